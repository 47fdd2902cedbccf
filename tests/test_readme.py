"""The examples of README.md and docs/: each runs on its own and prints what the page says.

Every ```python block of README.md and of the pages under docs/ is followed by a "Prints:"
paragraph and a ```text block with its exact standard output. Each block runs in a fresh
interpreter whose working directory is an empty temporary folder, which must still be empty
afterwards (examples write only into folders they create with ``tempfile``). Blocks that use
torch and transformers run too: the ``test`` extra installs them.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]

# a python block, optionally followed by "Prints:" and a text block with its output
_BLOCK = re.compile(r"```python\n(?P<code>.*?)```\n(?:\s*Prints:\s*\n\s*```text\n(?P<out>.*?)```)?",
                    re.S)


def _blocks() -> list[tuple[str, str, str | None]]:
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for match in _BLOCK.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append((f"{page.relative_to(ROOT)}:{line}", match.group("code"),
                          match.group("out")))
    return found


BLOCKS = _blocks()


def test_readme_is_short_and_every_page_has_only_known_fences() -> None:
    text = README.read_text(encoding="utf-8")
    # a newcomer reads it in five minutes: what it is, set-up, a quickstart, a feature table
    assert len(text.splitlines()) <= 150
    assert sum(1 for where, _, _ in BLOCKS if where.startswith("README.md")) >= 2
    assert len(BLOCKS) >= 12
    for page in PAGES:
        fences = re.findall(r"^```(\w*)$", page.read_text(encoding="utf-8"), re.M)
        # every fence opens a python, text or bash block or closes one; no unrun "py" examples
        assert set(fences) <= {"python", "text", "bash", ""}, page


def test_readme_links_point_at_pages_that_exist() -> None:
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#:]+?\.md)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            assert (page.parent / target).is_file(), f"{page.relative_to(ROOT)} links {target}"


@pytest.mark.parametrize("where,code,expected", BLOCKS, ids=[b[0] for b in BLOCKS])
def test_example_runs_alone_and_prints_what_it_says(where: str, code: str,
                                                    expected: str | None,
                                                    tmp_path: pathlib.Path) -> None:
    assert expected is not None, f"{where}: the python block has no 'Prints:' block"
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, f"{where} failed:\n{done.stderr}"
    assert done.stdout == expected, (f"{where} printed:\n{done.stdout}\n"
                                     f"the page says:\n{expected}")
    assert list(tmp_path.iterdir()) == [], f"{where} wrote into its working folder"
