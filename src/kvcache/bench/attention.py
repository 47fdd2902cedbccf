"""The decode section: one decode step of ``LayerKvCache.attend_all_heads`` over a working set
larger than the last-level cache, beside the NumPy reference and torch SDPA.

Method: ``docs/benchmark-method.md``.
"""

from __future__ import annotations

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
    F32, MAX_LAYERS, Geometry, GiB, MiB, layer_count, make_mode, random_kv, random_query)
from .machine import import_torch
from .tables import (
    Row, above_bandwidth, bandwidth_footnotes, context_label, fmt, fmt_ratio, pct_bandwidth_cell,
    render_table)
from .timing import (
    BANDWIDTH_BUFFER, Bandwidth, Samples, median_ms, numpy_threads, omp_threads,
    pct_of_bandwidth, relative_error, remeasure_above_bandwidth, time_repeats, torch_threads)

if TYPE_CHECKING:
    from torch import Tensor

    from .._progress import ProgressBar
    from .options import Options

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


def run_torch(geom: Geometry, context: int, k: F32, v: F32, opts: Options,
              rec: Record) -> F32:
    """Time torch SDPA per thread count; fills ``rec[n]`` and returns the first layer's output."""
    work = TorchDecode(geom, context, opts.working_set, k, v)
    rec["gqa"] = work.gqa
    rec["layers"] = len(work.kv)
    for n in opts.threads:
        with torch_threads(work.torch, n):
            rec[n] = time_repeats(work.sweep, opts.repeats)
    out = work.output()
    del work
    gc.collect()
    return out


def run_kvcache(geom: Geometry, context: int, mode_name: str, k: F32, v: F32, opts: Options,
                bandwidth: Bandwidth) -> Record:
    """Time kvcache (rotated) and the reference (one layer) for one mode; returns a record.

    A sweep that reads faster than ``bandwidth`` (the probe's GB/s per thread count) is timed
    once more (``rec["remeasured"]``)."""
    work = KvcacheDecode(geom, context, mode_name, opts.working_set, k, v)
    n_layers = len(work.layers)
    rec: Record = {"layers": n_layers, "kv": {}, "ref": {}, "remeasured": {}}
    for n in opts.threads:
        def pct(samples: Samples, n: int = n) -> float:
            return pct_of_bandwidth(work.step_bytes, statistics.median(samples) / n_layers,
                                    bandwidth[n]["best_gbs"])

        with omp_threads(n):
            rec["kv"][n], rec["remeasured"][n] = remeasure_above_bandwidth(
                time_repeats(work.sweep, opts.repeats),
                lambda: time_repeats(work.sweep, opts.repeats), pct)
    out = work.output()
    if opts.reference:
        ref = ReferenceDecode(work.layers[0], work.q)
        for n in opts.threads:
            with numpy_threads(n):
                rec["ref"][n] = time_repeats(ref.step, opts.ref_repeats)
        rec["err_ref"] = relative_error(out, ref.output())
    rec["out"] = out
    del work
    gc.collect()
    return rec


def run_context(geom: Geometry, context: int, opts: Options, bandwidth: Bandwidth,
                bar: ProgressBar) -> list[Row]:
    """Every mode and thread count at one (geometry, context); returns result rows."""
    k, v = random_kv(geom, context, opts.seed)
    torch_rec: Record = {}
    torch_out: F32 | None = None
    if opts.torch:
        bar.set_postfix_str(f"{geom.label} {context} torch")
        torch_out = run_torch(geom, context, k, v, opts, torch_rec)
        bar.update()
    recs: dict[str, Record] = {}
    for mode_name in opts.modes:
        bar.set_postfix_str(f"{geom.label} {context} {mode_name}")
        recs[mode_name] = run_kvcache(geom, context, mode_name, k, v, opts, bandwidth)
        bar.update()
    del k, v
    return [make_row(geom, context, m, n, recs, torch_rec, torch_out, bandwidth)
            for m in opts.modes for n in opts.threads]


def make_row(geom: Geometry, context: int, mode_name: str, n: int, recs: dict[str, Record],
             torch_rec: Record, torch_out: F32 | None, bandwidth: Bandwidth) -> Row:
    """One table row: timings (median ms per step), GB/s, % bandwidth and speedups."""
    rec = recs[mode_name]
    step_bytes = geom.step_bytes(context, mode_name)
    kv_ms = median_ms(rec["kv"][n], rec["layers"])
    row: Row = {"geometry": geom.label, "context": context, "mode": mode_name, "threads": n,
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
                   speedup_vs_torch_f32=t_ms / kv_ms)
        if mode_name == "f32" and torch_out is not None:
            row["rel_err_vs_torch"] = relative_error(rec["out"], torch_out)
    if mode_name != "f32" and "f32" in recs:
        row["speedup_vs_f32"] = median_ms(recs["f32"]["kv"][n], recs["f32"]["layers"]) / kv_ms
    return row


DECODE_HEADERS = ["model", "ctx", "mode", "thr", "layers x MiB", "kvcache ms", "GB/s", "%BW",
                  "ref ms", "torch f32 ms", "torch GB/s", "vs ref", "vs torch f32", "q8 vs f32"]


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
                     fmt_ratio(r.get("speedup_vs_torch_f32")), fmt_ratio(r.get("speedup_vs_f32"))])
    return render_table(DECODE_HEADERS, body)


def bandwidth_lines(bandwidth: Bandwidth) -> list[str]:
    """One line per thread count: the probe's best and median read bandwidth."""
    return [f"  {n} thread{'s' if n > 1 else ''}: {b['best_gbs']:.1f} GB/s best "
            f"({b['median_gbs']:.1f} median) over a "
            f"{fmt(b.get('buffer_bytes', BANDWIDTH_BUFFER) / MiB)} MiB float32 buffer"
            for n, b in bandwidth.items()]


def notes(opts: Options, rows: Sequence[Row]) -> list[str]:
    """Method lines printed under the decode table."""
    out = [(f"times: median ms per decode step (one layer's attend_all_heads) over "
            f"{opts.repeats} sweeps of every layer in the rotating working set (at least "
            f"{opts.working_set / GiB:.3g} GiB, 'layers x MiB' column), after one warm-up sweep."),
           ("GB/s: bytes of K/V rows (+ q8 scales) read per step / time; %BW: of the measured "
            "read bandwidth at the same thread count (a reading above 100% is measured once "
            "more).")]
    if opts.reference:
        out.append(f"ref: NumPy reference (kvcache.reference) on a SINGLE layer (not rotated, may "
                   f"be cache-resident at small contexts), median of {opts.ref_repeats} calls.")
    gqa = {r.get("torch_gqa") for r in rows} - {None}
    if gqa:
        how = ("enable_gqa=True" if gqa == {True}
               else "K/V heads repeat_interleave'd at setup (no enable_gqa in this torch)")
        out.append(f"torch: F.scaled_dot_product_attention on float32 K/V (1, nkv, T, hd), {how}, "
                   "rotated over its own working set; q8 rows compare against torch f32 "
                   "(torch has no int8 KV).")
    out.append("vs ref / vs torch f32: speedup of kvcache (>1 = kvcache faster); q8 vs f32: "
               "f32 time / q8 time at the same thread count.")
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
