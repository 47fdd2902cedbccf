"""Slot and allocation rules shared by the persistent caches and the re-bind protocol.

This module imports nothing of kvcache but its leaf helpers, so :mod:`kvcache.rebind` (the
protocol) and :mod:`kvcache.latent` / :mod:`kvcache.static` (the implementations) can all
depend on it without depending on each other.  It owns:

* :class:`KvAllocId`, the process-unique name of one allocation;
* :func:`resolve_dtype`, the dtypes a cache may hold (bfloat16 through ``ml_dtypes``);
* the index checks (:func:`slot_index`, :func:`maybe_index`) and geometry checks
  (:func:`at_least_one`, :func:`check_device`, :func:`check_bytes`);
* the slab rules every write follows (:func:`as_slab`, :func:`check_capacity`,
  :func:`cast_slabs`) and the read-only view rule (:func:`ro`);
* :class:`LatentSlot` (one buffer) and :class:`SlotCache`, the base of
  :class:`kvcache.LatentKvCache` and :class:`kvcache.StaticKvCache`: layers of slots,
  ``cached_len``, ``alloc_id``, versions, positions, and :meth:`SlotCache.state`, the one
  way other modules (device mirrors) read a slot cache's state.

The rules themselves are described in ``docs/latent.md``.
"""

from __future__ import annotations

import math
import operator
import os
import sys
import threading
from typing import Any, Iterable, NamedTuple, NoReturn, Optional, Sequence

import numpy as np
import numpy.typing as npt

from . import _deprecated
from ._generation import Generation
from ._validate import FloatArrayLike, as_array, as_int, readonly

__all__ = ["KvAllocId", "resolve_dtype", "slot_index", "maybe_index", "at_least_one",
           "check_device", "check_bytes", "storage_problem", "as_slab", "is_real_float",
           "check_capacity", "cast_slabs", "ro", "fmt_shape", "F32", "HOST", "DEVICES",
           "LatentSlot", "SlotState", "SlotCache"]

F32 = np.dtype(np.float32)
_PLAIN_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.float64))
HOST = "host"
DEVICES = ("cpu",)

Shape = tuple[int, ...]


# ------------------------------------------------------------------------------ KvAllocId
_id_lock = threading.Lock()
_id_next = 1          # 0 is never minted, so a zero/default value can never look real


class KvAllocId:
    """Process-unique identity of one cache allocation (never reused).

    Minted only by :meth:`next` from a module-global counter that starts at 1 and is guarded
    by a lock, so ids are unique across threads.  Frozen, hashable, equal by value.

    Examples
    --------
    >>> from kvcache.rebind import KvAllocId
    >>> a, b = KvAllocId.next(), KvAllocId.next()
    >>> a == b, b.get() > a.get() >= 1
    (False, True)
    """

    __slots__ = ("_value",)
    _value: int

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise TypeError("KvAllocId values are minted, not built: use KvAllocId.next()")

    @classmethod
    def next(cls) -> KvAllocId:
        """Mint a fresh id (thread-safe, strictly increasing within the process)."""
        global _id_next
        with _id_lock:
            value = _id_next
            _id_next += 1
        obj = object.__new__(cls)
        object.__setattr__(obj, "_value", value)
        return obj

    def get(self) -> int:
        """The id as an int (>= 1)."""
        return self._value

    def __setattr__(self, name: str, value: object) -> NoReturn:
        raise AttributeError("KvAllocId is immutable")

    def __delattr__(self, name: str) -> NoReturn:
        raise AttributeError("KvAllocId is immutable")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, KvAllocId):
            return NotImplemented
        return self._value == other._value

    def __hash__(self) -> int:
        return hash((KvAllocId, self._value))

    def __repr__(self) -> str:
        return f"KvAllocId({self._value})"

    def __copy__(self) -> KvAllocId:
        return self

    def __deepcopy__(self, memo: object) -> KvAllocId:
        return self

    def __reduce__(self) -> NoReturn:
        raise TypeError("a KvAllocId names an allocation of this process and cannot be pickled")


# ------------------------------------------------------------------------------ dtypes
def resolve_dtype(dtype: Optional[npt.DTypeLike], name: str = "dtype") -> np.dtype[Any]:
    """The cache dtype for ``dtype``: float32, float16, float64 or bfloat16.

    ``None`` means float32.  ``"bfloat16"``/``"bf16"`` (or ``ml_dtypes.bfloat16``) needs the
    optional ``ml_dtypes`` package, imported here and only here.

    Raises
    ------
    TypeError
        Any other dtype, or bfloat16 without ``ml_dtypes``.
    """
    if dtype is None:
        return F32
    if isinstance(dtype, str) and dtype.strip().lower() in ("bfloat16", "bf16"):
        try:
            import ml_dtypes
        except ImportError:
            raise TypeError(f"{name}: bfloat16 needs the optional ml_dtypes package "
                            f"(pip install ml_dtypes); or use float16, float32 or "
                            f"float64") from None
        bf16: np.dtype[Any] = np.dtype(ml_dtypes.bfloat16)   # ml_dtypes is untyped
        return bf16
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{name}: expected float32, float16, float64 or bfloat16, got "
                        f"{dtype!r}") from None
    if dt in _PLAIN_DTYPES or _is_bf16(dt):
        return dt
    raise TypeError(f"{name}: expected float32, float16, float64 or bfloat16, got {dt}")


def _is_bf16(dt: np.dtype[Any]) -> bool:
    return dt.name == "bfloat16" and dt.itemsize == 2


def is_real_float(dt: np.dtype[Any]) -> bool:
    """Whether ``dt`` holds real floating-point numbers (bfloat16 included)."""
    return dt.kind == "f" or _is_bf16(dt)


def as_slab(name: str, value: FloatArrayLike) -> npt.NDArray[Any]:
    """``value`` as an ndarray of real floats (no copy when it already is one)."""
    arr: npt.NDArray[Any] = as_array(name, value)
    if not is_real_float(arr.dtype):
        raise TypeError(f"{name}: expected real floating-point data (float16, float32, float64 or "
                        f"bfloat16), got dtype {arr.dtype}")
    return arr


# ------------------------------------------------------------------------------ indices
def slot_index(name: str, value: object, size: int, what: str) -> int:
    """``value`` as an index in ``[0, size)``: TypeError for a non-integer, IndexError naming
    ``size`` and ``what`` (e.g. ``"layers"``) when out of range."""
    idx: int = as_int(name, value)
    if not 0 <= idx < size:
        raise IndexError(f"{name}: index {idx} out of range for {size} {what}")
    return idx


def maybe_index(name: str, value: object) -> int:
    """An int for an index that may be out of range (TypeError for non-integers)."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected an integer index, got bool")
    try:
        return operator.index(value)  # type: ignore[arg-type]  # TypeError is the check
    except TypeError:
        raise TypeError(f"{name}: expected an integer index, got {type(value).__name__}") from None


# ------------------------------------------------------------------------------ geometry
def at_least_one(name: str, value: object) -> int:
    """``value`` as an int >= 1 (TypeError for a non-integer, ValueError below 1)."""
    v: int = as_int(name, value)
    if v < 1:
        raise ValueError(f"{name} must be >= 1, got {v}")
    return v


def check_device(device: object) -> str:
    """The device location of a cache: ``"cpu"``, the only one of this CPU library (case and
    surrounding blanks ignored)."""
    if not isinstance(device, str):
        raise TypeError(f"device: expected a device name (str), got {type(device).__name__}")
    loc = device.strip().lower()
    if loc not in DEVICES:
        raise ValueError(f"device: expected 'cpu' (the only device of this CPU library), got "
                         f"{device!r}")
    return loc


def fmt_shape(shape: Iterable[int]) -> str:
    """A shape as Python writes a tuple: ``(3,)``, ``(2, 4)``."""
    parts = [str(d) for d in shape]
    return "(" + ", ".join(parts) + ("," if len(parts) == 1 else "") + ")"


# Estimated bytes of the Python objects around one buffer (ndarray header, LatentSlot, list
# entry): what n_layers tiny buffers cost even when the buffers themselves are empty.
_OBJ_OVERHEAD = 200
_NO_SYSCONF_LIMIT = 2 ** 48


def _memory_limit() -> int:
    """Physical memory of this machine in bytes (``SC_PAGE_SIZE * SC_PHYS_PAGES``), or 2**48
    where the platform does not report it: a total above it cannot possibly be allocated."""
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return _NO_SYSCONF_LIMIT
    if pages > 0 and size > 0:
        return pages * size
    return _NO_SYSCONF_LIMIT


def check_bytes(shapes: Sequence[Shape], dtype: np.dtype[Any], n_layers: int = 1) -> None:
    """ValueError (naming the geometry) when one buffer is too large to address at all, or when
    ``n_layers`` layers of these buffers (plus ~200 B of Python objects per buffer) would need
    more than the machine's physical memory.  Checked before anything is allocated, so a huge
    ``n_layers`` fails at once instead of allocating objects until the process runs out of
    memory."""
    per_layer = 0
    for shape in shapes:
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes > sys.maxsize:
            raise ValueError(f"geometry: one buffer of shape {shape} ({dtype}) would need "
                             f"{nbytes} bytes, more than this platform can address")
        per_layer += nbytes + _OBJ_OVERHEAD
    total = n_layers * per_layer
    limit = _memory_limit()
    if total > limit:
        raise ValueError(f"geometry: {n_layers} layers of {len(shapes)} buffer(s) of shapes "
                         f"{', '.join(fmt_shape(s) for s in shapes)} ({dtype}) would need about "
                         f"{total} bytes (buffers plus ~{_OBJ_OVERHEAD} B of objects per "
                         f"buffer), more than this machine's {limit} bytes of memory")


def storage_problem(storage: object, shape: Sequence[int], dtype: np.dtype[Any],
                    writable: bool) -> Optional[str]:
    """Why ``storage`` cannot be used as a buffer of ``shape``/``dtype`` (None when it can)."""
    if not isinstance(storage, np.ndarray):
        return f"is a {type(storage).__name__}, not a numpy array"
    if storage.dtype != dtype:
        return f"has dtype {storage.dtype}"
    if storage.shape != tuple(shape):
        return f"has shape {storage.shape}"
    if not storage.flags.c_contiguous:
        return "is not C-contiguous"
    if writable and not storage.flags.writeable:
        return "is read-only"
    return None


# ------------------------------------------------------------------------------ writes
def check_capacity(name: str, cached_len: int, seq: int, max_seq_len: int) -> None:
    """ValueError when ``seq`` more positions at ``cached_len`` would pass ``max_seq_len``."""
    if cached_len + seq > max_seq_len:
        raise ValueError(f"{name}: {seq} positions at cached_len={cached_len} overflow "
                         f"max_seq_len={max_seq_len}")


def cast_slabs(names: Sequence[str], arrays: Sequence[npt.NDArray[Any]], dtype: np.dtype[Any],
               storages: Sequence[npt.NDArray[Any]]) -> list[npt.NDArray[Any]]:
    """Every slab as an array of the cache dtype, converted *before* anything is written.

    A cast that raises (``np.errstate(over="raise")`` on float64 -> float16 overflow, warnings
    turned into errors, a cast a dtype extension refuses) therefore raises while the cache is
    still untouched.  A slab that already has the cache dtype is used as is, unless it shares
    memory with one of the storages about to be written (a view of another slot), in which
    case it is copied so an earlier slot's write cannot change it."""
    out = []
    for _name, arr in zip(names, arrays):
        if arr.dtype == dtype:
            if any(np.may_share_memory(arr, st) for st in storages):
                arr = arr.copy()
        else:
            arr = arr.astype(dtype)
        out.append(arr)
    return out


def ro(buf: npt.NDArray[Any], idx: Any = Ellipsis) -> npt.NDArray[Any]:
    """A read-only view ``buf[idx]`` of a C-contiguous buffer that cannot be made writable.

    bfloat16 has no buffer-protocol format, so for it the view is built on a read-only
    memoryview of the raw bytes instead."""
    try:
        view: npt.NDArray[Any] = readonly(buf[idx])
        return view
    except ValueError:
        raw = memoryview(buf.reshape(-1).view(np.uint8).data).toreadonly()
        whole: npt.NDArray[Any] = np.frombuffer(raw, dtype=buf.dtype).reshape(buf.shape)
        part: npt.NDArray[Any] = whole[idx]
        return part


# ------------------------------------------------------------------------------ slots
class LatentSlot:
    """One (layer, slot) buffer of a persistent cache.

    Attributes
    ----------
    storage : ndarray
        The live, zero-initialised, C-contiguous buffer (its full capacity).
    layout : tuple of int
        Shape of ``storage``: ``(max_seq_len, *trailing)`` for a latent slot,
        ``(1, num_kv_heads, max_seq_len, head_dim)`` for a StaticKvCache K or V.
    version : int
        Monotonic counter, +1 per :meth:`LatentKvCache.bump_version` (0 at allocation).
    authority : str
        Coherence authority; always ``"host"`` (placeholder for a multi-device protocol).
    """

    __slots__ = ("storage", "layout", "version", "authority")

    storage: npt.NDArray[Any]
    layout: Shape
    version: int
    authority: str

    def __init__(self, storage: npt.NDArray[Any], layout: Optional[Sequence[int]] = None,
                 version: int = 0, authority: str = HOST) -> None:
        if not isinstance(storage, np.ndarray):
            raise TypeError(f"LatentSlot: storage must be a numpy array (the slot's buffer), got "
                            f"{type(storage).__name__}")
        self.storage = storage
        self.layout = tuple(storage.shape) if layout is None else tuple(layout)
        self.version = version
        self.authority = authority

    def __repr__(self) -> str:
        return (f"LatentSlot(layout={self.layout}, dtype={self.storage.dtype}, "
                f"version={self.version}, authority={self.authority!r})")


class SlotState(NamedTuple):
    """A consistent reading of a slot cache's state (:meth:`SlotCache.state`).

    Attributes
    ----------
    storages : tuple of (None or tuple of ndarray)
        Per layer, the live buffers of its slots in slot order (each checked: the cache dtype,
        the allocated shape, C-contiguous); None for an unpopulated (cleared) layer.  The
        buffers are the cache's own, not copies: read them, do not write them.
    cached_len : int
        Valid positions: rows ``[0, cached_len)`` along ``capacity_axis``.
    max_seq_len : int
        Capacity in positions.
    capacity_axis : int
        The axis of every storage that holds positions (0 for a latent slot, 2 for a
        StaticKvCache K or V).
    alloc_id : KvAllocId
        The allocation the storages belong to.
    generation : int
        The cache's generation (see :meth:`SlotCache.unchanged_prefix`).
    """

    storages: tuple[Optional[tuple[npt.NDArray[Any], ...]], ...]
    cached_len: int
    max_seq_len: int
    capacity_axis: int
    alloc_id: KvAllocId
    generation: int


class SlotCache:
    """What the persistent caches share: layers of slots, cached_len, alloc_id, versions.

    A subclass sets, in its constructor, ``layers`` (from :meth:`_allocate`), ``_cached_len``,
    ``_max_seq_len``, ``_dtype``, ``_device``, ``_alloc_id`` and ``_gen``, and defines
    :meth:`_storage_shape`; ``_n_slots`` and ``capacity_axis`` are class or instance fields.
    The fields are this class's own: other modules read them through the properties and
    :meth:`state`.
    """

    _n_slots: int = 0
    capacity_axis: int = 0
    """The axis of every storage that holds positions."""

    layers: list[Optional[list[LatentSlot]]]
    _cached_len: int
    _max_seq_len: int
    _dtype: np.dtype[Any]
    _device: Optional[str]
    _alloc_id: KvAllocId
    _gen: Generation

    def _allocate(self, n_layers: int, shapes: Sequence[Shape],
                  dtype: np.dtype[Any]) -> list[Optional[list[LatentSlot]]]:
        layers: list[Optional[list[LatentSlot]]] = []
        for _ in range(n_layers):                       # layer-major, slot-minor
            layers.append([LatentSlot(np.zeros(shape, dtype=dtype), shape) for shape in shapes])
        return layers

    def _storage_shape(self, s: int) -> Shape:
        raise NotImplementedError

    # ---------------------------------------------------------------- fields
    @property
    def cached_len(self) -> int:
        """Valid positions: rows ``[0, cached_len)`` of every slot hold data."""
        return self._cached_len

    @property
    def seq_len(self) -> int:
        """The same as :attr:`cached_len` (read-only): every cache of kvcache names its length
        ``seq_len``."""
        return self._cached_len

    @property
    def max_seq_len(self) -> int:
        """Capacity in positions."""
        return self._max_seq_len

    @property
    def dtype(self) -> np.dtype[Any]:
        """The storage dtype (``numpy.dtype``)."""
        return self._dtype

    @property
    def n_layers(self) -> int:
        """``len(layers)``: counts unpopulated (None) layers too."""
        return len(self.layers)

    @property
    def n_slots(self) -> int:
        """Buffers per layer."""
        return self._n_slots

    @property
    def alloc_id(self) -> KvAllocId:
        """The :class:`KvAllocId` of the storage this cache currently owns."""
        return self._alloc_id

    @property
    def generation(self) -> int:
        """A counter that grows each time stored rows change other than by appending:
        :meth:`truncate_last` (when it drops rows) and :meth:`clear`.  ``write_layer`` +
        ``advance`` only append, and leave it alone.  Writes made by hand through
        :meth:`slot_storage` into rows below ``cached_len`` are not seen: a device mirror
        must then be re-synced with ``sync(full=True)``."""
        value: int = self._gen.value
        return value

    def unchanged_prefix(self, since: Optional[int]) -> Optional[int]:
        """The number of rows ``n`` such that rows ``[0, n)`` of every slot hold what they held
        at generation ``since``; None when :meth:`clear` ran after ``since``, when more than
        64 truncations did (only the last 64 are remembered), or when ``since`` is not a
        generation this cache has had.  Truncations only lower it."""
        prefix = self._gen.unchanged_prefix(since, self._cached_len)
        return None if prefix is None else int(prefix)

    def __len__(self) -> int:
        return self._cached_len

    def __bool__(self) -> bool:
        return True

    def slot_state(self, what: str = "slot_state") -> SlotState:
        """Deprecated name of :meth:`state` (the state protocol has one name for every cache
        kind: ``LayerKvCache.state()`` too)."""
        _deprecated.warn(f"kvcache.{type(self).__name__}.slot_state()", "state()")
        return self.state(what)

    def state(self, what: str = "state") -> SlotState:
        """Every layer's checked storages with the lengths, id and generation, read together.

        This is how other modules (the device mirrors) read a slot cache, as they read a
        :class:`kvcache.LayerKvCache` through its ``state()``: it never hands out a storage
        it has not checked, and it needs no private field.

        Parameters
        ----------
        what : str
            The caller's name for itself, used in error messages (``"sync"``).

        Returns
        -------
        SlotState

        Raises
        ------
        ValueError
            A storage that is no longer the allocated buffer (replaced through the public
            ``layers`` or ``LatentSlot.storage``), naming the layer and slot.
        """
        storages = tuple(
            None if slots is None else tuple(self._storages(what, li, slots))
            for li, slots in enumerate(self.layers))
        return SlotState(storages, self._cached_len, self._max_seq_len, self.capacity_axis,
                         self._alloc_id, self.generation)

    # ---------------------------------------------------------------- slot access
    def _slots_or_none(self, layer: int) -> Optional[list[LatentSlot]]:
        if not 0 <= layer < len(self.layers):
            return None
        return self.layers[layer]

    def slot_storage(self, layer: int, slot: int) -> Optional[npt.NDArray[Any]]:
        """The live buffer of (layer, slot), or None.

        Parameters
        ----------
        layer, slot : int

        Returns
        -------
        ndarray or None
            The storage itself (writable, the same object on every call until ``clear()``);
            None when ``layer`` or ``slot`` is out of range or the layer is unpopulated.
        """
        li, si = maybe_index("layer", layer), maybe_index("slot", slot)
        slots = self._slots_or_none(li)
        if slots is None or not 0 <= si < len(slots):
            return None
        return slots[si].storage

    def bump_version(self, layer: int, slot: int) -> None:
        """Add 1 to the version of (layer, slot); a silent no-op when either index is out of
        range or the layer is unpopulated (TypeError only for a non-integer index)."""
        li, si = maybe_index("layer", layer), maybe_index("slot", slot)
        slots = self._slots_or_none(li)
        if slots is None or not 0 <= si < len(slots):
            return
        slots[si].version += 1

    def _populated(self, layer: int, what: str) -> tuple[int, list[LatentSlot]]:
        """(layer index, its slots); IndexError out of range, ValueError when unpopulated."""
        li = slot_index("layer", layer, len(self.layers), "layers")
        slots = self.layers[li]
        if slots is None:
            raise ValueError(f"{what}: layer {li} holds no storage (the cache was cleared); "
                             f"allocate a new cache with with_capacity")
        return li, slots

    def _storages(self, what: str, li: int, slots: object, which: Optional[int] = None,
                  writable: bool = False) -> list[npt.NDArray[Any]]:
        """The storages of layer ``li`` (or only slot ``which``), each checked against the
        cache's geometry: a numpy array of the cache dtype, exactly the allocated shape,
        C-contiguous (and writable when ``writable``).

        ``layers`` and ``LatentSlot.storage`` are public, writable fields; a replaced buffer
        of another shape must raise here (ValueError naming the layer and slot) rather than
        let a write land half-way or the compiled kernel read out of bounds."""
        n = self._n_slots
        if not isinstance(slots, (list, tuple)) or len(slots) != n:
            got = (f"{len(slots)} slots" if isinstance(slots, (list, tuple))
                   else f"a {type(slots).__name__}")
            raise ValueError(f"{what}: layer {li} holds {got}, expected a list of {n} LatentSlot "
                             f"(was cache.layers[{li}] replaced?)")
        out = []
        for s in (range(n) if which is None else (which,)):
            storage = getattr(slots[s], "storage", None)
            want = self._storage_shape(s)
            problem = storage_problem(storage, want, self._dtype, writable)
            if problem is not None:
                raise ValueError(f"{what}: the storage of layer {li}, slot {s} {problem}; "
                                 f"expected a C-contiguous{' writable' if writable else ''} "
                                 f"{self._dtype} array of shape {want} (was it replaced?)")
            assert isinstance(storage, np.ndarray)     # storage_problem checked it
            out.append(storage)
        return out

    # ---------------------------------------------------------------- positions
    def advance(self, seq: int) -> None:
        """Commit ``seq`` written positions: ``cached_len += seq``, then every populated
        (layer, slot) version += 1 (once per call, not per token).

        Call it once per step, after ``write_layer`` has written every layer.

        Raises
        ------
        ValueError
            ``seq < 1``, ``cached_len + seq > max_seq_len``, or no layer is populated.
        """
        seq = as_int("seq", seq, minimum=1)
        check_capacity("seq", self._cached_len, seq, self._max_seq_len)
        populated = [slots for slots in self.layers if slots is not None]
        if not populated:
            raise ValueError("advance: the cache holds no layers (it was cleared); allocate a "
                             "new cache with with_capacity")
        self._cached_len += seq
        for slots in populated:
            for slot in slots:
                slot.version += 1

    def truncate_last(self, n: int) -> None:
        """Roll back the newest ``n`` positions (speculative-decode reject), as
        :meth:`kvcache.LayerKvCache.truncate_last`: ``cached_len`` becomes
        ``max(cached_len - n, 0)``.

        Metadata only: storages, versions and ``alloc_id`` are untouched (a rewind is not a
        re-allocation); the rows past the new length are simply not read until overwritten.

        Raises
        ------
        ValueError
            ``n < 0``.
        """
        n = as_int("n", n, minimum=0)
        self._shrink(max(self._cached_len - n, 0))

    def truncate_to(self, new_len: int) -> None:
        """Deprecated (a DeprecationWarning): ``truncate_last(cached_len - new_len)``, the one
        rollback name; rewinds to ``new_len`` positions when that is shorter, else a no-op.

        Raises
        ------
        ValueError
            ``new_len < 0``.
        """
        _deprecated.warn(f"kvcache.{type(self).__name__}.truncate_to(new_len)",
                         "truncate_last(cached_len - new_len)")
        self._shrink(as_int("new_len", new_len, minimum=0))

    def _shrink(self, new_len: int) -> None:
        if new_len < self._cached_len:
            self._cached_len = new_len
            self._gen.shrink(new_len)

    # ---------------------------------------------------------------- KvRebindSource
    def rebind_location(self) -> Optional[str]:
        """Where the storage lives (KvRebindSource): ``"cpu"``, or None when that cannot be
        proven."""
        return self._device

    def rebind_slot(self, layer: int, which: int) -> Optional[npt.NDArray[Any]]:
        """Storage of half ``which`` of ``layer`` for a decode-plan re-bind (KvRebindSource):
        :meth:`slot_storage`, None when absent."""
        return self.slot_storage(layer, which)
