/* The kernel entry points as a table per compiled body, and the body chosen per family.
 *
 * The kernel sources (every family, written once on the vector layer _vec.h) are compiled
 * once per body, each time into a translation unit of its own that is built for that body's
 * target and nothing else:
 *   _body_portable.c  plain C for the baseline of the target (always built)
 *   _body_avx2.c      x86-64: AVX2 + FMA
 *   _body_avxvnni.c   x86-64: AVX2 + FMA + AVX-VNNI (q8 scoring with VEX vpdpbusd)
 *   _body_avx512.c    x86-64: AVX-512 F/BW/DQ/VL + AVX512-VNNI (16-float MLA, EVEX vpdpbusd)
 *   _body_neon.c      aarch64: Advanced SIMD
 *   _body_neondot.c   aarch64: Advanced SIMD + the dot-product extension (sdot)
 * A unit for another CPU family holds no code and its table pointer is NULL.  Each table names
 * the body it runs; _core.pyx (compiled for the baseline) includes only this header and calls
 * through the table of the body chosen for a family (kvc_ops_of), read once per kernel call.
 * An `isa` argument that an entry still takes is not read (the unit's own body runs).
 *
 * Families (kvcache/_dispatch.py holds the bodies each one has and the rule that chooses):
 *   KVC_FAM_F32      decode attention over float32 rows, softmax, the O(1) step
 *   KVC_FAM_Q8       q8 scoring (int8 keys) of decode, and the row and query quantisers
 *   KVC_FAM_PREFILL  prompt attention (attend_blocked) and its importance pass
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

#ifndef KVC_MLA_TASK_FN
#define KVC_MLA_TASK_FN
typedef void (*kvc_mla_task_fn)(const float *qT, ptrdiff_t H, ptrdiff_t Hp, const float *lat,
                                const float *kr, ptrdiff_t r, ptrdiff_t dr, ptrdiff_t p0,
                                ptrdiff_t p1, ptrdiff_t pf_end, float scale, float *acc,
                                float *m, float *l, float *S);
#endif

typedef struct kvc_ops {
    const char *name;   /* the body this unit is: "portable", "avx2", ... (_dispatch.py) */
    /* decode, float32 rows */
    void (*task_scores)(const float *q, ptrdiff_t nq, const ptrdiff_t *qf, const ptrdiff_t *qe,
                        const float *kf, ptrdiff_t p0, ptrdiff_t p1, ptrdiff_t hd, float scale,
                        float softcap, float *probs, ptrdiff_t L);
    void (*task_values)(const float *probs, ptrdiff_t L, ptrdiff_t nq, const ptrdiff_t *qf,
                        const ptrdiff_t *qe, const float *vf, const int8_t *vq, const float *vs,
                        int quant_v, ptrdiff_t p0, ptrdiff_t p1, ptrdiff_t hd, float *acc,
                        float *scratch);
    void (*axpy)(float *y, float w, const float *x, ptrdiff_t n);
    void (*softmax)(float *s, ptrdiff_t n);
    /* quantisation (plain C in every unit) */
    void (*quant_row)(const float *x, const float *col, ptrdiff_t hd, ptrdiff_t group,
                      int8_t *q, float *s);
    void (*quant_query)(const float *x, ptrdiff_t hd, ptrdiff_t group, int8_t *qi, float *sq,
                        int32_t *qsum);
    /* O(1) step */
    void (*o1_absorb)(const float *qt, const float *k, const float *v, ptrdiff_t m, ptrdiff_t d,
                      ptrdiff_t dv, float scale, float *t_hat, float *z_hat, float *m_max,
                      float *l);
    void (*o1_head)(const float *q, ptrdiff_t d, ptrdiff_t dv, float scale, const float *sink_k,
                    const float *sink_v, ptrdiff_t ns, const float *win_k, const float *win_v,
                    ptrdiff_t nw, ptrdiff_t slot, const float *k_new, const float *v_new,
                    const float *k_tilde, const float *mu, const float *t_hat,
                    const float *z_hat, const float *m_max, ptrdiff_t m, int use_far, int fm,
                    float *out, float *scr);
    /* q8 scoring */
    void (*task_scores_i8)(int isa, ptrdiff_t group, const int8_t *qi, const float *sq,
                           const int32_t *qsum, ptrdiff_t nq, const ptrdiff_t *qf,
                           const ptrdiff_t *qe, const int8_t *kq, const float *ks,
                           ptrdiff_t ks_stride, ptrdiff_t p0, ptrdiff_t p1, ptrdiff_t hd,
                           float scale, float softcap, float *probs, ptrdiff_t L);
    void (*i8_rows)(int isa, ptrdiff_t group, const int8_t *qi, const float *sq,
                    const int32_t *qsum, const int8_t *k, const float *ks, ptrdiff_t ks_stride,
                    ptrdiff_t hd, ptrdiff_t n, float *out);
    /* prompt attention */
    void (*pf_task)(const float *q, ptrdiff_t nq, const ptrdiff_t *qf, const ptrdiff_t *qe,
                    const float *kf, const int8_t *kq, const float *ks, ptrdiff_t ks_stride,
                    int quant_k, const float *vf, const int8_t *vq, const float *vs,
                    ptrdiff_t vs_stride, int quant_v, const float *vcol, ptrdiff_t hd,
                    float scale, float softcap, float *out, float *qm, float *ql,
                    float *scratch, int isa, ptrdiff_t group, const int8_t *qi,
                    const float *qsc, const int32_t *qsum);
    void (*pf_imp_group)(const float *q, ptrdiff_t nq, const ptrdiff_t *qf, const ptrdiff_t *qe,
                         const float *qm, const float *ql, const float *kf, const int8_t *kq,
                         const float *ks, ptrdiff_t ks_stride, int quant_k, ptrdiff_t hd,
                         float scale, float softcap, ptrdiff_t t0, ptrdiff_t t1, float *colsum,
                         float *scratch, int isa, ptrdiff_t group, const int8_t *qi,
                         const float *qsc, const int32_t *qsum);
    /* MLA decode */
    void (*mla_fold)(const float *qn, const float *qr, const float *wuk, ptrdiff_t dn,
                     ptrdiff_t r, ptrdiff_t dr, ptrdiff_t h, ptrdiff_t Hp, float *qa, float *qT);
    kvc_mla_task_fn (*mla_task_for)(int body);
    const char *(*mla_path_for)(int body);
    void (*mla_merge_head)(const float *acc, ptrdiff_t acc_stride, const float *m,
                           const float *l, ptrdiff_t ml_stride, ptrdiff_t nt, const float *wuv,
                           ptrdiff_t r, ptrdiff_t dv, float *c, float *out);
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
