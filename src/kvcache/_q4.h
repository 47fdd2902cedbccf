/* 4-bit V rows (docs/kv4.md): the quantiser, the dequantiser and float16 conversion.
 *
 * A row of hd channels (hd % 8 == 0) is stored as
 *   codes  hd / 2 bytes: channels in chunks of 32 (the last chunk n = hd % 32 channels when
 *          that is not 0); in a chunk of n channels starting at c0, byte c0 / 2 + i
 *          (i < n / 2) holds channel c0 + i in its low nibble and c0 + n / 2 + i in its high
 *          nibble, so one load and two nibble masks give a chunk's channels in order;
 *   par    2 * ceil(hd / 16) float16 values (IEEE binary16 bits): per group of 16 channels
 *          (the last one 8 when hd % 16 == 8) its step s then its minimum m.
 *
 * Quantiser, per group (fixed arithmetic, no contraction; the NumPy twin is
 * kvcache.reference.quantize_v4):
 *   lo = min, hi = max of the group;   step = (hi - lo) / 15           (float32)
 *   m = f16(lo), s = f16(step)          (round to nearest, ties to even, as IEEE and NumPy)
 *   code = s > 0 ? clamp(floor((x - m) / s + 0.5), 0, 15) : 0   (m, s read back as float32)
 * A group holding a NaN or an infinity, or whose m or s is not finite in float16 (|lo| or the
 * step beyond 65504), is stored as m = s = NaN with codes 0, so that every output that weighs
 * the row shows NaN, as a float32 row with that value would.
 * Dequantiser: v = fmaf((float)code, s, m), one rounding.
 */
#ifndef KVCACHE_Q4_H
#define KVCACHE_Q4_H

#include "_vec.h"        /* kvc_f16_to_f32 */

#ifndef KVC_Q4_INLINE
#if defined(__GNUC__)
#define KVC_Q4_INLINE static inline __attribute__((always_inline))
#else
#define KVC_Q4_INLINE static inline
#endif
#endif

#define KVC_V4_GROUP 16
#define KVC_V4_NG(hd) (((hd) + KVC_V4_GROUP - 1) / KVC_V4_GROUP)
#define KVC_V4_NAN16 0x7e00u

/* float32 -> float16 bits, round to nearest, ties to even (overflow to infinity, NaN kept). */
KVC_Q4_INLINE uint16_t kvc_f32_to_f16(float f)
{
    uint32_t u, sign, a;
    memcpy(&u, &f, 4);
    sign = (u >> 16) & 0x8000u;
    a = u & 0x7fffffffu;
    if (a >= 0x7f800000u)                     /* infinity or NaN */
        return (uint16_t)(sign | (a > 0x7f800000u ? KVC_V4_NAN16 : 0x7c00u));
    if (a >= 0x477ff000u)                     /* >= 65520: rounds to infinity */
        return (uint16_t)(sign | 0x7c00u);
    if (a < 0x38800000u) {                    /* below 2^-14: a float16 subnormal (or 0) */
        float x;
        volatile float big = 8388608.0f;      /* 2^23: the add rounds to an integer, ties even */
        memcpy(&x, &a, 4);
        x = x * 16777216.0f;                  /* exact: times 2^24, < 2^10 */
        x = (x + big) - big;
        return (uint16_t)(sign | (uint32_t)x);
    }
    a -= 0x38000000u;                         /* rebias the exponent from 127 to 15 */
    a += 0x0fffu + ((a >> 13) & 1u);          /* round the 13 dropped bits, ties to even */
    return (uint16_t)(sign | (a >> 13));
}

/* The byte and nibble shift holding channel d of a row of hd channels (layout above). */
KVC_Q4_INLINE void kvc_v4_place(ptrdiff_t hd, ptrdiff_t d, ptrdiff_t *byte, int *shift)
{
    ptrdiff_t c0 = d & ~(ptrdiff_t)31, n = hd - c0 < 32 ? hd - c0 : 32, i = d - c0;
    *byte = c0 / 2 + (i < n / 2 ? i : i - n / 2);
    *shift = i < n / 2 ? 0 : 4;
}

/* A group's float16 step and minimum from its extremes lo, hi (bad: it holds a non-finite
 * value), or NaN for both when the group cannot be stored; returns whether it can. */
KVC_Q4_INLINE int kvc_q4_params_of(float lo, float hi, int bad, uint16_t *s16, uint16_t *m16)
{
    if (!bad) {
        *m16 = kvc_f32_to_f16(lo);
        *s16 = kvc_f32_to_f16((hi - lo) / 15.0f);
        bad = (*m16 & 0x7c00u) == 0x7c00u || (*s16 & 0x7c00u) == 0x7c00u;
    }
    if (bad)
        *s16 = *m16 = KVC_V4_NAN16;
    return !bad;
}

/* The code of x in a group with minimum m and step s > 0 (read back from float16). */
KVC_Q4_INLINE int kvc_q4_code(float x, float m, float s)
{
    float t = floorf((x - m) / s + 0.5f);
    return t < 0.0f ? 0 : t > 15.0f ? 15 : (int)t;
}

/* Quantise one row x (hd floats) into codes (hd / 2 bytes) and par (2 * KVC_V4_NG(hd)). */
static inline void kvc_v4_quant_row(const float *restrict x, ptrdiff_t hd, uint8_t *restrict codes,
                             uint16_t *restrict par)
{
    ptrdiff_t g, d;
    memset(codes, 0, (size_t)(hd / 2));
    for (g = 0; g * KVC_V4_GROUP < hd; ++g) {
        ptrdiff_t d0 = g * KVC_V4_GROUP, d1 = d0 + KVC_V4_GROUP < hd ? d0 + KVC_V4_GROUP : hd;
        float lo = x[d0], hi = x[d0], m, s;
        int bad = 0;
        uint16_t m16, s16;
        for (d = d0; d < d1; ++d) {
            float v = x[d];
            if (!isfinite(v))
                bad = 1;
            lo = v < lo ? v : lo;
            hi = v > hi ? v : hi;
        }
        int ok = kvc_q4_params_of(lo, hi, bad, &s16, &m16);
        par[2 * g] = s16;
        par[2 * g + 1] = m16;
        s = kvc_f16_to_f32(s16);
        m = kvc_f16_to_f32(m16);
        if (!ok || !(s > 0.0f))
            continue;                         /* a constant group (or a step below float16) */
        for (d = d0; d < d1; ++d) {
            ptrdiff_t byte;
            int shift;
            kvc_v4_place(hd, d, &byte, &shift);
            codes[byte] = (uint8_t)(codes[byte] | (kvc_q4_code(x[d], m, s) << shift));
        }
    }
}

/* ---------------------------------------------------------------------------------------
 * 4-bit K (docs/kv4.md): per channel over blocks of KVC_K4_BLOCK rows.  A KV head keeps
 * its last KVC_K4_RING rows as float32 in a ring (row p at slot p % KVC_K4_RING); when row p
 * completes a block (p % KVC_K4_BLOCK == KVC_K4_BLOCK - 1) the block is quantised from the
 * ring: per channel c over the block's rows, lo = min, hi = max, m = f16(lo),
 * s = f16((hi - lo) / 15), code = clamp(floor((x - m) / s + 0.5), 0, 15) (0 when s is 0), a
 * channel with a non-finite value or m, s beyond float16 stored as m = s = NaN (codes 0).
 * Codes: a block's KVC_K4_BLOCK * hd / 2 bytes (the store's rows of the block, taken as one
 * run of bytes) in channel octets, each octet's rows in order, four bytes per row:
 *   byte (c / 8) * 4 * KVC_K4_BLOCK + 4 * t + c % 4 holds channel c of row t of the block,
 *   in its low nibble when c % 8 < 4, else in its high nibble,
 * so one 32-byte load is eight rows x four channel pairs: the integer scorer's lanes.
 * Parameters: per block 2 * hd float16, the hd steps then the hd minimums.
 * ------------------------------------------------------------------------------------- */
#define KVC_K4_BLOCK 32
#define KVC_K4_RING 64     /* the open block and the 32 rows before it */

/* The byte and nibble shift of channel c of row t in a block's codes (layout above). */
KVC_Q4_INLINE ptrdiff_t kvc_k4_byte(ptrdiff_t t, ptrdiff_t c, int *shift)
{
    *shift = (int)(c % 8 / 4 * 4);
    return c / 8 * 4 * KVC_K4_BLOCK + 4 * t + c % 4;
}

/* Quantise the block of rows [p0, p0 + KVC_K4_BLOCK) held in ring (KVC_K4_RING x hd) into
 * codes (KVC_K4_BLOCK * hd / 2 bytes) and par (2 * hd). */
static inline void kvc_k4_quant_block(const float *restrict ring, ptrdiff_t p0, ptrdiff_t hd,
                                      uint8_t *restrict codes, uint16_t *restrict par)
{
    ptrdiff_t c, r;
    memset(codes, 0, (size_t)(KVC_K4_BLOCK * (hd / 2)));
    for (c = 0; c < hd; ++c) {
        float lo = ring[(p0 % KVC_K4_RING) * hd + c], hi = lo, m, s;
        int bad = 0, shift;
        uint16_t m16, s16;
        for (r = 0; r < KVC_K4_BLOCK; ++r) {
            float v = ring[((p0 + r) % KVC_K4_RING) * hd + c];
            if (!isfinite(v))
                bad = 1;
            lo = v < lo ? v : lo;
            hi = v > hi ? v : hi;
        }
        int ok = kvc_q4_params_of(lo, hi, bad, &s16, &m16);
        par[c] = s16;
        par[hd + c] = m16;
        s = kvc_f16_to_f32(s16);
        m = kvc_f16_to_f32(m16);
        if (!ok || !(s > 0.0f))
            continue;
        for (r = 0; r < KVC_K4_BLOCK; ++r) {
            int code = kvc_q4_code(ring[((p0 + r) % KVC_K4_RING) * hd + c], m, s);
            ptrdiff_t byte = kvc_k4_byte(r, c, &shift);
            codes[byte] = (uint8_t)(codes[byte] | (code << shift));
        }
    }
}

/* n float16 parameters as float32 (kvc_f8_from_f16 eight at a time: exact either way). */
KVC_Q4_INLINE void kvc_f16_row(const uint16_t *restrict par, ptrdiff_t n, float *restrict out)
{
    ptrdiff_t i = 0;
    for (; i + 8 <= n; i += 8)
        kvc_f8_store(out + i, kvc_f8_from_f16(par + i));
    for (; i < n; ++i)
        out[i] = kvc_f16_to_f32(par[i]);
}

/* A row's 2 * KVC_V4_NG(hd) parameters as float32 (step, minimum per group). */
KVC_Q4_INLINE void kvc_v4_params(const uint16_t *restrict par, ptrdiff_t hd, float *restrict out)
{
    kvc_f16_row(par, 2 * KVC_V4_NG(hd), out);
}

#endif
