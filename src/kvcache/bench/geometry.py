"""Model shapes the sections share (Llama-3-8B, Qwen2.5-0.5B), storage modes and random rows.

Method: ``docs/benchmark-method.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from .._stores import specs_of
from ..modes import KvMode


F32 = npt.NDArray[np.float32]   # float32 arrays the workloads build and hand to the caches

MiB = 1 << 20
GiB = 1 << 30
MAX_LAYERS = 4096            # bounds object count for tiny layers (Qwen q8 at 1k is ~0.27 MiB)
MODE_NAMES = ("f32", "q8")


@dataclass(frozen=True)
class Geometry:
    """Attention shape of one model layer."""

    key: str
    label: str
    num_heads: int
    num_kv_heads: int
    head_dim: int

    def step_bytes(self, context: int, mode_name: str) -> int:
        """Bytes of K and V rows (and q8 scales) one decode step reads at ``context`` rows."""
        specs = specs_of(make_mode(mode_name), self.head_dim)
        return self.num_kv_heads * context * sum(spec.row_bytes for _, spec in specs)


GEOMETRIES = {g.key: g for g in (Geometry("llama3-8b", "Llama-3-8B", 32, 8, 128),
                                 Geometry("qwen2.5-0.5b", "Qwen2.5-0.5B", 14, 2, 64))}
GEOMETRY_ALIASES = {"llama": "llama3-8b", "qwen": "qwen2.5-0.5b"}


def make_mode(mode_name: str) -> KvMode:
    """The mode a name stands for (any name :meth:`KvMode.parse` accepts)."""
    return KvMode.parse(mode_name, "mode")


def mode_name(mode: KvMode) -> str:
    """The short name of a mode: "f32", "q8", "q8k", "q8v", "k8v4" or "q4v" (the scheme
    left out)."""
    return mode.name.partition(":")[0]


def random_kv(geom: Geometry, context: int, seed: int = 0) -> tuple[F32, F32]:
    """K and V rows of shape (context, num_kv_heads, head_dim), float32 standard normal."""
    rng = np.random.default_rng(seed)
    shape = (context, geom.num_kv_heads, geom.head_dim)
    return (rng.standard_normal(shape, dtype=np.float32),
            rng.standard_normal(shape, dtype=np.float32))


def random_query(geom: Geometry, seed: int = 1) -> F32:
    """A decode query of shape (num_heads, head_dim), float32."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((geom.num_heads, geom.head_dim), dtype=np.float32)


def layer_count(layer_bytes: int, working_set: int, max_layers: int = MAX_LAYERS) -> int:
    """Layers needed so that ``layer_count * layer_bytes >= working_set`` (at least 1)."""
    return max(1, min(max_layers, -(-working_set // max(layer_bytes, 1))))
