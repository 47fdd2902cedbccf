"""The compiled kernels accept the common call without running Python code
(``_core._accept_call`` for attend_rows/attend_blocked, ``_O1.accept`` for o1_step) and ask
the checks of kvcache._entry about everything else.  These tests hold the two together: on
each variant of a good call below -- malformed ones and ones the checks pass only on their
slow path (numpy integers and floats, read-only queries, an ndarray subclass) -- the kernel
raises exactly what the check raises (type and message) and writes nothing, or, where the
check passes, runs and gives the bits of the plain call."""

from __future__ import annotations

import numpy as np
import pytest

import kvcache as kc
from kvcache import _core, _entry
from kvcache._attention import default_scale
from kvcache._entry import AttendCall, O1State, O1Step


class Sub(np.ndarray):
    """An ndarray subclass (the checks accept it; the fast acceptance leaves it to them)."""


def outcome(fn):
    """None when ``fn()`` returns, else the (type, message) of what it raised."""
    try:
        fn()
    except Exception as e:                                       # noqa: BLE001 (compared)
        return type(e), str(e)
    return None


def readonly(a):
    a = a.copy()
    a.flags.writeable = False
    return a


def big_endian(a):
    return a.astype(a.dtype.newbyteorder(">"))


def layer_rows(mode, rng, nkv=2, hd=16, n=50):
    layer = kc.LayerKvCache(nkv, hd, mode=mode)
    for start in range(0, n, 17):
        m = min(17, n - start)
        layer.append(rng.standard_normal((m, nkv, hd)).astype(np.float32),
                     rng.standard_normal((m, nkv, hd)).astype(np.float32))
    return layer, layer._rows()


def call_variants(q2, g0, nq, hd, blocked):
    """(name, changes to the call) -- each a single change of a good call."""
    f64 = q2.astype(np.float64)
    cases = [
        ("q float64", dict(q=f64)), ("q Fortran", dict(q=np.asfortranarray(q2))),
        ("q 1-D", dict(q=q2.reshape(-1))), ("q list", dict(q=q2.tolist())),
        ("q big-endian", dict(q=big_endian(q2))), ("q head_dim", dict(q=q2[:, :8].copy())),
        ("q read-only", dict(q=readonly(q2))), ("q subclass", dict(q=q2.copy().view(Sub))),
        ("q strided", dict(q=np.repeat(q2, 2, axis=1)[:, ::2])),
        ("out read-only", dict(out=readonly(np.zeros((nq, hd), np.float32)))),
        ("out shape", dict(out=np.zeros((nq + 1, hd), np.float32))),
        ("out float64", dict(out=np.zeros((nq, hd)))),
        ("out strided", dict(out=np.zeros((nq, 2 * hd), np.float32)[:, ::2])),
        ("out subclass", dict(out=np.zeros((nq, hd), np.float32).view(Sub))),
        ("imp read-only", dict(imp=readonly(np.zeros(50, np.float32)))),
        ("imp 2-D", dict(imp=np.zeros((1, 50), np.float32))),
        ("imp float64", dict(imp=np.zeros(50))),
        ("group_q0 int32", dict(group_q0=g0.astype(np.int32))),
        ("group_q0 length", dict(group_q0=g0[:-1].copy())),
        ("group_q0 start", dict(group_q0=g0 + 1)),
        ("group_q0 end", dict(group_q0=np.array([0, g0[1], nq - 1], np.intp))),
        ("group_q0 negative", dict(group_q0=np.array([0, nq + 10, nq], np.intp))),
        ("group_q0 per position", dict(group_q0=np.array([0, 5, nq], np.intp))),
        ("n_pos 0", dict(n_pos=0)), ("n_pos -1", dict(n_pos=-1)), ("n_pos 2**63", dict(n_pos=2 ** 63)),
        ("n_pos float", dict(n_pos=10.0)), ("n_pos bool", dict(n_pos=True)),
        ("n_pos str", dict(n_pos="10")), ("n_pos numpy", dict(n_pos=np.int64(10))),
        ("n_back -1", dict(n_back=-1)), ("n_back 2**63", dict(n_back=2 ** 63)),
        ("n_back numpy", dict(n_back=np.int32(10))),
        ("window -1", dict(window=-1)), ("window 2**62", dict(window=2 ** 62)),
        ("first -1", dict(first=-1)), ("first numpy", dict(first=np.uint8(0))),
        ("n_threads 0", dict(n_threads=0)), ("n_threads 2**31", dict(n_threads=2 ** 31)),
        ("n_threads 2**64", dict(n_threads=2 ** 64)), ("n_threads numpy", dict(n_threads=np.int32(1))),
        ("imp_mode 3", dict(imp_mode=3)), ("imp_mode -1", dict(imp_mode=-1)),
        ("imp_mode 1", dict(imp_mode=1)), ("imp_mode 0", dict(imp_mode=0)),
        ("imp_mode numpy", dict(imp_mode=np.int8(2))),
        ("scale str", dict(scale="x")), ("scale None", dict(scale=None)),
        ("scale float32", dict(scale=np.float32(0.25))), ("scale int", dict(scale=1)),
        ("softcap numpy", dict(softcap=np.float64(0.0))), ("softcap None", dict(softcap=None)),
    ]
    if not blocked:
        cases += [
            ("probs rows", dict(probs=np.zeros((nq + 1, 50), np.float32))),
            ("probs read-only", dict(probs=readonly(np.zeros((nq, 50), np.float32)))),
            ("probs float64", dict(probs=np.zeros((nq, 50)))),
            ("probs None", dict(probs=None)),
            ("probs 1-D", dict(probs=np.zeros(nq * 50, np.float32))),
        ]
    return cases


@pytest.mark.parametrize("mode", [kc.KvMode.F32, kc.KvMode.Q8()], ids=["f32", "q8"])
@pytest.mark.parametrize("blocked", [False, True], ids=["rows", "blocked"])
def test_attention_kernels_decide_as_the_check(rng, mode, blocked):
    layer, rows = layer_rows(mode, rng)
    nkv, hd, n_pos, hpk = 2, 16, 10, 2
    q3 = rng.standard_normal((n_pos, nkv * hpk, hd)).astype(np.float32)
    qk = q3.reshape(n_pos, nkv, hpk, hd).transpose(1, 0, 2, 3).reshape(nkv, n_pos * hpk, hd)
    q2 = np.ascontiguousarray(layer._queries(qk).reshape(nkv * n_pos * hpk, hd))
    nq = q2.shape[0]
    g0 = np.arange(nkv + 1, dtype=np.intp) * (n_pos * hpk)
    bound = _core.bind_rows(rows)
    kernel = _core.attend_blocked if blocked else _core.attend_rows

    def fresh(**change):
        call = AttendCall(q=q2, group_q0=g0, n_pos=n_pos, n_back=n_pos, window=0, first=0,
                          scale=default_scale(hd), softcap=0.0,
                          out=np.full((nq, hd), 7.0, np.float32),
                          imp=np.full(50, 3.0, np.float32), imp_mode=2, n_threads=1,
                          probs=None if blocked else np.full((nq, 50), 5.0, np.float32))
        return call._replace(**change)

    plain = fresh()
    kernel(bound, plain)
    for name, change in call_variants(q2, g0, nq, hd, blocked):
        call = fresh(**change)
        before = [np.array(a, copy=True) for a in (call.out, call.imp, call.probs)
                  if isinstance(a, np.ndarray)]
        want = outcome(lambda: _entry.check_call(rows, bound.shape, call, blocked))
        got = outcome(lambda: kernel(bound, call))
        assert got == want, name
        if want is not None:
            after = [np.asarray(a) for a in (call.out, call.imp, call.probs)
                     if isinstance(a, np.ndarray)]
            assert all(np.array_equal(a, b) for a, b in zip(before, after)), name
        elif name != "scale int":                  # the rest compute the plain call
            assert np.array_equal(np.asarray(call.out), plain.out), name


def test_attention_kernels_decide_rows_held_as_the_check(rng):
    """The rows each KV group holds are read at every call (the layer changes them in place):
    a count beyond the capacity or below zero is refused with the check's message."""
    layer, rows = layer_rows(kc.KvMode.F32, rng)
    bound = _core.bind_rows(rows)
    q2 = rng.standard_normal((4, 16)).astype(np.float32)
    call = AttendCall(q=q2, group_q0=np.array([0, 2, 4], np.intp), n_pos=1, n_back=1, window=0,
                      first=0, scale=0.25, softcap=0.0, out=np.zeros((4, 16), np.float32),
                      imp=np.zeros(50, np.float32), imp_mode=2, n_threads=1,
                      probs=np.zeros((4, 50), np.float32))
    saved = rows.head_len.copy()
    cap = bound.shape.capacity
    try:
        for bad in (cap + 1, -1, cap):
            rows.head_len[1] = bad
            want = outcome(lambda: _entry.check_call(rows, bound.shape, call, False))
            assert (want is None) == (bad == cap)
            assert outcome(lambda: _core.attend_rows(bound, call)) == want, bad
    finally:
        rows.head_len[:] = saved


def test_wild_query_offsets_are_refused_not_run(rng):
    """Offsets whose differences wrap around in 64 bits (two huge counts that add up to nq)
    are refused with the check's message; the C acceptance compares offsets before it
    subtracts them."""
    layer, rows = layer_rows(kc.KvMode.F32, rng, nkv=3)
    bound = _core.bind_rows(rows)
    q2 = rng.standard_normal((1, 16)).astype(np.float32)
    for g0 in ([0, 2 ** 63 - 1, -2, 1], [0, -5, 6, 1], [0, 2, 0, 1]):
        call = AttendCall(q=q2, group_q0=np.array(g0, np.intp), n_pos=1, n_back=1, window=0,
                          first=0, scale=0.25, softcap=0.0, out=np.zeros((1, 16), np.float32),
                          imp=np.zeros(50, np.float32), imp_mode=2, n_threads=1,
                          probs=np.zeros((1, 50), np.float32))
        want = outcome(lambda: _entry.check_call(rows, bound.shape, call, False))
        assert want is not None and want[0] is ValueError, g0
        assert outcome(lambda: _core.attend_rows(bound, call)) == want, g0
        assert outcome(lambda: _core.attend_blocked(bound, call._replace(probs=None))) == \
            outcome(lambda: _entry.check_call(rows, bound.shape, call, True)), g0


def o1_state(rng, H, G, d, dv, m, ns, cap):
    f = lambda *s: rng.standard_normal(s).astype(np.float32)
    return dict(sink_k=f(G, ns, d), sink_v=f(G, ns, dv), win_k=f(G, cap, d), win_v=f(G, cap, dv),
                k_tilde=f(G, m, d), q_tilde=f(H, m, d), mu=f(H, m, m) * np.float32(0.3),
                t_hat=np.abs(f(H, m, dv)), z_hat=np.abs(f(H, m)) + np.float32(0.5), m_max=f(H, m))


def test_o1_step_decides_as_the_check(rng):
    H, G, d, dv, m, ns, win = 4, 2, 16, 8, 4, 2, 12
    st = o1_state(rng, H, G, d, dv, m, ns, win + 3)
    q = rng.standard_normal((H, d)).astype(np.float32)
    kn = rng.standard_normal((G, d)).astype(np.float32)
    vn = rng.standard_normal((G, dv)).astype(np.float32)
    nscr = ns + win + 3 * m
    variants = [
        ("q float64", dict(q=q.astype(np.float64))), ("q shape", dict(q=q[:, :8].copy())),
        ("q Fortran", dict(q=np.asfortranarray(q))), ("q big-endian", dict(q=big_endian(q))),
        ("q read-only", dict(q=readonly(q))), ("q subclass", dict(q=q.copy().view(Sub))),
        ("q list", dict(q=q.tolist())), ("q 1-D", dict(q=q.reshape(-1))),
        ("k_new groups", dict(k_new=np.zeros((G + 1, d), np.float32))),
        ("k_new no row", dict(k_new=np.zeros((0, d), np.float32))),
        ("q no head", dict(q=np.zeros((0, d), np.float32))),
        ("v_new no row", dict(v_new=np.zeros((0, dv), np.float32))),
        ("k_new width", dict(k_new=np.zeros((G, d + 1), np.float32))),
        ("v_new width", dict(v_new=np.zeros((G, d), np.float32))),
        ("v_new float64", dict(v_new=vn.astype(np.float64))),
        ("out read-only", dict(out=readonly(np.zeros((H, dv), np.float32)))),
        ("out shape", dict(out=np.zeros((H, d), np.float32))),
        ("out strided", dict(out=np.zeros((H, 2 * dv), np.float32)[:, ::2])),
        ("scr short", dict(scr=np.zeros((H, nscr - 1), np.float32))),
        ("scr heads", dict(scr=np.zeros((H + 1, nscr), np.float32))),
        ("scr read-only", dict(scr=readonly(np.zeros((H, nscr), np.float32)))),
        ("scr wide", dict(scr=np.zeros((H, nscr + 5), np.float32))),
        ("win_len 0", dict(win_len=0)), ("win_len cap+1", dict(win_len=win + 4)),
        ("win_len 2**63", dict(win_len=2 ** 63)), ("win_len numpy", dict(win_len=np.int64(win))),
        ("win_len bool", dict(win_len=True)), ("win_len float", dict(win_len=12.0)),
        ("slot -1", dict(slot=-1)), ("slot win_len", dict(slot=win)),
        ("slot numpy", dict(slot=np.int16(3))), ("slot str", dict(slot="3")),
        ("n_threads 0", dict(n_threads=0)), ("n_threads 2**31", dict(n_threads=2 ** 31)),
        ("n_threads numpy", dict(n_threads=np.int64(1))),
    ]

    def fresh(**change):
        return O1Step(q=q, k_new=kn, v_new=vn, win_len=win, slot=3, absorb=False, use_far=True,
                      out=np.full((H, dv), 7.0, np.float32),
                      scr=np.zeros((H, nscr), np.float32), n_threads=1)._replace(**change)

    bound = _core.bind_o1(O1State(**st, scale=0.25, fm=False))
    plain = fresh()
    ring = {n: st[n].copy() for n in ("win_k", "win_v")}
    _core.o1_step(bound, plain)
    for name, change in variants:
        for n, a in ring.items():                  # each step writes its row into the ring
            st[n][:] = a
        step = fresh(**change)
        out_before = np.array(step.out, copy=True)
        want = outcome(lambda: _entry.check_o1_call(bound.shape, step))
        got = outcome(lambda: _core.o1_step(bound, step))
        assert got == want, name
        if want is not None:
            assert all(np.array_equal(st[n], a) for n, a in ring.items()), name
            assert np.array_equal(np.asarray(step.out), out_before), name
        elif "out" not in name:
            assert np.array_equal(np.asarray(step.out), plain.out), name
