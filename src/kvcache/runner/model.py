"""The runner's forward pass and decoding loop: :class:`Runner`.

A decoder-only model in NumPy float32 whose attention runs on kvcache: every layer's K/V lives
in a :class:`kvcache.KvCache` layer and attention is ``attend_all_heads`` (or the O(1) override's
``o1_step`` on chosen layers).  Prefill runs the prompt in chunks that end at multiples of
``prefill_chunk`` absolute positions; decode runs one position per step;
:meth:`Runner.truncate_last` forgets the newest positions (speculative decoding).  A
:class:`kvcache.store.PrefixStore` passed to :meth:`Runner.prefill` or :meth:`Runner.generate`
supplies the prompt's stored leading positions and receives its new full blocks
(docs/store.md).

Why chunks at absolute positions: a BLAS matrix product gives a row different low bits
depending on how many rows are multiplied with it (OpenBLAS's blocking), so a prompt whose
first positions come from the store and whose rest is computed as a shorter block would not
be bit-identical to the same prompt computed as one block.  With chunk boundaries fixed at
multiples of ``prefill_chunk`` (a divisor of the store's block), every position is computed in
the same chunk, with the same rows, whether or not a store supplied the ones before it.
Each layer runs its chunks' products one chunk after another but attends once for all of
their queries (kvcache's kernel computes each query on its own, whatever the call holds), so
BLAS's threads and kvcache's OpenMP team take turns once per layer, as with one block.

Steps.  A long prompt is computed step-major: a step of ``prefill_step`` positions (a multiple of
``prefill_chunk``; by default at least 512 and a chunk per usable CPU up to 8) goes through
every layer before the next step starts, so the
activations, the products' scratch and the attention output hold one step's rows, not the
prompt's.  A step is a group of whole chunks and each query attends on its own to the rows
stored before it, so the bits do not depend on the step size.  One exception is kept out by
construction: in q8 modes of the legacy int8 scheme "cmf" the first append that reaches
position ``quant.COL_WARMUP`` (64) freezes the column field and requantises the rows before it, which a one-block prefill does
before any of its queries attend; no step therefore ends at or below that position (the first
step then runs past it), and the queries of the first positions see the frozen rows as they
would in one block.

Numerics: float32 throughout (NumPy matmuls for the projections and the MLP), RoPE angles as
transformers computes them (float32 inverse frequencies times the position).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import math
import os
import time
import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ContextManager, Union

import numpy as np
import numpy.typing as npt

from .. import _deprecated
from .._prefill_steps import step_ends
from .._stores import specs_of
from .._threads import BlasGovernor, usable_cpus
from .._validate import IntArrayLike, as_int, as_token_ids
from ..eviction import EvictionPolicy
from ..layer import LayerKvCache
from ..model import KvCache
from ..modes import KvMode
from ..o1 import RIDGE, check_max_error, check_ridge
from .config import MULTIMODAL, LayerSpec, ModelConfig, parse_layers
from .sampling import sample
from .digest import checkpoint_source, weights_digest
from .weights import (Array, LayerWeights, Tracked, as_f32, layers_from, load_safetensors,
                      random_weights, take, text_model_weights)

if TYPE_CHECKING:
    from ..o1 import O1Snapshot
    from ..store.prompt import StoreArg

__all__ = ["DEFAULT_PREFILL_CHUNK", "DEFAULT_PREFILL_STEP", "O1_AUTO_MAX_ERROR",
           "O1_AUTO_PARAMS", "Runner", "load_checkpoint", "load_checkpoint_tokenizer"]

#: The error bound of ``o1_layers="auto"`` when ``o1_max_error`` is not given: a layer seals
#: only when the seal's own estimate of its relative error (``LayerKvCache.o1_error``, see
#: docs/o1.md) is at most this.  Chosen on SmolLM2-135M (docs/o1.md, "auto").
O1_AUTO_MAX_ERROR = 0.1
#: The O(1) parameters ``(m, w, sink, keep, ridge)`` of ``o1_layers="auto"`` when ``o1_params``
#: is not given: 128 far keys kept exact and a ridge of 1e-3 make the far field good enough
#: for twice as many layers to pass the bound (docs/o1.md, measurements).
O1_AUTO_PARAMS = (32, 128, 4, 128, 1e-3)

#: Version of the prompt attention whose rows the prefix store keeps (part of the fingerprint):
#: "blocked-1" is the tiled kernel of ``LayerKvCache.attend_all_heads(prefill=True)``.
PROMPT_KERNEL = "blocked-2"

#: Positions per prefill chunk (chunks end at multiples of it).  It equals the prefix store's
#: default block (256), so stored blocks and computed chunks line up.  The store keeps the
#: final hidden row at each block's end (:meth:`PrefixStore.put_outputs`), so a store hit on
#: a whole number of blocks computes no chunk at all.  Products of more rows run faster
#: (docs/threads.md, "What decides a row's bits in OpenBLAS"), and a chunk bounds the MLP's
#: scratch to its rows.
DEFAULT_PREFILL_CHUNK = 256
#: Positions per prefill step (a step goes through every layer before the next one starts),
#: at least; rounded up to a multiple of ``prefill_chunk`` and raised to one chunk per usable
#: CPU (up to 8), so every thread has a chunk's products.  It bounds a long prompt's
#: activations and scratch to a step's rows (a step of 512 rows of a 4096-wide model's MLP:
#: about 30 MB; the step grows with the CPUs, up to 2,048 rows) while the BLAS/OpenMP
#: hand-over happens once per layer and step; the bits do not depend on it (module
#: docstring).
DEFAULT_PREFILL_STEP = 512

_F32 = np.float32
#: What :meth:`Runner._undo` needs per layer: its length, or an O(1) layer's snapshot.
_UndoPoint = Union[list[Union[int, "O1Snapshot"]], None]


def _gelu_tanh(x: Array) -> Array:
    inner = _F32(math.sqrt(2.0 / math.pi)) * (x + _F32(0.044715) * x * x * x)
    return as_f32(_F32(0.5) * x * (_F32(1.0) + np.tanh(inner)))


def _silu(x: Array) -> Array:
    with np.errstate(over="ignore"):
        return as_f32(x / (_F32(1.0) + np.exp(-x)))


#: The functions of the activation names :data:`kvcache.runner.config.ACTIVATIONS` accepts.
_ACTIVATIONS: dict[str, Callable[[Array], Array]] = {
    "silu": _silu, "gelu_pytorch_tanh": _gelu_tanh, "gelu_tanh": _gelu_tanh}


def _rope_inv_freq(hd: int, theta: float, rs: Mapping[str, Any]) -> Array:
    """float32 inverse frequencies of head size ``hd``, base ``theta`` and scaling ``rs``
    (``{"rope_type": ..., parameters}``), computed as transformers does (float32 power)."""
    exps = np.arange(0, hd, 2, dtype=np.int64).astype(_F32) / _F32(hd)
    inv = (_F32(1.0) / (_F32(theta) ** exps)).astype(_F32)
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
    elif kind == "freq_factors":           # llama.cpp's rope_freqs (GGUF): divided per frequency
        f = np.asarray(rs.get("factors", ()), dtype=_F32)
        if f.shape != inv.shape or not (np.isfinite(f).all() and (f > 0).all()):
            raise ValueError(f"rope_scaling: 'freq_factors' needs head_dim / 2 = {inv.size} "
                             f"positive finite factors, got {f.size}")
        inv = (inv / f).astype(_F32)
    return as_f32(inv)



_NO_CHECKPOINT = "no checkpoint there (expected a GGUF file, or a folder with config.json and " \
                 "*.safetensors)"


def load_checkpoint(path: str | os.PathLike[str]) -> tuple[ModelConfig, dict[str, Array]]:
    """The config and float32 weights of a checkpoint: a GGUF file
    (:func:`kvcache.runner.gguf.load_gguf`) or a folder of ``config.json`` and safetensors.
    FileNotFoundError naming ``path`` itself when it is neither (a mistyped file name is not
    reported as a missing ``x.gguf/config.json``)."""
    where = os.fspath(path)
    if os.path.isfile(where):
        from .gguf import load_gguf
        return load_gguf(path)
    if not os.path.isdir(where):
        raise FileNotFoundError(errno.ENOENT, _NO_CHECKPOINT, where)
    with open(os.path.join(where, "config.json")) as f:
        raw = json.load(f)
    config, weights = ModelConfig.from_hf(raw), load_safetensors(path)
    if raw.get("model_type") in MULTIMODAL:         # the language model of a Gemma 3 4B+
        weights = text_model_weights(weights)
    return config, weights


def load_checkpoint_tokenizer(path: str | os.PathLike[str] | None) -> Any:
    """The ``tokenizers`` Tokenizer of a checkpoint as :func:`load_checkpoint` reads it: built
    from a GGUF file's metadata, or ``path/tokenizer.json`` of a folder; None without one
    (or without ``path``).  FileNotFoundError when ``path`` is neither a file nor a folder,
    as for :func:`load_checkpoint`; ImportError without the tokenizers package, ValueError
    for a file it cannot read."""
    where = os.fspath(path) if path else None
    if where and os.path.isfile(where):
        from .gguf import load_tokenizer
        return load_tokenizer(where)
    if where and not os.path.isdir(where):
        raise FileNotFoundError(errno.ENOENT, _NO_CHECKPOINT, where)
    tok_file = os.path.join(where, "tokenizer.json") if where else None
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


class Runner:
    """A decoder-only model in NumPy whose attention runs on kvcache (see the module docstring).

    Parameters
    ----------
    config : ModelConfig
    weights : dict of str to ndarray
        Hugging Face tensor names (``model.layers.{i}.self_attn.q_proj.weight``, ...).
    kv : {"f32", "q8", "q8k", "q8v", "q8:cmf", "q4", "k8v4", "q4k", "q4v", "k4v8"} or KvMode
        KV storage of every layer (any name :meth:`KvMode.parse` accepts; "q8" is the default
        int8 scheme "rows", ":cmf" the legacy column-freeze scheme; the 4-bit modes in
        docs/kv4.md).
    o1_layers : str or sequence of int, optional
        Layers decoded with the O(1) Nystrom override (:func:`parse_layers` syntax, or
        ``"auto"``: every global layer is a candidate and seals only when its error estimate
        is at most ``o1_max_error``).  They seal at the end of the first :meth:`prefill` (their
        prompt K/V is kept in f32 until then, whatever ``kv`` says, and stays f32 when a seal
        is refused); sliding-window layers are refused.  The override approximates full
        softmax attention (no logit softcap on those layers).
    o1_params : tuple
        ``(m, w, sink)`` of the O(1) layers (default ``(32, 128, 4)``, upstream's), optionally
        followed by ``keep`` (far keys kept exact per KV group, default 0) and ``ridge`` (of
        the landmark pseudo-inverse, default 1e-6): see ``LayerKvCache.o1_begin``.  With
        ``o1_layers="auto"`` the default is :data:`O1_AUTO_PARAMS`.
    o1_max_error : float, optional
        Seal an O(1) layer only when the seal's estimate of its relative error is at most
        this (``LayerKvCache.o1_seal(max_error=...)``; a refused layer decodes exactly).
        Default: no bound, or :data:`O1_AUTO_MAX_ERROR` with ``o1_layers="auto"``.
    max_seq_len : int
        Positions the cache may hold (prefill and decode check it).
    blas_threads : int, optional
        The BLAS control, for prompt and decode steps alike (docs/threads.md, "BLAS"): None
        (the default) sizes NumPy's BLAS team for each layer's products from the CPUs free
        now -- BLAS's own count on a quiet machine, fewer when other processes take cores
        (:class:`kvcache._threads.BlasGovernor`); an int >= 1 caps that count (1: always one
        thread); 0 leaves BLAS alone.  BLAS's own setting (``OPENBLAS_NUM_THREADS``,
        ``threadpoolctl``) stays the outer limit.
    decode_blas_threads : int, optional
        Deprecated (a DeprecationWarning): BLAS threads in single-position steps only, a cap
        under ``blas_threads`` (0: BLAS as it is in them), as before; use ``blas_threads``.
    prefill_chunk : int
        Positions per prefill chunk (default :data:`DEFAULT_PREFILL_CHUNK`, 256): a prompt is
        computed in chunks that end at multiples of it (absolute positions), so the work done
        for a position does not depend on where the call started (see the module docstring).
        A prefix store's block must be a multiple of it.  Larger chunks make the products
        faster; smaller ones make the MLP's scratch smaller and a store hit on a prompt that
        ends inside a block faster (the chunk of its last position is computed).
    prefill_step : int, optional
        Positions per prefill step (default :data:`DEFAULT_PREFILL_STEP`, 512, rounded up to a
        multiple of ``prefill_chunk`` and to a chunk per usable CPU, up to 8; else it must be a
        multiple of it, ValueError): a prompt
        is computed step by step, each step through every layer, so memory for activations
        and scratch grows with the step, not with the prompt.  The outputs are bit-identical
        for every step size (see the module docstring), so it is not part of
        :attr:`fingerprint`.

    Attributes
    ----------
    cache : kvcache.KvCache
        The per-layer KV caches; ``position`` is the number of positions processed.
    store_loaded : int
        Prompt positions the last :meth:`prefill` took from its store (0 without one).
    """

    def __init__(self, config: ModelConfig, weights: Mapping[str, Array], *,
                 kv: KvMode | str = "f32", o1_layers: LayerSpec = None,
                 o1_params: Sequence[float] | None = None,
                 o1_max_error: float | None = None, max_seq_len: int = 131072,
                 blas_threads: int | None = None,
                 decode_blas_threads: int | None = None,
                 prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 prefill_step: int | None = None) -> None:
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config: expected a ModelConfig, got {type(config).__name__}")
        self.config: ModelConfig = config
        cfg = config
        self.mode = KvMode.parse(kv, "kv")
        self.max_seq_len = as_int("max_seq_len", max_seq_len, minimum=1)
        auto = isinstance(o1_layers, str) and o1_layers.strip().lower() == "auto"
        if o1_params is None:
            o1_params = O1_AUTO_PARAMS if auto else (32, 128, 4)
        if len(o1_params) not in (3, 4, 5):
            raise ValueError(f"o1_params: expected (m, w, sink), (m, w, sink, keep) or "
                             f"(m, w, sink, keep, ridge), got {o1_params!r}")
        ints = tuple(as_int(n, v, minimum=lo) for n, v, lo in
                     zip(("m", "w", "sink", "keep"), o1_params[:4], (4, 1, 0, 0)))
        #: (m, w, sink[, keep[, ridge]]) as given, checked
        self.o1_params: tuple[float, ...] = ints + tuple(check_ridge(r) for r in o1_params[4:])
        max_error = check_max_error(o1_max_error)
        #: the BLAS control: None adaptive, >= 1 a cap, 0 BLAS left alone
        self.blas_threads: int | None = (None if blas_threads is None else
                                         as_int("blas_threads", blas_threads, minimum=0))
        #: the deprecated decode_blas_threads: a cap on single-position steps only (0: BLAS
        #: as it is in them), as it was; prompts stay governed by blas_threads
        self._decode_cap: int | None = None
        if decode_blas_threads is not None:
            warnings.warn("Runner(decode_blas_threads=...) is deprecated: use blas_threads, "
                          "which governs prompt and decode steps alike", DeprecationWarning,
                          stacklevel=2)
            self._decode_cap = as_int("decode_blas_threads", decode_blas_threads, minimum=0)
        self._blas: BlasGovernor | None = None    # the governor of the call in progress
        self.prefill_chunk = as_int("prefill_chunk", prefill_chunk, minimum=1)
        c = self.prefill_chunk
        if prefill_step is None:
            self.prefill_step = max(-(-DEFAULT_PREFILL_STEP // c), min(usable_cpus(), 8)) * c
        else:
            self.prefill_step = as_int("prefill_step", prefill_step, minimum=1)
            if self.prefill_step % c:
                raise ValueError(f"prefill_step: expected a multiple of prefill_chunk={c}, got "
                                 f"{self.prefill_step}")
        tracked = Tracked(weights)
        self.embed = take(tracked, "model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size))
        self.layers: list[LayerWeights] = layers_from(tracked, cfg)
        self.norm = take(tracked, "model.norm.weight", (cfg.hidden_size,))
        if cfg.tie_word_embeddings or "lm_head.weight" not in tracked:
            if not cfg.tie_word_embeddings:
                raise KeyError("checkpoint: tensor 'lm_head.weight' is missing (and the config "
                               "does not tie it to the embeddings)")
            lm_head = self.embed
        else:
            lm_head = take(tracked, "lm_head.weight", (cfg.vocab_size, cfg.hidden_size))
        self.lm_head_t: Array = np.ascontiguousarray(lm_head.T)
        unused = sorted(k for k in set(tracked) - tracked.used
                        if not k.endswith("rotary_emb.inv_freq") and k != "lm_head.weight")
        if unused:                    # a tensor this runner would silently leave out
            raise ValueError(f"checkpoint: {len(unused)} tensors are not used by the "
                             f"{cfg.family} runner (e.g. {', '.join(unused[:4])}); the config "
                             f"does not describe them, so the logits would be wrong")
        glob = [i for i in range(cfg.num_layers) if cfg.layer_windows[i] is None]
        spec = o1_layers.strip().lower() if isinstance(o1_layers, str) else ""
        #: whether ``o1_layers`` was "auto" (every global layer a candidate, sealed under a bound)
        self.o1_auto = spec == "auto"
        if self.o1_auto and max_error is None:
            max_error = O1_AUTO_MAX_ERROR
        #: the error bound of the O(1) seals (None: none)
        self.o1_max_error: float | None = max_error
        if self.o1_auto:
            self.o1_layers: tuple[int, ...] = tuple(glob)
        elif spec == "all" or spec.startswith("deep"):
            # "all" / "deepN" count the global layers only: a window is already constant-size
            self.o1_layers = tuple(glob[j] for j in parse_layers(o1_layers, len(glob)))
        else:
            self.o1_layers = parse_layers(o1_layers, cfg.num_layers)
        for i in self.o1_layers:
            if cfg.layer_windows[i] is not None:
                raise ValueError(f"o1_layers: layer {i} has a sliding window of "
                                 f"{cfg.layer_windows[i]}; the O(1) override is for global "
                                 f"layers (a window is already constant-size)")
        glob_freq = _rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        local = cfg.local_rope
        local_freq = (glob_freq if local is None else
                      _rope_inv_freq(cfg.head_dim, float(local["rope_theta"]), local))
        #: per layer: RoPE inverse frequencies (Gemma 3's sliding layers have their own base)
        self._inv_freq: list[Array] = [local_freq if i in cfg.local_rope_layers else glob_freq
                                       for i in range(cfg.num_layers)]
        self._embed_scale = _F32(math.sqrt(cfg.hidden_size)) if cfg.gemma else None
        self.cache = KvCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                             max_seq_len=self.max_seq_len, policy=EvictionPolicy.born(),
                             mode=self.mode)
        for i in self.o1_layers:         # the seal needs f32 rows (released once it is done)
            self.cache.layers[i] = LayerKvCache(cfg.num_kv_heads, cfg.head_dim, KvMode.F32)
        # the runner never evicts (positions past max_seq_len are refused): no importance work
        self.cache.track_importance = False
        self.position = 0
        self.store_loaded = 0
        self.timings: dict[str, float] = {"attention_s": 0.0, "total_s": 0.0}
        self._fingerprint: str | None = None
        self._source: str | None = None      # the checkpoint's files (from_pretrained)

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str], **kwargs: Any) -> Runner:
        """Load a checkpoint: a folder (``config.json`` and its safetensors) or a GGUF file
        (weights dequantised to float32, config from its metadata: :mod:`kvcache.runner.gguf`).
        See the class for ``kwargs``."""
        before = checkpoint_source(path)
        config, weights = load_checkpoint(path)
        runner = cls(config, weights, **kwargs)
        # the files' key, when they did not change while being read (digest.py)
        runner._source = before if checkpoint_source(path) == before else None
        return runner

    @classmethod
    def random(cls, config: ModelConfig | None = None, seed: int = 0, **kwargs: Any) -> Runner:
        """A model with random weights (the embedded default of ``python -m kvcache
        generate``): a small Llama unless ``config`` is given."""
        cfg = config or ModelConfig(family="llama", vocab_size=512, hidden_size=256,
                                    intermediate_size=688, num_layers=4, num_heads=8,
                                    num_kv_heads=2, head_dim=32, rope_theta=500000.0,
                                    layer_windows=(None,) * 4, eos_token_id=())
        return cls(cfg, random_weights(cfg, seed), **kwargs)

    # ---------------------------------------------------------------- maths
    def _rms(self, x: Array, w: Array) -> Array:
        var = np.mean(x * x, axis=-1, keepdims=True, dtype=_F32)
        y = x * (_F32(1.0) / np.sqrt(var + _F32(self.config.rms_eps)))
        gain = (_F32(1.0) + w) if self.config.gemma else w
        return as_f32(y * gain)

    def _rope(self, x: Array, positions: npt.NDArray[np.int64], inv_freq: Array) -> Array:
        """Rotate-half RoPE of x (n, heads, hd) at ``positions`` (n,) with frequencies
        ``inv_freq`` (hd/2,), as transformers does."""
        ang = positions.astype(_F32)[:, None] * inv_freq[None, :]             # (n, hd/2)
        cos = np.cos(ang)[:, None, :]
        sin = np.sin(ang)[:, None, :]
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    def _layer(self, i: int, xs: list[Array], positions: list[npt.NDArray[np.int64]],
               sealing: bool, prompt: bool = False) -> list[Array]:
        """Layer ``i`` over the chunks ``xs`` (their ``positions``; one prefill step): the
        products and the row-wise steps run chunk by chunk (a row's bits depend on its chunk
        alone), the attention once for every chunk's queries (the kernel computes each query
        on its own), so BLAS and kvcache's OpenMP team take turns once per layer and step, not
        once per chunk.  ``prompt``: the positions are prompt positions (:meth:`_attend`)."""
        cfg, L = self.config, self.layers[i]
        nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        nq, nk = nh * hd, nkv * hd
        inv_freq = self._inv_freq[i]

        def qkv_of(item: tuple[Array, npt.NDArray[np.int64]]) -> tuple[Array, Array, Array]:
            x, pos = item
            n = x.shape[0]
            h = self._rms(x, L.norm_attn_in)
            qkv = h @ L.qkv
            if L.bqkv is not None:
                qkv = qkv + L.bqkv
            q = qkv[:, :nq].reshape(n, nh, hd)
            k = qkv[:, nq: nq + nk].reshape(n, nkv, hd)
            if L.q_norm is not None and L.k_norm is not None:    # Qwen3 / Gemma 3, per head
                q, k = self._rms(q, L.q_norm), self._rms(k, L.k_norm)
            return (self._rope(q, pos, inv_freq), self._rope(k, pos, inv_freq),
                    np.ascontiguousarray(qkv[:, nq + nk:]).reshape(n, nkv, hd))

        rows = [x.shape[0] for x in xs]
        parts = self._chunks(qkv_of, list(zip(xs, positions)), rows)
        qs = [p[0] for p in parts]
        ks = [p[1] for p in parts]
        vs = [p[2] for p in parts]
        q = qs[0] if len(qs) == 1 else as_f32(np.concatenate(qs))
        layer = self.cache.layers[i]
        t0 = time.perf_counter()
        if i in self.o1_layers and (sealing or layer.o1_sealed()):
            out = self._o1_attend(layer, q, ks, vs, sealing)
        else:
            for k, v in zip(ks, vs):          # chunk by chunk: q8's column freeze sees what
                layer.append(k, v)            # it sees with a store
            out = self._attend(layer, q, cfg.layer_windows[i], prompt)
        self.timings["attention_s"] += time.perf_counter() - t0
        act = _ACTIVATIONS[cfg.hidden_act]
        im = cfg.intermediate_size
        mines: list[Array] = []
        lo = 0
        for x in xs:
            n = x.shape[0]
            # each chunk's rows in an array of its own, wherever the chunk lies in the call
            mines.append(out if len(xs) == 1 else np.array(out[lo: lo + n]))
            lo += n

        def mlp_of(item: tuple[Array, Array]) -> Array:
            x, mine = item
            n = x.shape[0]
            o = mine.reshape(n, nh * hd) @ L.wo_t
            if L.bo is not None:
                o = o + L.bo
            if L.norm_attn_out is not None:                # Gemma-2 sandwich norm
                o = self._rms(o, L.norm_attn_out)
            x = x + o
            h = self._rms(x, L.norm_mlp_in)
            gu = h @ L.gate_up
            if L.b_gate_up is not None:
                gu = gu + L.b_gate_up
            m = (act(gu[:, :im]) * gu[:, im:]) @ L.down_t
            if L.b_down is not None:
                m = m + L.b_down
            if L.norm_mlp_out is not None:
                m = self._rms(m, L.norm_mlp_out)
            return x + m

        return self._chunks(mlp_of, list(zip(xs, mines)), rows)

    def _o1_attend(self, layer: LayerKvCache, q: Array, ks: list[Array], vs: list[Array],
                   sealing: bool) -> Array:
        cfg = self.config
        adj = _F32(cfg.scale * math.sqrt(cfg.head_dim))     # o1 scores use 1/sqrt(head_dim)
        if sealing:                                         # the prompt: exact, and traced
            layer.o1_push_q(q * adj)
            for k, v in zip(ks, vs):
                layer.append(k, v)
            return self._attend(layer, q, None, True)
        return layer.o1_step((q * adj)[0], ks[0][0], vs[0][0], cfg.num_heads)[None]

    def _attend(self, layer: LayerKvCache, q: Array, window: int | None,
                prompt: bool) -> Array:
        """Attention of the queries ``q`` (n, num_heads, head_dim) to the rows ``layer`` holds
        up to each query's own position: the one place where the runner calls kvcache's
        attention (O(1) layers' exact prompt included).

        ``prompt`` is True for every position of a prompt (:meth:`prefill`, and
        :meth:`forward` with several positions), whatever the size of its step or of its last
        chunk after a store hit, and False for a decode step.  The prompt's positions must go
        through the same kernel however the call that holds them is cut, or a store hit would
        change the bits; a kernel meant for prompts is chosen here, for all of them."""
        cfg = self.config
        return layer.attend_all_heads(q, scale=cfg.scale, window=window,
                                      softcap=cfg.attn_softcap or 0.0, prefill=prompt)

    def _blas_block(self) -> ContextManager[object]:
        """The BLAS governor of one call (:attr:`blas_threads`; docs/threads.md, "BLAS")."""
        if self.blas_threads == 0:
            self._blas = None
            return contextlib.nullcontext()
        gov = BlasGovernor(self.blas_threads)
        self._blas = gov
        return gov

    def _chunks(self, fn: Callable[[Any], Any], items: list[Any], rows: list[int]) -> list[Any]:
        """``[fn(item) for item in items]`` over the chunks of one step, sized by the call's
        governor: single-row chunks (decode) with BLAS at ``min(blas_threads, free CPUs)``
        threads (a matrix-vector product's bits do not depend on the count); chunks of
        several rows shared out over that many threads, BLAS on one thread in each, so a
        chunk's bits depend on the chunk alone (a matrix-matrix product's would depend on
        BLAS's count).  With ``blas_threads=0``, in order with BLAS as it is."""
        gov = self._blas
        if gov is None:
            return [fn(x) for x in items]
        if all(r == 1 for r in rows):
            if self._decode_cap != 0:
                gov.size(self._decode_cap)
            return [fn(x) for x in items]
        return gov.map(fn, items)

    def _logits(self, x: Array) -> Array:
        h = self._rms(x, self.norm)
        logits = h @ self.lm_head_t
        cap = self.config.final_softcap
        if cap:
            logits = np.tanh(logits / _F32(cap)) * _F32(cap)
        return logits

    def _check_ids(self, ids: IntArrayLike) -> npt.NDArray[Any]:
        """``ids`` as a 1-D int64 array of token ids in the vocabulary that fit after the
        cache (:func:`kvcache._validate.as_token_ids`: TypeError for ids that are not
        integers, ValueError otherwise)."""
        arr = as_token_ids(ids, vocab=self.config.vocab_size)
        n = arr.shape[0]
        if self.position + n > self.max_seq_len:
            raise ValueError(f"ids: {n} positions after {self.position} exceed max_seq_len="
                             f"{self.max_seq_len}")
        return arr

    def forward(self, ids: IntArrayLike, *, all_logits: bool = False) -> Array:
        """Run positions ``ids`` (1-D ints) after what the cache holds; return the logits of
        the last position (vocab,) or of all (n, vocab) with ``all_logits``.

        Several positions are computed in chunks that end at multiples of
        ``prefill_chunk`` (absolute positions), grouped in steps of ``prefill_step`` that go
        through every layer one after the other (module docstring); the call changes nothing
        when it fails."""
        arr = self._check_ids(ids)
        return self._forward(arr, all_logits, arr.shape[0] > 1, None)

    def _steps(self, n: int) -> list[list[tuple[int, int]]]:
        """The chunks ``(lo, hi)`` (offsets into the call) of ``n`` positions after
        :attr:`position`, grouped in steps: chunks end at multiples of ``prefill_chunk``, steps
        where :func:`kvcache._prefill_steps.step_ends` says (multiples of ``prefill_step`` and
        the end; in the q8 scheme "cmf" none at or below ``quant.COL_WARMUP``), the rule
        :func:`kvcache.hf.prefill` follows too."""
        start, c = self.position, self.prefill_chunk
        ends = list(range((start // c + 1) * c, start + n, c)) + [start + n]
        breaks = set(step_ends(start, start + n, self.prefill_step, self.mode)[:-1])
        steps: list[list[tuple[int, int]]] = [[]]
        lo = start
        for hi in ends:                        # prefill_step is a multiple of prefill_chunk
            steps[-1].append((lo - start, hi - start))
            if hi in breaks:
                steps.append([])
            lo = hi
        return steps

    def _forward(self, ids: npt.NDArray[Any], all_logits: bool, prompt: bool,
                 progress: Callable[[int, int], object] | None,
                 marks: dict[int, Array | None] | None = None) -> Array:
        """:meth:`forward` of checked ``ids``; ``prompt`` says whether they are prompt positions
        (:meth:`_attend`), ``progress(done, n)`` is called after each step; ``marks`` maps
        offsets into ``ids`` to None, replaced by a copy of that position's final hidden row
        (before the final norm: what :meth:`_logits` takes)."""
        n = ids.shape[0]
        sealing = bool(self.o1_layers) and self.position == 0
        if self.o1_layers and not sealing and n > 1:
            raise ValueError("ids: with O(1) layers, only the prompt (the first call) may hold "
                             "several positions; decode one position per call")
        t0 = time.perf_counter()
        undo = self._undo_point(sealing)
        steps = self._steps(n)
        outs: list[Array] = []
        try:
            if sealing:
                m, w, sink, keep, ridge = self.o1_params + (0, RIDGE)[len(self.o1_params) - 3:]
                for i in self.o1_layers:
                    self.cache.layers[i].o1_begin(int(m), int(w), int(sink), keep=int(keep),
                                                  ridge=ridge)
            with self._blas_block():
                for chunks in steps:
                    xs: list[Array] = []
                    positions: list[npt.NDArray[np.int64]] = []
                    for lo, hi in chunks:
                        x = self.embed[ids[lo:hi]]
                        if self._embed_scale is not None:
                            x = x * self._embed_scale
                        xs.append(x)
                        positions.append(np.arange(self.position + lo, self.position + hi))
                    for i in range(self.config.num_layers):
                        xs = self._layer(i, xs, positions, sealing, prompt)
                    for (lo, hi), x in zip(chunks, xs):
                        for off in marks or ():
                            if lo <= off < hi:
                                marks[off] = x[off - lo].copy()      # type: ignore[index]
                    if all_logits:
                        outs.extend(self._chunks(self._logits, xs, [x.shape[0] for x in xs]))
                    if progress is not None:
                        progress(chunks[-1][1], n)
                if not all_logits:
                    outs = [self._logits(xs[-1][-1:])]
            if sealing:
                for i in self.o1_layers:
                    self.cache.layers[i].o1_seal(self.config.num_heads,
                                                 max_error=self.o1_max_error)
        except BaseException:             # MemoryError, Ctrl-C...: no layer keeps a half step
            self._undo(undo)
            raise
        self.position += n
        self.timings["total_s"] += time.perf_counter() - t0
        if all_logits:
            return outs[0] if len(outs) == 1 else as_f32(np.concatenate(outs))
        return as_f32(outs[0][0])

    def _undo_point(self, sealing: bool) -> _UndoPoint:
        """What :meth:`_undo` needs to put every layer back as it is now."""
        if sealing:
            return None                   # the cache was empty: clearing restores it
        return [(layer.o1_snapshot() if layer.o1_sealed() else layer.seq_len)
                for layer in self.cache.layers]

    def _undo(self, point: _UndoPoint) -> None:
        if point is None:
            self.cache.clear()            # keeps the layer objects (the O(1) layers' f32 too)
            return
        for layer, saved in zip(self.cache.layers, point):
            if isinstance(saved, int):
                layer.truncate_last(layer.seq_len - saved)
            else:
                layer.o1_restore(saved)

    def prefill(self, ids: IntArrayLike, *, all_logits: bool = False,
                store: StoreArg | None = None,
                progress: Callable[[int, int], object] | None = None) -> Array:
        """The prompt (the cache must be empty): see :meth:`forward`.

        With ``store`` (a :class:`kvcache.store.PrefixStore`, or a backend spec such as a
        folder or ``redis://host:port/db``, opened as a store with this runner's
        :attr:`fingerprint` and closed afterwards), the longest stored prefix of ``ids`` is
        loaded into the cache, only the rest is computed, and the prompt's new full blocks
        are stored with the final hidden row of each block's last position.  A prompt of
        whole stored blocks whose last row is stored is loaded whole (not with 4-bit K: its
        roll-back needs the computed rows of the last block of keys) and its logits computed
        from that row; otherwise the chunk holding the prompt's final position is computed
        (its logits are needed).  :attr:`store_loaded` says how many positions were loaded.
        The logits are bit-identical to a run without the store.  A store that
        fails (a server down, a damaged entry) only costs the time: the prompt is computed.
        With ``all_logits`` nothing is loaded (every position's logits are computed); the new
        blocks are still stored.

        The prompt is computed in steps of ``prefill_step`` positions (each through every
        layer); ``progress(done, total)``, when given, is called after each step with the
        positions computed so far and the number this call computes (loaded ones left out).

        Raises ValueError before anything runs for a store with O(1) layers (the store holds
        exact rows, which those layers release when they seal), a store of another
        fingerprint, a store block that is not a multiple of ``prefill_chunk``, or one the
        KV mode cannot take (a q8 "cmf" cache needs a block over 64): the checks of
        :func:`kvcache.store.prompt.check_store`, the path kvcache.hf takes too."""
        if self.position:
            raise ValueError(f"prefill: the cache already holds {self.position} positions; "
                             f"call reset() first or use forward()")
        if progress is not None and not callable(progress):
            raise TypeError(f"progress: expected a callable or None, got "
                            f"{type(progress).__name__}")
        self.store_loaded = 0
        arr = self._check_ids(ids)
        if store is None:
            return self._forward(arr, all_logits, True, progress)
        from ..store.prompt import (check_store, load_prefix, open_store, refuse_o1,
                                    store_blocks)
        refuse_o1(self.o1_layers)             # before the fingerprint's digest is computed
        with open_store(store, self.fingerprint) as st:
            check_store(st, self.cache, fingerprint=self.fingerprint, chunk=self.prefill_chunk)
            n, b = arr.shape[0], st.block
            marks: dict[int, Array | None] = {}
            try:                              # all_logits: every position's are computed
                # the prompt's last hidden row, when stored, spares its chunk's computation;
                # not when a kind rebuilds a part the entries do not carry (4-bit K's roll-back
                # ring: rows rebuilt from the loaded codes where a cold run's holds the
                # computed ones; docs/store.md)
                rebuilds = any(spec.carried != spec.parts
                               for _, spec in specs_of(self.mode, self.config.head_dim))
                last = (st.load_output(arr, self.cache, self.config.hidden_size)
                        if not all_logits and n % b == 0 and not rebuilds else None)
                keep = 0 if all_logits else load_prefix(st, arr, self.cache,
                                                        chunk=self.prefill_chunk,
                                                        whole=last is not None)
                self.position = keep
                if keep == n and last is not None:
                    logits = self._from_hidden(last)
                else:
                    marks = {p - keep: None for p in range(b - 1, n, b) if p >= keep}
                    logits = self._forward(arr[keep:], all_logits, True, progress, marks)
            except BaseException:
                self.reset()
                raise
            self.store_loaded = keep
            store_blocks(st, arr, self.cache)
            rows = {keep + off + 1: row for off, row in marks.items() if row is not None}
            if rows:
                st.put_outputs(arr, self.cache, rows)
            return logits

    def _from_hidden(self, h: Array) -> Array:
        """The logits of the last prompt position from its stored final hidden row ``h``, the
        cache holding the whole prompt: the same one-row product :meth:`_forward` makes."""
        t0 = time.perf_counter()
        with self._blas_block():
            logits = self._logits(h[None, :])
        self.timings["total_s"] += time.perf_counter() - t0
        return as_f32(logits[0])

    @property
    def fingerprint(self) -> str:
        """A digest of what decides the KV rows this runner computes: the config, every weight
        array's bytes (as the forward pass holds them), the KV mode (its int8 scheme
        included), ``prefill_chunk``
        (the low bits of the rows depend on the chunking) and the prompt kernel's version
        (:data:`PROMPT_KERNEL`: rows written by another prompt kernel have other low bits).
        Hex BLAKE2b of those settings and of the weights' digest, computed on first use and
        kept.  The weights' digest is computed once per checkpoint (:mod:`kvcache.runner.digest`:
        in this process, and across processes in a small digest file, keyed by the checkpoint
        files' paths, sizes and times), on several threads; the prefix store's key for this
        model."""
        if self._fingerprint is None:
            h = hashlib.blake2b(digest_size=32, person=b"kvcache-runner")
            meta = {"config": dataclasses.asdict(self.config), "kv": repr(self.mode),
                    "prefill_chunk": self.prefill_chunk, "prompt_kernel": PROMPT_KERNEL}
            if self.mode.scheme == "rows":     # repr() of a "rows" mode names no scheme
                meta["kv_scheme"] = "rows"
            h.update(json.dumps(meta, sort_keys=True, default=repr).encode())
            h.update(weights_digest(self._named_arrays(), self._source).encode())
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    def _named_arrays(self) -> list[tuple[str, Array]]:
        """Every weight array the forward pass holds, named, in a fixed order."""
        arrays: list[tuple[str, Array]] = [("embed", self.embed), ("norm", self.norm)]
        if not self.config.tie_word_embeddings:       # else it is the embeddings'
            arrays.append(("lm_head_t", self.lm_head_t))
        for i, L in enumerate(self.layers):
            for f in dataclasses.fields(L):
                a = getattr(L, f.name)
                if a is not None:
                    arrays.append((f"{i}.{f.name}", a))
        return arrays

    def step(self, token: int) -> Array:
        """Decode one position: the next-token logits (vocab,)."""
        return self.forward(np.array([as_int("token", token, minimum=0)]))

    def truncate_last(self, n: int) -> None:
        """Forget the newest ``n`` positions (speculative-decode reject): ``truncate_last`` on
        every layer, as :meth:`kvcache.KvCache.truncate_last`; more than ``position`` forgets
        everything.  O(1)-sealed layers cannot roll back (RuntimeError, nothing changed)."""
        n = min(as_int("n", n, minimum=0), self.position)
        if n == 0:
            return
        self.cache.truncate_last(n)
        self.position -= n

    def rollback(self, n: int) -> None:
        """Deprecated name of :meth:`truncate_last` (a DeprecationWarning; one name for a
        rollback on every object of the package)."""
        _deprecated.warn("kvcache.runner.Runner.rollback()", "truncate_last()")
        self.truncate_last(n)

    def reset(self) -> None:
        """Empty the cache (a new conversation)."""
        self.cache.clear()
        self.position = 0
        self.store_loaded = 0

    @property
    def o1_sealed_layers(self) -> tuple[int, ...]:
        """The layers sealed in O(1) mode now (those of ``o1_layers`` whose seal was not
        refused; empty before the first prefill)."""
        return tuple(i for i in self.o1_layers if self.cache.layers[i].o1_sealed())

    def memory_bytes(self) -> int:
        """Bytes held by the KV cache (every layer)."""
        return self.cache.memory_bytes()

    # ---------------------------------------------------------------- sampling
    def generate(self, prompt: IntArrayLike, max_new_tokens: int, *, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int | None = None,
                 stop: int | Collection[int] | None = None,
                 callback: Callable[[int], object] | None = None,
                 store: StoreArg | None = None,
                 progress: Callable[[int, int], object] | None = None) -> list[int]:
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
        store : PrefixStore or str, optional
            A prefix store (or a backend spec: a folder, ``redis://host:port/db``): the
            prompt's stored prefix is loaded instead of computed, and its new full blocks are
            stored (see :meth:`prefill`).  The tokens are the same as without it.  O(1) layers
            refuse a store (ValueError, before anything runs).
        progress : callable, optional
            Called as ``progress(done, total)`` after each prefill step (see :meth:`prefill`).

        Returns
        -------
        list of int
            The new tokens (the prompt is not repeated).

        Starts a conversation: the cache must be empty (:meth:`reset`); the prompt length plus
        ``max_new_tokens - 1`` must fit ``max_seq_len`` (checked before anything runs).
        """
        max_new = as_int("max_new_tokens", max_new_tokens, minimum=0)
        if progress is not None and not callable(progress):
            raise TypeError(f"progress: expected a callable or None, got "
                            f"{type(progress).__name__}")
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
        stops = {as_int("stop", t) for t in stop}
        seed = None if seed is None else as_int("seed", seed, minimum=0)
        prompt = as_token_ids(prompt, "prompt", vocab=self.config.vocab_size)
        n_prompt = prompt.shape[0]
        if self.position:
            raise ValueError(f"generate: the cache already holds {self.position} positions; "
                             f"generate starts a conversation (call reset() first)")
        if n_prompt + max(max_new - 1, 0) > self.max_seq_len:
            raise ValueError(f"generate: {n_prompt} prompt positions and {max_new} new tokens "
                             f"exceed max_seq_len={self.max_seq_len}")
        if store is not None:
            from ..store.prompt import refuse_o1
            refuse_o1(self.o1_layers)
        rng = np.random.default_rng(seed)
        out: list[int] = []
        if max_new == 0:
            self.forward(prompt)          # checks the prompt like any other call, then
            self.reset()                  # leaves the runner as it was
            return out
        logits = self.prefill(prompt, store=store, progress=progress)
        while True:
            tok = sample(logits, temperature, top_p, rng)
            out.append(tok)
            if callback is not None:
                callback(tok)
            if tok in stops or len(out) >= max_new:
                return out
            logits = self.step(tok)

