"""PrefixStore.put_output / load_output: the vector a model driver keeps after a stored prefix.

A real PrefixStore over MemoryBackend and DirectoryBackend: a vector put after whole blocks of
ids comes back bit for bit for the same model, mode and ids, and for nothing else; every
damaged entry (bit flips, truncation, another count, version or key) is a miss that is deleted;
bad input raises before anything is stored; a store that is down answers None / False.  Also
``load_prefix(whole=True)``, which loads the last chunk too when the driver has its output.
"""

from __future__ import annotations

import logging
import struct

import numpy as np
import pytest

import kvcache as kc
from kvcache import wire
from kvcache.store import DirectoryBackend, MemoryBackend, PrefixStore
from kvcache.store import entry as store_entry
from kvcache.store.backend import BackendUnavailable
from kvcache.store.keys import Geometry, as_ids, block_keys, output_key
from kvcache.store.prompt import load_prefix, store_blocks

LAYERS, NKV, HD = 2, 2, 16


def cache_of(mode="f32", n=0, seed=0):
    cache = kc.KvCache(LAYERS, NKV, HD, mode=mode)
    if n:
        rng = np.random.default_rng(seed)
        for layer in cache.layers:
            layer.append(rng.standard_normal((n, NKV, HD)).astype(np.float32),
                         rng.standard_normal((n, NKV, HD)).astype(np.float32))
    return cache


def ids_of(n, seed=1):
    return np.random.default_rng(seed).integers(0, 1000, n)


def name_of(store, ids, count, mode="f32"):
    geom = Geometry(LAYERS, NKV, HD, kc.KvMode.parse(mode), store.block)
    return output_key(block_keys(as_ids(ids), store.fingerprint, geom)[-1], count).hex()


@pytest.mark.parametrize("kind", ["memory", "dir"])
@pytest.mark.parametrize("mode", ["f32", "q8", "q4"])
def test_an_output_comes_back_for_the_same_prefix_only(tmp_path, kind, mode):
    backend = MemoryBackend() if kind == "memory" else DirectoryBackend(tmp_path, fsync=False)
    store = PrefixStore(backend, fingerprint="m", block=32)
    cache = cache_of(mode)
    ids = ids_of(96)
    vec = np.random.default_rng(2).standard_normal(57).astype(np.float32)
    vec[3], vec[4] = np.inf, np.nan                      # stored as IEEE says
    assert store.put_output(ids[:64], cache, vec) is True
    assert store.put_output(ids[:64], cache, vec + 1) is False     # there already: kept
    got = store.load_output(ids[:64], cache, 57)
    assert got.dtype == np.float32 and got.flags.writeable
    assert np.array_equal(got.view(np.uint32), vec.view(np.uint32))
    assert store.load_output(ids[:32], cache, 57) is None          # another prefix
    assert store.load_output(ids[:96], cache, 57) is None
    changed = ids.copy()
    changed[5] += 1                                                # another history
    assert store.load_output(changed[:64], cache, 57) is None
    other = "f32" if mode != "f32" else "q8"
    assert store.load_output(ids[:64], cache_of(other), 57) is None     # another mode
    assert PrefixStore(backend, fingerprint="n", block=32).load_output(
        ids[:64], cache, 57) is None                                    # another model
    assert store.load_output(ids[:64], kc.KvCache(LAYERS, NKV, 2 * HD, mode=mode),
                             57) is None                                # another geometry
    # integer and float64 values are stored as float32
    assert store.put_output(ids[:32], cache, np.arange(5))
    assert np.array_equal(store.load_output(ids[:32], cache, 5), np.arange(5, dtype=np.float32))


def test_damaged_outputs_are_misses_that_are_deleted(caplog):
    backend = MemoryBackend()
    store = PrefixStore(backend, fingerprint="m", block=8)
    cache, ids = cache_of(), ids_of(16)
    vec = np.linspace(-1, 1, 33, dtype=np.float32)
    store.put_output(ids, cache, vec)
    name = name_of(store, ids, 33)
    pristine = backend.get_many([name])[0]
    assert len(pristine) == 80 + 136 + 8                 # header, 33 values padded to 8, digest
    rng = np.random.default_rng(3)
    bad = [pristine[:n] for n in (0, 1, 79, 80, len(pristine) - 1)] + [pristine + bytes(8)]
    for _ in range(30):
        data = bytearray(pristine)
        data[int(rng.integers(0, len(data)))] ^= 1 << int(rng.integers(0, 8))
        bad.append(bytes(data))
    version = bytearray(pristine)
    version[8] = 2                                       # another version, digest fixed up
    version[-8:] = struct.pack("<Q", wire.digest(version[10], np.frombuffer(
        bytes(version), dtype=np.uint8)[:-8]))
    bad.append(bytes(version))
    bad.append(backend.get_many([name])[0].replace(b"\x89KVOUTPT", b"\x89KVBLOCK"))
    with caplog.at_level(logging.WARNING, logger="kvcache"):
        for value in bad:
            backend.put(name, value)
            assert store.load_output(ids, cache, 33) is None
            assert name not in backend.keys()
        backend.put(name, pristine)
        assert store.load_output(ids, cache, 34) is None        # another count: another key
        assert name in backend.keys()
    assert "unusable" in caplog.text
    # an entry moved under another prefix's or count's name is refused by its header
    backend.put(name_of(store, ids[:8], 33), pristine)
    assert store.load_output(ids[:8], cache, 33) is None
    backend.put(name_of(store, ids, 32), pristine)
    assert store.load_output(ids, cache, 32) is None
    assert np.array_equal(store.load_output(ids, cache, 33), vec)


def test_the_documented_header():
    key, fp = bytes(range(32)), bytes(range(100, 116))
    value = store_entry.encode_output(key, fp, np.array([1.5, -2.0, 3.0], dtype=np.float32))
    magic, version, alg, flags, hlen, total = struct.unpack_from("<8sHBBIQ", value, 0)
    assert (magic, version, flags, hlen, total) == (b"\x89KVOUTPT", 1, 0, 80, len(value))
    assert value[24:56] == key and struct.unpack_from("<II", value, 56) == (3, 0)
    assert value[64:80] == fp
    assert np.array_equal(np.frombuffer(value, "<f4", 3, 80), [1.5, -2.0, 3.0])
    assert value[92:96] == bytes(4)                                    # pad8
    assert struct.unpack_from("<Q", value, 96)[0] == wire.digest(alg, np.frombuffer(
        value, dtype=np.uint8)[:96])


def test_put_outputs_stores_several_prefixes_at_once():
    backend = MemoryBackend()
    store = PrefixStore(backend, fingerprint="m", block=8)
    cache, ids = cache_of(), ids_of(40)
    rows = {8: np.ones(3), 24: np.arange(3.0), 40: [7.0, 8.0]}
    assert store.put_outputs(ids, cache, rows) == 3
    assert store.put_outputs(ids, cache, rows) == 0                    # there already
    assert store.put_outputs(ids, cache, {}) == 0
    for n, want in rows.items():
        assert np.array_equal(store.load_output(ids[:n], cache, len(want)),
                              np.asarray(want, dtype=np.float32))
    assert store.load_output(ids[:16], cache, 3) is None
    # every length and vector is checked before anything is stored
    for bad, exc in (({8: [1.0], 12: [1.0]}, ValueError), ({8: [1.0], 48: [1.0]}, ValueError),
                     ({0: [1.0]}, ValueError), ({True: [1.0]}, ValueError),
                     ({16: [1.0], 32: "x"}, TypeError), ([(8, [1.0])], TypeError)):
        with pytest.raises(exc):
            store.put_outputs(ids, cache, bad)
    assert len(backend) == 3


@pytest.mark.parametrize("values,exc,match", [
    ("abc", TypeError, "expected a 1-D array of real numbers, got str"),
    (b"ab", TypeError, "got bytes"),
    (np.array(["a"]), TypeError, "expected real numbers, got dtype <U1"),
    (np.array([1 + 2j]), TypeError, "expected real numbers, got dtype complex128"),
    ([[1.0, 2.0]], ValueError, r"1-D array of 1 to 16777216 values, got shape \(1, 2\)"),
    ([], ValueError, r"got shape \(0,\)"),
    (3.0, ValueError, r"got shape \(\)"),
    ([1, [2]], TypeError, "expected a 1-D array of real numbers"),
])
def test_bad_values_raise_and_store_nothing(values, exc, match):
    backend = MemoryBackend()
    store = PrefixStore(backend, fingerprint="m", block=8)
    with pytest.raises(exc, match=match):
        store.put_output(ids_of(8), cache_of(), values)
    assert len(backend) == 0


def test_bad_ids_counts_and_caches_raise():
    backend = MemoryBackend()
    store = PrefixStore(backend, fingerprint="m", block=8)
    cache = cache_of()
    for ids in (ids_of(7), ids_of(12), []):
        with pytest.raises(ValueError, match="an output is kept after whole blocks"):
            store.put_output(ids, cache, [1.0])
        with pytest.raises(ValueError, match="an output is kept after whole blocks"):
            store.load_output(ids, cache, 1)
    for count in (0, -1, True, 1.0, 1 << 25):
        with pytest.raises(ValueError, match="count: expected an int in"):
            store.load_output(ids_of(8), cache, count)
    with pytest.raises(TypeError, match="expected a kvcache.KvCache"):
        store.put_output(ids_of(8), "cache", [1.0])
    with pytest.raises(ValueError, match="token ids"):
        store.load_output([[1] * 8], cache, 1)
    assert len(backend) == 0


class _Down(MemoryBackend):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def _fail(self, *args):
        self.calls += 1
        raise BackendUnavailable("connection refused")

    get_many = contains_many = put = _fail


def test_a_store_that_is_down_answers_none(caplog):
    down = _Down()
    store = PrefixStore(down, fingerprint="m", block=8)
    with caplog.at_level(logging.WARNING, logger="kvcache"):
        assert store.put_output(ids_of(8), cache_of(), [1.0]) is False
        assert store.load_output(ids_of(8), cache_of(), 1) is None
    assert not store.available and down.calls == 1
    fresh = PrefixStore(_Down(), fingerprint="m", block=8)
    assert fresh.load_output(ids_of(8), cache_of(), 1) is None and not fresh.available


@pytest.mark.parametrize("mode", ["f32", "q8", "q4"])
def test_load_prefix_whole_loads_the_last_chunk_too(mode):
    block = 32
    store = PrefixStore(MemoryBackend(), fingerprint="m", block=block)
    ids, src = ids_of(96), cache_of(mode, 96)
    store_blocks(store, ids, src)
    for n, chunk, want in ((96, 16, 96), (64, 32, 64), (64, None, 64), (32, 8, 32),
                           (80, 16, 64), (95, 16, 64)):
        fresh = cache_of(mode)
        assert load_prefix(store, ids[:n], fresh, chunk=chunk, whole=True) == want, (n, chunk)
        assert fresh.seq_len == want
        for a, b in zip(fresh.layers, src.layers):        # the stored cache's first rows
            for h in range(NKV):
                for got, full in zip(a.head_rows(h), b.head_rows(h)):
                    assert np.array_equal(got, full[:want])
    # a missing last block: the rule without ``whole`` (the chunk of the last position left)
    partial = PrefixStore(MemoryBackend(), fingerprint="m", block=block)
    store_blocks(partial, ids[:64], cache_of(mode, 64))
    fresh = cache_of(mode)
    assert load_prefix(partial, ids, fresh, chunk=16, whole=True) == 64
    fresh = cache_of(mode)
    assert load_prefix(partial, ids[:64], fresh, chunk=16) == (32 if mode == "q4" else 48)
    with pytest.raises(TypeError, match="whole: expected a bool"):
        load_prefix(store, ids, cache_of(mode), whole=1)
