"""asv-style benchmarks of the absorbed MLA decode kernel against the naive NumPy form.

Each class builds its workload in ``setup`` with :class:`kvcache.bench.MlaDecode` (the same code
the MLA section of ``python -m kvcache bench`` times): a :class:`kvcache.LatentKvCache` of
DeepSeek-V2-Lite MLA layers (16 heads, kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim
128, v_head_dim 128; slot 0 the latent, slot 1 the RoPE key) holding ``context`` rows of random
float32 data, each layer with its own W_UK / W_UV, enough layers that they exceed the
last-level cache (160 MiB of rows and weights together, at least 2 layers).

* ``MlaKernel.time_kernel_step``: one decode step (one query position) through
  ``kvcache._core.mla_attend`` at ``threads`` threads, on the next layer of the rotation (so the
  rows come from DRAM, as in a model where the other layers run in between).
* ``MlaKernel.track_latent_bytes``: latent + k_rope bytes one step reads (T x 2304).
* ``MlaNaive.time_naive_step``: ``kvcache.reference.mla_naive`` (K and V of every head
  materialised from the latent each step) on one layer; slow (about 100x the kernel), so only
  at the smaller contexts by default.
* ``MlaMemory.track_*``: cache bytes per token per layer, latent against a per-head f32 cache
  of the same attention (the ratio is 8.9x).

Unlike the CLI there is no bandwidth or FMA-peak probe and no interleaving; ``python -m kvcache
bench --sections mla`` prints the full table with the compute ceiling.
Set ``KVCACHE_BENCH_MLA_CONTEXTS`` (default ``1024,16384``) and
``KVCACHE_BENCH_MLA_NAIVE_CONTEXTS`` (default ``1024,4096``) to change the contexts, and
``KVCACHE_BENCH_MLA_WORKING_SET_MIB`` (default 160) for the bytes the rotating layers hold at least.
"""

import os

from kvcache import bench


def _contexts(var, default):
    return [int(c) for c in os.environ.get(var, default).split(",") if c.strip()]


CONTEXTS = _contexts("KVCACHE_BENCH_MLA_CONTEXTS", "1024,16384")
NAIVE_CONTEXTS = _contexts("KVCACHE_BENCH_MLA_NAIVE_CONTEXTS", "1024,4096")
THREADS = sorted({1, bench.available_cpus()})
WORKING_SET = int(os.environ.get("KVCACHE_BENCH_MLA_WORKING_SET_MIB",
                                 bench.MLA_WORKING_SET // bench.MiB)) * bench.MiB


class MlaKernel:
    """One absorbed MLA decode step (``_core.mla_attend``) over a rotating set of layers."""

    params = (CONTEXTS, THREADS)
    param_names = ["context", "threads"]
    timeout = 600
    warmup_time = 0.5

    def setup(self, context, threads):
        self.work = bench.MlaDecode(context, WORKING_SET)
        self.work.sweep(threads)                             # warm the code paths

    def teardown(self, context, threads):
        del self.work

    def time_kernel_step(self, context, threads):
        self.work.step(threads)

    def track_latent_bytes(self, context, threads):
        return self.work.step_bytes

    track_latent_bytes.unit = "bytes"


class MlaNaive:
    """One step of the naive NumPy form (``reference.mla_naive``) on a single layer."""

    params = (NAIVE_CONTEXTS,)
    param_names = ["context"]
    timeout = 600
    number = 1
    repeat = 3

    def setup(self, context):
        self.work = bench.MlaDecode(context, n_layers=1)

    def teardown(self, context):
        del self.work

    def time_naive_step(self, context):
        self.work.naive()


class MlaMemory:
    """Cache bytes per token per layer: the latent against an equivalent per-head cache."""

    def setup(self):
        self.mem = bench.mla_cache_bytes_per_token()

    def track_latent_bytes_per_token(self):
        return self.mem["latent"]

    track_latent_bytes_per_token.unit = "bytes"

    def track_per_head_f32_bytes_per_token(self):
        return self.mem["per_head_f32"]

    track_per_head_f32_bytes_per_token.unit = "bytes"

    def track_ratio_f32(self):
        return self.mem["ratio_f32"]

    track_ratio_f32.unit = "x"
