"""The generation counter and kvcache.device mirrors (issue: GPU view shims).

Mirrors are checked against the cache after every operation of random sequences of append /
truncate / evict / clear / import, on the numpy backend (always) and on torch (CPU device
here; the ``cuda``-marked test repeats it on a GPU when one is present).  What a sync moves
is asserted too: appended rows only, the rows from a truncation point on, or everything after
a divergence.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys

import numpy as np
import pytest

import kvcache as kc
from kvcache import device as kd, quant
from kvcache._generation import LOG_LIMIT

F32, Q8KV, Q8K = kc.KvMode.F32, kc.KvMode.Q8(True, True), kc.KvMode.Q8(True, False)
Q8CMF = kc.KvMode.Q8(True, True, scheme="cmf")     # the legacy scheme: the column freeze
MODES = [F32, Q8KV, Q8K, kc.KvMode.Q8(False, True), Q8CMF, kc.KvMode.parse("k8v4"), kc.KvMode.parse("q4"),
         kc.KvMode.parse("q4v")]


def _torch_or_skip():
    return pytest.importorskip("torch")


@pytest.fixture(params=["numpy", "torch"])
def backend(request):
    if request.param == "torch":
        _torch_or_skip()
    return request.param


def rows(rng, n, nkv, hd):
    return rng.normal(size=(n, nkv, hd)).astype(np.float32)


# ------------------------------------------------------------------------------ comparisons
def assert_layer_mirrored(m, c):
    """Every mirrored accessor of a LayerMirror holds what the cache's holds, bit for bit."""
    assert m.generation == c.generation
    assert m.seq_len == c.seq_len and m.mode == c.mode and m.o1_sealed() == c.o1_sealed()
    for h in range(c.num_kv_heads):
        assert m.head_len(h) == c.head_len(h)
        host = ((c.head_keys(h), c.head_values(h)) + c.q8_rows(h) + c.k4_rows(h) + c.v4_rows(h)
                + c.columns(h))
        dev = ((m.head_keys(h), m.head_values(h)) + m.q8_rows(h) + m.k4_rows(h) + m.v4_rows(h)
               + m.columns(h))
        for a, b in zip(host, dev):
            if a is None:
                assert b is None
                continue
            b = m.to_numpy(b)
            assert a.shape == b.shape and a.dtype == b.dtype
            np.testing.assert_array_equal(a, b)
    hv, dv = c.o1_views(), m.o1_views()
    assert (hv is None) == (dv is None)
    for hg, dg in zip(hv or (), dv or ()):
        assert_o1_view_equal(m, hg, dg)


def assert_o1_view_equal(m, hg, dg):
    for f in ("m_eff", "w", "sink_len", "d", "dv", "exact_only", "scale", "win_len",
              "win_head", "far_len"):
        assert getattr(hg, f) == getattr(dg, f), f
    for f in ("win_k", "win_v", "sink_k", "sink_v", "k_tilde"):
        np.testing.assert_array_equal(getattr(hg, f), m.to_numpy(getattr(dg, f)))
    assert len(hg.heads) == len(dg.heads)
    for hh, dh in zip(hg.heads, dg.heads):
        assert hh.rect_fm == dh.rect_fm
        for f in ("t_hat", "z_hat", "m_max", "q_tilde", "mu"):
            np.testing.assert_array_equal(getattr(hh, f), m.to_numpy(getattr(dh, f)))


def assert_slots_mirrored(m, c):
    assert m.generation == c.generation and m.cached_len == c.cached_len
    assert m.alloc_id == c.alloc_id
    for li, slots in enumerate(c.layers):
        for s in range(c.n_slots):
            if slots is None:
                with pytest.raises(ValueError, match="holds no storage"):
                    m.valid_view(li, s)
                continue
            a, b = c.valid_view(li, s), m.to_numpy(m.valid_view(li, s))
            assert a.shape == b.shape and a.dtype == b.dtype
            np.testing.assert_array_equal(a, b)


def row_bytes(c):
    """Bytes of one stored row of one head, every store of the mode together."""
    v = (quant.v4_row_bytes(c.head_dim) if c.mode.v4
         else quant.v_row_bytes(c.head_dim, c.mode.quant_v))
    return quant.k_row_bytes(c.head_dim, c.mode.quant_k, scheme=c.mode.scheme or "rows") + v


def appended_bytes(c, new):
    """Bytes an append-only sync of ``new`` rows moves, or None for 4-bit K (which also
    re-sends its block parameters, its ring and the codes of the block the rows close:
    docs/kv4.md), where the mirror's bit-for-bit equality is the check."""
    return None if c.mode.k4 else new * row_bytes(c)


# ------------------------------------------------------------------------------ generation
def test_generation_moves_on_every_non_append_change(rng):
    c = kc.LayerKvCache(2, 8, mode=F32)
    g = [c.generation]

    def bumped():
        g.append(c.generation)
        return g[-1] > g[-2]

    c.append(rows(rng, 10, 2, 8), rows(rng, 10, 2, 8))
    assert not bumped()
    c.attend_all_heads(rng.normal(size=(4, 8)))
    c.accumulate_imp(np.ones(10))
    assert not bumped()
    c.truncate_last(0)
    assert not bumped()
    c.truncate_last(2)
    assert bumped()
    c._evict(100)                                   # nothing to evict: no change
    assert not bumped()
    c._evict(5)
    assert bumped()
    c.append(rows(rng, 10, 2, 8), rows(rng, 10, 2, 8))
    c.accumulate_imp(np.arange(15.0))
    c._evict_born(8, 2, 3)
    assert bumped()
    buf = c.to_bytes()
    c.install_bytes(buf)
    assert bumped()
    c.import_wire(c.export_wire())
    assert bumped()
    c.clear()
    assert bumped()
    c.clear()                                       # a clear always counts
    assert bumped()


def test_q8_column_freeze_bumps_the_generation_once(rng):
    c = kc.LayerKvCache(2, 8, mode=Q8CMF)
    c.append(rows(rng, 64, 2, 8), rows(rng, 64, 2, 8))
    g = c.generation
    c.append(rows(rng, 1, 2, 8), rows(rng, 1, 2, 8))            # the freeze requantises
    assert c.columns(0)[0] is not None and c.generation == g + 1
    c.append(rows(rng, 70, 2, 8), rows(rng, 70, 2, 8))
    assert c.generation == g + 1


def test_q8_freeze_with_no_rows_stored_is_not_a_change(rng):
    c = kc.LayerKvCache(1, 8, mode=Q8CMF)
    for _ in range(70):
        c.append(rows(rng, 1, 1, 8), rows(rng, 1, 1, 8), alive=[False])
    assert c.generation == 0 and c.columns(0) == (None, None)


def test_o1_seal_and_restore_bump_but_steps_do_not(rng):
    c = sealed(rng)
    g = c.generation
    snap = c.o1_snapshot()
    c.o1_step(rng.normal(size=(4, 8)), rng.normal(size=(2, 8)), rng.normal(size=(2, 8)), 4)
    assert c.generation == g
    c.o1_restore(snap)
    assert c.generation == g + 1


def test_kvcache_generation_sums_its_layers(rng):
    kv = kc.KvCache(3, 2, 4, mode=F32)
    for layer in kv:
        layer.append(rows(rng, 6, 2, 4), rows(rng, 6, 2, 4))
    assert kv.generation == 0
    kv.truncate_last(1)
    assert kv.generation == 3
    kv[1].clear()
    assert kv.generation == 4


def test_unchanged_prefix_follows_truncations_and_forgets_at_divergence(rng):
    c = kc.LayerKvCache(2, 4, mode=F32)
    c.append(rows(rng, 10, 2, 4), rows(rng, 10, 2, 4), alive=[True, False])
    g0 = c.generation
    np.testing.assert_array_equal(c.unchanged_prefix(g0), [10, 0])
    c.truncate_last(3)
    c.append(rows(rng, 5, 2, 4), rows(rng, 5, 2, 4))
    c.truncate_last(1)
    np.testing.assert_array_equal(c.unchanged_prefix(g0), [7, 0])
    g1 = c.generation
    np.testing.assert_array_equal(c.unchanged_prefix(g1), [11, 4])
    assert c.unchanged_prefix(g1 + 1) is None                   # not a generation yet
    c._evict(5)
    assert c.unchanged_prefix(g1) is None and c.unchanged_prefix(g0) is None
    with pytest.raises(TypeError, match="since"):
        c.unchanged_prefix(1.5)


def test_unchanged_prefix_log_is_bounded(rng):
    c = kc.LatentKvCache.with_capacity(1, 200, [[2]])
    c.write_layer(0, [np.ones((150, 2))])
    c.advance(150)
    g0 = c.generation
    for _ in range(LOG_LIMIT):
        c.truncate_last(1)
    assert c.unchanged_prefix(g0) == 150 - LOG_LIMIT
    c.truncate_last(1)                                          # one shrink too many
    assert c.unchanged_prefix(g0) is None                       # ...a full re-upload, not a lie
    assert c.unchanged_prefix(g0 + 1) == 150 - LOG_LIMIT - 1


def test_latent_static_and_lazy_generations(rng):
    lc = kc.LatentKvCache.with_capacity(2, 16, [[3]])
    sc = kc.StaticKvCache.with_capacity(2, 2, 4, 16)
    for c, write in ((lc, lambda l: lc.write_layer(l, [np.ones((4, 3))])),
                     (sc, lambda l: sc.write_layer(l, np.ones((2, 4, 4)), np.ones((2, 4, 4))))):
        for layer in range(2):
            write(layer)
        c.advance(4)
        assert c.generation == 0 and c.unchanged_prefix(0) == 4
        c.truncate_last(0)                                      # nothing to drop: no change
        assert c.generation == 0
        c.truncate_last(2)
        assert c.generation == 1 and c.unchanged_prefix(0) == 2
        c.clear()
        assert c.generation == 2 and c.unchanged_prefix(1) is None
    lazy = kc.LazyLatentCache.new(1, 8, [[2]])
    assert lazy.append(0, [np.ones((3, 2))]).advance_by(3).generation == 0


# ------------------------------------------------------------------------------ layer mirrors
def sealed(rng, nkv=2, hd=8, nh=4, t=60, m=4, w=8, sink=2):
    c = kc.LayerKvCache(nkv, hd, mode=F32)
    c.o1_begin(m, w, sink)
    for _ in range(t):
        c.append(rng.normal(size=(nkv, hd)), rng.normal(size=(nkv, hd)))
        c.o1_push_q(rng.normal(size=(nh, hd)))
    assert c.o1_seal(nh) and not c.o1.exact_only
    return c


def layer_ops(rng, c, n_ops, check):
    """Random append / truncate / evict / clear / import on ``c``; ``check`` after each."""
    nkv, hd = c.num_kv_heads, c.head_dim
    for _ in range(n_ops):
        op = rng.random()
        if op < 0.55:
            n = int(rng.integers(1, 6))
            alive = rng.random(nkv) > 0.15
            c.append(rows(rng, n, nkv, hd), rows(rng, n, nkv, hd), alive=alive)
            c.accumulate_imp(rng.random(c.seq_len))
        elif op < 0.75:
            c.truncate_last(int(rng.integers(0, 5)))
        elif op < 0.85:
            keep = int(rng.integers(1, 40))
            c._evict_born(keep, 2, max(keep // 2, 1)) if rng.random() < 0.5 else c._evict(keep)
        elif op < 0.9:
            c.install_bytes(c.to_bytes())
        elif op < 0.93 and c.mode.is_f32:
            c.import_wire(c.export_wire())
        elif op < 0.96:
            c.clear()
        check()


@pytest.mark.parametrize("mode", MODES, ids=repr)
def test_layer_mirror_follows_random_sequences(rng, backend, mode):
    c = kc.LayerKvCache(3, 40, mode=mode)
    m = kd.Mirror(c, backend=backend)
    assert isinstance(m, kd.LayerMirror) and m.backend == backend
    seen = {"full": 0, "part": 0}

    def check():
        before = {h: m.head_len(h) for h in range(3)}
        gen = m.generation
        stats = m.sync()
        assert_layer_mirrored(m, c)
        seen["full" if stats.full else "part"] += 1
        if not stats.full and gen == c.generation:      # append only: just the new rows
            new = sum(c.head_len(h) - before[h] for h in range(3))
            want = appended_bytes(c, new)
            assert stats.rows == new and (want is None or stats.bytes == want)

    layer_ops(rng, c, 250, check)
    assert seen["full"] and seen["part"] > seen["full"]


def test_sync_after_append_moves_only_the_appended_rows(rng, backend):
    c = kc.LayerKvCache(2, 16, mode=F32)
    c.append(rows(rng, 100, 2, 16), rows(rng, 100, 2, 16))
    m = kd.Mirror(c, backend=backend)
    assert m.total.full and m.total.bytes == 2 * 100 * 2 * 16 * 4
    c.append(rows(rng, 1, 2, 16), rows(rng, 1, 2, 16))
    s = m.sync()
    assert (s.full, s.rows, s.bytes, s.device_bytes) == (False, 2, 2 * 2 * 16 * 4, 0)
    assert m.sync() == kd.SyncStats(False, 0, 0, 0)             # nothing new: nothing moved
    assert_layer_mirrored(m, c)


def test_rollback_then_reappend_moves_from_the_truncation_point(rng, backend):
    c = kc.LayerKvCache(2, 16, mode=Q8KV)
    c.append(rows(rng, 300, 2, 16), rows(rng, 300, 2, 16))
    m = kd.Mirror(c, backend=backend)
    c.append(rows(rng, 5, 2, 16), rows(rng, 5, 2, 16))          # five draft tokens
    m.sync()
    c.truncate_last(4)                                          # three rejected...
    c.append(rows(rng, 2, 2, 16), rows(rng, 2, 2, 16))          # ...and the verified ones
    s = m.sync()
    assert not s.full and s.rows == 2 * 2 and s.bytes == 4 * row_bytes(c)
    assert_layer_mirrored(m, c)


@pytest.mark.parametrize("diverge", ["evict", "clear", "import", "freeze", "seal"])
def test_divergence_reuploads_everything(rng, backend, diverge):
    mode = Q8CMF if diverge == "freeze" else F32
    c = kc.LayerKvCache(2, 8, mode=mode)
    if diverge == "seal":
        c.o1_begin(4, 8, 2)
        for _ in range(60):
            c.o1_push_q(rng.normal(size=(2, 8)))
    c.append(rows(rng, 60, 2, 8), rows(rng, 60, 2, 8))
    m = kd.Mirror(c, backend=backend)
    {"evict": lambda: c._evict(30), "clear": c.clear,
     "import": lambda: c.import_wire(c.export_wire()),
     "freeze": lambda: c.append(rows(rng, 8, 2, 8), rows(rng, 8, 2, 8)),
     "seal": lambda: c.o1_seal(2)}[diverge]()
    s = m.sync()
    assert s.full
    assert_layer_mirrored(m, c)


def test_device_capacity_grows_geometrically(rng, backend):
    c = kc.LayerKvCache(1, 4, mode=F32)
    m = kd.Mirror(c, backend=backend)
    caps, moved = [], 0
    for _ in range(600):
        c.append(rows(rng, 1, 1, 4), rows(rng, 1, 1, 4))
        s = m.sync()
        moved += s.device_bytes
        if not caps or m.capacity != caps[-1]:
            caps.append(m.capacity)
    assert caps == [64, 128, 256, 512, 1024]
    # growth copies what the device holds, device-to-device (K and V, 16 B per row each)
    assert moved == 2 * 16 * (64 + 128 + 256 + 512)
    assert m.total.bytes == 600 * 2 * 16 and m.total.rows == 600
    assert_layer_mirrored(m, c)


def test_sealed_layer_mirror_tracks_steps_and_restore(rng, backend):
    c = sealed(rng)
    m = kd.Mirror(c, backend=backend)
    assert_layer_mirrored(m, c)
    const = m.o1_views()[0].k_tilde
    snap = c.o1_snapshot()
    for _ in range(12):                                         # the ring wraps (w = 8)
        c.o1_step(rng.normal(size=(4, 8)), rng.normal(size=(2, 8)), rng.normal(size=(2, 8)), 4)
        s = m.sync()
        assert not s.full
        assert_layer_mirrored(m, c)
    assert m.o1_views()[0].k_tilde is not None and m.sync().bytes == 0
    c.o1_restore(snap)
    assert m.sync().full
    assert_layer_mirrored(m, c)
    c.clear()
    m.sync()
    assert m.o1_views() is None and not m.o1_sealed()
    assert_layer_mirrored(m, c)
    del const


def test_exact_only_sealed_layer_has_no_device_form(rng, backend):
    c = kc.LayerKvCache(1, 4, mode=F32)
    c.o1_begin(4, 8, 2)
    for _ in range(5):
        c.append(rng.normal(size=(1, 4)), rng.normal(size=(1, 4)))
        c.o1_push_q(rng.normal(size=(1, 4)))
    assert c.o1_seal(1) and c.o1.exact_only
    m = kd.Mirror(c, backend=backend)
    assert m.o1_sealed() and m.o1_views() is None and m.head_len(0) == 0


def test_kvcache_mirror_syncs_every_layer(rng, backend):
    kv = kc.KvCache(3, 2, 8, mode=F32, policy=kc.EvictionPolicy.born(sink=2))
    m = kd.Mirror(kv, backend=backend)
    assert isinstance(m, kd.KvCacheMirror) and len(m) == 3
    for step in range(60):
        for layer in kv:
            layer.append(rows(rng, 1, 2, 8), rows(rng, 1, 2, 8))
        if step % 17 == 16:
            kv.evict(10)
        elif step % 7 == 6:
            kv.truncate_last(2)
        m.sync()
        assert m.generation == kv.generation and m.seq_len == kv.seq_len
        for lm, layer in zip(m, kv):
            assert_layer_mirrored(lm, layer)
    kv.layers.append(kc.LayerKvCache(2, 8, mode=F32))
    with pytest.raises(ValueError, match="replaced or resized"):
        m.sync()


# ------------------------------------------------------------------------------ slot mirrors
def latent_case(rng, dtype=np.float32):
    c = kc.LatentKvCache.with_capacity(3, 300, [[8], [3, 2]], dtype=dtype)

    def write(n):
        for li in range(3):
            c.write_layer(li, [rng.normal(size=(n, 8)), rng.normal(size=(n, 3, 2))])
    return c, write


def static_case(rng):
    c = kc.StaticKvCache.with_capacity(3, 2, 4, 300)

    def write(n):
        for li in range(3):
            c.write_layer(li, rng.normal(size=(2, n, 4)), rng.normal(size=(2, n, 4)))
    return c, write


@pytest.mark.parametrize("case", ["latent", "latent-f16", "latent-bf16", "static"])
def test_slot_mirror_follows_random_sequences(rng, backend, case):
    if case == "latent-bf16":
        pytest.importorskip("ml_dtypes")
        c, write = latent_case(rng, "bfloat16")
    elif case.startswith("latent"):
        c, write = latent_case(rng, np.float16 if case == "latent-f16" else np.float32)
    else:
        c, write = static_case(rng)
    m = kd.Mirror(c, backend=backend)
    assert isinstance(m, kd.StaticMirror if case == "static" else kd.LatentMirror)
    one_row = sum(b.nbytes // c.max_seq_len for b in (c.slot_storage(0, 0), c.slot_storage(0, 1)))
    for _ in range(150):
        op = rng.random()
        if op < 0.6:
            n = int(rng.integers(1, 6))
            if c.cached_len + n <= c.max_seq_len:
                write(n)
                c.advance(n)
        elif op < 0.9:
            c.truncate_last(int(rng.integers(0, 5)))
        gen, before = m.generation, m.cached_len
        s = m.sync()
        assert_slots_mirrored(m, c)
        if gen == c.generation:
            new = c.cached_len - before
            assert not s.full and s.rows == 3 * new and s.bytes == 3 * new * one_row
    assert m.capacity <= c.max_seq_len
    c.clear()
    assert m.sync().full
    assert_slots_mirrored(m, c)


def test_slot_mirror_capacity_stops_at_max_seq_len(rng, backend):
    c = kc.LatentKvCache.with_capacity(1, 100, [[4]])
    m = kd.Mirror(c, backend=backend)
    caps = []
    for _ in range(100):
        c.write_layer(0, [np.ones((1, 4))])
        c.advance(1)
        m.sync()
        caps.append(m.capacity)
    assert sorted(set(caps)) == [64, 100]
    assert_slots_mirrored(m, c)


def test_slot_mirror_refuses_a_replaced_storage(rng, backend):
    c, write = latent_case(rng)
    write(4)
    c.advance(4)
    m = kd.Mirror(c, backend=backend)
    c.layers[1][0].storage = np.zeros((5, 8), np.float32)
    with pytest.raises(ValueError, match="layer 1, slot 0"):
        m.sync()
    assert m.generation is None                 # the next sync is a full one


# ------------------------------------------------------------------------------ failures
class _FailingBackend:
    """Wraps a backend and fails the n-th upload."""

    def __init__(self, inner, fail_at):
        self._inner, self._n, self.fail_at = inner, 0, fail_at
        self.name, self.device = inner.name, inner.device

    def upload(self, dst, src):
        self._n += 1
        if self._n == self.fail_at:
            raise MemoryError("device out of memory (simulated)")
        self._inner.upload(dst, src)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def test_a_failed_sync_makes_the_next_one_full(rng):
    c = kc.LayerKvCache(2, 8, mode=F32)
    c.append(rows(rng, 10, 2, 8), rows(rng, 10, 2, 8), alive=[True, False])
    m = kd.Mirror(c, backend="numpy")
    m._be = _FailingBackend(m._be, fail_at=2)
    c.append(rows(rng, 3, 2, 8), rows(rng, 3, 2, 8))
    with pytest.raises(MemoryError):
        m.sync()
    assert m.generation is None
    s = m.sync()
    assert s.full
    assert_layer_mirrored(m, c)


def test_sync_full_reuploads_after_writes_by_hand(rng):
    c, write = latent_case(rng)
    write(4)
    c.advance(4)
    m = kd.Mirror(c, backend="numpy")
    c.slot_storage(0, 0)[1] = 7.0                # not seen by the generation counter
    assert m.sync().rows == 0
    assert m.sync(full=True).full
    assert_slots_mirrored(m, c)


# ------------------------------------------------------------------------------ bad input
def test_mirror_rejects_what_it_cannot_follow():
    with pytest.raises(TypeError, match="LazyLatentCache is immutable"):
        kd.Mirror(kc.LazyLatentCache.new(1, 4, [[2]]), backend="numpy")
    with pytest.raises(TypeError, match="got ndarray"):
        kd.Mirror(np.zeros(3), backend="numpy")
    with pytest.raises(TypeError, match="expected a LatentKvCache"):
        kd.LatentMirror(kc.LayerKvCache(1, 4, mode=F32), backend="numpy")
    c = kc.LayerKvCache(1, 4, mode=F32)
    with pytest.raises(ValueError, match="backend"):
        kd.Mirror(c, backend="jax")
    with pytest.raises(ValueError, match="host memory"):
        kd.Mirror(c, backend="numpy", device="cuda")
    m = kd.Mirror(c, backend="numpy")
    with pytest.raises(IndexError):
        m.head_keys(1)
    with pytest.raises(TypeError):
        m.head_len(0.5)
    lm = kd.Mirror(kc.LatentKvCache.with_capacity(1, 4, [[2]]), backend="numpy")
    with pytest.raises(IndexError):
        lm.valid_view(1, 0)
    with pytest.raises(IndexError):
        lm.valid_view(0, 1)


def test_missing_backend_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(ImportError, match="pip install torch"):
        kd.Mirror(kc.LayerKvCache(1, 4, mode=F32), backend="torch")
    with pytest.raises(ImportError, match="pip install torch"):
        kd.as_tensor(np.zeros(3, np.float32))
    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(ImportError, match="cupy"):
        kd.Mirror(kc.LayerKvCache(1, 4, mode=F32), backend="cupy")


def test_torch_device_errors_are_clear():
    torch = _torch_or_skip()
    c = kc.LayerKvCache(1, 4, mode=F32)
    with pytest.raises(ValueError, match="torch does not know"):
        kd.Mirror(c, backend="torch", device="not-a-device")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="no CUDA device"):
            kd.Mirror(c, backend="torch", device="cuda")


# ------------------------------------------------------------------------------ signature parity
def _parity_cases(rng):
    c = kc.LayerKvCache(2, 8, mode=Q8K)
    c.append(rows(rng, 70, 2, 8), rows(rng, 70, 2, 8))
    s = sealed(rng)
    lc, write = latent_case(rng)
    write(5)
    lc.advance(5)
    sc, swrite = static_case(rng)
    swrite(3)
    sc.advance(3)
    kv = kc.KvCache(2, 2, 8, mode=F32)
    for layer in kv:
        layer.append(rows(rng, 4, 2, 8), rows(rng, 4, 2, 8))
    calls = {"head_len": (1,), "head_keys": (1,), "head_values": (1,), "q8_rows": (1,),
             "v4_rows": (1,), "k4_rows": (1,),
             "columns": (1,), "valid_view": (2, 1), "slot_shape": (1,), "__getitem__": (1,)}
    return [c, s, lc, sc, kv], calls


def _shapes(x):
    """Shapes (and None / scalar values) of what an accessor returned, recursively."""
    if x is None or isinstance(x, (bool, int, float, str, np.dtype, kc.KvMode,
                                   kc.rebind.KvAllocId)):
        return x
    if isinstance(x, (list, tuple)):
        return [_shapes(v) for v in x]
    if isinstance(x, (kc.o1.O1DeviceView, kc.o1.O1HeadView)):
        return {k: _shapes(v) for k, v in vars(x).items()}
    if isinstance(x, kd.LayerMirror) or isinstance(x, kc.LayerKvCache):
        return "layer"
    return tuple(x.shape)


def _params(sig):
    """A method's parameters (names, kinds, defaults and annotations).  Return annotations are
    not compared: a mirror returns device arrays (and LayerMirror for KvCacheMirror[i]) where
    its cache returns host arrays; the shapes of what they return are compared below."""
    return list(sig.parameters.values())


def test_every_mirror_exposes_the_names_signatures_and_shapes_of_its_cache(rng, backend):
    caches, calls = _parity_cases(rng)
    for c in caches:
        m = kd.Mirror(c, backend=backend)
        assert m.MIRRORED, type(m).__name__
        for name in m.MIRRORED:
            host, dev = inspect.getattr_static(c, name), inspect.getattr_static(m, name)
            is_method = inspect.isfunction(host)
            assert is_method == inspect.isfunction(dev), name    # data (property or field) both
            if is_method:
                assert _params(inspect.signature(host)) == _params(inspect.signature(dev)), name
                args = calls.get(name, ())
                hv, dv = getattr(c, name)(*args), getattr(m, name)(*args)
            else:
                hv, dv = getattr(c, name), getattr(m, name)
            assert _shapes(hv) == _shapes(dv), (type(c).__name__, name)
    # and the list is complete: every public LayerKvCache accessor of stored data is there
    readers = {"head_len", "head_keys", "head_values", "k_heads", "v_heads", "q8_rows", "v4_rows",
               "k4_rows",
               "columns", "o1_views", "o1_sealed", "seq_len", "mode", "generation"}
    assert readers <= set(kd.LayerMirror.MIRRORED)
    assert {"valid_view", "cached_len", "alloc_id", "generation"} <= set(kd.LatentMirror.MIRRORED)


# ------------------------------------------------------------------------------ CUDA
@pytest.mark.cuda
def test_cuda_mirror_follows_random_sequences(rng):
    torch = _torch_or_skip()
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    for mode in (F32, Q8KV):
        c = kc.LayerKvCache(4, 64, mode=mode)
        m = kd.Mirror(c, backend="torch", device="cuda")
        assert m.head_keys(0).device.type == "cuda"
        layer_ops(rng, c, 200, lambda: (m.sync(), assert_layer_mirrored(m, c)))
    lc, write = latent_case(rng)
    lm = kd.Mirror(lc, backend="torch", device="cuda")
    for _ in range(40):
        write(3)
        lc.advance(3)
        lm.sync()
    lc.truncate_last(lc.cached_len - 50)                        # back to 50 of 120 rows
    lm.sync()
    assert_slots_mirrored(lm, lc)
    s = sealed(rng)
    sm = kd.Mirror(s, backend="torch", device="cuda")
    s.o1_step(rng.normal(size=(4, 8)), rng.normal(size=(2, 8)), rng.normal(size=(2, 8)), 4)
    sm.sync()
    assert_layer_mirrored(sm, s)


# ------------------------------------------------------------------------------ review fixes
class _FakeCupy:
    """A stand-in for CuPy (NumPy arrays that remember the device they were made on and
    refuse writes made while another device is current), to run the cupy backend's code."""

    def __init__(self):
        fake = self
        self.current = 0

        class ndarray(np.ndarray):
            def __array_finalize__(self, obj):
                self.dev = getattr(obj, "dev", fake.current)

            def __setitem__(self, key, value):
                if self.dev != fake.current:
                    raise AssertionError(f"write to device {self.dev} while {fake.current} "
                                         f"is current")
                np.ndarray.__setitem__(self, key, value)

        class Device:
            def __init__(self, ordinal=0):
                self.id = ordinal

            def __enter__(self):
                self.prev, fake.current = fake.current, self.id

            def __exit__(self, *exc):
                fake.current = self.prev

        self.ndarray = ndarray
        self.cuda = type("cuda", (), {"Device": Device})

    def _wrap(self, a):
        out = np.asarray(a).view(self.ndarray)
        out.dev = self.current
        return out

    def empty(self, shape, dtype):
        return self._wrap(np.empty(shape, dtype))

    def asarray(self, a):
        return self._wrap(np.array(a))

    def asnumpy(self, a):
        return np.array(a)


def test_cupy_backend_runs_on_its_device(rng, monkeypatch):
    fake = _FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    c = kc.LayerKvCache(2, 8, mode=Q8KV)
    m = kd.Mirror(c, backend="cupy", device="cuda:1")
    assert m.backend == "cupy" and m.device.id == 1
    layer_ops(rng, c, 120, lambda: (m.sync(), assert_layer_mirrored(m, c)))
    for _ in range(200):                                     # grow: copies made on device 1
        c.append(rows(rng, 1, 2, 8), rows(rng, 1, 2, 8))
        m.sync()
    assert m.total.device_bytes > 0
    assert_layer_mirrored(m, c)
    lc, write = latent_case(rng)
    lm = kd.Mirror(lc, backend="cupy", device=1)
    for _ in range(30):
        write(3)
        lc.advance(3)
        lm.sync()
    assert lm.total.device_bytes > 0
    assert_slots_mirrored(lm, lc)
    if importlib.util.find_spec("ml_dtypes"):
        with pytest.raises(TypeError, match="no bfloat16"):
            kd.Mirror(latent_case(rng, "bfloat16")[0], backend="cupy")
    for bad in (True, -1, 1.5, "cuda:x", "cpu"):
        with pytest.raises(ValueError, match="device"):
            kd.Mirror(c, backend="cupy", device=bad)
    with pytest.raises(TypeError, match="cupy array"):
        m.to_numpy(np.zeros(2))


def test_sync_takes_a_bool_and_a_bad_one_changes_nothing(rng):
    c = kc.LayerKvCache(1, 4, mode=F32)
    c.append(rows(rng, 3, 1, 4), rows(rng, 3, 1, 4))
    m = kd.Mirror(c, backend="numpy")
    for bad in ("False", np.array([1, 0]), None, 1):
        with pytest.raises(TypeError, match="full"):
            m.sync(full=bad)
    assert m.generation == c.generation and not m.sync().full
    assert m.sync(full=np.bool_(True)).full


def test_more_bad_input_is_refused_clearly(rng):
    with pytest.raises(TypeError, match="expected a LayerKvCache"):
        kd.LayerMirror(None, backend="numpy")
    with pytest.raises(TypeError):
        kd.SyncStats(False, 0, 0, 0) + 1
    with pytest.raises(TypeError, match="DLPack"):
        kd.as_tensor(np.array(["a"]), "numpy")
    with pytest.raises(TypeError, match="DLPack"):
        kd.as_tensor(np.zeros(2, dtype=">f4"), "numpy")
    with pytest.raises(ValueError, match="backend"):
        kd.as_tensor(np.zeros(2, np.float32), "cupy")
    with pytest.raises(TypeError, match="O1DeviceView"):
        kd.tensors(np.zeros(2), "numpy")
    lc, write = latent_case(rng)
    m = kd.Mirror(lc, backend="numpy")
    lc.layers.append(None)
    with pytest.raises(ValueError, match="resized"):
        m.sync()


def test_torch_refuses_devices_that_hold_no_data():
    _torch_or_skip()
    with pytest.raises(ValueError, match="meta"):
        kd.Mirror(kc.LayerKvCache(1, 4, mode=F32), backend="torch", device="meta")


def test_as_tensor_falls_back_where_dlpack_refuses_read_only_arrays(rng, monkeypatch):
    """NumPy < 2.1 and older torch speak only unversioned DLPack, which cannot mark an array
    read-only, so NumPy refuses to export one: the fallback still shares the memory."""
    torch = _torch_or_skip()
    c = kc.LayerKvCache(1, 4, mode=F32)
    c.append(rows(rng, 3, 1, 4), rows(rng, 3, 1, 4))
    view = c.head_keys(0)

    def refuse(array):
        raise BufferError("Cannot export readonly array since signalling readonly is unsupported")
    monkeypatch.setattr(torch, "from_dlpack", refuse)
    monkeypatch.setattr(np, "from_dlpack", refuse)
    t = kd.as_tensor(view, "torch")
    assert t.data_ptr() == view.ctypes.data and torch.equal(t, torch.tensor(view))
    a = kd.as_tensor(view, "numpy")
    assert a.ctypes.data == view.ctypes.data and not a.flags.writeable
    with pytest.raises(BufferError):                         # a writable array has no excuse
        kd.as_tensor(np.zeros(3, np.float32), "torch")


def test_exact_only_layer_reports_full_only_when_it_changed(rng):
    c = kc.LayerKvCache(1, 4, mode=F32)
    c.o1_begin(4, 8, 2)
    for _ in range(5):
        c.append(rng.normal(size=(1, 4)), rng.normal(size=(1, 4)))
        c.o1_push_q(rng.normal(size=(1, 4)))
    m = kd.Mirror(c, backend="numpy")
    assert c.o1_seal(1) and m.sync().full
    assert m.sync() == kd.SyncStats(False, 0, 0, 0)
