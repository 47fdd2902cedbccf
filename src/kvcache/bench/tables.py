"""Number formats and text tables (tabulate when installed, plain text otherwise).

Method: ``docs/benchmark-method.md``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

Row = dict[str, Any]   # one result record: a table row and a JSON object

# A share of the measured read bandwidth above 100% is not a bandwidth figure: the rows came
# (partly) from a cache, or the run was disturbed.  The sections measure such a reading once
# more; if it is still above 100%, the tables print this flag instead of the number.
BANDWIDTH_FLAG = ">100%*"
BANDWIDTH_FOOTNOTE = ("*: above 100% of the measured read bandwidth, also when measured a second "
                      "time (cache-resident or noisy): the rows were served from a cache or the "
                      "run was disturbed, so the reading is no bandwidth figure")


def above_bandwidth(pct: float) -> bool:
    """Whether ``pct`` (a share of the measured read bandwidth, in %) is above 100 (or NaN)."""
    return not pct <= 100.0


def pct_bandwidth_cell(pct: float, digits: int = 0) -> str:
    """``pct`` as a table cell: ``"73%"``, or :data:`BANDWIDTH_FLAG` above 100%."""
    return BANDWIDTH_FLAG if above_bandwidth(pct) else f"{pct:.{digits}f}%"


def bandwidth_footnotes(pcts: Iterable[float]) -> list[str]:
    """The footnote explaining :data:`BANDWIDTH_FLAG` when any of ``pcts`` is flagged."""
    return [BANDWIDTH_FOOTNOTE] if any(above_bandwidth(p) for p in pcts) else []


def fmt(x: float | None, digits: int = 3) -> str:
    """A number with ``digits`` significant digits, '-' for None."""
    if x is None:
        return "-"
    if x >= 10 ** digits:
        return f"{x:.0f}"
    return f"{x:.{digits}g}"


def context_label(t: int) -> str:
    """1024 -> '1k', 5000 -> '5000'."""
    return f"{t // 1024}k" if t % 1024 == 0 else str(t)


def fmt_ratio(x: float | None) -> str:
    """A ratio as ``'2.50x'``, '-' for None."""
    return "-" if x is None else f"{x:.2f}x"


def render_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A table via tabulate when installed, else a plain right-aligned text table."""
    try:
        # optional and untyped; pyproject's list of untyped packages does not name it yet
        from tabulate import (
            tabulate,
        )
    except ImportError:
        pass
    else:
        text: str = tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True,
                             stralign="right")
        return text
    cells = [list(map(str, headers))] + [list(map(str, r)) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
