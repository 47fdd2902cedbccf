"""kvcache attention for transformers: the attention function and the mask function
registered under ``"kvcache"`` (:func:`register`), see :mod:`kvcache.hf`."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from ..layer import LayerKvCache
from ..modes import KvMode
from ._common import ATTN_IMPLEMENTATION, PADS, TAG, as_numpy, check_batch, check_cpu
from .cache import HfKvLayer, config_window

__all__ = ["kvcache_attention", "kvcache_mask", "register"]


def kvcache_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: torch.Tensor | None,
                      dropout: float = 0.0, scaling: float | None = None,
                      sliding_window: int | None = None, softcap: float | None = None,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention function computing through kvcache's kernels.

    Parameters
    ----------
    module : torch.nn.Module
        The calling attention module.
    query : torch.Tensor of shape (batch, num_heads, n, head_dim)
    key, value : torch.Tensor of shape (batch, num_kv_heads, kv_len, head_dim)
        From :meth:`HfKvCache.update`: the n new positions, the key carrying its kvcache
        layer, which holds the history.  From any other cache (or none): every position the
        queries see, the queries being the last n of them.
    attention_mask : None or the padding marker of :func:`kvcache_mask`
        kvcache builds the causal (and sliding-window) pattern itself; the marker says how
        many leading rows of each batch row are left padding (left out); any other mask
        tensor raises.
    dropout : float
        Must be 0: attention dropout raises (a module in training mode asks for it).
    scaling : float, optional
        Score scale, default ``head_dim ** -0.5``.
    sliding_window : int, optional
        Attend only to the last ``sliding_window`` positions up to and including the query's.
        When None, the module's ``sliding_window`` attribute or the window the config gives
        this layer is used (the one transformers' mask would apply).
    softcap : float, optional
        Attention logit softcapping (Gemma-2): ``softcap * tanh(score / softcap)``.

    Returns
    -------
    attn_output : torch.Tensor of shape (batch, n, num_heads, head_dim), the query's dtype
    attn_weights : None
    """
    layer = getattr(key, TAG, None)
    if layer is not None:
        layer.attended()                       # consumed, whatever happens next
    if (dropout or 0.0) > 0.0:
        raise RuntimeError(f"kvcache attention has no attention dropout (the model asked for "
                           f"{dropout}, as a module in training mode does): call model.eval(), "
                           f"or set the config's attention_dropout to 0")
    pads: tuple[int, ...] | None = getattr(attention_mask, PADS, None)
    if attention_mask is not None and pads is None:
        raise ValueError(
            "attention_mask: kvcache attention applies the causal and sliding-window patterns "
            "itself and takes no explicit 4-D mask, got a tensor of shape "
            f"{tuple(attention_mask.shape)}")
    if kwargs.get("is_causal") is False or not getattr(module, "is_causal", True):
        raise NotImplementedError("kvcache attention is causal only (bidirectional attention "
                                  "is not supported)")
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("kvcache attention does not support attention sinks (s_aux)")
    check_cpu("query", query)
    batch, num_heads, n, head_dim = query.shape
    if pads is not None and len(pads) != batch:
        raise ValueError(f"attention_mask: {len(pads)} rows for a batch of {batch}")
    if layer is None:
        _refuse_preallocated(key, n, kwargs.get("position_ids"), pads[0] if pads else 0)
    window = _window(module, layer, sliding_window)
    cap = float(softcap) if softcap else 0.0
    scale = None if scaling is None else float(scaling)
    out = torch.empty((batch, n, num_heads, head_dim), dtype=torch.float32)
    q = as_numpy(query.transpose(1, 2))                 # (batch, n, num_heads, head_dim)
    if layer is not None:
        if batch != 1:
            check_batch(query)
        if key.shape[2] != n:
            raise ValueError(f"query: expected the {key.shape[2]} positions just appended to the "
                             f"cache, got {n}")
        assert layer.kv is not None
        skip = layer.drop_padding(pads[0], n, key, value) if pads else 0
        out[0, :skip] = 0.0                   # padding queries: their outputs are never read
        if skip < n:
            _attend(layer.kv, q[0, skip:], scale, window, cap, out[0, skip:].numpy())
    else:
        check_cpu("key", key)
        kv_len = key.shape[2]
        if kv_len < n:
            raise ValueError(f"key: expected at least the {n} query positions, got {kv_len}")
        k = as_numpy(key.transpose(1, 2))               # (batch, kv_len, num_kv_heads, head_dim)
        v = as_numpy(value.transpose(1, 2))
        for b in range(batch):
            p = min(pads[b], kv_len) if pads else 0    # leading padding rows: left out
            skip = max(0, min(p - (kv_len - n), n))    # padding queries among the n
            out[b, :skip] = 0.0
            if skip == n:
                continue
            tmp = LayerKvCache(k.shape[2], head_dim, mode=KvMode.F32)
            tmp.append(k[b, p:], v[b, p:])
            _attend(tmp, q[b, skip:], scale, window, cap, out[b, skip:].numpy())
    if query.dtype != torch.float32:
        out = out.to(query.dtype)
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad
                                    or value.requires_grad):
        out = _NoGradient.apply(out, query, key, value)  # type: ignore[no-untyped-call]
    return out, None


class _NoGradient(torch.autograd.Function):
    """Marks kvcache attention's output as part of the graph with a backward that raises: a
    forward pass with gradients enabled (a model in training mode, or outside ``no_grad``)
    runs, and only a ``backward()`` through it, which kvcache cannot compute, is refused."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        raise RuntimeError("kvcache attention computes no gradients (inference only): run the "
                           "backward pass with another attn_implementation (e.g. 'sdpa')")


def _refuse_preallocated(key: torch.Tensor, n: int, position_ids: Any, pads: int) -> None:
    """Refuse a key tensor holding rows past the last query (a static, preallocated cache's
    buffer: ``generate(cache_implementation="static" / "sliding_window")`` or a StaticCache),
    which only a mask tensor could describe; ``position_ids`` (1, n) tell where the queries
    are (counted from the first of the sequence's ``pads`` leading padding positions' end)."""
    if not isinstance(position_ids, torch.Tensor) or position_ids.ndim != 2 \
            or position_ids.shape[0] != 1 or position_ids.shape[1] != n or n == 0:
        return
    last = int(position_ids[0, -1]) + pads
    if key.shape[2] > last + 1:
        raise NotImplementedError(_STATIC_REFUSAL.format(rows=key.shape[2], last=last))


_STATIC_REFUSAL = (
    "kvcache attention cannot attend over a static (preallocated) cache: the key holds {rows} "
    "rows for queries ending at position {last} (generate(cache_implementation='static' or "
    "'sliding_window') or a StaticCache); kvcache keeps K/V in its own growing storage: pass "
    "cache=kvcache.hf.HfKvCache(model.config) (kvcache.hf.generate does), or leave the default "
    "dynamic cache")


def _attend(kv: LayerKvCache, q: npt.NDArray[np.float32], scale: float | None,
            window: int | None, cap: float, out: npt.NDArray[np.float32]) -> None:
    """The one place kvcache.hf calls kvcache's attention: the n queries ``q`` (n, num_heads,
    head_dim) attend to the rows ``kv`` holds up to their own, into ``out``.  A block of
    ``n > 1`` queries is a prompt (or a step of one, :func:`prefill`); one query is a decode
    step; a kernel meant for prompts is chosen here."""
    kv.attend_all_heads(q, scale=scale, window=window, softcap=cap, out=out,
                        prefill=q.shape[0] > 1)


def _window(module: torch.nn.Module, layer: HfKvLayer | None,
            sliding_window: int | None) -> int | None:
    """The sliding window of this call: the ``sliding_window`` the model passes, else the
    module's ``sliding_window`` attribute, else the one the config gives the layer (what
    transformers' mask uses; some models, e.g. Qwen2-MoE and PhiMoE, only tell the mask)."""
    window = sliding_window
    if window is None:
        window = getattr(module, "sliding_window", None)
    if window is None and layer is not None:
        window = layer.sliding_window
    if window is None:
        config = getattr(module, "config", None)
        index = getattr(module, "layer_idx", None)
        if config is not None and index is not None:
            window = config_window(config, index)
    return int(window) if window else None


def kvcache_mask(batch_size: int | None = None, q_length: int | None = None,
                 kv_length: int | None = None, q_offset: int = 0, kv_offset: int = 0,
                 mask_function: Any = None, attention_mask: torch.Tensor | None = None,
                 allow_is_causal_skip: bool = True, use_vmap: bool = False,
                 **kwargs: Any) -> torch.Tensor | None:
    """transformers mask function for kvcache attention: returns None (no mask is needed), or
    for a left-padded 2-D ``attention_mask`` a small marker tensor carrying, per row, how many
    of the key's rows are padding (leading zeros counted from ``kv_offset``, where the key
    starts), which :func:`kvcache_attention` leaves out.

    Raises instead of dropping information the kernels cannot apply: zeros in the 2-D
    ``attention_mask`` other than left padding (ValueError), and mask patterns other than
    causal / sliding-window causal -- overlays, packed sequences, bidirectional or chunked
    attention, static caches (NotImplementedError).
    """
    if not allow_is_causal_skip and not use_vmap and q_length == 1 \
            and "allow_is_bidirectional_skip" not in kwargs:
        # for the supported families, transformers builds a one-query mask it cannot skip for
        # a compileable cache alone
        raise NotImplementedError(
            "kvcache attention cannot decode with a static (compileable) cache "
            "(generate(cache_implementation='static' or 'sliding_window'), StaticCache): "
            "kvcache keeps K/V in its own growing storage; pass "
            "cache=kvcache.hf.HfKvCache(model.config) (kvcache.hf.generate does), or leave the "
            "default dynamic cache (or: this model always builds its mask, which kvcache "
            "attention does not read)")
    if use_vmap or not allow_is_causal_skip or "allow_is_bidirectional_skip" in kwargs:
        raise NotImplementedError(
            "kvcache attention is causal (optionally sliding-window) over one unpadded sequence; "
            "this model asked for another mask pattern (overlay, packed sequences, "
            "bidirectional or blockwise attention)")
    config = kwargs.get("config")
    if config is not None and getattr(config, "attention_chunk_size", None) is not None:
        raise NotImplementedError("kvcache attention does not support chunked attention")
    if attention_mask is None or bool(attention_mask.all()):
        return None
    return _padding_marker(attention_mask, int(kv_offset))


def _padding_marker(attention_mask: torch.Tensor, kv_offset: int = 0) -> torch.Tensor:
    """What the mask function returns for a left-padded 2-D mask (batch, positions): a small
    tensor carrying, per row, how many of the key's rows are padding, which
    :func:`kvcache_attention` leaves out.  The key starts at position ``kv_offset`` (a sliding
    layer of transformers' own cache keeps only its window), so a row's leading zeros count
    from there.  ValueError for any other pattern of zeros."""
    m = attention_mask.detach().to("cpu")
    if m.ndim != 2:
        raise ValueError(f"attention_mask: expected the 2-D padding mask (batch, length), got "
                         f"shape {tuple(m.shape)}")
    ones = m.to(torch.bool)
    first = torch.where(ones.any(dim=1), ones.to(torch.int8).argmax(dim=1),
                        torch.full((m.shape[0],), m.shape[1]))
    cols = torch.arange(m.shape[1])[None, :]
    if not torch.equal(ones, cols >= first[:, None]):
        raise ValueError(
            "attention_mask: kvcache attention supports left padding only (each row's zeros "
            "before its first one); this mask has zeros after a row's first one (right "
            "padding or holes)")
    marker = torch.zeros(m.shape[0], dtype=torch.int64)
    setattr(marker, PADS, tuple(max(0, int(x) - kv_offset) for x in first))
    return marker


def register(name: str = ATTN_IMPLEMENTATION) -> str:
    """Register :func:`kvcache_attention` and :func:`kvcache_mask` with transformers.

    Idempotent; done once on import.  Afterwards
    ``AutoModelForCausalLM.from_pretrained(path, attn_implementation=name)`` (or
    ``model.set_attn_implementation(name)``) routes attention through kvcache.

    Parameters
    ----------
    name : str
        Registration name, default ``"kvcache"``.

    Returns
    -------
    str
        The name registered.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    AttentionInterface.register(name, kvcache_attention)
    AttentionMaskInterface.register(name, kvcache_mask)
    return name
