/* Sizes shared by the kernel headers and the compiled drivers (_core.pyx): tile and task
 * geometry, scratch per thread, the padded query of q8 scoring.  Included by _kernels.h,
 * _prefill.h, _mla.h and _dispatch.h, so _core reads them without compiling any kernel. */
#ifndef KVCACHE_SIZES_H
#define KVCACHE_SIZES_H

/* the decode value pass (_kernels.h) */
#define KVC_VROWS 256 /* rows of one task at most: the chunk size of _core.pyx */

/* Per-thread scratch floats a task needs: the int8 and 4-bit value passes' KVC_VROWS x 8
 * weights (four or eight queries per pass: _kernels.h's KVC_VQ) and KVC_VROWS masks, and the
 * 4-bit pass's parameters of KVC_VROWS rows (two per 16 channels), or the 4-bit or int8 K
 * scorer's (below), whichever is most; the other passes read the rows in place. */
#define KVC_SCRATCH_FLOATS_V(hd) (9 * KVC_VROWS + KVC_VROWS * 2 * (((hd) + 15) / 16))
#define KVC_MAX2_(a, b) ((a) > (b) ? (a) : (b))
#define KVC_SCRATCH_FLOATS(hd) KVC_MAX2_(KVC_MAX2_(KVC_SCRATCH_FLOATS_V(hd), KVC_K4_SCRATCH(hd)), \
                                         KVC_K8_SCRATCH(hd))

/* Floats of scratch the 4-bit K scorer needs (_kernels.h, kvc_k4_raw): a block's parameters
 * (2 hd), then the scales, biases, scores (16 rows each) and int8 codes of KVC_K4_QC (4)
 * folded queries.  KVC_SCRATCH_FLOATS(hd) covers it. */
#define KVC_K4_SCRATCH(hd) (3 * (hd) + 4 * ((KVC_I8_GROUPS(hd, 16) + 7) / 8 * 8) + 72)

/* Floats of scratch the int8 K scorer of a decode task needs (_kernels.h,
 * kvc_task_scores_i8): 64 rows packed (four channels per byte lane: 64 x ceil(hd / 4) floats),
 * their scales (64 per group of 16 channels at most) and six queries' scores of 32 rows.
 * KVC_SCRATCH_FLOATS(hd) covers it. */
#define KVC_K8_SCRATCH(hd) (64 * (((hd) + 3) / 4) + 64 * (((hd) + 15) / 16) + 6 * 32)

/* the K kinds a kvc_store's quant_k holds: float32, int8, 4-bit */
#define KVC_K_F32 0
#define KVC_K_Q8 1
#define KVC_K_Q4 2

/* the V kinds a kvc_store's quant_v holds: float32, int8, 4-bit */
#define KVC_V_F32 0
#define KVC_V_Q8 1
#define KVC_V_Q4 2

/* q8 scoring (_kernels.h) */
#define KVC_I8_PAD(hd) (((hd) + 31) / 32 * 32) /* int8 codes per quantised query */
#define KVC_I8_GROUPS(hd, group) (((hd) + (group) - 1) / (group))

/* the prompt kernel (_prefill.h) */
#define KVC_PF_K4_TMP(hd) (10 * (hd)) /* 4-bit K tile loader: a block's parameters, 8 rows */
#define KVC_PF_TILE 64 /* rows per key/value tile, at absolute row multiples */
#define KVC_PF_QR 6    /* queries per register block (scores and values) */
#define KVC_PF_PAD16(hd) (((hd) + 15) / 16 * 16)
/* Floats of the packed K tile: 64 x hd floats, or the int8 tile's scales (64 per K group)
 * and codes (64 x hd rounded up to 4 bytes), which this bounds for every hd. */
#define KVC_PF_KP_FLOATS(hd) (KVC_PF_TILE * (hd) + 128)

/* Per-thread scratch floats of a task with up to nq queries:
 * the packed K tile (KVC_PF_KP_FLOATS), the packed V tile (64 x hd rounded up to 16), scores and
 * probabilities (nq x 64), the partial outputs (nq x padded hd), alpha (nq), and slack. */
#define KVC_PF_SCRATCH_FLOATS(hd, nq) \
    (KVC_PF_KP_FLOATS(hd) + KVC_PF_TILE * KVC_PF_PAD16(hd) + (nq) * KVC_PF_TILE \
     + (nq) * KVC_PF_PAD16(hd) + (nq) + 64 + KVC_PF_K4_TMP(hd))

/* One-pass importance (kvc_pf_task with pbuf): per task, the probabilities of its nq queries
 * over the ntiles tiles its visible rows meet (ntiles x nq x 64) and the running max each tile
 * left (ntiles x nq).  The planner (_core.pyx, _pf_piece) cuts a block of positions whose
 * buffer would exceed KVC_PF_IMP_BUDGET floats (16 MiB) in pieces that fit (a piece of one
 * position is kept even over it). */
#define KVC_PF_PBUF_FLOATS(ntiles, nq) ((ntiles) * (nq) * (KVC_PF_TILE + 1))
#define KVC_PF_IMP_BUDGET 4194304 /* floats: 16 MiB */
/* rows per chunk when the driver adds the tasks' column sums (one thread per chunk) */
#define KVC_PF_IMP_ROWS 256

/* MLA decode (_mla.h) */
#define KVC_MLA_BLOCK 64          /* rows per online-softmax block (~147 KiB at r=512) */
#define KVC_MLA_CHUNK 64          /* elements per partial sum of a score */

#endif
