"""kvcache's thread policy (kvcache._threads): the counts it picks, the limits it honours, the
caller's control, and results that do not depend on any of it.  No timing is asserted."""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

import kvcache as kc
from kvcache import _core, _threads
from kvcache._threads import MIN_WORK_PER_THREAD as M
from kvcache._threads import Sampler, choose, thread_settings, threads, threads_for

BIG = 1 << 30           # work enough for any thread count


# ---------------------------------------------------------------- the pure rule
@pytest.mark.parametrize("work, tasks, limit, free, expected", [
    (BIG, 64, 2, None, 2),          # quiet, no sample: the limit
    (BIG, 64, 8, None, 8),
    (BIG, 3, 8, None, 3),           # never more threads than independent tasks
    (BIG, 1, 8, None, 1),
    (BIG, 0, 8, None, 1),           # nothing to split: the caller alone
    (2 * M - 1, 64, 8, None, 1),    # too little work for a second thread
    (2 * M, 64, 8, None, 2),
    (5 * M, 64, 8, None, 5),        # each thread gets at least M multiply-adds
    (0, 64, 8, None, 1),
    (BIG, 64, 1, None, 1),          # the OpenMP limit
    (BIG, 64, 2, 1, 1),             # one CPU free (a busy core): one thread
    (BIG, 64, 2, 2, 2),
    (BIG, 64, 8, 3, 3),             # a busy many-core host: what is free
    (BIG, 64, 8, 0, 1),             # oversubscribed: still the caller
    (BIG, 64, 8, -5, 1),
    (BIG, 2, 8, 6, 2),
])
def test_choose(work, tasks, limit, free, expected):
    assert choose(work, tasks, limit, free) == expected


def test_choose_refuses_a_limit_below_one():
    with pytest.raises(ValueError, match="limit"):
        choose(BIG, 4, 0)


# ---------------------------------------------------------------- the sampler, simulated
class FakeClock:
    """A monotonic clock that moves only when a test says so (any starting value: the sampler
    uses differences only)."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def fake_sampler(tmp_path, running, host=2, usable=2, own=0, clock=None):
    """A sampler reading a loadavg file of ours, on a simulated host of ``host`` CPUs of which
    ``usable`` are ours, with ``own`` of our team's workers runnable, on a clock of ours."""
    path = tmp_path / "loadavg"
    path.write_text(f"0.50 0.40 0.30 {running}/321 4567\n")
    s = Sampler(str(path), clock=clock or FakeClock())
    s.host, s.usable = host, usable
    s.own_running = lambda workers: min(own, workers)          # type: ignore[method-assign]
    return s


@pytest.mark.parametrize("running, own, host, usable, expected", [
    (1, 0, 2, 2, 2),     # the caller alone
    (2, 1, 2, 2, 2),     # the caller and its own spinning worker: still quiet
    (2, 0, 2, 2, 1),     # a busy loop elsewhere
    (3, 1, 2, 2, 1),     # a busy loop, and our worker still spinning
    (3, 0, 2, 2, 1),     # more busy threads than cores
    (1, 0, 64, 8, 8),    # a container on a big host: its CPUs, not the host's
    (40, 0, 64, 8, 8),   # a busy host with room left
    (62, 0, 64, 8, 3),   # a nearly full host
])
def test_sampler_counts_free_cpus(tmp_path, running, own, host, usable, expected):
    s = fake_sampler(tmp_path, running, host, usable, own)
    assert s.available
    free, _ = s.sample(want=usable, spinning=usable - 1)
    assert free == expected
    assert s.cap(64, usable) == expected and s.last == expected


@pytest.mark.parametrize("asleep_from", [0, 1])
@pytest.mark.parametrize("others, expected", [(0, 2), (1, 1)])
def test_a_worker_falling_asleep_between_the_readings_is_not_competition(
        tmp_path, others, expected, asleep_from):
    """Our spinning worker is runnable when the host's count is first read and asleep from
    the ``asleep_from``-th reading of its own state on: read once after the host's count, it
    would be counted there and not among ours, a competitor that is not there.  The sample
    reads its workers before and after the host's count until the two agree.  A real
    competitor is seen either way."""
    s = fake_sampler(tmp_path, running=2 + others)
    path = tmp_path / "loadavg"
    reads: list[int] = []

    def own_running(workers: int) -> int:
        if len(reads) >= asleep_from:       # the worker is asleep: the host's count lacks it
            path.write_text(f"0.5 0.4 0.3 {1 + others}/100 1\n")
        reads.append(0 if len(reads) >= asleep_from else 1)
        return reads[-1]

    s.own_running = own_running                                # type: ignore[method-assign]
    free, exact = s.sample(want=2, spinning=1)
    assert (free, exact) == (expected, True)
    assert len(reads) == 2 + asleep_from                    # again while the two disagreed


# any epoch: a clock read just after boot (0), an hour-old machine, a year-old one
EPOCHS = [0.0, 3600.0, 3.2e7]


@pytest.mark.parametrize("start", EPOCHS)
def test_the_count_stays_down_for_a_moment_after_competition(tmp_path, start):
    """A competitor that pauses between two calls does not bring back a team it would stall:
    the count goes down at once and up only after HOLD seconds without competition."""
    clock = FakeClock(start)
    s = fake_sampler(tmp_path, running=1, clock=clock)
    step = 2 * _threads.SAMPLE_TTL                            # a fresh sample every call
    assert s.cap(2, 2) == 2
    (tmp_path / "loadavg").write_text("0.5 0.4 0.3 2/100 1\n")    # a busy loop appears
    clock.advance(step)
    assert s.cap(2, 2) == 1
    clock.advance(step)
    assert s.cap(2, 2) == 1                                   # seen twice in a row: held
    (tmp_path / "loadavg").write_text("0.5 0.4 0.3 1/100 1\n")    # ...pauses
    clock.advance(step)
    assert s.cap(2, 2) == 1 and s.last == 1
    clock.advance(_threads.HOLD / 4)
    assert s.cap(2, 2) == 1                                   # still inside the hold
    clock.advance(_threads.HOLD)                              # ...gone long enough
    assert s.cap(2, 2) == 2


@pytest.mark.parametrize("start", EPOCHS)
def test_a_thread_runnable_for_one_sample_is_not_held(tmp_path, start):
    """A competitor seen by one sample only (a daemon waking up) lowers that sample's count
    but starts no hold: the next sample without it gives the team back."""
    clock = FakeClock(start)
    s = fake_sampler(tmp_path, running=1, clock=clock)
    step = 2 * _threads.SAMPLE_TTL
    assert s.cap(2, 2) == 2
    (tmp_path / "loadavg").write_text("0.5 0.4 0.3 2/100 1\n")
    clock.advance(step)
    assert s.cap(2, 2) == 1
    (tmp_path / "loadavg").write_text("0.5 0.4 0.3 1/100 1\n")
    clock.advance(step)
    assert s.cap(2, 2) == 2


def test_a_sample_is_reused_for_its_ttl(tmp_path):
    clock = FakeClock(5.0)
    s = fake_sampler(tmp_path, running=1, clock=clock)
    assert s.cap(2, 2) == 2
    (tmp_path / "loadavg").write_text("0.5 0.4 0.3 2/100 1\n")
    clock.advance(_threads.SAMPLE_TTL / 2)
    assert s.cap(2, 2) == 2                                   # the cached sample
    clock.advance(_threads.SAMPLE_TTL)
    assert s.cap(2, 2) == 1


def test_sampler_parses_the_running_field(tmp_path):
    s = fake_sampler(tmp_path, 7)
    assert s.running() == 7


def test_no_proc_means_the_work_rule_alone(tmp_path):
    s = Sampler(str(tmp_path / "missing"))
    assert not s.available
    assert s.cap(5, 8) == 5
    bad = tmp_path / "garbage"
    bad.write_text("not a loadavg line")
    assert not Sampler(str(bad)).available


@pytest.fixture
def simulated(monkeypatch, tmp_path):
    """Install a simulated sampler for threads_for: call it with the runnable count."""
    def install(running, own=0, host=2, usable=2):
        s = fake_sampler(tmp_path, running, host, usable, own)
        monkeypatch.setattr(_threads, "_sampler", s)
        return s
    return install


def test_threads_for_uses_the_free_cpus(simulated):
    with threadpool_limits(2, user_api="openmp"):
        simulated(running=1)
        assert threads_for(BIG, 64) == 2
        simulated(running=2, own=1)
        assert threads_for(BIG, 64) == 2
        simulated(running=2)
        assert threads_for(BIG, 64) == 1
        simulated(running=3, own=1)
        assert threads_for(BIG, 64) == 1
        assert thread_settings().free_cpus == 1


def test_small_calls_never_sample(simulated):
    s = simulated(running=1)
    with threadpool_limits(2, user_api="openmp"):
        assert threads_for(M, 64) == 1
        assert threads_for(BIG, 1) == 1
    assert s.last is None


def test_forced_counts_ignore_the_load(simulated):
    simulated(running=50)
    with threadpool_limits(2, user_api="openmp"):
        with threads(adaptive=False):
            assert threads_for(BIG, 64) == 2
            assert threads_for(1, 1) == 2          # forced means forced (the kernels still
        with threads(2, adaptive=False):           # keep their own tiny-work gate)
            assert threads_for(BIG, 64) == 2
        with threads(1, adaptive=False):
            assert threads_for(BIG, 64) == 1


# ---------------------------------------------------------------- limits
def test_threadpoolctl_caps_every_mode(simulated):
    simulated(running=1, host=8, usable=8)
    with threadpool_limits(1, user_api="openmp"):
        assert threads_for(BIG, 64) == 1
        with threads(4, adaptive=False):
            assert threads_for(BIG, 64) == 1
        assert thread_settings().limit == 1
    with threadpool_limits(3, user_api="openmp"):
        assert threads_for(BIG, 64) == 3
        with threads(8, adaptive=False):
            assert threads_for(BIG, 64) == 3           # a cap above the limit is capped
        with threads(2):
            assert threads_for(BIG, 64) == 2           # an adaptive cap
        st = thread_settings()
        assert (st.limit, st.cap, st.max_threads, st.mode) == (3, None, 3, "adaptive")


@pytest.mark.parametrize("env, forced, adaptive_quiet", [("1", 1, 1), ("3", 3, 3)])
def test_omp_num_threads_is_the_limit(env, forced, adaptive_quiet, tmp_path):
    """OMP_NUM_THREADS is read when the OpenMP runtime starts: a fresh interpreter."""
    code = f"""
import json, kvcache
from kvcache import _threads
s = _threads.Sampler({str(tmp_path / 'loadavg')!r})
s.host = s.usable = 8
_threads._sampler = s
with kvcache.threads(adaptive=False):
    forced = _threads.threads_for(1 << 30, 64)
print(json.dumps([kvcache.thread_settings().limit, forced, _threads.threads_for(1 << 30, 64)]))
"""
    (tmp_path / "loadavg").write_text("0.0 0.0 0.0 1/100 1\n")
    env_vars = dict(os.environ, OMP_NUM_THREADS=env)
    out = subprocess.run([sys.executable, "-c", code], env=env_vars, capture_output=True,
                         text=True, check=True).stdout
    assert json.loads(out) == [int(env), forced, adaptive_quiet]


# ---------------------------------------------------------------- the control
def test_blocks_nest_and_restore():
    assert thread_settings()[1:3] == (None, True)
    with threads(1, adaptive=False):
        assert thread_settings()[1:3] == (1, False)
        with threads(2):
            assert thread_settings()[1:3] == (2, True)
            with threads():
                assert thread_settings()[1:3] == (None, True)
            assert thread_settings()[1:3] == (2, True)
        assert thread_settings()[1:3] == (1, False)
    assert thread_settings()[1:3] == (None, True)


def test_a_block_can_be_reused_and_restores_on_error():
    block = threads(1, adaptive=False)
    with pytest.raises(RuntimeError):
        with block:
            with block:
                assert thread_settings().cap == 1
            raise RuntimeError("boom")
    assert thread_settings()[1:3] == (None, True)
    assert "threads(1, adaptive=False)" in repr(block)


def test_settings_belong_to_the_python_thread():
    seen = []
    start, done = threading.Event(), threading.Event()

    def other():
        seen.append(thread_settings()[1:3])
        with threads(3):
            start.set()
            done.wait(5)
            seen.append(thread_settings()[1:3])

    with threads(1, adaptive=False):
        t = threading.Thread(target=other)
        t.start()
        assert start.wait(5)
        assert thread_settings()[1:3] == (1, False)       # the other thread's block is its own
        done.set()
        t.join()
    assert seen == [(None, True), (3, True)]


def test_settings_belong_to_the_async_task():
    async def task(n):
        with threads(n, adaptive=False):
            await asyncio.sleep(0.01)
            return thread_settings().cap

    async def both():
        return await asyncio.gather(task(1), task(2))

    assert asyncio.run(both()) == [1, 2]


@pytest.mark.parametrize("args, kwargs, exc, match", [
    ((0,), {}, ValueError, "n: expected >= 1"),
    ((-2,), {}, ValueError, "n: expected >= 1"),
    ((1.5,), {}, TypeError, "n: expected an int"),
    (("2",), {}, TypeError, "n: expected an int"),
    ((True,), {}, TypeError, "n: expected an int"),
    ((2,), {"adaptive": 1}, TypeError, "adaptive: expected a bool"),
])
def test_bad_arguments_raise_at_the_call(args, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        threads(*args, **kwargs)
    assert thread_settings()[1:3] == (None, True)


def test_show_config_shows_the_settings():
    out = io.StringIO()
    with threads(1, adaptive=False):
        kc.show_config(file=out)
    text = out.getvalue()
    assert "thread_mode: forced: 1 per call" in text and "cap 1" in text
    assert "thread_sampler:" in text
    out = io.StringIO()
    kc.show_config(file=out)
    assert f"1 to {thread_settings().max_threads} per call" in out.getvalue()


def test_public_names():
    assert kc.threads is threads and kc.thread_settings is thread_settings
    assert {"threads", "thread_settings"} <= set(kc.__all__)


def test_thread_ids_name_the_team():
    ids = _core.thread_ids(3)
    assert ids.shape == (3,) and ids.dtype == np.int64
    if _core.openmp_built() and sys.platform.startswith("linux"):
        assert ids[0] == threading.get_native_id()
        assert len(set(ids.tolist())) == 3 and all(i > 0 for i in ids)
        assert os.path.exists(f"/proc/self/task/{ids[1]}")


def test_the_real_sampler_reads_our_own_workers():
    """The sampler finds the kernel threads of the caller's OpenMP team and reads their state
    (a spinning worker is not competition); without /proc it gives no sample."""
    s = Sampler()
    if not (s.available and _core.openmp_built()):
        assert s.cap(5, 8) == 5
        return
    with threadpool_limits(2, user_api="openmp"), threads(2, adaptive=False):
        filled("f32").attend_all_heads(np.ones((16, 64), np.float32))
    assert s.own_running(1) in (0, 1)
    tids = s._team.tids
    assert len(tids) == 1 and _threads._stat_state(tids[0]) in "RSD"
    free, exact = s.sample(want=64, spinning=1)
    assert 1 <= free <= s.usable and exact


def test_calls_tell_the_policy_their_size(monkeypatch):
    """attend_all_heads asks for 2 * queries * rows * head_dim multiply-adds in (KV group,
    256-row chunk) tasks; mla_decode and the O(1) step ask too."""
    import kvcache._attention as att
    import kvcache.mla as mla
    seen = []

    def record(work, tasks):
        seen.append((work, tasks))
        return 1

    monkeypatch.setattr(att, "threads_for", record)
    filled("f32", context=1500).attend_all_heads(np.ones((16, 64), np.float32))
    assert seen == [(2 * 16 * 1500 * 64, 4 * 6)]
    monkeypatch.setattr(mla, "threads_for", record)
    rng = np.random.default_rng(0)
    kc.mla.mla_decode(*(rng.standard_normal(s, dtype=np.float32)
                    for s in ((4, 16), (4, 8), (700, 32), (700, 8), (4, 16, 32), (4, 16, 32))),
                  scale=0.1)
    assert len(seen) == 2 and seen[1][0] > 0 and seen[1][1] >= 1


# ---------------------------------------------------------------- results do not move
def filled(mode, context=1500, nkv=4, hd=64, seed=0):
    rng = np.random.default_rng(seed)
    c = kc.LayerKvCache(nkv, hd, mode=kc.KvMode.parse(mode, "mode"))
    c.append(rng.standard_normal((context, nkv, hd), dtype=np.float32),
             rng.standard_normal((context, nkv, hd), dtype=np.float32))
    return c


@pytest.mark.parametrize("mode", ["f32", "q8", "q4", "k8v4"])
@pytest.mark.parametrize("n_pos", [0, 5])
def test_results_are_bit_identical_for_every_count(mode, n_pos):
    """Decode (one position) and a multi-position block under each count the policy can pick,
    forced, and the adaptive default: the same bits, importance included (the 4-bit modes
    too)."""
    rng = np.random.default_rng(1)
    shape = (16, 64) if n_pos == 0 else (n_pos, 16, 64)
    q = rng.standard_normal(shape, dtype=np.float32)
    outs = []
    with threadpool_limits(4, user_api="openmp"):
        for block in (threads(1, adaptive=False), threads(2, adaptive=False),
                      threads(3, adaptive=False), threads(4, adaptive=False), threads()):
            c = filled(mode)
            with block:
                out = c.attend_all_heads(q)
                out2 = c.attend_all_heads(q, window=700)
            outs.append((out, out2, c.importance.copy()))
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            np.testing.assert_array_equal(a, b)


def test_mla_and_o1_results_do_not_depend_on_the_count():
    rng = np.random.default_rng(2)
    T, H, dn, dr, r, dv = 700, 4, 16, 8, 32, 16
    args = (rng.standard_normal((H, dn), dtype=np.float32),
            rng.standard_normal((H, dr), dtype=np.float32),
            rng.standard_normal((T, r), dtype=np.float32),
            rng.standard_normal((T, dr), dtype=np.float32),
            rng.standard_normal((H, dn, r), dtype=np.float32),
            rng.standard_normal((H, dv, r), dtype=np.float32))
    res = []
    with threadpool_limits(4, user_api="openmp"):
        for block in (threads(1, adaptive=False), threads(4, adaptive=False), threads()):
            with block:
                res.append(kc.mla.mla_decode(*args, scale=0.1))
    for other in res[1:]:
        np.testing.assert_array_equal(res[0], other)


# ---------------------------------------------------------------- the benchmark section
def test_contention_section_smallest_run(tmp_path, capsys):
    from kvcache import bench
    path = tmp_path / "contention.json"
    argv = ["--sections", "contention", "--quick", "--contention-calls", "3",
            "--contention-contexts", "64", "--contention-conditions", "quiet", "spin", "numpy",
            "pythread", "twoproc", "--no-progress", "--json", str(path)]
    assert bench.main(argv) == 0
    text = capsys.readouterr().out
    assert "contention: decode latency" in text and "forced 1 med/p99 ms" in text
    data = json.loads(path.read_text())["sections"]["contention"]
    rows = data["rows"]
    cells = ["attend f32 64", "attend q8 64", "runner f32 64", "prefill f32 64"]
    conds = ["quiet", "spin", "numpy", "pythread", "twoproc"]
    assert [(r["cell"], r["condition"]) for r in rows] == [(c, k) for c in cells for k in conds]
    for r in rows:
        assert set(r["settings"]) == {"default", "forced 1", "forced all"}
        for s in r["settings"].values():
            assert 0 < s["median_ms"] <= s["p99_ms"] <= s["max_ms"]
        if r["cell"].startswith("prefill") and r["condition"] not in ("quiet", "spin"):
            assert "met" not in r                    # reported, no target
        else:
            assert isinstance(r["met"], bool)
        if r["condition"] == "twoproc" and not r["cell"].startswith("prefill"):
            assert set(r["share_of_half_solo"]) == set(r["settings"])
    prefill = {r["condition"]: r for r in rows if r["cell"] == "prefill f32 64"}
    assert "BLAS at its own count" in prefill["quiet"]["target"]
    q = prefill["quiet"]["settings"]
    assert prefill["quiet"]["ratio"] == q["default"]["median_ms"] / q["forced all"]["median_ms"]
    sp = prefill["spin"]["settings"]
    assert prefill["spin"]["ratio"] == sp["forced 1"]["median_ms"] / sp["default"]["median_ms"]
    assert all(s["calls"] == 2 for s in q.values())  # the quick run's prefills per setting
    assert data["calls"] == 3 and data["prefill_calls"] == 2
    assert all(len(data["results"]["twoproc"][c]) == 2 for c in cells)   # two processes
    assert data["options"]["runner_model"] == "tiny"
    assert data["options"]["prefill_tokens"] == [64]


def test_contention_prefill_cells_can_be_left_out(tmp_path):
    from kvcache import bench
    path = tmp_path / "contention.json"
    argv = ["--sections", "contention", "--quick", "--contention-calls", "2",
            "--contention-contexts", "64", "--contention-conditions", "quiet",
            "--contention-runner-context", "0", "--contention-prefill-tokens", "0",
            "--no-progress", "--json", str(path)]
    assert bench.main(argv) == 0
    rows = json.loads(path.read_text())["sections"]["contention"]["rows"]
    assert [r["cell"] for r in rows] == ["attend f32 64", "attend q8 64"]


def test_contention_options_are_checked(capsys):
    from kvcache import bench
    with pytest.raises(SystemExit):
        bench.main(["--sections", "contention", "--contention-conditions", "loud"])
    err = capsys.readouterr().err
    assert "--contention-conditions: expected one of quiet, spin" in err and "'loud'" in err


def test_one_threads_object_entered_by_several_threads_at_once():
    """Each thread restores its own setting, whatever the order they leave in."""
    import threading
    import time

    shared = kc.threads(1)
    seen: list[object] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(3)

    def work(delay: float) -> None:
        try:
            with shared:
                barrier.wait()
                time.sleep(delay)
                seen.append(kc.thread_settings().cap)
            seen.append(kc.thread_settings().cap)
        except BaseException as exc:      # noqa: BLE001 -- reported below
            errors.append(exc)

    ts = [threading.Thread(target=work, args=(d,)) for d in (0.03, 0.0, 0.015)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert errors == []
    assert sorted(seen, key=str) == sorted([1, 1, 1, None, None, None], key=str)
    assert kc.thread_settings().cap is None


def test_threads_takes_numpy_ints_and_refuses_other_types():
    with kc.threads(np.int64(2)):
        assert kc.thread_settings().cap == 2
    with pytest.raises(TypeError):
        kc.threads(2.0)       # type: ignore[arg-type]
    with pytest.raises(RuntimeError):
        kc.threads(1).__exit__(None, None, None)
