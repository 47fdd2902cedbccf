"""The O(1) seal's error estimate (o1_error, max_error), the kept keys and the ridge option,
and the runner's o1_layers="auto" (docs/o1.md: error estimate, kept keys, ridge)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import kvcache as kc
from kvcache import LayerKvCache
from kvcache import reference as R
from kvcache.bench.geometry import Geometry
from kvcache.bench.o1 import SyntheticStream
from kvcache.o1 import O1Collecting, O1Error, O1Sealed, select_kept
from kvcache.runner import Runner
from kvcache.runner.weights import random_weights

GEOM = Geometry("test", "test", 4, 2, 32)       # 4 query heads, 2 KV heads of 32


def _layer(q: np.ndarray, k: np.ndarray, v: np.ndarray, p: int, m: int = 16, w: int = 64,
           sink: int = 4, **kw: object) -> LayerKvCache:
    """A collecting layer holding the first p positions (q (t, H, d), k/v (t, G, d))."""
    layer = LayerKvCache(k.shape[1], k.shape[2], "f32")
    layer.o1_begin(m, w, sink, **kw)  # type: ignore[arg-type]
    layer.o1_push_q(q[:p].astype(np.float32))
    layer.append(k[:p].astype(np.float32), v[:p].astype(np.float32))
    return layer


def _gauss(seed: int, t: int = 360, h: int = 4, g: int = 2, d: int = 16) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((t, h, d))
    k = rng.standard_normal((t, g, d))
    k[:, :, 0] += 3.0 * np.sin(np.arange(t) / 25.0)[:, None]          # some structure
    v = rng.standard_normal((t, g, d))
    return q, k, v


def _exact(q: np.ndarray, k: np.ndarray, v: np.ndarray, p: int, n: int) -> np.ndarray:
    """Exact causal attention of positions p .. p+n-1, float64 (n, H, d)."""
    H, G, d = q.shape[1], k.shape[1], q.shape[2]
    s = float(np.float32(1.0) / np.sqrt(np.float32(d)))
    out = np.empty((n, H, v.shape[2]))
    for i in range(p, p + n):
        for h in range(H):
            sc = s * (k[: i + 1, h // (H // G)].astype(np.float64) @ q[i, h])
            e = np.exp(sc - sc.max())
            out[i - p, h] = e @ v[: i + 1, h // (H // G)] / e.sum()
    return out


def _real_error(layer: LayerKvCache, q: np.ndarray, k: np.ndarray, v: np.ndarray, p: int,
                n: int) -> float:
    H = q.shape[1]
    got = np.stack([layer.o1_step(q[i].astype(np.float32), k[i].astype(np.float32),
                                  v[i].astype(np.float32), H) for i in range(p, p + n)])
    ref = _exact(q, k, v, p, n)
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def _spearman(a: list[float], b: list[float]) -> float:
    ra = np.argsort(np.argsort(a)).astype(float)
    rb = np.argsort(np.argsort(b)).astype(float)
    return float(np.corrcoef(ra, rb)[0, 1])


# ------------------------------------------------------------------------ the estimate itself
@pytest.mark.parametrize("keep,ridge,rect", [(0, 1e-6, "agg"), (24, 1e-6, "agg"),
                                             (24, 1e-3, "fm"), (0, 1e-2, "agg")])
def test_estimate_matches_its_definition(keep: int, ridge: float, rect: str) -> None:
    q, k, v = _gauss(1)
    p = 340
    layer = _layer(q, k, v, p, keep=keep, ridge=ridge, rect=rect)
    assert layer.o1_error() is None                          # collecting: nothing estimated
    assert layer.o1_seal(4)
    err = layer.o1_error()
    assert isinstance(err, O1Error) and err.queries == 16 and err.t == p
    per_head, overall = R.o1_error_estimate(q, k, v, p, 16, 64, 4, rect=rect, keep=keep,
                                            ridge=ridge)
    # the layer reads the float32-stored state; the reference is float64 throughout
    np.testing.assert_allclose(err.per_head, per_head, rtol=2e-3, atol=1e-5)
    assert err.overall == pytest.approx(overall, rel=2e-3, abs=1e-5)
    assert "estimated relative error" in str(err)


def test_estimate_of_an_exact_only_seal_is_zero() -> None:
    q, k, v = _gauss(2, t=60)
    layer = _layer(q, k, v, 60)                   # 60 <= w + sink + 8: exact-only
    assert layer.o1_seal(4, max_error=1e-9)       # an exact seal is never refused
    err = layer.o1_error()
    assert err is not None and err.overall == 0.0 and err.per_head == (0.0,) * 4


def test_estimate_is_cleared_with_the_state() -> None:
    q, k, v = _gauss(3)
    layer = _layer(q, k, v, 340)
    assert layer.o1_seal(4)
    assert layer.o1_error() is not None
    layer.clear()
    assert layer.o1_error() is None


# ------------------------------------------------------------------- it tracks the real error
def _kinds() -> list[tuple[str, np.ndarray, np.ndarray, np.ndarray]]:
    cases = []
    for kind in ("clustered", "switch", "iid"):
        for seed in (0, 1):
            q, k, v = SyntheticStream(GEOM, kind, seed=seed, block=1024).rows(0, 1024 + 48)
            cases.append((f"{kind}{seed}", q, k, v))
    # sharper attention (queries scaled up) and a near-copy task
    q, k, v = SyntheticStream(GEOM, "clustered", seed=2, block=1024).rows(0, 1024 + 48)
    cases.append(("sharp", 3.0 * q, k, v))
    rng = np.random.default_rng(5)
    t = 1024 + 48
    k2 = rng.standard_normal((t, 2, 32)).astype(np.float32)
    q2 = np.repeat(k2[rng.integers(0, t // 2, t)], 2, axis=1) * np.float32(0.6)
    v2 = rng.standard_normal((t, 2, 32)).astype(np.float32)
    cases.append(("lookup", q2, k2, v2))
    return cases


def test_estimate_tracks_the_real_error_over_data_kinds() -> None:
    est, real = [], []
    for _name, q, k, v in _kinds():
        layer = _layer(q, k, v, 1024, m=32, w=128, sink=4)
        assert layer.o1_seal(4)
        e = layer.o1_error()
        assert e is not None
        est.append(e.overall)
        real.append(_real_error(layer, q, k, v, 1024, 48))
    assert _spearman(est, real) >= 0.7, (est, real)
    # not only the order: each estimate is within a factor of two of the error it predicts
    for got, want in zip(est, real):
        assert 0.5 * want <= got <= 2.0 * want, (est, real)
    # the topic that changes every token is flagged far above clustered data
    names = [c[0] for c in _kinds()]
    assert min(est[i] for i, n in enumerate(names) if n.startswith("switch")) > \
        3 * max(est[i] for i, n in enumerate(names) if n.startswith("clustered"))


# ---------------------------------------------------------------------------- max_error
def test_refused_seal_leaves_the_layer_bit_exact(caplog: pytest.LogCaptureFixture) -> None:
    q, k, v = SyntheticStream(GEOM, "switch", seed=0, block=1024).rows(0, 1024 + 8)
    layer = _layer(q, k, v, 1024, m=32, w=128, sink=4)
    plain = LayerKvCache(2, 32, "f32")
    plain.append(k[:1024], v[:1024])
    with caplog.at_level(logging.WARNING, logger="kvcache"):
        assert layer.o1_seal(4, max_error=0.2) is False
    assert "seal refused" in caplog.text and "max_error=0.2" in caplog.text
    assert layer.o1 is None and not layer.o1_sealed()
    err = layer.o1_error()
    assert err is not None and err.overall > 0.2           # still there, to say why
    a, b = layer.state(), plain.state()
    assert a.seq_len == b.seq_len == 1024
    np.testing.assert_array_equal(a.lengths, b.lengths)
    assert a.kf is not None and b.kf is not None and a.vf is not None and b.vf is not None
    np.testing.assert_array_equal(a.kf[:, :1024], b.kf[:, :1024])
    np.testing.assert_array_equal(a.vf[:, :1024], b.vf[:, :1024])
    for i in range(1024, 1032):                             # and it keeps decoding exactly
        layer.append(k[i], v[i])
        plain.append(k[i], v[i])
        np.testing.assert_array_equal(layer.attend_all_heads(q[i]), plain.attend_all_heads(q[i]))


def test_seal_under_the_bound_is_kept() -> None:
    q, k, v = SyntheticStream(GEOM, "clustered", seed=0, block=1024).rows(0, 1024)
    layer = _layer(q, k, v, 1024, m=32, w=128, sink=4)
    assert layer.o1_seal(4, max_error=float("inf"))
    assert isinstance(layer.o1, O1Sealed)
    err = layer.o1_error()
    assert err is not None and err is layer.o1.error


@pytest.mark.parametrize("bad,exc", [(0, ValueError), (-0.1, ValueError),
                                     (float("nan"), ValueError), ("0.1", TypeError),
                                     (True, TypeError), ([0.1], TypeError)])
def test_bad_max_error_is_a_clear_error(bad: object, exc: type) -> None:
    q, k, v = _gauss(4)
    layer = _layer(q, k, v, 340)
    with pytest.raises(exc, match="max_error"):
        layer.o1_seal(4, max_error=bad)  # type: ignore[arg-type]
    assert isinstance(layer.o1, O1Collecting)               # unchanged: still collecting
    assert layer.o1_seal(4)


# ------------------------------------------------------------------- kept keys and ridge
def test_kept_keys_match_their_definition() -> None:
    q, k, v = _gauss(6)
    p = 340
    layer = _layer(q, k, v, p, keep=20)
    coll = layer.o1
    assert isinstance(coll, O1Collecting)
    got = select_kept(coll.trace.reshape(p, 4, 16), layer.state().kf,  # type: ignore[arg-type]
                      t=p, sink=4, w=64, keep=20, scale=0.25)
    np.testing.assert_array_equal(got, R.kept_keys(q, k, p, 64, 4, 20))
    assert layer.o1_seal(4)
    st = layer.o1
    assert isinstance(st, O1Sealed)
    assert st.keep == 20 and st.sink_len == 24 and st.far_len == p - 64 - 24
    np.testing.assert_array_equal(st.sink_k[1, 4:], k[got[1], 1].astype(np.float32))


@pytest.mark.parametrize("keep,ridge", [(20, 1e-6), (20, 1e-3), (400, 1e-6)])
def test_steps_match_the_float64_stream(keep: int, ridge: float) -> None:
    q, k, v = _gauss(7)
    p = 340
    layer = _layer(q, k, v, p, keep=keep, ridge=ridge)
    assert layer.o1_seal(4)
    got = np.stack([layer.o1_step(q[i].astype(np.float32), k[i].astype(np.float32),
                                  v[i].astype(np.float32), 4) for i in range(p, 360)])
    ref = R.nystrom_stream(q, k, v, p, 16, 64, 4, keep=keep, ridge=ridge)
    np.testing.assert_allclose(got, ref, atol=3e-4)
    # a snapshot/restore round trip and the wire both keep the kept rows
    st = layer.o1
    assert isinstance(st, O1Sealed) and st.keep == min(keep, p - 64 - 4)


def test_keep_and_ridge_travel_through_the_wire() -> None:
    q, k, v = _gauss(8)
    layer = _layer(q, k, v, 340, keep=16, ridge=1e-3)
    assert layer.o1_seal(4)
    copy = LayerKvCache(2, 16, "f32")
    copy.install_bytes(layer.to_bytes())
    for i in range(340, 350):
        a = layer.o1_step(q[i], k[i], v[i], 4)
        b = copy.o1_step(q[i], k[i], v[i], 4)
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kw,exc", [({"keep": -1}, ValueError), ({"keep": 1.5}, TypeError),
                                    ({"ridge": 0.0}, ValueError), ({"ridge": 2.0}, ValueError),
                                    ({"ridge": float("nan")}, ValueError),
                                    ({"ridge": "1e-3"}, TypeError)])
def test_bad_keep_or_ridge(kw: dict[str, object], exc: type) -> None:
    layer = LayerKvCache(2, 16, "f32")
    with pytest.raises(exc):
        layer.o1_begin(16, 64, 4, **kw)  # type: ignore[arg-type]
    assert layer.o1 is None


def test_kept_keys_and_ridge_lower_the_error_on_clustered_data() -> None:
    q, k, v = SyntheticStream(GEOM, "clustered", seed=3, block=1024).rows(0, 1024 + 48)
    errs = {}
    for keep, ridge in ((0, 1e-6), (64, 1e-3)):
        layer = _layer(q, k, v, 1024, m=32, w=128, sink=4, keep=keep, ridge=ridge)
        assert layer.o1_seal(4)
        errs[keep] = _real_error(layer, q, k, v, 1024, 48)
    assert errs[64] < errs[0], errs


# -------------------------------------------------------------------------- the runner
def _sharp_random(**kw: object) -> Runner:
    """The random model with its q/k projections scaled by 4: random, peaked attention (the
    plain random model attends almost uniformly, which O(1) reproduces well)."""
    base = Runner.random()
    w = random_weights(base.config, 0)
    w = {k: (a * np.float32(4) if ("q_proj" in k or "k_proj" in k) else a) for k, a in w.items()}
    return Runner(base.config, w, **kw)  # type: ignore[arg-type]


def test_runner_auto_refuses_on_random_data() -> None:
    ids = np.random.default_rng(0).integers(0, 512, 300)
    assert Runner.random(o1_layers="auto").o1_params == (32, 128, 4, 128, 1e-3)  # O1_AUTO_PARAMS
    assert Runner.random(o1_layers="all").o1_params == (32, 128, 4)
    # (with 128 kept keys, most of a 300-token prompt would stay exact: the plain operator)
    auto = _sharp_random(o1_layers="auto", o1_params=(32, 128, 4))
    plain = _sharp_random()
    assert auto.o1_auto and auto.o1_max_error == pytest.approx(0.1)
    assert auto.o1_layers == tuple(range(4))
    la = auto.prefill(ids)
    lp = plain.prefill(ids)
    assert auto.o1_sealed_layers == ()                   # every estimate is above the bound
    for i in range(4):
        err = auto.cache.layers[i].o1_error()
        assert err is not None and err.overall > 0.1
    np.testing.assert_array_equal(la, lp)
    for tok in (5, 7, 11):
        np.testing.assert_array_equal(auto.step(tok), plain.step(tok))


def test_runner_bound_and_params() -> None:
    ids = np.random.default_rng(1).integers(0, 512, 300)
    r = Runner.random(o1_layers="all", o1_params=(16, 64, 4, 8, 1e-3), o1_max_error=np.inf)
    r.prefill(ids)
    assert r.o1_sealed_layers == (0, 1, 2, 3)
    st = r.cache.layers[0].o1
    assert isinstance(st, O1Sealed) and st.keep == 8
    with pytest.raises(ValueError, match="max_error"):
        Runner.random(o1_layers="auto", o1_max_error=-1.0)
    with pytest.raises(ValueError, match="o1_params"):
        Runner.random(o1_params=(16, 64, 4, 8, 1e-3, 1))
    with pytest.raises(ValueError, match="ridge"):
        Runner.random(o1_params=(16, 64, 4, 8, 0.0))


def test_a_collecting_layer_with_keep_or_ridge_is_refused_by_the_byte_format():
    """Format version 2 carries only the default seal options of a collecting layer: other
    keep/ridge values are refused in one line (the layer unchanged, still collecting), and
    once sealed the layer round-trips."""
    rng = np.random.default_rng(3)
    c = kc.LayerKvCache(2, 16)
    c.append(rng.standard_normal((60, 2, 16), dtype=np.float32),
             rng.standard_normal((60, 2, 16), dtype=np.float32))
    c.o1_begin(8, 16, 2, keep=4, ridge=1e-3)
    for _ in range(60):
        c.o1_push_q(rng.standard_normal((4, 16), dtype=np.float32))
    with pytest.raises(ValueError, match="keep=4, ridge=0.001"):
        c.to_bytes()
    assert not c.o1_sealed() and c.seq_len == 60
    assert c.o1_seal(4)
    d = kc.LayerKvCache(2, 16)
    d.install_bytes(c.to_bytes())
    q = rng.standard_normal((4, 16), dtype=np.float32)
    k, v = rng.standard_normal((2, 2, 16), dtype=np.float32)
    assert np.array_equal(c.o1_step(q, k, v, 4), d.o1_step(q, k, v, 4))
