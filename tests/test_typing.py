"""The public API's annotations catch what the run-time checks would refuse.

mypy (from the test extra) checks a small user program against the package in src/ with the
project's strict configuration; the lines marked ``# bad`` must be the only errors.
"""

from __future__ import annotations

import pathlib
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[1]

PROGRAM = textwrap.dedent('''
    import numpy as np
    import kvcache as kc

    layer = kc.LayerKvCache(2, 8, mode="q8")
    layer.append(np.zeros((2, 8), np.float32), [[0.0] * 8] * 2)
    out = layer.attend_all_heads(np.zeros((4, 8)), window=16)
    n: int = layer.seq_len
    kv = kc.KvCache(2, 2, 8, 64, mode=kc.KvMode.F32)
    m: int = kv.seq_len
    sc = kc.StaticKvCache.with_capacity(1, 2, 8, 16)
    total: int = layer.memory_bytes() + kv.memory_bytes()
    layer.append("oops", 3)                       # bad
    s: str = kv.seq_len                           # bad
    layer.attend_all_heads(np.zeros((4, 8)), window="all")   # bad
''')


def test_strict_mypy_accepts_good_calls_and_flags_bad_ones(tmp_path):
    from mypy import api                          # mypy comes with the test extra
    prog = tmp_path / "user.py"
    prog.write_text(PROGRAM)
    stdout, stderr, _ = api.run([
        "--strict", "--no-error-summary", "--hide-error-context", "--show-column-numbers",
        "--config-file", str(ROOT / "pyproject.toml"), "--cache-dir", str(tmp_path / "cache"),
        str(prog)])
    lines = PROGRAM.splitlines()
    bad = {i + 1 for i, line in enumerate(lines) if line.rstrip().endswith("# bad")}
    flagged = {int(row.split(":")[1]) for row in stdout.splitlines()
               if row.startswith(str(prog)) and ": error:" in row}
    assert flagged == bad, stdout + stderr
