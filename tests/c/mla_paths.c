/* Runs the absorbed MLA decode of _mla.h -- fold, tasks, merge, as _core.mla_attend drives
 * them -- over many geometries and prints every result as raw bits (NaN as "nan").
 * A build holds one body of the task, chosen by the compile flags as for a kernel unit (_vec.h,
 * _mla.h): -DKVC_NO_SIMD the portable one, -mavx2 -mfma -mf16c the 8-float AVX2 one, with
 * -DKVC_EMULATE_512 added the 16-float body on pairs of 8-lane vectors, with the AVX-512 flags
 * the real __m512 one, and on aarch64 the NEON one.  tests/test_mla_paths.py builds each and
 * requires the output of every one it can run to be the portable build's.
 * The first line printed names the body (KVC_MLA_PATH); then each call prints one line: its
 * geometry, a hash of the bits of every result, how many, how many NaN.
 * Usage: mla_paths */
#include "_mla.h"
#include <stdio.h>
#include <stdlib.h>

/* The task, called through a pointer the compiler cannot see through: it stays a function of
 * its own in the program, whose instructions tests/test_mla_paths.py inspects. */
static kvc_mla_task_fn volatile task = kvc_mla_task;

static uint32_t state = 20261202u;
static float rnd(void)
{
    state = state * 1664525u + 1013904223u;
    return ((float)(state >> 8) / 16777216.0f - 0.5f) * 4.0f;
}

/* Every result goes into a running 64-bit FNV-1a hash of its bits (all NaNs hash alike);
 * one line per call prints the geometry, the hash and the count of results. */
static uint64_t hash;
static long count, nans;

static void out(float x)
{
    uint32_t b = 0x7fc00000u;
    int k;
    if (x == x)
        memcpy(&b, &x, 4);
    else
        ++nans;
    for (k = 0; k < 4; ++k) {
        hash ^= (b >> (8 * k)) & 0xffu;
        hash *= 1099511628211ull;
    }
    ++count;
}

/* One call: n positions over T rows, tasks of R rows (position i sees rows [0, T - n + i + 1)). */
static void run(ptrdiff_t H, ptrdiff_t r, ptrdiff_t dr, ptrdiff_t dn, ptrdiff_t dv, ptrdiff_t T,
                ptrdiff_t n, ptrdiff_t R, float scale, float wscale, int special)
{
    ptrdiff_t Hp = (H + 7) / 8 * 8, NT = (T + R - 1) / R, i, c, h, x;
    float *lat = malloc((size_t)(T * r + 64) * 4), *kr = malloc((size_t)(T * dr + 64) * 4);
    float *wuk = malloc((size_t)(H * dn * r + 1) * 4), *wuv = malloc((size_t)(H * dv * r) * 4);
    float *qn = malloc((size_t)(n * H * dn + 1) * 4), *qr = malloc((size_t)(n * H * dr + 1) * 4);
    float *qT = calloc((size_t)((r + dr) * Hp), 4), *qa = malloc((size_t)r * 4);
    float *acc = malloc((size_t)(NT * H * r) * 4), *m = malloc((size_t)(NT * Hp) * 4);
    float *l = malloc((size_t)(NT * Hp) * 4), *S = malloc((size_t)(KVC_MLA_BLOCK * Hp) * 4);
    float *cb = malloc((size_t)r * 4), *o = malloc((size_t)(H * dv) * 4);
    hash = 14695981039346656037ull;
    count = nans = 0;
    for (i = 0; i < T * r; ++i) lat[i] = rnd();
    for (i = 0; i < T * dr; ++i) kr[i] = rnd();
    for (i = 0; i < H * dn * r; ++i) wuk[i] = rnd() * wscale;
    for (i = 0; i < H * dv * r; ++i) wuv[i] = rnd() * 0.2f;
    for (i = 0; i < n * H * dn; ++i) qn[i] = rnd();
    for (i = 0; i < n * H * dr; ++i) qr[i] = rnd();
    if (special == 1 && T > 3)        /* a row whose score is -inf for some heads, +inf for others */
        for (x = 0; x < r; ++x) lat[(T / 3) * r + x] = x == 0 ? INFINITY : 0.0f;
    if (special == 2 && T > 5)        /* a NaN in one row */
        lat[(T / 2) * r + r / 2] = NAN;
    for (i = 0; i < n; ++i) {
        ptrdiff_t e = T - n + i + 1;
        memset(qT, 0, (size_t)((r + dr) * Hp) * 4);
        for (h = 0; h < H; ++h)
            kvc_mla_fold(qn + (i * H + h) * dn, qr + (i * H + h) * dr, wuk + h * dn * r, dn, r, dr,
                         h, Hp, qa, qT);
        for (x = 0; x < (r + dr) * Hp; ++x) out(qT[x]);
        for (c = 0; c < NT; ++c) {
            ptrdiff_t p0 = c * R, p1 = p0 + R < e ? p0 + R : e;
            if (p0 < p1) {
                task(qT, H, Hp, lat, kr, r, dr, p0, p1, e, scale, acc + c * H * r, m + c * Hp,
                     l + c * Hp, S);
                for (x = 0; x < H * r; ++x) out(acc[c * H * r + x]);
                for (h = 0; h < H; ++h) {
                    out(m[c * Hp + h]);
                    out(l[c * Hp + h]);
                }
            } else {
                for (h = 0; h < Hp; ++h) {
                    m[c * Hp + h] = -INFINITY;
                    l[c * Hp + h] = 0.0f;
                }
            }
        }
        for (h = 0; h < H; ++h)
            kvc_mla_merge_head(acc + h * r, H * r, m + h, l + h, Hp, NT, wuv + h * dv * r, r, dv, cb,
                               o + h * dv);
        for (x = 0; x < H * dv; ++x) out(o[x]);
    }
    printf("H=%td r=%td dr=%td dn=%td dv=%td T=%td n=%td R=%td special=%d: %016llx %ld %ld\n",
           H, r, dr, dn, dv, T, n, R, special, (unsigned long long)hash, count, nans);
    free(lat); free(kr); free(wuk); free(wuv); free(qn); free(qr); free(qT); free(qa);
    free(acc); free(m); free(l); free(S); free(cb); free(o);
}

int main(void)
{
    /* heads: 1..7 (no full 8-float vector), 8, 16 and 32 (whole vectors), 9, 17, 24, 40
     * (a remainder of 8 heads for the 16-float body, 1..7 scalar heads for both) */
    static const ptrdiff_t heads[] = {1, 3, 5, 6, 7, 8, 9, 12, 16, 17, 23, 24, 32, 40};
    /* ranks: tails of 1..7 elements, a last 8 or 16 (vector remainders), chunk tails */
    static const ptrdiff_t ranks[] = {1, 7, 8, 15, 16, 24, 40, 64, 72, 100, 136, 512};
    static const ptrdiff_t ropes[] = {0, 1, 3, 8, 17, 64, 70};
    /* rows: under one tile, tile and block tails, several blocks and tasks */
    static const ptrdiff_t rows[] = {1, 2, 3, 4, 5, 6, 11, 13, 63, 64, 65, 130, 200};
    int hi, ri, di, ti, k = 0;
    printf("%s\n", KVC_MLA_PATH);
    for (hi = 0; hi < (int)(sizeof heads / sizeof *heads); ++hi)
        for (ri = 0; ri < (int)(sizeof ranks / sizeof *ranks); ++ri) {
            ptrdiff_t H = heads[hi], r = ranks[ri];
            if (H * r > 16 * 512 || (r == 512 && H != 16))
                continue;
            for (di = 0; di < (int)(sizeof ropes / sizeof *ropes); ++di) {
                ptrdiff_t dr = ropes[(di + hi + ri) % (int)(sizeof ropes / sizeof *ropes)];
                if (di > 1 && r > 100)
                    break;
                for (ti = 0; ti < (int)(sizeof rows / sizeof *rows); ++ti) {
                    ptrdiff_t T = rows[(ti + 3 * hi + di) % (int)(sizeof rows / sizeof *rows)];
                    ptrdiff_t n = 1 + (k % 3 == 0 ? (T > 3 ? 3 : T - 1) : 0);
                    ptrdiff_t R = k % 2 ? 64 : 96;   /* tasks of whole blocks, or ragged */
                    if (ti > 2 && r > 64)
                        break;
                    run(H, r, dr, 1 + k % 5, 1 + k % 7, T, n, R, 0.13f + 0.01f * (float)(k % 5),
                        k % 4 == 0 ? 2.0f : 0.2f, k % 11 == 5 ? 1 : k % 13 == 7 ? 2 : 0);
                    ++k;
                }
            }
        }
    return 0;
}
