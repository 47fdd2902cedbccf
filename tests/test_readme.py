"""The README's Python examples: each runs on its own and prints exactly what the README says.

Every ```python block of README.md is followed by a "Prints:" paragraph and a ```text block with
its exact standard output. Each block runs in a fresh interpreter whose working directory is an
empty temporary folder, which must still be empty afterwards (examples write only into folders
they create with ``tempfile``). Blocks that use torch and transformers run too: the ``test`` extra
installs them.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"

# a python block, optionally followed by "Prints:" and a text block with its output
_BLOCK = re.compile(r"```python\n(?P<code>.*?)```\n(?:\s*Prints:\s*\n\s*```text\n(?P<out>.*?)```)?",
                    re.S)


def _blocks() -> list[tuple[int, str, str | None]]:
    text = README.read_text(encoding="utf-8")
    found = []
    for match in _BLOCK.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        found.append((line, match.group("code"), match.group("out")))
    return found


BLOCKS = _blocks()


def test_readme_has_examples_and_only_python_or_shell_fences() -> None:
    assert len(BLOCKS) >= 7
    fences = re.findall(r"^```(\w*)$", README.read_text(encoding="utf-8"), re.M)
    # every fence opens a python, text or bash block or closes one; no unrun "py" examples
    assert set(fences) <= {"python", "text", "bash", ""}


@pytest.mark.parametrize("line,code,expected", BLOCKS, ids=[f"line{b[0]}" for b in BLOCKS])
def test_readme_block_runs_alone_and_prints_what_it_says(line: int, code: str,
                                                         expected: str | None,
                                                         tmp_path: pathlib.Path) -> None:
    assert expected is not None, f"README.md line {line}: the python block has no 'Prints:' block"
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, f"README.md line {line} failed:\n{done.stderr}"
    assert done.stdout == expected, (f"README.md line {line} printed:\n{done.stdout}\n"
                                     f"the README says:\n{expected}")
    assert list(tmp_path.iterdir()) == [], f"README.md line {line} wrote into its working folder"
