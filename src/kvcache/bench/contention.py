"""The contention section: decode latency while other work competes for the cores.

Each cell -- ``attend_all_heads`` of one Llama-3-8B layer (f32, q8) at each context, one
decode step of the runner section's model, and the runner's prefill of a prompt of 512 and
2,048 tokens -- is timed call by call under five conditions:

- ``quiet``: nothing else from this benchmark runs;
- ``spin``: a process the section starts (and stops) keeps one core busy;
- ``numpy``: a 2-thread NumPy matrix product before every timed call (its BLAS workers keep
  spinning after it returns);
- ``pythread``: a Python thread of this process runs NumPy products the whole time;
- ``twoproc``: two worker processes run the same cell at the same time.

and three thread settings side by side, in rotating blocks of calls: kvcache's default
(``adaptive``), ``kvcache.threads(1, adaptive=False)`` and ``kvcache.threads(adaptive=False)``
(all threads the OpenMP limit allows, the behaviour before the adaptive default).  In the
prefill cells the three settings are BLAS's instead (kvcache's own threads stay adaptive):
``default`` is the runner's governed BLAS (``blas_threads=None``), ``forced 1`` one BLAS
thread (``blas_threads=1``), ``forced all`` BLAS left at its own count (``blas_threads=0``, the
runner's prefill before BLAS was governed); one prefill per block.  Each row is checked against
the targets of docs/threads.md.  Method: ``docs/benchmark-method.md``.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ContextManager, Optional

import numpy as np

from .._threads import threads
from ..layer import LayerKvCache
from .geometry import GEOMETRIES, make_mode, random_kv, random_query
from .registry import (
    Context, Option, Result, Section, Values, at_least, one_of, parse_context,
    parse_context_or_zero, register)
from .tables import Row, context_label, fmt, render_table, section_text

if TYPE_CHECKING:
    from .._progress import ProgressBar

CONTENTION_CONTEXTS, QUICK_CONTENTION_CONTEXTS = (1024, 16384), (256,)
CONTENTION_CALLS, QUICK_CONTENTION_CALLS = 200, 10
CONTENTION_RUNNER_CONTEXT, QUICK_CONTENTION_RUNNER_CONTEXT = 512, 64
CONTENTION_PREFILL_TOKENS, QUICK_CONTENTION_PREFILL_TOKENS = (512, 2048), (64,)
PREFILL_CALLS = 6                # prefills per setting (and condition) of a prefill cell
QUICK_PREFILL_CALLS = 2
CONDITIONS = ("quiet", "spin", "numpy", "pythread", "twoproc")
#: The conditions --quick runs: alone, and beside a process that spins one core.
QUICK_CONTENTION_CONDITIONS = ("quiet", "spin")
SETTINGS = ("default", "forced 1", "forced all")
BLOCK = 25                       # calls per setting before the next setting's turn
SETTING_BUDGET_S = 12.0          # a forced setting stops taking turns after this many seconds
                                 # in one cell and condition (forced all threads next to a busy
                                 # core can take 0.5 s a call); the default always completes
PREFILL_SETTING_BUDGET_S = 90.0  # the same for a prefill cell (a 2k prompt next to a busy core
                                 # with BLAS on both cores takes about 15 s)
PRODUCT = 256                    # the interleaved product: (256, 256) @ (256, 256) float32
THREAD_PRODUCT = 384             # the Python thread's products
# targets (docs/threads.md)
SPIN_P99_VS_ONE = 1.5
BUSY_P99_VS_QUIET = 2.0
TWOPROC_SHARE = 0.8
TWOPROC_WORST_VS_MEDIAN = 10.0
QUIET_MEDIAN_VS_BEST = 1.05
PREFILL_SPIN_VS_ONE = 0.9        # prefill, one core busy: tokens/s >= 0.9x one BLAS thread's
PREFILL_QUIET_VS_ALL = 1.05      # prefill, quiet: median <= 1.05x BLAS left at its own count


def setting_block(name: str) -> ContextManager[object]:
    """The thread setting of one column."""
    if name == "default":
        return contextlib.nullcontext()
    if name == "forced 1":
        return threads(1, adaptive=False)
    if name == "forced all":
        return threads(adaptive=False)
    raise ValueError(f"setting: expected one of {SETTINGS}, got {name!r}")


class Cell:
    """One timed call: ``attend_all_heads`` of one layer, or one runner decode step."""

    def __init__(self, kind: str, mode: str, context: int, seed: int = 0,
                 runner_model: str = "bench") -> None:
        self.kind, self.mode, self.context = kind, mode, context
        self.key = f"{kind} {mode} {context_label(context)}"
        if kind == "attend":
            geom = GEOMETRIES["llama3-8b"]
            k, v = random_kv(geom, context, seed)
            self.layer = LayerKvCache(geom.num_kv_heads, geom.head_dim, mode=make_mode(mode))
            self.layer.append(k, v)
            self.q = random_query(geom, seed + 1)
            self.out = np.empty_like(self.q)
            self.call: Callable[[], None] = self._attend
        elif kind == "runner":
            self.runner = make_runner(mode, context, seed, runner_model)
            self.token = 17
            self.steps = 0
            self.call = self._step
        elif kind == "prefill":
            self.runner = make_runner(mode, 0, seed, runner_model,
                                      max_seq_len=context + 64)
            vocab = self.runner.config.vocab_size
            self.ids = np.random.default_rng([seed, context]).integers(0, vocab, context)
            self.call = self._prefill
        else:
            raise ValueError(f"cell kind: expected 'attend', 'runner' or 'prefill', got {kind!r}")

    def _attend(self) -> None:
        self.layer.attend_all_heads(self.q, out=self.out)

    def _step(self) -> None:
        self.token = int(np.argmax(self.runner.step(self.token)))
        self.steps += 1

    def _prefill(self) -> None:
        self.runner.reset()
        self.runner.prefill(self.ids)

    def setting(self, name: str) -> ContextManager[object]:
        """The setting of one column: kvcache's threads, or for a prefill cell BLAS's."""
        if self.kind != "prefill":
            return setting_block(name)
        blas = {"default": None, "forced 1": 1, "forced all": 0}
        if name not in blas:
            raise ValueError(f"setting: expected one of {SETTINGS}, got {name!r}")
        self.runner.blas_threads = blas[name]
        return contextlib.nullcontext()

    def block(self, setting: str, calls: int, before: Optional[Callable[[], None]] = None
              ) -> list[float]:
        """Seconds of ``calls`` timed calls under ``setting`` (``before`` runs untimed ahead
        of each); the runner rolls back afterwards so that its context stays the same."""
        times = []
        with self.setting(setting):
            for _ in range(calls):
                if before is not None:
                    before()
                t0 = time.perf_counter()
                self.call()
                times.append(time.perf_counter() - t0)
        if self.kind == "runner" and self.steps:
            self.runner.truncate_last(self.steps)
            self.steps = 0
        return times


def make_runner(mode: str, context: int, seed: int, model: str,
                max_seq_len: Optional[int] = None) -> Any:
    """A random-weight runner (the runner section's model, or a tiny one for ``model="tiny"``)
    whose cache holds ``context`` random positions."""
    from ..runner import ModelConfig, Runner
    from .runner import RUNNER_MODEL
    cfg = None if model == "tiny" else ModelConfig.from_hf(dict(RUNNER_MODEL, model_type="llama"))
    r = Runner.random(cfg, seed=seed, kv=mode,
                      max_seq_len=max_seq_len or context + 4 * CONTENTION_CALLS)
    rng = np.random.default_rng([seed, context])
    c = r.config
    for layer in r.cache.layers:
        shape = (context, c.num_kv_heads, c.head_dim)
        layer.append(rng.standard_normal(shape, dtype=np.float32),
                     rng.standard_normal(shape, dtype=np.float32))
    r.position = context
    return r


def make_cells(values: Values, seed: int) -> list[Cell]:
    """The section's cells: attention at each context in f32 and q8, then the runner step."""
    cells = [Cell("attend", mode, ctx, seed)
             for ctx in values.contexts for mode in ("f32", "q8")]
    if values.runner_context:
        cells.append(Cell("runner", "f32", values.runner_context, seed, values.runner_model))
    for n in values.prefill_tokens:
        if n:                                               # 0 leaves the prefill cells out
            cells.append(Cell("prefill", "f32", n, seed, values.runner_model))
    return cells


def cell_calls(cell: Cell, calls: int, prefill_calls: int = PREFILL_CALLS) -> tuple[int, int]:
    """(calls per setting, calls per block) of a cell: a prefill cell runs ``prefill_calls``
    one at a time, the others ``calls`` in blocks of :data:`BLOCK`."""
    if cell.kind == "prefill":
        return prefill_calls, 1
    return calls, BLOCK


def rotation(done: int, block: int = BLOCK) -> list[str]:
    """The settings' order in the round that starts after ``done`` calls: each goes first in
    turn, so that none always follows the same one."""
    k = (done // block) % len(SETTINGS)
    return list(SETTINGS[k:] + SETTINGS[:k])


def over_budget(setting: str, times: Sequence[float], kind: str = "attend") -> bool:
    """Whether a forced setting has used up :data:`SETTING_BUDGET_S` (never the default; a
    prefill cell, whose calls take seconds, :data:`PREFILL_SETTING_BUDGET_S`)."""
    budget = PREFILL_SETTING_BUDGET_S if kind == "prefill" else SETTING_BUDGET_S
    return setting != "default" and sum(times) > budget


def run_settings(cell: Cell, calls: int, before: Optional[Callable[[], None]] = None,
                 prefill_calls: int = PREFILL_CALLS) -> dict[str, list[float]]:
    """``calls`` timed calls per setting, in rotating blocks of :data:`BLOCK` (after one
    untimed warm-up call per setting); a forced setting over its budget gets fewer."""
    for s in SETTINGS:
        cell.block(s, 1, before)
    calls, block = cell_calls(cell, calls, prefill_calls)
    out: dict[str, list[float]] = {s: [] for s in SETTINGS}
    done = 0
    while done < calls:
        n = min(block, calls - done)
        for s in rotation(done, block):
            if not over_budget(s, out[s], cell.kind):
                out[s] += cell.block(s, n, before)
        done += n
    return out


def summary(times: Sequence[float]) -> Row:
    """Median, p99, worst (ms) and calls per second of one column."""
    a = np.asarray(times) * 1e3
    return {"median_ms": float(np.median(a)), "p99_ms": float(np.percentile(a, 99)),
            "max_ms": float(a.max()), "per_s": float(len(a) / (a.sum() / 1e3)),
            "calls": len(a)}


@contextlib.contextmanager
def spinner() -> Iterator[None]:
    """A process that keeps one core busy for the duration of the block."""
    p = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)
        yield
    finally:
        p.kill()
        p.wait()


@contextlib.contextmanager
def numpy_thread() -> Iterator[None]:
    """A Python thread doing NumPy products (BLAS at its default threads) for the block."""
    stop = threading.Event()
    rng = np.random.default_rng(3)
    a = rng.standard_normal((THREAD_PRODUCT, THREAD_PRODUCT), dtype=np.float32)

    def work() -> None:
        while not stop.is_set():
            a @ a

    t = threading.Thread(target=work, name="kvcache-bench-numpy", daemon=True)
    t.start()
    try:
        time.sleep(0.05)
        yield
    finally:
        stop.set()
        t.join()


def interleaved_product() -> Callable[[], None]:
    """A 2-thread NumPy matrix product (run before each timed call)."""
    from threadpoolctl import threadpool_limits
    rng = np.random.default_rng(4)
    a = rng.standard_normal((PRODUCT, PRODUCT), dtype=np.float32)

    def product() -> None:
        with threadpool_limits(2, user_api="blas"):
            a @ a
    return product


def run_condition(cond: str, cells: Sequence[Cell], calls: int,
                  prefill_calls: int = PREFILL_CALLS) -> dict[str, dict[str, Row]]:
    """Per cell and setting, the summary of ``calls`` calls under condition ``cond`` (not
    ``twoproc``)."""
    before = interleaved_product() if cond == "numpy" else None
    guard: ContextManager[object] = (spinner() if cond == "spin" else
                                     numpy_thread() if cond == "pythread" else
                                     contextlib.nullcontext())
    res: dict[str, dict[str, Row]] = {}
    with guard:
        for cell in cells:
            times = run_settings(cell, calls, before, prefill_calls)
            res[cell.key] = {s: summary(t) for s, t in times.items()}
            gc.collect()
    return res


# ---------------------------------------------------------------- two processes at once
def worker_main() -> None:
    """A ``twoproc`` worker: builds the cells named on its first stdin line, answers "ready",
    then runs one block per command line ("cell-index setting calls") and answers with the
    times as JSON; stops at an empty line."""
    spec = json.loads(sys.stdin.readline())
    cells = [Cell(kind, mode, ctx, spec["seed"], spec["runner_model"])
             for kind, mode, ctx in spec["cells"]]
    for cell in cells:
        for s in SETTINGS:
            cell.block(s, 1)
    print("ready", flush=True)
    for line in sys.stdin:
        if not line.strip():
            break
        i, setting, calls = json.loads(line)
        print(json.dumps(cells[i].block(setting, calls)), flush=True)


def run_twoproc(cells: Sequence[Cell], calls: int, seed: int, runner_model: str,
                prefill_calls: int = PREFILL_CALLS) -> dict[str, list[dict[str, Row]]]:
    """Two worker processes run every cell's blocks at the same time (each block starts
    in both once both finished the previous one); per cell, per process, per setting."""
    import kvcache
    root = os.path.dirname(os.path.dirname(os.path.abspath(kvcache.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    code = "from kvcache.bench.contention import worker_main; worker_main()"
    spec = {"seed": seed, "runner_model": runner_model,
            "cells": [[c.kind, c.mode, c.context] for c in cells]}
    procs = [subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    try:
        for p in procs:
            assert p.stdin is not None
            p.stdin.write(json.dumps(spec) + "\n")
            p.stdin.flush()
        for p in procs:
            assert p.stdout is not None
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError("contention: a two-process worker failed to start")
        res: dict[str, list[dict[str, Row]]] = {}
        for i, cell in enumerate(cells):
            times: list[dict[str, list[float]]] = [{s: [] for s in SETTINGS} for _ in procs]
            done = 0
            ncalls, block = cell_calls(cell, calls, prefill_calls)
            while done < ncalls:
                n = min(block, ncalls - done)
                for s in rotation(done, block):
                    if any(over_budget(s, t[s], cell.kind) for t in times):
                        continue
                    for p in procs:
                        assert p.stdin is not None
                        p.stdin.write(json.dumps([i, s, n]) + "\n")
                        p.stdin.flush()
                    for p, t in zip(procs, times):
                        assert p.stdout is not None
                        t[s] += json.loads(p.stdout.readline())
                done += n
            res[cell.key] = [{s: summary(t[s]) for s in SETTINGS} for t in times]
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("\n")
            p.stdin.flush()
    finally:
        for p in procs:
            with contextlib.suppress(OSError):
                if p.stdin is not None:
                    p.stdin.close()
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    return res


# ---------------------------------------------------------------- the section
def run_contention(ctx: Context, values: Values, bar: ProgressBar) -> Result:
    """The contention section: every cell under every condition of ``values``."""
    cells = make_cells(values, ctx.seed)
    calls = values.calls
    out: dict[str, Any] = {"calls": calls, "prefill_calls": values.prefill_calls,
                           "cells": [c.key for c in cells],
                           "conditions": list(values.conditions),
                           "cpus": os.cpu_count(), "results": {}}
    for cond in values.conditions:
        bar.set_postfix_str(f"contention {cond}")
        if cond == "twoproc":
            out["results"][cond] = run_twoproc(cells, calls, ctx.seed, values.runner_model,
                                               values.prefill_calls)
        else:
            out["results"][cond] = run_condition(cond, cells, calls,
                                                 values.prefill_calls)
        bar.update()
    out["rows"] = contention_rows(out)
    return out


def _check(ok: Optional[bool]) -> str:
    return "-" if ok is None else ("met" if ok else "NOT met")


def contention_rows(res: dict[str, Any]) -> list[Row]:
    """Per (cell, condition): the three settings' median/p99 and the target's verdict."""
    rows: list[Row] = []
    results = res["results"]
    quiet = results.get("quiet", {})
    for key in res["cells"]:
        solo = quiet.get(key)
        for cond in res["conditions"]:
            r = results[cond][key]
            row: Row = {"cell": key, "condition": cond}
            if cond == "twoproc":
                per = r
                row["settings"] = {s: {"median_ms": max(p[s]["median_ms"] for p in per),
                                       "p99_ms": max(p[s]["p99_ms"] for p in per),
                                       "max_ms": max(p[s]["max_ms"] for p in per),
                                       "calls": min(p[s]["calls"] for p in per)}
                                   for s in SETTINGS}
                if solo is not None and not key.startswith("prefill "):   # prefill: no target
                    share = {s: min(p[s]["per_s"] for p in per) / (solo[s]["per_s"] / 2)
                             for s in SETTINGS}
                    worst = {s: row["settings"][s]["max_ms"] / solo[s]["median_ms"]
                             for s in SETTINGS}
                    row["share_of_half_solo"] = share
                    row["worst_vs_solo_median"] = worst
                    row["target"] = (f">= {TWOPROC_SHARE:.0%} of half solo, worst <= "
                                     f"{TWOPROC_WORST_VS_MEDIAN:g}x solo median")
                    row["met"] = (share["default"] >= TWOPROC_SHARE
                                  and worst["default"] <= TWOPROC_WORST_VS_MEDIAN)
            else:
                row["settings"] = {s: dict(r[s]) for s in SETTINGS}
                d = r["default"]
                if key.startswith("prefill ") and cond in ("quiet", "spin"):
                    if cond == "quiet":
                        row["target"] = (f"median <= {PREFILL_QUIET_VS_ALL:g}x BLAS at its own "
                                         "count (forced all)")
                        row["ratio"] = d["median_ms"] / r["forced all"]["median_ms"]
                        row["met"] = row["ratio"] <= PREFILL_QUIET_VS_ALL
                    else:
                        row["target"] = (f"tokens/s >= {PREFILL_SPIN_VS_ONE:g}x one BLAS "
                                         "thread (forced 1)")
                        row["ratio"] = r["forced 1"]["median_ms"] / d["median_ms"]
                        row["met"] = row["ratio"] >= PREFILL_SPIN_VS_ONE
                elif key.startswith("prefill "):
                    pass                      # reported, no target
                elif cond == "quiet":
                    best = min(r["forced 1"]["median_ms"], r["forced all"]["median_ms"])
                    row["target"] = f"median <= {QUIET_MEDIAN_VS_BEST:g}x best forced"
                    row["ratio"] = d["median_ms"] / best
                    row["met"] = row["ratio"] <= QUIET_MEDIAN_VS_BEST
                elif cond == "spin":
                    row["target"] = f"p99 <= {SPIN_P99_VS_ONE:g}x forced 1"
                    row["ratio"] = d["p99_ms"] / r["forced 1"]["p99_ms"]
                    row["met"] = row["ratio"] <= SPIN_P99_VS_ONE
                elif solo is not None:
                    row["target"] = f"p99 <= {BUSY_P99_VS_QUIET:g}x quiet p99"
                    row["ratio"] = d["p99_ms"] / solo["default"]["p99_ms"]
                    row["met"] = row["ratio"] <= BUSY_P99_VS_QUIET
            rows.append(row)
    return rows


def contention_table(res: dict[str, Any]) -> str:
    """One row per (cell, condition): median / p99 ms of each setting, the target, met."""
    body = []
    for r in res["rows"]:
        full = (res.get("prefill_calls", PREFILL_CALLS) if r["cell"].startswith("prefill ")
                else res["calls"])
        cells = [f"{fmt(r['settings'][s]['median_ms'])} / {fmt(r['settings'][s]['p99_ms'])}"
                 + (f" (n={r['settings'][s]['calls']})" if r["settings"][s]["calls"] < full
                    else "")
                 for s in SETTINGS]
        if "share_of_half_solo" in r:
            sh, wo = r["share_of_half_solo"], r["worst_vs_solo_median"]
            measured = (f"share {sh['default']:.2f} (1: {sh['forced 1']:.2f}, all: "
                        f"{sh['forced all']:.2f}); worst {wo['default']:.1f}x "
                        f"(1: {wo['forced 1']:.1f}x, all: {wo['forced all']:.1f}x)")
        elif "ratio" in r:
            measured = f"{r['ratio']:.2f}x"
        else:
            measured = "-"
        body.append([r["cell"], r["condition"], *cells, r.get("target", "-"), measured,
                     _check(r.get("met"))])
    return render_table(["cell", "condition", "default med/p99 ms", "forced 1 med/p99 ms",
                         "forced all med/p99 ms", "target (default)", "measured", "verdict"],
                        body)


def contention_notes(res: dict[str, Any], values: Values) -> list[str]:
    """Method lines printed under the contention table."""
    return [
        f"{res['calls']} calls per setting and cell, in rotating blocks of {BLOCK} (n=: a "
        f"forced setting stopped after {SETTING_BUDGET_S:g} s of calls); "
        f"attend = LayerKvCache.attend_all_heads, Llama-3-8B layer (8 KV heads x 128, 32 "
        f"query heads); runner = one Runner.step of the runner section's model "
        f"({values.runner_model}), rolled back after each block; prefill = "
        f"Runner.prefill of a prompt of that many tokens (same model), "
        f"{res.get('prefill_calls', PREFILL_CALLS)} per setting, one per block",
        "default = kvcache's adaptive thread count; forced 1 = kvcache.threads(1, "
        "adaptive=False); forced all = kvcache.threads(adaptive=False); in the prefill rows "
        "the settings are BLAS's: default = governed (Runner blas_threads=None), forced 1 = "
        "blas_threads=1, forced all = blas_threads=0 (BLAS at its own count)",
        f"spin: one process in a busy loop; numpy: a 2-thread ({PRODUCT}x{PRODUCT}) float32 "
        f"product before each call; pythread: a Python thread doing ({THREAD_PRODUCT}x"
        f"{THREAD_PRODUCT}) products all along; twoproc: two processes running the same "
        "blocks at once (median/p99 of the slower; share = calls/s of the slower process / "
        "half the quiet calls/s; worst = slowest call / quiet median)",
        f"{res['cpus']} CPUs; targets from docs/threads.md"]


def contention_report(ctx: Context, values: Values, result: Result) -> str:
    """The contention table and its notes."""
    return section_text("contention: decode latency next to competing work, kvcache's default "
                        "thread count vs forced 1 and forced all threads (median / p99 ms):",
                        [contention_table(result)], contention_notes(result, values))


SECTION = register(Section(
    name="contention", order=100,
    help="decode latency quiet, next to a busy core, BLAS products, a NumPy thread and a second "
         "process: kvcache's default vs forced 1 and all threads",
    options=(
        Option("contexts", "contexts of the attention cells", CONTENTION_CONTEXTS, parse_context,
               QUICK_CONTENTION_CONTEXTS, many=True, metavar="T"),
        Option("calls", "timed calls per cell, condition and thread setting", CONTENTION_CALLS,
               at_least(1), QUICK_CONTENTION_CALLS, metavar="N"),
        Option("conditions", f"conditions, any of {', '.join(CONDITIONS)}", CONDITIONS,
               one_of(*CONDITIONS), QUICK_CONTENTION_CONDITIONS, many=True, metavar="C"),
        Option("runner_context", "context of the runner-step cell (0 leaves the cell out)",
               CONTENTION_RUNNER_CONTEXT, parse_context_or_zero, QUICK_CONTENTION_RUNNER_CONTEXT,
               metavar="T"),
        Option("runner_model", "model of the runner and prefill cells: the runner section's "
               "(bench) or a tiny one", "bench", one_of("bench", "tiny"), "tiny", metavar="M"),
        Option("prefill_tokens", "prompt lengths of the runner-prefill cells (0 leaves them "
               "out)", CONTENTION_PREFILL_TOKENS, parse_context_or_zero,
               QUICK_CONTENTION_PREFILL_TOKENS, many=True, metavar="N"),
        Option("prefill_calls", "prefills per setting and condition of a prefill cell",
               PREFILL_CALLS, at_least(1), QUICK_PREFILL_CALLS, metavar="N")),
    tasks=lambda ctx, values: len(values.conditions), run=run_contention,
    report=contention_report))
