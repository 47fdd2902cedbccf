"""Compiled kernels against their NumPy twins in kvcache.reference.

Tolerances (float32, different summation order inside dot products and sums):
outputs and probabilities within 2e-6 absolute + 1e-4 relative of the reference; row
quantisation and row stores are bit-identical by construction.
"""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from threadpoolctl import threadpool_limits

import kvcache as kc
from kvcache import _core, reference as ref
from kvcache._attention import default_scale

MODES = [kc.KvMode.F32, kc.KvMode.Q8(), kc.KvMode.Q8(k=True, v=False), kc.KvMode.Q8(k=False, v=True)]
MODE_IDS = ["f32", "q8", "q8k", "q8v"]
HEAD_DIMS = [1, 31, 32, 64, 128, 256]
FANOUTS = [1, 2, 7]
RTOL, ATOL = 1e-4, 2e-6


def pair(nkv, hd, mode, rows, rng, alive_pattern=None):
    """Two identical layers (one for the kernels, one for the reference)."""
    a = kc.LayerKvCache(nkv, hd, mode=mode)
    b = kc.LayerKvCache(nkv, hd, mode=mode)
    for start in range(0, rows, 97):
        n = min(97, rows - start)
        k = rng.standard_normal((n, nkv, hd), dtype=np.float32)
        v = rng.standard_normal((n, nkv, hd), dtype=np.float32)
        alive = None if alive_pattern is None else alive_pattern(start)
        a.append(k, v, alive)
        b.append(k, v, alive)
    return a, b


def assert_close(got, want):
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("hd", HEAD_DIMS)
@pytest.mark.parametrize("fanout", FANOUTS)
def test_attend_all_heads_matches_reference(mode, hd, fanout, rng):
    nkv = 2
    a, b = pair(nkv, hd, mode, 300, rng)
    q = rng.standard_normal((nkv * fanout, hd), dtype=np.float32)
    assert_close(a.attend_all_heads(q), ref.attend_all_heads(b, q))
    assert_close(a.importance, b.importance)


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("rows", [0, 1, 2, 5, 255, 256, 257, 700])
def test_lengths_around_chunk_boundaries(mode, rows, rng):
    a, b = pair(2, 32, mode, rows, rng)
    if rows == 0:
        with pytest.raises(ValueError, match="at most seq_len"):
            a.attend_all_heads(np.zeros((4, 32), np.float32))
        out, probs = a.attend(np.ones(32), 0)
        assert not out.any() and probs.shape == (0,)
        return
    q = rng.standard_normal((min(rows, 3), 4, 32), dtype=np.float32)
    assert_close(a.attend_all_heads(q, window=7), ref.attend_all_heads(b, q, window=7))
    assert_close(a.importance, b.importance)
    for h in range(2):
        o1, p1 = a.attend(q[-1, h], h)
        o2, p2 = ref.attend(b, q[-1, h], h)
        assert_close(o1, o2)
        assert_close(p1, p2)


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("threads", [1, 2])
def test_block_queries_window_softcap_scale(mode, threads, rng):
    a, b = pair(3, 64, mode, 600, rng)
    q = rng.standard_normal((40, 6, 64), dtype=np.float32) * 3
    with threadpool_limits(threads, user_api="openmp"):
        got = a.attend_all_heads(q, window=130, softcap=2.5, scale=0.3)
    want = ref.attend_all_heads(b, q, window=130, softcap=2.5, scale=0.3)
    assert_close(got, want)
    assert_close(a.importance, b.importance)


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_attend_group_matches_reference(mode, rng):
    a, b = pair(2, 48, mode, 400, rng)
    q = rng.standard_normal((5, 48), dtype=np.float32)
    out_a, out_b = np.empty((5, 48), np.float32), np.empty((5, 48), np.float32)
    imp_a, imp_b = np.full(300, 0.5, np.float32), np.full(300, 0.5, np.float32)
    a.attend_group(q, 1, out_a, imp_a, 0.2, 50, 4.0)
    ref.attend_group(b, q, 1, out_b, imp_b, 0.2, 50, 4.0)
    assert_close(out_a, out_b)
    assert_close(imp_a, imp_b)
    assert np.all(imp_a[:50] == 0.5)                          # rows below `first` get nothing


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_results_do_not_depend_on_thread_count(mode, rng):
    a, _ = pair(2, 128, mode, 3000, rng)
    q = rng.standard_normal((16, 128), dtype=np.float32)
    outs, imps = [], []
    for threads in (1, 2):
        before = a.importance.copy()
        with threadpool_limits(threads, user_api="openmp"):
            outs.append(a.attend_all_heads(q))
        imps.append(a.importance - before)
    assert np.array_equal(outs[0], outs[1])
    assert np.array_equal(imps[0], imps[1])


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("hd", [1, 31, 64, 128])
@pytest.mark.parametrize("fan", [1, 3, 4])
def test_attend_all_heads_equals_attend_per_head_bitexact(mode, hd, fan, rng):
    """One decode position: each head's output is the per-head attend, bit for bit (query
    pairs and single queries take different loops that must compute the same bits)."""
    nkv = 2
    a, _ = pair(nkv, hd, mode, 600, rng)
    q = rng.standard_normal((nkv * fan, hd), dtype=np.float32)
    got = a.attend_all_heads(q)
    for h in range(nkv * fan):
        out, _ = a.attend(q[h], h // fan)
        assert np.array_equal(got[h], out)


def test_prefill_blocks_equal_one_block(monkeypatch, rng):
    """The probability scratch is bounded by splitting long prefills into position blocks."""
    import kvcache._attention as attention
    a, b = pair(2, 32, kc.KvMode.F32, 500, rng)
    q = rng.standard_normal((200, 4, 32), dtype=np.float32)
    whole = a.attend_all_heads(q)
    monkeypatch.setattr(attention, "PROBS_BUDGET", 4 * 4 * 500 * 7)   # 7 positions a block
    blocked = b.attend_all_heads(q)
    assert np.array_equal(whole, blocked)
    assert_close(a.importance, b.importance)


def test_dead_and_partial_heads(rng):
    """Heads dead for part of the time hold fewer rows; each reads its own rows only."""
    pattern = lambda start: [True, start % 2 == 0, False]      # noqa: E731
    for mode in MODES:
        a, b = pair(3, 16, mode, 500, rng, alive_pattern=pattern)
        assert a.head_len(2) == 0 and 0 < a.head_len(1) < a.head_len(0) == 500
        q = rng.standard_normal((6, 16), dtype=np.float32)
        got = a.attend_all_heads(q)
        assert_close(got, ref.attend_all_heads(b, q))
        assert not got[4:].any()                                 # the dead group outputs zeros
        assert_close(a.importance, b.importance)


# ---------------------------------------------------------------------- quantisation
@pytest.mark.parametrize("hd", HEAD_DIMS)
@pytest.mark.parametrize("group", [32, None])
def test_quantize_rows_bit_identical(hd, group, rng):
    group = hd if group is None else group
    x = rng.standard_normal((50, hd), dtype=np.float32) * rng.uniform(0.01, 100, (50, 1)).astype(np.float32)
    x[3] = 0.0                                                  # all-zero row: scale floor 1e-12
    x[4, 0] = np.nan
    x[5, -1] = np.inf
    x[6] = -x[6]
    col = rng.uniform(0.5, 2.0, hd).astype(np.float32)
    ng = -(-hd // group)
    for c in (np.zeros(0, np.float32), col):
        q1, s1 = np.empty((50, hd), np.int8), np.empty((50, ng), np.float32)
        q2, s2 = np.empty((50, hd), np.int8), np.empty((50, ng), np.float32)
        _core.quantize_rows(x, c, group, q1, s1, 2)
        ref.quantize_rows(x, c, group, q2, s2)
        assert np.array_equal(q1, q2)
        assert np.array_equal(s1, s2)
        assert q1.min() >= -127


def test_quantize_rounds_half_away_from_zero():
    # scale = 127/127 = 1 exactly, so r/s hits the .5 ties
    x = np.array([[127.0, 0.5, -0.5, 1.5, -1.5, 2.5, -2.5, 0.49999997]], np.float32)
    q, s = np.empty((1, 8), np.int8), np.empty((1, 1), np.float32)
    _core.quantize_rows(x, np.zeros(0, np.float32), 8, q, s, 1)
    assert s[0, 0] == 1.0
    assert q.tolist() == [[127, 1, -1, 2, -2, 3, -3, 0]]
    q2, s2 = np.empty((1, 8), np.int8), np.empty((1, 1), np.float32)
    ref.quantize_rows(x, np.zeros(0, np.float32), 8, q2, s2)
    assert np.array_equal(q, q2)


@pytest.mark.parametrize("mode", MODES[1:], ids=MODE_IDS[1:])
def test_store_rows_q8_matches_reference(mode, rng):
    nkv, hd, n = 3, 40, 9
    x = rng.standard_normal((n, nkv, hd), dtype=np.float32)
    alive = np.array([1, 0, 1], np.uint8)
    lens = np.array([2, 0, 5], np.intp)
    col = rng.uniform(0.5, 2, (nkv, hd)).astype(np.float32)
    col_on = np.array([1, 0, 0], np.uint8)
    out = []
    for kern in (_core, ref):
        q = np.zeros((nkv, 20, hd), np.int8)
        s = np.zeros((nkv, 20, 2), np.float32)
        kern.store_rows_q8(x, alive, lens, col, col_on, 32, q, s)
        out.append((q, s))
    assert np.array_equal(out[0][0], out[1][0]) and np.array_equal(out[0][1], out[1][1])
    assert not out[0][0][1].any()                                # dead head untouched


def test_stream_read_matches_reference(rng):
    buf = rng.standard_normal(1 << 20, dtype=np.float32)
    np.testing.assert_allclose(_core.stream_read(buf, 2), ref.stream_read(buf), rtol=1e-5, atol=1e-2)


# ---------------------------------------------------------------------- shape fuzzing
@settings(max_examples=40, deadline=None)
@given(nkv=st.integers(1, 4), fan=st.integers(1, 5), hd=st.integers(1, 80),
       rows=st.integers(1, 300), n=st.integers(1, 4), window=st.one_of(st.none(), st.integers(1, 50)),
       softcap=st.sampled_from([0.0, 1.5]), mode=st.sampled_from(MODES), seed=st.integers(0, 2**32 - 1))
def test_fuzz_shapes_against_reference(nkv, fan, hd, rows, n, window, softcap, mode, seed):
    rng = np.random.default_rng(seed)
    a, b = pair(nkv, hd, mode, rows, rng)
    q = rng.standard_normal((min(n, rows), nkv * fan, hd), dtype=np.float32)
    got = a.attend_all_heads(q, window=window, softcap=softcap)
    want = ref.attend_all_heads(b, q, window=window, softcap=softcap)
    assert_close(got, want)
    assert_close(a.importance, b.importance)
    assert np.isclose(a.importance.sum(), q.shape[0] * q.shape[1], rtol=1e-4)


def test_default_scale_is_float32_of_inverse_sqrt():
    for hd in HEAD_DIMS:
        assert default_scale(hd) == float(np.float32(1.0 / np.sqrt(hd)))


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_out_may_alias_q(mode, rng):
    a, b = pair(2, 32, mode, 300, rng)
    for shape in ((4, 32), (5, 4, 32)):
        q = rng.standard_normal(shape, dtype=np.float32)
        want = b.attend_all_heads(q.copy())
        got = a.attend_all_heads(q, out=q)
        assert got is q
        assert np.array_equal(q, want)
