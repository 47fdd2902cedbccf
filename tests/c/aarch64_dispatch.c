/* Run-time detection and dispatch on aarch64, with the real kernel units: linked with the
 * objects of _body_portable.c, _body_neon.c and _body_neondot.c compiled as setup.py compiles
 * them (the baseline of the target, each unit under its own target pragma), it prints what
 * kvc_cpu_features() detects, the tables the build holds, the ones this CPU runs and the most
 * capable of those (the one _core would take for q8 scoring), then runs the same kernel calls
 * through every table the CPU runs -- decode scores (float32 and int8 keys), softmax, values
 * (float32 and int8 values), the query quantiser, q8 rows -- and prints one line per call: the
 * table, the call, a 64-bit FNV-1a hash of the bits of every result and how many.
 * A table the CPU does not run is never called (its name is printed after "skip").
 * tests/test_aarch64.py runs it under QEMU as a core without the dot product (cortex-a53) and
 * one with it (max) and requires identical lines from every table.  No arguments.
 * Not a twin program: tests/test_aarch64.py builds it from the units, not with flags. */
#include "_dispatch.h"
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *const feature_names[KVC_N_FEATURES] = {
    "avx2", "fma", "avxvnni", "avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512vnni",
    "avx512bf16", "neon", "dotprod", "f16c"};

static uint32_t state = 20261205u;
static uint32_t next(void)
{
    state = state * 1664525u + 1013904223u;
    return state >> 8;
}
static float rnd(void) { return ((float)next() / 16777216.0f - 0.5f) * 4.0f; }

static uint64_t hash;
static long count;

static void bits(const void *p, size_t n)
{
    const unsigned char *b = p;
    size_t i;
    for (i = 0; i < n; ++i) {
        hash ^= b[i];
        hash *= 1099511628211ull;
    }
}

static void begin(void)
{
    hash = 14695981039346656037ull;
    count = 0;
}

static void floats(const float *x, ptrdiff_t n)
{
    bits(x, (size_t)n * sizeof(float));
    count += (long)n;
}

static void end(const kvc_ops *t, const char *call, ptrdiff_t hd, int variant)
{
    printf("%s %s hd=%td v=%d %016llx %ld\n", t->name, call, hd, variant,
           (unsigned long long)hash, count);
}

#define NQ 5
#define ROWS 37
#define NL 40
#define HDMAX 136
#define NG KVC_I8_GROUPS(HDMAX, 16) /* K scale groups per row at most (the stride of ks) */

static float q[NQ * HDMAX], k[ROWS * HDMAX], v[ROWS * HDMAX], ks[ROWS * NG], vs[ROWS];
static int8_t kq[ROWS * HDMAX], vq[ROWS * HDMAX];

static void run_table(const kvc_ops *t)
{
    static float probs[NQ * NL], acc[NQ * HDMAX];
    static float scratch[KVC_SCRATCH_FLOATS(HDMAX)];
    static int8_t qi[NQ * KVC_I8_PAD(HDMAX)];
    static float sq[NQ * NG];
    static int32_t qsum[NQ * NG];
    static const ptrdiff_t hds[] = {7, 32, 40, 64, 72, 128, 136};
    const ptrdiff_t qf[NQ] = {0, 3, 0, 9, 36}, qe[NQ] = {37, 37, 30, 20, 37};
    size_t h;
    int cap, quant, group;
    /* one group of rows, all queries in one task, through the table's descriptors */
    kvc_store st;
    kvc_call c;
    kvc_task all = {0, 0, NQ, 0, ROWS};
    for (h = 0; h < sizeof hds / sizeof hds[0]; ++h) {
        ptrdiff_t hd = hds[h], j;
        memset(&st, 0, sizeof st);
        memset(&c, 0, sizeof c);
        st.kf = k;
        st.vf = v;
        st.kq = kq;
        st.vq = vq;
        st.vs = vs;
        st.ks = ks;
        st.kcap = st.vcap = ROWS;
        st.vs_stride = 1;
        st.ks_stride = NG;
        st.hd = hd;
        c.q = q;
        c.qf = qf;
        c.qe = qe;
        c.scale = 0.3f;
        c.probs = probs;
        c.L = NL;
        for (cap = 0; cap < 2; ++cap) {
            float softcap = cap ? 2.5f : 0.0f;
            c.softcap = softcap;
            /* float32 keys: scores, then the softmax of each query's visible range, then the
             * values (float32 and int8 rows) */
            for (quant = 0; quant < 2; ++quant) {
                memset(probs, 0, sizeof probs);
                begin();
                st.quant_k = 0;
                c.scale = 0.3f;
                t->task_scores(&st, &c, &all);
                floats(probs, NQ * NL);
                end(t, "task_scores", hd, cap);
                begin();
                for (j = 0; j < NQ; ++j)
                    t->softmax(probs + j * NL + qf[j], qe[j] - qf[j]);
                floats(probs, NQ * NL);
                end(t, "softmax", hd, cap);
                begin();
                st.quant_v = quant;
                t->task_values(&st, &c, &all, acc, scratch);
                floats(acc, NQ * hd);
                end(t, "task_values", hd, 2 * cap + quant);
            }
            /* int8 keys: the query quantiser, q8 rows of every count (8-row bodies and the
             * tail), a decode score task */
            for (group = 16; group <= 32; group += 16) {
                ptrdiff_t hdp = KVC_I8_PAD(hd), ng = KVC_I8_GROUPS(hd, group), n;
                begin();
                for (j = 0; j < NQ; ++j)
                    t->quant_query(q + j * hd, hd, group, qi + j * hdp, sq + j * ng,
                                   qsum + j * ng);
                bits(qi, (size_t)(NQ * hdp));
                floats(sq, NQ * ng);
                bits(qsum, (size_t)(NQ * ng) * sizeof(int32_t));
                end(t, "quant_query", hd, group);
                begin();
                st.quant_k = 1;
                st.k_group = group;
                c.qi = qi;
                c.qsc = sq;
                c.qsum = qsum;
                for (n = 1; n <= ROWS; n += 6) {
                    /* raw scores of query n % NQ against rows [0, n) */
                    kvc_task one = {0, n % NQ, n % NQ + 1, 0, n};
                    memset(probs, 0, sizeof probs);
                    t->q8_rows(&st, &c, &one);
                    floats(probs + (n % NQ) * NL, n);
                }
                end(t, "q8_rows", hd, group);
                memset(probs, 0, sizeof probs);
                begin();
                c.scale = 0.17f;
                t->task_scores_i8(&st, &c, &all, scratch);
                floats(probs, NQ * NL);
                end(t, "task_scores_i8", hd, 2 * cap + group / 32);
            }
        }
    }
}

int main(void)
{
    unsigned f = kvc_cpu_features();
    int b, chosen = -1, i;
    for (i = 0; i < NQ * HDMAX; ++i)
        q[i] = rnd();
    for (i = 0; i < ROWS * HDMAX; ++i) {
        k[i] = rnd();
        v[i] = rnd();
        kq[i] = (int8_t)(next() & 0xFF);
        vq[i] = (int8_t)(rnd() * 60.0f);
    }
    for (i = 0; i < ROWS * NG; ++i)
        ks[i] = rnd() * rnd() * 0.1f;
    for (i = 0; i < ROWS; ++i)
        vs[i] = rnd() * 0.1f;
    printf("features");
    for (i = 0; i < KVC_N_FEATURES; ++i)
        if (f & (1u << i))
            printf(" %s", feature_names[i]);
    printf("\nbuilt");
    for (b = 0; b < KVC_N_BODIES; ++b)
        if (kvc_ops_body(b))
            printf(" %s", kvc_ops_body(b)->name);
    printf("\nruns");
    for (b = 0; b < KVC_N_BODIES; ++b)
        if (kvc_ops_body(b) && kvc_cpu_runs(b)) {
            printf(" %s", kvc_ops_body(b)->name);
            chosen = b;   /* ids grow with capability within a CPU family */
        }
    printf("\nchosen %s\n", chosen >= 0 ? kvc_ops_body(chosen)->name : "none");
    for (b = 0; b < KVC_N_BODIES; ++b) {
        const kvc_ops *t = kvc_ops_body(b);
        if (!t)
            continue;
        if (t->body != b) {
            printf("table %s holds body %d, expected %d\n", t->name, t->body, b);
            return 1;
        }
        if (kvc_cpu_runs(b))
            run_table(t);
        else
            printf("skip %s\n", t->name);
    }
    return 0;
}
