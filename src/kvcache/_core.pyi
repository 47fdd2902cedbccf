"""Signatures and shapes of the compiled kernels (kvcache/_core.pyx).

Every kernel is called by keyword from Python (``kvcache._attention``, ``kvcache.o1``,
``kvcache.mla``), so the parameter names below are part of the contract with the NumPy twins.

Naming: ``h`` KV head, ``c`` storage capacity (rows), ``d`` head_dim, ``g`` scale groups per row,
``n`` rows, ``j`` queries, ``l`` probability columns.  Every kernel has a NumPy twin of the same
name in kvcache/reference.py.
"""

import numpy as np
import numpy.typing as npt

class _BytesWriter:
    """A writable buffer over the memory of a new bytes object (see fresh_bytes)."""
    def __buffer__(self, flags: int, /) -> memoryview: ...

F32 = npt.NDArray[np.float32]
I8 = npt.NDArray[np.int8]
U8 = npt.NDArray[np.uint8]
IP = npt.NDArray[np.intp]

CHUNK_ROWS: int

def simd_built() -> bool: ...
def openmp_built() -> bool: ...
def max_threads() -> int: ...
def thread_ids(n_threads: int) -> npt.NDArray[np.int64]: ...
def store_rows_f32(x__nhd: F32, alive__h: U8, head_len__h: IP, store__hcd: F32) -> None: ...
def store_rows_q8(x__nhd: F32, alive__h: U8, head_len__h: IP, col__hd: F32, col_on__h: U8,
                  group: int, q__hcd: I8, s__hcg: F32) -> None: ...
def quantize_rows(x__nd: F32, col__d: F32, group: int, q__nd: I8, s__ng: F32,
                  n_threads: int) -> None: ...
def stream_read(buf: F32, n_threads: int) -> float: ...
def fresh_bytes(n: int) -> tuple[bytes, _BytesWriter]: ...
def attend_rows(kf__hcd: F32, kq__hcd: I8, ks__hcg: F32, vf__hcd: F32, vq__hcd: I8,
                vs__hc1: F32, vcol__hd: F32, head_len__h: IP, q__jd: F32, group_q0: IP,
                n_pos: int, n_back: int, window: int, first: int, scale: float, softcap: float,
                out__jd: F32, probs__jl: F32, imp__l: F32, imp_mode: int, quant_k: bool,
                quant_v: bool, n_threads: int) -> None: ...
PREFILL_TILE_ROWS: int
PREFILL_TASK_QUERIES: int
def attend_blocked(kf__hcd: F32, kq__hcd: I8, ks__hcg: F32, vf__hcd: F32, vq__hcd: I8,
                   vs__hc1: F32, vcol__hd: F32, head_len__h: IP, q__jd: F32, group_q0: IP,
                   n_pos: int, n_back: int, window: int, first: int, scale: float,
                   softcap: float, out__jd: F32, imp__l: F32, imp_mode: int, quant_k: bool,
                   quant_v: bool, n_threads: int) -> None: ...
# O(1) Nystrom decode: ``g`` KV group, ``h`` query head, ``m`` landmarks, ``d``/``e`` key/value
# dims, ``s`` sink rows, ``c`` window capacity, ``x`` scratch floats per head.
def o1_absorb(q_tilde__hmd: F32, keys__gnd: F32, values__gne: F32, row0: int, n: int,
              scale: float, t_hat__hme: F32, z_hat__hm: F32, m_max__hm: F32, scr__hm: F32,
              n_threads: int) -> None: ...
def o1_step(q__hd: F32, k_new__gd: F32, v_new__ge: F32, sink_k__gsd: F32, sink_v__gse: F32,
            win_k__gcd: F32, win_v__gce: F32, win_len: int, slot: int, absorb: bool,
            k_tilde__gmd: F32, q_tilde__hmd: F32, mu__hmm: F32, t_hat__hme: F32, z_hat__hm: F32,
            m_max__hm: F32, use_far: bool, fm: bool, scale: float, out__he: F32, scr__hx: F32,
            n_threads: int) -> None: ...
# Absorbed MLA decode: ``n`` query positions, ``h`` heads, ``k`` d_nope, ``e`` d_rope, ``t`` cached
# rows, ``r`` latent rank, ``j`` d_v.  Position i attends rows [0, t - n + i + 1).
def mla_attend(qn__nhk: F32, qr__nhe: F32, lat__tr: F32, kr__te: F32, wuk__hkr: F32,
               wuv__hjr: F32, scale: float, out__nhj: F32, n_threads: int) -> None: ...
def mla_task_rows(T: int) -> int: ...
def fma_probe(iters: int, n_threads: int) -> float: ...
