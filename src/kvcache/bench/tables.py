"""Number formats and text tables (tabulate when installed, plain text otherwise).

Method: ``docs/benchmark-method.md``.
"""

from __future__ import annotations

import textwrap
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


#: Widest table line printed; a wider table is split into parts (:func:`render_table`).
MAX_WIDTH = 120
#: Headers of columns that say what a row is (repeated in every part of a split table).
KEY_HEADERS = frozenset({"geometry", "prompt", "mode", "model", "ctx", "thr", "T", "layer",
                         "backend", "cell", "condition", "digest function", "package", "rows",
                         "layers x MiB", "mirror", "variant", "kind", "context"})
# A share of a measured compute peak above 100% is no share: the probe that measured the peak
# ran slower than the call (a busy machine), so the tables flag it.
PEAK_MARK = "!"
PEAK_FOOTNOTE = ("!: above 100% of the measured peak: the peak probe ran slower than this call "
                 "(the machine was busy or its clock changed), so the share is no figure")


def prose(text: str) -> str:
    """A line of prose wrapped at :data:`MAX_WIDTH` columns, its continuation lines indented
    two more than its own indentation (a table, or text with line breaks, is returned as
    is)."""
    if "\n" in text or text.lstrip().startswith("|") or len(text) <= MAX_WIDTH:
        return text
    indent = " " * (len(text) - len(text.lstrip()))
    return textwrap.fill(text, MAX_WIDTH, subsequent_indent=indent + "  ",
                         break_long_words=False, break_on_hyphens=False)


def section_text(title: str, tables: Sequence[str], notes: Iterable[str]) -> str:
    """A section of the report: a blank line, the title, the tables (a blank line between
    two), the notes indented; prose wrapped at :data:`MAX_WIDTH` columns."""
    lines = ["", title]
    for i, table in enumerate(tables):
        lines += [""] * bool(i) + [table]
    lines += ["  " + line for line in notes]
    return "\n".join(prose(line) for line in lines)


def _above_peak(cell: object) -> bool:
    text = str(cell).strip().rstrip("%")
    try:
        return float(text) > 100.0
    except ValueError:
        return False


def render_table(headers: Sequence[str], rows: Sequence[Sequence[object]],
                 keys: int | None = None) -> str:
    """A table via tabulate when installed, else a plain right-aligned text table.

    Cells of a ``%peak`` column above 100 get :data:`PEAK_MARK` and the table a footnote.  A
    table wider than :data:`MAX_WIDTH` is printed in parts, each repeating the first ``keys``
    columns (default: the leading columns named in :data:`KEY_HEADERS`, at least one)."""
    headers = list(map(str, headers))
    cells = [list(r) + [""] * (len(headers) - len(r)) for r in rows]
    flagged = False
    for i, h in enumerate(headers):
        if "%peak" in h:
            for r in cells:
                if i < len(r) and _above_peak(r[i]):
                    r[i] = f"{r[i]}{PEAK_MARK}"
                    flagged = True
    if keys is None:
        keys = 1
        while keys < len(headers) and headers[keys] in KEY_HEADERS:
            keys += 1
    text = _render(headers, cells)
    if max(map(len, text.splitlines()), default=0) > MAX_WIDTH and len(headers) > keys + 1:
        parts: list[list[int]] = []
        group: list[int] = []
        for i in range(keys, len(headers)):
            trial = group + [i]
            cols = list(range(keys)) + trial
            width = max(map(len, _render([headers[c] for c in cols],
                                         [[r[c] for c in cols] for r in cells]).splitlines()))
            if group and width > MAX_WIDTH:
                parts.append(group)
                trial = [i]
            group = trial
        parts.append(group)
        text = "\n\n".join(_render([headers[c] for c in list(range(keys)) + g],
                                    [[r[c] for c in list(range(keys)) + g] for r in cells])
                            for g in parts)
    return text + ("\n" + textwrap.fill(PEAK_FOOTNOTE, MAX_WIDTH) if flagged else "")


def _render(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    try:
        # optional (the bench and test extras); untyped, listed in pyproject's mypy overrides
        from tabulate import tabulate
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


def line_style(threads: Sequence[int], n: int) -> str:
    """The line style of thread count ``n`` in a chart of the counts ``threads``."""
    return "-" if n == threads[0] else ("--", ":", "-.")[list(threads).index(n) % 3 - 1]
