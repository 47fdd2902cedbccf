"""The NumPy twins of the O(1) kernels and the operator's float64 forms, part of
:mod:`kvcache.reference` (which re-exports every public name here: ``kvcache.reference`` is
where the twins are found).

o1_absorb / o1_step are the twins of the compiled kernels (the same O1State and O1Absorb /
O1Step descriptors; they compute in the dtype of the state arrays, so the same code is the
float32 twin and, fed float64 arrays, the float64 streaming reference).  nystrom_stream and
nystrom_matrix are the operator's two float64 forms, written from the definitions and
independent of kvcache.o1's seal code (docs/o1.md: the near and far sets, landmarks, the
operator).
"""

from __future__ import annotations

from typing import Any, Literal, overload

import numpy as np
import numpy.typing as npt

from ._entry import O1Absorb, O1State, O1Step
from ._validate import FloatArrayLike

__all__ = ["bind_o1", "kept_keys", "nystrom_matrix", "nystrom_stream", "o1_absorb",
           "o1_error_estimate", "o1_step"]

_F32 = np.float32
F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]
# The O(1) twins compute in the dtype of their state arrays: float32 (the kernel's twin) or
# float64 (the streaming reference).
FA = npt.NDArray[np.floating[Any]]


def o1_absorb(state: O1State, rows: O1Absorb) -> None:
    """Twin of ``_core.o1_absorb``: rows [row0, row0+n) of every group enter the far field of
    each of the group's heads, in row order, with the per-landmark running max."""
    q_tilde__hmd, t_hat__hme, z_hat__hm, m_max__hm = (state.q_tilde, state.t_hat, state.z_hat,
                                                      state.m_max)
    keys__gnd, values__gne, row0, n, scale = rows.keys, rows.values, rows.row0, rows.n, state.scale
    H, m = q_tilde__hmd.shape[:2]
    if H == 0 or m == 0 or n <= 0:
        return
    dt = t_hat__hme.dtype.type
    hpk = H // keys__gnd.shape[0]
    s = dt(scale)
    for h in range(H):
        g = h // hpk
        qt, T, Z, M = q_tilde__hmd[h], t_hat__hme[h], z_hat__hm[h], m_max__hm[h]
        for i in range(row0, row0 + n):
            k, v = keys__gnd[g, i], values__gne[g, i]                    # (d,), (dv,)
            with np.errstate(invalid="ignore", over="ignore"):
                l = (qt @ k).astype(dt) * s                              # (m,)
                up = l > M                                               # landmarks whose max moves
                r = np.exp(M[up] - l[up]).astype(dt)                     # exp(-inf) = 0 at first
                Z[up] *= r
                T[up] *= r[:, None]
                M[up] = l[up]
                e = np.exp(l - M).astype(dt)                             # (m,)
                Z += e
                T += e[:, None] * v[None, :]


def bind_o1(state: O1State) -> O1State:
    """Twin of ``_core.bind_o1``: the state itself (the twins trust their descriptors)."""
    return state


def o1_step(state: O1State, step: O1Step) -> int:
    """Twin of ``_core.o1_step`` (one decode step of every head; see its docstring).

    Returns the number of heads whose far field was dropped by the aggregate guard
    (far denominator < 0); the compiled kernel returns None."""
    (sink_k__gsd, sink_v__gse, win_k__gcd, win_v__gce, k_tilde__gmd, q_tilde__hmd, mu__hmm,
     t_hat__hme, z_hat__hm, m_max__hm) = state[:10]
    q__hd, k_new__gd, v_new__ge, out__he = step.q, step.k_new, step.v_new, step.out
    win_len, slot, absorb, use_far = step.win_len, step.slot, step.absorb, step.use_far
    scale, fm = state.scale, state.fm
    H = q__hd.shape[0]
    G = k_new__gd.shape[0]
    hpk = H // G
    m = q_tilde__hmd.shape[1]
    dt = out__he.dtype.type
    s = dt(scale)
    if absorb and m > 0:
        o1_absorb(state, O1Absorb(win_k__gcd, win_v__gce, slot, 1, None, 1))
    dropped = 0
    for h in range(H):
        g = h // hpk
        wk = win_k__gcd[g, :win_len].copy()                              # (nw, d) slot order
        wv = win_v__gce[g, :win_len].copy()
        wk[slot], wv[slot] = k_new__gd[g], v_new__ge[g]
        keys = np.concatenate([sink_k__gsd[g], wk])                      # (ns+nw, d) sinks first
        vals = np.concatenate([sink_v__gse[g], wv])
        with np.errstate(invalid="ignore", over="ignore"):
            sc = (keys @ q__hd[h]).astype(dt) * s                        # (n,)
            c_all = np.fmax.reduce(sc, initial=-np.inf)
            num = np.zeros(out__he.shape[1], dtype=dt)
            den = dt(0)
            if use_far and m > 0:
                f_a = (k_tilde__gmd[g] @ q__hd[h]).astype(dt) * s        # (m,)
                f = np.fmax.reduce(f_a, initial=-np.inf)
                u = (np.exp(f_a - f).astype(dt) @ mu__hmm[h]).astype(dt)  # (m,)
                if fm:
                    u = np.where(u > 0, u, dt(0))
                c_all = max(c_all, np.fmax.reduce(f + m_max__hm[h], initial=-np.inf))
                gain = u * np.exp(f + m_max__hm[h] - c_all).astype(dt)   # (m,)
                far_den = dt(gain @ z_hat__hm[h])
                if far_den >= 0:
                    den = far_den
                    num = (gain @ t_hat__hme[h]).astype(dt)              # (dv,)
                else:
                    dropped += 1
            p = np.exp(sc - c_all).astype(dt)                            # (n,)
            den = dt(den + p.sum(dtype=dt))
            num = num + (p @ vals).astype(dt)
            out__he[h] = num / max(den, dt(1e-30))
    win_k__gcd[:, slot] = k_new__gd
    win_v__gce[:, slot] = v_new__ge
    return dropped


def _o1_inputs(q: FloatArrayLike, k: FloatArrayLike,
               v: FloatArrayLike) -> tuple[F64, F64, F64]:
    """(t, H, d), (t, G, d), (t, G, dv) float64 views of the operator's inputs (2-D: H = G = 1)."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    if q.ndim == 2:
        q, k, v = q[:, None], k[:, None], v[:, None]
    return q, k, v


def _softmax_rows(q: F64, k: F64, v: F64, s: float, p: int, H: int, G: int) -> F64:
    """Exact causal softmax attention of positions p..t-1: (t-p, H, dv)."""
    t = q.shape[0]
    hpk = H // G
    out = np.empty((t - p, H, v.shape[2]))
    for i in range(p, t):
        for h in range(H):
            sc = s * (k[: i + 1, h // hpk] @ q[i, h])                    # (i+1,)
            e = np.exp(sc - sc.max())
            out[i - p, h] = e @ v[: i + 1, h // hpk] / e.sum()
    return out


@overload
def nystrom_stream(q: FloatArrayLike, k: FloatArrayLike, v: FloatArrayLike, p: int, m: int, w: int,
                   sink: int, rect: str = ..., *, return_dropped: Literal[False] = ...,
                   keep: int = ..., ridge: float = ...) -> F64: ...
@overload
def nystrom_stream(q: FloatArrayLike, k: FloatArrayLike, v: FloatArrayLike, p: int, m: int, w: int,
                   sink: int, rect: str = ..., *,
                   return_dropped: Literal[True], keep: int = ...,
                   ridge: float = ...) -> tuple[F64, int]: ...
@overload
def nystrom_stream(q: FloatArrayLike, k: FloatArrayLike, v: FloatArrayLike, p: int, m: int, w: int,
                   sink: int, rect: str = ..., *,
                   return_dropped: bool, keep: int = ...,
                   ridge: float = ...) -> F64 | tuple[F64, int]: ...


def nystrom_stream(q: FloatArrayLike, k: FloatArrayLike, v: FloatArrayLike, p: int, m: int, w: int,
                   sink: int, rect: str = "aggregate", *,
                   return_dropped: bool = False, keep: int = 0,
                   ridge: float = 1e-6) -> F64 | tuple[F64, int]:
    """The O(1) operator in streaming form, float64 (docs/o1.md, "The operator").

    Seal on positions [0, p) -- segment-mean landmarks, ``M = (Au^T Au + lam I)^-1 Au^T`` with
    ``lam = 1e-6 mean(diag(Au^T Au))`` -- replay the prompt through the window (a key enters the
    far field exactly when it leaves the window), then one decode step per position i in
    [p, t), the new key inserted before the output is read.

    Parameters
    ----------
    q : array_like (t, H, d);  k : (t, G, d);  v : (t, G, dv)   (2-D arrays: H = G = 1)
    p, m, w, sink : int
    rect : "aggregate" or "fm"
    return_dropped : bool
        Also return how many (step, head) outputs had their far field dropped by the
        aggregate guard.
    keep : int
        Far keys per group kept exact (:func:`kept_keys`): they join the sinks, the replay
        skips them.
    ridge : float
        ``lam = ridge * mean(diag(Au^T Au))`` (default 1e-6, the specified operator).

    Returns
    -------
    ndarray of shape (t - p, H, dv), float64  (and the dropped count when asked)
    """
    q, k, v = _o1_inputs(q, k, v)
    t, H, d = q.shape
    G, dv = k.shape[1], v.shape[2]
    s = float(_F32(1.0) / np.sqrt(_F32(d)))
    if p <= w + sink + 8:                                   # exact-only: plain softmax
        out = _softmax_rows(q, k, v, s, p, H, G)
        return (out, 0) if return_dropped else out
    hpk = H // G
    me = min(max(p // 8, 4), m)
    bounds = (np.arange(me + 1) * p) // me

    def seg(x: F64) -> F64:
        return np.stack([x[a:b].mean(axis=0) for a, b in zip(bounds[:-1], bounds[1:])])

    kt = np.stack([seg(k[:p, g]) for g in range(G)])                    # (G, me, d)
    qt = np.stack([seg(q[:p, h]) for h in range(H)])                    # (H, me, d)
    mu = np.empty((H, me, me))
    for h in range(H):
        au = np.exp(s * qt[h] @ kt[h // hpk].T)                         # (me, me)
        ata = au.T @ au
        lam = ridge * np.mean(np.diag(ata))
        mu[h] = np.linalg.solve(ata + lam * np.eye(me), au.T)
    kg = np.ascontiguousarray(k.transpose(1, 0, 2))                     # (G, t, d)
    vg = np.ascontiguousarray(v.transpose(1, 0, 2))                     # (G, t, dv)
    t_hat = np.zeros((H, me, dv))
    z_hat = np.zeros((H, me))
    m_max = np.full((H, me), -np.inf)
    kept = kept_keys(q, k, p, w, sink, keep)                            # (G, n)
    far = [[j for j in range(sink, p - w) if j not in set(kept[g])] for g in range(G)]
    far_k = np.stack([kg[g, far[g]] for g in range(G)])                 # (G, nfar, d)
    far_v = np.stack([vg[g, far[g]] for g in range(G)])
    sk = np.stack([np.concatenate([kg[g, :sink], kg[g, kept[g]]]) for g in range(G)])
    sv = np.stack([np.concatenate([vg[g, :sink], vg[g, kept[g]]]) for g in range(G)])
    win_k = np.zeros((G, w, d))
    win_v = np.zeros((G, w, dv))
    tail = np.arange(p - w, p)
    win_k[:, (tail - sink) % w] = kg[:, p - w:p]
    win_v[:, (tail - sink) % w] = vg[:, p - w:p]
    state = O1State(sk, sv, win_k, win_v, kt, qt, mu, t_hat, z_hat, m_max, s,
                    str(rect).lower().endswith("fm"))
    o1_absorb(state, O1Absorb(far_k, far_v, 0, far_k.shape[1], None, 1))
    head = (p - sink) % w
    out = np.empty((t - p, H, dv))
    dropped = 0
    for i in range(p, t):
        dropped += o1_step(state, O1Step(q[i], k[i], v[i], w, head, True, True, out[i - p],
                                         None, 1))
        head = (head + 1) % w
    return (out, dropped) if return_dropped else out


def kept_keys(q: FloatArrayLike, k: FloatArrayLike, p: int, w: int, sink: int,
              keep: int) -> npt.NDArray[np.intp]:
    """The far keys a seal on positions [0, p) keeps exact (docs/o1.md, kept keys), (G, n).

    Per group: every key ``sink <= j < p - w`` scored by the attention mass it gets from the
    group's heads at the 256 queries before the last 16 of the prompt (each query's softmax over
    all p keys); the ``min(keep, p - sink - w)`` highest, the earlier key on a tie, ascending."""
    q, k, _ = _o1_inputs(q, k, k)
    H, d, G = q.shape[1], q.shape[2], k.shape[1]
    s = float(_F32(1.0) / np.sqrt(_F32(d)))
    n = max(min(keep, p - sink - w), 0)
    hi = max(p - 16, 1)
    queries = range(max(hi - 256, 0), hi)
    out = np.empty((G, n), dtype=np.intp)
    for g in range(G):
        mass = np.zeros(p)
        for h in range(g * (H // G), (g + 1) * (H // G)):
            for i in queries:
                sc = s * (k[:p, g] @ q[i, h])
                e = np.exp(sc - sc.max())
                mass += e / e.sum()
        cand = sorted(range(sink, p - w), key=lambda j: (-mass[j], j))
        out[g] = sorted(cand[:n])
    return out


def o1_error_estimate(q: FloatArrayLike, k: FloatArrayLike, v: FloatArrayLike, p: int, m: int,
                      w: int, sink: int, rect: str = "aggregate", keep: int = 0,
                      ridge: float = 1e-6, queries: int = 16) -> tuple[F64, float]:
    """The seal's error estimate (docs/o1.md, error estimate) from its definition, float64:
    the last ``queries`` prompt queries read as decode queries at the end of the prompt (near
    set: sinks, kept keys, the last w keys; far set: the rest, with an explicit Nystrom
    weight per key) against exact softmax over keys [0, p).

    Returns (per-head relative L2 errors (H,), overall relative L2 error)."""
    q, k, v = _o1_inputs(q, k, v)
    H, d, G = q.shape[1], q.shape[2], k.shape[1]
    s = float(_F32(1.0) / np.sqrt(_F32(d)))
    n = min(queries, p)
    if p <= w + sink + 8:
        return np.zeros(H), 0.0
    me = min(max(p // 8, 4), m)
    bounds = (np.arange(me + 1) * p) // me
    kept = kept_keys(q, k, p, w, sink, keep)
    err2, ref2 = np.zeros(H), np.zeros(H)
    for h in range(H):
        g = h // (H // G)
        kt = np.stack([k[a:b, g].mean(axis=0) for a, b in zip(bounds[:-1], bounds[1:])])
        qt = np.stack([q[a:b, h].mean(axis=0) for a, b in zip(bounds[:-1], bounds[1:])])
        au = np.exp(s * qt @ kt.T)
        ata = au.T @ au
        mu = np.linalg.solve(ata + ridge * np.mean(np.diag(ata)) * np.eye(me), au.T)
        j = np.arange(p)
        near = (j >= p - w) | (j < sink) | np.isin(j, kept[g])
        for i in range(p - n, p):
            qi = q[i, h]
            sc = s * (k[:p, g] @ qi)
            e = np.exp(sc - sc.max())
            exact = e @ v[:p, g] / e.sum()
            wn = np.exp(s * (k[:p][near, g] @ qi))                      # unscaled (float64)
            u = np.exp(s * (kt @ qi)) @ mu
            if rect.lower() == "fm":
                u = np.maximum(u, 0.0)
            wf = np.exp(s * (k[:p][~near, g] @ qt.T)) @ u                # (nfar,)
            if wf.sum() < 0:
                wf = np.zeros_like(wf)
            approx = (wn @ v[:p][near, g] + wf @ v[:p][~near, g]) / (wn.sum() + wf.sum())
            err2[h] += float(np.sum((approx - exact) ** 2))
            ref2[h] += float(np.sum(exact ** 2))
    return np.sqrt(err2 / ref2), float(np.sqrt(err2.sum() / ref2.sum()))


def nystrom_matrix(q: FloatArrayLike, k: FloatArrayLike, v: FloatArrayLike, p: int, m: int, w: int,
                   sink: int, *, clip: bool = True) -> tuple[F64, int]:
    """The O(1) operator in matrix form, float64 (docs/o1.md), and how often the clip fired.

    For decode position i (keys 0..i): near set ``i - j < w or j < sink``, far set
    ``sink <= j <= i - w``; far weight of key j is ``((F M) E)_j`` with ``F = exp(s q_i K~^T)``,
    ``M = pinv(Au, rtol=1e-6)`` and ``E = exp(s Q~ k_j)`` (landmarks from the prefix [0, p)),
    clipped at 0 when ``clip``; one joint denominator with the exact near weights.

    Returns
    -------
    out : ndarray (t - p, H, dv), float64
    clipped : int
        Number of far weights that were negative (and clipped, when ``clip``).
    """
    q, k, v = _o1_inputs(q, k, v)
    t, H, d = q.shape
    G, dv = k.shape[1], v.shape[2]
    s = float(_F32(1.0) / np.sqrt(_F32(d)))
    if p <= w + sink + 8:
        return _softmax_rows(q, k, v, s, p, H, G), 0
    hpk = H // G
    me = min(max(p // 8, 4), m)
    bounds = (np.arange(me + 1) * p) // me
    out = np.empty((t - p, H, dv))
    clipped = 0
    for h in range(H):
        g = h // hpk
        kt = np.stack([k[a:b, g].mean(axis=0) for a, b in zip(bounds[:-1], bounds[1:])])  # (me, d)
        qt = np.stack([q[a:b, h].mean(axis=0) for a, b in zip(bounds[:-1], bounds[1:])])  # (me, d)
        mu = np.linalg.pinv(np.exp(s * qt @ kt.T), rtol=1e-6)            # (me, me)
        for i in range(p, t):
            j = np.arange(i + 1)
            near = (i - j < w) | (j < sink)                             # (i+1,)
            far = ~near
            kn, vn = k[: i + 1][near, g], v[: i + 1][near, g]          # near rows
            kf, vf = k[: i + 1][far, g], v[: i + 1][far, g]            # far rows
            ln = s * (kn @ q[i, h])                                     # near logits
            fl = s * (kt @ q[i, h])                                     # (me,) landmark logits
            el = s * (kf @ qt.T)                                        # (nfar, me)
            f = fl.max()
            gmax = el.max() if el.size else 0.0
            c = max(ln.max(), f + gmax)
            wn = np.exp(ln - c)
            wf = (np.exp(el - gmax) @ (np.exp(fl - f) @ mu)) * np.exp(f + gmax - c)  # (nfar,)
            neg = wf < 0
            clipped += int(neg.sum())
            if clip:
                wf = np.where(neg, 0.0, wf)
            num = wn @ vn + wf @ vf
            out[i - p, h] = num / (wn.sum() + wf.sum())
    return out, clipped
