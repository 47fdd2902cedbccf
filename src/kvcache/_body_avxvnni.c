/* The AVX-VNNI body (_dispatch.h): the AVX2 + FMA + F16C code, with q8 scoring on the VEX
 * vpdpbusd (AVX-VNNI without AVX-512: Alder Lake and later client cores).
 * Only this unit holds these instructions, and _core runs its body only on a CPU that reports
 * every feature the body needs (_isa.h).  GCC takes the target from `#pragma GCC target`, clang
 * from `#pragma clang attribute` (which defines no feature macros: KVC_UNIT_AVX2 and
 * KVC_UNIT_AVXVNNI tell _vec.h).
 * Elsewhere (another CPU family, KVC_NO_SIMD, KVC_NO_AVXVNNI) it holds no code and kvc_ops_avxvnni
 * is NULL. */
#include <stddef.h>

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__) && !defined(KVC_NO_SIMD) \
    && !defined(KVC_NO_AVXVNNI)
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <immintrin.h>
#if defined(__clang__)
#define KVC_UNIT_AVX2 1
#define KVC_UNIT_AVXVNNI 1
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,avxvnni"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")
#endif
#define KVC_BODY_TABLE kvc_ops_avxvnni_table
#define KVC_BODY_NAME "avxvnni"
#define KVC_BODY_ID KVC_ISA_AVXVNNI
#include "_body.h"
#if !KVC_VEC_AVX2 || KVC_VEC_I8 != KVC_I8_VNNI
#error "_body_avxvnni.c: the unit's target did not take effect"
#endif
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
const kvc_ops *const kvc_ops_avxvnni = &kvc_ops_avxvnni_table;
#else
#include "_dispatch.h"
const kvc_ops *const kvc_ops_avxvnni = NULL;
#endif
