"""The runner section: decode tokens/s of ``kvcache.runner.Runner`` against transformers' own
``generate`` on the same random-weight model.

Method: ``docs/benchmark-method.md``.
"""

from __future__ import annotations

import gc
import logging
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .geometry import F32, MiB
from .machine import package_version
from .registry import Context, Option, Result, Section, Values, at_least, parse_context, register
from .tables import Row, context_label, fmt, fmt_ratio, render_table, section_text

if TYPE_CHECKING:
    from .._progress import ProgressBar
    from ..runner import Runner

KvRows = list[tuple[F32, F32]]   # per layer: K and V rows of shape (context, nkv, head_dim)

log = logging.getLogger("kvcache.bench")


# runner section: kvcache.runner vs transformers generate on one random-weight model
RUNNER_CONTEXTS, QUICK_RUNNER_CONTEXTS = (512, 4096, 16384), (512,)
RUNNER_STEPS, QUICK_RUNNER_STEPS = 16, 8
RUNNER_MODEL: dict[str, int] = dict(
    vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
    num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=32768)


class RunnerVsTransformers:
    """One random-weight Llama-style model in transformers and in :class:`kvcache.runner.Runner`
    (the same float32 weights), with caches filled to a context of the same random K/V rows.

    Parameters
    ----------
    model_kwargs : dict, optional
        ``transformers.LlamaConfig`` arguments (default ``RUNNER_MODEL``).
    """

    def __init__(self, model_kwargs: Mapping[str, Any] | None = None, seed: int = 0) -> None:
        import torch
        import transformers

        from ..runner import ModelConfig, Runner
        self.torch = torch
        torch.manual_seed(seed)
        cfg = transformers.LlamaConfig(**(model_kwargs or RUNNER_MODEL))
        cfg._attn_implementation = "sdpa"
        self.model = transformers.LlamaForCausalLM(cfg)
        self.model.train(False)                    # eval mode (what .eval() does)
        self.model.generation_config.eos_token_id = None
        self.cfg = cfg
        self.weights = {k: v.detach().numpy() for k, v in self.model.state_dict().items()}
        self.rcfg = ModelConfig.from_hf(cfg.to_dict())
        self.runner_class = Runner
        self.nkv = int(cfg.num_key_value_heads or cfg.num_attention_heads)
        self.hd = self.rcfg.head_dim
        self.seed = seed

    def kv_rows(self, context: int) -> KvRows:
        """Random K/V rows for every layer, the same for both sides."""
        rng = np.random.default_rng([self.seed, context])
        shape = (context, self.nkv, self.hd)
        return [(rng.standard_normal(shape, dtype=np.float32),
                 rng.standard_normal(shape, dtype=np.float32))
                for _ in range(self.cfg.num_hidden_layers)]

    def runner(self, rows: KvRows, kv: str) -> Runner:
        """A Runner whose cache holds ``rows`` (storage ``kv``), positioned after them."""
        context = rows[0][0].shape[0]
        r = self.runner_class(self.rcfg, self.weights, kv=kv, max_seq_len=context + 4096)
        for layer, (k, v) in zip(r.cache.layers, rows):
            layer.append(k, v)
        r.position = context
        return r

    def time_runner(self, rows: KvRows, kv: str, steps: int, token: int) -> dict[str, Any]:
        """Step times, attention times, first logits and cache bytes of ``steps`` runner
        steps after ``token``."""
        r = self.runner(rows, kv)
        first = r.step(token)
        tok = int(np.argmax(first))
        times: list[float] = []
        att: list[float] = []
        for _ in range(steps):
            a0, t0 = r.timings["attention_s"], time.perf_counter()
            tok = int(np.argmax(r.step(tok)))
            times.append(time.perf_counter() - t0)
            att.append(r.timings["attention_s"] - a0)
        return {"step_s": times, "attention_s": att, "first_logits": first,
                "cache_bytes": r.memory_bytes()}

    def time_transformers(self, rows: KvRows, steps: int, token: int) -> dict[str, Any]:
        """Step intervals and first logits of transformers' ``generate`` from the same cache."""
        torch = self.torch
        from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList
        cache = DynamicCache(config=self.cfg)
        for i, (k, v) in enumerate(rows):
            cache.update(torch.from_numpy(np.ascontiguousarray(k.transpose(1, 0, 2)))[None],
                         torch.from_numpy(np.ascontiguousarray(v.transpose(1, 0, 2)))[None], i)
        stamps: list[float] = []

        class Stamp(LogitsProcessor):
            def __call__(self, input_ids: Any, scores: Any) -> Any:
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


def run_runner(ctx: Context, values: Values, bar: ProgressBar) -> Result:
    """The runner section: per context, the runner (f32, q8) and transformers in turn;
    ``{"rows": [...], "model": ..., "skipped": why not measured or ""}``."""
    try:
        work = RunnerVsTransformers(seed=ctx.seed)
    except ImportError as exc:
        log.warning("runner section skipped: it needs torch and transformers (%s)", exc)
        return {"rows": [], "model": RUNNER_MODEL, "skipped": str(exc)}
    rows: list[Row] = []
    token = 17
    for context in values.contexts:
        bar.set_postfix_str(f"runner {context_label(context)}")
        kv = work.kv_rows(context)
        rec: Row = {"context": context, "steps": values.steps}
        first = None
        for mode in ("f32", "q8"):
            res = work.time_runner(kv, mode, values.steps, token)
            med = statistics.median(res["step_s"])
            rec[mode] = {"tokens_per_s": 1.0 / med, "step_ms": 1e3 * med,
                         "attention_share": sum(res["attention_s"]) / sum(res["step_s"]),
                         "cache_bytes": res["cache_bytes"], "step_samples_s": res["step_s"]}
            if first is None:
                first = res["first_logits"]
            gc.collect()
        hf = work.time_transformers(kv, values.steps, token)
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
    return {"rows": rows, "model": RUNNER_MODEL, "skipped": ""}


def runner_table(rows: Sequence[Row]) -> str:
    """The runner table: one row per context."""
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


def runner_notes(rows: Sequence[Row], values: Values) -> list[str]:
    """Method lines (and any logits warning) printed under the runner table."""
    out = [f"median of {values.steps} greedy steps per side; transformers "
           f"{package_version('transformers')} generate (sdpa, DynamicCache), torch "
           f"{package_version('torch')}; model: Llama-style, {RUNNER_MODEL}",
           "attn = share of the runner's step time in append + attend_all_heads",
           "threads: the runner decodes with BLAS on 1 thread; kvcache picks its count per "
           "call (its adaptive default, docs/threads.md); torch uses its own default pool"]
    for r in rows:
        if r["max_abs_logit_diff"] > 1e-3:
            out.append(f"WARNING: at {context_label(r['context'])} the first-step logits differ "
                       f"by {r['max_abs_logit_diff']:.2g} (> 1e-3)")
    return out


def runner_report(ctx: Context, values: Values, result: Result) -> str:
    """The runner table and its notes ("" when the section was skipped)."""
    rows = result["rows"]
    if not rows:
        return ""
    return section_text("decode tokens/s: kvcache.runner vs transformers generate, the same "
                        "random-weight model and cache contents:", [runner_table(rows)],
                        runner_notes(rows, values))


SECTION = register(Section(
    name="runner", order=70,
    help="decode tokens/s of kvcache.runner vs transformers generate (needs torch and "
         "transformers)",
    options=(Option("contexts", "prompt lengths", RUNNER_CONTEXTS, parse_context,
                    QUICK_RUNNER_CONTEXTS, many=True, metavar="T"),
             Option("steps", "decode steps timed per side", RUNNER_STEPS, at_least(2),
                    QUICK_RUNNER_STEPS, metavar="N")),
    tasks=lambda ctx, values: len(values.contexts), run=run_runner, report=runner_report))
