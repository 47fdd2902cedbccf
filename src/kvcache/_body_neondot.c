/* The NEON + dot-product body (_dispatch.h): the NEON code with q8 scoring on sdot (Armv8.2
 * dot-product extension: Cortex-A55/A75 and later, Neoverse, Apple M1 and later).  GCC takes
 * the target from `#pragma GCC target("+dotprod")`, clang from `#pragma clang attribute`.
 * Elsewhere (another CPU family, KVC_NO_SIMD, KVC_NO_NEONDOT) it holds no code and kvc_ops_neondot
 * is NULL. */
#include <stddef.h>

#if (defined(__GNUC__) || defined(__clang__)) && defined(__aarch64__) && !defined(KVC_NO_SIMD) \
    && !defined(KVC_NO_NEONDOT)
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__clang__)
#define KVC_UNIT_NEONDOT 1
#pragma clang attribute push(__attribute__((target("dotprod"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("+dotprod")
#endif
#include <arm_neon.h>
#define KVC_BODY_TABLE kvc_ops_neondot_table
#define KVC_BODY_NAME "neondot"
#define KVC_BODY_ID KVC_ISA_NEONDOT
#include "_body.h"
#if !KVC_VEC_NEON || KVC_VEC_I8 != KVC_I8_SDOT
#error "_body_neondot.c: the unit's target did not take effect"
#endif
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
const kvc_ops *const kvc_ops_neondot = &kvc_ops_neondot_table;
#else
#include "_dispatch.h"
const kvc_ops *const kvc_ops_neondot = NULL;
#endif
