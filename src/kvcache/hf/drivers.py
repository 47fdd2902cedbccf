"""Drivers of :mod:`kvcache.hf`: :func:`prefill` (a prompt in steps) and :func:`generate`
(``model.generate`` with an :class:`~kvcache.hf.HfKvCache`)."""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import torch

from .._prefill_steps import step_ends
from ..modes import KvMode
from ._common import ATTN_IMPLEMENTATION, DEFAULT_PREFILL_STEP, prompt_ids
from .cache import HfKvCache

__all__ = ["cache_kwarg", "generate", "prefill"]


def cache_kwarg(model: torch.nn.Module) -> str:
    """The keyword the model's ``forward`` takes its cache under: ``cache`` (transformers 5.24)
    or ``past_key_values`` (older releases)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _check_model(model: Any) -> None:
    impl = getattr(model.config, "_attn_implementation", None)
    if impl != ATTN_IMPLEMENTATION:
        raise ValueError(f"model: expected attn_implementation={ATTN_IMPLEMENTATION!r}, got "
                         f"{impl!r}; load it with attn_implementation='kvcache' or call "
                         "model.set_attn_implementation('kvcache')")


def _new_or_given(model: Any, cache: HfKvCache | None, mode: KvMode | str | None) -> HfKvCache:
    if cache is None:
        return HfKvCache(model.config, mode=mode)
    if not isinstance(cache, HfKvCache):
        raise TypeError(f"cache: expected an HfKvCache, got {type(cache).__name__}")
    return cache


def _check_step(name: str, step: Any) -> None:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 1:
        raise ValueError(f"{name}: expected a positive integer, got {step!r}")


def _steps(start: int, n: int, step: int, mode: KvMode) -> list[tuple[int, int]]:
    """The ``(lo, hi)`` positions of :func:`prefill`'s calls: the runner's step rule
    (:func:`kvcache._prefill_steps.step_ends`)."""
    ends = step_ends(start, n, step, mode)
    return list(zip([start] + ends[:-1], ends))


def prefill(model: Any, input_ids: Any, *, cache: HfKvCache | None = None,
            mode: KvMode | str | None = None,
            step: int = DEFAULT_PREFILL_STEP) -> tuple[torch.Tensor, HfKvCache]:
    """Feed a prompt to ``model(...)`` in steps of ``step`` positions; return the logits of
    its last position and the cache.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        Loaded with ``attn_implementation="kvcache"``.
    input_ids : torch.LongTensor of shape (1, n), or a sequence of ints
        The whole sequence; the positions past what ``cache`` holds are fed (all of them with
        a new cache), as ``generate`` does.
    cache : HfKvCache, optional
        A cache to continue (e.g. from :func:`cache_from_store`); a new one otherwise.
    mode : KvMode, str or None
        Storage precision of a new cache (ignored when ``cache`` is given).
    step : int
        Positions per ``model(...)`` call (default :data:`DEFAULT_PREFILL_STEP`): the model's
        activations and products hold ``step`` rows, not the prompt's; each call asks the
        model for its last position's logits only (``logits_to_keep=1``).  Steps end at
        multiples of ``step`` (absolute positions), and with a q8 cache in the legacy scheme
        "cmf" the first runs past position 64, where its column field freezes, as a one-shot
        prefill does.

    Returns
    -------
    (logits, cache)
        ``logits``: float32 tensor (vocab,) of the last position, equal to a one-shot
        ``model(input_ids)``'s to float32 rounding; ``cache`` holds every position.

    Raises ValueError when the cache already holds every position of ``input_ids`` (nothing
    to compute) or more, or when ``step`` is not a positive integer; TypeError for a cache
    that is not an :class:`HfKvCache`.  A call that fails half way leaves the cache holding
    the steps done so far (``cache.crop`` rolls it back).
    """
    _check_model(model)
    _check_step("step", step)
    ids = prompt_ids(input_ids)
    cache = _new_or_given(model, cache, mode)
    start = cache.get_seq_length()
    if start >= ids.shape[0]:
        raise ValueError(f"input_ids: the cache already holds {start} positions, input_ids has "
                         f"{ids.shape[0]}; there is nothing left to compute")
    params = inspect.signature(model.forward).parameters
    kwargs: dict[str, Any] = {cache_kwarg(model): cache, "use_cache": True}
    if "logits_to_keep" in params:
        kwargs["logits_to_keep"] = 1
    tokens = torch.from_numpy(ids)[None]
    logits: torch.Tensor | None = None
    with torch.no_grad():
        for lo, hi in _steps(start, ids.shape[0], int(step), cache.mode):
            out = model(input_ids=tokens[:, lo: hi], **kwargs)
            logits = out.logits[0, -1]
    assert logits is not None
    return logits.float(), cache


def generate(model: Any, input_ids: torch.Tensor, *, mode: KvMode | str | None = None,
             cache: HfKvCache | None = None, prefill_step: int | None = DEFAULT_PREFILL_STEP,
             **kwargs: Any) -> Any:
    """``model.generate`` with an :class:`HfKvCache`.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        Loaded with ``attn_implementation="kvcache"``.
    input_ids : torch.LongTensor of shape (1, n)
    mode : KvMode, str or None
        Storage precision of a new cache (ignored when ``cache`` is given).
    cache : HfKvCache, optional
        A cache to continue from (multi-turn); a new one is made otherwise.
    prefill_step : int or None
        The prompt's positions but the last that the cache does not hold yet are first fed
        through :func:`prefill` in steps of ``prefill_step`` (default
        :data:`DEFAULT_PREFILL_STEP`, 512) when there are more than ``prefill_step`` of them,
        so a long prompt's activations hold one step; ``model.generate`` then computes the
        last one.  None leaves the whole prompt to ``model.generate``, one block, as do a
        batch of several sequences and a left-padded ``attention_mask``.
    **kwargs
        Passed to ``model.generate`` (``max_new_tokens``, ``do_sample``, ...).

    Returns
    -------
    What ``model.generate`` returns.  The cache is reachable through the output when
    ``return_dict_in_generate=True``, or pass your own ``cache``.
    """
    _check_model(model)
    cache = _new_or_given(model, cache, mode)
    batched = (isinstance(input_ids, torch.Tensor) and input_ids.ndim == 2
               and input_ids.shape[0] != 1)
    mask = kwargs.get("attention_mask")
    padded = isinstance(mask, torch.Tensor) and not bool(mask.all())
    if prefill_step is not None:
        _check_step("prefill_step", prefill_step)
    if prefill_step is not None and not batched and not padded:   # (padding: one block)
        ids = prompt_ids(input_ids)
        if ids.shape[0] - 1 - cache.get_seq_length() > prefill_step:
            prefill(model, ids[:-1], cache=cache, step=prefill_step)
    kwargs[cache_kwarg(model)] = cache
    return model.generate(input_ids, **kwargs)
