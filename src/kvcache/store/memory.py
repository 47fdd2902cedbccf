"""MemoryBackend: the prefix store's entries in this process's memory (docs/store.md).

A dict in least-recently-used order under one lock, with a byte budget: a put that takes the
total over the budget drops the least recently read or written entries first; a value larger
than the whole budget is not kept.  Thread-safe; the lock is held only for dict operations
(values are immutable ``bytes``, never copied under it).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Optional

__all__ = ["MemoryBackend", "DEFAULT_MEMORY_BUDGET"]

DEFAULT_MEMORY_BUDGET = 2 << 30     # 2 GiB


class MemoryBackend:
    """An in-process backend with a byte budget and LRU eviction.

    Parameters
    ----------
    budget : int
        Most bytes of values kept (default 2 GiB).
    """

    def __init__(self, budget: int = DEFAULT_MEMORY_BUDGET) -> None:
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
            raise ValueError(f"budget: expected an int >= 0 (bytes), got {budget!r}")
        self.budget = budget
        self.name = "memory" if budget == DEFAULT_MEMORY_BUDGET else f"memory:?budget={budget}"
        self._data: OrderedDict[str, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """Bytes of values held now."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._data)

    def keys(self) -> list[str]:
        """The keys held now, least recently used first."""
        with self._lock:
            return list(self._data)

    def get_many(self, keys: Sequence[str]) -> list[Optional[bytes]]:
        out: list[Optional[bytes]] = []
        with self._lock:
            for key in keys:
                value = self._data.get(key)
                if value is not None:
                    self._data.move_to_end(key)
                out.append(value)
        return out

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            return [key in self._data for key in keys]

    def put(self, key: str, value: bytes) -> None:
        if not isinstance(key, str):
            raise TypeError(f"key: expected str, got {type(key).__name__}")
        value = bytes(value) if type(value) is not bytes else value
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self._bytes -= len(old)
            if len(value) > self.budget:
                return
            self._data[key] = value
            self._bytes += len(value)
            while self._bytes > self.budget:
                _, dropped = self._data.popitem(last=False)
                self._bytes -= len(dropped)

    def delete(self, key: str) -> None:
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self._bytes -= len(old)

    def close(self) -> None:
        """Forget every entry."""
        with self._lock:
            self._data.clear()
            self._bytes = 0

    def __repr__(self) -> str:
        return f"MemoryBackend(budget={self.budget}, entries={len(self._data)}, bytes={self._bytes})"
