"""BLAS governed like kvcache's own threads (docs/threads.md, "BLAS"): BlasGovernor sizes
NumPy's BLAS team for each product from the CPUs other processes leave free, and the runner
uses it for prompt and decode steps alike.

The sampler reads a loadavg file of the test's and its own-thread count is fixed by the test,
the clock is the test's: nothing here depends on the machine's load, uptime or speed.
"""

from __future__ import annotations

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

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
    """The thread counts of the BLAS libraries the governor controls (NumPy's; torch, once
    imported by another test, brings a BLAS of its own that NumPy's products never use)."""
    return [int(lib.num_threads) for lib in _threads._blas_libs()]


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


@pytest.mark.parametrize("others, want", [(0, 2), (1, 1)])
def test_free_external_reads_again_when_one_of_ours_fell_asleep(tmp_path, others, want):
    """A worker of ours runnable when the host's count is first read and asleep when our own
    threads are read would look like another process; read before and after the host's
    count again, it is not one.  A real one is seen either way."""
    s = fake(tmp_path, 2 + others)
    path = tmp_path / "loadavg"

    def own_runnable() -> int:
        path.write_text(f"0.5 0.4 0.3 {1 + others}/200 99\n")   # the worker is asleep now
        return 1

    s.own_runnable = own_runnable                   # type: ignore[method-assign]
    assert s.free_external() == want


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
    assert gov.size() == 0 and gov.current is None


def test_nested_and_concurrent_governors_share_one_setting(tmp_path):
    """BLAS's count is one setting of the process: the count it had comes back when the last
    governor leaves, and no governor raises it while another one's pinned section runs."""
    with threadpool_limits(2, user_api="blas"):
        outer = BlasGovernor(sampler=fake(tmp_path, 1))
        inner = BlasGovernor(sampler=fake(tmp_path, 1))
        with outer:
            assert outer.size() == 2
            with inner, inner.pinned():
                assert set(blas_counts()) == {1}
                assert outer.size() == 1                    # pinned elsewhere: stays at one
                assert set(blas_counts()) == {1}
            assert outer.size() == 2                        # the pinned section ended
            assert set(blas_counts()) == {2}
            outer.size(1)
        assert set(blas_counts()) == {2}                    # the last one out restores


def test_a_forked_child_gets_its_own_workers(tmp_path):
    import multiprocessing as mp
    import os
    if "fork" not in mp.get_all_start_methods():
        pytest.fail("this test needs fork (Linux)")
    with BlasGovernor(sampler=fake(tmp_path, 1)) as gov:
        assert gov.map(lambda i: i * i, range(6)) == [0, 1, 4, 9, 16, 25]   # pool made
    pid = os.fork()
    if pid == 0:                                             # the child
        code = 1
        try:
            with BlasGovernor(sampler=fake(tmp_path, 1)) as gov:
                code = 0 if gov.map(lambda i: i + 1, range(6)) == [1, 2, 3, 4, 5, 6] else 1
        finally:
            os._exit(code)
    import time
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.01)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("the forked child hung in map")


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
    ids = np.arange(150) % 97                      # chunks of 64, 64 and 22 rows
    with threadpool_limits(2, user_api="blas"):
        r = kr.Runner.random(prefill_chunk=64)
        assert r.blas_threads is None
        last = r.prefill(ids)
        # two chunk maps per layer (QKV, then output projection and MLP)
        assert r._blas.sizes == {want: 2 * r.config.num_layers}
        assert set(blas_counts()) == {2}            # BLAS's own setting back after the call
        r.step(int(np.argmax(last)))
        assert r._blas.sizes == {want: 2 * r.config.num_layers}   # single rows: size()
        assert set(blas_counts()) == {2}


def test_runner_bits_do_not_depend_on_the_load(simulated):
    """Quiet (two chunk threads, decode with two BLAS threads) or busy (one): the same bits,
    prompt and decode steps alike, and the same as BLAS left alone on one thread."""
    ids = np.arange(300) % 97
    results = []
    for running, blas in ((1, None), (2, None), (1, 0)):
        simulated(running)
        with threadpool_limits(1 if blas == 0 else 2, user_api="blas"):
            r = kr.Runner.random(kv="q8", blas_threads=blas)
            every = r.prefill(ids, all_logits=True)
            steps = [r.step(5), r.step(6)]
        results.append([every, *steps])
    for other in results[1:]:
        for a, b in zip(results[0], other):
            np.testing.assert_array_equal(a, b)


def test_matrix_vector_bits_do_not_depend_on_blas_threads():
    """What the runner's decode relies on when it gives BLAS more than one thread."""
    rng = np.random.default_rng(1)
    for k, n in ((576, 1536), (1024, 3072), (2048, 8192)):
        x = rng.standard_normal((1, k), dtype=np.float32)
        w = rng.standard_normal((k, n), dtype=np.float32)
        with threadpool_limits(1, user_api="blas"):
            one = x @ w
        with threadpool_limits(2, user_api="blas"):
            two = x @ w
        np.testing.assert_array_equal(one, two)


def test_map_shares_chunks_over_threads_with_blas_on_one(tmp_path):
    import threading
    rng = np.random.default_rng(2)
    w = rng.standard_normal((256, 512), dtype=np.float32)
    xs = [rng.standard_normal((64, 256), dtype=np.float32) for _ in range(7)]
    with threadpool_limits(1, user_api="blas"):
        want = [x @ w for x in xs]
    seen = []

    def fn(x):
        seen.append((threading.get_ident(), tuple(blas_counts())))
        return x @ w

    with threadpool_limits(2, user_api="blas"):
        with BlasGovernor(sampler=fake(tmp_path, 1)) as gov:
            got = gov.map(fn, xs)
        assert set(blas_counts()) == {2}
    assert all(np.array_equal(a, b) for a, b in zip(got, want))   # in order, same bits
    assert len({t for t, _ in seen}) == 2 and all(set(c) == {1} for _, c in seen)
    with BlasGovernor(sampler=fake(tmp_path, 2)) as gov:        # busy: the caller alone
        seen.clear()
        gov.map(fn, xs)
    assert len({t for t, _ in seen}) == 1
    seen.clear()
    assert len(BlasGovernor().map(fn, xs)) == 7                 # outside a block: in order


def test_map_propagates_an_error_after_every_run(tmp_path):
    done = []

    def fn(i):
        if i == 5:
            raise KeyError(i)
        done.append(i)
        return i

    with threadpool_limits(2, user_api="blas"):
        with BlasGovernor(sampler=fake(tmp_path, 1)) as gov:
            with pytest.raises(KeyError):
                gov.map(fn, range(8))
        assert set(blas_counts()) == {2}
    # two runs, [0, 4) and [4, 8): the first finished, the second stopped at its error, and
    # neither is still running once map has raised
    assert sorted(done) == [0, 1, 2, 3, 4]


def test_runner_blas_control(simulated):
    simulated(1)
    ids = np.arange(70) % 97
    with threadpool_limits(2, user_api="blas"):
        one = kr.Runner.random(blas_threads=1, prefill_chunk=64)
        one.prefill(ids)
        assert set(one._blas.sizes) == {1}
        alone = kr.Runner.random(blas_threads=0, prefill_chunk=64)
        alone.prefill(ids)
        assert alone._blas is None
        with pytest.warns(DeprecationWarning, match="blas_threads"):
            old = kr.Runner.random(decode_blas_threads=1, prefill_chunk=64)
        assert old.blas_threads is None                    # prompts stay governed
        old.prefill(ids)
        assert set(old._blas.sizes) == {2}
        old.reset()
        last = old.prefill(ids[:1])                        # a single position: capped at 1
        assert set(old._blas.sizes) == {1}
        assert np.isfinite(last).all()
    for bad in (-1, 1.5, "x"):
        with pytest.raises((TypeError, ValueError)):
            kr.Runner.random(blas_threads=bad)
