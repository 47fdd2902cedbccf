"""The row stores a LayerKvCache holds for K and for V (kvcache._stores): one protocol for every
storage kind, each kind storing what the layer stored before it had them."""

from __future__ import annotations

import numpy as np
import pytest

import kvcache as kc
from kvcache import _stores, quant
from kvcache.modes import MODE_NAMES
from kvcache._stores import F32Rows, K4Rows, Q8Rows, V4Rows

MODES = ["f32", "q8", "q8k", "q8v", "q8:cmf", "q8k:cmf", "q8v:cmf"]


@pytest.mark.parametrize("name", MODES)
def test_a_layer_holds_the_kind_of_its_mode(name):
    mode = kc.KvMode.parse(name)
    layer = kc.LayerKvCache(2, 40, mode=mode)
    for store, quantised in ((layer._k, mode.quant_k), (layer._v, mode.quant_v)):
        assert isinstance(store, Q8Rows if quantised else F32Rows)
        assert store.quantised == quantised
        assert store.freezes == (quantised and mode.freezes_columns)
    assert layer._k.row_bytes == quant.k_row_bytes(40, mode.quant_k,
                                                   scheme=mode.scheme or "rows")
    assert layer._v.row_bytes == quant.v_row_bytes(40, mode.quant_v)
    if mode.quant_k:
        assert layer._k.group == quant.k_group(mode.scheme)
        assert layer._k.s.shape[2] == quant.k_scale_count(40, mode.scheme)
    if mode.quant_v:
        assert layer._v.group == 40 and layer._v.s.shape[2] == 1


@pytest.mark.parametrize("kind", ["f32", "q8"])
def test_grown_copies_the_used_rows_and_leaves_the_store_as_it_was(rng, kind):
    nkv, hd = 3, 16
    st = F32Rows(nkv, hd, 4 * hd) if kind == "f32" else Q8Rows(nkv, hd, hd + 4, 16, False)
    st = st.grown(8, 0)
    lengths = np.zeros(nkv, dtype=np.intp)
    x = rng.standard_normal((5, nkv, hd)).astype(np.float32)
    st.write(x, np.ones(nkv, np.uint8), lengths)
    before = {n: getattr(st, n).copy() for n in st._names}
    big = st.grown(32, 5)
    assert big.capacity == 32 and st.capacity == 8
    for n in st._names:               # bytes: the rows past 5 are uninitialised (maybe NaN)
        assert getattr(big, n)[:, :5].tobytes() == before[n][:, :5].tobytes(), n
        assert getattr(st, n).tobytes() == before[n].tobytes(), n     # the old store unchanged
    assert big.col is st.col and big.col_on is st.col_on


@pytest.mark.parametrize("kind", ["f32", "q8"])
def test_shift_keeps_or_drops_a_heads_rows(rng, kind):
    nkv, hd = 2, 8
    st = F32Rows(nkv, hd, 4 * hd) if kind == "f32" else Q8Rows(nkv, hd, hd + 4, hd, False)
    st = st.grown(16, 0)
    st.write(rng.standard_normal((10, nkv, hd)).astype(np.float32), np.ones(nkv, np.uint8),
             np.zeros(nkv, dtype=np.intp))
    rows = {n: getattr(st, n)[1, :10].copy() for n in st._names}
    st.shift(1, 10, keep_idx=np.array([0, 3, 7], dtype=np.intp))
    for n in st._names:
        assert np.array_equal(getattr(st, n)[1, :3], rows[n][[0, 3, 7]]), n
    head0 = {n: getattr(st, n)[0, :10].copy() for n in st._names}
    st.shift(0, 10, drop=4)
    for n in st._names:
        assert np.array_equal(getattr(st, n)[0, :6], head0[n][4:]), n


@pytest.mark.parametrize("name", MODES)
def test_export_and_from_state_round_trip(rng, name):
    layer = kc.LayerKvCache(2, 16, mode=name)
    for _ in range(3):
        layer.append(rng.standard_normal((40, 2, 16)).astype(np.float32),
                     rng.standard_normal((40, 2, 16)).astype(np.float32))
    state = layer.state().owned_copy()
    k, v = _stores.from_state(state)
    for mine, theirs in ((layer._k, k), (layer._v, v)):
        assert type(mine) is type(theirs) and mine.row_bytes == theirs.row_bytes
        for n in mine._names:               # every byte (rows past a head's length included)
            assert getattr(mine, n).tobytes() == getattr(theirs, n).tobytes(), n
        assert np.array_equal(mine.col, theirs.col)
        assert np.array_equal(mine.col_on, theirs.col_on)
    frozen = kc.KvMode.parse(name).freezes_columns
    assert bool(layer._k.col_on.any() or layer._v.col_on.any()) == frozen


def test_arrays_and_int8_access_by_kind(rng):
    f = F32Rows(1, 4, 16).grown(4, 0)
    q = Q8Rows(1, 4, 8, 4, False).grown(4, 0)
    x = rng.standard_normal((2, 1, 4)).astype(np.float32)
    for st in (f, q):
        st.write(x, np.ones(1, np.uint8), np.zeros(1, dtype=np.intp))
    assert list(f.arrays()) == ["f"] and f.arrays()["f"] is f.f
    assert np.array_equal(f.values(0, 2), x[:, 0])
    assert list(q.arrays()) == ["q", "s"] and q.arrays()["q"] is q.q
    codes, scales = q.int8(0, 2)
    assert codes.shape == (2, 4) and scales.shape == (2, 1)
    assert f.frozen_col() is None and q.frozen_col() is None


@pytest.mark.parametrize("name", MODE_NAMES)
def test_each_kind_describes_its_arrays(rng, name):
    """The layout that the state's checks, the byte formats and the prefix store's entries read
    is what the store holds: names, dtypes, widths, rows for a capacity; the rows a byte format
    carries per head; the kernels' descriptor and the state take the same arrays."""
    mode = kc.KvMode.parse(name)
    layer = kc.LayerKvCache(2, 16, mode=mode)
    layer.append(rng.standard_normal((70, 2, 16)).astype(np.float32),
                 rng.standard_normal((70, 2, 16)).astype(np.float32))
    for c, st in (("k", layer._k), ("v", layer._v)):
        bits = mode.k_bits if c == "k" else mode.v_bits
        want = {32: F32Rows, 8: Q8Rows, 4: K4Rows if c == "k" else V4Rows}[bits]
        assert type(st) is want is _stores.kind_of(c, mode)
        spec = _stores.spec_of(c, mode, 16)
        assert spec.kind is want and spec.parts == st.layout()
        assert spec.row_bytes == st.row_bytes and spec.group == st.group
        cap = st.capacity
        assert {p.name for p in spec.carried} == set(st._names) - ({"r"} if want is K4Rows
                                                                     else set())
        for part in spec.parts:
            arr = getattr(st, part.name)
            assert arr.dtype == part.dtype and arr.shape == (2, part.rows(cap), part.width)
            assert part.halves == (want is F32Rows)
        sel = spec.head_rows(70)
        assert len(sel) == len(spec.parts)
        for part, rows in zip(spec.parts, sel):
            taken = getattr(st, part.name)[0, rows]
            # 4-bit K: the two closed blocks' codes and parameters, the ring's last 64 rows
            want_rows = {"c": 64, "p": 2, "r": 64}[part.name] if want is K4Rows else 70
            assert taken.shape[0] == want_rows, part.name
    state = layer.state()
    assert set(state.stores()) == {c + n for c, st in (("k", layer._k), ("v", layer._v))
                                   for n in st._names}
    rows = layer._rows()
    assert (rows.quant_k, rows.quant_v, rows.k4, rows.v4) == (mode.quant_k, mode.quant_v,
                                                              mode.k4, mode.v4)


def test_a_spec_allocates_nothing():
    """A kind's description is had without storage (a reader checks a buffer's geometry
    with it before allocating anything): 4-bit K's ring at head_dim 2**20 would be 256 MiB."""
    import tracemalloc
    tracemalloc.start()
    try:
        _stores.spec_of.cache_clear()
        spec = _stores.spec_of("k", kc.KvMode.parse("q4"), 1 << 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert spec.kind is K4Rows and spec.parts[2].rows(0) == 64
    assert peak < 1 << 20, peak
    with pytest.raises(ValueError, match="multiple of 8"):
        _stores.spec_of("v", kc.KvMode.parse("q4"), 12)
