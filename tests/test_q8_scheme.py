"""The two int8 storage schemes: "rows" (the default) and the legacy "cmf" (column freeze).

- KvMode's scheme: constructors, names, environment, equality, hashing, repr, pickling, errors;
- each scheme's storage against its NumPy reference (``reference.q8_storage``), bit for bit;
- rollback and replay: in "rows" every stored byte and every attention output come back
  identical at any position, around every former threshold; "cmf" still differs across its
  column freeze, as that scheme specifies;
- the same through the runner (prefill 60, decode 10, roll back, decode again);
- the versioned format records the scheme, still reads the buffers kvcache wrote before it
  existed (tests/data/q8_legacy, see tests/data/README.md) and refuses mixing schemes;
- the prefix store keys and entries by scheme.
"""

from __future__ import annotations

import os
import pickle
import struct
import zlib

import numpy as np
import pytest

import kvcache as kc
from kvcache import reference as ref
from kvcache import wire
from kvcache.modes import MODE_NAMES
from kvcache.store import PrefixStore
from kvcache.store.memory import MemoryBackend

DATA = os.path.join(os.path.dirname(__file__), "data", "q8_legacy")
Q8 = kc.KvMode.Q8
ROWS_MODES = [Q8(), Q8(True, False), Q8(False, True)]
CMF_MODES = [Q8(scheme="cmf"), Q8(True, False, scheme="cmf"), Q8(False, True, scheme="cmf")]
ALL_Q8 = ROWS_MODES + CMF_MODES
IDS = ["q8", "q8k", "q8v", "q8:cmf", "q8k:cmf", "q8v:cmf"]


def data(rng, n, nkv, hd):
    """Rows with uneven channels (what a column field is for) and a few outliers."""
    scale = np.linspace(0.1, 4.0, hd, dtype=np.float32)
    k = (rng.standard_normal((n, nkv, hd)) * scale).astype(np.float32)
    v = rng.standard_normal((n, nkv, hd)).astype(np.float32)
    k[::17, :, 3] *= 20.0
    return k, v


def stored(layer):
    """Every stored byte of the layer: int8 rows, scales, float rows, column fields."""
    out = []
    for h in range(layer.num_kv_heads):
        out += [None if a is None else a.tobytes() for a in layer.q8_rows(h)]
        out += [None if a is None else a.tobytes() for a in layer.columns(h)]
        out += [layer.head_keys(h).tobytes(), layer.head_values(h).tobytes()]
    return out


# ------------------------------------------------------------------------------ KvMode API
def test_the_default_scheme_is_rows_and_cmf_is_kept():
    assert Q8().scheme == "rows" and Q8(True, False).scheme == "rows"
    assert Q8(scheme="cmf").scheme == "cmf"
    assert kc.KvMode.F32.scheme == ""
    assert Q8() != Q8(scheme="cmf") and hash(Q8()) != hash(Q8(scheme="cmf"))
    assert Q8(scheme="rows") == Q8() and hash(Q8(scheme="rows")) == hash(Q8())
    assert len({Q8(), Q8(scheme="cmf"), Q8(), kc.KvMode.F32}) == 3
    assert not Q8().freezes_columns and Q8(scheme="cmf").freezes_columns
    assert not kc.KvMode.F32.freezes_columns


def test_repr_names_only_the_legacy_scheme():
    assert repr(Q8()) == "KvMode.Q8(k=True, v=True)"
    assert repr(Q8(True, False)) == "KvMode.Q8(k=True, v=False)"
    assert repr(Q8(scheme="cmf")) == "KvMode.Q8(k=True, v=True, scheme='cmf')"
    assert repr(Q8(False, True, "cmf")) == "KvMode.Q8(k=False, v=True, scheme='cmf')"
    assert repr(kc.KvMode.F32) == "KvMode.F32"
    for mode in ALL_Q8 + [kc.KvMode.F32]:
        assert eval(repr(mode), {"KvMode": kc.KvMode}) == mode


@pytest.mark.parametrize("mode", ALL_Q8 + [kc.KvMode.F32], ids=IDS + ["f32"])
def test_pickle_keeps_the_scheme(mode):
    back = pickle.loads(pickle.dumps(mode))
    assert back == mode and back.scheme == mode.scheme and hash(back) == hash(mode)


@pytest.mark.parametrize("bad", ["legacy", "ROWS", "", "cmf "])
def test_a_bad_scheme_is_named(bad):
    with pytest.raises(ValueError, match=f"scheme: expected one of 'rows', 'cmf', got {bad!r}"):
        Q8(scheme=bad)
    with pytest.raises(ValueError, match="scheme"):
        kc.KvMode(True, True, bad)


def test_a_scheme_that_is_not_a_string_is_a_type_error():
    with pytest.raises(TypeError, match="scheme: expected one of 'rows', 'cmf', got int"):
        Q8(scheme=1)
    with pytest.raises(ValueError, match="needs k or v"):        # still checked
        Q8(False, False, "cmf")


@pytest.mark.parametrize("name, mode", [
    ("q8", Q8()), ("q8k", Q8(True, False)), ("q8v", Q8(False, True)),
    ("q8:cmf", Q8(scheme="cmf")), ("q8k:cmf", Q8(True, False, "cmf")),
    ("q8v:cmf", Q8(False, True, "cmf")), (" Q8K:CMF ", Q8(True, False, "cmf")),
    ("q8:rows", Q8()), ("q8v : rows", Q8(False, True)), ("f32", kc.KvMode.F32),
])
def test_names_parse_and_read_from_the_environment(name, mode, monkeypatch):
    assert kc.KvMode.parse(name) == mode
    monkeypatch.setenv("KVCACHE_KV", name)
    assert kc.KvMode.from_env() == mode
    assert kc.LayerKvCache(2, 4, mode=name).mode == mode
    kv = kc.KvCache(2, 2, 4, 16, mode=name)
    assert kv.mode == mode and all(layer.mode == mode for layer in kv.layers)


def test_every_documented_name_round_trips_through_mode_name():
    assert MODE_NAMES == ("f32", "q8", "q8k", "q8v", "q8:cmf", "q8k:cmf", "q8v:cmf", "q4",
                          "k8v4", "k8v4:cmf", "q4v", "q4k", "k4v8", "k4v8:cmf")
    for name in MODE_NAMES:
        assert kc.KvMode.parse(name).name == name


@pytest.mark.parametrize("bad", ["q8:", "q8:legacy", "f32:cmf", "cmf", "q8:cmf:cmf", "q8k:q8"])
def test_bad_names_list_every_name(bad, monkeypatch):
    listed = ("'f32', 'q8', 'q8k', 'q8v', 'q8:cmf', 'q8k:cmf', 'q8v:cmf', 'q4', 'k8v4', "
              "'k8v4:cmf', 'q4v', 'q4k', 'k4v8', 'k4v8:cmf'")
    with pytest.raises(ValueError, match=f"kv: expected one of {listed} \\(or a KvMode\\), got"):
        kc.KvMode.parse(bad, "kv")
    monkeypatch.setenv("KVCACHE_KV", bad)
    with pytest.raises(ValueError, match=f"KVCACHE_KV must be one of {listed}, got"):
        kc.KvMode.from_env()


def test_the_cli_takes_the_scheme_names(capsys):
    from kvcache.runner import cli
    parser = cli.build_parser()
    assert kc.KvMode.parse(parser.parse_args(["--kv", "q8k:cmf"]).kv) == Q8(True, False, "cmf")
    assert kc.KvMode.parse(parser.parse_args(["--kv", "q8"]).kv) == Q8()
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv", "q8:old"])
    assert "'q8:cmf', 'q8k:cmf', 'q8v:cmf'" in capsys.readouterr().err


# ------------------------------------------------------------------------------ reference
def _append_pieces(layer, k, v, alive, cuts):
    lo = 0
    for hi in list(cuts) + [k.shape[0]]:
        if hi > lo:
            layer.append(k[lo:hi], v[lo:hi], alive=None if alive is None else alive[lo])
        lo = hi


@pytest.mark.parametrize("mode", ALL_Q8, ids=IDS)
@pytest.mark.parametrize("hd", [40, 33, 5, 64])
def test_storage_matches_the_reference_of_its_scheme(rng, mode, hd):
    """Blocks of several sizes (one crossing position 64), a head dead for a few positions:
    every int8 value, scale and column bit-identical to reference.q8_storage."""
    nkv, n = 3, 150
    k, v = data(rng, n, nkv, hd)
    alive = np.ones((n, nkv), bool)
    alive[10:13, 1] = False                 # appended one position at a time below
    cuts = [1, 2, 10, 11, 12, 13, 40, 90, 91]
    layer = kc.LayerKvCache(nkv, hd, mode=mode)
    _append_pieces(layer, k, v, alive, cuts)
    want = ref.q8_storage(k, v, alive, mode.quant_k, mode.quant_v, mode.scheme)
    for h in range(nkv):
        kq, ks, vq, vs = layer.q8_rows(h)
        kcol, vcol = layer.columns(h)
        assert layer.head_len(h) == int(alive[:, h].sum())
        if mode.quant_k:
            assert kq.tobytes() == want["kq"][h].tobytes() and ks.tobytes() == want["ks"][h].tobytes()
            assert (kcol is None) == (want["kcol"][h] is None)
            assert kcol is None or kcol.tobytes() == want["kcol"][h].tobytes()
        if mode.quant_v:
            assert vq.tobytes() == want["vq"][h].tobytes() and vs.tobytes() == want["vs"][h].tobytes()
            assert (vcol is None) == (want["vcol"][h] is None)
            assert vcol is None or vcol.tobytes() == want["vcol"][h].tobytes()
        frozen = kcol is not None or vcol is not None
        assert frozen == (mode.scheme == "cmf")       # 150 positions: cmf froze, rows never


@pytest.mark.parametrize("mode", ROWS_MODES, ids=IDS[:3])
def test_a_rows_row_depends_on_itself_only(rng, mode):
    """The same row stores the same bytes whatever came before it (any position, any
    neighbours): what makes rollback exact."""
    nkv, hd = 2, 48
    k, v = data(rng, 200, nkv, hd)
    alone = kc.LayerKvCache(nkv, hd, mode=mode)
    alone.append(k[150:], v[150:])
    late = kc.LayerKvCache(nkv, hd, mode=mode)
    late.append(k, v)
    for h in range(nkv):
        for a, b in zip(alone.q8_rows(h), late.q8_rows(h)):
            assert (a is None and b is None) or a.tobytes() == b[150:].tobytes()


def test_the_reference_refuses_an_unknown_scheme():
    with pytest.raises(ValueError, match="scheme"):
        ref.q8_storage(np.zeros((1, 1, 4)), np.zeros((1, 1, 4)), None, True, True, "x")


# ------------------------------------------------------------------------------ rollback
N_AROUND = sorted({1, 63, 64, 65, *range(60, 71), 127, 128, 129, 130})


def _decode(layer, k, v, q):
    """Append one position at a time, attending after each: the outputs."""
    outs = []
    for i in range(k.shape[0]):
        layer.append(k[i], v[i])
        outs.append(layer.attend_all_heads(q[i]).copy())
        outs.append(layer.attend_all_heads(q[i:i + 1].repeat(2, 0), prefill=True).copy())
    return outs


@pytest.mark.parametrize("mode", ROWS_MODES + [kc.KvMode.F32], ids=IDS[:3] + ["f32"])
@pytest.mark.parametrize("n", N_AROUND)
def test_rows_rollback_and_replay_are_bit_exact(mode, n):
    rng = np.random.default_rng(n)
    nkv, hd, steps = 2, 40, 10
    k, v = data(rng, n + steps, nkv, hd)
    q = rng.standard_normal((n + steps, 3 * nkv, hd)).astype(np.float32)
    layer = kc.LayerKvCache(nkv, hd, mode=mode)
    layer.append(k[:n], v[:n])
    first_prompt = layer.attend_all_heads(q[:n]).copy()
    before = stored(layer)
    first = _decode(layer, k[n:], v[n:], q[n:])
    after_first = stored(layer)
    layer.truncate_last(steps)
    assert layer.seq_len == n and stored(layer) == before
    again = _decode(layer, k[n:], v[n:], q[n:])
    assert stored(layer) == after_first
    assert all(a.tobytes() == b.tobytes() for a, b in zip(first, again))
    layer.truncate_last(steps)
    assert layer.attend_all_heads(q[:n]).tobytes() == first_prompt.tobytes()
    # and the same rows in one block (a prefill of n + steps) store the same bytes
    block = kc.LayerKvCache(nkv, hd, mode=mode)
    block.append(k, v)
    assert stored(block) == after_first


@pytest.mark.parametrize("mode", CMF_MODES, ids=IDS[3:])
@pytest.mark.parametrize("n", [55, 60, 63, 64])
def test_cmf_rollback_across_the_freeze_differs_as_specified(mode, n):
    """The legacy scheme freezes its column at the append that finds 64 positions and keeps
    it through truncate_last: a rollback to 64 positions or fewer does not give back the
    bytes stored before (the kept rows were requantised), and replaying positions that
    crossed the freeze (a rollback to 63 or fewer) stores other bytes and attends
    differently -- what scheme "rows" fixes.  Replaying once the freeze is behind is exact."""
    rng = np.random.default_rng(n)
    nkv, hd, steps = 2, 40, 10
    k, v = data(rng, n + steps, nkv, hd)
    q = rng.standard_normal((n + steps, 3 * nkv, hd)).astype(np.float32)
    layer = kc.LayerKvCache(nkv, hd, mode=mode)
    layer.append(k[:n], v[:n])
    before = stored(layer)
    assert all(c is None for h in range(nkv) for c in layer.columns(h))
    first = _decode(layer, k[n:], v[n:], q[n:])
    after_first = stored(layer)
    layer.truncate_last(steps)
    kept = stored(layer)
    assert kept != before                        # the freeze requantised the kept rows
    assert any(c is not None for h in range(nkv) for c in layer.columns(h))
    again = _decode(layer, k[n:], v[n:], q[n:])
    crossed = n < 64            # the first decode ran its first steps before the freeze
    assert (stored(layer) != after_first) == crossed
    assert any(a.tobytes() != b.tobytes() for a, b in zip(first, again)) == crossed
    # past the freeze a cmf rollback is exact too
    layer.truncate_last(steps)
    third = _decode(layer, k[n:], v[n:], q[n:])
    assert all(a.tobytes() == b.tobytes() for a, b in zip(again, third))


@pytest.mark.parametrize("kv", ["q8", "q8k", "q8v", "f32"])
def test_runner_rollback_replays_the_same_logits(kv):
    from kvcache import runner as kr
    r = kr.Runner.random(kv=kv)
    ids = np.random.default_rng(1).integers(0, 512, 70)
    r.prefill(ids[:60])
    first = [r.step(int(t)) for t in ids[60:70]]
    r.truncate_last(10)
    again = [r.step(int(t)) for t in ids[60:70]]
    assert all(a.tobytes() == b.tobytes() for a, b in zip(first, again))


def test_runner_rollback_across_64_differs_in_the_legacy_scheme():
    from kvcache import runner as kr
    r = kr.Runner.random(kv="q8:cmf")
    ids = np.random.default_rng(1).integers(0, 512, 70)
    r.prefill(ids[:60])
    first = [r.step(int(t)) for t in ids[60:70]]
    r.truncate_last(10)
    again = [r.step(int(t)) for t in ids[60:70]]
    assert any(a.tobytes() != b.tobytes() for a, b in zip(first, again))


def test_runner_fingerprints_tell_the_schemes_apart():
    from kvcache import runner as kr
    prints = {kv: kr.Runner.random(kv=kv).fingerprint for kv in ("f32", "q8", "q8:cmf", "q8k",
                                                                   "q8k:cmf")}
    assert len(set(prints.values())) == 5


# ------------------------------------------------------------------------------ byte format
def test_the_versioned_format_records_the_scheme(rng):
    k, v = data(rng, 70, 2, 40)
    for mode, code in ((Q8(), 1), (Q8(scheme="cmf"), 2), (Q8(False, True), 1),
                       (kc.KvMode.F32, 0)):
        layer = kc.LayerKvCache(2, 40, mode=mode)
        layer.append(k, v)
        buf = layer.to_bytes()
        assert struct.unpack_from("<H", buf, 8)[0] == wire.VERSION == 3
        assert buf[32 + 12] == code                  # the layer body's scheme byte
        back = kc.LayerKvCache(2, 40, mode=mode)
        back.install_bytes(buf)
        assert back.mode == mode and stored(back) == stored(layer)
        kv = kc.KvCache(1, 2, 40, mode=mode)
        kv.layers[0] = layer
        loaded = wire.model_from_bytes(kc.KvCache, wire._finish(wire.model_plan(kv), 2, None))
        assert loaded.mode == mode and loaded.layers[0].mode == mode
        assert stored(loaded.layers[0]) == stored(layer)


def _reseal(buf, edit):
    b = bytearray(buf)
    edit(b)
    b[-8:] = struct.pack("<Q", wire.digest(b[11], np.frombuffer(bytes(b[:-8]), np.uint8)))
    return bytes(b)


def test_scheme_bytes_that_do_not_fit_are_refused(rng, snapshot, assert_same_state):
    k, v = data(rng, 70, 2, 40)
    cmf = kc.LayerKvCache(2, 40, mode=Q8(scheme="cmf"))
    cmf.append(k, v)
    buf = cmf.to_bytes()
    target = kc.LayerKvCache(2, 40, mode=kc.KvMode.F32)
    target.append(k[:3], v[:3])
    before = snapshot(target)
    cases = [
        (_reseal(buf, lambda b: b.__setitem__(44, 1)), "frozen columns in int8 scheme 'rows'"),
        (_reseal(buf, lambda b: b.__setitem__(44, 3)), "invalid int8 scheme byte 3"),
        (_reseal(buf, lambda b: b.__setitem__(44, 0)), "invalid int8 scheme byte 0"),
        (_reseal(buf, lambda b: b.__setitem__(slice(8, 10), b"\x01\x00")),
         "invalid reserved field 2 \\(format version 1\\)"),
    ]
    for bad, match in cases:
        with pytest.raises(kc.WireError, match=match):
            target.install_bytes(bad)
        assert_same_state(before, snapshot(target))


@pytest.mark.parametrize("have, got", [("q8", "q8:cmf"), ("q8:cmf", "q8"), ("q8k", "q8v:cmf"),
                                       ("q8v:cmf", "q8k")])
def test_a_buffer_of_the_other_scheme_is_refused(rng, have, got, snapshot, assert_same_state):
    k, v = data(rng, 70, 2, 40)
    src = kc.LayerKvCache(2, 40, mode=got)
    src.append(k, v)
    target = kc.LayerKvCache(2, 40, mode=have)
    target.append(k[:5], v[:5])
    before, raw = snapshot(target), target.to_bytes()
    want, mine = kc.KvMode.parse(got).scheme, kc.KvMode.parse(have).scheme
    with pytest.raises(kc.WireError, match=f"int8 scheme '{want}'.*scheme '{mine}'"):
        target.install_bytes(src.to_bytes())
    assert_same_state(before, snapshot(target))
    assert target.to_bytes() == raw
    f32 = kc.LayerKvCache(2, 40, mode="f32")          # an F32 layer takes either
    f32.install_bytes(src.to_bytes())
    assert f32.mode == kc.KvMode.parse(got) and stored(f32) == stored(src)


def test_the_legacy_wire_layout_refuses_int8_in_either_scheme(rng):
    k, v = data(rng, 10, 2, 8)
    for mode in ("q8", "q8:cmf", "q8v"):
        layer = kc.LayerKvCache(2, 8, mode=mode)
        layer.append(k, v)
        scheme = kc.KvMode.parse(mode).scheme
        with pytest.raises(kc.WireError, match=f"F32 caches only.*int8 scheme '{scheme}'"):
            layer.export_wire()


# ------------------------------------------------------------------------------ old buffers
EXPECTED = np.load(os.path.join(DATA, "expected.npz")) if os.path.isdir(DATA) else None
LAYER_CASES = ["q8_40", "q8_64", "q8_65", "q8_80", "q8k_80", "q8v_80", "q8_evicted", "q8_born",
               "q8k_f16", "f32_30"]


def _read(name):
    with open(os.path.join(DATA, name), "rb") as fh:
        return fh.read()


def _assert_state(layer, prefix, f16=False):
    """The layer holds what the fixture's writer held (its float K/V rows through binary16
    when the buffer was written with f16=True)."""
    e = EXPECTED
    st = layer.state()
    qk, qv = (bool(x) for x in e[f"{prefix}/mode"])
    assert (st.mode.quant_k, st.mode.quant_v) == (qk, qv)
    assert st.mode.scheme == ("cmf" if qk or qv else "")
    assert st.seq_len == int(e[f"{prefix}/seq_len"])
    assert st.lengths.tolist() == e[f"{prefix}/lengths"].tolist()
    for name in ("kf", "kq", "ks", "vf", "vq", "vs"):
        arr = getattr(st, name)
        key = f"{prefix}/{name}"
        assert (arr is None) == (key not in e.files), key
        if arr is not None:
            rows = np.concatenate([arr[h, : int(st.lengths[h])] for h in range(st.num_kv_heads)])
            want = e[key]
            if f16 and name in ("kf", "vf"):
                want = want.astype(np.float16).astype(np.float32)
            assert rows.tobytes() == want.tobytes() and rows.shape == want.shape, key
    for name in ("kcol", "vcol", "kcol_on", "vcol_on", "importance", "linear_state"):
        assert getattr(st, name).tobytes() == e[f"{prefix}/{name}"].tobytes(), name


@pytest.mark.parametrize("case", LAYER_CASES)
def test_version_1_layer_buffers_read_back_as_written(case):
    buf = _read(f"layer_{case}.kvc")
    assert struct.unpack_from("<H", buf, 8)[0] == 1
    quantised = not case.startswith("f32")
    layer = kc.LayerKvCache(2, 40, mode="q8:cmf" if quantised else "f32")
    layer.install_bytes(buf, fingerprint=f"fixture {case}")
    f16 = case.endswith("f16")
    _assert_state(layer, case, f16)
    # written again, the buffer is version 3 with scheme byte 2 ("cmf"; 0 for F32), and
    # otherwise the same bytes
    again = bytearray(layer.to_bytes(f16=f16, fingerprint=f"fixture {case}"))
    fp_len = struct.unpack_from("<I", buf, 24)[0]
    body = 28 + fp_len + (-(28 + fp_len) % 8)
    assert again[8:10] == b"\x03\x00" and again[body + 12] == (2 if quantised else 0)
    again[8:10], again[body + 12] = b"\x01\x00", 0
    again[11] = wire.ALG_CRC32
    again[-8:] = struct.pack("<Q", zlib.crc32(bytes(again[:-8])))
    assert bytes(again) == buf
    # an F32 layer takes it too (the mode comes from the buffer); a rows layer refuses it
    f32 = kc.LayerKvCache(2, 40, mode="f32")
    f32.install_bytes(buf)
    _assert_state(f32, case, f16)
    if quantised:
        rows = kc.LayerKvCache(2, 40, mode="q8")
        with pytest.raises(kc.WireError, match="int8 scheme 'cmf'"):
            rows.install_bytes(buf)
        assert rows.seq_len == 0 and rows.mode == Q8()


def test_a_version_1_model_file_loads_as_written():
    kv = kc.KvCache.load(os.path.join(DATA, "model_q8.kvc"), fingerprint="fixture model")
    assert kv.mode == Q8(scheme="cmf") and len(kv.layers) == 3
    for i, layer in enumerate(kv.layers):
        _assert_state(layer, f"model_q8/{i}")
    # the model keeps appending in its legacy scheme: layer 2 (50 positions) freezes at 64
    rng = np.random.default_rng(0)
    k, v = data(rng, 20, 2, 40)
    kv.layers[2].append(k, v)
    assert kv.layers[2].columns(0)[0] is not None


def test_the_legacy_wire_fixture_still_imports():
    layer = kc.LayerKvCache(2, 40, mode="q8")
    layer.import_wire(_read("legacy_f32.wire"))
    _assert_state(layer, "legacy_f32")
    assert layer.export_wire() == _read("legacy_f32.wire")


def test_prefix_store_entries_written_before_the_scheme_still_load():
    store_data = np.load(os.path.join(DATA, "store_q8.npz"))
    backend = MemoryBackend()
    for i, key in enumerate(store_data["keys"]):
        backend.put(str(key), store_data[f"entry_{i}"].tobytes())
    ids = EXPECTED["store_q8/ids"]
    store = PrefixStore(backend, fingerprint="fixture store", block=80)
    cmf = kc.KvCache(2, 2, 40, mode="q8:cmf")
    assert store.load(ids, cmf) == 160
    for i, layer in enumerate(cmf.layers):
        _assert_state(layer, f"store_q8/{i}")
    rows = kc.KvCache(2, 2, 40, mode="q8")               # other keys: nothing to load
    assert store.longest_prefix(ids, rows) == 0 and store.load(ids, rows) == 0
    assert len(backend) == 2                              # and nothing was deleted


# ------------------------------------------------------------------------------ prefix store
def test_the_store_keeps_the_schemes_apart_and_rows_takes_any_block(rng):
    nl, nkv, hd, b = 2, 2, 8, 16
    ids = np.arange(4 * b)
    k, v = data(rng, 4 * b, nkv, hd)
    backend = MemoryBackend()
    store = PrefixStore(backend, fingerprint="m", block=b)
    rows = kc.KvCache(nl, nkv, hd, mode="q8")
    for layer in rows.layers:
        layer.append(k, v)
    assert store.put(ids, rows) == 4                 # block 16 <= 64 is fine for "rows"
    fresh = kc.KvCache(nl, nkv, hd, mode="q8")
    assert store.load(ids, fresh) == 4 * b
    assert [stored(a) for a in fresh.layers] == [stored(a) for a in rows.layers]
    with pytest.raises(ValueError, match="block > 64"):
        store.load(ids, kc.KvCache(nl, nkv, hd, mode="q8:cmf"))
    big = PrefixStore(backend, fingerprint="m", block=80)
    ids2 = np.arange(160)
    k2, v2 = data(rng, 160, nkv, hd)
    for mode in ("q8", "q8:cmf"):
        kv = kc.KvCache(nl, nkv, hd, mode=mode)
        for layer in kv.layers:
            layer.append(k2, v2)
        assert big.put(ids2, kv) == 2                   # two schemes, two sets of keys
    for mode in ("q8", "q8:cmf"):
        kv = kc.KvCache(nl, nkv, hd, mode=mode)
        assert big.load(ids2, kv) == 160 and kv.mode == kc.KvMode.parse(mode)
        assert any(c is not None for c in kv.layers[0].columns(0)) == (mode == "q8:cmf")


def test_a_rows_entry_claiming_frozen_columns_is_a_miss(rng):
    from kvcache.store import entry as ent
    nl, nkv, hd, b = 1, 2, 8, 16
    ids = np.arange(b)
    k, v = data(rng, b, nkv, hd)
    backend = MemoryBackend()
    store = PrefixStore(backend, fingerprint="m", block=b)
    kv = kc.KvCache(nl, nkv, hd, mode="q8")
    kv.layers[0].append(k, v)
    assert store.put(ids, kv) == 1
    (key,) = backend.keys()
    raw = bytearray(backend.get_many([key])[0])
    assert raw[78] == 1                                   # the scheme byte: "rows"
    raw[ent.HEADER_SIZE] = 1                              # kcol_on[0] of layer 0
    raw[-8:] = struct.pack("<Q", wire.digest(raw[10], np.frombuffer(bytes(raw[:-8]), np.uint8)))
    backend.put(key, bytes(raw))
    fresh = kc.KvCache(nl, nkv, hd, mode="q8")
    assert store.load(ids, fresh) == 0 and fresh.seq_len == 0


# ------------------------------------------------------------------------------ device mirror
def test_a_mirror_carries_the_scheme(rng):
    from kvcache.device import Mirror
    k, v = data(rng, 70, 2, 8)
    for mode in ("q8", "q8:cmf"):
        layer = kc.LayerKvCache(2, 8, mode=mode)
        layer.append(k, v)
        m = Mirror(layer, backend="numpy")
        m.sync()
        assert m.mode == layer.mode
        assert [tuple(c is None for c in m.columns(h)) for h in range(2)] == \
            [tuple(c is None for c in layer.columns(h)) for h in range(2)]
