"""The q8 storage scheme (spec layer-kv-cache.md section 3).

K rows are quantised in groups of ``K_GROUP`` = 32 channels with one float32 scale per group;
V rows with one scale per row.  Scales are ``max(absmax / 127, 1e-12)``, values
``clamp(round_half_away_from_zero(r / s), -127, 127)`` (NaN -> 0), where ``r = x / col`` once
the per-channel column field is frozen, else ``r = x``.

The column field is frozen once per conversation, at the start of the first append that finds
``seq_len >= COL_WARMUP`` (64) and no column frozen yet: for every head and quantised component
holding rows, ``col[d] = max(sqrt(sum_p x[p, d]**2 / n), 1e-6)`` over the dequantised rows
(float32, rows added in order), and every stored row is requantised against it.
"""

from __future__ import annotations

import numpy as np

COL_WARMUP = 64
K_GROUP = 32
COL_FLOOR = np.float32(1e-6)


def n_groups(head_dim, group):
    """Number of scales per row: ceil(head_dim / group)."""
    return -(-head_dim // group)


def dequantize(q, s, group):
    """Dequantise int8 rows ``q`` (n, hd) with scales ``s`` (n, ceil(hd/group)) to float32.

    Used once, at the column freeze; the attention path never dequantises.
    """
    hd = q.shape[1]
    scales = np.repeat(s, group, axis=1)[:, :hd]          # (n, hd)
    with np.errstate(invalid="ignore", over="ignore"):     # inf scales from inf rows: IEEE
        return q.astype(np.float32) * scales               # (n, hd) float32


def column_field(x):
    """Per-channel RMS of rows ``x`` (n, hd), float32, rows accumulated in order, floored."""
    sq = np.zeros(x.shape[1], dtype=np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        for row in x:                                      # row order, as the spec says
            sq += row * row
        col = np.sqrt(sq / np.float32(x.shape[0]))
    return np.maximum(col, COL_FLOOR).astype(np.float32)


def freeze_columns(q_store, s_store, lengths, group, col, col_on, kernels):
    """Freeze the column field of one quantised component for every head that holds rows.

    q_store (nkv, cap, hd) int8 and s_store (nkv, cap, ng) float32 are requantised in place;
    col (nkv, hd) and col_on (nkv,) are written for the heads that had rows.
    """
    for h, n in enumerate(lengths):
        n = int(n)
        if n == 0:
            continue
        x = dequantize(q_store[h, :n], s_store[h, :n], group)   # (n, hd)
        c = column_field(x)                                      # (hd,)
        kernels.quantize_rows(x__nd=x, col__d=c, group=group, q__nd=q_store[h, :n],
                              s__ng=s_store[h, :n], n_threads=1)
        col[h] = c
        col_on[h] = 1
