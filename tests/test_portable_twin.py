"""Every x86 body of the decode, q8, O(1) and MLA kernels computes the portable twin's bits.

The kernels are written once on the vector layer, whose folds fix every summation order; this
builds tests/c/portable_twin.c once per body (the compile flags pick the layer's target) with
the C compiler Python was built with and compares the printed bit patterns of every result
(tests/test_aarch64.py does the same for the NEON bodies under emulation).
"""

import shlex
import subprocess
import sysconfig
from pathlib import Path

import kvcache
from conftest import X86_BODY_FLAGS, cpu_runs

HEADER_DIR = Path(kvcache.__file__).parent
SOURCE = Path(__file__).parent / "c" / "portable_twin.c"


def build(tmp_path, name, flags):
    cc = shlex.split(sysconfig.get_config_var("CC") or "cc")
    exe = tmp_path / name
    cmd = cc + ["-O2", "-std=gnu11", "-ffp-contract=off", *flags, f"-I{HEADER_DIR}",
                str(SOURCE), "-o", str(exe), "-lm"]
    subprocess.run(cmd, check=True, capture_output=True)
    return exe


def run(exe):
    return subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout


def test_every_x86_body_and_the_portable_twin_agree_bit_for_bit(tmp_path):
    """One build per x86 body (the flags select the vector layer's target as a unit's pragma
    does); each that this CPU runs prints the portable build's bits, the others compile."""
    assert (HEADER_DIR / "_kernels.h").exists()
    portable = run(build(tmp_path, "portable", X86_BODY_FLAGS["portable"]))
    lines_p = portable.splitlines()
    assert len(lines_p) > 10000 and len(set(lines_p)) > 1000     # it computed something
    ran = []
    for body, flags in X86_BODY_FLAGS.items():
        if body == "portable":
            continue
        exe = build(tmp_path, body, flags)
        if not cpu_runs(body):
            continue
        lines_s = run(exe).splitlines()
        assert len(lines_s) == len(lines_p)
        diff = [i for i, (a, b) in enumerate(zip(lines_s, lines_p)) if a != b]
        assert not diff, f"{body}: {len(diff)} of {len(lines_s)} results differ, first at line {diff[0]}"
        ran.append(body)
    assert ran == [b for b in X86_BODY_FLAGS if b != "portable" and cpu_runs(b)]


def test_the_avx512_forms_emulated_give_the_portable_bits(tmp_path):
    """The AVX-512 body's own forms (the value pass up to eight queries at a time on 16-lane
    registers, 4-bit K scored sixteen rows per register, int8 K packed once per block and
    scored for all the group's queries) built with -DKVC_EMULATE_512 on the
    portable layer, and on AVX2 where this CPU runs it, so that a CPU without AVX-512 checks
    their bits too."""
    portable = run(build(tmp_path, "portable", X86_BODY_FLAGS["portable"])).splitlines()
    builds = {"portable-512": [*X86_BODY_FLAGS["portable"], "-DKVC_EMULATE_512"]}
    if cpu_runs("avx2"):
        builds["avx2-512"] = [*X86_BODY_FLAGS["avx2"], "-DKVC_EMULATE_512"]
    for name, flags in builds.items():
        lines = run(build(tmp_path, name, flags)).splitlines()
        assert len(lines) == len(portable)
        diff = [i for i, (a, b) in enumerate(zip(lines, portable)) if a != b]
        assert not diff, f"{name}: {len(diff)} of {len(lines)} results differ, first at {diff[0]}"
