"""The digest of a runner's weights, computed once per checkpoint rather than once per runner.

:attr:`kvcache.runner.Runner.fingerprint` (the prefix store's key for a model) covers every
weight array's bytes.  Hashing them costs about a second per GB, and every new runner that
opens a store paid it again (0.7 s of a 1.2 s store hit on SmolLM2-135M).  Here the weights'
digest is computed once and kept:

* in this process, under the checkpoint's *source* (below), for every later runner loaded from
  the same files;
* in a small JSON file (``KVCACHE_DIGEST_CACHE``: its path; default
  ``~/.cache/kvcache-runner/weight-digests.json``; empty, ``off``, ``0``, ``no``, ``none`` or
  ``false``, in any case: no file), for later processes.  The file is rewritten atomically (a
  temporary file, then a rename); a file that cannot be read or written, is not a regular
  file, is over 1 MiB or does not parse is ignored, never an error.

The source of a checkpoint names the files the loader reads (a GGUF file; a folder's
``config.json``, ``model.safetensors.index.json`` and ``*.safetensors``) as they are: each
file's real path, size, modification and status-change times in nanoseconds, inode and
device, kvcache's version and :data:`LOADER` (the loader's conversion to float32 is part of
what was hashed), and the version of the package that decodes the file (``gguf`` for a GGUF
file, ``safetensors`` for a folder).  Rewriting a file in place changes its
times, so a stale digest is not reused.  A runner built from arrays (``Runner(config,
weights)``, ``Runner.random``) has no source: its digest is computed when first needed, as
before.

The digest itself is a tree: BLAKE2b of each array (its name, dtype, shape and bytes; the
arrays hashed on several threads, hashlib releases the GIL), then BLAKE2b of those digests in
order, so that hashing runs at the speed of several cores.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable, Optional

import numpy as np

from .._threads import usable_cpus
from .._version import __version__

__all__ = ["ENV", "LOADER", "SCHEME", "checkpoint_source", "weights_digest"]

ENV = "KVCACHE_DIGEST_CACHE"
"""The environment variable naming the digest file (``off`` or empty: none)."""
SCHEME = "tree-blake2b-1"
"""How the weights' digest is computed; part of every cached entry's key."""
LOADER = 1
"""The version of the checkpoint loaders' float32 conversion (raise it when a loader changes
what it gives for the same file); part of every cached entry's key."""
_OFF = ("", "off", "0", "no", "none", "false")
_MAX_FILE = 1 << 20
_DEFAULT = os.path.join("~", ".cache", "kvcache-runner", "weight-digests.json")
_MAX_ENTRIES = 64                 # the file keeps the newest entries only

_memo: dict[str, str] = {}
_lock = threading.Lock()


def checkpoint_source(path: str | os.PathLike[str]) -> Optional[str]:
    """The source key of the checkpoint at ``path`` (module docstring), or None when a file
    cannot be examined."""
    where = os.path.realpath(os.fspath(path))
    try:
        if os.path.isfile(where):
            files = [where]
        else:
            files = sorted(os.path.join(where, f) for f in os.listdir(where)
                           if f in ("config.json", "model.safetensors.index.json")
                           or f.endswith(".safetensors"))
        parts = []
        for f in files:
            st = os.stat(f)
            parts.append([f, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev])
    except OSError:
        return None
    decoder = "gguf" if len(files) == 1 and files[0] == where else "safetensors"
    return json.dumps([__version__, SCHEME, LOADER, decoder, _package_version(decoder), parts])


def _package_version(name: str) -> str:
    from importlib import metadata
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"


def _cache_file() -> Optional[str]:
    value = os.environ.get(ENV)
    if value is None:
        return os.path.expanduser(_DEFAULT)
    value = value.strip()
    if value.lower() in _OFF:
        return None
    return os.path.expanduser(value)


def _read(file: str) -> dict[str, str]:
    try:
        st = os.stat(file)
        if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_FILE:
            return {}
        with open(file, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError, RecursionError, MemoryError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)
            and len(v) == 64}


def _write(file: str, key: str, digest: str) -> None:
    entries = _read(file)
    entries.pop(key, None)
    entries[key] = digest                               # newest last
    keep = dict(list(entries.items())[-_MAX_ENTRIES:])
    try:
        folder = os.path.dirname(file) or "."
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".weight-digests-", dir=folder)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump(keep, fh)
            os.replace(tmp, file)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        pass                                            # a cache, never an error


def _array_digest(item: tuple[str, np.ndarray]) -> bytes:
    name, a = item
    h = hashlib.blake2b(digest_size=32, person=b"kvc-weight")
    h.update(f"{name}:{a.dtype.str}:{a.shape}".encode())
    h.update(np.ascontiguousarray(a).data)              # the buffer itself, no copy
    return h.digest()


def _compute(arrays: list[tuple[str, np.ndarray]]) -> str:
    workers = min(8, usable_cpus())
    if workers == 1 or len(arrays) < 2:
        parts = [_array_digest(x) for x in arrays]
    else:
        with ThreadPoolExecutor(workers) as pool:
            parts = list(pool.map(_array_digest, arrays))
    h = hashlib.blake2b(digest_size=32, person=b"kvc-weights")
    for p in parts:
        h.update(p)
    return h.hexdigest()


def weights_digest(arrays: Iterable[tuple[str, np.ndarray]], source: Optional[str]) -> str:
    """The hex digest of the named ``arrays`` (in order), reused for a known ``source`` from
    this process or from the digest file, and kept for it."""
    if source is not None:
        with _lock:
            if source in _memo:
                return _memo[source]
        file = _cache_file()
        if file is not None:
            hit = _read(file).get(source)
            if hit is not None:
                with _lock:
                    _memo[source] = hit
                return hit
    digest = _compute(list(arrays))
    if source is not None:
        with _lock:
            _memo[source] = digest
        file = _cache_file()
        if file is not None:
            _write(file, source, digest)
    return digest
