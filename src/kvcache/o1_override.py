"""The O(1) override a :class:`kvcache.LayerKvCache` holds: its state machine (docs/o1.md).

A layer's override is idle (no state), collecting (an :class:`~kvcache.o1.O1Collecting` query
trace of the prompt) or sealed (an :class:`~kvcache.o1.O1Sealed` Nystrom state that replaces the
layer's rows).  :class:`O1Override` holds that state and the error estimate of a refused seal,
and runs the transitions: ``begin`` (idle or collecting -> collecting), ``push_q``, ``seal``
(collecting -> sealed, or back to idle when the seal is refused), ``step``, ``snapshot`` /
``restore`` (sealed), ``clear``.  The layer keeps its rows, attention and eviction; it calls
the override from its ``o1_*`` methods and applies what a seal means for its storage (the
rows are released, :meth:`O1Override.seal` says when).

The override reads the layer only through its public accessors (``seq_len``, ``mode``,
``head_len``, ...) and the float32 rows the layer hands it; the kernel module arrives with each
call that runs one (the layer's ``kernels``).
"""

from __future__ import annotations

import copy
import logging
from types import ModuleType
from typing import TYPE_CHECKING, Optional, Union

import numpy as np
import numpy.typing as npt

from ._threads import BlasGovernor
from ._validate import FloatArrayLike, as_f32, as_int
from .o1 import (O1Collecting, O1DeviceView, O1Error, O1Rect, O1Sealed, O1Snapshot,
                 check_max_error, check_ridge, check_seal, estimate_error)

if TYPE_CHECKING:
    from .layer import LayerKvCache

__all__ = ["O1_MAX", "O1Override", "O1State"]

F32 = npt.NDArray[np.float32]
#: What an override holds when it is not idle.
O1State = Union[O1Collecting, O1Sealed]
#: Bound of the O(1) parameters m, w, sink and sink + keep (they travel as u32).
O1_MAX = (1 << 31) - 1

_log = logging.getLogger("kvcache")


class O1Override:
    """The O(1) state of one layer and its transitions (module docstring).

    Attributes
    ----------
    state : O1Collecting, O1Sealed or None
        What the layer's ``o1`` property shows.
    refused : O1Error or None
        The estimate of the last seal refused by its error bound (until the next begin, seal
        or clear).
    """

    __slots__ = ("state", "refused")

    def __init__(self, state: Optional[O1State] = None,
                 refused: Optional[O1Error] = None) -> None:
        self.state: Optional[O1State] = state
        self.refused: Optional[O1Error] = refused

    def copy(self) -> O1Override:
        """Another override with a copy of the state (what a shallow copy of the layer holds:
        a step, a restore or a pushed query of one does not change the other)."""
        return O1Override(copy.deepcopy(self.state), self.refused)

    def __repr__(self) -> str:
        what = ("idle" if self.state is None else "sealed" if self.sealed else "collecting")
        return f"O1Override({what})"

    @property
    def sealed(self) -> bool:
        """True when a sealed state replaces the layer's rows."""
        return isinstance(self.state, O1Sealed)

    def clear(self) -> None:
        """Back to idle, forgetting a refused seal's estimate."""
        self.state = None
        self.refused = None

    def install(self, state: Optional[O1State]) -> None:
        """Take ``state`` (from a layer state read from bytes or installed whole)."""
        self.state = state
        self.refused = None

    # ------------------------------------------------------------------ collecting
    def begin(self, head_dim: int, m: int, w: int, sink: int,
              rect: Union[O1Rect, str] = O1Rect.AGGREGATE, keep: int = 0,
              ridge: float = 1e-6) -> None:
        """Start collecting a prompt's query trace (``LayerKvCache.o1_begin``).

        Parameters
        ----------
        head_dim : int
            The layer's head size.
        m : int
            Landmark budget (>= 4; a seal prompt shorter than 8*m uses t // 8, at least 4).
        w : int
            Exact window rows (>= 1).
        sink : int
            Sink rows kept exact for ever (>= 0).
        rect : O1Rect or {"agg", "aggregate", "fm"}
            Far-field rectifier.
        keep : int
            Far keys per KV group the seal keeps exact beside the sinks (>= 0, default 0: the
            specified operator): the ones the last prompt queries attend most (docs/o1.md,
            kept keys).  They cost ``keep * 2 * head_dim`` floats per group.
        ridge : float
            Ridge of the pseudo-inverse ``M``, relative to ``mean(diag(Au^T Au))``, in (0, 1]
            (default 1e-6, the specified operator; larger is better conditioned, docs/o1.md).

        Replaces any collecting trace.  Checks every parameter before anything changes
        (ValueError, TypeError); RuntimeError when sealed (the layer's rows were released:
        clear first)."""
        m = as_int("m", m, minimum=4)
        w = as_int("w", w, minimum=1)
        sink = as_int("sink", sink, minimum=0)
        keep = as_int("keep", keep, minimum=0)
        ridge = check_ridge(ridge)
        for name, value in (("m", m), ("w", w), ("sink", sink), ("sink + keep", sink + keep)):
            if value > O1_MAX:
                raise ValueError(f"{name}: expected an integer <= {O1_MAX}, got {value}")
        rect = O1Rect.parse(rect)
        if self.sealed:
            raise RuntimeError("o1_begin: this layer is sealed and its KV was released; "
                               "call clear() before beginning a new O(1) prompt")
        self.state = O1Collecting(m, w, sink, rect, head_dim, keep=keep, ridge=ridge)
        self.refused = None

    def push_q(self, head_dim: int, q_all: FloatArrayLike) -> None:
        """Append one or more positions' queries to the trace (a no-op unless collecting);
        ValueError for a shape that is not (num_heads, head_dim), (n, num_heads, head_dim) or
        a flat multiple of head_dim."""
        hd = head_dim
        qa = as_f32("q_all", q_all)
        if qa.ndim not in (1, 2, 3) or qa.size == 0 or qa.size % hd or \
                (qa.ndim > 1 and qa.shape[-1] != hd):
            raise ValueError(f"q_all: expected shape (num_heads, {hd}), (n, num_heads, {hd}) or a "
                             f"flat vector of a positive multiple of {hd} floats, got {qa.shape}")
        if isinstance(self.state, O1Collecting):
            self.state.push(qa)

    # ------------------------------------------------------------------ the seal
    def seal(self, layer: LayerKvCache, num_heads: int, max_error: Optional[float],
             rows: tuple[Optional[F32], Optional[F32]], kernels: ModuleType,
             n_threads: int) -> Optional[O1Sealed]:
        """Seal the collected prompt of ``layer`` (its float32 ``rows``: keys, values) into
        per-group Nystrom states (``LayerKvCache.o1_seal``).

        The seal needs, with ``t = layer.seq_len``: t > 0, float32 rows, a trace of exactly
        ``t * num_heads * head_dim`` floats, ``num_heads`` a multiple of ``num_kv_heads``, and
        every KV head holding all t rows.  Every seal that builds a state also estimates its
        error (docs/o1.md: the last prompt queries read as decode queries, against exact
        attention over the rows about to be released); with ``max_error`` (a relative error
        bound > 0) a state whose estimate is above it is dropped, and :meth:`error` still
        reports the estimate.  A short prompt seals in exact-only mode (:class:`O1Sealed`).

        Returns the new sealed state when the layer must now release its rows; None when
        nothing was sealed: not collecting (the layer reports :attr:`sealed`), or the seal was
        refused (a precondition failed, or the estimate is above ``max_error``: logged as a
        warning, the override is idle again and the layer stays exact).  ValueError /
        TypeError for a bad ``num_heads`` or ``max_error``, before anything changes; an
        exception while building the state (MemoryError) leaves the override collecting."""
        nh = as_int("num_heads", num_heads, minimum=1)
        bound = check_max_error(max_error)
        coll = self.state
        if not isinstance(coll, O1Collecting):
            return None
        reason = check_seal(layer, coll, nh)
        if reason is not None:
            self.state = None
            _log.warning("kvcache O(1): seal refused, the layer stays exact: %s", reason)
            return None
        t, hd = layer.seq_len, layer.head_dim
        keys, values = rows
        assert keys is not None and values is not None     # check_seal: float32 rows
        trace = coll.trace.reshape(t, nh, hd)
        # the seal's float64 products and solves on one BLAS thread: their bits would depend
        # on BLAS's count (docs/threads.md, "BLAS"), so the state does not depend on the
        # machine's cores or load
        with BlasGovernor(1) as blas, blas.pinned():
            state = O1Sealed.seal(trace, keys, values, t=t, m=coll.m, w=coll.w, sink=coll.sink,
                                  rect=coll.rect, kernels=kernels, n_threads=n_threads,
                                  keep=coll.keep, ridge=coll.ridge)
            state.error = estimate_error(state, trace, keys, values, t)
        if bound is not None and not state.error.overall <= bound:
            self.state = None
            self.refused = state.error
            _log.warning("kvcache O(1): seal refused, the layer stays exact: %s is above "
                         "max_error=%g", state.error, bound)
            return None
        self.state = state
        return state

    def error(self) -> Optional[O1Error]:
        """The estimate of the last seal that built a state (:class:`kvcache.o1.O1Error`:
        ``per_head``, ``overall``), kept or refused by ``max_error``; None before any, while
        collecting, after a clear, or for a state read from bytes."""
        if isinstance(self.state, O1Sealed):
            return self.state.error
        return self.refused if self.state is None else None

    # ------------------------------------------------------------------ sealed
    def sealed_state(self, what: str) -> O1Sealed:
        """The sealed state; RuntimeError naming ``what`` when not sealed."""
        state = self.state
        if not isinstance(state, O1Sealed):
            raise RuntimeError(f"{what}: the layer is not sealed (call o1_begin, push every "
                               f"prompt position's queries with o1_push_q, then o1_seal)")
        return state

    def step(self, num_kv_heads: int, head_dim: int, q_all: FloatArrayLike,
             k_new: FloatArrayLike, v_new: FloatArrayLike, num_heads: int,
             kernels: ModuleType, n_threads: int) -> F32:
        """One decode step on the sealed state: (num_heads, head_dim) outputs.  Checks every
        argument before the state changes."""
        nh = as_int("num_heads", num_heads, minimum=1)
        state = self.sealed_state("o1_step")
        if nh != state.num_heads:
            raise ValueError(f"num_heads: expected {state.num_heads} (the value the layer was "
                             f"sealed with), got {nh}")
        nkv, hd = num_kv_heads, head_dim
        q = as_f32("q_all", q_all, shapes=[(nh, hd), (nh * hd,)]).reshape(nh, hd)
        k = as_f32("k_new", k_new, shapes=[(nkv, hd), (nkv * hd,)]).reshape(nkv, hd)
        v = as_f32("v_new", v_new, shapes=[(nkv, hd), (nkv * hd,)]).reshape(nkv, hd)
        if np.may_share_memory(k, state.win_k) or np.may_share_memory(v, state.win_v):
            k, v = k.copy(), v.copy()
        out = np.empty((nh, hd), dtype=np.float32)
        state.step(q, k, v, out, kernels, n_threads)
        return out

    def views(self) -> Optional[list[O1DeviceView]]:
        """One device view per KV group when sealed with a state (None otherwise)."""
        state = self.state
        return state.views() if isinstance(state, O1Sealed) else None

    def memory_bytes(self) -> int:
        """Bytes of the trace while collecting, of the sealed state's arrays once sealed."""
        return 0 if self.state is None else self.state.memory_bytes()

    def snapshot(self, seq_len: int) -> O1Snapshot:
        """A copy of the sealed state's ring and far accumulators with ``seq_len``."""
        return self.sealed_state("o1_snapshot").snapshot(seq_len)

    def restore(self, snapshot: O1Snapshot) -> int:
        """Put back a snapshot of this sealed state; returns its ``seq_len``.  TypeError /
        ValueError (another object, another state's snapshot) before anything changes."""
        if not isinstance(snapshot, O1Snapshot):
            raise TypeError(f"snapshot: expected an O1Snapshot from o1_snapshot(), got "
                            f"{type(snapshot).__name__}")
        state = self.sealed_state("o1_restore")
        if not state.owns(snapshot):
            raise ValueError("snapshot: it was taken from another O(1) state (another layer, or "
                             "before a clear/re-seal); it cannot be restored here")
        state.restore(snapshot)
        return snapshot.seq_len
