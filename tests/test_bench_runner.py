"""The runner section of ``python -m kvcache bench`` on a tiny model (code path, table and JSON;
no timing is asserted).  The section's model is swapped for a small one so the test is quick;
what it checks -- the same cache contents on both sides give the same first-step logits -- is
the section's own safeguard."""

from __future__ import annotations

import json

import pytest

from kvcache import bench

pytest.importorskip("torch")
pytest.importorskip("transformers")

TINY_MODEL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)


def test_runner_section_tiny_run(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench.runner, "RUNNER_MODEL", TINY_MODEL)
    path = tmp_path / "runner.json"
    argv = ["--sections", "runner", "--runner-contexts", "64,300", "--runner-steps", "3",
            "--no-progress", "--json", str(path)]
    assert bench.main(argv) == 0
    text = capsys.readouterr().out
    assert "kvcache.runner vs transformers generate" in text and "WARNING" not in text
    rows = json.loads(path.read_text())["sections"]["runner"]["rows"]
    assert [r["context"] for r in rows] == [64, 300]
    for r in rows:
        assert r["max_abs_logit_diff"] < 1e-4            # same cache, same token, same logits
        for side in ("f32", "q8", "transformers"):
            assert r[side]["tokens_per_s"] > 0 and len(r[side]["step_samples_s"]) >= 2
        for mode in ("f32", "q8"):
            assert 0 < r[mode]["attention_share"] < 1
        # f32 cache bytes: layers x (context + steps + 1) x K and V rows of 2 heads x 16 x 4 B
        assert r["f32"]["cache_bytes"] == 2 * (r["context"] + 3 + 1) * 2 * 2 * 16 * 4
        assert r["q8"]["cache_bytes"] < r["f32"]["cache_bytes"] / 2
