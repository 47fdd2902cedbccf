"""GGUF checkpoints for the runner: weights, configuration, tokenizer and chat template.

A GGUF file (llama.cpp's format) holds everything a checkpoint folder holds, in one file: the
tensors (quantised or not) under llama.cpp's names, and metadata key/value pairs that describe
the model (``<arch>.block_count``, ``<arch>.attention.head_count``, ...), the tokenizer
(``tokenizer.ggml.*``) and the chat template (``tokenizer.chat_template``).  This module reads
the header itself (:class:`_Reader`, ``struct`` over a memory map) and takes the tensor types
and their dequantisation from the ``gguf`` package (``pip install gguf``, or the
``kvcache[runner]`` extra):

- :func:`load_gguf` returns the :class:`~kvcache.runner.ModelConfig` and the weights, every
  tensor dequantised to float32 at load (``gguf.quants.dequantize``: F32, F16, BF16, Q8_0,
  Q4_0, Q4_1, Q5_0, Q5_1, the K-quants Q2_K..Q6_K, the IQ types) and renamed to the Hugging
  Face names the runner reads, so a GGUF file and the folder transformers dequantises it to
  give the same runner;
- :func:`load_tokenizer` builds a ``tokenizers.Tokenizer`` from ``tokenizer.ggml.*``:
  byte-level BPE (``tokenizer.ggml.model = "gpt2"``: SmolLM2, Qwen2, Llama 3) and
  SentencePiece BPE (``"llama"``: Llama 2, Mistral, Gemma), with the control tokens as
  special tokens;
- :func:`chat_template` and :func:`render_chat` keep and apply the chat template (a Jinja
  template, rendered with jinja2, which transformers depends on too; imported when used).

Families (``general.architecture``): ``llama`` (Mistral's files use it too; like llama.cpp,
the runner decodes them without a sliding window unless ``llama.attention.sliding_window`` is
set), ``qwen2``, ``qwen3``, ``gemma2`` and ``gemma3`` (the text model: llama.cpp converts
Gemma 3's language model alone).  Gemma 3 as llama.cpp's loader fixes it: sliding layers five
in six with RoPE base 10,000, ``gemma3.rope.freq_base`` and a linear scaling on the global
layers.  Two keys that loader does not read are honoured when a file carries them:
``gemma3.attention.sliding_window_pattern`` (a period, or one flag per layer) and
``gemma3.rope.freq_base_swa``.  A file without ``gemma3.attention.sliding_window`` is
refused (llama.cpp would decode it without a window).
Three differences from the safetensors layout are undone at load:

- llama.cpp stores a Llama checkpoint's q and k projections with the rows of every head
  permuted (its rotary pairs dimension ``2j`` with ``2j+1``, transformers pairs ``j`` with
  ``j + head_dim/2``); :func:`_unpermute` puts them back, as transformers' GGUF loader does;
- Gemma stores its RMSNorm gains as ``1 + w``; llama.cpp stores them (Gemma 3's q/k norms
  included) with the 1 added, the runner (like transformers) wants ``w``;
- the metadata is translated to a transformers ``config.json`` dict and read by
  :meth:`ModelConfig.from_hf`, so family defaults and the sliding-window rule are the ones the
  folder loader uses;
- llama 3.1 / 3.2's RoPE scaling arrives as the tensor ``rope_freqs.weight`` (one factor per
  frequency) instead of config keys: the runner divides each default frequency by its factor,
  as llama.cpp does (``rope_type`` ``"freq_factors"``); its frequencies then differ from
  transformers' ``llama3`` ones by float32 rounding only.

Anything the runner does not compute (another architecture, a tensor type the ``gguf``
package cannot dequantise, per-layer head counts, a missing field) is refused with a
one-line ValueError naming the field or tensor.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from .config import ModelConfig
from .weights import Array

__all__ = ["ARCHITECTURES", "chat_template", "gguf_metadata", "is_gguf", "load_gguf",
           "load_tokenizer", "render_chat"]

#: ``general.architecture`` values the runner decodes, and the family each one maps to.
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
                 "gemma3": "gemma3_text"}

#: llama.cpp tensor names (after ``blk.{i}.``) -> Hugging Face names (after
#: ``model.layers.{i}.``); the Gemmas' extra norms in :data:`_GEMMA_NORMS`.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GEMMA_NORMS = {"ffn_norm": "pre_feedforward_layernorm",
                 "post_attention_norm": "post_attention_layernorm",
                 "post_ffw_norm": "post_feedforward_layernorm"}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


def is_gguf(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` is a file that starts with GGUF's magic bytes."""
    p = os.fspath(path)
    if not os.path.isfile(p):
        return False
    with open(p, "rb") as f:
        return f.read(4) == b"GGUF"


class _Tensor:
    """One tensor of a GGUF file: its name, ggml type and shape (ggml order, fastest dimension
    first) and its bytes (a read-only view of the mapped file, ``(rows, row_bytes)``)."""

    def __init__(self, name: str, tensor_type: Any, shape: tuple[int, ...],
                 data: npt.NDArray[np.uint8]) -> None:
        self.name, self.tensor_type, self.shape, self.data = name, tensor_type, shape, data


class _Reader:
    """A GGUF file's metadata and tensors (format: llama.cpp's ``docs/gguf.md``, versions 2
    and 3, little-endian).

    The ``gguf`` package's ``GGUFReader`` builds a NumPy view per string of the metadata,
    which took 17 s for the 100,000 strings of a 49k vocabulary here; this reads the header
    with ``struct`` (0.2 s) and maps the tensor data with NumPy, and still takes the types and
    their block sizes, and the dequantisation, from the ``gguf`` package."""

    _SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                10: "<Q", 11: "<q", 12: "<d"}
    _STRING, _ARRAY = 8, 9

    def __init__(self, path: str) -> None:
        try:
            import gguf
        except ImportError:
            raise ImportError("reading GGUF files needs the gguf package: pip install gguf (or "
                              "the kvcache[runner] extra)") from None
        self.path = path
        self.buf = np.memmap(path, dtype=np.uint8, mode="r")
        self.mv = memoryview(self.buf)  # type: ignore[arg-type]
        self.pos = 0
        try:
            self._parse(gguf)
        except (struct.error, IndexError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path}: not a readable GGUF file (truncated or damaged: "
                             f"{exc})") from None

    def _unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        (v,) = struct.unpack_from(fmt, self.mv, self.pos)
        self.pos += size
        return v

    def _str(self) -> str:
        n = self._unpack("<Q")
        s = bytes(self.mv[self.pos: self.pos + n]).decode("utf-8")
        if len(s.encode()) != n:
            raise IndexError("a string runs past the end of the file")
        self.pos += n
        return s

    def _value(self, vtype: int) -> Any:
        if vtype == self._STRING:
            return self._str()
        if vtype == self._ARRAY:
            itype, n = self._unpack("<I"), self._unpack("<Q")
            if itype in self._SCALARS:
                dt = np.dtype(self._SCALARS[itype])
                arr = np.frombuffer(self.mv, dtype=dt, count=n, offset=self.pos)
                self.pos += n * dt.itemsize
                return arr.tolist()
            return [self._value(itype) for _ in range(n)]
        if vtype in self._SCALARS:
            return self._unpack(self._SCALARS[vtype])
        raise ValueError(f"{self.path}: metadata value type {vtype} is unknown")

    def _parse(self, gguf: Any) -> None:
        if bytes(self.mv[:4]) != b"GGUF":
            raise ValueError(f"{self.path}: not a GGUF file (the magic bytes are "
                             f"{bytes(self.mv[:4])!r})")
        self.pos = 4
        version = self._unpack("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF: GGUF.version {version} is not supported; expected 2 or 3")
        n_tensors, n_kv = self._unpack("<Q"), self._unpack("<Q")
        self.fields: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._str()
            self.fields[key] = self._value(self._unpack("<I"))
        infos = []
        for _ in range(n_tensors):
            name = self._str()
            dims = tuple(self._unpack("<Q") for _ in range(self._unpack("<I")))
            infos.append((name, self._unpack("<I"), dims, self._unpack("<Q")))
        align = int(self.fields.get("general.alignment", 32))
        start = -(-self.pos // align) * align
        self.tensors: list[_Tensor] = []
        for name, code, dims, offset in infos:
            try:
                qtype = gguf.GGMLQuantizationType(code)
            except ValueError:
                raise ValueError(f"GGUF: tensor {name!r} has type {code}, unknown to the gguf "
                                 f"package") from None
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            if dims[0] % block:
                raise ValueError(f"GGUF: tensor {name!r} has rows of {dims[0]} values, not a "
                                 f"multiple of {qtype.name}'s block of {block}")
            row_bytes = dims[0] // block * size
            rows = int(np.prod(dims[1:], dtype=np.int64)) if len(dims) > 1 else 1
            lo = start + offset
            if lo + rows * row_bytes > len(self.buf):
                raise ValueError(f"GGUF: tensor {name!r} runs past the end of the file")
            data = np.asarray(self.buf[lo: lo + rows * row_bytes]).reshape(rows, row_bytes)
            self.tensors.append(_Tensor(name, qtype, dims, data))


def _reader(path: str | os.PathLike[str]) -> _Reader:
    return _Reader(os.fspath(path))


def gguf_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Every metadata field of GGUF file ``path`` as Python values (strings, numbers, lists),
    under llama.cpp's key names."""
    return _reader(path).fields


class _Meta:
    """Metadata lookups that name the missing field."""

    def __init__(self, meta: Mapping[str, Any], arch: str) -> None:
        self.meta, self.arch = meta, arch

    def get(self, key: str, default: Any = None) -> Any:
        return self.meta.get(key.replace("{arch}", self.arch), default)

    def need(self, key: str) -> Any:
        full = key.replace("{arch}", self.arch)
        if full not in self.meta:
            raise ValueError(f"GGUF: the metadata field {full!r} is missing")
        return self.meta[full]

    def int(self, key: str, default: int | None = None) -> int:
        v = self.need(key) if default is None else self.get(key, default)
        if isinstance(v, list):
            if len(set(v)) != 1:
                raise ValueError(f"GGUF: {key.replace('{arch}', self.arch)} varies per layer "
                                 f"({v[:4]}...); the runner needs one value for every layer")
            v = v[0]
        return int(v)


def _hf_config(meta: Mapping[str, Any], tensor_names: Sequence[str]) -> dict[str, Any]:
    """The transformers ``config.json`` dict the metadata describes (refusing what the runner
    does not compute)."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF: general.architecture {arch!r} is not supported; expected one of "
                         f"{', '.join(ARCHITECTURES)}")
    m = _Meta(meta, str(arch))
    nh = m.int("{arch}.attention.head_count")
    hidden = m.int("{arch}.embedding_length")
    hd = m.int("{arch}.attention.key_length", hidden // nh)
    if m.int("{arch}.attention.value_length", hd) != hd:
        raise ValueError(f"GGUF: {arch}.attention.value_length differs from key_length ({hd}); "
                         f"the runner needs one head size")
    if m.int("{arch}.rope.dimension_count", hd) != hd:
        raise ValueError(f"GGUF: {arch}.rope.dimension_count ({m.get('{arch}.rope.dimension_count')}) "
                         f"is not the head size {hd}; partial rotary is not supported")
    vocab = m.get("{arch}.vocab_size")
    if vocab is None:
        tokens = meta.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise ValueError(f"GGUF: neither {arch}.vocab_size nor tokenizer.ggml.tokens is "
                             f"present; the vocabulary size is unknown")
        vocab = len(tokens)
    cfg: dict[str, Any] = {
        "model_type": ARCHITECTURES[str(arch)],
        "num_hidden_layers": m.int("{arch}.block_count"),
        "hidden_size": hidden, "intermediate_size": m.int("{arch}.feed_forward_length"),
        "num_attention_heads": nh,
        "num_key_value_heads": m.int("{arch}.attention.head_count_kv", nh),
        "head_dim": hd, "vocab_size": int(vocab),
        "rms_norm_eps": float(m.need("{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(m.get("{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": m.int("{arch}.context_length", 0) or None,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    scaling = m.get("{arch}.rope.scaling.type", "none")
    if scaling == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear",
                               "factor": float(m.need("{arch}.rope.scaling.factor"))}
    elif scaling != "none":
        raise ValueError(f"GGUF: {arch}.rope.scaling.type {scaling!r} is not supported; "
                         f"expected 'none' or 'linear'")
    window = m.get("{arch}.attention.sliding_window")
    if arch == "llama":
        cfg["attention_bias"] = any(n.endswith("attn_q.bias") for n in tensor_names)
        if window:                              # a Mistral file that says it slides
            cfg["model_type"], cfg["sliding_window"] = "mistral", int(window)
    elif arch in ("qwen2", "qwen3"):
        cfg["use_sliding_window"] = False
    elif arch in ("gemma2", "gemma3"):
        cfg["hidden_activation"] = "gelu_pytorch_tanh"
        cfg["sliding_window"] = int(m.need("{arch}.attention.sliding_window"))
        cfg["final_logit_softcapping"] = m.get("{arch}.final_logit_softcapping")
        # llama.cpp's rule: the 27B models (Gemma-2: 46 layers, Gemma 3: 62) scale by hidden /
        # heads, the others by the head size; transformers' configs say the same through
        # query_pre_attn_scalar
        big = 46 if arch == "gemma2" else 62
        cfg["query_pre_attn_scalar"] = (hidden // nh if cfg["num_hidden_layers"] == big else hd)
        if arch == "gemma2":
            cfg["attn_logit_softcapping"] = m.get("{arch}.attn_logit_softcapping")
        else:
            cfg["rope_local_base_freq"] = float(m.get("{arch}.rope.freq_base_swa", 10000.0))
            _gemma3_pattern(m, cfg)
    return cfg


def _gemma3_pattern(m: _Meta, cfg: dict[str, Any]) -> None:
    """Gemma 3's sliding layers: ``{arch}.attention.sliding_window_pattern`` as a period (layer
    i slides unless ``(i + 1) % period == 0``) or one flag per layer (true: sliding); llama.cpp's
    period 6 when the field is missing."""
    key = "{arch}.attention.sliding_window_pattern"
    pattern = m.get(key)
    n = int(cfg["num_hidden_layers"])
    if pattern is None:
        cfg["sliding_window_pattern"] = 6
    elif isinstance(pattern, list):
        if len(pattern) != n:
            raise ValueError(f"GGUF: {key.replace('{arch}', m.arch)} has {len(pattern)} entries "
                             f"for {n} layers")
        cfg["layer_types"] = ["sliding_attention" if f else "full_attention" for f in pattern]
    elif isinstance(pattern, int) and not isinstance(pattern, bool) and pattern >= 1:
        cfg["sliding_window_pattern"] = pattern
    else:
        raise ValueError(f"GGUF: {key.replace('{arch}', m.arch)} must be a period >= 1 or one "
                         f"flag per layer, got {pattern!r}")


def _hf_name(name: str, config: ModelConfig) -> str | None:
    """The Hugging Face name of llama.cpp tensor ``name`` in a checkpoint of ``config`` (None
    for one the runner does not know: q/k norms outside Qwen3 and Gemma 3 included)."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or not parts[1].isdigit():
        return None
    _, i, base, kind = parts
    table = dict(_LAYER_NAMES, **_GEMMA_NORMS) if config.gemma else _LAYER_NAMES
    if base not in table or (base in ("attn_q_norm", "attn_k_norm") and not config.qk_norm):
        return None
    return f"model.layers.{i}.{table[base]}.{kind}"


def _unpermute(w: Array, n_head: int) -> Array:
    """Undo llama.cpp's row permutation of a Llama q or k projection (or bias): within each
    head, rows ``(j, 2)`` become ``(2, j)``, i.e. the interleaved rotary pairs go back to the
    rotate-half layout transformers and the runner use."""
    half = w.shape[0] // n_head // 2
    out = w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    return np.ascontiguousarray(out, dtype=np.float32)


def _dequantize(tensor: _Tensor) -> Array:
    """One tensor as a float32 array in NumPy order (rows = ggml's last dimension)."""
    from gguf import quants
    try:
        arr = quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise ValueError(f"GGUF: tensor {tensor.name!r} has type {tensor.tensor_type.name}, "
                         f"which the gguf package cannot dequantise") from None
    shape = tuple(int(d) for d in reversed(tensor.shape))
    out = np.ascontiguousarray(np.asarray(arr, dtype=np.float32).reshape(shape))
    if not out.flags.writeable:          # an F32 tensor is a view of the mapped file: copy it,
        out = out.copy()                 # so the runner does not depend on the file staying
    return out


_ROPE_FREQS = "rope_freqs.weight"


def _freq_factors(tensor: _Tensor, hf: Mapping[str, Any]) -> dict[str, Any]:
    """llama 3's per-frequency RoPE factors (``rope_freqs.weight``, what llama.cpp's converter
    writes for a ``llama3`` rope_scaling) as the runner's ``freq_factors`` scaling: frequency
    i is the default ``rope_theta ** (-2 i / head_dim)`` divided by factor i, as llama.cpp
    computes it.  ValueError for a second scaling or factors that do not fit."""
    if "rope_scaling" in hf:
        raise ValueError(f"GGUF: both '{_ROPE_FREQS}' and a rope.scaling.type are given")
    f = _dequantize(tensor).reshape(-1)
    half = int(hf["head_dim"]) // 2
    if f.shape != (half,) or not (np.isfinite(f).all() and (f > 0).all()):
        raise ValueError(f"GGUF: '{_ROPE_FREQS}' must hold head_dim / 2 = {half} positive "
                         f"finite factors, got shape {f.shape}")
    return {"rope_type": "freq_factors", "factors": [float(x) for x in f]}


def load_gguf(path: str | os.PathLike[str]) -> tuple[ModelConfig, dict[str, Array]]:
    """The :class:`ModelConfig` and float32 weights (Hugging Face names) of GGUF file
    ``path``; ValueError naming the field or tensor for anything unsupported."""
    reader = _reader(path)
    meta = reader.fields
    names = [t.name for t in reader.tensors]
    hf = _hf_config(meta, names)
    for tensor in reader.tensors:
        if tensor.name == _ROPE_FREQS:
            hf["rope_scaling"] = _freq_factors(tensor, hf)
    config = ModelConfig.from_hf(hf)
    unknown = [n for n in names if n != _ROPE_FREQS and _hf_name(n, config) is None]
    if unknown:
        raise ValueError(f"GGUF: {len(unknown)} tensors are not used by the {config.family} "
                         f"runner (e.g. {', '.join(unknown[:4])})")
    weights: dict[str, Array] = {}
    for tensor in reader.tensors:
        if tensor.name == _ROPE_FREQS:
            continue
        key = _hf_name(tensor.name, config)
        assert key is not None
        w = _dequantize(tensor)
        if meta["general.architecture"] == "llama":       # q/k rows permuted by llama.cpp
            if ".attn_q." in tensor.name:
                w = _unpermute(w, config.num_heads)
            elif ".attn_k." in tensor.name:
                w = _unpermute(w, config.num_kv_heads)
        if config.gemma and tensor.name.endswith("norm.weight"):
            w = np.ascontiguousarray(w - np.float32(1.0), dtype=np.float32)
        weights[key] = w
    return config, weights


# ---------------------------------------------------------------- tokenizer
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE spells every token in it)."""
    keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
            + list(range(ord("®"), ord("ÿ") + 1)))
    chars = list(keep)
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(keep, (chr(c) for c in chars)))


#: ``tokenizer.ggml.pre`` values whose pre-tokenizer splits text with another regex than
#: GPT-2's (llama.cpp's names; the regexes are the models' own).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
           "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}
#: ``tokenizer.ggml.pre`` values that use GPT-2's own pre-tokenizer.
_GPT2_PRE = ("default", "gpt2", "smollm", "gpt-2")

_CONTROL, _USER_DEFINED = 3, 4


def _merges_from_scores(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """SentencePiece BPE merges implied by a vocabulary and its scores: every split of a token
    into two tokens of the vocabulary, best score (then the split's own ranks) first."""
    rank = {t: i for i, t in enumerate(tokens)}
    merges: list[tuple[float, int, int, str, str]] = []
    for tok, score in zip(tokens, scores):
        for cut in range(1, len(tok)):
            a, b = tok[:cut], tok[cut:]
            if a in rank and b in rank:
                merges.append((-float(score), rank[a], rank[b], a, b))
    merges.sort()
    return [(a, b) for _, _, _, a, b in merges]


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """The ``tokenizers.Tokenizer`` that GGUF file ``path`` describes (``tokenizer.ggml.*``).

    ``encode(text)`` adds the BOS token when ``tokenizer.ggml.add_bos_token`` says so (default:
    yes for SentencePiece, no for byte-level BPE, as llama.cpp); control tokens
    (``<|im_start|>``, ...) are special tokens, matched whole in the text."""
    try:
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
        from tokenizers import pre_tokenizers, processors
    except ImportError:
        raise ImportError("a GGUF tokenizer needs the tokenizers package: pip install tokenizers "
                          "(or the kvcache[runner] extra)") from None
    meta = gguf_metadata(path)
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError("GGUF: the metadata field 'tokenizer.ggml.tokens' is missing")
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if kind == "gpt2":
        spelling = _bytes_to_unicode()
        alphabet = set(spelling.values())
        vocab = {(t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode())): i
                 for i, t in enumerate(tokens)}
        if "tokenizer.ggml.merges" not in meta:
            raise ValueError("GGUF: the metadata field 'tokenizer.ggml.merges' is missing (a "
                             "byte-level BPE vocabulary needs its merges)")
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        pre = meta.get("tokenizer.ggml.pre", "default")
        if pre in _SPLITS:
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        elif pre in _GPT2_PRE:
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        else:
            raise ValueError(f"GGUF: tokenizer.ggml.pre {pre!r} is not supported; expected one "
                             f"of {', '.join(sorted(set(_SPLITS) | set(_GPT2_PRE)))}")
        tok.decoder = decoders.ByteLevel()
        add_bos_default = False
        special_ok: set[str] | None = alphabet
    elif kind == "llama":
        scores = meta.get("tokenizer.ggml.scores")
        if scores is None:
            raise ValueError("GGUF: the metadata field 'tokenizer.ggml.scores' is missing (a "
                             "SentencePiece vocabulary needs its scores)")
        vocab = {t: i for i, t in enumerate(tokens)}
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]] \
            if "tokenizer.ggml.merges" in meta else _merges_from_scores(tokens, scores)
        unk_id = meta.get("tokenizer.ggml.unknown_token_id")
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True,
                                   fuse_unk=True,
                                   unk_token=tokens[unk_id] if unk_id is not None else None))
        prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        tok.normalizer = normalizers.Sequence(
            ([normalizers.Prepend("▁")] if prefix else []) + [normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
            + ([decoders.Strip(" ", 1, 0)] if prefix else []))
        add_bos_default = True
        special_ok = None
    else:
        raise ValueError(f"GGUF: tokenizer.ggml.model {kind!r} is not supported; expected "
                         f"'gpt2' (byte-level BPE) or 'llama' (SentencePiece BPE)")
    control = [AddedToken(t, normalized=False, special=True)
               for t, ty in zip(tokens, types)
               if ty == _CONTROL and (special_ok is None or set(t) <= special_ok)]
    tok.add_special_tokens(control)
    user = [AddedToken(t, normalized=False, special=False)
            for t, ty in zip(tokens, types) if ty == _USER_DEFINED]
    tok.add_tokens(user)
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)) and bos is not None:
        name = tokens[bos]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{name} $A", pair=f"{name} $A {name} $B", special_tokens=[(name, int(bos))])
    return tok


# ---------------------------------------------------------------- chat template
def chat_template(path: str | os.PathLike[str]) -> str | None:
    """The chat template of a GGUF file (``tokenizer.chat_template``) or of a checkpoint folder
    (``chat_template.jinja``, else ``tokenizer_config.json``'s ``chat_template``); None when
    there is none."""
    p = os.fspath(path)
    if os.path.isdir(p):
        jinja = os.path.join(p, "chat_template.jinja")
        if os.path.exists(jinja):
            with open(jinja) as f:
                return f.read()
        conf = os.path.join(p, "tokenizer_config.json")
        if os.path.exists(conf):
            import json
            with open(conf) as f:
                value = json.load(f).get("chat_template")
            return value if isinstance(value, str) else None
        return None
    value = gguf_metadata(p).get("tokenizer.chat_template")
    return value if isinstance(value, str) else None


def render_chat(template: str, messages: Sequence[Mapping[str, str]], *,
                bos_token: str = "", eos_token: str = "",
                add_generation_prompt: bool = True) -> str:
    """``messages`` (``[{"role": "user", "content": ...}, ...]``) rendered by the Jinja chat
    ``template`` in a sandbox, as transformers' ``apply_chat_template`` renders it (the text;
    encode it without adding special tokens)."""
    try:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ImportError("a chat template needs the jinja2 package: pip install jinja2") from None

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        text: str = env.from_string(template).render(
            messages=list(messages), bos_token=bos_token, eos_token=eos_token,
            add_generation_prompt=add_generation_prompt)
    except TemplateError as exc:
        raise ValueError(f"chat template: {exc}") from None
    return text
