"""kvcache.store: a prompt-prefix store that reuses KV rows across runs, processes and machines.

:class:`PrefixStore` keys blocks of a prompt by content and keeps them in a :class:`Backend`:
:class:`MemoryBackend` (this process), :class:`DirectoryBackend` (a folder several processes
share; the default, ``~/.cache/kvcache``) or ``kvcache.store.redis.RedisBackend`` (a Redis
server many machines share).  See docs/store.md; the entry layout is in docs/formats.md.
"""

from __future__ import annotations

from .backend import Backend, BackendUnavailable
from .directory import DirectoryBackend
from .memory import MemoryBackend
from .prefix import PrefixStore, open_backend

__all__ = ["PrefixStore", "Backend", "BackendUnavailable", "MemoryBackend", "DirectoryBackend",
           "open_backend"]
