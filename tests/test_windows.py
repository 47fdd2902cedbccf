"""The per-layer sliding-window rule (kvcache._windows) shared by kvcache.runner and kvcache.hf.

transformers' own decision is read off a forward pass: an attention function registered for
the probe records, per layer, the 4-D mask transformers built (how many keys the last query may
see) and the ``sliding_window`` it passed.  The rule must give the same windows from the config
object (what kvcache.hf reads), from its saved ``config.json`` dict (what the runner reads) and
from the 4.x-style dict without ``layer_types``.
"""

from __future__ import annotations

import json

import pytest

from kvcache._windows import layer_windows

N = 12                                  # probe sequence length (> every window below)
COMMON = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
              num_attention_heads=2, num_key_value_heads=1)
ALT = ["sliding_attention", "full_attention"] * 2
CASES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama-stray-window": ("LlamaConfig", "LlamaForCausalLM", dict(sliding_window=5)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=5)),
    "mistral-no-window": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
    "mistral-layer-types": ("MistralConfig", "MistralForCausalLM",
                            dict(sliding_window=5, layer_types=ALT)),
    "qwen2-max-window-layers-1": ("Qwen2Config", "Qwen2ForCausalLM",
                                  dict(use_sliding_window=True, sliding_window=5,
                                       max_window_layers=1)),
    "qwen2-max-window-layers-3": ("Qwen2Config", "Qwen2ForCausalLM",
                                  dict(use_sliding_window=True, sliding_window=5,
                                       max_window_layers=3)),
    "qwen2-default-max-window-layers": ("Qwen2Config", "Qwen2ForCausalLM",
                                        dict(use_sliding_window=True, sliding_window=5)),
    "qwen2-window-off": ("Qwen2Config", "Qwen2ForCausalLM",
                         dict(use_sliding_window=False, sliding_window=5, max_window_layers=1)),
    "qwen2-layer-types": ("Qwen2Config", "Qwen2ForCausalLM",
                          dict(use_sliding_window=True, sliding_window=5, max_window_layers=1,
                               layer_types=ALT)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=8, sliding_window=5)),
    "gemma2-layer-types": ("Gemma2Config", "Gemma2ForCausalLM",
                           dict(head_dim=8, sliding_window=5,
                                layer_types=["full_attention"] * 3 + ["sliding_attention"])),
}


# ---------------------------------------------------------------------------- the rule alone
def test_rule_on_config_dicts():
    n4 = dict(num_hidden_layers=4)
    assert layer_windows(dict(n4, model_type="llama", sliding_window=8)) == (None,) * 4
    assert layer_windows(dict(n4, model_type="mistral", sliding_window=8,
                              layer_types=ALT)) == (8,) * 4
    qwen = dict(n4, model_type="qwen2", use_sliding_window=True, sliding_window=8)
    assert layer_windows(dict(qwen, max_window_layers=2)) == (None, None, 8, 8)
    assert layer_windows(qwen) == (None,) * 4                  # Qwen2Config's default: 28
    assert layer_windows(dict(qwen, max_window_layers=2, use_sliding_window=False)) == (None,) * 4
    assert layer_windows(dict(qwen, layer_types=ALT)) == (8, None, 8, None)
    assert layer_windows(dict(n4, model_type="gemma2", sliding_window=8)) == (8, None, 8, None)
    assert layer_windows(dict(n4, model_type="gemma3_text", sliding_window=8,
                              layer_types=ALT[::-1])) == (None, 8, None, 8)
    assert layer_windows(dict(n4, model_type="gemma2", sliding_window=None)) == (None,) * 4
    # Gemma 3 without layer_types: every layer but each pattern-th (6 by default) slides
    n8 = {"num_hidden_layers": 8, "model_type": "gemma3_text", "sliding_window": 8}
    assert layer_windows(n8) == (8,) * 5 + (None,) + (8,) * 2
    assert layer_windows(dict(n8, sliding_window_pattern=2)) == (8, None) * 4
    assert layer_windows(dict(n8, sliding_window_pattern=1)) == (None,) * 8
    with pytest.raises(ValueError, match="sliding_window_pattern must be >= 1"):
        layer_windows(dict(n8, sliding_window_pattern=0))
    assert layer_windows({"model_type": "mistral", "sliding_window": 3}, 2) == (3, 3)
    with pytest.raises(ValueError, match="layer_types has 2 entries for 4 layers"):
        layer_windows(dict(n4, model_type="gemma2", sliding_window=8, layer_types=ALT[:2]))
    with pytest.raises(ValueError, match="num_hidden_layers"):
        layer_windows({"model_type": "mistral"})


# ---------------------------------------------------------------------------- against transformers
_RECORD: dict[int, tuple[object, object]] = {}
_PROBE = "kvcache_window_probe"


def _probe_attention(module, query, key, value, attention_mask, **kwargs):
    import torch
    _RECORD[module.layer_idx] = (attention_mask, kwargs.get("sliding_window"))
    b, h, n, d = query.shape
    return torch.zeros(b, n, h, d, dtype=query.dtype), None


@pytest.fixture(scope="module")
def probe():
    torch = pytest.importorskip("torch")
    tf = pytest.importorskip("transformers")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask
    AttentionInterface.register(_PROBE, _probe_attention)
    AttentionMaskInterface.register(_PROBE, eager_mask)     # always a 4-D mask to read

    def windows(cfg_name, model_name, kw):
        """(config, per layer: the window transformers' mask applies, the window it passes)."""
        cfg = getattr(tf, cfg_name)(**COMMON, **json.loads(json.dumps(kw)))
        cfg._attn_implementation = _PROBE
        model = getattr(tf, model_name)(cfg).eval()
        _RECORD.clear()
        with torch.no_grad():
            model(torch.arange(N)[None], use_cache=False)
        masked, passed = [], []
        for i in range(cfg.num_hidden_layers):
            mask, window = _RECORD[i]
            seen = int((mask[0, 0, -1] == 0).sum())        # keys the last query may see
            masked.append(seen if seen < N else None)
            passed.append(window)
        return cfg, tuple(masked), tuple(passed)
    return windows


@pytest.mark.parametrize("case", list(CASES))
def test_rule_matches_transformers(probe, case):
    cfg_name, model_name, kw = CASES[case]
    cfg, masked, passed = probe(cfg_name, model_name, kw)
    assert masked == passed                      # transformers agrees with itself
    assert layer_windows(cfg) == masked          # the config object (kvcache.hf)
    assert layer_windows(cfg.to_dict()) == masked   # its config.json (kvcache.runner)
    legacy = {k: v for k, v in kw.items() if k != "layer_types"}   # a 4.x file: no layer_types
    _, want, _ = probe(cfg_name, model_name, legacy)
    assert layer_windows(dict(COMMON, model_type=cfg.model_type, **legacy)) == want


@pytest.mark.parametrize("case", list(CASES))
def test_runner_and_hf_agree(case):
    tf = pytest.importorskip("transformers")
    kh = pytest.importorskip("kvcache.hf")
    from kvcache.runner import ModelConfig
    cfg_name, _, kw = CASES[case]
    cfg = getattr(tf, cfg_name)(**COMMON, **json.loads(json.dumps(kw)))
    hf = tuple(layer.sliding_window for layer in kh.HfKvCache(cfg).layers)
    assert hf == ModelConfig.from_hf(cfg.to_dict()).layer_windows
