"""The smoke run of .ci/run (tests/isa_smoke.py) in-process: one call of every kernel family
gives the same bits with every body this CPU runs, portable included (.ci/run compares the
same digests from runs under QEMU on CPUs without AVX2 and without AVX-512)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvcache import _core
from kvcache import _dispatch as dispatch

sys.path.insert(0, str(Path(__file__).parent))
import isa_smoke  # noqa: E402


@pytest.fixture
def restore_isa():
    before = _core._isa_cap
    yield
    _core.set_isa(before)


def test_every_runnable_body_gives_the_same_digests(restore_isa):
    held = set().union(*_core.built_bodies().values())
    names = [b for b in dispatch.runnable(_core.cpu_features()) if b in held]
    assert "portable" in names
    digests = {}
    for name in names:
        _core.set_isa(name)
        digests[name] = isa_smoke.run_all()
    first = digests["portable"]
    assert len(first) == 15
    for name, got in digests.items():
        assert got == first, name


def test_the_program_prints_features_bodies_and_digests():
    res = subprocess.run([sys.executable, str(Path(isa_smoke.__file__))], check=True,
                         capture_output=True, text=True)
    report = json.loads(res.stdout)
    assert set(report["features"]) == set(_core.cpu_features())
    assert report["bodies"] == dispatch.choose(_core.cpu_features(), _core.built_bodies())
    assert report["digests"] == isa_smoke.run_all()
