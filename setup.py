"""Build script: cythonizes ``src/kvcache/_core.pyx``.

The Cython directives are set once here.  ``KVCACHE_CYTHON_DEBUG=1`` turns bounds and
wraparound checks back on (for a test run).  OpenMP is probed with a tiny test program; when the
compiler cannot build it the extension is compiled serially and a warning is printed, so an
install never fails for lack of OpenMP.  On macOS, Apple clang has no OpenMP of its own: after
plain ``-fopenmp`` (GCC, LLVM clang) the probe tries ``-Xpreprocessor -fopenmp`` with libomp,
from Homebrew's prefix where there is one (``brew install libomp``; /opt/homebrew/opt/libomp,
/usr/local/opt/libomp, or what ``brew --prefix libomp`` answers), then on the default paths.

Instruction sets (docs/numerics.md, "Dispatch"): the extension is compiled for the baseline of
the target (plain x86-64 on x86, Armv8-A on aarch64), so it imports and runs on any CPU of the
family.  The kernels, written once on the vector layer ``_vec.h``, are compiled once per body,
each in a translation unit of its own under ``#pragma GCC target`` (clang: ``#pragma clang
attribute``): ``_body_avx2.c``, ``_body_avxvnni.c``, ``_body_avx512.c`` on x86-64,
``_body_neon.c`` and ``_body_neondot.c`` on aarch64 (Linux and macOS); _core runs a body only
where the CPU reports every feature it needs.  A unit the compiler cannot build (probed below)
is left empty (``KVC_NO_AVX2``, ``KVC_NO_AVXVNNI``, ``KVC_NO_AVX512``, ``KVC_NO_NEONDOT``).
``KVCACHE_NATIVE=1`` adds ``-march=native`` to the baseline units (a build for this machine
only; not needed for speed).  ``KVCACHE_NO_SIMD=1`` builds the portable C alone (for tests).
Floating-point contraction is off (``-ffp-contract=off``): every fused multiply-add in the
kernels is written out, so each body computes the bits of the portable twin.
"""

import os
import platform
import shutil
import subprocess
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


def _unit_probe(target, body, includes="#include <immintrin.h>", clang_target=None,
                inner="", clang_inner=""):
    """A program that compiles ``body`` (a function ``int f(int s)``) under a unit's target
    pragma, as the _body_*.c files do, then links it (never run).  ``inner`` (``clang_inner``
    for clang only) is what the unit writes after its push, before the body."""
    clang_target = target.lstrip("+") if clang_target is None else clang_target
    return f"""
    {includes}
    #if defined(__clang__)
    #pragma clang attribute push(__attribute__((target("{clang_target}"))), apply_to = function)
    {clang_inner}
    #else
    #pragma GCC push_options
    #pragma GCC target("{target}")
    #endif
    {inner}
    {body}
    #if defined(__clang__)
    #pragma clang attribute pop
    #else
    #pragma GCC pop_options
    #endif
    int main(int argc, char **argv) {{ (void)argv; return argc > 99 ? f(argc) : 0; }}
    """


# The units' targets and the intrinsics _vec.h uses there: (macro that leaves the unit out,
# target, test body).  x86-64 and aarch64 each probe their own.
X86_UNITS = [
    ("KVC_NO_AVX2", "avx2,fma,f16c",
     "static int f(int s) { __m256 v = _mm256_set1_ps((float)s); v = _mm256_fmadd_ps(v, v, v);"
     " v = _mm256_add_ps(v, _mm256_cvtph_ps(_mm_set1_epi16((short)s)));"
     " return (int)_mm_cvtss_f32(_mm256_castps256_ps128(v)); }"),
    ("KVC_NO_AVXVNNI", "avx2,fma,f16c,avxvnni",
     "static int f(int s) { __m256i z = _mm256_set1_epi32(s);"
     " return _mm256_extract_epi32(_mm256_dpbusd_avx_epi32(z, z, z), 0); }"),
    ("KVC_NO_AVX512",
     "avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,prefer-vector-width=256",
     "static int f(int s) { __m256i z = _mm256_set1_epi32(s); __m512 w = _mm512_set1_ps((float)s);"
     " w = _mm512_fmadd_ps(w, w, w); z = _mm256_dpbusd_epi32(z, z, z);"
     " return _mm256_extract_epi32(z, 0) + (int)_mm512_reduce_add_ps(w); }"),
]
# aarch64: (macro, GCC target, clang target, test body), probed as _body_neondot.c builds the
# unit: arm_neon.h included after the push (clang 14 declares vdotq_s32 only where
# __ARM_FEATURE_DOTPROD is defined; GCC 12 defines it under arch=armv8.2-a+dotprod)
ARM_UNITS = [
    ("KVC_NO_NEONDOT", "arch=armv8.2-a+dotprod", "dotprod",
     "static int f(int s) { int8x16_t a = vdupq_n_s8((int8_t)s);"
     " return vgetq_lane_s32(vdotq_s32(vdupq_n_s32(0), a, a), 0); }"),
]
ARM_CLANG_INNER = """
    #ifndef __ARM_FEATURE_DOTPROD
    #define __ARM_FEATURE_DOTPROD 1
    #endif"""

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


def _libomp_prefixes():
    """Homebrew's libomp prefixes on this Mac that hold omp.h: Apple silicon's, Intel's, and the
    one ``brew --prefix libomp`` names (libomp is keg-only: not on the compiler's paths)."""
    candidates = ["/opt/homebrew/opt/libomp", "/usr/local/opt/libomp"]
    brew = shutil.which("brew")
    if brew:
        try:
            answer = subprocess.run([brew, "--prefix", "libomp"], capture_output=True,
                                    text=True, timeout=60, check=False)
            if answer.returncode == 0 and answer.stdout.strip():
                candidates.append(answer.stdout.strip())
        except (OSError, subprocess.SubprocessError):
            pass
    found = []
    for prefix in candidates:
        if prefix not in found and os.path.isfile(os.path.join(prefix, "include", "omp.h")):
            found.append(prefix)
    return found


def _openmp_options():
    """The OpenMP (compile, link) flags to probe, in order: ``-fopenmp`` (GCC, LLVM clang), and
    on macOS Apple clang's form, the preprocessor flag with libomp."""
    options = [(["-fopenmp"], ["-fopenmp"])]
    if sys.platform == "darwin":
        for prefix in _libomp_prefixes():
            lib = os.path.join(prefix, "lib")
            options.append((["-Xpreprocessor", "-fopenmp", "-I" + os.path.join(prefix, "include")],
                            ["-L" + lib, "-lomp", "-Wl,-rpath," + lib]))
        options.append((["-Xpreprocessor", "-fopenmp"], ["-lomp"]))
    return options


class BuildExt(build_ext):
    """build_ext that probes OpenMP and the x86-64 SIMD unit before compiling."""

    def build_extensions(self):
        compile_args = ["-O3", "-std=gnu11"]
        link_args = []
        if self.compiler.compiler_type == "msvc":
            compile_args = ["/O2"]
            omp_options = [(["/openmp"], [])]
        else:
            omp_options = _openmp_options()
            macros = self.extensions[0].define_macros
            machine = platform.machine().lower()
            if NO_SIMD:
                macros.append(("KVC_NO_SIMD", "1"))
            elif machine in ("x86_64", "amd64"):
                for macro, target, body in X86_UNITS:
                    if not _compiles(self.compiler, _unit_probe(target, body), [], []):
                        macros.append((macro, "1"))
            elif machine in ("aarch64", "arm64"):
                for macro, target, clang_target, body in ARM_UNITS:
                    probe = _unit_probe(target, body, "#include <stdint.h>", clang_target,
                                        "#include <arm_neon.h>", ARM_CLANG_INNER)
                    if not _compiles(self.compiler, probe, [], []):
                        macros.append((macro, "1"))
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
        for omp_c, omp_l in omp_options:
            if _compiles(self.compiler, omp_probe, omp_c, omp_l):
                compile_args += omp_c
                link_args += omp_l
                break
        else:
            warnings.warn(
                "kvcache: the C compiler cannot build OpenMP code; building the serial "
                "kernels (they run on one thread). Install libgomp/libomp to get threads "
                "(macOS: brew install libomp).",
                stacklevel=1,
            )
            print("WARNING: kvcache is being built WITHOUT OpenMP", file=sys.stderr)
        for ext in self.extensions:
            ext.extra_compile_args = compile_args + list(ext.extra_compile_args or [])
            ext.extra_link_args = link_args + list(ext.extra_link_args or [])
        super().build_extensions()


# one translation unit per kernel body (_dispatch.h); a unit for another CPU family compiles to
# nothing
BODY_UNITS = ("portable", "avx2", "avxvnni", "avx512", "neon", "neondot")

extensions = [
    Extension(
        "kvcache._core",
        ["src/kvcache/_core.pyx"] + [f"src/kvcache/_body_{unit}.c" for unit in BODY_UNITS],
        include_dirs=["src/kvcache"],
        depends=["src/kvcache/_kernels.h", "src/kvcache/_mla.h", "src/kvcache/_prefill.h",
                 "src/kvcache/_isa.h", "src/kvcache/_i8dot.h", "src/kvcache/_sizes.h",
                 "src/kvcache/_dispatch.h", "src/kvcache/_body.h", "src/kvcache/_entry.h",
                 "src/kvcache/_vec.h", "src/kvcache/_openmp.pxd"],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    )
]

setup(
    ext_modules=cythonize(extensions, compiler_directives=DIRECTIVES, force=DEBUG),
    cmdclass={"build_ext": BuildExt},
)
