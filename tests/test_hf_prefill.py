"""kvcache.hf.prefill: a long prompt fed to ``model(...)`` in steps, against one-shot prefill.

Tiny random models of tests/test_hf.py (Llama, Mistral with a window of 8, Gemma-2 with
sliding layers and softcaps) loaded with ``attn_implementation="kvcache"``: the last
position's logits of a stepped prefill must match a one-shot ``model(ids)`` on a kvcache cache
within the tolerance of tests/test_hf.py, in f32 and q8, and the cached rows must match (the
first layer's K/V rows bit for bit in f32: they come from the embeddings through one product,
row by row); ``generate(..., prefill_step=)`` gives the same tokens; a cache continued from a
partial prefill gives the same logits; bad input is refused.
"""

from __future__ import annotations

import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
kh = pytest.importorskip("kvcache.hf")

from test_hf import TOL, _cache, tiny_models  # noqa: E402  (the hf tests' tiny models)

N = 300


@pytest.fixture(scope="module", params=["llama", "mistral", "gemma2"])
def fam(request, tmp_path_factory):
    mk, mr, ids, _ = tiny_models(request.param, tmp_path_factory, N,
                                 max_position_embeddings=512)
    return types.SimpleNamespace(name=request.param, mk=mk, mr=mr, ids=ids)


def one_shot(model, ids, mode):
    cache = kh.HfKvCache(model.config, mode=mode)
    with torch.no_grad():
        logits = model(ids, use_cache=True, **_cache(cache)).logits[0, -1]
    return logits, cache


def rows(cache):
    out = []
    for kv in cache.kv_layers:
        out.append([(kv.head_keys(h), kv.head_values(h)) for h in range(kv.num_kv_heads)])
    return out


@pytest.mark.parametrize("mode", ["f32", "q8", "q8:cmf"])
def test_stepped_prefill_matches_one_shot(fam, mode):
    want, whole = one_shot(fam.mk, fam.ids, mode)
    calls = []
    hook = fam.mk.register_forward_pre_hook(
        lambda mod, args, kw: calls.append(kw["input_ids"].shape[1]), with_kwargs=True)
    try:
        got, cache = kh.prefill(fam.mk, fam.ids, mode=mode, step=64)
    finally:
        hook.remove()
    # q8:cmf: the first step runs past position 64 (the column freeze), as one shot does;
    # the default q8 scheme "rows" has no freeze and steps as f32 does
    assert calls == ([128, 64, 64, 44] if mode == "q8:cmf" else [64, 64, 64, 64, 44])
    assert got.shape == (want.shape[0],) and got.dtype == torch.float32
    assert (got - want).abs().max().item() < TOL
    assert cache.get_seq_length() == whole.get_seq_length() == N
    for li, (a, b) in enumerate(zip(rows(cache), rows(whole))):
        for (ka, va), (kb, vb) in zip(a, b):
            np.testing.assert_allclose(ka, kb, rtol=0, atol=1e-5)
            np.testing.assert_allclose(va, vb, rtol=0, atol=1e-5)
            if li == 0 and mode == "f32":
                assert np.array_equal(ka, kb) and np.array_equal(va, vb)
    if mode == "f32":                     # and transformers' own attention, one shot
        with torch.no_grad():
            ref = fam.mr(fam.ids).logits[0, -1]
        assert (got - ref).abs().max().item() < TOL


def test_a_partial_prefill_continues(fam):
    want, _ = kh.prefill(fam.mk, fam.ids, step=100)
    _, cache = kh.prefill(fam.mk, fam.ids[:, :130], step=100)
    got, cache = kh.prefill(fam.mk, fam.ids, cache=cache, step=100)
    assert cache.get_seq_length() == N
    assert (got - want).abs().max().item() < TOL


def test_generate_with_a_prefill_step_gives_the_same_tokens(fam):
    plain = kh.generate(fam.mk, fam.ids, max_new_tokens=6, do_sample=False)
    cache = kh.HfKvCache(fam.mk.config)
    stepped = kh.generate(fam.mk, fam.ids, max_new_tokens=6, do_sample=False, cache=cache,
                          prefill_step=64)
    assert torch.equal(plain, stepped)
    assert cache.get_seq_length() == N + 5


def test_bad_input_is_refused(fam):
    with pytest.raises(ValueError, match="step: expected a positive integer"):
        kh.prefill(fam.mk, fam.ids, step=0)
    with pytest.raises(ValueError, match="prefill_step"):
        kh.generate(fam.mk, fam.ids, max_new_tokens=2, prefill_step=-3)
    _, cache = kh.prefill(fam.mk, fam.ids[:, :50])
    with pytest.raises(ValueError, match="nothing left to compute"):
        kh.prefill(fam.mk, fam.ids[:, :50], cache=cache)
    assert cache.get_seq_length() == 50
    with pytest.raises(TypeError, match="HfKvCache"):
        kh.prefill(fam.mk, fam.ids, cache=object())
    with pytest.raises(ValueError, match="attn_implementation"):
        kh.prefill(fam.mr, fam.ids)
