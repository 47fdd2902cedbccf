"""The aarch64 kernel bodies, built with a cross compiler and run under user-mode QEMU.

1. Twin programs.  Every C program of tests/c (a twin: it runs kernels on pseudo-random
   inputs and prints the bits of every result) is built statically three ways -- ``portable``
   (-DKVC_NO_SIMD), ``neon`` (-march=armv8-a) and ``neondot`` (-march=armv8.2-a+dotprod) --
   with the arguments its x86 test gives it, and run under ``qemu-aarch64 -cpu cortex-a53``
   (Armv8.0: no dot product) and ``-cpu max``.  The portable and neon builds must run on both
   CPUs and neondot under max, all printing the portable build's results; a neondot build
   that holds sdot must die of SIGILL on the Cortex-A53 (the emulated core really lacks the
   extension, the build really uses it) after printing a prefix of those results.
   The portable build must also print what the portable build of the same program prints on
   this (x86-64) machine, with two allowances that belong to the machines, not the kernels:
   the softcap's tanhf comes from the C library, whose x86-64 and aarch64 builds differ in the
   last bit for some inputs, so both builds take the fixed stand-in tests/c/fixed_tanhf.h;
   and an invalid operation makes a NaN with the sign bit set on x86 and clear on Arm, so NaNs
   compare as one value there.
2. Detection and dispatch: tests/c/aarch64_dispatch.c, linked with the unit objects compiled
   as setup.py compiles them, must detect neon alone on the Cortex-A53 and choose the neon
   table, neon + dotprod on max and choose neondot, and get the same bits from every table
   the CPU runs.
3. Instructions: the float kernels of both NEON units hold vector FMAs (fmla on .4s), the q8
   scoring of the neondot unit holds sdot, the neon unit none.

The cross compiler (Debian: gcc-aarch64-linux-gnu), its C library (libc6-dev-arm64-cross) and
qemu-aarch64 (qemu-user) are needed; where one is missing the tests skip, unless
KVCACHE_REQUIRE_AARCH64 is set (.ci/run sets it), where they fail.  Everything is built once
per module, jobs in parallel.
"""

from __future__ import annotations

import os
import re
import resource
import shlex
import shutil
import signal
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEADERS = ROOT / "src" / "kvcache"
C_DIR = Path(__file__).resolve().parent / "c"
FIXED_TANHF = C_DIR / "fixed_tanhf.h"

CC = "aarch64-linux-gnu-gcc"
QEMU = "qemu-aarch64"
OBJDUMP = "aarch64-linux-gnu-objdump"
REQUIRED = os.environ.get("KVCACHE_REQUIRE_AARCH64", "") not in ("", "0")

# the twins' float flags (the extension's), static so QEMU needs no aarch64 root
FLAGS = ["-O3", "-std=gnu11", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math"]
BUILDS = {
    "portable": ["-DKVC_NO_SIMD"],
    "neon": ["-march=armv8-a"],
    "neondot": ["-march=armv8.2-a+dotprod"],
}
CPUS = ("cortex-a53", "max")          # without and with the dot product
# the units as setup.py compiles them (its flags, and the -fPIC and -fwrapv of Python's own)
UNIT_FLAGS = ["-O3", "-std=gnu11", "-fPIC", "-fwrapv", "-fno-math-errno", "-fno-trapping-math",
              "-ffp-contract=off"]
UNITS = ("portable", "avx2", "avxvnni", "avx512", "neon", "neondot")   # setup.py BODY_UNITS


@dataclass(frozen=True)
class Program:
    """How a twin program is run: one run per argument tuple (the arguments its x86 test gives
    it); how many leading lines name the body rather than print results (checked against
    HEADS where listed, never compared between builds); whether it runs q8 scoring, so that
    its neondot build holds sdot and dies of SIGILL on the Cortex-A53 (a program without it
    runs there like the neon build)."""

    args: tuple[tuple[str, ...], ...] = ((),)
    head: int = 0
    sdot: bool = True


# Every tests/c/*.c program is a twin run here.  One that needs arguments, or prints a head, is
# listed with them (whoever changes a program's arguments changes them here too); None: not a
# twin (built from the units below, not by flags).
PROGRAMS: dict[str, Program | None] = {
    "i8_twin": Program(head=1),
    "mla_paths": Program(head=1, sdot=False),   # float32 kernels only
    "aarch64_dispatch": None,
}
# the head each build must print
HEADS = {
    "i8_twin": {"portable": ["portable 0"], "neon": ["neon 3"], "neondot": ["neon 4"]},
    "mla_paths": {"portable": ["portable"], "neon": ["neon"], "neondot": ["neon"]},
}
TWINS = sorted(p.stem for p in C_DIR.glob("*.c") if PROGRAMS.get(p.stem, Program()) is not None)


def _no_core_dump() -> None:
    """QEMU writes a core file of a guest killed by a signal where the limit allows."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _run(cmd: list[str], cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          preexec_fn=_no_core_dump)


def _host_cc() -> list[str]:
    return shlex.split(sysconfig.get_config_var("CC") or "cc")


def _first_error(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if "error" in ln]
    return (lines or stderr.splitlines() or ["(no output)"])[0]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The cross tools, checked once: skip (fail where KVCACHE_REQUIRE_AARCH64 is set) when the
    compiler, its static C library, objdump or QEMU is missing."""
    tmp = tmp_path_factory.mktemp("aarch64")
    problem = None
    missing = [t for t in (CC, OBJDUMP, QEMU) if shutil.which(t) is None]
    if missing:
        problem = (f"{', '.join(missing)} not found (Debian/Ubuntu: apt-get install "
                   "gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user)")
    else:
        (tmp / "hello.c").write_text('#include <stdio.h>\nint main(void) { puts("hello"); '
                                     "return 0; }\n")
        built = _run([CC, "-static", "hello.c", "-o", "hello"], tmp)
        ran = _run([QEMU, "-cpu", "cortex-a53", "./hello"], tmp) if built.returncode == 0 else None
        if built.returncode != 0:
            problem = (f"{CC} cannot link a static program ({_first_error(built.stderr)}); "
                       "install libc6-dev-arm64-cross")
        elif ran is None or ran.stdout != "hello\n":
            problem = f"{QEMU} does not run a static aarch64 program: {ran and ran.stderr!r}"
    if problem:
        if REQUIRED:
            pytest.fail(f"KVCACHE_REQUIRE_AARCH64 is set, but {problem}", pytrace=False)
        pytest.skip(problem)
    return tmp


# ---------------------------------------------------------------------------------------------
# 1. twin programs


@dataclass
class Runs:
    """One twin program: build errors by build, and every run's (returncode, stdout) by
    (build, cpu, args); cpu "host" for the host's build."""

    errors: dict[str, str] = field(default_factory=dict)
    out: dict[tuple[str, str, tuple[str, ...]], tuple[int, str]] = field(default_factory=dict)
    sdot: bool = False   # the neondot build holds sdot


# the builds of each program: (name, compiler, flags); "fixed" ones take the fixed tanhf
def _builds() -> list[tuple[str, list[str], list[str]]]:
    fixed = ["-DKVC_NO_SIMD", "-include", str(FIXED_TANHF)]
    return ([(name, [CC, "-static"], flags) for name, flags in BUILDS.items()]
            + [("portable-fixed", [CC, "-static"], fixed), ("host-fixed", _host_cc(), fixed)])


@pytest.fixture(scope="module")
def twins(workdir: Path) -> dict[str, Runs]:
    """Every twin built every way and run on every CPU (in parallel), once per module."""
    results = {name: Runs() for name in TWINS}
    jobs = os.cpu_count() or 2

    def build(name: str, build: str, cc: list[str], flags: list[str]) -> None:
        exe = workdir / f"{name}-{build}"
        done = _run(cc + FLAGS + flags + [f"-I{HEADERS}", str(C_DIR / f"{name}.c"), "-o",
                                          str(exe), "-lm"], workdir)
        if done.returncode != 0:
            results[name].errors[build] = done.stderr

    with ThreadPoolExecutor(jobs) as pool:
        for f in [pool.submit(build, name, b, cc, flags)
                  for name in TWINS for b, cc, flags in _builds()]:
            f.result()

    def run(name: str, build: str, cpu: str, args: tuple[str, ...]) -> None:
        exe = str(workdir / f"{name}-{build}")
        cmd = [exe, *args] if cpu == "host" else [QEMU, "-cpu", cpu, exe, *args]
        done = _run(cmd, workdir)
        results[name].out[(build, cpu, args)] = (done.returncode, done.stdout)

    todo = []
    for name in TWINS:
        if results[name].errors:
            continue
        dump = _run([OBJDUMP, "-d", "--no-show-raw-insn", str(workdir / f"{name}-neondot")],
                    workdir).stdout
        results[name].sdot = re.search(r"\tsdot\t", dump) is not None
        for args in (PROGRAMS.get(name) or Program()).args:
            todo += [(name, b, cpu, args) for b in BUILDS for cpu in CPUS]
            todo += [(name, "portable-fixed", "cortex-a53", args),
                     (name, "host-fixed", "host", args)]
    with ThreadPoolExecutor(jobs) as pool:
        for f in [pool.submit(run, *job) for job in todo]:
            f.result()
    return results


def _built(name: str, runs: Runs) -> None:
    if runs.errors:
        by_error: dict[str, list[str]] = {}
        for b, e in sorted(runs.errors.items()):
            by_error.setdefault(_first_error(e), []).append(b)
        detail = "; ".join(f"{', '.join(bs)}: {e}" for e, bs in by_error.items())
        pytest.fail(f"{name} does not build: {detail}", pytrace=False)


def _first_difference(a: list[str], b: list[str]) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            n = sum(p != q for p, q in zip(a, b))
            return f"{n} of {len(a)} lines differ, first at line {i}: {x} vs {y}"
    return f"{len(a)} lines vs {len(b)}"


@pytest.mark.parametrize("name", TWINS)
def test_twin_bodies_agree_under_emulation(twins: dict[str, Runs], name: str) -> None:
    runs = twins[name]
    _built(name, runs)
    prog = PROGRAMS.get(name) or Program()
    assert runs.sdot == prog.sdot, (
        f"{name}: its neondot build {'holds' if runs.sdot else 'holds no'} sdot (PROGRAMS says "
        f"sdot={prog.sdot})")
    for args in prog.args:
        outs = {(b, cpu): runs.out[(b, cpu, args)] for b in BUILDS for cpu in CPUS}
        rc, text = outs[("portable", "cortex-a53")]
        assert rc == 0, f"{name} {args}: the portable build exited with {rc}"
        lines = text.splitlines()
        head, ref = lines[:prog.head], lines[prog.head:]
        assert len(set(ref)) > 100, f"{name} {args}: too little output to compare"
        for (build, cpu), (rc, text) in outs.items():
            lines = text.splitlines()
            if build == "neondot" and cpu == "cortex-a53" and prog.sdot:
                assert rc == -signal.SIGILL, (
                    f"{name} {args}: the neondot build exited with {rc} on a core without the "
                    f"dot product, not with SIGILL")
                # what it printed before the first sdot is the start of the results (whole
                # buffers: the last line may be cut)
                got = "\n".join(lines[prog.head:])
                assert "\n".join(ref).startswith(got), f"{name} {args}: neondot before SIGILL"
                continue
            assert rc == 0, f"{name} {args}: the {build} build exited with {rc} under {cpu}"
            if name in HEADS:
                assert lines[:prog.head] == HEADS[name][build], (name, build, cpu)
            assert lines[prog.head:] == ref, (
                f"{name} {args}: {build} under {cpu} vs portable: "
                f"{_first_difference(lines[prog.head:], ref)}")
        if name in HEADS:
            assert head == HEADS[name]["portable"]


def _nan_as_one(line: str) -> str:
    """A line that is the hex bits of a float NaN (any sign or payload) -> "nan"."""
    if re.fullmatch(r"[0-9a-f]{8}", line):
        b = int(line, 16)
        if (b >> 23) & 0xFF == 0xFF and b & 0x7FFFFF:
            return "nan"
    return line


@pytest.mark.parametrize("name", TWINS)
def test_twin_portable_build_matches_the_host_s(twins: dict[str, Runs], name: str) -> None:
    """The same program's portable build, on aarch64 and on this machine (both with the fixed
    tanhf; NaNs as one value): the same results, head included."""
    runs = twins[name]
    _built(name, runs)
    for args in (PROGRAMS.get(name) or Program()).args:
        rc_a, arm = runs.out[("portable-fixed", "cortex-a53", args)]
        rc_h, host = runs.out[("host-fixed", "host", args)]
        assert rc_a == 0 and rc_h == 0, (name, args, rc_a, rc_h)
        arm_lines = [_nan_as_one(x) for x in arm.splitlines()]
        host_lines = [_nan_as_one(x) for x in host.splitlines()]
        assert len(set(host_lines)) > 100
        assert arm_lines == host_lines, (
            f"{name} {args}: aarch64 vs host: {_first_difference(arm_lines, host_lines)}")


# ---------------------------------------------------------------------------------------------
# 2. detection and dispatch, 3. instructions: the unit objects


@pytest.fixture(scope="module")
def units(workdir: Path) -> dict[str, Path]:
    """The six unit objects, compiled for aarch64 as setup.py compiles them."""
    objs = {u: workdir / f"_body_{u}.o" for u in UNITS}

    def compile_unit(u: str) -> subprocess.CompletedProcess[str]:
        return _run([CC, *UNIT_FLAGS, f"-I{HEADERS}", "-c", str(HEADERS / f"_body_{u}.c"), "-o",
                     str(objs[u])], workdir)

    with ThreadPoolExecutor(os.cpu_count() or 2) as pool:
        done = dict(zip(UNITS, pool.map(compile_unit, UNITS)))
    bad = {u: _first_error(d.stderr) for u, d in done.items() if d.returncode != 0}
    assert not bad, f"units that do not compile for aarch64: {bad}"
    return objs


def test_detection_and_dispatch_under_emulation(workdir: Path, units: dict[str, Path]) -> None:
    exe = workdir / "aarch64_dispatch"
    done = _run([CC, "-static", *UNIT_FLAGS, f"-I{HEADERS}", str(C_DIR / "aarch64_dispatch.c"),
                 *map(str, units.values()), "-o", str(exe), "-lm"], workdir)
    assert done.returncode == 0, done.stderr
    expect = {
        "cortex-a53": ("features neon", "runs portable neon", "chosen neon", ["neondot"]),
        "max": ("features neon dotprod", "runs portable neon neondot", "chosen neondot", []),
    }
    calls: dict[str, list[str]] = {}
    for cpu, (features, runs, chosen, skipped) in expect.items():
        done = _run([QEMU, "-cpu", cpu, str(exe)], workdir)
        assert done.returncode == 0, (cpu, done.returncode, done.stderr)
        lines = done.stdout.splitlines()
        assert lines[:4] == [features, "built portable neon neondot", runs, chosen], cpu
        assert [ln.split()[1] for ln in lines[4:] if ln.startswith("skip ")] == skipped, cpu
        by_table: dict[str, list[str]] = {}
        for ln in lines[4:]:
            if not ln.startswith("skip "):
                table, rest = ln.split(" ", 1)
                by_table.setdefault(table, []).append(rest)
        assert sorted(by_table) == sorted(runs.split()[1:]), cpu
        for table, got in by_table.items():
            calls.setdefault("reference", by_table["portable"])
            assert got == calls["reference"], (
                f"{table} under {cpu}: {_first_difference(got, calls['reference'])}")
    assert len(calls["reference"]) > 100
    assert len({ln.split()[-2] for ln in calls["reference"]}) > 50   # the calls differ


def _instructions(obj: Path, cwd: Path) -> dict[str, list[str]]:
    """Mnemonic and operands of every instruction of every function symbol of an object,
    clones (name.constprop.N, name.isra.N, name.part.N) under their function's name."""
    dump = _run([OBJDUMP, "-d", "--no-show-raw-insn", str(obj)], cwd)
    assert dump.returncode == 0, dump.stderr
    out: dict[str, list[str]] = {}
    current = None
    for line in dump.stdout.splitlines():
        m = re.match(r"^[0-9a-f]+ <([^>]+)>:$", line)
        if m:
            current = out.setdefault(m.group(1).split(".")[0], [])
        elif current is not None and re.match(r"^\s+[0-9a-f]+:\t", line):
            current.append(line.split("\t", 1)[1].strip())
    return out


def _count(insns: list[str], pattern: str) -> int:
    return sum(1 for i in insns if re.match(pattern, i))


FMLA4S = r"fmla\s+v\d+\.4s"
SDOT = r"sdot\s"
SMULL = r"smlal2?\s|smull2?\s"
# the float kernels of the table (_body.h: the entry functions of _entry.h, where the compiler
# inlines the family's own function) that must run on vector FMAs: decode, prompt, MLA, the O(1)
# step, the benchmark's FMA probe
# (each: the symbols it may be compiled into, the entry or the family function it calls)
F32_KERNELS = (("kvc_entry_task_scores",), ("kvc_entry_task_values",), ("kvc_softmax",),
               ("kvc_axpy_f32",), ("kvc_entry_pf_task", "kvc_pf_task"),
               ("kvc_entry_mla_task", "kvc_mla_task"),
               ("kvc_entry_mla_fold",), ("kvc_entry_o1_absorb",),
               ("kvc_entry_o1_step_head", "kvc_o1_head"),
               ("kvc_fma_probe",))
# the q8 scoring, wherever the compiler left it: kvc_i8_rows (GCC clones it), the entries of
# q8 rows and of the decode score task (where it is inlined)
Q8_PREFIXES = ("kvc_i8_rows", "kvc_entry_q8_rows", "kvc_entry_task_scores_i8")


def test_neon_units_hold_vector_fma_and_sdot_only_where_built_for_it(
        workdir: Path, units: dict[str, Path]) -> None:
    found = {}
    for unit in ("neon", "neondot"):
        insns = _instructions(units[unit], workdir)
        every = [i for body in insns.values() for i in body]
        for names in F32_KERNELS:
            held = [fn for fn in names if fn in insns]
            assert held, f"{unit}: no symbol of {names}"
            assert sum(_count(insns[fn], FMLA4S) for fn in held) > 0, \
                f"{unit}: {held} hold no fmla on .4s"
        q8 = [i for name, body in insns.items() if name.startswith(Q8_PREFIXES) for i in body]
        assert q8, f"{unit}: no q8 scoring symbol"
        found[unit] = (_count(every, FMLA4S), _count(every, SDOT), _count(q8, SDOT),
                       _count(q8, SMULL))
    fmla_neon, sdot_neon, _, smull_q8 = found["neon"]
    fmla_dot, sdot_dot, sdot_q8, _ = found["neondot"]
    assert sdot_neon == 0, f"the neon unit holds {sdot_neon} sdot"
    assert smull_q8 > 0, "the neon unit's q8 scoring has no smull/smlal"
    assert sdot_q8 > 0, "the neondot unit's q8 scoring has no sdot"
    assert fmla_neon > 100 and fmla_dot > 100 and sdot_dot >= sdot_q8
