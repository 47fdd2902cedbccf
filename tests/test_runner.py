"""kvcache.runner against Hugging Face transformers, and the generate command.

For each family a tiny random model is created by transformers (norm weights and biases
perturbed so that they matter), saved with ``save_pretrained`` and loaded by the runner; the
prompt logits and 32 greedy decode steps must match transformers' own logits to 1e-4 (max
absolute difference, float32) with identical greedy tokens.  transformers' ``generate`` runs
with its end-of-sequence token disabled, so that both sides decode exactly 32 raw argmaxes.
"""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import numpy as np
import pytest

import kvcache.__main__ as cli
from kvcache import runner as kr

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

TOL = 1e-4
PROMPT, STEPS = 20, 32
COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
CASES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(rope_scaling=LLAMA3, rope_theta=5e5)),
    "llama-linear": ("LlamaConfig", "LlamaForCausalLM",
                     dict(rope_scaling={"rope_type": "linear", "factor": 4.0},
                          tie_word_embeddings=True)),
    "mistral-window8": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1e6)),
    "gemma2-window8": ("Gemma2Config", "Gemma2ForCausalLM",
                       dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
                            attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                            attn_implementation="eager")),
    # q/k norms, head_dim apart from hidden / heads, no biases
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, rope_theta=1e6)),
    # q/k norms, sliding layers in a pattern, a local RoPE base of its own, linear scaling on
    # the global layers only, query_pre_attn_scalar, a final softcap
    "gemma3-window8": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                       dict(head_dim=16, sliding_window=8, sliding_window_pattern=2,
                            query_pre_attn_scalar=24, rope_local_base_freq=100.0,
                            rope_scaling={"rope_type": "linear", "factor": 4.0},
                            final_logit_softcapping=3.0)),
}


def make_hf_model(case, seed=0):
    cfg_name, model_name, extra = CASES[case]
    torch.manual_seed(seed)
    kw = dict(COMMON)
    kw.update(json.loads(json.dumps(extra)))     # transformers edits the dicts it is given
    impl = kw.pop("attn_implementation", None)
    cfg = getattr(tf, cfg_name)(**kw)
    if impl:
        cfg._attn_implementation = impl
    model = getattr(tf, model_name)(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif "embed" in name or "lm_head" in name:
                p.normal_(0.0, 1.0)          # logits of order 1: greedy ties are unlikely
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """case -> (transformers model, checkpoint folder), built once per module."""
    cache = {}

    def get(case):
        if case not in cache:
            model = make_hf_model(case)
            path = tmp_path_factory.mktemp(case)
            model.save_pretrained(path)
            cache[case] = (model, path)
        return cache[case]
    return get


def hf_greedy(model, ids):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=STEPS, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[0, len(ids):].tolist()
    return tokens, [lg[0].numpy() for lg in out.logits]


def prompt_ids(seed=1, n=PROMPT):
    return np.random.default_rng(seed).integers(0, COMMON["vocab_size"], n).tolist()


@pytest.mark.parametrize("case", list(CASES))
def test_prompt_logits_and_greedy_decode_match_transformers(saved, case):
    model, path = saved(case)
    ids = prompt_ids()
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
    r = kr.Runner.from_pretrained(path)
    got = r.prefill(ids, all_logits=True)
    assert got.shape == want.shape
    prompt_err = float(np.abs(got - want).max())
    assert prompt_err <= TOL, prompt_err
    tokens, logits = hf_greedy(model, ids)
    r.reset()
    lg = r.prefill(ids)
    step_err = 0.0
    mine = []
    for t in range(STEPS):
        step_err = max(step_err, float(np.abs(lg - logits[t]).max()))
        mine.append(int(np.argmax(lg)))
        lg = r.step(tokens[t])
    assert step_err <= TOL, step_err
    assert mine == tokens
    r.reset()
    assert r.generate(ids, STEPS, stop=()) == tokens
    print(f"{case}: prompt max |diff| {prompt_err:.2e}, decode max |diff| {step_err:.2e}")


def test_the_runner_does_no_importance_work_and_gets_the_same_bits(saved):
    """The runner never evicts, so its cache tracks no importance (the prompt kernel skips its
    importance pass); tracking it would change no logit."""
    _, path = saved("llama")
    ids = prompt_ids(n=90)
    r = kr.Runner.from_pretrained(path)
    assert not r.cache.track_importance
    got = r.prefill(ids, all_logits=True)
    assert not any(layer.importance.any() for layer in r.cache.layers)
    r.reset()
    assert not r.cache.track_importance
    r.cache.track_importance = True
    want = r.prefill(ids, all_logits=True)
    assert all(layer.importance.any() for layer in r.cache.layers)
    assert got.tobytes() == want.tobytes()


def test_windows_really_bind(saved):
    """The sliding-window cases are only evidence if the prompt outruns the window and the
    window changes the answer: without it the logits move far beyond the tolerance."""
    for case in ("mistral-window8", "gemma2-window8"):
        model, path = saved(case)
        ids = prompt_ids()
        assert len(ids) > model.config.sliding_window
        r = kr.Runner.from_pretrained(path)
        assert any(w == 8 for w in r.config.layer_windows)
        if case.startswith("gemma2"):
            assert r.config.layer_windows[0] == 8 and r.config.layer_windows[1] is None
        with_w = r.prefill(ids, all_logits=True)
        r2 = kr.Runner.from_pretrained(path)
        r2.config = replace(r2.config, layer_windows=(None,) * r2.config.num_layers)
        without = r2.prefill(ids, all_logits=True)
        assert np.abs(with_w - without).max() > 100 * TOL


def test_q8_agrees_with_f32(saved):
    """KV in int8: top-1 agreement and KL divergence against f32 over the prompt and 32 steps
    of f32's greedy continuation (teacher forced), per family."""
    report = {}
    for case in CASES:
        _, path = saved(case)
        ids = prompt_ids(seed=2, n=48)
        f32, q8 = (kr.Runner.from_pretrained(path, kv=kv) for kv in ("f32", "q8"))
        a, b = f32.prefill(ids, all_logits=True), q8.prefill(ids, all_logits=True)
        rows_a, rows_b = list(a), list(b)
        tok = int(np.argmax(a[-1]))
        for _ in range(STEPS):
            la, lb = f32.step(tok), q8.step(tok)
            rows_a.append(la)
            rows_b.append(lb)
            tok = int(np.argmax(la))
        A, B = np.array(rows_a, np.float64), np.array(rows_b, np.float64)
        top1 = float(np.mean(A.argmax(1) == B.argmax(1)))
        pa = np.exp(A - A.max(1, keepdims=True))
        pa /= pa.sum(1, keepdims=True)
        lpb = B - B.max(1, keepdims=True)
        lpb -= np.log(np.exp(lpb).sum(1, keepdims=True))
        kl = float(np.mean(np.sum(pa * (np.log(pa) - lpb), axis=1)))
        report[case] = (top1, kl)
        assert not np.array_equal(A, B)                       # int8 storage was really used
        assert top1 >= 0.9 and kl < 1e-2, (case, top1, kl)
    print("q8 vs f32 (top-1 agreement, mean KL):",
          {k: (round(t, 3), f"{kl:.1e}") for k, (t, kl) in report.items()})


def test_rollback_then_redecode_is_bit_identical(saved):
    _, path = saved("qwen2")
    r = kr.Runner.from_pretrained(path, kv="q8")
    ids = prompt_ids()
    r.prefill(ids)
    first = [r.step(t) for t in (5, 6, 7)]
    r.truncate_last(2)                              # reject the last two drafts
    assert r.position == PROMPT + 1 and r.cache.seq_len == PROMPT + 1
    again = [r.step(t) for t in (6, 7)]
    np.testing.assert_array_equal(first[1], again[0])
    np.testing.assert_array_equal(first[2], again[1])
    r.truncate_last(10**6)
    assert r.position == 0
    r.prefill(ids)
    with pytest.warns(DeprecationWarning,
                      match=r"^kvcache\.runner\.Runner\.rollback\(\) is deprecated; use truncate_last"):
        r.rollback(3)                               # the old name, for one release
    assert r.position == PROMPT - 3 and r.cache.seq_len == PROMPT - 3


def test_sharded_bf16_checkpoint_and_4x_config_layout(saved, tmp_path):
    model, _ = saved("llama")
    ids = prompt_ids()
    shard = tmp_path / "sharded"
    model.save_pretrained(shard, max_shard_size="60KB")
    assert (shard / "model.safetensors.index.json").exists()
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
    r = kr.Runner.from_pretrained(shard)
    assert np.abs(r.prefill(ids, all_logits=True) - want).max() <= TOL
    # the same config in transformers 4.x's layout reads to the same ModelConfig
    cfg = json.loads((shard / "config.json").read_text())
    old = json.loads(json.dumps(cfg))
    rope = old.pop("rope_parameters")
    old["rope_theta"] = rope.pop("rope_theta")
    old["rope_scaling"] = rope
    assert kr.ModelConfig.from_hf(old) == kr.ModelConfig.from_hf(cfg)
    # a bfloat16 checkpoint loads (to float32) and stays close
    bf = tmp_path / "bf16"
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(bf)   # the shared model stays f32
    got = kr.Runner.from_pretrained(bf).prefill(ids, all_logits=True)
    assert np.abs(got - want).max() < 0.1 * np.abs(want).max()


def test_o1_layers_seal_and_decode(saved):
    _, path = saved("llama")
    ids = prompt_ids(seed=3, n=64)
    exact = kr.Runner.from_pretrained(path)
    o1 = kr.Runner.from_pretrained(path, kv="q8", o1_layers="deep2", o1_params=(4, 8, 2))
    assert o1.o1_layers == (1, 2)
    a, b = exact.prefill(ids), o1.prefill(ids)
    np.testing.assert_allclose(a, b, atol=0.05 * np.abs(a).max())   # q8 layer 0 only
    assert all(o1.cache.layers[i].o1_sealed() for i in (1, 2))
    mem = o1.memory_bytes()
    agree = 0
    for _ in range(16):
        la, lb = exact.step(int(np.argmax(a))), o1.step(int(np.argmax(a)))
        agree += int(np.argmax(la) == np.argmax(lb))
        a = la
    assert agree >= 12
    sealed_bytes = [o1.cache.layers[i].memory_bytes() for i in (1, 2)]
    o1.step(3)
    assert [o1.cache.layers[i].memory_bytes() for i in (1, 2)] == sealed_bytes  # constant
    assert o1.memory_bytes() > mem - 1                          # layer 0 still grows
    with pytest.raises(RuntimeError, match="sealed"):
        o1.truncate_last(1)
    with pytest.raises(ValueError, match="one position per call"):
        o1.forward([1, 2])


def test_o1_refuses_sliding_layers(saved):
    _, path = saved("gemma2-window8")
    with pytest.raises(ValueError, match="sliding window"):
        kr.Runner.from_pretrained(path, o1_layers="0,1")        # "0" alone means none
    assert kr.Runner.from_pretrained(path, o1_layers="1").o1_layers == (1,)


# ------------------------------------------------------------------------------ sampling
def test_sampling_is_seeded_and_follows_top_p():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    rng = np.random.default_rng(0)
    draws = np.array([kr.sample(logits, 1.0, 1.0, rng) for _ in range(20000)])
    freq = np.bincount(draws, minlength=4) / draws.size
    np.testing.assert_allclose(freq, [0.5, 0.3, 0.15, 0.05], atol=0.015)
    draws = np.array([kr.sample(logits, 1.0, 0.75, rng) for _ in range(20000)])
    freq = np.bincount(draws, minlength=4) / draws.size         # nucleus {0, 1}: 0.5+0.3
    np.testing.assert_allclose(freq, [0.625, 0.375, 0, 0], atol=0.015)
    assert kr.sample(logits, 0.0) == 0
    assert all(kr.sample(logits, 1.0, 1e-9, rng) == 0 for _ in range(50))
    r = kr.Runner.random()
    a = r.generate([1, 2, 3], 12, temperature=0.8, top_p=0.9, seed=7)
    r.reset()
    assert r.generate([1, 2, 3], 12, temperature=0.8, top_p=0.9, seed=7) == a


def test_bad_input_is_refused(saved, tmp_path):
    r = kr.Runner.random()
    for bad, match in (([], "non-empty"), ([600], r"\[0, 512\)"), ([[1, 2]], "1-D"),
                       ([-1], r"\[0, 512\)"), ([2 ** 70], "64-bit")):
        with pytest.raises(ValueError, match=match):
            r.forward(bad)
    for bad in ([1.5], "hello", [True]):          # not integers: the store's TypeError too
        with pytest.raises(TypeError, match="token ids"):
            r.forward(bad)
    assert r.position == 0 and r.cache.seq_len == 0
    with pytest.raises(ValueError, match="top_p"):
        r.generate([1], 3, top_p=0)
    with pytest.raises(ValueError, match="kv"):
        kr.Runner.random(kv="int4")
    with pytest.raises(ValueError, match="o1 layers"):
        kr.Runner.random(o1_layers="two")
    r.prefill([1, 2])
    with pytest.raises(ValueError, match="already holds"):
        r.prefill([1, 2])
    small = kr.Runner.random(max_seq_len=4)
    with pytest.raises(ValueError, match="max_seq_len"):
        small.forward([1, 2, 3, 4, 5])
    _, path = saved("llama")
    cfg = json.loads((path / "config.json").read_text())
    with pytest.raises(ValueError, match="model_type"):
        kr.ModelConfig.from_hf(dict(cfg, model_type="gpt2"))
    with pytest.raises(ValueError, match="rope type"):
        kr.ModelConfig.from_hf(dict(cfg, rope_parameters={"rope_type": "yarn", "factor": 2.0}))
    weights = kr.load_safetensors(path)
    del weights["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(KeyError, match="up_proj"):
        kr.Runner(kr.ModelConfig.from_hf(cfg), weights)
    with pytest.raises(FileNotFoundError):
        kr.load_safetensors(tmp_path)


def test_checkpoint_tokenizer_of_a_folder(tmp_path):
    """A folder without tokenizer.json has none; an unreadable one is a ValueError naming it."""
    assert kr.load_checkpoint_tokenizer(tmp_path) is None
    assert kr.load_checkpoint_tokenizer(None) is None
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json: not a readable tokenizer"):
        kr.load_checkpoint_tokenizer(tmp_path)


def test_a_missing_checkpoint_is_named_as_given(tmp_path):
    """A mistyped file name is reported as itself, not as a missing x.gguf/config.json."""
    for missing in (tmp_path / "model.gguf", tmp_path / "folder"):
        with pytest.raises(FileNotFoundError) as info:
            kr.Runner.from_pretrained(missing)
        assert info.value.filename == str(missing)
        assert "GGUF file" in str(info.value)
        for load in (kr.load_checkpoint, kr.load_checkpoint_tokenizer):
            with pytest.raises(FileNotFoundError) as info:
                load(missing)
            assert info.value.filename == str(missing)


def test_parse_layers():
    assert kr.parse_layers("all", 4) == (0, 1, 2, 3)
    assert kr.parse_layers("deep2", 4) == (2, 3)
    assert kr.parse_layers("deep9", 4) == (0, 1, 2, 3)
    assert kr.parse_layers("3, 1, 9", 4) == (1, 3)
    for none in ("", "off", "0", "none", None):
        assert kr.parse_layers(none, 4) == ()
    assert kr.parse_layers([2, 0], 4) == (0, 2)


# ------------------------------------------------------------------------------ command line
def test_generate_command_runs_without_a_model(capsys):
    assert cli.main(["generate", "--max-new-tokens", "5", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "embedded random-weight Llama" in out and "tokens/s" in out
    assert "cache memory" in out and "attention share" in out


@pytest.mark.parametrize("n", ["0", "1", "2"])
def test_generate_command_takes_the_blas_control(capsys, n):
    argv = ["generate", "--max-new-tokens", "3", "--no-progress", "--blas-threads", n]
    assert cli.main(argv) == 0
    assert "tokens/s" in capsys.readouterr().out


def test_generate_command_refuses_a_negative_blas_control(capsys):
    with pytest.raises(SystemExit):
        cli.main(["generate", "--blas-threads", "-1"])
    assert "--blas-threads must be >= 0" in capsys.readouterr().err


def test_generate_command_with_a_checkpoint_and_tokenizer(saved, capsys, tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    _, path = saved("qwen2")
    folder = tmp_path / "with_tok"
    folder.mkdir()
    for f in path.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    vocab = {f"w{i}": i for i in range(128)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.decoder = tokenizers.decoders.WordPiece()
    tok.save(str(folder / "tokenizer.json"))
    argv = ["generate", "--model", str(folder), "--prompt", "w5 w17 w99", "--max-new-tokens",
            "6", "--kv", "q8", "--no-progress"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "prompt (3 tokens): 'w5 w17 w99'" in out and "output (6 tokens): 'w" in out
    argv = ["generate", "--model", str(path), "--ids", "5,17", "99", "--max-new-tokens", "4",
            "--no-progress"]
    assert cli.main(argv) == 0
    assert "prompt (3 tokens): [5, 17, 99]" in capsys.readouterr().out
    assert cli.main(["generate", "--model", str(tmp_path / "nope"), "--no-progress"]) == 1
    with pytest.raises(SystemExit):
        cli.main(["generate", "--model", str(path), "--prompt", "hi", "--no-progress"])
    assert "tokenizer.json" in capsys.readouterr().err


# ------------------------------------------------------------------------------ review fixes
VARIANTS = {
    "llama-biases": ("LlamaConfig", "LlamaForCausalLM", dict(attention_bias=True, mlp_bias=True)),
    "gemma2-bias": ("Gemma2Config", "Gemma2ForCausalLM",
                    dict(head_dim=16, attention_bias=True, attn_implementation="eager")),
    "qwen2-window": ("Qwen2Config", "Qwen2ForCausalLM",
                     dict(use_sliding_window=True, sliding_window=6, max_window_layers=1)),
    "qwen3-bias-window": ("Qwen3Config", "Qwen3ForCausalLM",
                          dict(head_dim=8, attention_bias=True, use_sliding_window=True,
                               sliding_window=6, max_window_layers=1)),
    # a window longer than the prompt: the sliding layers still take the local RoPE base
    "gemma3-wide-window": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                         dict(head_dim=16, sliding_window=64, sliding_window_pattern=3,
                              rope_local_base_freq=50.0, attention_bias=True,
                              tie_word_embeddings=False)),
}


@pytest.mark.parametrize("case", list(VARIANTS))
def test_biases_and_windows_of_every_kind_match(tmp_path, case, monkeypatch):
    monkeypatch.setitem(CASES, case, VARIANTS[case])
    model = make_hf_model(case)
    model.save_pretrained(tmp_path)
    ids = prompt_ids()
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
    got = kr.Runner.from_pretrained(tmp_path).prefill(ids, all_logits=True)
    assert np.abs(got - want).max() <= TOL


def _config_case(saved, case, edit):
    """Prompt logits of transformers and of the runner after ``edit`` rewrote config.json
    (keys left out or renamed as older files have them)."""
    model, path = saved(case)
    ids = prompt_ids()
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
    cfg = json.loads((path / "config.json").read_text())
    return want, kr.ModelConfig.from_hf(edit(cfg)), kr.load_safetensors(path), ids


def test_missing_keys_take_the_family_defaults(saved):
    # a Gemma-2 file without its activation and final softcap keys: transformers' defaults
    # are gelu_pytorch_tanh and 30.0, which differ from this model's 3.0 -- so compare configs
    want, cfg, _, _ = _config_case(saved, "gemma2-window8", lambda c: {
        k: v for k, v in c.items() if k not in ("hidden_activation", "final_logit_softcapping",
                                                "hidden_act")})
    assert cfg.hidden_act == "gelu_pytorch_tanh" and cfg.final_softcap == 30.0
    # Qwen2 says attention_bias false but its q/k/v projections always carry biases
    want, cfg, w, ids = _config_case(saved, "qwen2", lambda c: dict(c, attention_bias=False))
    got = kr.Runner(cfg, w).prefill(ids, all_logits=True)
    assert cfg.qkv_bias and np.abs(got - want).max() <= TOL
    # a stray sliding_window key in a Llama file is ignored, as transformers ignores it
    want, cfg, w, ids = _config_case(saved, "llama", lambda c: dict(c, sliding_window=4))
    assert cfg.layer_windows == (None,) * 3
    assert np.abs(kr.Runner(cfg, w).prefill(ids, all_logits=True) - want).max() <= TOL
    # transformers 4.x's older rope_scaling key "type"
    want, cfg, w, ids = _config_case(saved, "llama-linear", lambda c: dict(
        {k: v for k, v in c.items() if k != "rope_parameters"},
        rope_theta=c["rope_parameters"]["rope_theta"],
        rope_scaling={"type": "linear", "factor": c["rope_parameters"]["factor"]}))
    assert cfg.rope_scaling["rope_type"] == "linear"
    assert np.abs(kr.Runner(cfg, w).prefill(ids, all_logits=True) - want).max() <= TOL


def test_gemma3_config_in_the_4x_layout(saved):
    """Gemma 3 files from transformers 4.x: rope_theta / rope_scaling for the global layers,
    rope_local_base_freq for the sliding ones, sliding_window_pattern instead of layer_types."""
    def old(c):
        rope = c["rope_parameters"]
        full, local = dict(rope["full_attention"]), rope["sliding_attention"]
        out = {k: v for k, v in c.items() if k not in ("rope_parameters", "layer_types")}
        out.update(rope_theta=full.pop("rope_theta"), rope_scaling=full,
                   rope_local_base_freq=local["rope_theta"], sliding_window_pattern=2)
        return out
    want, cfg, w, ids = _config_case(saved, "gemma3-window8", old)
    assert cfg == _config_case(saved, "gemma3-window8", lambda c: c)[1]
    assert cfg.layer_windows == (8, None, 8) and cfg.local_rope_layers == (0, 2)
    assert np.abs(kr.Runner(cfg, w).prefill(ids, all_logits=True) - want).max() <= TOL
    # transformers' defaults for keys a file leaves out: bases 1e6 / 1e4, pattern 6
    bare = kr.ModelConfig.from_hf(dict(model_type="gemma3_text", num_hidden_layers=7,
                                       num_attention_heads=4, hidden_size=64, vocab_size=128,
                                       intermediate_size=128))
    assert bare.rope_theta == 1e6 and bare.local_rope == {"rope_theta": 1e4,
                                                          "rope_type": "default"}
    assert bare.layer_windows == (4096,) * 5 + (None, 4096)
    assert bare.local_rope_layers == (0, 1, 2, 3, 4, 6)
    assert bare.head_dim == 256 and bare.scale == 256 ** -0.5 and bare.attn_softcap is None
    assert bare.final_softcap is None and bare.tie_word_embeddings and bare.qk_norm
    # transformers 5's reading of the other layouts: a 4.x rope_scaling beside per-type
    # rope_parameters scales the global layers
    per_type = {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    both = kr.ModelConfig.from_hf(dict(model_type="gemma3_text", num_hidden_layers=2,
                                       num_attention_heads=4, hidden_size=64, vocab_size=128,
                                       intermediate_size=128, rope_parameters=per_type,
                                       rope_scaling={"rope_type": "linear", "factor": 8.0}))
    assert both.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert both.local_rope == {"rope_theta": 1e4, "rope_type": "default"}
    # a global dict without a type takes the old key 'type' (transformers standardises it)
    old_key = dict(model_type="gemma3_text", num_hidden_layers=2, num_attention_heads=4,
                   hidden_size=64, vocab_size=128, intermediate_size=128,
                   rope_parameters={"full_attention": {"rope_theta": 1e6}},
                   rope_scaling={"type": "linear", "factor": 8.0})
    want = tf.Gemma3TextConfig(**{k: v for k, v in copy.deepcopy(old_key).items()
                                  if k != "model_type"}).rope_parameters["full_attention"]
    got = kr.ModelConfig.from_hf(old_key)
    assert want.get("rope_type", want.get("type")) == got.rope_scaling["rope_type"] == "linear"
    assert got.rope_scaling["factor"] == want["factor"] == 8.0
    for bad, message in ((dict(model_type="gemma3"), "without a text_config"),
                         (dict(use_bidirectional_attention=True), "causal models only"),
                         (dict(rope_parameters={"rope_type": "linear", "factor": 8.0}),
                          "per layer type"),
                         (dict(rope_scaling={"type": "linear", "factor": 8.0}), "old key 'type'")):
        with pytest.raises(ValueError, match=message):
            kr.ModelConfig.from_hf({**dict(model_type="gemma3_text", num_hidden_layers=2,
                                           num_attention_heads=4, hidden_size=64,
                                           vocab_size=128, intermediate_size=128), **bad})


def test_a_tensor_the_runner_would_not_use_is_refused(saved):
    _, path = saved("llama")
    cfg = kr.ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    weights = kr.load_safetensors(path)
    weights["model.layers.0.self_attn.o_proj.bias"] = np.zeros(64, np.float32)
    with pytest.raises(ValueError, match="o_proj.bias"):
        kr.Runner(cfg, weights)
    with pytest.raises(ValueError, match="num_hidden_layers"):
        kr.ModelConfig.from_hf({"model_type": "llama", "hidden_size": 8})


def test_top_p_one_never_loses_a_token():
    rng = np.random.default_rng(0)
    for _ in range(2000):                      # the summed mass often ends a hair below 1.0
        logits = rng.standard_normal(512) * 3
        tok = kr.sample(logits, 0.9, 1.0, rng)
        assert 0 <= tok < 512


def _failing_layer(runner, at, monkeypatch):
    real = kr.Runner._layer

    def layer(self, i, *a):
        if i == at:
            raise MemoryError("simulated")
        return real(self, i, *a)
    monkeypatch.setattr(kr.Runner, "_layer", layer)


@pytest.mark.parametrize("when", ["prefill", "decode", "sealed-decode"])
def test_a_call_that_fails_half_way_changes_nothing(saved, monkeypatch, when):
    _, path = saved("llama")
    o1 = dict(o1_layers="1", o1_params=(4, 8, 2)) if when == "sealed-decode" else {}
    r = kr.Runner.from_pretrained(path, **o1)
    ids = prompt_ids(seed=4, n=40)
    if when != "prefill":
        r.prefill(ids)
    before = [layer.seq_len for layer in r.cache.layers], r.position
    with monkeypatch.context() as mp:
        _failing_layer(r, 2, mp)
        with pytest.raises(MemoryError):
            r.forward([7]) if when != "prefill" else r.prefill(ids)
    assert ([layer.seq_len for layer in r.cache.layers], r.position) == before
    fresh = kr.Runner.from_pretrained(path, **o1)
    if when == "prefill":
        np.testing.assert_array_equal(r.prefill(ids), fresh.prefill(ids))
    else:
        fresh.prefill(ids)
        np.testing.assert_array_equal(r.step(7), fresh.step(7))    # the sealed state too


def test_o1_all_picks_global_layers_and_checks_its_parameters(saved):
    _, path = saved("gemma2-window8")
    r = kr.Runner.from_pretrained(path, o1_layers="all", o1_params=(4, 8, 2))
    assert r.o1_layers == (1,)                      # layers 0 and 2 slide
    with pytest.raises(ValueError, match="m: expected an integer >= 4"):
        kr.Runner.from_pretrained(path, o1_layers="1", o1_params=(2, 8, 2))
    with pytest.raises(TypeError, match="o1 layers"):
        kr.Runner.from_pretrained(path, o1_layers=5)
    ids = prompt_ids(n=40)
    r.prefill(ids)
    r.truncate_last(0)                              # nothing to undo: fine when sealed too
    with pytest.raises(ValueError, match="already holds"):
        r.generate(ids, 2)


def test_generate_checks_before_it_starts():
    r = kr.Runner.random(max_seq_len=10)
    with pytest.raises(ValueError, match="max_seq_len"):
        r.generate([1, 2, 3], 9)
    assert r.position == 0
    assert len(r.generate([1, 2, 3], 8, stop=())) == 8       # 3 + 8 - 1 = 10 positions
    r.reset()
    with pytest.raises(ValueError, match="seed"):
        r.generate([1], 2, temperature=1.0, seed=-1)
    with pytest.raises(ValueError, match="non-empty"):
        r.generate([], 0)
    toks = r.generate([1, 2], 5, stop=9999)
    assert len(toks) == 5


def test_generate_command_reports_damaged_files_in_one_line(saved, capsys, tmp_path):
    _, path = saved("qwen2")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_bytes((path / "config.json").read_bytes())
    (bad / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{broken")
    assert cli.main(["generate", "--model", str(bad), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: model.safetensors: not a readable safetensors file")
    assert "Traceback" not in err
    tok = tmp_path / "tok"
    tok.mkdir()
    for f in path.iterdir():
        (tok / f.name).write_bytes(f.read_bytes())
    (tok / "tokenizer.json").write_text("{}")
    assert cli.main(["generate", "--model", str(tok), "--ids", "5", "--max-new-tokens", "2",
                     "--no-progress"]) == 0          # ids need no tokenizer: a warning only
    assert "not a readable tokenizer" in capsys.readouterr().err


def test_generate_command_says_which_o1_layers_sealed(capsys):
    argv = ["generate", "--o1", "deep2", "--o1-params", "4,8,2", "--max-new-tokens", "3",
            "--no-progress", "--ids"] + [str(i) for i in range(1, 41)]
    assert cli.main(argv) == 0
    assert "O(1) layers [2, 3]," in capsys.readouterr().out
    assert cli.main(["generate", "--o1", "9", "--max-new-tokens", "2", "--no-progress"]) == 0
    assert "selects no global layer" in capsys.readouterr().err


def test_generate_command_o1_keep_ridge_and_error_bound(capsys):
    """--o1-params takes KEEP and RIDGE after M,W,SINK; --o1-max-error bounds the seal (a
    bound no layer meets leaves every layer exact, and the command says so)."""
    ids = ["--ids"] + [str(i) for i in range(1, 41)]
    argv = ["generate", "--o1", "deep2", "--o1-params", "4,8,2,4,1e-3", "--max-new-tokens", "3",
            "--no-progress"] + ids
    assert cli.main(argv) == 0
    assert "O(1) layers [2, 3]," in capsys.readouterr().out
    argv = ["generate", "--o1", "deep2", "--o1-params", "4,8,2", "--o1-max-error", "1e-9",
            "--max-new-tokens", "3", "--no-progress"] + ids
    assert cli.main(argv) == 0
    assert "seal refused on [2, 3]" in capsys.readouterr().out
    for bad in ("4,8", "4,8,2,1,1e-3,9", "4,8,x", "4,8,2,1.5"):
        with pytest.raises(SystemExit):
            cli.main(["generate", "--o1", "deep2", "--o1-params", bad, "--no-progress"])
    capsys.readouterr()


def test_the_language_model_of_a_multimodal_gemma3(tmp_path):
    """A Gemma 3 4B-style folder (Gemma3ForConditionalGeneration: text_config, the language
    model under language_model.model.*, a vision tower): the runner decodes the language
    model and leaves the vision tower out, as transformers computes a text-only prompt."""
    text = dict(COMMON, head_dim=16, sliding_window=8, sliding_window_pattern=2,
                query_pre_attn_scalar=24, rope_local_base_freq=100.0)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    cfg = tf.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                          image_token_index=127, boi_token_index=125, eoi_token_index=126)
    torch.manual_seed(0)
    model = tf.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "language_model" in name and "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif "embed" in name:
                p.normal_(0.0, 1.0)
    model.generation_config.eos_token_id = None
    model.save_pretrained(tmp_path)
    ids = prompt_ids()
    with torch.no_grad():
        want = model(torch.tensor([ids])).logits[0].numpy()
    r = kr.Runner.from_pretrained(tmp_path)
    assert r.config.family == "gemma3_text" and r.config.layer_windows == (8, None, 8)
    assert np.abs(r.prefill(ids, all_logits=True) - want).max() <= TOL
    tokens, _ = hf_greedy(model, ids)
    r.reset()
    assert r.generate(ids, STEPS, stop=()) == tokens
    bad = dict(json.loads((tmp_path / "config.json").read_text()))
    bad["text_config"] = dict(bad["text_config"], model_type="llama")
    with pytest.raises(ValueError, match="text_config.model_type 'llama'"):
        kr.ModelConfig.from_hf(bad)


def test_one_token_id_validator_for_the_runner_hf_and_the_store():
    """kvcache._validate.as_token_ids: what the runner, kvcache.hf and the prefix store accept
    and refuse, alike."""
    from kvcache._validate import as_token_ids
    from kvcache.hf._common import prompt_ids
    from kvcache.store.keys import as_ids
    ok = as_token_ids(np.array([3, 1], np.uint16))
    assert ok.dtype == np.int64 and ok.tolist() == [3, 1]
    assert as_token_ids(torch.tensor([5, 6])).tolist() == [5, 6]
    assert as_ids([]).shape == (0,)
    assert prompt_ids(torch.tensor([[7, 8, 9]])).tolist() == [7, 8, 9]
    assert prompt_ids([[7, 8]]).tolist() == [7, 8] and prompt_ids(np.array([[1, 2]])).tolist() == [1, 2]
    for call in (as_token_ids, as_ids, prompt_ids):
        for bad in ([1.5], [1, True], np.array([True, False]), "abc", np.array([1.0, 2.0])):
            with pytest.raises(TypeError):
                call(bad)
        for bad in ([2 ** 70], [np.int64(1), 2 ** 70], [-1, 2 ** 63], np.array([2 ** 63], np.uint64),
                    [[1, 2], [3]], np.zeros((2, 2), np.int64)):
            with pytest.raises(ValueError):
                call(bad)
    with pytest.raises(ValueError, match="non-empty"):
        prompt_ids([])
    with pytest.raises(ValueError, match=r"\[0, 10\)"):
        as_token_ids([3, 10], vocab=10)
    with pytest.raises(ValueError, match="batch size 1"):
        prompt_ids(torch.zeros((2, 3), dtype=torch.long))
