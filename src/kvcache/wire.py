"""Byte formats of kvcache: the legacy wire layout and the versioned, checksummed format.

Both are little-endian on every machine.  Nothing here uses pickle: a buffer is parsed field by
field, every length is checked against the bytes actually present before anything is
allocated, and nothing is installed into a cache until the whole buffer has been validated.
Every bad buffer raises :class:`WireError` (a ValueError) saying what is wrong.

The same layouts, with the reasoning behind them, are in docs/formats.md.  Layers are read and
installed through their state object (:class:`kvcache._state.LayerState`), never through
their fields.

The legacy layout (``export_wire`` / ``import_wire``) is laid out in :mod:`kvcache._wire_legacy`;
the constants, digests, writer and reader both formats use are in :mod:`kvcache._wire_io`.
This module re-exports what callers use of them.

Versioned format (``to_bytes`` / ``from_bytes`` / ``install_bytes``, ``KvCache.save`` / ``load``)
-------------------------------------------------------------------------------------------------
A buffer is a header, a body, and an 8-byte digest of every byte before it::

    offset size
    0      8    magic  89 4B 56 43 41 43 48 45  ("\\x89KVCACHE": the high bit catches 7-bit
                                                 channels, the text catches mix-ups)
    8      2    u16 format version (3; a reader also takes 2 and 1, see "Versions" below)
    10     1    u8  kind: 1 = one LayerKvCache, 2 = a KvCache (every layer of a model)
    11     1    u8  digest algorithm: 1 = XXH3-64 (``xxhash``), 2 = CRC-32 (``zlib``, zero-extended)
    12     4    u32 flags (0; any other value is refused)
    16     8    u64 total length of the buffer in bytes, digest included
    24     4    u32 fingerprint length F (0: none)
    28     F    fingerprint bytes (a str is stored as UTF-8)
    28+F        zero padding to a multiple of 8
    ...         body (below)
    L-8    8    u64 digest of bytes [0, L-8)

Every array below starts at a multiple of 8 from the start of the buffer ("pad8": zero bytes up
to the next multiple of 8).  Floats are IEEE binary32 ("f32") unless the layer body's f16 flag
is set, in which case the float K/V rows (only those) are binary16.

Layer body (kind 1; also each layer of a model body)::

    u32 num_kv_heads G, u32 head_dim D
    u8  quant_k, u8 quant_v          (1: that component is stored as int8; 2: 4-bit,
                                      version 3 only)
    u8  o1 state                     (0 none, 1 collecting, 2 sealed)
    u8  f16                          (1: float K/V rows are binary16)
    u8  scheme                       (int8 scheme: 0 none (F32), 1 "rows", 2 "cmf")
    u8  reserved (0), u16 reserved (0)
    u64 seq_len, u64 imp_len, u64 n_linear_state, u64 n_linear_scratch
    u64 x G  head_len[h]
    u8 x G   kcol_on[h],  u8 x G  vcol_on[h],  pad8
    f32 x G*D  kcol (rows of ones where not frozen), pad8
    f32 x G*D  vcol, pad8
    f32 x imp_len importance, pad8
    f32 x n_linear_state, pad8
    f32 x n_linear_scratch, pad8
    per head h: keys   float: f32|f16 x head_len*D, pad8
                       4-bit: u8 x Q*D/2 codes (block layout), pad8, u16 x (Q/32)*2*D
                              block parameters, pad8, f32 x R*D the ring's rows
                              [head_len - R, head_len) in order, pad8
                              (Q = 32 * floor(head_len / 32), R = min(head_len, 64);
                              docs/kv4.md)
                       int8:  i8 x head_len*D, pad8, f32 x head_len*ceil(D/g) scales, pad8
                              (g: the K group of the scheme, 16 "rows", 32 "cmf")
                values float: f32|f16 x head_len*D, pad8
                       int8:  i8 x head_len*D, pad8, f32 x head_len scales, pad8
                       4-bit: u8 x head_len*D/2 codes, pad8, u16 x head_len*2*ceil(D/16)
                              float16 steps and minimums (as their bits), pad8
                              (docs/kv4.md; D a multiple of 8)
    o1 collecting:  u32 m, u32 w, u32 sink, u32 rect (0 aggregate, 1 fm), u64 trace floats T,
                    f32 x T trace, pad8 (only with the seal's default keep=0 and ridge; a
                    layer collecting with other values is refused: seal it first)
    o1 sealed:      u32 num_heads H, u32 m, u32 w, u32 sink, u32 rect, u32 exact_only,
                    u32 m_eff M, u32 sink_len S, u64 window rows R (w, or win_len when
                    exact-only), u64 win_len, u64 win_head, u64 far_len, then f32 arrays, each
                    pad8: win_k (G,R,D), win_v (G,R,D), sink_k (G,S,D), sink_v (G,S,D),
                    k_tilde (G,M,D), q_tilde (H,M,D), mu (H,M,M), t_hat (H,M,D), z_hat (H,M),
                    m_max (H,M)

Model body (kind 2)::

    u32 n_layers, u32 num_kv_heads, u32 head_dim
    u8  quant_k, u8 quant_v          (the KvCache's mode for new layers; quant_v as in a layer)
    u8  policy (0 recent, 1 born), u8 scheme (as in a layer body)
    u64 policy sink (kept for both kinds), u64 max_seq_len
    per layer: u64 body length, then the layer body (its length is a multiple of 8)

Versions.  Version 3 (written since 4-bit storage exists) is version 2 with one more value of
the quant_k and quant_v bytes: 2, 4-bit rows, stored as above.  Version 2 records the int8
scheme (:attr:`KvMode.scheme`) in the scheme bytes above; a layer without an int8 component
writes 0 there, one with int8 rows 1 ("rows") or 2 ("cmf"), and any other combination is
refused.  Version 1 (kvcache before the scheme existed) had zeros in those bytes (a u32 reserved
field in the layer body, a u8 reserved field in the model body) and knew only the column-freeze
scheme: a reader takes a version-1 buffer as it was written, its int8 rows in scheme "cmf".  A
writer always writes version 3; version 2 and 1 buffers are still read (they cannot hold 4-bit
rows).  The scheme byte also decides how many K scales a stored int8 row has (``ceil(D / 16)``
for "rows", ``ceil(D / 32)`` for "cmf" and every version-1 buffer).

Import verifies, in order: the minimum length, the magic, the version, the total length field
against the buffer (truncated / trailing bytes), the flags, the digest algorithm, the digest,
the kind, the fingerprint (when the caller gives one: it must equal the stored one, and a
buffer without one does not match), then every field of the body against the target and
against the body's own invariants.  Row bytes must be present before storage is allocated, and
a body may not make the reader allocate more than 64 times its own size (plus 16 MiB).
``KvCache.load`` reads the file into memory first (no memory map: see ``load_model``).  The digest is XXH3-64 when the ``xxhash`` package is installed (measured fastest:
see ``python -m kvcache bench --sections wire``), else zlib's CRC-32; a reader needs the
algorithm the writer used and says which package to install when it lacks it.
"""

from __future__ import annotations

import os
import struct
import uuid
from typing import TYPE_CHECKING, Any, Optional, TypeVar, Union

import numpy as np
import numpy.typing as npt

from ._state import LayerState, scheme_conflict
from ._stores import kind_of, specs_of
from ._wire_io import (ALG_CRC32, ALG_NAMES as _ALG_NAMES, ALG_XXH3,
                       F16_LE as _F16, F32_LE as _F32, KIND_LAYER, KIND_MODEL, MAGIC,
                       READ_VERSIONS, VERSION, BufferLike, Fingerprint,
                       Hasher, Plan as _Plan, Reader as _Reader, WireError,
                       as_u8 as _as_u8, default_algorithm, digest, digest_name, fresh as _fresh,
                       hasher, pad as _pad, to_f32 as _f32)
from ._wire_legacy import export_wire, import_wire
from .eviction import EvictionPolicy
from .modes import KvMode
from .o1 import EXACT_EXTRA, RIDGE, O1Collecting, O1Rect, O1Sealed

if TYPE_CHECKING:
    from .layer import LayerKvCache
    from .model import KvCache

__all__ = ["WireError", "MAGIC", "VERSION", "READ_VERSIONS", "KIND_LAYER", "KIND_MODEL", "ALG_XXH3", "ALG_CRC32",
           "default_algorithm", "digest", "digest_name", "hasher", "Hasher", "BufferLike",
           "Fingerprint", "export_wire", "import_wire"]








_HEADER_FIXED = 28
_MAX_FINGERPRINT = 1 << 16
MAX_POSITIONS = 1 << 48          # larger seq_len / far_len values are refused as implausible
_ALLOC_FACTOR = 64               # a layer body may not make the reader allocate more than this
_ALLOC_SLACK = 16 << 20          # many times its own size (plus this), e.g. through dead heads










_Path = Union[str, "os.PathLike[str]"]
_Model = TypeVar("_Model", bound="KvCache")






# ---------------------------------------------------------------------------------- digests














# ---------------------------------------------------------------------------------- writing






def _header(plan: _Plan, kind: int, alg: int, fp: bytes, total: int) -> None:
    plan.raw(MAGIC)
    plan.pack("HBBIQI", VERSION, kind, alg, 0, total, len(fp))
    plan.raw(fp)
    plan.pad8()


def _header_size(fp: bytes) -> int:
    n = _HEADER_FIXED + len(fp)
    return n + _pad(n)


def _as_fingerprint(fingerprint: object) -> Optional[bytes]:
    if fingerprint is None:
        return None
    if isinstance(fingerprint, str):
        fp = fingerprint.encode("utf-8")
    elif isinstance(fingerprint, (bytes, bytearray, memoryview)):
        fp = bytes(fingerprint)
    else:
        raise TypeError(f"fingerprint: expected bytes or str, got {type(fingerprint).__name__}")
    if len(fp) > _MAX_FINGERPRINT:
        raise ValueError(f"fingerprint: expected at most {_MAX_FINGERPRINT} bytes, got {len(fp)}")
    return fp


def _framed(body: _Plan, kind: int, fingerprint: Optional[Fingerprint]) -> tuple[_Plan, int]:
    """The header and ``body`` as one plan (the digest follows it), and the digest algorithm."""
    fp = _as_fingerprint(fingerprint) or b""
    alg = default_algorithm()
    plan = _Plan()
    _header(plan, kind, alg, fp, _header_size(fp) + body.size + 8)
    plan.extend(body)
    return plan, alg


def _finish(body: _Plan, kind: int, fingerprint: Optional[Fingerprint]) -> bytes:
    """bytes of a whole buffer: header + body plan + digest."""
    plan, alg = _framed(body, kind, fingerprint)
    out_bytes, out = _fresh(plan.size + 8)
    h = hasher(alg)
    pos = plan.write_into(out, h)
    out[pos: pos + 8] = np.frombuffer(struct.pack("<Q", h.intdigest()), np.uint8)
    del out
    return out_bytes


def _save(path: _Path, body: _Plan, kind: int, fingerprint: Optional[Fingerprint]) -> None:
    """Write header + body + digest to ``path`` atomically (temp file, fsync, rename)."""
    plan, alg = _framed(body, kind, fingerprint)
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{uuid.uuid4().hex[:12]}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as fh:
            h = hasher(alg)
            plan.write_file(fh, h)
            fh.write(struct.pack("<Q", h.intdigest()))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:  # make the rename itself durable (best effort: not every platform can open a folder)
        dfd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


# ---------------------------------------------------------------------------------- reading




def _open(buf: object, kind: int, fingerprint: Optional[Fingerprint]) -> _Reader:
    """Verify the header and the digest of a versioned buffer; return a reader at its body."""
    fp_want = _as_fingerprint(fingerprint)
    u8 = _as_u8(buf)
    n = len(u8)
    if n < _HEADER_FIXED + 8:
        raise WireError(f"truncated: {n} bytes, a kvcache buffer has at least {_HEADER_FIXED + 8}")
    if bytes(u8[:8]) != MAGIC:
        raise WireError(f"not a kvcache buffer (magic {bytes(u8[:8])!r}, expected {MAGIC!r}); "
                        "a legacy export_wire buffer goes to import_wire")
    version, kind_got, alg, flags, total, fp_len = struct.unpack_from("<HBBIQI", u8.data, 8)
    if version not in READ_VERSIONS:
        raise WireError(f"unsupported format version {version} (this kvcache reads versions "
                        f"{', '.join(map(str, READ_VERSIONS))})")
    if total != n:
        what = "truncated" if n < total else "trailing bytes"
        raise WireError(f"{what}: the header says {total} bytes, the buffer has {n}")
    if flags != 0:
        raise WireError(f"unsupported flags 0x{flags:08x} (version {version} defines none)")
    stored = struct.unpack_from("<Q", u8.data, n - 8)[0]
    if digest(alg, u8[: n - 8]) != stored:
        raise WireError(f"checksum mismatch: the buffer is corrupted ({_ALG_NAMES[alg]} of its "
                        f"{n - 8} bytes does not match the stored digest)")
    if kind_got != kind:
        names = {KIND_LAYER: "one LayerKvCache", KIND_MODEL: "a whole KvCache"}
        raise WireError(f"the buffer holds {names.get(kind_got, f'kind {kind_got}')}, expected "
                        f"{names[kind]}")
    rd = _Reader(u8, _HEADER_FIXED, n - 8, version=version)
    fp = rd.bytes(fp_len, "fingerprint")
    rd.pad8("fingerprint")
    if fp_want is not None and fp != fp_want:
        got = "no fingerprint" if not fp else f"fingerprint {fp[:64]!r}"
        raise WireError(f"fingerprint mismatch: the buffer carries {got}, expected {fp_want[:64]!r} "
                        "(it was made for another model or configuration)")
    return rd


# ---------------------------------------------------------------------------------- layer body
def layer_plan(layer: LayerKvCache, f16: bool = False) -> _Plan:
    """The body pieces of one layer (layout: the module docstring), read through the layer's
    state object (no copies)."""
    return state_plan(layer.state(), f16)


def state_plan(st: LayerState, f16: bool = False) -> _Plan:
    """The body pieces of one layer state (layout: the module docstring)."""
    f16 = bool(f16)
    nkv, hd = st.num_kv_heads, st.head_dim
    mode = st.mode
    o1 = st.o1
    o1_kind = 2 if isinstance(o1, O1Sealed) else 1 if isinstance(o1, O1Collecting) else 0
    lens = st.lengths
    scratch = st.linear_scratch if st.linear_scratch is not None else np.zeros(0, np.float32)
    plan = _Plan()
    plan.pack("IIBBBBBBH", nkv, hd, k_code(mode), v_code(mode), o1_kind, int(f16),
              scheme_code(mode), 0, 0)
    plan.pack("QQQQ", st.seq_len, st.importance.size, st.linear_state.size, scratch.size)
    plan.pack(f"{nkv}Q", *[int(x) for x in lens])
    plan.raw(st.kcol_on.astype(np.uint8).tobytes() + st.vcol_on.astype(np.uint8).tobytes())
    plan.pad8()
    plan.array(st.kcol, _F32)
    plan.array(st.vcol, _F32)
    plan.array(st.importance, _F32)
    plan.array(st.linear_state, _F32)
    plan.array(scratch, _F32)
    stores = st.stores()
    specs = specs_of(st.mode, hd)
    # each part's rows that its kind carries, per head, in layout order
    parts = [(stores[c + p.name], _F16 if f16 and p.halves else p.dtype)
             for c, spec in specs for p in spec.parts]
    for h, n in enumerate(lens.tolist()):
        sels = [sel for _, spec in specs for sel in spec.head_rows(n)]
        for (arr, dtype), sel in zip(parts, sels):
            plan.array(arr[h, sel], dtype)
    if isinstance(o1, O1Collecting):
        if o1.keep != 0 or o1.ridge != RIDGE:
            raise ValueError(f"to_bytes: this layer collects for an O(1) seal with keep="
                             f"{o1.keep}, ridge={o1.ridge:g}, which format version {VERSION} "
                             f"cannot carry (only the defaults keep=0, ridge={RIDGE:g}); seal "
                             f"it first (a sealed state carries everything)")
        trace = o1.trace
        plan.pack("IIIIQ", o1.m, o1.w, o1.sink, int(o1.rect is O1Rect.FM), trace.size)
        plan.array(trace, _F32)
    elif isinstance(o1, O1Sealed):
        rows = o1.win_len if o1.exact_only else o1.w
        plan.pack("IIIIIIIIQQQQ", o1.num_heads, o1.m, o1.w, o1.sink, int(o1.rect is O1Rect.FM),
                  int(o1.exact_only), o1.m_eff, o1.sink_len, rows, o1.win_len, o1.win_head,
                  o1.far_len)
        plan.array(o1.win_k[:, :rows], _F32)
        plan.array(o1.win_v[:, :rows], _F32)
        for name in _SEALED_FIXED:
            plan.array(getattr(o1, name), _F32)
    return plan


_SEALED_FIXED = ("sink_k", "sink_v", "k_tilde", "q_tilde", "mu", "t_hat", "z_hat", "m_max")


SCHEME_CODES = {"": 0, "rows": 1, "cmf": 2}
"""The scheme byte of a version-2 body: 0 for a mode without int8 rows (F32)."""
_SCHEME_NAMES = {code: name for name, code in SCHEME_CODES.items()}


def scheme_code(mode: KvMode) -> int:
    """The scheme byte a version-2 or -3 body writes for ``mode``."""
    return SCHEME_CODES[mode.scheme]


def v_code(mode: KvMode) -> int:
    """The quant_v byte a body writes for ``mode``: 0 float32, 1 int8, 2 4-bit (version 3):
    the code of V's storage kind (:attr:`kvcache._stores.RowStore.code`)."""
    return kind_of("v", mode).code


def k_code(mode: KvMode) -> int:
    """The quant_k byte a body writes for ``mode``: 0 float32, 1 int8, 2 4-bit (version 3):
    the code of K's storage kind."""
    return kind_of("k", mode).code


def _mode(qk: int, qv: int, code: int, version: int) -> KvMode:
    """The KvMode of a body's quant_k / quant_v flags and scheme byte (``code``; always 0 in
    version 1, whose int8 rows are in scheme "cmf"); WireError for a scheme byte that does not
    fit the flags.  A byte 2 (4-bit, version 3 only) was checked by the caller."""
    if qv == 2 or qk == 2:
        int8 = qk == 1 or qv == 1
        name = _SCHEME_NAMES.get(code)
        if name is None or bool(name) != int8:
            raise WireError(f"invalid int8 scheme byte {code} for quant_k={qk} quant_v={qv} "
                            f"(expected {'1 (rows) or 2 (cmf)' if int8 else '0'})")
        bits = {0: 32, 1: 8, 2: 4}
        try:
            return KvMode.of(bits[qk], bits[qv], name or "rows")
        except ValueError as exc:
            raise WireError(str(exc)) from None
    quantised = bool(qk or qv)
    if version == 1:
        if code:
            raise WireError(f"invalid reserved field {code} (format version 1)")
        scheme = "cmf"
    else:
        name = _SCHEME_NAMES.get(code)
        if name is None or bool(name) != quantised:
            raise WireError(f"invalid int8 scheme byte {code} for quant_k={qk} quant_v={qv} "
                            f"(expected {'1 (rows) or 2 (cmf)' if quantised else '0'})")
        scheme = name
    return KvMode.Q8(k=bool(qk), v=bool(qv), scheme=scheme) if quantised else KvMode.F32




def _count(rows: Union[slice, npt.NDArray[np.intp]]) -> int:
    """How many rows a :meth:`RowStore.head_rows` index selects."""
    return rows.stop - rows.start if isinstance(rows, slice) else int(rows.size)


def parse_layer(rd: _Reader, num_kv_heads: Optional[int] = None,
                head_dim: Optional[int] = None) -> LayerState:
    """Parse and validate one layer body; return an owned state for
    ``LayerKvCache.install``."""
    nkv, hd, qk, qv, o1_kind, f16, code, res8, res16 = rd.unpack("IIBBBBBBH", "layer geometry")
    reserved = res8 | res16
    if num_kv_heads is not None and (nkv, hd) != (num_kv_heads, head_dim):
        raise WireError(f"geometry mismatch: the buffer holds {nkv}×{hd} per position "
                        f"(num_kv_heads×head_dim), this layer is {num_kv_heads}×{head_dim}")
    if nkv < 1 or hd < 1 or nkv > 1 << 20 or hd > 1 << 20:
        raise WireError(f"impossible geometry num_kv_heads={nkv}, head_dim={hd}")
    max_q = 2 if rd.version >= 3 else 1
    if qk > max_q or qv > max_q or o1_kind > 2 or f16 > 1 or reserved:
        raise WireError(f"invalid layer flags quant_k={qk} quant_v={qv} o1={o1_kind} f16={f16} "
                        f"reserved={reserved}")
    if 2 in (qk, qv) and hd % 8:
        raise WireError(f"4-bit rows need head_dim to be a multiple of 8, got {hd}")
    mode = _mode(qk, qv, code, rd.version)
    specs = specs_of(mode, hd)
    budget = _ALLOC_FACTOR * (rd.end - rd.pos) + _ALLOC_SLACK
    seq_len, imp_len, n_lin, n_scr = rd.unpack("QQQQ", "layer lengths")
    if seq_len > MAX_POSITIONS:
        raise WireError(f"implausible seq_len={seq_len} (more than 2**48 positions)")
    raw_lens = rd.unpack(f"{nkv}Q", "head lengths")
    if max(raw_lens, default=0) > seq_len:
        raise WireError(f"a head holds more rows ({max(raw_lens)}) than seq_len={seq_len}")
    lens = np.array(raw_lens, dtype=np.intp)
    cols = rd.array(np.uint8, 2 * nkv, "column flags")
    kcol_on, vcol_on = cols[:nkv].copy(), cols[nkv:].copy()
    if (cols > 1).any():
        raise WireError("invalid column flags (expected 0 or 1)")
    if (kcol_on.any() and qk != 1) or (vcol_on.any() and qv != 1):
        raise WireError("frozen columns on a component not stored as int8")
    if cols.any() and not mode.freezes_columns:
        raise WireError(f"frozen columns in int8 scheme {mode.scheme!r}, which never freezes one")
    if o1_kind == 2:
        if imp_len != 0 or lens.any() or qk or qv:   # (any 4-bit component too)
            raise WireError("a sealed O(1) layer holds no KV rows and no importance, in F32 mode")
    elif imp_len > seq_len:
        raise WireError(f"importance covers {imp_len} positions, more than seq_len={seq_len}")
    kcol = _f32(rd.array(_F32, nkv * hd, "kcol"), (nkv, hd))
    vcol = _f32(rd.array(_F32, nkv * hd, "vcol"), (nkv, hd))
    for name, col, on in (("kcol", kcol, kcol_on), ("vcol", vcol, vcol_on)):
        if not (col[on == 0] == 1.0).all():
            raise WireError(f"{name}: a column field that is not frozen must be all ones")
    imp = _f32(rd.array(_F32, imp_len, "importance"), (imp_len,))
    lin = _f32(rd.array(_F32, n_lin, "linear_state"), (n_lin,))
    scr = _f32(rd.array(_F32, n_scr, "linear_scratch"), (n_scr,))
    # the parts a head's rows are read into, in order: (state field, part, dtype as stored,
    # label) -- float32 rows as float16 when the body says so
    parts = [(c + p.name, p, _F16 if f16 and p.halves else p.dtype.newbyteorder("<"),
              p.what.format("key" if c == "k" else "value"))
             for c, spec in specs for p in spec.parts]
    # the rows must be present before storage for them is allocated (a crafted header must
    # not make us allocate what the buffer does not hold)
    rows_of = {int(n): tuple(sel for _, spec in specs for sel in spec.head_rows(int(n)))
               for n in set(lens.tolist())}
    need = 0
    for n in lens.tolist():
        for (_, part, dtype, _), sel in zip(parts, rows_of[n]):
            size = dtype.itemsize * _count(sel) * part.width
            need += size + _pad(size)
    if need > rd.end - rd.pos:
        raise WireError(f"{rd.what}: truncated: the head lengths {lens.tolist()} need {need} bytes "
                        f"of rows, {rd.end - rd.pos} left")
    cap = int(lens.max(initial=0))
    store_bytes = nkv * cap * sum(spec.row_bytes for _, spec in specs)
    if store_bytes > budget:
        raise WireError(f"{rd.what}: {nkv} heads of up to {cap} rows would need {store_bytes} bytes "
                        f"of storage, more than {_ALLOC_FACTOR}x the buffer; refused")
    arrays: dict[str, npt.NDArray[Any]] = {
        name: np.zeros((nkv, part.rows(cap), part.width), part.dtype)
        for name, part, _, _ in parts}
    for h, n in enumerate(lens.tolist()):
        for (name, part, dtype, what), sel in zip(parts, rows_of[n]):
            count = _count(sel)
            got = rd.array(dtype, count * part.width, f"head {h} {what}")
            arrays[name][h, sel] = got.reshape(count, part.width)
    o1: Union[O1Collecting, O1Sealed, None] = None
    if o1_kind == 1:
        m, w, sink, rect, tlen = rd.unpack("IIIIQ", "O(1) collecting parameters")
        if m < 4 or w < 1 or rect > 1:
            raise WireError(f"invalid O(1) parameters m={m} w={w} rect={rect}")
        o1 = O1Collecting(m, w, sink, O1Rect.FM if rect else O1Rect.AGGREGATE, hd)
        o1.push(_f32(rd.array(_F32, tlen, "O(1) query trace"), (tlen,)))
    elif o1_kind == 2:
        o1 = _parse_sealed(rd, nkv, hd, int(seq_len), budget)
    return LayerState(mode=mode, num_kv_heads=nkv, head_dim=hd, seq_len=int(seq_len),
                      lengths=lens, kcol=kcol, vcol=vcol, kcol_on=kcol_on, vcol_on=vcol_on,
                      importance=imp, linear_state=lin, linear_scratch=scr, o1=o1, owned=True,
                      **arrays)


def _parse_sealed(rd: _Reader, nkv: int, hd: int, seq_len: int, budget: int) -> O1Sealed:
    (nh, m, w, sink, rect, exact, m_eff, sink_len, rows, win_len, win_head,
     far_len) = rd.unpack("IIIIIIIIQQQQ", "O(1) sealed parameters")
    bad = None
    if nh < 1 or nh % nkv or m < 4 or w < 1 or rect > 1 or exact > 1:
        bad = f"num_heads={nh} m={m} w={w} rect={rect} exact_only={exact}"
    elif exact:
        if m_eff or sink_len or far_len or win_head or rows != win_len or win_len != seq_len:
            bad = (f"exact-only state with m_eff={m_eff} sink_len={sink_len} far_len={far_len} "
                   f"win_head={win_head} rows={rows} win_len={win_len} seq_len={seq_len}")
    else:
        if (rows != w or win_len != w or win_head >= w or sink_len != sink or m_eff < 4
                or m_eff > m or seq_len != far_len + w + sink):
            bad = (f"skeleton state with rows={rows} win_len={win_len} win_head={win_head} "
                   f"sink_len={sink_len} m_eff={m_eff} far_len={far_len} seq_len={seq_len}")
    if not bad:
        extra = 4 * nh * (sink + w + 3 * m_eff) if not exact else 4 * 2 * nkv * EXACT_EXTRA * hd
        if extra > budget:
            bad = f"num_heads={nh} with a window of {w} and {sink} sinks needs {extra} bytes of scratch"
    if bad:
        raise WireError(f"inconsistent O(1) state: {bad}")
    st = O1Sealed(num_heads=nh, num_kv_heads=nkv, d=hd, dv=hd, m=m, w=w, sink=sink,
                  rect=O1Rect.FM if rect else O1Rect.AGGREGATE, exact_only=bool(exact))
    st.m_eff, st.sink_len = m_eff, sink_len
    st.win_len, st.win_head, st.far_len = win_len, win_head, far_len
    shapes = {"win_k": (nkv, rows, hd), "win_v": (nkv, rows, hd), "sink_k": (nkv, sink_len, hd),
              "sink_v": (nkv, sink_len, hd), "k_tilde": (nkv, m_eff, hd),
              "q_tilde": (nh, m_eff, hd), "mu": (nh, m_eff, m_eff), "t_hat": (nh, m_eff, hd),
              "z_hat": (nh, m_eff), "m_max": (nh, m_eff)}
    for name, shape in shapes.items():
        setattr(st, name, _f32(rd.array(_F32, int(np.prod(shape)), f"O(1) {name}"), shape))
    if exact:
        st.set_exact_window(st.win_k, st.win_v, rows)     # room to grow, as after a seal
        st.scr = np.zeros((nh, 0), np.float32)
    else:
        st.scr = np.zeros((nh, sink + w + 3 * m_eff), np.float32)
    return st


# ---------------------------------------------------------------------------------- legacy




# ---------------------------------------------------------------------------------- entry points
def layer_to_bytes(layer: LayerKvCache, f16: bool = False,
                   fingerprint: Optional[Fingerprint] = None) -> bytes:
    """``LayerKvCache.to_bytes``: a whole buffer of kind 1."""
    return _finish(layer_plan(layer, f16), KIND_LAYER, fingerprint)


def layer_from_bytes(layer: LayerKvCache, buf: BufferLike,
                     fingerprint: Optional[Fingerprint] = None) -> LayerState:
    """``LayerKvCache.install_bytes``: verify a kind-1 buffer and parse it for ``layer``."""
    st = read_layer(buf, fingerprint, layer.num_kv_heads, layer.head_dim)
    problem = scheme_conflict(layer.mode, st.mode)
    if problem is not None:
        raise WireError(f"the buffer holds {problem}")
    return st


def read_layer(buf: BufferLike, fingerprint: Optional[Fingerprint] = None,
               num_kv_heads: Optional[int] = None,
               head_dim: Optional[int] = None) -> LayerState:
    """Verify a kind-1 buffer and parse it into an owned state (``LayerKvCache.from_bytes``
    builds a layer of the buffer's geometry and mode from it); the geometry is checked when
    given."""
    rd = _open(buf, KIND_LAYER, fingerprint)
    rd.what = "layer body"
    st = parse_layer(rd, num_kv_heads, head_dim)
    rd.done()
    return st


def model_plan(model: KvCache, f16: bool = False) -> _Plan:
    """The body pieces of a whole KvCache (kind 2)."""
    plan = _Plan()
    mode = model.mode
    pol = model.policy
    for i, layer in enumerate(model.layers):
        if (layer.num_kv_heads, layer.head_dim) != (model.num_kv_heads, model.head_dim):
            raise WireError(f"save: layer {i} is {layer.num_kv_heads}×{layer.head_dim}, the cache "
                            f"is {model.num_kv_heads}×{model.head_dim}; nothing was written")
    plan.pack("IIIBBBBQQ", len(model.layers), model.num_kv_heads, model.head_dim,
              k_code(mode), v_code(mode), 1 if pol.kind == "born" else 0,
              scheme_code(mode), pol.sink, model.max_seq_len)
    for layer in model.layers:
        lp = layer_plan(layer, f16)
        plan.pack("Q", lp.size)
        plan.extend(lp)
    return plan


def model_to_bytes(model: KvCache, f16: bool = False,
                   fingerprint: Optional[Fingerprint] = None) -> bytes:
    """``KvCache.to_bytes``: a whole buffer of kind 2 (the bytes ``save`` writes)."""
    return _finish(model_plan(model, f16), KIND_MODEL, fingerprint)


def save_model(model: KvCache, path: _Path, fingerprint: Optional[Fingerprint] = None,
               f16: bool = False) -> None:
    """``KvCache.save``: write the whole cache to ``path`` atomically."""
    _save(path, model_plan(model, f16), KIND_MODEL, fingerprint)


def load_model(cls: type[_Model], path: _Path,
               fingerprint: Optional[Fingerprint] = None) -> _Model:
    """KvCache.load: read the file into memory (one pass), then verify and parse it.

    The file is read rather than memory-mapped: a mapped file that another process truncates
    kills the interpreter (SIGBUS), and one rewritten in place could pass the digest and then
    parse from different bytes."""
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size == 0:
            raise WireError(f"{path!s}: empty file, not a kvcache file")
        buf = np.empty(size, np.uint8)
        view = buf.data
        got = 0
        while got < size:
            n = fh.readinto(view[got:])
            if not n:
                break
            got += n
        del view
        if got != size or fh.read(1):
            raise WireError(f"{path!s}: the file changed size while it was read")
    try:
        return model_from_bytes(cls, buf, fingerprint)
    except WireError as exc:
        raise WireError(f"{path!s}: {exc}") from None


def model_from_bytes(cls: type[_Model], buf: BufferLike,
                     fingerprint: Optional[Fingerprint] = None) -> _Model:
    """Parse and validate a whole-model buffer into a new ``cls`` (a KvCache)."""
    rd = _open(buf, KIND_MODEL, fingerprint)
    rd.what = "model body"
    n_layers, nkv, hd, qk, qv, pol, code, sink, max_seq = rd.unpack("IIIBBBBQQ", "model header")
    max_q = 2 if rd.version >= 3 else 1
    if qk > max_q or qv > max_q or pol > 1 or nkv < 1 or hd < 1 \
            or max_seq < 1 or (2 in (qk, qv) and hd % 8):
        raise WireError(f"invalid model header: num_kv_heads={nkv} head_dim={hd} quant=({qk},{qv}) "
                        f"policy={pol} max_seq_len={max_seq}")
    mode = _mode(qk, qv, code, rd.version)
    policy = EvictionPolicy("born" if pol else "recent", sink)
    states = []
    for i in range(n_layers):
        (size,) = rd.unpack("Q", f"layer {i} length")
        end = rd.pos + size
        if size % 8 or end > rd.end:
            raise WireError(f"model body: layer {i} length {size} is not valid here")
        sub = _Reader(rd.buf, rd.pos, end, what=f"layer {i}", version=rd.version)
        states.append(parse_layer(sub, nkv, hd))
        sub.done()
        rd.pos = end
    rd.done()
    model = cls(n_layers, nkv, hd, max_seq_len=max_seq, policy=policy, mode=mode)
    for layer, st in zip(model.layers, states):
        layer.install(st, any_scheme=True)       # each layer as it was saved
    return model
