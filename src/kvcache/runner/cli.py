"""``python -m kvcache generate``: decode a checkpoint (or a small random model) from the shell.

:func:`main` parses the command line, loads the model through :class:`~kvcache.runner.Runner`,
encodes the prompt with the checkpoint's tokenizer (the folder's ``tokenizer.json``, or the one
a GGUF file describes) when there is one (``--chat``: as a user message rendered by the
checkpoint's chat template), generates with a
progress bar on stderr (one over the prompt's positions first, when the prompt takes more than
two prefill steps) and prints the output with prefill / decode rates and the cache size.
``--store`` names a prefix store (a folder or a Redis URL) whose hit is reported on stderr.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import IO, Any

from .._progress import ProgressBar, progress_bar
from ..modes import KvMode
from .config import ModelConfig
from .model import Runner, load_checkpoint_tokenizer

__all__ = ["build_parser", "main"]


def _chat_ids(path: str, tokenizer: Any, cfg: ModelConfig, text: str) -> list[int]:
    """``text`` as one user message rendered by the checkpoint's chat template (ValueError
    without one), encoded as the template wrote it (special tokens included)."""
    from .gguf import chat_template, render_chat
    template = chat_template(path)
    if template is None:
        raise ValueError(f"--chat: {path} has no chat template (tokenizer.chat_template, "
                         f"chat_template.jinja or tokenizer_config.json's chat_template)")

    def token(i: int | None) -> str:
        return "" if i is None else str(tokenizer.id_to_token(i) or "")

    eos = cfg.eos_token_id[0] if cfg.eos_token_id else None
    rendered = render_chat(template, [{"role": "user", "content": text}],
                           bos_token=token(cfg.bos_token_id), eos_token=token(eos))
    return list(tokenizer.encode(rendered, add_special_tokens=False).ids)


def _kv_name(text: str) -> str:
    """``--kv``: a mode name as :meth:`kvcache.KvMode.parse` reads it (checked, kept as typed)."""
    try:
        KvMode.parse(text, "--kv")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--kv: ")) from None
    return text


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m kvcache generate``."""
    p = argparse.ArgumentParser(
        prog="python -m kvcache generate",
        description="Decode with a Llama / Mistral / Qwen2 / Gemma-2 checkpoint on kvcache. "
                    "Without --model, a small random-weight Llama built in memory is used.")
    p.add_argument("--model", metavar="PATH",
                   help="checkpoint folder (config.json + *.safetensors [+ tokenizer.json]) "
                        "or GGUF file (model.gguf: weights dequantised to float32)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text (needs the checkpoint's tokenizer: "
                                      "tokenizer.json in the folder, or the GGUF file's)")
    src.add_argument("--ids", nargs="+", metavar="ID",
                     help="prompt token ids (e.g. --ids 1 15043 29892 or --ids 1,15043)")
    p.add_argument("--chat", action="store_true",
                   help="send --prompt as a user message through the checkpoint's chat template "
                        "(the answer stops at the end-of-turn token)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="default 64")
    p.add_argument("--kv", default="f32", type=_kv_name,
                   metavar="{f32,q8,q8k,q8v,q8:cmf,q4,k8v4,q4k,q4v,k4v8}",
                   help="KV storage (default f32; q8 names use the int8 scheme 'rows', ':cmf' "
                        "the legacy column-freeze scheme; q4 and k8v4 4-bit, docs/kv4.md; any "
                        "name KvMode.parse accepts)")
    p.add_argument("--o1", metavar="LAYERS",
                   help="O(1) Nystrom layers: all, deepN, or a list like 0,5,7 (default none)")
    p.add_argument("--o1-params", metavar="M,W,SINK[,KEEP[,RIDGE]]",
                   help="O(1) landmarks, window, sinks, kept far keys and ridge (default: "
                        "32,128,4; with --o1 auto the runner's O1_AUTO_PARAMS)")
    p.add_argument("--o1-max-error", type=float, metavar="E",
                   help="seal only the O(1) layers whose estimated error is at most E "
                        "(default: no bound; 0.1 with --o1 auto)")
    p.add_argument("--blas-threads", type=int, metavar="N",
                   help="BLAS control (docs/threads.md, \"BLAS\"): default adaptive, from the "
                        "CPUs free now; N >= 1 caps it, 0 leaves BLAS alone")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass (default 1)")
    p.add_argument("--seed", type=int, help="sampler seed")
    p.add_argument("--store", metavar="DIR|redis://HOST:PORT/DB",
                   help="prefix store: load the prompt's stored leading positions instead of "
                        "computing them, and store its new full blocks (a folder, e.g. "
                        "~/.cache/kvcache, or a Redis URL); the output is the same as without "
                        "it, the hit is reported on stderr; not with --o1")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bars (prompt positions for long prompts, new tokens)")
    return p


def _prompt_ids(args: argparse.Namespace, tokenizer: Any, cfg: ModelConfig,
                parser: argparse.ArgumentParser) -> list[int]:
    if args.ids:
        try:
            return [int(t) for v in args.ids for t in v.split(",") if t.strip()]
        except ValueError:
            parser.error(f"--ids: expected integers, got {' '.join(args.ids)}")
    if args.prompt is not None:
        if tokenizer is None:
            parser.error("--prompt needs a tokenizer (tokenizer.json in the --model folder, or "
                         "a GGUF file) and the tokenizers package; pass --ids instead")
        if args.chat:
            return _chat_ids(args.model, tokenizer, cfg, args.prompt)
        return list(tokenizer.encode(args.prompt).ids)
    if tokenizer is not None:
        return list(tokenizer.encode("Once upon a time").ids)
    bos = cfg.bos_token_id if cfg.bos_token_id is not None else 1
    return [bos] + list(range(2, 9))


class _PromptBar:
    """The prefill's ``progress(done, total)`` as a bar over prompt positions, made at the
    first step when more than ``least`` positions are computed (a short prompt shows none)."""

    def __init__(self, least: int, enabled: bool) -> None:
        self.least, self.enabled = least, enabled
        self.bar: ProgressBar | None = None
        self.done = 0

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None and self.done == 0 and total > self.least:
            self.bar = progress_bar(total, self.enabled, unit="pos")
        if self.bar is not None:
            self.bar.update(done - self.done)
        self.done = done

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def main(argv: Sequence[str] | None = None, file: IO[str] | None = None) -> int:
    """Entry point of ``python -m kvcache generate``; returns the exit status."""
    out = sys.stdout if file is None else file
    parser = build_parser()
    args = parser.parse_args(argv)
    o1_params: tuple[float, ...] | None = None
    if args.o1_params is not None:
        parts = args.o1_params.split(",")
        try:
            o1_params = tuple(int(v) for v in parts[:4]) + tuple(float(v) for v in parts[4:])
        except ValueError:
            parser.error(f"--o1-params: expected M,W,SINK[,KEEP] integers and a RIDGE number, "
                         f"got {args.o1_params!r}")
        if not 3 <= len(o1_params) <= 5:
            parser.error(f"--o1-params: expected M,W,SINK[,KEEP[,RIDGE]], got {args.o1_params!r}")
    if args.chat and (args.prompt is None or not args.model):
        parser.error("--chat needs --prompt and a --model with a tokenizer and chat template")
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.blas_threads is not None and args.blas_threads < 0:
        parser.error(f"--blas-threads must be >= 0, got {args.blas_threads}")
    kwargs: dict[str, Any] = dict(kv=args.kv, o1_layers=args.o1, o1_params=o1_params,
                                  o1_max_error=args.o1_max_error, blas_threads=args.blas_threads)
    try:
        t0 = time.perf_counter()
        if args.model:
            runner = Runner.from_pretrained(args.model, **kwargs)
            name = args.model
        else:
            runner = Runner.random(**kwargs)
            name = "embedded random-weight Llama (4 layers, 256 wide, vocab 512)"
        load_s = time.perf_counter() - t0
        if args.o1 and not runner.o1_layers:
            print(f"warning: --o1 {args.o1!r} selects no global layer of this "
                  f"{runner.config.num_layers}-layer model; decoding exactly", file=sys.stderr)
        try:
            tokenizer = load_checkpoint_tokenizer(args.model)
        except (ImportError, ValueError) as exc:
            if args.prompt is not None:
                raise
            print(f"warning: {exc}; printing token ids", file=sys.stderr)
            tokenizer = None
        prompt = _prompt_ids(args, tokenizer, runner.config, parser)
        if not prompt:
            parser.error("the prompt is empty")
        prompt_bar = _PromptBar(2 * runner.prefill_step, not args.no_progress)
        bar = progress_bar(args.max_new_tokens, not args.no_progress, unit="tok")
        t0 = time.perf_counter()
        first: list[float] = []

        def on_token(tok: int) -> None:
            if not first:
                first.append(time.perf_counter())
            bar.update()

        try:
            tokens = runner.generate(prompt, args.max_new_tokens, temperature=args.temperature,
                                     top_p=args.top_p, seed=args.seed, callback=on_token,
                                     store=args.store, progress=prompt_bar)
        finally:
            prompt_bar.close()
        end = time.perf_counter()
        bar.close()
        if args.store:
            print(f"store: loaded {runner.store_loaded} of {len(prompt)} prompt tokens",
                  file=sys.stderr)
    except (ValueError, TypeError, KeyError, OSError, ImportError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    prefill_s = first[0] - t0
    decode_n = len(tokens) - 1
    decode_s = end - first[0]
    def p(text: str) -> None:
        print(text, file=out)

    sealed = [i for i in runner.o1_layers if runner.cache.layers[i].o1_sealed()]
    o1_text = ""
    if runner.o1_layers:
        o1_text = f", O(1) layers {sealed}"
        if sealed != list(runner.o1_layers):
            o1_text += (f" (seal refused on {sorted(set(runner.o1_layers) - set(sealed))}: "
                        f"decoded exactly)")
    p(f"model: {name} ({runner.config.family}, {runner.config.num_layers} layers), kv "
      f"{args.kv}{o1_text}, loaded in {load_s:.2f} s")
    shown = prompt if tokenizer is None else repr(
        tokenizer.decode(prompt, skip_special_tokens=False) if args.chat
        else args.prompt or tokenizer.decode(prompt))
    p(f"prompt ({len(prompt)} tokens): {shown}")
    p(f"output ({len(tokens)} tokens): "
      + (repr(tokenizer.decode(tokens)) if tokenizer is not None else str(tokens)))
    p(f"prefill: {len(prompt)} tokens in {prefill_s * 1e3:.1f} ms "
      f"({len(prompt) / prefill_s:.1f} tokens/s, first token included)")
    if decode_n > 0:
        p(f"decode: {decode_n} tokens in {decode_s * 1e3:.1f} ms ({decode_n / decode_s:.2f} "
          f"tokens/s)")
    share = runner.timings["attention_s"] / max(runner.timings["total_s"], 1e-12)
    p(f"attention share of the run: {100 * share:.0f}%")
    p(f"cache memory: {runner.memory_bytes() / 1024:.1f} KiB for {runner.position} positions")
    return 0
