"""Fixed-capacity decode caches: LatentKvCache, StaticKvCache, LazyLatentCache, KvAllocId.

Port of the persistent caches of the upstream Rust engine (spec latent-kv-cache.md sections 1-4,
section 7 for the Python shape of it).  Three caches, one vocabulary:

``LatentKvCache`` -- the N-slot persistent cache (MLA and friends)
    Every layer holds ``n_slots`` buffers; slot ``s`` of every layer is one zeroed,
    C-contiguous array of shape ``(max_seq_len, *slot_trailing[s])`` allocated up front, layer
    by layer (layer-major, slot-minor).  The capacity axis is 0: a latent is a per-token vector,
    there is no head axis.  DeepSeek-V2 MLA uses ``slot_trailing = ((kv_lora_rank,),
    (qk_rope_head_dim,))``: slot 0 the post-RMSNorm compressed latent ``c_kv``, slot 1 the
    post-RoPE shared key ``k_pe``.  One slot of ``(H_kv*D,)`` is a shared K=V cache.

``StaticKvCache`` -- the symmetric K/V cache (upstream ``KvCache::with_capacity``)
    K and V of each layer are zeroed arrays ``(1, num_kv_heads, max_seq_len, head_dim)``
    (capacity axis 2, the Hugging Face layout), slot 0 = K, slot 1 = V.  ``attend`` runs the
    compiled grouped-query kernel (``kvcache._core.attend_rows``) over the valid rows.

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
``truncate_to``, ``write_layer``, ``advance`` and ``bump_version`` keep it.  Each (layer, slot)
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
* there is no graph: ``write_layer``/``advance`` are the explicit write helpers of spec
  section 7, and ``device`` is ``"cpu"`` only (kept as a location so the re-bind residency
  rule stays expressible);
* after ``clear()`` a cache holds no storage: ``write_layer``/``attend``/``valid_view`` raise
  ValueError and ``advance`` too; allocate a new cache for the next conversation.

Threads: minting a KvAllocId is thread-safe; a cache is not (one writer at a time, as for
LayerKvCache).
"""

from __future__ import annotations

import numpy as np

from . import quant
from ._generation import Generation
from ._slots import (F32 as _F32, HOST as _HOST, KvAllocId, as_slab as _as_slab,
                     at_least_one as _at_least_one, cast_slabs as _cast_slabs,
                     check_bytes as _check_bytes, check_capacity as _check_capacity,
                     check_device as _device, fmt_shape as _fmt_shape,
                     maybe_index as _maybe_index, resolve_dtype, ro as _ro,
                     slot_index as _slot_index, storage_problem as _storage_problem)
from ._validate import as_f32, as_f32_scalar, as_int
from .layer import _PROBS_BUDGET, _scratch, default_scale, grouped_queries
from . import _core              # after .layer, whose import explains a missing _core

__all__ = ["KvAllocId", "LatentSlot", "LatentKvCache", "StaticKvCache", "LazyLatentCache",
           "resolve_dtype"]


# ------------------------------------------------------------------------------ validation
def _trailing(slot_trailing):
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


def _check_slabs(slabs, trailing, name="slabs"):
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

    def __init__(self, storage, layout=None, version=0, authority=_HOST):
        if not isinstance(storage, np.ndarray):
            raise TypeError(f"LatentSlot: storage must be a numpy array (the slot's buffer), got "
                            f"{type(storage).__name__}")
        self.storage = storage
        self.layout = tuple(storage.shape) if layout is None else tuple(layout)
        self.version = version
        self.authority = authority

    def __repr__(self):
        return (f"LatentSlot(layout={self.layout}, dtype={self.storage.dtype}, "
                f"version={self.version}, authority={self.authority!r})")


class _SlotCache:
    """What the persistent caches share: layers of slots, cached_len, alloc_id, versions."""

    _n_slots = 0

    def _allocate(self, n_layers, shapes, dtype):
        layers = []
        for _ in range(n_layers):                       # layer-major, slot-minor
            layers.append([LatentSlot(np.zeros(shape, dtype=dtype), shape) for shape in shapes])
        return layers

    # ---------------------------------------------------------------- fields
    @property
    def cached_len(self):
        """Valid positions: rows ``[0, cached_len)`` of every slot hold data."""
        return self._cached_len

    @property
    def max_seq_len(self):
        """Capacity in positions."""
        return self._max_seq_len

    @property
    def dtype(self):
        """The storage dtype (``numpy.dtype``)."""
        return self._dtype

    @property
    def n_layers(self):
        """``len(layers)``: counts unpopulated (None) layers too."""
        return len(self.layers)

    @property
    def n_slots(self):
        """Buffers per layer."""
        return self._n_slots

    @property
    def alloc_id(self):
        """The :class:`KvAllocId` of the storage this cache currently owns."""
        return self._alloc_id

    @property
    def generation(self):
        """A counter that grows each time stored rows change other than by appending:
        :meth:`truncate_to` (when it shrinks) and :meth:`clear`.  ``write_layer`` +
        ``advance`` only append, and leave it alone.  Writes made by hand through
        :meth:`slot_storage` into rows below ``cached_len`` are not seen: a device mirror
        must then be re-synced with ``sync(full=True)``."""
        return self._gen.value

    def unchanged_prefix(self, since):
        """The number of rows ``n`` such that rows ``[0, n)`` of every slot hold what they held
        at generation ``since``; None when :meth:`clear` ran after ``since``, when more than
        64 truncations did (only the last 64 are remembered), or when ``since`` is not a
        generation this cache has had.  Truncations only lower it."""
        return self._gen.unchanged_prefix(since, self._cached_len)

    def __len__(self):
        return self._cached_len

    def __bool__(self):
        return True

    # ---------------------------------------------------------------- slot access
    def _slots_or_none(self, layer):
        if not 0 <= layer < len(self.layers):
            return None
        return self.layers[layer]

    def slot_storage(self, layer, slot):
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
        li, si = _maybe_index("layer", layer), _maybe_index("slot", slot)
        slots = self._slots_or_none(li)
        if slots is None or not 0 <= si < len(slots):
            return None
        return slots[si].storage

    def bump_version(self, layer, slot):
        """Add 1 to the version of (layer, slot); a silent no-op when either index is out of
        range or the layer is unpopulated (TypeError only for a non-integer index)."""
        li, si = _maybe_index("layer", layer), _maybe_index("slot", slot)
        slots = self._slots_or_none(li)
        if slots is None or not 0 <= si < len(slots):
            return
        slots[si].version += 1

    def _populated(self, layer, what):
        """(layer index, its slots); IndexError out of range, ValueError when unpopulated."""
        li = _slot_index("layer", layer, len(self.layers), "layers")
        slots = self.layers[li]
        if slots is None:
            raise ValueError(f"{what}: layer {li} holds no storage (the cache was cleared); "
                             f"allocate a new cache with with_capacity")
        return li, slots

    def _storages(self, what, li, slots, which=None, writable=False):
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
            problem = _storage_problem(storage, want, self._dtype, writable)
            if problem is not None:
                raise ValueError(f"{what}: the storage of layer {li}, slot {s} {problem}; "
                                 f"expected a C-contiguous{' writable' if writable else ''} "
                                 f"{self._dtype} array of shape {want} (was it replaced?)")
            out.append(storage)
        return out

    # ---------------------------------------------------------------- positions
    def advance(self, seq):
        """Commit ``seq`` written positions: ``cached_len += seq``, then every populated
        (layer, slot) version += 1 (once per call, not per token).

        Call it once per step, after :meth:`write_layer` has written every layer.

        Raises
        ------
        ValueError
            ``seq < 1``, ``cached_len + seq > max_seq_len``, or no layer is populated.
        """
        seq = as_int("seq", seq, minimum=1)
        _check_capacity("seq", self._cached_len, seq, self._max_seq_len)
        populated = [slots for slots in self.layers if slots is not None]
        if not populated:
            raise ValueError("advance: the cache holds no layers (it was cleared); allocate a "
                             "new cache with with_capacity")
        self._cached_len += seq
        for slots in populated:
            for slot in slots:
                slot.version += 1

    def truncate_to(self, new_len):
        """Rewind to ``new_len`` positions when that is shorter (else a no-op; it never grows).

        Metadata only: storages, versions and ``alloc_id`` are untouched (a rewind is not a
        re-allocation); the rows past ``new_len`` are simply not read until overwritten.

        Raises
        ------
        ValueError
            ``new_len < 0``.
        """
        new_len = as_int("new_len", new_len, minimum=0)
        if new_len < self._cached_len:
            self._cached_len = new_len
            self._gen.shrink(new_len)

    # ---------------------------------------------------------------- KvRebindSource
    def rebind_slot(self, layer, which):
        """Storage of half ``which`` of ``layer`` for a decode-plan re-bind (KvRebindSource):
        :meth:`slot_storage`, None when absent."""
        return self.slot_storage(layer, which)


# ------------------------------------------------------------------------------ LatentKvCache
class LatentKvCache(_SlotCache):
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

    def __init__(self, n_layers, max_seq_len, slot_trailing, dtype=np.float32, device="cpu"):
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
    def with_capacity(cls, n_layers, max_seq_len, slot_trailing, dtype=np.float32, device="cpu"):
        """Allocate every layer's slot buffers up front, zeroed (see the class docstring)."""
        return cls(n_layers, max_seq_len, slot_trailing, dtype=dtype, device=device)

    @property
    def slot_trailing(self):
        """Per-slot trailing shapes, a tuple of tuples (its length is :attr:`n_slots`)."""
        return self._trailing

    def slot_shape(self, s):
        """Trailing shape of slot ``s`` (IndexError out of range)."""
        return self._trailing[_slot_index("slot", s, self._n_slots, "slots")]

    def _storage_shape(self, s):
        return (self._max_seq_len,) + self._trailing[s]

    def __repr__(self):
        return (f"LatentKvCache(n_layers={self.n_layers}, max_seq_len={self._max_seq_len}, "
                f"slot_trailing={self._trailing}, dtype={self._dtype}, "
                f"cached_len={self._cached_len}, alloc_id={self._alloc_id!r})")

    def valid_view(self, layer, s):
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

    def write_layer(self, layer, slabs):
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

    def clear(self):
        """Release every layer (``layers[l] = None``), ``cached_len = 0`` and mint a new
        ``alloc_id``.  The device location is kept, so a re-bind onto a cleared cache is
        refused as MISSING_SLOT (its slots are gone), not as residency unknown."""
        self.layers = [None] * len(self.layers)
        self._cached_len = 0
        self._alloc_id = KvAllocId.next()
        self._gen.diverge()

    def rebind_location(self):
        """Where the storage lives (KvRebindSource): always the device given at allocation."""
        return self._device


# ------------------------------------------------------------------------------ StaticKvCache
class StaticKvCache(_SlotCache):
    """Fixed-capacity symmetric K/V cache of every layer (the fuel-style ``KvCache``).

    Parameters
    ----------
    n_layers, num_kv_heads, max_seq_len, head_dim : int
        Each >= 1.
    dtype : dtype-like
        float32 (default), float16, float64 or bfloat16 (needs ``ml_dtypes``).  Only a float32
        cache can :meth:`attend`.
    device : str
        ``"cpu"``.

    Attributes
    ----------
    layers : list of (None or list of LatentSlot)
        ``layers[l] = [K, V]``, each storage zeroed, shape
        ``(1, num_kv_heads, max_seq_len, head_dim)`` (capacity axis 2); None after
        :meth:`clear`.

    Notes
    -----
    ``clear()`` releases the layers, mints a new ``alloc_id`` *and* forgets the device
    location (``rebind_location()`` becomes None), so a held decode plan is refused as
    RESIDENCY_UNKNOWN, as upstream does for ``KvCache``.

    Examples
    --------
    >>> import numpy as np, kvcache as kc
    >>> c = kc.StaticKvCache.with_capacity(1, 2, 4, 16)
    >>> c.write_layer(0, np.ones((2, 3, 4)), np.ones((2, 3, 4)))
    >>> c.advance(3)
    >>> c.attend(0, np.ones((4, 4))).shape
    (4, 4)
    """

    _n_slots = 2

    def __init__(self, n_layers, num_kv_heads, head_dim, max_seq_len, dtype=np.float32,
                 device="cpu"):
        n_layers = _at_least_one("n_layers", n_layers)
        nkv = _at_least_one("num_kv_heads", num_kv_heads)
        hd = _at_least_one("head_dim", head_dim)
        max_seq_len = _at_least_one("max_seq_len", max_seq_len)
        dt = resolve_dtype(dtype)
        loc = _device(device)
        shape = (1, nkv, max_seq_len, hd)
        _check_bytes([shape, shape], dt, n_layers)
        self.layers = self._allocate(n_layers, [shape, shape], dt)
        self._cached_len = 0
        self._max_seq_len = max_seq_len
        self._dtype = dt
        self._nkv = nkv
        self._hd = hd
        self._device = loc
        self._alloc_id = KvAllocId.next()
        self._gen = Generation()

    @classmethod
    def with_capacity(cls, n_layers, num_kv_heads, head_dim, max_seq_len, dtype=np.float32,
                      device="cpu"):
        """Allocate K and V of every layer up front, zeroed (see the class docstring).

        The arguments come in the order of :class:`KvCache`: ``(n_layers, num_kv_heads,
        head_dim, max_seq_len)``."""
        return cls(n_layers, num_kv_heads, head_dim, max_seq_len, dtype=dtype, device=device)

    @property
    def num_kv_heads(self):
        return self._nkv

    @property
    def head_dim(self):
        return self._hd

    def _storage_shape(self, s):
        return (1, self._nkv, self._max_seq_len, self._hd)

    @property
    def device_location(self):
        """``"cpu"``, or None once :meth:`clear` has made residency unprovable."""
        return self._device

    def __repr__(self):
        return (f"StaticKvCache(n_layers={self.n_layers}, num_kv_heads={self._nkv}, "
                f"head_dim={self._hd}, max_seq_len={self._max_seq_len}, dtype={self._dtype}, "
                f"cached_len={self._cached_len}, alloc_id={self._alloc_id!r})")

    def _as_kv(self, name, value, seq=None):
        arr = _as_slab(name, value)
        nkv, hd = self._nkv, self._hd
        ok = ((arr.ndim == 3 and arr.shape[0] == nkv and arr.shape[2] == hd)
              or (arr.ndim == 4 and arr.shape[:2] == (1, nkv) and arr.shape[3] == hd))
        if not ok:
            raise ValueError(f"{name}: expected shape (1, {nkv}, seq, {hd}) or ({nkv}, seq, {hd}), "
                             f"got {arr.shape}")
        if seq is not None and arr.shape[-2] != seq:
            raise ValueError(f"{name}: expected shape (1, {nkv}, {seq}, {hd}) or ({nkv}, {seq}, "
                             f"{hd}) (seq={seq} from k), got {arr.shape}")
        return arr.reshape(1, nkv, arr.shape[-2], hd)

    def write_layer(self, layer, k, v):
        """Write one step's new K and V rows of ``layer`` at ``[cached_len, cached_len+seq)``.

        Parameters
        ----------
        layer : int
        k, v : array_like of shape (1, num_kv_heads, seq, head_dim) or
            (num_kv_heads, seq, head_dim)
            Real floating point (cast to the cache dtype), the same ``seq >= 1``.

        Does not advance; call :meth:`advance` once after every layer is written.  Everything
        is checked, and K and V converted to the cache dtype, before anything is written
        (IndexError for ``layer``; ValueError for an unpopulated layer, shapes, ``seq == 0``,
        capacity or a replaced storage that is not the allocated writable buffer; TypeError
        for dtypes; an error of the cast itself, e.g. float16 overflow under
        ``np.errstate(over="raise")``, propagates with the cache unchanged).
        """
        li, slots = self._populated(layer, "write_layer")
        storages = self._storages("write_layer", li, slots, writable=True)
        k4 = self._as_kv("k", k)
        seq = k4.shape[2]
        v4 = self._as_kv("v", v, seq=seq)
        if seq < 1:
            raise ValueError("k: expected at least one position (seq >= 1), got seq=0")
        _check_capacity("k", self._cached_len, seq, self._max_seq_len)
        k4, v4 = _cast_slabs(("k", "v"), (k4, v4), self._dtype, storages)
        c0 = self._cached_len
        storages[0][:, :, c0: c0 + seq] = k4               # same dtype: nothing left to raise
        storages[1][:, :, c0: c0 + seq] = v4

    def valid_view(self, layer, which):
        """Read-only view ``(1, num_kv_heads, cached_len, head_dim)`` of K (``which=0``) or V
        (``which=1``) of ``layer`` (IndexError out of range, ValueError when unpopulated or
        when the storage was replaced by one that is not the allocated buffer)."""
        li, slots = self._populated(layer, "valid_view")
        wi = _slot_index("which", which, 2, "slots (0 = K, 1 = V)")
        (storage,) = self._storages("valid_view", li, slots, which=wi)
        return _ro(storage, np.s_[:, :, : self._cached_len])

    def clear(self):
        """Release every layer, ``cached_len = 0``, mint a new ``alloc_id`` and forget the
        device location (a re-bind onto the cleared cache is refused as RESIDENCY_UNKNOWN)."""
        self.layers = [None] * len(self.layers)
        self._cached_len = 0
        self._alloc_id = KvAllocId.next()
        self._device = None
        self._gen.diverge()

    def rebind_location(self):
        """Where the storage lives (KvRebindSource): ``"cpu"``, or None after :meth:`clear`."""
        return self._device

    def attend(self, layer, q, *, scale=None, softcap=0.0, window=None, _kernels=None):
        """Grouped-query decode attention of the newest position(s) over ``layer``'s valid rows.

        Parameters
        ----------
        layer : int
        q : array_like of shape (num_heads, head_dim) or (n, num_heads, head_dim)
            ``num_heads`` a positive multiple of ``num_kv_heads``; head ``h`` reads KV head
            ``h // (num_heads // num_kv_heads)``.  One position: the query of the newest
            cached position, which sees rows ``[0, cached_len)``.  ``n`` positions: a causal
            block whose last row is the newest cached position (query ``i`` sees rows up to
            ``cached_len - n + i``).  Written and advanced before attending, as in a forward.
        scale : float, optional
            Score scale > 0, default ``1/sqrt(head_dim)``.  Rounded to float32 (the kernel's
            type): a value that is not finite there (1e39) or that underflows to 0 (1e-46)
            raises ValueError.
        softcap : float
            0 (off) or the Gemma-2 logit cap ``cap*tanh(score/cap)`` on finite scores; >= 0 and
            finite in float32, like ``scale``.
        window : int, optional
            None (off, the default) or a sliding window >= 1: only the last ``window`` rows up
            to the query's own -- the convention of ``LayerKvCache.attend_all_heads`` (0 raises
            ValueError there and here).  A window wider than ``max_seq_len`` (up to any int,
            ``2**63`` or ``np.uint64`` included) is clamped to it, which changes nothing.

        Returns
        -------
        ndarray of shape (num_heads, head_dim) or (n, num_heads, head_dim), float32

        Raises
        ------
        TypeError
            The cache is not float32 (the compiled kernel reads float32 rows; read
            :meth:`valid_view` and compute in NumPy for other dtypes).
        ValueError
            Shapes, ``n > cached_len``, an unpopulated layer, bad scale/softcap/window, or a K/V
            storage replaced by one that is not the allocated float32 C-contiguous
            ``(1, num_kv_heads, max_seq_len, head_dim)`` buffer (checked before the kernel
            reads it: the kernel trusts the shape).

        Runs ``kvcache._core.attend_rows`` (the kernel of ``LayerKvCache.attend_all_heads``)
        directly on the K/V storage, which is already its head-major ``(nkv, capacity, hd)``
        layout: nothing is copied.
        """
        kernels = _core if _kernels is None else _kernels
        li, slots = self._populated(layer, "attend")
        if self._dtype != _F32:
            raise TypeError(f"attend: needs a float32 cache (the compiled kernel reads float32 "
                            f"rows), this one is {self._dtype}; use valid_view() with NumPy")
        k_store, v_store = self._storages("attend", li, slots)
        nkv, hd = self._nkv, self._hd
        q3, single = grouped_queries(q, nkv, hd)
        n, nh = q3.shape[0], q3.shape[1]
        L = self._cached_len
        if n > L:
            raise ValueError(f"q: expected at most cached_len={L} positions (queries attend the "
                             f"newest, already written and advanced rows), got {n}")
        scale = default_scale(hd) if scale is None else as_f32_scalar("scale", scale)
        softcap = as_f32_scalar("softcap", softcap, minimum=0.0)
        # None = off (the kernel's 0); a window past capacity sees every row: clamp, so any int
        # fits the kernel's Py_ssize_t
        window = 0 if window is None else min(as_int("window", window, minimum=1),
                                              self._max_seq_len)
        out = np.empty((nh, hd) if single else (n, nh, hd), dtype=_F32)
        if n == 0:
            return out
        hpk = nh // nkv
        kf = k_store[0]                              # (nkv, max_seq_len, hd), C-contiguous view
        vf = v_store[0]
        empty_q = np.zeros((nkv, 0, hd), dtype=np.int8)
        empty_ks = np.zeros((nkv, 0, quant.n_groups(hd, quant.K_GROUP)), dtype=_F32)
        empty_vs = np.zeros((nkv, 0, 1), dtype=_F32)
        vcol = np.ones((nkv, hd), dtype=_F32)
        head_len = np.full(nkv, L, dtype=np.intp)
        no_imp = np.zeros(0, dtype=_F32)
        out3 = out.reshape(n, nh, hd)
        block = max(1, min(n, _PROBS_BUDGET // (nh * L * 4)))
        for i0 in range(0, n, block):
            i1 = min(n, i0 + block)
            nb = i1 - i0
            qg = q3[i0:i1].reshape(nb, nkv, hpk, hd).transpose(1, 0, 2, 3)   # (nkv, nb, hpk, hd)
            q2 = np.ascontiguousarray(qg).reshape(nkv * nb * hpk, hd)
            group_q0 = np.arange(nkv + 1, dtype=np.intp) * (nb * hpk)
            width = L - n + i1                        # rows the block's last query sees
            probs = _scratch("probs", q2.shape[0] * width).reshape(q2.shape[0], width)
            o2 = np.empty((nkv * nb * hpk, hd), dtype=_F32)
            kernels.attend_rows(kf, empty_q, empty_ks, vf, empty_q, empty_vs, vcol, head_len, q2,
                                group_q0, nb, n - i0, window, 0, scale, softcap, o2, probs, no_imp,
                                0, False, False, _core.max_threads())
            out3[i0:i1] = o2.reshape(nkv, nb, hpk, hd).transpose(1, 0, 2, 3).reshape(nb, nh, hd)
        return out


# ------------------------------------------------------------------------------ LazyLatentCache
class LazyLatentCache:
    """Per-pass functional twin of :class:`LatentKvCache` (spec section 4).

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

    def __init__(self, n_layers, max_seq_len, slot_trailing, dtype=np.float32):
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
    def new(cls, n_layers, max_seq_len, slot_trailing, dtype=np.float32):
        """A zero-filled cache at position 0 (see the class docstring)."""
        return cls(n_layers, max_seq_len, slot_trailing, dtype=dtype)

    def _evolve(self, layers=None, length=None):
        new = object.__new__(LazyLatentCache)
        new._layers = self._layers if layers is None else layers
        new._trailing = self._trailing
        new._len = self._len if length is None else length
        new._max = self._max
        new._dtype = self._dtype
        return new

    # ---------------------------------------------------------------- accessors
    @property
    def current_seq_len(self):
        """Positions committed by :meth:`advance_by`."""
        return self._len

    @property
    def generation(self):
        """Always 0: a lazy cache is immutable, and the caches derived from it only append
        (rows below ``current_seq_len`` are never rewritten)."""
        return 0

    @property
    def max_seq_len(self):
        return self._max

    @property
    def n_layers(self):
        return len(self._layers)

    @property
    def n_slots(self):
        return len(self._trailing)

    @property
    def slot_trailing(self):
        """Per-slot trailing shapes, a tuple of tuples."""
        return self._trailing

    @property
    def dtype(self):
        return self._dtype

    def slot_shape(self, s):
        """Trailing shape of slot ``s`` (IndexError out of range)."""
        return self._trailing[_slot_index("slot", s, len(self._trailing), "slots")]

    def __len__(self):
        return self._len

    def __bool__(self):
        return True

    def __repr__(self):
        return (f"LazyLatentCache(n_layers={self.n_layers}, max_seq_len={self._max}, "
                f"slot_trailing={self._trailing}, dtype={self._dtype}, "
                f"current_seq_len={self._len})")

    def _buffer(self, layer, s):
        li = _slot_index("layer", layer, len(self._layers), "layers")
        si = _slot_index("slot", s, len(self._trailing), "slots")
        return self._layers[li][si]

    def slot(self, layer, s):
        """Read-only rows ``[0, max(current_seq_len, 1))`` of slot ``s`` of ``layer`` (at least
        one row, so an empty cache still gives a ``(1, *trailing)`` array of zeros)."""
        return _ro(self._buffer(layer, s), np.s_[: max(self._len, 1)])

    def slot_buffer_full(self, layer, s):
        """Read-only view of the whole ``(max_seq_len, *trailing)`` buffer of (layer, s)."""
        return _ro(self._buffer(layer, s))

    # ---------------------------------------------------------------- functional updates
    def append(self, layer, new_slots):
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

    def advance_by(self, n):
        """A new cache with ``current_seq_len = min(current_seq_len + n, max_seq_len)``.

        Call once per step, after the last layer's :meth:`append`.  ValueError for ``n < 0``.
        """
        n = as_int("n", n, minimum=0)
        return self._evolve(length=min(self._len + n, self._max))
