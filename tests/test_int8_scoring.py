"""Integer scoring of int8 keys (docs/numerics.md, "q8 scoring") and the run-time choice of the
instruction-set body (docs/numerics.md, "Dispatch").

Every level the machine runs is checked against the NumPy twin (kvcache.reference), bit for
bit for the query quantiser and the raw scores; the VNNI bodies, which this machine may lack,
are also compiled with an exact AVX2 emulation of vpdpbusd (tests/c/i8_twin.c) and compared
with the AVX2 body and the portable C.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

import kvcache
from kvcache import KvMode, LayerKvCache, _core
from kvcache import _dispatch as dispatch
from kvcache import reference as R
from kvcache._entry import AttendCall, Rows
from conftest import X86_BODY_FLAGS, cpu_runs

def runnable_levels() -> list[str]:
    """Every body name whose needed features this CPU reports and that some family of this
    build holds, portable included: what set_isa accepts here (features as sets, no ladder)."""
    held = set().union(*_core.built_bodies().values())
    return [b for b in dispatch.runnable(_core.cpu_features()) if b in held]


@pytest.fixture
def each_level():
    """Yield the runnable bodies, restoring the limit in force afterwards."""
    before = _core._isa_cap
    try:
        yield runnable_levels()
    finally:
        _core.set_isa(before)


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def _rand_case(rng, nq, n, hd, qmag=1.0, group=32):
    q = (rng.standard_normal((nq, hd)) * qmag).astype(np.float32)
    k = rng.integers(-128, 128, (n, hd)).astype(np.int8)
    ks = (rng.random((n, -(-hd // group))) * rng.choice([1e-4, 1e-2, 1.0])).astype(np.float32)
    return q, k, ks


# ---------------------------------------------------------------------------------------------
# the twin's float32 fma

def test_reference_fmaf_is_correctly_rounded():
    from fractions import Fraction
    rng = np.random.default_rng(5)
    a = (rng.standard_normal(4000) * 1e3).astype(np.float32)
    b = (rng.standard_normal(4000) * 1e-3).astype(np.float32)
    c = (rng.standard_normal(4000)).astype(np.float32)
    # hard cases: a * b + c lands near a float32 midpoint
    a[:1000] = np.float32(1 + 2.0 ** -12)
    b[:1000] = np.float32(1 + 2.0 ** -12)
    c[:1000] = -np.float32(1.0) * rng.integers(0, 2, 1000).astype(np.float32)
    got = R.fmaf(a, b, c)
    for x, y, z, r in zip(a.tolist(), b.tolist(), c.tolist(), got.tolist()):
        exact = Fraction(x) * Fraction(y) + Fraction(z)
        lo = np.float32(float(exact))
        # the correctly rounded float32: the nearer of the float32 neighbours of exact
        cands = [lo, np.nextafter(lo, np.float32(np.inf)), np.nextafter(lo, np.float32(-np.inf))]
        best = min(cands, key=lambda v: (abs(Fraction(float(v)) - exact),
                                         int(np.float32(v).view(np.uint32)) & 1))
        assert np.float32(r) == best


# ---------------------------------------------------------------------------------------------
# the query quantiser and the raw scores, every level against the twin

@pytest.mark.parametrize("group", [16, 32])
@pytest.mark.parametrize("hd", [1, 7, 8, 32, 33, 40, 48, 64, 72, 96, 128, 136, 256])
def test_quantize_query_matches_the_twin(hd, group):
    rng = np.random.default_rng(hd)
    q = (rng.standard_normal((9, hd)) * rng.choice([1e-6, 1.0, 1e4], (9, 1))).astype(np.float32)
    q[3] = 0.0
    ng = -(-hd // group)
    got = [np.zeros((9, -(-hd // 32) * 32), np.int8), np.zeros((9, ng), np.float32),
           np.zeros((9, ng), np.int32)]
    want = [np.zeros_like(a) for a in got]
    _core.quantize_query(q, *got, group=group)
    R.quantize_query(q, *want, group=group)
    assert np.array_equal(got[0], want[0])
    assert np.array_equal(_bits(got[1]), _bits(want[1]))
    assert np.array_equal(got[2], want[2])
    assert np.all(got[0][:, hd:] == 0)
    assert np.abs(got[0]).max() == 127                   # every nonzero group reaches 127
    padded = np.zeros((9, ng * group), np.int32)
    padded[:, :hd] = got[0][:, :hd]
    assert np.array_equal(got[2], padded.reshape(9, ng, group).sum(axis=2))


def test_quantize_query_marks_non_finite_groups():
    q = np.ones((3, 72), np.float32)
    q[0, 40] = np.nan
    q[1, 3] = np.inf
    q[2, 70] = -np.inf
    qi, sq, qs = np.zeros((3, 96), np.int8), np.zeros((3, 3), np.float32), np.zeros((3, 3), np.int32)
    _core.quantize_query(q, qi, sq, qs)
    assert np.isnan(sq[0, 1]) and np.isfinite(sq[0, [0, 2]]).all()
    assert np.isnan(sq[1, 0]) and np.isfinite(sq[1, 1:]).all()
    assert np.isnan(sq[2, 2]) and np.isfinite(sq[2, :2]).all()


@pytest.mark.parametrize("group", [16, 32])
@pytest.mark.parametrize("hd", [1, 8, 24, 31, 32, 40, 48, 64, 72, 100, 128, 136, 256])
def test_scores_of_every_level_match_the_twin_bit_for_bit(hd, group, each_level):
    rng = np.random.default_rng(100 + hd)
    assert "avx2" in each_level or _core.isa_detected() == "portable"
    for trial in range(4):
        n = int(rng.integers(1, 90))
        q, k, ks = _rand_case(rng, 5, n, hd, qmag=[1e-3, 1.0, 300.0, 1.0][trial], group=group)
        if trial == 3:
            k[:] = np.where(rng.random(k.shape) < 0.5, -128, 127).astype(np.int8)  # extreme codes
        want = np.zeros((5, n), np.float32)
        R.q8_scores(q, k, ks, want, group)
        for level in each_level:
            _core.set_isa(level)
            got = np.zeros((5, n), np.float32)
            _core.q8_scores(q, k, ks, got, k_group=group)
            assert np.array_equal(_bits(got), _bits(want)), (level, hd, trial)
            if hd > 16:                                  # the group read from the scale count
                again = np.zeros((5, n), np.float32)
                _core.q8_scores(q, k, ks, again)
                assert np.array_equal(_bits(again), _bits(want))


def test_scores_are_the_documented_arithmetic():
    """One score by hand: groups of 32, exact integer sums, fmaf in group order."""
    rng = np.random.default_rng(7)
    q, k, ks = _rand_case(rng, 1, 3, 72)
    qi, sq, qs = np.zeros((1, 96), np.int8), np.zeros((1, 3), np.float32), np.zeros((1, 3), np.int32)
    R.quantize_query(q, qi, sq, qs, 32)
    got = np.zeros((1, 3), np.float32)
    _core.q8_scores(q, k, ks, got)
    for r in range(3):
        acc = np.float32(0)
        for g, (g0, g1) in enumerate([(0, 32), (32, 64), (64, 72)]):
            isum = int(np.dot(qi[0, g0:g1].astype(np.int64), k[r, g0:g1].astype(np.int64)))
            acc = R.fmaf(np.float32(isum), np.float32(sq[0, g] * ks[r, g]), acc)
        assert _bits(got[0, r]) == _bits(acc)
    # close to the float product of the dequantised rows (the quantisation error only)
    deq = k.astype(np.float64) * np.repeat(ks, 32, axis=1)[:, :72]
    ref = deq @ q[0].astype(np.float64)
    assert np.allclose(got[0], ref, rtol=0.05, atol=0.05 * np.abs(ref).max())


def test_non_finite_query_gives_nan_for_that_query_only(each_level):
    """A NaN or an infinity in a query makes every score, and so the output, of that query
    NaN (as float32 scores would); the other queries are untouched."""
    rng = np.random.default_rng(11)
    layer = LayerKvCache(2, 64, mode=KvMode.Q8(k=True, v=True))
    layer.append(rng.standard_normal((40, 2, 64)).astype(np.float32),
                 rng.standard_normal((40, 2, 64)).astype(np.float32))
    q = rng.standard_normal((4, 64)).astype(np.float32)
    clean = layer.attend_all_heads(q.copy())
    q[1, 5] = np.nan
    q[2, 50] = np.inf
    for level in each_level:
        _core.set_isa(level)
        out = layer.attend_all_heads(q)
        assert np.isnan(out[1]).all() and np.isnan(out[2]).all()
        assert np.array_equal(_bits(out[[0, 3]]), _bits(clean[[0, 3]]))


# ---------------------------------------------------------------------------------------------
# the kernels: every level gives the same bits, close to the twin, for any thread count

def _q8_layer(rng, hd, n, nkv=2):
    layer = LayerKvCache(nkv, hd, mode=KvMode.Q8(k=True, v=True))
    layer.append(rng.standard_normal((n, nkv, hd)).astype(np.float32),
                 rng.standard_normal((n, nkv, hd)).astype(np.float32))
    return layer


@pytest.mark.parametrize("hd", [40, 64, 72, 128])
def test_decode_and_prefill_bits_do_not_depend_on_level_or_threads(hd, each_level):
    from threadpoolctl import threadpool_limits
    rng = np.random.default_rng(hd)
    layer = _q8_layer(rng, hd, 700)
    q1 = rng.standard_normal((6, hd)).astype(np.float32)
    qn = rng.standard_normal((37, 6, hd)).astype(np.float32)
    results = []
    for level in each_level:
        _core.set_isa(level)
        for threads in (1, 2, 3):
            with threadpool_limits(threads, user_api="openmp"):
                dec = layer.attend_all_heads(q1)
                pre = layer.attend_all_heads(qn)
            results.append((level, threads, dec, pre))
    _, _, dec0, pre0 = results[0]
    for level, threads, dec, pre in results[1:]:
        assert np.array_equal(_bits(dec), _bits(dec0)), (level, threads)
        assert np.array_equal(_bits(pre), _bits(pre0)), (level, threads)
    want = R.attend_all_heads(layer, q1)
    assert np.allclose(dec0, want, rtol=2e-4, atol=2e-5)
    want_n = R.attend_all_heads(layer, qn)
    assert np.allclose(pre0, want_n, rtol=2e-4, atol=2e-5)


def test_attend_rows_probabilities_come_from_the_twin_scores(each_level):
    """attend_rows scores with the arithmetic of q8_scores (compared bit for bit above): its
    probabilities are the softmax of the twin's raw scores to float32 rounding of exp."""
    rng = np.random.default_rng(3)
    hd, n = 72, 50
    kq = rng.integers(-127, 128, (1, n, hd)).astype(np.int8)
    ks = (rng.random((1, n, 3)) * 2e-3).astype(np.float32)
    q = rng.standard_normal((2, hd)).astype(np.float32)
    raw = np.zeros((2, n), np.float32)
    R.q8_scores(q, kq[0], ks[0], raw)
    assert 0.5 < np.ptp(raw) < 20                        # a softmax far from one-hot
    for level in each_level:
        _core.set_isa(level)
        probs = np.zeros((2, n), np.float32)
        out = np.zeros((2, hd), np.float32)
        zf = np.zeros((1, 1, hd), np.float32)
        _core.attend_rows(
            Rows(kf=zf, kq=kq, ks=ks, vf=zf, vq=np.ones((1, n, hd), np.int8),
                 vs=np.ones((1, n, 1), np.float32), vcol=np.ones((1, hd), np.float32),
                 head_len=np.array([n], np.intp), quant_k=True, quant_v=True),
            AttendCall(q=q, group_q0=np.array([0, 2], np.intp), n_pos=1, n_back=1, window=0,
                       first=0, scale=1.0, softcap=0.0, out=out, imp=np.zeros(0, np.float32),
                       imp_mode=0, n_threads=1, probs=probs))
        ref = np.exp(raw.astype(np.float64) - raw.max(axis=1, keepdims=True))
        ref /= ref.sum(axis=1, keepdims=True)
        assert np.allclose(probs, ref, rtol=2e-6, atol=0)


# ---------------------------------------------------------------------------------------------
# the VNNI bodies, emulated on AVX2, against the AVX2 body and the portable C

def _cc() -> list[str]:
    return shlex.split(sysconfig.get_config_var("CC") or "cc")


def _twin(tmp_path: Path, name: str, flags: list[str]) -> Path:
    src = Path(__file__).parent / "c" / "i8_twin.c"
    exe = tmp_path / name
    subprocess.run(_cc() + ["-O2", "-std=gnu11", "-ffp-contract=off", *flags,
                            f"-I{Path(kvcache.__file__).parent}", str(src), "-o", str(exe), "-lm"],
                   check=True, capture_output=True)
    return exe


def _output(exe: Path) -> tuple[str, str]:
    """The body line and the results of one run."""
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    head, _, rest = out.partition("\n")
    return head, rest


def test_every_body_computes_the_same_bits(tmp_path):
    """One build of the twin per x86 body (and the VNNI code on an exact AVX2 emulation of
    vpdpbusd, so it runs on any AVX2 CPU; and the AVX-512 body's packed decode scorer on pairs
    of 8-lane vectors, KVC_EMULATE_512): each runs where the CPU has its features, is compiled
    only elsewhere, and gives the portable build's bits."""
    head, ref = _output(_twin(tmp_path, "portable", X86_BODY_FLAGS["portable"]))
    assert head == "portable 0"
    lines = ref.splitlines()
    assert len(lines) > 100000 and len(set(lines)) > 20000
    # the 4-bit K dot products (the last 320 lines: kvc_i8x_dp16, then four chained dp4) reach
    # both extremes, 16 x 15 x +-127, and agree in plain C
    dots = [tuple(map(int, line.split())) for line in lines[-320:]]
    assert all(a == b for a, b in dots)
    assert {(-30480, -30480), (30480, 30480)} <= set(dots)
    builds = {name: (flags, name) for name, flags in X86_BODY_FLAGS.items() if name != "portable"}
    builds["vnni-emulated"] = (X86_BODY_FLAGS["avx2"] + ["-DKVC_EMULATE_VNNI"], "avx2")
    # the AVX-512 body's packed decode scorer (KVC_WIDE) on pairs of 8-lane vectors
    builds["wide-emulated"] = (X86_BODY_FLAGS["avx2"] + ["-DKVC_EMULATE_512"], "avx2")
    builds["wide-portable"] = (X86_BODY_FLAGS["portable"] + ["-DKVC_EMULATE_512"], "portable")
    forms = {"avx2": "avx2 1", "avxvnni": "avx2 2", "avx512": "avx512 2", "vnni-emulated": "avx2 2",
             "wide-emulated": "avx2 1", "wide-portable": "portable 0"}
    ran = 0
    for name, (flags, needs) in builds.items():
        exe = _twin(tmp_path, name, flags)
        if not cpu_runs(needs):
            continue
        head, got = _output(exe)
        assert head == forms[name], name
        assert got == ref, f"{name} differs from the portable C"
        ran += 1
    assert ran == sum(cpu_runs(needs) for _, needs in builds.values())


# ---------------------------------------------------------------------------------------------
# dispatch: set_isa, KVCACHE_ISA, show_config

def test_set_isa_refuses_unknown_and_unrunnable_bodies(each_level):
    have = _core.cpu_features()
    assert _core.isa() in dispatch.BODIES
    for bad in ("sse2", "", 3, b"avx2"):
        before = _core.bodies()
        with pytest.raises(ValueError, match="expected one of"):
            _core.set_isa(bad)
        assert _core.bodies() == before
    for name in dispatch.BODIES:
        before = _core.bodies()
        if not _core.body_needs(name) <= have:
            with pytest.raises(ValueError, match="does not report|holds no"):
                _core.set_isa(name)
            assert _core.bodies() == before            # nothing changed
        else:
            _core.set_isa(name)
            assert _core.isa() == name
            for fam, body in _core.bodies().items():  # never beyond the limit or the CPU
                assert _core.body_needs(body) <= _core.body_needs(name) & have, (name, fam)
    _core.set_isa("portable")
    assert set(_core.bodies().values()) == {"portable"}


def test_set_bodies_is_all_or_nothing(each_level):
    before = _core.bodies()
    lacking = [b for b in dispatch.BODIES if not _core.body_needs(b) <= _core.cpu_features()]
    bad = [{"f32": "portable", "nope": "avx2"}, {"q8": "sse2"}, {"f32": "avxvnni"}]
    bad += [{"f32": "portable", "q8": b} for b in lacking]
    for choice in bad:
        with pytest.raises(ValueError):
            _core.set_bodies(choice)
        assert _core.bodies() == before, choice


def test_the_chosen_bodies_are_the_pure_rule_on_the_detected_features():
    want = dispatch.choose(_core.cpu_features(), _core.built_bodies())
    code = "import kvcache._core as c; print(sorted(c.bodies().items()))"
    env = {k: v for k, v in os.environ.items() if k != "KVCACHE_ISA"}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    assert res.stdout.strip() == str(sorted(want.items()))
    for name in dispatch.BODIES:
        assert _core.body_needs(name) == dispatch.BODY_NEEDS[name]   # C and Python agree


@pytest.mark.parametrize("value", ["portable", "avx2", "avxvnni", "avx512", "bogus", "", "AVX2 ",
                                   "\u00e4vx2", "avx2,fma", "x" * 100000])
def test_kvcache_isa_environment_variable(value):
    code = ("import warnings, kvcache._core as c; print(c.isa(), c.isa_detected())")
    env = dict(os.environ, KVCACHE_ISA=value, PYTHONWARNINGS="always")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True)
    used, det = res.stdout.split()
    name = value.strip().lower()
    usable = name in runnable_levels()
    if usable:
        assert used == name and "RuntimeWarning" not in res.stderr
    else:
        assert used == det
        if name:
            warning = [ln for ln in res.stderr.splitlines() if "KVCACHE_ISA" in ln]
            assert len(warning) == 1 and "RuntimeWarning" in warning[0]
            assert len(warning[0]) < 400                 # one short line, whatever was set


def test_show_config_names_the_path_in_use(each_level):
    import io
    for level in each_level:
        _core.set_isa(level)
        buf = io.StringIO()
        kvcache.show_config(file=buf)
        text = buf.getvalue()
        line = [ln for ln in text.splitlines() if ln.strip().startswith("isa:")]
        assert len(line) == 1
        assert line[0].split(":", 1)[1].strip().startswith(f"{level} (cpu: {_core.isa_detected()};")
        feats = [ln for ln in text.splitlines() if ln.strip().startswith("cpu_features:")]
        assert len(feats) == 1 and set(feats[0].split(":", 1)[1].split()) == set(_core.cpu_features()) | (
            {"(none)"} if not _core.cpu_features() else set())
        bodies = [ln for ln in text.splitlines() if ln.strip().startswith("isa_bodies:")]
        assert len(bodies) == 1
        for fam, body in _core.bodies().items():
            assert f"{fam} {body}" in bodies[0]


@pytest.mark.parametrize("group", [16, 32])
@pytest.mark.parametrize("hd", [40, 64, 72])
def test_kernels_take_the_k_group_from_the_scale_count(hd, group, each_level):
    """attend_rows and attend_blocked with K in groups of 16 or 32 channels (the scales per row
    tell which): every level the same bits, close to the NumPy twin."""
    rng = np.random.default_rng(hd + group)
    nkv, hpk, T, n_pos = 2, 3, 300, 5
    ng = -(-hd // group)
    kq = rng.integers(-127, 128, (nkv, T, hd)).astype(np.int8)
    ks = (rng.random((nkv, T, ng)) * 0.02).astype(np.float32)
    vq = rng.integers(-127, 128, (nkv, T, hd)).astype(np.int8)
    vs = (rng.random((nkv, T, 1)) * 0.02).astype(np.float32)
    zf = np.zeros((nkv, 1, hd), np.float32)
    vcol = np.ones((nkv, hd), np.float32)
    hl = np.array([T, T - 7], np.intp)
    nq = nkv * hpk * n_pos
    q = rng.standard_normal((nq, hd)).astype(np.float32)
    g0 = np.arange(nkv + 1, dtype=np.intp) * hpk * n_pos
    rows = Rows(kf=zf, kq=kq, ks=ks, vf=zf, vq=vq, vs=vs, vcol=vcol, head_len=hl,
                quant_k=True, quant_v=True)

    def call(out, threads, blocked):
        return AttendCall(q=q, group_q0=g0, n_pos=n_pos, n_back=n_pos, window=0, first=0,
                          scale=0.2, softcap=0.0, out=out, imp=np.zeros(0, np.float32),
                          imp_mode=0, n_threads=threads,
                          probs=None if blocked else np.zeros((nq, T), np.float32))

    def run(mod, blocked, threads):
        out = np.zeros((nq, hd), np.float32)
        if blocked:
            mod.attend_blocked(rows, call(out, threads, blocked))
        else:
            mod.attend_rows(rows, call(out, threads, blocked))
        return out

    for blocked in (False, True):
        want = run(R, blocked, 1)
        first = None
        for level in each_level:
            _core.set_isa(level)
            for threads in (1, 2):
                got = run(_core, blocked, threads)
                first = got if first is None else first
                assert np.array_equal(_bits(got), _bits(first)), (level, threads, blocked)
        assert np.allclose(first, want, rtol=1e-4, atol=2e-5)
        if group == 16:   # the 16-channel arithmetic differs from the 32-channel one
            other = np.zeros((nq, hd), np.float32)
            rows32 = rows._replace(ks=np.ascontiguousarray(ks[:, :, : -(-hd // 32)]))
            if blocked:
                _core.attend_blocked(rows32, call(other, 1, blocked))
            else:
                _core.attend_rows(rows32, call(other, 1, blocked))
            assert not np.array_equal(_bits(other), _bits(first))
