"""The q8 storage schemes (described in docs/numerics.md) and the one place for row sizes.

K rows are quantised per row in groups of ``k_group(scheme)`` consecutive channels, one float32
scale per group: 16 channels in ``"rows"``, 32 in ``"cmf"`` (:data:`K_GROUPS`); when head_dim is
not a multiple of the group the last group is partial, so a K row holds ``ceil(head_dim /
group)`` scales.  V rows have one scale per row in both schemes.  Scales are
``max(absmax / 127, 1e-12)``, values ``clamp(round_half_away_from_zero(r / s), -127, 127)``
(NaN -> 0), where ``r = x / col`` once the per-channel column field is frozen, else ``r = x``.

Two schemes (:attr:`kvcache.KvMode.scheme`):

* ``"rows"`` (the default): K in 16-channel groups, and no column field is ever frozen:
  ``r = x`` for every row, so a stored row depends on its own values only and rolling back
  then appending the same rows again stores the same bytes at every position;
* ``"cmf"`` (the legacy scheme): K in 32-channel groups, and the column field is frozen once
  per conversation, at the start of the first append that finds ``seq_len >= COL_WARMUP`` (64)
  and no column frozen yet: for every head and quantised component holding rows,
  ``col[d] = max(sqrt(sum_p x[p, d]**2 / n), 1e-6)`` over the dequantised rows (float32, rows
  added in order), and every stored row is requantised against it.  A rollback keeps the
  frozen column, so rows appended again after rolling back across position 64 are stored
  differently.

Sizes.  :func:`k_group`, :func:`k_scale_count`, :func:`k_row_bytes`, :func:`v_row_bytes` and
:func:`q8_row_bytes` are the only place the K group and the byte size of a stored row are
computed: the layer (the width of its K scale store, the group it quantises with,
``memory_bytes``), the states' checks, the byte formats (:mod:`kvcache.wire`, whose scheme byte
decides the scale count, and the prefix-store entries) and the benchmarks' byte counts use
them.  Every K size takes the scheme as a required argument (there is no default group), so a
caller cannot size a K row for one scheme by omission.  (The kernels read the group back from
the width of a K scale store; that rule lives with them, ``_core._k_group`` and its twin
``reference.k_group_of``.)  :data:`CHUNK_ROWS` is the number of rows
the attention kernels accumulate per chunk (the compiled ``_core.CHUNK_ROWS`` must equal it),
and :data:`COPY_CHUNK_BYTES` the bytes the byte formats copy (and hash) per step.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

K4_BLOCK = 32
"""Rows per block of 4-bit K (docs/kv4.md; ``_q4.h``'s KVC_K4_BLOCK, checked by ``_core``)."""
K4_RING = 64
"""Float32 rows per KV head in 4-bit K's ring (``_q4.h``'s KVC_K4_RING, checked by ``_core``):
the open block and the 32 rows before it."""

__all__ = ["K4_BLOCK", "K4_RING", "COL_WARMUP", "K_GROUPS", "k_group", "COL_FLOOR", "CHUNK_ROWS",
           "COPY_CHUNK_BYTES", "n_groups", "k_scale_count", "k_row_bytes", "v_row_bytes",
           "q8_row_bytes", "v4_row_bytes", "check_v4_head_dim", "V4_GROUP", "k4_row_bytes",
           "check_k4_head_dim", "k4_values", "k4_read_back", "k4_refills", "k4_pack_block",
           "k4_unpack_blocks",
           "unpack_codes", "dequantize", "column_field", "freeze_columns"]

COL_WARMUP = 64
K_GROUPS: dict[str, int] = {"rows": 16, "cmf": 32}
"""Channels per K scale group, by int8 scheme."""
COL_FLOOR = np.float32(1e-6)
CHUNK_ROWS = 256                 # rows per V-accumulation chunk of the attention kernels
COPY_CHUNK_BYTES = 256 << 10     # bytes copied, then hashed while still in L2, per step


V4_GROUP = 16
"""Channels per (step, minimum) pair of a 4-bit V row."""


def n_groups(head_dim: int, group: int) -> int:
    """Number of scales per row: ceil(head_dim / group)."""
    return -(-head_dim // group)


def k_group(scheme: str) -> int:
    """Channels per K scale group of int8 scheme ``scheme``: 16 ("rows") or 32 ("cmf").

    ValueError for anything else (an F32 mode's empty scheme included: it stores no int8 K)."""
    try:
        return K_GROUPS[scheme]
    except (KeyError, TypeError):
        raise ValueError(f"int8 scheme must be one of {sorted(K_GROUPS)}, got {scheme!r}") \
            from None


def k_scale_count(head_dim: int, scheme: str) -> int:
    """Float32 scales per int8 K row: ceil(head_dim / k_group(scheme))."""
    return n_groups(head_dim, k_group(scheme))


def k_row_bytes(head_dim: int, q8: bool = True, *, scheme: str) -> int:
    """Bytes of one stored K row: int8 values and their group scales, or float32 values.

    ``scheme`` is required; it is only read when ``q8`` (float32 rows are one size)."""
    return head_dim + 4 * k_scale_count(head_dim, scheme) if q8 else 4 * head_dim


def v_row_bytes(head_dim: int, q8: bool = True) -> int:
    """Bytes of one stored V row: int8 values and one scale, or float32 values."""
    return head_dim + 4 if q8 else 4 * head_dim


def v4_row_bytes(head_dim: int) -> int:
    """Bytes of one stored 4-bit V row (docs/kv4.md): head_dim / 2 bytes of codes and a
    float16 step and minimum per 16 channels."""
    return head_dim // 2 + 4 * n_groups(head_dim, V4_GROUP)


def k4_row_bytes(head_dim: int) -> int:
    """Bytes per stored 4-bit K row (docs/kv4.md), the block parameters shared out: head_dim
    / 2 bytes of codes and a float16 step and minimum per channel per 32 rows (head_dim / 8).
    The float32 ring of the last 64 rows per head comes on top (``memory_bytes`` counts it)."""
    return head_dim // 2 + 4 * head_dim // K4_BLOCK


def check_k4_head_dim(head_dim: int) -> None:
    """ValueError unless 4-bit K can store rows of ``head_dim`` channels (a multiple of 8)."""
    if head_dim % 8:
        raise ValueError(f"4-bit K needs head_dim to be a multiple of 8, got head_dim="
                         f"{head_dim}")


def k4_values(codes: npt.NDArray[np.uint8], par: npt.NDArray[np.uint16],
              n: int, lo: int = 0) -> npt.NDArray[np.float32]:
    """The float32 values fmaf(code, step, minimum) of rows [lo, n) of one head's 4-bit K
    codes (cap, hd / 2) with block parameters (blocks, 2 * hd) (docs/kv4.md), as an (n - lo,
    hd) array; rows past the closed blocks (``32 * (n // 32)``) are left 0.  Only the blocks
    holding those rows are decoded."""
    B = K4_BLOCK
    hd = codes.shape[1] * 2
    out = np.zeros((n - lo, hd), dtype=np.float32)
    q = n // B * B
    b0 = lo // B
    if q > lo:
        c = k4_unpack_blocks(codes[B * b0:q]).astype(np.float32)         # (q - B b0, hd)
        pf = par[b0: q // B].view(np.float16).astype(np.float32)
        step = np.repeat(pf[:, :hd], B, axis=0)
        low = np.repeat(pf[:, hd:], B, axis=0)
        with np.errstate(invalid="ignore"):
            vals = c * step + low         # code * step is exact in float32: this is fmaf
        out[: q - lo] = vals[lo - B * b0:]
    return out


def k4_read_back(rows: npt.NDArray[np.float32], codes: npt.NDArray[np.uint8],
                 par: npt.NDArray[np.uint16], lo: int = 0) -> npt.NDArray[np.bool_]:
    """Which of ``rows`` (rows lo, lo + 1, ... of one head's 4-bit K, in blocks whose codes and
    parameters, as ``k4_values`` takes them, are those given) equal bit for bit their codes'
    values: the rows a rollback read back from the codes."""
    m = rows.shape[0]
    images = k4_values(codes, par, -(-(lo + m) // K4_BLOCK) * K4_BLOCK, lo)[:m]
    same: npt.NDArray[np.bool_] = (images.view(np.uint32) == rows.view(np.uint32)).all(axis=1)
    return same


def k4_refills(rows: npt.NDArray[np.float32], codes: npt.NDArray[np.uint8],
               par: npt.NDArray[np.uint16]) -> bool:
    """Whether a block of 4-bit K reopened by a rollback came back as it was: every one of
    its K4_BLOCK rows (K4_BLOCK, hd) is bit for bit its codes' value fmaf(code, step, minimum)
    under the block's previous codes (K4_BLOCK, hd / 2) and parameters (2 * hd,) -- a row
    the rollback read back from the codes -- or could have been one of the rows those
    parameters were made from and quantises to those codes -- a row appended again.  In a
    channel with a step, the code is ``_q4.h``'s kvc_q4_code, floor((x - m) / s + 0.5)
    clamped to 0..15, and before the clamp it may lie at most ``k`` codes outside 0..15,
    ``k`` covering the float16 roundings of m and s (a block's minimum lies within half a
    float16 spacing of m); a channel whose step rounded to 0 takes values within that much
    of m; a channel stored as NaN (a non-finite key) any value (docs/kv4.md, "Rollback")."""
    hd = rows.shape[1]
    old = k4_unpack_blocks(codes)
    is_image = k4_read_back(rows, codes, par[None])
    half = par.view(np.float16)
    pf = half.astype(np.float32)
    step, low = pf[:hd], pf[hd:]
    finite = np.isfinite(step) & np.isfinite(low)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        # half a float16 spacing at |m| (the wider one beside it) and at s, as float32
        gap = (np.spacing(np.abs(half)).astype(np.float32) * np.float32(0.5))
        slack = gap[hd:] + np.float32(15) * gap[:hd]
        t = np.floor((rows - low) / step + np.float32(0.5))
        k = np.ceil(slack / step) + 2
        near = np.abs(rows - low) <= slack + np.float32(15 * 2.0 ** -24)
    stepped = finite & (step > 0)
    inside = np.where(stepped, (t >= -k) & (t <= 15 + k), near)
    code = np.where(stepped, np.clip(np.nan_to_num(t), 0, 15), 0)
    same = ((code == old) & inside) | ~finite
    return bool((is_image | same.all(axis=1)).all())


def k4_pack_block(codes: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8]:
    """One block's codes (K4_BLOCK, hd), one per channel, packed in the 4-bit K block layout
    (docs/kv4.md): channel octets, each octet's rows in order, four bytes per row, byte i of a
    row holding channel 8 o + i (low nibble) and 8 o + 4 + i (high nibble).  Returned as the
    store's (K4_BLOCK, hd / 2) rows of the block."""
    B, hd = codes.shape
    c = np.asarray(codes, dtype=np.uint8).reshape(B, hd // 8, 2, 4)
    packed = (c[:, :, 0, :] | (c[:, :, 1, :] << 4)).astype(np.uint8)       # (t, o, i)
    out: npt.NDArray[np.uint8] = np.ascontiguousarray(packed.transpose(1, 0, 2)).reshape(B, hd // 2)
    return out


def k4_unpack_blocks(codes: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8]:
    """Whole blocks of 4-bit K codes (nb * K4_BLOCK, hd / 2) as one uint8 per channel (nb *
    K4_BLOCK, hd): the inverse of ``k4_pack_block`` block by block."""
    B = K4_BLOCK
    rows, half = codes.shape
    hd, nb = 2 * half, rows // B
    x = np.asarray(codes, dtype=np.uint8).reshape(nb, hd // 8, B, 4)          # (b, o, t, i)
    both = np.stack([x & 15, x >> 4], axis=3)                                # (b, o, t, 2, i)
    out: npt.NDArray[np.uint8] = np.ascontiguousarray(both.transpose(0, 2, 1, 3, 4)).reshape(rows, hd)
    return out


def unpack_codes(codes: npt.NDArray[np.uint8], hd: int) -> npt.NDArray[np.uint8]:
    """4-bit V codes (n, hd / 2), two per byte in the row layout of docs/kv4.md, as one uint8
    per channel (n, hd)."""
    n = codes.shape[0]
    out = np.empty((n, hd), dtype=np.uint8)
    for c0 in range(0, hd, 32):
        h = min(32, hd - c0) // 2
        b = codes[:, c0 // 2: c0 // 2 + h]
        out[:, c0: c0 + h] = b & 15
        out[:, c0 + h: c0 + 2 * h] = b >> 4
    return out


def v4_values(codes: npt.NDArray[np.uint8], par: npt.NDArray[np.uint16],
              hd: int) -> npt.NDArray[np.float32]:
    """The float32 values fmaf(code, step, minimum) of 4-bit V rows: codes (n, hd / 2) in the
    row layout of docs/kv4.md, parameters (n, 2 * ceil(hd / 16)) as float16 bits."""
    c = unpack_codes(np.asarray(codes, dtype=np.uint8), hd).astype(np.float32)
    pf = np.asarray(par, dtype=np.uint16).view(np.float16).astype(np.float32)
    g = np.arange(hd) // V4_GROUP
    with np.errstate(invalid="ignore"):
        out: npt.NDArray[np.float32] = c * pf[:, 2 * g] + pf[:, 2 * g + 1]  # exact product: fmaf
    return out


def check_v4_head_dim(head_dim: int) -> None:
    """ValueError unless 4-bit V can store rows of ``head_dim`` channels (a multiple of 8)."""
    if head_dim % 8:
        raise ValueError(f"4-bit V needs head_dim to be a multiple of 8, got head_dim="
                         f"{head_dim}")


def q8_row_bytes(head_dim: int, scheme: str) -> int:
    """Bytes of one position of one KV head stored as int8 K and V (rows and scales)."""
    return k_row_bytes(head_dim, scheme=scheme) + v_row_bytes(head_dim)


def dequantize(q: npt.NDArray[np.int8], s: npt.NDArray[np.float32],
               group: int) -> npt.NDArray[np.float32]:
    """Dequantise int8 rows ``q`` (n, hd) with scales ``s`` (n, ceil(hd/group)) to float32.

    Used once, at the column freeze; the attention path never dequantises.
    """
    hd = q.shape[1]
    scales = np.repeat(s, group, axis=1)[:, :hd]          # (n, hd)
    with np.errstate(invalid="ignore", over="ignore"):     # inf scales from inf rows: IEEE
        out: npt.NDArray[np.float32] = q.astype(np.float32) * scales   # (n, hd) float32
    return out


def column_field(x: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """Per-channel RMS of rows ``x`` (n, hd), float32, rows accumulated in order, floored."""
    sq = np.zeros(x.shape[1], dtype=np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        for row in x:                                      # row order, as documented
            sq += row * row
        col = np.sqrt(sq / np.float32(x.shape[0]))
    out: npt.NDArray[np.float32] = np.maximum(col, COL_FLOOR).astype(np.float32)
    return out


def freeze_columns(q_store: npt.NDArray[np.int8], s_store: npt.NDArray[np.float32],
                   lengths: npt.NDArray[np.intp], group: int, col: npt.NDArray[np.float32],
                   col_on: npt.NDArray[np.uint8], kernels: Any) -> None:
    """Freeze the column field of one quantised component for every head that holds rows.

    q_store (nkv, cap, hd) int8 and s_store (nkv, cap, ng) float32 are requantised in place;
    col (nkv, hd) and col_on (nkv,) are written for the heads that had rows.  ``kernels`` is
    the compiled module (or its NumPy twin), providing ``quantize_rows``.
    """
    for h, n in enumerate(lengths):
        n = int(n)
        if n == 0:
            continue
        x = dequantize(q_store[h, :n], s_store[h, :n], group)   # (n, hd)
        c = column_field(x)                                      # (hd,)
        kernels.quantize_rows(x__nd=x, col__d=c, group=group, q__nd=q_store[h, :n],
                              s__ng=s_store[h, :n], n_threads=1)
        col[h] = c
        col_on[h] = 1
