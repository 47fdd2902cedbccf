"""The MLA section of ``python -m kvcache bench`` in a tiny configuration (code path, output
shape and JSON content only: no timing is asserted)."""

from __future__ import annotations

import importlib.util
import json
import pathlib

import numpy as np
import pytest

from kvcache import bench, reference

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = ["--sections", "mla", "--mla-contexts", "128,192", "--mla-repeats", "1",
        "--mla-naive-repeats", "1", "--mla-working-set-mib", "1", "--mla-fma-iters", "1000",
        "--bandwidth-mib", "1", "--threads", "1", "--no-progress"]


def test_mla_section_tiny_run(tmp_path, capsys):
    path = tmp_path / "mla.json"
    assert bench.main(TINY + ["--json", str(path)]) == 0
    text = capsys.readouterr().out
    assert "MLA decode" in text
    assert "at 192, 1 thread:" in text and "compute ceiling" in text
    assert "target" not in text and "PASS" not in text and "FAIL" not in text
    assert "20480 B (8.89x the latent)" in text

    data = json.loads(path.read_text())
    assert list(data["sections"]) == ["mla"]
    mla = data["sections"]["mla"]
    assert mla["options"]["contexts"] == [128, 192]
    rows = mla["rows"]
    assert [(r["context"], r["threads"]) for r in rows] == [(128, 1), (192, 1)]
    for r in rows:
        assert r["layers"] >= 2                              # rotation, even at 1 MiB
        assert r["step_bytes"] == r["context"] * 2304
        assert r["layer_bytes"] == r["step_bytes"] + 2 * 16 * 128 * 512 * 4
        assert r["fmas_per_step"] == r["context"] * 17408 + 2 * 16 * 128 * 512
        assert len(r["kernel_samples_s"]) == 1
        for key in ("kernel_ms", "latent_gbs", "all_gbs", "pct_bandwidth", "kernel_gfmas",
                    "pct_peak_fma", "fma_ceiling_pct_bandwidth", "naive_ms",
                    "speedup_vs_naive"):
            assert np.isfinite(r[key]) and r[key] > 0, key
        assert r["rel_err_vs_naive"] < 1e-4                  # the kernel agrees with the naive form
    s = mla["summary"]
    assert s["context"] == 192 and s["threads"] == 1
    assert not any(k.endswith("_pass") for k in s) and "targets" not in mla
    info = mla
    assert info["memory"]["latent"] == 2304 and info["memory"]["per_head_f32"] == 20480
    assert set(info["fma_peak"]) == {"1"}


def test_mla_section_skips_naive_above_limit(tmp_path, capsys):
    path = tmp_path / "mla.json"
    argv = TINY + ["--mla-naive-max-context", "128", "--json", str(path)]
    assert bench.main(argv) == 0
    capsys.readouterr()
    mla = json.loads(path.read_text())["sections"]["mla"]
    rows = mla["rows"]
    assert "naive_ms" in rows[0] and "naive_ms" not in rows[1]
    assert mla["summary"]["speedup_vs_naive"] is None


def test_mla_summary_reports_the_largest_context():
    def row(context, threads, speedup, pct, ceiling):
        return {"context": context, "threads": threads, "speedup_vs_naive": speedup,
                "kernel_ms": 1.0, "naive_ms": speedup, "latent_gbs": 1.0, "bandwidth_gbs": 10.0,
                "pct_bandwidth": pct, "peak_gfmas": 1.0, "kernel_gfmas": 0.5,
                "pct_peak_fma": 50.0, "fma_ceiling_gbs": 1.0,
                "fma_ceiling_pct_bandwidth": ceiling}

    rows = [row(4096, 2, 5.0, 10.0, 35.0), row(16384, 1, 50.0, 20.0, 20.0),
            row(16384, 2, 12.0, 30.0, 35.0)]
    s = bench.mla_summary(rows)
    assert (s["threads"], s["context"]) == (2, 16384)
    assert s["speedup_vs_naive"] == 12.0 and s["pct_bandwidth"] == 30.0
    assert s["fma_ceiling_pct_bandwidth"] == 35.0
    assert not any(k.endswith("_pass") or "target" in k for k in s)
    rows[2] = row(16384, 2, 8.0, 65.0, 80.0)
    s = bench.mla_summary(rows)
    assert s["speedup_vs_naive"] == 8.0 and s["pct_bandwidth"] == 65.0


def test_mla_workload_matches_naive_and_cache_views():
    work = bench.MlaDecode(64, n_layers=2)
    lat, kr = work.views[1]
    assert lat.shape == (64, 512) and kr.shape == (64, 64)
    assert lat.flags.c_contiguous and kr.flags.c_contiguous
    assert np.shares_memory(lat, work.cache.slot_storage(1, 0))  # no copy
    assert not np.shares_memory(work.weights[0][0], work.weights[1][0])
    got = work.output(1, layer=1)
    want = reference.mla_naive(work.qn, work.qr, lat, kr, *work.weights[1], work.scale)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    work.step()
    work.step()
    work.sweep(1)


def test_mla_asv_module_runs(monkeypatch):
    monkeypatch.setenv("KVCACHE_BENCH_MLA_WORKING_SET_MIB", "1")    # 2 layers, not 160 MiB
    spec = importlib.util.spec_from_file_location("bench_mla", ROOT / "benchmarks" / "bench_mla.py")
    if spec is None:
        pytest.skip("benchmarks/ is not part of this checkout")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    k = mod.MlaKernel()
    k.setup(64, 1)
    k.time_kernel_step(64, 1)
    assert k.track_latent_bytes(64, 1) == 64 * 2304
    k.teardown(64, 1)
    n = mod.MlaNaive()
    n.setup(64)
    n.time_naive_step(64)
    n.teardown(64)
    m = mod.MlaMemory()
    m.setup()
    assert m.track_ratio_f32() == pytest.approx(20480 / 2304)
