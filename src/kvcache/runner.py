"""A llama-style CPU runner on kvcache: Hugging Face checkpoints decoded through kvcache's caches.

:class:`Runner` loads a checkpoint folder (``config.json`` and ``*.safetensors``, sharded or
not, read with the ``safetensors`` package's NumPy loader) of the Llama, Mistral, Qwen2 or
Gemma-2 family and runs it in NumPy float32, with every attention layer's K/V in a
:class:`kvcache.KvCache` and attention computed by kvcache's kernels:

- grouped-query attention, RoPE with the config's theta and scaling (``default``, ``linear``,
  ``llama3``), RMSNorm (Gemma's ``1 + w`` form), SwiGLU / GeGLU MLPs, Qwen2's q/k/v biases,
  Mistral's sliding window, Gemma-2's attention-logit softcap, final-logit softcap,
  ``query_pre_attn_scalar``, alternating sliding/global layers and sandwich norms, tied
  embeddings;
- prefill runs the prompt as one block (``append`` of n positions, then ``attend_all_heads``
  of n queries, causal within the block); decode runs one position per step;
- KV storage f32 or q8 (``kv="q8"``), and the O(1) Nystrom override on chosen layers
  (``o1_layers``): those layers seal the prompt at the end of the prefill and decode with
  ``o1_step`` in constant time and memory;
- greedy or temperature / top-p sampling (:meth:`Runner.generate`), and speculative rollback
  (:meth:`Runner.rollback`, ``truncate_last`` on every layer).

Both config layouts are read: transformers 5's ``rope_parameters`` / ``layer_types`` and the
4.x ``rope_theta`` / ``rope_scaling`` keys (with Gemma-2's even layers sliding, as 4.x did).

``python -m kvcache generate`` (:func:`main`) is the command-line front end.

Numerics: float32 throughout (NumPy matmuls for the projections and the MLP), RoPE angles as
transformers computes them (float32 inverse frequencies times the position); the parity tests
against transformers hold prompt logits and 32 greedy steps to 1e-4.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field, replace

import numpy as np

from ._validate import as_int
from .layer import LayerKvCache
from .model import EvictionPolicy, KvCache
from .modes import KvMode

__all__ = ["ModelConfig", "Runner", "parse_layers", "main"]

_F32 = np.float32
FAMILIES = ("llama", "mistral", "qwen2", "gemma2")
_ROPE_TYPES = ("default", "linear", "llama3")


# ------------------------------------------------------------------------------ configuration
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
    rope_scaling: dict = field(default_factory=dict)   # {"rope_type": ..., parameters}
    hidden_act: str = "silu"
    qkv_bias: bool = False          # q/k/v projection biases (Qwen2 always; Llama, Gemma-2 opt.)
    o_bias: bool = False            # o_proj bias (Llama / Gemma-2 attention_bias)
    mlp_bias: bool = False          # gate/up/down biases (Llama mlp_bias)
    layer_windows: tuple = ()       # per layer: sliding window or None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    query_pre_attn_scalar: float | None = None
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: tuple = ()

    @property
    def gemma(self):
        return self.family == "gemma2"

    @property
    def scale(self):
        """Attention score scale: ``query_pre_attn_scalar ** -0.5`` (Gemma-2) or
        ``head_dim ** -0.5``."""
        base = self.query_pre_attn_scalar if self.query_pre_attn_scalar else self.head_dim
        return float(base) ** -0.5

    @classmethod
    def from_hf(cls, cfg):
        """Read a transformers ``config.json`` dict (4.x or 5.x layout).

        A key the file leaves out takes the family's default from transformers' config class
        (Gemma-2: head_dim 256, softcaps 50 / 30, query_pre_attn_scalar 256, window 4096, tied
        embeddings; Mistral: window 4096; Qwen2: q/k/v biases, windows off, ...); an explicit
        null means none, as it does there."""
        mt = cfg.get("model_type")
        if mt not in FAMILIES:
            raise ValueError(f"config.json: model_type {mt!r} is not supported; expected one of "
                             f"{', '.join(FAMILIES)}")
        cfg = dict(_FAMILY_DEFAULTS[mt], **cfg)
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
        rope = dict(cfg.get("rope_parameters") or {})
        if "rope_theta" not in rope:
            rope["rope_theta"] = cfg.get("rope_theta", 10000.0)
        legacy = dict(cfg.get("rope_scaling") or {})
        if "type" in legacy and "rope_type" not in legacy:
            legacy["rope_type"] = legacy.pop("type")          # transformers 4.x's older key
        if legacy and rope.get("rope_type", "default") == "default":
            rope.update(legacy)
        rtype = rope.get("rope_type", rope.get("type", "default"))
        if rtype not in _ROPE_TYPES:
            raise ValueError(f"config.json: rope type {rtype!r} is not supported; expected one "
                             f"of {', '.join(_ROPE_TYPES)}")
        rope["rope_type"] = rtype
        rope.pop("type", None)
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("config.json: partial_rotary_factor != 1 is not supported")
        windows = _layer_windows(cfg, mt, n_layers)
        eos = cfg.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        gemma = mt == "gemma2"
        act = cfg.get("hidden_activation") if gemma else cfg.get("hidden_act")
        if act not in _ACTIVATIONS:
            raise ValueError(f"config.json: activation {act!r} is not supported; expected one of "
                             f"{', '.join(_ACTIVATIONS)}")
        attn_bias = bool(cfg.get("attention_bias"))
        return cls(
            family=mt, vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
            num_layers=n_layers, num_heads=nh, num_kv_heads=nkv, head_dim=hd,
            rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.pop("rope_theta")), rope_scaling=rope, hidden_act=act,
            qkv_bias=True if mt == "qwen2" else (attn_bias and mt != "mistral"),
            o_bias=attn_bias and mt in ("llama", "gemma2"),
            mlp_bias=bool(cfg.get("mlp_bias")) and mt == "llama",
            layer_windows=windows,
            attn_softcap=cfg.get("attn_logit_softcapping") if gemma else None,
            final_softcap=cfg.get("final_logit_softcapping") if gemma else None,
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar") if gemma else None,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings")),
            bos_token_id=cfg.get("bos_token_id"), eos_token_id=eos)


# What transformers' config classes (5.24) assume for keys a config.json leaves out.
_FAMILY_DEFAULTS = {
    "llama": {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
              "tie_word_embeddings": False},
    "mistral": {"hidden_act": "silu", "sliding_window": 4096, "tie_word_embeddings": False},
    "qwen2": {"hidden_act": "silu", "sliding_window": 4096, "use_sliding_window": False,
              "max_window_layers": 28, "tie_word_embeddings": False},
    "gemma2": {"hidden_activation": "gelu_pytorch_tanh", "attention_bias": False,
               "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 4096,
               "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
               "tie_word_embeddings": True},
}


def _layer_windows(cfg, mt, n_layers):
    if mt == "llama":                         # transformers' Llama has no sliding window
        return (None,) * n_layers
    window = cfg.get("sliding_window")
    if mt == "qwen2" and not cfg.get("use_sliding_window", False):
        window = None
    types = cfg.get("layer_types")
    if types is None:
        if mt == "gemma2":                    # transformers 4.x: even layers slide
            types = ["sliding_attention" if i % 2 == 0 else "full_attention"
                     for i in range(n_layers)]
        elif mt == "qwen2":
            first = int(cfg.get("max_window_layers", n_layers))
            types = ["sliding_attention" if window and i >= first else "full_attention"
                     for i in range(n_layers)]
        else:
            types = ["sliding_attention" if window else "full_attention"] * n_layers
    if mt == "mistral":                       # Mistral applies its window on every layer
        types = ["sliding_attention" if window else "full_attention"] * n_layers
    if len(types) != n_layers:
        raise ValueError(f"config.json: layer_types has {len(types)} entries for {n_layers} "
                         f"layers")
    return tuple(int(window) if t == "sliding_attention" and window else None for t in types)


def _gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(_F32(math.sqrt(2.0 / math.pi)) * (x + _F32(0.044715) * x * x * x)))


def _silu(x):
    with np.errstate(over="ignore"):
        return x / (1.0 + np.exp(-x))


_ACTIVATIONS = {"silu": _silu, "gelu_pytorch_tanh": _gelu_tanh, "gelu_tanh": _gelu_tanh}


def parse_layers(spec, n_layers):
    """Layer selection as the upstream engine reads it (spec 6.7): ``"all"``, ``"deepN"`` (the
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


# ------------------------------------------------------------------------------ weights
def load_safetensors(path):
    """Every tensor of a checkpoint folder as float32 NumPy arrays (sharded or not)."""
    try:
        from safetensors.numpy import load_file
    except ImportError:
        raise ImportError("reading checkpoints needs the safetensors package: pip install "
                          "safetensors (or the kvcache[runner] extra)") from None
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
    out = {}
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


class _Tracked(dict):
    """The checkpoint's tensors, remembering which were read (to refuse unknown ones)."""

    def __init__(self, weights):
        super().__init__(weights)
        self.used = set()


@dataclass
class _Layer:
    """One decoder layer's weights, as the forward pass uses them.

    Matrices are (in, out) C-contiguous products, q|k|v and gate|up fused: ``x @ W.T`` with
    the checkpoint's row-major (out, in) W runs OpenBLAS's transposed GEMV, which took 8 ms for
    a 2816 x 1024 matrix on 2 threads here against 0.3 ms for ``x @ Wt``; fusing also saves
    three of the seven products per layer."""

    qkv: np.ndarray
    bqkv: np.ndarray | None
    wo_t: np.ndarray
    bo: np.ndarray | None
    gate_up: np.ndarray
    b_gate_up: np.ndarray | None
    down_t: np.ndarray
    b_down: np.ndarray | None
    norm_attn_in: np.ndarray
    norm_mlp_in: np.ndarray
    norm_attn_out: np.ndarray | None = None     # Gemma-2 sandwich norms
    norm_mlp_out: np.ndarray | None = None


def _take(weights, key, shape):
    """Tensor ``key`` of a :class:`_Tracked` checkpoint, checked against ``shape``."""
    if key not in weights:
        raise KeyError(f"checkpoint: tensor {key!r} is missing")
    weights.used.add(key)
    arr = weights[key]
    if arr.shape != shape:
        raise ValueError(f"checkpoint: tensor {key!r} has shape {arr.shape}, expected {shape}")
    return arr


def _fused(weights, prefix, names, rows, cols, bias):
    """The (in, out) product of the stacked ``{prefix}{name}_proj`` matrices (rows[k], cols)
    and their stacked biases (None when ``bias`` is False)."""
    mats = [_take(weights, f"{prefix}{n}_proj.weight", (r, cols)) for n, r in zip(names, rows)]
    b = (np.concatenate([_take(weights, f"{prefix}{n}_proj.bias", (r,))
                         for n, r in zip(names, rows)]) if bias else None)
    return np.ascontiguousarray(np.concatenate(mats).T), b


def _layers_from(weights, cfg):
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
        layer = _Layer(
            qkv=qkv, bqkv=bqkv, wo_t=wo_t, bo=bo, gate_up=gate_up, b_gate_up=b_gate_up,
            down_t=down_t, b_down=b_down,
            norm_attn_in=_take(weights, p + "input_layernorm.weight", (H,)),
            norm_mlp_in=_take(weights, p + ("pre_feedforward_layernorm.weight" if cfg.gemma
                                            else "post_attention_layernorm.weight"), (H,)))
        if cfg.gemma:
            layer.norm_attn_out = _take(weights, p + "post_attention_layernorm.weight", (H,))
            layer.norm_mlp_out = _take(weights, p + "post_feedforward_layernorm.weight", (H,))
        layers.append(layer)
    return layers


# ------------------------------------------------------------------------------ the runner
class Runner:
    """A decoder-only model in NumPy whose attention runs on kvcache (see the module docstring).

    Parameters
    ----------
    config : ModelConfig
    weights : dict of str to ndarray
        Hugging Face tensor names (``model.layers.{i}.self_attn.q_proj.weight``, ...).
    kv : {"f32", "q8", "q8k", "q8v"} or KvMode
        KV storage of every layer.
    o1_layers : str or sequence of int, optional
        Layers decoded with the O(1) Nystrom override (:func:`parse_layers` syntax).  They
        seal at the end of the first :meth:`prefill` (their prompt K/V is kept in f32 until
        then, whatever ``kv`` says); sliding-window layers are refused.
        The override approximates full softmax attention (no logit softcap on those layers).
    o1_params : tuple of int
        ``(m, w, sink)`` of the O(1) layers (default ``(32, 128, 4)``, upstream's).
    max_seq_len : int
        Positions the cache may hold (prefill and decode check it).
    decode_blas_threads : int
        BLAS threads during single-position steps (default 1; 0 leaves BLAS alone): see
        :meth:`_blas_for` for why one is the right default on small machines.

    Attributes
    ----------
    cache : kvcache.KvCache
        The per-layer KV caches; ``position`` is the number of positions processed.
    """

    def __init__(self, config, weights, *, kv="f32", o1_layers=None, o1_params=(32, 128, 4),
                 max_seq_len=131072, decode_blas_threads=1):
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config: expected a ModelConfig, got {type(config).__name__}")
        self.config = cfg = config
        self.mode = KvMode.parse(kv, "kv")
        self.max_seq_len = as_int("max_seq_len", max_seq_len, minimum=1)
        if len(o1_params) != 3:
            raise ValueError(f"o1_params: expected (m, w, sink), got {o1_params!r}")
        self.o1_params = tuple(as_int(n, v, minimum=lo) for n, v, lo in
                               zip(("m", "w", "sink"), o1_params, (4, 1, 0)))
        self.blas_threads = as_int("decode_blas_threads", decode_blas_threads, minimum=0)
        weights = _Tracked(weights)
        self.embed = _take(weights, "model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size))
        self.layers = _layers_from(weights, cfg)
        self.norm = _take(weights, "model.norm.weight", (cfg.hidden_size,))
        if cfg.tie_word_embeddings or "lm_head.weight" not in weights:
            if not cfg.tie_word_embeddings:
                raise KeyError("checkpoint: tensor 'lm_head.weight' is missing (and the config "
                               "does not tie it to the embeddings)")
            self.lm_head = self.embed
        else:
            self.lm_head = _take(weights, "lm_head.weight", (cfg.vocab_size, cfg.hidden_size))
        self.lm_head_t = np.ascontiguousarray(self.lm_head.T)
        del self.lm_head
        unused = sorted(k for k in set(weights) - weights.used
                        if not k.endswith("rotary_emb.inv_freq") and k != "lm_head.weight")
        if unused:                    # a tensor this runner would silently leave out
            raise ValueError(f"checkpoint: {len(unused)} tensors are not used by the "
                             f"{cfg.family} runner (e.g. {', '.join(unused[:4])}); the config "
                             f"does not describe them, so the logits would be wrong")
        glob = [i for i in range(cfg.num_layers) if cfg.layer_windows[i] is None]
        spec = o1_layers.strip().lower() if isinstance(o1_layers, str) else ""
        if spec == "all" or spec.startswith("deep"):
            # "all" / "deepN" count the global layers only: a window is already constant-size
            self.o1_layers = tuple(glob[j] for j in parse_layers(o1_layers, len(glob)))
        else:
            self.o1_layers = parse_layers(o1_layers, cfg.num_layers)
        for i in self.o1_layers:
            if cfg.layer_windows[i] is not None:
                raise ValueError(f"o1_layers: layer {i} has a sliding window of "
                                 f"{cfg.layer_windows[i]}; the O(1) override is for global "
                                 f"layers (a window is already constant-size)")
        self._inv_freq = _rope_inv_freq(cfg)
        self._embed_scale = _F32(math.sqrt(cfg.hidden_size)) if cfg.gemma else None
        self.cache = KvCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                             max_seq_len=self.max_seq_len, policy=EvictionPolicy.born(),
                             mode=self.mode)
        for i in self.o1_layers:         # the seal needs f32 rows (released once it is done)
            self.cache.layers[i] = LayerKvCache(cfg.num_kv_heads, cfg.head_dim, KvMode.F32)
        self.position = 0
        self.timings = {"attention_s": 0.0, "total_s": 0.0}
        self._pools = None

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_pretrained(cls, path, **kwargs):
        """Load ``path/config.json`` and its safetensors (see the class for ``kwargs``)."""
        path = os.fspath(path)
        with open(os.path.join(path, "config.json")) as f:
            cfg = ModelConfig.from_hf(json.load(f))
        return cls(cfg, load_safetensors(path), **kwargs)

    @classmethod
    def random(cls, config=None, seed=0, **kwargs):
        """A model with random weights (the embedded default of ``python -m kvcache
        generate``): a small Llama unless ``config`` is given."""
        cfg = config or ModelConfig(family="llama", vocab_size=512, hidden_size=256,
                                    intermediate_size=688, num_layers=4, num_heads=8,
                                    num_kv_heads=2, head_dim=32, rope_theta=500000.0,
                                    layer_windows=(None,) * 4, eos_token_id=())
        return cls(cfg, random_weights(cfg, seed), **kwargs)

    # ---------------------------------------------------------------- maths
    def _rms(self, x, w):
        var = np.mean(x * x, axis=-1, keepdims=True, dtype=_F32)
        y = x * (_F32(1.0) / np.sqrt(var + _F32(self.config.rms_eps)))
        return y * ((_F32(1.0) + w) if self.config.gemma else w)

    def _rope(self, x, positions):
        """Rotate-half RoPE of x (n, heads, hd) at ``positions`` (n,), as transformers does."""
        ang = positions.astype(_F32)[:, None] * self._inv_freq[None, :]       # (n, hd/2)
        cos = np.cos(ang)[:, None, :]
        sin = np.sin(ang)[:, None, :]
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    def _layer(self, i, x, positions, sealing):
        cfg, L = self.config, self.layers[i]
        n = x.shape[0]
        nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h = self._rms(x, L.norm_attn_in)
        qkv = h @ L.qkv
        if L.bqkv is not None:
            qkv = qkv + L.bqkv
        nq, nk = nh * hd, nkv * hd
        q = self._rope(qkv[:, :nq].reshape(n, nh, hd), positions)
        k = self._rope(qkv[:, nq: nq + nk].reshape(n, nkv, hd), positions)
        v = np.ascontiguousarray(qkv[:, nq + nk:]).reshape(n, nkv, hd)
        layer = self.cache.layers[i]
        t0 = time.perf_counter()
        if i in self.o1_layers and (sealing or layer.o1_sealed()):
            out = self._o1_attend(layer, q, k, v, sealing)
        else:
            layer.append(k, v)
            out = layer.attend_all_heads(q, scale=cfg.scale, window=cfg.layer_windows[i],
                                         softcap=cfg.attn_softcap or 0.0)
        self.timings["attention_s"] += time.perf_counter() - t0
        o = out.reshape(n, nh * hd) @ L.wo_t
        if L.bo is not None:
            o = o + L.bo
        if cfg.gemma:
            o = self._rms(o, L.norm_attn_out)
        x = x + o
        h = self._rms(x, L.norm_mlp_in)
        act = _ACTIVATIONS[cfg.hidden_act]
        gu = h @ L.gate_up
        if L.b_gate_up is not None:
            gu = gu + L.b_gate_up
        im = cfg.intermediate_size
        m = (act(gu[:, :im]) * gu[:, im:]) @ L.down_t
        if L.b_down is not None:
            m = m + L.b_down
        if cfg.gemma:
            m = self._rms(m, L.norm_mlp_out)
        return x + m

    def _o1_attend(self, layer, q, k, v, sealing):
        cfg = self.config
        adj = _F32(cfg.scale * math.sqrt(cfg.head_dim))     # o1 scores use 1/sqrt(head_dim)
        if sealing:                                         # the prompt: exact, and traced
            layer.o1_push_q(q * adj)
            layer.append(k, v)
            return layer.attend_all_heads(q, scale=cfg.scale, softcap=cfg.attn_softcap or 0.0)
        return layer.o1_step((q * adj)[0], k[0], v[0], cfg.num_heads)[None]

    def _blas_for(self, n):
        """BLAS on one thread for a single position (decode), unless ``blas_threads`` says.

        A decode step's products are memory-bound matrix-vector products; on a machine with
        few cores, BLAS worker threads that spin-wait after each product and kvcache's OpenMP
        team that does the same descheduled each other for tens of milliseconds per call here
        (2 cores: 0.8 tokens/s instead of 25 on the benchmark model).  One BLAS thread
        removes the contention; prefill blocks keep every thread."""
        if n > 1 or self.blas_threads == 0:
            return contextlib.nullcontext()
        if self._pools is None:
            from threadpoolctl import ThreadpoolController
            self._pools = ThreadpoolController()
        return self._pools.limit(limits=self.blas_threads, user_api="blas")

    def _logits(self, x):
        h = self._rms(x, self.norm)
        logits = h @ self.lm_head_t
        cap = self.config.final_softcap
        if cap:
            logits = np.tanh(logits / _F32(cap)) * _F32(cap)
        return logits

    def forward(self, ids, *, all_logits=False):
        """Run positions ``ids`` (1-D ints) after what the cache holds; return the logits of
        the last position (vocab,) or of all (n, vocab) with ``all_logits``."""
        ids = np.asarray(ids)
        if ids.ndim != 1 or ids.size == 0 or ids.dtype.kind not in "iu":
            raise ValueError(f"ids: expected a non-empty 1-D array of token ids, got "
                             f"{ids.dtype} {ids.shape}")
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise ValueError(f"ids: token ids must lie in [0, {self.config.vocab_size})")
        n = ids.shape[0]
        if self.position + n > self.max_seq_len:
            raise ValueError(f"ids: {n} positions after {self.position} exceed max_seq_len="
                             f"{self.max_seq_len}")
        sealing = bool(self.o1_layers) and self.position == 0
        if self.o1_layers and not sealing and n > 1:
            raise ValueError("ids: with O(1) layers, only the prompt (the first call) may hold "
                             "several positions; decode one position per call")
        t0 = time.perf_counter()
        undo = self._undo_point(sealing)
        try:
            if sealing:
                m, w, sink = self.o1_params
                for i in self.o1_layers:
                    self.cache.layers[i].o1_begin(m, w, sink)
            x = self.embed[ids]
            if self._embed_scale is not None:
                x = x * self._embed_scale
            positions = np.arange(self.position, self.position + n)
            with self._blas_for(n):
                for i in range(self.config.num_layers):
                    x = self._layer(i, x, positions, sealing)
                out = self._logits(x if all_logits else x[-1:])
            if sealing:
                for i in self.o1_layers:
                    self.cache.layers[i].o1_seal(self.config.num_heads)
        except BaseException:             # MemoryError, Ctrl-C...: no layer keeps a half step
            self._undo(undo)
            raise
        self.position += n
        self.timings["total_s"] += time.perf_counter() - t0
        return out if all_logits else out[0]

    def _undo_point(self, sealing):
        """What :meth:`_undo` needs to put every layer back as it is now."""
        if sealing:
            return None                   # the cache was empty: clearing restores it
        return [(layer.o1_snapshot() if layer.o1_sealed() else layer.seq_len)
                for layer in self.cache.layers]

    def _undo(self, point):
        if point is None:
            self.cache.clear()            # keeps the layer objects (the O(1) layers' f32 too)
            return
        for layer, saved in zip(self.cache.layers, point):
            if isinstance(saved, int):
                layer.truncate_last(layer.seq_len - saved)
            else:
                layer.o1_restore(saved)

    def prefill(self, ids, *, all_logits=False):
        """The prompt as one block (the cache must be empty): see :meth:`forward`."""
        if self.position:
            raise ValueError(f"prefill: the cache already holds {self.position} positions; "
                             f"call reset() first or use forward()")
        return self.forward(ids, all_logits=all_logits)

    def step(self, token):
        """Decode one position: the next-token logits (vocab,)."""
        return self.forward(np.array([as_int("token", token, minimum=0)]))

    def rollback(self, n):
        """Forget the newest ``n`` positions (speculative-decode reject): ``truncate_last`` on
        every layer.  O(1)-sealed layers cannot roll back (RuntimeError, nothing changed)."""
        n = min(as_int("n", n, minimum=0), self.position)
        if n == 0:
            return
        self.cache.truncate_last(n)
        self.position -= n

    def reset(self):
        """Empty the cache (a new conversation)."""
        self.cache.clear()
        self.position = 0

    def memory_bytes(self):
        """Bytes held by the KV cache (every layer)."""
        return self.cache.memory_bytes()

    # ---------------------------------------------------------------- sampling
    def generate(self, prompt, max_new_tokens, *, temperature=0.0, top_p=1.0, seed=None,
                 stop=None, callback=None):
        """Prefill ``prompt`` and decode up to ``max_new_tokens`` tokens.

        Parameters
        ----------
        prompt : sequence of int
        max_new_tokens : int
        temperature : float
            0 is greedy (argmax; ties go to the lowest id); otherwise sample from
            ``softmax(logits / temperature)`` restricted to the top-p nucleus.
        top_p : float in (0, 1]
        seed : int, optional
            Seed of the sampler's ``numpy.random.Generator``.
        stop : collection of int, optional
            Token ids that end the generation (default: the config's eos ids).
        callback : callable, optional
            Called with each new token id.

        Returns
        -------
        list of int
            The new tokens (the prompt is not repeated).

        Starts a conversation: the cache must be empty (:meth:`reset`); the prompt length plus
        ``max_new_tokens - 1`` must fit ``max_seq_len`` (checked before anything runs).
        """
        max_new = as_int("max_new_tokens", max_new_tokens, minimum=0)
        temperature = float(temperature)
        top_p = float(top_p)
        if not temperature >= 0.0 or math.isinf(temperature):
            raise ValueError(f"temperature: expected a finite value >= 0, got {temperature}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p: expected a value in (0, 1], got {top_p}")
        if stop is None:
            stop = self.config.eos_token_id
        elif isinstance(stop, (int, np.integer)):
            stop = (stop,)
        stop = {as_int("stop", t) for t in stop}
        seed = None if seed is None else as_int("seed", seed, minimum=0)
        n_prompt = len(np.asarray(prompt).reshape(-1))
        if self.position:
            raise ValueError(f"generate: the cache already holds {self.position} positions; "
                             f"generate starts a conversation (call reset() first)")
        if n_prompt + max(max_new - 1, 0) > self.max_seq_len:
            raise ValueError(f"generate: {n_prompt} prompt positions and {max_new} new tokens "
                             f"exceed max_seq_len={self.max_seq_len}")
        rng = np.random.default_rng(seed)
        out = []
        if max_new == 0:
            self.forward(prompt)          # checks the prompt like any other call, then
            self.reset()                  # leaves the runner as it was
            return out
        logits = self.prefill(prompt)
        while True:
            tok = sample(logits, temperature, top_p, rng)
            out.append(tok)
            if callback is not None:
                callback(tok)
            if tok in stop or len(out) >= max_new:
                return out
            logits = self.step(tok)


def sample(logits, temperature=0.0, top_p=1.0, rng=None):
    """One token from ``logits`` (vocab,): greedy at temperature 0, else top-p sampling."""
    logits = np.asarray(logits, dtype=np.float64)
    if temperature == 0.0:
        return int(np.argmax(logits))
    z = logits / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    mass = np.cumsum(p[order])
    # the smallest set reaching top_p (of the mass as summed, which may end a hair below 1)
    keep = min(int(np.searchsorted(mass, top_p * mass[-1])) + 1, p.size)
    nucleus = order[:keep]
    q = p[nucleus] / p[nucleus].sum()
    rng = np.random.default_rng() if rng is None else rng
    return int(nucleus[rng.choice(keep, p=q)])


def _rope_inv_freq(cfg):
    """float32 inverse frequencies, computed as transformers does (float32 power)."""
    hd = cfg.head_dim
    exps = np.arange(0, hd, 2, dtype=np.int64).astype(_F32) / _F32(hd)
    inv = (_F32(1.0) / (_F32(cfg.rope_theta) ** exps)).astype(_F32)
    rs = cfg.rope_scaling
    kind = rs.get("rope_type", "default")
    if kind == "linear":
        inv = (inv / _F32(rs["factor"])).astype(_F32)
    elif kind == "llama3":
        factor = rs["factor"]
        low, high = rs["low_freq_factor"], rs["high_freq_factor"]
        old = rs["original_max_position_embeddings"]
        low_wl, high_wl = old / low, old / high
        wl = (_F32(2 * math.pi) / inv).astype(_F32)
        scaled = np.where(wl > low_wl, inv / _F32(factor), inv).astype(_F32)
        smooth = ((old / wl - low) / (high - low)).astype(_F32)
        smoothed = ((1 - smooth) * scaled / _F32(factor) + smooth * scaled).astype(_F32)
        medium = ~(wl < high_wl) & ~(wl > low_wl)
        inv = np.where(medium, smoothed, scaled).astype(_F32)
    return inv


def random_weights(cfg, seed=0):
    """Random float32 weights of ``cfg`` under Hugging Face tensor names (std 0.02 matrices,
    unit norms)."""
    rng = np.random.default_rng(seed)
    H, nh, nkv, hd, im = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                          cfg.intermediate_size)

    def mat(*shape):
        return (rng.standard_normal(shape, dtype=_F32) * _F32(0.02)).astype(_F32)

    norm = np.zeros if cfg.gemma else np.ones
    w = {"model.embed_tokens.weight": mat(cfg.vocab_size, H),
         "model.norm.weight": norm(H, dtype=_F32)}
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
                  p + "input_layernorm.weight": norm(H, dtype=_F32),
                  p + "post_attention_layernorm.weight": norm(H, dtype=_F32)})
        if cfg.qkv_bias:
            for n, size in (("q", nh * hd), ("k", nkv * hd), ("v", nkv * hd)):
                w[p + f"self_attn.{n}_proj.bias"] = mat(size)
        if cfg.o_bias:
            w[p + "self_attn.o_proj.bias"] = mat(H)
        if cfg.mlp_bias:
            for n, size in (("gate", im), ("up", im), ("down", H)):
                w[p + f"mlp.{n}_proj.bias"] = mat(size)
        if cfg.gemma:
            w[p + "pre_feedforward_layernorm.weight"] = norm(H, dtype=_F32)
            w[p + "post_feedforward_layernorm.weight"] = norm(H, dtype=_F32)
    return w


# ------------------------------------------------------------------------------ command line
def _load_tokenizer(path):
    tok_file = os.path.join(path, "tokenizer.json") if path else None
    if not tok_file or not os.path.exists(tok_file):
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ImportError(f"{tok_file} needs the tokenizers package to encode text: pip install "
                          f"tokenizers (or pass --ids)") from None
    try:
        return Tokenizer.from_file(tok_file)
    except Exception as exc:              # tokenizers raises a bare Exception for a bad file
        raise ValueError(f"{tok_file}: not a readable tokenizer ({exc})") from None


def build_parser():
    import argparse
    p = argparse.ArgumentParser(
        prog="python -m kvcache generate",
        description="Decode with a Llama / Mistral / Qwen2 / Gemma-2 checkpoint on kvcache. "
                    "Without --model, a small random-weight Llama built in memory is used.")
    p.add_argument("--model", metavar="PATH",
                   help="checkpoint folder (config.json + *.safetensors [+ tokenizer.json])")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text (needs tokenizer.json in the model folder)")
    src.add_argument("--ids", nargs="+", metavar="ID",
                     help="prompt token ids (e.g. --ids 1 15043 29892 or --ids 1,15043)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="default 64")
    p.add_argument("--kv", default="f32", choices=("f32", "q8", "q8k", "q8v"),
                   help="KV storage (default f32)")
    p.add_argument("--o1", metavar="LAYERS",
                   help="O(1) Nystrom layers: all, deepN, or a list like 0,5,7 (default none)")
    p.add_argument("--o1-params", metavar="M,W,SINK", default="32,128,4",
                   help="O(1) landmarks, window and sinks (default 32,128,4)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass (default 1)")
    p.add_argument("--seed", type=int, help="sampler seed")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def _prompt_ids(args, tokenizer, cfg, parser):
    if args.ids:
        try:
            return [int(t) for v in args.ids for t in v.split(",") if t.strip()]
        except ValueError:
            parser.error(f"--ids: expected integers, got {' '.join(args.ids)}")
    if args.prompt is not None:
        if tokenizer is None:
            parser.error("--prompt needs a tokenizer.json in the --model folder (and the "
                         "tokenizers package); pass --ids instead")
        return tokenizer.encode(args.prompt).ids
    if tokenizer is not None:
        return tokenizer.encode("Once upon a time").ids
    bos = cfg.bos_token_id if cfg.bos_token_id is not None else 1
    return [bos] + list(range(2, 9))


def main(argv=None, file=None):
    """Entry point of ``python -m kvcache generate``; returns the exit status."""
    out = sys.stdout if file is None else file
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        o1_params = tuple(int(v) for v in args.o1_params.split(","))
    except ValueError:
        parser.error(f"--o1-params: expected M,W,SINK integers, got {args.o1_params!r}")
    if len(o1_params) != 3:
        parser.error(f"--o1-params: expected M,W,SINK, got {args.o1_params!r}")
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    kwargs = dict(kv=args.kv, o1_layers=args.o1, o1_params=o1_params)
    try:
        t0 = time.perf_counter()
        if args.model:
            runner = Runner.from_pretrained(args.model, **kwargs)
            name = args.model
        else:
            runner = Runner.random(**kwargs)
            name = "embedded random-weight Llama (4 layers, 256 wide, vocab 512)"
        load_s = time.perf_counter() - t0
        if args.o1 and not runner.o1_layers:
            print(f"warning: --o1 {args.o1!r} selects no global layer of this "
                  f"{runner.config.num_layers}-layer model; decoding exactly", file=sys.stderr)
        try:
            tokenizer = _load_tokenizer(args.model)
        except (ImportError, ValueError) as exc:
            if args.prompt is not None:
                raise
            print(f"warning: {exc}; printing token ids", file=sys.stderr)
            tokenizer = None
        prompt = _prompt_ids(args, tokenizer, runner.config, parser)
        if not prompt:
            parser.error("the prompt is empty")
        from .bench import progress_bar
        bar = progress_bar(args.max_new_tokens, not args.no_progress, unit="tok")
        t0 = time.perf_counter()
        first = []

        def on_token(tok):
            if not first:
                first.append(time.perf_counter())
            bar.update()

        tokens = runner.generate(prompt, args.max_new_tokens, temperature=args.temperature,
                                 top_p=args.top_p, seed=args.seed, callback=on_token)
        end = time.perf_counter()
        bar.close()
    except (ValueError, TypeError, KeyError, OSError, ImportError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    prefill_s = first[0] - t0
    decode_n = len(tokens) - 1
    decode_s = end - first[0]
    p = lambda *a: print(*a, file=out)                  # noqa: E731
    sealed = [i for i in runner.o1_layers if runner.cache.layers[i].o1_sealed()]
    o1_text = ""
    if runner.o1_layers:
        o1_text = f", O(1) layers {sealed}"
        if sealed != list(runner.o1_layers):
            o1_text += (f" (seal refused on {sorted(set(runner.o1_layers) - set(sealed))}: "
                        f"decoded exactly)")
    p(f"model: {name} ({runner.config.family}, {runner.config.num_layers} layers), kv "
      f"{args.kv}{o1_text}, loaded in {load_s:.2f} s")
    p(f"prompt ({len(prompt)} tokens): {prompt if tokenizer is None else repr(args.prompt or tokenizer.decode(prompt))}")
    p(f"output ({len(tokens)} tokens): "
      + (repr(tokenizer.decode(tokens)) if tokenizer is not None else str(tokens)))
    p(f"prefill: {len(prompt)} tokens in {prefill_s * 1e3:.1f} ms "
      f"({len(prompt) / prefill_s:.1f} tokens/s, first token included)")
    if decode_n > 0:
        p(f"decode: {decode_n} tokens in {decode_s * 1e3:.1f} ms ({decode_n / decode_s:.2f} "
          f"tokens/s)")
    p(f"attention share of the run: {100 * runner.timings['attention_s'] / max(runner.timings['total_s'], 1e-12):.0f}%")
    p(f"cache memory: {runner.memory_bytes() / 1024:.1f} KiB for {runner.position} positions")
    return 0
