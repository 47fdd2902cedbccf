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

static inline float kvc_hsum16(float *acc)
{
    int w, l;
    for (w = KVC_LANES / 2; w > 0; w >>= 1)
        for (l = 0; l < w; ++l)
            acc[l] += acc[l + w];
    return acc[0];
}

static inline float kvc_dot_f32(const float *restrict a, const float *restrict b, ptrdiff_t n)
{
    float acc[KVC_LANES] = {0};
    float tail = 0.0f;
    ptrdiff_t i = 0;
    int l;
    for (; i + KVC_LANES <= n; i += KVC_LANES)
        for (l = 0; l < KVC_LANES; ++l)
            acc[l] += a[i + l] * b[i + l];
    for (; i < n; ++i)
        tail += a[i] * b[i];
    return kvc_hsum16(acc) + tail;
}

static inline float kvc_dot_i8(const int8_t *restrict a, const float *restrict b, ptrdiff_t n)
{
    float acc[KVC_LANES] = {0};
    float tail = 0.0f;
    ptrdiff_t i = 0;
    int l;
    for (; i + KVC_LANES <= n; i += KVC_LANES)
        for (l = 0; l < KVC_LANES; ++l)
            acc[l] += (float)a[i + l] * b[i + l];
    for (; i < n; ++i)
        tail += (float)a[i] * b[i];
    return kvc_hsum16(acc) + tail;
}

/* q8 score of one K row: sum over 32-channel groups of scale[g] * <kq_g, qc_g>, in group order.
 * The caller multiplies by the softmax scale. */
static inline float kvc_score_q8(const int8_t *restrict kq, const float *restrict ks,
                                 const float *restrict qc, ptrdiff_t hd, ptrdiff_t group)
{
    float s = 0.0f;
    ptrdiff_t g0, gi = 0;
    for (g0 = 0; g0 < hd; g0 += group, ++gi) {
        ptrdiff_t len = hd - g0 < group ? hd - g0 : group;
        s += ks[gi] * kvc_dot_i8(kq + g0, qc + g0, len);
    }
    return s;
}

static inline void kvc_axpy_f32(float *restrict y, float w, const float *restrict x, ptrdiff_t n)
{
    ptrdiff_t i;
    for (i = 0; i < n; ++i)
        y[i] += w * x[i];
}

static inline void kvc_axpy_i8(float *restrict y, float w, const int8_t *restrict x, ptrdiff_t n)
{
    ptrdiff_t i;
    for (i = 0; i < n; ++i)
        y[i] += w * (float)x[i];
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
