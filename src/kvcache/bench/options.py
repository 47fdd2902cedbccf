"""The resolved settings of one benchmark run and the list of sections.

Method: ``docs/benchmark-method.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .contention import (
    CONDITIONS, CONTENTION_CALLS, CONTENTION_CONTEXTS, CONTENTION_PREFILL_TOKENS,
    CONTENTION_RUNNER_CONTEXT, PREFILL_CALLS)
from .geometry import Geometry
from .mla import (
    MLA_CONTEXTS, MLA_FMA_ITERS, MLA_NAIVE_MAX_CONTEXT, MLA_NAIVE_REPEATS, MLA_REPEATS,
    MLA_WORKING_SET)
from .o1 import O1_CONTEXTS, O1_REPEATS
from .realmodel import REALMODEL_CONTEXTS, REALMODEL_STEPS, REALMODEL_TTFT_REPEATS
from .runner import RUNNER_CONTEXTS, RUNNER_STEPS
from .store import STORE_CONTEXTS, STORE_REPEATS
from .sync import SYNC_CONTEXT, SYNC_FULL_REPEATS, SYNC_STEPS
from .timing import BANDWIDTH_BUFFER
from .wire import WIRE_CONTEXT, WIRE_REPEATS, WIRE_SAVE_LAYERS


SECTIONS = ("decode", "append", "o1", "wire", "mla", "sync", "runner", "store", "prefill",
            "contention", "realmodel")
#: Sections that run only when ``--sections`` names them (they need an optional download).
OPT_IN_SECTIONS = ("realmodel",)


@dataclass
class Options:
    """Resolved command-line settings."""

    geometries: list[Geometry]
    contexts: list[int]
    modes: list[str]
    threads: list[int]
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
    o1_contexts: Sequence[int] = O1_CONTEXTS
    o1_repeats: int = O1_REPEATS
    wire: bool = True
    wire_context: int = WIRE_CONTEXT
    wire_repeats: int = WIRE_REPEATS
    wire_save_layers: int = WIRE_SAVE_LAYERS
    mla: bool = True
    mla_contexts: Sequence[int] = MLA_CONTEXTS
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
    runner_contexts: Sequence[int] = RUNNER_CONTEXTS
    runner_steps: int = RUNNER_STEPS
    store: bool = True
    store_contexts: Sequence[int] = STORE_CONTEXTS
    store_repeats: int = STORE_REPEATS
    prefill: bool = True
    prefill_quick: bool = False
    contention: bool = True
    contention_contexts: Sequence[int] = CONTENTION_CONTEXTS
    contention_calls: int = CONTENTION_CALLS
    contention_conditions: Sequence[str] = CONDITIONS
    contention_runner_context: int = CONTENTION_RUNNER_CONTEXT
    contention_runner_model: str = "bench"
    contention_prefill_tokens: Sequence[int] = CONTENTION_PREFILL_TOKENS
    contention_prefill_calls: int = PREFILL_CALLS
    realmodel: bool = False
    realmodel_contexts: Sequence[int] = REALMODEL_CONTEXTS
    realmodel_steps: int = REALMODEL_STEPS
    realmodel_ttft_repeats: int = REALMODEL_TTFT_REPEATS
