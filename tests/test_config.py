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


def test_the_kernel_stub_lists_every_compiled_function():
    """_core.pyi documents the compiled module: nothing missing, nothing stale."""
    import ast
    import pathlib

    from kvcache import _core
    compiled = {n for n in dir(_core) if not n.startswith("_") and callable(getattr(_core, n))}
    stub = ast.parse((pathlib.Path(_core.__file__).parent / "_core.pyi").read_text())
    declared = {node.name for node in stub.body if isinstance(node, ast.FunctionDef)}
    assert compiled == declared
