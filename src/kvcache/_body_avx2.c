/* The AVX2 + FMA + F16C body (_dispatch.h): every kernel family compiled for AVX2, FMA and F16C.
 * Only this unit holds these instructions, and _core runs its body only on a CPU that reports
 * every feature the body needs (_isa.h).  GCC takes the target from `#pragma GCC target`, clang
 * from `#pragma clang attribute` (which defines no feature macros: KVC_UNIT_AVX2 tells _vec.h).
 * Elsewhere (another CPU family, KVC_NO_SIMD, KVC_NO_AVX2) it holds no code and kvc_ops_avx2
 * is NULL. */
#include <stddef.h>

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__) && !defined(KVC_NO_SIMD) \
    && !defined(KVC_NO_AVX2)
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <immintrin.h>
#if defined(__clang__)
#define KVC_UNIT_AVX2 1
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif
#define KVC_BODY_TABLE kvc_ops_avx2_table
#define KVC_BODY_NAME "avx2"
#define KVC_BODY_ID KVC_ISA_AVX2
#include "_body.h"
#if !KVC_VEC_AVX2 || KVC_VEC_I8 != KVC_I8_MADDUBS
#error "_body_avx2.c: the unit's target did not take effect"
#endif
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
const kvc_ops *const kvc_ops_avx2 = &kvc_ops_avx2_table;
#else
#include "_dispatch.h"
const kvc_ops *const kvc_ops_avx2 = NULL;
#endif
