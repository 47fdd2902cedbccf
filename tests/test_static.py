"""StaticKvCache (kvcache.static): layout and argument order, write/advance, bad input leaving
the cache as it was, truncate and clear, and grouped attention against the NumPy twin, a
LayerKvCache holding the same rows and a plain softmax.  The rules it shares with LatentKvCache
(alloc ids, dtypes, replaced storages, sizes) are tested with it in test_latent.py.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import kvcache as kc
from kvcache import reference
from test_latent import state  # the shared snapshot of a persistent cache


# ------------------------------------------------------------------------------------ StaticKvCache
def test_static_cache_layout_zeroed_k_and_v():
    c = kc.StaticKvCache.with_capacity(2, 4, 16, 32)
    assert (c.n_layers, c.num_kv_heads, c.max_seq_len, c.head_dim, c.n_slots) == (2, 4, 32, 16, 2)
    assert c.dtype == np.float32 and c.cached_len == 0 and c.device_location == "cpu"
    for layer in range(2):
        k, v = c.slot_storage(layer, 0), c.slot_storage(layer, 1)
        assert k.shape == v.shape == (1, 4, 32, 16)
        assert k.nbytes == v.nbytes == 8192 and k.flags.c_contiguous
        assert not k.any() and not v.any() and not np.shares_memory(k, v)
        assert k is c.layers[layer][0].storage and v is c.rebind_slot(layer, 1)
        assert [s.version for s in c.layers[layer]] == [0, 0]
        assert c.layers[layer][0].authority == "host"
    for layer, slot in [(2, 0), (-1, 0), (0, 2), (0, -1)]:
        assert c.slot_storage(layer, slot) is None and c.rebind_slot(layer, slot) is None
    c.bump_version(0, 1)
    c.bump_version(0, 1)
    c.bump_version(0, 5)
    assert [s.version for s in c.layers[0]] == [0, 2]
    assert "StaticKvCache(n_layers=2, num_kv_heads=4" in repr(c)


def test_static_cache_argument_order_is_kvcaches():
    # (n_layers, num_kv_heads, head_dim, max_seq_len), as KvCache: storage is (1, nkv, max, hd)
    c = kc.StaticKvCache.with_capacity(2, 3, 64, 8)
    assert c.num_kv_heads == 3 and c.head_dim == 64 and c.max_seq_len == 8
    assert c.layers[0][0].storage.shape == (1, 3, 8, 64)
    assert kc.StaticKvCache(2, 3, 64, 8).layers[1][1].storage.shape == (1, 3, 8, 64)


@pytest.mark.parametrize("args, exc, match", [
    ((0, 2, 4, 8), ValueError, "n_layers must be >= 1"),
    ((1, 0, 4, 8), ValueError, "num_kv_heads must be >= 1"),
    ((1, 2, 4, 0), ValueError, "max_seq_len must be >= 1"),
    ((1, 2, 0, 8), ValueError, "head_dim must be >= 1"),
    ((1, 2, -4, 8), ValueError, "head_dim must be >= 1"),
    ((1, 2.0, 4, 8), TypeError, "num_kv_heads"),
    ((1, 2**31, 2**31, 2**31), ValueError, "address"),
])
def test_static_cache_rejects_bad_geometry(args, exc, match):
    with pytest.raises(exc, match=match):
        kc.StaticKvCache.with_capacity(*args)


def test_static_write_layer_both_shapes_two_steps(rng):
    c = kc.StaticKvCache.with_capacity(2, 2, 4, 8)
    k1, v1 = rng.standard_normal((2, 2, 3, 4)), rng.standard_normal((2, 2, 3, 4))
    for layer in range(2):
        c.write_layer(layer, k1[layer][None], v1[layer][None])   # (1, nkv, seq, hd)
    c.advance(3)
    k2, v2 = rng.standard_normal((2, 2, 1, 4)), rng.standard_normal((2, 2, 1, 4))
    for layer in range(2):
        c.write_layer(layer, k2[layer], v2[layer])               # (nkv, seq, hd)
    assert c.cached_len == 3
    c.advance(1)
    for layer in range(2):
        k = c.valid_view(layer, 0)
        assert k.shape == (1, 2, 4, 4) and not k.flags.writeable
        np.testing.assert_array_equal(
            k[0], np.concatenate([k1[layer], k2[layer]], axis=1).astype(np.float32))
        np.testing.assert_array_equal(
            c.valid_view(layer, 1)[0],
            np.concatenate([v1[layer], v2[layer]], axis=1).astype(np.float32))
        assert not c.slot_storage(layer, 0)[:, :, 4:].any()
        assert [s.version for s in c.layers[layer]] == [2, 2]
    with pytest.raises(IndexError):
        c.valid_view(0, 2)


def _static_filled(rng):
    c = kc.StaticKvCache.with_capacity(2, 2, 4, 8)
    for layer in range(2):
        c.write_layer(layer, rng.standard_normal((2, 6, 4)), rng.standard_normal((2, 6, 4)))
    c.advance(6)
    return c


K1 = np.zeros((2, 1, 4), np.float32)


@pytest.mark.parametrize("layer, k, v, exc, match", [
    (0, K1, np.zeros((2, 2, 4)), ValueError, r"v: expected shape \(1, 2, 1, 4\)"),
    (0, np.zeros((3, 1, 4)), K1, ValueError, r"k: expected shape \(1, 2, seq, 4\)"),
    (0, K1, np.zeros((2, 1, 5)), ValueError, "v: expected shape"),
    (0, np.zeros((2, 1, 2, 1, 4)), K1, ValueError, "k: expected shape"),
    (0, np.zeros((2, 0, 4)), np.zeros((2, 0, 4)), ValueError, "seq >= 1"),
    (0, np.zeros((2, 3, 4)), np.zeros((2, 3, 4)), ValueError, "overflow max_seq_len=8"),
    (0, K1.astype(np.int64), K1, TypeError, "k: expected real floating-point"),
    (0, K1, K1.astype(np.complex128), TypeError, "v: expected real floating-point"),
    (2, K1, K1, IndexError, "layer"),
])
def test_static_bad_write_raises_and_writes_nothing(rng, layer, k, v, exc, match):
    c = _static_filled(rng)
    before = state(c)
    with pytest.raises(exc, match=match):
        c.write_layer(layer, k, v)
    assert state(c) == before


def test_static_truncate_and_clear(rng):
    c = _static_filled(rng)
    first = c.alloc_id
    before = state(c)
    c.truncate_last(0)
    assert state(c) == before
    c.truncate_last(c.cached_len - 2)
    assert c.cached_len == 2 and c.alloc_id == first and state(c)["layers"] == before["layers"]
    c.clear()
    assert c.layers == [None, None] and c.cached_len == 0 and c.alloc_id != first
    assert c.device_location is None and c.rebind_location() is None   # residency unprovable
    assert c.slot_storage(0, 0) is None
    with pytest.raises(ValueError, match="cleared"):
        c.write_layer(0, K1, K1)
    with pytest.raises(ValueError, match="cleared"):
        c.attend(0, np.zeros((2, 4)))


# ---------------------------------------------------------------------- StaticKvCache.attend
def plain_attention(q3, k, v, scale, softcap=0.0, window=0):
    """Causal grouped attention in float64: q3 (n, nh, hd); k, v (nkv, L, hd); the last query
    is the newest row.  Written from the definition, independent of kvcache."""
    q3, k, v = (np.asarray(x, np.float64) for x in (q3, k, v))
    n, nh, hd = q3.shape
    nkv, L = k.shape[:2]
    out = np.zeros((n, nh, hd))
    for i in range(n):
        end = L - n + i + 1
        start = max(end - window, 0) if window else 0
        for h in range(nh):
            g = h // (nh // nkv)
            s = k[g, start:end] @ q3[i, h] * scale
            if softcap:
                s = softcap * np.tanh(s / softcap)
            p = np.exp(s - s.max())
            out[i, h] = (p / p.sum()) @ v[g, start:end]
    return out


def _static_with_rows(rng, n_layers, nkv, hd, rows, max_seq_len=64):
    c = kc.StaticKvCache.with_capacity(n_layers, nkv, hd, max_seq_len)
    ks = rng.standard_normal((n_layers, nkv, rows, hd)).astype(np.float32)
    vs = rng.standard_normal((n_layers, nkv, rows, hd)).astype(np.float32)
    for layer in range(n_layers):
        c.write_layer(layer, ks[layer], vs[layer])
    c.advance(rows)
    return c, ks, vs


@pytest.mark.parametrize("hpk", [1, 4], ids=["mha", "gqa4"])
@pytest.mark.parametrize("n", [None, 1, 5], ids=["one", "n1", "n5"])
def test_static_attend_matches_reference_layer_and_plain_softmax(rng, hpk, n):
    nkv, hd, rows = 2, 64, 37
    nh = nkv * hpk
    c, ks, vs = _static_with_rows(rng, 2, nkv, hd, rows)
    shape = (nh, hd) if n is None else (n, nh, hd)
    for layer in range(2):
        q = rng.standard_normal(shape).astype(np.float32)
        got = c.attend(layer, q)
        assert got.shape == shape and got.dtype == np.float32
        twin = reference.static_attend(c, layer, q)              # the NumPy twin kernel
        np.testing.assert_allclose(got, twin, rtol=1e-5, atol=1e-6)
        lay = kc.LayerKvCache(nkv, hd, mode=kc.KvMode.F32)         # same rows, grown storage
        lay.append(ks[layer].transpose(1, 0, 2), vs[layer].transpose(1, 0, 2))
        np.testing.assert_array_equal(got, lay.attend_all_heads(q))   # same compiled kernel
        np.testing.assert_allclose(got, reference.attend_all_heads(lay, q), rtol=1e-5, atol=1e-6)
        q3 = q[None] if n is None else q
        want = plain_attention(q3, ks[layer], vs[layer], 1 / np.sqrt(hd))
        np.testing.assert_allclose(got.reshape(q3.shape), want, rtol=1e-4, atol=2e-5)


def test_static_attend_scale_softcap_window(rng):
    nkv, hd, rows = 2, 64, 20
    c, ks, vs = _static_with_rows(rng, 1, nkv, hd, rows)
    q = rng.standard_normal((3, 8, hd)).astype(np.float32)
    got = c.attend(0, q, scale=0.3, softcap=2.0, window=6)
    np.testing.assert_allclose(got, plain_attention(q, ks[0], vs[0], 0.3, 2.0, 6),
                               rtol=1e-4, atol=2e-5)
    np.testing.assert_allclose(got, reference.static_attend(c, 0, q, scale=0.3, softcap=2.0,
                                                                     window=6), rtol=1e-5, atol=1e-6)
    assert not np.allclose(got, c.attend(0, q))                    # the options matter


def test_static_attend_after_truncate_ignores_stale_rows(rng):
    nkv, hd = 2, 64
    c, ks, vs = _static_with_rows(rng, 1, nkv, hd, 7)
    junk = np.full((nkv, 5, hd), 50.0, np.float32)                 # would dominate if read
    c.write_layer(0, junk, junk)
    c.advance(5)
    c.truncate_last(c.cached_len - 7)
    for shape in [(8, hd), (4, 8, hd)]:
        q = rng.standard_normal(shape).astype(np.float32)
        got = c.attend(0, q)
        q3 = q[None] if len(shape) == 2 else q
        np.testing.assert_allclose(got.reshape(q3.shape),
                                   plain_attention(q3, ks[0], vs[0], 1 / np.sqrt(hd)),
                                   rtol=1e-4, atol=2e-5)
        np.testing.assert_allclose(got, reference.static_attend(c, 0, q), rtol=1e-5, atol=1e-6)


def test_static_attend_long_block_is_chunked_like_the_layer(rng, monkeypatch):
    import kvcache._attention as attention
    monkeypatch.setattr(attention, "PROBS_BUDGET", 4 * 4 * 30 * 3)   # blocks of 3 positions
    c, ks, vs = _static_with_rows(rng, 1, 2, 8, 30)
    q = rng.standard_normal((10, 4, 8)).astype(np.float32)
    np.testing.assert_allclose(c.attend(0, q), plain_attention(q, ks[0], vs[0], 1 / np.sqrt(8)),
                               rtol=1e-4, atol=2e-5)


def test_static_attend_bad_input(rng):
    c, _, _ = _static_with_rows(rng, 1, 2, 8, 3, max_seq_len=8)
    cases = [
        (lambda: c.attend(0, np.zeros((3, 8))), ValueError, "multiple of num_kv_heads=2"),
        (lambda: c.attend(0, np.zeros((4, 7))), ValueError, "q: expected shape"),
        (lambda: c.attend(0, np.zeros((4, 4, 8))), ValueError, "at most cached_len=3"),
        (lambda: c.attend(0, np.zeros((4, 8), np.complex64)), TypeError, "q"),
        (lambda: c.attend(1, np.zeros((4, 8))), IndexError, "layer"),
        (lambda: c.attend(0, np.zeros((4, 8)), softcap=-1), ValueError, "softcap"),
        (lambda: c.attend(0, np.zeros((4, 8)), window=-1), ValueError, "window"),
        (lambda: c.attend(0, np.zeros((4, 8)), window=0), ValueError, "window"),
        (lambda: c.attend(0, np.zeros((4, 8)), window=True), TypeError, "window"),
        (lambda: c.attend(0, np.zeros((4, 8)), window=2.0), TypeError, "window"),
        (lambda: c.attend(0, np.zeros((4, 8)), scale=np.nan), ValueError, "scale"),
    ]
    before = state(c)
    for call, exc, match in cases:
        with pytest.raises(exc, match=match):
            call()
    assert state(c) == before
    assert c.attend(0, np.zeros((0, 4, 8))).shape == (0, 4, 8)
    empty = kc.StaticKvCache.with_capacity(1, 2, 8, 8)
    with pytest.raises(ValueError, match="cached_len=0"):
        empty.attend(0, np.zeros((4, 8)))
    half = kc.StaticKvCache.with_capacity(1, 2, 8, 8, np.float16)
    with pytest.raises(TypeError, match="float32"):
        half.attend(0, np.zeros((4, 8)))




@pytest.mark.parametrize("kw, match", [
    ({"scale": 1e39}, "scale: 1e.39 is not finite in float32"),
    ({"scale": -1e39}, "scale: -1e.39 is not finite in float32"),
    ({"scale": 1e-46}, "scale: 1e-46 underflows to 0 in float32"),
    ({"scale": np.inf}, "scale: expected a finite number"),
    ({"softcap": 1e39}, "softcap: 1e.39 is not finite in float32"),
    ({"softcap": np.float64(3.5e38)}, "softcap: .* is not finite in float32"),
    ({"softcap": 1e-46}, "softcap: 1e-46 underflows to 0 in float32"),
    ({"softcap": np.nan}, "softcap: expected a finite number"),
])
def test_static_attend_scale_and_softcap_must_survive_float32(rng, kw, match):
    """B5: values finite in float64 that the float32 kernel would see as inf or 0 are refused
    (they made NaN output or silently turned the scale/softcap off), also with warnings as
    errors (the check itself casts silently)."""
    c, _, _ = _static_with_rows(rng, 1, 2, 8, 3, max_seq_len=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match=match):
            c.attend(0, np.ones((4, 8)), **kw)
        q = rng.standard_normal((4, 8)).astype(np.float32)
        tiny = c.attend(0, q, scale=1e-40, softcap=3e38)   # subnormal / near max: fine
        assert np.isfinite(tiny).all()
        np.testing.assert_array_equal(c.attend(0, q, scale=np.float32(0.3)),
                                      c.attend(0, q, scale=float(np.float32(0.3))))


def test_static_attend_window_follows_attend_all_heads(rng):
    """B6: window=None is off (the default), 0 raises as in LayerKvCache.attend_all_heads, and
    any window at least the capacity -- 2**63 or an np.uint64 included -- is the same as off
    instead of an OverflowError."""
    nkv, hd, rows = 2, 8, 12
    c, ks, vs = _static_with_rows(rng, 1, nkv, hd, rows, max_seq_len=16)
    q = rng.standard_normal((3, 4, hd)).astype(np.float32)
    off = c.attend(0, q)
    np.testing.assert_array_equal(off, c.attend(0, q, window=None))
    for w in (rows, 16, 17, 2**62, 2**63, 2**64 + 5, 2**200, np.uint64(2**63),
              np.uint64(2**64 - 1), np.int64(2**63 - 1)):
        np.testing.assert_array_equal(c.attend(0, q, window=w), off)
    np.testing.assert_allclose(c.attend(0, q, window=4),
                               plain_attention(q, ks[0], vs[0], 1 / np.sqrt(hd), window=4),
                               rtol=1e-4, atol=2e-5)
    lay = kc.LayerKvCache(nkv, hd, mode=kc.KvMode.F32)          # same convention, same kernel
    lay.append(ks[0].transpose(1, 0, 2), vs[0].transpose(1, 0, 2))
    np.testing.assert_array_equal(off, lay.attend_all_heads(q, window=None))
    np.testing.assert_array_equal(c.attend(0, q, window=5), lay.attend_all_heads(q, window=5))
    for call in (lambda: c.attend(0, q, window=0), lambda: lay.attend_all_heads(q, window=0)):
        with pytest.raises(ValueError, match="window: expected an integer >= 1, got 0"):
            call()
    for scale in (0.0, -0.5, 2.0):                              # the same scales, the same bits
        np.testing.assert_array_equal(c.attend(0, q, scale=scale), lay.attend_all_heads(q, scale=scale))
