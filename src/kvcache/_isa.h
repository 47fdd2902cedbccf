/* Run-time choice of the instruction-set path of the compiled kernels.
 *
 * The extension is built for the x86-64 AVX2/FMA baseline (setup.py); kernels that gain from
 * newer instructions carry extra bodies compiled with GCC's per-function target attribute and
 * are chosen at run time from the level below.  Every path computes the same bits (integer
 * sums are exact, float reductions have one fixed order; docs/numerics.md), so the level
 * changes speed, never results.
 *
 *   KVC_ISA_PORTABLE  plain C (a build without AVX2/FMA; never chosen at run time on a SIMD build)
 *   KVC_ISA_AVX2      AVX2 + FMA: the build's baseline
 *   KVC_ISA_AVXVNNI   + AVX-VNNI (VEX vpdpbusd on 256-bit registers)
 *   KVC_ISA_AVX512    + AVX-512 F/BW/DQ/VL and AVX-512 VNNI
 *
 * KVC_NO_VNNI (set by setup.py when the compiler cannot build the VNNI intrinsics) caps the
 * levels at AVX2.  KVC_EMULATE_VNNI (tests/c only) compiles the VNNI bodies WITHOUT their
 * target attributes and with an exact AVX2 emulation of vpdpbusd (kvc_dpbusd_emu), so a
 * machine without VNNI runs those bodies and compares their bits with the AVX2 one.
 *
 * kvc_isa_detect() asks the CPU (and, through libgcc, whether the OS saves the wider register
 * state); kvc_isa is the level in use: _core sets it at import to the detected level, or to a
 * lower one named by KVCACHE_ISA (for tests), and every dispatching kernel reads it once per
 * call, before its parallel region.
 */
#ifndef KVCACHE_ISA_H
#define KVCACHE_ISA_H

#define KVC_ISA_PORTABLE 0
#define KVC_ISA_AVX2 1
#define KVC_ISA_AVXVNNI 2
#define KVC_ISA_AVX512 3

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__)) && defined(__AVX2__) \
    && defined(__FMA__) && !defined(KVC_NO_SIMD)
#define KVC_DISPATCH 1
#include <immintrin.h>
#if defined(KVC_EMULATE_VNNI)
#define KVC_VNNI 1
#define KVC_TARGET_AVXVNNI
#define KVC_TARGET_AVX512
/* vpdpbusd: acc + per 32-bit lane the sum of the four products (unsigned byte of a) x (signed
 * byte of b), exact: every product and pair sum fits int16 x int16 -> int32 (vpmaddwd). */
static inline __attribute__((always_inline)) __m256i kvc_dpbusd_emu(__m256i acc, __m256i a,
                                                                    __m256i b)
{
    __m256i a_even = _mm256_and_si256(a, _mm256_set1_epi16(0x00FF));
    __m256i a_odd = _mm256_srli_epi16(a, 8);
    __m256i b_even = _mm256_srai_epi16(_mm256_slli_epi16(b, 8), 8);
    __m256i b_odd = _mm256_srai_epi16(b, 8);
    return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(a_even, b_even),
                                                  _mm256_madd_epi16(a_odd, b_odd)));
}
#define KVC_DPBUSD_AVXVNNI(acc, a, b) kvc_dpbusd_emu(acc, a, b)
#define KVC_DPBUSD_AVX512(acc, a, b) kvc_dpbusd_emu(acc, a, b)
#elif !defined(KVC_NO_VNNI)
#define KVC_VNNI 1
#define KVC_TARGET_AVXVNNI __attribute__((target("avx2,fma,avxvnni")))
#define KVC_TARGET_AVX512 \
    __attribute__((target("avx2,fma,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))
#define KVC_DPBUSD_AVXVNNI(acc, a, b) _mm256_dpbusd_avx_epi32(acc, a, b)
#define KVC_DPBUSD_AVX512(acc, a, b) _mm256_dpbusd_epi32(acc, a, b)
#else
#define KVC_VNNI 0
#endif
#else
#define KVC_DISPATCH 0
#define KVC_VNNI 0
#endif

static int kvc_isa = KVC_ISA_PORTABLE;

static void kvc_isa_set(int level) { kvc_isa = level; }

/* The best level this CPU (and OS) can run, limited to what the build holds. */
static int kvc_isa_detect(void)
{
#if KVC_DISPATCH
    __builtin_cpu_init();
    if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")))
        return KVC_ISA_PORTABLE;   /* cannot happen on a machine that imported the module */
    if (!KVC_VNNI)
        return KVC_ISA_AVX2;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
        && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl")
        && __builtin_cpu_supports("avx512vnni"))
        return KVC_ISA_AVX512;
    if (__builtin_cpu_supports("avxvnni"))
        return KVC_ISA_AVXVNNI;
    return KVC_ISA_AVX2;
#else
    return KVC_ISA_PORTABLE;
#endif
}

/* The name of a level (the names KVCACHE_ISA and _core.set_isa take). */
static const char *kvc_isa_name(int level)
{
    switch (level) {
    case KVC_ISA_AVX2: return "avx2";
    case KVC_ISA_AVXVNNI: return "avxvnni";
    case KVC_ISA_AVX512: return "avx512";
    default: return "portable";
    }
}

#endif
