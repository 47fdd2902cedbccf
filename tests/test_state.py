"""LayerState: the one object through which a LayerKvCache's state is read and installed.

Checks that exporting a layer and installing the state into a fresh layer reproduces it bit
for bit (the same ``to_bytes``), that an exported state is views (no copies) and an installed
one is the target's own, and that every bad state is refused with the layer left unchanged.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import kvcache as kc
from kvcache._state import LayerState
from kvcache.o1 import O1Sealed

from test_wire import STATES, filled, sealed

F32 = kc.KvMode.F32


@pytest.mark.parametrize("name,make", STATES, ids=[s[0] for s in STATES])
def test_export_then_install_into_a_fresh_layer_gives_the_same_bytes(name, make):
    src = make()
    st = src.state()
    assert not st.owned
    dst = kc.LayerKvCache(src.num_kv_heads, src.head_dim, mode=F32)
    g = dst.generation
    dst.install(st)
    assert dst.to_bytes() == src.to_bytes()
    assert dst.generation != g
    assert dst.memory_bytes() == src.memory_bytes()


@pytest.mark.parametrize("name,make", STATES, ids=[s[0] for s in STATES])
def test_an_installed_copy_shares_nothing_with_its_source(name, make):
    src = make()
    before = src.to_bytes()
    dst = kc.LayerKvCache(src.num_kv_heads, src.head_dim)
    dst.install(src.state())
    assert dst.o1 is None or dst.o1 is not src.o1
    ours = dst.state()
    theirs = src.state()
    for f in dataclasses.fields(LayerState):
        a, b = getattr(ours, f.name), getattr(theirs, f.name)
        if isinstance(a, np.ndarray) and a.size:
            assert not np.shares_memory(a, b), f.name
    # the copy moves on alone
    rng = np.random.default_rng(9)
    nkv, hd = dst.num_kv_heads, dst.head_dim
    if dst.o1_sealed():
        dst.o1_step(rng.standard_normal((2 * nkv, hd)), rng.standard_normal((nkv, hd)),
                    rng.standard_normal((nkv, hd)), 2 * nkv)
    else:
        dst.append(rng.standard_normal((nkv, hd)), rng.standard_normal((nkv, hd)))
    assert src.to_bytes() == before


def test_export_is_read_only_views_of_the_storage():
    c = filled(kc.KvMode.Q8(scheme="cmf"), n=70)                 # columns frozen at 64
    st = c.state()
    assert st.kf is None and st.vf is None
    for name, arr in st.stores().items():
        assert not arr.flags.writeable, name
        assert arr.shape[:2] == (c.num_kv_heads, st.capacity), name
    kq, ks, vq, vs = c.q8_rows(1)
    assert np.shares_memory(st.kq, kq) and np.shares_memory(st.vs, vs)
    assert np.shares_memory(st.importance, c.importance)
    assert st.lengths.tolist() == [c.head_len(h) for h in range(c.num_kv_heads)]
    assert st.seq_len == c.seq_len and st.mode == c.mode
    assert st.any_col_frozen()
    with pytest.raises(ValueError):
        st.lengths[0] = 0


def test_an_owned_state_is_adopted_without_a_copy():
    src = filled(F32, n=10)
    st = src.state().owned_copy()
    assert st.owned
    dst = kc.LayerKvCache(2, 8)
    dst.install(st)
    assert np.shares_memory(dst.head_keys(0), st.kf)
    assert dst.to_bytes() == src.to_bytes()


def test_linear_scratch_none_keeps_the_layers_own():
    src = filled(F32, n=10)
    src.linear_scratch = [1.0, 2.0]
    dst = kc.LayerKvCache(2, 8)
    dst.linear_scratch = [5.0]
    dst.install(dataclasses.replace(src.state(), linear_scratch=None))
    assert dst.linear_scratch.tolist() == [5.0]
    assert dst.linear_state.tolist() == src.linear_state.tolist()


def _bad_states():
    """(id, edit(state) -> bad state, error type, message) for a filled q8 layer's state
    (scheme "cmf", 70 positions: its column fields are frozen)."""
    r = dataclasses.replace

    def ro_copy(a):
        return np.array(a)

    def more_rows(s):
        lens = ro_copy(s.lengths)
        lens[0] = s.capacity + 1
        return r(s, lengths=lens, seq_len=s.capacity + 1)

    def col_not_ones(s):
        vcol = ro_copy(s.vcol)
        kon = ro_copy(s.kcol_on)
        kon[1] = 0
        kcol = ro_copy(s.kcol)
        kcol[1, 0] = 2.0
        return r(s, kcol=kcol, kcol_on=kon, vcol=vcol)

    def flag_two(s):
        on = ro_copy(s.vcol_on)
        on[0] = 2
        return r(s, vcol_on=on)

    def f32_frozen(s):
        return r(s, mode=kc.KvMode.Q8(k=True, v=False, scheme="cmf"), vq=None, vs=None,
                 vf=np.zeros(s.vq.shape, np.float32))

    def sealed_with_rows(s):
        return r(s, mode=F32, kq=None, ks=None, vq=None, vs=None,
                 kf=np.zeros(s.kq.shape, np.float32), vf=np.zeros(s.vq.shape, np.float32),
                 kcol_on=np.zeros(2, np.uint8), vcol_on=np.zeros(2, np.uint8),
                 kcol=np.ones((2, 8), np.float32), vcol=np.ones((2, 8), np.float32),
                 o1=sealed().o1)

    return [
        ("geometry", lambda s: r(s, num_kv_heads=3), ValueError, "geometry"),
        ("mode-type", lambda s: r(s, mode="q8"), TypeError, "KvMode"),
        ("negative-seq", lambda s: r(s, seq_len=-1), ValueError, "seq_len"),
        ("lengths-dtype", lambda s: r(s, lengths=s.lengths.astype(np.int32)), TypeError, "lengths"),
        ("lengths-shape", lambda s: r(s, lengths=s.lengths[:1]), ValueError, "lengths"),
        ("lengths-past-seq", lambda s: r(s, seq_len=int(s.lengths.max()) - 1), ValueError,
         "lengths"),
        ("lengths-past-cap", more_rows, ValueError, "rows"),
        ("missing-store", lambda s: r(s, kq=None), ValueError, "kq"),
        ("extra-store", lambda s: r(s, kf=np.zeros((2, s.capacity, 8), np.float32)),
         ValueError, "kf"),
        ("store-dtype", lambda s: r(s, ks=s.ks.astype(np.float64)), TypeError, "ks"),
        ("store-width", lambda s: r(s, vs=np.zeros((2, s.capacity, 2), np.float32)),
         ValueError, "vs"),
        ("store-capacity", lambda s: r(s, vq=s.vq[:, :-1]), ValueError, "vq"),
        ("col-not-ones", col_not_ones, ValueError, "all ones"),
        ("col-flag", flag_two, ValueError, "0 or 1"),
        ("frozen-on-f32", f32_frozen, ValueError, "not stored as int8"),
        ("frozen-in-rows", lambda s: r(s, mode=kc.KvMode.Q8()), ValueError,
         "scheme 'rows', which never freezes"),
        ("importance-long", lambda s: r(s, importance=np.zeros(s.seq_len + 1, np.float32)),
         ValueError, "importance"),
        ("importance-2d", lambda s: r(s, importance=np.zeros((1, 1), np.float32)),
         ValueError, "importance"),
        ("linear-list", lambda s: r(s, linear_state=[1.0]), TypeError, "linear_state"),
        ("scratch-dtype", lambda s: r(s, linear_scratch=np.zeros(1, np.float16)), TypeError,
         "linear_scratch"),
        ("o1-type", lambda s: r(s, o1="sealed"), TypeError, "o1"),
        ("o1-geometry", lambda s: r(s, mode=F32, kq=None, ks=None, vq=None, vs=None,
                                    kf=np.zeros((2, 0, 8), np.float32),
                                    vf=np.zeros((2, 0, 8), np.float32),
                                    lengths=np.zeros(2, np.intp),
                                    importance=np.zeros(0, np.float32),
                                    kcol_on=np.zeros(2, np.uint8), vcol_on=np.zeros(2, np.uint8),
                                    kcol=np.ones((2, 8), np.float32),
                                    vcol=np.ones((2, 8), np.float32),
                                    o1=sealed(nkv=1, hd=8).o1), ValueError, "sealed for"),
        ("sealed-with-rows", sealed_with_rows, ValueError, "sealed"),
        ("owned-read-only", lambda s: r(s, owned=True), ValueError, "owned"),
    ]


BAD = _bad_states()


@pytest.mark.parametrize("name,edit,exc,match", BAD, ids=[b[0] for b in BAD])
def test_a_bad_state_is_refused_and_the_layer_is_unchanged(name, edit, exc, match, snapshot,
                                                            assert_same_state):
    good = filled(kc.KvMode.Q8(scheme="cmf"), n=70)
    bad = edit(good.state())
    target = filled(F32, n=12, seed=4)
    target.linear_scratch = [3.0]
    before, raw, gen = snapshot(target), target.to_bytes(), target.generation
    with pytest.raises(exc, match=match):
        target.install(bad)
    assert_same_state(before, snapshot(target))
    assert target.to_bytes() == raw and target.generation == gen


def test_install_refuses_what_is_not_a_state():
    c = filled(F32, n=3)
    raw = c.to_bytes()
    with pytest.raises(TypeError, match="LayerState"):
        c.install({"mode": F32})
    assert c.to_bytes() == raw


def test_a_sealed_state_round_trips_and_keeps_stepping_the_same():
    src = sealed()
    dst = kc.LayerKvCache(2, 8)
    dst.install(src.state())
    assert isinstance(dst.o1, O1Sealed) and dst.seq_len == src.seq_len
    rng = np.random.default_rng(2)
    for _ in range(5):
        q, k, v = rng.standard_normal((4, 8)), rng.standard_normal((2, 8)), rng.standard_normal((2, 8))
        np.testing.assert_array_equal(dst.o1_step(q, k, v, 4), src.o1_step(q, k, v, 4))
    assert dst.to_bytes() == src.to_bytes()


@pytest.mark.parametrize("have, got", [("q8", "q8:cmf"), ("q8k:cmf", "q8v"),
                                       ("q8v:cmf", "q8")])
def test_a_layer_keeps_its_int8_scheme(have, got, snapshot, assert_same_state):
    """A state of int8 rows in the other scheme is refused; F32 states and F32 layers mix
    with either (the mode comes from the state)."""
    src = filled(kc.KvMode.parse(got), n=70)
    target = filled(kc.KvMode.parse(have), n=12, seed=4)
    before, raw, gen = snapshot(target), target.to_bytes(), target.generation
    with pytest.raises(ValueError, match=f"int8 scheme '{kc.KvMode.parse(got).scheme}'.*"
                                         f"scheme '{kc.KvMode.parse(have).scheme}'"):
        target.install(src.state())
    assert_same_state(before, snapshot(target))
    assert target.to_bytes() == raw and target.generation == gen
    f32 = filled(F32, n=5)
    f32.install(src.state())                      # F32 takes either scheme
    assert f32.mode == src.mode
    target.install(filled(F32, n=3).state())       # and an F32 state goes anywhere
    assert target.mode == F32
