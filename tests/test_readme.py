"""The README's Python examples run as written (they share one namespace, in order).

Blocks fenced as ``py`` instead of ``python`` are illustrations that need outside files (a
checkpoint) and are not run."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)                 # the examples write files
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) >= 2
    namespace = {}
    for i, block in enumerate(blocks):
        exec(compile(block, f"README.md python block {i}", "exec"), namespace)
    assert namespace["layer"].o1_sealed()
    assert namespace["out"].shape == (1, 16, 128)           # the MLA example's last step
    assert namespace["lc"].cached_len == 0 and namespace["lc"].layers == [None, None]
