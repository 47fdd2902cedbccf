"""The fixed-capacity caches of kvcache.latent and the rules of kvcache._slots (docs/latent.md).

KvAllocId (minting, threads, allocation-not-conversation), LatentKvCache (the upstream unit
tests in our own words, the write/advance protocol, bad input leaving the cache as it was,
dtypes), the rules StaticKvCache shares with it (dtypes, casts, replaced storages, sizes; the
rest of StaticKvCache is in test_static.py), LazyLatentCache (the upstream per-pass tests and
the functional contract).
"""

from __future__ import annotations

import copy
import gc
import pickle
import sys
import threading
import warnings
import weakref

import numpy as np
import pytest

import kvcache as kc

MLA = [[5], [2]]


# ------------------------------------------------------------------------------------ helpers
def state(cache):
    """Every observable of a persistent cache, copied (bytes of every buffer included)."""
    layers = []
    for slots in cache.layers:
        if slots is None:
            layers.append(None)
        else:
            layers.append([(s.storage.tobytes(), s.storage.shape, s.version, s.authority)
                           for s in slots])
    return {"layers": layers, "cached_len": cache.cached_len, "alloc_id": cache.alloc_id,
            "location": cache.rebind_location(), "ids": [None if s is None else
                                                         [id(x.storage) for x in s]
                                                         for s in cache.layers]}


def slabs(rng, seq, trailing=MLA, dtype=np.float32):
    return [rng.standard_normal((seq, *t)).astype(dtype) for t in trailing]


def no_ml_dtypes(monkeypatch):
    """Make ``import ml_dtypes`` fail, as on a machine without it."""
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)


# ------------------------------------------------------------------------------------ KvAllocId
def test_alloc_id_is_a_frozen_hashable_value_minted_from_one():
    a, b = kc.rebind.KvAllocId.next(), kc.rebind.KvAllocId.next()
    assert a.get() >= 1 and b.get() > a.get()
    assert a != b and a == a and hash(a) == hash(a)
    assert {a: 1, b: 2}[a] == 1
    assert copy.copy(a) is a and copy.deepcopy(a) is a
    assert repr(a) == f"KvAllocId({a.get()})"
    assert (a == a.get()) is False                    # not equal to a bare int
    with pytest.raises(AttributeError):
        a._value = 7
    with pytest.raises(TypeError, match="KvAllocId.next"):
        kc.rebind.KvAllocId(5)
    with pytest.raises(TypeError, match="pickled"):
        pickle.dumps(a)


def test_alloc_ids_are_unique_across_threads():
    n_threads, per = 8, 1000
    barrier = threading.Barrier(n_threads)
    found = [None] * n_threads

    def mint(i):
        barrier.wait()
        found[i] = [kc.rebind.KvAllocId.next().get() for _ in range(per)]

    threads = [threading.Thread(target=mint, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    values = [v for chunk in found for v in chunk]
    assert len(values) == n_threads * per
    assert len(set(values)) == n_threads * per
    assert min(values) >= 1
    for chunk in found:                               # each thread saw increasing ids
        assert chunk == sorted(chunk)
    assert kc.rebind.KvAllocId.next().get() > max(values)    # never reused


@pytest.mark.parametrize("make", [
    lambda: kc.LatentKvCache.with_capacity(2, 16, MLA),
    lambda: kc.StaticKvCache.with_capacity(2, 2, 4, 16),
], ids=["latent", "static"])
def test_alloc_id_tracks_the_allocation_not_the_conversation(make, rng):
    a, b = make(), make()
    assert a.alloc_id != b.alloc_id                   # same geometry, different allocations
    first = a.alloc_id
    for layer in range(a.n_layers):
        if isinstance(a, kc.LatentKvCache):
            a.write_layer(layer, slabs(rng, 3))
        else:
            a.write_layer(layer, np.ones((2, 3, 4)), np.ones((2, 3, 4)))
    a.advance(3)
    a.bump_version(0, 0)
    a.truncate_last(a.cached_len - 1)                       # a rewind is not a re-allocation
    assert a.alloc_id == first
    a.clear()                                         # every buffer released: new id
    assert a.alloc_id != first and a.alloc_id != b.alloc_id
    assert a.alloc_id.get() > b.alloc_id.get()


# ------------------------------------------------------------------------------------ LatentKvCache
def test_with_capacity_allocates_every_layer_zeroed_on_cpu():
    c = kc.LatentKvCache.with_capacity(3, 8, MLA, np.float32, "cpu")
    assert (c.n_layers, c.n_slots, c.cached_len, c.max_seq_len) == (3, 2, 0, 8)
    assert c.dtype == np.float32
    assert c.slot_trailing == ((5,), (2,))
    assert c.slot_shape(0) == (5,) and c.slot_shape(1) == (2,)
    assert c.rebind_location() == "cpu"
    assert len(c) == 0 and bool(c)
    assert len(c.layers) == 3
    seen = []
    for layer in range(3):
        k0, k1 = c.slot_storage(layer, 0), c.slot_storage(layer, 1)
        assert k0.nbytes == 160 and k1.nbytes == 64
        assert k0.shape == (8, 5) and k1.shape == (8, 2)
        assert k0.flags.c_contiguous and k1.flags.c_contiguous
        assert not k0.any() and not k1.any()
        for s, slot in enumerate(c.layers[layer]):
            assert isinstance(slot, kc.latent.LatentSlot)
            assert slot.storage is c.slot_storage(layer, s)
            assert slot.layout == ((8, 5) if s == 0 else (8, 2))
            assert slot.version == 0 and slot.authority == "host"
        seen += [k0, k1]
    for i, x in enumerate(seen):                      # six independent buffers
        for y in seen[i + 1:]:
            assert not np.shares_memory(x, y)
    assert "LatentKvCache(n_layers=3" in repr(c)
    assert "LatentSlot(layout=(8, 5)" in repr(c.layers[0][0])


@pytest.mark.parametrize("make", [
    lambda: kc.LatentKvCache.with_capacity(2, 8, MLA),
    lambda: kc.StaticKvCache.with_capacity(2, 2, 4, 8),
], ids=["latent", "static"])
def test_seq_len_is_a_read_only_property_equal_to_cached_len(make, rng):
    c = make()
    assert c.seq_len == c.cached_len == 0
    for layer in range(2):
        if isinstance(c, kc.LatentKvCache):
            c.write_layer(layer, slabs(rng, 3))
        else:
            c.write_layer(layer, rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 3, 4)))
    c.advance(3)
    assert c.seq_len == c.cached_len == len(c) == 3
    c.truncate_last(c.cached_len - 1)
    assert c.seq_len == 1
    with pytest.raises(AttributeError):
        c.seq_len = 2
    lazy = kc.LazyLatentCache.new(1, 8, MLA)
    assert lazy.seq_len == 0
    lazy = lazy.append(0, slabs(rng, 2)).advance_by(2)
    assert lazy.seq_len == lazy.current_seq_len == 2
    with pytest.raises(AttributeError):
        lazy.seq_len = 0


@pytest.mark.parametrize("make, axis", [
    (lambda: kc.LatentKvCache.with_capacity(3, 8, MLA), 0),
    (lambda: kc.StaticKvCache.with_capacity(3, 2, 4, 8), 2),
], ids=["latent", "static"])
def test_state_reads_storages_lengths_and_id_together(make, axis):
    c = make()
    c.advance(2)
    c.layers[1] = None
    st = c.state("sync")
    assert (st.cached_len, st.max_seq_len, st.capacity_axis) == (2, 8, axis)
    assert st.alloc_id == c.alloc_id and st.generation == c.generation
    assert st.storages[1] is None and len(st.storages) == 3
    for layer in (0, 2):
        assert all(x is c.slot_storage(layer, s) for s, x in enumerate(st.storages[layer]))
        assert all(x.shape[axis] == 8 for x in st.storages[layer])
    with pytest.warns(DeprecationWarning, match="use state"):     # the old name still reads
        assert c.slot_state("sync").storages[0][0] is st.storages[0][0]
    c.layers[2][1].storage = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match="sync: the storage of layer 2, slot 1"):
        c.state("sync")


def test_slot_storage_is_the_live_buffer_and_none_out_of_range():
    c = kc.LatentKvCache.with_capacity(3, 8, MLA)
    buf = c.slot_storage(1, 0)
    assert buf is c.slot_storage(1, 0) and buf.flags.writeable
    buf[0, 0] = 4.0                                   # the live buffer, not a copy
    assert c.layers[1][0].storage[0, 0] == 4.0
    for layer, slot in [(3, 0), (99, 0), (-1, 0), (0, 2), (0, -1), (3, 9)]:
        assert c.slot_storage(layer, slot) is None
        assert c.rebind_slot(layer, slot) is None
    assert c.rebind_slot(2, 1) is c.slot_storage(2, 1)
    with pytest.raises(TypeError, match="layer: expected an integer"):
        c.slot_storage(0.5, 0)
    with pytest.raises(TypeError, match="slot"):
        c.bump_version(0, "1")


def test_slot_shape_out_of_range_raises_index_error():
    c = kc.LatentKvCache.with_capacity(1, 8, MLA)
    for s in (2, -1):
        with pytest.raises(IndexError, match="slot"):
            c.slot_shape(s)


def test_bump_version_advances_per_slot_and_out_of_range_is_a_noop():
    c = kc.LatentKvCache.with_capacity(2, 8, MLA)
    c.bump_version(0, 0)
    c.bump_version(0, 0)
    c.bump_version(0, 1)
    for layer, slot in [(2, 0), (-1, 0), (0, 2), (0, -1), (50, 50)]:
        c.bump_version(layer, slot)
    assert [s.version for s in c.layers[0]] == [2, 1]
    assert [s.version for s in c.layers[1]] == [0, 0]
    c.clear()
    c.bump_version(0, 0)                              # unpopulated: no-op
    assert c.layers == [None, None]


@pytest.mark.parametrize("args, exc, match", [
    ((0, 8, MLA), ValueError, "n_layers must be >= 1"),
    ((3, 0, MLA), ValueError, "max_seq_len must be >= 1"),
    ((3, 8, []), ValueError, "need at least one slot"),
    ((0, 0, []), ValueError, "n_layers must be >= 1"),         # the documented order
    ((1, 0, []), ValueError, "max_seq_len must be >= 1"),
    ((-2, 8, MLA), ValueError, "n_layers must be >= 1, got -2"),
    ((3, -1, MLA), ValueError, "max_seq_len must be >= 1, got -1"),
    ((2.5, 8, MLA), TypeError, "n_layers: expected an integer"),
    (("3", 8, MLA), TypeError, "n_layers"),
    ((True, 8, MLA), TypeError, "n_layers"),
    ((3, 8.0, MLA), TypeError, "max_seq_len"),
    ((3, 8, [[-1]]), ValueError, r"slot_trailing\[0\]\[0\]: expected a dimension >= 0"),
    ((3, 8, [[5], [2.5]]), TypeError, r"slot_trailing\[1\]\[0\]"),
    ((3, 8, [5, 2]), TypeError, r"slot_trailing\[0\]: expected a sequence of ints"),
    ((3, 8, "ab"), TypeError, "slot_trailing"),
    ((3, 8, None), TypeError, "slot_trailing"),
    ((3, 8, [[2**40, 2**40]]), ValueError, "more than this platform can address"),
])
def test_with_capacity_rejects_bad_geometry(args, exc, match):
    with pytest.raises(exc, match=match):
        kc.LatentKvCache.with_capacity(*args)


@pytest.mark.parametrize("device, exc", [("cuda", ValueError), ("cpu:1", ValueError),
                                         (0, TypeError), (None, TypeError)])
def test_with_capacity_rejects_other_devices(device, exc):
    with pytest.raises(exc, match="device"):
        kc.LatentKvCache.with_capacity(1, 8, MLA, device=device)


@pytest.mark.parametrize("dtype, want", [(np.float32, np.float32), ("float16", np.float16),
                                         (np.float64, np.float64), (None, np.float32),
                                         (np.dtype("<f4"), np.float32)])
def test_float_dtypes_allocate_in_that_dtype(dtype, want):
    c = kc.LatentKvCache.with_capacity(1, 4, [[3]], dtype)
    assert c.dtype == want and c.slot_storage(0, 0).dtype == want
    assert c.slot_storage(0, 0).nbytes == 4 * 3 * np.dtype(want).itemsize


@pytest.mark.parametrize("dtype", [np.int32, np.int8, np.complex64, object, "U4", np.bool_,
                                   "not-a-dtype", np.longdouble])
def test_other_dtypes_raise_type_error(dtype):
    with pytest.raises(TypeError, match="dtype"):
        kc.LatentKvCache.with_capacity(1, 4, [[3]], dtype)
    with pytest.raises(TypeError, match="dtype"):
        kc.StaticKvCache.with_capacity(1, 1, 2, 4, dtype)


@pytest.mark.parametrize("make", [
    lambda: kc.LatentKvCache.with_capacity(1, 4, [[3]], "bfloat16"),
    lambda: kc.StaticKvCache.with_capacity(1, 1, 2, 4, "bf16"),
    lambda: kc.LazyLatentCache.new(1, 4, [[3]], "bfloat16"),
], ids=["latent", "static", "lazy"])
def test_bfloat16_without_ml_dtypes_says_to_install_it(make, monkeypatch):
    no_ml_dtypes(monkeypatch)
    with pytest.raises(TypeError, match="pip install ml_dtypes"):
        make()


def test_bfloat16_with_ml_dtypes(rng):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf16 = np.dtype(ml_dtypes.bfloat16)
    for dtype in ("bfloat16", ml_dtypes.bfloat16):
        c = kc.LatentKvCache.with_capacity(2, 8, MLA, dtype)
        assert c.dtype == bf16 and c.slot_storage(1, 0).nbytes == 80
    x = [np.arange(10, dtype=np.float32).reshape(2, 5), np.array([[0.5, -2], [3, 1]], np.float32)]
    c.write_layer(0, x)
    c.write_layer(1, [a.astype(bf16) for a in x])       # bf16 slabs are accepted as they are
    c.advance(2)
    for layer in range(2):
        view = c.valid_view(layer, 0)
        assert view.dtype == bf16 and not view.flags.writeable
        np.testing.assert_array_equal(view.astype(np.float32), x[0])
        np.testing.assert_array_equal(c.valid_view(layer, 1).astype(np.float32), x[1])
    s = kc.StaticKvCache.with_capacity(1, 2, 8, 4, "bfloat16")
    assert s.slot_storage(0, 0).nbytes == 128 and s.slot_storage(0, 1).nbytes == 128
    with pytest.raises(TypeError, match="float32"):
        s.attend(0, np.zeros((2, 8)))
    lazy = kc.LazyLatentCache.new(1, 4, [[2]], "bfloat16").append(0, [x[1]]).advance_by(2)
    np.testing.assert_array_equal(lazy.slot(0, 0).astype(np.float32), x[1])


def test_empty_trailing_is_a_per_token_scalar_slot(rng):
    c = kc.LatentKvCache.with_capacity(1, 6, [[], [3]])
    assert c.slot_storage(0, 0).shape == (6,)
    a = rng.standard_normal(4).astype(np.float32)
    b = rng.standard_normal((4, 3)).astype(np.float32)
    c.write_layer(0, [a, b])
    c.advance(4)
    np.testing.assert_array_equal(c.valid_view(0, 0), a)


def test_write_layer_and_advance_two_unequal_slots_over_two_steps(rng):
    c = kc.LatentKvCache.with_capacity(3, 8, MLA)
    first = c.alloc_id
    steps = [[slabs(rng, 2) for _ in range(3)], [slabs(rng, 1) for _ in range(3)]]
    for n, step in zip((2, 1), steps):
        for layer in range(3):
            c.write_layer(layer, step[layer])
        assert c.cached_len == (0 if n == 2 else 2)   # writing does not advance
        c.advance(n)
    assert c.cached_len == 3 and len(c) == 3 and c.alloc_id == first
    for layer in range(3):
        for s in range(2):
            want = np.concatenate([steps[0][layer][s], steps[1][layer][s]])
            view = c.valid_view(layer, s)
            assert view.shape == (3,) + c.slot_shape(s)
            np.testing.assert_array_equal(view, want)
            assert not c.slot_storage(layer, s)[3:].any()   # the tail is still zero
            assert c.layers[layer][s].version == 2         # once per advance, not per token


def test_valid_view_is_read_only_rows_up_to_cached_len(rng):
    c = kc.LatentKvCache.with_capacity(2, 8, MLA)
    assert c.valid_view(0, 0).shape == (0, 5)
    c.write_layer(0, slabs(rng, 4))
    assert c.valid_view(0, 0).shape == (0, 5)          # written but not advanced
    c.layers[1] = None                                 # a public field, as upstream
    c.advance(4)
    assert [s.version for s in c.layers[0]] == [1, 1]  # only populated slots are bumped
    view = c.valid_view(0, 1)
    assert view.shape == (4, 2) and not view.flags.writeable
    with pytest.raises(ValueError):
        view.flags.writeable = True
    with pytest.raises(IndexError):
        c.valid_view(2, 0)
    with pytest.raises(IndexError):
        c.valid_view(0, 2)
    with pytest.raises(ValueError, match="layer 1 holds no storage"):
        c.valid_view(1, 0)


def test_slabs_of_other_float_dtypes_are_cast_to_the_cache_dtype(rng):
    x64 = [rng.standard_normal((3, 5)), rng.standard_normal((3, 2))]
    c = kc.LatentKvCache.with_capacity(1, 8, MLA, np.float32)
    c.write_layer(0, x64)
    c.advance(3)
    for s in range(2):
        np.testing.assert_array_equal(c.valid_view(0, s), x64[s].astype(np.float32))
    h = kc.LatentKvCache.with_capacity(1, 8, MLA, np.float16)
    h.write_layer(0, [a.astype(np.float32) for a in x64])
    h.advance(3)
    np.testing.assert_array_equal(h.valid_view(0, 0), x64[0].astype(np.float16))
    d = kc.LatentKvCache.with_capacity(1, 8, MLA, np.float64)
    d.write_layer(0, [a.astype(np.float16) for a in x64])
    d.advance(3)
    np.testing.assert_array_equal(d.valid_view(0, 1), x64[1].astype(np.float16).astype(np.float64))
    lst = kc.LatentKvCache.with_capacity(1, 8, MLA)    # nested lists of floats are fine
    lst.write_layer(0, [a.tolist() for a in x64])
    lst.advance(3)
    np.testing.assert_array_equal(lst.valid_view(0, 0), x64[0].astype(np.float32))


def test_nan_and_inf_are_stored_as_values():
    c = kc.LatentKvCache.with_capacity(1, 4, [[2]])
    c.write_layer(0, [np.array([[np.nan, np.inf]], np.float32)])
    c.advance(1)
    v = c.valid_view(0, 0)
    assert np.isnan(v[0, 0]) and v[0, 1] == np.inf


def _filled(rng, cached=6, max_seq_len=8):
    c = kc.LatentKvCache.with_capacity(2, max_seq_len, MLA)
    for layer in range(2):
        c.write_layer(layer, slabs(rng, cached))
    c.advance(cached)
    c.bump_version(1, 1)
    return c


Z5, Z2 = np.zeros((1, 5), np.float32), np.zeros((1, 2), np.float32)


@pytest.mark.parametrize("layer, bad, exc, match", [
    (0, [Z5], ValueError, "expected 2 slabs"),
    (0, [Z5, Z2, Z2], ValueError, "expected 2 slabs"),
    (0, [], ValueError, "expected 2 slabs"),
    (0, [np.zeros((1, 4), np.float32), Z2], ValueError, r"slabs\[0\]: expected shape \(seq, 5\)"),
    (0, [Z5, np.zeros((1, 3), np.float32)], ValueError, r"slabs\[1\]: expected shape \(1, 2\)"),
    (0, [Z5, np.zeros((2, 2), np.float32)], ValueError, r"slabs\[1\].*seq=1 from slabs\[0\]"),
    (0, [np.zeros((2, 5)), Z2], ValueError, r"slabs\[1\]"),
    (0, [np.zeros(5, np.float32), Z2], ValueError, r"slabs\[0\]"),
    (0, [np.float32(1.0), Z2], ValueError, "rank >= 1"),
    (0, [np.zeros((0, 5)), np.zeros((0, 2))], ValueError, "seq >= 1"),
    (0, [np.zeros((3, 5)), np.zeros((3, 2))], ValueError, "overflow max_seq_len=8"),
    (0, [Z5.astype(np.complex64), Z2], TypeError, r"slabs\[0\]: expected real floating-point"),
    (0, [Z5, Z2.astype(np.int32)], TypeError, r"slabs\[1\].*int32"),
    (0, [Z5, Z2.astype(bool)], TypeError, r"slabs\[1\]"),
    (0, [Z5, np.full((1, 2), None, object)], TypeError, r"slabs\[1\]"),
    (0, [Z5, np.full((1, 2), "x")], TypeError, r"slabs\[1\]"),
    (0, [[[1, 2, 3, 4, 5]], [[1, 2]]], TypeError, "int64"),
    (0, [[[1.0, 2.0], [3.0]], Z2], ValueError, "rectangular"),
    (0, np.zeros((2, 1, 5), np.float32), TypeError, "sequence of arrays"),
    (0, 3, TypeError, "sequence of arrays"),
    (2, [Z5, Z2], IndexError, "layer"),
    (-1, [Z5, Z2], IndexError, "layer"),
    ("0", [Z5, Z2], TypeError, "layer"),
])
def test_bad_write_raises_and_writes_nothing(rng, layer, bad, exc, match):
    c = _filled(rng)
    before = state(c)
    with pytest.raises(exc, match=match):
        c.write_layer(layer, bad)
    assert state(c) == before


@pytest.mark.parametrize("seq, exc", [(0, ValueError), (-1, ValueError), (3, ValueError),
                                      (1.5, TypeError), (None, TypeError)])
def test_bad_advance_changes_nothing(rng, seq, exc):
    c = _filled(rng)
    before = state(c)
    with pytest.raises(exc):
        c.advance(seq)
    assert state(c) == before
    c.advance(2)                                       # exactly to capacity is fine
    assert c.cached_len == 8


def test_truncate_last_is_metadata_only_and_keeps_the_id(rng):
    c = kc.LatentKvCache.with_capacity(2, 16, MLA)
    for layer in range(2):
        c.write_layer(layer, slabs(rng, 15))
    c.advance(15)
    before = state(c)
    c.truncate_last(0)
    assert state(c) == before                          # nothing dropped: a no-op
    c.truncate_last(5)
    after = state(c)
    assert c.cached_len == 10 and after["alloc_id"] == before["alloc_id"]
    assert after["layers"] == before["layers"]         # bytes and versions untouched
    assert c.valid_view(0, 0).shape == (10, 5)
    new = slabs(rng, 2)
    c.write_layer(0, new)                              # the stale rows are overwritten
    c.write_layer(1, new)
    c.advance(2)
    np.testing.assert_array_equal(c.valid_view(0, 0)[10:], new[0])
    c.truncate_last(100)                               # more than it holds: empty
    assert c.cached_len == 0 and state(c)["alloc_id"] == before["alloc_id"]
    with pytest.raises(ValueError, match="n"):
        c.truncate_last(-1)
    with pytest.raises(TypeError):
        c.truncate_last(2.0)


@pytest.mark.parametrize("make", ["latent", "static"])
def test_truncate_to_is_a_deprecated_absolute_truncate_last(make, rng):
    if make == "latent":
        c = kc.LatentKvCache.with_capacity(1, 16, MLA)
        c.write_layer(0, slabs(rng, 6))
    else:
        c = kc.StaticKvCache.with_capacity(1, 2, 4, 16)
        c.write_layer(0, np.ones((2, 6, 4)), np.ones((2, 6, 4)))
    c.advance(6)
    aid, name = c.alloc_id, type(c).__name__
    msg = rf"kvcache\.{name}\.truncate_to\(new_len\) is deprecated; use truncate_last"
    with pytest.warns(DeprecationWarning, match=msg):
        c.truncate_to(9)                               # never grows
    assert c.cached_len == 6
    with pytest.warns(DeprecationWarning, match=msg):
        c.truncate_to(4)                               # = truncate_last(2)
    assert c.cached_len == 4 and c.alloc_id == aid
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="new_len"):
        c.truncate_to(-1)
    assert c.cached_len == 4


def test_clear_releases_the_layers_reminted_and_keeps_the_location(rng):
    c = _filled(rng)
    first = c.alloc_id
    c.clear()
    assert c.layers == [None, None] and c.n_layers == 2 and c.cached_len == 0
    assert c.alloc_id != first
    assert c.rebind_location() == "cpu"               # kept: a re-bind sees MISSING_SLOT
    assert c.slot_storage(0, 0) is None and c.rebind_slot(1, 1) is None
    assert c.slot_shape(1) == (2,) and c.n_slots == 2
    before = state(c)
    with pytest.raises(ValueError, match="cleared"):
        c.write_layer(0, [Z5, Z2])
    with pytest.raises(ValueError, match="cleared"):
        c.advance(1)
    assert state(c) == before


def test_latent_and_lazy_caches_hold_byte_identical_buffers(rng):
    c = kc.LatentKvCache.with_capacity(2, 8, MLA)
    lazy = kc.LazyLatentCache.new(2, 8, MLA)
    for n in (3, 1, 2):
        for layer in range(2):
            x = slabs(rng, n)
            c.write_layer(layer, x)
            lazy = lazy.append(layer, x)
        c.advance(n)
        lazy = lazy.advance_by(n)
    assert lazy.current_seq_len == c.cached_len == 6
    for layer in range(2):
        for s in range(2):
            assert lazy.slot_buffer_full(layer, s).tobytes() == c.slot_storage(layer, s).tobytes()


# ---------------------------------------------------------------------------- LazyLatentCache
def test_lazy_empty_cache_accessors():
    c = kc.LazyLatentCache.new(2, 8, MLA)
    assert (c.current_seq_len, c.max_seq_len, c.n_layers, c.n_slots) == (0, 8, 2, 2)
    assert c.slot_trailing == ((5,), (2,)) and c.slot_shape(1) == (2,)
    assert c.dtype == np.float32 and len(c) == 0 and bool(c)
    s = c.slot(1, 0)
    assert s.shape == (1, 5) and not s.any() and not s.flags.writeable   # clamped to >= 1 row
    full = c.slot_buffer_full(0, 1)
    assert full.shape == (8, 2) and not full.any() and not full.flags.writeable
    with pytest.raises(IndexError):
        c.slot_shape(2)
    assert "LazyLatentCache(n_layers=2" in repr(c)
    assert kc.LazyLatentCache(2, 8, MLA).slot_trailing == c.slot_trailing


def test_lazy_mla_two_unequal_slots_over_two_steps(rng):
    c = kc.LazyLatentCache.new(1, 8, MLA)
    a, b = slabs(rng, 2), slabs(rng, 1)
    c = c.append(0, a)
    assert c.current_seq_len == 0                       # append does not advance
    np.testing.assert_array_equal(c.slot_buffer_full(0, 0)[:2], a[0])
    c = c.advance_by(2).append(0, b).advance_by(1)
    assert c.current_seq_len == 3
    for s in range(2):
        np.testing.assert_array_equal(c.slot(0, s), np.concatenate([a[s], b[s]]))


def test_lazy_single_slot_rank3_trailing(rng):
    c = kc.LazyLatentCache.new(1, 6, [[2, 3, 4]])
    x = rng.standard_normal((2, 2, 3, 4)).astype(np.float32)
    c = c.append(0, [x]).advance_by(2)
    assert c.slot(0, 0).shape == (2, 2, 3, 4)
    np.testing.assert_array_equal(c.slot(0, 0), x)
    assert c.slot_buffer_full(0, 0).shape == (6, 2, 3, 4)


def test_lazy_multi_layer_isolation_with_one_advance_per_step(rng):
    c = kc.LazyLatentCache.new(3, 8, MLA)
    written = {layer: [] for layer in range(3)}
    for n in (3, 2):
        for layer in range(3):
            x = slabs(rng, n)
            written[layer].append(x)
            c = c.append(layer, x)
        c = c.advance_by(n)
    assert c.current_seq_len == 5
    for layer in range(3):
        for s in range(2):
            np.testing.assert_array_equal(
                c.slot(layer, s), np.concatenate([w[s] for w in written[layer]]))


def test_lazy_is_functional(rng):
    c0 = kc.LazyLatentCache.new(2, 8, MLA)
    x = slabs(rng, 2)
    c1 = c0.append(1, x)
    assert c1 is not c0
    assert not c0.slot_buffer_full(1, 0).any() and c0.current_seq_len == 0   # untouched
    c2 = c1.advance_by(2)
    assert c1.current_seq_len == 0 and c2.current_seq_len == 2
    np.testing.assert_array_equal(c2.slot(1, 1), x[1])
    c3 = c2.append(1, slabs(rng, 1))                   # a branch does not disturb c2
    np.testing.assert_array_equal(c2.slot_buffer_full(1, 0)[2], np.zeros(5))
    assert c3.slot_buffer_full(1, 0)[2].any()
    with pytest.raises(ValueError):
        c2.slot(1, 0).flags.writeable = True
    assert c2.append(0, [np.zeros((0, 5)), np.zeros((0, 2))]).current_seq_len == 2   # 0 rows


def test_lazy_advance_by_clamps_to_capacity():
    c = kc.LazyLatentCache.new(1, 4, [[1]])
    assert c.advance_by(3).advance_by(5).current_seq_len == 4
    assert c.advance_by(0).current_seq_len == 0
    with pytest.raises(ValueError, match="n"):
        c.advance_by(-1)


@pytest.mark.parametrize("layer, bad, exc, match", [
    (2, [Z5, Z2], IndexError, "layer"),
    (-1, [Z5, Z2], IndexError, "layer"),
    (0, [Z5], ValueError, "expected 2 slabs"),
    (0, [np.float32(0.0), Z2], ValueError, "rank >= 1"),
    (0, [np.zeros((1, 4)), Z2], ValueError, r"new_slots\[0\]: expected shape \(seq, 5\)"),
    (0, [Z5, np.zeros((1, 3))], ValueError, r"new_slots\[1\]"),
    (0, [np.zeros((2, 5)), np.zeros((1, 2))], ValueError, r"new_slots\[1\].*seq=2"),
    (0, [np.zeros((4, 5)), np.zeros((4, 2))], ValueError, "overflow max_seq_len=8"),
    (0, [Z5.astype(np.int16), Z2], TypeError, r"new_slots\[0\]"),
    (0, [Z5, Z2.astype(np.complex64)], TypeError, r"new_slots\[1\]"),
])
def test_lazy_append_rejections(rng, layer, bad, exc, match):
    c = kc.LazyLatentCache.new(2, 8, MLA).append(0, slabs(rng, 5)).advance_by(5)
    before = [c.slot_buffer_full(la, s).tobytes() for la in range(2) for s in range(2)]
    with pytest.raises(exc, match=match):
        c.append(layer, bad)
    assert c.current_seq_len == 5
    assert [c.slot_buffer_full(la, s).tobytes() for la in range(2) for s in range(2)] == before


@pytest.mark.parametrize("args, exc, match", [
    ((0, 8, MLA), ValueError, "n_layers must be >= 1"),
    ((1, 0, MLA), ValueError, "max_seq_len must be >= 1"),
    ((1, 8, []), ValueError, "need at least one slot"),
    ((1, 8, MLA, np.int32), TypeError, "unsupported dtype"),
    ((1, 8, MLA, np.complex128), TypeError, "unsupported dtype"),
])
def test_lazy_new_rejections(args, exc, match):
    with pytest.raises(exc, match=match):
        kc.LazyLatentCache.new(*args)


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_lazy_other_float_dtypes(rng, dtype):
    x = slabs(rng, 2)
    c = kc.LazyLatentCache.new(1, 4, MLA, dtype).append(0, x).advance_by(2)
    assert c.slot(0, 0).dtype == dtype
    np.testing.assert_array_equal(c.slot(0, 0), x[0].astype(dtype))


# ------------------------------------------------------ review 5: writes, storages, sizes
def _f16_pair(kind):
    """A float16 cache and a bad write whose second half overflows float16 (1e6 > 65504)."""
    if kind == "latent":
        c = kc.LatentKvCache.with_capacity(2, 4, [[2], [2]], np.float16)
        c.write_layer(0, [np.full((1, 2), 0.5), np.full((1, 2), 0.25)])
        c.advance(1)
        return c, lambda: c.write_layer(0, [np.ones((1, 2)), np.full((1, 2), 1e6)])
    c = kc.StaticKvCache.with_capacity(2, 1, 2, 4, np.float16)
    c.write_layer(0, np.full((1, 1, 2), 0.5), np.full((1, 1, 2), 0.25))
    c.advance(1)
    return c, lambda: c.write_layer(0, np.ones((1, 1, 2)), np.full((1, 1, 2), 1e6))


@pytest.mark.parametrize("kind", ["latent", "static"])
@pytest.mark.parametrize("mode", ["errstate", "warnings"])
def test_write_whose_cast_raises_writes_nothing(kind, mode):
    """B2: the cast into the cache dtype happens before the first slot is written, so an
    overflow made fatal by np.errstate or by warnings-as-errors leaves slot 0 / K untouched."""
    c, bad = _f16_pair(kind)
    before = state(c)
    if mode == "errstate":
        with np.errstate(over="raise"), pytest.raises(FloatingPointError, match="overflow"):
            bad()
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(RuntimeWarning, match="overflow"):
                bad()
    assert state(c) == before
    with np.errstate(over="ignore"):                   # the default policy: IEEE inf, stored
        bad()
    assert np.isinf(c.slot_storage(0, 1)[..., 1, :] if kind == "static"
                    else c.slot_storage(0, 1)[1]).all()


@pytest.mark.parametrize("kind", ["latent", "static"])
def test_slab_that_views_another_slot_is_read_before_the_write(kind):
    """A slab aliasing a storage this call writes reads the values it had at the call."""
    if kind == "latent":
        c = kc.LatentKvCache.with_capacity(1, 4, [[2], [2]])
        c.write_layer(0, [np.full((2, 2), 3.0), np.zeros((2, 2))])
        c.advance(1)                                   # row 1 of slot 0 holds 3.0, is stale
        old = c.slot_storage(0, 0)[1:2]                # the very rows about to be overwritten
        c.write_layer(0, [np.full((1, 2), 9.0), old])
        c.advance(1)
        np.testing.assert_array_equal(c.valid_view(0, 0)[1], [9, 9])
        np.testing.assert_array_equal(c.valid_view(0, 1)[1], [3, 3])
    else:
        c = kc.StaticKvCache.with_capacity(1, 1, 2, 4)
        c.write_layer(0, np.full((1, 2, 2), 3.0), np.zeros((1, 2, 2)))
        c.advance(1)
        old = c.slot_storage(0, 0)[:, :, 1:2]
        c.write_layer(0, np.full((1, 1, 2), 9.0), old)
        c.advance(1)
        np.testing.assert_array_equal(c.valid_view(0, 0)[0, 0, 1], [9, 9])
        np.testing.assert_array_equal(c.valid_view(0, 1)[0, 0, 1], [3, 3])


def _replacements(shape):
    n = int(np.prod(shape))
    return [
        ("tiny", np.zeros((1,) * (len(shape) - 1) + (shape[-1],), np.float32), "has shape"),
        ("rank", np.zeros(n, np.float32), "has shape"),
        ("float64", np.zeros(shape, np.float64), "has dtype float64"),
        ("strided", np.zeros(shape[:-1] + (2 * shape[-1],), np.float32)[..., ::2],
         "not C-contiguous"),
        ("list", np.zeros(shape, np.float32).tolist(), "not a numpy array"),
        ("none", None, "NoneType"),
    ]


@pytest.mark.parametrize("which", [0, 1], ids=["K", "V"])
@pytest.mark.parametrize("case", range(6), ids=[r[0] for r in _replacements((1, 2, 3))])
def test_static_replaced_storage_raises_instead_of_reading_out_of_bounds(rng, which, case):
    """B3: attend hands the storage to the compiled kernel, which trusts its shape; a
    replaced buffer (here K or V of a cache with 4096 rows) must raise, not crash."""
    c = kc.StaticKvCache.with_capacity(2, 2, 16, 64)
    for layer in range(2):
        c.write_layer(layer, rng.standard_normal((2, 64, 16)), rng.standard_normal((2, 64, 16)))
    c.advance(64)
    name, bad, match = _replacements((1, 2, 64, 16))[case]
    c.layers[1][which].storage = bad
    good = c.attend(0, np.ones((4, 16)))               # layer 0 is untouched and still works
    assert np.isfinite(good).all()
    msg = rf"attend: the storage of layer 1, slot {which} .*{match}"
    with pytest.raises(ValueError, match=msg):
        c.attend(1, np.ones((4, 16)))
    with pytest.raises(ValueError, match=rf"valid_view: the storage of layer 1, slot {which}"):
        c.valid_view(1, which)
    c.valid_view(1, 1 - which)                          # the other half is fine
    c.truncate_last(c.cached_len - 10)
    other = c.layers[1][1 - which].storage.copy()
    with pytest.raises(ValueError, match=rf"write_layer: the storage of layer 1, slot {which}"):
        c.write_layer(1, np.ones((2, 1, 16)), np.ones((2, 1, 16)))
    np.testing.assert_array_equal(c.layers[1][1 - which].storage, other)   # no half write


@pytest.mark.parametrize("case", range(6), ids=[r[0] for r in _replacements((1, 2, 3))])
def test_latent_replaced_storage_raises_and_writes_nothing(rng, case):
    c = _filled(rng)
    name, bad, match = _replacements((8, 2))[case]
    c.layers[1][1].storage = bad
    before = [s.storage.tobytes() for s in c.layers[1][:1]] + [c.cached_len]
    with pytest.raises(ValueError, match=rf"write_layer: the storage of layer 1, slot 1 .*{match}"):
        c.write_layer(1, slabs(rng, 1))
    assert [s.storage.tobytes() for s in c.layers[1][:1]] + [c.cached_len] == before
    with pytest.raises(ValueError, match="valid_view: the storage of layer 1, slot 1"):
        c.valid_view(1, 1)
    assert c.valid_view(1, 0).shape == (6, 5)
    c.write_layer(0, slabs(rng, 1))                    # another layer is unaffected


def test_read_only_or_missing_slots_raise_before_a_write(rng):
    c = _filled(rng)
    ro = c.layers[0][1].storage.copy()
    ro.flags.writeable = False
    c.layers[0][1].storage = ro
    before = c.layers[0][0].storage.tobytes()
    with pytest.raises(ValueError, match="slot 1 is read-only"):
        c.write_layer(0, slabs(rng, 1))
    assert c.layers[0][0].storage.tobytes() == before
    assert c.valid_view(0, 1).shape == (6, 2)          # reading a read-only buffer is fine
    c.layers[1] = c.layers[1][:1]                      # a layer that lost a slot
    with pytest.raises(ValueError, match=r"layer 1 holds 1 slots, expected a list of 2"):
        c.write_layer(1, slabs(rng, 1))
    s = kc.StaticKvCache.with_capacity(1, 1, 2, 4)
    s.layers[0] = "KV"
    with pytest.raises(ValueError, match="layer 0 holds a str"):
        s.write_layer(0, np.ones((1, 1, 2)), np.ones((1, 1, 2)))


def test_latent_slot_needs_an_array():
    for bad in (None, [[0.0]], 3.0):
        with pytest.raises(TypeError, match="LatentSlot: storage must be a numpy array"):
            kc.latent.LatentSlot(bad)
    slot = kc.latent.LatentSlot(np.zeros((4, 2), np.float32))
    assert slot.layout == (4, 2) and slot.version == 0 and slot.authority == "host"


@pytest.mark.parametrize("make", [
    lambda: kc.LatentKvCache.with_capacity(2**31, 1, [[1]]),
    lambda: kc.LatentKvCache.with_capacity(2**40, 1, [[0]]),       # empty buffers, 2**40 objects
    lambda: kc.StaticKvCache.with_capacity(2**31, 1, 1, 1),
    lambda: kc.LazyLatentCache.new(2**33, 1, [[1]]),
    lambda: kc.LazyLatentCache.new(2**40, 1, [[0]]),
], ids=["latent", "latent-empty", "static", "lazy", "lazy-empty"])
def test_huge_n_layers_is_refused_before_allocating(make):
    """B4: the total (n_layers x buffers, plus ~200 B of objects per buffer) is bounded by the
    machine's memory before the first buffer exists."""
    import tracemalloc
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=r"geometry: \d+ layers .* more than this machine's"):
            make()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20          # refused before any buffer or per-layer object was made


def test_total_size_bound_counts_buffers_and_objects(monkeypatch):
    import kvcache._slots as latent
    monkeypatch.setattr(latent, "_memory_limit", lambda: 10_000)
    # 10 layers x (8*4*4 + 200) = 3280 bytes: fine; 40 layers = 13120: refused
    assert kc.LatentKvCache.with_capacity(10, 8, [[4]]).n_layers == 10
    for make in (lambda n: kc.LatentKvCache.with_capacity(n, 8, [[4]]),
                 lambda n: kc.LazyLatentCache.new(n, 8, [[4]])):
        make(10)
        with pytest.raises(ValueError, match="40 layers of 1 buffer.*13120 bytes.*10000 bytes"):
            make(40)
    # two buffers per StaticKvCache layer: 5 x 2 x (1*8*4*4 + 200) = 3280; 20 layers = 13120
    kc.StaticKvCache.with_capacity(5, 1, 4, 8)
    with pytest.raises(ValueError, match="20 layers of 2 buffer"):
        kc.StaticKvCache.with_capacity(20, 1, 4, 8)
    with pytest.raises(ValueError, match="address"):   # one unaddressable buffer says so first
        kc.LatentKvCache.with_capacity(1, 8, [[2**40, 2**40]])


def test_memory_limit_is_physical_memory_or_2_48(monkeypatch):
    import os

    import kvcache._slots as latent
    if hasattr(os, "sysconf"):
        try:
            want = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            want = 2**48
        assert latent._memory_limit() == (want if want > 0 else 2**48)

    def no_sysconf(name):
        raise ValueError(name)

    monkeypatch.setattr(os, "sysconf", no_sysconf, raising=False)
    assert latent._memory_limit() == 2**48


@pytest.mark.parametrize("make", [
    lambda: kc.LatentKvCache.with_capacity(2, 8, MLA),
    lambda: kc.StaticKvCache.with_capacity(2, 2, 4, 8),
], ids=["latent", "static"])
def test_clear_releases_the_storages(make):
    """clear() drops the cache's references: once the caller's own are gone, the buffers die
    (a view the caller kept holds its buffer alive until it is dropped too)."""
    c = make()
    refs = [weakref.ref(c.slot_storage(layer, s)) for layer in range(2) for s in range(2)]
    view = c.valid_view(0, 0)
    gc.collect()
    assert all(r() is not None for r in refs)          # held by the cache
    c.clear()
    assert [r() is None for r in refs] == [False, True, True, True]   # the view holds (0, 0)
    del view
    gc.collect()
    assert [r() for r in refs] == [None] * 4
