"""The one array validator used by every public entry point.

A leaf module: it imports nothing of kvcache.  Conventions (``docs/architecture.md``): anything ``np.asarray`` accepts; bool/int/float data become
C-contiguous float32; complex, object, string and other dtypes raise TypeError; a wrong shape
raises ValueError naming the parameter ("expected ..., got ...").
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional, TypeVar

import numpy as np
import numpy.typing as npt

__all__ = ["FloatArrayLike", "IntArrayLike", "as_array", "as_f32", "as_f32_scalar", "as_float",
           "as_index", "as_int", "as_token_ids", "out_f32", "readonly"]

F32 = npt.NDArray[np.float32]
Shape = Sequence[Optional[int]]
A = TypeVar("A", bound=npt.NDArray[Any])

# What the public entry points accept, for the type checker: numbers, nested sequences of
# numbers and arrays of bool/integer/floating dtype -- not str or bytes, which np.asarray
# would also take (and which the checks below refuse at run time).
if TYPE_CHECKING:
    from numpy._typing import _ArrayLikeFloat_co as FloatArrayLike  # noqa: F401 (re-exported)
    from numpy._typing import _ArrayLikeInt_co as IntArrayLike  # noqa: F401 (re-exported)
else:
    FloatArrayLike = IntArrayLike = npt.ArrayLike

_F32 = np.dtype(np.float32)


def as_array(name: str, value: object) -> npt.NDArray[Any]:
    """``np.asarray(value)`` (no copy for an ndarray); ValueError naming the parameter when
    NumPy cannot read it as a rectangular array (ragged lists and the like)."""
    if isinstance(value, np.ndarray):
        return value
    try:
        return np.asarray(value)
    except Exception as exc:
        raise ValueError(f"{name}: expected a rectangular array of numbers, got "
                         f"{type(value).__name__} that numpy cannot read ({exc})") from None


def as_f32(name: str, value: object, shapes: Optional[Sequence[Shape]] = None) -> F32:
    """Return ``value`` as a C-contiguous float32 ndarray.

    Parameters
    ----------
    name : str
        Parameter name used in error messages.
    value : array_like
    shapes : sequence of tuple, optional
        Allowed shapes; ``None`` entries in a shape match any size.  When given and no shape
        matches, ValueError says which were expected.
    """
    if isinstance(value, np.ndarray) and value.dtype == _F32 and value.flags.c_contiguous:
        arr: F32 = value
    else:
        raw = as_array(name, value)
        if raw.dtype.kind not in "biuf":
            raise TypeError(f"{name}: expected real numbers (float32), got dtype {raw.dtype}")
        arr = np.asarray(raw, dtype=_F32, order="C")   # keeps 0-d as 0-d (ascontiguousarray would not)
    if shapes is not None and not any(_shape_ok(arr.shape, s) for s in shapes):
        raise ValueError(f"{name}: expected shape {_fmt_shapes(shapes)}, got {arr.shape}")
    return arr


def out_f32(name: str, value: object, size: Optional[int] = None,
            shape: Optional[Sequence[int]] = None) -> F32:
    """Check a caller-provided output buffer: writable, C-contiguous float32 ndarray."""
    if not isinstance(value, np.ndarray):
        raise TypeError(f"{name}: expected a writable float32 numpy array, got {type(value).__name__}")
    if value.dtype != _F32:
        raise TypeError(f"{name}: expected dtype float32, got {value.dtype}")
    if not value.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous array, got strides {value.strides}")
    if not value.flags.writeable:
        raise ValueError(f"{name}: expected a writable array, got a read-only one")
    if size is not None and value.size != size:
        raise ValueError(f"{name}: expected {size} elements, got {value.size} (shape {value.shape})")
    if shape is not None and value.shape != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {value.shape}")
    out: F32 = value
    return out


def as_index(name: str, value: object, size: int) -> int:
    """An integer index in [0, size); IndexError outside, TypeError for non-integers."""
    idx = as_int(name, value)
    if not 0 <= idx < size:
        raise IndexError(f"{name}: index {idx} out of range for {size} heads")
    return idx


def as_int(name: str, value: object, minimum: Optional[int] = None) -> int:
    """An integer (anything with ``__index__``, bools excluded); ValueError below ``minimum``."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected an integer, got bool")
    try:
        v = operator.index(value)  # type: ignore[arg-type]  # any __index__; TypeError below
    except TypeError:
        raise TypeError(f"{name}: expected an integer, got {type(value).__name__}") from None
    if minimum is not None and v < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {v}")
    return v


def as_float(name: str, value: object, *, finite: bool = True,
             minimum: Optional[float] = None) -> float:
    """A real number as a Python float; ValueError when not finite or below ``minimum``."""
    if isinstance(value, (str, bytes, complex, bool, np.bool_)):
        raise TypeError(f"{name}: expected a real number, got {type(value).__name__}")
    try:
        v = float(value)  # type: ignore[arg-type]  # any __float__; TypeError below
    except OverflowError:                       # an int beyond the float range
        raise ValueError(f"{name}: expected a finite number, got {value!r:.40}") from None
    except (TypeError, ValueError):
        raise TypeError(f"{name}: expected a real number, got {type(value).__name__}") from None
    if finite and not np.isfinite(v):
        raise ValueError(f"{name}: expected a finite number, got {v}")
    if minimum is not None and v < minimum:
        raise ValueError(f"{name}: expected a number >= {minimum}, got {v}")
    return v


def as_f32_scalar(name: str, value: object, *, positive: bool = False,
                  minimum: Optional[float] = None) -> float:
    """A real number the float32 kernel receives unchanged in kind: finite in float64 *and*
    after rounding to float32 (1e39 would become inf), not a nonzero value that underflows to
    0 in float32 (1e-46), and > 0 when ``positive``.  Returns the float32-rounded value."""
    v = as_float(name, value, minimum=minimum)
    if positive and not v > 0:
        raise ValueError(f"{name}: expected a number > 0, got {v}")
    with np.errstate(all="ignore"):
        f = float(np.asarray(v, dtype=np.float64).astype(np.float32))
    if not math.isfinite(f):
        raise ValueError(f"{name}: {v} is not finite in float32 (the kernel computes in float32, "
                         f"largest {float(np.finfo(np.float32).max):.6g})")
    if v != 0 and f == 0:
        raise ValueError(f"{name}: {v} underflows to 0 in float32 (the kernel computes in "
                         f"float32, smallest {float(np.finfo(np.float32).smallest_subnormal):.6g})")
    return f


def readonly(arr: A) -> A:
    """A read-only view of ``arr`` that cannot be made writable again.

    The view is built on a read-only memoryview of the storage, so setting
    ``flags.writeable = True`` on it raises instead of opening the cache to writes."""
    view = np.asarray(memoryview(arr).toreadonly())  # type: ignore[arg-type]  # a buffer
    return view  # type: ignore[return-value]  # same dtype and shape as arr


def _shape_ok(shape: tuple[int, ...], pattern: Shape) -> bool:
    return len(shape) == len(pattern) and all(p is None or p == s for s, p in zip(shape, pattern))


def _fmt_shapes(shapes: Sequence[Shape]) -> str:
    parts = ["(" + ", ".join("n" if d is None else str(d) for d in s) + ("," if len(s) == 1 else "") + ")"
             for s in shapes]
    return " or ".join(parts)


def as_token_ids(ids: object, name: str = "ids", *, vocab: Optional[int] = None,
                 allow_empty: bool = False) -> npt.NDArray[np.int64]:
    """Token ids as a 1-D little-endian int64 array: the one validator of the runner,
    :mod:`kvcache.hf` and the prefix store.

    Accepts anything ``np.asarray`` reads as a 1-D array of integers (lists, NumPy arrays of
    any integer dtype, CPU torch tensors).  TypeError for other dtypes (floats, bools,
    strings); ValueError for another number of dimensions, for an empty sequence unless
    ``allow_empty``, for ids outside the int64 range and, with ``vocab``, for ids outside
    ``[0, vocab)``."""
    what = "a 1-D sequence of integer token ids"
    if isinstance(ids, (str, bytes, bytearray, memoryview)):
        raise TypeError(f"{name}: expected {what}, got {type(ids).__name__}")
    try:
        arr: npt.NDArray[Any] = np.asarray(ids)
    except Exception as exc:
        raise ValueError(f"{name}: expected {what}, got {type(ids).__name__} that numpy cannot "
                         f"read ({exc})") from None
    if arr.ndim != 1:
        raise ValueError(f"{name}: expected a 1-D sequence of token ids, got shape {arr.shape}")
    if arr.size == 0:
        if not allow_empty:
            raise ValueError(f"{name}: expected a non-empty sequence of token ids")
        return np.zeros(0, dtype=np.int64)
    if isinstance(ids, (list, tuple)):
        if any(isinstance(i, (bool, np.bool_)) for i in ids):
            raise TypeError(f"{name}: expected integer token ids, got a bool among them")
        if arr.dtype.kind in "fO" and all(isinstance(i, (int, np.integer)) for i in ids):
            # Python ints beyond int64 make numpy choose float64 or object
            raise ValueError(f"{name}: a token id does not fit in a signed 64-bit integer")
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected integer token ids, got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and int(arr.max()) >= 1 << 63:
        raise ValueError(f"{name}: a token id does not fit in a signed 64-bit integer")
    out: npt.NDArray[np.int64] = np.ascontiguousarray(arr, dtype="<i8")
    if vocab is not None and (int(out.min()) < 0 or int(out.max()) >= vocab):
        raise ValueError(f"{name}: token ids must lie in [0, {vocab})")
    return out
