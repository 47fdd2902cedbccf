/* Instruction-set features of the CPU and the kernel bodies that need them.
 *
 * Features are a SET (bits below), never a ladder: an AVX-512 CPU need not have AVX-VNNI (AMD
 * Zen 4, Intel Ice Lake and Cascade Lake servers have AVX512-VNNI but not the VEX AVX-VNNI),
 * and an AVX-VNNI CPU need not have AVX-512 (Alder Lake); an ARM core need not have the
 * dot-product extension (Cortex-A53, A72).  kvc_cpu_features() asks the CPU (x86: CPUID, and
 * XGETBV for whether the OS saves the wider register state; aarch64 Linux: getauxval; macOS:
 * sysctl).
 *
 * A kernel body is one translation unit compiled for one target (_dispatch.h); kvc_body_needs()
 * is the set of features it may execute.  Every body computes the bits of the portable twin
 * (docs/numerics.md), so the choice changes speed, never results:
 *
 *   KVC_ISA_PORTABLE  plain C for the baseline of the target (x86-64: SSE2)        needs {}
 *   KVC_ISA_AVX2      AVX2 + FMA + F16C                                {avx2, fma, f16c}
 *   KVC_ISA_AVXVNNI   + AVX-VNNI (VEX vpdpbusd on 256-bit registers)
 *                                                            {avx2, fma, f16c, avxvnni}
 *   KVC_ISA_AVX512    + AVX-512 F/BW/DQ/VL and AVX512-VNNI (EVEX)
 *                      {avx2, fma, f16c, avx512f, avx512bw, avx512dq, avx512vl, avx512vnni}
 *   KVC_ISA_NEON      aarch64 Advanced SIMD                                         {neon}
 *   KVC_ISA_NEONDOT   + the dot-product extension (sdot)                   {neon, dotprod}
 *
 * Which bodies each kernel family holds, and the choice among them, is made in Python
 * (kvcache/_dispatch.py) from these sets; _core keeps the chosen body per family.
 */
#ifndef KVCACHE_ISA_H
#define KVCACHE_ISA_H

#define KVC_ISA_PORTABLE 0
#define KVC_ISA_AVX2 1
#define KVC_ISA_AVXVNNI 2
#define KVC_ISA_AVX512 3
#define KVC_ISA_NEON 4
#define KVC_ISA_NEONDOT 5
#define KVC_N_BODIES 6

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
#define KVC_F_F16C (1u << 11)
#define KVC_N_FEATURES 12

#if defined(__GNUC__) && defined(__x86_64__)
#define KVC_X86 1
#else
#define KVC_X86 0
#endif

#if KVC_X86
#include <cpuid.h>
#elif defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
/* the kernel's AT_HWCAP bits (arch/arm64/include/uapi/asm/hwcap.h), where libc lacks them */
#ifndef HWCAP_ASIMD
#define HWCAP_ASIMD (1ul << 1)
#endif
#ifndef HWCAP_ASIMDDP
#define HWCAP_ASIMDDP (1ul << 20)
#endif
#elif defined(__aarch64__) && defined(__APPLE__)
#include <sys/sysctl.h>
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
    if (ymm && (c & (1u << 29)))                     /* F16C: vcvtph2ps on YMM registers */
        f |= KVC_F_F16C;
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
    if (hw & HWCAP_ASIMD)
        f |= KVC_F_NEON;
    if ((hw & HWCAP_ASIMD) && (hw & HWCAP_ASIMDDP))
        f |= KVC_F_DOTPROD;
#elif defined(__aarch64__) && defined(__APPLE__)
    int on = 0;
    size_t len = sizeof on;
    f |= KVC_F_NEON;   /* Advanced SIMD is part of every AArch64 CPU */
    if (sysctlbyname("hw.optional.arm.FEAT_DotProd", &on, &len, NULL, 0) == 0 && on)
        f |= KVC_F_DOTPROD;
#elif defined(__aarch64__)
    f |= KVC_F_NEON;
#endif
    return f;
}

/* The features body `body` may execute. */
static inline unsigned kvc_body_needs(int body)
{
    switch (body) {
    case KVC_ISA_AVX2: return KVC_F_AVX2 | KVC_F_FMA | KVC_F_F16C;
    case KVC_ISA_AVXVNNI: return KVC_F_AVX2 | KVC_F_FMA | KVC_F_F16C | KVC_F_AVXVNNI;
    case KVC_ISA_AVX512:
        return KVC_F_AVX2 | KVC_F_FMA | KVC_F_F16C | KVC_F_AVX512F | KVC_F_AVX512BW | KVC_F_AVX512DQ
               | KVC_F_AVX512VL | KVC_F_AVX512VNNI;
    case KVC_ISA_NEON: return KVC_F_NEON;
    case KVC_ISA_NEONDOT: return KVC_F_NEON | KVC_F_DOTPROD;
    default: return 0;
    }
}

/* Whether this CPU runs body `body`: every feature it needs is present. */
static inline int kvc_cpu_runs(int body)
{
    unsigned need = kvc_body_needs(body);
    return (kvc_cpu_features() & need) == need;
}

#endif
