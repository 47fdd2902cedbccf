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

#endif
