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

What the layer calls (one protocol for every kind; a new kind is one class here, listed in
``_KINDS``, plus its kernels): :meth:`RowStore.grown` (a new store with room for ``cap`` rows,
allocated before the layer changes anything), :meth:`~RowStore.write` (append rows at each
head's length), :meth:`~RowStore.shift` (compact a head's rows), :meth:`~RowStore.freeze`,
:meth:`~RowStore.values` (a head's rows as the kernels read them), :meth:`~RowStore.arrays`
(the arrays by name: what the kernels' descriptor, the layer state and the device mirrors
read), ``row_bytes`` (sized by :mod:`kvcache.quant`, the one place row sizes are computed).

What everything that carries a layer reads (the state's checks, the byte formats, the prefix
store's entries, the device mirrors): :func:`spec_of`, a :class:`Spec` had without allocating
anything -- the kind, one :class:`Part` per array (dtype, width, rows per capacity, block
rules), the bytes of a row -- and :meth:`RowStore.head_rows` (which of a head's rows the byte
formats carry), so that none of them branches on the kind.  The kind-specific reads (int8
rows, 4-bit codes) are the layer's own exports (``q8_rows``, ``k4_rows``, ``v4_rows``), which
ask for the class.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any, ClassVar, Optional, TypeVar, Union

import numpy as np
import numpy.typing as npt

from . import _core, quant
from ._entry import K4_BLOCK, K4_RING, Rows, ring_slots
from .modes import DEFAULT_SCHEME, KvMode

if TYPE_CHECKING:
    from ._state import LayerState

__all__ = ["F32Rows", "K4Rows", "Part", "Q8Rows", "RowStore", "Spec", "V4Rows", "from_state",
           "kernel_rows", "kind_of", "spec_of", "specs_of", "state_arrays", "stores_for"]

F32 = npt.NDArray[np.float32]
I8 = npt.NDArray[np.int8]
U8 = npt.NDArray[np.uint8]
U16 = npt.NDArray[np.uint16]
IP = npt.NDArray[np.intp]
S = TypeVar("S", bound="RowStore")

_F32 = np.dtype(np.float32)
Index = Union[slice, IP]


@dataclass(frozen=True)
class Part:
    """One array of a storage kind, (nkv, rows, width): ``name`` is the store's attribute (the
    layer state's field is the component's letter then the name: ``kq``, ``vc``), ``per``
    positions per element of axis 1 (1; 32 for 4-bit K's block parameters), or ``fixed`` rows
    whatever the capacity (4-bit K's ring of 64; a prefix-store entry does not carry such a
    part, the kind rebuilds it), ``what`` names the rows in errors (formatted with "key" or
    "value"), ``halves``: the byte formats may write it as float16 (float32 rows);
    ``f16_bits``: uint16 holding float16 values (a device mirror holds them as float16);
    ``settle``: a row is final only once a block of that many rows closed (4-bit K's codes: a
    mirror re-uploads the open block, a store's load never reopens a block)."""

    name: str
    dtype: np.dtype[Any]
    width: int
    what: str
    per: int = 1
    fixed: int = 0
    halves: bool = False
    f16_bits: bool = False
    settle: int = 1

    def rows(self, cap: int) -> int:
        """Rows along axis 1 for a store of ``cap`` rows per head."""
        return self.fixed or -(-cap // self.per)

    @property
    def by_row(self) -> bool:
        """Whether axis 1 is indexed by position (one element per row, not fixed)."""
        return self.per == 1 and not self.fixed


@dataclass(frozen=True)
class Spec:
    """What component ``c`` of a mode is stored as at a head_dim, without any storage (what
    the state's checks, the byte formats and the prefix store read; :func:`spec_of`): the
    kind, its parts, the bytes of one stored row and the channels per scale (int8; else 0)."""

    kind: type[RowStore]
    parts: tuple[Part, ...]
    row_bytes: int
    group: int = 0

    def head_rows(self, n: int) -> tuple[Index, ...]:
        """:meth:`RowStore.head_rows` of the kind."""
        return self.kind.head_rows(n)

    @property
    def carried(self) -> tuple[Part, ...]:
        """The parts a prefix-store entry carries (those with rows per position)."""
        return tuple(p for p in self.parts if not p.fixed)

    @property
    def settle(self) -> int:
        """Rows after which every part's rows are final (:attr:`Part.settle`)."""
        return max(p.settle for p in self.parts)


class RowStore:
    """One component's rows (see the module docstring); the base of the storage kinds."""

    quantised: ClassVar[bool] = False
    _names: ClassVar[tuple[str, ...]] = ()    # the (nkv, cap, width) arrays, in state order
    #: the byte formats' code of the kind (the quant_k / quant_v bytes): 0 float32, 1 int8, 2 4-bit
    code: ClassVar[int] = 0
    #: the kernels' descriptor flag of the kind ("quant_{}", "{}4" with k or v), "" for float32
    _flag: ClassVar[str] = ""
    #: whether the kind can freeze a column field (int8 rows, in the scheme "cmf")
    can_freeze: ClassVar[bool] = False
    group: int = 0                              # channels per scale (int8 rows)

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

    @classmethod
    def takes(cls, c: str, mode: KvMode) -> bool:
        """Whether component ``c`` ("k" or "v") of ``mode`` is stored as this kind."""
        raise NotImplementedError

    @classmethod
    def spec(cls, c: str, mode: KvMode, hd: int) -> Spec:
        """This kind's :class:`Spec` for component ``c`` of ``mode`` at ``hd`` (ValueError for a
        head_dim the kind cannot store); allocates nothing."""
        raise NotImplementedError

    @classmethod
    def parts(cls, hd: int, group: int) -> tuple[Part, ...]:
        """The kind's arrays at ``hd`` (``group`` channels per scale), in state order."""
        raise NotImplementedError

    @classmethod
    def make(cls, c: str, mode: KvMode, nkv: int, hd: int) -> RowStore:
        """An empty store of component ``c`` of ``mode`` (ValueError for a head_dim the kind
        cannot store); a kind whose constructor takes more than (nkv, hd, row_bytes) says how."""
        return cls(nkv, hd, cls.spec(c, mode, hd).row_bytes)

    def layout(self) -> tuple[Part, ...]:
        """The kind's arrays, in state order."""
        return self.parts(self.hd, self.group)

    def arrays(self) -> dict[str, npt.NDArray[Any]]:
        """The kind's arrays by name (:attr:`Part.name`), in state order."""
        return {name: getattr(self, name) for name in self._names}

    @classmethod
    def head_rows(cls, n: int) -> tuple[Index, ...]:
        """Per part, the rows of a head holding ``n`` positions that the byte formats carry
        (axis 1 of the part's array): all ``n`` unless the kind says otherwise."""
        return (slice(0, n),) * len(cls._names)

    @classmethod
    def rebuilt(cls, carried: dict[str, npt.NDArray[Any]], n: int, m: int,
                own: dict[str, Optional[npt.NDArray[Any]]]) -> dict[str, npt.NDArray[Any]]:
        """The parts a prefix-store entry does not carry (:attr:`Part.fixed`), by name, for
        heads that hold ``n`` rows after a load: ``carried`` holds the other parts' arrays
        (every head's ``n`` rows), rows below ``m`` were the cache's own before the load and
        ``own`` is the cache's arrays by name (None where it held none).  Nothing, unless the
        kind says otherwise."""
        return {}

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

    def installed(self, lengths: IP) -> None:
        """The store now holds a state's arrays (:func:`from_state`), heads of ``lengths``."""

    def frozen_col(self) -> Optional[F32]:
        """The column field when some head froze one (the queries are folded with it)."""
        return self.col if self.col_on.any() else None

    def values(self, h: int, n: int) -> F32:
        """Head h's first ``n`` rows as the float32 values the kernels read: a view of the
        store for float32 rows, a new array of the dequantised values otherwise."""
        raise NotImplementedError

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

    @classmethod
    def takes(cls, c: str, mode: KvMode) -> bool:
        return (mode.k_bits if c == "k" else mode.v_bits) == 32

    @classmethod
    def spec(cls, c: str, mode: KvMode, hd: int) -> Spec:
        return Spec(cls, cls.parts(hd, 0), quant.v_row_bytes(hd, False))

    @classmethod
    def parts(cls, hd: int, group: int) -> tuple[Part, ...]:
        return (Part("f", _F32, hd, "{}s", halves=True),)

    def write(self, x3: F32, live: U8, lengths: IP) -> None:
        _core.store_rows_f32(x__nhd=x3, alive__h=live, head_len__h=lengths, store__hcd=self.f)

    def frozen_col(self) -> Optional[F32]:
        return None

    def values(self, h: int, n: int) -> F32:
        return self.f[h, :n]


class Q8Rows(RowStore):
    """int8 rows ``q`` (nkv, cap, hd), one float32 scale per ``group`` channels in ``s``
    (nkv, cap, ceil(hd / group)); ``cmf``: the store freezes its column field."""

    quantised = True
    _names = ("q", "s")
    code = 1
    _flag = "quant_{}"
    can_freeze = True

    def __init__(self, nkv: int, hd: int, row_bytes: int, group: int, cmf: bool) -> None:
        super().__init__(nkv, hd, row_bytes)
        self.group, self.cmf = group, cmf
        self.q: I8 = np.zeros((nkv, 0, hd), dtype=np.int8)
        self.s: F32 = np.zeros((nkv, 0, quant.n_groups(hd, group)), dtype=_F32)

    @classmethod
    def takes(cls, c: str, mode: KvMode) -> bool:
        return mode.quant_k if c == "k" else mode.quant_v

    @classmethod
    def spec(cls, c: str, mode: KvMode, hd: int) -> Spec:
        if c == "k":           # K: the scheme's groups; V: one scale per row
            group, size = quant.k_group(mode.scheme), quant.k_row_bytes(hd, scheme=mode.scheme)
        else:
            group, size = hd, quant.v_row_bytes(hd)
        return Spec(cls, cls.parts(hd, group), size, group)

    @classmethod
    def parts(cls, hd: int, group: int) -> tuple[Part, ...]:
        return (Part("q", np.dtype(np.int8), hd, "int8 {}s"),
                Part("s", _F32, quant.n_groups(hd, group), "{} scales"))

    @classmethod
    def make(cls, c: str, mode: KvMode, nkv: int, hd: int) -> Q8Rows:
        sp = cls.spec(c, mode, hd)
        return cls(nkv, hd, sp.row_bytes, sp.group, mode.freezes_columns)

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

    def int8(self, h: int, n: int) -> tuple[I8, F32]:
        """Head h's first ``n`` int8 rows and their scales."""
        return self.q[h, :n], self.s[h, :n]

    def values(self, h: int, n: int) -> F32:
        out = quant.dequantize(self.q[h, :n], self.s[h, :n], self.group)
        if self.col_on[h]:                  # rows quantised over the frozen column field
            with np.errstate(invalid="ignore", over="ignore"):
                out *= self.col[h]
        return out


class V4Rows(RowStore):
    """4-bit V rows (docs/kv4.md): codes ``c`` (nkv, cap, hd / 2) uint8, two per byte, and
    per 16 channels a float16 step and minimum in ``p`` (nkv, cap, 2 * ceil(hd / 16)), kept as
    their uint16 bits.  A row's bytes depend only on its own values."""

    quantised = True
    _names = ("c", "p")
    code = 2
    _flag = "{}4"

    def __init__(self, nkv: int, hd: int, row_bytes: int) -> None:
        quant.check_v4_head_dim(hd)
        super().__init__(nkv, hd, row_bytes)
        self.c: U8 = np.zeros((nkv, 0, hd // 2), dtype=np.uint8)
        self.p: U16 = np.zeros((nkv, 0, 2 * quant.n_groups(hd, quant.V4_GROUP)),
                               dtype=np.uint16)

    @classmethod
    def takes(cls, c: str, mode: KvMode) -> bool:
        return c == "v" and mode.v4

    @classmethod
    def spec(cls, c: str, mode: KvMode, hd: int) -> Spec:
        quant.check_v4_head_dim(hd)
        return Spec(cls, cls.parts(hd, 0), quant.v4_row_bytes(hd))

    @classmethod
    def parts(cls, hd: int, group: int) -> tuple[Part, ...]:
        return (Part("c", np.dtype(np.uint8), hd // 2, "4-bit {}s"),
                Part("p", np.dtype(np.uint16), 2 * quant.n_groups(hd, quant.V4_GROUP),
                     "{} parameters", f16_bits=True))

    def write(self, x3: F32, live: U8, lengths: IP) -> None:
        _core.store_rows_v4(x__nhd=x3, alive__h=live, head_len__h=lengths, c__hcb=self.c,
                            p__hcp=self.p)

    def frozen_col(self) -> Optional[F32]:
        return None

    def values(self, h: int, n: int) -> F32:
        return quant.v4_values(self.c[h, :n], self.p[h, :n], self.hd)


class K4Rows(RowStore):
    """4-bit K (docs/kv4.md): per channel over blocks of ``K4_BLOCK`` (32) rows.  Codes ``c``
    (nkv, cap, hd / 2) uint8 of the closed blocks (each block's rows of bytes in the block
    layout); their parameters ``p`` (nkv, ceil(cap / 32), 2 * hd) float16 as uint16 bits (per
    block the hd steps, then the hd minimums); the float32 ring ``r`` (nkv, K4_RING, hd) of
    each head's last 64 rows (row ``i`` at slot ``i % 64``), which holds the open block and
    lets a rollback of up to 32 rows reopen blocks from their original values (deeper, from
    the codes' values: :meth:`truncated`, :meth:`write`).  Head h's rows below
    ``32 * (len // 32)`` are read as codes, the others from the ring."""

    quantised = True
    _names = ("c", "p", "r")
    code = 2
    _flag = "{}4"

    def __init__(self, nkv: int, hd: int, row_bytes: int) -> None:
        quant.check_k4_head_dim(hd)
        super().__init__(nkv, hd, row_bytes)
        self.c: U8 = np.zeros((nkv, 0, hd // 2), dtype=np.uint8)
        self.p: U16 = np.zeros((nkv, 0, 2 * hd), dtype=np.uint16)
        self.r: F32 = np.zeros((nkv, K4_RING, hd), dtype=_F32)
        #: head -> its open block, when a rollback reopened that block with rows read back
        #: from its codes, which (with its parameters) are still those it had (:meth:`write`)
        self.reopened: dict[int, int] = {}
        #: per head, the rows [read[h, 0], read[h, 1]) of the ring that a rollback read back
        #: from the codes (the rows it wrote, and those it kept of an earlier one)
        self.read: IP = np.zeros((nkv, 2), dtype=np.intp)
        #: per head, the length it had when the store took a state's arrays: the ring's rows
        #: below it may have been read back from the codes (a load, a byte format's reader)
        self.unsure: IP = np.zeros(nkv, dtype=np.intp)

    @classmethod
    def takes(cls, c: str, mode: KvMode) -> bool:
        return c == "k" and mode.k4

    @classmethod
    def spec(cls, c: str, mode: KvMode, hd: int) -> Spec:
        quant.check_k4_head_dim(hd)
        return Spec(cls, cls.parts(hd, 0), quant.k4_row_bytes(hd))

    @classmethod
    def parts(cls, hd: int, group: int) -> tuple[Part, ...]:
        return (Part("c", np.dtype(np.uint8), hd // 2, "4-bit {}s", settle=K4_BLOCK),
                Part("p", np.dtype(np.uint16), 2 * hd, "{} parameters", per=K4_BLOCK,
                     f16_bits=True),
                Part("r", _F32, hd, "{} ring", fixed=K4_RING))

    @classmethod
    def head_rows(cls, n: int) -> tuple[Index, ...]:
        """The codes and parameters of the closed blocks, the ring's slots of the last (up to
        64) rows."""
        q = n // K4_BLOCK * K4_BLOCK
        return slice(0, q), slice(0, q // K4_BLOCK), ring_slots(max(0, n - K4_RING), n)

    def grown(self, cap: int, used: int) -> K4Rows:
        new = copy.copy(self)
        nb, used_b = -(-cap // K4_BLOCK), -(-used // K4_BLOCK)
        new.c = np.empty((self.nkv, cap, self.hd // 2), dtype=np.uint8)
        new.p = np.empty((self.nkv, nb, 2 * self.hd), dtype=np.uint16)
        used = min(used_b * K4_BLOCK, self.c.shape[1])  # whole blocks: a reopened one's codes
        new.c[:, :used] = self.c[:, :used]
        new.p[:, :used_b] = self.p[:, :used_b]
        new.r = self.r.copy()
        new.reopened = dict(self.reopened)
        new.read, new.unsure = self.read.copy(), self.unsure.copy()
        return new

    def write(self, x3: F32, live: U8, lengths: IP) -> None:
        """Append rows; a block completes and is quantised from the ring.  A block a rollback
        reopened from its codes keeps its previous codes and parameters when its rows came
        back as they were (:func:`quant.k4_refills`: appending the rolled-back rows again), so
        a deep rollback and replay restore every byte; otherwise it is quantised afresh from
        the ring (docs/kv4.md, "Rollback").  The rows are written up to each such block's end
        first, so the result does not depend on how they arrive."""
        while self.reopened:
            ends = {h: K4_BLOCK * (b + 1) - int(lengths[h]) for h, b in self.reopened.items()
                    if live[h]}
            r = min(ends.values(), default=x3.shape[0] + 1)
            if r > x3.shape[0]:
                break
            closing = {h: self.reopened.pop(h) for h, e in ends.items() if e == r}
            old = {h: (self.c[h, K4_BLOCK * b:K4_BLOCK * (b + 1)].copy(), self.p[h, b].copy())
                   for h, b in closing.items()}
            self._write(x3[:r], live, lengths)
            for h, b in closing.items():
                rows = self.r[h, ring_slots(K4_BLOCK * b, K4_BLOCK * (b + 1))]
                if quant.k4_refills(rows, *old[h]):
                    self.c[h, K4_BLOCK * b:K4_BLOCK * (b + 1)], self.p[h, b] = old[h]
            x3, lengths = x3[r:], lengths + live.astype(np.intp) * r
        if x3.shape[0]:
            self._write(x3, live, lengths)

    def _write(self, x3: F32, live: U8, lengths: IP) -> None:
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

    @classmethod
    def rebuilt(cls, carried: dict[str, npt.NDArray[Any]], n: int, m: int,
                own: dict[str, Optional[npt.NDArray[Any]]]) -> dict[str, npt.NDArray[Any]]:
        """The ring: the cache's own rows below ``m`` (its originals), the loaded rows'
        values from their codes."""
        nkv, _, half = carried["c"].shape
        ring = np.zeros((nkv, K4_RING, 2 * half), dtype=_F32)
        lo = max(0, n - K4_RING)
        slots, kept = ring_slots(lo, n), ring_slots(lo, max(lo, m))
        old = own.get("r")
        for h in range(nkv):
            ring[h, slots] = quant.k4_values(carried["c"][h], carried["p"][h], n, lo)
            if old is not None:
                ring[h, kept] = old[h, kept]
        return {"r": ring}

    def truncated(self, old: IP, new: IP) -> None:
        """The ring's rows below the new lengths that left it since: their values from the
        codes; and which heads' open blocks that reopens with such rows (:meth:`write`)."""
        B = K4_BLOCK
        for h in range(self.nkv):
            o, n = int(old[h]), int(new[h])
            lo, hi = max(0, n - K4_RING), min(n, o - K4_RING)
            read = self.read[h]
            read[1] = min(read[1], n)
            self.unsure[h] = min(self.unsure[h], n)    # rows appended since are the rows
            if hi > lo:            # slots overwritten since: the rows' values from the codes
                # (rows below o - 64 are in blocks that were closed: whole blocks up to hi)
                vals = quant.k4_values(self.c[h], self.p[h], -(-hi // B) * B, lo)
                self.r[h, ring_slots(lo, hi)] = vals[: hi - lo]
                read[:] = lo, max(hi, read[1])   # (the rows kept of earlier ones start at o - 64)
            b, was = n // B, self.reopened.pop(h, None)
            if not n % B or (B * (b + 1) > o and was != b):  # its codes are not the block's
                continue
            if was == b or read[1] > max(B * b, read[0]):     # it holds rows read back
                self.reopened[h] = b
            elif self.unsure[h] > B * b:    # rows a load may have read back: by their bits
                ring = self.r[h, ring_slots(B * b, min(n, int(self.unsure[h])))]
                if quant.k4_read_back(ring, self.c[h], self.p[h], B * b).any():
                    self.reopened[h] = b

    def installed(self, lengths: IP) -> None:
        self.unsure = lengths.copy()

    def shift(self, h: int, n: int, keep_idx: Optional[IP] = None, drop: int = 0) -> None:
        self.reopened.pop(h, None)           # the head's rows are quantised again from 0
        self.read[h], self.unsure[h] = 0, 0
        rows = self.nearest(h, n)
        rows = rows[drop:n] if keep_idx is None else rows[keep_idx]
        x3 = np.zeros((rows.shape[0], self.nkv, self.hd), dtype=_F32)
        x3[:, h] = rows
        live = np.zeros(self.nkv, dtype=np.uint8)
        live[h] = 1
        self.write(x3, live, np.zeros(self.nkv, dtype=np.intp))

    def frozen_col(self) -> Optional[F32]:
        return None

    def bytes_held(self, lengths: IP) -> int:
        q = (lengths // K4_BLOCK) * K4_BLOCK
        return int((q * (self.hd // 2) + q // K4_BLOCK * 4 * self.hd
                    + np.minimum(lengths, K4_RING) * 4 * self.hd).sum())


#: the storage kinds; exactly one takes each component of a mode (by its bits)
_KINDS: tuple[type[RowStore], ...] = (F32Rows, Q8Rows, K4Rows, V4Rows)


def kind_of(c: str, mode: KvMode) -> type[RowStore]:
    """The storage kind of component ``c`` ("k" or "v") of ``mode``."""
    for kind in _KINDS:
        if kind.takes(c, mode):
            return kind
    raise ValueError(f"{mode!r}: no storage kind stores its {c.upper()}")


@lru_cache(maxsize=256)
def spec_of(c: str, mode: KvMode, hd: int) -> Spec:
    """The :class:`Spec` of component ``c`` ("k" or "v") of ``mode`` at ``hd`` (ValueError for
    a head_dim its kind cannot store); allocates nothing."""
    return kind_of(c, mode).spec(c, mode, hd)


def specs_of(mode: KvMode, hd: int) -> tuple[tuple[str, Spec], tuple[str, Spec]]:
    """K's and V's :class:`Spec`, each with its component's letter."""
    return ("k", spec_of("k", mode, hd)), ("v", spec_of("v", mode, hd))


def stores_for(mode: KvMode, nkv: int, hd: int) -> tuple[RowStore, RowStore]:
    """Empty (K, V) stores of a layer of ``nkv`` x ``hd`` in ``mode`` (ValueError for a
    head_dim a kind cannot store)."""
    return (kind_of("k", mode).make("k", mode, nkv, hd),
            kind_of("v", mode).make("v", mode, nkv, hd))


def from_state(state: LayerState) -> tuple[RowStore, RowStore]:
    """The (K, V) stores holding a checked state's own arrays (no copies)."""
    k, v = stores_for(state.mode, state.num_kv_heads, state.head_dim)
    for c, st in (("k", k), ("v", v)):
        for name in st._names:
            setattr(st, name, getattr(state, c + name))
        st.col = getattr(state, c + "col")
        st.col_on = getattr(state, c + "col_on")
        st.installed(state.lengths)
    return k, v


def state_arrays(k: RowStore, v: RowStore) -> dict[str, npt.NDArray[Any]]:
    """The stores' arrays by layer-state field (``kf``, ``kq``, ``ks``, ``vc``, ...)."""
    return {c + name: arr for c, st in (("k", k), ("v", v)) for name, arr in st.arrays().items()}


#: the kernels' descriptor's names of the 4-bit codes (the state's ``kc`` and ``vc``)
_ROWS_NAME = {"kc": "kc4", "vc": "vc4"}


def kernel_rows(k: RowStore, v: RowStore, lengths: IP, mode: KvMode) -> Rows:
    """A layer's K and V stores as the attention kernels read them (:class:`Rows`): each part
    a store does not hold is an empty array of the shape the kernels' checks accept (K scales
    as wide as the mode's scheme's scale count; a mode with float32 K takes the default
    scheme's)."""
    nkv, hd = k.nkv, k.hd
    ef = np.zeros((nkv, 0, hd), dtype=_F32)
    eq = np.zeros((nkv, 0, hd), dtype=np.int8)
    kw: dict[str, Any] = dict(
        kf=ef, kq=eq, vf=ef, vq=eq, vs=np.zeros((nkv, 0, 1), dtype=_F32),
        ks=np.zeros((nkv, 0, quant.k_scale_count(hd, mode.scheme or DEFAULT_SCHEME)),
                    dtype=_F32))
    for name, arr in state_arrays(k, v).items():
        kw[_ROWS_NAME.get(name, name)] = arr
    for c, st in (("k", k), ("v", v)):
        if st._flag:
            kw[st._flag.format(c)] = True
    kw.setdefault("quant_k", False)
    kw.setdefault("quant_v", False)
    return Rows(vcol=v.col, head_len=lengths, **kw)
