"""Eviction: which positions a cache keeps when it must shrink.

``EvictionPolicy`` names the rule; :func:`born_rows` chooses the rows for the Born
(attention-mass) rule.  The layer applies the choice to its storage
(:meth:`kvcache.LayerKvCache.evict`), :class:`kvcache.KvCache` applies it to every layer and
the wire format records the policy, so all three import this module and it imports nothing but
the validation leaf.  The rules are described in ``docs/architecture.md`` (eviction).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import numpy.typing as npt

from ._validate import as_int

__all__ = ["EvictionPolicy", "born_rows"]

PolicyKind = Literal["recent", "born"]


class EvictionPolicy:
    """How :meth:`KvCache.evict` chooses the positions to keep.

    ``EvictionPolicy.RECENT`` keeps the newest positions.  ``EvictionPolicy.born(sink)`` keeps
    the first ``sink`` positions, the newest ``max(keep // 2, 1)``, and fills the rest of the
    budget with the positions that received the most attention mass (importance).
    """

    __slots__ = ("_kind", "_sink")
    _kind: PolicyKind
    _sink: int

    RECENT: EvictionPolicy  # set below

    def __init__(self, kind: PolicyKind, sink: int = 0) -> None:
        if kind not in ("recent", "born"):
            raise ValueError(f"kind: expected 'recent' or 'born', got {kind!r}")
        object.__setattr__(self, "_kind", kind)
        object.__setattr__(self, "_sink", as_int("sink", sink, minimum=0))

    @classmethod
    def born(cls, sink: int = 4) -> EvictionPolicy:
        """Born (attention-mass) eviction keeping ``sink`` leading positions."""
        return cls("born", sink)

    @property
    def kind(self) -> PolicyKind:
        return self._kind

    @property
    def sink(self) -> int:
        return self._sink

    def recent(self, keep: int) -> int:
        """How many of the newest positions the Born rule keeps out of ``keep``."""
        return max(keep // 2, 1)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("EvictionPolicy is immutable")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, EvictionPolicy):
            return NotImplemented
        return (self._kind, self._sink) == (other._kind, other._sink)

    def __hash__(self) -> int:
        return hash((self._kind, self._sink))

    def __repr__(self) -> str:
        return "EvictionPolicy.RECENT" if self._kind == "recent" else f"EvictionPolicy.born(sink={self._sink})"


EvictionPolicy.RECENT = EvictionPolicy("recent")


def born_rows(imp: npt.NDArray[np.float32], keep: int, sink: int,
              recent: int) -> npt.NDArray[np.intp]:
    """The positions the Born rule keeps out of ``imp.size``, in chronological order.

    The first ``sink`` positions, the newest ``recent``, and the middle positions of highest
    importance ``imp`` to fill ``keep`` (a stable descending sort: ties keep the older
    position; NaN ranks last).  Nothing is chosen twice; at most ``keep`` positions come back.
    """
    total = int(imp.size)
    sink_n = min(sink, keep)
    recent_n = min(recent, keep - sink_n)
    budget = keep - sink_n - recent_n
    middle = np.arange(sink_n, total - recent_n)
    if budget > 0 and middle.size:
        vals = imp[middle].astype(np.float64)
        order = np.argsort(np.where(np.isnan(vals), np.inf, -vals), kind="stable")
        chosen = middle[order[:budget]]
    else:
        chosen = middle[:0]
    kept = np.concatenate([np.arange(sink_n), chosen, np.arange(total - recent_n, total)])
    return np.sort(kept).astype(np.intp)
