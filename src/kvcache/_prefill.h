/* Blocked prompt attention (kvcache._core.attend_blocked): tiles of queries x stored rows,
 * an online softmax, no probability matrix.  Written once on the vector layer (_vec.h): the
 * same code is the AVX2 body and, on struct lanes, the portable one (and NEON on aarch64),
 * so every target computes the same bits.  No -ffast-math; every fused multiply-add is
 * written out (kvc_f8_fma, kvc_f16_fma, fmaf).  The score and value micro-kernels work on
 * 16-lane vectors (one lane per key, or per channel), which are zmm registers on the AVX-512
 * body; there they also take two strips at once (32 keys or channels, 12 accumulators).  A
 * lane's chain is the same on every body, so only the speed differs.
 *
 * Summation orders (fixed by row and channel index only, so a query's result depends on its
 * own visible rows [f, e) and never on the other queries of the call or the thread count):
 *
 *   tiles        stored rows are cut into tiles of KVC_PF_TILE (64) rows at ABSOLUTE row
 *                multiples; a query takes the tiles that meet [f, e) in increasing order, and
 *                in each only its visible rows.
 *   scores       s = dot * scale, where dot = fma(q[d], k[d], dot) over the channels d in
 *                increasing order from 0 (one chain, no lanes) for float32 keys and for 4-bit
 *                keys, read as their values fmaf(code, s, m) (docs/kv4.md), and for int8
 *                keys the raw q8 score of _kernels.h (the query quantised per K group of 16
 *                or 32 channels, exact int32 group sums, groups combined with fmaf in order: the bits
 *                the decode kernel gives; kvc_k8_qk forms the sums 16 keys x several queries
 *                at a time).  Softcap (> 0): s = cap * tanhf(s / cap) for finite s.
 *   online max   m' = max(m, max of the tile's visible scores), NaN ignored, m starts at -inf;
 *                mu = m' (0 while m' is -inf); alpha = exp(m - mu); p = exp(s - mu) with
 *                kvc_expf (the same function scalar and 8-wide).  The tile's max runs in 8
 *                lanes (lane = row % 8, x > y ? x : y), folded by kvc_f8_fold_max for a
 *                whole tile and in lane order from -inf otherwise; the order shows only in the
 *                sign of a zero max.
 *   running sum  t = the tile's p summed in 8 lanes (lane = row % 8, rows in order, then
 *                kvc_f8_fold); l = fmaf(l, alpha, t).
 *   values       per channel: o = o * alpha, then o = fma(p, v[d], o) over the tile's visible
 *                rows in increasing order (every visible row, no skip rule); int8 values are
 *                dequantised as (float)v8[d] * row_scale.  The result is o / l (then times the
 *                frozen V column, when V is int8).  A query that sees no row gets zeros.
 *   importance   one pass (kvc_pf_imp_fold): a task keeps each tile's p and the running max
 *                mt it was taken under; once its queries' m and l are final it adds
 *                p * g, g = exp(mt - m) / l (1 / l when mt == m), with one fma per row into a
 *                column sum per task, tile by tile, the task's queries in order.  The
 *                driver adds the tasks' column sums row by row in task order (the order of
 *                the task list, fixed by the call: never by the thread count), then the
 *                result once to imp.  A block of positions whose buffer would exceed
 *                KVC_PF_IMP_BUDGET is planned as pieces that fit, each a task (_core.pyx,
 *                _pf_piece, _position_blocks), so no score is computed twice.  (l is used
 *                only when it is > 0, else 1.)
 */
#ifndef KVCACHE_PREFILL_H
#define KVCACHE_PREFILL_H

#include "_kernels.h"



/* Ask for the rows [p0, p1) of a store (row_bytes each) in L2, ahead of the next tile. */
KVC_INLINE void kvc_pf_prefetch(const void *base, ptrdiff_t p0, ptrdiff_t p1, ptrdiff_t row_bytes)
{
#if defined(__GNUC__)
    const char *a = (const char *)base + p0 * row_bytes, *e = (const char *)base + p1 * row_bytes;
    for (; a < e; a += 64)
        __builtin_prefetch(a, 0, 2);
#else
    (void)base, (void)p0, (void)p1, (void)row_bytes;
#endif
}

/* ---------------------------------------------------------------------------------------
 * Tile packing.  Rows [r0, r1) of the tile starting at row t0:
 *   K  Kp[s * hd * 16 + d * 16 + c] = k_p[d],  p = t0 + 16 s + c  (strips of 16 keys, channel
 *      major inside a strip: the score kernel reads 16 keys of one channel contiguously);
 *   V  Vp[s * 64 * 16 + r * 16 + c] = v_p[16 s + c],  p = t0 + r  (strips of 16 channels, 0
 *      past head_dim).
 * float32 K only (int8 K has its own tile, kvc_k8_pack below; 4-bit K is read as its
 * values, kvc_pf_load_k4); int8 V rows are dequantised on the way: (float)v8[d] * vs.
 * Columns of K outside [r0, r1) hold other stored rows or copies (their scores are never
 * used); V rows outside [r0, r1) are not written (never read).
 * ------------------------------------------------------------------------------------- */
KVC_INLINE void kvc_pf_load_k(const float *kf, ptrdiff_t t0, ptrdiff_t r0, ptrdiff_t r1,
                              ptrdiff_t hd, float *restrict Kp)
{
    ptrdiff_t g, d, i;
    for (g = (r0 - t0) / 8 * 8; g < r1 - t0; g += 8) {
        float *dst = Kp + (g / 16) * hd * 16 + (g % 16);
        ptrdiff_t src[8];
        for (i = 0; i < 8; ++i)
            src[i] = t0 + g + i < r1 ? t0 + g + i : r1 - 1;
        /* 8 rows x 8 channels at a time: row i in a[i], then transposed so that a[c] holds
         * channel d + c of the 8 rows (one contiguous store each) */
        for (d = 0; d + 8 <= hd; d += 8) {
            kvc_f8 a[8];
#pragma GCC unroll 8
            for (i = 0; i < 8; ++i)
                a[i] = kvc_f8_load(kf + src[i] * hd + d);
            kvc_f8_transpose8(a);
#pragma GCC unroll 8
            for (i = 0; i < 8; ++i)
                kvc_f8_store(dst + (d + i) * 16, a[i]);
        }
        for (; d < hd; ++d)
            for (i = 0; i < 8; ++i)
                dst[d * 16 + i] = kf[src[i] * hd + d];
    }
}

/* 4-bit K (docs/kv4.md) into the packed K tile, in kvc_pf_load_k's layout and row range: a
 * row of a closed block as its values fmaf(code, s, m), a row of the open block as the ring
 * holds it.  Eight rows of one closed block come from one 32-byte load per channel octet
 * (the block layout puts eight rows in the lanes: no transpose); other groups of eight rows
 * (the open block, the tile's last rows) are gathered row by row and transposed into place
 * as kvc_pf_load_k does.  tmp: KVC_PF_K4_TMP(hd) floats. */
KVC_INLINE void kvc_pf_load_k4(const kvc_k4 *K, ptrdiff_t t0, ptrdiff_t r0, ptrdiff_t r1,
                               ptrdiff_t hd, float *restrict Kp, float *restrict tmp)
{
    const ptrdiff_t B = KVC_K4_BLOCK;
    float *pf = tmp, *rows = tmp + 2 * hd;          /* 8 rows of hd */
    ptrdiff_t g, d, i, o, blk = -1;
    for (g = (r0 - t0) / 8 * 8; g < r1 - t0; g += 8) {
        float *dst = Kp + (g / 16) * hd * 16 + (g % 16);
        const ptrdiff_t p8 = t0 + g;
        const float *src[8];
        if (p8 + 8 <= r1 && p8 + 8 <= K->qlen) {
            if (p8 / B != blk) {
                blk = p8 / B;
                kvc_k4_params(K->par + blk * 2 * hd, hd, pf);
            }
            const uint8_t *cb = K->codes + blk * B * (hd / 2) + (p8 % B) * 4;
            for (o = 0; o < hd / 8; ++o) {
                const kvc_i8x u = kvc_i8x_loadb(cb + o * 4 * B);
#pragma GCC unroll 8
                for (i = 0; i < 8; ++i) {
                    d = 8 * o + i;      /* byte i % 4 of each lane, low nibble for i < 4 */
                    kvc_f8 x = kvc_i8x_to_f8(kvc_i8x_field(u, (int)(8 * (i % 4) + 4 * (i / 4))));
                    kvc_f8_store(dst + d * 16, kvc_f8_fma(x, kvc_f8_bcast(pf + d),
                                                          kvc_f8_bcast(pf + hd + d)));
                }
            }
            continue;
        }
        for (i = 0; i < 8; ++i) {
            ptrdiff_t p = p8 + i < r1 ? p8 + i : r1 - 1;
            float *row = rows + i * hd;
            int shift;
            if (p >= K->qlen) {
                src[i] = K->ring + (p % KVC_K4_RING) * hd;
                continue;
            }
            if (p / B != blk) {
                blk = p / B;
                kvc_k4_params(K->par + blk * 2 * hd, hd, pf);
            }
            const uint8_t *cb = K->codes + blk * B * (hd / 2);
            for (d = 0; d < hd; ++d) {
                ptrdiff_t byte = kvc_k4_byte(p % B, d, &shift);
                row[d] = fmaf((float)((cb[byte] >> shift) & 15), pf[d], pf[hd + d]);
            }
            src[i] = row;
        }
        for (d = 0; d + 8 <= hd; d += 8) {         /* hd is a multiple of 8 */
            kvc_f8 a[8];
#pragma GCC unroll 8
            for (i = 0; i < 8; ++i)
                a[i] = kvc_f8_load(src[i] + d);
            kvc_f8_transpose8(a);
#pragma GCC unroll 8
            for (i = 0; i < 8; ++i)
                kvc_f8_store(dst + (d + i) * 16, a[i]);
        }
    }
}

KVC_INLINE void kvc_pf_load_v(const float *vf, const int8_t *vq, const float *vs,
                          ptrdiff_t vs_stride, int quant_v, const uint8_t *vc4,
                          const uint16_t *vp, ptrdiff_t t0, ptrdiff_t r0,
                          ptrdiff_t r1, ptrdiff_t hd, float *restrict Vp)
{
    ptrdiff_t p, d;
    if (quant_v == KVC_V_Q4) {
        /* 4-bit rows: v = fmaf(code, s_g, m_g), the decode pass's values (_q4.h) */
        const ptrdiff_t np = 2 * KVC_V4_NG(hd);
        for (p = r0; p < r1; ++p) {
            float *dst = Vp + (p - t0) * 16;
            const uint8_t *c = vc4 + p * (hd / 2);
            const uint16_t *pr = vp + p * np;
            ptrdiff_t c0;
            /* whole 32-channel chunks, 8 lanes at a time: the low nibbles of the chunk's 16
             * bytes are its first 16 channels (group c0 / 16), the high nibbles the next 16
             * (the layout of _q4.h); each lane fma(code, s_g, m_g) as below */
            for (c0 = 0; c0 + 32 <= hd; c0 += 32) {
                int h;
                for (h = 0; h < 2; ++h) {
                    const ptrdiff_t g = c0 / 16 + h;
                    const kvc_f8 sg = kvc_f8_set1(kvc_f16_to_f32(pr[2 * g]));
                    const kvc_f8 mg = kvc_f8_set1(kvc_f16_to_f32(pr[2 * g + 1]));
                    float *o = dst + g * KVC_PF_TILE * 16;
                    kvc_f8_store(o, kvc_f8_fma(kvc_f8_from_u4(c + c0 / 2, 4 * h), sg, mg));
                    kvc_f8_store(o + 8, kvc_f8_fma(kvc_f8_from_u4(c + c0 / 2 + 8, 4 * h), sg,
                                                   mg));
                }
            }
            for (d = c0; d < hd; d += KVC_V4_GROUP) {
                float sg = kvc_f16_to_f32(vp[p * np + 2 * (d / 16)]);
                float mg = kvc_f16_to_f32(vp[p * np + 2 * (d / 16) + 1]);
                ptrdiff_t e, e1 = hd - d < KVC_V4_GROUP ? hd : d + KVC_V4_GROUP;
                for (e = d; e < e1; ++e) {
                    ptrdiff_t byte;
                    int shift;
                    kvc_v4_place(hd, e, &byte, &shift);
                    dst[(e / 16) * KVC_PF_TILE * 16 + (e % 16)] =
                        fmaf((float)((c[byte] >> shift) & 15), sg, mg);
                }
            }
            for (d = hd; d < KVC_PF_PAD16(hd); ++d)
                dst[(d / 16) * KVC_PF_TILE * 16 + (d % 16)] = 0.0f;
        }
        return;
    }
    for (p = r0; p < r1; ++p) {
        float *dst = Vp + (p - t0) * 16;
        float s = quant_v ? vs[p * vs_stride] : 1.0f;
        for (d = 0; d + 8 <= hd; d += 8) {
            kvc_f8 x = quant_v ? kvc_f8_mul(kvc_f8_from_s8(vq + p * hd + d), kvc_f8_set1(s))
                               : kvc_f8_load(vf + p * hd + d);
            kvc_f8_store(dst + (d / 16) * KVC_PF_TILE * 16 + (d % 16), x);
        }
        for (; d < KVC_PF_PAD16(hd); ++d)
            dst[(d / 16) * KVC_PF_TILE * 16 + (d % 16)] =
                d >= hd ? 0.0f : quant_v ? (float)vq[p * hd + d] * s : vf[p * hd + d];
    }
}

/* ---------------------------------------------------------------------------------------
 * Scores of NR queries (rows of Q, stride ldq) against NS neighbouring 16-key strips of the
 * packed K tile (Ks, Ks + 16 hd): S[q * lds + 16 s + c] = the channel-ordered fma chain of
 * key 16 s + c.  NR <= KVC_PF_QR and NS <= 2 (2 only where KVC_PF_STRIPS is 2) are constants
 * at every call, so each (NR, NS) is its own unrolled kernel.  The 16-lane accumulators are
 * one zmm each on AVX-512, two ymm halves elsewhere; a key's chain is the same for every NS.
 * ------------------------------------------------------------------------------------- */
#if KVC_VEC_AVX512
#define KVC_PF_STRIPS 2   /* 2 NR zmm accumulators: enough independent chains for the fma */
#else
#define KVC_PF_STRIPS 1   /* 16 ymm registers: one strip (2 NR accumulator halves) */
#endif

KVC_INLINE void kvc_pf_qk(const float *restrict Q, ptrdiff_t ldq, const int NR, const int NS,
                          const float *restrict Ks, ptrdiff_t hd, float *restrict S,
                          ptrdiff_t lds)
{
    ptrdiff_t d;
    int q, t;
    kvc_f16 acc[KVC_PF_QR][2];
#pragma GCC unroll 6
    for (q = 0; q < NR; ++q)
        for (t = 0; t < NS; ++t)
            acc[q][t] = kvc_f16_zero();
    for (d = 0; d < hd; ++d) {
        kvc_f16 k[2];
        for (t = 0; t < NS; ++t)
            k[t] = kvc_f16_load(Ks + t * hd * 16 + d * 16);
#pragma GCC unroll 6
        for (q = 0; q < NR; ++q) {
            kvc_f16 b = kvc_f16_bcast(Q + q * ldq + d);
            for (t = 0; t < NS; ++t)
                acc[q][t] = kvc_f16_fma(b, k[t], acc[q][t]);
        }
    }
#pragma GCC unroll 6
    for (q = 0; q < NR; ++q)
        for (t = 0; t < NS; ++t)
            kvc_f16_store(S + q * lds + 16 * t, acc[q][t]);
}

/* kvc_pf_qk for nq queries (nq any): blocks of KVC_PF_QR, then the rest. */
KVC_INLINE void kvc_pf_qk_rows(const float *Q, ptrdiff_t ldq, ptrdiff_t nq, const int NS,
                               const float *Ks, ptrdiff_t hd, float *S, ptrdiff_t lds)
{
#define KVC_PF_QK(J, N) kvc_pf_qk(Q + (J) * ldq, ldq, N, NS, Ks, hd, S + (J) * lds, lds)
    KVC_QBLOCKS(nq, KVC_PF_QR, KVC_PF_QK);
#undef KVC_PF_QK
}

/* Scores of nq queries (nq any) for the 16-key strips covering columns [c0, c1) of a packed
 * K block, two at a time where the body takes two and both meet [c0, c1); S rows have
 * stride lds. */
KVC_INLINE void kvc_pf_scores(const float *Q, ptrdiff_t ldq, ptrdiff_t nq, const float *Kp,
                          ptrdiff_t hd, ptrdiff_t c0, ptrdiff_t c1, float *S, ptrdiff_t lds)
{
    ptrdiff_t k0;
    for (k0 = c0 / 16 * 16; k0 < c1; k0 += 16) {
        const float *Ks = Kp + (k0 / 16) * hd * 16;
        if (KVC_PF_STRIPS == 2 && k0 + 16 < c1) {
            kvc_pf_qk_rows(Q, ldq, nq, 2, Ks, hd, S + k0, lds);
            k0 += 16;
        } else {
            kvc_pf_qk_rows(Q, ldq, nq, 1, Ks, hd, S + k0, lds);
        }
    }
}

/* kvc_k8_qk for nq queries (nq any): blocks of KVC_K8_QR, then the rest. */
KVC_INLINE void kvc_pf_qk8_rows(const int8_t *qi, ptrdiff_t ldqi, const float *sq,
                                const int32_t *qsum, ptrdiff_t ng, ptrdiff_t nq, const int NS,
                                const uint8_t *Kb, const float *Ksc, ptrdiff_t hd,
                                ptrdiff_t group, float *S, ptrdiff_t lds)
{
#define KVC_PF_QK8(J, N) kvc_k8_qk(qi + (J) * ldqi, ldqi, sq + (J) * ng, qsum + (J) * ng, ng, \
                                   N, NS, Kb, Ksc, hd, group, S + (J) * lds, lds)
    KVC_QBLOCKS(nq, KVC_K8_QR, KVC_PF_QK8);
#undef KVC_PF_QK8
}

/* q8 scores of nq queries for the 16-key strips covering columns [c0, c1) of a packed int8
 * tile, two at a time where the body takes two; S rows have stride lds. */
KVC_INLINE void kvc_pf_scores8(const int8_t *qi, const float *sq, const int32_t *qsum,
                               ptrdiff_t ng, ptrdiff_t nq, const uint8_t *Kb, const float *Ksc,
                               ptrdiff_t hd, ptrdiff_t group, ptrdiff_t c0, ptrdiff_t c1,
                               float *S, ptrdiff_t lds)
{
    const ptrdiff_t ldqi = KVC_I8_PAD(hd);
    ptrdiff_t k0;
    for (k0 = c0 / 16 * 16; k0 < c1; k0 += 16) {
        const uint8_t *Ks = Kb + (k0 / 16) * KVC_K8_STRIP(hd);
        const float *Kc = Ksc + (k0 / 16) * ng * 16;
        if (KVC_PF_STRIPS == 2 && k0 + 16 < c1) {
            kvc_pf_qk8_rows(qi, ldqi, sq, qsum, ng, nq, 2, Ks, Kc, hd, group, S + k0, lds);
            k0 += 16;
        } else {
            kvc_pf_qk8_rows(qi, ldqi, sq, qsum, ng, nq, 1, Ks, Kc, hd, group, S + k0, lds);
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

/* Online-softmax step of one query on one tile: s[a, b) are its raw scores (dot products);
 * on return s[0, 64) holds p (0 outside [a, b)), *m and *l are updated and the rescale factor
 * of the partial output is returned. */
static float kvc_pf_softmax_step(float *restrict s, ptrdiff_t a, ptrdiff_t b, float scale,
                                 float softcap, float *m, float *l)
{
    ptrdiff_t k;
    float tmax = -INFINITY, mnew, mu, alpha, t;
    if (softcap > 0.0f) {
        kvc_pf_scale(s, a, b, scale, softcap);
        scale = 1.0f;   /* s * 1.0f == s: the passes below leave the capped scores as they are */
    }
    const kvc_f8 sc = kvc_f8_set1(scale);
    if (a == 0 && b == KVC_PF_TILE) {
#if KVC_VEC_AVX512
        /* a whole tile on zmm: the scaling and the exponentials 16 lanes at a time (the same
         * bits lane by lane: kvc_f16_exp is kvc_f8_exp), the max and the sum taken over the
         * 8-lane halves in row order, as below */
        kvc_f16 w[4];
        kvc_f8 mx8 = kvc_f8_set1(-INFINITY), acc8 = kvc_f8_zero();
        const kvc_f16 sc16 = kvc_f16_set1(scale);
        int i;
        for (i = 0; i < 4; ++i) {
            w[i] = kvc_f16_mul(kvc_f16_load(s + 16 * i), sc16);
            mx8 = kvc_f8_max_num(mx8, kvc_f16_lo(w[i]));
            mx8 = kvc_f8_max_num(mx8, kvc_f16_hi(w[i]));
        }
        tmax = kvc_f8_fold_max(mx8);
        mnew = tmax > *m ? tmax : *m;
        mu = mnew == -INFINITY ? 0.0f : mnew;
        alpha = kvc_expf(*m - mu);
        const kvc_f16 mu16 = kvc_f16_set1(mu);
        for (i = 0; i < 4; ++i) {
            kvc_f16 p = kvc_f16_exp(kvc_f16_sub(w[i], mu16));
            kvc_f16_store(s + 16 * i, p);
            acc8 = kvc_f8_add(acc8, kvc_f16_lo(p));
            acc8 = kvc_f8_add(acc8, kvc_f16_hi(p));
        }
        t = kvc_f8_fold(acc8);
        *l = fmaf(*l, alpha, t);
        *m = mnew;
        return alpha;
#else
        /* a whole tile: the 64 scaled scores stay in registers */
        kvc_f8 v[8], mx = kvc_f8_set1(-INFINITY), acc;
        int i;
        for (i = 0; i < 8; ++i) {
            v[i] = kvc_f8_mul(kvc_f8_load(s + 8 * i), sc);
            mx = kvc_f8_max_num(mx, v[i]);   /* a NaN v keeps mx: NaN ignored */
        }
        tmax = kvc_f8_fold_max(mx);
        mnew = tmax > *m ? tmax : *m;
        mu = mnew == -INFINITY ? 0.0f : mnew;
        alpha = kvc_expf(*m - mu);
        const kvc_f8 muv = kvc_f8_set1(mu);
        acc = kvc_f8_zero();
        for (i = 0; i < 8; ++i) {
            kvc_f8 p = kvc_f8_exp(kvc_f8_sub(v[i], muv));
            kvc_f8_store(s + 8 * i, p);
            acc = kvc_f8_add(acc, p);
        }
        t = kvc_f8_fold(acc);
        *l = fmaf(*l, alpha, t);
        *m = mnew;
        return alpha;
#endif
    }
    /* part of a tile: the 8-blocks that meet [a, b), lanes outside it masked (their scores
     * may be stale or not finite) */
    const kvc_f8 idx = kvc_f8_setr(0, 1, 2, 3, 4, 5, 6, 7);
    const kvc_f8 av = kvc_f8_set1((float)a), bv = kvc_f8_set1((float)b);
    const kvc_f8 ninf = kvc_f8_set1(-INFINITY);
    kvc_f8 mx = ninf;
    for (k = a / 8 * 8; k < b; k += 8) {
        kvc_f8 kk = kvc_f8_add(idx, kvc_f8_set1((float)k));
        kvc_m8 vis = kvc_m8_and(kvc_f8_ge(kk, av), kvc_f8_lt(kk, bv));
        kvc_f8 v = kvc_f8_mul(kvc_f8_load(s + k), sc);
        kvc_f8_store(s + k, v);
        mx = kvc_f8_max_num(mx, kvc_f8_sel(vis, v, ninf));
    }
    {
        float tmp[8];
        int i;
        kvc_f8_store(tmp, mx);
        for (i = 0; i < 8; ++i)
            tmax = tmp[i] > tmax ? tmp[i] : tmax;
    }
    mnew = tmax > *m ? tmax : *m;
    mu = mnew == -INFINITY ? 0.0f : mnew;
    alpha = kvc_expf(*m - mu);
    {
        const kvc_f8 muv = kvc_f8_set1(mu);
        kvc_f8 acc = kvc_f8_zero();
        for (k = 0; k < KVC_PF_TILE; k += 8) {
            if (k + 8 <= a || k >= b) {   /* p = 0 (and adding it would change no sum) */
                kvc_f8_store(s + k, kvc_f8_zero());
                continue;
            }
            kvc_f8 p = kvc_f8_exp(kvc_f8_sub(kvc_f8_load(s + k), muv));
            if (k < a || k + 8 > b) {
                kvc_f8 kk = kvc_f8_add(idx, kvc_f8_set1((float)k));
                p = kvc_f8_sel(kvc_m8_and(kvc_f8_ge(kk, av), kvc_f8_lt(kk, bv)), p,
                               kvc_f8_zero());
            }
            kvc_f8_store(s + k, p);
            acc = kvc_f8_add(acc, p);
        }
        t = kvc_f8_fold(acc);
    }
    *l = fmaf(*l, alpha, t);
    *m = mnew;
    return alpha;
}

/* ---------------------------------------------------------------------------------------
 * Values.  For NR queries (probability rows P + q * 64, tile-relative row index) and NS
 * neighbouring 16-channel strips of the packed V tile (Vs, Vs + 16 * KVC_PF_TILE; O + 16):
 * O = O * alpha (when alpha != NULL), then O = fma(p, v, O) over the rows [ra, rb) in order.
 * O rows have stride ldo.  A channel's chain is the same for every NS.
 * ------------------------------------------------------------------------------------- */
KVC_INLINE void kvc_pf_pv16(const float *restrict P, const int NR, const int NS,
                            const float *restrict Vs, ptrdiff_t ra, ptrdiff_t rb,
                            float *restrict O, ptrdiff_t ldo, const float *alpha)
{
    ptrdiff_t r;
    int q, t;
    kvc_f16 acc[KVC_PF_QR][2];
#pragma GCC unroll 6
    for (q = 0; q < NR; ++q)
        for (t = 0; t < NS; ++t) {
            acc[q][t] = kvc_f16_load(O + q * ldo + 16 * t);
            if (alpha)
                acc[q][t] = kvc_f16_mul(acc[q][t], kvc_f16_bcast(alpha + q));
        }
    for (r = ra; r < rb; ++r) {
        kvc_f16 v[2];
        for (t = 0; t < NS; ++t)
            v[t] = kvc_f16_load(Vs + t * 16 * KVC_PF_TILE + r * 16);
#pragma GCC unroll 6
        for (q = 0; q < NR; ++q) {
            kvc_f16 b = kvc_f16_bcast(P + q * KVC_PF_TILE + r);
            for (t = 0; t < NS; ++t)
                acc[q][t] = kvc_f16_fma(b, v[t], acc[q][t]);
        }
    }
#pragma GCC unroll 6
    for (q = 0; q < NR; ++q)
        for (t = 0; t < NS; ++t)
            kvc_f16_store(O + q * ldo + 16 * t, acc[q][t]);
}

/* kvc_pf_pv16 of nr (<= KVC_PF_QR, a run-time count) queries. */
KVC_INLINE void kvc_pf_pv_nr(const float *P, int nr, const int NS, const float *Vs,
                             ptrdiff_t ra, ptrdiff_t rb, float *O, ptrdiff_t ldo,
                             const float *alpha)
{
    /* one run of nr (a block of KVC_PF_QR, or the rest) */
#define KVC_PF_PV(J, N) kvc_pf_pv16(P, N, NS, Vs, ra, rb, O, ldo, alpha)
    KVC_QBLOCKS(nr, KVC_PF_QR, KVC_PF_PV);
#undef KVC_PF_PV
}

/* Values of nr (<= KVC_PF_QR) queries over the rows [ra, rb) of a tile, every strip (two at
 * a time where the body takes two). */
KVC_INLINE void kvc_pf_pv(const float *P, int nr, const float *Vp, ptrdiff_t hdp, ptrdiff_t ra,
                      ptrdiff_t rb, float *O, const float *alpha)
{
    ptrdiff_t d0;
    for (d0 = 0; d0 < hdp; d0 += 16) {
        const float *Vs = Vp + (d0 / 16) * KVC_PF_TILE * 16;
        if (KVC_PF_STRIPS == 2 && d0 + 32 <= hdp) {
            kvc_pf_pv_nr(P, nr, 2, Vs, ra, rb, O + d0, hdp, alpha);
            d0 += 16;
        } else {
            kvc_pf_pv_nr(P, nr, 1, Vs, ra, rb, O + d0, hdp, alpha);
        }
    }
}

/* ---------------------------------------------------------------------------------------
 * One-pass importance of a task, once its queries' maxima qm and sums ql are final: P holds
 * tile ti's probabilities p = exp(s - mu) at P + (ti * nq + j) * 64 (0 outside the query's
 * visible rows of the tile) and MT[ti * nq + j] the running max mt they were taken under
 * (mu = mt, or 0 while mt is -inf).  Tile by tile, the queries in order:
 *   g = (mt == m and m > -inf ? 1 : exp(mt - m)) / l   (l only when it is > 0, else 1)
 *   colsum[p] = fma(p, g, colsum[p])   over the query's visible rows of the tile,
 * colsum[p] indexed by absolute row, set for every row of the ntl tiles from tlo (0 where no
 * query sees it).  A non-finite g (a query whose scores are all -inf or NaN) touches only the
 * visible rows, so the rows the query does not see stay as they are.
 * ------------------------------------------------------------------------------------- */
static void kvc_pf_imp_fold(ptrdiff_t nq, const ptrdiff_t *qf, const ptrdiff_t *qe,
                            const float *qm, const float *ql, const float *P, const float *MT,
                            ptrdiff_t tlo, ptrdiff_t ntl, float *colsum)
{
    ptrdiff_t ti, j, k;
    for (ti = ntl - 1; ti >= 0; --ti) {   /* the tiles written last, still in cache, first */
        const ptrdiff_t t0 = tlo + ti * KVC_PF_TILE, t1 = t0 + KVC_PF_TILE;
        float *cs = colsum + t0;
        memset(cs, 0, KVC_PF_TILE * sizeof(float));
        for (j = 0; j < nq; ++j) {
            if (!(qe[j] > qf[j]) || qf[j] >= t1 || qe[j] <= t0)
                continue;
            const ptrdiff_t a = (qf[j] > t0 ? qf[j] : t0) - t0;
            const ptrdiff_t b = (qe[j] < t1 ? qe[j] : t1) - t0;
            const float *p = P + (ti * nq + j) * KVC_PF_TILE;
            const float m = qm[j], mt = MT[ti * nq + j], l = ql[j] > 0.0f ? ql[j] : 1.0f;
            const float g = (mt == m && m > -INFINITY ? 1.0f : kvc_expf(mt - m)) / l;
            if (isfinite(g)) {
                /* the lanes of [a / 8 * 8, b) outside [a, b) hold p = 0: adding 0 * g
                 * leaves the sum as it is (never -0) */
                const kvc_f8 gv = kvc_f8_set1(g);
                for (k = a / 8 * 8; k < b; k += 8)
                    kvc_f8_store(cs + k, kvc_f8_fma(kvc_f8_load(p + k), gv, kvc_f8_load(cs + k)));
            } else {
                for (k = a; k < b; ++k)
                    cs[k] = fmaf(p[k], g, cs[k]);
            }
        }
    }
}

/* ---------------------------------------------------------------------------------------
 * One task: nq queries (rows of q, stride hd) of one KV group with visible rows
 * [qf[j], qe[j]).  kf/kq/ks and vf/vq/vs point at the group's row 0.  Writes out (nq x hd)
 * and the final running max and sum of each query (qm, ql).  With pbuf (KVC_PF_PBUF_FLOATS(
 * ntiles, nq) floats, ntiles the tiles that meet the union of the visible rows), the tiles'
 * probabilities are kept there and the task's importance is folded into colsum
 * (kvc_pf_imp_fold); without (NULL), neither is touched.
 * ------------------------------------------------------------------------------------- */
KVC_INLINE void kvc_pf_task_impl(const float *q, ptrdiff_t nq, const ptrdiff_t *qf,
                                 const ptrdiff_t *qe, const float *kf, const int8_t *kq,
                                 const float *ks, ptrdiff_t ks_stride, int quant_k,
                                 const kvc_k4 *k4,
                                 const float *vf, const int8_t *vq, const float *vs,
                                 ptrdiff_t vs_stride, int quant_v, const uint8_t *vc4,
                                 const uint16_t *vp, const float *vcol,
                                 ptrdiff_t hd, float scale, float softcap, float *out,
                                 float *qm, float *ql, float *scratch, float *pbuf,
                                 float *colsum, ptrdiff_t group, const int8_t *qi,
                                 const float *qsc, const int32_t *qsum)
{
    const ptrdiff_t hdp = KVC_PF_PAD16(hd);
    float *Kp = scratch;
    float *Vp = Kp + KVC_PF_KP_FLOATS(hd);
    float *S = Vp + hdp * KVC_PF_TILE;
    /* the int8 tile in Kp's place: the scales, then the codes */
    const ptrdiff_t ng = quant_k == KVC_K_Q8 ? KVC_I8_GROUPS(hd, group) : 0;
    float *K8sc = Kp;
    uint8_t *K8 = (uint8_t *)(Kp + KVC_PF_TILE * ng);
    float *O = S + nq * KVC_PF_TILE;
    float *alpha = O + nq * hdp;
    float *MT = NULL;
    ptrdiff_t lo = PTRDIFF_MAX, hi = 0, j, d, t0, tlo, ntl;
    for (j = 0; j < nq; ++j) {
        qm[j] = -INFINITY;
        ql[j] = 0.0f;
        if (qe[j] > qf[j]) {
            lo = qf[j] < lo ? qf[j] : lo;
            hi = qe[j] > hi ? qe[j] : hi;
        }
    }
    memset(O, 0, (size_t)(nq * hdp) * sizeof(float));
    tlo = hi > lo ? lo / KVC_PF_TILE * KVC_PF_TILE : hi;
    ntl = (hi - tlo + KVC_PF_TILE - 1) / KVC_PF_TILE;
    if (pbuf)
        MT = pbuf + ntl * nq * KVC_PF_TILE;
    for (t0 = tlo; t0 < hi; t0 += KVC_PF_TILE) {
        ptrdiff_t t1 = t0 + KVC_PF_TILE, ti = (t0 - tlo) / KVC_PF_TILE;
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
        if (pbuf)   /* the tile's scores and probabilities stay in the task's buffer */
            S = pbuf + ti * nq * KVC_PF_TILE;
        if (quant_k == KVC_K_Q4)
            kvc_pf_load_k4(k4, t0, r0, r1, hd, Kp, alpha + nq + 16);   /* KVC_PF_K4_TMP */
        else if (!quant_k)
            kvc_pf_load_k(kf, t0, r0, r1, hd, Kp);
        else
            kvc_k8_pack(kq, ks, ks_stride, ng, t0, r0, r1, hd, K8, K8sc);
        kvc_pf_load_v(vf, vq, vs, vs_stride, quant_v, vc4, vp, t0, r0, r1, hd, Vp);
        /* the next tile's rows go to L2 while this one is computed, a few rows per block
         * of queries (a burst of prefetches would stall on the miss buffers) */
        ptrdiff_t pf_next = t1, pf_end = hi < t1 + KVC_PF_TILE ? hi : t1 + KVC_PF_TILE;
        ptrdiff_t pf_step = (KVC_PF_TILE * KVC_PF_QR + (jb - ja) - 1) / (jb - ja);
        if (quant_k == KVC_K_Q8) {
            kvc_pf_scores8(qi + ja * KVC_I8_PAD(hd), qsc + ja * ng, qsum + ja * ng, ng, jb - ja,
                           K8, K8sc, hd, group, r0 - t0, r1 - t0, S + ja * KVC_PF_TILE,
                           KVC_PF_TILE);
        } else {
            kvc_pf_scores(q + ja * hd, hd, jb - ja, Kp, hd, r0 - t0, r1 - t0,
                          S + ja * KVC_PF_TILE, KVC_PF_TILE);
        }
        for (j = ja; j < jb; ++j) {
            ptrdiff_t a = (qf[j] > t0 ? qf[j] : t0) - t0, b = (qe[j] < t1 ? qe[j] : t1) - t0;
            float *s = S + j * KVC_PF_TILE;
            if (!(qe[j] > qf[j]) || a >= b) {
                alpha[j] = 1.0f;
                memset(s, 0, KVC_PF_TILE * sizeof(float));
                continue;
            }
            alpha[j] = kvc_pf_softmax_step(s, a, b, scale, softcap, qm + j, ql + j);
            if (MT)
                MT[ti * nq + j] = qm[j];   /* the running max p was taken under (0: -inf) */
        }
        /* values, by blocks of queries: the rows all of the block see go through the
         * register-blocked kernel, the rest query by query (each row chain stays in order) */
        for (j = ja; j < jb; j += KVC_PF_QR) {
            int nr = jb - j < KVC_PF_QR ? (int)(jb - j) : KVC_PF_QR, i;
            if (pf_next < pf_end) {
                ptrdiff_t p1 = pf_end - pf_next < pf_step ? pf_end : pf_next + pf_step;
                if (quant_k == KVC_K_Q4) {
                    ptrdiff_t pq = p1 < k4->qlen ? p1 : k4->qlen;
                    if (pf_next < pq)
                        kvc_pf_prefetch(k4->codes, pf_next, pq, hd / 2);
                } else if (quant_k) {
                    kvc_pf_prefetch(kq, pf_next, p1, hd);
                    kvc_pf_prefetch(ks, pf_next, p1, ks_stride * 4);
                } else {
                    kvc_pf_prefetch(kf, pf_next, p1, hd * 4);
                }
                if (quant_v == KVC_V_Q4) {
                    kvc_pf_prefetch(vc4, pf_next, p1, hd / 2);
                    kvc_pf_prefetch(vp, pf_next, p1, 4 * KVC_V4_NG(hd));
                } else if (quant_v) {
                    kvc_pf_prefetch(vq, pf_next, p1, hd);
                    kvc_pf_prefetch(vs, pf_next, p1, vs_stride * 4);
                } else {
                    kvc_pf_prefetch(vf, pf_next, p1, hd * 4);
                }
                pf_next = p1;
            }
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
                    kvc_pf_pv(S + jj * KVC_PF_TILE, 1, Vp, hdp, ai[i], bi[i], O + jj * hdp,
                              alpha + jj);
                }
                continue;
            }
            if (!same_start)
                for (i = 0; i < nr; ++i)
                    kvc_pf_pv(S + (j + i) * KVC_PF_TILE, 1, Vp, hdp, ai[i], A,
                              O + (j + i) * hdp, alpha + j + i);
            kvc_pf_pv(S + j * KVC_PF_TILE, nr, Vp, hdp, A, B, O + j * hdp,
                      same_start ? alpha + j : NULL);
            for (i = 0; i < nr; ++i)
                if (bi[i] > B)
                    kvc_pf_pv(S + (j + i) * KVC_PF_TILE, 1, Vp, hdp, B, bi[i],
                              O + (j + i) * hdp, NULL);
        }
    }
    for (j = 0; j < nq; ++j) {
        float *o = out + j * hd;
        const float *src = O + j * hdp;
        if (!(qe[j] > qf[j])) {
            memset(o, 0, (size_t)hd * sizeof(float));
            continue;
        }
        float lj = ql[j];
        for (d = 0; d < hd; ++d)
            o[d] = src[d] / lj;
        if (quant_v == KVC_V_Q8)
            for (d = 0; d < hd; ++d)
                o[d] = o[d] * vcol[d];
    }
    if (pbuf)
        kvc_pf_imp_fold(nq, qf, qe, qm, ql, pbuf, MT, tlo, ntl, colsum);
}

/* The task specialised for the common head dims (the constant lets the compiler unroll and
 * address the inner loops; the arithmetic, and so every bit, is the same). */
static void kvc_pf_task(const float *q, ptrdiff_t nq, const ptrdiff_t *qf, const ptrdiff_t *qe,
                        const float *kf, const int8_t *kq, const float *ks, ptrdiff_t ks_stride,
                        int quant_k, const kvc_k4 *k4, const float *vf, const int8_t *vq, const float *vs,
                        ptrdiff_t vs_stride, int quant_v, const uint8_t *vc4,
                        const uint16_t *vp, const float *vcol, ptrdiff_t hd,
                        float scale, float softcap, float *out, float *qm, float *ql,
                        float *scratch, float *pbuf, float *colsum, ptrdiff_t group,
                        const int8_t *qi, const float *qsc, const int32_t *qsum)
{
#define KVC_PF_TASK(HD) kvc_pf_task_impl(q, nq, qf, qe, kf, kq, ks, ks_stride, quant_k, k4, vf, vq, \
                                         vs, vs_stride, quant_v, vc4, vp, vcol, HD, scale, \
                                         softcap, out, \
                                         qm, ql, scratch, pbuf, colsum, group, qi, qsc, qsum)
    switch (hd) {
    case 64: KVC_PF_TASK(64); break;
    case 128: KVC_PF_TASK(128); break;
    default: KVC_PF_TASK(hd); break;
    }
#undef KVC_PF_TASK
}

#endif
