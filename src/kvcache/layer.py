"""LayerKvCache: one layer's K/V rows, head-major, in float32, int8 or 4 bits
(docs/architecture.md): its rows, attention and eviction.  Its O(1) override is a component
(:mod:`kvcache.o1_override`), its byte formats a mixin over its state protocol
(:mod:`kvcache._layer_bytes`: ``state()`` / ``install()``).

Storage.  K and V are each one row store of the mode's kind (:mod:`kvcache._stores`: float32
rows, int8 rows with their scales and, in the scheme "cmf", a frozen column field, or 4-bit
codes with their parameters), whose
arrays are C-contiguous ``(num_kv_heads, capacity, trailing)``, so a head's rows are one
contiguous block (head-major).  ``capacity`` grows geometrically (x2), so an append is
amortised O(1): the whole cache is copied only when the capacity doubles.  Each head has its
own stored length; dead heads (``alive[h] == False``) store nothing while ``seq_len`` and
importance still advance.

Views handed out (``head_keys`` and friends, ``importance``) are read-only and show the
storage as it is; a later append, truncation or eviction may change or re-allocate what they
point to.  Take a copy to keep a snapshot.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Optional, Union

import numpy as np
import numpy.typing as npt

from . import quant
from ._state import LayerState, scheme_conflict
from ._validate import (FloatArrayLike, IntArrayLike, as_f32, as_f32_scalar, as_index, as_int,
                        out_f32, readonly)
from ._attention import (Rows, RowsBinding, attend_blocks, attend_prefill, attend_rows,
                         default_scale, grouped_queries)
from .eviction import EvictionPolicy, born_rows
from .modes import KvMode
from ._stores import (F32Rows, K4Rows, Q8Rows, RowStore, V4Rows, from_state, kernel_rows,
                      state_arrays, stores_for)
from ._layer_bytes import LayerBytes
from ._entry import K4_BLOCK
from ._generation import Generation
from .o1 import O1DeviceView, O1Error, O1Rect, O1Snapshot
from .o1_override import O1Override, O1State

try:
    from . import _core
except ImportError as exc:  # pragma: no cover - exercised only on a broken install
    raise ImportError(
        "kvcache's compiled extension kvcache._core is not built. Install the package with "
        "`pip install .` (or `pip install -e .`) from a checkout; a C compiler is needed."
    ) from exc

__all__ = ["LayerKvCache"]

F32 = npt.NDArray[np.float32]
I8 = npt.NDArray[np.int8]
U8 = npt.NDArray[np.uint8]
IP = npt.NDArray[np.intp]

_F32 = np.float32
_MIN_CAPACITY = 16


class LayerKvCache(LayerBytes):
    """KV cache of one attention layer, head-major, float32 or int8 rows.

    Parameters
    ----------
    num_kv_heads : int
        Number of KV heads (>= 1).
    head_dim : int
        Channels per head (>= 1).
    mode : KvMode or str, optional
        Storage precision: a KvMode or a name :meth:`KvMode.parse` accepts ("f32", "q8",
        "q8k", "q8v", with ":cmf" for the legacy int8 scheme, the 4-bit "q4", "k8v4", ...);
        ``None`` reads ``KVCACHE_KV`` through :meth:`KvMode.from_env`.

    Examples
    --------
    >>> import numpy as np, kvcache as kc
    >>> c = kc.LayerKvCache(2, 4, mode=kc.KvMode.F32)
    >>> c.append(np.ones((2, 4)), np.ones((2, 4)))
    >>> c.attend_all_heads(np.ones((4, 4))).shape
    (4, 4)
    """

    # the storage: one row store for K and one for V (kvcache._stores), the rows each head
    # holds, and the empty arrays the kernels' descriptor takes for what a kind does not store
    _k: RowStore
    _v: RowStore
    _len: IP
    _imp: F32
    _imp_len: int
    _seq_len: int
    _cap: int
    _o1: O1Override
    _linear_state: F32
    _linear_scratch: F32
    _evicted: bool
    _binding: Optional[tuple[ModuleType, RowsBinding, RowStore, RowStore, IP]]
    _track_imp: bool = True         # the class default also serves pickles made before it
    #: the kernel module the layer calls: kvcache._core (kvcache.reference's twins run a layer
    #: on the NumPy kernels by setting it for one call)
    kernels: ModuleType = _core

    def __init__(self, num_kv_heads: int, head_dim: int,
                 mode: Union[KvMode, str, None] = None) -> None:
        nkv = as_int("num_kv_heads", num_kv_heads, minimum=1)
        hd = as_int("head_dim", head_dim, minimum=1)
        self._mode = KvMode.from_env() if mode is None else KvMode.parse(mode)
        self._nkv = nkv
        self._hd = hd
        self._o1 = O1Override()
        self._linear_state = np.zeros(0, dtype=_F32)
        self._linear_scratch = np.zeros(0, dtype=_F32)
        self._gen = Generation()
        self._track_imp = True
        self._reset_storage()

    def __getstate__(self) -> dict[str, Any]:
        """Copies and pickles leave the kernels' binding behind (a copy binds its own
        arrays) and run on the compiled kernels."""
        state = dict(self.__dict__, _binding=None)
        state.pop("kernels", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Pickles made before the O(1) override was a component: its two fields, converted."""
        if not isinstance(state.get("_o1"), O1Override):
            state["_o1"] = O1Override(state.get("_o1"), state.pop("_o1_refused", None))
        self.__dict__.update(state)

    def __copy__(self) -> LayerKvCache:
        """A shallow copy with an O(1) state of its own (steps change a state in place)."""
        new = LayerKvCache.__new__(type(self))
        new.__dict__.update(self.__getstate__(), _o1=self._o1.copy())
        return new

    # ------------------------------------------------------------------ storage basics
    def _reset_storage(self) -> None:
        """Empty rows, columns and importance (mode, geometry, linear and O(1) state stay)."""
        nkv, hd = self._nkv, self._hd
        self._binding = None
        self._seq_len = 0
        self._cap = 0
        self._len = np.zeros(nkv, dtype=np.intp)
        self._k, self._v = stores_for(self._mode, nkv, hd)
        self._imp = np.zeros(0, dtype=_F32)
        self._imp_len = 0
        self._evicted = False

    def _reserve(self, n: int) -> None:
        """Make room for ``n`` more rows on every head and ``n`` more importance entries.

        Allocates before anything is modified, so a MemoryError leaves the cache as it was.
        """
        need = int(self._len.max(initial=0)) + n
        if need > self._cap:
            cap = max(need, 2 * self._cap, _MIN_CAPACITY)
            used = int(self._len.max(initial=0))
            k, v = self._k.grown(cap, used), self._v.grown(cap, used)
            self._binding = None
            self._k, self._v = k, v
            self._cap = cap
        need = self._imp_len + n
        if need > self._imp.shape[0]:
            imp = np.empty(max(need, 2 * self._imp.shape[0], _MIN_CAPACITY), dtype=_F32)
            imp[: self._imp_len] = self._imp[: self._imp_len]
            self._imp = imp

    # ------------------------------------------------------------------ public fields
    @property
    def mode(self) -> KvMode:
        """The storage precision (:class:`KvMode`)."""
        return self._mode

    @property
    def seq_len(self) -> int:
        """Positions appended so far (dead heads included)."""
        return self._seq_len

    @property
    def num_kv_heads(self) -> int:
        return self._nkv

    @property
    def head_dim(self) -> int:
        return self._hd

    @property
    def linear_state(self) -> F32:
        """Linear-core state: a 1-D float32 array owned by the layer (assignable)."""
        return self._linear_state

    @linear_state.setter
    def linear_state(self, value: FloatArrayLike) -> None:
        self._linear_state = self._as_state("linear_state", value)

    @property
    def linear_scratch(self) -> F32:
        """Tentative lane-2 linear state during a speculative verify (assignable)."""
        return self._linear_scratch

    @linear_scratch.setter
    def linear_scratch(self, value: FloatArrayLike) -> None:
        self._linear_scratch = self._as_state("linear_scratch", value)

    @staticmethod
    def _as_state(name: str, value: FloatArrayLike) -> F32:
        arr = as_f32(name, value)
        if arr.ndim != 1:
            raise ValueError(f"{name}: expected a 1-D array, got shape {arr.shape}")
        copy: F32 = arr.copy()
        return copy

    def commit_linear_scratch(self) -> None:
        """Accept lane 2: swap the scratch in as the linear state, then empty the scratch.

        Does nothing when the scratch is empty (no pending lane-2 state)."""
        if self._linear_scratch.size:
            self._linear_state = self._linear_scratch
            self._linear_scratch = np.zeros(0, dtype=_F32)

    def discard_linear_scratch(self) -> None:
        """Reject lane 2: drop the scratch; the linear state stays as it is."""
        self._linear_scratch = np.zeros(0, dtype=_F32)

    @property
    def o1(self) -> Optional[O1State]:
        """The O(1) state (read-only): None, an :class:`kvcache.o1.O1Collecting` (trace being
        collected) or an :class:`kvcache.o1.O1Sealed` (sealed; decode with :meth:`o1_step`).

        Change it through o1_begin / o1_seal / clear (or install_bytes, to move a state between
        layers): a state belongs to the layer whose positions it summarises."""
        return self._o1.state

    @property
    def generation(self) -> int:
        """A counter that grows each time stored rows change other than by appending.

        Bumped by :meth:`truncate_last`, eviction, :meth:`clear`, :meth:`import_wire` /
        :meth:`install_bytes`, the q8 column freeze (which requantises every stored row), a
        successful :meth:`o1_seal` and :meth:`o1_restore`.  Appends (and ``o1_step``, which
        appends to the O(1) state) leave it alone, so a device mirror that sees the same
        generation only uploads what was appended; see :meth:`unchanged_prefix` and
        :class:`kvcache.device.Mirror`."""
        return self._gen.value

    def unchanged_prefix(self, since: int) -> Optional[IP]:
        """Per-head row counts ``n[h]`` such that rows ``[0, n[h])`` of head h hold what they
        held at generation ``since`` (rows that existed then).

        Returns an int array of shape (num_kv_heads,), or None when a change that may rewrite
        any row (eviction, clear, import, column freeze, seal, O(1) restore) happened after
        ``since``, when more than 64 truncations did (only the last 64 are remembered), or
        when ``since`` is not a generation this cache has had.  Truncations only lower the
        counts."""
        prefix = self._gen.unchanged_prefix(since, self._len)
        return None if prefix is None else np.asarray(prefix, dtype=np.intp)

    @property
    def importance(self) -> F32:
        """Accumulated attention mass per stored position, read-only float32 view."""
        return readonly(self._imp[: self._imp_len])

    @property
    def track_importance(self) -> bool:
        """Whether :meth:`attend_all_heads` adds its attention mass into :attr:`importance`
        (default True).  False: it does no importance work at all (docs/numerics.md),
        :attr:`importance` keeps its length (0 for positions appended since) and Born
        eviction, which ranks positions by it, is refused.  For callers that never evict by
        importance (the runner, ``kvcache.hf``).  :meth:`attend_group` and
        :meth:`accumulate_imp` add what they are given either way.  Not in the byte formats
        (``install_bytes`` / ``import_wire`` keep the layer's setting, layers built from bytes
        or files track importance); pickles keep it."""
        return self._track_imp

    @track_importance.setter
    def track_importance(self, on: bool) -> None:
        if not isinstance(on, (bool, np.bool_)):
            raise TypeError(f"track_importance: expected True or False, got {on!r}")
        self._track_imp = bool(on)

    def __len__(self) -> int:
        return self._seq_len

    def __bool__(self) -> bool:
        return True

    def __repr__(self) -> str:
        o1 = "" if self.o1 is None else (", o1=sealed" if self.o1_sealed() else ", o1=collecting")
        return (f"LayerKvCache(num_kv_heads={self._nkv}, head_dim={self._hd}, mode={self._mode!r}, "
                f"seq_len={self._seq_len}{o1})")

    # ------------------------------------------------------------------ append
    def _as_rows(self, name: str, value: FloatArrayLike) -> F32:
        nkv, hd = self._nkv, self._hd
        arr = as_f32(name, value, shapes=[(nkv, hd), (nkv * hd,), (None, nkv, hd)])
        return arr.reshape(-1, nkv, hd)

    def _as_alive(self, alive: Optional[IntArrayLike]) -> U8:
        if alive is None:
            return np.ones(self._nkv, dtype=np.uint8)
        arr = np.asarray(alive)
        if arr.dtype != np.bool_:
            if arr.dtype.kind in "iu" and arr.size and np.all((arr == 0) | (arr == 1)):
                arr = arr.astype(np.bool_)
            elif arr.size:
                raise TypeError(f"alive: expected booleans, got dtype {arr.dtype}")
        if arr.shape != (self._nkv,):
            raise ValueError(f"alive: expected shape ({self._nkv},), got {arr.shape}")
        return arr.astype(np.uint8)

    def append(self, k_new: FloatArrayLike, v_new: FloatArrayLike,
               alive: Optional[IntArrayLike] = None) -> None:
        """Append K/V for one position or a block of ``n`` positions.

        Parameters
        ----------
        k_new, v_new : array_like of shape (num_kv_heads, head_dim), (num_kv_heads*head_dim,)
            or (n, num_kv_heads, head_dim)
        alive : sequence of bool of length num_kv_heads, optional
            Heads marked False store nothing for these positions; ``seq_len`` and importance
            still advance.  None means every head is alive.
        """
        self._check_exact("append")
        k3 = self._as_rows("k_new", k_new)
        v3 = self._as_rows("v_new", v_new)
        if k3.shape != v3.shape:
            raise ValueError(f"v_new: expected the shape of k_new {k3.shape}, got {v3.shape}")
        live = self._as_alive(alive)
        n = k3.shape[0]
        if n == 0:
            return
        self._reserve(n)
        if not (self._k.freezes or self._v.freezes):   # f32, or q8 in scheme "rows"
            self._store(k3, v3, live)
            return
        # q8 in scheme "cmf": the column freeze fires at the start of the first single append that finds
        # seq_len >= 64 with no column frozen yet; split the block there so a block append
        # is identical to n single appends.
        i = 0
        while i < n:
            if self._seq_len >= quant.COL_WARMUP and not self._any_col_frozen():
                self._freeze_columns()
            j = n if self._any_col_frozen() else min(n, max(i + 1, i + quant.COL_WARMUP - self._seq_len))
            self._store(k3[i:j], v3[i:j], live)
            i = j

    def _any_col_frozen(self) -> bool:
        return bool(self._k.col_on.any() or self._v.col_on.any())

    def _freeze_columns(self) -> None:
        if self._len.any():                  # requantises every stored row (heads with rows)
            self._gen.diverge()
        self._k.freeze(self._len)
        self._v.freeze(self._len)

    def _store(self, k3: F32, v3: F32, live: U8) -> None:
        n = k3.shape[0]
        self._k.write(k3, live, self._len)
        self._v.write(v3, live, self._len)
        self._len += live.astype(np.intp) * n
        self._imp[self._imp_len: self._imp_len + n] = 0.0
        self._imp_len += n
        self._seq_len += n

    # ------------------------------------------------------------------ accessors
    def head_len(self, h: int) -> int:
        """Rows stored for KV head ``h`` (0 for a head that was always dead)."""
        return int(self._len[as_index("kv_head", h, self._nkv)])

    def head_keys(self, h: int) -> F32:
        """Read-only float32 view (head_len(h), head_dim) of head h's keys.

        Empty (0, head_dim) when K is not stored as float32 (int8, 4-bit)."""
        return self._floats(self._k, h)

    def head_values(self, h: int) -> F32:
        """Read-only float32 view (head_len(h), head_dim) of head h's values.

        Empty (0, head_dim) when V is not stored as float32 (int8, 4-bit)."""
        return self._floats(self._v, h)

    def _floats(self, st: RowStore, h: int) -> F32:
        h = as_index("kv_head", h, self._nkv)
        return readonly(st.f[h, : self._len[h]] if isinstance(st, F32Rows)
                        else np.zeros((0, self._hd), dtype=_F32))

    def k_heads(self) -> list[F32]:
        """List of :meth:`head_keys` views, one per KV head."""
        return [self.head_keys(h) for h in range(self._nkv)]

    def v_heads(self) -> list[F32]:
        """List of :meth:`head_values` views, one per KV head."""
        return [self.head_values(h) for h in range(self._nkv)]

    def head_rows(self, h: int) -> tuple[F32, F32]:
        """Head h's keys and values, each (head_len(h), head_dim) float32, as the kernels read
        them: read-only views of the storage for a part stored as float32 (valid until the
        layer next changes), read-only new arrays of the dequantised values for int8 (rows
        times scales, times the frozen column field) and 4-bit parts (docs/kv4.md)."""
        h = as_index("kv_head", h, self._nkv)
        n = int(self._len[h])
        return readonly(self._k.values(h, n)), readonly(self._v.values(h, n))

    def q8_rows(self, h: int) -> tuple[Optional[I8], Optional[F32], Optional[I8], Optional[F32]]:
        """Read-only views of head h's int8 storage: (kq, ks, vq, vs), None for f32 parts.

        kq (head_len, head_dim) int8, ks (head_len, ceil(head_dim/group)) float32 (group 16 or 32),
        vq (head_len, head_dim) int8, vs (head_len,) float32."""
        h = as_index("kv_head", h, self._nkv)
        n = int(self._len[h])
        k, v = (st.int8(h, n) if isinstance(st, Q8Rows) else None for st in (self._k, self._v))
        return (None if k is None else readonly(k[0]), None if k is None else readonly(k[1]),
                None if v is None else readonly(v[0]), None if v is None else readonly(v[1][:, 0]))

    def k4_rows(self, h: int) -> tuple[Optional[npt.NDArray[np.uint8]],
                                       Optional[npt.NDArray[np.float16]], Optional[F32]]:
        """Read-only views of head h's 4-bit K (docs/kv4.md): (codes, params, ring), or
        (None, None, None) when K is not 4-bit.

        codes (q, head_dim / 2) uint8 of the q = 32 * (head_len // 32) rows in closed blocks,
        each block's 32 rows of bytes in the block layout of docs/kv4.md; params (q / 32,
        2 * head_dim) float16, per block the head_dim steps then the head_dim minimums; ring
        (64, head_dim) float32, row i of the last 64 at slot i % 64 (the rows from q on are
        read from it)."""
        h = as_index("kv_head", h, self._nkv)
        q = int(self._len[h]) // K4_BLOCK * K4_BLOCK
        if not isinstance(self._k, K4Rows):
            return None, None, None
        c, p, r = self._k.c, self._k.p, self._k.r
        return (readonly(c[h, :q]), readonly(p[h, : q // K4_BLOCK].view(np.float16)),
                readonly(r[h]))

    def v4_rows(self, h: int) -> tuple[Optional[npt.NDArray[np.uint8]],
                                       Optional[npt.NDArray[np.float16]]]:
        """Read-only views of head h's 4-bit V rows (docs/kv4.md): (codes, params), or
        (None, None) when V is not 4-bit.

        codes (head_len, head_dim / 2) uint8, two channels per byte in the layout of
        docs/kv4.md; params (head_len, 2 * ceil(head_dim / 16)) float16, the step then the
        minimum of each group of 16 channels: channel d's value is
        ``fmaf(code_d, params[2 * (d // 16)], params[2 * (d // 16) + 1])``."""
        h = as_index("kv_head", h, self._nkv)
        n = int(self._len[h])
        if not isinstance(self._v, V4Rows):
            return None, None
        return readonly(self._v.c[h, :n]), readonly(self._v.p[h, :n].view(np.float16))

    def columns(self, h: int) -> tuple[Optional[F32], Optional[F32]]:
        """Frozen column fields of head h: (kcol, vcol), each a read-only (head_dim,) view or None."""
        h = as_index("kv_head", h, self._nkv)
        return (readonly(self._k.col[h]) if self._k.col_on[h] else None,
                readonly(self._v.col[h]) if self._v.col_on[h] else None)

    # ------------------------------------------------------------------ attention
    def _check_exact(self, what: str) -> None:
        if self._o1.sealed:
            raise RuntimeError(f"{what}: this layer is sealed in O(1) mode; use o1_step")

    def _queries(self, qk: F32) -> F32:
        """Fold the frozen key columns into queries (nkv, m, hd) when K is int8."""
        col = self._k.frozen_col()
        if col is not None:
            return np.ascontiguousarray(qk * col[:, None, :])
        return np.ascontiguousarray(qk)

    def _one_group(self, h: int, q2d: F32) -> tuple[F32, IP]:
        """Queries (nq, hd) of KV head h alone: the column-folded queries and group offsets."""
        col = self._k.frozen_col()
        if col is not None:
            q2d = q2d * col[h]
        group_q0 = np.zeros(self._nkv + 1, dtype=np.intp)
        group_q0[h + 1:] = q2d.shape[0]
        return np.ascontiguousarray(q2d), group_q0

    def _rows(self) -> Rows:
        """The stored rows as the attention kernels read them (:func:`_stores.kernel_rows`)."""
        return kernel_rows(self._k, self._v, self._len, self._mode)

    def _bound_rows(self, kernels: ModuleType) -> RowsBinding:
        """The stored rows bound by ``kernels.bind_rows``: checked once and kept while the
        layer holds the very stores bound (rows written in place need no new binding; a store
        that grows is a new store).  The methods that replace stores (``_reset_storage``,
        ``_reserve``, ``install``) also drop the binding, so that it never keeps
        replaced storage alive."""
        b = self._binding
        if (b is not None and b[0] is kernels and b[2] is self._k and b[3] is self._v
                and b[4] is self._len):
            return b[1]
        bound: RowsBinding = kernels.bind_rows(self._rows())
        self._binding = (kernels, bound, self._k, self._v, self._len)
        return bound

    def attend(self, q: FloatArrayLike, kv_head: int) -> tuple[F32, F32]:
        """Attention of one query head over KV head ``kv_head``'s stored rows.

        Always the plain form: scale 1/sqrt(head_dim), no softcap, no window.

        Returns
        -------
        out : ndarray of shape (head_dim,), float32
        probs : ndarray of shape (head_len(kv_head),), float32
        """
        kernels = self.kernels
        self._check_exact("attend")
        hd = self._hd
        qa = as_f32("q", q, shapes=[(hd,), (1, hd)])
        h = as_index("kv_head", kv_head, self._nkv)
        stored = int(self._len[h])
        out = np.zeros((1, hd), dtype=_F32)
        if stored == 0:
            return out.reshape(hd), np.zeros(0, dtype=_F32)
        q2, group_q0 = self._one_group(h, qa.reshape(1, hd))
        probs = attend_rows(kernels, self._bound_rows(kernels), q2, group_q0, n_pos=1, n_back=1, window=0,
                            first=0, scale=default_scale(hd), softcap=0.0, out2=out,
                            width=stored, imp=np.zeros(0, dtype=_F32), imp_mode=0,
                            n_threads=_core.max_threads())
        return out.reshape(hd), probs[0, :stored].copy()

    def attend_group(self, q_group: FloatArrayLike, kv_head: int, out: F32, imp_acc: F32,
                     scale: float, first: int, softcap: float) -> None:
        """Grouped attention of the query heads of one KV group, in one pass over its rows.

        Parameters
        ----------
        q_group : array_like of shape (n_q, head_dim) or (n_q*head_dim,)
        kv_head : int
        out : ndarray, float32, writable, n_q*head_dim elements -- filled in place
        imp_acc : ndarray of shape (m,), float32, writable -- probabilities ADDED in place
            over the first min(m, head_len) rows, head by head in order
        scale : float
            Score scale.
        first : int
            Earliest visible row (clamped to head_len - 1).
        softcap : float
            0 for off, else scores become softcap*tanh(score/softcap) (finite scores only).

        Bit-for-bit equal to :meth:`attend` per head (probabilities summed in head order)
        when ``scale == 1/sqrt(head_dim)`` (as float32), ``first == 0`` and ``softcap == 0``.
        """
        kernels = self.kernels
        self._check_exact("attend_group")
        hd = self._hd
        qa = as_f32("q_group", q_group)
        if qa.size == 0 or qa.size % hd or qa.ndim not in (1, 2) or (qa.ndim == 2 and qa.shape[1] != hd):
            raise ValueError(f"q_group: expected shape (n_q, {hd}) or (n_q*{hd},) with n_q >= 1, "
                             f"got {qa.shape}")
        h = as_index("kv_head", kv_head, self._nkv)
        out = out_f32("out", out, size=qa.size)
        imp_acc = out_f32("imp_acc", imp_acc)
        if imp_acc.ndim != 1:
            raise ValueError(f"imp_acc: expected a 1-D array, got shape {imp_acc.shape}")
        scale = as_f32_scalar("scale", scale)
        # clamped to head_len - 1 by the kernel; cap it so any int fits its Py_ssize_t
        first = min(as_int("first", first, minimum=0), 1 << 62)
        softcap = as_f32_scalar("softcap", softcap, minimum=0.0)
        nq = qa.size // hd
        stored = int(self._len[h])
        if stored == 0:
            out.fill(0.0)
            return None
        q2, group_q0 = self._one_group(h, qa.reshape(nq, hd))
        attend_rows(kernels, self._bound_rows(kernels), q2, group_q0, n_pos=1, n_back=1, window=0,
                    first=first, scale=scale, softcap=softcap, out2=out.reshape(nq, hd),
                    width=stored, imp=imp_acc, imp_mode=1, n_threads=_core.max_threads())

    def attend_all_heads(self, q: FloatArrayLike, *, scale: Optional[float] = None,
                         window: Optional[int] = None, softcap: float = 0.0,
                         out: Optional[F32] = None, prefill: Optional[bool] = None) -> F32:
        """Whole-layer grouped-query attention of the newest position(s).

        Parameters
        ----------
        q : array_like of shape (num_heads, head_dim) or (n, num_heads, head_dim)
            num_heads a positive multiple of num_kv_heads; head h reads KV head
            h // (num_heads // num_kv_heads).  With n positions (already appended), query i
            sees stored rows up to stored - n + i (causal within the block).
        scale : float, optional
            Score scale, default 1/sqrt(head_dim).
        window : int, optional
            Sliding window: only the last ``window`` rows up to and including the query's own.
        softcap : float
            0 (off) or the Gemma-2 logit cap: cap*tanh(score/cap) on finite scores.
        out : ndarray, optional
            float32 C-contiguous array of the result shape, filled and returned.
        prefill : bool, optional
            Which kernel runs.  None (default): the blocked prompt kernel when ``n > 1``, the
            decode kernel for one position.  True: the blocked kernel even for one position
            (a one-position chunk then gets the bits it would get inside a longer prompt).
            False: the decode kernel for any ``n``.

        Returns
        -------
        ndarray of shape (num_heads, head_dim) or (n, num_heads, head_dim), float32

        Every query's attention mass is added into :attr:`importance` (per row, summed over
        KV groups in order, then positions, then heads within the group), unless
        :attr:`track_importance` is False.

        Notes
        -----
        The blocked kernel (``docs/numerics.md``, "Prompt attention") walks the rows in tiles
        of 64 at absolute row multiples with an online softmax: a query's result depends only
        on the rows it sees, so a chunk of a prompt gets the same bits alone or inside a longer
        call; its scratch is a few tiles per thread, and the call's mass is summed from the
        tiles' kept probabilities (docs/numerics.md, step 5) and added to the importance once.
        Its bits differ from the decode kernel's (another summation order), which processes a
        long block in pieces that fit a 64 MB per-thread scratch.  ``out`` may be ``q``.
        """
        kernels = self.kernels
        self._check_exact("attend_all_heads")
        nkv, hd = self._nkv, self._hd
        q3, single = grouped_queries(q, nkv, hd)
        n, nh = q3.shape[0], q3.shape[1]
        if n > self._seq_len:
            raise ValueError(f"q: expected at most seq_len={self._seq_len} positions (queries "
                             f"attend the newest, already appended rows), got {n}")
        scale = default_scale(hd) if scale is None else as_f32_scalar("scale", scale)
        # a window longer than any cache is no window (and must not overflow Py_ssize_t)
        window = 0 if window is None else min(as_int("window", window, minimum=1), 1 << 62)
        softcap = as_f32_scalar("softcap", softcap, minimum=0.0)
        res_shape = (nh, hd) if single else (n, nh, hd)
        if out is None:
            out = np.empty(res_shape, dtype=_F32)
        else:
            out = out_f32("out", out, shape=res_shape)
        if prefill is not None and not isinstance(prefill, (bool, np.bool_)):
            raise TypeError(f"prefill: expected None, True or False, got {prefill!r}")
        if n == 0:
            return out
        blocked = n > 1 if prefill is None else bool(prefill)
        run = attend_prefill if blocked else attend_blocks
        run(kernels, self._bound_rows(kernels), q3, out.reshape(n, nh, hd), maxlen=int(self._len.max()),
            window=window, scale=scale, softcap=softcap, imp=self._imp[: self._imp_len],
            imp_mode=2 if self._track_imp else 0, n_threads=_core.max_threads(),
            fold=self._queries)
        return out

    def accumulate_imp(self, probs: FloatArrayLike) -> None:
        """Add attention mass: ``importance[i] += probs[i]`` over the overlapping prefix."""
        p = as_f32("probs", probs)
        if p.ndim != 1:
            raise ValueError(f"probs: expected a 1-D array, got shape {p.shape}")
        m = min(self._imp_len, p.shape[0])
        self._imp[:m] += p[:m]

    # ------------------------------------------------------------------ rollback, eviction
    def truncate_last(self, n: int) -> None:
        """Roll back the newest ``n`` positions (speculative-decode reject).

        Drops min(n, seq_len) positions from every head (dead heads saturate at 0) and from
        the importance; keeps the column fields and the linear state.  Appending the same rows
        again restores every stored byte in float32, in the int8 scheme "rows" and in 4-bit
        (K's codes and block parameters at any depth; the limits in docs/kv4.md); in the
        scheme "cmf" a column frozen by the dropped positions stays frozen, so rolling back
        across position 64 does not restore what was stored before.  A sealed O(1) layer
        raises RuntimeError (its far-field insertions cannot be undone): roll it back with
        :meth:`o1_snapshot` / :meth:`o1_restore` instead."""
        n = as_int("n", n, minimum=0)
        self._check_exact("truncate_last")
        d = min(n, self._seq_len)
        if d == 0:
            return
        new = np.maximum(self._len - d, 0)
        self._k.truncated(self._len, new)       # (4-bit K refills its ring; may allocate)
        self._v.truncated(self._len, new)
        self._len[:] = new
        self._imp_len = max(self._imp_len - d, 0)
        self._seq_len -= d
        self._gen.shrink(self._len)

    def clear(self) -> None:
        """Forget everything: rows, columns, importance, linear state and scratch, O(1) state.

        Keeps mode, num_kv_heads and head_dim."""
        self._reset_storage()
        self._linear_state = np.zeros(0, dtype=_F32)
        self._linear_scratch = np.zeros(0, dtype=_F32)
        self._o1.clear()
        self._gen.diverge()

    def _shift_rows(self, h: int, keep_idx: Optional[IP] = None, drop: int = 0) -> None:
        """Compact head h's rows: keep rows ``keep_idx`` (sorted) or drop the first ``drop``."""
        n = int(self._len[h])
        self._k.shift(h, n, keep_idx, drop)
        self._v.shift(h, n, keep_idx, drop)
        self._len[h] = n - drop if keep_idx is None else keep_idx.size

    @property
    def evicted(self) -> bool:
        """True once an eviction dropped positions (until :meth:`clear`): row i is then no
        longer position i of the sequence (the prefix store refuses such a layer).  A layer
        filled from bytes (``from_bytes``, ``install_bytes``, ``import_wire``) starts False."""
        return self._evicted

    def evict(self, keep: int, policy: EvictionPolicy = EvictionPolicy.RECENT) -> None:
        """Shrink to at most ``keep`` positions with ``policy`` (see :mod:`kvcache.eviction`).

        RECENT drops the oldest positions; Born keeps the policy's sink, the newest
        ``policy.recent(keep)`` and the middle positions of highest importance (ValueError,
        changing nothing, when :attr:`track_importance` is False).  A layer with
        O(1) state (collecting or sealed) is left as it is, as is one already within ``keep``.
        """
        keep = as_int("keep", keep, minimum=0)
        if not isinstance(policy, EvictionPolicy):
            raise TypeError(f"policy: expected an EvictionPolicy, got {type(policy).__name__}")
        if policy.kind == "born" and not self._track_imp:
            raise ValueError("evict: Born eviction ranks positions by importance, which this "
                             "layer does not track (track_importance=False); use "
                             "EvictionPolicy.RECENT or track importance")
        if policy.kind == "recent":
            self._evict(keep)
        else:
            self._evict_born(keep, policy.sink, policy.recent(keep))

    def _evict(self, keep: int) -> None:
        """RECENT: keep the newest ``keep`` positions."""
        if self.o1 is not None or self._seq_len <= keep:
            return
        drop = self._seq_len - keep
        for h in range(self._nkv):
            self._shift_rows(h, drop=min(drop, int(self._len[h])))
        d = min(drop, self._imp_len)
        self._imp[: self._imp_len - d] = self._imp[d: self._imp_len].copy()
        self._imp_len -= d
        self._seq_len = keep
        self._evicted = True
        self._gen.diverge()

    def _evict_born(self, keep: int, sink: int, recent: int) -> None:
        """Born: keep ``sink`` first, ``recent`` newest and the most important middle rows."""
        if self.o1 is not None or self._imp_len <= keep:
            return
        kept = born_rows(self._imp[: self._imp_len], keep, sink, recent)
        for h in range(self._nkv):
            self._shift_rows(h, keep_idx=kept[kept < self._len[h]])
        self._imp[: kept.size] = self._imp[kept]
        self._imp_len = kept.size
        self._seq_len = int(kept.size)
        self._evicted = True
        self._gen.diverge()

    # ------------------------------------------------------------------ accounting
    def memory_bytes(self) -> int:
        """Bytes held by the rows, scales, frozen columns and linear state (row sizes:
        :func:`kvcache.quant.k_row_bytes`, :func:`kvcache.quant.v_row_bytes`,
        :func:`kvcache.quant.v4_row_bytes`; 4-bit K: its codes and block parameters and its
        float32 ring of up to 64 rows per head, docs/kv4.md).

        Counts lengths, not capacities; excludes importance and the linear scratch."""
        total = self._k.bytes_held(self._len) + self._v.bytes_held(self._len)
        total += 4 * self._hd * int(self._k.col_on.sum() + self._v.col_on.sum())
        total += 4 * self._linear_state.size
        total += self.o1_memory_bytes()
        return total

    # ------------------------------------------------------------------ the state protocol
    def state(self) -> LayerState:
        """Everything the layer holds, as one :class:`kvcache._state.LayerState`: read-only
        views of its arrays and its own O(1) object, no copies.

        The state protocol (docs/architecture.md), named alike on every cache kind (slot
        caches: ``SlotCache.state()``): how the byte formats, the prefix store and the device
        mirrors read a layer, and how :meth:`install` takes one.  The views show the storage
        as it is; read them before the layer changes again."""
        arrays = {name: readonly(a) for name, a in state_arrays(self._k, self._v).items()}
        return LayerState(
            mode=self._mode, num_kv_heads=self._nkv, head_dim=self._hd, seq_len=self._seq_len,
            lengths=readonly(self._len), kcol=readonly(self._k.col), vcol=readonly(self._v.col),
            kcol_on=readonly(self._k.col_on), vcol_on=readonly(self._v.col_on),
            importance=readonly(self._imp[: self._imp_len]),
            linear_state=readonly(self._linear_state),
            linear_scratch=readonly(self._linear_scratch), o1=self._o1.state, owned=False, **arrays)

    def install(self, state: LayerState, any_scheme: bool = False) -> None:
        """Replace everything the layer holds with ``state`` (from :meth:`state` of a layer of
        the same geometry, or a byte format's reader), atomically.

        ``state`` is checked completely first (:meth:`LayerState.check`: geometry, dtypes,
        shapes, lengths, column and O(1) rules; ValueError or TypeError; and, when both this
        layer and the state store int8 rows, the same int8 scheme, unless ``any_scheme``: a
        whole model read from bytes takes each layer as it was saved) and copied unless
        it is ``owned``; only then is it swapped in, by assignments that cannot fail.  When
        this raises, the layer is unchanged.  ``linear_scratch=None`` keeps the layer's own.
        The generation diverges (a mirror re-uploads everything)."""
        if not isinstance(state, LayerState):
            raise TypeError(f"state: expected a LayerState, got {type(state).__name__}")
        state.check(self._nkv, self._hd)
        problem = None if any_scheme else scheme_conflict(self._mode, state.mode)
        if problem is not None:
            raise ValueError(f"state: {problem}")
        if not state.owned:
            state = state.owned_copy()
        k, v = from_state(state)
        # commit: assignments only
        self._binding = None
        self._mode = state.mode
        self._seq_len = int(state.seq_len)
        self._cap = state.capacity
        self._len = state.lengths
        self._k, self._v = k, v
        self._imp = state.importance
        self._imp_len = int(state.importance.shape[0])
        self._evicted = False
        self._linear_state = state.linear_state
        if state.linear_scratch is not None:
            self._linear_scratch = state.linear_scratch
        self._o1.install(state.o1)
        self._gen.diverge()

    # ------------------------------------------------------------------ O(1) override
    # The state machine is kvcache.o1_override.O1Override (held in _o1); these are its public
    # face on the layer, and the layer applies what a seal means for its rows.
    def o1_begin(self, m: int, w: int, sink: int,
                 rect: Union[O1Rect, str] = O1Rect.AGGREGATE,
                 keep: int = 0, ridge: float = 1e-6) -> None:
        """Start collecting the prompt's query trace for an O(1) seal (docs/o1.md): landmark
        budget ``m`` (>= 4), exact window ``w`` (>= 1), ``sink`` rows kept for ever, the
        far-field rectifier, ``keep`` far keys kept exact, the ``ridge`` of the pseudo-inverse
        (parameters in full: :meth:`kvcache.o1_override.O1Override.begin`).

        Replaces any collecting trace; the trace must cover every position the layer holds
        when :meth:`o1_seal` runs.  RuntimeError on a sealed layer (its KV was released:
        :meth:`clear` first)."""
        self._o1.begin(self._hd, m, w, sink, rect, keep, ridge)

    def o1_push_q(self, q_all: FloatArrayLike) -> None:
        """Append one prompt position's queries (num_heads, head_dim) -- or several,
        (n, num_heads, head_dim) -- to the trace.  Call it once per position, in order, before
        or after the position's append.  A no-op unless the layer is collecting."""
        self._o1.push_q(self._hd, q_all)

    def o1_sealed(self) -> bool:
        """True when the layer is sealed (O(1) decode through :meth:`o1_step`)."""
        return self._o1.sealed

    def o1_seal(self, num_heads: int, max_error: Optional[float] = None) -> bool:
        """Freeze the prompt into per-group Nystrom states and release the layer's KV; True
        when the layer is sealed.

        Idempotent when the layer is not collecting.  A seal whose preconditions fail (float32
        rows, a full trace, ``num_heads`` a multiple of ``num_kv_heads``, every head holding
        every position), or whose error estimate (:meth:`o1_error`) is above ``max_error``,
        is refused with a logged warning: ``o1`` becomes None, the layer keeps its rows and
        stays exact, False.  On success the rows and importance are released and ``seq_len``
        stays.  ValueError / TypeError for a bad ``num_heads`` or ``max_error``, before
        anything changes.  In full: :meth:`kvcache.o1_override.O1Override.seal`, docs/o1.md.
        """
        k, v = self._k, self._v
        rows = (k.f if isinstance(k, F32Rows) else None, v.f if isinstance(v, F32Rows) else None)
        state = self._o1.seal(self, num_heads, max_error, rows, self.kernels,
                              _core.max_threads())
        if state is None:
            return self._o1.sealed
        t = self._seq_len
        self._reset_storage()          # rows, columns, importance (the linear state stays)
        self._seq_len = t
        self._gen.diverge()
        return True

    def o1_error(self) -> Optional[O1Error]:
        """The error estimate of the last seal that built a state, kept or refused
        (:meth:`kvcache.o1_override.O1Override.error`); None otherwise."""
        return self._o1.error()

    def o1_step(self, q_all: FloatArrayLike, k_new: FloatArrayLike, v_new: FloatArrayLike,
                num_heads: int) -> F32:
        """One O(1) decode step: ``k_new`` / ``v_new`` (num_kv_heads, head_dim) inserted once
        per KV group, every head's output (num_heads, head_dim) float32 returned for ``q_all``
        (num_heads, head_dim; flat arrays too).  ``num_heads`` must be the value the layer
        was sealed with; ``seq_len`` grows by one, nothing is stored per position."""
        out = self._o1.step(self._nkv, self._hd, q_all, k_new, v_new, num_heads, self.kernels,
                            _core.max_threads())
        self._seq_len += 1
        return out

    def o1_views(self) -> Optional[list[O1DeviceView]]:
        """One :class:`kvcache.o1.O1DeviceView` per KV group; None unless sealed with a state."""
        return self._o1.views()

    def o1_memory_bytes(self) -> int:
        """Bytes of the O(1) trace or sealed state (docs/o1.md); part of memory_bytes()."""
        return self._o1.memory_bytes()

    def o1_snapshot(self) -> O1Snapshot:
        """A copy of the sealed state's ring, far accumulators and seq_len: :meth:`o1_restore`
        rolls back, bit for bit, the steps taken since (speculative decode)."""
        return self._o1.snapshot(self._seq_len)

    def o1_restore(self, snapshot: O1Snapshot) -> None:
        """Put back a snapshot taken by :meth:`o1_snapshot` on this same sealed state."""
        self._seq_len = self._o1.restore(snapshot)
        self._gen.diverge()
