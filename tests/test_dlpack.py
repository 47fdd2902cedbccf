"""Zero-copy exports: every storage view kvcache hands out goes through DLPack without a copy.

Issue item: "every storage view kvcache hands out is consumable through DLPack
(``torch.from_dlpack``, ``np.from_dlpack``) without a copy; tests prove it by pointer equality
with torch on the CPU".

For each view of every cache (LayerKvCache in float32 and the three q8 modes, KvCache, the O(1)
collecting trace and sealed state, LatentKvCache / StaticKvCache / LazyLatentCache in every
dtype, DecodePlan) the tests check:

1. ``torch.from_dlpack(view)``: the same address (``data_ptr() == view.ctypes.data``), shape,
   element strides and bits;
2. ``np.from_dlpack(view)``: the same address, strides and bits, and a read-only view stays
   read-only (a writable one, ``slot_storage``, stays writable);
3. liveness: a tensor taken earlier sees a later in-place change of the cache (it aliases the
   storage, it is not a snapshot);
4. bfloat16: NumPy's DLPack exporter has no bfloat16 (BufferError), so
   :func:`kvcache.device.as_tensor` exports the bytes as uint16 and reinterprets them: a
   ``torch.bfloat16`` tensor at the same address with the same bits;
5. :func:`kvcache.device.tensors` of ``o1_views()``: every array field a tensor at the
   address of the original view's array, every scalar equal;
6. completeness: every public method or property of these classes that hands out an ndarray
   (found by calling each one with index arguments on a prepared instance) is covered here.

Empty views (no rows yet) are consumable too, but torch gives an empty tensor the address 0:
for them only shape, dtype and the read-only flag are compared.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import inspect

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kvcache as kc  # noqa: E402  (after the skip: nothing to test without torch)
from kvcache.device import as_tensor, tensors  # noqa: E402
from kvcache.o1 import O1Collecting, O1Sealed  # noqa: E402

F32 = kc.KvMode.F32
# the legacy int8 scheme "cmf": its layers hand out column fields too (scheme "rows" has none)
Q8_MODES = [kc.KvMode.Q8(True, True, scheme="cmf"), kc.KvMode.Q8(True, False, scheme="cmf"),
            kc.KvMode.Q8(False, True, scheme="cmf")]
NKV, HD = 2, 40              # head_dim 40: two K scale groups of 32 channels per q8 row
H, G, D = 4, 2, 16           # O(1): query heads, KV groups, head_dim
M, W, SINK, P = 8, 16, 4, 96  # P > W + SINK + 8: the seal is a skeleton, not exact-only


def _dtypes():
    out = [np.float32, np.float16, np.float64]
    try:
        import ml_dtypes
    except ImportError:
        out.append(pytest.param("bfloat16", marks=pytest.mark.skip("ml_dtypes not installed")))
    else:
        out.append(ml_dtypes.bfloat16)
    return out


DTYPES = _dtypes()
DTYPE_IDS = ["f32", "f16", "f64", "bf16"]


def is_bf16(a):
    return a.dtype.name == "bfloat16"


def rows(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


# ------------------------------------------------------------------------------ the checks
def elem_strides(a):
    """NumPy byte strides in elements (what torch reports), for the axes of length > 1 (the
    stride of a length-0/1 axis is meaningless and exporters may normalise it)."""
    return tuple(s // a.itemsize for s, n in zip(a.strides, a.shape) if n > 1)


def torch_strides(t):
    return tuple(s for s, n in zip(t.stride(), t.shape) if n > 1)


def bits(a):
    """The raw bits of an array (or a CPU tensor) in memory order of its shape, as a NumPy array
    of unsigned ints: a bit-for-bit comparison that does not trip over NaN or -0.0."""
    if isinstance(a, torch.Tensor):
        a = a.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[
            a.element_size()]).numpy()
    return np.ascontiguousarray(a).view(f"u{a.itemsize}")


def check_torch_alias(view, t, name="view"):
    """``t`` is a torch tensor over exactly ``view``'s memory."""
    assert isinstance(t, torch.Tensor), name
    assert t.device.type == "cpu", name
    assert tuple(t.shape) == view.shape, name
    assert t.element_size() == view.itemsize, name
    if view.size == 0:
        return
    assert t.data_ptr() == view.ctypes.data, f"{name}: copied (another address)"
    assert torch_strides(t) == elem_strides(view), name
    np.testing.assert_array_equal(bits(t), bits(view), err_msg=name)


def check_numpy_alias(view, n, name="view"):
    """``n`` is a NumPy array over exactly ``view``'s memory, as writable as ``view``."""
    assert isinstance(n, np.ndarray), name
    assert n.shape == view.shape and n.dtype == view.dtype, name
    assert n.flags.writeable == view.flags.writeable, f"{name}: the read-only flag changed"
    if view.size == 0:
        return
    assert n.ctypes.data == view.ctypes.data, f"{name}: copied (another address)"
    assert elem_strides(n) == elem_strides(view), name
    np.testing.assert_array_equal(bits(n), bits(view), err_msg=name)


def check_zero_copy(view, name="view"):
    """Every DLPack route of ``view`` (a storage view kvcache handed out) aliases it.

    Returns the torch tensor (through :func:`as_tensor`)."""
    assert isinstance(view, np.ndarray), f"{name}: not a numpy array ({type(view).__name__})"
    if is_bf16(view):
        # NumPy's exporter has no bfloat16 code; as_tensor goes through uint16
        try:
            raw = torch.from_dlpack(view)
        except BufferError:
            pass
        else:                                  # a NumPy that exports bfloat16: still no copy
            check_torch_alias(view, raw, name)
        t = as_tensor(view)
        assert t.dtype == torch.bfloat16, name
        check_torch_alias(view, t, name)
        if view.size:
            np.testing.assert_array_equal(t.view(torch.int16).numpy(), view.view(np.int16),
                                          err_msg=name)
        check_numpy_alias(view, as_tensor(view, backend="numpy"), name)
        return t
    t = torch.from_dlpack(view)
    check_torch_alias(view, t, name)
    assert t.dtype == getattr(torch, view.dtype.name), name
    check_numpy_alias(view, np.from_dlpack(view), name)
    t2 = as_tensor(view)
    check_torch_alias(view, t2, name)
    check_numpy_alias(view, as_tensor(view, backend="numpy"), name)
    return t


def check_all(named):
    """check_zero_copy over {name: array}; None entries (absent parts) are skipped.
    Returns the number of non-empty arrays checked."""
    assert named
    n = 0
    for name, arr in named.items():
        if arr is None:
            continue
        check_zero_copy(arr, name)
        n += arr.size > 0
    return n


def tensor(view):
    """The torch tensor over a view (bfloat16 through as_tensor)."""
    return as_tensor(view) if is_bf16(view) else torch.from_dlpack(view)


# ------------------------------------------------------------------------------ prepared caches
def f32_layer(rng, n=5):
    """A float32 layer: n positions (head 1 dead for the last two), importance, linear state
    and scratch."""
    c = kc.LayerKvCache(NKV, HD, mode=F32)
    c.append(rows(rng, n - 2, NKV, HD), rows(rng, n - 2, NKV, HD))
    for _ in range(2):
        c.append(rows(rng, NKV, HD), rows(rng, NKV, HD), alive=[True, False])
    c.attend_all_heads(rows(rng, 2 * NKV, HD))
    c.linear_state = rng.standard_normal(7)
    c.linear_scratch = rng.standard_normal(3)
    return c


def q8_layer(rng, mode, n=70):
    """A q8 layer past the column freeze (it fires at the 65th position)."""
    c = kc.LayerKvCache(NKV, HD, mode=mode)
    c.append(rows(rng, n, NKV, HD), rows(rng, n, NKV, HD))
    c.attend_all_heads(rows(rng, NKV, HD))
    return c


def o1_data(rng, t=P + 8):
    return rows(rng, t, H, D), rows(rng, t, G, D), rows(rng, t, G, D)


def sealed_layer(rng, rect=kc.O1Rect.AGGREGATE):
    """A layer sealed in skeleton mode on P positions (as tests/test_o1.py does), and the
    data of 8 more decode positions."""
    q, k, v = o1_data(rng)
    c = kc.LayerKvCache(G, D, mode=F32)
    c.o1_begin(M, W, SINK, rect)
    c.o1_push_q(q[:P])
    c.append(k[:P], v[:P])
    assert c.o1_seal(H) and not c.o1.exact_only
    return c, (q, k, v)


def collecting_layer(rng, n=3):
    c = kc.LayerKvCache(G, D, mode=F32)
    c.o1_begin(M, W, SINK)
    q, k, v = o1_data(rng, n)
    c.o1_push_q(q)
    c.append(k, v)
    return c


LATENT_TRAILING = ((6,), (2,), ())     # MLA-like latent + rope key, and a per-token scalar


def latent_cache(rng, dtype, n=3):
    c = kc.LatentKvCache.with_capacity(2, 8, LATENT_TRAILING, dtype=dtype)
    for layer in range(c.n_layers):
        c.write_layer(layer, [rng.standard_normal((n,) + t) for t in LATENT_TRAILING])
    c.advance(n)
    return c


def static_cache(rng, dtype, n=3):
    c = kc.StaticKvCache.with_capacity(2, NKV, HD, 8, dtype=dtype)
    for layer in range(c.n_layers):
        c.write_layer(layer, rng.standard_normal((1, NKV, n, HD)),
                      rng.standard_normal((1, NKV, n, HD)))
    c.advance(n)
    return c


def lazy_cache(rng, dtype, n=3):
    c = kc.LazyLatentCache.new(2, 8, LATENT_TRAILING, dtype=dtype)
    for layer in range(c.n_layers):
        c = c.append(layer, [rng.standard_normal((n,) + t) for t in LATENT_TRAILING])
    return c.advance_by(n)


# ------------------------------------------------------------------------------ 1, 2, 4: aliasing
# The views, by hand.  Compiled from the accessors of layer.py, latent.py, o1.py, model.py and
# rebind.py that return an ndarray (or a tuple/list/mapping/dataclass of them); the
# completeness test at the end re-discovers them by introspection and fails when one is added
# without being listed (HANDED_OUT) here.
def layer_views(c, prefix="layer"):
    out = {}
    for h in range(c.num_kv_heads):
        out[f"{prefix}.head_keys({h})"] = c.head_keys(h)
        out[f"{prefix}.head_values({h})"] = c.head_values(h)
        out[f"{prefix}.k_heads()[{h}]"] = c.k_heads()[h]
        out[f"{prefix}.v_heads()[{h}]"] = c.v_heads()[h]
        for name, a in zip(("kq", "ks", "vq", "vs"), c.q8_rows(h)):
            out[f"{prefix}.q8_rows({h}).{name}"] = a
        for name, a in zip(("kcol", "vcol"), c.columns(h)):
            out[f"{prefix}.columns({h}).{name}"] = a
        for name, a in zip(("keys", "values"), c.head_rows(h)):     # views where float32
            out[f"{prefix}.head_rows({h}).{name}"] = a
    st = c.state()                          # the state protocol: read-only views, no copies
    for f in dataclasses.fields(st):        # (the row arrays; lengths and columns are per head)
        a = getattr(st, f.name)
        if isinstance(a, np.ndarray) and f.name not in ("lengths", "kcol", "vcol", "kcol_on",
                                                        "vcol_on"):
            out[f"{prefix}.state().{f.name}"] = a
    out[f"{prefix}.importance"] = c.importance
    out[f"{prefix}.linear_state"] = c.linear_state
    out[f"{prefix}.linear_scratch"] = c.linear_scratch
    return out


def o1_view_arrays(views, prefix="o1_views()"):
    out = {}
    for g, view in enumerate(views):
        for f in ("win_k", "win_v", "sink_k", "sink_v", "k_tilde"):
            out[f"{prefix}[{g}].{f}"] = getattr(view, f)
        for i, head in enumerate(view.heads):
            for f in ("t_hat", "z_hat", "m_max", "q_tilde", "mu"):
                out[f"{prefix}[{g}].heads[{i}].{f}"] = getattr(head, f)
    return out


SEALED_ARRAYS = ("win_k", "win_v", "sink_k", "sink_v", "k_tilde", "q_tilde", "mu", "t_hat",
                 "z_hat", "m_max", "scr")


def slot_views(c, kind):
    """The views of a LatentKvCache ("latent"), StaticKvCache ("static") or LazyLatentCache
    ("lazy"), and of a DecodePlan bound to the first two."""
    out = {}
    for layer in range(c.n_layers):
        for s in range(c.n_slots):
            key = f"{kind}[{layer},{s}]"
            if kind == "lazy":
                out[f"{key}.slot"] = c.slot(layer, s)
                out[f"{key}.slot_buffer_full"] = c.slot_buffer_full(layer, s)
                continue
            out[f"{key}.slot_storage"] = c.slot_storage(layer, s)
            out[f"{key}.valid_view"] = c.valid_view(layer, s)
            out[f"{key}.rebind_slot"] = c.rebind_slot(layer, s)
            out[f"{key}.layers.storage"] = c.layers[layer][s].storage
            out[f"{key}.slot_state.storages"] = c.state().storages[layer][s]
    if kind != "lazy":
        plan = kc.rebind.DecodePlan.build(c, slots=tuple(range(c.n_slots)))
        for (layer, s), arr in plan.bound.items():
            out[f"plan.bound[{layer},{s}]"] = arr
            out[f"plan.storage({layer},{s})"] = plan.storage(layer, s)
            assert arr is c.slot_storage(layer, s)
    return out


@pytest.mark.parametrize("mode", [F32] + Q8_MODES, ids=["f32", "q8kv", "q8k", "q8v"])
def test_layer_views_are_zero_copy(rng, mode):
    c = f32_layer(rng) if mode.is_f32 else q8_layer(rng, mode)
    views = layer_views(c)
    # the int8 parts exist exactly in their modes, frozen columns after the 65th position
    for h in range(NKV):
        assert (views[f"layer.q8_rows({h}).kq"] is not None) == mode.quant_k
        assert (views[f"layer.q8_rows({h}).vq"] is not None) == mode.quant_v
        assert (views[f"layer.columns({h}).kcol"] is not None) == mode.quant_k
        assert (views[f"layer.columns({h}).vcol"] is not None) == mode.quant_v
        if mode.quant_k:
            assert views[f"layer.q8_rows({h}).ks"].shape == (70, 2)
    assert check_all(views) >= 2 * NKV + 1
    # read-only views stay read-only through np.from_dlpack
    for name in ("layer.head_keys(0)", "layer.importance"):
        assert not np.from_dlpack(views[name]).flags.writeable


def test_empty_layer_views_are_consumable():
    """A fresh layer (and a fresh q8 layer): empty views, consumable all the same."""
    views = layer_views(kc.LayerKvCache(NKV, HD, mode=F32), "f32")
    views.update(layer_views(kc.LayerKvCache(NKV, HD, mode=Q8_MODES[0]), "q8"))
    for name, a in views.items():
        if a is not None:
            assert a.size == 0, name
    check_all(views)
    t = torch.from_dlpack(views["q8.q8_rows(0).kq"])
    assert t.dtype == torch.int8 and tuple(t.shape) == (0, HD)


def test_kvcache_layer_views_are_zero_copy(rng):
    kv = kc.KvCache(2, NKV, HD, mode=F32)
    for layer in kv.layers:
        layer.append(rows(rng, 4, NKV, HD), rows(rng, 4, NKV, HD))
    views = {}
    for i in range(len(kv)):
        views.update(layer_views(kv[i], f"kv[{i}]"))
    assert check_all(views) > 0
    # kv[i] is the layer itself (no copy on the way): its views sit on the layer's storage
    assert kv[1] is kv.layers[1]
    assert torch.from_dlpack(kv[1].head_keys(1)).data_ptr() == kv.layers[1].head_keys(1).ctypes.data


def test_o1_collecting_trace_is_zero_copy(rng):
    c = collecting_layer(rng)
    assert isinstance(c.o1, O1Collecting)
    trace = c.o1.trace
    assert trace.size == 3 * H * D and not trace.flags.writeable
    check_zero_copy(trace, "o1.trace")


@pytest.mark.parametrize("rect", [kc.O1Rect.AGGREGATE, kc.O1Rect.FM], ids=["agg", "fm"])
def test_o1_sealed_views_are_zero_copy(rng, rect):
    c, _ = sealed_layer(rng, rect)
    views = c.o1_views()
    assert len(views) == G and all(len(v.heads) == H // G for v in views)
    named = o1_view_arrays(views)
    assert all(a.size for a in named.values())
    check_all(named)
    # the sealed state's own arrays (public attributes of layer.o1)
    assert isinstance(c.o1, O1Sealed)
    check_all({f"o1.{f}": getattr(c.o1, f) for f in SEALED_ARRAYS})
    # a view of group g is row g of the state's arrays: same address, no copy on the way
    st = c.o1
    hpk = H // G
    for g, view in enumerate(views):
        assert torch.from_dlpack(view.win_k).data_ptr() == st.win_k[g].ctypes.data
        for i, head in enumerate(view.heads):
            assert torch.from_dlpack(head.t_hat).data_ptr() == st.t_hat[g * hpk + i].ctypes.data


def test_exact_only_seal_has_no_views_but_state_arrays_are_zero_copy(rng):
    c = kc.LayerKvCache(G, D, mode=F32)
    c.o1_begin(M, W, SINK)
    q, k, v = o1_data(rng, 3)
    c.o1_push_q(q)
    c.append(k, v)
    assert c.o1_seal(H) and c.o1.exact_only
    assert c.o1_views() is None
    check_all({f"o1.{f}": getattr(c.o1, f) for f in SEALED_ARRAYS})   # empty parts included


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("kind", ["latent", "static", "lazy"])
def test_slot_cache_views_are_zero_copy(rng, kind, dtype):
    make = {"latent": latent_cache, "static": static_cache, "lazy": lazy_cache}[kind]
    c = make(rng, dtype)
    views = slot_views(c, kind)
    check_all(views)
    for name, a in views.items():
        assert a.dtype == c.dtype, name
        writable = name.endswith(("slot_storage", "rebind_slot", "layers.storage",
                                  "state.storages")) or \
            name.startswith("plan.")
        assert a.flags.writeable == writable, name
        if a.size:
            assert np.any(bits(a)), f"{name}: expected data, got zeros"  # data was written
    # every view of one (layer, slot) sits on the one buffer
    for layer in range(c.n_layers):
        for s in range(c.n_slots):
            key = f"{kind}[{layer},{s}]"
            full = views[f"{key}.slot_buffer_full" if kind == "lazy" else f"{key}.slot_storage"]
            part = views[f"{key}.slot" if kind == "lazy" else f"{key}.valid_view"]
            assert tensor(part).data_ptr() == tensor(full).data_ptr() == full.ctypes.data


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_empty_slot_cache_views_are_consumable(dtype):
    views = {}
    views.update(slot_views(kc.LatentKvCache.with_capacity(1, 4, ((3,), ()), dtype=dtype),
                            "latent"))
    views.update(slot_views(kc.StaticKvCache.with_capacity(1, NKV, HD, 4, dtype=dtype),
                            "static"))
    for name, a in views.items():
        if name.endswith("valid_view"):
            assert a.size == 0 and not a.flags.writeable, name
    check_all(views)
    # a zero-width trailing shape: a non-empty row count with no elements
    c = kc.LatentKvCache.with_capacity(1, 4, ((0,),), dtype=dtype)
    c.write_layer(0, [np.zeros((2, 0))])
    c.advance(2)
    check_all({"latent(0,).valid_view": c.valid_view(0, 0)})


def test_bf16_goes_through_as_tensor(rng):
    """NumPy's DLPack exporter refuses bfloat16; as_tensor reinterprets uint16, no copy."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    c = latent_cache(rng, ml_dtypes.bfloat16)
    view = c.valid_view(0, 0)
    assert view.dtype == ml_dtypes.bfloat16 and view.size
    with pytest.raises(BufferError):
        torch.from_dlpack(view)               # numpy 2.4: "DLPack only supports ... dtypes"
    t = as_tensor(view)
    assert t.dtype == torch.bfloat16 and tuple(t.shape) == view.shape
    assert t.data_ptr() == view.ctypes.data
    np.testing.assert_array_equal(t.view(torch.int16).numpy(), view.view(np.int16))
    # and the values, as numbers
    np.testing.assert_array_equal(t.float().numpy(), view.astype(np.float32))
    # the numpy backend keeps the dtype, the address and the read-only flag
    n = as_tensor(view, backend="numpy")
    assert n.dtype == view.dtype and n.ctypes.data == view.ctypes.data
    assert not n.flags.writeable


# ------------------------------------------------------------------------------ 3: liveness
def test_layer_view_tensors_alias_the_storage_within_capacity(rng):
    """A LayerKvCache view's tensor aliases the storage while the capacity holds.

    An append that grows the capacity re-allocates the store (x2) and copies the rows: views
    and tensors taken before keep pointing at the old buffer.  So liveness is tested for the
    in-place changes (rollback + re-append within the capacity, eviction, importance), and past
    a re-allocation the tensor is only required to equal the view it came from, which it
    keeps alive (it does not follow the cache to the new buffer)."""
    kv = kc.KvCache(1, NKV, HD, policy=kc.EvictionPolicy.RECENT, mode=F32)
    c = kv[0]
    k, v = rows(rng, 10, NKV, HD), rows(rng, 10, NKV, HD)
    c.append(k, v)                                    # capacity 16
    keys = torch.from_dlpack(c.head_keys(0))
    vals = torch.from_dlpack(c.head_values(1))
    # speculative rollback then re-append: rows 7..9 rewritten in place
    c.truncate_last(3)
    k2, v2 = rows(rng, 3, NKV, HD), rows(rng, 3, NKV, HD)
    c.append(k2, v2)
    assert keys.data_ptr() == c.head_keys(0).ctypes.data
    np.testing.assert_array_equal(keys[7:].numpy(), k2[:, 0])
    np.testing.assert_array_equal(vals[7:].numpy(), v2[:, 1])
    np.testing.assert_array_equal(keys.numpy(), c.head_keys(0))
    # eviction shifts the rows down in place: the old tensor sees the kept rows at the front
    kv.evict(4)
    assert c.head_len(0) == 4
    np.testing.assert_array_equal(keys[:4].numpy(), c.head_keys(0))
    np.testing.assert_array_equal(keys[:4].numpy(), np.concatenate([k[6:7, 0], k2[:, 0]]))
    # importance accumulates in place
    imp = torch.from_dlpack(c.importance)
    before = imp.clone()
    c.accumulate_imp(np.ones(4))
    np.testing.assert_array_equal(imp.numpy(), (before + 1).numpy())
    # past the capacity: a new buffer; the old tensor still equals the view it came from
    view = c.head_keys(0)
    old = torch.from_dlpack(view)
    c.append(rows(rng, 40, NKV, HD), rows(rng, 40, NKV, HD))
    assert c.head_keys(0).ctypes.data != old.data_ptr()          # re-allocated
    assert old.data_ptr() == view.ctypes.data
    np.testing.assert_array_equal(bits(old), bits(view))
    np.testing.assert_array_equal(old.numpy(), c.head_keys(0)[:4])   # the rows were copied


@pytest.mark.parametrize("mode", Q8_MODES, ids=["q8kv", "q8k", "q8v"])
def test_q8_view_tensors_alias_the_storage(rng, mode):
    c = q8_layer(rng, mode, n=70)                          # capacity 70, columns frozen
    kq, ks, vq, vs = (None if a is None else torch.from_dlpack(a) for a in c.q8_rows(0))
    cols = [None if a is None else torch.from_dlpack(a) for a in c.columns(0)]
    c.truncate_last(2)
    c.append(rows(rng, 2, NKV, HD) * 5, rows(rng, 2, NKV, HD) * 5)   # rows 68, 69 rewritten
    now = c.q8_rows(0)
    for t, a in zip((kq, ks, vq, vs), now):
        assert (t is None) == (a is None)
        if t is not None:
            assert t.data_ptr() == a.ctypes.data
            np.testing.assert_array_equal(t.numpy(), a)
    for t, a in zip(cols, c.columns(0)):
        if t is not None:
            np.testing.assert_array_equal(t.numpy(), a)


@pytest.mark.parametrize("rect", [kc.O1Rect.AGGREGATE, kc.O1Rect.FM], ids=["agg", "fm"])
def test_o1_view_tensors_follow_steps_and_restores(rng, rect):
    c, (q, k, v) = sealed_layer(rng, rect)
    devs = tensors(c.o1_views())
    start = [{f: getattr(d, f).clone() for f in ("win_k", "win_v")} |
             {f"{f}{i}": getattr(hv, f).clone() for i, hv in enumerate(d.heads)
              for f in ("t_hat", "z_hat", "m_max")} for d in devs]
    snap = c.o1_snapshot()
    for i in range(P, P + 3):
        c.o1_step(q[i], k[i], v[i], H)
    fresh = c.o1_views()
    for d, f_view, s in zip(devs, fresh, start):
        for f in ("win_k", "win_v", "sink_k", "sink_v", "k_tilde"):
            np.testing.assert_array_equal(getattr(d, f).numpy(), getattr(f_view, f))
        for hd_, hf in zip(d.heads, f_view.heads):
            for f in ("t_hat", "z_hat", "m_max", "q_tilde", "mu"):
                np.testing.assert_array_equal(getattr(hd_, f).numpy(), getattr(hf, f))
        # the step changed the ring and the far field under the old tensors
        assert not torch.equal(d.win_k, s["win_k"])
        assert not torch.equal(d.heads[0].t_hat, s["t_hat0"])
        # ... while the snapshot scalars of the old view did not move
        assert d.far_len == P - SINK - W and f_view.far_len == d.far_len + 3
    c.o1_restore(snap)                            # copies back in place
    for d, s in zip(devs, start):
        assert torch.equal(d.win_k, s["win_k"]) and torch.equal(d.win_v, s["win_v"])
        for i, hv in enumerate(d.heads):
            for f in ("t_hat", "z_hat", "m_max"):
                assert torch.equal(getattr(hv, f), s[f"{f}{i}"]), f


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_latent_storage_tensor_sees_write_layer(rng, dtype):
    c = latent_cache(rng, dtype, n=2)
    dt = c.dtype
    store = [tensor(c.slot_storage(1, s)) for s in range(c.n_slots)]
    early = [tensor(c.valid_view(1, s)) for s in range(c.n_slots)]       # rows [0, 2)
    # the next step: write_layer into the buffers slot_storage handed out
    slabs = [rng.standard_normal((3,) + t) for t in LATENT_TRAILING]
    c.write_layer(0, [rng.standard_normal((3,) + t) for t in LATENT_TRAILING])
    c.write_layer(1, slabs)
    for s, t in enumerate(store):
        np.testing.assert_array_equal(bits(t[2:5]), bits(slabs[s].astype(dt)))
    c.advance(3)
    for s, t in enumerate(store):
        view = c.valid_view(1, s)
        assert tensor(view).data_ptr() == t.data_ptr()
        np.testing.assert_array_equal(bits(t[:5]), bits(view))
    # a rewind and a rewrite of row 1: the tensor of the early valid_view sees it
    c.truncate_last(c.cached_len - 1)
    again = [rng.standard_normal((1,) + t) for t in LATENT_TRAILING]
    for layer in range(c.n_layers):
        c.write_layer(layer, again)
    for s, t in enumerate(early):
        np.testing.assert_array_equal(bits(t[1:2]), bits(again[s].astype(dt)))
    # writing through the tensor writes into the cache (torch has no read-only tensors)
    store[0][0].fill_(3.0)
    np.testing.assert_array_equal(c.valid_view(1, 0)[0].astype(np.float32), np.full(6, 3.0))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_static_storage_tensor_sees_write_layer(rng, dtype):
    c = static_cache(rng, dtype, n=2)
    dt = c.dtype
    k_store, v_store = (tensor(c.slot_storage(0, w)) for w in (0, 1))
    k_early = tensor(c.valid_view(0, 0))
    k, v = rng.standard_normal((1, NKV, 1, HD)), rng.standard_normal((1, NKV, 1, HD))
    c.write_layer(0, k, v)
    c.write_layer(1, k, v)
    np.testing.assert_array_equal(bits(k_store[:, :, 2:3]), bits(k.astype(dt)))
    np.testing.assert_array_equal(bits(v_store[:, :, 2:3]), bits(v.astype(dt)))
    c.advance(1)
    for w, t in ((0, k_store), (1, v_store)):
        view = c.valid_view(0, w)
        assert tensor(view).data_ptr() == t.data_ptr()
        assert torch_strides(tensor(view)) == elem_strides(view)
        np.testing.assert_array_equal(bits(t[:, :, :3]), bits(view))
    c.truncate_last(c.cached_len - 1)
    k2 = rng.standard_normal((1, NKV, 1, HD))
    c.write_layer(0, k2, k2)
    np.testing.assert_array_equal(bits(k_early[:, :, 1:2]), bits(k2.astype(dt)))


def test_decode_plan_storage_tensors_alias_the_bound_cache(rng):
    a = latent_cache(rng, np.float32, n=1)
    plan = kc.rebind.DecodePlan.build(a, shape_key="mla")
    t = torch.from_dlpack(plan.storage(0, 0))
    assert t.data_ptr() == a.slot_storage(0, 0).ctypes.data
    slab = [rng.standard_normal((1,) + s) for s in LATENT_TRAILING]
    a.write_layer(0, slab)
    np.testing.assert_array_equal(t[1:2].numpy(), slab[0].astype(np.float32))
    # re-bound to another allocation: the plan hands out the new cache's buffers
    b = latent_cache(rng, np.float32, n=1)
    plan.rebind_kv(b)
    assert torch.from_dlpack(plan.storage(0, 0)).data_ptr() == b.slot_storage(0, 0).ctypes.data
    assert t.data_ptr() == a.slot_storage(0, 0).ctypes.data     # the old tensor stays on a


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_lazy_cache_tensors_are_copy_on_write(rng, dtype):
    """LazyLatentCache is immutable: an append copies the touched layer and shares the others,
    so a tensor taken before an append keeps the old data, and the untouched layers of the new
    cache are the very same memory."""
    c0 = lazy_cache(rng, dtype, n=2)
    t0 = tensor(c0.slot_buffer_full(0, 0))
    before = bits(t0).copy()
    c1 = c0.append(0, [rng.standard_normal((1,) + t) for t in LATENT_TRAILING])
    np.testing.assert_array_equal(bits(t0), before)
    assert tensor(c1.slot_buffer_full(0, 0)).data_ptr() != t0.data_ptr()
    assert (tensor(c1.slot_buffer_full(1, 0)).data_ptr()
            == tensor(c0.slot_buffer_full(1, 0)).data_ptr())
    assert tensor(c1.slot(0, 1)).data_ptr() == c1.slot_buffer_full(0, 1).ctypes.data


# ------------------------------------------------------------------------------ 5: tensors()
@pytest.mark.parametrize("backend", ["torch", "numpy"])
def test_tensors_of_o1_views_alias_every_array(rng, backend):
    c, _ = sealed_layer(rng)
    views = c.o1_views()
    out = tensors(views) if backend == "torch" else tensors(views, backend="numpy")
    assert type(out) is list and len(out) == len(views)
    kind = torch.Tensor if backend == "torch" else np.ndarray
    scalars = ("m_eff", "w", "sink_len", "d", "dv", "exact_only", "scale", "win_len",
               "win_head", "far_len")
    for dev, view in zip(out, views):
        assert isinstance(dev, kc.o1.O1DeviceView)
        for f in scalars:
            assert getattr(dev, f) == getattr(view, f), f
        for f in ("win_k", "win_v", "sink_k", "sink_v", "k_tilde"):
            a, t = getattr(view, f), getattr(dev, f)
            assert isinstance(t, kind), f
            (check_torch_alias if backend == "torch" else check_numpy_alias)(a, t, f)
        assert isinstance(dev.heads, tuple) and len(dev.heads) == len(view.heads)
        for hdev, hview in zip(dev.heads, view.heads):
            assert isinstance(hdev, kc.o1.O1HeadView) and hdev.rect_fm == hview.rect_fm
            for f in ("t_hat", "z_hat", "m_max", "q_tilde", "mu"):
                a, t = getattr(hview, f), getattr(hdev, f)
                assert isinstance(t, kind), f
                (check_torch_alias if backend == "torch" else check_numpy_alias)(a, t, f)
    # one view, one head view, a tuple of views: the same
    one = tensors(views[1])
    assert one.win_v.data_ptr() == views[1].win_v.ctypes.data
    head = tensors(views[0].heads[1])
    assert head.mu.data_ptr() == views[0].heads[1].mu.ctypes.data
    assert type(tensors(tuple(views))) is tuple


def test_tensors_refuses_what_is_not_a_view():
    with pytest.raises(TypeError):
        tensors(np.zeros(3))
    with pytest.raises(TypeError):
        as_tensor([1.0, 2.0])
    with pytest.raises(ValueError):
        as_tensor(np.zeros(3), backend="cupy")


# ------------------------------------------------------------------------------ 6: completeness
# Public names that hand out an ndarray (alone or in a tuple/list/mapping/dataclass), per
# class, and the test above that proves each one zero-copy.  NOT_VIEWS: names that return a
# freshly computed array, not storage.
HANDED_OUT = {
    kc.LayerKvCache: {"head_keys", "head_values", "k_heads", "v_heads", "q8_rows", "columns",
                      "importance", "linear_state", "linear_scratch", "o1_views", "head_rows",
                      "state"},
    kc.KvCache: set(),                       # hands out its LayerKvCache objects (kv[i], layers)
    O1Collecting: {"trace"},
    O1Sealed: set(SEALED_ARRAYS) | {"views"},
    # (slot_state, the deprecated name of state, raises its DeprecationWarning under the
    # suite's filter, so the scan does not count it; test_latent checks it still reads)
    kc.LatentKvCache: {"slot_storage", "valid_view", "rebind_slot", "layers", "state"},
    kc.StaticKvCache: {"slot_storage", "valid_view", "rebind_slot", "layers", "state"},
    kc.LazyLatentCache: {"slot", "slot_buffer_full"},
    kc.latent.LatentSlot: {"storage"},
    kc.rebind.DecodePlan: {"storage", "bound"},
}
NOT_VIEWS = {
    kc.LayerKvCache: {"unchanged_prefix"},   # a copy of the per-head lengths
}
# Arguments the scan passes, by parameter name: indices of heads, layers, slots, and the
# generation 0.  A method with another required parameter (data to append, a query, a path)
# is not called: those compute or mutate, they hand out no storage.
INDEX_ARGS = {"h": 0, "kv_head": 0, "layer": 0, "s": 0, "slot": 0, "which": 0, "i": 0,
              "since": 0}


def _holds_array(x, depth=0):
    if isinstance(x, np.ndarray):
        return True
    if depth > 4:
        return False
    if isinstance(x, kc.latent.LatentSlot):
        return _holds_array(x.storage, depth + 1)
    if isinstance(x, (list, tuple)):
        return any(_holds_array(y, depth + 1) for y in x)
    if isinstance(x, collections.abc.Mapping):
        return any(_holds_array(y, depth + 1) for y in x.values())
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return any(_holds_array(getattr(x, f.name), depth + 1) for f in dataclasses.fields(x))
    return False


def _call_args(fn):
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    args = []
    for p in sig.parameters.values():
        if p.default is not inspect.Parameter.empty or p.kind in (p.VAR_POSITIONAL,
                                                                  p.VAR_KEYWORD):
            continue
        if p.name not in INDEX_ARGS or p.kind is p.KEYWORD_ONLY:
            return None
        args.append(INDEX_ARGS[p.name])
    return args


def _handing_out(make):
    """Public names of the object ``make()`` builds that hand out an ndarray.  Each name is
    read on a fresh object (a call may mutate: clear(), commit_linear_scratch())."""
    found = set()
    for name in dir(make()):
        if name.startswith("_"):
            continue
        obj = make()
        try:
            value = getattr(obj, name)
        except Exception:
            continue
        if inspect.isclass(value):
            continue
        if callable(value) and not isinstance(value, np.ndarray):
            args = _call_args(value)
            if args is None:
                continue
            try:
                value = value(*args)
            except Exception:              # not applicable in this state (e.g. not sealed)
                continue
        if _holds_array(value):
            found.add(name)
    return found


def _instances():
    """Prepared objects per class: with data, in each state that hands out something else."""
    rng = np.random.default_rng(7)
    latent = lambda: latent_cache(rng, np.float32)                   # noqa: E731
    static = lambda: static_cache(rng, np.float32)                   # noqa: E731
    return {
        kc.LayerKvCache: [lambda: f32_layer(rng), lambda: q8_layer(rng, Q8_MODES[0]),
                          lambda: sealed_layer(rng)[0], lambda: collecting_layer(rng)],
        kc.KvCache: [lambda: _kvcache(rng)],
        O1Collecting: [lambda: collecting_layer(rng).o1],
        O1Sealed: [lambda: sealed_layer(rng)[0].o1],
        kc.LatentKvCache: [latent],
        kc.StaticKvCache: [static],
        kc.LazyLatentCache: [lambda: lazy_cache(rng, np.float32)],
        kc.latent.LatentSlot: [lambda: latent().layers[0][0]],
        kc.rebind.DecodePlan: [lambda: kc.rebind.DecodePlan.build(latent()),
                                    lambda: kc.rebind.DecodePlan.build(static())],
    }


def _kvcache(rng):
    kv = kc.KvCache(2, NKV, HD, mode=F32)
    for layer in kv.layers:
        layer.append(rows(rng, 3, NKV, HD), rows(rng, 3, NKV, HD))
    return kv


@pytest.mark.parametrize("cls", list(HANDED_OUT), ids=lambda c: c.__name__)
def test_every_array_handed_out_is_covered(cls):
    found = set()
    for make in _instances()[cls]:
        assert isinstance(make(), cls)
        found |= _handing_out(make)
    known = HANDED_OUT[cls] | NOT_VIEWS.get(cls, set())
    assert found <= known, (f"{cls.__name__} hands out arrays through {sorted(found - known)}: "
                            f"add them to the zero-copy tests and to HANDED_OUT")
    assert HANDED_OUT[cls] <= found, (f"{cls.__name__}: {sorted(HANDED_OUT[cls] - found)} no "
                                      f"longer hand out arrays; update HANDED_OUT")
