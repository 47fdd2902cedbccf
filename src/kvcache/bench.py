"""Decode-attention benchmark behind ``python -m kvcache bench``.

What is timed
-------------
One decode step of one layer: ``LayerKvCache.attend_all_heads(q, out=buf)`` with ``q`` of shape
(num_heads, head_dim), i.e. the newest position attending over ``context`` stored rows, for two
geometries (Llama-3-8B: 32 query heads, 8 KV heads, head_dim 128; Qwen2.5-0.5B: 14 / 2 / 64), two
storage modes (``KvMode.F32`` and ``KvMode.Q8()``), several contexts and thread counts.  Side by
side, in the same run: the pure-NumPy reference (``kvcache.reference.attend_all_heads``) and, when
torch is installed, ``torch.nn.functional.scaled_dot_product_attention`` over float32 K/V tensors
of shape (1, num_kv_heads, context, head_dim) with ``enable_gqa=True``.  Torch has no int8 KV, so
q8 rows are compared with torch *f32* (labelled so).

Methodology
-----------
* **Working set above the last-level cache.**  Decode attention streams K and V once per step, so
  it is bound by memory bandwidth only when the rows come from DRAM.  A single 32k layer can sit in
  a large (possibly virtualised, much larger than reported) LLC and give impossible numbers, so
  each configuration builds *several* layers holding the same rows (like a model's layers) until
  their bytes reach the target working set (1 GiB by default), and a timed *sweep* attends every
  layer once, in order.  By the time a layer comes round again, the others have pushed it out of
  cache.  kvcache and torch both rotate over such a working set (built one after the other, so
  memory stays bounded).  The NumPy reference is slow, so it is timed on a single layer with fewer
  repeats; for small contexts that layer may be cache-resident, which only flatters the reference.
* **Bandwidth probe.**  ``kvcache._core.stream_read`` (a parallel sum) reads a 1 GiB float32
  buffer several times, for each thread count; the best run is this machine's read bandwidth and
  the denominator of "% of bandwidth" at the same thread count.
* **Effective GB/s** = bytes of K and V rows a step reads / time per step, with
  f32: 2*nkv*T*hd*4 and q8: nkv*T*(hd + 4*ceil(hd/32)) + nkv*T*(hd + 4) (int8 rows and their
  scales).
* **Medians.**  After one warm-up sweep, every sweep is timed (``timeit``, garbage collector off)
  and divided by the number of layers; the reported time per step is the median over sweeps.
* **Threads.**  kvcache runs under ``threadpool_limits(n, user_api="openmp")``, the NumPy reference
  under ``threadpool_limits(n)`` (its BLAS calls), torch under ``torch.set_num_threads(n)``.
* **Append cost.**  Time to fill a Llama-geometry f32 layer from 0 to T one position at a time
  (amortised, divided by T) and the median of single appends at T (each rolled back with
  ``truncate_last(1)``), at 1k and 32k; their 32k/1k ratio should stay near 1 (amortised O(1)).

O(1) section (``--sections o1`` runs it alone)
-----------------------------------------------
The O(1) Nystrom override (``LayerKvCache.o1_begin`` / ``o1_push_q`` / ``o1_seal`` /
``o1_step``) against exact attention, Llama-3-8B layer geometry (32 query heads, 8 KV heads,
head_dim 128), m=32 landmarks, a w=128 window and 4 sinks, at contexts 1k..32k (quick: 1k, 4k).
For each context one f32 layer is filled with the prompt's K/V and query trace and sealed (the
seal is timed once, at the largest thread count, and reported on its own: it is not part of
the step), and an exact f32 layer and an exact q8 layer are filled with the same rows.

* **Step times, round-robin.**  Per repeat: the O(1) layer is rolled back to its post-seal
  snapshot (``o1_restore``, untimed), then O(1) ``o1_step``, exact f32 and exact q8 are each
  timed once (``time.perf_counter`` around the call, garbage collector off), in that order, so
  machine noise hits all three alike; the medians are reported.  An exact step is
  ``append(k, v)`` + ``attend_all_heads(q, out=buf)`` of the newest position over ``context``
  stored rows (so context + 1 rows are attended); the ``truncate_last(1)`` that keeps the length
  at ``context`` runs after the timer stops.  Every call uses the same (q, k, v): the first decode
  position after the prompt.
* **Cold caches.**  Before each of the three timed calls a 256 MiB buffer is read
  (``_core.stream_read``), so every step starts with its state or KV rows out of the last-level
  cache, as in a model where the other layers run in between (the decode section gets the same
  effect from its rotating working set).  Without it the exact layers at small contexts and the
  ~2.3 MiB O(1) state would be cache-resident at some contexts and not at others.  The "O(1)
  warm" column is a second ``o1_step`` right after the cold one (state in cache), for reference.
* **Threads.**  Like the decode section: every thread count of ``--threads`` (default 1 and all
  available) gets its own round-robin and rows, under ``threadpool_limits(n, "openmp")``; the
  seal and the accuracy steps run at the largest thread count.
* **Memory.**  ``memory_bytes()`` of each layer: the sealed layer (KV released: only the O(1)
  state, equal to ``o1_memory_bytes()``) against the f32 and q8 layers holding ``context`` rows.
* **Accuracy.**  16 decode steps after the prompt, the same (q, k, v) fed to the O(1) layer
  (``o1_step``) and to the exact layers (``append`` then ``attend_all_heads``); the error is the
  relative L2 norm ||o1 - exact_f32|| / ||exact_f32|| over all 16 steps' outputs (all heads
  together).  q8's error against f32 is shown for scale.  The layers are rolled back afterwards
  (``o1_restore``, ``truncate_last(16)``).  Two data sets (both float32, seeded, generated in
  1024-position blocks, each block from its own seed so a shorter prompt is a prefix of a longer
  one and the decode steps continue the same sequence):

  - ``clustered`` (:class:`SyntheticStream`): per KV head 8 key-cluster centres c_j ~ N(0, I)
    that drift slowly, c_j(t) = base_j + 0.5 (a_j cos th_j(t) + b_j sin th_j(t)),
    th_j(t) = 2 pi t / 16384 + phi_j (a_j, b_j ~ N(0, I)); the sequence moves between "topics":
    runs of 64 positions share a cluster drawn uniformly; a key is its cluster's centre plus
    0.5 N(0, I) noise; a query of every head of the group is 0.25 * the same centre plus
    N(0, I) noise (queries correlated with the keys of their topic: about +3.5 logits for the
    position's own cluster); a value is a per-cluster value centre u_j ~ N(0, I) plus N(0, I).
  - ``iid``: q, k, v independent standard normal (no structure to exploit: attention is nearly
    uniform, the exact output is the mean of thousands of random values and close to zero, so
    this is the hard, unflattering case for a low-rank far field).
* **Ratios** come from the same run: exact f32 step / O(1) step per context and thread count,
  f32 KV bytes / state bytes, and flatness O(1) step at the largest / smallest context; the
  issue's targets (flatness <= 1.2x, >= 20x faster and >= 10x less memory than exact f32 at 32k)
  are printed with pass/fail.

Wire section (``--sections wire`` runs it alone)
-----------------------------------------------
Export and import throughput of the byte formats (``kvcache.wire``) for one Llama-3-8B layer
(8 KV heads, head_dim 128) holding 32k positions (f32 KV = 256 MiB; quick: 4k), single thread
(the writers and readers are NumPy copies plus the digest; no OpenMP).

* **Variants.**  Versioned format: ``layer.to_bytes()`` and ``LayerKvCache(8, 128).from_bytes``
  for f32 storage, f32 storage written with ``f16=True``, and q8 storage (a ``KvMode.Q8()``
  layer filled with the same rows).  Legacy layout: ``export_wire()`` / ``import_wire()``, f32
  and f16 (q8 storage is refused by that layout, by design).  The checksum's cost: f32
  ``to_bytes()`` with ``kvcache.wire._BENCH_NO_DIGEST`` set (a null digest; such a buffer does
  not import, so that variant is export only).  ``KvCache.save(path)`` / ``KvCache.load(path)``
  of a model of 2 such f32 layers, in a temporary folder (save includes the fsync of the file
  and of the folder; load reads a file that is in the page cache, having just been written).
  Each import goes into a fresh ``LayerKvCache`` built before the timer starts.
* **Round-robin.**  Per repeat every variant runs once (export, then import of that buffer,
  which is then dropped), then save and load; odd repeats run the variants in reverse order, so
  neither a variant's position nor the allocator's state favours one of them.  One untimed
  warm-up round first (it also checks the round trips); the garbage collector is off and at
  most one exported buffer is alive at a time.  Medians are reported, the best in the JSON.
* **GB/s** = ``memory_bytes()`` of the exported layer (of every model layer for save/load) /
  time, 1e9 bytes per GB; the buffer (file) bytes are shown beside it: f16 buffers are half
  the layer, q8 layers are ~27% of f32.  Every export allocates a fresh buffer, so its time
  includes the page faults of first touching it (``_core.fresh_bytes`` asks for huge pages).
* **Checksum share** = 1 - (no-digest export) / (f32 export), from the medians; the paired
  per-repeat median is in the JSON.  For information, the raw digest functions
  (``xxhash.xxh3_64_intdigest``, ``zlib.crc32``, and ``crc32c.crc32c`` when that package is
  installed) are timed over the f32 export buffer in the same rounds: the evidence for the
  writer's choice (XXH3-64 when ``xxhash`` is installed, else CRC-32).  The writers hash each
  256 KiB chunk right after copying it (in L2), the raw functions read a 256 MiB buffer from
  DRAM.
* **Targets** (the issue's): f32 ``to_bytes`` export and ``from_bytes`` import at >= 1 GB/s,
  checksum included; the checksum <= 25% of the export time; printed with pass/fail.

MLA section (``--sections mla`` runs it alone)
---------------------------------------------
The absorbed Multi-head Latent Attention decode kernel (``kvcache._core.mla_attend``, what
``kvcache.mla_decode`` runs) against the naive NumPy form (``kvcache.reference.mla_naive``,
which materialises every head's K and V from the latent each step), DeepSeek-V2-Lite geometry:
16 heads, kv_lora_rank r=512, qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128, scale
``mla_softmax_scale(128, 64, {"factor": 40, "mscale_all_dim": 0.707})``; one query position
of one layer per step, contexts 1k, 4k, 16k, 32k (quick: 1k, 4k).

* **Cache.**  A ``LatentKvCache.with_capacity(n_layers, T, [(512,), (64,)])`` filled with
  ``write_layer`` + ``advance(T)`` (float32 standard normal rows, the same rows in every layer);
  a step reads ``slot_storage(l, 0)[:T]`` and ``slot_storage(l, 1)[:T]`` (views, no copy).
  Each layer has its own W_UK (16, 128, 512) and W_UV (16, 128, 512) copies (8 MiB together),
  as in a model, so they are read from DRAM every step too.
* **Working set above the last-level cache.**  Like the decode section: enough layers that
  their latent, RoPE-key and weight bytes reach max(160 MiB, 4 x the reported LLC) (at least 2
  layers), and a timed sweep runs one step on every layer in order, so each step finds its rows
  evicted by the others.  Time per step = sweep / layers, median over ``--mla-repeats`` sweeps
  (after one warm-up sweep), per thread count (``mla_attend``'s n_threads argument, under
  ``threadpool_limits(n, "openmp")``).  The numpy arrays are large, so NumPy asks for
  transparent huge pages for them.
* **Naive form.**  ``reference.mla_naive`` on layer 0 under ``threadpool_limits(n)`` (its BLAS
  matmuls), median of ``--mla-naive-repeats`` calls (default 3) after one warm-up, at every
  context up to ``--mla-naive-max-context`` (default 32k); its output checks the kernel's
  (relative error max|a-b| / max|b|).  Speedup = naive / kernel at the same thread count.
* **Rates.**  Latent GB/s = T (512 + 64) 4 bytes / kernel time, and as % of the measured
  ``stream_read`` bandwidth at the same thread count; "all GB/s" adds the two weight matrices
  (2 x 16 x 128 x 512 x 4 bytes) read every step.
* **Compute bound.**  The kernel does 16 (512 + 64) + 16 x 512 = 17408 fused multiply-adds per
  cached row (scores with the folded query, then the latent-weighted sum), plus the fixed fold
  and unfold of 2 x 16 x 128 x 512 per step.  ``_core.fma_probe`` (80 independent FMA chains per
  thread) is timed per thread count, best of 5, for the machine's peak FMA rate; reported:
  achieved GFMA/s, % of that peak, and the bandwidth the FMA peak can consume at 17408 FMAs per
  2304-byte row (peak / 17408 x 2304 B/s) as % of the measured bandwidth: above that line a
  latent-read target is out of reach for this kernel however the memory system performs.
* **Memory.**  Cache bytes per token per layer: latent (512 + 64) x 4 = 2304 B against an
  equivalent per-head f32 cache (16 heads x (K of 128 + 64 = 192, V of 128) x 4 = 20480 B) and
  against the same per-head cache in kvcache's q8 layout.
* **Targets** (the issue's, judged at 16k and the largest thread count): kernel >= 10x faster
  than the naive NumPy form; latent read >= 60% of the measured bandwidth -- printed with
  pass/fail next to the compute ceiling.

Sync section (``--sections sync`` runs it alone)
-----------------------------------------------
What keeping a device mirror in step costs (``kvcache.device.Mirror``): one layer at 32k
positions (quick: 4k) -- Llama-3-8B attention (8 KV heads x 128) in f32 and in q8, and a
DeepSeek-V2-Lite latent layer (``LatentKvCache``, slots 512 + 64, float32) -- mirrored with
the torch backend on its CPU device (``--sync-backend numpy`` for host arrays; no GPU is
assumed: on the CPU "device" a sync is a memory copy, so the bytes are the portable figure and
the times say what a copy of that size costs here).

* **decode step**: append one position, then ``sync()``; median bytes and time of
  ``--sync-steps`` steps (default 101, quick 21).  The first step after the initial upload
  grows the device capacity (doubling): its device-to-device copy is reported apart.
* **rollback step** (speculative decode): ``truncate_last(4)`` then append 5 positions, then
  ``sync()``: only the rows from the truncation point on move.  Not for the latent cache
  (``truncate_to`` is the same operation).
* **full re-upload**: ``sync(full=True)``, what a mirror without a generation counter pays at
  every step (median of ``--sync-full-repeats``, default 7, quick 3).
* Ratios full / step of bytes and of time, measured in the same run.

Runner section (``--sections runner`` runs it alone; needs torch and transformers)
------------------------------------------------------------------------------
Decode tokens/s of :class:`kvcache.runner.Runner` against transformers' own CPU ``generate``
(``attn_implementation="sdpa"``, its default ``DynamicCache``) on the same random-weight model,
in the same run: a Llama-style decoder of 8 layers, hidden 1024, 16 query / 4 KV heads of 64,
MLP 2816, vocabulary 32000 (float32 weights from ``torch.manual_seed``; about 555 MB read per
token, so a step is a memory-bound pass over the weights plus the cache).

* **Context.**  Prompt lengths 512, 4k and 16k (quick: 512, 4k).  Both caches are filled with
  the same random K/V rows instead of running the prompt through the model (a 16k prefill would
  take minutes on each side and is not what is measured); transformers gets them through
  ``DynamicCache.update``, the runner through ``LayerKvCache.append`` (f32, and q8, which
  quantises them).
* **Decode.**  ``--runner-steps`` greedy steps (default 16, quick 8) on each side, starting
  from the same last token.  Per-token time = median of the step intervals (the runner's
  ``step`` calls; transformers' via a logits processor that stamps each step, the first
  interval, which includes ``generate``'s setup, dropped).  tokens/s = 1 / that median.
* **Attention share.**  The runner times its attention calls (``append`` +
  ``attend_all_heads``); share = attention time / step time over the timed steps.
* **Check.**  The first step's logits of the runner (f32) and of transformers, from the same
  cache and token, must agree (max |diff| printed; a warning above 1e-3).

The workload classes here (:class:`KvcacheDecode`, :class:`TorchDecode`,
:class:`ReferenceDecode`, :class:`AppendFill`, :class:`O1Decode`, :class:`WireLayers`,
:class:`MlaDecode`) are shared with the asv-style suite in ``benchmarks/`` so both measure the
same thing.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import timeit
import zlib
from dataclasses import dataclass

import numpy as np

from . import _core, reference, wire
from .layer import LayerKvCache
from .model import KvCache
from .modes import KvMode

__all__ = [
    "GEOMETRIES",
    "AppendFill",
    "Geometry",
    "KvcacheDecode",
    "MirrorSync",
    "MlaDecode",
    "O1Decode",
    "ReferenceDecode",
    "SyntheticStream",
    "TorchDecode",
    "WireLayers",
    "main",
    "measure_bandwidth",
]

log = logging.getLogger("kvcache.bench")

MiB = 1 << 20
GiB = 1 << 30
DEFAULT_CONTEXTS = (1024, 4096, 16384, 32768)
QUICK_CONTEXTS = (1024, 16384)
APPEND_CONTEXTS = (1024, 32768)
DEFAULT_WORKING_SET = GiB
QUICK_WORKING_SET = 512 * MiB
MAX_LAYERS = 4096            # bounds object count for tiny layers (Qwen q8 at 1k is ~0.27 MiB)
BANDWIDTH_BUFFER = GiB
MODE_NAMES = ("f32", "q8")
SECTIONS = ("decode", "append", "o1", "wire", "mla", "sync", "runner")
O1_CONTEXTS = (1024, 2048, 4096, 8192, 16384, 32768)
QUICK_O1_CONTEXTS = (1024, 4096)
O1_M, O1_W, O1_SINK = 32, 128, 4
O1_ERROR_STEPS = 16
O1_REPEATS, QUICK_O1_REPEATS = 21, 7
O1_BLOCK = 1024              # positions per generated block (data and prompt fill)
O1_FLUSH_BYTES = 256 * MiB   # buffer read before every timed O(1)-section call (cold caches)
O1_DATA = ("clustered", "iid")
O1_TARGETS = {"flatness": 1.2, "speedup_f32": 20.0, "memory_f32": 10.0, "context": 32768}
WIRE_CONTEXT, QUICK_WIRE_CONTEXT = 32768, 4096
WIRE_REPEATS, QUICK_WIRE_REPEATS = 15, 5
WIRE_SAVE_LAYERS = 2         # layers of the KvCache.save / load model
# name -> (format, storage of the exported layer, f16): the export/import pairs of the wire section
WIRE_VARIANTS = {"f32": ("versioned", "f32", False),
                 "f32 no digest": ("versioned", "f32", False),
                 "f32 as f16": ("versioned", "f32", True),
                 "q8": ("versioned", "q8", False),
                 "legacy f32": ("legacy", "f32", False),
                 "legacy f16": ("legacy", "f32", True)}
WIRE_TARGETS = {"export_gbs": 1.0, "import_gbs": 1.0, "checksum_share": 0.25}
# MLA section: DeepSeek-V2-Lite attention geometry
MLA_HEADS, MLA_RANK, MLA_ROPE, MLA_NOPE, MLA_V = 16, 512, 64, 128, 128
MLA_ROPE_SCALING = {"factor": 40, "mscale_all_dim": 0.707}
MLA_CONTEXTS = (1024, 4096, 16384, 32768)
QUICK_MLA_CONTEXTS = (1024, 4096)
MLA_REPEATS, QUICK_MLA_REPEATS = 15, 5
MLA_NAIVE_REPEATS, QUICK_MLA_NAIVE_REPEATS = 3, 2
MLA_NAIVE_MAX_CONTEXT = 32768
MLA_WORKING_SET = 160 * MiB  # at least; 4 x the reported LLC when that is more (capped at 1 GiB)
MLA_MAX_LAYERS = 512
MLA_FMA_ITERS, QUICK_MLA_FMA_ITERS = 10_000_000, 2_000_000
MLA_FMA_PER_PROBE_ITER = 80  # FMAs per thread per fma_probe iteration
MLA_TARGETS = {"context": 16384, "speedup_naive": 10.0, "pct_bandwidth": 60.0}
# sync section: the cost of keeping a kvcache.device.Mirror in step
SYNC_CONTEXT, QUICK_SYNC_CONTEXT = 32768, 4096
SYNC_STEPS, QUICK_SYNC_STEPS = 101, 21
SYNC_FULL_REPEATS, QUICK_SYNC_FULL_REPEATS = 7, 3
SYNC_CASES = ("f32", "q8", "latent")
SYNC_ROLLBACK = (4, 5)       # truncate_last(4), then append 5: one speculative-decode round
# runner section: kvcache.runner vs transformers generate on one random-weight model
RUNNER_CONTEXTS, QUICK_RUNNER_CONTEXTS = (512, 4096, 16384), (512, 4096)
RUNNER_STEPS, QUICK_RUNNER_STEPS = 16, 8
RUNNER_MODEL = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                    num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                    max_position_embeddings=32768)


# ---------------------------------------------------------------------------------------- geometry
@dataclass(frozen=True)
class Geometry:
    """Attention shape of one model layer."""

    key: str
    label: str
    num_heads: int
    num_kv_heads: int
    head_dim: int

    def step_bytes(self, context, mode_name):
        """Bytes of K and V rows (and q8 scales) one decode step reads at ``context`` rows."""
        nkv, hd, t = self.num_kv_heads, self.head_dim, context
        if mode_name == "f32":
            return 2 * nkv * t * hd * 4
        return nkv * t * (hd + 4 * math.ceil(hd / 32)) + nkv * t * (hd + 4)


GEOMETRIES = {g.key: g for g in (Geometry("llama3-8b", "Llama-3-8B", 32, 8, 128),
                                 Geometry("qwen2.5-0.5b", "Qwen2.5-0.5B", 14, 2, 64))}
_GEOMETRY_ALIASES = {"llama": "llama3-8b", "qwen": "qwen2.5-0.5b"}


def make_mode(mode_name):
    """``"f32"`` -> KvMode.F32, ``"q8"`` -> KvMode.Q8()."""
    return KvMode.F32 if mode_name == "f32" else KvMode.Q8()


def random_kv(geom, context, seed=0):
    """K and V rows of shape (context, num_kv_heads, head_dim), float32 standard normal."""
    rng = np.random.default_rng(seed)
    shape = (context, geom.num_kv_heads, geom.head_dim)
    return (rng.standard_normal(shape, dtype=np.float32),
            rng.standard_normal(shape, dtype=np.float32))


def random_query(geom, seed=1):
    """A decode query of shape (num_heads, head_dim), float32."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((geom.num_heads, geom.head_dim), dtype=np.float32)


def layer_count(layer_bytes, working_set, max_layers=MAX_LAYERS):
    """Layers needed so that ``layer_count * layer_bytes >= working_set`` (at least 1)."""
    return max(1, min(max_layers, -(-working_set // max(layer_bytes, 1))))


# ---------------------------------------------------------------------------------------- workloads
class KvcacheDecode:
    """``n_layers`` LayerKvCache layers holding the same rows; a step attends the next layer.

    Parameters
    ----------
    geom : Geometry
    context : int
        Rows per layer.
    mode_name : {"f32", "q8"}
    working_set : int
        Target bytes read by one sweep (sets the number of layers).
    k, v : ndarray of shape (context, num_kv_heads, head_dim), optional
        Rows to store (random when omitted); every layer appends the same arrays.
    """

    def __init__(self, geom, context, mode_name, working_set=DEFAULT_WORKING_SET, k=None, v=None,
                 max_layers=MAX_LAYERS):
        if k is None:
            k, v = random_kv(geom, context)
        self.geom, self.context, self.mode_name = geom, context, mode_name
        self.step_bytes = geom.step_bytes(context, mode_name)
        n = layer_count(self.step_bytes, working_set, max_layers)
        self.layers = [self._layer(k, v) for _ in range(n)]
        self.q = random_query(geom)
        self.out = np.empty((geom.num_heads, geom.head_dim), dtype=np.float32)
        self._next = 0

    def _layer(self, k, v):
        c = LayerKvCache(self.geom.num_kv_heads, self.geom.head_dim, mode=make_mode(self.mode_name))
        c.append(k, v)
        return c

    @property
    def working_set_bytes(self):
        return self.step_bytes * len(self.layers)

    def step(self):
        """One decode step on the next layer of the rotation."""
        self.layers[self._next].attend_all_heads(self.q, out=self.out)
        self._next = (self._next + 1) % len(self.layers)

    def sweep(self):
        """One decode step on every layer, in order (one model-wide decode step)."""
        q, out = self.q, self.out
        for c in self.layers:
            c.attend_all_heads(q, out=out)

    def output(self):
        """The result of the first layer's step (for the accuracy check)."""
        return self.layers[0].attend_all_heads(self.q).copy()


class ReferenceDecode:
    """The NumPy reference on a single layer (slow, so not rotated)."""

    def __init__(self, layer, q):
        self.layer, self.q = layer, q
        self.out = np.empty_like(q)

    def step(self):
        reference.attend_all_heads(self.layer, self.q, out=self.out)

    def output(self):
        return reference.attend_all_heads(self.layer, self.q).copy()


def import_torch():
    """torch and torch.nn.functional, or (None, None) when torch is not installed."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None, None
    return torch, F


def torch_has_gqa(torch, F):
    """Whether this torch's scaled_dot_product_attention accepts ``enable_gqa``."""
    q = torch.zeros(1, 2, 1, 4)
    kv = torch.zeros(1, 1, 1, 4)
    try:
        F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
    except (TypeError, RuntimeError):
        return False
    return True


class TorchDecode:
    """torch SDPA over float32 K/V tensors (1, nkv, T, hd), one copy per layer, rotated.

    Without ``enable_gqa`` support the K/V heads are repeated once at setup (``gqa`` False).
    """

    def __init__(self, geom, context, working_set=DEFAULT_WORKING_SET, k=None, v=None,
                 max_layers=MAX_LAYERS):
        torch, F = import_torch()
        if torch is None:
            raise NotImplementedError("torch is not installed")
        if k is None:
            k, v = random_kv(geom, context)
        self.torch, self.F = torch, F
        self.gqa = torch_has_gqa(torch, F)
        self.step_bytes = geom.step_bytes(context, "f32")
        n = layer_count(self.step_bytes, working_set, max_layers)
        kt = np.ascontiguousarray(k.transpose(1, 0, 2))      # (nkv, T, hd)
        vt = np.ascontiguousarray(v.transpose(1, 0, 2))
        self.kv = [(self._tensor(kt, geom), self._tensor(vt, geom)) for _ in range(n)]
        self.q = torch.from_numpy(random_query(geom)).reshape(1, geom.num_heads, 1, geom.head_dim)
        self._next = 0

    def _tensor(self, rows, geom):
        t = self.torch.from_numpy(rows.copy()).unsqueeze(0)   # (1, nkv, T, hd), own memory
        if not self.gqa:
            t = t.repeat_interleave(geom.num_heads // geom.num_kv_heads, dim=1).contiguous()
        return t

    @property
    def layers(self):
        return self.kv

    @property
    def working_set_bytes(self):
        return self.step_bytes * len(self.kv)

    def _attend(self, k, v):
        if self.gqa:
            return self.F.scaled_dot_product_attention(self.q, k, v, enable_gqa=True)
        return self.F.scaled_dot_product_attention(self.q, k, v)

    def step(self):
        with self.torch.inference_mode():
            self._attend(*self.kv[self._next])
        self._next = (self._next + 1) % len(self.kv)

    def sweep(self):
        with self.torch.inference_mode():
            for k, v in self.kv:
                self._attend(k, v)

    def output(self):
        with self.torch.inference_mode():
            o = self._attend(*self.kv[0])
        return o.reshape(o.shape[1], o.shape[3]).numpy().copy()


class AppendFill:
    """Append cost of a layer: fill 0..T one position at a time, then single appends at T."""

    def __init__(self, geom, context, mode_name="f32", seed=2):
        self.geom, self.context, self.mode_name = geom, context, mode_name
        self.k, self.v = random_kv(geom, context, seed)
        self.layer = None

    def fill(self):
        """A fresh layer filled one ``append(k_row, v_row)`` at a time."""
        c = LayerKvCache(self.geom.num_kv_heads, self.geom.head_dim, mode=make_mode(self.mode_name))
        k, v = self.k, self.v
        for i in range(self.context):
            c.append(k[i], v[i])
        self.layer = c

    def single_appends(self, n):
        """Seconds of ``n`` single appends at T rows, each rolled back (T stays fixed)."""
        c, k, v = self.layer, self.k, self.v
        times = []
        clock = time.perf_counter
        for i in range(n):
            t0 = clock()
            c.append(k[i], v[i])
            times.append(clock() - t0)
            c.truncate_last(1)
        return times


class SyntheticStream:
    """Deterministic (q, k, v) rows of a synthetic sequence, float32, for the O(1) section.

    ``kind`` is ``"clustered"`` (keys around slowly drifting cluster centres, the sequence in
    64-position topic runs, queries correlated with their topic's keys, values around
    per-cluster centres; see the module docstring) or ``"iid"`` (independent standard normal).
    Positions are generated in blocks of ``block`` from a seed per (seed, kind, block index), so
    the rows of a position do not depend on how they are requested: a shorter prompt is a
    prefix of a longer one and ``rows(context, n)`` continues either.
    """

    CLUSTERS = 8            # key clusters per KV head
    RUN = 64                # positions per topic run (one cluster)
    PERIOD = 16384          # positions per turn of a centre's drift
    DRIFT = 0.5             # drift amplitude (centres are N(0, I) + DRIFT * circle)
    KEY_NOISE = 0.5
    QUERY_GAIN = 0.25       # query = QUERY_GAIN * centre + N(0, I)

    def __init__(self, geom, kind="clustered", seed=0, block=O1_BLOCK):
        if kind not in O1_DATA:
            raise ValueError(f"kind: expected one of {O1_DATA}, got {kind!r}")
        if block % self.RUN:
            raise ValueError(f"block must be a multiple of {self.RUN}, got {block}")
        self.geom, self.kind, self.seed, self.block = geom, kind, seed, block
        self._kind_id = O1_DATA.index(kind)
        if kind == "clustered":
            rng = np.random.default_rng([seed, self._kind_id, 0xC1])
            shape = (geom.num_kv_heads, self.CLUSTERS, geom.head_dim)
            self.base = rng.standard_normal(shape, dtype=np.float32)
            self.drift_a = rng.standard_normal(shape, dtype=np.float32) * np.float32(self.DRIFT)
            self.drift_b = rng.standard_normal(shape, dtype=np.float32) * np.float32(self.DRIFT)
            self.phase = rng.uniform(0, 2 * np.pi, self.CLUSTERS)
            self.value_centres = rng.standard_normal(shape, dtype=np.float32)

    def _block(self, b):
        g, n = self.geom, self.block
        nh, nkv, hd = g.num_heads, g.num_kv_heads, g.head_dim
        rng = np.random.default_rng([self.seed, self._kind_id, b])
        if self.kind == "iid":
            return (rng.standard_normal((n, nh, hd), dtype=np.float32),
                    rng.standard_normal((n, nkv, hd), dtype=np.float32),
                    rng.standard_normal((n, nkv, hd), dtype=np.float32))
        z = rng.integers(0, self.CLUSTERS, n // self.RUN).repeat(self.RUN)          # (n,)
        pos = b * n + np.arange(n)
        theta = (2 * np.pi * pos / self.PERIOD + self.phase[z]).astype(np.float32)
        cos, sin = np.cos(theta)[:, None], np.sin(theta)[:, None]
        centre = np.empty((n, nkv, hd), dtype=np.float32)
        for h in range(nkv):
            centre[:, h] = (self.base[h, z] + self.drift_a[h, z] * cos
                            + self.drift_b[h, z] * sin)
        k = centre + np.float32(self.KEY_NOISE) * rng.standard_normal(centre.shape,
                                                                      dtype=np.float32)
        v = self.value_centres[:, z].transpose(1, 0, 2) + rng.standard_normal(
            (n, nkv, hd), dtype=np.float32)
        q = rng.standard_normal((n, nh, hd), dtype=np.float32)
        q += np.float32(self.QUERY_GAIN) * np.repeat(centre, nh // nkv, axis=1)
        return q, k, v

    def rows(self, start, n):
        """q (n, num_heads, head_dim), k and v (n, num_kv_heads, head_dim) of positions
        start .. start + n - 1."""
        parts = []
        b0, b1 = start // self.block, (start + n - 1) // self.block
        for b in range(b0, b1 + 1):
            lo = max(start, b * self.block) - b * self.block
            hi = min(start + n, (b + 1) * self.block) - b * self.block
            blk = self._block(b)
            parts.append(tuple(a[lo:hi] for a in blk) if (lo, hi) != (0, self.block) else blk)
        if len(parts) == 1:
            return parts[0]
        return tuple(np.concatenate(a) for a in zip(*parts))


class O1Decode:
    """A sealed O(1) layer and exact layers holding the same ``context``-position prompt.

    Parameters
    ----------
    geom : Geometry
    context : int
        Prompt positions (sealed into the O(1) state; rows of the exact layers).
    data : {"clustered", "iid"}
        :class:`SyntheticStream` kind.
    exact_modes : sequence of {"f32", "q8"}
        Exact layers to build beside the O(1) one.
    decode_steps : int
        Decode positions after the prompt to keep ready (``self.q/k/v[i]``).
    with_o1 : bool
        False: exact layers only (no query trace, no seal; ``o1`` is None).

    The seal runs in the constructor (``seal_s`` its seconds, at the current OpenMP thread
    count).  :meth:`rollback` puts every layer back to the end of the prompt.
    """

    def __init__(self, geom, context, data="clustered", exact_modes=("f32", "q8"), seed=0,
                 m=O1_M, w=O1_W, sink=O1_SINK, decode_steps=O1_ERROR_STEPS, with_o1=True):
        self.geom, self.context, self.data = geom, context, data
        nkv, nh, hd = geom.num_kv_heads, geom.num_heads, geom.head_dim
        stream = SyntheticStream(geom, data, seed)
        self.o1 = LayerKvCache(nkv, hd, mode=KvMode.F32) if with_o1 else None
        if with_o1:
            self.o1.o1_begin(m, w, sink)
        self.exact = {name: LayerKvCache(nkv, hd, mode=make_mode(name)) for name in exact_modes}
        for start in range(0, context, stream.block):
            q, k, v = stream.rows(start, min(stream.block, context - start))
            if with_o1:
                self.o1.o1_push_q(q)
                self.o1.append(k, v)
            for c in self.exact.values():
                c.append(k, v)
            del q, k, v
        self.seal_s, self.snapshot = None, None
        if with_o1:
            t0 = time.perf_counter()
            if not self.o1.o1_seal(nh):
                raise RuntimeError(f"o1_seal refused a {context}-position prompt (see the log)")
            self.seal_s = time.perf_counter() - t0
            self.snapshot = self.o1.o1_snapshot()
        self.q, self.k, self.v = stream.rows(context, max(1, decode_steps))
        self.out = np.empty((nh, hd), dtype=np.float32)

    def o1_step(self, i=0):
        """One O(1) decode step with decode position ``i``'s (q, k, v); returns the output."""
        return self.o1.o1_step(self.q[i], self.k[i], self.v[i], self.geom.num_heads)

    def exact_step(self, mode_name, i=0):
        """One exact decode step: append position ``i``'s (k, v), attend its q (into ``out``)."""
        c = self.exact[mode_name]
        c.append(self.k[i], self.v[i])
        return c.attend_all_heads(self.q[i], out=self.out)

    def rollback(self):
        """O(1) layer back to its post-seal snapshot, exact layers back to ``context`` rows."""
        if self.o1 is not None:
            self.o1.o1_restore(self.snapshot)
        for c in self.exact.values():
            c.truncate_last(c.seq_len - self.context)

    def errors(self, steps=O1_ERROR_STEPS):
        """Relative L2 error against exact f32 over ``steps`` decode steps (then rolled back):
        ``{"o1": ..., "q8": ...}`` (q8 when that layer exists)."""
        if "f32" not in self.exact:
            raise ValueError("errors() needs an exact f32 layer")
        outs = {name: [] for name in ("o1", *self.exact)}
        for i in range(steps):
            outs["o1"].append(self.o1_step(i))
            for name in self.exact:
                outs[name].append(self.exact_step(name, i).copy())
        self.rollback()
        ref = np.stack(outs.pop("f32")).astype(np.float64)
        norm = max(float(np.linalg.norm(ref)), 1e-30)
        return {name: float(np.linalg.norm(np.stack(o) - ref) / norm)
                for name, o in outs.items()}

    def state_bytes(self):
        return self.o1.memory_bytes()

    def exact_bytes(self, mode_name):
        return self.exact[mode_name].memory_bytes()


class WireLayers:
    """Llama-geometry layers holding the same ``context`` random rows, for the wire section.

    ``layers`` maps ``"f32"`` / ``"q8"`` (the storages in ``storages``) to a filled
    :class:`LayerKvCache`; ``model_layers`` > 0 also builds ``model``, a :class:`KvCache` of that
    many f32 layers holding the same rows (for ``save`` / ``load``).  :meth:`export` and
    :meth:`load` run one variant of :data:`WIRE_VARIANTS` (the timed calls).
    """

    def __init__(self, geom, context, seed=3, storages=("f32", "q8"), model_layers=0):
        self.geom, self.context = geom, context
        nkv, hd = geom.num_kv_heads, geom.head_dim
        k, v = random_kv(geom, context, seed)
        self.layers = {}
        for name in storages:
            c = LayerKvCache(nkv, hd, mode=make_mode(name))
            c.append(k, v)
            self.layers[name] = c
        self.model = None
        if model_layers:
            self.model = KvCache(model_layers, nkv, hd, max_seq_len=max(context, 1),
                                 mode=KvMode.F32)
            for c in self.model.layers:
                c.append(k, v)
        del k, v

    @staticmethod
    def variant(name):
        """(format, storage, f16) of a :data:`WIRE_VARIANTS` name."""
        try:
            return WIRE_VARIANTS[name]
        except KeyError:
            raise ValueError(f"unknown wire variant {name!r}; choose from "
                             f"{', '.join(WIRE_VARIANTS)}") from None

    def layer_bytes(self, name):
        """``memory_bytes()`` of the layer that variant ``name`` exports."""
        return self.layers[self.variant(name)[1]].memory_bytes()

    def model_bytes(self):
        return sum(c.memory_bytes() for c in self.model.layers)

    def export(self, name):
        """The buffer of variant ``name``: ``to_bytes`` or ``export_wire`` of its layer.

        ``"f32 no digest"`` is ``to_bytes()`` under ``kvcache.wire._BENCH_NO_DIGEST`` (a null
        digest: the buffer does not import)."""
        fmt, storage, f16 = self.variant(name)
        layer = self.layers[storage]
        if fmt == "legacy":
            return layer.export_wire(f16=f16)
        if name != "f32 no digest":
            return layer.to_bytes(f16=f16)
        wire._BENCH_NO_DIGEST = True
        try:
            return layer.to_bytes(f16=f16)
        finally:
            wire._BENCH_NO_DIGEST = False

    def target(self):
        """A fresh, empty layer to import into (the mode comes from the buffer)."""
        return LayerKvCache(self.geom.num_kv_heads, self.geom.head_dim, mode=KvMode.F32)

    def load(self, name, target, buf):
        """Install variant ``name``'s buffer into ``target`` (``from_bytes`` / ``import_wire``)."""
        if name == "f32 no digest":
            raise ValueError("a buffer written without its digest does not import")
        if self.variant(name)[0] == "legacy":
            target.import_wire(buf)
        else:
            target.from_bytes(buf)

    def check(self, name, target):
        """Raise AssertionError unless ``target`` holds what variant ``name`` exported."""
        fmt, storage, f16 = self.variant(name)
        src = self.layers[storage]
        if target.seq_len != src.seq_len or target.mode != src.mode:
            raise AssertionError(f"wire {name}: round trip changed seq_len or mode "
                                 f"({target.seq_len}, {target.mode!r})")
        if storage == "q8":
            same = all(np.array_equal(a, b) for h in range(src.num_kv_heads)
                       for a, b in zip(src.q8_rows(h), target.q8_rows(h)))
        else:
            tol = 1e-3 if f16 else 0.0
            same = all(np.allclose(a, b, rtol=tol, atol=tol) for h in (0, src.num_kv_heads - 1)
                       for a, b in ((src.head_keys(h), target.head_keys(h)),
                                    (src.head_values(h), target.head_values(h))))
        if not same:
            raise AssertionError(f"wire {name}: round trip changed the rows")



MLA_ROW_BYTES = (MLA_RANK + MLA_ROPE) * 4                  # latent + k_rope of one cached row
MLA_WEIGHT_BYTES = MLA_HEADS * (MLA_NOPE + MLA_V) * MLA_RANK * 4   # W_UK + W_UV of one layer
MLA_FMA_PER_ROW = MLA_HEADS * (MLA_RANK + MLA_ROPE) + MLA_HEADS * MLA_RANK    # 17408
MLA_FMA_FIXED = MLA_HEADS * (MLA_NOPE + MLA_V) * MLA_RANK   # fold W_UK^T q + unfold W_UV c


def mla_scale():
    """DeepSeek-V2-Lite's softmax scale (``mla_softmax_scale(128, 64, rope_scaling)``)."""
    from .mla import mla_softmax_scale
    return mla_softmax_scale(MLA_NOPE, MLA_ROPE, MLA_ROPE_SCALING)


def mla_cache_bytes_per_token():
    """Cache bytes per token per layer: the MLA latent (slot 0 + slot 1) against a per-head
    cache of the same attention (K of width qk_nope + qk_rope, V of width v_head_dim per head),
    f32 and in kvcache's q8 layout (K: int8 + a float scale per 32 values, V: int8 + one scale
    per row)."""
    k, v = MLA_NOPE + MLA_ROPE, MLA_V
    out = {"latent": MLA_ROW_BYTES,
           "per_head_f32": MLA_HEADS * (k + v) * 4,
           "per_head_q8": MLA_HEADS * ((k + 4 * math.ceil(k / 32)) + (v + 4))}
    out["ratio_f32"] = out["per_head_f32"] / out["latent"]
    out["ratio_q8"] = out["per_head_q8"] / out["latent"]
    return out


class MirrorSync:
    """One layer of ``context`` positions and its :class:`kvcache.device.Mirror`.

    Parameters
    ----------
    case : {"f32", "q8", "latent"}
        Llama-3-8B attention (8 KV heads x 128) stored f32 or q8, or a DeepSeek-V2-Lite latent
        layer (``LatentKvCache`` slots 512 and 64, float32).
    context : int
    backend : {"torch", "numpy"}
        The mirror's backend (on the CPU device).
    spare : int
        Positions appended after the fill (the latent cache's capacity covers them).
    """

    NKV, HD = 8, 128

    def __init__(self, case, context, backend="torch", seed=0, spare=1024):
        from .device import Mirror
        from .latent import LatentKvCache
        self.case = case
        rng = np.random.default_rng([seed, 0x53594E43])
        if case == "latent":
            self.width = [(MLA_RANK,), (MLA_ROPE,)]
            self.cache = LatentKvCache.with_capacity(1, context + spare, self.width)
            for start in range(0, context, 4096):
                n = min(4096, context - start)
                self.cache.write_layer(0, [rng.standard_normal((n,) + w, dtype=np.float32)
                                           for w in self.width])
                self.cache.advance(n)
            self.new = [rng.standard_normal((spare,) + w, dtype=np.float32) for w in self.width]
        else:
            mode = KvMode.F32 if case == "f32" else KvMode.Q8(True, True)
            self.cache = LayerKvCache(self.NKV, self.HD, mode)
            for start in range(0, context, 4096):
                n = min(4096, context - start)
                shape = (n, self.NKV, self.HD)
                self.cache.append(rng.standard_normal(shape, dtype=np.float32),
                                  rng.standard_normal(shape, dtype=np.float32))
            shape = (spare, self.NKV, self.HD)
            self.new = [rng.standard_normal(shape, dtype=np.float32) for _ in range(2)]
        self.used = 0
        self.mirror = Mirror(self.cache, backend=backend)
        self.initial = self.mirror.total

    def append(self, n=1):
        a, self.used = self.used, self.used + n
        if self.case == "latent":
            self.cache.write_layer(0, [x[a: a + n] for x in self.new])
            self.cache.advance(n)
        else:
            self.cache.append(self.new[0][a: a + n], self.new[1][a: a + n])

    def timed_sync(self, full=False):
        t0 = time.perf_counter()
        stats = self.mirror.sync(full=full)
        return time.perf_counter() - t0, stats

    def rollback(self):
        """One speculative-decode round: drop the last drafts, append the next ones."""
        drop, add = SYNC_ROLLBACK
        self.cache.truncate_last(drop)
        self.append(add)


class MlaDecode:
    """A :class:`kvcache.LatentKvCache` of ``n_layers`` MLA layers (DeepSeek-V2-Lite geometry)
    holding ``context`` rows each, with per-layer weights; a step is one query position of one
    layer through the absorbed kernel ``_core.mla_attend``.

    Parameters
    ----------
    context : int
        Cached rows per layer (the cache's capacity too).
    working_set : int
        Target bytes (latent + k_rope rows + W_UK + W_UV) of all layers together; sets the
        layer count (at least ``min_layers``, at most ``max_layers``).
    n_layers : int, optional
        Explicit layer count (overrides ``working_set``).
    """

    def __init__(self, context, working_set=MLA_WORKING_SET, seed=0, n_layers=None,
                 min_layers=2, max_layers=MLA_MAX_LAYERS):
        from .latent import LatentKvCache
        self.context = context
        self.step_bytes = context * MLA_ROW_BYTES
        self.layer_bytes = self.step_bytes + MLA_WEIGHT_BYTES
        if n_layers is None:
            n_layers = max(min_layers, layer_count(self.layer_bytes, working_set, max_layers))
        self.n_layers = n_layers
        self.scale = mla_scale()
        rng = np.random.default_rng([seed, 0x4D4C41])
        lat = rng.standard_normal((context, MLA_RANK), dtype=np.float32)
        kr = rng.standard_normal((context, MLA_ROPE), dtype=np.float32)
        self.cache = LatentKvCache.with_capacity(n_layers, context, [(MLA_RANK,), (MLA_ROPE,)])
        for layer in range(n_layers):
            self.cache.write_layer(layer, [lat, kr])
        self.cache.advance(context)
        del lat, kr
        w = np.float32(MLA_RANK ** -0.5)
        wuk = rng.standard_normal((MLA_HEADS, MLA_NOPE, MLA_RANK), dtype=np.float32) * w
        wuv = rng.standard_normal((MLA_HEADS, MLA_V, MLA_RANK), dtype=np.float32) * w
        self.weights = [(wuk.copy(), wuv.copy()) for _ in range(n_layers)]   # own memory each
        self.views = [(self.cache.slot_storage(layer, 0)[:context],
                       self.cache.slot_storage(layer, 1)[:context]) for layer in range(n_layers)]
        self.qn = rng.standard_normal((1, MLA_HEADS, MLA_NOPE), dtype=np.float32)
        self.qr = rng.standard_normal((1, MLA_HEADS, MLA_ROPE), dtype=np.float32)
        self.out = np.empty((1, MLA_HEADS, MLA_V), dtype=np.float32)
        self._next = 0

    @property
    def working_set_bytes(self):
        return self.layer_bytes * self.n_layers

    def _attend(self, layer, n_threads):
        lat, kr = self.views[layer]
        wuk, wuv = self.weights[layer]
        _core.mla_attend(self.qn, self.qr, lat, kr, wuk, wuv, self.scale, self.out, n_threads)

    def step(self, n_threads=1):
        """One decode step (one query position) on the next layer of the rotation."""
        self._attend(self._next, n_threads)
        self._next = (self._next + 1) % self.n_layers

    def sweep(self, n_threads=1):
        """One decode step on every layer, in order."""
        for layer in range(self.n_layers):
            self._attend(layer, n_threads)

    def output(self, n_threads=1, layer=0):
        """The kernel's (1, H, d_v) result on ``layer`` (a copy)."""
        self._attend(layer, n_threads)
        return self.out.copy()

    def naive(self, layer=0):
        """``reference.mla_naive`` on ``layer``: (1, H, d_v)."""
        lat, kr = self.views[layer]
        wuk, wuv = self.weights[layer]
        return reference.mla_naive(self.qn, self.qr, lat, kr, wuk, wuv, self.scale)


# ---------------------------------------------------------------------------------------- timing
def time_repeats(fn, repeats, warmup=1):
    """Seconds of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones (gc off, timeit)."""
    for _ in range(warmup):
        fn()
    return timeit.Timer(fn).repeat(repeat=repeats, number=1)


def omp_threads(n):
    """kvcache's OpenMP thread count limited to ``n``."""
    from threadpoolctl import threadpool_limits
    return threadpool_limits(n, user_api="openmp")


def numpy_threads(n):
    """Every thread pool (BLAS included) limited to ``n``: for the NumPy reference."""
    from threadpoolctl import threadpool_limits
    return threadpool_limits(n)


@contextlib.contextmanager
def torch_threads(torch, n):
    """torch's intra-op thread count set to ``n``, restored on exit."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def measure_bandwidth(thread_counts, nbytes=BANDWIDTH_BUFFER, repeats=5):
    """Read bandwidth (GB/s) of ``_core.stream_read`` over an ``nbytes`` buffer per thread count.

    Returns ``{n: {"best_gbs", "median_gbs", "samples_s"}}``; "best" is the figure used.
    """
    buf = np.ones(nbytes // 4, dtype=np.float32)            # pages touched: not lazily zero
    result = {}
    for n in thread_counts:
        samples = time_repeats(lambda n=n: _core.stream_read(buf, n), repeats)
        result[n] = {"best_gbs": buf.nbytes / min(samples) / 1e9,
                     "median_gbs": buf.nbytes / statistics.median(samples) / 1e9,
                     "buffer_bytes": buf.nbytes, "samples_s": samples}
    return result


def median_ms(samples, per=1):
    """Median of ``samples`` (seconds, each covering ``per`` steps) in ms per step."""
    return statistics.median(samples) / per * 1e3


# ---------------------------------------------------------------------------------------- runs
@dataclass
class Options:
    """Resolved command-line settings."""

    geometries: list
    contexts: list
    modes: list
    threads: list
    repeats: int
    ref_repeats: int
    working_set: int
    torch: bool
    reference: bool
    append: bool
    append_repeats: int
    seed: int
    decode: bool = True
    o1: bool = True
    o1_contexts: tuple = O1_CONTEXTS
    o1_repeats: int = O1_REPEATS
    wire: bool = True
    wire_context: int = WIRE_CONTEXT
    wire_repeats: int = WIRE_REPEATS
    wire_save_layers: int = WIRE_SAVE_LAYERS
    mla: bool = True
    mla_contexts: tuple = MLA_CONTEXTS
    mla_repeats: int = MLA_REPEATS
    mla_naive_repeats: int = MLA_NAIVE_REPEATS
    mla_naive_max_context: int = MLA_NAIVE_MAX_CONTEXT
    mla_working_set: int = MLA_WORKING_SET
    mla_fma_iters: int = MLA_FMA_ITERS
    bandwidth_bytes: int = BANDWIDTH_BUFFER
    sync: bool = True
    sync_context: int = SYNC_CONTEXT
    sync_steps: int = SYNC_STEPS
    sync_full_repeats: int = SYNC_FULL_REPEATS
    sync_backend: str = "torch"
    runner: bool = True
    runner_contexts: tuple = RUNNER_CONTEXTS
    runner_steps: int = RUNNER_STEPS


def run_torch(geom, context, k, v, opts, rec):
    """Time torch SDPA per thread count; fills ``rec[n]`` and returns the first layer's output."""
    work = TorchDecode(geom, context, opts.working_set, k, v)
    rec["gqa"] = work.gqa
    rec["layers"] = len(work.kv)
    for n in opts.threads:
        with torch_threads(work.torch, n):
            rec[n] = time_repeats(work.sweep, opts.repeats)
    out = work.output()
    del work
    gc.collect()
    return out


def run_kvcache(geom, context, mode_name, k, v, opts):
    """Time kvcache (rotated) and the reference (one layer) for one mode; returns a record."""
    work = KvcacheDecode(geom, context, mode_name, opts.working_set, k, v)
    rec = {"layers": len(work.layers), "kv": {}, "ref": {}}
    for n in opts.threads:
        with omp_threads(n):
            rec["kv"][n] = time_repeats(work.sweep, opts.repeats)
    out = work.output()
    if opts.reference:
        ref = ReferenceDecode(work.layers[0], work.q)
        for n in opts.threads:
            with numpy_threads(n):
                rec["ref"][n] = time_repeats(ref.step, opts.ref_repeats)
        rec["err_ref"] = relative_error(out, ref.output())
    rec["out"] = out
    del work
    gc.collect()
    return rec


def relative_error(a, b):
    """max |a - b| / max(max |b|, 1e-30)."""
    return float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30))


def run_context(geom, context, opts, bandwidth, bar):
    """Every mode and thread count at one (geometry, context); returns result rows."""
    k, v = random_kv(geom, context, opts.seed)
    torch_rec, torch_out = {}, None
    if opts.torch:
        bar.set_postfix_str(f"{geom.label} {context} torch")
        torch_out = run_torch(geom, context, k, v, opts, torch_rec)
        bar.update()
    recs = {}
    for mode_name in opts.modes:
        bar.set_postfix_str(f"{geom.label} {context} {mode_name}")
        recs[mode_name] = run_kvcache(geom, context, mode_name, k, v, opts)
        bar.update()
    del k, v
    return [make_row(geom, context, m, n, recs, torch_rec, torch_out, bandwidth)
            for m in opts.modes for n in opts.threads]


def make_row(geom, context, mode_name, n, recs, torch_rec, torch_out, bandwidth):
    """One table row: timings (median ms per step), GB/s, % bandwidth and speedups."""
    rec = recs[mode_name]
    step_bytes = geom.step_bytes(context, mode_name)
    kv_ms = median_ms(rec["kv"][n], rec["layers"])
    row = {"geometry": geom.label, "context": context, "mode": mode_name, "threads": n,
           "layers": rec["layers"], "step_bytes": step_bytes,
           "working_set_bytes": step_bytes * rec["layers"],
           "kvcache_ms": kv_ms, "kvcache_samples_s": rec["kv"][n],
           "kvcache_gbs": step_bytes / kv_ms / 1e6,
           "bandwidth_gbs": bandwidth[n]["best_gbs"]}
    row["pct_bandwidth"] = 100.0 * row["kvcache_gbs"] / row["bandwidth_gbs"]
    if n in rec["ref"]:
        row["reference_ms"] = median_ms(rec["ref"][n])
        row["reference_samples_s"] = rec["ref"][n]
        row["speedup_vs_reference"] = row["reference_ms"] / kv_ms
        row["rel_err_vs_reference"] = rec["err_ref"]
    if n in torch_rec:
        t_ms = median_ms(torch_rec[n], torch_rec["layers"])
        row.update(torch_f32_ms=t_ms, torch_samples_s=torch_rec[n], torch_gqa=torch_rec["gqa"],
                   torch_layers=torch_rec["layers"],
                   torch_gbs=geom.step_bytes(context, "f32") / t_ms / 1e6,
                   speedup_vs_torch_f32=t_ms / kv_ms)
        if mode_name == "f32":
            row["rel_err_vs_torch"] = relative_error(rec["out"], torch_out)
    if mode_name != "f32" and "f32" in recs:
        row["speedup_vs_f32"] = median_ms(recs["f32"]["kv"][n], recs["f32"]["layers"]) / kv_ms
    return row


def run_append(opts, bar):
    """Append-cost rows for the Llama geometry, f32, at 1k and 32k."""
    geom = GEOMETRIES["llama3-8b"]
    rows = []
    for context in APPEND_CONTEXTS:
        bar.set_postfix_str(f"append {context}")
        work = AppendFill(geom, context, "f32", seed=opts.seed + 2)
        fill_s = timeit.Timer(work.fill).timeit(number=1)
        singles = work.single_appends(opts.append_repeats)
        rows.append({"geometry": geom.label, "mode": "f32", "context": context,
                     "fill_s": fill_s, "amortised_us": fill_s / context * 1e6,
                     "single_median_us": statistics.median(singles) * 1e6,
                     "single_max_us": max(singles) * 1e6, "single_samples_s": singles})
        del work
        gc.collect()
        bar.update()
    return rows


def o1_round_robin(work, n_threads, repeats, flush_buf, flush_threads):
    """Interleaved step timings (seconds) at ``n_threads``: per repeat, after a rollback, a cold
    O(1) step, a warm O(1) step, then one cold exact step per exact layer (each exact step's
    truncate_last(1) untimed).  One untimed warm-up round first.  Returns {name: [s, ...]}."""
    clock = time.perf_counter
    names = ("o1", "o1_warm", *work.exact)
    samples = {name: [] for name in names}
    gc_was_on = gc.isenabled()
    gc.disable()
    try:
        with omp_threads(n_threads):
            for r in range(repeats + 1):
                work.rollback()
                _core.stream_read(flush_buf, flush_threads)
                t0 = clock()
                work.o1_step()
                t1 = clock()
                work.o1_step()
                t2 = clock()
                got = {"o1": t1 - t0, "o1_warm": t2 - t1}
                for name, c in work.exact.items():
                    _core.stream_read(flush_buf, flush_threads)
                    t0 = clock()
                    work.exact_step(name)
                    got[name] = clock() - t0
                    c.truncate_last(1)
                if r:                                        # round 0 is the warm-up
                    for name in names:
                        samples[name].append(got[name])
            work.rollback()
    finally:
        if gc_was_on:
            gc.enable()
    return samples


def run_o1_context(context, opts, flush_buf, bar):
    """O(1) rows (one per thread count) at one context: iid error first (its layers freed),
    then the clustered layers for the error, the memory and the round-robin timings."""
    geom = GEOMETRIES["llama3-8b"]
    top = max(opts.threads)
    with omp_threads(top):
        bar.set_postfix_str(f"o1 {context_label(context)} iid")
        work = O1Decode(geom, context, "iid", exact_modes=("f32",), seed=opts.seed)
        err_iid = work.errors(O1_ERROR_STEPS)["o1"]
        del work
        gc.collect()
        bar.set_postfix_str(f"o1 {context_label(context)} clustered")
        work = O1Decode(geom, context, "clustered", exact_modes=("f32", "q8"), seed=opts.seed)
        err = work.errors(O1_ERROR_STEPS)
    base = {"geometry": geom.label, "context": context, "m": O1_M, "w": O1_W, "sink": O1_SINK,
            "seal_threads": top, "seal_s": work.seal_s,
            "state_bytes": work.state_bytes(), "o1_memory_bytes": work.o1.o1_memory_bytes(),
            "f32_bytes": work.exact_bytes("f32"), "q8_bytes": work.exact_bytes("q8"),
            "rel_err_clustered": err["o1"], "rel_err_iid": err_iid,
            "rel_err_q8_clustered": err["q8"], "error_steps": O1_ERROR_STEPS}
    base["memory_ratio_f32"] = base["f32_bytes"] / base["state_bytes"]
    base["memory_ratio_q8"] = base["q8_bytes"] / base["state_bytes"]
    rows = []
    for n in opts.threads:
        bar.set_postfix_str(f"o1 {context_label(context)} {n}t")
        samples = o1_round_robin(work, n, opts.o1_repeats, flush_buf, top)
        row = dict(base, threads=n, repeats=opts.o1_repeats,
                   o1_ms=median_ms(samples["o1"]), o1_warm_ms=median_ms(samples["o1_warm"]),
                   f32_ms=median_ms(samples["f32"]), q8_ms=median_ms(samples["q8"]),
                   samples_s=samples)
        row["speedup_vs_f32"] = row["f32_ms"] / row["o1_ms"]
        row["speedup_vs_q8"] = row["q8_ms"] / row["o1_ms"]
        rows.append(row)
    del work
    gc.collect()
    bar.update()
    return rows


def run_o1(opts, bar):
    """The O(1) section: rows for every O(1) context and thread count, one context at a time."""
    flush_buf = np.ones(O1_FLUSH_BYTES // 4, dtype=np.float32)    # pages touched
    rows = []
    t0 = time.perf_counter()
    for context in opts.o1_contexts:
        rows += run_o1_context(context, opts, flush_buf, bar)
    return rows, time.perf_counter() - t0


def wire_digest_functions():
    """{name: (function, library description)} of the raw digest functions the wire section
    times: ``xxhash.xxh3_64_intdigest`` and ``crc32c.crc32c`` when those packages are installed,
    ``zlib.crc32`` always."""
    fns = {}
    try:
        import xxhash
    except ImportError:
        xxhash = None
    if xxhash is not None:
        fns["xxhash.xxh3_64_intdigest"] = (xxhash.xxh3_64_intdigest,
                                           f"xxhash {_package_version('xxhash')}")
    fns["zlib.crc32"] = (zlib.crc32, f"zlib {zlib.ZLIB_RUNTIME_VERSION}")
    try:
        import crc32c
    except ImportError:
        crc32c = None
    if crc32c is not None:
        hw = getattr(crc32c, "hardware_based", None)
        how = "" if hw is None else (", hardware" if hw else ", software")
        fns["crc32c.crc32c"] = (crc32c.crc32c, f"crc32c {_package_version('crc32c')}{how}")
    return fns


def _package_version(name):
    try:
        from importlib.metadata import version
        return version(name)
    except Exception:                                        # noqa: BLE001 (metadata missing)
        return "?"


def filesystem_type(path):
    """Type of the filesystem holding ``path`` (Linux /proc/mounts; None when unknown)."""
    path = os.path.realpath(path)
    best = ("", None)
    try:
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                inside = path == mnt or path.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best[0]):
                    best = (mnt, parts[2])
    except OSError:
        return None
    return best[1]


WIRE_SAVE_LOAD = "KvCache save/load"


def wire_round_robin(work, repeats, path, digests, bar=None):
    """Interleaved wire timings (seconds).  Per repeat: every :data:`WIRE_VARIANTS` entry
    exports once and (except the null-digest one) imports that buffer into a fresh layer,
    the f32 buffer is also hashed by every function of ``digests``, then the buffer is dropped;
    ``work.model`` (when built) is saved to ``path`` and loaded.  Odd repeats run in reverse
    order.  One untimed warm-up round first, which also checks every round trip.

    Returns ``(samples, sizes)``: ``{"<variant> export" | "<variant> import" | "save" | "load"
    | "digest <name>": [s, ...]}`` and ``{variant | "save": buffer or file bytes}``."""
    clock = time.perf_counter
    order = list(WIRE_VARIANTS) + ([WIRE_SAVE_LOAD] if work.model is not None else [])
    samples, sizes = {}, {}
    gc_was_on = gc.isenabled()
    gc.disable()
    try:
        for r in range(repeats + 1):
            got = {}
            for name in (order if r % 2 == 0 else order[::-1]):
                if name == WIRE_SAVE_LOAD:
                    t0 = clock()
                    work.model.save(path)
                    got["save"] = clock() - t0
                    sizes["save"] = os.path.getsize(path)
                    t0 = clock()
                    loaded = KvCache.load(path)
                    got["load"] = clock() - t0
                    if r == 0 and ([c.seq_len for c in loaded.layers]
                                   != [c.seq_len for c in work.model.layers]):
                        raise AssertionError("wire: KvCache.load did not restore the model")
                    del loaded
                    gc.collect()
                    continue
                t0 = clock()
                buf = work.export(name)
                got[f"{name} export"] = clock() - t0
                sizes[name] = len(buf)
                if name != "f32 no digest":
                    target = work.target()
                    t0 = clock()
                    work.load(name, target, buf)
                    got[f"{name} import"] = clock() - t0
                    if r == 0:
                        work.check(name, target)
                    del target
                if name == "f32":
                    for d, fn in digests.items():
                        t0 = clock()
                        fn(buf)
                        got[f"digest {d}"] = clock() - t0
                del buf
                gc.collect()
            if r:                                            # round 0 is the warm-up
                for key, t in got.items():
                    samples.setdefault(key, []).append(t)
            if bar is not None:
                bar.update()
    finally:
        if gc_was_on:
            gc.enable()
    return samples, sizes


def _timing(samples, nbytes):
    """median / best ms and GB/s of ``nbytes`` per call."""
    med, best = statistics.median(samples), min(samples)
    return {"ms": med * 1e3, "best_ms": best * 1e3, "gbs": nbytes / med / 1e9,
            "best_gbs": nbytes / best / 1e9, "samples_s": samples}


def _wire_call(fmt):
    return {"versioned": "to_bytes/from_bytes", "legacy": "export_wire/import_wire"}[fmt]


def wire_rows(work, samples, sizes):
    """Table rows of the wire section (one per variant, then save/load)."""
    rows = []
    for name, (fmt, storage, f16) in WIRE_VARIANTS.items():
        nbytes = work.layer_bytes(name)
        call = "to_bytes, null digest" if name == "f32 no digest" else _wire_call(fmt)
        row = {"variant": name, "call": call, "format": fmt, "storage": storage, "f16": f16,
               "rows": f"{storage} -> f16" if f16 else storage,
               "layer_bytes": nbytes, "buffer_bytes": sizes[name]}
        for op in ("export", "import"):
            key = f"{name} {op}"
            if key in samples:
                row.update({f"{op}_{k}": v for k, v in _timing(samples[key], nbytes).items()})
        rows.append(row)
    if "save" in samples:
        nbytes = work.model_bytes()
        row = {"variant": WIRE_SAVE_LOAD, "call": "KvCache.save/load", "format": "versioned file",
               "storage": "f32", "f16": False, "rows": f"{len(work.model.layers)} x f32",
               "layer_bytes": nbytes, "buffer_bytes": sizes["save"]}
        for op, key in (("export", "save"), ("import", "load")):
            row.update({f"{op}_{k}": v for k, v in _timing(samples[key], nbytes).items()})
        rows.append(row)
    return rows


def wire_digest_rows(samples, digests, nbytes):
    """Rows of the raw digest functions, each over the ``nbytes`` f32 export buffer."""
    in_use = {wire.ALG_XXH3: "xxhash.xxh3_64_intdigest",
              wire.ALG_CRC32: "zlib.crc32"}[wire.default_algorithm()]
    rows = []
    for name, (_, library) in digests.items():
        row = {"function": name, "library": library, "bytes": nbytes, "in_use": name == in_use}
        row.update(_timing(samples[f"digest {name}"], nbytes))
        rows.append(row)
    return rows


def wire_summary(rows, samples, context):
    """The checksum share and the issue's targets, from the rows of one run."""
    by = {r["variant"]: r for r in rows}
    d, nd = samples["f32 export"], samples["f32 no digest export"]
    alg = wire.default_algorithm()
    s = {"context": context, "algorithm": alg,
         "algorithm_name": {wire.ALG_XXH3: "XXH3-64 (xxhash)",
                            wire.ALG_CRC32: "CRC-32 (zlib)"}.get(alg, str(alg)),
         "checksum_share": 1.0 - statistics.median(nd) / statistics.median(d),
         "checksum_share_best": 1.0 - min(nd) / min(d),
         "checksum_share_paired": statistics.median(1.0 - b / a for a, b in zip(d, nd)),
         "export_gbs": by["f32"]["export_gbs"], "import_gbs": by["f32"]["import_gbs"]}
    s["export_pass"] = s["export_gbs"] >= WIRE_TARGETS["export_gbs"]
    s["import_pass"] = s["import_gbs"] >= WIRE_TARGETS["import_gbs"]
    s["checksum_pass"] = s["checksum_share"] <= WIRE_TARGETS["checksum_share"]
    return s


def run_wire(opts, bar):
    """The wire section: export/import of every byte format, the checksum's cost, the raw
    digest functions and KvCache save/load, one round-robin at ``opts.wire_context``."""
    geom = GEOMETRIES["llama3-8b"]
    t0 = time.perf_counter()
    bar.set_postfix_str(f"wire {context_label(opts.wire_context)} setup")
    work = WireLayers(geom, opts.wire_context, seed=opts.seed + 3,
                      model_layers=opts.wire_save_layers)
    bar.update()
    digests = wire_digest_functions()
    bar.set_postfix_str(f"wire {context_label(opts.wire_context)}")
    with tempfile.TemporaryDirectory(prefix="kvcache-bench-wire-") as folder:
        samples, sizes = wire_round_robin(work, opts.wire_repeats,
                                          os.path.join(folder, "model.kvcache"),
                                          {k: f for k, (f, _) in digests.items()}, bar)
        fs = filesystem_type(folder)
    rows = wire_rows(work, samples, sizes)
    result = {"geometry": geom.label, "context": opts.wire_context,
              "repeats": opts.wire_repeats, "save_layers": opts.wire_save_layers,
              "folder": os.path.dirname(folder), "filesystem": fs, "rows": rows,
              "digests": wire_digest_rows(samples, digests, sizes["f32"]),
              "digests_missing": [n for n in ("xxhash", "crc32c") if not any(
                  k.startswith(n) for k in digests)],
              "summary": wire_summary(rows, samples, opts.wire_context)}
    del work
    gc.collect()
    result["section_s"] = time.perf_counter() - t0
    return result


def measure_fma_peak(thread_counts, iters=MLA_FMA_ITERS, repeats=5):
    """Peak float32 FMA rate (GFMA/s) of ``_core.fma_probe`` per thread count.

    ``fma_probe(iters, n)`` runs ``iters`` x 80 FMAs (independent chains) on each of ``n``
    threads.  Returns ``{n: {"best_gfmas", "median_gfmas", "iters", "samples_s"}}``; "best" is
    the figure used (the peak)."""
    result = {}
    for n in thread_counts:
        fmas = iters * MLA_FMA_PER_PROBE_ITER * n
        with omp_threads(n):
            samples = time_repeats(lambda n=n: _core.fma_probe(iters, n), repeats)
        result[n] = {"best_gfmas": fmas / min(samples) / 1e9,
                     "median_gfmas": fmas / statistics.median(samples) / 1e9,
                     "iters": iters, "samples_s": samples}
    return result


def run_mla_context(context, opts, bandwidth, fma, bar):
    """MLA rows (one per thread count) at one context: the kernel over a rotating working set
    of latent layers, the naive NumPy form on one layer, their agreement."""
    label = context_label(context)
    bar.set_postfix_str(f"mla {label} setup")
    work = MlaDecode(context, opts.mla_working_set, seed=opts.seed)
    kern = {}
    for n in opts.threads:
        bar.set_postfix_str(f"mla {label} kernel {n}t")
        with omp_threads(n):
            kern[n] = time_repeats(lambda n=n: work.sweep(n), opts.mla_repeats)
    top = max(opts.threads)
    with omp_threads(top):
        out = work.output(top)
    naive, err, naive_out = {}, None, [None]
    run_naive = opts.reference and context <= opts.mla_naive_max_context

    def naive_step():
        naive_out[0] = work.naive()

    if run_naive:
        for n in opts.threads:
            bar.set_postfix_str(f"mla {label} naive {n}t")
            with numpy_threads(n):
                naive[n] = time_repeats(naive_step, opts.mla_naive_repeats)
        err = relative_error(out, naive_out[0])
    rows = []
    for n in opts.threads:
        kernel_s = statistics.median(kern[n]) / work.n_layers
        bw, peak = bandwidth[n]["best_gbs"], fma[n]["best_gfmas"]
        fmas = context * MLA_FMA_PER_ROW + MLA_FMA_FIXED
        row = {"geometry": "DeepSeek-V2-Lite MLA", "context": context, "threads": n,
               "layers": work.n_layers, "step_bytes": work.step_bytes,
               "weight_bytes": MLA_WEIGHT_BYTES, "layer_bytes": work.layer_bytes,
               "working_set_bytes": work.working_set_bytes, "repeats": opts.mla_repeats,
               "kernel_ms": kernel_s * 1e3, "kernel_samples_s": kern[n],
               "latent_gbs": work.step_bytes / kernel_s / 1e9,
               "all_gbs": work.layer_bytes / kernel_s / 1e9,
               "bandwidth_gbs": bw, "fmas_per_step": fmas,
               "kernel_gfmas": fmas / kernel_s / 1e9, "peak_gfmas": peak,
               "fma_ceiling_gbs": peak / MLA_FMA_PER_ROW * MLA_ROW_BYTES}
        row["pct_bandwidth"] = 100.0 * row["latent_gbs"] / bw
        row["pct_bandwidth_all"] = 100.0 * row["all_gbs"] / bw
        row["pct_peak_fma"] = 100.0 * row["kernel_gfmas"] / peak
        row["fma_ceiling_pct_bandwidth"] = 100.0 * row["fma_ceiling_gbs"] / bw
        if n in naive:
            row.update(naive_ms=median_ms(naive[n]), naive_samples_s=naive[n],
                       naive_repeats=opts.mla_naive_repeats, rel_err_vs_naive=err)
            row["speedup_vs_naive"] = row["naive_ms"] / row["kernel_ms"]
        rows.append(row)
    del work, naive_out
    gc.collect()
    bar.update()
    return rows


def mla_summary(rows):
    """The issue's MLA targets from the rows of one run, judged at the largest thread count
    and 16k (None: not judged -- no 16k row, or no naive timing there)."""
    top = max(r["threads"] for r in rows)
    mine = sorted((r for r in rows if r["threads"] == top), key=lambda r: r["context"])
    at = next((r for r in mine if r["context"] == MLA_TARGETS["context"]), mine[-1])
    judged = at["context"] == MLA_TARGETS["context"]
    s = {"threads": top, "target_context": at["context"],
         "speedup_vs_naive": at.get("speedup_vs_naive"), "kernel_ms": at["kernel_ms"],
         "naive_ms": at.get("naive_ms"), "latent_gbs": at["latent_gbs"],
         "bandwidth_gbs": at["bandwidth_gbs"], "pct_bandwidth": at["pct_bandwidth"],
         "peak_gfmas": at["peak_gfmas"], "kernel_gfmas": at["kernel_gfmas"],
         "pct_peak_fma": at["pct_peak_fma"], "fma_ceiling_gbs": at["fma_ceiling_gbs"],
         "fma_ceiling_pct_bandwidth": at["fma_ceiling_pct_bandwidth"]}
    s["speedup_pass"] = (s["speedup_vs_naive"] >= MLA_TARGETS["speedup_naive"]
                         if judged and s["speedup_vs_naive"] is not None else None)
    s["bandwidth_pass"] = (s["pct_bandwidth"] >= MLA_TARGETS["pct_bandwidth"]) if judged else None
    s["bandwidth_target_above_fma_ceiling"] = (MLA_TARGETS["pct_bandwidth"]
                                               > s["fma_ceiling_pct_bandwidth"])
    return s


def run_mla(opts, bandwidth, bar):
    """The MLA section: the FMA probe, then every context of ``opts.mla_contexts``."""
    t0 = time.perf_counter()
    bar.set_postfix_str("mla FMA probe")
    fma = measure_fma_peak(opts.threads, opts.mla_fma_iters)
    bar.update()
    rows = []
    for context in opts.mla_contexts:
        rows += run_mla_context(context, opts, bandwidth, fma, bar)
    return {"geometry": "DeepSeek-V2-Lite", "heads": MLA_HEADS, "kv_lora_rank": MLA_RANK,
            "qk_rope_head_dim": MLA_ROPE, "qk_nope_head_dim": MLA_NOPE, "v_head_dim": MLA_V,
            "rope_scaling": MLA_ROPE_SCALING, "scale": mla_scale(),
            "contexts": list(opts.mla_contexts), "repeats": opts.mla_repeats,
            "naive_repeats": opts.mla_naive_repeats,
            "naive_max_context": opts.mla_naive_max_context if opts.reference else None,
            "working_set_target_bytes": opts.mla_working_set,
            "fma_per_row": MLA_FMA_PER_ROW, "fma_fixed": MLA_FMA_FIXED,
            "row_bytes": MLA_ROW_BYTES, "weight_bytes": MLA_WEIGHT_BYTES,
            "fma_peak": {n: v for n, v in fma.items()},
            "memory": mla_cache_bytes_per_token(), "rows": rows, "summary": mla_summary(rows),
            "section_s": time.perf_counter() - t0}


def run_sync_case(case, opts):
    """Median decode-step, rollback-step and full re-upload costs of one mirrored layer."""
    steps, fulls = opts.sync_steps, opts.sync_full_repeats
    work = MirrorSync(case, opts.sync_context, opts.sync_backend, opts.seed,
                      spare=steps + 2 + (steps * SYNC_ROLLBACK[1] if case != "latent" else 0))
    step_s, step_b, growth = [], [], []
    for _ in range(steps):
        work.append(1)
        t, st = work.timed_sync()
        if st.device_bytes:                 # the one step that doubled the device capacity
            growth.append({"ms": 1e3 * t, "device_bytes": st.device_bytes, "bytes": st.bytes})
            continue
        step_s.append(t)
        step_b.append(st.bytes)
    rec = {"case": case, "context": opts.sync_context, "backend": opts.sync_backend,
           "device": str(work.mirror.device), "initial_bytes": work.initial.bytes,
           "step_ms": 1e3 * statistics.median(step_s), "step_bytes": statistics.median(step_b),
           "step_samples_s": step_s, "growth": growth, "capacity": work.mirror.capacity}
    if case != "latent":
        roll_s, roll_b = [], []
        for _ in range(steps):
            work.rollback()
            t, st = work.timed_sync()
            if not st.device_bytes:
                roll_s.append(t)
                roll_b.append(st.bytes)
        rec.update(rollback_ms=1e3 * statistics.median(roll_s),
                   rollback_bytes=statistics.median(roll_b))
    full_s, full_b = [], []
    for _ in range(fulls):
        t, st = work.timed_sync(full=True)
        full_s.append(t)
        full_b.append(st.bytes)
    rec.update(full_ms=1e3 * statistics.median(full_s), full_bytes=statistics.median(full_b),
               full_samples_s=full_s, context_at_end=work.cache.seq_len if case != "latent"
               else work.cache.cached_len)
    rec["bytes_ratio"] = rec["full_bytes"] / rec["step_bytes"] if rec["step_bytes"] else None
    rec["time_ratio"] = rec["full_ms"] / rec["step_ms"] if rec["step_ms"] else None
    del work
    gc.collect()
    return rec


def run_sync(opts, bar):
    rows = []
    for case in SYNC_CASES:
        bar.set_postfix_str(f"sync {case}")
        rows.append(run_sync_case(case, opts))
        bar.update()
    return rows


def sync_table(rows):
    body = []
    for r in rows:
        roll = r.get("rollback_bytes")
        body.append([r["case"], context_label(r["context"]), f"{r['backend']}:{r['device']}",
                     f"{r['step_bytes'] / 1024:.3g}", fmt(r["step_ms"]),
                     "-" if roll is None else f"{roll / 1024:.3g}",
                     fmt(r.get("rollback_ms")), f"{r['full_bytes'] / MiB:.4g}",
                     fmt(r["full_ms"]), fmt_ratio(r["bytes_ratio"]), fmt_ratio(r["time_ratio"])])
    return render_table(["layer", "ctx", "mirror", "step KiB", "step ms", "rollback KiB",
                         "rollback ms", "full MiB", "full ms", "bytes full/step",
                         "time full/step"], body)


def sync_notes(rows, opts):
    out = [f"medians of {opts.sync_steps} steps / {opts.sync_full_repeats} full re-uploads; "
           f"a step appends one position and syncs; a rollback step is truncate_last"
           f"({SYNC_ROLLBACK[0]}) + append {SYNC_ROLLBACK[1]} + sync"]
    for r in rows:
        for g in r["growth"]:
            out.append(f"{r['case']}: one step grew the device capacity (doubling): "
                       f"{g['device_bytes'] / MiB:.4g} MiB copied device-to-device in "
                       f"{fmt(g['ms'])} ms (not in the step median)")
    if opts.sync_backend == "torch":
        out.append("the torch 'device' here is the CPU: a sync is a host memory copy; on a GPU "
                   "the same bytes cross the bus")
    return out


class RunnerVsTransformers:
    """One random-weight Llama-style model in transformers and in :class:`kvcache.runner.Runner`
    (the same float32 weights), with caches filled to a context of the same random K/V rows.

    Parameters
    ----------
    model_kwargs : dict, optional
        ``transformers.LlamaConfig`` arguments (default ``RUNNER_MODEL``).
    """

    def __init__(self, model_kwargs=None, seed=0):
        import torch
        import transformers
        from .runner import ModelConfig, Runner
        self.torch = torch
        torch.manual_seed(seed)
        cfg = transformers.LlamaConfig(**(model_kwargs or RUNNER_MODEL))
        cfg._attn_implementation = "sdpa"
        self.model = transformers.LlamaForCausalLM(cfg).eval()
        self.model.generation_config.eos_token_id = None
        self.cfg = cfg
        self._weights = {k: v.detach().numpy() for k, v in self.model.state_dict().items()}
        self.rcfg = ModelConfig.from_hf(cfg.to_dict())
        self._Runner = Runner
        self.nkv = cfg.num_key_value_heads
        self.hd = self.rcfg.head_dim
        self.seed = seed

    def kv_rows(self, context):
        rng = np.random.default_rng([self.seed, context])
        shape = (context, self.nkv, self.hd)
        return [(rng.standard_normal(shape, dtype=np.float32),
                 rng.standard_normal(shape, dtype=np.float32))
                for _ in range(self.cfg.num_hidden_layers)]

    def runner(self, rows, kv):
        context = rows[0][0].shape[0]
        r = self._Runner(self.rcfg, self._weights, kv=kv, max_seq_len=context + 4096)
        for layer, (k, v) in zip(r.cache.layers, rows):
            layer.append(k, v)
        r.position = context
        return r

    def time_runner(self, rows, kv, steps, token):
        r = self.runner(rows, kv)
        first = r.step(token)
        tok = int(np.argmax(first))
        times, att = [], []
        for _ in range(steps):
            a0, t0 = r.timings["attention_s"], time.perf_counter()
            tok = int(np.argmax(r.step(tok)))
            times.append(time.perf_counter() - t0)
            att.append(r.timings["attention_s"] - a0)
        return {"step_s": times, "attention_s": att, "first_logits": first,
                "cache_bytes": r.memory_bytes()}

    def time_transformers(self, rows, steps, token):
        torch = self.torch
        from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList
        cache = DynamicCache(config=self.cfg)
        for i, (k, v) in enumerate(rows):
            cache.update(torch.from_numpy(np.ascontiguousarray(k.transpose(1, 0, 2)))[None],
                         torch.from_numpy(np.ascontiguousarray(v.transpose(1, 0, 2)))[None], i)
        stamps = []

        class Stamp(LogitsProcessor):
            def __call__(self, input_ids, scores):
                stamps.append(time.perf_counter())
                return scores

        context = rows[0][0].shape[0]
        ids = torch.zeros((1, context + 1), dtype=torch.long)
        ids[0, -1] = token
        # the ids before the last stand for the cached rows; an explicit mask keeps generate
        # from taking them (zeros, the pad id) for padding and masking the cache out
        kwargs = dict(max_new_tokens=steps + 1, do_sample=False, pad_token_id=0,
                      attention_mask=torch.ones_like(ids),
                      logits_processor=LogitsProcessorList([Stamp()]), output_logits=True,
                      return_dict_in_generate=True)
        with torch.no_grad():
            try:
                out = self.model.generate(ids, cache=cache, **kwargs)
            except (TypeError, ValueError):      # transformers before the `cache` argument
                out = self.model.generate(ids, past_key_values=cache, **kwargs)
        return {"step_s": [float(d) for d in np.diff(stamps)],
                "first_logits": out.logits[0][0].numpy()}


def run_runner(opts, bar):
    """The runner section: per context, the runner (f32, q8) and transformers in turn."""
    try:
        work = RunnerVsTransformers(seed=opts.seed)
    except ImportError as exc:
        log.warning("runner section skipped: it needs torch and transformers (%s)", exc)
        return []
    rows = []
    token = 17
    for context in opts.runner_contexts:
        bar.set_postfix_str(f"runner {context_label(context)}")
        kv = work.kv_rows(context)
        rec = {"context": context, "steps": opts.runner_steps}
        first = None
        for mode in ("f32", "q8"):
            res = work.time_runner(kv, mode, opts.runner_steps, token)
            med = statistics.median(res["step_s"])
            rec[mode] = {"tokens_per_s": 1.0 / med, "step_ms": 1e3 * med,
                         "attention_share": sum(res["attention_s"]) / sum(res["step_s"]),
                         "cache_bytes": res["cache_bytes"], "step_samples_s": res["step_s"]}
            if first is None:
                first = res["first_logits"]
            gc.collect()
        hf = work.time_transformers(kv, opts.runner_steps, token)
        med = statistics.median(hf["step_s"])
        rec["transformers"] = {"tokens_per_s": 1.0 / med, "step_ms": 1e3 * med,
                               "step_samples_s": hf["step_s"]}
        rec["max_abs_logit_diff"] = float(np.abs(first - hf["first_logits"]).max())
        for mode in ("f32", "q8"):
            rec[mode]["speedup_vs_transformers"] = (rec[mode]["tokens_per_s"]
                                                    / rec["transformers"]["tokens_per_s"])
        rows.append(rec)
        del kv
        gc.collect()
        bar.update()
    return rows


def runner_table(rows):
    body = []
    for r in rows:
        f, q, h = r["f32"], r["q8"], r["transformers"]
        body.append([context_label(r["context"]), fmt(f["tokens_per_s"]), fmt(q["tokens_per_s"]),
                     fmt(h["tokens_per_s"]), fmt_ratio(f["speedup_vs_transformers"]),
                     fmt_ratio(q["speedup_vs_transformers"]),
                     f"{100 * f['attention_share']:.0f}%", f"{100 * q['attention_share']:.0f}%",
                     f"{f['cache_bytes'] / MiB:.4g}", f"{q['cache_bytes'] / MiB:.4g}",
                     f"{r['max_abs_logit_diff']:.1e}"])
    return render_table(["ctx", "runner f32 tok/s", "runner q8 tok/s", "transformers tok/s",
                         "f32/hf", "q8/hf", "attn f32", "attn q8", "cache f32 MiB",
                         "cache q8 MiB", "|dlogit|"], body)


def runner_notes(rows, opts):
    out = [f"median of {opts.runner_steps} greedy steps per side; transformers "
           f"{_package_version('transformers')} generate (sdpa, DynamicCache), torch "
           f"{_package_version('torch')}; model: Llama-style, {RUNNER_MODEL}",
           "attn = share of the runner's step time in append + attend_all_heads",
           "threads: the runner decodes with BLAS on 1 thread and kvcache's OpenMP on all "
           "(its default, see kvcache.runner); torch uses its own default pool"]
    for r in rows:
        if r["max_abs_logit_diff"] > 1e-3:
            out.append(f"WARNING: at {context_label(r['context'])} the first-step logits differ "
                       f"by {r['max_abs_logit_diff']:.2g} (> 1e-3)")
    return out


# ---------------------------------------------------------------------------------------- output
def fmt(x, digits=3):
    """A number with ``digits`` significant digits, '-' for None."""
    if x is None:
        return "-"
    if x >= 10 ** digits:
        return f"{x:.0f}"
    return f"{x:.{digits}g}"


def context_label(t):
    """1024 -> '1k', 5000 -> '5000'."""
    return f"{t // 1024}k" if t % 1024 == 0 else str(t)


def fmt_ratio(x):
    return "-" if x is None else f"{x:.2f}x"


def render_table(headers, rows):
    """A table via tabulate when installed, else a plain right-aligned text table."""
    try:
        from tabulate import tabulate
    except ImportError:
        pass
    else:
        return tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True,
                        stralign="right")
    cells = [list(map(str, headers))] + [list(map(str, r)) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


DECODE_HEADERS = ["model", "ctx", "mode", "thr", "layers x MiB", "kvcache ms", "GB/s", "%BW",
                  "ref ms", "torch f32 ms", "torch GB/s", "vs ref", "vs torch f32", "q8 vs f32"]


def decode_table(rows):
    body = []
    for r in rows:
        body.append([r["geometry"], context_label(r["context"]), r["mode"], r["threads"],
                     f"{r['layers']} x {r['step_bytes'] / MiB:.3g}",
                     fmt(r["kvcache_ms"]), fmt(r["kvcache_gbs"]), f"{r['pct_bandwidth']:.0f}%",
                     fmt(r.get("reference_ms")), fmt(r.get("torch_f32_ms")),
                     fmt(r.get("torch_gbs")), fmt_ratio(r.get("speedup_vs_reference")),
                     fmt_ratio(r.get("speedup_vs_torch_f32")), fmt_ratio(r.get("speedup_vs_f32"))])
    return render_table(DECODE_HEADERS, body)


def append_table(rows):
    body = [[r["geometry"], r["mode"], context_label(r["context"]), fmt(r["fill_s"]),
             fmt(r["amortised_us"]), fmt(r["single_median_us"]), fmt(r["single_max_us"])]
            for r in rows]
    return render_table(["model", "mode", "T", "fill 0..T s", "amortised us/pos",
                         "single at T median us", "single at T max us"], body)


def append_ratio_lines(rows):
    by_t = {r["context"]: r for r in rows}
    lo, hi = by_t.get(APPEND_CONTEXTS[0]), by_t.get(APPEND_CONTEXTS[-1])
    if lo is None or hi is None:
        return []
    amortised = hi["amortised_us"] / lo["amortised_us"]
    single = hi["single_median_us"] / lo["single_median_us"]
    return [f"ratio 32k/1k: amortised {amortised:.2f}x, single-append median {single:.2f}x"]


O1_HEADERS = ["ctx", "thr", "O(1) ms", "O(1) warm ms", "f32 ms", "q8 ms", "f32/O(1)", "q8/O(1)",
              "state MiB", "f32 KV MiB", "q8 KV MiB", "f32 KV/state", "seal s",
              "err clustered", "err iid", "q8 err"]


def o1_table(rows):
    body = []
    for r in rows:
        body.append([context_label(r["context"]), r["threads"], fmt(r["o1_ms"]),
                     fmt(r["o1_warm_ms"]), fmt(r["f32_ms"]), fmt(r["q8_ms"]),
                     fmt_ratio(r["speedup_vs_f32"]), fmt_ratio(r["speedup_vs_q8"]),
                     fmt(r["state_bytes"] / MiB), fmt(r["f32_bytes"] / MiB),
                     fmt(r["q8_bytes"] / MiB), fmt_ratio(r["memory_ratio_f32"]),
                     fmt(r["seal_s"]), f"{r['rel_err_clustered']:.3g}",
                     f"{r['rel_err_iid']:.3g}", f"{r['rel_err_q8_clustered']:.2g}"])
    return render_table(O1_HEADERS, body)


def o1_summary(rows):
    """Ratios and the issue's targets per thread count, from the rows of one run.

    Returns ``{threads: {...}}`` with the smallest / largest context, flatness (cold and warm),
    and at the target context (32k, else the largest) the f32 speedup and memory ratio, each
    target's value and pass flag (None: not judged -- one context only, or no 32k in the run)."""
    out = {}
    for n in sorted({r["threads"] for r in rows}):
        mine = sorted((r for r in rows if r["threads"] == n), key=lambda r: r["context"])
        lo, hi = mine[0], mine[-1]
        at = next((r for r in mine if r["context"] == O1_TARGETS["context"]), hi)
        flat = hi["o1_ms"] / lo["o1_ms"]
        s = {"smallest_context": lo["context"], "largest_context": hi["context"],
             "flatness": flat, "flatness_warm": hi["o1_warm_ms"] / lo["o1_warm_ms"],
             "target_context": at["context"],
             "speedup_vs_f32": at["speedup_vs_f32"], "memory_ratio_f32": at["memory_ratio_f32"]}
        judged = at["context"] == O1_TARGETS["context"]      # speed/memory targets are at 32k
        s["flatness_pass"] = flat <= O1_TARGETS["flatness"] if len(mine) > 1 else None
        s["speedup_pass"] = (at["speedup_vs_f32"] >= O1_TARGETS["speedup_f32"]) if judged else None
        s["memory_pass"] = (at["memory_ratio_f32"] >= O1_TARGETS["memory_f32"]) if judged else None
        out[n] = s
    return out


def _pass(flag):
    return "n/a" if flag is None else ("PASS" if flag else "FAIL")


def o1_notes(opts, rows, section_s):
    """Methodology, ratio and target lines printed under the O(1) table."""
    out = [(f"Llama-3-8B layer (32 heads, 8 KV heads, head_dim 128), O(1) m={O1_M} w={O1_W} "
            f"sink={O1_SINK}; times: median ms per decode step over {opts.o1_repeats} round-robin "
            f"repeats (O(1), exact f32, exact q8 timed alternately, after one warm-up round)."),
           (f"every timed call starts cold: a {O1_FLUSH_BYTES // MiB} MiB buffer is read before "
            "it; 'O(1) warm' is a second o1_step right after the cold one (state in cache)."),
           ("O(1) ms: o1_step on the sealed layer, rolled back (o1_restore, untimed) before "
            "each repeat; f32/q8 ms: append(k, v) + attend_all_heads(q) of the newest position "
            "over context rows, truncate_last(1) after the timer (untimed)."),
           ("f32/O(1), q8/O(1): exact step / O(1) step; state MiB: memory_bytes() of the sealed "
            "layer (KV released); f32/q8 KV MiB: memory_bytes() of the exact layers at ctx; "
            f"seal s: o1_seal (replay included) at {max(opts.threads)} thread(s), not in any "
            "step time."),
           (f"err: relative L2 ||o1 - exact f32|| / ||exact f32|| over {O1_ERROR_STEPS} decode "
            "steps (same q/k/v to both); 'clustered' data: keys around 8 slowly drifting "
            "cluster centres per KV head in 64-position topic runs, queries = 0.25 * their "
            "topic's centre + noise, values around per-cluster centres; 'iid': q, k, v "
            "independent N(0, 1) (near-uniform attention, the hard case); q8 err: exact q8 vs "
            "exact f32 on the clustered data, for scale.  Details: kvcache.bench docstring."),
           ]
    summary = o1_summary(rows)
    for n, s in summary.items():
        lo, hi, at = (context_label(s[k]) for k in
                      ("smallest_context", "largest_context", "target_context"))
        note = "" if s["target_context"] == O1_TARGETS["context"] else \
            " (speed and memory targets are judged at 32k, not in this run: n/a)"
        out.append(f"{n} thread{'s' if n > 1 else ''}: O(1) step {hi}/{lo} = {s['flatness']:.2f}x "
                   f"(warm {s['flatness_warm']:.2f}x); at {at}: exact f32 / O(1) = "
                   f"{s['speedup_vs_f32']:.1f}x, f32 KV / state = {s['memory_ratio_f32']:.1f}x{note}")
        out.append(f"  targets: flatness {hi}/{lo} <= {O1_TARGETS['flatness']}x "
                   f"{_pass(s['flatness_pass'])}; >= {O1_TARGETS['speedup_f32']:.0f}x faster "
                   f"than exact f32 at {at} {_pass(s['speedup_pass'])}; >= "
                   f"{O1_TARGETS['memory_f32']:.0f}x less memory than the f32 KV at {at} "
                   f"{_pass(s['memory_pass'])}")
    out.append(f"O(1) section: {section_s:.1f} s (data generation, seals, accuracy steps and "
               "timings).")
    return out


WIRE_HEADERS = ["call", "rows", "layer MiB", "buffer MiB", "export ms", "export GB/s",
                "import ms", "import GB/s", "best export GB/s", "best import GB/s"]


def wire_table(rows):
    body = [[r["call"], r["rows"], fmt(r["layer_bytes"] / MiB), fmt(r["buffer_bytes"] / MiB),
             fmt(r.get("export_ms")), fmt(r.get("export_gbs")), fmt(r.get("import_ms")),
             fmt(r.get("import_gbs")), fmt(r.get("export_best_gbs")),
             fmt(r.get("import_best_gbs"))] for r in rows]
    return render_table(WIRE_HEADERS, body)


def wire_digest_table(rows):
    body = [[r["function"] + (" (in use)" if r["in_use"] else ""), r["library"],
             fmt(r["bytes"] / MiB), fmt(r["ms"]), fmt(r["gbs"]), fmt(r["best_gbs"])]
            for r in rows]
    return render_table(["digest function", "package", "MiB", "ms", "GB/s", "best GB/s"], body)


def wire_notes(result):
    """Methodology, checksum and target lines printed under the wire tables."""
    s = result["summary"]
    ctx = context_label(result["context"])
    fs = f", {result['filesystem']}" if result.get("filesystem") else ""
    out = [(f"{result['geometry']} layer (8 KV heads, head_dim 128) holding {ctx} positions, "
            f"one thread; times: median ms over {result['repeats']} round-robin repeats (every "
            "variant once per repeat, odd repeats in reverse order, after one warm-up round "
            "that also checks every round trip); 'best': the fastest repeat (all samples in the "
            "JSON)."),
           ("GB/s: memory_bytes() of the exported layer(s) / time (1e9 bytes per GB); buffer "
            "MiB: bytes of the buffer (file).  Every export allocates a fresh buffer, so its time "
            "includes first-touch page faults; each import goes into a fresh LayerKvCache."),
           ("rows 'f32 -> f16': an f32 layer written with f16=True (imports as f32); 'q8': a "
            "KvMode.Q8() layer holding the same rows.  export_wire refuses q8 storage by design "
            "(the legacy layout describes F32 caches only), so it has no q8 row."),
           (f"KvCache.save/load: a model of {result['save_layers']} such f32 layers, file in a "
            f"temporary folder under {result['folder']}{fs}; save includes the fsync of the "
            "file and of the folder; load reads the file (still in the page cache) into memory, "
            "verifies it and copies the layers out."),
           (f"checksum: {s['algorithm_name']} (kvcache.wire.default_algorithm() = "
            f"{s['algorithm']}); 'to_bytes, null digest' is the f32 export with "
            "kvcache.wire._BENCH_NO_DIGEST set (export only: such a buffer does not import); "
            f"checksum share = 1 - null-digest / f32 export = {100 * s['checksum_share']:.1f}% "
            f"(paired per repeat {100 * s['checksum_share_paired']:.1f}%, best times "
            f"{100 * s['checksum_share_best']:.1f}%)."),
           ("digest functions: one call over the whole f32 export buffer, in the same rounds "
            "(right after its import; at 32k it comes from DRAM); the writers instead hash each "
            "256 KiB chunk right after copying it (from cache), so the checksum share above, not "
            "these figures, is the digest's cost in an export.")]
    if result["digests_missing"]:
        out.append(f"not installed (not timed): {', '.join(result['digests_missing'])}")
    note = "" if result["context"] == WIRE_CONTEXT else \
        f" (judged at {ctx}; the issue's figure is for a {context_label(WIRE_CONTEXT)} layer)"
    out.append(f"targets{note}: f32 to_bytes export >= {WIRE_TARGETS['export_gbs']:g} GB/s: "
               f"{s['export_gbs']:.2f} GB/s {_pass(s['export_pass'])}; f32 from_bytes import >= "
               f"{WIRE_TARGETS['import_gbs']:g} GB/s: {s['import_gbs']:.2f} GB/s "
               f"{_pass(s['import_pass'])}; checksum <= "
               f"{100 * WIRE_TARGETS['checksum_share']:.0f}% of the export time: "
               f"{100 * s['checksum_share']:.1f}% {_pass(s['checksum_pass'])}")
    out.append(f"wire section: {result['section_s']:.1f} s (data, layers, warm-up round and "
               "timings).")
    return out


MLA_HEADERS = ["ctx", "thr", "layers x MiB", "kernel ms", "naive ms", "naive/kernel",
               "latent GB/s", "%BW", "all GB/s", "GFMA/s", "%peak FMA", "FMA ceil %BW",
               "err vs naive"]


def mla_table(rows):
    body = []
    for r in rows:
        err = r.get("rel_err_vs_naive")
        body.append([context_label(r["context"]), r["threads"],
                     f"{r['layers']} x {r['layer_bytes'] / MiB:.3g}", fmt(r["kernel_ms"]),
                     fmt(r.get("naive_ms")), fmt_ratio(r.get("speedup_vs_naive")),
                     fmt(r["latent_gbs"]), f"{r['pct_bandwidth']:.0f}%", fmt(r["all_gbs"]),
                     fmt(r["kernel_gfmas"]), f"{r['pct_peak_fma']:.0f}%",
                     f"{r['fma_ceiling_pct_bandwidth']:.0f}%",
                     "-" if err is None else f"{err:.2g}"])
    return render_table(MLA_HEADERS, body)


def mla_notes(result):
    """Methodology, compute-ceiling, memory and target lines printed under the MLA table."""
    rows, s, mem = result["rows"], result["summary"], result["memory"]
    layers = sorted({(r["context"], r["layers"]) for r in rows})
    out = [(f"DeepSeek-V2-Lite MLA layer: {MLA_HEADS} heads, kv_lora_rank {MLA_RANK}, "
            f"qk_rope_head_dim {MLA_ROPE}, qk_nope_head_dim {MLA_NOPE}, v_head_dim {MLA_V}, "
            f"scale {result['scale']:.7g} (mla_softmax_scale(128, 64, {MLA_ROPE_SCALING})); "
            "one query position of one layer per step."),
           (f"kernel ms: _core.mla_attend (what kvcache.mla_decode runs, at n_threads = thr) on "
            f"slot_storage views of a LatentKvCache, median over {result['repeats']} sweeps of "
            "every layer ('layers x MiB': latent + k_rope rows + that layer's own W_UK/W_UV; "
            f"target working set {result['working_set_target_bytes'] / MiB:.0f} MiB, so each "
            "step reads its rows from DRAM), after one warm-up sweep."),
           ((f"naive ms: kvcache.reference.mla_naive (K and V of every head materialised, NumPy "
             f"BLAS at thr threads) on one layer, median of {result['naive_repeats']} calls "
             f"after one warm-up, contexts <= {context_label(result['naive_max_context'])}; "
             "naive/kernel: speedup at the same thread count; err: max|kernel - naive| / "
             "max|naive|.") if result["naive_max_context"] else
            "naive form skipped (--no-reference)."),
           (f"latent GB/s: T x (r + d_rope) x 4 = T x {MLA_ROW_BYTES} bytes / kernel time; %BW: "
            "of the measured read bandwidth (stream_read) at the same thread count; all GB/s "
            f"adds W_UK + W_UV ({MLA_WEIGHT_BYTES / MiB:.0f} MiB) read every step."),
           (f"compute: {MLA_FMA_PER_ROW} FMAs per cached row ({MLA_HEADS} x ({MLA_RANK} + "
            f"{MLA_ROPE}) scores + {MLA_HEADS} x {MLA_RANK} latent sum) plus "
            f"{MLA_FMA_FIXED} per step (fold/unfold); GFMA/s: achieved; %peak FMA: of "
            "_core.fma_probe's rate (best of 5) at thr threads: "
            + ", ".join(f"{n}t {v['best_gfmas']:.1f} GFMA/s"
                        for n, v in result["fma_peak"].items())
            + f"; FMA ceil %BW: the latent read rate at peak FMA (peak / {MLA_FMA_PER_ROW} x "
            f"{MLA_ROW_BYTES} B/s) as % of the bandwidth -- no latent-read figure above it is "
            "reachable by this kernel on this machine."),
           (f"cache bytes per token per layer: latent (r + d_rope) x 4 = {mem['latent']} B; "
            f"per-head f32 K ({MLA_NOPE + MLA_ROPE} wide) + V ({MLA_V} wide) x {MLA_HEADS} heads = "
            f"{mem['per_head_f32']} B ({mem['ratio_f32']:.2f}x the latent); the same per-head "
            f"cache in kvcache's q8 layout = {mem['per_head_q8']} B ({mem['ratio_q8']:.2f}x)."),
           "layers per context: " + ", ".join(f"{context_label(t)} {n}" for t, n in layers)]
    at, n = context_label(s["target_context"]), s["threads"]
    note = "" if s["target_context"] == MLA_TARGETS["context"] else \
        (f" (the targets are judged at {context_label(MLA_TARGETS['context'])}, not in this "
         "run: n/a)")
    speed = ("not timed" if s["speedup_vs_naive"] is None
             else f"{s['speedup_vs_naive']:.1f}x ({fmt(s['naive_ms'])} ms / "
                  f"{fmt(s['kernel_ms'])} ms)")
    out.append(f"targets at {at}, {n} thread{'s' if n > 1 else ''}{note}: kernel >= "
               f"{MLA_TARGETS['speedup_naive']:.0f}x faster than naive NumPy: {speed} "
               f"{_pass(s['speedup_pass'])}; latent read >= {MLA_TARGETS['pct_bandwidth']:.0f}% "
               f"of measured bandwidth: {s['pct_bandwidth']:.1f}% ({s['latent_gbs']:.2f} of "
               f"{s['bandwidth_gbs']:.1f} GB/s) {_pass(s['bandwidth_pass'])}")
    ceiling = (f"  compute ceiling beside it: peak {s['peak_gfmas']:.1f} GFMA/s / "
               f"{MLA_FMA_PER_ROW} FMAs per {MLA_ROW_BYTES}-byte row = "
               f"{s['fma_ceiling_gbs']:.2f} GB/s = {s['fma_ceiling_pct_bandwidth']:.1f}% of "
               f"bandwidth; the kernel runs at {s['kernel_gfmas']:.1f} GFMA/s = "
               f"{s['pct_peak_fma']:.0f}% of peak FMA.")
    if s["bandwidth_target_above_fma_ceiling"]:
        ceiling += (f"  The {MLA_TARGETS['pct_bandwidth']:.0f}% target is ABOVE this ceiling: "
                    f"at {MLA_FMA_PER_ROW} FMAs per row even a kernel running at the FMA peak "
                    "could not read the latent that fast on this machine (only fewer FMAs per "
                    "row or more FMA throughput would).")
    else:
        ceiling += (f"  The {MLA_TARGETS['pct_bandwidth']:.0f}% target is within this "
                    "ceiling.")
    out.append(ceiling)
    out.append(f"MLA section: {result['section_s']:.1f} s (FMA probe, cache fill, kernel and "
               "naive timings).")
    return out


def bandwidth_lines(bandwidth):
    return [f"  {n} thread{'s' if n > 1 else ''}: {b['best_gbs']:.1f} GB/s best "
            f"({b['median_gbs']:.1f} median) over a "
            f"{fmt(b.get('buffer_bytes', BANDWIDTH_BUFFER) / MiB)} MiB float32 buffer"
            for n, b in bandwidth.items()]


def notes(opts, rows):
    """Methodology lines printed under the decode table."""
    out = [(f"times: median ms per decode step (one layer's attend_all_heads) over "
            f"{opts.repeats} sweeps of every layer in the rotating working set (target "
            f"{opts.working_set / GiB:.3g} GiB, 'layers x MiB' column), after one warm-up sweep."),
           ("GB/s: bytes of K/V rows (+ q8 scales) read per step / time; %BW: of the measured "
            "read bandwidth at the same thread count.")]
    if opts.reference:
        out.append(f"ref: NumPy reference (kvcache.reference) on a SINGLE layer (not rotated, may "
                   f"be cache-resident at small contexts), median of {opts.ref_repeats} calls.")
    gqa = {r.get("torch_gqa") for r in rows} - {None}
    if gqa:
        how = ("enable_gqa=True" if gqa == {True}
               else "K/V heads repeat_interleave'd at setup (no enable_gqa in this torch)")
        out.append(f"torch: F.scaled_dot_product_attention on float32 K/V (1, nkv, T, hd), {how}, "
                   "rotated over its own working set; q8 rows compare against torch f32 "
                   "(torch has no int8 KV).")
    out.append("vs ref / vs torch f32: speedup of kvcache (>1 = kvcache faster); q8 vs f32: "
               "f32 time / q8 time at the same thread count.")
    return out


def accuracy_warnings(rows, tol=1e-3):
    """Warn when kvcache disagrees with the reference or torch beyond ``tol`` (relative)."""
    for r in rows:
        for key in ("rel_err_vs_reference", "rel_err_vs_torch"):
            err = r.get(key)
            if err is not None and not err <= tol:
                log.warning("%s %s %s T=%d: %s = %.3g (> %g)", "kvcache", r["geometry"],
                            r["mode"], r["context"], key, err, tol)


def mla_accuracy_warnings(rows, tol=1e-3):
    """Warn when the MLA kernel disagrees with the naive form beyond ``tol`` (relative)."""
    seen = set()
    for r in rows:
        err = r.get("rel_err_vs_naive")
        if err is not None and r["context"] not in seen and not err <= tol:
            seen.add(r["context"])
            log.warning("mla T=%d: kernel vs naive relative error %.3g (> %g)", r["context"],
                        err, tol)


def machine_info():
    """Facts that make a result reproducible: CPU, cache, versions, thread pools."""
    from ._config import config_info
    info = config_info()
    info["cpu_count"] = available_cpus()
    info["cpu_model"] = cpu_model()
    info["llc_bytes_reported"] = llc_bytes()
    return info


class BusyMonitor:
    """CPU time other processes used while the benchmark ran (Linux /proc/stat; else unknown).

    On a shared 2-core machine a compiler or test run beside the benchmark inflates timings,
    multi-threaded ones most; this measures it instead of guessing from the load average."""

    def __init__(self):
        self.start = self._sample()

    @staticmethod
    def _sample():
        try:
            import resource
            with open("/proc/stat") as f:
                vals = [int(x) for x in f.readline().split()[1:9]]
        except (ImportError, OSError, ValueError):
            return None
        busy = (sum(vals) - vals[3] - vals[4]) / os.sysconf("SC_CLK_TCK")   # minus idle, iowait
        own = resource.getrusage(resource.RUSAGE_SELF)
        return time.perf_counter(), busy, own.ru_utime + own.ru_stime

    def other_cores(self):
        """Average number of cores other processes kept busy since construction (None: unknown)."""
        end = self._sample()
        if self.start is None or end is None:
            return None
        wall, busy, own = (e - s for e, s in zip(end, self.start))
        return max(0.0, (busy - own) / wall) if wall > 0 else None


def warn_if_busy(monitor, info, threshold=0.2):
    other = monitor.other_cores()
    info["other_processes_cores"] = other
    if other is not None and other > threshold:
        log.warning("other processes kept %.2f cores busy on average during the run: timings "
                    "(multi-threaded ones most) may be inflated; rerun on an idle machine", other)


def available_cpus():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:                                   # not Linux
        return os.cpu_count() or 1


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def llc_bytes():
    """Size of the highest cache level sysfs reports for cpu0 (None when unknown)."""
    base = "/sys/devices/system/cpu/cpu0/cache"
    best = (0, None)
    try:
        entries = os.listdir(base)
    except OSError:
        return None
    for name in entries:
        try:
            with open(f"{base}/{name}/level") as f:
                level = int(f.read())
            with open(f"{base}/{name}/size") as f:
                size = f.read().strip()
        except (OSError, ValueError):
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        nbytes = int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
        best = max(best, (level, nbytes), key=lambda t: (t[0], t[1] or 0))
    return best[1]


def write_plot(path, rows, bandwidth):
    """ms per step and effective GB/s against context, one column per geometry.

    Colour: implementation and mode; line style: thread count; grey lines: stream_read."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    geoms = list(dict.fromkeys(r["geometry"] for r in rows))
    threads = sorted({r["threads"] for r in rows})
    fig, axes = plt.subplots(2, len(geoms), figsize=(6.5 * len(geoms), 8), squeeze=False)
    for col, g in enumerate(geoms):
        mine = [r for r in rows if r["geometry"] == g]
        ax_ms, ax_gbs = axes[0][col], axes[1][col]
        for (impl, mode, n), pts in plot_series(mine).items():
            pts.sort()
            style = {"color": _PLOT_COLOURS[(impl, mode)], "marker": _PLOT_MARKERS[impl],
                     "ls": _line_style(threads, n), "label": f"{impl} {mode} {n}t"}
            ax_ms.plot([p[0] for p in pts], [p[1] for p in pts], **style)
            ax_gbs.plot([p[0] for p in pts], [p[2] for p in pts], **style)
        for n, b in bandwidth.items():
            ax_gbs.axhline(b["best_gbs"], color="grey", lw=0.8, ls=_line_style(threads, n))
            ax_gbs.annotate(f"stream_read {n}t", (mine[0]["context"], b["best_gbs"]),
                            fontsize=7, color="grey", va="bottom")
        ax_ms.set_yscale("log")
        ax_ms.set_title(g)
        contexts = sorted({r["context"] for r in mine})
        for ax in (ax_ms, ax_gbs):
            ax.set_xscale("log", base=2)
            ax.set_xticks(contexts, [context_label(c) for c in contexts])
            ax.set_xlabel("context (rows)")
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("ms per decode step (one layer)")
    axes[1][0].set_ylabel("effective GB/s (K/V bytes read per step)")
    axes[0][0].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


_PLOT_COLOURS = {("kvcache", "f32"): "C0", ("kvcache", "q8"): "C1", ("torch", "f32"): "C2",
                 ("reference", "f32"): "C3", ("reference", "q8"): "C4"}
_PLOT_MARKERS = {"kvcache": "o", "torch": "s", "reference": "x"}


def _line_style(threads, n):
    return "-" if n == threads[0] else ("--", ":", "-.")[threads.index(n) % 3 - 1]


def mla_plot_path(path):
    """``chart.png`` -> ``chart-mla.png`` (the MLA chart beside the decode chart)."""
    stem, ext = os.path.splitext(path)
    return f"{stem}-mla{ext or '.png'}"


def write_mla_plot(path, result):
    """MLA section chart: ms per step (kernel per thread count, naive) and latent read rate as
    % of bandwidth with the FMA-peak ceiling, against context."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    threads = sorted({r["threads"] for r in rows})
    contexts = sorted({r["context"] for r in rows})
    fig, (ax_ms, ax_bw) = plt.subplots(1, 2, figsize=(13, 5))
    for i, n in enumerate(threads):
        mine = sorted((r for r in rows if r["threads"] == n), key=lambda r: r["context"])
        ls = _line_style(threads, n)
        xs = [r["context"] for r in mine]
        ax_ms.plot(xs, [r["kernel_ms"] for r in mine], color="C0", marker="o", ls=ls,
                   label=f"kernel {n}t")
        naive = [(r["context"], r["naive_ms"]) for r in mine if "naive_ms" in r]
        if naive:
            ax_ms.plot(*zip(*naive), color="C3", marker="x", ls=ls, label=f"naive NumPy {n}t")
        ax_bw.plot(xs, [r["pct_bandwidth"] for r in mine], color="C0", marker="o", ls=ls,
                   label=f"latent read {n}t")
        ax_bw.plot(xs, [r["fma_ceiling_pct_bandwidth"] for r in mine], color="grey", ls=ls,
                   label=f"FMA-peak ceiling {n}t")
    ax_bw.axhline(MLA_TARGETS["pct_bandwidth"], color="C3", lw=0.8, ls=":",
                  label=f"target {MLA_TARGETS['pct_bandwidth']:.0f}%")
    ax_ms.set_yscale("log")
    ax_ms.set_ylabel("ms per decode step (one layer)")
    ax_bw.set_ylabel("% of measured read bandwidth")
    ax_ms.set_title("DeepSeek-V2-Lite MLA decode")
    for ax in (ax_ms, ax_bw):
        ax.set_xscale("log", base=2)
        ax.set_xticks(contexts, [context_label(c) for c in contexts])
        ax.set_xlabel("context (rows)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_series(rows):
    """{(implementation, mode, threads): [(context, ms, GB/s), ...]} from result rows."""
    series = {}
    for r in rows:
        t, n, m = r["context"], r["threads"], r["mode"]
        series.setdefault(("kvcache", m, n), []).append((t, r["kvcache_ms"], r["kvcache_gbs"]))
        if "reference_ms" in r:
            series.setdefault(("reference", m, n), []).append(
                (t, r["reference_ms"], r["step_bytes"] / r["reference_ms"] / 1e6))
        if "torch_f32_ms" in r and m == "f32":
            series.setdefault(("torch", "f32", n), []).append(
                (t, r["torch_f32_ms"], r["torch_gbs"]))
    return series


# ---------------------------------------------------------------------------------------- CLI
class _NoBar:
    """Stand-in for a tqdm bar when tqdm is not installed."""

    def update(self, n=1):
        pass

    def set_postfix_str(self, s):
        pass

    def close(self):
        pass


def progress_bar(total, enabled=True, unit="task"):
    """A tqdm bar on stderr (also used by ``python -m kvcache generate``); a stand-in that
    does nothing when tqdm is not installed."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    # disable=None: tqdm turns itself off when stderr is not a terminal (logs stay clean)
    return tqdm(total=total, disable=None if enabled else True, leave=False, unit=unit,
                file=sys.stderr)


def parse_context(text):
    """'1k' -> 1024, '32K' -> 32768, '5000' -> 5000."""
    t = text.strip().lower()
    try:
        value = int(t[:-1]) * 1024 if t.endswith("k") else int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"context: expected an integer or Nk (e.g. 4096, 4k), got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"context must be >= 1, got {text!r}")
    return value


def parse_geometry(text):
    key = _GEOMETRY_ALIASES.get(text.lower(), text.lower())
    if key not in GEOMETRIES:
        raise argparse.ArgumentTypeError(
            f"unknown geometry {text!r}; choose from {', '.join(GEOMETRIES)} (or llama, qwen)")
    return GEOMETRIES[key]


def parse_mode(text):
    if text.lower() not in MODE_NAMES:
        raise argparse.ArgumentTypeError(f"unknown mode {text!r}; choose from f32, q8")
    return text.lower()


def parse_section(text):
    if text.lower() not in SECTIONS:
        raise argparse.ArgumentTypeError(
            f"unknown section {text!r}; choose from {', '.join(SECTIONS)}")
    return text.lower()


def parse_threads(text):
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"thread count must be >= 1, got {text!r}")
    return n


def _split(values, conv):
    """Flatten ``['1,2', '4']`` -> conv over ['1', '2', '4'], order kept, duplicates dropped."""
    if values is None:
        return None
    items = [conv(s) for v in values for s in v.split(",") if s.strip()]
    return list(dict.fromkeys(items))


def build_parser():
    p = argparse.ArgumentParser(
        prog="python -m kvcache bench",
        description="Decode-attention benchmark: kvcache vs the NumPy reference and torch SDPA, "
                    "over a working set larger than the last-level cache; append cost; the "
                    "O(1) Nystrom decode step vs exact f32/q8 attention (time, memory, error); "
                    "export/import throughput of the byte formats (wire); and the absorbed "
                    "MLA decode kernel vs the naive NumPy form (mla).")
    p.add_argument("--quick", action="store_true",
                   help="small subset (Llama, 1k and 16k, 3 repeats, 512 MiB working set; "
                        "O(1) section at 1k and 4k, 7 repeats; wire section at 4k, "
                        f"{QUICK_WIRE_REPEATS} repeats; MLA section at 1k and 4k, "
                        f"{QUICK_MLA_REPEATS} repeats)")
    p.add_argument("--sections", nargs="+", metavar="S",
                   help="sections to run, any of: decode (decode attention vs reference/torch), "
                        "append (append cost), o1 (O(1) Nystrom decode vs exact f32/q8), "
                        "wire (to_bytes/from_bytes, export_wire/import_wire, checksum cost, "
                        "KvCache save/load), mla (absorbed MLA decode kernel vs the naive "
                        "NumPy form, latent read rate, compute ceiling), sync (device-mirror "
                        "sync per decode step vs a full re-upload), runner (decode tokens/s "
                        "of kvcache.runner vs transformers generate); default all, e.g. "
                        "--sections o1 runs the O(1) section alone")
    p.add_argument("--contexts", nargs="+", metavar="T", help="contexts, e.g. 1k 4k 16k 32k")
    p.add_argument("--geometries", nargs="+", metavar="G", help="llama3-8b and/or qwen2.5-0.5b")
    p.add_argument("--modes", nargs="+", metavar="M", help="f32 and/or q8")
    p.add_argument("--threads", nargs="+", metavar="N",
                   help="thread counts (default: 1 and all available)")
    p.add_argument("--repeats", type=int,
                   help="timed sweeps per configuration (default 5, quick 3)")
    p.add_argument("--ref-repeats", type=int, help="timed reference calls (default 3, quick 2)")
    p.add_argument("--working-set-mib", type=int,
                   help="target bytes read per sweep, MiB (default 1024, quick 512)")
    p.add_argument("--no-torch", action="store_true", help="skip torch SDPA")
    p.add_argument("--no-reference", action="store_true", help="skip the NumPy reference")
    p.add_argument("--no-append", action="store_true", help="skip the append-cost section")
    p.add_argument("--append-repeats", type=int, default=201,
                   help="single appends timed at T (default 201)")
    p.add_argument("--no-o1", action="store_true", help="skip the O(1) section")
    p.add_argument("--o1-contexts", nargs="+", metavar="T",
                   help="contexts of the O(1) section (default 1k 2k 4k 8k 16k 32k, quick 1k 4k)")
    p.add_argument("--o1-repeats", type=int,
                   help=f"round-robin repeats of the O(1) section (default {O1_REPEATS}, "
                        f"quick {QUICK_O1_REPEATS})")
    p.add_argument("--no-wire", action="store_true", help="skip the wire section")
    p.add_argument("--wire-context", metavar="T",
                   help=f"positions of the wire section's layer (default "
                        f"{context_label(WIRE_CONTEXT)}, quick "
                        f"{context_label(QUICK_WIRE_CONTEXT)})")
    p.add_argument("--wire-repeats", type=int,
                   help=f"round-robin repeats of the wire section (default {WIRE_REPEATS}, "
                        f"quick {QUICK_WIRE_REPEATS})")
    p.add_argument("--no-mla", action="store_true", help="skip the MLA section")
    p.add_argument("--mla-contexts", nargs="+", metavar="T",
                   help="contexts of the MLA section (default 1k 4k 16k 32k, quick 1k 4k)")
    p.add_argument("--mla-repeats", type=int,
                   help=f"timed sweeps of the MLA kernel per context and thread count (default "
                        f"{MLA_REPEATS}, quick {QUICK_MLA_REPEATS})")
    p.add_argument("--mla-naive-repeats", type=int,
                   help=f"timed calls of the naive NumPy MLA form (default {MLA_NAIVE_REPEATS}, "
                        f"quick {QUICK_MLA_NAIVE_REPEATS})")
    p.add_argument("--mla-naive-max-context", metavar="T",
                   help="largest context at which the (slow) naive MLA form is timed (default "
                        f"{context_label(MLA_NAIVE_MAX_CONTEXT)})")
    p.add_argument("--mla-working-set-mib", type=int,
                   help="target bytes of the MLA section's rotating layers, MiB (default "
                        f"max({MLA_WORKING_SET // MiB}, 4 x the reported LLC), at most 1024)")
    p.add_argument("--mla-fma-iters", type=int,
                   help=f"iterations of the FMA peak probe (x80 FMAs per thread; default "
                        f"{MLA_FMA_ITERS:_}, quick {QUICK_MLA_FMA_ITERS:_})")
    p.add_argument("--no-sync", action="store_true", help="skip the sync section")
    p.add_argument("--sync-context", metavar="T",
                   help=f"positions of the sync section's layers (default "
                        f"{context_label(SYNC_CONTEXT)}, quick {context_label(QUICK_SYNC_CONTEXT)})")
    p.add_argument("--sync-steps", type=int,
                   help=f"decode (and rollback) steps timed in the sync section (default "
                        f"{SYNC_STEPS}, quick {QUICK_SYNC_STEPS})")
    p.add_argument("--sync-full-repeats", type=int,
                   help=f"full re-uploads timed in the sync section (default {SYNC_FULL_REPEATS}, "
                        f"quick {QUICK_SYNC_FULL_REPEATS})")
    p.add_argument("--sync-backend", choices=("torch", "numpy"),
                   help="the mirror's backend in the sync section (default torch when installed, "
                        "else numpy)")
    p.add_argument("--no-runner", action="store_true", help="skip the runner section")
    p.add_argument("--runner-contexts", nargs="+", metavar="T",
                   help="prompt lengths of the runner section (default 512 4k 16k, quick "
                        "512 4k)")
    p.add_argument("--runner-steps", type=int,
                   help=f"decode steps timed per side in the runner section (default "
                        f"{RUNNER_STEPS}, quick {QUICK_RUNNER_STEPS})")
    p.add_argument("--bandwidth-mib", type=int,
                   help=f"buffer of the read-bandwidth probe, MiB (default "
                        f"{BANDWIDTH_BUFFER // MiB})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write raw results as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG chart (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def resolve_options(args, parser):
    """Command-line arguments, with --quick defaults where an option was not given."""
    try:
        return _resolve_options(args)
    except (argparse.ArgumentTypeError, ValueError) as exc:
        parser.error(str(exc))                                # exits with status 2


def _resolve_options(args):
    quick = args.quick
    contexts = (_split(args.contexts, parse_context)
                or list(QUICK_CONTEXTS if quick else DEFAULT_CONTEXTS))
    geoms = _split(args.geometries, parse_geometry) or (
        [GEOMETRIES["llama3-8b"]] if quick else list(GEOMETRIES.values()))
    modes = _split(args.modes, parse_mode) or list(MODE_NAMES)
    threads = _split(args.threads, parse_threads) or sorted({1, available_cpus()})
    ws_mib = args.working_set_mib or (QUICK_WORKING_SET if quick else DEFAULT_WORKING_SET) // MiB
    sections = _split(args.sections, parse_section) or list(SECTIONS)
    decode = "decode" in sections
    o1_contexts = (_split(args.o1_contexts, parse_context)
                   or list(QUICK_O1_CONTEXTS if quick else O1_CONTEXTS))
    wire_context = (parse_context(args.wire_context) if args.wire_context
                    else QUICK_WIRE_CONTEXT if quick else WIRE_CONTEXT)
    mla_contexts = (_split(args.mla_contexts, parse_context)
                    or list(QUICK_MLA_CONTEXTS if quick else MLA_CONTEXTS))
    if args.mla_working_set_mib is not None:
        if args.mla_working_set_mib < 1:
            raise ValueError(f"--mla-working-set-mib must be >= 1, got {args.mla_working_set_mib}")
        mla_ws = args.mla_working_set_mib * MiB
    else:
        mla_ws = max(MLA_WORKING_SET, min(GiB, 4 * (llc_bytes() or 0)))
    if args.bandwidth_mib is not None and args.bandwidth_mib < 1:
        raise ValueError(f"--bandwidth-mib must be >= 1, got {args.bandwidth_mib}")
    sync_backend = args.sync_backend or ("torch" if import_torch()[0] is not None else "numpy")
    torch_ok = decode and not args.no_torch and import_torch()[0] is not None
    if decode and not args.no_torch and not torch_ok:
        log.warning("torch is not installed: skipping the torch SDPA comparison")
    return Options(geometries=geoms, contexts=contexts, modes=modes, threads=threads,
                   repeats=max(1, args.repeats or (3 if quick else 5)),
                   ref_repeats=max(1, args.ref_repeats or (2 if quick else 3)),
                   working_set=ws_mib * MiB, torch=torch_ok, reference=not args.no_reference,
                   append="append" in sections and not args.no_append,
                   append_repeats=max(1, args.append_repeats), seed=args.seed,
                   decode=decode, o1="o1" in sections and not args.no_o1,
                   o1_contexts=o1_contexts,
                   o1_repeats=max(1, args.o1_repeats
                                  or (QUICK_O1_REPEATS if quick else O1_REPEATS)),
                   wire="wire" in sections and not args.no_wire, wire_context=wire_context,
                   wire_repeats=max(1, args.wire_repeats
                                    or (QUICK_WIRE_REPEATS if quick else WIRE_REPEATS)),
                   mla="mla" in sections and not args.no_mla, mla_contexts=mla_contexts,
                   mla_repeats=max(1, args.mla_repeats
                                   or (QUICK_MLA_REPEATS if quick else MLA_REPEATS)),
                   mla_naive_repeats=max(1, args.mla_naive_repeats
                                         or (QUICK_MLA_NAIVE_REPEATS if quick
                                             else MLA_NAIVE_REPEATS)),
                   mla_naive_max_context=(parse_context(args.mla_naive_max_context)
                                          if args.mla_naive_max_context
                                          else MLA_NAIVE_MAX_CONTEXT),
                   mla_working_set=mla_ws,
                   mla_fma_iters=max(1, args.mla_fma_iters
                                     or (QUICK_MLA_FMA_ITERS if quick else MLA_FMA_ITERS)),
                   bandwidth_bytes=(args.bandwidth_mib * MiB if args.bandwidth_mib
                                    else BANDWIDTH_BUFFER),
                   sync="sync" in sections and not args.no_sync,
                   sync_context=(parse_context(args.sync_context) if args.sync_context
                                 else QUICK_SYNC_CONTEXT if quick else SYNC_CONTEXT),
                   sync_steps=max(1, args.sync_steps
                                  or (QUICK_SYNC_STEPS if quick else SYNC_STEPS)),
                   sync_full_repeats=max(1, args.sync_full_repeats
                                         or (QUICK_SYNC_FULL_REPEATS if quick
                                             else SYNC_FULL_REPEATS)),
                   sync_backend=sync_backend,
                   runner="runner" in sections and not args.no_runner,
                   runner_contexts=(_split(args.runner_contexts, parse_context)
                                    or list(QUICK_RUNNER_CONTEXTS if quick else RUNNER_CONTEXTS)),
                   runner_steps=max(2, args.runner_steps
                                    or (QUICK_RUNNER_STEPS if quick else RUNNER_STEPS)))


def check_plot_backend():
    """Fail early (before the long run) when --plot is given without matplotlib."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return ("--plot needs matplotlib, which is not installed: "
                "pip install matplotlib (or pip install 'kvcache[bench]')")
    return None


def print_report(info, opts, bandwidth, rows, append_rows, o1_rows=(), o1_s=0.0,
                 file=None, wire_result=None, mla_result=None, sync_rows=(), runner_rows=()):
    file = sys.stdout if file is None else file              # at call time (capture, redirect)

    def p(*a):
        print(*a, file=file)

    llc = info["llc_bytes_reported"]
    llc_text = f"LLC reported {llc / MiB:.0f} MiB" if llc else "LLC size unknown"
    p(f"kvcache {info['kvcache']} decode-attention benchmark -- {info['cpu_model']}, "
      f"{info['cpu_count']} CPUs, {llc_text}")
    other = info.get("other_processes_cores")
    if other is not None:
        p(f"other processes kept {other:.2f} cores busy on average during the run "
          f"({'quiet' if other <= 0.2 else 'NOT quiet: timings may be inflated'})")
    if bandwidth:
        p("measured read bandwidth (kvcache._core.stream_read):")
        for line in bandwidth_lines(bandwidth):
            p(line)
    if rows:
        p("")
        p(decode_table(rows))
        for line in notes(opts, rows):
            p("  " + line)
    if append_rows:
        p("")
        p("append cost (c.append(k_row, v_row), one position per call):")
        p(append_table(append_rows))
        for line in append_ratio_lines(append_rows):
            p("  " + line)
    if o1_rows:
        p("")
        p("O(1) Nystrom decode (o1_step on a sealed layer) vs exact attend_all_heads, one layer:")
        p(o1_table(o1_rows))
        for line in o1_notes(opts, o1_rows, o1_s):
            p("  " + line)
    if wire_result:
        p("")
        p("byte formats (kvcache.wire): export / import throughput, one layer:")
        p(wire_table(wire_result["rows"]))
        p("")
        p(f"raw digest functions over the {fmt(wire_result['digests'][0]['bytes'] / MiB)} MiB "
          "f32 export buffer (for information: the pick by measurement):"
          if wire_result["digests"] else "no digest functions timed")
        if wire_result["digests"]:
            p(wire_digest_table(wire_result["digests"]))
        for line in wire_notes(wire_result):
            p("  " + line)
    if mla_result:
        p("")
        p("MLA decode (absorbed kernel _core.mla_attend vs naive NumPy reference.mla_naive), "
          "one query position, one layer:")
        p(mla_table(mla_result["rows"]))
        for line in mla_notes(mla_result):
            p("  " + line)
    if sync_rows:
        p("")
        p("device mirror sync (kvcache.device.Mirror): per decode step vs a full re-upload, "
          "one layer:")
        p(sync_table(sync_rows))
        for line in sync_notes(sync_rows, opts):
            p("  " + line)
    if runner_rows:
        p("")
        p("decode tokens/s: kvcache.runner vs transformers generate, the same random-weight "
          "model and cache contents:")
        p(runner_table(runner_rows))
        for line in runner_notes(runner_rows, opts):
            p("  " + line)


def write_json(path, info, opts, bandwidth, rows, append_rows, o1_rows=(), o1_s=0.0,
               wire_result=None, mla_result=None, sync_rows=(), runner_rows=()):
    payload = {"machine": info,
               "options": {"geometries": [g.key for g in opts.geometries],
                           "contexts": opts.contexts, "modes": opts.modes,
                           "threads": opts.threads, "repeats": opts.repeats,
                           "ref_repeats": opts.ref_repeats,
                           "working_set_bytes": opts.working_set, "torch": opts.torch,
                           "reference": opts.reference, "seed": opts.seed,
                           "decode_section": opts.decode, "append_section": opts.append,
                           "o1_section": opts.o1, "o1_contexts": opts.o1_contexts,
                           "o1_repeats": opts.o1_repeats, "o1_m": O1_M, "o1_w": O1_W,
                           "o1_sink": O1_SINK, "o1_error_steps": O1_ERROR_STEPS,
                           "o1_flush_bytes": O1_FLUSH_BYTES, "wire_section": opts.wire,
                           "wire_context": opts.wire_context,
                           "wire_repeats": opts.wire_repeats,
                           "wire_save_layers": opts.wire_save_layers,
                           "mla_section": opts.mla, "mla_contexts": opts.mla_contexts,
                           "mla_repeats": opts.mla_repeats,
                           "mla_naive_repeats": opts.mla_naive_repeats,
                           "mla_naive_max_context": opts.mla_naive_max_context,
                           "mla_working_set_bytes": opts.mla_working_set,
                           "mla_fma_iters": opts.mla_fma_iters,
                           "bandwidth_bytes": opts.bandwidth_bytes,
                           "sync_section": opts.sync, "sync_context": opts.sync_context,
                           "sync_steps": opts.sync_steps,
                           "sync_full_repeats": opts.sync_full_repeats,
                           "sync_backend": opts.sync_backend,
                           "runner_section": opts.runner,
                           "runner_contexts": opts.runner_contexts,
                           "runner_steps": opts.runner_steps, "runner_model": RUNNER_MODEL},
               "bandwidth": {str(n): b for n, b in bandwidth.items()},
               "decode": rows, "append": append_rows, "o1": list(o1_rows)}
    if o1_rows:
        payload["o1_summary"] = {str(n): v for n, v in o1_summary(o1_rows).items()}
        payload["o1_targets"] = O1_TARGETS
        payload["o1_section_s"] = o1_s
    if wire_result:
        payload["wire"] = wire_result["rows"]
        payload["wire_digests"] = wire_result["digests"]
        payload["wire_summary"] = wire_result["summary"]
        payload["wire_targets"] = WIRE_TARGETS
        payload["wire_info"] = {k: v for k, v in wire_result.items()
                                if k not in ("rows", "digests", "summary")}
    if mla_result:
        payload["mla"] = mla_result["rows"]
        payload["mla_summary"] = mla_result["summary"]
        payload["mla_targets"] = MLA_TARGETS
        payload["mla_info"] = {k: v for k, v in mla_result.items()
                               if k not in ("rows", "summary")}
    if sync_rows:
        payload["sync"] = list(sync_rows)
    if runner_rows:
        payload["runner"] = list(runner_rows)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, default=str)


def main(argv=None):
    """Entry point of ``python -m kvcache bench``; returns the exit status."""
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(levelname)s: %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.plot:
        err = check_plot_backend()
        if err:
            print(err, file=sys.stderr)
            return 2
    opts = resolve_options(args, parser)
    info = machine_info()
    monitor = BusyMonitor()
    n_tasks = ((len(opts.geometries) * len(opts.contexts) * (len(opts.modes) + opts.torch) + 1
                if opts.decode else 0)
               + (len(APPEND_CONTEXTS) if opts.append else 0)
               + (len(opts.o1_contexts) if opts.o1 else 0)
               + (opts.wire_repeats + 2 if opts.wire else 0)
               + (len(opts.mla_contexts) + 1 + (not opts.decode) if opts.mla else 0)
               + (len(SYNC_CASES) if opts.sync else 0)
               + (len(opts.runner_contexts) if opts.runner else 0))
    bar = progress_bar(n_tasks, enabled=not args.no_progress)
    bandwidth, rows, o1_rows, o1_s, wire_result, mla_result = {}, [], [], 0.0, None, None
    sync_rows, runner_rows = [], []
    try:
        if opts.decode or opts.mla:
            bar.set_postfix_str("bandwidth probe")
            bandwidth = measure_bandwidth(opts.threads, opts.bandwidth_bytes)
            bar.update()
        if opts.decode:
            for geom in opts.geometries:
                for context in opts.contexts:
                    rows += run_context(geom, context, opts, bandwidth, bar)
        append_rows = run_append(opts, bar) if opts.append else []
        if opts.o1:
            o1_rows, o1_s = run_o1(opts, bar)
        if opts.wire:
            wire_result = run_wire(opts, bar)
        if opts.mla:
            mla_result = run_mla(opts, bandwidth, bar)
        if opts.sync:
            sync_rows = run_sync(opts, bar)
        if opts.runner:
            runner_rows = run_runner(opts, bar)
    finally:
        bar.close()
    accuracy_warnings(rows)
    if mla_result:
        mla_accuracy_warnings(mla_result["rows"])
    warn_if_busy(monitor, info)
    print_report(info, opts, bandwidth, rows, append_rows, o1_rows, o1_s,
                 wire_result=wire_result, mla_result=mla_result, sync_rows=sync_rows,
                 runner_rows=runner_rows)
    if args.json:
        write_json(args.json, info, opts, bandwidth, rows, append_rows, o1_rows, o1_s,
                   wire_result=wire_result, mla_result=mla_result, sync_rows=sync_rows,
                   runner_rows=runner_rows)
        print(f"raw results written to {args.json}")
    if args.plot and rows:
        write_plot(args.plot, rows, bandwidth)
        print(f"chart written to {args.plot}")
    if args.plot and mla_result:
        path = mla_plot_path(args.plot) if rows else args.plot
        write_mla_plot(path, mla_result)
        print(f"MLA chart written to {path}")
    return 0
