"""Zero-copy hand-off of kvcache storage to torch and NumPy through DLPack.

Every storage view kvcache hands out (``head_keys``/``head_values``, ``q8_rows``, ``columns``,
latent ``valid_view``/``slot_storage``, static K/V, the arrays of
:class:`kvcache.o1.O1DeviceView`) is a plain NumPy array, so ``torch.from_dlpack(view)`` and
``np.from_dlpack(view)`` wrap the same memory without a copy.  :func:`as_tensor` does that
and also covers bfloat16 storage, which NumPy's DLPack exporter refuses (it is exported as
uint16 and reinterpreted, still without a copy); :func:`tensors` does it for a whole
``O1DeviceView``.  Views are read-only in NumPy, but torch has no read-only tensors: writing
through such a tensor writes into the cache.  CuPy cannot wrap host memory; use a
:class:`kvcache.device.Mirror` to put the storage on a CUDA device.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, TypeVar, Union

import numpy as np
import numpy.typing as npt

from ..o1 import O1DeviceView, O1HeadView

__all__ = ["as_tensor", "tensors"]

_HINTS = {"torch": "pip install torch (for a CPU-only build: pip install torch "
                   "--index-url https://download.pytorch.org/whl/cpu)",
          "cupy": "pip install cupy-cuda12x (a CUDA device is needed)"}

_View = TypeVar("_View", bound=Union[O1DeviceView, O1HeadView, list[Any], tuple[Any, ...]])


def require(name: str) -> Any:
    """Import the optional package ``name`` ("torch" or "cupy"), or raise an ImportError that
    says how to install it."""
    try:
        return __import__(name)
    except ImportError as exc:
        raise ImportError(f"kvcache.device: the {name!r} backend needs {name}, which is not "
                          f"installed ({exc}); {_HINTS[name]}") from None


def is_bf16(dtype: npt.DTypeLike) -> bool:
    """Whether ``dtype`` is ml_dtypes' bfloat16."""
    dt = np.dtype(dtype)
    return dt.kind == "V" and dt.name == "bfloat16"


def as_tensor(array: npt.NDArray[Any], backend: str = "torch") -> Any:
    """Wrap a NumPy array (any kvcache storage view) as a torch tensor or NumPy array sharing
    its memory, through DLPack.

    Parameters
    ----------
    array : numpy.ndarray
    backend : {"torch", "numpy"}

    Returns
    -------
    torch.Tensor or numpy.ndarray
        On the CPU, with ``data_ptr()`` (``ctypes.data``) equal to ``array``'s.  bfloat16
        arrays become ``torch.bfloat16`` tensors (NumPy's DLPack exporter has no bfloat16:
        the bytes are exported as uint16 and reinterpreted).  A read-only view stays read-only
        with ``"numpy"``; torch tensors are always writable, and writing through one writes
        into the cache.
    """
    if not isinstance(array, np.ndarray):
        raise TypeError(f"array: expected a numpy array, got {type(array).__name__}")
    if backend not in ("torch", "numpy"):
        raise ValueError(f"backend: expected 'torch' or 'numpy' (CuPy cannot wrap host memory; "
                         f"use Mirror(..., backend='cupy')), got {backend!r}")
    bf16 = is_bf16(array.dtype)
    if not bf16 and (array.dtype.kind not in "biuf" or not array.dtype.isnative):
        raise TypeError(f"array: DLPack carries native-endian bool, integer and float arrays, "
                        f"got dtype {array.dtype}")
    if backend == "numpy":
        return array.view() if bf16 else _from_dlpack(np.from_dlpack, array, array.view)
    torch = require("torch")
    if bf16:
        bits = array.view(np.uint16)
        return _from_dlpack(torch.from_dlpack, bits,
                            lambda: _torch_from_numpy(torch, bits)).view(torch.bfloat16)
    return _from_dlpack(torch.from_dlpack, array, lambda: _torch_from_numpy(torch, array))


def _from_dlpack(consume: Callable[[npt.NDArray[Any]], Any], array: npt.NDArray[Any],
                 fallback: Callable[[], Any]) -> Any:
    """``consume(array)``; for a read-only array on a NumPy or torch too old for versioned
    DLPack (which alone carries the read-only flag: NumPy < 2.1, torch < 2.8 or so) the
    exporter refuses, and ``fallback()`` wraps the same memory another way."""
    try:
        return consume(array)
    except BufferError:
        if array.flags.writeable:
            raise
        return fallback()


def _torch_from_numpy(torch: Any, array: npt.NDArray[Any]) -> Any:
    with warnings.catch_warnings():          # "not writable": documented above, not a surprise
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


def tensors(view: _View, backend: str = "torch") -> _View:
    """An :class:`~kvcache.o1.O1DeviceView` (or :class:`~kvcache.o1.O1HeadView`, or a list of them,
    as ``o1_views()`` returns) with every array replaced by :func:`as_tensor` of it: the
    same scalars, the same memory, no copy."""
    if isinstance(view, (list, tuple)):
        return type(view)(tensors(v, backend) for v in view)
    if isinstance(view, O1HeadView):
        return dataclasses.replace(view, **{f: as_tensor(getattr(view, f), backend)
                                            for f in ("t_hat", "z_hat", "m_max", "q_tilde", "mu")})
    if isinstance(view, O1DeviceView):
        arrays = {f: as_tensor(getattr(view, f), backend)
                  for f in ("win_k", "win_v", "sink_k", "sink_v", "k_tilde")}
        return dataclasses.replace(view, heads=tensors(view.heads, backend), **arrays)
    raise TypeError(f"view: expected an O1DeviceView, an O1HeadView or a list of them, got "
                    f"{type(view).__name__}")
