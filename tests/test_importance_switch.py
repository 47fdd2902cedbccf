"""track_importance: a cache or layer that never evicts by importance can switch off the
importance work (the prompt kernel's kept probabilities and their column sums) without
changing any output."""

from __future__ import annotations

import numpy as np
import pytest

import kvcache as kc


def _bits(x):
    return np.ascontiguousarray(x).view(np.uint32)


def _layer(rng, mode, n=150, nkv=2, hd=64):
    layer = kc.LayerKvCache(nkv, hd, mode=mode)
    layer.append(rng.standard_normal((n, nkv, hd)).astype(np.float32),
                 rng.standard_normal((n, nkv, hd)).astype(np.float32))
    return layer


@pytest.mark.parametrize("mode", ["f32", "q8", "q4"])
def test_outputs_are_the_same_bits_and_importance_stays_zero(mode):
    rng = np.random.default_rng(3)
    on, off = _layer(rng, mode), _layer(np.random.default_rng(3), mode)
    off.track_importance = False
    assert on.track_importance and not off.track_importance
    prompt = rng.standard_normal((40, 6, 64)).astype(np.float32)
    step = rng.standard_normal((6, 64)).astype(np.float32)
    for q, kw in ((prompt, {}), (prompt, {"window": 17}), (step, {}), (step, {"softcap": 2.0})):
        assert np.array_equal(_bits(on.attend_all_heads(q, **kw)),
                              _bits(off.attend_all_heads(q, **kw)))
    assert on.importance.shape == off.importance.shape == (150,)
    assert on.importance.sum() > 1.0 and not off.importance.any()


def test_switching_back_on_counts_only_what_follows():
    rng = np.random.default_rng(5)
    a, b = _layer(rng, "f32"), _layer(np.random.default_rng(5), "f32")
    q1 = rng.standard_normal((30, 4, 64)).astype(np.float32)
    q2 = rng.standard_normal((4, 64)).astype(np.float32)
    a.track_importance = False
    a.attend_all_heads(q1)
    a.track_importance = True
    a.attend_all_heads(q2)
    b.attend_all_heads(q2)                   # b saw only the tracked call
    assert a.importance.tobytes() == b.importance.tobytes()
    a.append(np.ones((3, 2, 64), np.float32), np.ones((3, 2, 64), np.float32))
    assert a.importance.shape == (153,) and not a.importance[150:].any()


def test_born_eviction_is_refused_and_changes_nothing():
    rng = np.random.default_rng(7)
    layer = _layer(rng, "q8", n=100)
    layer.attend_all_heads(rng.standard_normal((4, 64)).astype(np.float32))
    layer.track_importance = False
    st = layer.state().owned_copy()
    with pytest.raises(ValueError, match="track_importance=False"):
        layer.evict(40, kc.EvictionPolicy.born(4))
    now = layer.state()
    assert now.seq_len == 100 and now.kq.tobytes() == st.kq.tobytes()
    assert now.importance.tobytes() == st.importance.tobytes()
    layer.evict(40)                          # RECENT needs no importance
    assert len(layer) == 40


def test_the_cache_switch_sets_every_layer_and_guards_eviction():
    rng = np.random.default_rng(9)
    cache = kc.KvCache(3, 2, 64, mode="f32")
    for layer in cache.layers:
        layer.append(rng.standard_normal((50, 2, 64)).astype(np.float32),
                     rng.standard_normal((50, 2, 64)).astype(np.float32))
        layer.attend_all_heads(rng.standard_normal((4, 64)).astype(np.float32))
    assert cache.track_importance
    cache.layers[2].track_importance = False           # one layer is enough to refuse
    assert not cache.track_importance
    before = [layer.importance.copy() for layer in cache.layers]
    with pytest.raises(ValueError, match="track_importance=False"):
        cache.evict(20)                                 # the default policy is Born
    assert all(len(layer) == 50 for layer in cache.layers)
    assert all(np.array_equal(x, layer.importance) for x, layer in zip(before, cache.layers))
    cache.track_importance = True
    assert all(layer.track_importance for layer in cache.layers)
    cache.evict(20)
    assert all(len(layer) == 20 for layer in cache.layers)
    cache.track_importance = False
    assert not any(layer.track_importance for layer in cache.layers)


@pytest.mark.parametrize("bad", [1, 0, "no", None, np.array([True])])
def test_the_switch_takes_only_a_bool(bad):
    layer, cache = kc.LayerKvCache(1, 8), kc.KvCache(2, 1, 8)
    with pytest.raises(TypeError, match="track_importance"):
        layer.track_importance = bad
    with pytest.raises(TypeError, match="track_importance"):
        cache.track_importance = bad
    assert layer.track_importance and cache.track_importance
    layer.track_importance = np.bool_(False)
    assert layer.track_importance is False


def test_a_pickled_layer_keeps_the_switch():
    import pickle
    layer = _layer(np.random.default_rng(1), "f32", n=10)
    layer.track_importance = False
    assert pickle.loads(pickle.dumps(layer)).track_importance is False
