"""The grouped-query attention driver shared by every cache that stores head-major rows.

``LayerKvCache`` (float32, int8 or 4-bit rows) and ``StaticKvCache`` (float32 rows in preallocated
storage) both hand their rows to one compiled kernel, ``attend_rows``.  What lies between a
public ``attend`` call and that kernel is the same for both and lives here once:

- :func:`grouped_queries` checks ``q`` and turns it into ``(n, num_heads, head_dim)``;
- :func:`attend_blocks` cuts ``n`` query positions into blocks whose probability scratch fits
  :data:`PROBS_BUDGET` bytes, gathers each block's queries KV group by KV group (the layout the
  kernel reads: for group ``g``, positions in order, then the group's query heads), runs the
  kernel and scatters the result back to ``(n, num_heads, head_dim)``;
- :func:`attend_rows` runs the kernel on one set of gathered queries, with a per-thread
  probability scratch that is kept for the next call;
- :func:`attend_prefill` is the prompt path: the blocked kernel ``attend_blocked`` (tiles of
  queries x rows, online softmax, no probability matrix) over all ``n`` positions in one call.

Both kernels take the layer's storage descriptor (:class:`kvcache._entry.Rows`, or the binding
of it that the layer keeps: ``kernels.bind_rows`` checks a storage once, and each call is then
checked against the binding alone) and one call descriptor
(:class:`kvcache._entry.AttendCall`).  The kernel module is a parameter: the
compiled ``kvcache._core`` in normal use, the NumPy twin ``kvcache.reference`` when the
reference runs a cache's own driver (the twins have the same names and take the same
descriptors).  The summation orders are those of the kernel (``docs/numerics.md``).
"""

from __future__ import annotations

import math
import threading
from types import ModuleType
from typing import Callable, Optional

import numpy as np
import numpy.typing as npt

from ._entry import AttendCall, Rows, RowsBinding
from ._threads import threads_for
from ._validate import FloatArrayLike, as_f32
from .quant import CHUNK_ROWS

__all__ = ["PROBS_BUDGET", "AttendCall", "Rows", "RowsBinding", "attend_blocks", "attend_prefill",
           "attend_rows", "default_scale", "grouped_queries", "prefill_work", "scratch"]

F32 = npt.NDArray[np.float32]
IP = npt.NDArray[np.intp]

PROBS_BUDGET = 64 << 20
"""Bytes of probability scratch per block of query positions (per calling thread)."""

_tls = threading.local()


def scratch(name: str, n: int) -> F32:
    """A per-thread float32 scratch buffer of at least ``n`` elements (reused across calls)."""
    buf: Optional[F32] = getattr(_tls, name, None)
    if buf is None or buf.size < n:
        size = max(n, 1 if buf is None else 2 * buf.size)
        buf = np.empty(size, dtype=np.float32)
        setattr(_tls, name, buf)
    return buf[:n]


def grouped_queries(q: FloatArrayLike, nkv: int, hd: int) -> tuple[F32, bool]:
    """``q`` of shape (num_heads, hd) or (n, num_heads, hd) as float32 (n, num_heads, hd) and
    whether it was one position; num_heads must be a positive multiple of ``nkv``."""
    qa = as_f32("q", q, shapes=[(None, hd), (None, None, hd)])
    single = qa.ndim == 2
    q3 = qa.reshape((1,) + qa.shape) if single else qa
    nh = q3.shape[1]
    if nh == 0 or nh % nkv:
        raise ValueError(f"q: expected num_heads a positive multiple of num_kv_heads={nkv}, "
                         f"got {nh}")
    return q3, single


def default_scale(head_dim: int) -> float:
    """1/sqrt(head_dim) as float32 (computed in double, rounded once)."""
    return float(np.float32(1.0 / math.sqrt(head_dim)))


def attend_rows(kernels: ModuleType, rows: RowsBinding, q2: F32, group_q0: IP, *, n_pos: int,
                n_back: int, window: int, first: int, scale: float, softcap: float, out2: F32,
                width: int, imp: F32, imp_mode: int, n_threads: int) -> F32:
    """Run ``kernels.attend_rows`` on queries ``q2`` (gathered per KV group, ``group_q0``
    giving each group's first row) over at most ``width`` stored rows; returns the
    probabilities (a view of the per-thread scratch, valid until the next call).
    ``n_threads`` caps the count the thread policy picks (kvcache._threads)."""
    w = max(width, 1)
    nq, hd = q2.shape
    n_threads = min(n_threads, threads_for(2 * nq * w * hd,
                                           min(nq, len(group_q0) - 1) * -(-w // CHUNK_ROWS)))
    probs = scratch("probs", q2.shape[0] * w).reshape(q2.shape[0], w)
    # positional (the field order of AttendCall): keywords would build a dict every call
    kernels.attend_rows(rows, AttendCall(q2, group_q0, n_pos, n_back, window, first, scale,
                                         softcap, out2, imp, imp_mode, n_threads, probs))
    return probs


def attend_blocks(kernels: ModuleType, rows: RowsBinding, q3: F32, out3: F32, *, maxlen: int,
                  window: int, scale: float, softcap: float, imp: F32, imp_mode: int,
                  n_threads: int, fold: Optional[Callable[[F32], F32]] = None) -> None:
    """Causal GQA attention of the newest ``n`` positions ``q3`` (n, num_heads, hd) into
    ``out3`` (n, num_heads, hd): query ``i`` sees stored rows up to ``maxlen - n + i``.

    ``fold`` maps a block's grouped queries ``(nkv, positions*heads_per_group, hd)`` to the
    queries the kernel scores with (the int8 K path folds its frozen column in); the default
    only makes them contiguous.  ``imp_mode`` 2 adds each block's mass into ``imp``.
    """
    n, nh, hd = q3.shape
    nkv = rows.head_len.shape[0]
    hpk = nh // nkv
    per_pos = nh * max(maxlen, 1) * 4
    block = max(1, min(n, PROBS_BUDGET // per_pos))
    for i0 in range(0, n, block):
        i1 = min(n, i0 + block)
        nb = i1 - i0
        qk = q3[i0:i1].reshape(nb, nkv, hpk, hd).transpose(1, 0, 2, 3).reshape(nkv, nb * hpk, hd)
        q2 = (np.ascontiguousarray(qk) if fold is None else fold(qk)).reshape(nkv * nb * hpk, hd)
        group_q0 = np.arange(nkv + 1, dtype=np.intp) * (nb * hpk)
        # one position: its (nkv, hpk) query order is already out's (num_heads) order
        o2 = out3[i0].reshape(nh, hd) if nb == 1 else np.empty((nkv * nb * hpk, hd), np.float32)
        attend_rows(kernels, rows, q2, group_q0, n_pos=nb, n_back=n - i0, window=window,
                    first=0, scale=scale, softcap=softcap, out2=o2,
                    width=max(0, maxlen - n + i1), imp=imp, imp_mode=imp_mode,
                    n_threads=n_threads)
        if nb > 1:
            out3[i0:i1] = o2.reshape(nkv, nb, hpk, hd).transpose(1, 0, 2, 3).reshape(nb, nh, hd)


def prefill_work(n: int, maxlen: int, window: int, num_heads: int, num_kv_heads: int,
                 head_dim: int) -> tuple[int, int]:
    """Multiply-adds and tasks of one ``attend_blocked`` call over ``n`` positions: scores and
    values of every visible row (2 x head_dim each per query head), and one task per KV group
    and block of ``ceil(PREFILL_TASK_QUERIES / heads_per_group)`` positions (the kernel's
    split before it cuts blocks over importance's buffer budget in pieces, which only long
    prompts have)."""
    from . import _core   # here: importing kvcache.layer first explains a missing extension

    ends = np.arange(maxlen - n + 1, maxlen + 1, dtype=np.int64).clip(0, None)   # (n,)
    seen = np.minimum(ends, window) if window > 0 else ends
    hpk = num_heads // num_kv_heads
    per_task = -(-_core.PREFILL_TASK_QUERIES // hpk)
    return (int(seen.sum()) * 2 * head_dim * num_heads,
            num_kv_heads * -(-n // per_task))


def attend_prefill(kernels: ModuleType, rows: RowsBinding, q3: F32, out3: F32, *, maxlen: int,
                   window: int, scale: float, softcap: float, imp: F32, imp_mode: int,
                   n_threads: int, fold: Optional[Callable[[F32], F32]] = None) -> None:
    """:func:`attend_blocks`' contract on the blocked kernel: causal GQA attention of the
    newest ``n`` positions ``q3`` (n, num_heads, hd) into ``out3``, query ``i`` seeing stored
    rows up to ``maxlen - n + i``, all positions in one call (the kernel's scratch is a few
    tiles per thread, whatever ``n``).  ``imp_mode`` 2 adds the call's mass into ``imp``
    once.  A query's bits depend only on its own visible rows (docs/numerics.md)."""
    n, nh, hd = q3.shape
    nkv = rows.head_len.shape[0]
    hpk = nh // nkv
    qk = q3.reshape(n, nkv, hpk, hd).transpose(1, 0, 2, 3).reshape(nkv, n * hpk, hd)
    q2 = (np.ascontiguousarray(qk) if fold is None else fold(qk)).reshape(nkv * n * hpk, hd)
    group_q0 = np.arange(nkv + 1, dtype=np.intp) * (n * hpk)
    o2 = np.empty((nkv * n * hpk, hd), np.float32)
    work, tasks = prefill_work(n, maxlen, window, nh, nkv, hd)
    kernels.attend_blocked(rows, AttendCall(
        q=q2, group_q0=group_q0, n_pos=n, n_back=n, window=window, first=0, scale=scale,
        softcap=softcap, out=o2, imp=imp, imp_mode=imp_mode,
        n_threads=min(n_threads, threads_for(work, tasks))))
    out3[...] = o2.reshape(nkv, n, hpk, hd).transpose(1, 0, 2, 3).reshape(n, nh, hd)
