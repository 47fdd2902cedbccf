"""show_config(): what was built, the thread pools, the wire digest."""

import io

import kvcache as kc
from kvcache import _config, _wire_io


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
    monkeypatch.setattr(_wire_io, "xxhash_module", lambda: None)
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


def test_the_kernel_stub_and_the_twins_name_the_same_parameters():
    """Kernels are called by keyword: the stub, the compiled module and the NumPy twins in
    kvcache.reference must agree on every parameter name, in order."""
    import ast
    import inspect
    import pathlib

    from kvcache import _core, reference
    stub = ast.parse((pathlib.Path(_core.__file__).parent / "_core.pyi").read_text())
    for node in stub.body:
        if not isinstance(node, ast.FunctionDef):
            continue
        declared = [a.arg for a in node.args.args]
        compiled = list(inspect.signature(getattr(_core, node.name)).parameters)
        assert declared == compiled, node.name
        twin = getattr(reference, node.name, None)
        if twin is not None:
            assert list(inspect.signature(twin).parameters) == compiled, node.name


def test_fresh_bytes_returns_the_bytes_and_their_writer():
    from kvcache import _core
    b, w = _core.fresh_bytes(8)
    memoryview(w)[:] = b"abcdefgh"
    del w
    assert isinstance(b, bytes) and b == b"abcdefgh"


def test_the_chunk_constant_is_one_value():
    """The compiled kernels and the Python side (quant, hence the NumPy twins) chunk the V
    accumulation alike: the summation order of docs/numerics.md depends on it."""
    from kvcache import _core, quant, reference
    assert _core.CHUNK_ROWS == quant.CHUNK_ROWS == reference.CHUNK_ROWS
