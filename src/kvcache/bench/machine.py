"""What the machine is (CPU, caches, versions) and whether other processes were busy.

Method: ``docs/benchmark-method.md``.
"""

from __future__ import annotations

import logging
import os
import platform
import time
from types import ModuleType
from typing import Any


log = logging.getLogger("kvcache.bench")


def import_torch() -> tuple[ModuleType, ModuleType] | tuple[None, None]:
    """torch and torch.nn.functional, or (None, None) when torch is not installed."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None, None
    return torch, F


def package_version(name: str) -> str:
    """The installed version of package ``name``, '?' when unknown."""
    try:
        from importlib.metadata import version
        return version(name)
    except Exception:                                        # noqa: BLE001 (metadata missing)
        return "?"


def filesystem_type(path: str) -> str | None:
    """Type of the filesystem holding ``path`` (Linux /proc/mounts; None when unknown)."""
    path = os.path.realpath(path)
    best: tuple[str, str | None] = ("", None)
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                inside = path == mnt or path.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best[0]):
                    best = (mnt, parts[2])
    except OSError:
        return None
    return best[1]


def machine_info() -> dict[str, Any]:
    """Facts that make a result reproducible: CPU, cache, versions, thread pools."""
    from .._config import config_info
    info: dict[str, Any] = config_info()
    info["cpu_count"] = available_cpus()
    info["cpu_model"] = cpu_model()
    info["llc_bytes_reported"] = llc_bytes()
    info["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return info


class BusyMonitor:
    """CPU time other processes used while the benchmark ran (Linux /proc/stat; else unknown).

    On a shared 2-core machine a compiler or test run beside the benchmark inflates timings,
    multi-threaded ones most; this measures it instead of guessing from the load average."""

    def __init__(self) -> None:
        self.start = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float] | None:
        try:
            import resource
            with open("/proc/stat") as f:
                vals = [int(x) for x in f.readline().split()[1:9]]
        except (ImportError, OSError, ValueError):
            return None
        busy = (sum(vals) - vals[3] - vals[4]) / os.sysconf("SC_CLK_TCK")   # minus idle, iowait
        # this process and its reaped children (the contention section's busy loop and
        # worker processes are the benchmark's own load, not other processes')
        own = resource.getrusage(resource.RUSAGE_SELF)
        kids = resource.getrusage(resource.RUSAGE_CHILDREN)
        return (time.perf_counter(), busy,
                own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime)

    def other_cores(self) -> float | None:
        """Average number of cores other processes kept busy since construction (None: unknown)."""
        end = self._sample()
        if self.start is None or end is None:
            return None
        wall, busy, own = (e - s for e, s in zip(end, self.start))
        return max(0.0, (busy - own) / wall) if wall > 0 else None


def warn_if_busy(monitor: BusyMonitor, info: dict[str, Any], threshold: float = 0.2) -> None:
    """Record in ``info`` how busy other processes were; warn above ``threshold`` cores."""
    other = monitor.other_cores()
    info["other_processes_cores"] = other
    if other is not None and other > threshold:
        log.warning("other processes kept %.2f cores busy on average during the run: timings "
                    "(multi-threaded ones most) may be inflated; rerun on an idle machine", other)


def available_cpus() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:                                   # not Linux
        return os.cpu_count() or 1


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo, else what platform says)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def llc_bytes() -> int | None:
    """Size of the highest cache level sysfs reports for cpu0 (None when unknown)."""
    base = "/sys/devices/system/cpu/cpu0/cache"
    best: tuple[int, int | None] = (0, None)
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
