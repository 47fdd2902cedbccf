"""``python -m kvcache``: the dispatcher's own options (the commands have their own tests)."""

from __future__ import annotations

import subprocess
import sys

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
    for word in ("bench", "generate", "config", "--version"):
        assert word in text


def test_unknown_command_exits_2(capsys) -> None:
    assert main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err
