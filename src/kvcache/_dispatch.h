/* The kernel entry points as a table per compiled body, and the body chosen per family.
 *
 * The kernel sources (every family, written once on the vector layer _vec.h) are compiled
 * once per body, each time into a translation unit of its own that is built for that body's
 * target and nothing else:
 *   _body_portable.c  plain C for the baseline of the target (always built)
 *   _body_avx2.c      x86-64: AVX2 + FMA + F16C
 *   _body_avxvnni.c   x86-64: AVX2 + FMA + F16C + AVX-VNNI (q8 scoring with VEX vpdpbusd)
 *   _body_avx512.c    x86-64: AVX-512 F/BW/DQ/VL + AVX512-VNNI (16-float MLA, EVEX vpdpbusd)
 *   _body_neon.c      aarch64: Advanced SIMD
 *   _body_neondot.c   aarch64: Advanced SIMD + the dot-product extension (sdot)
 * A unit for another CPU family holds no code and its table pointer is NULL.  Each table names
 * the body it runs; _core.pyx (compiled for the baseline) includes only this header and calls
 * through the table of the body chosen for a family (kvc_ops_of), read once per kernel call.
 * An entry takes the descriptors below and its task's range (five arguments at most) and runs
 * its unit's own body: no entry takes a body argument.
 *
 * Families (kvcache/_dispatch.py holds the bodies each one has and the rule that chooses):
 *   KVC_FAM_F32      decode attention over float32 rows, softmax, the O(1) step
 *   KVC_FAM_Q8       q8 scoring (int8 keys) of decode, and the row and query quantisers
 *   KVC_FAM_PREFILL  prompt attention (attend_blocked) and its one-pass importance
 *   KVC_FAM_MLA      MLA decode
 */
#ifndef KVCACHE_DISPATCH_H
#define KVCACHE_DISPATCH_H

#include <stddef.h>
#include <stdint.h>

#include "_sizes.h"
#include "_isa.h"

#define KVC_FAM_F32 0
#define KVC_FAM_Q8 1
#define KVC_FAM_PREFILL 2
#define KVC_FAM_MLA 3
#define KVC_N_FAMILIES 4

/* ---------------------------------------------------------------------------------------
 * What crosses from _core into a unit: one storage descriptor, one call descriptor and the
 * range of the task.  _core fills them once per call, from kvcache._entry's descriptors after
 * kvcache._entry's checks; the entries (_entry.h) unpack them into the kernels' own
 * arguments.  Arrays are C-contiguous; a pointer is NULL where its array is empty or unused.
 * ------------------------------------------------------------------------------------- */

/* One layer's stored rows, head-major: row p of KV group g in a store of capacity `cap` rows
 * of width `w` is at base + (g * cap + p) * w.  K is float32 (kf) or int8 (kq codes and ks
 * scales, ks_stride per row, one per k_group channels); V is float32 (vf), int8 (vq codes, vs
 * one scale per row, vcol the frozen column field, nkv x hd) or 4-bit (vc4 codes, hd / 2
 * bytes per row, and vp, 2 * ceil(hd / 16) float16 parameters per row: _q4.h); quant_v is
 * KVC_V_F32, KVC_V_Q8 or KVC_V_Q4, quant_k KVC_K_F32, KVC_K_Q8 or KVC_K_Q4. */
typedef struct kvc_store {
    const float *kf;
    const int8_t *kq;
    const float *ks;
    const float *vf;
    const int8_t *vq;
    const float *vs;
    const uint8_t *vc4;
    const uint16_t *vp;
    const uint8_t *kc4;             /* 4-bit K (quant_k KVC_K_Q4, docs/kv4.md): codes, hd / 2 */
    const uint16_t *kp;             /* bytes per row; per block of 32 rows 2 x hd float16; */
    const float *kr;                /* the float32 ring, KVC_K4_RING rows per group */
    const ptrdiff_t *head_len;      /* rows per group (4-bit K: its closed blocks) */
    const float *vcol;
    ptrdiff_t kcap, vcap;           /* rows per group of the K and V stores */
    ptrdiff_t ks_stride, vs_stride; /* scales per row (0 for a float32 component) */
    ptrdiff_t hd;                   /* head_dim */
    ptrdiff_t k_group;              /* channels per K scale: 16 or 32 */
    int quant_k, quant_v;
} kvc_store;

/* The queries of one attention call and where its results go.  Query j (row j of q) belongs
 * to one KV group and sees that group's rows [qf[j], qe[j]). */
typedef struct kvc_call {
    const float *q;                 /* nq x hd */
    const ptrdiff_t *qf, *qe;
    const int8_t *qi;               /* int8 K: the queries' codes (KVC_I8_PAD(hd) each), */
    const float *qsc;               /* group scales and code sums (KVC_I8_GROUPS(hd, k_group) */
    const int32_t *qsum;            /* each); NULL for float32 K */
    float scale, softcap;
    float *probs;                   /* nq x L: decode probabilities (q8_rows: raw scores) */
    ptrdiff_t L;
    float *out;                     /* nq x hd: prompt outputs */
    float *qm, *ql;                 /* nq each: a prompt query's final running max and sum */
} kvc_call;

/* One task of an attention call: the queries [j0, j1), all of KV group g, over the rows
 * [p0, p1) of that group (decode tasks, q8 rows, the prompt's importance tiles; a prompt task
 * walks its queries' own visible rows and leaves p0 = p1 = 0). */
typedef struct kvc_task {
    ptrdiff_t g, j0, j1, p0, p1;
} kvc_task;

/* The O(1) state of a sealed layer and one decode step over it (docs/o1.md): group-shared
 * arrays indexed by KV group g, per-head arrays by query head h, which is in group h / hpk. */
typedef struct kvc_o1 {
    ptrdiff_t hpk, m, d, dv;        /* heads per group, landmarks, key and value dims */
    float scale;
    int fm;                         /* the FM rectifier (else aggregate) */
    const float *q_tilde;           /* H x m x d   query landmarks */
    const float *k_tilde;           /* G x m x d   key landmarks */
    const float *mu;                /* H x m x m   mixing matrices */
    float *t_hat, *z_hat, *m_max;   /* H x m x dv, H x m, H x m   far accumulators */
    const float *sink_k, *sink_v;   /* G x ns x d, G x ns x dv */
    ptrdiff_t ns;
    float *win_k, *win_v;           /* G x cap x d, G x cap x dv   the window ring */
    ptrdiff_t cap;
    /* the step */
    const float *q;                 /* H x d */
    const float *k_new, *v_new;     /* G x d, G x dv */
    ptrdiff_t win_len, slot;        /* ring rows read; the slot of the new row */
    int absorb, use_far;            /* absorb the row leaving the ring; read the far field */
    float *out;                     /* H x dv */
    float *scr;                     /* H x scr_stride scratch */
    ptrdiff_t scr_stride;
} kvc_o1;

/* One absorbed MLA call and the scratch of its current group of positions, which starts at
 * position i0: position i of n attends the rows [0, T - n + i + 1). */
typedef struct kvc_mla {
    const float *qn, *qr;           /* n x H x dn, n x H x dr   query parts (no RoPE, RoPE) */
    const float *lat, *kr;          /* T x r latents, T x dr RoPE keys */
    const float *wuk, *wuv;         /* H x dn x r, H x dv x r   the two halves of kv_b_proj */
    ptrdiff_t n, T, H, Hp, dn, dr, r, dv;
    float scale;
    float *out;                     /* n x H x dv */
    ptrdiff_t i0, R, NT;            /* the group's first position; rows per task; tasks
                                       per position */
    float *qT;                      /* per position of the group: (r + dr) x Hp folded query */
    float *qa;                      /* per (position, head): r */
    float *acc;                     /* per task: H x r partial latent sums */
    float *m, *l;                   /* per task: Hp running maxima and sums */
    float *c;                       /* per (position, head): r merged latent */
} kvc_mla;

/* The entry points of one compiled body (defined in _entry.h). */
typedef struct kvc_ops {
    const char *name;   /* the body this unit is: "portable", "avx2", ... (_dispatch.py) */
    /* decode: scores of a task's queries over its rows into c->probs (float32 keys, int8
     * keys), their weighted values into acc ((j1 - j0) x hd); raw q8 scores (no scale) */
    void (*task_scores)(const kvc_store *s, const kvc_call *c, const kvc_task *t);
    void (*task_scores_i8)(const kvc_store *s, const kvc_call *c, const kvc_task *t,
                           float *scratch);
    void (*task_scores_k4)(const kvc_store *s, const kvc_call *c, const kvc_task *t,
                           float *scratch);
    void (*task_values)(const kvc_store *s, const kvc_call *c, const kvc_task *t, float *acc,
                        float *scratch);
    void (*q8_rows)(const kvc_store *s, const kvc_call *c, const kvc_task *t);
    void (*axpy)(float *y, float w, const float *x, ptrdiff_t n);
    void (*softmax)(float *s, ptrdiff_t n);
    /* quantisation (plain C in every unit) */
    void (*quant_row)(const float *x, const float *col, ptrdiff_t hd, ptrdiff_t group,
                      int8_t *q, float *s);
    void (*quant_query)(const float *x, ptrdiff_t hd, ptrdiff_t group, int8_t *qi, float *sq,
                        int32_t *qsum);
    /* prompt attention: a task's outputs, running maxima and sums (with pbuf, its one-pass
     * importance into colsum, indexed by row) */
    void (*pf_task)(const kvc_store *s, const kvc_call *c, const kvc_task *t, float *scratch,
                    float *pbuf, float *colsum);
    /* O(1): absorb one key/value row into head h's far field; head h's part of a step */
    void (*o1_absorb)(const kvc_o1 *o, ptrdiff_t h, const float *k, const float *v,
                      float *scr);
    void (*o1_step_head)(const kvc_o1 *o, ptrdiff_t h);
    /* MLA decode, over the current group of positions: fold the query of (position i, head
     * h), task = i * H + h; one task of rows, task = i * NT + c; merge (i, h) */
    void (*mla_fold)(const kvc_mla *a, ptrdiff_t task);
    void (*mla_task)(const kvc_mla *a, ptrdiff_t task, float *S);
    void (*mla_merge)(const kvc_mla *a, ptrdiff_t task);
    const char *(*mla_path)(void);
    /* the benchmark's machine probe */
    float (*fma_probe)(long iters, float x);
    /* the body this unit is (KVC_ISA_*) */
    int body;
} kvc_ops;

extern const kvc_ops kvc_ops_portable;
/* the other units' tables, or NULL where a unit was not built (another CPU family,
 * KVC_NO_SIMD, a compiler without the target) */
extern const kvc_ops *const kvc_ops_avx2;
extern const kvc_ops *const kvc_ops_avxvnni;
extern const kvc_ops *const kvc_ops_avx512;
extern const kvc_ops *const kvc_ops_neon;
extern const kvc_ops *const kvc_ops_neondot;

/* The table of body `body`, or NULL where this build does not hold it. */
static inline const kvc_ops *kvc_ops_body(int body)
{
    switch (body) {
    case KVC_ISA_PORTABLE: return &kvc_ops_portable;
    case KVC_ISA_AVX2: return kvc_ops_avx2;
    case KVC_ISA_AVXVNNI: return kvc_ops_avxvnni;
    case KVC_ISA_AVX512: return kvc_ops_avx512;
    case KVC_ISA_NEON: return kvc_ops_neon;
    case KVC_ISA_NEONDOT: return kvc_ops_neondot;
    default: return NULL;
    }
}

/* The table that runs body `body`: its own where built (the chooser only picks built bodies),
 * the portable one otherwise. */
static inline const kvc_ops *kvc_ops_of(int body)
{
    const kvc_ops *t = kvc_ops_body(body);
    return t ? t : &kvc_ops_portable;
}

#endif
