"""The wire section of ``python -m kvcache bench`` in a tiny configuration: the code path, the
tables and the JSON (no timing is asserted)."""

from __future__ import annotations

import json

from kvcache import bench

TINY = ["--sections", "wire", "--wire-context", "64", "--wire-repeats", "1", "--no-progress"]


def test_wire_section_tiny_run(tmp_path, capsys):
    path = tmp_path / "wire.json"
    assert bench.main(TINY + ["--json", str(path)]) == 0
    text = capsys.readouterr().out
    assert "byte formats (kvcache.wire)" in text and "digest alone" in text
    assert "target" not in text and "PASS" not in text and "issue" not in text
    data = json.loads(path.read_text())["sections"]["wire"]
    variants = [r["variant"] for r in data["rows"]]
    assert variants == list(bench.WIRE_VARIANTS) + ["KvCache save/load"]
    for r in data["rows"]:
        assert r["export_ms"] > 0 and r["import_ms"] > 0
    alone = data["digests"][0]
    assert alone["function"] == "digest alone" and alone["bytes"] == data["rows"][0]["buffer_bytes"]
    s = data["summary"]
    assert s["checksum_share"] > 0 and not any(k.endswith("_pass") for k in s)
    assert "targets" not in data


def test_digest_alone_matches_the_stored_digest():
    work = bench.WireLayers(bench.GEOMETRIES["qwen2.5-0.5b"], 40, storages=("f32",))
    buf = work.export("f32")
    assert work.digest(buf) == work.stored_digest(buf)
