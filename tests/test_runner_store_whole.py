"""The runner with a prefix store, a prompt of whole stored blocks: loaded whole, nothing computed.

Small random-weight runners (``Runner.random``, no torch needed) and a real MemoryBackend: a
miss stores the blocks and the final hidden row at each block's end; a new runner given a
prompt of whole stored blocks loads every position, computes no layer, and its logits, decode
steps and a roll-back and replay are bit-identical to a cold run, in every KV mode.  Modes with
4-bit K compute the chunk of the last position instead (their roll-back needs its computed
rows).  A missing or damaged hidden row costs only time.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from kvcache import runner as kr
from kvcache.store import MemoryBackend, PrefixStore
from kvcache.store.keys import Geometry, as_ids, block_keys, output_key

VOCAB = 512


def ids_of(n, seed=3):
    return np.random.default_rng(seed).integers(0, VOCAB, n)


def trace(runner, ids, store=None, steps=4):
    """Prompt logits, ``steps`` greedy decode steps, then a roll-back of 40 positions (into
    the prompt's last block) and the same steps again."""
    runner.reset()
    out = [runner.prefill(ids, store=store)]
    for _ in range(steps):
        out.append(runner.step(int(np.argmax(out[-1]))))
    runner.truncate_last(40)
    tail = ids[-(40 - steps):]
    out.append(runner.forward(tail))
    for _ in range(steps):
        out.append(runner.step(int(np.argmax(out[-1]))))
    return out


def assert_bits(got, want):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype == np.float32
        assert np.array_equal(g, w), f"logits {i} differ by {np.abs(g - w).max()}"


def output_name(store, runner, ids):
    layer = runner.cache.layers[0]
    geom = Geometry(len(runner.cache.layers), layer.num_kv_heads, layer.head_dim, layer.mode,
                    store.block)
    return output_key(block_keys(as_ids(ids), store.fingerprint, geom)[-1],
                      runner.config.hidden_size).hex()


@pytest.mark.parametrize("kv", ["f32", "q8", "q8:cmf", "q4", "k4v8", "k8v4"])
def test_a_prompt_of_whole_stored_blocks_computes_no_position(kv):
    # the default chunk is the default block (256): the miss keeps the final hidden row at
    # each block's end; a new runner then loads the whole prompt and computes no layer
    backend = MemoryBackend()
    ids = ids_of(512)
    cold = trace(kr.Runner.random(seed=2, kv=kv), ids)
    first = kr.Runner.random(seed=2, kv=kv)
    store = PrefixStore(backend, fingerprint=first.fingerprint)
    assert_bits(trace(first, ids, store=store), cold)
    assert first.store_loaded == 0
    assert len(backend) == 4                             # 2 blocks, 2 hidden rows
    k4 = first.mode.k4
    for n in (512, 256):
        second = kr.Runner.random(seed=2, kv=kv)
        want = cold if n == 512 else trace(kr.Runner.random(seed=2, kv=kv), ids[:n])
        assert_bits(trace(second, ids[:n], store=store), want)
        assert second.store_loaded == (n - 256 if k4 else n)
    fresh = kr.Runner.random(seed=2, kv=kv)
    fresh.prefill(ids, store=store)
    assert fresh.position == 512
    assert (fresh.timings["attention_s"] > 0) == k4      # 4-bit K: the last chunk computed


def test_a_missing_or_damaged_hidden_row_costs_only_time(caplog):
    backend = MemoryBackend()
    ids = ids_of(512)
    cold = trace(kr.Runner.random(seed=2), ids)
    runner = kr.Runner.random(seed=2)
    store = PrefixStore(backend, fingerprint=runner.fingerprint)
    trace(runner, ids, store=store)
    name = output_name(store, runner, ids)
    pristine = backend.get_many([name])[0]
    value = bytearray(pristine)
    value[100] ^= 4
    backend.put(name, bytes(value))
    with caplog.at_level(logging.WARNING, logger="kvcache"):
        assert_bits(trace(runner, ids, store=store), cold)
    assert runner.store_loaded == 256 and "unusable" in caplog.text
    assert backend.get_many([name])[0] == pristine       # computed and stored again
    backend.delete(name)
    assert_bits(trace(runner, ids, store=store), cold)
    assert runner.store_loaded == 256 and name in backend.keys()
    assert_bits(trace(runner, ids, store=store), cold)
    assert runner.store_loaded == 512


def test_outputs_are_stored_only_at_block_ends_the_call_computed():
    backend = MemoryBackend()
    runner = kr.Runner.random(seed=2, prefill_chunk=64)
    store = PrefixStore(backend, fingerprint=runner.fingerprint, block=128)
    ids = ids_of(600)
    runner.prefill(ids[:300], store=store)               # blocks and rows at 128, 256
    names = {n: output_name(store, runner, ids[:n]) for n in (128, 256, 384, 512)}
    assert [names[n] in backend.keys() for n in (128, 256, 384, 512)] == [True, True, False,
                                                                          False]
    runner.reset()
    runner.prefill(ids, store=store)                     # loads 256, computes 256..600
    assert runner.store_loaded == 256
    assert all(names[n] in backend.keys() for n in (384, 512))
    runner.reset()
    cold = kr.Runner.random(seed=2, prefill_chunk=64).prefill(ids[:512])
    assert np.array_equal(runner.prefill(ids[:512], store=store), cold)
    assert runner.store_loaded == 512
