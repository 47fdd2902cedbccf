/* The q8 scoring kernel (docs/numerics.md, "q8 scoring"), written once on the vector layer:
 * the integer step is kvc_i8_dot32x8 (_vec.h: AVX2 vpmaddubsw, VNNI vpdpbusd, NEON smull or
 * sdot, or plain C, whichever the unit is compiled for), the float step elementwise with
 * lanes = rows, so every target computes kvc_i8_score1's bits.
 *
 * Per K group g (16 or 32 channels) of eight rows r (lanes) the exact int32 dot product
 * isum[r] of the query codes and the row codes is formed, 32 channels at a time; the float step
 * is acc = fma((float)isum, sq_g * sk_g, acc) lane by lane, groups in order; groups past the
 * last whole 32 channels (a partial last group, or a 16-channel group at head_dim % 32 == 16)
 * are summed in scalar C.  Included by _kernels.h after kvc_i8_score1.
 */
#ifndef KVCACHE_I8DOT_H
#define KVCACHE_I8DOT_H

/* One float step of the 8 lanes (rows): acc = fma((float)isum, sq_g * sk_g[r], acc). */
KVC_INLINE kvc_f8 kvc_i8_step(kvc_f8 acc, kvc_i8x isum, float sq_g, const float *ks,
                              ptrdiff_t ks_stride, ptrdiff_t g)
{
    kvc_f8 skv = kvc_f8_setr(ks[g], ks[ks_stride + g], ks[2 * ks_stride + g],
                             ks[3 * ks_stride + g], ks[4 * ks_stride + g],
                             ks[5 * ks_stride + g], ks[6 * ks_stride + g],
                             ks[7 * ks_stride + g]);
    return kvc_f8_fma(kvc_i8x_to_f8(isum), kvc_f8_mul(kvc_f8_set1(sq_g), skv), acc);
}

/* out[r] = kvc_i8_score1(qi, sq, k + r * hd, ks + r * ks_stride, hd, group) for r < 8, group
 * 16 or 32.  Chunk c of 32 channels gives per row lo (channels 0-15) and hi (16-31): two
 * 16-channel groups, or their int32 sum as one 32-channel group. */
KVC_INLINE void kvc_i8_score8(const int8_t *restrict qi, const float *restrict sq,
                              const int32_t *restrict qsum, const int8_t *restrict k,
                              const float *restrict ks, ptrdiff_t ks_stride, ptrdiff_t hd,
                              ptrdiff_t group, float *restrict out)
{
    const ptrdiff_t nchunk = hd / 32, ng = (hd + group - 1) / group, gpc = 32 / group;
    ptrdiff_t c, g, r, d;
    kvc_f8 acc = kvc_f8_zero();
    for (c = 0; c < nchunk; ++c) {
        kvc_i8x lo, hi;
        if (gpc == 1) {
            kvc_i8_dot32x8(qi + 32 * c, k + 32 * c, hd, qsum[c], 0, &lo, &hi);
            acc = kvc_i8_step(acc, kvc_i8x_add(lo, hi), sq[c], ks, ks_stride, c);
        } else {
            kvc_i8_dot32x8(qi + 32 * c, k + 32 * c, hd, qsum[2 * c], qsum[2 * c + 1], &lo, &hi);
            acc = kvc_i8_step(acc, lo, sq[2 * c], ks, ks_stride, 2 * c);
            acc = kvc_i8_step(acc, hi, sq[2 * c + 1], ks, ks_stride, 2 * c + 1);
        }
    }
    for (g = nchunk * gpc; g < ng; ++g) {
        const ptrdiff_t g1 = hd - g * group < group ? hd : (g + 1) * group;
        int32_t t[8];
        for (r = 0; r < 8; ++r) {
            int32_t s = 0;
            for (d = g * group; d < g1; ++d)
                s += (int32_t)qi[d] * (int32_t)k[r * hd + d];
            t[r] = s;
        }
        acc = kvc_i8_step(acc, kvc_i8x_load(t), sq[g], ks, ks_stride, g);
    }
    kvc_f8_store(out, acc);
}

KVC_INLINE void kvc_i8_rows_impl(const int8_t *qi, const float *sq, const int32_t *qsum,
                                 const int8_t *k, const float *ks, ptrdiff_t ks_stride,
                                 ptrdiff_t hd, ptrdiff_t group, ptrdiff_t n, float *out)
{
    ptrdiff_t i = 0;
    for (; i + 8 <= n; i += 8)
        kvc_i8_score8(qi, sq, qsum, k + i * hd, ks + i * ks_stride, ks_stride, hd, group,
                      out + i);
    for (; i < n; ++i)
        out[i] = kvc_i8_score1(qi, sq, k + i * hd, ks + i * ks_stride, hd, group);
}

/* out[i] = the raw q8 score of row i (rows k + i * hd, scales ks + i * ks_stride), i < n, with
 * K groups of `group` (16 or 32) channels; specialised for head dims 64 and 128 (same
 * arithmetic). */
static void kvc_i8_rows(ptrdiff_t group, const int8_t *qi, const float *sq, const int32_t *qsum,
                        const int8_t *k, const float *ks, ptrdiff_t ks_stride, ptrdiff_t hd,
                        ptrdiff_t n, float *out)
{
#define KVC_I8_CALL(HD, G) kvc_i8_rows_impl(qi, sq, qsum, k, ks, ks_stride, HD, G, n, out)
    if (group == 16) {
        switch (hd) {
        case 64: KVC_I8_CALL(64, 16); break;
        case 128: KVC_I8_CALL(128, 16); break;
        default: KVC_I8_CALL(hd, 16); break;
        }
    } else {
        switch (hd) {
        case 64: KVC_I8_CALL(64, 32); break;
        case 128: KVC_I8_CALL(128, 32); break;
        default: KVC_I8_CALL(hd, 32); break;
        }
    }
#undef KVC_I8_CALL
}

/* ---------------------------------------------------------------------------------------
 * int8 K, blocked across queries: the decode task's scorer (kvc_task_scores_i8) and the prompt
 * kernel's (_prefill.h).  kvc_k8_pack packs rows [r0, r1) of the tile at t0, in whole groups of
 * eight from the one holding r0 (rows of that group before r0 are packed from the store as
 * they are; a row past r1 in the last group stands in as a copy of row r1 - 1; the scores of
 * neither are used) as
 *   codes   Kb[s * KVC_K8_STRIP(hd) + o * 64 + 4 c + i] = kform(k_p[4 o + i]),
 *           p = t0 + 16 s + c: strips of 16 keys, quads of channels o < ceil(hd / 4), past hd
 *           kform(0) (adds 0: the query's codes are 0 there);
 *   scales  Ksc[(s * ng + g) * 16 + c] = the row's scale of K group g.
 * kvc_k8_qk then forms, for NR quantised queries and NS strips, each group's exact int32
 * sum of q k (16 keys per vector, four channels per step) and combines the groups in order
 * as kvc_i8_score1 does, acc = fma((float)isum, sq_g * sk_g, acc) from 0: the same bits as
 * the query-by-query kvc_i8_rows, at a quarter of the instructions of the float tile.
 * ------------------------------------------------------------------------------------- */
#define KVC_K8_STRIP(hd) (((hd) + 3) / 4 * 64) /* bytes of one 16-key strip */
#if KVC_VEC_AVX512
#define KVC_K8_QR 6      /* 12 int and 12 float zmm accumulators over two strips */
#define KVC_K8_STRIPS 2
#else
#define KVC_K8_QR 3      /* 6 + 6 ymm halves over one strip */
#define KVC_K8_STRIPS 1
#endif
/* kvc_k8_qk's accumulators, the decode scorer's query blocks and its scratch hold six */
_Static_assert(KVC_K8_QR <= 6, "at most six queries per kvc_k8_qk call");

KVC_INLINE void kvc_k8_pack(const int8_t *kq, const float *ks, ptrdiff_t ks_stride,
                            ptrdiff_t ng, ptrdiff_t t0, ptrdiff_t r0, ptrdiff_t r1,
                            ptrdiff_t hd, uint8_t *restrict Kb, float *restrict Ksc)
{
    const ptrdiff_t nquad = (hd + 3) / 4;
    ptrdiff_t g, o, i, gi;
    for (g = (r0 - t0) / 8 * 8; g < r1 - t0; g += 8) {
        const ptrdiff_t s = g / 16, c0 = g % 16;
        uint8_t *dst = Kb + s * KVC_K8_STRIP(hd) + 4 * c0;
        ptrdiff_t src[8];
        for (i = 0; i < 8; ++i)
            src[i] = t0 + g + i < r1 ? t0 + g + i : r1 - 1;
        for (gi = 0; gi < ng; ++gi)
            for (i = 0; i < 8; ++i)
                Ksc[(s * ng + gi) * 16 + c0 + i] = ks[src[i] * ks_stride + gi];
        /* 8 rows x 8 quads at a time: row i in a[i], transposed so that a[j] holds quad o + j
         * of the 8 rows (one contiguous store each) */
        for (o = 0; 4 * o + 32 <= hd; o += 8) {
            kvc_i8x a[8];
#pragma GCC unroll 8
            for (i = 0; i < 8; ++i)
                a[i] = kvc_i8x_loadb((const uint8_t *)(kq + src[i] * hd + 4 * o));
            kvc_i8x_transpose8(a);
#pragma GCC unroll 8
            for (i = 0; i < 8; ++i)
                kvc_i8x_storeb(dst + (o + i) * 64, kvc_i8x_kform(a[i]));
        }
        for (; o < nquad; ++o)
            for (i = 0; i < 8; ++i) {
                int b;
                for (b = 0; b < 4; ++b) {
                    const ptrdiff_t d = 4 * o + b;
                    const uint8_t x = d < hd ? (uint8_t)kq[src[i] * hd + d] : 0;
                    dst[o * 64 + 4 * i + b] = (uint8_t)(x ^ (KVC_I8_KOFF ? 0x80 : 0));
                }
            }
    }
}

KVC_INLINE void kvc_k8_qk(const int8_t *restrict qi, ptrdiff_t ldqi, const float *restrict sq,
                          const int32_t *restrict qsum, ptrdiff_t ng, const int NR,
                          const int NS, const uint8_t *restrict Kb, const float *restrict Ksc,
                          ptrdiff_t hd, ptrdiff_t group, float *restrict S, ptrdiff_t lds)
{
    const ptrdiff_t sb = KVC_K8_STRIP(hd), nquad = (hd + 3) / 4, gq = group / 4;
    ptrdiff_t g, o;
    int q, t;
    kvc_f16 acc[6][2];      /* NR <= 5 at the remainder calls of every body */
    kvc_i16x ia[6][2];
#pragma GCC unroll 6
    for (q = 0; q < NR; ++q)
        for (t = 0; t < NS; ++t)
            acc[q][t] = kvc_f16_zero();
    for (g = 0; g < ng; ++g) {
        const ptrdiff_t o1 = (g + 1) * gq < nquad ? (g + 1) * gq : nquad;
#pragma GCC unroll 6
        for (q = 0; q < NR; ++q)
            for (t = 0; t < NS; ++t)
                ia[q][t] = kvc_i16x_set1(-KVC_I8_KOFF * qsum[q * ng + g]);
        for (o = g * gq; o < o1; ++o) {
            kvc_i16x k[2];
            for (t = 0; t < NS; ++t)
                k[t] = kvc_i16x_loadb(Kb + t * sb + o * 64);
#pragma GCC unroll 6
            for (q = 0; q < NR; ++q) {
                int32_t w;
                memcpy(&w, qi + q * ldqi + 4 * o, 4);
                for (t = 0; t < NS; ++t)
                    ia[q][t] = kvc_i16x_dp4k(ia[q][t], k[t], w);
            }
        }
#pragma GCC unroll 6
        for (q = 0; q < NR; ++q) {
            const kvc_f16 sqg = kvc_f16_set1(sq[q * ng + g]);
            for (t = 0; t < NS; ++t)
                acc[q][t] = kvc_f16_fma(kvc_i16x_to_f16(ia[q][t]),
                                        kvc_f16_mul(sqg, kvc_f16_load(Ksc + (t * ng + g) * 16)),
                                        acc[q][t]);
        }
    }
#pragma GCC unroll 6
    for (q = 0; q < NR; ++q)
        for (t = 0; t < NS; ++t)
            kvc_f16_store(S + q * lds + 16 * t, acc[q][t]);
}

#endif
