"""A llama-style CPU runner on kvcache: Hugging Face checkpoints decoded through kvcache's caches.

:class:`Runner` loads a checkpoint folder (``config.json`` and ``*.safetensors``, sharded or
not, read with the ``safetensors`` package's NumPy loader) or a GGUF file (llama.cpp's format:
tensors dequantised to float32 at load, configuration, tokenizer and chat template from its
metadata, :mod:`~kvcache.runner.gguf`) of the Llama, Mistral, Qwen2 or Gemma-2 family and runs
it in NumPy float32, with every attention layer's K/V in a
:class:`kvcache.KvCache` and attention computed by kvcache's kernels:

- grouped-query attention, RoPE with the config's theta and scaling (``default``, ``linear``,
  ``llama3``), RMSNorm (Gemma's ``1 + w`` form), SwiGLU / GeGLU MLPs, Qwen2's q/k/v biases,
  Mistral's sliding window, Gemma-2's attention-logit softcap, final-logit softcap,
  ``query_pre_attn_scalar``, alternating sliding/global layers and sandwich norms, tied
  embeddings;
- prefill runs the prompt in chunks ending at multiples of ``prefill_chunk`` (default 256)
  absolute positions, grouped in steps of ``prefill_step`` (default at least 512, and a chunk
  per usable CPU up to 8) positions that each go
  through every layer before the next (per layer and step: the chunks' products, ``append`` of
  their positions, one ``attend_all_heads`` of their queries); the bits do not depend on the
  step; decode runs one position per step;
- a prefix store (``store=`` of :meth:`Runner.prefill` and :meth:`Runner.generate`, a
  :class:`kvcache.store.PrefixStore` or a backend spec) supplies the prompt's stored leading
  positions, bit-identical to computing them, keyed by :attr:`Runner.fingerprint`;
- KV storage f32, q8 or 4-bit (``kv="q8"``, ``kv="q4"``, any name
  :meth:`kvcache.KvMode.parse` accepts), and the O(1) Nystrom override on chosen layers
  (``o1_layers``): those layers seal the prompt at the end of the prefill and decode with
  ``o1_step`` in constant time and memory;
- greedy or temperature / top-p sampling (:meth:`Runner.generate`), and speculative rollback
  (:meth:`Runner.truncate_last`, the same on every layer).

Both config layouts are read: transformers 5's ``rope_parameters`` / ``layer_types`` and the
4.x ``rope_theta`` / ``rope_scaling`` keys (with Gemma-2's even layers sliding, as 4.x did).
Which layers slide is the rule :mod:`kvcache.hf` uses too (``kvcache._windows``).

``python -m kvcache generate`` (:func:`main`) is the command-line front end; ``python -m
kvcache eval`` (:mod:`kvcache.evaluate`) measures what a KV mode or the O(1) override costs in
quality on a checkpoint and a text.

The package, one job per module:

- :mod:`~kvcache.runner.config`: :class:`ModelConfig`, family defaults, reading config.json,
  the O(1) layer selection (:func:`parse_layers`);
- :mod:`~kvcache.runner.weights`: reading safetensors, the fused per-layer products,
  random checkpoints;
- :mod:`~kvcache.runner.gguf`: GGUF files (weights, config, tokenizer, chat template);
- :mod:`~kvcache.runner.model`: :class:`Runner`, the forward pass and decoding, and
  :func:`load_checkpoint` and :func:`load_checkpoint_tokenizer` (a GGUF file or a folder, as
  ``Runner.from_pretrained`` reads it);
- :mod:`~kvcache.runner.sampling`: greedy and top-p sampling (:func:`sample`);
- :mod:`~kvcache.runner.cli`: ``python -m kvcache generate`` (:func:`main`).

Numerics: float32 throughout (NumPy matmuls for the projections and the MLP), RoPE angles as
transformers computes them (float32 inverse frequencies times the position); the parity tests
against transformers hold prompt logits and 32 greedy steps to 1e-4.
"""

from __future__ import annotations

from .cli import build_parser, main
from .config import FAMILIES, ModelConfig, parse_layers, read_config
from .gguf import load_gguf, load_tokenizer
from .model import Runner, load_checkpoint, load_checkpoint_tokenizer
from .sampling import sample
from .weights import load_safetensors, random_weights

__all__ = ["FAMILIES", "ModelConfig", "Runner", "build_parser", "load_checkpoint",
           "load_checkpoint_tokenizer", "load_gguf", "load_safetensors", "load_tokenizer", "main",
           "parse_layers", "random_weights", "read_config", "sample"]
