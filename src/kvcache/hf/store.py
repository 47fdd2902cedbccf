"""The prefix store through :mod:`kvcache.hf`: :func:`cache_from_store` starts an
:class:`~kvcache.hf.HfKvCache` from a prompt's stored blocks, :func:`store_cache` stores a
cache's full blocks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..model import KvCache
from ..modes import KvMode
from ..store.prompt import load_prefix, store_blocks
from ._common import prompt_ids
from .cache import HfKvCache, text_config

if TYPE_CHECKING:
    from ..store import PrefixStore

__all__ = ["cache_from_store", "store_cache"]


def _kv_view(cache: HfKvCache, nkv: int, hd: int, max_seq_len: int) -> KvCache:
    """A :class:`kvcache.KvCache` over the cache's layers, for the prefix store: its own
    layers, and new ones of ``nkv`` x ``hd`` rows for those still lazy (made now, as
    ``lazy_initialization`` makes them: never evicted).  ValueError for a layer of other
    geometry."""
    view = KvCache(len(cache.layers), nkv, hd, max_seq_len=max(max_seq_len, 1), mode=cache.mode)
    view.track_importance = False
    for i, layer in enumerate(cache.hf_layers):
        if layer.kv is None:
            layer.kv = view.layers[i]
        elif (layer.kv.num_kv_heads, layer.kv.head_dim) != (nkv, hd):
            raise ValueError(f"cache: layer {i} holds {layer.kv.num_kv_heads}x"
                             f"{layer.kv.head_dim} rows, expected {nkv}x{hd}")
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

    The load is :func:`kvcache.store.prompt.load_prefix`, the runner's, with the block as the
    chunk.  TypeError for a store that is not a PrefixStore; ValueError, before anything is
    read, for a store that cannot hold the mode's rows (a q8 "cmf" cache needs a block over
    64).
    """
    config = getattr(model, "config", model)
    ids = prompt_ids(input_ids)
    cache = HfKvCache(config, mode=mode)
    if not cache.layers:
        raise ValueError("model: its config gives no decoder layers")
    text = text_config(config)
    heads = int(text.num_attention_heads)
    nkv = int(getattr(text, "num_key_value_heads", None) or heads)
    hd = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    view = _kv_view(cache, nkv, hd, ids.shape[0])
    loaded = load_prefix(store, ids, view)
    if not loaded:
        for layer in cache.hf_layers:     # back to lazy layers, as a new cache has
            layer.kv = None
        return cache, 0
    for layer in cache.hf_layers:
        layer.is_initialized = True
    return cache, loaded


def store_cache(store: PrefixStore, cache: HfKvCache, ids: Any) -> int:
    """Store the full blocks of the positions ``cache`` holds; return how many were written.

    ``ids`` is the sequence whose positions the cache holds, or a longer one (e.g. the
    ``generate`` output: prompt and new tokens; the cache holds all but the last token); only
    its first ``cache.get_seq_length()`` ids are used.  Raises ValueError when the cache
    holds more positions than ``ids`` has, or layers the store cannot take (see
    :meth:`kvcache.store.PrefixStore.put`); nothing is stored then.  The put is
    :func:`kvcache.store.prompt.store_blocks`, the runner's."""
    if not isinstance(cache, HfKvCache):
        raise TypeError(f"cache: expected an HfKvCache, got {type(cache).__name__}")
    arr = prompt_ids(ids)
    pads = max((layer.pads for layer in cache.hf_layers), default=0)
    if pads:
        raise ValueError(f"cache: its sequence starts with {pads} padding positions it does not "
                         f"store; store the cache of an unpadded sequence")
    n = cache.get_seq_length()
    kvs = [kv for kv in cache.kv_layers if kv is not None]
    if n == 0 or len(kvs) < len(cache.layers):
        return 0
    return store_blocks(store, arr, _kv_view(cache, kvs[0].num_kv_heads, kvs[0].head_dim, n))
