"""The MLA decode bodies of _mla.h compute the same bits, each built as its own program.

tests/c/mla_paths.c runs fold, tasks and merge (as _core.mla_attend drives them) over about
eleven thousand geometries -- head counts with and without vector remainders, ranks and RoPE
widths with every kind of tail, row counts under one tile up to several blocks and tasks,
several query positions, rows that score -inf and rows holding NaN -- and prints one hash of
the bits of every result per call.  A build holds one body, chosen by its compile flags as a
kernel unit's is (_vec.h picks the target, _mla.h the width):

  portable         -DKVC_NO_SIMD: the reference every other build must reproduce
  avx2             -mavx2 -mfma -mf16c: the 8-float body
  avx512-emulated  the same with -DKVC_EMULATE_512: the 16-float body on pairs of 8-lane
                   vectors, so that the very code of the AVX-512 body runs on an AVX2 machine
  avx512           the AVX-512 flags: the 16-float body on __m512; it must compile to zmm
                   instructions everywhere and runs where the CPU has AVX-512
  neon             aarch64-linux-gnu-gcc -static, run under qemu-aarch64 -cpu max, where both
                   are on PATH

The x86 builds use the C compiler Python was built with.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

import kvcache
from conftest import X86_BODY_FLAGS, cpu_runs

HEADER_DIR = Path(kvcache.__file__).parent
SOURCE = Path(__file__).parent / "c" / "mla_paths.c"
# the extension's float flags
FLAGS = ["-O3", "-std=gnu11", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off"]
AVX2 = X86_BODY_FLAGS["avx2"]

# build: (its flags, the body it names, whether this CPU runs it)
BUILDS = {
    "avx2": (AVX2, "avx2", lambda: cpu_runs("avx2")),
    "avx512-emulated": ([*AVX2, "-DKVC_EMULATE_512"], "avx512", lambda: cpu_runs("avx2")),
    "avx512": (X86_BODY_FLAGS["avx512"], "avx512", lambda: cpu_runs("avx512")),
}
AARCH64_CC = shutil.which("aarch64-linux-gnu-gcc")
QEMU_AARCH64 = shutil.which("qemu-aarch64")


def compiler() -> list[str]:
    return shlex.split(sysconfig.get_config_var("CC") or "cc")


def build(out: Path, extra: list[str], cc: list[str] | None = None) -> Path:
    cmd = (cc or compiler()) + [*FLAGS, *extra, f"-I{HEADER_DIR}", str(SOURCE), "-o", str(out),
                                "-lm"]
    subprocess.run(cmd, check=True, capture_output=True)
    return out


def run(cmd: list[str]) -> tuple[str, list[str]]:
    """The body's name and one line per call."""
    lines = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()
    return lines[0], lines[1:]


def totals(lines: list[str]) -> tuple[int, int]:
    """Results and NaN results over all calls."""
    return (sum(int(line.split()[-2]) for line in lines),
            sum(int(line.split()[-1]) for line in lines))


def first_difference(a: list[str], b: list[str]) -> str:
    diff = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    if not diff:
        return ""
    return f"{len(diff)} of {len(a)} calls differ, first: {a[diff[0]]} vs {b[diff[0]]}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The portable build's lines."""
    exe = build(tmp_path_factory.mktemp("mla") / "portable", ["-DKVC_NO_SIMD"])
    name, lines = run([str(exe)])
    assert name == "portable"
    return lines


def test_the_portable_build_computes_every_call(reference: list[str]) -> None:
    assert len(reference) > 10000
    results, nans = totals(reference)
    assert results > 10_000_000 and 0 < nans < results // 10
    # every call its own bits
    assert len({line.split()[-3] for line in reference}) == len(reference)


@pytest.mark.parametrize("name", list(BUILDS))
def test_each_x86_body_matches_the_portable_build_bit_for_bit(name: str, tmp_path: Path,
                                                              reference: list[str]) -> None:
    flags, body, cpu_runs = BUILDS[name]
    exe = build(tmp_path / name, flags)           # every build compiles, whatever the CPU
    if not cpu_runs():
        pytest.skip(f"built only: this CPU does not run the {name} build")
    got_name, got = run([str(exe)])
    assert got_name == body
    assert len(got) == len(reference)
    assert got == reference, first_difference(got, reference)


def test_the_avx512_body_is_made_of_zmm_instructions(tmp_path: Path) -> None:
    asm = tmp_path / "mla_paths.s"
    build(asm, [*X86_BODY_FLAGS["avx512"], "-S"])
    text = asm.read_text()
    task = re.search(r"^kvc_mla_task:\n(.*?)^\s*\.size\s+kvc_mla_task,", text, re.M | re.S)
    assert task, "no function kvc_mla_task in the program"
    assert re.search(r"vfmadd\w*ps\s[^\n]*%zmm", task.group(1))   # a real 16-float body


@pytest.mark.skipif(not (AARCH64_CC and QEMU_AARCH64),
                    reason="needs aarch64-linux-gnu-gcc and qemu-aarch64 on PATH")
def test_the_neon_body_matches_the_portable_build_bit_for_bit(tmp_path: Path,
                                                              reference: list[str]) -> None:
    exe = build(tmp_path / "neon", ["-static"], cc=[AARCH64_CC])
    name, got = run([QEMU_AARCH64, "-cpu", "max", str(exe)])
    assert name == "neon"
    assert got == reference, first_difference(got, reference)
