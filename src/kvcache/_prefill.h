/* Blocked prompt attention (kvcache._core.attend_blocked): tiles of queries x stored rows,
 * an online softmax, no probability matrix.  AVX2/FMA intrinsics under KVC_SIMD with a
 * portable C twin that computes the same bits (the conventions of _kernels.h, whose exp,
 * lane folds and SIMD switch this file reuses).  No -ffast-math.
 *
 * Summation orders (fixed by row and channel index only, so a query's result depends on its
 * own visible rows [f, e) and never on the other queries of the call or the thread count):
 *
 *   tiles        stored rows are cut into tiles of KVC_PF_TILE (64) rows at ABSOLUTE row
 *                multiples; a query takes the tiles that meet [f, e) in increasing order, and
 *                in each only its visible rows.
 *   scores       s = dot * scale, where dot = fma(q[d], k[d], dot) over the channels d in
 *                increasing order from 0 (one chain, no lanes); int8 keys are first
 *                dequantised channel by channel as (float)k8[d] * group_scale[d / 32] (one
 *                rounded product).  Softcap (> 0): s = cap * tanhf(s / cap) for finite s.
 *   online max   m' = max(m, max of the tile's visible scores), NaN ignored, m starts at -inf;
 *                mu = m' (0 while m' is -inf); alpha = exp(m - mu); p = exp(s - mu) with
 *                kvc_expf (the same function scalar and 8-wide).
 *   running sum  t = the tile's p summed in 8 lanes (lane = row % 8, rows in order, then
 *                kvc_hsum8's fold); l = fmaf(l, alpha, t).
 *   values       per channel: o = o * alpha, then o = fma(p, v[d], o) over the tile's visible
 *                rows in increasing order (every visible row, no skip rule); int8 values are
 *                dequantised as (float)v8[d] * row_scale.  The result is o / l (then times the
 *                frozen V column, when V is int8).  A query that sees no row gets zeros.
 *   importance   a second pass recomputes each score bit for bit and adds
 *                exp(s - m_final) / l_final (l_final only when it is > 0, else 1) into a
 *                per-tile column sum, KV groups in order, the group's queries in order; the
 *                column sum is added once to imp.
 */
#ifndef KVCACHE_PREFILL_H
#define KVCACHE_PREFILL_H

#include "_kernels.h"

#define KVC_PF_TILE 64 /* rows per key/value tile, at absolute row multiples */
#define KVC_PF_QR 6    /* queries per register block (scores and values) */

/* Per-thread scratch floats of a task with up to nq queries (the importance pass needs less):
 * the K tile transposed (hd x 64), a dequantised V tile (64 x hd), scores/probabilities
 * (nq x 64), the partial outputs (nq x hd), m, l and alpha (3 nq), and alignment slack. */
#define KVC_PF_SCRATCH_FLOATS(hd, nq) \
    (2 * (hd) * KVC_PF_TILE + (nq) * KVC_PF_TILE + (nq) * (hd) + 3 * (nq) + 64)

/* ---------------------------------------------------------------------------------------
 * Tile loads.  Kt[d * 64 + (p - t0)] = k_p[d] for rows p in [r0, r1), zero elsewhere;
 * Vd[(p - t0) * hd + d] = dequantised v_p[d] for rows p in [r0, r1) (int8 V only).
 * ------------------------------------------------------------------------------------- */
KVC_INLINE void kvc_pf_load_k(const float *kf, const int8_t *kq, const float *ks,
                              ptrdiff_t ks_stride, int quant_k, ptrdiff_t t0, ptrdiff_t r0,
                              ptrdiff_t r1, ptrdiff_t hd, float *restrict Kt)
{
    ptrdiff_t p, d, r;
    for (d = 0; d < hd; ++d) {
        float *row = Kt + d * KVC_PF_TILE;
        for (r = 0; r < r0 - t0; ++r)
            row[r] = 0.0f;
        for (r = r1 - t0; r < KVC_PF_TILE; ++r)
            row[r] = 0.0f;
    }
    if (!quant_k) {
#if KVC_SIMD
        if (hd % 8 == 0) {
            /* 8 x 8 transposes of the row block; rows past r1 are read as the last row */
            for (p = r0; p < r1; p += 8) {
                const float *src[8];
                for (r = 0; r < 8; ++r)
                    src[r] = kf + (p + r < r1 ? p + r : r1 - 1) * hd;
                for (d = 0; d < hd; d += 8) {
                    __m256 a0 = _mm256_loadu_ps(src[0] + d), a1 = _mm256_loadu_ps(src[1] + d);
                    __m256 a2 = _mm256_loadu_ps(src[2] + d), a3 = _mm256_loadu_ps(src[3] + d);
                    __m256 a4 = _mm256_loadu_ps(src[4] + d), a5 = _mm256_loadu_ps(src[5] + d);
                    __m256 a6 = _mm256_loadu_ps(src[6] + d), a7 = _mm256_loadu_ps(src[7] + d);
                    __m256 b0 = _mm256_unpacklo_ps(a0, a1), b1 = _mm256_unpackhi_ps(a0, a1);
                    __m256 b2 = _mm256_unpacklo_ps(a2, a3), b3 = _mm256_unpackhi_ps(a2, a3);
                    __m256 b4 = _mm256_unpacklo_ps(a4, a5), b5 = _mm256_unpackhi_ps(a4, a5);
                    __m256 b6 = _mm256_unpacklo_ps(a6, a7), b7 = _mm256_unpackhi_ps(a6, a7);
                    __m256 c0 = _mm256_shuffle_ps(b0, b2, 0x44), c1 = _mm256_shuffle_ps(b0, b2, 0xEE);
                    __m256 c2 = _mm256_shuffle_ps(b1, b3, 0x44), c3 = _mm256_shuffle_ps(b1, b3, 0xEE);
                    __m256 c4 = _mm256_shuffle_ps(b4, b6, 0x44), c5 = _mm256_shuffle_ps(b4, b6, 0xEE);
                    __m256 c6 = _mm256_shuffle_ps(b5, b7, 0x44), c7 = _mm256_shuffle_ps(b5, b7, 0xEE);
                    __m256 o[8];
                    o[0] = _mm256_permute2f128_ps(c0, c4, 0x20);
                    o[1] = _mm256_permute2f128_ps(c1, c5, 0x20);
                    o[2] = _mm256_permute2f128_ps(c2, c6, 0x20);
                    o[3] = _mm256_permute2f128_ps(c3, c7, 0x20);
                    o[4] = _mm256_permute2f128_ps(c0, c4, 0x31);
                    o[5] = _mm256_permute2f128_ps(c1, c5, 0x31);
                    o[6] = _mm256_permute2f128_ps(c2, c6, 0x31);
                    o[7] = _mm256_permute2f128_ps(c3, c7, 0x31);
                    ptrdiff_t nr = r1 - p < 8 ? r1 - p : 8;
                    for (r = 0; r < 8; ++r) {
                        float *dst = Kt + (d + r) * KVC_PF_TILE + (p - t0);
                        if (nr == 8) {
                            _mm256_storeu_ps(dst, o[r]);
                        } else {
                            float tmp[8];
                            ptrdiff_t i;
                            _mm256_storeu_ps(tmp, o[r]);
                            for (i = 0; i < nr; ++i)
                                dst[i] = tmp[i];
                        }
                    }
                }
            }
            return;
        }
#endif
        for (p = r0; p < r1; ++p) {
            const float *k = kf + p * hd;
            for (d = 0; d < hd; ++d)
                Kt[d * KVC_PF_TILE + (p - t0)] = k[d];
        }
        return;
    }
    for (p = r0; p < r1; ++p) {
        const int8_t *k = kq + p * hd;
        const float *s = ks + p * ks_stride;
        for (d = 0; d < hd; ++d)
            Kt[d * KVC_PF_TILE + (p - t0)] = (float)k[d] * s[d >> 5];
    }
}

KVC_INLINE void kvc_pf_load_v8(const int8_t *vq, const float *vs, ptrdiff_t vs_stride,
                               ptrdiff_t t0, ptrdiff_t r0, ptrdiff_t r1, ptrdiff_t hd,
                               float *restrict Vd)
{
    ptrdiff_t p, d;
    for (p = r0; p < r1; ++p) {
        const int8_t *v = vq + p * hd;
        float s = vs[p * vs_stride];
        float *dst = Vd + (p - t0) * hd;
        d = 0;
#if KVC_SIMD
        __m256 sv = _mm256_set1_ps(s);
        for (; d + 8 <= hd; d += 8)
            _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_cvtepi32_ps(
                _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(v + d)))), sv));
#endif
        for (; d < hd; ++d)
            dst[d] = (float)v[d] * s;
    }
}

/* ---------------------------------------------------------------------------------------
 * Scores of NR queries (rows of Q, stride ldq) against the 16 tile columns k0..k0+15 of Kt:
 * S[q * 64 + k] = the channel-ordered fma chain.  NR <= KVC_PF_QR.
 * ------------------------------------------------------------------------------------- */
KVC_INLINE void kvc_pf_qk(const float *restrict Q, ptrdiff_t ldq, const int NR,
                          const float *restrict Kt, ptrdiff_t hd, ptrdiff_t k0,
                          float *restrict S)
{
    ptrdiff_t d;
    int q;
#if KVC_SIMD
    __m256 acc[KVC_PF_QR][2];
#pragma GCC unroll 6
    for (q = 0; q < NR; ++q)
        acc[q][0] = acc[q][1] = _mm256_setzero_ps();
    const float *kp = Kt + k0;
    for (d = 0; d < hd; ++d, kp += KVC_PF_TILE) {
        __m256 ka = _mm256_loadu_ps(kp), kb = _mm256_loadu_ps(kp + 8);
#pragma GCC unroll 6
        for (q = 0; q < NR; ++q) {
            __m256 b = _mm256_broadcast_ss(Q + q * ldq + d);
            acc[q][0] = _mm256_fmadd_ps(b, ka, acc[q][0]);
            acc[q][1] = _mm256_fmadd_ps(b, kb, acc[q][1]);
        }
    }
#pragma GCC unroll 6
    for (q = 0; q < NR; ++q) {
        _mm256_storeu_ps(S + q * KVC_PF_TILE + k0, acc[q][0]);
        _mm256_storeu_ps(S + q * KVC_PF_TILE + k0 + 8, acc[q][1]);
    }
#else
    int k;
    for (q = 0; q < NR; ++q)
        for (k = 0; k < 16; ++k) {
            float a = 0.0f;
            for (d = 0; d < hd; ++d)
                a = fmaf(Q[q * ldq + d], Kt[d * KVC_PF_TILE + k0 + k], a);
            S[q * KVC_PF_TILE + k0 + k] = a;
        }
#endif
}

/* Scores of nq queries (nq any) for the 16-column strips covering tile columns [c0, c1). */
static void kvc_pf_scores(const float *Q, ptrdiff_t ldq, ptrdiff_t nq, const float *Kt,
                          ptrdiff_t hd, ptrdiff_t c0, ptrdiff_t c1, float *S)
{
    ptrdiff_t j, k0;
    for (k0 = c0 / 16 * 16; k0 < c1; k0 += 16) {
        for (j = 0; j + KVC_PF_QR <= nq; j += KVC_PF_QR)
            kvc_pf_qk(Q + j * ldq, ldq, KVC_PF_QR, Kt, hd, k0, S + j * KVC_PF_TILE);
        switch (nq - j) {
        case 5: kvc_pf_qk(Q + j * ldq, ldq, 5, Kt, hd, k0, S + j * KVC_PF_TILE); break;
        case 4: kvc_pf_qk(Q + j * ldq, ldq, 4, Kt, hd, k0, S + j * KVC_PF_TILE); break;
        case 3: kvc_pf_qk(Q + j * ldq, ldq, 3, Kt, hd, k0, S + j * KVC_PF_TILE); break;
        case 2: kvc_pf_qk(Q + j * ldq, ldq, 2, Kt, hd, k0, S + j * KVC_PF_TILE); break;
        case 1: kvc_pf_qk(Q + j * ldq, ldq, 1, Kt, hd, k0, S + j * KVC_PF_TILE); break;
        default: break;
        }
    }
}

/* Scale and cap the scores s[a, b) of one query row (tile-relative columns). */
KVC_INLINE void kvc_pf_scale(float *restrict s, ptrdiff_t a, ptrdiff_t b, float scale,
                             float softcap)
{
    ptrdiff_t k;
    for (k = a; k < b; ++k)
        s[k] = s[k] * scale;
    if (softcap > 0.0f)
        for (k = a; k < b; ++k) {
            float v = s[k];
            if (isfinite(v))
                s[k] = softcap * tanhf(v / softcap);
        }
}

/* Online-softmax step of one query on one tile: s[a, b) are its scaled scores; on return
 * s[0, 64) holds p (0 outside [a, b)), *m and *l are updated and the rescale factor of the
 * partial output is returned. */
static float kvc_pf_softmax_step(float *restrict s, ptrdiff_t a, ptrdiff_t b, float *m,
                                 float *l)
{
    ptrdiff_t k;
    float tmax = -INFINITY, mnew, mu, alpha, t;
#if KVC_SIMD
    const __m256 idx = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 av = _mm256_set1_ps((float)a), bv = _mm256_set1_ps((float)b);
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    __m256 mx = ninf;
    for (k = a / 8 * 8; k < b; k += 8) {
        __m256 kk = _mm256_add_ps(idx, _mm256_set1_ps((float)k));
        __m256 vis = _mm256_and_ps(_mm256_cmp_ps(kk, av, _CMP_GE_OQ), _mm256_cmp_ps(kk, bv, _CMP_LT_OQ));
        __m256 v = _mm256_blendv_ps(ninf, _mm256_loadu_ps(s + k), vis);
        mx = _mm256_blendv_ps(mx, v, _mm256_cmp_ps(v, mx, _CMP_GT_OQ));
    }
    {
        float tmp[8];
        int i;
        _mm256_storeu_ps(tmp, mx);
        for (i = 0; i < 8; ++i)
            tmax = tmp[i] > tmax ? tmp[i] : tmax;
    }
#else
    for (k = a; k < b; ++k)
        tmax = s[k] > tmax ? s[k] : tmax;
#endif
    mnew = tmax > *m ? tmax : *m;
    mu = mnew == -INFINITY ? 0.0f : mnew;
    alpha = kvc_expf(*m - mu);
#if KVC_SIMD
    {
        const __m256 muv = _mm256_set1_ps(mu);
        __m256 acc = _mm256_setzero_ps();
        for (k = 0; k < KVC_PF_TILE; k += 8) {
            if (k + 8 <= a || k >= b) {
                _mm256_storeu_ps(s + k, _mm256_setzero_ps());
                continue;
            }
            __m256 kk = _mm256_add_ps(idx, _mm256_set1_ps((float)k));
            __m256 vis = _mm256_and_ps(_mm256_cmp_ps(kk, av, _CMP_GE_OQ), _mm256_cmp_ps(kk, bv, _CMP_LT_OQ));
            __m256 p = _mm256_and_ps(kvc_expf8(_mm256_sub_ps(_mm256_loadu_ps(s + k), muv)), vis);
            _mm256_storeu_ps(s + k, p);
            acc = _mm256_add_ps(acc, p);
        }
        t = kvc_fold8(acc);
    }
#else
    {
        float acc[8] = {0};
        for (k = 0; k < KVC_PF_TILE; ++k) {
            float p = (k >= a && k < b) ? kvc_expf(s[k] - mu) : 0.0f;
            s[k] = p;
            acc[k & 7] = acc[k & 7] + p;
        }
        t = kvc_hsum8(acc);
    }
#endif
    *l = fmaf(*l, alpha, t);
    *m = mnew;
    return alpha;
}

/* ---------------------------------------------------------------------------------------
 * Values.  For NR queries (p rows P + q * 64, tile-relative row index), channels [d0, d0+W)
 * with W = 16, 8 or 1: O = O * alpha (when alpha != NULL), then O = fma(p, v, O) over the
 * rows [ra, rb) (tile-relative) in order.  V points at the tile's row 0 (row stride hd).
 * ------------------------------------------------------------------------------------- */
KVC_INLINE void kvc_pf_pv16(const float *restrict P, const int NR, const float *restrict V,
                            ptrdiff_t hd, ptrdiff_t ra, ptrdiff_t rb, ptrdiff_t d0,
                            float *restrict O, const float *alpha)
{
    ptrdiff_t r;
    int q;
#if KVC_SIMD
    __m256 acc[KVC_PF_QR][2];
#pragma GCC unroll 6
    for (q = 0; q < NR; ++q) {
        acc[q][0] = _mm256_loadu_ps(O + q * hd + d0);
        acc[q][1] = _mm256_loadu_ps(O + q * hd + d0 + 8);
        if (alpha) {
            __m256 av = _mm256_broadcast_ss(alpha + q);
            acc[q][0] = _mm256_mul_ps(acc[q][0], av);
            acc[q][1] = _mm256_mul_ps(acc[q][1], av);
        }
    }
    for (r = ra; r < rb; ++r) {
        __m256 va = _mm256_loadu_ps(V + r * hd + d0), vb = _mm256_loadu_ps(V + r * hd + d0 + 8);
#pragma GCC unroll 6
        for (q = 0; q < NR; ++q) {
            __m256 b = _mm256_broadcast_ss(P + q * KVC_PF_TILE + r);
            acc[q][0] = _mm256_fmadd_ps(b, va, acc[q][0]);
            acc[q][1] = _mm256_fmadd_ps(b, vb, acc[q][1]);
        }
    }
#pragma GCC unroll 6
    for (q = 0; q < NR; ++q) {
        _mm256_storeu_ps(O + q * hd + d0, acc[q][0]);
        _mm256_storeu_ps(O + q * hd + d0 + 8, acc[q][1]);
    }
#else
    int c;
    for (q = 0; q < NR; ++q)
        for (c = 0; c < 16; ++c) {
            float o = O[q * hd + d0 + c];
            if (alpha)
                o = o * alpha[q];
            for (r = ra; r < rb; ++r)
                o = fmaf(P[q * KVC_PF_TILE + r], V[r * hd + d0 + c], o);
            O[q * hd + d0 + c] = o;
        }
#endif
}

/* The same for channels [d0, hd) with hd - d0 < 16 (one 8-wide block, then single channels). */
static void kvc_pf_pv_tail(const float *restrict P, int nr, const float *restrict V,
                           ptrdiff_t hd, ptrdiff_t ra, ptrdiff_t rb, ptrdiff_t d0,
                           float *restrict O, const float *alpha)
{
    ptrdiff_t r, d;
    int q;
#if KVC_SIMD
    if (d0 + 8 <= hd) {
        for (q = 0; q < nr; ++q) {
            __m256 acc = _mm256_loadu_ps(O + q * hd + d0);
            if (alpha)
                acc = _mm256_mul_ps(acc, _mm256_broadcast_ss(alpha + q));
            for (r = ra; r < rb; ++r)
                acc = _mm256_fmadd_ps(_mm256_broadcast_ss(P + q * KVC_PF_TILE + r),
                                      _mm256_loadu_ps(V + r * hd + d0), acc);
            _mm256_storeu_ps(O + q * hd + d0, acc);
        }
        d0 += 8;
    }
#endif
    for (q = 0; q < nr; ++q)
        for (d = d0; d < hd; ++d) {
            float o = O[q * hd + d];
            if (alpha)
                o = o * alpha[q];
            for (r = ra; r < rb; ++r)
                o = fmaf(P[q * KVC_PF_TILE + r], V[r * hd + d], o);
            O[q * hd + d] = o;
        }
}

/* Values of nr (<= KVC_PF_QR) queries over the rows [ra, rb) of a tile, all channels. */
static void kvc_pf_pv(const float *P, int nr, const float *V, ptrdiff_t hd, ptrdiff_t ra,
                      ptrdiff_t rb, float *O, const float *alpha)
{
    ptrdiff_t d0 = 0;
    for (; d0 + 16 <= hd; d0 += 16) {
        switch (nr) {
        case 6: kvc_pf_pv16(P, 6, V, hd, ra, rb, d0, O, alpha); break;
        case 5: kvc_pf_pv16(P, 5, V, hd, ra, rb, d0, O, alpha); break;
        case 4: kvc_pf_pv16(P, 4, V, hd, ra, rb, d0, O, alpha); break;
        case 3: kvc_pf_pv16(P, 3, V, hd, ra, rb, d0, O, alpha); break;
        case 2: kvc_pf_pv16(P, 2, V, hd, ra, rb, d0, O, alpha); break;
        default: kvc_pf_pv16(P, 1, V, hd, ra, rb, d0, O, alpha); break;
        }
    }
    if (d0 < hd)
        kvc_pf_pv_tail(P, nr, V, hd, ra, rb, d0, O, alpha);
}

/* ---------------------------------------------------------------------------------------
 * One task: nq queries (rows of q, stride hd) of one KV group with visible rows
 * [qf[j], qe[j]).  kf/kq/ks and vf/vq/vs point at the group's row 0.  Writes out (nq x hd)
 * and the final running max and sum of each query (qm, ql).
 * ------------------------------------------------------------------------------------- */
static void kvc_pf_task(const float *q, ptrdiff_t nq, const ptrdiff_t *qf, const ptrdiff_t *qe,
                        const float *kf, const int8_t *kq, const float *ks, ptrdiff_t ks_stride,
                        int quant_k, const float *vf, const int8_t *vq, const float *vs,
                        ptrdiff_t vs_stride, int quant_v, const float *vcol, ptrdiff_t hd,
                        float scale, float softcap, float *out, float *qm, float *ql,
                        float *scratch)
{
    float *Kt = scratch;
    float *Vd = Kt + hd * KVC_PF_TILE;
    float *S = Vd + hd * KVC_PF_TILE;
    float *O = S + nq * KVC_PF_TILE;
    float *alpha = O + nq * hd;
    ptrdiff_t lo = PTRDIFF_MAX, hi = 0, j, d, t0;
    for (j = 0; j < nq; ++j) {
        qm[j] = -INFINITY;
        ql[j] = 0.0f;
        if (qe[j] > qf[j]) {
            lo = qf[j] < lo ? qf[j] : lo;
            hi = qe[j] > hi ? qe[j] : hi;
        }
    }
    memset(O, 0, (size_t)(nq * hd) * sizeof(float));
    for (t0 = hi > lo ? lo / KVC_PF_TILE * KVC_PF_TILE : hi; t0 < hi; t0 += KVC_PF_TILE) {
        ptrdiff_t t1 = t0 + KVC_PF_TILE;
        ptrdiff_t r0 = lo > t0 ? lo : t0, r1 = hi < t1 ? hi : t1, ja = -1, jb = -1;
        /* the active queries (those that see a row of this tile) */
        for (j = 0; j < nq; ++j)
            if (qf[j] < t1 && qe[j] > t0 && qe[j] > qf[j]) {
                if (ja < 0)
                    ja = j;
                jb = j + 1;
            }
        if (ja < 0)
            continue;
        kvc_pf_load_k(kf, kq, ks, ks_stride, quant_k, t0, r0, r1, hd, Kt);
        const float *V;
        if (quant_v) {
            kvc_pf_load_v8(vq, vs, vs_stride, t0, r0, r1, hd, Vd);
            V = Vd;
        } else {
            V = vf + t0 * hd;
        }
        kvc_pf_scores(q + ja * hd, hd, jb - ja, Kt, hd, r0 - t0, r1 - t0, S + ja * KVC_PF_TILE);
        for (j = ja; j < jb; ++j) {
            ptrdiff_t a = (qf[j] > t0 ? qf[j] : t0) - t0, b = (qe[j] < t1 ? qe[j] : t1) - t0;
            float *s = S + j * KVC_PF_TILE;
            if (!(qe[j] > qf[j]) || a >= b) {
                alpha[j] = 1.0f;
                memset(s, 0, KVC_PF_TILE * sizeof(float));
                continue;
            }
            kvc_pf_scale(s, a, b, scale, softcap);
            alpha[j] = kvc_pf_softmax_step(s, a, b, qm + j, ql + j);
        }
        /* values, by blocks of queries: the rows all of the block see go through the
         * register-blocked kernel, the rest query by query (each row chain stays in order) */
        for (j = ja; j < jb; j += KVC_PF_QR) {
            int nr = jb - j < KVC_PF_QR ? (int)(jb - j) : KVC_PF_QR, i;
            ptrdiff_t A = 0, B = KVC_PF_TILE, ai[KVC_PF_QR], bi[KVC_PF_QR];
            int same_start = 1, all_active = 1;
            for (i = 0; i < nr; ++i) {
                ptrdiff_t jj = j + i;
                ai[i] = (qf[jj] > t0 ? qf[jj] : t0) - t0;
                bi[i] = (qe[jj] < t1 ? qe[jj] : t1) - t0;
                if (!(qe[jj] > qf[jj]) || ai[i] >= bi[i]) {
                    all_active = 0;
                    continue;
                }
                A = ai[i] > A ? ai[i] : A;
                B = bi[i] < B ? bi[i] : B;
            }
            for (i = 0; i < nr; ++i)
                same_start = same_start && ai[i] == A;
            if (!all_active || A >= B) {
                for (i = 0; i < nr; ++i) {
                    ptrdiff_t jj = j + i;
                    if (!(qe[jj] > qf[jj]) || ai[i] >= bi[i])
                        continue;
                    kvc_pf_pv(S + jj * KVC_PF_TILE, 1, V, hd, ai[i], bi[i], O + jj * hd, alpha + jj);
                }
                continue;
            }
            if (!same_start)
                for (i = 0; i < nr; ++i)
                    kvc_pf_pv(S + (j + i) * KVC_PF_TILE, 1, V, hd, ai[i], A, O + (j + i) * hd,
                              alpha + j + i);
            kvc_pf_pv(S + j * KVC_PF_TILE, nr, V, hd, A, B, O + j * hd,
                      same_start ? alpha + j : NULL);
            for (i = 0; i < nr; ++i)
                if (bi[i] > B)
                    kvc_pf_pv(S + (j + i) * KVC_PF_TILE, 1, V, hd, B, bi[i], O + (j + i) * hd, NULL);
        }
    }
    for (j = 0; j < nq; ++j) {
        float *o = out + j * hd;
        const float *src = O + j * hd;
        if (!(qe[j] > qf[j])) {
            memset(o, 0, (size_t)hd * sizeof(float));
            continue;
        }
        float lj = ql[j];
        for (d = 0; d < hd; ++d)
            o[d] = src[d] / lj;
        if (quant_v)
            for (d = 0; d < hd; ++d)
                o[d] = o[d] * vcol[d];
    }
}

/* ---------------------------------------------------------------------------------------
 * Importance of one KV group over the tile rows [t0, t1) (t1 - t0 <= 64): for the group's
 * queries in order, colsum[p - t0] += exp(s - qm[j]) / ql[j] over the query's visible rows.
 * scratch: KVC_PF_SCRATCH_FLOATS(hd, KVC_PF_QR) floats.
 * ------------------------------------------------------------------------------------- */
static void kvc_pf_imp_group(const float *q, ptrdiff_t nq, const ptrdiff_t *qf,
                             const ptrdiff_t *qe, const float *qm, const float *ql,
                             const float *kf, const int8_t *kq, const float *ks,
                             ptrdiff_t ks_stride, int quant_k, ptrdiff_t hd, float scale,
                             float softcap, ptrdiff_t t0, ptrdiff_t t1, float *colsum,
                             float *scratch)
{
    float *Kt = scratch;
    float *S = Kt + hd * KVC_PF_TILE;
    ptrdiff_t j, ja = -1, jb = -1, r0 = t1, r1 = t0, k;
    for (j = 0; j < nq; ++j)
        if (qf[j] < t1 && qe[j] > t0 && qe[j] > qf[j]) {
            if (ja < 0)
                ja = j;
            jb = j + 1;
            r0 = qf[j] < r0 ? qf[j] : r0;
            r1 = qe[j] > r1 ? qe[j] : r1;
        }
    r0 = r0 > t0 ? r0 : t0;
    r1 = r1 < t1 ? r1 : t1;
    if (ja < 0)
        return;
    kvc_pf_load_k(kf, kq, ks, ks_stride, quant_k, t0, r0, r1, hd, Kt);
    for (j = ja; j < jb; j += KVC_PF_QR) {
        ptrdiff_t nr = jb - j < KVC_PF_QR ? jb - j : KVC_PF_QR, i;
        kvc_pf_scores(q + j * hd, hd, nr, Kt, hd, r0 - t0, r1 - t0, S);
        for (i = 0; i < nr; ++i) {
            ptrdiff_t jj = j + i;
            ptrdiff_t a = (qf[jj] > t0 ? qf[jj] : t0) - t0, b = (qe[jj] < t1 ? qe[jj] : t1) - t0;
            float *s = S + i * KVC_PF_TILE;
            if (!(qe[jj] > qf[jj]) || a >= b)
                continue;
            kvc_pf_scale(s, a, b, scale, softcap);
            /* the sum divides only when it is > 0 (a NaN sum leaves exp(s - m)), as in
             * kvc_softmax */
            float m = qm[jj], l = ql[jj] > 0.0f ? ql[jj] : 1.0f;
            k = a;
#if KVC_SIMD
            {
                __m256 mv = _mm256_set1_ps(m), lv = _mm256_set1_ps(l);
                for (; k + 8 <= b; k += 8) {
                    __m256 p = _mm256_div_ps(kvc_expf8(_mm256_sub_ps(_mm256_loadu_ps(s + k), mv)), lv);
                    _mm256_storeu_ps(colsum + k, _mm256_add_ps(_mm256_loadu_ps(colsum + k), p));
                }
            }
#endif
            for (; k < b; ++k)
                colsum[k] = colsum[k] + kvc_expf(s[k] - m) / l;
        }
    }
}

#endif
