/* One instruction-set body of the int8 scoring kernel (docs/numerics.md, "q8 scoring").
 * _kernels.h includes this file once per body with
 *   KVC_I8_NAME(x)   the function name of the body (x ## _avx2, ...)
 *   KVC_I8_ATTR      the body's target attribute (empty for AVX2: the unit is compiled for it)
 *   KVC_I8_DPBUSD    vpdpbusd (acc, unsigned bytes, signed bytes) for the VNNI bodies;
 *                    undefined for AVX2, which uses vpmaddubsw/vpmaddwd
 * and every body computes kvc_i8_score1's bits (integer sums are exact, the float steps are
 * elementwise with lanes = rows).
 *
 * Per K group g (16 or 32 channels) of eight rows r (lanes) the exact int32 dot product
 * isum[r] of the query codes and the row codes is formed, 32 channels at a time, as:
 *   AVX2   vpmaddubsw(|k|, sign(q, k)) -- |k| <= 128 unsigned, q * sign(k) in [-127, 127]
 *          signed, so each int16 pair sum is at most 2 * 128 * 127 = 32512 (no saturation) --
 *          then vpmaddwd with ones (int32 sums of four products);
 *   VNNI   vpdpbusd(0, k ^ 0x80, q) = sum (k + 128) q, then minus 128 * sum(q_g) (exact);
 * then the eight per-lane vectors are reduced to one vector of eight row sums (integer adds:
 * any order gives the same value).  The float step is acc = fma((float)isum, sq_g * sk_g, acc)
 * lane by lane, groups in order; groups past the last whole 32 channels (a partial last group,
 * or a 16-channel group at head_dim % 32 == 16) are summed in scalar C.
 */

/* One float step of the 8 lanes (rows): acc = fma((float)isum, sq_g * sk_g[r], acc). */
#define KVC_I8_STEP(G, ISUM) do { \
        __m256 skv_ = _mm256_setr_ps(ks[(G)], ks[ks_stride + (G)], ks[2 * ks_stride + (G)], \
                                     ks[3 * ks_stride + (G)], ks[4 * ks_stride + (G)], \
                                     ks[5 * ks_stride + (G)], ks[6 * ks_stride + (G)], \
                                     ks[7 * ks_stride + (G)]); \
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ISUM), \
                              _mm256_mul_ps(_mm256_set1_ps(sq[(G)]), skv_), acc); \
    } while (0)

/* out[r] = kvc_i8_score1(qi, sq, k + r * hd, ks + r * ks_stride, hd, group) for r < 8, group
 * 16 or 32.  Each 32-channel chunk c gives per row eight int32 lanes (lane l: channels 4l..4l+3
 * of the chunk); the 8 x 8 reduction leaves lo = rows 0-7 of lanes 0-3 (channels 0-15) and
 * hi = rows 0-7 of lanes 4-7 (channels 16-31): two 16-channel groups, or their int32 sum as
 * one 32-channel group.  Groups past the last whole chunk are summed in scalar C. */
KVC_I8_ATTR static inline __attribute__((always_inline)) void
KVC_I8_NAME(kvc_i8_score8)(const int8_t *restrict qi, const float *restrict sq,
                           const int32_t *restrict qsum, const int8_t *restrict k,
                           const float *restrict ks, ptrdiff_t ks_stride, ptrdiff_t hd,
                           ptrdiff_t group, float *restrict out)
{
    const ptrdiff_t nchunk = hd / 32, ng = (hd + group - 1) / group, gpc = 32 / group;
    ptrdiff_t c, g, r, d;
    __m256 acc = _mm256_setzero_ps();
#ifdef KVC_I8_DPBUSD
    const __m256i x80 = _mm256_set1_epi8((char)0x80);
#else
    const __m256i ones = _mm256_set1_epi16(1);
    (void)qsum;
#endif
    for (c = 0; c < nchunk; ++c) {
        const __m256i qv = _mm256_loadu_si256((const __m256i *)(qi + 32 * c));
        __m256i m[8];
#pragma GCC unroll 8
        for (r = 0; r < 8; ++r) {
            __m256i kv = _mm256_loadu_si256((const __m256i *)(k + r * hd + 32 * c));
#ifdef KVC_I8_DPBUSD
            m[r] = KVC_I8_DPBUSD(_mm256_setzero_si256(), _mm256_xor_si256(kv, x80), qv);
#else
            m[r] = _mm256_madd_epi16(
                _mm256_maddubs_epi16(_mm256_abs_epi8(kv), _mm256_sign_epi8(qv, kv)), ones);
#endif
        }
        __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(m[0], m[1]),
                                      _mm256_hadd_epi32(m[2], m[3]));
        __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(m[4], m[5]),
                                      _mm256_hadd_epi32(m[6], m[7]));
        __m256i lo = _mm256_permute2x128_si256(a, b, 0x20);
        __m256i hi = _mm256_permute2x128_si256(a, b, 0x31);
        if (gpc == 1) {
            __m256i isum = _mm256_add_epi32(lo, hi);
#ifdef KVC_I8_DPBUSD
            isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(128 * qsum[c]));
#endif
            KVC_I8_STEP(c, isum);
        } else {
#ifdef KVC_I8_DPBUSD
            lo = _mm256_sub_epi32(lo, _mm256_set1_epi32(128 * qsum[2 * c]));
            hi = _mm256_sub_epi32(hi, _mm256_set1_epi32(128 * qsum[2 * c + 1]));
#endif
            KVC_I8_STEP(2 * c, lo);
            KVC_I8_STEP(2 * c + 1, hi);
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
        KVC_I8_STEP(g, _mm256_loadu_si256((const __m256i *)t));
    }
    _mm256_storeu_ps(out, acc);
}

#undef KVC_I8_STEP

KVC_I8_ATTR static inline __attribute__((always_inline)) void
KVC_I8_NAME(kvc_i8_rows_impl)(const int8_t *qi, const float *sq, const int32_t *qsum,
                              const int8_t *k, const float *ks, ptrdiff_t ks_stride,
                              ptrdiff_t hd, ptrdiff_t group, ptrdiff_t n, float *out)
{
    ptrdiff_t i = 0;
    for (; i + 8 <= n; i += 8)
        KVC_I8_NAME(kvc_i8_score8)(qi, sq, qsum, k + i * hd, ks + i * ks_stride, ks_stride, hd,
                                   group, out + i);
    for (; i < n; ++i)
        out[i] = kvc_i8_score1(qi, sq, k + i * hd, ks + i * ks_stride, hd, group);
}

/* out[i] = the raw q8 score of row i (rows k + i * hd, scales ks + i * ks_stride), i < n, with
 * K groups of `group` (16 or 32) channels; specialised for head dims 64 and 128 (same
 * arithmetic). */
KVC_I8_ATTR static void KVC_I8_NAME(kvc_i8_rows)(const int8_t *qi, const float *sq,
                                                const int32_t *qsum, const int8_t *k,
                                                const float *ks, ptrdiff_t ks_stride,
                                                ptrdiff_t hd, ptrdiff_t group, ptrdiff_t n,
                                                float *out)
{
#define KVC_I8_CALL(HD, G) KVC_I8_NAME(kvc_i8_rows_impl)(qi, sq, qsum, k, ks, ks_stride, HD, G, n, out)
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
