"""Does BLAS give a row of ``x @ w`` the same bits whatever block of rows it is computed in?

The measurement behind docs/threads.md, "What decides a row's bits in OpenBLAS": for a few
product shapes, every row of ``x[lo:hi] @ w`` (one BLAS thread, float32) is compared bit for
bit with the same row computed in 64-row chunks at absolute multiples of 64, the runner's
prompt chunks.  Run it as is, and with ``OPENBLAS_CORETYPE=Haswell`` (or another kernel) in
the environment of that one command to see another kernel of the same library.

    python tools/blas_row_bits.py
"""

from __future__ import annotations

import numpy as np
from threadpoolctl import threadpool_info, threadpool_limits

SHAPES = [(576, 960), (576, 576), (576, 1728), (576, 3072), (1536, 576), (2048, 8192), (64, 128)]
BLOCKS = [(0, 1), (0, 2), (0, 3), (1, 66), (0, 128), (0, 200), (64, 1024), (512, 514)]


def main() -> None:
    rng = np.random.default_rng(0)
    libs = [(i.get("internal_api"), i.get("version"), i.get("architecture"))
            for i in threadpool_info() if i.get("user_api") == "blas"]
    print("BLAS:", libs)
    with threadpool_limits(1, user_api="blas"):
        for k, n in SHAPES:
            w = (rng.standard_normal((k, n), dtype=np.float32) * np.float32(0.02))
            x = rng.standard_normal((1024, k), dtype=np.float32)
            chunks = np.concatenate([x[i: i + 64] @ w for i in range(0, 1024, 64)])
            differ = [(lo, hi) for lo, hi in BLOCKS
                      if not np.array_equal((x[lo:hi] @ w).view(np.uint32),
                                            chunks[lo:hi].view(np.uint32))]
            print(f"({k}, {n}): blocks whose rows differ from 64-row chunks: {differ or 'none'}")


if __name__ == "__main__":
    main()
