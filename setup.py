"""Build script: cythonizes ``src/kvcache/_core.pyx``.

The Cython directives are set once here.  ``KVCACHE_CYTHON_DEBUG=1`` turns bounds and
wraparound checks back on (for a test run).  OpenMP is probed with a tiny test program; when the
compiler cannot build it the extension is compiled serially and a warning is printed, so an
install never fails for lack of OpenMP.  ``KVCACHE_NATIVE=0`` drops ``-march=native`` (use it
when building a wheel for other machines).
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
NATIVE = os.environ.get("KVCACHE_NATIVE", "1") not in ("", "0")

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
    """build_ext that probes OpenMP and -march=native before compiling."""

    def build_extensions(self):
        compile_args = ["-O3", "-std=gnu11"]
        link_args = []
        if self.compiler.compiler_type == "msvc":
            compile_args = ["/O2"]
            omp_c, omp_l = ["/openmp"], []
        else:
            omp_c, omp_l = ["-fopenmp"], ["-fopenmp"]
            if NATIVE and _compiles(self.compiler, "int main(void){return 0;}\n", ["-march=native"], []):
                compile_args += ["-march=native", "-mprefer-vector-width=512"]
            compile_args += ["-fno-math-errno", "-fno-trapping-math"]
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
        ["src/kvcache/_core.pyx"],
        include_dirs=["src/kvcache"],
        depends=["src/kvcache/_kernels.h", "src/kvcache/_mla.h", "src/kvcache/_prefill.h",
                 "src/kvcache/_openmp.pxd"],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    )
]

setup(
    ext_modules=cythonize(extensions, compiler_directives=DIRECTIVES, force=DEBUG),
    cmdclass={"build_ext": BuildExt},
)
