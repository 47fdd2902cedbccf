"""Side-by-side timing in the benchmark: every cell of a comparison timed round by round
(:func:`kvcache.bench.timing.time_interleaved`), and ratios as medians of each round's pair
(:func:`kvcache.bench.timing.paired_ratio`).  The timer is a fake clock here, so nothing
depends on this machine's speed or load."""

from __future__ import annotations

import gc
import statistics

import pytest

from kvcache.bench import attention, timing
from kvcache.bench.registry import Context, Values


class Clock:
    """A clock that advances only when a timed function says how long it took."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_rounds_rotate_the_order_and_pair_the_samples():
    clock, order = Clock(), []
    cost = {"a": [1.0, 2.0, 4.0], "b": [3.0, 3.0, 3.0], "c": [0.5, 0.5, 8.0]}
    calls = {"a": 0, "b": 0, "c": 0}

    def fn(name):
        def call():
            order.append(name)
            calls[name] += 1
            if calls[name] > 1:                   # the first call is the warm-up
                clock.now += cost[name][calls[name] - 2]
        return call

    samples = timing.time_interleaved({n: fn(n) for n in "abc"}, 3, clock=clock)
    assert order[:3] == ["a", "b", "c"]                       # the warm-up, untimed
    assert order[3:] == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert samples == cost                                    # sample r from round r
    assert gc.isenabled()
    assert [timing.rotated("abc", r) for r in (0, 1, 2, 3, 5)] == [
        list("abc"), list("bca"), list("cab"), list("abc"), list("cab")]
    assert timing.rotated([], 3) == []


def test_go_on_ends_the_rounds_but_never_the_first():
    calls = []
    samples = timing.time_interleaved({"x": lambda: calls.append("x"),
                                       "y": lambda: calls.append("y")},
                                      5, warmup=0, go_on=lambda s: False)
    assert calls == ["x", "y"] and [len(v) for v in samples.values()] == [1, 1]
    seen = []
    timing.time_interleaved({"x": lambda: None}, 4, warmup=0,
                            go_on=lambda s: seen.append(len(s["x"])) or len(s["x"]) < 2)
    assert seen == [1, 2]


def test_gc_is_restored_when_a_timed_call_raises():
    def boom():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        timing.time_interleaved({"b": boom}, 2, warmup=0)
    assert gc.isenabled()
    gc.disable()
    try:
        timing.time_interleaved({"n": lambda: None}, 1)
        assert not gc.isenabled()                 # left as the caller had it
    finally:
        gc.enable()


def test_paired_ratio_is_the_median_of_each_rounds_ratio():
    # the machine slowed down between rounds: each round f32 took twice q8's time
    f32 = [2.0, 8.0, 4.0, 20.0]
    q8 = [1.0, 4.0, 2.0, 10.0]
    assert timing.paired_ratio(f32, q8) == 2.0
    assert statistics.median(f32) / statistics.median(q8) == 2.0
    # where the two differ: the rounds say 0.5, 4 and 1.25, the medians 4 / 2
    f32, q8 = [1.0, 4.0, 10.0], [2.0, 1.0, 8.0]
    assert timing.paired_ratio(f32, q8) == 1.25
    assert statistics.median(f32) / statistics.median(q8) == 2.0
    # samples that cover several steps each (layers per sweep)
    assert timing.paired_ratio([8.0, 8.0], [2.0, 2.0], slow_per=4, fast_per=2) == 2.0


@pytest.mark.parametrize("slow,fast", [([], []), ([1.0], [1.0, 2.0])])
def test_paired_ratio_wants_as_many_samples_each_side(slow, fast):
    with pytest.raises(ValueError, match="as many samples on each side"):
        timing.paired_ratio(slow, fast)


class Bar:
    def set_postfix_str(self, s):
        pass

    def update(self, n=1):
        pass


def record_passes(monkeypatch):
    """The names of every pass of rounds the decode section times (one list per pass)."""
    passes = []

    def recording(fns, *args, **kwargs):
        passes.append(list(fns))
        return timing.time_interleaved(fns, *args, **kwargs)

    monkeypatch.setattr(attention, "time_interleaved", recording)
    return passes


def test_decode_times_the_modes_side_by_side(monkeypatch):
    """One context of the decode section, f32, q8 and q4 at one thread: every mode has a
    sample per round, and its speed-ups over f32 (and q4's over q8) are the paired medians of
    those samples."""
    ctx = Context(quick=True, threads=[1], seed=0, bandwidth_bytes=0,
                  bandwidth={1: {"best_gbs": 1e6}})
    values = Values({"modes": ["f32", "q8", "q4"], "repeats": 3, "ref_repeats": 1,
                     "working_set_mib": 1, "torch": False, "reference": True})

    passes = record_passes(monkeypatch)
    rows = attention.run_context(attention.GEOMETRIES["qwen2.5-0.5b"], 256, ctx, values, Bar())
    assert passes == [["f32", "q8", "q4"]]            # one pass of rounds, every mode in it
    by_mode = {r["mode"]: r for r in rows}
    assert set(by_mode) == {"f32", "q8", "q4"}
    f32, q8, q4 = by_mode["f32"], by_mode["q8"], by_mode["q4"]
    assert len({len(r["kvcache_samples_s"]) for r in rows}) == 1
    assert len(q4["kvcache_samples_s"]) == 3
    for base, r in ((f32, q8), (f32, q4), (q8, q4)):
        assert r[f"speedup_vs_{base['mode']}"] == timing.paired_ratio(
            base["kvcache_samples_s"], r["kvcache_samples_s"], base["layers"], r["layers"])
    assert "speedup_vs_f32" not in f32 and "speedup_vs_q8" not in q8
    assert "vs q8" in attention.decode_table(rows)
    for r in rows:
        assert r["rel_err_vs_reference"] < 1e-5 and not r["remeasured"] and r["paired"]
    assert any(n.startswith("side by side") for n in attention.notes(values, rows))
    old_rows = [{k: v for k, v in r.items() if k != "paired"} for r in rows]
    assert not any(n.startswith("side by side") for n in attention.notes(values, old_rows))


def test_a_decode_reading_above_the_bandwidth_retakes_every_rounds(monkeypatch):
    """A mode reading faster than the measured bandwidth makes the section time all modes'
    rounds once more (so the samples stay paired), and every row says so."""
    ctx = Context(quick=True, threads=[1], seed=0, bandwidth_bytes=0,
                  bandwidth={1: {"best_gbs": 1e-9}})
    values = Values({"modes": ["f32", "q8"], "repeats": 2, "ref_repeats": 1,
                     "working_set_mib": 1, "torch": False, "reference": False})
    passes = record_passes(monkeypatch)
    rows = attention.run_context(attention.GEOMETRIES["qwen2.5-0.5b"], 128, ctx, values, Bar())
    assert passes == [["f32", "q8"], ["f32", "q8"]]
    assert all(r["remeasured"] and r["above_bandwidth"] for r in rows)
