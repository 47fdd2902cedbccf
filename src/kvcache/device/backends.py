"""Where a mirror keeps its copies: torch (any device), CuPy (a CUDA device) or NumPy (host).

A backend allocates device arrays, uploads host arrays into slices of them, copies device to
device and reads one back; torch and CuPy are imported on first use, with an ImportError that
says what to install when they are missing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Protocol, Union

import numpy as np
import numpy.typing as npt

from .. import _deprecated
from .dlpack import as_tensor, is_bf16, require

__all__ = ["DeviceBackend", "TorchBackend", "ArrayBackend", "BACKENDS", "make_backend",
           "cuda_ordinal"]

BACKENDS = ("torch", "cupy", "numpy")


class DeviceBackend(Protocol):
    """What a mirror needs of a backend.

    Named apart from :class:`kvcache.store.StoreBackend` (where a prefix store keeps its
    entries); ``Backend``, its old name, is deprecated."""

    name: str
    device: Any

    def empty(self, shape: tuple[int, ...], np_dtype: npt.DTypeLike) -> Any:
        """An uninitialised device array."""

    def upload(self, dst: Any, src: npt.NDArray[Any]) -> None:
        """Copy host ``src`` into the device array (or slice) ``dst`` of the same shape."""

    def copy(self, dst: Any, src: Any) -> None:
        """Copy device ``src`` into device ``dst`` (same shape)."""

    def to_numpy(self, t: Any) -> npt.NDArray[Any]:
        """A host copy of one of this backend's device arrays."""


class TorchBackend:
    """torch tensors on any device torch knows ("cpu", "cuda", "cuda:1", ...)."""

    name = "torch"

    def __init__(self, device: Any) -> None:
        torch = self._torch = require("torch")
        try:
            dev = torch.device("cpu" if device is None else device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"device: torch does not know {device!r} ({exc})") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"device: {dev} was asked for, but torch sees no CUDA device")
        if dev.type == "meta":
            raise ValueError("device: 'meta' tensors hold no data; a mirror needs a real device")
        try:                                   # fail here, not half-way through the first sync
            probe = torch.zeros(2, dtype=torch.int8, device=dev)
            probe[1:].copy_(torch.ones(1, dtype=torch.int8))
            probe.cpu()
        except Exception as exc:
            raise RuntimeError(f"device: torch cannot allocate and copy on {dev} "
                               f"({type(exc).__name__}: {exc})") from None
        self.device: Any = dev
        self._cpu = dev.type == "cpu"

    def dtype(self, np_dtype: npt.DTypeLike) -> Any:
        """The torch dtype of a NumPy dtype."""
        if is_bf16(np_dtype):
            return self._torch.bfloat16
        return {"float32": self._torch.float32, "float16": self._torch.float16,
                "float64": self._torch.float64, "int8": self._torch.int8,
                "uint8": self._torch.uint8}[np.dtype(np_dtype).name]

    def empty(self, shape: tuple[int, ...], np_dtype: npt.DTypeLike) -> Any:
        return self._torch.empty(shape, dtype=self.dtype(np_dtype), device=self.device)

    def upload(self, dst: Any, src: npt.NDArray[Any]) -> None:
        if self._cpu:          # a NumPy copy: torch's copy_ costs ~30 us more per small slice
            if is_bf16(src.dtype):
                dst.view(self._torch.int16).numpy()[...] = src.view(np.int16)
            else:
                dst.numpy()[...] = src
        else:
            dst.copy_(as_tensor(src, "torch"))

    def copy(self, dst: Any, src: Any) -> None:
        dst.copy_(src)

    def to_numpy(self, t: Any) -> npt.NDArray[Any]:
        if not isinstance(t, self._torch.Tensor):
            raise TypeError(f"tensor: expected a torch.Tensor of this mirror, got "
                            f"{type(t).__name__}")
        t = t.detach().cpu()
        if t.dtype == self._torch.bfloat16:
            import ml_dtypes
            out: npt.NDArray[Any] = t.view(self._torch.int16).numpy().view(ml_dtypes.bfloat16)
            return out
        host: npt.NDArray[Any] = t.numpy()
        return host


class ArrayBackend:
    """NumPy (host arrays) or CuPy (CUDA arrays): the same slice assignments."""

    def __init__(self, name: str, device: Any) -> None:
        self.name = name
        self.device: Any
        if name == "numpy":
            if device not in (None, "cpu"):
                raise ValueError(f"device: the numpy backend keeps its copy in host memory; "
                                 f"expected None or 'cpu', got {device!r}")
            self._xp: Any = np
            self.device = "cpu"
        else:
            ordinal = cuda_ordinal(device)
            self._xp = require("cupy")
            self.device = self._xp.cuda.Device(ordinal)

    def empty(self, shape: tuple[int, ...], np_dtype: npt.DTypeLike) -> Any:
        if self.name == "cupy":
            if is_bf16(np_dtype):
                raise TypeError("the cupy backend has no bfloat16 arrays; use backend='torch'")
            with self.device:
                return self._xp.empty(shape, dtype=np_dtype)
        return np.empty(shape, dtype=np_dtype)

    def upload(self, dst: Any, src: npt.NDArray[Any]) -> None:
        if self.name == "cupy":
            with self.device:
                dst[...] = self._xp.asarray(src)
        else:
            dst[...] = src

    def copy(self, dst: Any, src: Any) -> None:
        if self.name == "cupy":
            with self.device:
                dst[...] = src
        else:
            dst[...] = src

    def to_numpy(self, a: Any) -> npt.NDArray[Any]:
        if not isinstance(a, self._xp.ndarray):
            raise TypeError(f"tensor: expected a {self.name} array of this mirror, got "
                            f"{type(a).__name__}")
        if self.name == "cupy":
            with self.device:
                host: npt.NDArray[Any] = self._xp.asnumpy(a)
                return host
        return np.array(a)


def cuda_ordinal(device: Union[None, int, str, Any]) -> int:
    """CuPy's device: None (0), an int >= 0 or "cuda" / "cuda:N"."""
    if device is None:
        return 0
    if isinstance(device, (int, np.integer)) and not isinstance(device, (bool, np.bool_)):
        if device >= 0:
            return int(device)
    elif isinstance(device, str) and device.split(":")[0] == "cuda":
        tail = device.partition(":")[2]
        if tail == "" or tail.isdigit():
            return int(tail or 0)
    raise ValueError(f"device: the cupy backend takes a CUDA device ordinal (an int >= 0) or "
                     f"'cuda[:N]', got {device!r}")


def make_backend(backend: str, device: Optional[Any]) -> DeviceBackend:
    """The backend named ``backend`` on ``device``."""
    if backend == "torch":
        return TorchBackend(device)
    if backend in ("cupy", "numpy"):
        return ArrayBackend(backend, device)
    raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")


# the old name, deprecated in 0.2.0 (type checkers see only the new one)
if not TYPE_CHECKING:
    __getattr__ = _deprecated.module_getattr(
        __name__, {"Backend": "kvcache.device.backends.DeviceBackend"})
