"""Shared fixtures for the kvcache tests.

The helpers are handed out as session-scoped fixtures that return plain functions, so
hypothesis-driven tests can use them too (they hold no state between examples).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import settings

# the runner's weight-digest file (kvcache.runner.digest) stays out of the home folder; the
# tests of that file point it at a temporary path
os.environ["KVCACHE_DIGEST_CACHE"] = "off"

# Property tests draw the same examples on every run and machine, for a given hypothesis
# version ("ci", the default: a test
# that passes here passes in CI); KVCACHE_HYPOTHESIS=explore draws new ones each run, to look
# for failures (docs/install.md).  A test's own @settings keep their example counts.
_PROFILES = {"ci": dict(derandomize=True, database=None), "explore": dict(derandomize=False)}
_profile = os.environ.get("KVCACHE_HYPOTHESIS", "ci")
if _profile not in _PROFILES:
    raise pytest.UsageError(f"KVCACHE_HYPOTHESIS={_profile!r}: expected one of "
                            f"{sorted(_PROFILES)}")
for _name, _kw in _PROFILES.items():
    settings.register_profile(_name, **_kw)
settings.load_profile(_profile)


@pytest.fixture
def rng():
    """A fresh, seeded generator per test (tests stay independent of their order)."""
    return np.random.default_rng(20260712)


def _make_kv(rng, n, nkv, hd, scale=1.0):
    """Random float32 K and V blocks of shape (n, nkv, hd)."""
    k = (rng.standard_normal((n, nkv, hd)) * scale).astype(np.float32)
    v = (rng.standard_normal((n, nkv, hd)) * scale).astype(np.float32)
    return k, v


@pytest.fixture(scope="session")
def make_kv():
    """make_kv(rng, n, nkv, hd, scale=1.0) -> (k, v), float32 arrays of shape (n, nkv, hd)."""
    return _make_kv


def _copy(x):
    return None if x is None else np.array(x, copy=True)


def _snapshot(layer):
    """Every observable of a LayerKvCache, copied (so later mutation cannot alias it)."""
    nkv = layer.num_kv_heads
    return {
        "mode": layer.mode,
        "seq_len": layer.seq_len,
        "head_len": [layer.head_len(h) for h in range(nkv)],
        "keys": [_copy(layer.head_keys(h)) for h in range(nkv)],
        "values": [_copy(layer.head_values(h)) for h in range(nkv)],
        "q8": [tuple(_copy(a) for a in layer.q8_rows(h)) for h in range(nkv)],
        "cols": [tuple(_copy(a) for a in layer.columns(h)) for h in range(nkv)],
        "importance": _copy(layer.importance),
        "linear_state": _copy(layer.linear_state),
        "linear_scratch": _copy(layer.linear_scratch),
        "memory_bytes": layer.memory_bytes(),
        "o1": layer.o1,
        "o1_state": _o1_state(layer.o1),
    }


_O1_ARRAYS = ("win_k", "win_v", "sink_k", "sink_v", "k_tilde", "q_tilde", "mu", "t_hat", "z_hat",
              "m_max")


def _o1_state(o1):
    """Copies of everything an O(1) state holds (None when there is no real state)."""
    if o1 is None or not hasattr(o1, "memory_bytes"):
        return None
    if not o1.sealed:
        return {"kind": "collecting", "params": (o1.m, o1.w, o1.sink, o1.rect),
                "trace": np.array(o1.trace, copy=True)}
    state = {"kind": "sealed", "counts": (o1.win_len, o1.win_head, o1.far_len, o1.m_eff)}
    for name in _O1_ARRAYS:
        state[name] = np.array(getattr(o1, name), copy=True)
    return state


def _bits_equal(a, b):
    """Bit-exact equality of two arrays (or two Nones): same dtype, shape and bytes."""
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _assert_same_state(before, after):
    """Assert two snapshots of a layer are identical, bit for bit."""
    for key in ("mode", "seq_len", "head_len", "memory_bytes"):
        assert before[key] == after[key], key
    assert before["o1"] is after["o1"]
    a, b = before["o1_state"], after["o1_state"]
    assert (a is None) == (b is None)
    if a is not None:
        assert a.keys() == b.keys()
        for key in a:
            if isinstance(a[key], np.ndarray):
                assert _bits_equal(a[key], b[key]), f"o1.{key}"
            else:
                assert a[key] == b[key], f"o1.{key}"
    for key in ("importance", "linear_state", "linear_scratch"):
        assert _bits_equal(before[key], after[key]), key
    for key in ("keys", "values", "q8", "cols"):
        for h, (x, y) in enumerate(zip(before[key], after[key])):
            if isinstance(x, tuple):
                assert len(x) == len(y)
                for i, (a, b) in enumerate(zip(x, y)):
                    assert _bits_equal(a, b), f"{key}[{h}][{i}]"
            else:
                assert _bits_equal(x, y), f"{key}[{h}]"


@pytest.fixture(scope="session")
def snapshot():
    """snapshot(layer) -> dict of copied observables (see assert_same_state)."""
    return _snapshot


@pytest.fixture(scope="session")
def assert_same_state():
    """assert_same_state(before, after): two layer snapshots are bit-identical."""
    return _assert_same_state


def _softmax_attention(q, keys, values, scale, softcap=0.0):
    """NumPy reference of one query head over rows (keys, values), in float64.

    Returns (out (hd,), probs (rows,)).  Scores are q.k*scale, softcapped (cap*tanh(s/cap))
    where finite and softcap > 0, then a max-shifted softmax.
    """
    q = np.asarray(q, dtype=np.float64)
    keys = np.asarray(keys, dtype=np.float64)
    values = np.asarray(values, dtype=np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        s = keys @ q * scale
        if softcap > 0:
            fin = np.isfinite(s)
            s = np.where(fin, softcap * np.tanh(np.where(fin, s, 0.0) / softcap), s)
        e = np.exp(s - np.max(s))
    p = e / e.sum()
    return p @ values, p


@pytest.fixture(scope="session")
def softmax_attention():
    """softmax_attention(q, keys, values, scale, softcap=0.0) -> (out, probs), float64."""
    return _softmax_attention


# -- a real redis-server for the Redis backend's tests ----------------------------------------
# No mock stands in for Redis: these fixtures start the `redis-server` binary (Debian package
# `redis-server`) on a free loopback port, without persistence, in a temporary directory.

_REDIS_INSTALL_HINT = (
    "the Redis backend's tests need a real redis-server binary on PATH; install it with "
    "`apt-get install -y redis-server` (Debian/Ubuntu) or `brew install redis` (macOS)"
)


class _RedisServer:
    """One redis-server process on 127.0.0.1:<port>; ``url`` to reach it, ``stop()`` to end it."""

    def __init__(self, workdir):
        import shutil
        import subprocess

        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail(_REDIS_INSTALL_HINT, pytrace=False)
        self.workdir = workdir
        self.log = workdir / "redis.log"
        for _attempt in range(5):  # a free port may be taken between probing and binding
            self.port = _free_port()
            with open(self.log, "wb") as log:
                self.proc = subprocess.Popen(
                    [binary, "--port", str(self.port), "--bind", "127.0.0.1",
                     "--save", "", "--appendonly", "no", "--dir", str(workdir),
                     "--daemonize", "no"],
                    stdout=log, stderr=subprocess.STDOUT, cwd=workdir,
                )
            if self._wait_ready(timeout=10.0):
                break
            self.stop()
        else:
            pytest.fail(f"redis-server did not answer PING; its log:\n{self.log.read_text()}",
                        pytrace=False)
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def ping(self) -> bool:
        import socket

        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1.0) as s:
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def _wait_ready(self, timeout):
        import time

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            if self.ping():
                return True
            time.sleep(0.02)
        return False

    def stop(self):
        """Stop the server (a no-op once it is stopped)."""
        import subprocess

        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _free_port():
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """URL ``redis://127.0.0.1:<port>/0`` of a redis-server started for this test session.

    Tests share it: each should use its own key namespace.  Fails (never skips) when the
    redis-server binary is missing, saying how to install it.
    """
    server = _RedisServer(tmp_path_factory.mktemp("redis"))
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def redis_server_throwaway(tmp_path_factory):
    """A redis-server of this test's own (``.url``, ``.stop()``, ``.ping()``), e.g. to stop mid-run."""
    server = _RedisServer(tmp_path_factory.mktemp("redis-throwaway"))
    try:
        yield server
    finally:
        server.stop()


# The x86-64 bodies as the C twin programs (tests/c) build them: one program per body, the body
# chosen by the compile flags as the extension's units choose it by their target pragma.
X86_BODY_FLAGS = {
    "portable": ["-DKVC_NO_SIMD"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avxvnni": ["-mavx2", "-mfma", "-mf16c", "-mavxvnni"],
    "avx512": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl",
               "-mavx512vnni", "-mprefer-vector-width=256"],
}


def cpu_runs(body: str) -> bool:
    """Whether this CPU has every feature body ``body`` needs (kvcache._dispatch.BODY_NEEDS):
    a C twin program built for it runs only then, elsewhere it is compiled only."""
    from kvcache import _core
    from kvcache import _dispatch
    return _dispatch.BODY_NEEDS[body] <= _core.cpu_features()
