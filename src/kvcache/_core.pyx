# Compiled kernels of kvcache.  Directives are set once in setup.py.
#
# House rules (docs/architecture.md): kernels take memoryviews and plain numbers, never touch a Python
# object inside `nogil`, never raise.  All validation, conversion, allocation and thread-count
# resolution happen in the Python layer (layer.py), once per call.  Every function here has a
# NumPy twin of the same name in kvcache/reference.py.
#
# Summation orders (documented, thread-count independent; the code is in _kernels.h):
#   * a row's f32 score is kvc_dot_f32 (8 fused-multiply-add lanes folded pairwise, then the
#     tail) times `scale`; a q8 score is integer scoring (_kernels.h, "q8 scoring"): the
#     (column-folded) query quantised per 32-channel group once per call, exact int32 group
#     sums, groups combined in order as acc = fmaf(isum, sq * sk, acc), times `scale`; the
#     instruction-set body (chosen per family, read once per call) changes speed, never bits;
#   * the softmax of a query runs over its visible rows [first, end) in one piece;
#   * V is accumulated per chunk of CHUNK_ROWS rows (chunk c = absolute rows
#     [c*CHUNK_ROWS, (c+1)*CHUNK_ROWS)), rows in order inside a chunk (one fused multiply-add
#     per element and row), and the chunk partials are added in chunk order.  The chunking is
#     fixed by row index, so results are bit-identical for any thread count and for any
#     number of queries sharing the pass;
#   * importance: for each row p, the probabilities of the queries are added in query order.
#   * attend_blocked (prompt blocks: 64-row tiles, online softmax) has its own orders, at the top
#     of _prefill.h.

from libc.stdlib cimport malloc, calloc, free
from libc.string cimport memcpy, memset
from libc.math cimport fabsf, tanhf, isfinite, INFINITY
from libc.stdint cimport int8_t, int32_t
from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING
from cpython.buffer cimport PyBuffer_FillInfo
from cython.parallel cimport prange

import numpy as np

from kvcache._openmp cimport KVC_OPENMP_BUILT, omp_get_max_threads, omp_get_thread_num

cdef extern from "_dispatch.h" nogil:
    ctypedef void (*kvc_mla_task_fn)(const float *qT, Py_ssize_t H, Py_ssize_t Hp,
                                     const float *lat, const float *kr, Py_ssize_t r,
                                     Py_ssize_t dr, Py_ssize_t p0, Py_ssize_t p1,
                                     Py_ssize_t pf_end, float scale, float *acc, float *m,
                                     float *l, float *S) noexcept nogil
    ctypedef struct kvc_ops:
        const char *name
        void (*task_scores)(const float *q, Py_ssize_t nq, const Py_ssize_t *qf,
                            const Py_ssize_t *qe, const float *kf, Py_ssize_t p0,
                            Py_ssize_t p1, Py_ssize_t hd, float scale, float softcap,
                            float *probs, Py_ssize_t L) noexcept nogil
        void (*task_values)(const float *probs, Py_ssize_t L, Py_ssize_t nq,
                            const Py_ssize_t *qf, const Py_ssize_t *qe, const float *vf,
                            const int8_t *vq, const float *vs, int quant_v, Py_ssize_t p0,
                            Py_ssize_t p1, Py_ssize_t hd, float *acc,
                            float *scratch) noexcept nogil
        void (*axpy)(float *y, float w, const float *x, Py_ssize_t n) noexcept nogil
        void (*softmax)(float *s, Py_ssize_t n) noexcept nogil
        void (*quant_row)(const float *x, const float *col, Py_ssize_t hd, Py_ssize_t group,
                          int8_t *q, float *s) noexcept nogil
        void (*quant_query)(const float *x, Py_ssize_t hd, Py_ssize_t group, int8_t *qi,
                            float *sq, int32_t *qsum) noexcept nogil
        void (*o1_absorb)(const float *qt, const float *k, const float *v, Py_ssize_t m,
                          Py_ssize_t d, Py_ssize_t dv, float scale, float *t_hat,
                          float *z_hat, float *m_max, float *l) noexcept nogil
        void (*o1_head)(const float *q, Py_ssize_t d, Py_ssize_t dv, float scale,
                        const float *sink_k, const float *sink_v, Py_ssize_t ns,
                        const float *win_k, const float *win_v, Py_ssize_t nw, Py_ssize_t slot,
                        const float *k_new, const float *v_new, const float *k_tilde,
                        const float *mu, const float *t_hat, const float *z_hat,
                        const float *m_max, Py_ssize_t m, int use_far, int fm, float *out,
                        float *scr) noexcept nogil
        void (*task_scores_i8)(int isa, Py_ssize_t group, const int8_t *qi, const float *sq,
                               const int32_t *qsum, Py_ssize_t nq, const Py_ssize_t *qf,
                               const Py_ssize_t *qe, const int8_t *kq, const float *ks,
                               Py_ssize_t ks_stride, Py_ssize_t p0, Py_ssize_t p1,
                               Py_ssize_t hd, float scale, float softcap, float *probs,
                               Py_ssize_t L) noexcept nogil
        void (*i8_rows)(int isa, Py_ssize_t group, const int8_t *qi, const float *sq,
                        const int32_t *qsum, const int8_t *k, const float *ks,
                        Py_ssize_t ks_stride, Py_ssize_t hd, Py_ssize_t n,
                        float *out) noexcept nogil
        void (*pf_task)(const float *q, Py_ssize_t nq, const Py_ssize_t *qf,
                        const Py_ssize_t *qe, const float *kf, const int8_t *kq,
                        const float *ks, Py_ssize_t ks_stride, int quant_k, const float *vf,
                        const int8_t *vq, const float *vs, Py_ssize_t vs_stride, int quant_v,
                        const float *vcol, Py_ssize_t hd, float scale, float softcap,
                        float *out, float *qm, float *ql, float *scratch, int isa,
                        Py_ssize_t group, const int8_t *qi, const float *qsc,
                        const int32_t *qsum) noexcept nogil
        void (*pf_imp_group)(const float *q, Py_ssize_t nq, const Py_ssize_t *qf,
                             const Py_ssize_t *qe, const float *qm, const float *ql,
                             const float *kf, const int8_t *kq, const float *ks,
                             Py_ssize_t ks_stride, int quant_k, Py_ssize_t hd, float scale,
                             float softcap, Py_ssize_t t0, Py_ssize_t t1, float *colsum,
                             float *scratch, int isa, Py_ssize_t group, const int8_t *qi,
                             const float *qsc, const int32_t *qsum) noexcept nogil
        void (*mla_fold)(const float *qn, const float *qr, const float *wuk, Py_ssize_t dn,
                         Py_ssize_t r, Py_ssize_t dr, Py_ssize_t h, Py_ssize_t Hp, float *qa,
                         float *qT) noexcept nogil
        kvc_mla_task_fn (*mla_task_for)(int body) noexcept nogil
        const char *(*mla_path_for)(int body) noexcept nogil
        void (*mla_merge_head)(const float *acc, Py_ssize_t acc_stride, const float *m,
                               const float *l, Py_ssize_t ml_stride, Py_ssize_t nt,
                               const float *wuv, Py_ssize_t r, Py_ssize_t dv, float *c,
                               float *out) noexcept nogil
        float (*fma_probe)(long iters, float x) noexcept nogil
        int body
    const kvc_ops kvc_ops_portable
    const kvc_ops *kvc_ops_body(int body)
    const kvc_ops *kvc_ops_of(int body)
    int KVC_FAM_F32
    int KVC_FAM_Q8
    int KVC_FAM_PREFILL
    int KVC_FAM_MLA
    int KVC_N_FAMILIES
    int KVC_N_BODIES
    int KVC_N_FEATURES
    unsigned kvc_cpu_features()
    unsigned kvc_body_needs(int body)
    Py_ssize_t KVC_SCRATCH_FLOATS(Py_ssize_t hd)
    Py_ssize_t KVC_I8_PAD(Py_ssize_t hd)
    Py_ssize_t KVC_I8_GROUPS(Py_ssize_t hd, Py_ssize_t group)
    Py_ssize_t KVC_MLA_BLOCK
    Py_ssize_t KVC_PF_TILE
    Py_ssize_t KVC_PF_QR
    Py_ssize_t KVC_PF_IMP_ROWS
    Py_ssize_t KVC_PF_SCRATCH_FLOATS(Py_ssize_t hd, Py_ssize_t nq)
    Py_ssize_t KVC_PF_IMP_SCRATCH(Py_ssize_t hd)

# the body in use per family (KVC_FAM_*), set only by set_bodies (which checks it against the
# CPU's features); a kernel call reads its family's table once, before its parallel region
cdef int _family_body[4]

cdef inline const kvc_ops *_ops(int family) noexcept nogil:
    return kvc_ops_of(_family_body[family])


cdef extern from *:
    """
    #if defined(__linux__)
    #include <sys/mman.h>
    #include <stdint.h>
    #endif
    /* Ask for transparent huge pages on the page-aligned rest of a fresh buffer, so that
     * first touching it costs one page fault per 2 MiB instead of per 4 KiB (what NumPy does
     * for its own large arrays).  A hint only: a no-op where unsupported. */
    static void kvc_advise_huge(char *p, size_t n)
    {
    #if defined(__linux__) && defined(MADV_HUGEPAGE)
        uintptr_t a = ((uintptr_t)p + 0xFFF) & ~(uintptr_t)0xFFF;
        uintptr_t e = (uintptr_t)p + n;
        if (e > a)
            (void)madvise((void *)a, e - a, MADV_HUGEPAGE);
    #else
        (void)p;
        (void)n;
    #endif
    }
    """
    void kvc_advise_huge(char *p, size_t n) nogil

# rows per V-accumulation chunk; kvcache.quant.CHUNK_ROWS is the Python side's copy (a test
# holds them equal), reference.py reads that one
cdef Py_ssize_t _CHUNK = 256
CHUNK_ROWS = _CHUNK
# below this many multiply-adds a call stays on the calling thread
cdef Py_ssize_t _PAR_WORK = 1 << 16
# probabilities of one batch of groups: about half of a core's L2
cdef Py_ssize_t _BATCH_BYTES = 384 * 1024


cdef class _BytesWriter:
    """A writable buffer over a bytes object being built; it keeps the bytes object alive."""
    cdef object owner
    cdef char *p
    cdef Py_ssize_t n

    def __getbuffer__(self, Py_buffer *buf, int flags):
        PyBuffer_FillInfo(buf, self, self.p, self.n, 0, flags)

    def __releasebuffer__(self, Py_buffer *buf):
        pass


def fresh_bytes(Py_ssize_t n):
    """A new ``bytes`` object of n uninitialised bytes and a writable buffer over its memory.

    For the wire writers: the caller fills the buffer, drops it, and only then hands the bytes
    object out (it is never shared while being written; the buffer object keeps it alive).
    Large buffers are advised to use huge pages, which makes the first write several times
    faster on machines where 4 KiB page faults are expensive."""
    if n < 0:
        raise ValueError(f"n: expected a size >= 0, got {n}")
    b = PyBytes_FromStringAndSize(NULL, n)
    cdef _BytesWriter w = _BytesWriter.__new__(_BytesWriter)
    w.owner = b
    w.p = PyBytes_AS_STRING(b)
    w.n = n
    if n >= (4 << 20):
        kvc_advise_huge(w.p, <size_t>n)
    return b, w


# ---- instruction-set bodies (_isa.h, _dispatch.h, kvcache/_dispatch.py) ---------------------
# The CPU's features are a set; each family runs the best body it holds whose every needed
# feature the CPU reports.  KVCACHE_ISA / set_isa only narrow that choice, never widen it.
from kvcache import _dispatch as _dp

if (len(_dp.FEATURES), len(_dp.BODIES), len(_dp.FAMILIES)) != (
        KVC_N_FEATURES, KVC_N_BODIES, KVC_N_FAMILIES):   # the C and Python tables are one table
    raise ImportError("kvcache._core: the feature, body or family tables of _isa.h / "
                      "_dispatch.h and kvcache/_dispatch.py disagree; rebuild the extension")
_BODY_ID = {name: i for i, name in enumerate(_dp.BODIES)}
_FAMILY_ID = {name: i for i, name in enumerate(_dp.FAMILIES)}
_isa_cap = None


def _short(value):
    """repr(value), cut to 40 characters (an environment variable may hold anything)."""
    r = repr(value)
    return r if len(r) <= 40 else r[:36] + "...'"


def _names(unsigned bits, names):
    return frozenset(name for i, name in enumerate(names) if bits >> i & 1)


def cpu_features():
    """The instruction-set features this CPU and OS support (a frozenset of names of
    ``kvcache._dispatch.FEATURES``, e.g. ``{"avx2", "fma", "avx512f", ...}``)."""
    return _names(kvc_cpu_features(), _dp.FEATURES)


def body_needs(name):
    """The features body ``name`` may execute, as compiled (``kvc_body_needs``); ValueError
    for an unknown name."""
    if not isinstance(name, str) or name not in _BODY_ID:
        raise ValueError(f"body: expected one of {list(_dp.BODIES)}, got {name!r}")
    return _names(kvc_body_needs(_BODY_ID[name]), _dp.FEATURES)


def built_bodies():
    """Family -> the bodies this build holds for it (a tuple of names, portable first): those
    of ``kvcache._dispatch.HELD`` whose unit was compiled (_dispatch.h)."""
    cdef const kvc_ops *t
    units = set()
    for i, name in enumerate(_dp.BODIES):
        t = kvc_ops_body(i)
        if t != NULL and t.body == i and t.name == name.encode():   # a unit of that body
            units.add(name)
    return {fam: tuple(b for b in _dp.BODIES if b in units and b in _dp.HELD[fam])
            for fam in _dp.FAMILIES}


def bodies():
    """Family -> the body it runs now (a name of ``kvcache._dispatch.BODIES``)."""
    return {fam: _dp.BODIES[_family_body[i]] for i, fam in enumerate(_dp.FAMILIES)}


def set_bodies(choice):
    """Run body ``choice[family]`` for each family named (a mapping), from the next kernel call
    on.  All or nothing: ValueError, changing nothing, for an unknown family or body, a body
    the build does not hold for that family, or one needing a feature the CPU lacks."""
    global _isa_cap
    cdef unsigned have = kvc_cpu_features(), need
    if not hasattr(choice, "items"):
        raise TypeError(f"set_bodies: expected a mapping of family -> body, got "
                        f"{type(choice).__name__}")
    built = built_bodies()
    todo = []
    for fam, body in list(choice.items()):
        if fam not in _FAMILY_ID:
            raise ValueError(f"family: expected one of {list(_dp.FAMILIES)}, got {_short(fam)}")
        if body not in _BODY_ID:
            raise ValueError(f"{fam}: expected one of {list(_dp.BODIES)}, got {_short(body)}")
        if body not in built[fam]:
            raise ValueError(f"{fam}: this build holds no {body!r} body (it holds "
                             f"{', '.join(built[fam])})")
        need = kvc_body_needs(_BODY_ID[body])
        if need & have != need:
            missing = sorted(_names(need & ~have, _dp.FEATURES))
            raise ValueError(f"{fam}: the {body!r} body needs {', '.join(missing)}, which this "
                             f"CPU does not report")
        todo.append((_FAMILY_ID[fam], _BODY_ID[body]))
    for f, b in todo:
        _family_body[f] = b
    _isa_cap = None      # a choice per family: no single limit names it any more


def isa_detected():
    """The most capable body this CPU runs and this build holds, for display (``"avx512"``,
    ``"avxvnni"``, ``"avx2"``, ``"neondot"``, ``"neon"`` or ``"portable"``; each family still
    runs its own best body)."""
    held = set().union(*built_bodies().values())
    runs = set(_dp.runnable(cpu_features()))
    return next(b for b in _dp.MOST_CAPABLE if b in held and b in runs)


def isa():
    """The body name the kernels are limited to now: the one set by ``set_isa`` or
    ``KVCACHE_ISA``, else :func:`isa_detected` (docs/numerics.md, "Dispatch")."""
    return _isa_cap if _isa_cap is not None else isa_detected()


def set_isa(name):
    """Limit every family to bodies whose needs are within those of body ``name`` (a name of
    ``kvcache._dispatch.BODIES``: ``"portable"``, ``"avx2"``, ``"neon"``, ...), from the next
    kernel call on;
    ``None`` lifts the limit.  Every body gives the same bits.  ValueError, changing nothing,
    for an unknown name or a body that needs a feature this CPU does not report."""
    global _isa_cap
    if isinstance(name, str):
        name = name.strip().lower()
    if name is not None and (not isinstance(name, str) or name not in _BODY_ID):
        raise ValueError(f"isa: expected one of {list(_dp.BODIES)} or None, got {_short(name)}")
    built = built_bodies()
    if name is not None and not any(name in held for held in built.values()):
        raise ValueError(f"isa: this build holds no {name!r} body")
    set_bodies(_dp.choose(cpu_features(), built, cap=name))
    _isa_cap = name


def isa_build():
    """What the build holds: ``"portable + avx2, avxvnni, avx512"`` (the units compiled
    besides the portable C), or ``"portable C"`` (no SIMD unit: a compiler without the targets,
    or KVCACHE_NO_SIMD)."""
    units = [b for b in _dp.BODIES if b != "portable"
             and any(b in held for held in built_bodies().values())]
    return "portable + " + ", ".join(units) if units else "portable C"


def _isa_from_env():
    """Choose the bodies at import: the best per family, limited by KVCACHE_ISA when it names
    a body the CPU runs (a one-line RuntimeWarning, and no limit, for any other value)."""
    import os
    import warnings
    set_isa(None)
    want = os.environ.get("KVCACHE_ISA", "").strip().lower()
    if not want:
        return
    try:
        set_isa(want)
    except ValueError as exc:
        warnings.warn(f"KVCACHE_ISA={_short(want)} ignored, using {isa()!r}: {exc}",
                      RuntimeWarning, stacklevel=2)


_isa_from_env()


cdef Py_ssize_t _k_group(Py_ssize_t hd, Py_ssize_t n_scales, Py_ssize_t k_group) except -1:
    """The K group (16 or 32 channels) of a q8 call: ``k_group`` when given (16 or 32), else
    read from the K store's scales per row (ceil(hd / 16) scales: 16, otherwise 32; the two
    agree for head dims <= 16, where one partial group covers the row either way)."""
    if k_group == 16 or k_group == 32:
        return k_group
    if k_group != 0:
        raise ValueError(f"k_group: expected 16, 32 or 0 (from the scale count), got {k_group}")
    return 16 if hd > 16 and n_scales == (hd + 15) // 16 else 32


def quantize_query(const float[:, ::1] q__jd, int8_t[:, ::1] qi__jp, float[:, ::1] sq__jg,
                   int32_t[:, ::1] qsum__jg, Py_ssize_t group=32):
    """Quantise queries for q8 scoring (docs/numerics.md) in groups of ``group`` (16 or 32)
    channels: qi (nq, ceil(hd/32)*32) codes, zero past hd; sq and qsum (nq, ceil(hd/group))
    group scales (NaN for a group with a non-finite value) and group sums of the codes."""
    cdef Py_ssize_t nq = q__jd.shape[0], hd = q__jd.shape[1], j
    if group != 16 and group != 32:
        raise ValueError(f"group: expected 16 or 32, got {group}")
    if hd < 1 or qi__jp.shape[0] != nq or qi__jp.shape[1] != KVC_I8_PAD(hd) \
            or sq__jg.shape[0] != nq or sq__jg.shape[1] != KVC_I8_GROUPS(hd, group) \
            or qsum__jg.shape[0] != nq or qsum__jg.shape[1] != KVC_I8_GROUPS(hd, group):
        raise ValueError("quantize_query: expected qi (nq, ceil(hd/32)*32), sq and qsum "
                         "(nq, ceil(hd/group))")
    with nogil:
        for j in range(nq):
            _ops(KVC_FAM_Q8).quant_query(&q__jd[j, 0], hd, group, &qi__jp[j, 0], &sq__jg[j, 0],
                            &qsum__jg[j, 0])


def q8_scores(const float[:, ::1] q__jd, const int8_t[:, ::1] kq__rd, const float[:, ::1] ks__rg,
              float[:, ::1] out__jr, Py_ssize_t k_group=0):
    """Raw q8 scores (before the softmax scale) of every query against every int8 row, with
    the kernels' query quantiser and the q8 body in use: the arithmetic of
    attend_rows' and attend_blocked's q8 scores, exposed for tests.  ``k_group``: 16 or 32, or
    0 to read it from ks (ceil(hd/16) scales per row: 16)."""
    cdef Py_ssize_t nq = q__jd.shape[0], hd = q__jd.shape[1], n = kq__rd.shape[0], j
    cdef Py_ssize_t hdp, ng, group
    if hd < 1:
        raise ValueError("q8_scores: expected head_dim >= 1")
    group = _k_group(hd, ks__rg.shape[1], k_group)
    if kq__rd.shape[1] != hd or ks__rg.shape[0] != n \
            or ks__rg.shape[1] < KVC_I8_GROUPS(hd, group) or out__jr.shape[0] != nq \
            or out__jr.shape[1] != n:
        raise ValueError("q8_scores: expected kq (n, hd), ks (n, >= ceil(hd/group)), out (nq, n)")
    hdp = KVC_I8_PAD(hd)
    ng = KVC_I8_GROUPS(hd, group)
    qi_arr = np.zeros((max(nq, 1), hdp), dtype=np.int8)
    sq_arr = np.zeros((max(nq, 1), ng), dtype=np.float32)
    qs_arr = np.zeros((max(nq, 1), ng), dtype=np.int32)
    cdef int8_t[:, ::1] qi = qi_arr
    cdef float[:, ::1] sq = sq_arr
    cdef int32_t[:, ::1] qs = qs_arr
    cdef int level = _family_body[KVC_FAM_Q8]   # the q8 body, once per call
    cdef const kvc_ops *q8 = kvc_ops_of(level)
    if nq == 0 or n == 0:
        return
    with nogil:
        for j in range(nq):
            _ops(KVC_FAM_Q8).quant_query(&q__jd[j, 0], hd, group, &qi[j, 0], &sq[j, 0], &qs[j, 0])
            q8.i8_rows(level, group, &qi[j, 0], &sq[j, 0], &qs[j, 0], &kq__rd[0, 0],
                            &ks__rg[0, 0],
                            ks__rg.shape[1], hd, n, &out__jr[j, 0])


def simd_built():
    """True when a SIMD unit of this CPU family (x86-64 AVX2, aarch64 NEON) was compiled in."""
    return any(b in built_bodies()["f32"] for b in ("avx2", "neon"))


def openmp_built():
    """True when the extension was compiled with OpenMP."""
    return bool(KVC_OPENMP_BUILT)


def max_threads():
    """The OpenMP thread count in force now (threadpoolctl / OMP_NUM_THREADS aware)."""
    return omp_get_max_threads()


cdef extern from *:
    """
    #if defined(__linux__)
    #include <unistd.h>
    #include <sys/syscall.h>
    static long long kvc_gettid(void) { return (long long)syscall(SYS_gettid); }
    #else
    static long long kvc_gettid(void) { return 0; }
    #endif
    """
    long long kvc_gettid() nogil


def thread_ids(int n_threads):
    """Kernel thread ids (Linux; 0 elsewhere) of the OpenMP team of ``n_threads`` that the
    calling thread starts, by thread number (0 is the caller): kvcache._threads tells its own
    spinning workers from competing threads with them."""
    ids_arr = np.zeros(max(n_threads, 1), dtype=np.int64)
    cdef long long[::1] ids = ids_arr
    cdef int i
    for i in prange(n_threads, nogil=True, num_threads=n_threads, schedule="static", chunksize=1):
        ids[omp_get_thread_num()] = kvc_gettid()
    return ids_arr


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
                    _ops(KVC_FAM_Q8).quant_row(&x__nhd[i, h, 0], &col__hd[h, 0] if col_on__h[h] else NULL,
                                  hd, group, &q__hcd[h, r, 0], &s__hcg[h, r, 0])


def quantize_rows(const float[:, ::1] x__nd, const float[::1] col__d, Py_ssize_t group,
                  int8_t[:, ::1] q__nd, float[:, ::1] s__ng, int n_threads):
    """Row quantisation (docs/numerics.md) of x (n, hd) into q (n, hd) and s (n, ceil(hd/group)).

    col of length 0 means "no column field" (col == 1)."""
    cdef Py_ssize_t n = x__nd.shape[0], hd = x__nd.shape[1], i
    cdef bint has_col = col__d.shape[0] > 0
    if n == 0:
        return
    for i in prange(n, nogil=True, num_threads=n_threads, schedule="static",
                    use_threads_if=n * hd > _PAR_WORK):
        _ops(KVC_FAM_Q8).quant_row(&x__nd[i, 0], &col__d[0] if has_col else NULL, hd, group,
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


cdef inline Py_ssize_t _visible(Py_ssize_t stored, Py_ssize_t n_back, Py_ssize_t i,
                                Py_ssize_t window, Py_ssize_t first, Py_ssize_t cap,
                                Py_ssize_t *first_out) noexcept nogil:
    """The rows [first, end) that query position i of a group holding ``stored`` rows sees
    (the rule of attend_rows' docstring, reference.visible_range): returns end, writes first.
    ``cap`` bounds end as well (the probability rows' width in attend_rows)."""
    cdef Py_ssize_t e = stored - n_back + i + 1, f = 0
    if e < 0:
        e = 0
    if e > stored:
        e = stored
    if e > cap:
        e = cap
    if window > 0 and e - window > 0:
        f = e - window
    if first > f:
        f = first
    if f > e - 1:
        f = e - 1
    if f < 0:
        f = 0
    first_out[0] = f
    return e


cdef int _query_codes(const float *qp, Py_ssize_t nq, Py_ssize_t hd, Py_ssize_t kgroup,
                      int n_threads, bint par, int8_t **q_i8, float **q_sc,
                      int32_t **q_sum) except -1:
    """The int8 codes of nq contiguous queries for integer scoring (docs/numerics.md, "q8
    scoring"): allocates *q_i8 (nq x KVC_I8_PAD(hd)), *q_sc and *q_sum (nq x groups), which the
    caller frees (also after a MemoryError here), and quantises query j into row j."""
    cdef Py_ssize_t j, hdp = KVC_I8_PAD(hd), ngq = KVC_I8_GROUPS(hd, kgroup)
    q_i8[0] = <int8_t *> malloc(nq * hdp)
    q_sc[0] = <float *> malloc(nq * ngq * sizeof(float))
    q_sum[0] = <int32_t *> malloc(nq * ngq * sizeof(int32_t))
    if q_i8[0] == NULL or q_sc[0] == NULL or q_sum[0] == NULL:
        raise MemoryError()
    cdef int8_t *qi = q_i8[0]
    cdef float *sq = q_sc[0]
    cdef int32_t *qs = q_sum[0]
    for j in prange(nq, nogil=True, num_threads=n_threads, schedule="static",
                    use_threads_if=par):
        _ops(KVC_FAM_Q8).quant_query(qp + j * hd, hd, kgroup, qi + j * hdp, sq + j * ngq, qs + j * ngq)
    return 0


def attend_rows(const float[:, :, ::1] kf__hcd, const int8_t[:, :, ::1] kq__hcd,
                const float[:, :, ::1] ks__hcg,
                const float[:, :, ::1] vf__hcd, const int8_t[:, :, ::1] vq__hcd,
                const float[:, :, ::1] vs__hc1, const float[:, ::1] vcol__hd,
                const Py_ssize_t[::1] head_len__h,
                const float[:, ::1] q__jd, const Py_ssize_t[::1] group_q0,
                Py_ssize_t n_pos, Py_ssize_t n_back, Py_ssize_t window, Py_ssize_t first,
                float scale, float softcap,
                float[:, ::1] out__jd, float[:, ::1] probs__jl, float[::1] imp__l,
                int imp_mode, bint quant_k, bint quant_v, int n_threads, Py_ssize_t k_group=0):
    """Grouped attention of nq queries over the head-major storage of one layer.

    Queries of KV head g are rows [group_q0[g], group_q0[g+1]) of q, ordered position-major
    (n_pos positions, each with the group's heads).  Query position i of a group sees the
    stored rows [first_i, end_i) with end_i = head_len[g] - n_back + i + 1 (clamped to
    [0, head_len[g]]), first_i = max(end_i - window, 0) when window > 0, then
    first_i = min(max(first_i, first), end_i - 1).  In q8-K mode q must already be multiplied
    by the frozen key columns; q8 scores use K groups of ``k_group`` channels (16 or 32; 0:
    from ks, ceil(head_dim/16) scales per row meaning 16).

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
    cdef int8_t *q_i8 = NULL
    cdef float *q_sc = NULL
    cdef int32_t *q_sum = NULL
    cdef Py_ssize_t hdp = KVC_I8_PAD(hd), ngq, kgroup = 32
    cdef int level = _family_body[KVC_FAM_Q8]   # the q8 body, once per call
    cdef const kvc_ops *q8 = kvc_ops_of(level)
    cdef const kvc_ops *f32 = _ops(KVC_FAM_F32)

    if quant_k:
        kgroup = _k_group(hd, ks__hcg.shape[2], k_group)
    ngq = KVC_I8_GROUPS(hd, kgroup)
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
                e = _visible(head_len__h[g], n_back, i, window, first, L, &f)
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
        if quant_k:
            _query_codes(&q__jd[0, 0], nq, hd, kgroup, n_threads, par and nq * hd > _PAR_WORK,
                         &q_i8, &q_sc, &q_sum)

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
                if quant_k:
                    q8.task_scores_i8(level, kgroup, q_i8 + group_q0[g] * hdp,
                                       q_sc + group_q0[g] * ngq,
                                       q_sum + group_q0[g] * ngq, group_q0[g + 1] - group_q0[g],
                                       q_first + group_q0[g], q_end + group_q0[g],
                                       &kq__hcd[g, 0, 0], &ks__hcg[g, 0, 0], ngk,
                                       task_p0[t], task_p1[t], hd, scale, softcap,
                                       &probs__jl[group_q0[g], 0], L)
                else:
                    f32.task_scores(&q__jd[group_q0[g], 0], group_q0[g + 1] - group_q0[g],
                                    q_first + group_q0[g], q_end + group_q0[g],
                                    &kf__hcd[g, 0, 0], task_p0[t], task_p1[t], hd, scale,
                                    softcap, &probs__jl[group_q0[g], 0], L)

            # 2. softmax per query over its visible rows; zeros elsewhere
            for j in prange(j0, j1, nogil=True, num_threads=n_threads, schedule="static",
                            use_threads_if=par):
                if q_first[j] > 0:
                    memset(&probs__jl[j, 0], 0, q_first[j] * sizeof(float))
                if q_end[j] < L:
                    memset(&probs__jl[j, q_end[j]], 0, (L - q_end[j]) * sizeof(float))
                if q_end[j] > q_first[j]:
                    f32.softmax(&probs__jl[j, q_first[j]], q_end[j] - q_first[j])

            # 3. V partials per chunk: a block of 4 V rows read once for the group
            for t in prange(t0, t1, nogil=True, num_threads=n_threads, schedule="static",
                            use_threads_if=par):
                g = task_g[t]
                f32.task_values(&probs__jl[group_q0[g], 0], L, group_q0[g + 1] - group_q0[g],
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
                f32.axpy(&out__jd[j, 0], 1.0, part + (t * maxcnt + j - group_q0[g]) * hd, hd)
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
        free(q_i8)
        free(q_sc)
        free(q_sum)


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


# ----------------------------------------------------------------------------------------------
# O(1) Nystrom decode (docs/o1.md).  The state lives in o1.py as stacked float32 arrays: the group-
# shared part (window ring, sinks, key landmarks) indexed by KV group g, the per-head part
# (query landmarks, mixing matrix, far accumulators) by query head h; head h belongs to group
# h // (H // G).  The per-head arithmetic and its order are in _kernels.h (kvc_o1_absorb,
# kvc_o1_head); heads are independent, so the result is the same for any thread count.

cdef inline const float *_cptr3(const float[:, :, ::1] a) noexcept nogil:
    return &a[0, 0, 0] if a.shape[0] * a.shape[1] * a.shape[2] > 0 else NULL

cdef inline float *_ptr3(float[:, :, ::1] a) noexcept nogil:
    return &a[0, 0, 0] if a.shape[0] * a.shape[1] * a.shape[2] > 0 else NULL

cdef inline float *_ptr2(float[:, ::1] a) noexcept nogil:
    return &a[0, 0] if a.shape[0] * a.shape[1] > 0 else NULL


cdef inline _o1_check(bint ok, str what):
    if not ok:
        raise ValueError(f"O(1) kernel: inconsistent state or arguments, expected {what}")


def o1_absorb(const float[:, :, ::1] q_tilde__hmd, const float[:, :, ::1] keys__gnd,
              const float[:, :, ::1] values__gne, Py_ssize_t row0, Py_ssize_t n, float scale,
              float[:, :, ::1] t_hat__hme, float[:, ::1] z_hat__hm, float[:, ::1] m_max__hm,
              float[:, ::1] scr__hm, int n_threads):
    """Far-field insertion of rows [row0, row0 + n) of every group, in row order.

    Head h (group g = h // (H // G)) absorbs keys[g, i] / values[g, i] into t_hat[h],
    z_hat[h], m_max[h] with the per-landmark running max; scr (H, >= m) is scratch."""
    cdef Py_ssize_t H = q_tilde__hmd.shape[0], m = q_tilde__hmd.shape[1]
    cdef Py_ssize_t d = q_tilde__hmd.shape[2], G = keys__gnd.shape[0]
    cdef Py_ssize_t rows = keys__gnd.shape[1], dv = values__gne.shape[2]
    cdef Py_ssize_t hpk, h, g, i
    cdef const float *qt = _cptr3(q_tilde__hmd)
    cdef const float *kp = _cptr3(keys__gnd)
    cdef const float *vp = _cptr3(values__gne)
    cdef float *tp = _ptr3(t_hat__hme)
    cdef float *zp = _ptr2(z_hat__hm)
    cdef float *mp = _ptr2(m_max__hm)
    cdef float *sp = _ptr2(scr__hm)
    cdef Py_ssize_t sstride = scr__hm.shape[1]
    cdef const kvc_ops *f32 = _ops(KVC_FAM_F32)
    if H == 0 or m == 0 or n <= 0:
        return
    _o1_check(G > 0 and H % G == 0, "H a positive multiple of G")
    _o1_check(keys__gnd.shape[2] == d and values__gne.shape[0] == G
              and values__gne.shape[1] == rows, "keys (G, n, d) and values (G, n, dv)")
    _o1_check(t_hat__hme.shape[0] == H and t_hat__hme.shape[1] == m and t_hat__hme.shape[2] == dv
              and z_hat__hm.shape[0] == H and z_hat__hm.shape[1] == m
              and m_max__hm.shape[0] == H and m_max__hm.shape[1] == m, "far accumulators (H, m, .)")
    _o1_check(scr__hm.shape[0] == H and scr__hm.shape[1] >= m, "scratch (H, >= m)")
    _o1_check(0 <= row0 and row0 + n <= rows, "rows [row0, row0 + n) inside keys")
    hpk = H // G
    for h in prange(H, nogil=True, num_threads=n_threads, schedule="static",
                    use_threads_if=n * m * (d + dv) > _PAR_WORK):
        g = h // hpk
        for i in range(row0, row0 + n):
            f32.o1_absorb(qt + h * m * d, kp + (g * rows + i) * d, vp + (g * rows + i) * dv,
                          m, d, dv, scale, tp + h * m * dv, zp + h * m, mp + h * m,
                          sp + h * sstride)


def o1_step(const float[:, ::1] q__hd, const float[:, ::1] k_new__gd,
            const float[:, ::1] v_new__ge, const float[:, :, ::1] sink_k__gsd,
            const float[:, :, ::1] sink_v__gse, float[:, :, ::1] win_k__gcd,
            float[:, :, ::1] win_v__gce, Py_ssize_t win_len, Py_ssize_t slot, bint absorb,
            const float[:, :, ::1] k_tilde__gmd, const float[:, :, ::1] q_tilde__hmd,
            const float[:, :, ::1] mu__hmm, float[:, :, ::1] t_hat__hme,
            float[:, ::1] z_hat__hm, float[:, ::1] m_max__hm, bint use_far, bint fm,
            float scale, float[:, ::1] out__he, float[:, ::1] scr__hx, int n_threads):
    """One decode step of every head of a sealed layer.

    When ``absorb``, head h first absorbs window row ``slot`` of its group (the key leaving a
    full ring) into its far field.  The output then reads the sinks and window rows
    [0, win_len) in slot order, row ``slot`` taken from (k_new, v_new) -- the caller counts
    the new row in win_len -- plus the far field when ``use_far``.  Finally the new rows are
    written into the ring at ``slot``.  scr: (H, >= sink_len + win_len + 3 m) scratch."""
    cdef Py_ssize_t H = q__hd.shape[0], d = q__hd.shape[1], dv = v_new__ge.shape[1]
    cdef Py_ssize_t G = k_new__gd.shape[0], ns = sink_k__gsd.shape[1]
    cdef Py_ssize_t cap = win_k__gcd.shape[1], m = q_tilde__hmd.shape[1]
    cdef Py_ssize_t sstride = scr__hx.shape[1], hpk, h, g
    cdef const float *qp
    cdef const float *knp
    cdef const float *vnp
    cdef const float *skp = _cptr3(sink_k__gsd)
    cdef const float *svp = _cptr3(sink_v__gse)
    cdef float *wkp = _ptr3(win_k__gcd)
    cdef float *wvp = _ptr3(win_v__gce)
    cdef const float *ktp = _cptr3(k_tilde__gmd)
    cdef const float *qtp = _cptr3(q_tilde__hmd)
    cdef const float *mup = _cptr3(mu__hmm)
    cdef float *tp = _ptr3(t_hat__hme)
    cdef float *zp = _ptr2(z_hat__hm)
    cdef float *mp = _ptr2(m_max__hm)
    cdef float *op
    cdef float *sp
    cdef const kvc_ops *f32 = _ops(KVC_FAM_F32)
    _o1_check(H > 0 and G > 0 and H % G == 0, "H a positive multiple of G")
    _o1_check(k_new__gd.shape[1] == d and v_new__ge.shape[0] == G, "k_new (G, d), v_new (G, dv)")
    _o1_check(sink_k__gsd.shape[0] == G and sink_k__gsd.shape[2] == d
              and sink_v__gse.shape[0] == G and sink_v__gse.shape[1] == ns
              and sink_v__gse.shape[2] == dv, "sinks (G, s, d) and (G, s, dv)")
    _o1_check(win_k__gcd.shape[0] == G and win_k__gcd.shape[2] == d
              and win_v__gce.shape[0] == G and win_v__gce.shape[1] == cap
              and win_v__gce.shape[2] == dv, "window (G, c, d) and (G, c, dv)")
    _o1_check(1 <= win_len <= cap and 0 <= slot < win_len, "0 <= slot < win_len <= capacity")
    _o1_check(k_tilde__gmd.shape[0] == G and k_tilde__gmd.shape[1] == m
              and k_tilde__gmd.shape[2] == d and q_tilde__hmd.shape[0] == H
              and q_tilde__hmd.shape[2] == d and mu__hmm.shape[0] == H
              and mu__hmm.shape[1] == m and mu__hmm.shape[2] == m
              and t_hat__hme.shape[0] == H and t_hat__hme.shape[1] == m
              and t_hat__hme.shape[2] == dv and z_hat__hm.shape[0] == H
              and z_hat__hm.shape[1] == m and m_max__hm.shape[0] == H
              and m_max__hm.shape[1] == m, "landmark state (G|H, m, .)")
    _o1_check(out__he.shape[0] == H and out__he.shape[1] == dv, "out (H, dv)")
    _o1_check(scr__hx.shape[0] == H and scr__hx.shape[1] >= ns + win_len + 3 * m,
              "scratch (H, >= sinks + win_len + 3 m)")
    qp = &q__hd[0, 0]
    knp = &k_new__gd[0, 0]
    vnp = &v_new__ge[0, 0]
    op = &out__he[0, 0]
    sp = &scr__hx[0, 0]
    hpk = H // G
    for h in prange(H, nogil=True, num_threads=n_threads, schedule="static",
                    use_threads_if=H > 1 and H * (ns + win_len + m) * (d + dv) > _PAR_WORK):
        g = h // hpk
        if absorb and m > 0:
            f32.o1_absorb(qtp + h * m * d, wkp + (g * cap + slot) * d, wvp + (g * cap + slot) * dv,
                          m, d, dv, scale, tp + h * m * dv, zp + h * m, mp + h * m,
                          sp + h * sstride + ns + win_len + 2 * m)
        f32.o1_head(qp + h * d, d, dv, scale,
                    skp + g * ns * d if ns > 0 else NULL, svp + g * ns * dv if ns > 0 else NULL, ns,
                    wkp + g * cap * d, wvp + g * cap * dv, win_len, slot,
                    knp + g * d, vnp + g * dv,
                    ktp + g * m * d if m > 0 else NULL, mup + h * m * m if m > 0 else NULL,
                    tp + h * m * dv if m > 0 else NULL, zp + h * m if m > 0 else NULL,
                    mp + h * m if m > 0 else NULL, m, use_far, fm,
                    op + h * dv, sp + h * sstride)
    with nogil:
        for g in range(G):
            memcpy(wkp + (g * cap + slot) * d, knp + g * d, d * sizeof(float))
            memcpy(wvp + (g * cap + slot) * dv, vnp + g * dv, dv * sizeof(float))


# ---------------------------------------------------------------------------------------------
# Absorbed MLA decode (DeepSeek-V2 Multi-head Latent Attention).  Inner loops and their
# summation orders: _mla.h.

# partial accumulators of one call stay under this many bytes (a causal block of positions is
# processed in groups that fit)
cdef Py_ssize_t _MLA_PART_BYTES = 64 * 1024 * 1024


def fma_probe(long iters, int n_threads):
    """Run ``iters`` x 80 float32 fused multiply-adds on each of ``n_threads`` threads (the
    benchmark times it to get the machine's peak FMA rate).  Returns a checksum."""
    cdef int t
    cdef float acc = 0
    cdef float[::1] res = np.zeros(max(1, n_threads), dtype=np.float32)
    cdef const kvc_ops *best = _ops(KVC_FAM_F32)
    for t in prange(n_threads, nogil=True, num_threads=n_threads, schedule="static"):
        res[t] = best.fma_probe(iters, 1.0 + t)
    for t in range(n_threads):
        acc += res[t]
    return acc


def mla_path():
    """The body the MLA kernel runs now: "avx512", "avx2" or "portable" (the same bits
    whichever; _mla.h)."""
    return _ops(KVC_FAM_MLA).mla_path_for(_family_body[KVC_FAM_MLA]).decode()


def mla_task_rows(Py_ssize_t T):
    """Rows per task for a cache of T rows: 256 * ceil(T / 8192), so at most ~32 tasks per
    position.  A function of T only, which keeps results independent of the thread count."""
    if T <= 0:
        return 256
    return 256 * ((T + 8191) // 8192)


def mla_attend(const float[:, :, ::1] qn__nhk, const float[:, :, ::1] qr__nhe,
               const float[:, ::1] lat__tr, const float[:, ::1] kr__te,
               const float[:, :, ::1] wuk__hkr, const float[:, :, ::1] wuv__hjr, float scale,
               float[:, :, ::1] out__nhj, int n_threads):
    """Absorbed MLA attention of n query positions over the first T cached rows.

    qn (n, H, dn) and qr (n, H, dr) are the no-RoPE and RoPE parts of the queries; lat (T, r)
    and kr (T, dr) the cached latents and shared RoPE keys; wuk (H, dn, r) and wuv (H, dv, r)
    the two halves of kv_b_proj.  Position i (0-based) attends causally to rows
    [0, T - n + i + 1).  Writes out (n, H, dv).  Shapes are checked here (ValueError) before
    any nogil code runs."""
    cdef Py_ssize_t n = qn__nhk.shape[0], H = qn__nhk.shape[1], dn = qn__nhk.shape[2]
    cdef Py_ssize_t T = lat__tr.shape[0], r = lat__tr.shape[1], dr = kr__te.shape[1]
    cdef Py_ssize_t dv = wuv__hjr.shape[1]
    cdef Py_ssize_t Hp, R, NT, G, g0, g1, ng, task, i, c, h, p0, p1, e, tid, nthr
    if n == 0 or H == 0:
        return
    if not (qr__nhe.shape[0] == n and qr__nhe.shape[1] == H):
        raise ValueError("MLA kernel: q_rope must be (n, H, d_rope) like q_nope")
    if not (kr__te.shape[0] == T and r > 0 and dr == qr__nhe.shape[2]):
        raise ValueError("MLA kernel: k_rope must be (T, d_rope) with the rows of latent")
    if not (wuk__hkr.shape[0] == H and wuk__hkr.shape[1] == dn and wuk__hkr.shape[2] == r):
        raise ValueError("MLA kernel: w_uk must be (H, d_nope, r)")
    if not (wuv__hjr.shape[0] == H and wuv__hjr.shape[2] == r and dv > 0):
        raise ValueError("MLA kernel: w_uv must be (H, d_v, r)")
    if not (out__nhj.shape[0] == n and out__nhj.shape[1] == H and out__nhj.shape[2] == dv):
        raise ValueError("MLA kernel: out must be (n, H, d_v)")
    if T < n:
        raise ValueError(f"MLA kernel: {n} query positions need at least {n} cached rows, got {T}")
    Hp = (H + 7) // 8 * 8
    R = mla_task_rows(T)
    NT = (T + R - 1) // R
    nthr = max(1, n_threads)
    G = max(1, min(n, _MLA_PART_BYTES // max(1, NT * H * r * 4)))
    qT_arr = np.zeros((G, r + dr, Hp), dtype=np.float32)
    qa_arr = np.empty((G * H, r), dtype=np.float32)
    acc_arr = np.empty((G * NT, H, r), dtype=np.float32)
    ml_arr = np.empty((2, G * NT, Hp), dtype=np.float32)
    s_arr = np.empty((nthr, KVC_MLA_BLOCK * Hp), dtype=np.float32)
    cdef float[:, :, ::1] qT = qT_arr
    cdef float[:, ::1] qa = qa_arr
    cdef float[:, :, ::1] acc = acc_arr
    cdef float[:, :, ::1] ml = ml_arr
    cdef float[:, ::1] sbuf = s_arr
    cdef float[:, ::1] cbuf = np.empty((G * H, r), dtype=np.float32)
    cdef const float *qnp = &qn__nhk[0, 0, 0] if dn > 0 else &lat__tr[0, 0]
    cdef const float *qrp = &qr__nhe[0, 0, 0] if dr > 0 else NULL
    cdef const float *latp = &lat__tr[0, 0]
    cdef const float *krp = &kr__te[0, 0] if dr > 0 else &lat__tr[0, 0]
    cdef const float *wukp = &wuk__hkr[0, 0, 0] if dn > 0 else NULL
    cdef const float *wuvp = &wuv__hjr[0, 0, 0]
    cdef float *outp = &out__nhj[0, 0, 0]
    cdef bint par_scores = T * H * (r + dr) > _PAR_WORK
    cdef bint par_heads = H > 1 and H * (dn + dv) * r > _PAR_WORK
    cdef const kvc_ops *mla = _ops(KVC_FAM_MLA)            # the family's body, once per call
    cdef kvc_mla_task_fn task_fn = mla.mla_task_for(_family_body[KVC_FAM_MLA])
    for g0 in range(0, n, G):
        g1 = min(n, g0 + G)
        ng = g1 - g0
        for task in prange(ng * H, nogil=True, num_threads=nthr, schedule="static",
                           use_threads_if=par_heads):
            i = task // H
            h = task % H
            mla.mla_fold(qnp + ((g0 + i) * H + h) * dn, qrp + ((g0 + i) * H + h) * dr if dr > 0 else qnp,
                         wukp + h * dn * r if dn > 0 else NULL, dn, r, dr, h, Hp,
                         &qa[task, 0], &qT[i, 0, 0])
        # static: each thread takes a contiguous run of tasks, so the rows it prefetches at
        # the end of one task are the start of its next
        for task in prange(ng * NT, nogil=True, num_threads=nthr, schedule="static",
                           use_threads_if=par_scores):
            i = task // NT
            c = task % NT
            e = T - n + g0 + i + 1
            p0 = c * R
            p1 = min(p0 + R, e)
            tid = omp_get_thread_num()
            if p0 < p1:
                task_fn(&qT[i, 0, 0], H, Hp, latp, krp, r, dr, p0, p1, e, scale,
                             &acc[task, 0, 0], &ml[0, task, 0], &ml[1, task, 0], &sbuf[tid, 0])
            else:
                for h in range(Hp):
                    ml[0, task, h] = -INFINITY
                    ml[1, task, h] = 0
        for task in prange(ng * H, nogil=True, num_threads=nthr, schedule="static",
                           use_threads_if=par_heads):
            i = task // H
            h = task % H
            mla.mla_merge_head(&acc[i * NT, h, 0], H * r, &ml[0, i * NT, h], &ml[1, i * NT, h],
                               Hp, NT, wuvp + h * dv * r, r, dv, &cbuf[task, 0],
                               outp + ((g0 + i) * H + h) * dv)


# ---------------------------------------------------------------------------------------------
# Blocked prompt attention: tiles of queries x stored rows with an online softmax and no
# probability matrix.  Inner loops and their summation orders: _prefill.h.

# queries per task (whole positions: a task holds ceil(_PF_QUERIES / heads per group) positions
# of one KV group, so each K/V tile is loaded once for that many queries)
cdef Py_ssize_t _PF_QUERIES = 192
PREFILL_TASK_QUERIES = _PF_QUERIES
PREFILL_TILE_ROWS = KVC_PF_TILE
# the largest count or length the driver accepts (sums of them stay far from overflow)
cdef Py_ssize_t _PF_MAX = (<Py_ssize_t>1) << 40


cdef inline float *_aligned64(float *p) noexcept nogil:
    return <float *> ((<size_t> p + 63) & ~(<size_t> 63))


def attend_blocked(const float[:, :, ::1] kf__hcd, const int8_t[:, :, ::1] kq__hcd,
                   const float[:, :, ::1] ks__hcg,
                   const float[:, :, ::1] vf__hcd, const int8_t[:, :, ::1] vq__hcd,
                   const float[:, :, ::1] vs__hc1, const float[:, ::1] vcol__hd,
                   const Py_ssize_t[::1] head_len__h,
                   const float[:, ::1] q__jd, const Py_ssize_t[::1] group_q0,
                   Py_ssize_t n_pos, Py_ssize_t n_back, Py_ssize_t window, Py_ssize_t first,
                   float scale, float softcap,
                   float[:, ::1] out__jd, float[::1] imp__l,
                   int imp_mode, bint quant_k, bint quant_v, int n_threads,
                   Py_ssize_t k_group=0):
    """Grouped attention of nq queries over one layer's head-major rows, tile by tile.

    The queries, visible ranges and outputs are those of :func:`attend_rows` (query position
    i of group g sees [first_i, end_i), end_i = head_len[g] - n_back + i + 1 clamped to
    [0, head_len[g]], then the window and ``first``), without the probability matrix: an
    online softmax over tiles of 64 rows at absolute row multiples (orders in _prefill.h,
    docs/numerics.md), so a query's bits depend only on its own visible rows.  imp_mode 0:
    importance untouched; 2: every row p < len(imp) gets, once, the sum over KV groups in
    order and their queries in order of the query's final probability of row p (a second
    pass of scores).  q8 keys: K groups of ``k_group`` channels as in :func:`attend_rows`.
    ValueError on inconsistent shapes or arguments, before any work.
    """
    cdef Py_ssize_t nkv = head_len__h.shape[0], hd = q__jd.shape[1], nq = q__jd.shape[0]
    cdef Py_ssize_t n_imp = imp__l.shape[0]
    cdef Py_ssize_t kcap, vcap, ks_stride, vs_stride, g, j, jl, i, e, f, cnt, per, bq
    cdef Py_ssize_t ntasks, t, nqmax, nscr, nscr_imp, work, maxlen, ntiles, c, t0, t1, tid, p
    cdef Py_ssize_t i0, j0, j1
    cdef const float *kfp = NULL
    cdef const int8_t *kqp = NULL
    cdef const float *ksp = NULL
    cdef const float *vfp = NULL
    cdef const int8_t *vqp = NULL
    cdef const float *vsp = NULL
    cdef const float *vcp = NULL
    cdef const float *qp
    cdef float *outp
    cdef Py_ssize_t *q_first = NULL
    cdef Py_ssize_t *q_end = NULL
    cdef Py_ssize_t *task_g = NULL
    cdef Py_ssize_t *task_j0 = NULL
    cdef Py_ssize_t *task_j1 = NULL
    cdef float *q_m = NULL
    cdef float *q_l = NULL
    cdef float *scr_raw = NULL
    cdef float *scr
    cdef float *colsum
    cdef bint par
    cdef int8_t *q_i8 = NULL
    cdef float *q_sc = NULL
    cdef int32_t *q_sum = NULL
    cdef Py_ssize_t hdp, ngq, kgroup = 32
    cdef int level = _family_body[KVC_FAM_Q8]   # the q8 body, once per call
    cdef const kvc_ops *pf = _ops(KVC_FAM_PREFILL)

    # ---- validation: everything the nogil code indexes is checked here -------------------
    if n_threads < 1:
        raise ValueError(f"n_threads: expected >= 1, got {n_threads}")
    if imp_mode != 0 and imp_mode != 2:
        raise ValueError(f"imp_mode: expected 0 or 2, got {imp_mode}")
    if hd < 1:
        raise ValueError(f"q: expected head_dim >= 1, got {hd}")
    if not (1 <= n_pos <= _PF_MAX):
        raise ValueError(f"n_pos: expected 1 <= n_pos <= 2**40, got {n_pos}")
    if not (0 <= n_back <= _PF_MAX) or not (0 <= window <= _PF_MAX) \
            or not (0 <= first <= _PF_MAX):
        raise ValueError(f"n_back, window, first: expected each in [0, 2**40], got "
                         f"{n_back}, {window}, {first}")
    if group_q0.shape[0] != nkv + 1 or group_q0[0] != 0 or group_q0[nkv] != nq:
        raise ValueError(f"group_q0: expected {nkv + 1} offsets from 0 to {nq}")
    for g in range(nkv):
        cnt = group_q0[g + 1] - group_q0[g]
        if cnt < 0 or cnt % n_pos:
            raise ValueError(f"group_q0: group {g} has {cnt} queries, expected a multiple "
                             f"of n_pos={n_pos}")
    if out__jd.shape[0] != nq or out__jd.shape[1] != hd:
        raise ValueError(f"out: expected shape ({nq}, {hd}), got "
                         f"({out__jd.shape[0]}, {out__jd.shape[1]})")
    if quant_k:
        kcap = kq__hcd.shape[1]
        ks_stride = ks__hcg.shape[2]
        kgroup = _k_group(hd, ks_stride, k_group)
        if kq__hcd.shape[0] < nkv or kq__hcd.shape[2] != hd or ks__hcg.shape[0] < nkv \
                or ks__hcg.shape[1] != kcap or ks_stride < (hd + kgroup - 1) // kgroup:
            raise ValueError("int8 K: expected kq (nkv, capacity, head_dim) and ks "
                             "(nkv, capacity, ceil(head_dim/k_group))")
    else:
        kcap = kf__hcd.shape[1]
        ks_stride = 0
        if kf__hcd.shape[0] < nkv or kf__hcd.shape[2] != hd:
            raise ValueError("float32 K: expected kf (nkv, capacity, head_dim)")
    if quant_v:
        vcap = vq__hcd.shape[1]
        vs_stride = vs__hc1.shape[2]
        if vq__hcd.shape[0] < nkv or vq__hcd.shape[2] != hd or vs__hc1.shape[0] < nkv \
                or vs__hc1.shape[1] != vcap or vs_stride < 1 or vcol__hd.shape[0] < nkv \
                or vcol__hd.shape[1] != hd:
            raise ValueError("int8 V: expected vq (nkv, capacity, head_dim), vs "
                             "(nkv, capacity, 1) and vcol (nkv, head_dim)")
    else:
        vcap = vf__hcd.shape[1]
        vs_stride = 0
        if vf__hcd.shape[0] < nkv or vf__hcd.shape[2] != hd:
            raise ValueError("float32 V: expected vf (nkv, capacity, head_dim)")
    for g in range(nkv):
        if not (0 <= head_len__h[g] <= kcap and head_len__h[g] <= vcap):
            raise ValueError(f"head_len: group {g} has {head_len__h[g]} rows, expected "
                             f"0..{min(kcap, vcap)} (the storage capacity)")
    if nq == 0:
        return

    # ---- visible ranges, the task list and the work ---------------------------------------
    nqmax = 0
    ntasks = 0
    work = 0
    maxlen = 0
    q_first = <Py_ssize_t *> malloc(nq * sizeof(Py_ssize_t))
    q_end = <Py_ssize_t *> malloc(nq * sizeof(Py_ssize_t))
    q_m = <float *> malloc(nq * sizeof(float))
    q_l = <float *> malloc(nq * sizeof(float))
    try:
        if q_first == NULL or q_end == NULL or q_m == NULL or q_l == NULL:
            raise MemoryError()
        for g in range(nkv):
            cnt = group_q0[g + 1] - group_q0[g]
            if cnt == 0:
                continue
            per = cnt // n_pos
            bq = max(1, (_PF_QUERIES + per - 1) // per)
            ntasks += (n_pos + bq - 1) // bq
            nqmax = max(nqmax, min(n_pos, bq) * per)
            for jl in range(cnt):
                j = group_q0[g] + jl
                i = jl // per
                e = _visible(head_len__h[g], n_back, i, window, first, head_len__h[g], &f)
                q_first[j] = f
                q_end[j] = e
                if e > f:
                    work += (e - f) * hd * 2
                    if e > maxlen:
                        maxlen = e
        task_g = <Py_ssize_t *> malloc((ntasks + 1) * sizeof(Py_ssize_t))
        task_j0 = <Py_ssize_t *> malloc((ntasks + 1) * sizeof(Py_ssize_t))
        task_j1 = <Py_ssize_t *> malloc((ntasks + 1) * sizeof(Py_ssize_t))
        # per thread: a task's tiles, or the importance pass's rows and column sums
        nscr = max(KVC_PF_SCRATCH_FLOATS(hd, nqmax), KVC_PF_IMP_SCRATCH(hd) + KVC_PF_IMP_ROWS)
        nscr = (nscr + 15) // 16 * 16
        scr_raw = <float *> malloc((n_threads * nscr + 16) * sizeof(float))
        if task_g == NULL or task_j0 == NULL or task_j1 == NULL or scr_raw == NULL:
            raise MemoryError()
        scr = _aligned64(scr_raw)
        # the latest positions (the most rows) first, KV groups interleaved: a dynamic
        # schedule then ends on short tasks
        t = 0
        c = 0
        while t < ntasks:
            for g in range(nkv):
                cnt = group_q0[g + 1] - group_q0[g]
                if cnt == 0:
                    continue
                per = cnt // n_pos
                bq = max(1, (_PF_QUERIES + per - 1) // per)
                i0 = ((n_pos + bq - 1) // bq - 1 - c) * bq
                if i0 < 0:
                    continue
                task_g[t] = g
                task_j0[t] = group_q0[g] + i0 * per
                task_j1[t] = group_q0[g] + min(n_pos, i0 + bq) * per
                t += 1
            c += 1
        par = work > _PAR_WORK
        qp = &q__jd[0, 0]
        outp = &out__jd[0, 0]
        hdp = KVC_I8_PAD(hd)
        ngq = KVC_I8_GROUPS(hd, kgroup)
        if quant_k:
            _query_codes(qp, nq, hd, kgroup, n_threads, par and nq * hd > _PAR_WORK,
                         &q_i8, &q_sc, &q_sum)
        if quant_k:
            kqp = &kq__hcd[0, 0, 0] if kcap > 0 else NULL
            ksp = &ks__hcg[0, 0, 0] if kcap > 0 else NULL
        else:
            kfp = &kf__hcd[0, 0, 0] if kcap > 0 else NULL
        if quant_v:
            vqp = &vq__hcd[0, 0, 0] if vcap > 0 else NULL
            vsp = &vs__hc1[0, 0, 0] if vcap > 0 else NULL
            vcp = &vcol__hd[0, 0]
        else:
            vfp = &vf__hcd[0, 0, 0] if vcap > 0 else NULL

        # ---- 1. outputs, running max and sum: one task per (group, block of positions) ----
        for t in prange(ntasks, nogil=True, num_threads=n_threads, schedule="dynamic",
                        use_threads_if=par):
            g = task_g[t]
            j0 = task_j0[t]
            j1 = task_j1[t]
            tid = omp_get_thread_num()
            pf.pf_task(qp + j0 * hd, j1 - j0, q_first + j0, q_end + j0,
                        kfp + g * kcap * hd if kfp != NULL else NULL,
                        kqp + g * kcap * hd if kqp != NULL else NULL,
                        ksp + g * kcap * ks_stride if ksp != NULL else NULL, ks_stride,
                        quant_k,
                        vfp + g * vcap * hd if vfp != NULL else NULL,
                        vqp + g * vcap * hd if vqp != NULL else NULL,
                        vsp + g * vcap * vs_stride if vsp != NULL else NULL, vs_stride,
                        quant_v, vcp + g * hd if vcp != NULL else NULL, hd, scale, softcap,
                        outp + j0 * hd, q_m + j0, q_l + j0, scr + tid * nscr, level, kgroup,
                        q_i8 + j0 * hdp if q_i8 != NULL else NULL,
                        q_sc + j0 * ngq if q_sc != NULL else NULL,
                        q_sum + j0 * ngq if q_sum != NULL else NULL)

        # ---- 2. importance: blocks of rows, each owned by one thread (the first rows, seen by
        # the most queries, first) --------------------------------------------------------
        if imp_mode == 2:
            maxlen = min(maxlen, n_imp)
            ntiles = (maxlen + KVC_PF_IMP_ROWS - 1) // KVC_PF_IMP_ROWS
            for c in prange(ntiles, nogil=True, num_threads=n_threads, schedule="dynamic",
                            use_threads_if=par):
                tid = omp_get_thread_num()
                colsum = scr + tid * nscr
                t0 = c * KVC_PF_IMP_ROWS
                t1 = min(t0 + KVC_PF_IMP_ROWS, maxlen)
                memset(colsum, 0, KVC_PF_IMP_ROWS * sizeof(float))
                for g in range(nkv):
                    j0 = group_q0[g]
                    j1 = group_q0[g + 1]
                    if j1 == j0:
                        continue
                    pf.pf_imp_group(qp + j0 * hd, j1 - j0, q_first + j0, q_end + j0,
                                     q_m + j0, q_l + j0,
                                     kfp + g * kcap * hd if kfp != NULL else NULL,
                                     kqp + g * kcap * hd if kqp != NULL else NULL,
                                     ksp + g * kcap * ks_stride if ksp != NULL else NULL,
                                     ks_stride, quant_k, hd, scale, softcap, t0, t1,
                                     colsum, colsum + KVC_PF_IMP_ROWS, level, kgroup,
                                     q_i8 + j0 * hdp if q_i8 != NULL else NULL,
                                     q_sc + j0 * ngq if q_sc != NULL else NULL,
                                     q_sum + j0 * ngq if q_sum != NULL else NULL)
                for p in range(t0, t1):
                    imp__l[p] = imp__l[p] + colsum[p - t0]
    finally:
        free(q_first)
        free(q_end)
        free(q_m)
        free(q_l)
        free(task_g)
        free(task_j0)
        free(task_j1)
        free(scr_raw)
        free(q_i8)
        free(q_sc)
        free(q_sum)
