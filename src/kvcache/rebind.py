"""Guarded re-binding of a held decode plan onto another cache (``docs/latent.md``).

A decode plan (:class:`DecodePlan`) is built once against a cache and then reused token after
token.  It holds the cache's storage buffers themselves (``{(layer, which): ndarray}``), so it
reads and writes *the buffers it was built against*, whatever cache the caller hands it later.
Two same-shaped caches look identical to a geometry check; the plan therefore also records the
cache's :class:`KvAllocId` and device location, read from the same source one after the
other when the plan is built, so the two cannot describe different allocations.

Per step the decode loop asks :meth:`DecodePlan.validity_for` (one comparison list, so
"valid" and "only the allocation differs" cannot drift apart)::

    STALE               a structural key differs: seq, max_seq_len, n_layers, dtype, shape_key
                        -> build a new plan
    VALID               same keys, same alloc_id (also after truncate_last) -> keep the plan
    ALLOCATION_CHANGED  same keys, another allocation (a swapped or cleared cache)
                        -> try plan.rebind_kv(cache); on RebindRefused build a new plan

``rebind_kv`` (call it only on ALLOCATION_CHANGED; it does not re-check the structural keys):

1. ``incoming = cache.rebind_location()``; None -> RESIDENCY_UNKNOWN;
2. the plan's baked location None -> RESIDENCY_UNKNOWN;
3. baked != incoming -> RESIDENCY_DIFFERS;
4. collect first: for every bound (layer, which) in order, the incoming storage
   ``cache.rebind_slot(layer, which)`` (None -> MISSING_SLOT), the bound one (absent ->
   UNBAKED_SLOT); they are interchangeable when they are the same object or their
   fingerprints (backend ``"cpu"``, dtype, shape, byte length, C-contiguity) are equal, else
   STORAGE_DIFFERS;
5. only when every slot passed: swap every binding and adopt the cache's ``alloc_id``.

A refusal raises :class:`RebindRefused` (``.reason`` a :class:`RebindRefusal`) and leaves the
plan exactly as it was: a partial re-bind is impossible.

Consequences of the cache rules (kvcache.latent, kvcache.static): ``truncate_last`` keeps the id
(VALID, no re-bind); a cleared LatentKvCache keeps its location but has no slots
(MISSING_SLOT); a cleared StaticKvCache forgets its location (RESIDENCY_UNKNOWN).

The source protocol is narrow on purpose (:class:`KvRebindSource`: ``alloc_id``,
``rebind_location()``, ``rebind_slot(layer, which)``); building a plan and checking its
validity also read the structural keys ``max_seq_len``, ``n_layers`` and ``dtype``
(:class:`KvPlanSource`), which both LatentKvCache and StaticKvCache expose.  ``seq`` and
``shape_key`` (the model's structural key: family, config, instance) come from the caller.
"""

from __future__ import annotations

import enum
import types
from typing import (Any, Hashable, Mapping, NamedTuple, Optional, Protocol, Sequence,
                    runtime_checkable)

import numpy as np
import numpy.typing as npt

from ._validate import as_int
from ._slots import KvAllocId, resolve_dtype

__all__ = ["KvRebindSource", "KvPlanSource", "KvAllocId", "PlanValidity", "RebindRefusal",
           "RebindRefused", "StorageFingerprint", "DecodePlan"]


@runtime_checkable
class KvRebindSource(Protocol):
    """What a cache offers a held plan for a re-bind (LatentKvCache and StaticKvCache do).

    ``alloc_id``: the :class:`KvAllocId` of the current allocation.
    ``rebind_location()``: where the storage lives (``"cpu"``), or None when that cannot be
    proven, which a re-bind treats as a refusal, never as a default.
    ``rebind_slot(layer, which)``: the storage of half ``which`` (0 or 1: K/V, or latent/k_pe)
    of ``layer``, or None.
    """

    @property
    def alloc_id(self) -> KvAllocId: ...

    def rebind_location(self) -> Optional[str]: ...

    def rebind_slot(self, layer: int, which: int) -> Optional[npt.NDArray[Any]]: ...


@runtime_checkable
class KvPlanSource(KvRebindSource, Protocol):
    """A :class:`KvRebindSource` that also exposes the structural keys a plan checks."""

    @property
    def max_seq_len(self) -> int: ...

    @property
    def n_layers(self) -> int: ...

    @property
    def dtype(self) -> np.dtype[Any]: ...


class PlanValidity(enum.Enum):
    """Whether a held plan may run against a cache (see :meth:`DecodePlan.validity_for`)."""

    VALID = "valid"
    ALLOCATION_CHANGED = "allocation_changed"
    STALE = "stale"


class RebindRefusal(enum.Enum):
    """Why :meth:`DecodePlan.rebind_kv` refused (``RebindRefused.reason``)."""

    RESIDENCY_UNKNOWN = "residency_unknown"
    RESIDENCY_DIFFERS = "residency_differs"
    MISSING_SLOT = "missing_slot"
    UNBAKED_SLOT = "unbaked_slot"
    STORAGE_DIFFERS = "storage_differs"


class StorageFingerprint(NamedTuple):
    """What makes two storages interchangeable under a plan (when they are not the same
    object)."""

    backend: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    c_contiguous: bool

    @classmethod
    def of(cls, storage: object) -> StorageFingerprint:
        if isinstance(storage, np.ndarray):
            return cls("cpu", str(storage.dtype), tuple(storage.shape), int(storage.nbytes),
                       bool(storage.flags.c_contiguous))
        t = type(storage)
        return cls(f"{t.__module__}.{t.__qualname__}", str(getattr(storage, "dtype", "?")),
                   tuple(getattr(storage, "shape", ())), int(getattr(storage, "nbytes", -1)),
                   False)

    def __str__(self) -> str:
        layout = "C-contiguous" if self.c_contiguous else "strided"
        return f"{self.dtype} {self.shape} {self.nbytes} B {layout} on {self.backend}"


class RebindRefused(RuntimeError):
    """A re-bind was refused; the plan is unchanged.

    Attributes
    ----------
    reason : RebindRefusal
    layer, which : int or None
        The slot concerned (MISSING_SLOT, UNBAKED_SLOT, STORAGE_DIFFERS).
    baked, incoming
        The plan's and the cache's locations (RESIDENCY_*) or storage fingerprints
        (STORAGE_DIFFERS), else None.
    """

    def __init__(self, reason: RebindRefusal, *, layer: Optional[int] = None,
                 which: Optional[int] = None, baked: object = None,
                 incoming: object = None) -> None:
        self.reason = reason
        self.layer = layer
        self.which = which
        self.baked = baked
        self.incoming = incoming
        super().__init__(self._message())

    def _message(self) -> str:
        r = self.reason
        where = f"layer {self.layer}, slot {self.which}"
        if r is RebindRefusal.RESIDENCY_UNKNOWN:
            side = "the cache" if self.incoming is None else "the plan"
            return (f"re-bind refused (residency unknown): {side} cannot prove where its storage "
                    f"lives (a cleared cache?); build a new plan")
        if r is RebindRefusal.RESIDENCY_DIFFERS:
            return (f"re-bind refused (residency differs): the plan is bound to storage on "
                    f"{self.baked!r}, the cache lives on {self.incoming!r}")
        if r is RebindRefusal.MISSING_SLOT:
            return (f"re-bind refused (missing slot): the cache has no storage for {where} "
                    f"(cleared or unpopulated layer)")
        if r is RebindRefusal.UNBAKED_SLOT:
            return f"re-bind refused (unbaked slot): the plan holds no storage for {where}"
        return (f"re-bind refused (storage differs) at {where}: the plan is bound to "
                f"{self.baked}, the cache holds {self.incoming}")


def _structure(source: object) -> tuple[int, int, np.dtype[Any]]:
    """(max_seq_len, n_layers, dtype) of a plan source (TypeError when it has none)."""
    try:
        return (int(source.max_seq_len), int(source.n_layers),  # type: ignore[attr-defined]
                np.dtype(source.dtype))  # type: ignore[attr-defined]  # checked by the except
    except (AttributeError, TypeError):
        raise TypeError(f"source: expected a cache exposing max_seq_len, n_layers and dtype "
                        f"(a LatentKvCache or StaticKvCache), got "
                        f"{type(source).__name__}") from None


def _check_source(source: object) -> None:
    if not isinstance(source, KvRebindSource):
        raise TypeError(f"source: expected a KvRebindSource (alloc_id, rebind_location(), "
                        f"rebind_slot()), got {type(source).__name__}")


class DecodePlan:
    """A decode plan's binding to a cache's storage: what a held plan is "welded" to.

    Parameters
    ----------
    source : KvPlanSource
        The cache (LatentKvCache or StaticKvCache).  Its ``alloc_id`` and location are read
        one right after the other, then slots ``slots`` of every populated layer are bound.
    seq : int
        Positions per step the plan runs (1 for decode).
    shape_key : hashable, optional
        The model's structural key (family, config, instance); part of the validity check.
    n_layers, max_seq_len, dtype : optional
        The plan's expectations; when given they must match the source (ValueError), which
        is the geometry guard run once, at build.
    slots : sequence of int
        Which slots of each layer the plan binds, default ``(0, 1)`` (K/V, or latent/k_pe).

    Raises
    ------
    TypeError
        ``source`` is not a plan source; ``shape_key`` is unhashable.
    ValueError
        A mismatching expectation, a layer with some but not all of ``slots``, or no
        populated layer at all.

    Examples
    --------
    >>> import kvcache as kc
    >>> a = kc.LatentKvCache.with_capacity(2, 8, [[4], [2]])
    >>> plan = kc.rebind.DecodePlan.build(a, shape_key="tiny-mla")
    >>> b = kc.LatentKvCache.with_capacity(2, 8, [[4], [2]])
    >>> plan.validity_for(b)
    <PlanValidity.ALLOCATION_CHANGED: 'allocation_changed'>
    >>> plan.rebind_kv(b)
    >>> plan.storage(0, 0) is b.slot_storage(0, 0), plan.validity_for(b)
    (True, <PlanValidity.VALID: 'valid'>)
    """

    def __init__(self, source: KvPlanSource, *, seq: int = 1, shape_key: Hashable = None,
                 n_layers: Optional[int] = None, max_seq_len: Optional[int] = None,
                 dtype: Optional[npt.DTypeLike] = None, slots: Sequence[int] = (0, 1)) -> None:
        _check_source(source)
        seq = as_int("seq", seq, minimum=1)
        try:
            hash(shape_key)
        except TypeError:
            raise TypeError(f"shape_key: expected a hashable key, got "
                            f"{type(shape_key).__name__}") from None
        slots = tuple(as_int(f"slots[{i}]", w, minimum=0) for i, w in enumerate(slots))
        if not slots or len(set(slots)) != len(slots):
            raise ValueError(f"slots: expected distinct slot indices, at least one, got {slots}")
        src_max, src_layers, src_dtype = _structure(source)
        for name, want, have in (("n_layers", n_layers, src_layers),
                                 ("max_seq_len", max_seq_len, src_max)):
            if want is not None and as_int(name, want) != have:
                raise ValueError(f"{name}: the plan expects {want}, the source has {have}")
        if dtype is not None and resolve_dtype(dtype) != src_dtype:
            raise ValueError(f"dtype: the plan expects {resolve_dtype(dtype)}, the source has "
                             f"{src_dtype}")
        # the same breath: identity and residency of one allocation
        alloc_id = source.alloc_id
        location = source.rebind_location()
        bound: dict[tuple[int, int], npt.NDArray[Any]] = {}
        for layer in range(src_layers):
            got = [source.rebind_slot(layer, w) for w in slots]
            if all(x is None for x in got):
                continue
            present = []
            for w, x in zip(slots, got):
                if x is None:
                    raise ValueError(f"source: layer {layer} has storage for some of slots "
                                     f"{slots} but not for slot {w}")
                present.append(x)
            for w, x in zip(slots, present):
                bound[(layer, w)] = x
        if not bound:
            raise ValueError("source: no populated layer to bind (a cleared cache?); allocate "
                             "a new cache")
        self._seq = seq
        self._shape_key = shape_key
        self._max_seq_len = src_max
        self._n_layers = src_layers
        self._dtype = src_dtype
        self._slots = slots
        self._layers = tuple(sorted({layer for layer, _ in bound}))
        self._bound = bound
        self._alloc_id = alloc_id
        self._kv_location = location

    @classmethod
    def build(cls, source: KvPlanSource, *, seq: int = 1, shape_key: Hashable = None,
              n_layers: Optional[int] = None, max_seq_len: Optional[int] = None,
              dtype: Optional[npt.DTypeLike] = None, slots: Sequence[int] = (0, 1)) -> DecodePlan:
        """Bind a plan to ``source`` (same as the constructor)."""
        return cls(source, seq=seq, shape_key=shape_key, n_layers=n_layers,
                   max_seq_len=max_seq_len, dtype=dtype, slots=slots)

    # ---------------------------------------------------------------- fields
    @property
    def alloc_id(self) -> KvAllocId:
        """The :class:`KvAllocId` of the allocation the plan is bound to."""
        return self._alloc_id

    @property
    def kv_location(self) -> Optional[str]:
        """The location read at build (None: unprovable, every re-bind is refused)."""
        return self._kv_location

    @property
    def seq(self) -> int:
        return self._seq

    @property
    def shape_key(self) -> Hashable:
        return self._shape_key

    @property
    def max_seq_len(self) -> int:
        return self._max_seq_len

    @property
    def n_layers(self) -> int:
        return self._n_layers

    @property
    def dtype(self) -> np.dtype[Any]:
        return self._dtype

    @property
    def slots(self) -> tuple[int, ...]:
        """Slot indices bound per layer."""
        return self._slots

    @property
    def layers(self) -> tuple[int, ...]:
        """Indices of the bound layers (the source's populated layers at build)."""
        return self._layers

    @property
    def bound(self) -> Mapping[tuple[int, int], npt.NDArray[Any]]:
        """Read-only mapping ``{(layer, which): storage}`` of the current bindings."""
        return types.MappingProxyType(self._bound)

    def storage(self, layer: int, which: int) -> npt.NDArray[Any]:
        """The storage bound for (layer, which) (IndexError when none is)."""
        key = (as_int("layer", layer), as_int("which", which))
        try:
            return self._bound[key]
        except KeyError:
            raise IndexError(f"no storage bound for layer {key[0]}, slot {key[1]} (bound layers "
                             f"{self._layers}, slots {self._slots})") from None

    def __repr__(self) -> str:
        return (f"DecodePlan(seq={self._seq}, n_layers={self._n_layers}, "
                f"max_seq_len={self._max_seq_len}, dtype={self._dtype}, "
                f"shape_key={self._shape_key!r}, alloc_id={self._alloc_id!r}, "
                f"kv_location={self._kv_location!r}, bound={len(self._bound)})")

    # ---------------------------------------------------------------- validity
    def validity_for(self, source: KvPlanSource, *, seq: Optional[int] = None,
                     shape_key: Hashable = None) -> PlanValidity:
        """Whether this plan may run against ``source``.

        Parameters
        ----------
        source : KvPlanSource
        seq : int, optional
            Positions of the step about to run (default: the plan's own ``seq``).
        shape_key : hashable, optional
            The model's current structural key (default: the plan's own, i.e. unchanged).

        Returns
        -------
        PlanValidity
            STALE when seq, max_seq_len, n_layers, dtype or shape_key differ; else VALID when
            the alloc ids are equal, else ALLOCATION_CHANGED.
        """
        _check_source(source)
        seq = self._seq if seq is None else as_int("seq", seq, minimum=1)
        key = self._shape_key if shape_key is None else shape_key
        now = (seq,) + _structure(source) + (key,)
        then = (self._seq, self._max_seq_len, self._n_layers, self._dtype, self._shape_key)
        if now != then:
            return PlanValidity.STALE
        if source.alloc_id == self._alloc_id:
            return PlanValidity.VALID
        return PlanValidity.ALLOCATION_CHANGED

    def is_valid_for(self, source: KvPlanSource, *, seq: Optional[int] = None,
                     shape_key: Hashable = None) -> bool:
        """``validity_for(...) is PlanValidity.VALID``."""
        return self.validity_for(source, seq=seq, shape_key=shape_key) is PlanValidity.VALID

    # ---------------------------------------------------------------- re-bind
    def rebind_kv(self, source: KvPlanSource) -> None:
        """Re-bind every bound slot to ``source``'s storage, all or nothing.

        Call it on ALLOCATION_CHANGED; the structural keys are not re-checked (see the module
        docstring for the order of the checks).

        Raises
        ------
        RebindRefused
            With the first failing check's reason; the plan is unchanged.
        """
        _check_source(source)
        incoming = source.rebind_location()
        if incoming is None:
            raise RebindRefused(RebindRefusal.RESIDENCY_UNKNOWN, baked=self._kv_location,
                                incoming=None)
        baked = self._kv_location
        if baked is None:
            raise RebindRefused(RebindRefusal.RESIDENCY_UNKNOWN, baked=None, incoming=incoming)
        if baked != incoming:
            raise RebindRefused(RebindRefusal.RESIDENCY_DIFFERS, baked=baked, incoming=incoming)
        staged: dict[tuple[int, int], npt.NDArray[Any]] = {}
        for layer in self._layers:
            for which in self._slots:
                new = source.rebind_slot(layer, which)
                if new is None:
                    raise RebindRefused(RebindRefusal.MISSING_SLOT, layer=layer, which=which)
                old = self._bound.get((layer, which))
                if old is None:
                    raise RebindRefused(RebindRefusal.UNBAKED_SLOT, layer=layer, which=which)
                if new is not old:
                    fo, fn = StorageFingerprint.of(old), StorageFingerprint.of(new)
                    if fo != fn:
                        raise RebindRefused(RebindRefusal.STORAGE_DIFFERS, layer=layer,
                                            which=which, baked=fo, incoming=fn)
                staged[(layer, which)] = new
        alloc_id = source.alloc_id
        bound = dict(self._bound)
        bound.update(staged)
        self._bound = bound
        self._alloc_id = alloc_id
