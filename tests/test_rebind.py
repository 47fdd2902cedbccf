"""Guarded re-bind of a held decode plan (kvcache.rebind; docs/latent.md).

The upstream GAP-014/GAP-028 tests in our own words, on both carriers (LatentKvCache and
StaticKvCache): a plan is kept across steps and rewinds, re-bound onto a same-geometry swapped
cache, declared stale for another geometry, and refused -- all or nothing -- for a cleared
cache, another residency or storage of another shape.
"""

from __future__ import annotations

import numpy as np
import pytest

import kvcache as kc
from kvcache.rebind import StorageFingerprint

MLA = [[5], [2]]
PV = kc.rebind.PlanValidity
V, AC, ST = PV.VALID, PV.ALLOCATION_CHANGED, PV.STALE


def latent(n_layers=3, max_seq_len=8, trailing=MLA, dtype=np.float32):
    return kc.LatentKvCache.with_capacity(n_layers, max_seq_len, trailing, dtype)


def static(n_layers=2, nkv=2, max_seq_len=8, hd=4, dtype=np.float32):
    return kc.StaticKvCache.with_capacity(n_layers, nkv, hd, max_seq_len, dtype)


def step(cache, rng, seq=1):
    """One forward step: every layer written at cached_len, then one advance."""
    for layer in range(cache.n_layers):
        if isinstance(cache, kc.LatentKvCache):
            cache.write_layer(layer, [rng.standard_normal((seq, *t)) for t in cache.slot_trailing])
        else:
            shape = (cache.num_kv_heads, seq, cache.head_dim)
            cache.write_layer(layer, rng.standard_normal(shape), rng.standard_normal(shape))
    cache.advance(seq)


def plan_state(plan):
    return (plan.alloc_id, plan.kv_location, dict(plan.bound),
            {k: id(v) for k, v in plan.bound.items()})


class Relocated:
    """A source that forwards to a cache but reports another location (a stand-in for a
    cache on another device)."""

    def __init__(self, cache, location):
        self.cache, self.location = cache, location

    @property
    def alloc_id(self):
        return self.cache.alloc_id

    def rebind_location(self):
        return self.location

    def rebind_slot(self, layer, which):
        return self.cache.rebind_slot(layer, which)

    max_seq_len = property(lambda self: self.cache.max_seq_len)
    n_layers = property(lambda self: self.cache.n_layers)
    dtype = property(lambda self: self.cache.dtype)


# ------------------------------------------------------------------------------------ protocol
def test_both_caches_satisfy_the_protocols():
    for cache in (latent(), static()):
        assert isinstance(cache, kc.rebind.KvRebindSource)
        assert isinstance(cache, kc.rebind.KvPlanSource)
    assert not isinstance(kc.LazyLatentCache.new(1, 4, MLA), kc.rebind.KvRebindSource)
    assert not isinstance(object(), kc.rebind.KvRebindSource)
    assert {r.name for r in kc.rebind.RebindRefusal} == {"RESIDENCY_UNKNOWN", "RESIDENCY_DIFFERS",
                                                  "MISSING_SLOT", "UNBAKED_SLOT",
                                                  "STORAGE_DIFFERS"}
    assert {v.name for v in kc.rebind.PlanValidity} == {"VALID", "ALLOCATION_CHANGED", "STALE"}
    assert issubclass(kc.RebindRefused, RuntimeError)


@pytest.mark.parametrize("make", [latent, static], ids=["latent", "static"])
def test_build_binds_slots_0_and_1_of_every_layer(make):
    cache = make()
    plan = kc.rebind.DecodePlan.build(cache, shape_key=("tiny", 1))
    assert plan.alloc_id == cache.alloc_id and plan.kv_location == "cpu"
    assert (plan.seq, plan.max_seq_len, plan.n_layers, plan.dtype) == (1, 8, cache.n_layers,
                                                                        np.float32)
    assert plan.shape_key == ("tiny", 1) and plan.slots == (0, 1)
    assert plan.layers == tuple(range(cache.n_layers))
    assert set(plan.bound) == {(la, w) for la in range(cache.n_layers) for w in (0, 1)}
    for la in range(cache.n_layers):
        for w in (0, 1):
            assert plan.storage(la, w) is cache.slot_storage(la, w)
    with pytest.raises(IndexError, match="no storage bound for layer 9"):
        plan.storage(9, 0)
    with pytest.raises(TypeError):
        plan.bound[(0, 0)] = None                      # a read-only mapping
    assert "DecodePlan(seq=1" in repr(plan)
    assert plan.validity_for(cache) is V and plan.is_valid_for(cache)


def test_build_guards_and_bad_arguments():
    cache = latent()
    kc.rebind.DecodePlan(cache, n_layers=3, max_seq_len=8, dtype="float32")   # matching: fine
    for kw, match in [({"n_layers": 4}, "n_layers: the plan expects 4"),
                      ({"max_seq_len": 16}, "max_seq_len"),
                      ({"dtype": np.float16}, "dtype"),
                      ({"seq": 0}, "seq"),
                      ({"slots": ()}, "slots"),
                      ({"slots": (0, 0)}, "slots")]:
        with pytest.raises(ValueError, match=match):
            kc.rebind.DecodePlan.build(cache, **kw)
    with pytest.raises(TypeError, match="hashable"):
        kc.rebind.DecodePlan.build(cache, shape_key=["not", "hashable"])
    with pytest.raises(TypeError, match="KvRebindSource"):
        kc.rebind.DecodePlan.build(kc.LazyLatentCache.new(1, 4, MLA))
    one = latent(trailing=[[6]])                      # a single-slot cache binds slot 0 only
    with pytest.raises(ValueError, match="not for slot 1"):
        kc.rebind.DecodePlan.build(one)
    plan = kc.rebind.DecodePlan.build(one, slots=(0,))
    assert set(plan.bound) == {(0, 0), (1, 0), (2, 0)}
    cache.clear()
    with pytest.raises(ValueError, match="no populated layer"):
        kc.rebind.DecodePlan.build(cache)


def test_partially_populated_cache_binds_its_layers_only():
    cache = latent()
    cache.layers[0] = None                            # pipeline-parallel: layers 1, 2 here
    plan = kc.rebind.DecodePlan.build(cache)
    assert plan.layers == (1, 2) and plan.n_layers == 3
    other = latent()
    other.layers[0] = None
    assert plan.validity_for(other) is AC
    plan.rebind_kv(other)
    assert plan.storage(1, 0) is other.slot_storage(1, 0)


# ------------------------------------------------------------------------------------ validity
@pytest.mark.parametrize("make", [latent, static], ids=["latent", "static"])
def test_plan_survives_continuation_and_truncate(make, rng):
    cache = make()
    plan = kc.rebind.DecodePlan.build(cache, shape_key="m")
    bound = dict(plan.bound)
    step(cache, rng, 3)
    step(cache, rng)
    cache.bump_version(0, 0)
    assert plan.validity_for(cache) is V
    cache.truncate_last(cache.cached_len - 2)               # speculative reject: same allocation
    assert plan.validity_for(cache) is V
    assert dict(plan.bound) == bound                  # nothing to re-bind
    step(cache, rng)
    assert plan.validity_for(cache) is V


@pytest.mark.parametrize("other, why", [
    (lambda: latent(max_seq_len=16), "max_seq_len"),
    (lambda: latent(dtype=np.float64), "dtype"),
    (lambda: latent(n_layers=4), "n_layers"),
    (lambda: static(n_layers=3), "static n_layers"),
    (lambda: static(max_seq_len=9), "static max_seq_len"),
    (lambda: static(dtype=np.float16), "static dtype"),
])
def test_other_structure_is_stale(other, why):
    base = latent() if "static" not in why else static()
    plan = kc.rebind.DecodePlan.build(base)
    assert plan.validity_for(other()) is ST, why


def test_seq_and_shape_key_are_part_of_validity():
    cache = latent()
    plan = kc.rebind.DecodePlan.build(cache, shape_key=("llama", 7))
    assert plan.validity_for(cache, seq=2) is ST                      # a prefill step
    assert plan.validity_for(cache, shape_key=("llama", 8)) is ST     # another model
    assert plan.validity_for(cache, seq=1, shape_key=("llama", 7)) is V
    assert not plan.is_valid_for(cache, seq=3)
    swapped = latent()
    assert plan.validity_for(swapped, shape_key=("llama", 8)) is ST   # stale wins
    with pytest.raises(TypeError, match="KvRebindSource"):
        plan.validity_for("cache")


# ------------------------------------------------------------------------------------ rebind
@pytest.mark.parametrize("make", [latent, static], ids=["latent", "static"])
def test_same_geometry_swap_is_rebound(make, rng):
    a, b = make(), make()
    step(a, rng, 2)
    step(b, rng, 3)
    plan = kc.rebind.DecodePlan.build(a, shape_key="m")
    assert plan.validity_for(b) is AC
    plan.rebind_kv(b)
    assert plan.alloc_id == b.alloc_id and plan.validity_for(b) is V
    assert plan.validity_for(a) is AC                 # now welded to b
    for la in range(b.n_layers):
        for w in (0, 1):
            assert plan.storage(la, w) is b.slot_storage(la, w)
            assert not np.shares_memory(plan.storage(la, w), a.slot_storage(la, w))
    # a decode step through the plan's bindings lands in b, not in a
    a_bytes = [a.slot_storage(la, 0).tobytes() for la in range(a.n_layers)]
    row = b.cached_len
    for la in range(b.n_layers):
        buf = plan.storage(la, 0)
        if isinstance(b, kc.LatentKvCache):
            buf[row] = 7.0
        else:
            buf[:, :, row] = 7.0
    b.advance(1)
    for la in range(b.n_layers):
        view = b.valid_view(la, 0)
        assert (view[row] if isinstance(b, kc.LatentKvCache) else view[:, :, row]).min() == 7.0
    assert [a.slot_storage(la, 0).tobytes() for la in range(a.n_layers)] == a_bytes


@pytest.mark.parametrize("make", [latent, static], ids=["latent", "static"])
@pytest.mark.parametrize("keep", [2, 0], ids=["truncated", "truncated-to-0"])
def test_truncated_caches_keep_or_rebind_the_plan(make, keep, rng):
    """truncate_last keeps alloc_id: the plan's own cache stays VALID (re-binding onto it is a
    no-op), and a plan moves onto *another* same-geometry cache that was truncated like any
    swap, then decodes into that cache's rows from the truncated position on."""
    a, b = make(), make()
    plan = kc.rebind.DecodePlan.build(a, shape_key="m")
    step(a, rng, 3)
    a.truncate_last(a.cached_len - keep)
    assert plan.validity_for(a) is V
    before = plan_state(plan)
    plan.rebind_kv(a)                                  # onto its own truncated cache
    assert plan_state(plan) == before and plan.validity_for(a) is V
    step(b, rng, 5)
    b.truncate_last(b.cached_len - keep)
    assert b.cached_len == keep
    assert plan.validity_for(b) is AC
    plan.rebind_kv(b)
    assert plan.validity_for(b) is V and plan.validity_for(a) is AC
    assert plan.alloc_id == b.alloc_id
    for la in range(b.n_layers):
        for w in (0, 1):
            assert plan.storage(la, w) is b.slot_storage(la, w)
    a_bytes = [a.slot_storage(la, w).tobytes() for la in range(a.n_layers) for w in (0, 1)]
    step(b, rng)                                       # overwrites row `keep` of b
    assert b.cached_len == keep + 1 and plan.validity_for(b) is V
    for la in range(b.n_layers):
        got = b.valid_view(la, 0)
        row = got[keep] if isinstance(b, kc.LatentKvCache) else got[:, :, keep]
        bound = plan.storage(la, 0)
        mine = bound[keep] if isinstance(b, kc.LatentKvCache) else bound[:, :, keep]
        np.testing.assert_array_equal(row, mine)      # the plan sees b's new row
    assert [a.slot_storage(la, w).tobytes() for la in range(a.n_layers)
            for w in (0, 1)] == a_bytes                # a untouched


def test_rebind_onto_the_same_cache_is_a_noop():
    cache = latent()
    plan = kc.rebind.DecodePlan.build(cache)
    before = plan_state(plan)
    plan.rebind_kv(cache)
    assert plan_state(plan) == before


def test_cleared_latent_cache_is_refused_as_missing_slot():
    cache = latent()
    plan = kc.rebind.DecodePlan.build(cache)
    before = plan_state(plan)
    cache.clear()
    assert plan.validity_for(cache) is AC             # the id was re-minted
    with pytest.raises(kc.RebindRefused, match="missing slot") as info:
        plan.rebind_kv(cache)
    err = info.value
    assert err.reason is kc.rebind.RebindRefusal.MISSING_SLOT and (err.layer, err.which) == (0, 0)
    assert plan_state(plan) == before


def test_cleared_static_cache_is_refused_as_residency_unknown():
    cache = static()
    plan = kc.rebind.DecodePlan.build(cache)
    before = plan_state(plan)
    cache.clear()
    assert plan.validity_for(cache) is AC
    with pytest.raises(kc.RebindRefused, match="residency unknown") as info:
        plan.rebind_kv(cache)
    assert info.value.reason is kc.rebind.RebindRefusal.RESIDENCY_UNKNOWN
    assert info.value.incoming is None and info.value.layer is None
    assert plan_state(plan) == before


def test_incompatible_static_swap_is_refused_not_rebound():
    a = static(nkv=2)
    b = static(nkv=4)                                  # double the KV heads, same max_seq_len
    plan = kc.rebind.DecodePlan.build(a, shape_key="m")
    before = plan_state(plan)
    assert plan.validity_for(b) is AC                  # geometry of the model unchanged
    with pytest.raises(kc.RebindRefused, match="storage differs") as info:
        plan.rebind_kv(b)
    err = info.value
    assert err.reason is kc.rebind.RebindRefusal.STORAGE_DIFFERS
    assert (err.layer, err.which) == (0, 0)
    assert err.baked.shape == (1, 2, 8, 4) and err.incoming.shape == (1, 4, 8, 4)
    assert err.incoming.nbytes == 2 * err.baked.nbytes and err.baked.backend == "cpu"
    assert "(1, 4, 8, 4)" in str(err)
    assert plan_state(plan) == before
    assert plan.validity_for(a) is V


def test_latent_swap_of_another_trailing_shape_is_refused():
    a, b = latent(trailing=[[5], [2]]), latent(trailing=[[6], [2]])
    plan = kc.rebind.DecodePlan.build(a)
    before = plan_state(plan)
    assert plan.validity_for(b) is AC
    with pytest.raises(kc.RebindRefused) as info:
        plan.rebind_kv(b)
    assert info.value.reason is kc.rebind.RebindRefusal.STORAGE_DIFFERS
    assert (info.value.layer, info.value.which) == (0, 0)
    assert plan_state(plan) == before


def test_refusal_in_a_late_layer_changes_nothing():
    a, b = latent(), latent()
    b.layers[2][1].storage = np.zeros((8, 3), np.float32)   # one odd slot, in the last layer
    plan = kc.rebind.DecodePlan.build(a)
    before = plan_state(plan)
    with pytest.raises(kc.RebindRefused) as info:
        plan.rebind_kv(b)
    assert info.value.reason is kc.rebind.RebindRefusal.STORAGE_DIFFERS
    assert (info.value.layer, info.value.which) == (2, 1)
    assert plan_state(plan) == before                 # layers 0 and 1 were not swapped
    assert plan.storage(0, 0) is a.slot_storage(0, 0)
    b.layers[2][1].storage = np.zeros((16, 2), np.float32)[::2]   # same shape, strided
    with pytest.raises(kc.RebindRefused, match="strided"):
        plan.rebind_kv(b)
    b.layers[2][1].storage = np.zeros((8, 2), np.float64)
    with pytest.raises(kc.RebindRefused, match="float64"):
        plan.rebind_kv(b)
    assert plan_state(plan) == before
    b.layers[2][1].storage = np.zeros((8, 2), np.float32)  # interchangeable again
    plan.rebind_kv(b)
    assert plan.storage(2, 1) is b.layers[2][1].storage and plan.alloc_id == b.alloc_id


def test_residency_checks_come_first():
    cache = latent()
    plan = kc.rebind.DecodePlan.build(cache)
    before = plan_state(plan)
    moved = Relocated(latent(), "cuda:0")
    with pytest.raises(kc.RebindRefused, match="residency differs") as info:
        plan.rebind_kv(moved)
    err = info.value
    assert err.reason is kc.rebind.RebindRefusal.RESIDENCY_DIFFERS
    assert (err.baked, err.incoming) == ("cpu", "cuda:0")
    cleared = latent()
    cleared.clear()                                   # no slots, but residency is checked first
    with pytest.raises(kc.RebindRefused) as info:
        plan.rebind_kv(Relocated(cleared, None))
    assert info.value.reason is kc.rebind.RebindRefusal.RESIDENCY_UNKNOWN
    assert plan_state(plan) == before
    # a plan built on a source of unprovable residency can never be re-bound
    blind = kc.rebind.DecodePlan.build(Relocated(cache, None))
    assert blind.kv_location is None
    with pytest.raises(kc.RebindRefused, match="the plan cannot prove") as info:
        blind.rebind_kv(latent())
    assert info.value.reason is kc.rebind.RebindRefusal.RESIDENCY_UNKNOWN
    assert info.value.incoming == "cpu"


def test_unbaked_slot_is_refused():
    cache = latent()
    plan = kc.rebind.DecodePlan.build(cache)
    del plan._bound[(1, 1)]                           # no public way to lose a binding
    before = plan_state(plan)
    with pytest.raises(kc.RebindRefused, match="unbaked slot") as info:
        plan.rebind_kv(latent())
    assert info.value.reason is kc.rebind.RebindRefusal.UNBAKED_SLOT
    assert (info.value.layer, info.value.which) == (1, 1)
    assert plan_state(plan) == before


def test_decode_loop_with_refresh(rng):
    """The per-token decision of a server loop: keep, re-bind, or drop and rebuild."""
    def refresh(plan, cache):
        v = plan.validity_for(cache)
        if v is V:
            return plan, "kept"
        if v is AC:
            try:
                plan.rebind_kv(cache)
                return plan, "rebound"
            except kc.RebindRefused as err:
                return None, f"dropped:{err.reason.name}"
        return None, "dropped:STALE"

    a, b, c = latent(), latent(), latent(max_seq_len=16)
    plan = kc.rebind.DecodePlan.build(a)
    log = []
    for cache in (a, a, b, "clear b", c, c):
        if isinstance(cache, str):
            b.clear()
            cache = b
        plan, what = refresh(plan, cache)
        log.append(what)
        if plan is None:
            if cache is b:                             # a cleared cache: start a new one
                plan = kc.rebind.DecodePlan.build(a)
                continue
            plan = kc.rebind.DecodePlan.build(cache)
        step(cache, rng)
    assert log == ["kept", "kept", "rebound", "dropped:MISSING_SLOT", "dropped:STALE", "kept"]


def test_fingerprint_of_arrays():
    a = np.zeros((8, 5), np.float32)
    f = StorageFingerprint.of(a)
    assert f == ("cpu", "float32", (8, 5), 160, True)
    assert StorageFingerprint.of(np.zeros((8, 5), np.float32)) == f
    assert StorageFingerprint.of(np.zeros((8, 5), np.float16)) != f
    assert StorageFingerprint.of(np.zeros((5, 8), np.float32)) != f
    assert StorageFingerprint.of(memoryview(a)).backend == "builtins.memoryview"
