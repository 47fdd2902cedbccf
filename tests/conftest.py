"""Shared fixtures for the kvcache tests.

The helpers are handed out as session-scoped fixtures that return plain functions, so
hypothesis-driven tests can use them too (they hold no state between examples).
"""

from __future__ import annotations

import numpy as np
import pytest

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
