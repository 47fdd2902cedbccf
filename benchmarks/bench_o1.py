"""asv-style benchmarks of the O(1) Nystrom decode step against exact attention.

Each class builds its workload in ``setup`` with :class:`kvcache.bench.O1Decode` (the same code
the O(1) section of ``python -m kvcache bench`` times): a Llama-3-8B layer (32 query heads,
8 KV heads, head_dim 128) whose ``context``-position prompt -- the ``clustered`` synthetic data
of :class:`kvcache.bench.SyntheticStream` -- is sealed with m=32, w=128, sink=4, beside exact
f32 and q8 layers holding the same rows.

* ``time_o1_step``: one ``o1_step`` on the sealed layer.  The layer just keeps stepping (its
  cost does not depend on how many steps were taken: the state has a fixed size).
* ``time_exact_step``: ``append(k, v)`` + ``attend_all_heads(q)`` of the newest position over
  ``context`` rows, then ``truncate_last(1)`` -- inside the timed function here (asv times the
  whole call; the rollback only moves a length), so the length stays ``context``.
* ``track_state_bytes`` / ``track_exact_bytes``: ``memory_bytes()`` of the sealed layer and of
  the exact layer; ``track_rel_err``: relative L2 error of the O(1) outputs against exact f32
  over 16 decode steps.

Unlike the CLI these run with warm caches (asv repeats a call back to back) and one thread
count; ``python -m kvcache bench --sections o1`` prints the cold, interleaved, multi-thread
table.  Set ``KVCACHE_BENCH_O1_CONTEXTS`` (e.g. ``1024``) for a smaller smoke run.
"""

import os

from kvcache import bench

GEOMETRY = bench.GEOMETRIES["llama3-8b"]
CONTEXTS = [int(c) for c in
            os.environ.get("KVCACHE_BENCH_O1_CONTEXTS", "1024,32768").split(",") if c.strip()]
MODES = list(bench.MODE_NAMES)


class O1Step:
    """One O(1) decode step (``o1_step``) of a sealed layer; memory and error of the seal."""

    params = (CONTEXTS,)
    param_names = ["context"]
    timeout = 600
    warmup_time = 0.5

    def setup(self, context):
        self.work = bench.O1Decode(GEOMETRY, context, "clustered", exact_modes=("f32",))
        self.err = self.work.errors()["o1"]
        del self.work.exact["f32"]                           # only the sealed layer is timed

    def teardown(self, context):
        del self.work

    def time_o1_step(self, context):
        self.work.o1_step()

    def track_state_bytes(self, context):
        return self.work.state_bytes()

    track_state_bytes.unit = "bytes"

    def track_rel_err(self, context):
        return self.err

    track_rel_err.unit = "relative L2"


class ExactStep:
    """One exact decode step (append + attend_all_heads + truncate_last(1)), f32 and q8."""

    params = (CONTEXTS, MODES)
    param_names = ["context", "mode"]
    timeout = 600
    warmup_time = 0.5

    def setup(self, context, mode):
        self.work = bench.O1Decode(GEOMETRY, context, "clustered", exact_modes=(mode,),
                                   decode_steps=1, with_o1=False)
        self.layer = self.work.exact[mode]

    def teardown(self, context, mode):
        del self.work, self.layer

    def time_exact_step(self, context, mode):
        self.work.exact_step(mode)
        self.layer.truncate_last(1)

    def track_exact_bytes(self, context, mode):
        return self.layer.memory_bytes()

    track_exact_bytes.unit = "bytes"
