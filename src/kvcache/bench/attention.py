"""The decode section: one decode step of ``LayerKvCache.attend_all_heads`` over a working set
larger than the last-level cache, beside the NumPy reference and torch SDPA.

Method: ``docs/benchmark-method.md``.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import statistics
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import reference
from ..layer import LayerKvCache
from .geometry import (
    F32, GEOMETRIES, MAX_LAYERS, MODE_NAMES, Geometry, GiB, MiB, layer_count, make_mode,
    random_kv, random_query)
from .machine import import_torch
from .registry import (
    Context, Option, Result, Section, Values, at_least, parse_context, parse_geometry, parse_mode,
    register)
from .tables import (
    Row, above_bandwidth, bandwidth_footnotes, context_label, fmt, fmt_ratio, pct_bandwidth_cell,
    line_style, render_table, section_text)
from .timing import (
    Bandwidth, Samples, median_ms, numpy_threads, omp_threads, paired_ratio, pct_of_bandwidth,
    relative_error, time_interleaved, time_repeats, torch_threads)

if TYPE_CHECKING:
    from torch import Tensor

    from .._progress import ProgressBar

Record = dict[Any, Any]   # one implementation's timings at one (geometry, context, mode)

log = logging.getLogger("kvcache.bench")


DEFAULT_CONTEXTS = (1024, 4096, 16384, 32768)
QUICK_CONTEXTS = (1024, 4096)
DEFAULT_WORKING_SET = GiB
QUICK_WORKING_SET = 512 * MiB


class KvcacheDecode:
    """``n_layers`` LayerKvCache layers holding the same rows; a step attends the next layer.

    Parameters
    ----------
    geom : Geometry
    context : int
        Rows per layer.
    mode_name : {"f32", "q8"}
    working_set : int
        Target bytes read by one sweep (sets the number of layers).
    k, v : ndarray of shape (context, num_kv_heads, head_dim), optional
        Rows to store (random when omitted); every layer appends the same arrays.
    """

    def __init__(self, geom: Geometry, context: int, mode_name: str,
                 working_set: int = DEFAULT_WORKING_SET, k: F32 | None = None,
                 v: F32 | None = None, max_layers: int = MAX_LAYERS) -> None:
        if k is None or v is None:
            k, v = random_kv(geom, context)
        self.geom, self.context, self.mode_name = geom, context, mode_name
        self.step_bytes = geom.step_bytes(context, mode_name)
        n = layer_count(self.step_bytes, working_set, max_layers)
        self.layers = [self._layer(k, v) for _ in range(n)]
        self.q = random_query(geom)
        self.out = np.empty((geom.num_heads, geom.head_dim), dtype=np.float32)
        self._next = 0

    def _layer(self, k: F32, v: F32) -> LayerKvCache:
        c = LayerKvCache(self.geom.num_kv_heads, self.geom.head_dim, mode=make_mode(self.mode_name))
        c.append(k, v)
        return c

    @property
    def working_set_bytes(self) -> int:
        """Bytes one sweep reads (every layer's K/V rows)."""
        return self.step_bytes * len(self.layers)

    def step(self) -> None:
        """One decode step on the next layer of the rotation."""
        self.layers[self._next].attend_all_heads(self.q, out=self.out)
        self._next = (self._next + 1) % len(self.layers)

    def sweep(self) -> None:
        """One decode step on every layer, in order (one model-wide decode step)."""
        q, out = self.q, self.out
        for c in self.layers:
            c.attend_all_heads(q, out=out)

    def output(self) -> F32:
        """The result of the first layer's step (for the accuracy check)."""
        out: F32 = self.layers[0].attend_all_heads(self.q).copy()
        return out


class ReferenceDecode:
    """The NumPy reference on a single layer (slow, so not rotated)."""

    def __init__(self, layer: LayerKvCache, q: F32) -> None:
        self.layer, self.q = layer, q
        self.out = np.empty_like(q)

    def step(self) -> None:
        """One reference decode step into ``out``."""
        reference.attend_all_heads(self.layer, self.q, out=self.out)

    def output(self) -> F32:
        """The reference's result (a copy)."""
        out: F32 = reference.attend_all_heads(self.layer, self.q).copy()
        return out


def torch_has_gqa(torch: ModuleType, F: ModuleType) -> bool:
    """Whether this torch's scaled_dot_product_attention accepts ``enable_gqa``."""
    q = torch.zeros(1, 2, 1, 4)
    kv = torch.zeros(1, 1, 1, 4)
    try:
        F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
    except (TypeError, RuntimeError):
        return False
    return True


class TorchDecode:
    """torch SDPA over float32 K/V tensors (1, nkv, T, hd), one copy per layer, rotated.

    Without ``enable_gqa`` support the K/V heads are repeated once at setup (``gqa`` False).
    """

    def __init__(self, geom: Geometry, context: int, working_set: int = DEFAULT_WORKING_SET,
                 k: F32 | None = None, v: F32 | None = None,
                 max_layers: int = MAX_LAYERS) -> None:
        torch, F = import_torch()
        if torch is None or F is None:
            raise NotImplementedError("torch is not installed")
        if k is None or v is None:
            k, v = random_kv(geom, context)
        self.torch, self.F = torch, F
        self.gqa = torch_has_gqa(torch, F)
        self.step_bytes = geom.step_bytes(context, "f32")
        n = layer_count(self.step_bytes, working_set, max_layers)
        kt = np.ascontiguousarray(k.transpose(1, 0, 2))      # (nkv, T, hd)
        vt = np.ascontiguousarray(v.transpose(1, 0, 2))
        self.kv = [(self._tensor(kt, geom), self._tensor(vt, geom)) for _ in range(n)]
        self.q: Tensor = torch.from_numpy(random_query(geom)).reshape(
            1, geom.num_heads, 1, geom.head_dim)
        self._next = 0

    def _tensor(self, rows: F32, geom: Geometry) -> Tensor:
        t: Tensor = self.torch.from_numpy(rows.copy()).unsqueeze(0)   # (1, nkv, T, hd), own
        if not self.gqa:
            t = t.repeat_interleave(geom.num_heads // geom.num_kv_heads, dim=1).contiguous()
        return t

    @property
    def layers(self) -> list[tuple[Tensor, Tensor]]:
        """The (K, V) tensors of every layer."""
        return self.kv

    @property
    def working_set_bytes(self) -> int:
        """Bytes one sweep reads (every layer's K/V tensors)."""
        return self.step_bytes * len(self.kv)

    def _attend(self, k: Tensor, v: Tensor) -> Tensor:
        out: Tensor
        if self.gqa:
            out = self.F.scaled_dot_product_attention(self.q, k, v, enable_gqa=True)
        else:
            out = self.F.scaled_dot_product_attention(self.q, k, v)
        return out

    def step(self) -> None:
        """One decode step on the next layer of the rotation."""
        with self.torch.inference_mode():
            self._attend(*self.kv[self._next])
        self._next = (self._next + 1) % len(self.kv)

    def sweep(self) -> None:
        """One decode step on every layer, in order."""
        with self.torch.inference_mode():
            for k, v in self.kv:
                self._attend(k, v)

    def output(self) -> F32:
        """The first layer's result, shape (num_heads, head_dim) (for the accuracy check)."""
        with self.torch.inference_mode():
            o = self._attend(*self.kv[0])
        out: F32 = o.reshape(o.shape[1], o.shape[3]).numpy().copy()
        return out


def _timed_rounds(works: dict[str, Any], modes: Sequence[str], values: Values,
                  bandwidth_gbs: float) -> tuple[dict[str, Samples], set[str]]:
    """Sweeps of every work in ``works`` side by side (:func:`time_interleaved`, ``repeats``
    rounds), and the kvcache ``modes`` whose reading passed ``bandwidth_gbs``: when there is
    one, the rounds are timed once more, all of them (the samples stay paired), and every
    mode's row says it was remeasured."""
    def pct(m: str, smp: Samples) -> float:
        w = works[m]
        return pct_of_bandwidth(w.step_bytes, statistics.median(smp) / len(w.layers),
                                bandwidth_gbs)

    fns = {name: w.sweep for name, w in works.items()}
    samples = time_interleaved(fns, values.repeats)
    above = {m for m in modes if pct(m, samples[m]) > 100.0}
    if above:
        samples = time_interleaved(fns, values.repeats)
    return samples, above


def run_context(geom: Geometry, context: int, ctx: Context, values: Values,
                bar: ProgressBar) -> list[Row]:
    """Every mode and thread count at one (geometry, context); returns result rows.

    The modes' rotating layers (and torch's) are built together, then timed side by side per
    thread count, each round sweeping every one of them once (docs/benchmark-method.md), so
    their ratios are paired; the reference runs after, one mode at a time."""
    k, v = random_kv(geom, context, ctx.seed)
    works: dict[str, Any] = {}
    torch_rec: Record = {}
    torch = None
    if use_torch(values):
        bar.set_postfix_str(f"{geom.label} {context} torch")
        tw = TorchDecode(geom, context, values.working_set_mib * MiB, k, v)
        works["torch"], torch = tw, tw.torch
        torch_rec.update(gqa=tw.gqa, layers=len(tw.kv))
    recs: dict[str, Record] = {}
    for mode_name in values.modes:
        w = KvcacheDecode(geom, context, mode_name, values.working_set_mib * MiB, k, v)
        works[mode_name] = w
        recs[mode_name] = {"layers": len(w.layers), "kv": {}, "ref": {}, "remeasured": {}}
    for n in ctx.threads:
        bar.set_postfix_str(f"{geom.label} {context} {n} thr")
        with omp_threads(n), (torch_threads(torch, n) if torch is not None
                              else contextlib.nullcontext()):
            samples, above = _timed_rounds(works, values.modes, values,
                                           ctx.bandwidth[n]["best_gbs"])
        for m in values.modes:
            recs[m]["kv"][n] = samples[m]
            recs[m]["remeasured"][n] = bool(above)     # every mode's rounds were retaken
        if torch is not None:
            torch_rec[n] = samples["torch"]
    torch_out = works.pop("torch").output() if torch is not None else None
    for mode_name in values.modes:
        w = works.pop(mode_name)
        rec = recs[mode_name]
        rec["out"] = w.output()
        if values.reference:
            ref = ReferenceDecode(w.layers[0], w.q)
            for n in ctx.threads:
                with numpy_threads(n):
                    rec["ref"][n] = time_repeats(ref.step, values.ref_repeats)
            rec["err_ref"] = relative_error(rec["out"], ref.output())
        del w
        gc.collect()
        bar.update()
    if torch is not None:
        bar.update()
    del k, v
    return [make_row(geom, context, m, n, recs, torch_rec, torch_out, ctx.bandwidth)
            for m in values.modes for n in ctx.threads]


def use_torch(values: Values) -> bool:
    """Whether torch SDPA is timed: asked for (``--decode-torch``) and installed."""
    return bool(values.torch) and import_torch()[0] is not None


def run_decode(ctx: Context, values: Values, bar: ProgressBar) -> Result:
    """The decode section: every geometry and context of ``values``, ``{"rows": [...]}``."""
    if values.torch and not use_torch(values):
        log.warning("torch is not installed: skipping the torch SDPA comparison")
    rows: list[Row] = []
    for key in values.geometries:
        for context in values.contexts:
            rows += run_context(GEOMETRIES[key], context, ctx, values, bar)
    return {"rows": rows}


def make_row(geom: Geometry, context: int, mode_name: str, n: int, recs: dict[str, Record],
             torch_rec: Record, torch_out: F32 | None, bandwidth: Bandwidth) -> Row:
    """One table row: timings (median ms per step), GB/s, % bandwidth and speedups."""
    rec = recs[mode_name]
    step_bytes = geom.step_bytes(context, mode_name)
    kv_ms = median_ms(rec["kv"][n], rec["layers"])
    row: Row = {"geometry": geom.label, "context": context, "mode": mode_name, "threads": n,
                "paired": True,
                "layers": rec["layers"], "step_bytes": step_bytes,
                "working_set_bytes": step_bytes * rec["layers"],
                "kvcache_ms": kv_ms, "kvcache_samples_s": rec["kv"][n],
                "kvcache_gbs": step_bytes / kv_ms / 1e6,
                "bandwidth_gbs": bandwidth[n]["best_gbs"]}
    row["pct_bandwidth"] = 100.0 * row["kvcache_gbs"] / row["bandwidth_gbs"]
    row["remeasured"] = rec["remeasured"][n]
    row["above_bandwidth"] = above_bandwidth(row["pct_bandwidth"])
    if n in rec["ref"]:
        row["reference_ms"] = median_ms(rec["ref"][n])
        row["reference_samples_s"] = rec["ref"][n]
        row["speedup_vs_reference"] = row["reference_ms"] / kv_ms
        row["rel_err_vs_reference"] = rec["err_ref"]
    if n in torch_rec:
        t_ms = median_ms(torch_rec[n], torch_rec["layers"])
        row.update(torch_f32_ms=t_ms, torch_samples_s=torch_rec[n], torch_gqa=torch_rec["gqa"],
                   torch_layers=torch_rec["layers"],
                   torch_gbs=geom.step_bytes(context, "f32") / t_ms / 1e6,
                   speedup_vs_torch_f32=paired_ratio(torch_rec[n], rec["kv"][n],
                                                     torch_rec["layers"], rec["layers"]))
        if mode_name == "f32" and torch_out is not None:
            row["rel_err_vs_torch"] = relative_error(rec["out"], torch_out)
    for base in ("f32", "q8"):               # the modes the 4-bit targets are stated against
        if mode_name not in ("f32", base) and base in recs:
            row[f"speedup_vs_{base}"] = paired_ratio(recs[base]["kv"][n], rec["kv"][n],
                                                     recs[base]["layers"], rec["layers"])
    return row


DECODE_HEADERS = ["model", "ctx", "mode", "thr", "layers x MiB", "kvcache ms", "GB/s", "%BW",
                  "ref ms", "torch f32 ms", "torch GB/s", "vs ref", "vs torch f32", "vs f32",
                  "vs q8"]


def decode_table(rows: Sequence[Row]) -> str:
    """The decode table: one row per (geometry, context, mode, thread count)."""
    body = []
    for r in rows:
        body.append([r["geometry"], context_label(r["context"]), r["mode"], r["threads"],
                     f"{r['layers']} x {r['step_bytes'] / MiB:.3g}",
                     fmt(r["kvcache_ms"]), fmt(r["kvcache_gbs"]),
                     pct_bandwidth_cell(r["pct_bandwidth"]),
                     fmt(r.get("reference_ms")), fmt(r.get("torch_f32_ms")),
                     fmt(r.get("torch_gbs")), fmt_ratio(r.get("speedup_vs_reference")),
                     fmt_ratio(r.get("speedup_vs_torch_f32")), fmt_ratio(r.get("speedup_vs_f32")),
                     fmt_ratio(r.get("speedup_vs_q8"))])
    return render_table(DECODE_HEADERS, body)


def notes(values: Values, rows: Sequence[Row]) -> list[str]:
    """Method lines printed under the decode table."""
    out = [(f"times: median ms per decode step (one layer's attend_all_heads) over "
            f"{values.repeats} sweeps of every layer in the rotating working set (at least "
            f"{values.working_set_mib * MiB / GiB:.3g} GiB, 'layers x MiB' column), after one "
            "warm-up sweep."),
           ("GB/s: bytes of K/V rows (+ q8 scales) read per step / time; %BW: of the measured "
            "read bandwidth at the same thread count (a reading above 100% is measured once "
            "more).")]
    if values.reference:
        out.append(f"ref: NumPy reference (kvcache.reference) on a SINGLE layer (not rotated, may "
                   f"be cache-resident at small contexts), median of {values.ref_repeats} calls.")
    gqa = {r.get("torch_gqa") for r in rows} - {None}
    if gqa:
        how = ("enable_gqa=True" if gqa == {True}
               else "K/V heads repeat_interleave'd at setup (no enable_gqa in this torch)")
        out.append(f"torch: F.scaled_dot_product_attention on float32 K/V (1, nkv, T, hd), {how}, "
                   "rotated over its own working set; q8 rows compare against torch f32 "
                   "(torch has no int8 KV).")
    out.append("vs ref / vs torch f32: speedup of kvcache (>1 = kvcache faster); vs f32 / vs q8: "
               "f32 (q8) time / this mode's time at the same thread count.")
    if any(r.get("paired") for r in rows):
        out.append("side by side: at each context the modes' working sets (and torch's) were "
                   "swept in turn, round by round; 'vs torch f32', 'vs f32' and 'vs q8' are the "
                   "medians over rounds of each round's ratio.")
    out += bandwidth_footnotes(r["pct_bandwidth"] for r in rows)
    return out


def accuracy_warnings(rows: Sequence[Row], tol: float = 1e-3) -> None:
    """Warn when kvcache disagrees with the reference or torch beyond ``tol`` (relative)."""
    for r in rows:
        for key in ("rel_err_vs_reference", "rel_err_vs_torch"):
            err = r.get(key)
            if err is not None and not err <= tol:
                log.warning("%s %s %s T=%d: %s = %.3g (> %g)", "kvcache", r["geometry"],
                            r["mode"], r["context"], key, err, tol)


def plot_series(rows: Sequence[Row]) -> dict[tuple[str, str, int], list[tuple[int, float, float]]]:
    """{(implementation, mode, threads): [(context, ms, GB/s), ...]} from result rows."""
    series: dict[tuple[str, str, int], list[tuple[int, float, float]]] = {}
    for r in rows:
        t, n, m = r["context"], r["threads"], r["mode"]
        series.setdefault(("kvcache", m, n), []).append((t, r["kvcache_ms"], r["kvcache_gbs"]))
        if "reference_ms" in r:
            series.setdefault(("reference", m, n), []).append(
                (t, r["reference_ms"], r["step_bytes"] / r["reference_ms"] / 1e6))
        if "torch_f32_ms" in r and m == "f32":
            series.setdefault(("torch", "f32", n), []).append(
                (t, r["torch_f32_ms"], r["torch_gbs"]))
    return series


def write_plot(ctx: Context, result: Result, path: str) -> None:
    """The decode chart: ms per step and effective GB/s against context, one column per
    geometry.

    Colour: implementation and mode; line style: thread count; grey lines: stream_read."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    geoms = list(dict.fromkeys(r["geometry"] for r in rows))
    threads = sorted({r["threads"] for r in rows})
    fig, axes = plt.subplots(2, len(geoms), figsize=(6.5 * len(geoms), 8), squeeze=False)
    for col, g in enumerate(geoms):
        mine = [r for r in rows if r["geometry"] == g]
        ax_ms, ax_gbs = axes[0][col], axes[1][col]
        for (impl, mode, n), pts in plot_series(mine).items():
            pts.sort()
            style = {"color": _PLOT_COLOURS[(impl, mode)], "marker": _PLOT_MARKERS[impl],
                     "ls": line_style(threads, n), "label": f"{impl} {mode} {n}t"}
            ax_ms.plot([p[0] for p in pts], [p[1] for p in pts], **style)
            ax_gbs.plot([p[0] for p in pts], [p[2] for p in pts], **style)
        for n, b in ctx.bandwidth.items():
            ax_gbs.axhline(b["best_gbs"], color="grey", lw=0.8, ls=line_style(threads, n))
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


def decode_report(ctx: Context, values: Values, result: Result) -> str:
    """The decode table and its notes (and a warning when the implementations disagree)."""
    rows = result["rows"]
    if not rows:
        return ""
    accuracy_warnings(rows)
    return section_text("decode attention (one attend_all_heads step of one layer) vs the NumPy "
                        "reference and torch SDPA:", [decode_table(rows)], notes(values, rows))


def decode_tasks(ctx: Context, values: Values) -> int:
    """Progress steps: one per geometry, context and mode (and torch)."""
    return len(values.geometries) * len(values.contexts) * (len(values.modes) + use_torch(values))


SECTION = register(Section(
    name="decode", order=10, bandwidth=True,
    help="decode attention: one attend_all_heads step of one layer over a working set larger "
         "than the last-level cache, vs the NumPy reference and torch SDPA",
    options=(
        Option("contexts", "contexts, e.g. 1k 4k 16k 32k", DEFAULT_CONTEXTS, parse_context,
               QUICK_CONTEXTS, many=True, old=("--contexts",), metavar="T"),
        Option("geometries", "llama3-8b and/or qwen2.5-0.5b (or llama, qwen)", tuple(GEOMETRIES),
               parse_geometry, ("llama3-8b",), many=True, old=("--geometries",), metavar="G"),
        Option("modes", "KV modes (f32, q8, q4, k8v4, ...)", MODE_NAMES, parse_mode, many=True,
               old=("--modes",), metavar="M"),
        Option("repeats", "timed sweeps per configuration", 5, at_least(1), 3,
               old=("--repeats",), metavar="N"),
        Option("ref_repeats", "timed reference calls", 3, at_least(1), 2,
               old=("--ref-repeats",), metavar="N"),
        Option("working_set_mib", "bytes the rotating layers of one sweep hold at least, MiB",
               DEFAULT_WORKING_SET // MiB, at_least(1), QUICK_WORKING_SET // MiB,
               old=("--working-set-mib",), metavar="MIB"),
        Option("torch", "time torch SDPA beside kvcache (when torch is installed)", True,
               old=("--no-torch",)),
        Option("reference", "time the NumPy reference beside kvcache", True,
               old=("--no-reference",))),
    tasks=decode_tasks, run=run_decode, report=decode_report, plot=write_plot))
