"""The figures of README.md and docs/ are what their data says (tools/figures.py).

Every measured figure sits in a ``<!-- figure: RENDERER FILE -->`` region that
tools/figures.py writes from a JSON file under docs/data/; these tests fail when a region's text
differs from its rendering, when a data file is unused or undocumented, and when a measured
figure appears outside a region.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re
import shutil
import sys
from types import ModuleType

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kvcache_docs_figures", ROOT / "tools" / "figures.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


figures = _load_tool()

# What a measured figure looks like in prose: a number in scientific notation (4.94e-4), a
# percentage or a ratio (98.8%, 1.32x), a time or a rate.
MEASURED = re.compile(r"\b\d(?:\.\d+)?e[-+]?\d+\b|\b\d+(?:\.\d+)?%|\b\d+(?:\.\d+)?x\b"
                      r"|\b\d[\d,]*(?:\.\d+)?\s?(?:ms|us|µs|s|GB/s|MB/s|GFLOP/s|GFMA/s|tok/s)\b")

# A bound, a threshold or a target is not a measurement ("at least 1.3x", "<= 0.8x", "within
# 0.2%", "above 100%", "a warning above 1e-3"), nor is a setting given with its constant's name
# ("`HOLD` (20 ms)").  Inline code (parameters, formulas) and code blocks are not prose.
BOUND = re.compile(r"(?:(?:at\s+least|at\s+most|<=|>=|within|target|above|below|under|over"
                   r"|up\s+to|floored\s+at|more\s+than|less\s+than|checked\s+against)"
                   r"\W*(?:\w+\W+){0,2}"
                   r"|`[A-Z_]+` \()$")


def prose(text: str) -> str:
    """``text`` without figure regions, code blocks and inline code (line numbers kept)."""
    text = figures.REGION.sub(lambda m: "\n" * m.group().count("\n"), text)
    text = re.sub(r"```.*?```", lambda m: "\n" * m.group().count("\n"), text, flags=re.S)
    return re.sub(r"`[^`\n]*`", lambda m: "`" + "_" * (len(m.group()) - 2) + "`"
                  if re.fullmatch(r"`[A-Z_]+`", m.group()) else " " * len(m.group()), text)


def test_every_region_is_what_its_data_renders() -> None:
    assert figures.stale() == []


def test_every_data_file_is_used_and_documented() -> None:
    specs = [m["spec"] for page in figures.pages()
             for m in figures.regions(page.read_text(encoding="utf-8"))]
    used = {spec.split()[1] for spec in specs}
    files = {p.name for p in figures.DATA.glob("*.json")}
    assert files == used
    listing = (figures.DATA / "README.md").read_text(encoding="utf-8")
    for name in files:
        assert f"`{name}`" in listing, f"docs/data/README.md does not say how {name} was made"


def test_no_measured_figure_outside_a_region() -> None:
    found = []
    for page in figures.pages():
        text = prose(page.read_text(encoding="utf-8"))
        for m in MEASURED.finditer(text):
            if BOUND.search(text[max(0, m.start() - 40):m.start()]):
                continue
            line = text.count("\n", 0, m.start()) + 1
            found.append(f"{page.relative_to(ROOT)}:{line}: {m.group()}")
    assert found == []


def test_a_region_follows_its_data(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shutil.copy(figures.DATA / "eval-gpl3-prompt.json", tmp_path / "e.json")
    monkeypatch.setattr(figures, "DATA", tmp_path)
    page = "<!-- figure: eval-lines e.json q8 -->\nold text\n<!-- /figure -->\n"
    first = figures.rewrite(page)
    assert "old text" not in first and "`q8`: mean KL" in first
    assert figures.rewrite(first) == first
    doc = json.loads((tmp_path / "e.json").read_text())
    for r in doc["results"]:
        if r["name"] == "q8":
            r["top1"] = 0.5
    (tmp_path / "e.json").write_text(json.dumps(doc))
    second = figures.rewrite(first)
    assert second != first and "top-1 50.0%" in second


@pytest.mark.parametrize("spec,message", [
    ("no-such-renderer eval-gpl3-prompt.json", "unknown renderer"),
    ("eval-table missing.json", "no such file"),
    ("eval-table", "expected RENDERER FILE"),
    ("eval-table eval-gpl3-prompt.json q99", "no rows"),
])
def test_a_bad_region_is_a_clear_error(spec: str, message: str) -> None:
    with pytest.raises(figures.FigureError, match=message):
        figures.render(spec)


def test_an_ab_region_shows_each_tree_s_runs_and_the_ratio_of_medians() -> None:
    run = {"other_processes_cores": 0.01}
    doc = {"command": "python -m kvcache bench --sections decode",
           "trees": {"before": "aaaa", "after": "bbbb"},
           "machine": {"cpu_model": "CPU", "cpu_count": 2},
           "runs": [dict(run, tree=tree, date=f"d{i}", rows=[
               {"geometry": "G", "context": 16384, "mode": "q4", "threads": 2, "ms": ms}])
               for i, (tree, ms) in enumerate([("before", 2.0), ("after", 1.0), ("before", 4.0),
                                               ("after", 1.5), ("before", 3.0), ("after", 9.0)])]}
    text = figures.RENDERERS["bench-ab"](doc, [])
    assert "| G | 16k q4 | 2.000, 4.000, 3.000 | 1.000, 1.500, 9.000 | 0.50x |" in text
    assert "aaaa (before) and bbbb (after)" in text and "d0 to d5" in text


def test_a_tiles_region_names_the_tiles_per_shape_and_thread_count() -> None:
    doc = {"blas": [["openblas", "0.3", "Haswell"]], "date": "d",
           "tiles": [{"threads": 1, "shape": [8, 4], "aligned": [24, 48], "shifted": []},
                     {"threads": 2, "shape": [8, 4], "aligned": [], "shifted": []},
                     {"threads": 1, "shape": [2, 2], "aligned": [16], "shifted": [16]},
                     {"threads": 2, "shape": [2, 2], "aligned": [16], "shifted": []}]}
    text = figures.RENDERERS["blas-tiles"](doc, [])
    assert "| (8, 4) | 24, 48 | none |" in text
    assert "| (2, 2) | 16; shifted: 16 | 16 |" in text and "(8, 16, 24, 32, 48, 64)" in text
    with pytest.raises(figures.FigureError, match="no tile results"):
        figures.RENDERERS["blas-tiles"]({"blas": [], "date": "d"}, [])
