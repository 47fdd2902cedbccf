"""Fixed-capacity decode caches: LatentKvCache and LazyLatentCache (StaticKvCache in its module).

Port of the persistent caches of the upstream Rust engine (``docs/latent.md`` describes them and
their rules).  Three caches, one vocabulary; the rules they share (:class:`KvAllocId`, dtypes,
slot and size checks, the slot-cache base) live in :mod:`kvcache._slots`:

``LatentKvCache`` -- the N-slot persistent cache (MLA and friends)
    Every layer holds ``n_slots`` buffers; slot ``s`` of every layer is one zeroed,
    C-contiguous array of shape ``(max_seq_len, *slot_trailing[s])`` allocated up front, layer
    by layer (layer-major, slot-minor).  The capacity axis is 0: a latent is a per-token vector,
    there is no head axis.  DeepSeek-V2 MLA uses ``slot_trailing = ((kv_lora_rank,),
    (qk_rope_head_dim,))``: slot 0 the post-RMSNorm compressed latent ``c_kv``, slot 1 the
    post-RoPE shared key ``k_pe``.  One slot of ``(H_kv*D,)`` is a shared K=V cache.

``StaticKvCache`` -- the symmetric K/V cache (upstream ``KvCache::with_capacity``)
    In :mod:`kvcache.static` (re-exported here).  K and V of each layer are zeroed arrays
    ``(1, num_kv_heads, max_seq_len, head_dim)`` (capacity axis 2, the Hugging Face layout),
    slot 0 = K, slot 1 = V.  ``attend`` runs the compiled grouped-query kernel
    (``kvcache._core.attend_rows``) over the valid rows.

``LazyLatentCache`` -- the per-pass functional twin of ``LatentKvCache``
    Same buffers, but ``append`` returns a *new* cache and never mutates the one it is called
    on; positions advance explicitly with ``advance_by``.

The write protocol of one decode step (what the upstream model forward does)::

    for layer in range(n_layers):
        cache.write_layer(layer, slabs)   # rows [cached_len, cached_len + seq), no advance
    cache.advance(seq)                    # cached_len += seq; every slot's version += 1

All layers write at the same offset; ``cached_len`` moves once per step, after every layer.
Rows at or past ``cached_len`` are stale or zero and must not be read: attention reads rows
``[0, cached_len + seq)`` while the step is in flight (``slot_storage``) and rows
``[0, cached_len)`` afterwards (``valid_view``).

Identity and versions.  ``alloc_id`` (a :class:`KvAllocId`) names the *allocation*, not the
conversation: a constructor and ``clear()`` mint a new one (every buffer is released, so a
decode plan bound to them must be rebuilt or re-bound, see :mod:`kvcache.rebind`);
``truncate_last``, ``write_layer``, ``advance`` and ``bump_version`` keep it.  Each (layer, slot)
has a ``version`` counter, bumped once per ``advance`` (not per token); it is bookkeeping for
staleness checks and plays no part in plan validity.

Storage.  ``slot_storage(layer, slot)`` returns the live, writable buffer itself (always the
same object until ``clear()``), because it is the binding handle a decode plan reads and
writes through; it is not a view handed out for reading, so the read-only rule of the API
conventions does not apply to it.  ``valid_view`` (rows ``[0, cached_len)``) is read-only.

Numbers.  Cache dtypes: float32 (default), float16, float64 and bfloat16.  bfloat16 comes from
the optional ``ml_dtypes`` package, imported only when asked for (``dtype="bfloat16"`` or
``ml_dtypes.bfloat16``); without it a TypeError says to install it.  Any other dtype raises
TypeError.  Slabs written into a cache must hold real floating-point numbers (float16, float32,
float64, long double or bfloat16); they are cast to the cache dtype with NumPy's rounding
(``same_kind`` casting: float64 -> float16 rounds, values beyond the range become inf as IEEE
says).  Integer, boolean, complex, object and string slabs raise TypeError: a latent or a K/V
row is an activation, and integer input there is almost always a bug (token ids passed by
mistake).

Every mutating call validates everything (indices, slab count, shapes, a common ``seq``,
capacity, dtypes) and converts every slab to the cache dtype before it writes anything: a call
that raises -- the cast itself included (``np.errstate(over="raise")``, warnings as errors) --
leaves the cache exactly as it was (same bytes, ``cached_len``, versions and ``alloc_id``).

``layers`` and ``LatentSlot.storage`` are public, writable fields (as upstream).  Every call
that reads or writes a storage (``write_layer``, ``valid_view``, ``attend``) first checks it is
still a numpy array of the cache dtype, exactly the allocated shape and C-contiguous (and
writable, for a write); a replaced buffer raises ValueError naming the layer and slot.

Sizes.  A buffer too large to address, or ``n_layers`` layers whose buffers (plus ~200 B of
Python objects per buffer) exceed the machine's physical memory (``SC_PAGE_SIZE *
SC_PHYS_PAGES``; 2**48 bytes where it is not reported), raise ValueError before anything is
allocated -- all three caches, the lazy one counted as a pass that appends to every layer.

Where this differs from the upstream engine (deliberately):

* ``slot_trailing`` is a tuple attribute (the API contract); the per-slot accessor is
  ``slot_shape(s)``, which raises IndexError where upstream panics;
* non-integer or negative geometry raises (upstream takes ``usize``); ``StaticKvCache`` checks
  its geometry too (upstream ``KvCache::with_capacity`` does not);
* there is no graph: ``write_layer``/``advance`` are explicit write helpers, and ``device``
  is ``"cpu"`` only (kept as a location so the re-bind residency rule stays expressible);
* after ``clear()`` a cache holds no storage: ``write_layer``/``attend``/``valid_view`` raise
  ValueError and ``advance`` too; allocate a new cache for the next conversation.

Threads: minting a KvAllocId is thread-safe; a cache is not (one writer at a time, as for
LayerKvCache).
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence

import numpy as np
import numpy.typing as npt

from ._generation import Generation
from ._slots import (HOST as _HOST, KvAllocId, LatentSlot, SlotCache, as_slab as _as_slab,
                     at_least_one as _at_least_one, cast_slabs as _cast_slabs,
                     check_bytes as _check_bytes, check_capacity as _check_capacity,
                     check_device as _device, fmt_shape as _fmt_shape,
                     resolve_dtype, ro as _ro, slot_index as _slot_index)
from ._validate import FloatArrayLike, as_int

__all__ = ["LatentKvCache", "LazyLatentCache", "LatentSlot"]

Trailing = tuple[tuple[int, ...], ...]
_Layers = tuple[tuple[npt.NDArray[Any], ...], ...]


# ------------------------------------------------------------------------------ validation
def _trailing(slot_trailing: Iterable[Iterable[int]]) -> Trailing:
    """slot_trailing as a tuple of tuples of ints >= 0 (ValueError 'need at least one slot')."""
    if isinstance(slot_trailing, (str, bytes)):
        raise TypeError(f"slot_trailing: expected a sequence of trailing shapes, got "
                        f"{type(slot_trailing).__name__}")
    try:
        slots = list(slot_trailing)
    except TypeError:
        raise TypeError(f"slot_trailing: expected a sequence of trailing shapes (sequences of "
                        f"ints), got {type(slot_trailing).__name__}") from None
    if not slots:
        raise ValueError("need at least one slot: slot_trailing is empty")
    out = []
    for s, shape in enumerate(slots):
        if isinstance(shape, (str, bytes)):
            raise TypeError(f"slot_trailing[{s}]: expected a sequence of ints, got "
                            f"{type(shape).__name__}")
        try:
            dims = list(shape)
        except TypeError:
            raise TypeError(f"slot_trailing[{s}]: expected a sequence of ints (the slot's "
                            f"trailing shape), got {type(shape).__name__}") from None
        tup = []
        for i, d in enumerate(dims):
            v = as_int(f"slot_trailing[{s}][{i}]", d)
            if v < 0:
                raise ValueError(f"slot_trailing[{s}][{i}]: expected a dimension >= 0, got {v}")
            tup.append(v)
        out.append(tuple(tup))
    return tuple(out)


def _check_slabs(slabs: Sequence[FloatArrayLike], trailing: Trailing,
                 name: str = "slabs") -> tuple[list[npt.NDArray[Any]], int]:
    """Convert and check one slab per slot; returns (list of arrays, seq).

    Slab 0 fixes ``seq`` (its leading dim); slab s must be exactly (seq, *trailing[s])."""
    if isinstance(slabs, (np.ndarray, str, bytes)):
        raise TypeError(f"{name}: expected a sequence of arrays, one per slot, got "
                        f"{type(slabs).__name__}")
    try:
        items = list(slabs)
    except TypeError:
        raise TypeError(f"{name}: expected a sequence of arrays, one per slot, got "
                        f"{type(slabs).__name__}") from None
    if len(items) != len(trailing):
        raise ValueError(f"{name}: expected {len(trailing)} slabs (one per slot), got {len(items)}")
    arrays = [_as_slab(f"{name}[{s}]", x) for s, x in enumerate(items)]
    first = arrays[0]
    if first.ndim == 0:
        raise ValueError(f"{name}[0]: expected rank >= 1, shape (seq, *{trailing[0]}), got a 0-d "
                         f"array")
    seq = first.shape[0]
    for s, arr in enumerate(arrays):
        want = (seq,) + trailing[s]
        if arr.shape != want:
            if s == 0:
                expect = "(seq" + "".join(f", {d}" for d in trailing[0]) + ")"
            else:
                expect = f"{_fmt_shape(want)} (seq={seq} from {name}[0])"
            raise ValueError(f"{name}[{s}]: expected shape {expect}, got {arr.shape}")
    return arrays, seq


# ------------------------------------------------------------------------------ LatentKvCache
class LatentKvCache(SlotCache):
    """Persistent N-slot decode cache with per-slot trailing shapes (MLA latents and more).

    Parameters
    ----------
    n_layers : int
        Layers (>= 1); every layer is populated.
    max_seq_len : int
        Capacity in positions (>= 1).
    slot_trailing : sequence of sequence of int
        Trailing shape of each slot (the same for every layer); slot ``s`` of every layer is a
        buffer of shape ``(max_seq_len, *slot_trailing[s])``.  At least one slot; an empty
        trailing shape is a per-token scalar slot.
    dtype : dtype-like
        float32 (default), float16, float64 or bfloat16 (needs ``ml_dtypes``).
    device : str
        ``"cpu"``.

    Attributes
    ----------
    layers : list of (None or list of LatentSlot)
        Index = layer; None once :meth:`clear` has released the layer.

    Raises
    ------
    ValueError
        In this order: "n_layers must be >= 1", "max_seq_len must be >= 1", "need at least one
        slot"; a negative trailing dimension; a buffer too large to address; ``n_layers``
        layers of buffers (plus ~200 B of objects per buffer) larger than the machine's
        physical memory (refused before anything is allocated).
    TypeError
        Non-integer sizes, an unsupported dtype, bfloat16 without ``ml_dtypes``.

    Examples
    --------
    >>> import numpy as np, kvcache as kc
    >>> c = kc.LatentKvCache.with_capacity(2, 8, [[4], [2]])
    >>> for layer in range(c.n_layers):
    ...     c.write_layer(layer, [np.ones((3, 4)), np.ones((3, 2))])
    >>> c.advance(3)
    >>> c.cached_len, c.valid_view(0, 0).shape, c.layers[0][0].version
    (3, (3, 4), 1)
    """

    def __init__(self, n_layers: int, max_seq_len: int, slot_trailing: Iterable[Iterable[int]],
                 dtype: npt.DTypeLike = np.float32, device: str = "cpu") -> None:
        n_layers = _at_least_one("n_layers", n_layers)
        max_seq_len = _at_least_one("max_seq_len", max_seq_len)
        trailing = _trailing(slot_trailing)
        dt = resolve_dtype(dtype)
        loc = _device(device)
        shapes = [(max_seq_len,) + t for t in trailing]
        _check_bytes(shapes, dt, n_layers)
        self.layers = self._allocate(n_layers, shapes, dt)
        self._cached_len = 0
        self._max_seq_len = max_seq_len
        self._dtype = dt
        self._trailing = trailing
        self._n_slots = len(trailing)
        self._device = loc
        self._alloc_id = KvAllocId.next()
        self._gen = Generation()

    @classmethod
    def with_capacity(cls, n_layers: int, max_seq_len: int,
                      slot_trailing: Iterable[Iterable[int]], dtype: npt.DTypeLike = np.float32,
                      device: str = "cpu") -> LatentKvCache:
        """Allocate every layer's slot buffers up front, zeroed (see the class docstring)."""
        return cls(n_layers, max_seq_len, slot_trailing, dtype=dtype, device=device)

    @property
    def slot_trailing(self) -> Trailing:
        """Per-slot trailing shapes, a tuple of tuples (its length is :attr:`n_slots`)."""
        return self._trailing

    def slot_shape(self, s: int) -> tuple[int, ...]:
        """Trailing shape of slot ``s`` (IndexError out of range)."""
        return self._trailing[_slot_index("slot", s, self._n_slots, "slots")]

    def _storage_shape(self, s: int) -> tuple[int, ...]:
        return (self._max_seq_len,) + self._trailing[s]

    def __repr__(self) -> str:
        return (f"LatentKvCache(n_layers={self.n_layers}, max_seq_len={self._max_seq_len}, "
                f"slot_trailing={self._trailing}, dtype={self._dtype}, "
                f"cached_len={self._cached_len}, alloc_id={self._alloc_id!r})")

    def valid_view(self, layer: int, s: int) -> npt.NDArray[Any]:
        """Read-only view of rows ``[0, cached_len)`` of slot ``s`` of ``layer``.

        Returns
        -------
        ndarray of shape (cached_len, *slot_trailing[s])

        Raises
        ------
        IndexError
            ``layer`` or ``s`` out of range.
        ValueError
            The layer is unpopulated (cleared cache), or its storage was replaced by one that
            is not the allocated shape/dtype/C-contiguous buffer.
        """
        li, slots = self._populated(layer, "valid_view")
        si = _slot_index("slot", s, self._n_slots, "slots")
        (storage,) = self._storages("valid_view", li, slots, which=si)
        return _ro(storage, np.s_[: self._cached_len])

    def write_layer(self, layer: int, slabs: Sequence[FloatArrayLike]) -> None:
        """Write one step's new rows of every slot of ``layer``, without advancing.

        Parameters
        ----------
        layer : int
        slabs : sequence of array_like, one per slot
            ``slabs[s]`` of shape ``(seq, *slot_trailing[s])``, the same ``seq >= 1`` for every
            slot, real floating point (cast to the cache dtype).  Written at rows
            ``[cached_len, cached_len + seq)``.

        Raises
        ------
        IndexError
            ``layer`` out of range.
        ValueError
            Unpopulated layer, wrong slab count, a wrong shape (including a ``seq`` that
            differs from slab 0's), ``seq == 0``, ``cached_len + seq > max_seq_len``, or a
            storage replaced by one that is not the allocated writable buffer.
        TypeError
            A slab that is not real floating point.

        Everything is checked, and every slab converted to the cache dtype, before the first
        row is written: on error nothing changed.  That includes an error of the cast itself
        (``np.errstate(over="raise")`` or warnings as errors when a float64 slab overflows a
        float16 cache), which propagates as NumPy raises it.
        """
        li, slots = self._populated(layer, "write_layer")
        storages = self._storages("write_layer", li, slots, writable=True)
        arrays, seq = _check_slabs(slabs, self._trailing)
        if seq < 1:
            raise ValueError("slabs: expected at least one position (seq >= 1), got seq=0")
        _check_capacity("slabs", self._cached_len, seq, self._max_seq_len)
        arrays = _cast_slabs([f"slabs[{s}]" for s in range(len(arrays))], arrays, self._dtype,
                             storages)
        c0 = self._cached_len
        for storage, arr in zip(storages, arrays):         # same dtype: nothing left to raise
            storage[c0: c0 + seq] = arr

    def clear(self) -> None:
        """Release every layer (``layers[l] = None``), ``cached_len = 0`` and mint a new
        ``alloc_id``.  The device location is kept, so a re-bind onto a cleared cache is
        refused as MISSING_SLOT (its slots are gone), not as residency unknown."""
        self.layers = [None] * len(self.layers)
        self._cached_len = 0
        self._alloc_id = KvAllocId.next()
        self._gen.diverge()

    def rebind_location(self) -> Optional[str]:
        """Where the storage lives (KvRebindSource): always the device given at allocation."""
        return self._device


# ------------------------------------------------------------------------------ LazyLatentCache
class LazyLatentCache:
    """Per-pass functional twin of :class:`LatentKvCache` (see ``docs/latent.md``).

    Same buffers (slot ``s`` of every layer is ``(max_seq_len, *slot_trailing[s])``, capacity
    axis 0, zero-filled), but immutable: :meth:`append` and :meth:`advance_by` return a new
    cache and leave the one they are called on exactly as it was.  ``append`` copies the
    touched layer's buffers (copy-on-write) and shares every other layer with the original, so
    an append costs one layer's capacity, not the whole cache.  The buffers are read-only
    arrays; every view handed out is read-only too.

    Parameters
    ----------
    n_layers : int
        >= 1.
    max_seq_len : int
        >= 1.
    slot_trailing : sequence of sequence of int
        At least one slot; trailing dims >= 0.
    dtype : dtype-like
        float32 (default), float16, float64 or bfloat16 (needs ``ml_dtypes``); other dtypes
        raise TypeError ("unsupported dtype").

    Use inside one step (positions do not move until ``advance_by``)::

        for layer in range(n_layers):
            cache = cache.append(layer, slabs)                       # at current_seq_len
            rows = cache.slot_buffer_full(layer, 0)[: cache.current_seq_len + seq]
            ...attend over rows...
        cache = cache.advance_by(seq)

    Examples
    --------
    >>> import numpy as np, kvcache as kc
    >>> c0 = kc.LazyLatentCache.new(1, 4, [[2]])
    >>> c1 = c0.append(0, [np.ones((2, 2))]).advance_by(2)
    >>> c0.current_seq_len, c1.current_seq_len, c1.slot(0, 0).shape
    (0, 2, (2, 2))
    """

    __slots__ = ("_layers", "_trailing", "_len", "_max", "_dtype")

    def __init__(self, n_layers: int, max_seq_len: int, slot_trailing: Iterable[Iterable[int]],
                 dtype: npt.DTypeLike = np.float32) -> None:
        n_layers = _at_least_one("n_layers", n_layers)
        max_seq_len = _at_least_one("max_seq_len", max_seq_len)
        trailing = _trailing(slot_trailing)
        try:
            dt = resolve_dtype(dtype)
        except TypeError as exc:
            raise TypeError(f"unsupported dtype: {exc}") from None
        shapes = [(max_seq_len,) + t for t in trailing]
        _check_bytes(shapes, dt, n_layers)     # what a pass appending to every layer needs
        zeros = []
        for shape in shapes:
            buf = np.zeros(shape, dtype=dt)
            buf.flags.writeable = False
            zeros.append(buf)
        # every layer starts on the same zero buffers: they are never written, appends copy
        self._layers = tuple(tuple(zeros) for _ in range(n_layers))
        self._trailing = trailing
        self._len = 0
        self._max = max_seq_len
        self._dtype = dt

    @classmethod
    def new(cls, n_layers: int, max_seq_len: int, slot_trailing: Iterable[Iterable[int]],
            dtype: npt.DTypeLike = np.float32) -> LazyLatentCache:
        """A zero-filled cache at position 0 (see the class docstring)."""
        return cls(n_layers, max_seq_len, slot_trailing, dtype=dtype)

    def _evolve(self, layers: Optional[_Layers] = None,
                length: Optional[int] = None) -> LazyLatentCache:
        new = object.__new__(LazyLatentCache)
        new._layers = self._layers if layers is None else layers
        new._trailing = self._trailing
        new._len = self._len if length is None else length
        new._max = self._max
        new._dtype = self._dtype
        return new

    # ---------------------------------------------------------------- accessors
    @property
    def current_seq_len(self) -> int:
        """Positions committed by :meth:`advance_by`."""
        return self._len

    @property
    def seq_len(self) -> int:
        """The same as :attr:`current_seq_len` (read-only): every cache of kvcache names its
        length ``seq_len``."""
        return self._len

    @property
    def generation(self) -> int:
        """Always 0: a lazy cache is immutable, and the caches derived from it only append
        (rows below ``current_seq_len`` are never rewritten)."""
        return 0

    @property
    def max_seq_len(self) -> int:
        return self._max

    @property
    def n_layers(self) -> int:
        return len(self._layers)

    @property
    def n_slots(self) -> int:
        return len(self._trailing)

    @property
    def slot_trailing(self) -> Trailing:
        """Per-slot trailing shapes, a tuple of tuples."""
        return self._trailing

    @property
    def dtype(self) -> np.dtype[Any]:
        return self._dtype

    def slot_shape(self, s: int) -> tuple[int, ...]:
        """Trailing shape of slot ``s`` (IndexError out of range)."""
        return self._trailing[_slot_index("slot", s, len(self._trailing), "slots")]

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return True

    def __repr__(self) -> str:
        return (f"LazyLatentCache(n_layers={self.n_layers}, max_seq_len={self._max}, "
                f"slot_trailing={self._trailing}, dtype={self._dtype}, "
                f"current_seq_len={self._len})")

    def _buffer(self, layer: int, s: int) -> npt.NDArray[Any]:
        li = _slot_index("layer", layer, len(self._layers), "layers")
        si = _slot_index("slot", s, len(self._trailing), "slots")
        return self._layers[li][si]

    def slot(self, layer: int, s: int) -> npt.NDArray[Any]:
        """Read-only rows ``[0, max(current_seq_len, 1))`` of slot ``s`` of ``layer`` (at least
        one row, so an empty cache still gives a ``(1, *trailing)`` array of zeros)."""
        return _ro(self._buffer(layer, s), np.s_[: max(self._len, 1)])

    def slot_buffer_full(self, layer: int, s: int) -> npt.NDArray[Any]:
        """Read-only view of the whole ``(max_seq_len, *trailing)`` buffer of (layer, s)."""
        return _ro(self._buffer(layer, s))

    # ---------------------------------------------------------------- functional updates
    def append(self, layer: int, new_slots: Sequence[FloatArrayLike]) -> LazyLatentCache:
        """A new cache with ``new_slots`` written into ``layer`` at ``current_seq_len``.

        Parameters
        ----------
        layer : int
        new_slots : sequence of array_like, one per slot
            ``new_slots[s]`` of shape ``(seqlen_new, *slot_trailing[s])``; ``seqlen_new`` is
            slab 0's leading dim (slab 0 must have rank >= 1), real floating point (cast to
            the cache dtype).  ``seqlen_new = 0`` is allowed (nothing is written).

        Returns
        -------
        LazyLatentCache
            Positions are not advanced; this cache is unchanged.

        Raises
        ------
        IndexError
            ``layer`` out of range.
        ValueError
            Wrong slab count, slab 0 of rank 0, a shape mismatch (including a ``seqlen`` that
            differs across slots), ``current_seq_len + seqlen_new > max_seq_len``.
        TypeError
            A slab that is not real floating point.
        """
        li = _slot_index("layer", layer, len(self._layers), "layers")
        arrays, seq = _check_slabs(new_slots, self._trailing, name="new_slots")
        _check_capacity("new_slots", self._len, seq, self._max)
        if seq == 0:
            return self._evolve()
        c0 = self._len
        fresh = []
        for buf, arr in zip(self._layers[li], arrays):
            copy = buf.copy()
            copy[c0: c0 + seq] = arr
            copy.flags.writeable = False
            fresh.append(copy)
        layers = self._layers[:li] + (tuple(fresh),) + self._layers[li + 1:]
        return self._evolve(layers=layers)

    def advance_by(self, n: int) -> LazyLatentCache:
        """A new cache with ``current_seq_len = min(current_seq_len + n, max_seq_len)``.

        Call once per step, after the last layer's :meth:`append`.  ValueError for ``n < 0``.
        """
        n = as_int("n", n, minimum=0)
        return self._evolve(length=min(self._len + n, self._max))
