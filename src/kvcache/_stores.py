"""Row stores: how one component (K or V) of a :class:`kvcache.LayerKvCache` keeps its rows.

A layer holds two stores, one for K and one for V, each of one storage kind:

* :class:`F32Rows` -- float32 rows ``f`` (nkv, cap, hd);
* :class:`K4Rows` -- 4-bit K per channel over blocks of 32 rows, codes ``c``, block parameters
  ``p`` and a float32 ring ``r`` of the last 64 rows (docs/kv4.md);
* :class:`V4Rows` -- 4-bit V rows ``c`` (nkv, cap, hd / 2) and their float16 parameters ``p``
  (docs/kv4.md);
* :class:`Q8Rows` -- int8 rows ``q`` (nkv, cap, hd) and float32 scales ``s`` (nkv, cap, ng),
  ``ng = ceil(hd / group)``: K in groups of 16 channels (scheme "rows") or 32 ("cmf"), V one
  scale per row (group = hd).  In the scheme "cmf" the store also freezes its column field
  once (:func:`kvcache.quant.freeze_columns`); rows are quantised against it from then on.

Every store has a column field ``col`` (nkv, hd) float32 and ``col_on`` (nkv,) uint8: ones
and zeros unless a "cmf" store froze them, so that the kernels' descriptor and the layer's
state read the same fields whatever the kind.  Storage is head-major: a head's rows are one
contiguous block, ``cap`` rows per head of which the layer's ``lengths[h]`` hold data.

What the layer calls (one protocol for every kind; a new kind is one class here plus its
kernels): :meth:`RowStore.grown` (a new store with room for ``cap`` rows, allocated before the
layer changes anything), :meth:`~RowStore.write` (append rows at each head's length),
:meth:`~RowStore.shift` (compact a head's rows), :meth:`~RowStore.freeze`,
:meth:`~RowStore.floats` / :meth:`~RowStore.int8` (read-only access to a head's rows),
:meth:`~RowStore.parts` (the arrays the attention kernels read, and the layer state's),
:func:`from_state` (stores holding a state's arrays), ``row_bytes`` (sized by
:mod:`kvcache.quant`, the one place row sizes are computed).
"""

from __future__ import annotations

import copy
from typing import Any, ClassVar, Optional, TypeVar

import numpy as np
import numpy.typing as npt

from . import _core, quant
from ._state import LayerState
from ._entry import K4_BLOCK, K4_RING, Rows, ring_slots
from .modes import DEFAULT_SCHEME, KvMode

__all__ = ["F32Rows", "K4Rows", "Q8Rows", "RowStore", "V4Rows", "from_state", "kernel_rows",
           "stores_for"]

F32 = npt.NDArray[np.float32]
I8 = npt.NDArray[np.int8]
U8 = npt.NDArray[np.uint8]
U16 = npt.NDArray[np.uint16]
IP = npt.NDArray[np.intp]
S = TypeVar("S", bound="RowStore")

_F32 = np.dtype(np.float32)


class RowStore:
    """One component's rows (see the module docstring); the base of the storage kinds."""

    quantised: ClassVar[bool] = False
    _names: ClassVar[tuple[str, ...]] = ()    # the (nkv, cap, width) arrays, in state order

    def __init__(self, nkv: int, hd: int, row_bytes: int) -> None:
        self.nkv, self.hd = nkv, hd
        self.row_bytes = row_bytes
        self.col: F32 = np.ones((nkv, hd), dtype=_F32)
        self.col_on: U8 = np.zeros(nkv, dtype=np.uint8)

    @property
    def capacity(self) -> int:
        """Rows per head the arrays hold."""
        return int(getattr(self, self._names[0]).shape[1])

    @property
    def freezes(self) -> bool:
        """Whether this store freezes a column field (int8 in the scheme "cmf")."""
        return False

    def grown(self: S, cap: int, used: int) -> S:
        """A store like this one with room for ``cap`` rows per head, rows ``[0, used)``
        copied, the column field shared.  Everything is allocated before the caller commits,
        so a MemoryError leaves the layer as it was."""
        new = copy.copy(self)
        for name in self._names:
            old: npt.NDArray[Any] = getattr(self, name)
            arr: npt.NDArray[Any] = np.empty((self.nkv, cap) + old.shape[2:], dtype=old.dtype)
            arr[:, :used] = old[:, :used]
            setattr(new, name, arr)
        return new

    def write(self, x3: F32, live: U8, lengths: IP) -> None:
        """Store rows ``x3`` (n, nkv, hd) after each live head's ``lengths[h]`` rows (the
        caller made room and advances the lengths)."""
        raise NotImplementedError

    def shift(self, h: int, n: int, keep_idx: Optional[IP] = None, drop: int = 0) -> None:
        """Compact head h's ``n`` rows: keep rows ``keep_idx`` (sorted) or drop the first
        ``drop``."""
        for name in self._names:
            arr: npt.NDArray[Any] = getattr(self, name)
            if keep_idx is None:
                arr[h, : n - drop] = arr[h, drop:n].copy()
            else:
                arr[h, : keep_idx.size] = arr[h, keep_idx]

    def freeze(self, lengths: IP) -> None:
        """Freeze the column field of every head holding rows (only a "cmf" store does)."""

    def frozen_col(self) -> Optional[F32]:
        """The column field when some head froze one (the queries are folded with it)."""
        return self.col if self.col_on.any() else None

    def floats(self, h: int, n: int) -> Optional[F32]:
        """Head h's first ``n`` rows as float32, when stored as such (else None)."""
        return None

    def int8(self, h: int, n: int) -> Optional[tuple[I8, F32]]:
        """Head h's first ``n`` int8 rows and their scales, when stored as such (else None)."""
        return None

    def values(self, h: int, n: int) -> F32:
        """Head h's first ``n`` rows as the float32 values the kernels read: a view of the
        store for float32 rows, a new array of the dequantised values otherwise."""
        raise NotImplementedError

    def parts(self) -> tuple[Optional[F32], Optional[I8], Optional[F32]]:
        """The arrays the attention kernels read: (float32 rows, int8 rows, scales), None
        where this kind stores none (:class:`kvcache._entry.Rows`)."""
        raise NotImplementedError

    def packed(self) -> tuple[Optional[U8], Optional[U16]]:
        """The 4-bit V arrays (codes, float16 parameters as uint16), or (None, None)."""
        return None, None

    def k4(self) -> Optional[tuple[U8, U16, F32]]:
        """The 4-bit K arrays (codes, block parameters, ring), or None."""
        return None

    def bytes_held(self, lengths: IP) -> int:
        """Bytes of the rows the heads hold (``lengths[h]`` each): what ``memory_bytes``
        counts."""
        return int(lengths.sum()) * self.row_bytes

    def truncated(self, old: IP, new: IP) -> None:
        """The layer dropped each head's rows past ``new[h]`` (it held ``old[h]``)."""


class F32Rows(RowStore):
    """float32 rows ``f`` (nkv, cap, hd)."""

    _names = ("f",)

    def __init__(self, nkv: int, hd: int, row_bytes: int) -> None:
        super().__init__(nkv, hd, row_bytes)
        self.f: F32 = np.zeros((nkv, 0, hd), dtype=_F32)

    def write(self, x3: F32, live: U8, lengths: IP) -> None:
        _core.store_rows_f32(x__nhd=x3, alive__h=live, head_len__h=lengths, store__hcd=self.f)

    def frozen_col(self) -> Optional[F32]:
        return None

    def floats(self, h: int, n: int) -> Optional[F32]:
        return self.f[h, :n]

    def values(self, h: int, n: int) -> F32:
        return self.f[h, :n]

    def parts(self) -> tuple[Optional[F32], Optional[I8], Optional[F32]]:
        return self.f, None, None


class Q8Rows(RowStore):
    """int8 rows ``q`` (nkv, cap, hd), one float32 scale per ``group`` channels in ``s``
    (nkv, cap, ceil(hd / group)); ``cmf``: the store freezes its column field."""

    quantised = True
    _names = ("q", "s")

    def __init__(self, nkv: int, hd: int, row_bytes: int, group: int, cmf: bool) -> None:
        super().__init__(nkv, hd, row_bytes)
        self.group, self.cmf = group, cmf
        self.q: I8 = np.zeros((nkv, 0, hd), dtype=np.int8)
        self.s: F32 = np.zeros((nkv, 0, quant.n_groups(hd, group)), dtype=_F32)

    @property
    def freezes(self) -> bool:
        return self.cmf

    def write(self, x3: F32, live: U8, lengths: IP) -> None:
        _core.store_rows_q8(x__nhd=x3, alive__h=live, head_len__h=lengths, col__hd=self.col,
                            col_on__h=self.col_on, group=self.group, q__hcd=self.q,
                            s__hcg=self.s)

    def freeze(self, lengths: IP) -> None:
        if self.cmf:
            quant.freeze_columns(self.q, self.s, lengths, self.group, self.col, self.col_on,
                                 _core)

    def int8(self, h: int, n: int) -> Optional[tuple[I8, F32]]:
        return self.q[h, :n], self.s[h, :n]

    def values(self, h: int, n: int) -> F32:
        out = quant.dequantize(self.q[h, :n], self.s[h, :n], self.group)
        if self.col_on[h]:                  # rows quantised over the frozen column field
            with np.errstate(invalid="ignore", over="ignore"):
                out *= self.col[h]
        return out

    def parts(self) -> tuple[Optional[F32], Optional[I8], Optional[F32]]:
        return None, self.q, self.s


class V4Rows(RowStore):
    """4-bit V rows (docs/kv4.md): codes ``c`` (nkv, cap, hd / 2) uint8, two per byte, and
    per 16 channels a float16 step and minimum in ``p`` (nkv, cap, 2 * ceil(hd / 16)), kept as
    their uint16 bits.  A row's bytes depend only on its own values."""

    quantised = True
    _names = ("c", "p")

    def __init__(self, nkv: int, hd: int, row_bytes: int) -> None:
        quant.check_v4_head_dim(hd)
        super().__init__(nkv, hd, row_bytes)
        self.c: U8 = np.zeros((nkv, 0, hd // 2), dtype=np.uint8)
        self.p: U16 = np.zeros((nkv, 0, 2 * quant.n_groups(hd, quant.V4_GROUP)),
                               dtype=np.uint16)

    def write(self, x3: F32, live: U8, lengths: IP) -> None:
        _core.store_rows_v4(x__nhd=x3, alive__h=live, head_len__h=lengths, c__hcb=self.c,
                            p__hcp=self.p)

    def frozen_col(self) -> Optional[F32]:
        return None

    def parts(self) -> tuple[Optional[F32], Optional[I8], Optional[F32]]:
        return None, None, None

    def packed(self) -> tuple[Optional[U8], Optional[U16]]:
        return self.c, self.p

    def values(self, h: int, n: int) -> F32:
        return quant.v4_values(self.c[h, :n], self.p[h, :n], self.hd)


class K4Rows(RowStore):
    """4-bit K (docs/kv4.md): per channel over blocks of ``K4_BLOCK`` (32) rows.  Codes ``c``
    (nkv, cap, hd / 2) uint8 of the closed blocks (each block's rows of bytes in the block
    layout); their parameters ``p`` (nkv, ceil(cap / 32), 2 * hd) float16 as uint16 bits (per
    block the hd steps, then the hd minimums); the float32 ring ``r`` (nkv, K4_RING, hd) of
    each head's last 64 rows (row ``i`` at slot ``i % 64``), which holds the open block and
    lets a rollback of up to 32 rows reopen blocks from their original values.  Head h's rows
    below ``32 * (len // 32)`` are read as codes, the others from the ring."""

    quantised = True
    _names = ("c", "p", "r")

    def __init__(self, nkv: int, hd: int, row_bytes: int) -> None:
        quant.check_k4_head_dim(hd)
        super().__init__(nkv, hd, row_bytes)
        self.c: U8 = np.zeros((nkv, 0, hd // 2), dtype=np.uint8)
        self.p: U16 = np.zeros((nkv, 0, 2 * hd), dtype=np.uint16)
        self.r: F32 = np.zeros((nkv, K4_RING, hd), dtype=_F32)

    def grown(self, cap: int, used: int) -> K4Rows:
        new = copy.copy(self)
        nb, used_b = -(-cap // K4_BLOCK), used // K4_BLOCK
        new.c = np.empty((self.nkv, cap, self.hd // 2), dtype=np.uint8)
        new.c[:, :used] = self.c[:, :used]
        new.p = np.empty((self.nkv, nb, 2 * self.hd), dtype=np.uint16)
        new.p[:, :used_b] = self.p[:, :used_b]
        new.r = self.r.copy()
        return new

    def write(self, x3: F32, live: U8, lengths: IP) -> None:
        _core.store_rows_k4(x__nhd=x3, alive__h=live, head_len__h=lengths, c__hcb=self.c,
                            p__hbq=self.p, r__hrd=self.r)

    def values(self, h: int, n: int) -> F32:
        """Head h's first ``n`` rows as the kernels read them: the codes' values in closed
        blocks, the ring's rows of the open block."""
        q = n // K4_BLOCK * K4_BLOCK
        out = quant.k4_values(self.c[h], self.p[h], n)
        out[q:] = self.r[h, ring_slots(q, n)]
        return out

    def nearest(self, h: int, n: int) -> F32:
        """Head h's first ``n`` rows as near the originals as the store holds them: the ring's
        rows (the last 64, originals unless a deep rollback or a load left images there), the
        codes' values before them (what eviction requantises from)."""
        out = quant.k4_values(self.c[h], self.p[h], n)
        lo = max(0, n - K4_RING)
        out[lo:] = self.r[h, ring_slots(lo, n)]
        return out

    def truncated(self, old: IP, new: IP) -> None:
        for h in range(self.nkv):
            o, n = int(old[h]), int(new[h])
            lo, hi = max(0, n - K4_RING), min(n, o - K4_RING)
            if hi > lo:            # slots overwritten since: the rows' values from the codes
                # (rows below o - 64 are in blocks that were closed: whole blocks up to hi)
                vals = quant.k4_values(self.c[h], self.p[h], -(-hi // K4_BLOCK) * K4_BLOCK, lo)
                self.r[h, ring_slots(lo, hi)] = vals[: hi - lo]

    def shift(self, h: int, n: int, keep_idx: Optional[IP] = None, drop: int = 0) -> None:
        rows = self.nearest(h, n)
        rows = rows[drop:n] if keep_idx is None else rows[keep_idx]
        x3 = np.zeros((rows.shape[0], self.nkv, self.hd), dtype=_F32)
        x3[:, h] = rows
        live = np.zeros(self.nkv, dtype=np.uint8)
        live[h] = 1
        self.write(x3, live, np.zeros(self.nkv, dtype=np.intp))

    def frozen_col(self) -> Optional[F32]:
        return None

    def parts(self) -> tuple[Optional[F32], Optional[I8], Optional[F32]]:
        return None, None, None

    def k4(self) -> Optional[tuple[U8, U16, F32]]:
        return self.c, self.p, self.r

    def bytes_held(self, lengths: IP) -> int:
        q = (lengths // K4_BLOCK) * K4_BLOCK
        return int((q * (self.hd // 2) + q // K4_BLOCK * 4 * self.hd
                    + np.minimum(lengths, K4_RING) * 4 * self.hd).sum())


def _store(c: str, mode: KvMode, nkv: int, hd: int) -> RowStore:
    """An empty store of component ``c`` ("k" or "v") in ``mode``."""
    if c == "k" and mode.k4:
        return K4Rows(nkv, hd, quant.k4_row_bytes(hd))
    if c == "k" and mode.quant_k:
        return Q8Rows(nkv, hd, quant.k_row_bytes(hd, scheme=mode.scheme),
                      quant.k_group(mode.scheme), mode.freezes_columns)
    if c == "v" and mode.quant_v:
        return Q8Rows(nkv, hd, quant.v_row_bytes(hd), hd, mode.freezes_columns)
    if c == "v" and mode.v4:
        return V4Rows(nkv, hd, quant.v4_row_bytes(hd))
    return F32Rows(nkv, hd, quant.v_row_bytes(hd, False))


def stores_for(mode: KvMode, nkv: int, hd: int) -> tuple[RowStore, RowStore]:
    """Empty (K, V) stores of a layer of ``nkv`` x ``hd`` in ``mode``."""
    return _store("k", mode, nkv, hd), _store("v", mode, nkv, hd)


def from_state(state: LayerState) -> tuple[RowStore, RowStore]:
    """The (K, V) stores holding a checked state's own arrays (no copies)."""
    out = []
    for c in ("k", "v"):
        st = _store(c, state.mode, state.num_kv_heads, state.head_dim)
        for name in st._names:
            setattr(st, name, getattr(state, c + name))
        st.col = getattr(state, c + "col")
        st.col_on = getattr(state, c + "col_on")
        out.append(st)
    return out[0], out[1]


def kernel_rows(k: RowStore, v: RowStore, lengths: IP, mode: KvMode) -> Rows:
    """A layer's K and V stores as the attention kernels read them (:class:`Rows`): each part
    a store does not hold is an empty array of the shape the kernels' checks accept (K scales
    as wide as the mode's scheme's scale count; a mode with float32 K takes the default
    scheme's)."""
    nkv, hd = k.nkv, k.hd
    kf, kq, ks = k.parts()
    vf, vq, vs = v.parts()
    vc, vp = v.packed()
    k4 = k.k4()
    kc, kp, kr = k4 if k4 is not None else (None, None, None)
    ef = np.zeros((nkv, 0, hd), dtype=_F32)
    eq = np.zeros((nkv, 0, hd), dtype=np.int8)
    if ks is None:
        ks = np.zeros((nkv, 0, quant.k_scale_count(hd, mode.scheme or DEFAULT_SCHEME)),
                      dtype=_F32)
    return Rows(ef if kf is None else kf, eq if kq is None else kq, ks,
                ef if vf is None else vf, eq if vq is None else vq,
                np.zeros((nkv, 0, 1), dtype=_F32) if vs is None else vs, v.col, lengths,
                mode.quant_k, mode.quant_v, 0, vc, vp, vc is not None, kc, kp, kr,
                k4 is not None)
