/* The NEON body (_dispatch.h): every kernel family compiled for aarch64 Advanced SIMD, which
 * every AArch64 CPU has (the baseline of the target); q8 scoring on smull/smlal, also where the
 * compiler's baseline has the dot product (Apple clang's default arm64 CPU): KVC_UNIT_NEON tells
 * _vec.h, so this body stays the one for CPUs without sdot.
 * Elsewhere (another CPU family, KVC_NO_SIMD, KVC_NO_NEON) it holds no code and kvc_ops_neon
 * is NULL. */
#include <stddef.h>

#if (defined(__GNUC__) || defined(__clang__)) && defined(__aarch64__) && !defined(KVC_NO_SIMD) \
    && !defined(KVC_NO_NEON)
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <arm_neon.h>
#define KVC_UNIT_NEON 1
#define KVC_BODY_TABLE kvc_ops_neon_table
#define KVC_BODY_NAME "neon"
#define KVC_BODY_ID KVC_ISA_NEON
#include "_body.h"
#if !KVC_VEC_NEON || KVC_VEC_I8 != KVC_I8_SMULL
#error "_body_neon.c: the unit's target did not take effect"
#endif
const kvc_ops *const kvc_ops_neon = &kvc_ops_neon_table;
#else
#include "_dispatch.h"
const kvc_ops *const kvc_ops_neon = NULL;
#endif
