"""The append section: the cost of filling a layer one position at a time and of a single
append at a given length (amortised O(1) growth).

Method: ``docs/benchmark-method.md``.
"""

from __future__ import annotations

import gc
import statistics
import time
import timeit
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..layer import LayerKvCache
from .geometry import GEOMETRIES, Geometry, make_mode, random_kv
from .registry import Context, Option, Result, Section, Values, at_least, register
from .tables import Row, context_label, fmt, render_table, section_text

if TYPE_CHECKING:
    from .._progress import ProgressBar


APPEND_CONTEXTS = (1024, 32768)


class AppendFill:
    """Append cost of a layer: fill 0..T one position at a time, then single appends at T."""

    def __init__(self, geom: Geometry, context: int, mode_name: str = "f32",
                 seed: int = 2) -> None:
        self.geom, self.context, self.mode_name = geom, context, mode_name
        self.k, self.v = random_kv(geom, context, seed)
        self.layer: LayerKvCache | None = None

    def fill(self) -> None:
        """A fresh layer filled one ``append(k_row, v_row)`` at a time."""
        c = LayerKvCache(self.geom.num_kv_heads, self.geom.head_dim, mode=make_mode(self.mode_name))
        k, v = self.k, self.v
        for i in range(self.context):
            c.append(k[i], v[i])
        self.layer = c

    def single_appends(self, n: int) -> list[float]:
        """Seconds of ``n`` single appends at T rows, each rolled back (T stays fixed)."""
        c, k, v = self.layer, self.k, self.v
        if c is None:
            raise RuntimeError("single_appends() needs a filled layer: call fill() first")
        times = []
        clock = time.perf_counter
        for i in range(n):
            t0 = clock()
            c.append(k[i], v[i])
            times.append(clock() - t0)
            c.truncate_last(1)
        return times


def run_append(ctx: Context, values: Values, bar: ProgressBar) -> Result:
    """The append section: ``{"rows": [...]}`` for the Llama geometry, f32, at 1k and 32k."""
    geom = GEOMETRIES["llama3-8b"]
    rows = []
    for context in APPEND_CONTEXTS:
        bar.set_postfix_str(f"append {context}")
        work = AppendFill(geom, context, "f32", seed=ctx.seed + 2)
        fill_s = timeit.Timer(work.fill).timeit(number=1)
        singles = work.single_appends(values.repeats)
        rows.append({"geometry": geom.label, "mode": "f32", "context": context,
                     "fill_s": fill_s, "amortised_us": fill_s / context * 1e6,
                     "single_median_us": statistics.median(singles) * 1e6,
                     "single_max_us": max(singles) * 1e6, "single_samples_s": singles})
        del work
        gc.collect()
        bar.update()
    return {"rows": rows}


def append_table(rows: Sequence[Row]) -> str:
    """The append-cost table."""
    body = [[r["geometry"], r["mode"], context_label(r["context"]), fmt(r["fill_s"]),
             fmt(r["amortised_us"]), fmt(r["single_median_us"]), fmt(r["single_max_us"])]
            for r in rows]
    return render_table(["model", "mode", "T", "fill 0..T s", "amortised us/pos",
                         "single at T median us", "single at T max us"], body)


def append_ratio_lines(rows: Sequence[Row]) -> list[str]:
    """The 32k / 1k ratios of the append costs (amortised O(1) keeps them near 1)."""
    by_t = {r["context"]: r for r in rows}
    lo, hi = by_t.get(APPEND_CONTEXTS[0]), by_t.get(APPEND_CONTEXTS[-1])
    if lo is None or hi is None:
        return []
    amortised = hi["amortised_us"] / lo["amortised_us"]
    single = hi["single_median_us"] / lo["single_median_us"]
    return [f"ratio 32k/1k: amortised {amortised:.2f}x, single-append median {single:.2f}x"]


def append_report(ctx: Context, values: Values, result: Result) -> str:
    """The append-cost table and the 32k / 1k ratios."""
    rows = result["rows"]
    return section_text("append cost (c.append(k_row, v_row), one position per call):",
                        [append_table(rows)], append_ratio_lines(rows))


SECTION = register(Section(
    name="append", order=20,
    help="append cost: filling a layer one position at a time, and single appends at T",
    options=(Option("repeats", "single appends timed at T", 201, at_least(1),
                    metavar="N"),),
    tasks=lambda ctx, values: len(APPEND_CONTEXTS), run=run_append, report=append_report))
