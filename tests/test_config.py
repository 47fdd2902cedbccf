"""show_config(): what was built, the thread pools, the wire digest."""

import io

import kvcache as kc
from kvcache import _config, wire


def test_show_config_prints_every_fact():
    out = io.StringIO()
    kc.show_config(file=out)
    text = out.getvalue()
    for key in ("kvcache", "numpy", "openmp_built", "simd_built", "threads", "chunk_rows",
                "wire_digest", "threadpools"):
        assert f"{key}:" in text
    info = _config.config_info()
    assert info["kvcache"] == kc.__version__ and info["threads"] >= 1


def test_wire_digest_names_the_fallback(monkeypatch):
    assert _config.config_info()["wire_digest"].startswith("XXH3-64")
    monkeypatch.setattr(wire, "_xxhash", lambda: None)
    assert "CRC-32" in _config.config_info()["wire_digest"]
