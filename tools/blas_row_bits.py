"""Does BLAS give a row of ``x @ w`` the same bits whatever block of rows it is computed in?

The measurement behind docs/threads.md, "What decides a row's bits in OpenBLAS": for a few
product shapes, every row of ``x[lo:hi] @ w`` (float32, on 1, 2 and 8 BLAS threads) is compared
bit for bit with the same row computed in 64-row chunks at absolute multiples of 64 on as many
threads.  It then asks whether whole row tiles decide the bits: for each tile size t in TILES,
the blocks [3t, 4t), [t, 3t), [2t, 6t) and [0, 1024 // t * t) (whole tiles starting at multiples
of t) against the same rows in t-row chunks at multiples of t, and the block [5, 5 + 4t) (whole
tiles shifted off that grid).  Run it as is, and with ``OPENBLAS_CORETYPE=Haswell`` (or another
kernel) in the environment of that one command to see another kernel of the same library.

    python tools/blas_row_bits.py [--json OUT]

``--json OUT`` writes what it prints (docs/data/blas-row-bits.json is such a run; the page's
figures are written from it by tools/figures.py).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np
from threadpoolctl import threadpool_info, threadpool_limits

SHAPES = [(576, 960), (576, 576), (576, 1728), (576, 3072), (1536, 576), (2048, 8192), (64, 128)]
BLOCKS = [(0, 1), (0, 2), (0, 3), (1, 66), (0, 128), (0, 200), (64, 1024), (512, 514)]
TILES = (8, 16, 24, 32, 48, 64)


def tile_blocks(t: int) -> list[tuple[int, int]]:
    """Blocks of whole t-row tiles at multiples of t among 1,024 rows: one tile (not the first,
    which is a reference chunk itself), two, four and the largest."""
    return [(3 * t, 4 * t), (t, 3 * t), (2 * t, 6 * t), (0, 1024 // t * t)]


def same_bits(x: Any, w: Any, ref: Any, lo: int, hi: int) -> bool:
    """Whether the rows [lo, hi) of ``x @ w``, computed as one block, have the bits of the
    same rows of ``ref``."""
    return np.array_equal((x[lo:hi] @ w).view(np.uint32), ref[lo:hi].view(np.uint32))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", metavar="OUT", help="also write the results as JSON to OUT")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    libs = [(i.get("internal_api"), i.get("version"), i.get("architecture"))
            for i in threadpool_info() if i.get("user_api") == "blas"]
    print("BLAS:", libs)
    doc: dict[str, Any] = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "blas": libs,
                           "blocks": BLOCKS, "differ": [], "speed": [], "tiles": [],
                           "tile_sizes": list(TILES)}
    for threads in (1, 2, 8):
        with threadpool_limits(threads, user_api="blas"):
            for k, n in SHAPES:
                w = (rng.standard_normal((k, n), dtype=np.float32) * np.float32(0.02))
                x = rng.standard_normal((1024, k), dtype=np.float32)
                chunks = np.concatenate([x[i: i + 64] @ w for i in range(0, 1024, 64)])
                differ = [(lo, hi) for lo, hi in BLOCKS if not same_bits(x, w, chunks, lo, hi)]
                print(f"{threads} thread(s), ({k}, {n}): blocks whose rows differ from 64-row "
                      f"chunks: {differ or 'none'}")
                doc["differ"].append({"threads": threads, "shape": [k, n], "blocks": differ})
                aligned, shifted = [], []
                for t in TILES:
                    ref = np.concatenate([x[i: i + t] @ w for i in range(0, 1024 // t * t, t)])
                    if all(same_bits(x, w, ref, lo, hi) for lo, hi in tile_blocks(t)):
                        aligned.append(t)
                    if same_bits(x, w, ref, 5, 5 + 4 * t):
                        shifted.append(t)
                print(f"{threads} thread(s), ({k}, {n}): tile sizes t whose blocks of whole "
                      f"tiles at multiples of t match t-row chunks: {aligned or 'none'}; "
                      f"whose block [5, 5 + 4t) does: {shifted or 'none'}")
                doc["tiles"].append({"threads": threads, "shape": [k, n], "aligned": aligned,
                                     "shifted": shifted})
    # the speed of larger blocks, one thread: 64-row chunks, the runner's 256 and 1024 rows
    k, n = 576, 1728
    w = rng.standard_normal((k, n), dtype=np.float32)
    x = rng.standard_normal((2048, k), dtype=np.float32)
    blocks = (64, 256, 1024)
    times: dict[int, list[float]] = {b: [] for b in blocks}
    with threadpool_limits(1, user_api="blas"):
        for _ in range(7):                     # the block sizes take turns
            for block in blocks:
                start = time.perf_counter()
                for i in range(0, 2048, block):
                    x[i: i + block] @ w
                times[block].append(time.perf_counter() - start)
    for block in blocks:
        gflops = 2 * 2048 * k * n / sorted(times[block])[3] / 1e9
        print(f"1 thread, ({k}, {n}), blocks of {block} rows: {gflops:.0f} GFLOP/s (median)")
        doc["speed"].append({"threads": 1, "shape": [k, n], "block": block,
                             "gflops": gflops, "samples_s": times[block]})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
