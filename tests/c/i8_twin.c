/* Runs the q8 scoring of _kernels.h (query quantiser, raw scores, a decode score task) on
 * pseudo-random inputs and prints every result as raw bits.  K groups of 16 and of 32
 * channels.  The body is the one the compile flags select (_vec.h: -DKVC_NO_SIMD, -mavx2,
 * -mavxvnni, -mavx512*, aarch64 with and without +dotprod; -DKVC_EMULATE_VNNI runs the VNNI
 * code with an exact AVX2 emulation of vpdpbusd); tests/test_int8_scoring.py and
 * tests/test_aarch64.py build it once per body and require output identical to the portable
 * build.  The first line names the body's int8 dot form (KVC_VEC_I8). */
#include "_kernels.h"
#include <stdio.h>
#include <stdlib.h>

static uint32_t state = 20261202u;
static uint32_t next(void)
{
    state = state * 1664525u + 1013904223u;
    return state >> 8;
}
static float rnd(void) { return ((float)next() / 16777216.0f - 0.5f) * 4.0f; }

static void out(float x)
{
    uint32_t b;
    memcpy(&b, &x, 4);
    printf("%08x\n", b);
}

#define HDMAX 264
#define ROWS 77
#define NQ 8   /* two query blocks of the AVX-512 decode scorer (six, then two) */

int main(void)
{
    static float q[NQ * HDMAX], ks[ROWS * 17], res[ROWS], probs[NQ * ROWS];
    static float scratch[KVC_SCRATCH_FLOATS(HDMAX)];
    static int8_t kq[ROWS * HDMAX], qi[NQ * KVC_I8_PAD(HDMAX)];   /* codes padded to 32 */
    static float sq[NQ * 17];
    static int32_t qsum[NQ * 17];
    ptrdiff_t hds[] = {1, 7, 8, 16, 31, 32, 33, 40, 64, 72, 96, 100, 128, 136, 160, 256, 264};
    ptrdiff_t qf[NQ] = {0, 3, 0, 9, 20, 5, 66, 2}, qe[NQ] = {77, 77, 70, 40, 21, 60, 77, 3};
    int trial, h, i, j;
    printf("%s %d\n", KVC_VEC_NAME, KVC_VEC_I8);
    {   /* the row quantiser on halfway cases (scale exactly 1: |max| = 127), with and without a
         * column field, special values, every head dim and both groups */
        static float x[HDMAX], col[HDMAX], sc[17];
        static int8_t code[HDMAX];
        const float special[] = {0.5f, -0.5f, 1.5f, -2.5f, 126.5f, -126.5f, 127.0f, -127.0f,
                                 0.49999997f, -0.49999997f, 2.5000002f, 0.0f, -0.0f, 1e-30f};
        for (trial = 0; trial < 6; ++trial)
            for (h = 0; h < (int)(sizeof hds / sizeof hds[0]) * 2; ++h) {
                ptrdiff_t hd = hds[h / 2], group = h % 2 ? 16 : 32;
                for (i = 0; i < hd; ++i) {
                    x[i] = i % 16 == 0 ? 127.0f : trial < 2 ? special[next() % 14] : rnd() * 50.0f;
                    col[i] = trial % 2 ? 1.0f : 0.25f + (float)(next() % 8) * 0.5f;
                }
                if (trial == 4) {
                    x[hd / 2] = NAN;
                    x[hd - 1] = -INFINITY;
                }
                kvc_quant_row(x, trial % 2 ? NULL : col, hd, group, code, sc);
                for (i = 0; i < hd; ++i)
                    printf("%d\n", code[i]);
                for (i = 0; i < KVC_I8_GROUPS(hd, group); ++i)
                    out(sc[i]);
            }
    }
    for (trial = 0; trial < 12; ++trial) {
        /* magnitudes from tiny to large; some trials use the extreme codes -128 and 127 */
        float mag = trial % 3 == 0 ? 1e-3f : trial % 3 == 1 ? 1.0f : 300.0f;
        for (i = 0; i < NQ * HDMAX; ++i)
            q[i] = rnd() * mag;
        for (i = 0; i < ROWS * HDMAX; ++i)
            kq[i] = trial % 4 == 3 ? (int8_t)(next() % 2 ? -128 : 127) : (int8_t)(next() & 0xFF);
        for (i = 0; i < ROWS * 17; ++i)
            ks[i] = rnd() * rnd() * (trial % 2 ? 1e-2f : 1.0f);
        if (trial == 5) {   /* a non-finite query value: NaN scores for that query */
            q[3] = NAN;
            q[HDMAX + 40] = INFINITY;
        }
        for (h = 0; h < (int)(sizeof hds / sizeof hds[0]) * 2; ++h) {
            ptrdiff_t hd = hds[h / 2], group = h % 2 ? 16 : 32;
            ptrdiff_t hdp = KVC_I8_PAD(hd), ng = KVC_I8_GROUPS(hd, group);
            for (j = 0; j < NQ; ++j) {
                kvc_quant_query(q + j * hd, hd, group, qi + j * hdp, sq + j * ng, qsum + j * ng);
                for (i = 0; i < hdp; ++i)
                    printf("%d\n", qi[j * hdp + i]);
                for (i = 0; i < ng; ++i) {
                    out(sq[j * ng + i]);
                    printf("%d\n", qsum[j * ng + i]);
                }
            }
            for (j = 0; j < NQ; ++j) {
                /* every row count (the 8-row bodies and the scalar tail), scale stride 12 */
                ptrdiff_t n = 1 + (ptrdiff_t)(next() % ROWS);
                kvc_i8_rows(group, qi + j * hdp, sq + j * ng, qsum + j * ng, kq, ks, 17,
                                hd, n, res);
                for (i = 0; i < n; ++i)
                    out(res[i]);
            }
            memset(probs, 0, sizeof probs);
            kvc_task_scores_i8(group, qi, sq, qsum, NQ, qf, qe, kq, ks, 17, 2, ROWS, hd, 0.17f,
                               trial % 2 ? 5.0f : 0.0f, probs, ROWS, scratch);
            for (i = 0; i < NQ * ROWS; ++i)
                out(probs[i]);
        }
    }
    {   /* the 4-bit K dot products at their extremes (every code 15 or 0, every weight byte
         * +-127: AVX2's int16 sums of kvc_i8x_dp16 reach 15240 in magnitude) and at random:
         * kvc_i8x_dp16 against four chained kvc_i8x_dp4, then both lane by lane */
        static uint8_t ub[4][32];
        const int32_t wx[] = {(int32_t)0x81818181u, 0x7f7f7f7f};
        for (trial = 0; trial < 40; ++trial) {
            kvc_i8x u[4], a, b;
            int32_t w[4], la[8], lb[8];
            for (i = 0; i < 4; ++i) {
                for (j = 0; j < 32; ++j)
                    ub[i][j] = (uint8_t)(trial >= 4 ? next() % 16 : trial % 2 || j % 3 ? 15 : 0);
                u[i] = kvc_i8x_loadb(ub[i]);
                w[i] = (int32_t)next();                 /* two statements: a fixed order */
                w[i] ^= (int32_t)(next() << 8);
                if (trial < 4)
                    w[i] = wx[trial / 2];
                for (j = 0; j < 4; ++j)          /* weight bytes in [-127, 127] */
                    if (((w[i] >> (8 * j)) & 0xff) == 0x80)
                        w[i] ^= 1 << (8 * j);
            }
            a = kvc_i8x_dp16(u[0], w[0], u[1], w[1], u[2], w[2], u[3], w[3]);
            b = kvc_i8x_set1(0);
            for (i = 0; i < 4; ++i)
                b = kvc_i8x_dp4(b, u[i], w[i]);
            kvc_i8x_storeb((uint8_t *)la, a);
            kvc_i8x_storeb((uint8_t *)lb, b);
            for (j = 0; j < 8; ++j)
                printf("%d %d\n", la[j], lb[j]);
        }
    }
    return 0;
}
