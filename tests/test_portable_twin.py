"""The AVX2/FMA inner loops and their portable C twin compute the same bits.

_kernels.h promises that the summation orders are the same whichever path a build compiles;
this builds a small C program over the header twice (SIMD and -DKVC_NO_SIMD) with the C
compiler Python was built with and compares the printed bit patterns of every result.
"""

import os
import shlex
import subprocess
import sysconfig
from pathlib import Path

import kvcache
from conftest import cpu_runs_avx2

HEADER_DIR = Path(kvcache.__file__).parent
SOURCE = Path(__file__).parent / "c" / "portable_twin.c"


def build_and_run(tmp_path, name, extra):
    cc = shlex.split(sysconfig.get_config_var("CC") or "cc")
    exe = tmp_path / name
    cmd = cc + ["-O2", "-std=gnu11", "-ffp-contract=off", "-mavx2", "-mfma", *extra, f"-I{HEADER_DIR}",
                str(SOURCE), "-o", str(exe), "-lm"]
    subprocess.run(cmd, check=True, capture_output=True)
    return subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout


def test_simd_and_portable_paths_agree_bit_for_bit(tmp_path):
    assert (HEADER_DIR / "_kernels.h").exists()
    portable = build_and_run(tmp_path, "portable", ["-DKVC_NO_SIMD"])
    if not cpu_runs_avx2():          # this CPU cannot run the SIMD build: compile it only
        subprocess.run(shlex.split(sysconfig.get_config_var("CC") or "cc")
                       + ["-O2", "-std=gnu11", "-mavx2", "-mfma", f"-I{HEADER_DIR}", "-c",
                          str(SOURCE), "-o", str(tmp_path / "simd.o")], check=True)
        assert len(set(portable.splitlines())) > 1000
        return
    simd = build_and_run(tmp_path, "simd", [])
    lines_s, lines_p = simd.splitlines(), portable.splitlines()
    assert len(lines_s) == len(lines_p) > 10000
    diff = [i for i, (a, b) in enumerate(zip(lines_s, lines_p)) if a != b]
    assert not diff, f"{len(diff)} of {len(lines_s)} results differ, first at line {diff[0]}"
    assert len(set(lines_s)) > 1000                     # the program computed something
