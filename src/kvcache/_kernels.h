/* Inner loops of the kvcache kernels, written so that gcc/clang vectorise them without
 * -ffast-math.  Every reduction has a FIXED summation order that does not depend on the
 * thread count or on how many heads share a pass, which is what makes attend() and
 * attend_group() bit-identical:
 *
 *   dot products  16 interleaved partial sums (lane l takes elements i with i % 16 == l over
 *                 the whole 16-blocks), combined pairwise (8, 4, 2, 1), then the scalar tail
 *                 (the last n % 16 elements, in order) is added.
 *   softmax sum   the same 16-lane scheme over the exponentials.
 *   exp           kvc_expf: Cody-Waite reduction and a degree-6 polynomial, |rel err| < 2 ulp,
 *                 exp(-inf) = 0, NaN propagates, arguments below -87.3 flush to 0.
 */
#ifndef KVCACHE_KERNELS_H
#define KVCACHE_KERNELS_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#include <stddef.h>

#define KVC_LANES 16

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVC_SIMD 1
#else
#define KVC_SIMD 0
#endif

/* ---------------------------------------------------------------------------------------
 * The canonical 16-lane reduction.  Lane l (0..15) accumulates, with fused multiply-add,
 * the products of elements i with i % 16 == l over the full 16-blocks; the lanes are folded
 * l += l+8, l += l+4, l += l+2, 0 += 1; the tail (n % 16 elements) is accumulated in order
 * with fmaf and added last.  The AVX2 path and the portable path compute exactly this, so a
 * build gives the same bits whichever it uses.
 * ------------------------------------------------------------------------------------- */

static inline float kvc_hsum16(float *acc)
{
    int w, l;
    for (w = KVC_LANES / 2; w > 0; w >>= 1)
        for (l = 0; l < w; ++l)
            acc[l] += acc[l + w];
    return acc[0];
}

#if KVC_SIMD
static inline float kvc_fold(__m256 lo, __m256 hi)
{
    __m256 s = _mm256_add_ps(lo, hi);
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_shuffle_ps(x, x, 1));
    return _mm_cvtss_f32(x);
}
#endif

static inline float kvc_dot_f32(const float *restrict a, const float *restrict b, ptrdiff_t n)
{
    ptrdiff_t i = 0;
    float tail = 0.0f, head;
#if KVC_SIMD
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    for (; i + KVC_LANES <= n; i += KVC_LANES) {
        lo = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), lo);
        hi = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), hi);
    }
    head = kvc_fold(lo, hi);
#else
    float acc[KVC_LANES] = {0};
    int l;
    for (; i + KVC_LANES <= n; i += KVC_LANES)
        for (l = 0; l < KVC_LANES; ++l)
            acc[l] = fmaf(a[i + l], b[i + l], acc[l]);
    head = kvc_hsum16(acc);
#endif
    for (; i < n; ++i)
        tail = fmaf(a[i], b[i], tail);
    return head + tail;
}

/* Four dot products of q with rows k0..k3, each bit-identical to kvc_dot_f32(q, kr, n). */
static inline void kvc_dot4_f32(const float *restrict q, const float *k0, const float *k1,
                                const float *k2, const float *k3, ptrdiff_t n, float *out)
{
#if KVC_SIMD
    ptrdiff_t i = 0;
    __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0;
    for (; i + KVC_LANES <= n; i += KVC_LANES) {
        __m256 ql = _mm256_loadu_ps(q + i), qh = _mm256_loadu_ps(q + i + 8);
        a0 = _mm256_fmadd_ps(ql, _mm256_loadu_ps(k0 + i), a0);
        b0 = _mm256_fmadd_ps(qh, _mm256_loadu_ps(k0 + i + 8), b0);
        a1 = _mm256_fmadd_ps(ql, _mm256_loadu_ps(k1 + i), a1);
        b1 = _mm256_fmadd_ps(qh, _mm256_loadu_ps(k1 + i + 8), b1);
        a2 = _mm256_fmadd_ps(ql, _mm256_loadu_ps(k2 + i), a2);
        b2 = _mm256_fmadd_ps(qh, _mm256_loadu_ps(k2 + i + 8), b2);
        a3 = _mm256_fmadd_ps(ql, _mm256_loadu_ps(k3 + i), a3);
        b3 = _mm256_fmadd_ps(qh, _mm256_loadu_ps(k3 + i + 8), b3);
    }
    float t0 = 0.0f, t1 = 0.0f, t2 = 0.0f, t3 = 0.0f;
    for (; i < n; ++i) {
        t0 = fmaf(q[i], k0[i], t0);
        t1 = fmaf(q[i], k1[i], t1);
        t2 = fmaf(q[i], k2[i], t2);
        t3 = fmaf(q[i], k3[i], t3);
    }
    out[0] = kvc_fold(a0, b0) + t0;
    out[1] = kvc_fold(a1, b1) + t1;
    out[2] = kvc_fold(a2, b2) + t2;
    out[3] = kvc_fold(a3, b3) + t3;
#else
    out[0] = kvc_dot_f32(q, k0, n);
    out[1] = kvc_dot_f32(q, k1, n);
    out[2] = kvc_dot_f32(q, k2, n);
    out[3] = kvc_dot_f32(q, k3, n);
#endif
}

/* int8 -> float widening of one row (no scale applied). */
static inline void kvc_widen_i8(const int8_t *restrict x, float *restrict y, ptrdiff_t n)
{
    ptrdiff_t i;
    for (i = 0; i < n; ++i)
        y[i] = (float)x[i];
}

/* q8 score of one widened K row kw (float copy of the int8 values, unscaled) with scales ks:
 * per 32-channel group g, a 16-lane partial p_g (fma over the group's full 16-blocks) is
 * folded into the lane accumulator as acc = fma(ks[g], p_g, acc); the group's remainder
 * (len % 16 elements, in order) gives t_g, folded as tail = fmaf(ks[g], t_g, tail).
 * Result: fold(acc) + tail.  The caller multiplies by the softmax scale. */
static inline float kvc_score_q8w(const float *restrict kw, const float *restrict ks,
                                  const float *restrict qc, ptrdiff_t hd, ptrdiff_t group)
{
    ptrdiff_t g0, gi = 0, i;
    float tail = 0.0f;
#if KVC_SIMD
    __m256 alo = _mm256_setzero_ps(), ahi = _mm256_setzero_ps();
#else
    float acc[KVC_LANES] = {0};
    int l;
#endif
    for (g0 = 0; g0 < hd; g0 += group, ++gi) {
        ptrdiff_t g1 = hd - g0 < group ? hd : g0 + group;
        float t = 0.0f;
        i = g0;
#if KVC_SIMD
        __m256 plo = _mm256_setzero_ps(), phi = _mm256_setzero_ps();
        for (; i + KVC_LANES <= g1; i += KVC_LANES) {
            plo = _mm256_fmadd_ps(_mm256_loadu_ps(kw + i), _mm256_loadu_ps(qc + i), plo);
            phi = _mm256_fmadd_ps(_mm256_loadu_ps(kw + i + 8), _mm256_loadu_ps(qc + i + 8), phi);
        }
        __m256 sg = _mm256_set1_ps(ks[gi]);
        alo = _mm256_fmadd_ps(sg, plo, alo);
        ahi = _mm256_fmadd_ps(sg, phi, ahi);
#else
        float p[KVC_LANES] = {0};
        for (; i + KVC_LANES <= g1; i += KVC_LANES)
            for (l = 0; l < KVC_LANES; ++l)
                p[l] = fmaf(kw[i + l], qc[i + l], p[l]);
        for (l = 0; l < KVC_LANES; ++l)
            acc[l] = fmaf(ks[gi], p[l], acc[l]);
#endif
        for (; i < g1; ++i)
            t = fmaf(kw[i], qc[i], t);
        tail = fmaf(ks[gi], t, tail);
    }
#if KVC_SIMD
    return kvc_fold(alo, ahi) + tail;
#else
    return kvc_hsum16(acc) + tail;
#endif
}

/* y += w * x, one fused multiply-add per element. */
static inline void kvc_axpy_f32(float *restrict y, float w, const float *restrict x, ptrdiff_t n)
{
    ptrdiff_t i = 0;
#if KVC_SIMD
    __m256 wv = _mm256_set1_ps(w);
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#endif
    for (; i < n; ++i)
        y[i] = fmaf(w, x[i], y[i]);
}

/* y = fma(w3, x3, fma(w2, x2, fma(w1, x1, fma(w0, x0, y)))): four kvc_axpy_f32 in row order,
 * with y loaded and stored once. */
static inline void kvc_axpy4_f32(float *restrict y, const float *w, const float *x0,
                                 const float *x1, const float *x2, const float *x3, ptrdiff_t n)
{
    ptrdiff_t i = 0;
#if KVC_SIMD
    __m256 w0 = _mm256_set1_ps(w[0]), w1 = _mm256_set1_ps(w[1]);
    __m256 w2 = _mm256_set1_ps(w[2]), w3 = _mm256_set1_ps(w[3]);
    for (; i + 8 <= n; i += 8) {
        __m256 acc = _mm256_loadu_ps(y + i);
        acc = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x0 + i), acc);
        acc = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x1 + i), acc);
        acc = _mm256_fmadd_ps(w2, _mm256_loadu_ps(x2 + i), acc);
        acc = _mm256_fmadd_ps(w3, _mm256_loadu_ps(x3 + i), acc);
        _mm256_storeu_ps(y + i, acc);
    }
#endif
    for (; i < n; ++i) {
        float a = y[i];
        a = fmaf(w[0], x0[i], a);
        a = fmaf(w[1], x1[i], a);
        a = fmaf(w[2], x2[i], a);
        a = fmaf(w[3], x3[i], a);
        y[i] = a;
    }
}

static inline float kvc_expf(float x)
{
    /* exp(x) = 2^n * exp(r), x = n ln2 + r, |r| <= ln2/2 */
    const float log2e = 1.44269504088896341f;
    const float ln2_hi = 0.693359375f;
    const float ln2_lo = -2.12194440e-4f;
    const float shifter = 12582912.0f; /* 1.5 * 2^23: adding it rounds to nearest integer */
    float xc = x > 88.0f ? 88.0f : x;
    xc = xc < -87.0f ? -87.0f : xc;
    float t = xc * log2e + shifter;
    float n = t - shifter;
    float r = xc - n * ln2_hi;
    r = r - n * ln2_lo;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    float nc = n == n ? n : 0.0f; /* NaN input: keep the conversion defined; p is NaN anyway */
    int32_t ni = (int32_t)nc;
    uint32_t bits = (uint32_t)(ni + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    float y = p * two_n;
    y = x < -87.33654f ? 0.0f : y;
    y = x > 88.72283f ? INFINITY : y;
    return y;
}

/* Max over s[0:n]; NaN entries are ignored, the fold starts at -inf. */
static inline float kvc_max(const float *restrict s, ptrdiff_t n)
{
    float mx[KVC_LANES];
    ptrdiff_t i = 0;
    int l;
    for (l = 0; l < KVC_LANES; ++l)
        mx[l] = -INFINITY;
    for (; i + KVC_LANES <= n; i += KVC_LANES)
        for (l = 0; l < KVC_LANES; ++l)
            mx[l] = s[i + l] > mx[l] ? s[i + l] : mx[l];
    float m = -INFINITY;
    for (l = 0; l < KVC_LANES; ++l)
        m = mx[l] > m ? mx[l] : m;
    for (; i < n; ++i)
        m = s[i] > m ? s[i] : m;
    return m;
}

/* In-place stable softmax of s[0:n]: m = max (NaN ignored), e = exp(s - m),
 * sum in the 16-lane order, divide by the sum only when it is > 0. */
static inline void kvc_softmax(float *restrict s, ptrdiff_t n)
{
    float m = kvc_max(s, n);
    float acc[KVC_LANES] = {0};
    float tail = 0.0f;
    ptrdiff_t i = 0;
    int l;
    for (; i + KVC_LANES <= n; i += KVC_LANES)
        for (l = 0; l < KVC_LANES; ++l) {
            float e = kvc_expf(s[i + l] - m);
            s[i + l] = e;
            acc[l] += e;
        }
    for (; i < n; ++i) {
        float e = kvc_expf(s[i] - m);
        s[i] = e;
        tail += e;
    }
    float sum = kvc_hsum16(acc) + tail;
    if (sum > 0.0f)
        for (i = 0; i < n; ++i)
            s[i] = s[i] / sum;
}

/* ---------------------------------------------------------------------------------------
 * Task bodies of attend_rows: one (KV head, chunk of rows) each.  Queries are the group's
 * nq query rows; query j sees rows [qf[j], qe[j]).  probs row j starts at probs + j*L.
 * scratch holds at least 4*hd floats (a block of widened int8 rows, never a whole cache).
 * ------------------------------------------------------------------------------------- */
#ifndef KVC_PREFETCH_ROWS
#define KVC_PREFETCH_ROWS 32
#endif

/* Ask for rows [p, p+nb) of a row-major store (row_bytes each) ahead of use. */
static inline void kvc_prefetch_rows(const void *base, ptrdiff_t p, ptrdiff_t nb, ptrdiff_t row_bytes)
{
#if defined(__GNUC__)
    const char *a = (const char *)base + p * row_bytes;
    ptrdiff_t off, n = nb * row_bytes;
    for (off = 0; off < n; off += 64)
        __builtin_prefetch(a + off, 0, 3);
#endif
}

static inline void kvc_task_scores(const float *q, ptrdiff_t nq, const ptrdiff_t *qf,
                                   const ptrdiff_t *qe, const float *kf, const int8_t *kq,
                                   const float *ks, ptrdiff_t ng, int quant_k, ptrdiff_t p0,
                                   ptrdiff_t p1, ptrdiff_t hd, float scale, float softcap,
                                   float *probs, ptrdiff_t L, float *scratch)
{
    ptrdiff_t p, j, r;
    const float *rows[4] = {0, 0, 0, 0};
    for (p = p0; p < p1; p += 4) {
        ptrdiff_t nb = p1 - p < 4 ? p1 - p : 4;
        if (p + KVC_PREFETCH_ROWS + 4 <= p1) {
            if (quant_k)
                kvc_prefetch_rows(kq, p + KVC_PREFETCH_ROWS, 4, hd);
            else
                kvc_prefetch_rows(kf, p + KVC_PREFETCH_ROWS, 4, hd * 4);
        }
        for (r = 0; r < nb; ++r) {
            if (quant_k) {
                kvc_widen_i8(kq + (p + r) * hd, scratch + r * hd, hd);
                rows[r] = scratch + r * hd;
            } else {
                rows[r] = kf + (p + r) * hd;
            }
        }
        for (j = 0; j < nq; ++j) {
            const float *qj = q + j * hd;
            float *s = probs + j * L;
            if (!quant_k && nb == 4 && p >= qf[j] && p + 4 <= qe[j]) {
                kvc_dot4_f32(qj, rows[0], rows[1], rows[2], rows[3], hd, s + p);
                continue;
            }
            for (r = 0; r < nb; ++r) {
                ptrdiff_t pr = p + r;
                if (pr < qf[j] || pr >= qe[j])
                    continue;
                s[pr] = quant_k ? kvc_score_q8w(rows[r], ks + pr * ng, qj, hd, 32)
                                : kvc_dot_f32(qj, rows[r], hd);
            }
        }
    }
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

static inline void kvc_task_values(const float *probs, ptrdiff_t L, ptrdiff_t nq,
                                   const ptrdiff_t *qf, const ptrdiff_t *qe, const float *vf,
                                   const int8_t *vq, const float *vs, int quant_v, ptrdiff_t p0,
                                   ptrdiff_t p1, ptrdiff_t hd, float *acc, float *scratch)
{
    ptrdiff_t p, j, r;
    const float *rows[4] = {0, 0, 0, 0};
    memset(acc, 0, (size_t)(nq * hd) * sizeof(float));
    for (p = p0; p < p1; p += 4) {
        ptrdiff_t nb = p1 - p < 4 ? p1 - p : 4;
        if (p + KVC_PREFETCH_ROWS + 4 <= p1) {
            if (quant_v)
                kvc_prefetch_rows(vq, p + KVC_PREFETCH_ROWS, 4, hd);
            else
                kvc_prefetch_rows(vf, p + KVC_PREFETCH_ROWS, 4, hd * 4);
        }
        for (r = 0; r < nb; ++r) {
            if (quant_v) {
                kvc_widen_i8(vq + (p + r) * hd, scratch + r * hd, hd);
                rows[r] = scratch + r * hd;
            } else {
                rows[r] = vf + (p + r) * hd;
            }
        }
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

/* Quantise one row (x / col when col != NULL) in groups of `group` channels:
 * s = max(absmax / 127, 1e-12), q = clamp(round_half_away(r / s), -127, 127), NaN -> 0. */
static inline void kvc_quant_row(const float *restrict x, const float *restrict col, ptrdiff_t hd,
                                 ptrdiff_t group, int8_t *restrict q, float *restrict s)
{
    ptrdiff_t g0, d, gi = 0;
    for (g0 = 0; g0 < hd; g0 += group, ++gi) {
        ptrdiff_t g1 = hd - g0 < group ? hd : g0 + group;
        float absmax = 0.0f;
        for (d = g0; d < g1; ++d) {
            float r = col ? x[d] / col[d] : x[d];
            float a = fabsf(r);
            absmax = a > absmax ? a : absmax;
        }
        float sc = absmax / 127.0f;
        sc = sc > 1e-12f ? sc : 1e-12f;
        s[gi] = sc;
        for (d = g0; d < g1; ++d) {
            float r = col ? x[d] / col[d] : x[d];
            float v = roundf(r / sc);
            v = v > 127.0f ? 127.0f : v;
            v = v < -127.0f ? -127.0f : v;
            q[d] = (v == v) ? (int8_t)v : (int8_t)0;
        }
    }
}

#endif
