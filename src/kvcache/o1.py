"""The O(1) Nystrom override of a LayerKvCache (docs/o1.md).

A long prompt is frozen, at the end of prefill, into a state of constant size per KV group:

* group-shared (stored once per KV group): ``sink`` sink keys/values, an exact window ring of
  the last ``w`` keys/values, and ``m_eff`` key landmarks (segment means of the prompt keys);
* per query head: ``m_eff`` query landmarks (segment means of that head's prompt queries), the
  ridge pseudo-inverse ``M`` of ``Au = exp(s Q~ K~^T)``, and the far-field accumulators
  ``T^`` (m_eff x dv), ``Z^`` (m_eff) kept at scale ``exp(-m_max)`` per landmark.

Each decode step inserts the new key/value once per group; the key that leaves a full window
is absorbed into every head's far field; each head's output is the joint-denominator mix of
the exact near set (sinks and window) and the Nystrom far field.  Time and memory per step do
not depend on the context length.

State machine (``LayerKvCache.o1``)::

    None --o1_begin--> O1Collecting --o1_seal ok--> O1Sealed
                              |  (preconditions fail: layer stays exact, o1 = None)
    clear() returns to None from anywhere.

Numbers.  The seal maths (segment means, ``Au``, the ridge pseudo-inverse) run in float64 and
are stored as float32; the replay of the prompt through the window and every decode step run
in float32 in the compiled kernels (``_core.o1_absorb`` / ``_core.o1_step``, whose summation
orders are written down in ``_kernels.h``).  The score scale is ``1/sqrt(head_dim)`` in
float32; the layer's own scale and softcap are not used (to use a scale ``s'``, multiply the
pushed queries and the step queries by ``s' * sqrt(head_dim)``: landmarks are means, so the
operator is then exactly the one with scale ``s'``).

Beyond the specified operator (docs/o1.md): every seal estimates its own error
(:func:`estimate_error`, :class:`O1Error`; ``LayerKvCache.o1_seal(max_error=...)`` refuses a
seal above a bound), and two far-field options, off by default: ``keep`` far keys per group
kept exact beside the sinks (:func:`select_kept`) and the pseudo-inverse's ``ridge``.

Where this differs from the upstream engine (deliberately):

* bad arguments raise instead of being clamped or ignored: ``o1_begin`` with m < 4, w < 1 or
  sink < 0 (ValueError), ``o1_push_q`` with a shape that is not whole positions (even when not
  collecting), ``o1_seal(num_heads)`` with num_heads < 1 (even when already sealed);
* ``o1_step`` before a seal raises RuntimeError (upstream returns zeros); so do ``o1_begin`` on
  a sealed layer (its KV is gone: ``clear()`` first) and ``truncate_last`` on a sealed layer
  (use ``o1_snapshot``/``o1_restore``, which upstream does not offer on the cache);
* a seal that raises (e.g. MemoryError) leaves the layer collecting, as before the call;
* ``Au`` is computed from the float32-stored landmarks, widened (so ``M`` belongs to the very
  landmarks the decode step uses); sink and window scores use the same dot product;
* device views hold 2-D arrays (their ``ravel()`` is upstream's flat slice, without a copy).
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import numpy.typing as npt

from ._entry import O1Absorb, O1State, O1Step
from ._threads import threads_for
from ._validate import readonly

if TYPE_CHECKING:
    from .layer import LayerKvCache

F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]

__all__ = ["O1Rect", "O1Error", "O1Collecting", "O1Sealed", "O1DeviceView", "O1HeadView", "O1Snapshot",
           "EXACT_SLACK", "EXACT_EXTRA", "seg_means", "ridge_pinv", "effective_landmarks",
           "o1_scale", "check_seal", "estimate_error", "check_max_error", "select_kept",
           "ERROR_QUERIES", "KEEP_QUERIES", "RIDGE", "check_ridge"]

log = logging.getLogger("kvcache")

_F32 = np.float32
EXACT_SLACK = 8          # a seal prompt of t <= w + sink + EXACT_SLACK positions is kept exact
_RIDGE = 1e-6            # ridge, relative to mean(diag(A^T A)) (the specified default)
RIDGE = _RIDGE
_RIDGE_TRIES = 12        # ridge x10 per failed Cholesky, this many attempts
EXACT_EXTRA = 64         # spare window rows allocated for an exact-only group at seal
_EXACT_EXTRA = EXACT_EXTRA
ERROR_QUERIES = 16       # prompt queries (the last ones) the seal's error estimate replays
KEEP_QUERIES = 256       # prompt queries (before the estimate's) that choose the kept keys


class O1Rect(enum.Enum):
    """Rectifier of the Nystrom far field (docs/o1.md, rectifiers).

    AGGREGATE (default): drop the far field when its aggregate denominator is negative.
    FM: also clamp the landmark mixing row ``u = F M`` at 0, so every output lies in the hull
    of the values (measurably worse perplexity upstream).
    """

    AGGREGATE = "aggregate"
    FM = "fm"

    @classmethod
    def parse(cls, value: object) -> O1Rect:
        """An O1Rect from itself or from ``"agg"``/``"aggregate"``/``"fm"`` (any case)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            key = value.strip().lower()
            if key in ("agg", "aggregate"):
                return cls.AGGREGATE
            if key == "fm":
                return cls.FM
            raise ValueError(f"rect: expected 'agg', 'aggregate' or 'fm', got {value!r}")
        raise TypeError(f"rect: expected an O1Rect or a string, got {type(value).__name__}")


@dataclass(frozen=True)
class O1Error:
    """The seal's estimate of the O(1) operator's relative error (docs/o1.md, error estimate).

    The last ``queries`` prompt queries are read as if they were decode queries at the end of
    the prompt, through the state the seal built (near set exact, far field Nystrom), and
    compared with exact softmax attention over all ``t`` prompt keys:
    ``||o1 - exact|| / ||exact||`` (L2 over the queries' outputs), per query head and over all
    of them.  1.0 is what returning zeros would score.
    """

    per_head: tuple[float, ...]
    overall: float
    queries: int
    t: int

    def __str__(self) -> str:
        heads = ", ".join(f"{e:.3g}" for e in self.per_head)
        return (f"estimated relative error {self.overall:.3g} (per head: {heads}; "
                f"{self.queries} prompt queries of {self.t})")


def check_max_error(max_error: object) -> Optional[float]:
    """``max_error`` of :meth:`LayerKvCache.o1_seal` checked: None, or a float > 0 (finite or
    inf).  TypeError for a non-number (bool included), ValueError for nan or a value <= 0."""
    if max_error is None:
        return None
    if isinstance(max_error, bool) or not isinstance(max_error, (int, float, np.integer,
                                                                 np.floating)):
        raise TypeError(f"max_error: expected None or a positive number, got "
                        f"{type(max_error).__name__}")
    value = float(max_error)
    if not value > 0:          # nan too
        raise ValueError(f"max_error: expected a positive number (a relative error bound, "
                         f"e.g. 0.3), got {max_error!r}")
    return value


def o1_scale(d: int) -> np.float32:
    """The operator's score scale 1/sqrt(d), computed in float32 as upstream does."""
    scale: np.float32 = _F32(1.0) / np.sqrt(_F32(d))
    return scale


def effective_landmarks(t: int, m: int) -> int:
    """``m_eff = clamp(t // 8, 4, m)``: fewer landmarks for a short seal prompt."""
    return min(max(t // 8, 4), m)


def seg_means(x: npt.ArrayLike, m: int) -> F64:
    """Segment means (float64) of the rows of ``x`` (..., t, d) into m landmarks.

    Segment i covers rows ``[floor(i t / m), floor((i + 1) t / m))`` (the Nystromformer recipe);
    sums are accumulated in float64 without a float64 copy of ``x``.
    """
    xa = np.asarray(x)
    t = xa.shape[-2]
    bounds = (np.arange(m + 1) * t) // m                                # (m+1,)
    out = np.empty(xa.shape[:-2] + (m, xa.shape[-1]))                  # (..., m, d)
    for i in range(m):
        a, b = int(bounds[i]), int(bounds[i + 1])
        out[..., i, :] = xa[..., a:b, :].sum(axis=-2, dtype=np.float64) / max(b - a, 1)
    return out


def select_kept(q_trace: F32, keys: F32, *, t: int, sink: int, w: int, keep: int,
                scale: float) -> npt.NDArray[np.intp]:
    """The far keys a seal keeps exact (docs/o1.md, kept keys): (G, n) row indices, ascending
    per group, ``n = min(keep, t - sink - w)``.

    Per KV group, each far candidate (rows ``sink .. t - w - 1``) is scored by the attention
    mass the group's heads give it from the ``KEEP_QUERIES`` prompt queries before the last
    ``ERROR_QUERIES`` (each query's softmax over all t keys, float64); the ``n`` largest win
    (the earlier row on a tie)."""
    nkv = keys.shape[0]
    nh = q_trace.shape[1]
    hpk = nh // nkv
    n_far = t - sink - w
    n = max(min(keep, n_far), 0)
    out = np.empty((nkv, n), dtype=np.intp)
    if n == 0:
        return out
    hi = max(t - ERROR_QUERIES, 1)
    lo = max(hi - KEEP_QUERIES, 0)
    for g in range(nkv):
        kg = keys[g, :t].astype(np.float64)
        mass = np.zeros(n_far)
        for h in range(g * hpk, (g + 1) * hpk):
            sc = float(scale) * (q_trace[lo:hi, h].astype(np.float64) @ kg.T)       # (nq, t)
            p = np.exp(sc - sc.max(axis=1, keepdims=True))
            p /= p.sum(axis=1, keepdims=True)
            mass += p[:, sink: sink + n_far].sum(axis=0)
        best = np.argsort(-mass, kind="stable")[:n]
        out[g] = sink + np.sort(best)
    return out


def check_ridge(ridge: object) -> float:
    """The ``ridge`` of ``o1_begin`` checked: a finite float in (0, 1] (TypeError for a
    non-number, bool included; ValueError otherwise)."""
    if isinstance(ridge, bool) or not isinstance(ridge, (int, float, np.integer, np.floating)):
        raise TypeError(f"ridge: expected a number, got {type(ridge).__name__}")
    value = float(ridge)
    if not 0.0 < value <= 1.0:
        raise ValueError(f"ridge: expected a number in (0, 1] (relative to mean(diag(A^T A))), "
                         f"got {ridge!r}")
    return value


def ridge_pinv(a: npt.ArrayLike, ridge: Optional[float] = None) -> F64:
    """Ridge pseudo-inverse ``(A^T A + lam I)^-1 A^T`` of a square float64 matrix (docs/o1.md).

    ``lam = ridge * mean(diag(A^T A))``, ridge 1e-6 by default (at least the smallest positive float64); a Cholesky that
    fails (non-positive or non-finite pivot) multiplies lam by 10, up to 12 attempts; after
    that the fallback is ``I / mean(diag(A^T A))``.
    """
    a64 = np.asarray(a, dtype=np.float64)
    n = a64.shape[0]
    rel = _RIDGE if ridge is None else ridge
    with np.errstate(all="ignore"):
        g = a64.T @ a64
        mean_diag = float(np.mean(np.diag(g))) if n else 1.0
        lam = (max(rel * mean_diag, float(np.finfo(np.float64).tiny))
               if mean_diag == mean_diag else float("nan"))
        eye = np.eye(n)
        for _ in range(_RIDGE_TRIES):
            try:
                low: Optional[F64] = np.linalg.cholesky(g + lam * eye)
            except np.linalg.LinAlgError:
                low = None
            if low is not None and np.all(np.isfinite(low)) and np.all(np.diag(low) > 0):
                y = _solve_lower(low, a64.T)
                return _solve_lower(low.T[::-1, ::-1], y[::-1])[::-1]
            lam *= 10.0
        fallback: F64 = eye / mean_diag
        return fallback


def _solve_lower(low: F64, b: F64) -> F64:
    """Forward substitution ``low @ x = b`` (low lower-triangular), column-vectorised."""
    n = low.shape[0]
    x = np.empty_like(b)
    for i in range(n):
        x[i] = (b[i] - low[i, :i] @ x[:i]) / low[i, i]
    return x


# ---------------------------------------------------------------------------------- states
class O1Collecting:
    """O(1) requested, prompt in progress: the query trace is being collected.

    The trace is position-major float32, ``num_heads * head_dim`` floats per position, appended
    verbatim by :meth:`LayerKvCache.o1_push_q`."""

    sealed = False

    def __init__(self, m: int, w: int, sink: int, rect: O1Rect, head_dim: int,
                 keep: int = 0, ridge: float = _RIDGE) -> None:
        self.m, self.w, self.sink, self.rect = m, w, sink, rect
        self.keep, self.ridge = keep, ridge
        self._hd = head_dim
        self._q = np.zeros(0, dtype=_F32)
        self._len = 0

    def push(self, q: npt.NDArray[np.float32]) -> None:
        """Append the float32 values of ``q`` (already validated) to the trace."""
        flat = q.reshape(-1)
        need = self._len + flat.size
        if need > self._q.size:
            grown = np.empty(max(need, 2 * self._q.size, 1024), dtype=_F32)
            grown[: self._len] = self._q[: self._len]
            self._q = grown
        self._q[self._len: need] = flat
        self._len = need

    @property
    def trace(self) -> npt.NDArray[np.float32]:
        """The collected queries, a read-only flat float32 view."""
        return readonly(self._q[: self._len])

    @property
    def head_dim(self) -> int:
        """Channels per query head of the layer this trace belongs to."""
        return self._hd

    def memory_bytes(self) -> int:
        return 4 * self._len

    def __repr__(self) -> str:
        return (f"O1Collecting(m={self.m}, w={self.w}, sink={self.sink}, rect={self.rect.name}, "
                f"keep={self.keep}, ridge={self.ridge:g}, trace_floats={self._len})")


@dataclass(frozen=True)
class O1HeadView:
    """Read-only views of one query head's part of a sealed group (docs/o1.md)."""

    rect_fm: bool
    t_hat: F32      # (m_eff, dv) far numerators, at scale exp(-m_max) per landmark
    z_hat: F32      # (m_eff,) far denominators, same scale
    m_max: F32      # (m_eff,) running max of the landmark logits
    q_tilde: F32    # (m_eff, d) query landmarks
    mu: F32         # (m_eff, m_eff) ridge pseudo-inverse M of Au


@dataclass(frozen=True)
class O1DeviceView:
    """Read-only views of one KV group's sealed state, for device mirrors (docs/o1.md).

    Scalars are a snapshot taken by :meth:`LayerKvCache.o1_views`; the arrays are live views of
    the state (a later ``o1_step`` changes the ring and the far accumulators under them).
    Arrays are 2-D row-major (``win_k.ravel()`` is upstream's flat ``[w*d]`` slice, no copy).
    """

    m_eff: int
    w: int
    sink_len: int
    d: int
    dv: int
    exact_only: bool
    scale: float
    win_len: int
    win_head: int
    far_len: int
    win_k: F32      # (w, d) window ring, slot order
    win_v: F32      # (w, dv)
    sink_k: F32     # (sink_len, d)
    sink_v: F32     # (sink_len, dv)
    k_tilde: F32    # (m_eff, d) key landmarks
    heads: tuple[O1HeadView, ...]   # one per query head of the group


class O1Snapshot:
    """An opaque copy of a sealed layer's mutable O(1) state (ring, far accumulators, counts).

    Made by :meth:`LayerKvCache.o1_snapshot`; :meth:`LayerKvCache.o1_restore` puts it back,
    bit for bit, into the same sealed state."""

    __slots__ = ("_owner", "_arrays", "_counts", "seq_len")

    def __init__(self, owner: O1Sealed, arrays: dict[str, F32], counts: tuple[int, int, int],
                 seq_len: int) -> None:
        self._owner = owner
        self._arrays = arrays
        self._counts = counts
        self.seq_len = seq_len

    def __repr__(self) -> str:
        return f"O1Snapshot(seq_len={self.seq_len}, bytes={sum(a.nbytes for a in self._arrays.values())})"


class O1Sealed:
    """A sealed layer: per-group Nystrom states (group-shared arrays stacked over the G KV
    groups, per-head arrays stacked over the H query heads; head h is in group h // (H // G)).

    Skeleton mode: ``win_k`` (G, w, d) ring, ``sink_k`` (G, sink, d), ``k_tilde`` (G, m_eff, d),
    ``q_tilde`` (H, m_eff, d), ``mu`` (H, m_eff, m_eff), ``t_hat`` (H, m_eff, dv), ``z_hat`` and
    ``m_max`` (H, m_eff), and per-head scratch (H, sink + w + 3 m_eff).
    Exact-only mode (a short seal prompt): every key stays an exact window row (the window
    grows, no landmarks, no sinks): the output is plain causal softmax.
    """

    sealed = True
    # the arrays (set by seal, _empty_parts, _set_exact_window or a stored state)
    win_k: F32
    win_v: F32
    sink_k: F32
    sink_v: F32
    k_tilde: F32
    q_tilde: F32
    mu: F32
    t_hat: F32
    z_hat: F32
    m_max: F32
    scr: F32

    # The kernels' binding of the arrays above, scale and rect (``_bound_state``): assigning
    # any of them, here or from outside (``layer.o1`` is public), drops it; a step's writes
    # into the arrays need no new binding.  ``step`` writes its three counters, which are not
    # bound, straight into ``__dict__``: it runs every token, and this hook is Python.
    _BOUND = frozenset(("sink_k", "sink_v", "win_k", "win_v", "k_tilde", "q_tilde", "mu",
                        "t_hat", "z_hat", "m_max", "scale", "rect"))
    _binding: Optional[tuple[ModuleType, Any]]

    def __setattr__(self, name: str, value: Any) -> None:
        if name in O1Sealed._BOUND:
            object.__setattr__(self, "_binding", None)
        object.__setattr__(self, name, value)

    def __getstate__(self) -> dict[str, Any]:
        """Copies and pickles leave the binding behind (a copy binds its own arrays)."""
        return dict(self.__dict__, _binding=None)

    def __init__(self, *, num_heads: int, num_kv_heads: int, d: int, dv: int, m: int, w: int,
                 sink: int, rect: O1Rect, exact_only: bool, keep: int = 0) -> None:
        self._binding = None
        self.keep = keep        # kept far keys (stored after the sinks, counted in sink)
        self.error: Optional[O1Error] = None      # the seal's estimate (None: not estimated)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.hpk = num_heads // num_kv_heads
        self.d, self.dv = d, dv
        self.m, self.w, self.sink = m, w, sink
        self.rect = rect
        self.exact_only = exact_only
        self.scale = float(o1_scale(d))
        self.m_eff = 0
        self.sink_len = 0
        self.win_len = 0
        self.win_head = 0
        self.far_len = 0

    # ------------------------------------------------------------------ construction
    @classmethod
    def seal(cls, q_trace: F32, keys: F32, values: F32, *, t: int, m: int, w: int, sink: int,
             rect: O1Rect, kernels: ModuleType, n_threads: int, keep: int = 0,
             ridge: float = _RIDGE) -> O1Sealed:
        """Build the state from a prompt of t positions (docs/o1.md).

        q_trace (t, H, d); keys (G, cap, d) and values (G, cap, dv) with the prompt in rows
        [0, t) (the layer's own head-major stores): float32, C-contiguous.  ``keep`` far keys
        per group (:func:`select_kept`) stay exact: they are stored after the sinks and the
        state counts them as sinks (``sink_len = sink + kept``)."""
        nh, d = q_trace.shape[1], q_trace.shape[2]
        nkv, dv = values.shape[0], values.shape[2]
        st = cls(num_heads=nh, num_kv_heads=nkv, d=d, dv=dv, m=m, w=w, sink=sink, rect=rect,
                 exact_only=t <= w + sink + EXACT_SLACK)
        if st.exact_only:
            st._set_exact_window(keys, values, t)
            st._empty_parts()
            log.info("kvcache O(1): seal prompt of %d positions <= w + sink + %d = %d; the layer "
                     "stays exact (window holds every key, cost grows with the context)",
                     t, EXACT_SLACK, w + sink + EXACT_SLACK)
            return st
        m_eff = effective_landmarks(t, m)
        if m_eff < m:
            log.warning("kvcache O(1): landmark budget m=%d clamped to %d by a %d-position seal "
                        "prompt (use a prompt of at least 8*m = %d positions)", m, m_eff, t, 8 * m)
        st.m_eff = m_eff
        n_far = t - sink - w
        kept = select_kept(q_trace, keys, t=t, sink=sink, w=w, keep=keep, scale=st.scale)
        n_kept = kept.shape[1]
        st.keep = n_kept
        st.sink = st.sink_len = sink + n_kept
        gi = np.arange(nkv)[:, None]
        st.sink_k = np.ascontiguousarray(np.concatenate([keys[:, :sink], keys[gi, kept]], axis=1))
        st.sink_v = np.ascontiguousarray(np.concatenate([values[:, :sink], values[gi, kept]],
                                                        axis=1))
        st.k_tilde = seg_means(keys[:, :t], m_eff).astype(_F32)                       # (G, m, d)
        # a view, not a copy: at 32k positions the trace is 512 MiB for Llama-3-8B
        st.q_tilde = seg_means(q_trace.transpose(1, 0, 2), m_eff).astype(_F32)   # (H, m, d)
        s64 = float(st.scale)
        st.mu = np.empty((nh, m_eff, m_eff), dtype=_F32)
        kt64 = st.k_tilde.astype(np.float64)
        for h in range(nh):
            with np.errstate(over="ignore", invalid="ignore"):
                au = np.exp(s64 * (st.q_tilde[h].astype(np.float64) @ kt64[h // st.hpk].T))
            st.mu[h] = ridge_pinv(au, ridge)
        st.t_hat = np.zeros((nh, m_eff, dv), dtype=_F32)
        st.z_hat = np.zeros((nh, m_eff), dtype=_F32)
        st.m_max = np.full((nh, m_eff), -np.inf, dtype=_F32)
        st.scr = np.zeros((nh, st.sink_len + w + 3 * m_eff), dtype=_F32)
        # replay: keys sink .. t-w-1 leave the window in order and enter the far field (the
        # kept ones excepted, they are exact)
        far_k, far_v, row0 = keys, values, sink
        if n_kept:
            rest = np.ones((nkv, n_far), dtype=bool)
            rest[gi, kept - sink] = False
            idx = (sink + np.nonzero(rest)[1]).reshape(nkv, n_far - n_kept)   # row order
            far_k = np.ascontiguousarray(keys[gi, idx])
            far_v = np.ascontiguousarray(values[gi, idx])
            row0 = 0
        n_abs = n_far - n_kept
        # key j >= sink sits in ring slot (j - sink) % w
        st.win_k = np.zeros((nkv, w, d), dtype=_F32)
        st.win_v = np.zeros((nkv, w, dv), dtype=_F32)
        tail = np.arange(t - w, t)
        st.win_k[:, (tail - sink) % w] = keys[:, t - w: t]
        st.win_v[:, (tail - sink) % w] = values[:, t - w: t]
        # n_threads caps the policy's count (kvcache._threads)
        n_threads = min(n_threads, threads_for(nh * n_abs * m_eff * (d + dv), nh))
        kernels.o1_absorb(st._kernel_state(), O1Absorb(
            keys=far_k, values=far_v, row0=row0, n=n_abs, scr=st.scr, n_threads=n_threads))
        st.far_len = n_abs
        st.win_len = w
        st.win_head = (t - sink) % w
        return st

    def set_exact_window(self, keys: npt.NDArray[np.float32], values: npt.NDArray[np.float32],
                         n: int) -> None:
        """Exact-only: the window holds rows [0, n) of keys (G, >= n, d) and values, with
        ``EXACT_EXTRA`` spare rows to grow into (at a seal, and when a stored state is read)."""
        self._set_exact_window(keys, values, n)

    def _set_exact_window(self, keys: F32, values: F32, n: int) -> None:
        """Exact-only: the window holds rows [0, n) of keys (G, >= n, d) and values, with
        spare rows to grow into."""
        self.win_k = np.zeros((self.num_kv_heads, n + _EXACT_EXTRA, self.d), dtype=_F32)
        self.win_v = np.zeros((self.num_kv_heads, n + _EXACT_EXTRA, self.dv), dtype=_F32)
        self.win_k[:, :n] = keys[:, :n]
        self.win_v[:, :n] = values[:, :n]
        self.win_len = n

    def _empty_parts(self) -> None:
        nkv, nh, d, dv = self.num_kv_heads, self.num_heads, self.d, self.dv
        self.sink_k = np.zeros((nkv, 0, d), dtype=_F32)
        self.sink_v = np.zeros((nkv, 0, dv), dtype=_F32)
        self.k_tilde = np.zeros((nkv, 0, d), dtype=_F32)
        self.q_tilde = np.zeros((nh, 0, d), dtype=_F32)
        self.mu = np.zeros((nh, 0, 0), dtype=_F32)
        self.t_hat = np.zeros((nh, 0, dv), dtype=_F32)
        self.z_hat = np.zeros((nh, 0), dtype=_F32)
        self.m_max = np.zeros((nh, 0), dtype=_F32)
        self.scr = np.zeros((nh, 0), dtype=_F32)

    # ------------------------------------------------------------------ decode
    def _kernel_state(self) -> O1State:
        """The state as the O(1) kernels read it (the arrays themselves, no copies)."""
        return O1State(self.sink_k, self.sink_v, self.win_k, self.win_v, self.k_tilde,
                       self.q_tilde, self.mu, self.t_hat, self.z_hat, self.m_max, self.scale,
                       self.rect is O1Rect.FM)

    def _bound_state(self, kernels: ModuleType) -> Any:
        """The state bound by ``kernels.bind_o1``: checked in full once, and bound again only
        after one of its arrays is replaced (a seal, a grown exact window, a stored state read
        back); a step's writes into the arrays need no new binding."""
        b = self._binding
        if b is None or b[0] is not kernels:
            b = self._binding = (kernels, kernels.bind_o1(self._kernel_state()))
        return b[1]

    def step(self, q: F32, k_new: F32, v_new: F32, out: F32, kernels: ModuleType,
             n_threads: int) -> None:
        """One decode step; q (H, d), k_new (G, d), v_new (G, dv) float32; fills out (H, dv)."""
        if self.exact_only:
            if self.win_len == self.win_k.shape[1]:
                self._grow_exact()
            slot, absorb = self.win_len, False
            win_len = self.win_len + 1
            scr = np.empty((self.num_heads, win_len), dtype=_F32)
        elif self.win_len == self.w:
            slot, absorb = self.win_head, True
            win_len = self.w
            scr = self.scr
        else:  # unreachable after a skeleton seal (the ring is full), kept for completeness
            slot, absorb = self.win_len, False
            win_len = self.win_len + 1
            scr = self.scr
        far_len = self.far_len + (1 if absorb else 0)
        nh = self.num_heads
        n_threads = min(n_threads, threads_for(
            nh * (self.sink_len + win_len + self.m_eff) * (self.d + self.dv), nh))
        # positional (the field order of O1Step): keywords would build a dict every step
        kernels.o1_step(self._bound_state(kernels), O1Step(
            q, k_new, v_new, win_len, slot, absorb, far_len > 0, out, scr, n_threads))
        counters = self.__dict__                 # past __setattr__ (see _BOUND)
        counters["win_len"] = win_len
        if absorb:
            counters["win_head"] = (self.win_head + 1) % self.w
        counters["far_len"] = far_len

    def _grow_exact(self) -> None:
        n, cap = self.win_len, self.win_k.shape[1]
        new_cap = max(2 * cap, _EXACT_EXTRA)
        for name in ("win_k", "win_v"):
            old = getattr(self, name)
            grown = np.zeros((old.shape[0], new_cap, old.shape[2]), dtype=_F32)
            grown[:, :n] = old[:, :n]
            setattr(self, name, grown)

    # ------------------------------------------------------------------ accounting, views
    def memory_bytes(self) -> int:
        """Bytes of the state (docs/o1.md, cost): group rings, sinks and key landmarks; per head the
        query landmarks, M, the far accumulators and the step scratch.  An exact-only group
        counts the window rows it holds (it grows with the context)."""
        if self.exact_only:
            return 4 * self.num_kv_heads * self.win_len * (self.d + self.dv)
        arrays = (self.win_k, self.win_v, self.sink_k, self.sink_v, self.k_tilde, self.q_tilde,
                  self.mu, self.t_hat, self.z_hat, self.m_max, self.scr)
        return int(sum(a.nbytes for a in arrays))

    def views(self) -> Optional[list[O1DeviceView]]:
        if self.exact_only:
            return None
        groups = []
        for g in range(self.num_kv_heads):
            heads = tuple(
                O1HeadView(rect_fm=self.rect is O1Rect.FM, t_hat=readonly(self.t_hat[h]),
                           z_hat=readonly(self.z_hat[h]), m_max=readonly(self.m_max[h]),
                           q_tilde=readonly(self.q_tilde[h]), mu=readonly(self.mu[h]))
                for h in range(g * self.hpk, (g + 1) * self.hpk))
            groups.append(O1DeviceView(
                m_eff=self.m_eff, w=self.w, sink_len=self.sink_len, d=self.d, dv=self.dv,
                exact_only=False, scale=self.scale, win_len=self.win_len, win_head=self.win_head,
                far_len=self.far_len, win_k=readonly(self.win_k[g]), win_v=readonly(self.win_v[g]),
                sink_k=readonly(self.sink_k[g]), sink_v=readonly(self.sink_v[g]),
                k_tilde=readonly(self.k_tilde[g]), heads=heads))
        return groups

    # ------------------------------------------------------------------ rollback
    _FAR = ("t_hat", "z_hat", "m_max")        # per-head accumulators a step changes
    _WINDOW = ("win_k", "win_v")              # rows [0, win_len) are live (the whole ring once full)

    def snapshot(self, seq_len: int) -> O1Snapshot:
        arrays = {name: getattr(self, name).copy() for name in self._FAR}
        arrays.update((name, getattr(self, name)[:, : self.win_len].copy()) for name in self._WINDOW)
        counts = (self.win_len, self.win_head, self.far_len)
        return O1Snapshot(self, arrays, counts, seq_len)

    def owns(self, snap: O1Snapshot) -> bool:
        """Whether ``snap`` was taken from this state (only then can it be restored here)."""
        return snap._owner is self

    def restore(self, snap: O1Snapshot) -> None:
        """Copy a snapshot back in place (views handed out stay valid)."""
        for name in self._FAR:
            np.copyto(getattr(self, name), snap._arrays[name])
        n = snap._counts[0]
        for name in self._WINDOW:
            getattr(self, name)[:, :n] = snap._arrays[name]
        self.win_len, self.win_head, self.far_len = snap._counts

    def __repr__(self) -> str:
        mode = "exact-only" if self.exact_only else f"m_eff={self.m_eff}"
        return (f"O1Sealed(groups={self.num_kv_heads}, heads={self.num_heads}, {mode}, "
                f"w={self.w}, sink={self.sink_len} (kept {self.keep}), rect={self.rect.name}, "
                f"far_len={self.far_len})")

    # ------------------------------------------------------------------ error estimate
    def outputs(self, q: npt.ArrayLike) -> F64:
        """The operator's outputs (n, H, dv), float64, for queries ``q`` (n, H, d) read against
        the current state without changing it (no key inserted, nothing absorbed): the near
        set (sinks, the window's ``win_len`` rows) exact, the far field through ``M``, ``T^``
        and ``Z^``, the rectifier applied.  The float64 form of what :meth:`step` reads."""
        qa = np.asarray(q, dtype=np.float64)
        n = qa.shape[0]
        out = np.empty((n, self.num_heads, self.dv))
        s = float(self.scale)
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            for h in range(self.num_heads):
                g = h // self.hpk
                qh = qa[:, h]                                                   # (n, d)
                keys = np.concatenate([self.sink_k[g, : self.sink_len],
                                       self.win_k[g, : self.win_len]]).astype(np.float64)
                vals = np.concatenate([self.sink_v[g, : self.sink_len],
                                       self.win_v[g, : self.win_len]]).astype(np.float64)
                sc = s * (qh @ keys.T)                                          # (n, near)
                c_all = np.max(sc, axis=1, initial=-np.inf)
                num = np.zeros((n, self.dv))
                den = np.zeros(n)
                if self.far_len > 0 and self.m_eff > 0:
                    f_a = s * (qh @ self.k_tilde[g].astype(np.float64).T)       # (n, m)
                    f = f_a.max(axis=1)
                    u = np.exp(f_a - f[:, None]) @ self.mu[h].astype(np.float64)
                    if self.rect is O1Rect.FM:
                        u = np.maximum(u, 0.0)
                    mm = self.m_max[h].astype(np.float64)
                    c_all = np.maximum(c_all, f + np.max(mm))
                    gain = u * np.exp(f[:, None] + mm[None, :] - c_all[:, None])
                    gain = np.where(np.isfinite(gain), gain, 0.0)
                    far_den = gain @ self.z_hat[h].astype(np.float64)
                    keep = far_den >= 0
                    den = np.where(keep, far_den, 0.0)
                    num = np.where(keep[:, None], gain @ self.t_hat[h].astype(np.float64), 0.0)
                p = np.exp(sc - c_all[:, None])
                den = den + p.sum(axis=1)
                num = num + p @ vals
                out[:, h] = num / np.maximum(den, 1e-30)[:, None]
        return out


def estimate_error(state: O1Sealed, q_trace: F32, keys: F32, values: F32, t: int,
                   queries: int = ERROR_QUERIES) -> O1Error:
    """The seal's error estimate (:class:`O1Error`, docs/o1.md): the last ``queries`` prompt
    queries of ``q_trace`` (t, H, d), read as decode queries through ``state``, against exact
    softmax attention over the prompt's ``t`` keys/values (``keys`` (G, >= t, d), the rows the
    seal is about to release).  Cost: ``queries * H * t * (d + dv)`` multiply-adds for the
    exact side, ``queries * H * (sink + w + m_eff) * (d + dv)`` for the operator's side."""
    nh = state.num_heads
    n = min(queries, t)
    if state.exact_only or n == 0:
        return O1Error(per_head=(0.0,) * nh, overall=0.0, queries=n, t=t)
    q = q_trace[t - n: t].astype(np.float64)                                   # (n, H, d)
    approx = state.outputs(q)                                                  # (n, H, dv)
    s = float(state.scale)
    err2 = np.empty(nh)
    ref2 = np.empty(nh)
    for g in range(state.num_kv_heads):
        kg = keys[g, :t].astype(np.float64)
        vg = values[g, :t].astype(np.float64)
        for h in range(g * state.hpk, (g + 1) * state.hpk):
            sc = s * (q[:, h] @ kg.T)                                          # (n, t)
            p = np.exp(sc - sc.max(axis=1, keepdims=True))
            exact = (p @ vg) / p.sum(axis=1, keepdims=True)                    # (n, dv)
            err2[h] = float(np.sum((approx[:, h] - exact) ** 2))
            ref2[h] = float(np.sum(exact ** 2))
    tiny = 1e-300
    per_head = tuple(float(np.sqrt(e / max(r, tiny))) for e, r in zip(err2, ref2))
    overall = float(np.sqrt(err2.sum() / max(ref2.sum(), tiny)))
    return O1Error(per_head=per_head, overall=overall, queries=n, t=t)


def check_seal(layer: LayerKvCache, coll: O1Collecting, num_heads: int) -> Optional[str]:
    """The reason a seal is refused (preconditions: docs/o1.md), or None when it may proceed."""
    t = layer.seq_len
    nkv = layer.num_kv_heads
    hd = layer.head_dim
    if t <= 0:
        return "nothing to seal (seq_len == 0)"
    if not layer.mode.is_f32:
        return (f"the layer stores quantised rows ({layer.mode.name}); the O(1) seal needs F32 "
                f"KV rows")
    if coll._len != t * num_heads * hd:
        return (f"the query trace holds {coll._len} floats, expected seq_len * num_heads * "
                f"head_dim = {t} * {num_heads} * {hd} = {t * num_heads * hd} (a full trace)")
    if num_heads % nkv:
        return f"num_heads={num_heads} is not a multiple of num_kv_heads={nkv}"
    lens = [layer.head_len(h) for h in range(nkv)]
    if any(n != t for n in lens):
        return (f"every KV head must hold all {t} positions (no dead heads, no eviction); "
                f"head lengths are {lens}")
    return None

