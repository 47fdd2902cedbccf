"""Signatures and shapes of the compiled kernels (kvcache/_core.pyx).

Naming: ``h`` KV head, ``c`` storage capacity (rows), ``d`` head_dim, ``g`` scale groups per row,
``n`` rows, ``j`` queries, ``l`` probability columns.  Every kernel has a NumPy twin of the same
name in kvcache/reference.py.
"""

import numpy as np
import numpy.typing as npt

F32 = npt.NDArray[np.float32]
I8 = npt.NDArray[np.int8]
U8 = npt.NDArray[np.uint8]
IP = npt.NDArray[np.intp]

CHUNK_ROWS: int

def simd_built() -> bool: ...
def openmp_built() -> bool: ...
def max_threads() -> int: ...
def store_rows_f32(x__nhd: F32, alive__h: U8, head_len__h: IP, store__hcd: F32) -> None: ...
def store_rows_q8(x__nhd: F32, alive__h: U8, head_len__h: IP, col__hd: F32, col_on__h: U8,
                  group: int, q__hcd: I8, s__hcg: F32) -> None: ...
def quantize_rows(x__nd: F32, col__d: F32, group: int, q__nd: I8, s__ng: F32,
                  n_threads: int) -> None: ...
def stream_read(buf: F32, n_threads: int) -> float: ...
def attend_rows(kf__hcd: F32, kq__hcd: I8, ks__hcg: F32, vf__hcd: F32, vq__hcd: I8,
                vs__hc1: F32, vcol__hd: F32, head_len__h: IP, q__jd: F32, group_q0: IP,
                n_pos: int, n_back: int, window: int, first: int, scale: float, softcap: float,
                out__jd: F32, probs__jl: F32, imp__l: F32, imp_mode: int, quant_k: bool,
                quant_v: bool, n_threads: int) -> None: ...
