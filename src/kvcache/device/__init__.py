"""GPU view shims: zero-copy hand-off of cache storage, and incremental device mirrors.

kvcache owns its storage on the CPU.  A runner that offloads attention or whole layers to a GPU
keeps the CPU cache as the owner of record and a *mirror* of it on the device.  This package
gives it the two pieces, one module per job:

* :mod:`kvcache.device.dlpack` -- **zero-copy export.**  Every storage view kvcache hands out
  is a plain NumPy array, so ``torch.from_dlpack(view)`` and ``np.from_dlpack(view)`` wrap
  the same memory without a copy; :func:`as_tensor` also covers bfloat16 storage (exported as
  uint16 and reinterpreted, still without a copy), and :func:`tensors` a whole
  :class:`kvcache.o1.O1DeviceView`.  Views are read-only in NumPy, but torch has no read-only
  tensors: writing through such a tensor writes into the cache.  CuPy cannot wrap host
  memory; use a :class:`Mirror` to put the storage on a CUDA device.
* :mod:`kvcache.device.backends` -- where the copies live: ``"torch"`` (any device torch
  knows: ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ...), ``"cupy"`` (a CUDA device ordinal) and
  ``"numpy"`` (host arrays; a plain copy, useful as a staging buffer and as the backend-free
  test of the sync logic).  torch and CuPy are imported on first use; without them
  :class:`Mirror` raises ImportError saying what to install.
* :mod:`kvcache.device.mirrors` -- **mirrors.**  ``Mirror(cache, backend="torch",
  device="cuda")`` keeps device copies of a :class:`~kvcache.LayerKvCache` (float32 or int8
  storage, or the state of a sealed O(1) layer), a :class:`~kvcache.KvCache` (one mirror per
  layer), a :class:`~kvcache.LatentKvCache` or a :class:`~kvcache.StaticKvCache`.
  :meth:`Mirror.sync` compares the cache's ``generation`` with the one it last synced:

  - unchanged: only the rows appended since the last sync are uploaded;
  - changed by truncations only: the rows from the lowest truncation point on are uploaded
    (the cache's ``unchanged_prefix``), so a speculative-decode rollback costs what it
    re-appends, not the whole context;
  - anything else (eviction, clear, import, column freeze, seal, O(1) restore): everything is
    uploaded again.

  Device capacity grows geometrically (doubling, at least 64 rows), as the host storage does:
  on growth the rows already on the device are copied device-to-device, not re-uploaded.
  Each sync returns a :class:`SyncStats` with the bytes it moved.

A mirror reads the cache's storage directly (through the cache's state object, not a copy)
and is not thread-safe: do not append to the cache while a sync runs.  Writes made by hand
into a cache's storage (``slot_storage``) are not tracked; re-sync with ``sync(full=True)``
after them.
"""

from __future__ import annotations

from .dlpack import as_tensor, tensors
from .mirrors import KvCacheMirror, LatentMirror, LayerMirror, Mirror, StaticMirror, SyncStats

__all__ = ["as_tensor", "tensors", "Mirror", "LayerMirror", "KvCacheMirror", "LatentMirror",
           "StaticMirror", "SyncStats"]
