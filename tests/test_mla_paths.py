"""The MLA decode bodies of _mla.h compute the same bits: AVX2, AVX-512 and the portable twin.

tests/c/mla_paths.c runs fold, tasks and merge (as _core.mla_attend drives them) over about
eleven thousand geometries -- head counts with and without vector remainders, ranks and RoPE
widths with every kind of tail, row counts under one tile up to several blocks and tasks,
several query positions, rows that score -inf and rows holding NaN -- and prints one hash of
the bits of every result per call.  It is built three ways with the C compiler Python was built
with: with KVC_EMULATE_512, which builds the AVX-512 body's 16-float vectors from pairs of
__m256 operations so that the very code of that body runs on an AVX2 machine (run at level 1,
the AVX2 body, and level 3, the AVX-512 body); with -DKVC_NO_SIMD (the portable twin); and
as the real build, whose __m512 body must compile, and runs too where the CPU has AVX-512.
"""

from __future__ import annotations

import shlex
import subprocess
import sysconfig
from pathlib import Path

import pytest

import kvcache
from conftest import cpu_runs_avx2

HEADER_DIR = Path(kvcache.__file__).parent
SOURCE = Path(__file__).parent / "c" / "mla_paths.c"
# the extension's baseline (AVX2 + FMA, no -march=native) and its float flags
FLAGS = ["-O3", "-std=gnu11", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off"]
SIMD = ["-mavx2", "-mfma"]


def compiler() -> list[str]:
    return shlex.split(sysconfig.get_config_var("CC") or "cc")


def build(tmp_path: Path, name: str, extra: list[str]) -> Path:
    exe = tmp_path / name
    cmd = compiler() + [*FLAGS, *extra, f"-I{HEADER_DIR}", str(SOURCE), "-o", str(exe), "-lm"]
    subprocess.run(cmd, check=True, capture_output=True)
    return exe


def run(exe: Path, arg: str) -> tuple[str, list[str]]:
    """The body's name and one line per call."""
    lines = subprocess.run([str(exe), arg], check=True, capture_output=True,
                           text=True).stdout.splitlines()
    return lines[0], lines[1:]


def totals(lines: list[str]) -> tuple[int, int]:
    """Results and NaN results over all calls."""
    return (sum(int(line.split()[-2]) for line in lines),
            sum(int(line.split()[-1]) for line in lines))


@pytest.fixture(scope="module")
def emu(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The SIMD build with the AVX-512 body on emulated 16-float vectors."""
    return build(tmp_path_factory.mktemp("mla"), "emu", [*SIMD, "-DKVC_EMULATE_512"])


def first_difference(a: list[str], b: list[str]) -> str:
    diff = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    return f"{len(diff)} of {len(a)} calls differ, first: {a[diff[0]]} vs {b[diff[0]]}" if diff else ""


def test_avx2_avx512_and_portable_bodies_agree_bit_for_bit(tmp_path: Path, emu: Path) -> None:
    portable = build(tmp_path, "portable", ["-DKVC_NO_SIMD"])
    if not cpu_runs_avx2():          # the SIMD builds (compiled by the fixture) cannot run here
        name_c, twin = run(portable, "3")
        assert name_c == "portable" and len(twin) > 10000
        return
    name2, avx2 = run(emu, "1")
    name16, avx512 = run(emu, "3")
    name_c, twin = run(portable, "3")          # a portable build ignores the level
    assert (name2, name16, name_c) == ("avx2", "avx512", "portable")
    assert len(avx2) == len(avx512) == len(twin) > 10000
    assert avx2 == avx512, first_difference(avx2, avx512)
    assert avx2 == twin, first_difference(avx2, twin)
    results, nans = totals(avx2)
    assert results > 10_000_000 and 0 < nans < results // 10
    assert len({line.split()[-3] for line in avx2}) == len(avx2)   # every call its own bits


def test_level_zero_and_vnni_run_the_avx2_body(emu: Path) -> None:
    if not cpu_runs_avx2():
        assert emu.exists()
        return
    assert run(emu, "0")[0] == "avx2"          # kvc_isa not set yet: the baseline body
    assert run(emu, "2")[0] == "avx2"          # AVX-VNNI brings nothing to float kernels


def test_real_avx512_body_builds_and_runs_where_the_cpu_has_it(tmp_path: Path, emu: Path) -> None:
    asm = tmp_path / "mla_paths.s"
    subprocess.run(compiler() + [*FLAGS, *SIMD, f"-I{HEADER_DIR}", "-S", str(SOURCE), "-o",
                                 str(asm)], check=True, capture_output=True)
    text = asm.read_text()
    assert "kvc_mla_task_avx512" in text and "%zmm" in text   # a real 16-float body
    real = build(tmp_path, "real", SIMD)
    if not cpu_runs_avx2():
        return
    reference = run(emu, "1")[1]
    name, avx2 = run(real, "1")
    assert name == "avx2" and avx2 == reference, first_difference(avx2, reference)
    level = int(subprocess.run([str(real), "detect"], check=True, capture_output=True,
                               text=True).stdout)
    if level >= 3:                             # this CPU runs the __m512 instructions
        name, avx512 = run(real, "3")
        assert name == "avx512" and avx512 == reference, first_difference(avx512, reference)
