"""LayerKvCache behaviour pinned by layer-kv-cache.md sections 1-5, 8 and 9.

The first block re-states the upstream kv_cache unit tests of spec section 9 (wire tests
excepted) with our own data; the rest pins the behaviour the spec describes in prose.
Expected values come from the spec's numbers or from a small float64 NumPy softmax (the
softmax_attention fixture of conftest.py), never from running the library.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import kvcache as kc
from kvcache import reference as _reference  # noqa: F401  (kc.reference for scored_query)
from kvcache._attention import default_scale

F32 = kc.KvMode.F32
# (4-bit K scores through a per-block integer query, which a float64 reference over its stored
# values does not model: tests/test_kv4.py checks it against its NumPy twin bit for bit)
ALL_MODES = [F32, kc.KvMode.Q8(), kc.KvMode.Q8(k=True, v=False), kc.KvMode.Q8(k=False, v=True),
             kc.KvMode.of(8, 4), kc.KvMode.of(32, 4)]
MODE_IDS = ["f32", "q8", "q8k", "q8v", "k8v4", "q4v"]
Q8_MODES = ALL_MODES[1:4]
Q8_IDS = MODE_IDS[1:4]
# the spec's scheme (column freeze after 64 rows): KvMode's legacy int8 scheme "cmf"
CMF_MODES = [kc.KvMode.Q8(scheme="cmf"), kc.KvMode.Q8(True, False, scheme="cmf"),
             kc.KvMode.Q8(False, True, scheme="cmf")]
CMF_IDS = ["q8:cmf", "q8k:cmf", "q8v:cmf"]
WARMUP = 64           # spec 3: KV_COL_WARMUP
# K channels per scale group: spec 3's KV_K_GROUP (32) for "cmf"; the default scheme "rows"
# stores K in 16-channel groups (docs/numerics.md, "int8 storage")
K_GROUP = {"rows": 16, "cmf": 32}


# ---------------------------------------------------------------------------- helpers
def filled(mode, k, v, alive=None):
    """A layer of k's geometry holding the block (k, v) of shape (n, nkv, hd)."""
    layer = kc.LayerKvCache(k.shape[1], k.shape[2], mode=mode)
    layer.append(k, v, alive)
    return layer


def stored_keys(layer, h):
    """Head h's keys as float64 rows: the f32 store, or int8 dequantised per spec 3.3
    (kq * per-group scale * frozen key column)."""
    if not layer.mode.quant_k:
        return layer.head_keys(h).astype(np.float64)
    kq, ks, _, _ = layer.q8_rows(h)
    hd = layer.head_dim
    group = K_GROUP[layer.mode.scheme]
    x = kq.astype(np.float64) * np.repeat(ks.astype(np.float64), group, axis=1)[:, :hd]
    kcol = layer.columns(h)[0]
    return x if kcol is None else x * kcol.astype(np.float64)


def scored_query(layer, h, q):
    """The query, as float64, that the kernels score against stored_keys(layer, h).

    float32 keys: q itself.  int8 keys (docs/numerics.md, "q8 scoring"): the kernel quantises
    the column-folded query q * kcol per K group of the scheme (16 or 32 channels), so its scores are those of the
    dequantised codes Q(q * kcol), i.e. of Q(q * kcol) / kcol against stored_keys."""
    q = np.asarray(q, dtype=np.float32)
    if not layer.mode.quant_k:
        return q.astype(np.float64)
    hd = q.shape[-1]
    kcol = layer.columns(h)[0]
    x = (q if kcol is None else q * kcol).reshape(-1, hd).astype(np.float32)
    group = K_GROUP[layer.mode.scheme]                  # the query in the K groups
    ng = -(-hd // group)
    qi, sq = np.zeros((len(x), ng * group), np.int8), np.zeros((len(x), ng), np.float32)
    kc.reference.quantize_query(x, qi, sq, np.zeros((len(x), ng), np.int32), group)
    deq = (qi.astype(np.float64) * np.repeat(sq.astype(np.float64), group, axis=1))[:, :hd]
    deq = deq.reshape(q.shape)
    return deq if kcol is None else deq / kcol.astype(np.float64)


def scored_queries(layer, q):
    """scored_query for every head of q (..., nh, hd): head h reads KV group h // hpk."""
    q = np.asarray(q, dtype=np.float32)
    hpk = q.shape[-2] // layer.num_kv_heads
    out = np.empty(q.shape, dtype=np.float64)
    for h in range(q.shape[-2]):
        out[..., h, :] = scored_query(layer, h // hpk, q[..., h, :])
    return out


def stored_values(layer, h):
    """Head h's values as float64 rows: the f32 store, int8 * row scale * value column, or the
    4-bit rows' values fmaf(code, step, minimum) (docs/kv4.md)."""
    if layer.mode.v4:
        c, p = layer.v4_rows(h)
        return kc.reference.dequantize_v4(c, p.view(np.uint16), layer.head_dim).astype(np.float64)
    if not layer.mode.quant_v:
        return layer.head_values(h).astype(np.float64)
    _, _, vq, vs = layer.q8_rows(h)
    x = vq.astype(np.float64) * vs.astype(np.float64)[:, None]
    vcol = layer.columns(h)[1]
    return x if vcol is None else x * vcol.astype(np.float64)


def no_columns(layer):
    """True when no head of the layer has a frozen column field."""
    return all(c is None for h in range(layer.num_kv_heads) for c in layer.columns(h))


def reference_all_heads(attn, keys, values, q, scale, window=None, softcap=0.0):
    """attend_all_heads by the spec's words, in float64.

    keys/values: per-KV-head row arrays; q: (n, nh, hd), the newest n positions.  Query i
    sees rows [end - window, end) with end = rows - n + i + 1; head h reads group h // hpk.
    Returns (out (n, nh, hd), importance added per row).
    """
    n, nh, hd = q.shape
    hpk = nh // len(keys)
    rows = max(len(k) for k in keys)
    out = np.zeros((n, nh, hd))
    imp = np.zeros(rows)
    for i in range(n):
        for h in range(nh):
            g = h // hpk
            end = len(keys[g]) - n + i + 1
            start = 0 if window is None else max(0, end - window)
            o, p = attn(q[i, h], keys[g][start:end], values[g][start:end], scale, softcap)
            out[i, h] = o
            imp[start:end] += p
    return out, imp


def assert_close32(got, want, rtol=1e-5):
    """float32 results against a float64 reference: a few float32 ulps of the data scale."""
    want = np.asarray(want, dtype=np.float64)
    atol = rtol * max(1.0, float(np.max(np.abs(want), initial=0.0)))
    np.testing.assert_allclose(np.asarray(got, dtype=np.float64), want, rtol=rtol, atol=atol)


# ---------------------------------------------------------------------------- spec 9 tests
def test_append_tracks_seq_len_and_layout(rng):
    nkv, hd = 4, 8
    k_new = rng.standard_normal(nkv * hd).astype(np.float32)   # one flat position
    v_new = rng.standard_normal(nkv * hd).astype(np.float32)
    layer = kc.LayerKvCache(nkv, hd, mode=F32)
    layer.append(k_new, v_new)
    assert layer.seq_len == 1
    assert [layer.head_len(h) for h in range(nkv)] == [1] * nkv
    assert np.array_equal(layer.head_keys(1), k_new[8:16].reshape(1, hd))
    assert np.array_equal(layer.head_values(1), v_new[8:16].reshape(1, hd))
    assert layer.memory_bytes() == 256      # 4 heads * 8 ch * 4 B * (K + V)


@pytest.mark.parametrize("mode", ALL_MODES, ids=MODE_IDS)
def test_dead_head_stores_nothing(rng, make_kv, mode):
    nkv, hd, rows = 2, 8 if mode.v4 else 4, 2
    k, v = make_kv(rng, rows, nkv, hd)
    layer = filled(mode, k, v, alive=[True, False])
    assert layer.head_len(0) == rows and layer.head_len(1) == 0
    assert layer.seq_len == rows
    assert layer.importance.shape == (rows,)
    k_bytes = hd + 4 * math.ceil(hd / K_GROUP[mode.scheme]) if mode.quant_k else 4 * hd
    v_bytes = hd + 4 if mode.quant_v else hd // 2 + 4 if mode.v4 else 4 * hd
    assert layer.memory_bytes() == rows * (k_bytes + v_bytes)      # only head 0's rows
    if mode == F32:
        assert layer.memory_bytes() == 64                          # the spec's number
    assert layer.head_keys(1).shape == (0, hd) and layer.head_values(1).shape == (0, hd)


def test_eviction_keeps_recent():
    nkv, hd = 2, 4
    kv = kc.KvCache(1, nkv, hd, policy=kc.EvictionPolicy.RECENT, mode=F32)
    layer = kv.layers[0]
    for pos in range(8):
        layer.append(np.full((nkv, hd), pos), np.full((nkv, hd), -pos))
    layer.accumulate_imp(np.arange(8, dtype=np.float32) * 10)      # must not matter
    kv.evict(4)
    assert layer.seq_len == 4 and kv.seq_len == 4
    for h in range(nkv):
        assert layer.head_len(h) == 4
        assert layer.head_keys(h)[:, 0].tolist() == [4, 5, 6, 7]
        assert layer.head_values(h)[:, 0].tolist() == [-4, -5, -6, -7]
    assert layer.importance.tolist() == [40, 50, 60, 70]          # travels with its row


@pytest.mark.parametrize("mode", ALL_MODES, ids=MODE_IDS)
def test_truncate_rolls_back_speculative_positions(rng, make_kv, mode):
    nkv, hd = 2, 8
    k, v = make_kv(rng, 5, nkv, hd)
    layer = kc.LayerKvCache(nkv, hd, mode=mode)
    for i in range(5):
        layer.append(k[i], v[i])
    keep = filled(mode, k[:3], v[:3])          # what the first 3 rows look like stored
    layer.truncate_last(2)
    assert layer.seq_len == 3
    assert layer.importance.shape == (3,)
    for h in range(nkv):
        assert layer.head_len(h) == 3
        assert np.array_equal(stored_keys(layer, h), stored_keys(keep, h))
        assert np.array_equal(stored_values(layer, h), stored_values(keep, h))
    if not mode.quant_k:
        assert np.array_equal(layer.head_keys(0)[2], k[2, 0])        # row 2 survives
    assert layer.memory_bytes() == keep.memory_bytes()


def _channel_structured(rng, n, nkv, hd):
    # bounded base values (uniform in [-1, 1)), then the spec's channel structure
    x = rng.uniform(-1.0, 1.0, (n, nkv, hd)).astype(np.float32)
    x[..., 0::2] *= 4.0
    x[..., 1::2] *= 0.25
    return x


def test_q8_attend_matches_f32_within_grid(rng):
    nkv, hd, rows = 2, 32, 100
    k = _channel_structured(rng, rows, nkv, hd)
    v = _channel_structured(rng, rows, nkv, hd)
    exact = kc.LayerKvCache(nkv, hd, mode=F32)
    q8 = kc.LayerKvCache(nkv, hd, mode=CMF_MODES[0])
    for i in range(rows):                      # one position at a time, crossing the freeze
        exact.append(k[i], v[i])
        q8.append(k[i], v[i])
    assert q8.columns(0)[0] is not None and q8.columns(0)[1] is not None
    assert 3 * q8.memory_bytes() < exact.memory_bytes()

    queries = rng.standard_normal((6, hd)).astype(np.float32)

    def compare(expect_len):
        for h in range(nkv):
            for q in queries:
                # the f32 layer scores the query the int8 keys are scored with (q8 scoring
                # quantises the query; tests/test_int8_scoring.py checks that step): what is
                # compared here is the storage's error
                o32, p32 = exact.attend(scored_query(q8, h, q).astype(np.float32), h)
                o8, p8 = q8.attend(q, h)
                assert p8.shape == p32.shape == (expect_len,)
                bound = 0.03 * np.max(np.abs(o32)) + 1e-3
                assert np.max(np.abs(o32 - o8)) <= bound
                assert np.max(np.abs(p32 - p8)) < 0.02

    compare(rows)
    exact.truncate_last(30)
    q8.truncate_last(30)
    assert [q8.head_len(h) for h in range(nkv)] == [70, 70]
    compare(70)
    q8._evict_born(20, 2, 8)
    assert [q8.head_len(h) for h in range(nkv)] == [20, 20]
    assert q8.seq_len == 20
    for h in range(nkv):
        out, probs = q8.attend(queries[0], h)
        assert np.all(np.isfinite(out)) and probs.shape == (20,)
        assert abs(float(probs.sum()) - 1.0) < 1e-5


@pytest.mark.parametrize("mode", ALL_MODES, ids=MODE_IDS)
def test_attend_group_equals_per_head_attend_bitexact(rng, make_kv, mode):
    nkv, hd, hpk, rows = 2, 32, 3, 70        # 70 rows: the q8 columns are frozen
    k, v = make_kv(rng, rows, nkv, hd)
    layer = filled(mode, k, v)
    scale = default_scale(hd)
    assert scale == float(np.float32(1.0 / np.sqrt(hd)))
    for g in range(nkv):
        qg = rng.standard_normal((hpk, hd)).astype(np.float32)
        out = np.full(hpk * hd, np.nan, dtype=np.float32)
        imp = np.zeros(rows, dtype=np.float32)
        layer.attend_group(qg, g, out, imp, scale, 0, 0.0)
        want_imp = np.zeros(rows, dtype=np.float32)
        for j in range(hpk):
            o, p = layer.attend(qg[j], g)
            assert np.array_equal(out[j * hd:(j + 1) * hd], o), (g, j)
            want_imp += p                                  # head order, float32
        assert np.array_equal(imp, want_imp)


@pytest.mark.parametrize("mode", [kc.KvMode.Q8(True, False), kc.KvMode.Q8(False, True)],
                         ids=["q8k", "q8v"])
def test_born_eviction_mixed_modes_stay_consistent(rng, make_kv, softmax_attention, mode):
    nkv, hd, rows = 2, 32, 80
    k, v = make_kv(rng, rows, nkv, hd)
    layer = filled(mode, k, v)
    heavy = np.zeros(rows, dtype=np.float32)
    heavy[30:38] = np.linspace(1.0, 2.0, 8)          # the 8 middle rows the budget keeps
    layer.accumulate_imp(heavy)
    before = [(stored_keys(layer, h), stored_values(layer, h), layer.q8_rows(h)) for h in range(nkv)]
    before = [(kk, vv, tuple(None if a is None else a.copy() for a in q8)) for kk, vv, q8 in before]
    mem_before = layer.memory_bytes()

    layer._evict_born(20, 4, 8)

    kept = np.r_[0:4, 30:38, 72:80]                      # sink, heavy middle, recent tail
    assert layer.seq_len == 20
    assert np.array_equal(layer.importance, heavy[kept])
    assert layer.memory_bytes() < mem_before / 2
    q = rng.standard_normal(hd).astype(np.float32)
    for h in range(nkv):
        assert layer.head_len(h) == 20
        kk, vv, q8 = before[h]
        for old, new in zip(q8, layer.q8_rows(h)):     # int8 rows gathered, not requantised
            assert (old is None) == (new is None)
            if old is not None:
                assert np.array_equal(new, old[kept])
        f32_part = k[:, h] if not mode.quant_k else v[:, h]
        f32_now = layer.head_keys(h) if not mode.quant_k else layer.head_values(h)
        assert np.array_equal(f32_now, f32_part[kept])
        out, probs = layer.attend(q, h)
        want, want_p = softmax_attention(scored_query(layer, h, q), kk[kept], vv[kept],
                                         default_scale(hd))
        assert_close32(out, want)
        assert_close32(probs, want_p)


def test_born_eviction_keeps_high_mass_position():
    nkv, hd = 2, 4
    kv = kc.KvCache(1, nkv, hd, policy=kc.EvictionPolicy.born(sink=1), mode=F32)
    layer = kv.layers[0]
    for pos in range(8):
        layer.append(np.full((nkv, hd), pos), np.full((nkv, hd), pos))
    imp = np.full(8, 0.05, dtype=np.float32)
    imp[3] = 5.0
    layer.accumulate_imp(imp)
    kv.evict(4)
    for h in range(nkv):
        assert layer.head_keys(h)[:, 0].tolist() == [0, 3, 6, 7]
        assert layer.head_values(h)[:, 0].tolist() == [0, 3, 6, 7]
    assert layer.seq_len == 4
    assert np.array_equal(layer.importance, imp[[0, 3, 6, 7]])


# ---------------------------------------------------------------------------- attend edge cases
@pytest.mark.parametrize("mode", ALL_MODES, ids=MODE_IDS)
def test_attend_of_empty_head_returns_zeros(rng, mode):
    layer = kc.LayerKvCache(2, 8, mode=mode)
    out, probs = layer.attend(np.ones(8), 0)
    assert out.shape == (8,) and out.dtype == np.float32 and not out.any()
    assert probs.shape == (0,) and probs.dtype == np.float32
    # a head that was always dead is empty too, whatever the other head holds
    layer.append(rng.standard_normal((3, 2, 8)), rng.standard_normal((3, 2, 8)), alive=[True, False])
    out, probs = layer.attend(np.ones(8), 1)
    assert not out.any() and probs.shape == (0,)


@pytest.mark.parametrize("mode", ALL_MODES, ids=MODE_IDS)
def test_attend_group_on_empty_head_zero_fills_and_leaves_imp(rng, mode):
    hd = 8
    layer = kc.LayerKvCache(2, hd, mode=mode)
    layer.append(rng.standard_normal((3, 2, hd)), rng.standard_normal((3, 2, hd)), alive=[True, False])
    out = np.full(2 * hd, 7.0, dtype=np.float32)
    imp = np.array([0.5, 0.25, 0.125], dtype=np.float32)
    layer.attend_group(rng.standard_normal((2, hd)), 1, out, imp, default_scale(hd), 0, 0.0)
    assert not out.any()
    assert imp.tolist() == [0.5, 0.25, 0.125]


def test_softcap_only_touches_finite_scores(rng, softmax_attention):
    hd, rows, cap = 4, 6, 2.0
    keys = rng.standard_normal((rows, 1, hd)).astype(np.float32) * 3
    values = rng.standard_normal((rows, 1, hd)).astype(np.float32)
    keys[2, 0] = [-np.inf, 0.0, 0.0, 0.0]        # score -inf for a query with q[0] > 0
    layer = filled(F32, keys, values)
    q = np.array([[1.5, 0.5, -1.0, 2.0]], dtype=np.float32)
    scale = default_scale(hd)
    out = np.empty(hd, dtype=np.float32)
    imp = np.zeros(rows, dtype=np.float32)
    layer.attend_group(q, 0, out, imp, scale, 0, cap)
    # a capped -inf would become -cap and get a positive probability; it must stay at 0
    assert imp[2] == 0.0
    finite = [0, 1, 3, 4, 5]
    want, want_p = softmax_attention(q[0], keys[finite, 0], values[finite, 0], scale, cap)
    assert_close32(out, want)
    assert_close32(imp[finite], want_p)
    # the cap changes the finite scores: without it the probabilities differ
    _, raw_p = softmax_attention(q[0], keys[finite, 0], values[finite, 0], scale)
    assert np.max(np.abs(raw_p - want_p)) > 1e-2


@pytest.mark.parametrize("mode", ALL_MODES, ids=MODE_IDS)
def test_attend_group_first_hides_earlier_rows(rng, make_kv, softmax_attention, mode):
    nkv, hd, hpk, rows, first = 2, 16, 2, 30, 12
    k, v = make_kv(rng, rows, nkv, hd)
    layer = filled(mode, k, v)
    qg = rng.standard_normal((hpk, hd)).astype(np.float32)
    out = np.empty((hpk, hd), dtype=np.float32)             # 2-D out of the right size
    imp = np.zeros(rows, dtype=np.float32)
    layer.attend_group(qg.reshape(-1), 1, out, imp, 0.4, first, 0.0)   # flat q form
    assert not imp[:first].any()                             # probability exactly 0
    want_imp = np.zeros(rows)
    for j in range(hpk):
        want, p = softmax_attention(scored_query(layer, 1, qg[j]), stored_keys(layer, 1)[first:],
                                    stored_values(layer, 1)[first:], 0.4)
        assert_close32(out[j], want)
        want_imp[first:] += p
    assert_close32(imp, want_imp)


@pytest.mark.parametrize("mode", ALL_MODES, ids=MODE_IDS)
def test_attend_group_first_past_the_end_keeps_the_last_row(rng, make_kv, mode):
    nkv, hd, rows = 1, 8, 10
    k, v = make_kv(rng, rows, nkv, hd)
    layer = filled(mode, k, v)
    out = np.empty(2 * hd, dtype=np.float32)
    imp = np.zeros(rows, dtype=np.float32)
    layer.attend_group(rng.standard_normal((2, hd)), 0, out, imp, 0.3, 10 ** 6, 0.0)
    last = stored_values(layer, 0)[-1]
    assert_close32(out.reshape(2, hd), np.stack([last, last]))
    assert imp.tolist() == [0.0] * (rows - 1) + [2.0]        # one full unit per query head


def test_attend_group_adds_over_the_overlapping_prefix_of_imp_acc(rng, make_kv):
    hd, rows = 8, 10
    k, v = make_kv(rng, rows, 1, hd)
    layer = filled(F32, k, v)
    q = rng.standard_normal((3, hd)).astype(np.float32)
    probs = [layer.attend(qj, 0)[1] for qj in q]      # bit-equal to the group's, per contract

    def expected(start):
        acc = np.array(start, dtype=np.float32)
        for p in probs:                                # added head by head, in order
            m = min(acc.size, p.size)
            acc[:m] += p[:m]
        return acc

    scale = default_scale(hd)
    for start in ([1.0] * 4, [-1.0] * (rows + 5)):
        imp = np.array(start, dtype=np.float32)
        layer.attend_group(q, 0, np.empty(3 * hd, np.float32), imp, scale, 0, 0.0)
        assert np.array_equal(imp, expected(start))
    assert not layer.importance.any()                  # the cache's own imp is not touched


@pytest.mark.parametrize("mode", ALL_MODES, ids=MODE_IDS)
def test_attend_all_heads_dead_group_outputs_zeros(rng, make_kv, mode):
    nkv, hpk, hd, rows = 2, 2, 8, 6
    k, v = make_kv(rng, rows, nkv, hd)
    layer = filled(mode, k, v, alive=[True, False])        # KV head 1 holds nothing
    buf = np.full((nkv * hpk, hd), 5.0, dtype=np.float32)
    out = layer.attend_all_heads(rng.standard_normal((nkv * hpk, hd)), out=buf)
    assert not out[hpk:].any()                               # skipped, zero-filled
    assert np.all(np.isfinite(out[:hpk])) and out[:hpk].any()
    assert abs(float(layer.importance.sum()) - hpk) < 1e-5  # only live query heads add mass


@pytest.mark.parametrize("mode", ALL_MODES, ids=MODE_IDS)
def test_attend_single_head_matches_numpy(rng, make_kv, softmax_attention, mode):
    nkv, hd, rows = 2, 40, 90                   # hd not a multiple of 32: short last K group
    k, v = make_kv(rng, rows, nkv, hd)
    layer = filled(mode, k, v)
    for h in range(nkv):
        q = rng.standard_normal(hd).astype(np.float32)
        out, probs = layer.attend(q, h)
        want, want_p = softmax_attention(scored_query(layer, h, q), stored_keys(layer, h),
                                         stored_values(layer, h), 1.0 / math.sqrt(hd))
        assert_close32(out, want)
        assert_close32(probs, want_p)


# ---------------------------------------------------------------------------- attend_all_heads
@pytest.mark.parametrize("mode", ALL_MODES, ids=MODE_IDS)
@pytest.mark.parametrize("window", [None, 1, 5, 200])
@pytest.mark.parametrize("n", [1, 7])
def test_attend_all_heads_causal_window_matches_numpy(rng, make_kv, softmax_attention, mode,
                                                     window, n):
    nkv, hpk, hd, rows = 2, 3, 16, 75
    k, v = make_kv(rng, rows, nkv, hd)
    layer = filled(mode, k, v)
    keys = [stored_keys(layer, g) for g in range(nkv)]
    values = [stored_values(layer, g) for g in range(nkv)]
    q = rng.standard_normal((n, nkv * hpk, hd)).astype(np.float32)
    scale = 0.3
    got = layer.attend_all_heads(q, scale=scale, window=window)
    want, want_imp = reference_all_heads(softmax_attention, keys, values,
                                         scored_queries(layer, q), scale, window)
    assert got.shape == (n, nkv * hpk, hd) and got.dtype == np.float32
    assert_close32(got, want)
    assert_close32(layer.importance, want_imp)


def test_window_one_returns_own_value(rng, make_kv):
    nkv, hd, rows = 2, 8, 10
    k, v = make_kv(rng, rows, nkv, hd)
    layer = filled(F32, k, v)
    out = layer.attend_all_heads(rng.standard_normal((4, 4, hd)), window=1)
    for i in range(4):
        for h in range(4):
            assert np.array_equal(out[i, h], v[rows - 4 + i, h // 2])


def test_single_query_form_equals_one_position_block(rng, make_kv):
    k, v = make_kv(rng, 30, 2, 8)
    a, b = filled(F32, k, v), filled(F32, k, v)
    q = rng.standard_normal((4, 8)).astype(np.float32)
    out2 = a.attend_all_heads(q)
    out3 = b.attend_all_heads(q[None])
    assert out2.shape == (4, 8) and out3.shape == (1, 4, 8)
    assert np.array_equal(out2, out3[0])
    assert np.array_equal(a.importance, b.importance)


def test_attend_all_heads_softcap_matches_numpy(rng, make_kv, softmax_attention):
    k, v = make_kv(rng, 40, 2, 8, scale=3.0)
    layer = filled(F32, k, v)
    q = (rng.standard_normal((3, 4, 8)) * 3).astype(np.float32)
    got = layer.attend_all_heads(q, softcap=1.5)
    keys = [layer.head_keys(g).astype(np.float64) for g in range(2)]
    vals = [layer.head_values(g).astype(np.float64) for g in range(2)]
    want, _ = reference_all_heads(softmax_attention, keys, vals, q, default_scale(8), None, 1.5)
    assert_close32(got, want)


def test_out_buffer_is_filled_and_returned(rng, make_kv):
    k, v = make_kv(rng, 12, 2, 8)
    a, b = filled(F32, k, v), filled(F32, k, v)
    q = rng.standard_normal((3, 4, 8)).astype(np.float32)
    buf = np.full((3, 4, 8), np.nan, dtype=np.float32)
    res = a.attend_all_heads(q, out=buf)
    assert res is buf
    assert np.array_equal(buf, b.attend_all_heads(q))


def test_many_positions_span_several_probability_blocks(rng, softmax_attention):
    # 64 query heads over 8192 rows: more positions than one probability-scratch block holds
    nkv, nh, hd, rows, n = 1, 64, 4, 8192, 40
    k = rng.standard_normal((rows, nkv, hd)).astype(np.float32)
    v = rng.standard_normal((rows, nkv, hd)).astype(np.float32)
    layer = filled(F32, k, v)
    q = rng.standard_normal((n, nh, hd)).astype(np.float32)
    got = layer.attend_all_heads(q)
    # vectorised float64 reference: query i sees rows [0, rows - n + i]
    s = np.einsum("ihd,rd->ihr", q.astype(np.float64), k[:, 0].astype(np.float64)) * default_scale(hd)
    mask = np.arange(rows)[None, :] > (rows - n + np.arange(n))[:, None]
    s[np.broadcast_to(mask[:, None, :], s.shape)] = -np.inf
    p = np.exp(s - s.max(axis=2, keepdims=True))
    p /= p.sum(axis=2, keepdims=True)
    assert_close32(got, p @ v[:, 0].astype(np.float64))
    assert_close32(layer.importance, p.sum(axis=(0, 1)))


# ---------------------------------------------------------------------------- importance
@pytest.mark.parametrize("mode", ALL_MODES, ids=MODE_IDS)
def test_importance_counts_every_query_head(rng, make_kv, mode):
    nkv, hpk, hd, rows = 2, 4, 16, 50
    nh = nkv * hpk
    k, v = make_kv(rng, rows, nkv, hd)
    layer = filled(mode, k, v)
    assert not layer.importance.any()
    layer.attend_all_heads(rng.standard_normal((nh, hd)))
    assert abs(float(layer.importance.sum(dtype=np.float64)) - nh) < 1e-4
    n = 9
    layer.attend_all_heads(rng.standard_normal((n, nh, hd)))
    assert abs(float(layer.importance.sum(dtype=np.float64)) - (n + 1) * nh) < 1e-3
    assert np.all(layer.importance >= 0)
    # causal: rows older than the block's first query were seen by all n + 1 queries, the
    # newest row only by the single query and the block's last position
    assert layer.importance[-1] <= 2 * nh + 1e-4


def test_accumulate_imp_adds_over_the_overlapping_prefix(rng, make_kv):
    k, v = make_kv(rng, 4, 1, 4)
    layer = filled(F32, k, v)
    layer.accumulate_imp([1.0, 2.0])
    layer.accumulate_imp(np.array([0.5, 0.5, 0.5, 0.5, 99.0, 99.0]))
    assert layer.importance.tolist() == [1.5, 2.5, 0.5, 0.5]
    layer.accumulate_imp([])
    assert layer.importance.tolist() == [1.5, 2.5, 0.5, 0.5]


# ---------------------------------------------------------------------------- q8 column freeze
@pytest.mark.parametrize("mode", CMF_MODES, ids=CMF_IDS)
def test_column_freeze_fires_at_the_65th_append(rng, make_kv, mode):
    nkv, hd = 2, 40
    k, v = make_kv(rng, 65, nkv, hd)
    layer = kc.LayerKvCache(nkv, hd, mode=mode)
    for i in range(WARMUP):
        layer.append(k[i], v[i])
        assert no_columns(layer), i
    layer.append(k[WARMUP], v[WARMUP])
    for h in range(nkv):
        kcol, vcol = layer.columns(h)
        assert (kcol is not None) == mode.quant_k and (vcol is not None) == mode.quant_v
        for col, part in ((kcol, k), (vcol, v)):
            if col is None:
                continue
            assert col.shape == (hd,) and col.dtype == np.float32
            # the field is the per-channel RMS of the first 64 rows (within their q8 grid)
            rms = np.sqrt(np.mean(part[:WARMUP, h].astype(np.float64) ** 2, axis=0))
            np.testing.assert_allclose(col, rms, rtol=0.02)
    # the freeze requantised the stored rows: they still read back as the data
    for h in range(nkv):
        got = stored_keys(layer, h) if mode.quant_k else stored_values(layer, h)
        ref = k[:, h] if mode.quant_k else v[:, h]
        assert np.max(np.abs(got - ref)) < 0.05 * np.max(np.abs(ref))


@pytest.mark.parametrize("mode", ALL_MODES, ids=MODE_IDS)
def test_block_append_equals_single_appends(rng, make_kv, mode):
    nkv, hd, rows = 2, 40, 100
    k, v = make_kv(rng, rows, nkv, hd)
    block = filled(mode, k, v)
    single = kc.LayerKvCache(nkv, hd, mode=mode)
    for i in range(rows):
        single.append(k[i], v[i])
    assert block.seq_len == single.seq_len == rows
    for h in range(nkv):
        for a, b in zip(block.q8_rows(h), single.q8_rows(h)):
            assert (a is None and b is None) or np.array_equal(a, b)
        for a, b in zip(block.columns(h), single.columns(h)):
            assert (a is None and b is None) or a.tobytes() == b.tobytes()
        assert np.array_equal(block.head_keys(h), single.head_keys(h))
        assert np.array_equal(block.head_values(h), single.head_values(h))
    assert block.memory_bytes() == single.memory_bytes()


@pytest.mark.parametrize("mode", CMF_MODES, ids=CMF_IDS)
def test_columns_survive_truncate_and_eviction_but_not_clear(rng, make_kv, mode):
    k, v = make_kv(rng, 90, 2, 32)
    layer = filled(mode, k, v)
    cols = [tuple(None if c is None else c.copy() for c in layer.columns(h)) for h in range(2)]
    layer.truncate_last(40)             # back under 64 rows: the field stays
    layer._evict_born(10, 2, 4)
    for h in range(2):
        for old, new in zip(cols[h], layer.columns(h)):
            assert (old is None and new is None) or np.array_equal(old, new)
    layer.clear()
    assert no_columns(layer)
    layer.append(k[:64], v[:64])                 # a new conversation warms up again
    assert no_columns(layer)
    layer.append(k[64], v[64])
    assert all(any(c is not None for c in layer.columns(h)) for h in range(2))


@pytest.mark.parametrize("mode", CMF_MODES, ids=CMF_IDS)
def test_column_freeze_sees_only_rows_that_survived_rollback(rng, make_kv, mode):
    k, v = make_kv(rng, 80, 2, 32)
    rolled = kc.LayerKvCache(2, 32, mode=mode)
    rolled.append(k[:60], v[:60])
    rolled.append(k[60:64] * 50, v[60:64] * 50)  # rejected drafts, very unlike the rest
    rolled.truncate_last(4)
    assert no_columns(rolled)
    rolled.append(k[60:80], v[60:80])            # the freeze fires at row 64 of this block
    straight = filled(mode, k[:80], v[:80])
    for h in range(2):
        for a, b in zip(rolled.columns(h) + rolled.q8_rows(h), straight.columns(h) + straight.q8_rows(h)):
            assert (a is None and b is None) or a.tobytes() == b.tobytes()


def test_q8_memory_per_row_and_head_matches_spec(rng, make_kv):
    hd, rows = 128, 10
    k, v = make_kv(rng, rows, 1, hd)
    q8 = filled(CMF_MODES[0], k, v)
    f32 = filled(F32, k, v)
    assert q8.memory_bytes() == rows * 276            # spec 3.4: hd=128 -> 276 B
    assert f32.memory_bytes() == rows * 1024
    k2, v2 = make_kv(rng, 70, 1, hd)
    q8.append(k2, v2)                                 # freezes both fields: + 4*hd each
    assert q8.memory_bytes() == 80 * 276 + 2 * 4 * hd


def test_q8_outlier_channels_stay_within_three_percent(rng):
    # Llama-like geometry: 8 KV heads x 4 query heads, hd 128, keys with outlier channels
    nkv, hpk, hd, rows = 8, 4, 128, 400
    k = rng.standard_normal((rows, nkv, hd)).astype(np.float32)
    v = rng.standard_normal((rows, nkv, hd)).astype(np.float32)
    for ch, mult in ((5, 10.0), (77, 30.0), (120, 100.0)):
        k[:, :, ch] *= mult
    q = rng.standard_normal((4, nkv * hpk, hd)).astype(np.float32)
    # With unit queries the x100 channel alone gives logits of std ~9 at 1/sqrt(hd): an
    # almost one-hot softmax that no int8 grid can follow.  Trained models keep logits in a
    # few units, so the score scale is chosen to give the f32 logits a standard deviation of 2.
    logits = np.einsum("nhd,rhd->nhr", q.reshape(4, nkv, hpk, hd)[:, :, 0], k)
    scale = 2.0 / float(np.std(logits))
    exact, q8 = filled(F32, k, v), filled(CMF_MODES[0], k, v)   # the column field's purpose
    o32 = exact.attend_all_heads(q, scale=scale)
    o8 = q8.attend_all_heads(q, scale=scale)
    assert np.max(np.abs(o32 - o8)) <= 0.03 * np.max(np.abs(o32))


# ---------------------------------------------------------------------------- linear state
def test_linear_state_and_scratch_lifecycle(rng, make_kv):
    layer = kc.LayerKvCache(2, 4, mode=F32)
    assert layer.linear_state.shape == (0,) and layer.linear_scratch.shape == (0,)
    base = layer.memory_bytes()
    layer.linear_state = [0.5, -0.25, 1.0]
    assert layer.linear_state.dtype == np.float32 and layer.linear_state.ndim == 1
    assert layer.linear_state.tolist() == [0.5, -0.25, 1.0]
    assert layer.memory_bytes() == base + 12          # the state counts
    layer.linear_scratch = np.arange(5, dtype=np.float64)
    assert layer.linear_scratch.dtype == np.float32
    assert layer.memory_bytes() == base + 12          # the scratch does not

    k, v = make_kv(rng, 3, 2, 4)
    layer.append(k, v)
    layer.attend_all_heads(rng.standard_normal((2, 4)))
    assert layer.importance.sum() > 0                 # importance does not count either
    assert layer.memory_bytes() == base + 12 + 3 * 2 * 2 * 4 * 4
    layer.truncate_last(2)                            # leaves both alone
    assert layer.linear_state.tolist() == [0.5, -0.25, 1.0]
    assert layer.linear_scratch.tolist() == [0, 1, 2, 3, 4]

    layer.commit_linear_scratch()                     # swap in, then empty the scratch
    assert layer.linear_state.tolist() == [0, 1, 2, 3, 4]
    assert layer.linear_scratch.shape == (0,)
    layer.linear_scratch = [9.0]
    layer.discard_linear_scratch()                    # reject: state untouched
    assert layer.linear_state.tolist() == [0, 1, 2, 3, 4]
    assert layer.linear_scratch.shape == (0,)
    layer.linear_scratch = [1.0, 2.0]
    layer.clear()
    assert layer.linear_state.shape == (0,) and layer.linear_scratch.shape == (0,)
    assert layer.seq_len == 0 and layer.memory_bytes() == 0


def test_linear_state_assignment_copies_the_input():
    layer = kc.LayerKvCache(1, 4, mode=F32)
    src = np.array([1.0, 2.0], dtype=np.float32)
    layer.linear_state = src
    src[0] = 100.0
    assert layer.linear_state.tolist() == [1.0, 2.0]


def test_commit_with_empty_scratch_keeps_state():
    layer = kc.LayerKvCache(1, 4, mode=F32)
    layer.linear_state = [3.0, 4.0]
    layer.commit_linear_scratch()
    assert layer.linear_state.tolist() == [3.0, 4.0]


def test_clear_keeps_geometry_and_mode(rng, make_kv):
    k, v = make_kv(rng, 70, 3, 8)
    layer = filled(kc.KvMode.Q8(k=True, v=False), k, v)
    layer.o1_begin(4, 8, 2)
    layer.clear()
    assert (layer.num_kv_heads, layer.head_dim) == (3, 8)
    assert layer.mode == kc.KvMode.Q8(k=True, v=False)
    assert layer.seq_len == 0 and layer.importance.shape == (0,) and layer.o1 is None
    assert all(layer.head_len(h) == 0 for h in range(3))
    layer.append(k[0], v[0])                          # usable again
    assert layer.seq_len == 1


# ---------------------------------------------------------------------------- views
@pytest.mark.parametrize("mode", ALL_MODES, ids=MODE_IDS)
def test_views_are_read_only(rng, make_kv, mode):
    k, v = make_kv(rng, 70, 2, 8)
    layer = filled(mode, k, v)
    views = [layer.importance, *layer.k_heads(), *layer.v_heads()]
    for h in range(2):
        views += [a for a in layer.q8_rows(h) + layer.columns(h) if a is not None]
    for view in views:
        assert view.flags.writeable is False
        if view.size:
            with pytest.raises(ValueError):
                view[(0,) * view.ndim] = 1
    for view in (layer.head_keys(0), layer.head_values(1)):
        with pytest.raises(ValueError):
            view[...] = 0


@pytest.mark.parametrize("mode", ALL_MODES, ids=MODE_IDS)
def test_k_heads_and_v_heads_list_the_head_views(rng, make_kv, mode):
    nkv, hd = 3, 8
    k, v = make_kv(rng, 5, nkv, hd)
    layer = filled(mode, k, v, alive=[True, False, True])
    ks, vs = layer.k_heads(), layer.v_heads()
    assert isinstance(ks, list) and isinstance(vs, list)
    assert len(ks) == len(vs) == nkv
    for h in range(nkv):
        assert np.array_equal(ks[h], layer.head_keys(h)) and ks[h].shape == layer.head_keys(h).shape
        assert np.array_equal(vs[h], layer.head_values(h)) and vs[h].shape == layer.head_values(h).shape
        assert ks[h].dtype == vs[h].dtype == np.float32
    if not mode.quant_k:
        assert np.array_equal(ks[2], k[:, 2]) and ks[1].shape == (0, hd)


@pytest.mark.parametrize("mode", Q8_MODES, ids=Q8_IDS)
def test_quantised_components_show_empty_float_views(rng, make_kv, mode):
    hd = 8
    k, v = make_kv(rng, 5, 2, hd)
    layer = filled(mode, k, v)
    for h in range(2):
        keys, values = layer.head_keys(h), layer.head_values(h)
        assert keys.shape == ((0, hd) if mode.quant_k else (5, hd))
        assert values.shape == ((0, hd) if mode.quant_v else (5, hd))
        assert keys.dtype == values.dtype == np.float32
        kq, ks, vq, vs = layer.q8_rows(h)
        if mode.quant_k:
            assert kq.shape == (5, hd) and kq.dtype == np.int8 and ks.shape == (5, 1)
        if mode.quant_v:
            assert vq.shape == (5, hd) and vq.dtype == np.int8 and vs.shape == (5,)


def test_q8_rows_follow_the_spec_quantiser():
    # the spec's scheme ("cmf"), one row (no column yet), hd 33: K groups [0, 32) and [32, 33);
    # V one group.  Values chosen so the expected int8 codes are plain arithmetic: absmax 127
    # -> scale 1.
    hd = 33
    row = np.arange(hd, dtype=np.float32) - 16.0          # -16 .. 16
    row[0] = 127.0
    row[32] = -2.5                                        # alone in its group: scale 2.5/127
    layer = kc.LayerKvCache(1, hd, mode=kc.KvMode.Q8(scheme="cmf"))
    layer.append(row[None], row[None])
    kq, ks, vq, vs = layer.q8_rows(0)
    assert ks.tolist() == [[1.0, np.float32(2.5) / np.float32(127)]]
    assert kq[0, :32].tolist() == row[:32].astype(int).tolist()
    assert kq[0, 32] == -127
    assert vs.tolist() == [1.0]
    assert vq[0, :32].tolist() == row[:32].astype(int).tolist()
    assert vq[0, 32] == -3                                # -2.5: half away from zero


def test_q8_rows_scheme_quantises_k_in_16_channel_groups():
    # the default scheme "rows", hd 33: K groups [0, 16), [16, 32) and the partial [32, 33);
    # V one scale per row.  Each full K group holds a +-127, so its scale is 1.
    hd = 33
    row = np.arange(hd, dtype=np.float32) - 16.0          # -16 .. 16
    row[0] = 127.0
    row[31] = -127.0
    row[32] = -2.5                                        # alone in its group: scale 2.5/127
    layer = kc.LayerKvCache(1, hd, mode=kc.KvMode.Q8())
    layer.append(row[None], row[None])
    kq, ks, vq, vs = layer.q8_rows(0)
    assert ks.tolist() == [[1.0, 1.0, np.float32(2.5) / np.float32(127)]]
    assert kq[0, :32].tolist() == row[:32].astype(int).tolist()
    assert kq[0, 32] == -127
    assert vs.tolist() == [1.0]
    assert vq[0, :32].tolist() == row[:32].astype(int).tolist()
    assert vq[0, 32] == -3                                # -2.5: half away from zero


def _round_half_away(x):
    """Round half away from zero; exact for float32 inputs evaluated in float64."""
    x = np.asarray(x, dtype=np.float64)
    return np.sign(x) * np.floor(np.abs(x) + 0.5)


def _spec_quantise(row, col, group):
    """Spec 3.1 for one float32 row: codes (hd,) int8 and one scale per group."""
    r = row if col is None else (row / col).astype(np.float32)
    codes, scales = np.zeros(row.size, dtype=np.int8), []
    for g0 in range(0, row.size, group):
        part = r[g0:g0 + group]
        s = np.float32(max(np.float32(np.max(np.abs(part))) / np.float32(127), np.float32(1e-12)))
        codes[g0:g0 + group] = np.clip(_round_half_away((part / s).astype(np.float32)), -127, 127)
        scales.append(s)
    return codes, np.array(scales, dtype=np.float32)


def _spec_store(rows, group, freeze=True):
    """Spec 3.1-3.2 for one head's component appended row by row: codes, scales, column.
    ``freeze`` False: scheme "rows", where 3.2 (the column freeze) never happens."""
    hd = rows.shape[1]
    codes, scales, col = [], [], None
    for i, row in enumerate(rows):
        if freeze and i >= WARMUP and col is None:             # the freeze, at the start of the append
            x = np.array([c.astype(np.float32) * np.repeat(s, group)[:hd]
                          for c, s in zip(codes, scales)], dtype=np.float32)
            sq = np.zeros(hd, dtype=np.float32)
            for xr in x:                            # row order, float32
                sq += xr * xr
            col = np.maximum(np.sqrt(sq / np.float32(len(x))), np.float32(1e-6)).astype(np.float32)
            requant = [_spec_quantise(xr, col, group) for xr in x]
            codes, scales = [c for c, _ in requant], [s for _, s in requant]
        c, s = _spec_quantise(row, col, group)
        codes.append(c)
        scales.append(s)
    return np.array(codes), np.array(scales), col


@pytest.mark.parametrize("mode", CMF_MODES + Q8_MODES, ids=CMF_IDS + Q8_IDS)
def test_q8_storage_matches_a_numpy_model_of_the_spec(rng, make_kv, mode):
    nkv, hd, rows = 2, 40, 100
    k, v = make_kv(rng, rows, nkv, hd)
    k[..., 0::2] *= 4.0                             # channel structure for the column field
    v[..., 1::2] *= 0.25
    layer = kc.LayerKvCache(nkv, hd, mode=mode)
    for i in range(rows):
        layer.append(k[i], v[i])
    for h in range(nkv):
        kq, ks, vq, vs = layer.q8_rows(h)
        kcol, vcol = layer.columns(h)
        freeze = mode.scheme == "cmf"
        if mode.quant_k:
            codes, scales, col = _spec_store(k[:, h], K_GROUP[mode.scheme], freeze)
            assert np.array_equal(kq, codes) and ks.tobytes() == scales.tobytes()
            assert (kcol is None and col is None) if not freeze else kcol.tobytes() == col.tobytes()
        if mode.quant_v:
            codes, scales, col = _spec_store(v[:, h], hd, freeze)
            assert np.array_equal(vq, codes) and vs.tobytes() == scales[:, 0].tobytes()
            assert (vcol is None and col is None) if not freeze else vcol.tobytes() == col.tobytes()


# ---------------------------------------------------------------------------- rollback property
@st.composite
def _rollback_case(draw):
    modes = ALL_MODES + CMF_MODES
    mode = modes[draw(st.integers(0, len(modes) - 1))]
    n = draw(st.integers(1, 20))
    if mode.freezes_columns:
        # The scheme "rows" (the default) rolls back exactly at any position.  In the legacy
        # scheme "cmf" the q8 column field is frozen at the start of the first append that finds
        # seq_len >= 64, and by design it survives truncate_last (spec 3.2).  A rollback can
        # only be exact if the n speculative appends do not fire the freeze: either it has
        # already fired (m >= 65) or it cannot fire yet (m + n <= 64).
        if draw(st.booleans()):
            m = draw(st.integers(65, 110))
        else:
            m = draw(st.integers(0, 64 - n))
    else:
        m = draw(st.integers(0, 110))
    nkv = draw(st.integers(1, 3))
    hd = draw(st.sampled_from([32, 40] if mode.v4 else [1, 5, 32, 40]))
    seed = draw(st.integers(0, 2 ** 32 - 1))
    block = draw(st.booleans())
    return mode, m, n, nkv, hd, seed, block


@settings(max_examples=40, deadline=None)
@given(_rollback_case())
def test_truncate_last_undoes_appends_bit_exactly(snapshot, assert_same_state, case):
    mode, m, n, nkv, hd, seed, block = case
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((m + n, nkv, hd)).astype(np.float32)
    v = rng.standard_normal((m + n, nkv, hd)).astype(np.float32)
    imp = rng.random(m).astype(np.float32)
    # two identical layers: `twin` never sees the speculative rows, so attention (which
    # adds into importance) can be compared on equal footing after the rollback
    twin, layer = kc.LayerKvCache(nkv, hd, mode=mode), kc.LayerKvCache(nkv, hd, mode=mode)
    for c in (twin, layer):
        c.append(k[:m], v[:m])
        c.accumulate_imp(imp)
    before = snapshot(twin)

    if block:                                       # speculative appends: one block ...
        layer.append(k[m:], v[m:])
    else:                                           # ... or one position at a time
        for i in range(m, m + n):
            layer.append(k[i], v[i])
    layer.truncate_last(n)
    assert_same_state(before, snapshot(layer))

    if m:                                           # and attention agrees bit for bit
        nq = min(m, 3)
        q = rng.standard_normal((nq, 2 * nkv, hd)).astype(np.float32)
        assert np.array_equal(twin.attend_all_heads(q), layer.attend_all_heads(q))
        assert twin.importance.tobytes() == layer.importance.tobytes()
        for h in range(nkv):
            o1, p1 = twin.attend(q[-1, 0], h)
            o2, p2 = layer.attend(q[-1, 0], h)
            assert o1.tobytes() == o2.tobytes() and p1.tobytes() == p2.tobytes()


def test_views_cannot_be_made_writable_again(rng, make_kv):
    layer = kc.LayerKvCache(2, 8, mode=F32)
    layer.append(*make_kv(rng, 3, 2, 8))
    for view in (layer.head_keys(0), layer.head_values(1), layer.importance, *layer.k_heads()):
        with pytest.raises(ValueError):
            view.flags.writeable = True
        assert not view.flags.writeable
