"""The weights' digest behind Runner.fingerprint is computed once per checkpoint: in the
process and, through the digest file, across processes; a changed file is hashed again."""

from __future__ import annotations

import json
import os

import pytest

from kvcache.runner import Runner, digest

pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
from test_gguf import write_gguf  # noqa: E402  (the GGUF tests' random checkpoints)


@pytest.fixture
def counted(monkeypatch, tmp_path):
    """Count the real hash computations; a fresh process memo and digest file."""
    calls = []
    real = digest._compute

    def spy(arrays):
        calls.append(len(arrays))
        return real(arrays)

    monkeypatch.setattr(digest, "_compute", spy)
    monkeypatch.setattr(digest, "_memo", {})
    monkeypatch.setenv(digest.ENV, str(tmp_path / "cache" / "digests.json"))
    return calls


def test_one_hash_per_checkpoint_in_a_process_and_across_processes(tmp_path, counted):
    path = tmp_path / "m.gguf"
    write_gguf(path)
    a = Runner.from_pretrained(path)
    fp = a.fingerprint
    assert len(counted) == 1
    b = Runner.from_pretrained(path)                  # another runner, same files
    assert b.fingerprint == fp and len(counted) == 1
    c = Runner.from_pretrained(path, kv="q8")         # another mode: another fingerprint,
    assert c.fingerprint != fp and len(counted) == 1  # the same weights' digest
    digest._memo.clear()                              # as a new process would start
    d = Runner.from_pretrained(path)
    assert d.fingerprint == fp and len(counted) == 1  # read from the digest file
    entries = json.loads((tmp_path / "cache" / "digests.json").read_text())
    assert len(entries) == 1 and len(next(iter(entries.values()))) == 64


def test_a_rewritten_file_is_hashed_again(tmp_path, counted):
    path = tmp_path / "m.gguf"
    write_gguf(path, seed=1)
    fp = Runner.from_pretrained(path).fingerprint
    write_gguf(path, seed=2)                          # other weights, same name and size
    other = Runner.from_pretrained(path).fingerprint
    assert len(counted) == 2 and other != fp
    st = os.stat(path)
    data = path.read_bytes()
    path.write_bytes(data)                            # the same bytes written again
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    again = Runner.from_pretrained(path).fingerprint  # ctime moved: hashed once more,
    assert len(counted) == 3 and again == other       # the same digest


def test_the_digest_file_is_optional_and_never_an_error(tmp_path, counted, monkeypatch):
    path = tmp_path / "m.gguf"
    write_gguf(path)
    file = tmp_path / "cache" / "digests.json"
    file.parent.mkdir()
    file.write_text("{not json")                      # a damaged file is ignored and replaced
    fp = Runner.from_pretrained(path).fingerprint
    assert len(json.loads(file.read_text())) == 1
    monkeypatch.setenv(digest.ENV, "off")             # no file at all
    digest._memo.clear()
    assert Runner.from_pretrained(path).fingerprint == fp and len(counted) == 2
    blocked = tmp_path / "ro"
    blocked.write_text("a file where a folder is needed")
    monkeypatch.setenv(digest.ENV, str(blocked / "digests.json"))
    digest._memo.clear()
    assert Runner.from_pretrained(path).fingerprint == fp and len(counted) == 3


@pytest.mark.parametrize("value", ["OFF", " off ", "0", "None", "false", "no", ""])
def test_every_off_spelling_writes_no_file(tmp_path, counted, monkeypatch, value):
    path = tmp_path / "ckpt" / "m.gguf"
    path.parent.mkdir()
    write_gguf(path)
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv(digest.ENV, value)
    Runner.from_pretrained(path).fingerprint
    assert list(work.iterdir()) == [] and len(counted) == 1


@pytest.mark.parametrize("content", ["[" * 200000 + "]" * 200000, "[1, 2]", '{"k": 3}',
                                     " " * (1 << 20) + "{}"])
def test_a_hostile_digest_file_is_ignored(tmp_path, counted, monkeypatch, content):
    path = tmp_path / "m.gguf"
    write_gguf(path)
    file = tmp_path / "d.json"
    file.write_text(content)                          # too deep, not a dict, bad values, too big
    monkeypatch.setenv(digest.ENV, str(file))
    fp = Runner.from_pretrained(path).fingerprint
    digest._memo.clear()
    assert Runner.from_pretrained(path).fingerprint == fp
    assert len(counted) == 1                          # the second read the rewritten file
    monkeypatch.setenv(digest.ENV, str(tmp_path))     # a folder where the file should be
    digest._memo.clear()
    assert Runner.from_pretrained(path).fingerprint == fp and len(counted) == 2


def test_the_source_names_the_decoder_and_its_version(tmp_path):
    import json as js
    path = tmp_path / "m.gguf"
    write_gguf(path)
    key = js.loads(digest.checkpoint_source(path))
    assert key[2] == digest.LOADER and key[3] == "gguf" and key[4] not in ("", "absent")
    assert digest.checkpoint_source(tmp_path / "missing") is None


def test_a_runner_from_arrays_has_no_source_and_hashes_its_own():
    a, b = Runner.random(seed=3), Runner.random(seed=3)
    assert a._source is None and a.fingerprint == b.fingerprint
    assert Runner.random(seed=4).fingerprint != a.fingerprint


def test_the_tree_digest_covers_names_shapes_and_bytes():
    import numpy as np
    x = np.arange(12, dtype=np.float32)
    base = digest._compute([("a", x), ("b", x)])
    assert digest._compute([("a", x), ("b", x)]) == base
    assert digest._compute([("a", x), ("c", x)]) != base
    assert digest._compute([("a", x), ("b", x.reshape(3, 4))]) != base
    y = x.copy()
    y[5] = np.nextafter(y[5], np.float32(100))
    assert digest._compute([("a", x), ("b", y)]) != base
