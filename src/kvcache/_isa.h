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
#define KVC_TARGET_AVXVNNI __attribute__((target("avx2,fma,avxvnni")))
#define KVC_TARGET_AVX512 \
    __attribute__((target("avx2,fma,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))
#else
#define KVC_DISPATCH 0
#endif

static int kvc_isa = KVC_ISA_PORTABLE;

/* The best level this CPU (and OS) can run, limited to what the build holds. */
static int kvc_isa_detect(void)
{
#if KVC_DISPATCH
    __builtin_cpu_init();
    if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")))
        return KVC_ISA_PORTABLE;   /* cannot happen on a machine that imported the module */
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

#endif
