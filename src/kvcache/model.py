"""KvCache: the caches of every layer of a model, evicted and rolled back together.

The eviction rules live in :mod:`kvcache.eviction` (``EvictionPolicy`` is re-exported here)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Optional, Union

import numpy as np

from ._validate import as_int
from .eviction import EvictionPolicy
from .layer import LayerKvCache
from .modes import KvMode

if TYPE_CHECKING:
    from ._wire_io import BufferLike

__all__ = ["EvictionPolicy", "KvCache"]


class KvCache:
    """The KV caches of every layer of a model, with an eviction policy.

    Parameters
    ----------
    n_layers, num_kv_heads, head_dim : int
    max_seq_len : int
        :meth:`needs_eviction` turns True once a layer holds this many positions.
    policy : EvictionPolicy
        Default ``EvictionPolicy.born(sink=4)``.
    mode : KvMode or str, optional
        Storage precision of every layer: a KvMode or a name ``KvMode.parse`` accepts
        ("f32", "q8", "q8k", "q8v"); None reads ``KVCACHE_KV``.
    """

    def __init__(self, n_layers: int, num_kv_heads: int, head_dim: int, max_seq_len: int = 32768,
                 policy: Optional[EvictionPolicy] = None,
                 mode: Union[KvMode, str, None] = None) -> None:
        n_layers = as_int("n_layers", n_layers, minimum=0)
        self.max_seq_len = as_int("max_seq_len", max_seq_len, minimum=1)
        if policy is None:
            policy = EvictionPolicy.born(sink=4)
        if not isinstance(policy, EvictionPolicy):
            raise TypeError(f"policy: expected an EvictionPolicy, got {type(policy).__name__}")
        self.policy = policy
        mode = KvMode.from_env() if mode is None else KvMode.parse(mode)
        self.layers = [LayerKvCache(num_kv_heads, head_dim, mode) for _ in range(n_layers)]
        self.num_kv_heads = as_int("num_kv_heads", num_kv_heads, minimum=1)
        self.head_dim = as_int("head_dim", head_dim, minimum=1)
        self.mode = mode

    @property
    def seq_len(self) -> int:
        """The longest layer's seq_len (0 when there are no layers); a property, as on
        :class:`LayerKvCache`."""
        return max((layer.seq_len for layer in self.layers), default=0)

    @property
    def generation(self) -> int:
        """The sum of the layers' :attr:`LayerKvCache.generation` counters: it grows whenever
        any layer's stored rows change other than by appending (as long as ``layers`` itself
        is not edited by hand)."""
        return sum(layer.generation for layer in self.layers)

    @property
    def track_importance(self) -> bool:
        """True when every layer tracks importance (:attr:`LayerKvCache.track_importance`);
        setting it sets every layer's (a caller that never evicts by importance turns it off
        and saves the prompt kernel's importance pass)."""
        return all(layer.track_importance for layer in self.layers)

    @track_importance.setter
    def track_importance(self, on: bool) -> None:
        if not isinstance(on, (bool, np.bool_)):
            raise TypeError(f"track_importance: expected True or False, got {on!r}")
        for layer in self.layers:
            layer.track_importance = bool(on)

    def needs_eviction(self) -> bool:
        return self.seq_len >= self.max_seq_len

    def evict(self, keep: int) -> None:
        """Shrink every layer to at most ``keep`` positions with the cache's policy.

        Layers carrying O(1) state (collecting or sealed) are skipped.  With a Born policy,
        a layer that does not track importance is a ValueError before any layer changes."""
        keep = as_int("keep", keep, minimum=0)
        if self.policy.kind == "born" and not self.track_importance:
            raise ValueError("evict: Born eviction ranks positions by importance, which a layer "
                             "of this cache does not track (track_importance=False); use "
                             "EvictionPolicy.RECENT or track importance")
        for layer in self.layers:
            layer.evict(keep, self.policy)

    def truncate_last(self, n: int) -> None:
        """Roll back the newest ``n`` positions on every layer.

        All or nothing: when a layer is sealed in O(1) mode (its far field cannot be
        undone; roll it back with ``o1_snapshot``/``o1_restore``) RuntimeError is raised
        before any layer changes."""
        n = as_int("n", n, minimum=0)
        sealed = [i for i, layer in enumerate(self.layers) if layer.o1_sealed()]
        if sealed:
            raise RuntimeError(f"truncate_last: layer {sealed[0]} is sealed in O(1) mode; roll "
                               f"it back with o1_snapshot/o1_restore")
        for layer in self.layers:
            layer.truncate_last(n)

    def clear(self) -> None:
        for layer in self.layers:
            layer.clear()

    def memory_bytes(self) -> int:
        return sum(layer.memory_bytes() for layer in self.layers)

    def to_bytes(self, *, f16: bool = False,
                 fingerprint: Union[bytes, str, None] = None) -> bytes:
        """Every layer in kvcache's versioned, checksummed format: the bytes :meth:`save`
        writes to a file (byte layout: ``docs/formats.md``).

        ``fingerprint`` (bytes or str) identifies the model; ``f16`` stores float32 K/V rows as
        binary16.  :meth:`from_bytes` reads the buffer back into a new cache."""
        from . import wire
        return wire.model_to_bytes(self, f16, fingerprint)

    @classmethod
    def from_bytes(cls, buf: BufferLike, *,
                   fingerprint: Union[bytes, str, None] = None) -> KvCache:
        """A new cache holding what a buffer made by :meth:`to_bytes` (or a file written by
        :meth:`save`, read into memory) holds: geometry, mode, policy, ``max_seq_len`` and
        every layer's state.

        Raises kvcache.WireError for anything wrong with the buffer (truncated, corrupted,
        another format or version, a fingerprint that does not match the one given)."""
        from . import wire
        return wire.model_from_bytes(cls, buf, fingerprint)

    def save(self, path: Union[str, os.PathLike[str]], *,
             fingerprint: Union[bytes, str, None] = None, f16: bool = False) -> None:
        """Write every layer to ``path`` in kvcache's versioned, checksummed format.

        Atomic: the file is written under a temporary name in the same folder, flushed to disk
        (fsync) and renamed over ``path``, so a crash never leaves a half-written file under
        the final name.  ``fingerprint`` (bytes or str) identifies the model; ``f16`` stores
        float32 K/V rows as binary16.  Byte layout: ``docs/formats.md``."""
        from . import wire
        wire.save_model(self, path, fingerprint, f16)

    @classmethod
    def load(cls, path: Union[str, os.PathLike[str]], *,
             fingerprint: Union[bytes, str, None] = None) -> KvCache:
        """Read a file written by :meth:`save` (read into memory, verified, then copied out;
        not memory-mapped: see kvcache.wire.load_model).

        Raises kvcache.WireError for anything wrong with the file (truncated, corrupted,
        another format or version, a fingerprint that does not match the one given)."""
        from . import wire
        return wire.load_model(cls, path, fingerprint)

    def __len__(self) -> int:
        return len(self.layers)

    def __bool__(self) -> bool:
        return True

    def __iter__(self) -> Iterator[LayerKvCache]:
        return iter(self.layers)

    def __getitem__(self, i: int) -> LayerKvCache:
        return self.layers[i]

    def __repr__(self) -> str:
        return (f"KvCache(n_layers={len(self.layers)}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, max_seq_len={self.max_seq_len}, policy={self.policy!r}, "
                f"mode={self.mode!r}, seq_len={self.seq_len})")
