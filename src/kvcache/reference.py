"""Pure-NumPy twins of the compiled kernels in ``kvcache._core``, name for name.

They take the same arguments (for the attention, O(1) and MLA kernels: the descriptors of
``kvcache._entry``, which they trust) and write the same outputs, so the tests can run both on
identical inputs (the oracle) and the benchmark can time them side by side (the baseline).
Numerics follow the same rules (docs/numerics.md) in float32 (scores, softmax, V accumulation,
importance), with NumPy's own summation order inside dot products and sums; results therefore
agree with the kernels to float32 rounding, not bit for bit (the exceptions, bit-identical by
construction, are row quantisation, the row stores, the query quantiser and the raw q8 scores:
``quantize_query``, ``q8_scores`` and the q8 scores inside ``attend_rows``/``attend_blocked``).

Convenience wrappers run a LayerKvCache's own driver on these kernels:
``attend_all_heads(layer, q, ...)``, ``attend(layer, q, h)``, ``attend_group(layer, ...)``,
``o1_seal(layer, num_heads)``, ``o1_step_layer(layer, q, k, v, num_heads)``.

The O(1) Nystrom operator has, besides the kernel twins ``o1_absorb``/``o1_step``, its two
float64 forms: ``nystrom_stream`` (seal, replay, decode steps) and ``nystrom_matrix`` (the
definition, with an explicit far weight per key); ``kept_keys`` and ``o1_error_estimate`` are
the seal's kept-key choice and error estimate written from their definitions.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import numpy.typing as npt

from ._entry import AttendCall, MlaCall, Rows, k_group_of
from ._validate import FloatArrayLike
from ._entry import K4_BLOCK, K4_RING, ring_slots
from .quant import CHUNK_ROWS, k4_pack_block, k4_unpack_blocks, k4_values, k_group, unpack_codes
from ._reference_o1 import (bind_o1, kept_keys, nystrom_matrix, nystrom_stream, o1_absorb,
                            o1_error_estimate, o1_step)

if TYPE_CHECKING:
    from .layer import LayerKvCache
    from .static import StaticKvCache

__all__ = ["CHUNK_ROWS", "openmp_built", "max_threads", "round_half_away", "quantize_rows",
           "store_rows_f32", "store_rows_q8", "store_rows_v4", "quantize_v4", "dequantize_v4",
           "store_rows_k4", "quantize_k4_block", "k4_fold", "k4_scores", "k4_keys", "dot_f32",
           "stream_read", "fmaf", "k_group_of", "quantize_query",
           "q8_scores", "visible_range", "bind_rows", "attend_rows", "attend_blocked", "bind_o1",
           "attend_all_heads", "attend", "attend_group", "o1_seal", "o1_step_layer",
           "static_attend", "o1_absorb", "o1_step", "nystrom_stream", "nystrom_matrix",
           "kept_keys", "o1_error_estimate",
           "mla_absorbed", "mla_naive", "mla_attend"]

_F32 = np.float32

# Array types of the kernel signatures (as in _core.pyi).
F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]
I8 = npt.NDArray[np.int8]
U8 = npt.NDArray[np.uint8]
U16 = npt.NDArray[np.uint16]
IP = npt.NDArray[np.intp]
# The O(1) twins compute in the dtype of their state arrays: float32 (the kernel's twin) or
# float64 (the streaming reference).
FA = npt.NDArray[np.floating[Any]]
# The MLA forms compute in their inputs' float dtype and return it.
_Fl = TypeVar("_Fl", bound=np.floating[Any])


def openmp_built() -> bool:
    return False


def max_threads() -> int:
    return 1


def round_half_away(x: FA) -> FA:
    """Round half away from zero, exactly (no 0.49999997 + 0.5 trap)."""
    t = np.trunc(x)                                            # same shape as x
    r: FA = t + np.sign(x) * (np.abs(x - t) >= 0.5)
    return r


def quantize_rows(x__nd: F32, col__d: F32, group: int, q__nd: I8, s__ng: F32,
                  n_threads: int = 1) -> None:
    """Row quantisation (docs/numerics.md, "int8 quantisation") of x (n, hd) into q (n, hd) int8
    and s (n, ng) float32."""
    x = np.asarray(x__nd, dtype=_F32)
    n, hd = x.shape
    if n == 0:
        return
    r = x / np.asarray(col__d, dtype=_F32) if len(col__d) else x      # (n, hd)
    for gi, g0 in enumerate(range(0, hd, group)):
        rg = r[:, g0:g0 + group]                                       # (n, glen)
        absmax = np.fmax.reduce(np.abs(rg), axis=1, initial=_F32(0))   # (n,) NaN ignored
        s = np.maximum(absmax / _F32(127), _F32(1e-12)).astype(_F32)   # (n,)
        with np.errstate(invalid="ignore", divide="ignore"):
            v = round_half_away(rg / s[:, None])                       # (n, glen)
        v = np.clip(v, -127, 127)
        v = np.where(np.isnan(v), 0, v)
        q__nd[:, g0:g0 + group] = v.astype(np.int8)
        s__ng[:, gi] = s


def fmaf(a: F32, b: F32, c: F32) -> F32:
    """C's ``fmaf`` elementwise: a * b + c with ONE rounding to float32, exactly.

    a * b is exact in float64 (24 + 24 significant bits); the float64 sum s = a * b + c is
    rounded once more, which changes the float32 result only when s lands exactly on a
    midpoint between two float32 numbers while the exact sum does not: then s is nudged one
    float64 step towards the exact sum (its rounding error, from TwoSum) before rounding."""
    a64 = np.asarray(a, dtype=_F32).astype(np.float64)
    b64 = np.asarray(b, dtype=_F32).astype(np.float64)
    c64 = np.asarray(c, dtype=_F32).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        p = a64 * b64                                                   # exact
        s = p + c64
        bb = s - p
        err = (p - (s - bb)) + (c64 - bb)                               # s + err == p + c
        r = s.astype(_F32)
        r64 = r.astype(np.float64)
        other = np.nextafter(r, np.where(s > r64, _F32(np.inf), _F32(-np.inf))).astype(np.float64)
        mid = np.isfinite(s) & np.isfinite(err) & (r64 != s) & ((r64 + other) / 2 == s) & (err != 0)
        if np.any(mid):
            s2 = np.nextafter(s, np.where(err > 0, np.inf, -np.inf))
            r = np.where(mid, s2.astype(_F32), r)
    out: F32 = np.asarray(r, dtype=_F32)
    return out


def quantize_query(q__jd: F32, qi__jp: I8, sq__jg: F32, qsum__jg: npt.NDArray[np.int32],
                   group: int = 32) -> None:
    """Twin of ``_core.quantize_query`` (docs/numerics.md, "q8 scoring"): each query quantised
    like a stored row in groups of ``group`` (16 or 32) channels (codes zero past head_dim), a
    group with a NaN or an infinity gets scale NaN; qsum holds the group sums of the codes."""
    q = np.asarray(q__jd, dtype=_F32)
    nq, hd = q.shape
    ng = -(-hd // group)
    qi__jp[:] = 0
    quantize_rows(q, np.zeros(0, dtype=_F32), group, qi__jp[:, :hd], sq__jg)
    for g in range(ng):
        qsum__jg[:, g] = qi__jp[:, g * group:(g + 1) * group].astype(np.int32).sum(axis=1)
        bad = ~np.isfinite(q[:, g * group:(g + 1) * group]).all(axis=1)       # (nq,)
        sq__jg[bad, g] = np.nan


def q8_scores(q__jd: F32, kq__rd: I8, ks__rg: F32, out__jr: F32, k_group: int = 0) -> None:
    """Twin of ``_core.q8_scores``, bit for bit: per query and row, acc = 0 and for each K
    group g (``k_group_of``) in order acc = fmaf(float(isum_g), sq_g * sk_g, acc), isum_g the
    exact integer dot product of the group's codes."""
    q = np.asarray(q__jd, dtype=_F32)
    nq, hd = q.shape
    group = k_group_of(hd, ks__rg.shape[1], k_group)
    ng = -(-hd // group)
    qi = np.zeros((nq, -(-hd // 32) * 32), dtype=np.int8)
    sq = np.zeros((nq, ng), dtype=_F32)
    qs = np.zeros((nq, ng), dtype=np.int32)
    quantize_query(q, qi, sq, qs, group)
    k = np.asarray(kq__rd).astype(np.int64)                                   # (r, hd)
    acc = np.zeros((nq, k.shape[0]), dtype=_F32)
    for g in range(ng):
        g0, g1 = g * group, min(hd, (g + 1) * group)
        isum = qi[:, g0:g1].astype(np.int64) @ k[:, g0:g1].T                  # (nq, r) exact
        with np.errstate(invalid="ignore", over="ignore"):
            prod = (sq[:, g:g + 1] * ks__rg[None, :, g]).astype(_F32)          # (nq, r)
        acc = fmaf(isum.astype(_F32), prod, acc)
    out__jr[:] = acc


def store_rows_f32(x__nhd: F32, alive__h: U8, head_len__h: IP, store__hcd: F32) -> None:
    """store[h, head_len[h] + i] = x[i, h] for alive heads."""
    n = x__nhd.shape[0]
    for h in range(x__nhd.shape[1]):
        if alive__h[h]:
            L = head_len__h[h]
            store__hcd[h, L:L + n] = x__nhd[:, h]


def store_rows_q8(x__nhd: F32, alive__h: U8, head_len__h: IP, col__hd: F32, col_on__h: U8,
                  group: int, q__hcd: I8, s__hcg: F32) -> None:
    """Quantise x[i, h] (over col[h] where col_on[h]) into q/s at row head_len[h] + i."""
    n = x__nhd.shape[0]
    empty = np.zeros(0, dtype=_F32)
    for h in range(x__nhd.shape[1]):
        if alive__h[h]:
            L = head_len__h[h]
            quantize_rows(np.ascontiguousarray(x__nhd[:, h]), col__hd[h] if col_on__h[h] else empty,
                          group, q__hcd[h, L:L + n], s__hcg[h, L:L + n])


def _v4_order(hd: int) -> npt.NDArray[np.intp]:
    """The channel order of a 4-bit row's nibbles (``_q4.h``): entry 2 * b is the channel in
    byte b's low nibble, 2 * b + 1 the one in its high nibble."""
    order = np.zeros(hd, dtype=np.intp)
    for c0 in range(0, hd, 32):
        n = min(32, hd - c0)
        for i in range(n // 2):
            order[c0 + 2 * i] = c0 + i
            order[c0 + 2 * i + 1] = c0 + n // 2 + i
    return order


def _q4_quantise(x__ng: F32) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.float16],
                                         npt.NDArray[np.float16]]:
    """The 4-bit quantiser of ``_q4.h`` along the last axis of x (n, g): codes (n, g), the
    float16 steps and minimums (n,) (NaN for a lane of values that cannot be stored)."""
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        lo = x__ng.min(axis=1)
        step = ((x__ng.max(axis=1) - lo) / _F32(15)).astype(_F32)
        m16, s16 = lo.astype(np.float16), step.astype(np.float16)
        bad = ~np.isfinite(x__ng).all(axis=1) | ~np.isfinite(m16) | ~np.isfinite(s16)
        m, sc = m16.astype(_F32), s16.astype(_F32)
        t = np.floor((x__ng - m[:, None]) / sc[:, None] + _F32(0.5))
    t = np.where((sc > 0)[:, None] & ~bad[:, None], np.nan_to_num(t), 0)
    nan16 = np.float16(np.nan)
    return (np.clip(t, 0, 15).astype(np.uint8), np.where(bad, nan16, s16),
            np.where(bad, nan16, m16))


def quantize_v4(x__nd: F32, c__nb: U8, p__np: U16) -> None:
    """Twin of ``_core.quantize_v4``, bit for bit (docs/kv4.md): per group of 16 channels
    m = float16(min), s = float16((max - min) / 15), codes floor((x - m) / s + 0.5) clamped to
    0..15 (0 when s is 0); a group with a non-finite value, m or s is stored as NaN, codes 0."""
    x = np.asarray(x__nd, dtype=_F32)
    n, hd = x.shape
    codes = np.zeros((n, hd), dtype=np.uint8)
    par = np.zeros((n, 2 * -(-hd // 16)), dtype=np.float16)
    for g, d0 in enumerate(range(0, hd, 16)):
        codes[:, d0:d0 + 16], par[:, 2 * g], par[:, 2 * g + 1] = _q4_quantise(x[:, d0:d0 + 16])
    c__nb[:] = _pack_codes(codes)
    p__np[:] = par.view(np.uint16)


def dequantize_v4(c__nb: U8, p__np: U16, hd: int) -> F32:
    """The float32 values of 4-bit rows (n, hd): fmaf(code, s, m) per channel, as the kernels
    read them."""
    codes = unpack_codes(np.asarray(c__nb, dtype=np.uint8), hd).astype(_F32)
    par = np.asarray(p__np, dtype=np.uint16).view(np.float16).astype(_F32)
    g = np.arange(hd) // 16
    return fmaf(codes, par[:, 2 * g], par[:, 2 * g + 1])


def store_rows_v4(x__nhd: F32, alive__h: U8, head_len__h: IP, c__hcb: U8, p__hcp: U16) -> None:
    """Quantise x[i, h] to 4 bits into c/p at row head_len[h] + i of alive heads."""
    n = x__nhd.shape[0]
    for h in range(x__nhd.shape[1]):
        if alive__h[h]:
            L = head_len__h[h]
            quantize_v4(np.ascontiguousarray(x__nhd[:, h]), c__hcb[h, L:L + n], p__hcp[h, L:L + n])


def dot_f32(a: F32, b: F32) -> F32:
    """``kvc_dot_f32`` of the rows of ``a`` (m, n) with ``b`` (n,) or (m, n), bit for bit
    (docs/numerics.md): 8 lanes of fmaf over the whole 8-blocks (lane l: elements i % 8 == l),
    folded (0+1, 2+3, 4+5, 6+7) then ((b0+b1) + (b2+b3)), plus the tail chained with fmaf."""
    a = np.atleast_2d(np.asarray(a, dtype=_F32))
    b = np.broadcast_to(np.asarray(b, dtype=_F32), a.shape)
    m, n = a.shape
    full = n // 8 * 8
    lanes = np.zeros((m, 8), dtype=_F32)
    for i in range(0, full, 8):
        lanes = fmaf(a[:, i:i + 8], b[:, i:i + 8], lanes)
    with np.errstate(invalid="ignore", over="ignore"):
        pair = lanes[:, 0::2] + lanes[:, 1::2]                             # (m, 4)
        fold = (pair[:, 0] + pair[:, 1]) + (pair[:, 2] + pair[:, 3])
        tail = np.zeros(m, dtype=_F32)
        for i in range(full, n):
            tail = fmaf(a[:, i], b[:, i], tail)
        out: F32 = (fold + tail).astype(_F32)
    return out


def _pack_codes(codes: npt.NDArray[np.uint8]) -> U8:
    """One code per channel (n, hd) packed two per byte in the layout of docs/kv4.md."""
    n, hd = codes.shape
    packed = codes[:, _v4_order(hd)].reshape(n, hd // 2, 2)
    out: U8 = (packed[:, :, 0] | (packed[:, :, 1] << 4)).astype(np.uint8)
    return out


def quantize_k4_block(x__rd: F32) -> tuple[U8, U16]:
    """One block of 4-bit K (docs/kv4.md), bit for bit ``_q4.h``'s kvc_k4_quant_block: the
    32 rows x (32, hd) quantised per channel (the V quantiser's arithmetic along the rows).
    Returns the codes (32, hd / 2) in the block layout (``quant.k4_pack_block``) and the
    parameters (2 * hd,): the steps, then the minimums."""
    x = np.asarray(x__rd, dtype=_F32)
    codes, s16, m16 = _q4_quantise(np.ascontiguousarray(x.T))        # (hd, rows) per channel
    par = np.concatenate([s16, m16]).view(np.uint16)
    return k4_pack_block(np.ascontiguousarray(codes.T)), par


def store_rows_k4(x__nhd: F32, alive__h: U8, head_len__h: IP, c__hcb: U8, p__hbq: U16,
                  r__hrd: F32) -> None:
    """Twin of ``_core.store_rows_k4``: rows into the ring, each completed block quantised."""
    n = x__nhd.shape[0]
    for h in range(x__nhd.shape[1]):
        if not alive__h[h]:
            continue
        for i in range(n):
            p = int(head_len__h[h]) + i
            r__hrd[h, p % K4_RING] = x__nhd[i, h]
            if p % K4_BLOCK == K4_BLOCK - 1:
                p0 = p + 1 - K4_BLOCK
                rows = r__hrd[h, [(p0 + j) % K4_RING for j in range(K4_BLOCK)]]
                c__hcb[h, p0:p + 1], p__hbq[h, p0 // K4_BLOCK] = quantize_k4_block(rows)


def k4_fold(q__jd: F32, step__d: F32) -> tuple[I8, F32]:
    """The block query of 4-bit K scoring (docs/kv4.md), bit for bit ``kvc_k4_fold``:
    w = q * step; per group of 16 channels a = max |w| (NaN counted as +inf),
    sw = max(a / 127, 1e-12) (NaN where a is not finite), codes w * (1 / sw) rounded to the
    nearest integer, ties to even (NaN -> 0).  Returns the codes (nq, hd) and the scales (nq, groups)."""
    q = np.atleast_2d(np.asarray(q__jd, dtype=_F32))
    nq, hd = q.shape
    ng = -(-hd // 16)
    wi = np.zeros((nq, hd), dtype=np.int8)
    sw = np.zeros((nq, ng), dtype=_F32)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        w = (q * step__d).astype(_F32)
        for g in range(ng):
            wg = w[:, 16 * g:16 * g + 16]
            a = np.where(np.isnan(wg), _F32(np.inf), np.abs(wg)).max(axis=1)
            sc = np.maximum((a / _F32(127)).astype(_F32), _F32(1e-12))
            inv = (_F32(1) / sc).astype(_F32)
            sw[:, g] = np.where(np.isfinite(a), sc, _F32(np.nan))
            c = np.rint((wg * inv[:, None]).astype(_F32))                # ties to even
            wi[:, 16 * g:16 * g + 16] = np.nan_to_num(c, nan=0.0).astype(np.int8)
    return wi, sw


def k4_scores(q__jd: F32, kc__cb: U8, kp__bq: U16, kr__rd: F32, n: int,
              out__jr: F32) -> None:
    """Twin of ``_core.k4_scores``: into out (nq, n) the raw scores (no scale) of queries q
    (nq, hd) against one KV group's first ``n`` rows of 4-bit K (codes, block parameters,
    ring), bit for bit the kernels' (docs/kv4.md): per closed block the folded query
    (``k4_fold``), per group the exact integer sum against the codes, chained
    raw = fmaf(isum_g, sw_g, raw) over the groups in order, plus bias = dot_f32(q, minimum);
    rows past the closed blocks from the ring with dot_f32."""
    q = np.atleast_2d(np.asarray(q__jd, dtype=_F32))
    nq, hd = q.shape
    B = K4_BLOCK
    out = np.zeros((nq, n), dtype=_F32)
    qlen = n // B * B
    codes = k4_unpack_blocks(kc__cb[:qlen]).astype(np.int32)             # (qlen, hd)
    for b in range(qlen // B):
        pf = kp__bq[b].view(np.float16).astype(_F32)
        wi, sw = k4_fold(q, pf[:hd])
        rows = codes[b * B:(b + 1) * B]
        raw = np.zeros((nq, B), dtype=_F32)
        for g in range(sw.shape[1]):
            isum = wi[:, 16 * g:16 * g + 16].astype(np.int32) @ rows[:, 16 * g:16 * g + 16].T
            with np.errstate(invalid="ignore", over="ignore"):
                raw = fmaf(isum.astype(_F32), np.broadcast_to(sw[:, g:g + 1], raw.shape), raw)
        bias = dot_f32(q, pf[hd:])                                      # (nq,)
        with np.errstate(invalid="ignore", over="ignore"):
            out[:, b * B:(b + 1) * B] = raw + bias[:, None]
    for p in range(qlen, n):
        out[:, p] = dot_f32(q, kr__rd[p % K4_RING])
    out__jr[:] = out


def k4_keys(kc__cb: U8, kp__bq: U16, kr__rd: F32, n: int) -> F32:
    """One KV group's first ``n`` 4-bit K rows as the prompt kernel reads them (docs/kv4.md):
    a closed block's rows as fmaf(code, step, minimum), the open block's from the ring."""
    out = k4_values(kc__cb, kp__bq, n)
    q = n // K4_BLOCK * K4_BLOCK
    out[q:] = kr__rd[ring_slots(q, n)]
    return out


def _k4_raw(q: F32, kc: U8, kp: U16, kr: F32, n: int) -> F32:
    out = np.zeros((q.shape[0], n), dtype=_F32)
    k4_scores(q, kc, kp, kr, n, out)
    return out


def stream_read(buf: F32, n_threads: int = 1) -> float:
    """Sum of a buffer (the read-bandwidth probe), NumPy's single-threaded sum."""
    return float(np.sum(buf, dtype=np.float64))


def visible_range(stored: int, n_back: int, i: int, window: int, first: int,
                  L: int) -> tuple[int, int]:
    """Rows [f, e) that query position i sees (same rule as the kernel)."""
    e = min(max(stored - n_back + i + 1, 0), stored, L)
    f = max(e - window, 0) if window > 0 else 0
    f = max(min(max(f, first), e - 1), 0)
    return f, e


def bind_rows(rows: Rows) -> Rows:
    """Twin of ``_core.bind_rows``: the twins trust their descriptors, so the binding is the
    :class:`Rows` itself."""
    return rows


def attend_rows(rows: Rows, call: AttendCall) -> None:
    """NumPy twin of ``_core.attend_rows`` (see its docstring for the contract): the same
    descriptors, trusted (the compiled entry checks them)."""
    kf__hcd, kq__hcd, ks__hcg, vf__hcd, vq__hcd, vs__hc1, vcol__hd, head_len__h = rows[:8]
    quant_k, quant_v, k_group = rows.quant_k, rows.quant_v, rows.k_group
    hd_ = call.q.shape[1]
    vc4, vp = (rows.vc4, rows.vp) if rows.v4 else (None, None)
    rows_k4 = ((rows.kc4, rows.kp, rows.kr) if rows.k4 and rows.kc4 is not None
               and rows.kp is not None and rows.kr is not None else None)
    q__jd, group_q0, out__jd, imp__l = call.q, call.group_q0, call.out, call.imp
    probs__jl = call.probs
    n_pos, n_back, window, first, imp_mode = (call.n_pos, call.n_back, call.window, call.first,
                                              call.imp_mode)
    if probs__jl is None:
        raise ValueError("attend_rows: expected call.probs, the (nq, L) probability matrix")
    scale, softcap = call.scale, call.softcap
    nkv = len(head_len__h)
    L = probs__jl.shape[1]
    scale = _F32(scale)
    softcap = _F32(softcap)
    probs__jl[:] = 0
    fresh = np.zeros(min(len(imp__l), L), dtype=_F32)                 # (m,) imp_mode 2 buffer
    for g in range(nkv):
        cnt = int(group_q0[g + 1] - group_q0[g])
        if cnt == 0:
            continue
        per = cnt // n_pos
        stored = int(head_len__h[g])
        k4_raw = None if rows_k4 is None else _k4_raw(
            q__jd[int(group_q0[g]):int(group_q0[g + 1])], rows_k4[0][g], rows_k4[1][g],
            rows_k4[2][g], stored)                                     # (cnt, stored)
        for jl in range(cnt):
            j = int(group_q0[g]) + jl
            f, e = visible_range(stored, n_back, jl // per, window, first, L)
            out__jd[j] = 0
            if e <= f:
                continue
            qj = q__jd[j]                                              # (hd,)
            if k4_raw is not None:
                with np.errstate(invalid="ignore", over="ignore"):
                    sc = k4_raw[jl, f:e] * scale
            elif quant_k:
                raw = np.zeros((1, e - f), dtype=_F32)                 # (1, r)
                q8_scores(qj[None, :], kq__hcd[g, f:e], ks__hcg[g, f:e], raw, k_group)
                with np.errstate(invalid="ignore", over="ignore"):
                    sc = raw[0] * scale                                # bit-exact scores
            else:
                sc = (kf__hcd[g, f:e] @ qj) * scale                    # (r,)
            if softcap > 0:
                fin = np.isfinite(sc)
                sc[fin] = softcap * np.tanh(sc[fin] / softcap)
            m = np.fmax.reduce(sc, initial=-np.inf)                    # NaN ignored
            with np.errstate(invalid="ignore", over="ignore"):
                p = np.exp(sc - _F32(m)).astype(_F32)                  # (r,)
                tot = p.sum(dtype=_F32)
                if tot > 0:
                    p = p / tot
            probs__jl[j, f:e] = p
            w = p * vs__hc1[g, f:e, 0] if quant_v else p               # (r,)
            keep = ~(np.abs(w) < 1e-12)                                # skip rule; NaN kept
            if vc4 is not None and vp is not None:
                vrows = dequantize_v4(vc4[g, f:e][keep], vp[g, f:e][keep], hd_)
            else:
                vrows = vq__hcd[g, f:e][keep].astype(_F32) if quant_v else vf__hcd[g, f:e][keep]
            with np.errstate(invalid="ignore", over="ignore"):
                o = (w[keep] @ vrows).astype(_F32)                      # (hd,)
            if quant_v:
                o = o * vcol__hd[g]
            out__jd[j] = o
            lim = min(len(imp__l), stored, L)
            if imp_mode == 1:
                imp__l[:lim] += probs__jl[j, :lim]
            elif imp_mode == 2:
                fresh[:lim] += probs__jl[j, :lim]
    if imp_mode == 2:
        imp__l[: fresh.shape[0]] += fresh



def attend_blocked(rows: Rows, call: AttendCall) -> None:
    """NumPy twin of ``_core.attend_blocked``: the same visible ranges and arithmetic in one
    softmax per query (the kernel's tiles change only the rounding).  int8 keys are
    scored with the integer arithmetic of ``q8_scores`` (bit for bit), int8 values are
    dequantised as int8 value times scale, every visible row is summed (no skip rule), the
    output is (sum of exp(s - max) * v) / (sum of exp(s - max)), times the V column in q8.
    Importance (imp_mode 2) is each query's exp(s - max) / sum added in (group, query) order:
    the kernel's one pass (tile exponentials rescaled by exp(tile max - max), docs/numerics.md)
    and its task order change only the rounding, within the bound given there."""
    kf__hcd, kq__hcd, ks__hcg, vf__hcd, vq__hcd, vs__hc1, vcol__hd, head_len__h = rows[:8]
    quant_k, quant_v, k_group = rows.quant_k, rows.quant_v, rows.k_group
    q__jd, group_q0, out__jd, imp__l = call.q, call.group_q0, call.out, call.imp
    n_pos, n_back, window, first, imp_mode = (call.n_pos, call.n_back, call.window, call.first,
                                              call.imp_mode)
    scale, softcap = call.scale, call.softcap
    nkv = len(head_len__h)
    scale = _F32(scale)
    softcap = _F32(softcap)
    fresh = np.zeros(len(imp__l), dtype=_F32)                          # (m,) imp_mode 2 buffer
    for g in range(nkv):
        cnt = int(group_q0[g + 1] - group_q0[g])
        if cnt == 0:
            continue
        per = cnt // n_pos
        stored = int(head_len__h[g])
        keys = None if quant_k else kf__hcd[g, :stored]                        # (T, hd)
        if rows.k4 and rows.kc4 is not None and rows.kp is not None and rows.kr is not None:
            keys = k4_keys(rows.kc4[g], rows.kp[g], rows.kr[g], stored)      # their values
        if rows.v4 and rows.vc4 is not None and rows.vp is not None:
            vals = dequantize_v4(rows.vc4[g, :stored], rows.vp[g, :stored],
                                 q__jd.shape[1])                               # (T, hd)
        else:
            vals = (vq__hcd[g, :stored].astype(_F32) * vs__hc1[g, :stored, :1] if quant_v
                    else vf__hcd[g, :stored])                                  # (T, hd)
        for jl in range(cnt):
            j = int(group_q0[g]) + jl
            f, e = visible_range(stored, n_back, jl // per, window, first, stored)
            out__jd[j] = 0
            if e <= f:
                continue
            with np.errstate(invalid="ignore", over="ignore"):
                if keys is None:                                                # q8 scoring
                    raw = np.zeros((1, e - f), dtype=_F32)
                    q8_scores(q__jd[j][None, :], kq__hcd[g, f:e], ks__hcg[g, f:e], raw, k_group)
                    sc = raw[0] * scale                                         # (r,)
                else:
                    sc = (keys[f:e] @ q__jd[j]).astype(_F32) * scale           # (r,)
                if softcap > 0:
                    fin = np.isfinite(sc)
                    sc[fin] = softcap * np.tanh(sc[fin] / softcap)
                m = np.fmax.reduce(sc, initial=-np.inf)                         # NaN ignored
                ex = np.exp(sc - _F32(m if m > -np.inf else 0)).astype(_F32)   # (r,)
                tot = ex.sum(dtype=_F32)
                o = (ex @ vals[f:e]).astype(_F32) / tot                         # (hd,)
                if quant_v:
                    o = o * vcol__hd[g]
                out__jd[j] = o
                if imp_mode == 2:
                    lim = min(len(imp__l), e)
                    if lim > f:
                        div = tot if tot > 0 else _F32(1)               # as the kernel
                        fresh[f:lim] += (np.exp(sc - _F32(m)).astype(_F32) / div)[:lim - f]
    if imp_mode == 2:
        imp__l += fresh


def _this() -> ModuleType:
    return sys.modules[__name__]


@contextlib.contextmanager
def _on_twins(obj: Any) -> Iterator[None]:
    """Run ``obj`` (a layer or a static cache) on this module's kernels for one call: its
    ``kernels`` attribute names the kernel module it calls; what it was is put back after.
    (The object runs on the twins for every caller meanwhile: for tests, one thread.)"""
    own = vars(obj)
    had, before = "kernels" in own, own.get("kernels")
    obj.kernels = _this()
    try:
        yield
    finally:
        if had:
            obj.kernels = before
        else:
            del obj.kernels                 # back to the class's: the compiled kernels


def attend_all_heads(layer: LayerKvCache, q: FloatArrayLike, *, scale: float | None = None,
                     window: int | None = None, softcap: float = 0.0,
                     out: F32 | None = None, prefill: bool | None = None) -> F32:
    """``layer.attend_all_heads`` run on the NumPy kernels (adds importance like the real one)."""
    with _on_twins(layer):
        return layer.attend_all_heads(q, scale=scale, window=window, softcap=softcap, out=out,
                                      prefill=prefill)


def attend(layer: LayerKvCache, q: FloatArrayLike, kv_head: int) -> tuple[F32, F32]:
    """``layer.attend`` run on the NumPy kernels."""
    with _on_twins(layer):
        return layer.attend(q, kv_head)


def attend_group(layer: LayerKvCache, q_group: FloatArrayLike, kv_head: int, out: F32,
                 imp_acc: F32, scale: float, first: int, softcap: float) -> None:
    """``layer.attend_group`` run on the NumPy kernels."""
    with _on_twins(layer):
        layer.attend_group(q_group, kv_head, out, imp_acc, scale, first, softcap)


def o1_seal(layer: LayerKvCache, num_heads: int) -> bool:
    """``layer.o1_seal`` with the prompt replayed by the NumPy ``o1_absorb``."""
    with _on_twins(layer):
        return layer.o1_seal(num_heads)


def o1_step_layer(layer: LayerKvCache, q_all: FloatArrayLike, k_new: FloatArrayLike,
                  v_new: FloatArrayLike, num_heads: int) -> F32:
    """``layer.o1_step`` run on the NumPy ``o1_step``."""
    with _on_twins(layer):
        return layer.o1_step(q_all, k_new, v_new, num_heads)


def static_attend(cache: StaticKvCache, layer: int, q: FloatArrayLike, *,
                  scale: float | None = None, softcap: float = 0.0,
                  window: int | None = None) -> F32:
    """``StaticKvCache.attend`` run on the NumPy kernels."""
    with _on_twins(cache):
        return cache.attend(layer, q, scale=scale, softcap=softcap, window=window)


# ---------------------------------------------------------------------------------------------
# Multi-head Latent Attention (DeepSeek-V2).  Shapes: q_nope (n, H, dn), q_rope (n, H, dr),
# latent (T, r), k_rope (T, dr), w_uk (H, dn, r), w_uv (H, dv, r); query position i of n sees
# rows [0, T - n + i + 1).  Both forms compute in the inputs' float dtype (float32 in, float32
# arithmetic; float64 in, float64: the high-precision oracle of the tests).

def _mla_softmax(s: npt.NDArray[_Fl]) -> npt.NDArray[_Fl]:
    """Softmax over the last axis (IEEE: a NaN, or every score -inf, gives NaN)."""
    m = s.max(axis=-1, keepdims=True)
    e = np.exp(s - m)
    p: npt.NDArray[_Fl] = e / e.sum(axis=-1, keepdims=True)
    return p


def mla_absorbed(q_nope: npt.NDArray[_Fl], q_rope: npt.NDArray[_Fl], latent: npt.NDArray[_Fl],
                 k_rope: npt.NDArray[_Fl], w_uk: npt.NDArray[_Fl], w_uv: npt.NDArray[_Fl],
                 scale: float | np.floating[Any]) -> npt.NDArray[_Fl]:
    """The absorbed form in NumPy: fold W_UK into the query, score against [latent | k_rope],
    softmax, accumulate the latent, apply W_UV.  Returns (n, H, dv).  Each position reads only
    its visible rows (so nothing in a hidden row, not even a NaN, reaches it)."""
    n, T = q_nope.shape[0], latent.shape[0]
    q_abs = np.einsum("nhk,hkr->nhr", q_nope, w_uk)                        # (n, H, r)
    c = np.empty(q_abs.shape, dtype=np.result_type(q_abs, latent))
    for i in range(n):
        vis = T - n + i + 1
        s = (q_abs[i] @ latent[:vis].T + q_rope[i] @ k_rope[:vis].T) * q_nope.dtype.type(scale)
        c[i] = _mla_softmax(s) @ latent[:vis]                             # (H, r)
    out: npt.NDArray[_Fl] = np.einsum("nhr,hjr->nhj", c, w_uv)            # (n, H, dv)
    return out


def mla_naive(q_nope: npt.NDArray[_Fl], q_rope: npt.NDArray[_Fl], latent: npt.NDArray[_Fl],
              k_rope: npt.NDArray[_Fl], w_uk: npt.NDArray[_Fl], w_uv: npt.NDArray[_Fl],
              scale: float | np.floating[Any]) -> npt.NDArray[_Fl]:
    """The naive form: materialise every head's keys K[h] = latent W_UK[h]^T (T, dn) and values
    V[h] = latent W_UV[h]^T (T, dv), then ordinary attention over [K[h] | k_rope].
    Returns (n, H, dv).  This is what a runner without weight absorption computes per step (and
    what the benchmark times as the NumPy baseline).  Position i reads rows [0, T - n + i + 1)."""
    n, T = q_nope.shape[0], latent.shape[0]
    k_nope = np.matmul(latent[None], np.swapaxes(w_uk, 1, 2))                # (H, T, dn)
    v = np.matmul(latent[None], np.swapaxes(w_uv, 1, 2))                     # (H, T, dv)
    out = np.empty((n, w_uv.shape[0], w_uv.shape[1]), dtype=v.dtype)
    for i in range(n):
        vis = T - n + i + 1
        s = (np.matmul(k_nope[:, :vis], q_nope[i][:, :, None])[..., 0]      # (H, vis)
             + q_rope[i] @ k_rope[:vis].T) * q_nope.dtype.type(scale)
        out[i] = np.matmul(_mla_softmax(s)[:, None, :], v[:, :vis])[:, 0]   # (H, dv)
    return out


def mla_attend(call: MlaCall) -> None:
    """Twin of ``_core.mla_attend``: the absorbed form in float32, written into call.out."""
    f = [np.asarray(a, dtype=_F32) for a in call[:6]]
    scale, out__nhj = call.scale, call.out
    n = f[0].shape[0]
    if n == 0 or f[0].shape[1] == 0:
        return
    if f[2].shape[0] < n:
        raise ValueError(f"MLA kernel: {n} query positions need at least {n} cached rows, "
                         f"got {f[2].shape[0]}")
    out__nhj[...] = mla_absorbed(f[0], f[1], f[2], f[3], f[4], f[5], _F32(scale))


# ---------------------------------------------------------------------------- int8 storage
def q8_storage(k: FloatArrayLike, v: FloatArrayLike, alive: npt.ArrayLike | None,
               quant_k: bool, quant_v: bool, scheme: str) -> dict[str, list[npt.NDArray[Any]]]:
    """What a LayerKvCache in int8 scheme ``scheme`` stores for the positions ``k``, ``v``
    (n, nkv, hd) appended in order (``alive`` (n, nkv) bool, None for all alive), by the words
    of docs/numerics.md, "int8 storage", position by position in NumPy.

    Returns per-head lists: ``kq``/``ks`` (rows, hd) int8 / (rows, ceil(hd/group)) float32 when
    ``quant_k`` (group = the scheme's K group, :func:`kvcache.quant.k_group`: 16 for "rows",
    32 for "cmf"), ``vq``/``vs`` (rows, hd) / (rows,) when ``quant_v``, and ``kcol``/``vcol``,
    each head's frozen column field (hd,) or None.

    "rows": each row by itself (:func:`quantize_rows`, no column; K in 16-channel groups, a
    partial last group when hd is not a multiple of 16), so nothing depends on what else is
    stored.  "cmf": the same until position 64; the append of a position that finds
    64 or more stored positions and no column frozen first freezes, for every head and int8
    component holding rows, ``col = max(sqrt(mean of squares of the dequantised rows), 1e-6)``
    (float32, rows summed in order) and requantises those rows over it; later rows are
    quantised over the column."""
    if scheme not in ("rows", "cmf"):
        raise ValueError(f"scheme: expected 'rows' or 'cmf', got {scheme!r}")
    ka = np.asarray(k, dtype=_F32)
    va = np.asarray(v, dtype=_F32)
    n, nkv, hd = ka.shape
    live = np.ones((n, nkv), bool) if alive is None else np.asarray(alive, dtype=bool)
    comps = [(name, x, group) for name, x, group, on in
             (("k", ka, k_group(scheme), quant_k), ("v", va, hd, quant_v)) if on]
    codes: dict[str, list[list[npt.NDArray[np.int8]]]] = {c: [[] for _ in range(nkv)] for c, _, _ in comps}
    scales: dict[str, list[list[npt.NDArray[np.float32]]]] = {c: [[] for _ in range(nkv)] for c, _, _ in comps}
    cols: dict[str, list[npt.NDArray[np.float32] | None]] = {c: [None] * nkv for c, _, _ in comps}
    empty = np.zeros(0, dtype=_F32)
    ng = {c: -(-hd // g) for c, _, g in comps}

    def quantise(row: npt.NDArray[np.float32], col: npt.NDArray[np.float32] | None,
                 c: str, group: int) -> tuple[npt.NDArray[np.int8], npt.NDArray[np.float32]]:
        q = np.zeros((1, hd), np.int8)
        s = np.zeros((1, ng[c]), _F32)
        quantize_rows(row[None], empty if col is None else col, group, q, s)
        return q[0], s[0]

    frozen = False
    for i in range(n):
        if scheme == "cmf" and i >= 64 and not frozen:
            for c, _, group in comps:
                for h in range(nkv):
                    if not codes[c][h]:
                        continue
                    x = np.array([qr.astype(_F32) * np.repeat(sr, group)[:hd]
                                  for qr, sr in zip(codes[c][h], scales[c][h])], dtype=_F32)
                    sq = np.zeros(hd, dtype=_F32)
                    with np.errstate(invalid="ignore", over="ignore"):
                        for xr in x:
                            sq += xr * xr
                        col = np.maximum(np.sqrt(sq / _F32(len(x))), _F32(1e-6)).astype(_F32)
                    cols[c][h] = col
                    redone = [quantise(xr, col, c, group) for xr in x]
                    codes[c][h] = [q for q, _ in redone]
                    scales[c][h] = [s for _, s in redone]
                    frozen = True
        for c, x, group in comps:
            for h in range(nkv):
                if live[i, h]:
                    q, s = quantise(x[i, h], cols[c][h], c, group)
                    codes[c][h].append(q)
                    scales[c][h].append(s)
    out: dict[str, list[npt.NDArray[Any]]] = {}
    for c, _, _ in comps:
        out[f"{c}q"] = [np.array(codes[c][h], np.int8).reshape(-1, hd) for h in range(nkv)]
        s_all = [np.array(scales[c][h], _F32).reshape(-1, ng[c]) for h in range(nkv)]
        out[f"{c}s"] = s_all if c == "k" else [a[:, 0] for a in s_all]
        out[f"{c}col"] = list(cols[c])            # type: ignore[arg-type]
    return out
