"""One call of every kernel family on fixed inputs, printed as a digest per family.

Run as a program (``python tests/isa_smoke.py``) it prints one JSON object: the CPU features
kvcache detected, the body each family runs and the SHA-256 of each family's output bytes.  The
bodies compute the portable twin's bits, so the digests must not depend on the CPU or on the
bodies chosen: .ci/run runs this natively and under user-mode QEMU on CPUs without AVX2
(``-cpu Nehalem``) and without AVX-512 (``-cpu Haswell``) and compares the digests; the test
suite runs it in-process for every body this CPU runs (tests/test_isa_smoke.py).

Small shapes (under QEMU the interpreter is emulated), but every family's SIMD paths are
reached: head dims 64 and 72 (whole and partial vector blocks), K groups of 16 and 32, 4-bit K
and V (closed blocks and the ring's open block), enough rows for several tiles and tasks.
"""

from __future__ import annotations

import hashlib
import json
import sys

import numpy as np

from kvcache._entry import AttendCall, MlaCall, O1Absorb, O1State, O1Step, Rows


def _digest(*arrays: np.ndarray) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def _attention(core, rng, blocked: bool, quant: bool, hd: int, group: int) -> list[np.ndarray]:
    nkv, hpk, T, n_pos = 2, 3, 300, 5 if not blocked else 70
    ng = -(-hd // group)
    kf = rng.standard_normal((nkv, T, hd)).astype(np.float32)
    vf = rng.standard_normal((nkv, T, hd)).astype(np.float32)
    kq = rng.integers(-127, 128, (nkv, T, hd)).astype(np.int8)
    ks = (rng.random((nkv, T, ng)) * 0.02).astype(np.float32)
    vq = rng.integers(-127, 128, (nkv, T, hd)).astype(np.int8)
    vs = (rng.random((nkv, T, 1)) * 0.02).astype(np.float32)
    zf = np.zeros((nkv, 1, hd), np.float32)
    vcol = (1.0 + rng.random((nkv, hd))).astype(np.float32)
    hl = np.array([T, T - 7], np.intp)
    nq = nkv * hpk * n_pos
    q = rng.standard_normal((nq, hd)).astype(np.float32)
    g0 = np.arange(nkv + 1, dtype=np.intp) * hpk * n_pos
    out = np.zeros((nq, hd), np.float32)
    imp = np.zeros(T, np.float32)
    rows = Rows(kf=zf if quant else kf, kq=kq, ks=ks, vf=zf if quant else vf, vq=vq, vs=vs,
                vcol=vcol, head_len=hl, quant_k=quant, quant_v=quant)
    call = AttendCall(q=q, group_q0=g0, n_pos=n_pos, n_back=n_pos, window=0, first=0,
                      scale=0.125, softcap=0.0, out=out, imp=imp, imp_mode=2 if blocked else 1,
                      n_threads=2)
    if blocked:
        core.attend_blocked(rows, call)
        return [out, imp]
    probs = np.zeros((nq, T), np.float32)
    core.attend_rows(rows, call._replace(probs=probs))
    return [out, probs, imp]


def _o1(core, rng) -> list[np.ndarray]:
    H, G, m, d, dv, ns, cap = 4, 2, 8, 64, 64, 4, 32
    f = np.float32
    qt = rng.standard_normal((H, m, d)).astype(f)
    keys = rng.standard_normal((G, 40, d)).astype(f)
    vals = rng.standard_normal((G, 40, dv)).astype(f)
    t_hat = np.zeros((H, m, dv), f)
    z_hat = np.zeros((H, m), f)
    m_max = np.full((H, m), -np.inf, f)
    win_k = np.zeros((G, cap, d), f)
    win_v = np.zeros((G, cap, dv), f)
    unused = np.zeros((G, 0, d), f)
    far = O1State(sink_k=unused, sink_v=unused, win_k=win_k, win_v=win_v, k_tilde=unused,
                  q_tilde=qt, mu=np.zeros((H, 0, 0), f), t_hat=t_hat, z_hat=z_hat, m_max=m_max,
                  scale=0.125, fm=False)
    core.o1_absorb(far, O1Absorb(keys=keys, values=vals, row0=0, n=40,
                                 scr=np.zeros((H, m), f), n_threads=2))
    win_k[...] = rng.standard_normal((G, cap, d))
    win_v[...] = rng.standard_normal((G, cap, dv))
    out = np.zeros((H, dv), f)
    q = rng.standard_normal((H, d)).astype(f)
    k_new = rng.standard_normal((G, d)).astype(f)
    v_new = rng.standard_normal((G, dv)).astype(f)
    state = O1State(sink_k=rng.standard_normal((G, ns, d)).astype(f),
                    sink_v=rng.standard_normal((G, ns, dv)).astype(f),
                    win_k=win_k, win_v=win_v,
                    k_tilde=rng.standard_normal((G, m, d)).astype(f), q_tilde=qt,
                    mu=(rng.standard_normal((H, m, m)) * 0.1).astype(f), t_hat=t_hat,
                    z_hat=z_hat, m_max=m_max, scale=0.125, fm=False)
    core.o1_step(state, O1Step(q=q, k_new=k_new, v_new=v_new, win_len=cap, slot=5, absorb=True,
                               use_far=True, out=out, scr=np.zeros((H, ns + cap + 3 * m), f),
                               n_threads=2))
    return [t_hat, z_hat, m_max, win_k, win_v, out]


def _mla(core, rng) -> list[np.ndarray]:
    n, H, dn, dr, T, r, dv = 3, 20, 32, 16, 200, 96, 32
    f = np.float32
    out = np.zeros((n, H, dv), f)
    core.mla_attend(MlaCall(qn=rng.standard_normal((n, H, dn)).astype(f),
                            qr=rng.standard_normal((n, H, dr)).astype(f),
                            lat=rng.standard_normal((T, r)).astype(f),
                            kr=rng.standard_normal((T, dr)).astype(f),
                            wuk=(rng.standard_normal((H, dn, r)) * 0.1).astype(f),
                            wuv=(rng.standard_normal((H, dv, r)) * 0.1).astype(f), scale=0.1,
                            out=out, n_threads=2))
    return [out]


def _quant(core, rng) -> list[np.ndarray]:
    x = (rng.standard_normal((50, 72)) * 3).astype(np.float32)
    res = []
    for group in (16, 32):
        ng = -(-72 // group)
        q = np.zeros((50, 72), np.int8)
        s = np.zeros((50, ng), np.float32)
        core.quantize_rows(x, np.zeros(0, np.float32), group, q, s, 2)
        scores = np.zeros((7, 50), np.float32)
        core.q8_scores(x[:7].copy(), q, s, scores, group)
        res += [q, s, scores]
    return res


def _four_bit(core, rng, blocked: bool, hd: int) -> list[np.ndarray]:
    """4-bit K and V (docs/kv4.md): rows written by the compiled quantisers, then decode or
    prompt attention over them, and the raw 4-bit K scores."""
    nkv, hpk, T, n_pos = 2, 3, 203, 5 if not blocked else 40
    x = (rng.standard_normal((T, nkv, hd)) * 2).astype(np.float32)
    y = rng.standard_normal((T, nkv, hd)).astype(np.float32)
    kc = np.zeros((nkv, T, hd // 2), np.uint8)
    kp = np.zeros((nkv, -(-T // core.K4_BLOCK), 2 * hd), np.uint16)
    kr = np.zeros((nkv, core.K4_RING, hd), np.float32)
    vc = np.zeros((nkv, T, hd // 2), np.uint8)
    vp = np.zeros((nkv, T, 2 * -(-hd // 16)), np.uint16)
    live, zero = np.ones(nkv, np.uint8), np.zeros(nkv, np.intp)
    core.store_rows_k4(x, live, zero, kc, kp, kr)
    core.store_rows_v4(y, live, zero, vc, vp)
    z8 = np.zeros((nkv, 0, hd), np.int8)
    zf = np.zeros((nkv, 0, hd), np.float32)
    rows = Rows(kf=zf, kq=z8, ks=np.zeros((nkv, 0, 4), np.float32), vf=zf, vq=z8,
                vs=np.zeros((nkv, 0, 1), np.float32), vcol=np.ones((nkv, hd), np.float32),
                head_len=np.array([T, T - 9], np.intp), quant_k=False, quant_v=False,
                vc4=vc, vp=vp, v4=True, kc4=kc, kp=kp, kr=kr, k4=True)
    nq = nkv * hpk * n_pos
    q = rng.standard_normal((nq, hd)).astype(np.float32)
    g0 = np.arange(nkv + 1, dtype=np.intp) * hpk * n_pos
    out = np.zeros((nq, hd), np.float32)
    imp = np.zeros(T, np.float32)
    call = AttendCall(q=q, group_q0=g0, n_pos=n_pos, n_back=n_pos, window=0, first=0,
                      scale=0.125, softcap=0.0, out=out, imp=imp, imp_mode=2 if blocked else 1,
                      n_threads=2)
    raw = np.zeros((4, T), np.float32)
    core.k4_scores(q[:4].copy(), kc[0], kp[0], kr[0], T, raw)
    if blocked:
        core.attend_blocked(rows, call)
        return [kc, kp, vc, vp, raw, out, imp]
    probs = np.zeros((nq, T), np.float32)
    core.attend_rows(rows, call._replace(probs=probs))
    return [kc, kp, vc, vp, raw, out, probs, imp]


def run_all() -> dict[str, str]:
    """Family -> digest of its outputs (fixed seeds, so the same on every machine)."""
    from kvcache import _core

    rng = np.random.default_rng(20261202)
    out: dict[str, str] = {}
    for hd, group in ((64, 16), (72, 32)):
        out[f"f32 decode hd={hd}"] = _digest(*_attention(_core, rng, False, False, hd, group))
        out[f"q8 decode hd={hd} group={group}"] = _digest(*_attention(_core, rng, False, True,
                                                                       hd, group))
        out[f"f32 prefill hd={hd}"] = _digest(*_attention(_core, rng, True, False, hd, group))
        out[f"q8 prefill hd={hd} group={group}"] = _digest(*_attention(_core, rng, True, True,
                                                                        hd, group))
    for hd in (64, 72):
        out[f"4-bit decode hd={hd}"] = _digest(*_four_bit(_core, rng, False, hd))
        out[f"4-bit prefill hd={hd}"] = _digest(*_four_bit(_core, rng, True, hd))
    out["o1 step"] = _digest(*_o1(_core, rng))
    out["mla"] = _digest(*_mla(_core, rng))
    out["quantise"] = _digest(*_quant(_core, rng))
    return out


def main() -> int:
    from kvcache import _core

    report = {"features": sorted(_core.cpu_features()), "bodies": _core.bodies(),
              "digests": run_all()}
    json.dump(report, sys.stdout, indent=1, sort_keys=True)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
