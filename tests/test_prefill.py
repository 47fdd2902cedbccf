"""The blocked prompt kernel (``_core.attend_blocked``, src/kvcache/_prefill.h).

Against its NumPy twin over shapes, head dims, GQA fan-outs, windows, softcaps, ``first``,
tile-boundary lengths and the four storage modes; thread counts and chunk independence bit
for bit; importance against the twin and the materialised kernel (``attend_rows``), against
the float64 importance of the kernel's own scores within its documented bound, in whole
blocks and in the pieces a block over its buffer budget is cut in, bit for bit across threads
and bodies; decode
bits unchanged; NaN/inf like the decode kernel; bad input refused before any work; the AVX2
and portable C paths of the header bit for bit.

Tolerances: outputs and importance within 2e-6 absolute + 1e-4 relative of the twin (float32,
different summation order); within 1e-5 absolute + 1e-4 relative of ``attend_rows`` (another
formula: tile-wise rescaling, no skip rule, int8 rows dequantised before the dot product).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
import sysconfig
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import kvcache as kc
from kvcache import _core, _dispatch as dispatch, reference as ref
from kvcache._attention import default_scale
from kvcache._entry import AttendCall, Rows
from conftest import X86_BODY_FLAGS, cpu_runs

MODES = [kc.KvMode.F32, kc.KvMode.Q8(), kc.KvMode.Q8(k=True, v=False),
         kc.KvMode.Q8(k=False, v=True)]
MODE_IDS = ["f32", "q8", "q8k", "q8v"]
RTOL, ATOL = 1e-4, 2e-6
ATOL_ROWS = 1e-5
TILE = _core.PREFILL_TILE_ROWS


def filled(nkv, hd, mode, rows, rng, scale=1.0):
    """A layer with ``rows`` random rows (appended in pieces, so a q8 column field freezes)."""
    layer = kc.LayerKvCache(nkv, hd, mode=mode)
    for start in range(0, rows, 97):
        n = min(97, rows - start)
        k = (rng.standard_normal((n, nkv, hd)) * scale).astype(np.float32)
        v = rng.standard_normal((n, nkv, hd)).astype(np.float32)
        layer.append(k, v)
    return layer


def grouped(layer, q3):
    """Queries (n, nh, hd) gathered per KV group, position-major, K column folded in."""
    n, nh, hd = q3.shape
    nkv = layer.num_kv_heads
    hpk = nh // nkv
    qk = q3.reshape(n, nkv, hpk, hd).transpose(1, 0, 2, 3).reshape(nkv, n * hpk, hd)
    q2 = layer._queries(qk).reshape(nkv * n * hpk, hd)
    return q2, np.arange(nkv + 1, dtype=np.intp) * (n * hpk)


def make_call(rows, q2, group_q0, *, n_pos, n_back, window=0, first=0, scale=None,
              softcap=0.0, imp_mode=2, n_threads=1, imp_len=None):
    """An AttendCall over ``rows`` with a fresh output (7.0) and importance (0.0)."""
    hd = q2.shape[1]
    out = np.full(q2.shape, 7.0, dtype=np.float32)
    imp = np.zeros(int(rows.head_len.max()) if imp_len is None else imp_len, dtype=np.float32)
    return AttendCall(q=q2, group_q0=group_q0, n_pos=n_pos, n_back=n_back, window=window,
                      first=first, scale=default_scale(hd) if scale is None else scale,
                      softcap=softcap, out=out, imp=imp, imp_mode=imp_mode, n_threads=n_threads)


def run(fn, layer, q2, group_q0, *, rows=None, **kw):
    """One kernel call on a layer's rows (``kw`` as make_call takes); returns (out, imp)."""
    rows = layer._rows() if rows is None else rows
    call = make_call(rows, q2, group_q0, **kw)
    out, imp = call.out, call.imp
    if fn == "rows":
        call = call._replace(probs=np.zeros(
            (q2.shape[0], max(1, imp.shape[0], int(rows.head_len.max()))), dtype=np.float32))
        _core.attend_rows(rows, call)
    elif fn == "ref":
        ref.attend_blocked(rows, call)
    else:
        _core.attend_blocked(rows, call)
    return out, imp


def close(got, want, atol=ATOL):
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=atol)


# ---------------------------------------------------------------------------------------------
# against the twin

CASES = [  # (rows, n_pos, n_back, window, first, softcap)
    (200, 200, 200, 0, 0, 0.0),
    (130, 70, 70, 0, 0, 0.0),
    (129, 129, 129, 50, 0, 0.0),
    (300, 65, 65, 0, 10, 0.0),
    (150, 40, 90, 0, 0, 2.5),       # n_back > n: a block of a longer prompt
    (64, 64, 64, 7, 0, 1.0),
]


@pytest.mark.parametrize("mi", range(4), ids=MODE_IDS)
@pytest.mark.parametrize("hd", [64, 128, 72, 5])
@pytest.mark.parametrize("fanout", [1, 3, 4, 7])
def test_matches_the_twin(mi, hd, fanout, rng):
    """Every (mode, head dim, fan-out) once, the cases of CASES in turn."""
    nkv = 2
    rows, n_pos, n_back, window, first, softcap = CASES[(hd + 3 * fanout + mi) % len(CASES)]
    layer = filled(nkv, hd, MODES[mi], rows, rng)
    q3 = rng.standard_normal((n_pos, nkv * fanout, hd)).astype(np.float32) * 2
    q2, g0 = grouped(layer, q3)
    kw = dict(n_pos=n_pos, n_back=n_back, window=window, first=first, softcap=softcap)
    out, imp = run("blk", layer, q2, g0, **kw)
    out_r, imp_r = run("ref", layer, q2, g0, **kw)
    close(out, out_r)
    close(imp, imp_r)
    assert imp.sum() == pytest.approx(q2.shape[0], rel=1e-4)   # every query's mass is 1


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("rows", [1, 2, 63, 64, 65, 127, 128, 129, 191, 257])
def test_tile_boundary_lengths(mode, rows, rng):
    nkv, hd = 1, 32
    layer = filled(nkv, hd, mode, rows, rng)
    for n in {rows, max(1, rows // 2), 1}:
        q3 = rng.standard_normal((n, 3, hd)).astype(np.float32)
        q2, g0 = grouped(layer, q3)
        for window in (0, 64, 65):
            out, imp = run("blk", layer, q2, g0, n_pos=n, n_back=n, window=window)
            out_r, imp_r = run("ref", layer, q2, g0, n_pos=n, n_back=n, window=window)
            close(out, out_r)
            close(imp, imp_r)


@settings(max_examples=40, deadline=None)
@given(nkv=st.integers(1, 3), fan=st.sampled_from([1, 2, 3, 4, 7]),
       hd=st.sampled_from([1, 8, 13, 16, 40, 64, 72]), rows=st.integers(1, 300),
       frac=st.floats(0.0, 1.0), back=st.integers(0, 40), window=st.integers(0, 150),
       first=st.integers(0, 80), softcap=st.sampled_from([0.0, 1.5, 30.0]),
       mode=st.sampled_from(range(4)), imp_len=st.integers(0, 320), seed=st.integers(0, 999))
def test_fuzz_against_the_twin(nkv, fan, hd, rows, frac, back, window, first, softcap, mode,
                               imp_len, seed):
    rng = np.random.default_rng(seed)
    layer = filled(nkv, hd, MODES[mode], rows, rng)
    n = max(1, int(rows * frac))
    q3 = (rng.standard_normal((n, nkv * fan, hd)) * 2).astype(np.float32)
    q2, g0 = grouped(layer, q3)
    kw = dict(n_pos=n, n_back=n + back, window=window, first=first, softcap=softcap,
              imp_len=imp_len)
    out, imp = run("blk", layer, q2, g0, **kw)
    out_r, imp_r = run("ref", layer, q2, g0, **kw)
    # An output is a float32 sum of up to `rows` terms p * v in two summation orders (the
    # kernel's and the twin's), which may cancel: each order is within rows * 2^-24 of
    # sum p * |v| (the same attention over |V|), so the two are within twice that, plus the
    # probabilities' own few ulps.  A fixed atol alone failed where an output cancelled to
    # 3e-5 from terms of order 1 (hd 72, 289 rows, seed 447).
    st = layer._rows()
    absv = st._replace(vf=np.abs(st.vf), vq=np.abs(st.vq.astype(np.int16)).astype(np.int8),
                       vcol=np.abs(st.vcol))
    mag, _ = run("ref", layer, q2, g0, rows=absv, **kw)
    bound = RTOL * np.abs(out_r) + ATOL + 2 * (rows + 8) * 2.0 ** -24 * mag
    assert (np.abs(out - out_r) <= bound).all(), float(np.max(np.abs(out - out_r) - bound))
    close(imp, imp_r)


def test_unequal_head_lengths_and_empty_groups(rng):
    """Groups of other lengths (dead heads) and a group without queries."""
    nkv, hd = 3, 16
    layer = filled(nkv, hd, kc.KvMode.F32, 150, rng)
    rows = layer._rows()._replace(head_len=np.array([150, 70, 0], dtype=np.intp))
    q2 = rng.standard_normal((2 * 10 * 2, hd)).astype(np.float32)
    g0 = np.array([0, 20, 40, 40], dtype=np.intp)            # group 2 has no query
    for fn in ("blk", "ref"):
        out, imp = run(fn, layer, q2, g0, n_pos=10, n_back=10, rows=rows)
        if fn == "blk":
            got = out, imp
    close(got[0], out)
    close(got[1], imp)
    # group 1 holds 70 rows: its last query sees them all
    assert np.isfinite(got[0]).all() and got[1][70:].sum() > 0


# ---------------------------------------------------------------------------------------------
# bits: threads, chunks, decode

@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_thread_counts_give_the_same_bits(mode, rng):
    layer = filled(2, 64, mode, 700, rng)
    q3 = rng.standard_normal((300, 8, 64)).astype(np.float32)
    q2, g0 = grouped(layer, q3)
    for kw in (dict(), dict(window=100, softcap=3.0)):
        one = run("blk", layer, q2, g0, n_pos=300, n_back=300, n_threads=1, **kw)
        for threads in (2, 3):
            many = run("blk", layer, q2, g0, n_pos=300, n_back=300, n_threads=threads, **kw)
            assert np.array_equal(one[0], many[0]) and np.array_equal(one[1], many[1])


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("window,first", [(0, 0), (90, 0), (0, 33)])
def test_a_query_gets_the_same_bits_alone_or_in_a_longer_call(mode, window, first, rng):
    """The runner and the prefix store rely on it: a chunk computed after a stored prefix gives
    the bits of the same chunk inside a longer call."""
    nkv, fan, hd, rows = 2, 3, 40, 260
    layer = filled(nkv, hd, mode, rows, rng)
    n = 200                                               # positions rows-200 .. rows-1
    q3 = rng.standard_normal((n, nkv * fan, hd)).astype(np.float32)
    q2, g0 = grouped(layer, q3)
    whole, _ = run("blk", layer, q2, g0, n_pos=n, n_back=n, window=window, first=first)
    whole = whole.reshape(nkv, n, fan, hd)
    for a, b in [(0, 1), (63, 64), (64, 130), (129, 130), (150, 200), (199, 200), (5, 77)]:
        sub = np.ascontiguousarray(q3[a:b])
        q2s, g0s = grouped(layer, sub)
        part, _ = run("blk", layer, q2s, g0s, n_pos=b - a, n_back=n - a, window=window,
                      first=first)
        assert np.array_equal(part.reshape(nkv, b - a, fan, hd), whole[:, a:b]), (a, b)


def test_a_prompt_in_chunks_equals_one_call_through_the_layer(rng):
    """attend_all_heads(prefill=True) chunk by chunk (one-position chunks included) gives the
    bits of one call over the whole prompt."""
    nkv, nh, hd, n = 2, 8, 64, 150
    k = rng.standard_normal((n, nkv, hd)).astype(np.float32)
    v = rng.standard_normal((n, nkv, hd)).astype(np.float32)
    q = rng.standard_normal((n, nh, hd)).astype(np.float32)
    one = kc.LayerKvCache(nkv, hd)
    one.append(k, v)
    want = one.attend_all_heads(q, window=70)
    chunked = kc.LayerKvCache(nkv, hd)
    got = []
    for a, b in [(0, 64), (64, 65), (65, 128), (128, 129), (129, 150)]:
        chunked.append(k[a:b], v[a:b])
        got.append(chunked.attend_all_heads(q[a:b], window=70, prefill=True))
    assert np.array_equal(np.concatenate(got), want)
    np.testing.assert_allclose(chunked.importance, one.importance, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_decode_bits_are_unchanged(mode, rng):
    """One position takes the decode kernel by default: the bits of attend_rows itself, and
    prefill=False keeps a block on it too."""
    nkv, nh, hd = 2, 6, 64
    layer = filled(nkv, hd, mode, 300, rng)
    q3 = rng.standard_normal((4, nh, hd)).astype(np.float32)
    # one position, default
    imp0 = layer.importance.copy()
    got = layer.attend_all_heads(q3[0])
    q2, g0 = grouped(layer, q3[:1])
    want, imp = run("rows", layer, q2, g0, n_pos=1, n_back=1)
    assert np.array_equal(got, want.reshape(nh, hd))
    assert np.array_equal(layer.importance, imp0 + imp)
    # a block with prefill=False: the decode kernel, bit for bit
    got = layer.attend_all_heads(q3, prefill=False)
    q2, g0 = grouped(layer, q3)
    want, _ = run("rows", layer, q2, g0, n_pos=4, n_back=4)
    assert np.array_equal(got, want.reshape(nkv, 4, nh // nkv, hd).transpose(1, 0, 2, 3)
                          .reshape(4, nh, hd))
    # attend() per head still equals the one-position path
    out_h, _ = layer.attend(q3[0, 0], 0)
    assert np.array_equal(out_h, layer.attend_all_heads(q3[0])[0])


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_prefill_switch(mode, rng):
    nkv, nh, hd = 2, 4, 32
    layer = filled(nkv, hd, mode, 100, rng)
    q3 = rng.standard_normal((5, nh, hd)).astype(np.float32)
    # None with n > 1 and True: the blocked kernel
    q2, g0 = grouped(layer, q3)
    want, _ = run("blk", layer, q2, g0, n_pos=5, n_back=5)
    want = want.reshape(nkv, 5, nh // nkv, hd).transpose(1, 0, 2, 3).reshape(5, nh, hd)
    assert np.array_equal(layer.attend_all_heads(q3), want)
    assert np.array_equal(layer.attend_all_heads(q3, prefill=True), want)
    # True with one position: the blocked kernel (the last position of the block)
    one = layer.attend_all_heads(q3[-1], prefill=True)
    assert one.shape == (nh, hd) and np.array_equal(one, want[-1])
    # the twin wrapper takes the same switch
    close(ref.attend_all_heads(layer, q3[-1], prefill=True), want[-1])
    before = layer.importance.copy()
    with pytest.raises(TypeError, match="prefill"):
        layer.attend_all_heads(q3, prefill="yes")
    assert np.array_equal(layer.importance, before)


def test_static_cache_block_uses_the_blocked_kernel(rng):
    nkv, nh, hd, rows = 2, 8, 64, 90
    c = kc.StaticKvCache(1, nkv, hd, 128)
    k = rng.standard_normal((nkv, rows, hd)).astype(np.float32)
    v = rng.standard_normal((nkv, rows, hd)).astype(np.float32)
    c.write_layer(0, k, v)
    c.advance(rows)
    layer = kc.LayerKvCache(nkv, hd)
    layer.append(k.transpose(1, 0, 2), v.transpose(1, 0, 2))
    q = rng.standard_normal((30, nh, hd)).astype(np.float32)
    assert np.array_equal(c.attend(0, q, window=40), layer.attend_all_heads(q, window=40))
    close(c.attend(0, q, window=40), ref.static_attend(c, 0, q, window=40))


# ---------------------------------------------------------------------------------------------
# importance and outputs against the materialised kernel

@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (100, 0.0), (0, 4.0)])
def test_against_attend_rows(mode, window, softcap, rng):
    layer = filled(2, 64, mode, 400, rng)
    q3 = rng.standard_normal((150, 8, 64)).astype(np.float32) * 2
    q2, g0 = grouped(layer, q3)
    kw = dict(n_pos=150, n_back=150, window=window, softcap=softcap)
    out, imp = run("blk", layer, q2, g0, **kw)
    out_r, imp_r = run("rows", layer, q2, g0, **kw)
    close(out, out_r, atol=ATOL_ROWS)
    close(imp, imp_r, atol=ATOL_ROWS)


# ---------------------------------------------------------------------------------------------
# importance in one pass (kvc_pf_imp_fold), blocks cut in pieces to fit its budget, its bound

IMP_ULPS = 64   # docs/numerics.md, "Prompt attention": |imp - exact| <= (n_p + 64 + R) 2^-24 exact


@contextlib.contextmanager
def imp_budget(floats):
    """The one-pass buffer budget of a task set to ``floats`` (0: every block cut in pieces of
    one position), restored afterwards."""
    old = _core._set_prefill_imp_budget(floats)
    try:
        yield
    finally:
        _core._set_prefill_imp_budget(old)


def kernel_scores(layer, q2, g0):
    """Each group's scores (cnt, T) as the kernel computes them: the channel-ordered fmaf chain
    for float32 keys, q8_scores for int8 keys, times the scale."""
    rows = layer._rows()
    hd = q2.shape[1]
    scale = np.float32(default_scale(hd))
    out = []
    for g in range(len(rows.head_len)):
        q, T = q2[g0[g]:g0[g + 1]], int(rows.head_len[g])
        raw = np.zeros((q.shape[0], T), np.float32)                    # (cnt, T)
        if rows.quant_k:
            ref.q8_scores(q, rows.kq[g, :T], rows.ks[g, :T], raw, rows.k_group)
        else:
            for d in range(hd):
                raw = ref.fmaf(np.broadcast_to(q[:, d:d + 1], raw.shape),
                               np.broadcast_to(rows.kf[g, :T, d], raw.shape), raw)
        out.append(raw * scale)
    return out


def exact_importance(scores, n_pos):
    """float64 importance of causal queries (the last n_pos rows are theirs) from their
    float32 scores: per row the sum of exp(s - m) / sum(exp(s - m)), how many queries see it
    (n_p) and the largest distance m - s of its scores below their query's max (R)."""
    T = scores[0].shape[1]
    imp, n_p, dist = np.zeros(T), np.zeros(T), np.zeros(T)
    for s in scores:
        per = s.shape[0] // n_pos
        for jl in range(s.shape[0]):
            e = T - n_pos + jl // per + 1
            x = s[jl, :e].astype(np.float64)                             # (e,)
            w = np.exp(x - x.max())
            imp[:e] += w / w.sum()
            n_p[:e] += 1
            dist[:e] = np.maximum(dist[:e], x.max() - x)
    return imp, n_p, dist


@pytest.mark.parametrize("mode", MODES[:2], ids=MODE_IDS[:2])
@pytest.mark.parametrize("budget", ["whole", "halves", "quarters", "one position"])
def test_importance_is_within_its_bound_of_the_exact_sum(mode, budget, rng):
    """Whole blocks, blocks cut in halves, in narrower pieces and in single positions (over
    the budget) stay within (n_p + 64 + R) 2^-24 of the float64 importance of the kernel's own
    scores; the outputs are the same bits however a block is cut."""
    nkv, fan, hd, T, n = 2, 4, 64, 700, 300
    layer = filled(nkv, hd, mode, T, rng)
    q3 = (rng.standard_normal((n, nkv * fan, hd)) * 3).astype(np.float32)
    q2, g0 = grouped(layer, q3)
    exact, n_p, dist = exact_importance(kernel_scores(layer, q2, g0), n)
    # a block holds 48 positions (192 queries); the first sees 7 tiles, the last 11.  With
    # 7 x 192 x 65 floats the first block (7 tiles, the budget exactly) and the last (12
    # positions) stay whole and the others are cut in halves; with 11 x 48 x 65 no half
    # fits and every block but the last is cut in quarters (12 positions, 48 queries)
    floats = {"whole": _core.PREFILL_IMP_BUDGET_FLOATS, "halves": 7 * 192 * 65,
              "quarters": 11 * 48 * 65, "one position": 0}[budget]
    out0, _ = run("blk", layer, q2, g0, n_pos=n, n_back=n, imp_mode=0)
    with imp_budget(floats):
        plan = tasks_of(layer, q2, g0, n_pos=n, n_back=n)
        out, imp = run("blk", layer, q2, g0, n_pos=n, n_back=n, n_threads=2)
    width = (plan[:, 2] - plan[:, 1]) // fan                    # positions per task
    assert (plan[:, 3] > 0).all()                               # every task keeps its tiles
    assert (plan[:, 3] <= floats).all() or budget == "one position"
    assert {"whole": len(plan) == 14, "halves": set(width.tolist()) == {12, 24, 48},
            "quarters": (width == 12).all() and len(plan) == 50,
            "one position": (width == 1).all()}[budget]
    assert np.array_equal(out, out0)
    err = np.abs(imp - exact) / exact
    bound = (n_p + IMP_ULPS + dist) * 2.0 ** -24
    assert (err <= bound).all(), (err / bound).max()
    assert err.max() < 64 * 2.0 ** -24         # what such rows show (docs/numerics.md)


@pytest.mark.parametrize("mode", ["f32", "q8", "q8k", "q4", "k8v4", "q4k"])
def test_importance_bits_do_not_depend_on_threads_bodies_or_batches(mode, rng):
    """Whole blocks, halves, narrower pieces and single positions: the same bits for 1, 2 and 3
    threads and on every body this CPU runs; the cuts agree within the bound's scale."""
    layer = kc.LayerKvCache(2, 64, mode=mode)
    layer.append(rng.standard_normal((400, 2, 64)).astype(np.float32),
                 rng.standard_normal((400, 2, 64)).astype(np.float32))
    q3 = rng.standard_normal((230, 8, 64)).astype(np.float32)
    q2, g0 = grouped(layer, q3)
    kw = dict(n_pos=230, n_back=230, window=150)
    before = _core._isa_cap
    held = set().union(*_core.built_bodies().values())
    levels = [b for b in dispatch.runnable(_core.cpu_features()) if b in held]
    results = {}
    try:
        # blocks of 48 positions (192 queries) over 4 tiles, the last of 38 positions: with
        # 4 * 160 * 65 floats the others are cut in halves; with 24000 the last is cut in
        # halves and the others, whose halves do not fit, in quarters; with 0 in single
        # positions
        for floats in (_core.PREFILL_IMP_BUDGET_FLOATS, 4 * 160 * 65, 24000, 0):
            got = {}
            with imp_budget(floats):
                for lvl in levels:
                    _core.set_isa(lvl)
                    for th in (1, 2, 3) if lvl == levels[-1] else (2,):
                        got[lvl, th] = run("blk", layer, q2, g0, n_threads=th, **kw)
            first = next(iter(got.values()))
            for key, (out, imp) in got.items():
                assert np.array_equal(out, first[0]) and np.array_equal(imp, first[1]), key
            results[floats] = first
    finally:
        _core.set_isa(before)
    one, halves, quarters, single = results.values()
    for other in (halves, quarters, single):
        assert np.array_equal(one[0], other[0])
        np.testing.assert_allclose(other[1], one[1], rtol=2e-5, atol=0)


def tasks_of(layer, q2, g0, **kw):
    """attend_blocked's tasks for a call: (group, first query, end query, one-pass floats)."""
    rows = layer._rows()
    return _core._prefill_tasks(rows, make_call(rows, q2, g0, **kw))


def pass_floats(vis, per, a, b):
    """The one-pass buffer of a group's positions [a, b) (``per`` queries each, position i
    seeing rows vis[i]): the tiles meeting the union of their visible rows, x queries x 65."""
    seen_by = [(f, e) for f, e in vis[a:b] if e > f]
    if not seen_by:
        return 0
    lo, hi = min(f for f, _ in seen_by), max(e for _, e in seen_by)
    return (-(-hi // 64) - lo // 64) * (b - a) * per * 65


def pieces(vis, per, budget, a, b):
    """The planner's rule for a block [a, b), as its tasks (latest first): pieces of
    s = ceil(nb / k) positions for the first k of 1, 2, 4, ... below nb whose pieces all fit
    the budget, else pieces of one position."""
    nb, k = b - a, 1
    while k < nb:
        s = -(-nb // k)
        cut = [(x, min(b, x + s)) for x in range(a, b, s)]
        if all(pass_floats(vis, per, x, y) <= budget for x, y in cut):
            return cut[::-1]
        k *= 2
    return [(x, x + 1) for x in range(a, b)][::-1]


@pytest.mark.parametrize("window", [0, 150])
def test_blocks_over_the_budget_are_cut_in_pieces_that_keep_the_one_pass(window, rng):
    """With importance, a block of positions whose one-pass buffer would pass the budget is
    cut in the fewest pieces (halves, quarters, ...: ceil(nb / k) positions, the last one
    shorter, the latest listed first) that all fit, or in single positions when none does;
    every task keeps its one pass.  Without importance, or within the budget, the blocks
    stay as they are."""
    nkv, fan, hd, T, n, bq = 2, 4, 16, 700, 300, 48
    layer = filled(nkv, hd, kc.KvMode.F32, T, rng)
    q2, g0 = grouped(layer, rng.standard_normal((n, nkv * fan, hd)).astype(np.float32))
    kw = dict(n_pos=n, n_back=n, window=window)
    vis = [ref.visible_range(T, n, i, window, 0, T) for i in range(n)]
    whole = tasks_of(layer, q2, g0, imp_mode=0, **kw)
    blocks = [(a, min(n, a + bq)) for a in range(0, n, bq)][::-1]   # latest first
    assert [tuple(t[:3]) for t in whole] == [(g, g0[g] + a * fan, g0[g] + b * fan)
                                             for a, b in blocks for g in range(nkv)]
    assert (whole[:, 3] == 0).all()
    assert np.array_equal(tasks_of(layer, q2, g0, **kw)[:, :3], whole[:, :3])   # fits 16 MiB
    kinds = set()
    for budget in (7 * 192 * 65, 8 * 192 * 65, 24960, 24000, 9 * 4 * 65, 0):
        with imp_budget(budget):
            cut = tasks_of(layer, q2, g0, **kw)
        want = []
        for a, b in blocks:
            got = pieces(vis, fan, budget, a, b)
            kinds.add({1: "whole", 2: "halves"}.get(len(got), "narrower"))
            for g in range(nkv):
                for x, y in got:
                    need = pass_floats(vis, fan, x, y)
                    want.append((g, g0[g] + x * fan, g0[g] + y * fan, need))
                    if need > budget:
                        assert y - x == 1
                        kinds.add("one position over the budget")
        assert [tuple(t) for t in cut] == want, budget
    assert kinds == {"whole", "halves", "narrower", "one position over the budget"}


def test_every_query_is_in_one_task_of_its_block(rng):
    """Random calls (KV groups with different head counts or none, windows, first rows,
    budgets, importance shorter than the rows): each task is a run of whole positions of one
    group inside one block (of ceil(192 / heads) positions from position 0), the tasks of a
    group cover its queries once, a block is cut in the pieces of the planner's rule (the
    latest first), and every task keeps the one pass with its own buffer."""
    cut = 0
    for _ in range(40):
        heads = [int(h) for h in rng.choice([0, 1, 3, 4, 7, 200], size=3)]
        if not any(heads):
            heads[0] = 2
        hd, T = 8, int(rng.integers(1, 400))
        n = int(rng.integers(1, T + 1))
        layer = filled(3, hd, kc.KvMode.F32, T, rng)
        g0 = np.concatenate([[0], np.cumsum([h * n for h in heads])]).astype(np.intp)
        q2 = rng.standard_normal((int(g0[-1]), hd)).astype(np.float32)
        window = int(rng.choice([0, 1, 50]))
        first = int(rng.integers(0, 3)) if window else 0
        budget = int(rng.choice([0, 500, 5000, 50000, _core.PREFILL_IMP_BUDGET_FLOATS]))
        with imp_budget(budget):
            plan = tasks_of(layer, q2, g0, n_pos=n, n_back=n, window=window, first=first,
                            imp_len=int(rng.integers(1, T + 1)))
        vis = [ref.visible_range(T, n, i, window, first, T) for i in range(n)]
        seen = np.zeros(int(g0[-1]), np.int64)
        tasks = {}
        for g, j0, j1, need in plan:
            per = heads[g]
            assert per > 0 and g0[g] <= j0 < j1 <= g0[g + 1]
            a, b = (j0 - g0[g]) // per, -(-(j1 - g0[g]) // per)
            assert (j0 - g0[g]) % per == 0 and (j1 - g0[g] == per * b)
            bq = -(-_core.PREFILL_TASK_QUERIES // per)
            assert a // bq == (b - 1) // bq                          # inside one block
            tasks.setdefault((g, a // bq), []).append((a, b))
            seen[j0:j1] += 1
            buf = pass_floats(vis, per, a, b)
            assert need == buf                                       # its one-pass buffer
        assert (seen == 1).all()
        for (g, blk), got in tasks.items():
            bq = -(-_core.PREFILL_TASK_QUERIES // heads[g])
            a, b = blk * bq, min(n, (blk + 1) * bq)
            want = pieces(vis, heads[g], budget, a, b)
            assert got == want                                       # the latest first
            cut += len(want) > 1
    assert cut > 0


def test_the_budget_is_16_mib_and_only_a_count(rng):
    assert _core.PREFILL_IMP_BUDGET_FLOATS * 4 == 16 << 20
    with pytest.raises(ValueError, match="budget"):
        _core._set_prefill_imp_budget(-1)
    with imp_budget(0):
        assert _core._set_prefill_imp_budget(0) == 0


def test_imp_mode_zero_leaves_importance_alone(rng):
    layer = filled(1, 16, kc.KvMode.F32, 80, rng)
    q2, g0 = grouped(layer, rng.standard_normal((80, 2, 16)).astype(np.float32))
    _, imp = run("blk", layer, q2, g0, n_pos=80, n_back=80, imp_mode=0)
    assert not imp.any()


# ---------------------------------------------------------------------------------------------
# NaN and infinity

def poisoned(rng):
    nkv, hd, rows = 1, 16, 200
    layer = filled(nkv, hd, kc.KvMode.F32, rows, rng)
    rows_ = layer._rows()
    kf, vf = rows_.kf.copy(), rows_.vf.copy()
    kf[0, 10, 3] = np.nan               # a NaN score for every query that sees row 10
    kf[0, 150, :] = np.inf              # +inf or NaN scores from row 150 on
    vf[0, 90, 5] = np.inf               # an infinite value
    vf[0, 120, 2] = np.nan              # a NaN value
    return layer, rows_._replace(kf=kf, vf=vf)


def test_nan_and_inf_propagate_like_the_decode_kernel(rng):
    layer, rows = poisoned(rng)
    q3 = rng.standard_normal((195, 2, 16)).astype(np.float32)
    q3[100, 1, 0] = np.nan              # one NaN query
    q2, g0 = grouped(layer, q3)
    # window 60: queries before row 10 + 60 see the NaN key, later ones do not
    for window in (0, 60):
        out, imp = run("blk", layer, q2, g0, n_pos=195, n_back=195, window=window, rows=rows)
        out_r, imp_r = run("rows", layer, q2, g0, n_pos=195, n_back=195, window=window,
                           rows=rows)
        assert np.array_equal(np.isnan(out), np.isnan(out_r))
        assert np.array_equal(np.isinf(out), np.isinf(out_r))
        assert np.array_equal(np.isnan(imp), np.isnan(imp_r))
        fin = np.isfinite(out_r)
        assert fin.any() and (~fin).any()
        close(out[fin], out_r[fin], atol=ATOL_ROWS)
        fin = np.isfinite(imp_r)
        close(imp[fin], imp_r[fin], atol=ATOL_ROWS)


def test_all_minus_inf_scores_give_nan_like_the_decode_kernel(rng):
    layer = filled(1, 8, kc.KvMode.F32, 70, rng)
    rows = layer._rows()
    kf = rows.kf.copy()
    kf[0, :70] = -1e30
    rows = rows._replace(kf=kf)
    q2 = np.full((3, 8), 1e30, dtype=np.float32)      # scores of -inf everywhere
    g0 = np.array([0, 3], dtype=np.intp)
    out, imp = run("blk", layer, q2, g0, n_pos=3, n_back=3, rows=rows)
    out_r, imp_r = run("rows", layer, q2, g0, n_pos=3, n_back=3, rows=rows)
    assert np.isnan(out_r).all() and np.isnan(out).all()
    assert np.array_equal(np.isnan(imp), np.isnan(imp_r))


# ---------------------------------------------------------------------------------------------
# bad input

def _bad_cases(layer, q2, g0):
    rows = layer._rows()
    hd = q2.shape[1]
    return [
        (dict(n_threads=0), "n_threads"),
        (dict(imp_mode=1), "imp_mode"),
        (dict(n_pos=0), "n_pos"),
        (dict(n_pos=7), "multiple of n_pos"),
        (dict(n_back=-1), "n_back"),
        (dict(window=-2), "n_back, window, first"),
        (dict(first=-1), "n_back, window, first"),
        (dict(group_q0=np.array([0, 5, 9], dtype=np.intp)), "group_q0"),
        (dict(group_q0=np.array([1, g0[1], g0[2]], dtype=np.intp)), "group_q0"),
        (dict(group_q0=np.array([0, 30, 20], dtype=np.intp)), "group_q0"),
        (dict(head_len=np.array([50, 10 ** 6], dtype=np.intp)), "head_len"),
        (dict(head_len=np.array([50, -1], dtype=np.intp)), "head_len"),
        (dict(head_len=np.array([50], dtype=np.intp)), "group_q0"),
        (dict(out=np.zeros((q2.shape[0], hd + 1), np.float32)), "out"),
        (dict(out=np.zeros((q2.shape[0] - 1, hd), np.float32)), "out"),
        (dict(kf=rows.kf[:1]), "float32 K"),
        (dict(vf=np.zeros((2, 10, hd), np.float32)), "head_len"),
        (dict(quant_k=True), "head_len"),          # the empty int8 arrays hold no row
        (dict(quant_v=True), "head_len"),
    ]


def _bad_call(layer, q2, g0, change, out, imp, probs=None):
    """The layer's rows and a good call, with ``change`` applied to whichever holds each field."""
    rows = layer._rows()
    call = AttendCall(q=q2, group_q0=g0, n_pos=10, n_back=10, window=0, first=0, scale=0.25,
                      softcap=0.0, out=out, imp=imp, imp_mode=2, n_threads=1, probs=probs)
    return (rows._replace(**{k: v for k, v in change.items() if k in Rows._fields}),
            call._replace(**{k: v for k, v in change.items() if k not in Rows._fields}))


def test_bad_input_raises_before_any_work(rng):
    layer = filled(2, 16, kc.KvMode.F32, 50, rng)
    q2, g0 = grouped(layer, rng.standard_normal((10, 4, 16)).astype(np.float32))
    for change, match in _bad_cases(layer, q2, g0):
        out = np.full(q2.shape, 7.0, dtype=np.float32)
        imp = np.full(50, 3.0, dtype=np.float32)
        rows, call = _bad_call(layer, q2, g0, change, out, imp)
        with pytest.raises(ValueError, match=match):
            _core.attend_blocked(rows, call)
        assert (out == 7.0).all() and (imp == 3.0).all(), change


def test_decode_kernel_refuses_the_same_bad_input(rng):
    """attend_rows runs the checks of attend_blocked (imp_mode 1 is its own), and checks its
    probability matrix: nothing is written before they pass."""
    layer = filled(2, 16, kc.KvMode.F32, 50, rng)
    q2, g0 = grouped(layer, rng.standard_normal((10, 4, 16)).astype(np.float32))
    cases = [(c, m) for c, m in _bad_cases(layer, q2, g0) if c != dict(imp_mode=1)] + [
        (dict(imp_mode=3), "imp_mode"),
        (dict(probs=np.zeros((q2.shape[0] + 1, 50), np.float32)), "probs"),
        (dict(probs=np.zeros((q2.shape[0], 50), np.float64)), "probs"),
        (dict(probs=None), "probs"),
        (dict(q=q2.astype(np.float64)), "q"),
        (dict(out=np.zeros((q2.shape[0], 32), np.float32)[:, ::2]), "out"),
        (dict(kf=layer._rows().kf.astype(np.float64)), "kf"),
    ]
    for change, match in cases:
        out = np.full(q2.shape, 7.0, dtype=np.float32)
        imp = np.full(50, 3.0, dtype=np.float32)
        probs = np.full((q2.shape[0], 50), 5.0, dtype=np.float32)
        rows, call = _bad_call(layer, q2, g0, change, out, imp, probs)
        with pytest.raises((ValueError, TypeError), match=match):
            _core.attend_rows(rows, call)
        assert (out == 7.0).all() and (imp == 3.0).all() and (probs == 5.0).all(), change


def test_a_bound_storage_checks_each_call_against_it(rng):
    """bind_rows checks the storage once (a bad one is refused at binding); each call on the
    binding is checked against it -- the bad calls above, the rows each group holds now -- and
    gives the unbound call's bits, also after an array of the storage is reshaped in place."""
    layer = filled(2, 16, kc.KvMode.F32, 50, rng)
    q2, g0 = grouped(layer, rng.standard_normal((10, 4, 16)).astype(np.float32))
    rows = layer._rows()
    with pytest.raises(ValueError, match="float32 K"):
        _core.bind_rows(rows._replace(kf=rows.kf[:1]))
    bound = _core.bind_rows(rows)
    for change, match in _bad_cases(layer, q2, g0):
        if any(k in Rows._fields and k != "head_len" for k in change) or \
                change.get("head_len", rows.head_len).shape != rows.head_len.shape:
            continue                                  # a storage change: not this binding's
        out = np.full(q2.shape, 7.0, dtype=np.float32)
        imp = np.full(50, 3.0, dtype=np.float32)
        _, call = _bad_call(layer, q2, g0, change, out, imp)
        saved = rows.head_len.copy()
        if "head_len" in change:
            rows.head_len[:] = change["head_len"]     # the bound array itself, changed in place
        try:
            with pytest.raises(ValueError, match=match):
                _core.attend_blocked(bound, call)
        finally:
            rows.head_len[:] = saved
        assert (out == 7.0).all() and (imp == 3.0).all(), change
    outs = []
    for storage in (bound, rows):
        out = np.zeros(q2.shape, dtype=np.float32)
        _, call = _bad_call(layer, q2, g0, {}, out, np.zeros(50, np.float32))
        _core.attend_blocked(storage, call)
        outs.append(out)
    assert np.array_equal(outs[0], outs[1])
    rows.kf.shape = (rows.kf.shape[0], rows.kf.shape[1] * 2, rows.kf.shape[2] // 2)
    out = np.zeros(q2.shape, dtype=np.float32)
    _, call = _bad_call(layer, q2, g0, {}, out, np.zeros(50, np.float32))
    _core.attend_blocked(bound, call)                 # the binding reads (nkv, cap, 16)
    assert np.array_equal(out, outs[0])


def test_a_layer_that_attended_copies_and_pickles_without_its_binding(rng):
    """The layer keeps its storage's binding; a copy or a pickled layer binds its own arrays
    and attends with the original's bits."""
    import copy
    import pickle
    layer = filled(2, 16, kc.KvMode.Q8(), 50, rng)
    q = rng.standard_normal((4, 16)).astype(np.float32)
    want = layer.attend_all_heads(q)
    for other in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert np.array_equal(other.attend_all_heads(q), want)
        other.append(np.ones((1, 2, 16), np.float32), np.ones((1, 2, 16), np.float32))
        assert not np.array_equal(other.attend_all_heads(q), want)
    assert np.array_equal(layer.attend_all_heads(q), want)


def test_q8_storage_shapes_are_checked(rng):
    layer = filled(2, 40, kc.KvMode.Q8(), 80, rng)
    q2, g0 = grouped(layer, rng.standard_normal((4, 2, 40)).astype(np.float32))
    rows = layer._rows()
    for bad in (rows._replace(ks=np.ascontiguousarray(rows.ks[:, :, :1])),
                rows._replace(vs=np.ascontiguousarray(rows.vs[:, :10])),
                rows._replace(vcol=np.ones((2, 39), np.float32)),
                # scale arrays longer than the rows' capacity: their group stride would differ
                rows._replace(ks=np.zeros((2, rows.kq.shape[1] + 8, rows.ks.shape[2]),
                                          np.float32)),
                rows._replace(vs=np.zeros((2, rows.vq.shape[1] + 8, 1), np.float32))):
        with pytest.raises(ValueError, match="int8"):
            run("blk", layer, q2, g0, n_pos=4, n_back=4, rows=bad)


# ---------------------------------------------------------------------------------------------
# every x86 body of the prompt kernel and its portable C twin

def _build(tmp_path, name, flags):
    cc = shlex.split(sysconfig.get_config_var("CC") or "cc")
    exe = tmp_path / name
    src = Path(__file__).parent / "c" / "prefill_twin.c"
    cmd = cc + ["-O2", "-std=gnu11", "-ffp-contract=off", *flags,
                f"-I{Path(kc.__file__).parent}", str(src), "-o", str(exe), "-lm"]
    subprocess.run(cmd, check=True, capture_output=True)
    return exe


def _run(exe):
    return subprocess.run([str(exe)], check=True, capture_output=True, text=True,
                          env=dict(os.environ)).stdout.splitlines()


def test_every_body_and_the_portable_twin_agree_bit_for_bit(tmp_path):
    """One build per x86 body (float32 and q8 tiles), plus the VNNI q8 code on an exact AVX2
    emulation of vpdpbusd: each the CPU runs gives the portable C's bits; the others compile."""
    portable = _run(_build(tmp_path, "portable", X86_BODY_FLAGS["portable"]))
    assert len(portable) > 10000
    assert len(set(portable)) > 1000
    builds = {b: (f, b) for b, f in X86_BODY_FLAGS.items() if b != "portable"}
    builds["vnni-emulated"] = (X86_BODY_FLAGS["avx2"] + ["-DKVC_EMULATE_VNNI"], "avx2")
    for name, (flags, needs) in builds.items():
        exe = _build(tmp_path, name, flags)
        if not cpu_runs(needs):
            continue
        simd = _run(exe)
        assert len(simd) == len(portable)
        diff = [i for i, (a, b) in enumerate(zip(simd, portable)) if a != b]
        assert not diff, (f"{name}: {len(diff)} of {len(simd)} results differ, first at "
                          f"line {diff[0]}")


@pytest.mark.parametrize("n,maxlen,window", [(1, 1, 0), (5, 9, 0), (70, 70, 16), (3, 2, 0)])
def test_prefill_work_counts_the_visible_rows(n, maxlen, window):
    from kvcache._attention import prefill_work
    nh, nkv, hd = 14, 2, 8
    rows = sum(min(max(0, maxlen - n + i + 1), window or maxlen) for i in range(n))
    work, tasks = prefill_work(n, maxlen, window, nh, nkv, hd)
    assert work == rows * 2 * hd * nh
    per_task = -(-_core.PREFILL_TASK_QUERIES // (nh // nkv))
    assert tasks == nkv * -(-n // per_task)
