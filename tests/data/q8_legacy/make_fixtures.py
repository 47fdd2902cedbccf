"""Write the old-buffer fixtures of tests/data/q8_legacy (see tests/data/README.md).

Run once, at the commit named in the README, with that commit's kvcache on the path:

    PYTHONPATH=src python tests/data/q8_legacy/make_fixtures.py

It writes buffers in every byte format that commit writes for int8 storage (the versioned
format, kind 1 and kind 2, and prefix-store entries), plus float32 and legacy-wire buffers, and
``expected.npz``: each fixture's layer state as that commit held it after writing.  The digest
is forced to CRC-32 so the fixtures read without the optional ``xxhash`` package.
Running it with a later kvcache overwrites the fixtures with what that version writes: don't.
"""

from __future__ import annotations

import os

import numpy as np

import kvcache as kc
from kvcache import wire
from kvcache.store import PrefixStore
from kvcache.store.memory import MemoryBackend

HERE = os.path.dirname(os.path.abspath(__file__))
NKV, HD = 2, 40                      # head_dim 40: two K scale groups, the second partial
STATE_FIELDS = ("lengths", "kf", "kq", "ks", "vf", "vq", "vs", "kcol", "vcol", "kcol_on",
                "vcol_on", "importance", "linear_state", "linear_scratch")


def rows(seed: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    scale = np.linspace(0.2, 3.0, HD, dtype=np.float32)          # uneven channels
    k = (rng.standard_normal((n, NKV, HD)) * scale).astype(np.float32)
    v = rng.standard_normal((n, NKV, HD)).astype(np.float32)
    return k, v


def fill(layer: kc.LayerKvCache, seed: int, n: int, dead: bool = True) -> None:
    """Append n >= 7 positions: 0..2 as one block, 3..5 with head 1 dead (when ``dead``),
    6 alone, the rest as one block; then one attention call puts mass into the importance."""
    k, v = rows(seed, n)
    layer.append(k[0:3], v[0:3])
    layer.append(k[3:6], v[3:6], alive=[True, not dead])
    layer.append(k[6], v[6])
    if n > 7:
        layer.append(k[7:], v[7:])
    q = np.random.default_rng(seed + 100).standard_normal((2 * NKV, HD)).astype(np.float32)
    layer.attend_all_heads(q)


def record(out: dict[str, np.ndarray], name: str, layer: kc.LayerKvCache) -> None:
    st = layer.state()
    out[f"{name}/seq_len"] = np.array(st.seq_len, np.int64)
    out[f"{name}/mode"] = np.array([st.mode.quant_k, st.mode.quant_v], np.uint8)
    for f in STATE_FIELDS:
        a = getattr(st, f)
        if a is None:
            continue
        if f in ("kf", "kq", "ks", "vf", "vq", "vs"):
            a = np.concatenate([a[h, : int(st.lengths[h])] for h in range(NKV)])  # stored rows only
        out[f"{name}/{f}"] = np.array(a)


def main() -> None:
    wire.default_algorithm = lambda: wire.ALG_CRC32    # readable without xxhash
    expected: dict[str, np.ndarray] = {}
    layers: dict[str, tuple[kc.LayerKvCache, bool]] = {}
    cases = [("q8_40", "q8", 40), ("q8_80", "q8", 80), ("q8k_80", "q8k", 80),
             ("q8v_80", "q8v", 80), ("q8_64", "q8", 64), ("q8_65", "q8", 65),
             ("f32_30", "f32", 30)]
    for seed, (name, mode, n) in enumerate(cases):
        layer = kc.LayerKvCache(NKV, HD, mode=mode)
        fill(layer, seed, n)
        layers[name] = (layer, False)
    ev = kc.LayerKvCache(NKV, HD, mode="q8")             # evicted after the freeze
    fill(ev, 20, 100)
    ev.evict(70)
    layers["q8_evicted"] = (ev, False)
    born = kc.LayerKvCache(NKV, HD, mode="q8")           # Born eviction keeps a sink
    fill(born, 21, 90)
    born.evict(50, kc.EvictionPolicy.born(4))
    layers["q8_born"] = (born, False)
    f16 = kc.LayerKvCache(NKV, HD, mode="q8k")
    fill(f16, 22, 70)
    layers["q8k_f16"] = (f16, True)
    for name, (layer, half) in layers.items():
        with open(os.path.join(HERE, f"layer_{name}.kvc"), "wb") as fh:
            fh.write(layer.to_bytes(f16=half, fingerprint=f"fixture {name}"))
        record(expected, name, layer)
    # kind 2: a whole model, q8, two layers past the freeze and one before
    model = kc.KvCache(3, NKV, HD, max_seq_len=4096, mode="q8")
    for i, layer in enumerate(model.layers):
        fill(layer, 30 + i, (70, 90, 50)[i])
    model.save(os.path.join(HERE, "model_q8.kvc"), fingerprint="fixture model")
    for i, layer in enumerate(model.layers):
        record(expected, f"model_q8/{i}", layer)
    # legacy wire layout (f32 only)
    lw = kc.LayerKvCache(NKV, HD, mode="f32")
    fill(lw, 40, 20)
    with open(os.path.join(HERE, "legacy_f32.wire"), "wb") as fh:
        fh.write(lw.export_wire())
    record(expected, "legacy_f32", lw)
    # prefix-store entries of a q8 cache (block 80 > 64): two blocks, 160 positions
    store_cache = kc.KvCache(2, NKV, HD, max_seq_len=4096, mode="q8")
    k, v = rows(50, 160)
    for layer in store_cache.layers:
        layer.append(k[:1], v[:1])
        layer.append(k[1:], v[1:])
    ids = np.arange(1000, 1160, dtype=np.int64)
    backend = MemoryBackend()
    store = PrefixStore(backend, fingerprint="fixture store", block=80)
    assert store.put(ids, store_cache) == 2
    keys = backend.keys()
    np.savez_compressed(os.path.join(HERE, "store_q8.npz"), keys=np.array(keys),
             **{f"entry_{i}": np.frombuffer(backend.get_many([key])[0], np.uint8)
                for i, key in enumerate(keys)})
    for i, layer in enumerate(store_cache.layers):
        record(expected, f"store_q8/{i}", layer)
    expected["store_q8/ids"] = ids
    np.savez_compressed(os.path.join(HERE, "expected.npz"), **expected)


if __name__ == "__main__":
    main()
