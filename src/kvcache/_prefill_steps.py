"""The prompt-step rule shared by :class:`kvcache.runner.Runner` and :func:`kvcache.hf.prefill`:
where a long prompt's steps end.

A step is one pass of a block of prompt positions through every layer.  Steps end at multiples
of the step size (absolute positions, so a prompt continued from a prefix store gets the
steps a cold run gets) and at the end.  With the int8 scheme "cmf" no step ends at or below
``quant.COL_WARMUP``: there the column field freezes and requantises the rows before it, and a
one-shot prompt freezes before any of its queries attend, so the first step must too.
"""

from __future__ import annotations

from . import quant
from .modes import KvMode

__all__ = ["step_ends"]


def step_ends(start: int, end: int, step: int, mode: KvMode) -> list[int]:
    """The positions where the steps over prompt positions ``[start, end)`` end, ascending,
    the last being ``end`` (``start < end``; ``step`` >= 1)."""
    floor = quant.COL_WARMUP if mode.freezes_columns else 0
    return [e for e in range((start // step + 1) * step, end, step) if e > floor] + [end]
