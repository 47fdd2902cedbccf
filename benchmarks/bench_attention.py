"""asv-style decode-attention benchmarks for kvcache.

Each class builds its workload in ``setup`` from the shared workload classes in
:mod:`kvcache.bench` (the same code ``python -m kvcache bench`` times), so both measure the same
thing: one decode step (``attend_all_heads`` of one layer) over a rotating set of layers whose
bytes exceed the last-level cache.  ``time_*`` methods time one step on the next layer of the
rotation; ``peakmem_*`` methods report the peak resident memory of the same step (the working set
dominates it).

Run with asv from this folder (``asv run --python=same``, see asv.conf.json) or, without asv,
through ``python -m kvcache bench`` which prints the full table.  The working set defaults to
1 GiB; set ``KVCACHE_BENCH_WS_MIB`` to change it (e.g. smaller for a smoke run).
"""

import os

from kvcache import bench

CONTEXTS = [1024, 4096, 16384, 32768]
GEOMETRIES = list(bench.GEOMETRIES)
MODES = list(bench.MODE_NAMES)


def _working_set():
    default_mib = bench.DEFAULT_WORKING_SET // bench.MiB
    return int(os.environ.get("KVCACHE_BENCH_WS_MIB", default_mib)) * bench.MiB


class DecodeAttention:
    """kvcache ``attend_all_heads`` per decode step, f32 and q8, rotated over >= 1 GiB."""

    params = (CONTEXTS, GEOMETRIES, MODES)
    param_names = ["context", "geometry", "mode"]
    timeout = 600
    warmup_time = 0.5

    def setup(self, context, geometry, mode):
        self.work = bench.KvcacheDecode(bench.GEOMETRIES[geometry], context, mode, _working_set())
        self.work.sweep()                                    # first touch of every layer

    def teardown(self, context, geometry, mode):
        del self.work

    def time_decode_step(self, context, geometry, mode):
        self.work.step()

    def peakmem_decode_step(self, context, geometry, mode):
        self.work.step()


class DecodeAttentionTorch:
    """torch ``scaled_dot_product_attention`` (f32, enable_gqa) over the same rotated rows."""

    params = (CONTEXTS, GEOMETRIES)
    param_names = ["context", "geometry"]
    timeout = 600
    warmup_time = 0.5

    def setup(self, context, geometry):
        # NotImplementedError (torch missing) makes asv skip the benchmark
        self.work = bench.TorchDecode(bench.GEOMETRIES[geometry], context, _working_set())
        self.work.sweep()

    def teardown(self, context, geometry):
        del self.work

    def time_decode_step(self, context, geometry):
        self.work.step()


class DecodeAttentionReference:
    """The NumPy reference on one layer (slow; not rotated, so small contexts may sit in cache)."""

    params = (CONTEXTS, GEOMETRIES, MODES)
    param_names = ["context", "geometry", "mode"]
    timeout = 600
    number = 1
    repeat = 3

    def setup(self, context, geometry, mode):
        work = bench.KvcacheDecode(bench.GEOMETRIES[geometry], context, mode, working_set=0)
        self.ref = bench.ReferenceDecode(work.layers[0], work.q)

    def time_decode_step(self, context, geometry, mode):
        self.ref.step()


class AppendCost:
    """Filling a Llama-geometry f32 layer from 0 to T one position at a time (amortised cost)."""

    params = [1024, 32768]
    param_names = ["context"]
    timeout = 300
    number = 1
    repeat = 3

    def setup(self, context):
        self.work = bench.AppendFill(bench.GEOMETRIES["llama3-8b"], context, "f32")

    def time_fill_one_at_a_time(self, context):
        self.work.fill()

    def peakmem_fill_one_at_a_time(self, context):
        self.work.fill()
