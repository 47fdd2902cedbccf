"""DirectoryBackend: the prefix store's entries as files in a folder (docs/store.md).

Layout: ``ROOT/<first two characters of the key>/<key>.kvb`` (256 fan-out folders for the
store's hex keys), created on demand.

Several processes (and threads) may use one folder at once; no lock is held while reading or
writing a file:

- **put** writes the whole value to a temporary file in the entry's own folder
  (``.<key>.<pid>.<random>.tmp``), optionally flushes it to disk (fsync) and renames it over the final
  name (``os.replace``, atomic on POSIX and Windows).  A reader opens either the old file or
  the new one, never a half-written one; a writer that dies leaves only a temporary file,
  which a later eviction scan removes once it is an hour old.
- **get** opens the file, reads it whole and sets its modification time to now
  (``os.utime``): the time of the last read or write is the LRU clock.  A file deleted while
  it is being read stays readable through the open handle.
- **budget**: each backend object keeps an estimate of the folder's bytes (a scan, then its
  own puts).  When the estimate passes the budget, or after it wrote an eighth of the budget
  since its last scan (other processes write too), it scans the folder (``os.scandir``, one
  ``stat`` per file), and deletes the least recently used entries until the folder holds at
  most 90% of the budget.  Two processes evicting at once may delete a little more than
  needed; a file that vanished under a scan is skipped.  Deleting an entry another process is
  reading is harmless (see get), and an evicted entry is only a miss for the store.

Errors other than "no such file" (permissions, a full or read-only disk, I/O errors) raise
:class:`~kvcache.store.backend.BackendUnavailable`.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import stat
import logging
import threading
import time
from collections.abc import Sequence
from typing import Optional, Union

from .backend import BackendUnavailable

_log = logging.getLogger("kvcache")

__all__ = ["DirectoryBackend", "DEFAULT_DIRECTORY_BUDGET"]

DEFAULT_DIRECTORY_BUDGET = 16 << 30         # 16 GiB
_SUFFIX = ".kvb"
_KEY = re.compile(r"[0-9A-Za-z][0-9A-Za-z_-]{1,200}\Z")
_STALE_TMP_S = 3600.0
_LOW_WATER = 0.9
_READ_CHUNK = 1 << 30
_HAVE_V = hasattr(os, "readv") and hasattr(os, "writev")
try:
    _IOV = max(16, min(os.sysconf("SC_IOV_MAX"), 1024))
except (AttributeError, ValueError, OSError):
    _IOV = 16


class DirectoryBackend:
    """Entries as files in a folder, shared safely by several processes.

    Parameters
    ----------
    path : str or os.PathLike
        The folder (``~`` is expanded); created with its parents on the first put.
    budget : int or None
        Most bytes the folder may hold (default 16 GiB); None for no limit.
    fsync : bool
        Flush each entry to disk before it is renamed into place (default False).  Readers
        never see a torn entry either way (the rename is atomic); without fsync a machine
        crash may leave an empty or partial file under the final name, which the store's
        digest rejects as a miss and deletes.  The store is a cache, so the default favours
        write speed (here about 1.6 GB/s without fsync against 0.4 GB/s with it).
    """

    def __init__(self, path: Union[str, os.PathLike[str]], *,
                 budget: Optional[int] = DEFAULT_DIRECTORY_BUDGET, fsync: bool = False) -> None:
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)
                                   or budget < 0):
            raise ValueError(f"budget: expected an int >= 0 (bytes) or None, got {budget!r}")
        self.root = os.path.abspath(os.path.expanduser(os.fspath(path)))
        self.budget = budget
        self.fsync = bool(fsync)
        self._read_only = False        # a write was refused for lack of permission
        self.name = f"dir:{self.root}"
        self._lock = threading.Lock()       # guards the counters below, never held during I/O
        self._estimate: Optional[int] = None
        self._since_scan = 0
        self._scanning = False

    # ------------------------------------------------------------------ paths
    def path_of(self, key: str) -> str:
        """The file that holds ``key``'s value."""
        if not isinstance(key, str) or not _KEY.match(key):
            raise ValueError(f"key: expected 2 to 201 letters, digits, '_' or '-' starting with "
                             f"a letter or digit, got {key!r}")
        return os.path.join(self.root, key[:2], key + _SUFFIX)

    # ------------------------------------------------------------------ reads
    def get_many(self, keys: Sequence[str]) -> list[Optional[bytes]]:
        return [self._get(self.path_of(key)) for key in keys]

    def _open(self, path: str) -> Optional[int]:
        """A read-only descriptor of the regular file ``path``; None when there is no such
        entry, or something else stands there (a folder, a FIFO, a device, a symbolic link:
        entries are only ever regular files renamed into place).  Opened without blocking and
        without following links, so a FIFO or a link loop cannot hang or fool a read."""
        flags = (os.O_RDONLY | getattr(os, "O_BINARY", 0) | getattr(os, "O_NONBLOCK", 0)
                 | getattr(os, "O_NOFOLLOW", 0))
        try:
            fd = os.open(path, flags)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENXIO):   # a link, or a FIFO with no writer
                return None
            raise BackendUnavailable(f"{self.name}: cannot open {path}: {exc}") from exc
        try:
            regular = stat.S_ISREG(os.fstat(fd).st_mode)
        except OSError:
            regular = False
        if not regular:
            os.close(fd)
            return None
        return fd

    def _get(self, path: str) -> Optional[bytes]:
        fd = self._open(path)
        if fd is None:
            return None
        try:
            size = os.fstat(fd).st_size
            data = os.read(fd, size) if size <= _READ_CHUNK else b""
            if len(data) < size:           # a short read (huge files, some file systems)
                parts = [data]
                got = len(data)
                while got < size:
                    part = os.read(fd, min(size - got, _READ_CHUNK))
                    if not part:
                        break
                    parts.append(part)
                    got += len(part)
                data = b"".join(parts)
            _touch(fd, path)
            return data
        except OSError as exc:
            raise BackendUnavailable(f"{self.name}: cannot read {path}: {exc}") from exc
        finally:
            os.close(fd)

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        out: list[bool] = []
        for key in keys:
            try:
                os.stat(self.path_of(key))
                out.append(True)
            except (FileNotFoundError, NotADirectoryError):
                out.append(False)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    out.append(False)
                    continue
                raise BackendUnavailable(f"{self.name}: cannot look up {key}: {exc}") from exc
        return out

    # ------------------------------------------------------------------ writes
    def put(self, key: str, value: bytes) -> None:
        self.put_parts(key, [memoryview(value)])

    def put_parts(self, key: str, parts: Sequence[memoryview]) -> None:
        """``put(key, b"".join(parts))`` written with gathered writes, without joining."""
        path = self.path_of(key)
        folder = os.path.dirname(path)
        tmp = os.path.join(folder, f".{key}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        views = [memoryview(p).cast("B") for p in parts]
        size = sum(len(v) for v in views)
        try:
            os.makedirs(folder, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0),
                         0o644)
            try:
                _write_all(fd, views)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.replace(tmp, path)
            except (IsADirectoryError, OSError) as exc:
                if exc.errno not in (errno.EISDIR, errno.ENOTEMPTY):
                    raise
                os.unlink(tmp)           # a folder stands at the entry's name: not stored
                return
        except OSError as exc:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
                if not self._read_only:  # a folder shared read-only: reads still serve
                    self._read_only = True
                    _log.warning("kvcache store %s: cannot write (%s); reading only", self.name,
                                 exc.strerror)
                return
            raise BackendUnavailable(f"{self.name}: cannot write {path}: {exc}") from exc
        self._account(size)

    def read_parts(self, key: str, parts: Sequence[memoryview]) -> Optional[int]:
        """The value's length (None: missing); the parts hold it when the lengths agree."""
        path = self.path_of(key)
        fd = self._open(path)
        if fd is None:
            return None
        try:
            size = os.fstat(fd).st_size
            views = [memoryview(p).cast("B") for p in parts]
            if size == sum(len(v) for v in views):
                got = _read_all(fd, views)
                if got != size:          # shorter than fstat said: cannot happen to a file
                    size = got           # that is only ever renamed into place; a miss then
            _touch(fd, path)
            return size
        except OSError as exc:
            raise BackendUnavailable(f"{self.name}: cannot read {path}: {exc}") from exc
        finally:
            os.close(fd)

    def delete(self, key: str) -> None:
        """Remove ``key``'s file; quietly nothing where the folder does not allow it (a
        read-only store shared by others)."""
        _unlink(self.path_of(key))

    def close(self) -> None:
        """Nothing to release (files are closed after each operation)."""

    # ------------------------------------------------------------------ budget
    def _account(self, written: int) -> None:
        if self.budget is None:
            return
        with self._lock:
            if self._estimate is not None:
                self._estimate += written
            self._since_scan += written
            due = (self._estimate is None or self._estimate > self.budget
                   or self._since_scan > self.budget // 8)
            if not due or self._scanning:
                return
            self._scanning = True
        try:
            self.evict()
        finally:
            with self._lock:
                self._scanning = False

    def scan(self) -> list[tuple[float, int, str]]:
        """(modification time, size, path) of every entry file now in the folder; removes
        temporary files older than an hour on the way.  Files that vanish are skipped."""
        out: list[tuple[float, int, str]] = []
        now = time.time()
        try:
            tops = list(os.scandir(self.root))
        except (FileNotFoundError, NotADirectoryError):
            return out
        except OSError as exc:
            raise BackendUnavailable(f"{self.name}: cannot list the folder: {exc}") from exc
        for top in tops:
            try:
                if not top.is_dir(follow_symlinks=False):
                    continue
                entries = list(os.scandir(top.path))
            except OSError:
                continue
            for e in entries:
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                if e.name.endswith(_SUFFIX) and not e.name.startswith("."):
                    out.append((st.st_mtime, st.st_size, e.path))
                elif e.name.endswith(".tmp") and now - st.st_mtime > _STALE_TMP_S:
                    _unlink(e.path)
        return out

    def evict(self) -> int:
        """Scan the folder and delete least recently used entries until it holds at most 90% of
        the budget (nothing when it is within the budget).  Returns the bytes deleted."""
        files = self.scan()
        total = sum(size for _, size, _ in files)
        freed = 0
        if self.budget is not None and total > self.budget:
            files.sort()
            target = int(self.budget * _LOW_WATER)
            for _, size, path in files:
                if total - freed <= target:
                    break
                if _unlink(path):
                    freed += size
        with self._lock:
            self._estimate = total - freed
            self._since_scan = 0
        return freed

    def nbytes(self) -> int:
        """Bytes of entries in the folder now (a scan)."""
        return sum(size for _, size, _ in self.scan())

    def __repr__(self) -> str:
        return f"DirectoryBackend({self.root!r}, budget={self.budget})"


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.EBUSY, errno.EISDIR,
                         errno.ENOTDIR, errno.ELOOP):
            return False
        raise BackendUnavailable(f"cannot delete {path}: {exc}") from exc


def _touch(fd: int, path: str) -> None:
    """Set the file's times to now (the LRU clock); quietly nothing where that is refused
    (a read-only folder, someone else's file)."""
    try:
        os.utime(fd if os.utime in os.supports_fd else path)
    except OSError:
        pass


def _advance(views: list[memoryview], i: int, n: int) -> tuple[int, list[memoryview]]:
    """Skip ``n`` bytes of ``views[i:]``: the new index and the views (the first trimmed)."""
    while n and i < len(views):
        if n >= len(views[i]):
            n -= len(views[i])
            i += 1
        else:
            views[i] = views[i][n:]
            n = 0
    return i, views


def _write_all(fd: int, views: list[memoryview]) -> None:
    """Write every byte of ``views`` in order (gathered writes of up to _IOV views)."""
    views = list(views)
    i = 0
    while i < len(views):
        if not len(views[i]):
            i += 1
            continue
        if _HAVE_V:
            n = os.writev(fd, views[i: i + _IOV])
        else:
            n = os.write(fd, views[i])
        i, views = _advance(views, i, n)


def _read_all(fd: int, views: list[memoryview]) -> int:
    """Fill ``views`` in order from ``fd`` (scattered reads); the bytes read (less at EOF)."""
    views = list(views)
    total = 0
    i = 0
    while i < len(views):
        if not len(views[i]):
            i += 1
            continue
        if _HAVE_V:
            n = os.readv(fd, views[i: i + _IOV])
        else:
            n = os.readinto(fd, views[i]) if hasattr(os, "readinto") else _readinto(fd, views[i])
        if n == 0:
            break
        total += n
        i, views = _advance(views, i, n)
    return total


def _readinto(fd: int, view: memoryview) -> int:
    data = os.read(fd, len(view))
    view[: len(data)] = data
    return len(data)
