"""Decode-attention benchmark behind ``python -m kvcache bench``.

What is timed
-------------
One decode step of one layer: ``LayerKvCache.attend_all_heads(q, out=buf)`` with ``q`` of shape
(num_heads, head_dim), i.e. the newest position attending over ``context`` stored rows, for two
geometries (Llama-3-8B: 32 query heads, 8 KV heads, head_dim 128; Qwen2.5-0.5B: 14 / 2 / 64), two
storage modes (``KvMode.F32`` and ``KvMode.Q8()``), several contexts and thread counts.  Side by
side, in the same run: the pure-NumPy reference (``kvcache.reference.attend_all_heads``) and, when
torch is installed, ``torch.nn.functional.scaled_dot_product_attention`` over float32 K/V tensors
of shape (1, num_kv_heads, context, head_dim) with ``enable_gqa=True``.  Torch has no int8 KV, so
q8 rows are compared with torch *f32* (labelled so).

Methodology
-----------
* **Working set above the last-level cache.**  Decode attention streams K and V once per step, so
  it is bound by memory bandwidth only when the rows come from DRAM.  A single 32k layer can sit in
  a large (possibly virtualised, much larger than reported) LLC and give impossible numbers, so
  each configuration builds *several* layers holding the same rows (like a model's layers) until
  their bytes reach the target working set (1 GiB by default), and a timed *sweep* attends every
  layer once, in order.  By the time a layer comes round again, the others have pushed it out of
  cache.  kvcache and torch both rotate over such a working set (built one after the other, so
  memory stays bounded).  The NumPy reference is slow, so it is timed on a single layer with fewer
  repeats; for small contexts that layer may be cache-resident, which only flatters the reference.
* **Bandwidth probe.**  ``kvcache._core.stream_read`` (a parallel sum) reads a 1 GiB float32
  buffer several times, for each thread count; the best run is this machine's read bandwidth and
  the denominator of "% of bandwidth" at the same thread count.
* **Effective GB/s** = bytes of K and V rows a step reads / time per step, with
  f32: 2*nkv*T*hd*4 and q8: nkv*T*(hd + 4*ceil(hd/32)) + nkv*T*(hd + 4) (int8 rows and their
  scales).
* **Medians.**  After one warm-up sweep, every sweep is timed (``timeit``, garbage collector off)
  and divided by the number of layers; the reported time per step is the median over sweeps.
* **Threads.**  kvcache runs under ``threadpool_limits(n, user_api="openmp")``, the NumPy reference
  under ``threadpool_limits(n)`` (its BLAS calls), torch under ``torch.set_num_threads(n)``.
* **Append cost.**  Time to fill a Llama-geometry f32 layer from 0 to T one position at a time
  (amortised, divided by T) and the median of single appends at T (each rolled back with
  ``truncate_last(1)``), at 1k and 32k; their 32k/1k ratio should stay near 1 (amortised O(1)).

The workload classes here (:class:`KvcacheDecode`, :class:`TorchDecode`,
:class:`ReferenceDecode`, :class:`AppendFill`) are shared with the asv-style suite in
``benchmarks/`` so both measure the same thing.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import math
import os
import platform
import statistics
import sys
import time
import timeit
from dataclasses import dataclass

import numpy as np

from . import _core, reference
from .layer import LayerKvCache
from .modes import KvMode

__all__ = [
    "GEOMETRIES",
    "AppendFill",
    "Geometry",
    "KvcacheDecode",
    "ReferenceDecode",
    "TorchDecode",
    "main",
    "measure_bandwidth",
]

log = logging.getLogger("kvcache.bench")

MiB = 1 << 20
GiB = 1 << 30
DEFAULT_CONTEXTS = (1024, 4096, 16384, 32768)
QUICK_CONTEXTS = (1024, 16384)
APPEND_CONTEXTS = (1024, 32768)
DEFAULT_WORKING_SET = GiB
QUICK_WORKING_SET = 512 * MiB
MAX_LAYERS = 4096            # bounds object count for tiny layers (Qwen q8 at 1k is ~0.27 MiB)
BANDWIDTH_BUFFER = GiB
MODE_NAMES = ("f32", "q8")


# ---------------------------------------------------------------------------------------- geometry
@dataclass(frozen=True)
class Geometry:
    """Attention shape of one model layer."""

    key: str
    label: str
    num_heads: int
    num_kv_heads: int
    head_dim: int

    def step_bytes(self, context, mode_name):
        """Bytes of K and V rows (and q8 scales) one decode step reads at ``context`` rows."""
        nkv, hd, t = self.num_kv_heads, self.head_dim, context
        if mode_name == "f32":
            return 2 * nkv * t * hd * 4
        return nkv * t * (hd + 4 * math.ceil(hd / 32)) + nkv * t * (hd + 4)


GEOMETRIES = {g.key: g for g in (Geometry("llama3-8b", "Llama-3-8B", 32, 8, 128),
                                 Geometry("qwen2.5-0.5b", "Qwen2.5-0.5B", 14, 2, 64))}
_GEOMETRY_ALIASES = {"llama": "llama3-8b", "qwen": "qwen2.5-0.5b"}


def make_mode(mode_name):
    """``"f32"`` -> KvMode.F32, ``"q8"`` -> KvMode.Q8()."""
    return KvMode.F32 if mode_name == "f32" else KvMode.Q8()


def random_kv(geom, context, seed=0):
    """K and V rows of shape (context, num_kv_heads, head_dim), float32 standard normal."""
    rng = np.random.default_rng(seed)
    shape = (context, geom.num_kv_heads, geom.head_dim)
    return (rng.standard_normal(shape, dtype=np.float32),
            rng.standard_normal(shape, dtype=np.float32))


def random_query(geom, seed=1):
    """A decode query of shape (num_heads, head_dim), float32."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((geom.num_heads, geom.head_dim), dtype=np.float32)


def layer_count(layer_bytes, working_set, max_layers=MAX_LAYERS):
    """Layers needed so that ``layer_count * layer_bytes >= working_set`` (at least 1)."""
    return max(1, min(max_layers, -(-working_set // max(layer_bytes, 1))))


# ---------------------------------------------------------------------------------------- workloads
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

    def __init__(self, geom, context, mode_name, working_set=DEFAULT_WORKING_SET, k=None, v=None,
                 max_layers=MAX_LAYERS):
        if k is None:
            k, v = random_kv(geom, context)
        self.geom, self.context, self.mode_name = geom, context, mode_name
        self.step_bytes = geom.step_bytes(context, mode_name)
        n = layer_count(self.step_bytes, working_set, max_layers)
        self.layers = [self._layer(k, v) for _ in range(n)]
        self.q = random_query(geom)
        self.out = np.empty((geom.num_heads, geom.head_dim), dtype=np.float32)
        self._next = 0

    def _layer(self, k, v):
        c = LayerKvCache(self.geom.num_kv_heads, self.geom.head_dim, mode=make_mode(self.mode_name))
        c.append(k, v)
        return c

    @property
    def working_set_bytes(self):
        return self.step_bytes * len(self.layers)

    def step(self):
        """One decode step on the next layer of the rotation."""
        self.layers[self._next].attend_all_heads(self.q, out=self.out)
        self._next = (self._next + 1) % len(self.layers)

    def sweep(self):
        """One decode step on every layer, in order (one model-wide decode step)."""
        q, out = self.q, self.out
        for c in self.layers:
            c.attend_all_heads(q, out=out)

    def output(self):
        """The result of the first layer's step (for the accuracy check)."""
        return self.layers[0].attend_all_heads(self.q).copy()


class ReferenceDecode:
    """The NumPy reference on a single layer (slow, so not rotated)."""

    def __init__(self, layer, q):
        self.layer, self.q = layer, q
        self.out = np.empty_like(q)

    def step(self):
        reference.attend_all_heads(self.layer, self.q, out=self.out)

    def output(self):
        return reference.attend_all_heads(self.layer, self.q).copy()


def import_torch():
    """torch and torch.nn.functional, or (None, None) when torch is not installed."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None, None
    return torch, F


def torch_has_gqa(torch, F):
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

    def __init__(self, geom, context, working_set=DEFAULT_WORKING_SET, k=None, v=None,
                 max_layers=MAX_LAYERS):
        torch, F = import_torch()
        if torch is None:
            raise NotImplementedError("torch is not installed")
        if k is None:
            k, v = random_kv(geom, context)
        self.torch, self.F = torch, F
        self.gqa = torch_has_gqa(torch, F)
        self.step_bytes = geom.step_bytes(context, "f32")
        n = layer_count(self.step_bytes, working_set, max_layers)
        kt = np.ascontiguousarray(k.transpose(1, 0, 2))      # (nkv, T, hd)
        vt = np.ascontiguousarray(v.transpose(1, 0, 2))
        self.kv = [(self._tensor(kt, geom), self._tensor(vt, geom)) for _ in range(n)]
        self.q = torch.from_numpy(random_query(geom)).reshape(1, geom.num_heads, 1, geom.head_dim)
        self._next = 0

    def _tensor(self, rows, geom):
        t = self.torch.from_numpy(rows.copy()).unsqueeze(0)   # (1, nkv, T, hd), own memory
        if not self.gqa:
            t = t.repeat_interleave(geom.num_heads // geom.num_kv_heads, dim=1).contiguous()
        return t

    @property
    def layers(self):
        return self.kv

    @property
    def working_set_bytes(self):
        return self.step_bytes * len(self.kv)

    def _attend(self, k, v):
        if self.gqa:
            return self.F.scaled_dot_product_attention(self.q, k, v, enable_gqa=True)
        return self.F.scaled_dot_product_attention(self.q, k, v)

    def step(self):
        with self.torch.inference_mode():
            self._attend(*self.kv[self._next])
        self._next = (self._next + 1) % len(self.kv)

    def sweep(self):
        with self.torch.inference_mode():
            for k, v in self.kv:
                self._attend(k, v)

    def output(self):
        with self.torch.inference_mode():
            o = self._attend(*self.kv[0])
        return o.reshape(o.shape[1], o.shape[3]).numpy().copy()


class AppendFill:
    """Append cost of a layer: fill 0..T one position at a time, then single appends at T."""

    def __init__(self, geom, context, mode_name="f32", seed=2):
        self.geom, self.context, self.mode_name = geom, context, mode_name
        self.k, self.v = random_kv(geom, context, seed)
        self.layer = None

    def fill(self):
        """A fresh layer filled one ``append(k_row, v_row)`` at a time."""
        c = LayerKvCache(self.geom.num_kv_heads, self.geom.head_dim, mode=make_mode(self.mode_name))
        k, v = self.k, self.v
        for i in range(self.context):
            c.append(k[i], v[i])
        self.layer = c

    def single_appends(self, n):
        """Seconds of ``n`` single appends at T rows, each rolled back (T stays fixed)."""
        c, k, v = self.layer, self.k, self.v
        times = []
        clock = time.perf_counter
        for i in range(n):
            t0 = clock()
            c.append(k[i], v[i])
            times.append(clock() - t0)
            c.truncate_last(1)
        return times


# ---------------------------------------------------------------------------------------- timing
def time_repeats(fn, repeats, warmup=1):
    """Seconds of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones (gc off, timeit)."""
    for _ in range(warmup):
        fn()
    return timeit.Timer(fn).repeat(repeat=repeats, number=1)


def omp_threads(n):
    """kvcache's OpenMP thread count limited to ``n``."""
    from threadpoolctl import threadpool_limits
    return threadpool_limits(n, user_api="openmp")


def numpy_threads(n):
    """Every thread pool (BLAS included) limited to ``n``: for the NumPy reference."""
    from threadpoolctl import threadpool_limits
    return threadpool_limits(n)


@contextlib.contextmanager
def torch_threads(torch, n):
    """torch's intra-op thread count set to ``n``, restored on exit."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def measure_bandwidth(thread_counts, nbytes=BANDWIDTH_BUFFER, repeats=5):
    """Read bandwidth (GB/s) of ``_core.stream_read`` over an ``nbytes`` buffer per thread count.

    Returns ``{n: {"best_gbs", "median_gbs", "samples_s"}}``; "best" is the figure used.
    """
    buf = np.ones(nbytes // 4, dtype=np.float32)            # pages touched: not lazily zero
    result = {}
    for n in thread_counts:
        samples = time_repeats(lambda n=n: _core.stream_read(buf, n), repeats)
        result[n] = {"best_gbs": buf.nbytes / min(samples) / 1e9,
                     "median_gbs": buf.nbytes / statistics.median(samples) / 1e9,
                     "samples_s": samples}
    return result


def median_ms(samples, per=1):
    """Median of ``samples`` (seconds, each covering ``per`` steps) in ms per step."""
    return statistics.median(samples) / per * 1e3


# ---------------------------------------------------------------------------------------- runs
@dataclass
class Options:
    """Resolved command-line settings."""

    geometries: list
    contexts: list
    modes: list
    threads: list
    repeats: int
    ref_repeats: int
    working_set: int
    torch: bool
    reference: bool
    append: bool
    append_repeats: int
    seed: int


def run_torch(geom, context, k, v, opts, rec):
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


def run_kvcache(geom, context, mode_name, k, v, opts):
    """Time kvcache (rotated) and the reference (one layer) for one mode; returns a record."""
    work = KvcacheDecode(geom, context, mode_name, opts.working_set, k, v)
    rec = {"layers": len(work.layers), "kv": {}, "ref": {}}
    for n in opts.threads:
        with omp_threads(n):
            rec["kv"][n] = time_repeats(work.sweep, opts.repeats)
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


def relative_error(a, b):
    """max |a - b| / max(max |b|, 1e-30)."""
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


def run_context(geom, context, opts, bandwidth, bar):
    """Every mode and thread count at one (geometry, context); returns result rows."""
    k, v = random_kv(geom, context, opts.seed)
    torch_rec, torch_out = {}, None
    if opts.torch:
        bar.set_postfix_str(f"{geom.label} {context} torch")
        torch_out = run_torch(geom, context, k, v, opts, torch_rec)
        bar.update()
    recs = {}
    for mode_name in opts.modes:
        bar.set_postfix_str(f"{geom.label} {context} {mode_name}")
        recs[mode_name] = run_kvcache(geom, context, mode_name, k, v, opts)
        bar.update()
    del k, v
    return [make_row(geom, context, m, n, recs, torch_rec, torch_out, bandwidth)
            for m in opts.modes for n in opts.threads]


def make_row(geom, context, mode_name, n, recs, torch_rec, torch_out, bandwidth):
    """One table row: timings (median ms per step), GB/s, % bandwidth and speedups."""
    rec = recs[mode_name]
    step_bytes = geom.step_bytes(context, mode_name)
    kv_ms = median_ms(rec["kv"][n], rec["layers"])
    row = {"geometry": geom.label, "context": context, "mode": mode_name, "threads": n,
           "layers": rec["layers"], "step_bytes": step_bytes,
           "working_set_bytes": step_bytes * rec["layers"],
           "kvcache_ms": kv_ms, "kvcache_samples_s": rec["kv"][n],
           "kvcache_gbs": step_bytes / kv_ms / 1e6,
           "bandwidth_gbs": bandwidth[n]["best_gbs"]}
    row["pct_bandwidth"] = 100.0 * row["kvcache_gbs"] / row["bandwidth_gbs"]
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
        if mode_name == "f32":
            row["rel_err_vs_torch"] = relative_error(rec["out"], torch_out)
    if mode_name != "f32" and "f32" in recs:
        row["speedup_vs_f32"] = median_ms(recs["f32"]["kv"][n], recs["f32"]["layers"]) / kv_ms
    return row


def run_append(opts, bar):
    """Append-cost rows for the Llama geometry, f32, at 1k and 32k."""
    geom = GEOMETRIES["llama3-8b"]
    rows = []
    for context in APPEND_CONTEXTS:
        bar.set_postfix_str(f"append {context}")
        work = AppendFill(geom, context, "f32", seed=opts.seed + 2)
        fill_s = timeit.Timer(work.fill).timeit(number=1)
        singles = work.single_appends(opts.append_repeats)
        rows.append({"geometry": geom.label, "mode": "f32", "context": context,
                     "fill_s": fill_s, "amortised_us": fill_s / context * 1e6,
                     "single_median_us": statistics.median(singles) * 1e6,
                     "single_max_us": max(singles) * 1e6, "single_samples_s": singles})
        del work
        gc.collect()
        bar.update()
    return rows


# ---------------------------------------------------------------------------------------- output
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


DECODE_HEADERS = ["model", "ctx", "mode", "thr", "layers x MiB", "kvcache ms", "GB/s", "%BW",
                  "ref ms", "torch f32 ms", "torch GB/s", "vs ref", "vs torch f32", "q8 vs f32"]


def decode_table(rows):
    body = []
    for r in rows:
        body.append([r["geometry"], context_label(r["context"]), r["mode"], r["threads"],
                     f"{r['layers']} x {r['step_bytes'] / MiB:.3g}",
                     fmt(r["kvcache_ms"]), fmt(r["kvcache_gbs"]), f"{r['pct_bandwidth']:.0f}%",
                     fmt(r.get("reference_ms")), fmt(r.get("torch_f32_ms")),
                     fmt(r.get("torch_gbs")), fmt_ratio(r.get("speedup_vs_reference")),
                     fmt_ratio(r.get("speedup_vs_torch_f32")), fmt_ratio(r.get("speedup_vs_f32"))])
    return render_table(DECODE_HEADERS, body)


def append_table(rows):
    body = [[r["geometry"], r["mode"], context_label(r["context"]), fmt(r["fill_s"]),
             fmt(r["amortised_us"]), fmt(r["single_median_us"]), fmt(r["single_max_us"])]
            for r in rows]
    return render_table(["model", "mode", "T", "fill 0..T s", "amortised us/pos",
                         "single at T median us", "single at T max us"], body)


def append_ratio_lines(rows):
    by_t = {r["context"]: r for r in rows}
    lo, hi = by_t.get(APPEND_CONTEXTS[0]), by_t.get(APPEND_CONTEXTS[-1])
    if lo is None or hi is None:
        return []
    amortised = hi["amortised_us"] / lo["amortised_us"]
    single = hi["single_median_us"] / lo["single_median_us"]
    return [f"ratio 32k/1k: amortised {amortised:.2f}x, single-append median {single:.2f}x"]


def bandwidth_lines(bandwidth):
    return [f"  {n} thread{'s' if n > 1 else ''}: {b['best_gbs']:.1f} GB/s best "
            f"({b['median_gbs']:.1f} median) over a {BANDWIDTH_BUFFER // MiB} MiB float32 buffer"
            for n, b in bandwidth.items()]


def notes(opts, rows):
    """Methodology lines printed under the decode table."""
    out = [(f"times: median ms per decode step (one layer's attend_all_heads) over "
            f"{opts.repeats} sweeps of every layer in the rotating working set (target "
            f"{opts.working_set / GiB:.3g} GiB, 'layers x MiB' column), after one warm-up sweep."),
           ("GB/s: bytes of K/V rows (+ q8 scales) read per step / time; %BW: of the measured "
            "read bandwidth at the same thread count.")]
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
    return out


def accuracy_warnings(rows, tol=1e-3):
    """Warn when kvcache disagrees with the reference or torch beyond ``tol`` (relative)."""
    for r in rows:
        for key in ("rel_err_vs_reference", "rel_err_vs_torch"):
            err = r.get(key)
            if err is not None and not err <= tol:
                log.warning("%s %s %s T=%d: %s = %.3g (> %g)", "kvcache", r["geometry"],
                            r["mode"], r["context"], key, err, tol)


def machine_info():
    """Facts that make a result reproducible: CPU, cache, versions, thread pools."""
    from ._config import config_info
    info = config_info()
    info["cpu_count"] = available_cpus()
    info["cpu_model"] = cpu_model()
    info["llc_bytes_reported"] = llc_bytes()
    return info


class BusyMonitor:
    """CPU time other processes used while the benchmark ran (Linux /proc/stat; else unknown).

    On a shared 2-core machine a compiler or test run beside the benchmark inflates timings,
    multi-threaded ones most; this measures it instead of guessing from the load average."""

    def __init__(self):
        self.start = self._sample()

    @staticmethod
    def _sample():
        try:
            import resource
            with open("/proc/stat") as f:
                vals = [int(x) for x in f.readline().split()[1:9]]
        except (ImportError, OSError, ValueError):
            return None
        busy = (sum(vals) - vals[3] - vals[4]) / os.sysconf("SC_CLK_TCK")   # minus idle, iowait
        own = resource.getrusage(resource.RUSAGE_SELF)
        return time.perf_counter(), busy, own.ru_utime + own.ru_stime

    def other_cores(self):
        """Average number of cores other processes kept busy since construction (None: unknown)."""
        end = self._sample()
        if self.start is None or end is None:
            return None
        wall, busy, own = (e - s for e, s in zip(end, self.start))
        return max(0.0, (busy - own) / wall) if wall > 0 else None


def warn_if_busy(monitor, info, threshold=0.2):
    other = monitor.other_cores()
    info["other_processes_cores"] = other
    if other is not None and other > threshold:
        log.warning("other processes kept %.2f cores busy on average during the run: timings "
                    "(multi-threaded ones most) may be inflated; rerun on an idle machine", other)


def available_cpus():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:                                   # not Linux
        return os.cpu_count() or 1


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def llc_bytes():
    """Size of the highest cache level sysfs reports for cpu0 (None when unknown)."""
    base = "/sys/devices/system/cpu/cpu0/cache"
    best = (0, None)
    try:
        entries = os.listdir(base)
    except OSError:
        return None
    for name in entries:
        try:
            with open(f"{base}/{name}/level") as f:
                level = int(f.read())
            with open(f"{base}/{name}/size") as f:
                size = f.read().strip()
        except (OSError, ValueError):
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        nbytes = int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
        best = max(best, (level, nbytes), key=lambda t: (t[0], t[1] or 0))
    return best[1]


def write_plot(path, rows, bandwidth):
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


def _line_style(threads, n):
    return "-" if n == threads[0] else ("--", ":", "-.")[threads.index(n) % 3 - 1]


def plot_series(rows):
    """{(implementation, mode, threads): [(context, ms, GB/s), ...]} from result rows."""
    series = {}
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


# ---------------------------------------------------------------------------------------- CLI
class _NoBar:
    """Stand-in for a tqdm bar when tqdm is not installed."""

    def update(self, n=1):
        pass

    def set_postfix_str(self, s):
        pass

    def close(self):
        pass


def progress_bar(total, enabled=True):
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    # disable=None: tqdm turns itself off when stderr is not a terminal (logs stay clean)
    return tqdm(total=total, disable=None if enabled else True, leave=False, unit="task",
                file=sys.stderr)


def parse_context(text):
    """'1k' -> 1024, '32K' -> 32768, '5000' -> 5000."""
    t = text.strip().lower()
    try:
        value = int(t[:-1]) * 1024 if t.endswith("k") else int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"context: expected an integer or Nk (e.g. 4096, 4k), got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"context must be >= 1, got {text!r}")
    return value


def parse_geometry(text):
    key = _GEOMETRY_ALIASES.get(text.lower(), text.lower())
    if key not in GEOMETRIES:
        raise argparse.ArgumentTypeError(
            f"unknown geometry {text!r}; choose from {', '.join(GEOMETRIES)} (or llama, qwen)")
    return GEOMETRIES[key]


def parse_mode(text):
    if text.lower() not in MODE_NAMES:
        raise argparse.ArgumentTypeError(f"unknown mode {text!r}; choose from f32, q8")
    return text.lower()


def parse_threads(text):
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"thread count must be >= 1, got {text!r}")
    return n


def _split(values, conv):
    """Flatten ``['1,2', '4']`` -> conv over ['1', '2', '4'], order kept, duplicates dropped."""
    if values is None:
        return None
    items = [conv(s) for v in values for s in v.split(",") if s.strip()]
    return list(dict.fromkeys(items))


def build_parser():
    p = argparse.ArgumentParser(
        prog="python -m kvcache bench",
        description="Decode-attention benchmark: kvcache vs the NumPy reference and torch SDPA, "
                    "over a working set larger than the last-level cache.")
    p.add_argument("--quick", action="store_true",
                   help="small subset (Llama, 1k and 16k, 3 repeats, 512 MiB working set)")
    p.add_argument("--contexts", nargs="+", metavar="T", help="contexts, e.g. 1k 4k 16k 32k")
    p.add_argument("--geometries", nargs="+", metavar="G", help="llama3-8b and/or qwen2.5-0.5b")
    p.add_argument("--modes", nargs="+", metavar="M", help="f32 and/or q8")
    p.add_argument("--threads", nargs="+", metavar="N",
                   help="thread counts (default: 1 and all available)")
    p.add_argument("--repeats", type=int,
                   help="timed sweeps per configuration (default 5, quick 3)")
    p.add_argument("--ref-repeats", type=int, help="timed reference calls (default 3, quick 2)")
    p.add_argument("--working-set-mib", type=int,
                   help="target bytes read per sweep, MiB (default 1024, quick 512)")
    p.add_argument("--no-torch", action="store_true", help="skip torch SDPA")
    p.add_argument("--no-reference", action="store_true", help="skip the NumPy reference")
    p.add_argument("--no-append", action="store_true", help="skip the append-cost section")
    p.add_argument("--append-repeats", type=int, default=201,
                   help="single appends timed at T (default 201)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write raw results as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG chart (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def resolve_options(args, parser):
    """Command-line arguments, with --quick defaults where an option was not given."""
    try:
        return _resolve_options(args)
    except (argparse.ArgumentTypeError, ValueError) as exc:
        parser.error(str(exc))                                # exits with status 2


def _resolve_options(args):
    quick = args.quick
    contexts = (_split(args.contexts, parse_context)
                or list(QUICK_CONTEXTS if quick else DEFAULT_CONTEXTS))
    geoms = _split(args.geometries, parse_geometry) or (
        [GEOMETRIES["llama3-8b"]] if quick else list(GEOMETRIES.values()))
    modes = _split(args.modes, parse_mode) or list(MODE_NAMES)
    threads = _split(args.threads, parse_threads) or sorted({1, available_cpus()})
    ws_mib = args.working_set_mib or (QUICK_WORKING_SET if quick else DEFAULT_WORKING_SET) // MiB
    torch_ok = not args.no_torch and import_torch()[0] is not None
    if not args.no_torch and not torch_ok:
        log.warning("torch is not installed: skipping the torch SDPA comparison")
    return Options(geometries=geoms, contexts=contexts, modes=modes, threads=threads,
                   repeats=max(1, args.repeats or (3 if quick else 5)),
                   ref_repeats=max(1, args.ref_repeats or (2 if quick else 3)),
                   working_set=ws_mib * MiB, torch=torch_ok, reference=not args.no_reference,
                   append=not args.no_append, append_repeats=max(1, args.append_repeats),
                   seed=args.seed)


def check_plot_backend():
    """Fail early (before the long run) when --plot is given without matplotlib."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return ("--plot needs matplotlib, which is not installed: "
                "pip install matplotlib (or pip install 'kvcache[bench]')")
    return None


def print_report(info, opts, bandwidth, rows, append_rows, file=sys.stdout):
    def p(*a):
        print(*a, file=file)

    llc = info["llc_bytes_reported"]
    llc_text = f"LLC reported {llc / MiB:.0f} MiB" if llc else "LLC size unknown"
    p(f"kvcache {info['kvcache']} decode-attention benchmark -- {info['cpu_model']}, "
      f"{info['cpu_count']} CPUs, {llc_text}")
    other = info.get("other_processes_cores")
    if other is not None:
        p(f"other processes kept {other:.2f} cores busy on average during the run "
          f"({'quiet' if other <= 0.2 else 'NOT quiet: timings may be inflated'})")
    p("measured read bandwidth (kvcache._core.stream_read):")
    for line in bandwidth_lines(bandwidth):
        p(line)
    p("")
    if rows:
        p(decode_table(rows))
        for line in notes(opts, rows):
            p("  " + line)
    if append_rows:
        p("")
        p("append cost (c.append(k_row, v_row), one position per call):")
        p(append_table(append_rows))
        for line in append_ratio_lines(append_rows):
            p("  " + line)


def write_json(path, info, opts, bandwidth, rows, append_rows):
    payload = {"machine": info,
               "options": {"geometries": [g.key for g in opts.geometries],
                           "contexts": opts.contexts, "modes": opts.modes,
                           "threads": opts.threads, "repeats": opts.repeats,
                           "ref_repeats": opts.ref_repeats,
                           "working_set_bytes": opts.working_set, "torch": opts.torch,
                           "reference": opts.reference, "seed": opts.seed},
               "bandwidth": {str(n): b for n, b in bandwidth.items()},
               "decode": rows, "append": append_rows}
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, default=str)


def main(argv=None):
    """Entry point of ``python -m kvcache bench``; returns the exit status."""
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(levelname)s: %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.plot:
        err = check_plot_backend()
        if err:
            print(err, file=sys.stderr)
            return 2
    opts = resolve_options(args, parser)
    info = machine_info()
    monitor = BusyMonitor()
    n_tasks = (len(opts.geometries) * len(opts.contexts) * (len(opts.modes) + opts.torch)
               + (len(APPEND_CONTEXTS) if opts.append else 0) + 1)
    bar = progress_bar(n_tasks, enabled=not args.no_progress)
    try:
        bar.set_postfix_str("bandwidth probe")
        bandwidth = measure_bandwidth(opts.threads)
        bar.update()
        rows = []
        for geom in opts.geometries:
            for context in opts.contexts:
                rows += run_context(geom, context, opts, bandwidth, bar)
        append_rows = run_append(opts, bar) if opts.append else []
    finally:
        bar.close()
    accuracy_warnings(rows)
    warn_if_busy(monitor, info)
    print_report(info, opts, bandwidth, rows, append_rows)
    if args.json:
        write_json(args.json, info, opts, bandwidth, rows, append_rows)
        print(f"raw results written to {args.json}")
    if args.plot and rows:
        write_plot(args.plot, rows, bandwidth)
        print(f"chart written to {args.plot}")
    return 0
