"""The prefill section: prompt attention against torch SDPA and the FMA peak, and time to first
token of ``kvcache.runner`` against transformers.

(a) Attention alone.  Per layer geometry (Llama-3-8B 32/8x128, Qwen2.5-0.5B 14/2x64) and prompt
length T (1k, 4k, 16k, or ``--prefill-contexts``): K/V rows of T positions are appended to a
:class:`kvcache.LayerKvCache` (f32, q8), then one ``attend_all_heads`` call computes all T
queries causally; torch's ``scaled_dot_product_attention(q, k, v, is_causal=True,
enable_gqa=True)`` computes the same data.  Reported: seconds per call, GFLOP/s
(``4 * num_heads * head_dim * T(T+1)/2`` flops: a multiply-add of the scores and one of the
output per visible row and head), % of the FMA peak probed with ``_core.fma_probe`` (2 flops
per FMA), the ratio to SDPA and q8/f32, and the largest difference of kvcache's output from
SDPA's (checked against a tolerance per mode).  All threads.  The first call of a cell is
timed; more follow (up to ``repeats``) while the cell has spent less than
:data:`PREFILL_CELL_S`; a cell whose first call is estimated (from the rate
measured at the previous length) above :data:`PREFILL_MAX_CALL_S` is not run and reported as
skipped, with the estimate.

(b) Time to first token.  The runner section's random-weight Llama-style model
(:data:`kvcache.bench.runner.RUNNER_MODEL`, or :data:`PREFILL_MODEL`) in transformers (sdpa)
and in :class:`kvcache.runner.Runner` (the same float32 weights, f32 and q8 KV): per prompt
length (512, 2k, 4k), the median of ``ttft_repeats`` runs of ``Runner.prefill(ids)`` against
transformers' ``model(ids, logits_to_keep=1)`` under ``torch.no_grad()`` (a prefill filling a
new ``DynamicCache``, whose logits give the first token), the ratio runner / transformers and
whether it meets the target :data:`TTFT_TARGET` (at 2k and more), and the largest logit
difference of the runner f32 from transformers.

Method: ``docs/benchmark-method.md``.
"""

from __future__ import annotations

import gc
import logging
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .geometry import F32, GEOMETRIES, Geometry
from .machine import available_cpus, import_torch, package_version
from .registry import Context, Option, Result, Section, Values, at_least, parse_context
from .registry import parse_geometry, parse_mode
from .registry import register
from .tables import Row, context_label, fmt, fmt_ratio, render_table, section_text
from .._threads import threads as kvcache_threads
from .timing import omp_threads, paired_ratio, rotated, time_interleaved

if TYPE_CHECKING:
    from .._progress import ProgressBar

log = logging.getLogger("kvcache.bench")

PREFILL_CONTEXTS, QUICK_PREFILL_CONTEXTS = (1024, 4096, 16384), (512, 1024)
TTFT_CONTEXTS, QUICK_TTFT_CONTEXTS = (512, 2048, 4096), (256,)
PREFILL_REPEATS, QUICK_PREFILL_REPEATS = 3, 1
TTFT_REPEATS, QUICK_TTFT_REPEATS = 3, 1
PREFILL_MODES = ("f32", "q8")
#: The 4-bit modes timed in part (a) too (docs/kv4.md), each against f32.
PREFILL_4BIT = ("q4", "k8v4")
#: A cell stops repeating once its calls have taken this long (the first call always runs).
PREFILL_CELL_S = 20.0
#: A cell whose first call is estimated to take longer is skipped (and reported as such).
PREFILL_MAX_CALL_S = 120.0
#: A cell whose call is estimated to take less is called once untimed before its rounds:
#: from the previous length's rate, else from the probed FMA peak at this share of it.
PREFILL_WARMUP_S, PREFILL_WARMUP_SHARE = 2.0, 0.25
#: A time-to-first-token prompt length stops taking new prompts once they took this long.
TTFT_CELL_S = 90.0
#: What the notes say of rows whose cells were timed side by side (rows with "paired").
PAIRED_NOTE = ("; the cells of a row ran side by side, one call each per round, and a ratio is "
               "the median over rounds of that round's ratio")
#: Largest |kvcache - SDPA| of an output element accepted per KV mode (q8 stores int8 rows).
PREFILL_TOL = {"f32": 1e-4, "q8": 0.1, "q4": 0.5, "k8v4": 0.25}
#: The target marked: runner time to first token <= 1.0 x transformers' at 2k and more (the
#: time-to-first-token issue's; the prefill section's first issue asked for 0.8).
TTFT_TARGET = 1.0
TTFT_TARGET_FROM = 2048
#: The TTFT model (transformers ``LlamaConfig`` keys); None: the runner section's RUNNER_MODEL.
PREFILL_MODEL: dict[str, int] | None = None
#: FMA-peak probe iterations (x 80 FMAs per thread).
FMA_ITERS, QUICK_FMA_ITERS = 10_000_000, 2_000_000


@dataclass
class PrefillSettings:
    """The sizes of one run of the section (:func:`settings_of` gives the defaults)."""

    geometries: Sequence[Geometry]
    contexts: Sequence[int] = PREFILL_CONTEXTS
    repeats: int = PREFILL_REPEATS
    ttft_contexts: Sequence[int] = TTFT_CONTEXTS
    ttft_repeats: int = TTFT_REPEATS
    cell_s: float | None = PREFILL_CELL_S          # None: no time budget (--prefill-repeats)
    max_call_s: float = PREFILL_MAX_CALL_S
    fma_iters: int = FMA_ITERS
    ttft_cell_s: float | None = TTFT_CELL_S    # None: no time budget (--prefill-ttft-repeats)
    four_bit: Sequence[str] = ()       # the 4-bit modes of --modes, timed in part (a)


def settings_of(values: Values, quick: bool) -> PrefillSettings:
    """The section's sizes for a run: the geometries of ``--prefill-geometries`` (both by
    default, Llama-3-8B alone with ``--quick``), the 4-bit modes of ``--prefill-modes``, the
    prompt lengths of ``--prefill-contexts`` (else the full or the ``--quick`` ones), the full
    or the ``--quick`` repeats."""
    geoms = [GEOMETRIES[key] for key in values.geometries]
    four = tuple(m for m in PREFILL_4BIT if m in values.modes)
    given = tuple(values.contexts or ())
    if quick:
        cfg = PrefillSettings(geoms, given or QUICK_PREFILL_CONTEXTS, QUICK_PREFILL_REPEATS,
                              QUICK_TTFT_CONTEXTS, QUICK_TTFT_REPEATS,
                              fma_iters=QUICK_FMA_ITERS, four_bit=four)
    else:
        cfg = PrefillSettings(geoms, given or PREFILL_CONTEXTS, four_bit=four)
    if values.repeats is not None:          # asked for: that many rounds, no time budget
        cfg.repeats, cfg.cell_s = values.repeats, None
    if values.ttft_repeats is not None:
        cfg.ttft_repeats, cfg.ttft_cell_s = values.ttft_repeats, None
    return cfg


def attention_flops(geom: Geometry, context: int) -> float:
    """Flops of causal prompt attention over ``context`` positions: 2 multiply-adds (QK and
    PV) per visible row, head and channel."""
    return 4.0 * geom.num_heads * geom.head_dim * context * (context + 1) / 2


def _cells(calls: Mapping[str, Callable[[], Any]], repeats: int, budget_s: float | None,
           clock: Callable[[], float] = time.perf_counter
           ) -> tuple[dict[str, list[float]], dict[str, Any]]:
    """Seconds of every call of ``calls`` side by side (:func:`time_interleaved`, no warm-up
    here: :func:`attention_rows` warms up the short cells):
    a first round calls each once, more rounds follow (up to ``repeats``) while all the calls
    so far have taken less than ``budget_s`` per call name (None: all ``repeats`` rounds);
    and each name's last output."""
    outs: dict[str, Any] = {}

    def keeping(name: str, fn: Callable[[], Any]) -> Callable[[], None]:
        def call() -> None:
            outs[name] = fn()
        return call

    def go_on(samples: dict[str, list[float]]) -> bool:
        return budget_s is None or sum(map(sum, samples.values())) < budget_s * len(samples)

    gc.collect()
    samples = time_interleaved({name: keeping(name, fn) for name, fn in calls.items()},
                               repeats, warmup=0, go_on=go_on, clock=clock)
    return samples, outs


class PromptAttention:
    """Random prompt data of one geometry and length: Q (T, heads, hd), K/V (T, kv heads, hd)."""

    def __init__(self, geom: Geometry, context: int, seed: int) -> None:
        rng = np.random.default_rng([seed, context, geom.num_heads])
        self.geom, self.context = geom, context
        self.q: F32 = rng.standard_normal((context, geom.num_heads, geom.head_dim),
                                          dtype=np.float32)
        self.k: F32 = rng.standard_normal((context, geom.num_kv_heads, geom.head_dim),
                                          dtype=np.float32)
        self.v: F32 = rng.standard_normal((context, geom.num_kv_heads, geom.head_dim),
                                          dtype=np.float32)
        self.scale = geom.head_dim ** -0.5

    def kvcache(self, mode: str) -> Callable[[], F32]:
        """A layer in ``mode`` holding the K/V rows; the returned call attends all queries.

        ``mode`` ``"f32_noimp"`` / ``"q8_noimp"``: an f32 / q8 layer with
        ``track_importance`` False, whose prompt kernel does no importance work: the same work
        as SDPA's (the runner's layers are so).  The other modes track importance, as a layer
        does by default."""
        from ..layer import LayerKvCache
        from ..modes import KvMode
        g = self.geom
        base, _, tail = mode.partition("_")
        bare = tail == "noimp"
        layer = LayerKvCache(g.num_kv_heads, g.head_dim, KvMode.parse(base))
        layer.track_importance = not bare          # False: the kernel skips its importance pass
        layer.append(self.k, self.v)
        out = np.empty_like(self.q)
        kwargs = prompt_kwargs()

        def call() -> F32:
            layer.attend_all_heads(self.q, scale=self.scale, out=out, **kwargs)
            return out
        return call

    def sdpa(self, torch: Any, F: Any) -> Callable[[], F32]:
        """torch SDPA on the same data (contiguous (1, heads, T, hd) tensors), output as
        (T, heads, hd)."""
        def t(a: F32) -> Any:
            return torch.from_numpy(np.ascontiguousarray(a.transpose(1, 0, 2)))[None]
        q, k, v = t(self.q), t(self.k), t(self.v)

        def call() -> F32:
            with torch.no_grad():
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                                   enable_gqa=True)
            out: F32 = o[0].transpose(0, 1).numpy()
            return out
        return call


def prompt_kwargs() -> dict[str, Any]:
    """``{"prefill": True}`` when ``LayerKvCache.attend_all_heads`` takes ``prefill`` (its
    kernel for prompts), else ``{}``: the section measures the prompt kernel when there is one."""
    import inspect

    from ..layer import LayerKvCache
    params = inspect.signature(LayerKvCache.attend_all_heads).parameters
    return {"prefill": True} if "prefill" in params else {}


def measure_fma_gflops(threads: int, iters: int = FMA_ITERS, repeats: int = 5) -> float:
    """The probed float32 peak in GFLOP/s (2 flops per FMA) on ``threads`` threads."""
    from .mla import measure_fma_peak
    peak = measure_fma_peak([threads], iters, repeats)
    return 2.0 * float(peak[threads]["best_gfmas"])


def attention_rows(cfg: PrefillSettings, seed: int, bar: ProgressBar,
                   peak_gflops: float) -> list[Row]:
    """Part (a): one row per geometry and prompt length (kvcache f32, q8 and SDPA cells)."""
    torch, F = import_torch()
    if torch is None:
        log.warning("prefill section: torch is not installed: no SDPA comparison")
    threads = available_cpus()
    rows: list[Row] = []
    rate: dict[tuple[str, str], float] = {}          # (geometry, impl) -> last flops/s
    for geom in cfg.geometries:
        for context in cfg.contexts:
            bar.set_postfix_str(f"prefill {geom.key} {context_label(context)}")
            flops = attention_flops(geom, context)
            repeats = cfg.repeats
            data = PromptAttention(geom, context, seed)
            rec: Row = {"geometry": geom.key, "context": context, "flops": flops,
                        "threads": threads}
            names = [*PREFILL_MODES, *cfg.four_bit, "f32_noimp", "q8_noimp",
                     *(["sdpa"] if torch is not None else [])]
            calls: dict[str, Callable[[], F32]] = {}
            warm: list[str] = []
            for name in names:
                est = flops / rate[geom.key, name] if (geom.key, name) in rate else None
                if est is not None and est > cfg.max_call_s:
                    rec[name] = {"skipped": True, "estimated_s": est}
                    continue
                calls[name] = data.sdpa(torch, F) if name == "sdpa" else data.kvcache(name)
                if (est if est is not None
                        else flops / (PREFILL_WARMUP_SHARE * peak_gflops * 1e9)) < PREFILL_WARMUP_S:
                    warm.append(name)
            # every thread, as the targets are stated (no adaptive count); the cells
            # side by side, round by round, so that their ratios are paired; a short cell is
            # called once untimed first (its first call's page faults and pool start-up weigh
            # most on it)
            with omp_threads(threads), kvcache_threads(adaptive=False):
                for name in warm:
                    calls[name]()
                timed, last = _cells(calls, repeats, cfg.cell_s)
            rec["warmed_up"] = warm
            outs: dict[str, F32] = last            # the last call's outputs, not copied
            del calls, last
            for name, samples in timed.items():
                med = statistics.median(samples)
                rate[geom.key, name] = flops / med
                rec[name] = {"skipped": False, "s": med, "gflops": flops / med / 1e9,
                             "pct_peak": 100 * flops / med / 1e9 / peak_gflops,
                             "samples_s": samples}
            for m in PREFILL_MODES:                  # importance never changes an output
                if f"{m}_noimp" in outs and m in outs:
                    rec[f"{m}_noimp"][f"same_as_{m}"] = bool(np.array_equal(
                        outs[m], outs[f"{m}_noimp"]))
            if "sdpa" in outs:
                for mode in (*PREFILL_MODES, *cfg.four_bit):
                    if mode in outs:
                        diff = float(np.abs(outs[mode] - outs["sdpa"]).max())
                        rec[mode]["max_abs_diff"] = diff
                        rec[mode]["matches"] = diff <= PREFILL_TOL[mode]
            rec["paired"] = True                  # the ratios pair the rounds (_ratio)
            rec["vs_sdpa"] = {m: _ratio(rec, "sdpa", m)
                              for m in (*PREFILL_MODES, "f32_noimp", "q8_noimp")}
            rec["q8_noimp_vs_f32_noimp"] = _ratio(rec, "f32_noimp", "q8_noimp")
            rec["q8_vs_f32"] = _ratio(rec, "f32", "q8")
            for mode in cfg.four_bit:
                rec[f"{mode}_vs_f32"] = _ratio(rec, "f32", mode)
            rows.append(rec)
            del data, outs
            gc.collect()
            bar.update()
    return rows


def _ratio(rec: Row, slow: str, fast: str) -> float | None:
    """Speed of ``fast`` over ``slow`` (time of slow / time of fast), paired round by round
    (:func:`paired_ratio`); None when one is missing or skipped."""
    a, b = rec.get(slow), rec.get(fast)
    if not a or not b or a.get("skipped") or b.get("skipped"):
        return None
    return paired_ratio(a["samples_s"], b["samples_s"])


def ttft_rows(cfg: PrefillSettings, seed: int, bar: ProgressBar) -> tuple[list[Row], str]:
    """Part (b): per prompt length, the runner (f32, q8) and transformers' prefill; and why
    it was not measured ("" when it was)."""
    from . import runner as runner_section
    try:
        work = runner_section.RunnerVsTransformers(PREFILL_MODEL, seed=seed)
    except ImportError as exc:
        return [], f"it needs torch and transformers ({exc})"
    torch = work.torch
    rows: list[Row] = []
    vocab = int(work.cfg.vocab_size)
    runners = {mode: work.runner_class(work.rcfg, work.weights, kv=mode,
                                  max_seq_len=max(*cfg.ttft_contexts, 128))
               for mode in PREFILL_MODES}
    for r in runners.values():                    # warm-up: thread pools, first pages
        r.prefill(np.zeros(min(2 * r.prefill_chunk, r.max_seq_len), dtype=np.int64))
        r.reset()
    for context in cfg.ttft_contexts:
        bar.set_postfix_str(f"prefill ttft {context_label(context)}")
        samples: dict[str, list[float]] = {m: [] for m in (*PREFILL_MODES, "transformers")}
        diff = 0.0
        spent = 0.0
        for rep in range(cfg.ttft_repeats):
            if rep and cfg.ttft_cell_s is not None and spent >= cfg.ttft_cell_s:
                break
            ids = np.random.default_rng([seed, context, rep]).integers(0, vocab, context)
            first: dict[str, Any] = {}
            hf = None
            for side in rotated([*runners, "transformers"], rep):  # in turn, rotated per prompt
                gc.collect()
                if side == "transformers":
                    tokens = torch.from_numpy(ids)[None]
                    with torch.no_grad():
                        t0 = time.perf_counter()
                        out = work.model(tokens, use_cache=True, logits_to_keep=1)
                        samples[side].append(time.perf_counter() - t0)
                    hf = out.logits[0, -1].numpy()
                    del out
                    continue
                r = runners[side]
                r.reset()
                t0 = time.perf_counter()
                first[side] = r.prefill(ids)
                samples[side].append(time.perf_counter() - t0)
                r.reset()
            assert hf is not None
            spent += sum(v[-1] for v in samples.values())
            diff = max(diff, float(np.abs(first["f32"] - hf).max()))
        med = {k: statistics.median(v) for k, v in samples.items()}
        rec: Row = {"context": context, "repeats": len(samples["transformers"]), "paired": True,
                    "max_abs_logit_diff": diff,
                    "transformers": {"s": med["transformers"],
                                     "samples_s": samples["transformers"]}}
        for mode in PREFILL_MODES:
            ratio = paired_ratio(samples[mode], samples["transformers"])   # runner / hf
            rec[mode] = {"s": med[mode], "samples_s": samples[mode], "vs_transformers": ratio,
                         "target_met": (ratio <= TTFT_TARGET) if context >= TTFT_TARGET_FROM
                         else None}
        rows.append(rec)
        gc.collect()
        bar.update()
    return rows, ""


def run_prefill(ctx: Context, values: Values, bar: ProgressBar) -> Result:
    """The prefill section: ``{"attention": rows, "ttft": rows, "peak_gflops": ...,
    "threads": ..., "ttft_skipped": why not measured or "", "torch": version or None,
    "settings": ...}``."""
    cfg = settings_of(values, ctx.quick)
    seed = ctx.seed
    threads = available_cpus()
    bar.set_postfix_str("prefill FMA probe")
    peak = measure_fma_gflops(threads, cfg.fma_iters)
    torch, _ = import_torch()
    result: dict[str, Any] = {
        "peak_gflops": peak, "threads": threads,
        "attend_kwargs": {k: str(v) for k, v in prompt_kwargs().items()},
        "torch": package_version("torch") if torch is not None else None,
        "transformers": package_version("transformers") if torch is not None else None}
    result["settings"] = {**asdict(cfg), "geometries": [g.key for g in cfg.geometries]}
    result["attention"] = attention_rows(cfg, seed, bar, peak)
    result["ttft"], result["ttft_skipped"] = ttft_rows(cfg, seed, bar)
    if result["ttft_skipped"]:
        log.warning("prefill section: time to first token not measured: %s",
                    result["ttft_skipped"])
    return result


def task_count(ctx: Context, values: Values) -> int:
    """Progress-bar steps of the section."""
    cfg = settings_of(values, ctx.quick)
    return len(cfg.geometries) * len(cfg.contexts) + len(
        cfg.ttft_contexts)


# ------------------------------------------------------------------------- report
#: Modes whose prompt kernel scores int8 keys with integer dot products (four multiply-adds
#: per 32-bit lane): their float-equivalent GFLOP/s may pass the float FMA peak.
INT8_KEY_MODES = frozenset({"q8", "k8v4"})
INT8_MARK = " (int8)"
INT8_NOTE = (f"{INT8_MARK.strip()}: above the float FMA peak with int8 keys, whose scores are integer "
             f"dot products (four multiply-adds per 32-bit lane); GFLOP/s counts the float "
             f"work it stands for")


def _cell_text(c: Mapping[str, Any] | None, mode: str = "f32") -> list[str]:
    if not c:
        return ["-", "-", "-"]
    if c.get("skipped"):
        return [f"skipped (~{c['estimated_s']:.0f} s)", "-", "-"]
    pct = f"{c['pct_peak']:.0f}%"
    if mode in INT8_KEY_MODES and c["pct_peak"] > 100:
        pct += INT8_MARK          # not a busy probe: render_table leaves it unflagged
    return [fmt(c["s"]), fmt(c["gflops"]), pct]


def attention_table(rows: Sequence[Row]) -> str:
    """Prompt attention: one row per geometry and length."""
    body = []
    for r in rows:
        f, q, s = r.get("f32"), r.get("q8"), r.get("sdpa")
        ok = [r[m].get("matches") for m in PREFILL_MODES if r.get(m) and "matches" in r[m]]
        body.append([GEOMETRIES[r["geometry"]].label, context_label(r["context"]),
                     *_cell_text(f), *_cell_text(q, "q8"),
                     *(_cell_text(s)[:2] if s else ["not installed", "-"]),
                     fmt_ratio(r["vs_sdpa"]["f32"]), fmt_ratio(r["vs_sdpa"]["q8"]),
                     fmt_ratio(r["q8_vs_f32"]),
                     *_cell_text(r.get("f32_noimp")),
                     fmt_ratio(r["vs_sdpa"].get("f32_noimp")),
                     "-" if not ok else ("yes" if all(ok) else "NO")])
    return render_table(["geometry", "prompt", "f32 s", "f32 GFLOP/s", "f32 %peak", "q8 s",
                         "q8 GFLOP/s", "q8 %peak", "SDPA s", "SDPA GFLOP/s", "f32/SDPA",
                         "q8/SDPA", "q8/f32", "no-imp s", "no-imp GFLOP/s", "no-imp %peak",
                         "no-imp/SDPA", "matches SDPA"], body)


def four_bit_table(rows: Sequence[Row]) -> str:
    """The 4-bit modes' prompt attention (``--modes`` with q4 / k8v4), each against f32: one
    row per geometry, length and mode."""
    body = []
    for r in rows:
        for mode in PREFILL_4BIT:
            c = r.get(mode)
            if not c:
                continue
            body.append([GEOMETRIES[r["geometry"]].label, context_label(r["context"]), mode,
                         *_cell_text(c, mode), fmt_ratio(r.get(f"{mode}_vs_f32")),
                         "-" if "matches" not in c else ("yes" if c["matches"] else "NO")])
    return render_table(["geometry", "prompt", "mode", "s", "GFLOP/s", "%peak", "vs f32",
                         "matches SDPA"], body) if body else ""


def q8_noimp_table(rows: Sequence[Row]) -> str:
    """q8's prompt kernel without importance (``q8_noimp``), as the runner's q8 layers run
    it, against SDPA and f32 without importance: one row per geometry and length ("" for
    results that do not hold it)."""
    body = [[GEOMETRIES[r["geometry"]].label, context_label(r["context"]),
             *_cell_text(r["q8_noimp"], "q8"), fmt_ratio(r["vs_sdpa"].get("q8_noimp")),
             fmt_ratio(r.get("q8_noimp_vs_f32_noimp"))]
            for r in rows if r.get("q8_noimp")]
    return render_table(["geometry", "prompt", "q8 no-imp s", "GFLOP/s", "%peak",
                         "vs SDPA", "vs f32 no-imp"], body) if body else ""


def ttft_table(rows: Sequence[Row]) -> str:
    """Time to first token: one row per prompt length."""
    def met(v: bool | None) -> str:
        return "-" if v is None else ("met" if v else "NOT met")
    body = [[context_label(r["context"]), fmt(r["f32"]["s"]), fmt(r["q8"]["s"]),
             fmt(r["transformers"]["s"]), fmt_ratio(r["f32"]["vs_transformers"]),
             met(r["f32"]["target_met"]), fmt_ratio(r["q8"]["vs_transformers"]),
             met(r["q8"]["target_met"]), f"{r['max_abs_logit_diff']:.1e}"] for r in rows]
    return render_table(["prompt", "runner f32 s", "runner q8 s", "transformers s",
                         "f32/hf", f"<= {TTFT_TARGET}x", "q8/hf", f"<= {TTFT_TARGET}x",
                         "|dlogit| f32"], body)


def prefill_notes(result: Mapping[str, Any]) -> list[str]:
    """Method lines and warnings under the two tables."""
    cfg = PrefillSettings(**{**result["settings"], "geometries": ()})
    paired = any(r.get("paired") for r in result["attention"])
    from . import runner as runner_section
    model = PREFILL_MODEL if PREFILL_MODEL is not None else runner_section.RUNNER_MODEL
    kw = ", ".join(f"{k}={v}" for k, v in result.get("attend_kwargs", {}).items())
    out = [f"attention: one attend_all_heads({kw or 'q'}) call over all T queries of a layer "
           f"holding T rows vs torch SDPA (is_causal, enable_gqa) on the same data, "
           f"{result['threads']} threads; GFLOP/s = 4 x heads x head_dim x T(T+1)/2 / s; "
           f"%peak of the probed FMA peak {result['peak_gflops']:.1f} GFLOP/s "
           f"(_core.fma_probe); median of "
           + (f"{cfg.repeats} calls" if cfg.cell_s is None
              else f"up to {cfg.repeats} calls (fewer once the row's cells took "
                   f"{cfg.cell_s:.0f} s each on average)" if paired
              else f"up to {cfg.repeats} calls (fewer once a cell took {cfg.cell_s:.0f} s)")
           + f"; a cell estimated over "
           f"{cfg.max_call_s:.0f} s per call is skipped; ratios are speeds"
           + (PAIRED_NOTE if paired else ""),
           "no-imp: the same f32 prompt kernel on a layer with track_importance False (no "
           "importance work), the work SDPA does; the other columns track importance",
           f"matches SDPA: max |kvcache - SDPA| <= {PREFILL_TOL['f32']:g} (f32), "
           f"<= {PREFILL_TOL['q8']:g} (q8)",
           f"time to first token: Runner.prefill(ids) vs transformers "
           f"{result.get('transformers')} model(ids, logits_to_keep=1) (sdpa, new "
           f"DynamicCache), torch {result.get('torch')}, median of "
           + (f"up to {cfg.ttft_repeats} prompt(s) (fewer once a length took "
              f"{cfg.ttft_cell_s:.0f} s)" if cfg.ttft_cell_s is not None
              else f"{cfg.ttft_repeats} prompt(s)")
           + f"; model: Llama-style, {model}; target "
           f"runner/transformers <= {TTFT_TARGET}x at {context_label(TTFT_TARGET_FROM)} and up"]
    if any(m in INT8_KEY_MODES and (r.get(m) or {}).get("pct_peak", 0) > 100
           for r in result["attention"] for m in (*PREFILL_MODES, *PREFILL_4BIT)):
        out.append(INT8_NOTE)
    if result.get("ttft_skipped"):
        out.append(f"time to first token not measured: {result['ttft_skipped']}")
    for r in result["attention"]:
        for mode in PREFILL_MODES:
            c = r.get(mode) or {}
            if c.get("matches") is False:
                out.append(f"WARNING: {r['geometry']} {context_label(r['context'])} {mode}: "
                           f"output differs from SDPA by {c['max_abs_diff']:.2g}")
        for m in PREFILL_MODES:
            if (r.get(f"{m}_noimp") or {}).get(f"same_as_{m}") is False:
                out.append(f"WARNING: {r['geometry']} {context_label(r['context'])} {m}: the "
                           f"kernel without importance gave other outputs than with it")
    for r in result["ttft"]:
        if r["max_abs_logit_diff"] > 1e-3:
            out.append(f"WARNING: at {context_label(r['context'])} the runner's f32 logits "
                       f"differ from transformers' by {r['max_abs_logit_diff']:.2g} (> 1e-3)")
    return out


def prefill_report(ctx: Context, values: Values, result: Result) -> str:
    """The section's tables (prompt attention, the 4-bit modes, time to first token) and
    notes."""
    tables = [attention_table(result["attention"])]
    q8_bare = q8_noimp_table(result["attention"])
    if q8_bare:
        tables.append("q8 without importance (track_importance False, as in the runner):\n"
                      + q8_bare)
    four = four_bit_table(result["attention"])
    if four:
        tables.append("4-bit KV (docs/kv4.md), the same prompts:\n" + four)
    if result["ttft"]:
        tables.append(ttft_table(result["ttft"]))
    return section_text("prefill: prompt attention (attend_all_heads over all positions) vs "
                        "torch SDPA, and time to first token of kvcache.runner vs transformers:",
                        tables, prefill_notes(result))


SECTION = register(Section(
    name="prefill", order=90,
    help="prompt attention vs torch SDPA and the FMA peak, time to first token of "
         "kvcache.runner vs transformers",
    options=(Option("geometries", "llama3-8b and/or qwen2.5-0.5b (or llama, qwen)",
                    tuple(GEOMETRIES), parse_geometry, ("llama3-8b",), many=True,
                    old=("--geometries",), metavar="G"),
             Option("modes", f"KV modes: f32 and q8 always, and any of {', '.join(PREFILL_4BIT)}",
                    PREFILL_MODES, parse_mode, many=True, old=("--modes",), metavar="M"),
             Option("contexts", "prompt lengths of the attention cells, e.g. 4k 16k 32k (auto: "
                    f"{' '.join(map(context_label, PREFILL_CONTEXTS))}; with --quick "
                    f"{' '.join(map(context_label, QUICK_PREFILL_CONTEXTS))})", None,
                    parse_context, many=True, metavar="T"),
             Option("repeats", f"rounds of the attention cells per prompt length (default: up to "
                    f"{PREFILL_REPEATS}, {QUICK_PREFILL_REPEATS} with --quick, fewer once they "
                    f"took {PREFILL_CELL_S:.0f} s a cell; given: exactly N)", None, at_least(1),
                    metavar="N"),
             Option("ttft_repeats", f"prompts per time-to-first-token length (default: up to "
                    f"{TTFT_REPEATS}, {QUICK_TTFT_REPEATS} with --quick, fewer once they took "
                    f"{TTFT_CELL_S:.0f} s; given: exactly N)", None, at_least(1),
                    metavar="N")),
    tasks=task_count, run=run_prefill, report=prefill_report))
