"""The contract between :class:`kvcache.store.PrefixStore` and where its entries live.

A backend is a flat map from string keys to immutable byte values.  The store alone decides
what the keys and values mean (content-derived keys, checksummed entries); a backend only has
to keep what it was given, whole or not at all:

- ``put`` is atomic: a reader sees the old value, the new one, or nothing -- never a torn value.
  Writing a key that exists again is allowed (two processes may store the same block at once;
  the values are then equal).
- ``get_many`` returns one item per key, None for a missing key.  Backends that can batch
  (Redis pipelining) fetch all keys in one round trip.
- ``contains_many`` answers whether keys exist without reading values.
- ``delete`` removes a key if it is there (the store deletes entries it found corrupt).
- A backend may drop any entry at any time (byte budget, LRU, TTL): the store treats a missing
  entry as a miss.
- When the backend cannot be reached, times out or fails in its own machinery it raises
  :class:`BackendUnavailable`; the store then turns itself into a no-op with one warning.
  Every other exception is a bug.

Optional: a backend that can move a value between its storage and the caller's memory without
an intermediate ``bytes`` object also implements :class:`ScatterBackend` (``put_parts``,
``read_parts``; the directory backend does).  The store then writes an entry straight from the
cache's rows and reads one straight into the new cache's arrays.  Same rules as above.

Optional too: ``get_many_buffers(keys)``, :class:`BufferBackend`: ``get_many`` whose values
may be read-only buffers (a ``memoryview``) instead of ``bytes``, so that a backend can hand
over a value without copying it out of what it received (the Redis backend's inline values).
Same keys, order and None for a miss; each buffer must stay valid and unchanged while anyone
holds it (never a view into a receive buffer that is reused).  The store reads entries
through it where a backend has it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Optional, Protocol, Union, runtime_checkable

from .. import _deprecated

__all__ = ["StoreBackend", "BackendUnavailable", "ScatterBackend", "BufferBackend"]


class BackendUnavailable(OSError):
    """The backend cannot be used right now (server down, timeout, disk gone)."""


@runtime_checkable
class StoreBackend(Protocol):
    """Where a prefix store keeps its entries (see the module docstring for the contract).

    Named apart from :class:`kvcache.device.backends.DeviceBackend` (where a device mirror
    keeps its copies); ``Backend``, its old name, is deprecated."""

    #: a short description for messages and ``repr``: ``"memory"``, ``"dir:/path"``, ``"redis://host:port/db"``
    name: str

    def get_many(self, keys: Sequence[str]) -> list[Optional[bytes]]: ...

    def contains_many(self, keys: Sequence[str]) -> list[bool]: ...

    def put(self, key: str, value: bytes) -> None: ...

    def delete(self, key: str) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class ScatterBackend(Protocol):
    """What a backend may add to :class:`StoreBackend` to skip a copy of every value
    (optional)."""

    def put_parts(self, key: str, parts: Sequence[memoryview]) -> None:
        """``put(key, b"".join(parts))``, atomic likewise, without joining."""
        ...

    def read_parts(self, key: str, parts: Sequence[memoryview]) -> Optional[int]:
        """None when ``key`` is missing; else the value's length n.  When n equals the parts'
        total length, the parts (writable byte views) hold the value in order; otherwise their
        content is unspecified.  Counts as a read for LRU like ``get_many``."""
        ...


@runtime_checkable
class BufferBackend(Protocol):
    """What a backend may add to :class:`StoreBackend` to hand over values without a copy
    (optional; the module docstring says what the buffers must guarantee)."""

    def get_many_buffers(self, keys: Sequence[str]) -> list[Optional[Union[bytes, memoryview]]]:
        """:meth:`StoreBackend.get_many`, each value as bytes or a read-only buffer."""
        ...


# the old name, deprecated in 0.2.0 (type checkers see only the new one)
if not TYPE_CHECKING:
    __getattr__ = _deprecated.module_getattr(
        __name__, {"Backend": "kvcache.store.backend.StoreBackend"})
