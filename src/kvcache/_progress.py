"""A progress bar on stderr: tqdm when it is installed, a silent stand-in otherwise.

A leaf module: it imports nothing of kvcache, so the benchmark, the runner and the CLI can all use
it without depending on each other.
"""

from __future__ import annotations

import sys
from typing import Any, Protocol


class ProgressBar(Protocol):
    """The part of tqdm's bar that kvcache uses."""

    def update(self, n: float = 1) -> Any: ...

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> Any: ...

    def close(self) -> Any: ...


class _NoBar:
    """Stand-in for a tqdm bar when tqdm is not installed: every call does nothing."""

    def update(self, n: float = 1) -> None:
        pass

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int | None, enabled: bool = True, unit: str = "task") -> ProgressBar:
    """A tqdm bar on stderr counting ``total`` steps of ``unit``; a no-op bar without tqdm.

    tqdm is given ``disable=None`` when ``enabled``, so it turns itself off when stderr is not a
    terminal and logs stay clean.
    """
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    bar: ProgressBar = tqdm(total=total, disable=None if enabled else True, leave=False,
                            unit=unit, file=sys.stderr)
    return bar
