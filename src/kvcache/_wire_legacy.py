"""The legacy wire layout of one layer (re-exported by :mod:`kvcache.wire`).

Legacy layout (``LayerKvCache.export_wire`` / ``import_wire``)
--------------------------------------------------------------
No magic, no version, no checksum (byte-compatible with the upstream engine)::

    u32 f16_flag            1 when K/V rows are binary16, else 0 (import: non-zero = f16)
    u32 seq_len
    u32 num_kv_heads
    u32 head_dim
    u32 n_lin               floats of linear_state
    u32 n_imp               floats of importance
    f32 x n_lin             linear_state (always f32)
    f32 x n_imp             importance (always f32)
    per KV head h = 0 .. num_kv_heads-1:
        u32 n_k             floats of head h's keys (rows * head_dim; 0 for a dead head)
        n_k x f32|f16       keys, row-major
        u32 n_v
        n_v x f32|f16       values

Export refuses (in this order) a cache stored as int8 (any q8 mode, in either int8 scheme:
the layout has no place for int8 rows, so a "rows" cache cannot be converted to it either), one
with O(1) state (collecting or sealed), and one with frozen columns: the layout cannot describe
them.  f16 is
NumPy's IEEE conversion (round to nearest even, also for subnormals, where the upstream writer
rounds half up).  Import checks the geometry first (the message names both shapes, e.g.
"peer sent 2×4 per position, this layer is 2×8"), then the lengths (each head's rows a whole
number of head_dim, K and V rows equal, at most seq_len rows, importance for at most seq_len
positions -- upstream's linear-core layers send none), refuses trailing bytes, and installs atomically: the layer becomes F32 with the
parsed rows, importance and linear state; columns and O(1) state are reset; linear_scratch is
kept.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from ._state import LayerState
from ._wire_io import F16_LE, F32_LE, BufferLike, Plan, Reader, WireError, as_u8, fresh, to_f32
from .modes import KvMode

if TYPE_CHECKING:
    from .layer import LayerKvCache

__all__ = ["export_wire", "import_wire"]


def export_wire(layer: LayerKvCache, f16: bool = False) -> bytes:
    """The legacy layout of ``layer`` (see the module docstring); WireError for what it
    cannot describe."""
    st = layer.state()
    if not st.mode.is_f32:
        what = ", ".join(([f"int8 scheme {st.mode.scheme!r}"] if st.mode.scheme else [])
                         + (["4-bit keys"] if st.mode.k4 else [])
                         + (["4-bit values"] if st.mode.v4 else []))
        raise WireError(f"export_wire: the legacy layout describes F32 caches only; this layer is "
                        f"{st.mode!r}, {what} (use to_bytes, which carries int8 storage in either "
                        f"scheme and 4-bit storage)")
    if st.o1 is not None:
        raise WireError("export_wire: a Nyström overlay (O(1) state) is not part of this format "
                        "(use to_bytes)")
    if st.any_col_frozen():
        raise WireError("export_wire: frozen columns under an F32 cache are not part of this format")
    f16 = bool(f16)
    nkv, hd = st.num_kv_heads, st.head_dim
    rows = F16_LE if f16 else F32_LE
    biggest = max([st.seq_len, st.linear_state.size, st.importance.size]
                  + [int(n) * hd for n in st.lengths])
    if biggest >= 1 << 32:
        raise WireError(f"export_wire: a count of {biggest} does not fit the layout's u32 fields "
                        "(use to_bytes)")
    stores = st.stores()
    plan = Plan()
    plan.pack("6I", int(f16), st.seq_len, nkv, hd, st.linear_state.size, st.importance.size)
    plan.array(st.linear_state, F32_LE, pad=False)
    plan.array(st.importance, F32_LE, pad=False)
    for h in range(nkv):
        n = int(st.lengths[h])
        for store in (stores["kf"], stores["vf"]):
            plan.pack("I", n * hd)
            plan.array(store[h, :n], rows, pad=False)
    out_bytes, out = fresh(plan.size)
    plan.write_into(out)
    del out
    return out_bytes


def import_wire(layer: LayerKvCache, buf: BufferLike) -> LayerState:
    """Parse and validate a legacy buffer; return an owned state for
    ``LayerKvCache.install`` (F32, no columns, no O(1) state, the layer's
    linear_scratch kept)."""
    u8 = as_u8(buf)
    rd = Reader(u8, what="kv import")
    try:
        f16, seq_len, heads, hd, n_lin, n_imp = rd.unpack("6I", "header")
    except WireError:
        raise WireError(f"kv import: truncated header ({len(u8)} bytes, the header has 24)") from None
    nkv, want_hd = layer.num_kv_heads, layer.head_dim
    if (heads, hd) != (nkv, want_hd):
        raise WireError(f"kv import: peer sent {heads}×{hd} per position, this layer is "
                        f"{nkv}×{want_hd}")
    rows_dtype = F16_LE if f16 else F32_LE

    def arr(dtype: np.dtype[Any], count: int, field: str) -> npt.NDArray[Any]:
        try:
            return rd.array(dtype, count, field, pad=False)
        except WireError as exc:
            raise WireError(f"kv import: truncated payload ({exc})") from None

    lin = to_f32(arr(F32_LE, n_lin, "linear_state"), (n_lin,))
    imp = to_f32(arr(F32_LE, n_imp, "importance"), (n_imp,))
    heads_k: list[npt.NDArray[Any]] = []
    heads_v: list[npt.NDArray[Any]] = []
    for h in range(nkv):
        for out, what in ((heads_k, "keys"), (heads_v, "values")):
            try:
                (n,) = rd.unpack("I", f"head {h} {what} length")
            except WireError:
                raise WireError(f"kv import: truncated header (head {h} {what} length)") from None
            if n % hd:
                raise WireError(f"kv import: head {h} {what}: {n} floats is not a whole number of "
                                f"rows of head_dim={hd}")
            out.append(arr(rows_dtype, n, f"head {h} {what}"))
    if rd.pos != len(u8):
        raise WireError(f"kv import: {len(u8) - rd.pos} trailing bytes after the last head")
    lens = np.array([a.size // hd for a in heads_k], dtype=np.intp)
    for h in range(nkv):
        if heads_v[h].size != heads_k[h].size:
            raise WireError(f"kv import: head {h} sends {heads_k[h].size // hd} key rows but "
                            f"{heads_v[h].size // hd} value rows")
    if (lens > seq_len).any():
        raise WireError(f"kv import: a head sends {int(lens.max())} rows, more than seq_len={seq_len}")
    if n_imp > seq_len:
        raise WireError(f"kv import: importance covers {n_imp} positions, more than seq_len={seq_len}")
    cap = int(lens.max(initial=0))
    kf = np.zeros((nkv, cap, hd), np.float32)
    vf = np.zeros((nkv, cap, hd), np.float32)
    for h in range(nkv):
        n = int(lens[h])
        kf[h, :n] = heads_k[h].reshape(n, hd)
        vf[h, :n] = heads_v[h].reshape(n, hd)
    return LayerState(mode=KvMode.F32, num_kv_heads=nkv, head_dim=hd, seq_len=int(seq_len),
                      lengths=lens, kf=kf, kq=None, ks=None, vf=vf, vq=None, vs=None,
                      kcol=np.ones((nkv, hd), np.float32), vcol=np.ones((nkv, hd), np.float32),
                      kcol_on=np.zeros(nkv, np.uint8), vcol_on=np.zeros(nkv, np.uint8),
                      importance=imp, linear_state=lin, linear_scratch=None, o1=None, owned=True)
