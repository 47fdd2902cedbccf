"""What every part of :mod:`kvcache.hf` shares: the transformers check, the registration
name, the mode parser, and the conversions between torch tensors and kvcache's arrays.

Importing it imports torch and transformers (ImportError naming them when they are missing or
transformers is older than 5.0)."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from .._validate import as_token_ids
from ..modes import KvMode

try:
    import torch
    import transformers
except ImportError as exc:     # tests/test_hf.py hides transformers to exercise this
    raise ImportError(
        "kvcache.hf needs PyTorch and Hugging Face transformers (>= 5.0, < 6; verified up to "
        "5.25.0).  Install them with `pip install torch transformers` (a CPU-only torch: `pip "
        "install torch --index-url https://download.pytorch.org/whl/cpu`)."
    ) from exc

__all__ = ["ATTN_IMPLEMENTATION", "DEFAULT_PREFILL_STEP", "PADS", "SUPPORTED_LAYER_TYPES", "TAG",
           "as_numpy", "check_batch", "check_cpu", "parse_mode", "prompt_ids", "rows_of"]

ATTN_IMPLEMENTATION = "kvcache"
#: Positions per ``model(...)`` call of :func:`prefill` (the runner's default step too).
DEFAULT_PREFILL_STEP = 512

_MIN_TRANSFORMERS = (5, 0)
_VERIFIED_TRANSFORMERS = "5.0.0 to 5.25.0"
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")
TAG = "_kvcache_layer"          # attribute carrying the HfKvLayer on the key tensor
PADS = "_kvcache_pads"          # attribute carrying each row's leading padding on the marker


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


if _version_tuple(transformers.__version__) < _MIN_TRANSFORMERS:
    raise ImportError(
        f"kvcache.hf needs transformers >= {'.'.join(map(str, _MIN_TRANSFORMERS))} (verified with "
        f"{_VERIFIED_TRANSFORMERS}), found {transformers.__version__}; upgrade with "
        "`pip install -U transformers`.")


def parse_mode(mode: KvMode | str | None) -> KvMode:
    """A :class:`kvcache.KvMode` from a mode or its name.

    Parameters
    ----------
    mode : KvMode, str or None
        ``None`` reads ``KVCACHE_KV`` (:meth:`KvMode.from_env`, float32 when unset); strings
        are ``"f32"``, ``"q8"`` (int8 K and V), ``"q8k"`` (int8 K only) or ``"q8v"`` (int8 V
        only), in the default int8 scheme "rows", or the same with ``":cmf"`` (e.g.
        ``"q8:cmf"``) for the legacy column-freeze scheme, the 4-bit modes ``"q4"``,
        ``"k8v4"``, ``"q4v"``, ``"q4k"``, ``"k4v8"`` (docs/kv4.md) and anything else
        :meth:`KvMode.parse` takes; case-insensitive.

    Returns
    -------
    KvMode
    """
    if mode is None:
        return KvMode.from_env()
    return KvMode.parse(mode, "mode")


def check_cpu(name: str, tensor: torch.Tensor) -> None:
    if tensor.device.type != "cpu":
        raise ValueError(f"{name}: expected a CPU tensor (kvcache stores and computes on the CPU), "
                         f"got device {tensor.device}; load the model on the CPU")


def as_numpy(tensor: torch.Tensor) -> npt.NDArray[np.float32]:
    """A float32 NumPy view of a CPU tensor (a copy only when the dtype must change)."""
    t = tensor.detach()
    if t.dtype != torch.float32:
        t = t.to(torch.float32)
    return t.numpy()


def rows_of(states: torch.Tensor) -> npt.NDArray[np.float32]:
    """(batch=1, nkv, n, hd) key/value states as a float32 array (n, nkv, hd)."""
    return as_numpy(states[0].transpose(0, 1))


def check_batch(states: torch.Tensor) -> None:
    if states.ndim != 4:
        raise ValueError(f"key_states: expected shape (batch, num_kv_heads, seq, head_dim), got "
                         f"{tuple(states.shape)}")
    if states.shape[0] != 1:
        raise ValueError(
            f"key_states: expected batch size 1, got {states.shape[0]}; HfKvCache holds one "
            "sequence, so batched generation, num_return_sequences > 1 and beam search are not "
            "supported (run sequences one at a time, each with its own cache)")


def prompt_ids(input_ids: Any) -> npt.NDArray[np.int64]:
    """Token ids of one sequence: a (1, n) or (n,) tensor or array, or a sequence of ints
    (:func:`kvcache._validate.as_token_ids`, the validator the runner and the store share)."""
    ids = input_ids
    if isinstance(ids, torch.Tensor):
        if ids.ndim == 2:
            if ids.shape[0] != 1:
                raise ValueError(f"input_ids: expected one sequence (batch size 1), got shape "
                                 f"{tuple(ids.shape)}")
            ids = ids[0]
        ids = ids.detach().cpu().numpy()
    elif isinstance(ids, np.ndarray) and ids.ndim == 2 and ids.shape[0] == 1:
        ids = ids[0]
    elif isinstance(ids, (list, tuple)) and len(ids) == 1 and \
            isinstance(ids[0], (list, tuple, np.ndarray)):
        ids = ids[0]
    return as_token_ids(ids, "input_ids")
