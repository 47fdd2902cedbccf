/* The vector layer: the types and operations every kernel family is written against, one set
 * per target.  A kernel is written once on these names; the unit that compiles it picks the
 * target (below), and every target computes the same bits (docs/numerics.md):
 *
 *   KVC_VEC_PORTABLE  plain C over arrays of lanes (every machine; -DKVC_NO_SIMD forces it)
 *   KVC_VEC_AVX2      x86-64 AVX2 + FMA + F16C (__m256; the 16-lane type is a pair of them)
 *   KVC_VEC_AVX512    x86-64 AVX-512 F/BW/DQ/VL: the 8-lane type stays __m256 (EVEX-encoded,
 *                     32 registers), the 16-lane type is __m512
 *   KVC_VEC_NEON      aarch64 Advanced SIMD (float32x4_t pairs and quads)
 *
 * KVC_SIMD is 1 for every target but the portable one.  The target is taken from what the
 * compiler is building for: -DKVC_NO_SIMD, else aarch64, else the x86 features in effect
 * (`#pragma GCC target` defines __AVX2__/__AVX512F__; clang's `#pragma clang attribute`
 * defines nothing, so _body_avx2.c/_body_avx512.c also set KVC_UNIT_AVX2/KVC_UNIT_AVX512).
 *
 * Types (lanes): kvc_f8 (8 floats), kvc_m8 (8 lane masks), kvc_i8x (8 int32), kvc_f16 (16
 * floats).  Every operation is lane by lane with the IEEE result of its scalar twin (fma is
 * fused: fmaf), except the folds, whose order is fixed here and is the order of the portable
 * C (docs/numerics.md, "Summation orders"):
 *   kvc_f8_fold(a)            b[m] = a[2m] + a[2m+1] (m < 4), (b0 + b1) + (b2 + b3)
 *   kvc_f8_fold4(a0..a3, o)   o[r] = kvc_f8_fold(a_r)
 *   kvc_f16_fold(a)           c[l] = a[l] + a[l+8] (l < 8), then kvc_f8_fold(c)
 *   kvc_f8_fold16(lo, hi)     kvc_f16_fold of the 16 lanes lo, hi
 */
#ifndef KVCACHE_VEC_H
#define KVCACHE_VEC_H

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <stddef.h>

#if defined(__GNUC__)
#define KVC_INLINE static inline __attribute__((always_inline))
#define KVC_NOINLINE static __attribute__((noinline))
#else
#define KVC_INLINE static inline
#define KVC_NOINLINE static
#endif

#if defined(KVC_NO_SIMD)
#define KVC_VEC_PORTABLE 1
#elif defined(__aarch64__) && (defined(__GNUC__) || defined(__clang__))
#define KVC_VEC_NEON 1
#elif defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) \
    && ((defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) \
         && defined(__AVX512VL__) && defined(__FMA__) && defined(__F16C__)) \
        || defined(KVC_UNIT_AVX512))
#define KVC_VEC_AVX512 1
#elif defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) \
    && ((defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)) || defined(KVC_UNIT_AVX2))
#define KVC_VEC_AVX2 1
#else
#define KVC_VEC_PORTABLE 1
#endif

#ifndef KVC_VEC_PORTABLE
#define KVC_VEC_PORTABLE 0
#endif
#ifndef KVC_VEC_NEON
#define KVC_VEC_NEON 0
#endif
#ifndef KVC_VEC_AVX512
#define KVC_VEC_AVX512 0
#endif
#ifndef KVC_VEC_AVX2
#define KVC_VEC_AVX2 0
#endif
#define KVC_VEC_X86 (KVC_VEC_AVX2 || KVC_VEC_AVX512)
#define KVC_SIMD (!KVC_VEC_PORTABLE)

#if KVC_VEC_X86
#include <immintrin.h>
#define KVC_VEC_NAME (KVC_VEC_AVX512 ? "avx512" : "avx2")
#elif KVC_VEC_NEON
#include <arm_neon.h>
#define KVC_VEC_NAME "neon"
#else
#define KVC_VEC_NAME "portable"
#endif

/* ---------------------------------------------------------------------------------------
 * Scalar twins used by every target for tails and by the portable lanes.
 * ------------------------------------------------------------------------------------- */

/* exp(x) = 2^n * exp(r), x = n ln2 + r, |r| <= ln2/2: Cody-Waite reduction and a degree-6
 * polynomial, every step an explicit fused multiply-add so that the scalar and the vector
 * versions give the same bits.  exp(-inf) = 0, NaN propagates, below -87.3 flushes to 0,
 * above 88.7 is +inf.  Max error 1.42 ulp. */
#define KVC_EXP_LOG2E 1.44269504088896341f
#define KVC_EXP_LN2HI 0.693359375f
#define KVC_EXP_LN2LO -2.12194440e-4f
#define KVC_EXP_SHIFT 12582912.0f /* 1.5 * 2^23: adding it rounds to the nearest integer */
#define KVC_EXP_P0 1.9875691500e-4f
#define KVC_EXP_P1 1.3981999507e-3f
#define KVC_EXP_P2 8.3334519073e-3f
#define KVC_EXP_P3 4.1665795894e-2f
#define KVC_EXP_P4 1.6666665459e-1f
#define KVC_EXP_P5 5.0000001201e-1f
#define KVC_EXP_LO -87.33654f
#define KVC_EXP_HI 88.72283f

static inline float kvc_expf(float x)
{
    float xc = x > 88.0f ? 88.0f : x;
    xc = xc < -87.0f || xc != xc ? -87.0f : xc;
    float n = fmaf(xc, KVC_EXP_LOG2E, KVC_EXP_SHIFT) - KVC_EXP_SHIFT;
    float r = fmaf(-n, KVC_EXP_LN2HI, xc);
    r = fmaf(-n, KVC_EXP_LN2LO, r);
    float p = KVC_EXP_P0;
    p = fmaf(p, r, KVC_EXP_P1);
    p = fmaf(p, r, KVC_EXP_P2);
    p = fmaf(p, r, KVC_EXP_P3);
    p = fmaf(p, r, KVC_EXP_P4);
    p = fmaf(p, r, KVC_EXP_P5);
    p = fmaf(p * r, r, r) + 1.0f;
    int32_t ni = (int32_t)n;
    uint32_t bits = (uint32_t)(ni + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    float y = p * two_n;
    y = x < KVC_EXP_LO ? 0.0f : y;
    y = x > KVC_EXP_HI ? INFINITY : y;
    return x != x ? x : y;
}

/* IEEE binary16 bits -> float32, exactly (4-bit KV parameters, docs/kv4.md): the scalar twin
 * of kvc_f8_from_f16, which is the conversion instruction where the target has one (x86 F16C
 * vcvtph2ps, aarch64 fcvtl with FPCR.DN clear, as Linux and macOS leave it).  A normal half is
 * its bits moved into float32 position with the exponent rebiased (integer operations); a
 * subnormal one is its 10-bit significand times 2^-24, both operands and the product normal
 * float32 values, so a flush-to-zero or denormals-are-zero mode (which the instructions
 * ignore) cannot change it; exponent 31 is an infinity or a NaN, a NaN made quiet (bit 22 set,
 * its payload kept) as the instructions make it. */
static inline float kvc_f16_to_f32(uint16_t h)
{
    uint32_t em = (uint32_t)h & 0x7fffu, u;
    float f;
    if (em >= 0x7c00u) {
        u = 0x7f800000u | ((em & 0x3ffu) << 13) | (em > 0x7c00u ? 0x400000u : 0u);
        memcpy(&f, &u, 4);
    } else if (em >= 0x0400u) {
        u = (em << 13) + (112u << 23);
        memcpy(&f, &u, 4);
    } else {
        f = (float)em * 5.9604644775390625e-08f;   /* 2^-24 */
    }
    memcpy(&u, &f, 4);
    u |= ((uint32_t)h & 0x8000u) << 16;
    memcpy(&f, &u, 4);
    return f;
}

KVC_INLINE float kvc_hsum8(const float *a)
{
    float b0 = a[0] + a[1], b1 = a[2] + a[3], b2 = a[4] + a[5], b3 = a[6] + a[7];
    return (b0 + b1) + (b2 + b3);
}

KVC_INLINE float kvc_hsum16(const float *acc)
{
    float a[8];
    int l;
    for (l = 0; l < 8; ++l)
        a[l] = acc[l] + acc[l + 8];
    return kvc_hsum8(a);
}

/* ---------------------------------------------------------------------------------------
 * 8 float lanes
 * ------------------------------------------------------------------------------------- */
#if KVC_VEC_X86

typedef __m256 kvc_f8;
typedef __m256 kvc_m8;   /* all-ones / all-zeros lanes */
typedef __m256i kvc_i8x; /* 8 int32 lanes */

KVC_INLINE kvc_f8 kvc_f8_zero(void) { return _mm256_setzero_ps(); }
KVC_INLINE kvc_f8 kvc_f8_set1(float x) { return _mm256_set1_ps(x); }
KVC_INLINE kvc_f8 kvc_f8_bcast(const float *p) { return _mm256_broadcast_ss(p); }
KVC_INLINE kvc_f8 kvc_f8_load(const float *p) { return _mm256_loadu_ps(p); }
KVC_INLINE void kvc_f8_store(float *p, kvc_f8 v) { _mm256_storeu_ps(p, v); }
KVC_INLINE kvc_f8 kvc_f8_setr(float a, float b, float c, float d, float e, float f, float g,
                              float h) { return _mm256_setr_ps(a, b, c, d, e, f, g, h); }
KVC_INLINE kvc_f8 kvc_f8_fma(kvc_f8 a, kvc_f8 b, kvc_f8 c) { return _mm256_fmadd_ps(a, b, c); }
KVC_INLINE kvc_f8 kvc_f8_fnma(kvc_f8 a, kvc_f8 b, kvc_f8 c) { return _mm256_fnmadd_ps(a, b, c); }
KVC_INLINE kvc_f8 kvc_f8_add(kvc_f8 a, kvc_f8 b) { return _mm256_add_ps(a, b); }
KVC_INLINE kvc_f8 kvc_f8_sub(kvc_f8 a, kvc_f8 b) { return _mm256_sub_ps(a, b); }
KVC_INLINE kvc_f8 kvc_f8_mul(kvc_f8 a, kvc_f8 b) { return _mm256_mul_ps(a, b); }
KVC_INLINE kvc_f8 kvc_f8_div(kvc_f8 a, kvc_f8 b) { return _mm256_div_ps(a, b); }
KVC_INLINE kvc_m8 kvc_f8_gt(kvc_f8 a, kvc_f8 b) { return _mm256_cmp_ps(a, b, _CMP_GT_OQ); }
KVC_INLINE kvc_m8 kvc_f8_lt(kvc_f8 a, kvc_f8 b) { return _mm256_cmp_ps(a, b, _CMP_LT_OQ); }
KVC_INLINE kvc_m8 kvc_f8_eq(kvc_f8 a, kvc_f8 b) { return _mm256_cmp_ps(a, b, _CMP_EQ_OQ); }
KVC_INLINE kvc_m8 kvc_f8_isnan(kvc_f8 a) { return _mm256_cmp_ps(a, a, _CMP_UNORD_Q); }
KVC_INLINE kvc_m8 kvc_m8_or(kvc_m8 a, kvc_m8 b) { return _mm256_or_ps(a, b); }
/* m ? a : b, lane by lane */
KVC_INLINE kvc_f8 kvc_f8_sel(kvc_m8 m, kvc_f8 a, kvc_f8 b) { return _mm256_blendv_ps(b, a, m); }
KVC_INLINE kvc_i8x kvc_f8_trunc_i(kvc_f8 a) { return _mm256_cvttps_epi32(a); }
KVC_INLINE kvc_f8 kvc_i8x_to_f8(kvc_i8x a) { return _mm256_cvtepi32_ps(a); }
/* 2^n for integer n in [-126, 127] (the exponent field (n + 127) << 23) */
KVC_INLINE kvc_f8 kvc_i8x_pow2(kvc_i8x n)
{
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23));
}
KVC_INLINE kvc_i8x kvc_i8x_load(const int32_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
KVC_INLINE kvc_i8x kvc_i8x_set1(int32_t x) { return _mm256_set1_epi32(x); }
KVC_INLINE kvc_i8x kvc_i8x_add(kvc_i8x a, kvc_i8x b) { return _mm256_add_epi32(a, b); }
KVC_INLINE kvc_i8x kvc_i8x_sub(kvc_i8x a, kvc_i8x b) { return _mm256_sub_epi32(a, b); }
/* eight signed bytes widened to floats */
KVC_INLINE kvc_f8 kvc_f8_from_s8(const int8_t *p)
{
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* The low (shift 0) or high (shift 4) nibbles of the 8 bytes at p, as floats 0..15. */
KVC_INLINE kvc_f8 kvc_f8_from_u4(const uint8_t *p, int shift)
{
    __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(w, shift), _mm256_set1_epi32(15)));
}

/* Eight float16 values at p as float32, exactly (lane by lane kvc_f16_to_f32): F16C's
 * vcvtph2ps, which every x86 body needs (_isa.h). */
KVC_INLINE kvc_f8 kvc_f8_from_f16(const uint16_t *p)
{
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

/* Lanes holding integers in [-127, 127] (or NaN, stored as 0) as 8 int8 at dst. */
KVC_INLINE void kvc_f8_store_i8(int8_t *dst, kvc_f8 v)
{
    __m256i i = _mm256_cvttps_epi32(_mm256_blendv_ps(v, _mm256_setzero_ps(),
                                                     _mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
    _mm_storel_epi64((__m128i *)dst, _mm_packs_epi16(w, w));
}


KVC_INLINE float kvc_f8_fold(kvc_f8 a)
{
    __m256 h = _mm256_hadd_ps(a, a);
    h = _mm256_hadd_ps(h, h);
    return _mm_cvtss_f32(_mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}

/* out[r] = kvc_f8_fold(a_r) + t[r] for four accumulators (t: the in-order tails) */
KVC_INLINE void kvc_f8_fold4(kvc_f8 a0, kvc_f8 a1, kvc_f8 a2, kvc_f8 a3, const float *t,
                             float *out)
{
    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    _mm_storeu_ps(out, _mm_add_ps(s, _mm_loadu_ps(t)));
}

KVC_INLINE float kvc_f8_fold16(kvc_f8 lo, kvc_f8 hi) { return kvc_f8_fold(_mm256_add_ps(lo, hi)); }

#elif KVC_VEC_NEON

typedef float32x4x2_t kvc_f8;
typedef uint32x4x2_t kvc_m8;
typedef int32x4x2_t kvc_i8x;

#define KVC_N2(op, a, b) { { op((a).val[0], (b).val[0]), op((a).val[1], (b).val[1]) } }
KVC_INLINE kvc_f8 kvc_f8_zero(void) { kvc_f8 r = { { vdupq_n_f32(0.0f), vdupq_n_f32(0.0f) } }; return r; }
KVC_INLINE kvc_f8 kvc_f8_set1(float x) { kvc_f8 r = { { vdupq_n_f32(x), vdupq_n_f32(x) } }; return r; }
KVC_INLINE kvc_f8 kvc_f8_bcast(const float *p) { return kvc_f8_set1(*p); }
KVC_INLINE kvc_f8 kvc_f8_load(const float *p) { kvc_f8 r = { { vld1q_f32(p), vld1q_f32(p + 4) } }; return r; }
KVC_INLINE void kvc_f8_store(float *p, kvc_f8 v) { vst1q_f32(p, v.val[0]); vst1q_f32(p + 4, v.val[1]); }
KVC_INLINE kvc_f8 kvc_f8_setr(float a, float b, float c, float d, float e, float f, float g,
                              float h)
{
    float t[8] = {a, b, c, d, e, f, g, h};
    return kvc_f8_load(t);
}
/* vfmaq_f32(c, a, b) = c + a * b, fused */
KVC_INLINE kvc_f8 kvc_f8_fma(kvc_f8 a, kvc_f8 b, kvc_f8 c)
{
    kvc_f8 r = { { vfmaq_f32(c.val[0], a.val[0], b.val[0]), vfmaq_f32(c.val[1], a.val[1], b.val[1]) } };
    return r;
}
/* c - a * b, fused (vfmsq_f32) */
KVC_INLINE kvc_f8 kvc_f8_fnma(kvc_f8 a, kvc_f8 b, kvc_f8 c)
{
    kvc_f8 r = { { vfmsq_f32(c.val[0], a.val[0], b.val[0]), vfmsq_f32(c.val[1], a.val[1], b.val[1]) } };
    return r;
}
KVC_INLINE kvc_f8 kvc_f8_add(kvc_f8 a, kvc_f8 b) { kvc_f8 r = KVC_N2(vaddq_f32, a, b); return r; }
KVC_INLINE kvc_f8 kvc_f8_sub(kvc_f8 a, kvc_f8 b) { kvc_f8 r = KVC_N2(vsubq_f32, a, b); return r; }
KVC_INLINE kvc_f8 kvc_f8_mul(kvc_f8 a, kvc_f8 b) { kvc_f8 r = KVC_N2(vmulq_f32, a, b); return r; }
KVC_INLINE kvc_f8 kvc_f8_div(kvc_f8 a, kvc_f8 b) { kvc_f8 r = KVC_N2(vdivq_f32, a, b); return r; }
KVC_INLINE kvc_m8 kvc_f8_gt(kvc_f8 a, kvc_f8 b) { kvc_m8 r = KVC_N2(vcgtq_f32, a, b); return r; }
KVC_INLINE kvc_m8 kvc_f8_lt(kvc_f8 a, kvc_f8 b) { kvc_m8 r = KVC_N2(vcltq_f32, a, b); return r; }
KVC_INLINE kvc_m8 kvc_f8_eq(kvc_f8 a, kvc_f8 b) { kvc_m8 r = KVC_N2(vceqq_f32, a, b); return r; }
KVC_INLINE kvc_m8 kvc_f8_isnan(kvc_f8 a)
{
    kvc_m8 r = { { vmvnq_u32(vceqq_f32(a.val[0], a.val[0])), vmvnq_u32(vceqq_f32(a.val[1], a.val[1])) } };
    return r;
}
KVC_INLINE kvc_m8 kvc_m8_or(kvc_m8 a, kvc_m8 b) { kvc_m8 r = KVC_N2(vorrq_u32, a, b); return r; }
KVC_INLINE kvc_f8 kvc_f8_sel(kvc_m8 m, kvc_f8 a, kvc_f8 b)
{
    kvc_f8 r = { { vbslq_f32(m.val[0], a.val[0], b.val[0]), vbslq_f32(m.val[1], a.val[1], b.val[1]) } };
    return r;
}
/* vcvtq_s32_f32 rounds toward zero, as the C cast */
KVC_INLINE kvc_i8x kvc_f8_trunc_i(kvc_f8 a)
{
    kvc_i8x r = { { vcvtq_s32_f32(a.val[0]), vcvtq_s32_f32(a.val[1]) } };
    return r;
}
KVC_INLINE kvc_f8 kvc_i8x_to_f8(kvc_i8x a)
{
    kvc_f8 r = { { vcvtq_f32_s32(a.val[0]), vcvtq_f32_s32(a.val[1]) } };
    return r;
}
KVC_INLINE kvc_f8 kvc_i8x_pow2(kvc_i8x n)
{
    int32x4_t b = vdupq_n_s32(127);
    kvc_f8 r = { { vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(n.val[0], b), 23)),
                   vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(n.val[1], b), 23)) } };
    return r;
}
KVC_INLINE kvc_i8x kvc_i8x_load(const int32_t *p) { kvc_i8x r = { { vld1q_s32(p), vld1q_s32(p + 4) } }; return r; }
KVC_INLINE kvc_i8x kvc_i8x_set1(int32_t x) { kvc_i8x r = { { vdupq_n_s32(x), vdupq_n_s32(x) } }; return r; }
KVC_INLINE kvc_i8x kvc_i8x_add(kvc_i8x a, kvc_i8x b) { kvc_i8x r = KVC_N2(vaddq_s32, a, b); return r; }
KVC_INLINE kvc_i8x kvc_i8x_sub(kvc_i8x a, kvc_i8x b) { kvc_i8x r = KVC_N2(vsubq_s32, a, b); return r; }
KVC_INLINE kvc_f8 kvc_f8_from_s8(const int8_t *p)
{
    int16x8_t w = vmovl_s8(vld1_s8(p));
    kvc_f8 r = { { vcvtq_f32_s32(vmovl_s16(vget_low_s16(w))), vcvtq_f32_s32(vmovl_s16(vget_high_s16(w))) } };
    return r;
}
/* fcvtl, which every AArch64 CPU has (exact; with FPCR.DN clear, as Linux and macOS leave it,
 * a NaN made quiet with its sign and payload kept, as kvc_f16_to_f32 does) */
KVC_INLINE kvc_f8 kvc_f8_from_f16(const uint16_t *p)
{
    float16x8_t h = vreinterpretq_f16_u16(vld1q_u16(p));
    kvc_f8 r = { { vcvt_f32_f16(vget_low_f16(h)), vcvt_high_f32_f16(h) } };
    return r;
}
KVC_INLINE void kvc_f8_store_i8(int8_t *dst, kvc_f8 v)
{
    /* NaN converts to 0 (fcvtzs); the values are integers in [-127, 127] */
    int16x8_t w = vcombine_s16(vmovn_s32(vcvtq_s32_f32(v.val[0])), vmovn_s32(vcvtq_s32_f32(v.val[1])));
    vst1_s8(dst, vmovn_s16(w));
}
KVC_INLINE kvc_f8 kvc_f8_from_u4(const uint8_t *p, int shift)
{
    uint8x8_t b = vld1_u8(p);
    uint16x8_t w = vmovl_u8(shift ? vshr_n_u8(b, 4) : vand_u8(b, vdup_n_u8(15)));
    kvc_f8 r = { { vcvtq_f32_u32(vmovl_u16(vget_low_u16(w))), vcvtq_f32_u32(vmovl_u16(vget_high_u16(w))) } };
    return r;
}
#undef KVC_N2

/* vpaddq_f32(x, y) = {x0+x1, x2+x3, y0+y1, y2+y3}: the fold's pairs exactly */
KVC_INLINE float kvc_f8_fold(kvc_f8 a)
{
    float32x4_t b = vpaddq_f32(a.val[0], a.val[1]); /* b0 b1 b2 b3 */
    float32x4_t c = vpaddq_f32(b, b);               /* b0+b1, b2+b3 */
    return vgetq_lane_f32(c, 0) + vgetq_lane_f32(c, 1);
}

KVC_INLINE void kvc_f8_fold4(kvc_f8 a0, kvc_f8 a1, kvc_f8 a2, kvc_f8 a3, const float *t,
                             float *out)
{
    float32x4_t b0 = vpaddq_f32(a0.val[0], a0.val[1]), b1 = vpaddq_f32(a1.val[0], a1.val[1]);
    float32x4_t b2 = vpaddq_f32(a2.val[0], a2.val[1]), b3 = vpaddq_f32(a3.val[0], a3.val[1]);
    float32x4_t c01 = vpaddq_f32(b0, b1), c23 = vpaddq_f32(b2, b3); /* (b0+b1, b2+b3) per row */
    vst1q_f32(out, vaddq_f32(vpaddq_f32(c01, c23), vld1q_f32(t)));
}

KVC_INLINE float kvc_f8_fold16(kvc_f8 lo, kvc_f8 hi) { return kvc_f8_fold(kvc_f8_add(lo, hi)); }

#else /* portable */

typedef struct { float v[8]; } kvc_f8;
typedef struct { int32_t v[8]; } kvc_m8; /* 0 or -1 */
typedef struct { int32_t v[8]; } kvc_i8x;

#define KVC_P8(T, EXPR) { T r_; int l_; for (l_ = 0; l_ < 8; ++l_) r_.v[l_] = (EXPR); return r_; }
KVC_INLINE kvc_f8 kvc_f8_zero(void) KVC_P8(kvc_f8, 0.0f)
KVC_INLINE kvc_f8 kvc_f8_set1(float x) KVC_P8(kvc_f8, x)
KVC_INLINE kvc_f8 kvc_f8_bcast(const float *p) KVC_P8(kvc_f8, *p)
KVC_INLINE kvc_f8 kvc_f8_load(const float *p) KVC_P8(kvc_f8, p[l_])
KVC_INLINE void kvc_f8_store(float *p, kvc_f8 v) { memcpy(p, v.v, sizeof v.v); }
KVC_INLINE kvc_f8 kvc_f8_setr(float a, float b, float c, float d, float e, float f, float g,
                              float h)
{
    kvc_f8 r = { {a, b, c, d, e, f, g, h} };
    return r;
}
KVC_INLINE kvc_f8 kvc_f8_fma(kvc_f8 a, kvc_f8 b, kvc_f8 c) KVC_P8(kvc_f8, fmaf(a.v[l_], b.v[l_], c.v[l_]))
KVC_INLINE kvc_f8 kvc_f8_fnma(kvc_f8 a, kvc_f8 b, kvc_f8 c) KVC_P8(kvc_f8, fmaf(-a.v[l_], b.v[l_], c.v[l_]))
KVC_INLINE kvc_f8 kvc_f8_add(kvc_f8 a, kvc_f8 b) KVC_P8(kvc_f8, a.v[l_] + b.v[l_])
KVC_INLINE kvc_f8 kvc_f8_sub(kvc_f8 a, kvc_f8 b) KVC_P8(kvc_f8, a.v[l_] - b.v[l_])
KVC_INLINE kvc_f8 kvc_f8_mul(kvc_f8 a, kvc_f8 b) KVC_P8(kvc_f8, a.v[l_] * b.v[l_])
KVC_INLINE kvc_f8 kvc_f8_div(kvc_f8 a, kvc_f8 b) KVC_P8(kvc_f8, a.v[l_] / b.v[l_])
KVC_INLINE kvc_m8 kvc_f8_gt(kvc_f8 a, kvc_f8 b) KVC_P8(kvc_m8, a.v[l_] > b.v[l_] ? -1 : 0)
KVC_INLINE kvc_m8 kvc_f8_lt(kvc_f8 a, kvc_f8 b) KVC_P8(kvc_m8, a.v[l_] < b.v[l_] ? -1 : 0)
KVC_INLINE kvc_m8 kvc_f8_eq(kvc_f8 a, kvc_f8 b) KVC_P8(kvc_m8, a.v[l_] == b.v[l_] ? -1 : 0)
KVC_INLINE kvc_m8 kvc_f8_isnan(kvc_f8 a) KVC_P8(kvc_m8, a.v[l_] != a.v[l_] ? -1 : 0)
KVC_INLINE kvc_m8 kvc_m8_or(kvc_m8 a, kvc_m8 b) KVC_P8(kvc_m8, a.v[l_] | b.v[l_])
KVC_INLINE kvc_f8 kvc_f8_sel(kvc_m8 m, kvc_f8 a, kvc_f8 b) KVC_P8(kvc_f8, m.v[l_] ? a.v[l_] : b.v[l_])
KVC_INLINE kvc_i8x kvc_f8_trunc_i(kvc_f8 a) KVC_P8(kvc_i8x, (int32_t)a.v[l_])
KVC_INLINE kvc_f8 kvc_i8x_to_f8(kvc_i8x a) KVC_P8(kvc_f8, (float)a.v[l_])
KVC_INLINE kvc_f8 kvc_i8x_pow2(kvc_i8x n)
{
    kvc_f8 r;
    int l;
    for (l = 0; l < 8; ++l) {
        uint32_t bits = (uint32_t)(n.v[l] + 127) << 23;
        memcpy(&r.v[l], &bits, sizeof bits);
    }
    return r;
}
KVC_INLINE kvc_i8x kvc_i8x_load(const int32_t *p) KVC_P8(kvc_i8x, p[l_])
KVC_INLINE kvc_i8x kvc_i8x_set1(int32_t x) KVC_P8(kvc_i8x, x)
KVC_INLINE kvc_i8x kvc_i8x_add(kvc_i8x a, kvc_i8x b) KVC_P8(kvc_i8x, a.v[l_] + b.v[l_])
KVC_INLINE kvc_i8x kvc_i8x_sub(kvc_i8x a, kvc_i8x b) KVC_P8(kvc_i8x, a.v[l_] - b.v[l_])
KVC_INLINE kvc_f8 kvc_f8_from_s8(const int8_t *p) KVC_P8(kvc_f8, (float)p[l_])
KVC_INLINE kvc_f8 kvc_f8_from_u4(const uint8_t *p, int shift) KVC_P8(kvc_f8, (float)((p[l_] >> shift) & 15))
KVC_INLINE kvc_f8 kvc_f8_from_f16(const uint16_t *p) KVC_P8(kvc_f8, kvc_f16_to_f32(p[l_]))
KVC_INLINE void kvc_f8_store_i8(int8_t *dst, kvc_f8 v)
{
    int l;
    for (l = 0; l < 8; ++l)
        dst[l] = v.v[l] == v.v[l] ? (int8_t)v.v[l] : (int8_t)0;
}
#undef KVC_P8

KVC_INLINE float kvc_f8_fold(kvc_f8 a) { return kvc_hsum8(a.v); }

KVC_INLINE void kvc_f8_fold4(kvc_f8 a0, kvc_f8 a1, kvc_f8 a2, kvc_f8 a3, const float *t,
                             float *out)
{
    out[0] = kvc_hsum8(a0.v) + t[0];
    out[1] = kvc_hsum8(a1.v) + t[1];
    out[2] = kvc_hsum8(a2.v) + t[2];
    out[3] = kvc_hsum8(a3.v) + t[3];
}

KVC_INLINE float kvc_f8_fold16(kvc_f8 lo, kvc_f8 hi) { return kvc_f8_fold(kvc_f8_add(lo, hi)); }

#endif

/* Lane-wise operations written once on the layer. */

/* exp on 8 lanes: kvc_expf's steps lane by lane (the same bits) */
KVC_INLINE kvc_f8 kvc_f8_exp(kvc_f8 x)
{
    /* xc = x clamped to [-87, 88], NaN -> -87: maxps(x, -87) answers -87 for a NaN x and
     * NEON's fmaxnm the number, so one max and one min are kvc_expf's two selects */
#if KVC_VEC_X86
    kvc_f8 xc = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
#elif KVC_VEC_NEON
    float32x4_t lo = vdupq_n_f32(-87.0f), hi = vdupq_n_f32(88.0f);
    kvc_f8 xc = { { vminnmq_f32(vmaxnmq_f32(x.val[0], lo), hi),
                    vminnmq_f32(vmaxnmq_f32(x.val[1], lo), hi) } };
#else
    kvc_f8 xc = kvc_f8_sel(kvc_f8_gt(x, kvc_f8_set1(88.0f)), kvc_f8_set1(88.0f), x);
    xc = kvc_f8_sel(kvc_m8_or(kvc_f8_lt(xc, kvc_f8_set1(-87.0f)), kvc_f8_isnan(xc)),
                    kvc_f8_set1(-87.0f), xc);
#endif
    kvc_f8 sh = kvc_f8_set1(KVC_EXP_SHIFT);
    kvc_f8 n = kvc_f8_sub(kvc_f8_fma(xc, kvc_f8_set1(KVC_EXP_LOG2E), sh), sh);
    kvc_f8 r = kvc_f8_fnma(n, kvc_f8_set1(KVC_EXP_LN2HI), xc);
    r = kvc_f8_fnma(n, kvc_f8_set1(KVC_EXP_LN2LO), r);
    kvc_f8 p = kvc_f8_set1(KVC_EXP_P0);
    p = kvc_f8_fma(p, r, kvc_f8_set1(KVC_EXP_P1));
    p = kvc_f8_fma(p, r, kvc_f8_set1(KVC_EXP_P2));
    p = kvc_f8_fma(p, r, kvc_f8_set1(KVC_EXP_P3));
    p = kvc_f8_fma(p, r, kvc_f8_set1(KVC_EXP_P4));
    p = kvc_f8_fma(p, r, kvc_f8_set1(KVC_EXP_P5));
    p = kvc_f8_add(kvc_f8_fma(kvc_f8_mul(p, r), r, r), kvc_f8_set1(1.0f));
    kvc_f8 y = kvc_f8_mul(p, kvc_i8x_pow2(kvc_f8_trunc_i(n)));
    y = kvc_f8_sel(kvc_f8_lt(x, kvc_f8_set1(KVC_EXP_LO)), kvc_f8_zero(), y);
    y = kvc_f8_sel(kvc_f8_gt(x, kvc_f8_set1(KVC_EXP_HI)), kvc_f8_set1(INFINITY), y);
    return kvc_f8_sel(kvc_f8_isnan(x), x, y);
}

/* v where v > acc, else acc: a running max that ignores NaN in v (x86 maxps(v, acc) is exactly
 * this; NEON's fmax is not: it returns NaN for a NaN operand) */
KVC_INLINE kvc_f8 kvc_f8_max_num(kvc_f8 acc, kvc_f8 v)
{
#if KVC_VEC_X86
    return _mm256_max_ps(v, acc);
#else
    return kvc_f8_sel(kvc_f8_gt(v, acc), v, acc);
#endif
}

/* e, with 0 in the lanes where s is -inf (where e = exp(s - m) must be exactly 0) */
KVC_INLINE kvc_f8 kvc_f8_zero_neginf(kvc_f8 s, kvc_f8 e)
{
#if KVC_VEC_X86
    return _mm256_andnot_ps(_mm256_cmp_ps(s, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ), e);
#else
    return kvc_f8_sel(kvc_f8_eq(s, kvc_f8_set1(-INFINITY)), kvc_f8_zero(), e);
#endif
}

/* ---------------------------------------------------------------------------------------
 * 16 float lanes: __m512 on AVX-512, two 8-lane halves elsewhere (lanes 0-7 in lo).
 * ------------------------------------------------------------------------------------- */
#if KVC_VEC_AVX512

typedef __m512 kvc_f16;
KVC_INLINE kvc_f16 kvc_f16_zero(void) { return _mm512_setzero_ps(); }
KVC_INLINE kvc_f16 kvc_f16_set1(float x) { return _mm512_set1_ps(x); }
KVC_INLINE kvc_f16 kvc_f16_bcast(const float *p) { return _mm512_set1_ps(*p); }
KVC_INLINE kvc_f16 kvc_f16_load(const float *p) { return _mm512_loadu_ps(p); }
KVC_INLINE void kvc_f16_store(float *p, kvc_f16 v) { _mm512_storeu_ps(p, v); }
KVC_INLINE kvc_f16 kvc_f16_fma(kvc_f16 a, kvc_f16 b, kvc_f16 c) { return _mm512_fmadd_ps(a, b, c); }
KVC_INLINE kvc_f16 kvc_f16_add(kvc_f16 a, kvc_f16 b) { return _mm512_add_ps(a, b); }
KVC_INLINE kvc_f16 kvc_f16_sub(kvc_f16 a, kvc_f16 b) { return _mm512_sub_ps(a, b); }
KVC_INLINE kvc_f16 kvc_f16_mul(kvc_f16 a, kvc_f16 b) { return _mm512_mul_ps(a, b); }
KVC_INLINE kvc_f16 kvc_f16_div(kvc_f16 a, kvc_f16 b) { return _mm512_div_ps(a, b); }
/* kvc_f8_max_num on 16 lanes: v where v > acc, else acc (a NaN in v ignored) */
KVC_INLINE kvc_f16 kvc_f16_max_num(kvc_f16 acc, kvc_f16 v) { return _mm512_max_ps(v, acc); }
KVC_INLINE kvc_f8 kvc_f16_lo(kvc_f16 a) { return _mm512_castps512_ps256(a); }
KVC_INLINE kvc_f8 kvc_f16_hi(kvc_f16 a)
{
    return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
}
KVC_INLINE kvc_f16 kvc_f16_pair(kvc_f8 lo, kvc_f8 hi)
{
    return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
}
#else

typedef struct { kvc_f8 lo, hi; } kvc_f16;
KVC_INLINE kvc_f16 kvc_f16_pair(kvc_f8 lo, kvc_f8 hi) { kvc_f16 r; r.lo = lo; r.hi = hi; return r; }
KVC_INLINE kvc_f8 kvc_f16_lo(kvc_f16 a) { return a.lo; }
KVC_INLINE kvc_f8 kvc_f16_hi(kvc_f16 a) { return a.hi; }
KVC_INLINE kvc_f16 kvc_f16_zero(void) { return kvc_f16_pair(kvc_f8_zero(), kvc_f8_zero()); }
KVC_INLINE kvc_f16 kvc_f16_set1(float x) { return kvc_f16_pair(kvc_f8_set1(x), kvc_f8_set1(x)); }
KVC_INLINE kvc_f16 kvc_f16_bcast(const float *p) { return kvc_f16_set1(*p); }
KVC_INLINE kvc_f16 kvc_f16_load(const float *p) { return kvc_f16_pair(kvc_f8_load(p), kvc_f8_load(p + 8)); }
KVC_INLINE void kvc_f16_store(float *p, kvc_f16 v) { kvc_f8_store(p, v.lo); kvc_f8_store(p + 8, v.hi); }
KVC_INLINE kvc_f16 kvc_f16_fma(kvc_f16 a, kvc_f16 b, kvc_f16 c)
{
    return kvc_f16_pair(kvc_f8_fma(a.lo, b.lo, c.lo), kvc_f8_fma(a.hi, b.hi, c.hi));
}
KVC_INLINE kvc_f16 kvc_f16_add(kvc_f16 a, kvc_f16 b) { return kvc_f16_pair(kvc_f8_add(a.lo, b.lo), kvc_f8_add(a.hi, b.hi)); }
KVC_INLINE kvc_f16 kvc_f16_sub(kvc_f16 a, kvc_f16 b) { return kvc_f16_pair(kvc_f8_sub(a.lo, b.lo), kvc_f8_sub(a.hi, b.hi)); }
KVC_INLINE kvc_f16 kvc_f16_mul(kvc_f16 a, kvc_f16 b) { return kvc_f16_pair(kvc_f8_mul(a.lo, b.lo), kvc_f8_mul(a.hi, b.hi)); }
KVC_INLINE kvc_f16 kvc_f16_div(kvc_f16 a, kvc_f16 b)
{
    return kvc_f16_pair(kvc_f8_div(a.lo, b.lo), kvc_f8_div(a.hi, b.hi));
}
KVC_INLINE kvc_f16 kvc_f16_max_num(kvc_f16 acc, kvc_f16 v)
{
    return kvc_f16_pair(kvc_f8_max_num(acc.lo, v.lo), kvc_f8_max_num(acc.hi, v.hi));
}

#endif

#if KVC_VEC_AVX512
/* exp on 16 lanes: kvc_f8_exp's x86 steps on one __m512 (the same bits), its selects as
 * mask moves.  Not two kvc_f8_exp on the halves: their compares into vector masks and their
 * blendv are VEX-only instructions, which reach only the low 16 of the 32 registers, so the
 * compiler copied values in and out around them (about 20 more instructions per vector). */
KVC_INLINE kvc_f16 kvc_f16_exp(kvc_f16 x)
{
    __m512 xc = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
    __m512 sh = _mm512_set1_ps(KVC_EXP_SHIFT);
    __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(xc, _mm512_set1_ps(KVC_EXP_LOG2E), sh), sh);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(KVC_EXP_LN2HI), xc);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(KVC_EXP_LN2LO), r);
    __m512 p = _mm512_set1_ps(KVC_EXP_P0);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(KVC_EXP_P1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(KVC_EXP_P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(KVC_EXP_P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(KVC_EXP_P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(KVC_EXP_P5));
    p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n),
                                                   _mm512_set1_epi32(127)), 23);
    __m512 y = _mm512_mul_ps(p, _mm512_castsi512_ps(e));
    y = _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(x, _mm512_set1_ps(KVC_EXP_LO), _CMP_LT_OQ),
                           _mm512_setzero_ps());
    y = _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(x, _mm512_set1_ps(KVC_EXP_HI), _CMP_GT_OQ),
                           _mm512_set1_ps(INFINITY));
    return _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x);
}
KVC_INLINE kvc_f16 kvc_f16_zero_neginf(kvc_f16 s, kvc_f16 e)
{
    return _mm512_mask_mov_ps(e, _mm512_cmp_ps_mask(s, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ),
                              _mm512_setzero_ps());
}
#else
KVC_INLINE kvc_f16 kvc_f16_exp(kvc_f16 a)
{
    return kvc_f16_pair(kvc_f8_exp(kvc_f16_lo(a)), kvc_f8_exp(kvc_f16_hi(a)));
}
KVC_INLINE kvc_f16 kvc_f16_zero_neginf(kvc_f16 s, kvc_f16 e)
{
    return kvc_f16_pair(kvc_f8_zero_neginf(kvc_f16_lo(s), kvc_f16_lo(e)),
                        kvc_f8_zero_neginf(kvc_f16_hi(s), kvc_f16_hi(e)));
}
#endif
KVC_INLINE float kvc_f16_fold(kvc_f16 a) { return kvc_f8_fold16(kvc_f16_lo(a), kvc_f16_hi(a)); }

/* ---------------------------------------------------------------------------------------
 * int8 dot products (q8 scoring).  kvc_i8_dot32x8 forms, for one 32-byte chunk of query
 * codes q and eight rows of key codes (row r at k + r * stride), the exact int32 sums
 *   lo[r] = sum_{c < 16} q[c] k_r[c],   hi[r] = sum_{16 <= c < 32} q[c] k_r[c]
 * (integer sums: every target gives the same values).  q codes are in [-127, 127], k codes in
 * [-128, 127].  qs_lo / qs_hi are sum q[c] over the two halves (or, where only lo + hi is
 * used, their total in qs_lo and 0 in qs_hi): the VNNI forms need them.  The forms:
 *   KVC_I8_SCALAR    plain C (the portable target)
 *   KVC_I8_MADDUBS   AVX2: vpmaddubsw(|k|, sign(q, k)) -- |k| <= 128 unsigned, q sign(k) in
 *                    [-127, 127], each int16 pair sum at most 2 * 128 * 127 = 32512 -- then
 *                    vpmaddwd with ones
 *   KVC_I8_VNNI      vpdpbusd(0, k ^ 0x80, q) = sum (k + 128) q, minus 128 * sum q (exact):
 *                    VEX (AVX-VNNI unit) or EVEX (AVX-512 unit) encoding; with
 *                    KVC_EMULATE_VNNI (tests/c only) an exact AVX2 emulation of vpdpbusd
 *   KVC_I8_SMULL     NEON: vmull_s8 + vmlal_s8 (two products per int16 lane, <= 32512),
 *                    then pairwise widening adds
 *   KVC_I8_SDOT      NEON with the dot-product extension: vdotq_s32
 * ------------------------------------------------------------------------------------- */
#define KVC_I8_SCALAR 0
#define KVC_I8_MADDUBS 1
#define KVC_I8_VNNI 2
#define KVC_I8_SMULL 3
#define KVC_I8_SDOT 4

#if KVC_VEC_X86
#if KVC_VEC_AVX512 || defined(KVC_EMULATE_VNNI) || defined(__AVXVNNI__) || defined(KVC_UNIT_AVXVNNI)
#define KVC_VEC_I8 KVC_I8_VNNI
#else
#define KVC_VEC_I8 KVC_I8_MADDUBS
#endif
#elif KVC_VEC_NEON
#if defined(KVC_UNIT_NEON)   /* the NEON unit: smull whatever the baseline (_body_neon.c) */
#define KVC_VEC_I8 KVC_I8_SMULL
#elif defined(__ARM_FEATURE_DOTPROD) || defined(KVC_UNIT_NEONDOT)
#define KVC_VEC_I8 KVC_I8_SDOT
#else
#define KVC_VEC_I8 KVC_I8_SMULL
#endif
#else
#define KVC_VEC_I8 KVC_I8_SCALAR
#endif

#if KVC_VEC_I8 == KVC_I8_VNNI
#if defined(KVC_EMULATE_VNNI)
/* vpdpbusd: acc + per 32-bit lane the sum of the four products (unsigned byte of a) x (signed
 * byte of b), exact: every product and pair sum fits int16 x int16 -> int32 (vpmaddwd). */
KVC_INLINE __m256i kvc_dpbusd(__m256i acc, __m256i a, __m256i b)
{
    __m256i a_even = _mm256_and_si256(a, _mm256_set1_epi16(0x00FF));
    __m256i a_odd = _mm256_srli_epi16(a, 8);
    __m256i b_even = _mm256_srai_epi16(_mm256_slli_epi16(b, 8), 8);
    __m256i b_odd = _mm256_srai_epi16(b, 8);
    return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(a_even, b_even),
                                                  _mm256_madd_epi16(a_odd, b_odd)));
}
#elif KVC_VEC_AVX512
KVC_INLINE __m256i kvc_dpbusd(__m256i acc, __m256i a, __m256i b) { return _mm256_dpbusd_epi32(acc, a, b); }
#else
KVC_INLINE __m256i kvc_dpbusd(__m256i acc, __m256i a, __m256i b) { return _mm256_dpbusd_avx_epi32(acc, a, b); }
#endif
#endif

#if KVC_VEC_X86
KVC_INLINE void kvc_i8_dot32x8(const int8_t *restrict q, const int8_t *restrict k,
                               ptrdiff_t stride, int32_t qs_lo, int32_t qs_hi, kvc_i8x *lo,
                               kvc_i8x *hi)
{
    const __m256i qv = _mm256_loadu_si256((const __m256i *)q);
    __m256i m[8];
    int r;
#if KVC_VEC_I8 == KVC_I8_VNNI
    const __m256i x80 = _mm256_set1_epi8((char)0x80);
#else
    const __m256i ones = _mm256_set1_epi16(1);
    (void)qs_lo, (void)qs_hi;
#endif
#pragma GCC unroll 8
    for (r = 0; r < 8; ++r) {
        __m256i kv = _mm256_loadu_si256((const __m256i *)(k + r * stride));
#if KVC_VEC_I8 == KVC_I8_VNNI
        m[r] = kvc_dpbusd(_mm256_setzero_si256(), _mm256_xor_si256(kv, x80), qv);
#else
        m[r] = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(kv), _mm256_sign_epi8(qv, kv)),
                                 ones);
#endif
    }
    /* lane l of m[r]: channels 4l..4l+3 of row r; reduce to rows x (lanes 0-3, lanes 4-7) */
    __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(m[0], m[1]), _mm256_hadd_epi32(m[2], m[3]));
    __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(m[4], m[5]), _mm256_hadd_epi32(m[6], m[7]));
    *lo = _mm256_permute2x128_si256(a, b, 0x20);
    *hi = _mm256_permute2x128_si256(a, b, 0x31);
#if KVC_VEC_I8 == KVC_I8_VNNI
    *lo = _mm256_sub_epi32(*lo, _mm256_set1_epi32(128 * qs_lo));
    *hi = _mm256_sub_epi32(*hi, _mm256_set1_epi32(128 * qs_hi));
#endif
}

#elif KVC_VEC_NEON

/* four int32 partial sums of 16 channels of one row */
KVC_INLINE int32x4_t kvc_i8_part16(int8x16_t q, int8x16_t k)
{
#if KVC_VEC_I8 == KVC_I8_SDOT
    return vdotq_s32(vdupq_n_s32(0), q, k);
#else
    int16x8_t p = vmull_s8(vget_low_s8(q), vget_low_s8(k));
    p = vmlal_s8(p, vget_high_s8(q), vget_high_s8(k));
    return vpaddlq_s16(p);
#endif
}

KVC_INLINE void kvc_i8_dot32x8(const int8_t *restrict q, const int8_t *restrict k,
                               ptrdiff_t stride, int32_t qs_lo, int32_t qs_hi, kvc_i8x *lo,
                               kvc_i8x *hi)
{
    const int8x16_t q0 = vld1q_s8(q), q1 = vld1q_s8(q + 16);
    int32x4_t l[8], h[8];
    int r;
    (void)qs_lo, (void)qs_hi;
#pragma GCC unroll 8
    for (r = 0; r < 8; ++r) {
        l[r] = kvc_i8_part16(q0, vld1q_s8(k + r * stride));
        h[r] = kvc_i8_part16(q1, vld1q_s8(k + r * stride + 16));
    }
    lo->val[0] = vpaddq_s32(vpaddq_s32(l[0], l[1]), vpaddq_s32(l[2], l[3]));
    lo->val[1] = vpaddq_s32(vpaddq_s32(l[4], l[5]), vpaddq_s32(l[6], l[7]));
    hi->val[0] = vpaddq_s32(vpaddq_s32(h[0], h[1]), vpaddq_s32(h[2], h[3]));
    hi->val[1] = vpaddq_s32(vpaddq_s32(h[4], h[5]), vpaddq_s32(h[6], h[7]));
}

#else

KVC_INLINE void kvc_i8_dot32x8(const int8_t *restrict q, const int8_t *restrict k,
                               ptrdiff_t stride, int32_t qs_lo, int32_t qs_hi, kvc_i8x *lo,
                               kvc_i8x *hi)
{
    int r, c;
    (void)qs_lo, (void)qs_hi;
    for (r = 0; r < 8; ++r) {
        int32_t a = 0, b = 0;
        for (c = 0; c < 16; ++c) {
            a += (int32_t)q[c] * (int32_t)k[r * stride + c];
            b += (int32_t)q[c + 16] * (int32_t)k[r * stride + c + 16];
        }
        lo->v[r] = a;
        hi->v[r] = b;
    }
}

#endif

/* ---------------------------------------------------------------------------------------
 * 4-bit K in blocks (docs/kv4.md, "4-bit K"): lanes = eight rows, four code bytes per lane.
 *   kvc_i8x_loadb(p)        the 32 bytes at p as eight int32 lanes (lane l: bytes 4l..4l+3,
 *                           byte i its bits 8i..8i+7: the targets are little-endian)
 *   kvc_i8x_srl_and(v, s, m) per lane (v >> s) & m, a logical shift
 *   kvc_i8x_nib(v, sh)      per lane (v >> sh) & 0x0f0f0f0f, sh 0 or 4: the four low (or
 *                           high) nibbles of the lane's bytes, each a byte in [0, 15]
 *   kvc_i8x_field(v, sh)    per lane (v >> sh) & 15, sh a multiple of 4 below 32
 *   kvc_i8x_dp4(acc, u, w)  per lane acc + sum_{i < 4} byte_i(u) * sbyte_i(w): the bytes of u
 *                           in [0, 15] (unsigned), w four int8 codes in [-127, 127] (the same w
 *                           in every lane); exact int32, so every target gives the same values.
 *                           VNNI: vpdpbusd; AVX2: vpmaddubsw (pair sums at most 2 * 15 * 127)
 *                           then vpmaddwd with ones; NEON: sdot, or smull and pairwise adds.
 *   kvc_i8x_dp16(u0, w0, .., u3, w3)  per lane the sum of the sixteen products of the four
 *                           dp4 terms (u_i, w_i), from zero: exactly the int32 value of four
 *                           chained kvc_i8x_dp4.  AVX2 adds the four vpmaddubsw results as int16
 *                           (at most 4 * 2 * 15 * 127 = 15240 in magnitude, no wrap) before one
 *                           vpmaddwd: 8 instructions where four dp4s take 12; the other
 *                           targets chain their dp4.
 * ------------------------------------------------------------------------------------- */
#if KVC_VEC_X86
KVC_INLINE kvc_i8x kvc_i8x_loadb(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
KVC_INLINE kvc_i8x kvc_i8x_srl_and(kvc_i8x v, int sh, uint32_t mask)
{
    return _mm256_and_si256(_mm256_srli_epi32(v, sh), _mm256_set1_epi32((int32_t)mask));
}
KVC_INLINE kvc_i8x kvc_i8x_dp4(kvc_i8x acc, kvc_i8x u, int32_t w)
{
#if KVC_VEC_I8 == KVC_I8_VNNI
    return kvc_dpbusd(acc, u, _mm256_set1_epi32(w));
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, _mm256_set1_epi32(w)),
                                                   _mm256_set1_epi16(1)));
#endif
}
#if KVC_VEC_I8 != KVC_I8_VNNI
KVC_INLINE kvc_i8x kvc_i8x_dp16(kvc_i8x u0, int32_t w0, kvc_i8x u1, int32_t w1, kvc_i8x u2,
                                int32_t w2, kvc_i8x u3, int32_t w3)
{
    __m256i a = _mm256_add_epi16(_mm256_maddubs_epi16(u0, _mm256_set1_epi32(w0)),
                                 _mm256_maddubs_epi16(u1, _mm256_set1_epi32(w1)));
    __m256i b = _mm256_add_epi16(_mm256_maddubs_epi16(u2, _mm256_set1_epi32(w2)),
                                 _mm256_maddubs_epi16(u3, _mm256_set1_epi32(w3)));
    return _mm256_madd_epi16(_mm256_add_epi16(a, b), _mm256_set1_epi16(1));
}
#endif
#elif KVC_VEC_NEON
KVC_INLINE kvc_i8x kvc_i8x_loadb(const uint8_t *p)
{
    kvc_i8x r = { { vreinterpretq_s32_u8(vld1q_u8(p)), vreinterpretq_s32_u8(vld1q_u8(p + 16)) } };
    return r;
}
KVC_INLINE int32x4_t kvc_neon_srl_and(int32x4_t v, int sh, uint32_t mask)
{
    uint32x4_t u = vshlq_u32(vreinterpretq_u32_s32(v), vdupq_n_s32(-sh));
    return vreinterpretq_s32_u32(vandq_u32(u, vdupq_n_u32(mask)));
}
KVC_INLINE kvc_i8x kvc_i8x_srl_and(kvc_i8x v, int sh, uint32_t mask)
{
    kvc_i8x r = { { kvc_neon_srl_and(v.val[0], sh, mask), kvc_neon_srl_and(v.val[1], sh, mask) } };
    return r;
}
KVC_INLINE int32x4_t kvc_neon_dp4(int32x4_t acc, int32x4_t u, int8x16_t w)
{
#if KVC_VEC_I8 == KVC_I8_SDOT
    return vdotq_s32(acc, vreinterpretq_s8_s32(u), w);
#else
    int8x16_t b = vreinterpretq_s8_s32(u);
    int16x8_t lo = vmull_s8(vget_low_s8(b), vget_low_s8(w));
    int16x8_t hi = vmull_s8(vget_high_s8(b), vget_high_s8(w));
    return vaddq_s32(acc, vpaddq_s32(vpaddlq_s16(lo), vpaddlq_s16(hi)));
#endif
}
KVC_INLINE kvc_i8x kvc_i8x_dp4(kvc_i8x acc, kvc_i8x u, int32_t w)
{
    int8x16_t wv = vreinterpretq_s8_s32(vdupq_n_s32(w));
    kvc_i8x r = { { kvc_neon_dp4(acc.val[0], u.val[0], wv), kvc_neon_dp4(acc.val[1], u.val[1], wv) } };
    return r;
}
#else
KVC_INLINE kvc_i8x kvc_i8x_loadb(const uint8_t *p)
{
    kvc_i8x r;
    memcpy(r.v, p, sizeof r.v);
    return r;
}
KVC_INLINE kvc_i8x kvc_i8x_srl_and(kvc_i8x v, int sh, uint32_t mask)
{
    kvc_i8x r;
    int l;
    for (l = 0; l < 8; ++l)
        r.v[l] = (int32_t)(((uint32_t)v.v[l] >> sh) & mask);
    return r;
}
/* u's bytes read as signed: they are in [0, 15], so signed and unsigned reads agree, and
 * kvc_i8x_dp4k (signed key codes) is this same loop */
KVC_INLINE kvc_i8x kvc_i8x_dp4(kvc_i8x acc, kvc_i8x u, int32_t w)
{
    int8_t ub[32], wb[4];
    int l, i;
    memcpy(ub, u.v, 32);
    memcpy(wb, &w, 4);
    for (l = 0; l < 8; ++l) {
        int32_t s = 0;
        for (i = 0; i < 4; ++i)
            s += (int32_t)ub[4 * l + i] * (int32_t)wb[i];
        acc.v[l] += s;
    }
    return acc;
}
#endif
#if !KVC_VEC_X86 || KVC_VEC_I8 == KVC_I8_VNNI    /* AVX2's own form is above */
KVC_INLINE kvc_i8x kvc_i8x_dp16(kvc_i8x u0, int32_t w0, kvc_i8x u1, int32_t w1, kvc_i8x u2,
                                int32_t w2, kvc_i8x u3, int32_t w3)
{
    return kvc_i8x_dp4(kvc_i8x_dp4(kvc_i8x_dp4(kvc_i8x_dp4(kvc_i8x_set1(0), u0, w0), u1, w1),
                                   u2, w2), u3, w3);
}
#endif
KVC_INLINE kvc_i8x kvc_i8x_nib(kvc_i8x v, int sh) { return kvc_i8x_srl_and(v, sh, 0x0f0f0f0fu); }
KVC_INLINE kvc_i8x kvc_i8x_field(kvc_i8x v, int sh) { return kvc_i8x_srl_and(v, sh, 15u); }

/* --- operations added for quantisation --- */

/* |a| lane by lane (fabsf: clears the sign bit, NaN stays NaN) */
KVC_INLINE kvc_f8 kvc_f8_abs(kvc_f8 a)
{
#if KVC_VEC_X86
    return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a);
#elif KVC_VEC_NEON
    kvc_f8 r = { { vabsq_f32(a.val[0]), vabsq_f32(a.val[1]) } };
    return r;
#else
    kvc_f8 r;
    int l;
    for (l = 0; l < 8; ++l)
        r.v[l] = fabsf(a.v[l]);
    return r;
#endif
}

/* roundf lane by lane: to the nearest integer, halfway cases away from zero.  x86 has no such
 * rounding mode: t = trunc(a), then t + sign(a) where |a - t| >= 0.5 (a - t is exact; for
 * |a| >= 2^23, inf and NaN, a - t is 0 or NaN and t is the answer). */
KVC_INLINE kvc_f8 kvc_f8_round(kvc_f8 a)
{
#if KVC_VEC_X86
    __m256 t = _mm256_round_ps(a, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    __m256 half = _mm256_cmp_ps(kvc_f8_abs(_mm256_sub_ps(a, t)), _mm256_set1_ps(0.5f), _CMP_GE_OQ);
    __m256 one = _mm256_or_ps(_mm256_set1_ps(1.0f), _mm256_and_ps(a, _mm256_set1_ps(-0.0f)));
    return _mm256_blendv_ps(t, _mm256_add_ps(t, one), half);
#elif KVC_VEC_NEON
    kvc_f8 r = { { vrndaq_f32(a.val[0]), vrndaq_f32(a.val[1]) } };
    return r;
#else
    kvc_f8 r;
    int l;
    for (l = 0; l < 8; ++l)
        r.v[l] = roundf(a.v[l]);
    return r;
#endif
}

/* To the nearest integer, halfway cases to even, whatever the floating-point environment's
 * rounding mode (x86 roundps with an explicit mode, NEON frintn, C from floorf: x - floor(x)
 * is exact).  NaN stays NaN. */
KVC_INLINE kvc_f8 kvc_f8_round_even(kvc_f8 a)
{
#if KVC_VEC_X86
    return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#elif KVC_VEC_NEON
    kvc_f8 r = { { vrndnq_f32(a.val[0]), vrndnq_f32(a.val[1]) } };
    return r;
#else
    kvc_f8 r;
    int l;
    for (l = 0; l < 8; ++l) {
        float t = floorf(a.v[l]), d = a.v[l] - t;
        r.v[l] = d > 0.5f || (d == 0.5f && fmodf(t, 2.0f) != 0.0f) ? t + 1.0f : t;
    }
    return r;
#endif
}

/* dst[l] = (int8_t)v[l] for lanes holding integers in [-128, 127] (no NaN: the callers check). */
KVC_INLINE void kvc_f8_store_i8_int(int8_t *dst, kvc_f8 v)
{
#if KVC_VEC_AVX512
    _mm_storel_epi64((__m128i *)dst, _mm256_cvtsepi32_epi8(_mm256_cvttps_epi32(v)));
#elif KVC_VEC_X86
    __m256i i = _mm256_cvttps_epi32(v);
    __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
    _mm_storel_epi64((__m128i *)dst, _mm_packs_epi16(w, w));
#else
    kvc_f8_store_i8(dst, v);
#endif
}

/* --- operations added for the prompt kernel --- */
/* Exact semantics, lane by lane, on every target:
 *   kvc_f8_ge(a, b)        a >= b (false where either lane is NaN, like kvc_f8_lt)
 *   kvc_m8_and(m, n)       m & n
 *   kvc_f8_fold_max(a)     the largest lane in a fixed order, with mx(x, y) = x > y ? x : y
 *                          (y when x == y or either is NaN: x86's maxps): b[l] = mx(a[l], a[l+4])
 *                          for l < 4, then mx(mx(b[0], b[2]), mx(b[1], b[3])).  The order shows
 *                          only in the sign of a zero result and in which NaN (if any) is kept.
 *   kvc_f8_transpose8(r)   r[0..7] in place, an 8 x 8 transpose: afterwards lane j of r[i] is
 *                          what lane i of r[j] was (copies only, no arithmetic). */
KVC_INLINE float kvc_max_gt(float x, float y) { return x > y ? x : y; }

#if KVC_VEC_X86

KVC_INLINE kvc_m8 kvc_f8_ge(kvc_f8 a, kvc_f8 b) { return _mm256_cmp_ps(a, b, _CMP_GE_OQ); }
KVC_INLINE kvc_m8 kvc_m8_and(kvc_m8 a, kvc_m8 b) { return _mm256_and_ps(a, b); }
/* _mm256_max_ps(x, y) is mx(x, y): the second operand when equal or unordered */
KVC_INLINE float kvc_f8_fold_max(kvc_f8 a)
{
    __m256 m = _mm256_max_ps(a, _mm256_permute2f128_ps(a, a, 0x01)); /* lanes l, l ^ 4 */
    m = _mm256_max_ps(m, _mm256_permute_ps(m, 0x4E));                /* l, l ^ 2 */
    m = _mm256_max_ps(m, _mm256_permute_ps(m, 0xB1));                /* l, l ^ 1 */
    return _mm_cvtss_f32(_mm256_castps256_ps128(m));
}
KVC_INLINE void kvc_f8_transpose8(kvc_f8 *r)
{
    __m256 b0 = _mm256_unpacklo_ps(r[0], r[1]), b1 = _mm256_unpackhi_ps(r[0], r[1]);
    __m256 b2 = _mm256_unpacklo_ps(r[2], r[3]), b3 = _mm256_unpackhi_ps(r[2], r[3]);
    __m256 b4 = _mm256_unpacklo_ps(r[4], r[5]), b5 = _mm256_unpackhi_ps(r[4], r[5]);
    __m256 b6 = _mm256_unpacklo_ps(r[6], r[7]), b7 = _mm256_unpackhi_ps(r[6], r[7]);
    /* c0: lanes 0 and 4 of rows 0-3, c1: lanes 1 and 5, c2: 2 and 6, c3: 3 and 7 (c4-c7:
     * the same of rows 4-7), one 128-bit half each */
    __m256 c0 = _mm256_shuffle_ps(b0, b2, 0x44), c1 = _mm256_shuffle_ps(b0, b2, 0xEE);
    __m256 c2 = _mm256_shuffle_ps(b1, b3, 0x44), c3 = _mm256_shuffle_ps(b1, b3, 0xEE);
    __m256 c4 = _mm256_shuffle_ps(b4, b6, 0x44), c5 = _mm256_shuffle_ps(b4, b6, 0xEE);
    __m256 c6 = _mm256_shuffle_ps(b5, b7, 0x44), c7 = _mm256_shuffle_ps(b5, b7, 0xEE);
    r[0] = _mm256_permute2f128_ps(c0, c4, 0x20);
    r[1] = _mm256_permute2f128_ps(c1, c5, 0x20);
    r[2] = _mm256_permute2f128_ps(c2, c6, 0x20);
    r[3] = _mm256_permute2f128_ps(c3, c7, 0x20);
    r[4] = _mm256_permute2f128_ps(c0, c4, 0x31);
    r[5] = _mm256_permute2f128_ps(c1, c5, 0x31);
    r[6] = _mm256_permute2f128_ps(c2, c6, 0x31);
    r[7] = _mm256_permute2f128_ps(c3, c7, 0x31);
}

#elif KVC_VEC_NEON

KVC_INLINE kvc_m8 kvc_f8_ge(kvc_f8 a, kvc_f8 b)
{
    kvc_m8 r = { { vcgeq_f32(a.val[0], b.val[0]), vcgeq_f32(a.val[1], b.val[1]) } };
    return r;
}
KVC_INLINE kvc_m8 kvc_m8_and(kvc_m8 a, kvc_m8 b)
{
    kvc_m8 r = { { vandq_u32(a.val[0], b.val[0]), vandq_u32(a.val[1], b.val[1]) } };
    return r;
}
/* vmaxq_f32 differs from mx on NaN and on +-0: compare and select instead */
KVC_INLINE float kvc_f8_fold_max(kvc_f8 a)
{
    float32x4_t b = vbslq_f32(vcgtq_f32(a.val[0], a.val[1]), a.val[0], a.val[1]);
    return kvc_max_gt(kvc_max_gt(vgetq_lane_f32(b, 0), vgetq_lane_f32(b, 2)),
                      kvc_max_gt(vgetq_lane_f32(b, 1), vgetq_lane_f32(b, 3)));
}
/* 4 x 4 transpose of x0..x3 (lane j of y_i = lane i of x_j) */
KVC_INLINE void kvc_neon_transpose4(float32x4_t x0, float32x4_t x1, float32x4_t x2,
                                    float32x4_t x3, float32x4_t *y)
{
    /* t0 = x0[0] x1[0] x0[2] x1[2], t1 = x0[1] x1[1] x0[3] x1[3] (t2, t3: the same of x2, x3) */
    float32x4_t t0 = vtrn1q_f32(x0, x1), t1 = vtrn2q_f32(x0, x1);
    float32x4_t t2 = vtrn1q_f32(x2, x3), t3 = vtrn2q_f32(x2, x3);
    y[0] = vreinterpretq_f32_f64(vtrn1q_f64(vreinterpretq_f64_f32(t0), vreinterpretq_f64_f32(t2)));
    y[1] = vreinterpretq_f32_f64(vtrn1q_f64(vreinterpretq_f64_f32(t1), vreinterpretq_f64_f32(t3)));
    y[2] = vreinterpretq_f32_f64(vtrn2q_f64(vreinterpretq_f64_f32(t0), vreinterpretq_f64_f32(t2)));
    y[3] = vreinterpretq_f32_f64(vtrn2q_f64(vreinterpretq_f64_f32(t1), vreinterpretq_f64_f32(t3)));
}
/* four 4 x 4 blocks: val[0] holds lanes 0-3, val[1] lanes 4-7 */
KVC_INLINE void kvc_f8_transpose8(kvc_f8 *r)
{
    float32x4_t ll[4], lh[4], hl[4], hh[4]; /* [rows 0-3 | 4-7][lanes 0-3 | 4-7] */
    kvc_neon_transpose4(r[0].val[0], r[1].val[0], r[2].val[0], r[3].val[0], ll);
    kvc_neon_transpose4(r[0].val[1], r[1].val[1], r[2].val[1], r[3].val[1], lh);
    kvc_neon_transpose4(r[4].val[0], r[5].val[0], r[6].val[0], r[7].val[0], hl);
    kvc_neon_transpose4(r[4].val[1], r[5].val[1], r[6].val[1], r[7].val[1], hh);
    int i;
    for (i = 0; i < 4; ++i) {
        r[i].val[0] = ll[i];
        r[i].val[1] = hl[i];
        r[i + 4].val[0] = lh[i];
        r[i + 4].val[1] = hh[i];
    }
}

#else /* portable */

KVC_INLINE kvc_m8 kvc_f8_ge(kvc_f8 a, kvc_f8 b)
{
    kvc_m8 r;
    int l;
    for (l = 0; l < 8; ++l)
        r.v[l] = a.v[l] >= b.v[l] ? -1 : 0;
    return r;
}
KVC_INLINE kvc_m8 kvc_m8_and(kvc_m8 a, kvc_m8 b)
{
    kvc_m8 r;
    int l;
    for (l = 0; l < 8; ++l)
        r.v[l] = a.v[l] & b.v[l];
    return r;
}
KVC_INLINE float kvc_f8_fold_max(kvc_f8 a)
{
    float b0 = kvc_max_gt(a.v[0], a.v[4]), b1 = kvc_max_gt(a.v[1], a.v[5]);
    float b2 = kvc_max_gt(a.v[2], a.v[6]), b3 = kvc_max_gt(a.v[3], a.v[7]);
    return kvc_max_gt(kvc_max_gt(b0, b2), kvc_max_gt(b1, b3));
}
/* int32 lanes (the blocked q8 tile's packing); the float one moves the same bits through it */
KVC_INLINE void kvc_i8x_transpose8(kvc_i8x *r)
{
    kvc_i8x t[8];
    int i, j;
    for (i = 0; i < 8; ++i)
        for (j = 0; j < 8; ++j)
            t[i].v[j] = r[j].v[i];
    memcpy(r, t, sizeof t);
}
KVC_INLINE void kvc_f8_transpose8(kvc_f8 *r)
{
    kvc_i8x t[8];
    memcpy(t, r, sizeof t);
    kvc_i8x_transpose8(t);
    memcpy(r, t, sizeof t);
}

#endif

/* --- operations added for the prompt kernel's blocked q8 scores --- */
/* Four int8 key codes per int32 lane (one lane per key) against four query codes w, the same
 * in every lane.  Exact integer sums on every target, so each gives the same values:
 *   KVC_I8_KOFF              what the stored form adds to a key code: 128 where the form is
 *                            k ^ 0x80 (k + 128 as an unsigned byte: vpdpbusd's unsigned
 *                            operand), 0 where it is k
 *   kvc_i8x_kform(v)         the stored form of four codes per lane (v ^ 0x80808080 or v)
 *   kvc_i8x_storeb(p, v)     the 32 bytes of v at p (kvc_i8x_loadb's layout)
 *   kvc_i8x_transpose8(r)    kvc_f8_transpose8 of int32 lanes (copies only)
 *   kvc_i16x                 16 int32 lanes: __m512i on AVX-512, two kvc_i8x halves elsewhere
 *   kvc_i16x_dp4k(acc, k, w) per lane acc + sum_{i < 4} (kbyte_i + KVC_I8_KOFF) sbyte_i(w), k
 *                            16 lanes of stored form (kvc_i16x_loadb); w's codes in
 *                            [-127, 127].  A caller that starts acc at -KVC_I8_KOFF * sum(w's
 *                            codes over the group) ends with the group's exact sum of q k.
 *                            VNNI: vpdpbusd; AVX2: vpmaddubsw(|k|, sign(w, k)) (pair sums at
 *                            most 2 * 128 * 127) then vpmaddwd with ones; NEON: sdot, or smull
 *                            and pairwise adds; C: the loop.
 *   kvc_i16x_to_f16(a)       (float) of each lane (round to nearest, as C's conversion) */
#if KVC_VEC_I8 == KVC_I8_VNNI
#define KVC_I8_KOFF 128
#else
#define KVC_I8_KOFF 0
#endif

#if KVC_VEC_X86
KVC_INLINE kvc_i8x kvc_i8x_kform(kvc_i8x v)
{
#if KVC_I8_KOFF
    return _mm256_xor_si256(v, _mm256_set1_epi8((char)0x80));
#else
    return v;
#endif
}
KVC_INLINE void kvc_i8x_storeb(uint8_t *p, kvc_i8x v) { _mm256_storeu_si256((__m256i *)p, v); }
KVC_INLINE void kvc_i8x_transpose8(kvc_i8x *r)
{
    kvc_f8 f[8];
    int i;
    for (i = 0; i < 8; ++i)
        f[i] = _mm256_castsi256_ps(r[i]);
    kvc_f8_transpose8(f);
    for (i = 0; i < 8; ++i)
        r[i] = _mm256_castps_si256(f[i]);
}
KVC_INLINE kvc_i8x kvc_i8x_dp4k(kvc_i8x acc, kvc_i8x k, int32_t w)
{
#if KVC_VEC_I8 == KVC_I8_VNNI
    return kvc_dpbusd(acc, k, _mm256_set1_epi32(w));
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(
        _mm256_maddubs_epi16(_mm256_abs_epi8(k), _mm256_sign_epi8(_mm256_set1_epi32(w), k)),
        _mm256_set1_epi16(1)));
#endif
}
#elif KVC_VEC_NEON
KVC_INLINE kvc_i8x kvc_i8x_kform(kvc_i8x v) { return v; }
KVC_INLINE void kvc_i8x_storeb(uint8_t *p, kvc_i8x v)
{
    vst1q_u8(p, vreinterpretq_u8_s32(v.val[0]));
    vst1q_u8(p + 16, vreinterpretq_u8_s32(v.val[1]));
}
KVC_INLINE void kvc_i8x_transpose8(kvc_i8x *r)
{
    kvc_f8 f[8];
    int i;
    for (i = 0; i < 8; ++i) {
        f[i].val[0] = vreinterpretq_f32_s32(r[i].val[0]);
        f[i].val[1] = vreinterpretq_f32_s32(r[i].val[1]);
    }
    kvc_f8_transpose8(f);
    for (i = 0; i < 8; ++i) {
        r[i].val[0] = vreinterpretq_s32_f32(f[i].val[0]);
        r[i].val[1] = vreinterpretq_s32_f32(f[i].val[1]);
    }
}
KVC_INLINE kvc_i8x kvc_i8x_dp4k(kvc_i8x acc, kvc_i8x k, int32_t w)
{
    int8x16_t wv = vreinterpretq_s8_s32(vdupq_n_s32(w));
    kvc_i8x r = { { kvc_neon_dp4(acc.val[0], k.val[0], wv), kvc_neon_dp4(acc.val[1], k.val[1], wv) } };
    return r;
}
#else
KVC_INLINE kvc_i8x kvc_i8x_kform(kvc_i8x v) { return v; }
KVC_INLINE void kvc_i8x_storeb(uint8_t *p, kvc_i8x v) { memcpy(p, v.v, sizeof v.v); }
/* kvc_i8x_transpose8: with the float one, above */
KVC_INLINE kvc_i8x kvc_i8x_dp4k(kvc_i8x acc, kvc_i8x k, int32_t w) { return kvc_i8x_dp4(acc, k, w); }
#endif

#if KVC_VEC_AVX512
typedef __m512i kvc_i16x;
KVC_INLINE kvc_i16x kvc_i16x_set1(int32_t x) { return _mm512_set1_epi32(x); }
KVC_INLINE kvc_i16x kvc_i16x_loadb(const uint8_t *p) { return _mm512_loadu_si512((const void *)p); }
KVC_INLINE kvc_i16x kvc_i16x_dp4k(kvc_i16x acc, kvc_i16x k, int32_t w)
{
    return _mm512_dpbusd_epi32(acc, k, _mm512_set1_epi32(w));   /* KVC_I8_KOFF is 128 */
}
KVC_INLINE kvc_f16 kvc_i16x_to_f16(kvc_i16x a) { return _mm512_cvtepi32_ps(a); }
#else
typedef struct { kvc_i8x lo, hi; } kvc_i16x;
KVC_INLINE kvc_i16x kvc_i16x_set1(int32_t x)
{
    kvc_i16x r;
    r.lo = r.hi = kvc_i8x_set1(x);
    return r;
}
KVC_INLINE kvc_i16x kvc_i16x_loadb(const uint8_t *p)
{
    kvc_i16x r;
    r.lo = kvc_i8x_loadb(p);
    r.hi = kvc_i8x_loadb(p + 32);
    return r;
}
KVC_INLINE kvc_i16x kvc_i16x_dp4k(kvc_i16x acc, kvc_i16x k, int32_t w)
{
    acc.lo = kvc_i8x_dp4k(acc.lo, k.lo, w);
    acc.hi = kvc_i8x_dp4k(acc.hi, k.hi, w);
    return acc;
}
KVC_INLINE kvc_f16 kvc_i16x_to_f16(kvc_i16x a)
{
    return kvc_f16_pair(kvc_i8x_to_f8(a.lo), kvc_i8x_to_f8(a.hi));
}
#endif

/* --- operations added for the value pass's weights --- */
/*   kvc_m8_bit(m, b)   per lane m ? b : 0, as int32 lanes (m all-ones or all-zeros lanes) */
#if KVC_VEC_X86
KVC_INLINE kvc_i8x kvc_m8_bit(kvc_m8 m, int32_t b)
{
    return _mm256_and_si256(_mm256_castps_si256(m), _mm256_set1_epi32(b));
}
#elif KVC_VEC_NEON
KVC_INLINE kvc_i8x kvc_m8_bit(kvc_m8 m, int32_t b)
{
    kvc_i8x r = { { vandq_s32(vreinterpretq_s32_u32(m.val[0]), vdupq_n_s32(b)),
                    vandq_s32(vreinterpretq_s32_u32(m.val[1]), vdupq_n_s32(b)) } };
    return r;
}
#else
KVC_INLINE kvc_i8x kvc_m8_bit(kvc_m8 m, int32_t b)
{
    kvc_i8x r;
    int l;
    for (l = 0; l < 8; ++l)
        r.v[l] = m.v[l] & b;
    return r;
}
#endif

/* --- 16-lane operations of 4-bit K's fold and scorer and the quantised value pass --- */
/* Exact semantics, lane by lane, on every target (AVX-512 on __m512 / __m512i, elsewhere the
 * two 8-lane halves through the operations above, so every target gives the same values):
 *   kvc_f16_from_s8(p)            the sixteen signed bytes at p as floats
 *   kvc_f16_from_u4(p, sh)        the low (sh 0) or high (sh 4) nibbles of the sixteen bytes
 *                                 at p as floats 0..15
 *   kvc_i16x_nib(v, sh)           kvc_i8x_nib on sixteen lanes
 *   kvc_i16x_dp4(acc, u, w)       kvc_i8x_dp4 on sixteen lanes (u's bytes in [0, 15])
 *   kvc_f16_absmax_inf(a)         the largest |a[l]|, a NaN lane counted as +inf: the lanes are
 *                                 then never NaN nor -0, so the order of the maximum (halves
 *                                 first, then kvc_f8_fold_max) does not show in the value
 *   kvc_f16_store_i8_round(d, a, s)  d[l] = round-half-even(a[l] * s) as int8, lanes whose
 *                                 product rounds into [-128, 127] (no NaN: the caller checks) */
#if KVC_VEC_AVX512
KVC_INLINE kvc_f16 kvc_f16_from_s8(const int8_t *p)
{
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
KVC_INLINE kvc_f16 kvc_f16_from_u4(const uint8_t *p, int shift)
{
    __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(w, (unsigned)shift),
                                               _mm512_set1_epi32(15)));
}
KVC_INLINE kvc_i16x kvc_i16x_nib(kvc_i16x v, int sh)
{
    return _mm512_and_si512(_mm512_srli_epi32(v, (unsigned)sh), _mm512_set1_epi32(0x0f0f0f0f));
}
KVC_INLINE kvc_i16x kvc_i16x_dp4(kvc_i16x acc, kvc_i16x u, int32_t w)
{
    return _mm512_dpbusd_epi32(acc, u, _mm512_set1_epi32(w));
}
KVC_INLINE float kvc_f16_absmax_inf(kvc_f16 a)
{
    __m512 m = _mm512_mask_mov_ps(_mm512_abs_ps(a), _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q),
                                  _mm512_set1_ps(INFINITY));
    return kvc_f8_fold_max(_mm256_max_ps(kvc_f16_lo(m), kvc_f16_hi(m)));
}
KVC_INLINE void kvc_f16_store_i8_round(int8_t *dst, kvc_f16 a, float s)
{
    __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(a, _mm512_set1_ps(s)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128((__m128i *)dst, _mm512_cvtsepi32_epi8(_mm512_cvttps_epi32(r)));
}
#else
KVC_INLINE kvc_f16 kvc_f16_from_s8(const int8_t *p)
{
    return kvc_f16_pair(kvc_f8_from_s8(p), kvc_f8_from_s8(p + 8));
}
KVC_INLINE kvc_f16 kvc_f16_from_u4(const uint8_t *p, int shift)
{
    return kvc_f16_pair(kvc_f8_from_u4(p, shift), kvc_f8_from_u4(p + 8, shift));
}
KVC_INLINE kvc_i16x kvc_i16x_nib(kvc_i16x v, int sh)
{
    v.lo = kvc_i8x_nib(v.lo, sh);
    v.hi = kvc_i8x_nib(v.hi, sh);
    return v;
}
KVC_INLINE kvc_i16x kvc_i16x_dp4(kvc_i16x acc, kvc_i16x u, int32_t w)
{
    acc.lo = kvc_i8x_dp4(acc.lo, u.lo, w);
    acc.hi = kvc_i8x_dp4(acc.hi, u.hi, w);
    return acc;
}
KVC_INLINE float kvc_f16_absmax_inf(kvc_f16 a)
{
    const kvc_f8 infv = kvc_f8_set1(INFINITY), lo = kvc_f16_lo(a), hi = kvc_f16_hi(a);
    return kvc_f8_fold_max(kvc_f8_max_num(kvc_f8_sel(kvc_f8_isnan(lo), infv, kvc_f8_abs(lo)),
                                          kvc_f8_sel(kvc_f8_isnan(hi), infv, kvc_f8_abs(hi))));
}
KVC_INLINE void kvc_f16_store_i8_round(int8_t *dst, kvc_f16 a, float s)
{
    const kvc_f8 sv = kvc_f8_set1(s);
    kvc_f8_store_i8_int(dst, kvc_f8_round_even(kvc_f8_mul(kvc_f16_lo(a), sv)));
    kvc_f8_store_i8_int(dst + 8, kvc_f8_round_even(kvc_f8_mul(kvc_f16_hi(a), sv)));
}
#endif

#endif
