"""4-bit V rows (docs/kv4.md): the quantiser against its NumPy twin and its definition, the
modes that store them ("k8v4", "q4v"), the attention kernels over them against the twin and
across instruction-set bodies and thread counts, rollback, eviction, byte formats and bad
input."""

from __future__ import annotations

import pickle
import subprocess
import sys

import numpy as np
import pytest

import kvcache as kc
from kvcache import _core, quant
from kvcache import reference as R
from kvcache._stores import V4Rows

HEAD_DIMS = [64, 128, 72, 40, 256]
V4_MODES = ["k8v4", "q4v"]


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def _quantised(x):
    n, hd = x.shape
    c = np.zeros((n, hd // 2), np.uint8)
    p = np.zeros((n, 2 * -(-hd // 16)), np.uint16)
    _core.quantize_v4(np.ascontiguousarray(x, dtype=np.float32), c, p)
    return c, p


@pytest.fixture
def each_level():
    """The bodies this CPU runs (features as sets), the limit restored afterwards."""
    from kvcache import _dispatch as dispatch
    held = set().union(*_core.built_bodies().values())
    before = _core._isa_cap
    try:
        yield [b for b in dispatch.runnable(_core.cpu_features()) if b in held]
    finally:
        _core.set_isa(before)


# -- the quantiser ------------------------------------------------------------------------------
@pytest.mark.parametrize("hd", HEAD_DIMS + [8, 24])
def test_the_quantiser_matches_its_twin_bit_for_bit(hd):
    rng = np.random.default_rng(hd)
    for scale in (3e-7, 1e-4, 1.0, 300.0, 3e4, 1e5):     # float16 subnormals .. overflow
        x = (rng.standard_normal((200, hd)) * scale).astype(np.float32)
        x[0, :3] = np.nan
        x[1, 5] = np.inf
        x[2] = 1.25                                        # constant groups
        x[3, :8] = -0.0
        x[4] = np.float32(65504.0) * np.sign(x[4])         # at float16's largest
        c, p = _quantised(x)
        c2, p2 = np.zeros_like(c), np.zeros_like(p)
        R.quantize_v4(x, c2, p2)
        assert c.tobytes() == c2.tobytes() and p.tobytes() == p2.tobytes(), scale


@pytest.mark.parametrize("hd", [64, 72, 40])
def test_the_quantiser_is_its_documented_definition(hd):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((50, hd)).astype(np.float32) * np.float32(2.5)
    c, p = _quantised(x)
    vals = R.dequantize_v4(c, p, hd)
    par = p.view(np.float16).astype(np.float32)
    for g, d0 in enumerate(range(0, hd, 16)):
        xg = x[:, d0:d0 + 16]
        s, m = par[:, 2 * g], par[:, 2 * g + 1]
        assert (s == np.float16((xg.max(1) - xg.min(1)) / np.float32(15))).all()
        assert (m == np.float16(xg.min(1))).all()
        # every value within half a step (plus the float16 rounding of the minimum)
        err = np.abs(vals[:, d0:d0 + 16] - xg)
        assert (err <= (s / 2 + np.abs(m - xg.min(1)) + 1e-6)[:, None] * 1.0001).all()
    # the nibble layout: byte c0/2 + i holds channels c0 + i (low) and c0 + n/2 + i (high)
    one = np.zeros((1, hd), np.float32)
    one[0, 0] = 1.0                                      # group 0: min 0, step 1/15
    c1, _ = _quantised(one)
    assert c1[0, 0] == 15 and not c1[0, 1:].any()
    one[0, 0], one[0, 16] = 0.0, 1.0                     # channel 16: the high nibble of byte 0
    c1, _ = _quantised(one)
    assert c1[0, 0] == 15 << 4 and not c1[0, 1:].any()


def test_a_non_finite_or_out_of_range_group_is_stored_as_nan():
    x = np.zeros((3, 32), np.float32)
    x[0, 3] = np.nan
    x[1, 20] = np.inf
    x[2, 0], x[2, 1] = -70000.0, 1.0                    # its minimum overflows float16
    c, p = _quantised(x)
    par = p.view(np.float16)
    assert np.isnan(par[0, :2]).all() and not np.isnan(par[0, 2:]).any()
    assert np.isnan(par[1, 2:]).all() and not np.isnan(par[1, :2]).any()
    assert np.isnan(par[2, :2]).all()
    assert not c[0].any() and not c[1].any()
    vals = R.dequantize_v4(c, p, 32)
    assert np.isnan(vals[0, :16]).all() and (vals[0, 16:] == 0).all()


def test_quantize_v4_refuses_bad_shapes():
    with pytest.raises(ValueError, match="hd % 8 == 0"):
        _core.quantize_v4(np.zeros((2, 12), np.float32), np.zeros((2, 6), np.uint8),
                          np.zeros((2, 2), np.uint16))
    with pytest.raises(ValueError, match="codes"):
        _core.quantize_v4(np.zeros((2, 16), np.float32), np.zeros((2, 9), np.uint8),
                          np.zeros((2, 2), np.uint16))


# -- modes --------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, kb, vb, scheme", [
    ("k8v4", 8, 4, "rows"), ("k8v4:cmf", 8, 4, "cmf"), ("q4v", 32, 4, ""),
    ("K8V4", 8, 4, "rows"), ("k32v4", 32, 4, ""), ("k8v8", 8, 8, "rows"), ("k32v32", 32, 32, "")])
def test_mode_names(name, kb, vb, scheme):
    mode = kc.KvMode.parse(name)
    assert (mode.k_bits, mode.v_bits, mode.scheme) == (kb, vb, scheme)
    assert mode.v4 == (vb == 4) and mode.quant_v == (vb == 8) and mode.quant_k == (kb == 8)
    assert kc.KvMode.parse(mode.name) == mode
    assert pickle.loads(pickle.dumps(mode)) == mode and hash(mode) == hash(kc.KvMode.parse(name))
    assert eval(repr(mode), {"KvMode": kc.KvMode}) == mode
    assert mode == kc.KvMode.of(kb, vb, scheme or "rows")


def test_new_modes_keep_the_old_modes_equal_and_hashed_as_before():
    assert kc.KvMode.of(8, 8) == kc.KvMode.Q8() and kc.KvMode.of() == kc.KvMode.F32
    assert hash(kc.KvMode.of(8, 32)) == hash(kc.KvMode.Q8(True, False))
    assert kc.KvMode.parse("k8v4") != kc.KvMode.Q8() and kc.KvMode.parse("q4v") != kc.KvMode.F32
    assert not kc.KvMode.parse("q4v").is_f32


@pytest.mark.parametrize("bad, exc, match", [
    ((4, 4), ValueError, "k_bits: expected one of \\(32, 8\\), got 4"),
    ((8, 2), ValueError, "v_bits: expected one of \\(32, 8, 4\\), got 2"),
    ((8.0, 4), TypeError, "k_bits"), ((True, 4), TypeError, "k_bits")])
def test_kvmode_of_refuses_other_precisions(bad, exc, match):
    with pytest.raises(exc, match=match):
        kc.KvMode.of(*bad)


@pytest.mark.parametrize("bad", ["q4", "k4v4", "k8v2", "k8v4:x", "v4"])
def test_unknown_4bit_names_are_refused_listing_the_names(bad):
    with pytest.raises(ValueError, match="'k8v4', 'k8v4:cmf', 'q4v'"):
        kc.KvMode.parse(bad)


@pytest.mark.parametrize("mode", V4_MODES)
@pytest.mark.parametrize("hd", [36, 12, 100, 1])
def test_an_unsupported_head_dim_is_one_line_naming_it(mode, hd):
    with pytest.raises(ValueError) as info:
        kc.LayerKvCache(2, hd, mode=mode)
    msg = str(info.value)
    assert "\n" not in msg and f"head_dim={hd}" in msg and "4-bit" in msg


# -- the layer ----------------------------------------------------------------------------------
def _pair(rng, mode, hd, n, nkv=2):
    layer = kc.LayerKvCache(nkv, hd, mode=mode)
    k = rng.standard_normal((n, nkv, hd)).astype(np.float32)
    v = rng.standard_normal((n, nkv, hd)).astype(np.float32)
    layer.append(k, v)
    return layer, k, v


@pytest.mark.parametrize("mode", V4_MODES)
def test_a_layer_stores_v_as_4bit_rows(mode):
    rng = np.random.default_rng(3)
    layer, k, v = _pair(rng, mode, 72, 30)
    assert isinstance(layer._v, V4Rows)
    st = layer._export_state()
    assert st.vf is None and st.vq is None and st.vc.shape[2] == 36 and st.vp.shape[2] == 10
    for h in range(2):
        c, p = _quantised(v[:, h])
        assert st.vc[h, :30].tobytes() == c.tobytes() and st.vp[h, :30].tobytes() == p.tobytes()
    kbytes = quant.k_row_bytes(72, mode == "k8v4", scheme="rows")
    assert layer.memory_bytes() == 2 * 30 * (kbytes + quant.v4_row_bytes(72))
    assert quant.v4_row_bytes(128) == 96                  # 64 B of codes, 8 x (f16, f16)
    assert layer.head_values(0).shape == (0, 72)          # not stored as float32


@pytest.mark.parametrize("mode", V4_MODES)
@pytest.mark.parametrize("hd", HEAD_DIMS)
def test_decode_and_prompt_attention_match_the_twin(mode, hd):
    rng = np.random.default_rng(hd)
    layer, _, _ = _pair(rng, mode, hd, 300, nkv=2)
    for q in (rng.standard_normal((6, hd)).astype(np.float32),           # decode, 3 per group
              rng.standard_normal((40, 6, hd)).astype(np.float32)):      # a prompt block
        for kw in ({}, {"window": 37}, {"softcap": 2.0}, {"window": 5, "softcap": 1.5}):
            got = layer.attend_all_heads(q, **kw)
            want = R.attend_all_heads(layer, q, **kw)
            assert np.allclose(got, want, rtol=2e-4, atol=2e-5), kw


@pytest.mark.parametrize("mode", V4_MODES)
def test_4bit_values_are_what_attention_reads(mode):
    """Against float32 attention over the dequantised values (the same keys): 4-bit V is
    exactly its images, nothing else."""
    rng = np.random.default_rng(11)
    hd = 64
    layer, k, v = _pair(rng, mode, hd, 120, nkv=1)
    st = layer._export_state()
    images = R.dequantize_v4(st.vc[0, :120], st.vp[0, :120], hd)
    twin = kc.LayerKvCache(1, hd, mode="q8k" if mode == "k8v4" else "f32")
    twin.append(k, images[:, None, :])
    q = rng.standard_normal((4, hd)).astype(np.float32)
    assert np.allclose(layer.attend_all_heads(q), twin.attend_all_heads(q), rtol=1e-5,
                       atol=1e-6)
    out, probs = layer.attend(q[0], 0)
    assert np.allclose(out, probs @ images, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", V4_MODES)
@pytest.mark.parametrize("hd", [40, 64, 72, 128])
def test_bits_do_not_depend_on_body_or_threads(mode, hd, each_level):
    from threadpoolctl import threadpool_limits
    rng = np.random.default_rng(hd)
    layer, _, _ = _pair(rng, mode, hd, 700, nkv=2)
    q1 = rng.standard_normal((8, hd)).astype(np.float32)
    qn = rng.standard_normal((37, 8, hd)).astype(np.float32)
    results = []
    for level in each_level:
        _core.set_isa(level)
        for threads in (1, 2, 3):
            with threadpool_limits(threads, user_api="openmp"):
                results.append((level, threads, layer.attend_all_heads(q1),
                                layer.attend_all_heads(qn)))
    for level, threads, dec, pre in results[1:]:
        assert np.array_equal(_bits(dec), _bits(results[0][2])), (level, threads)
        assert np.array_equal(_bits(pre), _bits(results[0][3])), (level, threads)


@pytest.mark.parametrize("mode", V4_MODES)
def test_gqa_groups_dead_heads_and_attend_group(mode):
    rng = np.random.default_rng(5)
    hd, nkv = 64, 3
    layer = kc.LayerKvCache(nkv, hd, mode=mode)
    k = rng.standard_normal((50, nkv, hd)).astype(np.float32)
    v = rng.standard_normal((50, nkv, hd)).astype(np.float32)
    layer.append(k[:20], v[:20])
    layer.append(k[20:], v[20:], alive=[1, 0, 1])          # head 1 stops at 20 rows
    q = rng.standard_normal((12, hd)).astype(np.float32)   # 4 query heads per group
    got = layer.attend_all_heads(q)
    assert np.allclose(got, R.attend_all_heads(layer, q), rtol=2e-4, atol=2e-5)
    out = np.zeros((4, hd), np.float32)
    imp = np.zeros(50, np.float32)
    layer.attend_group(q[4:8], 1, out, imp, 1.0 / np.sqrt(hd), 0, 0.0)
    assert np.array_equal(_bits(out), _bits(got[4:8]))
    assert layer.head_len(1) == 20 and abs(float(imp[:20].sum()) - 4.0) < 1e-4


@pytest.mark.parametrize("mode", V4_MODES)
@pytest.mark.parametrize("n_back", [1, 5, 16, 17, 40])
def test_rollback_and_replay_give_identical_bits(mode, n_back):
    rng = np.random.default_rng(n_back)
    hd = 72
    layer, k, v = _pair(rng, mode, hd, 60)
    before = layer._export_state().owned_copy()
    q = rng.standard_normal((4, hd)).astype(np.float32)
    out_before = layer.attend_all_heads(q)
    layer.truncate_last(n_back)
    assert len(layer) == 60 - n_back
    layer.append(k[60 - n_back:], v[60 - n_back:])
    after = layer._export_state()
    for name in ("kf", "kq", "ks", "vc", "vp"):
        a, b = getattr(before, name), getattr(after, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a[:, :60].tobytes() == b[:, :60].tobytes(), name
    assert np.array_equal(_bits(layer.attend_all_heads(q)), _bits(out_before))


@pytest.mark.parametrize("mode", V4_MODES)
def test_eviction_moves_rows_without_changing_their_bytes(mode):
    rng = np.random.default_rng(9)
    layer, k, v = _pair(rng, mode, 64, 40)
    st = layer._export_state().owned_copy()
    layer.evict(25)
    now = layer._export_state()
    assert now.vc[:, :25].tobytes() == st.vc[:, 15:40].tobytes()
    assert now.vp[:, :25].tobytes() == st.vp[:, 15:40].tobytes()
    layer.attend_all_heads(rng.standard_normal((2, 64)).astype(np.float32))
    layer.evict(10, kc.EvictionPolicy("born", 4))
    assert len(layer) == 10 and layer._export_state().vc.shape[2] == 32


# -- bytes --------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", V4_MODES + ["k8v4:cmf"])
def test_byte_format_round_trip_and_version(mode, tmp_path):
    rng = np.random.default_rng(2)
    layer, _, _ = _pair(rng, mode, 40, 33)
    layer.truncate_last(2)
    buf = layer.to_bytes(fingerprint="m")
    assert int.from_bytes(buf[8:10], "little") == 3
    other = kc.LayerKvCache(2, 40, mode=mode)
    other.from_bytes(buf, fingerprint="m")
    a, b = layer._export_state(), other._export_state()
    assert b.mode == a.mode and b.lengths.tolist() == [31, 31]
    for name in ("vc", "vp", "kq", "ks", "kf"):
        x, y = getattr(a, name), getattr(b, name)
        if x is not None:
            assert x[:, :31].tobytes() == y[:, :31].tobytes(), name
    q = rng.standard_normal((2, 40)).astype(np.float32)
    assert np.array_equal(_bits(layer.attend_all_heads(q)), _bits(other.attend_all_heads(q)))
    kv = kc.KvCache(2, 2, 40, mode=mode)
    kv.layers[1] = layer
    kv.save(tmp_path / "m.kvc")
    back = kc.KvCache.load(tmp_path / "m.kvc")
    assert back.mode == kv.mode and back.layers[1]._export_state().vc.shape[1] >= 31
    with pytest.raises(kc.WireError, match="4-bit values"):
        layer.export_wire()


def test_a_4bit_body_with_a_bad_head_dim_or_version_2_is_refused():
    import struct
    import xxhash
    from kvcache import wire
    layer, _, _ = _pair(np.random.default_rng(0), "q4v", 8, 3, nkv=1)
    buf = bytearray(layer.to_bytes())
    body = 32                                            # header 28, no fingerprint, pad8
    assert buf[body + 9] == 2                            # the quant_v byte: 4-bit

    def resealed(b):
        b = bytes(b[:-8])
        return b + struct.pack("<Q", xxhash.xxh3_64_intdigest(b))

    v2 = bytearray(buf)
    v2[8:10] = struct.pack("<H", 2)
    target = kc.LayerKvCache(1, 8, mode="q4v")
    with pytest.raises(wire.WireError, match="quant_v=2"):
        target.from_bytes(resealed(v2))
    bad = bytearray(buf)
    bad[body + 4: body + 8] = struct.pack("<I", 12)      # head_dim 12
    with pytest.raises(wire.WireError):
        kc.LayerKvCache(1, 12, mode="f32").from_bytes(resealed(bad))
    assert len(target) == 0


def test_a_subprocess_with_kvcache_kv_k8v4_builds_4bit_layers():
    code = ("import kvcache as kc; c = kc.LayerKvCache(1, 16); print(c.mode.name, "
            "type(c._v).__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**__import__("os").environ, "KVCACHE_KV": "k8v4"}, check=True)
    assert out.stdout.split() == ["k8v4", "V4Rows"]
