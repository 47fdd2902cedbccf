"""PrefixStore: a prompt's KV rows, stored by content and loaded back bit for bit
(docs/store.md).

A prompt's token ids are cut into blocks of ``block`` positions; block i's key is a hash chain
over the ids of blocks 0..i, the fingerprint, the KV mode, the geometry and the block size
(:mod:`kvcache.store.keys`).  An entry holds the block's rows on every layer and head (K, V,
their int8 scales, importance, and in q8 modes the layer's frozen column fields) in the layout
of :mod:`kvcache.store.entry`.  Layers are read with ``state`` and replaced with
``install`` (:class:`kvcache._state.LayerState`), never through their fields.

What a cache must be (else ValueError, nothing stored or loaded):

- a :class:`kvcache.KvCache` whose layers all have the cache's geometry and one mode;
- ``put``: every layer holds exactly ``len(ids)`` positions, every head all of them
  (no dead heads, no evicted rows: seq_len == every head's length == importance length), no
  O(1) state (``o1`` None, empty ``linear_state`` and ``linear_scratch``); in the q8 scheme
  "cmf" the column fields are frozen on every head once more than 64 positions are held, as an
  append leaves them;
- ``load``: the same rules for the cache as it is (empty, or holding a whole number of
  blocks which the caller vouches are the first positions of ``ids``);
- q8 modes in the legacy int8 scheme "cmf" need ``block > 64``: the column fields freeze when
  a layer passes 64 positions and every row is requantised then, so only blocks cut from caches
  past that point can be loaded bit for bit.  The default scheme "rows" takes any block size.

Faults: a missing, corrupted, truncated or foreign entry is a miss (and, unless the backend
is merely unable to read it, deleted and logged once on logger ``"kvcache"``); a backend that
raises :class:`~kvcache.store.backend.BackendUnavailable` turns the store into a no-op for the
rest of its life (one warning): ``put`` stores nothing and ``longest_prefix``/``load`` return 0.
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any, Optional, Union

import numpy as np
import numpy.typing as npt

from .. import quant
from .._state import LayerState
from .._stores import specs_of
from ..layer import LayerKvCache
from ..model import KvCache
from ..modes import KvMode
from . import entry as _entry
from .backend import BackendUnavailable, BufferBackend, ScatterBackend, StoreBackend
from .directory import DEFAULT_DIRECTORY_BUDGET, DirectoryBackend
from .keys import (Geometry, as_fingerprint, as_ids, block_keys, fingerprint_digest,
                   output_key)
from .memory import MemoryBackend

__all__ = ["PrefixStore", "open_backend", "DEFAULT_BLOCK", "DEFAULT_PATH"]

_log = logging.getLogger("kvcache")

DEFAULT_BLOCK = 256
DEFAULT_PATH = "~/.cache/kvcache"
# Entries fetched per backend call, at most (about): bounds the values held at once, and a
# Redis pipeline's one response (a 256 MiB response read slower through redis-py than eight
# of 32 MiB, measured on SmolLM2's 8k-token hit).
_READ_BATCH_BYTES = 32 << 20
_REPORTED_MAX = 4096                    # bad keys remembered so each is logged once

BackendSpec = Union[StoreBackend, str, "os.PathLike[str]"]


def _parse_size(text: str, spec: str) -> int:
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    mult = 1
    for suffix, m in (("k", 1 << 10), ("m", 1 << 20), ("g", 1 << 30), ("t", 1 << 40)):
        if t.endswith(suffix):
            t, mult = t[:-1], m
            break
    if not t.isdigit():
        raise ValueError(f"backend {spec!r}: budget={text!r} is not a byte count (e.g. 1000000, "
                         f"512M, 4G)")
    return int(t) * mult


_QUERY = re.compile(r"(?:(?:budget|fsync)=[^&?]*)(?:&(?:budget|fsync)=[^&?]*)*\Z")


def _split_query(rest: str, spec: str) -> tuple[str, dict[str, str]]:
    """``PATH?budget=..&fsync=..`` -> (PATH, options); a '?' not followed by known options is
    part of the path."""
    head, sep, query = rest.rpartition("?")
    if not sep or not _QUERY.match(query):
        return rest, {}
    return head, dict(item.split("=", 1) for item in query.split("&"))


def _flag(text: str, spec: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"backend {spec!r}: fsync={text!r}, expected 0 or 1")


def open_backend(spec: BackendSpec) -> StoreBackend:
    """The backend a spec names (a :class:`StoreBackend` object is returned as it is).

    - ``"memory"`` or ``"memory:?budget=BYTES"``: a new :class:`MemoryBackend`;
    - ``"redis://host:port/db"`` (or ``rediss://``): :class:`kvcache.store.redis.RedisBackend`,
      imported on demand;
    - ``"dir:PATH"``, ``"dir:PATH?budget=BYTES&fsync=1"``, any other string or an
      ``os.PathLike``: a :class:`DirectoryBackend` on that folder (``~`` expanded).

    BYTES is an integer with an optional K, M, G or T suffix (powers of 1024); without it the
    backend's default budget applies."""
    if isinstance(spec, os.PathLike):
        return DirectoryBackend(spec)
    if not isinstance(spec, str):
        if isinstance(spec, StoreBackend):
            return spec
        raise TypeError(f"backend: expected a StoreBackend, a path or a spec string, got "
                        f"{type(spec).__name__}")
    if not spec:
        raise ValueError("backend: expected a path or a spec, got an empty string")
    if spec == "memory" or spec.startswith("memory:"):
        rest = spec[len("memory:"):] if spec.startswith("memory:") else ""
        left, opts = _split_query(rest, spec)
        if left or "fsync" in opts:
            raise ValueError(f"backend {spec!r}: expected 'memory' or 'memory:?budget=BYTES'")
        if "budget" in opts:
            return MemoryBackend(_parse_size(opts["budget"], spec))
        return MemoryBackend()
    if spec.startswith(("redis://", "rediss://", "unix://")):
        try:
            from .redis import RedisBackend
        except ImportError as exc:
            raise ImportError(f"backend {spec!r}: the Redis backend needs the 'redis' package "
                              f"(pip install redis) and kvcache.store.redis ({exc})") from exc
        backend: StoreBackend = RedisBackend(spec)
        return backend
    scheme = re.match(r"([A-Za-z][A-Za-z0-9+.-]*)://", spec)
    if scheme:
        raise ValueError(f"backend {spec!r}: unknown scheme {scheme.group(1)!r} (expected "
                         f"redis://, rediss:// or unix://, 'memory', or a folder)")
    path = spec[len("dir:"):] if spec.startswith("dir:") else spec
    path, opts = _split_query(path, spec)
    if "\0" in path:
        raise ValueError(f"backend {spec!r}: a folder name cannot hold a NUL character")
    if not path:
        raise ValueError(f"backend {spec!r}: no folder given")
    budget = _parse_size(opts["budget"], spec) if "budget" in opts else DEFAULT_DIRECTORY_BUDGET
    return DirectoryBackend(path, budget=budget, fsync=_flag(opts.get("fsync", "0"), spec))


class PrefixStore:
    """Stores the KV rows of prompt prefixes and loads them back (docs/store.md).

    Parameters
    ----------
    backend : StoreBackend, str or os.PathLike
        Where entries live (:func:`open_backend`): default the folder ``~/.cache/kvcache``.
    fingerprint : str or bytes
        Identifies the model and its weights (required): entries stored under another
        fingerprint never match.
    block : int
        Positions per block (default 256); only whole blocks are stored.  q8 caches in the
        legacy int8 scheme "cmf" need ``block > 64``.

    Examples
    --------
    >>> import numpy as np, kvcache as kc
    >>> from kvcache.store import PrefixStore
    >>> store = PrefixStore("memory", fingerprint="toy-model-v1", block=4)
    >>> cache = kc.KvCache(1, 2, 8, mode="f32")
    >>> cache[0].append(np.ones((10, 2, 8)), np.ones((10, 2, 8)))
    >>> store.put(range(10), cache)
    2
    >>> fresh = kc.KvCache(1, 2, 8, mode="f32")
    >>> store.load(range(10), fresh), fresh.seq_len
    (8, 8)
    """

    def __init__(self, backend: BackendSpec = DEFAULT_PATH, *, fingerprint: Union[str, bytes],
                 block: int = DEFAULT_BLOCK) -> None:
        fp = as_fingerprint(fingerprint)
        if isinstance(block, bool) or not isinstance(block, (int, np.integer)) or block < 1:
            raise ValueError(f"block: expected an int >= 1, got {block!r}")
        if block > 1 << 24:
            raise ValueError(f"block: expected at most {1 << 24} positions, got {block}")
        self._backend = open_backend(backend)
        self._fp = fp
        self._fp_digest = fingerprint_digest(fp)
        self._block = int(block)
        self._down: Optional[str] = None
        self._reported: set[bytes] = set()

    # ------------------------------------------------------------------ properties
    @property
    def backend(self) -> StoreBackend:
        return self._backend

    @property
    def block(self) -> int:
        """Positions per block."""
        return self._block

    @property
    def fingerprint(self) -> bytes:
        return self._fp

    @property
    def available(self) -> bool:
        """False once the backend raised BackendUnavailable (the store is then a no-op)."""
        return self._down is None

    def close(self) -> None:
        """Close the backend."""
        self._backend.close()

    def __enter__(self) -> PrefixStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"PrefixStore({self._backend.name!r}, block={self._block}"
                f"{'' if self._down is None else ', unavailable'})")

    # ------------------------------------------------------------------ public API
    def check(self, cache: KvCache) -> None:
        """Raise TypeError/ValueError unless this store can hold ``cache``'s rows: a
        :class:`kvcache.KvCache` of LayerKvCache layers of its geometry and one mode, none
        evicted, and a block that mode takes (q8 "cmf": ``block > 64``; 4-bit K: a multiple of
        32).  The checks ``put`` and ``load`` begin with; reads nothing from the backend, so a
        caller can refuse a pairing before it computes anything."""
        self._geometry(cache)

    def put(self, ids: object, cache: KvCache) -> int:
        """Store every full block of ``ids`` that is not stored yet; return how many were written.

        ``cache`` must hold exactly ``len(ids)`` positions on every layer and head (call it
        right after the prefill of ``ids``); see the module docstring for what else it must be.
        Raises ValueError/TypeError for bad inputs (nothing is stored)."""
        arr = as_ids(ids)
        geom = self._geometry(cache)
        states = [layer.state() for layer in cache.layers]
        for i, st in enumerate(states):
            _check_state(i, st, arr.shape[0], "put")
        if self._down is not None:
            return 0
        raw = block_keys(arr, self._fp, geom)
        if not raw:
            return 0
        names = [k.hex() for k in raw]
        written = 0
        try:
            present = self._backend.contains_many(names)
            for i, (key, name) in enumerate(zip(raw, names)):
                if present[i]:
                    continue
                if isinstance(self._backend, ScatterBackend):
                    self._backend.put_parts(name, _entry.encode_parts(geom, i, key,
                                                                      self._fp_digest, states))
                else:
                    self._backend.put(name, _entry.encode(geom, i, key, self._fp_digest, states))
                written += 1
        except BackendUnavailable as exc:
            self._disable(exc)
        return written

    def longest_prefix(self, ids: object, cache: KvCache) -> int:
        """How many leading positions of ``ids`` are stored for ``cache``'s model, mode and
        geometry (a multiple of ``block``).  Asks the backend whether the keys exist and reads
        no value, so a later ``load`` may still find fewer (an entry evicted or corrupted)."""
        arr = as_ids(ids)
        geom = self._geometry(cache)
        if self._down is not None:
            return 0
        names = [k.hex() for k in block_keys(arr, self._fp, geom)]
        if not names:
            return 0
        try:
            present = self._backend.contains_many(names)
        except BackendUnavailable as exc:
            self._disable(exc)
            return 0
        return _leading(present) * self._block

    def load(self, ids: object, cache: KvCache) -> int:
        """Append the stored blocks that continue ``cache`` along ``ids``; return how many
        positions were appended.

        ``cache`` is empty, or holds a whole number of blocks m (the caller vouches they are
        ``ids[:m]`` computed by this model); blocks m/block onwards are read, checked and
        appended on every layer, up to the first block that is missing or bad.  Afterwards
        ``cache.seq_len`` is m plus the returned count.  Nothing changes when it returns 0
        or raises.  Rows, scales, column fields and per-head lengths are then bit-identical to
        a cold prefill of those positions; importance is what the storing cache held (see
        docs/store.md)."""
        arr = as_ids(ids)
        geom = self._geometry(cache)
        states = [layer.state() for layer in cache.layers]
        m = states[0].seq_len                # _geometry: at least one layer
        for i, st in enumerate(states):
            _check_state(i, st, m, "load")
        b = self._block
        if m % b or m > arr.shape[0]:
            raise ValueError(f"load: the cache holds {m} positions; expected 0 or a multiple of "
                             f"block={b} that is at most len(ids)={arr.shape[0]}")
        if self._down is not None:
            return 0
        raw = block_keys(arr, self._fp, geom)
        first = m // b
        raw = raw[first:]
        if not raw:
            return 0
        names = [k.hex() for k in raw]
        try:
            run = _leading(self._backend.contains_many(names))
            if run == 0:
                return 0
            fresh = self._read(geom, states, first, raw[:run], names[:run])
        except BackendUnavailable as exc:
            self._disable(exc)
            return 0
        if fresh is None:
            return 0
        new_states, loaded = fresh
        for st in new_states:            # every layer checked before any is installed
            st.check(geom.num_kv_heads, geom.head_dim)
        for layer, st in zip(cache.layers, new_states):
            layer.install(st)
        return loaded

    def put_output(self, ids: object, cache: KvCache, values: object) -> bool:
        """Store ``values`` as the output after the prefix ``ids``: what a model driver
        computed at the prefix's last position and needs, besides the rows, to go on without
        recomputing it (the runner keeps its final hidden row, from which it computes the
        logits).  Return True when it was written, False when it was stored already or the
        store is off.

        ``len(ids)`` must be a positive multiple of ``block``; ``cache`` names the model's
        geometry and mode as for :meth:`put` (its rows are not read); ``values`` is a 1-D
        array of 1 to ``entry.OUTPUT_MAX`` real numbers, stored as float32.  Kept apart from
        the blocks under a key derived from the last block's and the count, in an entry of
        its own with a digest (docs/formats.md, "Prefix store output").  ValueError/TypeError
        for bad input (nothing is stored)."""
        arr = as_ids(ids)
        return self.put_outputs(arr, cache, {int(arr.shape[0]): values}) == 1

    def put_outputs(self, ids: object, cache: KvCache, outputs: Mapping[int, object]) -> int:
        """:meth:`put_output` of several prefixes of ``ids`` at once: ``outputs`` maps a prefix
        length (a positive multiple of ``block``, at most ``len(ids)``) to its values.  The
        block keys are computed once and the backend asked once which outputs it holds;
        returns how many were written.  Every length and vector is checked before anything
        is stored (ValueError/TypeError)."""
        arr = as_ids(ids)
        geom = self._geometry(cache)
        if not isinstance(outputs, Mapping):
            raise TypeError(f"outputs: expected a mapping of prefix lengths to values, got "
                            f"{type(outputs).__name__}")
        n, b = arr.shape[0], self._block
        vecs: list[tuple[int, npt.NDArray[np.float32]]] = []
        for length, values in outputs.items():
            if (isinstance(length, bool) or not isinstance(length, (int, np.integer))
                    or not 0 < length <= n or length % b):
                raise ValueError(f"outputs: an output is kept after whole blocks; expected "
                                 f"prefix lengths that are positive multiples of block={b} "
                                 f"up to len(ids)={n}, got {length!r}")
            vecs.append((int(length), _output_values(values)))
        if self._down is not None or not vecs:
            return 0
        raw = block_keys(arr[: max(length for length, _ in vecs)], self._fp, geom)
        items = [(raw[length // b - 1], vec) for length, vec in vecs]
        names = [output_key(key, vec.shape[0]).hex() for key, vec in items]
        written = 0
        try:
            present = self._backend.contains_many(names)
            for (key, vec), name, there in zip(items, names, present):
                if not there:
                    self._backend.put(name, _entry.encode_output(key, self._fp_digest, vec))
                    written += 1
        except BackendUnavailable as exc:
            self._disable(exc)
        return written

    def load_output(self, ids: object, cache: KvCache, count: int) -> Optional[
            npt.NDArray[np.float32]]:
        """The output of ``count`` values :meth:`put_output` stored after the prefix ``ids``
        for ``cache``'s model and mode, as a new float32 array; None when none is stored, the
        stored one fails its checks (it is then deleted and logged once, as a bad block is),
        or the store is off.  ValueError/TypeError for bad input."""
        arr = as_ids(ids)
        geom = self._geometry(cache)
        if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or not (
                1 <= count <= _entry.OUTPUT_MAX):
            raise ValueError(f"count: expected an int in [1, {_entry.OUTPUT_MAX}], got "
                             f"{count!r}")
        n, b = arr.shape[0], self._block
        if n == 0 or n % b:
            raise ValueError(f"ids: an output is kept after whole blocks; expected a positive "
                             f"multiple of block={b} ids, got {n}")
        if self._down is not None:
            return None
        key = block_keys(arr, self._fp, geom)[-1]
        name = output_key(key, int(count)).hex()
        try:
            value = self._backend.get_many([name])[0]
            if value is None:
                return None
            try:
                return _entry.decode_output(value, key, self._fp_digest, int(count))
            except _entry.EntryError as exc:
                self._bad(name, key, exc)
                return None
        except BackendUnavailable as exc:
            self._disable(exc)
            return None

    # ------------------------------------------------------------------ internals
    def _geometry(self, cache: object) -> Geometry:
        if not isinstance(cache, KvCache):
            raise TypeError(f"cache: expected a kvcache.KvCache, got {type(cache).__name__}")
        layers = cache.layers
        if not isinstance(layers, list) or not layers:
            raise ValueError(f"cache.layers: expected a non-empty list of layers, got "
                             f"{layers!r:.60}")
        mode: KvMode = cache.mode
        for i, layer in enumerate(layers):
            if not isinstance(layer, LayerKvCache):
                raise TypeError(f"cache.layers[{i}]: expected a LayerKvCache, got "
                                f"{type(layer).__name__}")
            if (layer.num_kv_heads, layer.head_dim) != (cache.num_kv_heads, cache.head_dim):
                raise ValueError(f"cache.layers[{i}]: geometry {layer.num_kv_heads}x"
                                 f"{layer.head_dim}, the cache is {cache.num_kv_heads}x"
                                 f"{cache.head_dim}")
            if layer.evicted:
                raise ValueError(f"cache.layers[{i}]: eviction dropped positions, so its rows "
                                 f"are no longer positions 0..n-1 of a prompt; the store cannot "
                                 f"describe it")
            if i == 0:
                mode = layer.mode
            elif layer.mode != mode:
                raise ValueError(f"cache.layers[{i}]: mode {layer.mode!r}, layer 0 has {mode!r}; "
                                 f"the store needs one mode for every layer")
        if mode.freezes_columns and self._block <= quant.COL_WARMUP:
            raise ValueError(f"block={self._block}: a {mode!r} cache needs block > "
                             f"{quant.COL_WARMUP} (its column fields freeze after "
                             f"{quant.COL_WARMUP} positions and requantise every row)")
        unit = math.lcm(*(max(p.per, p.settle) for _, spec in specs_of(mode, cache.head_dim)
                          for p in spec.parts))
        if self._block % unit:          # 4-bit K: quantised 32 rows at a time
            raise ValueError(f"block={self._block}: a {mode!r} cache needs a block that is a "
                             f"multiple of {unit} (its rows are quantised in blocks of {unit})")
        return Geometry(len(layers), cache.num_kv_heads, cache.head_dim, mode, self._block)

    def _read(self, geom: Geometry, states: list[LayerState], first: int, raw: list[bytes],
              names: list[str]) -> Optional[tuple[list[LayerState], int]]:
        """Read, check and copy blocks ``first ..`` (keys ``raw``) after the rows the states
        hold; None when not even the first block is good."""
        b = geom.block
        m = first * b
        cap = m + len(raw) * b
        g = geom.num_kv_heads
        fields, _ = _entry.layer_fields(geom)
        rows = [f for f in fields if len(f.shape) == 3]
        # destination arrays: the rows the cache holds, then room for every block in the run
        dest: list[dict[str, npt.NDArray[Any]]] = []
        for st in states:
            d: dict[str, npt.NDArray[Any]] = {}
            old = st.stores()
            for f in rows:
                arr: npt.NDArray[Any] = np.empty((g, cap // f.per, f.shape[2]), dtype=f.dtype)
                if m:
                    arr[:, : m // f.per] = old[f.name][:, : m // f.per]
                d[f.name] = arr
            imp: npt.NDArray[np.float32] = np.empty(cap, dtype=np.float32)
            imp[:m] = st.importance[:m]
            d["importance"] = imp
            dest.append(d)
        # the column state the loaded rows must share: the cache's own when it holds rows
        cols: Optional[list[Optional[bytes]]] = None
        col_arrays: Optional[list[dict[str, npt.NDArray[Any]]]] = None
        if m and not geom.mode.is_f32:
            cols = [_state_columns(st) for st in states]
        elif not geom.mode.is_f32 and not geom.mode.freezes_columns:
            # the int8 scheme "rows" never freezes a column: every entry's must be unfrozen
            cols = [_state_columns(st) for st in states]        # an empty layer's: unfrozen
        expected = cols

        def same_columns(got: list[Optional[bytes]]) -> None:
            nonlocal expected
            if expected is None:
                expected = got
            elif got != expected:
                # against the cache's own columns the cache, not the entry, is the odd one:
                # a miss for this load, but the entry stays for others
                raise _entry.EntryError("column fields differ from the earlier blocks' (or the "
                                        "cache's)", remove=expected is not cols or good > 0)

        good = 0
        backend = self._backend
        if isinstance(backend, ScatterBackend):
            # read each entry straight into the new arrays; checked before anything is kept
            col_tmp = [{f.name: np.empty(f.shape, dtype=f.dtype) for f in fields
                        if len(f.shape) < 3 and f.name != "importance"} for _ in states]
            header = bytearray(_entry.HEADER_SIZE)
            trailer = bytearray(_entry.DIGEST_SIZE)
            pad = memoryview(bytearray(8))
            total = _entry.entry_size(geom)
            for idx in range(len(raw)):
                at = m + idx * b
                parts: list[memoryview] = [memoryview(header)]
                for d, tmp in zip(dest, col_tmp):
                    for f in fields:
                        if len(f.shape) == 3:
                            parts += [d[f.name][h, at // f.per: (at + b) // f.per].data.cast("B")
                                      for h in range(g)]
                        elif f.name == "importance":
                            parts.append(d["importance"][at: at + b].data.cast("B"))
                        else:
                            parts.append(tmp[f.name].data.cast("B"))
                        if f.nbytes % 8:
                            parts.append(pad[: -f.nbytes % 8])
                parts.append(memoryview(trailer))
                n = backend.read_parts(names[idx], parts)
                if n is None:
                    break
                try:
                    if n != total:
                        raise _entry.EntryError(f"truncated or padded: {n} bytes, this geometry "
                                                f"needs {total}")
                    alg = _entry.check_header(header, n, geom, first + idx, raw[idx],
                                              self._fp_digest)
                    if _entry.digest_parts(alg, parts[:-1]) != _entry.stored_digest(trailer, 8):
                        raise _entry.EntryError("digest mismatch (corrupted entry)")
                    same_columns([_entry.columns_of(t) for t in col_tmp])
                except _entry.EntryError as exc:
                    self._bad(names[idx], raw[idx], exc)   # what it wrote lies past the
                    break                                   # loaded rows; col_tmp is dropped
                if col_arrays is None:
                    col_arrays = [{k: a.copy() for k, a in t.items()} for t in col_tmp]
                good += 1
        else:
            per_batch = max(1, _READ_BATCH_BYTES // _entry.entry_size(geom))
            # values as buffers where the backend can give them without a copy (Redis)
            get_many = (backend.get_many_buffers if isinstance(backend, BufferBackend)
                        else backend.get_many)
            stop = False
            for lo in range(0, len(raw), per_batch):
                values = get_many(names[lo: lo + per_batch])
                for j, value in enumerate(values):
                    idx = lo + j
                    if value is None:
                        stop = True
                        break
                    try:
                        layers = _entry.decode(value, geom, first + idx, raw[idx],
                                               self._fp_digest)
                        same_columns([_entry.columns_of(a) for a in layers])
                    except _entry.EntryError as exc:
                        self._bad(names[idx], raw[idx], exc)
                        stop = True
                        break
                    if col_arrays is None:
                        col_arrays = [{k: a[k] for k in ("kcol", "vcol", "kcol_on", "vcol_on")
                                       if k in a} for a in layers]
                    at = m + idx * b
                    for d, arrays in zip(dest, layers):
                        for f in rows:
                            d[f.name][:, at // f.per: (at + b) // f.per] = arrays[f.name]
                        d["importance"][at: at + b] = arrays["importance"]
                    good += 1
                if stop:
                    break
        if good == 0:
            return None
        n = m + good * b
        out: list[LayerState] = []
        specs = specs_of(geom.mode, geom.head_dim)
        for i, (st, d) in enumerate(zip(states, dest)):
            if m or geom.mode.is_f32 or col_arrays is None:
                kcol, vcol = np.array(st.kcol), np.array(st.vcol)
                kon, von = np.array(st.kcol_on), np.array(st.vcol_on)
            else:
                src = col_arrays[i]
                kcol, vcol = np.array(src["kcol"]), np.array(src["vcol"])
                kon, von = np.array(src["kcol_on"]), np.array(src["vcol_on"])
            arrays = {f.name: d[f.name] for f in rows}
            for c, spec in specs:
                # what the entries do not carry (4-bit K's ring), from what they do
                carried = {p.name: arrays[c + p.name] for p in spec.carried}
                own = {p.name: getattr(st, c + p.name) for p in spec.parts}
                arrays.update((c + name, a) for name, a in
                              spec.kind.rebuilt(carried, n, m, own).items())
            out.append(LayerState(
                mode=geom.mode, num_kv_heads=g, head_dim=geom.head_dim, seq_len=n,
                lengths=np.full(g, n, dtype=np.intp), kcol=kcol, vcol=vcol, kcol_on=kon,
                vcol_on=von, importance=np.array(d["importance"][:n]),
                linear_state=np.zeros(0, dtype=np.float32), linear_scratch=None, o1=None,
                owned=True, **arrays))
        return out, good * b

    def _bad(self, name: str, key: bytes, exc: _entry.EntryError) -> None:
        """A stored entry that failed its checks: a miss, deleted, and logged once (an entry
        that could not be deleted, e.g. in a read-only folder, is not reported again)."""
        if exc.remove:
            self._backend.delete(name)
        if key in self._reported:
            return
        _log.warning("kvcache store %s: entry %s is unusable (%s)%s; treated as a miss",
                     self._backend.name, name[:16], exc.reason,
                     ", deleted" if exc.remove else "")
        if not exc.remove or self._backend.contains_many([name])[0]:
            if len(self._reported) >= _REPORTED_MAX:
                self._reported.clear()
            self._reported.add(key)

    def _disable(self, exc: BaseException) -> None:
        if self._down is None:
            self._down = str(exc)
            _log.warning("kvcache store %s: backend unavailable (%s); the prefix store is off "
                         "for the rest of this run", self._backend.name, exc)


def _output_values(values: object) -> npt.NDArray[np.float32]:
    """``values`` as a 1-D float32 array for :meth:`PrefixStore.put_output`: TypeError for
    what is not real numbers, ValueError for another shape or size."""
    if isinstance(values, (str, bytes, bytearray, memoryview)):
        raise TypeError(f"values: expected a 1-D array of real numbers, got "
                        f"{type(values).__name__}")
    try:
        arr = np.asarray(values)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"values: expected a 1-D array of real numbers ({exc})") from None
    if arr.dtype.kind not in "fiu":
        raise TypeError(f"values: expected real numbers, got dtype {arr.dtype}")
    if arr.ndim != 1 or not 1 <= arr.shape[0] <= _entry.OUTPUT_MAX:
        raise ValueError(f"values: expected a 1-D array of 1 to {_entry.OUTPUT_MAX} values, "
                         f"got shape {arr.shape}")
    return np.ascontiguousarray(arr, dtype=np.float32)


def _leading(flags: Sequence[bool]) -> int:
    n = 0
    for f in flags:
        if not f:
            break
        n += 1
    return n


def _state_columns(st: LayerState) -> bytes:
    return b"".join(np.ascontiguousarray(a).tobytes()
                    for a in (st.kcol_on, st.vcol_on, st.kcol, st.vcol))


def _check_state(i: int, st: LayerState, n: int, what: str) -> None:
    """ValueError unless layer ``i`` holds exactly ``n`` positions on every head, importance
    for all of them and no O(1) state, with frozen columns in q8 modes past the warm-up."""
    if st.o1 is not None or st.linear_state.size or (st.linear_scratch is not None
                                                     and st.linear_scratch.size):
        raise ValueError(f"{what}: layer {i} carries O(1) or linear state, which the prefix "
                         f"store does not handle")
    if st.seq_len != n:
        raise ValueError(f"{what}: layer {i} holds {st.seq_len} positions, expected {n}"
                         + (" (len(ids))" if what == "put" else " (every layer alike)"))
    if (st.lengths != n).any() or st.importance.shape[0] != n:
        raise ValueError(f"{what}: layer {i} has heads holding {st.lengths.tolist()} rows and "
                         f"importance for {st.importance.shape[0]} of its {n} positions (dead "
                         f"heads or evicted rows), which the prefix store does not handle")
    if st.mode.freezes_columns and n > quant.COL_WARMUP:
        for (_, spec), name, on in zip(specs_of(st.mode, st.head_dim), ("key", "value"),
                                       (st.kcol_on, st.vcol_on)):
            if spec.kind.can_freeze and not on.all():
                raise ValueError(f"{what}: layer {i} holds {n} int8 {name} rows without frozen "
                                 f"column fields (not what appending them gives)")
    elif st.any_col_frozen():
        raise ValueError(f"{what}: layer {i} has frozen column fields with only {n} positions "
                         f"(rolled back below the warm-up), which the prefix store does not "
                         f"handle")
