"""KvCache: every layer of a model, with eviction (layer-kv-cache.md section 5)."""

from __future__ import annotations

import numpy as np
import pytest

import kvcache as kc

F32 = kc.KvMode.F32
ALL_MODES = [F32, kc.KvMode.Q8(), kc.KvMode.Q8(k=True, v=False), kc.KvMode.Q8(k=False, v=True)]
MODE_IDS = ["f32", "q8", "q8k", "q8v"]
NKV, HD = 2, 8


def positional_rows(n, nkv=NKV, hd=HD, start=0):
    """K/V blocks whose every channel holds the position (V negated): rows are traceable."""
    pos = np.arange(start, start + n, dtype=np.float32)
    k = np.broadcast_to(pos[:, None, None], (n, nkv, hd)).copy()
    return k, -k


def key_positions(layer, h):
    return layer.head_keys(h)[:, 0].astype(int).tolist()


def model_with_lengths(lengths, policy=None, mode=F32, max_seq_len=32768):
    kv = kc.KvCache(len(lengths), NKV, HD, max_seq_len=max_seq_len, policy=policy, mode=mode)
    for layer, n in zip(kv.layers, lengths):
        if n:
            layer.append(*positional_rows(n))
    return kv


# ---------------------------------------------------------------------------- construction
def test_constructor_defaults():
    kv = kc.KvCache(3, NKV, HD, mode=F32)
    assert kv.max_seq_len == 32768
    assert kv.policy == kc.EvictionPolicy.born(sink=4)
    assert kv.policy.kind == "born" and kv.policy.sink == 4
    assert len(kv.layers) == 3 and len({id(layer) for layer in kv.layers}) == 3
    for layer in kv.layers:
        assert isinstance(layer, kc.LayerKvCache)
        assert (layer.num_kv_heads, layer.head_dim, layer.mode) == (NKV, HD, F32)
        assert layer.seq_len == 0 and layer.o1 is None
    assert kv.seq_len == 0 and not kv.needs_eviction() and kv.memory_bytes() == 0


@pytest.mark.parametrize("env, mode", [(None, F32), ("q8k", kc.KvMode.Q8(k=True, v=False)),
                                       ("q8", kc.KvMode.Q8())])
def test_mode_none_reads_env_for_every_layer(monkeypatch, env, mode):
    if env is None:
        monkeypatch.delenv("KVCACHE_KV", raising=False)
    else:
        monkeypatch.setenv("KVCACHE_KV", env)
    kv = kc.KvCache(2, NKV, HD)
    assert all(layer.mode == mode for layer in kv.layers)


def test_explicit_policy_and_mode_are_kept():
    mode = kc.KvMode.Q8(k=False, v=True)
    kv = kc.KvCache(2, NKV, HD, max_seq_len=100, policy=kc.EvictionPolicy.RECENT, mode=mode)
    assert kv.policy == kc.EvictionPolicy.RECENT and kv.max_seq_len == 100
    assert all(layer.mode == mode for layer in kv.layers)


def test_policy_values():
    assert kc.EvictionPolicy.RECENT.kind == "recent"
    assert kc.EvictionPolicy.born().sink == 4
    assert kc.EvictionPolicy.born(sink=0) == kc.EvictionPolicy.born(sink=0)
    assert kc.EvictionPolicy.born(sink=1) != kc.EvictionPolicy.born(sink=2)
    assert kc.EvictionPolicy.born(sink=1) != kc.EvictionPolicy.RECENT
    assert hash(kc.EvictionPolicy.born(sink=3)) == hash(kc.EvictionPolicy.born(sink=3))


def test_no_layers_is_a_valid_empty_model():
    kv = kc.KvCache(0, NKV, HD, mode=F32)
    assert kv.layers == [] and kv.seq_len == 0 and kv.memory_bytes() == 0
    assert not kv.needs_eviction()
    kv.evict(0)
    kv.truncate_last(3)
    kv.clear()


# ---------------------------------------------------------------------------- queries
def test_seq_len_is_the_max_over_layers():
    kv = model_with_lengths([3, 7, 0])
    assert kv.seq_len == 7
    kv.layers[2].append(*positional_rows(9))
    assert kv.seq_len == 9


def test_needs_eviction_from_max_seq_len_on():
    kv = model_with_lengths([7, 2], max_seq_len=8)
    assert not kv.needs_eviction()
    kv.layers[1].append(*positional_rows(5))        # layer 1: 7 rows, still below 8
    assert kv.seq_len == 7 and not kv.needs_eviction()
    kv.layers[1].append(*positional_rows(1))        # layer 1 reaches 8: seq_len >= max
    assert kv.seq_len == 8 and kv.needs_eviction() is True


def test_memory_bytes_is_the_sum_over_layers():
    kv = model_with_lengths([3, 5, 0])
    kv.layers[0].linear_state = np.ones(6, dtype=np.float32)
    assert kv.memory_bytes() == sum(layer.memory_bytes() for layer in kv.layers)
    assert kv.memory_bytes() == (3 + 5) * NKV * HD * 4 * 2 + 6 * 4


# ---------------------------------------------------------------------------- truncate, clear
def test_truncate_last_applies_to_every_layer():
    kv = model_with_lengths([6, 4, 1])
    kv.truncate_last(2)
    assert [layer.seq_len for layer in kv.layers] == [4, 2, 0]    # saturating at 0
    assert key_positions(kv.layers[0], 1) == [0, 1, 2, 3]
    assert key_positions(kv.layers[1], 0) == [0, 1]
    assert kv.layers[2].head_len(0) == 0


def test_clear_empties_every_layer_and_keeps_modes():
    mode = kc.KvMode.Q8()
    kv = model_with_lengths([70, 3], mode=mode)
    kv.layers[0].linear_state = [1.0]
    kv.clear()
    assert kv.seq_len == 0 and kv.memory_bytes() == 0
    for layer in kv.layers:
        assert layer.mode == mode and layer.importance.shape == (0,)
        assert layer.linear_state.shape == (0,)
        assert all(c is None for h in range(NKV) for c in layer.columns(h))


# ---------------------------------------------------------------------------- eviction
def test_recent_eviction_on_every_layer():
    kv = model_with_lengths([10, 6, 3], policy=kc.EvictionPolicy.RECENT)
    kv.evict(4)
    assert [layer.seq_len for layer in kv.layers] == [4, 4, 3]    # the short layer is kept
    assert key_positions(kv.layers[0], 0) == [6, 7, 8, 9]
    assert key_positions(kv.layers[1], 1) == [2, 3, 4, 5]
    assert key_positions(kv.layers[2], 0) == [0, 1, 2]
    assert kv.seq_len == 4


@pytest.mark.parametrize("keep, imp_peaks, expected", [
    # sink 4 and recent keep // 2 fill the whole budget
    (8, {5: 9.0}, [0, 1, 2, 3, 8, 9, 10, 11]),
    # sink 4 + recent 5 (rows 7..11) leave one slot: the heaviest middle row
    (10, {5: 9.0, 4: 1.0}, [0, 1, 2, 3, 5, 7, 8, 9, 10, 11]),
    # a tie keeps the earlier row (stable, descending)
    (10, {4: 3.0, 6: 3.0}, [0, 1, 2, 3, 4, 7, 8, 9, 10, 11]),
    # keep 2: sink takes both slots
    (2, {}, [0, 1]),
    # nothing to evict
    (12, {}, list(range(12))),
], ids=["budget-full", "one-slot", "tie", "sink-only", "noop"])
def test_born_eviction_default_policy(keep, imp_peaks, expected):
    kv = model_with_lengths([12, 12])
    imp = np.zeros(12, dtype=np.float32)
    for row, mass in imp_peaks.items():
        imp[row] = mass
    for layer in kv.layers:
        layer.accumulate_imp(imp)
    kv.evict(keep)
    for layer in kv.layers:
        assert layer.seq_len == len(expected)
        for h in range(NKV):
            assert key_positions(layer, h) == expected
            assert (-layer.head_values(h)[:, 0]).astype(int).tolist() == expected
        assert np.array_equal(layer.importance, imp[expected])


@pytest.mark.parametrize("policy", [kc.EvictionPolicy.RECENT, kc.EvictionPolicy.born(sink=4)],
                         ids=["recent", "born"])
def test_evict_to_zero_empties_the_rows(policy):
    kv = model_with_lengths([9, 5], policy=policy)
    kv.evict(0)
    for layer in kv.layers:
        assert layer.seq_len == 0 and layer.importance.shape == (0,)
        assert all(layer.head_len(h) == 0 for h in range(NKV))
    assert kv.memory_bytes() == 0


@pytest.mark.parametrize("mode", ALL_MODES, ids=MODE_IDS)
@pytest.mark.parametrize("policy", [kc.EvictionPolicy.RECENT, kc.EvictionPolicy.born(sink=2)],
                         ids=["recent", "born"])
def test_eviction_gathers_every_store_of_every_mode(rng, make_kv, mode, policy):
    rows, keep = 80, 20
    kv = kc.KvCache(1, NKV, HD, policy=policy, mode=mode)
    layer = kv.layers[0]
    k, v = make_kv(rng, rows, NKV, HD)
    layer.append(k, v)
    imp = rng.random(rows).astype(np.float32)
    layer.accumulate_imp(imp)
    before = [(layer.head_keys(h).copy(), layer.head_values(h).copy(),
               [None if a is None else a.copy() for a in layer.q8_rows(h)]) for h in range(NKV)]
    if policy.kind == "recent":
        kept = np.arange(rows - keep, rows)
    else:   # sink 2, recent 10, then the 8 heaviest middle rows
        middle = np.arange(2, rows - 10)
        heavy = middle[np.argsort(-imp[middle], kind="stable")[:8]]
        kept = np.sort(np.r_[0:2, heavy, rows - 10:rows])
    kv.evict(keep)
    assert layer.seq_len == keep
    assert np.array_equal(layer.importance, imp[kept])
    for h in range(NKV):
        keys, values, q8 = before[h]
        assert layer.head_len(h) == keep
        if keys.size:
            assert np.array_equal(layer.head_keys(h), keys[kept])
        if values.size:
            assert np.array_equal(layer.head_values(h), values[kept])
        for old, new in zip(q8, layer.q8_rows(h)):
            assert (old is None) == (new is None)
            if old is not None:
                assert np.array_equal(new, old[kept])


@pytest.mark.parametrize("policy", [kc.EvictionPolicy.RECENT, kc.EvictionPolicy.born(sink=1)],
                         ids=["recent", "born"])
def test_eviction_skips_layers_with_o1_state(snapshot, assert_same_state, policy):
    kv = model_with_lengths([12, 12, 12], policy=policy)
    kv.layers[1].o1_begin(4, 8, 2)          # an O(1) state still collecting its trace
    frozen = snapshot(kv.layers[1])
    kv.evict(4)
    assert_same_state(frozen, snapshot(kv.layers[1]))
    assert kv.layers[0].seq_len == kv.layers[2].seq_len == 4
    assert kv.seq_len == 12


def _partially_dead_layer():
    """10 positions on 2 heads; head 1 is dead for positions 2, 3 and 4 (7 rows)."""
    layer = kc.LayerKvCache(NKV, HD, mode=F32)
    for pos in range(10):
        k, v = positional_rows(1, start=pos)
        layer.append(k[0], v[0], alive=[True, pos not in (2, 3, 4)])
    return layer


def test_born_eviction_with_a_partially_dead_head():
    kv = kc.KvCache(1, NKV, HD, policy=kc.EvictionPolicy.born(sink=1), mode=F32)
    layer = kv.layers[0] = _partially_dead_layer()
    assert layer.head_len(0) == 10 and layer.head_len(1) == 7 and layer.importance.size == 10
    head1_before = key_positions(layer, 1)
    assert head1_before == [0, 1, 5, 6, 7, 8, 9]
    imp = np.zeros(10, dtype=np.float32)
    imp[[2, 5]] = [4.0, 3.0]
    layer.accumulate_imp(imp)

    kv.evict(6)        # sink [0], recent 3 -> [7, 8, 9], budget 2 -> rows 2 and 5 by mass
    kept = [0, 2, 5, 7, 8, 9]
    assert layer.seq_len == 6
    assert np.array_equal(layer.importance, imp[kept])
    assert key_positions(layer, 0) == kept
    # head 1 keeps only rows it holds: the kept indices below its own length, gathered
    # from its own storage (so never a row of another head, never out of range)
    own = [head1_before[i] for i in kept if i < 7]
    assert layer.head_len(1) == len(own)
    assert key_positions(layer, 1) == own
    assert layer.memory_bytes() == (6 + len(own)) * HD * 4 * 2
    out = layer.attend_all_heads(np.ones((NKV, HD), dtype=np.float32))
    assert np.all(np.isfinite(out))


def test_recent_eviction_with_a_partially_dead_head():
    kv = kc.KvCache(1, NKV, HD, policy=kc.EvictionPolicy.RECENT, mode=F32)
    layer = kv.layers[0] = _partially_dead_layer()
    kv.evict(6)        # drop 4 from the front of each head (at most what it holds)
    assert layer.seq_len == 6
    assert key_positions(layer, 0) == [4, 5, 6, 7, 8, 9]
    assert key_positions(layer, 1) == [7, 8, 9]


def test_decode_loop_with_eviction_stays_bounded(rng, make_kv):
    max_len = 16
    kv = kc.KvCache(2, NKV, HD, max_seq_len=max_len, mode=F32)
    k, v = make_kv(rng, 100, NKV, HD)
    for t in range(100):
        for layer in kv.layers:
            layer.append(k[t], v[t])
            out = layer.attend_all_heads(rng.standard_normal((2 * NKV, HD)))
            assert np.all(np.isfinite(out))
        if kv.needs_eviction():
            kv.evict(max(max_len // 2, 1))
        assert kv.seq_len <= max_len
        # the newest row always survives: it is in the recent part of every eviction
        assert np.array_equal(kv.layers[0].head_keys(0)[-1], k[t, 0])


def test_layer_evict_applies_the_policy_as_kvcache_does(rng):
    # LayerKvCache.evict is what KvCache.evict runs per layer; born_rows is the row choice
    kv = kc.KvCache(1, 2, 8, 64, policy=kc.EvictionPolicy.born(sink=2), mode=kc.KvMode.F32)
    alone = kc.LayerKvCache(2, 8, mode=kc.KvMode.F32)
    k, v = rng.standard_normal((2, 20, 2, 8)).astype(np.float32)
    for layer in (kv.layers[0], alone):
        layer.append(k, v)
        layer.accumulate_imp(np.arange(20, dtype=np.float32)[::-1].copy())
    kv.evict(8)
    alone.evict(8, kc.EvictionPolicy.born(sink=2))
    np.testing.assert_array_equal(alone.head_keys(1), kv.layers[0].head_keys(1))
    np.testing.assert_array_equal(alone.head_keys(0), k[[0, 1, 2, 3, 16, 17, 18, 19], 0])
    # sink 0, 1; the most important middle rows 2, 3; the newest max(8 // 2, 1) = 4 rows
    from kvcache.eviction import born_rows
    kept = born_rows(np.arange(20, dtype=np.float32)[::-1].copy(), 8, 2, 4)
    assert kept.tolist() == [0, 1, 2, 3, 16, 17, 18, 19]
    with pytest.raises(TypeError, match="policy: expected an EvictionPolicy"):
        alone.evict(4, "born")
    assert alone.seq_len == 8
