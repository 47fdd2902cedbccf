"""Pure-NumPy twins of the compiled kernels in ``kvcache._core``, name for name.

They take the same arguments and write the same outputs, so the tests can run both on
identical inputs (the oracle) and the benchmark can time them side by side (the baseline).
Numerics follow the same rules in float32 (scores, softmax, V accumulation, importance), with
NumPy's own summation order inside dot products and sums; results therefore agree with the
kernels to float32 rounding, not bit for bit (the exceptions, bit-identical by construction,
are row quantisation and the row stores).

Convenience wrappers run a LayerKvCache's own driver on these kernels:
``attend_all_heads(layer, q, ...)``, ``attend(layer, q, h)``, ``attend_group(layer, ...)``.
"""

from __future__ import annotations

import sys

import numpy as np

from .quant import K_GROUP

_F32 = np.float32
CHUNK_ROWS = 256


def openmp_built():
    return False


def max_threads():
    return 1


def round_half_away(x):
    """Round half away from zero, exactly (no 0.49999997 + 0.5 trap)."""
    t = np.trunc(x)                                            # same shape as x
    return t + np.sign(x) * (np.abs(x - t) >= 0.5)


def quantize_rows(x__nd, col__d, group, q__nd, s__ng, n_threads=1):
    """Row quantisation (spec 3.1) of x (n, hd) into q (n, hd) int8 and s (n, ng) float32."""
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


def store_rows_f32(x__nhd, alive__h, head_len__h, store__hcd):
    """store[h, head_len[h] + i] = x[i, h] for alive heads."""
    n = x__nhd.shape[0]
    for h in range(x__nhd.shape[1]):
        if alive__h[h]:
            L = head_len__h[h]
            store__hcd[h, L:L + n] = x__nhd[:, h]


def store_rows_q8(x__nhd, alive__h, head_len__h, col__hd, col_on__h, group, q__hcd, s__hcg):
    """Quantise x[i, h] (over col[h] where col_on[h]) into q/s at row head_len[h] + i."""
    n = x__nhd.shape[0]
    empty = np.zeros(0, dtype=_F32)
    for h in range(x__nhd.shape[1]):
        if alive__h[h]:
            L = head_len__h[h]
            quantize_rows(np.ascontiguousarray(x__nhd[:, h]), col__hd[h] if col_on__h[h] else empty,
                          group, q__hcd[h, L:L + n], s__hcg[h, L:L + n])


def stream_read(buf, n_threads=1):
    """Sum of a buffer (the read-bandwidth probe), NumPy's single-threaded sum."""
    return float(np.sum(buf, dtype=np.float64))


def visible_range(stored, n_back, i, window, first, L):
    """Rows [f, e) that query position i sees (same rule as the kernel)."""
    e = min(max(stored - n_back + i + 1, 0), stored, L)
    f = max(e - window, 0) if window > 0 else 0
    f = max(min(max(f, first), e - 1), 0)
    return f, e


def attend_rows(kf__hcd, kq__hcd, ks__hcg, vf__hcd, vq__hcd, vs__hc1, vcol__hd, head_len__h,
                q__jd, group_q0, n_pos, n_back, window, first, scale, softcap,
                out__jd, probs__jl, imp__l, imp_mode, quant_k, quant_v, n_threads=1):
    """NumPy twin of ``_core.attend_rows`` (see its docstring for the contract)."""
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
        for jl in range(cnt):
            j = int(group_q0[g]) + jl
            f, e = visible_range(stored, n_back, jl // per, window, first, L)
            out__jd[j] = 0
            if e <= f:
                continue
            qj = q__jd[j]                                              # (hd,)
            if quant_k:
                hd = qj.shape[0]
                sc = np.zeros(e - f, dtype=_F32)                       # (r,)
                for gi, g0 in enumerate(range(0, hd, K_GROUP)):
                    part = kq__hcd[g, f:e, g0:g0 + K_GROUP].astype(_F32) @ qj[g0:g0 + K_GROUP]
                    sc += ks__hcg[g, f:e, gi] * part                   # (r,)
                sc = sc * scale
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
            rows = vq__hcd[g, f:e][keep].astype(_F32) if quant_v else vf__hcd[g, f:e][keep]
            with np.errstate(invalid="ignore", over="ignore"):
                o = (w[keep] @ rows).astype(_F32)                      # (hd,)
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


def _this():
    return sys.modules[__name__]


def attend_all_heads(layer, q, *, scale=None, window=None, softcap=0.0, out=None):
    """``layer.attend_all_heads`` run on the NumPy kernels (adds importance like the real one)."""
    return layer.attend_all_heads(q, scale=scale, window=window, softcap=softcap, out=out,
                                  _kernels=_this())


def attend(layer, q, kv_head):
    """``layer.attend`` run on the NumPy kernels."""
    return layer.attend(q, kv_head, _kernels=_this())


def attend_group(layer, q_group, kv_head, out, imp_acc, scale, first, softcap):
    """``layer.attend_group`` run on the NumPy kernels."""
    return layer.attend_group(q_group, kv_head, out, imp_acc, scale, first, softcap,
                              _kernels=_this())
