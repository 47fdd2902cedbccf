"""show_config(): what was built and what the thread pools look like."""

from __future__ import annotations

import platform
import sys
from typing import Any, Optional, TextIO


def _wire_digest() -> str:
    """Which digest the versioned byte format writes (kvcache.wire)."""
    from . import wire
    return wire.digest_name()


def config_info() -> dict[str, Any]:
    """The facts show_config prints, as a dict."""
    import numpy as np
    from . import _core, _omp
    from ._dispatch import FEATURES
    from ._threads import thread_settings
    from ._version import __version__

    ts = thread_settings()

    info: dict[str, Any] = {
        "kvcache": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "numpy": np.__version__,
        "openmp_built": _core.openmp_built(),
        "simd_built": _core.simd_built(),
        "cpu_features": " ".join(f for f in FEATURES if f in _core.cpu_features()) or "(none)",
        "isa": f"{_core.isa()} (cpu: {_core.isa_detected()}; build: {_core.isa_build()})",
        "isa_bodies": ", ".join(f"{fam} {body}" for fam, body in _core.bodies().items()),
        "threads": ts.max_threads,
        "omp_spin": _omp.SPIN,
        "thread_mode": (f"{ts.mode}: "
                        + (f"1 to {ts.max_threads}" if ts.adaptive else f"{ts.max_threads}")
                        + f" per call (OpenMP limit {ts.limit}"
                        + ("" if ts.cap is None else f", kvcache.threads cap {ts.cap}") + ")"),
        "thread_sampler": (f"{ts.sampler}, {ts.usable_cpus} usable CPUs, last sample "
                           + ("none" if ts.free_cpus is None else f"{ts.free_cpus} free")),
        "chunk_rows": _core.CHUNK_ROWS,
        "wire_digest": _wire_digest(),
    }
    try:
        from threadpoolctl import threadpool_info
        info["threadpools"] = [
            {k: d.get(k) for k in ("user_api", "internal_api", "num_threads", "version", "filepath")}
            for d in threadpool_info()
        ]
    except ImportError:  # threadpoolctl is a runtime dependency; keep show_config usable anyway
        info["threadpools"] = "threadpoolctl not installed"
    return info


def show_config(file: Optional[TextIO] = None) -> None:
    """Print kvcache's version, whether OpenMP was built in, the instruction-set path the kernels
    use (``cpu_features``: what the CPU reports; ``isa``: the limit in force, the CPU's most
    capable body, what the build holds; ``isa_bodies``: the body each kernel family runs --
    f32 decode, q8 scoring, prefill, mla; docs/numerics.md, "Dispatch"), its thread settings in this context
    (``kvcache.threads``: limit, mode, the free-CPU sampler), how OpenMP's idle workers wait
    (``omp_spin``: kvcache's libgomp spin default or what the environment set; docs/threads.md,
    "OpenMP's idle workers") and threadpoolctl's view."""
    info = config_info()
    out = file or sys.stdout
    for key in ("kvcache", "python", "platform", "numpy", "openmp_built", "simd_built",
                "cpu_features", "isa", "isa_bodies", "threads", "thread_mode", "thread_sampler",
                "omp_spin", "chunk_rows", "wire_digest"):
        print(f"{key:>14}: {info[key]}", file=out)
    print(f"{'threadpools':>14}:", file=out)
    pools = info["threadpools"]
    if isinstance(pools, str):
        print(f"{'':>16}{pools}", file=out)
    else:
        for pool in pools:
            print(f"{'':>16}{pool['user_api']}/{pool['internal_api']} threads={pool['num_threads']} "
                  f"version={pool['version']} ({pool['filepath']})", file=out)
