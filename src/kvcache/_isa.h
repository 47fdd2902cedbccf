/* Instruction-set features of the CPU and the kernel bodies that need them.
 *
 * Features are a SET (bits below), never a ladder: an AVX-512 CPU need not have AVX-VNNI (AMD
 * Zen 4, Intel Ice Lake and Cascade Lake servers have AVX512-VNNI but not the VEX AVX-VNNI),
 * and an AVX-VNNI CPU need not have AVX-512 (Alder Lake).  kvc_cpu_features() asks the CPU
 * (CPUID) and whether the OS saves the wider register state (XGETBV); on aarch64 the kernel's
 * hardware capabilities (getauxval).
 *
 * A kernel body is named by what it is compiled for; kvc_body_needs() is the set of features
 * it may execute.  Every body computes the bits of the portable twin (docs/numerics.md), so
 * the choice changes speed, never results:
 *
 *   KVC_ISA_PORTABLE  plain C for the baseline of the target (x86-64: SSE2)        needs {}
 *   KVC_ISA_AVX2      AVX2 + FMA                                             {avx2, fma}
 *   KVC_ISA_AVXVNNI   + AVX-VNNI (VEX vpdpbusd on 256-bit registers)   {avx2, fma, avxvnni}
 *   KVC_ISA_AVX512    + AVX-512 F/BW/DQ/VL and AVX512-VNNI (EVEX)
 *                                  {avx2, fma, avx512f, avx512bw, avx512dq, avx512vl, avx512vnni}
 *
 * Which bodies each kernel family holds, and the choice among them, is made in Python
 * (kvcache/_dispatch.py) from these sets; _core keeps the chosen body per family.  Only the
 * translation unit _body_avx2.c is compiled for instructions beyond the baseline (GCC's
 * `#pragma GCC target`, and per-function target attributes for the VNNI and AVX-512 bodies);
 * everything else, _core included, runs on any x86-64 CPU.
 *
 * The C test programs (tests/c) include the kernel headers into one file built with -mavx2
 * -mfma (or -DKVC_NO_SIMD for the portable twin); for them kvc_isa is the body the program
 * runs.  KVC_NO_VNNI (set by setup.py when the compiler cannot build the VNNI intrinsics)
 * leaves the VNNI and AVX-512 bodies out.  KVC_EMULATE_VNNI (tests/c only) compiles the VNNI
 * bodies WITHOUT their target attributes and with an exact AVX2 emulation of vpdpbusd
 * (kvc_dpbusd_emu), so a machine without VNNI runs those bodies and compares their bits with
 * the AVX2 one.
 */
#ifndef KVCACHE_ISA_H
#define KVCACHE_ISA_H

#define KVC_ISA_PORTABLE 0
#define KVC_ISA_AVX2 1
#define KVC_ISA_AVXVNNI 2
#define KVC_ISA_AVX512 3
#define KVC_N_BODIES 4

/* feature bits (kvcache/_dispatch.py FEATURES holds the same names in the same order) */
#define KVC_F_AVX2 (1u << 0)
#define KVC_F_FMA (1u << 1)
#define KVC_F_AVXVNNI (1u << 2)
#define KVC_F_AVX512F (1u << 3)
#define KVC_F_AVX512BW (1u << 4)
#define KVC_F_AVX512DQ (1u << 5)
#define KVC_F_AVX512VL (1u << 6)
#define KVC_F_AVX512VNNI (1u << 7)
#define KVC_F_AVX512BF16 (1u << 8)
#define KVC_F_NEON (1u << 9)
#define KVC_F_DOTPROD (1u << 10)
#define KVC_N_FEATURES 11

#if defined(__GNUC__) && defined(__x86_64__)
#define KVC_X86 1
#else
#define KVC_X86 0
#endif

/* KVC_UNIT_AVX2: set by _body_avx2.c where the compiler applies the unit's target by
 * attribute (clang's `#pragma clang attribute`), which defines no __AVX2__ */
#if KVC_X86 && ((defined(__AVX2__) && defined(__FMA__)) || defined(KVC_UNIT_AVX2)) \
    && !defined(KVC_NO_SIMD)
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

#if KVC_X86
#include <cpuid.h>
#elif defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#endif

#if KVC_X86
/* XCR0: which register state the OS saves (read only when CPUID reports OSXSAVE). */
static inline unsigned long long kvc_xgetbv0(void)
{
    unsigned int lo, hi;
    __asm__ volatile(".byte 0x0f, 0x01, 0xd0" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((unsigned long long)hi << 32) | lo;
}
#endif

/* The features this CPU and OS support (a set of KVC_F_* bits): CPUID, and XCR0 for whether
 * the OS saves the AVX (YMM) and AVX-512 (opmask, ZMM) state -- read directly, so that the
 * answer does not depend on what the compiler's own feature tables know. */
static inline unsigned kvc_cpu_features(void)
{
    unsigned f = 0;
#if KVC_X86
    unsigned int a, b, c, d, max_leaf, b7 = 0, c7 = 0, a71 = 0;
    unsigned long long xcr0 = 0;
    int ymm, zmm;
    if (!__get_cpuid(0, &max_leaf, &b, &c, &d) || !__get_cpuid(1, &a, &b, &c, &d))
        return 0;
    if (c & (1u << 27))                              /* OSXSAVE: XGETBV is usable */
        xcr0 = kvc_xgetbv0();
    ymm = (c & (1u << 28)) && (xcr0 & 0x6) == 0x6;   /* AVX, and SSE + YMM state saved */
    zmm = ymm && (xcr0 & 0xE0) == 0xE0;              /* opmask, ZMM_Hi256, Hi16_ZMM saved */
    if (ymm && (c & (1u << 12)))
        f |= KVC_F_FMA;
    if (max_leaf >= 7) {
        __cpuid_count(7, 0, a, b7, c7, d);
        if (a >= 1)
            __cpuid_count(7, 1, a71, b, c, d);
    }
    if (ymm && (b7 & (1u << 5)))
        f |= KVC_F_AVX2;
    if (ymm && (a71 & (1u << 4)))
        f |= KVC_F_AVXVNNI;
    if (zmm) {
        if (b7 & (1u << 16)) f |= KVC_F_AVX512F;
        if (b7 & (1u << 17)) f |= KVC_F_AVX512DQ;
        if (b7 & (1u << 30)) f |= KVC_F_AVX512BW;
        if (b7 & (1u << 31)) f |= KVC_F_AVX512VL;
        if (c7 & (1u << 11)) f |= KVC_F_AVX512VNNI;
        if (a71 & (1u << 5)) f |= KVC_F_AVX512BF16;
    }
#elif defined(__aarch64__) && defined(__linux__)
    unsigned long hw = getauxval(AT_HWCAP);
#ifdef HWCAP_ASIMD
    if (hw & HWCAP_ASIMD)
        f |= KVC_F_NEON;
#endif
#ifdef HWCAP_ASIMDDP
    if (hw & HWCAP_ASIMDDP)
        f |= KVC_F_DOTPROD;
#endif
#elif defined(__aarch64__)
    f |= KVC_F_NEON;   /* Advanced SIMD is part of every AArch64 CPU */
#endif
    return f;
}

/* The features body `body` may execute. */
static inline unsigned kvc_body_needs(int body)
{
    switch (body) {
    case KVC_ISA_AVX2: return KVC_F_AVX2 | KVC_F_FMA;
    case KVC_ISA_AVXVNNI: return KVC_F_AVX2 | KVC_F_FMA | KVC_F_AVXVNNI;
    case KVC_ISA_AVX512:
        return KVC_F_AVX2 | KVC_F_FMA | KVC_F_AVX512F | KVC_F_AVX512BW | KVC_F_AVX512DQ
               | KVC_F_AVX512VL | KVC_F_AVX512VNNI;
    default: return 0;
    }
}

/* Whether this CPU runs body `body`: every feature it needs is present. */
static inline int kvc_cpu_runs(int body)
{
    unsigned need = kvc_body_needs(body);
    return (kvc_cpu_features() & need) == need;
}

/* The body a C test program runs (tests/c; _core keeps its own choice per family). */
#if defined(__GNUC__)
__attribute__((unused))
#endif
static int kvc_isa = KVC_ISA_PORTABLE;

/* For the C test programs: the most capable body this CPU runs of those a one-file build
 * holds (AVX-512, then AVX-VNNI, then AVX2, then the portable C). */
static inline int kvc_isa_detect(void)
{
#if KVC_DISPATCH
    if (KVC_VNNI && kvc_cpu_runs(KVC_ISA_AVX512))
        return KVC_ISA_AVX512;
    if (KVC_VNNI && kvc_cpu_runs(KVC_ISA_AVXVNNI))
        return KVC_ISA_AVXVNNI;
    if (kvc_cpu_runs(KVC_ISA_AVX2))
        return KVC_ISA_AVX2;
#endif
    return KVC_ISA_PORTABLE;
}

/* The name of a body (the names KVCACHE_ISA and _core.set_isa take). */
static inline const char *kvc_isa_name(int body)
{
    switch (body) {
    case KVC_ISA_AVX2: return "avx2";
    case KVC_ISA_AVXVNNI: return "avxvnni";
    case KVC_ISA_AVX512: return "avx512";
    default: return "portable";
    }
}

#endif
