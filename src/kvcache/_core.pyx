# Compiled kernels of kvcache.  Directives are set once in setup.py.
#
# House rules (ARCHITECTURE.md): kernels take memoryviews and plain numbers, never touch a Python
# object inside `nogil`, never raise.  All validation, conversion, allocation and thread-count
# resolution happen in the Python layer (layer.py), once per call.  Every function here has a
# NumPy twin of the same name in kvcache/reference.py.
#
# Summation orders (documented, thread-count independent; the code is in _kernels.h):
#   * a row's f32 score is kvc_dot_f32 (8 fused-multiply-add lanes folded pairwise, then the
#     tail) times `scale`; a q8 score is kvc_score_q8w: per 32-channel group an 8-lane partial
#     of widened int8 values times the (column-folded) query, folded into the lanes with the
#     group's scale, then the lanes folded pairwise, times `scale`;
#   * the softmax of a query runs over its visible rows [first, end) in one piece;
#   * V is accumulated per chunk of CHUNK_ROWS rows (chunk c = absolute rows
#     [c*CHUNK_ROWS, (c+1)*CHUNK_ROWS)), rows in order inside a chunk (one fused multiply-add
#     per element and row), and the chunk partials are added in chunk order.  The chunking is
#     fixed by row index, so results are bit-identical for any thread count and for any
#     number of queries sharing the pass;
#   * importance: for each row p, the probabilities of the queries are added in query order.

from libc.stdlib cimport malloc, calloc, free
from libc.string cimport memcpy, memset
from libc.math cimport fabsf, tanhf, isfinite
from libc.stdint cimport int8_t
from cython.parallel cimport prange

from kvcache._openmp cimport KVC_OPENMP_BUILT, omp_get_max_threads, omp_get_thread_num

cdef extern from "_kernels.h" nogil:
    void kvc_task_scores(const float *q, Py_ssize_t nq, const Py_ssize_t *qf,
                         const Py_ssize_t *qe, const float *kf, const int8_t *kq,
                         const float *ks, Py_ssize_t ng, int quant_k, Py_ssize_t p0,
                         Py_ssize_t p1, Py_ssize_t hd, float scale, float softcap,
                         float *probs, Py_ssize_t L, float *scratch)
    void kvc_task_values(const float *probs, Py_ssize_t L, Py_ssize_t nq,
                         const Py_ssize_t *qf, const Py_ssize_t *qe, const float *vf,
                         const int8_t *vq, const float *vs, int quant_v, Py_ssize_t p0,
                         Py_ssize_t p1, Py_ssize_t hd, float *acc, float *scratch)
    void kvc_axpy_f32(float *y, float w, const float *x, Py_ssize_t n)
    void kvc_softmax(float *s, Py_ssize_t n)
    void kvc_quant_row(const float *x, const float *col, Py_ssize_t hd, Py_ssize_t group,
                       int8_t *q, float *s)
    bint KVC_SIMD
    Py_ssize_t KVC_SCRATCH_FLOATS(Py_ssize_t hd)

CHUNK_ROWS = 256
cdef Py_ssize_t _CHUNK = 256
# below this many multiply-adds a call stays on the calling thread
cdef Py_ssize_t _PAR_WORK = 1 << 16
# probabilities of one batch of groups: about half of a core's L2
cdef Py_ssize_t _BATCH_BYTES = 384 * 1024


def simd_built():
    """True when the AVX2/FMA inner loops were compiled in."""
    return bool(KVC_SIMD)


def openmp_built():
    """True when the extension was compiled with OpenMP."""
    return bool(KVC_OPENMP_BUILT)


def max_threads():
    """The OpenMP thread count in force now (threadpoolctl / OMP_NUM_THREADS aware)."""
    return omp_get_max_threads()


def store_rows_f32(const float[:, :, ::1] x__nhd, const unsigned char[::1] alive__h,
                   const Py_ssize_t[::1] head_len__h, float[:, :, ::1] store__hcd):
    """store[h, head_len[h] + i] = x[i, h] for every alive head h and row i."""
    cdef Py_ssize_t n = x__nhd.shape[0], nkv = x__nhd.shape[1], hd = x__nhd.shape[2]
    cdef Py_ssize_t h, i
    with nogil:
        for h in range(nkv):
            if alive__h[h]:
                for i in range(n):
                    memcpy(&store__hcd[h, head_len__h[h] + i, 0], &x__nhd[i, h, 0],
                           hd * sizeof(float))


def store_rows_q8(const float[:, :, ::1] x__nhd, const unsigned char[::1] alive__h,
                  const Py_ssize_t[::1] head_len__h, const float[:, ::1] col__hd,
                  const unsigned char[::1] col_on__h, Py_ssize_t group,
                  int8_t[:, :, ::1] q__hcd, float[:, :, ::1] s__hcg):
    """Quantise x[i, h] (divided by col[h] where col_on[h]) into q/s at row head_len[h] + i."""
    cdef Py_ssize_t n = x__nhd.shape[0], nkv = x__nhd.shape[1], hd = x__nhd.shape[2]
    cdef Py_ssize_t h, i, r
    with nogil:
        for h in range(nkv):
            if alive__h[h]:
                for i in range(n):
                    r = head_len__h[h] + i
                    kvc_quant_row(&x__nhd[i, h, 0], &col__hd[h, 0] if col_on__h[h] else NULL,
                                  hd, group, &q__hcd[h, r, 0], &s__hcg[h, r, 0])


def quantize_rows(const float[:, ::1] x__nd, const float[::1] col__d, Py_ssize_t group,
                  int8_t[:, ::1] q__nd, float[:, ::1] s__ng, int n_threads):
    """Row quantisation (spec 3.1) of x (n, hd) into q (n, hd) and s (n, ceil(hd/group)).

    col of length 0 means "no column field" (col == 1)."""
    cdef Py_ssize_t n = x__nd.shape[0], hd = x__nd.shape[1], i
    cdef bint has_col = col__d.shape[0] > 0
    if n == 0:
        return
    for i in prange(n, nogil=True, num_threads=n_threads, schedule="static",
                    use_threads_if=n * hd > _PAR_WORK):
        kvc_quant_row(&x__nd[i, 0], &col__d[0] if has_col else NULL, hd, group,
                      &q__nd[i, 0], &s__ng[i, 0])


def stream_read(const float[::1] buf, int n_threads):
    """Sum a large buffer with every thread: the read-bandwidth probe of the benchmark."""
    cdef Py_ssize_t n = buf.shape[0], nblk, b, lo, hi
    cdef Py_ssize_t blk = 1 << 16
    cdef double total = 0.0
    nblk = (n + blk - 1) // blk
    for b in prange(nblk, nogil=True, num_threads=n_threads, schedule="static"):
        lo = b * blk
        hi = lo + blk
        if hi > n:
            hi = n
        total += _block_sum(&buf[lo], hi - lo)
    return total


cdef inline double _block_sum(const float *p, Py_ssize_t n) noexcept nogil:
    cdef float acc[16]
    cdef Py_ssize_t i = 0
    cdef int l
    for l in range(16):
        acc[l] = 0.0
    while i + 16 <= n:
        for l in range(16):
            acc[l] += p[i + l]
        i += 16
    while i < n:
        acc[0] += p[i]
        i += 1
    cdef double s = 0.0
    for l in range(16):
        s += acc[l]
    return s


def attend_rows(const float[:, :, ::1] kf__hcd, const int8_t[:, :, ::1] kq__hcd,
                const float[:, :, ::1] ks__hcg,
                const float[:, :, ::1] vf__hcd, const int8_t[:, :, ::1] vq__hcd,
                const float[:, :, ::1] vs__hc1, const float[:, ::1] vcol__hd,
                const Py_ssize_t[::1] head_len__h,
                const float[:, ::1] q__jd, const Py_ssize_t[::1] group_q0,
                Py_ssize_t n_pos, Py_ssize_t n_back, Py_ssize_t window, Py_ssize_t first,
                float scale, float softcap,
                float[:, ::1] out__jd, float[:, ::1] probs__jl, float[::1] imp__l,
                int imp_mode, bint quant_k, bint quant_v, int n_threads):
    """Grouped attention of nq queries over the head-major storage of one layer.

    Queries of KV head g are rows [group_q0[g], group_q0[g+1]) of q, ordered position-major
    (n_pos positions, each with the group's heads).  Query position i of a group sees the
    stored rows [first_i, end_i) with end_i = head_len[g] - n_back + i + 1 (clamped to
    [0, head_len[g]]), first_i = max(end_i - window, 0) when window > 0, then
    first_i = min(max(first_i, first), end_i - 1).  In q8-K mode q must already be multiplied
    by the frozen key columns.

    Fills out (nq, hd) and probs (nq, L) (normalised probabilities, 0 outside the visible
    rows).  imp_mode 0: importance untouched; 1: imp[p] += probs[j, p] for each query j in
    order (attend_group); 2: imp[p] += (sum over queries in order of probs[j, p])
    (attend_all_heads: a fresh buffer added once).  Rows p >= head_len of a query's group and
    p >= len(imp) are never touched.
    """
    cdef Py_ssize_t nkv = head_len__h.shape[0], hd = q__jd.shape[1], nq = q__jd.shape[0]
    cdef Py_ssize_t L = probs__jl.shape[1], n_imp = imp__l.shape[0]
    cdef Py_ssize_t g, j, jl, t, c, p, p0, p1, cnt, per, i, e, f, ntasks, maxcnt, work
    cdef float *part
    cdef Py_ssize_t *q_first
    cdef Py_ssize_t *q_end
    cdef Py_ssize_t *task_g
    cdef Py_ssize_t *task_p0
    cdef Py_ssize_t *task_p1
    cdef Py_ssize_t *g_task0
    cdef Py_ssize_t *g_lo
    cdef Py_ssize_t *g_hi
    cdef Py_ssize_t *q_group
    cdef Py_ssize_t lo, hi
    cdef bint par
    cdef float *scratch
    cdef float *imp_tmp
    cdef Py_ssize_t ga, gb, t0, t1, j0, j1
    cdef Py_ssize_t nscr, ngk

    if nq == 0:
        return
    q_first = <Py_ssize_t *> malloc(nq * sizeof(Py_ssize_t))
    q_end = <Py_ssize_t *> malloc(nq * sizeof(Py_ssize_t))
    q_group = <Py_ssize_t *> malloc(nq * sizeof(Py_ssize_t))
    g_task0 = <Py_ssize_t *> malloc((nkv + 1) * sizeof(Py_ssize_t))
    g_lo = <Py_ssize_t *> malloc(nkv * sizeof(Py_ssize_t))
    g_hi = <Py_ssize_t *> malloc(nkv * sizeof(Py_ssize_t))
    task_g = task_p0 = task_p1 = NULL
    part = NULL
    scratch = NULL
    imp_tmp = NULL
    try:
        if q_first == NULL or q_end == NULL or q_group == NULL or g_task0 == NULL \
                or g_lo == NULL or g_hi == NULL:
            raise MemoryError()
        # ---- visible ranges and the (group, chunk) task list -----------------------------
        ntasks = 0
        maxcnt = 0
        work = 0
        for g in range(nkv):
            cnt = group_q0[g + 1] - group_q0[g]
            g_task0[g] = ntasks
            g_lo[g] = g_hi[g] = 0
            if cnt == 0:
                continue
            if cnt > maxcnt:
                maxcnt = cnt
            per = cnt // n_pos
            lo = head_len__h[g]
            hi = 0
            for jl in range(cnt):
                j = group_q0[g] + jl
                i = jl // per
                e = head_len__h[g] - n_back + i + 1
                if e < 0:
                    e = 0
                if e > head_len__h[g]:
                    e = head_len__h[g]
                if e > L:
                    e = L
                f = 0
                if window > 0 and e - window > 0:
                    f = e - window
                if first > f:
                    f = first
                if f > e - 1:
                    f = e - 1
                if f < 0:
                    f = 0
                q_first[j] = f
                q_end[j] = e
                q_group[j] = g
                if e > f:
                    if f < lo:
                        lo = f
                    if e > hi:
                        hi = e
                    work += (e - f) * hd
            if hi > lo:
                g_lo[g] = lo
                g_hi[g] = hi
                ntasks += (hi - 1) // _CHUNK - lo // _CHUNK + 1
        g_task0[nkv] = ntasks
        task_g = <Py_ssize_t *> malloc((ntasks + 1) * sizeof(Py_ssize_t))
        task_p0 = <Py_ssize_t *> malloc((ntasks + 1) * sizeof(Py_ssize_t))
        task_p1 = <Py_ssize_t *> malloc((ntasks + 1) * sizeof(Py_ssize_t))
        part = <float *> malloc((ntasks * maxcnt * hd + 1) * sizeof(float))
        # per-thread scratch, sized by _kernels.h for the passes that use it
        nscr = KVC_SCRATCH_FLOATS(hd)
        scratch = <float *> malloc((n_threads * nscr + 1) * sizeof(float))
        if part == NULL or task_g == NULL or task_p0 == NULL or task_p1 == NULL \
                or scratch == NULL:
            raise MemoryError()
        t = 0
        for g in range(nkv):
            lo = g_lo[g]
            hi = g_hi[g]
            if hi <= lo:
                continue
            for c in range(lo // _CHUNK, (hi - 1) // _CHUNK + 1):
                task_g[t] = g
                task_p0[t] = lo if c * _CHUNK < lo else c * _CHUNK
                task_p1[t] = hi if (c + 1) * _CHUNK > hi else (c + 1) * _CHUNK
                t += 1
        par = work > _PAR_WORK
        ngk = ks__hcg.shape[2]

        # ---- groups are processed in batches whose probabilities (batch queries x L floats)
        # stay in the core's L2 between the score, softmax, value and importance passes
        if imp_mode == 2:
            imp_tmp = <float *> calloc(L + 1, sizeof(float))
            if imp_tmp == NULL:
                raise MemoryError()
        ga = 0
        while ga < nkv:
            gb = ga + 1
            while gb < nkv and (group_q0[gb + 1] - group_q0[ga]) * L * 4 <= _BATCH_BYTES:
                gb += 1
            t0 = g_task0[ga]
            t1 = g_task0[gb]
            j0 = group_q0[ga]
            j1 = group_q0[gb]
            ga = gb
            if t1 == t0:
                continue

            # 1. scores: a block of 4 K rows is read once for all the group's queries
            for t in prange(t0, t1, nogil=True, num_threads=n_threads, schedule="static",
                            use_threads_if=par):
                g = task_g[t]
                kvc_task_scores(&q__jd[group_q0[g], 0], group_q0[g + 1] - group_q0[g],
                                q_first + group_q0[g], q_end + group_q0[g],
                                NULL if quant_k else &kf__hcd[g, 0, 0],
                                &kq__hcd[g, 0, 0] if quant_k else NULL,
                                &ks__hcg[g, 0, 0] if quant_k else NULL, ngk, quant_k,
                                task_p0[t], task_p1[t], hd, scale, softcap,
                                &probs__jl[group_q0[g], 0], L,
                                scratch + omp_get_thread_num() * nscr)

            # 2. softmax per query over its visible rows; zeros elsewhere
            for j in prange(j0, j1, nogil=True, num_threads=n_threads, schedule="static",
                            use_threads_if=par):
                if q_first[j] > 0:
                    memset(&probs__jl[j, 0], 0, q_first[j] * sizeof(float))
                if q_end[j] < L:
                    memset(&probs__jl[j, q_end[j]], 0, (L - q_end[j]) * sizeof(float))
                if q_end[j] > q_first[j]:
                    kvc_softmax(&probs__jl[j, q_first[j]], q_end[j] - q_first[j])

            # 3. V partials per chunk: a block of 4 V rows read once for the group
            for t in prange(t0, t1, nogil=True, num_threads=n_threads, schedule="static",
                            use_threads_if=par):
                g = task_g[t]
                kvc_task_values(&probs__jl[group_q0[g], 0], L, group_q0[g + 1] - group_q0[g],
                                q_first + group_q0[g], q_end + group_q0[g],
                                NULL if quant_v else &vf__hcd[g, 0, 0],
                                &vq__hcd[g, 0, 0] if quant_v else NULL,
                                &vs__hc1[g, 0, 0] if quant_v else NULL, quant_v,
                                task_p0[t], task_p1[t], hd, part + t * maxcnt * hd,
                                scratch + omp_get_thread_num() * nscr)

            # 4. importance of the batch's queries, in query order, per chunk of rows
            if imp_mode != 0:
                hi = n_imp if n_imp < L else L
                for c in prange((hi + _CHUNK - 1) // _CHUNK, nogil=True, num_threads=n_threads,
                                schedule="static", use_threads_if=par):
                    _importance_chunk(probs__jl, q_group, head_len__h, j0, j1, c * _CHUNK,
                                      min(hi, (c + 1) * _CHUNK), imp__l, imp_mode, imp_tmp)

        # ---- 5. merge the chunk partials in chunk order ---------------------------------
        for j in prange(nq, nogil=True, num_threads=n_threads, schedule="static",
                        use_threads_if=par):
            g = q_group[j]
            memset(&out__jd[j, 0], 0, hd * sizeof(float))
            for t in range(g_task0[g], g_task0[g + 1]):
                if task_p1[t] <= q_first[j] or task_p0[t] >= q_end[j]:
                    continue
                kvc_axpy_f32(&out__jd[j, 0], 1.0, part + (t * maxcnt + j - group_q0[g]) * hd, hd)
            if quant_v:
                for e in range(hd):
                    out__jd[j, e] = out__jd[j, e] * vcol__hd[g, e]

        # ---- 6. attend_all_heads importance: the fresh per-row sums are added once -------
        if imp_mode == 2:
            hi = n_imp if n_imp < L else L
            for p in prange(hi, nogil=True, num_threads=n_threads, schedule="static",
                            use_threads_if=par):
                imp__l[p] += imp_tmp[p]
    finally:
        free(q_first)
        free(q_end)
        free(q_group)
        free(g_task0)
        free(g_lo)
        free(g_hi)
        free(task_g)
        free(task_p0)
        free(task_p1)
        free(part)
        free(scratch)
        free(imp_tmp)


cdef void _importance_chunk(const float[:, ::1] probs__jl, const Py_ssize_t *q_group,
                            const Py_ssize_t[::1] head_len__h, Py_ssize_t j0, Py_ssize_t j1,
                            Py_ssize_t p0, Py_ssize_t p1, float[::1] imp__l, int imp_mode,
                            float *imp_tmp) noexcept nogil:
    """For p in [p0, p1) below the query's group head_len, add probs[j, p] for the queries
    j in [j0, j1) in order: into imp (mode 1) or into the fresh buffer imp_tmp (mode 2)."""
    cdef Py_ssize_t j, p, hi
    for j in range(j0, j1):
        hi = head_len__h[q_group[j]]
        if hi > p1:
            hi = p1
        if imp_mode == 1:
            for p in range(p0, hi):
                imp__l[p] += probs__jl[j, p]
        else:
            for p in range(p0, hi):
                imp_tmp[p] = imp_tmp[p] + probs__jl[j, p]
