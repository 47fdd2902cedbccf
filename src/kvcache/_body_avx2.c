/* The x86-64 SIMD bodies (_dispatch.h): the kernel sources compiled under
 * `#pragma GCC target("avx2,fma")`, with the AVX-VNNI and AVX-512 bodies of q8 scoring and the
 * AVX-512 body of MLA under their own target attributes.  Only this unit holds instructions
 * beyond the x86-64 baseline, and _core runs a body of it only on a CPU that has every feature
 * the body needs.  Elsewhere (another CPU family, a compiler without the pragma, KVC_NO_SIMD)
 * it holds no code and kvc_ops_avx2 is NULL. */
#include <stddef.h>

#if defined(__GNUC__) && defined(__x86_64__) && !defined(KVC_NO_SIMD)
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <immintrin.h>
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define KVC_BODY_TABLE kvc_ops_avx2_table
#include "_body.h"
#pragma GCC pop_options
const kvc_ops *const kvc_ops_avx2 = &kvc_ops_avx2_table;
#else
#include "_dispatch.h"
const kvc_ops *const kvc_ops_avx2 = NULL;
#endif
