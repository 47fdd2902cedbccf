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
transformers >= 5.0, < 6 with PyTorch on the CPU.  Written against 5.24.0 (the release pip
installs today, torch 2.13) and verified there and on 5.0.0, 5.8.1, 5.14.1 and 5.20.2 with
Llama, Mistral, Qwen2 and Gemma-2 (the test suite of ``tests/test_hf.py``).  The differences
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

import inspect
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import numpy.typing as npt

from . import quant
from ._windows import layer_windows
from .layer import LayerKvCache
from .model import KvCache
from .modes import KvMode

try:
    import torch
    import transformers
    from transformers.cache_utils import Cache, CacheLayerMixin
except ImportError as exc:     # tests/test_hf.py hides transformers to exercise this
    raise ImportError(
        "kvcache.hf needs PyTorch and Hugging Face transformers (>= 5.0, < 6; verified up to "
        "5.24.0).  Install them with `pip install torch transformers` (a CPU-only torch: `pip "
        "install torch --index-url https://download.pytorch.org/whl/cpu`)."
    ) from exc

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from .store import PrefixStore

__all__ = ["ATTN_IMPLEMENTATION", "DEFAULT_PREFILL_STEP", "HfKvCache", "HfKvLayer",
           "cache_from_store", "generate", "kvcache_attention", "kvcache_mask", "parse_mode",
           "prefill", "register", "store_cache"]

#: The name the attention (and mask) function is registered under.
ATTN_IMPLEMENTATION = "kvcache"
#: Positions per ``model(...)`` call of :func:`prefill` (the runner's default step too).
DEFAULT_PREFILL_STEP = 512

_MIN_TRANSFORMERS = (5, 0)
_VERIFIED_TRANSFORMERS = "5.0.0 to 5.24.0"
_SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")
_TAG = "_kvcache_layer"          # attribute carrying the HfKvLayer on the key tensor
_PADS = "_kvcache_pads"          # attribute carrying each row's leading padding on the marker


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


if _version_tuple(transformers.__version__) < _MIN_TRANSFORMERS:
    raise ImportError(
        f"kvcache.hf needs transformers >= {'.'.join(map(str, _MIN_TRANSFORMERS))} (verified with "
        f"{_VERIFIED_TRANSFORMERS}), found {transformers.__version__}; upgrade with "
        "`pip install -U transformers`.")


def parse_mode(mode: KvMode | str | None) -> KvMode:
    """A :class:`kvcache.KvMode` from a mode or its name.

    Parameters
    ----------
    mode : KvMode, str or None
        ``None`` reads ``KVCACHE_KV`` (:meth:`KvMode.from_env`, float32 when unset); strings
        are ``"f32"``, ``"q8"`` (int8 K and V), ``"q8k"`` (int8 K only) or ``"q8v"`` (int8 V
        only), in the default int8 scheme "rows", or the same with ``":cmf"`` (e.g.
        ``"q8:cmf"``) for the legacy column-freeze scheme, the 4-bit modes ``"q4"``,
        ``"k8v4"``, ``"q4v"``, ``"q4k"``, ``"k4v8"`` (docs/kv4.md) and anything else
        :meth:`KvMode.parse` takes; case-insensitive.

    Returns
    -------
    KvMode
    """
    if mode is None:
        return KvMode.from_env()
    return KvMode.parse(mode, "mode")


def _check_cpu(name: str, tensor: torch.Tensor) -> None:
    if tensor.device.type != "cpu":
        raise ValueError(f"{name}: expected a CPU tensor (kvcache stores and computes on the CPU), "
                         f"got device {tensor.device}; load the model on the CPU")


def _as_numpy(tensor: torch.Tensor) -> npt.NDArray[np.float32]:
    """A float32 NumPy view of a CPU tensor (a copy only when the dtype must change)."""
    t = tensor.detach()
    if t.dtype != torch.float32:
        t = t.to(torch.float32)
    return t.numpy()


def _rows(states: torch.Tensor) -> npt.NDArray[np.float32]:
    """(batch=1, nkv, n, hd) key/value states as a float32 array (n, nkv, hd)."""
    return _as_numpy(states[0].transpose(0, 1))


class _Handoff:
    """State shared by a cache and its layers: the layer whose rows were appended by the last
    ``update`` and not yet attended (None when every update was followed by kvcache attention)."""

    __slots__ = ("pending",)

    def __init__(self) -> None:
        self.pending: int | None = None


class HfKvLayer(CacheLayerMixin):  # type: ignore[no-untyped-call]  # transformers: unannotated
    """One decoder layer of an :class:`HfKvCache`: a :class:`kvcache.LayerKvCache` behind
    transformers' cache-layer interface.

    Created by :class:`HfKvCache`; the kvcache layer itself is created on the first
    :meth:`update` (its geometry is read from the key tensor) and is :attr:`kv`.

    Parameters
    ----------
    mode : KvMode
    sliding_window : int, optional
        The layer's window from the config: reported to transformers (``is_sliding``) and used
        by :func:`kvcache_attention` when the model passes none.
    """

    is_compileable = False
    is_croppable = True
    supports_early_init = True

    def __init__(self, mode: KvMode | str = KvMode.F32, sliding_window: int | None = None
                 ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # transformers leaves it unannotated
        self.mode = parse_mode(mode)
        self.sliding_window = sliding_window
        self.is_sliding = sliding_window is not None
        self.kv: LayerKvCache | None = None
        #: leading padding positions of the sequence (a left-padded 2-D mask), not stored
        self.pads = 0
        self._handoff = _Handoff()          # HfKvCache shares its own with every layer

    def __repr__(self) -> str:
        window = "" if self.sliding_window is None else f", sliding_window={self.sliding_window}"
        return f"HfKvLayer(mode={self.mode!r}, seq_len={self.get_seq_length()}{window})"

    # ------------------------------------------------------------------ reading K/V
    @property
    def keys(self) -> torch.Tensor | None:
        """The stored keys, (1, num_kv_heads, seq_len, head_dim) float32, as transformers'
        layers expose them; None before the first :meth:`update`.

        Float32 storage (``f32``, ``q8v``, ...): a tensor over kvcache's own rows, no copy.
        PyTorch cannot mark it read-only: do not write to it (``.clone()`` gives a copy you
        may change); it shows the rows held when it was taken (a later ``update`` may move
        the storage).  Quantised storage (int8, 4-bit): a new float32 tensor of the values the
        kernels read (:meth:`kvcache.LayerKvCache.head_rows`: int8 rows times their scales,
        4-bit codes times step plus minimum)."""
        return self._states(0)

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        _read_only_states("keys", value)

    @property
    def values(self) -> torch.Tensor | None:
        """The stored values, as :attr:`keys`."""
        return self._states(1)

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        _read_only_states("values", value)

    def _states(self, part: int) -> torch.Tensor | None:
        if self.kv is None:
            return None
        parts = [self.kv.head_rows(h)[part] for h in range(self.kv.num_kv_heads)]
        return _heads_tensor(parts)

    # ------------------------------------------------------------------ storage
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Create the kvcache layer for keys shaped (1, num_kv_heads, n, head_dim)."""
        _check_batch(key_states)
        self.kv = LayerKvCache(int(key_states.shape[1]), int(key_states.shape[-1]), mode=self.mode)
        self.kv.track_importance = False      # transformers never evicts: no importance work
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new positions and return the new key/value states.

        Parameters
        ----------
        key_states, value_states : torch.Tensor of shape (1, num_kv_heads, n, head_dim)
            The keys (after rotary embedding) and values of the n new positions, on the CPU.

        Returns
        -------
        key_states, value_states : torch.Tensor
            The tensors given, not the history: the key tensor carries this layer so that
            :func:`kvcache_attention` attends over the stored rows without materialising them.
        """
        _check_batch(key_states)
        _check_cpu("key_states", key_states)
        _check_cpu("value_states", value_states)
        if tuple(key_states.shape) != tuple(value_states.shape):
            raise ValueError(f"value_states: expected the shape of key_states "
                             f"{tuple(key_states.shape)}, got {tuple(value_states.shape)}")
        if self.kv is None:
            self.lazy_initialization(key_states, value_states)
        assert self.kv is not None
        self.kv.append(_rows(key_states), _rows(value_states))
        setattr(key_states, _TAG, self)
        return key_states, value_states

    def get_seq_length(self) -> int:
        """Positions held: the rows stored plus the leading padding positions left out."""
        return 0 if self.kv is None else self.kv.seq_len + self.pads

    def _drop_padding(self, pads: int, n: int, key_states: torch.Tensor,
                      value_states: torch.Tensor) -> int:
        """Leave out the padding among the ``n`` positions just appended: the sequence's first
        ``pads`` positions (a left-padded mask).  Rolls the n rows back and appends the real
        ones again (exact, O(n)); returns how many of the n queries are padding."""
        assert self.kv is not None
        total = self.kv.seq_len + self.pads
        start = total - n                       # the position of the first new row
        if pads < self.pads or (pads > self.pads and self.pads < start):
            raise ValueError(
                f"attention_mask: marks the first {pads} positions as padding, but this cache "
                f"already holds {total - self.pads} real positions after {self.pads} padding "
                f"ones; the padding must stay the sequence's leading positions")
        if pads == self.pads:
            return max(0, min(pads - start, n))
        skip = min(pads - start, n)
        self.kv.truncate_last(n)
        if skip < n:
            self.kv.append(_rows(key_states[:, :, skip:]), _rows(value_states[:, :, skip:]))
        self.pads = pads
        return skip

    def get_mask_sizes(self, query_length: int | torch.Tensor) -> tuple[int, int]:
        """(kv_length, kv_offset) for mask creation: every stored row plus the queries, offset 0.

        ``query_length`` is the number of queries (transformers 5.24) or their
        ``cache_position`` tensor (early 5.x releases)."""
        if isinstance(query_length, torch.Tensor):
            query_length = query_length.shape[0]
        return self.get_seq_length() + int(query_length), 0

    def get_max_length(self) -> int:
        """-1: the layer grows without bound."""
        return -1

    get_max_cache_shape = get_max_length      # the name early 5.x releases use

    def reset(self) -> None:
        """Forget every position (keeps the mode and geometry)."""
        self.pads = 0
        if self.kv is not None:
            self.kv.clear()

    def crop(self, tokens_to_remove: int) -> None:
        """Roll back positions (speculative decoding).

        Parameters
        ----------
        tokens_to_remove : int
            Negative: drop the newest ``-tokens_to_remove`` positions (what transformers 5.x
            passes).  Positive: keep the first ``tokens_to_remove`` positions (the older
            absolute form of ``crop(max_length)``).  0: nothing (as in transformers 5.24).
        """
        n = int(tokens_to_remove)
        if self.kv is None or n == 0:
            return
        total = self.kv.seq_len + self.pads
        keep = max(total + n, 0) if n < 0 else min(n, total)
        if keep >= self.pads:
            self.kv.truncate_last(total - keep)
        else:                                   # into the leading padding: no row is left
            self.kv.truncate_last(self.kv.seq_len)
            self.pads = keep

    def offload(self) -> None:
        """No-op: kvcache storage lives on the CPU already."""

    def prefetch(self) -> None:
        """No-op: kvcache storage lives on the CPU already."""

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Beam search is not supported: raises unless ``beam_idx`` is the identity ``[0]``."""
        _refuse_batch_op("reorder_cache (beam search)", beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Only ``repeats == 1`` (a no-op) is supported: the cache holds one sequence."""
        if int(repeats) != 1:
            raise NotImplementedError(
                f"HfKvCache holds one sequence (batch size 1) and cannot be repeated {repeats} "
                "times for beam search or num_return_sequences > 1")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Only selecting row 0 (a no-op) is supported: the cache holds one sequence."""
        _refuse_batch_op("batch_select_indices", indices)


def _read_only_states(name: str, value: torch.Tensor | None) -> None:
    """The setter of HfKvLayer.keys / .values: transformers' base layer assigns None at
    construction; any tensor is refused (kvcache owns the rows: ``update`` appends them)."""
    if value is not None:
        raise AttributeError(f"HfKvLayer.{name} is read-only: the rows live in kvcache storage "
                             f"(append with update(), roll back with crop())")


def _root(a: npt.NDArray[Any]) -> Any:
    """The object owning ``a``'s memory (following views' ``base`` and memoryviews' ``obj``)."""
    obj: Any = a
    while True:
        nxt = obj.base if isinstance(obj, np.ndarray) else getattr(obj, "obj", None) \
            if isinstance(obj, memoryview) else None
        if nxt is None:
            return obj
        obj = nxt


def _heads_tensor(parts: list[npt.NDArray[np.float32]]) -> torch.Tensor:
    """(1, heads, n, head_dim) float32 over per-head (n, head_dim) arrays: a view when they lie
    in one buffer at one stride (float32 storage, heads ``cap`` rows apart), else a copy."""
    a0 = parts[0]
    step = parts[1].ctypes.data - a0.ctypes.data if len(parts) > 1 else 0
    view = all(_root(p) is _root(a0) and p.shape == a0.shape and p.strides == a0.strides
               and p.ctypes.data - a0.ctypes.data == h * step for h, p in enumerate(parts))
    if view and (step > 0 or len(parts) == 1) and a0.size:
        arr = np.lib.stride_tricks.as_strided(a0, shape=(1, len(parts)) + a0.shape,
                                              strides=(0, step) + a0.strides, writeable=False)
    else:
        arr = np.stack(parts)[None]
    with warnings.catch_warnings():               # a read-only view: documented, not copied
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(arr)


def _check_batch(states: torch.Tensor) -> None:
    if states.ndim != 4:
        raise ValueError(f"key_states: expected shape (batch, num_kv_heads, seq, head_dim), got "
                         f"{tuple(states.shape)}")
    if states.shape[0] != 1:
        raise ValueError(
            f"key_states: expected batch size 1, got {states.shape[0]}; HfKvCache holds one "
            "sequence, so batched generation, num_return_sequences > 1 and beam search are not "
            "supported (run sequences one at a time, each with its own cache)")


def _refuse_batch_op(what: str, indices: torch.Tensor | list[int]) -> None:
    idx = torch.as_tensor(indices).reshape(-1)
    if idx.numel() == 1 and int(idx[0]) == 0:
        return
    raise NotImplementedError(
        f"HfKvCache.{what}: the cache holds one sequence (batch size 1); beam search and "
        f"batch re-indexing are not supported (got indices {idx.tolist()})")


class HfKvCache(Cache):
    """A transformers ``Cache`` whose layers are :class:`kvcache.LayerKvCache` objects.

    Use it with a model loaded with ``attn_implementation="kvcache"``; attention then reads
    K/V from kvcache storage (float32 or int8 rows) through kvcache's kernels.

    Parameters
    ----------
    config : transformers.PretrainedConfig, optional
        The model's config (``model.config``).  Gives the number of layers and which ones use
        a sliding window; without it layers are added as ``update`` reaches them.  Configs
        with layer types other than full and sliding attention raise NotImplementedError.
    mode : KvMode, str or None
        Storage precision of every layer, see :func:`parse_mode`; None reads ``KVCACHE_KV``
        (float32 when unset).

    Attributes
    ----------
    mode : KvMode
    layers : list of HfKvLayer

    Notes
    -----
    One sequence per cache (batch size 1).  ``crop`` rolls back any layer, sliding ones
    included, because every row is kept; ``reorder_cache`` (beam search) raises.

    Examples
    --------
    >>> cache = HfKvCache(model.config, mode="q8")                       # doctest: +SKIP
    >>> model.generate(ids, max_new_tokens=32, do_sample=False, cache=cache)  # doctest: +SKIP
    """

    def __init__(self, config: PretrainedConfig | None = None,
                 mode: KvMode | str | None = None) -> None:
        self.mode = parse_mode(mode)
        self._handoff = _Handoff()
        layers: list[Any] = []            # HfKvLayer objects (transformers types a union)
        if config is not None:
            windows = _layer_windows(config)
            layers = [self._new_layer(w) for w in windows]
        super().__init__(layers=layers)

    def _new_layer(self, sliding_window: int | None) -> HfKvLayer:
        """A layer that reports to this cache's hand-off (the attention reads what update
        stored through it)."""
        layer = HfKvLayer(self.mode, sliding_window)
        layer._handoff = self._handoff
        return layer

    def __repr__(self) -> str:
        return (f"HfKvCache(mode={self.mode!r}, num_layers={len(self.layers)}, "
                f"seq_len={self.get_seq_length()})")

    def __bool__(self) -> bool:
        return True

    @property
    def is_croppable(self) -> bool:
        """True: :meth:`crop` rolls every layer back exactly (sliding layers included)."""
        return True

    @property
    def kv_layers(self) -> list[LayerKvCache | None]:
        """The kvcache layers, one per decoder layer (None for a layer not yet updated)."""
        return [layer.kv for layer in self._hf_layers]

    @property
    def _hf_layers(self) -> list[HfKvLayer]:
        """``layers``, typed as what this cache puts there (transformers types it as any
        cache layer)."""
        return cast("list[HfKvLayer]", self.layers)

    def __getitem__(self, layer_idx: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(keys, values)`` of decoder layer ``layer_idx`` (negative counts from the end), as
        :attr:`HfKvLayer.keys` / :attr:`HfKvLayer.values` give them: the legacy tuple form
        code written for transformers 4.x caches reads.  IndexError past the layers."""
        layer = self._hf_layers[layer_idx]
        return layer.keys, layer.values

    def __iter__(self) -> Iterator[tuple[torch.Tensor | None, torch.Tensor | None]]:
        """``(keys, values)`` of every decoder layer, in order."""
        for i in range(len(self.layers)):
            yield self[i]

    def memory_bytes(self) -> int:
        """Bytes of K/V storage held, summed over layers (see LayerKvCache.memory_bytes)."""
        return sum(kv.memory_bytes() for kv in self.kv_layers if kv is not None)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new positions of layer ``layer_idx``; see :meth:`HfKvLayer.update`.

        Raises RuntimeError when the previous update was not consumed by kvcache attention:
        the model is not running ``attn_implementation="kvcache"``, and its attention would
        have seen only the new positions.
        """
        pending = self._handoff.pending
        if pending is not None:
            raise RuntimeError(
                f"HfKvCache: the attention of layer {pending} did not go through kvcache (the "
                "model's attn_implementation is not 'kvcache'), so it saw only the new positions. "
                "Load the model with attn_implementation='kvcache' (after `import kvcache.hf`) or "
                "call model.set_attn_implementation('kvcache'), and start from a new cache "
                "(this one is now inconsistent)")
        while len(self.layers) <= layer_idx:
            self.layers.append(self._new_layer(None))
        keys, values = self._hf_layers[layer_idx].update(key_states, value_states)
        self._handoff.pending = layer_idx
        return keys, values

    def reset(self) -> None:
        """Forget every position in every layer (keeps layers, mode and geometry)."""
        self._handoff.pending = None
        super().reset()  # type: ignore[no-untyped-call]  # transformers leaves it unannotated


def _text_config(config: Any) -> Any:
    """The decoder part of a (possibly multimodal) transformers config."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def _layer_windows(config: Any) -> tuple[int | None, ...]:
    """Per decoder layer: the sliding window (int) or None for full attention, by the rule
    the runner uses too (:func:`kvcache._windows.layer_windows`)."""
    cfg = _text_config(config)
    n_layers = getattr(cfg, "num_hidden_layers", None)
    if n_layers is None:
        raise ValueError("config: expected a decoder config with num_hidden_layers, got "
                         f"{type(config).__name__} without it")
    if getattr(cfg, "attention_chunk_size", None) is not None:
        raise NotImplementedError("HfKvCache: chunked attention (attention_chunk_size) is not "
                                  "supported by kvcache attention")
    types = getattr(cfg, "layer_types", None)
    if types is not None:
        bad = sorted({t for t in types if t not in _SUPPORTED_LAYER_TYPES})
        if bad:
            raise NotImplementedError(f"HfKvCache: layer types {bad} are not supported (kvcache "
                                      f"attention covers {list(_SUPPORTED_LAYER_TYPES)})")
    return layer_windows(cfg, int(n_layers))


def _config_window(config: Any, index: int) -> int | None:
    """Layer ``index``'s sliding window as transformers' masks derive it from ``config`` (None
    when the config does not say how many layers there are)."""
    cfg = _text_config(config)
    if getattr(cfg, "num_hidden_layers", None) is None:
        return None
    return layer_windows(cfg)[index]


# ---------------------------------------------------------------------------- attention function
def kvcache_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: torch.Tensor | None,
                      dropout: float = 0.0, scaling: float | None = None,
                      sliding_window: int | None = None, softcap: float | None = None,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention function computing through kvcache's kernels.

    Parameters
    ----------
    module : torch.nn.Module
        The calling attention module.
    query : torch.Tensor of shape (batch, num_heads, n, head_dim)
    key, value : torch.Tensor of shape (batch, num_kv_heads, kv_len, head_dim)
        From :meth:`HfKvCache.update`: the n new positions, the key carrying its kvcache
        layer, which holds the history.  From any other cache (or none): every position the
        queries see, the queries being the last n of them.
    attention_mask : None
        kvcache builds the causal (and sliding-window) pattern itself; a mask tensor raises.
    dropout : float
        Must be 0 (inference only).
    scaling : float, optional
        Score scale, default ``head_dim ** -0.5``.
    sliding_window : int, optional
        Attend only to the last ``sliding_window`` positions up to and including the query's.
        When None, the module's ``sliding_window`` attribute or the window the config gives
        this layer is used (the one transformers' mask would apply).
    softcap : float, optional
        Attention logit softcapping (Gemma-2): ``softcap * tanh(score / softcap)``.

    Returns
    -------
    attn_output : torch.Tensor of shape (batch, n, num_heads, head_dim), the query's dtype
    attn_weights : None
    """
    layer = getattr(key, _TAG, None)
    if layer is not None:
        layer._handoff.pending = None           # consumed, whatever happens next
    if (dropout or 0.0) > 0.0:
        raise RuntimeError(f"kvcache attention has no attention dropout (the model asked for "
                           f"{dropout}, as a module in training mode does): call model.eval(), "
                           f"or set the config's attention_dropout to 0")
    pads: tuple[int, ...] | None = getattr(attention_mask, _PADS, None)
    if attention_mask is not None and pads is None:
        raise ValueError(
            "attention_mask: kvcache attention applies the causal and sliding-window patterns "
            "itself and takes no explicit 4-D mask, got a tensor of shape "
            f"{tuple(attention_mask.shape)}")
    if kwargs.get("is_causal") is False or not getattr(module, "is_causal", True):
        raise NotImplementedError("kvcache attention is causal only (bidirectional attention "
                                  "is not supported)")
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("kvcache attention does not support attention sinks (s_aux)")
    _check_cpu("query", query)
    batch, num_heads, n, head_dim = query.shape
    if pads is not None and len(pads) != batch:
        raise ValueError(f"attention_mask: {len(pads)} rows for a batch of {batch}")
    if layer is None:
        _refuse_preallocated(key, n, kwargs.get("position_ids"), pads[0] if pads else 0)
    window = _window(module, layer, sliding_window)
    cap = float(softcap) if softcap else 0.0
    scale = None if scaling is None else float(scaling)
    out = torch.empty((batch, n, num_heads, head_dim), dtype=torch.float32)
    q = _as_numpy(query.transpose(1, 2))                 # (batch, n, num_heads, head_dim)
    if layer is not None:
        if batch != 1:
            _check_batch(query)
        if key.shape[2] != n:
            raise ValueError(f"query: expected the {key.shape[2]} positions just appended to the "
                             f"cache, got {n}")
        assert layer.kv is not None
        skip = layer._drop_padding(pads[0], n, key, value) if pads else 0
        out[0, :skip] = 0.0                   # padding queries: their outputs are never read
        if skip < n:
            _attend(layer.kv, q[0, skip:], scale, window, cap, out[0, skip:].numpy())
    else:
        _check_cpu("key", key)
        kv_len = key.shape[2]
        if kv_len < n:
            raise ValueError(f"key: expected at least the {n} query positions, got {kv_len}")
        k = _as_numpy(key.transpose(1, 2))               # (batch, kv_len, num_kv_heads, head_dim)
        v = _as_numpy(value.transpose(1, 2))
        for b in range(batch):
            p = min(pads[b], kv_len) if pads else 0    # leading padding rows: left out
            skip = max(0, min(p - (kv_len - n), n))    # padding queries among the n
            out[b, :skip] = 0.0
            if skip == n:
                continue
            tmp = LayerKvCache(k.shape[2], head_dim, mode=KvMode.F32)
            tmp.append(k[b, p:], v[b, p:])
            _attend(tmp, q[b, skip:], scale, window, cap, out[b, skip:].numpy())
    if query.dtype != torch.float32:
        out = out.to(query.dtype)
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad
                                    or value.requires_grad):
        out = _NoGradient.apply(out, query, key, value)  # type: ignore[no-untyped-call]
    return out, None


class _NoGradient(torch.autograd.Function):
    """Marks kvcache attention's output as part of the graph with a backward that raises: a
    forward pass with gradients enabled (a model in training mode, or outside ``no_grad``)
    runs, and only a ``backward()`` through it, which kvcache cannot compute, is refused."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        raise RuntimeError("kvcache attention computes no gradients (inference only): run the "
                           "backward pass with another attn_implementation (e.g. 'sdpa')")


def _refuse_preallocated(key: torch.Tensor, n: int, position_ids: Any, pads: int) -> None:
    """Refuse a key tensor holding rows past the last query (a static, preallocated cache's
    buffer: ``generate(cache_implementation="static" / "sliding_window")`` or a StaticCache),
    which only a mask tensor could describe; ``position_ids`` (1, n) tell where the queries
    are (counted from the first of the sequence's ``pads`` leading padding positions' end)."""
    if not isinstance(position_ids, torch.Tensor) or position_ids.ndim != 2 \
            or position_ids.shape[0] != 1 or position_ids.shape[1] != n or n == 0:
        return
    last = int(position_ids[0, -1]) + pads
    if key.shape[2] > last + 1:
        raise NotImplementedError(_STATIC_REFUSAL.format(rows=key.shape[2], last=last))


_STATIC_REFUSAL = (
    "kvcache attention cannot attend over a static (preallocated) cache: the key holds {rows} "
    "rows for queries ending at position {last} (generate(cache_implementation='static' or "
    "'sliding_window') or a StaticCache); kvcache keeps K/V in its own growing storage: pass "
    "cache=kvcache.hf.HfKvCache(model.config) (kvcache.hf.generate does), or leave the default "
    "dynamic cache")


def _attend(kv: LayerKvCache, q: npt.NDArray[np.float32], scale: float | None,
            window: int | None, cap: float, out: npt.NDArray[np.float32]) -> None:
    """The one place kvcache.hf calls kvcache's attention: the n queries ``q`` (n, num_heads,
    head_dim) attend to the rows ``kv`` holds up to their own, into ``out``.  A block of
    ``n > 1`` queries is a prompt (or a step of one, :func:`prefill`); one query is a decode
    step; a kernel meant for prompts is chosen here."""
    kv.attend_all_heads(q, scale=scale, window=window, softcap=cap, out=out,
                        prefill=q.shape[0] > 1)


def _window(module: torch.nn.Module, layer: HfKvLayer | None,
            sliding_window: int | None) -> int | None:
    """The sliding window of this call: the ``sliding_window`` the model passes, else the
    module's ``sliding_window`` attribute, else the one the config gives the layer (what
    transformers' mask uses; some models, e.g. Qwen2-MoE and PhiMoE, only tell the mask)."""
    window = sliding_window
    if window is None:
        window = getattr(module, "sliding_window", None)
    if window is None and layer is not None:
        window = layer.sliding_window
    if window is None:
        config = getattr(module, "config", None)
        index = getattr(module, "layer_idx", None)
        if config is not None and index is not None:
            window = _config_window(config, index)
    return int(window) if window else None


def kvcache_mask(batch_size: int | None = None, q_length: int | None = None,
                 kv_length: int | None = None, q_offset: int = 0, kv_offset: int = 0,
                 mask_function: Any = None, attention_mask: torch.Tensor | None = None,
                 allow_is_causal_skip: bool = True, use_vmap: bool = False,
                 **kwargs: Any) -> torch.Tensor | None:
    """transformers mask function for kvcache attention: returns None (no mask is needed), or
    for a left-padded 2-D ``attention_mask`` a small marker tensor carrying each row's count
    of leading padding positions, which :func:`kvcache_attention` leaves out.

    Raises instead of dropping information the kernels cannot apply: zeros in the 2-D
    ``attention_mask`` other than left padding (ValueError), and mask patterns other than
    causal / sliding-window causal -- overlays, packed sequences, bidirectional or chunked
    attention, static caches (NotImplementedError).
    """
    if not allow_is_causal_skip and not use_vmap and q_length == 1 \
            and "allow_is_bidirectional_skip" not in kwargs:
        # transformers builds a one-query mask it cannot skip for a compileable cache alone
        raise NotImplementedError(
            "kvcache attention cannot decode with a static (compileable) cache "
            "(generate(cache_implementation='static' or 'sliding_window'), StaticCache): "
            "kvcache keeps K/V in its own growing storage; pass "
            "cache=kvcache.hf.HfKvCache(model.config) (kvcache.hf.generate does), or leave the "
            "default dynamic cache")
    if use_vmap or not allow_is_causal_skip or "allow_is_bidirectional_skip" in kwargs:
        raise NotImplementedError(
            "kvcache attention is causal (optionally sliding-window) over one unpadded sequence; "
            "this model asked for another mask pattern (overlay, packed sequences, "
            "bidirectional or blockwise attention)")
    config = kwargs.get("config")
    if config is not None and getattr(config, "attention_chunk_size", None) is not None:
        raise NotImplementedError("kvcache attention does not support chunked attention")
    if attention_mask is None or bool(attention_mask.all()):
        return None
    return _padding_marker(attention_mask)


def _padding_marker(attention_mask: torch.Tensor) -> torch.Tensor:
    """What the mask function returns for a left-padded 2-D mask (batch, kv_len): a small
    tensor carrying each row's count of leading zeros, which :func:`kvcache_attention` reads
    (it leaves those positions out).  ValueError for any other pattern of zeros."""
    m = attention_mask.detach().to("cpu")
    if m.ndim != 2:
        raise ValueError(f"attention_mask: expected the 2-D padding mask (batch, length), got "
                         f"shape {tuple(m.shape)}")
    ones = m.to(torch.bool)
    first = torch.where(ones.any(dim=1), ones.to(torch.int8).argmax(dim=1),
                        torch.full((m.shape[0],), m.shape[1]))
    cols = torch.arange(m.shape[1])[None, :]
    if not torch.equal(ones, cols >= first[:, None]):
        raise ValueError(
            "attention_mask: kvcache attention supports left padding only (each row's zeros "
            "before its first one); this mask has zeros after a row's first one (right "
            "padding or holes)")
    marker = torch.zeros(m.shape[0], dtype=torch.int64)
    setattr(marker, _PADS, tuple(int(x) for x in first))
    return marker


def register(name: str = ATTN_IMPLEMENTATION) -> str:
    """Register :func:`kvcache_attention` and :func:`kvcache_mask` with transformers.

    Idempotent; done once on import.  Afterwards
    ``AutoModelForCausalLM.from_pretrained(path, attn_implementation=name)`` (or
    ``model.set_attn_implementation(name)``) routes attention through kvcache.

    Parameters
    ----------
    name : str
        Registration name, default ``"kvcache"``.

    Returns
    -------
    str
        The name registered.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    AttentionInterface.register(name, kvcache_attention)
    AttentionMaskInterface.register(name, kvcache_mask)
    return name


def _cache_kwarg(model: torch.nn.Module) -> str:
    """The keyword the model's ``forward`` takes its cache under: ``cache`` (transformers 5.24)
    or ``past_key_values`` (older releases)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _check_model(model: Any) -> None:
    impl = getattr(model.config, "_attn_implementation", None)
    if impl != ATTN_IMPLEMENTATION:
        raise ValueError(f"model: expected attn_implementation={ATTN_IMPLEMENTATION!r}, got "
                         f"{impl!r}; load it with attn_implementation='kvcache' or call "
                         "model.set_attn_implementation('kvcache')")


def _new_or_given(model: Any, cache: HfKvCache | None, mode: KvMode | str | None) -> HfKvCache:
    if cache is None:
        return HfKvCache(model.config, mode=mode)
    if not isinstance(cache, HfKvCache):
        raise TypeError(f"cache: expected an HfKvCache, got {type(cache).__name__}")
    return cache


def _check_step(name: str, step: Any) -> None:
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 1:
        raise ValueError(f"{name}: expected a positive integer, got {step!r}")


def _steps(start: int, n: int, step: int, mode: KvMode) -> list[tuple[int, int]]:
    """The ``(lo, hi)`` positions of :func:`prefill`'s calls: steps end at multiples of
    ``step`` and at ``n``; in the q8 scheme "cmf" none ends at or below ``quant.COL_WARMUP``,
    where the column freeze requantises the rows before it (a one-shot prefill freezes before any of its
    queries attend; so does the first step then)."""
    floor = quant.COL_WARMUP if mode.freezes_columns else 0
    ends = [e for e in range((start // step + 1) * step, n, step) if e > floor] + [n]
    return list(zip([start] + ends[:-1], ends))


def prefill(model: Any, input_ids: Any, *, cache: HfKvCache | None = None,
            mode: KvMode | str | None = None,
            step: int = DEFAULT_PREFILL_STEP) -> tuple[torch.Tensor, HfKvCache]:
    """Feed a prompt to ``model(...)`` in steps of ``step`` positions; return the logits of
    its last position and the cache.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        Loaded with ``attn_implementation="kvcache"``.
    input_ids : torch.LongTensor of shape (1, n), or a sequence of ints
        The whole sequence; the positions past what ``cache`` holds are fed (all of them with
        a new cache), as ``generate`` does.
    cache : HfKvCache, optional
        A cache to continue (e.g. from :func:`cache_from_store`); a new one otherwise.
    mode : KvMode, str or None
        Storage precision of a new cache (ignored when ``cache`` is given).
    step : int
        Positions per ``model(...)`` call (default :data:`DEFAULT_PREFILL_STEP`): the model's
        activations and products hold ``step`` rows, not the prompt's; each call asks the
        model for its last position's logits only (``logits_to_keep=1``).  Steps end at
        multiples of ``step`` (absolute positions), and with a q8 cache in the legacy scheme
        "cmf" the first runs past position 64, where its column field freezes, as a one-shot
        prefill does.

    Returns
    -------
    (logits, cache)
        ``logits``: float32 tensor (vocab,) of the last position, equal to a one-shot
        ``model(input_ids)``'s to float32 rounding; ``cache`` holds every position.

    Raises ValueError when the cache already holds every position of ``input_ids`` (nothing
    to compute) or more, or when ``step`` is not a positive integer; TypeError for a cache
    that is not an :class:`HfKvCache`.  A call that fails half way leaves the cache holding
    the steps done so far (``cache.crop`` rolls it back).
    """
    _check_model(model)
    _check_step("step", step)
    ids = _prompt_ids(input_ids)
    cache = _new_or_given(model, cache, mode)
    start = cache.get_seq_length()
    if start >= ids.shape[0]:
        raise ValueError(f"input_ids: the cache already holds {start} positions, input_ids has "
                         f"{ids.shape[0]}; there is nothing left to compute")
    params = inspect.signature(model.forward).parameters
    kwargs: dict[str, Any] = {_cache_kwarg(model): cache, "use_cache": True}
    if "logits_to_keep" in params:
        kwargs["logits_to_keep"] = 1
    tokens = torch.from_numpy(ids)[None]
    logits: torch.Tensor | None = None
    with torch.no_grad():
        for lo, hi in _steps(start, ids.shape[0], int(step), cache.mode):
            out = model(input_ids=tokens[:, lo: hi], **kwargs)
            logits = out.logits[0, -1]
    assert logits is not None
    return logits.float(), cache


def generate(model: Any, input_ids: torch.Tensor, *, mode: KvMode | str | None = None,
             cache: HfKvCache | None = None, prefill_step: int | None = DEFAULT_PREFILL_STEP,
             **kwargs: Any) -> Any:
    """``model.generate`` with an :class:`HfKvCache`.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        Loaded with ``attn_implementation="kvcache"``.
    input_ids : torch.LongTensor of shape (1, n)
    mode : KvMode, str or None
        Storage precision of a new cache (ignored when ``cache`` is given).
    cache : HfKvCache, optional
        A cache to continue from (multi-turn); a new one is made otherwise.
    prefill_step : int or None
        The prompt's positions but the last that the cache does not hold yet are first fed
        through :func:`prefill` in steps of ``prefill_step`` (default
        :data:`DEFAULT_PREFILL_STEP`, 512) when there are more than ``prefill_step`` of them,
        so a long prompt's activations hold one step; ``model.generate`` then computes the
        last one.  None leaves the whole prompt to ``model.generate``, one block, as does a
        batch of several sequences.
    **kwargs
        Passed to ``model.generate`` (``max_new_tokens``, ``do_sample``, ...).

    Returns
    -------
    What ``model.generate`` returns.  The cache is reachable through the output when
    ``return_dict_in_generate=True``, or pass your own ``cache``.
    """
    _check_model(model)
    cache = _new_or_given(model, cache, mode)
    batched = (isinstance(input_ids, torch.Tensor) and input_ids.ndim == 2
               and input_ids.shape[0] != 1)
    if prefill_step is not None and not batched:
        _check_step("prefill_step", prefill_step)
        ids = _prompt_ids(input_ids)
        if ids.shape[0] - 1 - cache.get_seq_length() > prefill_step:
            prefill(model, ids[:-1], cache=cache, step=prefill_step)
    kwargs[_cache_kwarg(model)] = cache
    return model.generate(input_ids, **kwargs)


def _prompt_ids(input_ids: Any) -> npt.NDArray[np.int64]:
    """Token ids of one sequence: a (1, n) or (n,) tensor or array, or a sequence of ints."""
    if isinstance(input_ids, torch.Tensor):
        if input_ids.ndim == 2 and input_ids.shape[0] != 1:
            raise ValueError(f"input_ids: expected one sequence (batch size 1), got shape "
                             f"{tuple(input_ids.shape)}")
        input_ids = input_ids.detach().cpu().reshape(-1).numpy()
    ids = np.asarray(input_ids)
    if ids.ndim == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.ndim != 1 or ids.size == 0 or ids.dtype.kind not in "iu":
        raise ValueError(f"input_ids: expected one non-empty sequence of token ids, got "
                         f"{ids.dtype} {ids.shape}")
    out: npt.NDArray[np.int64] = ids.astype(np.int64)
    return out


def _kv_view(cache: HfKvCache, config: Any, max_seq_len: int) -> KvCache:
    """A :class:`kvcache.KvCache` over the cache's layers (made now when still lazy), for the
    prefix store; the cache's config decides the geometry."""
    text = _text_config(config)
    heads = int(text.num_attention_heads)
    nkv = int(getattr(text, "num_key_value_heads", None) or heads)
    hd = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    view = KvCache(len(cache.layers), nkv, hd, max_seq_len=max(max_seq_len, 1), mode=cache.mode)
    view.track_importance = False            # as lazy_initialization makes them: never evicted
    for i, layer in enumerate(cache._hf_layers):
        if layer.kv is None:
            layer.kv = view.layers[i]
        elif (layer.kv.num_kv_heads, layer.kv.head_dim) != (nkv, hd):
            raise ValueError(f"cache: layer {i} holds {layer.kv.num_kv_heads}x"
                             f"{layer.kv.head_dim} rows, the config says {nkv}x{hd}")
        view.layers[i] = layer.kv
    return view


def cache_from_store(store: PrefixStore, model: Any, input_ids: Any, *,
                     mode: KvMode | str | None = None) -> tuple[HfKvCache, int]:
    """A new :class:`HfKvCache` holding the stored leading blocks of a prompt.

    Parameters
    ----------
    store : kvcache.store.PrefixStore
        Its fingerprint names the model and its weights (a string the caller chooses, see
        the module docstring); its block is the granularity of a hit.
    model : transformers.PreTrainedModel or PretrainedConfig
        The model (or its config): gives the layers, their windows and the K/V geometry.
    input_ids : torch.LongTensor of shape (1, n), or a sequence of ints
        The whole prompt.
    mode : KvMode, str or None
        Storage precision of the cache (see :func:`parse_mode`); entries are per mode.

    Returns
    -------
    (cache, n_loaded)
        ``n_loaded`` leading positions of the prompt are in the cache (whole blocks, at most
        ``n - 1``: the last position is always left to compute, for its logits).  Pass the
        whole prompt and the cache to :func:`generate` (or ``model.generate``), which then
        computes positions ``n_loaded ..`` only.  0 on a miss, or when the store is
        unavailable (it then logs one warning and generation goes on without it).
    """
    config = getattr(model, "config", model)
    ids = _prompt_ids(input_ids)
    cache = HfKvCache(config, mode=mode)
    if not cache.layers:
        raise ValueError("model: its config gives no decoder layers")
    view = _kv_view(cache, config, ids.shape[0])
    loaded = store.load(ids[:-1], view) if ids.shape[0] > 1 else 0
    if not loaded:
        for layer in cache._hf_layers:     # back to lazy layers, as a new cache has
            layer.kv = None
        return cache, 0
    for layer in cache._hf_layers:
        layer.is_initialized = True
    return cache, loaded


def store_cache(store: PrefixStore, cache: HfKvCache, ids: Any) -> int:
    """Store the full blocks of the positions ``cache`` holds; return how many were written.

    ``ids`` is the sequence whose positions the cache holds, or a longer one (e.g. the
    ``generate`` output: prompt and new tokens; the cache holds all but the last token); only
    its first ``cache.get_seq_length()`` ids are used.  Raises ValueError when the cache
    holds more positions than ``ids`` has, or layers the store cannot take (see
    :meth:`kvcache.store.PrefixStore.put`)."""
    if not isinstance(cache, HfKvCache):
        raise TypeError(f"cache: expected an HfKvCache, got {type(cache).__name__}")
    arr = _prompt_ids(ids)
    pads = max((layer.pads for layer in cache._hf_layers), default=0)
    if pads:
        raise ValueError(f"cache: its sequence starts with {pads} padding positions it does not "
                         f"store; store the cache of an unpadded sequence")
    n = cache.get_seq_length()
    if n > arr.shape[0]:
        raise ValueError(f"ids: the cache holds {n} positions, ids has {arr.shape[0]}")
    if n == 0 or any(layer.kv is None for layer in cache._hf_layers):
        return 0
    kvs = [layer.kv for layer in cache._hf_layers if layer.kv is not None]
    view = KvCache(len(kvs), kvs[0].num_kv_heads, kvs[0].head_dim, max_seq_len=n,
                   mode=cache.mode)
    view.layers[:] = kvs
    return store.put(arr[:n], view)


register()
