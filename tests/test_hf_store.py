"""kvcache.hf with a prefix store: ``generate`` started from a stored prompt prefix.

Tiny random models (as in tests/test_hf.py: Llama, Mistral with a sliding window shorter than
the prompt, Gemma-2 with alternating sliding layers and softcaps), loaded with
``attn_implementation="kvcache"``: a prompt is generated once (a miss; its blocks stored with
``store_cache``), then again from ``cache_from_store`` (a hit), and a longer prompt sharing it
(a partial hit).  Every f32 run must give transformers' own greedy tokens (default attention,
no store) and per-step logits within the tolerance of tests/test_hf.py; every q8 run those of
kvcache attention on a q8 cache without the store.
"""

from __future__ import annotations

import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
kh = pytest.importorskip("kvcache.hf")

from kvcache.store import DirectoryBackend, MemoryBackend, PrefixStore  # noqa: E402

from test_hf import _COMMON, _cache, tiny_models  # noqa: E402  (the hf tests' tiny models)

PROMPT, LONGER, NEW, BLOCK = 200, 280, 12, 80     # BLOCK > 64: q8 entries need it
TOL = 1e-4


@pytest.fixture(scope="module", params=["llama", "mistral", "gemma2"])
def fam(request, tmp_path_factory):
    mk, mr, ids, _ = tiny_models(request.param, tmp_path_factory, LONGER,
                                 max_position_embeddings=512)
    return types.SimpleNamespace(name=request.param, mk=mk, mr=mr, ids=ids)


def reference(fam, ids, mode):
    """Greedy tokens and per-step logits without a store: transformers' own attention for
    f32; kvcache attention on a new q8 cache for q8 (int8 rows are not transformers')."""
    with torch.no_grad():
        if mode == "f32":
            out = fam.mr.generate(ids, max_new_tokens=NEW, do_sample=False,
                                  return_dict_in_generate=True, output_logits=True)
        else:
            out = kh.generate(fam.mk, ids, mode=mode, max_new_tokens=NEW, do_sample=False,
                              return_dict_in_generate=True, output_logits=True)
    return out.sequences, torch.stack(out.logits)


def from_store(fam, store, ids, mode):
    cache, n = kh.cache_from_store(store, fam.mk, ids, mode=mode)
    assert cache.get_seq_length() == n
    with torch.no_grad():
        out = kh.generate(fam.mk, ids, cache=cache, max_new_tokens=NEW, do_sample=False,
                          return_dict_in_generate=True, output_logits=True)
    assert cache.get_seq_length() == ids.shape[1] + NEW - 1
    assert not any(kv.track_importance for kv in cache.kv_layers)   # as a cold cache's layers
    return out.sequences, torch.stack(out.logits), n, cache


@pytest.mark.parametrize("mode", ["f32", "q8"])
def test_generate_from_a_stored_prefix_matches_transformers(fam, tmp_path, mode):
    store = PrefixStore(DirectoryBackend(tmp_path), fingerprint=f"tiny-{fam.name}", block=BLOCK)
    prompt, longer = fam.ids[:, :PROMPT], fam.ids
    want_seq, want_logits = reference(fam, prompt, mode)
    # a miss: computed from scratch, then its blocks are stored
    seq, logits, n, cache = from_store(fam, store, prompt, mode)
    assert n == 0 and torch.equal(seq, want_seq)
    assert (logits - want_logits).abs().max().item() <= TOL
    assert kh.store_cache(store, cache, seq[0]) == (PROMPT + NEW - 1) // BLOCK
    # a hit: the stored blocks of the prompt (never its last position) are loaded
    seq, logits, n, _ = from_store(fam, store, prompt, mode)
    assert n == (PROMPT - 1) // BLOCK * BLOCK
    assert torch.equal(seq, want_seq)
    assert (logits - want_logits).abs().max().item() <= TOL
    # a longer prompt sharing it: the blocks the first run stored (its generated tokens
    # differ from this prompt's continuation, so only the prompt's own blocks match)
    want_seq, want_logits = reference(fam, longer, mode)
    seq, logits, n, _ = from_store(fam, store, longer, mode)
    assert n == PROMPT // BLOCK * BLOCK
    assert torch.equal(seq, want_seq)
    assert (logits - want_logits).abs().max().item() <= TOL


def test_another_fingerprint_or_mode_never_hits(fam):
    store = PrefixStore(MemoryBackend(), fingerprint="model-a", block=BLOCK)
    prompt = fam.ids[:, :PROMPT]
    seq, _, _, cache = from_store(fam, store, prompt, "f32")
    assert kh.store_cache(store, cache, seq[0]) > 0
    other = PrefixStore(store.backend, fingerprint="model-b", block=BLOCK)
    assert kh.cache_from_store(other, fam.mk, prompt)[1] == 0
    assert kh.cache_from_store(store, fam.mk, prompt, mode="q8")[1] == 0
    cache, n = kh.cache_from_store(store, fam.mk, prompt.tolist()[0], mode="f32")
    assert n == 160 and cache.get_seq_length() == 160


def test_bad_input_is_refused():
    cfg = transformers.LlamaConfig(**_COMMON, num_hidden_layers=2)
    store = PrefixStore(MemoryBackend(), fingerprint="x", block=BLOCK)
    with pytest.raises(ValueError, match="batch size 1"):
        kh.cache_from_store(store, cfg, torch.zeros((2, 10), dtype=torch.long))
    with pytest.raises(ValueError, match="sequence of token ids"):
        kh.cache_from_store(store, cfg, [])
    cache, n = kh.cache_from_store(store, cfg, [5])
    assert n == 0 and cache.get_seq_length() == 0
    with pytest.raises(TypeError, match="expected a kvcache.store.PrefixStore, got str"):
        kh.cache_from_store("memory", cfg, [5, 6])
    small = PrefixStore(MemoryBackend(), fingerprint="x", block=64)     # q8 "cmf": > 64
    with pytest.raises(ValueError, match="needs block > 64"):
        kh.cache_from_store(small, cfg, [5], mode="q8:cmf")
    assert kh.store_cache(store, cache, [5]) == 0               # nothing held, nothing stored
    with pytest.raises(TypeError, match="HfKvCache"):
        kh.store_cache(store, object(), [5])
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.set_attn_implementation("kvcache")
    cache = kh.HfKvCache(model.config)
    with torch.no_grad():
        model(torch.arange(3, 100).reshape(1, -1), use_cache=True, **_cache(cache))
    with pytest.raises(ValueError, match="holds 97 positions"):
        kh.store_cache(store, cache, np.arange(50))
    assert kh.store_cache(store, cache, np.arange(3, 100)) == 1
    padded = kh.HfKvCache(model.config)            # left padding is not stored: refused
    mask = (torch.arange(97) >= 2).long()[None]
    with torch.no_grad():
        model(torch.arange(3, 100).reshape(1, -1), attention_mask=mask, use_cache=True,
              **_cache(padded))
    with pytest.raises(ValueError, match="starts with 2 padding positions"):
        kh.store_cache(store, padded, np.arange(3, 100))
