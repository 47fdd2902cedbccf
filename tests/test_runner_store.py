"""The runner with a prefix store: the same bits with and without it.

The small random checkpoints of tests/test_runner.py (built by transformers, saved, loaded by
the runner) prefill prompts whose leading blocks come from a store (a directory, and a real
redis-server); the prompt's logits, every decode step's logits and the generated tokens must
be bit-identical (np.array_equal) to a run without the store, in f32 and q8.  Also: the
prefill's chunks, the fingerprint, the refusals (O(1) layers, a block the chunk does not
divide), a store that is down, and ``python -m kvcache generate --store``.
"""

from __future__ import annotations

import logging
import uuid

import numpy as np
import pytest

import kvcache.__main__ as cli
from kvcache import runner as kr
from kvcache.store import DirectoryBackend, MemoryBackend, PrefixStore

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from test_runner import COMMON, make_hf_model  # noqa: E402  (the runner tests' checkpoints)
from test_runner_store_whole import assert_bits  # noqa: E402  (torch-free: the shared check)

STEPS = 6
VOCAB = COMMON["vocab_size"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """case -> checkpoint folder (built once per module)."""
    paths = {}

    def get(case):
        if case not in paths:
            path = tmp_path_factory.mktemp(case)
            make_hf_model(case).save_pretrained(path)
            paths[case] = path
        return paths[case]
    return get


def ids_of(n, seed=3):
    return np.random.default_rng(seed).integers(0, VOCAB, n)


def trace(runner, ids, store=None, steps=STEPS):
    """Prompt logits and ``steps`` greedy decode steps' logits (fresh conversation)."""
    runner.reset()
    out = [runner.prefill(ids, store=store)]
    for _ in range(steps):
        out.append(runner.step(int(np.argmax(out[-1]))))
    return out


@pytest.mark.parametrize("kv", ["f32", "q8"])
@pytest.mark.parametrize("case", ["llama", "gemma2-window8", "qwen2"])
def test_directory_store_is_bit_identical(ckpt, tmp_path, case, kv):
    runner = kr.Runner.from_pretrained(ckpt(case), kv=kv, prefill_chunk=64)
    store = PrefixStore(DirectoryBackend(tmp_path / "store"), fingerprint=runner.fingerprint,
                        block=128)
    base = ids_of(420)
    # (prompt length, positions the store then supplies; chunks of 64): a miss that stores 3
    # blocks and the hidden rows at their ends, a hit of the same prompt, a longer prompt
    # sharing it, a prompt that is all stored blocks (loaded whole: its last hidden row is
    # stored), a shorter one inside a block
    for n, loaded in ((420, 0), (420, 384), (500, 384), (384, 384), (200, 128)):
        ids = base[:n] if n <= 420 else np.concatenate([base, ids_of(n - 420, seed=4)])
        cold = trace(kr.Runner.from_pretrained(ckpt(case), kv=kv, prefill_chunk=64), ids)
        warm = trace(runner, ids, store=store)
        assert runner.store_loaded == loaded, (n, runner.store_loaded)
        assert_bits(warm, cold)
    # generate gives the same tokens with and without it
    ids = base[:300]
    runner.reset()
    want = kr.Runner.from_pretrained(ckpt(case), kv=kv, prefill_chunk=64).generate(ids, 8)
    assert runner.generate(ids, 8, store=store) == want
    assert runner.store_loaded == 256


@pytest.mark.parametrize("kv", ["f32", "q8"])
def test_redis_store_is_bit_identical(ckpt, redis_server, kv):
    url = f"{redis_server}?namespace=runner-store-{uuid.uuid4().hex}"
    ids = ids_of(400)
    cold = trace(kr.Runner.from_pretrained(ckpt("llama"), kv=kv), ids)
    # two runners, as two processes or machines sharing the server would be
    first = kr.Runner.from_pretrained(ckpt("llama"), kv=kv)
    assert_bits(trace(first, ids, store=url), cold)
    assert first.store_loaded == 0
    second = kr.Runner.from_pretrained(ckpt("llama"), kv=kv)
    assert_bits(trace(second, ids, store=url), cold)
    assert second.store_loaded == 256                    # the default block: 256
    first.reset()
    want = first.generate(ids, 5)
    second.reset()
    assert second.generate(ids, 5, store=url) == want


def test_chunked_prefill_is_the_same_work_wherever_a_call_starts():
    runner = kr.Runner.random(prefill_chunk=96)
    ids = ids_of(300) % 512
    whole = runner.prefill(ids)
    runner.reset()
    runner.forward(ids[:192])
    assert np.array_equal(runner.forward(ids[192:]), whole)
    runner.reset()
    all_logits = runner.forward(ids, all_logits=True)
    assert all_logits.shape == (300, 512)
    # the last row's logits come from a product of 44 rows here, of one row above
    np.testing.assert_allclose(all_logits[-1], whole, rtol=0, atol=1e-5)


def test_all_logits_with_a_store_computes_every_position(tmp_path):
    runner = kr.Runner.random(prefill_chunk=64)
    store = PrefixStore(tmp_path, fingerprint=runner.fingerprint, block=128)
    ids = ids_of(300) % 512
    want = runner.prefill(ids, all_logits=True)
    runner.reset()
    runner.prefill(ids, store=store)
    runner.reset()
    got = runner.prefill(ids, all_logits=True, store=store)
    assert runner.store_loaded == 0 and np.array_equal(got, want)


def test_fingerprint_names_config_weights_mode_and_chunk():
    fp = kr.Runner.random().fingerprint
    assert isinstance(fp, str) and len(fp) == 64
    assert kr.Runner.random().fingerprint == fp
    assert kr.Runner.random(seed=1).fingerprint != fp
    assert kr.Runner.random(kv="q8").fingerprint != fp
    assert kr.Runner.random(prefill_chunk=128).fingerprint != fp
    runner = kr.Runner.random()
    assert runner.fingerprint == fp
    runner.layers[0].qkv[0, 0] += 1.0
    assert runner.fingerprint == fp                        # computed once, then kept
    changed = kr.Runner.random()
    changed.layers[0].qkv[0, 0] += 1.0
    assert changed.fingerprint != fp


def test_a_store_of_another_model_never_hits(tmp_path):
    ids = ids_of(300) % 512
    kr.Runner.random(seed=0).generate(ids, 1, store=str(tmp_path))
    other = kr.Runner.random(seed=1)
    other.generate(ids, 1, store=str(tmp_path))
    assert other.store_loaded == 0
    again = kr.Runner.random(seed=0)
    again.generate(ids, 1, store=str(tmp_path))
    assert again.store_loaded == 256


def test_o1_layers_refuse_a_store_up_front(tmp_path):
    runner = kr.Runner.random(o1_layers="all")
    ids = ids_of(300) % 512
    for call in (lambda: runner.generate(ids, 3, store=str(tmp_path)),
                 lambda: runner.prefill(ids, store=str(tmp_path))):
        with pytest.raises(ValueError, match="O\\(1\\) layers"):
            call()
        assert runner.position == 0 and runner.cache.seq_len == 0
    assert not any(tmp_path.iterdir())
    runner.generate(ids, 3)                                # still usable without one


def test_a_block_the_chunk_does_not_divide_is_refused():
    runner = kr.Runner.random(prefill_chunk=128)
    store = PrefixStore(MemoryBackend(), fingerprint=runner.fingerprint, block=320)
    with pytest.raises(ValueError, match="not a multiple of prefill_chunk=128"):
        runner.generate(ids_of(300) % 512, 2, store=store)
    assert runner.position == 0


def test_a_store_that_is_down_changes_nothing_but_time(redis_server_throwaway, caplog):
    ids = ids_of(300) % 512
    want = kr.Runner.random().generate(ids, 4)
    url = redis_server_throwaway.url
    store = PrefixStore(url, fingerprint=kr.Runner.random().fingerprint)
    redis_server_throwaway.stop()
    runner = kr.Runner.random()
    with caplog.at_level(logging.WARNING, logger="kvcache"):
        assert runner.generate(ids, 4, store=store) == want
    assert runner.store_loaded == 0
    assert any("unavailable" in r.getMessage() for r in caplog.records)


def test_generate_command_reports_the_hit(tmp_path, capsys):
    args = ["--no-progress", "--store", str(tmp_path / "s"), "--max-new-tokens", "3",
            "--ids", ",".join(str(int(t)) for t in ids_of(300) % 512)]
    assert cli.main(["generate", *args]) == 0
    first = capsys.readouterr()
    assert "store: loaded 0 of 300 prompt tokens" in first.err
    assert cli.main(["generate", *args]) == 0
    second = capsys.readouterr()
    assert "store: loaded 256 of 300 prompt tokens" in second.err
    out = [line for line in first.out.splitlines() if line.startswith("output")]
    assert out and out == [line for line in second.out.splitlines() if line.startswith("output")]
    assert cli.main(["generate", "--no-progress", "--o1", "all", *args]) == 1
    assert "O(1) layers" in capsys.readouterr().err


def test_a_store_object_with_another_fingerprint_is_refused(tmp_path):
    # a PrefixStore made with some other fingerprint could hold another model's rows
    ids = ids_of(300) % 512
    runner = kr.Runner.random(seed=1)
    store = PrefixStore(str(tmp_path), fingerprint="not-this-runner")
    with pytest.raises(ValueError, match="fingerprint"):
        runner.prefill(ids, store=store)
    assert runner.cache.seq_len == 0


def test_a_backend_object_stays_the_callers(tmp_path):
    # the runner closes only what it opened from a spec; a MemoryBackend keeps its entries
    ids = ids_of(300) % 512
    runner = kr.Runner.random(seed=0)
    backend = MemoryBackend()
    runner.prefill(ids, store=backend)
    assert len(backend) > 0
    runner.reset()
    runner.prefill(ids, store=backend)
    assert runner.store_loaded == 256


def test_a_4bit_key_hit_is_bit_identical_with_a_chunk_below_its_block_of_keys():
    # with prefill_chunk=16 a hit rolled the loaded blocks back mid-way through a block of 32
    # 4-bit keys, which was then quantised again from the loaded codes: other bits than cold
    runner = kr.Runner.random(kv="q4", prefill_chunk=16)
    store = PrefixStore(MemoryBackend(), fingerprint=runner.fingerprint, block=256)
    ids = ids_of(256) % 512
    cold = trace(runner, ids)
    trace(runner, ids, store=store)
    assert runner.store_loaded == 0
    assert_bits(trace(runner, ids, store=store), cold)
    assert runner.store_loaded == 224               # 240 is mid-block: down to 224


def test_a_block_the_mode_cannot_take_is_refused_before_anything_runs():
    # q8 "cmf" needs block > 64: refused up front, also for a prompt of one chunk (which was
    # computed before the put refused the cache)
    runner = kr.Runner.random(kv="q8:cmf", prefill_chunk=64)
    backend = MemoryBackend()
    store = PrefixStore(backend, fingerprint=runner.fingerprint, block=64)
    for n, all_logits in ((30, False), (300, False), (300, True)):
        with pytest.raises(ValueError, match="needs block > 64"):
            runner.prefill(ids_of(n) % 512, store=store, all_logits=all_logits)
        assert runner.position == 0 and runner.cache.seq_len == 0 and len(backend) == 0

