"""The sync section of ``python -m kvcache bench`` in a tiny configuration: the code path, the
table, and the bytes each sync moved (exact; no timing is asserted)."""

from __future__ import annotations

import json

import pytest

from kvcache import bench

TINY = ["--sections", "sync", "--sync-context", "512", "--sync-steps", "4",
        "--sync-full-repeats", "2", "--no-progress"]
ROW = {"f32": 8 * 128 * 4 * 2,                        # K and V rows of 8 heads
       "q8": 8 * (128 + 8 * 4) + 8 * (128 + 4),       # int8 rows ("rows": 8 K scales of 16
                                                      # channels), 1 V scale
       "latent": (512 + 64) * 4}


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_sync_section_tiny_run(tmp_path, capsys, backend):
    if backend == "torch":
        pytest.importorskip("torch")
    path = tmp_path / "sync.json"
    assert bench.main(TINY + ["--sync-backend", backend, "--json", str(path)]) == 0
    text = capsys.readouterr().out
    assert "device mirror sync" in text and "bytes full/step" in text
    data = json.loads(path.read_text())
    assert list(data["sections"]) == ["sync"]
    sync = data["sections"]["sync"]
    assert sync["options"]["backend"] == sync["backend"] == backend
    rows = {r["case"]: r for r in sync["rows"]}
    assert set(rows) == {"f32", "q8", "latent"}
    for case, r in rows.items():
        assert r["step_bytes"] == ROW[case]                      # one appended position
        end = r["context_at_end"]
        cols = 0                          # q8 is the int8 scheme "rows": no column fields
        assert r["full_bytes"] == end * ROW[case] + cols
        assert r["bytes_ratio"] == pytest.approx(r["full_bytes"] / ROW[case])
        assert r["step_ms"] > 0 and r["full_ms"] > 0
        if case != "latent":                                    # drop 4, append 5: 5 rows move
            assert r["rollback_bytes"] == 5 * ROW[case]
            assert end == 512 + 4 + 4 * (5 - 4)
        # 512 rows fill the first device capacity (a power of two): the first step doubles it
        assert len(r["growth"]) == 1 and r["growth"][0]["device_bytes"] > 0
