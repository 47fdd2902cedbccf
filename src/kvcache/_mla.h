/* Absorbed Multi-head Latent Attention (DeepSeek-V2 MLA) decode: the inner loops behind
 * _core.mla_attend, written once on the vector layer (_vec.h).  No -ffast-math: every body
 * computes the bits of the portable build (docs/numerics.md).
 *
 * One unit, one body.  The unit's target (_vec.h) fixes the width of a task's vectors:
 *   16 floats (kvc_f16)  a unit compiled for AVX-512 (KVC_VEC_AVX512: a real __m512), or any
 *                        unit built with KVC_EMULATE_512 (tests only: kvc_f16 is then a pair of
 *                        8-lane vectors, so the very code of the 16-float body runs, and is
 *                        compared bit for bit, on a machine without AVX-512);
 *   8 floats (kvc_f8)    every other target: AVX2, NEON and the portable one, whose struct
 *                        lanes run the same code (there is no separate scalar twin).
 * kvc_mla_task is this unit's task (a kvc_mla_task_fn) and KVC_MLA_PATH names it: "avx512"
 * for the 16-float body, else KVC_VEC_NAME ("avx2", "neon", "portable").  Lane j of a vector
 * is one head (scores) or one latent element (sums) and carries its own chain of operations,
 * so the width and the target change how many chains run side by side, never the order inside
 * one.  The 16-float body hands a remainder of 8 heads or 8 elements to the 8-float code; what
 * is left after the vectors (fewer than 8 heads or elements) runs through fmaf and kvc_expf,
 * the scalar twins of the vector operations.
 *
 * The vector code (score tiles, latent-sum tiles, the exp of a row of scores) is written once,
 * in the part of this file compiled with KVC_MLA_TW set: the file includes itself once per
 * width the unit needs (8, and 16 in a 16-float unit), and the functions of one width carry it
 * in their names (kvc_mla_scores8, kvc_mla_scores16).  The task around them is written once,
 * for the unit's width KVC_MLA_W.  tests/c/mla_paths.c builds each body as its own program and
 * compares the bits; tests/c/portable_twin.c runs the task too.
 *
 * Geometry: H query heads; the latent rank r and the shared RoPE key width dr; W_UK is
 * (H, dn, r) and W_UV (H, dv, r).  Cache rows: lat (T x r), kr (T x dr), both row-major.
 * The absorbed query of one position is kept TRANSPOSED, qT[(r + dr) x Hp] (Hp = H rounded up
 * to a multiple of 8, padding columns zero), so that one score is one lane of a vector over
 * heads: every latent element is loaded once and multiplied into 8 or 16 heads at a time.
 *
 * Summation orders (fixed, independent of thread count and of the body):
 *   fold      qa[h][x] = sum over k ascending of qn[h][k] * wuk[h][k][x]: one fma per k
 *   scores    the latent part cut into chunks of KVC_MLA_CHUNK elements from x = 0, then
 *             the RoPE part likewise; each chunk c_j = one fma per element, x ascending, from
 *             0; s[t][h] = ((c_0 + c_1) + c_2 ...) * scale (chunks in order, latent first)
 *   task      a position's visible rows are cut into tasks of `task_rows` rows from row 0
 *             (a function of T only); a task walks its rows in blocks of KVC_MLA_BLOCK and
 *             keeps, per head, a running max m, sum l and latent accumulator acc[r]:
 *               b = max of the block's scores (NaN ignored); m' = max(m, b)
 *               if m' > m and m > -inf: a = exp(m - m'), l *= a, acc *= a
 *               p = exp(s - m') (0 when s = -inf; NaN scores stay NaN); l += p, rows
 *               ascending
 *               acc[x] = fma(p, lat[t][x], acc[x]), rows ascending
 *   merge     per head over the tasks of its position in task order, skipping tasks with
 *             m = -inf and l = 0: M = max m_c; w = exp(m_c - M); L = fma(l_c, w, L);
 *             c[x] = fma(w, acc_c[x], c[x]); then c[x] /= L when L > 0, else NaN (all
 *             scores -inf, or a NaN: the IEEE softmax's answer)
 *   unfold    out[h][j] = kvc_dot_f32(wuv[h][j], c[h], r)  (the 8-lane order of _kernels.h)
 * exp is kvc_expf / kvc_f8_exp / kvc_f16_exp (identical bits).
 */
#ifndef KVC_MLA_TW
#ifndef KVCACHE_MLA_H
#define KVCACHE_MLA_H

#include "_kernels.h"

/* This unit's width: 16 floats where kvc_f16 is a real __m512, or emulated for the tests. */
#if KVC_VEC_AVX512 || defined(KVC_EMULATE_512)
#define KVC_MLA_W 16
#define KVC_MLA_PATH "avx512"
#else
#define KVC_MLA_W 8
#define KVC_MLA_PATH KVC_VEC_NAME
#endif
/* whether this unit's body is the 16-float one (_body.h reads it for its table of bodies) */
#define KVC_MLA_HAS512 (KVC_MLA_W == 16)

/* Absorbed query of one (position, head): qa = W_UK[h]^T qn, written into column h of qT,
 * followed by the head's RoPE query qr (dr floats) in rows r .. r + dr - 1. */
static void kvc_mla_fold(const float *restrict qn, const float *restrict qr,
                         const float *restrict wuk, ptrdiff_t dn, ptrdiff_t r, ptrdiff_t dr,
                         ptrdiff_t h, ptrdiff_t Hp, float *restrict qa, float *restrict qT)
{
    ptrdiff_t k = 0, x;
    memset(qa, 0, (size_t)r * sizeof(float));
    for (; k + 4 <= dn; k += 4)
        kvc_axpy4_f32(qa, qn + k, wuk + k * r, wuk + (k + 1) * r, wuk + (k + 2) * r,
                      wuk + (k + 3) * r, r);
    for (; k < dn; ++k)
        kvc_axpy_f32(qa, qn[k], wuk + k * r, r);
    for (x = 0; x < r; ++x)
        qT[x * Hp + h] = qa[x];
    for (x = 0; x < dr; ++x)
        qT[(r + x) * Hp + h] = qr[x];
}

/* ---- prefetch of the next block ---------------------------------------------------------
 * While a block is scored and summed, the next block's rows (two contiguous byte ranges: its
 * latents and its RoPE keys) are asked for in L2, a few cache lines at each score chunk and
 * each latent-sum tile, so that the stream from memory is spread evenly over the block's
 * arithmetic instead of arriving in bursts. */
#define KVC_MLA_PF_STRIDE 64       /* bytes between two prefetches: every cache line */
#define KVC_MLA_PF_HINT 2          /* __builtin_prefetch locality: L2 and below */
typedef struct {
    const char *p, *e, *p2, *e2;   /* the two ranges still to ask for */
    ptrdiff_t per;                 /* lines per step */
} kvc_mla_pf;

KVC_INLINE void kvc_mla_pf_step(kvc_mla_pf *f)
{
    ptrdiff_t k;
    for (k = 0; k < f->per; ++k) {
        if (f->p < f->e) {
            __builtin_prefetch(f->p, 0, KVC_MLA_PF_HINT);
            f->p += KVC_MLA_PF_STRIDE;
        } else if (f->p2 < f->e2) {
            __builtin_prefetch(f->p2, 0, KVC_MLA_PF_HINT);
            f->p2 += KVC_MLA_PF_STRIDE;
        } else {
            break;
        }
    }
}

/* The next block: rows [0, nx) of (lat, kr); the steps of this block (nb rows, H heads, score
 * tiles of `rows` rows over head-vectors of w floats) share its lines. */
KVC_INLINE void kvc_mla_pf_start(kvc_mla_pf *f, const float *lat, const float *kr,
                                 ptrdiff_t nx, ptrdiff_t H, ptrdiff_t Hp, ptrdiff_t r,
                                 ptrdiff_t dr, ptrdiff_t nb, ptrdiff_t rows, ptrdiff_t w)
{
    ptrdiff_t lines, steps;
    if (nx <= 0) {
        f->p = f->e = f->p2 = f->e2 = NULL;
        f->per = 0;
        return;
    }
    f->p = (const char *)((uintptr_t)lat & ~(uintptr_t)63);
    f->e = (const char *)(lat + nx * r);
    f->p2 = (const char *)((uintptr_t)kr & ~(uintptr_t)63);
    f->e2 = (const char *)(kr + nx * dr);
    lines = (f->e - f->p + KVC_MLA_PF_STRIDE - 1) / KVC_MLA_PF_STRIDE
            + (f->e2 - f->p2 + KVC_MLA_PF_STRIDE - 1) / KVC_MLA_PF_STRIDE;
    steps = ((nb + rows - 1) / rows + 3) * ((Hp + 2 * w - 1) / (2 * w))
            * ((r + KVC_MLA_CHUNK - 1) / KVC_MLA_CHUNK + (dr + KVC_MLA_CHUNK - 1) / KVC_MLA_CHUNK)
            + ((r + 2 * w - 1) / (2 * w)) * ((H + 5) / 6);
    f->per = (lines + steps - 1) / steps;
}

/* Whatever the steps left. */
KVC_INLINE void kvc_mla_pf_finish(kvc_mla_pf *f)
{
    f->per = PTRDIFF_MAX;
    kvc_mla_pf_step(f);
}

/* Rows per score tile, by vector width (measured on x86).  8 floats: 5 rows x 2 head-vectors =
 * 10 accumulators, enough to cover the FMA latency, and 16 ymm registers leave room for the
 * two query vectors and the broadcast (6 rows measured slower: the compiler spills).  16
 * floats: 12 rows of one zmm head-vector (16 heads), or 12 x 2 = 24 of the 32 zmm registers. */
#ifndef KVC_MLA_TILE_ROWS8
#define KVC_MLA_TILE_ROWS8 5
#endif
#ifndef KVC_MLA_TILE_ROWS16
#define KVC_MLA_TILE_ROWS16 12
#endif
#define KVC_MLA_TILE_MAX 12       /* rows of a score tile at most: KVC_MLA_EACH's count */
#define KVC_MLA_EACH(M) M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7) M(8) M(9) M(10) M(11)
#define KVC_MLA_EACH6(M) M(0) M(1) M(2) M(3) M(4) M(5)

/* Names by width: KVC_MLA_CAT(kvc_f, 16, _fma) is kvc_f16_fma.  In the part written for a
 * width (KVC_MLA_TW): its vector type, an operation on it, a function of that width and its
 * rows per score tile. */
#define KVC_MLA_CAT_(a, b, c) a##b##c
#define KVC_MLA_CAT(a, b, c) KVC_MLA_CAT_(a, b, c)
#define KVC_MLA_V KVC_MLA_CAT(kvc_f, KVC_MLA_TW, )
#define KVC_MLA_OP(op) KVC_MLA_CAT(kvc_f, KVC_MLA_TW, _##op)
#define KVC_MLA_FN(name) KVC_MLA_CAT(name, KVC_MLA_TW, )
#define KVC_MLA_TROWS KVC_MLA_CAT(KVC_MLA_TILE_ROWS, KVC_MLA_TW, )
/* outside it: a function of this unit's width */
#define KVC_MLA_UFN(name) KVC_MLA_CAT(name, KVC_MLA_W, )

/* The latent sums of the last elements [x0, r), which no vector covers: per head and element
 * one fmaf per row, rows ascending (the lanes' chain). */
static inline void kvc_mla_acc_tail(const float *restrict P, ptrdiff_t Hp, ptrdiff_t H,
                                    const float *restrict lat, ptrdiff_t r, ptrdiff_t x0,
                                    ptrdiff_t nb, float *restrict acc)
{
    ptrdiff_t h, t, x;
    for (h = 0; h < H; ++h)
        for (x = x0; x < r; ++x) {
            float a = acc[h * r + x];
            for (t = 0; t < nb; ++t)
                a = fmaf(P[t * Hp + h], lat[t * r + x], a);
            acc[h * r + x] = a;
        }
}

/* the 8-float code (every unit: the 16-float body's remainders run it too) */
#define KVC_MLA_TW 8
#include "_mla.h"
#undef KVC_MLA_TW
#if KVC_MLA_W == 16
/* the 16-float code */
#define KVC_MLA_TW 16
#include "_mla.h"
#undef KVC_MLA_TW
#endif

/* ---- the task ---------------------------------------------------------------------------- */

#ifndef KVC_MLA_TASK_FN
#define KVC_MLA_TASK_FN
typedef void (*kvc_mla_task_fn)(const float *qT, ptrdiff_t H, ptrdiff_t Hp, const float *lat,
                                const float *kr, ptrdiff_t r, ptrdiff_t dr, ptrdiff_t p0,
                                ptrdiff_t p1, ptrdiff_t pf_end, float scale, float *acc,
                                float *m, float *l, float *S);
#endif

/* One task: rows [p0, p1) of one position, on this unit's width.  acc (H x r), m and l (Hp
 * each) are the task's partial state; S is KVC_MLA_BLOCK x Hp scratch.  Rows up to pf_end
 * (>= p1) may be prefetched, never read.
 * A function of its own, not inlined into its entry point (kvc_entry_mla_task, _entry.h):
 * there, with the entry's descriptor arithmetic live around it, GCC ran out of general
 * registers in the score tiles and kept their loop counter, bound and stride on the stack
 * (25 instructions instead of 23 per element of the hottest loop, AVX2). */
KVC_NOINLINE void kvc_mla_task(const float *restrict qT, ptrdiff_t H, ptrdiff_t Hp,
                               const float *lat, const float *kr, ptrdiff_t r, ptrdiff_t dr,
                               ptrdiff_t p0, ptrdiff_t p1, ptrdiff_t pf_end, float scale,
                               float *restrict acc, float *restrict m, float *restrict l,
                               float *restrict S)
{
    ptrdiff_t b0, t, h, x;
    for (h = 0; h < Hp; ++h) {
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
    memset(acc, 0, (size_t)(H * r) * sizeof(float));
    for (b0 = p0; b0 < p1; b0 += KVC_MLA_BLOCK) {
        ptrdiff_t nb = p1 - b0 < KVC_MLA_BLOCK ? p1 - b0 : KVC_MLA_BLOCK;
        /* the next block; after the last one, the rows after p1 (up to pf_end), which the
         * same thread reads next when tasks are handed out in contiguous runs */
        ptrdiff_t nx = pf_end - b0 - nb < KVC_MLA_BLOCK ? pf_end - b0 - nb : KVC_MLA_BLOCK;
        kvc_mla_pf pf;
        kvc_mla_pf_start(&pf, lat + (b0 + nb) * r, kr + (b0 + nb) * dr, nx, H, Hp, r, dr, nb,
                         KVC_MLA_UFN(KVC_MLA_TILE_ROWS), KVC_MLA_W);
        KVC_MLA_UFN(kvc_mla_scores)(qT, Hp, lat + b0 * r, kr + b0 * dr, r, dr, nb, scale, S, &pf);
        for (h = 0; h < H; ++h) {
            float b = -INFINITY;
            for (t = 0; t < nb; ++t) {
                float v = S[t * Hp + h];
                b = v > b ? v : b;
            }
            float mn = b > m[h] ? b : m[h];
            if (mn > m[h] && m[h] > -INFINITY) {
                float a = kvc_expf(m[h] - mn);
                l[h] *= a;
                float *restrict ah = acc + h * r;
                for (x = 0; x < r; ++x)
                    ah[x] *= a;
            }
            m[h] = mn;
        }
        for (t = 0; t < nb; ++t)
            KVC_MLA_UFN(kvc_mla_exp_row)(S + t * Hp, m, l, H);
        KVC_MLA_UFN(kvc_mla_accumulate)(S, Hp, H, lat + b0 * r, r, nb, acc, &pf);
        kvc_mla_pf_finish(&pf);
    }
}

/* Merge the nt task partials of one head (strides: acc by acc_stride floats, m and l by
 * ml_stride) and apply W_UV: out[j] = W_UV[h][j] . c.  c: r floats of scratch. */
static void kvc_mla_merge_head(const float *acc, ptrdiff_t acc_stride, const float *m,
                               const float *l, ptrdiff_t ml_stride, ptrdiff_t nt,
                               const float *restrict wuv, ptrdiff_t r, ptrdiff_t dv,
                               float *restrict c, float *restrict out)
{
    ptrdiff_t k, x, j = 0;
    float M = -INFINITY, L = 0.0f;
    for (k = 0; k < nt; ++k) {
        float mk = m[k * ml_stride];
        M = mk > M ? mk : M;
    }
    memset(c, 0, (size_t)r * sizeof(float));
    for (k = 0; k < nt; ++k) {
        float mk = m[k * ml_stride];
        if (mk == -INFINITY && l[k * ml_stride] == 0.0f)
            continue;                 /* no rows, or every score -inf: contributes nothing */
        float w = kvc_expf(mk - M);
        L = fmaf(l[k * ml_stride], w, L);
        kvc_axpy_f32(c, w, acc + k * acc_stride, r);
    }
    if (L > 0.0f)
        for (x = 0; x < r; ++x)
            c[x] = c[x] / L;
    else                              /* every score -inf (0/0) or a NaN: as IEEE softmax does */
        for (x = 0; x < r; ++x)
            c[x] = NAN;
    for (; j + 4 <= dv; j += 4)
        kvc_dot4_f32(c, wuv + j * r, wuv + (j + 1) * r, wuv + (j + 2) * r, wuv + (j + 3) * r,
                     r, out + j);
    for (; j < dv; ++j)
        out[j] = kvc_dot_f32(c, wuv + j * r, r);
}

/* ---- entry points ------------------------------------------------------------------------ */


/* Machine probe for the benchmark: `iters` steps of 160 fused multiply-adds on 16-lane vectors,
 * the widest float vector of any body (one __m512 on AVX-512, whose 512-bit FMA rate is about
 * twice the 256-bit one on a core with two 512-bit units; two 8-lane halves elsewhere), so the
 * probe measures the rate a kernel written on kvc_f16 can reach.  The chains are independent
 * and as many as cover the FMA latency without leaving the registers: 10 of 16 lanes on
 * AVX-512's 32 registers, 5 (10 of 8 lanes) where there are 16.  Returns a value that depends
 * on every lane of every chain, so that nothing is optimised away (the portable target's lanes
 * are plain floats). */
#if KVC_VEC_AVX512
#define KVC_PROBE_CHAINS 10
#else
#define KVC_PROBE_CHAINS 5
#endif
static float kvc_fma_probe(long iters, float x)
{
    long i;
    int k, r;
    kvc_f16 a[KVC_PROBE_CHAINS], b = kvc_f16_set1(0.999999f), c = kvc_f16_set1(1e-7f), s;
    for (k = 0; k < KVC_PROBE_CHAINS; ++k)
        a[k] = kvc_f16_set1(x + (float)k);
    for (i = 0; i < iters; ++i)
        for (r = 0; r < 10 / KVC_PROBE_CHAINS; ++r)
            for (k = 0; k < KVC_PROBE_CHAINS; ++k)
                a[k] = kvc_f16_fma(a[k], b, c);
    s = a[0];
    for (k = 1; k < KVC_PROBE_CHAINS; ++k)
        s = kvc_f16_add(s, a[k]);
    return kvc_f16_fold(s);
}
#undef KVC_PROBE_CHAINS

#endif /* KVCACHE_MLA_H */

#else /* KVC_MLA_TW: the vector code of one width ------------------------------------------ */

/* One chunk (len <= KVC_MLA_CHUNK elements) of the scores of NR rows x NV head-vectors:
 * fresh accumulators, one fma per element in order, then S = c (first chunk) or S = S + c.
 * src points at element x0 of row 0 (rows ld floats apart), qc at row x0 of qT.  pf: the
 * prefetch stream (NULL: none), one step per chunk.  The accumulators are named variables,
 * not an array, so that they stay in registers. */
KVC_INLINE void KVC_MLA_FN(kvc_mla_score_chunk)(const float *restrict qc, ptrdiff_t Hp,
                                                const float *src, ptrdiff_t ld, ptrdiff_t len,
                                                int NR, int NV, float *S, int first,
                                                kvc_mla_pf *pf)
{
    ptrdiff_t x;
    KVC_MLA_V z = KVC_MLA_OP(zero)();
#define KVC_MLA_DECL(j) KVC_MLA_V c##j##_0 = z, c##j##_1 = z;
    KVC_MLA_EACH(KVC_MLA_DECL)
#undef KVC_MLA_DECL
    if (pf)
        kvc_mla_pf_step(pf);
    for (x = 0; x < len; ++x) {
        KVC_MLA_V q0 = KVC_MLA_OP(load)(qc + x * Hp);
        KVC_MLA_V q1 = NV > 1 ? KVC_MLA_OP(load)(qc + x * Hp + KVC_MLA_TW) : q0;
#define KVC_MLA_FMA(j) \
        if (NR > j) { \
            KVC_MLA_V b = KVC_MLA_OP(bcast)(src + j * ld + x); \
            c##j##_0 = KVC_MLA_OP(fma)(q0, b, c##j##_0); \
            if (NV > 1) \
                c##j##_1 = KVC_MLA_OP(fma)(q1, b, c##j##_1); \
        }
        KVC_MLA_EACH(KVC_MLA_FMA)
#undef KVC_MLA_FMA
    }
#define KVC_MLA_STORE(j) \
    if (NR > j) { \
        float *sp = S + j * Hp; \
        if (!first) { \
            c##j##_0 = KVC_MLA_OP(add)(KVC_MLA_OP(load)(sp), c##j##_0); \
            if (NV > 1) \
                c##j##_1 = KVC_MLA_OP(add)(KVC_MLA_OP(load)(sp + KVC_MLA_TW), c##j##_1); \
        } \
        KVC_MLA_OP(store)(sp, c##j##_0); \
        if (NV > 1) \
            KVC_MLA_OP(store)(sp + KVC_MLA_TW, c##j##_1); \
    }
    KVC_MLA_EACH(KVC_MLA_STORE)
#undef KVC_MLA_STORE
}

/* Scores of NR rows x NV head-vectors: the latent part in chunks, then the RoPE part in
 * chunks, then the scale. */
KVC_INLINE void KVC_MLA_FN(kvc_mla_score_tile)(const float *restrict qT, ptrdiff_t Hp,
                                               const float *lat, const float *kr, ptrdiff_t r,
                                               ptrdiff_t dr, int NR, int NV, float scale,
                                               float *S, kvc_mla_pf *pf)
{
    ptrdiff_t x0;
    int i, v;
    for (x0 = 0; x0 < r; x0 += KVC_MLA_CHUNK)
        KVC_MLA_FN(kvc_mla_score_chunk)(qT + x0 * Hp, Hp, lat + x0, r,
                                        r - x0 < KVC_MLA_CHUNK ? r - x0 : KVC_MLA_CHUNK, NR, NV,
                                        S, x0 == 0, pf);
    for (x0 = 0; x0 < dr; x0 += KVC_MLA_CHUNK)
        KVC_MLA_FN(kvc_mla_score_chunk)(qT + (r + x0) * Hp, Hp, kr + x0, dr,
                                        dr - x0 < KVC_MLA_CHUNK ? dr - x0 : KVC_MLA_CHUNK, NR,
                                        NV, S, 0, pf);
    KVC_MLA_V sv = KVC_MLA_OP(set1)(scale);
    for (i = 0; i < NR; ++i)
        for (v = 0; v < NV; ++v) {
            float *sp = S + i * Hp + KVC_MLA_TW * v;
            KVC_MLA_OP(store)(sp, KVC_MLA_OP(mul)(KVC_MLA_OP(load)(sp), sv));
        }
}

/* NR rows for every head: pairs of head-vectors, a single one, and in the 16-float code a
 * last 8 heads through the 8-float tile. */
KVC_INLINE void KVC_MLA_FN(kvc_mla_score_rows)(const float *restrict qT, ptrdiff_t Hp,
                                               const float *lat, const float *kr, ptrdiff_t r,
                                               ptrdiff_t dr, int NR, float scale, float *S,
                                               kvc_mla_pf *pf)
{
    ptrdiff_t v = 0;
    for (; v + 2 * KVC_MLA_TW <= Hp; v += 2 * KVC_MLA_TW)
        KVC_MLA_FN(kvc_mla_score_tile)(qT + v, Hp, lat, kr, r, dr, NR, 2, scale, S + v, pf);
    for (; v + KVC_MLA_TW <= Hp; v += KVC_MLA_TW)
        KVC_MLA_FN(kvc_mla_score_tile)(qT + v, Hp, lat, kr, r, dr, NR, 1, scale, S + v, pf);
#if KVC_MLA_TW == 16
    if (v < Hp)                       /* Hp is a multiple of 8 */
        kvc_mla_score_tile8(qT + v, Hp, lat, kr, r, dr, NR, 1, scale, S + v, pf);
#endif
}

/* Scores of nb rows for all heads, S[t * Hp + h]: tiles of KVC_MLA_TROWS rows, then 4, 2, 1. */
static inline void KVC_MLA_FN(kvc_mla_scores)(const float *restrict qT, ptrdiff_t Hp,
                                              const float *lat, const float *kr, ptrdiff_t r,
                                              ptrdiff_t dr, ptrdiff_t nb, float scale,
                                              float *restrict S, kvc_mla_pf *pf)
{
    ptrdiff_t t = 0;
#define KVC_MLA_ROWS(NR) { \
        KVC_MLA_FN(kvc_mla_score_rows)(qT, Hp, lat + t * r, kr + t * dr, r, dr, (NR), scale, \
                                       S + t * Hp, pf); \
        t += (NR); }
    while (t + KVC_MLA_TROWS <= nb)
        KVC_MLA_ROWS(KVC_MLA_TROWS)
    while (t + 4 <= nb)
        KVC_MLA_ROWS(4)
    if (t + 2 <= nb)
        KVC_MLA_ROWS(2)
    if (t < nb)
        KVC_MLA_ROWS(1)
#undef KVC_MLA_ROWS
}

/* acc[h][x] += sum over rows of P[t][h] lat[t][x] for NH heads (<= 6) x NV vectors (<= 2) of
 * latent elements (rows of lat and acc r floats apart): rows ascending, one fma each (named
 * accumulators, as above). */
KVC_INLINE void KVC_MLA_FN(kvc_mla_acc_tile)(const float *P, ptrdiff_t Hp, const float *lat,
                                             ptrdiff_t r, ptrdiff_t nb, int NH, int NV,
                                             float *acc, kvc_mla_pf *pf)
{
    ptrdiff_t t;
    KVC_MLA_V z = KVC_MLA_OP(zero)();
    if (pf)
        kvc_mla_pf_step(pf);
#define KVC_MLA_LOAD(j) \
    KVC_MLA_V a##j##_0 = NH > j ? KVC_MLA_OP(load)(acc + j * r) : z; \
    KVC_MLA_V a##j##_1 = NH > j && NV > 1 ? KVC_MLA_OP(load)(acc + j * r + KVC_MLA_TW) : z;
    KVC_MLA_EACH6(KVC_MLA_LOAD)
#undef KVC_MLA_LOAD
    for (t = 0; t < nb; ++t) {
        KVC_MLA_V l0 = KVC_MLA_OP(load)(lat + t * r);
        KVC_MLA_V l1 = NV > 1 ? KVC_MLA_OP(load)(lat + t * r + KVC_MLA_TW) : l0;
#define KVC_MLA_FMA(j) \
        if (NH > j) { \
            KVC_MLA_V p = KVC_MLA_OP(bcast)(P + t * Hp + j); \
            a##j##_0 = KVC_MLA_OP(fma)(p, l0, a##j##_0); \
            if (NV > 1) \
                a##j##_1 = KVC_MLA_OP(fma)(p, l1, a##j##_1); \
        }
        KVC_MLA_EACH6(KVC_MLA_FMA)
#undef KVC_MLA_FMA
    }
#define KVC_MLA_STORE(j) \
    if (NH > j) { \
        KVC_MLA_OP(store)(acc + j * r, a##j##_0); \
        if (NV > 1) \
            KVC_MLA_OP(store)(acc + j * r + KVC_MLA_TW, a##j##_1); \
    }
    KVC_MLA_EACH6(KVC_MLA_STORE)
#undef KVC_MLA_STORE
}

/* One slice of NV vectors of latent elements, all heads, in tiles of 6 heads. */
KVC_INLINE void KVC_MLA_FN(kvc_mla_acc_slice)(const float *P, ptrdiff_t Hp, ptrdiff_t H,
                                              const float *lat, ptrdiff_t r, ptrdiff_t nb,
                                              int NV, float *acc, kvc_mla_pf *pf)
{
    ptrdiff_t h;
    for (h = 0; h + 6 <= H; h += 6)
        KVC_MLA_FN(kvc_mla_acc_tile)(P + h, Hp, lat, r, nb, 6, NV, acc + h * r, pf);
    switch (H - h) {
    case 5: KVC_MLA_FN(kvc_mla_acc_tile)(P + h, Hp, lat, r, nb, 5, NV, acc + h * r, pf); break;
    case 4: KVC_MLA_FN(kvc_mla_acc_tile)(P + h, Hp, lat, r, nb, 4, NV, acc + h * r, pf); break;
    case 3: KVC_MLA_FN(kvc_mla_acc_tile)(P + h, Hp, lat, r, nb, 3, NV, acc + h * r, pf); break;
    case 2: KVC_MLA_FN(kvc_mla_acc_tile)(P + h, Hp, lat, r, nb, 2, NV, acc + h * r, pf); break;
    case 1: KVC_MLA_FN(kvc_mla_acc_tile)(P + h, Hp, lat, r, nb, 1, NV, acc + h * r, pf); break;
    default: break;
    }
}

/* The latent sums of nb rows for all heads: pairs of vectors of latent elements, a single
 * one, in the 16-float code a last 8 elements through the 8-float slice, then the last (< 8)
 * elements with fmaf. */
static inline void KVC_MLA_FN(kvc_mla_accumulate)(const float *restrict P, ptrdiff_t Hp,
                                                  ptrdiff_t H, const float *restrict lat,
                                                  ptrdiff_t r, ptrdiff_t nb,
                                                  float *restrict acc, kvc_mla_pf *pf)
{
    ptrdiff_t x = 0;
    for (; x + 2 * KVC_MLA_TW <= r; x += 2 * KVC_MLA_TW)
        KVC_MLA_FN(kvc_mla_acc_slice)(P, Hp, H, lat + x, r, nb, 2, acc + x, pf);
    for (; x + KVC_MLA_TW <= r; x += KVC_MLA_TW)
        KVC_MLA_FN(kvc_mla_acc_slice)(P, Hp, H, lat + x, r, nb, 1, acc + x, pf);
#if KVC_MLA_TW == 16
    if (x + 8 <= r) {
        kvc_mla_acc_slice8(P, Hp, H, lat + x, r, nb, 1, acc + x, pf);
        x += 8;
    }
#endif
    kvc_mla_acc_tail(P, Hp, H, lat, r, x, nb, acc);
}

/* One vector of heads of a row of scores: st = p = exp(s - m) (0 where s = -inf), l += p. */
KVC_INLINE void KVC_MLA_FN(kvc_mla_exp_vec)(float *restrict st, const float *restrict m,
                                            float *restrict l)
{
    KVC_MLA_V sv = KVC_MLA_OP(load)(st);
    KVC_MLA_V e = KVC_MLA_OP(exp)(KVC_MLA_OP(sub)(sv, KVC_MLA_OP(load)(m)));
    e = KVC_MLA_OP(zero_neginf)(sv, e);
    KVC_MLA_OP(store)(st, e);
    KVC_MLA_OP(store)(l, KVC_MLA_OP(add)(KVC_MLA_OP(load)(l), e));
}

/* A row of scores, heads [0, H): vectors, in the 16-float code a last 8 heads through the
 * 8-float code, then the last (< 8) heads with kvc_expf. */
KVC_INLINE void KVC_MLA_FN(kvc_mla_exp_row)(float *restrict st, const float *restrict m,
                                            float *restrict l, ptrdiff_t H)
{
    ptrdiff_t h = 0;
    for (; h + KVC_MLA_TW <= H; h += KVC_MLA_TW)
        KVC_MLA_FN(kvc_mla_exp_vec)(st + h, m + h, l + h);
#if KVC_MLA_TW == 16
    if (h + 8 <= H) {
        kvc_mla_exp_vec8(st + h, m + h, l + h);
        h += 8;
    }
#endif
    for (; h < H; ++h) {
        float e = st[h] == -INFINITY ? 0.0f : kvc_expf(st[h] - m[h]);
        st[h] = e;
        l[h] += e;
    }
}

#endif /* KVC_MLA_TW */
