"""The MLA section: the absorbed Multi-head Latent Attention decode kernel against the naive
NumPy form (DeepSeek-V2-Lite geometry), its read rate and its compute ceiling.

Method: ``docs/benchmark-method.md``.
"""

from __future__ import annotations

import gc
import logging
import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _core, quant, reference
from .._entry import MlaCall
from ..modes import DEFAULT_SCHEME
from .geometry import F32, GiB, MiB, layer_count
from .machine import llc_bytes
from .registry import (
    Context, Option, Result, Section, Values, at_least, parse_context, parse_context_or_zero,
    register)
from .tables import (
    Row, above_bandwidth, bandwidth_footnotes, context_label, fmt, fmt_ratio, line_style,
    pct_bandwidth_cell, render_table, section_text)
from .timing import (
    Samples, median_ms, numpy_threads, omp_threads, pct_of_bandwidth, relative_error,
    remeasure_above_bandwidth, time_repeats)

if TYPE_CHECKING:
    from .._progress import ProgressBar

FmaPeak = dict[int, dict[str, Any]]   # thread count -> {"best_gfmas", "median_gfmas", ...}

log = logging.getLogger("kvcache.bench")


# MLA section: DeepSeek-V2-Lite attention geometry
MLA_HEADS, MLA_RANK, MLA_ROPE, MLA_NOPE, MLA_V = 16, 512, 64, 128, 128
MLA_ROPE_SCALING = {"factor": 40, "mscale_all_dim": 0.707}
MLA_CONTEXTS = (1024, 4096, 16384, 32768)
QUICK_MLA_CONTEXTS = (1024,)
MLA_REPEATS, QUICK_MLA_REPEATS = 15, 5
MLA_NAIVE_REPEATS, QUICK_MLA_NAIVE_REPEATS = 3, 2
MLA_NAIVE_MAX_CONTEXT = 32768
MLA_WORKING_SET = 160 * MiB  # at least; 4 x the reported LLC when that is more (capped at 1 GiB)
MLA_MAX_LAYERS = 512
MLA_FMA_ITERS, QUICK_MLA_FMA_ITERS = 10_000_000, 2_000_000
MLA_FMA_PER_PROBE_ITER = 160  # FMAs per thread per fma_probe iteration (10 chains x 16 lanes)
MLA_ROW_BYTES = (MLA_RANK + MLA_ROPE) * 4                  # latent + k_rope of one cached row
MLA_WEIGHT_BYTES = MLA_HEADS * (MLA_NOPE + MLA_V) * MLA_RANK * 4   # W_UK + W_UV of one layer
MLA_FMA_PER_ROW = MLA_HEADS * (MLA_RANK + MLA_ROPE) + MLA_HEADS * MLA_RANK    # 17408
MLA_FMA_FIXED = MLA_HEADS * (MLA_NOPE + MLA_V) * MLA_RANK   # fold W_UK^T q + unfold W_UV c


def mla_scale() -> float:
    """DeepSeek-V2-Lite's softmax scale (``mla_softmax_scale(128, 64, rope_scaling)``)."""
    from ..mla import mla_softmax_scale
    return float(mla_softmax_scale(MLA_NOPE, MLA_ROPE, MLA_ROPE_SCALING))


def mla_cache_bytes_per_token() -> dict[str, float]:
    """Cache bytes per token per layer: the MLA latent (slot 0 + slot 1) against a per-head
    cache of the same attention (K of width qk_nope + qk_rope, V of width v_head_dim per head),
    f32 and in kvcache's default q8 layout (scheme "rows": K int8 + a float scale per 16
    values, V int8 + one scale per row)."""
    k, v = MLA_NOPE + MLA_ROPE, MLA_V
    out: dict[str, float] = {"latent": MLA_ROW_BYTES,
                             "per_head_f32": MLA_HEADS * (k + v) * 4,
                             "per_head_q8": MLA_HEADS * (quant.k_row_bytes(k, scheme=DEFAULT_SCHEME)
                                                       + quant.v_row_bytes(v))}
    out["ratio_f32"] = out["per_head_f32"] / out["latent"]
    out["ratio_q8"] = out["per_head_q8"] / out["latent"]
    return out


class MlaDecode:
    """A :class:`kvcache.LatentKvCache` of ``n_layers`` MLA layers (DeepSeek-V2-Lite geometry)
    holding ``context`` rows each, with per-layer weights; a step is one query position of one
    layer through the absorbed kernel ``_core.mla_attend``.

    Parameters
    ----------
    context : int
        Cached rows per layer (the cache's capacity too).
    working_set : int
        Target bytes (latent + k_rope rows + W_UK + W_UV) of all layers together; sets the
        layer count (at least ``min_layers``, at most ``max_layers``).
    n_layers : int, optional
        Explicit layer count (overrides ``working_set``).
    """

    def __init__(self, context: int, working_set: int = MLA_WORKING_SET, seed: int = 0,
                 n_layers: int | None = None, min_layers: int = 2,
                 max_layers: int = MLA_MAX_LAYERS) -> None:
        from ..latent import LatentKvCache
        self.context = context
        self.step_bytes = context * MLA_ROW_BYTES
        self.layer_bytes = self.step_bytes + MLA_WEIGHT_BYTES
        if n_layers is None:
            n_layers = max(min_layers, layer_count(self.layer_bytes, working_set, max_layers))
        self.n_layers = n_layers
        self.scale = mla_scale()
        rng = np.random.default_rng([seed, 0x4D4C41])
        lat = rng.standard_normal((context, MLA_RANK), dtype=np.float32)
        kr = rng.standard_normal((context, MLA_ROPE), dtype=np.float32)
        self.cache = LatentKvCache.with_capacity(n_layers, context, [(MLA_RANK,), (MLA_ROPE,)])
        for layer in range(n_layers):
            self.cache.write_layer(layer, [lat, kr])
        self.cache.advance(context)
        del lat, kr
        w = np.float32(MLA_RANK ** -0.5)
        wuk = rng.standard_normal((MLA_HEADS, MLA_NOPE, MLA_RANK), dtype=np.float32) * w
        wuv = rng.standard_normal((MLA_HEADS, MLA_V, MLA_RANK), dtype=np.float32) * w
        self.weights = [(wuk.copy(), wuv.copy()) for _ in range(n_layers)]   # own memory each
        self.views: list[tuple[F32, F32]] = [
            (self._slot(layer, 0)[:context], self._slot(layer, 1)[:context])
            for layer in range(n_layers)]
        self.qn = rng.standard_normal((1, MLA_HEADS, MLA_NOPE), dtype=np.float32)
        self.qr = rng.standard_normal((1, MLA_HEADS, MLA_ROPE), dtype=np.float32)
        self.out: F32 = np.empty((1, MLA_HEADS, MLA_V), dtype=np.float32)
        self._next = 0

    def _slot(self, layer: int, slot: int) -> F32:
        storage: F32 | None = self.cache.slot_storage(layer, slot)
        if storage is None:
            raise RuntimeError(f"layer {layer} slot {slot} has no storage")
        return storage

    @property
    def working_set_bytes(self) -> int:
        """Bytes of every layer's rows and weights."""
        return self.layer_bytes * self.n_layers

    def _attend(self, layer: int, n_threads: int) -> None:
        lat, kr = self.views[layer]
        wuk, wuv = self.weights[layer]
        _core.mla_attend(MlaCall(qn=self.qn, qr=self.qr, lat=lat, kr=kr, wuk=wuk, wuv=wuv,
                                 scale=self.scale, out=self.out, n_threads=n_threads))

    def step(self, n_threads: int = 1) -> None:
        """One decode step (one query position) on the next layer of the rotation."""
        self._attend(self._next, n_threads)
        self._next = (self._next + 1) % self.n_layers

    def sweep(self, n_threads: int = 1) -> None:
        """One decode step on every layer, in order."""
        for layer in range(self.n_layers):
            self._attend(layer, n_threads)

    def output(self, n_threads: int = 1, layer: int = 0) -> F32:
        """The kernel's (1, H, d_v) result on ``layer`` (a copy)."""
        self._attend(layer, n_threads)
        out: F32 = self.out.copy()
        return out

    def naive(self, layer: int = 0) -> F32:
        """``reference.mla_naive`` on ``layer``: (1, H, d_v)."""
        lat, kr = self.views[layer]
        wuk, wuv = self.weights[layer]
        out: F32 = reference.mla_naive(self.qn, self.qr, lat, kr, wuk, wuv, self.scale)
        return out


def measure_fma_peak(thread_counts: Iterable[int], iters: int = MLA_FMA_ITERS,
                     repeats: int = 5) -> FmaPeak:
    """Peak float32 FMA rate (GFMA/s) of ``_core.fma_probe`` per thread count.

    ``fma_probe(iters, n)`` runs ``iters`` x 160 FMAs (independent chains) on each of ``n``
    threads.  Returns ``{n: {"best_gfmas", "median_gfmas", "iters", "samples_s"}}``; "best" is
    the figure used (the peak)."""
    result: FmaPeak = {}
    for n in thread_counts:
        fmas = iters * MLA_FMA_PER_PROBE_ITER * n
        with omp_threads(n):
            samples = time_repeats(lambda: _core.fma_probe(iters=iters, n_threads=n), repeats)
        result[n] = {"best_gfmas": fmas / min(samples) / 1e9,
                     "median_gfmas": fmas / statistics.median(samples) / 1e9,
                     "iters": iters, "samples_s": samples}
    return result


def run_mla_context(context: int, ctx: Context, values: Values, working_set: int,
                    fma: FmaPeak, bar: ProgressBar) -> list[Row]:
    """MLA rows (one per thread count) at one context: the kernel over a rotating working set
    of latent layers, the naive NumPy form on one layer, their agreement."""
    label = context_label(context)
    bar.set_postfix_str(f"mla {label} setup")
    work = MlaDecode(context, working_set, seed=ctx.seed)
    kern: dict[int, Samples] = {}
    remeasured: dict[int, bool] = {}
    for n in ctx.threads:
        bar.set_postfix_str(f"mla {label} kernel {n}t")

        def sweeps(n: int = n) -> Samples:
            return time_repeats(lambda: work.sweep(n), values.repeats)

        def pct(samples: Samples, n: int = n) -> float:
            return pct_of_bandwidth(work.step_bytes, statistics.median(samples) / work.n_layers,
                                    ctx.bandwidth[n]["best_gbs"])

        with omp_threads(n):
            kern[n], remeasured[n] = remeasure_above_bandwidth(sweeps(), sweeps, pct)
    top = max(ctx.threads)
    with omp_threads(top):
        out = work.output(top)
    naive: dict[int, Samples] = {}
    err: float | None = None
    naive_out: list[F32] = []
    run_naive = context <= values.naive_max_context

    def naive_step() -> None:
        naive_out[:] = [work.naive()]

    if run_naive:
        for n in ctx.threads:
            bar.set_postfix_str(f"mla {label} naive {n}t")
            with numpy_threads(n):
                naive[n] = time_repeats(naive_step, values.naive_repeats)
        err = relative_error(out, naive_out[0])
    rows: list[Row] = []
    for n in ctx.threads:
        kernel_s = statistics.median(kern[n]) / work.n_layers
        bw, peak = ctx.bandwidth[n]["best_gbs"], fma[n]["best_gfmas"]
        fmas = context * MLA_FMA_PER_ROW + MLA_FMA_FIXED
        row: Row = {"geometry": "DeepSeek-V2-Lite MLA", "context": context, "threads": n,
                    "layers": work.n_layers, "step_bytes": work.step_bytes,
                    "weight_bytes": MLA_WEIGHT_BYTES, "layer_bytes": work.layer_bytes,
                    "working_set_bytes": work.working_set_bytes, "repeats": values.repeats,
                    "kernel_ms": kernel_s * 1e3, "kernel_samples_s": kern[n],
                    "latent_gbs": work.step_bytes / kernel_s / 1e9,
                    "all_gbs": work.layer_bytes / kernel_s / 1e9,
                    "bandwidth_gbs": bw, "fmas_per_step": fmas,
                    "kernel_gfmas": fmas / kernel_s / 1e9, "peak_gfmas": peak,
                    "fma_ceiling_gbs": peak / MLA_FMA_PER_ROW * MLA_ROW_BYTES}
        row["pct_bandwidth"] = 100.0 * row["latent_gbs"] / bw
        row["remeasured"] = remeasured[n]
        row["above_bandwidth"] = above_bandwidth(row["pct_bandwidth"])
        row["pct_bandwidth_all"] = 100.0 * row["all_gbs"] / bw
        row["pct_peak_fma"] = 100.0 * row["kernel_gfmas"] / peak
        row["fma_ceiling_pct_bandwidth"] = 100.0 * row["fma_ceiling_gbs"] / bw
        if n in naive:
            row.update(naive_ms=median_ms(naive[n]), naive_samples_s=naive[n],
                       naive_repeats=values.naive_repeats, rel_err_vs_naive=err)
            row["speedup_vs_naive"] = row["naive_ms"] / row["kernel_ms"]
        rows.append(row)
    del work, naive_out
    gc.collect()
    bar.update()
    return rows


def mla_summary(rows: Sequence[Row]) -> Row:
    """The figures of one run at its largest thread count and largest context: kernel and
    naive times (``speedup_vs_naive`` None when the naive form was not timed there), the latent
    read rate against the measured bandwidth, and the FMA rate against the probe's peak."""
    top = max(r["threads"] for r in rows)
    at = max((r for r in rows if r["threads"] == top), key=lambda r: r["context"])
    keys = ("kernel_ms", "latent_gbs", "bandwidth_gbs", "pct_bandwidth", "peak_gfmas",
            "kernel_gfmas", "pct_peak_fma", "fma_ceiling_gbs", "fma_ceiling_pct_bandwidth")
    s: Row = {"threads": top, "context": at["context"],
              "speedup_vs_naive": at.get("speedup_vs_naive"), "naive_ms": at.get("naive_ms")}
    s.update({k: at[k] for k in keys})
    return s


def run_mla(ctx: Context, values: Values, bar: ProgressBar) -> Result:
    """The MLA section: the FMA probe, then every context of ``values.contexts``."""
    working_set = (values.working_set_mib * MiB if values.working_set_mib
                   else max(MLA_WORKING_SET, min(GiB, 4 * (llc_bytes() or 0))))
    t0 = time.perf_counter()
    bar.set_postfix_str("mla FMA probe")
    fma = measure_fma_peak(ctx.threads, values.fma_iters)
    bar.update()
    rows: list[Row] = []
    for context in values.contexts:
        rows += run_mla_context(context, ctx, values, working_set, fma, bar)
    return {"geometry": "DeepSeek-V2-Lite", "heads": MLA_HEADS, "kv_lora_rank": MLA_RANK,
            "qk_rope_head_dim": MLA_ROPE, "qk_nope_head_dim": MLA_NOPE, "v_head_dim": MLA_V,
            "rope_scaling": MLA_ROPE_SCALING, "scale": mla_scale(),
            "contexts": list(values.contexts), "repeats": values.repeats,
            "naive_repeats": values.naive_repeats,
            "naive_max_context": values.naive_max_context or None,
            "working_set_target_bytes": working_set,
            "fma_per_row": MLA_FMA_PER_ROW, "fma_fixed": MLA_FMA_FIXED,
            "row_bytes": MLA_ROW_BYTES, "weight_bytes": MLA_WEIGHT_BYTES,
            "fma_peak": {n: v for n, v in fma.items()},
            "memory": mla_cache_bytes_per_token(), "rows": rows, "summary": mla_summary(rows),
            "section_s": time.perf_counter() - t0}


MLA_HEADERS = ["ctx", "thr", "layers x MiB", "kernel ms", "naive ms", "naive/kernel",
               "latent GB/s", "%BW", "all GB/s", "GFMA/s", "%peak FMA", "FMA ceil %BW",
               "err vs naive"]


def mla_table(rows: Sequence[Row]) -> str:
    """The MLA table: one row per (context, thread count)."""
    body = []
    for r in rows:
        err = r.get("rel_err_vs_naive")
        body.append([context_label(r["context"]), r["threads"],
                     f"{r['layers']} x {r['layer_bytes'] / MiB:.3g}", fmt(r["kernel_ms"]),
                     fmt(r.get("naive_ms")), fmt_ratio(r.get("speedup_vs_naive")),
                     fmt(r["latent_gbs"]), pct_bandwidth_cell(r["pct_bandwidth"]),
                     fmt(r["all_gbs"]),
                     fmt(r["kernel_gfmas"]), f"{r['pct_peak_fma']:.0f}%",
                     f"{r['fma_ceiling_pct_bandwidth']:.0f}%",
                     "-" if err is None else f"{err:.2g}"])
    return render_table(MLA_HEADERS, body)


def mla_notes(result: Mapping[str, Any]) -> list[str]:
    """Method, compute-ceiling, memory and summary lines printed under the MLA table."""
    rows, s, mem = result["rows"], result["summary"], result["memory"]
    layers = sorted({(r["context"], r["layers"]) for r in rows})
    out = [(f"DeepSeek-V2-Lite MLA layer: {MLA_HEADS} heads, kv_lora_rank {MLA_RANK}, "
            f"qk_rope_head_dim {MLA_ROPE}, qk_nope_head_dim {MLA_NOPE}, v_head_dim {MLA_V}, "
            f"scale {result['scale']:.7g} (mla_softmax_scale(128, 64, {MLA_ROPE_SCALING})); "
            "one query position of one layer per step."),
           (f"kernel ms: _core.mla_attend (what kvcache.mla.mla_decode runs, at n_threads = thr) on "
            f"slot_storage views of a LatentKvCache, median over {result['repeats']} sweeps of "
            "every layer ('layers x MiB': latent + k_rope rows + that layer's own W_UK/W_UV; "
            f"working set at least {result['working_set_target_bytes'] / MiB:.0f} MiB, so each "
            "step reads its rows from DRAM), after one warm-up sweep."),
           ((f"naive ms: kvcache.reference.mla_naive (K and V of every head materialised, NumPy "
             f"BLAS at thr threads) on one layer, median of {result['naive_repeats']} calls "
             f"after one warm-up, contexts <= {context_label(result['naive_max_context'])}; "
             "naive/kernel: speedup at the same thread count; err: max|kernel - naive| / "
             "max|naive|.") if result["naive_max_context"] else
            "naive form not timed (--mla-naive-max-context 0)."),
           (f"latent GB/s: T x (r + d_rope) x 4 = T x {MLA_ROW_BYTES} bytes / kernel time; %BW: "
            "of the measured read bandwidth (stream_read) at the same thread count; all GB/s "
            f"adds W_UK + W_UV ({MLA_WEIGHT_BYTES / MiB:.0f} MiB) read every step."),
           (f"compute: {MLA_FMA_PER_ROW} FMAs per cached row ({MLA_HEADS} x ({MLA_RANK} + "
            f"{MLA_ROPE}) scores + {MLA_HEADS} x {MLA_RANK} latent sum) plus "
            f"{MLA_FMA_FIXED} per step (fold/unfold); GFMA/s: achieved; %peak FMA: of "
            "_core.fma_probe's rate (best of 5) at thr threads: "
            + ", ".join(f"{n}t {v['best_gfmas']:.1f} GFMA/s"
                        for n, v in result["fma_peak"].items())
            + f"; FMA ceil %BW: the latent read rate at peak FMA (peak / {MLA_FMA_PER_ROW} x "
            f"{MLA_ROW_BYTES} B/s) as % of the bandwidth -- no latent-read figure above it is "
            "reachable by this kernel on this machine."),
           (f"cache bytes per token per layer: latent (r + d_rope) x 4 = {mem['latent']} B; "
            f"per-head f32 K ({MLA_NOPE + MLA_ROPE} wide) + V ({MLA_V} wide) x {MLA_HEADS} heads = "
            f"{mem['per_head_f32']} B ({mem['ratio_f32']:.2f}x the latent); the same per-head "
            f"cache in kvcache's q8 layout = {mem['per_head_q8']} B ({mem['ratio_q8']:.2f}x)."),
           "layers per context: " + ", ".join(f"{context_label(t)} {n}" for t, n in layers)]
    at, n = context_label(s["context"]), s["threads"]
    speed = ("naive form not timed" if s["speedup_vs_naive"] is None
             else f"kernel {s['speedup_vs_naive']:.1f}x faster than naive NumPy "
                  f"({fmt(s['naive_ms'])} ms / {fmt(s['kernel_ms'])} ms)")
    out.append(f"at {at}, {n} thread{'s' if n > 1 else ''}: {speed}; latent read "
               f"{pct_bandwidth_cell(s['pct_bandwidth'], 1)} of the measured bandwidth "
               f"({s['latent_gbs']:.2f} of {s['bandwidth_gbs']:.1f} GB/s)")
    ceiling = (f"  compute ceiling beside it: peak {s['peak_gfmas']:.1f} GFMA/s / "
               f"{MLA_FMA_PER_ROW} FMAs per {MLA_ROW_BYTES}-byte row = "
               f"{s['fma_ceiling_gbs']:.2f} GB/s = {s['fma_ceiling_pct_bandwidth']:.1f}% of "
               f"bandwidth; the kernel runs at {s['kernel_gfmas']:.1f} GFMA/s = "
               f"{s['pct_peak_fma']:.0f}% of peak FMA.")
    out.append(ceiling)
    out += bandwidth_footnotes(r["pct_bandwidth"] for r in rows)
    out.append(f"MLA section: {result['section_s']:.1f} s (FMA probe, cache fill, kernel and "
               "naive timings).")
    return out


def mla_accuracy_warnings(rows: Sequence[Row], tol: float = 1e-3) -> None:
    """Warn when the MLA kernel disagrees with the naive form beyond ``tol`` (relative)."""
    seen = set()
    for r in rows:
        err = r.get("rel_err_vs_naive")
        if err is not None and r["context"] not in seen and not err <= tol:
            seen.add(r["context"])
            log.warning("mla T=%d: kernel vs naive relative error %.3g (> %g)", r["context"],
                        err, tol)


def write_mla_plot(ctx: Context, result: Result, path: str) -> None:
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
        ls = line_style(threads, n)
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


def mla_report(ctx: Context, values: Values, result: Result) -> str:
    """The MLA table and its notes (and a warning when the kernel and the naive form
    disagree)."""
    mla_accuracy_warnings(result["rows"])
    return section_text("MLA decode (absorbed kernel _core.mla_attend vs naive NumPy "
                        "reference.mla_naive), one query position, one layer:",
                        [mla_table(result["rows"])], mla_notes(result))


SECTION = register(Section(
    name="mla", order=50, bandwidth=True,
    help="the absorbed MLA decode kernel vs the naive NumPy form (DeepSeek-V2-Lite), latent "
         "read rate, compute ceiling",
    options=(
        Option("contexts", "contexts of the MLA section", MLA_CONTEXTS, parse_context,
               QUICK_MLA_CONTEXTS, many=True, metavar="T"),
        Option("repeats", "timed sweeps per context and thread count", MLA_REPEATS,
               at_least(1), QUICK_MLA_REPEATS, metavar="N"),
        Option("naive_repeats", "timed calls of the naive NumPy form", MLA_NAIVE_REPEATS,
               at_least(1), QUICK_MLA_NAIVE_REPEATS, metavar="N"),
        Option("naive_max_context", "largest context the naive form is timed at (0: none)",
               MLA_NAIVE_MAX_CONTEXT, parse_context_or_zero, metavar="T"),
        Option("working_set_mib", "bytes of the rotating latent layers, MiB; auto: "
               f"{MLA_WORKING_SET // MiB} or 4x the reported LLC, at most {GiB // MiB}", None,
               at_least(1), metavar="MIB"),
        Option("fma_iters", "iterations of the FMA-peak probe", MLA_FMA_ITERS, at_least(1),
               QUICK_MLA_FMA_ITERS, metavar="N")),
    tasks=lambda ctx, values: len(values.contexts) + 1, run=run_mla, report=mla_report,
    plot=write_mla_plot))
