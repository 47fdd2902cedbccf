"""StaticKvCache: the fixed-capacity symmetric K/V cache of every layer.

K and V of each layer are zeroed arrays ``(1, num_kv_heads, max_seq_len, head_dim)`` (capacity
axis 2, the Hugging Face layout), slot 0 = K, slot 1 = V, allocated up front (the fuel-style
``KvCache::with_capacity`` of the upstream engine).  It shares the slot rules of
:class:`kvcache.LatentKvCache` (:class:`kvcache._slots.SlotCache`: ``write_layer`` then one
``advance`` per step, ``alloc_id``, versions, ``truncate_last``, ``clear``, the re-bind source
protocol); ``attend`` runs the compiled grouped-query kernel (``kvcache._core.attend_rows``)
over the valid rows.  ``docs/latent.md`` describes the rules.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Optional

import numpy as np
import numpy.typing as npt

from ._generation import Generation
from ._slots import (F32 as _F32, KvAllocId, SlotCache, as_slab as _as_slab,
                     at_least_one as _at_least_one, cast_slabs as _cast_slabs,
                     check_bytes as _check_bytes, check_capacity as _check_capacity,
                     check_device as _device, resolve_dtype, ro as _ro,
                     slot_index as _slot_index)
from ._validate import FloatArrayLike, as_f32_scalar, as_int
from ._attention import Rows, attend_blocks, attend_prefill, default_scale, grouped_queries
from . import layer as _layer     # noqa: F401  first: its import explains a missing extension
from . import _core

__all__ = ["StaticKvCache"]


class StaticKvCache(SlotCache):
    """Fixed-capacity symmetric K/V cache of every layer (the fuel-style ``KvCache``).

    Parameters
    ----------
    n_layers, num_kv_heads, head_dim, max_seq_len : int
        Each >= 1, in the order of :class:`kvcache.KvCache`.
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
    capacity_axis = 2
    #: the kernel module :meth:`attend` calls: kvcache._core (kvcache.reference's twin sets it
    #: for one call)
    kernels: ModuleType = _core

    def __init__(self, n_layers: int, num_kv_heads: int, head_dim: int, max_seq_len: int,
                 dtype: npt.DTypeLike = np.float32, device: str = "cpu") -> None:
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
    def with_capacity(cls, n_layers: int, num_kv_heads: int, head_dim: int, max_seq_len: int,
                      dtype: npt.DTypeLike = np.float32, device: str = "cpu") -> StaticKvCache:
        """Allocate K and V of every layer up front, zeroed (see the class docstring).

        The arguments come in the order of :class:`KvCache`: ``(n_layers, num_kv_heads,
        head_dim, max_seq_len)``."""
        return cls(n_layers, num_kv_heads, head_dim, max_seq_len, dtype=dtype, device=device)

    @property
    def num_kv_heads(self) -> int:
        """K/V heads per layer."""
        return self._nkv

    @property
    def head_dim(self) -> int:
        """Width of one K or V row."""
        return self._hd

    def _storage_shape(self, s: int) -> tuple[int, ...]:
        return (1, self._nkv, self._max_seq_len, self._hd)

    @property
    def device_location(self) -> Optional[str]:
        """``"cpu"``, or None once :meth:`clear` has made residency unprovable."""
        return self._device

    def __repr__(self) -> str:
        return (f"StaticKvCache(n_layers={self.n_layers}, num_kv_heads={self._nkv}, "
                f"head_dim={self._hd}, max_seq_len={self._max_seq_len}, dtype={self._dtype}, "
                f"cached_len={self._cached_len}, alloc_id={self._alloc_id!r})")

    def _as_kv(self, name: str, value: FloatArrayLike,
               seq: Optional[int] = None) -> npt.NDArray[Any]:
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

    def write_layer(self, layer: int, k: FloatArrayLike, v: FloatArrayLike) -> None:
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

    def valid_view(self, layer: int, which: int) -> npt.NDArray[Any]:
        """Read-only view ``(1, num_kv_heads, cached_len, head_dim)`` of K (``which=0``) or V
        (``which=1``) of ``layer`` (IndexError out of range, ValueError when unpopulated or
        when the storage was replaced by one that is not the allocated buffer)."""
        li, slots = self._populated(layer, "valid_view")
        wi = _slot_index("which", which, 2, "slots (0 = K, 1 = V)")
        (storage,) = self._storages("valid_view", li, slots, which=wi)
        return _ro(storage, np.s_[:, :, : self._cached_len])

    def clear(self) -> None:
        """Release every layer, ``cached_len = 0``, mint a new ``alloc_id`` and forget the
        device location (a re-bind onto the cleared cache is refused as RESIDENCY_UNKNOWN)."""
        self.layers = [None] * len(self.layers)
        self._cached_len = 0
        self._alloc_id = KvAllocId.next()
        self._device = None
        self._gen.diverge()

    def rebind_location(self) -> Optional[str]:
        """Where the storage lives (KvRebindSource): ``"cpu"``, or None after :meth:`clear`."""
        return self._device

    def attend(self, layer: int, q: FloatArrayLike, *, scale: Optional[float] = None,
               softcap: float = 0.0, window: Optional[int] = None) -> npt.NDArray[np.float32]:
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

        Runs the kernels of ``LayerKvCache.attend_all_heads`` -- ``kvcache._core.attend_rows``
        for one position, the blocked ``attend_blocked`` for ``n > 1`` -- directly on the K/V
        storage, which is already their head-major ``(nkv, capacity, hd)`` layout: nothing is
        copied.
        """
        kernels = self.kernels
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
        # the (1, nkv, max_seq_len, hd) storage is already the kernel's head-major layout; K is
        # float32, so the (empty) K scale store is never read: one scale column
        rows = Rows.float32(k_store[0], v_store[0], np.full(nkv, L, dtype=np.intp), 1)
        # a prompt block (n > 1) takes the blocked kernel, one position the decode kernel
        run = attend_prefill if n > 1 else attend_blocks
        run(kernels, rows, q3, out.reshape(n, nh, hd), maxlen=L, window=window, scale=scale,
            softcap=softcap, imp=np.zeros(0, dtype=_F32), imp_mode=0,
            n_threads=_core.max_threads())
        return out
