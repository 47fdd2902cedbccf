"""Checkpoint tensors for the runner: reading safetensors and building each layer's products.

:func:`load_safetensors` reads a checkpoint folder (sharded or not) as float32 NumPy arrays;
:func:`layers_from` turns Hugging Face tensor names into :class:`LayerWeights`, the fused
(in, out) matrices the forward pass multiplies by, recording which tensors were used so that
the runner can refuse a checkpoint holding tensors it would silently leave out;
:func:`random_weights` makes a random checkpoint of a :class:`~kvcache.runner.ModelConfig`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
import numpy as np
import numpy.typing as npt

from .config import ModelConfig

__all__ = ["Array", "LayerWeights", "Tracked", "as_f32", "layers_from", "load_safetensors",
           "random_weights", "take", "text_model_weights"]

#: A float32 NumPy array (every tensor the runner holds).
Array = npt.NDArray[np.float32]
_F32 = np.float32


def as_f32(a: npt.NDArray[Any]) -> Array:
    """``a``, typed as the float32 array it is: NumPy's stubs type some float32 arithmetic as
    float64 or Any (depending on the Python version mypy checks for)."""
    return a


def load_safetensors(path: str | os.PathLike[str]) -> dict[str, Array]:
    """Every tensor of a checkpoint folder as float32 NumPy arrays (sharded or not)."""
    try:
        from safetensors.numpy import load_file
    except ImportError:
        raise ImportError("reading checkpoints needs the safetensors package: pip install "
                          "safetensors (or the kvcache[runner] extra)") from None
    path = os.fspath(path)
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors file")
    try:
        import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy for bf16 checkpoints)
    except ImportError:
        pass
    out: dict[str, Array] = {}
    for name in files:
        try:
            tensors = load_file(os.path.join(path, name))
        except TypeError as exc:
            raise TypeError(f"{name}: {exc}; a bfloat16 checkpoint needs ml_dtypes: pip install "
                            f"ml_dtypes (or the kvcache[runner] extra)") from None
        except OSError:
            raise
        except Exception as exc:          # safetensors' own error type for a damaged file
            raise ValueError(f"{name}: not a readable safetensors file ({exc})") from None
        for key, arr in tensors.items():
            out[key] = np.ascontiguousarray(arr, dtype=_F32)
    return out


#: Where a multimodal checkpoint keeps its language model (transformers 4.x's layout, which 5.x
#: still writes, and 5.x's own), and the prefixes of what the runner leaves out.
_TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                    "model.multi_modal_projector.")


def text_model_weights(weights: Mapping[str, Array]) -> dict[str, Array]:
    """The language model's tensors of a multimodal checkpoint under the text model's names
    (``language_model.model.X`` or ``model.language_model.X`` -> ``model.X``); the vision
    tower and the multimodal projector are left out.  Any other tensor keeps its name (the
    runner then refuses it as unused)."""
    out: dict[str, Array] = {}
    for name, arr in weights.items():
        if name.startswith(_VISION_PREFIXES):
            continue
        for old, new in _TEXT_PREFIXES:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        out[name] = arr
    return out


class Tracked(dict[str, Array]):
    """The checkpoint's tensors, remembering which were read (to refuse unknown ones)."""

    def __init__(self, weights: Mapping[str, Array]) -> None:
        super().__init__(weights)
        self.used: set[str] = set()


@dataclass
class LayerWeights:
    """One decoder layer's weights, as the forward pass uses them.

    Matrices are (in, out) C-contiguous products, q|k|v and gate|up fused: ``x @ W.T`` with
    the checkpoint's row-major (out, in) W runs OpenBLAS's transposed GEMV, which took 8 ms for
    a 2816 x 1024 matrix on 2 threads here against 0.3 ms for ``x @ Wt``; fusing also saves
    three of the seven products per layer."""

    qkv: Array
    bqkv: Array | None
    wo_t: Array
    bo: Array | None
    gate_up: Array
    b_gate_up: Array | None
    down_t: Array
    b_down: Array | None
    norm_attn_in: Array
    norm_mlp_in: Array
    norm_attn_out: Array | None = None     # the Gemmas' sandwich norms
    norm_mlp_out: Array | None = None
    q_norm: Array | None = None            # per-head RMSNorm gains of q and k (head_dim,):
    k_norm: Array | None = None            # Qwen3, Gemma 3


def take(weights: Tracked, key: str, shape: tuple[int, ...]) -> Array:
    """Tensor ``key`` of a :class:`Tracked` checkpoint, checked against ``shape``."""
    if key not in weights:
        raise KeyError(f"checkpoint: tensor {key!r} is missing")
    weights.used.add(key)
    arr = weights[key]
    if arr.shape != shape:
        raise ValueError(f"checkpoint: tensor {key!r} has shape {arr.shape}, expected {shape}")
    return arr


def _fused(weights: Tracked, prefix: str, names: Sequence[str], rows: Sequence[int], cols: int,
           bias: bool) -> tuple[Array, Array | None]:
    """The (in, out) product of the stacked ``{prefix}{name}_proj`` matrices (rows[k], cols)
    and their stacked biases (None when ``bias`` is False)."""
    mats = [take(weights, f"{prefix}{n}_proj.weight", (r, cols)) for n, r in zip(names, rows)]
    b = (np.concatenate([take(weights, f"{prefix}{n}_proj.bias", (r,))
                         for n, r in zip(names, rows)]) if bias else None)
    return np.ascontiguousarray(np.concatenate(mats).T), b


def layers_from(weights: Tracked, cfg: ModelConfig) -> list[LayerWeights]:
    """Every decoder layer's :class:`LayerWeights`, read from ``weights`` under Hugging Face
    names (``model.layers.{i}.self_attn.q_proj.weight``, ...)."""
    H, nh, nkv, hd, im = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                          cfg.intermediate_size)
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        qkv, bqkv = _fused(weights, a, "qkv", (nh * hd, nkv * hd, nkv * hd), H, cfg.qkv_bias)
        wo_t, bo = _fused(weights, a, ("o",), (H,), nh * hd, cfg.o_bias)
        gate_up, b_gate_up = _fused(weights, m, ("gate", "up"), (im, im), H, cfg.mlp_bias)
        down_t, b_down = _fused(weights, m, ("down",), (H,), im, cfg.mlp_bias)
        layer = LayerWeights(
            qkv=qkv, bqkv=bqkv, wo_t=wo_t, bo=bo, gate_up=gate_up, b_gate_up=b_gate_up,
            down_t=down_t, b_down=b_down,
            norm_attn_in=take(weights, p + "input_layernorm.weight", (H,)),
            norm_mlp_in=take(weights, p + ("pre_feedforward_layernorm.weight" if cfg.gemma
                                           else "post_attention_layernorm.weight"), (H,)))
        if cfg.gemma:
            layer.norm_attn_out = take(weights, p + "post_attention_layernorm.weight", (H,))
            layer.norm_mlp_out = take(weights, p + "post_feedforward_layernorm.weight", (H,))
        if cfg.qk_norm:
            layer.q_norm = take(weights, a + "q_norm.weight", (hd,))
            layer.k_norm = take(weights, a + "k_norm.weight", (hd,))
        layers.append(layer)
    return layers


def random_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, Array]:
    """Random float32 weights of ``cfg`` under Hugging Face tensor names (std 0.02 matrices,
    unit norms)."""
    rng = np.random.default_rng(seed)
    H, nh, nkv, hd, im = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                          cfg.intermediate_size)

    def mat(*shape: int) -> Array:
        return as_f32((rng.standard_normal(shape, dtype=_F32) * _F32(0.02)).astype(_F32))

    def norm(size: int = H) -> Array:     # Gemma stores norm weights as w - 1
        return np.full(size, 0.0 if cfg.gemma else 1.0, dtype=_F32)

    w = {"model.embed_tokens.weight": mat(cfg.vocab_size, H), "model.norm.weight": norm()}
    if not cfg.tie_word_embeddings:
        w["lm_head.weight"] = mat(cfg.vocab_size, H)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        w.update({p + "self_attn.q_proj.weight": mat(nh * hd, H),
                  p + "self_attn.k_proj.weight": mat(nkv * hd, H),
                  p + "self_attn.v_proj.weight": mat(nkv * hd, H),
                  p + "self_attn.o_proj.weight": mat(H, nh * hd),
                  p + "mlp.gate_proj.weight": mat(im, H), p + "mlp.up_proj.weight": mat(im, H),
                  p + "mlp.down_proj.weight": mat(H, im),
                  p + "input_layernorm.weight": norm(),
                  p + "post_attention_layernorm.weight": norm()})
        if cfg.qkv_bias:
            for n, size in (("q", nh * hd), ("k", nkv * hd), ("v", nkv * hd)):
                w[p + f"self_attn.{n}_proj.bias"] = mat(size)
        if cfg.o_bias:
            w[p + "self_attn.o_proj.bias"] = mat(H)
        if cfg.mlp_bias:
            for n, size in (("gate", im), ("up", im), ("down", H)):
                w[p + f"mlp.{n}_proj.bias"] = mat(size)
        if cfg.gemma:
            w[p + "pre_feedforward_layernorm.weight"] = norm()
            w[p + "post_feedforward_layernorm.weight"] = norm()
        if cfg.qk_norm:
            w[p + "self_attn.q_norm.weight"] = norm(hd)
            w[p + "self_attn.k_norm.weight"] = norm(hd)
    return w
