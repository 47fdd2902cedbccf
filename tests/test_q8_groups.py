"""The K scale group of each int8 scheme: 16 channels for "rows" (the default), 32 for "cmf".

- quant's sizes take the scheme as a required argument and give the documented numbers;
- what a layer stores: the width of its K scale store, each scale against the absmax of its
  group (a partial last group when head_dim is not a multiple of the group), and bit for bit
  against reference.q8_storage, for head dims 64, 128, 72, 40, 16 and 8;
- memory_bytes per scheme;
- the versioned format and the prefix-store entries per scheme (sizes follow the scheme
  byte), states of the wrong width refused;
- rollback and replay in "rows" stay bit-exact with 16-channel groups.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import kvcache as kc
from kvcache import quant, wire
from kvcache import reference as ref
from kvcache.store import PrefixStore
from kvcache.store import entry as ent
from kvcache.store.keys import Geometry
from kvcache.store.memory import MemoryBackend

Q8 = kc.KvMode.Q8
GROUP = {"rows": 16, "cmf": 32}           # docs/numerics.md, "int8 storage"
HEAD_DIMS = [64, 128, 72, 40, 16, 8]
K_MODES = [Q8(), Q8(True, False), Q8(scheme="cmf"), Q8(True, False, scheme="cmf")]
K_IDS = ["q8", "q8k", "q8:cmf", "q8k:cmf"]


def data(rng, n, nkv, hd):
    """Rows with uneven channels and a few outliers (groups then get different scales)."""
    scale = np.linspace(0.1, 4.0, hd, dtype=np.float32)
    k = (rng.standard_normal((n, nkv, hd)) * scale).astype(np.float32)
    v = rng.standard_normal((n, nkv, hd)).astype(np.float32)
    k[::13, :, hd // 3] *= 30.0
    return k, v


# ------------------------------------------------------------------------------ quant sizes
def test_the_k_group_is_a_property_of_the_scheme():
    assert quant.k_group("rows") == 16 and quant.k_group("cmf") == 32
    assert quant.k_group(kc.KvMode.Q8().scheme) == 16
    for bad in ("", "q8", "ROWS", None):
        with pytest.raises(ValueError, match="scheme"):
            quant.k_group(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("hd", HEAD_DIMS + [33, 1, 17])
def test_k_sizes_per_scheme(hd):
    for scheme, g in GROUP.items():
        assert quant.k_scale_count(hd, scheme) == math.ceil(hd / g)
        assert quant.k_row_bytes(hd, scheme=scheme) == hd + 4 * math.ceil(hd / g)
        assert quant.k_row_bytes(hd, False, scheme=scheme) == 4 * hd
        assert quant.q8_row_bytes(hd, scheme) == hd + 4 * math.ceil(hd / g) + hd + 4
    assert quant.k_row_bytes(hd, False, scheme="") == 4 * hd      # float32 K: no scheme


def test_k_row_bytes_of_head_dim_128():
    assert quant.k_row_bytes(128, scheme="rows") == 128 + 8 * 4 == 160
    assert quant.k_row_bytes(128, scheme="cmf") == 128 + 4 * 4 == 144


def test_no_k_size_has_a_default_scheme():
    with pytest.raises(TypeError):
        quant.k_scale_count(64)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        quant.k_row_bytes(64)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        quant.k_row_bytes(64, True, "rows")  # type: ignore[misc]   scheme is keyword-only
    with pytest.raises(TypeError):
        quant.q8_row_bytes(64)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="scheme"):
        quant.k_row_bytes(64, True, scheme="")


# ------------------------------------------------------------------------------ layer storage
@pytest.mark.parametrize("mode", K_MODES, ids=K_IDS)
@pytest.mark.parametrize("hd", HEAD_DIMS)
def test_k_rows_are_scaled_per_group_of_the_scheme(rng, mode, hd):
    """Before any column freeze (fewer than 64 positions), every K scale is the absmax of its
    group of the row over 127, the last group partial, and the codes round within half a
    step: computed here from the data, not from the reference."""
    nkv, n = 2, 40
    k, v = data(rng, n, nkv, hd)
    layer = kc.LayerKvCache(nkv, hd, mode=mode)
    layer.append(k, v)
    g = GROUP[mode.scheme]
    ng = math.ceil(hd / g)
    for h in range(nkv):
        kq, ks, _, _ = layer.q8_rows(h)
        assert ks.shape == (n, ng) and ks.dtype == np.float32
        for gi in range(ng):
            part = k[:, h, gi * g:(gi + 1) * g]
            want = np.maximum(np.abs(part).max(axis=1) / np.float32(127), np.float32(1e-12))
            assert ks[:, gi].tobytes() == want.astype(np.float32).tobytes()
            err = np.abs(kq[:, gi * g:(gi + 1) * g] * ks[:, gi:gi + 1].astype(np.float64)
                         - part.astype(np.float64))
            assert (err <= 0.5 * ks[:, gi:gi + 1].astype(np.float64) * (1 + 1e-6)).all()
            assert np.abs(kq[:, gi * g:(gi + 1) * g]).max(axis=1).tolist() == [127] * n


@pytest.mark.parametrize("mode", K_MODES, ids=K_IDS)
@pytest.mark.parametrize("hd", HEAD_DIMS)
def test_storage_is_bit_exact_against_the_reference(rng, mode, hd):
    nkv, n = 2, 100                                  # past 64: cmf freezes, rows does not
    k, v = data(rng, n, nkv, hd)
    layer = kc.LayerKvCache(nkv, hd, mode=mode)
    for lo, hi in ((0, 1), (1, 30), (30, 64), (64, 65), (65, 100)):
        layer.append(k[lo:hi], v[lo:hi])
    want = ref.q8_storage(k, v, None, mode.quant_k, mode.quant_v, mode.scheme)
    for h in range(nkv):
        kq, ks, vq, vs = layer.q8_rows(h)
        assert want["ks"][h].shape == (n, math.ceil(hd / GROUP[mode.scheme]))
        assert kq.tobytes() == want["kq"][h].tobytes() and ks.tobytes() == want["ks"][h].tobytes()
        if mode.quant_v:
            assert vq.tobytes() == want["vq"][h].tobytes()
            assert vs.tobytes() == want["vs"][h].tobytes()


@pytest.mark.parametrize("mode, k_bytes", [(Q8(), 160), (Q8(scheme="cmf"), 144),
                                           (Q8(True, False), 160), (Q8(False, True), 512)],
                         ids=["q8", "q8:cmf", "q8k", "q8v"])
def test_memory_bytes_per_scheme(rng, mode, k_bytes):
    nkv, hd, n = 2, 128, 10
    k, v = data(rng, n, nkv, hd)
    layer = kc.LayerKvCache(nkv, hd, mode=mode)
    layer.append(k, v)
    v_bytes = 128 + 4 if mode.quant_v else 4 * 128
    assert layer.memory_bytes() == nkv * n * (k_bytes + v_bytes)


# ------------------------------------------------------------------------------ formats
def stored(layer):
    out = []
    for h in range(layer.num_kv_heads):
        out += [None if a is None else a.tobytes() for a in layer.q8_rows(h)]
        out += [None if a is None else a.tobytes() for a in layer.columns(h)]
    return out


@pytest.mark.parametrize("mode", K_MODES, ids=K_IDS)
@pytest.mark.parametrize("hd", [72, 40, 8])
def test_the_versioned_format_round_trips_each_scheme(rng, mode, hd):
    nkv, n = 2, 70
    k, v = data(rng, n, nkv, hd)
    layer = kc.LayerKvCache(nkv, hd, mode=mode)
    layer.append(k, v)
    buf = layer.to_bytes()
    back = kc.LayerKvCache(nkv, hd, mode=mode)
    back.install_bytes(buf)
    assert back.mode == mode and stored(back) == stored(layer)
    assert back.q8_rows(0)[1].shape == (n, math.ceil(hd / GROUP[mode.scheme]))
    assert back.memory_bytes() == layer.memory_bytes()
    kv = kc.KvCache(1, nkv, hd, mode=mode)
    kv.layers[0] = layer
    loaded = wire.model_from_bytes(kc.KvCache, wire._finish(wire.model_plan(kv), 2, None))
    assert stored(loaded.layers[0]) == stored(layer)


def test_the_buffers_differ_by_the_extra_scales_only(rng):
    """Same rows in both schemes: the rows buffer is longer by the extra K scales, padded."""
    nkv, hd, n = 2, 72, 20                           # 5 scales per row against 3
    k, v = data(rng, n, nkv, hd)
    sizes = {}
    for scheme in GROUP:
        layer = kc.LayerKvCache(nkv, hd, mode=Q8(scheme=scheme))
        layer.append(k, v)
        sizes[scheme] = len(layer.to_bytes())
    pad8 = lambda x: x + (-x % 8)                    # noqa: E731
    extra = nkv * (pad8(4 * n * 5) - pad8(4 * n * 3))
    assert sizes["rows"] - sizes["cmf"] == extra


def test_a_state_with_the_other_schemes_scale_width_is_refused(rng):
    nkv, hd = 2, 64
    k, v = data(rng, 10, nkv, hd)
    cmf = kc.LayerKvCache(nkv, hd, mode=Q8(scheme="cmf"))
    cmf.append(k, v)
    st = cmf.state()
    from dataclasses import replace
    forged = replace(st, mode=Q8(), owned=False)     # cmf widths (4 scales) under "rows"
    rows = kc.LayerKvCache(nkv, hd, mode=Q8())
    before = stored(rows)
    with pytest.raises(ValueError, match="ks"):
        rows.install(forged)
    assert stored(rows) == before and rows.seq_len == 0


# ------------------------------------------------------------------------------ prefix store
@pytest.mark.parametrize("hd", [72, 64])
def test_entry_sizes_follow_the_scheme(hd):
    g, b, nl = 2, 16, 3
    size = {s: ent.entry_size(Geometry(nl, g, hd, Q8(scheme=s), b)) for s in GROUP}
    pad8 = lambda x: x + (-x % 8)                    # noqa: E731
    per_layer = pad8(4 * g * b * math.ceil(hd / 16)) - pad8(4 * g * b * math.ceil(hd / 32))
    assert size["rows"] - size["cmf"] == nl * per_layer > 0


@pytest.mark.parametrize("mode, b", [("q8", 16), ("q8k", 16), ("q8:cmf", 80)])
def test_the_prefix_store_round_trips_each_scheme(rng, mode, b):
    nl, nkv, hd = 2, 2, 40                           # cmf needs blocks past its freeze at 64
    ids = np.arange(4 * b)
    k, v = data(rng, 4 * b, nkv, hd)
    store = PrefixStore(MemoryBackend(), fingerprint="m", block=b)
    kv = kc.KvCache(nl, nkv, hd, mode=mode)
    for layer in kv.layers:
        layer.append(k, v)
    assert store.put(ids, kv) == 4
    fresh = kc.KvCache(nl, nkv, hd, mode=mode)
    assert store.load(ids, fresh) == 4 * b
    assert [stored(a) for a in fresh.layers] == [stored(a) for a in kv.layers]


# ------------------------------------------------------------------------------ rollback
@pytest.mark.parametrize("hd", [72, 40])
@pytest.mark.parametrize("n", [1, 5, 30])
def test_rows_rollback_and_replay_are_bit_exact(rng, hd, n):
    nkv = 2
    k, v = data(rng, 120, nkv, hd)
    for at in (10, 63, 64, 65, 90):
        layer = kc.LayerKvCache(nkv, hd, mode=Q8())
        layer.append(k[:at], v[:at])
        for i in range(at, at + n):
            layer.append(k[i:i + 1], v[i:i + 1])
        once = stored(layer)
        layer.truncate_last(n)
        for i in range(at, at + n):
            layer.append(k[i:i + 1], v[i:i + 1])
        assert stored(layer) == once
        straight = kc.LayerKvCache(nkv, hd, mode=Q8())
        straight.append(k[:at + n], v[:at + n])
        assert stored(straight) == once
