"""How many threads a kernel call uses: the policy, its sampler and the caller's control.

Every compiled kernel takes its thread count from :func:`threads_for`, called once per kernel
call in Python with the call's size.  The count is the smallest of

- the OpenMP limit (``omp_get_max_threads``: ``threadpoolctl.threadpool_limits(n,
  user_api="openmp")`` and ``OMP_NUM_THREADS`` set it) and the cap of :func:`threads`;
- the call's independent tasks (a thread without a task only adds a fork-join member);
- ``work // MIN_WORK_PER_THREAD`` (below ``2 * MIN_WORK_PER_THREAD`` multiply-adds a call stays
  on the calling thread);
- the CPUs that are free right now (:class:`Sampler`): the CPUs this process may use, less the
  runnable threads of everything else -- other processes, other Python threads, BLAS workers
  that spin after a product.  An OpenMP fork-join waits for its slowest member, so a team
  larger than the free CPUs waits for a descheduled thread (docs/threads.md has the
  measurements); one that fits does not.

``kvcache.threads(n, adaptive=False)`` forces a count (the benchmark's "forced 1" and "forced
all"), still capped by the OpenMP limit.  Results are bit-identical for every count: the
kernels split their sums by row index, never by thread (docs/numerics.md).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import threading
import time
from collections.abc import Iterator
from typing import NamedTuple, Optional

from . import _core

__all__ = ["MIN_WORK_PER_THREAD", "SAMPLE_TTL", "Sampler", "ThreadSettings", "choose",
           "sampler", "thread_settings", "threads", "threads_for"]

MIN_WORK_PER_THREAD = 1 << 18
"""Multiply-adds a thread must get (about 30-60 us on one core) before it is worth waking."""

SAMPLE_TTL = 0.002
"""Seconds a sample of the free CPUs is reused by the calls of one Python thread."""


def choose(work: int, tasks: int, limit: int, free: Optional[int] = None) -> int:
    """The thread count for a call: the pure rule :func:`threads_for` applies.

    Parameters
    ----------
    work : int
        Multiply-adds of the call (>= 0).
    tasks : int
        Independent pieces the call splits into (>= 0).
    limit : int
        The most threads allowed (>= 1): the OpenMP limit, or a smaller cap.
    free : int, optional
        CPUs free for this call counting the calling thread's own (None: unknown, the
        work-size rule alone decides).

    Returns
    -------
    int
        ``min(limit, tasks, work // MIN_WORK_PER_THREAD, free)``, at least 1.
    """
    if limit < 1:
        raise ValueError(f"limit: expected >= 1, got {limit}")
    n = min(limit, tasks, work // MIN_WORK_PER_THREAD)
    if free is not None:
        n = min(n, free)
    return max(1, n)


def _stat_state(fd: int) -> str:
    """The one-letter state of a /proc/<pid>/task/<tid>/stat file kept open on ``fd``."""
    line = os.pread(fd, 256, 0)
    i = line.rfind(b")")
    return chr(line[i + 2]) if 0 <= i < len(line) - 2 else "?"


class _TeamTids(threading.local):
    """The kernel thread ids of the calling Python thread's OpenMP team (thread 0 = itself)."""

    size = 0
    fds: tuple[int, ...] = ()

    def close(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = ()
        self.size = 0


class _Cached(threading.local):
    at = -1.0
    free: Optional[int] = None


class Sampler:
    """Free CPUs from ``/proc``: usable CPUs less the runnable threads of everyone else.

    Field 4 of ``/proc/loadavg`` counts the threads runnable on the host right now
    (``running/total``).  The calling thread is one of them, and the workers of its own OpenMP
    team may be too (they spin for a while after a parallel region): those are read from
    ``/proc/self/task/<tid>/stat`` and not counted.  Everything else competes.  The host's
    CPUs (``os.cpu_count()``, the scale of ``/proc/loadavg`` also in a container) less the
    competitors, capped by the CPUs this process may run on (``os.sched_getaffinity``), is the
    answer.  Without ``/proc`` there is no sample (None).
    """

    def __init__(self, loadavg: str = "/proc/loadavg") -> None:
        self.host = os.cpu_count() or 1
        try:
            self.usable = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            self.usable = self.host
        self._team = _TeamTids()
        self._cached = _Cached()
        self.last: Optional[int] = None
        try:
            self._fd: Optional[int] = os.open(loadavg, os.O_RDONLY)
            self._running()
        except (OSError, ValueError, IndexError):
            self._fd = None

    @property
    def available(self) -> bool:
        """Whether samples can be taken here."""
        return self._fd is not None

    def _running(self) -> int:
        assert self._fd is not None
        fields = os.pread(self._fd, 128, 0).split()
        return int(fields[3].split(b"/")[0])

    def _own_running(self, limit: int) -> int:
        """How many workers of the calling thread's OpenMP team (of ``limit``) are runnable."""
        team = self._team
        if team.size != limit:
            team.close()
            fds = []
            for tid in _core.thread_ids(limit)[1:]:
                if tid > 0:
                    with contextlib.suppress(OSError):
                        fds.append(os.open(f"/proc/self/task/{int(tid)}/stat", os.O_RDONLY))
            team.fds = tuple(fds)
            team.size = limit
        n = 0
        for fd in team.fds:
            try:
                n += _stat_state(fd) == "R"
            except OSError:        # the worker is gone: capture the team again next time
                team.size = 0
        return n

    def sample(self, limit: int) -> Optional[int]:
        """Free CPUs now, counting the caller's own (None when unavailable); a fresh read."""
        if self._fd is None:
            return None
        try:
            others = self._running() - 1
            free = min(self.usable, self.host - others)
            if free < limit and others > 0 and limit > 1:
                # our own spinning workers are not competition
                free = min(self.usable, self.host - max(0, others - self._own_running(limit)))
        except (OSError, ValueError, IndexError):
            return None
        self.last = max(1, free)
        return self.last

    def free(self, limit: int) -> Optional[int]:
        """:meth:`sample`, reused for :data:`SAMPLE_TTL` seconds by the calling thread."""
        c = self._cached
        now = time.monotonic()
        if now - c.at > SAMPLE_TTL or c.at < 0:
            c.free = self.sample(limit)
            c.at = now
        return c.free


_sampler: Optional[Sampler] = None
_sampler_lock = threading.Lock()


def sampler() -> Sampler:
    """The process's sampler (made on first use)."""
    global _sampler
    s = _sampler
    if s is None:
        with _sampler_lock:
            if _sampler is None:
                _sampler = Sampler()
            s = _sampler
    return s


# (cap or None, adaptive) for the current Python thread / async context
_setting: contextvars.ContextVar[tuple[Optional[int], bool]] = contextvars.ContextVar(
    "kvcache_threads", default=(None, True))


def threads_for(work: int, tasks: int) -> int:
    """The thread count of a kernel call of ``work`` multiply-adds in ``tasks`` independent
    pieces, under the settings in force (:func:`threads`) and the OpenMP limit."""
    cap, adaptive = _setting.get()
    limit = max(1, _core.max_threads())
    if cap is not None:
        limit = min(limit, cap)
    if not adaptive or limit == 1:
        return limit
    want = choose(work, tasks, limit)
    if want == 1:
        return 1
    return choose(work, tasks, limit, sampler().free(limit))


@contextlib.contextmanager
def threads(n: Optional[int] = None, *, adaptive: bool = True) -> Iterator[None]:
    """Set kvcache's thread count for a block of code (this Python thread or async task only).

    Parameters
    ----------
    n : int, optional
        The most threads a kernel call may use (>= 1); None leaves the OpenMP limit
        (``threadpoolctl`` / ``OMP_NUM_THREADS``) as the only cap.  ``n`` above that limit
        is capped by it.
    adaptive : bool
        True (the default): each call picks its count up to the cap by its size and the CPUs
        free now.  False: every call asks for exactly the cap (``threads(1, adaptive=False)``
        is single-threaded, ``threads(adaptive=False)`` all threads allowed, as before 0.x);
        the kernels still keep tiny calls (under 65536 multiply-adds) on one thread.

    Blocks nest; leaving one restores the enclosing setting.  Results do not depend on it.
    """
    if n is not None:
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"n: expected an int or None, got {type(n).__name__}")
        if n < 1:
            raise ValueError(f"n: expected >= 1, got {n}")
    if not isinstance(adaptive, bool):
        raise TypeError(f"adaptive: expected a bool, got {type(adaptive).__name__}")
    token = _setting.set((n, adaptive))
    try:
        yield
    finally:
        _setting.reset(token)


class ThreadSettings(NamedTuple):
    """What :func:`thread_settings` reports."""

    limit: int
    """The OpenMP limit now (threadpoolctl / OMP_NUM_THREADS)."""
    cap: Optional[int]
    """The cap set by :func:`threads` in this context (None: none)."""
    adaptive: bool
    """Whether calls adapt to their size and the free CPUs (False: forced count)."""
    max_threads: int
    """The most threads a call may use here: ``min(limit, cap)``."""
    sampler: str
    """"loadavg" when the free-CPU sampler works here, else "off" (work-size rule only)."""
    free_cpus: Optional[int]
    """The last sample of free CPUs (None before the first or without a sampler)."""
    usable_cpus: int
    """CPUs this process may run on (``os.sched_getaffinity``)."""

    @property
    def mode(self) -> str:
        """"adaptive" or "forced"."""
        return "adaptive" if self.adaptive else "forced"


def thread_settings() -> ThreadSettings:
    """kvcache's thread settings in this Python thread / async context."""
    cap, adaptive = _setting.get()
    limit = max(1, _core.max_threads())
    s = sampler()
    return ThreadSettings(limit=limit, cap=cap, adaptive=adaptive,
                          max_threads=limit if cap is None else min(limit, cap),
                          sampler="loadavg" if s.available else "off", free_cpus=s.last,
                          usable_cpus=s.usable)
