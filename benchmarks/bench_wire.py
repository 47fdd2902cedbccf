"""asv-style benchmarks of the byte formats (``kvcache.wire``): export and import throughput.

Each class builds its workload in ``setup`` with :class:`kvcache.bench.WireLayers` (the same code
the wire section of ``python -m kvcache bench`` times): Llama-3-8B layers (8 KV heads,
head_dim 128) holding ``context`` positions of random float32 rows, f32 storage or q8 storage
(``KvMode.Q8()``) filled with the same rows.  The variants are those of
:data:`kvcache.bench.WIRE_VARIANTS`:

* ``f32``, ``f32 as f16``, ``q8``: versioned format, ``to_bytes()`` (``f16=True`` for the second)
  and ``install_bytes``;
* ``legacy f32``, ``legacy f16``: ``export_wire()`` / ``import_wire()`` (q8 storage is refused
  by the legacy layout, by design).

* ``WireExport.time_export``: one export (a fresh buffer each call);
  ``track_buffer_bytes``: its size.
* ``WireImport.time_import``: one import of the exported buffer into a fresh ``LayerKvCache``
  (building that empty layer is inside the timed call; it is negligible).
* ``ModelSaveLoad``: ``KvCache.save(path)`` (fsync included) and ``KvCache.load(path)`` of a
  model of 2 such f32 layers, in a temporary folder.
* ``DigestAlone.time_digest_alone``: the digest ``to_bytes()`` stores, computed again over an
  f32 buffer with the wire module's own helper (the checksum's cost on its own).
* ``DigestFunctions.time_digest``: the raw digest functions over an f32 ``to_bytes()`` buffer
  (``crc32c`` and ``xxhash`` are skipped when not installed).

Unlike the CLI these run back to back (no interleaving across variants); ``python -m kvcache
bench --sections wire`` prints the interleaved table at 32k.  The
context defaults to 4k; set ``KVCACHE_BENCH_WIRE_CONTEXTS`` (e.g. ``4096,32768``) to change it.
"""

import os
import shutil
import tempfile

from kvcache import KvCache, bench

GEOMETRY = bench.GEOMETRIES["llama3-8b"]
CONTEXTS = [int(c) for c in
            os.environ.get("KVCACHE_BENCH_WIRE_CONTEXTS", "4096").split(",") if c.strip()]
VARIANTS = list(bench.WIRE_VARIANTS)


def _work(context, variant):
    storage = bench.WireLayers.variant(variant)[1]
    return bench.WireLayers(GEOMETRY, context, storages=(storage,))


class WireExport:
    """One export (``to_bytes`` / ``export_wire``) of a layer, per format variant."""

    params = (CONTEXTS, VARIANTS)
    param_names = ["context", "variant"]
    timeout = 300

    def setup(self, context, variant):
        self.work = _work(context, variant)

    def teardown(self, context, variant):
        del self.work

    def time_export(self, context, variant):
        self.work.export(variant)

    def track_buffer_bytes(self, context, variant):
        return len(self.work.export(variant))

    track_buffer_bytes.unit = "bytes"

    def track_layer_bytes(self, context, variant):
        return self.work.layer_bytes(variant)

    track_layer_bytes.unit = "bytes"


class WireImport:
    """One import (``install_bytes`` / ``import_wire``) into a fresh layer, per format variant."""

    params = (CONTEXTS, VARIANTS)
    param_names = ["context", "variant"]
    timeout = 300

    def setup(self, context, variant):
        self.work = _work(context, variant)
        self.buf = self.work.export(variant)
        target = self.work.target()
        self.work.load(variant, target, self.buf)
        self.work.check(variant, target)                     # the round trip is right
        del target

    def teardown(self, context, variant):
        del self.work, self.buf

    def time_import(self, context, variant):
        self.work.load(variant, self.work.target(), self.buf)


class ModelSaveLoad:
    """``KvCache.save`` (temp file, fsync, rename) and ``KvCache.load`` of a 2-layer f32 model."""

    params = (CONTEXTS,)
    param_names = ["context"]
    timeout = 300

    def setup(self, context):
        self.work = bench.WireLayers(GEOMETRY, context, storages=(),
                                     model_layers=bench.WIRE_SAVE_LAYERS)
        self.folder = tempfile.mkdtemp(prefix="kvcache-asv-wire-")
        self.path = os.path.join(self.folder, "model.kvcache")
        self.work.model.save(self.path)

    def teardown(self, context):
        del self.work
        shutil.rmtree(self.folder, ignore_errors=True)

    def time_save(self, context):
        self.work.model.save(self.path)

    def time_load(self, context):
        KvCache.load(self.path)

    def track_file_bytes(self, context):
        return os.path.getsize(self.path)

    track_file_bytes.unit = "bytes"


class DigestAlone:
    """The digest ``to_bytes()`` stores, computed again over an f32 buffer (wire's own helper)."""

    params = (CONTEXTS,)
    param_names = ["context"]
    timeout = 300

    def setup(self, context):
        self.buf = _work(context, "f32").export("f32")

    def teardown(self, context):
        del self.buf

    def time_digest_alone(self, context):
        bench.WireLayers.digest(self.buf)


class DigestFunctions:
    """Raw digest functions over an f32 ``to_bytes()`` buffer (the pick-by-measurement data)."""

    params = (CONTEXTS, ["xxhash.xxh3_64_intdigest", "zlib.crc32", "crc32c.crc32c"])
    param_names = ["context", "function"]
    timeout = 300

    def setup(self, context, function):
        fns = bench.wire_digest_functions()
        if function not in fns:
            raise NotImplementedError(f"{function.split('.')[0]} is not installed")
        self.fn = fns[function][0]
        self.buf = _work(context, "f32").export("f32")

    def teardown(self, context, function):
        del self.buf

    def time_digest(self, context, function):
        self.fn(self.buf)
