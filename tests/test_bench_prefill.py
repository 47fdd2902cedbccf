"""The prefill section of ``python -m kvcache bench``: its tables and notes on made-up rows (no
timing), the skip rule for cells estimated too slow, and a tiny ``--quick`` run end to end
(small lengths and a small model swapped in; the run's own checks -- kvcache's prompt attention
matches SDPA's, the runner's logits match transformers' -- are asserted)."""

from __future__ import annotations

import json

import pytest

from kvcache import bench
from kvcache.bench import tables, timing
from kvcache.bench import prefill as bp
from kvcache.bench.geometry import GEOMETRIES
from kvcache.bench.registry import sections

TINY_MODEL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
QWEN = GEOMETRIES["qwen2.5-0.5b"]


class Bar:
    def update(self, n=1):
        pass

    def set_postfix_str(self, s="", refresh=True):
        pass

    def close(self):
        pass


def cell(s, gflops, pct, diff=None, ok=None):
    c = {"skipped": False, "s": s, "gflops": gflops, "pct_peak": pct, "samples_s": [s]}
    if diff is not None:
        c.update(max_abs_diff=diff, matches=ok)
    return c


def result(sdpa=True, ttft=True, bad=False):
    row = {"geometry": "llama3-8b", "context": 4096, "flops": 1.4e11, "threads": 2,
           "f32": cell(2.0, 70.0, 50.0, 1e-6 if sdpa else None, True if sdpa else None),
           "q8": cell(1.6, 87.5, 62.0, 0.3 if bad else 0.02 if sdpa else None,
                      (not bad) if sdpa else None)}
    if sdpa:
        row["sdpa"] = cell(1.0, 140.0, 100.0)
    row["vs_sdpa"] = {"f32": 0.5 if sdpa else None, "q8": 0.625 if sdpa else None}
    row["q8_vs_f32"] = 1.25
    big = {"geometry": "llama3-8b", "context": 16384, "flops": 2.2e12, "threads": 2,
           "f32": {"skipped": True, "estimated_s": 300.0},
           "q8": {"skipped": True, "estimated_s": 250.0},
           "vs_sdpa": {"f32": None, "q8": None}, "q8_vs_f32": None}
    rows = []
    if ttft:
        rows = [{"context": c, "repeats": 3, "max_abs_logit_diff": 2e-5,
                 "transformers": {"s": t, "samples_s": [t]},
                 "f32": {"s": f, "vs_transformers": f / t,
                         "target_met": None if c < 2048 else f / t <= 0.8, "samples_s": [f]},
                 "q8": {"s": q, "vs_transformers": q / t,
                        "target_met": None if c < 2048 else q / t <= 0.8, "samples_s": [q]}}
                for c, f, q, t in ((512, 1.0, 1.1, 0.9), (2048, 3.0, 3.5, 4.0))]
    settings = {**bp.PrefillSettings(list(GEOMETRIES.values())).__dict__,
                "geometries": ["llama3-8b"]}
    return {"attention": [row, big], "ttft": rows, "peak_gflops": 140.0, "threads": 2,
            "ttft_skipped": "" if ttft else "it needs torch and transformers (no torch)",
            "torch": "2.13", "transformers": "5.24", "settings": settings}


def test_prefill_is_a_section():
    assert "prefill" in [s.name for s in sections()]


@pytest.mark.parametrize("quick", [False, True])
def test_prefill_contexts_choose_the_prompt_lengths(quick):
    """--prefill-contexts sets the attention cells' lengths; without it, the full or quick
    defaults."""
    sec = next(s for s in sections() if s.name == "prefill")
    auto = bp.settings_of(sec.values(quick, {}), quick).contexts
    assert tuple(auto) == (bp.QUICK_PREFILL_CONTEXTS if quick else bp.PREFILL_CONTEXTS)
    given = bp.settings_of(sec.values(quick, {"contexts": [32768, 300]}), quick)
    assert tuple(given.contexts) == (32768, 300)
    assert tuple(given.ttft_contexts) == (bp.QUICK_TTFT_CONTEXTS if quick else bp.TTFT_CONTEXTS)


class Clock:
    """A clock that advances only when a fake call spends time."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.mark.parametrize("quick", [False, True])
def test_repeats_asked_for_are_run_whatever_they_take(quick):
    """Without --prefill-repeats / --prefill-ttft-repeats the rounds stop once a cell took its
    time; given, exactly that many run (and the notes say so)."""
    sec = next(s for s in sections() if s.name == "prefill")
    auto = bp.settings_of(sec.values(quick, {}), quick)
    assert auto.cell_s == bp.PREFILL_CELL_S and auto.ttft_cell_s == bp.TTFT_CELL_S
    cfg = bp.settings_of(sec.values(quick, {"repeats": 7, "ttft_repeats": 2}), quick)
    assert (cfg.repeats, cfg.cell_s, cfg.ttft_repeats, cfg.ttft_cell_s) == (7, None, 2, None)
    res = result()
    res["settings"] = {**cfg.__dict__, "geometries": ["llama3-8b"]}
    notes = " ".join(" ".join(bp.prefill_notes(res)).split())
    assert "median of 7 calls;" in notes and "median of 2 prompt(s);" in notes
    assert "median of up to 3 calls (fewer once a cell took 20 s)" in " ".join(
        " ".join(bp.prefill_notes(result())).split())            # an older file's rows
    paired = result()
    paired["attention"][0]["paired"] = True
    assert "median of up to 3 calls (fewer once the row's cells took 20 s each on average)" \
        in " ".join(" ".join(bp.prefill_notes(paired)).split())
    calls = []
    samples, last = bp._cells({"a": lambda: calls.append("a") or 1.0,
                               "b": lambda: calls.append("b") or 2.0}, 4, None)
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a"] and last == {"a": 1.0, "b": 2.0}
    assert [len(v) for v in samples.values()] == [4, 4]
    calls.clear()
    bp._cells({"a": lambda: calls.append("a")}, 4, 0.0)         # spent: one round only
    assert calls == ["a"]
    # the budget is per cell on average: a (10 s) and b (1 s) with 6 s each go on after the
    # first round (11 < 12) and stop after the second (22)
    clock = Clock()
    cost = {"a": 10.0, "b": 1.0}

    def spend(name):
        def call():
            clock.now += cost[name]
        return call

    samples, _ = bp._cells({n: spend(n) for n in cost}, 5, 6.0, clock=clock)
    assert samples == {"a": [10.0, 10.0], "b": [1.0, 1.0]}


def test_tables_show_every_cell(monkeypatch):
    monkeypatch.setattr(tables, "MAX_WIDTH", 10_000)     # one part: rows on one line each
    text = bp.attention_table(result()["attention"])
    lines = text.splitlines()
    assert len(lines) == 2 + 2 and "f32/SDPA" in lines[0] and "%peak" in lines[0]
    assert "0.50x" in lines[2] and "0.62x" in lines[2] and "1.25x" in lines[2]
    assert lines[2].rstrip(" |").endswith("yes")   # plain text or tabulate's github table
    assert "skipped (~300 s)" in lines[3] and "skipped (~250 s)" in lines[3]
    no_torch = bp.attention_table(result(sdpa=False)["attention"])
    assert "not installed" in no_torch
    assert bp.attention_table(result(bad=True)["attention"]).splitlines()[2].rstrip(" |").endswith("NO")
    ttft = bp.ttft_table(result()["ttft"]).splitlines()
    assert len(ttft) == 2 + 2
    assert "met" not in ttft[2]                        # 512: no target there
    assert "0.75x" in ttft[3] and " met" in ttft[3] and "NOT met" in ttft[3]   # f32 / q8


def test_q8_without_importance_gets_its_own_table_and_warning():
    res = result()
    assert bp.q8_noimp_table(res["attention"]) == ""          # results without the cell
    row = res["attention"][0]
    row["q8_noimp"] = {**cell(1.2, 116.0, 83.0), "same_as_q8": False}
    row["vs_sdpa"]["q8_noimp"], row["q8_noimp_vs_f32_noimp"] = 0.83, 1.4
    text = bp.q8_noimp_table(res["attention"])
    assert "0.83x" in text and "1.40x" in text and len(text.splitlines()) == 3
    assert any(n.startswith("WARNING: llama3-8b 4k q8: the kernel without importance")
               for n in bp.prefill_notes(res))


def test_notes_say_what_was_not_measured_and_warn():
    notes = bp.prefill_notes(result())
    assert any("140.0 GFLOP/s" in n and "fma_probe" in n for n in notes)
    assert not any("WARNING" in n for n in notes)
    notes = bp.prefill_notes(result(ttft=False, bad=True))
    assert "time to first token not measured: it needs torch and transformers (no torch)" in notes
    assert any(n.startswith("WARNING: llama3-8b 4k q8: output differs from SDPA") for n in notes)


def test_int8_keys_above_the_float_peak_are_explained_not_flagged(monkeypatch):
    """q8 scores with integer dot products: its share of the float FMA peak may pass 100%, which
    gets its own mark and note, not the busy-probe flag an f32 cell above 100% gets."""
    monkeypatch.setattr(tables, "MAX_WIDTH", 10_000)
    res = result()
    assert bp.INT8_NOTE not in bp.prefill_notes(res)
    res["attention"][0]["q8"]["pct_peak"] = 107.0
    text = bp.attention_table(res["attention"])
    assert "107%" + bp.INT8_MARK in text and tables.PEAK_FOOTNOTE[:20] not in text
    assert bp.INT8_NOTE in bp.prefill_notes(res)
    res["attention"][0]["f32"]["pct_peak"] = 104.0
    text = bp.attention_table(res["attention"])
    assert "104%" + tables.PEAK_MARK in text and tables.PEAK_FOOTNOTE[:20] in text


def test_a_cell_estimated_too_slow_is_skipped():
    cfg = bp.PrefillSettings([QWEN], contexts=(128, 256), repeats=1, max_call_s=1e-9)
    rows = bp.attention_rows(cfg, 0, Bar(), peak_gflops=100.0)
    first, second = rows
    for name in ("f32", "q8"):
        assert not first[name]["skipped"] and first[name]["s"] > 0
        assert second[name]["skipped"] and second[name]["estimated_s"] > 0
    assert first["f32"]["matches"] and first["q8"]["matches"]
    assert first["vs_sdpa"]["f32"] > 0 and second["vs_sdpa"]["f32"] is None


def test_only_cells_estimated_short_are_warmed_up():
    """A cell is called once untimed when its call is estimated under PREFILL_WARMUP_S: at the
    first length from the FMA peak (here absurdly low, so nothing is), then from the rate the
    cell itself reached at the previous length."""
    cfg = bp.PrefillSettings([QWEN], contexts=(128, 256), repeats=1)
    first, second = bp.attention_rows(cfg, 0, Bar(), peak_gflops=1e-9)
    assert first["warmed_up"] == []
    timed = [n for n in ("f32", "q8", "f32_noimp", "q8_noimp", "sdpa") if n in second]
    assert {"f32", "q8", "f32_noimp", "q8_noimp"} <= set(timed)
    assert sorted(second["warmed_up"]) == sorted(timed)


def test_quick_run_end_to_end(tmp_path, capsys, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setattr(bp, "PREFILL_MODEL", TINY_MODEL)
    monkeypatch.setattr(bp, "QUICK_PREFILL_CONTEXTS", (256, 384))
    monkeypatch.setattr(bp, "QUICK_TTFT_CONTEXTS", (256,))
    path = tmp_path / "prefill.json"
    argv = ["--sections", "prefill", "--quick", "--prefill-geometries", "qwen", "--no-progress",
            "--json", str(path), "--prefill-modes", "f32", "q8", "q4", "k8v4",
            "--prefill-repeats", "2", "--prefill-ttft-repeats", "2"]
    assert bench.main(argv) == 0
    text = capsys.readouterr().out
    assert "prefill: prompt attention" in text and "WARNING" not in text
    assert "4-bit KV" in text and " q4 " in text and " k8v4 " in text
    assert "q8 without importance" in text
    assert bp.PAIRED_NOTE.strip("; ") in " ".join(text.split())
    data = json.loads(path.read_text())["sections"]["prefill"]
    assert data["settings"]["contexts"] == [256, 384] and data["settings"]["repeats"] == 2
    assert data["settings"]["geometries"] == ["qwen2.5-0.5b"] and data["peak_gflops"] > 0
    att = data["attention"]
    assert [r["context"] for r in att] == [256, 384]
    for r in att:
        for name in ("f32", "q8", "sdpa"):
            assert not r[name]["skipped"] and r[name]["gflops"] > 0
        assert r["f32"]["matches"] and r["q8"]["matches"]
        assert r["f32"]["max_abs_diff"] < r["q8"]["max_abs_diff"]
        assert r["q8_vs_f32"] > 0
        # the cells ran side by side, a sample each per round, and ratios pair the rounds
        timed = ("f32", "q8", "q4", "k8v4", "f32_noimp", "q8_noimp", "sdpa")
        assert {len(r[n]["samples_s"]) for n in timed} == {2}
        assert sorted(r["warmed_up"]) == sorted(timed)      # short cells: one untimed call
        assert r["q8_vs_f32"] == timing.paired_ratio(r["f32"]["samples_s"], r["q8"]["samples_s"])
        assert r["vs_sdpa"]["f32"] == timing.paired_ratio(r["sdpa"]["samples_s"],
                                                          r["f32"]["samples_s"])
        for m in ("f32", "q8"):             # without importance: the same outputs
            assert not r[f"{m}_noimp"]["skipped"] and r[f"{m}_noimp"][f"same_as_{m}"] is True
        assert r["vs_sdpa"]["q8_noimp"] > 0 and r["q8_noimp_vs_f32_noimp"] > 0
        for name in ("q4", "k8v4"):          # the 4-bit modes asked for with --modes
            assert not r[name]["skipped"] and r[name]["matches"] and r[f"{name}_vs_f32"] > 0
            assert r[name]["max_abs_diff"] > r["f32"]["max_abs_diff"]
    (row,) = data["ttft"]
    assert row["context"] == 256 and row["max_abs_logit_diff"] < 1e-3
    for name in ("f32", "q8"):
        assert row[name]["s"] > 0 and row[name]["target_met"] is None
        assert row[name]["vs_transformers"] == timing.paired_ratio(
            row[name]["samples_s"], row["transformers"]["samples_s"])
        assert len(row[name]["samples_s"]) == 2
    assert row["paired"] and len(row["transformers"]["samples_s"]) == 2
    assert row["transformers"]["s"] > 0


def test_ttft_stops_taking_prompts_once_a_length_took_its_time(monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setattr(bp, "PREFILL_MODEL", TINY_MODEL)
    cfg = bp.PrefillSettings([QWEN], ttft_contexts=(64, 128), ttft_repeats=3, ttft_cell_s=0.0)
    rows, why = bp.ttft_rows(cfg, 0, Bar())
    assert why == "" and [r["context"] for r in rows] == [64, 128]
    for r in rows:
        assert r["repeats"] == 1 and len(r["f32"]["samples_s"]) == 1
    cfg.ttft_cell_s = 1e9
    (row,) = bp.ttft_rows(bp.PrefillSettings([QWEN], ttft_contexts=(64,), ttft_repeats=2),
                          0, Bar())[0]
    assert row["repeats"] == 2 and len(row["transformers"]["samples_s"]) == 2
