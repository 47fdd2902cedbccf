"""KvMode: constructors, environment parsing, immutability, value semantics (API.md "Modes")."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

import kvcache as kc


def test_f32_is_plain_float():
    m = kc.KvMode.F32
    assert m.quant_k is False and m.quant_v is False


@pytest.mark.parametrize("k, v", [(True, True), (True, False), (False, True)])
def test_q8_flags(k, v):
    m = kc.KvMode.Q8(k=k, v=v)
    assert (m.quant_k, m.quant_v) == (k, v)
    assert m != kc.KvMode.F32


def test_q8_defaults_quantise_both():
    m = kc.KvMode.Q8()
    assert m.quant_k and m.quant_v


def test_q8_with_nothing_quantised_is_refused():
    with pytest.raises(ValueError):
        kc.KvMode.Q8(k=False, v=False)


@pytest.mark.parametrize("value, expected", [
    (None, (False, False)),
    ("f32", (False, False)),
    ("q8", (True, True)),
    ("q8k", (True, False)),
    ("q8v", (False, True)),
])
def test_from_env(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("KVCACHE_KV", raising=False)
    else:
        monkeypatch.setenv("KVCACHE_KV", value)
    m = kc.KvMode.from_env()
    assert (m.quant_k, m.quant_v) == expected


@pytest.mark.parametrize("garbage", ["q2", "fp16", "Q8 please", "q8kv", "1"])
def test_from_env_garbage_is_refused(monkeypatch, garbage):
    monkeypatch.setenv("KVCACHE_KV", garbage)
    with pytest.raises(ValueError):
        kc.KvMode.from_env()


@pytest.mark.parametrize("attr", ["quant_k", "quant_v", "anything_new"])
def test_modes_are_immutable(attr):
    m = kc.KvMode.Q8(k=True, v=False)
    with pytest.raises(AttributeError):
        setattr(m, attr, True)
    assert (m.quant_k, m.quant_v) == (True, False)


def test_shared_f32_constant_cannot_be_mutated():
    with pytest.raises(AttributeError):
        kc.KvMode.F32.quant_k = True
    assert kc.KvMode.F32.quant_k is False


def test_equality_and_hashing_by_value():
    a, b = kc.KvMode.Q8(k=True, v=False), kc.KvMode.Q8(k=True, v=False)
    assert a is not b
    assert a == b and hash(a) == hash(b)
    assert len({a, b, kc.KvMode.Q8(), kc.KvMode.F32, kc.KvMode.Q8(False, True)}) == 4
    assert kc.KvMode.Q8() != kc.KvMode.Q8(k=False, v=True)
    assert kc.KvMode.F32 != "f32"
    table = {kc.KvMode.Q8(): "both"}
    assert table[kc.KvMode.Q8(True, True)] == "both"


@pytest.mark.parametrize("m", [kc.KvMode.F32, kc.KvMode.Q8(), kc.KvMode.Q8(False, True)])
def test_copy_and_pickle_keep_the_value(m):
    assert copy.deepcopy(m) == m
    assert pickle.loads(pickle.dumps(m)) == m


@pytest.mark.parametrize("value, expected", [
    (None, kc.KvMode.F32),
    ("q8", kc.KvMode.Q8()),
    ("q8k", kc.KvMode.Q8(k=True, v=False)),
    ("q8v", kc.KvMode.Q8(k=False, v=True)),
])
def test_layer_without_mode_reads_env(monkeypatch, value, expected):
    if value is not None:
        monkeypatch.setenv("KVCACHE_KV", value)
    layer = kc.LayerKvCache(2, 8, mode=None)
    assert layer.mode == expected
    # the mode is what the layer actually stores: int8 components show empty f32 views
    layer.append(np.ones((2, 8)), np.ones((2, 8)))
    assert layer.head_keys(0).shape == ((0, 8) if expected.quant_k else (1, 8))
    assert layer.head_values(0).shape == ((0, 8) if expected.quant_v else (1, 8))


def test_layer_without_mode_refuses_garbage_env(monkeypatch):
    monkeypatch.setenv("KVCACHE_KV", "int4")
    with pytest.raises(ValueError):
        kc.LayerKvCache(2, 8)


def test_explicit_mode_ignores_env(monkeypatch):
    monkeypatch.setenv("KVCACHE_KV", "q8")
    assert kc.LayerKvCache(1, 4, mode=kc.KvMode.F32).mode == kc.KvMode.F32


def test_parse_reads_the_same_names_as_the_environment(monkeypatch):
    for name, mode in (("f32", kc.KvMode.F32), ("Float32", kc.KvMode.F32),
                       (" q8 ", kc.KvMode.Q8()), ("q8k", kc.KvMode.Q8(True, False)),
                       ("Q8V", kc.KvMode.Q8(False, True))):
        assert kc.KvMode.parse(name) == mode
        monkeypatch.setenv("KVCACHE_KV", name)
        assert kc.KvMode.from_env() == mode
    mode = kc.KvMode.Q8(True, False)
    assert kc.KvMode.parse(mode) is mode
    with pytest.raises(ValueError, match="kv: expected one of 'f32', 'q8', 'q8k', 'q8v', "
                                         "'q8:cmf', 'q8k:cmf', 'q8v:cmf'"):
        kc.KvMode.parse("q2", "kv")
    with pytest.raises(ValueError, match="expected one of 'f32'"):
        kc.KvMode.parse("")                       # empty means f32 only in the environment
    with pytest.raises(TypeError, match="mode: expected a KvMode"):
        kc.KvMode.parse(8)


@pytest.mark.parametrize("name, mode", [("q8", kc.KvMode.Q8()), ("F32", kc.KvMode.F32),
                                        ("q8v", kc.KvMode.Q8(False, True))])
def test_every_cache_takes_a_mode_name(name, mode):
    assert kc.LayerKvCache(2, 4, mode=name).mode == mode
    assert kc.KvCache(2, 2, 4, 16, mode=name).mode == mode
    assert all(layer.mode == mode for layer in kc.KvCache(2, 2, 4, 16, mode=name).layers)


def test_a_bad_mode_name_names_the_parameter():
    with pytest.raises(ValueError, match="mode: expected one of 'f32'"):
        kc.LayerKvCache(2, 4, mode="q2")
    with pytest.raises(TypeError, match="mode: expected a KvMode"):
        kc.KvCache(2, 2, 4, 16, mode=8)
