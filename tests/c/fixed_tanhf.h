/* A tanhf of the same bits on every machine, for comparing one twin program's output across
 * CPU families (tests/test_aarch64.py: the portable build on x86-64 against the portable build
 * on aarch64).  The kernels' own arithmetic is IEEE operations in a fixed order, but the
 * softcap calls the C library's tanhf, and glibc's x86-64 and aarch64 builds differ in its last
 * bit for some inputs; force-included (-include) before a twin program, this replaces it, so
 * the comparison sees the kernels alone.  Only +, -, *, / and fmaf (all correctly rounded),
 * floorf, ldexpf and copysignf (exact): the same bits wherever it is compiled with
 * -ffp-contract=off.  Within a few float ulp of tanh: a stand-in, not a replacement. */
#ifndef KVCACHE_FIXED_TANHF_H
#define KVCACHE_FIXED_TANHF_H

#include <math.h>

static float kvc_fixed_tanhf(float x)
{
    float a = fabsf(x), z, y, f, p, e, t;
    int n;
    if (x != x)
        return x;
    if (a > 9.1f)           /* tanh rounds to 1 in float from about 9.01 */
        return copysignf(1.0f, x);
    if (a < 0.34f) {
        /* tanh(a) = -m / (m + 2), m = expm1(-2a) = z (1 + z/2! + ... + z^9/10!), |z| < 0.68 */
        static const float c[9] = {1.0f / 3628800.0f, 1.0f / 362880.0f, 1.0f / 40320.0f,
                                   1.0f / 5040.0f, 1.0f / 720.0f, 1.0f / 120.0f,
                                   1.0f / 24.0f, 1.0f / 6.0f, 0.5f};
        z = -2.0f * a;
        p = c[0];
        for (n = 1; n < 9; ++n)
            p = fmaf(p, z, c[n]);
        p = fmaf(p, z, 1.0f) * z;
        t = -p / (p + 2.0f);
    } else {
        /* tanh(a) = (1 - e) / (1 + e), e = exp(-2a) = 2^-(n + f), 0 <= f < 1, e <= 0.51 */
        y = (2.0f * a) * 1.44269504f;
        n = (int)floorf(y);
        f = (y - (float)n) * 0.693147181f;   /* 2^-f = exp(-f ln 2), Taylor to degree 8 */
        p = 1.0f / 40320.0f;
        p = fmaf(p, -f, 1.0f / 5040.0f);
        p = fmaf(p, -f, 1.0f / 720.0f);
        p = fmaf(p, -f, 1.0f / 120.0f);
        p = fmaf(p, -f, 1.0f / 24.0f);
        p = fmaf(p, -f, 1.0f / 6.0f);
        p = fmaf(p, -f, 0.5f);
        p = fmaf(p, -f, 1.0f);
        p = fmaf(p, -f, 1.0f);
        e = ldexpf(p, -n);
        t = (1.0f - e) / (1.0f + e);
    }
    return copysignf(t, x);
}

#define tanhf kvc_fixed_tanhf

#endif
