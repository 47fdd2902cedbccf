"""The runner's model description: :class:`ModelConfig`, read from a transformers ``config.json``.

Both config layouts are read: transformers 5's ``rope_parameters`` / ``layer_types`` and the
4.x ``rope_theta`` / ``rope_scaling`` keys.  A key the file leaves out takes the family's
default from transformers' config class (:data:`FAMILY_DEFAULTS`).  Which layers get a sliding
window is decided by :func:`kvcache._windows.layer_windows`, the rule :mod:`kvcache.hf` uses
too.  :func:`parse_layers` reads the O(1) layer selection.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Union

from .._validate import as_int
from .._windows import layer_windows

__all__ = ["ACTIVATIONS", "FAMILIES", "FAMILY_DEFAULTS", "MULTIMODAL", "ModelConfig",
           "parse_layers", "read_config"]

#: The model families (``model_type``) the runner decodes.
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text")
#: The Gemma families: ``1 + w`` norms, sandwich norms, embeddings scaled by sqrt(hidden),
#: ``query_pre_attn_scalar``.
GEMMA_FAMILIES = ("gemma2", "gemma3_text")
#: Families with a per-head RMSNorm of q and k before RoPE (``q_norm`` / ``k_norm``).
QK_NORM_FAMILIES = ("qwen3", "gemma3_text")
#: Multimodal checkpoints whose language model the runner decodes (its ``text_config``; the
#: vision tower is left out, :func:`kvcache.runner.weights.text_model_weights`), and the
#: family of that language model.
MULTIMODAL = {"gemma3": "gemma3_text"}
#: RoPE variants the runner computes.
ROPE_TYPES = ("default", "linear", "llama3", "freq_factors")
#: MLP activations the runner computes (``hidden_act`` / Gemma's ``hidden_activation``).
ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu_tanh")

#: What transformers' config classes (5.24) assume for keys a config.json leaves out.
FAMILY_DEFAULTS: dict[str, dict[str, object]] = {
    "llama": {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
              "tie_word_embeddings": False},
    "mistral": {"hidden_act": "silu", "sliding_window": 4096, "tie_word_embeddings": False},
    "qwen2": {"hidden_act": "silu", "sliding_window": 4096, "use_sliding_window": False,
              "max_window_layers": 28, "tie_word_embeddings": False},
    "qwen3": {"hidden_act": "silu", "attention_bias": False, "head_dim": 128,
              "sliding_window": 4096, "use_sliding_window": False, "max_window_layers": 28,
              "tie_word_embeddings": False},
    "gemma2": {"hidden_activation": "gelu_pytorch_tanh", "attention_bias": False,
               "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096,
               "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
               "tie_word_embeddings": True},
    "gemma3_text": {"hidden_activation": "gelu_pytorch_tanh", "attention_bias": False,
                    "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096,
                    "final_logit_softcapping": None, "rope_theta": 1_000_000.0,
                    "rope_local_base_freq": 10_000.0, "tie_word_embeddings": True},
}


@dataclass(frozen=True)
class ModelConfig:
    """What the runner needs from a ``config.json`` (see :meth:`from_hf`)."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] = field(default_factory=dict)   # {"rope_type": ..., parameters}
    hidden_act: str = "silu"
    qkv_bias: bool = False          # q/k/v projection biases (Qwen2 always; others' attention_bias)
    o_bias: bool = False            # o_proj bias (attention_bias of Llama, Qwen3 and the Gemmas)
    mlp_bias: bool = False          # gate/up/down biases (Llama mlp_bias)
    layer_windows: tuple[int | None, ...] = ()    # per layer: sliding window or None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    query_pre_attn_scalar: float | None = None
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    #: the RoPE of the layers typed ``sliding_attention`` when it differs from the global one
    #: (Gemma 3's local base): ``{"rope_theta": ..., "rope_type": ..., parameters}``
    local_rope: dict[str, Any] | None = None
    #: the layers that use ``local_rope`` (Gemma 3's sliding-attention layers, window or not)
    local_rope_layers: tuple[int, ...] = ()

    @property
    def gemma(self) -> bool:
        """True for the Gemma families (``1 + w`` norms, sandwich norms, scaled embeddings)."""
        return self.family in GEMMA_FAMILIES

    @property
    def qk_norm(self) -> bool:
        """True when q and k get a per-head RMSNorm before RoPE (Qwen3, Gemma 3)."""
        return self.family in QK_NORM_FAMILIES

    @property
    def scale(self) -> float:
        """Attention score scale: ``query_pre_attn_scalar ** -0.5`` (Gemma-2) or
        ``head_dim ** -0.5``."""
        base = self.query_pre_attn_scalar if self.query_pre_attn_scalar else self.head_dim
        scale: float = float(base) ** -0.5
        return scale

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> ModelConfig:
        """Read a transformers ``config.json`` dict (4.x or 5.x layout).

        A key the file leaves out takes the family's default from transformers' config class
        (Gemma-2: head_dim 256, softcaps 50 / 30, query_pre_attn_scalar 256, window 4096, tied
        embeddings; Mistral: window 4096; Qwen2: q/k/v biases, windows off; Qwen3: head_dim
        128; Gemma 3: RoPE bases 1e6 global and 1e4 local, sliding layers five in six, ...);
        an explicit null means none, as it does there."""
        mt = cfg.get("model_type")
        if mt in MULTIMODAL:
            cfg = _text_config(cfg)
            mt = cfg.get("model_type")
        if mt not in FAMILIES:
            raise ValueError(f"config.json: model_type {mt!r} is not supported; expected one of "
                             f"{', '.join(FAMILIES)}")
        if cfg.get("use_bidirectional_attention"):
            raise ValueError("config.json: use_bidirectional_attention is true; the runner "
                             "decodes causal models only")
        cfg = dict(FAMILY_DEFAULTS[mt], **cfg)
        try:
            n_layers = int(cfg["num_hidden_layers"])
            nh = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            vocab = int(cfg["vocab_size"])
            inter = int(cfg["intermediate_size"])
        except KeyError as exc:
            raise ValueError(f"config.json: the key {exc.args[0]!r} is missing") from None
        hd = int(cfg.get("head_dim") or hidden // nh)
        nkv = int(cfg.get("num_key_value_heads") or nh)
        rope, local_rope = _rope_parameters(cfg, mt)
        try:
            windows = layer_windows(cfg, n_layers, mt)
        except ValueError as exc:
            raise ValueError(f"config.json: {str(exc).removeprefix('config: ')}") from None
        eos = cfg.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        gemma = mt in GEMMA_FAMILIES
        act = cfg.get("hidden_activation") if gemma else cfg.get("hidden_act")
        if act not in ACTIVATIONS:
            raise ValueError(f"config.json: activation {act!r} is not supported; expected one of "
                             f"{', '.join(ACTIVATIONS)}")
        attn_bias = bool(cfg.get("attention_bias"))
        return cls(
            family=mt, vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
            num_layers=n_layers, num_heads=nh, num_kv_heads=nkv, head_dim=hd,
            rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.pop("rope_theta")), rope_scaling=rope, hidden_act=act,
            qkv_bias=True if mt == "qwen2" else (attn_bias and mt != "mistral"),
            o_bias=attn_bias and mt in ("llama", "qwen3") + GEMMA_FAMILIES,
            mlp_bias=bool(cfg.get("mlp_bias")) and mt == "llama",
            layer_windows=windows,
            # Gemma 3's attention never passes its softcap on (transformers ignores the key)
            attn_softcap=cfg.get("attn_logit_softcapping") if mt == "gemma2" else None,
            final_softcap=cfg.get("final_logit_softcapping") if gemma else None,
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar") if gemma else None,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings")),
            bos_token_id=cfg.get("bos_token_id"), eos_token_id=eos,
            local_rope=(None if local_rope is None else
                        dict(local_rope, rope_theta=float(local_rope["rope_theta"]))),
            local_rope_layers=() if local_rope is None else _sliding_typed(cfg, n_layers, mt))


_PER_TYPE = ("full_attention", "sliding_attention")


def _text_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The language model's config of a multimodal ``config.json`` (Gemma 3 4B and larger):
    its ``text_config``, with the model's own token ids and embedding tying where the text
    config leaves them out."""
    mt = str(cfg.get("model_type"))
    text = cfg.get("text_config")
    if not isinstance(text, Mapping):
        raise ValueError(f"config.json: model_type {mt!r} without a text_config")
    out = dict(text)
    out.setdefault("model_type", MULTIMODAL[mt])
    if out["model_type"] != MULTIMODAL[mt]:
        raise ValueError(f"config.json: text_config.model_type {out['model_type']!r} is not "
                         f"{MULTIMODAL[mt]!r}")
    for key in ("tie_word_embeddings", "bos_token_id", "eos_token_id"):
        if key in cfg:
            out[key] = cfg[key]
    return out


def _sliding_typed(cfg: Mapping[str, Any], n_layers: int, family: str) -> tuple[int, ...]:
    """The layers of type ``sliding_attention``, whether the config gives them a window or not
    (the layer rule asked with a stand-in window)."""
    typed = layer_windows(dict(cfg, sliding_window=1), n_layers, family)
    return tuple(i for i, w in enumerate(typed) if w is not None)


def _rope_parameters(cfg: Mapping[str, Any],
                     family: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The global RoPE (theta under ``rope_theta``, type under ``rope_type``) and, for Gemma 3,
    the sliding layers' own; ValueError for a variant the runner does not compute.

    ``rope_parameters`` (5.x) is merged with the 4.x ``rope_theta`` / ``rope_scaling`` keys;
    Gemma 3's 5.x layout gives one dict per layer type, its 4.x layout ``rope_theta`` and
    ``rope_scaling`` for global layers and ``rope_local_base_freq`` for sliding ones."""
    params = dict(cfg.get("rope_parameters") or {})
    if family != "gemma3_text":
        if any(k in params for k in _PER_TYPE):
            raise ValueError(f"config.json: per-layer-type rope_parameters are not supported "
                             f"for {family}")
        return _one_rope(params, cfg, cfg.get("rope_theta", 10000.0)), None
    # as Gemma3TextConfig reads them: one dict per layer type (default RoPE where one is
    # missing), a 4.x rope_scaling applied to the global layers', the bases from rope_theta
    # and rope_local_base_freq where a dict names none
    if params and not any(k in params for k in _PER_TYPE):
        raise ValueError("config.json: gemma3_text takes rope_parameters per layer type "
                         "(full_attention, sliding_attention), got a flat dict")
    glob = dict(params.get("full_attention") or {"rope_type": "default"})
    local = dict(params.get("sliding_attention") or {"rope_type": "default"})
    legacy = dict(cfg.get("rope_scaling") or {})
    if legacy:
        if "type" in legacy and "rope_type" not in legacy:
            if "rope_type" in glob:     # transformers keeps the dict's type, ignores 'type'
                raise ValueError("config.json: gemma3_text's rope_scaling names its type under "
                                 "the old key 'type', which transformers 5 does not read here "
                                 "(it keeps default RoPE); write 'rope_type'")
            legacy["rope_type"] = legacy.pop("type")
        glob.update(legacy)
    glob.setdefault("rope_theta", cfg.get("rope_theta", 1_000_000.0))
    local.setdefault("rope_theta", cfg.get("rope_local_base_freq", 10_000.0))
    return _one_rope(glob, {}, None), _one_rope(local, {}, None)


def _one_rope(rope: dict[str, Any], cfg: Mapping[str, Any], theta: Any) -> dict[str, Any]:
    """One RoPE description: ``rope`` (a ``rope_parameters`` dict) completed from the 4.x keys
    of ``cfg`` (``rope_scaling``) and the default ``theta``, checked."""
    rope = dict(rope)
    if "rope_theta" not in rope:
        rope["rope_theta"] = theta
    if rope["rope_theta"] is None:
        raise ValueError("config.json: rope_theta is null")
    legacy = dict(cfg.get("rope_scaling") or {})
    if "type" in legacy and "rope_type" not in legacy:
        legacy["rope_type"] = legacy.pop("type")          # transformers 4.x's older key
    if legacy and rope.get("rope_type", "default") == "default":
        rope.update(legacy)
    rtype = rope.get("rope_type", rope.get("type", "default"))
    if rtype not in ROPE_TYPES:
        raise ValueError(f"config.json: rope type {rtype!r} is not supported; expected one "
                         f"of {', '.join(ROPE_TYPES)}")
    rope["rope_type"] = rtype
    rope.pop("type", None)
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("config.json: partial_rotary_factor != 1 is not supported")
    return rope


def read_config(path: str | os.PathLike[str]) -> ModelConfig:
    """The :class:`ModelConfig` of checkpoint folder ``path`` (its ``config.json``)."""
    with open(os.path.join(os.fspath(path), "config.json")) as f:
        return ModelConfig.from_hf(json.load(f))


LayerSpec = Union[str, Iterable[int], None]


def parse_layers(spec: LayerSpec, n_layers: int) -> tuple[int, ...]:
    """Layer selection as the upstream engine reads it: ``"all"``, ``"deepN"`` (the
    N deepest layers), ``"i,j,k"`` (out-of-range indices dropped), or ``""`` / ``"off"`` /
    ``"0"`` / ``"none"`` for none.  A sequence of ints is taken as a list.

    Unlike upstream, a malformed spec raises ValueError instead of meaning "none"."""
    if spec is None:
        return ()
    if not isinstance(spec, str):
        try:
            items = [as_int("o1 layer", i) for i in spec]
        except TypeError:
            raise TypeError(f"o1 layers: expected a string spec or a sequence of ints, got "
                            f"{spec!r}") from None
        return tuple(sorted({i for i in items if 0 <= i < n_layers}))
    s = spec.strip().lower()
    if s in ("", "off", "0", "none"):
        return ()
    if s == "all":
        return tuple(range(n_layers))
    if s.startswith("deep") and s[4:].isdigit():
        n = min(int(s[4:]), n_layers)
        return tuple(range(n_layers - n, n_layers))
    try:
        items = [int(p) for p in s.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"o1 layers: expected 'all', 'deepN', 'none' or a comma-separated list "
                         f"of layer indices, got {spec!r}") from None
    return tuple(sorted({i for i in items if 0 <= i < n_layers}))
