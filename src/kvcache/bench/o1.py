"""The O(1) section: the Nystrom decode step of a sealed layer against exact f32 and q8
attention (time, memory, error).

Method: ``docs/benchmark-method.md``.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _core
from ..layer import LayerKvCache
from ..modes import KvMode
from .geometry import F32, GEOMETRIES, Geometry, MiB, make_mode
from .registry import Context, Option, Result, Section, Values, at_least, parse_context, register
from .tables import Row, context_label, fmt, fmt_ratio, render_table, section_text
from .timing import Samples, median_ms, omp_threads

if TYPE_CHECKING:
    from .._progress import ProgressBar

QKV = tuple[F32, F32, F32]   # q (n, num_heads, head_dim), k and v (n, num_kv_heads, head_dim)


O1_CONTEXTS = (1024, 2048, 4096, 8192, 16384, 32768)
QUICK_O1_CONTEXTS = (1024, 4096)
O1_M, O1_W, O1_SINK = 32, 128, 4
O1_ERROR_STEPS = 16
O1_REPEATS, QUICK_O1_REPEATS = 21, 7
O1_BLOCK = 1024              # positions per generated block (data and prompt fill)
O1_FLUSH_BYTES = 256 * MiB   # buffer read before every timed O(1)-section call (cold caches)
O1_DATA = ("clustered", "iid")
#: every kind SyntheticStream makes: the table's, and "switch" (the topic changes every token)
O1_KINDS = O1_DATA + ("switch",)


class SyntheticStream:
    """Deterministic (q, k, v) rows of a synthetic sequence, float32, for the O(1) section.

    ``kind`` is ``"clustered"`` (keys around slowly drifting cluster centres, the sequence in
    64-position topic runs, queries correlated with their topic's keys, values around
    per-cluster centres; see docs/benchmark-method.md), ``"switch"`` (the same with a new
    topic at every position: no segment is about one topic) or ``"iid"`` (independent standard
    normal).
    Positions are generated in blocks of ``block`` from a seed per (seed, kind, block index), so
    the rows of a position do not depend on how they are requested: a shorter prompt is a
    prefix of a longer one and ``rows(context, n)`` continues either.
    """

    CLUSTERS = 8            # key clusters per KV head
    RUN = 64                # positions per topic run (one cluster)
    PERIOD = 16384          # positions per turn of a centre's drift
    DRIFT = 0.5             # drift amplitude (centres are N(0, I) + DRIFT * circle)
    KEY_NOISE = 0.5
    QUERY_GAIN = 0.25       # query = QUERY_GAIN * centre + N(0, I)

    def __init__(self, geom: Geometry, kind: str = "clustered", seed: int = 0,
                 block: int = O1_BLOCK) -> None:
        if kind not in O1_KINDS:
            raise ValueError(f"kind: expected one of {O1_KINDS}, got {kind!r}")
        if block % self.RUN:
            raise ValueError(f"block must be a multiple of {self.RUN}, got {block}")
        self.geom, self.kind, self.seed, self.block = geom, kind, seed, block
        self._kind_id = O1_KINDS.index(kind)
        self._run = 1 if kind == "switch" else self.RUN
        if kind != "iid":
            rng = np.random.default_rng([seed, self._kind_id, 0xC1])
            shape = (geom.num_kv_heads, self.CLUSTERS, geom.head_dim)
            self.base = rng.standard_normal(shape, dtype=np.float32)
            self.drift_a = rng.standard_normal(shape, dtype=np.float32) * np.float32(self.DRIFT)
            self.drift_b = rng.standard_normal(shape, dtype=np.float32) * np.float32(self.DRIFT)
            self.phase = rng.uniform(0, 2 * np.pi, self.CLUSTERS)
            self.value_centres = rng.standard_normal(shape, dtype=np.float32)

    def _block(self, b: int) -> QKV:
        g, n = self.geom, self.block
        nh, nkv, hd = g.num_heads, g.num_kv_heads, g.head_dim
        rng = np.random.default_rng([self.seed, self._kind_id, b])
        if self.kind == "iid":
            return (rng.standard_normal((n, nh, hd), dtype=np.float32),
                    rng.standard_normal((n, nkv, hd), dtype=np.float32),
                    rng.standard_normal((n, nkv, hd), dtype=np.float32))
        z = rng.integers(0, self.CLUSTERS, n // self._run).repeat(self._run)        # (n,)
        pos = b * n + np.arange(n)
        theta = (2 * np.pi * pos / self.PERIOD + self.phase[z]).astype(np.float32)
        cos, sin = np.cos(theta)[:, None], np.sin(theta)[:, None]
        centre = np.empty((n, nkv, hd), dtype=np.float32)
        for h in range(nkv):
            centre[:, h] = (self.base[h, z] + self.drift_a[h, z] * cos
                            + self.drift_b[h, z] * sin)
        k = centre + np.float32(self.KEY_NOISE) * rng.standard_normal(centre.shape,
                                                                      dtype=np.float32)
        v = self.value_centres[:, z].transpose(1, 0, 2) + rng.standard_normal(
            (n, nkv, hd), dtype=np.float32)
        q = rng.standard_normal((n, nh, hd), dtype=np.float32)
        q += np.float32(self.QUERY_GAIN) * np.repeat(centre, nh // nkv, axis=1)
        return q, k, v

    def rows(self, start: int, n: int) -> QKV:
        """q (n, num_heads, head_dim), k and v (n, num_kv_heads, head_dim) of positions
        start .. start + n - 1."""
        parts: list[QKV] = []
        b0, b1 = start // self.block, (start + n - 1) // self.block
        for b in range(b0, b1 + 1):
            lo = max(start, b * self.block) - b * self.block
            hi = min(start + n, (b + 1) * self.block) - b * self.block
            blk = self._block(b)
            q, k, v = blk
            parts.append((q[lo:hi], k[lo:hi], v[lo:hi]) if (lo, hi) != (0, self.block) else blk)
        if len(parts) == 1:
            return parts[0]
        qs, ks, vs = zip(*parts)
        return np.concatenate(qs), np.concatenate(ks), np.concatenate(vs)


class O1Decode:
    """A sealed O(1) layer and exact layers holding the same ``context``-position prompt.

    Parameters
    ----------
    geom : Geometry
    context : int
        Prompt positions (sealed into the O(1) state; rows of the exact layers).
    data : {"clustered", "iid"}
        :class:`SyntheticStream` kind.
    exact_modes : sequence of {"f32", "q8"}
        Exact layers to build beside the O(1) one.
    decode_steps : int
        Decode positions after the prompt to keep ready (``self.q/k/v[i]``).
    with_o1 : bool
        False: exact layers only (no query trace, no seal; ``o1`` is None).
    keep, ridge :
        ``LayerKvCache.o1_begin``'s far-field options (defaults: the specified operator).

    The seal runs in the constructor (``seal_s`` its seconds, at the current OpenMP thread
    count).  :meth:`rollback` puts every layer back to the end of the prompt.
    """

    def __init__(self, geom: Geometry, context: int, data: str = "clustered",
                 exact_modes: Sequence[str] = ("f32", "q8"), seed: int = 0, m: int = O1_M,
                 w: int = O1_W, sink: int = O1_SINK, decode_steps: int = O1_ERROR_STEPS,
                 with_o1: bool = True, keep: int = 0, ridge: float = 1e-6) -> None:
        self.geom, self.context, self.data = geom, context, data
        nkv, nh, hd = geom.num_kv_heads, geom.num_heads, geom.head_dim
        stream = SyntheticStream(geom, data, seed)
        o1 = LayerKvCache(nkv, hd, mode=KvMode.F32) if with_o1 else None
        self.o1 = o1
        if o1 is not None:
            o1.o1_begin(m, w, sink, keep=keep, ridge=ridge)
        self.exact = {name: LayerKvCache(nkv, hd, mode=make_mode(name)) for name in exact_modes}
        for start in range(0, context, stream.block):
            q, k, v = stream.rows(start, min(stream.block, context - start))
            if o1 is not None:
                o1.o1_push_q(q)
                o1.append(k, v)
            for c in self.exact.values():
                c.append(k, v)
            del q, k, v
        self.seal_s: float | None = None
        self.snapshot: Any = None            # what o1_snapshot() returns, for o1_restore()
        if o1 is not None:
            t0 = time.perf_counter()
            if not o1.o1_seal(nh):
                raise RuntimeError(f"o1_seal refused a {context}-position prompt (see the log)")
            self.seal_s = time.perf_counter() - t0
            self.snapshot = o1.o1_snapshot()
        self.q, self.k, self.v = stream.rows(context, max(1, decode_steps))
        self.out = np.empty((nh, hd), dtype=np.float32)

    def sealed(self) -> LayerKvCache:
        """The sealed O(1) layer (ValueError when built with ``with_o1=False``)."""
        if self.o1 is None:
            raise ValueError("this O1Decode has no O(1) layer (with_o1=False)")
        return self.o1

    def o1_step(self, i: int = 0) -> F32:
        """One O(1) decode step with decode position ``i``'s (q, k, v); returns the output."""
        out: F32 = self.sealed().o1_step(self.q[i], self.k[i], self.v[i], self.geom.num_heads)
        return out

    def exact_step(self, mode_name: str, i: int = 0) -> F32:
        """One exact decode step: append position ``i``'s (k, v), attend its q (into ``out``)."""
        c = self.exact[mode_name]
        c.append(self.k[i], self.v[i])
        out: F32 = c.attend_all_heads(self.q[i], out=self.out)
        return out

    def rollback(self) -> None:
        """O(1) layer back to its post-seal snapshot, exact layers back to ``context`` rows."""
        if self.o1 is not None:
            self.o1.o1_restore(self.snapshot)
        for c in self.exact.values():
            c.truncate_last(c.seq_len - self.context)

    def errors(self, steps: int = O1_ERROR_STEPS) -> dict[str, float]:
        """Relative L2 error against exact f32 over ``steps`` decode steps (then rolled back):
        ``{"o1": ..., "q8": ...}`` (q8 when that layer exists)."""
        if "f32" not in self.exact:
            raise ValueError("errors() needs an exact f32 layer")
        outs: dict[str, list[F32]] = {name: [] for name in ("o1", *self.exact)}
        for i in range(steps):
            outs["o1"].append(self.o1_step(i))
            for name in self.exact:
                outs[name].append(self.exact_step(name, i).copy())
        self.rollback()
        ref = np.stack(outs.pop("f32")).astype(np.float64)
        norm = max(float(np.linalg.norm(ref)), 1e-30)
        return {name: float(np.linalg.norm(np.stack(o) - ref) / norm)
                for name, o in outs.items()}

    def state_bytes(self) -> int:
        """``memory_bytes()`` of the sealed layer (its KV released: the O(1) state)."""
        return int(self.sealed().memory_bytes())

    def exact_bytes(self, mode_name: str) -> int:
        """``memory_bytes()`` of the exact ``mode_name`` layer."""
        return int(self.exact[mode_name].memory_bytes())


def o1_round_robin(work: O1Decode, n_threads: int, repeats: int, flush_buf: F32,
                   flush_threads: int) -> dict[str, Samples]:
    """Interleaved step timings (seconds) at ``n_threads``: per repeat, after a rollback, a cold
    O(1) step, a warm O(1) step, then one cold exact step per exact layer (each exact step's
    truncate_last(1) untimed).  One untimed warm-up round first.  Returns {name: [s, ...]}."""
    clock = time.perf_counter
    names = ("o1", "o1_warm", *work.exact)
    samples: dict[str, Samples] = {name: [] for name in names}
    gc_was_on = gc.isenabled()
    gc.disable()
    try:
        with omp_threads(n_threads):
            for r in range(repeats + 1):
                work.rollback()
                _core.stream_read(buf=flush_buf, n_threads=flush_threads)
                t0 = clock()
                work.o1_step()
                t1 = clock()
                work.o1_step()
                t2 = clock()
                got = {"o1": t1 - t0, "o1_warm": t2 - t1}
                for name, c in work.exact.items():
                    _core.stream_read(buf=flush_buf, n_threads=flush_threads)
                    t0 = clock()
                    work.exact_step(name)
                    got[name] = clock() - t0
                    c.truncate_last(1)
                if r:                                        # round 0 is the warm-up
                    for name in names:
                        samples[name].append(got[name])
            work.rollback()
    finally:
        if gc_was_on:
            gc.enable()
    return samples


def run_o1_context(context: int, ctx: Context, repeats: int, flush_buf: F32,
                   bar: ProgressBar) -> list[Row]:
    """O(1) rows (one per thread count) at one context: iid error first (its layers freed),
    then the clustered layers for the error, the memory and the round-robin timings."""
    geom = GEOMETRIES["llama3-8b"]
    top = max(ctx.threads)
    with omp_threads(top):
        bar.set_postfix_str(f"o1 {context_label(context)} iid")
        work = O1Decode(geom, context, "iid", exact_modes=("f32",), seed=ctx.seed)
        err_iid = work.errors(O1_ERROR_STEPS)["o1"]
        del work
        gc.collect()
        bar.set_postfix_str(f"o1 {context_label(context)} clustered")
        work = O1Decode(geom, context, "clustered", exact_modes=("f32", "q8"), seed=ctx.seed)
        err = work.errors(O1_ERROR_STEPS)
    base: Row = {"geometry": geom.label, "context": context, "m": O1_M, "w": O1_W, "sink": O1_SINK,
                 "seal_threads": top, "seal_s": work.seal_s,
                 "state_bytes": work.state_bytes(),
                 "o1_memory_bytes": work.sealed().o1_memory_bytes(),
                 "f32_bytes": work.exact_bytes("f32"), "q8_bytes": work.exact_bytes("q8"),
                 "rel_err_clustered": err["o1"], "rel_err_iid": err_iid,
                 "rel_err_q8_clustered": err["q8"], "error_steps": O1_ERROR_STEPS}
    base["memory_ratio_f32"] = base["f32_bytes"] / base["state_bytes"]
    base["memory_ratio_q8"] = base["q8_bytes"] / base["state_bytes"]
    rows = []
    for n in ctx.threads:
        bar.set_postfix_str(f"o1 {context_label(context)} {n}t")
        samples = o1_round_robin(work, n, repeats, flush_buf, top)
        row = dict(base, threads=n, repeats=repeats,
                   o1_ms=median_ms(samples["o1"]), o1_warm_ms=median_ms(samples["o1_warm"]),
                   f32_ms=median_ms(samples["f32"]), q8_ms=median_ms(samples["q8"]),
                   samples_s=samples)
        row["speedup_vs_f32"] = row["f32_ms"] / row["o1_ms"]
        row["speedup_vs_q8"] = row["q8_ms"] / row["o1_ms"]
        rows.append(row)
    del work
    gc.collect()
    bar.update()
    return rows


def run_o1(ctx: Context, values: Values, bar: ProgressBar) -> Result:
    """The O(1) section: rows for every O(1) context and thread count, one context at a time,
    and the seconds the section took."""
    flush_buf = np.ones(O1_FLUSH_BYTES // 4, dtype=np.float32)    # pages touched
    rows: list[Row] = []
    t0 = time.perf_counter()
    for context in values.contexts:
        rows += run_o1_context(context, ctx, values.repeats, flush_buf, bar)
    return {"rows": rows, "section_s": time.perf_counter() - t0, "m": O1_M, "w": O1_W,
            "sink": O1_SINK, "error_steps": O1_ERROR_STEPS, "flush_bytes": O1_FLUSH_BYTES}


O1_HEADERS = ["ctx", "thr", "O(1) ms", "O(1) warm ms", "f32 ms", "q8 ms", "f32/O(1)", "q8/O(1)",
              "state MiB", "f32 KV MiB", "q8 KV MiB", "f32 KV/state", "seal s",
              "err clustered", "err iid", "q8 err"]


def o1_table(rows: Sequence[Row]) -> str:
    """The O(1) table: one row per (context, thread count)."""
    body = []
    for r in rows:
        body.append([context_label(r["context"]), r["threads"], fmt(r["o1_ms"]),
                     fmt(r["o1_warm_ms"]), fmt(r["f32_ms"]), fmt(r["q8_ms"]),
                     fmt_ratio(r["speedup_vs_f32"]), fmt_ratio(r["speedup_vs_q8"]),
                     fmt(r["state_bytes"] / MiB), fmt(r["f32_bytes"] / MiB),
                     fmt(r["q8_bytes"] / MiB), fmt_ratio(r["memory_ratio_f32"]),
                     fmt(r["seal_s"]), f"{r['rel_err_clustered']:.3g}",
                     f"{r['rel_err_iid']:.3g}", f"{r['rel_err_q8_clustered']:.2g}"])
    return render_table(O1_HEADERS, body)


def o1_summary(rows: Sequence[Row]) -> dict[int, Row]:
    """Ratios per thread count, from the rows of one run.

    Returns ``{threads: {...}}`` with the smallest and largest context, the flatness (O(1) step
    at the largest / at the smallest context, cold and warm) and, at the largest context, the
    exact f32 / O(1) step time and the f32 KV / O(1) state memory."""
    out: dict[int, Row] = {}
    for n in sorted({r["threads"] for r in rows}):
        mine = sorted((r for r in rows if r["threads"] == n), key=lambda r: r["context"])
        lo, hi = mine[0], mine[-1]
        out[n] = {"smallest_context": lo["context"], "largest_context": hi["context"],
                  "flatness": hi["o1_ms"] / lo["o1_ms"],
                  "flatness_warm": hi["o1_warm_ms"] / lo["o1_warm_ms"],
                  "speedup_vs_f32": hi["speedup_vs_f32"],
                  "memory_ratio_f32": hi["memory_ratio_f32"]}
    return out


def o1_notes(ctx: Context, values: Values, rows: Sequence[Row], section_s: float) -> list[str]:
    """Method and ratio lines printed under the O(1) table."""
    out = [(f"Llama-3-8B layer (32 heads, 8 KV heads, head_dim 128), O(1) m={O1_M} w={O1_W} "
            f"sink={O1_SINK}; times: median ms per decode step over {values.repeats} round-robin "
            f"repeats (O(1), exact f32, exact q8 timed alternately, after one warm-up round)."),
           (f"every timed call starts cold: a {O1_FLUSH_BYTES // MiB} MiB buffer is read before "
            "it; 'O(1) warm' is a second o1_step right after the cold one (state in cache)."),
           ("O(1) ms: o1_step on the sealed layer, rolled back (o1_restore, untimed) before "
            "each repeat; f32/q8 ms: append(k, v) + attend_all_heads(q) of the newest position "
            "over context rows, truncate_last(1) after the timer (untimed)."),
           ("f32/O(1), q8/O(1): exact step / O(1) step; state MiB: memory_bytes() of the sealed "
            "layer (KV released); f32/q8 KV MiB: memory_bytes() of the exact layers at ctx; "
            f"seal s: o1_seal (replay included) at {max(ctx.threads)} thread(s), not in any "
            "step time."),
           (f"err: relative L2 ||o1 - exact f32|| / ||exact f32|| over {O1_ERROR_STEPS} decode "
            "steps (same q/k/v to both); 'clustered' data: keys around 8 slowly drifting "
            "cluster centres per KV head in 64-position topic runs, queries = 0.25 * their "
            "topic's centre + noise, values around per-cluster centres; 'iid': q, k, v "
            "independent N(0, 1) (near-uniform attention, the hard case); q8 err: exact q8 vs "
            "exact f32 on the clustered data, for scale.  Details: docs/benchmark-method.md."),
           ]
    for n, s in o1_summary(rows).items():
        lo, hi = context_label(s["smallest_context"]), context_label(s["largest_context"])
        out.append(f"{n} thread{'s' if n > 1 else ''}: O(1) step {hi}/{lo} = {s['flatness']:.2f}x "
                   f"(warm {s['flatness_warm']:.2f}x); at {hi}: exact f32 / O(1) = "
                   f"{s['speedup_vs_f32']:.1f}x, f32 KV / state = {s['memory_ratio_f32']:.1f}x")
    out.append(f"O(1) section: {section_s:.1f} s (data generation, seals, accuracy steps and "
               "timings).")
    return out


def o1_report(ctx: Context, values: Values, result: Result) -> str:
    """The O(1) table, its method and the ratios per thread count."""
    rows = result["rows"]
    return section_text("O(1) Nystrom decode (o1_step on a sealed layer) vs exact "
                        "attend_all_heads, one layer:", [o1_table(rows)],
                        o1_notes(ctx, values, rows, result["section_s"]))


def o1_json(result: Result) -> Result:
    """The section's JSON object: the result and the ratios per thread count."""
    return {**result, "summary": {str(n): s for n, s in o1_summary(result["rows"]).items()}}


SECTION = register(Section(
    name="o1", order=30,
    help="the O(1) Nystrom decode step of a sealed layer vs exact f32/q8 (time, memory, error)",
    options=(Option("contexts", "contexts of the O(1) section", O1_CONTEXTS, parse_context,
                    QUICK_O1_CONTEXTS, many=True, metavar="T"),
             Option("repeats", "round-robin repeats", O1_REPEATS, at_least(1), QUICK_O1_REPEATS,
                    metavar="N")),
    tasks=lambda ctx, values: len(values.contexts), run=run_o1, report=o1_report,
    to_json=o1_json))
