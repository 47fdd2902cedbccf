"""What a kernel call hands to ``kvcache._core`` (and to its NumPy twin ``kvcache.reference``),
and the checks that make it safe to run.

Every attention kernel takes one **storage descriptor** and one **call descriptor**:

- :class:`Rows` -- one layer's stored rows, head-major ``(nkv, capacity, .)``: float32, int8 or
  4-bit K and V, their scales, parameters and frozen V column, each KV group's row count, the K
  scale group;
- :class:`AttendCall` -- the queries of one call (gathered per KV group), the rows each sees
  (``n_pos``, ``n_back``, ``window``, ``first``), scale and softcap, the outputs and the
  thread count.

``attend_rows(rows, call)`` and ``attend_blocked(rows, call)`` read the same pair.  The O(1)
kernels take an :class:`O1State` and an :class:`O1Absorb` or :class:`O1Step`; the MLA kernel
one :class:`MlaCall`.

The compiled entry points call the checks of their entry here before any array is touched and
raise nothing themselves.  Attention and the O(1) step check in two halves: the storage or state
once, when it is bound (``check_rows`` in ``_core.bind_rows``, ``check_o1_state`` in
``_core.bind_o1``; an unbound descriptor is bound, so checked, at each call), and each call
against the binding (``check_call``, ``check_o1_call``; the compiled entries answer the
common call of that half in C and send every other call here, so these functions decide what
passes and what each error says).  The others check whole calls
(``check_o1_absorb``, ``check_mla_attend``, ``check_quantize_query``, ``check_q8_scores``).
A descriptor that passes is one the ``nogil`` code can index without reading or writing
outside its arrays.  A check raises TypeError for a wrong type or dtype and
ValueError for a wrong shape, layout or value (the message names the field and says what was
expected), before any array is touched.  The NumPy twins trust their descriptors.

A leaf module: it imports nothing of kvcache but the leaf ``_validate``.
"""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple, Optional, Protocol

import numpy as np
import numpy.typing as npt

from ._validate import as_int
from .quant import K4_BLOCK, K4_RING

__all__ = ["K4_BLOCK", "K4_RING", "ring_slots", "AttendCall", "MlaCall", "O1Absorb", "O1Shape", "O1State", "O1Step", "Rows",
           "RowsBinding", "RowsShape", "check_call", "check_mla_attend", "check_o1_absorb",
           "check_k4_scores", "check_o1_call", "check_o1_state", "check_q8_scores",
           "check_quantize_query",
           "check_rows", "k_group_of"]

F32 = npt.NDArray[np.float32]
I8 = npt.NDArray[np.int8]
U8 = npt.NDArray[np.uint8]
U16 = npt.NDArray[np.uint16]
I32 = npt.NDArray[np.int32]
IP = npt.NDArray[np.intp]
# the O(1) twins also run on float64 state (the streaming reference)
FA = npt.NDArray[np.floating[Any]]



def ring_slots(lo: int, hi: int) -> IP:
    """The ring slots of 4-bit K rows [lo, hi) (row i at slot i % K4_RING), in row order."""
    out: IP = np.arange(lo, hi, dtype=np.intp) % K4_RING
    return out

COUNT_MAX = 1 << 62
"""The largest count, length or row index a kernel accepts (sums of them fit Py_ssize_t)."""
THREADS_MAX = (1 << 31) - 1

_F32 = np.dtype(np.float32)
_I8 = np.dtype(np.int8)
_U8 = np.dtype(np.uint8)
_U16 = np.dtype(np.uint16)
_I32 = np.dtype(np.int32)
_IP = np.dtype(np.intp)


# ---------------------------------------------------------------------------------------------
# descriptors

class Rows(NamedTuple):
    """One layer's stored rows as the attention kernels read them: head-major
    ``(nkv, capacity, .)``, KV group ``g``'s rows ``[0, head_len[g])`` valid.

    A float32 component leaves its int8 arrays (and scales) with zero capacity, and the other
    way round; ``vcol`` is the frozen V column field (ones when there is none).  ``k_group``:
    channels per K scale (16 or 32), or 0 to read it from the scales per row
    (:func:`k_group_of`).  4-bit V (``v4``) is read from ``vc4`` and ``vp`` (float16 as
    uint16 bits; the layout is ``_q4.h``'s); ``vf``, ``vq`` and ``vs`` are then unused.
    4-bit K (``k4``) likewise from ``kc4``, ``kp`` and ``kr`` (docs/kv4.md).
    """

    kf: F32          # (nkv, capacity, hd) float32 K
    kq: I8           # (nkv, capacity, hd) int8 K codes
    ks: F32          # (nkv, capacity, ceil(hd / k_group)) their scales
    vf: F32          # (nkv, capacity, hd) float32 V
    vq: I8           # (nkv, capacity, hd) int8 V codes
    vs: F32          # (nkv, capacity, 1) their scales
    vcol: F32        # (nkv, hd) the frozen V column
    head_len: IP     # (nkv,) rows stored per KV group
    quant_k: bool
    quant_v: bool
    k_group: int = 0
    vc4: Optional[U8] = None    # (nkv, capacity, hd / 2) 4-bit V codes (docs/kv4.md)
    vp: Optional[U16] = None    # (nkv, capacity, 2 * ceil(hd / 16)) their float16 parameters
    v4: bool = False            # V is 4-bit (vc4, vp); quant_v is then False
    kc4: Optional[U8] = None    # (nkv, capacity, hd / 2) 4-bit K codes of the closed blocks
    kp: Optional[U16] = None    # (nkv, ceil(capacity / 32), 2 * hd) their float16 parameters
    kr: Optional[F32] = None    # (nkv, 64, hd) the float32 ring of the last rows
    k4: bool = False            # K is 4-bit (kc4, kp, kr); quant_k is then False

    @classmethod
    def float32(cls, kf: F32, vf: F32, head_len: IP, k_groups: int) -> Rows:
        """Float32 K and V only (``k_groups`` scale groups per row of an int8 K, unused)."""
        nkv, _, hd = kf.shape
        empty_q = np.zeros((nkv, 0, hd), dtype=np.int8)
        return cls(kf, empty_q, np.zeros((nkv, 0, k_groups), dtype=np.float32), vf, empty_q,
                   np.zeros((nkv, 0, 1), dtype=np.float32), np.ones((nkv, hd), dtype=np.float32),
                   head_len, False, False)


class RowsBinding(Protocol):
    """What a kernel module's ``bind_rows`` returns for a :class:`Rows` (``_core``: a checked
    binding; the NumPy twins: the Rows itself); the attention kernels take either."""

    @property
    def head_len(self) -> IP: ...


class AttendCall(NamedTuple):
    """One attention call over a :class:`Rows`.

    The queries of KV group ``g`` are rows ``[group_q0[g], group_q0[g + 1])`` of ``q``,
    position-major (``n_pos`` positions, each with the group's query heads; in int8-K mode
    already multiplied by the frozen K column).  Query position ``i`` of a group holding
    ``stored`` rows sees the rows ``[first_i, end_i)``: ``end_i = stored - n_back + i + 1``
    clamped to ``[0, stored]``, ``first_i = max(end_i - window, 0)`` when ``window > 0``, then
    ``first_i = min(max(first_i, first), end_i - 1)`` (``reference.visible_range``).

    ``imp_mode`` 0 leaves ``imp`` alone; 1 adds each query's probabilities in order
    (attend_rows only); 2 adds the call's summed mass once.  ``probs`` is attend_rows'
    probability matrix (``attend_blocked`` has none).
    """

    q: F32           # (nq, hd)
    group_q0: IP     # (nkv + 1,) offsets from 0 to nq
    n_pos: int
    n_back: int
    window: int
    first: int
    scale: float
    softcap: float
    out: F32         # (nq, hd), written
    imp: F32         # (m,), added into
    imp_mode: int
    n_threads: int
    probs: Optional[F32] = None   # (nq, L), written: attend_rows' probabilities


class O1State(NamedTuple):
    """A sealed layer's O(1) arrays (docs/o1.md): group-shared ones stacked over the G KV
    groups, per-head ones over the H query heads (head h is in group h // (H // G))."""

    sink_k: FA       # (G, s, d)
    sink_v: FA       # (G, s, dv)
    win_k: FA        # (G, c, d) the window ring, written by a step
    win_v: FA        # (G, c, dv)
    k_tilde: FA      # (G, m, d) key landmarks
    q_tilde: FA      # (H, m, d) query landmarks
    mu: FA           # (H, m, m) mixing matrices
    t_hat: FA        # (H, m, dv) far accumulators, updated
    z_hat: FA        # (H, m)
    m_max: FA        # (H, m)
    scale: float
    fm: bool         # the FM rectifier (else aggregate)


class O1Absorb(NamedTuple):
    """Rows ``[row0, row0 + n)`` of every group's ``keys`` / ``values`` to absorb, in row
    order, into the far field of each of the group's heads."""

    keys: FA         # (G, rows, d)
    values: FA       # (G, rows, dv)
    row0: int
    n: int
    scr: Optional[FA]   # (H, >= m) scratch (the twin needs none)
    n_threads: int


class O1Step(NamedTuple):
    """One decode step of every head.  When ``absorb``, each head first absorbs ring row
    ``slot`` of its group into its far field; the output reads the sinks, then ring rows
    ``[0, win_len)`` in slot order with row ``slot`` taken from ``(k_new, v_new)`` (counted
    in ``win_len``), plus the far field when ``use_far``; the new rows then go into the ring
    at ``slot``."""

    q: FA            # (H, d)
    k_new: FA        # (G, d)
    v_new: FA        # (G, dv)
    win_len: int
    slot: int
    absorb: bool
    use_far: bool
    out: FA          # (H, dv), written
    scr: Optional[FA]   # (H, >= s + win_len + 3 m) scratch (the twin needs none)
    n_threads: int


class MlaCall(NamedTuple):
    """Absorbed MLA attention of ``n`` query positions over the first ``T`` cached rows:
    position ``i`` attends the rows ``[0, T - n + i + 1)``."""

    qn: F32          # (n, H, dn) query, no-RoPE part
    qr: F32          # (n, H, dr) query, RoPE part
    lat: F32         # (T, r) cached latents
    kr: F32          # (T, dr) cached RoPE keys
    wuk: F32         # (H, dn, r) W_UK
    wuv: F32         # (H, dv, r) W_UV
    scale: float
    out: F32         # (n, H, dv), written
    n_threads: int


# ---------------------------------------------------------------------------------------------
# small checks

def _array(name: str, a: object, dtype: np.dtype[Any], ndim: int, *,
           writable: bool = False) -> npt.NDArray[Any]:
    """``a`` as the kernel binds it: an ndarray of ``dtype`` with ``ndim`` dimensions,
    C-contiguous, and writable when the kernel writes it."""
    if type(a) is np.ndarray and a.dtype is dtype and a.ndim == ndim:   # the common case, fast
        flags = a.flags
        if flags.c_contiguous and (flags.writeable or not writable):
            return a
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{name}: expected a numpy array, got {type(a).__name__}")
    if a.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {a.dtype}")
    if a.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {a.shape}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous array, got strides {a.strides}")
    if writable and not a.flags.writeable:
        raise ValueError(f"{name}: expected a writable array, got a read-only one")
    return a


def _count(name: str, value: object, lo: int, hi: int = COUNT_MAX) -> int:
    """An integer in [lo, hi] (anything with ``__index__``, bools excluded)."""
    v = as_int(name, value)
    if not lo <= v <= hi:
        raise ValueError(f"{name}: expected {lo} <= {name} <= {_bound(hi)}, got {v}")
    return v


def _real(name: str, value: object) -> None:
    """A real number (the kernel takes it as float32; NaN and inf are values, not errors)."""
    if type(value) is not float and not isinstance(value, numbers.Real):   # float: fast
        raise TypeError(f"{name}: expected a real number, got {type(value).__name__}")


def _bound(hi: int) -> str:
    return {COUNT_MAX: "2**62", THREADS_MAX: "2**31 - 1"}.get(hi, str(hi))


def _threads(value: object) -> int:
    if type(value) is int and 1 <= value <= THREADS_MAX:   # the common case, fast
        return value
    return _count("n_threads", value, 1, THREADS_MAX)


def k_group_of(hd: int, n_scales: int, k_group: int = 0) -> int:
    """The K group of a q8 call: ``k_group`` when 16 or 32, else 16 when the K store holds
    ceil(hd / 16) scales per row (and hd > 16), otherwise 32 (the two agree for head dims
    <= 16, where one partial group covers the row either way).  ValueError for another
    ``k_group``."""
    if k_group in (16, 32):
        return k_group
    if k_group != 0:
        raise ValueError(f"k_group: expected 16, 32 or 0 (from the scale count), got {k_group}")
    return 16 if hd > 16 and n_scales == -(-hd // 16) else 32


# ---------------------------------------------------------------------------------------------
# attention

class RowsShape(NamedTuple):
    """What :func:`check_rows` found in a :class:`Rows`: its KV groups, head_dim, the rows
    its storage holds per group and the K scale group."""

    nkv: int
    hd: int
    capacity: int
    k_group: int


def _four_bit(name: str, flag: object, int8: object, component: str) -> bool:
    """A descriptor's 4-bit flag for ``component``: a bool, and not set with its int8 flag."""
    if type(flag) is not bool:
        raise TypeError(f"{name}: expected a bool, got {type(flag).__name__}")
    if flag and int8:
        raise ValueError(f"{name}: 4-bit {component} and quant_{component.lower()} (int8 "
                         f"{component}) are exclusive")
    return flag


def check_rows(rows: Rows) -> RowsShape:
    """The storage half of the attention checks: the arrays of ``rows`` (dtypes, dimensions,
    layouts, shapes against each other) and ``head_len``'s type and length, not its values
    (a layer changes them in place between calls; :func:`check_call` reads them).

    The compiled kernels check a storage once, when it is bound (``_core.bind_rows``), and
    each call against it: an ndarray's dtype, dimensions and memory cannot change while a
    binding holds its buffer (the binding keeps its own copy of the shape)."""
    head_len = _array("head_len", rows.head_len, _IP, 1)
    nkv = head_len.shape[0]
    kf = _array("kf", rows.kf, _F32, 3)
    kq = _array("kq", rows.kq, _I8, 3)
    ks = _array("ks", rows.ks, _F32, 3)
    vf = _array("vf", rows.vf, _F32, 3)
    vq = _array("vq", rows.vq, _I8, 3)
    vs = _array("vs", rows.vs, _F32, 3)
    vcol = _array("vcol", rows.vcol, _F32, 2)
    k_group = _count("k_group", rows.k_group, 0, 32)
    if _four_bit("k4", rows.k4, rows.quant_k, "K"):
        kc4 = _array("kc4", rows.kc4, _U8, 3)
        kp = _array("kp", rows.kp, _U16, 3)
        kr = _array("kr", rows.kr, _F32, 3)
        kcap, hd = kc4.shape[1], kr.shape[2]
        k_group = 16
        if hd % 8 or hd < 1:
            raise ValueError(f"4-bit K: head_dim must be a multiple of 8, got {hd}")
        if kc4.shape[0] < nkv or kc4.shape[2] != hd // 2 or kp.shape[0] < nkv \
                or kp.shape[1] != -(-kcap // K4_BLOCK) or kp.shape[2] != 2 * hd \
                or kr.shape[0] < nkv or kr.shape[1] != K4_RING:
            raise ValueError(f"4-bit K: expected kc4 (nkv, capacity, head_dim / 2), kp (nkv, "
                             f"ceil(capacity / {K4_BLOCK}), 2 * head_dim) and kr (nkv, "
                             f"{K4_RING}, head_dim)")
    elif rows.quant_k:
        kcap, hd = kq.shape[1], kq.shape[2]
        k_group = k_group_of(hd, ks.shape[2], k_group)
        if kq.shape[0] < nkv or ks.shape[0] < nkv or ks.shape[1] != kcap \
                or ks.shape[2] < -(-hd // k_group):
            raise ValueError("int8 K: expected kq (nkv, capacity, head_dim) and ks "
                             "(nkv, capacity, ceil(head_dim/k_group))")
    else:
        kcap, hd = kf.shape[1], kf.shape[2]
        k_group = 32
        if kf.shape[0] < nkv:
            raise ValueError("float32 K: expected kf (nkv, capacity, head_dim)")
    if hd < 1:
        raise ValueError(f"K: expected head_dim >= 1, got {hd}")
    if _four_bit("v4", rows.v4, rows.quant_v, "V"):
        vc4 = _array("vc4", rows.vc4, _U8, 3)
        vp = _array("vp", rows.vp, _U16, 3)
        vcap = vc4.shape[1]
        if hd % 8:
            raise ValueError(f"4-bit V: head_dim must be a multiple of 8, got {hd}")
        if vc4.shape[0] < nkv or vc4.shape[2] != hd // 2 or vp.shape[0] < nkv \
                or vp.shape[1] != vcap or vp.shape[2] != 2 * -(-hd // 16):
            raise ValueError("4-bit V: expected vc4 (nkv, capacity, head_dim / 2) and vp "
                             "(nkv, capacity, 2 * ceil(head_dim / 16))")
    elif rows.quant_v:
        vcap = vq.shape[1]
        if vq.shape[0] < nkv or vq.shape[2] != hd or vs.shape[0] < nkv \
                or vs.shape[1] != vcap or vs.shape[2] != 1 or vcol.shape[0] < nkv \
                or vcol.shape[1] != hd:
            raise ValueError("int8 V: expected vq (nkv, capacity, head_dim), vs "
                             "(nkv, capacity, 1) and vcol (nkv, head_dim)")
    else:
        vcap = vf.shape[1]
        if vf.shape[0] < nkv or vf.shape[2] != hd:
            raise ValueError("float32 V: expected vf (nkv, capacity, head_dim)")
    return RowsShape(nkv, hd, min(kcap, vcap), k_group)


def _arrays_fast(call: AttendCall, hd: int, nq: int, blocked: bool) -> bool:
    """The common case of :func:`check_call`'s array checks, in one expression (no
    messages): every array an ndarray of its dtype, dimensions and layout, the written ones
    writable, ``q`` and ``out`` (nq, hd), ``probs`` (nq, .)."""
    q, out, imp, g0, probs = call.q, call.out, call.imp, call.group_q0, call.probs
    nd = np.ndarray
    return (type(q) is nd and type(out) is nd and type(imp) is nd and type(g0) is nd
            and q.dtype is _F32 and out.dtype is _F32 and imp.dtype is _F32
            and g0.dtype is _IP and q.ndim == 2 and imp.ndim == 1 and g0.ndim == 1
            and q.shape[1] == hd and out.shape == (nq, hd) and q.flags.c_contiguous
            and out.flags.c_contiguous and out.flags.writeable and imp.flags.c_contiguous and imp.flags.writeable
            and g0.flags.c_contiguous
            and (blocked or (type(probs) is nd and probs.dtype is _F32 and probs.ndim == 2
                             and probs.shape[0] == nq and probs.flags.c_contiguous
                             and probs.flags.writeable)))


def _counts_fast(call: AttendCall) -> bool:
    """The common case of :func:`check_call`'s number checks: plain ints in range."""
    n_pos, n_back, window, first = call.n_pos, call.n_back, call.window, call.first
    return (type(n_pos) is int and type(n_back) is int and type(window) is int
            and type(first) is int and type(call.n_threads) is int
            and type(call.imp_mode) is int and 0 <= call.imp_mode <= 2
            and 1 <= n_pos <= COUNT_MAX and 0 <= n_back <= COUNT_MAX and 0 <= window <= COUNT_MAX
            and 0 <= first <= COUNT_MAX and 1 <= call.n_threads <= THREADS_MAX
            and type(call.scale) is float and type(call.softcap) is float)


def check_call(rows: Rows, shape: RowsShape, call: AttendCall, blocked: bool) -> None:
    """The call half of the attention checks: ``call`` against a storage that passed
    :func:`check_rows` with ``shape`` (its queries, outputs and counts; the rows each KV
    group holds now, ``rows.head_len``, against the capacity).  ``blocked``: the checks of
    ``attend_blocked`` (no probability matrix, importance mode 0 or 2), else those of
    ``attend_rows``."""
    nkv, hd = shape.nkv, shape.hd
    q = call.q
    nq = q.shape[0] if type(q) is np.ndarray and q.ndim == 2 else -1
    if not (nq >= 0 and _arrays_fast(call, hd, nq, blocked) and _counts_fast(call)):
        _call_full(call, hd, blocked)     # raises naming what is wrong; passes numbers of
                                          # other types (numpy integers, float32 scales)
    imp_mode = call.imp_mode
    if imp_mode not in ((0, 2) if blocked else (0, 1, 2)):
        raise ValueError(f"imp_mode: expected {'0 or 2' if blocked else '0, 1 or 2'}, got "
                         f"{imp_mode}")
    n_pos = call.n_pos
    g0 = call.group_q0.tolist()
    if len(g0) != nkv + 1 or g0[0] != 0 or g0[nkv] != nq:
        raise ValueError(f"group_q0: expected {nkv + 1} offsets from 0 to {nq}")
    for g in range(nkv):
        cnt = g0[g + 1] - g0[g]
        if cnt < 0 or cnt % n_pos:
            raise ValueError(f"group_q0: group {g} has {cnt} queries, expected a multiple "
                             f"of n_pos={n_pos}")
    cap = shape.capacity
    for g, n in enumerate(rows.head_len.tolist()):
        if not 0 <= n <= cap:
            raise ValueError(f"head_len: group {g} has {n} rows, expected 0..{cap} (the "
                             f"storage capacity)")


def _call_full(call: AttendCall, hd: int, blocked: bool) -> None:
    """:func:`check_call`'s array and number checks one by one, raising the error of the first
    that ``call`` fails (the path taken when the common case's expression is False)."""
    _threads(call.n_threads)
    imp_mode = _count("imp_mode", call.imp_mode, 0, 2)
    q = _array("q", call.q, _F32, 2)
    nq = q.shape[0]
    if q.shape[1] != hd:
        raise ValueError(f"q: expected head_dim {hd} (the storage's), got {q.shape[1]}")
    _count("n_pos", call.n_pos, 1)
    try:
        for name in ("n_back", "window", "first"):
            _count(name, getattr(call, name), 0)
    except ValueError:
        raise ValueError(f"n_back, window, first: expected each in [0, 2**62], got "
                         f"{call.n_back}, {call.window}, {call.first}") from None
    _real("scale", call.scale)
    _real("softcap", call.softcap)
    _array("group_q0", call.group_q0, _IP, 1)
    out = _array("out", call.out, _F32, 2, writable=True)
    if out.shape != (nq, hd):
        raise ValueError(f"out: expected shape ({nq}, {hd}), got {out.shape}")
    _array("imp", call.imp, _F32, 1, writable=True)
    if not blocked:
        probs = _array("probs", call.probs, _F32, 2, writable=True)
        if probs.shape[0] != nq:
            raise ValueError(f"probs: expected shape ({nq}, L), got {probs.shape}")


# ---------------------------------------------------------------------------------------------
# O(1) step

def _o1_ok(ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"O(1) kernel: inconsistent state or arguments, expected {what}")


def _o1_arrays(state: O1State) -> list[npt.NDArray[Any]]:
    names = ("sink_k", "sink_v", "win_k", "win_v", "k_tilde", "q_tilde", "mu", "t_hat",
             "z_hat", "m_max")
    written = ("win_k", "win_v", "t_hat", "z_hat", "m_max")
    arrs = [_array(n, getattr(state, n), _F32, 2 if n in ("z_hat", "m_max") else 3,
                   writable=n in written) for n in names]
    _real("scale", state.scale)
    return arrs


def check_o1_absorb(state: O1State, rows: O1Absorb) -> None:
    """The checks of ``_core.o1_absorb``: the far field of every head (``q_tilde``, ``t_hat``,
    ``z_hat``, ``m_max``) against the rows absorbed and the scratch."""
    _, _, _, _, _, q_tilde, _, t_hat, z_hat, m_max = _o1_arrays(state)
    keys = _array("keys", rows.keys, _F32, 3)
    values = _array("values", rows.values, _F32, 3)
    scr = _array("scr", rows.scr, _F32, 2, writable=True)
    row0 = _count("row0", rows.row0, -COUNT_MAX)
    n = _count("n", rows.n, -COUNT_MAX)
    _threads(rows.n_threads)
    H, m, d = q_tilde.shape
    if H == 0 or m == 0 or n <= 0:
        return                                   # nothing to absorb: the kernel returns
    G, nrows, dv = keys.shape[0], keys.shape[1], values.shape[2]
    _o1_ok(G > 0 and H % G == 0, "H a positive multiple of G")
    _o1_ok(keys.shape[2] == d and values.shape[:2] == (G, nrows),
           "keys (G, n, d) and values (G, n, dv)")
    _o1_ok(t_hat.shape == (H, m, dv) and z_hat.shape == (H, m) and m_max.shape == (H, m),
           "far accumulators (H, m, .)")
    _o1_ok(scr.shape[0] == H and scr.shape[1] >= m, "scratch (H, >= m)")
    _o1_ok(0 <= row0 and row0 + n <= nrows, "rows [row0, row0 + n) inside keys")


class O1Shape(NamedTuple):
    """What :func:`check_o1_state` found in an :class:`O1State`: H query heads, G groups,
    m landmarks, key and value widths d and dv, ns sink rows and a ring of cap rows."""

    H: int
    G: int
    m: int
    d: int
    dv: int
    ns: int
    cap: int


def check_o1_state(state: O1State) -> O1Shape:
    """The state half of the O(1) step checks: every array of ``state`` (dtype, dimensions,
    layout, writable where a step writes) and their shapes against each other.

    The compiled kernel checks a state once, when it is bound (``_core.bind_o1``), and each
    step against it (:func:`check_o1_call`)."""
    sink_k, sink_v, win_k, win_v, k_tilde, q_tilde, mu, t_hat, z_hat, m_max = _o1_arrays(state)
    G, ns, d = sink_k.shape
    H, m = q_tilde.shape[0], q_tilde.shape[1]
    dv, cap = sink_v.shape[2], win_k.shape[1]
    _o1_ok(H > 0 and G > 0 and H % G == 0, "H a positive multiple of G")
    _o1_ok(sink_v.shape[:2] == (G, ns), "sinks (G, s, d) and (G, s, dv)")
    _o1_ok(win_k.shape[0] == G and win_k.shape[2] == d and win_v.shape == (G, cap, dv),
           "window (G, c, d) and (G, c, dv)")
    _o1_ok(k_tilde.shape == (G, m, d) and q_tilde.shape[2] == d and mu.shape == (H, m, m)
           and t_hat.shape == (H, m, dv) and z_hat.shape == (H, m) and m_max.shape == (H, m),
           "landmark state (G|H, m, .)")
    return O1Shape(H, G, m, d, dv, ns, cap)


def check_o1_call(shape: O1Shape, step: O1Step) -> None:
    """The step half of the O(1) step checks: ``step``'s queries, new rows, ring position,
    output and scratch against a state that passed :func:`check_o1_state` with ``shape``.

    The common case is one expression (a step runs every token, often with the interpreter's
    own data out of cache: each separate check there costs cache misses); anything it does
    not accept goes through the checks one by one, which raise naming what is wrong."""
    H, G, m, d, dv, ns, cap = shape
    q, k_new, v_new, out, scr = step.q, step.k_new, step.v_new, step.out, step.scr
    win_len, slot, nd = step.win_len, step.slot, np.ndarray
    if (type(q) is nd and type(k_new) is nd and type(v_new) is nd and type(out) is nd
            and type(scr) is nd and type(win_len) is int and type(slot) is int
            and type(step.n_threads) is int and 1 <= step.n_threads <= THREADS_MAX
            and q.dtype is _F32 and k_new.dtype is _F32 and v_new.dtype is _F32
            and out.dtype is _F32 and scr.dtype is _F32
            and q.shape == (H, d) and k_new.shape == (G, d) and v_new.shape == (G, dv)
            and out.shape == (H, dv) and scr.ndim == 2 and scr.shape[0] == H
            and 1 <= win_len <= cap and 0 <= slot < win_len
            and scr.shape[1] >= ns + win_len + 3 * m
            and q.flags.c_contiguous and k_new.flags.c_contiguous
            and v_new.flags.c_contiguous and out.flags.c_contiguous and out.flags.writeable
            and scr.flags.c_contiguous and scr.flags.writeable):
        return
    q = _array("q", step.q, _F32, 2)
    k_new = _array("k_new", step.k_new, _F32, 2)
    v_new = _array("v_new", step.v_new, _F32, 2)
    out = _array("out", step.out, _F32, 2, writable=True)
    scr = _array("scr", step.scr, _F32, 2, writable=True)
    win_len = _count("win_len", step.win_len, -COUNT_MAX)
    slot = _count("slot", step.slot, -COUNT_MAX)
    _threads(step.n_threads)
    H, G, m, d, dv, ns, cap = shape
    _o1_ok(q.shape == (H, d), "q (H, d)")
    _o1_ok(k_new.shape == (G, d) and v_new.shape == (G, dv), "k_new (G, d), v_new (G, dv)")
    _o1_ok(1 <= win_len <= cap and 0 <= slot < win_len, "0 <= slot < win_len <= capacity")
    _o1_ok(out.shape == (H, dv), "out (H, dv)")
    _o1_ok(scr.shape[0] == H and scr.shape[1] >= ns + win_len + 3 * m,
           "scratch (H, >= sinks + win_len + 3 m)")


# ---------------------------------------------------------------------------------------------
# MLA decode

def check_mla_attend(call: MlaCall) -> None:
    """The checks of ``_core.mla_attend``: the shapes of the queries, the cache, the weights
    and the output against each other, and at least as many cached rows as positions."""
    qn = _array("qn", call.qn, _F32, 3)
    qr = _array("qr", call.qr, _F32, 3)
    lat = _array("lat", call.lat, _F32, 2)
    kr = _array("kr", call.kr, _F32, 2)
    wuk = _array("wuk", call.wuk, _F32, 3)
    wuv = _array("wuv", call.wuv, _F32, 3)
    out = _array("out", call.out, _F32, 3, writable=True)
    _real("scale", call.scale)
    _threads(call.n_threads)
    n, H, dn = qn.shape
    if n == 0 or H == 0:
        return                                   # nothing to compute: the kernel returns
    T, r = lat.shape
    dr, dv = kr.shape[1], wuv.shape[1]
    if qr.shape[:2] != (n, H):
        raise ValueError("MLA kernel: q_rope must be (n, H, d_rope) like q_nope")
    if not (kr.shape[0] == T and r > 0 and dr == qr.shape[2]):
        raise ValueError("MLA kernel: k_rope must be (T, d_rope) with the rows of latent")
    if wuk.shape != (H, dn, r):
        raise ValueError("MLA kernel: w_uk must be (H, d_nope, r)")
    if not (wuv.shape[0] == H and wuv.shape[2] == r and dv > 0):
        raise ValueError("MLA kernel: w_uv must be (H, d_v, r)")
    if out.shape != (n, H, dv):
        raise ValueError("MLA kernel: out must be (n, H, d_v)")
    if T < n:
        raise ValueError(f"MLA kernel: {n} query positions need at least {n} cached rows, got {T}")


# ---------------------------------------------------------------------------------------------
# q8 scoring, exposed for tests

def check_quantize_query(q: F32, qi: I8, sq: F32, qsum: I32, group: int) -> None:
    """The checks of ``_core.quantize_query``."""
    if group not in (16, 32):
        raise ValueError(f"group: expected 16 or 32, got {group}")
    q = _array("q", q, _F32, 2)
    qi = _array("qi", qi, _I8, 2, writable=True)
    sq = _array("sq", sq, _F32, 2, writable=True)
    qsum = _array("qsum", qsum, _I32, 2, writable=True)
    nq, hd = q.shape
    ng = -(-hd // group)
    if hd < 1 or qi.shape != (nq, -(-hd // 32) * 32) or sq.shape != (nq, ng) \
            or qsum.shape != (nq, ng):
        raise ValueError("quantize_query: expected qi (nq, ceil(hd/32)*32), sq and qsum "
                         "(nq, ceil(hd/group))")


def check_k4_scores(q: object, kc: object, kp: object, kr: object, n: object,
                    out: object) -> int:
    """The checks of ``_core.k4_scores``: q (nq, hd) float32 with hd a multiple of 8, kc
    (cap, hd / 2) uint8, kp (ceil(cap / 32), 2 * hd) uint16, kr (K4_RING, hd) float32,
    0 <= n <= cap, out (nq, n) float32 writable.  Returns n."""
    qa = _array("q", q, _F32, 2)
    kca = _array("kc", kc, _U8, 2)
    kpa = _array("kp", kp, _U16, 2)
    kra = _array("kr", kr, _F32, 2)
    outa = _array("out", out, _F32, 2, writable=True)
    rows = _count("n", n, 0)
    nq, hd = qa.shape
    if hd < 8 or hd % 8 or kca.shape[1] != hd // 2 or kpa.shape[1] != 2 * hd \
            or kra.shape != (K4_RING, hd) or rows > kca.shape[0] \
            or kpa.shape[0] != -(-kca.shape[0] // K4_BLOCK) or outa.shape != (nq, rows):
        raise ValueError(f"k4_scores: expected q (nq, hd) with hd a multiple of 8, kc (cap, "
                         f"hd / 2), kp (ceil(cap / {K4_BLOCK}), 2 * hd), kr ({K4_RING}, hd), "
                         f"n <= cap and out (nq, n); got q {qa.shape}, kc {kca.shape}, kp "
                         f"{kpa.shape}, kr {kra.shape}, n {rows}, out {outa.shape}")
    return rows


def check_q8_scores(q: F32, kq: I8, ks: F32, out: F32, k_group: int) -> int:
    """The checks of ``_core.q8_scores``; returns the K group."""
    q = _array("q", q, _F32, 2)
    kq = _array("kq", kq, _I8, 2)
    ks = _array("ks", ks, _F32, 2)
    out = _array("out", out, _F32, 2, writable=True)
    nq, hd = q.shape
    n = kq.shape[0]
    if hd < 1:
        raise ValueError("q8_scores: expected head_dim >= 1")
    group = k_group_of(hd, ks.shape[1], _count("k_group", k_group, 0, 32))
    if kq.shape[1] != hd or ks.shape[0] != n or ks.shape[1] < -(-hd // group) \
            or out.shape != (nq, n):
        raise ValueError("q8_scores: expected kq (n, hd), ks (n, >= ceil(hd/group)), out (nq, n)")
    return group
