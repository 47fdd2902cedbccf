"""Build script: cythonizes ``src/kvcache/_core.pyx``.

The Cython directives are set once here.  ``KVCACHE_CYTHON_DEBUG=1`` turns bounds and
wraparound checks back on (for a test run).  OpenMP is probed with a tiny test program; when the
compiler cannot build it the extension is compiled serially and a warning is printed, so an
install never fails for lack of OpenMP.

Instruction sets (docs/numerics.md, "Dispatch"): the extension is compiled for the baseline of
the target (plain x86-64 on x86), so it imports and runs on any CPU of the family.  The kernels
are compiled a second time in their own translation unit, ``_body_avx2.c``, under ``#pragma GCC
target("avx2,fma")`` with the AVX-VNNI and AVX-512 bodies under per-function target attributes;
_core runs a body of that unit only where the CPU reports every feature the body needs.  When
the compiler cannot build that unit it is left empty (``KVC_NO_SIMD``), and when it cannot
build the VNNI intrinsics those bodies are left out (``KVC_NO_VNNI``).
``KVCACHE_NATIVE=1`` adds ``-march=native`` (a build for this machine only; not needed for
speed).  ``KVCACHE_NO_SIMD=1`` builds the portable C alone (for tests).
Floating-point contraction is off (``-ffp-contract=off``): every fused multiply-add in the
kernels is written out, so each body computes the bits of the portable twin.
"""

import os
import sys
import tempfile
import textwrap
import warnings

import numpy  # noqa: F401  (build requirement; keeps the error clear when missing)
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

DEBUG = os.environ.get("KVCACHE_CYTHON_DEBUG", "0") not in ("", "0")
NATIVE = os.environ.get("KVCACHE_NATIVE", "0") not in ("", "0")
NO_SIMD = os.environ.get("KVCACHE_NO_SIMD", "0") not in ("", "0")

# the SIMD unit: the target pragma _body_avx2.c uses and the AVX2/FMA intrinsics, no -m flags
SIMD_PROBE = """
    #include <immintrin.h>
    #if defined(__clang__)
    #pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
    #else
    #pragma GCC push_options
    #pragma GCC target("avx2,fma")
    #endif
    static float f(const float *p)
    { __m256 v = _mm256_fmadd_ps(_mm256_loadu_ps(p), _mm256_loadu_ps(p), _mm256_setzero_ps());
      return _mm_cvtss_f32(_mm256_castps256_ps128(v)); }
    #if defined(__clang__)
    #pragma clang attribute pop
    #else
    #pragma GCC pop_options
    #endif
    int main(int argc, char **argv) {
        float x[8] = {1, 2, 3, 4, 5, 6, 7, 8};
        (void)argv;
        return argc > 99 ? (int)f(x) : 0;   /* compiled and linked, never run */
    }
"""

# the VNNI bodies: the target attributes and intrinsics _isa.h uses
VNNI_PROBE = """
    #include <immintrin.h>
    __attribute__((target("avx2,fma,avxvnni"))) static __m256i a(__m256i x, __m256i y)
    { return _mm256_dpbusd_avx_epi32(x, x, y); }
    __attribute__((target("avx2,fma,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))
    static __m256i b(__m256i x, __m256i y) { return _mm256_dpbusd_epi32(x, x, y); }
    __attribute__((target("avx2"))) static int c(int s) {
        __m256i z = _mm256_set1_epi32(s);
        return _mm256_extract_epi32(a(z, z), 0) + _mm256_extract_epi32(b(z, z), 0) == 12345;
    }
    int main(int argc, char **argv) {
        (void)argv;
        return argc > 99 ? c(argc) : 0;   /* compiled and linked, never run */
    }
"""

DIRECTIVES = {
    "language_level": 3,
    "boundscheck": DEBUG,
    "wraparound": DEBUG,
    "initializedcheck": DEBUG,
    "cdivision": not DEBUG,
    "nonecheck": DEBUG,
    "embedsignature": True,
}


def _compiles(compiler, code, extra_compile, extra_link):
    """Return True when ``code`` compiles and links with the given flags."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe.c")
        with open(src, "w") as fh:
            fh.write(textwrap.dedent(code))
        try:
            objs = compiler.compile([src], output_dir=tmp, extra_postargs=extra_compile)
            compiler.link_executable(objs, os.path.join(tmp, "probe"), extra_postargs=extra_link)
        except Exception:  # any compiler/linker failure means "not available"
            return False
    return True


class BuildExt(build_ext):
    """build_ext that probes OpenMP and the x86-64 SIMD unit before compiling."""

    def build_extensions(self):
        compile_args = ["-O3", "-std=gnu11"]
        link_args = []
        if self.compiler.compiler_type == "msvc":
            compile_args = ["/O2"]
            omp_c, omp_l = ["/openmp"], []
        else:
            omp_c, omp_l = ["-fopenmp"], ["-fopenmp"]
            macros = self.extensions[0].define_macros
            if NO_SIMD or not _compiles(self.compiler, SIMD_PROBE, [], []):
                macros.append(("KVC_NO_SIMD", "1"))
            elif not _compiles(self.compiler, VNNI_PROBE, [], []):
                macros.append(("KVC_NO_VNNI", "1"))
            if NATIVE and _compiles(self.compiler, "int main(void){return 0;}\n", ["-march=native"], []):
                compile_args += ["-march=native"]
            compile_args += ["-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off"]
        omp_probe = """
            #include <omp.h>
            int main(void) {
                int n = 0;
                #pragma omp parallel reduction(+:n)
                n += 1;
                return omp_get_max_threads() > 0 && n > 0 ? 0 : 1;
            }
        """
        if _compiles(self.compiler, omp_probe, omp_c, omp_l):
            compile_args += omp_c
            link_args += omp_l
        else:
            warnings.warn(
                "kvcache: the C compiler cannot build OpenMP code; building the serial "
                "kernels (they run on one thread). Install libgomp/libomp to get threads.",
                stacklevel=1,
            )
            print("WARNING: kvcache is being built WITHOUT OpenMP", file=sys.stderr)
        for ext in self.extensions:
            ext.extra_compile_args = compile_args + list(ext.extra_compile_args or [])
            ext.extra_link_args = link_args + list(ext.extra_link_args or [])
        super().build_extensions()


extensions = [
    Extension(
        "kvcache._core",
        ["src/kvcache/_core.pyx", "src/kvcache/_body_portable.c", "src/kvcache/_body_avx2.c"],
        include_dirs=["src/kvcache"],
        depends=["src/kvcache/_kernels.h", "src/kvcache/_mla.h", "src/kvcache/_prefill.h",
                 "src/kvcache/_isa.h", "src/kvcache/_i8dot.h", "src/kvcache/_sizes.h",
                 "src/kvcache/_dispatch.h", "src/kvcache/_body.h",
                 "src/kvcache/_openmp.pxd"],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    )
]

setup(
    ext_modules=cythonize(extensions, compiler_directives=DIRECTIVES, force=DEBUG),
    cmdclass={"build_ext": BuildExt},
)
