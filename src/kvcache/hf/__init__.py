"""Hugging Face transformers integration: a ``Cache`` stored in kvcache, and kvcache attention.

Importing this module registers an attention implementation named ``"kvcache"`` with
transformers, so a causal language model loaded with it decodes through kvcache's grouped-query
kernels, reading K/V straight from a :class:`kvcache.LayerKvCache` per decoder layer::

    import kvcache.hf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = "path/to/checkpoint"          # a local folder: config.json, *.safetensors, tokenizer
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="kvcache")
    input_ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    cache = kvcache.hf.HfKvCache(model.config, mode="q8")      # or "f32" (the default)
    out = model.generate(input_ids, max_new_tokens=64, do_sample=False, cache=cache)
    # (transformers < 5.24 names that argument past_key_values; kvcache.hf.generate picks the name)

How the pieces fit
------------------
transformers' attention modules call ``cache.update(key, value, layer_idx)`` with the new
positions' keys and values, then the registered attention function with the queries.
:meth:`HfKvCache.update` appends the new rows to the layer's :class:`~kvcache.LayerKvCache` and
returns the *new* key/value tensors unchanged (no concatenated copy of the history is built),
with the layer attached to the key tensor.  :func:`kvcache_attention` finds the layer there and
calls :meth:`~kvcache.LayerKvCache.attend_all_heads` once for the whole block of queries
(``scale`` = the module's ``scaling``, ``window`` = the ``sliding_window`` the model passes,
``softcap`` = Gemma-2's ``attn_logit_softcapping``).  The n queries of a block attend causally
to every stored row up to their own, so a prefill is one call and a decode step is one call.
Tensors cross to NumPy without copies where their layout allows (``Tensor.numpy()``).

Masks.  kvcache attention is causal by construction, with the sliding window applied in the
kernel, so no mask tensor is ever built: the mask function registered under the same name
returns None.  Left padding (a 2-D ``attention_mask`` whose rows have zeros before their first
one) is left out instead: the mask function returns a marker carrying each row's count of
leading zeros, an :class:`HfKvCache` never stores those positions (it still counts them in
``get_seq_length``, as transformers does), the per-row path below skips them, and the padding
queries' outputs are zeros nobody reads.  It raises instead of silently ignoring what it cannot
express: other zeros (right padding, holes) and mask overlays (image-token or packed-sequence
masks, bidirectional attention).  An explicit 4-D mask passed by the caller is refused by the
attention function.  transformers' sliding mask (``kv_idx > q_idx - window`` and
``kv_idx <= q_idx``) is exactly kvcache's ``window=w``: the last ``w`` rows up to and including
the query's own.

Prefix store.  :func:`cache_from_store` starts ``generate`` from a stored prompt prefix: it
returns an :class:`HfKvCache` holding the prompt's stored leading blocks (read from a
:class:`kvcache.store.PrefixStore`) and how many positions that is; ``generate`` given the
whole prompt and that cache computes only the rest (transformers feeds the positions past the
cache's length).  :func:`store_cache` stores a cache's full blocks afterwards::

    from kvcache.store import PrefixStore
    store = PrefixStore("~/.cache/kvcache", fingerprint="my-model@rev")  # names model+weights
    cache, n_loaded = kvcache.hf.cache_from_store(store, model, input_ids, mode="q8")
    out = kvcache.hf.generate(model, input_ids, cache=cache, max_new_tokens=64)
    kvcache.hf.store_cache(store, cache, out[0])   # the sequence whose positions it holds

Long prompts.  :func:`prefill` feeds a prompt to ``model(...)`` in steps of ``step`` positions
(default :data:`DEFAULT_PREFILL_STEP`, 512) with an :class:`HfKvCache`, so the model's
activations and products hold one step's rows instead of the whole prompt's, and returns the
last position's logits; :func:`generate` does the same for the prompt with ``prefill_step=``::

    logits, cache = kvcache.hf.prefill(model, input_ids, mode="q8", step=512)
    out = kvcache.hf.generate(model, input_ids, max_new_tokens=64, prefill_step=512)

Each step's queries attend to every row stored before them, so the result is the one-shot
prefill's up to float32 rounding (PyTorch's products of a step's rows differ from those of
the whole prompt in the low bits).

The fingerprint is the caller's: a string that changes whenever the weights do (a model id with
its revision or a hash of the checkpoint files); entries stored under one never match another.
The loaded rows are the ones an earlier run computed; PyTorch computes the rest as a shorter
block than a run without the store would, so logits agree to float32 rounding (not bit for
bit, unlike :class:`kvcache.runner.Runner`) and greedy tokens normally match.

Without an :class:`HfKvCache` (``use_cache=False``, or ``generate`` with its default
``DynamicCache``) the attention function still computes through kvcache's kernels: it copies
the keys and values it is given into a temporary float32 layer per batch row.  That is correct
(left padding left out per row) but not the fast path; pass an :class:`HfKvCache` for
decoding.

Supported versions
------------------
transformers >= 5.0, < 6 with PyTorch on the CPU.  Written against 5.24.0 and verified there
and on 5.0.0, 5.8.1, 5.14.1 and 5.20.2 with Llama, Mistral, Qwen2 and Gemma-2 (the test suite
of ``tests/test_hf.py``); Qwen3, Gemma 3, left padding, the static-cache refusal, the training
mode and ``keys`` / ``values`` were added and tested on 5.25.0 (the release pip installs
today, torch 2.13).  The differences
inside 5.x are handled: early releases size masks from ``cache_position``, name the cache
argument ``past_key_values`` (5.24: ``cache``; the old name still works with a FutureWarning)
and call ``crop`` with an absolute length.  Importing with transformers older than 5.0 raises
ImportError: 4.57 calls mask functions differently (probed: its plain causal masks arrive
looking like overlays) and has other cache-layer signatures.  The model families are those
whose attention modules pass ``scaling`` (and, where they have them, ``sliding_window`` and
``softcap``) to the attention interface; models needing attention sinks (``s_aux``), chunked
attention or bidirectional attention are refused with an error.

Limitations
-----------
* One sequence per :class:`HfKvCache` (batch size 1): with one, batched generation,
  ``num_return_sequences > 1`` and beam search raise ValueError (``reorder_cache``: beam
  search).  With transformers' default ``DynamicCache`` instead they run, through the per-row
  path above (correct, left-padded batches included, and equal to transformers' own tokens,
  but it copies every row of the history into a temporary layer at each step).
* Static (preallocated) caches: ``generate(cache_implementation="static" /
  "sliding_window")`` and ``StaticCache`` raise NotImplementedError saying so (their buffers
  hold rows past the queries that only a mask tensor describes); kvcache keeps its own
  growing storage, so pass an :class:`HfKvCache`.
* ``output_attentions=True`` is refused by transformers itself (its message: the attention
  implementation does not return weights); kvcache never materialises the probabilities.
* CPU tensors only; inference only.  A model in training mode runs as long as nothing needs
  what kvcache does not compute: attention dropout above 0 raises RuntimeError at the call,
  and with gradients enabled the output carries a backward that raises RuntimeError (so
  ``loss.backward()`` through kvcache attention fails loudly instead of returning partial
  gradients).  float16/bfloat16 models work, converting to float32 at the boundary.
* Reading the rows: :attr:`HfKvLayer.keys` / :attr:`HfKvLayer.values` are (1, num_kv_heads,
  seq_len, head_dim) float32 tensors, over kvcache's storage for float32 parts (do not write
  to them) and dequantised copies for int8 / 4-bit parts; ``cache[i]`` is layer i's ``(keys,
  values)``, and iterating a cache yields those pairs.
* Sliding-window layers keep every row (the window is applied in the kernel), so memory grows
  like a full layer; in exchange :meth:`HfKvCache.crop` rolls back any layer kind exactly.
"""

from __future__ import annotations

from ._common import ATTN_IMPLEMENTATION, DEFAULT_PREFILL_STEP, parse_mode
from .attention import kvcache_attention, kvcache_mask, register
from .cache import HfKvCache, HfKvLayer
from .drivers import generate, prefill
from .store import cache_from_store, store_cache

__all__ = ["ATTN_IMPLEMENTATION", "DEFAULT_PREFILL_STEP", "HfKvCache", "HfKvLayer",
           "cache_from_store", "generate", "kvcache_attention", "kvcache_mask", "parse_mode",
           "prefill", "register", "store_cache"]

# Importing kvcache.hf registers "kvcache" with transformers' attention and mask interfaces, so
# that attn_implementation="kvcache" resolves; register(name) does it again (idempotent), also
# under another name.
register()
