/* Runs the blocked prompt kernel of _prefill.h (tasks with and without their one-pass
 * importance; float32 keys, q8 keys in groups of 32 and of 16
 * channels, and 4-bit keys; float32, int8 and 4-bit values) on fixed pseudo-random inputs and
 * prints every result as raw bits; it also checks the blocked int8 scores against
 * kvc_i8_score1 bit for bit (exit status 2 on a difference).  The body is the one
 * the compile flags select (_vec.h); tests/test_prefill.py builds it once per x86 body (and the
 * VNNI q8 code emulated, -DKVC_EMULATE_VNNI), tests/test_aarch64.py once per aarch64 body, and
 * both require the -DKVC_NO_SIMD build's output. */
#include "_prefill.h"
#include <stdio.h>
#include <stdlib.h>

static uint32_t state = 20261202u;
static float rnd(void)
{
    state = state * 1664525u + 1013904223u;
    return ((float)(state >> 8) / 16777216.0f - 0.5f) * 4.0f;
}

static void out(float x)
{
    uint32_t b;
    memcpy(&b, &x, 4);
    printf("%08x\n", b);
}

#define HDMAX 136
#define ROWS 203
#define NQ 23
#define KS 9 /* K scales per int8 row: ceil(HDMAX / 16) */

int main(void)
{
    static int8_t qi[NQ * KVC_I8_PAD(HDMAX)];
    static float qsc[NQ * KVC_I8_GROUPS(HDMAX, 16)];
    static int32_t qsum[NQ * KVC_I8_GROUPS(HDMAX, 16)];
    static float q[NQ * HDMAX], k[ROWS * HDMAX], v[ROWS * HDMAX], ks[ROWS * KS], vs[ROWS];
    static float vcol[HDMAX], o[NQ * HDMAX], o2[NQ * HDMAX], qm[NQ], ql[NQ];
    static float colsum1[3 * KVC_PF_TILE];
    static float pbuf[KVC_PF_PBUF_FLOATS(3, NQ)];
    static int8_t kq[ROWS * HDMAX], vq[ROWS * HDMAX];
    static uint8_t vc4[ROWS * HDMAX / 2], kc4[ROWS * HDMAX / 2];
    static uint16_t vp[ROWS * 2 * KVC_V4_NG(HDMAX)], kp4[(ROWS / KVC_K4_BLOCK + 1) * 2 * HDMAX];
    static float kr4[KVC_K4_RING * HDMAX];
    kvc_k4 k4;
    float *scratch = malloc(sizeof(float) * KVC_PF_SCRATCH_FLOATS(HDMAX, NQ));
    ptrdiff_t hds[] = {1, 7, 8, 16, 24, 40, 64, 72, 128, 136};
    ptrdiff_t qf[NQ], qe[NQ];
    int i, h, mode, cap;
    for (i = 0; i < NQ * HDMAX; ++i) q[i] = rnd();
    for (i = 0; i < ROWS * HDMAX; ++i) {
        k[i] = rnd();
        v[i] = rnd();
        kq[i] = (int8_t)(rnd() * 60.0f);
        vq[i] = (int8_t)(rnd() * 60.0f);
    }
    for (i = 0; i < ROWS * KS; ++i) ks[i] = rnd() * rnd();
    for (i = 0; i < ROWS; ++i) vs[i] = rnd() * 0.1f;
    for (i = 0; i < HDMAX; ++i) vcol[i] = 1.0f + 0.1f * rnd();
    /* causal ranges of 23 queries (positions 150..172, three heads per position, shared
     * ends), one with a window, one empty, one seeing a single row */
    for (i = 0; i < NQ; ++i) {
        qe[i] = 150 + i / 3 + 1;
        qf[i] = 0;
    }
    qf[4] = 100;
    qf[5] = 63;
    qf[9] = qe[9] - 1;
    qe[12] = qf[12] = 0;
    qf[20] = 129;
    for (h = 0; h < 20; ++h) {
        /* K groups of 32 channels (scheme "cmf"), then of 16 ("rows": int8 keys only) */
        ptrdiff_t hd = hds[h % 10], group = h < 10 ? 32 : 16;
        for (i = 0; i < NQ; ++i)
            kvc_quant_query(q + i * hd, hd, group, qi + i * KVC_I8_PAD(hd),
                            qsc + i * KVC_I8_GROUPS(hd, group),
                            qsum + i * KVC_I8_GROUPS(hd, group));
        if (hd % 8 == 0) {  /* the 4-bit V rows and 4-bit K of this head dim (_q4.h) */
            for (i = 0; i < ROWS; ++i)
                kvc_v4_quant_row(v + i * hd, hd, vc4 + i * (hd / 2), vp + i * 2 * KVC_V4_NG(hd));
            /* a head of 173 rows, appended as a store does: 5 closed blocks (160 rows), each
             * quantised from the ring when its last row arrives, and 13 open rows in the ring */
            for (i = 0; i < 173; ++i) {
                memcpy(kr4 + (i % KVC_K4_RING) * hd, k + i * hd, (size_t)hd * sizeof(float));
                if (i % KVC_K4_BLOCK == KVC_K4_BLOCK - 1)
                    kvc_k4_quant_block(kr4, i + 1 - KVC_K4_BLOCK, hd,
                                       kc4 + (i + 1 - KVC_K4_BLOCK) * (hd / 2),
                                       kp4 + (i / KVC_K4_BLOCK) * 2 * hd);
            }
            k4.codes = kc4;
            k4.par = kp4;
            k4.ring = kr4;
            k4.qlen = 160;
        }
        /* modes: quant_k = mode % 3 (float32, int8, 4-bit), quant_v = mode / 3 */
        for (mode = 0; mode < 9; ++mode)
            for (cap = 0; cap < 2; ++cap) {
                int quant_k = mode % 3, quant_v = mode / 3;
                if ((hd % 8 && (quant_k == 2 || quant_v == 2)) || (group == 16 && quant_k != 1))
                    continue;
                float softcap = cap ? 2.5f : 0.0f;
                ptrdiff_t j;
                kvc_pf_task(q, NQ, qf, qe, k, kq, ks, KS, quant_k, &k4, v, vq, vs, 1, quant_v, vc4, vp,
                            vcol, hd, 0.3f, softcap, o, qm, ql, scratch, NULL, NULL, group, qi, qsc,
                            qsum);
                for (i = 0; i < NQ * hd; ++i)
                    out(o[i]);
                for (j = 0; j < NQ; ++j) {
                    out(qm[j]);
                    out(ql[j]);
                }
                /* the task again with its one-pass importance (3 tiles: rows 0..172): the
                 * same outputs, and the column sums */
                kvc_pf_task(q, NQ, qf, qe, k, kq, ks, KS, quant_k, &k4, v, vq, vs, 1, quant_v, vc4, vp,
                            vcol, hd, 0.3f, softcap, o2, qm, ql, scratch, pbuf, colsum1, group, qi,
                            qsc, qsum);
                if (memcmp(o, o2, sizeof(float) * (size_t)(NQ * hd)) != 0)
                    return 1;
                for (i = 0; i < 3 * KVC_PF_TILE; ++i)
                    out(colsum1[i]);
            }
    }
    /* The blocked int8 scores against the query-by-query definition (kvc_i8_score1), bit for
     * bit: groups of 32 and 16, rows starting off a strip and off a group of 8, a partial
     * tile, the last tile.  A difference is exit status 2. */
    {
        static uint8_t k8[KVC_PF_TILE * ((HDMAX + 3) / 4 * 4)];
        static float k8sc[KVC_PF_TILE * KS], s8[NQ * KVC_PF_TILE];
        const ptrdiff_t offs[] = {0, 3, 9, 17}, t0s[] = {0, 64, 192};
        int g2, oi, ti, e;
        for (h = 0; h < 10; ++h)
            for (g2 = 0; g2 < 2; ++g2) {
                const ptrdiff_t hd = hds[h], group = g2 ? 16 : 32;
                const ptrdiff_t ng = KVC_I8_GROUPS(hd, group);
                for (i = 0; i < NQ; ++i)
                    kvc_quant_query(q + i * hd, hd, group, qi + i * KVC_I8_PAD(hd),
                                    qsc + i * ng, qsum + i * ng);
                for (ti = 0; ti < 3; ++ti)
                    for (oi = 0; oi < 4; ++oi)
                        for (e = 0; e < 2; ++e) {
                            const ptrdiff_t t0 = t0s[ti], r0 = t0 + offs[oi];
                            ptrdiff_t r1 = e ? r0 + 29 : t0 + KVC_PF_TILE, j, p;
                            r1 = r1 < ROWS ? r1 : ROWS;
                            kvc_k8_pack(kq, ks, KS, ng, t0, r0, r1, hd, k8, k8sc);
                            kvc_pf_scores8(qi, qsc, qsum, ng, NQ, k8, k8sc, hd, group, r0 - t0,
                                           r1 - t0, s8, KVC_PF_TILE);
                            for (j = 0; j < NQ; ++j)
                                for (p = r0; p < r1; ++p) {
                                    float ref = kvc_i8_score1(qi + j * KVC_I8_PAD(hd),
                                                              qsc + j * ng, kq + p * hd,
                                                              ks + p * KS, hd, group);
                                    if (memcmp(&ref, s8 + j * KVC_PF_TILE + (p - t0), 4) != 0) {
                                        fprintf(stderr, "q8 score differs: hd %d group %d "
                                                "rows [%d, %d) query %d row %d\n", (int)hd,
                                                (int)group, (int)r0, (int)r1, (int)j, (int)p);
                                        return 2;
                                    }
                                }
                        }
            }
    }
    /* NaN, infinities and -inf scores */
    k[3 * 64 + 5] = NAN;
    v[7 * 64 + 2] = INFINITY;
    for (i = 0; i < 64; ++i)
        k[150 * 64 + i] = -1e30f;
    kvc_pf_task(q, NQ, qf, qe, k, kq, ks, KS, 0, &k4, v, vq, vs, 1, 0, vc4, vp, vcol, 64, 1e10f, 0.0f,
                o, qm, ql, scratch, NULL, NULL, 32, qi, qsc, qsum);
    for (i = 0; i < NQ * 64; ++i)
        out(o[i]);
    kvc_pf_task(q, NQ, qf, qe, k, kq, ks, KS, 0, &k4, v, vq, vs, 1, 0, vc4, vp, vcol, 64, 1e10f, 0.0f,
                o2, qm, ql, scratch, pbuf, colsum1, 32, qi, qsc, qsum);
    for (i = 0; i < 3 * KVC_PF_TILE; ++i)
        out(colsum1[i]);
    free(scratch);
    return 0;
}
