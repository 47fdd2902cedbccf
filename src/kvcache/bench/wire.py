"""The wire section: export and import throughput of the byte formats (``kvcache.wire``), the
digest's cost and ``KvCache.save`` / ``load``.

Method: ``docs/benchmark-method.md``.
"""

from __future__ import annotations

import gc
import os
import statistics
import struct
import tempfile
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import wire
from ..layer import LayerKvCache
from ..model import KvCache
from ..modes import KvMode
from .geometry import GEOMETRIES, Geometry, MiB, make_mode, random_kv
from .machine import package_version, filesystem_type
from .registry import Context, Option, Result, Section, Values, at_least, parse_context, register
from .tables import Row, context_label, fmt, render_table, section_text
from .timing import Samples, timing_summary

if TYPE_CHECKING:
    from .._progress import ProgressBar

DigestFn = Callable[[bytes], int]   # a raw digest function over one buffer


WIRE_CONTEXT, QUICK_WIRE_CONTEXT = 32768, 4096
WIRE_REPEATS, QUICK_WIRE_REPEATS = 15, 5
WIRE_SAVE_LAYERS = 2         # layers of the KvCache.save / load model
# name -> (format, storage of the exported layer, f16): the export/import pairs of the wire section
WIRE_VARIANTS = {"f32": ("versioned", "f32", False),
                 "f32 as f16": ("versioned", "f32", True),
                 "q8": ("versioned", "q8", False),
                 "legacy f32": ("legacy", "f32", False),
                 "legacy f16": ("legacy", "f32", True)}
DIGEST_ALONE = "digest alone"  # the digest to_bytes writes, computed again over an f32 buffer


class WireLayers:
    """Llama-geometry layers holding the same ``context`` random rows, for the wire section.

    ``layers`` maps ``"f32"`` / ``"q8"`` (the storages in ``storages``) to a filled
    :class:`LayerKvCache`; ``model_layers`` > 0 also builds ``model``, a :class:`KvCache` of that
    many f32 layers holding the same rows (for ``save`` / ``load``).  :meth:`export` and
    :meth:`load` run one variant of :data:`WIRE_VARIANTS` (the timed calls).
    """

    def __init__(self, geom: Geometry, context: int, seed: int = 3,
                 storages: Sequence[str] = ("f32", "q8"), model_layers: int = 0) -> None:
        self.geom, self.context = geom, context
        nkv, hd = geom.num_kv_heads, geom.head_dim
        k, v = random_kv(geom, context, seed)
        self.layers: dict[str, LayerKvCache] = {}
        for name in storages:
            c = LayerKvCache(nkv, hd, mode=make_mode(name))
            c.append(k, v)
            self.layers[name] = c
        self.model: KvCache | None = None
        if model_layers:
            model = KvCache(model_layers, nkv, hd, max_seq_len=max(context, 1), mode=KvMode.F32)
            for c in model.layers:
                c.append(k, v)
            self.model = model
        del k, v

    @staticmethod
    def variant(name: str) -> tuple[str, str, bool]:
        """(format, storage, f16) of a :data:`WIRE_VARIANTS` name."""
        try:
            return WIRE_VARIANTS[name]
        except KeyError:
            raise ValueError(f"unknown wire variant {name!r}; choose from "
                             f"{', '.join(WIRE_VARIANTS)}") from None

    def layer_bytes(self, name: str) -> int:
        """``memory_bytes()`` of the layer that variant ``name`` exports."""
        return int(self.layers[self.variant(name)[1]].memory_bytes())

    def saved_model(self) -> KvCache:
        """The model of ``model_layers`` f32 layers (ValueError when none was built)."""
        if self.model is None:
            raise ValueError("this WireLayers was built without a model (model_layers=0)")
        return self.model

    def model_bytes(self) -> int:
        """``memory_bytes()`` of every layer of the model."""
        total = 0
        for c in self.saved_model().layers:
            total += int(c.memory_bytes())
        return total

    def export(self, name: str) -> bytes:
        """The buffer of variant ``name``: ``to_bytes`` or ``export_wire`` of its layer."""
        form, storage, f16 = self.variant(name)
        layer = self.layers[storage]
        buf: bytes = layer.export_wire(f16=f16) if form == "legacy" else layer.to_bytes(f16=f16)
        return buf

    @staticmethod
    def digest(buf: bytes) -> int:
        """The digest ``to_bytes`` stored at the end of ``buf``, computed again over the bytes
        before it with the wire module's own helper and algorithm (the checksum's cost alone)."""
        u8 = np.frombuffer(buf, dtype=np.uint8)
        return int(wire.digest(wire.default_algorithm(), u8[: len(u8) - 8]))

    @staticmethod
    def stored_digest(buf: bytes) -> int:
        """The digest written in the last 8 bytes of a versioned buffer."""
        return int(struct.unpack_from("<Q", buf, len(buf) - 8)[0])

    def target(self) -> LayerKvCache:
        """A fresh, empty layer to import into (the mode comes from the buffer)."""
        return LayerKvCache(self.geom.num_kv_heads, self.geom.head_dim, mode=KvMode.F32)

    def load(self, name: str, target: LayerKvCache, buf: bytes) -> None:
        """Install variant ``name``'s buffer into ``target`` (``install_bytes`` / ``import_wire``)."""
        if self.variant(name)[0] == "legacy":
            target.import_wire(buf)
        else:
            target.install_bytes(buf)

    def check(self, name: str, target: LayerKvCache) -> None:
        """Raise AssertionError unless ``target`` holds what variant ``name`` exported."""
        form, storage, f16 = self.variant(name)
        src = self.layers[storage]
        if target.seq_len != src.seq_len or target.mode != src.mode:
            raise AssertionError(f"wire {name}: round trip changed seq_len or mode "
                                 f"({target.seq_len}, {target.mode!r})")
        if storage == "q8":
            same = all((a is None and b is None)
                       or (a is not None and b is not None and np.array_equal(a, b))
                       for h in range(src.num_kv_heads)
                       for a, b in zip(src.q8_rows(h), target.q8_rows(h)))
        else:
            tol = 1e-3 if f16 else 0.0
            same = all(np.allclose(a, b, rtol=tol, atol=tol) for h in (0, src.num_kv_heads - 1)
                       for a, b in ((src.head_keys(h), target.head_keys(h)),
                                    (src.head_values(h), target.head_values(h))))
        if not same:
            raise AssertionError(f"wire {name}: round trip changed the rows")


def wire_digest_functions() -> dict[str, tuple[DigestFn, str]]:
    """{name: (function, library description)} of the raw digest functions the wire section
    times: ``xxhash.xxh3_64_intdigest`` and ``crc32c.crc32c`` when those packages are installed,
    ``zlib.crc32`` always."""
    fns: dict[str, tuple[DigestFn, str]] = {}
    try:
        import xxhash
    except ImportError:
        pass
    else:
        fns["xxhash.xxh3_64_intdigest"] = (xxhash.xxh3_64_intdigest,
                                           f"xxhash {package_version('xxhash')}")
    fns["zlib.crc32"] = (zlib.crc32, f"zlib {zlib.ZLIB_RUNTIME_VERSION}")
    try:
        # optional and untyped; pyproject's list of untyped packages does not name it yet
        import crc32c
    except ImportError:
        pass
    else:
        hw = getattr(crc32c, "hardware_based", None)
        how = "" if hw is None else (", hardware" if hw else ", software")
        fns["crc32c.crc32c"] = (crc32c.crc32c, f"crc32c {package_version('crc32c')}{how}")
    return fns


WIRE_SAVE_LOAD = "KvCache save/load"


def wire_round_robin(work: WireLayers, repeats: int, path: str, digests: Mapping[str, DigestFn],
                     bar: ProgressBar | None = None) -> tuple[dict[str, Samples], dict[str, int]]:
    """Interleaved wire timings (seconds).  Per repeat: every :data:`WIRE_VARIANTS` entry
    exports once and imports that buffer into a fresh layer, the f32 buffer's digest is
    computed again on its own (:meth:`WireLayers.digest`, timed as :data:`DIGEST_ALONE`) and the
    buffer is hashed by every function of ``digests``, then the buffer is dropped;
    ``work.model`` (when built) is saved to ``path`` and loaded.  Odd repeats run in reverse
    order.  One untimed warm-up round first, which also checks every round trip.

    Returns ``(samples, sizes)``: ``{"<variant> export" | "<variant> import" | "save" | "load"
    | "digest alone" | "digest <name>": [s, ...]}`` and ``{variant | "save": buffer or file
    bytes}``."""
    clock = time.perf_counter
    order = list(WIRE_VARIANTS) + ([WIRE_SAVE_LOAD] if work.model is not None else [])
    samples: dict[str, Samples] = {}
    sizes: dict[str, int] = {}
    gc_was_on = gc.isenabled()
    gc.disable()
    try:
        for r in range(repeats + 1):
            got = {}
            for name in (order if r % 2 == 0 else order[::-1]):
                if name == WIRE_SAVE_LOAD:
                    t0 = clock()
                    work.saved_model().save(path)
                    got["save"] = clock() - t0
                    sizes["save"] = os.path.getsize(path)
                    t0 = clock()
                    loaded = KvCache.load(path)
                    got["load"] = clock() - t0
                    if r == 0 and ([c.seq_len for c in loaded.layers]
                                   != [c.seq_len for c in work.saved_model().layers]):
                        raise AssertionError("wire: KvCache.load did not restore the model")
                    del loaded
                    gc.collect()
                    continue
                t0 = clock()
                buf = work.export(name)
                got[f"{name} export"] = clock() - t0
                sizes[name] = len(buf)
                target = work.target()
                t0 = clock()
                work.load(name, target, buf)
                got[f"{name} import"] = clock() - t0
                if r == 0:
                    work.check(name, target)
                del target
                if name == "f32":
                    t0 = clock()
                    digest = work.digest(buf)
                    got[DIGEST_ALONE] = clock() - t0
                    if r == 0 and digest != work.stored_digest(buf):
                        raise AssertionError("wire: the digest computed alone differs from the "
                                             "one to_bytes stored")
                    for d, fn in digests.items():
                        t0 = clock()
                        fn(buf)
                        got[f"digest {d}"] = clock() - t0
                del buf
                gc.collect()
            if r:                                            # round 0 is the warm-up
                for key, t in got.items():
                    samples.setdefault(key, []).append(t)
            if bar is not None:
                bar.update()
    finally:
        if gc_was_on:
            gc.enable()
    return samples, sizes


def _wire_call(form: str) -> str:
    return {"versioned": "to_bytes/install_bytes", "legacy": "export_wire/import_wire"}[form]


def wire_rows(work: WireLayers, samples: Mapping[str, Samples],
              sizes: Mapping[str, int]) -> list[Row]:
    """Table rows of the wire section (one per variant, then save/load)."""
    rows: list[Row] = []
    for name, (form, storage, f16) in WIRE_VARIANTS.items():
        nbytes = work.layer_bytes(name)
        row: Row = {"variant": name, "call": _wire_call(form), "format": form,
                    "storage": storage, "f16": f16,
                    "rows": f"{storage} -> f16" if f16 else storage,
                    "layer_bytes": nbytes, "buffer_bytes": sizes[name]}
        for op in ("export", "import"):
            key = f"{name} {op}"
            if key in samples:
                row.update({f"{op}_{k}": v
                            for k, v in timing_summary(samples[key], nbytes).items()})
        rows.append(row)
    if "save" in samples:
        nbytes = work.model_bytes()
        row = {"variant": WIRE_SAVE_LOAD, "call": "KvCache.save/load", "format": "versioned file",
               "storage": "f32", "f16": False, "rows": f"{len(work.saved_model().layers)} x f32",
               "layer_bytes": nbytes, "buffer_bytes": sizes["save"]}
        for op, key in (("export", "save"), ("import", "load")):
            row.update({f"{op}_{k}": v for k, v in timing_summary(samples[key], nbytes).items()})
        rows.append(row)
    return rows


def wire_digest_rows(samples: Mapping[str, Samples], digests: Mapping[str, tuple[DigestFn, str]],
                     nbytes: int) -> list[Row]:
    """Rows of the digest alone (what ``to_bytes`` computes) and of the raw digest functions,
    each over the ``nbytes`` f32 export buffer."""
    in_use = {wire.ALG_XXH3: "xxhash.xxh3_64_intdigest",
              wire.ALG_CRC32: "zlib.crc32"}[wire.default_algorithm()]
    alone = {"function": DIGEST_ALONE, "library": f"kvcache.wire ({_algorithm_name()})",
             "bytes": nbytes, "in_use": True}
    alone.update(timing_summary(samples[DIGEST_ALONE], nbytes))
    rows = [alone]
    for name, (_, library) in digests.items():
        row = {"function": name, "library": library, "bytes": nbytes, "in_use": name == in_use}
        row.update(timing_summary(samples[f"digest {name}"], nbytes))
        rows.append(row)
    return rows


def _algorithm_name() -> str:
    alg = wire.default_algorithm()
    return {wire.ALG_XXH3: "XXH3-64 (xxhash)", wire.ALG_CRC32: "CRC-32 (zlib)"}.get(alg, str(alg))


def wire_summary(rows: Sequence[Row], samples: Mapping[str, Samples], context: int) -> Row:
    """The f32 export and import rates and the digest's share of the export time, from the
    rows of one run (share = digest alone / f32 export: of the medians, of the best times, and
    the median of the per-repeat ratios)."""
    by = {r["variant"]: r for r in rows}
    e, d = samples["f32 export"], samples[DIGEST_ALONE]
    return {"context": context, "algorithm": wire.default_algorithm(),
            "algorithm_name": _algorithm_name(),
            "checksum_share": statistics.median(d) / statistics.median(e),
            "checksum_share_best": min(d) / min(e),
            "checksum_share_paired": statistics.median(b / a for a, b in zip(e, d)),
            "export_gbs": by["f32"]["export_gbs"], "import_gbs": by["f32"]["import_gbs"]}


def run_wire(ctx: Context, values: Values, bar: ProgressBar) -> Result:
    """The wire section: export/import of every byte format, the checksum's cost, the raw
    digest functions and KvCache save/load, one round-robin at ``values.context``."""
    geom = GEOMETRIES["llama3-8b"]
    t0 = time.perf_counter()
    bar.set_postfix_str(f"wire {context_label(values.context)} setup")
    work = WireLayers(geom, values.context, seed=ctx.seed + 3,
                      model_layers=WIRE_SAVE_LAYERS)
    bar.update()
    digests = wire_digest_functions()
    bar.set_postfix_str(f"wire {context_label(values.context)}")
    with tempfile.TemporaryDirectory(prefix="kvcache-bench-wire-") as folder:
        samples, sizes = wire_round_robin(work, values.repeats,
                                          os.path.join(folder, "model.kvcache"),
                                          {k: f for k, (f, _) in digests.items()}, bar)
        fs = filesystem_type(folder)
    rows = wire_rows(work, samples, sizes)
    result: dict[str, Any] = {"geometry": geom.label, "context": values.context,
              "repeats": values.repeats, "save_layers": WIRE_SAVE_LAYERS,
              "folder": os.path.dirname(folder), "filesystem": fs, "rows": rows,
              "digests": wire_digest_rows(samples, digests, sizes["f32"]),
              "digests_missing": [n for n in ("xxhash", "crc32c") if not any(
                  k.startswith(n) for k in digests)],
              "summary": wire_summary(rows, samples, values.context)}
    del work
    gc.collect()
    result["section_s"] = time.perf_counter() - t0
    return result


WIRE_HEADERS = ["call", "rows", "layer MiB", "buffer MiB", "export ms", "export GB/s",
                "import ms", "import GB/s", "best export GB/s", "best import GB/s"]


def wire_table(rows: Sequence[Row]) -> str:
    """The export / import table: one row per variant, then save/load."""
    body = [[r["call"], r["rows"], fmt(r["layer_bytes"] / MiB), fmt(r["buffer_bytes"] / MiB),
             fmt(r.get("export_ms")), fmt(r.get("export_gbs")), fmt(r.get("import_ms")),
             fmt(r.get("import_gbs")), fmt(r.get("export_best_gbs")),
             fmt(r.get("import_best_gbs"))] for r in rows]
    return render_table(WIRE_HEADERS, body)


def wire_digest_table(rows: Sequence[Row]) -> str:
    """The digest table: the digest alone, then each package's raw function."""
    body = [[r["function"] + (" (in use)" if r["in_use"] and r["function"] != DIGEST_ALONE
                              else ""), r["library"],
             fmt(r["bytes"] / MiB), fmt(r["ms"]), fmt(r["gbs"]), fmt(r["best_gbs"])]
            for r in rows]
    return render_table(["digest function", "package", "MiB", "ms", "GB/s", "best GB/s"], body)


def wire_notes(result: Mapping[str, Any]) -> list[str]:
    """Method, digest and summary lines printed under the wire tables."""
    s = result["summary"]
    ctx = context_label(result["context"])
    fs = f", {result['filesystem']}" if result.get("filesystem") else ""
    out = [(f"{result['geometry']} layer (8 KV heads, head_dim 128) holding {ctx} positions, "
            f"one thread; times: median ms over {result['repeats']} round-robin repeats (every "
            "variant once per repeat, odd repeats in reverse order, after one warm-up round "
            "that also checks every round trip); 'best': the fastest repeat (all samples in the "
            "JSON)."),
           ("GB/s: memory_bytes() of the exported layer(s) / time (1e9 bytes per GB); buffer "
            "MiB: bytes of the buffer (file).  Every export allocates a fresh buffer, so its time "
            "includes first-touch page faults; each import goes into a fresh LayerKvCache."),
           ("rows 'f32 -> f16': an f32 layer written with f16=True (imports as f32); 'q8': a "
            "KvMode.Q8() layer holding the same rows.  export_wire refuses q8 storage by design "
            "(the legacy layout describes F32 caches only), so it has no q8 row."),
           (f"KvCache.save/load: a model of {result['save_layers']} such f32 layers, file in a "
            f"temporary folder under {result['folder']}{fs}; save includes the fsync of the "
            "file and of the folder; load reads the file (still in the page cache) into memory, "
            "verifies it and copies the layers out."),
           (f"checksum: {s['algorithm_name']} (kvcache.wire.default_algorithm() = "
            f"{s['algorithm']}); 'digest alone': the digest to_bytes stores, computed again over "
            "the f32 export buffer by the wire module's own helper (checked against the stored "
            "one in the warm-up round); digest alone / f32 export = "
            f"{100 * s['checksum_share']:.1f}% (paired per repeat "
            f"{100 * s['checksum_share_paired']:.1f}%, best times "
            f"{100 * s['checksum_share_best']:.1f}%)."),
           ("digest rows: one pass over the whole f32 export buffer, in the same rounds, right "
            "after its import (a large buffer comes from DRAM); an export instead hashes each "
            "256 KiB piece right after copying it, while it is still in cache, so inside an "
            "export the digest may cost less than 'digest alone'.")]
    if result["digests_missing"]:
        out.append(f"not installed (not timed): {', '.join(result['digests_missing'])}")
    out.append(f"at {ctx}: f32 to_bytes export {s['export_gbs']:.2f} GB/s, f32 install_bytes "
               f"import {s['import_gbs']:.2f} GB/s, digest alone "
               f"{100 * s['checksum_share']:.1f}% of the export time.")
    out.append(f"wire section: {result['section_s']:.1f} s (data, layers, warm-up round and "
               "timings).")
    return out


def wire_report(ctx: Context, values: Values, result: Result) -> str:
    """The export / import table, the digest table and their notes."""
    digests = (f"the digest alone, and the digest functions of each package, over the "
               f"{fmt(result['digests'][0]['bytes'] / MiB)} MiB f32 export buffer:\n"
               + wire_digest_table(result["digests"]))
    return section_text("byte formats (kvcache.wire): export / import throughput, one layer:",
                        [wire_table(result["rows"]), digests], wire_notes(result))


SECTION = register(Section(
    name="wire", order=40,
    help="to_bytes/install_bytes, export_wire/import_wire, the checksum's cost, KvCache save/load",
    options=(Option("context", "positions of the section's layer", WIRE_CONTEXT, parse_context,
                    QUICK_WIRE_CONTEXT, metavar="T"),
             Option("repeats", "round-robin repeats", WIRE_REPEATS, at_least(1),
                    QUICK_WIRE_REPEATS, metavar="N")),
    tasks=lambda ctx, values: values.repeats + 2, run=run_wire, report=wire_report))
