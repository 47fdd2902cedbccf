"""kvcache.store: a prompt-prefix store that reuses KV rows across runs, processes and machines.

:class:`PrefixStore` keys blocks of a prompt by content and keeps them in a
:class:`StoreBackend`:
:class:`MemoryBackend` (this process), :class:`DirectoryBackend` (a folder several processes
share; the default, ``~/.cache/kvcache``) or ``kvcache.store.redis.RedisBackend`` (a Redis
server many machines share).  See docs/store.md; the entry layout is in docs/formats.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import _deprecated
from .backend import BackendUnavailable, StoreBackend
from .directory import DirectoryBackend
from .memory import MemoryBackend
from .prefix import PrefixStore, open_backend

__all__ = ["PrefixStore", "StoreBackend", "BackendUnavailable", "MemoryBackend", "DirectoryBackend",
           "open_backend"]


# the old name, deprecated in 0.2.0 (type checkers see only the new one)
if not TYPE_CHECKING:
    __getattr__ = _deprecated.module_getattr(
        __name__, {"Backend": "kvcache.store.StoreBackend"})
