"""The bytes of one stored block: a small versioned header, the block's rows for every layer,
and a digest (the same tables are in docs/formats.md, section "Prefix store entry").

Little-endian on every machine; no pickle.  The digest is kvcache.wire's (:func:`kvcache.wire.
digest`: XXH3-64 when ``xxhash`` is installed, else CRC-32, named by the algorithm byte).
Every array starts at a multiple of 8 bytes from the start of the entry ("pad8": zero bytes up
to the next multiple of 8).

Header (96 bytes)::

    offset size
    0      8    magic 89 4B 56 42 4C 4F 43 4B ("\\x89KVBLOCK")
    8      2    u16 version (1)
    10     1    u8  digest algorithm (kvcache.wire: 1 = XXH3-64, 2 = CRC-32)
    11     1    u8  flags (0; any other value is refused)
    12     4    u32 header length (96)
    16     8    u64 total length of the entry, digest included
    24     32   the block's key (the raw 32-byte hash chain value, kvcache.store.keys)
    56     4    u32 block size B (positions per block)
    60     4    u32 block index i (the block holds positions [i*B, (i+1)*B))
    64     4    u32 n_layers
    68     4    u32 num_kv_heads G
    72     4    u32 head_dim D
    76     1    u8  quant_k (1: keys stored as int8, 2: as 4-bit codes, docs/kv4.md)
    77     1    u8  quant_v (1: values stored as int8, 2: as 4-bit codes, docs/kv4.md)
    78     1    u8  int8 scheme: 0 = F32 or "cmf" (what entries held before the scheme
                    existed), 1 = "rows"
    79     1    u8  reserved (0)
    80     16   fingerprint digest (BLAKE2b-128 of the fingerprint bytes)

Payload, per layer l = 0 .. n_layers-1, each array pad8::

    only when a component is int8 (any q8 mode), the layer's column state:
        u8  x G      kcol_on
        u8  x G      vcol_on
        f32 x G*D    kcol (ones where not frozen)
        f32 x G*D    vcol
    keys    f32: f32 x G*B*D  (head-major: head h's B rows, then head h+1's)
            4-bit: u8 x G*B*D/2 codes (the block layout of docs/kv4.md), then u16 x
                  G*(B/32)*2*D block parameters (B a multiple of 32)
            int8: i8 x G*B*D, then f32 x G*B*ceil(D/g) scales (g: the scheme's K group,
                  16 "rows", 32 "cmf")
    values  f32: f32 x G*B*D
            int8: i8 x G*B*D, then f32 x G*B scales
            4-bit: u8 x G*B*D/2 codes, then u16 x G*B*2*ceil(D/16) float16 steps and minimums
    f32 x B  importance of the block's positions

Trailer: u64 digest of bytes [0, total-8).

The length of an entry follows from its geometry (:func:`entry_size`), so a reader knows what
to expect before it looks at the bytes.  A reader (:func:`check_header`, then the digest in
:func:`decode` or the store's scattered read) checks, in order: the length against a header's,
the magic, the version, the header length, flags and reserved field, the total length against
the value and against the geometry it expects, the key, the fingerprint digest, the geometry,
the mode (quant_k, quant_v and the scheme byte), the block size and the block index against what the caller asked for, and last the
digest.  Any failure raises :class:`EntryError`; nothing is returned for a bad entry.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Optional, Union

import numpy as np
import numpy.typing as npt

from .. import wire
from .._state import LayerState
from .._stores import specs_of
from .keys import Geometry

__all__ = ["EntryError", "MAGIC", "VERSION", "HEADER_SIZE", "DIGEST_SIZE", "Field", "layer_fields",
           "entry_size", "encode", "encode_parts", "check_header", "digest_parts",
           "stored_digest", "decode", "columns_of", "OUTPUT_MAGIC", "OUTPUT_VERSION",
           "OUTPUT_HEADER_SIZE", "OUTPUT_MAX", "encode_output", "decode_output"]

MAGIC = b"\x89KVBLOCK"
VERSION = 1
_HEADER = struct.Struct("<8sHBBIQ32sIIIIIBBBB16s")
HEADER_SIZE = _HEADER.size          # 96
_DIGEST = struct.Struct("<Q")
DIGEST_SIZE = _DIGEST.size

_U8 = np.dtype("u1")
_F32 = np.dtype("<f4")


class EntryError(ValueError):
    """A stored entry that must not be loaded.  ``remove`` is False only when the entry may be
    fine for another reader (a digest this Python cannot compute)."""

    def __init__(self, reason: str, remove: bool = True) -> None:
        super().__init__(reason)
        self.reason = reason
        self.remove = remove


@dataclass(frozen=True)
class Field:
    """One array of a layer's section: its name (a LayerState field, or ``importance``), dtype,
    shape, and byte offset from the start of the layer's section."""

    name: str
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    offset: int
    per: int = 1        # positions per element of axis 1 (4-bit K's block parameters: 32)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def _pad8(n: int) -> int:
    return n + (-n % 8)


@lru_cache(maxsize=64)
def layer_fields(geom: Geometry) -> tuple[tuple[Field, ...], int]:
    """The arrays of one layer's section, in order, and the section's size in bytes."""
    g, d, b = geom.num_kv_heads, geom.head_dim, geom.block
    specs: list[tuple[str, np.dtype[Any], tuple[int, ...], int]] = []
    if not geom.mode.is_f32:
        specs += [("kcol_on", _U8, (g,), 1), ("vcol_on", _U8, (g,), 1),
                  ("kcol", _F32, (g, d), 1), ("vcol", _F32, (g, d), 1)]
    for c, spec in specs_of(geom.mode, d):     # the parts with rows per position
        specs += [(c + p.name, p.dtype.newbyteorder("<"), (g, b // p.per, p.width), p.per)
                  for p in spec.carried]
    specs.append(("importance", _F32, (b,), 1))
    out: list[Field] = []
    off = 0
    for name, dtype, shape, per in specs:
        f = Field(name, dtype, shape, off, per)
        out.append(f)
        off += _pad8(f.nbytes)
    return tuple(out), off


def entry_size(geom: Geometry) -> int:
    """Bytes of one entry of this geometry, header and digest included."""
    return HEADER_SIZE + geom.n_layers * layer_fields(geom)[1] + _DIGEST.size


def _header(geom: Geometry, index: int, key: bytes, fp_digest: bytes, alg: int) -> bytes:
    return _HEADER.pack(MAGIC, VERSION, alg, 0, HEADER_SIZE, entry_size(geom), key, geom.block,
                        index, geom.n_layers, geom.num_kv_heads, geom.head_dim,
                        wire.k_code(geom.mode), wire.v_code(geom.mode), _scheme_byte(geom), 0,
                        fp_digest)


def _scheme_byte(geom: Geometry) -> int:
    """Byte 78 of the header: 1 for the int8 scheme "rows", else 0."""
    return 1 if geom.mode.scheme == "rows" else 0


def encode_parts(geom: Geometry, index: int, key: bytes, fp_digest: bytes,
                 states: list[LayerState]) -> list[memoryview]:
    """The entry of block ``index`` (positions [index*B, (index+1)*B)) of the layers ``states``
    as byte views, in order: the header, each head's rows straight from the layer's storage
    (no copy), the small arrays, the padding and the digest.  ``b"".join`` of them is the entry.

    The states must hold at least those positions on every head (the caller checks)."""
    b = geom.block
    start, stop = index * b, (index + 1) * b
    fields, _ = layer_fields(geom)
    alg = wire.default_algorithm()
    hasher = wire.hasher(alg)
    head = memoryview(_header(geom, index, key, fp_digest, alg))
    parts: list[memoryview] = [head]
    hasher.update(head)
    for st in states:
        for f in fields:
            if f.name == "importance":
                arrs = [st.importance[start:stop]]
            elif len(f.shape) == 3:
                src: npt.NDArray[Any] = getattr(st, f.name)
                arrs = [src[h, start // f.per: stop // f.per] for h in range(geom.num_kv_heads)]
            else:
                arrs = [getattr(st, f.name)]
            for a in arrs:
                view = np.ascontiguousarray(a, dtype=f.dtype).data.cast("B")
                parts.append(view)
                hasher.update(view)
            pad = -f.nbytes % 8
            if pad:
                zeros = memoryview(bytes(pad))
                parts.append(zeros)
                hasher.update(zeros)
    parts.append(memoryview(_DIGEST.pack(hasher.intdigest())))
    return parts


def encode(geom: Geometry, index: int, key: bytes, fp_digest: bytes,
           states: list[LayerState]) -> bytes:
    """The entry of block ``index`` as one ``bytes`` (:func:`encode_parts`, joined)."""
    return b"".join(encode_parts(geom, index, key, fp_digest, states))


def check_header(head: Any, n: int, geom: Geometry, index: int, key: bytes,
                 fp_digest: bytes) -> int:
    """Check the header ``head`` (the first HEADER_SIZE bytes, or all of an entry of ``n``
    bytes) against the entry's length and what the caller asked for; return the digest
    algorithm.  EntryError for anything wrong.  The digest itself is the caller's to check."""
    if n < HEADER_SIZE + _DIGEST.size:
        raise EntryError(f"truncated: {n} bytes, shorter than a header")
    (magic, version, alg, flags, header_len, total, e_key, e_block, e_index, e_layers, e_nkv,
     e_hd, e_qk, e_qv, e_scheme, reserved, e_fp) = _HEADER.unpack_from(head, 0)
    if magic != MAGIC:
        raise EntryError("not a prefix store entry (bad magic)")
    if version != VERSION:
        raise EntryError(f"entry format version {version}, this kvcache reads {VERSION}")
    if header_len != HEADER_SIZE or flags != 0 or reserved != 0:
        raise EntryError("bad header (length, flags or reserved field)")
    if total != n:
        raise EntryError(f"truncated or padded: the header says {total} bytes, the entry has {n}")
    want = entry_size(geom)
    if total != want:
        raise EntryError(f"length {total} bytes, this geometry needs {want}")
    if e_key != key:
        raise EntryError("stored under another key")
    if e_fp != fp_digest:
        raise EntryError("another fingerprint")
    if (e_layers, e_nkv, e_hd) != (geom.n_layers, geom.num_kv_heads, geom.head_dim):
        raise EntryError(f"geometry {e_layers}x{e_nkv}x{e_hd}, expected "
                         f"{geom.n_layers}x{geom.num_kv_heads}x{geom.head_dim}")
    if ((e_qk, e_qv) != (wire.k_code(geom.mode), wire.v_code(geom.mode))
            or e_scheme != _scheme_byte(geom)):
        raise EntryError("another KV mode")
    if (e_block, e_index) != (geom.block, index):
        raise EntryError(f"block {e_index} of size {e_block}, expected block {index} of size "
                         f"{geom.block}")
    return int(alg)


def digest_parts(alg: int, parts: Sequence[memoryview]) -> int:
    """The digest ``alg`` of the concatenated ``parts`` (as :func:`kvcache.wire.digest` of
    their join); EntryError for an algorithm this Python cannot compute."""
    if alg == wire.ALG_XXH3 and wire.default_algorithm() != wire.ALG_XXH3:
        raise EntryError("the entry's digest is XXH3-64, which needs the 'xxhash' package",
                         remove=False)
    if alg not in (wire.ALG_XXH3, wire.ALG_CRC32):
        raise EntryError(f"unknown digest algorithm {alg}")
    hasher = wire.hasher(alg)
    for p in parts:
        hasher.update(p)
    return int(hasher.intdigest())


def stored_digest(buf: Any, n: int) -> int:
    """The digest stored in the last 8 bytes of an ``n``-byte entry ``buf``."""
    return int(_DIGEST.unpack_from(buf, n - _DIGEST.size)[0])


def decode(value: Union[bytes, memoryview], geom: Geometry, index: int, key: bytes,
           fp_digest: bytes) -> list[dict[str, npt.NDArray[Any]]]:
    """Check ``value`` as the entry of block ``index`` with ``key`` and return, per layer, its
    arrays by field name (read-only views into ``value``).  EntryError for anything wrong."""
    n = len(value)
    alg = check_header(value, n, geom, index, key, fp_digest)
    data: npt.NDArray[np.uint8] = np.frombuffer(value, dtype=np.uint8)
    if digest_parts(alg, [memoryview(value)[: n - _DIGEST.size]]) != stored_digest(value, n):
        raise EntryError("digest mismatch (corrupted entry)")
    fields, section = layer_fields(geom)
    out: list[dict[str, npt.NDArray[Any]]] = []
    base = HEADER_SIZE
    for _ in range(geom.n_layers):
        arrays: dict[str, npt.NDArray[Any]] = {}
        for f in fields:
            lo = base + f.offset
            arrays[f.name] = data[lo: lo + f.nbytes].view(f.dtype).reshape(f.shape)
        base += section
        out.append(arrays)
    return out


def columns_of(arrays: dict[str, npt.NDArray[Any]]) -> Optional[bytes]:
    """The column state of one decoded layer as bytes (None in f32 mode), for comparisons."""
    if "kcol_on" not in arrays:
        return None
    return b"".join(arrays[name].tobytes() for name in ("kcol_on", "vcol_on", "kcol", "vcol"))


# --------------------------------------------------------------------- a prefix's output
#: Magic of an output entry: the vector a model driver computed after a stored prefix (the
#: runner's final hidden row), kept under a key derived from the prefix's last block key.
OUTPUT_MAGIC = b"\x89KVOUTPT"
OUTPUT_VERSION = 1
#: Most float32 values an output entry holds (64 MiB): a hidden row, or a row of logits.
OUTPUT_MAX = 1 << 24
_OUTPUT = struct.Struct("<8sHBBIQ32sII16s")
OUTPUT_HEADER_SIZE = _OUTPUT.size        # 80


def encode_output(key: bytes, fp_digest: bytes, values: npt.NDArray[np.float32]) -> bytes:
    """The output entry of the prefix whose last block key is ``key`` (stored under
    :func:`kvcache.store.keys.output_key` of it and the count): an 80-byte header
    (magic, version, digest algorithm, flags 0, header length, total length, ``key``, the
    count of values, a reserved 0, the fingerprint digest), ``values`` as little-endian
    float32, zero padding to a multiple of 8 and the digest of everything before it."""
    data = np.ascontiguousarray(values, dtype=_F32).tobytes()
    pad = -len(data) % 8
    total = OUTPUT_HEADER_SIZE + len(data) + pad + _DIGEST.size
    alg = wire.default_algorithm()
    body = _OUTPUT.pack(OUTPUT_MAGIC, OUTPUT_VERSION, alg, 0, OUTPUT_HEADER_SIZE, total, key,
                        values.shape[0], 0, fp_digest) + data + bytes(pad)
    return body + _DIGEST.pack(digest_parts(alg, [memoryview(body)]))


def decode_output(value: bytes, key: bytes, fp_digest: bytes,
                  count: int) -> npt.NDArray[np.float32]:
    """Check ``value`` as the output entry after the prefix whose last block key is ``key``,
    holding ``count`` values, and return
    them (a new float32 array).  EntryError for anything wrong, checked in the order of
    :func:`check_header`: length, magic, version, header, total, key, fingerprint, count,
    digest."""
    n = len(value)
    if n < OUTPUT_HEADER_SIZE + _DIGEST.size:
        raise EntryError(f"truncated: {n} bytes, shorter than a header")
    (magic, version, alg, flags, header_len, total, e_key, e_count, reserved,
     e_fp) = _OUTPUT.unpack_from(value, 0)
    if magic != OUTPUT_MAGIC:
        raise EntryError("not a prefix store output entry (bad magic)")
    if version != OUTPUT_VERSION:
        raise EntryError(f"output entry format version {version}, this kvcache reads "
                         f"{OUTPUT_VERSION}")
    if header_len != OUTPUT_HEADER_SIZE or flags != 0 or reserved != 0:
        raise EntryError("bad header (length, flags or reserved field)")
    if total != n:
        raise EntryError(f"truncated or padded: the header says {total} bytes, the entry has {n}")
    if e_key != key:
        raise EntryError("stored under another key")
    if e_fp != fp_digest:
        raise EntryError("another fingerprint")
    want = OUTPUT_HEADER_SIZE + _pad8(4 * count) + _DIGEST.size
    if e_count != count or total != want:
        raise EntryError(f"{e_count} values in {total} bytes, expected {count}")
    if digest_parts(alg, [memoryview(value)[: n - _DIGEST.size]]) != stored_digest(value, n):
        raise EntryError("digest mismatch (corrupted entry)")
    return np.frombuffer(value, dtype=_F32, count=count,
                         offset=OUTPUT_HEADER_SIZE).astype(np.float32)
