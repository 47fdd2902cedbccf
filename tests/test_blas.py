"""BLAS governed like kvcache's own threads (docs/threads.md, "BLAS"): BlasGovernor sizes
NumPy's BLAS team for each product from the CPUs other processes leave free, and the runner
uses it for prompt and decode steps alike.

The sampler reads a loadavg file of the test's and its own-thread count is fixed by the test,
the clock is the test's: nothing here depends on the machine's load, uptime or speed.
"""

from __future__ import annotations

import numpy as np
import pytest
from threadpoolctl import threadpool_info, threadpool_limits

from kvcache import _threads
from kvcache import runner as kr
from kvcache._threads import BLAS_SAMPLE_TTL, BlasGovernor, Sampler


class Clock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def fake(tmp_path, running, own=1, host=2, usable=2):
    """A sampler on a simulated host: ``running`` runnable threads of which ``own`` are ours."""
    path = tmp_path / "loadavg"
    path.write_text(f"0.5 0.4 0.3 {running}/200 99\n")
    s = Sampler(str(path), clock=Clock())
    s.host, s.usable = host, usable
    s.own_runnable = lambda: own                    # type: ignore[method-assign]
    return s


def blas_counts() -> list[int]:
    return [d["num_threads"] for d in threadpool_info() if d["user_api"] == "blas"]


@pytest.mark.parametrize("running, own, host, usable, want", [
    (1, 1, 2, 2, 2),      # the caller alone
    (3, 3, 2, 2, 2),      # the caller and two of its own workers spinning: still free
    (2, 1, 2, 2, 1),      # a busy loop in another process
    (4, 2, 2, 2, 1),      # two busy loops, one of our workers
    (1, 1, 64, 4, 4),     # a container on a big host: its CPUs
    (62, 1, 64, 4, 3),    # a nearly full host
])
def test_free_external_counts_other_processes_only(tmp_path, running, own, host, usable, want):
    assert fake(tmp_path, running, own, host, usable).free_external() == want


def test_free_external_without_proc(tmp_path):
    assert Sampler(str(tmp_path / "missing")).free_external() is None


def test_own_runnable_counts_the_caller():
    assert Sampler().own_runnable() >= 1


@pytest.mark.parametrize("running, own, cap, want", [
    (1, 1, None, 2), (2, 1, None, 1), (1, 1, 1, 1), (1, 1, 5, 2), (3, 1, 5, 1)])
def test_the_governor_sets_and_restores_blas(tmp_path, running, own, cap, want):
    s = fake(tmp_path, running, own)
    with threadpool_limits(2, user_api="blas"):
        seen = []
        with BlasGovernor(cap, sampler=s, clock=Clock()) as gov:
            assert gov.limit == (2 if cap is None else min(cap, 2))
            assert gov.size() == want
            seen = blas_counts()
        assert set(seen) == {want}
        assert set(blas_counts()) == {2}            # restored on leaving
        assert gov.size() == 0                       # outside the block: nothing


def test_blas_own_setting_is_the_outer_limit(tmp_path):
    with threadpool_limits(1, user_api="blas"):
        with BlasGovernor(4, sampler=fake(tmp_path, 1)) as gov:
            assert gov.limit == 1 and gov.size() == 1


def test_a_sample_is_reused_for_its_ttl(tmp_path):
    s = fake(tmp_path, 1)
    clock = Clock()
    with threadpool_limits(2, user_api="blas"):
        with BlasGovernor(sampler=s, clock=clock) as gov:
            assert gov.size() == 2
            (tmp_path / "loadavg").write_text("0.5 0.4 0.3 2/200 99\n")   # a competitor
            clock.now += BLAS_SAMPLE_TTL / 2
            assert gov.size() == 2
            clock.now += BLAS_SAMPLE_TTL
            assert gov.size() == 1 and set(blas_counts()) == {1}
            (tmp_path / "loadavg").write_text("0.5 0.4 0.3 1/200 99\n")   # gone
            clock.now += 2 * BLAS_SAMPLE_TTL
            assert gov.size() == 2
            assert gov.sizes == {2: 3, 1: 1}


def test_bad_caps_are_refused():
    for bad, exc in ((0, ValueError), (-1, ValueError), (1.5, TypeError), (True, TypeError),
                     ("2", TypeError)):
        with pytest.raises(exc):
            BlasGovernor(bad)
    gov = BlasGovernor()
    with gov:
        with pytest.raises(RuntimeError, match="already entered"):
            gov.__enter__()


# ---------------------------------------------------------------- the runner
@pytest.fixture
def simulated(monkeypatch, tmp_path):
    def install(running, own=1):
        s = fake(tmp_path, running, own)
        monkeypatch.setattr(_threads, "_sampler", s)
        return s
    return install


@pytest.mark.parametrize("running, want", [(1, 2), (2, 1)])
def test_runner_sizes_blas_in_prefill_and_decode(simulated, running, want):
    simulated(running)
    ids = np.arange(150) % 97
    with threadpool_limits(2, user_api="blas"):
        r = kr.Runner.random()
        assert r.blas_threads is None
        last = r.prefill(ids)
        assert set(r._blas.sizes) == {want} and sum(r._blas.sizes.values()) > 10
        assert set(blas_counts()) == {2}            # BLAS's own setting back after the call
        r.step(int(np.argmax(last)))
        assert set(r._blas.sizes) == {want}
        assert set(blas_counts()) == {2}


def test_runner_blas_control(simulated):
    simulated(1)
    ids = np.arange(70) % 97
    with threadpool_limits(2, user_api="blas"):
        one = kr.Runner.random(blas_threads=1)
        one.prefill(ids)
        assert set(one._blas.sizes) == {1}
        alone = kr.Runner.random(blas_threads=0)
        alone.prefill(ids)
        assert alone._blas is None
        with pytest.warns(DeprecationWarning, match="blas_threads"):
            old = kr.Runner.random(decode_blas_threads=1)
        assert old.blas_threads == 1
    for bad in (-1, 1.5, "x"):
        with pytest.raises((TypeError, ValueError)):
            kr.Runner.random(blas_threads=bad)
