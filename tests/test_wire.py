"""Byte formats (issue 4): the legacy wire layout and the versioned, checksummed format.

Golden bytes pin both layouts; round trips cover every mode and layer state; the decoders are
fuzzed exhaustively on small buffers (every truncation, every single-bit flip) and with
hypothesis (random bytes, structure-aware mutations with a recomputed digest); save() is
atomic under injected failures.
"""

from __future__ import annotations

import hashlib
import os
import struct
import zlib

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings, strategies as hst

import kvcache as kc
from kvcache import _wire_io, wire

F32 = kc.KvMode.F32
MODES = [kc.KvMode.F32, kc.KvMode.Q8(), kc.KvMode.Q8(k=True, v=False), kc.KvMode.Q8(k=False, v=True),
         kc.KvMode.Q8(scheme="cmf"), kc.KvMode.Q8(k=True, v=False, scheme="cmf"),
         kc.KvMode.Q8(k=False, v=True, scheme="cmf")]
MODE_IDS = ["f32", "q8", "q8k", "q8v", "q8:cmf", "q8k:cmf", "q8v:cmf"]


# ------------------------------------------------------------------------------------ helpers
def filled(mode, n=90, nkv=2, hd=8, seed=0, attend=True):
    rng = np.random.default_rng(seed)
    c = kc.LayerKvCache(nkv, hd, mode=mode)
    c.append(rng.standard_normal((n, nkv, hd)), rng.standard_normal((n, nkv, hd)))
    if attend and n:
        c.attend_all_heads(rng.standard_normal((min(n, 3), 2 * nkv, hd)))
    return c


def sealed(p=60, exact=False, nkv=2, hd=8, seed=1):
    rng = np.random.default_rng(seed)
    c = kc.LayerKvCache(nkv, hd, mode=F32)
    c.o1_begin(4, 40 if exact else 8, 2)
    c.o1_push_q(rng.standard_normal((p, 2 * nkv, hd)))
    c.append(rng.standard_normal((p, nkv, hd)), rng.standard_normal((p, nkv, hd)))
    assert c.o1_seal(2 * nkv)
    for _ in range(3):
        c.o1_step(rng.standard_normal((2 * nkv, hd)), rng.standard_normal((nkv, hd)),
                  rng.standard_normal((nkv, hd)), 2 * nkv)
    return c


def states():
    """(id, factory) of every layer state the versioned format must carry."""
    out = []
    for mode, mid in zip(MODES, MODE_IDS):
        out.append((f"{mid}-empty", lambda m=mode: kc.LayerKvCache(2, 8, mode=m)))
        out.append((f"{mid}-filled", lambda m=mode: filled(m)))
        out.append((f"{mid}-short", lambda m=mode: filled(m, n=5)))       # before the column freeze

        def dead(m=mode):
            c = filled(m, n=70)
            rng = np.random.default_rng(3)
            for i in range(6):
                c.append(rng.standard_normal((2, 8)), rng.standard_normal((2, 8)), alive=[i % 2 == 0, False])
            return c
        out.append((f"{mid}-dead-heads", dead))

        def evicted(m=mode):
            kv = kc.KvCache(1, 2, 8, mode=m, policy=kc.EvictionPolicy.born(sink=2))
            kv.layers[0] = filled(m, n=100)
            kv.evict(40)
            return kv.layers[0]
        out.append((f"{mid}-evicted", evicted))

        def truncated(m=mode):
            c = filled(m, n=80)
            c.truncate_last(7)
            return c
        out.append((f"{mid}-truncated", truncated))

        def linear(m=mode):
            c = filled(m, n=20)
            c.linear_state = [1.5, -2.0, 3.25]
            c.linear_scratch = [7.0]
            return c
        out.append((f"{mid}-linear", linear))

    def collecting():
        c = filled(F32, n=30, attend=False)
        c.o1_begin(4, 8, 2, "fm")
        c.o1_push_q(np.arange(30 * 4 * 8, dtype=np.float32).reshape(30, 4, 8))
        return c
    out.append(("o1-collecting", collecting))
    out.append(("o1-sealed", lambda: sealed()))
    out.append(("o1-sealed-exact-only", lambda: sealed(p=20, exact=True)))
    return out


STATES = states()


def observe(c, rng_seed=5):
    """Everything observable about a layer, plus its answers to the same queries."""
    rng = np.random.default_rng(rng_seed)
    nkv, hd = c.num_kv_heads, c.head_dim
    obs = {"mode": c.mode, "seq_len": c.seq_len, "mem": c.memory_bytes(),
           "o1_mem": c.o1_memory_bytes(), "sealed": c.o1_sealed(),
           "lens": [c.head_len(h) for h in range(nkv)],
           "imp": c.importance.tobytes(), "lin": c.linear_state.tobytes(),
           "scr": c.linear_scratch.tobytes(),
           "keys": [c.head_keys(h).tobytes() for h in range(nkv)],
           "values": [c.head_values(h).tobytes() for h in range(nkv)],
           "q8": [[None if a is None else a.tobytes() for a in c.q8_rows(h)] for h in range(nkv)],
           "cols": [[None if a is None else a.tobytes() for a in c.columns(h)] for h in range(nkv)]}
    if isinstance(c.o1, kc.o1.O1Collecting):
        obs["trace"] = c.o1.trace.tobytes()
    q = rng.standard_normal((2 * nkv, hd)).astype(np.float32)
    k = rng.standard_normal((nkv, hd)).astype(np.float32)
    if c.o1_sealed():
        obs["step"] = c.o1_step(q, k, k, 2 * nkv).tobytes()
        obs["after"] = c.o1.t_hat.tobytes()
    elif c.seq_len:
        obs["attend"] = [tuple(a.tobytes() for a in c.attend(q[h], h)) for h in range(nkv)]
        obs["all"] = c.attend_all_heads(q).tobytes()
        obs["imp_after"] = c.importance.tobytes()
        c.append(np.tile(k, (70, 1, 1)), np.tile(k, (70, 1, 1)))     # growth, column freeze
        obs["grown"] = c.attend_all_heads(q).tobytes()
        obs["cols_after"] = [[None if a is None else a.tobytes() for a in c.columns(h)] for h in range(nkv)]
    return obs


def reseal(buf, edit=None):
    """A copy of a versioned buffer with ``edit(bytearray)`` applied and a correct digest."""
    b = bytearray(buf)
    if edit is not None:
        edit(b)
    alg = b[11]
    body = bytes(b[:-8])
    d = xxhash.xxh3_64_intdigest(body) if alg == wire.ALG_XXH3 else zlib.crc32(body)
    b[-8:] = struct.pack("<Q", d)
    return bytes(b)


# ------------------------------------------------------------------------------------ legacy layout
def test_legacy_round_trip_reproduces_attention():
    rng = np.random.default_rng(0)
    c = kc.LayerKvCache(2, 4, mode=F32)
    for _ in range(5):
        c.append(rng.standard_normal((2, 4)), rng.standard_normal((2, 4)))
    c.linear_state = [0.5, -0.25, 1.0]
    buf = c.export_wire()
    assert isinstance(buf, bytes)
    assert len(buf) == 24 + 4 * (3 + 5) + 2 * (8 + 4 * (5 * 4 + 5 * 4))
    d = kc.LayerKvCache(2, 4, mode=F32)
    d.import_wire(buf)
    assert d.seq_len == 5 and d.linear_state.tolist() == [0.5, -0.25, 1.0]
    q = rng.standard_normal(4)
    for h in range(2):
        (o1, p1), (o2, p2) = c.attend(q, h), d.attend(q, h)
        assert o1.tobytes() == o2.tobytes() and p1.tobytes() == p2.tobytes()


def test_legacy_golden_bytes():
    c = kc.LayerKvCache(2, 2, mode=F32)
    c.append([[1.0, 2.0], [3.0, 4.0]], [[5.0, 6.0], [7.0, 8.0]])
    c.append([[0.5, -1.0], [0.0, 0.0]], [[1.0, 1.0], [2.0, 2.0]], alive=[True, False])
    c.linear_state = [0.25]
    c.accumulate_imp([0.75, 1.5])
    expect = struct.pack("<6I", 0, 2, 2, 2, 1, 2) + struct.pack("<3f", 0.25, 0.75, 1.5)
    expect += struct.pack("<I4f", 4, 1.0, 2.0, 0.5, -1.0) + struct.pack("<I4f", 4, 5.0, 6.0, 1.0, 1.0)
    expect += struct.pack("<I2f", 2, 3.0, 4.0) + struct.pack("<I2f", 2, 7.0, 8.0)
    assert c.export_wire() == expect
    half = struct.pack("<6I", 1, 2, 2, 2, 1, 2) + struct.pack("<3f", 0.25, 0.75, 1.5)
    half += struct.pack("<I4e", 4, 1.0, 2.0, 0.5, -1.0) + struct.pack("<I4e", 4, 5.0, 6.0, 1.0, 1.0)
    half += struct.pack("<I2e", 2, 3.0, 4.0) + struct.pack("<I2e", 2, 7.0, 8.0)
    assert c.export_wire(f16=True) == half
    assert hashlib.sha256(half).hexdigest()[:16] == "f704ce7822389339"


def test_legacy_f16_is_numpy_rounding():
    c = filled(F32, n=10, attend=False)
    d = kc.LayerKvCache(2, 8, mode=F32)
    d.import_wire(c.export_wire(f16=True))
    for h in range(2):
        want = c.head_keys(h).astype(np.float16).astype(np.float32)
        assert d.head_keys(h).tobytes() == want.tobytes()
    assert d.importance.tobytes() == c.importance.tobytes()      # always f32


@pytest.mark.parametrize("mode", MODES[1:], ids=MODE_IDS[1:])
def test_legacy_refuses_int8_storage(mode, snapshot, assert_same_state):
    c = filled(mode, n=10)
    before = snapshot(c)
    with pytest.raises(kc.WireError, match="F32"):
        c.export_wire()
    assert_same_state(before, snapshot(c))


def test_legacy_refuses_o1_state_and_frozen_columns():
    c = filled(F32, n=10)
    c.o1_begin(4, 8, 2)
    with pytest.raises(kc.WireError, match="Nyström"):
        c.export_wire()
    with pytest.raises(kc.WireError, match="Nyström"):
        sealed().export_wire()
    c = filled(F32, n=10)
    c._k.col_on[1] = 1                    # (an F32 cache never freezes columns by itself)
    with pytest.raises(kc.WireError, match="frozen columns"):
        c.export_wire()


def test_legacy_import_checks_geometry(snapshot, assert_same_state):
    buf = filled(F32, n=3, nkv=2, hd=4).export_wire()
    target = filled(F32, n=4, nkv=2, hd=8, seed=9)
    before = snapshot(target)
    with pytest.raises(kc.WireError, match="2×4") as info:
        target.import_wire(buf)
    assert "2×8" in str(info.value)
    assert_same_state(before, snapshot(target))


def _legacy(f16=0, seq=2, heads=((8, 8), (8, 8)), n_lin=1, n_imp=2, extra=b"", hd=4):
    out = struct.pack("<6I", f16, seq, len(heads), hd, n_lin, n_imp) + bytes(4 * (n_lin + n_imp))
    for nk, nv in heads:
        out += struct.pack("<I", nk) + bytes(nk * (2 if f16 else 4))
        out += struct.pack("<I", nv) + bytes(nv * (2 if f16 else 4))
    return out + extra


@pytest.mark.parametrize("buf,match", [
    (b"", "truncated header"), (_legacy()[:23], "truncated header"),
    (_legacy()[:-1], "truncated payload"), (_legacy()[:-36], "truncated header"),
    (_legacy(extra=b"\0"), "trailing"), (_legacy(heads=((6, 6), (8, 8))), "whole number"),
    (_legacy(heads=((8, 4), (8, 8))), "value rows"), (_legacy(heads=((12, 12), (8, 8))), "seq_len"),
    (_legacy(n_imp=3), "importance"),
    (struct.pack("<6I", 0, 2, 2, 4, 10**9, 2) + bytes(64), "truncated payload"),
    (struct.pack("<6I", 0, 1, 2, 4, 0, 1) + bytes(4) + struct.pack("<I", 2**32 - 4), "truncated payload")])
def test_legacy_import_rejects_bad_buffers_atomically(buf, match, snapshot, assert_same_state):
    target = filled(F32, n=7, nkv=2, hd=4)
    target.linear_state = [9.0]
    before = snapshot(target)
    with pytest.raises(kc.WireError, match=match):
        target.import_wire(buf)
    assert_same_state(before, snapshot(target))


def test_legacy_import_of_a_valid_handmade_buffer():
    c = kc.LayerKvCache(2, 4, mode=kc.KvMode.Q8())
    c.linear_scratch = [4.0]
    c.import_wire(_legacy())
    assert c.mode == F32 and c.seq_len == 2 and c.head_len(0) == 2
    assert c.linear_scratch.tolist() == [4.0]                 # untouched, as upstream
    assert c.attend_all_heads(np.ones((2, 4))).shape == (2, 4)


# ------------------------------------------------------------------------------------ versioned: round trips
@pytest.mark.parametrize("name,make", STATES, ids=[s[0] for s in STATES])
def test_round_trip_is_bit_exact(name, make):
    a, b = make(), make()
    buf = a.to_bytes(fingerprint="model-A")
    # another mode, but the buffer's int8 scheme: a layer keeps its scheme (test_q8_scheme.py)
    target = kc.LayerKvCache(2, 8, mode=kc.KvMode.Q8(k=False, v=True, scheme=a.mode.scheme or "rows"))
    target.linear_scratch = [123.0]
    target.install_bytes(buf, fingerprint="model-A")
    assert target.to_bytes(fingerprint="model-A") == buf       # re-export: the same bytes
    assert observe(target) == observe(b)


@pytest.mark.parametrize("name,make", STATES, ids=[s[0] for s in STATES])
def test_from_bytes_on_the_class_builds_an_equal_layer(name, make):
    a = make()
    buf = a.to_bytes(fingerprint="model-A")
    new = kc.LayerKvCache.from_bytes(buf, fingerprint="model-A")
    assert type(new) is kc.LayerKvCache and new is not a
    assert new.mode == a.mode and (new.num_kv_heads, new.head_dim) == (2, 8)
    assert new.to_bytes(fingerprint="model-A") == buf          # bit-identical round trip
    assert new.to_bytes(f16=True) == a.to_bytes(f16=True)
    observe(new)


def test_from_bytes_on_the_class_checks_everything_first():
    buf = filled(kc.KvMode.Q8(), n=12).to_bytes(fingerprint="m")
    with pytest.raises(kc.WireError, match="fingerprint"):
        kc.LayerKvCache.from_bytes(buf, fingerprint="other")
    for bad in (buf[:-1], buf[:40], b"", b"x" * len(buf)):
        with pytest.raises(kc.WireError):
            kc.LayerKvCache.from_bytes(bad)
    with pytest.raises(kc.WireError, match="whole KvCache"):
        kc.LayerKvCache.from_bytes(kc.KvCache(1, 2, 8).to_bytes())   # a whole-model buffer
    with pytest.raises(TypeError):
        kc.LayerKvCache.from_bytes("text")

    class Sub(kc.LayerKvCache):
        pass
    assert type(Sub.from_bytes(buf)) is Sub                     # built by the class it is called on


def test_from_bytes_on_an_instance_warns_and_installs(snapshot, assert_same_state):
    src = filled(kc.KvMode.Q8(), n=30)
    buf = src.to_bytes(fingerprint="m")
    target = kc.LayerKvCache(2, 8, mode=F32)
    with pytest.warns(DeprecationWarning, match=r"^kvcache\.LayerKvCache\.from_bytes\(\) on an "
                                                r"instance is deprecated; use install_bytes"):
        assert target.from_bytes(buf, fingerprint="m") is None   # the 0.1 meaning: in place
    assert target.to_bytes(fingerprint="m") == buf
    before = snapshot(target)
    with pytest.warns(DeprecationWarning), pytest.raises(kc.WireError):
        target.from_bytes(buf[:-3])                            # bad bytes: nothing changes
    assert_same_state(before, snapshot(target))
    with pytest.raises(kc.WireError, match="fingerprint"):
        target.install_bytes(buf, fingerprint="n")
    assert_same_state(before, snapshot(target))


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_round_trip_f16_rounds_only_float_rows(mode):
    c = filled(mode, n=80)
    d = kc.LayerKvCache(2, 8, mode=F32)
    d.install_bytes(c.to_bytes(f16=True))
    assert d.mode == mode and d.importance.tobytes() == c.importance.tobytes()
    for h in range(2):
        for got, want in ((d.head_keys(h), c.head_keys(h)), (d.head_values(h), c.head_values(h))):
            assert got.tobytes() == want.astype(np.float16).astype(np.float32).tobytes()
        for got, want in zip(d.q8_rows(h), c.q8_rows(h)):
            assert (got is None and want is None) or got.tobytes() == want.tobytes()
    assert len(c.to_bytes(f16=True)) < len(c.to_bytes()) or not mode.is_f32 and mode.quant_k and mode.quant_v


FOUR_BIT = ["q4", "k8v4", "q4k", "q4v", "k4v8"]


@pytest.mark.parametrize("name", FOUR_BIT)
def test_round_trip_f16_of_four_bit_modes_rounds_only_float_rows(name):
    """f16 halves the float32 rows only: 4-bit codes and parameters, int8 rows and 4-bit K's
    float32 ring travel as they are."""
    mode = kc.KvMode.parse(name)
    c = filled(mode, n=80)
    d = kc.LayerKvCache.from_bytes(c.to_bytes(f16=True))
    assert d.mode == mode and d.importance.tobytes() == c.importance.tobytes()
    for h in range(2):
        for got, want in ((d.head_keys(h), c.head_keys(h)), (d.head_values(h), c.head_values(h))):
            assert got.tobytes() == want.astype(np.float16).astype(np.float32).tobytes()
        for got_parts, want_parts in ((d.k4_rows(h), c.k4_rows(h)), (d.v4_rows(h), c.v4_rows(h)),
                                      (d.q8_rows(h), c.q8_rows(h))):
            for got, want in zip(got_parts, want_parts):
                assert (got is None and want is None) or got.tobytes() == want.tobytes()
    floats = mode.k_bits == 32 or mode.v_bits == 32
    assert (len(c.to_bytes(f16=True)) < len(c.to_bytes())) == floats


def test_a_crafted_four_bit_geometry_is_refused_before_any_storage(snapshot, assert_same_state):
    """A 4-bit layer body that claims head_dim 2**20 (4-bit K's ring alone would be 256 MiB)
    is refused from what the buffer lacks, allocating nothing of the sort."""
    import tracemalloc
    buf = bytearray(filled(kc.KvMode.parse("q4"), n=3, nkv=1).to_bytes())
    off = 32                                             # the header, empty fingerprint
    assert struct.unpack_from("<II", buf, off) == (1, 8)
    struct.pack_into("<I", buf, off + 4, 1 << 20)
    buf = reseal(buf)
    tracemalloc.start()
    try:
        with pytest.raises(kc.WireError, match="truncated"):
            kc.LayerKvCache.from_bytes(buf)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, peak


def test_golden_bytes_versioned(monkeypatch):
    c = kc.LayerKvCache(1, 2, mode=F32)
    c.append([[1.0, 2.0]], [[3.0, 4.0]])
    c.linear_state = [0.5]
    body = struct.pack("<IIBBBBBBH", 1, 2, 0, 0, 0, 0, 0, 0, 0) + struct.pack("<QQQQ", 1, 1, 1, 0)
    body += struct.pack("<Q", 1) + bytes([0, 0]) + bytes(6)
    body += struct.pack("<2f", 1, 1) + struct.pack("<2f", 1, 1)           # kcol, vcol (ones)
    body += struct.pack("<f", 0) + bytes(4)                               # importance, pad
    body += struct.pack("<f", 0.5) + bytes(4)                             # linear_state, pad
    body += struct.pack("<2f", 1, 2) + struct.pack("<2f", 3, 4)           # head 0 keys, values
    fp = b"llama-3-8b@rev1"
    head = wire.MAGIC + struct.pack("<HBBIQI", 3, 1, wire.ALG_XXH3, 0, 48 + len(body) + 8, len(fp))
    head += fp + bytes(5)                                                 # 28 + 15 -> 48
    expect = head + body
    expect += struct.pack("<Q", xxhash.xxh3_64_intdigest(expect))
    assert c.to_bytes(fingerprint=fp) == expect
    assert len(expect) == 168 and expect[-8:].hex() == "adfe46415bf1cf62"
    # the same body under a version-2 header (what kvcache wrote before 4-bit V) still reads
    v2 = expect[:8] + struct.pack("<H", 2) + expect[10:-8]
    v2 += struct.pack("<Q", xxhash.xxh3_64_intdigest(v2))
    assert v2[-8:].hex() == "ce225e9dd847ed0f"
    d = kc.LayerKvCache(1, 2, mode=F32)
    d.install_bytes(v2, fingerprint=fp)
    assert d.head_keys(0).tolist() == [[1.0, 2.0]] and d.head_values(0).tolist() == [[3.0, 4.0]]
    monkeypatch.setattr(_wire_io, "xxhash_module", lambda: None)                   # the zlib fallback
    crc = c.to_bytes(fingerprint=fp)
    assert crc[11] == wire.ALG_CRC32
    assert crc[:-8] == expect[:11] + bytes([wire.ALG_CRC32]) + expect[12:-8]
    assert crc[-8:] == struct.pack("<Q", zlib.crc32(crc[:-8]))


def test_crc32_buffers_read_everywhere_xxh3_needs_xxhash(monkeypatch):
    c = filled(F32, n=10)
    xx = c.to_bytes()
    assert xx[11] == wire.ALG_XXH3
    monkeypatch.setattr(_wire_io, "xxhash_module", lambda: None)
    crc = c.to_bytes()
    d = kc.LayerKvCache(2, 8, mode=F32)
    d.install_bytes(crc)
    assert observe(d) == observe(filled(F32, n=10))
    with pytest.raises(kc.WireError, match="xxhash"):
        d.install_bytes(xx)


def test_fingerprints():
    c = filled(F32, n=4)
    d = kc.LayerKvCache(2, 8, mode=F32)
    buf = c.to_bytes(fingerprint="modèle")
    d.install_bytes(buf, fingerprint="modèle".encode())           # str is stored as UTF-8
    d.install_bytes(buf)                                           # no fingerprint asked: not checked
    with pytest.raises(kc.WireError, match="fingerprint mismatch"):
        d.install_bytes(buf, fingerprint="other")
    with pytest.raises(kc.WireError, match="no fingerprint"):
        d.install_bytes(c.to_bytes(), fingerprint="modèle")
    for bad in (3, 2.5, ["a"]):
        with pytest.raises(TypeError):
            c.to_bytes(fingerprint=bad)
        with pytest.raises(TypeError):
            d.install_bytes(buf, fingerprint=bad)
    with pytest.raises(ValueError):
        c.to_bytes(fingerprint=bytes(70_000))


def test_geometry_mismatch_names_both_shapes(snapshot, assert_same_state):
    buf = filled(F32, n=4, nkv=2, hd=8).to_bytes()
    for nkv, hd in ((2, 4), (1, 8), (4, 8)):
        d = filled(F32, n=3, nkv=nkv, hd=hd)
        before = snapshot(d)
        with pytest.raises(kc.WireError, match="2×8") as info:
            d.install_bytes(buf)
        assert f"{nkv}×{hd}" in str(info.value)
        assert_same_state(before, snapshot(d))


def test_accepts_any_bytes_like_and_refuses_other_types():
    c = filled(F32, n=4)
    buf = c.to_bytes()
    for form in (bytearray(buf), memoryview(buf), np.frombuffer(buf, np.uint8)):
        d = kc.LayerKvCache(2, 8, mode=F32)
        d.install_bytes(form)
        assert d.seq_len == 4
    for bad in (None, 3, "text", [1, 2]):
        with pytest.raises(TypeError):
            kc.LayerKvCache(2, 8, mode=F32).install_bytes(bad)
        with pytest.raises(TypeError):
            kc.LayerKvCache(2, 8, mode=F32).import_wire(bad)


def test_version_kind_flags_and_magic_are_checked(snapshot, assert_same_state):
    buf = filled(F32, n=4).to_bytes()
    target = filled(F32, n=6, seed=4)
    before = snapshot(target)
    cases = [
        (reseal(buf, lambda b: b.__setitem__(slice(8, 10), struct.pack("<H", 4))), "version 4"),
        (reseal(buf, lambda b: b.__setitem__(slice(8, 10), struct.pack("<H", 0))), "version 0"),
        (reseal(buf, lambda b: b.__setitem__(10, 2)), "whole KvCache"),
        (reseal(buf, lambda b: b.__setitem__(10, 7)), "kind 7"),
        (reseal(buf, lambda b: b.__setitem__(slice(12, 16), struct.pack("<I", 1))), "flags"),
        (reseal(buf, lambda b: b.__setitem__(11, 9)), "digest algorithm 9"),
        (b"GGUF" + buf[4:], "not a kvcache buffer"),
        (filled(F32, n=4).export_wire(), "not a kvcache buffer|truncated"),
        (buf + b"\0", "trailing"), (buf[:-1], "truncated"), (b"", "truncated"),
    ]
    for bad, match in cases:
        with pytest.raises(kc.WireError, match=match):
            target.install_bytes(bad)
        assert_same_state(before, snapshot(target))


@pytest.mark.parametrize("edit,match", [
    (lambda b, o: b.__setitem__(slice(o + 16, o + 24), struct.pack("<Q", 3)), "head holds more rows|importance"),
    (lambda b, o: b.__setitem__(slice(o + 24, o + 32), struct.pack("<Q", 5)), "importance covers"),
    (lambda b, o: b.__setitem__(o + 8, 3), "invalid layer flags"),
    (lambda b, o: b.__setitem__(o + 10, 2), "sealed O\\(1\\) layer|truncated|inconsistent"),
    (lambda b, o: b.__setitem__(slice(o + 32, o + 40), struct.pack("<Q", 2**40)), "truncated"),
    (lambda b, o: b.__setitem__(slice(o + 48, o + 56), struct.pack("<Q", 2**62)), "more rows"),
    (lambda b, o: b.__setitem__(o + 64, 1), "frozen columns on a component not stored as int8"),
    (lambda b, o: b.__setitem__(o + 12, 1), "invalid int8 scheme byte 1"),     # f32 says "rows"
    (lambda b, o: b.__setitem__(o + 13, 1), "invalid layer flags"),            # reserved
    (lambda b, o: b.__setitem__(o + 15, 1), "invalid layer flags"),            # reserved
])
def test_valid_digest_but_inconsistent_body_is_refused(edit, match, snapshot, assert_same_state):
    c = filled(F32, n=4)
    buf = c.to_bytes()
    off = 32                                                    # body start (no fingerprint)
    bad = reseal(buf, lambda b: edit(b, off))
    target = filled(F32, n=6, seed=4)
    before = snapshot(target)
    with pytest.raises(kc.WireError, match=match):
        target.install_bytes(bad)
    assert_same_state(before, snapshot(target))


def test_model_and_layer_buffers_do_not_mix(tmp_path):
    kv = kc.KvCache(2, 2, 8, mode=F32)
    path = tmp_path / "m.kvc"
    kv.save(path)
    with pytest.raises(kc.WireError, match="whole KvCache"):
        kc.LayerKvCache(2, 8, mode=F32).install_bytes(path.read_bytes())
    (tmp_path / "l.kvc").write_bytes(filled(F32, n=3).to_bytes())
    with pytest.raises(kc.WireError, match="one LayerKvCache"):
        kc.KvCache.load(tmp_path / "l.kvc")


# ------------------------------------------------------------------------------------ fuzzing
SMALL = {  # small valid buffers of different shapes, for the exhaustive sweeps
    "f32": lambda: filled(F32, n=3, nkv=2, hd=4).to_bytes(fingerprint="fp"),
    "q8": lambda: filled(kc.KvMode.Q8(), n=66, nkv=1, hd=4).to_bytes(),
    "sealed": lambda: sealed(p=40, nkv=1, hd=4).to_bytes(),
    "legacy": lambda: filled(F32, n=3, nkv=2, hd=4).export_wire(),
}


@pytest.mark.parametrize("kind", list(SMALL))
def test_every_truncation_is_refused(kind, snapshot, assert_same_state):
    buf = SMALL[kind]()
    nkv, hd = (1, 4) if kind in ("q8", "sealed") else (2, 4)
    target = filled(F32, n=5, nkv=nkv, hd=hd, seed=8)
    before = snapshot(target)
    load = target.import_wire if kind == "legacy" else target.install_bytes
    for n in range(len(buf)):
        with pytest.raises(kc.WireError):
            load(buf[:n])
    assert_same_state(before, snapshot(target))
    load(buf)                                                     # the whole buffer is fine


@pytest.mark.parametrize("kind", ["f32", "q8", "sealed"])
def test_every_single_bit_flip_is_detected(kind, snapshot, assert_same_state):
    buf = SMALL[kind]()
    nkv, hd = (1, 4) if kind in ("q8", "sealed") else (2, 4)
    target = filled(F32, n=5, nkv=nkv, hd=hd, seed=8)
    before = snapshot(target)
    flipped = bytearray(buf)
    count = 0
    for i in range(len(buf)):
        for bit in range(8):
            flipped[i] ^= 1 << bit
            with pytest.raises(kc.WireError):
                target.install_bytes(flipped)
            flipped[i] ^= 1 << bit
            count += 1
    assert count == 8 * len(buf)
    assert_same_state(before, snapshot(target))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=hst.binary(min_size=0, max_size=400))
def test_random_bytes_are_refused(data):
    target = kc.LayerKvCache(2, 4, mode=F32)
    with pytest.raises(kc.WireError):
        target.install_bytes(data)
    with pytest.raises(kc.WireError):
        wire.model_from_bytes(kc.KvCache, data)
    try:
        target.import_wire(data)
    except kc.WireError:
        return
    # a few random bytes can form a valid legacy buffer (e.g. all-zero lengths): it must work
    assert target.mode == F32
    if target.seq_len and target.head_len(0) and target.head_len(1):
        assert target.attend_all_heads(np.ones((2, 4))).shape == (2, 4)


def test_crafted_lengths_do_not_allocate_what_the_buffer_lacks(snapshot, assert_same_state):
    # a valid digest over a body whose dead head 1 claims every position's rows: the row
    # bytes are checked to be present before any storage is allocated
    n = 1 << 12
    c = kc.LayerKvCache(2, 4, mode=F32)
    c.append(np.ones((n, 2, 4)), np.ones((n, 2, 4)), alive=[True, False])
    buf = bytearray(c.to_bytes())
    off = 32
    assert struct.unpack_from("<QQ", buf, off + 48) == (n, 0)
    struct.pack_into("<Q", buf, off + 56, n)
    target = filled(F32, n=2, nkv=2, hd=4)
    before = snapshot(target)
    with pytest.raises(kc.WireError, match="head lengths"):
        target.install_bytes(reseal(buf))
    assert_same_state(before, snapshot(target))


@settings(max_examples=400, deadline=None)
@given(which=hst.sampled_from(["f32", "q8", "sealed"]), pos=hst.integers(0, 10**6),
       value=hst.integers(0, 255), bit=hst.integers(0, 7), flip=hst.booleans())
def test_mutated_bodies_with_valid_digests_never_crash(which, pos, value, bit, flip):
    """Structure-aware fuzz: change one byte, recompute the digest: the decoder must either
    refuse with WireError or install a state that then works."""
    buf = SMALL[which]()
    nkv, hd = (1, 4) if which in ("q8", "sealed") else (2, 4)
    i = 32 + 8 + pos % (len(buf) - 48)            # inside the body (after header + fingerprint)

    def edit(b):
        b[i] = b[i] ^ (1 << bit) if flip else value
    bad = reseal(buf, edit)
    target = kc.LayerKvCache(nkv, hd, mode=F32)
    try:
        target.install_bytes(bad)
    except kc.WireError:
        return
    # accepted: it is a consistent layer; it re-exports to the same bytes, and it works
    again = target.to_bytes()
    twin = kc.LayerKvCache(nkv, hd, mode=F32)
    twin.install_bytes(again)
    assert twin.to_bytes() == again
    target.memory_bytes()
    if target.o1_sealed():
        target.o1_step(np.ones((target.o1.num_heads, hd)), np.ones((nkv, hd)), np.ones((nkv, hd)),
                       target.o1.num_heads)
    elif target.seq_len and all(target.head_len(h) for h in range(nkv)):
        target.attend_all_heads(np.ones((nkv, hd)))
    target.append(np.ones((nkv, hd)), np.ones((nkv, hd))) if not target.o1_sealed() else None
    assert target.to_bytes() is not None


# ------------------------------------------------------------------------------------ KvCache save / load
def model(seed=0):
    rng = np.random.default_rng(seed)
    kv = kc.KvCache(3, 2, 8, max_seq_len=500, policy=kc.EvictionPolicy.born(sink=3), mode=kc.KvMode.Q8())
    for i, layer in enumerate(kv.layers):
        layer.append(rng.standard_normal((70 + i, 2, 8)), rng.standard_normal((70 + i, 2, 8)))
        layer.attend_all_heads(rng.standard_normal((4, 8)))
    kv.layers[1].linear_state = [1.0, 2.0]
    return kv


def test_save_load_round_trip(tmp_path):
    kv = model()
    path = tmp_path / "cache.kvc"
    kv.save(path, fingerprint="m")
    back = kc.KvCache.load(path, fingerprint="m")
    assert (back.max_seq_len, back.policy, back.mode, back.num_kv_heads, back.head_dim) == \
        (500, kc.EvictionPolicy.born(sink=3), kc.KvMode.Q8(), 2, 8)
    assert len(back.layers) == 3 and back.memory_bytes() == kv.memory_bytes()
    for a, b in zip(kv.layers, back.layers):
        assert observe(a) == observe(b)
    assert os.listdir(tmp_path) == ["cache.kvc"]
    with pytest.raises(kc.WireError, match="fingerprint"):
        kc.KvCache.load(path, fingerprint="n")
    empty = kc.KvCache(0, 1, 4)
    empty.save(tmp_path / "e.kvc")
    assert kc.KvCache.load(tmp_path / "e.kvc").layers == []


def test_kvcache_to_bytes_is_the_file_and_from_bytes_builds_a_new_cache(tmp_path):
    kv = model()
    kv.save(tmp_path / "c.kvc", fingerprint="m")
    buf = kv.to_bytes(fingerprint="m")
    assert (tmp_path / "c.kvc").read_bytes() == buf
    back = kc.KvCache.from_bytes(buf, fingerprint="m")
    assert back is not kv and back.to_bytes(fingerprint="m") == buf
    assert (back.max_seq_len, back.policy, back.mode) == (kv.max_seq_len, kv.policy, kv.mode)
    half = kv.to_bytes(f16=True)
    assert kc.KvCache.from_bytes(half).to_bytes(f16=True) == half
    with pytest.raises(kc.WireError, match="fingerprint"):
        kc.KvCache.from_bytes(buf, fingerprint="n")
    with pytest.raises(kc.WireError):
        kc.KvCache.from_bytes(buf[:-1])
    with pytest.raises(kc.WireError):
        kc.KvCache.from_bytes(kv.layers[0].to_bytes())         # a layer buffer


def test_save_carries_mixed_layer_states(tmp_path):
    kv = kc.KvCache(2, 2, 8, mode=F32)
    kv.layers[1] = sealed()
    kv.layers[0] = filled(F32, n=63)
    kv.save(tmp_path / "m.kvc", f16=True)
    back = kc.KvCache.load(tmp_path / "m.kvc")
    assert back.layers[1].o1_sealed() and not back.layers[0].o1_sealed()
    assert back.layers[1].o1_memory_bytes() == kv.layers[1].o1_memory_bytes()


def test_load_refuses_damaged_files(tmp_path):
    path = tmp_path / "m.kvc"
    model().save(path)
    data = path.read_bytes()
    for bad in (data[:-1], data[: len(data) // 2], b"", data + b"x",
                data[:100] + bytes([data[100] ^ 4]) + data[101:]):
        path.write_bytes(bad)
        with pytest.raises(kc.WireError):
            kc.KvCache.load(path)
    with pytest.raises(FileNotFoundError):
        kc.KvCache.load(tmp_path / "missing.kvc")


class Boom(Exception):
    pass


def test_save_is_atomic_under_a_failed_write(tmp_path, monkeypatch):
    path = tmp_path / "cache.kvc"
    model(1).save(path)
    old = path.read_bytes()
    real = wire._Plan.write_file

    def crash(self, fh, hasher):
        fh.write(b"partial")
        raise Boom("disk full")
    monkeypatch.setattr(wire._Plan, "write_file", crash)
    with pytest.raises(Boom):
        model(2).save(path)
    assert path.read_bytes() == old                            # the old file is intact
    assert os.listdir(tmp_path) == ["cache.kvc"]               # no temporary left behind
    monkeypatch.setattr(wire._Plan, "write_file", real)
    monkeypatch.setattr(os, "replace", lambda *a: (_ for _ in ()).throw(Boom("rename")))
    with pytest.raises(Boom):
        model(2).save(tmp_path / "new.kvc")
    assert os.listdir(tmp_path) == ["cache.kvc"]


def test_save_fsyncs_before_rename(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append("replace"), real_replace(a, b))[1])
    model().save(tmp_path / "m.kvc")
    assert events[:2] == ["fsync", "replace"]


LEGACY_STATES = [s for s in STATES if s[0].startswith("f32-")]


@pytest.mark.parametrize("f16", [False, True])
@pytest.mark.parametrize("name,make", LEGACY_STATES, ids=[s[0] for s in LEGACY_STATES])
def test_legacy_round_trip_of_every_f32_state(name, make, f16):
    a, b = make(), make()
    d = kc.LayerKvCache(2, 8, mode=kc.KvMode.Q8())
    d.import_wire(a.export_wire(f16=f16))
    if not f16:
        d.linear_scratch = b.linear_scratch          # the legacy layout does not carry it
        assert observe(d) == observe(b)
    else:
        assert d.importance.tobytes() == b.importance.tobytes() and d.memory_bytes() == b.memory_bytes()
        for h in range(2):
            assert d.head_values(h).tobytes() == b.head_values(h).astype(np.float16).astype(np.float32).tobytes()


# ------------------------------------------------------------------------------------ review findings
@pytest.mark.parametrize("value", [2**62, 2**63, 2**64 - 1])
def test_huge_counts_are_refused_not_overflowing(value, snapshot, assert_same_state):
    c = filled(F32, n=4, nkv=2, hd=4, attend=False)
    buf = c.to_bytes()
    target = filled(F32, n=2, nkv=2, hd=4)
    before = snapshot(target)
    for field in (16, 24, 48, 56):                    # seq_len, imp_len, head lengths
        bad = reseal(buf, lambda b: struct.pack_into("<Q", b, 32 + field, value))
        with pytest.raises(kc.WireError):
            target.install_bytes(bad)
    assert_same_state(before, snapshot(target))


def test_reader_refuses_to_amplify_memory(monkeypatch):
    """A body may not make the reader allocate much more than its own size (dense stores of
    mostly dead heads, O(1) scratch): the guard is checked by shrinking its budget to zero."""
    bufs = {"rows": filled(F32, n=40).to_bytes(), "sealed": sealed().to_bytes()}
    monkeypatch.setattr(wire, "_ALLOC_FACTOR", 0)
    monkeypatch.setattr(wire, "_ALLOC_SLACK", 0)
    with pytest.raises(kc.WireError, match="storage"):
        kc.LayerKvCache(2, 8, mode=F32).install_bytes(bufs["rows"])
    with pytest.raises(kc.WireError, match="scratch"):
        kc.LayerKvCache(2, 8, mode=F32).install_bytes(bufs["sealed"])


def test_implausible_positions_are_refused():
    c = sealed()
    buf = c.to_bytes()
    # the sealed parameters follow the (empty) rows; bump seq_len and far_len together
    o1 = c.o1
    body = 32
    i = buf.index(struct.pack("<QQQQ", o1.w, o1.win_len, o1.win_head, o1.far_len))

    def edit(b):
        struct.pack_into("<Q", b, body + 16, 2**60 + o1.w + o1.sink)
        struct.pack_into("<Q", b, i + 24, 2**60)
    with pytest.raises(kc.WireError, match="implausible"):
        kc.LayerKvCache(2, 8, mode=F32).install_bytes(reseal(buf, edit))


def test_unfrozen_column_fields_must_be_ones():
    c = filled(kc.KvMode.Q8(k=False, v=True), n=10, attend=False)   # no column frozen yet
    buf = c.to_bytes()
    off = 32 + 16 + 32 + 16 + 8 + 4 * 2 * 8                          # the vcol array
    bad = reseal(buf, lambda b: struct.pack_into("<f", b, off, 2.0))
    with pytest.raises(kc.WireError, match="vcol"):
        kc.LayerKvCache(2, 8, mode=F32).install_bytes(bad)


def test_writer_refuses_what_the_reader_would_refuse(tmp_path):
    kv = kc.KvCache(2, 2, 8, mode=F32)
    kv.layers[1] = kc.LayerKvCache(2, 4, mode=F32)
    with pytest.raises(kc.WireError, match="layer 1 is 2×4"):
        kv.save(tmp_path / "m.kvc")
    assert os.listdir(tmp_path) == []
    c = kc.LayerKvCache(2, 8, mode=F32)
    with pytest.raises(ValueError):
        c.o1_begin(2**32, 8, 2)
    assert c.o1 is None


def test_legacy_accepts_importance_shorter_than_seq_len():
    # what the upstream engine sends for a layer whose importance was never accumulated
    buf = struct.pack("<6I", 0, 12, 2, 4, 3, 0) + struct.pack("<3f", 1, 2, 3)
    buf += struct.pack("<II", 0, 0) * 2
    c = kc.LayerKvCache(2, 4, mode=F32)
    c.import_wire(buf)
    assert c.seq_len == 12 and c.importance.shape == (0,) and c.linear_state.tolist() == [1, 2, 3]
    c.append(np.ones((2, 4)), np.ones((2, 4)))
    assert c.attend_all_heads(np.ones((2, 4))).shape == (2, 4)
    d = kc.LayerKvCache(2, 4, mode=F32)
    d.install_bytes(c.to_bytes())
    assert observe(d) == observe(c)


def test_legacy_refusal_order_puts_int8_first():
    c = filled(kc.KvMode.Q8(), n=10)
    c.o1_begin(4, 8, 2)
    with pytest.raises(kc.WireError, match="F32"):
        c.export_wire()


def test_f16_round_trip_attention_within_f16_rounding():
    c = filled(F32, n=200)
    d = kc.LayerKvCache(2, 8, mode=F32)
    d.install_bytes(c.to_bytes(f16=True))
    q = np.random.default_rng(3).standard_normal((4, 8)).astype(np.float32)
    np.testing.assert_allclose(d.attend_all_heads(q), c.attend_all_heads(q), rtol=0, atol=5e-3)


def test_policy_and_permissions_survive_save(tmp_path):
    kv = kc.KvCache(1, 2, 8, policy=kc.EvictionPolicy("recent", 5), mode=F32)
    path = tmp_path / "m.kvc"
    kv.save(path)
    assert kc.KvCache.load(path).policy == kc.EvictionPolicy("recent", 5)
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask


def test_fresh_bytes_writer_keeps_its_bytes_alive():
    from kvcache import _core
    b, writer = _core.fresh_bytes(8 << 20)
    del b
    arr = np.frombuffer(writer, np.uint8)
    arr[0], arr[-1] = 1, 2
    assert arr[-1] == 2
    with pytest.raises(ValueError):
        _core.fresh_bytes(-1)


GOLDEN_PINNED = {  # sha256 of deterministic buffers: pins every section's layout (and the digest)
    # (q8, q8_rows and model re-taken when q8 importance came from integer scoring)
    "q8": "9599d8a6bbd6e2f889221bb7683492655dcb3bc05d533a4c5158e3a5e5a1d923",
    "q8_rows": "54acc853416170fed2c2ce6b99b297859f6e5b502687f712cdcef83241b34473",
    "collecting": "bd2b54be01eb8150442b672943db1912cbf281a05a5c53992da963b6410716b8",
    "sealed": "f43b55bc65f8640e13652e6142a724be5b18591b877b92e67c6bfd95cc934b14",
    "model": "6848b3f6d5b7a57ce4b9d903c221ec9e0bce2fdbf529ce946a092efec0d759a2",
}
GOLDEN_PINNED_V1 = {  # the same buffers as format version 1 wrote them (before the scheme byte);
    # the q8 and model buffers carry importance from q8 scoring, re-taken with integer scoring
    "q8": "6cfee2baeb6d2e9babecf55b333e44e485329dfdc9b1ef4ff4715097ec2cc448",
    "collecting": "daaa151ce88ca4b6532501b6a6fa4a8cf16512545d67015f059390d14ce6dca7",
    "sealed": "d1439ca84ae56710825aab40e7e6fdb13ca38a3049c1bfd5a246406ba8199d4d",
    "model": "7452cf403641830386658a52ad3005c91464633c40d0fdf4a30e5245333db9d4",
}


def exact_rows(n, nkv, hd, seed):
    """Deterministic rows of exactly representable values (no RNG, no libm): golden inputs."""
    i = np.arange(n * nkv * hd, dtype=np.int64).reshape(n, nkv, hd)
    return (((i * 7 + seed * 13) % 23) - 11).astype(np.float32) / 8


def exact_layer(mode, n, nkv=2, hd=8, seed=0):
    c = kc.LayerKvCache(nkv, hd, mode=mode)
    c.append(exact_rows(n, nkv, hd, seed), exact_rows(n, nkv, hd, seed + 1))
    # importance from the decode kernel (prefill=False): the values these pins were taken
    # with, so the digests keep pinning the byte layout and not a kernel's rounding
    c.attend_all_heads(exact_rows(3, 2 * nkv, hd, seed + 2), prefill=False)
    return c


def golden_buffers(tmp_path):
    out = {"q8": exact_layer(kc.KvMode.Q8(scheme="cmf"), 70, seed=11).to_bytes(fingerprint="g"),
           "q8_rows": exact_layer(kc.KvMode.Q8(), 70, seed=11).to_bytes(fingerprint="g")}
    c = exact_layer(F32, 30, seed=3)
    c.o1_begin(4, 8, 2, "fm")
    c.o1_push_q(exact_rows(30, 4, 8, 5))
    out["collecting"] = c.to_bytes()
    assert c.o1_seal(4)
    for name in ("win_k", "win_v", "sink_k", "sink_v", "k_tilde", "q_tilde", "mu", "t_hat",
                 "z_hat", "m_max"):                     # replace LAPACK-dependent values
        arr = getattr(c.o1, name)
        arr[...] = (np.arange(arr.size, dtype=np.float32) % 19 - 9).reshape(arr.shape) / 4
    out["sealed"] = c.to_bytes(f16=True)
    kv = kc.KvCache(2, 2, 8, policy=kc.EvictionPolicy.born(sink=2), mode=kc.KvMode.Q8(k=True, v=False))
    kv.layers[0] = exact_layer(kc.KvMode.Q8(k=True, v=False), 12, seed=13)
    kv.save(tmp_path / "g.kvc", fingerprint=b"\x00\x01")
    out["model"] = (tmp_path / "g.kvc").read_bytes()
    return out


def as_version_2(buf):
    """A version-3 buffer as version 2 wrote it: the version field 2, the digest recomputed
    (XXH3); nothing else differs where no 4-bit component is stored."""
    b = bytearray(buf)
    b[8:10] = struct.pack("<H", 2)
    b[-8:] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(b[:-8])))
    return bytes(b)


def test_golden_digests_of_every_section(tmp_path):
    """Version 3 writes what version 2 wrote (the digests it pinned) but for the version
    field: 4-bit V only added a value of the quant_v bytes."""
    bufs = golden_buffers(tmp_path)
    assert all(struct.unpack_from("<H", b, 8)[0] == 3 for b in bufs.values())
    got = {k: hashlib.sha256(as_version_2(v)).hexdigest() for k, v in bufs.items()}
    assert got == GOLDEN_PINNED


GOLDEN_FOUR_BIT = {  # sha256 of a 4-bit layer's bytes and of a prefix-store entry of its rows
    ("q4", "layer"): "f52ff6d2e1fb6e38513e88a9f615ab3feb6fb8c6522faa798067c2a40d200f7e",
    ("q4", "entry"): "e39e903cfdc62c807870159a8a8ce4de59a4cbe12f87edec3dbf13fbaa8e21cb",
    ("k8v4", "layer"): "e0535d2d5dcdff68598e1999cfa758333d53c763e9c5b0d47bbb1f90f8e88406",
    ("k8v4", "entry"): "1bde46800cc1e72ea768957f0a545e36aa42083923c4b2080a44588869a7d575",
}


@pytest.mark.parametrize("name", ["q4", "k8v4"])
def test_golden_digests_of_four_bit_layers_and_entries(name):
    """Pins the 4-bit layouts (the layer body's parts per head, an entry's per block: codes,
    block parameters, no ring) as the storage kinds describe them."""
    from kvcache.store import entry
    from kvcache.store.keys import Geometry
    mode = kc.KvMode.parse(name)
    c = exact_layer(mode, 70, hd=16, seed=11)       # two closed blocks and an open one
    parts = entry.encode_parts(Geometry(1, 2, 16, mode, 32), 1, bytes(16), bytes(16),
                               [c.state()])
    got = {(name, "layer"): hashlib.sha256(c.to_bytes(fingerprint="g")).hexdigest(),
           (name, "entry"): hashlib.sha256(b"".join(parts)).hexdigest()}
    assert got == {k: v for k, v in GOLDEN_FOUR_BIT.items() if k[0] == name}


def as_version_1(buf):
    """A version-2 buffer rewritten as version 1 wrote it: version field 1, the scheme bytes
    (a layer body's byte 12, a model body's byte 15) zero, the digest recomputed (XXH3)."""
    b = bytearray(buf)
    b[8:10] = struct.pack("<H", 1)
    (fp_len,) = struct.unpack_from("<I", b, 24)
    body = 28 + fp_len + (-(28 + fp_len) % 8)
    if b[10] == wire.KIND_LAYER:
        b[body + 12] = 0
    else:
        b[body + 15] = 0
        (n_layers,) = struct.unpack_from("<I", b, body)
        pos = body + 32
        for _ in range(n_layers):
            (size,) = struct.unpack_from("<Q", b, pos)
            b[pos + 8 + 12] = 0
            pos += 8 + size
    b[-8:] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(b[:-8])))
    return bytes(b)


def test_version_2_is_version_1_plus_the_scheme_byte(tmp_path):
    """Against the digests version 1 pinned: the new format changed nothing else (the "q8"
    buffer is in scheme "cmf", which is what version 1 stored; the q8k model holds 12 rows,
    where the two schemes store the same bytes)."""
    bufs = golden_buffers(tmp_path)
    got = {k: hashlib.sha256(as_version_1(as_version_2(bufs[k]))).hexdigest()
           for k in GOLDEN_PINNED_V1}
    assert got == GOLDEN_PINNED_V1
    for name, want in (("q8", 2), ("q8_rows", 1), ("collecting", 0)):
        assert bufs[name][32 + 12] == want, name           # header 28 (+ "g") padded to 32


@pytest.mark.parametrize("cut", ["truncate", "flip"])
def test_model_buffers_are_swept_too(tmp_path, cut):
    kv = kc.KvCache(2, 1, 4, mode=kc.KvMode.Q8())
    kv.layers[0] = filled(kc.KvMode.Q8(), n=5, nkv=1, hd=4)
    kv.layers[1] = sealed(p=40, nkv=1, hd=4)
    kv.save(tmp_path / "m.kvc")
    buf = (tmp_path / "m.kvc").read_bytes()
    n = 0
    if cut == "truncate":
        for i in range(len(buf)):
            with pytest.raises(kc.WireError):
                wire.model_from_bytes(kc.KvCache, buf[:i])
            n += 1
    else:
        b = bytearray(buf)
        for i in range(len(buf)):
            for bit in range(8):
                b[i] ^= 1 << bit
                with pytest.raises(kc.WireError):
                    wire.model_from_bytes(kc.KvCache, b)
                b[i] ^= 1 << bit
                n += 1
    assert n >= len(buf)
    assert wire.model_from_bytes(kc.KvCache, buf).layers[1].o1_sealed()
