"""Absorbed Multi-head Latent Attention decode (DeepSeek-V2 MLA) over a latent cache.

An MLA layer caches, per token, the normalised latent ``c_t`` (``kv_lora_rank`` = r floats)
and one RoPE key shared by every head (``qk_rope_head_dim`` = dr floats): slots 0 and 1 of a
:class:`kvcache.LatentKvCache`.  A head's key and value are up-projections of the latent,
``k_nope[h, t] = W_UK[h] c_t`` and ``v[h, t] = W_UV[h] c_t``.  Instead of materialising them
(the naive form, :func:`kvcache.reference.mla_naive`), the absorbed form folds ``W_UK`` into
the query and ``W_UV`` into the output:

    q_abs[h] = W_UK[h]^T q_nope[h]                                   (r)
    s[h, t]  = scale * (q_abs[h] . c_t + q_rope[h] . k_rope[t])
    p[h, :]  = softmax(s[h, :]) over the visible rows (float32)
    out[h]   = W_UV[h] (sum_t p[h, t] c_t)                           (dv)

which reads each cached row once for all heads.  The kernel is ``_core.mla_attend`` (inner
loops and their summation orders in ``_mla.h``); its float32 NumPy twin is
``kvcache.reference.mla_attend`` and the naive form is ``kvcache.reference.mla_naive``.

Weights: Hugging Face checkpoints store ``kv_b_proj.weight`` as ``(H * (dn + dv), r)``; for
head h, rows ``h*(dn+dv) .. +dn`` are ``W_UK[h]`` and the next ``dv`` rows ``W_UV[h]``.
:func:`split_kv_b` cuts it into the ``(H, dn, r)`` and ``(H, dv, r)`` arrays this module takes.

Softmax scale: see :func:`mla_softmax_scale`.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Optional

import numpy as np
import numpy.typing as npt

from . import _core
from ._entry import MlaCall
from ._threads import threads_for
from ._validate import FloatArrayLike, as_f32, as_f32_scalar

__all__ = ["mla_decode", "mla_softmax_scale", "yarn_get_mscale", "split_kv_b"]


def _dims(name: str, arr: npt.NDArray[Any], ndim: int) -> None:
    if arr.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {arr.shape}")


def mla_decode(q_nope: FloatArrayLike, q_rope: FloatArrayLike, latent: FloatArrayLike,
               k_rope: FloatArrayLike, w_uk: FloatArrayLike, w_uv: FloatArrayLike, scale: float, *,
               out: Optional[npt.NDArray[np.float32]] = None) -> npt.NDArray[np.float32]:
    """Absorbed MLA attention of one query position, or a causal block of n, over a latent cache.

    Parameters
    ----------
    q_nope : array_like, (n_heads, d_nope) or (n, n_heads, d_nope)
        The no-RoPE part of the queries.
    q_rope : array_like, (n_heads, d_rope) or (n, n_heads, d_rope)
        The RoPE part of the queries, already rotated to their positions.
    latent : array_like, (T, r)
        Cached latents (slot 0 of a LatentKvCache layer, rows ``[0, cached_len)``).
    k_rope : array_like, (T, d_rope)
        Cached shared RoPE keys (slot 1), already rotated.
    w_uk : array_like, (n_heads, d_nope, r)
        Key up-projection per head.
    w_uv : array_like, (n_heads, d_v, r)
        Value up-projection per head.
    scale : float
        Softmax scale (finite, > 0); :func:`mla_softmax_scale` gives DeepSeek's.
    out : ndarray, optional
        float32 C-contiguous array of the result's shape to write into.

    Returns
    -------
    ndarray, float32, (n_heads, d_v) or (n, n_heads, d_v)
        With n queries, position i (0-based) sees rows ``[0, T - n + i + 1)``: the last n rows
        are the block's own positions, as in ``LayerKvCache.attend_all_heads``.

    Notes
    -----
    Inputs are converted to C-contiguous float32 (no copy when they already are: a slice
    ``slot_storage(l, 0)[:cached_len]`` of a float32 cache is passed as is).  Softmax and every
    accumulation are float32.  NaN or infinite inputs give what the IEEE softmax gives (NaN for
    a position and head with a NaN score, or whose every score is -inf); rows a position cannot
    see are never read.  Inputs are not scanned for them, as that would cost a pass over the
    cache.
    """
    qn = as_f32("q_nope", q_nope)
    single = qn.ndim == 2
    if qn.ndim not in (2, 3):
        raise ValueError(f"q_nope: expected (n_heads, d_nope) or (n, n_heads, d_nope), got shape {qn.shape}")
    qr = as_f32("q_rope", q_rope)
    _dims("q_rope", qr, qn.ndim)
    lat = as_f32("latent", latent)
    _dims("latent", lat, 2)
    kr = as_f32("k_rope", k_rope)
    _dims("k_rope", kr, 2)
    wuk = as_f32("w_uk", w_uk)
    _dims("w_uk", wuk, 3)
    wuv = as_f32("w_uv", w_uv)
    _dims("w_uv", wuv, 3)
    if single:
        qn, qr = qn[None], qr[None]
    n, H, dn = qn.shape
    T, r = lat.shape
    dr = kr.shape[1]
    dv = wuv.shape[1]
    if H < 1:
        raise ValueError("q_nope: need at least one head")
    if r < 1:
        raise ValueError(f"latent: the latent rank must be >= 1, got shape {lat.shape}")
    if dv < 1:
        raise ValueError(f"w_uv: d_v must be >= 1, got shape {wuv.shape}")
    if qr.shape[:2] != (n, H):
        raise ValueError(f"q_rope: expected {(n, H, dr) if not single else (H, dr)} "
                         f"(the heads of q_nope), got {qr.shape[1:] if single else qr.shape}")
    if kr.shape[0] != T:
        raise ValueError(f"k_rope: expected {T} rows like latent, got shape {kr.shape}")
    if qr.shape[2] != dr:
        raise ValueError(f"q_rope: d_rope {qr.shape[2]} does not match k_rope's {dr}")
    if wuk.shape != (H, dn, r):
        raise ValueError(f"w_uk: expected (n_heads, d_nope, r) = {(H, dn, r)}, got {wuk.shape}")
    if wuv.shape[0] != H or wuv.shape[2] != r:
        raise ValueError(f"w_uv: expected (n_heads, d_v, r) = {(H, 'd_v', r)}, got {wuv.shape}")
    if T < n:
        raise ValueError(f"latent: {n} query positions need at least {n} cached rows "
                         f"(the block's own), got {T}")
    scale = as_f32_scalar("scale", scale, positive=True)
    shape = (H, dv) if single else (n, H, dv)
    if out is not None and any(np.may_share_memory(out, a) for a in (qn, qr, lat, kr, wuk, wuv)):
        # positions are computed in groups, so a later group would read what an earlier wrote
        raise ValueError("out: must not share memory with any input")
    if out is None:
        res = np.empty((n, H, dv), dtype=np.float32)
    else:
        if not isinstance(out, np.ndarray) or out.dtype != np.float32:
            raise TypeError(f"out: expected a float32 ndarray, got "
                            f"{getattr(out, 'dtype', type(out).__name__)}")
        if not (out.flags.c_contiguous and out.flags.writeable and out.shape == shape):
            raise ValueError(f"out: expected a writeable C-contiguous array of shape {shape}, "
                             f"got shape {out.shape}")
        res = out.reshape(n, H, dv)
    _core.mla_attend(MlaCall(qn=qn, qr=qr, lat=lat, kr=kr, wuk=wuk, wuv=wuv, scale=scale,
                             out=res,
                             n_threads=threads_for(n * T * H * (2 * r + dr) + n * H * (dn + dv) * r,
                                                   n * -(-T // _core.mla_task_rows(T)))))
    if out is not None:
        return out
    return res[0] if single else res


def yarn_get_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention magnitude factor: 1 for ``factor <= 1``, else ``0.1 mscale ln(factor) + 1``."""
    factor = float(factor)
    if factor <= 1.0:
        return 1.0
    return 0.1 * float(mscale) * math.log(factor) + 1.0


def _cfg(config: object, key: str, default: Any = None) -> Any:
    if isinstance(config, dict):
        return config.get(key, default)
    return getattr(config, key, default)


def mla_softmax_scale(qk_nope_head_dim: Optional[int] = None,
                      qk_rope_head_dim: Optional[int] = None,
                      rope_scaling: object = None, *, config: object = None,
                      apply_mscale: bool = True) -> float:
    """Softmax scale of a DeepSeek-V2-style MLA layer.

    ``scale = (qk_nope_head_dim + qk_rope_head_dim) ** -0.5 * m**2`` with
    ``m = yarn_get_mscale(rope_scaling["factor"], rope_scaling["mscale_all_dim"])`` when
    ``rope_scaling`` is given and its ``mscale_all_dim`` is nonzero, else ``m = 1``.  The scale
    uses the FULL query head dim (nope + rope), although the two parts are scored separately.

    Parameters
    ----------
    qk_nope_head_dim, qk_rope_head_dim : int
        Head dims of the query parts (DeepSeek-V2 and V2-Lite: 128 and 64).
    rope_scaling : dict, optional
        The config's ``rope_scaling`` (transformers 5 calls it ``rope_parameters``); only
        ``factor`` and ``mscale_all_dim`` are read.
    config : dict or object, optional
        A model config (``config.json`` as a dict, or a transformers config) to read the three
        values from instead; explicit arguments win.
    apply_mscale : bool
        False gives the plain ``(dn + dr) ** -0.5``.

    Notes
    -----
    Which checkpoints use which convention:

    * DeepSeek's official inference code (V2, V2-Lite, V2.5, V3), the checkpoints' own
      ``modeling_deepseek.py`` (``trust_remote_code``) and transformers' in-library
      DeepseekV3 multiply by ``m**2``; so does the in-library DeepseekV2 of transformers 5
      (checked in 5.24, ``yarn_apply_mscale``).  For
      DeepSeek-V2 and V2-Lite (``factor=40``, ``mscale_all_dim=0.707``): ``m**2 = 1.589626``
      and ``scale = 192**-0.5 * 1.589626 = 0.1147214``.  Their YaRN RoPE additionally scales
      cos/sin by ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)``, which is 1 for
      these configs (both 0.707) and is part of the RoPE, not of this scale.
    * Earlier in-library DeepseekV2 code of transformers (4.x) used the plain
      ``(dn + dr) ** -0.5`` and put YaRN's factor into the rotary embedding instead, as does
      the upstream fuel port (v1): pass ``apply_mscale=False`` to match them.
    * A config without ``rope_scaling`` (or with ``mscale_all_dim`` 0) gets the plain scale
      either way.
    """
    if config is not None:
        qk_nope_head_dim = qk_nope_head_dim if qk_nope_head_dim is not None else _cfg(config, "qk_nope_head_dim")
        qk_rope_head_dim = qk_rope_head_dim if qk_rope_head_dim is not None else _cfg(config, "qk_rope_head_dim")
        if rope_scaling is None:
            rope_scaling = _cfg(config, "rope_scaling") or _cfg(config, "rope_parameters")
    d = 0
    for name, v in (("qk_nope_head_dim", qk_nope_head_dim), ("qk_rope_head_dim", qk_rope_head_dim)):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
            raise ValueError(f"{name}: expected an int >= 0, got {v!r}")
        d += int(v)
    if d < 1:
        raise ValueError("qk_nope_head_dim + qk_rope_head_dim must be >= 1")
    scale: float = d ** -0.5
    if apply_mscale and rope_scaling:
        mad = _cfg(rope_scaling, "mscale_all_dim", 0) or 0
        if mad:
            factor = _cfg(rope_scaling, "factor")
            if factor is None:
                raise ValueError("rope_scaling: mscale_all_dim is set but factor is missing")
            m = yarn_get_mscale(factor, mad)
            scale = scale * m * m
    return scale


def split_kv_b(kv_b_weight: FloatArrayLike, n_heads: int, qk_nope_head_dim: int,
               v_head_dim: int) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
    """Cut a Hugging Face ``kv_b_proj.weight`` (n_heads * (dn + dv), r) into W_UK (n_heads, dn, r)
    and W_UV (n_heads, dv, r), both float32 C-contiguous copies."""
    w = as_f32("kv_b_weight", kv_b_weight)
    _dims("kv_b_weight", w, 2)
    H, dn, dv = int(n_heads), int(qk_nope_head_dim), int(v_head_dim)
    if H < 1 or dn < 0 or dv < 1 or w.shape[0] != H * (dn + dv):
        raise ValueError(f"kv_b_weight: expected {H} * ({dn} + {dv}) = {H * (dn + dv)} rows, "
                         f"got shape {w.shape}")
    w3 = w.reshape(H, dn + dv, w.shape[1])
    return np.ascontiguousarray(w3[:, :dn]), np.ascontiguousarray(w3[:, dn:])
