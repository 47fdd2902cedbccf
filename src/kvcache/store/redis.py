"""A prefix-store backend kept in Redis, so that many processes and machines share one store.

Install the client with ``pip install redis``; the server is one Redis >= 5 (the Debian package
``redis-server`` will do; Redis Cluster is not supported, a value's parts may land on other nodes).  See ``docs/store.md`` for the store itself.

Layout in Redis
---------------
Every key lives under ``namespace`` (default ``"kvcache:"``).  An entry ``key`` is one *manifest*
string at ``<namespace>e:<key>``:

- a value of at most ``max_part_bytes`` is kept inline: the manifest is ``b"KVR1i"`` + the value;
- a longer value is cut into parts of ``max_part_bytes`` (Redis refuses strings over 512 MB), kept at
  ``<namespace>p:<key>:<token>:<i>``, and the manifest is ``b"KVR1m"`` + the part count, the total
  length, the part length and the random 16-byte ``token`` of this write.

A put writes the parts first, under part keys no other write uses, and then the manifest with
one ``SET``, so a reader sees the old manifest, the new one or none, and every manifest it sees
names parts that were complete when it was written.  A read fetches the manifests of all keys in
one pipelined round trip and the parts of the split ones in a second; a part that is missing or
of the wrong length (evicted, expired, or dropped by a later overwrite) makes that entry a miss,
and the stale manifest is removed if nobody replaced it meanwhile (so ``contains_many``, which
only looks for manifests, stops reporting it and the store writes the entry again).

Byte budget and expiry
----------------------
Redis enforces the byte budget itself: run the server with ``maxmemory <bytes>`` and
``maxmemory-policy allkeys-lru`` (or ``allkeys-lfu``) and it evicts the least recently used keys.
An evicted part only turns its entry into a miss.  On the client side, ``ttl`` (seconds) makes
every key written expire that long after its write; a write that died half-way leaves parts
without a manifest, which the TTL or the server's eviction removes.

Failures
--------
Every error of the client (connection refused or lost, a timeout after ``socket_timeout``
seconds, an error reply) is raised as :class:`~kvcache.store.backend.BackendUnavailable`.  The
client does not retry, so a server that is down is reported at once, and one that hangs within
``socket_timeout``.
"""

from __future__ import annotations

import math
import os
import struct
import urllib.parse
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable, Optional, TypeVar, Union

from .backend import BackendUnavailable

if TYPE_CHECKING:
    import redis as _redis_mod

__all__ = ["RedisBackend"]

_T = TypeVar("_T")

#: Redis refuses string values over 512 MB (its ``proto-max-bulk-len`` default).
REDIS_MAX_STRING = 512 * 1024 * 1024
#: default size of the parts a long value is cut into
DEFAULT_MAX_PART_BYTES = 64 * 1024 * 1024

_INLINE = b"KVR1i"
_SPLIT = b"KVR1m"
_SPLIT_FMT = struct.Struct("<IQQ16s")  # part count, total bytes, part bytes, token
#: Most parts one value may have: a manifest naming more is not one this backend writes
#: (a writer uses larger parts rather than more), so a reader takes it for a miss.
MAX_PARTS = 1 << 16

# Delete KEYS[1] only if it still holds ARGV[1] (a stale manifest nobody replaced meanwhile).
_DELETE_IF_EQUAL = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
    return redis.call('DEL', KEYS[1])
end
return 0
"""


class _Split:
    """The decoded manifest of a value kept in parts."""

    __slots__ = ("count", "total", "part_bytes", "token")

    def __init__(self, count: int, total: int, part_bytes: int, token: bytes) -> None:
        self.count = count
        self.total = total
        self.part_bytes = part_bytes
        self.token = token

    def part_length(self, i: int) -> int:
        return min(self.part_bytes, self.total - i * self.part_bytes)


def _parse_manifest(raw: bytes) -> Union[memoryview, _Split, None]:
    """The inline value (a view into ``raw``, not a copy), the split manifest, or None for
    bytes that are not a manifest."""
    head = raw[: len(_INLINE)]
    if head == _INLINE:
        return memoryview(raw)[len(_INLINE) :]
    if head != _SPLIT or len(raw) != len(_SPLIT) + _SPLIT_FMT.size:
        return None
    count, total, part_bytes, token = _SPLIT_FMT.unpack_from(raw, len(_SPLIT))
    if (part_bytes < 1 or total < 1 or count > MAX_PARTS
            or count != math.ceil(total / part_bytes)):
        return None                # (a forged count would make one read fetch millions of keys)
    return _Split(count, total, part_bytes, token)


def _display_url(url: str) -> str:
    """``url`` without its password, for ``name`` and messages."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    user = parts.username or ""
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


#: options that may also come in the URL's query string: ``redis://host:6379/0?ttl=3600``
_URL_OPTIONS = ("namespace", "ttl", "max_part_bytes", "socket_timeout")


def _take_options(url: str) -> tuple[str, dict[str, str]]:
    """``url`` without this backend's query options, and those options."""
    parts = urllib.parse.urlsplit(url)
    query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    ours = {k: v for k, v in query if k in _URL_OPTIONS}
    if not ours:
        return url, ours              # untouched (urlunsplit would turn unix:///p into unix:/p)
    rest = urllib.parse.urlencode([(k, v) for k, v in query if k not in _URL_OPTIONS])
    base = url.split("?", 1)[0]
    return (f"{base}?{rest}" if rest else base), ours


def _ttl_from_text(text: str) -> Optional[float]:
    return None if text.lower() in ("", "none", "0") else float(text)


class RedisBackend:
    """A :class:`~kvcache.store.backend.StoreBackend` in a Redis server (see the module docstring).

    Parameters
    ----------
    url : str
        ``redis://[user:password@]host:port/db`` (``rediss://`` for TLS, ``unix://`` for a
        socket), as the ``redis`` client package reads it.  The options below may also be
        given in its query string, e.g. ``redis://host:6379/0?namespace=llama:&ttl=86400``
        (``ttl=0`` or ``none``: no expiry), so that a URL alone (``--store`` on the command
        line) can set them; giving one both ways with different values is an error.
    namespace : str, default ``"kvcache:"``
        Prefix of every key this backend writes; stores with other namespaces on the same server
        never see each other's entries.
    ttl : float or None, default None
        Seconds after its write at which an entry expires; None keeps entries until deleted or
        evicted.  A byte budget is the server's job (``maxmemory`` with ``allkeys-lru``).
    max_part_bytes : int, default 64 MiB
        Values longer than this are kept as several parts of this size (at most 512 MiB, Redis's
        limit for one string).
    socket_timeout : float, default 5.0
        Seconds to wait for a connection or a reply before the server counts as unavailable.

    Raises
    ------
    ImportError
        The ``redis`` client package is not installed.
    ValueError
        An option is out of range.

    Notes
    -----
    Nothing is sent before the first call; a server that is down shows up as
    :class:`~kvcache.store.backend.BackendUnavailable` from that call.
    """

    name: str

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        namespace: str = "kvcache:",
        ttl: Optional[float] = None,
        max_part_bytes: int = DEFAULT_MAX_PART_BYTES,
        socket_timeout: float = 5.0,
    ) -> None:
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as exc:
            raise ImportError(
                "RedisBackend needs the redis client package: pip install redis"
            ) from exc
        if not isinstance(url, str):
            raise TypeError(f"expected a redis:// URL string, got {type(url).__name__}")
        self.name = _display_url(url)
        client_url, from_url = _take_options(url)

        def pick(option: str, value: _T, default: _T, parse: Callable[[str], _T]) -> _T:
            if option not in from_url:
                return value
            try:
                parsed = parse(from_url[option])
            except ValueError:
                raise ValueError(f"expected a number for {option} in the URL {self.name!r}, "
                                 f"got {from_url[option]!r}") from None
            if value != default and value != parsed:
                raise ValueError(f"{option} given twice: {value!r}, and {parsed!r} in the URL")
            return parsed

        namespace = pick("namespace", namespace, "kvcache:", str)
        ttl = pick("ttl", ttl, None, _ttl_from_text)
        max_part_bytes = pick("max_part_bytes", max_part_bytes, DEFAULT_MAX_PART_BYTES, int)
        socket_timeout = pick("socket_timeout", socket_timeout, 5.0, float)
        if not isinstance(namespace, str):
            raise TypeError(f"expected namespace to be a str, got {type(namespace).__name__}")
        if ttl is not None and not (ttl > 0 and math.isfinite(ttl) and ttl * 1000 < 2 ** 63):
            raise ValueError(f"expected ttl > 0 seconds (at most about 292 million years) or "
                             f"None, got {ttl!r}")
        db = urllib.parse.urlsplit(client_url).path.strip("/")
        if client_url.startswith(("redis://", "rediss://")) and db and not db.isdigit():
            raise ValueError(f"expected a database number after the port in {self.name!r}, "
                             f"got {db!r}")
        if (
            isinstance(max_part_bytes, bool)
            or not isinstance(max_part_bytes, int)
            or not 1 <= max_part_bytes <= REDIS_MAX_STRING
        ):
            raise ValueError(
                f"expected max_part_bytes in [1, {REDIS_MAX_STRING}], got {max_part_bytes!r}"
            )
        if not (socket_timeout > 0 and math.isfinite(socket_timeout)):
            raise ValueError(f"expected socket_timeout > 0 seconds, got {socket_timeout!r}")
        self.namespace = namespace
        self.ttl = ttl
        self.max_part_bytes = max_part_bytes
        self.socket_timeout = float(socket_timeout)
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        # an error reply (not a lost connection) to a clean-up the reads and writes do not need
        self._refused: type[BaseException] = redis.ResponseError
        try:
            self._client: _redis_mod.Redis = redis.Redis.from_url(
                client_url,
                socket_timeout=self.socket_timeout,
                socket_connect_timeout=self.socket_timeout,
                retry=Retry(NoBackoff(), 0),
                retry_on_timeout=False,
                decode_responses=False,
            )
        except ValueError as exc:
            raise ValueError(f"expected a redis:// URL, got {self.name!r}: {exc}") from exc
        self._delete_if_equal = self._client.register_script(_DELETE_IF_EQUAL)
        self._ttl_ms = None if ttl is None else max(1, round(ttl * 1000))

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        namespace: str = "kvcache:",
        ttl: Optional[float] = None,
        max_part_bytes: int = DEFAULT_MAX_PART_BYTES,
        socket_timeout: float = 5.0,
    ) -> RedisBackend:
        """``RedisBackend(url, ...)``: the same parameters as the constructor."""
        return cls(
            url,
            namespace=namespace,
            ttl=ttl,
            max_part_bytes=max_part_bytes,
            socket_timeout=socket_timeout,
        )

    def __repr__(self) -> str:
        return f"RedisBackend({self.name!r}, namespace={self.namespace!r})"

    # -- keys ----------------------------------------------------------------------------------

    def _manifest_key(self, key: str) -> str:
        return f"{self.namespace}e:{key}"

    def _part_keys(self, key: str, split: _Split) -> list[str]:
        tok = split.token.hex()
        return [f"{self.namespace}p:{key}:{tok}:{i}" for i in range(split.count)]

    @contextmanager
    def _errors_as_unavailable(self) -> Iterator[None]:
        try:
            yield
        except BackendUnavailable:
            raise
        except self._errors as exc:
            raise BackendUnavailable(f"redis at {self.name}: {exc}") from exc

    # -- the StoreBackend contract -------------------------------------------------------------

    def get_many(self, keys: Sequence[str]) -> list[Optional[bytes]]:
        """The values of ``keys`` (None for a missing or inconsistent entry), in order."""
        return [None if v is None else bytes(v) for v in self.get_many_buffers(keys)]

    def get_many_buffers(self, keys: Sequence[str]) -> list[Optional[Union[bytes, memoryview]]]:
        """:meth:`get_many` without copying an inline value out of its manifest: each value
        as bytes or a read-only memoryview (``bytes(v)`` is the value), None where missing.
        The prefix store reads entries this way."""
        keys = list(keys)
        if not keys:
            return []
        out: list[Optional[Union[bytes, memoryview]]] = [None] * len(keys)
        with self._errors_as_unavailable():
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.get(self._manifest_key(key))
            manifests: list[Optional[bytes]] = pipe.execute()
            split_at: list[tuple[int, _Split, list[str]]] = []
            stale: list[tuple[str, bytes, list[str]]] = []
            for i, (key, raw) in enumerate(zip(keys, manifests)):
                if raw is None:
                    continue
                parsed = _parse_manifest(raw)
                if isinstance(parsed, memoryview):
                    out[i] = parsed
                elif isinstance(parsed, _Split):
                    split_at.append((i, parsed, self._part_keys(key, parsed)))
                else:
                    stale.append((self._manifest_key(key), raw, []))
            if split_at:
                pipe = self._client.pipeline(transaction=False)
                for _, _, part_keys in split_at:
                    for pk in part_keys:
                        pipe.get(pk)
                parts: list[Optional[bytes]] = pipe.execute()
                pos = 0
                for i, split, part_keys in split_at:
                    mine = parts[pos : pos + split.count]
                    pos += split.count
                    if all(
                        p is not None and len(p) == split.part_length(j)
                        for j, p in enumerate(mine)
                    ):
                        out[i] = b"".join(p for p in mine if p is not None)
                    else:
                        stale.append((self._manifest_key(keys[i]), manifests[i] or b"", part_keys))
            if stale:
                self._remove_stale(stale)
        return out

    def contains_many(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key has a manifest (its parts are checked only when it is read)."""
        keys = list(keys)
        if not keys:
            return []
        with self._errors_as_unavailable():
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self._manifest_key(key))
            found: list[int] = pipe.execute()
        return [bool(n) for n in found]

    def put(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key``: parts first, then the manifest in one ``SET``."""
        view = memoryview(value).cast("B")
        total = len(view)
        with self._errors_as_unavailable():
            if total <= self.max_part_bytes:
                manifest = _INLINE + view.tobytes()
            else:
                # at most MAX_PARTS parts: larger ones than max_part_bytes when needed
                step = max(self.max_part_bytes, -(-total // MAX_PARTS))
                split = _Split(math.ceil(total / step), total, step, os.urandom(16))
                pipe = self._client.pipeline(transaction=False)
                for j, pk in enumerate(self._part_keys(key, split)):
                    pipe.set(pk, view[j * step : (j + 1) * step], px=self._ttl_ms)
                pipe.execute()
                manifest = _SPLIT + _SPLIT_FMT.pack(split.count, total, step, split.token)
            # GET and SET in one MULTI/EXEC: the old manifest tells which old parts to drop
            pipe = self._client.pipeline(transaction=True)
            pipe.get(self._manifest_key(key))
            pipe.set(self._manifest_key(key), manifest, px=self._ttl_ms)
            old = pipe.execute()[0]
            self._drop_parts_of(key, old)

    def delete(self, key: str) -> None:
        """Remove ``key`` and its parts if it is there."""
        with self._errors_as_unavailable():
            pipe = self._client.pipeline(transaction=True)
            pipe.get(self._manifest_key(key))
            pipe.delete(self._manifest_key(key))
            old = pipe.execute()[0]
            self._drop_parts_of(key, old)

    def close(self) -> None:
        """Close the connections; the backend is not used afterwards."""
        with self._errors_as_unavailable():
            self._client.close()

    # -- helpers -------------------------------------------------------------------------------

    def _drop_parts_of(self, key: str, manifest: Optional[bytes]) -> None:
        """Delete the parts named by a manifest that was just replaced or deleted."""
        if manifest is None:
            return
        parsed = _parse_manifest(manifest)
        if isinstance(parsed, _Split):
            try:
                self._client.delete(*self._part_keys(key, parsed))
            except self._refused:
                pass  # left to the TTL or the server's eviction

    def _remove_stale(self, stale: list[tuple[str, bytes, list[str]]]) -> None:
        """Remove manifests whose parts are gone (or that are not manifests), unless replaced."""
        try:
            for manifest_key, raw, part_keys in stale:
                if self._delete_if_equal(keys=[manifest_key], args=[raw]) and part_keys:
                    self._client.delete(*part_keys)
        except self._refused:
            pass  # e.g. scripting not allowed for this user: the entry stays a miss
