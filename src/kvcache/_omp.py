"""How long libgomp's idle workers spin: kvcache's default, set while its compiled module loads.

libgomp reads ``GOMP_SPINCOUNT`` and ``OMP_WAIT_POLICY`` once, when it is loaded, and a worker
left without work spins that many times before it sleeps (300,000 when neither is set, several
milliseconds on many CPUs).  Between two of kvcache's parallel regions a program runs other
work: the runner's matrix products on a thread per CPU, NumPy, another process.  A worker that
spins through it takes a CPU from that work, which made the runner's prompt markedly slower
on a 2-core machine (docs/threads.md, "OpenMP's idle workers"; the CHANGELOG has the runs).
Sleeping at once
(``OMP_WAIT_POLICY=PASSIVE``) makes every region pay a wake-up instead, several times the time
of a small decode call.

So when the environment names neither variable, kvcache sets ``GOMP_SPINCOUNT`` to
:data:`SPIN_DEFAULT` while it imports ``kvcache._core`` (which loads libgomp) and removes it
again: child processes see the environment the program had (a subprocess that another thread
starts during that import inherits it).  A libgomp that another module loaded first (torch,
or a NumPy whose BLAS runs on libgomp) keeps its own setting (:data:`SPIN` says which applies;
``show_config`` prints it).  Nothing here is read again after the import.
"""

from __future__ import annotations

import os

__all__ = ["SPIN", "SPIN_DEFAULT"]

#: libgomp's spin count when the environment names neither GOMP_SPINCOUNT nor OMP_WAIT_POLICY
SPIN_DEFAULT = 10000
_NAMES = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


def _libgomp_paths() -> set[str] | None:
    """The paths of the libgomp copies mapped into this process (None without /proc)."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            return {line.split(None, 5)[-1].strip() for line in f
                    if "libgomp" in line and len(line.split(None, 5)) == 6}
    except OSError:
        return None


def _load() -> str:
    """Import kvcache._core under kvcache's spin default; what applies, in words."""
    before = _libgomp_paths()
    user = {n: os.environ[n] for n in _NAMES if n in os.environ}
    if not user:
        os.environ["GOMP_SPINCOUNT"] = str(SPIN_DEFAULT)
    try:
        from . import _core  # noqa: F401  (kvcache.layer explains a missing extension)
    except ImportError:
        pass
    finally:
        if not user:
            os.environ.pop("GOMP_SPINCOUNT", None)
    after = _libgomp_paths()
    if user:   # repr: a value need not be printable text
        return "environment: " + ", ".join(f"{k}={v!r}" for k, v in user.items())
    if before is None or after is None:
        return (f"GOMP_SPINCOUNT={SPIN_DEFAULT} set while the extension loaded (whether a "
                f"libgomp read it is unknown: no /proc/self/maps)")
    loaded = after - before
    if loaded:
        return f"GOMP_SPINCOUNT={SPIN_DEFAULT} (kvcache's default)"
    if before:
        return "libgomp's own setting (loaded before kvcache)"
    return "not applied (no libgomp loaded: another OpenMP runtime, or none)"


#: which spin setting kvcache's OpenMP workers got, in words (show_config's ``omp_spin``)
SPIN = _load()
