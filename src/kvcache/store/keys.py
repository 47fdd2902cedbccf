"""Block keys of the prefix store: a hash chain over a prompt's token ids (docs/store.md).

A prompt is cut into blocks of ``block`` token ids.  Block i's key is

    h(-1) = BLAKE2b-256(person="kvcache-prefix1", "root" record)
    h(i)  = BLAKE2b-256(person="kvcache-prefix1", h(i-1) || ids of block i as little-endian i64)

where the root record packs the store format version, the fingerprint (its length, then its
bytes), the KV mode (quant_k, quant_v: 0 float32, 1 int8, 2 4-bit each), the geometry (n_layers, num_kv_heads, head_dim) and
the block size, followed, for a mode in the int8 scheme "rows", by the 8 bytes ``b"scheme=r"``
(a mode in the legacy scheme "cmf" or F32 adds nothing, so keys written before the scheme
existed -- which were all "cmf" -- still match).  A key therefore depends on every id before the end of its block and on
everything that decides what the rows are: a key never matches another model, mode, geometry,
block size or history.  The backend sees the key as 64 lowercase hex digits.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from .._stores import kind_of
from .._validate import as_token_ids
from ..modes import KvMode

__all__ = ["Geometry", "as_ids", "as_fingerprint", "block_keys", "fingerprint_digest",
           "output_key", "KEY_BYTES"]

KEY_BYTES = 32
_PERSON = b"kvcache-prefix1"
_ROOT = struct.Struct("<4sHI")          # b"root", version, fingerprint length
_SHAPE = struct.Struct("<BBIIII")       # quant_k, quant_v, n_layers, nkv, head_dim, block
_VERSION = 1
_ROWS = b"scheme=r"                    # appended to the root record for the int8 scheme "rows"


@dataclass(frozen=True)
class Geometry:
    """What a stored block's rows depend on besides the ids: the mode, the shape and the block
    size (the fingerprint travels next to it)."""

    n_layers: int
    num_kv_heads: int
    head_dim: int
    mode: KvMode
    block: int


def as_fingerprint(value: object) -> bytes:
    """The fingerprint as bytes (a str as UTF-8); TypeError for anything else, ValueError for
    an empty one."""
    if isinstance(value, str):
        out = value.encode("utf-8")
    elif isinstance(value, (bytes, bytearray, memoryview)):
        out = bytes(value)
    else:
        raise TypeError(f"fingerprint: expected str or bytes identifying the model and its "
                        f"weights, got {type(value).__name__}")
    if not out:
        raise ValueError("fingerprint: expected a non-empty str or bytes")
    return out


def fingerprint_digest(fp: bytes) -> bytes:
    """16 bytes naming the fingerprint inside an entry's header."""
    return hashlib.blake2b(fp, digest_size=16, person=_PERSON).digest()


def as_ids(ids: object) -> npt.NDArray[np.int64]:
    """Token ids as a 1-D little-endian int64 array, an empty sequence allowed
    (:func:`kvcache._validate.as_token_ids`, the validator the runner and kvcache.hf share)."""
    return as_token_ids(ids, allow_empty=True)


def _root(fp: bytes, geom: Geometry) -> bytes:
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=_PERSON)
    h.update(_ROOT.pack(b"root", _VERSION, len(fp)))
    h.update(fp)
    k_code, v_code = kind_of("k", geom.mode).code, kind_of("v", geom.mode).code
    h.update(_SHAPE.pack(k_code, v_code, geom.n_layers,
                         geom.num_kv_heads, geom.head_dim, geom.block))
    if geom.mode.scheme == "rows":
        h.update(_ROWS)
    return h.digest()


def block_keys(ids: npt.NDArray[np.int64], fp: bytes, geom: Geometry) -> list[bytes]:
    """The raw 32-byte keys of every full block of ``ids`` (an :func:`as_ids` array), in order."""
    b = geom.block
    n = ids.shape[0] // b
    prev = _root(fp, geom)
    raw = ids[: n * b].tobytes()
    step = b * 8
    out: list[bytes] = []
    for i in range(n):
        h = hashlib.blake2b(prev, digest_size=KEY_BYTES, person=_PERSON)
        h.update(raw[i * step: (i + 1) * step])
        prev = h.digest()
        out.append(prev)
    return out


def output_key(key: bytes, count: int) -> bytes:
    """The key of the output of ``count`` values stored after the prefix whose last block key
    is ``key``: BLAKE2b-256(person="kvcache-prefix1", key || b"output" || u32 count), so it
    depends on everything the block key does, never equals a block key, and outputs of other
    lengths after the same prefix (another driver's) never share it."""
    return hashlib.blake2b(key + b"output" + struct.pack("<I", count), digest_size=KEY_BYTES,
                           person=_PERSON).digest()
