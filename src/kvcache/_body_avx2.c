/* The x86-64 SIMD bodies (_dispatch.h): the kernel sources compiled for AVX2 + FMA, with the
 * AVX-VNNI and AVX-512 bodies of q8 scoring and the AVX-512 body of MLA under their own target
 * attributes.  Only this unit holds instructions beyond the x86-64 baseline, and _core runs a
 * body of it only on a CPU that reports every feature the body needs.  GCC takes the target
 * from `#pragma GCC target`, clang from `#pragma clang attribute` (KVC_UNIT_AVX2 tells the
 * headers, since it defines no __AVX2__).  Elsewhere (another CPU family, KVC_NO_SIMD) it
 * holds no code and kvc_ops_avx2 is NULL. */
#include <stddef.h>

#if (defined(__GNUC__) || defined(__clang__)) && defined(__x86_64__) && !defined(KVC_NO_SIMD)
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <immintrin.h>
#if defined(__clang__)
#define KVC_UNIT_AVX2 1
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif
#define KVC_BODY_TABLE kvc_ops_avx2_table
#include "_body.h"
#if !KVC_SIMD
#error "_body_avx2.c: the AVX2 target did not take effect"
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
