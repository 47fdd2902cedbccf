"""The prefix store (kvcache.store) with its memory and directory backends.

A "cold prefill" below is what a model run gives: every layer's K/V rows appended through
LayerKvCache.append, then (optionally) the prompt's queries attended, which fills importance.
Loaded caches are compared with it field by field, bit for bit.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import struct
import sys
import threading

import numpy as np
import pytest

import kvcache as kc
from kvcache.quant import K4_BLOCK as B, K4_RING as RING, k4_values
from kvcache import wire
from kvcache.store import (BackendUnavailable, DirectoryBackend, MemoryBackend, StoreBackend,
                           PrefixStore, open_backend)
from kvcache.store import entry as store_entry
from kvcache.store.backend import ScatterBackend
from kvcache.store.keys import Geometry, as_ids, block_keys

L, G, D = 3, 2, 40           # D = 40: two key scale groups, rows not a multiple of 8 bytes in int8
MODES = ["f32", "q8", "q8k", "q8v", "q8:cmf", "q8k:cmf", "k8v4", "q4v", "q4", "k4v8"]
MAXPOS = 600


# -- helpers ----------------------------------------------------------------------------------
def _base(salt: int = 0):
    rng = np.random.default_rng(1234 + salt)
    k = rng.standard_normal((MAXPOS, L, G, D)).astype(np.float32)
    v = rng.standard_normal((MAXPOS, L, G, D)).astype(np.float32)
    q = rng.standard_normal((MAXPOS, L, 2 * G, D)).astype(np.float32)
    return k, v, q


_BASE = _base()


def rows_for(ids):
    """Deterministic K/V/Q for a prompt: position p's rows depend on p and ids[p]."""
    ids = np.asarray(ids, dtype=np.float32)
    n = ids.shape[0]
    shift = (ids[:, None, None, None] % 97) * np.float32(0.01)
    k, v, q = _BASE
    return k[:n] + shift, v[:n] - shift, q[:n] + shift


def cold(ids, mode, attend=True, n_layers=L):
    cache = kc.KvCache(n_layers, G, D, mode=mode)
    k, v, q = rows_for(ids)
    for i, layer in enumerate(cache.layers):
        if len(ids):
            layer.append(k[:, i], v[:, i])
            if attend:
                layer.attend_all_heads(q[:, i])
    return cache


def assert_same(a, b, importance=True):
    assert len(a.layers) == len(b.layers)
    for la, lb in zip(a.layers, b.layers):
        sa, sb = la.state(), lb.state()
        assert sa.mode == sb.mode
        assert sa.seq_len == sb.seq_len
        assert np.array_equal(sa.lengths, sb.lengths)
        n = int(sa.lengths.max(initial=0))
        stores_a, stores_b = sa.stores(), sb.stores()
        assert stores_a.keys() == stores_b.keys()
        for name in stores_a:
            if name == "kr":
                # 4-bit K's ring: the open block's rows are read by attention and must match;
                # a loaded cache holds the codes' values of the older, loaded rows there
                # (docs/kv4.md: the store keeps no float32 rows)
                for i in range(n // B * B, n):
                    assert stores_a[name][:, i % RING].tobytes() == stores_b[name][:, i % RING].tobytes()
                continue
            m = n
            if name in ("kc", "kp"):                     # the closed blocks only
                m = n // B * (B if name == "kc" else 1)
            x, y = stores_a[name][:, :m], stores_b[name][:, :m]
            assert x.tobytes() == y.tobytes(), name
        for name in ("kcol", "vcol", "kcol_on", "vcol_on"):
            assert getattr(sa, name).tobytes() == getattr(sb, name).tobytes(), name
        if importance:
            assert sa.importance.tobytes() == sb.importance.tobytes()
        assert sa.o1 is None and sb.o1 is None
        assert sa.linear_state.size == sb.linear_state.size == 0


def snapshot(cache):
    out = []
    for layer in cache.layers:
        st = layer.state()
        out.append((st.seq_len, st.lengths.tobytes(),
                    b"".join(a[:, : st.seq_len].tobytes() for a in st.stores().values()),
                    st.importance.tobytes(), st.kcol.tobytes(), st.vcol.tobytes(),
                    st.kcol_on.tobytes(), st.vcol_on.tobytes(), layer.generation))
    return out


def ids_of(n, seed=0):
    return np.random.default_rng(seed).integers(0, 50_000, n)


def block_for(mode):
    return 16 if mode == "f32" else 96   # int8 "cmf": past the column warm-up; 4-bit K: 3 blocks


@pytest.fixture(params=["memory", "dir"])
def backend(request, tmp_path):
    if request.param == "memory":
        return MemoryBackend()
    return DirectoryBackend(tmp_path / "store", fsync=False)


def entry_files(root):
    out = []
    for dirpath, _, files in os.walk(root):
        out += [os.path.join(dirpath, f) for f in files if f.endswith(".kvb")]
    return sorted(out)


# -- round trips ------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_round_trip_full_hit_is_bit_identical(backend, mode):
    b = block_for(mode)
    ids = ids_of(3 * b)
    ref = cold(ids, mode)
    store = PrefixStore(backend, fingerprint="model-a", block=b)
    assert store.put(ids, ref) == 3
    assert store.put(ids, ref) == 0                      # already stored
    fresh = kc.KvCache(L, G, D, mode=mode)
    assert store.longest_prefix(ids, fresh) == 3 * b
    assert store.load(ids, fresh) == 3 * b
    assert_same(fresh, ref)                              # importance too: same length as put
    if mode != "f32":          # cmf: the loaded columns are frozen; rows: never
        assert all(layer.state().kcol_on.all() == layer.mode.freezes_columns
                   or not layer.mode.quant_k for layer in fresh.layers)


@pytest.mark.parametrize("mode", MODES)
def test_round_trip_with_partial_last_block(backend, mode):
    b = block_for(mode)
    ids = ids_of(3 * b + b // 2)
    ref = cold(ids, mode)
    store = PrefixStore(backend, fingerprint="model-a", block=b)
    assert store.put(ids, ref) == 3
    fresh = kc.KvCache(L, G, D, mode=mode)
    assert store.load(ids, fresh) == 3 * b
    # rows, scales, columns and lengths equal a cold prefill of the loaded positions
    assert_same(fresh, cold(ids[: 3 * b], mode, attend=False), importance=False)
    # importance: what the storing cache held for those positions
    for lf, lr in zip(fresh.layers, ref.layers):
        assert lf.importance.tobytes() == lr.importance[: 3 * b].tobytes()
    # and the cache goes on like a cold one: append the rest, compare rows
    k, v, _ = rows_for(ids)
    for i, layer in enumerate(fresh.layers):
        layer.append(k[3 * b:, i], v[3 * b:, i])
    assert_same(fresh, cold(ids, mode, attend=False), importance=False)


@pytest.mark.parametrize("mode", ["f32", "q8"])
def test_partial_hits(backend, mode):
    b = block_for(mode)
    ids = ids_of(4 * b)
    store = PrefixStore(backend, fingerprint="m", block=b)
    assert store.put(ids, cold(ids, mode)) == 4
    probe = kc.KvCache(L, G, D, mode=mode)
    # a prompt that diverges inside block 2 shares blocks 0 and 1
    other = ids.copy()
    other[2 * b + 3] += 1
    assert store.longest_prefix(other, probe) == 2 * b
    fresh = kc.KvCache(L, G, D, mode=mode)
    assert store.load(other, fresh) == 2 * b
    assert_same(fresh, cold(other[: 2 * b], mode, attend=False), importance=False)
    # a shorter prompt: only its full blocks
    assert store.longest_prefix(ids[: 2 * b + 5], probe) == 2 * b
    # a prompt that differs in its first id shares nothing
    first = ids.copy()
    first[0] += 1
    assert store.longest_prefix(first, probe) == 0
    assert store.load(first, probe) == 0
    assert probe.seq_len == 0
    # shorter than a block
    assert store.longest_prefix(ids[: b - 1], probe) == 0
    assert store.put(ids[: b - 1], cold(ids[: b - 1], mode)) == 0


@pytest.mark.parametrize("mode", ["f32", "q8"])
def test_load_continues_a_cache_holding_whole_blocks(backend, mode):
    b = block_for(mode)
    ids = ids_of(3 * b)
    store = PrefixStore(backend, fingerprint="m", block=b)
    store.put(ids, cold(ids, mode))
    part = cold(ids[: 2 * b], mode, attend=False) if mode != "f32" else cold(ids[:b], mode,
                                                                               attend=False)
    m = part.seq_len
    assert store.load(ids, part) == 3 * b - m
    assert part.seq_len == 3 * b
    assert_same(part, cold(ids, mode, attend=False), importance=False)
    # nothing more to load: 0 and no change
    before = snapshot(part)
    assert store.load(ids, part) == 0
    assert snapshot(part) == before


def test_load_refuses_a_cache_not_on_a_block_boundary(backend):
    ids = ids_of(64)
    store = PrefixStore(backend, fingerprint="m", block=16)
    store.put(ids, cold(ids, "f32"))
    part = cold(ids[:20], "f32")
    before = snapshot(part)
    with pytest.raises(ValueError, match="multiple of block=16"):
        store.load(ids, part)
    assert snapshot(part) == before


def test_q8_columns_must_match_the_cache(backend):
    b = 80
    ids = ids_of(2 * b)
    store = PrefixStore(backend, fingerprint="m", block=b)
    store.put(ids, cold(ids, "q8:cmf"))
    other = ids_of(b, seed=9)                # another prompt: other rows, other columns
    part = cold(other, "q8:cmf", attend=False)   # ... which the caller claims is ids[:b]
    before = snapshot(part)
    assert store.load(ids, part) == 0
    assert snapshot(part) == before


def test_put_and_load_with_a_real_directory_default_spec(tmp_path):
    store = PrefixStore(str(tmp_path / "a" / "b"), fingerprint=b"\x00bytes-fp", block=16)
    assert isinstance(store.backend, DirectoryBackend)
    ids = ids_of(40)
    assert store.put(ids, cold(ids, "f32")) == 2
    files = entry_files(tmp_path / "a" / "b")
    assert len(files) == 2
    # fan-out: ROOT/<first two hex digits>/<key>.kvb
    for f in files:
        name = os.path.basename(f)
        assert os.path.basename(os.path.dirname(f)) == name[:2] and len(name) == 64 + 4
    fresh = kc.KvCache(L, G, D, mode="f32")
    assert PrefixStore(f"dir:{tmp_path}/a/b", fingerprint=b"\x00bytes-fp",
                       block=16).load(ids, fresh) == 32


# -- keys -------------------------------------------------------------------------------------
def test_keys_differ_by_fingerprint_mode_geometry_history_and_block():
    ids = as_ids(ids_of(64))
    base = Geometry(L, G, D, kc.KvMode.F32, 16)
    ref = block_keys(ids, b"fp", base)
    assert len(ref) == 4 and len(set(ref)) == 4 and all(len(k) == 32 for k in ref)
    variants = [
        block_keys(ids, b"fp2", base),
        block_keys(ids, b"fp", Geometry(L, G, D, kc.KvMode.Q8(), 16)),
        block_keys(ids, b"fp", Geometry(L, G, D, kc.KvMode.Q8(k=True, v=False), 16)),
        block_keys(ids, b"fp", Geometry(L, G, D, kc.KvMode.parse("q4v"), 16)),
        block_keys(ids, b"fp", Geometry(L, G, D, kc.KvMode.parse("k8v4"), 16)),
        block_keys(ids, b"fp", Geometry(L, G, D, kc.KvMode.parse("q4"), 16)),
        block_keys(ids, b"fp", Geometry(L, G, D, kc.KvMode.parse("q4k"), 16)),
        block_keys(ids, b"fp", Geometry(L + 1, G, D, kc.KvMode.F32, 16)),
        block_keys(ids, b"fp", Geometry(L, G + 1, D, kc.KvMode.F32, 16)),
        block_keys(ids, b"fp", Geometry(L, G, D + 1, kc.KvMode.F32, 16)),
    ]
    for keys in variants:
        assert not set(keys) & set(ref)
    other_block = block_keys(ids, b"fp", Geometry(L, G, D, kc.KvMode.F32, 32))
    assert not set(other_block) & set(ref)
    # history: changing block 0 changes every key; changing block 2 keeps blocks 0, 1
    h = ids.copy()
    h[0] += 1
    assert not set(block_keys(h, b"fp", base)) & set(ref)
    h = ids.copy()
    h[40] += 1
    got = block_keys(h, b"fp", base)
    assert got[:2] == ref[:2] and not set(got[2:]) & set(ref)
    # the same ids in any integer dtype give the same keys
    assert block_keys(as_ids(ids.astype(np.int32)), b"fp", base) == ref
    assert block_keys(as_ids(ids.tolist()), b"fp", base) == ref
    # the fingerprint's str form is its UTF-8 bytes
    s = PrefixStore("memory", fingerprint="fp", block=16)
    assert s.fingerprint == b"fp"


def test_store_misses_for_another_fingerprint_mode_or_geometry():
    backend = MemoryBackend()
    ids = ids_of(192)
    PrefixStore(backend, fingerprint="a", block=96).put(ids, cold(ids, "f32"))
    PrefixStore(backend, fingerprint="a", block=96).put(ids, cold(ids, "q8"))
    assert len(backend) == 4
    probe = kc.KvCache(L, G, D, mode="f32")
    assert PrefixStore(backend, fingerprint="b", block=96).longest_prefix(ids, probe) == 0
    assert PrefixStore(backend, fingerprint="a", block=96).longest_prefix(ids, probe) == 192
    assert PrefixStore(backend, fingerprint="a", block=96).longest_prefix(
        ids, kc.KvCache(L, G, D, mode="q8")) == 192
    assert PrefixStore(backend, fingerprint="a", block=96).longest_prefix(
        ids, kc.KvCache(L, G, D, mode="q8v")) == 0
    for mode in ("q4v", "k8v4", "q4", "q4k"):     # 4-bit: another mode than float32 or int8
        assert PrefixStore(backend, fingerprint="a", block=96).longest_prefix(
            ids, kc.KvCache(L, G, D, mode=mode)) == 0
    assert PrefixStore(backend, fingerprint="a", block=96).longest_prefix(
        ids, kc.KvCache(L - 1, G, D, mode="f32")) == 0
    assert PrefixStore(backend, fingerprint="a", block=48).longest_prefix(ids, probe) == 0


def test_an_entry_under_the_wrong_key_is_refused():
    """An entry copied under another key (a mix-up in a backend) is caught by the header."""
    backend = MemoryBackend()
    store = PrefixStore(backend, fingerprint="a", block=16)
    one, two = ids_of(16, seed=1), ids_of(16, seed=2)
    store.put(one, cold(one, "f32"))
    store.put(two, cold(two, "f32"))
    k1, k2 = backend.keys()
    backend.put(k2, backend.get_many([k1])[0])
    fresh = kc.KvCache(L, G, D, mode="f32")
    assert store.load(two, fresh) == 0 and fresh.seq_len == 0
    assert backend.contains_many([k1, k2]) == [True, False]


# -- entry layout -----------------------------------------------------------------------------
def test_entry_layout_matches_the_documented_header():
    ids = ids_of(80)
    backend = MemoryBackend()
    PrefixStore(backend, fingerprint="fp", block=80).put(ids, cold(ids, "q8"))
    (key,) = backend.keys()
    value = backend.get_many([key])[0]
    assert value[:8] == b"\x89KVBLOCK"
    version, alg, flags, hlen, total = struct.unpack_from("<HBBIQ", value, 8)
    assert (version, flags, hlen, total) == (1, 0, 96, len(value))
    assert alg == wire.default_algorithm()
    assert value[24:56].hex() == key
    assert struct.unpack_from("<IIIIIBBBB", value, 56) == (80, 0, L, G, D, 1, 1, 1, 0)
    geom = Geometry(L, G, D, kc.KvMode.Q8(), 80)       # scheme byte 1: "rows"
    assert len(value) == store_entry.entry_size(geom)
    # the trailer is kvcache.wire's digest of everything before it
    body = np.frombuffer(value, dtype=np.uint8)[:-8]
    assert struct.unpack_from("<Q", value, len(value) - 8)[0] == wire.digest(alg, body)
    # payload: the first layer's column state comes first
    st = cold(ids, "q8").layers[0].state()
    off = 96
    assert value[off: off + G] == st.kcol_on.tobytes()
    off += 8
    assert value[off: off + G] == st.vcol_on.tobytes()
    off += 8
    assert value[off: off + 4 * G * D] == st.kcol.tobytes()


def test_streamed_digest_equals_wire_digest():
    rng = np.random.default_rng(3)
    parts = [memoryview(rng.integers(0, 256, n, dtype=np.uint8).tobytes()) for n in (5, 0, 96, 4097)]
    whole = np.frombuffer(b"".join(parts), dtype=np.uint8)
    for alg in (wire.ALG_CRC32, wire.default_algorithm()):
        assert store_entry.digest_parts(alg, parts) == wire.digest(alg, whole)


# -- nothing wrong is ever loaded -------------------------------------------------------------
def _stored_prompt(backend, mode="f32", n_blocks=3, seed=0):
    b = block_for(mode)
    ids = ids_of(n_blocks * b, seed=seed)
    store = PrefixStore(backend, fingerprint="m", block=b)
    assert store.put(ids, cold(ids, mode)) == n_blocks
    return store, ids, b


def _check_loaded_prefix(store, ids, mode):
    """Load and check the result is a correct prefix (possibly empty); return its length."""
    fresh = kc.KvCache(L, G, D, mode=mode)
    n = store.load(ids, fresh)
    assert fresh.seq_len == n and n % store.block == 0
    if n:
        assert_same(fresh, cold(ids[:n], mode, attend=False), importance=False)
    return n


@pytest.mark.parametrize("mode", ["f32", "q8"])
def test_bit_flips_in_stored_files_are_misses(tmp_path, caplog, mode):
    rng = np.random.default_rng(7)
    root = tmp_path / "s"
    backend = DirectoryBackend(root, fsync=False)
    store, ids, b = _stored_prompt(backend, mode)
    files = entry_files(root)
    pristine = {f: open(f, "rb").read() for f in files}
    # which file is block i: the key chain
    order = [backend.path_of(k.hex()) for k in block_keys(
        as_ids(ids), b"m", Geometry(L, G, D, kc.KvMode.parse(mode), b))]
    trials = 30
    for t in range(trials):
        victim = order[t % 3]
        data = bytearray(pristine[victim])
        for _ in range(1 + t % 3):
            pos = int(rng.integers(0, len(data)))
            data[pos] ^= 1 << int(rng.integers(0, 8))
        for f, raw in pristine.items():
            with open(f, "wb") as fh:
                fh.write(bytes(data) if f == victim else raw)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvcache"):
            n = _check_loaded_prefix(store, ids, mode)
        assert n == order.index(victim) * b
        assert not os.path.exists(victim)                       # deleted
        assert sum("unusable" in r.getMessage() for r in caplog.records) == 1
        # a second load neither finds it nor logs again
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvcache"):
            assert _check_loaded_prefix(store, ids, mode) == n
        assert not caplog.records


def test_bit_flips_in_memory_values_are_misses(caplog):
    rng = np.random.default_rng(8)
    backend = MemoryBackend()
    store, ids, b = _stored_prompt(backend)
    keys = [k.hex() for k in block_keys(as_ids(ids), b"m", Geometry(L, G, D, kc.KvMode.F32, b))]
    pristine = dict(zip(keys, backend.get_many(keys)))
    for t in range(40):
        victim = keys[t % 3]
        data = bytearray(pristine[victim])
        pos = int(rng.integers(0, len(data)))
        data[pos] ^= 1 << int(rng.integers(0, 8))
        for k in keys:
            backend.put(k, bytes(data) if k == victim else pristine[k])
        with caplog.at_level(logging.WARNING, logger="kvcache"):
            n = _check_loaded_prefix(store, ids, "f32")
        assert n == keys.index(victim) * b
        assert victim not in backend.keys()


class _Buffers(MemoryBackend):
    """Values handed over as read-only views at an odd offset into a larger buffer, as the
    Redis backend hands over its inline values (BufferBackend); counts its calls."""

    calls = 0

    def get_many_buffers(self, keys):
        self.calls += 1
        return [None if v is None else memoryview(b"KVR1i" + v)[5:] for v in self.get_many(keys)]


@pytest.mark.parametrize("mode", ["f32", "q8", "q4", "k8v4"])
def test_entries_read_as_buffers_in_several_batches(caplog, monkeypatch, mode):
    """A backend's buffers load the same bits as its bytes, one entry per read batch; an
    entry damaged in the second batch ends the load there, is deleted and logged once."""
    from kvcache.store import prefix
    from kvcache.store.backend import BufferBackend
    backend = _Buffers()
    assert isinstance(backend, BufferBackend) and not isinstance(MemoryBackend(), BufferBackend)
    store, ids, b = _stored_prompt(backend, mode)
    monkeypatch.setattr(prefix, "_READ_BATCH_BYTES", 1)         # one entry per batch
    assert _check_loaded_prefix(store, ids, mode) == 3 * b and backend.calls == 3
    keys = [k.hex() for k in block_keys(as_ids(ids), b"m",
                                        Geometry(L, G, D, kc.KvMode.parse(mode), b))]
    data = bytearray(backend.get_many([keys[1]])[0])
    data[len(data) // 2] ^= 4
    backend.put(keys[1], bytes(data))
    with caplog.at_level(logging.WARNING, logger="kvcache"):
        assert _check_loaded_prefix(store, ids, mode) == b
    assert keys[1] not in backend.keys()
    assert sum("unusable" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("kind", ["memory", "dir"])
def test_truncated_or_padded_entries_are_misses(tmp_path, kind):
    rng = np.random.default_rng(9)
    backend = MemoryBackend() if kind == "memory" else DirectoryBackend(tmp_path, fsync=False)
    store, ids, b = _stored_prompt(backend, n_blocks=2)
    keys = [k.hex() for k in block_keys(as_ids(ids), b"m", Geometry(L, G, D, kc.KvMode.F32, b))]
    pristine = dict(zip(keys, backend.get_many(keys)))
    size = len(pristine[keys[0]])
    cuts = [0, 1, 95, 96, 103, size - 8, size - 1] + [int(x) for x in rng.integers(0, size, 8)]
    for cut in cuts:
        for k in keys:
            backend.put(k, pristine[k])
        backend.put(keys[1], pristine[keys[1]][:cut])
        assert _check_loaded_prefix(store, ids, "f32") == b
        assert backend.contains_many(keys) == [True, False]
    for k in keys:
        backend.put(k, pristine[k])
    backend.put(keys[0], pristine[keys[0]] + b"\x00" * 8)
    assert _check_loaded_prefix(store, ids, "f32") == 0
    assert backend.contains_many(keys) == [False, True]


def test_an_entry_of_another_format_version_is_a_miss():
    backend = MemoryBackend()
    store, ids, b = _stored_prompt(backend, n_blocks=1)
    (key,) = backend.keys()
    value = bytearray(backend.get_many([key])[0])
    value[8] = 2                                                # version 2, digest fixed up
    dig = wire.digest(value[10], np.frombuffer(bytes(value), dtype=np.uint8)[:-8])
    value[-8:] = struct.pack("<Q", dig)
    backend.put(key, bytes(value))
    assert _check_loaded_prefix(store, ids, "f32") == 0


@pytest.mark.parametrize("kind", ["memory", "dir"])
def test_an_xxh3_entry_without_xxhash_is_a_miss_that_stays(tmp_path, monkeypatch, kind):
    """A reader lacking xxhash cannot check an XXH3 entry: a miss, but the entry is fine for
    others and is not deleted."""
    assert wire.default_algorithm() == wire.ALG_XXH3          # xxhash is in the test extra
    backend = MemoryBackend() if kind == "memory" else DirectoryBackend(tmp_path, fsync=False)
    store, ids, b = _stored_prompt(backend, n_blocks=1)
    monkeypatch.setitem(sys.modules, "xxhash", None)          # `import xxhash` now fails
    assert wire.default_algorithm() == wire.ALG_CRC32
    assert _check_loaded_prefix(store, ids, "f32") == 0
    assert store.longest_prefix(ids, kc.KvCache(L, G, D, mode="f32")) == b
    monkeypatch.delitem(sys.modules, "xxhash")
    assert _check_loaded_prefix(store, ids, "f32") == b


# -- backend unavailable ----------------------------------------------------------------------
class _Down:
    name = "down://"

    def __init__(self):
        self.calls = 0

    def _fail(self, *args):
        self.calls += 1
        raise BackendUnavailable("connection refused")

    get_many = contains_many = put = delete = _fail

    def close(self):
        pass


def test_an_unavailable_backend_makes_the_store_a_no_op_with_one_warning(caplog):
    down = _Down()
    assert isinstance(down, StoreBackend)
    store = PrefixStore(down, fingerprint="m", block=16)
    ids = ids_of(48)
    ref = cold(ids, "f32")
    fresh = kc.KvCache(L, G, D, mode="f32")
    before = snapshot(fresh)
    with caplog.at_level(logging.WARNING, logger="kvcache"):
        assert store.put(ids, ref) == 0
        assert store.longest_prefix(ids, fresh) == 0
        assert store.load(ids, fresh) == 0
        assert store.put(ids, ref) == 0
    assert snapshot(fresh) == before
    assert not store.available
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "unavailable" in warnings[0].getMessage()
    assert down.calls == 1
    # bad inputs still raise (a no-op store does not hide caller bugs)
    with pytest.raises(TypeError):
        store.put(ids, "not a cache")


class _FailsMidway(MemoryBackend):
    """Answers lookups, then fails on reads: a server that went down between the two."""

    def get_many(self, keys):
        raise BackendUnavailable("timeout")

    def read_parts(self, key, parts):
        raise BackendUnavailable("timeout")


def test_a_backend_failing_during_load_changes_nothing(caplog):
    backend = _FailsMidway()
    store = PrefixStore(backend, fingerprint="m", block=16)
    ids = ids_of(48)
    store.put(ids, cold(ids, "f32"))
    part = cold(ids[:16], "f32")
    before = snapshot(part)
    with caplog.at_level(logging.WARNING, logger="kvcache"):
        assert store.load(ids, part) == 0
    assert snapshot(part) == before
    assert sum(r.levelno == logging.WARNING for r in caplog.records) == 1


def test_directory_errors_become_backend_unavailable(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_bytes(b"x")
    backend = DirectoryBackend(blocker / "sub", fsync=False)   # its parent is a file
    assert backend.contains_many(["ab12"]) == [False]
    assert backend.get_many(["ab12"]) == [None]
    with pytest.raises(BackendUnavailable):
        backend.put("ab12", b"value")
    store = PrefixStore(backend, fingerprint="m", block=16)
    ids = ids_of(16)
    assert store.put(ids, cold(ids, "f32")) == 0 and not store.available


# -- bad inputs -------------------------------------------------------------------------------
@pytest.mark.parametrize("ids, exc", [
    (np.zeros((2, 16), dtype=np.int64), ValueError),
    (np.zeros(16, dtype=np.float32), TypeError),
    (np.zeros(16, dtype=bool), TypeError),
    ("abcdefghijklmnop", TypeError),
    (b"abcdefghijklmnop", TypeError),
    (None, ValueError),
    (5, ValueError),
    (np.array([2 ** 64 - 1] * 16, dtype=np.uint64), ValueError),
])
def test_bad_ids_raise_and_change_nothing(ids, exc):
    backend = MemoryBackend()
    store = PrefixStore(backend, fingerprint="m", block=16)
    cache = cold(ids_of(16), "f32")
    empty = kc.KvCache(L, G, D, mode="f32")
    before, before_empty = snapshot(cache), snapshot(empty)
    with pytest.raises(exc, match="ids"):
        store.put(ids, cache)
    with pytest.raises(exc, match="ids"):
        store.longest_prefix(ids, cache)
    with pytest.raises(exc, match="ids"):
        store.load(ids, empty)
    assert snapshot(cache) == before and snapshot(empty) == before_empty and len(backend) == 0


@pytest.mark.parametrize("cache", [None, "cache", [1, 2], kc.LayerKvCache(G, D, mode="f32")])
def test_a_cache_of_the_wrong_type_raises(cache):
    store = PrefixStore(MemoryBackend(), fingerprint="m", block=16)
    for call in (store.put, store.longest_prefix, store.load):
        with pytest.raises(TypeError, match="cache"):
            call(ids_of(16), cache)


def test_caches_the_store_does_not_handle_are_refused():
    backend = MemoryBackend()
    store = PrefixStore(backend, fingerprint="m", block=16)
    ids = ids_of(32)
    # another length than ids
    with pytest.raises(ValueError, match="holds 32 positions, expected 16"):
        store.put(ids[:16], cold(ids, "f32"))
    # O(1) state
    c = cold(ids, "f32")
    c.layers[1].o1_begin(4, 8, 0)
    with pytest.raises(ValueError, match="O\\(1\\)"):
        store.put(ids, c)
    empty = kc.KvCache(L, G, D, mode="f32")
    empty.layers[0].o1_begin(4, 8, 0)
    with pytest.raises(ValueError, match="O\\(1\\)"):
        store.load(ids, empty)
    # linear state
    c = cold(ids, "f32")
    c.layers[0].linear_state = np.ones(4)
    with pytest.raises(ValueError, match="linear"):
        store.put(ids, c)
    # dead heads: a head holding fewer rows than positions
    c = kc.KvCache(L, G, D, mode="f32")
    k, v, _ = rows_for(ids)
    for i, layer in enumerate(c.layers):
        layer.append(k[:, i], v[:, i], alive=[True, i != 1])
    with pytest.raises(ValueError, match="dead heads or evicted"):
        store.put(ids, c)
    # eviction leaves rows that are no longer positions 0..n-1: refused, whatever ids say
    c = cold(ids, "f32")
    c.evict(20)
    with pytest.raises(ValueError, match="eviction dropped positions"):
        store.put(ids, c)
    with pytest.raises(ValueError, match="eviction dropped positions"):
        store.put(ids[:20], c)                       # ids of the right length: still refused
    with pytest.raises(ValueError, match="eviction dropped positions"):
        store.load(ids, c)
    c.clear()
    assert store.load(ids, c) == 0 or c.seq_len > 0  # a cleared layer is usable again
    # a q8 store in the legacy scheme needs block > 64
    with pytest.raises(ValueError, match="block > 64"):
        PrefixStore(backend, fingerprint="m", block=64).put(ids_of(128), cold(ids_of(128), "q8:cmf"))
    # a cmf cache rolled back below the column warm-up keeps frozen columns: refused
    c = cold(ids_of(100), "q8:cmf", attend=False)
    c.truncate_last(100 - 80 + 20)
    with pytest.raises(ValueError, match="frozen column"):
        PrefixStore(backend, fingerprint="m", block=80).put(ids_of(60), c)
    # layers in different modes
    c = kc.KvCache(2, G, D, mode="f32")
    c.layers[1] = kc.LayerKvCache(G, D, mode="q8")
    with pytest.raises(ValueError, match="one mode"):
        store.longest_prefix(ids, c)
    assert len(backend) == 0


def test_bad_store_arguments():
    with pytest.raises(TypeError, match="fingerprint"):
        PrefixStore("memory", fingerprint=None)          # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fingerprint"):
        PrefixStore("memory", fingerprint="")
    with pytest.raises(TypeError):
        PrefixStore("memory")                            # type: ignore[call-arg]
    for block in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="block"):
            PrefixStore("memory", fingerprint="m", block=block)
    with pytest.raises(TypeError, match="backend"):
        PrefixStore(42, fingerprint="m")                 # type: ignore[arg-type]
    with pytest.raises(ValueError, match="memory"):
        open_backend("memory:bogus")
    with pytest.raises(ValueError, match="byte count"):
        open_backend("memory:?budget=lots")


def test_open_backend_specs(tmp_path):
    m = open_backend("memory:?budget=1M")
    assert isinstance(m, MemoryBackend) and m.budget == 1 << 20
    d = open_backend(f"dir:{tmp_path}/x?budget=2G&fsync=1")
    assert isinstance(d, DirectoryBackend)
    assert (d.root, d.budget, d.fsync) == (str(tmp_path / "x"), 2 << 30, True)
    d = open_backend(tmp_path / "y")                      # fsync is off by default
    assert isinstance(d, DirectoryBackend) and not d.fsync and d.root == str(tmp_path / "y")
    d = open_backend(f"{tmp_path}/odd?name")              # '?' without options: part of the path
    assert isinstance(d, DirectoryBackend) and d.root.endswith("odd?name")
    assert open_backend(m) is m
    home = open_backend("~/kvcache-test-not-created")
    assert isinstance(home, DirectoryBackend) and not home.root.startswith("~")
    assert not os.path.exists(home.root)                  # created on the first put only


# -- backends ---------------------------------------------------------------------------------
def test_memory_backend_budget_and_lru():
    m = MemoryBackend(budget=300)
    for k in "abc":
        m.put(k + "k", bytes(100))
    assert m.nbytes == 300
    assert m.get_many(["ak"]) == [bytes(100)]           # 'ak' is now the most recent
    m.put("dk", bytes(100))
    assert m.contains_many(["ak", "bk", "ck", "dk"]) == [True, False, True, True]
    m.put("huge", bytes(301))                            # larger than the budget: not kept
    assert m.contains_many(["huge"]) == [False] and m.nbytes == 300
    m.put("ak", bytes(10))
    assert m.nbytes == 210
    m.delete("ak")
    m.delete("ak")
    assert m.nbytes == 200 and not isinstance(m, ScatterBackend)


def test_memory_backend_is_thread_safe():
    m = MemoryBackend(budget=50 * 1000)
    errors = []

    def work(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(2000):
                k = f"k{int(rng.integers(0, 200))}"
                if rng.random() < 0.5:
                    m.put(k, k.encode() * 100)
                else:
                    v = m.get_many([k])[0]
                    assert v is None or v == k.encode() * 100
        except Exception as exc:            # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert m.nbytes == sum(len(v) for v in m.get_many(m.keys())) <= m.budget


def test_directory_backend_budget_evicts_least_recently_read(tmp_path):
    d = DirectoryBackend(tmp_path, budget=10_000, fsync=False)
    keys = [f"{i:02x}key" for i in range(9)]
    for i, k in enumerate(keys):
        d.put(k, bytes([i]) * 1000)
        os.utime(d.path_of(k), (1000 + i, 1000 + i))    # a clear LRU order
    assert d.get_many([keys[0]]) == [bytes([0]) * 1000]  # read: now the most recent
    d.put("ffnew", bytes(3000))                          # 12 000 bytes > budget: evict to 9 000
    present = d.contains_many(keys + ["ffnew"])
    assert present[0] and present[-1]
    assert present[1:4] == [False, False, False] and all(present[4:])
    assert d.nbytes() <= 9_000
    # stale temporary files of dead writers are swept, fresh ones are left
    stale = tmp_path / "ff" / ".ffnew.1.dead.tmp"
    stale.write_bytes(b"x")
    os.utime(stale, (1, 1))
    fresh = tmp_path / "ff" / ".ffnew.2.live.tmp"
    fresh.write_bytes(b"x")
    d.scan()
    assert not stale.exists() and fresh.exists()


def test_directory_backend_parts_and_bad_keys(tmp_path):
    d = DirectoryBackend(tmp_path, fsync=True)
    assert isinstance(d, ScatterBackend) and isinstance(d, StoreBackend)
    d.put_parts("abcd", [memoryview(b"hello "), memoryview(b""), memoryview(b"world")])
    assert d.get_many(["abcd", "abce"]) == [b"hello world", None]
    a, b = bytearray(5), bytearray(6)
    assert d.read_parts("abcd", [memoryview(a), memoryview(b)]) == 11
    assert bytes(a + b) == b"hello world"
    assert d.read_parts("abcd", [memoryview(bytearray(4))]) == 11   # length says: not read
    assert d.read_parts("abce", [memoryview(a)]) is None
    assert not [f for f in os.listdir(tmp_path / "ab") if f.endswith(".tmp")]
    for bad in ("", "a", "../etc", "a/b", ".hidden"):
        with pytest.raises(ValueError, match="key"):
            d.put(bad, b"x")


# -- several processes ------------------------------------------------------------------------
def _write_same(root, barrier, seed):
    ids = ids_of(5 * 16, seed=seed)
    store = PrefixStore(DirectoryBackend(root, fsync=True), fingerprint="m", block=16)
    cache = cold(ids, "f32")
    barrier.wait()
    for _ in range(5):
        store.put(ids, cache)
        for f in entry_files(root):
            if np.random.random() < 0.3:                  # race the rewrites
                with contextlib.suppress(FileNotFoundError):   # the other process was first
                    os.unlink(f)


def test_two_processes_writing_the_same_blocks_at_once(tmp_path):
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_write_same, args=(str(tmp_path), barrier, 5)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    ids = ids_of(5 * 16, seed=5)
    store = PrefixStore(DirectoryBackend(tmp_path), fingerprint="m", block=16)
    store.put(ids, cold(ids, "f32"))                 # whatever the race deleted comes back
    fresh = kc.KvCache(L, G, D, mode="f32")
    assert store.load(ids, fresh) == 80
    assert_same(fresh, cold(ids, "f32"))
    leftovers = [f for _, _, fs in os.walk(tmp_path) for f in fs if f.endswith(".tmp")]
    assert not leftovers


def _fill_past_budget(root, n_prompts, done):
    store = PrefixStore(DirectoryBackend(root, budget=BUDGET, fsync=False), fingerprint="m",
                        block=16)
    for s in range(n_prompts):
        ids = ids_of(64, seed=100 + s)
        store.put(ids, cold(ids, "f32", attend=False))
    done.set()


def _read_while_filling(root, done, out):
    store = PrefixStore(DirectoryBackend(root, budget=BUDGET, fsync=False), fingerprint="m",
                        block=16)
    hits = misses = 0
    while not done.is_set() or hits + misses < 40:
        for s in range(0, 24, 3):
            ids = ids_of(64, seed=100 + s)
            fresh = kc.KvCache(L, G, D, mode="f32")
            n = store.load(ids, fresh)
            if n:
                assert_same(fresh, cold(ids[:n], "f32", attend=False))
                hits += 1
            else:
                misses += 1
    out.put((hits, misses))


BUDGET = 12 * 16 * L * 2 * G * D * 4        # about 12 blocks of this geometry


def test_directory_filled_past_its_budget_while_another_process_reads(tmp_path):
    ctx = mp.get_context("spawn")
    done, out = ctx.Event(), ctx.Queue()
    writer = ctx.Process(target=_fill_past_budget, args=(str(tmp_path), 24, done))
    reader = ctx.Process(target=_read_while_filling, args=(str(tmp_path), done, out))
    writer.start()
    reader.start()
    writer.join(180)
    hits, misses = out.get(timeout=180)
    reader.join(60)
    assert writer.exitcode == 0 and reader.exitcode == 0
    assert hits + misses >= 40
    d = DirectoryBackend(tmp_path, budget=BUDGET)
    assert d.nbytes() <= BUDGET + store_entry.entry_size(Geometry(L, G, D, kc.KvMode.F32, 16))


# -- what a hostile folder or URL may hold --------------------------------------------------------
def test_odd_files_at_entry_names_are_misses_and_keep_the_store_on(tmp_path):
    ids = ids_of(5 * 16)
    store = PrefixStore(DirectoryBackend(tmp_path, fsync=False), fingerprint="m", block=16)
    assert store.put(ids, cold(ids, "f32")) == 5
    first = store.backend.path_of(block_keys(
        as_ids(ids), b"m", Geometry(L, G, D, kc.KvMode.F32, 16))[0].hex())   # block 0's file
    for make in (os.mkfifo, os.mkdir, lambda p: os.symlink(p, p)):      # FIFO, folder, link loop
        os.remove(first) if os.path.lexists(first) and not os.path.isdir(first) else None
        if os.path.isdir(first):
            os.rmdir(first)
        make(first)
        fresh = kc.KvCache(L, G, D, mode="f32")
        assert store.load(ids, fresh) == 0 and fresh.seq_len == 0      # no hang, no error
        assert store.available
        assert store.put(ids, cold(ids, "f32")) in (0, 1)               # not stored over it


def test_unknown_schemes_and_nul_paths_are_refused(tmp_path):
    for spec in ("ftp://host/x", "s3://bucket/key", f"{tmp_path}/a\0b"):
        with pytest.raises(ValueError, match="scheme|NUL"):
            PrefixStore(spec, fingerprint="m")
    assert not any(tmp_path.iterdir())


def test_a_cache_without_layers_is_refused(tmp_path):
    store = PrefixStore(MemoryBackend(), fingerprint="m", block=4)
    with pytest.raises(ValueError, match="cache.layers"):
        store.put(range(8), kc.KvCache(0, 2, 8))
    assert store.longest_prefix(range(8), kc.KvCache(1, 2, 8)) == 0


def test_a_q8_load_into_a_mismatched_cache_keeps_the_entry(tmp_path):
    # the cache's own column fields differ: a miss for this load, the entry stays for others
    ids = ids_of(160)
    store = PrefixStore(DirectoryBackend(tmp_path, fsync=False), fingerprint="m", block=80)
    assert store.put(ids, cold(ids, "q8:cmf", attend=False)) == 2
    other = cold(ids_of(80, seed=5), "q8:cmf", attend=False)           # another first block
    assert store.load(ids, other) == 0 and other.seq_len == 80
    assert len(entry_files(tmp_path)) == 2
    fresh = kc.KvCache(L, G, D, mode="q8:cmf")
    assert store.load(ids, fresh) == 160
    assert_same(fresh, cold(ids, "q8:cmf", attend=False))


def test_a_read_only_folder_still_serves_reads(tmp_path, caplog, monkeypatch):
    # a folder shared read-only: writes are refused (EACCES), reads go on, one warning
    ids = ids_of(3 * 16)
    store = PrefixStore(DirectoryBackend(tmp_path, fsync=False), fingerprint="m", block=16)
    assert store.put(ids[:32], cold(ids[:32], "f32")) == 2
    import kvcache.store.directory as directory
    real_open = directory.os.open

    def no_create(path, flags, *args, **kwargs):     # root ignores permission bits: refuse here
        if flags & os.O_CREAT:
            raise PermissionError(13, "Permission denied", path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(directory.os, "open", no_create)
    with caplog.at_level(logging.WARNING, logger="kvcache"):
        store.put(ids, cold(ids, "f32"))                                # block 2: refused
        store.put(ids, cold(ids, "f32"))
        fresh = kc.KvCache(L, G, D, mode="f32")
        assert store.load(ids, fresh) == 32                             # reads still serve
    assert store.available
    assert len(entry_files(tmp_path)) == 2
    assert sum("reading only" in r.getMessage() for r in caplog.records) == 1
    assert_same(fresh, cold(ids[:32], "f32"))


def test_ids_beyond_int64_are_a_value_error():
    # Python ints past int64 make numpy pick float64 or object: still "does not fit", as documented
    for ids in ([2 ** 63, 1], [2 ** 100], [-(2 ** 63) - 1]):
        with pytest.raises(ValueError, match="signed 64-bit"):
            as_ids(ids)
    assert as_ids([2 ** 63 - 1, 0]).tolist() == [2 ** 63 - 1, 0]


def _k4_blocks(layer):
    """Every head's 4-bit K codes and block parameters (the closed blocks), as bytes."""
    return [[a.tobytes() for a in layer.k4_rows(h)[:2]] for h in range(layer.num_kv_heads)]


def test_a_shallow_rollback_into_loaded_four_bit_rows_replays_exactly():
    """A load leaves the codes' values in the ring (an entry carries no ring), so a rollback
    that stays within the ring still reopens a block from them: the loaded rows are found by
    their bits, and appending the same rows again gives back the block's codes and
    parameters (quantising it afresh would not, with a key channel far from zero)."""
    rng = np.random.default_rng(0)
    n, G, D = 128, 2, 16
    k = rng.standard_normal((n, G, D)).astype(np.float32)
    k[:, :, 3] = k[:, :, 3] * np.float32(0.3) + np.float32(300)
    v = rng.standard_normal((n, G, D)).astype(np.float32)
    src = kc.KvCache(1, G, D, max_seq_len=n, mode="q4")
    src.layers[0].append(k, v)
    store = PrefixStore("memory", fingerprint="shallow", block=B)
    assert store.put(np.arange(n), src) == n // B
    dst = kc.KvCache(1, G, D, max_seq_len=n, mode="q4")
    assert store.load(np.arange(n), dst) == n
    layer = dst.layers[0]
    layer.truncate_last(20)                 # reopens the block of rows 96..127 from the ring
    layer.append(k[108:], v[108:])
    assert _k4_blocks(layer) == _k4_blocks(src.layers[0])


@pytest.mark.parametrize("own", [64, 96])
def test_a_four_bit_load_rebuilds_the_ring_from_own_rows_and_loaded_codes(rng, own):
    """After a load into a cache that held ``own`` rows of its own, 4-bit K's ring holds the
    cache's original rows below ``own`` and the loaded codes' values above (an entry carries
    no ring); a rollback into the loaded rows then reads those values."""
    n, G, D = 128, 2, 16
    k = rng.standard_normal((n, G, D)).astype(np.float32)
    k[:, :, 3] = k[:, :, 3] * np.float32(0.3) + np.float32(300)      # a channel far off zero
    v = rng.standard_normal((n, G, D)).astype(np.float32)
    ids = np.arange(n)
    src = kc.KvCache(1, G, D, max_seq_len=n, mode="q4")
    src.layers[0].append(k, v)
    store = PrefixStore("memory", fingerprint="ring", block=B)
    assert store.put(ids, src) == n // B
    dst = kc.KvCache(1, G, D, max_seq_len=n, mode="q4")
    dst.layers[0].append(k[:own], v[:own])
    assert store.load(ids, dst) == n - own
    layer = dst.layers[0]
    values = []
    for h in range(G):
        codes, params, ring = layer.k4_rows(h)
        want_codes, want_params, _ = src.layers[0].k4_rows(h)
        assert codes.tobytes() == want_codes.tobytes()
        assert params.tobytes() == want_params.tobytes()
        values.append(k4_values(codes, params.view(np.uint16), n))
        for i in range(n - RING, n):
            want = k[i, h] if i < own else values[h][i]
            assert ring[i % RING].tobytes() == want.tobytes(), i
    layer.truncate_last(40)                 # reopens the block of rows 64..95
    for h in range(G):
        keys, _ = layer.head_rows(h)
        want = k[64:88, h] if own > 64 else values[h][64:88]
        assert keys[64:88].tobytes() == want.tobytes()
    layer.append(k[88:], v[88:])            # the same rows again: the blocks come back
    layer.truncate_last(70)                 # and from deeper, through the loaded rows
    layer.append(k[58:], v[58:])
    assert _k4_blocks(layer) == _k4_blocks(src.layers[0])
