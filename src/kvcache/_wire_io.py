"""The building blocks of kvcache's byte formats (:mod:`kvcache.wire`): the format
constants, :class:`WireError`, the digests (XXH3-64 through ``xxhash`` when installed, else
zlib's CRC-32), the writer's :class:`Plan` of pieces and the bounds-checked :class:`Reader`.

Every format module builds on these; :mod:`kvcache.wire` re-exports the public ones.
"""

from __future__ import annotations

import struct
import zlib
from typing import Any, BinaryIO, Optional, Protocol, Union, cast

import numpy as np
import numpy.typing as npt

from . import _core, quant

__all__ = ["ALG_CRC32", "ALG_NAMES", "ALG_XXH3", "BufferLike", "CHUNK", "Crc32", "F16_LE",
           "F32_LE", "Fingerprint", "Hasher", "I8", "KIND_LAYER", "KIND_MODEL", "MAGIC", "Piece",
           "Plan", "READ_VERSIONS", "Reader", "U16_LE", "U8", "VERSION", "WireError", "as_u8",
           "default_algorithm", "digest", "digest_name", "fresh", "hasher", "pad", "to_f32",
           "xxhash_module"]

MAGIC = b"\x89KVCACHE"
VERSION = 3
READ_VERSIONS = (1, 2, 3)           # versions a reader takes (kvcache.wire, "Versions")
KIND_LAYER = 1
KIND_MODEL = 2
ALG_XXH3 = 1
ALG_CRC32 = 2
ALG_NAMES = {ALG_XXH3: "XXH3-64", ALG_CRC32: "CRC-32"}
CHUNK = quant.COPY_CHUNK_BYTES  # bytes copied, then hashed while still in L2, per step

F32_LE = np.dtype("<f4")
F16_LE = np.dtype("<f2")
I8 = np.dtype("i1")
U8 = np.dtype("u1")
U16_LE = np.dtype("<u2")


BufferLike = Union[bytes, bytearray, memoryview, npt.NDArray[Any]]
"""What the readers accept: any C-contiguous bytes-like object."""
Fingerprint = Union[bytes, bytearray, memoryview, str]
"""A fingerprint: bytes, or a str stored as UTF-8."""
Piece = Union[bytes, tuple[npt.NDArray[Any], np.dtype[Any]]]


class Hasher(Protocol):
    """What a digest needs: xxhash's hashers and :class:`Crc32`."""

    def update(self, data: Any) -> None: ...

    def intdigest(self) -> int: ...


class WireError(ValueError):
    """A buffer that is not a valid kvcache buffer for this target (nothing was installed)."""


class Crc32:
    """zlib.crc32 with the update/intdigest interface of xxhash's hashers."""

    def __init__(self) -> None:
        self._v = 0

    def update(self, data: Any) -> None:
        self._v = zlib.crc32(data, self._v)

    def intdigest(self) -> int:
        return self._v


def xxhash_module() -> Any:
    """The ``xxhash`` module, or None when it is not installed."""
    try:
        import xxhash
    except ImportError:
        return None
    return xxhash


def digest_name() -> str:
    """What the digest of a buffer written now is, in words (for show_config)."""
    xxhash = xxhash_module()
    if xxhash is not None:
        return f"XXH3-64 (xxhash {getattr(xxhash, 'VERSION', '?')})"
    return "CRC-32 (zlib; install xxhash for XXH3-64, and to read XXH3 buffers)"


def default_algorithm() -> int:
    """The digest a writer uses: XXH3-64 when ``xxhash`` is installed, else CRC-32."""
    return ALG_XXH3 if xxhash_module() is not None else ALG_CRC32


def hasher(alg: int) -> Hasher:
    """A streaming hasher for algorithm ``alg``: ``update(bytes-like)`` then ``intdigest()``
    gives :func:`digest` of the concatenated updates (the store's entries use it); WireError
    for an algorithm this kvcache cannot compute."""
    if alg == ALG_XXH3:
        xxhash = xxhash_module()
        if xxhash is None:
            raise WireError("the buffer's digest is XXH3-64, which needs the 'xxhash' package "
                            "(pip install xxhash, or the kvcache[wire] extra)")
        hasher: Hasher = xxhash.xxh3_64()
        return hasher
    if alg == ALG_CRC32:
        return Crc32()
    raise WireError(f"unknown digest algorithm {alg} (this kvcache knows "
                    f"{', '.join(f'{k} = {v}' for k, v in ALG_NAMES.items())})")


def digest(alg: int, data: npt.NDArray[np.uint8]) -> int:
    """The digest ``alg`` (:data:`ALG_XXH3` or :data:`ALG_CRC32`) of the bytes ``data`` (a
    uint8 array), hashed in the same steps as a reader does; WireError for an algorithm this
    kvcache cannot compute."""
    h = hasher(alg)
    for i in range(0, len(data), 8 * CHUNK):
        h.update(data[i: i + 8 * CHUNK])
    return h.intdigest()


def pad(n: int) -> int:
    return -n % 8


class Plan:
    """The pieces of a buffer, in order: small ``bytes`` and NumPy arrays written raw
    (as ``dtype``: f32 arrays may be written as f16).  Offsets follow from the sizes."""

    def __init__(self) -> None:
        self.pieces: list[Piece] = []
        self.size = 0

    def raw(self, data: bytes) -> None:
        self.pieces.append(bytes(data))
        self.size += len(data)

    def pack(self, fmt: str, *values: Any) -> None:
        self.raw(struct.pack("<" + fmt, *values))

    def pad8(self) -> None:
        if self.size % 8:
            self.raw(bytes(pad(self.size)))

    def array(self, arr: npt.NDArray[Any], dtype: Optional[npt.DTypeLike] = None,
              pad: bool = True) -> None:
        """Write ``arr`` (any shape, C order) as ``dtype`` (default its own, little-endian),
        then pad to a multiple of 8 unless ``pad`` is False (the legacy layout has no padding)."""
        arr = np.ascontiguousarray(arr)
        dt = np.dtype(dtype or arr.dtype).newbyteorder("<")
        if arr.size:
            self.pieces.append((arr.reshape(-1), dt))
            self.size += arr.size * dt.itemsize
        if pad:
            self.pad8()

    def extend(self, other: Plan) -> None:
        """Append every piece of another plan."""
        self.pieces += other.pieces
        self.size += other.size

    def write_into(self, out: npt.NDArray[np.uint8], hasher: Optional[Hasher] = None) -> int:
        """Copy every piece into ``out`` (uint8, len >= size), hashing what it writes."""
        pos = 0
        for piece in self.pieces:
            if isinstance(piece, bytes):
                n = len(piece)
                out[pos: pos + n] = np.frombuffer(piece, np.uint8)
                if hasher is not None:
                    hasher.update(out[pos: pos + n])
                pos += n
                continue
            src, dtype = piece
            step = max(CHUNK // dtype.itemsize, 1)
            nbytes = src.size * dtype.itemsize
            dst = out[pos: pos + nbytes].view(dtype)
            for i in range(0, src.size, step):
                j = min(i + step, src.size)
                np.copyto(dst[i:j], src[i:j], casting="unsafe")
                if hasher is not None:
                    hasher.update(out[pos + i * dtype.itemsize: pos + j * dtype.itemsize])
            pos += nbytes
        return pos

    def write_file(self, fh: BinaryIO, hasher: Hasher) -> None:
        """Stream every piece to a binary file object, hashing what it writes."""
        buf = np.empty(CHUNK, np.uint8)
        for piece in self.pieces:
            if isinstance(piece, bytes):
                fh.write(piece)
                hasher.update(piece)
                continue
            src, dtype = piece
            step = max(CHUNK // dtype.itemsize, 1)
            for i in range(0, src.size, step):
                j = min(i + step, src.size)
                n = (j - i) * dtype.itemsize
                chunk = buf[:n]
                np.copyto(chunk.view(dtype), src[i:j], casting="unsafe")
                fh.write(chunk.data)
                hasher.update(chunk)


def fresh(n: int) -> tuple[bytes, npt.NDArray[np.uint8]]:
    """A new bytes object of n bytes and a writable uint8 view of it (see _core.fresh_bytes)."""
    b, writer = _core.fresh_bytes(n)
    return b, np.frombuffer(memoryview(writer), np.uint8)


class Reader:
    """Bounds-checked reads from a uint8 array; arrays come back as views (no copy)."""

    def __init__(self, buf: npt.NDArray[np.uint8], start: int = 0, end: Optional[int] = None,
                 what: str = "buffer", version: int = VERSION) -> None:
        self.buf = buf
        self.pos = start
        self.end = len(buf) if end is None else end
        self.what = what
        self.version = version           # the format version of the buffer being read

    def _take(self, n: int, field: str) -> int:
        if n < 0 or self.pos + n > self.end:
            raise WireError(f"{self.what}: truncated: {field} needs {n} bytes at offset "
                            f"{self.pos}, {max(self.end - self.pos, 0)} left")
        p = self.pos
        self.pos += n
        return p

    def unpack(self, fmt: str, field: str) -> tuple[Any, ...]:
        fmt = "<" + fmt
        p = self._take(struct.calcsize(fmt), field)
        return struct.unpack_from(fmt, self.buf.data, p)

    def bytes(self, n: int, field: str) -> bytes:
        p = self._take(n, field)
        return bytes(self.buf[p: p + n])

    def array(self, dtype: npt.DTypeLike, count: int, field: str,
              pad: bool = True) -> npt.NDArray[Any]:
        dtype = np.dtype(dtype)
        if count < 0:
            raise WireError(f"{self.what}: {field}: negative length {count}")
        p = self._take(count * dtype.itemsize, field)
        out = self.buf[p: p + count * dtype.itemsize].view(dtype)
        if pad:
            self.pad8(field)
        return out

    def pad8(self, field: str) -> None:
        n = pad(self.pos)
        if n:
            p = self._take(n, f"padding after {field}")
            if self.buf[p: p + n].any():
                raise WireError(f"{self.what}: non-zero padding after {field} at offset {p}")

    def done(self) -> None:
        if self.pos != self.end:
            raise WireError(f"{self.what}: {self.end - self.pos} unexpected bytes after offset "
                            f"{self.pos}")


def as_u8(buf: object) -> npt.NDArray[np.uint8]:
    try:
        mv = memoryview(cast(Any, buf))       # anything with the buffer protocol
    except TypeError:
        raise TypeError(f"buf: expected a bytes-like object, got {type(buf).__name__}") from None
    if not mv.c_contiguous:
        raise WireError("buf: expected a C-contiguous buffer")
    return np.frombuffer(mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv, np.uint8)


def to_f32(view: npt.NDArray[Any], shape: tuple[int, ...]) -> npt.NDArray[np.float32]:
    """A native float32 copy of a little-endian f32/f16 view, reshaped."""
    return np.array(view, dtype=np.float32).reshape(shape)
