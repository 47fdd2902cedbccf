"""kvcache.o1_override.O1Override: the O(1) state machine a LayerKvCache holds, on its own and
through its layer (idle -> collecting -> sealed or refused, clear, snapshots), and the
layer's parts around it: the kernel module injected once, pickles of the old layout."""

from __future__ import annotations

import copy
import logging
import pickle

import numpy as np
import pytest

import kvcache as kc
from kvcache import _core
from kvcache import reference as R
from kvcache.o1 import O1Collecting, O1Rect, O1Sealed, O1Snapshot
from kvcache.o1_override import O1_MAX, O1Override

NKV, HD, NH, T = 2, 16, 4, 48


def _prompt(rng, layer=None):
    layer = layer or kc.LayerKvCache(NKV, HD, mode="f32")
    k = rng.standard_normal((T, NKV, HD)).astype(np.float32)
    v = rng.standard_normal((T, NKV, HD)).astype(np.float32)
    q = rng.standard_normal((T, NH, HD)).astype(np.float32)
    layer.o1_begin(4, 8, 2)
    layer.append(k, v)
    layer.o1_push_q(q)
    return layer


def test_a_new_override_is_idle_and_begin_checks_before_it_changes():
    o = O1Override()
    assert o.state is None and not o.sealed and o.error() is None and o.views() is None
    assert o.memory_bytes() == 0 and repr(o) == "O1Override(idle)"
    for kwargs, exc in ((dict(m=3), ValueError), (dict(w=0), ValueError),
                        (dict(sink=-1), ValueError), (dict(keep=-1), ValueError),
                        (dict(ridge=0.0), ValueError), (dict(m=O1_MAX + 1), ValueError),
                        (dict(rect="nope"), ValueError), (dict(m=4.5), TypeError)):
        args = {**dict(m=4, w=8, sink=2), **kwargs}
        with pytest.raises(exc):
            o.begin(HD, **args)
        assert o.state is None
    o.begin(HD, 4, 8, 2, rect="fm", keep=1, ridge=1e-4)
    assert isinstance(o.state, O1Collecting) and o.state.rect is O1Rect.FM
    assert repr(o) == "O1Override(collecting)"


def test_push_q_checks_shapes_and_is_a_no_op_unless_collecting():
    o = O1Override()
    o.push_q(HD, np.ones((NH, HD), np.float32))           # idle: nothing to collect
    o.begin(HD, 4, 8, 2)
    for bad in (np.ones((NH, HD + 1)), np.ones(HD + 1), np.ones((0, HD)),
                np.ones((1, 1, 1, HD))):
        with pytest.raises(ValueError, match="q_all"):
            o.push_q(HD, bad)
    o.push_q(HD, np.ones((3, NH, HD), np.float32))
    assert o.state.memory_bytes() == 4 * 3 * NH * HD == o.memory_bytes()


def test_sealed_only_calls_name_the_missing_seal():
    o = O1Override()
    for call in (lambda: o.snapshot(3), lambda: o.step(NKV, HD, np.ones((NH, HD)),
                                                       np.ones((NKV, HD)), np.ones((NKV, HD)),
                                                       NH, _core, 1)):
        with pytest.raises(RuntimeError, match="not sealed"):
            call()
    with pytest.raises(TypeError, match="O1Snapshot"):
        o.restore("snapshot")


def test_a_seal_through_the_layer_releases_its_rows_and_steps(rng):
    layer = _prompt(rng)
    assert layer.o1_seal(NH)
    assert isinstance(layer.o1, O1Sealed) and layer.o1_sealed() and layer.seq_len == T
    assert layer.head_len(0) == 0 and layer.o1_error() is layer.o1.error
    with pytest.raises(RuntimeError, match="sealed"):
        layer.o1_begin(4, 8, 2)
    snap = layer.o1_snapshot()
    assert isinstance(snap, O1Snapshot)
    q, k = rng.standard_normal((NH, HD)), rng.standard_normal((NKV, HD))
    first = layer.o1_step(q, k, k, NH)
    assert layer.seq_len == T + 1
    layer.o1_restore(snap)
    assert layer.seq_len == T and np.array_equal(layer.o1_step(q, k, k, NH), first)
    other = _prompt(np.random.default_rng(9))
    other.o1_seal(NH)
    with pytest.raises(ValueError, match="another O\\(1\\) state"):
        layer.o1_restore(other.o1_snapshot())
    layer.clear()
    assert layer.o1 is None and layer.o1_error() is None and layer.seq_len == 0


def test_a_refused_seal_leaves_the_rows_and_keeps_its_estimate(rng, caplog):
    layer = _prompt(rng)
    keys = layer.head_keys(0).copy()
    with caplog.at_level(logging.WARNING, logger="kvcache"):
        assert not layer.o1_seal(NH, max_error=1e-12)
    assert "above max_error" in caplog.text
    assert layer.o1 is None and layer.o1_error() is not None
    assert np.array_equal(layer.head_keys(0), keys)
    assert not layer.o1_seal(NH)                # idle now: the seal is idempotent
    bad = _prompt(rng)
    bad.o1_push_q(np.ones((1, NH, HD), np.float32))        # one position too many
    with caplog.at_level(logging.WARNING, logger="kvcache"):
        assert not bad.o1_seal(NH)
    assert "full trace" in caplog.text and bad.o1_error() is None


def test_the_twin_kernels_are_injected_for_one_call(rng):
    """kvcache.reference runs a layer on the NumPy kernels by setting its kernel module for
    one call: the layer is back on the compiled kernels afterwards, and both agree."""
    a, b = _prompt(np.random.default_rng(0)), _prompt(np.random.default_rng(0))
    assert R.o1_seal(b, NH) and a.o1_seal(NH)
    assert a.kernels is _core and b.kernels is _core and "kernels" not in vars(b)
    q = np.ones((NH, HD), np.float32)
    layer = kc.LayerKvCache(NKV, HD)
    layer.append(np.ones((5, NKV, HD)), np.ones((5, NKV, HD)))
    twin = R.attend_all_heads(layer, q)
    assert layer.kernels is _core
    np.testing.assert_allclose(twin, layer.attend_all_heads(q), rtol=0, atol=1e-6)


def test_pickles_of_the_old_layout_load_into_the_component(rng):
    layer = _prompt(rng)
    old = layer.__getstate__()
    old["_o1"], old["_o1_refused"] = layer.o1, None        # what a 0.2.0-dev pickle held
    fresh = kc.LayerKvCache.__new__(kc.LayerKvCache)
    fresh.__setstate__(old)
    assert isinstance(fresh._o1, O1Override) and isinstance(fresh.o1, O1Collecting)
    assert fresh.o1_seal(NH) and fresh.o1_sealed()
    for copied in (pickle.loads(pickle.dumps(fresh)), copy.deepcopy(fresh)):
        assert copied.o1_sealed() and copied.kernels is _core


def test_a_copied_layer_has_a_component_of_its_own(rng):
    """copy.copy of a sealed layer: clearing the copy leaves the original sealed (it did
    before the override was a component)."""
    layer = _prompt(rng)
    assert layer.o1_seal(NH)
    shallow = copy.copy(layer)
    q, k = rng.standard_normal((NH, HD)), rng.standard_normal((NKV, HD))
    first = shallow.o1_step(q, k, k, NH)        # a step changes a state in place: not ours
    assert np.array_equal(layer.o1_step(q, k, k, NH), first) and layer.seq_len == T + 1
    with pytest.raises(ValueError, match="another O\\(1\\) state"):
        shallow.o1_restore(layer.o1_snapshot())
    shallow.clear()
    assert layer.o1_sealed() and layer.seq_len == T + 1 and shallow.o1 is None
    collecting = kc.LayerKvCache(NKV, HD)
    collecting.o1_begin(4, 8, 2)
    twin = copy.copy(collecting)
    twin.o1_push_q(np.ones((1, NH, HD), np.float32))
    assert collecting.o1_memory_bytes() == 0 < twin.o1_memory_bytes()


def test_the_twin_call_puts_back_a_kernel_module_set_on_the_layer(rng):
    layer = kc.LayerKvCache(NKV, HD)
    layer.append(np.ones((3, NKV, HD)), np.ones((3, NKV, HD)))
    layer.kernels = R                        # a caller's own choice, kept
    R.attend_all_heads(layer, np.ones((NH, HD), np.float32))
    assert vars(layer)["kernels"] is R
    del layer.kernels
    assert layer.kernels is _core


@pytest.fixture
def rng():
    return np.random.default_rng(5)
