"""GGUF checkpoints in the runner (kvcache.runner.gguf), without downloads.

Small random GGUF files are written here with gguf.GGUFWriter, the way llama.cpp's converter
writes them (llama.cpp tensor names, Llama's q/k rows permuted for its rotary layout, Gemma's
norms stored as 1 + w, 2-D tensors quantised), and loaded through Runner.from_pretrained.  The
reference is the runner built from the Hugging Face-named weights the file should give back
after dequantisation: quantisation is per row, so dequantize(quantize(w)) of the unpermuted
matrix is exactly what the loader must return.
"""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("tokenizers")

from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf import quants  # noqa: E402

from kvcache.runner import ModelConfig, Runner, main as generate_main  # noqa: E402
from kvcache.runner.gguf import (chat_template, is_gguf, load_gguf,  # noqa: E402
                                 load_tokenizer, render_chat)
from kvcache.runner.weights import random_weights  # noqa: E402

H, IM, NH, NKV, HD, LAYERS = 256, 512, 8, 2, 32, 2
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _byte_chars() -> list[str]:
    from kvcache.runner.gguf import _bytes_to_unicode
    table = _bytes_to_unicode()
    return [table[b] for b in range(256)]


def gpt2_vocab() -> tuple[list[str], list[str], list[int]]:
    """A byte-level BPE vocabulary: the 256 byte symbols, a few merges, three control tokens."""
    chars = _byte_chars()
    sp = chars[ord(" ")]
    merges = [f"{sp} t", "h e", f"{sp}t he", "a b", "ab c"]
    tokens = chars + [f"{sp}t", "he", f"{sp}the", "ab", "abc"] + SPECIALS
    types = [1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS)
    return tokens, merges, types


def config_of(family: str) -> ModelConfig:
    fam = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
           "gemma2": "gemma2", "gemma3": "gemma3_text"}[family]
    tokens = gpt2_vocab()[0]
    cfg = {"model_type": fam, "num_hidden_layers": LAYERS, "hidden_size": H,
           "intermediate_size": IM, "num_attention_heads": NH, "num_key_value_heads": NKV,
           "head_dim": HD, "vocab_size": len(tokens), "rms_norm_eps": float(np.float32(1e-5)),
           "rope_theta": 50000.0, "tie_word_embeddings": family.startswith("gemma"),
           "bos_token_id": 256 + 5, "eos_token_id": len(tokens) - 1}
    if family == "mistral":
        cfg["sliding_window"] = 16
    if family in ("qwen2", "qwen3"):
        cfg["use_sliding_window"] = False
    if family == "gemma2":
        cfg.update(sliding_window=16, query_pre_attn_scalar=HD, attn_logit_softcapping=50.0,
                   final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh")
    if family == "gemma3":              # llama.cpp's fixed local base and period
        cfg.update(sliding_window=16, query_pre_attn_scalar=HD, rope_local_base_freq=10000.0,
                   sliding_window_pattern=6, final_logit_softcapping=None,
                   hidden_activation="gelu_pytorch_tanh")
    return ModelConfig.from_hf(cfg)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of a q/k projection (rotate-half rows to
    interleaved pairs)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


GGUF_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
              "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
              "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(hf: str, gemma: bool) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
           "output_norm.weight", "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, i, rest = hf.split(".", 3)
    base, kind = rest.rsplit(".", 1)
    names = dict(GGUF_NAMES)
    names.update({"self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"})
    if gemma:
        names.update({"post_attention_layernorm": "post_attention_norm",
                      "pre_feedforward_layernorm": "ffn_norm",
                      "post_feedforward_layernorm": "post_ffw_norm"})
    else:
        names["post_attention_layernorm"] = "ffn_norm"
    return f"blk.{i}.{names[base]}.{kind}"


def _raw_k_blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random blocks of a K-quant (no quantiser in the gguf package) with small finite
    float16 scales."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    scale = lambda: (rng.uniform(1e-4, 1e-3, size=(rows, cols // block, 1))  # noqa: E731
                     .astype(np.float16).view(np.uint8))
    if qtype == Q.Q4_K:                 # d, dmin, scales[12], qs[128]
        raw[..., 0:2], raw[..., 2:4] = scale(), scale()
    elif qtype == Q.Q6_K:               # ql[128], qh[64], scales[16], d
        raw[..., 208:210] = scale()
    return raw.reshape(rows, -1)


def encode_tensor(w: np.ndarray, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    if qtype in (Q.Q4_K, Q.Q6_K):
        return _raw_k_blocks(qtype, w.shape[0], w.shape[1], rng)
    return quants.quantize(w, qtype)


def write_gguf(path, family: str = "llama", qtype: Q = Q.Q4_1, seed: int = 0, *,
               arch: str | None = None, drop: tuple[str, ...] = (), extra=None,
               extra_tensors=None, tokenizer_model: str = "gpt2"):
    """A random checkpoint of ``family`` written as a GGUF file; returns (config, the float32
    Hugging Face-named weights the loader must give back)."""
    cfg = config_of(family)
    gemma = family.startswith("gemma")
    rng = np.random.default_rng(seed)
    hf = random_weights(cfg, seed)
    for k in hf:                        # norms with content (random_weights makes them flat)
        if hf[k].ndim == 1 and "norm" in k:
            hf[k] = (hf[k] + rng.uniform(-0.2, 0.2, hf[k].shape)).astype(np.float32)
    writer = gguf.GGUFWriter(str(path), arch or ("llama" if family == "mistral" else family))
    a = arch or ("llama" if family == "mistral" else family)
    kv = {f"{a}.block_count": LAYERS, f"{a}.embedding_length": H,
          f"{a}.feed_forward_length": IM, f"{a}.attention.head_count": NH,
          f"{a}.attention.head_count_kv": NKV, f"{a}.context_length": 4096,
          f"{a}.attention.layer_norm_rms_epsilon": 1e-5, f"{a}.rope.freq_base": 50000.0}
    if family in ("llama", "mistral"):
        kv[f"{a}.rope.dimension_count"] = HD
    if family == "mistral":
        kv[f"{a}.attention.sliding_window"] = 16
    if gemma or family == "qwen3":
        kv.update({f"{a}.attention.key_length": HD, f"{a}.attention.value_length": HD})
    if gemma:
        kv[f"{a}.attention.sliding_window"] = 16
    if family == "gemma2":
        kv.update({f"{a}.attn_logit_softcapping": 50.0, f"{a}.final_logit_softcapping": 30.0})
    kv.update(extra or {})
    for key, value in kv.items():
        if key in drop:
            continue
        if isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, list):
            writer.add_array(key, value)
        else:
            writer.add_uint32(key, value)
    tokens, merges, types = gpt2_vocab()
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id[0])
    writer.add_add_bos_token(False)
    writer.add_chat_template(TEMPLATE)
    expect = {}
    for name, w in hf.items():
        gname = gguf_name(name, gemma)
        stored = w
        if gemma and name.endswith("norm.weight"):
            stored = (w + np.float32(1.0)).astype(np.float32)
            w = (stored - np.float32(1.0)).astype(np.float32)
        if family in ("llama", "mistral") and (".q_proj." in name or ".k_proj." in name):
            stored = _permute(stored, NH if ".q_proj." in name else NKV)
        if stored.ndim == 2 and qtype != Q.F32:
            data = encode_tensor(stored, qtype, rng)
            writer.add_tensor(gname, data, raw_dtype=qtype)
            deq = quants.dequantize(data, qtype).reshape(stored.shape)
            if family in ("llama", "mistral") and (".q_proj." in name or ".k_proj." in name):
                n = NH if ".q_proj." in name else NKV     # the inverse of _permute
                deq = deq.reshape(n, w.shape[0] // n // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)
            w = deq.astype(np.float32)
        else:
            writer.add_tensor(gname, np.ascontiguousarray(stored))
        expect[name] = np.ascontiguousarray(w)
    for gname, arr in (extra_tensors or {}).items():
        writer.add_tensor(gname, arr)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return cfg, expect


CASES = [("llama", Q.Q4_1), ("llama", Q.Q8_0), ("llama", Q.F16), ("llama", Q.BF16),
         ("llama", Q.Q4_K), ("llama", Q.F32), ("mistral", Q.Q4_0), ("qwen2", Q.Q6_K),
         ("qwen2", Q.Q8_0), ("qwen3", Q.Q8_0), ("qwen3", Q.F32), ("gemma2", Q.Q4_1),
         ("gemma2", Q.F16), ("gemma3", Q.Q4_1), ("gemma3", Q.F16)]


@pytest.mark.parametrize("family,qtype", CASES, ids=[f"{f}-{q.name}" for f, q in CASES])
def test_gguf_gives_the_runner_of_its_dequantised_weights(tmp_path, family, qtype):
    path = tmp_path / "m.gguf"
    cfg, expect = write_gguf(path, family, qtype)
    loaded_cfg, weights = load_gguf(path)
    assert loaded_cfg == cfg
    assert set(weights) == set(expect)
    for k in expect:
        np.testing.assert_array_equal(weights[k], expect[k], err_msg=k)
    ids = np.array([5, 17, 200, 42, 42, 7, 99, 260, 3, 11] * 3)
    got = Runner.from_pretrained(path).prefill(ids, all_logits=True)
    ref = Runner(cfg, expect).prefill(ids, all_logits=True)
    np.testing.assert_array_equal(got, ref)


def test_llama3_rope_freqs_give_the_llama3_frequencies(tmp_path):
    """Llama 3.1 / 3.2 files carry their RoPE scaling as per-frequency factors: the runner
    divides the default frequencies by them (as llama.cpp does), which gives transformers'
    ``llama3`` frequencies up to float32 rounding, and so its logits."""
    from dataclasses import replace
    from kvcache.runner.model import _rope_inv_freq
    base = config_of("llama")
    llama3 = replace(base, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 256})
    def inv_freq(c):
        return _rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling)
    plain, scaled = inv_freq(base), inv_freq(llama3)
    factors = (plain.astype(np.float64) / scaled).astype(np.float32)   # what a converter writes
    assert (factors > 1.5).any() and (factors == 1).any()              # the scaling bites
    path = tmp_path / "m.gguf"
    _, expect = write_gguf(path, "llama", Q.F32, extra_tensors={"rope_freqs.weight": factors})
    cfg, _ = load_gguf(path)
    assert cfg.rope_scaling["rope_type"] == "freq_factors"
    np.testing.assert_allclose(inv_freq(cfg), scaled, rtol=3e-7, atol=0)
    ids = np.arange(40) * 7 % 260
    got = Runner.from_pretrained(path).prefill(ids, all_logits=True)
    want = Runner(llama3, expect).prefill(ids, all_logits=True)
    unscaled = Runner(base, expect).prefill(ids, all_logits=True)
    err = np.abs(got - want).max()
    assert err <= 1e-4 and np.abs(unscaled - want).max() > 100 * max(err, 1e-6)


def test_llama_rows_are_unpermuted_for_rotary(tmp_path):
    """Loading without undoing llama.cpp's permutation would give other logits: the test
    above is sensitive to it (the q/k rows of one head differ)."""
    path = tmp_path / "m.gguf"
    cfg, expect = write_gguf(path, "llama", Q.F32)
    _, weights = load_gguf(path)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not np.array_equal(_permute(expect[q], NH), expect[q])
    np.testing.assert_array_equal(weights[q], expect[q])


def test_config_comes_from_the_metadata(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, "gemma2", Q.F32)
    cfg, _ = load_gguf(path)
    assert (cfg.family, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == \
        ("gemma2", LAYERS, NH, NKV, HD)
    assert cfg.attn_softcap == 50.0 and cfg.final_softcap == 30.0
    assert cfg.layer_windows == (16, None)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 50000.0
    path2 = tmp_path / "mistral.gguf"
    write_gguf(path2, "mistral", Q.F32)
    assert load_gguf(path2)[0].layer_windows == (16, 16)
    assert is_gguf(path) and not is_gguf(tmp_path)


def test_gemma3_and_qwen3_metadata():
    """Gemma 3 as llama.cpp reads it: sliding layers five in six (or the file's pattern, as a
    period or per-layer flags), local RoPE base 10,000 (or rope.freq_base_swa), the global
    base and a linear scaling on the global layers, the 27B rule for the query scale; Qwen3's
    head size apart from hidden / heads."""
    from kvcache.runner.gguf import _hf_config
    g = {"general.architecture": "gemma3", "gemma3.block_count": 62,
         "gemma3.embedding_length": 5376, "gemma3.feed_forward_length": 64,
         "gemma3.attention.head_count": 32, "gemma3.attention.head_count_kv": 16,
         "gemma3.attention.key_length": 128, "gemma3.attention.value_length": 128,
         "gemma3.attention.layer_norm_rms_epsilon": 1e-6, "gemma3.rope.freq_base": 1e6,
         "gemma3.attention.sliding_window": 1024, "gemma3.vocab_size": 300,
         "gemma3.rope.scaling.type": "linear", "gemma3.rope.scaling.factor": 8.0}
    cfg = ModelConfig.from_hf(_hf_config(g, ["token_embd.weight"]))
    assert cfg.family == "gemma3_text" and cfg.qk_norm and cfg.gemma
    assert cfg.scale == (5376 // 32) ** -0.5                    # 27B: hidden / heads
    assert cfg.layer_windows == tuple(None if (i + 1) % 6 == 0 else 1024 for i in range(62))
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert cfg.local_rope == {"rope_theta": 10000.0, "rope_type": "default"}
    assert cfg.attn_softcap is None and cfg.final_softcap is None and cfg.tie_word_embeddings
    small = dict(g, **{"gemma3.block_count": 4, "gemma3.rope.freq_base_swa": 500.0,
                       "gemma3.attention.sliding_window_pattern": 2})
    cfg = ModelConfig.from_hf(_hf_config(small, ["output.weight"]))
    assert cfg.scale == 128 ** -0.5 and cfg.layer_windows == (1024, None, 1024, None)
    assert cfg.local_rope["rope_theta"] == 500.0 and not cfg.tie_word_embeddings
    flags = dict(small, **{"gemma3.attention.sliding_window_pattern": [True, True, False, True]})
    assert ModelConfig.from_hf(_hf_config(flags, [])).layer_windows == (1024, 1024, None, 1024)
    for bad in ([True], 0, "6"):
        with pytest.raises(ValueError, match="sliding_window_pattern"):
            _hf_config(dict(small, **{"gemma3.attention.sliding_window_pattern": bad}), [])
    q = {k.replace("gemma3", "qwen3"): v for k, v in g.items() if "sliding" not in k
         and "scaling" not in k}
    q["general.architecture"] = "qwen3"
    cfg = ModelConfig.from_hf(_hf_config(q, ["output.weight"]))
    assert cfg.family == "qwen3" and cfg.head_dim == 128 and cfg.qk_norm and not cfg.gemma
    assert cfg.layer_windows == (None,) * 62 and not cfg.qkv_bias and cfg.local_rope is None


@pytest.mark.parametrize("kwargs,message", [
    (dict(arch="phi3"), "general.architecture 'phi3' is not supported"),
    (dict(drop=("llama.attention.head_count",)), "'llama.attention.head_count' is missing"),
    (dict(drop=("llama.block_count",)), "'llama.block_count' is missing"),
    (dict(drop=("llama.attention.layer_norm_rms_epsilon",)),
     "'llama.attention.layer_norm_rms_epsilon' is missing"),
    (dict(extra={"llama.attention.head_count_kv": [2, 4]}),
     "llama.attention.head_count_kv varies per layer"),
    (dict(extra={"llama.rope.dimension_count": 16}), "partial rotary"),
    (dict(extra_tensors={"rope_freqs.weight": np.ones(HD // 2 + 1, np.float32)}),
     "'rope_freqs.weight' must hold head_dim / 2"),
    (dict(extra_tensors={"rope_freqs.weight": -np.ones(HD // 2, np.float32)}),
     "positive finite factors"),
    (dict(extra={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0},
          extra_tensors={"rope_freqs.weight": np.ones(HD // 2, np.float32)}),
     "both 'rope_freqs.weight' and a rope.scaling.type"),
    (dict(extra_tensors={"blk.0.attn_q_norm.weight": np.ones(32, np.float32)}),
     "blk.0.attn_q_norm.weight"),
    (dict(extra_tensors={"blk.0.attn_q.bias": np.ones(256, np.int32)}),
     "tensor 'blk.0.attn_q.bias' has type I32"),
])
def test_unsupported_files_are_refused_in_one_line(tmp_path, kwargs, message):
    path = tmp_path / "m.gguf"
    write_gguf(path, "llama", Q.F32, **kwargs)
    with pytest.raises(ValueError) as info:
        Runner.from_pretrained(path)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(b"not a model at all")
    with pytest.raises(ValueError, match="not a GGUF file"):
        Runner.from_pretrained(path)
    good = tmp_path / "good.gguf"
    write_gguf(good, "llama", Q.F32)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[:-1000])
    with pytest.raises(ValueError, match="runs past the end"):
        Runner.from_pretrained(cut)


def test_byte_level_tokenizer_from_the_metadata(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path)
    tok = load_tokenizer(path)
    tokens = gpt2_vocab()[0]
    text = "a the abc <|im_start|>héllo\n\t1234"
    enc = tok.encode(text)
    assert tok.decode(enc.ids, skip_special_tokens=False) == text
    assert tokens.index("<|im_start|>") in enc.ids            # a control token stays whole
    assert tokens.index(_byte_chars()[ord(" ")] + "the") in enc.ids    # merges applied
    assert tokens.index("abc") in enc.ids
    assert tok.get_vocab_size() == len(tokens)


def test_tokenizer_matches_transformers_on_a_written_file(tmp_path):
    transformers = pytest.importorskip("transformers")
    path = tmp_path / "m.gguf"
    write_gguf(path)
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="m.gguf")
    tok = load_tokenizer(path)
    for text in ("the abc the", " the  abc\n\nxyz 99", "<|im_start|>user\nhe<|im_end|>"):
        assert tok.encode(text).ids == ref(text)["input_ids"], text


def test_sentencepiece_tokenizer_or_its_errors(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, tokenizer_model="llama")             # no scores: named in the error
    with pytest.raises(ValueError, match="tokenizer.ggml.scores"):
        load_tokenizer(path)
    path2 = tmp_path / "m2.gguf"
    write_gguf(path2, tokenizer_model="bert")
    with pytest.raises(ValueError, match="tokenizer.ggml.model 'bert' is not supported"):
        load_tokenizer(path2)


def test_chat_template_is_kept_and_rendered(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path)
    template = chat_template(path)
    assert template == TEMPLATE
    text = render_chat(template, [{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match="chat template: no"):
        render_chat("{{ raise_exception('no') }}", [])


def test_generate_command_with_a_gguf_and_chat(tmp_path, capsys):
    path = tmp_path / "m.gguf"
    write_gguf(path)
    assert generate_main(["--model", str(path), "--prompt", "the abc", "--chat",
                          "--max-new-tokens", "4", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "<|im_start|>user\\nthe abc<|im_end|>\\n<|im_start|>assistant\\n" in out
    assert "(llama, 2 layers)" in out
    with pytest.raises(SystemExit):                       # --chat needs a prompt
        generate_main(["--model", str(path), "--chat"])


def write_sentencepiece_file(path):
    """A one-layer Llama GGUF whose tokenizer is SentencePiece BPE (no merges: derived from the
    scores), with byte-fallback tokens, as llama.cpp writes Llama 2's."""
    w = gguf.GGUFWriter(str(path), "llama")
    pieces = ["\u2581", "t", "h", "e", "a", "b", "c", "x", "\u2581t", "he", "\u2581the", "ab", "abc",
              "\u2581a", "\u2581abc"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    for k, v in {"llama.block_count": 1, "llama.embedding_length": 64,
                 "llama.feed_forward_length": 64, "llama.attention.head_count": 2}.items():
        w.add_uint32(k, v)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(pieces))
    w.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces))])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tokens


def test_sentencepiece_tokenizer_from_the_metadata(tmp_path):
    transformers = pytest.importorskip("transformers")
    tokens = write_sentencepiece_file(tmp_path / "s.gguf")
    tok = load_tokenizer(tmp_path / "s.gguf")
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="s.gguf")
    for text in ("the abc", "hello", "abc xyz\n\u00e9 the"):       # BOS added, bytes fall back
        assert tok.encode(text).ids == ref(text)["input_ids"], text
        assert tok.decode(tok.encode(text).ids) == text
    # llama.cpp (and SentencePiece) prefix every text with a space, also one that starts with
    # a space and one after a control token; transformers' GGUF conversion does not there
    sp = "\u2581"
    assert tok.encode(" the").ids == [1, tokens.index(sp), tokens.index(sp + "the")]
    assert tok.encode("abc</s>the").ids == [1, tokens.index(sp + "abc"), 2,
                                            tokens.index(sp + "the")]
    assert tok.decode(tok.encode(" the  abc").ids) == " the  abc"
