"""Timers, thread-count limits and the read-bandwidth probe that every section uses.

Method: ``docs/benchmark-method.md``.
"""

from __future__ import annotations

import contextlib
import statistics
import timeit

import numpy as np

from .. import _core
from .geometry import GiB


BANDWIDTH_BUFFER = GiB


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
                     "buffer_bytes": buf.nbytes, "samples_s": samples}
    return result


def pct_of_bandwidth(nbytes, seconds, bandwidth_gbs):
    """``nbytes`` read in ``seconds`` as % of ``bandwidth_gbs`` (1e9 bytes per GB)."""
    return 100.0 * nbytes / seconds / 1e9 / bandwidth_gbs


def remeasure_above_bandwidth(samples, measure, pct):
    """``(samples, False)`` when ``pct(samples)`` is at most 100 (% of the measured bandwidth);
    otherwise ``(measure(), True)``: a reading above the bandwidth is taken once more (the
    report flags it if it stays above)."""
    if pct(samples) <= 100.0:
        return samples, False
    return measure(), True


def median_ms(samples, per=1):
    """Median of ``samples`` (seconds, each covering ``per`` steps) in ms per step."""
    return statistics.median(samples) / per * 1e3


def relative_error(a, b):
    """max |a - b| / max(max |b|, 1e-30)."""
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


def _timing(samples, nbytes):
    """median / best ms and GB/s of ``nbytes`` per call."""
    med, best = statistics.median(samples), min(samples)
    return {"ms": med * 1e3, "best_ms": best * 1e3, "gbs": nbytes / med / 1e9,
            "best_gbs": nbytes / best / 1e9, "samples_s": samples}
