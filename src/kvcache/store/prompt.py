"""A prompt's trip through the prefix store: the one path :class:`kvcache.runner.Runner` and
:mod:`kvcache.hf` take (docs/store.md, "The runner and transformers").

A model driver that computes a prompt with a store does four things, in this order:

1. :func:`open_store` -- a :class:`PrefixStore` from what the caller passed (the store itself,
   a backend, or a spec: a folder, ``redis://...``), closed on exit when it was opened here;
2. :func:`check_store` -- refuse, before anything is computed, a store that is not this
   model's (``fingerprint``), whose block the driver's chunk does not divide (``chunk``), or
   that cannot hold the cache's rows (:meth:`PrefixStore.check`); :func:`refuse_o1` refuses
   O(1) layers, which release the prompt's rows when they seal;
3. :func:`load_prefix` -- load the longest stored prefix of the ids into the empty cache, in
   whole chunks, leaving at least the chunk of the last position to compute (its logits are
   the driver's output), unless the driver has that position's output from the store
   (:meth:`PrefixStore.load_output`, ``whole=True``): then all of it;
4. :func:`store_blocks` -- after the prompt is computed, put the full blocks of the ids the
   cache holds (and the driver puts the outputs it kept at their ends,
   :meth:`PrefixStore.put_output`).

Why a module of its own and not methods of :class:`PrefixStore`: the store keeps blocks of
rows under keys and knows nothing of chunks, logits or fingerprints that come from a model;
these functions are the policy of a caller that computes prompts (what to leave for the model
to compute, what "this model's store" means), written once for every such caller.

Every function leaves the store and the cache as they were when it raises.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Collection, Iterator
from typing import Optional, Union

from .. import quant
from .._stores import specs_of
from ..model import KvCache
from .keys import as_fingerprint, as_ids
from .prefix import BackendSpec, PrefixStore

__all__ = ["StoreArg", "check_store", "load_prefix", "open_store", "refuse_o1",
           "store_blocks"]

#: What a driver's ``store=`` accepts: a PrefixStore, or what :func:`open_backend` opens.
StoreArg = Union[PrefixStore, BackendSpec]


def refuse_o1(o1_layers: Collection[int]) -> None:
    """ValueError when ``o1_layers`` (a driver's O(1) layers) is not empty: they seal the
    prompt and release its rows, which the store needs (checked before a fingerprint is
    computed or a store opened)."""
    if o1_layers:
        raise ValueError(f"store: the prefix store does not handle O(1) layers (layers "
                         f"{sorted(o1_layers)} seal the prompt and release its rows); run "
                         f"without store= or without o1_layers")


@contextlib.contextmanager
def open_store(store: Optional[StoreArg], fingerprint: Union[str, bytes]
               ) -> Iterator[PrefixStore]:
    """``store`` as a :class:`PrefixStore`: itself, or a new one over the backend it names
    with ``fingerprint`` and the default block.  A store opened here from a spec string or
    path is closed on exit; a PrefixStore or backend object the caller passed stays open (it
    is theirs).  ValueError for None, TypeError for what no backend is made from."""
    if store is None:
        raise ValueError("store: expected a PrefixStore or a backend spec, got None")
    if isinstance(store, PrefixStore):
        yield store
        return
    own = isinstance(store, (str, os.PathLike))
    st = PrefixStore(store, fingerprint=fingerprint)
    try:
        yield st
    finally:
        if own:
            st.close()


def check_store(store: object, cache: KvCache, *, fingerprint: Union[str, bytes, None] = None,
                chunk: int = 1) -> PrefixStore:
    """``store``, checked against a driver and its cache before anything is computed.

    Parameters
    ----------
    store : PrefixStore
    cache : KvCache
        The cache the driver computes into (:meth:`PrefixStore.check`).
    fingerprint : str or bytes, optional
        The driver's: the store's must equal it (rows under another may be another model's).
        None when the caller chose the store's fingerprint itself.
    chunk : int
        Positions per chunk of the driver's prompt computation: the block must be a multiple
        (else loaded rows would not be those the driver computes, bit for bit).

    Returns the store; TypeError for a store that is not a PrefixStore, ValueError otherwise.
    """
    if not isinstance(store, PrefixStore):
        raise TypeError(f"store: expected a kvcache.store.PrefixStore, got "
                        f"{type(store).__name__}")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk: expected an int >= 1, got {chunk!r}")
    if fingerprint is not None and store.fingerprint != as_fingerprint(fingerprint):
        raise ValueError("store: its fingerprint is not this model's (the runner's digests the "
                         "config, weights, KV mode and chunk); rows stored under another "
                         "fingerprint may come from another model")
    if store.block % chunk:
        raise ValueError(f"store: its block of {store.block} positions is not a multiple of "
                         f"prefill_chunk={chunk}; the loaded rows would not be bit-identical "
                         f"to computed ones")
    store.check(cache)
    return store


def load_prefix(store: PrefixStore, ids: object, cache: KvCache, *,
                chunk: Optional[int] = None, whole: bool = False) -> int:
    """Load the longest stored prefix of ``ids`` into the empty ``cache``; return how many
    positions it then holds.

    With ``whole`` (the caller has the output of the last position from elsewhere, e.g.
    :meth:`PrefixStore.load_output`), every position is loaded when every block of ``ids``
    is stored, and ``len(ids)`` is returned; otherwise, and without ``whole``, the count is
    a multiple of ``chunk`` (default: the store's block) below ``len(ids)``: the chunk
    holding the last position is left to compute, for its logits.  Blocks
    reaching past that chunk's start are loaded and the cache rolled back to it (a
    ``chunk`` smaller than the block gains the positions between), to a multiple of 32
    in modes with 4-bit K too (a block of 32 keys reopened by the roll-back would be read
    from its loaded codes, not the original rows, and quantised again: other bits than a
    cold prefill's).  In q8 modes of the legacy scheme "cmf" a count of 64 or less becomes
    0: a cache rolled back below the column warm-up keeps frozen columns a cold prefill
    does not have.  A store that fails
    only costs the time (0).  ValueError/TypeError for bad input or a cache that is not
    empty; the cache is then unchanged."""
    check_store(store, cache, chunk=1 if chunk is None else chunk)
    c = store.block if chunk is None else chunk
    arr = as_ids(ids)
    if cache.seq_len:
        raise ValueError(f"cache: expected an empty cache to load into, it holds "
                         f"{cache.seq_len} positions")
    if not isinstance(whole, bool):
        raise TypeError(f"whole: expected a bool, got {type(whole).__name__}")
    n, b = int(arr.shape[0]), store.block
    most = (n - 1) // c * c if n else 0
    whole = whole and n > 0 and n % b == 0
    if most == 0 and not whole:
        return 0
    loaded = store.load(arr[: n if whole else min(n, -(-most // b) * b)], cache)
    if whole and loaded == n:
        return n
    keep = min(loaded, most)
    mode = cache.layers[0].mode
    settle = max(spec.settle for _, spec in specs_of(mode, cache.head_dim))
    if keep < loaded and settle > 1:
        keep -= keep % math.lcm(c, settle)        # no 4-bit K block is reopened
    if keep <= quant.COL_WARMUP and mode.freezes_columns:
        keep = 0
    if keep == 0 and loaded:
        cache.clear()
    elif keep < loaded:
        cache.truncate_last(loaded - keep)
    return keep


def store_blocks(store: PrefixStore, ids: object, cache: KvCache) -> int:
    """Put the full blocks of the positions ``cache`` holds; return how many were written.

    ``ids`` is the sequence whose positions the cache holds, or a longer one (a prompt and the
    tokens generated after it); its first ``cache.seq_len`` ids are used.  ValueError when the
    cache holds more positions than ``ids`` has, or rows the store cannot take
    (:meth:`PrefixStore.put`); nothing is stored then."""
    check_store(store, cache)
    arr = as_ids(ids)
    n = cache.seq_len
    if n > arr.shape[0]:
        raise ValueError(f"ids: the cache holds {n} positions, ids has {arr.shape[0]}")
    return store.put(arr[:n], cache)
