"""The benchmark's handling of bandwidth readings above 100% (pure functions, no timing)."""

from __future__ import annotations

import math

from kvcache.bench import tables, timing


def test_readings_up_to_100_percent_print_as_figures():
    assert tables.pct_bandwidth_cell(73.4) == "73%"
    assert tables.pct_bandwidth_cell(100.0) == "100%"
    assert tables.pct_bandwidth_cell(61.25, 1) == "61.2%"
    assert not tables.above_bandwidth(100.0)
    assert tables.bandwidth_footnotes([12.0, 99.9, 100.0]) == []


def test_readings_above_100_percent_are_flagged_not_printed():
    for pct in (100.01, 136.0, math.inf, math.nan):
        assert tables.above_bandwidth(pct)
        assert tables.pct_bandwidth_cell(pct) == tables.BANDWIDTH_FLAG
        assert tables.pct_bandwidth_cell(pct, 1) == tables.BANDWIDTH_FLAG
    assert tables.BANDWIDTH_FLAG.startswith(">100%")
    notes = tables.bandwidth_footnotes([50.0, 136.0])
    assert notes == [tables.BANDWIDTH_FOOTNOTE]
    assert "cache-resident or noisy" in notes[0]


def test_a_reading_above_the_bandwidth_is_measured_once_more():
    calls = []

    def measure():
        calls.append(1)
        return [2.0]

    def pct(samples):
        return 100.0 / samples[0] * 1.5             # 1 s -> 150%, 2 s -> 75%

    assert timing.remeasure_above_bandwidth([2.0], measure, pct) == ([2.0], False)
    assert calls == []
    assert timing.remeasure_above_bandwidth([1.0], measure, pct) == ([2.0], True)
    assert calls == [1]
    # a second reading still above 100% is kept (and flagged by the tables)
    assert timing.remeasure_above_bandwidth([1.0], lambda: [1.0], pct) == ([1.0], True)


def test_pct_of_bandwidth():
    assert timing.pct_of_bandwidth(2e9, 1.0, 4.0) == 50.0
    assert timing.pct_of_bandwidth(5e8, 0.1, 4.0) == 125.0


def test_wide_tables_print_in_parts_that_repeat_the_key_columns():
    from kvcache.bench.tables import MAX_WIDTH, render_table
    headers = ["geometry", "prompt"] + [f"a fairly long column name {i}" for i in range(9)]
    rows = [["llama3-8b", "4k"] + [f"{i}.5" for i in range(9)],
            ["qwen2.5-0.5b", "16k"] + ["7"] * 9]
    text = render_table(headers, rows)
    lines = text.splitlines()
    assert max(map(len, lines)) <= MAX_WIDTH
    parts = text.split("\n\n")
    assert len(parts) >= 3
    for part in parts:                    # every part names its rows
        head = part.splitlines()[0]
        assert "geometry" in head and "prompt" in head
        assert "llama3-8b" in part and "16k" in part
    for i in range(9):                    # every column printed once
        assert text.count(f"a fairly long column name {i}") == 1
    narrow = render_table(["ctx", "ms"], [["1k", "1.5"]])
    assert "\n\n" not in narrow


def test_readings_above_the_measured_peak_are_flagged():
    from kvcache.bench.tables import PEAK_MARK, render_table
    text = render_table(["prompt", "f32 %peak", "GFLOP/s"], [["4k", "113%", "120"],
                                                             ["16k", "87%", "90"]])
    assert f"113%{PEAK_MARK}" in text and f"87%{PEAK_MARK}" not in text
    assert "above 100% of the measured peak" in text
    assert "peak" not in render_table(["prompt", "%BW"], [["4k", "130"]]).split("\n")[-1]


def test_prose_wraps_at_the_table_width_and_leaves_tables_alone():
    from kvcache.bench.tables import MAX_WIDTH, prose
    line = "  note: " + " ".join(f"word{i}" for i in range(60))
    wrapped = prose(line).splitlines()
    assert len(wrapped) > 1 and max(map(len, wrapped)) <= MAX_WIDTH
    assert wrapped[0].startswith("  note:") and all(w.startswith("    ") for w in wrapped[1:])
    assert " ".join(w.strip() for w in wrapped) == line.strip()
    table = "|   a |   b |" + " x" * 80
    assert prose(table) == table and prose("short") == "short"
