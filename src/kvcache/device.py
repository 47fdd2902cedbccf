"""GPU view shims: zero-copy hand-off of cache storage, and incremental device mirrors.

kvcache owns its storage on the CPU.  A runner that offloads attention or whole layers to a GPU
keeps the CPU cache as the owner of record and a *mirror* of it on the device.  This module
gives it the two pieces:

**Zero-copy export.**  Every storage view kvcache hands out (``head_keys``/``head_values``,
``q8_rows``, ``columns``, latent ``valid_view``/``slot_storage``, static K/V, the arrays of
:class:`kvcache.O1DeviceView`) is a plain NumPy array, so ``torch.from_dlpack(view)`` and
``np.from_dlpack(view)`` wrap the same memory without a copy.  :func:`as_tensor` does that
and also covers bfloat16 storage, which NumPy's DLPack exporter refuses (it is exported as
uint16 and reinterpreted, still without a copy); :func:`tensors` does it for a whole
``O1DeviceView``.  Views are read-only in NumPy, but torch has no read-only tensors: writing
through such a tensor writes into the cache.  CuPy cannot wrap host memory; use a
:class:`Mirror` to put the storage on a CUDA device.

**Mirrors.**  ``Mirror(cache, backend="torch", device="cuda")`` keeps device copies of a
:class:`~kvcache.LayerKvCache` (float32 or int8 storage, or the state of a sealed O(1) layer),
a :class:`~kvcache.KvCache` (one mirror per layer), a :class:`~kvcache.LatentKvCache` or a
:class:`~kvcache.StaticKvCache`.  :meth:`Mirror.sync` compares the cache's
``generation`` with the one it last synced:

- unchanged: only the rows appended since the last sync are uploaded;
- changed by truncations only: the rows from the lowest truncation point on are uploaded
  (the cache's ``unchanged_prefix``), so a speculative-decode rollback costs what it
  re-appends, not the whole context;
- anything else (eviction, clear, import, column freeze, seal, O(1) restore): everything is
  uploaded again.

Device capacity grows geometrically (doubling, at least 64 rows), as the host storage does:
on growth the rows already on the device are copied device-to-device, not re-uploaded.  Each
sync returns a :class:`SyncStats` with the bytes it moved.

Backends: ``"torch"`` (any device torch knows: ``"cpu"``, ``"cuda"``, ``"cuda:1"``, ...),
``"cupy"`` (a CUDA device ordinal) and ``"numpy"`` (host arrays; a plain copy, useful as a
staging buffer and as the backend-free test of the sync logic).  torch and CuPy are imported
on first use; without them :class:`Mirror` raises ImportError saying what to install.

A mirror reads the cache's storage directly and is not thread-safe: do not append to the cache
while a sync runs.  Writes made by hand into a cache's storage (``slot_storage``) are not
tracked; re-sync with ``sync(full=True)`` after them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ._validate import as_index, readonly
from .latent import LatentKvCache, LazyLatentCache, StaticKvCache, _slot_index
from .layer import LayerKvCache
from .model import KvCache
from .o1 import O1DeviceView, O1HeadView

__all__ = ["as_tensor", "tensors", "Mirror", "LayerMirror", "KvCacheMirror", "LatentMirror",
           "StaticMirror", "SyncStats"]

_MIN_DEVICE_ROWS = 64
_BACKENDS = ("torch", "cupy", "numpy")


def _is_bf16(dtype):
    dtype = np.dtype(dtype)
    return dtype.kind == "V" and dtype.name == "bfloat16"     # ml_dtypes' bfloat16


# ------------------------------------------------------------------------------ zero-copy export
def as_tensor(array, backend="torch"):
    """Wrap a NumPy array (any kvcache storage view) as a torch tensor or NumPy array sharing
    its memory, through DLPack.

    Parameters
    ----------
    array : numpy.ndarray
    backend : {"torch", "numpy"}

    Returns
    -------
    torch.Tensor or numpy.ndarray
        On the CPU, with ``data_ptr()`` (``ctypes.data``) equal to ``array``'s.  bfloat16
        arrays become ``torch.bfloat16`` tensors (NumPy's DLPack exporter has no bfloat16:
        the bytes are exported as uint16 and reinterpreted).  A read-only view stays read-only
        with ``"numpy"``; torch tensors are always writable, and writing through one writes
        into the cache.
    """
    if not isinstance(array, np.ndarray):
        raise TypeError(f"array: expected a numpy array, got {type(array).__name__}")
    if backend not in ("torch", "numpy"):
        raise ValueError(f"backend: expected 'torch' or 'numpy' (CuPy cannot wrap host memory; "
                         f"use Mirror(..., backend='cupy')), got {backend!r}")
    bf16 = _is_bf16(array.dtype)
    if not bf16 and (array.dtype.kind not in "biuf" or not array.dtype.isnative):
        raise TypeError(f"array: DLPack carries native-endian bool, integer and float arrays, "
                        f"got dtype {array.dtype}")
    if backend == "numpy":
        return array.view() if bf16 else _from_dlpack(np.from_dlpack, array, array.view)
    torch = _import("torch")
    if bf16:
        return _from_dlpack(torch.from_dlpack, array.view(np.uint16),
                            lambda: _torch_from_numpy(torch, array.view(np.uint16))
                            ).view(torch.bfloat16)
    return _from_dlpack(torch.from_dlpack, array, lambda: _torch_from_numpy(torch, array))


def _from_dlpack(consume, array, fallback):
    """``consume(array)``; for a read-only array on a NumPy or torch too old for versioned
    DLPack (which alone carries the read-only flag: NumPy < 2.1, torch < 2.8 or so) the
    exporter refuses, and ``fallback()`` wraps the same memory another way."""
    try:
        return consume(array)
    except BufferError:
        if array.flags.writeable:
            raise
        return fallback()


def _torch_from_numpy(torch, array):
    import warnings
    with warnings.catch_warnings():          # "not writable": documented above, not a surprise
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


def tensors(view, backend="torch"):
    """An :class:`~kvcache.O1DeviceView` (or :class:`~kvcache.O1HeadView`, or a list of them,
    as ``o1_views()`` returns) with every array replaced by :func:`as_tensor` of it: the
    same scalars, the same memory, no copy."""
    if isinstance(view, (list, tuple)):
        return type(view)(tensors(v, backend) for v in view)
    if isinstance(view, O1HeadView):
        return dataclasses.replace(view, **{f: as_tensor(getattr(view, f), backend)
                                            for f in ("t_hat", "z_hat", "m_max", "q_tilde", "mu")})
    if isinstance(view, O1DeviceView):
        arrays = {f: as_tensor(getattr(view, f), backend)
                  for f in ("win_k", "win_v", "sink_k", "sink_v", "k_tilde")}
        return dataclasses.replace(view, heads=tensors(view.heads, backend), **arrays)
    raise TypeError(f"view: expected an O1DeviceView, an O1HeadView or a list of them, got "
                    f"{type(view).__name__}")


# ------------------------------------------------------------------------------ backends
def _import(name):
    try:
        return __import__(name)
    except ImportError as exc:
        hint = {"torch": "pip install torch (for a CPU-only build: pip install torch "
                         "--index-url https://download.pytorch.org/whl/cpu)",
                "cupy": "pip install cupy-cuda12x (a CUDA device is needed)"}[name]
        raise ImportError(f"kvcache.device: the {name!r} backend needs {name}, which is not "
                          f"installed ({exc}); {hint}") from None


class _TorchBackend:
    name = "torch"

    def __init__(self, device):
        torch = self._torch = _import("torch")
        try:
            dev = torch.device("cpu" if device is None else device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"device: torch does not know {device!r} ({exc})") from None
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"device: {dev} was asked for, but torch sees no CUDA device")
        if dev.type == "meta":
            raise ValueError("device: 'meta' tensors hold no data; a mirror needs a real device")
        try:                                   # fail here, not half-way through the first sync
            probe = torch.zeros(2, dtype=torch.int8, device=dev)
            probe[1:].copy_(torch.ones(1, dtype=torch.int8))
            probe.cpu()
        except Exception as exc:
            raise RuntimeError(f"device: torch cannot allocate and copy on {dev} "
                               f"({type(exc).__name__}: {exc})") from None
        self.device = dev
        self._cpu = dev.type == "cpu"

    def dtype(self, np_dtype):
        if _is_bf16(np_dtype):
            return self._torch.bfloat16
        return {"float32": self._torch.float32, "float16": self._torch.float16,
                "float64": self._torch.float64, "int8": self._torch.int8,
                "uint8": self._torch.uint8}[np.dtype(np_dtype).name]

    def empty(self, shape, np_dtype):
        return self._torch.empty(shape, dtype=self.dtype(np_dtype), device=self.device)

    def upload(self, dst, src):
        if self._cpu:          # a NumPy copy: torch's copy_ costs ~30 us more per small slice
            if _is_bf16(src.dtype):
                dst.view(self._torch.int16).numpy()[...] = src.view(np.int16)
            else:
                dst.numpy()[...] = src
        else:
            dst.copy_(as_tensor(src, "torch"))

    def copy(self, dst, src):
        dst.copy_(src)

    def to_numpy(self, t):
        if not isinstance(t, self._torch.Tensor):
            raise TypeError(f"tensor: expected a torch.Tensor of this mirror, got "
                            f"{type(t).__name__}")
        t = t.detach().cpu()
        if t.dtype == self._torch.bfloat16:
            import ml_dtypes
            return t.view(self._torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()


class _ArrayBackend:
    """NumPy (host arrays) or CuPy (CUDA arrays): the same slice assignments."""

    def __init__(self, name, device):
        self.name = name
        if name == "numpy":
            if device not in (None, "cpu"):
                raise ValueError(f"device: the numpy backend keeps its copy in host memory; "
                                 f"expected None or 'cpu', got {device!r}")
            self._xp = np
            self.device = "cpu"
        else:
            ordinal = _cuda_ordinal(device)
            self._xp = _import("cupy")
            self.device = self._xp.cuda.Device(ordinal)

    def empty(self, shape, np_dtype):
        if self.name == "cupy":
            if _is_bf16(np_dtype):
                raise TypeError("the cupy backend has no bfloat16 arrays; use backend='torch'")
            with self.device:
                return self._xp.empty(shape, dtype=np_dtype)
        return np.empty(shape, dtype=np_dtype)

    def upload(self, dst, src):
        if self.name == "cupy":
            with self.device:
                dst[...] = self._xp.asarray(src)
        else:
            dst[...] = src

    def copy(self, dst, src):
        if self.name == "cupy":
            with self.device:
                dst[...] = src
        else:
            dst[...] = src

    def to_numpy(self, a):
        if not isinstance(a, self._xp.ndarray):
            raise TypeError(f"tensor: expected a {self.name} array of this mirror, got "
                            f"{type(a).__name__}")
        if self.name == "cupy":
            with self.device:
                return self._xp.asnumpy(a)
        return np.array(a)


def _cuda_ordinal(device):
    """CuPy's device: None (0), an int >= 0 or "cuda" / "cuda:N"."""
    if device is None:
        return 0
    if isinstance(device, (int, np.integer)) and not isinstance(device, (bool, np.bool_)):
        if device >= 0:
            return int(device)
    elif isinstance(device, str) and device.split(":")[0] == "cuda":
        tail = device.partition(":")[2]
        if tail == "" or tail.isdigit():
            return int(tail or 0)
    raise ValueError(f"device: the cupy backend takes a CUDA device ordinal (an int >= 0) or "
                     f"'cuda[:N]', got {device!r}")


def _backend(backend, device):
    if backend == "torch":
        return _TorchBackend(device)
    if backend in ("cupy", "numpy"):
        return _ArrayBackend(backend, device)
    raise ValueError(f"backend: expected one of {_BACKENDS}, got {backend!r}")


# ------------------------------------------------------------------------------ mirrors
@dataclass(frozen=True)
class SyncStats:
    """What one :meth:`Mirror.sync` did.

    Attributes
    ----------
    full : bool
        Everything was uploaded (first sync, ``full=True``, or the cache diverged).
    rows : int
        Rows uploaded, summed over heads / slots / layers.
    bytes : int
        Bytes copied host -> device.
    device_bytes : int
        Bytes copied device -> device while growing the device capacity.
    """

    full: bool
    rows: int
    bytes: int
    device_bytes: int

    def __add__(self, other):
        if not isinstance(other, SyncStats):
            return NotImplemented
        return SyncStats(self.full or other.full, self.rows + other.rows,
                         self.bytes + other.bytes, self.device_bytes + other.device_bytes)


_NOTHING = SyncStats(False, 0, 0, 0)


def _grow(need, cap, limit=None):
    """The next device capacity: ``cap`` doubled (at least 64) until it holds ``need``, at most
    ``limit`` (a full upload sizes from 64 the same way, so it usually leaves room)."""
    new = max(2 * cap, _MIN_DEVICE_ROWS)
    while new < need:
        new *= 2
    return new if limit is None else max(min(new, limit), need)


def _rows(axis, a, b):
    return (slice(None),) * axis + (slice(a, b),)


class Mirror:
    """Device copies of a cache, kept in step by :meth:`sync` (see the module docstring).

    ``Mirror(cache, backend="torch", device=None)`` returns the mirror for the cache's type:
    :class:`LayerMirror`, :class:`KvCacheMirror`, :class:`LatentMirror` or
    :class:`StaticMirror`; the first sync runs in the constructor.

    Parameters
    ----------
    cache : LayerKvCache, KvCache, LatentKvCache or StaticKvCache
    backend : {"torch", "cupy", "numpy"}
    device : str, int or torch.device, optional
        torch: any torch device (default ``"cpu"``); cupy: a device ordinal or ``"cuda:N"``
        (default 0); numpy: None or ``"cpu"``.

    The accessors mirror the cache's own (same names, signatures and shapes: see each
    subclass's ``MIRRORED``) and return device arrays as of the last sync.  What a device
    kernel does not read stays on the cache: importance, the linear state, the O(1) collecting
    trace, ``slot_storage`` / ``layers`` (the full host buffers), the device location.  They are views of
    the mirror's storage: do not write through them, and do not keep them across a sync that
    grows the capacity (they would point at the old storage).
    """

    MIRRORED = ()
    _CACHE = None                     # the cache type a subclass mirrors

    def __new__(cls, cache, backend="torch", device=None):
        if cls is Mirror:
            for sub in (LayerMirror, KvCacheMirror, LatentMirror, StaticMirror):
                if isinstance(cache, sub._CACHE):
                    cls = sub
                    break
            else:
                if isinstance(cache, LazyLatentCache):
                    raise TypeError("cache: a LazyLatentCache is immutable and copies a layer per "
                                    "append; mirror the LatentKvCache it stands in for instead")
                raise TypeError(f"cache: expected a LayerKvCache, KvCache, LatentKvCache or "
                                f"StaticKvCache, got {type(cache).__name__}")
        return object.__new__(cls)

    def __init__(self, cache, backend="torch", device=None):
        if not isinstance(cache, self._CACHE):
            raise TypeError(f"cache: expected a {self._CACHE.__name__}, got "
                            f"{type(cache).__name__}")
        self._be = _backend(backend, device)
        self._cache = cache
        self._gen = None              # generation at the last complete sync; None: full next
        self.total = _NOTHING         # SyncStats summed over every sync
        self.syncs = 0
        self._setup(cache, backend, device)
        self.sync()

    def _setup(self, cache, backend, device):
        """The subclass's empty device state (before the first sync)."""

    @property
    def cache(self):
        """The cache this mirror follows."""
        return self._cache

    @property
    def backend(self):
        """``"torch"``, ``"cupy"`` or ``"numpy"``."""
        return self._be.name

    @property
    def device(self):
        """The device the copies live on (a ``torch.device``, a ``cupy.cuda.Device`` or
        ``"cpu"``)."""
        return self._be.device

    @property
    def generation(self):
        """The cache's ``generation`` at the last sync; None before the first one completes
        and after a failed one (the next sync is then full)."""
        return self._gen

    def sync(self, full=False):
        """Bring the device copies up to the cache's present state.

        Parameters
        ----------
        full : bool
            Upload everything even when the cache only appended (after writing into the
            cache's storage by hand, say).

        Returns
        -------
        SyncStats

        When an upload fails part-way (a device out of memory, say), the error propagates
        and the next sync is a full one.
        """
        if not isinstance(full, (bool, np.bool_)):
            raise TypeError(f"full: expected a bool, got {type(full).__name__}")
        gen = self._cache.generation
        try:
            stats = self._sync(bool(full) or self._gen is None, gen)
        except BaseException:
            self._gen = None
            raise
        self._gen = gen
        self.total = self.total + stats
        self.syncs += 1
        return stats

    def to_numpy(self, tensor):
        """A host NumPy copy of one of this mirror's device arrays (for checks and tests)."""
        return self._be.to_numpy(tensor)


class LayerMirror(Mirror):
    """Mirror of one :class:`~kvcache.LayerKvCache`.

    Device storage: float32 K and V ``(num_kv_heads, capacity, head_dim)``, or for int8
    storage the int8 rows, their float32 scales and the frozen column fields, as the cache
    holds them; for a sealed O(1) layer the arrays of its :meth:`o1_views` (re-uploaded
    whole after each step: the state is constant-size).  A layer sealed in exact-only mode
    has no device form (spec 6.9): its mirror holds no rows and ``o1_views()`` is None.
    """

    MIRRORED = ("seq_len", "num_kv_heads", "head_dim", "mode", "generation", "__len__", "head_len",
                "head_keys", "head_values", "k_heads", "v_heads", "q8_rows", "columns",
                "o1_sealed", "o1_views")

    _CACHE = LayerKvCache
    _O1_CONST = ("sink_k", "sink_v", "k_tilde", "q_tilde", "mu")
    _O1_MOVING = ("win_k", "win_v", "t_hat", "z_hat", "m_max")

    def _setup(self, cache, backend, device):
        nkv, hd = cache.num_kv_heads, cache.head_dim
        self._mode = None
        self._lens = np.zeros(nkv, dtype=np.intp)
        self._seq = 0
        self._cap = 0
        self._rows = {}               # cache store name -> device (nkv, cap, width)
        self._cols = None             # (kcol, vcol) device (nkv, hd), (kcol_on, vcol_on) host
        self._o1 = None               # sealed state: dict of device arrays + scalars
        self._nkv, self._hd = nkv, hd

    # ---------------------------------------------------------------- sync
    def _sync(self, full, gen):
        c = self._cache
        if c.o1_sealed():
            return self._sync_o1(full, gen)
        if self._o1 is not None or c.mode != self._mode:
            full = True
        prefix = None if full else c.unchanged_prefix(self._gen)
        if prefix is None:
            full = True
            keep = np.zeros(self._nkv, dtype=np.intp)
        else:
            keep = np.minimum(self._lens, prefix)
        lens = c._len.copy()
        names = c._stores()
        need = int(lens.max(initial=0))
        moved = 0
        same_fields = set(names) == set(self._rows)
        if same_fields and need <= self._cap:
            rows, cap = dict(self._rows), self._cap
        else:
            cap = _grow(need, self._cap if same_fields else 0)
            kept = 0 if full else int(keep.max(initial=0))
            rows = {}
            for name in names:
                width, dtype = c._trailing(name)
                rows[name] = self._be.empty((self._nkv, cap, width), dtype)
                if kept:                  # incremental: the device keeps what it has
                    self._be.copy(rows[name][:, :kept], self._rows[name][:, :kept])
                    moved += self._nkv * kept * width * np.dtype(dtype).itemsize
        nbytes = 0
        same = bool((keep == keep[0]).all() and (lens == lens[0]).all())
        for name in names:
            host = getattr(c, name)
            if same:
                a, b = int(keep[0]), int(lens[0])
                if b > a:
                    self._be.upload(rows[name][:, a:b], host[:, a:b])
                    nbytes += host[:, a:b].nbytes
            else:
                for h in range(self._nkv):
                    a, b = int(keep[h]), int(lens[h])
                    if b > a:
                        self._be.upload(rows[name][h, a:b], host[h, a:b])
                        nbytes += host[h, a:b].nbytes
        uploaded = int(np.maximum(lens - keep, 0).sum())
        cols = self._cols
        if full:                         # column fields change only at a divergence
            cols = []
            for host, on in ((c._kcol, c._kcol_on), (c._vcol, c._vcol_on)):
                dev = None
                if on.any():
                    dev = self._be.empty(host.shape, np.float32)
                    self._be.upload(dev, host)
                    nbytes += host.nbytes
                cols.append(dev)
            cols = tuple(cols) + (c._kcol_on.copy(), c._vcol_on.copy())
        # commit (nothing below can fail)
        self._rows, self._cap, self._cols = rows, cap, cols
        self._lens, self._seq, self._mode, self._o1 = lens, c.seq_len, c.mode, None
        return SyncStats(full, uploaded, nbytes, moved)

    def _sync_o1(self, full, gen):
        c = self._cache
        st = c.o1
        if st.exact_only:
            o1 = {"exact_only": True}
            stats = SyncStats(full or self._o1 is None or gen != self._gen, 0, 0, 0)
        else:
            full = full or self._o1 is None or gen != self._gen
            if not full and c.seq_len == self._seq:
                return _NOTHING
            names = self._O1_MOVING + (self._O1_CONST if full else ())
            o1 = dict(self._o1) if not full else {}
            nbytes = 0
            for name in names:
                host = getattr(st, name)
                dev = o1.get(name)
                if dev is None:
                    dev = self._be.empty(host.shape, host.dtype)
                self._be.upload(dev, host)
                nbytes += host.nbytes
                o1[name] = dev
            o1.update(exact_only=False, scalars=dict(
                m_eff=st.m_eff, w=st.w, sink_len=st.sink_len, d=st.d, dv=st.dv, scale=st.scale,
                win_len=st.win_len, win_head=st.win_head, far_len=st.far_len),
                hpk=st.hpk, rect_fm=st.rect.name == "FM")
            stats = SyncStats(full, 0, nbytes, 0)
        self._rows, self._cap, self._cols = {}, 0, None
        self._lens = np.zeros(self._nkv, dtype=np.intp)
        self._seq, self._mode, self._o1 = c.seq_len, c.mode, o1
        return stats

    # ---------------------------------------------------------------- accessors
    @property
    def seq_len(self):
        """The cache's ``seq_len`` at the last sync."""
        return self._seq

    @property
    def num_kv_heads(self):
        return self._nkv

    @property
    def head_dim(self):
        return self._hd

    @property
    def mode(self):
        """The cache's storage mode at the last sync."""
        return self._mode

    @property
    def capacity(self):
        """Rows per head the device storage holds before it must grow."""
        return self._cap

    def __len__(self):
        return self._seq

    def head_len(self, h):
        return int(self._lens[as_index("kv_head", h, self._nkv)])

    def _empty(self, dtype=np.float32, width=None):
        return self._be.empty((0, self._hd if width is None else width), dtype)

    def head_keys(self, h):
        """Device (head_len(h), head_dim) float32 keys; empty when K is int8."""
        h = as_index("kv_head", h, self._nkv)
        if "_kf" not in self._rows:
            return self._empty()
        return self._rows["_kf"][h, : self._lens[h]]

    def head_values(self, h):
        """Device (head_len(h), head_dim) float32 values; empty when V is int8."""
        h = as_index("kv_head", h, self._nkv)
        if "_vf" not in self._rows:
            return self._empty()
        return self._rows["_vf"][h, : self._lens[h]]

    def k_heads(self):
        return [self.head_keys(h) for h in range(self._nkv)]

    def v_heads(self):
        return [self.head_values(h) for h in range(self._nkv)]

    def q8_rows(self, h):
        """Device (kq, ks, vq, vs) of head h as :meth:`LayerKvCache.q8_rows` (None for float32
        parts)."""
        h = as_index("kv_head", h, self._nkv)
        n = int(self._lens[h])
        r = self._rows
        k = (r["_kq"][h, :n], r["_ks"][h, :n]) if "_kq" in r else (None, None)
        v = (r["_vq"][h, :n], r["_vs"][h, :n, 0]) if "_vq" in r else (None, None)
        return k + v

    def columns(self, h):
        """Device frozen column fields of head h: (kcol, vcol), each (head_dim,) or None."""
        h = as_index("kv_head", h, self._nkv)
        if self._cols is None:
            return (None, None)
        kcol, vcol, kon, von = self._cols
        return (kcol[h] if kon[h] else None, vcol[h] if von[h] else None)

    def o1_sealed(self):
        """Whether the cache was sealed at the last sync."""
        return self._o1 is not None

    def o1_views(self):
        """:class:`~kvcache.O1DeviceView` per KV group holding device arrays, as
        :meth:`LayerKvCache.o1_views` at the last sync; None when not sealed or exact-only."""
        o1 = self._o1
        if o1 is None or o1["exact_only"]:
            return None
        hpk = o1["hpk"]
        out = []
        for g in range(self._nkv):
            heads = tuple(O1HeadView(rect_fm=o1["rect_fm"], t_hat=o1["t_hat"][h],
                                     z_hat=o1["z_hat"][h], m_max=o1["m_max"][h],
                                     q_tilde=o1["q_tilde"][h], mu=o1["mu"][h])
                          for h in range(g * hpk, (g + 1) * hpk))
            out.append(O1DeviceView(exact_only=False, win_k=o1["win_k"][g],
                                    win_v=o1["win_v"][g], sink_k=o1["sink_k"][g],
                                    sink_v=o1["sink_v"][g], k_tilde=o1["k_tilde"][g],
                                    heads=heads, **o1["scalars"]))
        return out

    def __repr__(self):
        return (f"LayerMirror(backend={self.backend!r}, device={self.device!s}, "
                f"seq_len={self._seq}, capacity={self._cap}, generation={self._gen})")


class KvCacheMirror(Mirror):
    """Mirror of a :class:`~kvcache.KvCache`: one :class:`LayerMirror` per layer
    (``mirror[i]``, ``mirror.layers``), synced together."""

    MIRRORED = ("seq_len", "num_kv_heads", "head_dim", "mode", "max_seq_len", "generation",
                "__len__", "__getitem__")

    _CACHE = KvCache

    def _setup(self, cache, backend, device):
        self.layers = None
        self._args = (backend, device)

    def _sync(self, full, gen):
        if self.layers is None:           # the first sync: each layer mirror syncs as made
            self.layers = [LayerMirror(layer, *self._args) for layer in self._cache.layers]
            stats = _NOTHING
            for m in self.layers:
                stats = stats + m.total
            return stats
        if len(self.layers) != len(self._cache.layers) or any(
                m.cache is not l for m, l in zip(self.layers, self._cache.layers)):
            raise ValueError("cache: its list of layers was replaced or resized since this "
                             "mirror was made; make a new Mirror")
        stats = _NOTHING
        for m in self.layers:
            stats = stats + m.sync(full)
        return stats

    @property
    def seq_len(self):
        return max((m.seq_len for m in self.layers), default=0)

    @property
    def num_kv_heads(self):
        return self._cache.num_kv_heads

    @property
    def head_dim(self):
        return self._cache.head_dim

    @property
    def mode(self):
        return self._cache.mode

    @property
    def max_seq_len(self):
        return self._cache.max_seq_len

    def __len__(self):
        return len(self.layers)

    def __getitem__(self, i):
        return self.layers[i]

    def __iter__(self):
        return iter(self.layers)

    def __repr__(self):
        return (f"KvCacheMirror(backend={self.backend!r}, device={self.device!s}, "
                f"n_layers={len(self.layers)}, generation={self._gen})")


class _SlotMirror(Mirror):
    """Shared by the latent and static mirrors: per layer, one device array per slot whose
    axis ``_AXIS`` holds the positions, grown geometrically up to ``max_seq_len``."""

    _AXIS = 0

    def _setup(self, cache, backend, device):
        self._layers = [None] * len(cache.layers)
        self._len = 0
        self._cap = 0
        self._alloc = None

    def _sync(self, full, gen):
        c = self._cache
        ax = self._AXIS
        if len(c.layers) != len(self._layers):
            raise ValueError(f"cache: its list of layers was resized ({len(self._layers)} -> "
                             f"{len(c.layers)}) since this mirror was made; make a new Mirror")
        populated = [slots is not None for slots in c.layers]
        hosts = [c._storages("sync", li, slots) if slots is not None else None
                 for li, slots in enumerate(c.layers)]              # validates every storage
        if populated != [d is not None for d in self._layers]:
            full = True
        prefix = None if full else c.unchanged_prefix(self._gen)
        if prefix is None:
            full, keep = True, 0
        else:
            keep = min(self._len, prefix)
        n = c.cached_len
        cap = 0 if full else self._cap
        moved = nbytes = 0
        layers = list(self._layers) if not full else [None] * len(hosts)
        if full and self._cap >= n and all(
                (d is None) == (h is None) for d, h in zip(self._layers, hosts)):
            layers, cap = list(self._layers), self._cap          # reuse the device storage
        if n > cap or any(d is None and h is not None for d, h in zip(layers, hosts)):
            new_cap = _grow(n, cap, c.max_seq_len) if n > cap else cap
            for li, host in enumerate(hosts):
                if host is None:
                    layers[li] = None
                    continue
                fresh = []
                for s, buf in enumerate(host):
                    shape = buf.shape[:ax] + (new_cap,) + buf.shape[ax + 1:]
                    dev = self._be.empty(shape, buf.dtype)
                    if not full and keep:
                        src = layers[li][s][_rows(ax, 0, keep)]
                        self._be.copy(dev[_rows(ax, 0, keep)], src)
                        moved += buf[_rows(ax, 0, keep)].nbytes
                    fresh.append(dev)
                layers[li] = fresh
            cap = new_cap
        for li, host in enumerate(hosts):
            if host is None:
                continue
            for s, buf in enumerate(host):
                if n > keep:
                    part = buf[_rows(ax, keep, n)]
                    self._be.upload(layers[li][s][_rows(ax, keep, n)], part)
                    nbytes += part.nbytes
        rows = (n - keep) * sum(h is not None for h in hosts)
        self._layers, self._cap, self._len, self._alloc = layers, cap, n, c.alloc_id
        return SyncStats(full, rows, nbytes, moved)

    # ---------------------------------------------------------------- accessors
    @property
    def cached_len(self):
        """The cache's ``cached_len`` at the last sync."""
        return self._len

    def __len__(self):
        return self._len

    @property
    def max_seq_len(self):
        return self._cache.max_seq_len

    @property
    def dtype(self):
        return self._cache.dtype

    @property
    def n_layers(self):
        return len(self._layers)

    @property
    def n_slots(self):
        return self._cache.n_slots

    @property
    def alloc_id(self):
        """The cache's ``alloc_id`` at the last sync."""
        return self._alloc

    @property
    def capacity(self):
        """Positions the device storage holds before it must grow (at most max_seq_len)."""
        return self._cap

    def _device_rows(self, layer, s, name, what="slots"):
        li = _slot_index("layer", layer, len(self._layers), "layers")
        si = _slot_index(name, s, self.n_slots, what)
        slots = self._layers[li]
        if slots is None:
            raise ValueError(f"valid_view: layer {li} holds no storage (the cache was cleared)")
        return slots[si][_rows(self._AXIS, 0, self._len)]

    def __repr__(self):
        return (f"{type(self).__name__}(backend={self.backend!r}, device={self.device!s}, "
                f"cached_len={self._len}, capacity={self._cap}, generation={self._gen})")


class LatentMirror(_SlotMirror):
    """Mirror of a :class:`~kvcache.LatentKvCache`: slot ``s`` of a populated layer is a device
    array ``(capacity, *slot_trailing[s])``; unpopulated (cleared) layers are None."""

    MIRRORED = ("cached_len", "__len__", "max_seq_len", "dtype", "n_layers", "n_slots",
                "alloc_id", "generation", "slot_trailing", "slot_shape", "valid_view")
    _AXIS = 0
    _CACHE = LatentKvCache

    @property
    def slot_trailing(self):
        return self._cache.slot_trailing

    def slot_shape(self, s):
        return self._cache.slot_shape(s)

    def valid_view(self, layer, s):
        """Device rows ``[0, cached_len)`` of slot ``s`` of ``layer``, shape
        ``(cached_len, *slot_trailing[s])``."""
        return self._device_rows(layer, s, "slot")


class StaticMirror(_SlotMirror):
    """Mirror of a :class:`~kvcache.StaticKvCache`: K and V of a populated layer are device
    arrays ``(1, num_kv_heads, capacity, head_dim)``."""

    MIRRORED = ("cached_len", "__len__", "max_seq_len", "dtype", "n_layers", "n_slots",
                "alloc_id", "generation", "num_kv_heads", "head_dim", "valid_view")
    _AXIS = 2
    _CACHE = StaticKvCache

    @property
    def num_kv_heads(self):
        return self._cache.num_kv_heads

    @property
    def head_dim(self):
        return self._cache.head_dim

    def valid_view(self, layer, which):
        """Device ``(1, num_kv_heads, cached_len, head_dim)`` K (``which=0``) or V (1)."""
        return self._device_rows(layer, which, "which", "slots (0 = K, 1 = V)")
