"""The transformers ``Cache`` of :mod:`kvcache.hf`: :class:`HfKvCache`, whose layers
(:class:`HfKvLayer`) are :class:`kvcache.LayerKvCache` objects, and the per-layer windows a
transformers config gives."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import numpy.typing as npt
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .._windows import layer_windows
from ..layer import LayerKvCache
from ..modes import KvMode
from ._common import (SUPPORTED_LAYER_TYPES, TAG, check_batch, check_cpu, parse_mode,
                      rows_of)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["HfKvCache", "HfKvLayer", "config_layer_windows", "config_window", "text_config"]


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
        PyTorch cannot mark it read-only: writing to it writes into the cache (``.clone()``
        gives a copy you may change).  It is valid until the cache next changes (``update``,
        ``crop``, ``reset``): rows rolled back and appended again show through it, and a
        growing store moves away from it.  Quantised storage (int8, 4-bit): a new float32
        tensor of the values the kernels read (:meth:`kvcache.LayerKvCache.head_rows`: int8
        rows times their scales, 4-bit codes times step plus minimum)."""
        return self.states()[0]

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        _read_only_states("keys", value)

    @property
    def values(self) -> torch.Tensor | None:
        """The stored values, as :attr:`keys`."""
        return self.states()[1]

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        _read_only_states("values", value)

    def states(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(keys, values)`` read in one pass over the heads (:attr:`keys`)."""
        if self.kv is None:
            return None, None
        rows = [self.kv.head_rows(h) for h in range(self.kv.num_kv_heads)]
        return _heads_tensor([r[0] for r in rows]), _heads_tensor([r[1] for r in rows])

    # ------------------------------------------------------------------ storage
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Create the kvcache layer for keys shaped (1, num_kv_heads, n, head_dim)."""
        check_batch(key_states)
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
        check_batch(key_states)
        check_cpu("key_states", key_states)
        check_cpu("value_states", value_states)
        if tuple(key_states.shape) != tuple(value_states.shape):
            raise ValueError(f"value_states: expected the shape of key_states "
                             f"{tuple(key_states.shape)}, got {tuple(value_states.shape)}")
        if self.kv is None:
            self.lazy_initialization(key_states, value_states)
        assert self.kv is not None
        self.kv.append(rows_of(key_states), rows_of(value_states))
        setattr(key_states, TAG, self)
        return key_states, value_states

    def attended(self) -> None:
        """Called by kvcache attention when it reads this layer's update: the hand-off is
        consumed (:meth:`HfKvCache.update` checks that every update is)."""
        self._handoff.pending = None

    def get_seq_length(self) -> int:
        """Positions held: the rows stored plus the leading padding positions left out."""
        return 0 if self.kv is None else self.kv.seq_len + self.pads

    def drop_padding(self, pads: int, n: int, key_states: torch.Tensor,
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
                f"already holds {start - self.pads} real positions after {self.pads} padding "
                f"ones; the padding must stay the sequence's leading positions (feed a padded "
                f"prompt in one call, with its attention_mask)")
        skip = max(0, min(pads - start, n))
        if pads == self.pads:
            return skip
        self.kv.truncate_last(n)
        if skip < n:
            self.kv.append(rows_of(key_states[:, :, skip:]), rows_of(value_states[:, :, skip:]))
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

        ``crop`` is transformers' name (``Cache.crop``, what its generation loop calls); the
        same operation is ``truncate_last(n)`` everywhere in kvcache itself.

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
            windows = config_layer_windows(config)
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
        return [layer.kv for layer in self.hf_layers]

    @property
    def hf_layers(self) -> list[HfKvLayer]:
        """``layers``, typed as what this cache puts there (transformers types it as any
        cache layer)."""
        return cast("list[HfKvLayer]", self.layers)

    def __getitem__(self, layer_idx: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(keys, values)`` of decoder layer ``layer_idx`` (negative counts from the end), as
        :attr:`HfKvLayer.keys` / :attr:`HfKvLayer.values` give them: the legacy tuple form
        code written for transformers 4.x caches reads (5.x caches have no indexing; their
        ``DynamicCache`` iterates as triples with a sliding-window tensor).  IndexError past
        the layers."""
        return self.hf_layers[layer_idx].states()

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
        keys, values = self.hf_layers[layer_idx].update(key_states, value_states)
        self._handoff.pending = layer_idx
        return keys, values

    def reset(self) -> None:
        """Forget every position in every layer (keeps layers, mode and geometry)."""
        self._handoff.pending = None
        super().reset()  # type: ignore[no-untyped-call]  # transformers leaves it unannotated


def text_config(config: Any) -> Any:
    """The decoder part of a (possibly multimodal) transformers config."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def config_layer_windows(config: Any) -> tuple[int | None, ...]:
    """Per decoder layer: the sliding window (int) or None for full attention, by the rule
    the runner uses too (:func:`kvcache._windows.layer_windows`)."""
    cfg = text_config(config)
    n_layers = getattr(cfg, "num_hidden_layers", None)
    if n_layers is None:
        raise ValueError("config: expected a decoder config with num_hidden_layers, got "
                         f"{type(config).__name__} without it")
    if getattr(cfg, "attention_chunk_size", None) is not None:
        raise NotImplementedError("HfKvCache: chunked attention (attention_chunk_size) is not "
                                  "supported by kvcache attention")
    types = getattr(cfg, "layer_types", None)
    if types is not None:
        bad = sorted({t for t in types if t not in SUPPORTED_LAYER_TYPES})
        if bad:
            raise NotImplementedError(f"HfKvCache: layer types {bad} are not supported (kvcache "
                                      f"attention covers {list(SUPPORTED_LAYER_TYPES)})")
    return layer_windows(cfg, int(n_layers))


def config_window(config: Any, index: int) -> int | None:
    """Layer ``index``'s sliding window as transformers' masks derive it from ``config`` (None
    when the config does not say how many layers there are)."""
    cfg = text_config(config)
    if getattr(cfg, "num_hidden_layers", None) is None:
        return None
    return layer_windows(cfg)[index]
