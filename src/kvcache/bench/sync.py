"""The sync section: what keeping a ``kvcache.device.Mirror`` in step costs per decode step,
per rollback and for a full re-upload.

Method: ``docs/benchmark-method.md``.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from ..latent import LatentKvCache
from ..layer import LayerKvCache
from ..modes import KvMode
from .geometry import F32, MiB
from .machine import import_torch
from .mla import MLA_RANK, MLA_ROPE
from .registry import (
    Context, Option, Result, Section, Values, at_least, one_of, parse_context, register)
from .tables import Row, context_label, fmt, fmt_ratio, render_table, section_text

if TYPE_CHECKING:
    from .._progress import ProgressBar
    from ..device.mirrors import SyncStats


# sync section: the cost of keeping a kvcache.device.Mirror in step
SYNC_CONTEXT, QUICK_SYNC_CONTEXT = 32768, 4096
SYNC_STEPS, QUICK_SYNC_STEPS = 101, 21
SYNC_FULL_REPEATS, QUICK_SYNC_FULL_REPEATS = 7, 3
SYNC_CASES = ("f32", "q8", "latent")
SYNC_ROLLBACK = (4, 5)       # truncate_last(4), then append 5: one speculative-decode round


class MirrorSync:
    """One layer of ``context`` positions and its :class:`kvcache.device.Mirror`.

    Parameters
    ----------
    case : {"f32", "q8", "latent"}
        Llama-3-8B attention (8 KV heads x 128) stored f32 or q8, or a DeepSeek-V2-Lite latent
        layer (``LatentKvCache`` slots 512 and 64, float32).
    context : int
    backend : {"torch", "numpy"}
        The mirror's backend (on the CPU device).
    spare : int
        Positions appended after the fill (the latent cache's capacity covers them).
    """

    NKV, HD = 8, 128

    def __init__(self, case: str, context: int, backend: str = "torch", seed: int = 0,
                 spare: int = 1024) -> None:
        from ..device import Mirror
        self.case = case
        rng = np.random.default_rng([seed, 0x53594E43])
        self.cache: LayerKvCache | LatentKvCache
        self.new: list[F32]
        if case == "latent":
            self.width = [(MLA_RANK,), (MLA_ROPE,)]
            latent = LatentKvCache.with_capacity(1, context + spare, self.width)
            for start in range(0, context, 4096):
                n = min(4096, context - start)
                latent.write_layer(0, [rng.standard_normal((n,) + w, dtype=np.float32)
                                       for w in self.width])
                latent.advance(n)
            self.cache = latent
            self.new = [rng.standard_normal((spare,) + w, dtype=np.float32) for w in self.width]
        else:
            mode = KvMode.F32 if case == "f32" else KvMode.Q8(True, True)
            layer = LayerKvCache(self.NKV, self.HD, mode)
            for start in range(0, context, 4096):
                n = min(4096, context - start)
                shape = (n, self.NKV, self.HD)
                layer.append(rng.standard_normal(shape, dtype=np.float32),
                             rng.standard_normal(shape, dtype=np.float32))
            self.cache = layer
            shape = (spare, self.NKV, self.HD)
            self.new = [rng.standard_normal(shape, dtype=np.float32) for _ in range(2)]
        self.used = 0
        self.mirror = Mirror(self.cache, backend=backend)
        self.initial = self.mirror.total

    def append(self, n: int = 1) -> None:
        """Append the next ``n`` spare positions to the cache."""
        a, self.used = self.used, self.used + n
        if isinstance(self.cache, LatentKvCache):
            self.cache.write_layer(0, [x[a: a + n] for x in self.new])
            self.cache.advance(n)
        else:
            self.cache.append(self.new[0][a: a + n], self.new[1][a: a + n])

    def timed_sync(self, full: bool = False) -> tuple[float, SyncStats]:
        """Seconds of one ``sync()`` and what it moved."""
        t0 = time.perf_counter()
        stats = self.mirror.sync(full=full)
        return time.perf_counter() - t0, stats

    def rollback(self) -> None:
        """One speculative-decode round: drop the last drafts, append the next ones."""
        if isinstance(self.cache, LatentKvCache):
            raise ValueError("the latent case has no rollback step (truncate_to is the same "
                             "operation)")
        drop, add = SYNC_ROLLBACK
        self.cache.truncate_last(drop)
        self.append(add)

    def seq_len(self) -> int:
        """Positions the cache holds now."""
        if isinstance(self.cache, LatentKvCache):
            return int(self.cache.cached_len)
        return int(self.cache.seq_len)


def run_sync_case(case: str, values: Values, backend: str, seed: int) -> Row:
    """Median decode-step, rollback-step and full re-upload costs of one mirrored layer."""
    steps, fulls = values.steps, values.full_repeats
    work = MirrorSync(case, values.context, backend, seed,
                      spare=steps + 2 + (steps * SYNC_ROLLBACK[1] if case != "latent" else 0))
    step_s: list[float] = []
    step_b: list[int] = []
    growth: list[Row] = []
    for _ in range(steps):
        work.append(1)
        t, st = work.timed_sync()
        if st.device_bytes:                 # the one step that doubled the device capacity
            growth.append({"ms": 1e3 * t, "device_bytes": st.device_bytes, "bytes": st.bytes})
            continue
        step_s.append(t)
        step_b.append(st.bytes)
    # every mirror kind has a capacity; the Mirror base class does not declare it
    capacity = getattr(work.mirror, "capacity")
    rec: Row = {"case": case, "context": values.context, "backend": backend,
                "device": str(work.mirror.device), "initial_bytes": work.initial.bytes,
                "step_ms": 1e3 * statistics.median(step_s),
                "step_bytes": statistics.median(step_b), "step_samples_s": step_s,
                "growth": growth, "capacity": capacity}
    if case != "latent":
        roll_s: list[float] = []
        roll_b: list[int] = []
        for _ in range(steps):
            work.rollback()
            t, st = work.timed_sync()
            if not st.device_bytes:
                roll_s.append(t)
                roll_b.append(st.bytes)
        rec.update(rollback_ms=1e3 * statistics.median(roll_s),
                   rollback_bytes=statistics.median(roll_b))
    full_s: list[float] = []
    full_b: list[int] = []
    for _ in range(fulls):
        t, st = work.timed_sync(full=True)
        full_s.append(t)
        full_b.append(st.bytes)
    rec.update(full_ms=1e3 * statistics.median(full_s), full_bytes=statistics.median(full_b),
               full_samples_s=full_s, context_at_end=work.seq_len())
    rec["bytes_ratio"] = rec["full_bytes"] / rec["step_bytes"] if rec["step_bytes"] else None
    rec["time_ratio"] = rec["full_ms"] / rec["step_ms"] if rec["step_ms"] else None
    del work
    gc.collect()
    return rec


def run_sync(ctx: Context, values: Values, bar: ProgressBar) -> Result:
    """The sync section: ``{"rows": [...], "backend": ...}``, a row per case of
    :data:`SYNC_CASES`; the backend is torch by default when it is installed, else NumPy."""
    backend = values.backend or ("torch" if import_torch()[0] is not None else "numpy")
    rows = []
    for case in SYNC_CASES:
        bar.set_postfix_str(f"sync {case}")
        rows.append(run_sync_case(case, values, backend, ctx.seed))
        bar.update()
    return {"rows": rows, "backend": backend}


def sync_table(rows: Sequence[Row]) -> str:
    """The sync table: one row per mirrored layer."""
    body = []
    for r in rows:
        roll = r.get("rollback_bytes")
        body.append([r["case"], context_label(r["context"]), f"{r['backend']}:{r['device']}",
                     f"{r['step_bytes'] / 1024:.3g}", fmt(r["step_ms"]),
                     "-" if roll is None else f"{roll / 1024:.3g}",
                     fmt(r.get("rollback_ms")), f"{r['full_bytes'] / MiB:.4g}",
                     fmt(r["full_ms"]), fmt_ratio(r["bytes_ratio"]), fmt_ratio(r["time_ratio"])])
    return render_table(["layer", "ctx", "mirror", "step KiB", "step ms", "rollback KiB",
                         "rollback ms", "full MiB", "full ms", "bytes full/step",
                         "time full/step"], body)


def sync_notes(rows: Sequence[Row], values: Values, backend: str) -> list[str]:
    """Method lines printed under the sync table."""
    out = [f"medians of {values.steps} steps / {values.full_repeats} full re-uploads; "
           f"a step appends one position and syncs; a rollback step is truncate_last"
           f"({SYNC_ROLLBACK[0]}) + append {SYNC_ROLLBACK[1]} + sync"]
    for r in rows:
        for g in r["growth"]:
            out.append(f"{r['case']}: one step grew the device capacity (doubling): "
                       f"{g['device_bytes'] / MiB:.4g} MiB copied device-to-device in "
                       f"{fmt(g['ms'])} ms (not in the step median)")
    if backend == "torch":
        out.append("the torch 'device' here is the CPU: a sync is a host memory copy; on a GPU "
                   "the same bytes cross the bus")
    return out


def sync_report(ctx: Context, values: Values, result: Result) -> str:
    """The sync table and its notes."""
    return section_text("device mirror sync (kvcache.device.Mirror): per decode step vs a full "
                        "re-upload, one layer:", [sync_table(result["rows"])],
                        sync_notes(result["rows"], values, result["backend"]))


SECTION = register(Section(
    name="sync", order=60,
    help="device-mirror sync per decode step vs a full re-upload",
    options=(Option("context", "positions of each mirrored layer", SYNC_CONTEXT, parse_context,
                    QUICK_SYNC_CONTEXT, metavar="T"),
             Option("steps", "decode steps timed per layer", SYNC_STEPS, at_least(1),
                    QUICK_SYNC_STEPS, metavar="N"),
             Option("full_repeats", "full re-uploads timed per layer", SYNC_FULL_REPEATS,
                    at_least(1), QUICK_SYNC_FULL_REPEATS, metavar="N"),
             Option("backend", "the mirrors' backend, torch or numpy (default: torch when "
                    "installed)", None, one_of("torch", "numpy"), metavar="B")),
    tasks=lambda ctx, values: len(SYNC_CASES), run=run_sync, report=sync_report))
