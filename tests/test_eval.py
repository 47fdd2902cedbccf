"""``python -m kvcache eval`` (kvcache.evaluate) on a small random-weight checkpoint folder."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvcache.evaluate import (EvalConfig, evaluate, main, parse_config,  # noqa: E402
                              split_configs)
from kvcache.o1 import RIDGE
from kvcache.runner import ModelConfig, Runner
from kvcache.runner.model import O1_AUTO_PARAMS
from kvcache.runner.weights import random_weights

tokenizers = pytest.importorskip("tokenizers")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

CONFIG = {"model_type": "llama", "vocab_size": 300, "hidden_size": 128,
          "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 32, "rope_theta": 10000.0,
          "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
TEXT = ("The licenses for most software and other practical works are designed to take away "
        "your freedom to share and change the works. ") * 8


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A random Llama checkpoint folder with a byte-level tokenizer (256 byte tokens)."""
    path = tmp_path_factory.mktemp("evalmodel")
    cfg = ModelConfig.from_hf(CONFIG)
    rng = np.random.default_rng(3)
    w = random_weights(cfg, seed=3)
    # larger q/k weights than random_weights' 0.02 give attention with some contrast, so that
    # q8 and O(1) move the logits measurably
    for k in w:
        if ".q_proj." in k or ".k_proj." in k:
            w[k] = (rng.standard_normal(w[k].shape) * 0.3).astype(np.float32)
    safetensors_numpy.save_file(w, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(CONFIG))
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from kvcache.runner.gguf import _bytes_to_unicode
    table = _bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={table[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(path / "tokenizer.json"))
    (path / "text.txt").write_text(TEXT)
    return path


def test_config_names_parse():
    assert parse_config("f32") == EvalConfig("f32")
    assert parse_config("q8").kv == "q8"
    c = parse_config("o1:deep2:m=8,sink=2")
    assert (c.kv, c.o1_layers, c.o1_params) == ("f32", "deep2", (8, 128, 2, 0, RIDGE))
    c = parse_config("o1:all:keep=64,ridge=1e-3,max_error=0.2")
    assert c.o1_params == (32, 128, 4, 64, 1e-3) and c.o1_max_error == 0.2
    assert parse_config("o1:all").o1_params is None         # the runner's own defaults
    c = parse_config("o1:auto:max_error=0.15")
    assert c.o1_params is None and c.runner_kwargs()["o1_max_error"] == 0.15
    assert parse_config("o1:auto:w=256").o1_params == (O1_AUTO_PARAMS[:1] + (256,)
                                                       + O1_AUTO_PARAMS[2:])
    assert parse_config("o1:1+3").o1_layers == "1,3"
    assert parse_config("o1:auto").runner_kwargs()["o1_layers"] == "auto"
    for bad in ("q9", "o1:", "o1:all:m=x", "o1:all:q=3", "o1:a:b:c", "o1:all:keep=1.5",
                "o1:all:ridge=x", "o1:all:max_error=-"):
        with pytest.raises(ValueError):
            parse_config(bad)
    assert split_configs("f32,q8,o1:deep15:m=64,w=256,sink=4,o1:0,3,5:m=16,o1:all") == [
        "f32", "q8", "o1:deep15:m=64,w=256,sink=4", "o1:0+3+5:m=16", "o1:all"]
    assert split_configs("o1:deep15:keep=128,ridge=1e-3,max_error=0.1,q8") == [
        "o1:deep15:keep=128,ridge=1e-3,max_error=0.1", "q8"]


def _ids(folder):
    from kvcache.evaluate import _encode_text
    return _encode_text(str(folder), str(folder / "text.txt"))


def test_scores_are_teacher_forced_log_likelihoods(folder):
    """f32's perplexity equals the one computed from one all-logits prefill of the text (the
    first scored token predicted by the prompt's last position)."""
    ids = _ids(folder)
    P, N = 40, 30
    (res,) = evaluate(folder, ids, ["f32"], prompt_tokens=P, tokens=N, progress=False)
    logits = Runner.from_pretrained(folder).prefill(np.array(ids[: P + N]), all_logits=True)
    lp = logits.astype(np.float64)
    lp = lp - lp.max(axis=1, keepdims=True)
    lp = lp - np.log(np.exp(lp).sum(axis=1, keepdims=True))
    nll = -lp[np.arange(P - 1, P + N - 1), ids[P: P + N]]
    np.testing.assert_allclose(res.perplexity, np.exp(nll.mean()), rtol=1e-4)
    assert res.ratio == 1.0 and res.mean_kl == 0.0 and res.top1 == 1.0
    assert res.kv_bytes == 4 * 2 * 2 * 32 * 4 * (P + N - 1)     # f32 K and V, every layer


def test_modes_and_o1_against_f32(folder):
    ids = _ids(folder)
    res = evaluate(folder, ids, ["q8", "o1:all:m=4,w=4,sink=1", "o1:1+2", "o1:auto"],
                   prompt_tokens=64, tokens=24, progress=False)
    names = [r.name for r in res]
    assert names == ["f32", "q8", "o1:all:m=4,w=4,sink=1", "o1:1+2", "o1:auto"]
    f32, q8, o1, o1b, auto = res
    assert q8.error is None and 0 < q8.mean_kl <= q8.max_kl
    assert q8.kv_bytes < f32.kv_bytes / 2
    assert np.isclose(q8.ratio, q8.perplexity / f32.perplexity)
    assert 0.0 <= q8.top1 <= 1.0
    assert o1.o1_sealed == [0, 1, 2, 3] and o1.mean_kl > q8.mean_kl
    assert o1.kv_bytes < f32.kv_bytes
    assert o1b.o1_sealed == [1, 2]
    for r in (f32, q8, o1, o1b):
        assert r.decode_tok_s > 0 and np.isfinite(r.perplexity)
    # o1_layers="auto" is the runner's to accept; when it refuses, the row carries its error
    assert auto.error is None or "auto" in auto.error


def test_eval_command_prints_a_table_and_writes_json(folder, tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = main(["--model", str(folder), "--text", str(folder / "text.txt"), "--tokens", "8",
               "--prompt-tokens", "0", "--configs", "q8", "--json", str(out), "--no-progress"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "perplexity" in text and "q8" in text and "f32" in text
    doc = json.loads(out.read_text())
    assert doc["prompt_tokens"] == 1 and doc["tokens"] == 8
    assert [r["name"] for r in doc["results"]] == ["f32", "q8"]


def test_eval_command_refuses_bad_input(folder, capsys):
    base = ["--model", str(folder), "--text", str(folder / "text.txt"), "--no-progress"]
    with pytest.raises(SystemExit):
        main(base + ["--configs", "q9"])
    assert "q9" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(base + ["--tokens", "0"])
    assert main(base + ["--tokens", "100000"]) == 1
    assert "the text has" in capsys.readouterr().err
