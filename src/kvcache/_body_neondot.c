/* The NEON + dot-product body (_dispatch.h): the NEON code with q8 scoring on sdot (Armv8.2
 * dot-product extension: Cortex-A55/A75 and later, Neoverse, Apple M1 and later).
 * GCC takes the target from `#pragma GCC target("arch=armv8.2-a+dotprod")`: GCC 12's
 * arm_neon.h defines vdotq_s32 under that very target, and an always_inline intrinsic is
 * inlined only into a caller whose features include its own, so "+dotprod" alone (Armv8-A plus
 * sdot) fails to compile there.  Every CPU with the extension implements Armv8.2 (it is an
 * option of 8.2 and later), so the wider target asks for nothing such a CPU lacks.
 * clang takes it from `#pragma clang attribute`, which defines no feature macro: KVC_UNIT_NEONDOT
 * tells _vec.h, and __ARM_FEATURE_DOTPROD is defined before arm_neon.h, since clang's header
 * (clang 14 at least) declares the dot-product intrinsics only under that macro; included after
 * the push, those declarations carry the unit's target attribute, so they compile here.
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
#ifndef __ARM_FEATURE_DOTPROD
#define __ARM_FEATURE_DOTPROD 1
#endif
#else
#pragma GCC push_options
#pragma GCC target("arch=armv8.2-a+dotprod")
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
