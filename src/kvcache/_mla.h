/* Absorbed Multi-head Latent Attention (DeepSeek-V2 MLA) decode: the inner loops behind
 * _core.mla_attend.  Three bodies of a task (scores, online softmax, latent sums) compute the
 * same bits (no -ffast-math): the portable C twin (a build without AVX2/FMA), the AVX2/FMA
 * body on 8-float vectors (the SIMD build's baseline) and the AVX-512 body on 16-float
 * vectors, which kvc_mla_task_for() picks for the body KVC_ISA_AVX512 (_isa.h).  The two SIMD
 * bodies are one source compiled twice (see "the SIMD bodies" below).
 * tests/c/portable_twin.c and tests/c/mla_paths.c compile them and compare the bits.
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
#ifndef KVC_MLA_PASS
#ifndef KVCACHE_MLA_H
#define KVCACHE_MLA_H

#include "_kernels.h"
#include "_isa.h"


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

/* ---- the portable twin: scores, latent sums, one task ------------------------------------
 * Plain C in the documented orders; the SIMD bodies below compute the same bits. */

#if !KVC_VEC_X86
static void kvc_mla_scores_c(const float *restrict qT, ptrdiff_t Hp, const float *lat,
                             const float *kr, ptrdiff_t r, ptrdiff_t dr, ptrdiff_t nb,
                             float scale, float *restrict S)
{
    ptrdiff_t t, h, x, x0, x1;
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
}

static void kvc_mla_task_c(const float *restrict qT, ptrdiff_t H, ptrdiff_t Hp,
                           const float *lat, const float *kr, ptrdiff_t r, ptrdiff_t dr,
                           ptrdiff_t p0, ptrdiff_t p1, ptrdiff_t pf_end, float scale,
                           float *restrict acc, float *restrict m, float *restrict l,
                           float *restrict S)
{
    ptrdiff_t b0, t, h, x;
    (void)pf_end;
    for (h = 0; h < Hp; ++h) {
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
    memset(acc, 0, (size_t)(H * r) * sizeof(float));
    for (b0 = p0; b0 < p1; b0 += KVC_MLA_BLOCK) {
        ptrdiff_t nb = p1 - b0 < KVC_MLA_BLOCK ? p1 - b0 : KVC_MLA_BLOCK;
        kvc_mla_scores_c(qT, Hp, lat + b0 * r, kr + b0 * dr, r, dr, nb, scale, S);
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
                for (x = 0; x < r; ++x)
                    acc[h * r + x] *= a;
            }
            m[h] = mn;
        }
        for (t = 0; t < nb; ++t)
            for (h = 0; h < H; ++h) {
                float *st = S + t * Hp + h;
                float e = *st == -INFINITY ? 0.0f : kvc_expf(*st - m[h]);
                *st = e;
                l[h] += e;
            }
        for (h = 0; h < H; ++h)
            for (x = 0; x < r; ++x) {
                float a = acc[h * r + x];
                for (t = 0; t < nb; ++t)
                    a = fmaf(S[t * Hp + h], lat[(b0 + t) * r + x], a);
                acc[h * r + x] = a;
            }
    }
}
#endif

/* ---- prefetch of the next block ---------------------------------------------------------
 * While a block is scored and summed, the next block's rows (two contiguous byte ranges: its
 * latents and its RoPE keys) are asked for in L2, a few cache lines at each score chunk and
 * each latent-sum tile, so that the stream from memory is spread evenly over the block's
 * arithmetic instead of arriving in bursts. */
#define KVC_MLA_PF_STRIDE 64       /* bytes between two prefetches: every cache line */
#define KVC_MLA_PF_HINT 2          /* __builtin_prefetch locality: L2 and below */
typedef struct {
    const char *p, *e, *p2, *e2;   /* the two ranges still to ask for */
    ptrdiff_t per;                 /* lines per step */
} kvc_mla_pf;

KVC_INLINE void kvc_mla_pf_step(kvc_mla_pf *f)
{
    ptrdiff_t k;
    for (k = 0; k < f->per; ++k) {
        if (f->p < f->e) {
            __builtin_prefetch(f->p, 0, KVC_MLA_PF_HINT);
            f->p += KVC_MLA_PF_STRIDE;
        } else if (f->p2 < f->e2) {
            __builtin_prefetch(f->p2, 0, KVC_MLA_PF_HINT);
            f->p2 += KVC_MLA_PF_STRIDE;
        } else {
            break;
        }
    }
}

/* The next block: rows [0, nx) of (lat, kr); the steps of this block (nb rows, H heads, score
 * tiles of `rows` rows over head-vectors of w floats) share its lines. */
KVC_INLINE void kvc_mla_pf_start(kvc_mla_pf *f, const float *lat, const float *kr,
                                 ptrdiff_t nx, ptrdiff_t H, ptrdiff_t Hp, ptrdiff_t r,
                                 ptrdiff_t dr, ptrdiff_t nb, ptrdiff_t rows, ptrdiff_t w)
{
    ptrdiff_t lines, steps;
    if (nx <= 0) {
        f->p = f->e = f->p2 = f->e2 = NULL;
        f->per = 0;
        return;
    }
    f->p = (const char *)((uintptr_t)lat & ~(uintptr_t)63);
    f->e = (const char *)(lat + nx * r);
    f->p2 = (const char *)((uintptr_t)kr & ~(uintptr_t)63);
    f->e2 = (const char *)(kr + nx * dr);
    lines = (f->e - f->p + KVC_MLA_PF_STRIDE - 1) / KVC_MLA_PF_STRIDE
            + (f->e2 - f->p2 + KVC_MLA_PF_STRIDE - 1) / KVC_MLA_PF_STRIDE;
    steps = ((nb + rows - 1) / rows + 3) * ((Hp + 2 * w - 1) / (2 * w))
            * ((r + KVC_MLA_CHUNK - 1) / KVC_MLA_CHUNK + (dr + KVC_MLA_CHUNK - 1) / KVC_MLA_CHUNK)
            + ((r + 2 * w - 1) / (2 * w)) * ((H + 5) / 6);
    f->per = (lines + steps - 1) / steps;
}

/* Whatever the steps left. */
KVC_INLINE void kvc_mla_pf_finish(kvc_mla_pf *f)
{
    f->per = PTRDIFF_MAX;
    kvc_mla_pf_step(f);
}

/* ---- the SIMD bodies ----------------------------------------------------------------------
 * One body, written over a thin vector layer (KVC_MV* below: load, store, broadcast, fma, add,
 * mul, sub, exp, "0 where the score is -inf" on a vector of KVC_MVW floats), is compiled twice
 * by including this file into itself: with 8-float __m256 vectors (the AVX2/FMA unit,
 * functions named *_avx2) and with 16-float vectors (functions named *_avx512, compiled with
 * KVC_TARGET_AVX512 and __m512 intrinsics).  Lane j of a vector is one head (scores) or one
 * latent element (sums) and carries its own chain of operations, so the width changes how
 * many chains run side by side, never the order inside one: both bodies and the portable twin
 * give the same bits.  The 16-float body hands a remainder of 8 heads or 8 elements to the
 * 8-float code, and exp runs as two kvc_expf8 on the halves of a vector.
 *
 * KVC_EMULATE_512 (tests only: tests/c/mla_paths.c) builds the 16-float body from pairs of
 * __m256 operations, so that the very code of the AVX-512 path runs, and is compared bit for
 * bit, on a machine without AVX-512. */

#if KVC_VEC_X86 && defined(KVC_EMULATE_512) /* interim: the AVX-512 unit gets its body with the layer */
#define KVC_MLA_HAS512 1
#else
#define KVC_MLA_HAS512 0
#endif

#if KVC_MLA_HAS512
#if defined(KVC_EMULATE_512)
#define KVC_T512
typedef struct { __m256 lo, hi; } kvc_v16;
KVC_INLINE kvc_v16 kvc_v16_pair(__m256 lo, __m256 hi)
{
    kvc_v16 v;
    v.lo = lo;
    v.hi = hi;
    return v;
}
KVC_INLINE kvc_v16 kvc_v16_load(const float *p)
{
    return kvc_v16_pair(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8));
}
KVC_INLINE void kvc_v16_store(float *p, kvc_v16 v)
{
    _mm256_storeu_ps(p, v.lo);
    _mm256_storeu_ps(p + 8, v.hi);
}
KVC_INLINE kvc_v16 kvc_v16_bcast(const float *p)
{
    __m256 b = _mm256_broadcast_ss(p);
    return kvc_v16_pair(b, b);
}
KVC_INLINE kvc_v16 kvc_v16_set1(float x)
{
    return kvc_v16_pair(_mm256_set1_ps(x), _mm256_set1_ps(x));
}
KVC_INLINE kvc_v16 kvc_v16_fma(kvc_v16 a, kvc_v16 b, kvc_v16 c)
{
    return kvc_v16_pair(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi));
}
KVC_INLINE kvc_v16 kvc_v16_add(kvc_v16 a, kvc_v16 b)
{
    return kvc_v16_pair(_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi));
}
KVC_INLINE kvc_v16 kvc_v16_sub(kvc_v16 a, kvc_v16 b)
{
    return kvc_v16_pair(_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi));
}
KVC_INLINE kvc_v16 kvc_v16_mul(kvc_v16 a, kvc_v16 b)
{
    return kvc_v16_pair(_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi));
}
KVC_INLINE kvc_v16 kvc_v16_exp(kvc_v16 a)
{
    return kvc_v16_pair(kvc_expf8(a.lo), kvc_expf8(a.hi));
}
/* e, with 0 in the lanes where s is -inf */
KVC_INLINE kvc_v16 kvc_v16_zero_neginf(kvc_v16 s, kvc_v16 e)
{
    __m256 ninf = _mm256_set1_ps(-INFINITY);
    return kvc_v16_pair(_mm256_andnot_ps(_mm256_cmp_ps(s.lo, ninf, _CMP_EQ_OQ), e.lo),
                        _mm256_andnot_ps(_mm256_cmp_ps(s.hi, ninf, _CMP_EQ_OQ), e.hi));
}
#else
#define KVC_T512 KVC_TARGET_AVX512
typedef __m512 kvc_v16;
KVC_INLINE KVC_T512 kvc_v16 kvc_v16_load(const float *p) { return _mm512_loadu_ps(p); }
KVC_INLINE KVC_T512 void kvc_v16_store(float *p, kvc_v16 v) { _mm512_storeu_ps(p, v); }
KVC_INLINE KVC_T512 kvc_v16 kvc_v16_bcast(const float *p) { return _mm512_set1_ps(*p); }
KVC_INLINE KVC_T512 kvc_v16 kvc_v16_set1(float x) { return _mm512_set1_ps(x); }
KVC_INLINE KVC_T512 kvc_v16 kvc_v16_fma(kvc_v16 a, kvc_v16 b, kvc_v16 c)
{
    return _mm512_fmadd_ps(a, b, c);
}
KVC_INLINE KVC_T512 kvc_v16 kvc_v16_add(kvc_v16 a, kvc_v16 b) { return _mm512_add_ps(a, b); }
KVC_INLINE KVC_T512 kvc_v16 kvc_v16_sub(kvc_v16 a, kvc_v16 b) { return _mm512_sub_ps(a, b); }
KVC_INLINE KVC_T512 kvc_v16 kvc_v16_mul(kvc_v16 a, kvc_v16 b) { return _mm512_mul_ps(a, b); }
KVC_INLINE KVC_T512 kvc_v16 kvc_v16_exp(kvc_v16 a)
{
    __m256 lo = kvc_expf8(_mm512_castps512_ps256(a));
    __m256 hi = kvc_expf8(_mm512_extractf32x8_ps(a, 1));
    return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
}
KVC_INLINE KVC_T512 kvc_v16 kvc_v16_zero_neginf(kvc_v16 s, kvc_v16 e)
{
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(s, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ),
                                e, _mm512_setzero_ps());
}
#endif
#endif

#if KVC_VEC_X86
/* Rows per score tile, by vector width.  8 floats: 5 rows x 2 head-vectors = 10 accumulators,
 * enough to cover the FMA latency, and 16 ymm registers leave room for the two query vectors
 * and the broadcast (6 rows measured slower: the compiler spills).  16 floats: 12 rows of one
 * zmm head-vector (16 heads), or 12 x 2 = 24 of the 32 zmm registers. */
#ifndef KVC_MLA_TILE_ROWS8
#define KVC_MLA_TILE_ROWS8 5
#endif
#ifndef KVC_MLA_TILE_ROWS16
#define KVC_MLA_TILE_ROWS16 12
#endif
#define KVC_MLA_TILE_MAX 12       /* rows of a score tile at most: KVC_MLA_EACH's count */
#define KVC_MLA_EACH(M) M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7) M(8) M(9) M(10) M(11)
#define KVC_MLA_EACH6(M) M(0) M(1) M(2) M(3) M(4) M(5)

/* the 8-float body */
#define KVC_MLA_PASS 8
#include "_mla.h"
#undef KVC_MLA_PASS
#if KVC_MLA_HAS512
/* the 16-float body */
#define KVC_MLA_PASS 16
#include "_mla.h"
#undef KVC_MLA_PASS
#endif
#endif

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

/* ---- dispatch ------------------------------------------------------------------------- */

typedef void (*kvc_mla_task_fn)(const float *qT, ptrdiff_t H, ptrdiff_t Hp, const float *lat,
                                const float *kr, ptrdiff_t r, ptrdiff_t dr, ptrdiff_t p0,
                                ptrdiff_t p1, ptrdiff_t pf_end, float scale, float *acc,
                                float *m, float *l, float *S);

/* The task body for body id `body` (_isa.h): the 16-float body for KVC_ISA_AVX512 where this
 * file holds it, else the 8-float one on a SIMD build (AVX-VNNI brings nothing to float
 * kernels), the portable twin otherwise.  A caller reads it once per call, before its
 * parallel region, and has checked that the CPU runs that body. */
static inline kvc_mla_task_fn kvc_mla_task_for(int body)
{
#if KVC_MLA_HAS512
    if (body == KVC_ISA_AVX512)
        return kvc_mla_task_avx512;
#endif
#if KVC_VEC_X86
    (void)body;
    return kvc_mla_task_avx2;
#else
    (void)body;
    return kvc_mla_task_c;
#endif
}

/* The name of that body: "avx512", "avx2" or "portable". */
static inline const char *kvc_mla_path_for(int body)
{
#if KVC_MLA_HAS512
    if (body == KVC_ISA_AVX512)
        return "avx512";
#endif
    (void)body;
    return KVC_VEC_X86 ? "avx2" : "portable";
}

/* The C test programs' form: the body of kvc_isa. */


/* One task: rows [p0, p1) of one position.  acc (H x r), m and l (Hp each) are the task's
 * partial state; S is KVC_MLA_BLOCK x Hp scratch.  Rows up to pf_end (>= p1) may be
 * prefetched, never read.  Runs the body kvc_mla_task_select() names. */
static inline void kvc_mla_task(const float *restrict qT, ptrdiff_t H, ptrdiff_t Hp,
                         const float *lat, const float *kr, ptrdiff_t r, ptrdiff_t dr,
                         ptrdiff_t p0, ptrdiff_t p1, ptrdiff_t pf_end, float scale,
                         float *restrict acc, float *restrict m, float *restrict l,
                         float *restrict S)
{
    kvc_mla_task_for(0)(qT, H, Hp, lat, kr, r, dr, p0, p1, pf_end, scale, acc, m, l, S);
}

/* Machine probe for the benchmark: `iters` steps of 10 independent chains of 8-lane fused
 * multiply-adds (80 FMAs per step), enough chains to cover the FMA latency on current x86
 * cores.  Returns a value that depends on every chain so nothing is optimised away. */
static float kvc_fma_probe(long iters, float x)
{
    long i;
    int k;
#if KVC_VEC_X86
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

#endif /* KVCACHE_MLA_H */

#else /* KVC_MLA_PASS: one SIMD body of the scores, the latent sums and a task ------------- */

#if KVC_MLA_PASS == 8
#define KVC_MVW 8
#define KVC_MV __m256
#define KVC_MVLOAD _mm256_loadu_ps
#define KVC_MVSTORE _mm256_storeu_ps
#define KVC_MVBCAST _mm256_broadcast_ss
#define KVC_MVSET1 _mm256_set1_ps
#define KVC_MVFMA _mm256_fmadd_ps
#define KVC_MVADD _mm256_add_ps
#define KVC_MVSUB _mm256_sub_ps
#define KVC_MVMUL _mm256_mul_ps
#define KVC_MVEXP kvc_expf8
#define KVC_MVZNEGINF(s, e) \
    _mm256_andnot_ps(_mm256_cmp_ps((s), _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ), (e))
#define KVC_MVFN(name) name##_avx2
#define KVC_MVTGT
#define KVC_MVROWS KVC_MLA_TILE_ROWS8
#else
#define KVC_MVW 16
#define KVC_MV kvc_v16
#define KVC_MVLOAD kvc_v16_load
#define KVC_MVSTORE kvc_v16_store
#define KVC_MVBCAST kvc_v16_bcast
#define KVC_MVSET1 kvc_v16_set1
#define KVC_MVFMA kvc_v16_fma
#define KVC_MVADD kvc_v16_add
#define KVC_MVSUB kvc_v16_sub
#define KVC_MVMUL kvc_v16_mul
#define KVC_MVEXP kvc_v16_exp
#define KVC_MVZNEGINF kvc_v16_zero_neginf
#define KVC_MVFN(name) name##_avx512
#define KVC_MVTGT KVC_T512
#define KVC_MVROWS KVC_MLA_TILE_ROWS16
#endif

/* One chunk (len <= KVC_MLA_CHUNK elements) of the scores of NR rows x NV head-vectors:
 * fresh accumulators, one fma per element in order, then S = c (first chunk) or S = S + c.
 * src points at element x0 of row 0 (rows ld floats apart), qc at row x0 of qT.  pf: the
 * prefetch stream (NULL: none), one step per chunk.  The accumulators are named variables,
 * not an array, so that they stay in registers. */
KVC_INLINE KVC_MVTGT void KVC_MVFN(kvc_mla_score_chunk)(const float *restrict qc, ptrdiff_t Hp,
                                                        const float *src, ptrdiff_t ld,
                                                        ptrdiff_t len, int NR, int NV, float *S,
                                                        int first, kvc_mla_pf *pf)
{
    ptrdiff_t x;
    KVC_MV z = KVC_MVSET1(0.0f);
#define KVC_MLA_DECL(j) KVC_MV c##j##_0 = z, c##j##_1 = z;
    KVC_MLA_EACH(KVC_MLA_DECL)
#undef KVC_MLA_DECL
    if (pf)
        kvc_mla_pf_step(pf);
    for (x = 0; x < len; ++x) {
        KVC_MV q0 = KVC_MVLOAD(qc + x * Hp);
        KVC_MV q1 = NV > 1 ? KVC_MVLOAD(qc + x * Hp + KVC_MVW) : q0;
#define KVC_MLA_FMA(j) \
        if (NR > j) { \
            KVC_MV b = KVC_MVBCAST(src + j * ld + x); \
            c##j##_0 = KVC_MVFMA(q0, b, c##j##_0); \
            if (NV > 1) \
                c##j##_1 = KVC_MVFMA(q1, b, c##j##_1); \
        }
        KVC_MLA_EACH(KVC_MLA_FMA)
#undef KVC_MLA_FMA
    }
#define KVC_MLA_STORE(j) \
    if (NR > j) { \
        float *sp = S + j * Hp; \
        KVC_MVSTORE(sp, first ? c##j##_0 : KVC_MVADD(KVC_MVLOAD(sp), c##j##_0)); \
        if (NV > 1) \
            KVC_MVSTORE(sp + KVC_MVW, first ? c##j##_1 \
                                            : KVC_MVADD(KVC_MVLOAD(sp + KVC_MVW), c##j##_1)); \
    }
    KVC_MLA_EACH(KVC_MLA_STORE)
#undef KVC_MLA_STORE
}

/* Scores of NR rows x NV head-vectors: the latent part in chunks, then the RoPE part in
 * chunks, then the scale. */
KVC_INLINE KVC_MVTGT void KVC_MVFN(kvc_mla_score_tile)(const float *restrict qT, ptrdiff_t Hp,
                                                     const float *lat, const float *kr,
                                                     ptrdiff_t r, ptrdiff_t dr, int NR, int NV,
                                                     float scale, float *S, kvc_mla_pf *pf)
{
    ptrdiff_t x0;
    int i, v;
    for (x0 = 0; x0 < r; x0 += KVC_MLA_CHUNK)
        KVC_MVFN(kvc_mla_score_chunk)(qT + x0 * Hp, Hp, lat + x0, r,
                                     r - x0 < KVC_MLA_CHUNK ? r - x0 : KVC_MLA_CHUNK, NR, NV, S,
                                     x0 == 0, pf);
    for (x0 = 0; x0 < dr; x0 += KVC_MLA_CHUNK)
        KVC_MVFN(kvc_mla_score_chunk)(qT + (r + x0) * Hp, Hp, kr + x0, dr,
                                     dr - x0 < KVC_MLA_CHUNK ? dr - x0 : KVC_MLA_CHUNK, NR, NV,
                                     S, 0, pf);
    KVC_MV sv = KVC_MVSET1(scale);
    for (i = 0; i < NR; ++i)
        for (v = 0; v < NV; ++v)
            KVC_MVSTORE(S + i * Hp + KVC_MVW * v, KVC_MVMUL(KVC_MVLOAD(S + i * Hp + KVC_MVW * v), sv));
}

/* NR rows for every head: pairs of head-vectors, a single one, and (16-float body) a last 8
 * heads through the 8-float tile. */
KVC_INLINE KVC_MVTGT void KVC_MVFN(kvc_mla_score_rows)(const float *restrict qT, ptrdiff_t Hp,
                                                     const float *lat, const float *kr,
                                                     ptrdiff_t r, ptrdiff_t dr, int NR,
                                                     float scale, float *S, kvc_mla_pf *pf)
{
    ptrdiff_t v = 0;
    for (; v + 2 * KVC_MVW <= Hp; v += 2 * KVC_MVW) {
        KVC_MVFN(kvc_mla_score_tile)(qT + v, Hp, lat, kr, r, dr, NR, 2, scale, S + v, pf);
    }
    for (; v + KVC_MVW <= Hp; v += KVC_MVW) {
        KVC_MVFN(kvc_mla_score_tile)(qT + v, Hp, lat, kr, r, dr, NR, 1, scale, S + v, pf);
    }
#if KVC_MVW == 16
    if (v < Hp)                       /* Hp is a multiple of 8 */
        kvc_mla_score_tile_avx2(qT + v, Hp, lat, kr, r, dr, NR, 1, scale, S + v, pf);
#endif
}

/* Scores of nb rows for all heads, S[t * Hp + h]: tiles of KVC_MVROWS rows, then 4, 2, 1. */
static KVC_MVTGT void KVC_MVFN(kvc_mla_scores)(const float *restrict qT, ptrdiff_t Hp,
                                               const float *lat, const float *kr, ptrdiff_t r,
                                               ptrdiff_t dr, ptrdiff_t nb, float scale,
                                               float *restrict S, kvc_mla_pf *pf)
{
    ptrdiff_t t = 0;
#define KVC_MLA_ROWS(NR) { \
        KVC_MVFN(kvc_mla_score_rows)(qT, Hp, lat + t * r, kr + t * dr, r, dr, (NR), scale, \
                                     S + t * Hp, pf); \
        t += (NR); }
    while (t + KVC_MVROWS <= nb)
        KVC_MLA_ROWS(KVC_MVROWS)
    while (t + 4 <= nb)
        KVC_MLA_ROWS(4)
    if (t + 2 <= nb)
        KVC_MLA_ROWS(2)
    if (t < nb)
        KVC_MLA_ROWS(1)
#undef KVC_MLA_ROWS
}

/* acc[h][x] += sum over rows of P[t][h] lat[t][x] for NH heads (<= 6) x NV vectors (<= 2) of
 * latent elements: rows ascending, one fma each (named accumulators, as above). */
KVC_INLINE KVC_MVTGT void KVC_MVFN(kvc_mla_acc_tile)(const float *P, ptrdiff_t Hp,
                                                     const float *lat, ptrdiff_t r,
                                                     ptrdiff_t nb, int NH, int NV, float *acc,
                                                     kvc_mla_pf *pf)
{
    ptrdiff_t t;
    KVC_MV z = KVC_MVSET1(0.0f);
    if (pf)
        kvc_mla_pf_step(pf);
#define KVC_MLA_LOAD(j) \
    KVC_MV a##j##_0 = NH > j ? KVC_MVLOAD(acc + j * r) : z; \
    KVC_MV a##j##_1 = NH > j && NV > 1 ? KVC_MVLOAD(acc + j * r + KVC_MVW) : z;
    KVC_MLA_EACH6(KVC_MLA_LOAD)
#undef KVC_MLA_LOAD
    for (t = 0; t < nb; ++t) {
        KVC_MV l0 = KVC_MVLOAD(lat + t * r);
        KVC_MV l1 = NV > 1 ? KVC_MVLOAD(lat + t * r + KVC_MVW) : l0;
#define KVC_MLA_FMA(j) \
        if (NH > j) { \
            KVC_MV p = KVC_MVBCAST(P + t * Hp + j); \
            a##j##_0 = KVC_MVFMA(p, l0, a##j##_0); \
            if (NV > 1) \
                a##j##_1 = KVC_MVFMA(p, l1, a##j##_1); \
        }
        KVC_MLA_EACH6(KVC_MLA_FMA)
#undef KVC_MLA_FMA
    }
#define KVC_MLA_STORE(j) \
    if (NH > j) { \
        KVC_MVSTORE(acc + j * r, a##j##_0); \
        if (NV > 1) \
            KVC_MVSTORE(acc + j * r + KVC_MVW, a##j##_1); \
    }
    KVC_MLA_EACH6(KVC_MLA_STORE)
#undef KVC_MLA_STORE
}

/* One slice of NV vectors of latent elements, all heads, in tiles of 6 heads. */
KVC_INLINE KVC_MVTGT void KVC_MVFN(kvc_mla_acc_slice)(const float *P, ptrdiff_t Hp, ptrdiff_t H,
                                                      const float *lat, ptrdiff_t r,
                                                      ptrdiff_t nb, int NV, float *acc,
                                                      kvc_mla_pf *pf)
{
    ptrdiff_t h;
    for (h = 0; h + 6 <= H; h += 6)
        KVC_MVFN(kvc_mla_acc_tile)(P + h, Hp, lat, r, nb, 6, NV, acc + h * r, pf);
    switch (H - h) {
    case 5: KVC_MVFN(kvc_mla_acc_tile)(P + h, Hp, lat, r, nb, 5, NV, acc + h * r, pf); break;
    case 4: KVC_MVFN(kvc_mla_acc_tile)(P + h, Hp, lat, r, nb, 4, NV, acc + h * r, pf); break;
    case 3: KVC_MVFN(kvc_mla_acc_tile)(P + h, Hp, lat, r, nb, 3, NV, acc + h * r, pf); break;
    case 2: KVC_MVFN(kvc_mla_acc_tile)(P + h, Hp, lat, r, nb, 2, NV, acc + h * r, pf); break;
    case 1: KVC_MVFN(kvc_mla_acc_tile)(P + h, Hp, lat, r, nb, 1, NV, acc + h * r, pf); break;
    default: break;
    }
}

static KVC_MVTGT void KVC_MVFN(kvc_mla_accumulate)(const float *restrict P, ptrdiff_t Hp,
                                                 ptrdiff_t H, const float *restrict lat,
                                                 ptrdiff_t r, ptrdiff_t nb, float *restrict acc,
                                                 kvc_mla_pf *pf)
{
    ptrdiff_t x = 0, t, h;
    for (; x + 2 * KVC_MVW <= r; x += 2 * KVC_MVW)
        KVC_MVFN(kvc_mla_acc_slice)(P, Hp, H, lat + x, r, nb, 2, acc + x, pf);
    for (; x + KVC_MVW <= r; x += KVC_MVW)
        KVC_MVFN(kvc_mla_acc_slice)(P, Hp, H, lat + x, r, nb, 1, acc + x, pf);
#if KVC_MVW == 16
    for (; x + 8 <= r; x += 8)
        kvc_mla_acc_slice_avx2(P, Hp, H, lat + x, r, nb, 1, acc + x, pf);
#endif
    for (h = 0; h < H; ++h)
        for (ptrdiff_t xx = x; xx < r; ++xx) {
            float a = acc[h * r + xx];
            for (t = 0; t < nb; ++t)
                a = fmaf(P[t * Hp + h], lat[t * r + xx], a);
            acc[h * r + xx] = a;
        }
}

/* One task (see kvc_mla_task). */
static KVC_MVTGT void KVC_MVFN(kvc_mla_task)(const float *restrict qT, ptrdiff_t H,
                                           ptrdiff_t Hp, const float *lat, const float *kr,
                                           ptrdiff_t r, ptrdiff_t dr, ptrdiff_t p0,
                                           ptrdiff_t p1, ptrdiff_t pf_end, float scale,
                                           float *restrict acc, float *restrict m,
                                           float *restrict l, float *restrict S)
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
        kvc_mla_pf pf;
        kvc_mla_pf_start(&pf, lat + (b0 + nb) * r, kr + (b0 + nb) * dr, nx, H, Hp, r, dr, nb,
                         KVC_MVROWS, KVC_MVW);
        KVC_MVFN(kvc_mla_scores)(qT, Hp, lat + b0 * r, kr + b0 * dr, r, dr, nb, scale, S, &pf);
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
            for (; h + KVC_MVW <= H; h += KVC_MVW) {
                KVC_MV sv = KVC_MVLOAD(st + h);
                KVC_MV e = KVC_MVZNEGINF(sv, KVC_MVEXP(KVC_MVSUB(sv, KVC_MVLOAD(m + h))));
                KVC_MVSTORE(st + h, e);
                KVC_MVSTORE(l + h, KVC_MVADD(KVC_MVLOAD(l + h), e));
            }
#if KVC_MVW == 16
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
        KVC_MVFN(kvc_mla_accumulate)(S, Hp, H, lat + b0 * r, r, nb, acc, &pf);
        kvc_mla_pf_finish(&pf);
    }
}

#undef KVC_MVW
#undef KVC_MV
#undef KVC_MVLOAD
#undef KVC_MVSTORE
#undef KVC_MVBCAST
#undef KVC_MVSET1
#undef KVC_MVFMA
#undef KVC_MVADD
#undef KVC_MVSUB
#undef KVC_MVMUL
#undef KVC_MVEXP
#undef KVC_MVZNEGINF
#undef KVC_MVFN
#undef KVC_MVTGT
#undef KVC_MVROWS
#endif
