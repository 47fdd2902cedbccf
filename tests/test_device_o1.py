"""A device mirror of the O(1) decode step, built from O1DeviceView alone (spec 6.4 and 6.6).

What a GPU port does: take every array of ``LayerKvCache.o1_views()`` through DLPack (no copy)
and run the step in torch.  Here torch runs on the CPU, in float64, and its output and post-step
state are compared with the compiled float32 kernel, step after step, until the ring has wrapped
more than twice.  A step inserts first and attends second: the key leaving the full ring is
absorbed into the far field, the new key takes its slot, and the output reads sinks, the ring
in slot order and the far field.

Tolerance: the kernel works in float32 (dots of d = 16 products with FMAs, exp within 1.42
ulp, sums of sink + w + m_eff terms); torch works in float64 on the same float32 state, so
the difference is the kernel's rounding.  Errors are relative to the largest magnitude of the
compared quantity (scale-free).  Measured worst over 40 steps: outputs 9e-7, t_hat and z_hat
1.1e-7, m_max 5e-8; ring rows and counters are exact.  TOL = 1e-5 leaves 10x headroom for
another CPU or BLAS, and each sabotage of the step misses by more than 100 TOL (measured
0.19 and up).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import kvcache as kc  # noqa: E402  (after the skip: the module is pointless without torch)

H, G, D = 4, 2, 16                    # query heads, KV groups, head_dim (= dv)
M, W, SINK, P = 8, 16, 4, 96          # P > W + SINK + 8: sealed as a skeleton, m_eff = M
STEPS = 40                            # > 2 W: the ring wraps, every step evicts to the far field
TOL = 1e-5
SABOTAGE = ("mu transposed", "no far absorb", "attend before insert", "no rectifier")

_SCALARS = ("m_eff", "w", "sink_len", "d", "dv", "exact_only", "scale", "win_len", "win_head",
            "far_len")
_GROUP = ("win_k", "win_v", "sink_k", "sink_v", "k_tilde")
_HEAD = ("t_hat", "z_hat", "m_max", "q_tilde", "mu")
_F64 = torch.float64


def prompt_and_steps(rng, data, n):
    """q (P + n, H, D), k and v (P + n, G, D) float32.

    "clustered": keys near M per-group centres (segments of the prompt, then cycling), queries
    near the same centres, standard-normal values (the upstream fixture's regime, spec 9); the
    far denominator stays positive, FM clamps about half of u.  "wide": q and k ~ 3 N(0, 1),
    v ~ 2 U(0, 1); the aggregate rectifier drops the far field in about half the head-steps."""
    if data == "wide":
        q = 3 * rng.standard_normal((P + n, H, D))
        k = 3 * rng.standard_normal((P + n, G, D))
        v = 2 * rng.random((P + n, G, D))
    else:
        cen = 0.6 * rng.standard_normal((G, M, D))
        pos = np.arange(P + n)
        c = np.where(pos < P, pos * M // P, pos % M)                       # (P+n,) centre index
        near = cen[:, c].transpose(1, 0, 2)                                # (P+n, G, D)
        k = near + 0.02 * rng.standard_normal((P + n, G, D))
        q = np.repeat(near, H // G, axis=1) + 0.5 * rng.standard_normal((P + n, H, D))
        v = rng.standard_normal((P + n, G, D))
    return q.astype(np.float32), k.astype(np.float32), v.astype(np.float32)


def sealed(q, k, v, rect):
    """A layer sealed, in skeleton mode, on positions [0, P)."""
    layer = kc.LayerKvCache(G, D, mode=kc.KvMode.F32)
    layer.o1_begin(M, W, SINK, rect)
    layer.o1_push_q(q[:P])
    layer.append(k[:P], v[:P])
    assert layer.o1_seal(H) and not layer.o1.exact_only
    return layer


def dl(arr):
    """The torch tensor over a view's memory, through DLPack; asserts no copy was made.

    torch does not keep the view's read-only flag: writing through this tensor would change the
    layer's state, hence the clones in :func:`mirror`."""
    t = torch.from_dlpack(arr)
    assert t.dtype == torch.float32 and tuple(t.shape) == arr.shape
    if arr.size:
        assert t.data_ptr() == arr.ctypes.data, "from_dlpack copied the view"
    return t


def mirror(views):
    """Cloned torch copies (float32) of every group's arrays and its scalars.

    The views are live: o1_step rewrites the ring and the far accumulators under them, so the
    pre-step state must be copied before the step."""
    groups = []
    for view in views:
        g = {name: getattr(view, name) for name in _SCALARS}
        g.update((name, dl(getattr(view, name)).clone()) for name in _GROUP)
        g["heads"] = [dict(rect_fm=hv.rect_fm,
                           **{name: dl(getattr(hv, name)).clone() for name in _HEAD})
                      for hv in view.heads]
        groups.append(g)
    return groups


def torch_step(groups, q, k_new, v_new, sabotage=None):
    """One decode step of every head from the mirrored state, float64 (spec 6.4).

    q (H, D), k_new and v_new (G, D) float32 tensors.  Returns the outputs (H, dv), every
    group's post-step state in the layout of :func:`mirror`, and how many heads the aggregate
    rectifier cut off from their far field.  ``sabotage`` names one deliberate bug (SABOTAGE)."""
    outs, post, dropped = [], [], 0
    hpk = len(groups[0]["heads"])
    for gi, g in enumerate(groups):
        assert not g["exact_only"] and g["win_len"] == g["w"]      # full ring: every step evicts
        s = g["scale"]                      # 1/sqrt(d) rounded to float32, exact in float64
        slot = g["win_head"]
        k_old, v_old = g["win_k"][slot].to(_F64), g["win_v"][slot].to(_F64)
        win_k, win_v = g["win_k"].clone(), g["win_v"].clone()
        win_k[slot], win_v[slot] = k_new[gi], v_new[gi]
        read_k, read_v = win_k, win_v
        if sabotage == "attend before insert":
            read_k, read_v = g["win_k"], g["win_v"]
        keys = torch.cat([g["sink_k"], read_k]).to(_F64)           # (sink + w, d) sinks, then slots
        vals = torch.cat([g["sink_v"], read_v]).to(_F64)
        far_len = g["far_len"] + 1
        heads = []
        for hi, head in enumerate(g["heads"]):
            qh = q[gi * hpk + hi].to(_F64)
            t_hat, z_hat, m_max = (head[name].to(_F64) for name in ("t_hat", "z_hat", "m_max"))
            if sabotage != "no far absorb":
                # the evicted row enters the far field under a per-landmark running max
                l = s * (head["q_tilde"].to(_F64) @ k_old)         # (m,)
                up = l > m_max
                r = torch.exp(m_max - l)                           # 0 where m_max is still -inf
                z_hat = torch.where(up, z_hat * r, z_hat)
                t_hat = torch.where(up[:, None], t_hat * r[:, None], t_hat)
                m_max = torch.maximum(m_max, l)
                e = torch.exp(l - m_max)
                z_hat = z_hat + e
                t_hat = t_hat + e[:, None] * v_old
            sc = s * (keys @ qh)                                   # (sink + w,)
            c_all = sc.max()
            num = torch.zeros(g["dv"], dtype=_F64)
            den = torch.zeros((), dtype=_F64)
            if far_len > 0 and g["m_eff"] > 0:
                fa = s * (g["k_tilde"].to(_F64) @ qh)              # (m,)
                f = fa.max()
                mu = head["mu"].to(_F64)
                fh = torch.exp(fa - f)
                u = mu @ fh if sabotage == "mu transposed" else fh @ mu   # u_b = sum_a fh_a M[a, b]
                if head["rect_fm"] and sabotage != "no rectifier":
                    u = u.clamp(min=0)
                c_all = torch.maximum(c_all, (f + m_max).max())
                gain = u * torch.exp(f + m_max - c_all)
                far_den = gain @ z_hat
                if far_den >= 0 or sabotage == "no rectifier":   # the aggregate rectifier
                    den, num = far_den, gain @ t_hat
                else:
                    dropped += 1
            p = torch.exp(sc - c_all)
            outs.append((num + p @ vals) / torch.clamp(den + p.sum(), min=1e-30))
            heads.append(dict(t_hat=t_hat, z_hat=z_hat, m_max=m_max))
        post.append(dict(win_k=win_k, win_v=win_v, win_len=g["w"], win_head=(slot + 1) % g["w"],
                         far_len=far_len, heads=heads))
    return torch.stack(outs), post, dropped


def rel_err(got, want):
    """max |got - want| / max |want| in float64 (scale-free: t_hat and z_hat sit at scale
    exp(-m_max) per landmark, the outputs at the scale of the values)."""
    got, want = got.to(_F64), want.to(_F64)
    return float((got - want).abs().max() / want.abs().max().clamp(min=1e-30))


def state_errors(want, groups):
    """Per-field worst relative error of a computed post-step state against a mirror of the
    layer's views; ring rows and counters must match exactly."""
    errs = {"t_hat": 0.0, "z_hat": 0.0, "m_max": 0.0}
    for w_g, g in zip(want, groups):
        counts = ("win_len", "win_head", "far_len")
        assert [g[name] for name in counts] == [w_g[name] for name in counts]
        assert torch.equal(g["win_k"], w_g["win_k"]) and torch.equal(g["win_v"], w_g["win_v"])
        for w_h, h in zip(w_g["heads"], g["heads"]):
            for name in errs:
                errs[name] = max(errs[name], rel_err(h[name], w_h[name]))
    return errs


def steps_in_torch(layer, q, k, v, sabotage=None):
    """Run o1_step over positions [P, len(q)), each step mirrored in torch from views read just
    before it.  Returns the worst relative errors (outputs and far accumulators; ring rows and
    counters are asserted exact) and the number of heads the torch step saw dropped."""
    worst = {"out": 0.0, "t_hat": 0.0, "z_hat": 0.0, "m_max": 0.0}
    dropped = 0
    pre = mirror(layer.o1_views())
    for i in range(P, q.shape[0]):
        qkv = (torch.from_numpy(x[i]) for x in (q, k, v))
        want, want_state, n = torch_step(pre, *qkv, sabotage)
        dropped += n
        out = layer.o1_step(q[i], k[i], v[i], H)
        worst["out"] = max(worst["out"], rel_err(torch.from_numpy(out), want))
        pre = mirror(layer.o1_views())      # this step's post-state is the next step's input
        for name, err in state_errors(want_state, pre).items():
            worst[name] = max(worst[name], err)
    return worst, dropped


@pytest.mark.parametrize("data", ["clustered", "wide"])
@pytest.mark.parametrize("rect", [kc.O1Rect.AGGREGATE, kc.O1Rect.FM])
def test_torch_step_from_device_views_matches_o1_step(rng, rect, data):
    q, k, v = prompt_and_steps(rng, data, STEPS)
    layer = sealed(q, k, v, rect)
    views = layer.o1_views()
    assert len(views) == G and all(len(view.heads) == H // G for view in views)
    assert views[0].far_len == P - SINK - W and views[0].m_eff == M
    ptr = dl(views[-1].heads[-1].t_hat).data_ptr()
    worst, dropped = steps_in_torch(layer, q, k, v)
    assert max(worst.values()) <= TOL, worst
    # the rectifier branch is exercised where it should be (FM never drops: u >= 0, Z >= 0)
    assert (dropped > 0) == (data == "wide" and rect is kc.O1Rect.AGGREGATE)
    views = layer.o1_views()
    assert views[0].far_len == P + STEPS - SINK - W
    # the state is updated in place: a device mirror can bind its buffers once
    assert dl(views[-1].heads[-1].t_hat).data_ptr() == ptr


@pytest.mark.parametrize("sabotage", SABOTAGE)
@pytest.mark.parametrize("rect", [kc.O1Rect.AGGREGATE, kc.O1Rect.FM])
def test_sabotaged_torch_step_is_caught(rng, rect, sabotage):
    """The comparison has teeth: each plausible porting bug misses by far more than TOL.

    Over a few steps of the "wide" data, where the rectifiers act and every part matters (one
    step alone may hide a bug: a peaked softmax can make the evicted key irrelevant)."""
    q, k, v = prompt_and_steps(rng, "wide", 8)
    worst, _ = steps_in_torch(sealed(q, k, v, rect), q, k, v, sabotage)
    assert max(worst.values()) > 1e2 * TOL, worst
