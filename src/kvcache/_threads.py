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
  that spin after a product -- held down for :data:`HOLD` seconds once two samples in a row
  saw competition.  An OpenMP fork-join waits for its slowest member, so a team
  larger than the free CPUs waits for a descheduled thread (docs/threads.md has the
  measurements); one that fits does not.

``kvcache.threads(n, adaptive=False)`` forces a count (the benchmark's "forced 1" and "forced
all"), still capped by the OpenMP limit.  Results are bit-identical for every count: the
kernels split their sums by row index, never by thread (docs/numerics.md).
"""

from __future__ import annotations

import contextlib
import contextvars
import operator
import os
import threading
import time
from typing import Any, Callable, NamedTuple, Optional

from . import _core

__all__ = ["BLAS_SAMPLE_TTL", "BlasGovernor", "HOLD", "MIN_WORK_PER_THREAD", "SAMPLE_TTL",
           "Sampler", "ThreadSettings", "choose", "sampler", "thread_settings", "threads",
           "threads_for"]

MIN_WORK_PER_THREAD = 1 << 18
"""Multiply-adds a thread must get (about 30-60 us on one core) before it is worth waking."""

SAMPLE_TTL = 0.002
"""Seconds a sample of the free CPUs is reused by the calls of one Python thread."""

HOLD = 0.02
"""Seconds the count stays down after two samples in a row saw competition: a competitor that pauses
for a moment (another process between two calls, a thread between two products) does not
bring back a team that it would stall when it resumes."""


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


def _stat_state(tid: int) -> str:
    """The one-letter state of thread ``tid`` of this process (``R``: runnable)."""
    fd = os.open(f"/proc/self/task/{tid}/stat", os.O_RDONLY)
    try:
        line = os.pread(fd, 256, 0)
    finally:
        os.close(fd)
    i = line.rfind(b")")
    return chr(line[i + 2]) if 0 <= i < len(line) - 2 else "?"


class _TeamTids(threading.local):
    """The kernel thread ids of the calling Python thread's OpenMP workers (thread numbers 1,
    2, ...).  Ids only, no open files: nothing to close when the thread ends."""

    tids: tuple[int, ...] = ()
    size = 0


class _Cached(threading.local):
    """The calling thread's last sample: when (None: never), the free CPUs, whether exact or a
    lower bound, the largest count handed out since (its workers may still be spinning), and
    when competition was last held (None: never)."""

    at: Optional[float] = None
    free = 1
    exact = False
    used = 1
    low_at: Optional[float] = None
    low_streak = 0


class Sampler:
    """Free CPUs from ``/proc``: usable CPUs less the runnable threads of everyone else.

    Field 4 of ``/proc/loadavg`` counts the threads runnable on the host right now
    (``running/total``).  The calling thread is one of them, and the workers of its own OpenMP
    team may be too (they spin for a while after a parallel region): those are read from
    ``/proc/self/task/<tid>/stat`` and not counted -- only when the count matters, and only
    the workers of the largest team handed out since the last sample.  Everything else
    competes.  The host's CPUs (``os.cpu_count()``, the scale of ``/proc/loadavg`` also in a
    container) less the competitors, capped by the CPUs this process may run on
    (``os.sched_getaffinity``), is the answer.  Without ``/proc`` there is no sample.

    Parameters
    ----------
    loadavg : str
        The file to read (a test points it at a file of its own).
    clock : callable, optional
        Seconds, monotonic (default ``time.monotonic``; a test passes a clock of its own).  Only
        differences of its readings are used, never its value: the policy does not depend on
        when the machine booted.
    """

    def __init__(self, loadavg: str = "/proc/loadavg",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.host = os.cpu_count() or 1
        try:
            self.usable = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            self.usable = self.host
        self._team = _TeamTids()
        self._cached = _Cached()
        self.last: Optional[int] = None
        self._fd: Optional[int] = None
        try:
            self._fd = os.open(loadavg, os.O_RDONLY)
            self.running()
        except (OSError, ValueError, IndexError):
            self.close()

    def close(self) -> None:
        """Stop sampling (closes /proc/loadavg)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    @property
    def available(self) -> bool:
        """Whether samples can be taken here."""
        return self._fd is not None

    def running(self) -> int:
        """Threads runnable on the host now (field 4 of ``/proc/loadavg``, before the slash)."""
        if self._fd is None:
            raise OSError("no /proc/loadavg")
        fields = os.pread(self._fd, 128, 0).split()
        return int(fields[3].split(b"/")[0])

    def own_running(self, workers: int) -> int:
        """How many of the first ``workers`` workers of the calling thread's OpenMP team are
        runnable now (their kernel ids are captured once, by a team of ``workers + 1``: OpenMP
        gives thread number i the same pooled thread in every team of the caller)."""
        team = self._team
        if team.size < workers + 1:
            team.tids = tuple(int(t) for t in _core.thread_ids(workers + 1)[1:] if t > 0)
            team.size = workers + 1
        n = 0
        for tid in team.tids[:workers]:
            try:
                n += _stat_state(tid) == "R"
            except OSError:        # the worker is gone (or a fork's child): capture again
                team.size = 0
        return n

    def own_runnable(self) -> int:
        """Runnable threads of this process now, the caller included (every
        ``/proc/self/task/<tid>/stat`` in state R)."""
        own = 0
        for name in os.listdir("/proc/self/task"):
            try:
                own += _stat_state(int(name)) == "R"
            except (OSError, ValueError):
                pass              # a thread that ended meanwhile
        return own

    def free_external(self) -> Optional[int]:
        """CPUs not taken by other processes now, counting the caller's own: the usable CPUs
        less the runnable threads of everyone else, where every thread of this process --
        the caller, kvcache's OpenMP workers, BLAS's workers spinning after a product -- is
        ours, not competition (each is read from ``/proc/self/task/<tid>/stat``).  None
        without a sample.  What :class:`BlasGovernor` sizes BLAS's team from."""
        if self._fd is None:
            return None
        try:
            running = self.running()
            own = self.own_runnable() if running > 1 else 1   # someone else: one of ours?
            others = max(0, running - max(own, 1))
        except (OSError, ValueError, IndexError):
            return None
        return max(1, min(self.usable, self.host - others))

    def sample(self, want: int, spinning: int) -> tuple[int, bool]:
        """Free CPUs now counting the caller's own, and whether the count is exact (False: a
        lower bound, already >= ``want``); ``spinning`` of the team's workers may spin."""
        others = self.running() - 1
        free = min(self.usable, self.host - others)
        if free >= want or others <= 0 or spinning <= 0:
            return max(1, free), others <= 0 or spinning <= 0
        own = self.own_running(spinning)
        return max(1, min(self.usable, self.host - max(0, others - own))), True

    def cap(self, n: int, limit: int) -> int:
        """``min(n, free CPUs)``, with the sample reused for :data:`SAMPLE_TTL` seconds by the
        calling thread, and a lower count kept for :data:`HOLD` seconds after competition was
        last seen; ``n`` when there is no sample."""
        c = self._cached
        now = self.clock()
        if c.at is None or now - c.at > SAMPLE_TTL or (not c.exact and c.free < n):
            if self._fd is None:
                return n
            try:
                # workers that may still spin: those of the largest team since the last
                # sample, and all of a small machine's (reading one costs ~5 us)
                free, exact = self.sample(n, max(c.used, min(limit, 8)) - 1)
            except (OSError, ValueError, IndexError):
                return n
            if c.at is None or free <= c.free or c.low_at is None or now - c.low_at > HOLD:
                c.free, c.exact = free, exact
                if free < limit:
                    # competition seen now; held only when the previous sample saw it too,
                    # so a thread that is runnable for a moment (a daemon, a kernel worker)
                    # costs one sample's calls, not a whole hold
                    if c.low_streak:
                        c.low_at = now
                    c.low_streak += 1
                else:
                    c.low_streak = 0
            else:
                c.exact = True                      # held down: no resampling until then
                c.low_streak = 0
            c.at = now
            c.used = 1
            self.last = c.free
        if c.free < n:
            n = c.free
        if n > c.used:
            c.used = n
        return n


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
    pieces, under the settings in force (:func:`threads`) and the OpenMP limit.

    :func:`choose` with the free CPUs of :class:`Sampler` (sampled only when the call is large
    enough for more than one thread); about 1 us when the sample is reused."""
    cap, adaptive = _setting.get()
    limit = _core.max_threads()
    if cap is not None and cap < limit:
        limit = cap
    if not adaptive or limit <= 1:
        return max(1, limit)
    n = work // MIN_WORK_PER_THREAD      # choose(), inlined: this runs once per kernel call
    if tasks < n:
        n = tasks
    if limit < n:
        n = limit
    if n <= 1:
        return 1
    return (_sampler or sampler()).cap(n, limit)


_Setting = tuple[Optional[int], bool]
_entered: contextvars.ContextVar[tuple[tuple[int, contextvars.Token[_Setting]], ...]] = (
    contextvars.ContextVar("kvcache_threads_entered", default=()))


class threads:
    """Set kvcache's thread count for a block of code: ``with kvcache.threads(1): ...``.

    The setting belongs to the calling Python thread or async task (a context variable):
    other threads keep theirs.  Blocks nest; leaving one restores the enclosing setting.
    Results do not depend on it (bit-identical for every thread count).

    Parameters
    ----------
    n : int, optional
        The most threads a kernel call may use (>= 1); None leaves the OpenMP limit
        (``threadpoolctl.threadpool_limits(n, user_api="openmp")`` / ``OMP_NUM_THREADS``) as
        the only cap.  An ``n`` above that limit is capped by it.
    adaptive : bool
        True (the default): each call picks its count up to the cap from its size, its
        independent tasks and the CPUs free now.  False: every call asks for exactly the cap
        -- ``threads(1, adaptive=False)`` is single-threaded, ``threads(adaptive=False)`` uses
        every thread the OpenMP limit allows; the kernels still run calls under 65536
        multiply-adds on the calling thread.

    Raises
    ------
    TypeError
        ``n`` not an int or None, ``adaptive`` not a bool.
    ValueError
        ``n`` < 1.
    """

    __slots__ = ("_value",)

    def __init__(self, n: Optional[int] = None, *, adaptive: bool = True) -> None:
        if n is not None:
            if isinstance(n, bool) or not hasattr(n, "__index__"):
                raise TypeError(f"n: expected an int or None, got {type(n).__name__}")
            n = operator.index(n)
            if n < 1:
                raise ValueError(f"n: expected >= 1, got {n}")
        if not isinstance(adaptive, bool):
            raise TypeError(f"adaptive: expected a bool, got {type(adaptive).__name__}")
        self._value: tuple[Optional[int], bool] = (n, adaptive)

    def __enter__(self) -> threads:
        # the token goes on a stack of the current context, so one object may be entered by
        # several threads or tasks at once, each restoring its own setting
        token = _setting.set(self._value)
        _entered.set(_entered.get() + ((id(self), token),))
        return self

    def __exit__(self, *exc: object) -> None:
        stack = _entered.get()
        for i in range(len(stack) - 1, -1, -1):
            if stack[i][0] == id(self):
                _entered.set(stack[:i] + stack[i + 1:])
                _setting.reset(stack[i][1])
                return
        raise RuntimeError("kvcache.threads: left a block that this thread or task did not enter")

    def __repr__(self) -> str:
        n, adaptive = self._value
        return f"kvcache.threads({n!r}, adaptive={adaptive})"


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


BLAS_SAMPLE_TTL = 0.005
"""Seconds :class:`BlasGovernor` reuses a sample of the free CPUs (a layer's products of one
chunk take a few milliseconds: about one sample per layer and chunk)."""

_blas_libs_cache: Optional[list[Any]] = None
_blas_lock = threading.Lock()


def _blas_libs() -> list[Any]:
    """threadpoolctl's controllers of the BLAS libraries loaded now (NumPy's OpenBLAS, MKL,
    ...), found once per process after NumPy's import."""
    global _blas_libs_cache
    libs = _blas_libs_cache
    if libs is None:
        with _blas_lock:
            if _blas_libs_cache is None:
                import numpy  # noqa: F401  (loads the BLAS threadpoolctl should see)
                from threadpoolctl import ThreadpoolController
                ctl = ThreadpoolController().select(user_api="blas")
                _blas_libs_cache = list(ctl.lib_controllers)
            libs = _blas_libs_cache
    return libs


class BlasGovernor:
    """Size NumPy's BLAS thread pool for each product from the free CPUs, as kvcache's own
    kernels are sized (docs/threads.md, "BLAS").

    BLAS's fork-join team waits for its slowest thread: on a machine where another process
    keeps a core busy, a product on every core runs at the pace of the descheduled one (a
    512-token prompt measured 10x slower), while on a quiet machine one thread leaves cores
    idle.  Inside a ``with BlasGovernor(): ...`` block, :meth:`size` (called before each
    product or group of products) sets BLAS's thread count to ``min(cap, free CPUs now)``,
    where the free CPUs are the usable ones less the runnable threads of *other* processes
    (this process's own threads, BLAS's and OpenMP's spinning workers included, are not
    competition: :meth:`Sampler.free_external`).  Leaving the block restores the counts
    BLAS had.  Results do not depend on the count (BLAS's products are deterministic for a
    given count only on some libraries; kvcache's runner does not depend on it: its
    bit-identity guarantees are about its own kernels and chunking).

    Parameters
    ----------
    cap : int, optional
        The most BLAS threads a product may use (>= 1); None: BLAS's own count when the
        block is entered (``OPENBLAS_NUM_THREADS``, ``threadpoolctl`` limits), which stays
        the outer limit in every case.
    clock : callable, optional
        Monotonic seconds (a test passes its own).
    sampler : Sampler, optional
        The free-CPU sampler (default: the process's, :func:`sampler`).
    """

    def __init__(self, cap: Optional[int] = None, *,
                 clock: Callable[[], float] = time.monotonic,
                 sampler: Optional[Sampler] = None) -> None:
        if cap is not None:
            if isinstance(cap, bool) or not hasattr(cap, "__index__"):
                raise TypeError(f"cap: expected an int or None, got {type(cap).__name__}")
            cap = operator.index(cap)
            if cap < 1:
                raise ValueError(f"cap: expected >= 1, got {cap}")
        self.cap = cap
        self.clock = clock
        self._sampler = sampler
        self._saved: Optional[list[int]] = None
        self._libs: list[Any] = []
        self.limit = 1
        self.current: Optional[int] = None
        self._at: Optional[float] = None
        self.sizes: dict[int, int] = {}
        """How many times :meth:`size` chose each count in this block (for tests and the
        benchmark)."""

    def __enter__(self) -> BlasGovernor:
        if self._saved is not None:
            raise RuntimeError("BlasGovernor: this block is already entered")
        self._libs = _blas_libs()
        self._saved = [int(lib.num_threads) for lib in self._libs]
        base = max(self._saved, default=1)
        self.limit = max(1, base if self.cap is None else min(self.cap, base))
        self.current = None
        self._at = None
        self.sizes = {}
        return self

    def __exit__(self, *exc: object) -> None:
        saved, self._saved = self._saved, None
        if saved is not None:
            for lib, n in zip(self._libs, saved):
                lib.set_num_threads(n)
        self.current = None

    def size(self) -> int:
        """Set BLAS's thread count for the next product(s) and return it: ``min(limit, free
        CPUs)``, the sample reused for :data:`BLAS_SAMPLE_TTL` seconds.  Outside a block it
        changes nothing and returns 0."""
        if self._saved is None:
            return 0
        now = self.clock()
        if self.current is None or self._at is None or now - self._at > BLAS_SAMPLE_TTL:
            s = self._sampler or sampler()
            free = s.free_external()
            n = self.limit if free is None else max(1, min(self.limit, free))
            self._at = now
            if n != self.current:
                for lib in self._libs:
                    lib.set_num_threads(n)
                self.current = n
        n = self.current
        self.sizes[n] = self.sizes.get(n, 0) + 1
        return n
