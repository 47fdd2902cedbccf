"""kvcache.store.prompt: the one store path of the runner and kvcache.hf.

A real PrefixStore (MemoryBackend, DirectoryBackend in tmp_path) and KvCaches filled with random
rows: a cold cache of a prompt is stored with ``store_blocks``, a new cache is filled with
``load_prefix``, and what it then holds must be the cold cache's first positions bit for bit;
``load_prefix``'s count follows the rule (whole chunks, never the chunk of the last position);
``check_store`` refuses what the drivers must refuse, before anything changes; ``open_store``
closes only what it opened.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvcache as kc
from kvcache.store import DirectoryBackend, MemoryBackend, PrefixStore
from kvcache.store.prompt import (check_store, load_prefix, open_store, refuse_o1,
                                  store_blocks)

LAYERS, NKV, HD = 2, 2, 32


def cold(n, mode, seed=0, held=None):
    """A cache holding the first ``held`` (default all) of ``n`` positions of random rows,
    appended as a prefill does."""
    cache = kc.KvCache(LAYERS, NKV, HD, mode=mode)
    rng = np.random.default_rng(seed)
    for layer in cache.layers:
        k = rng.standard_normal((n, NKV, HD)).astype(np.float32)
        v = rng.standard_normal((n, NKV, HD)).astype(np.float32)
        layer.append(k[:held], v[:held])
    return cache


def ids_of(n, seed=1):
    return np.random.default_rng(seed).integers(0, 1000, n)


def rows(cache, n):
    """Every layer's (K, V) rows of the first ``n`` positions, as the kernels read them."""
    out = []
    for layer in cache.layers:
        for h in range(NKV):
            k, v = layer.head_rows(h)
            out += [np.array(k[:n]), np.array(v[:n])]
    return out


def assert_same_rows(got, want, n):
    assert got.seq_len == n
    for a, b in zip(rows(got, n), rows(want, n)):
        assert np.array_equal(a, b)


# (prompt length, chunk, positions loaded) with block 8; chunk None: the block (kvcache.hf)
RULE = [(20, 4, 16), (17, 4, 16), (16, 4, 12), (8, 4, 4), (5, 4, 0), (4, 4, 0), (1, 4, 0),
        (0, 4, 0), (16, 8, 8), (17, 8, 16), (16, None, 8), (17, None, 16), (9, None, 8),
        (8, None, 0), (16, 2, 14), (20, 1, 16), (16, 1, 15)]
# 4-bit K, block 32: a roll-back never reopens a block of 32 keys (its rows would be read
# from the loaded codes and quantised again), so the count is also a multiple of 32
RULE_K4 = [(64, 16, 32), (64, 32, 32), (80, 16, 64), (64, 8, 32), (65, 8, 64), (64, None, 32),
           (100, 1, 96), (96, 1, 64)]


@pytest.mark.parametrize("mode,block,n,chunk,want",
                         [("f32", 8, *r) for r in RULE] + [("q8", 8, *r) for r in RULE]
                         + [("q4", 32, *r) for r in RULE_K4] + [("k4v8", 32, *r) for r in RULE_K4])
def test_load_prefix_loads_whole_chunks_before_the_last_one(mode, block, n, chunk, want):
    store = PrefixStore(MemoryBackend(), fingerprint="m", block=block)
    ids = ids_of(n)
    src = cold(n, mode)
    assert store_blocks(store, ids, src) == n // block
    fresh = kc.KvCache(LAYERS, NKV, HD, mode=mode)
    assert load_prefix(store, ids, fresh, chunk=chunk) == want
    assert_same_rows(fresh, cold(n, mode, held=want), want)   # a cold cache of those positions


def test_a_loaded_prefix_continues_as_a_cold_cache(tmp_path):
    # rolled back to the chunk and appended again: the same rows as the cold cache's
    store = PrefixStore(DirectoryBackend(tmp_path), fingerprint="m", block=16)
    ids, src = ids_of(40), cold(40, "q8")
    store_blocks(store, ids, src)
    fresh = kc.KvCache(LAYERS, NKV, HD, mode="q8")
    assert load_prefix(store, ids[:32], fresh, chunk=8) == 24     # 2 blocks, rolled back to 24
    for layer, other in zip(fresh.layers, cold(40, "q8").layers):  # the same random rows
        k = np.stack([other.head_rows(h)[0][24:40] for h in range(NKV)], axis=1)
        v = np.stack([other.head_rows(h)[1][24:40] for h in range(NKV)], axis=1)
        layer.append(k, v)
    assert_same_rows(fresh, src, 40)


def test_cmf_below_the_warm_up_loads_nothing():
    # a q8 "cmf" cache rolled back to 64 positions would keep frozen columns: nothing is loaded
    store = PrefixStore(MemoryBackend(), fingerprint="m", block=128)
    ids, src = ids_of(200), cold(200, "q8:cmf")
    store_blocks(store, ids, src)
    fresh = kc.KvCache(LAYERS, NKV, HD, mode="q8:cmf")
    assert load_prefix(store, ids[:128], fresh, chunk=64) == 0
    assert fresh.seq_len == 0
    assert not any(layer.state().any_col_frozen() for layer in fresh.layers)
    assert load_prefix(store, ids[:129], fresh, chunk=64) == 128
    assert_same_rows(fresh, src, 128)


def test_another_fingerprint_a_block_the_chunk_splits_or_a_mode_the_block_cannot_take():
    backend = MemoryBackend()
    store = PrefixStore(backend, fingerprint="model-a", block=96)
    cache = kc.KvCache(LAYERS, NKV, HD, mode="f32")
    assert check_store(store, cache, fingerprint="model-a", chunk=32) is store
    assert check_store(store, cache, fingerprint=b"model-a") is store
    with pytest.raises(TypeError, match="expected a kvcache.store.PrefixStore, got str"):
        check_store("memory", cache)
    with pytest.raises(ValueError, match="fingerprint is not this model's"):
        check_store(store, cache, fingerprint="model-b")
    with pytest.raises(ValueError, match="block of 96 positions is not a multiple of "
                                         "prefill_chunk=64"):
        check_store(store, cache, chunk=64)
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="chunk: expected an int >= 1"):
            check_store(store, cache, chunk=bad)
    small = PrefixStore(backend, fingerprint="model-a", block=64)
    cmf = kc.KvCache(LAYERS, NKV, HD, mode="q8:cmf")
    with pytest.raises(ValueError, match="needs block > 64"):
        check_store(small, cmf, chunk=64)
    with pytest.raises(TypeError, match="expected a kvcache.KvCache"):
        check_store(store, object())
    assert len(backend) == 0 and cache.seq_len == 0


def test_bad_input_changes_neither_the_store_nor_the_cache():
    backend = MemoryBackend()
    store = PrefixStore(backend, fingerprint="m", block=8)
    ids, src = ids_of(20), cold(20, "f32")
    with pytest.raises(ValueError, match="ids: the cache holds 20 positions, ids has 19"):
        store_blocks(store, ids[:19], src)
    assert len(backend) == 0
    with pytest.raises(ValueError, match="block of 8 positions is not a multiple"):
        load_prefix(store, ids, kc.KvCache(LAYERS, NKV, HD, mode="f32"), chunk=3)
    assert store_blocks(store, np.concatenate([ids, ids_of(5)]), src) == 2   # a longer one
    assert store_blocks(store, ids, src) == 0                                # already there
    assert len(backend) == 2
    held = cold(8, "f32", seed=5)
    before = rows(held, 8)
    with pytest.raises(ValueError, match="expected an empty cache to load into, it holds 8"):
        load_prefix(store, ids, held)
    with pytest.raises(ValueError, match="sequence of token ids|token ids"):
        load_prefix(store, [[1, 2]], kc.KvCache(LAYERS, NKV, HD, mode="f32"))
    assert all(np.array_equal(a, b) for a, b in zip(rows(held, 8), before))
    assert held.seq_len == 8 and len(backend) == 2


def test_open_store_closes_only_what_it_opened(tmp_path):
    ids, src = ids_of(300), cold(300, "f32")
    with open_store("memory", "m") as st:                    # opened here: closed on exit
        assert (st.fingerprint, st.block) == (b"m", 256)
        assert store_blocks(st, ids, src) == 1
        backend = st.backend
    assert len(backend) == 0                                # MemoryBackend.close forgets
    mine = MemoryBackend()
    with open_store(mine, "m") as st:                        # the caller's backend: kept
        store_blocks(st, ids, src)
    assert len(mine) == 1
    given = PrefixStore(mine, fingerprint="other", block=128)
    with open_store(given, "m") as st:                       # the caller's store: as it is
        assert st is given
    assert len(mine) == 1
    with open_store(tmp_path / "dir", "m") as st:            # a path: a DirectoryBackend
        store_blocks(st, ids, src)
    with open_store(str(tmp_path / "dir"), "m") as st:
        assert load_prefix(st, ids, kc.KvCache(LAYERS, NKV, HD, mode="f32")) == 256
    with pytest.raises(ValueError, match="got None"):
        with open_store(None, "m"):
            pass
    with pytest.raises(TypeError, match="backend: expected"):
        with open_store(3, "m"):                             # type: ignore[arg-type]
            pass


def test_refuse_o1():
    refuse_o1(())
    with pytest.raises(ValueError, match=r"does not handle O\(1\) layers \(layers \[1, 3\]"):
        refuse_o1((3, 1))
