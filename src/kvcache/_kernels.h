/* Inner loops of the decode kernels, the quantisers and the O(1) step, written once on the
 * vector layer (_vec.h); every target computes the portable C's bits.  No -ffast-math: every reduction has a FIXED order that does not
 * depend on the thread count or on how many queries share a pass, which is what makes
 * attend() and attend_group() (and attend_all_heads) bit-identical:
 *
 *   f32 scores    8 lanes of fused multiply-adds (lane l: elements i % 8 == l), folded
 *                 (0+1, 2+3, 4+5, 6+7), then pairs, then the tail (n % 8, in order, fmaf).
 *   q8 scores     per 32-channel group an 8-lane partial of widened int8 values times the
 *                 query, folded into 8 lane accumulators with the group's scale (fma); the
 *                 lanes fold as above; group remainders (len % 8) go through fmaf.
 *   softmax       max ignoring NaN; exp by kvc_expf (Cody-Waite, degree-6 polynomial, explicit
 *                 FMAs, max error 1.42 ulp, exp(-inf) = 0, NaN propagates, < -87.3 -> 0); the
 *                 sum in the 16-lane order; division by the sum when it is > 0.
 *   values        per element one fma per visible, non-skipped row, rows in order.
 */
#ifndef KVCACHE_KERNELS_H
#define KVCACHE_KERNELS_H

#include "_vec.h"
#include "_sizes.h"
#include "_q4.h"

#define KVC_LANES 16

/* ---------------------------------------------------------------------------------------
 * float32 dot products (K scores) use 8 lanes: lane l accumulates, with fused multiply-add,
 * the products of elements i with i % 8 == l over the full 8-blocks; the lanes fold as
 * kvc_f8_fold; the tail (n % 8 elements) is accumulated in order with fmaf and added last.
 * One accumulator per (query, row) lets a block of queries and rows run with one load per two
 * FMAs.
 * ------------------------------------------------------------------------------------- */

KVC_INLINE float kvc_dot_f32(const float *restrict a, const float *restrict b, ptrdiff_t n)
{
    ptrdiff_t i = 0;
    float tail = 0.0f;
    kvc_f8 acc = kvc_f8_zero();
    for (; i + 8 <= n; i += 8)
        acc = kvc_f8_fma(kvc_f8_load(a + i), kvc_f8_load(b + i), acc);
    for (; i < n; ++i)
        tail = fmaf(a[i], b[i], tail);
    return kvc_f8_fold(acc) + tail;
}

/* out[r] = kvc_dot_f32(q, k_r, n) for four rows, bit for bit. */
KVC_INLINE void kvc_dot4_f32(const float *restrict q, const float *k0, const float *k1,
                             const float *k2, const float *k3, ptrdiff_t n, float *out)
{
    ptrdiff_t i = 0;
    kvc_f8 a0 = kvc_f8_zero(), a1 = a0, a2 = a0, a3 = a0;
    float t[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (; i + 8 <= n; i += 8) {
        kvc_f8 qv = kvc_f8_load(q + i);
        a0 = kvc_f8_fma(qv, kvc_f8_load(k0 + i), a0);
        a1 = kvc_f8_fma(qv, kvc_f8_load(k1 + i), a1);
        a2 = kvc_f8_fma(qv, kvc_f8_load(k2 + i), a2);
        a3 = kvc_f8_fma(qv, kvc_f8_load(k3 + i), a3);
    }
    for (; i < n; ++i) {
        t[0] = fmaf(q[i], k0[i], t[0]);
        t[1] = fmaf(q[i], k1[i], t[1]);
        t[2] = fmaf(q[i], k2[i], t[2]);
        t[3] = fmaf(q[i], k3[i], t[3]);
    }
    kvc_f8_fold4(a0, a1, a2, a3, t, out);
}

/* out[j*ostride + r] = kvc_dot_f32(q_j, k_r, n) for two queries and four rows, bit for bit:
 * each K row block is loaded once for both queries (13 vector registers: no spills). */
KVC_INLINE void kvc_dot2x4_f32(const float *q0, const float *q1, const float *k0,
                               const float *k1, const float *k2, const float *k3, ptrdiff_t n,
                               float *out, ptrdiff_t ostride)
{
    ptrdiff_t i = 0;
    static const float zero4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    kvc_f8 z = kvc_f8_zero();
    kvc_f8 a00 = z, a01 = z, a02 = z, a03 = z, a10 = z, a11 = z, a12 = z, a13 = z;
    if (n % 8) {   /* head dims that are not a multiple of 8: the single-query path */
        kvc_dot4_f32(q0, k0, k1, k2, k3, n, out);
        kvc_dot4_f32(q1, k0, k1, k2, k3, n, out + ostride);
        return;
    }
    for (; i < n; i += 8) {
        kvc_f8 r0 = kvc_f8_load(k0 + i), r1 = kvc_f8_load(k1 + i);
        kvc_f8 r2 = kvc_f8_load(k2 + i), r3 = kvc_f8_load(k3 + i);
        kvc_f8 qa = kvc_f8_load(q0 + i), qb = kvc_f8_load(q1 + i);
        a00 = kvc_f8_fma(qa, r0, a00); a01 = kvc_f8_fma(qa, r1, a01);
        a02 = kvc_f8_fma(qa, r2, a02); a03 = kvc_f8_fma(qa, r3, a03);
        a10 = kvc_f8_fma(qb, r0, a10); a11 = kvc_f8_fma(qb, r1, a11);
        a12 = kvc_f8_fma(qb, r2, a12); a13 = kvc_f8_fma(qb, r3, a13);
    }
    /* the single-query path adds its (empty) tail */
    kvc_f8_fold4(a00, a01, a02, a03, zero4, out);
    kvc_f8_fold4(a10, a11, a12, a13, zero4, out + ostride);
}

/* y += w * x, one fused multiply-add per element. */
KVC_INLINE void kvc_axpy_f32(float *restrict y, float w, const float *restrict x, ptrdiff_t n)
{
    ptrdiff_t i = 0;
    kvc_f8 wv = kvc_f8_set1(w);
    for (; i + 8 <= n; i += 8)
        kvc_f8_store(y + i, kvc_f8_fma(wv, kvc_f8_load(x + i), kvc_f8_load(y + i)));
    for (; i < n; ++i)
        y[i] = fmaf(w, x[i], y[i]);
}

/* y = fma(w3, x3, fma(w2, x2, fma(w1, x1, fma(w0, x0, y)))): four kvc_axpy_f32 in row order,
 * with y loaded and stored once. */
KVC_INLINE void kvc_axpy4_f32(float *restrict y, const float *w, const float *x0,
                              const float *x1, const float *x2, const float *x3, ptrdiff_t n)
{
    ptrdiff_t i = 0;
    kvc_f8 w0 = kvc_f8_set1(w[0]), w1 = kvc_f8_set1(w[1]);
    kvc_f8 w2 = kvc_f8_set1(w[2]), w3 = kvc_f8_set1(w[3]);
    for (; i + 8 <= n; i += 8) {
        kvc_f8 acc = kvc_f8_load(y + i);
        acc = kvc_f8_fma(w0, kvc_f8_load(x0 + i), acc);
        acc = kvc_f8_fma(w1, kvc_f8_load(x1 + i), acc);
        acc = kvc_f8_fma(w2, kvc_f8_load(x2 + i), acc);
        acc = kvc_f8_fma(w3, kvc_f8_load(x3 + i), acc);
        kvc_f8_store(y + i, acc);
    }
    for (; i < n; ++i) {
        float a = y[i];
        a = fmaf(w[0], x0[i], a);
        a = fmaf(w[1], x1[i], a);
        a = fmaf(w[2], x2[i], a);
        a = fmaf(w[3], x3[i], a);
        y[i] = a;
    }
}

/* Max over s[0:n]; NaN entries are ignored, the fold starts at -inf (order does not matter:
 * the max of a -0 and a +0 may come out as either, and exp(s - m) is the same for both). */
static inline float kvc_max(const float *restrict s, ptrdiff_t n)
{
    ptrdiff_t i = 0;
    float m = -INFINITY, tmp[16];
    int l;
    kvc_f16 m0 = kvc_f16_set1(-INFINITY), m1 = m0;
    for (; i + 32 <= n; i += 32) {
        m0 = kvc_f16_max_num(m0, kvc_f16_load(s + i));
        m1 = kvc_f16_max_num(m1, kvc_f16_load(s + i + 16));
    }
    for (; i + 16 <= n; i += 16)
        m0 = kvc_f16_max_num(m0, kvc_f16_load(s + i));
    kvc_f16_store(tmp, kvc_f16_max_num(m0, m1));
    for (l = 0; l < 16; ++l)
        m = tmp[l] > m ? tmp[l] : m;
    for (; i < n; ++i)
        m = s[i] > m ? s[i] : m;
    return m;
}

/* In-place stable softmax of s[0:n]: m = max (NaN ignored), e = exp(s - m), summed in the
 * canonical 16-lane order (lane l takes the elements i with i % 16 == l of the whole 16-element
 * blocks, kvc_f16_fold folds the lanes, the tail is added after in order), divided by the sum
 * only when it is > 0.  On 16-lane vectors (one __m512 on AVX-512, two 8-lane halves elsewhere:
 * the same lanes and bits). */
static inline void kvc_softmax(float *restrict s, ptrdiff_t n)
{
    float m = kvc_max(s, n);
    float tail = 0.0f, sum;
    ptrdiff_t i = 0;
    kvc_f16 mv = kvc_f16_set1(m), acc = kvc_f16_zero();
    for (; i + KVC_LANES <= n; i += KVC_LANES) {
        kvc_f16 e = kvc_f16_exp(kvc_f16_sub(kvc_f16_load(s + i), mv));
        kvc_f16_store(s + i, e);
        acc = kvc_f16_add(acc, e);
    }
    sum = kvc_f16_fold(acc);
    for (; i < n; ++i) {
        float e = kvc_expf(s[i] - m);
        s[i] = e;
        tail += e;
    }
    sum = sum + tail;
    if (sum > 0.0f) {
        kvc_f16 sv = kvc_f16_set1(sum);
        i = 0;
        for (; i + 16 <= n; i += 16)
            kvc_f16_store(s + i, kvc_f16_div(kvc_f16_load(s + i), sv));
        for (; i < n; ++i)
            s[i] = s[i] / sum;
    }
}

#ifndef KVC_PREFETCH_ROWS
#define KVC_PREFETCH_ROWS 16
#endif

/* Ask for rows [p, p+nb) of a row-major store (row_bytes each) ahead of use: into every cache
 * level, or with l2_only into L2 and below (for blocks larger than L1).  l2_only is a constant
 * at every call, so the branch folds away. */
KVC_INLINE void kvc_prefetch_rows_to(const void *base, ptrdiff_t p, ptrdiff_t nb,
                                     ptrdiff_t row_bytes, int l2_only)
{
#if defined(__GNUC__)
    const char *a = (const char *)base + p * row_bytes;
    ptrdiff_t off, n = nb * row_bytes;
    for (off = 0; off < n; off += 64) {
        if (l2_only)
            __builtin_prefetch(a + off, 0, 2);
        else
            __builtin_prefetch(a + off, 0, 3);
    }
#else
    (void)base, (void)p, (void)nb, (void)row_bytes, (void)l2_only;
#endif
}

KVC_INLINE void kvc_prefetch_rows(const void *base, ptrdiff_t p, ptrdiff_t nb, ptrdiff_t row_bytes)
{
    kvc_prefetch_rows_to(base, p, nb, row_bytes, 0);
}

/* Point rows[0..nb) at rows p..p+nb of a float32 store and prefetch the block
 * KVC_PREFETCH_ROWS rows ahead. */
KVC_INLINE void kvc_row_block(const float *f, ptrdiff_t p, ptrdiff_t p1, ptrdiff_t nb,
                              ptrdiff_t hd, const float **rows)
{
    ptrdiff_t r;
    if (p + KVC_PREFETCH_ROWS + 4 <= p1)
        kvc_prefetch_rows(f, p + KVC_PREFETCH_ROWS, 4, hd * 4);
    for (r = 0; r < nb; ++r)
        rows[r] = f + (p + r) * hd;
}

/* The last step of every score pass, float32 or int8 keys alike: each raw score of rows
 * [p0, p1) that query j sees (its range [qf[j], qe[j])) times `scale`, then the softcap
 * cap * tanh(s / cap) on finite scores when cap > 0. */
KVC_INLINE void kvc_scale_scores(ptrdiff_t nq, const ptrdiff_t *qf, const ptrdiff_t *qe,
                                 ptrdiff_t p0, ptrdiff_t p1, float scale, float softcap,
                                 float *probs, ptrdiff_t L)
{
    ptrdiff_t j, p;
    for (j = 0; j < nq; ++j) {
        ptrdiff_t lo = p0 > qf[j] ? p0 : qf[j], hi = p1 < qe[j] ? p1 : qe[j];
        float *s = probs + j * L;
        for (p = lo; p < hi; ++p) {
            float v = s[p] * scale;
            if (softcap > 0.0f && isfinite(v))
                v = softcap * tanhf(v / softcap);
            s[p] = v;
        }
    }
}

/* Scores of one task with float32 keys (int8 keys: kvc_task_scores_i8). */
KVC_INLINE void kvc_task_scores_impl(const float *q, ptrdiff_t nq, const ptrdiff_t *qf,
                                     const ptrdiff_t *qe, const float *kf, ptrdiff_t p0,
                                     ptrdiff_t p1, ptrdiff_t hd, float scale, float softcap,
                                     float *probs, ptrdiff_t L)
{
    ptrdiff_t p, j, r;
    const float *rows[4] = {0, 0, 0, 0};
    for (p = p0; p < p1; p += 4) {
        ptrdiff_t nb = p1 - p < 4 ? p1 - p : 4;
        kvc_row_block(kf, p, p1, nb, hd, rows);
        j = 0;
        if (nb == 4)
            for (; j + 2 <= nq; j += 2) {
                if (!(p >= qf[j] && p + 4 <= qe[j] && p >= qf[j + 1] && p + 4 <= qe[j + 1]))
                    break;
                kvc_dot2x4_f32(q + j * hd, q + (j + 1) * hd, rows[0], rows[1], rows[2],
                               rows[3], hd, probs + j * L + p, L);
            }
        for (; j < nq; ++j) {
            const float *qj = q + j * hd;
            float *s = probs + j * L;
            if (nb == 4 && p >= qf[j] && p + 4 <= qe[j]) {
                kvc_dot4_f32(qj, rows[0], rows[1], rows[2], rows[3], hd, s + p);
                continue;
            }
            for (r = 0; r < nb; ++r) {
                ptrdiff_t pr = p + r;
                if (pr < qf[j] || pr >= qe[j])
                    continue;
                s[pr] = kvc_dot_f32(qj, rows[r], hd);
            }
        }
    }
    kvc_scale_scores(nq, qf, qe, p0, p1, scale, softcap, probs, L);
}

/* The value pass scheduled the other way round, for int8 and 4-bit V rows (whose 32-channel
 * blocks share one or two cache lines, so re-walking a chunk per block costs no extra memory
 * traffic): per quad of queries and block of KVC_VBLOCK channels, the quad's accumulators stay in
 * registers while the chunk's rows stream past, each row widened once for the quad.  Same
 * per-element chain as kvc_task_values_impl:
 *   int8   w_p = prob * row scale, v = (float)code
 *   4-bit  w_p = prob, v = fmaf((float)code, s_g, m_g) (docs/kv4.md; each row's float16
 *          parameters converted once per chunk)
 * then acc = fma(w_p, v, acc) over the visible rows whose |w_p| >= 1e-12, in order.  `kind`
 * (KVC_V_Q8 or KVC_V_Q4) is a constant at every call, so each kind compiles to its own loop.
 * scratch: KVC_SCRATCH_FLOATS(hd). */
/* KVC_WIDE: the AVX-512 body's forms of the quantised value pass and 4-bit K scorer (16-lane
 * registers), or a test build that runs them on pairs of 8-lane vectors (KVC_EMULATE_512, as
 * _mla.h's) so that a CPU without AVX-512 checks their bits. */
#if KVC_VEC_AVX512 || defined(KVC_EMULATE_512)
#define KVC_WIDE 1
#else
#define KVC_WIDE 0
#endif
/* Channels per block: 32 where the target has 32 vector registers (the quad's 16 accumulators
 * fit), 16 on AVX2's 16 (8 accumulators; 32 spilled them).  The same chains either way. */
#if KVC_VEC_AVX2 && !KVC_WIDE
#define KVC_VBLOCK 16
#else
#define KVC_VBLOCK 32
#endif
/* Queries per pass over a chunk's rows: eight on AVX-512, whose 512-bit accumulators hold a
 * block of 32 channels for eight queries in 16 registers (a KV group of seven or eight queries,
 * as Qwen2.5's or Llama-3-70B's, widens each row once instead of twice), four elsewhere.  Each
 * query's chain is the same either way. */
#if KVC_WIDE
#define KVC_VQ 8
#else
#define KVC_VQ 4
#endif

#if KVC_WIDE
/* One 32-channel block of the quantised value pass on AVX-512 (kvc_task_values_quad, whose
 * scratch wq, use and pf it reads): the block as two zmm per query (channels 0-15, 16-31), for
 * nj <= NJ queries (NJ 4 or 8, a constant at each call) whose accumulators start at
 * acc + J * hd + d0; the same per-element chains as the 8-lane code. */
KVC_INLINE void kvc_values_block32(const int q4, const uint8_t *v4, const int8_t *vq,
                                   const float *pf, const float *wq, const int32_t *use,
                                   ptrdiff_t c0, ptrdiff_t c1, ptrdiff_t hd, ptrdiff_t d0,
                                   float *acc, ptrdiff_t nj, const int NJ)
{
    const ptrdiff_t np = 2 * KVC_V4_NG(hd), rb = q4 ? hd / 2 : hd;   /* params, row bytes */
    const void *base = q4 ? (const void *)v4 : (const void *)vq;
    ptrdiff_t p;
#define KVC_LD16(J, R) (J < nj && J < NJ ? kvc_f16_load(acc + J * hd + d0 + 16 * R) \
                        : kvc_f16_zero())
    kvc_f16 z00 = KVC_LD16(0, 0), z01 = KVC_LD16(0, 1), z10 = KVC_LD16(1, 0), z11 = KVC_LD16(1, 1);
    kvc_f16 z20 = KVC_LD16(2, 0), z21 = KVC_LD16(2, 1), z30 = KVC_LD16(3, 0), z31 = KVC_LD16(3, 1);
    kvc_f16 z40 = KVC_LD16(4, 0), z41 = KVC_LD16(4, 1), z50 = KVC_LD16(5, 0), z51 = KVC_LD16(5, 1);
    kvc_f16 z60 = KVC_LD16(6, 0), z61 = KVC_LD16(6, 1), z70 = KVC_LD16(7, 0), z71 = KVC_LD16(7, 1);
#undef KVC_LD16
    for (p = c0; p < c1; ++p) {
        int32_t m = use[p - c0];
        kvc_f16 v0, v1;
        if (d0 == 0 && p + KVC_PREFETCH_ROWS < c1)
            kvc_prefetch_rows(base, p + KVC_PREFETCH_ROWS, 1, rb);
        if (!m)
            continue;
        if (q4) {
            /* a whole 32-channel chunk: byte i holds channels i and 16 + i */
            const uint8_t *src = v4 + p * rb + d0 / 2;
            const float *par = pf + (p - c0) * np + 2 * (d0 / 16);
            v0 = kvc_f16_fma(kvc_f16_from_u4(src, 0), kvc_f16_set1(par[0]), kvc_f16_set1(par[1]));
            v1 = kvc_f16_fma(kvc_f16_from_u4(src, 4), kvc_f16_set1(par[2]), kvc_f16_set1(par[3]));
        } else {
            v0 = kvc_f16_from_s8(vq + p * hd + d0);
            v1 = kvc_f16_from_s8(vq + p * hd + d0 + 16);
        }
        const float *w = wq + (p - c0);
#define KVC_UPD16(J) if (J < NJ && (m >> J & 1)) { kvc_f16 wb = kvc_f16_bcast(w + J * KVC_VROWS); \
            z##J##0 = kvc_f16_fma(wb, v0, z##J##0); z##J##1 = kvc_f16_fma(wb, v1, z##J##1); }
        KVC_UPD16(0) KVC_UPD16(1) KVC_UPD16(2) KVC_UPD16(3)
        KVC_UPD16(4) KVC_UPD16(5) KVC_UPD16(6) KVC_UPD16(7)
#undef KVC_UPD16
    }
#define KVC_ST16(J) if (J < nj && J < NJ) { float *y = acc + J * hd + d0; \
        kvc_f16_store(y, z##J##0); kvc_f16_store(y + 16, z##J##1); }
    KVC_ST16(0) KVC_ST16(1) KVC_ST16(2) KVC_ST16(3) KVC_ST16(4) KVC_ST16(5) KVC_ST16(6) KVC_ST16(7)
#undef KVC_ST16
}
#endif

KVC_INLINE void kvc_task_values_quad(const float *probs, ptrdiff_t L, ptrdiff_t nq,
                                     const ptrdiff_t *qf, const ptrdiff_t *qe, const int kind,
                                     const int8_t *vq, const float *vs, const uint8_t *v4,
                                     const uint16_t *vp, ptrdiff_t p0, ptrdiff_t p1,
                                     ptrdiff_t hd, float *acc, float *scratch)
{
    const int q4 = kind == KVC_V_Q4;
    const ptrdiff_t np = 2 * KVC_V4_NG(hd), rb = q4 ? hd / 2 : hd;   /* params, row bytes */
    float *wq = scratch;                     /* query jj's weight of row c0 + i: wq[jj * VROWS + i] */
    int32_t *use = (int32_t *)(scratch + KVC_VROWS * KVC_VQ);
    float *pf = scratch + KVC_VROWS * (KVC_VQ + 1);  /* 4-bit: the chunk's parameters as float32 */
    float vrow[KVC_VBLOCK];
    ptrdiff_t j0, p, d0, d;
    memset(acc, 0, (size_t)(nq * hd) * sizeof(float));
    for (j0 = 0; j0 < nq; j0 += KVC_VQ) {
        ptrdiff_t nj = nq - j0 < KVC_VQ ? nq - j0 : KVC_VQ, jj;
        ptrdiff_t c0, c1 = p0;
        for (c0 = p0; c0 < p1; c0 = c1) {
            c1 = p1 - c0 < KVC_VROWS ? p1 : c0 + KVC_VROWS;
            /* weights and skip flags of the quad for rows [c0, c1): use[p - c0] has bit jj
             * when query jj sees row p and !(|w| < 1e-12); a weight is read only where its
             * bit is set, so the rows a query does not see are left unwritten */
            memset(use, 0, (size_t)(c1 - c0) * sizeof(int32_t));
            for (jj = 0; jj < nj; ++jj) {
                const ptrdiff_t lo = c0 > qf[j0 + jj] ? c0 : qf[j0 + jj];
                const ptrdiff_t hi = c1 < qe[j0 + jj] ? c1 : qe[j0 + jj];
                const float *pr = probs + (j0 + jj) * L;
                float *wj = wq + jj * KVC_VROWS;
                const kvc_i8x bit = kvc_i8x_set1(1 << jj);
                const kvc_f8 tiny = kvc_f8_set1(1e-12f);
                for (p = lo; p + 8 <= hi; p += 8) {
                    kvc_f8 w = kvc_f8_load(pr + p);
                    if (!q4)
                        w = kvc_f8_mul(w, kvc_f8_load(vs + p));
                    kvc_f8_store(wj + (p - c0), w);
                    /* bit where !(|w| < tiny): a NaN weight is used */
                    kvc_i8x f = kvc_i8x_sub(bit, kvc_m8_bit(kvc_f8_lt(kvc_f8_abs(w), tiny), 1 << jj));
                    uint8_t *u8 = (uint8_t *)(use + (p - c0));
                    kvc_i8x_storeb(u8, kvc_i8x_add(kvc_i8x_loadb(u8), f));
                }
                for (; p < hi; ++p) {
                    float w = pr[p];
                    if (!q4)
                        w = w * vs[p];
                    wj[p - c0] = w;
                    if (!(fabsf(w) < 1e-12f))
                        use[p - c0] |= 1 << jj;
                }
            }
            if (q4)
                for (p = c0; p < c1; ++p)
                    if (use[p - c0])
                        kvc_v4_params(vp + p * np, hd, pf + (p - c0) * np);
            for (d0 = 0; d0 < hd; d0 += KVC_VBLOCK) {
                ptrdiff_t dn = hd - d0 < KVC_VBLOCK ? hd - d0 : KVC_VBLOCK;
#if KVC_WIDE
                if (dn == 32) {
                    /* the 8-query form costs a quad a few per-row tests more */
                    if (nj > 4)
                        kvc_values_block32(q4, v4, vq, pf, wq, use, c0, c1, hd, d0,
                                           acc + j0 * hd, nj, 8);
                    else
                        kvc_values_block32(q4, v4, vq, pf, wq, use, c0, c1, hd, d0,
                                           acc + j0 * hd, nj, 4);
                    continue;
                }
#else
                /* 4-bit: the 32-channel chunk ch0 holding the block, of cn channels; chunk
                 * bytes ch0 / 2 + i hold channel ch0 + i (low nibble) and ch0 + cn / 2 + i
                 * (high) (docs/kv4.md) */
                const ptrdiff_t ch0 = d0 & ~(ptrdiff_t)31, cn = hd - ch0 < 32 ? hd - ch0 : 32;
                const void *base = q4 ? (const void *)v4 : (const void *)vq;
                if (dn == KVC_VBLOCK && (!q4 || KVC_VBLOCK == 32 || cn != 24)) {
                    /* named registers: an array here ends up on the stack.  With 16-channel
                     * blocks the registers of vectors 2 and 3 are never touched. */
#define KVC_W32 (KVC_VBLOCK == 32)
#define KVC_LD(J, R) (J < nj && (R < 2 || KVC_W32) \
                      ? kvc_f8_load(acc + (j0 + J) * hd + d0 + 8 * R) : kvc_f8_zero())
                    kvc_f8 a00 = KVC_LD(0, 0), a01 = KVC_LD(0, 1), a02 = KVC_LD(0, 2), a03 = KVC_LD(0, 3);
                    kvc_f8 a10 = KVC_LD(1, 0), a11 = KVC_LD(1, 1), a12 = KVC_LD(1, 2), a13 = KVC_LD(1, 3);
                    kvc_f8 a20 = KVC_LD(2, 0), a21 = KVC_LD(2, 1), a22 = KVC_LD(2, 2), a23 = KVC_LD(2, 3);
                    kvc_f8 a30 = KVC_LD(3, 0), a31 = KVC_LD(3, 1), a32 = KVC_LD(3, 2), a33 = KVC_LD(3, 3);
#undef KVC_LD
                    /* 16-channel blocks: the low (hi4 0) or high (4) nibbles of a full chunk */
                    const int hi4 = (int)(d0 - ch0) / 16 * 4;
                    for (p = c0; p < c1; ++p) {
                        int32_t m = use[p - c0];
                        kvc_f8 v0, v1, v2 = kvc_f8_zero(), v3 = kvc_f8_zero();
                        if (d0 == 0 && p + KVC_PREFETCH_ROWS < c1)
                            kvc_prefetch_rows(base, p + KVC_PREFETCH_ROWS, 1, rb);
                        if (!m)
                            continue;
                        if (q4) {
                            const uint8_t *src = v4 + p * rb + ch0 / 2;
                            const float *par = pf + (p - c0) * np + 2 * (d0 / 16);
                            kvc_f8 s0 = kvc_f8_set1(par[0]), m0 = kvc_f8_set1(par[1]);
                            if (KVC_W32) {
                                kvc_f8 s1 = kvc_f8_set1(par[2]), m1 = kvc_f8_set1(par[3]);
                                v0 = kvc_f8_fma(kvc_f8_from_u4(src, 0), s0, m0);
                                v1 = kvc_f8_fma(kvc_f8_from_u4(src + 8, 0), s0, m0);
                                v2 = kvc_f8_fma(kvc_f8_from_u4(src, 4), s1, m1);
                                v3 = kvc_f8_fma(kvc_f8_from_u4(src + 8, 4), s1, m1);
                            } else if (cn == 32) {
                                v0 = kvc_f8_fma(kvc_f8_from_u4(src, hi4), s0, m0);
                                v1 = kvc_f8_fma(kvc_f8_from_u4(src + 8, hi4), s0, m0);
                            } else {                     /* a last chunk of 16 channels */
                                v0 = kvc_f8_fma(kvc_f8_from_u4(src, 0), s0, m0);
                                v1 = kvc_f8_fma(kvc_f8_from_u4(src, 4), s0, m0);
                            }
                        } else {
                            const int8_t *src = vq + p * hd + d0;
                            v0 = kvc_f8_from_s8(src);
                            v1 = kvc_f8_from_s8(src + 8);
                            if (KVC_W32) {
                                v2 = kvc_f8_from_s8(src + 16);
                                v3 = kvc_f8_from_s8(src + 24);
                            }
                        }
                        const float *w = wq + (p - c0);
#define KVC_UPD(J) if (m >> J & 1) { kvc_f8 wb = kvc_f8_bcast(w + J * KVC_VROWS); \
                            a##J##0 = kvc_f8_fma(wb, v0, a##J##0); a##J##1 = kvc_f8_fma(wb, v1, a##J##1); \
                            if (KVC_W32) { a##J##2 = kvc_f8_fma(wb, v2, a##J##2); \
                                           a##J##3 = kvc_f8_fma(wb, v3, a##J##3); } }
                        KVC_UPD(0) KVC_UPD(1) KVC_UPD(2) KVC_UPD(3)
#undef KVC_UPD
                    }
#define KVC_ST(J) if (J < nj) { float *y = acc + (j0 + J) * hd + d0; \
                        kvc_f8_store(y, a##J##0); kvc_f8_store(y + 8, a##J##1); \
                        if (KVC_W32) { kvc_f8_store(y + 16, a##J##2); kvc_f8_store(y + 24, a##J##3); } }
                    KVC_ST(0) KVC_ST(1) KVC_ST(2) KVC_ST(3)
#undef KVC_ST
#undef KVC_W32
                    continue;
                }
#endif
                /* a last block of fewer than KVC_VBLOCK channels (or, with 16-channel
                 * blocks, one in a last 4-bit chunk of 24 channels): the same values and
                 * chain, element by element */
                for (p = c0; p < c1; ++p) {
                    int32_t m = use[p - c0];
                    const float *w = wq + (p - c0);
                    if (!m)
                        continue;
                    if (q4) {
                        const uint8_t *src = v4 + p * rb;
                        const float *par = pf + (p - c0) * np;
                        for (d = 0; d < dn; ++d) {
                            ptrdiff_t byte, e = d0 + d;
                            int shift;
                            kvc_v4_place(hd, e, &byte, &shift);
                            vrow[d] = fmaf((float)((src[byte] >> shift) & 15), par[2 * (e >> 4)],
                                           par[2 * (e >> 4) + 1]);
                        }
                    } else {
                        for (d = 0; d < dn; ++d)
                            vrow[d] = (float)vq[p * hd + d0 + d];
                    }
                    for (jj = 0; jj < nj; ++jj) {
                        float *y;
                        if (!(m >> jj & 1))
                            continue;
                        y = acc + (j0 + jj) * hd + d0;
                        for (d = 0; d < dn; ++d)
                            y[d] = fmaf(w[jj * KVC_VROWS], vrow[d], y[d]);
                    }
                }
            }
        }
    }
}

/* Value pass of one task.  For every query j and channel d the accumulation is
 * acc[j][d] = fma(w_p, v_p[d], acc[j][d]) over the visible, non-skipped rows p in order
 * (w_p = prob, times the row scale in q8; rows with |w_p| < 1e-12 are skipped).  float32 rows
 * stream past in prefetched blocks of four, each query's accumulator loaded and stored once
 * per block (kvc_axpy4_f32); int8 and 4-bit rows go through kvc_task_values_quad. */
KVC_INLINE void kvc_task_values_impl(const float *probs, ptrdiff_t L, ptrdiff_t nq,
                                   const ptrdiff_t *qf, const ptrdiff_t *qe, const float *vf,
                                   const int8_t *vq, const float *vs, int quant_v, ptrdiff_t p0,
                                   ptrdiff_t p1, ptrdiff_t hd, float *acc, float *scratch)
{
    ptrdiff_t p, j, r;
    const float *rows[4] = {0, 0, 0, 0};
    if (quant_v) {
        kvc_task_values_quad(probs, L, nq, qf, qe, KVC_V_Q8, vq, vs, NULL, NULL, p0, p1, hd, acc,
                             scratch);
        return;
    }
    memset(acc, 0, (size_t)(nq * hd) * sizeof(float));
    if (!quant_v && hd == 64) {
        /* 64 channels fit in 8 registers: each query sweeps the chunk with its accumulator
         * held in registers (the first sweep streams the rows in, the others hit L2) */
        for (j = 0; j < nq; ++j) {
            ptrdiff_t lo = p0 > qf[j] ? p0 : qf[j], hi = p1 < qe[j] ? p1 : qe[j];
            kvc_f8 a0 = kvc_f8_zero(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0,
                   a7 = a0;
            for (p = lo; p < hi; ++p) {
                const float *v = vf + p * 64;
                float w = probs[j * L + p];
                if (j == 0 && p + KVC_PREFETCH_ROWS < hi)
                    kvc_prefetch_rows(vf, p + KVC_PREFETCH_ROWS, 1, 64 * 4);
                if (fabsf(w) < 1e-12f)
                    continue;
                kvc_f8 wb = kvc_f8_set1(w);
                a0 = kvc_f8_fma(wb, kvc_f8_load(v), a0);
                a1 = kvc_f8_fma(wb, kvc_f8_load(v + 8), a1);
                a2 = kvc_f8_fma(wb, kvc_f8_load(v + 16), a2);
                a3 = kvc_f8_fma(wb, kvc_f8_load(v + 24), a3);
                a4 = kvc_f8_fma(wb, kvc_f8_load(v + 32), a4);
                a5 = kvc_f8_fma(wb, kvc_f8_load(v + 40), a5);
                a6 = kvc_f8_fma(wb, kvc_f8_load(v + 48), a6);
                a7 = kvc_f8_fma(wb, kvc_f8_load(v + 56), a7);
            }
            float *y = acc + j * 64;
            kvc_f8_store(y, a0); kvc_f8_store(y + 8, a1);
            kvc_f8_store(y + 16, a2); kvc_f8_store(y + 24, a3);
            kvc_f8_store(y + 32, a4); kvc_f8_store(y + 40, a5);
            kvc_f8_store(y + 48, a6); kvc_f8_store(y + 56, a7);
        }
        return;
    }
    for (p = p0; p < p1; p += 4) {
        ptrdiff_t nb = p1 - p < 4 ? p1 - p : 4;
        kvc_row_block(vf, p, p1, nb, hd, rows);
        for (j = 0; j < nq; ++j) {
            float w[4];
            int use[4], all = nb == 4;
            for (r = 0; r < nb; ++r) {
                ptrdiff_t pr = p + r;
                use[r] = 0;
                if (pr < qf[j] || pr >= qe[j]) {
                    all = 0;
                    continue;
                }
                w[r] = probs[j * L + pr];
                if (quant_v)
                    w[r] = w[r] * vs[pr];
                use[r] = !(fabsf(w[r]) < 1e-12f);
                all = all && use[r];
            }
            if (all) {
                kvc_axpy4_f32(acc + j * hd, w, rows[0], rows[1], rows[2], rows[3], hd);
                continue;
            }
            for (r = 0; r < nb; ++r)
                if (use[r])
                    kvc_axpy_f32(acc + j * hd, w[r], rows[r], hd);
        }
    }
}

/* The task bodies specialised for the common head dims (the constant lets the compiler unroll
 * the inner loops; the arithmetic, and so every bit of the result, is the same). */
#define KVC_BY_HEAD_DIM(hd, CALL) switch (hd) { \
    case 64: CALL(64); break; \
    case 128: CALL(128); break; \
    case 256: CALL(256); break; \
    default: CALL(hd); break; }

static void kvc_task_scores(const float *q, ptrdiff_t nq, const ptrdiff_t *qf, const ptrdiff_t *qe,
                            const float *kf, ptrdiff_t p0, ptrdiff_t p1, ptrdiff_t hd, float scale,
                            float softcap, float *probs, ptrdiff_t L)
{
#define KVC_SCORES(HD) kvc_task_scores_impl(q, nq, qf, qe, kf, p0, p1, HD, scale, softcap, \
                                            probs, L)
    KVC_BY_HEAD_DIM(hd, KVC_SCORES);
#undef KVC_SCORES
}

static void kvc_task_values(const float *probs, ptrdiff_t L, ptrdiff_t nq, const ptrdiff_t *qf,
                            const ptrdiff_t *qe, const float *vf, const int8_t *vq, const float *vs,
                            int quant_v, ptrdiff_t p0, ptrdiff_t p1, ptrdiff_t hd, float *acc,
                            float *scratch)
{
#define KVC_VALUES(HD) kvc_task_values_impl(probs, L, nq, qf, qe, vf, vq, vs, quant_v, p0, p1, HD, \
                                            acc, scratch)
    KVC_BY_HEAD_DIM(hd, KVC_VALUES);
#undef KVC_VALUES
}

/* The value pass of one task over 4-bit V rows (docs/kv4.md): kvc_task_values_quad. */
static void kvc_task_values_v4(const float *probs, ptrdiff_t L, ptrdiff_t nq, const ptrdiff_t *qf,
                               const ptrdiff_t *qe, const uint8_t *v4, const uint16_t *vp,
                               ptrdiff_t p0, ptrdiff_t p1, ptrdiff_t hd, float *acc,
                               float *scratch)
{
    kvc_task_values_quad(probs, L, nq, qf, qe, KVC_V_Q4, NULL, NULL, v4, vp, p0, p1, hd, acc,
                         scratch);
}

/* Quantise one row (x / col when col != NULL) in groups of `group` channels:
 * s = max(absmax / 127, 1e-12), q = clamp(round_half_away(r / s), -127, 127), NaN -> 0. */
static inline void kvc_quant_row(const float *restrict x, const float *restrict col, ptrdiff_t hd,
                                 ptrdiff_t group, int8_t *restrict q, float *restrict s)
{
    ptrdiff_t g0, d, gi = 0;
    int l;
    float r8[8];
    for (g0 = 0; g0 < hd; g0 += group, ++gi) {
        ptrdiff_t g1 = hd - g0 < group ? hd : g0 + group;
        /* the group's |max| (NaN ignored: a maximum, so the lane order does not matter) */
        kvc_f8 am = kvc_f8_zero();
        float absmax = 0.0f;
        for (d = g0; d + 8 <= g1; d += 8) {
            kvc_f8 r = col ? kvc_f8_div(kvc_f8_load(x + d), kvc_f8_load(col + d)) : kvc_f8_load(x + d);
            am = kvc_f8_max_num(am, kvc_f8_abs(r));
        }
        kvc_f8_store(r8, am);
        for (l = 0; l < 8; ++l)
            absmax = r8[l] > absmax ? r8[l] : absmax;
        for (; d < g1; ++d) {
            float r = col ? x[d] / col[d] : x[d];
            float a = fabsf(r);
            absmax = a > absmax ? a : absmax;
        }
        float sc = absmax / 127.0f;
        sc = sc > 1e-12f ? sc : 1e-12f;
        s[gi] = sc;
        /* codes: roundf(r / sc) clamped to [-127, 127], NaN -> 0 */
        kvc_f8 scv = kvc_f8_set1(sc), hi = kvc_f8_set1(127.0f), lo = kvc_f8_set1(-127.0f);
        for (d = g0; d + 8 <= g1; d += 8) {
            kvc_f8 r = col ? kvc_f8_div(kvc_f8_load(x + d), kvc_f8_load(col + d)) : kvc_f8_load(x + d);
            kvc_f8 v = kvc_f8_round(kvc_f8_div(r, scv));
            v = kvc_f8_sel(kvc_f8_gt(v, hi), hi, v);
            v = kvc_f8_sel(kvc_f8_lt(v, lo), lo, v);
            kvc_f8_store_i8(q + d, v);        /* NaN -> 0 */
        }
        for (; d < g1; ++d) {
            float r = col ? x[d] / col[d] : x[d];
            float v = roundf(r / sc);
            v = v > 127.0f ? 127.0f : v;
            v = v < -127.0f ? -127.0f : v;
            q[d] = (v == v) ? (int8_t)v : (int8_t)0;
        }
    }
}

/* ---------------------------------------------------------------------------------------
 * q8 scoring: integer dot products (docs/numerics.md, "q8 scoring").
 *
 *   query      per call, each query is quantised like a stored row (kvc_quant_row) in groups
 *              of the layer's K group (`group`: 16 or 32 channels; the last group partial
 *              when head_dim % group != 0): codes qi (zero-padded to whole 32-channel chunks),
 *              scales sq, and the group sums qsum of the codes (the VNNI bodies' offset
 *              correction).  A group holding a NaN or an infinity gets scale
 *              NaN, so every score of that query is NaN (as its float32 scores would be).
 *   row score  acc = 0; for each K group g in order:
 *                  isum_g = sum over the group's channels of qi[d] * k[d]   (exact, int32)
 *                  acc = fmaf((float)isum_g, sq_g * sk_g, acc)
 *              then, as for float32 rows, s = acc * scale and the softcap.
 * Every target of the vector layer (portable C, AVX2, AVX-VNNI, AVX-512 VNNI, NEON with and
 * without sdot: _i8dot.h on kvc_i8_dot32x8) computes exactly these bits.
 * ------------------------------------------------------------------------------------- */

/* Quantise one query x (hd floats) in groups of `group` (16 or 32) channels: qi
 * (KVC_I8_PAD(hd) codes, zeros past hd), sq and qsum (KVC_I8_GROUPS(hd, group) each). */
static void kvc_quant_query(const float *restrict x, ptrdiff_t hd, ptrdiff_t group,
                            int8_t *restrict qi, float *restrict sq, int32_t *restrict qsum)
{
    ptrdiff_t ng = KVC_I8_GROUPS(hd, group), g, d;
    kvc_quant_row(x, NULL, hd, group, qi, sq);
    for (d = hd; d < KVC_I8_PAD(hd); ++d)
        qi[d] = 0;
    for (g = 0; g < ng; ++g) {
        ptrdiff_t g1 = hd - group * g < group ? hd : group * g + group;
        int32_t s = 0;
        int finite = 1;
        kvc_f8 z = kvc_f8_zero();            /* x * 0 is NaN exactly where x is not finite */
        for (d = group * g; d < g1; ++d)
            s += qi[d];
        for (d = group * g; d + 8 <= g1; d += 8)
            z = kvc_f8_add(z, kvc_f8_mul(kvc_f8_load(x + d), kvc_f8_zero()));
        finite = !(kvc_f8_fold(z) != 0.0f);
        for (; d < g1; ++d)
            finite = finite && isfinite(x[d]);
        qsum[g] = s;
        if (!finite)
            sq[g] = NAN;
    }
}

/* The raw q8 score of one row k (hd codes) with group scales ks: the definition above. */
KVC_INLINE float kvc_i8_score1(const int8_t *restrict qi, const float *restrict sq,
                               const int8_t *restrict k, const float *restrict ks, ptrdiff_t hd,
                               ptrdiff_t group)
{
    ptrdiff_t g0, gi = 0, d;
    float acc = 0.0f;
    for (g0 = 0; g0 < hd; g0 += group, ++gi) {
        ptrdiff_t g1 = hd - g0 < group ? hd : g0 + group;
        int32_t isum = 0;
        for (d = g0; d < g1; ++d)
            isum += (int32_t)qi[d] * (int32_t)k[d];
        acc = fmaf((float)isum, sq[gi] * ks[gi], acc);
    }
    return acc;
}

/* CALL(J, N) for the runs [J, J + N) of queries 0..nq-1: blocks of QR, then the rest (QR <=
 * 6), N a constant at every call so that each is its own unrolled kernel (the int8 K tile
 * scorer's in decode, the prompt kernel's score and value blocks). */
#define KVC_QBLOCKS(nq, QR, CALL)                                                            \
    do {                                                                                     \
        ptrdiff_t jb_;                                                                       \
        for (jb_ = 0; jb_ + (QR) <= (nq); jb_ += (QR))                                       \
            CALL(jb_, QR);                                                                   \
        switch ((nq) - jb_) {                                                                \
        case 5: CALL(jb_, 5); break;                                                         \
        case 4: CALL(jb_, 4); break;                                                         \
        case 3: CALL(jb_, 3); break;                                                         \
        case 2: CALL(jb_, 2); break;                                                         \
        case 1: CALL(jb_, 1); break;                                                         \
        default: break;                                                                      \
        }                                                                                    \
    } while (0)

#include "_i8dot.h"

#define KVC_I8_BLOCK 64 /* rows scored for every query of a task before the next rows */

#if KVC_WIDE
/* The scores tmp[jj * 32 + p - k0] of nr queries (visible ranges qf[jj], qe[jj]) for rows
 * [k0, k1) into out[jj * L + p], each query's visible rows only. */
KVC_INLINE void kvc_k8_visible(const float *tmp, ptrdiff_t nr, const ptrdiff_t *qf,
                               const ptrdiff_t *qe, ptrdiff_t k0, ptrdiff_t k1, float *out,
                               ptrdiff_t L)
{
    ptrdiff_t jj;
    for (jj = 0; jj < nr; ++jj) {
        const ptrdiff_t a = k0 > qf[jj] ? k0 : qf[jj], e = k1 < qe[jj] ? k1 : qe[jj];
        if (a < e)
            memcpy(out + jj * L + a, tmp + jj * 32 + (a - k0), (size_t)(e - a) * sizeof(float));
    }
}
#endif

/* Scores of one decode task (kvc_task_scores with int8 keys): queries j < nq (quantised:
 * qi + j * KVC_I8_PAD(hd), sq / qsum + j * KVC_I8_GROUPS(hd, group)) over their visible rows
 * in [p0, p1): probs[j * L + p] = raw score * scale, softcapped.  Blocks of KVC_I8_BLOCK rows;
 * in each, every query's raw scores are the bits of kvc_i8_rows (kvc_i8_score1's definition),
 * formed one of two ways:
 *   KVC_WIDE (the AVX-512 body)  the rows some query sees are packed once (kvc_k8_pack: 16 rows
 *                  per vector, four channels per lane) and scored for all the task's queries,
 *                  KVC_K8_QR at a time (kvc_k8_qk), with the task's next block prefetched
 *                  towards L2: the rows are read once for the KV group, with no horizontal
 *                  sums;
 *   elsewhere      kvc_i8_rows query by query (on AVX2 and AVX-VNNI the packed form measured
 *                  slower: its 8-lane integer steps save nothing over the row form's, and the
 *                  packing is extra).
 * scratch: KVC_K8_SCRATCH(hd) floats (KVC_WIDE only). */
static void kvc_task_scores_i8(ptrdiff_t group, const int8_t *qi, const float *sq,
                               const int32_t *qsum,
                               ptrdiff_t nq, const ptrdiff_t *qf, const ptrdiff_t *qe,
                               const int8_t *kq, const float *ks, ptrdiff_t ks_stride,
                               ptrdiff_t p0, ptrdiff_t p1, ptrdiff_t hd, float scale,
                               float softcap, float *probs, ptrdiff_t L, float *scratch)
{
    const ptrdiff_t hdp = KVC_I8_PAD(hd), ng = KVC_I8_GROUPS(hd, group);
    ptrdiff_t b0, j;
#if KVC_WIDE
    const ptrdiff_t sb = KVC_K8_STRIP(hd);
    uint8_t *Kb = (uint8_t *)scratch;                          /* KVC_I8_BLOCK / 16 strips */
    float *Ksc = scratch + KVC_I8_BLOCK / 16 * sb / 4;          /* their scales */
    float *tmp = Ksc + KVC_I8_BLOCK * ng;                       /* KVC_K8_QR x 32 scores */
    ptrdiff_t k0;
    for (b0 = p0; b0 < p1; b0 += KVC_I8_BLOCK) {
        const ptrdiff_t b1 = p1 - b0 < KVC_I8_BLOCK ? p1 : b0 + KVC_I8_BLOCK;
        ptrdiff_t lo = b1, hi = b0;
        for (j = 0; j < nq; ++j) {                      /* the rows some query sees */
            const ptrdiff_t a = b0 > qf[j] ? b0 : qf[j], e = b1 < qe[j] ? b1 : qe[j];
            if (a < e) {
                lo = a < lo ? a : lo;
                hi = e > hi ? e : hi;
            }
        }
        if (lo >= hi)
            continue;
        if (b1 < p1) {   /* the task's next block towards L2 while this one is scored */
            const ptrdiff_t nn = p1 - b1 < KVC_I8_BLOCK ? p1 - b1 : KVC_I8_BLOCK;
            kvc_prefetch_rows_to(kq, b1, nn, hd, 1);
            kvc_prefetch_rows_to(ks, b1, nn, ks_stride * (ptrdiff_t)sizeof(float), 1);
        }
        kvc_k8_pack(kq, ks, ks_stride, ng, lo, lo, hi, hd, Kb, Ksc);
        for (k0 = lo; k0 < hi; ) {
            /* strips of 16 rows from lo: two at a time where the body takes two */
            const int ns = KVC_K8_STRIPS == 2 && k0 + 16 < hi ? 2 : 1;
            const uint8_t *Ks = Kb + (k0 - lo) / 16 * sb;
            const float *Kc = Ksc + (k0 - lo) / 16 * ng * 16;
            const ptrdiff_t k1 = hi - k0 < 16 * ns ? hi : k0 + 16 * ns;
            /* a run of N queries from J scored into tmp, then each one's visible rows out */
#define KVC_K8_RUN(J, N, NS) do { \
                kvc_k8_qk(qi + (J) * hdp, hdp, sq + (J) * ng, qsum + (J) * ng, ng, N, NS, Ks, \
                          Kc, hd, group, tmp, 32); \
                kvc_k8_visible(tmp, N, qf + (J), qe + (J), k0, k1, probs + (J) * L, L); \
            } while (0)
#define KVC_K8_RUN1(J, N) KVC_K8_RUN(J, N, 1)
#define KVC_K8_RUN2(J, N) KVC_K8_RUN(J, N, 2)
            if (ns == 2)
                KVC_QBLOCKS(nq, KVC_K8_QR, KVC_K8_RUN2);
            else
                KVC_QBLOCKS(nq, KVC_K8_QR, KVC_K8_RUN1);
#undef KVC_K8_RUN2
#undef KVC_K8_RUN1
#undef KVC_K8_RUN
            k0 = k1;
        }
    }
#else
    (void)scratch;
    for (b0 = p0; b0 < p1; b0 += KVC_I8_BLOCK) {
        ptrdiff_t b1 = p1 - b0 < KVC_I8_BLOCK ? p1 : b0 + KVC_I8_BLOCK;
        for (j = 0; j < nq; ++j) {
            ptrdiff_t lo = b0 > qf[j] ? b0 : qf[j], hi = b1 < qe[j] ? b1 : qe[j];
            if (lo < hi)
                kvc_i8_rows(group, qi + j * hdp, sq + j * ng, qsum + j * ng, kq + lo * hd,
                                ks + lo * ks_stride, ks_stride, hd, hi - lo, probs + j * L + lo);
        }
    }
#endif
    kvc_scale_scores(nq, qf, qe, p0, p1, scale, softcap, probs, L);
}

/* ---------------------------------------------------------------------------------------
 * 4-bit K scoring (docs/kv4.md, "4-bit K"): integer dot products per block.
 *
 *   block query  for a closed block b (rows 32 b .. 32 b + 31) with per-channel steps s and
 *                minimums m (float16, read as float32): w[d] = q[d] * s[d] (one rounding),
 *                bias = kvc_dot_f32(q, m, hd); per group g of 16 channels (the last one 8
 *                when hd % 16 == 8):
 *                  a    = max |w[d]| over the group, a NaN counted as +inf
 *                  sw_g = max(a / 127, 1e-12) (float32), or NaN when a is not finite
 *                  inv  = 1 / max(a / 127, 1e-12)                  (float32; 0 when a = inf)
 *                  wi[d] = round-half-even(w[d] * inv), NaN -> 0   (|w * inv| <= 127)
 *   row score    isum_g = sum over the group's channels of wi[d] * code[d]     (exact int32)
 *                raw = 0, raw = fmaf((float)isum_g, sw_g, raw) over the groups in order;
 *                s = raw + bias;
 *   open rows    rows at or past qlen = 32 * floor(head_len / 32) are float32 in the ring
 *                (row p at slot p % KVC_K4_RING): s = kvc_dot_f32(q, row);
 * then, as for every kind, s * scale and the softcap (kvc_scale_scores).  The scorer folds up
 * to KVC_K4_QC queries per block and scores eight rows per vector (sixteen on AVX-512),
 * lanes = rows, four channel codes per lane (kvc_i8x_dp4 and kvc_i8x_dp16, kvc_i16x_dp4:
 * vpdpbusd, vpmaddubsw, sdot or C), so every target computes these bits.
 * ------------------------------------------------------------------------------------- */

/* gcc 12 warns, in the portable unit only, that kvc_dot_f32's tail loop inlined below could
 * run 2^62 times (-Waggressive-loop-optimizations): it cannot see that hd is a head dim.  The
 * warning is off for the 4-bit K scorer alone. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Waggressive-loop-optimizations"
#endif

/* One KV group's 4-bit K: codes (KVC_K4_BLOCK * hd / 2 bytes per block, _q4.h's layout),
 * block parameters (2 * hd float16 per block: steps, then minimums), the float32 ring
 * (KVC_K4_RING x hd), and qlen, the rows held as codes (a multiple of KVC_K4_BLOCK). */
typedef struct kvc_k4 {
    const uint8_t *codes;
    const uint16_t *par;
    const float *ring;
    ptrdiff_t qlen;
} kvc_k4;

/* Block b's parameters as float32: pf[d] the step, pf[hd + d] the minimum of channel d. */
KVC_INLINE void kvc_k4_params(const uint16_t *restrict par, ptrdiff_t hd, float *restrict pf)
{
    kvc_f16_row(par, 2 * hd, pf);
}

#define KVC_K4_QC 4 /* queries folded and scored together against one block */

#define KVC_K4_NGP(hd) ((KVC_I8_GROUPS(hd, 16) + 7) / 8 * 8) /* group slots, whole vectors */

/* The block query of q against a block's parameters pf (the definition above): codes wi (hd),
 * scales sw (KVC_I8_GROUPS(hd, 16)); returns the bias.  One pass over the groups: a group's
 * maximum counts a NaN as +inf, so a group holding a NaN or an infinity (or a product that
 * overflows) gets the NaN scale and zero codes, and every other group its scale and codes. */
KVC_INLINE float kvc_k4_fold(const float *restrict q, const float *restrict pf, ptrdiff_t hd,
                             int8_t *restrict wi, float *restrict sw)
{
    const kvc_f8 infv = kvc_f8_set1(INFINITY);
    ptrdiff_t g, d0;
    for (g = 0, d0 = 0; d0 < hd; ++g, d0 += 16) {
        const int two = hd - d0 >= 16;
        float ag;
        kvc_f16 w = kvc_f16_zero();
        kvc_f8 w0 = kvc_f8_zero();
        if (two) {                          /* a whole group: 16 lanes */
            w = kvc_f16_mul(kvc_f16_load(q + d0), kvc_f16_load(pf + d0));
            ag = kvc_f16_absmax_inf(w);
        } else {                            /* a last group of eight channels */
            w0 = kvc_f8_mul(kvc_f8_load(q + d0), kvc_f8_load(pf + d0));
            ag = kvc_f8_fold_max(kvc_f8_sel(kvc_f8_isnan(w0), infv, kvc_f8_abs(w0)));
        }
        if (ag <= FLT_MAX) {
            float sc = ag / 127.0f;
            sc = sc > 1e-12f ? sc : 1e-12f;
            sw[g] = sc;
            if (two)
                kvc_f16_store_i8_round(wi + d0, w, 1.0f / sc);
            else
                kvc_f8_store_i8_int(wi + d0,
                                    kvc_f8_round_even(kvc_f8_mul(w0, kvc_f8_set1(1.0f / sc))));
        } else {                            /* not finite: 1 / inf is 0, NaN codes are 0 */
            sw[g] = NAN;
            memset(wi + d0, 0, two ? 16 : 8);
        }
    }
    return kvc_dot_f32(q, pf + hd, hd);
}

/* Raw scores of NC folded queries (codes wi + c * hd, scales sw + c * KVC_K4_NGP(hd), biases bias[c])
 * against rows 8 tv .. 8 tv + 7 of the block whose codes start at blk: out[8 c + l]. */
KVC_INLINE void kvc_k4_score8(const uint8_t *restrict blk, ptrdiff_t tv, ptrdiff_t hd,
                              const ptrdiff_t NC, const int8_t *restrict wi,
                              const float *restrict sw, const float *restrict bias,
                              float *restrict out)
{
    const ptrdiff_t ng = KVC_I8_GROUPS(hd, 16), ngp = KVC_K4_NGP(hd), no = hd / 8;
    kvc_f8 f[KVC_K4_QC];
    ptrdiff_t g, o, c;
    for (c = 0; c < NC; ++c)
        f[c] = kvc_f8_zero();
    for (g = 0, o = 0; g < ng; ++g, o += 2) {
        /* the group's one or two channel octets, the low and high nibbles of each; a group's
         * int32 sum is exact, so summing its sixteen products at once (kvc_i8x_dp16) gives
         * the bits of four chained kvc_i8x_dp4 */
        const kvc_i8x u0 = kvc_i8x_loadb(blk + o * 4 * KVC_K4_BLOCK + tv * 32);
        const kvc_i8x l0 = kvc_i8x_nib(u0, 0), h0 = kvc_i8x_nib(u0, 4);
        if (o + 1 < no) {
            const kvc_i8x u1 = kvc_i8x_loadb(blk + (o + 1) * 4 * KVC_K4_BLOCK + tv * 32);
            const kvc_i8x l1 = kvc_i8x_nib(u1, 0), h1 = kvc_i8x_nib(u1, 4);
            for (c = 0; c < NC; ++c) {
                int32_t w[4];
                memcpy(w, wi + c * hd + 8 * o, 16);
                const kvc_i8x isum = kvc_i8x_dp16(l0, w[0], h0, w[1], l1, w[2], h1, w[3]);
                f[c] = kvc_f8_fma(kvc_i8x_to_f8(isum), kvc_f8_set1(sw[c * ngp + g]), f[c]);
            }
        } else {                                    /* a last group of eight channels */
            for (c = 0; c < NC; ++c) {
                int32_t w[2];
                memcpy(w, wi + c * hd + 8 * o, 8);
                const kvc_i8x isum = kvc_i8x_dp4(kvc_i8x_dp4(kvc_i8x_set1(0), l0, w[0]), h0, w[1]);
                f[c] = kvc_f8_fma(kvc_i8x_to_f8(isum), kvc_f8_set1(sw[c * ngp + g]), f[c]);
            }
        }
    }
    for (c = 0; c < NC; ++c)
        kvc_f8_store(out + 8 * c, kvc_f8_add(f[c], kvc_f8_set1(bias[c])));
}

/* kvc_k4_score8 on sixteen rows, 16 tv .. 16 tv + 15 (kvc_i16x lanes = rows): the same chain
 * per lane.  The AVX-512 body's scorer (one register of sixteen lanes); elsewhere the halves
 * would hold twice the registers of kvc_k4_score8 for the same work. */
KVC_INLINE void kvc_k4_score16(const uint8_t *restrict blk, ptrdiff_t tv, ptrdiff_t hd,
                               const ptrdiff_t NC, const int8_t *restrict wi,
                               const float *restrict sw, const float *restrict bias,
                               float *restrict out)
{
    const ptrdiff_t ng = KVC_I8_GROUPS(hd, 16), ngp = KVC_K4_NGP(hd), no = hd / 8;
    kvc_f16 f[KVC_K4_QC];
    ptrdiff_t g, o, c;
    for (c = 0; c < NC; ++c)
        f[c] = kvc_f16_zero();
    for (g = 0, o = 0; g < ng; ++g, o += 2) {
        const kvc_i16x u0 = kvc_i16x_loadb(blk + o * 4 * KVC_K4_BLOCK + tv * 64);
        const kvc_i16x l0 = kvc_i16x_nib(u0, 0), h0 = kvc_i16x_nib(u0, 4);
        if (o + 1 < no) {
            const kvc_i16x u1 = kvc_i16x_loadb(blk + (o + 1) * 4 * KVC_K4_BLOCK + tv * 64);
            const kvc_i16x l1 = kvc_i16x_nib(u1, 0), h1 = kvc_i16x_nib(u1, 4);
            for (c = 0; c < NC; ++c) {
                int32_t w[4];
                memcpy(w, wi + c * hd + 8 * o, 16);
                const kvc_i16x isum = kvc_i16x_dp4(kvc_i16x_dp4(kvc_i16x_dp4(kvc_i16x_dp4(
                    kvc_i16x_set1(0), l0, w[0]), h0, w[1]), l1, w[2]), h1, w[3]);
                f[c] = kvc_f16_fma(kvc_i16x_to_f16(isum), kvc_f16_set1(sw[c * ngp + g]), f[c]);
            }
        } else {                                    /* a last group of eight channels */
            for (c = 0; c < NC; ++c) {
                int32_t w[2];
                memcpy(w, wi + c * hd + 8 * o, 8);
                const kvc_i16x isum = kvc_i16x_dp4(kvc_i16x_dp4(kvc_i16x_set1(0), l0, w[0]), h0,
                                                   w[1]);
                f[c] = kvc_f16_fma(kvc_i16x_to_f16(isum), kvc_f16_set1(sw[c * ngp + g]), f[c]);
            }
        }
    }
    for (c = 0; c < NC; ++c)
        kvc_f16_store(out + 16 * c, kvc_f16_add(f[c], kvc_f16_set1(bias[c])));
}

#if KVC_WIDE
#define KVC_K4_ROWS 16  /* rows per call of the scorer */
#define kvc_k4_score_rows kvc_k4_score16
#else
#define KVC_K4_ROWS 8
#define kvc_k4_score_rows kvc_k4_score8
#endif

/* kvc_k4_score_rows (KVC_K4_ROWS rows) for nc (1 .. KVC_K4_QC) queries, specialised for the
 * common head dims. */
static void kvc_k4_score_n(const uint8_t *blk, ptrdiff_t tv, ptrdiff_t hd, ptrdiff_t nc,
                           const int8_t *wi, const float *sw, const float *bias, float *out)
{
#define KVC_K4_S8(HD, NC) kvc_k4_score_rows(blk, tv, HD, NC, wi, sw, bias, out)
#define KVC_K4_S8_HD(NC) switch (hd) { \
        case 64: KVC_K4_S8(64, NC); break; \
        case 128: KVC_K4_S8(128, NC); break; \
        default: KVC_K4_S8(hd, NC); break; }
    switch (nc) {
    case 4: KVC_K4_S8_HD(4); break;
    case 3: KVC_K4_S8_HD(3); break;
    case 2: KVC_K4_S8_HD(2); break;
    default: KVC_K4_S8_HD(1); break;
    }
#undef KVC_K4_S8_HD
#undef KVC_K4_S8
}

/* Raw scores (no scale) of queries [0, nq) (rows of q, stride hd) over the rows of [p0, p1)
 * each sees ([qf[j], qe[j])): out[j * ldo + p - base].  scratch: KVC_K4_SCRATCH(hd) floats. */
static void kvc_k4_raw(const kvc_k4 *K, const float *q, ptrdiff_t nq, const ptrdiff_t *qf,
                       const ptrdiff_t *qe, ptrdiff_t p0, ptrdiff_t p1, ptrdiff_t hd,
                       float *out, ptrdiff_t ldo, ptrdiff_t base, float *scratch)
{
    const ptrdiff_t ng = KVC_K4_NGP(hd), B = KVC_K4_BLOCK, R = KVC_K4_ROWS;
    float *pf = scratch, *sw = pf + 2 * hd, *bias = sw + KVC_K4_QC * ng, *tmp = bias + KVC_K4_QC;
    int8_t *wi = (int8_t *)(tmp + R * KVC_K4_QC);
    ptrdiff_t b0, j, p;
    for (b0 = p0 / B * B; b0 < p1 && b0 < K->qlen; b0 += B) {
        const ptrdiff_t lo = b0 > p0 ? b0 : p0, hi = b0 + B < p1 ? b0 + B : p1;
        const uint8_t *blk = K->codes + b0 * (hd / 2);
        ptrdiff_t js[KVC_K4_QC], a[KVC_K4_QC], e[KVC_K4_QC], nc = 0, c, tv, l;
        int loaded = 0;
        for (j = 0; j < nq; ++j) {
            ptrdiff_t aj = lo > qf[j] ? lo : qf[j], ej = hi < qe[j] ? hi : qe[j];
            if (aj < ej) {
                if (!loaded) {
                    kvc_k4_params(K->par + b0 / B * 2 * hd, hd, pf);
                    loaded = 1;
                }
                bias[nc] = kvc_k4_fold(q + j * hd, pf, hd, wi + nc * hd, sw + nc * ng);
                js[nc] = j, a[nc] = aj, e[nc] = ej, ++nc;
            }
            if (nc == KVC_K4_QC || (nc > 0 && j == nq - 1)) {
                ptrdiff_t ua = a[0], ue = e[0];
                for (c = 1; c < nc; ++c) {
                    ua = a[c] < ua ? a[c] : ua;
                    ue = e[c] > ue ? e[c] : ue;
                }
                for (tv = (ua - b0) / R; tv * R + b0 < ue; ++tv) {
                    const ptrdiff_t r0 = b0 + R * tv;
                    kvc_k4_score_n(blk, tv, hd, nc, wi, sw, bias, tmp);
                    for (c = 0; c < nc; ++c) {
                        float *o = out + js[c] * ldo - base;
                        if (a[c] <= r0 && r0 + R <= e[c])
                            memcpy(o + r0, tmp + R * c, R * sizeof(float));
                        else
                            for (l = 0; l < R; ++l)
                                if (r0 + l >= a[c] && r0 + l < e[c])
                                    o[r0 + l] = tmp[R * c + l];
                    }
                }
                nc = 0;
            }
        }
    }
    for (p = p0 > K->qlen ? p0 : K->qlen; p < p1; ++p) {
        const float *row = K->ring + (p % KVC_K4_RING) * hd;
        for (j = 0; j < nq; ++j)
            if (p >= qf[j] && p < qe[j])
                out[j * ldo + p - base] = kvc_dot_f32(q + j * hd, row, hd);
    }
}

/* Scores of one decode task with 4-bit keys: probs[j * L + p] = score * scale, softcapped,
 * for the rows of [p0, p1) query j sees. */
static void kvc_task_scores_k4(const kvc_k4 *K, const float *q, ptrdiff_t nq,
                               const ptrdiff_t *qf, const ptrdiff_t *qe, ptrdiff_t p0,
                               ptrdiff_t p1, ptrdiff_t hd, float scale, float softcap,
                               float *probs, ptrdiff_t L, float *scratch)
{
    kvc_k4_raw(K, q, nq, qf, qe, p0, p1, hd, probs, L, 0, scratch);
    kvc_scale_scores(nq, qf, qe, p0, p1, scale, softcap, probs, L);
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

/* ---------------------------------------------------------------------------------------
 * O(1) Nystrom decode (docs/o1.md).  Per head; every reduction in a fixed
 * order, so a head's result does not depend on the thread count or on which other heads
 * share the call (a group's output is bit-identical to independent single-head states).
 *   landmark scores  l_i = kvc_dot_f32(qt_i, k) * scale          (four landmarks per pass)
 *   far absorb       if l_i > m_max_i: r = exp(m_max_i - l_i), z_i *= r, t_i *= r, m_max_i = l_i;
 *                    e = exp(l_i - m_max_i); z_i += e; t_i = fma(e, v, t_i)
 *   near scores      kvc_dot_f32(q, row) * scale, sinks first, then the window in SLOT order
 *   mixing row       u_b = fma(fh_a, M[a][b], u_b) over a ascending (FM: u_b = max(u_b, 0))
 *   far denominator  far_den = fma(gain_b, z_b, far_den) over b ascending; used when >= 0
 *   output           out = sum_b gain_b t_b (b ascending, fma), then every near entry in
 *                    order: den += p_j (plain adds), out = fma(p_j, value_j, out);
 *                    out /= max(den, 1e-30)
 * ------------------------------------------------------------------------------------- */

/* Absorb one key/value (k: d floats, v: dv floats) into one head's far field.
 * qt: the head's m x d query landmarks; t_hat m x dv, z_hat m, m_max m; l: m floats scratch. */
static void kvc_o1_absorb(const float *restrict qt, const float *restrict k,
                          const float *restrict v, ptrdiff_t m, ptrdiff_t d, ptrdiff_t dv,
                          float scale, float *restrict t_hat, float *restrict z_hat,
                          float *restrict m_max, float *restrict l)
{
    ptrdiff_t i = 0, j;
    for (; i + 4 <= m; i += 4)
        kvc_dot4_f32(k, qt + i * d, qt + (i + 1) * d, qt + (i + 2) * d, qt + (i + 3) * d, d, l + i);
    for (; i < m; ++i)
        l[i] = kvc_dot_f32(k, qt + i * d, d);
    for (i = 0; i < m; ++i) {
        float li = l[i] * scale;
        float *restrict ti = t_hat + i * dv;
        if (li > m_max[i]) {
            float r = kvc_expf(m_max[i] - li);
            z_hat[i] *= r;
            for (j = 0; j < dv; ++j)
                ti[j] *= r;
            m_max[i] = li;
        }
        float e = kvc_expf(li - m_max[i]);
        z_hat[i] += e;
        kvc_axpy_f32(ti, e, v, dv);
    }
}

/* One head's decode output (docs/o1.md, the decode step).
 * Near rows: ns sink rows (sink_k/sink_v), then nw window rows in slot order, where row `slot`
 * is read from (k_new, v_new) instead of the ring (slot < 0: none).  The far field (k_tilde
 * m x d of the group; mu m x m, t_hat m x dv, z_hat, m_max of the head) is used when use_far.
 * scr: ns + nw + 2 m floats. */
KVC_NOINLINE void kvc_o1_head(const float *restrict q, ptrdiff_t d, ptrdiff_t dv,
                              float scale, const float *sink_k, const float *sink_v,
                              ptrdiff_t ns, const float *win_k, const float *win_v, ptrdiff_t nw,
                              ptrdiff_t slot, const float *k_new, const float *v_new,
                              const float *k_tilde, const float *mu, const float *t_hat,
                              const float *z_hat, const float *m_max, ptrdiff_t m, int use_far,
                              int fm, float *restrict out, float *restrict scr)
{
    ptrdiff_t n = ns + nw, j, a, b;
    float *restrict s = scr, *restrict fh = scr + n, *restrict u = scr + n + m;
    const float *rows[4];
#define KVC_O1_KROW(J) ((J) < ns ? sink_k + (J) * d : ((J) - ns == slot ? k_new : win_k + ((J) - ns) * d))
#define KVC_O1_VROW(J) ((J) < ns ? sink_v + (J) * dv : ((J) - ns == slot ? v_new : win_v + ((J) - ns) * dv))
    for (j = 0; j + 4 <= n; j += 4) {
        kvc_dot4_f32(q, KVC_O1_KROW(j), KVC_O1_KROW(j + 1), KVC_O1_KROW(j + 2), KVC_O1_KROW(j + 3), d, s + j);
    }
    for (; j < n; ++j)
        s[j] = kvc_dot_f32(q, KVC_O1_KROW(j), d);
    for (j = 0; j < n; ++j)
        s[j] *= scale;
    float c_all = kvc_max(s, n), den = 0.0f;
    memset(out, 0, (size_t)dv * sizeof(float));
    if (use_far && m > 0) {
        for (a = 0; a + 4 <= m; a += 4)
            kvc_dot4_f32(q, k_tilde + a * d, k_tilde + (a + 1) * d, k_tilde + (a + 2) * d,
                         k_tilde + (a + 3) * d, d, fh + a);
        for (; a < m; ++a)
            fh[a] = kvc_dot_f32(q, k_tilde + a * d, d);
        for (a = 0; a < m; ++a)
            fh[a] *= scale;
        float f = kvc_max(fh, m);
        for (a = 0; a < m; ++a)
            fh[a] = kvc_expf(fh[a] - f);
        memset(u, 0, (size_t)m * sizeof(float));
        for (a = 0; a < m; ++a)
            kvc_axpy_f32(u, fh[a], mu + a * m, m);
        if (fm)
            for (b = 0; b < m; ++b)
                u[b] = u[b] > 0.0f ? u[b] : 0.0f;
        float mx = -INFINITY;
        for (b = 0; b < m; ++b) {
            float e = f + m_max[b];
            mx = e > mx ? e : mx;
        }
        c_all = mx > c_all ? mx : c_all;
        float far_den = 0.0f;
        for (b = 0; b < m; ++b) {
            u[b] *= kvc_expf(f + m_max[b] - c_all);
            far_den = fmaf(u[b], z_hat[b], far_den);
        }
        if (far_den >= 0.0f) {
            den = far_den;
            for (b = 0; b < m; ++b)
                kvc_axpy_f32(out, u[b], t_hat + b * dv, dv);
        }
    }
    for (j = 0; j < n; ++j) {
        s[j] = kvc_expf(s[j] - c_all);
        den += s[j];
    }
    for (j = 0; j + 4 <= n; j += 4) {
        rows[0] = KVC_O1_VROW(j);
        rows[1] = KVC_O1_VROW(j + 1);
        rows[2] = KVC_O1_VROW(j + 2);
        rows[3] = KVC_O1_VROW(j + 3);
        kvc_axpy4_f32(out, s + j, rows[0], rows[1], rows[2], rows[3], dv);
    }
    for (; j < n; ++j)
        kvc_axpy_f32(out, s[j], KVC_O1_VROW(j), dv);
#undef KVC_O1_KROW
#undef KVC_O1_VROW
    den = den > 1e-30f ? den : 1e-30f;
    for (j = 0; j < dv; ++j)
        out[j] /= den;
}

#endif
