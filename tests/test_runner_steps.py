"""The runner's step-major prefill: a prompt computed in steps of ``prefill_step`` positions
(each through every layer) gives the same bits as one step, for any step size.

Small random models (``Runner.random``) prefill prompts with steps of 64, 512 and one step for
the whole prompt; the logits (last position and all positions), every layer's stored rows (f32
rows, q8 codes, scales and column fields) and a few decode steps must be bit-identical.  Also:
the q8 column freeze inside the first step, the steps' progress calls, a store with a step size
that differs from the storing runner's, and ``python -m kvcache generate``'s prompt bar.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvcache.__main__ as cli
from kvcache import runner as kr
from kvcache._threads import usable_cpus
from kvcache.runner import model as km
from kvcache.store import MemoryBackend, PrefixStore

VOCAB = 512


def ids_of(n, seed=5):
    return np.random.default_rng(seed).integers(0, VOCAB, n)


def rows(runner):
    """Every stored row of every layer and head, as arrays."""
    out = []
    for layer in runner.cache.layers:
        for h in range(layer.num_kv_heads):
            if layer.mode.is_f32:
                out += [layer.head_keys(h), layer.head_values(h)]
            else:
                out += [a for a in layer.q8_rows(h) if a is not None]
                out += [a for a in layer.columns(h) if a is not None]
    return out


def run(step, kv, ids, decode=3):
    r = kr.Runner.random(kv=kv, prefill_step=step, prefill_chunk=64)
    last = r.prefill(ids)
    logits = [last] + [r.step(int(np.argmax(last)) + k) for k in range(decode)]
    got = rows(r)
    r.reset()
    every = r.prefill(ids, all_logits=True)
    return logits, got, every


@pytest.mark.parametrize("kv", ["f32", "q8", "q8k"])
@pytest.mark.parametrize("n", [700, 100, 64, 65, 1])
def test_step_size_does_not_change_the_bits(kv, n):
    ids = ids_of(n)
    want = run(None, kv, ids, 2)                   # the default step: 512
    for step in (64, 128, 1024):                   # 1024: the whole prompt in one step
        got = run(step, kv, ids, 2)
        for g, w in zip(got[0], want[0]):
            assert np.array_equal(g, w), (step, np.abs(g - w).max())
        assert len(got[1]) == len(want[1])
        assert all(np.array_equal(g, w) for g, w in zip(got[1], want[1])), step
        assert np.array_equal(got[2], want[2]) and got[2].shape == (n, VOCAB)


def test_steps_hold_whole_chunks_and_skip_the_q8_warmup():
    r = kr.Runner.random(prefill_step=128, prefill_chunk=64)
    assert [[c for c in s] for s in r._steps(300)] == [
        [(0, 64), (64, 128)], [(128, 192), (192, 256)], [(256, 300)]]
    r.position = 100                                  # a call that starts inside a chunk
    assert r._steps(200) == [[(0, 28)], [(28, 92), (92, 156)], [(156, 200)]]
    q = kr.Runner.random(kv="q8:cmf", prefill_step=64, prefill_chunk=64)
    # f32 would end a step at 64; the legacy q8 scheme runs the first step past its column
    # freeze; the default scheme "rows" has no freeze and steps as f32 does
    assert q._steps(200) == [[(0, 64), (64, 128)], [(128, 192)], [(192, 200)]]
    assert kr.Runner.random(kv="q8", prefill_step=64, prefill_chunk=64)._steps(200) == [
        [(0, 64)], [(64, 128)], [(128, 192)], [(192, 200)]]
    # the default: 512 rounded up to whole chunks, and at least a chunk per usable CPU (<= 8)
    cpus = min(usable_cpus(), 8)
    assert km.DEFAULT_PREFILL_STEP == 512 and km.DEFAULT_PREFILL_CHUNK == 256
    assert kr.Runner.random().prefill_step == max(2, cpus) * 256
    assert kr.Runner.random(prefill_chunk=96).prefill_step == max(6, cpus) * 96
    assert kr.Runner.random(prefill_chunk=64).prefill_step == max(8, cpus) * 64
    with pytest.raises(ValueError, match="multiple of prefill_chunk=64"):
        kr.Runner.random(prefill_step=100, prefill_chunk=64)
    with pytest.raises(ValueError, match="prefill_step"):
        kr.Runner.random(prefill_step=0)


def test_each_step_goes_through_every_layer_before_the_next(monkeypatch):
    r = kr.Runner.random(prefill_step=128, prefill_chunk=64)
    seen = []
    real = kr.Runner._layer

    def layer(self, i, xs, positions, *a):
        seen.append((i, sum(x.shape[0] for x in xs)))
        return real(self, i, xs, positions, *a)
    monkeypatch.setattr(kr.Runner, "_layer", layer)
    logit_rows = []
    real_logits = kr.Runner._logits

    def logits(self, x):
        logit_rows.append(x.shape[0])
        return real_logits(self, x)
    monkeypatch.setattr(kr.Runner, "_logits", logits)
    calls = []
    r.prefill(ids_of(300), progress=lambda done, total: calls.append((done, total)))
    layers = r.config.num_layers
    assert seen == [(i, rows) for rows in (128, 128, 44) for i in range(layers)]
    assert calls == [(128, 300), (256, 300), (300, 300)]
    assert logit_rows == [1]                   # the last position's logits only
    r.reset()
    logit_rows.clear()
    assert r.prefill(ids_of(300), all_logits=True).shape == (300, VOCAB)
    assert logit_rows == [64, 64, 64, 64, 44]  # unless asked: every chunk's


def test_a_store_filled_with_another_step_size_gives_the_same_bits():
    ids = ids_of(600)
    backend = MemoryBackend()
    small = kr.Runner.random(kv="q8", prefill_step=64, prefill_chunk=64)
    big = kr.Runner.random(kv="q8", prefill_step=1024, prefill_chunk=64)
    assert small.fingerprint == big.fingerprint        # the step is not part of it
    store = PrefixStore(backend, fingerprint=small.fingerprint, block=128)
    want = kr.Runner.random(kv="q8", prefill_chunk=64).prefill(ids)
    assert np.array_equal(small.prefill(ids, store=store), want)
    calls = []
    got = big.prefill(ids, store=store, progress=lambda d, t: calls.append((d, t)))
    assert big.store_loaded == 512 and np.array_equal(got, want)
    assert calls == [(88, 88)]                         # only the computed positions count


def test_generate_command_shows_a_bar_for_long_prompts(monkeypatch, capsys):
    bars = []

    class Bar:
        def __init__(self, total, enabled, unit):
            self.total, self.enabled, self.unit, self.n, self.closed = total, enabled, unit, 0, False
            bars.append(self)

        def update(self, n=1):
            self.n += n

        def set_postfix_str(self, s="", refresh=True):
            pass

        def close(self):
            self.closed = True
    from kvcache.runner import cli as rcli
    monkeypatch.setattr(rcli, "progress_bar", Bar)
    step = kr.Runner.random().prefill_step           # the default step on this machine
    n = 2 * step + 64
    ids = ",".join(str(int(t)) for t in ids_of(n))
    assert cli.main(["generate", "--max-new-tokens", "2", "--ids", ids]) == 0
    prompt = [b for b in bars if b.unit == "pos"]
    assert len(prompt) == 1 and prompt[0].total == n and prompt[0].n == n
    assert prompt[0].closed and prompt[0].enabled
    bars.clear()
    assert cli.main(["generate", "--no-progress", "--max-new-tokens", "2", "--ids", ids]) == 0
    assert [b.enabled for b in bars if b.unit == "pos"] == [False]
    bars.clear()
    short = ",".join(str(int(t)) for t in ids_of(2 * step))
    assert cli.main(["generate", "--max-new-tokens", "2", "--ids", short]) == 0
    assert [b for b in bars if b.unit == "pos"] == []     # two steps or fewer: no bar
    capsys.readouterr()


def test_o1_layers_seal_the_same_prompt_whatever_the_step():
    ids = ids_of(300)
    out = []
    for step in (64, 1024):
        r = kr.Runner.random(o1_layers="all", o1_params=(8, 32, 2), prefill_step=step,
                             prefill_chunk=64)
        first = r.prefill(ids)
        assert all(r.cache.layers[i].o1_sealed() for i in r.o1_layers)
        out.append([first] + [r.step(int(np.argmax(first)) + k) for k in range(3)])
    for a, b in zip(*out):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("bad", [5, "bar", object()])
def test_a_progress_that_is_not_callable_is_refused_before_any_work(bad):
    r = kr.Runner.random(kv="f32", prefill_step=64, prefill_chunk=64)
    with pytest.raises(TypeError, match="progress"):
        r.prefill(ids_of(200), progress=bad)
    assert r.position == 0 and r.cache.layers[0].seq_len == 0
    with pytest.raises(TypeError, match="progress"):
        r.generate(ids_of(200), 2, progress=bad)
    assert r.position == 0 and r.cache.layers[0].seq_len == 0
