"""The generation counter that lets a device mirror tell "rows were appended" from "diverged".

Every cache object owns one :class:`Generation`.  ``value`` starts at 0 and grows by one each
time stored rows change other than by appending.  Two kinds of change are told apart:

- a *shrink* (``truncate_last``) keeps rows ``[0, new_len)`` exactly as they
  were; it is logged with the lengths it left, so a mirror synced before it only has to
  re-upload from the lowest of those lengths;
- a *divergence* (eviction, clear, import, column freeze, seal, O(1) restore) may rewrite any
  row; a mirror synced before it re-uploads everything.

The log holds at most ``LOG_LIMIT`` shrinks; when it overflows, the oldest entry is dropped
and counted as a divergence, so a mirror that has not synced for that long re-uploads in full
(correct, only slower).
"""

from __future__ import annotations

from typing import Optional, Union

import numpy as np
import numpy.typing as npt

Lengths = Union[int, npt.ArrayLike]

LOG_LIMIT = 64


class Generation:
    __slots__ = ("value", "_floor", "_log")

    def __init__(self) -> None:
        self.value = 0
        self._floor = 0          # syncs older than this generation cannot be patched
        self._log: list[tuple[int, npt.NDArray[np.intp]]] = []         # (generation, lengths left) of each shrink since _floor

    def shrink(self, lengths: Lengths) -> None:
        """Record a prefix-preserving rewind that left ``lengths`` rows (int or per-head)."""
        self.value += 1
        self._log.append((self.value, np.array(lengths, dtype=np.intp, copy=True)))
        if len(self._log) > LOG_LIMIT:
            self._floor = self._log.pop(0)[0]

    def diverge(self) -> None:
        """Record a change that may have rewritten any stored row."""
        self.value += 1
        self._floor = self.value
        self._log.clear()

    def unchanged_prefix(self, since: object, current: Lengths
                         ) -> Optional[Union[int, npt.NDArray[np.intp]]]:
        """Rows ``[0, n)`` untouched since generation ``since`` (``n`` like ``current``), or
        None when a divergence happened since then (or ``since`` is not a generation of this
        object).  ``current`` is the present length(s); rows appended after ``since`` count
        as untouched until a shrink or divergence reaches them."""
        if not isinstance(since, (int, np.integer)) or isinstance(since, bool):
            raise TypeError(f"since: expected an int generation, got {type(since).__name__}")
        since = int(since)
        if since > self.value or since < self._floor:
            return None
        out = np.array(current, dtype=np.intp, copy=True)
        for gen, lengths in self._log:
            if gen > since:
                np.minimum(out, lengths, out=out)
        return out if out.ndim else int(out)
