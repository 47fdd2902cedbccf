"""show_config(): what was built, the thread pools, the wire digest."""

import ast
import io
import os
import re
import subprocess
import sys

import pytest

import kvcache as kc
from kvcache import _config, _wire_io


def test_show_config_prints_every_fact():
    out = io.StringIO()
    kc.show_config(file=out)
    text = out.getvalue()
    for key in ("kvcache", "numpy", "openmp_built", "simd_built", "threads", "omp_spin",
                "chunk_rows", "wire_digest", "threadpools"):
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


def _spin_after_import(env_extra: dict[str, str], first: str = "") -> tuple:
    """In a fresh interpreter (``first`` run before ``import kvcache``, OMP_DISPLAY_ENV=VERBOSE
    so that libgomp prints what it read): kvcache._omp.SPIN, the two variables as the
    environment holds them after the import, whether OpenMP is built in, a small kernel call's
    result, and the spin count libgomp printed (None: it printed none)."""
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    env.update(env_extra, OMP_DISPLAY_ENV="VERBOSE", PYTHONIOENCODING="utf-8")
    code = (first + "import os\nimport numpy as np\nimport kvcache\nfrom kvcache import _core, _omp\n"
            "layer = kvcache.LayerKvCache(1, 8)\n"
            "layer.append(np.ones((3, 1, 8), np.float32), np.ones((3, 1, 8), np.float32))\n"
            "o = layer.attend_all_heads(np.ones((1, 8), np.float32))\n"
            "kvcache.show_config()\n"
            "print(repr((_omp.SPIN, os.environ.get('GOMP_SPINCOUNT'), "
            "os.environ.get('OMP_WAIT_POLICY'), _core.openmp_built(), float(o.sum()))))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    read = re.search(rb"GOMP_SPINCOUNT = '([^']*)'", out.stderr)
    return (*ast.literal_eval(out.stdout.decode().strip().splitlines()[-1]),
            None if read is None else read.group(1).decode())


def _libgomp_here() -> bool:
    """Whether this process runs kvcache's kernels on libgomp (Linux, OpenMP built in)."""
    from kvcache import _core
    if sys.platform != "linux" or not _core.openmp_built():
        return False
    with open("/proc/self/maps") as f:
        return "libgomp" in f.read()


def test_the_spin_default_applies_while_the_extension_loads_and_leaves_no_trace():
    spin, count, policy, built, total, read = _spin_after_import({})
    assert count is None and policy is None            # children see the program's environment
    assert total == 8.0
    if _libgomp_here():
        assert spin == f"GOMP_SPINCOUNT={kc._omp.SPIN_DEFAULT} (kvcache's default)"
        assert read == str(kc._omp.SPIN_DEFAULT)       # what libgomp itself read
    else:
        assert spin.startswith("not applied") and read is None


@pytest.mark.parametrize("extra,want,reads", [
    ({"GOMP_SPINCOUNT": "123"}, "environment: GOMP_SPINCOUNT='123'", "123"),
    ({"OMP_WAIT_POLICY": "passive"}, "environment: OMP_WAIT_POLICY='passive'", "0"),
    ({"GOMP_SPINCOUNT": "not a number"}, "environment: GOMP_SPINCOUNT='not a number'", "300000"),
    ({"GOMP_SPINCOUNT": "1\udcff"}, "environment: GOMP_SPINCOUNT='1\\udcff'", "300000"),
])
def test_a_spin_setting_of_the_environment_is_kept(extra, want, reads):
    """The environment's setting wins and stays; libgomp answers a bad value itself (a
    warning, its default), the kernels still run and show_config prints the value escaped."""
    spin, count, policy, _, total, read = _spin_after_import(extra)
    assert spin == want and total == 8.0
    assert (count, policy) == (extra.get("GOMP_SPINCOUNT"), extra.get("OMP_WAIT_POLICY"))
    if _libgomp_here():
        assert read == reads


def test_a_libgomp_loaded_before_kvcache_keeps_its_own_setting():
    if not _libgomp_here():   # no libgomp to load first: the extension loads none either
        spin = _spin_after_import({})[0]
        assert spin.startswith("not applied")
        return
    spin, count, _, _, total, read = _spin_after_import(
        {}, first="import ctypes\nctypes.CDLL('libgomp.so.1')\n")
    assert spin == "libgomp's own setting (loaded before kvcache)"
    assert count is None and total == 8.0 and read == "300000"
