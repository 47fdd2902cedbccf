"""Every measured figure in README.md and docs/, written from the JSON the measurements wrote.

A page holds its figures in regions::

    <!-- figure: RENDERER FILE [ARG ...] -->
    ...text this script writes...
    <!-- /figure -->

``FILE`` is a JSON file under docs/data/, as ``python -m kvcache bench --json``,
``python -m kvcache eval --json`` or a study script under tools/ wrote it (docs/data/README.md
gives the command behind each file). ``RENDERER`` names a function below that turns the file
into Markdown; ``ARG`` narrows it (the rows to show, ...).

    python tools/figures.py            # rewrite every region from its data
    python tools/figures.py --check    # change nothing; exit 1 naming each stale region

``tests/test_figures.py`` runs the check, so a page whose figures differ from the data, a region
naming a missing file or an unknown renderer fails the suite. A figure cannot go stale without
the test noticing: to change one, change the data (run the measurement again) and rewrite.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import pathlib
import re
import statistics
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "data"

REGION = re.compile(r"(?P<open><!-- figure: (?P<spec>[^>]*?) -->\n)(?P<body>.*?)(?P<close><!-- /figure -->)",
                    re.S)

Renderer = Callable[[Any, Sequence[str]], str]
RENDERERS: dict[str, Renderer] = {}


def renderer(name: str) -> Callable[[Renderer], Renderer]:
    def register(fn: Renderer) -> Renderer:
        RENDERERS[name] = fn
        return fn
    return register


class FigureError(ValueError):
    """A region that cannot be rendered: unknown renderer, missing file, bad argument."""


# ---------------------------------------------------------------------------------------------
# number formats (one place, so every page writes a figure the same way)

def sci(x: float | None, digits: int = 2) -> str:
    """3.21e-2 style; exactly 0 as 0."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if x == 0:
        return "0"
    mant, exp = f"{x:.{digits}e}".split("e")
    return f"{mant}e{int(exp)}"


def kl(x: float | None) -> str:
    """A KL divergence: plain from 1 up, scientific below."""
    if x is not None and x >= 1:
        return f"{x:.2f}"
    return sci(x)


def pct(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{100 * x:.{digits}f}%"


def signed_pct(ratio: float | None, digits: int = 2) -> str:
    """A ratio as a signed change: 1.0085 -> +0.85%."""
    return "-" if ratio is None else f"{100 * (ratio - 1):+.{digits}f}%"


def mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def load(name: str) -> Any:
    path = DATA / name
    if not path.is_file():
        raise FigureError(f"docs/data/{name}: no such file")
    return json.loads(path.read_text(encoding="utf-8"))


def pick(rows: list[dict[str, Any]], key: str, wanted: Sequence[str]) -> list[dict[str, Any]]:
    """The rows whose ``key`` is in ``wanted``, in that order (all rows when it is empty)."""
    if not wanted:
        return rows
    by = {r[key]: r for r in rows}
    missing = [w for w in wanted if w not in by]
    if missing:
        raise FigureError(f"no rows {missing}; the file has {sorted(by)}")
    return [by[w] for w in wanted]


# ---------------------------------------------------------------------------------------------
# python -m kvcache eval --json

def _eval_name(r: dict[str, Any]) -> str:
    name = f"`{r['name']}`"
    if r.get("o1_sealed"):
        name += f" ({len(r['o1_sealed'])} sealed)"
    return name


def _eval_command(doc: dict[str, Any]) -> str:
    configs = ",".join(doc.get("configs") or [r["name"] for r in doc["results"]])
    model = pathlib.PurePath(doc["model"]).name
    text = pathlib.PurePath(doc["text"]).name
    when = f"; kvcache {doc['kvcache']}, {doc['date']}" if "date" in doc else ""
    return (f"`python -m kvcache eval --model {model} --text {text} --prompt-tokens "
            f"{doc['prompt_tokens']} --tokens {doc['tokens']} --configs {configs}`{when}:")


@renderer("eval-table")
def eval_table(doc: Any, args: Sequence[str]) -> str:
    """The quality table of an eval run; ARGs: the configurations to show (default all)."""
    rows = []
    for r in pick(doc["results"], "name", args):
        if r.get("error"):
            rows.append([_eval_name(r), "refused: " + r["error"], "", "", "", "", ""])
            continue
        rows.append([_eval_name(r), f"{r['perplexity']:.4f}", f"{r['ratio']:.4f}",
                     kl(r["mean_kl"]), kl(r["max_kl"]), pct(r["top1"]), mib(r["kv_bytes"])])
    head = ["config", "perplexity", "ratio", "mean KL", "max KL", "top-1", "KV memory"]
    return _eval_command(doc) + "\n\n" + table(head, rows)


@renderer("eval-lines")
def eval_lines(doc: Any, args: Sequence[str]) -> str:
    """One bullet per configuration: mean KL, perplexity change, top-1, KV memory."""
    out = []
    for r in pick(doc["results"], "name", args):
        out.append(f"- `{r['name']}`: mean KL {kl(r['mean_kl'])}, perplexity "
                   f"{signed_pct(r['ratio'])}, top-1 {pct(r['top1'])}, KV memory "
                   f"{mib(r['kv_bytes'])}")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# tools/q8_scheme_study.py and tools/kv4_scheme_study.py --json

def _study_rows(doc: Any, args: Sequence[str]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = doc["rows"]
    if not args:
        return [r for r in rows if not r["scheme"].startswith("check")]
    return [r for r in rows if any(r["scheme"].startswith(a) for a in args)]


@renderer("study-table")
def study_table(doc: Any, args: Sequence[str]) -> str:
    """A scheme study's table; ARGs: scheme label prefixes to show (default all but checks)."""
    bytes_col = "bytes_f16" in doc["rows"][0]
    rows = []
    for r in _study_rows(doc, args):
        row = [r["scheme"], kl(r["mean_kl"]), kl(r["max_kl"]), f"{r['ppl_ratio']:.5f}",
               pct(r["top1"], 2)]
        if bytes_col and r["scheme"].startswith("check"):
            row += ["-", "-"]                  # nothing quantised: no storage to count
        elif bytes_col:
            row += [f"{r['bytes_f16']:.0f} ({r['bytes_f32']:.0f})",
                    f"{4 * 2 * 128 / r['bytes_f16']:.1f}x"]
        rows.append(row)
    head = ["scheme", "mean KL", "max KL", "perplexity ratio", "top-1"]
    if bytes_col:
        head += ["K+V bytes/row at head_dim 128, f16 params (f32)", "vs float32"]
    text = pathlib.PurePath(str(doc["text"]).split(" (")[0]).name
    return (f"{doc['tokens']} tokens of `{text}`, float32 perplexity {float(doc['f32_ppl']):.3f}:"
            "\n\n" + table(head, rows))


# ---------------------------------------------------------------------------------------------
# python -m kvcache bench --json

def bench_section(doc: Any, name: str) -> dict[str, Any]:
    sections = doc.get("sections", {})
    if name not in sections:
        raise FigureError(f"the benchmark run has no section {name!r} (it has {sorted(sections)})")
    section: dict[str, Any] = sections[name]
    return section


def bench_machine(doc: Any) -> str:
    """One line: the CPU, the bodies, how busy the machine was, the date."""
    m = doc["machine"]
    busy = m.get("other_processes_cores")
    load = "" if busy is None else f", other processes {busy:.2f} cores busy on average"
    cpu = m.get("cpu_model") or m.get("cpu") or "CPU"
    return (f"kvcache {m.get('kvcache')}, {cpu}, {m.get('cpu_count', '?')} CPUs, "
            f"features {m.get('cpu_features', '?')}{load}; {m.get('date', '')}").rstrip("; ")


@renderer("bench-report")
def bench_report(doc: Any, args: Sequence[str]) -> str:
    """What the benchmark printed for one section (its machine header included), printed again
    from the JSON by the benchmark's own report (``kvcache.bench.report.read_json``)."""
    if len(args) != 1:
        raise FigureError("bench-report takes one argument, the section's name")
    from kvcache.bench import report

    bench_section(doc, args[0])
    info, ctx, ran = report.read_json(doc)
    out = io.StringIO()
    report.print_report(info, ctx, [r for r in ran if r[0].name == args[0]], file=out)
    return f"```text\n{out.getvalue().rstrip()}\n```"


@renderer("bench-modes")
def bench_modes(doc: Any, args: Sequence[str]) -> str:
    """Decode ms per step of each mode side by side, and the ratios between them."""
    rows = bench_section(doc, "decode")["rows"]
    modes = [m for m in ("f32", "q8", "q4", "k8v4") if any(r["mode"] == m for r in rows)]
    cells: dict[tuple[str, int, int], dict[str, Any]] = {}
    for r in rows:
        cells.setdefault((r["geometry"], r["context"], r["threads"]), {})[r["mode"]] = r
    pairs = [(a, b) for a, b in (("q8", "f32"), ("q4", "q8"), ("q4", "f32"), ("k8v4", "q8"))
             if a in modes and b in modes]

    def speedup(cell: dict[str, Any], a: str, b: str) -> str:
        if a not in cell or b not in cell:
            return "-"
        # the row's own (paired, in files that time the modes side by side), else of medians
        x = cell[a].get(f"speedup_vs_{b}", cell[b]["kvcache_ms"] / cell[a]["kvcache_ms"])
        return f"{x:.2f}x"

    out = []
    for (geometry, context, threads), cell in cells.items():
        out.append([geometry, f"{context // 1024}k", str(threads)]
                   + [f"{cell[m]['kvcache_ms']:.2f}" if m in cell else "-" for m in modes]
                   + [speedup(cell, a, b) for a, b in pairs])
    head = (["geometry", "context", "threads"] + [f"{m} ms" for m in modes]
            + [f"{a} vs {b}" for a, b in pairs])
    return bench_machine(doc) + ":\n\n" + table(head, out)


@renderer("bench-prefill-modes")
def bench_prefill_modes(doc: Any, args: Sequence[str]) -> str:
    """Prompt attention of each mode against float32 and SDPA, from the prefill section."""
    attention = bench_section(doc, "prefill")["attention"]
    modes = [m for m in ("f32", "q8", "q4", "k8v4") if any(m in r for r in attention)]
    out = []
    for r in attention:
        f32 = r["f32"]["s"] if not r["f32"].get("skipped") else None
        row = [r["geometry"], f"{r['context'] // 1024}k"]
        row += [f"{r[m]['s']:.3f}" if m in r and not r[m].get("skipped") else "-" for m in modes]
        # the row's own ratios (paired in files that time the cells side by side)
        row += [f"{r[f'{m}_vs_f32']:.2f}x" if f32 and m in r and not r[m].get("skipped") else "-"
                for m in modes if m != "f32"]
        sdpa = r.get("sdpa", {})
        row.append(f"{r['vs_sdpa']['f32']:.2f}x" if f32 and sdpa and not sdpa.get("skipped")
                   else "-")
        out.append(row)
    head = (["geometry", "prompt"] + [f"{m} s" for m in modes]
            + [f"{m} vs f32" for m in modes if m != "f32"] + ["f32 vs SDPA"])
    return bench_machine(doc) + ":\n\n" + table(head, out)


@renderer("bench-ab")
def bench_ab(doc: Any, args: Sequence[str]) -> str:
    """An interleaved A/B of two source trees: each cell's times per tree, in run order, and
    the ratio of the medians (after / before: below 1 the change is faster)."""
    cells: dict[tuple[str, int, str, int], dict[str, list[float]]] = {}
    for run in doc["runs"]:
        for r in run["rows"]:
            key = (r["geometry"], r["context"], r["mode"], r.get("threads", 0))
            cells.setdefault(key, {"before": [], "after": []})[run["tree"]].append(r["ms"])
    several = len({key[3] for key in cells}) > 1     # name the thread count only then
    out = []
    for (geometry, context, mode, threads), t in cells.items():
        out.append([geometry, f"{context // 1024}k {mode}" + (f" {threads}t" if several else ""),
                    ", ".join(f"{x:.3f}" for x in t["before"]),
                    ", ".join(f"{x:.3f}" for x in t["after"]),
                    f"{statistics.median(t['after']) / statistics.median(t['before']):.2f}x"])
    dates = sorted(run["date"] for run in doc["runs"])
    busy = max(run["other_processes_cores"] for run in doc["runs"])
    head = ["geometry", "cell", "before ms", "after ms", "after / before (medians)"]
    return (f"`{doc['command']}`, {doc['trees']['before']} (before) and "
            f"{doc['trees']['after']} (after) taking turns, {dates[0]} to {dates[-1]}, "
            f"{doc['machine']['cpu_model']}, {doc['machine']['cpu_count']} CPUs, other processes "
            f"at most {busy:.2f} cores busy:\n\n" + table(head, out))


@renderer("ab-forms")
def ab_forms(doc: Any, args: Sequence[str]) -> str:
    """Two forms of one kernel alternating in one process: per cell the median and range over
    rounds of each round's old / new time (above 1 the new form is faster), and whether the two
    gave the same bits."""
    out = [[r["body"], f"{r['geometry']} {r['context'] // 1024}k {r['mode']} {r['threads']}t",
            f"{r['layers']} x {r['rounds']}", f"{r['speedup_median']:.2f}x",
            f"{r['speedup_min']:.2f}-{r['speedup_max']:.2f}x", "yes" if r["same_bits"] else "no"]
           for r in doc["rows"]]
    head = ["body", "cell", "layers x rounds", "old / new (median)", "range", "same bits"]
    return (f"{doc['machine']['cpu_model']}, {doc['machine']['cpu_count']} CPUs, "
            f"{doc['date']}:\n\n" + table(head, out))


@renderer("prompt-pair")
def prompt_pair(doc: Any, args: Sequence[str]) -> str:
    """Two trees taking turns, each run timing q4 against f32 in one process: per cell and run,
    the median over rounds of the paired f32 / q4 ratio, with and without importance."""
    cells = list(doc["runs"][0]["res"])
    head = ["cell"] + [f"{run['tree']} (run {i + 1})" for i, run in enumerate(doc["runs"])]
    out = [[cell] + [f"{run['res'][cell]['q4/f32']:.2f}x / {run['res'][cell]['q4/f32 noimp']:.2f}x"
                     for run in doc["runs"]] for cell in cells]
    return (f"{doc['machine']['cpu_model']}, {doc['machine']['cpu_count']} CPUs, {doc['date']}; "
            "q4's speed against f32 with importance / without:\n\n" + table(head, out))


# ---------------------------------------------------------------------------------------------
# tools/blas_row_bits.py --json

def _blas_libs(doc: Any) -> str:
    return ", ".join(f"{api} {version} ({arch})" for api, version, arch in doc["blas"])


def _shape_thread_table(entries: Sequence[Any], cell: Any) -> str:
    """A table of tools/blas_row_bits.py results: a row per product shape, a column per BLAS
    thread count, ``cell(entry)`` in each."""
    threads = sorted({d["threads"] for d in entries})
    shapes: dict[tuple[int, int], dict[int, Any]] = {}
    for d in entries:
        shapes.setdefault(tuple(d["shape"]), {})[d["threads"]] = d
    rows = [[f"({k}, {n})"] + [cell(by[t]) for t in threads] for (k, n), by in shapes.items()]
    head = ["shape (k, n)"] + [f"{t} thread{'s' if t > 1 else ''}" for t in threads]
    return table(head, rows)


@renderer("blas-bits")
def blas_bits(doc: Any, args: Sequence[str]) -> str:
    """Per product shape and BLAS thread count, the blocks whose rows differ from 64-row chunks."""
    blocks = ", ".join(f"{lo}:{hi}" for lo, hi in doc["blocks"])
    return (f"{_blas_libs(doc)}, {doc['date']}; blocks tried: {blocks}. Blocks whose rows differ "
            f"from the same rows in 64-row chunks:\n\n"
            + _shape_thread_table(doc["differ"], lambda d: ", ".join(
                f"{lo}:{hi}" for lo, hi in d["blocks"]) or "none"))


@renderer("blas-tiles")
def blas_tiles(doc: Any, args: Sequence[str]) -> str:
    """Per product shape and BLAS thread count, the tile sizes t whose blocks of whole tiles at
    multiples of t give every row the bits of t-row chunks, and those whose shifted block does."""
    if not doc.get("tiles"):
        raise FigureError("blas-tiles: the file has no tile results (an older run of "
                          "tools/blas_row_bits.py)")

    def cell(d: Any) -> str:
        a = ", ".join(map(str, d["aligned"])) or "none"
        return a + ("" if not d["shifted"] else f"; shifted: {', '.join(map(str, d['shifted']))}")
    sizes = ", ".join(map(str, doc.get("tile_sizes", [8, 16, 24, 32, 48, 64])))
    return (f"{_blas_libs(doc)}, {doc['date']}. Of the tile sizes t tried ({sizes}), those whose "
            f"blocks of whole tiles at multiples of t gave every row the bits of t-row chunks "
            f"(and, after \"shifted:\", those whose block of four tiles starting 5 rows later "
            f"did):\n\n" + _shape_thread_table(doc["tiles"], cell))


@renderer("blas-speed")
def blas_speed(doc: Any, args: Sequence[str]) -> str:
    """The one-thread speed of 64-row chunks against larger blocks."""
    parts = [f"blocks of {s['block']} rows {s['gflops']:.0f} GFLOP/s" for s in doc["speed"]]
    first, last = doc["speed"][0], doc["speed"][-1]
    k, n = first["shape"]
    return (f"One thread, ({k}, {n}), medians of {len(first['samples_s'])}: "
            + ", ".join(parts) + f" ({last['gflops'] / first['gflops']:.2f}x).")


# ---------------------------------------------------------------------------------------------

def regions(text: str) -> Iterator[re.Match[str]]:
    return REGION.finditer(text)


def render(spec: str) -> str:
    words = spec.split()
    if len(words) < 2:
        raise FigureError(f"figure '{spec}': expected RENDERER FILE [ARG ...]")
    name, file, args = words[0], words[1], words[2:]
    if name not in RENDERERS:
        raise FigureError(f"figure '{spec}': unknown renderer {name!r} "
                          f"(known: {', '.join(sorted(RENDERERS))})")
    return RENDERERS[name](load(file), args).rstrip("\n") + "\n"


def rewrite(text: str) -> str:
    return REGION.sub(lambda m: m["open"] + render(m["spec"]) + m["close"], text)


def pages() -> list[pathlib.Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def stale() -> list[str]:
    """'page: spec' for each region whose text differs from its rendering."""
    out = []
    for page in pages():
        for m in regions(page.read_text(encoding="utf-8")):
            if m["body"] != render(m["spec"]):
                out.append(f"{page.relative_to(ROOT)}: {m['spec']}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="change nothing; exit 1 naming each region that differs from its data")
    args = ap.parse_args(argv)
    try:
        if args.check:
            bad = stale()
            for line in bad:
                print(f"stale: {line}")
            return 1 if bad else 0
        for page in pages():
            text = page.read_text(encoding="utf-8")
            new = rewrite(text)
            if new != text:
                page.write_text(new, encoding="utf-8")
                print(f"rewrote {page.relative_to(ROOT)}")
    except FigureError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
