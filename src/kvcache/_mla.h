/* Absorbed Multi-head Latent Attention (DeepSeek-V2 MLA) decode: the inner loops behind
 * _core.mla_attend.  AVX2/FMA intrinsics with a portable C twin that computes the same bits
 * (no -ffast-math; tests/c/portable_twin.c compiles both and compares).
 *
 * Geometry: H query heads; the latent rank r and the shared RoPE key width dr; W_UK is
 * (H, dn, r) and W_UV (H, dv, r).  Cache rows: lat (T x r), kr (T x dr), both row-major.
 * The absorbed query of one position is kept TRANSPOSED, qT[(r + dr) x Hp] (Hp = H rounded up
 * to a multiple of 8, padding columns zero), so that one score is one lane of a vector over
 * heads: every latent element is loaded once and multiplied into 8 or 16 heads at a time.
 *
 * Summation orders (fixed, independent of thread count and of the SIMD path):
 *   fold      qa[h][x] = sum over k ascending of qn[h][k] * wuk[h][k][x]: one fma per k
 *   scores    the latent part cut into chunks of KVC_MLA_CHUNK elements from x = 0, then
 *             the RoPE part likewise; each chunk c_j = one fma per element, x ascending, from
 *             0; s[t][h] = ((c_0 + c_1) + c_2 ...) * scale (chunks in order, latent first)
 *   task      a position's visible rows are cut into tasks of `task_rows` rows from row 0
 *             (a function of T only); a task walks its rows in blocks of KVC_MLA_BLOCK and
 *             keeps, per head, a running max m, sum l and latent accumulator acc[r]:
 *               b = max of the block's scores (NaN ignored); m' = max(m, b)
 *               if m' > m and m > -inf: a = exp(m - m'), l *= a, acc *= a
 *               p = exp(s - m') (0 when s = -inf; NaN scores stay NaN); l += p, rows
 *               ascending
 *               acc[x] = fma(p, lat[t][x], acc[x]), rows ascending
 *   merge     per head over the tasks of its position in task order, skipping tasks with
 *             m = -inf and l = 0: M = max m_c; w = exp(m_c - M); L = fma(l_c, w, L);
 *             c[x] = fma(w, acc_c[x], c[x]); then c[x] /= L when L > 0, else NaN (all
 *             scores -inf, or a NaN: the IEEE softmax's answer)
 *   unfold    out[h][j] = kvc_dot_f32(wuv[h][j], c[h], r)  (the 8-lane order of _kernels.h)
 * exp is kvc_expf / kvc_expf8 (identical bits).
 */
#ifndef KVCACHE_MLA_H
#define KVCACHE_MLA_H

#include "_kernels.h"

#define KVC_MLA_BLOCK 64          /* rows per online-softmax block (~147 KiB at r=512) */
#define KVC_MLA_CHUNK 64          /* elements per partial sum of a score */

/* Absorbed query of one (position, head): qa = W_UK[h]^T qn, written into column h of qT,
 * followed by the head's RoPE query qr (dr floats) in rows r .. r + dr - 1. */
static void kvc_mla_fold(const float *restrict qn, const float *restrict qr,
                         const float *restrict wuk, ptrdiff_t dn, ptrdiff_t r, ptrdiff_t dr,
                         ptrdiff_t h, ptrdiff_t Hp, float *restrict qa, float *restrict qT)
{
    ptrdiff_t k = 0, x;
    memset(qa, 0, (size_t)r * sizeof(float));
    for (; k + 4 <= dn; k += 4)
        kvc_axpy4_f32(qa, qn + k, wuk + k * r, wuk + (k + 1) * r, wuk + (k + 2) * r,
                      wuk + (k + 3) * r, r);
    for (; k < dn; ++k)
        kvc_axpy_f32(qa, qn[k], wuk + k * r, r);
    for (x = 0; x < r; ++x)
        qT[x * Hp + h] = qa[x];
    for (x = 0; x < dr; ++x)
        qT[(r + x) * Hp + h] = qr[x];
}

/* ---- scores of nb rows for all heads: S[t * Hp + h] ------------------------------------ */

#if KVC_SIMD
/* One chunk (len <= KVC_MLA_CHUNK elements) of the scores of NR rows x NV head-vectors (8 heads
 * each): fresh accumulators, then S = c (first chunk) or S = S + c.  src points at element x0
 * of row 0 (rows ld floats apart), qc at row x0 of qT.  pf: the same elements of the next
 * block's rows, prefetched a cache line at a time (NULL: none). */
KVC_INLINE void kvc_mla_score_chunk(const float *restrict qc, ptrdiff_t Hp, const float *src,
                                    ptrdiff_t ld, ptrdiff_t len, int NR, int NV, float *S,
                                    int first, const float *pf)
{
    __m256 c[6][2];
    int i, v;
    ptrdiff_t x;
    for (i = 0; i < NR; ++i)
        for (v = 0; v < NV; ++v)
            c[i][v] = _mm256_setzero_ps();
    for (x = 0; x < len; ++x) {
        if (pf && (x & 15) == 0)
            for (i = 0; i < NR; ++i)
                __builtin_prefetch(pf + i * ld + x, 0, 2);
        __m256 q0 = _mm256_loadu_ps(qc + x * Hp);
        __m256 q1 = NV > 1 ? _mm256_loadu_ps(qc + x * Hp + 8) : q0;
        for (i = 0; i < NR; ++i) {
            __m256 b = _mm256_broadcast_ss(src + i * ld + x);
            c[i][0] = _mm256_fmadd_ps(q0, b, c[i][0]);
            if (NV > 1)
                c[i][1] = _mm256_fmadd_ps(q1, b, c[i][1]);
        }
    }
    for (i = 0; i < NR; ++i)
        for (v = 0; v < NV; ++v) {
            float *sp = S + i * Hp + 8 * v;
            _mm256_storeu_ps(sp, first ? c[i][v] : _mm256_add_ps(_mm256_loadu_ps(sp), c[i][v]));
        }
}

/* Scores of NR rows x NV head-vectors: the latent part in chunks, then the RoPE part in
 * chunks, then the scale.  pfl/pfk: the next block's rows to prefetch (NULL: none). */
KVC_INLINE void kvc_mla_score_tile(const float *restrict qT, ptrdiff_t Hp, const float *lat,
                                   const float *kr, ptrdiff_t r, ptrdiff_t dr, int NR, int NV,
                                   float scale, float *S, const float *pfl, const float *pfk)
{
    ptrdiff_t x0;
    int i, v;
    for (x0 = 0; x0 < r; x0 += KVC_MLA_CHUNK)
        kvc_mla_score_chunk(qT + x0 * Hp, Hp, lat + x0, r,
                            r - x0 < KVC_MLA_CHUNK ? r - x0 : KVC_MLA_CHUNK, NR, NV, S, x0 == 0,
                            pfl ? pfl + x0 : NULL);
    for (x0 = 0; x0 < dr; x0 += KVC_MLA_CHUNK)
        kvc_mla_score_chunk(qT + (r + x0) * Hp, Hp, kr + x0, dr,
                            dr - x0 < KVC_MLA_CHUNK ? dr - x0 : KVC_MLA_CHUNK, NR, NV, S, 0,
                            pfk ? pfk + x0 : NULL);
    __m256 sv = _mm256_set1_ps(scale);
    for (i = 0; i < NR; ++i)
        for (v = 0; v < NV; ++v)
            _mm256_storeu_ps(S + i * Hp + 8 * v, _mm256_mul_ps(_mm256_loadu_ps(S + i * Hp + 8 * v), sv));
}
#endif

/* Rows [0, pf_rows) of (pf_lat, pf_kr) -- the next block -- are prefetched a tile at a time
 * while this block is scored, so the stream from memory overlaps the arithmetic. */
static void kvc_mla_scores(const float *restrict qT, ptrdiff_t Hp, const float *lat,
                           const float *kr, ptrdiff_t r, ptrdiff_t dr, ptrdiff_t nb, float scale,
                           float *restrict S, const float *pf_lat, const float *pf_kr,
                           ptrdiff_t pf_rows)
{
#if KVC_SIMD
    ptrdiff_t t = 0, v;
    for (; t + 6 <= nb; t += 6) {
        /* rows t..t+5 of the next block are prefetched inside the first head-vector pass,
         * spread over its arithmetic */
        const float *pl = t + 6 <= pf_rows ? pf_lat + t * r : NULL;
        const float *pk = t + 6 <= pf_rows ? pf_kr + t * dr : NULL;
        if (!pl && t < pf_rows) {
            kvc_prefetch_rows_to(pf_lat, t, pf_rows - t, r * (ptrdiff_t)sizeof(float), 1);
            kvc_prefetch_rows_to(pf_kr, t, pf_rows - t, dr * (ptrdiff_t)sizeof(float), 1);
        }
        for (v = 0; v + 16 <= Hp; v += 16) {
            kvc_mla_score_tile(qT + v, Hp, lat + t * r, kr + t * dr, r, dr, 6, 2, scale, S + t * Hp + v, pl, pk);
            pl = pk = NULL;
        }
        if (v < Hp)
            kvc_mla_score_tile(qT + v, Hp, lat + t * r, kr + t * dr, r, dr, 6, 1, scale, S + t * Hp + v, pl, pk);
    }
    if (t < nb) {
        if (t < pf_rows) {
            kvc_prefetch_rows_to(pf_lat, t, pf_rows - t, r * (ptrdiff_t)sizeof(float), 1);
            kvc_prefetch_rows_to(pf_kr, t, pf_rows - t, dr * (ptrdiff_t)sizeof(float), 1);
        }
#define KVC_MLA_REM(NR) \
        for (v = 0; v + 16 <= Hp; v += 16) \
            kvc_mla_score_tile(qT + v, Hp, lat + t * r, kr + t * dr, r, dr, NR, 2, scale, S + t * Hp + v, NULL, NULL); \
        if (v < Hp) \
            kvc_mla_score_tile(qT + v, Hp, lat + t * r, kr + t * dr, r, dr, NR, 1, scale, S + t * Hp + v, NULL, NULL);
        switch (nb - t) {
        case 5: KVC_MLA_REM(5) break;
        case 4: KVC_MLA_REM(4) break;
        case 3: KVC_MLA_REM(3) break;
        case 2: KVC_MLA_REM(2) break;
        default: KVC_MLA_REM(1) break;
        }
#undef KVC_MLA_REM
    }
#else
    ptrdiff_t t, h, x;
    (void)pf_lat;
    (void)pf_kr;
    (void)pf_rows;
    ptrdiff_t x0, x1;
    for (t = 0; t < nb; ++t)
        for (h = 0; h < Hp; ++h) {
            float s = 0.0f;
            for (x0 = 0; x0 < r; x0 += KVC_MLA_CHUNK) {
                float c = 0.0f;
                x1 = r - x0 < KVC_MLA_CHUNK ? r : x0 + KVC_MLA_CHUNK;
                for (x = x0; x < x1; ++x)
                    c = fmaf(qT[x * Hp + h], lat[t * r + x], c);
                s = x0 == 0 ? c : s + c;
            }
            for (x0 = 0; x0 < dr; x0 += KVC_MLA_CHUNK) {
                float c = 0.0f;
                x1 = dr - x0 < KVC_MLA_CHUNK ? dr : x0 + KVC_MLA_CHUNK;
                for (x = x0; x < x1; ++x)
                    c = fmaf(qT[(r + x) * Hp + h], kr[t * dr + x], c);
                s = s + c;
            }
            S[t * Hp + h] = s * scale;
        }
#endif
}

/* ---- acc[h][x] += sum over rows of P[t][h] lat[t][x] (rows ascending, one fma each) ------ */

#if KVC_SIMD
/* NH heads (<= 6) x NV latent vectors (<= 2) of accumulators over nb rows. */
KVC_INLINE void kvc_mla_acc_tile(const float *P, ptrdiff_t Hp, const float *lat, ptrdiff_t r,
                                 ptrdiff_t nb, int NH, int NV, float *acc)
{
    __m256 a[6][2];
    int i, v;
    ptrdiff_t t;
    for (i = 0; i < NH; ++i)
        for (v = 0; v < NV; ++v)
            a[i][v] = _mm256_loadu_ps(acc + i * r + 8 * v);
    for (t = 0; t < nb; ++t) {
        __m256 l0 = _mm256_loadu_ps(lat + t * r);
        __m256 l1 = NV > 1 ? _mm256_loadu_ps(lat + t * r + 8) : l0;
        for (i = 0; i < NH; ++i) {
            __m256 p = _mm256_broadcast_ss(P + t * Hp + i);
            a[i][0] = _mm256_fmadd_ps(p, l0, a[i][0]);
            if (NV > 1)
                a[i][1] = _mm256_fmadd_ps(p, l1, a[i][1]);
        }
    }
    for (i = 0; i < NH; ++i)
        for (v = 0; v < NV; ++v)
            _mm256_storeu_ps(acc + i * r + 8 * v, a[i][v]);
}

#define KVC_MLA_ACC_HEADS(NV) { \
    ptrdiff_t h = 0; \
    for (; h + 6 <= H; h += 6) \
        kvc_mla_acc_tile(P + h, Hp, lat + x, r, nb, 6, NV, acc + h * r + x); \
    switch (H - h) { \
    case 5: kvc_mla_acc_tile(P + h, Hp, lat + x, r, nb, 5, NV, acc + h * r + x); break; \
    case 4: kvc_mla_acc_tile(P + h, Hp, lat + x, r, nb, 4, NV, acc + h * r + x); break; \
    case 3: kvc_mla_acc_tile(P + h, Hp, lat + x, r, nb, 3, NV, acc + h * r + x); break; \
    case 2: kvc_mla_acc_tile(P + h, Hp, lat + x, r, nb, 2, NV, acc + h * r + x); break; \
    case 1: kvc_mla_acc_tile(P + h, Hp, lat + x, r, nb, 1, NV, acc + h * r + x); break; \
    default: break; } }
#endif

static void kvc_mla_accumulate(const float *restrict P, ptrdiff_t Hp, ptrdiff_t H,
                               const float *restrict lat, ptrdiff_t r, ptrdiff_t nb,
                               float *restrict acc)
{
    ptrdiff_t x = 0, t, h;
#if KVC_SIMD
    for (; x + 16 <= r; x += 16)
        KVC_MLA_ACC_HEADS(2)
    for (; x + 8 <= r; x += 8)
        KVC_MLA_ACC_HEADS(1)
#endif
    for (h = 0; h < H; ++h)
        for (ptrdiff_t xx = x; xx < r; ++xx) {
            float a = acc[h * r + xx];
            for (t = 0; t < nb; ++t)
                a = fmaf(P[t * Hp + h], lat[t * r + xx], a);
            acc[h * r + xx] = a;
        }
}

/* One task: rows [p0, p1) of one position.  acc (H x r), m and l (Hp each) are the task's
 * partial state; S is KVC_MLA_BLOCK x Hp scratch.  Rows up to pf_end (>= p1) may be
 * prefetched, never read. */
static void kvc_mla_task(const float *restrict qT, ptrdiff_t H, ptrdiff_t Hp,
                         const float *lat, const float *kr, ptrdiff_t r, ptrdiff_t dr,
                         ptrdiff_t p0, ptrdiff_t p1, ptrdiff_t pf_end, float scale,
                         float *restrict acc, float *restrict m, float *restrict l,
                         float *restrict S)
{
    ptrdiff_t b0, t, h, x;
    for (h = 0; h < Hp; ++h) {
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
    memset(acc, 0, (size_t)(H * r) * sizeof(float));
    for (b0 = p0; b0 < p1; b0 += KVC_MLA_BLOCK) {
        ptrdiff_t nb = p1 - b0 < KVC_MLA_BLOCK ? p1 - b0 : KVC_MLA_BLOCK;
        /* the next block; after the last one, the rows after p1 (up to pf_end), which the
         * same thread reads next when tasks are handed out in contiguous runs */
        ptrdiff_t nx = pf_end - b0 - nb < KVC_MLA_BLOCK ? pf_end - b0 - nb : KVC_MLA_BLOCK;
        kvc_mla_scores(qT, Hp, lat + b0 * r, kr + b0 * dr, r, dr, nb, scale, S,
                       lat + (b0 + nb) * r, kr + (b0 + nb) * dr, nx);
        for (h = 0; h < H; ++h) {
            float b = -INFINITY;
            for (t = 0; t < nb; ++t) {
                float v = S[t * Hp + h];
                b = v > b ? v : b;
            }
            float mn = b > m[h] ? b : m[h];
            if (mn > m[h] && m[h] > -INFINITY) {
                float a = kvc_expf(m[h] - mn);
                l[h] *= a;
                float *restrict ah = acc + h * r;
                for (x = 0; x < r; ++x)
                    ah[x] *= a;
            }
            m[h] = mn;
        }
        for (t = 0; t < nb; ++t) {
            float *restrict st = S + t * Hp;
            h = 0;
#if KVC_SIMD
            for (; h + 8 <= H; h += 8) {
                __m256 sv = _mm256_loadu_ps(st + h);
                __m256 e = kvc_expf8(_mm256_sub_ps(sv, _mm256_loadu_ps(m + h)));
                e = _mm256_andnot_ps(_mm256_cmp_ps(sv, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ), e);
                _mm256_storeu_ps(st + h, e);
                _mm256_storeu_ps(l + h, _mm256_add_ps(_mm256_loadu_ps(l + h), e));
            }
#endif
            for (; h < H; ++h) {
                float e = st[h] == -INFINITY ? 0.0f : kvc_expf(st[h] - m[h]);
                st[h] = e;
                l[h] += e;
            }
        }
        kvc_mla_accumulate(S, Hp, H, lat + b0 * r, r, nb, acc);
    }
}

/* Merge the nt task partials of one head (strides: acc by acc_stride floats, m and l by
 * ml_stride) and apply W_UV: out[j] = W_UV[h][j] . c.  c: r floats of scratch. */
static void kvc_mla_merge_head(const float *acc, ptrdiff_t acc_stride, const float *m,
                               const float *l, ptrdiff_t ml_stride, ptrdiff_t nt,
                               const float *restrict wuv, ptrdiff_t r, ptrdiff_t dv,
                               float *restrict c, float *restrict out)
{
    ptrdiff_t k, x, j = 0;
    float M = -INFINITY, L = 0.0f;
    for (k = 0; k < nt; ++k) {
        float mk = m[k * ml_stride];
        M = mk > M ? mk : M;
    }
    memset(c, 0, (size_t)r * sizeof(float));
    for (k = 0; k < nt; ++k) {
        float mk = m[k * ml_stride];
        if (mk == -INFINITY && l[k * ml_stride] == 0.0f)
            continue;                 /* no rows, or every score -inf: contributes nothing */
        float w = kvc_expf(mk - M);
        L = fmaf(l[k * ml_stride], w, L);
        kvc_axpy_f32(c, w, acc + k * acc_stride, r);
    }
    if (L > 0.0f)
        for (x = 0; x < r; ++x)
            c[x] = c[x] / L;
    else                              /* every score -inf (0/0) or a NaN: as IEEE softmax does */
        for (x = 0; x < r; ++x)
            c[x] = NAN;
    for (; j + 4 <= dv; j += 4)
        kvc_dot4_f32(c, wuv + j * r, wuv + (j + 1) * r, wuv + (j + 2) * r, wuv + (j + 3) * r,
                     r, out + j);
    for (; j < dv; ++j)
        out[j] = kvc_dot_f32(c, wuv + j * r, r);
}

/* Machine probe for the benchmark: `iters` steps of 10 independent chains of 8-lane fused
 * multiply-adds (80 FMAs per step), enough chains to cover the FMA latency on current x86
 * cores.  Returns a value that depends on every chain so nothing is optimised away. */
static float kvc_fma_probe(long iters, float x)
{
    long i;
    int k;
#if KVC_SIMD
    __m256 a[10], b = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-7f);
    for (k = 0; k < 10; ++k)
        a[k] = _mm256_set1_ps(x + (float)k);
    for (i = 0; i < iters; ++i)
        for (k = 0; k < 10; ++k)
            a[k] = _mm256_fmadd_ps(a[k], b, c);
    __m256 s = a[0];
    for (k = 1; k < 10; ++k)
        s = _mm256_add_ps(s, a[k]);
    float t[8];
    _mm256_storeu_ps(t, s);
    return t[0] + t[7];
#else
    float a[80];
    for (k = 0; k < 80; ++k)
        a[k] = x + (float)k;
    for (i = 0; i < iters; ++i)
        for (k = 0; k < 80; ++k)
            a[k] = fmaf(a[k], 0.999999f, 1e-7f);
    float s = 0.0f;
    for (k = 0; k < 80; ++k)
        s += a[k];
    return s;
#endif
}

#endif
