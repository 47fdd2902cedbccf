"""``python -m kvcache eval``: how far a KV mode or the O(1) override moves a model's output.

The question a user asks before choosing ``kv="q8"`` or ``o1_layers=...`` for a model: on my
text, how much worse does the model predict?  :func:`evaluate` answers it per configuration,
teacher-forced, against the exact float32 cache as the baseline:

1. the text is tokenised with the checkpoint's tokenizer; the first ``prompt_tokens`` tokens
   (P) are the prompt, the next ``tokens`` (N) are scored;
2. each configuration's :class:`~kvcache.runner.Runner` prefills the prompt (O(1) layers seal
   it, as they do for a user), then decodes the N scored tokens one step at a time, as a user
   decodes: the logits of position t predict token t+1, the first scored token is predicted
   by the prefill's last logits, and the true token (not the model's choice) is fed next;
3. per configuration: perplexity ``exp(-mean log p(token))`` over the N tokens, its ratio to
   f32's, the mean and max over the N positions of the KL divergence
   ``KL(p_f32 || p_config)`` of the next-token distributions, top-1 agreement (share of the
   positions whose argmax equals f32's), KV memory after the last step
   (:meth:`Runner.memory_bytes`: rows, scales and the O(1) state) and decode tokens/s (the
   N steps' wall time, scoring included).

``prompt_tokens=0`` scores from the second token on (the first one is the prompt: a
prediction needs a context).  Configuration names (:func:`parse_config`):

- ``f32`` and any KV mode name :meth:`kvcache.KvMode.parse` accepts (``q8``, ``q8k``, ...),
  passed through as the runner's ``kv``;
- ``o1:<layers>`` with ``<layers>`` as the runner's ``o1_layers`` reads it (``all``,
  ``deepN``: the N deepest global layers, ``auto``, or a list ``3+7+11``; on the command line
  ``o1:3,7,11`` works too), f32 storage;
- ``o1:<layers>:m=64,w=256,sink=4,keep=128,ridge=1e-3,max_error=0.1``: the O(1) parameters
  (any of them; the others keep the runner's defaults: 32, 128, 4, 0, the specified ridge, or
  ``O1_AUTO_PARAMS`` for ``auto``) and the seal's error bound (``o1_max_error``).

f32 is always computed first (the baseline), whether listed or not.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

import numpy as np
import numpy.typing as npt

from ._progress import ProgressBar, progress_bar
from .modes import KvMode
from ._version import __version__
from .o1 import RIDGE

__all__ = ["EvalConfig", "build_parser", "evaluate", "main", "parse_config", "split_configs"]

#: The O(1) parameters an ``o1:`` configuration may set, in the runner's ``o1_params`` order
#: (``m``, ``w``, ``sink``, ``keep`` integers, ``ridge`` a float), and ``max_error`` (the
#: runner's ``o1_max_error``).
O1_KEYS = ("m", "w", "sink", "keep", "ridge")
_DEFAULT_O1 = (32, 128, 4, 0, RIDGE)
_NUM = r"(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?"
_PARAM = re.compile(rf"^((m|w|sink|keep)=\d+|(ridge|max_error)={_NUM})$")


@dataclass(frozen=True)
class EvalConfig:
    """One configuration of an evaluation: its name and the runner keywords it stands for.

    ``o1_params`` None: the runner's default for the layer choice (``O1_AUTO_PARAMS`` for
    ``auto``); ``o1_max_error`` None: the runner's default bound (none, or
    ``O1_AUTO_MAX_ERROR`` for ``auto``)."""

    name: str
    kv: str = "f32"
    o1_layers: str | None = None
    o1_params: tuple[float, ...] | None = None
    o1_max_error: float | None = None

    def runner_kwargs(self) -> dict[str, Any]:
        """The keywords of :class:`kvcache.runner.Runner` for this configuration."""
        kw: dict[str, Any] = {"kv": self.kv}
        if self.o1_layers is not None:
            kw.update(o1_layers=self.o1_layers, o1_params=self.o1_params,
                      o1_max_error=self.o1_max_error)
        return kw


def split_configs(text: str) -> list[str]:
    """``--configs``' comma-separated names, with the commas inside an ``o1:`` name kept:
    ``"f32,o1:deep15:m=64,w=256,q8"`` -> ``["f32", "o1:deep15:m=64,w=256", "q8"]`` (a piece
    ``key=value``, or a layer number while the name has no parameters yet, continues the
    ``o1:`` name before it: ``"o1:0,3,5:m=16"`` is one name)."""
    out: list[str] = []
    for piece in (p.strip() for p in text.split(",")):
        if not piece:
            continue
        if out and out[-1].startswith("o1:"):
            last = out[-1]
            has_params = last.count(":") >= 2
            if _PARAM.match(piece) and has_params:
                out[-1] = f"{last},{piece}"
                continue
            if _PARAM.match(piece):
                out[-1] = f"{last}:{piece}"
                continue
            if re.match(r"^\d+(:|$)", piece) and not has_params:
                out[-1] = f"{last}+{piece}"
                continue
        out.append(piece)
    return out


def parse_config(name: str) -> EvalConfig:
    """The :class:`EvalConfig` of a configuration name (module docstring); ValueError naming
    the problem for a malformed one."""
    name = name.strip()
    if name.startswith("o1:"):
        parts = name.split(":")
        if len(parts) > 3 or not parts[1]:
            raise ValueError(f"config {name!r}: expected o1:<layers> or o1:<layers>:m=M,w=W,"
                             f"sink=S,keep=K,ridge=R,max_error=E")
        layers = parts[1].replace("+", ",")
        given: dict[str, float] = {}
        if len(parts) == 3:
            for item in parts[2].split(","):
                if not _PARAM.match(item.strip()):
                    raise ValueError(f"config {name!r}: O(1) parameter {item!r}: expected "
                                     f"m=, w=, sink=, keep= (integers), ridge= or max_error= "
                                     f"(numbers)")
                key, value = item.strip().split("=")
                given[key] = float(value) if key in ("ridge", "max_error") else int(value)
        max_error = given.pop("max_error", None)
        params: tuple[float, ...] | None = None
        if given:
            from .runner.model import O1_AUTO_PARAMS
            base = O1_AUTO_PARAMS if layers.strip().lower() == "auto" else _DEFAULT_O1
            params = tuple(given.get(k, b) for k, b in zip(O1_KEYS, base))
        return EvalConfig(name=name, o1_layers=layers, o1_params=params, o1_max_error=max_error)
    KvMode.parse(name, "config")         # ValueError naming the config for an unknown mode
    return EvalConfig(name=name, kv=name)


@dataclass
class ConfigResult:
    """What :func:`evaluate` measured for one configuration (``error`` when it could not
    run)."""

    name: str
    perplexity: float = float("nan")
    ratio: float = float("nan")
    mean_kl: float = float("nan")
    max_kl: float = float("nan")
    top1: float = float("nan")
    kv_bytes: int = 0
    decode_tok_s: float = float("nan")
    prefill_s: float = float("nan")
    o1_sealed: list[int] = field(default_factory=list)
    error: str | None = None

    def as_json(self) -> dict[str, Any]:
        def clean(v: Any) -> Any:
            return None if isinstance(v, float) and math.isnan(v) else v
        return {k: clean(v) for k, v in self.__dict__.items()}


def _log_softmax(logits: npt.NDArray[np.float32]) -> npt.NDArray[np.float64]:
    x = logits.astype(np.float64)
    x = x - x.max()
    out: npt.NDArray[np.float64] = x - np.log(np.exp(x).sum())
    return out


def _run_one(runner: Any, ids: npt.NDArray[np.int64], n_prompt: int, n_tokens: int,
             on_progress: Callable[[int], None],
             visit: Callable[[int, npt.NDArray[np.float64]], None]) -> tuple[float, float]:
    """Prefill ``ids[:n_prompt]`` and decode the next ``n_tokens`` teacher-forced, calling
    ``visit(t, log_probs)`` for the distribution that predicts ``ids[n_prompt + t]``; returns
    (prefill seconds, decode seconds)."""
    done = [0]

    def prog(d: int, total: int) -> None:
        on_progress(d - done[0])
        done[0] = d

    t0 = time.perf_counter()
    logits = runner.prefill(ids[:n_prompt], progress=prog)
    prefill_s = time.perf_counter() - t0
    on_progress(n_prompt - done[0])
    t0 = time.perf_counter()
    for t in range(n_tokens):
        visit(t, _log_softmax(logits))
        on_progress(1)
        if t + 1 < n_tokens:
            logits = runner.step(int(ids[n_prompt + t]))
    return prefill_s, time.perf_counter() - t0


def evaluate(model: Any, ids: Sequence[int] | npt.NDArray[Any], configs: Sequence[str], *,
             prompt_tokens: int, tokens: int, progress: bool = True,
             weights: Any = None) -> list[ConfigResult]:
    """Teacher-forced quality and speed of each configuration against f32 (module docstring).

    Parameters
    ----------
    model : str or os.PathLike or ModelConfig
        A checkpoint (folder or GGUF file), or a :class:`~kvcache.runner.ModelConfig` with
        ``weights`` (Hugging Face names).
    ids : sequence of int
        The text's token ids; at least ``max(prompt_tokens, 1) + tokens`` of them.
    configs : sequence of str
        Configuration names (:func:`parse_config`); f32 is added first when absent.
    prompt_tokens, tokens : int
        P and N.
    progress : bool
        A progress bar on stderr over every configuration's positions.

    Returns
    -------
    list of ConfigResult
        f32 first, then the others in the given order.  A configuration the runner refuses
        (its error message) is reported with ``error`` set; the others still run.
    """
    from .runner import ModelConfig, Runner, load_checkpoint

    parsed = [parse_config(c) for c in configs]
    names = [c.name for c in parsed]
    if "f32" not in names:
        parsed.insert(0, parse_config("f32"))
    else:
        parsed.insert(0, parsed.pop(names.index("f32")))
    if len(set(c.name for c in parsed)) != len(parsed):
        raise ValueError(f"configs: a configuration is listed twice: {names}")
    n_prompt = max(int(prompt_tokens), 1)
    n_tokens = int(tokens)
    if n_tokens < 1:
        raise ValueError(f"tokens: expected >= 1, got {tokens}")
    arr = np.asarray(ids, dtype=np.int64).reshape(-1)
    if arr.shape[0] < n_prompt + n_tokens:
        raise ValueError(f"the text has {arr.shape[0]} tokens; {n_prompt} prompt and "
                         f"{n_tokens} scored tokens need {n_prompt + n_tokens}")
    arr = arr[: n_prompt + n_tokens]
    if isinstance(model, ModelConfig):
        cfg, w = model, weights
    else:
        cfg, w = load_checkpoint(model)
    targets = arr[n_prompt:]
    base_lp = np.empty((n_tokens, cfg.vocab_size), dtype=np.float32)
    base_top = np.empty(n_tokens, dtype=np.int64)
    bar: ProgressBar = progress_bar(len(parsed) * (n_prompt + n_tokens), progress, unit="pos")
    results: list[ConfigResult] = []
    try:
        for k, conf in enumerate(parsed):
            res = ConfigResult(conf.name)
            results.append(res)
            bar.set_postfix_str(conf.name)
            try:
                runner = Runner(cfg, w, max_seq_len=n_prompt + n_tokens,
                                **conf.runner_kwargs())
            except (ValueError, TypeError, KeyError) as exc:
                res.error = str(exc)
                bar.update(n_prompt + n_tokens)
                continue
            nll = np.empty(n_tokens)
            kl = np.zeros(n_tokens)
            agree = np.zeros(n_tokens, dtype=bool)

            def visit(t: int, lp: npt.NDArray[np.float64], first: bool = k == 0) -> None:
                nll[t] = -lp[targets[t]]
                top = int(np.argmax(lp))
                if first:
                    base_lp[t] = lp
                    base_top[t] = top
                    agree[t] = True
                else:
                    p = base_lp[t].astype(np.float64)
                    kl[t] = max(float(np.sum(np.exp(p) * (p - lp))), 0.0)
                    agree[t] = top == base_top[t]

            prefill_s, decode_s = _run_one(runner, arr, n_prompt, n_tokens, bar.update, visit)
            res.perplexity = float(np.exp(nll.mean()))
            res.ratio = res.perplexity / results[0].perplexity
            res.mean_kl, res.max_kl = float(kl.mean()), float(kl.max())
            res.top1 = float(agree.mean())
            res.kv_bytes = runner.memory_bytes()
            res.decode_tok_s = (n_tokens - 1) / decode_s if n_tokens > 1 and decode_s > 0 \
                else float("nan")
            res.prefill_s = prefill_s
            res.o1_sealed = [i for i in runner.o1_layers if runner.cache.layers[i].o1_sealed()]
            del runner
    finally:
        bar.close()
    return results


def format_table(results: Sequence[ConfigResult]) -> str:
    """The results as a text table (one row per configuration)."""
    headers = ["config", "perplexity", "ratio", "mean KL", "max KL", "top-1", "KV memory",
               "decode tok/s"]
    rows: list[list[str]] = []
    for r in results:
        if r.error is not None:
            rows.append([r.name, "error (below)"] + ["-"] * 6)
            continue
        name = r.name
        if r.o1_sealed:
            name += f" ({len(r.o1_sealed)} sealed)"
        rows.append([name, f"{r.perplexity:.4f}", f"{r.ratio:.4f}", f"{r.mean_kl:.2e}",
                     f"{r.max_kl:.2e}", f"{100 * r.top1:.1f}%",
                     f"{r.kv_bytes / 2 ** 20:.2f} MiB", f"{r.decode_tok_s:.1f}"])
    notes = [f"{r.name}: {r.error}" for r in results if r.error is not None]
    return "\n".join([_table(headers, rows)] + notes)


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A right-aligned text table, the name column left-aligned (the library does not import
    the benchmark's table helpers)."""
    cells = [list(headers)] + [list(r) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([line(cells[0]), line(["-" * w for w in widths])]
                     + [line(r) for r in cells[1:]])


def _encode_text(model: str, path: str) -> list[int]:
    from .runner import load_checkpoint_tokenizer
    tokenizer = load_checkpoint_tokenizer(model)
    if tokenizer is None:
        raise ValueError(f"{model}: no tokenizer (tokenizer.json in the folder, or a GGUF "
                         f"file's tokenizer.* metadata) to encode the text")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    return list(tokenizer.encode(text).ids)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m kvcache eval``."""
    p = argparse.ArgumentParser(
        prog="python -m kvcache eval",
        description="Teacher-forced perplexity, KL from f32, top-1 agreement, KV memory and "
                    "decode speed of KV modes and O(1) layer choices on a checkpoint and a "
                    "text (docs/eval.md).")
    p.add_argument("--model", required=True, metavar="PATH",
                   help="checkpoint folder (config.json + *.safetensors + tokenizer.json) or "
                        "GGUF file")
    p.add_argument("--text", required=True, metavar="FILE", help="UTF-8 text to score")
    p.add_argument("--tokens", type=int, default=256, metavar="N",
                   help="tokens scored after the prompt (default 256)")
    p.add_argument("--prompt-tokens", type=int, default=512, metavar="P",
                   help="tokens prefilled before the scored ones (default 512; 0 scores from "
                        "the second token on)")
    p.add_argument("--configs", default="f32,q8", metavar="NAMES",
                   help="comma-separated: f32, any KV mode name (q8, q8k, q8v, ...), "
                        "o1:<layers>[:m=M,w=W,sink=S,keep=K,ridge=R,max_error=E] with layers all, deepN, auto or 3+7+11 "
                        "(default f32,q8; f32 is always computed, as the baseline)")
    p.add_argument("--json", metavar="OUT", help="also write the results as JSON to OUT")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def main(argv: Sequence[str] | None = None, file: IO[str] | None = None) -> int:
    """Entry point of ``python -m kvcache eval``; returns the exit status."""
    out = sys.stdout if file is None else file
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.tokens < 1:
        parser.error(f"--tokens must be >= 1, got {args.tokens}")
    if args.prompt_tokens < 0:
        parser.error(f"--prompt-tokens must be >= 0, got {args.prompt_tokens}")
    try:
        names = split_configs(args.configs)
        for n in names:
            parse_config(n)
    except ValueError as exc:
        parser.error(f"--configs: {exc}")
    t0 = time.perf_counter()
    try:
        ids = _encode_text(args.model, args.text)
        results = evaluate(args.model, ids, names, prompt_tokens=args.prompt_tokens,
                           tokens=args.tokens, progress=not args.no_progress)
    except (ValueError, TypeError, KeyError, OSError, ImportError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    wall = time.perf_counter() - t0
    n_prompt = max(args.prompt_tokens, 1)
    print(f"model: {args.model}; text: {args.text} ({len(ids)} tokens); prompt {n_prompt} "
          f"tokens, {args.tokens} scored; wall {wall:.1f} s", file=out)
    print(format_table(results), file=out)
    if args.json:
        doc = {"kvcache": __version__,
               "date": time.strftime("%Y-%m-%d", time.gmtime()),
               "model": os.fspath(args.model), "text": os.fspath(args.text),
               "text_tokens": len(ids), "prompt_tokens": n_prompt, "tokens": args.tokens,
               "configs": names, "wall_s": wall, "results": [r.as_json() for r in results]}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
    return 1 if any(r.error is not None for r in results) else 0
