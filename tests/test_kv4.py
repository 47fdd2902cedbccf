"""4-bit K and V (docs/kv4.md): the quantisers and the 4-bit K scorer against their NumPy twins
and their definitions, the modes that store them ("q4", "k8v4", "q4v", "q4k", "k4v8"), the
attention kernels over them against the twin and across instruction-set bodies and thread
counts, block boundaries, rollback and replay, eviction, byte formats and bad input."""

from __future__ import annotations

import itertools
import pickle
import subprocess
import sys

import numpy as np
import pytest

import kvcache as kc
from kvcache import _core, quant
from kvcache import reference as R
from kvcache._entry import K4_BLOCK as B, K4_RING as RING
from kvcache._stores import V4Rows

HEAD_DIMS = [64, 128, 72, 40, 256]
V4_MODES = ["k8v4", "q4v"]
K4_MODES = ["q4", "q4k", "k4v8"]
MODES4 = ["q4", "k8v4", "q4v", "q4k", "k4v8"]


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
    ("q4", 4, 4, ""), ("k4v4", 4, 4, ""), ("q4k", 4, 32, ""), ("k4v8", 4, 8, "rows"),
    ("k4v8:cmf", 4, 8, "cmf"),
    ("k8v4", 8, 4, "rows"), ("k8v4:cmf", 8, 4, "cmf"), ("q4v", 32, 4, ""),
    ("K8V4", 8, 4, "rows"), ("k32v4", 32, 4, ""), ("k8v8", 8, 8, "rows"), ("k32v32", 32, 32, "")])
def test_mode_names(name, kb, vb, scheme):
    mode = kc.KvMode.parse(name)
    assert (mode.k_bits, mode.v_bits, mode.scheme) == (kb, vb, scheme)
    assert mode.v4 == (vb == 4) and mode.quant_v == (vb == 8) and mode.quant_k == (kb == 8)
    assert mode.k4 == (kb == 4)
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
    ((2, 4), ValueError, "k_bits: expected one of \\(32, 8, 4\\), got 2"),
    ((8, 2), ValueError, "v_bits: expected one of \\(32, 8, 4\\), got 2"),
    ((8.0, 4), TypeError, "k_bits"), ((True, 4), TypeError, "k_bits")])
def test_kvmode_of_refuses_other_precisions(bad, exc, match):
    with pytest.raises(exc, match=match):
        kc.KvMode.of(*bad)


@pytest.mark.parametrize("bad", ["q2", "k4v2", "k8v2", "k8v4:x", "v4", "q4:x"])
def test_unknown_4bit_names_are_refused_listing_the_names(bad):
    with pytest.raises(ValueError, match="'q4', 'k8v4', 'k8v4:cmf', 'q4v', 'q4k'"):
        kc.KvMode.parse(bad)


@pytest.mark.parametrize("mode", MODES4)
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
    st = layer.state()
    assert st.vf is None and st.vq is None and st.vc.shape[2] == 36 and st.vp.shape[2] == 10
    for h in range(2):
        c, p = _quantised(v[:, h])
        assert st.vc[h, :30].tobytes() == c.tobytes() and st.vp[h, :30].tobytes() == p.tobytes()
    kbytes = quant.k_row_bytes(72, mode == "k8v4", scheme="rows")
    assert layer.memory_bytes() == 2 * 30 * (kbytes + quant.v4_row_bytes(72))
    assert quant.v4_row_bytes(128) == 96                  # 64 B of codes, 8 x (f16, f16)
    assert layer.head_values(0).shape == (0, 72)          # not stored as float32


@pytest.mark.parametrize("mode", MODES4)
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
    st = layer.state()
    images = R.dequantize_v4(st.vc[0, :120], st.vp[0, :120], hd)
    twin = kc.LayerKvCache(1, hd, mode="q8k" if mode == "k8v4" else "f32")
    twin.append(k, images[:, None, :])
    q = rng.standard_normal((4, hd)).astype(np.float32)
    assert np.allclose(layer.attend_all_heads(q), twin.attend_all_heads(q), rtol=1e-5,
                       atol=1e-6)
    out, probs = layer.attend(q[0], 0)
    assert np.allclose(out, probs @ images, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", MODES4)
@pytest.mark.parametrize("hd", [24, 40, 56, 64, 72, 128, 256])  # 24, 56: a last chunk of 24
def test_bits_do_not_depend_on_body_or_threads(mode, hd, each_level):
    from threadpoolctl import threadpool_limits
    rng = np.random.default_rng(hd)
    layer, _, _ = _pair(rng, mode, hd, 700, nkv=2)
    q1 = rng.standard_normal((8, hd)).astype(np.float32)
    q7 = rng.standard_normal((14, hd)).astype(np.float32)   # 7 per group: more than one quad
    qn = rng.standard_normal((37, 8, hd)).astype(np.float32)
    results = []
    for level in each_level:
        _core.set_isa(level)
        for threads in (1, 2, 3):
            with threadpool_limits(threads, user_api="openmp"):
                results.append((level, threads, layer.attend_all_heads(q1),
                                layer.attend_all_heads(qn), layer.attend_all_heads(q7),
                                layer.attend_all_heads(q7, window=300, softcap=1.5),
                                layer.attend_all_heads(qn, window=90, softcap=2.0)))
    for level, threads, *outs in results[1:]:
        for k, (got, want) in enumerate(zip(outs, results[0][2:], strict=True)):
            assert np.array_equal(_bits(got), _bits(want)), (level, threads, k)
    # a query's output does not depend on the other queries of its group (one quad or two)
    four = layer.attend_all_heads(q7[[0, 1, 2, 3, 7, 8, 9, 10]])          # 4 per group
    assert np.array_equal(_bits(results[0][4][:4]), _bits(four[:4]))


@pytest.mark.parametrize("mode", ["q8", "q4", "k8v4", "q4v"])
@pytest.mark.parametrize("per_group", [3, 4, 7, 8])
def test_the_value_pass_skips_tiny_weights_query_by_query(mode, per_group, each_level):
    """Peaked queries: a row's weight is below 1e-12 for some queries of a quad and not for
    others, so the value pass skips it for those queries only; with 8 per group the first
    quad is all peaked, so some rows are skipped by the whole quad.  The result is the
    twin's and the same on every body."""
    rng = np.random.default_rng(per_group)
    hd, nkv = 64, 2
    layer, _, _ = _pair(rng, mode, hd, 500, nkv=nkv)
    q = rng.standard_normal((nkv * per_group, hd)).astype(np.float32)
    idx = np.arange(len(q))
    peaked = idx % per_group < 4 if per_group == 8 else idx % 2 == 0
    q[peaked] *= 12.0                  # peaked queries: many of their weights skipped
    if per_group == 8:                 # a row that no query of the first quad weighs
        probs4 = np.stack([layer.attend(q[j], 0)[1] for j in range(4)])
        assert (probs4 < 1e-12).all(axis=0).any()
    results = []
    for level in each_level:
        _core.set_isa(level)
        results.append(layer.attend_all_heads(q))
        want = R.attend_all_heads(layer, q)
        assert np.allclose(results[-1], want, rtol=2e-4, atol=2e-5), level
    for got in results[1:]:
        assert np.array_equal(_bits(got), _bits(results[0]))
    # each query's output is its own: the same bits as the query attending alone
    for j in range(len(q)):
        alone = layer.attend(q[j], j // per_group)[0]
        assert np.array_equal(_bits(alone), _bits(results[-1][j])), j
    # the skips are real: a peaked query gives weight < 1e-12 to many rows, a plain one to none
    out, probs = layer.attend(q[0], 0)
    plain = int(np.flatnonzero(~peaked)[0])
    assert (probs < 1e-12).mean() > 0.3 and (layer.attend(q[plain], 0)[1] >= 1e-12).all()
    assert layer.head_len(0) == 500


@pytest.mark.parametrize("mode", MODES4)
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


@pytest.mark.parametrize("mode", MODES4)
@pytest.mark.parametrize("n_back", [1, 5, 32, 33, 36])
def test_rollback_and_replay_give_identical_bits(mode, n_back):
    rng = np.random.default_rng(n_back)
    hd, n = 72, 100
    layer, k, v = _pair(rng, mode, hd, n)
    before = layer.state().owned_copy()
    q = rng.standard_normal((4, hd)).astype(np.float32)
    out_before = layer.attend_all_heads(q)
    layer.truncate_last(n_back)
    assert len(layer) == n - n_back
    layer.append(k[n - n_back:], v[n - n_back:])
    after = layer.state()
    for name, rows in (("kf", n), ("kq", n), ("ks", n), ("vc", n), ("vp", n), ("kc", n // B * B),
                       ("kp", n // B), ("kr", RING)):
        a, b = getattr(before, name), getattr(after, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a[:, :rows].tobytes() == b[:, :rows].tobytes(), name
    assert np.array_equal(_bits(layer.attend_all_heads(q)), _bits(out_before))


@pytest.mark.parametrize("mode", V4_MODES)
def test_eviction_moves_rows_without_changing_their_bytes(mode):
    rng = np.random.default_rng(9)
    layer, k, v = _pair(rng, mode, 64, 40)
    st = layer.state().owned_copy()
    layer.evict(25)
    now = layer.state()
    assert now.vc[:, :25].tobytes() == st.vc[:, 15:40].tobytes()
    assert now.vp[:, :25].tobytes() == st.vp[:, 15:40].tobytes()
    layer.attend_all_heads(rng.standard_normal((2, 64)).astype(np.float32))
    layer.evict(10, kc.EvictionPolicy("born", 4))
    assert len(layer) == 10 and layer.state().vc.shape[2] == 32


# -- bytes --------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES4 + ["k8v4:cmf", "k4v8:cmf"])
def test_byte_format_round_trip_and_version(mode, tmp_path):
    rng = np.random.default_rng(2)
    layer, _, _ = _pair(rng, mode, 40, 2 * B + 6)
    layer.truncate_last(2)
    buf = layer.to_bytes(fingerprint="m")
    assert int.from_bytes(buf[8:10], "little") == 3
    other = kc.LayerKvCache(2, 40, mode=mode)
    other.install_bytes(buf, fingerprint="m")
    a, b = layer.state(), other.state()
    n = 2 * B + 4
    assert b.mode == a.mode and b.lengths.tolist() == [n, n]
    for name, rows in (("vc", n), ("vp", n), ("kq", n), ("ks", n), ("kf", n), ("kc", 2 * B),
                       ("kp", 2), ("kr", RING)):        # every ring slot holds one of the rows
        x, y = getattr(a, name), getattr(b, name)
        if x is not None:
            assert x[:, :rows].tobytes() == y[:, :rows].tobytes(), name
    q = rng.standard_normal((2, 40)).astype(np.float32)
    assert np.array_equal(_bits(layer.attend_all_heads(q)), _bits(other.attend_all_heads(q)))
    kv = kc.KvCache(2, 2, 40, mode=mode)
    kv.layers[1] = layer
    kv.save(tmp_path / "m.kvc")
    back = kc.KvCache.load(tmp_path / "m.kvc")
    assert back.mode == kv.mode and len(back.layers[1]) == n
    assert np.array_equal(_bits(back.layers[1].attend_all_heads(q)),
                          _bits(layer.attend_all_heads(q)))
    with pytest.raises(kc.WireError, match="F32 caches only"):
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
        target.install_bytes(resealed(v2))
    bad = bytearray(buf)
    bad[body + 4: body + 8] = struct.pack("<I", 12)      # head_dim 12
    with pytest.raises(wire.WireError):
        kc.LayerKvCache(1, 12, mode="f32").install_bytes(resealed(bad))
    assert len(target) == 0


def test_a_subprocess_with_kvcache_kv_k8v4_builds_4bit_layers():
    code = ("import kvcache as kc; c = kc.LayerKvCache(1, 16); print(c.mode.name, "
            "type(c._v).__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**__import__("os").environ, "KVCACHE_KV": "k8v4"}, check=True)
    assert out.stdout.split() == ["k8v4", "V4Rows"]


# -- 4-bit K ------------------------------------------------------------------------------------
def _k4_layer(rng, hd, n, nkv=1, mode="q4", scale=1.0):
    layer = kc.LayerKvCache(nkv, hd, mode=mode)
    k = (rng.standard_normal((n, nkv, hd)) * scale).astype(np.float32)
    k[:, :, 3] *= 20.0                          # an outlier channel, as real keys have
    v = rng.standard_normal((n, nkv, hd)).astype(np.float32)
    if n:
        layer.append(k, v)
    return layer, k, v


@pytest.mark.parametrize("hd", HEAD_DIMS + [8])
@pytest.mark.parametrize("n", [15, 31, 32, 33, 63, 64, 65, 100])
def test_k4_scores_match_the_twin_bit_for_bit_on_every_body(hd, n, each_level):
    rng = np.random.default_rng(hd * 1000 + n)
    layer, _, _ = _k4_layer(rng, hd, n)
    st = layer.state()
    q = rng.standard_normal((5, hd)).astype(np.float32) * np.float32(3)
    want = np.zeros((5, n), np.float32)
    R.k4_scores(q, st.kc[0], st.kp[0], st.kr[0], n, want)
    for level in each_level:
        _core.set_isa(level)
        got = np.zeros((5, n), np.float32)
        _core.k4_scores(q, st.kc[0], st.kp[0], st.kr[0], n, got)
        assert np.array_equal(_bits(got), _bits(want)), level


@pytest.mark.parametrize("hd", [64, 72, 40, 8])
def test_k4_fold_of_special_queries_matches_the_twin_on_every_body(hd, each_level):
    """Queries whose folded w is not finite in some groups (a NaN, an infinity, a product that
    overflows float32) get NaN scales there; zeros and tiny values meet the scale's 1e-12
    floor: every body gives the twin's bits, NaN rows where the twin has them."""
    rng = np.random.default_rng(hd)
    n = 70
    layer, _, _ = _k4_layer(rng, hd, n)
    st = layer.state()
    q = rng.standard_normal((8, hd)).astype(np.float32)
    q[0, 0], q[0, 4] = 100.0, np.nan             # a NaN beside a large lane: a NaN scale
    q[1, hd - 1] = np.inf                        # an infinity in the last group
    q[2, 3] = np.float32(3e38)                   # finite, but q * step (about 5) overflows
    q[3] = 0.0                                   # every group at the scale floor
    q[4] *= np.float32(1e-11)                    # tiny: codes from the floor's inverse
    q[5, :16] = -0.0                             # negative zeros: a group at the floor
    q[6, 20 % hd] = -np.inf
    q[6, 40 % hd] = np.nan
    assert st.kp[0][0].view(np.float16)[3] > 1           # channel 3's step (the outlier)
    wi, sw = R.k4_fold(q[4], st.kp[0][0].view(np.float16)[:hd].astype(np.float32))
    assert (sw == np.float32(1e-12)).all() and np.abs(wi).max() > 1   # the floor, codes not 0
    want = np.zeros((8, n), np.float32)
    R.k4_scores(q, st.kc[0], st.kp[0], st.kr[0], n, want)
    assert np.isnan(want[[0, 1, 2, 6], :64]).all()
    assert np.isfinite(want[[3, 4, 5, 7]]).all()
    for level in each_level:
        _core.set_isa(level)
        got = np.zeros((8, n), np.float32)
        _core.k4_scores(q, st.kc[0], st.kp[0], st.kr[0], n, got)
        assert np.array_equal(_bits(got), _bits(want)), level


@pytest.mark.parametrize("hd", [64, 40])
def test_an_infinite_query_over_a_constant_key_channel_scores_nan(hd, each_level):
    """q * step is inf * 0 = NaN where a block's key channel is constant: that group's scale
    is NaN, so the score is NaN (not the bias's infinity) on every body, as in the twin."""
    rng = np.random.default_rng(hd + 1)
    n = 2 * B + 5
    layer = kc.LayerKvCache(1, hd, mode="q4")
    k = rng.standard_normal((n, 1, hd)).astype(np.float32)
    k[:B, 0, 5] = 2.0                                  # constant in block 0: step 0, minimum 2
    layer.append(k, rng.standard_normal((n, 1, hd)).astype(np.float32))
    st = layer.state()
    q = rng.standard_normal((2, hd)).astype(np.float32)
    q[0, 5] = np.inf
    want = np.zeros((2, n), np.float32)
    R.k4_scores(q, st.kc[0], st.kp[0], st.kr[0], n, want)
    assert np.isnan(want[0, :B]).all() and np.isfinite(want[1]).all()
    for level in each_level:
        _core.set_isa(level)
        got = np.zeros((2, n), np.float32)
        _core.k4_scores(q, st.kc[0], st.kp[0], st.kr[0], n, got)
        assert np.array_equal(_bits(got), _bits(want)), level


def test_k4_blocks_are_the_documented_quantiser():
    rng = np.random.default_rng(4)
    hd = 40
    n = 2 * B + 11
    layer, k, _ = _k4_layer(rng, hd, n)
    st = layer.state()
    for b in range(2):                                 # two closed blocks, 11 rows open
        x = k[B * b:B * (b + 1), 0]
        pf = st.kp[0, b].view(np.float16).astype(np.float32)
        assert (pf[:hd] == np.float16((x.max(0) - x.min(0)) / np.float32(15))).all()
        assert (pf[hd:] == np.float16(x.min(0))).all()
        c, p = R.quantize_k4_block(x)
        assert c.tobytes() == st.kc[0, B * b:B * (b + 1)].tobytes()
        assert p.tobytes() == st.kp[0, b].tobytes()
        # the block layout: channel d of row t at byte (d // 8) * 4 B + 4 t + d % 4
        flat = st.kc[0, B * b:B * (b + 1)].reshape(-1)
        t, d = 5, 13
        code = (flat[(d // 8) * 4 * B + 4 * t + d % 4] >> (4 * (d % 8 // 4))) & 15
        assert code == quant.k4_unpack_blocks(st.kc[0, B * b:B * (b + 1)])[t, d]
    vals = quant.k4_values(st.kc[0], st.kp[0], n)
    assert (vals[2 * B:] == 0).all()                   # the open block is not codes
    step = np.repeat(st.kp[0, :2].view(np.float16).astype(np.float32)[:, :hd], B, axis=0)
    assert (np.abs(vals[:2 * B] - k[:2 * B, 0]) <= step / 2 * 1.001 + 0.02).all()
    for i in range(n - RING, n):                       # the ring: the last RING rows as given
        if i >= 0:
            assert st.kr[0, i % RING].tobytes() == k[i, 0].tobytes()
    assert layer.head_keys(0).shape == (0, hd)         # not stored as float32
    kb = 2 * B * (hd // 2) + 2 * 4 * hd + min(n, RING) * 4 * hd    # codes, parameters, ring
    assert layer.memory_bytes() == kb + n * quant.v4_row_bytes(hd)


@pytest.mark.parametrize("mode", K4_MODES)
def test_k4_does_not_depend_on_how_rows_arrived(mode):
    rng = np.random.default_rng(8)
    hd = 72
    whole, k, v = _k4_layer(rng, hd, 70, nkv=2, mode=mode)
    parts = kc.LayerKvCache(2, hd, mode=mode)
    for a, b in ((0, 1), (1, 31), (31, 32), (32, 33), (33, 63), (63, 64), (64, 65), (65, 70)):
        parts.append(k[a:b], v[a:b])
    sa, sb = whole.state(), parts.state()
    for name in ("kc", "kr"):
        assert getattr(sa, name)[:, :64].tobytes() == getattr(sb, name)[:, :64].tobytes()
    assert sa.kp[:, :2].tobytes() == sb.kp[:, :2].tobytes()
    q = rng.standard_normal((3, 8, hd)).astype(np.float32)
    assert np.array_equal(_bits(whole.attend_all_heads(q)), _bits(parts.attend_all_heads(q)))


@pytest.mark.parametrize("length", [40, 63, 64, 65, 80, 95, 96, 97, 130])
def test_k4_rollback_of_up_to_32_rows_is_exact_at_every_phase(length):
    rng = np.random.default_rng(length)
    hd = 40
    layer, k, v = _k4_layer(rng, hd, length, nkv=2)
    q = rng.standard_normal((4, hd)).astype(np.float32)
    ref = layer.attend_all_heads(q)
    st0 = layer.state().owned_copy()
    for n_back in (1, 2, length % B or B, B // 2 + 1, 31, 32):
        layer.truncate_last(n_back)
        short, _, _ = _k4_layer(rng, hd, 0, nkv=2)      # a cold layer of the kept rows
        short.append(k[:length - n_back], v[:length - n_back])
        assert np.array_equal(_bits(layer.attend_all_heads(q)), _bits(short.attend_all_heads(q)))
        layer.append(k[length - n_back:], v[length - n_back:])
        st = layer.state()
        nb = length // B
        assert st.kc[:, :B * nb].tobytes() == st0.kc[:, :B * nb].tobytes(), n_back
        assert st.kp[:, :nb].tobytes() == st0.kp[:, :nb].tobytes(), n_back
        assert st.kr.tobytes() == st0.kr.tobytes(), n_back
        assert np.array_equal(_bits(layer.attend_all_heads(q)), _bits(ref)), n_back


def test_k4_a_deeper_rollback_reopens_blocks_from_their_4bit_values():
    """Past the ring (64 rows), a reopened block's rows are the codes' values: what the
    layer then holds is those values, deterministically (docs/kv4.md)."""
    rng = np.random.default_rng(12)
    hd = 64
    layer, k, v = _k4_layer(rng, hd, 150)
    vals = quant.k4_values(layer.state().kc[0], layer.state().kp[0], 150)
    layer.truncate_last(100)                            # 50 rows: block 1 reopens, rows 32..49
    st = layer.state()
    for i in range(B, 50):
        assert st.kr[0, i % RING].tobytes() == vals[i].tobytes()
    again = kc.LayerKvCache(1, hd, mode="q4")
    again.append(k[:B], v[:B])
    again.append(vals[B:50, None, :], v[B:50])          # the same rows as the layer holds
    q = rng.standard_normal((2, hd)).astype(np.float32)
    assert np.array_equal(_bits(layer.attend_all_heads(q)), _bits(again.attend_all_heads(q)))


def _k4_bytes(layer, n):
    """The closed blocks' codes and parameters and the ring of a 4-bit K layer at length n."""
    st = layer.state()
    return (st.kc[:, :B * (n // B)].tobytes(), st.kp[:, :n // B].tobytes(), st.kr.tobytes())


@pytest.mark.parametrize("length", [70, 100, 150, 161, 257])
def test_k4_a_deep_rollback_and_replay_restore_every_byte(length):
    """Past the ring, a reopened block's rows are read back from its codes; when the same rows
    are appended again the block keeps its codes and parameters, so the layer comes back to
    every byte it held, whatever the depth and however the rows arrive (docs/kv4.md)."""
    rng = np.random.default_rng(length)
    hd = 40
    layer, k, v = _k4_layer(rng, hd, length, nkv=2, scale=3.0)
    q = rng.standard_normal((4, hd)).astype(np.float32)
    ref, want = layer.attend_all_heads(q), _k4_bytes(layer, length)
    depths = {33, 40, 50, 63, 64, 65, 96, 100, 130, length - 1, length} - {d for d in
                                                                         range(length + 1, 300)}
    for back, pieces in itertools.product(sorted(depths), [(1000,), (1, 7, 31, 5, 64, 1000)]):
        layer.truncate_last(back)
        i = length - back
        for step in pieces:
            j = min(length, i + step)
            layer.append(k[i:j], v[i:j])
            i = j
        assert _k4_bytes(layer, length) == want, (back, pieces)
        assert np.array_equal(_bits(layer.attend_all_heads(q)), _bits(ref)), (back, pieces)


def test_k4_rollbacks_in_a_row_and_partial_replays_restore_every_byte():
    rng = np.random.default_rng(44)
    hd, n = 64, 200
    layer, k, v = _k4_layer(rng, hd, n, nkv=2, scale=2.0)
    want = _k4_bytes(layer, n)
    for trial in range(12):
        at = n
        for _ in range(4):                  # back, forward part of the way, back again
            back = int(rng.integers(1, at + 1))
            layer.truncate_last(back)
            at -= back
            fwd = int(rng.integers(0, n - at + 1))
            layer.append(k[at:at + fwd], v[at:at + fwd])
            at += fwd
        layer.append(k[at:], v[at:])
        assert _k4_bytes(layer, n) == want, trial


def test_k4_a_deep_rollback_after_a_byte_round_trip_replays_exactly():
    """A layer read from bytes holds its ring as saved (rows that are already the codes'
    values among them): a deep rollback into it and a replay still restore every byte."""
    rng = np.random.default_rng(45)
    hd, n = 40, 150
    layer, k, v = _k4_layer(rng, hd, n, nkv=2)
    layer.truncate_last(70)                 # the ring now holds rows 16..79, some as values
    layer.append(k[80:120], v[80:120])
    want = _k4_bytes(layer, 120)
    other = kc.LayerKvCache(2, hd, mode="q4")
    other.install_bytes(layer.to_bytes())
    assert _k4_bytes(other, 120) == want
    other.truncate_last(90)
    other.append(k[30:120], v[30:120])
    assert _k4_bytes(other, 120)[:2] == want[:2]
    # the ring's closed rows are the replayed originals now, as in a cold layer of the rows
    cold, _, _ = _k4_layer(rng, hd, 0, nkv=2)
    cold.append(k[:120], v[:120])
    assert _k4_bytes(other, 120) == _k4_bytes(cold, 120)


def test_k4_a_reopened_block_refilled_with_other_rows_is_quantised_afresh():
    """Rows other than the rolled-back ones: the block is quantised again from what the ring
    holds (the rows read back from the codes, then the new rows), deterministically."""
    rng = np.random.default_rng(46)
    hd = 64
    layer, k, v = _k4_layer(rng, hd, 150)
    vals = quant.k4_values(layer.state().kc[0], layer.state().kp[0], 150)
    layer.truncate_last(100)                 # block 1 reopens, rows 32..49 from the codes
    new = rng.standard_normal((30, 1, hd)).astype(np.float32)
    layer.append(new, v[50:80])
    block = np.concatenate([vals[B:50], new[:2 * B - 50, 0]])
    c, p = R.quantize_k4_block(block)
    st = layer.state()
    assert st.kc[0, B:2 * B].tobytes() == c.tobytes()
    assert st.kp[0, 1].tobytes() == p.tobytes()
    again = kc.LayerKvCache(1, hd, mode="q4")
    again.append(k[:B], v[:B])
    again.append(vals[B:50, None, :], v[B:50])
    again.append(new, v[50:80])
    assert _k4_bytes(again, 80)[:2] == _k4_bytes(layer, 80)[:2]
    q = rng.standard_normal((2, hd)).astype(np.float32)
    assert np.array_equal(_bits(layer.attend_all_heads(q)), _bits(again.attend_all_heads(q)))


def test_k4_a_reopened_block_keeps_its_codes_for_rows_that_quantise_to_them():
    """The rule that makes a replay exact, on rows that are not the originals: rows that
    quantise to the block's old codes under its old parameters leave the block as it was."""
    rng = np.random.default_rng(47)
    hd = 64
    _, k, v = _k4_layer(rng, hd, 150)
    k[:, :, 5] = k[:, :, 5] * np.float32(0.3) + np.float32(300)    # afresh would move it
    layer = kc.LayerKvCache(1, hd, mode="q4")
    layer.append(k, v)
    want = _k4_bytes(layer, 64)
    st = layer.state()
    step = st.kp[0, 1, :hd].view(np.float16).astype(np.float32)
    images = quant.k4_values(st.kc[0], st.kp[0], 2 * B, B)
    layer.truncate_last(100)
    near = k[50:64].copy()                   # halfway to their codes' values: the same codes
    near[:, 0] += (images[50 - B:] - near[:, 0]) * np.float32(0.5)
    assert (near[:, 0] != k[50:64, 0]).any(axis=1).all()
    layer.append(near, v[50:64])
    assert _k4_bytes(layer, 64)[:2] == want[:2]
    far = k[50:64].copy()
    far[:, 0, 3] += 10 * step[3]             # one channel moves by ten steps: afresh
    layer.truncate_last(14)
    layer.append(far, v[50:64])
    assert _k4_bytes(layer, 64)[1] != want[1]


def test_k4_a_replay_that_grows_the_layer_keeps_the_reopened_block():
    """Growing the arrays while a block is reopened carries its codes and parameters, which
    lie past the head's length: a replay across the growth is exact, and rows that arrive one
    by one give what one call gives."""
    rng = np.random.default_rng(49)
    hd, n = 40, 356
    cold, k, v = _k4_layer(rng, hd, n, nkv=2, scale=3.0)
    for fill in (256, 512 - 76):
        if fill > n:
            continue
        for one_by_one in (False, True):
            layer = kc.LayerKvCache(2, hd, mode="q4")
            layer.append(k[:fill], v[:fill])
            layer.truncate_last(76)
            rows = range(fill - 76, n)
            if one_by_one:
                for i in rows:
                    layer.append(k[i:i + 1], v[i:i + 1])
            else:
                layer.append(k[fill - 76:], v[fill - 76:])
            assert _k4_bytes(layer, n) == _k4_bytes(cold, n), (fill, one_by_one)


def test_k4_gqa_heads_at_other_lengths_replay_exactly():
    rng = np.random.default_rng(50)
    hd, n, nkv = 64, 180, 4
    k = (rng.standard_normal((n, nkv, hd)) * 2).astype(np.float32)
    k[:, :, 5] += 300
    v = rng.standard_normal((n, nkv, hd)).astype(np.float32)
    alive = [np.array([1, i >= 30, 1, i >= 45], bool) for i in range(n)]   # heads join late
    layer = kc.LayerKvCache(nkv, hd, mode="q4")
    for i in range(n):
        layer.append(k[i:i + 1], v[i:i + 1], alive=alive[i])
    lengths = [layer.head_len(h) for h in range(nkv)]
    want = [[a.tobytes() for a in layer.k4_rows(h)[:2]] for h in range(nkv)]
    assert lengths == [180, 150, 180, 135]           # the blocks at other phases
    for back in (100, 37, 130):
        layer.truncate_last(back)
        for i in range(n - back, n):
            layer.append(k[i:i + 1], v[i:i + 1], alive=alive[i])
        for h in range(nkv):
            assert layer.head_len(h) == lengths[h]
            assert [a.tobytes() for a in layer.k4_rows(h)[:2]] == want[h], (back, h)


def test_k4_a_shallow_rollback_then_other_rows_equals_a_cold_layer():
    """Within the ring a reopened block holds its own rows, so other rows appended after a
    rollback give what a cold layer of the same rows gives, even for keys that lie on the
    4-bit grid (their rows equal the codes' values bit for bit)."""
    rng = np.random.default_rng(51)
    hd = 16
    k = rng.integers(0, 16, (100, 1, hd)).astype(np.float32)
    k[[0, 32], 0], k[[1, 33], 0] = 0, 15                 # step 1, minimum 0: on the grid
    v = rng.standard_normal((100, 1, hd)).astype(np.float32)
    layer = kc.LayerKvCache(1, hd, mode="q4")
    layer.append(k[:70], v[:70])
    layer.truncate_last(20)                              # block 1 reopens, rows 32..49
    other = k[50:70].copy()
    other[:, 0, :] += 0.25           # the same codes under the old step, off the grid, and
    # a maximum of 15.25: afresh, the block's step is float16(15.25 / 15), not 1
    layer.append(other, v[50:70])
    cold = kc.LayerKvCache(1, hd, mode="q4")
    cold.append(np.concatenate([k[:50], other]), v[:70])
    assert _k4_bytes(layer, 70) == _k4_bytes(cold, 70)


def test_k4_rows_appended_after_a_load_are_not_taken_as_read_back():
    """After a load, only the loaded rows of the ring may be rows read back from the codes:
    rows appended after a rollback below the loaded length are the rows themselves, so a
    shallow rollback over them followed by other rows still equals a cold layer."""
    rng = np.random.default_rng(52)
    hd = 16
    rows = rng.integers(0, 16, (64, 1, hd)).astype(np.float32)     # on the 4-bit grid
    rows[[0, 32]], rows[[1, 33]] = 0, 15                          # step 1, minimum 0
    src = kc.LayerKvCache(1, hd, mode="q4")
    src.append(rows[:40], rows[:40])
    layer = kc.LayerKvCache(1, hd, mode="q4")
    layer.install_bytes(src.to_bytes())                           # a load at 40
    layer.truncate_last(20)
    layer.append(rows[20:64], rows[20:64])                        # blocks 0 and 1 close
    layer.truncate_last(20)                                       # within the ring
    rows[44:64] += np.float32(0.25)                               # the same codes
    layer.append(rows[44:64], rows[44:64])
    cold = kc.LayerKvCache(1, hd, mode="q4")
    cold.append(rows, rows)
    assert _k4_bytes(layer, 64)[:2] == _k4_bytes(cold, 64)[:2]


def test_k4_refills_reads_rows_as_images_or_as_their_codes():
    rng = np.random.default_rng(48)
    hd = 16
    x = (rng.standard_normal((B, hd)) * 2).astype(np.float32)
    c, p = R.quantize_k4_block(x)
    assert quant.k4_refills(x, c, p)                           # the originals
    images = quant.k4_values(c, p[None], B)
    assert quant.k4_refills(images, c, p)                      # the codes' values
    mixed = np.concatenate([images[:10], x[10:]])
    assert quant.k4_refills(mixed, c, p)
    for bad in (np.nan, np.inf, 1e6):
        y = x.copy()
        y[5, 2] = bad
        assert not quant.k4_refills(y, c, p), bad
    y = x.copy()
    y[7] = -y[7]
    assert not quant.k4_refills(y, c, p)
    lo, hi = x.min(0), x.max(0)
    for far in (lo[4] - 1e4, hi[4] + 1e4, lo[4] - 5 * (hi[4] - lo[4]) / 15):
        y = x.copy()                 # the clamped code 0 or 15, but no row of the block
        y[9, 4] = far
        assert not quant.k4_refills(y, c, p), far
    z = x.copy()
    z[:, 6] = 5.0                    # a constant channel: step 0, code 0 whatever the value
    c, p = R.quantize_k4_block(z)
    assert p.view(np.float16)[6] == 0 and quant.k4_refills(z, c, p)
    z[3, 6] = 1000.0
    assert not quant.k4_refills(z, c, p)


@pytest.mark.parametrize("mode", K4_MODES)
def test_k4_eviction_rebuilds_the_kept_rows_from_their_stored_values(mode):
    rng = np.random.default_rng(21)
    hd = 64
    layer, k, v = _k4_layer(rng, hd, 90, nkv=2, mode=mode)
    st = layer.state()
    kept_vals = [layer._k.nearest(h, 90) for h in range(2)]
    layer.evict(50)
    assert len(layer) == 50
    rebuilt = kc.LayerKvCache(2, hd, mode=mode)
    kk = np.stack([kept_vals[h][40:] for h in range(2)], axis=1)
    rebuilt.append(kk, v[40:])
    q = rng.standard_normal((4, hd)).astype(np.float32)
    assert np.array_equal(_bits(layer.attend_all_heads(q)), _bits(rebuilt.attend_all_heads(q)))
    assert st.kc.shape[2] == hd // 2


def test_k4_quality_beats_per_row_4bit_keys_on_channel_offsets():
    """Per-channel blocks follow a channel's own range: keys whose channels sit at their own
    offsets (as real keys do) are scored with far less error than per-row 4-bit keys (16-channel
    groups) would give: the reason for the scheme (docs/kv4-scheme-study.md)."""
    rng = np.random.default_rng(31)
    hd, n = 64, 256
    offset = (rng.standard_normal(hd) * 4).astype(np.float32)
    k = (rng.standard_normal((n, 1, hd)) + offset).astype(np.float32)
    layer = kc.LayerKvCache(1, hd, mode="q4")
    layer.append(k, k)
    st = layer.state()
    q = rng.standard_normal((8, hd)).astype(np.float32)
    exact = q @ k[:, 0].T
    got = np.zeros((8, n), np.float32)
    R.k4_scores(q, st.kc[0], st.kp[0], st.kr[0], n, got)
    c, p = _quantised(k[:, 0])                           # per-row 16-channel groups
    per_row = q @ R.dequantize_v4(c, p, hd).T
    assert np.abs(got - exact).mean() < 0.4 * np.abs(per_row - exact).mean()


def test_k4_head_dims_and_bad_input():
    for hd in (8, 40, 72, 256):
        kc.LayerKvCache(1, hd, mode="q4")
    with pytest.raises(ValueError, match="4-bit K needs head_dim to be a multiple of 8"):
        kc.LayerKvCache(1, 20, mode="q4k")
    out = np.zeros((1, 5), np.float32)
    good = (np.zeros((1, 16), np.float32), np.zeros((B, 8), np.uint8),
            np.zeros((1, 32), np.uint16), np.zeros((RING, 16), np.float32))
    with pytest.raises(ValueError, match="k4_scores"):
        _core.k4_scores(*good, B + 1, np.zeros((1, B + 1), np.float32))  # n past the codes
    with pytest.raises(TypeError, match="kp"):
        _core.k4_scores(good[0], good[1], good[2].astype(np.int16), good[3], 5, out)
    with pytest.raises(ValueError, match="k4_scores"):
        _core.k4_scores(good[0], good[1], good[2], good[3][:RING - 1], 5, out)
    _core.k4_scores(*good, 5, out)
    assert not out.any()


def test_the_4bit_row_writers_refuse_shapes_that_do_not_fit():
    x = np.zeros((2, 1, 16), np.float32)
    one, zero = np.ones(1, np.uint8), np.zeros(1, np.intp)
    c, p = np.zeros((1, 4, 8), np.uint8), np.zeros((1, 4, 2), np.uint16)
    ring = np.zeros((1, RING, 16), np.float32)
    kp = np.zeros((1, 1, 32), np.uint16)
    with pytest.raises(ValueError, match="capacity"):
        _core.store_rows_v4(x, one, np.full(1, 3, np.intp), c, p)       # rows 3, 4 past 4
    with pytest.raises(ValueError, match="heads"):
        _core.store_rows_v4(np.zeros((2, 3, 16), np.float32), np.ones(3, np.uint8),
                            np.zeros(3, np.intp), c, p)
    with pytest.raises(ValueError, match="ring"):
        _core.store_rows_k4(x, one, zero, c, kp, ring[:, :1])
    with pytest.raises(ValueError, match="capacity"):
        _core.store_rows_k4(x, one, np.full(1, 10**9, np.intp), c, kp, ring)
    _core.store_rows_k4(x, one, zero, c, kp, ring)
    _core.store_rows_v4(x, one, zero, c, p)


def test_k4_truncate_decodes_only_the_blocks_it_reopens(monkeypatch):
    rng = np.random.default_rng(3)
    layer, _, _ = _k4_layer(rng, 64, 640)
    seen = []
    real = quant.k4_values

    def spy(codes, par, n, lo=0):
        seen.append(n - lo)
        return real(codes, par, n, lo)

    monkeypatch.setattr(quant, "k4_values", spy)
    layer.truncate_last(1)
    layer.truncate_last(40)
    assert seen and max(seen) <= RING              # never the whole history


def test_k4_prefix_store_needs_whole_blocks():
    from kvcache.store import PrefixStore
    cache = kc.KvCache(1, 1, 16, mode="q4")
    with pytest.raises(ValueError, match=f"multiple of {B}"):
        PrefixStore("memory", fingerprint="m", block=48).put(np.arange(96), cache)


@pytest.mark.parametrize("mode", ["f32", "q8", "q8:cmf", "q4", "k8v4", "q4k", "q4v", "q8v"])
def test_head_rows_are_the_values_the_kernels_read(mode):
    """LayerKvCache.head_rows: float32 parts are read-only views of the storage; int8 parts
    are rows times scales (times the frozen column field); 4-bit K is the twin's k4_keys
    (codes in closed blocks, the ring's rows in the open one), 4-bit V its dequantize_v4."""
    rng = np.random.default_rng(5)
    hd, n = 64, 100                                  # past the q8 column freeze at 64 rows
    layer = kc.LayerKvCache(2, hd, mode=mode)
    k = rng.standard_normal((n, 2, hd)).astype(np.float32)
    v = rng.standard_normal((n, 2, hd)).astype(np.float32)
    layer.append(k, v)
    m = layer.mode
    for h in range(2):
        keys, values = layer.head_rows(h)
        assert keys.shape == values.shape == (n, hd) and keys.dtype == values.dtype == np.float32
        assert not keys.flags.writeable and not values.flags.writeable
        kq, ks, vq, vs = layer.q8_rows(h)
        kcol, vcol = layer.columns(h)
        if m.k_bits == 32:
            assert np.array_equal(keys, k[:, h])
            assert np.shares_memory(keys, layer.head_keys(h))
        elif m.k_bits == 8:
            want = quant.dequantize(kq, ks, quant.k_group(m.scheme))
            assert np.array_equal(keys, want if kcol is None else want * kcol)
        else:
            c, p, r = layer.k4_rows(h)
            full_c = np.zeros((-(-n // B) * B, hd // 2), np.uint8)
            full_c[: c.shape[0]] = c
            full_p = np.zeros((-(-n // B), 2 * hd), np.uint16)
            full_p[: p.shape[0]] = p.view(np.uint16)
            assert np.array_equal(keys, R.k4_keys(full_c, full_p, r, n))
        if m.v_bits == 32:
            assert np.array_equal(values, v[:, h])
        elif m.v_bits == 8:
            want = vq.astype(np.float32) * vs[:, None]
            assert np.array_equal(values, want if vcol is None else want * vcol)
        else:
            c, p = layer.v4_rows(h)
            assert np.array_equal(values, R.dequantize_v4(c, p.view(np.uint16), hd))
    if m.k_bits == 32:                    # float32 scores: attention over them is the kernel's
        q = rng.standard_normal((2, hd)).astype(np.float32)
        out = layer.attend_all_heads(q.copy())
        keys, values = layer.head_rows(1)
        s = keys.astype(np.float64) @ q[1] / np.sqrt(hd)
        p = np.exp(s - s.max())
        np.testing.assert_allclose(p / p.sum() @ values, out[1], rtol=0, atol=1e-6)
    with pytest.raises(IndexError):
        layer.head_rows(2)
