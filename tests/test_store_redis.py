"""The Redis backend of the prefix store, against a real redis-server (fixtures in conftest.py).

No mock: every test talks to a redis-server started for the session (``redis_server``, shared,
one namespace per test) or to one of its own that it may stop or freeze (``redis_server_throwaway``).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import uuid

import pytest

import redis  # the client is part of the test extra: a missing one fails, never skips

from kvcache.store.backend import BackendUnavailable, StoreBackend
from kvcache.store.redis import RedisBackend

KIB = 1024


@pytest.fixture
def ns():
    """A namespace of this test's own on the shared server."""
    return f"test-{uuid.uuid4().hex[:12]}:"


@pytest.fixture
def raw(redis_server):
    """A plain client on the shared server, to look at and damage what the backend wrote."""
    client = redis.Redis.from_url(redis_server)
    yield client
    client.close()


@pytest.fixture
def backend(redis_server, ns):
    b = RedisBackend(redis_server, namespace=ns, max_part_bytes=KIB, socket_timeout=2.0)
    yield b
    b.close()


def _value(n, seed=0):
    return bytes((i * 131 + seed * 7 + (i >> 8)) & 0xFF for i in range(n))


def _keys_under(raw, ns):
    return sorted(k.decode() for k in raw.scan_iter(match=f"{ns}*", count=1000))


def _part_keys(raw, ns):
    return [k for k in _keys_under(raw, ns) if k.startswith(f"{ns}p:")]


# -- the contract ------------------------------------------------------------------------------


def test_is_a_backend(backend, redis_server):
    assert isinstance(backend, StoreBackend)
    assert backend.name == redis_server
    assert "RedisBackend" in repr(backend)


def test_put_get_contains_delete_round_trip(backend):
    assert backend.get_many(["a"]) == [None]
    assert backend.contains_many(["a"]) == [False]
    backend.put("a", b"alpha")
    backend.put("b", b"")
    assert backend.get_many(["a", "b", "c"]) == [b"alpha", b"", None]
    assert backend.contains_many(["a", "b", "c"]) == [True, True, False]
    backend.delete("a")
    backend.delete("a")  # deleting a missing key is fine
    backend.delete("never-there")
    assert backend.get_many(["a", "b"]) == [None, b""]
    assert backend.contains_many(["a", "b"]) == [False, True]
    assert backend.get_many([]) == []
    assert backend.contains_many([]) == []


def test_put_accepts_buffers(backend):
    import numpy as np

    arr = np.arange(1000, dtype=np.float32)  # 4000 bytes: split into 4 parts of 1 KiB
    backend.put("arr", memoryview(arr))
    backend.put("ba", bytearray(b"xyz"))
    got = backend.get_many(["arr", "ba"])
    assert got == [arr.tobytes(), b"xyz"]
    assert all(type(v) is bytes for v in got)


def test_get_many_buffers_reads_inline_values_without_a_copy(backend):
    """An inline value comes back as a read-only view into its manifest, a split one as the
    joined bytes; either way bytes(v) is the value, and a missing key is None."""
    small, big = _value(100, seed=1), _value(3 * KIB + 5, seed=2)
    backend.put("small", small)
    backend.put("big", big)
    got = backend.get_many_buffers(["small", "nope", "big"])
    assert isinstance(got[0], memoryview) and got[0].readonly and bytes(got[0]) == small
    assert got[1] is None and type(got[2]) is bytes and got[2] == big
    assert backend.get_many(["small", "big"]) == [small, big]


@pytest.mark.parametrize("n", [KIB - 1, KIB, KIB + 1, 2 * KIB, 10 * KIB + 7])
def test_values_longer_than_a_part_are_split_and_read_back(backend, raw, ns, n):
    value = _value(n, seed=n)
    backend.put("k", value)
    assert backend.get_many(["k"]) == [value]
    assert backend.contains_many(["k"]) == [True]
    expected_parts = 0 if n <= KIB else -(-n // KIB)
    parts = _part_keys(raw, ns)
    assert len(parts) == expected_parts
    assert all(len(raw.get(p)) <= KIB for p in parts)
    backend.delete("k")
    assert backend.get_many(["k"]) == [None]
    assert _keys_under(raw, ns) == []  # the parts went with the manifest


def test_overwrite_drops_the_old_parts(backend, raw, ns):
    big1, big2, small = _value(5 * KIB, 1), _value(3 * KIB, 2), b"small"
    backend.put("k", big1)
    assert len(_part_keys(raw, ns)) == 5
    backend.put("k", big2)
    assert backend.get_many(["k"]) == [big2]
    assert len(_part_keys(raw, ns)) == 3
    backend.put("k", small)
    assert backend.get_many(["k"]) == [small]
    assert _part_keys(raw, ns) == []


def test_namespaces_are_isolated(redis_server, raw):
    ns_a, ns_b = f"a-{uuid.uuid4().hex[:8]}:", f"b-{uuid.uuid4().hex[:8]}:"
    a = RedisBackend(redis_server, namespace=ns_a, max_part_bytes=KIB)
    b = RedisBackend(redis_server, namespace=ns_b, max_part_bytes=KIB)
    try:
        a.put("k", b"from a")
        b.put("k", _value(3 * KIB))
        assert a.get_many(["k"]) == [b"from a"]
        assert b.get_many(["k"]) == [_value(3 * KIB)]
        a.delete("k")
        assert a.contains_many(["k"]) == [False]
        assert b.get_many(["k"]) == [_value(3 * KIB)]
        assert _keys_under(raw, ns_a) == []
        assert _keys_under(raw, ns_b) and all(k.startswith(ns_b) for k in _keys_under(raw, ns_b))
    finally:
        a.close()
        b.close()


def test_default_namespace(redis_server, raw):
    b = RedisBackend(redis_server)
    key = f"default-ns-{uuid.uuid4().hex}"
    try:
        b.put(key, b"v")
        assert raw.get(f"kvcache:e:{key}") is not None
    finally:
        b.delete(key)
        b.close()


def test_ttl_expires_entries_and_their_parts(redis_server, raw, ns):
    b = RedisBackend(redis_server, namespace=ns, max_part_bytes=KIB, ttl=0.3)
    try:
        b.put("small", b"s")
        b.put("big", _value(4 * KIB))
        assert b.get_many(["small", "big"]) == [b"s", _value(4 * KIB)]
        ttls = [raw.pttl(k) for k in _keys_under(raw, ns)]
        assert len(ttls) == 2 + 4 and all(0 < t <= 300 for t in ttls)
        deadline = time.monotonic() + 5.0
        while _keys_under(raw, ns) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _keys_under(raw, ns) == []
        assert b.get_many(["small", "big"]) == [None, None]
        assert b.contains_many(["small", "big"]) == [False, False]
    finally:
        b.close()


def test_no_ttl_means_no_expiry(backend, raw, ns):
    backend.put("k", _value(2 * KIB))
    assert all(raw.pttl(k) == -1 for k in _keys_under(raw, ns))


def test_get_many_is_pipelined(backend, monkeypatch):
    keys = [f"key-{i}" for i in range(500)]
    values = {k: _value(KIB // 2 + (i % 7), seed=i) for i, k in enumerate(keys)}
    big = {k: _value(3 * KIB + i, seed=i) for i, k in enumerate(keys[::50])}
    values.update(big)
    for k, v in values.items():
        backend.put(k, v)

    client = backend._client
    pipelines = []
    real_pipeline = client.pipeline

    def counting_pipeline(*args, **kwargs):
        pipe = real_pipeline(*args, **kwargs)
        pipelines.append(pipe)
        return pipe

    def no_single_commands(*args, **kwargs):
        raise AssertionError(f"a command outside a pipeline: {args[:1]}")

    monkeypatch.setattr(client, "pipeline", counting_pipeline)
    monkeypatch.setattr(client, "execute_command", no_single_commands)
    wanted = keys + ["missing-1", "missing-2"]
    got = backend.get_many(wanted)
    assert got == [values.get(k) for k in wanted]
    assert len(pipelines) == 2  # the manifests in one round trip, the parts of split values in another
    assert backend.contains_many(wanted) == [k in values for k in wanted]
    assert len(pipelines) == 3

    small_only = [k for k in keys if k not in big]
    assert backend.get_many(small_only) == [values[k] for k in small_only]
    assert len(pipelines) == 4  # no value split: a single round trip


# -- nothing torn is ever returned ---------------------------------------------------------------


def test_missing_part_is_a_miss_and_the_manifest_is_removed(backend, raw, ns):
    backend.put("k", _value(4 * KIB))
    backend.put("other", _value(2 * KIB, seed=3))
    victim = [p for p in _part_keys(raw, ns) if p.startswith(f"{ns}p:k:")][2]
    raw.delete(victim)
    assert backend.get_many(["k", "other"]) == [None, _value(2 * KIB, seed=3)]
    assert backend.contains_many(["k"]) == [False]  # so the store writes it again
    assert [p for p in _part_keys(raw, ns) if p.startswith(f"{ns}p:k:")] == []
    backend.put("k", _value(4 * KIB))
    assert backend.get_many(["k"]) == [_value(4 * KIB)]


@pytest.mark.parametrize("damage", ["truncate", "extend", "empty"])
def test_part_of_the_wrong_length_is_a_miss(backend, raw, ns, damage):
    value = _value(3 * KIB + 5)
    backend.put("k", value)
    victim = _part_keys(raw, ns)[0]
    part = raw.get(victim)
    raw.set(victim, {"truncate": part[:-1], "extend": part + b"!", "empty": b""}[damage])
    assert backend.get_many(["k"]) == [None]
    assert backend.contains_many(["k"]) == [False]


@pytest.mark.parametrize(
    "manifest",
    [b"", b"junk", b"KVR1m", b"KVR1m" + bytes(36), b"KVR1m" + bytes(37), b"KVR1x" + b"value"],
)
def test_foreign_or_torn_manifest_is_a_miss(backend, raw, ns, manifest):
    raw.set(f"{ns}e:k", manifest)
    assert backend.get_many(["k"]) == [None]
    assert raw.get(f"{ns}e:k") is None


def test_manifest_with_a_wrong_part_count_is_a_miss(backend, raw, ns):
    import struct

    backend.put("k", _value(3 * KIB))
    manifest = raw.get(f"{ns}e:k")
    count, total, part, token = struct.unpack_from("<IQQ16s", manifest, 5)
    assert (count, total, part) == (3, 3 * KIB, KIB)
    raw.set(f"{ns}e:k", manifest[:5] + struct.pack("<IQQ16s", 2, total, part, token))
    assert backend.get_many(["k"]) == [None]
    backend.put("k", _value(3 * KIB))
    raw.set(f"{ns}e:k", manifest[:5] + struct.pack("<IQQ16s", 3, total + 1, part, token))
    assert backend.get_many(["k"]) == [None]


def test_parts_without_a_manifest_are_a_miss(backend, raw, ns):
    backend.put("k", _value(3 * KIB))
    raw.delete(f"{ns}e:k")  # as if the writer died before its manifest
    assert backend.get_many(["k"]) == [None]
    assert backend.contains_many(["k"]) == [False]


def test_concurrent_writers_never_show_a_torn_value(redis_server, ns):
    values = [_value(8 * KIB + 3, seed=1), _value(5 * KIB + 1, seed=2), b"inline"]
    stop = threading.Event()
    errors = []

    def writer(v):
        b = RedisBackend(redis_server, namespace=ns, max_part_bytes=KIB)
        try:
            while not stop.is_set():
                b.put("k", v)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            b.close()

    threads = [threading.Thread(target=writer, args=(v,)) for v in values]
    for t in threads:
        t.start()
    reader = RedisBackend(redis_server, namespace=ns, max_part_bytes=KIB)
    seen = set()
    try:
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            got = reader.get_many(["k"])[0]
            assert got is None or got in values
            seen.add(got)
    finally:
        stop.set()
        for t in threads:
            t.join()
        reader.close()
    assert not errors
    assert len(seen - {None}) >= 2


# -- a server that is down or hangs ----------------------------------------------------------------


def _calls(b):
    return {
        "get_many": lambda: b.get_many(["k", "big"]),
        "contains_many": lambda: b.contains_many(["k"]),
        "put": lambda: b.put("k", b"v"),
        "put_split": lambda: b.put("big", _value(3 * KIB)),
        "delete": lambda: b.delete("k"),
    }


def test_server_stopped_mid_run_raises_backend_unavailable_quickly(redis_server_throwaway):
    server = redis_server_throwaway
    b = RedisBackend(server.url, namespace="t:", max_part_bytes=KIB, socket_timeout=1.0)
    b.put("k", b"v")
    b.put("big", _value(3 * KIB))
    assert b.get_many(["k", "big"]) == [b"v", _value(3 * KIB)]
    server.stop()
    for what, call in _calls(b).items():
        t0 = time.monotonic()
        with pytest.raises(BackendUnavailable, match="redis at"):
            call()
        assert time.monotonic() - t0 < 1.0 + 0.5, what
    b.close()


@pytest.mark.skipif(sys.platform == "win32", reason="SIGSTOP freezes the server process")
def test_server_that_hangs_times_out_within_socket_timeout(redis_server_throwaway):
    server = redis_server_throwaway
    b = RedisBackend(server.url, namespace="t:", max_part_bytes=KIB, socket_timeout=0.5)
    b.put("k", b"v")
    os.kill(server.proc.pid, signal.SIGSTOP)  # accepts connections, never answers
    try:
        for what, call in _calls(b).items():
            t0 = time.monotonic()
            with pytest.raises(BackendUnavailable):
                call()
            assert time.monotonic() - t0 < 0.5 + 1.0, what
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    # the server answers again: so does the backend, without being rebuilt
    assert server.ping()
    assert b.get_many(["k"]) == [b"v"]
    b.close()


def test_no_server_at_all_is_unavailable_at_the_first_call():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens on it once the socket closes
    b = RedisBackend(f"redis://127.0.0.1:{port}/0", socket_timeout=1.0)  # connects lazily
    t0 = time.monotonic()
    with pytest.raises(BackendUnavailable):
        b.get_many(["k"])
    assert time.monotonic() - t0 < 1.5
    b.close()


# -- construction -----------------------------------------------------------------------------------


def test_from_url_and_options(redis_server, ns):
    b = RedisBackend.from_url(redis_server, namespace=ns, ttl=60, max_part_bytes=7, socket_timeout=3)
    try:
        assert (b.namespace, b.ttl, b.max_part_bytes, b.socket_timeout) == (ns, 60, 7, 3.0)
        b.put("k", b"0123456789abcdef")  # three parts of 7 bytes
        assert b.get_many(["k"]) == [b"0123456789abcdef"]
    finally:
        b.close()


def test_options_in_the_url(redis_server, raw, ns):
    url = f"{redis_server}?namespace={ns}&ttl=60&max_part_bytes=100&socket_timeout=2.5"
    b = RedisBackend(url)
    try:
        assert (b.namespace, b.ttl, b.max_part_bytes, b.socket_timeout) == (ns, 60.0, 100, 2.5)
        b.put("k", _value(250))
        assert b.get_many(["k"]) == [_value(250)]
        assert len(_part_keys(raw, ns)) == 3
        assert all(0 < raw.pttl(k) <= 60_000 for k in _keys_under(raw, ns))
    finally:
        b.close()
    # the same value both ways is fine, ttl=0 means none, and the client's own options pass
    b = RedisBackend(f"{redis_server}?ttl=0&namespace={ns}&health_check_interval=0",
                     namespace=ns)
    assert b.ttl is None and b.namespace == ns
    assert b.get_many(["k"]) == [_value(250)]
    b.close()
    with pytest.raises(ValueError, match="given twice"):
        RedisBackend(f"{redis_server}?ttl=5", ttl=6)
    with pytest.raises(ValueError, match="expected a number for max_part_bytes"):
        RedisBackend(f"{redis_server}?max_part_bytes=big")
    with pytest.raises(ValueError, match="expected ttl"):
        RedisBackend(f"{redis_server}?ttl=-3")


def test_name_hides_the_password():
    b = RedisBackend("redis://user:secret@127.0.0.1:1/3")
    assert "secret" not in b.name and "secret" not in repr(b)
    assert b.name == "redis://user:***@127.0.0.1:1/3"
    b.close()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_part_bytes": 0},
        {"max_part_bytes": 512 * 1024 * 1024 + 1},
        {"max_part_bytes": 1.5},
        {"ttl": 0},
        {"ttl": -1},
        {"ttl": float("inf")},
        {"socket_timeout": 0},
        {"socket_timeout": float("nan")},
    ],
)
def test_bad_options_are_refused(kwargs):
    with pytest.raises(ValueError, match="expected"):
        RedisBackend("redis://127.0.0.1:6379/0", **kwargs)


def test_bad_url_is_refused():
    with pytest.raises(ValueError, match="redis://"):
        RedisBackend("http://127.0.0.1:6379/0")
    with pytest.raises(TypeError):
        RedisBackend(6379)


def test_missing_client_package_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "redis", None)  # `import redis` now raises ImportError
    with pytest.raises(ImportError, match="pip install redis"):
        RedisBackend("redis://127.0.0.1:6379/0")


def test_clean_up_refused_by_the_server_still_reads(redis_server_throwaway):
    """A user without scripting rights still gets misses for torn entries, not errors."""
    server = redis_server_throwaway
    admin = redis.Redis.from_url(server.url)
    admin.execute_command("ACL", "SETUSER", "limited", "on", ">pw", "~*", "+@all", "-@scripting")
    b = RedisBackend(f"redis://limited:pw@127.0.0.1:{server.port}/0", namespace="t:",
                     max_part_bytes=KIB)
    try:
        b.put("k", _value(3 * KIB))
        b.put("ok", b"fine")
        admin.delete(next(admin.scan_iter(match="t:p:k:*")))
        assert b.get_many(["k", "ok"]) == [None, b"fine"]
        admin.set("t:e:junk", b"junk")
        assert b.get_many(["junk"]) == [None]
    finally:
        b.close()
        admin.close()


# -- the prefix store over Redis ------------------------------------------------------------------

_L, _G, _D = 2, 2, 40


def _prefill(ids, mode):
    """A cache as a prefill of ``ids`` leaves it: position p's rows depend on p and ids[p]."""
    import numpy as np

    import kvcache as kc

    ids = np.asarray(ids)
    n = len(ids)
    rng = np.random.default_rng(99)
    base = rng.standard_normal((2, _L, 512, _G, _D)).astype(np.float32)[:, :, :n]
    shift = ((ids % 97) * 0.01).astype(np.float32)[:, None, None]
    cache = kc.KvCache(_L, _G, _D, mode=mode)
    for i, layer in enumerate(cache.layers):
        layer.append(base[0, i] + shift, base[1, i] - shift)
    return cache


def _rows(cache):
    out = []
    for layer in cache.layers:
        st = layer.state()
        n = int(st.lengths.max(initial=0))
        out.append((st.seq_len, st.lengths.tobytes(),
                    {name: a[:, :n].tobytes() for name, a in st.stores().items()},
                    st.kcol.tobytes(), st.vcol.tobytes()))
    return out


def _ids(n, seed=0):
    import numpy as np

    return np.random.default_rng(seed).integers(0, 50_000, n)


@pytest.mark.parametrize("mode", ["f32", "q8"])
def test_prefix_store_round_trip_over_redis(redis_server, ns, mode):
    import kvcache as kc
    from kvcache.store import PrefixStore

    block = 16 if mode == "f32" else 80
    ids = _ids(3 * block + 5)
    fp = f"model-{ns}"
    writer = PrefixStore(RedisBackend(redis_server, namespace=ns, max_part_bytes=4 * KIB),
                         fingerprint=fp, block=block)
    assert writer.put(ids, _prefill(ids, mode)) == 3
    assert writer.put(ids, _prefill(ids, mode)) == 0  # already stored
    writer.close()
    # another process (or machine) with a backend of its own finds the blocks
    for backend in (RedisBackend(redis_server, namespace=ns, max_part_bytes=64),
                    RedisBackend(redis_server, namespace=ns)):
        reader = PrefixStore(backend, fingerprint=fp, block=block)
        fresh = kc.KvCache(_L, _G, _D, mode=mode)
        assert reader.longest_prefix(ids, fresh) == 3 * block
        assert reader.load(ids, fresh) == 3 * block
        assert _rows(fresh) == _rows(_prefill(ids[: 3 * block], mode))
        assert reader.available
        reader.close()
    # another namespace, another fingerprint: nothing
    for store in (PrefixStore(RedisBackend(redis_server, namespace=ns + "x:"),
                              fingerprint=fp, block=block),
                  PrefixStore(RedisBackend(redis_server, namespace=ns),
                              fingerprint=fp + "x", block=block)):
        assert store.load(ids, kc.KvCache(_L, _G, _D, mode=mode)) == 0
        store.close()


def test_prefix_store_from_a_redis_url(redis_server):
    import kvcache as kc
    from kvcache.store import PrefixStore

    fp = f"url-{uuid.uuid4().hex}"
    ids = _ids(40)
    with PrefixStore(redis_server, fingerprint=fp, block=16) as store:
        assert isinstance(store.backend, RedisBackend)
        assert store.put(ids, _prefill(ids, "f32")) == 2
        fresh = kc.KvCache(_L, _G, _D, mode="f32")
        assert store.load(ids, fresh) == 32
        assert _rows(fresh) == _rows(_prefill(ids[:32], "f32"))


def test_prefix_store_bit_flip_in_a_redis_part_is_a_miss(redis_server, raw, ns, caplog):
    import logging

    import kvcache as kc
    from kvcache.store import PrefixStore

    ids = _ids(48)
    store = PrefixStore(RedisBackend(redis_server, namespace=ns, max_part_bytes=KIB),
                        fingerprint="m", block=16)

    def manifests():
        return {k for k in _keys_under(raw, ns) if k.startswith(f"{ns}e:")}

    assert store.put(ids[:32], _prefill(ids[:32], "f32")) == 2
    first_two = manifests()
    assert store.put(ids, _prefill(ids, "f32")) == 1
    (third,) = manifests() - first_two
    entry_key = third[len(f"{ns}e:"):]
    parts = [k for k in _part_keys(raw, ns) if k.startswith(f"{ns}p:{entry_key}:")]
    assert len(parts) > 2  # the entry was split
    victim = parts[len(parts) // 2]
    data = bytearray(raw.get(victim))
    data[len(data) // 2] ^= 0x10
    raw.set(victim, bytes(data))

    fresh = kc.KvCache(_L, _G, _D, mode="f32")
    with caplog.at_level(logging.WARNING, logger="kvcache"):
        assert store.load(ids, fresh) == 32  # up to the damaged block
    assert _rows(fresh) == _rows(_prefill(ids[:32], "f32"))
    assert sum("unusable" in r.getMessage() for r in caplog.records) == 1
    assert manifests() == first_two  # the damaged entry was deleted...
    assert store.put(ids, _prefill(ids, "f32")) == 1  # ...so it is written again
    fresh = kc.KvCache(_L, _G, _D, mode="f32")
    assert store.load(ids, fresh) == 48
    assert _rows(fresh) == _rows(_prefill(ids, "f32"))
    assert store.available
    store.close()


def test_prefix_store_server_stopped_mid_run_is_a_no_op_with_one_warning(
        redis_server_throwaway, caplog):
    import logging

    import kvcache as kc
    from kvcache.store import PrefixStore

    server = redis_server_throwaway
    ids = _ids(48)
    store = PrefixStore(RedisBackend(server.url, namespace="t:", max_part_bytes=KIB,
                                     socket_timeout=1.0), fingerprint="m", block=16)
    assert store.put(ids, _prefill(ids, "f32")) == 3
    assert store.longest_prefix(ids, kc.KvCache(_L, _G, _D, mode="f32")) == 48
    server.stop()
    fresh = kc.KvCache(_L, _G, _D, mode="f32")
    before = _rows(fresh)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="kvcache"):
        assert store.load(ids, fresh) == 0
        assert store.longest_prefix(ids, fresh) == 0
        assert store.put(ids, _prefill(ids, "f32")) == 0
        assert store.load(ids, fresh) == 0
    assert time.monotonic() - t0 < 1.0 + 1.0  # one failed call at most, never a hang
    assert _rows(fresh) == before
    assert not store.available
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "unavailable" in warnings[0].getMessage()
    store.close()


def test_a_forged_manifest_with_millions_of_parts_is_a_miss_at_once(backend, raw, ns):
    # consistent numbers, but far more parts than a writer makes: no read of 10**8 keys
    import struct
    import time

    from kvcache.store.redis import MAX_PARTS
    raw.set(f"{ns}e:k", b"KVR1m" + struct.pack("<IQQ16s", 10**8, 10**8, 1, b"x" * 16))
    t0 = time.perf_counter()
    assert backend.get_many(["k"]) == [None]
    assert time.perf_counter() - t0 < 5
    assert 10**8 > MAX_PARTS


def test_a_ttl_past_redis_range_or_a_named_db_is_refused_up_front():
    with pytest.raises(ValueError, match="ttl"):
        RedisBackend("redis://127.0.0.1:1/0?ttl=1e300")
    with pytest.raises(ValueError, match="database number"):
        RedisBackend("redis://127.0.0.1:1/abc")
