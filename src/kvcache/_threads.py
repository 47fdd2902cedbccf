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
from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence

from . import _core

__all__ = ["BLAS_SAMPLE_TTL", "BlasGovernor", "HOLD", "MIN_WORK_PER_THREAD", "SAMPLE_TTL",
           "Sampler", "ThreadSettings", "choose", "sampler", "thread_settings", "threads",
           "threads_for", "usable_cpus"]

MIN_WORK_PER_THREAD = 1 << 18
"""Multiply-adds a thread must get (about 30-60 us on one core) before it is worth waking."""

SAMPLE_TTL = 0.002
"""Seconds a sample of the free CPUs is reused by the calls of one Python thread."""

HOLD = 0.02
"""Seconds the count stays down after two samples in a row saw competition: a competitor that pauses
for a moment (another process between two calls, a thread between two products) does not
bring back a team that it would stall when it resumes."""


def usable_cpus() -> int:
    """CPUs this process may run on (``os.sched_getaffinity``; the host's count where the
    platform does not say)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


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
        self.usable = usable_cpus()
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
            own = 1
            if running > 1:                                   # someone else: one of ours?
                running, own = self._bracketed(self.own_runnable, 3)
            others = max(0, running - max(own, 1))
        except (OSError, ValueError, IndexError):
            return None
        return max(1, min(self.usable, self.host - others))

    def _bracketed(self, own: Callable[[], int], tries: int) -> tuple[int, int]:
        """The host's runnable count and ``own()`` (how many of them are ours) at one moment:
        ``own`` read before and after the host's count, again while the two readings differ
        (at most ``tries`` times).  Read once after, a thread of ours that fell asleep
        between the readings would be in the host's count and not among ours, and look
        like another process's; when nothing of ours changed state around the host's
        count, the two agree with it."""
        before = own()
        running, after = self.running(), own()
        while after != before and tries > 1:
            tries -= 1
            before = after
            running, after = self.running(), own()
        return running, after

    def sample(self, want: int, spinning: int) -> tuple[int, bool]:
        """Free CPUs now counting the caller's own, and whether the count is exact (False: a
        lower bound, already >= ``want``); ``spinning`` of the team's workers may spin."""
        others = self.running() - 1
        free = min(self.usable, self.host - others)
        if free >= want or others <= 0 or spinning <= 0:
            return max(1, free), others <= 0 or spinning <= 0
        # between calls a worker only falls asleep, so at most ``spinning`` changes of state
        running, own = self._bracketed(lambda: self.own_running(spinning), spinning + 1)
        others = max(0, running - 1 - own)
        return max(1, min(self.usable, self.host - others)), True

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


def _count_or_none(name: str, value: object) -> Optional[int]:
    """``value`` as a thread count >= 1, or None (TypeError for a non-int or a bool,
    ValueError below 1)."""
    if value is None:
        return None
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{name}: expected an int or None, got {type(value).__name__}")
    n = operator.index(value)
    if n < 1:
        raise ValueError(f"{name}: expected >= 1, got {n}")
    return n


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
        n = _count_or_none("n", n)
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


_pool: Optional[Any] = None


def _executor() -> Any:
    """The process's worker threads for :meth:`BlasGovernor.map` (made on first use; a forked
    child makes its own: the parent's workers do not exist there)."""
    global _pool
    pool = _pool
    if pool is None:
        with _blas_lock:
            if _pool is None:
                from concurrent.futures import ThreadPoolExecutor
                _pool = ThreadPoolExecutor(max_workers=max(1, (os.cpu_count() or 1) - 1),
                                           thread_name_prefix="kvcache-blas")
            pool = _pool
    return pool


# BLAS's thread count is one setting of the whole process, shared by every governor: the
# count BLAS had before the first governor entered (restored when the last one leaves), the
# count set now, and how many pinned sections (map, pinned) are running -- while one is, no
# governor raises the count above one, so a pinned section's products always run on one thread.
class _BlasShared:
    lock = threading.Lock()
    depth = 0
    saved: Optional[list[int]] = None
    now: Optional[int] = None
    pinned = 0


def _set_blas(libs: list[Any], n: int) -> None:
    """Set every governed BLAS to ``n`` threads (caller holds _BlasShared.lock)."""
    if _BlasShared.now != n:
        for lib in libs:
            lib.set_num_threads(n)
        _BlasShared.now = n


def _after_fork_in_child() -> None:
    global _pool
    _pool = None
    _BlasShared.lock = threading.Lock()
    _BlasShared.pinned = 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class BlasGovernor:
    """Size NumPy's BLAS work from the free CPUs, as kvcache's own kernels are sized
    (docs/threads.md, "BLAS").

    BLAS's fork-join team waits for its slowest thread: on a machine where another process
    keeps a core busy, a product on every core runs at the pace of the descheduled one (a
    512-token prompt measured 10x slower), while on a quiet machine one thread leaves cores
    idle.  And the bits of a matrix-matrix product depend on BLAS's thread count (OpenBLAS
    splits the work differently), so a count that follows the load would make results follow
    it too.  Inside a ``with BlasGovernor(): ...`` block:

    - :meth:`map` runs a function over independent pieces of work (row chunks of a prompt) on
      up to ``min(cap, free CPUs)`` threads, BLAS on one thread in each: the bits of a piece
      never depend on the count, only the time does;
    - :meth:`size` sets BLAS's own count to ``min(cap, free CPUs)`` for what follows: for
      matrix-vector products (a decode step), whose bits do not depend on the count
      (tests/test_blas.py holds NumPy's BLAS to that).

    The free CPUs are the usable ones less the runnable threads of *other* processes (this
    process's threads -- the caller, kvcache's OpenMP workers, BLAS's workers spinning after a
    product, :meth:`map`'s workers -- are not competition: :meth:`Sampler.free_external`), one
    sample reused for :data:`BLAS_SAMPLE_TTL` seconds.  Leaving the block restores the counts
    BLAS had.

    Parameters
    ----------
    cap : int, optional
        The most threads (>= 1); None: BLAS's own count when the block is entered
        (``OPENBLAS_NUM_THREADS``, ``threadpoolctl`` limits), which stays the outer limit.
    clock : callable, optional
        Monotonic seconds (a test passes its own).
    sampler : Sampler, optional
        The free-CPU sampler (default: the process's, :func:`sampler`).
    """

    def __init__(self, cap: Optional[int] = None, *,
                 clock: Callable[[], float] = time.monotonic,
                 sampler: Optional[Sampler] = None) -> None:
        self.cap = _count_or_none("cap", cap)
        self.clock = clock
        self._sampler = sampler
        self._entered = False
        self._libs: list[Any] = []
        self.limit = 1
        self._free: Optional[int] = None
        self._at: Optional[float] = None
        self.sizes: dict[int, int] = {}
        """How many times :meth:`size` and :meth:`map` chose each count in this block (for
        tests and the benchmark)."""

    def __enter__(self) -> BlasGovernor:
        if self._entered:
            raise RuntimeError("BlasGovernor: this block is already entered")
        libs = _blas_libs()
        with _BlasShared.lock:
            if _BlasShared.depth == 0:
                _BlasShared.saved = [int(lib.num_threads) for lib in libs]
                _BlasShared.now = None
            _BlasShared.depth += 1
            saved = _BlasShared.saved or []
        self._libs = libs
        self._entered = True
        base = max(saved, default=1)
        self.limit = max(1, base if self.cap is None else min(self.cap, base))
        self._at = None
        self._free = None
        self.sizes = {}
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._entered:
            return
        self._entered = False
        with _BlasShared.lock:
            _BlasShared.depth -= 1
            if _BlasShared.depth == 0 and _BlasShared.saved is not None:
                for lib, n in zip(self._libs, _BlasShared.saved):
                    lib.set_num_threads(n)
                _BlasShared.saved = None
                _BlasShared.now = None

    @property
    def current(self) -> Optional[int]:
        """BLAS's thread count as the governors last set it (None: not set in this block)."""
        return _BlasShared.now if self._entered else None

    def _count(self, cap: Optional[int] = None) -> int:
        """``min(limit, cap, free CPUs)``, the sample reused for :data:`BLAS_SAMPLE_TTL`."""
        now = self.clock()
        if self._free is None or self._at is None or now - self._at > BLAS_SAMPLE_TTL:
            s = self._sampler or sampler()
            free = s.free_external()
            self._free = self.limit if free is None else max(1, min(self.limit, free))
            self._at = now
        n = self._free if cap is None else max(1, min(self._free, cap))
        self.sizes[n] = self.sizes.get(n, 0) + 1
        return n

    def size(self, cap: Optional[int] = None) -> int:
        """Set BLAS's thread count for the next product(s) and return it: ``min(limit, cap,
        free CPUs)`` -- one while a pinned section (:meth:`map`, :meth:`pinned`) of any
        governor runs.  For matrix-vector products: a matrix-matrix product's bits depend on
        the count (use :meth:`map`).  Outside a block it changes nothing and returns 0."""
        if not self._entered:
            return 0
        n = self._count(cap)
        with _BlasShared.lock:
            if _BlasShared.pinned:
                n = 1
            _set_blas(self._libs, n)
        return n

    @contextlib.contextmanager
    def pinned(self) -> Iterator[None]:
        """A section whose products run on one BLAS thread whatever other governors of the
        process do meanwhile (their :meth:`size` stays at one until it ends)."""
        if not self._entered:
            yield
            return
        with _BlasShared.lock:
            _BlasShared.pinned += 1
            _set_blas(self._libs, 1)
        try:
            yield
        finally:
            with _BlasShared.lock:
                _BlasShared.pinned -= 1

    def map(self, fn: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
        """``[fn(item) for item in items]``, the items shared out in contiguous runs over
        ``min(limit, free CPUs, len(items))`` threads (the caller's among them), inside a
        :meth:`pinned` section: each item's products give the bits they give on one BLAS
        thread, whatever the count.  Outside a block: in order on the calling thread, BLAS
        untouched.  An exception of ``fn`` propagates once every run has stopped."""
        items = list(items)
        if not self._entered:
            return [fn(x) for x in items]
        with self.pinned():
            n = min(self._count(), len(items)) if len(items) > 1 else 1
            if n <= 1:
                return [fn(x) for x in items]
            bounds = [len(items) * k // n for k in range(n + 1)]

            def run(k: int) -> list[Any]:
                return [fn(x) for x in items[bounds[k]:bounds[k + 1]]]

            pool = _executor()
            futures = [pool.submit(run, k) for k in range(1, n)]
            out: list[Any] = []
            first: Optional[BaseException] = None
            try:
                out = run(0)
            except BaseException as exc:   # still wait for the others: no work left running
                first = exc
            rest = []
            for f in futures:
                try:
                    rest.append(f.result())
                except BaseException as exc:
                    first = first or exc
            if first is not None:
                raise first
            for r in rest:
                out.extend(r)
            return out
