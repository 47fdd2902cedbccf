"""Incremental device mirrors of kvcache's caches (see :mod:`kvcache.device`).

A mirror reads its cache only through the cache's state interface and public methods: a
LayerKvCache through ``state()`` (:class:`kvcache._state.LayerState`) and its public
``generation`` / ``unchanged_prefix``; a slot cache (latent, static) through
:meth:`kvcache._slots.SlotCache.state`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Iterator, Optional, Union

import numpy as np
import numpy.typing as npt

from .._entry import K4_BLOCK
from .._slots import SlotCache, slot_index
from .._validate import as_index
from ..latent import LatentKvCache, LazyLatentCache
from ..layer import LayerKvCache
from ..model import KvCache
from ..o1 import O1DeviceView, O1HeadView, O1Sealed
from ..static import StaticKvCache
from .backends import DeviceBackend, make_backend

__all__ = ["Mirror", "LayerMirror", "KvCacheMirror", "LatentMirror", "StaticMirror",
           "SyncStats"]

_MIN_DEVICE_ROWS = 64
_Cache = Union[LayerKvCache, KvCache, LatentKvCache, StaticKvCache]


@dataclass(frozen=True)
class SyncStats:
    """What one :meth:`Mirror.sync` did.

    Attributes
    ----------
    full : bool
        Everything was uploaded (first sync, ``full=True``, or the cache diverged).
    rows : int
        Rows uploaded, summed over heads / slots / layers.
    bytes : int
        Bytes copied host -> device.
    device_bytes : int
        Bytes copied device -> device while growing the device capacity.
    """

    full: bool
    rows: int
    bytes: int
    device_bytes: int

    def __add__(self, other: object) -> SyncStats:
        if not isinstance(other, SyncStats):
            return NotImplemented
        return SyncStats(self.full or other.full, self.rows + other.rows,
                         self.bytes + other.bytes, self.device_bytes + other.device_bytes)


_NOTHING = SyncStats(False, 0, 0, 0)


def _grow(need: int, cap: int, limit: Optional[int] = None) -> int:
    """The next device capacity: ``cap`` doubled (at least 64) until it holds ``need``, at most
    ``limit`` (a full upload sizes from 64 the same way, so it usually leaves room)."""
    new = max(2 * cap, _MIN_DEVICE_ROWS)
    while new < need:
        new *= 2
    return new if limit is None else max(min(new, limit), need)


def _rows(axis: int, a: int, b: int) -> tuple[slice, ...]:
    return (slice(None),) * axis + (slice(a, b),)


class Mirror:
    """Device copies of a cache, kept in step by :meth:`sync` (see :mod:`kvcache.device`).

    ``Mirror(cache, backend="torch", device=None)`` returns the mirror for the cache's type:
    :class:`LayerMirror`, :class:`KvCacheMirror`, :class:`LatentMirror` or
    :class:`StaticMirror`; the first sync runs in the constructor.

    Parameters
    ----------
    cache : LayerKvCache, KvCache, LatentKvCache or StaticKvCache
    backend : {"torch", "cupy", "numpy"}
    device : str, int or torch.device, optional
        torch: any torch device (default ``"cpu"``); cupy: a device ordinal or ``"cuda:N"``
        (default 0); numpy: None or ``"cpu"``.

    The accessors mirror the cache's own (same names, signatures and shapes: see each
    subclass's ``MIRRORED``) and return device arrays as of the last sync.  What a device
    kernel does not read stays on the cache: importance, the linear state, the O(1) collecting
    trace, ``slot_storage`` / ``layers`` (the full host buffers), the device location.  They are views of
    the mirror's storage: do not write through them, and do not keep them across a sync that
    grows the capacity (they would point at the old storage).
    """

    MIRRORED: ClassVar[tuple[str, ...]] = ()
    _CACHE: ClassVar[Optional[type]] = None     # the cache type a subclass mirrors

    _be: DeviceBackend
    _cache: Any
    _gen: Optional[int]

    def __new__(cls, cache: _Cache, backend: str = "torch", device: Any = None) -> Mirror:
        if cls is Mirror:
            for sub in (LayerMirror, KvCacheMirror, LatentMirror, StaticMirror):
                if sub._CACHE is not None and isinstance(cache, sub._CACHE):
                    cls = sub
                    break
            else:
                if isinstance(cache, LazyLatentCache):
                    raise TypeError("cache: a LazyLatentCache is immutable and copies a layer per "
                                    "append; mirror the LatentKvCache it stands in for instead")
                raise TypeError(f"cache: expected a LayerKvCache, KvCache, LatentKvCache or "
                                f"StaticKvCache, got {type(cache).__name__}")
        return object.__new__(cls)

    def __init__(self, cache: _Cache, backend: str = "torch", device: Any = None) -> None:
        want = self._CACHE
        if want is None or not isinstance(cache, want):
            raise TypeError(f"cache: expected a {getattr(want, '__name__', 'cache')}, got "
                            f"{type(cache).__name__}")
        self._be = make_backend(backend, device)
        self._cache = cache
        self._gen = None              # generation at the last complete sync; None: full next
        self.total = _NOTHING         # SyncStats summed over every sync
        self.syncs = 0
        self._setup(cache, backend, device)
        self.sync()

    def _setup(self, cache: Any, backend: str, device: Any) -> None:
        """The subclass's empty device state (before the first sync)."""

    def _sync(self, full: bool, gen: int) -> SyncStats:
        raise NotImplementedError

    @property
    def cache(self) -> Any:
        """The cache this mirror follows."""
        return self._cache

    @property
    def backend(self) -> str:
        """``"torch"``, ``"cupy"`` or ``"numpy"``."""
        return self._be.name

    @property
    def device(self) -> Any:
        """The device the copies live on (a ``torch.device``, a ``cupy.cuda.Device`` or
        ``"cpu"``)."""
        return self._be.device

    @property
    def generation(self) -> Optional[int]:
        """The cache's ``generation`` at the last sync; None before the first one completes
        and after a failed one (the next sync is then full)."""
        return self._gen

    def sync(self, full: bool = False) -> SyncStats:
        """Bring the device copies up to the cache's present state.

        Parameters
        ----------
        full : bool
            Upload everything even when the cache only appended (after writing into the
            cache's storage by hand, say).

        Returns
        -------
        SyncStats

        When an upload fails part-way (a device out of memory, say), the error propagates
        and the next sync is a full one.
        """
        if not isinstance(full, (bool, np.bool_)):
            raise TypeError(f"full: expected a bool, got {type(full).__name__}")
        gen = int(self._cache.generation)
        try:
            stats = self._sync(bool(full) or self._gen is None, gen)
        except BaseException:
            self._gen = None
            raise
        self._gen = gen
        self.total = self.total + stats
        self.syncs += 1
        return stats

    def to_numpy(self, tensor: Any) -> npt.NDArray[Any]:
        """A host NumPy copy of one of this mirror's device arrays (for checks and tests)."""
        return self._be.to_numpy(tensor)


class LayerMirror(Mirror):
    """Mirror of one :class:`~kvcache.LayerKvCache`.

    Device storage: float32 K and V ``(num_kv_heads, capacity, head_dim)``, or for int8
    storage the int8 rows, their float32 scales and the frozen column fields, as the cache
    holds them; for a sealed O(1) layer the arrays of its :meth:`o1_views` (re-uploaded
    whole after each step: the state is constant-size).  A layer sealed in exact-only mode
    has no device form (see docs/o1.md): its mirror holds no rows and ``o1_views()`` is None.
    """

    MIRRORED = ("seq_len", "num_kv_heads", "head_dim", "mode", "generation", "__len__", "head_len",
                "head_keys", "head_values", "k_heads", "v_heads", "q8_rows", "k4_rows", "v4_rows",
                "columns", "o1_sealed", "o1_views")

    _CACHE = LayerKvCache
    _O1_CONST = ("sink_k", "sink_v", "k_tilde", "q_tilde", "mu")
    _O1_MOVING = ("win_k", "win_v", "t_hat", "z_hat", "m_max")

    _cache: LayerKvCache

    def _setup(self, cache: Any, backend: str, device: Any) -> None:
        st = cache.state()
        nkv, hd = st.num_kv_heads, st.head_dim
        self._mode: Any = None
        self._lens: npt.NDArray[np.intp] = np.zeros(nkv, dtype=np.intp)
        self._seq = 0
        self._cap = 0
        self._rows: dict[str, Any] = {}     # store name (kf, kq, ks, ...) -> device (nkv, cap, width)
        self._cols: Optional[tuple[Any, ...]] = None   # device kcol, vcol (nkv, hd); host kcol_on, vcol_on
        self._o1: Optional[dict[str, Any]] = None      # sealed state: device arrays + scalars
        self._nkv: int = nkv
        self._hd: int = hd

    # ---------------------------------------------------------------- sync
    def _sync(self, full: bool, gen: int) -> SyncStats:
        c = self._cache
        st = c.state()
        if isinstance(st.o1, O1Sealed):
            return self._sync_o1(st.o1, st.seq_len, full, gen)
        if self._o1 is not None or st.mode != self._mode:
            full = True
        prefix = None if full or self._gen is None else c.unchanged_prefix(self._gen)
        if prefix is None:
            full = True
            keep = np.zeros(self._nkv, dtype=np.intp)
        else:
            keep = np.minimum(self._lens, prefix)
        lens = st.lengths.copy()
        hosts = st.stores()
        layout = st.layout()
        for name, part in layout.items():   # 4-bit parameters travel as the float16 they are
            if part.f16_bits:
                hosts[name] = hosts[name].view(np.float16)
        # parts not indexed by row (4-bit K's block parameters and ring): copied whole
        whole = {name: hosts.pop(name) for name, part in layout.items() if not part.by_row}
        need = int(lens.max(initial=0))
        moved = 0
        same_fields = set(hosts) | set(whole) == set(self._rows)
        if same_fields and need <= self._cap:
            rows, cap = dict(self._rows), self._cap
        else:
            cap = _grow(need, self._cap if same_fields else 0)
            kept = 0 if full else int(keep.max(initial=0))
            rows = {}
            for name, host in hosts.items():
                width = int(host.shape[2])
                rows[name] = self._be.empty((self._nkv, cap, width), host.dtype)
                if kept:                  # incremental: the device keeps what it has
                    self._be.copy(rows[name][:, :kept], self._rows[name][:, :kept])
                    moved += self._nkv * kept * width * host.dtype.itemsize
        nbytes = 0
        same = bool((keep == keep[0]).all() and (lens == lens[0]).all())
        for name, host in hosts.items():
            blk = layout[name].settle     # 4-bit K codes change until their block closes
            if same:
                a, b = int(keep[0]) // blk * blk, int(lens[0])
                if b > a:
                    self._be.upload(rows[name][:, a:b], host[:, a:b])
                    nbytes += host[:, a:b].nbytes
            else:
                for h in range(self._nkv):
                    a, b = int(keep[h]) // blk * blk, int(lens[h])
                    if b > a:
                        self._be.upload(rows[name][h, a:b], host[h, a:b])
                        nbytes += host[h, a:b].nbytes
        for name, host in whole.items():
            dev = self._rows.get(name)
            if dev is None or tuple(dev.shape) != host.shape:
                dev = self._be.empty(host.shape, host.dtype)
            self._be.upload(dev, np.ascontiguousarray(host))
            nbytes += host.nbytes
            rows[name] = dev
        uploaded = int(np.maximum(lens - keep, 0).sum())
        cols = self._cols
        if full:                         # column fields change only at a divergence
            devs: list[Any] = []
            for col, on in ((st.kcol, st.kcol_on), (st.vcol, st.vcol_on)):
                dev = None
                if on.any():
                    dev = self._be.empty(col.shape, np.float32)
                    self._be.upload(dev, col)
                    nbytes += col.nbytes
                devs.append(dev)
            cols = tuple(devs) + (st.kcol_on.copy(), st.vcol_on.copy())
        # commit (nothing below can fail)
        self._rows, self._cap, self._cols = rows, cap, cols
        self._lens, self._seq, self._mode, self._o1 = lens, st.seq_len, st.mode, None
        return SyncStats(full, uploaded, nbytes, moved)

    def _sync_o1(self, o1: O1Sealed, seq_len: int, full: bool, gen: int) -> SyncStats:
        dev: dict[str, Any]
        if o1.exact_only:
            dev = {"exact_only": True}
            stats = SyncStats(full or self._o1 is None or gen != self._gen, 0, 0, 0)
        else:
            full = full or self._o1 is None or gen != self._gen
            if not full and seq_len == self._seq:
                return _NOTHING
            names = self._O1_MOVING + (self._O1_CONST if full else ())
            dev = dict(self._o1) if not full and self._o1 is not None else {}
            nbytes = 0
            for name in names:
                host = getattr(o1, name)
                arr = dev.get(name)
                if arr is None:
                    arr = self._be.empty(host.shape, host.dtype)
                self._be.upload(arr, host)
                nbytes += host.nbytes
                dev[name] = arr
            dev.update(exact_only=False, scalars=dict(
                m_eff=o1.m_eff, w=o1.w, sink_len=o1.sink_len, d=o1.d, dv=o1.dv, scale=o1.scale,
                win_len=o1.win_len, win_head=o1.win_head, far_len=o1.far_len),
                hpk=o1.hpk, rect_fm=o1.rect.name == "FM")
            stats = SyncStats(full, 0, nbytes, 0)
        self._rows, self._cap, self._cols = {}, 0, None
        self._lens = np.zeros(self._nkv, dtype=np.intp)
        self._seq, self._mode, self._o1 = seq_len, self._cache.mode, dev
        return stats

    # ---------------------------------------------------------------- accessors
    # The mirrored methods keep LayerKvCache's signatures exactly (a test compares them);
    # LayerKvCache's accessors are not annotated yet, so neither are these.
    @property
    def seq_len(self) -> int:
        """The cache's ``seq_len`` at the last sync."""
        return self._seq

    @property
    def num_kv_heads(self) -> int:
        return self._nkv

    @property
    def head_dim(self) -> int:
        return self._hd

    @property
    def mode(self) -> Any:
        """The cache's storage mode at the last sync."""
        return self._mode

    @property
    def capacity(self) -> int:
        """Rows per head the device storage holds before it must grow."""
        return self._cap

    def __len__(self) -> int:
        return self._seq

    def head_len(self, h: int) -> int:
        return int(self._lens[as_index("kv_head", h, self._nkv)])

    def _empty(self, dtype: npt.DTypeLike = np.float32, width: Optional[int] = None) -> Any:
        return self._be.empty((0, self._hd if width is None else width), dtype)

    def head_keys(self, h: int) -> Any:
        """Device (head_len(h), head_dim) float32 keys; empty when K is int8."""
        h = as_index("kv_head", h, self._nkv)
        if "kf" not in self._rows:
            return self._empty()
        return self._rows["kf"][h, : self._lens[h]]

    def head_values(self, h: int) -> Any:
        """Device (head_len(h), head_dim) float32 values; empty when V is int8."""
        h = as_index("kv_head", h, self._nkv)
        if "vf" not in self._rows:
            return self._empty()
        return self._rows["vf"][h, : self._lens[h]]

    def k_heads(self) -> list[Any]:
        return [self.head_keys(h) for h in range(self._nkv)]

    def v_heads(self) -> list[Any]:
        return [self.head_values(h) for h in range(self._nkv)]

    def q8_rows(self, h: int) -> tuple[Any, Any, Any, Any]:
        """Device (kq, ks, vq, vs) of head h as :meth:`LayerKvCache.q8_rows` (None for float32
        parts)."""
        h = as_index("kv_head", h, self._nkv)
        n = int(self._lens[h])
        r = self._rows
        k = (r["kq"][h, :n], r["ks"][h, :n]) if "kq" in r else (None, None)
        v = (r["vq"][h, :n], r["vs"][h, :n, 0]) if "vq" in r else (None, None)
        return k + v

    def k4_rows(self, h: int) -> tuple[Any, Any, Any]:
        """Device (codes, params, ring) of head h's 4-bit K as :meth:`LayerKvCache.k4_rows`
        (codes uint8 (q, head_dim / 2) of the q = 32 * (head_len // 32) rows in closed
        blocks, params float16 (q / 32, 2 * head_dim), the float32 ring (64, head_dim)), or
        (None, None, None) when K is not 4-bit."""
        h = as_index("kv_head", h, self._nkv)
        q = int(self._lens[h]) // K4_BLOCK * K4_BLOCK
        r = self._rows
        if "kc" not in r:
            return None, None, None
        return r["kc"][h, :q], r["kp"][h, : q // K4_BLOCK], r["kr"][h]

    def v4_rows(self, h: int) -> tuple[Any, Any]:
        """Device (codes, params) of head h's 4-bit V rows as :meth:`LayerKvCache.v4_rows`
        (codes uint8 (n, head_dim / 2), params float16 (n, 2 * ceil(head_dim / 16))), or
        (None, None) when V is not 4-bit."""
        h = as_index("kv_head", h, self._nkv)
        n = int(self._lens[h])
        r = self._rows
        return (r["vc"][h, :n], r["vp"][h, :n]) if "vc" in r else (None, None)

    def columns(self, h: int) -> tuple[Any, Any]:
        """Device frozen column fields of head h: (kcol, vcol), each (head_dim,) or None."""
        h = as_index("kv_head", h, self._nkv)
        if self._cols is None:
            return (None, None)
        kcol, vcol, kon, von = self._cols
        return (kcol[h] if kon[h] else None, vcol[h] if von[h] else None)

    def o1_sealed(self) -> bool:
        """Whether the cache was sealed at the last sync."""
        return self._o1 is not None

    def o1_views(self) -> Optional[list[O1DeviceView]]:
        """:class:`~kvcache.o1.O1DeviceView` per KV group holding device arrays, as
        :meth:`LayerKvCache.o1_views` at the last sync; None when not sealed or exact-only."""
        o1 = self._o1
        if o1 is None or o1["exact_only"]:
            return None
        hpk = o1["hpk"]
        out = []
        for g in range(self._nkv):
            heads = tuple(O1HeadView(rect_fm=o1["rect_fm"], t_hat=o1["t_hat"][h],
                                     z_hat=o1["z_hat"][h], m_max=o1["m_max"][h],
                                     q_tilde=o1["q_tilde"][h], mu=o1["mu"][h])
                          for h in range(g * hpk, (g + 1) * hpk))
            out.append(O1DeviceView(exact_only=False, win_k=o1["win_k"][g],
                                    win_v=o1["win_v"][g], sink_k=o1["sink_k"][g],
                                    sink_v=o1["sink_v"][g], k_tilde=o1["k_tilde"][g],
                                    heads=heads, **o1["scalars"]))
        return out

    def __repr__(self) -> str:
        return (f"LayerMirror(backend={self.backend!r}, device={self.device!s}, "
                f"seq_len={self._seq}, capacity={self._cap}, generation={self._gen})")


class KvCacheMirror(Mirror):
    """Mirror of a :class:`~kvcache.KvCache`: one :class:`LayerMirror` per layer
    (``mirror[i]``, ``mirror.layers``), synced together."""

    MIRRORED = ("seq_len", "num_kv_heads", "head_dim", "mode", "max_seq_len", "generation",
                "__len__", "__getitem__")

    _CACHE = KvCache

    _cache: KvCache

    def _setup(self, cache: Any, backend: str, device: Any) -> None:
        self.layers: list[LayerMirror] = []
        self._made = False
        self._args = (backend, device)

    def _sync(self, full: bool, gen: int) -> SyncStats:
        cache_layers = self._cache.layers
        if not self._made:                 # the first sync: each layer mirror syncs as made
            self.layers = [LayerMirror(layer, *self._args) for layer in cache_layers]
            self._made = True
            stats = _NOTHING
            for m in self.layers:
                stats = stats + m.total
            return stats
        if len(self.layers) != len(cache_layers) or any(
                m.cache is not l for m, l in zip(self.layers, cache_layers)):
            raise ValueError("cache: its list of layers was replaced or resized since this "
                             "mirror was made; make a new Mirror")
        stats = _NOTHING
        for m in self.layers:
            stats = stats + m.sync(full)
        return stats

    @property
    def seq_len(self) -> int:
        return max((m.seq_len for m in self.layers), default=0)

    @property
    def num_kv_heads(self) -> int:
        return int(self._cache.num_kv_heads)

    @property
    def head_dim(self) -> int:
        return int(self._cache.head_dim)

    @property
    def mode(self) -> Any:
        return self._cache.mode

    @property
    def max_seq_len(self) -> int:
        return int(self._cache.max_seq_len)

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, i: int) -> LayerMirror:
        return self.layers[i]

    def __iter__(self) -> Iterator[LayerMirror]:
        return iter(self.layers)

    def __repr__(self) -> str:
        return (f"KvCacheMirror(backend={self.backend!r}, device={self.device!s}, "
                f"n_layers={len(self.layers)}, generation={self._gen})")


class _SlotMirror(Mirror):
    """Shared by the latent and static mirrors: per layer, one device array per slot whose
    capacity axis (the cache's ``capacity_axis``) holds the positions, grown geometrically up
    to ``max_seq_len``."""

    _AXIS = 0
    _cache: SlotCache

    def _setup(self, cache: Any, backend: str, device: Any) -> None:
        self._layers: list[Optional[list[Any]]] = [None] * cache.n_layers
        self._len = 0
        self._cap = 0
        self._alloc: Any = None

    def _sync(self, full: bool, gen: int) -> SyncStats:
        c = self._cache
        ax = self._AXIS
        if c.n_layers != len(self._layers):
            raise ValueError(f"cache: its list of layers was resized ({len(self._layers)} -> "
                             f"{c.n_layers}) since this mirror was made; make a new Mirror")
        state = c.state("sync")          # validates every storage
        hosts = state.storages
        if [h is not None for h in hosts] != [d is not None for d in self._layers]:
            full = True
        prefix = None if full else c.unchanged_prefix(self._gen)
        if prefix is None:
            full, keep = True, 0
        else:
            keep = min(self._len, prefix)
        n = state.cached_len
        cap = 0 if full else self._cap
        moved = nbytes = 0
        layers: list[Optional[list[Any]]] = (list(self._layers) if not full
                                             else [None] * len(hosts))
        if full and self._cap >= n and all(
                (d is None) == (h is None) for d, h in zip(self._layers, hosts)):
            layers, cap = list(self._layers), self._cap          # reuse the device storage
        if n > cap or any(d is None and h is not None for d, h in zip(layers, hosts)):
            new_cap = _grow(n, cap, state.max_seq_len) if n > cap else cap
            for li, host in enumerate(hosts):
                if host is None:
                    layers[li] = None
                    continue
                old = layers[li]
                fresh = []
                for s, buf in enumerate(host):
                    shape = buf.shape[:ax] + (new_cap,) + buf.shape[ax + 1:]
                    dev = self._be.empty(shape, buf.dtype)
                    if not full and keep and old is not None:
                        self._be.copy(dev[_rows(ax, 0, keep)], old[s][_rows(ax, 0, keep)])
                        moved += buf[_rows(ax, 0, keep)].nbytes
                    fresh.append(dev)
                layers[li] = fresh
            cap = new_cap
        for li, host in enumerate(hosts):
            target = layers[li]
            if host is None or target is None:
                continue
            for s, buf in enumerate(host):
                if n > keep:
                    part = buf[_rows(ax, keep, n)]
                    self._be.upload(target[s][_rows(ax, keep, n)], part)
                    nbytes += part.nbytes
        rows = (n - keep) * sum(h is not None for h in hosts)
        self._layers, self._cap, self._len, self._alloc = layers, cap, n, state.alloc_id
        return SyncStats(full, rows, nbytes, moved)

    # ---------------------------------------------------------------- accessors
    @property
    def cached_len(self) -> int:
        """The cache's ``cached_len`` at the last sync."""
        return self._len

    @property
    def seq_len(self) -> int:
        """The cache's ``seq_len`` (= ``cached_len``) at the last sync."""
        return self._len

    def __len__(self) -> int:
        return self._len

    @property
    def max_seq_len(self) -> int:
        return self._cache.max_seq_len

    @property
    def dtype(self) -> np.dtype[Any]:
        return self._cache.dtype

    @property
    def n_layers(self) -> int:
        return len(self._layers)

    @property
    def n_slots(self) -> int:
        return self._cache.n_slots

    @property
    def alloc_id(self) -> Any:
        """The cache's ``alloc_id`` at the last sync."""
        return self._alloc

    @property
    def capacity(self) -> int:
        """Positions the device storage holds before it must grow (at most max_seq_len)."""
        return self._cap

    def _device_rows(self, layer: int, s: int, name: str, what: str = "slots") -> Any:
        li = slot_index("layer", layer, len(self._layers), "layers")
        si = slot_index(name, s, self.n_slots, what)
        slots = self._layers[li]
        if slots is None:
            raise ValueError(f"valid_view: layer {li} holds no storage (the cache was cleared)")
        return slots[si][_rows(self._AXIS, 0, self._len)]

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(backend={self.backend!r}, device={self.device!s}, "
                f"cached_len={self._len}, capacity={self._cap}, generation={self._gen})")


class LatentMirror(_SlotMirror):
    """Mirror of a :class:`~kvcache.LatentKvCache`: slot ``s`` of a populated layer is a device
    array ``(capacity, *slot_trailing[s])``; unpopulated (cleared) layers are None."""

    MIRRORED = ("cached_len", "seq_len", "__len__", "max_seq_len", "dtype", "n_layers", "n_slots",
                "alloc_id", "generation", "slot_trailing", "slot_shape", "valid_view")
    _AXIS = 0
    _CACHE = LatentKvCache

    _cache: LatentKvCache

    @property
    def slot_trailing(self) -> Any:
        return self._cache.slot_trailing

    def slot_shape(self, s: int) -> tuple[int, ...]:
        return self._cache.slot_shape(s)

    def valid_view(self, layer: int, s: int) -> npt.NDArray[Any]:
        """Device rows ``[0, cached_len)`` of slot ``s`` of ``layer``, shape
        ``(cached_len, *slot_trailing[s])``."""
        out: npt.NDArray[Any] = self._device_rows(layer, s, "slot")
        return out


class StaticMirror(_SlotMirror):
    """Mirror of a :class:`~kvcache.StaticKvCache`: K and V of a populated layer are device
    arrays ``(1, num_kv_heads, capacity, head_dim)``."""

    MIRRORED = ("cached_len", "seq_len", "__len__", "max_seq_len", "dtype", "n_layers", "n_slots",
                "alloc_id", "generation", "num_kv_heads", "head_dim", "valid_view")
    _AXIS = 2
    _CACHE = StaticKvCache

    _cache: StaticKvCache

    @property
    def num_kv_heads(self) -> int:
        return self._cache.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self._cache.head_dim

    def valid_view(self, layer: int, which: int) -> npt.NDArray[Any]:
        """Device ``(1, num_kv_heads, cached_len, head_dim)`` K (``which=0``) or V (1)."""
        out: npt.NDArray[Any] = self._device_rows(layer, which, "which", "slots (0 = K, 1 = V)")
        return out
