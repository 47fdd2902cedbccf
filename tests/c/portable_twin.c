/* Runs the inner loops of _kernels.h on fixed pseudo-random inputs and prints every result as
 * raw bits.  tests/test_portable_twin.py builds it once per x86 body (the compile flags select
 * the target) and with -DKVC_NO_SIMD (the portable C path), and requires identical output. */
#include "_mla.h"
#include <stdio.h>
#include <stdlib.h>

#if defined(__AVX2__) && !defined(KVC_NO_SIMD) && KVC_VEC_PORTABLE
#error "an AVX2 build fell back to the portable vector layer (a missing -mfma or -mf16c?)"
#endif

static uint32_t state = 20261129u;
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

/* out(), with every NaN printed as "nan" (which NaN an operation returns is not specified) */
static void outc(float x)
{
    if (x != x)
        printf("nan\n");
    else
        out(x);
}

/* The quantised value passes against their definition (docs/numerics.md), so that a mistake
 * every body shares is caught too: acc[j][d] = fmaf(w, v, acc) over the rows p in [p0, p1) that
 * query j sees, in order, skipping those with |w| < 1e-12 (a NaN weight is used); q8 (v4 NULL):
 * w = prob * vs[p], v = (float)code; 4-bit: w = prob, v = fmaf(code, step, minimum).  A NaN
 * matches any NaN.  Exits with status 2 on the first difference. */
static void check_values(const char *what, const float *probs, ptrdiff_t L, ptrdiff_t nq,
                         const ptrdiff_t *qf, const ptrdiff_t *qe, const int8_t *vq,
                         const float *vs, const uint8_t *v4, const uint16_t *vp, ptrdiff_t p0,
                         ptrdiff_t p1, ptrdiff_t hd, const float *acc)
{
    const ptrdiff_t np = 2 * KVC_V4_NG(hd);
    ptrdiff_t j, d, p;
    for (j = 0; j < nq; ++j)
        for (d = 0; d < hd; ++d) {
            float y = 0.0f, got = acc[j * hd + d];
            for (p = p0 > qf[j] ? p0 : qf[j]; p < p1 && p < qe[j]; ++p) {
                float w = probs[j * L + p], x;
                if (v4) {
                    ptrdiff_t byte;
                    int shift;
                    kvc_v4_place(hd, d, &byte, &shift);
                    x = fmaf((float)((v4[p * (hd / 2) + byte] >> shift) & 15),
                             kvc_f16_to_f32(vp[p * np + 2 * (d / 16)]),
                             kvc_f16_to_f32(vp[p * np + 2 * (d / 16) + 1]));
                } else {
                    w = w * vs[p];
                    x = (float)vq[p * hd + d];
                }
                if (!(fabsf(w) < 1e-12f))
                    y = fmaf(w, x, y);
            }
            if (memcmp(&y, &got, 4) != 0 && !(y != y && got != got)) {
                fprintf(stderr, "%s value pass differs from its definition: head_dim %d, query %d, "
                        "channel %d: %a, not %a\n", what, (int)hd, (int)j, (int)d, got, y);
                exit(2);
            }
        }
}

/* probs with weights at the value pass's skip threshold (0, -0, +-1e-13, +-1e-12, 1.5e-12, a
 * NaN) spread over the eight-row blocks and the tail of its flag computation */
static void threshold_probs(const float *probs, float *pz, ptrdiff_t n, ptrdiff_t salt)
{
    static const float special[8] = {0.0f, -0.0f, 1e-13f, -1e-13f, 1e-12f, -1e-12f, 1.5e-12f, NAN};
    ptrdiff_t i;
    for (i = 0; i < n; ++i)
        pz[i] = (i * 7 + salt) % 5 == 0 ? special[(i / 5) % 8] : probs[i];
}

#define HDMAX 136
#define ROWS 37

int main(void)
{
    static float q[8 * HDMAX], k[ROWS * HDMAX], v[ROWS * HDMAX], ks[ROWS * 8], vs[ROWS];
    static float probs[8 * 64], acc[8 * HDMAX], scratch[4096], res[16];
    static int8_t kq[ROWS * HDMAX], vq[ROWS * HDMAX];
    static uint8_t vc4[ROWS * HDMAX / 2];
    static uint16_t vp[ROWS * 2 * KVC_V4_NG(HDMAX)];
    static float v4scr[KVC_SCRATCH_FLOATS(HDMAX)];
    ptrdiff_t hds[] = {1, 7, 8, 24, 31, 32, 40, 56, 64, 72, 128, 136};
    ptrdiff_t qf[8] = {0, 1, 0, 3, 0, 0, 5, 0}, qe[8] = {37, 37, 30, 37, 37, 36, 37, 21};
    int i, h;
    /* every float16 bit pattern through the body's conversion (F16C, fcvtl or the loop): the
     * scalar's bits, signalling NaNs made quiet; one folded line per 256 patterns */
    for (i = 0; i < 65536; i += 256) {
        uint32_t fold = 0;
        int j;
        for (j = 0; j < 256; j += 8) {
            uint16_t hv[8];
            float f[8];
            int l;
            for (l = 0; l < 8; ++l)
                hv[l] = (uint16_t)(i + j + l);
            kvc_f8_store(f, kvc_f8_from_f16(hv));
            for (l = 0; l < 8; ++l) {
                float s = kvc_f16_to_f32(hv[l]);
                uint32_t b;
                if (memcmp(&s, &f[l], 4) != 0) {
                    fprintf(stderr, "float16 %04x: vector and scalar differ\n", hv[l]);
                    return 2;
                }
                memcpy(&b, &s, 4);
                fold = fold * 31u + b;
            }
        }
        printf("%08x\n", fold);
    }
    for (i = 0; i < 8 * HDMAX; ++i) q[i] = rnd();
    for (i = 0; i < ROWS * HDMAX; ++i) {
        k[i] = rnd();
        v[i] = rnd();
        kq[i] = (int8_t)(rnd() * 60.0f);
        vq[i] = (int8_t)(rnd() * 60.0f);
    }
    for (i = 0; i < ROWS * 8; ++i) ks[i] = rnd() * rnd();
    for (i = 0; i < ROWS; ++i) vs[i] = rnd() * 0.1f;
    for (h = 0; h < (int)(sizeof hds / sizeof hds[0]); ++h) {
        ptrdiff_t hd = hds[h], ng = (hd + 31) / 32;
        int quant;
        out(kvc_dot_f32(q, k, hd));
        kvc_dot4_f32(q, k, k + hd, k + 2 * hd, k + 3 * hd, hd, res);
        kvc_dot2x4_f32(q, q + hd, k, k + hd, k + 2 * hd, k + 3 * hd, hd, res + 4, 8);
        for (i = 0; i < 16; ++i) out(res[i]);
        for (quant = 0; quant < 2; ++quant) {
            memset(probs, 0, sizeof probs);
            if (quant) {   /* integer scoring (every level: tests/c/i8_twin.c) */
                static int8_t qi[8 * KVC_I8_PAD(HDMAX)];
                static float sq[8 * KVC_I8_GROUPS(HDMAX, 32)];
                static int32_t qsum[8 * KVC_I8_GROUPS(HDMAX, 32)];
                for (i = 0; i < 8; ++i)
                    kvc_quant_query(q + i * hd, hd, 32, qi + i * KVC_I8_PAD(hd),
                                    sq + i * KVC_I8_GROUPS(hd, 32),
                                    qsum + i * KVC_I8_GROUPS(hd, 32));
                kvc_task_scores_i8(32, qi, sq, qsum, 8,
                                   qf, qe, kq, ks, ng, 0, ROWS, hd, 0.3f, 2.5f, probs, 64,
                                   v4scr);
            } else {
                kvc_task_scores(q, 8, qf, qe, k, 0, ROWS, hd, 0.3f, 2.5f, probs, 64);
            }
            for (i = 0; i < 8; ++i)
                if (qe[i] > qf[i]) kvc_softmax(probs + i * 64 + qf[i], qe[i] - qf[i]);
            for (i = 0; i < 8 * 64; ++i) out(probs[i]);
            kvc_task_values(probs, 64, 8, qf, qe, v, vq, vs, quant, 0, ROWS, hd, acc, scratch);
            for (i = 0; i < 8 * hd; ++i) out(acc[i]);
            if (quant)
                check_values("q8", probs, 64, 8, qf, qe, vq, vs, NULL, NULL, 0, ROWS, hd, acc);
            {
                static float pz[8 * 64];
                threshold_probs(probs, pz, 8 * 64, hd);
                kvc_task_values(pz, 64, 8, qf, qe, v, vq, vs, quant, 0, ROWS, hd, acc, scratch);
                for (i = 0; i < 8 * hd; ++i) outc(acc[i]);
                if (quant)
                    check_values("q8", pz, 64, 8, qf, qe, vq, vs, NULL, NULL, 0, ROWS, hd, acc);
            }
            if (hd % 8 == 0) {   /* the 4-bit V pass over these probabilities (_q4.h) */
                for (i = 0; i < ROWS; ++i)
                    kvc_v4_quant_row(v + i * hd, hd, vc4 + i * (hd / 2),
                                     vp + i * 2 * KVC_V4_NG(hd));
                for (i = 0; i < ROWS * (hd / 2); ++i) out((float)vc4[i]);
                for (i = 0; i < ROWS * 2 * KVC_V4_NG(hd); ++i) out((float)vp[i]);
                kvc_task_values_v4(probs, 64, 8, qf, qe, vc4, vp, 0, ROWS, hd, acc, v4scr);
                for (i = 0; i < 8 * hd; ++i) out(acc[i]);
                check_values("4-bit", probs, 64, 8, qf, qe, NULL, NULL, vc4, vp, 0, ROWS, hd, acc);
                kvc_task_values_v4(probs, 64, 3, qf + 2, qe + 2, vc4, vp, 5, 29, hd, acc, v4scr);
                for (i = 0; i < 3 * hd; ++i) out(acc[i]);
                check_values("4-bit", probs, 64, 3, qf + 2, qe + 2, NULL, NULL, vc4, vp, 5, 29,
                             hd, acc);
                {
                    static float pz[8 * 64];
                    threshold_probs(probs, pz, 8 * 64, hd + 1);
                    kvc_task_values_v4(pz, 64, 8, qf, qe, vc4, vp, 0, ROWS, hd, acc, v4scr);
                    for (i = 0; i < 8 * hd; ++i) outc(acc[i]);
                    check_values("4-bit", pz, 64, 8, qf, qe, NULL, NULL, vc4, vp, 0, ROWS, hd, acc);
                }
                {   /* 4-bit K: 37 rows, one closed block of 32 and 5 ring rows (_kernels.h) */
                    const ptrdiff_t B = KVC_K4_BLOCK;
                    static uint8_t kc4[ROWS * HDMAX / 2];
                    static uint16_t kp4[3 * 2 * HDMAX];
                    static float kr4[KVC_K4_RING * HDMAX];
                    kvc_k4 k4;
                    for (i = 0; i < ROWS; ++i) {
                        memcpy(kr4 + (i % KVC_K4_RING) * hd, k + i * hd,
                               (size_t)hd * sizeof(float));
                        if (i % B == B - 1)
                            kvc_k4_quant_block(kr4, i - (B - 1), hd, kc4 + (i - (B - 1)) * (hd / 2),
                                               kp4 + (i / B) * 2 * hd);
                    }
                    for (i = 0; i < ROWS / B * B * (hd / 2); ++i) out((float)kc4[i]);
                    for (i = 0; i < ROWS / B * 2 * hd; ++i) out((float)kp4[i]);
                    k4.codes = kc4;
                    k4.par = kp4;
                    k4.ring = kr4;
                    k4.qlen = ROWS / B * B;
                    memset(probs, 0, sizeof probs);
                    kvc_task_scores_k4(&k4, q, 8, qf, qe, 0, ROWS, hd, 0.3f, 2.5f, probs, 64,
                                       v4scr);
                    for (i = 0; i < 8 * 64; ++i) out(probs[i]);
                    kvc_task_scores_k4(&k4, q, 8, qf, qe, 7, 21, hd, 0.3f, 0.0f, probs, 64,
                                       v4scr);
                    for (i = 0; i < 8 * 64; ++i) out(probs[i]);
                }
            }
        }
        {   /* O(1): six far insertions into one head, then its output for both rectifiers */
            static float t_hat[8 * HDMAX], z_hat[8], m_max[8], l[8], o1scr[64];
            ptrdiff_t m = 5, r;
            int fm;
            for (i = 0; i < 8; ++i) {
                z_hat[i] = 0.0f;
                m_max[i] = -INFINITY;
            }
            memset(t_hat, 0, sizeof t_hat);
            for (r = 0; r < 6; ++r)
                kvc_o1_absorb(q, k + r * hd, v + r * hd, m, hd, hd, 0.3f, t_hat, z_hat, m_max, l);
            for (i = 0; i < m * hd; ++i) out(t_hat[i]);
            for (i = 0; i < m; ++i) {
                out(z_hat[i]);
                out(m_max[i]);
            }
            for (fm = 0; fm < 2; ++fm) {
                kvc_o1_head(q + hd, hd, hd, 0.3f, k + 6 * hd, v + 6 * hd, 2, k + 8 * hd, v + 8 * hd,
                            9, 4, k + 20 * hd, v + 20 * hd, k + 21 * hd, ks, t_hat, z_hat, m_max,
                            m, 1, fm, acc, o1scr);
                for (i = 0; i < hd; ++i) out(acc[i]);
            }
        }
    }
    {   /* MLA: fold, tasks over 150 rows (three blocks, the last ragged) split in two, merge */
        static float lat[150 * 40], kr[150 * 8], wuk[12 * 6 * 40], wuv[12 * 7 * 40];
        static float qn[12 * 6], qr[12 * 5], qa[40], qT[45 * 16], macc[2 * 12 * 40];
        static float mm[2 * 16], ml[2 * 16], S[KVC_MLA_BLOCK * 16], c[40], mo[16 * 7];
        ptrdiff_t geo[][4] = {{12, 40, 5, 6}, {5, 19, 0, 3}, {16, 24, 3, 0}, {3, 8, 8, 4}};
        int gi;
        for (i = 0; i < 150 * 40; ++i) lat[i] = rnd();
        for (i = 0; i < 150 * 8; ++i) kr[i] = rnd();
        for (i = 0; i < 12 * 6 * 40; ++i) wuk[i] = rnd() * 0.2f;
        for (i = 0; i < 12 * 7 * 40; ++i) wuv[i] = rnd() * 0.2f;
        for (i = 0; i < 12 * 6; ++i) qn[i] = rnd();
        for (i = 0; i < 12 * 5; ++i) qr[i] = rnd();
        for (gi = 0; gi < 4; ++gi) {
            ptrdiff_t H = geo[gi][0], r = geo[gi][1], dr = geo[gi][2], dn = geo[gi][3], dv = 7;
            ptrdiff_t Hp = (H + 7) / 8 * 8, T = 150, split[3] = {0, 97, 150};
            memset(qT, 0, sizeof qT);
            for (h = 0; h < H; ++h)
                kvc_mla_fold(qn + h * dn, qr + h * dr, wuk + h * dn * r, dn, r, dr, h, Hp, qa, qT);
            for (i = 0; i < (r + dr) * Hp; ++i) out(qT[i]);
            for (i = 0; i < 2; ++i)
                kvc_mla_task(qT, H, Hp, lat, kr, r, dr, split[i], split[i + 1], T, 0.37f,
                             macc + i * H * r, mm + i * Hp, ml + i * Hp, S);
            for (i = 0; i < 2 * H * r; ++i) out(macc[i]);
            for (i = 0; i < 2 * Hp; ++i) {
                if (i % Hp < H) {
                    out(mm[i]);
                    out(ml[i]);
                }
            }
            for (h = 0; h < H; ++h)
                kvc_mla_merge_head(macc + h * r, H * r, mm + h, ml + h, Hp, 2, wuv + h * dv * r, r,
                                   dv, c, mo + h * dv);
            for (i = 0; i < H * dv; ++i) out(mo[i]);
        }
    }
    return 0;
}
