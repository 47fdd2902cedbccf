"""Bad input to every public method: the right exception, and the object left as it was.

API.md conventions: a wrong shape raises ValueError naming the parameter and saying
"expected ..."; an unsupported dtype (complex, object, strings) raises TypeError; an
out-of-range index raises IndexError; a call that raises changes nothing.  NaN/inf *values*
are not errors: they are stored and computed on as IEEE says.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvcache as kc

NKV, HD, HPK = 2, 8, 2
NH = NKV * HPK
F32 = kc.KvMode.F32
ALL_MODES = [F32, kc.KvMode.Q8(), kc.KvMode.Q8(k=True, v=False), kc.KvMode.Q8(k=False, v=True)]
MODE_IDS = ["f32", "q8", "q8k", "q8v"]


def z(*shape, dtype=np.float32):
    return np.zeros(shape, dtype=dtype)


def readonly(a):
    a = np.array(a)
    a.flags.writeable = False
    return a


def strided(n):
    """A float32 array of n elements that is not C-contiguous."""
    return np.zeros(2 * n, dtype=np.float32)[::2]


COMPLEX = z(NKV, HD, dtype=np.complex64)
OBJECT = np.full((NKV, HD), None, dtype=object)
STRINGS = np.full((NKV, HD), "x")


# (mode, rows): a q8 layer at exactly 64 rows catches a column freeze fired before validation
LAYER_KINDS = [(F32, 5), (kc.KvMode.Q8(), 5), (kc.KvMode.Q8(), 64),
               (kc.KvMode.Q8(k=True, v=False), 70), (kc.KvMode.Q8(k=False, v=True), 3)]
LAYER_IDS = ["f32-5", "q8-5", "q8-64", "q8k-70", "q8v-3"]


@pytest.fixture(params=LAYER_KINDS, ids=LAYER_IDS)
def layer(request, rng, make_kv):
    mode, rows = request.param
    c = kc.LayerKvCache(NKV, HD, mode=mode)
    k, v = make_kv(rng, rows, NKV, HD)
    c.append(k, v)
    c.append(k[0], v[0], alive=[False, True])             # heads of different lengths
    c.attend_all_heads(rng.standard_normal((NH, HD)))     # non-zero importance
    c.linear_state = [1.0, 2.0, 3.0]
    c.linear_scratch = [4.0]
    return c


# ---------------------------------------------------------------------------- LayerKvCache
# (id, call, exception, parameter named in a ValueError message or None)
LAYER_CASES = [
    # append: shapes
    ("append-k-hd", lambda c: c.append(z(NKV, HD - 1), z(NKV, HD - 1)), ValueError, "k_new"),
    ("append-k-heads", lambda c: c.append(z(NKV + 1, HD), z(NKV + 1, HD)), ValueError, "k_new"),
    ("append-k-flat", lambda c: c.append(z(NKV * HD - 1), z(NKV * HD)), ValueError, "k_new"),
    ("append-k-3d-hd", lambda c: c.append(z(2, NKV, HD + 1), z(2, NKV, HD + 1)), ValueError, "k_new"),
    ("append-k-4d", lambda c: c.append(z(1, 1, NKV, HD), z(1, 1, NKV, HD)), ValueError, "k_new"),
    ("append-k-scalar", lambda c: c.append(1.0, 1.0), ValueError, "k_new"),
    ("append-v-shape", lambda c: c.append(z(NKV, HD), z(NKV, HD + 1)), ValueError, "v_new"),
    ("append-v-other-n", lambda c: c.append(z(3, NKV, HD), z(2, NKV, HD)), ValueError, "v_new"),
    ("append-v-one-vs-block", lambda c: c.append(z(NKV, HD), z(2, NKV, HD)), ValueError, "v_new"),
    ("append-k-ragged", lambda c: c.append([[1.0, 2.0], [3.0]], z(NKV, HD)), ValueError, None),
    # append: dtypes
    ("append-k-complex", lambda c: c.append(COMPLEX, z(NKV, HD)), TypeError, None),
    ("append-v-complex", lambda c: c.append(z(NKV, HD), COMPLEX), TypeError, None),
    ("append-k-object", lambda c: c.append(OBJECT, z(NKV, HD)), TypeError, None),
    ("append-v-strings", lambda c: c.append(z(NKV, HD), STRINGS), TypeError, None),
    ("append-k-bytes", lambda c: c.append(np.full((NKV, HD), b"a"), z(NKV, HD)), TypeError, None),
    # append: alive
    ("alive-short", lambda c: c.append(z(NKV, HD), z(NKV, HD), [True]), ValueError, "alive"),
    ("alive-long", lambda c: c.append(z(NKV, HD), z(NKV, HD), [True] * (NKV + 1)), ValueError, "alive"),
    ("alive-empty", lambda c: c.append(z(NKV, HD), z(NKV, HD), []), ValueError, "alive"),
    ("alive-2d", lambda c: c.append(z(NKV, HD), z(NKV, HD), [[True] * NKV]), ValueError, "alive"),
    ("alive-float", lambda c: c.append(z(NKV, HD), z(NKV, HD), [1.0, 0.0]), TypeError, None),
    ("alive-strings", lambda c: c.append(z(NKV, HD), z(NKV, HD), ["yes", "no"]), TypeError, None),
    ("alive-object", lambda c: c.append(z(NKV, HD), z(NKV, HD), np.array([True, None], dtype=object)),
     TypeError, None),
    # attend
    ("attend-q-short", lambda c: c.attend(z(HD - 1), 0), ValueError, "q"),
    ("attend-q-two-heads", lambda c: c.attend(z(2, HD), 0), ValueError, "q"),
    ("attend-q-complex", lambda c: c.attend(z(HD, dtype=np.complex128), 0), TypeError, None),
    ("attend-q-strings", lambda c: c.attend(np.full(HD, "1"), 0), TypeError, None),
    # attend_all_heads: q
    ("aah-heads-not-multiple", lambda c: c.attend_all_heads(z(NKV + 1, HD)), ValueError, "q"),
    ("aah-zero-heads", lambda c: c.attend_all_heads(z(0, HD)), ValueError, "q"),
    ("aah-zero-heads-block", lambda c: c.attend_all_heads(z(1, 0, HD)), ValueError, "q"),
    ("aah-more-positions", lambda c: c.attend_all_heads(z(c.seq_len + 1, NH, HD)), ValueError, "q"),
    ("aah-hd", lambda c: c.attend_all_heads(z(NH, HD + 1)), ValueError, "q"),
    ("aah-1d", lambda c: c.attend_all_heads(z(NH * HD)), ValueError, "q"),
    ("aah-4d", lambda c: c.attend_all_heads(z(1, 1, NH, HD)), ValueError, "q"),
    ("aah-complex", lambda c: c.attend_all_heads(z(NH, HD, dtype=np.complex64)), TypeError, None),
    ("aah-object", lambda c: c.attend_all_heads(np.full((NH, HD), None)), TypeError, None),
    # attend_all_heads: options
    ("aah-window-0", lambda c: c.attend_all_heads(z(NH, HD), window=0), ValueError, "window"),
    ("aah-window-neg", lambda c: c.attend_all_heads(z(NH, HD), window=-3), ValueError, "window"),
    ("aah-window-float", lambda c: c.attend_all_heads(z(NH, HD), window=2.5), TypeError, None),
    ("aah-softcap-neg", lambda c: c.attend_all_heads(z(NH, HD), softcap=-1.0), ValueError, "softcap"),
    ("aah-softcap-nan", lambda c: c.attend_all_heads(z(NH, HD), softcap=np.nan), ValueError, "softcap"),
    ("aah-scale-nan", lambda c: c.attend_all_heads(z(NH, HD), scale=np.nan), ValueError, "scale"),
    ("aah-scale-inf", lambda c: c.attend_all_heads(z(NH, HD), scale=np.inf), ValueError, "scale"),
    ("aah-scale-str", lambda c: c.attend_all_heads(z(NH, HD), scale="0.5"), TypeError, None),
    ("aah-scale-complex", lambda c: c.attend_all_heads(z(NH, HD), scale=1j), TypeError, None),
    # attend_all_heads: out
    ("aah-out-shape", lambda c: c.attend_all_heads(z(NH, HD), out=z(NH, HD + 1)), ValueError, "out"),
    ("aah-out-block-shape", lambda c: c.attend_all_heads(z(NH, HD), out=z(1, NH, HD)), ValueError, "out"),
    ("aah-out-f64", lambda c: c.attend_all_heads(z(NH, HD), out=z(NH, HD, dtype=np.float64)),
     TypeError, None),
    ("aah-out-readonly", lambda c: c.attend_all_heads(z(NH, HD), out=readonly(z(NH, HD))),
     ValueError, "out"),
    ("aah-out-list", lambda c: c.attend_all_heads(z(NH, HD), out=[[0.0] * HD] * NH), TypeError, None),
    ("aah-out-strided", lambda c: c.attend_all_heads(z(NH, HD), out=z(NH, 2 * HD)[:, ::2]),
     ValueError, "out"),
    # accumulate_imp
    ("imp-2d", lambda c: c.accumulate_imp(z(1, c.seq_len)), ValueError, "probs"),
    ("imp-0d-f32", lambda c: c.accumulate_imp(np.array(0.5, np.float32)), ValueError, "probs"),
    ("imp-complex", lambda c: c.accumulate_imp(z(3, dtype=np.complex64)), TypeError, None),
    ("imp-strings", lambda c: c.accumulate_imp(["a", "b"]), TypeError, None),
    # truncate_last
    ("truncate-neg", lambda c: c.truncate_last(-1), ValueError, "n"),
    ("truncate-float", lambda c: c.truncate_last(1.5), TypeError, None),
    ("truncate-str", lambda c: c.truncate_last("1"), TypeError, None),
    ("truncate-none", lambda c: c.truncate_last(None), TypeError, None),
]


def _set_state(c, name, value):
    setattr(c, name, value)


# read-only attributes cannot be assigned
for _name in ("seq_len", "mode", "num_kv_heads", "head_dim", "importance"):
    LAYER_CASES.append((f"assign-{_name}", lambda c, n=_name: _set_state(c, n, 1), AttributeError, None))


for _name in ("linear_state", "linear_scratch"):
    LAYER_CASES += [
        (f"{_name}-2d", lambda c, n=_name: _set_state(c, n, z(2, 2)), ValueError, _name),
        (f"{_name}-0d-f32", lambda c, n=_name: _set_state(c, n, np.array(1.0, np.float32)),
         ValueError, _name),
        (f"{_name}-complex", lambda c, n=_name: _set_state(c, n, z(3, dtype=np.complex64)), TypeError, None),
        (f"{_name}-strings", lambda c, n=_name: _set_state(c, n, ["a"]), TypeError, None),
    ]

HEAD_METHODS = ["head_len", "head_keys", "head_values", "q8_rows", "columns", "attend"]
BAD_HEADS = [(NKV, IndexError), (NKV + 5, IndexError), (-1, IndexError), (-NKV - 1, IndexError),
             (10 ** 20, IndexError), (np.int64(NKV), IndexError), (1.0, TypeError),
             ("0", TypeError), (None, TypeError)]


def _call_head_method(c, method, h):
    if method == "attend":
        return c.attend(z(HD), h)
    return getattr(c, method)(h)


for _m in HEAD_METHODS:
    for _h, _exc in BAD_HEADS:
        LAYER_CASES.append((f"{_m}-head-{_h!r}", lambda c, m=_m, h=_h: _call_head_method(c, m, h), _exc, None))


@pytest.mark.parametrize("call, exc, param", [c[1:] for c in LAYER_CASES],
                         ids=[c[0] for c in LAYER_CASES])
def test_layer_rejects_bad_input_and_stays_unchanged(layer, snapshot, assert_same_state,
                                                     call, exc, param):
    before = snapshot(layer)
    with pytest.raises(exc) as info:
        call(layer)
    if param is not None:
        msg = str(info.value)
        assert param in msg and "expected" in msg, msg
    assert_same_state(before, snapshot(layer))


# A scalar is not a 1-D array, whatever its dtype: a float32 0-d array is refused above, and
# a Python float or a float64 0-d array must be refused the same way (not read as [x]).
SCALAR_CASES = [
    ("imp-float", lambda c: c.accumulate_imp(1.0), "probs"),
    ("imp-0d-f64", lambda c: c.accumulate_imp(np.array(0.5)), "probs"),
    ("imp-np-float32", lambda c: c.accumulate_imp(np.float32(0.5)), "probs"),
    ("linear_state-float", lambda c: _set_state(c, "linear_state", 1.0), "linear_state"),
    ("linear_scratch-float", lambda c: _set_state(c, "linear_scratch", 1.0), "linear_scratch"),
]


@pytest.mark.parametrize("call, param", [c[1:] for c in SCALAR_CASES], ids=[c[0] for c in SCALAR_CASES])
def test_scalar_is_not_a_one_d_array(rng, make_kv, snapshot, assert_same_state, call, param):
    c = kc.LayerKvCache(NKV, HD, mode=F32)
    c.append(*make_kv(rng, 3, NKV, HD))
    before = snapshot(c)
    with pytest.raises(ValueError) as info:
        call(c)
    assert param in str(info.value) and "expected" in str(info.value)
    assert_same_state(before, snapshot(c))


# attend_group: the cache and the caller's buffers must both survive a refused call
def _group_args(**over):
    args = dict(q_group=np.ones((HPK, HD), np.float32), kv_head=0,
                out=np.full(HPK * HD, 3.0, np.float32), imp_acc=np.full(4, 0.5, np.float32),
                scale=0.25, first=0, softcap=0.0)
    args.update(over)
    return args


GROUP_CASES = [
    ("q-hd", dict(q_group=z(HPK, HD - 1)), ValueError, "q_group"),
    ("q-flat-partial", dict(q_group=z(HD + 3)), ValueError, "q_group"),
    ("q-empty", dict(q_group=z(0, HD), out=z(0)), ValueError, "q_group"),
    ("q-3d", dict(q_group=z(1, HPK, HD)), ValueError, "q_group"),
    ("q-complex", dict(q_group=z(HPK, HD, dtype=np.complex64)), TypeError, None),
    ("q-strings", dict(q_group=np.full((HPK, HD), "a")), TypeError, None),
    ("head-high", dict(kv_head=NKV), IndexError, None),
    ("head-neg", dict(kv_head=-1), IndexError, None),
    ("head-float", dict(kv_head=0.0), TypeError, None),
    ("out-size", dict(out=z(HPK * HD + 1)), ValueError, "out"),
    ("out-f64", dict(out=z(HPK * HD, dtype=np.float64)), TypeError, None),
    ("out-readonly", dict(out=readonly(z(HPK * HD))), ValueError, "out"),
    ("out-strided", dict(out=strided(HPK * HD)), ValueError, "out"),
    ("out-list", dict(out=[0.0] * (HPK * HD)), TypeError, None),
    ("out-none", dict(out=None), TypeError, None),
    ("imp-2d", dict(imp_acc=z(2, 2)), ValueError, "imp_acc"),
    ("imp-f64", dict(imp_acc=z(4, dtype=np.float64)), TypeError, None),
    ("imp-readonly", dict(imp_acc=readonly(z(4))), ValueError, "imp_acc"),
    ("imp-strided", dict(imp_acc=strided(4)), ValueError, "imp_acc"),
    ("imp-list", dict(imp_acc=[0.0] * 4), TypeError, None),
    ("scale-nan", dict(scale=np.nan), ValueError, "scale"),
    ("scale-inf", dict(scale=-np.inf), ValueError, "scale"),
    ("scale-str", dict(scale="1"), TypeError, None),
    ("first-neg", dict(first=-1), ValueError, "first"),
    ("first-float", dict(first=1.5), TypeError, None),
    ("softcap-neg", dict(softcap=-0.5), ValueError, "softcap"),
    ("softcap-nan", dict(softcap=np.nan), ValueError, "softcap"),
    ("softcap-str", dict(softcap="x"), TypeError, None),
]


@pytest.mark.parametrize("over, exc, param", [c[1:] for c in GROUP_CASES],
                         ids=[c[0] for c in GROUP_CASES])
def test_attend_group_rejects_bad_input(layer, snapshot, assert_same_state, over, exc, param):
    args = _group_args(**over)
    buffers = {k: np.array(args[k], copy=True) for k in ("out", "imp_acc")
               if isinstance(args[k], np.ndarray)}
    before = snapshot(layer)
    with pytest.raises(exc) as info:
        layer.attend_group(**args)
    if param is not None:
        assert param in str(info.value) and "expected" in str(info.value), str(info.value)
    assert_same_state(before, snapshot(layer))
    for name, saved in buffers.items():
        assert np.array_equal(args[name], saved), name


def test_attend_all_heads_on_empty_layer_is_refused():
    c = kc.LayerKvCache(NKV, HD, mode=F32)
    with pytest.raises(ValueError, match="expected"):
        c.attend_all_heads(z(NH, HD))          # the newest position does not exist yet
    assert c.seq_len == 0 and c.importance.shape == (0,)


@pytest.mark.parametrize("args, exc", [
    ((0, HD), ValueError), ((-1, HD), ValueError), ((NKV, 0), ValueError), ((NKV, -8), ValueError),
    ((2.0, HD), TypeError), (("2", HD), TypeError), ((NKV, None), TypeError),
    ((NKV, HD, "q2"), ValueError), ((NKV, HD, 1), TypeError), ((NKV, HD, kc.EvictionPolicy.RECENT), TypeError),
])
def test_layer_constructor_rejects_bad_geometry(args, exc):
    with pytest.raises(exc):
        kc.LayerKvCache(*args)


# ---------------------------------------------------------------------------- no-op edge inputs
def test_degenerate_but_valid_inputs_change_nothing(layer, snapshot, assert_same_state):
    before = snapshot(layer)
    layer.append(z(0, NKV, HD), z(0, NKV, HD))               # an empty block
    layer.accumulate_imp([])
    layer.truncate_last(0)
    out = layer.attend_all_heads(z(0, NH, HD))
    assert out.shape == (0, NH, HD)
    assert_same_state(before, snapshot(layer))


def test_huge_counts_saturate(layer):
    layer.truncate_last(2 ** 70)
    assert layer.seq_len == 0 and all(layer.head_len(h) == 0 for h in range(NKV))
    assert layer.importance.shape == (0,)


def test_huge_window_sees_everything(rng, make_kv):
    k, v = make_kv(rng, 6, NKV, HD)
    a, b = (kc.LayerKvCache(NKV, HD, mode=F32) for _ in range(2))
    a.append(k, v)
    b.append(k, v)
    q = rng.standard_normal((NH, HD)).astype(np.float32)
    assert np.array_equal(a.attend_all_heads(q, window=10 ** 12), b.attend_all_heads(q))


# ---------------------------------------------------------------------------- NaN / inf values
def _poison(x, rng):
    """Put NaN, +inf and -inf into head 0 of a (n, nkv, hd) block (a copy)."""
    x = x.copy()
    x[1, 0, 2] = np.nan
    x[3, 0, 0] = np.inf
    x[4, 0, 5] = -np.inf
    return x


@pytest.mark.parametrize("mode", ALL_MODES, ids=MODE_IDS)
def test_nan_and_inf_values_are_accepted_and_do_not_leak(rng, make_kv, mode):
    rows = 80                                           # crosses the q8 column freeze
    k, v = make_kv(rng, rows, NKV, HD)
    clean, dirty = (kc.LayerKvCache(NKV, HD, mode=mode) for _ in range(2))
    clean.append(k, v)
    dirty.append(_poison(k, rng), _poison(v, rng))      # not an error
    assert dirty.seq_len == rows and [dirty.head_len(h) for h in range(NKV)] == [rows, rows]
    if not mode.quant_k:                                # f32 stores the values as given
        keys = dirty.head_keys(0)
        assert np.isnan(keys[1, 2]) and keys[3, 0] == np.inf and keys[4, 5] == -np.inf
    if not mode.quant_v:
        assert np.isnan(dirty.head_values(0)[1, 2])

    q = rng.standard_normal((5, NH, HD)).astype(np.float32)
    q_dirty = q.copy()
    q_dirty[:, 0, 1] = np.nan                           # query head 0 reads KV group 0 only
    q_dirty[:, 0, 4] = np.inf
    got_clean = clean.attend_all_heads(q)
    got_dirty = dirty.attend_all_heads(q_dirty)
    # group 1 (query heads HPK..) never sees head 0's rows or query head 0
    assert got_dirty[:, HPK:].tobytes() == got_clean[:, HPK:].tobytes()
    # query head 1 shares group 0 with the NaN query but not its NaN: it matches a clean
    # query over the same poisoned rows
    ref = kc.LayerKvCache(NKV, HD, mode=mode)
    ref.append(_poison(k, rng), _poison(v, rng))
    assert ref.attend_all_heads(q)[:, 1].tobytes() == got_dirty[:, 1].tobytes()

    for h in range(NKV):                                # single-head forms run too
        out, probs = dirty.attend(q[0, 0], h)
        assert out.shape == (HD,) and probs.shape == (rows,)
    o_clean, o_dirty = np.empty(HPK * HD, np.float32), np.empty(HPK * HD, np.float32)
    clean.attend_group(q[0, HPK:], 1, o_clean, z(rows), 0.3, 0, 0.0)
    dirty.attend_group(q[0, HPK:], 1, o_dirty, z(rows), 0.3, 0, 0.0)
    assert o_clean.tobytes() == o_dirty.tobytes()


def test_nan_query_gives_nan_output_in_f32(rng, make_kv):
    k, v = make_kv(rng, 4, NKV, HD)
    c = kc.LayerKvCache(NKV, HD, mode=F32)
    c.append(k, v)
    q = np.ones((NH, HD), np.float32)
    q[0, 0] = np.nan
    out = c.attend_all_heads(q)
    assert np.all(np.isnan(out[0]))                     # NaN scores propagate (IEEE)
    assert np.all(np.isfinite(out[1:]))


def test_nan_importance_is_accepted(rng, make_kv):
    k, v = make_kv(rng, 6, NKV, HD)
    kv = kc.KvCache(1, NKV, HD, policy=kc.EvictionPolicy.born(sink=1), mode=F32)
    kv.layers[0].append(k, v)
    kv.layers[0].accumulate_imp([0.0, np.nan, 1.0, np.nan, 2.0, 0.0])
    kv.evict(4)                                         # NaN ranks as "no mass", no crash
    assert kv.seq_len == 4 and kv.layers[0].head_len(0) == 4


# ---------------------------------------------------------------------------- KvCache
@pytest.fixture
def model(rng, make_kv):
    kv = kc.KvCache(2, NKV, HD, max_seq_len=16, mode=F32)
    for i, layer in enumerate(kv.layers):
        k, v = make_kv(rng, 5 + i, NKV, HD)
        layer.append(k, v)
        layer.accumulate_imp(rng.random(5 + i))
    return kv


MODEL_CASES = [
    ("evict-neg", lambda kv: kv.evict(-1), ValueError),
    ("evict-float", lambda kv: kv.evict(2.5), TypeError),
    ("evict-str", lambda kv: kv.evict("3"), TypeError),
    ("evict-none", lambda kv: kv.evict(None), TypeError),
    ("truncate-neg", lambda kv: kv.truncate_last(-2), ValueError),
    ("truncate-float", lambda kv: kv.truncate_last(1.0), TypeError),
    ("truncate-str", lambda kv: kv.truncate_last("1"), TypeError),
]


@pytest.mark.parametrize("call, exc", [c[1:] for c in MODEL_CASES], ids=[c[0] for c in MODEL_CASES])
def test_kvcache_rejects_bad_input_and_stays_unchanged(model, snapshot, assert_same_state, call, exc):
    before = [snapshot(layer) for layer in model.layers]
    with pytest.raises(exc):
        call(model)
    for b, layer in zip(before, model.layers):
        assert_same_state(b, snapshot(layer))
    assert model.seq_len == 6


def test_kvcache_truncate_refused_by_one_layer_touches_none(model, snapshot, assert_same_state):
    layer = model.layers[1]
    layer.o1_begin(4, 8, 2)
    layer.o1_push_q(np.zeros((layer.seq_len, layer.num_kv_heads, layer.head_dim)))
    assert layer.o1_seal(layer.num_kv_heads)
    before = [snapshot(layer) for layer in model.layers]
    with pytest.raises(RuntimeError):
        model.truncate_last(1)
    for b, layer in zip(before, model.layers):
        assert_same_state(b, snapshot(layer))


@pytest.mark.parametrize("kwargs, exc", [
    (dict(n_layers=-1), ValueError), (dict(n_layers=1.5), TypeError), (dict(n_layers="2"), TypeError),
    (dict(num_kv_heads=0), ValueError), (dict(head_dim=0), ValueError), (dict(head_dim=2.0), TypeError),
    (dict(max_seq_len=0), ValueError), (dict(max_seq_len=-5), ValueError),
    (dict(max_seq_len=1.5), TypeError),
    (dict(policy="born"), TypeError), (dict(policy=kc.KvMode.F32), TypeError),
    (dict(mode="q2"), ValueError), (dict(mode=kc.EvictionPolicy.RECENT), TypeError),
])
def test_kvcache_constructor_rejects_bad_arguments(kwargs, exc):
    args = dict(n_layers=2, num_kv_heads=NKV, head_dim=HD, mode=F32)
    args.update(kwargs)
    with pytest.raises(exc):
        kc.KvCache(**args)


# ---------------------------------------------------------------------------- policies and modes
@pytest.mark.parametrize("call, exc", [
    (lambda: kc.EvictionPolicy.born(sink=-1), ValueError),
    (lambda: kc.EvictionPolicy.born(sink=1.5), TypeError),
    (lambda: kc.EvictionPolicy.born(sink="4"), TypeError),
    (lambda: kc.EvictionPolicy.born(sink=None), TypeError),
    (lambda: kc.EvictionPolicy("lru"), ValueError),
    (lambda: kc.KvMode.Q8(k=False, v=False), ValueError),
], ids=["born-neg", "born-float", "born-str", "born-none", "unknown-kind", "q8-nothing"])
def test_policy_and_mode_constructors_reject_bad_arguments(call, exc):
    with pytest.raises(exc):
        call()


@pytest.mark.parametrize("obj", [kc.EvictionPolicy.RECENT, kc.EvictionPolicy.born(sink=2),
                                 kc.KvMode.F32, kc.KvMode.Q8()],
                         ids=["recent", "born", "f32", "q8"])
def test_policies_and_modes_refuse_mutation(obj):
    before = repr(obj)
    for attr in ("kind", "sink", "quant_k", "_sink", "_quant_k", "new_field"):
        with pytest.raises(AttributeError):
            setattr(obj, attr, 1)
    assert repr(obj) == before


def test_from_env_refuses_garbage(monkeypatch):
    monkeypatch.setenv("KVCACHE_KV", "bf16")
    with pytest.raises(ValueError):
        kc.KvMode.from_env()


def test_attend_all_heads_parameters_are_checked_in_float32():
    """The kernel computes in float32: a scale or softcap that is finite in float64 but not in
    float32 (1e39), or a nonzero one that underflows to 0 there (1e-46, which for the softcap
    would silently turn it off), is refused; a window longer than any cache is no window,
    even past the range of a C integer."""
    c = kc.LayerKvCache(2, 8, kc.KvMode.F32)
    rng = np.random.default_rng(0)
    c.append(rng.standard_normal((2, 8)).astype(np.float32), rng.standard_normal((2, 8)).astype(np.float32))
    c.append(rng.standard_normal((2, 8)).astype(np.float32), rng.standard_normal((2, 8)).astype(np.float32))
    q = rng.standard_normal((4, 8)).astype(np.float32)
    for kw in (dict(scale=1e39), dict(scale=-1e39), dict(softcap=1e39), dict(softcap=1e-46),
               dict(scale=1e-46)):
        with pytest.raises(ValueError, match="float32"):
            c.attend_all_heads(q, **kw)
    plain = c.attend_all_heads(q)
    for w in (2**63, np.uint64(2**63), 2**200):
        assert np.array_equal(c.attend_all_heads(q, window=w), plain)
    assert c.seq_len == 2


def test_attend_group_first_and_scale_edges():
    """first past any length is clamped (no OverflowError); a scale beyond the float range is a
    ValueError and a bool is not a scale; nothing is written on error."""
    c = kc.LayerKvCache(1, 4, mode=kc.KvMode.F32)
    c.append(np.ones((3, 1, 4), np.float32), np.arange(12, dtype=np.float32).reshape(3, 1, 4))
    out, imp = np.zeros(4, np.float32), np.zeros(3, np.float32)
    last = np.zeros(4, np.float32)
    c.attend_group(np.ones(4), 0, last, np.zeros(3, np.float32), 0.5, 2, 0.0)
    for first in (2**63, np.uint64(2**63), 10**30):
        c.attend_group(np.ones(4), 0, out, imp, 0.5, first, 0.0)
        assert np.array_equal(out, last)
    out[:] = 7.0
    for kw, exc in ((dict(scale=10**400), ValueError), (dict(scale=True), TypeError),
                    (dict(softcap=10**400), ValueError)):
        args = dict(scale=0.5, first=0, softcap=0.0) | kw
        with pytest.raises(exc):
            c.attend_group(np.ones(4), 0, out, imp, args["scale"], args["first"], args["softcap"])
        with pytest.raises(exc):
            c.attend_all_heads(np.ones((1, 4)), **kw)
    assert (out == 7.0).all()
