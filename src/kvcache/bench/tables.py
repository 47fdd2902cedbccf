"""Number formats and text tables (tabulate when installed, plain text otherwise).

Method: ``docs/benchmark-method.md``.
"""

from __future__ import annotations




def fmt(x, digits=3):
    """A number with ``digits`` significant digits, '-' for None."""
    if x is None:
        return "-"
    if x >= 10 ** digits:
        return f"{x:.0f}"
    return f"{x:.{digits}g}"


def context_label(t):
    """1024 -> '1k', 5000 -> '5000'."""
    return f"{t // 1024}k" if t % 1024 == 0 else str(t)


def fmt_ratio(x):
    return "-" if x is None else f"{x:.2f}x"


def render_table(headers, rows):
    """A table via tabulate when installed, else a plain right-aligned text table."""
    try:
        from tabulate import tabulate
    except ImportError:
        pass
    else:
        return tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True,
                        stralign="right")
    cells = [list(map(str, headers))] + [list(map(str, r)) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
