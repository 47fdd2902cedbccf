"""Timers, thread-count limits and the read-bandwidth probe that every section uses.

Method: ``docs/benchmark-method.md``.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
import timeit
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from .. import _core
from .geometry import GiB

if TYPE_CHECKING:
    from threadpoolctl import threadpool_limits

Samples = list[float]                  # seconds, one per timed call (or sweep)
Bandwidth = dict[int, dict[str, Any]]  # thread count -> {"best_gbs", "median_gbs", ...}
Timing = dict[str, Any]                # ms / best_ms / gbs / best_gbs / samples_s of one call

BANDWIDTH_BUFFER = GiB


def time_repeats(fn: Callable[[], object], repeats: int, warmup: int = 1) -> Samples:
    """Seconds of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones (gc off, timeit)."""
    for _ in range(warmup):
        fn()
    return timeit.Timer(fn).repeat(repeat=repeats, number=1)


def rotated(names: Sequence[str], r: int) -> list[str]:
    """``names`` in their order rotated by ``r`` (A B C, B C A, C A B, ... for r = 0, 1, 2):
    round or prompt r's order, so that no side always runs first or last."""
    k = r % len(names) if names else 0
    return [*names[k:], *names[:k]]


def time_interleaved(fns: Mapping[str, Callable[[], object]], repeats: int, warmup: int = 1,
                     go_on: Callable[[dict[str, Samples]], bool] | None = None,
                     clock: Callable[[], float] = time.perf_counter) -> dict[str, Samples]:
    """Seconds of ``fns`` timed side by side: after ``warmup`` untimed calls of each, up to
    ``repeats`` rounds in which every function is called once (gc off while timing).

    Round r calls the functions in their order rotated by r (A B C, B C A, C A B, ...), so no
    function always runs first or last; sample r of every function comes from round r, which
    is what :func:`paired_ratio` pairs.  ``go_on`` (given the samples so
    far) may end the rounds early; the first round always runs.  ``clock`` is injectable for
    tests."""
    names = list(fns)
    samples: dict[str, Samples] = {name: [] for name in names}
    for _ in range(warmup):
        for name in names:
            fns[name]()
    enabled = gc.isenabled()
    gc.disable()
    try:
        for r in range(repeats):
            if r and go_on is not None and not go_on(samples):
                break
            for name in rotated(names, r):
                t0 = clock()
                fns[name]()
                samples[name].append(clock() - t0)
    finally:
        if enabled:
            gc.enable()
    return samples


def paired_ratio(slow: Sequence[float], fast: Sequence[float], slow_per: float = 1.0,
                 fast_per: float = 1.0) -> float:
    """How many times faster ``fast`` is than ``slow``: the median over rounds of
    ``(slow[r] / slow_per) / (fast[r] / fast_per)`` (``*_per``: steps a sample covers), for
    samples taken side by side (:func:`time_interleaved`).  Each round's two samples saw the
    same state of the machine, so the ratio holds while the machine drifts, where a ratio of
    two medians taken at different times need not."""
    if len(slow) != len(fast) or not slow:
        raise ValueError(f"paired_ratio needs as many samples on each side, at least one; got "
                         f"{len(slow)} and {len(fast)}")
    return float(statistics.median((s / slow_per) / (f / fast_per) for s, f in zip(slow, fast)))


def omp_threads(n: int) -> threadpool_limits:
    """kvcache's OpenMP thread count limited to ``n``."""
    from threadpoolctl import threadpool_limits
    return threadpool_limits(n, user_api="openmp")


def numpy_threads(n: int) -> threadpool_limits:
    """Every thread pool (BLAS included) limited to ``n``: for the NumPy reference."""
    from threadpoolctl import threadpool_limits
    return threadpool_limits(n)


@contextlib.contextmanager
def torch_threads(torch: ModuleType, n: int) -> Iterator[None]:
    """torch's intra-op thread count set to ``n``, restored on exit."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def measure_bandwidth(thread_counts: Iterable[int], nbytes: int = BANDWIDTH_BUFFER,
                      repeats: int = 5) -> Bandwidth:
    """Read bandwidth (GB/s) of ``_core.stream_read`` over an ``nbytes`` buffer per thread count.

    Returns ``{n: {"best_gbs", "median_gbs", "samples_s"}}``; "best" is the figure used.
    """
    buf = np.ones(nbytes // 4, dtype=np.float32)            # pages touched: not lazily zero
    result: Bandwidth = {}
    for n in thread_counts:
        samples = time_repeats(lambda: _core.stream_read(buf=buf, n_threads=n), repeats)
        result[n] = {"best_gbs": buf.nbytes / min(samples) / 1e9,
                     "median_gbs": buf.nbytes / statistics.median(samples) / 1e9,
                     "buffer_bytes": buf.nbytes, "samples_s": samples}
    return result


def pct_of_bandwidth(nbytes: float, seconds: float, bandwidth_gbs: float) -> float:
    """``nbytes`` read in ``seconds`` as % of ``bandwidth_gbs`` (1e9 bytes per GB)."""
    return 100.0 * nbytes / seconds / 1e9 / bandwidth_gbs


def remeasure_above_bandwidth(samples: Samples, measure: Callable[[], Samples],
                              pct: Callable[[Samples], float]) -> tuple[Samples, bool]:
    """``(samples, False)`` when ``pct(samples)`` is at most 100 (% of the measured bandwidth);
    otherwise ``(measure(), True)``: a reading above the bandwidth is taken once more (the
    report flags it if it stays above)."""
    if pct(samples) <= 100.0:
        return samples, False
    return measure(), True


def median_ms(samples: Sequence[float], per: int = 1) -> float:
    """Median of ``samples`` (seconds, each covering ``per`` steps) in ms per step."""
    return statistics.median(samples) / per * 1e3


def relative_error(a: npt.NDArray[np.floating[Any]], b: npt.NDArray[np.floating[Any]]) -> float:
    """max |a - b| / max(max |b|, 1e-30)."""
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


def timing_summary(samples: Samples, nbytes: int) -> Timing:
    """median / best ms and GB/s of ``nbytes`` per call."""
    med, best = statistics.median(samples), min(samples)
    return {"ms": med * 1e3, "best_ms": best * 1e3, "gbs": nbytes / med / 1e9,
            "best_gbs": nbytes / best / 1e9, "samples_s": samples}
