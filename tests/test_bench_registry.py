"""The benchmark's sections register themselves: a section registered here (a small section
of its own, no timing) appears in the command line, the task count, the report and the JSON;
bad option values and unknown section names are one-line errors."""

from __future__ import annotations

import io
import json
import pathlib

import pytest

from kvcache.bench import cli, registry, report
from kvcache.bench.registry import Option, Section, at_least, one_of
from kvcache.bench.tables import render_table, section_text

# what the package registers, read from it (a new section module needs no edit here)
SECTION_NAMES = [s.name for s in registry.sections()]
BENCH = pathlib.Path(registry.__file__).parent


# ------------------------------------------------------------------ a section of the test's own
def count_run(ctx, values, bar):
    rows = []
    for i in range(values.size):
        rows.append({"i": i, "word": values.word, "seed": ctx.seed})
        bar.update()
    return {"rows": rows}


def count_report(ctx, values, result):
    table = render_table(["i", "word"], [[r["i"], r["word"]] for r in result["rows"]])
    return section_text("counting section:", [table], [f"{values.size} rows"])


COUNT = Section(
    name="count", order=5, help="counts to --count-size",
    options=(Option("size", "rows to count", 3, at_least(1), 2, metavar="N"),
             Option("word", "the word of every row", "one", one_of("one", "two"))),
    tasks=lambda ctx, values: values.size, run=count_run, report=count_report,
    to_json=lambda result: {**result, "total": len(result["rows"])})


@pytest.fixture
def with_count(monkeypatch):
    monkeypatch.setattr(registry, "REGISTRY", dict(registry.REGISTRY))
    registry.sections()                     # the package's own sections first
    registry.register(COUNT)
    return COUNT


def test_every_section_module_registers_its_section():
    # every module that declares a section registers exactly one, under a name of its own
    declaring = sorted(f"kvcache.bench.{p.stem}" for p in BENCH.glob("*.py")
                       if "register(Section(" in p.read_text(encoding="utf-8"))
    assert sorted(s.run.__module__ for s in registry.sections()) == declaring
    assert len(set(SECTION_NAMES)) == len(SECTION_NAMES) >= 10
    assert len({s.order for s in registry.sections()}) == len(SECTION_NAMES)
    assert [s.name for s in registry.sections() if not s.default] == ["realmodel"]
    for section in registry.sections():
        module = section.run.__module__
        assert module.startswith("kvcache.bench."), section.name
        assert all(o.help for o in section.options)


def test_a_registered_section_is_in_the_cli_the_task_count_the_report_and_the_json(
        with_count, tmp_path, capsys):
    help_text = cli.build_parser().format_help()
    assert "--count-size" in help_text and "counts to --count-size" in help_text
    assert "rows to count (default 3, quick 2)" in help_text

    plan = cli.resolve(cli.build_parser().parse_args(["--sections", "count", "--quick"]))
    assert [s.name for s, _ in plan.chosen] == ["count"] and plan.tasks() == 2
    plan = cli.resolve(cli.build_parser().parse_args(["--sections", "count", "append",
                                                      "--count-size", "7"]))
    assert [s.name for s, _ in plan.chosen] == ["count", "append"]        # registry order
    assert plan.tasks() == 7 + 2
    assert "count" in [s.name for s, _ in cli.resolve(cli.build_parser().parse_args([])).chosen]

    path = tmp_path / "count.json"
    argv = ["--sections", "count", "--count-size", "4", "--count-word", "TWO", "--seed", "9",
            "--no-progress", "--json", str(path)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "counting section:" in out and "  4 rows" in out
    data = json.loads(path.read_text())
    assert data["options"]["sections"] == ["count"] and data["options"]["seed"] == 9
    assert data["bandwidth"] == {}                   # no section of this run reads it
    assert list(data["sections"]) == ["count"]
    count = data["sections"]["count"]
    assert count["options"] == {"size": 4, "word": "two"}
    assert count["total"] == 4 and count["rows"][3] == {"i": 3, "word": "two", "seed": 9}

    # read back, the file prints the same report again (what tools/figures.py relies on)
    info, ctx, ran = report.read_json(data)
    assert [(s.name, v.record()) for s, v, _ in ran] == [("count", {"size": 4, "word": "two"})]
    again = io.StringIO()
    report.print_report(info, ctx, ran, file=again)
    assert out == again.getvalue() + f"raw results written to {path}\n"
    with pytest.raises(ValueError, match="section 'nope', which this kvcache does not register"):
        report.read_json({**data, "sections": {"nope": {"options": {}}}})


def test_a_section_is_registered_once(with_count):
    with pytest.raises(ValueError, match="section 'count' is registered twice"):
        registry.register(COUNT)


@pytest.mark.parametrize("argv, says", [
    (["--o1-repeats", "0"], "argument --o1-repeats: expected an integer >= 1, got '0'"),
    (["--runner-steps", "1"], "argument --runner-steps: expected an integer >= 2, got '1'"),
    (["--wire-context", "big"], "argument --wire-context: expected an integer or Nk"),
    (["--decode-contexts", "1k,-4"],
     "argument --decode-contexts: expected a context >= 1, got '-4'"),
    (["--decode-geometries", "gpt"], "unknown geometry 'gpt'; choose from llama3-8b"),
    (["--sync-backend", "cupy"], "argument --sync-backend: expected one of torch, numpy"),
    (["--threads", "0"], "argument --threads: expected an integer >= 1, got '0'"),
    (["--sections", "o1,nope"], "argument --sections: unknown section 'nope'; choose from "
                                + ", ".join(SECTION_NAMES)),
])
def test_bad_values_are_one_line_errors(argv, says, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert says in err
    assert err.count("\n") == 1 and err.startswith("python -m kvcache bench: error: ")


def test_the_section_flags_of_the_last_release_are_gone(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--no-o1"])
    assert "unrecognized arguments: --no-o1" in capsys.readouterr().err


def test_old_spellings_of_decode_options_warn_and_still_work(caplog):
    argv = ["--contexts", "1k", "--no-torch", "--repeats=4", "--modes", "f32,q4",
            "--o1-repeats", "2", "--prefill-geometries", "qwen", "--geometries", "llama"]
    plan = cli.resolve(cli.build_parser().parse_args(argv))
    values = dict((s.name, v) for s, v in plan.chosen)
    decode, prefill = values["decode"], values["prefill"]
    assert decode.contexts == [1024] and decode.torch is False and decode.repeats == 4
    assert decode.modes == prefill.modes == ["f32", "q4"]       # both sections read --modes
    assert decode.geometries == ["llama3-8b"] and prefill.geometries == ["qwen2.5-0.5b"]
    assert values["o1"].repeats == 2
    assert "--contexts is deprecated" in caplog.text and "use --decode-contexts" in caplog.text
    assert "--no-torch is deprecated" in caplog.text and "use --no-decode-torch" in caplog.text
    assert "--old" not in cli.build_parser().format_help() and "--no-torch" not in (
        cli.build_parser().format_help())
