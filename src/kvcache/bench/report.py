"""The report of a run, from the sections that ran: the printed text, the JSON file, the charts.

Method (and the JSON file's layout): ``docs/benchmark-method.md``.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from typing import IO, Any

from .geometry import MiB
from .registry import Context, Result, Section, Values, sections
from .tables import fmt, prose
from .timing import BANDWIDTH_BUFFER

Ran = tuple[Section, Values, Result]   # a section, its option values and what it measured


def print_report(info: dict[str, Any], ctx: Context, ran: Sequence[Ran],
                 file: IO[str] | None = None) -> None:
    """The text report: the machine, the bandwidth probe, then each section's text."""
    out = sys.stdout if file is None else file               # at call time (capture, redirect)
    llc = info["llc_bytes_reported"]
    llc_text = f"LLC reported {llc / MiB:.0f} MiB" if llc else "LLC size unknown"
    lines = [f"kvcache {info['kvcache']} benchmark -- {info['cpu_model']}, "
             f"{info['cpu_count']} CPUs, {llc_text}"]
    if info.get("isa_bodies"):
        lines.append(f"kernel bodies: {info['isa_bodies']} (cpu features: "
                     f"{info.get('cpu_features', '?')})")
    other = info.get("other_processes_cores")
    if other is not None:
        lines.append(f"other processes kept {other:.2f} cores busy on average during the run "
                     f"({'quiet' if other <= 0.2 else 'NOT quiet: timings may be inflated'})")
    if ctx.bandwidth:
        lines.append("measured read bandwidth (kvcache._core.stream_read):")
        lines += [f"  {n} thread{'s' if n > 1 else ''}: {b['best_gbs']:.1f} GB/s best "
                  f"({b['median_gbs']:.1f} median) over a "
                  f"{fmt(b.get('buffer_bytes', BANDWIDTH_BUFFER) / MiB)} MiB float32 buffer"
                  for n, b in ctx.bandwidth.items()]
    for line in lines:
        print(prose(line), file=out)
    for section, values, result in ran:
        text = section.report(ctx, values, result)
        if text:
            print(text, file=out)


def json_document(info: dict[str, Any], ctx: Context, ran: Sequence[Ran]) -> dict[str, Any]:
    """The JSON file's content: the machine, the run-wide options, the bandwidth probe and one
    object per section (its options and what it measured)."""
    return {"machine": info,
            "options": {"quick": ctx.quick, "threads": ctx.threads, "seed": ctx.seed,
                        "bandwidth_bytes": ctx.bandwidth_bytes,
                        "sections": [section.name for section, _, _ in ran]},
            "bandwidth": {str(n): b for n, b in ctx.bandwidth.items()},
            "sections": {section.name: {"options": values.record(),
                                        **(section.to_json or dict)(result)}
                         for section, values, result in ran}}


def read_json(doc: Mapping[str, Any]) -> tuple[dict[str, Any], Context, list[Ran]]:
    """What :func:`json_document` wrote, read back: the machine, the run's context and each
    section with its option values and results, so that :func:`print_report` prints the run's
    report again (tools/figures.py writes the docs' benchmark figures this way).  ValueError
    for a section this kvcache does not register."""
    opts = doc["options"]
    ctx = Context(quick=opts["quick"], threads=list(opts["threads"]), seed=opts["seed"],
                  bandwidth_bytes=opts["bandwidth_bytes"],
                  bandwidth={int(n): b for n, b in doc["bandwidth"].items()})
    known = {section.name: section for section in sections()}
    ran: list[Ran] = []
    for name, obj in doc["sections"].items():
        if name not in known:
            raise ValueError(f"the file holds a section {name!r}, which this kvcache does not "
                             f"register")
        result = {k: v for k, v in obj.items() if k != "options"}
        ran.append((known[name], known[name].values(opts["quick"], obj["options"]), result))
    return dict(doc["machine"]), ctx, ran


def write_json(path: str, info: dict[str, Any], ctx: Context, ran: Sequence[Ran]) -> None:
    """The raw results (every sample included) as JSON."""
    with open(path, "w") as f:
        json.dump(json_document(info, ctx, ran), f, indent=1, default=str)


def write_plots(path: str, ctx: Context, ran: Sequence[Ran]) -> list[str]:
    """The chart of every section that draws one: the first at ``path``, the next ones beside
    it (``chart-mla.png``); returns the paths written."""
    stem, ext = os.path.splitext(path)
    written: list[str] = []
    for section, _, result in ran:
        if section.plot is not None and result.get("rows"):
            target = f"{stem}-{section.name}{ext or '.png'}" if written else path
            section.plot(ctx, result, target)
            written.append(target)
    return written
