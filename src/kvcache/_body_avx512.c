/* The AVX-512 body (_dispatch.h): every family compiled for AVX-512 F/BW/DQ/VL and
 * AVX512-VNNI: 8-float code on EVEX ymm registers (32 of them), the 16-float MLA body on zmm,
 * q8 scoring on the EVEX vpdpbusd.  The compiler is asked to prefer 256-bit vectors where it
 * vectorises by itself, so only the explicit 16-float code uses zmm.
 * Only this unit holds these instructions, and _core runs its body only on a CPU that reports
 * every feature the body needs (_isa.h).  GCC takes the target from `#pragma GCC target`, clang
 * from `#pragma clang attribute` (which defines no feature macros: KVC_UNIT_AVX512 tells _vec.h).
 * Elsewhere (another CPU family, KVC_NO_SIMD, KVC_NO_AVX512) it holds no code and kvc_ops_avx512
 * is NULL. */
#include <stddef.h>

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__) && !defined(KVC_NO_SIMD) \
    && !defined(KVC_NO_AVX512)
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <immintrin.h>
#if defined(__clang__)
#define KVC_UNIT_AVX512 1
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,prefer-vector-width=256"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,prefer-vector-width=256")
#endif
#define KVC_BODY_TABLE kvc_ops_avx512_table
#define KVC_BODY_NAME "avx512"
#define KVC_BODY_ID KVC_ISA_AVX512
#include "_body.h"
#if !KVC_VEC_AVX512 || KVC_VEC_I8 != KVC_I8_VNNI
#error "_body_avx512.c: the unit's target did not take effect"
#endif
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
const kvc_ops *const kvc_ops_avx512 = &kvc_ops_avx512_table;
#else
#include "_dispatch.h"
const kvc_ops *const kvc_ops_avx512 = NULL;
#endif
