"""kvcache.hf: transformers Cache + "kvcache" attention against transformers' own path.

Tiny random models of six families (Llama, Mistral with a sliding window shorter than the
prompt, Qwen2 with projection biases, Gemma-2 with alternating sliding layers, logit softcapping
and query_pre_attn_scalar, Qwen3 with q/k norms, Gemma 3 with sliding layers in a pattern and
a local RoPE base) are saved, reloaded with ``attn_implementation="kvcache"`` and with
the default implementation (sdpa; eager for Gemma-2), and compared: prompt logits, greedy
``generate`` tokens and per-step logits, int8 (q8) agreement, rollback (crop, prompt-lookup
speculative decoding) and the errors promised for what the integration does not support.

The measured figures are printed with the prefix ``[hf]`` (``pytest -s``).
"""

from __future__ import annotations

import copy
import inspect
import subprocess
import sys
import types

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
kh = pytest.importorskip("kvcache.hf")

import kvcache as kc  # noqa: E402

PROMPT = 40           # > sliding window (8) and < 64, so the q8 column freeze happens in decode
NEW = 32
TOL = 1e-4            # max abs logit difference vs transformers' default attention


def _report(*parts):
    print("[hf]", *parts)


_COMMON = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=256,
               pad_token_id=0, bos_token_id=None, eos_token_id=None, initializer_range=0.2)

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_hidden_layers=2)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(num_hidden_layers=2, sliding_window=8)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_hidden_layers=2)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(num_hidden_layers=4, sliding_window=8, query_pre_attn_scalar=24,
                    attn_logit_softcapping=5.0, final_logit_softcapping=30.0)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_hidden_layers=2)),
    # sliding layers in a pattern with their own RoPE base, q/k norms
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(num_hidden_layers=3, sliding_window=8, sliding_window_pattern=2,
                    query_pre_attn_scalar=24, rope_local_base_freq=100.0)),
}


def tiny_models(name, tmp_path_factory, n_ids, **overrides):
    """A tiny seeded model of family ``name`` saved to disk and loaded twice (kvcache
    attention, and transformers' default), with ``n_ids`` seeded prompt ids."""
    cfg_name, model_name, extra = FAMILIES[name]
    config = getattr(transformers, cfg_name)(**{**_COMMON, **overrides}, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config)
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    auto = transformers.AutoModelForCausalLM
    mk = auto.from_pretrained(path, attn_implementation="kvcache")
    # Gemma-2 needs eager in every 5.x (5.24 picks it by default; early 5.x picked sdpa, which
    # dropped the attention softcap)
    ref_impl = {"attn_implementation": "eager"} if name == "gemma2" else {}
    mr = auto.from_pretrained(path, **ref_impl)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 128, (1, n_ids), generator=gen)
    return mk, mr, ids, path


@pytest.fixture(scope="module", params=list(FAMILIES))
def fam(request, tmp_path_factory):
    """A tiny seeded model saved to disk, loaded twice: kvcache attention and the default."""
    mk, mr, ids, path = tiny_models(request.param, tmp_path_factory, PROMPT)
    with torch.no_grad():
        ref = mr.generate(ids, max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True,
                          output_logits=True)
    return types.SimpleNamespace(name=request.param, mk=mk, mr=mr, ids=ids, path=path,
                                 ref_seq=ref.sequences, ref_logits=torch.stack(ref.logits))


# transformers 5.24 names the cache argument ``cache``; early 5.x releases ``past_key_values``
_FORWARD_PARAMS = inspect.signature(transformers.LlamaForCausalLM.forward).parameters
_CACHE_KW = "cache" if "cache" in _FORWARD_PARAMS else "past_key_values"


def _cache(cache):
    return {_CACHE_KW: cache}


def _forward(model, ids, cache=None, **kw):
    with torch.no_grad():
        if cache is None:
            return model(ids, **kw).logits
        return model(ids, use_cache=True, **_cache(cache), **kw).logits


# ----------------------------------------------------------------------------------- parity
def test_prompt_logits_match_default_attention(fam):
    assert fam.mk.config._attn_implementation == "kvcache"
    assert fam.mr.config._attn_implementation in ("sdpa", "eager")
    cache = kh.HfKvCache(fam.mk.config, mode="f32")
    got = _forward(fam.mk, fam.ids, cache)
    want = _forward(fam.mr, fam.ids)
    diff = (got - want).abs().max().item()
    _report(f"{fam.name}: prompt logits max abs diff {diff:.2e} "
            f"(vs {fam.mr.config._attn_implementation})")
    assert diff <= TOL
    assert cache.get_seq_length() == PROMPT
    assert all(isinstance(kv, kc.LayerKvCache) and kv.seq_len == PROMPT for kv in cache.kv_layers)
    assert cache.memory_bytes() > 0
    # transformers never evicts: no importance work (the outputs are the same bits either way)
    assert not any(kv.track_importance or kv.importance.any() for kv in cache.kv_layers)


def test_generate_matches_default_attention(fam):
    cache = kh.HfKvCache(fam.mk.config, mode=kc.KvMode.F32)
    with torch.no_grad():
        out = fam.mk.generate(fam.ids, max_new_tokens=NEW, do_sample=False, **_cache(cache),
                              return_dict_in_generate=True, output_logits=True)
    diff = (torch.stack(out.logits) - fam.ref_logits).abs().max().item()
    same = torch.equal(out.sequences, fam.ref_seq)
    _report(f"{fam.name}: generate {NEW} tokens equal={same}, "
            f"per-step logits max abs diff {diff:.2e}")
    assert same
    assert diff <= TOL
    # the cache holds every position but the last generated token (never fed back)
    assert cache.get_seq_length() == PROMPT + NEW - 1


def test_without_hfkvcache_attention_still_matches(fam):
    """No cache / transformers' DynamicCache: the kernels run on a temporary layer."""
    got = _forward(fam.mk, fam.ids, use_cache=False)
    diff = (got - _forward(fam.mr, fam.ids)).abs().max().item()
    assert diff <= TOL
    with torch.no_grad():
        seq = fam.mk.generate(fam.ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(seq, fam.ref_seq[:, :PROMPT + 8])


def test_multi_turn_reuses_the_cache(fam):
    cache = kh.HfKvCache(fam.mk.config)
    with torch.no_grad():
        first = fam.mk.generate(fam.ids, max_new_tokens=NEW // 2, do_sample=False, **_cache(cache))
        second = fam.mk.generate(first, max_new_tokens=NEW // 2, do_sample=False, **_cache(cache))
    assert torch.equal(second, fam.ref_seq)


# ----------------------------------------------------------------------------------- q8
def _teacher_forced(fam, modes):
    """Teacher-forced along the f32 greedy sequence: prefill the prompt, then decode step by
    step (crossing the 64-row column freeze and 4-bit block boundaries); per mode its cache
    and the last-position logits of every step."""
    seq = fam.ref_seq
    caches = {m: kh.HfKvCache(fam.mk.config, mode=m) for m in modes}
    logits = {}
    for m, cache in caches.items():
        rows = [_forward(fam.mk, seq[:, :PROMPT], cache)[0, -1]]
        for i in range(PROMPT, seq.shape[1] - 1):
            rows.append(_forward(fam.mk, seq[:, i:i + 1], cache)[0, -1])
        logits[m] = torch.stack(rows)
    return caches, logits


def test_q8_agrees_with_f32(fam):
    caches, logits = _teacher_forced(fam, ("f32", "q8"))
    agree = (logits["q8"].argmax(-1) == logits["f32"].argmax(-1)).float().mean().item()
    diff = (logits["q8"] - logits["f32"]).abs().max().item()
    _report(f"{fam.name}: q8 top-1 agreement with f32 {agree:.3f} over {len(logits['q8'])} steps, "
            f"max abs logit diff {diff:.2e}")
    assert agree >= 0.9
    assert diff > 0                                       # int8 storage was really used
    kv = caches["q8"].kv_layers[0]
    assert kv.mode == kc.KvMode.Q8(True, True) and kv.q8_rows(0)[0] is not None
    assert caches["q8"].memory_bytes() < caches["f32"].memory_bytes()


def _relative_error(got, want):
    """RMS of ``got - want`` over the RMS spread of ``want``'s logits around their mean."""
    spread = want - want.mean(-1, keepdim=True)
    return ((got - want).norm() / spread.norm()).item()


@pytest.mark.parametrize("mode", ["q4", "k8v4"])
def test_4bit_modes_agree_with_f32(fam, mode):
    """The 4-bit modes through transformers, teacher-forced as above.  On these tiny random
    models (head_dim 16, one V group per row) 4 bits move the logits by 4-25% of their spread
    (int8: 0.4-2.5%); garbage would be above 100% and agree on ~1% of the steps.  Quality on a
    real model is measured by ``kvcache eval`` (docs/kv4.md)."""
    caches, logits = _teacher_forced(fam, ("f32", "q8", mode))
    agree = (logits[mode].argmax(-1) == logits["f32"].argmax(-1)).float().mean().item()
    rel = _relative_error(logits[mode], logits["f32"])
    rel8 = _relative_error(logits["q8"], logits["f32"])
    _report(f"{fam.name}: {mode} top-1 agreement with f32 {agree:.3f} over "
            f"{len(logits[mode])} steps, logit error {rel:.3f} of their spread (q8 {rel8:.3f})")
    assert agree >= 0.5 and rel <= 0.35
    assert rel > rel8 > 0                                 # 4-bit storage was really used
    assert all(kv.mode == kc.KvMode.parse(mode) for kv in caches[mode].kv_layers)
    assert caches[mode].memory_bytes() < caches["f32"].memory_bytes()   # (a 64-row float
    # ring keeps 4-bit K above int8 at this length: docs/kv4.md)


def test_generate_helper_q8(fam):
    with torch.no_grad():
        seq = kh.generate(fam.mk, fam.ids, mode="q8", max_new_tokens=4, do_sample=False)
    assert seq.shape == (1, PROMPT + 4)
    with pytest.raises(ValueError, match="attn_implementation"):
        kh.generate(fam.mr, fam.ids, max_new_tokens=1)


# ----------------------------------------------------------------------------------- rollback
def test_crop_then_refeed_equals_fresh_forward(fam):
    seq = fam.ref_seq[:, :PROMPT + 8]
    cache = kh.HfKvCache(fam.mk.config)
    _forward(fam.mk, seq, cache)
    cache.crop(-5)                                        # drop the newest 5 (transformers 5.x)
    assert cache.get_seq_length() == PROMPT + 3
    cache.crop(0)                                         # no-op
    assert cache.get_seq_length() == PROMPT + 3
    redo = _forward(fam.mk, seq[:, -5:], cache)
    fresh = _forward(fam.mk, seq)[:, -5:]
    assert (redo - fresh).abs().max().item() <= 1e-5
    cache.crop(PROMPT)                                    # absolute form keeps the first PROMPT
    assert [kv.seq_len for kv in cache.kv_layers] == [PROMPT] * len(cache.layers)
    cache.reset()
    assert cache.get_seq_length() == 0


def test_prompt_lookup_speculative_decoding(fam, monkeypatch):
    """Assisted generation verifies drafts and crops the rejected ones; tokens must match."""
    dropped = []
    cache = kh.HfKvCache(fam.mk.config)
    real = cache.crop

    def crop(n):
        before = cache.get_seq_length()
        real(n)
        dropped.append(before - cache.get_seq_length())

    monkeypatch.setattr(cache, "crop", crop)
    prompt = torch.cat([fam.ids[:, :20], fam.ids[:, :20]], dim=1)   # repeated n-grams to draft
    with torch.no_grad():
        # an eos id is set because early 5.x prompt lookup needs one (the prompt never holds 0)
        want = fam.mr.generate(prompt, max_new_tokens=NEW, do_sample=False, eos_token_id=0)
        got = fam.mk.generate(prompt, max_new_tokens=NEW, do_sample=False, **_cache(cache),
                              prompt_lookup_num_tokens=4, eos_token_id=0)
    assert torch.equal(got, want)
    assert max(dropped) > 0                               # drafts were rejected and rolled back


# ----------------------------------------------------------------------------------- errors
@pytest.fixture(scope="module")
def llama():
    config = transformers.LlamaConfig(**_COMMON, num_hidden_layers=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    model.set_attn_implementation("kvcache")
    return model


def test_batch_and_beam_search_raise(llama):
    ids = torch.randint(3, 128, (2, 6))
    with pytest.raises(ValueError, match="batch size 1"):
        _forward(llama, ids, kh.HfKvCache(llama.config))
    with pytest.raises(ValueError, match="beam search"), torch.no_grad():
        llama.generate(ids[:1], max_new_tokens=2, num_beams=2, do_sample=False,
                       **_cache(kh.HfKvCache(llama.config)))
    cache = kh.HfKvCache(llama.config)
    _forward(llama, ids[:1], cache)
    with pytest.raises(NotImplementedError, match="beam search"):
        cache.reorder_cache(torch.tensor([1, 0]))
    cache.reorder_cache(torch.tensor([0]))                # the identity is fine
    with pytest.raises(NotImplementedError):
        cache.batch_repeat_interleave(2)
    with pytest.raises(NotImplementedError):
        cache.batch_select_indices(torch.tensor([1]))
    assert cache.get_seq_length() == 6


def test_right_padding_holes_and_explicit_masks_raise(llama):
    ids = torch.randint(3, 128, (1, 6))
    mask = torch.ones(1, 6, dtype=torch.long)
    _forward(llama, ids, kh.HfKvCache(llama.config), attention_mask=mask)   # all ones: fine
    for zero in (5, 2):                                   # right padding, a hole
        bad = mask.clone()
        bad[0, zero] = 0
        with pytest.raises(ValueError, match="left padding only"):
            _forward(llama, ids, kh.HfKvCache(llama.config), attention_mask=bad)
    mask4 = torch.zeros(1, 1, 6, 6)
    with pytest.raises(ValueError, match="4-D mask"):
        _forward(llama, ids, kh.HfKvCache(llama.config), attention_mask=mask4)


def _reference_twin(llama):
    """The same weights under transformers' own attention (a config of its own: the
    attention implementation is a config field)."""
    ref = transformers.LlamaForCausalLM(copy.deepcopy(llama.config)).eval()
    ref.load_state_dict(llama.state_dict())
    ref.set_attn_implementation("sdpa")
    return ref


@pytest.mark.parametrize("mode", ["f32", "q8"])
def test_left_padding_is_left_out(llama, mode):
    """A left-padded prompt at batch size 1 generates what the unpadded prompt generates: the
    padding positions are never stored (the cache still counts them, as transformers does),
    their queries' outputs are zeros nobody reads; prompt-lookup decoding and rollback keep
    working."""
    ids = torch.randint(3, 128, (1, 12))
    pad = torch.cat([torch.zeros(1, 5, dtype=torch.long), ids], 1)
    mask = (torch.arange(17) >= 5).long()[None]
    kw = dict(max_new_tokens=16, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = llama.generate(ids, **kw, **_cache(kh.HfKvCache(llama.config, mode=mode)))
        cache = kh.HfKvCache(llama.config, mode=mode)
        got = llama.generate(pad, attention_mask=mask, **kw, **_cache(cache))
        assert torch.equal(got[:, 5:], want)
        assert cache.get_seq_length() == 17 + 15 and cache.kv_layers[0].seq_len == 12 + 15
        assert all(layer.pads == 5 for layer in cache.layers)
        lookup = llama.generate(pad, attention_mask=mask, prompt_lookup_num_tokens=3, **kw,
                                **_cache(kh.HfKvCache(llama.config, mode=mode)))
        assert torch.equal(lookup, got)
        ref = _reference_twin(llama).generate(pad, attention_mask=mask, **kw)
        if mode == "f32":
            assert torch.equal(got, ref)
    cache.crop(-(cache.get_seq_length() - 3))       # into the padding: no row is left
    assert cache.get_seq_length() == 3 and cache.kv_layers[0].seq_len == 0
    cache.reset()
    assert cache.layers[0].pads == 0


def test_padding_that_moves_is_refused(llama):
    ids = torch.randint(3, 128, (1, 6))
    cache = kh.HfKvCache(llama.config)
    _forward(llama, ids, cache, attention_mask=torch.tensor([[0, 0, 1, 1, 1, 1]]))
    more = torch.randint(3, 128, (1, 2))
    with pytest.raises(ValueError, match="padding must stay the sequence's leading"):
        _forward(llama, more, cache, attention_mask=torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]]))


def test_padded_batches_run_with_the_default_cache(llama):
    """Without an HfKvCache (transformers' DynamicCache) a left-padded batch runs through the
    per-row path, token for token what transformers' own attention generates."""
    a, b = torch.randint(3, 128, (1, 9)), torch.randint(3, 128, (1, 13))
    batch = torch.cat([torch.cat([torch.zeros(1, 4, dtype=torch.long), a], 1), b])
    mask = torch.ones_like(batch)
    mask[0, :4] = 0
    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        got = llama.generate(batch, **kw)
        assert torch.equal(got, _reference_twin(llama).generate(batch, **kw))


@pytest.mark.parametrize("name,pads,real", [("mistral", 5, 12), ("gemma3", 5, 12),
                                             ("mistral", 12, 2)])
def test_left_padding_on_sliding_layers(name, pads, real, tmp_path_factory):
    """Sliding layers: transformers' own cache keeps only a window of rows, so the padding is
    counted from the window's first position (12 + 2: a window that starts inside the
    padding); with either cache, at batch 1 and in a padded batch, the logits of every step
    follow transformers' own attention."""
    mk, mr, _, _ = tiny_models(name, tmp_path_factory, 1, max_position_embeddings=256)
    ids = torch.randint(3, 128, (1, real), generator=torch.Generator().manual_seed(3))
    pad = torch.cat([torch.zeros(1, pads, dtype=torch.long), ids], 1)
    mask = (torch.arange(pads + real) >= pads).long()[None]
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
              return_dict_in_generate=True, output_logits=True)
    with torch.no_grad():
        want = mr.generate(pad, **kw)
        for cache in (None, kh.HfKvCache(mk.config)):
            got = mk.generate(pad, **kw, **({} if cache is None else _cache(cache)))
            assert torch.equal(got.sequences, want.sequences)
            diff = (torch.stack(got.logits) - torch.stack(want.logits)).abs().max().item()
            assert diff <= TOL, diff
        other = torch.randint(3, 128, (1, pads + real),
                              generator=torch.Generator().manual_seed(4))
        batch, bmask = torch.cat([pad, other]), torch.cat([mask, torch.ones_like(mask)])
        kw.update(attention_mask=bmask)
        assert torch.equal(mk.generate(batch, **kw).sequences, mr.generate(batch, **kw).sequences)


def test_generate_with_a_padded_prompt_longer_than_a_step(llama):
    """kvcache.hf.generate feeds a left-padded prompt in one block (its steps would store the
    padding as rows): the tokens of the unpadded prompt."""
    ids = torch.randint(3, 128, (1, 20))
    pad = torch.cat([torch.zeros(1, 6, dtype=torch.long), ids], 1)
    mask = (torch.arange(26) >= 6).long()[None]
    with torch.no_grad():
        want = kh.generate(llama, ids, max_new_tokens=6, do_sample=False, prefill_step=8)
        got = kh.generate(llama, pad, attention_mask=mask, max_new_tokens=6, do_sample=False,
                          prefill_step=8, pad_token_id=0)
    assert torch.equal(got[:, 6:], want)


def test_cache_with_another_attention_raises(llama):
    llama.set_attn_implementation("sdpa")
    try:
        cache = kh.HfKvCache(llama.config)
        with pytest.raises(RuntimeError, match="did not go through kvcache"):
            _forward(llama, torch.randint(3, 128, (1, 6)), cache)
    finally:
        llama.set_attn_implementation("kvcache")


def test_training_mode_runs_until_a_gradient_or_dropout_is_needed(llama):
    """A model left in training mode (built from a config, never put in eval()) decodes: only
    attention dropout, which kvcache does not compute, and a backward pass through kvcache
    attention raise, each naming its reason."""
    ids = torch.randint(3, 128, (1, 8))
    want = _forward(llama, ids)
    llama.train()
    try:
        got = _forward(llama, ids, kh.HfKvCache(llama.config))          # under no_grad
        assert torch.equal(got, want)
        logits = llama(ids).logits                                       # gradients on
        assert torch.equal(logits.detach(), want) and logits.requires_grad
        with pytest.raises(RuntimeError, match="computes no gradients"):
            logits.sum().backward()
        llama.config.attention_dropout = 0.1
        for layer in llama.model.layers:
            layer.self_attn.attention_dropout = 0.1
        with pytest.raises(RuntimeError, match="attention dropout"), torch.no_grad():
            llama(ids)
    finally:
        llama.config.attention_dropout = 0.0
        for layer in llama.model.layers:
            layer.self_attn.attention_dropout = 0.0
        llama.eval()
        llama.zero_grad(set_to_none=True)
    _forward(llama, ids)                                  # eval mode ignores the dropout rate


@pytest.mark.parametrize("implementation", ["static", "sliding_window"])
def test_static_caches_are_refused_with_their_reason(llama, implementation):
    ids = torch.randint(3, 128, (1, 6))
    with pytest.raises(NotImplementedError, match="static") as info, torch.no_grad():
        llama.generate(ids, max_new_tokens=3, do_sample=False,
                       cache_implementation=implementation, pad_token_id=0)
    assert "HfKvCache" in str(info.value) and "overlay" not in str(info.value)
    # a StaticCache whose length fits the prompt exactly passes the prompt; its first decode
    # step is refused by the mask, with the same reason
    static = transformers.StaticCache(config=llama.config, max_cache_len=6)
    with pytest.raises(NotImplementedError, match="static"), torch.no_grad():
        llama.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0,
                       **_cache(static))


@pytest.mark.parametrize("mode", ["f32", "q8", "q4", "k8v4"])
def test_keys_values_and_indexing(llama, mode):
    """Layers expose their rows as transformers' do: (1, kv_heads, seq, head_dim) float32,
    exactly transformers' own keys for float32 storage, their dequantised values otherwise;
    the cache indexes and iterates as (keys, values) pairs."""
    ids = torch.randint(3, 128, (1, 40))
    ref = transformers.DynamicCache(config=llama.config)     # the same model's own rows
    _forward(llama, ids, ref)
    cache = kh.HfKvCache(llama.config, mode=mode)
    assert cache[0] == (None, None) and cache.layers[1].keys is None
    _forward(llama, ids, cache)
    assert len(list(cache)) == len(cache.layers) == 2
    # layer 0's rows are the same inputs quantised: int8 within half a step of absmax / 127,
    # 4-bit within half a step of range / 15 (later layers also see the quantised attention)
    bound = {"f32": (0.0, 0.0), "q8": (0.5 / 127, 0.5 / 127), "q4": (1 / 15, 1 / 15),
             "k8v4": (0.5 / 127, 1 / 15)}[mode]
    for i, (k, v) in enumerate(cache):
        want_k, want_v = ref.layers[i].keys, ref.layers[i].values
        assert k.shape == v.shape == want_k.shape == (1, 2, 40, 16)
        assert k.dtype == v.dtype == torch.float32
        assert torch.equal(cache[i - 2][0], k)                        # negative indices
        if i == 0 or mode == "f32":
            for got, want, b in ((k, want_k, bound[0]), (v, want_v, bound[1])):
                err = (got - want).abs().max().item()
                assert err <= b * 2 * want.abs().max().item(), (i, err)
    if mode == "f32":                       # a view of the storage, no copy
        kv = cache.kv_layers[0]
        assert cache[0][0][0, 1].numpy().ctypes.data == kv.head_keys(1).ctypes.data
    else:                                   # the values the kernels read: int8 / 4-bit exact
        assert not torch.equal(cache[0][0], ref.layers[0].keys)
    with pytest.raises(IndexError):
        cache[2]
    with pytest.raises(AttributeError, match="read-only"):
        cache.layers[0].keys = torch.zeros(1)
    taken = cache[1][1]
    cache.crop(-10)
    assert cache[1][1].shape == (1, 2, 30, 16)
    if mode == "f32":                       # a view: valid until the cache changes
        _forward(llama, ids[:, 30:], cache)             # the rolled-back rows, again
        assert torch.equal(taken, cache[1][1])


def test_low_precision_model_runs(llama):
    ids = torch.randint(3, 128, (1, 12))
    want = _forward(llama, ids)
    low = transformers.LlamaForCausalLM(llama.config).eval()
    low.load_state_dict(llama.state_dict())
    low = low.to(torch.bfloat16)
    got = _forward(low, ids, kh.HfKvCache(low.config))
    assert got.dtype == torch.bfloat16
    assert torch.isfinite(got).all()
    assert (got.float() - want).abs().max().item() < 0.5


def test_modes_and_layer_types():
    assert kh.parse_mode("q8") == kc.KvMode.Q8(True, True)
    assert kh.parse_mode("Q8K") == kc.KvMode.Q8(True, False)
    assert kh.parse_mode("q8v") == kc.KvMode.Q8(False, True)
    assert kh.parse_mode("f32") == kc.KvMode.F32
    assert kh.parse_mode(kc.KvMode.F32) == kc.KvMode.F32
    assert kh.parse_mode("q4") == kc.KvMode.of(4, 4)
    assert kh.parse_mode("k8v4") == kc.KvMode.of(8, 4)
    with pytest.raises(ValueError, match="expected one of 'f32'"):
        kh.parse_mode("q2")
    with pytest.raises(TypeError):
        kh.parse_mode(8)
    cfg = transformers.Gemma2Config(**_COMMON, num_hidden_layers=4, sliding_window=8)
    cache = kh.HfKvCache(cfg, mode="q8")
    assert cache.is_sliding == [True, False, True, False]
    assert len(cache) == 4 and bool(kh.HfKvCache())      # an empty cache is still truthy
    assert "Q8" in repr(cache)
    assert cache.is_croppable and not cache.is_compileable
    odd = types.SimpleNamespace(num_hidden_layers=2,
                                layer_types=["full_attention", "linear_attention"])
    with pytest.raises(NotImplementedError, match="linear_attention"):
        kh.HfKvCache(odd)


@pytest.mark.parametrize("cfg_name, model_name, extra", [
    # transformers' Llama ignores a sliding_window key; Mistral ignores layer_types
    ("LlamaConfig", "LlamaForCausalLM", dict(sliding_window=8)),
    ("MistralConfig", "MistralForCausalLM",
     dict(sliding_window=8, layer_types=["full_attention", "sliding_attention"])),
])
def test_windows_the_model_ignores_are_ignored(cfg_name, model_name, extra):
    config = getattr(transformers, cfg_name)(**_COMMON, num_hidden_layers=2, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).eval()
    ids = torch.randint(3, 128, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    want = _forward(model, ids)
    model.set_attn_implementation("kvcache")
    cache = kh.HfKvCache(model.config)
    expected = None if cfg_name == "LlamaConfig" else 8
    assert [layer.sliding_window for layer in cache.layers] == [expected] * 2
    diff = (_forward(model, ids, cache) - want).abs().max().item()
    assert diff <= TOL


def test_register_is_idempotent():
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    assert kh.register() == kh.register() == "kvcache"
    assert ALL_ATTENTION_FUNCTIONS["kvcache"] is kh.kvcache_attention
    assert ALL_MASK_ATTENTION_FUNCTIONS["kvcache"] is kh.kvcache_mask


def test_import_without_transformers(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    for name in [m for m in sys.modules if m == "kvcache.hf" or m.startswith("kvcache.hf.")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(ImportError, match="pip install"):
        import kvcache.hf  # noqa: F401
    code = ("import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None; "
            "import kvcache; assert 'kvcache.hf' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
