"""The report of a run: the printed text, the JSON file and the charts.

Method: ``docs/benchmark-method.md``.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any

from .append import append_ratio_lines, append_table
from .attention import bandwidth_lines, decode_table, notes, plot_series
from .geometry import MiB
from .mla import mla_notes, mla_table
from .o1 import (
    O1_ERROR_STEPS, O1_FLUSH_BYTES, O1_M, O1_SINK, O1_W, o1_notes, o1_summary,
    o1_table)
from . import runner as runner_section
from .runner import runner_notes, runner_table
from .store import io_table, store_notes, store_summary, ttft_table
from .sync import sync_notes, sync_table
from .contention import contention_notes, contention_table
from .tables import context_label, fmt, prose
from .tables import Row
from .timing import Bandwidth
from .wire import wire_digest_table, wire_notes, wire_table

if TYPE_CHECKING:
    from .options import Options


@dataclass
class Results:
    """Everything one run measured, section by section (empty where a section did not run)."""

    info: dict[str, Any]                                   # the machine (machine.machine_info)
    bandwidth: Bandwidth = field(default_factory=dict)
    decode: list[Row] = field(default_factory=list)
    append: list[Row] = field(default_factory=list)
    o1: list[Row] = field(default_factory=list)
    o1_s: float = 0.0                                      # seconds the O(1) section took
    wire: dict[str, Any] | None = None
    mla: dict[str, Any] | None = None
    sync: list[Row] = field(default_factory=list)
    runner: list[Row] = field(default_factory=list)
    store: dict[str, Any] | None = None
    contention: dict[str, Any] | None = None


def write_plot(path: str, rows: Sequence[Row], bandwidth: Bandwidth) -> None:
    """ms per step and effective GB/s against context, one column per geometry.

    Colour: implementation and mode; line style: thread count; grey lines: stream_read."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    geoms = list(dict.fromkeys(r["geometry"] for r in rows))
    threads = sorted({r["threads"] for r in rows})
    fig, axes = plt.subplots(2, len(geoms), figsize=(6.5 * len(geoms), 8), squeeze=False)
    for col, g in enumerate(geoms):
        mine = [r for r in rows if r["geometry"] == g]
        ax_ms, ax_gbs = axes[0][col], axes[1][col]
        for (impl, mode, n), pts in plot_series(mine).items():
            pts.sort()
            style = {"color": _PLOT_COLOURS[(impl, mode)], "marker": _PLOT_MARKERS[impl],
                     "ls": _line_style(threads, n), "label": f"{impl} {mode} {n}t"}
            ax_ms.plot([p[0] for p in pts], [p[1] for p in pts], **style)
            ax_gbs.plot([p[0] for p in pts], [p[2] for p in pts], **style)
        for n, b in bandwidth.items():
            ax_gbs.axhline(b["best_gbs"], color="grey", lw=0.8, ls=_line_style(threads, n))
            ax_gbs.annotate(f"stream_read {n}t", (mine[0]["context"], b["best_gbs"]),
                            fontsize=7, color="grey", va="bottom")
        ax_ms.set_yscale("log")
        ax_ms.set_title(g)
        contexts = sorted({r["context"] for r in mine})
        for ax in (ax_ms, ax_gbs):
            ax.set_xscale("log", base=2)
            ax.set_xticks(contexts, [context_label(c) for c in contexts])
            ax.set_xlabel("context (rows)")
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("ms per decode step (one layer)")
    axes[1][0].set_ylabel("effective GB/s (K/V bytes read per step)")
    axes[0][0].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


_PLOT_COLOURS = {("kvcache", "f32"): "C0", ("kvcache", "q8"): "C1", ("torch", "f32"): "C2",
                 ("reference", "f32"): "C3", ("reference", "q8"): "C4"}
_PLOT_MARKERS = {"kvcache": "o", "torch": "s", "reference": "x"}


def _line_style(threads: list[int], n: int) -> str:
    return "-" if n == threads[0] else ("--", ":", "-.")[threads.index(n) % 3 - 1]


def mla_plot_path(path: str) -> str:
    """``chart.png`` -> ``chart-mla.png`` (the MLA chart beside the decode chart)."""
    stem, ext = os.path.splitext(path)
    return f"{stem}-mla{ext or '.png'}"


def write_mla_plot(path: str, result: dict[str, Any]) -> None:
    """MLA section chart: ms per step (kernel per thread count, naive) and latent read rate as
    % of bandwidth with the FMA-peak ceiling, against context."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    threads = sorted({r["threads"] for r in rows})
    contexts = sorted({r["context"] for r in rows})
    fig, (ax_ms, ax_bw) = plt.subplots(1, 2, figsize=(13, 5))
    for i, n in enumerate(threads):
        mine = sorted((r for r in rows if r["threads"] == n), key=lambda r: r["context"])
        ls = _line_style(threads, n)
        xs = [r["context"] for r in mine]
        ax_ms.plot(xs, [r["kernel_ms"] for r in mine], color="C0", marker="o", ls=ls,
                   label=f"kernel {n}t")
        naive = [(r["context"], r["naive_ms"]) for r in mine if "naive_ms" in r]
        if naive:
            ax_ms.plot(*zip(*naive), color="C3", marker="x", ls=ls, label=f"naive NumPy {n}t")
        ax_bw.plot(xs, [r["pct_bandwidth"] for r in mine], color="C0", marker="o", ls=ls,
                   label=f"latent read {n}t")
        ax_bw.plot(xs, [r["fma_ceiling_pct_bandwidth"] for r in mine], color="grey", ls=ls,
                   label=f"FMA-peak ceiling {n}t")
    ax_bw.axhline(100.0, color="C3", lw=0.8, ls=":", label="measured read bandwidth")
    ax_ms.set_yscale("log")
    ax_ms.set_ylabel("ms per decode step (one layer)")
    ax_bw.set_ylabel("% of measured read bandwidth")
    ax_ms.set_title("DeepSeek-V2-Lite MLA decode")
    for ax in (ax_ms, ax_bw):
        ax.set_xscale("log", base=2)
        ax.set_xticks(contexts, [context_label(c) for c in contexts])
        ax.set_xlabel("context (rows)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_report(res: Results, opts: Options, file: IO[str] | None = None) -> None:
    """The text report: the machine, the bandwidth probe, then each section's table and notes."""
    out = sys.stdout if file is None else file               # at call time (capture, redirect)
    info, bandwidth, rows, append_rows = res.info, res.bandwidth, res.decode, res.append
    o1_rows, wire_result, mla_result = res.o1, res.wire, res.mla
    sync_rows, runner_rows = res.sync, res.runner

    def p(*a: object) -> None:
        """Print; a line of prose wider than the tables' 120 columns is wrapped."""
        print(prose(" ".join(map(str, a))), file=out)

    def section(title: str | None, tables: Sequence[str], notes: Iterable[str]) -> None:
        """A blank line, the title, the tables (a blank line between two), the notes indented."""
        p("")
        if title:
            p(title)
        for i, table in enumerate(tables):
            if i:
                p("")
            p(table)
        for line in notes:
            p("  " + line)

    llc = info["llc_bytes_reported"]
    llc_text = f"LLC reported {llc / MiB:.0f} MiB" if llc else "LLC size unknown"
    p(f"kvcache {info['kvcache']} benchmark -- {info['cpu_model']}, "
      f"{info['cpu_count']} CPUs, {llc_text}")
    if info.get("isa_bodies"):
        p(f"kernel bodies: {info['isa_bodies']} (cpu features: {info.get('cpu_features', '?')})")
    other = info.get("other_processes_cores")
    if other is not None:
        p(f"other processes kept {other:.2f} cores busy on average during the run "
          f"({'quiet' if other <= 0.2 else 'NOT quiet: timings may be inflated'})")
    if bandwidth:
        p("measured read bandwidth (kvcache._core.stream_read):")
        for line in bandwidth_lines(bandwidth):
            p(line)
    if rows:
        section(None, [decode_table(rows)], notes(opts, rows))
    if append_rows:
        section("append cost (c.append(k_row, v_row), one position per call):",
                [append_table(append_rows)], append_ratio_lines(append_rows))
    if o1_rows:
        section("O(1) Nystrom decode (o1_step on a sealed layer) vs exact attend_all_heads, "
                "one layer:", [o1_table(o1_rows)], o1_notes(opts, o1_rows, res.o1_s))
    if wire_result:
        digests = (f"the digest alone, and the digest functions of each package, over the "
                   f"{fmt(wire_result['digests'][0]['bytes'] / MiB)} MiB f32 export buffer:\n"
                   + wire_digest_table(wire_result["digests"]))
        section("byte formats (kvcache.wire): export / import throughput, one layer:",
                [wire_table(wire_result["rows"]), digests], wire_notes(wire_result))
    if mla_result:
        section("MLA decode (absorbed kernel _core.mla_attend vs naive NumPy "
                "reference.mla_naive), one query position, one layer:",
                [mla_table(mla_result["rows"])], mla_notes(mla_result))
    if sync_rows:
        section("device mirror sync (kvcache.device.Mirror): per decode step vs a full "
                "re-upload, one layer:", [sync_table(sync_rows)], sync_notes(sync_rows, opts))
    if runner_rows:
        section("decode tokens/s: kvcache.runner vs transformers generate, the same "
                "random-weight model and cache contents:", [runner_table(runner_rows)],
                runner_notes(runner_rows, opts))
    if res.store:
        section("prefix store (kvcache.store): time to first token (Runner.prefill) cold vs "
                "a full and a half hit, and the store's I/O:",
                [ttft_table(res.store["ttft"]), io_table(res.store["io"])],
                store_notes(res.store, opts))
    if res.contention:
        section("contention: decode latency next to competing work, kvcache's default thread "
                "count vs forced 1 and forced all threads (median / p99 ms):",
                [contention_table(res.contention)], contention_notes(res.contention, opts))


def options_record(opts: Options) -> dict[str, Any]:
    """The settings of a run, as written to the JSON file."""
    return {"geometries": [g.key for g in opts.geometries],
            "contexts": opts.contexts, "modes": opts.modes,
            "threads": opts.threads, "repeats": opts.repeats, "ref_repeats": opts.ref_repeats,
            "working_set_bytes": opts.working_set, "torch": opts.torch,
            "reference": opts.reference, "seed": opts.seed,
            "decode_section": opts.decode, "append_section": opts.append,
            "o1_section": opts.o1, "o1_contexts": opts.o1_contexts,
            "o1_repeats": opts.o1_repeats, "o1_m": O1_M, "o1_w": O1_W, "o1_sink": O1_SINK,
            "o1_error_steps": O1_ERROR_STEPS, "o1_flush_bytes": O1_FLUSH_BYTES,
            "wire_section": opts.wire, "wire_context": opts.wire_context,
            "wire_repeats": opts.wire_repeats, "wire_save_layers": opts.wire_save_layers,
            "mla_section": opts.mla, "mla_contexts": opts.mla_contexts,
            "mla_repeats": opts.mla_repeats, "mla_naive_repeats": opts.mla_naive_repeats,
            "mla_naive_max_context": opts.mla_naive_max_context,
            "mla_working_set_bytes": opts.mla_working_set, "mla_fma_iters": opts.mla_fma_iters,
            "bandwidth_bytes": opts.bandwidth_bytes,
            "sync_section": opts.sync, "sync_context": opts.sync_context,
            "sync_steps": opts.sync_steps, "sync_full_repeats": opts.sync_full_repeats,
            "sync_backend": opts.sync_backend,
            "runner_section": opts.runner, "runner_contexts": opts.runner_contexts,
            "runner_steps": opts.runner_steps, "runner_model": runner_section.RUNNER_MODEL,
            "store_section": opts.store, "store_contexts": opts.store_contexts,
            "store_repeats": opts.store_repeats,
            "contention_section": opts.contention,
            "contention_contexts": opts.contention_contexts,
            "contention_calls": opts.contention_calls,
            "contention_conditions": opts.contention_conditions,
            "contention_runner_context": opts.contention_runner_context,
            "contention_runner_model": opts.contention_runner_model,
            "contention_prefill_tokens": list(opts.contention_prefill_tokens),
            "contention_prefill_calls": opts.contention_prefill_calls}


def write_json(path: str, res: Results, opts: Options) -> None:
    """The raw results (every sample included) as JSON."""
    wire_result, mla_result = res.wire, res.mla
    payload: dict[str, Any] = {
        "machine": res.info, "options": options_record(opts),
        "bandwidth": {str(n): b for n, b in res.bandwidth.items()},
        "decode": res.decode, "append": res.append, "o1": res.o1}
    if res.o1:
        payload["o1_summary"] = {str(n): v for n, v in o1_summary(res.o1).items()}
        payload["o1_section_s"] = res.o1_s
    if wire_result:
        payload["wire"] = wire_result["rows"]
        payload["wire_digests"] = wire_result["digests"]
        payload["wire_summary"] = wire_result["summary"]
        payload["wire_info"] = {k: v for k, v in wire_result.items()
                                                 if k not in ("rows", "digests", "summary")}
    if mla_result:
        payload["mla"] = mla_result["rows"]
        payload["mla_summary"] = mla_result["summary"]
        payload["mla_info"] = {k: v for k, v in mla_result.items()
                                                if k not in ("rows", "summary")}
    if res.sync:
        payload["sync"] = res.sync
    if res.runner:
        payload["runner"] = res.runner
    if res.store:
        payload["store"] = res.store["ttft"]
        payload["store_io"] = res.store["io"]
        payload["store_summary"] = store_summary(res.store)
        payload["store_info"] = {k: v for k, v in res.store.items() if k not in ("ttft", "io")}
    if res.contention:
        payload["contention"] = res.contention["rows"]
        payload["contention_info"] = {k: v for k, v in res.contention.items() if k != "rows"}
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, default=str)
