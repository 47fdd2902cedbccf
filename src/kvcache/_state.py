"""LayerState: everything one LayerKvCache holds, as one object (see docs/architecture.md).

A layer's state is owned by :class:`kvcache.LayerKvCache`.  Other modules -- the byte formats
(:mod:`kvcache.wire`) and the device mirrors (:mod:`kvcache.device`) -- read it with
``layer.state()`` and replace it with ``layer.install(state)``, never through
the layer's fields.  The row stores' fields are the storage kinds' arrays
(:mod:`kvcache._stores`: the component's letter, then the array's name), checked against the
kinds' layouts; a new kind of storage is a class there (and fields here only for arrays of
new names).

Storage (as the layer keeps it: head-major, ``cap`` rows per head of which the first
``lengths[h]`` hold data):

* K: float32 rows ``kf`` (G, cap, D), or int8 rows ``kq`` (G, cap, D) with float32 scales
  ``ks`` (G, cap, ceil(D / group)), the group of the mode's scheme
  (:func:`kvcache.quant.k_group`: 16 "rows", 32 "cmf"); the other pair is None;
* V: float32 rows ``vf`` (G, cap, D), or int8 rows ``vq`` (G, cap, D) with scales
  ``vs`` (G, cap, 1), or 4-bit rows ``vc`` (G, cap, D / 2) uint8 with their float16 steps
  and minimums ``vp`` (G, cap, 2 * ceil(D / 16)) as uint16 bits (docs/kv4.md);
* 4-bit K (docs/kv4.md): codes ``kc`` (G, cap, D / 2) uint8 of the closed blocks, their
  parameters ``kp`` (G, ceil(cap / 32), 2 * D) uint16 (float16 bits), the float32 ring ``kr``
  (G, 64, D) of each head's last 64 rows (row i at slot i % 64);
* the column fields ``kcol``/``vcol`` (G, D), rows of ones where ``kcol_on``/``vcol_on``
  (G,) uint8 is 0 (always 0 unless the mode's int8 scheme is "cmf");
* ``importance`` (n,) float32 for the first n <= seq_len positions;
* ``linear_state`` and ``linear_scratch``, 1-D float32 (``linear_scratch`` None: keep the
  layer's own, for the legacy layout that carries none);
* ``o1``: None, an :class:`~kvcache.o1.O1Collecting` or an :class:`~kvcache.o1.O1Sealed`.

An exported state holds read-only views of the layer's arrays and the layer's own O(1) object
(no copies): read it before the layer changes again.  A state built by a reader of bytes holds
fresh arrays and says so with ``owned=True``; the layer then adopts them as they are.  Any
other state is copied on install.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Union

import numpy as np
import numpy.typing as npt

from ._stores import Part, specs_of
from .modes import KvMode
from .o1 import O1Collecting, O1Sealed

__all__ = ["LayerState", "O1State", "scheme_conflict"]

O1State = Union[O1Collecting, O1Sealed, None]
#: every state field that holds a row store (what no kind of the mode holds must be None)
_STORE_FIELDS = ("kf", "kq", "ks", "kc", "kp", "kr", "vf", "vq", "vs", "vc", "vp")

F32 = np.dtype(np.float32)
U8 = np.dtype(np.uint8)
INTP = np.dtype(np.intp)


@dataclass(frozen=True)
class LayerState:
    """One layer's whole state (see the module docstring for each field)."""

    mode: KvMode
    num_kv_heads: int
    head_dim: int
    seq_len: int
    lengths: npt.NDArray[np.intp]
    kcol: npt.NDArray[np.float32]
    vcol: npt.NDArray[np.float32]
    kcol_on: npt.NDArray[np.uint8]
    vcol_on: npt.NDArray[np.uint8]
    importance: npt.NDArray[np.float32]
    linear_state: npt.NDArray[np.float32]
    linear_scratch: Optional[npt.NDArray[np.float32]]
    o1: O1State
    owned: bool = False
    # the row stores, by the component's letter and the store's array (kvcache._stores): the
    # ones the mode's kinds hold, the others None
    kf: Optional[npt.NDArray[np.float32]] = None
    kq: Optional[npt.NDArray[np.int8]] = None
    ks: Optional[npt.NDArray[np.float32]] = None
    vf: Optional[npt.NDArray[np.float32]] = None
    vq: Optional[npt.NDArray[np.int8]] = None
    vs: Optional[npt.NDArray[np.float32]] = None
    vc: Optional[npt.NDArray[np.uint8]] = None
    vp: Optional[npt.NDArray[np.uint16]] = None
    kc: Optional[npt.NDArray[np.uint8]] = None
    kp: Optional[npt.NDArray[np.uint16]] = None
    kr: Optional[npt.NDArray[np.float32]] = None

    # ---------------------------------------------------------------- derived
    def layout(self) -> dict[str, Part]:
        """The arrays this mode's storage kinds hold (K's, then V's), by state field, each
        described by its :class:`kvcache._stores.Part` (ValueError for a head_dim a kind
        cannot store)."""
        return {c + p.name: p for c, spec in specs_of(self.mode, self.head_dim)
                for p in spec.parts}

    def stores(self) -> dict[str, npt.NDArray[Any]]:
        """The row stores this mode uses, by state field (``kf``; ``kq``, ``ks``; ``kc``,
        ``kp``, ``kr``; ``vf``; ``vq``, ``vs``; ``vc``, ``vp``), in :meth:`layout`'s order."""
        out: dict[str, npt.NDArray[Any]] = {}
        for name in self.layout():
            arr = getattr(self, name)
            if arr is None:
                raise ValueError(f"state: {self.mode!r} stores {name}, which is None")
            out[name] = arr
        return out

    @property
    def capacity(self) -> int:
        """Rows per head the stores hold (0 when they are empty)."""
        stores = self.stores()
        return int(next(iter(stores.values())).shape[1]) if stores else 0

    def any_col_frozen(self) -> bool:
        """Whether a column field is frozen on some head."""
        return bool(self.kcol_on.any() or self.vcol_on.any())

    # ---------------------------------------------------------------- checks
    def check(self, num_kv_heads: int, head_dim: int) -> None:
        """Raise ValueError (TypeError for a wrong type) when this state cannot be a layer of
        ``num_kv_heads`` x ``head_dim``: geometry, dtypes, shapes, lengths and the rules the
        layer keeps (frozen columns only on int8 components, ones where not frozen, a sealed
        O(1) layer holds no rows).  Costs O(num_kv_heads * head_dim), not O(rows)."""
        nkv, hd = num_kv_heads, head_dim
        if not isinstance(self.mode, KvMode):
            raise TypeError(f"state.mode: expected a KvMode, got {type(self.mode).__name__}")
        if (self.num_kv_heads, self.head_dim) != (nkv, hd):
            raise ValueError(f"state: geometry {self.num_kv_heads}x{self.head_dim}, this layer is "
                             f"{nkv}x{hd}")
        if not isinstance(self.seq_len, (int, np.integer)) or self.seq_len < 0:
            raise ValueError(f"state.seq_len: expected an int >= 0, got {self.seq_len!r}")
        seq_len = int(self.seq_len)
        _check("lengths", self.lengths, INTP, (nkv,), self.owned)
        if (self.lengths < 0).any() or int(self.lengths.max(initial=0)) > seq_len:
            raise ValueError(f"state.lengths: expected 0 <= lengths <= seq_len={seq_len}, got "
                             f"{self.lengths.tolist()}")
        layout = self.layout()
        stores = self.stores()
        for name in _STORE_FIELDS:
            if name not in stores and getattr(self, name) is not None:
                raise ValueError(f"state.{name}: {self.mode!r} does not store it; expected None")
        cap = self.capacity
        for name, arr in stores.items():
            part = layout[name]
            _check(name, arr, part.dtype, (nkv, part.rows(cap), part.width), self.owned)
        if int(self.lengths.max(initial=0)) > cap:
            raise ValueError(f"state.lengths: a head holds {int(self.lengths.max())} rows, the "
                             f"stores hold {cap}")
        (_, kspec), (_, vspec) = specs_of(self.mode, hd)
        for name, on, freezable in (("kcol", self.kcol_on, kspec.kind.can_freeze),
                                    ("vcol", self.vcol_on, vspec.kind.can_freeze)):
            _check(f"{name}_on", on, U8, (nkv,), self.owned)
            col = getattr(self, name)
            _check(name, col, F32, (nkv, hd), self.owned)
            if (on > 1).any():
                raise ValueError(f"state.{name}_on: expected 0 or 1 per head")
            if on.any() and not freezable:
                raise ValueError(f"state.{name}_on: frozen columns on a component not stored "
                                 f"as int8")
            if on.any() and not self.mode.freezes_columns:
                raise ValueError(f"state.{name}_on: frozen columns in int8 scheme "
                                 f"{self.mode.scheme!r}, which never freezes one")
            if not (col[on == 0] == 1.0).all():
                raise ValueError(f"state.{name}: a column field that is not frozen must be all "
                                 f"ones")
        _check("importance", self.importance, F32, (None,), self.owned)
        if self.importance.shape[0] > seq_len:
            raise ValueError(f"state.importance: covers {self.importance.shape[0]} positions, "
                             f"more than seq_len={seq_len}")
        _check("linear_state", self.linear_state, F32, (None,), self.owned)
        if self.linear_scratch is not None:
            _check("linear_scratch", self.linear_scratch, F32, (None,), self.owned)
        o1 = self.o1
        if isinstance(o1, O1Sealed):
            if not self.mode.is_f32 or self.lengths.any() or self.importance.size:
                raise ValueError("state.o1: a sealed O(1) layer holds no KV rows and no "
                                 "importance, in F32 mode")
            if (o1.num_kv_heads, o1.d) != (nkv, hd):
                raise ValueError(f"state.o1: sealed for {o1.num_kv_heads}x{o1.d}, this layer is "
                                 f"{nkv}x{hd}")
        elif isinstance(o1, O1Collecting):
            if o1.head_dim != hd:
                raise ValueError(f"state.o1: collecting for head_dim={o1.head_dim}, this layer "
                                 f"has {hd}")
        elif o1 is not None:
            raise TypeError(f"state.o1: expected None, an O1Collecting or an O1Sealed, got "
                            f"{type(o1).__name__}")

    # ---------------------------------------------------------------- copies
    def owned_copy(self) -> LayerState:
        """A state holding fresh, writable, C-contiguous copies of every array and of the O(1)
        object (``owned=True``)."""
        arrays: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, np.ndarray):
                arrays[f.name] = np.array(value, order="C", copy=True)
        return dataclasses.replace(self, o1=copy.deepcopy(self.o1), owned=True, **arrays)


def scheme_conflict(have: KvMode, got: KvMode) -> Optional[str]:
    """Why a layer in mode ``have`` cannot take a state in mode ``got`` (both store int8 rows,
    in different schemes), or None when it can."""
    if not have.scheme or not got.scheme or have.scheme == got.scheme:
        return None
    return (f"int8 scheme {got.scheme!r} ({got!r}), this layer stores int8 rows in scheme "
            f"{have.scheme!r} ({have!r}); a layer keeps its scheme (use a layer made in "
            f"{got.name!r}, or KvCache.load)")


def _check(name: str, arr: object, dtype: np.dtype[Any], shape: tuple[Optional[int], ...],
           owned: bool) -> None:
    if not isinstance(arr, np.ndarray):
        raise TypeError(f"state.{name}: expected a numpy array, got {type(arr).__name__}")
    if arr.dtype != dtype:
        raise TypeError(f"state.{name}: expected dtype {dtype}, got {arr.dtype}")
    if len(arr.shape) != len(shape) or any(w is not None and g != w
                                           for g, w in zip(arr.shape, shape)):
        want = "(" + ", ".join("n" if w is None else str(w) for w in shape) + \
            ("," if len(shape) == 1 else "") + ")"
        raise ValueError(f"state.{name}: expected shape {want}, got {arr.shape}")
    if owned and not (arr.flags.c_contiguous and arr.flags.writeable):
        raise ValueError(f"state.{name}: an owned state's arrays must be C-contiguous and "
                         f"writable")
