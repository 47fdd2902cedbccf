"""``python -m kvcache``: the dispatcher's own options (the commands have their own tests)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import kvcache
from kvcache.__main__ import main


def run_module(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvcache", *args], capture_output=True,
                          text=True, timeout=120)


def test_version_prints_name_and_version_and_exits_0() -> None:
    done = run_module("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"kvcache {kvcache.__version__}\n"


def test_help_lists_every_command_and_version(capsys) -> None:
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    for word in ("bench", "generate", "eval", "config", "--version"):
        assert word in text


def test_unknown_command_exits_2(capsys) -> None:
    assert main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err


def test_eval_help_names_its_options(capsys) -> None:
    import pytest
    with pytest.raises(SystemExit) as info:
        main(["eval", "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for word in ("--model", "--text", "--tokens", "--prompt-tokens", "--configs", "--json",
                 "--no-progress", "o1:"):
        assert word in text


def bench_plan(*argv: str) -> dict[str, object]:
    """The sections ``python -m kvcache bench ARGV`` would run, with their option values."""
    from kvcache.bench.cli import build_parser, resolve
    plan = resolve(build_parser().parse_args(list(argv)))
    return {section.name: values for section, values in plan.chosen}


def test_bench_realmodel_section_is_opt_in() -> None:
    assert "realmodel" not in bench_plan() and "runner" in bench_plan()
    chosen = bench_plan("--sections", "realmodel", "--quick")
    assert list(chosen) == ["realmodel"]
    assert list(chosen["realmodel"].contexts) == [512]
    chosen = bench_plan("--sections", "realmodel", "--realmodel-contexts", "1k", "4k")
    assert list(chosen["realmodel"].contexts) == [1024, 4096]


def test_bench_realmodel_takes_the_4bit_modes() -> None:
    """``--realmodel-modes`` adds modes after f32 and q8 (which always run), and the table
    gains their columns; a mode name it does not know is refused."""
    from kvcache.bench.realmodel import _modes, realmodel_table
    assert list(bench_plan("--sections", "realmodel")["realmodel"].modes) == ["f32", "q8"]
    chosen = bench_plan("--sections", "realmodel", "--realmodel-modes", "q4", "q8", "k8v4")
    assert _modes(chosen["realmodel"].modes) == ("f32", "q8", "q4", "k8v4")
    for bad in ("q3", "q8:cmf"):          # q8:cmf would have been measured as q8
        with pytest.raises(SystemExit):
            bench_plan("--sections", "realmodel", "--realmodel-modes", bad)
    with pytest.raises(SystemExit):
        bench_plan("--sections", "decode", "--decode-modes", "k8v4:cmf")
    assert list(bench_plan("--sections", "decode", "--decode-modes", "Q8:rows", "k8v8")
                ["decode"].modes) == ["q8"]
    side = {"tokens_per_s": 10.0, "ttft_s": 0.5, "cache_bytes": 2 ** 20,
            "decode_vs_transformers": 2.0, "ttft_vs_transformers": 0.9}
    row = {"context": 512, "steps": 2, "f32": side, "q8": side, "q4": side,
           "transformers": {"tokens_per_s": 5.0, "ttft_s": 0.55}, "max_abs_logit_diff": 1e-5}
    text = realmodel_table([row])
    for head in ("decode q4 tok/s", "TTFT q4 ms", "cache q4 MiB", "decode q8 tok/s"):
        assert head in text
    assert "k8v4" not in text


def test_bench_bodies_option_sets_bodies_all_or_nothing(capsys) -> None:
    from kvcache import _core
    from kvcache.bench.cli import apply_bodies
    before = _core.bodies()
    try:
        for bad in (["f32"], ["=avx2"], ["f32="], ["nope=avx2"], ["f32=sse9"],
                    ["f32=portable", "q8=nope"], ["f32=" + "x" * 1000]):
            err = apply_bodies(bad)
            assert err is not None and err.startswith("--bodies: ") and len(err) < 300, bad
            assert _core.bodies() == before, bad
        assert apply_bodies(["f32=portable", "MLA=portable"]) is not None   # family names are exact
        assert apply_bodies(["f32=Portable", "mla=portable"]) is None
        assert _core.bodies()["f32"] == "portable" and _core.bodies()["mla"] == "portable"
        assert main(["bench", "--bodies", "q8=sse9", "--sections", "decode", "--quick"]) == 2
        assert "--bodies:" in capsys.readouterr().err
    finally:
        _core.set_bodies(before)


def test_quick_runs_the_contention_section_quiet_and_beside_a_spinner():
    quick = bench_plan("--quick")
    assert list(quick["contention"].conditions) == ["quiet", "spin"]
    assert quick["contention"].calls == 10 and list(quick["store"].contexts) == [256]
    full = bench_plan()
    assert list(full["contention"].conditions) == ["quiet", "spin", "numpy", "pythread",
                                                   "twoproc"]
