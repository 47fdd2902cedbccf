# Compiled kernels of kvcache.  Directives are set once in setup.py.
#
# House rules (docs/architecture.md): kernels take memoryviews and plain numbers, never touch a Python
# object inside `nogil`, never raise.  Conversion, allocation and thread-count resolution happen
# in the Python layer (layer.py, _attention.py, o1.py, mla.py), once per call.  An entry point
# takes one storage descriptor and one call descriptor (kvcache._entry: Rows and AttendCall,
# O1State and O1Absorb / O1Step, MlaCall) and runs its check there before any array is touched
# -- the one place the rules and messages are; for the common bound call, attention and the O(1)
# step first try a C acceptance that accepts only calls the check accepts and hands every other
# call to it (_accept_call, _O1.accept).  A kernel entry raises nothing itself but MemoryError
# (the body choice, set_bodies / set_isa, refuses unknown names).  Every kernel here has a NumPy twin of the same
# name in kvcache/reference.py.
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
from libc.stdint cimport int8_t, int32_t, uint8_t, uint16_t
from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING
from cpython.buffer cimport PyBuffer_FillInfo
from cpython.pyport cimport PY_SSIZE_T_MAX
from cython.parallel cimport prange

import numpy as np

from kvcache._openmp cimport KVC_OPENMP_BUILT, omp_get_max_threads, omp_get_thread_num

cdef extern from "_dispatch.h" nogil:
    # the descriptors every entry takes (_dispatch.h says what each field holds)
    ctypedef struct kvc_store:
        const float *kf
        const int8_t *kq
        const float *ks
        const float *vf
        const int8_t *vq
        const float *vs
        const uint8_t *vc4
        const uint16_t *vp
        const uint8_t *kc4
        const uint16_t *kp
        const float *kr
        const Py_ssize_t *head_len
        const float *vcol
        Py_ssize_t kcap, vcap, ks_stride, vs_stride, hd, k_group
        int quant_k, quant_v
    ctypedef struct kvc_call:
        const float *q
        const Py_ssize_t *qf
        const Py_ssize_t *qe
        const int8_t *qi
        const float *qsc
        const int32_t *qsum
        float scale, softcap
        float *probs
        Py_ssize_t L
        float *out
        float *qm
        float *ql
    ctypedef struct kvc_task:
        Py_ssize_t g, j0, j1, p0, p1
    ctypedef struct kvc_o1:
        Py_ssize_t hpk, m, d, dv
        float scale
        int fm
        const float *q_tilde
        const float *k_tilde
        const float *mu
        float *t_hat
        float *z_hat
        float *m_max
        const float *sink_k
        const float *sink_v
        Py_ssize_t ns
        float *win_k
        float *win_v
        Py_ssize_t cap
        const float *q
        const float *k_new
        const float *v_new
        Py_ssize_t win_len, slot
        int absorb, use_far
        float *out
        float *scr
        Py_ssize_t scr_stride
    ctypedef struct kvc_mla:
        const float *qn
        const float *qr
        const float *lat
        const float *kr
        const float *wuk
        const float *wuv
        Py_ssize_t n, T, H, Hp, dn, dr, r, dv
        float scale
        float *out
        Py_ssize_t i0, R, NT
        float *qT
        float *qa
        float *acc
        float *m
        float *l
        float *c
    ctypedef struct kvc_ops:
        const char *name
        void (*task_scores)(const kvc_store *s, const kvc_call *c, const kvc_task *t) noexcept nogil
        void (*task_scores_i8)(const kvc_store *s, const kvc_call *c, const kvc_task *t,
                               float *scratch) noexcept nogil
        void (*task_scores_k4)(const kvc_store *s, const kvc_call *c, const kvc_task *t,
                               float *scratch) noexcept nogil
        void (*task_values)(const kvc_store *s, const kvc_call *c, const kvc_task *t,
                            float *acc, float *scratch) noexcept nogil
        void (*q8_rows)(const kvc_store *s, const kvc_call *c, const kvc_task *t) noexcept nogil
        void (*axpy)(float *y, float w, const float *x, Py_ssize_t n) noexcept nogil
        void (*softmax)(float *s, Py_ssize_t n) noexcept nogil
        void (*quant_row)(const float *x, const float *col, Py_ssize_t hd, Py_ssize_t group,
                          int8_t *q, float *s) noexcept nogil
        void (*quant_query)(const float *x, Py_ssize_t hd, Py_ssize_t group, int8_t *qi,
                            float *sq, int32_t *qsum) noexcept nogil
        void (*pf_task)(const kvc_store *s, const kvc_call *c, const kvc_task *t,
                        float *scratch, float *pbuf, float *colsum) noexcept nogil
        void (*o1_absorb)(const kvc_o1 *o, Py_ssize_t h, const float *k, const float *v,
                          float *scr) noexcept nogil
        void (*o1_step_head)(const kvc_o1 *o, Py_ssize_t h) noexcept nogil
        void (*mla_fold)(const kvc_mla *a, Py_ssize_t task) noexcept nogil
        void (*mla_task)(const kvc_mla *a, Py_ssize_t task, float *S) noexcept nogil
        void (*mla_merge)(const kvc_mla *a, Py_ssize_t task) noexcept nogil
        const char *(*mla_path)() noexcept nogil
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
    int KVC_V_Q8
    int KVC_V_Q4
    int KVC_K_Q8
    int KVC_K_Q4
    Py_ssize_t KVC_I8_PAD(Py_ssize_t hd)
    Py_ssize_t KVC_I8_GROUPS(Py_ssize_t hd, Py_ssize_t group)
    Py_ssize_t KVC_MLA_BLOCK
    Py_ssize_t KVC_PF_TILE
    Py_ssize_t KVC_PF_QR
    Py_ssize_t KVC_PF_IMP_ROWS
    Py_ssize_t KVC_PF_SCRATCH_FLOATS(Py_ssize_t hd, Py_ssize_t nq)
    Py_ssize_t KVC_PF_PBUF_FLOATS(Py_ssize_t ntiles, Py_ssize_t nq)
    Py_ssize_t KVC_PF_IMP_BUDGET

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
from kvcache import _entry

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


def quantize_query(q__jd, qi__jp, sq__jg, qsum__jg, group=32):
    """Quantise queries q (nq, hd) for q8 scoring (docs/numerics.md) in groups of ``group`` (16
    or 32) channels: qi (nq, ceil(hd/32)*32) int8 codes, zero past hd; sq and qsum
    (nq, ceil(hd/group)) float32 group scales (NaN for a group with a non-finite value) and
    int32 group sums of the codes.  Checked by kvcache._entry.check_quantize_query."""
    _entry.check_quantize_query(q__jd, qi__jp, sq__jg, qsum__jg, group)
    cdef const float[:, ::1] q = q__jd
    cdef int8_t[:, ::1] qi = qi__jp
    cdef float[:, ::1] sq = sq__jg
    cdef int32_t[:, ::1] qs = qsum__jg
    cdef Py_ssize_t nq = q.shape[0], hd = q.shape[1], j, grp = group
    with nogil:
        for j in range(nq):
            _ops(KVC_FAM_Q8).quant_query(&q[j, 0], hd, grp, &qi[j, 0], &sq[j, 0], &qs[j, 0])


def q8_scores(q__jd, kq__rd, ks__rg, out__jr, k_group=0):
    """Raw q8 scores (before the softmax scale) of every query q (nq, hd) against every int8
    row kq (n, hd) with scales ks (n, >= ceil(hd/group)) into out (nq, n), with the kernels'
    query quantiser and the q8 body in use: the arithmetic of attend_rows' and attend_blocked's
    q8 scores, exposed for tests.  ``k_group``: 16 or 32, or 0 to read it from ks
    (ceil(hd/16) scales per row: 16).  Checked by kvcache._entry.check_q8_scores."""
    cdef Py_ssize_t group = _entry.check_q8_scores(q__jd, kq__rd, ks__rg, out__jr, k_group)
    cdef const float[:, ::1] q = q__jd
    cdef const int8_t[:, ::1] kq = kq__rd
    cdef const float[:, ::1] ks = ks__rg
    cdef float[:, ::1] out = out__jr
    cdef Py_ssize_t nq = q.shape[0], hd = q.shape[1], n = kq.shape[0], j
    cdef Py_ssize_t hdp = KVC_I8_PAD(hd), ng = KVC_I8_GROUPS(hd, group)
    qi_arr = np.zeros((max(nq, 1), hdp), dtype=np.int8)
    sq_arr = np.zeros((max(nq, 1), ng), dtype=np.float32)
    qs_arr = np.zeros((max(nq, 1), ng), dtype=np.int32)
    cdef int8_t[:, ::1] qi = qi_arr
    cdef float[:, ::1] sq = sq_arr
    cdef int32_t[:, ::1] qs = qs_arr
    cdef const kvc_ops *q8 = _ops(KVC_FAM_Q8)   # the q8 body, once per call
    cdef kvc_store st
    cdef kvc_call c
    cdef kvc_task t
    if nq == 0 or n == 0:
        return
    # the rows as one group of a K store, the raw scores as the call's "probabilities"
    memset(&st, 0, sizeof(st))
    memset(&c, 0, sizeof(c))
    st.kq = &kq[0, 0]
    st.ks = &ks[0, 0]
    st.kcap = n
    st.ks_stride = ks.shape[1]
    st.hd = hd
    st.k_group = group
    st.quant_k = 1
    c.qi = &qi[0, 0]
    c.qsc = &sq[0, 0]
    c.qsum = &qs[0, 0]
    c.probs = &out[0, 0]
    c.L = n
    with nogil:
        for j in range(nq):
            q8.quant_query(&q[j, 0], hd, group, &qi[j, 0], &sq[j, 0], &qs[j, 0])
            t = _task(0, j, j + 1, 0, n)
            q8.q8_rows(&st, &c, &t)


def k4_scores(q__jd, kc__cb, kp__bq, kr__rd, n, out__jr):
    """Raw scores (before the softmax scale) of every query q (nq, hd) against the first ``n``
    rows of one KV group's 4-bit K (docs/kv4.md: codes kc (cap, hd / 2) in the block layout,
    block parameters kp (ceil(cap / 32), 2 * hd) as uint16, the ring kr (64, hd)) into out
    (nq, n), with the 4-bit scorer of the q8 body in use: the arithmetic of attend_rows' 4-bit
    K scores, exposed for tests.  Checked by kvcache._entry.check_k4_scores."""
    cdef Py_ssize_t rows = _entry.check_k4_scores(q__jd, kc__cb, kp__bq, kr__rd, n, out__jr)
    cdef const float[:, ::1] q = q__jd
    cdef const uint8_t[:, ::1] kc = kc__cb
    cdef const uint16_t[:, ::1] kp = kp__bq
    cdef const float[:, ::1] kr = kr__rd
    cdef float[:, ::1] out = out__jr
    cdef Py_ssize_t nq = q.shape[0], hd = q.shape[1]
    cdef Py_ssize_t[::1] hl = np.full(1, rows, dtype=np.intp)
    qf_arr, qe_arr = np.zeros(max(nq, 1), dtype=np.intp), np.full(max(nq, 1), rows, np.intp)
    cdef Py_ssize_t[::1] qf = qf_arr
    cdef Py_ssize_t[::1] qe = qe_arr
    scr_arr = np.zeros(KVC_SCRATCH_FLOATS(hd), dtype=np.float32)
    cdef float[::1] scr = scr_arr
    cdef const kvc_ops *q8 = _ops(KVC_FAM_Q8)
    cdef kvc_store st
    cdef kvc_call c
    cdef kvc_task t
    if nq == 0 or rows == 0:
        return
    memset(&st, 0, sizeof(st))
    memset(&c, 0, sizeof(c))
    st.kc4 = &kc[0, 0] if kc.shape[0] > 0 else NULL
    st.kp = &kp[0, 0] if kp.shape[0] > 0 else NULL
    st.kr = &kr[0, 0]
    st.head_len = &hl[0]
    st.kcap = kc.shape[0]
    st.hd = hd
    st.quant_k = KVC_K_Q4
    c.q = &q[0, 0]
    c.qf = &qf[0]
    c.qe = &qe[0]
    c.scale = 1.0
    c.softcap = 0.0
    c.probs = &out[0, 0]
    c.L = rows
    t = _task(0, 0, nq, 0, rows)
    with nogil:
        q8.task_scores_k4(&st, &c, &t, &scr[0])


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


cdef extern from "_q4.h" nogil:
    void kvc_v4_quant_row(const float *x, Py_ssize_t hd, uint8_t *codes, uint16_t *par)
    void kvc_k4_quant_block(const float *ring, Py_ssize_t p0, Py_ssize_t hd, uint8_t *codes,
                            uint16_t *par)
    Py_ssize_t KVC_K4_BLOCK
    Py_ssize_t KVC_K4_RING

K4_BLOCK = KVC_K4_BLOCK
K4_RING = KVC_K4_RING
if (_entry.K4_BLOCK, _entry.K4_RING) != (K4_BLOCK, K4_RING):
    raise ImportError("kvcache._core: 4-bit K's block and ring sizes differ from "
                      "kvcache._entry's (a stale build?)")


def store_rows_k4(const float[:, :, ::1] x__nhd, const unsigned char[::1] alive__h,
                  const Py_ssize_t[::1] head_len__h, uint8_t[:, :, ::1] c__hcb,
                  uint16_t[:, :, ::1] p__hbq, float[:, :, ::1] r__hrd):
    """Append x[i, h] to every alive head h's 4-bit K (docs/kv4.md): row p = head_len[h] + i
    goes to ring slot p % K4_RING; a row that completes a block of K4_BLOCK rows quantises the
    block from the ring into codes c (rows) and parameters p (blocks).  The caller checked the
    shapes and made room."""
    cdef Py_ssize_t n = x__nhd.shape[0], nkv = x__nhd.shape[1], hd = x__nhd.shape[2]
    cdef Py_ssize_t h, i, p
    _check_store(x__nhd, alive__h, head_len__h, c__hcb, "store_rows_k4")
    if (hd % 8 or c__hcb.shape[2] != hd // 2 or p__hbq.shape[0] < nkv or r__hrd.shape[0] < nkv
            or p__hbq.shape[1] != (c__hcb.shape[1] + KVC_K4_BLOCK - 1) // KVC_K4_BLOCK
            or p__hbq.shape[2] != 2 * hd or r__hrd.shape[1] != KVC_K4_RING
            or r__hrd.shape[2] != hd):
        raise ValueError("store_rows_k4: expected x (n, nkv, hd), hd a multiple of 8, codes "
                         f"(nkv, cap, hd / 2), params (nkv, ceil(cap / {KVC_K4_BLOCK}), 2 * hd) "
                         f"and a ring (nkv, {KVC_K4_RING}, hd)")
    with nogil:
        for h in range(nkv):
            if alive__h[h]:
                for i in range(n):
                    p = head_len__h[h] + i
                    memcpy(&r__hrd[h, p % KVC_K4_RING, 0], &x__nhd[i, h, 0], hd * sizeof(float))
                    if p % KVC_K4_BLOCK == KVC_K4_BLOCK - 1:
                        kvc_k4_quant_block(&r__hrd[h, 0, 0], p + 1 - KVC_K4_BLOCK, hd,
                                           &c__hcb[h, p + 1 - KVC_K4_BLOCK, 0],
                                           &p__hbq[h, p // KVC_K4_BLOCK, 0])


def _check_store(x, alive, head_len, codes, str what):
    """The checks the 4-bit row writers share: one alive flag and one length per head of x,
    each head's rows fitting the codes' capacity (ValueError otherwise)."""
    nkv, cap = x.shape[1], codes.shape[1]
    if alive.shape[0] != nkv or head_len.shape[0] != nkv or codes.shape[0] < nkv:
        raise ValueError(f"{what}: expected alive, head_len ({nkv},) and codes for {nkv} heads")
    for h in range(nkv):
        if head_len[h] < 0 or head_len[h] > cap - x.shape[0]:
            raise ValueError(f"{what}: head {h} holds {head_len[h]} rows; {x.shape[0]} more do "
                             f"not fit a capacity of {cap}")


def store_rows_v4(const float[:, :, ::1] x__nhd, const unsigned char[::1] alive__h,
                  const Py_ssize_t[::1] head_len__h, uint8_t[:, :, ::1] c__hcb,
                  uint16_t[:, :, ::1] p__hcp):
    """Quantise x[i, h] to 4 bits (docs/kv4.md, ``_q4.h``) into c/p at row head_len[h] + i of
    every alive head h (the caller checked the shapes and made room)."""
    cdef Py_ssize_t n = x__nhd.shape[0], nkv = x__nhd.shape[1], hd = x__nhd.shape[2]
    cdef Py_ssize_t h, i, r
    _check_store(x__nhd, alive__h, head_len__h, c__hcb, "store_rows_v4")
    if (hd % 8 or c__hcb.shape[2] != hd // 2 or p__hcp.shape[0] < nkv
            or p__hcp.shape[1] != c__hcb.shape[1] or p__hcp.shape[2] != 2 * ((hd + 15) // 16)):
        raise ValueError("store_rows_v4: expected x (n, nkv, hd), hd a multiple of 8, codes "
                         "(nkv, cap, hd / 2) and params (nkv, cap, 2 * ceil(hd / 16))")
    with nogil:
        for h in range(nkv):
            if alive__h[h]:
                for i in range(n):
                    r = head_len__h[h] + i
                    kvc_v4_quant_row(&x__nhd[i, h, 0], hd, &c__hcb[h, r, 0], &p__hcp[h, r, 0])


def quantize_v4(const float[:, ::1] x__nd, uint8_t[:, ::1] c__nb, uint16_t[:, ::1] p__np):
    """4-bit quantisation (docs/kv4.md) of the rows x (n, hd), hd a multiple of 8, into codes
    (n, hd / 2) and float16 parameters (n, 2 * ceil(hd / 16)) as uint16 bits; ValueError for
    other shapes."""
    cdef Py_ssize_t n = x__nd.shape[0], hd = x__nd.shape[1], i
    if hd % 8 or c__nb.shape[0] != n or p__np.shape[0] != n or c__nb.shape[1] != hd // 2 \
            or p__np.shape[1] != 2 * ((hd + 15) // 16):
        raise ValueError(f"quantize_v4: expected x (n, hd) with hd % 8 == 0, codes (n, hd / 2) "
                         f"and params (n, 2 * ceil(hd / 16)), got ({n}, {hd}), "
                         f"({c__nb.shape[0]}, {c__nb.shape[1]}), ({p__np.shape[0]}, "
                         f"{p__np.shape[1]})")
    with nogil:
        for i in range(n):
            kvc_v4_quant_row(&x__nd[i, 0], hd, &c__nb[i, 0], &p__np[i, 0])


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


# ---------------------------------------------------------------------------------------------
# Attention: attend_rows (decode: a probability matrix, chunks of rows) and attend_blocked
# (prompt blocks: tiles with an online softmax, _prefill.h).  Both read one storage descriptor
# and one call descriptor (kvcache._entry.Rows, AttendCall), checked by kvcache._entry before
# anything here runs; _Store and _Call hold their typed views and the C structs of them
# (kvc_store, kvc_call in _dispatch.h), _plan the visible rows and the task list of a call.

# queries per task of attend_blocked (whole positions: a task holds ceil(_PF_QUERIES / heads
# per group) positions of one KV group, so each K/V tile is loaded once for that many queries;
# or a piece of such a block, where importance's one-pass buffer would pass its budget)
cdef Py_ssize_t _PF_QUERIES = 192
PREFILL_TASK_QUERIES = _PF_QUERIES
PREFILL_TILE_ROWS = KVC_PF_TILE


# pointers to the first element of a view, or NULL where it is empty
cdef inline const float *_cf3(const float[:, :, ::1] a) noexcept nogil:
    return &a[0, 0, 0] if a.shape[0] * a.shape[1] * a.shape[2] > 0 else NULL

cdef inline const int8_t *_ci8(const int8_t[:, :, ::1] a) noexcept nogil:
    return &a[0, 0, 0] if a.shape[0] * a.shape[1] * a.shape[2] > 0 else NULL

cdef inline float *_f3(float[:, :, ::1] a) noexcept nogil:
    return &a[0, 0, 0] if a.shape[0] * a.shape[1] * a.shape[2] > 0 else NULL

# what the fast acceptance of a call (``_O1.accept``, ``_accept_call``) compares against:
# kvcache._entry's own dtypes and limits, so that it accepts nothing the checks there refuse
cdef object _ND = np.ndarray
cdef object _DT_F32 = _entry._F32
cdef object _DT_IP = _entry._IP
cdef object _THREADS_MAX = _entry.THREADS_MAX
cdef object _COUNT_MAX = _entry.COUNT_MAX


cdef inline bint _is_f32(object a) except -1:
    return type(a) is _ND and a.dtype is _DT_F32


# The call descriptors' fields in their NamedTuple order (kvcache._entry): read by position from
# a descriptor of that very type (no attribute lookups per call), by name from anything else.
_ATTEND_FIELDS = ("q", "group_q0", "n_pos", "n_back", "window", "first", "scale", "softcap",
                  "out", "imp", "imp_mode", "n_threads", "probs")
_STEP_FIELDS = ("q", "k_new", "v_new", "win_len", "slot", "absorb", "use_far", "out", "scr",
                "n_threads")
if _entry.AttendCall._fields != _ATTEND_FIELDS or _entry.O1Step._fields != _STEP_FIELDS:
    raise ImportError("kvcache._core was built for other call descriptors than kvcache._entry "
                      "defines; rebuild the extension (pip install -e .)")
cdef object _ATTEND = _entry.AttendCall
cdef object _STEP = _entry.O1Step


cdef tuple _fields(obj, cls, tuple names):
    """``obj``'s fields in ``names`` order: ``obj`` itself when it is a ``cls`` (a NamedTuple
    of those fields), else its attributes (None where missing: the checks ran before)."""
    if type(obj) is cls:
        return <tuple> obj
    return tuple([getattr(obj, n, None) for n in names])


cdef inline const float *_cf2(const float[:, ::1] a) noexcept nogil:
    return &a[0, 0] if a.shape[0] * a.shape[1] > 0 else NULL

cdef inline float *_f2(float[:, ::1] a) noexcept nogil:
    return &a[0, 0] if a.shape[0] * a.shape[1] > 0 else NULL


cdef inline Py_ssize_t _visible(Py_ssize_t stored, Py_ssize_t n_back, Py_ssize_t i,
                                Py_ssize_t window, Py_ssize_t first, Py_ssize_t cap,
                                Py_ssize_t *first_out) noexcept nogil:
    """The rows [first, end) that query position i of a group holding ``stored`` rows sees
    (the rule of AttendCall's docstring, reference.visible_range): returns end, writes first.
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


cdef inline kvc_task _task(Py_ssize_t g, Py_ssize_t j0, Py_ssize_t j1, Py_ssize_t p0,
                           Py_ssize_t p1) noexcept nogil:
    cdef kvc_task t
    t.g = g
    t.j0 = j0
    t.j1 = j1
    t.p0 = p0
    t.p1 = p1
    return t


cdef class _Store:
    """One layer's storage bound for the attention kernels (``bind_rows``): a
    kvcache._entry.Rows that passed ``check_rows``, as typed views, and the kvc_store of
    pointers the C entries read (only the arrays of the stored representation, float32 or
    int8 per component, NULL where empty).  The views hold the arrays' buffers, so their
    memory and shapes stay what was checked while the binding lives; ``rows`` and ``shape``
    are what each call is checked against (``check_call``)."""
    cdef readonly object rows
    cdef readonly object shape
    cdef readonly object head_len
    cdef const float[:, :, ::1] kf__hcd
    cdef const int8_t[:, :, ::1] kq__hcd
    cdef const float[:, :, ::1] ks__hcg
    cdef const float[:, :, ::1] vf__hcd
    cdef const int8_t[:, :, ::1] vq__hcd
    cdef const float[:, :, ::1] vs__hc1
    cdef const uint8_t[:, :, ::1] vc4__hcb
    cdef const uint16_t[:, :, ::1] vp__hcp
    cdef const uint8_t[:, :, ::1] kc4__hcb
    cdef const uint16_t[:, :, ::1] kp__hbq
    cdef const float[:, :, ::1] kr__hrd
    cdef const float[:, ::1] vcol__hd
    cdef const Py_ssize_t[::1] head_len__h
    cdef Py_ssize_t nkv, cap              # the checked shape's KV groups and capacity
    cdef kvc_store s

    def __init__(self, rows):
        self.shape = _entry.check_rows(rows)
        self.cap = self.shape.capacity
        self.rows = rows
        self.head_len = rows.head_len
        cdef Py_ssize_t k_group = self.shape.k_group
        self.kf__hcd = rows.kf
        self.kq__hcd = rows.kq
        self.ks__hcg = rows.ks
        self.vf__hcd = rows.vf
        self.vq__hcd = rows.vq
        self.vs__hc1 = rows.vs
        self.vcol__hd = rows.vcol
        self.head_len__h = rows.head_len
        self.nkv = self.head_len__h.shape[0]
        memset(&self.s, 0, sizeof(kvc_store))
        self.s.quant_k = 1 if rows.quant_k else 0
        self.s.quant_v = 1 if rows.quant_v else 0
        self.s.k_group = k_group
        self.s.head_len = &self.head_len__h[0] if self.nkv > 0 else NULL
        if rows.k4:
            self.kc4__hcb = rows.kc4
            self.kp__hbq = rows.kp
            self.kr__hrd = rows.kr
            self.s.quant_k = KVC_K_Q4
            self.s.kc4 = &self.kc4__hcb[0, 0, 0] if self.kc4__hcb.size > 0 else NULL
            self.s.kp = &self.kp__hbq[0, 0, 0] if self.kp__hbq.size > 0 else NULL
            self.s.kr = &self.kr__hrd[0, 0, 0] if self.kr__hrd.size > 0 else NULL
            self.s.kcap = self.kc4__hcb.shape[1]
            self.s.hd = self.kr__hrd.shape[2]
        elif self.s.quant_k:
            self.s.kq = _ci8(self.kq__hcd)
            self.s.ks = _cf3(self.ks__hcg)
            self.s.kcap = self.kq__hcd.shape[1]
            self.s.ks_stride = self.ks__hcg.shape[2]
            self.s.hd = self.kq__hcd.shape[2]
        else:
            self.s.kf = _cf3(self.kf__hcd)
            self.s.kcap = self.kf__hcd.shape[1]
            self.s.hd = self.kf__hcd.shape[2]
        if rows.v4:
            self.vc4__hcb = rows.vc4
            self.vp__hcp = rows.vp
            self.s.quant_v = KVC_V_Q4
            self.s.vc4 = &self.vc4__hcb[0, 0, 0] if self.vc4__hcb.size > 0 else NULL
            self.s.vp = &self.vp__hcp[0, 0, 0] if self.vp__hcp.size > 0 else NULL
            self.s.vcap = self.vc4__hcb.shape[1]
        elif self.s.quant_v:
            self.s.vq = _ci8(self.vq__hcd)
            self.s.vs = _cf3(self.vs__hc1)
            self.s.vcol = &self.vcol__hd[0, 0] if self.vcol__hd.shape[0] > 0 else NULL
            self.s.vcap = self.vq__hcd.shape[1]
            self.s.vs_stride = self.vs__hc1.shape[2]
        else:
            self.s.vf = _cf3(self.vf__hcd)
            self.s.vcap = self.vf__hcd.shape[1]


cdef class _Call:
    """One attention call (a checked kvcache._entry.AttendCall) as typed views and numbers,
    and its kvc_call (the visible rows and query codes in it point into the call's _Plan)."""
    cdef const float[:, ::1] q__jd
    cdef const Py_ssize_t[::1] group_q0
    cdef float[:, ::1] out__jd
    cdef float[:, ::1] probs__jl
    cdef float[::1] imp__l
    cdef Py_ssize_t nq, n_pos, n_back, window, first
    cdef int imp_mode, n_threads
    cdef kvc_call c

    def __init__(self, fields, bint with_probs):
        """``fields``: the call's fields in AttendCall order (``_fields``)."""
        q, g0, n_pos, n_back, window, first, scale, softcap, out, imp, imp_mode, nt, probs = \
            fields
        self.q__jd = q
        self.group_q0 = g0
        self.out__jd = out
        self.imp__l = imp
        self.nq = self.q__jd.shape[0]
        self.n_pos = n_pos
        self.n_back = n_back
        self.window = window
        self.first = first
        self.imp_mode = imp_mode
        self.n_threads = nt
        memset(&self.c, 0, sizeof(kvc_call))
        self.c.scale = scale
        self.c.softcap = softcap
        if self.nq > 0:
            self.c.q = &self.q__jd[0, 0]
            self.c.out = &self.out__jd[0, 0]
        if with_probs:
            self.probs__jl = probs
            self.c.L = self.probs__jl.shape[1]
            if self.nq > 0 and self.c.L > 0:
                self.c.probs = &self.probs__jl[0, 0]


cdef class _Plan:
    """The plan of one attention call and every C buffer it uses (freed with it): its bound
    descriptors, each query's visible rows [qf, qe) and KV group qg, the task list, and what the
    entry adds (alloc)."""
    cdef _Store st
    cdef _Call ca
    cdef Py_ssize_t *qf
    cdef Py_ssize_t *qe
    cdef Py_ssize_t *qg
    cdef kvc_task *tasks
    cdef Py_ssize_t ntasks
    cdef Py_ssize_t *g_task0    # attend_rows: group g's tasks are [g_task0[g], g_task0[g + 1])
    cdef Py_ssize_t work        # rows times head_dim, summed over the queries
    cdef Py_ssize_t maxlen      # the largest end of a visible range
    cdef Py_ssize_t width       # attend_rows: most queries of a group; attend_blocked: of a task
    cdef bint imp               # imp_mode 2 with a row of importance to add to
    cdef void *_owned[24]
    cdef int _n_owned

    cdef void *alloc(self, size_t nbytes, bint zero=False) except NULL:
        """nbytes (at least 1) of C memory owned by the plan; MemoryError when there is none."""
        cdef void *p
        if self._n_owned == 24:
            raise MemoryError("_Plan: too many buffers")
        if nbytes == 0:
            nbytes = 1
        p = calloc(nbytes, 1) if zero else malloc(nbytes)
        if p == NULL:
            raise MemoryError()
        self._owned[self._n_owned] = p
        self._n_owned += 1
        return p

    def __dealloc__(self):
        cdef int i
        for i in range(self._n_owned):
            free(self._owned[i])


def bind_rows(rows):
    """A kvcache._entry.Rows checked (kvcache._entry.check_rows: TypeError, ValueError) and
    bound for ``attend_rows`` and ``attend_blocked``, which then check only each call against
    it.  The binding reads the arrays it was made from: bind again when an owner replaces
    one (a layer does when its storage grows or is restored); values written into them, the
    rows each group holds included, need no new binding."""
    return _Store(rows)


cdef _Call _accept_call(_Store st, call, bint blocked):
    """``call`` bound, when kvcache._entry.check_call accepts it against the storage ``st``,
    answered without running Python code for the common case: every array an ndarray of its
    dtype that the typed views take (dimensions, C order, writability), the counts plain ints
    in range, the shapes, query groups and each group's stored rows as the check requires.
    None for anything else, even a call the check would pass: the caller then asks the check
    itself, which raises naming what is wrong.  So this accepts a subset of what the check
    accepts and never raises an error of its own (tests/test_entry_accept.py compares the
    two on malformed calls)."""
    if type(call) is not _ATTEND:
        return None
    cdef tuple fields = <tuple> call
    q, g0, n_pos, n_back, window, first, scale, softcap, out, imp, im, nt, probs = fields
    if not (_is_f32(q) and _is_f32(out) and _is_f32(imp) and type(g0) is _ND
            and g0.dtype is _DT_IP and (blocked or _is_f32(probs))
            and type(n_pos) is int and type(n_back) is int and type(window) is int
            and type(first) is int and type(nt) is int and type(im) is int
            and type(scale) is float and type(softcap) is float):
        return None
    if not (1 <= n_pos <= _COUNT_MAX and 0 <= n_back <= _COUNT_MAX
            and 0 <= window <= _COUNT_MAX and 0 <= first <= _COUNT_MAX
            and 1 <= nt <= _THREADS_MAX and (im == 0 or im == 2 or (im == 1 and not blocked))):
        return None
    cdef _Call ca
    try:
        ca = _Call(fields, not blocked)
    except (TypeError, ValueError, BufferError):
        return None
    cdef Py_ssize_t nq = ca.nq, nkv = st.nkv, g, cnt
    if not (ca.q__jd.shape[1] == st.s.hd and ca.out__jd.shape[0] == nq
            and ca.out__jd.shape[1] == st.s.hd and (blocked or ca.probs__jl.shape[0] == nq)
            and ca.group_q0.shape[0] == nkv + 1 and ca.group_q0[0] == 0
            and ca.group_q0[nkv] == nq):
        return None
    for g in range(nkv):
        # offsets compared before any difference is taken: 0 = g0[0] <= ... <= g0[nkv] = nq
        # bounds every count by nq (a difference of wild offsets could wrap around)
        if ca.group_q0[g + 1] < ca.group_q0[g]:
            return None
        cnt = ca.group_q0[g + 1] - ca.group_q0[g]
        if cnt % ca.n_pos != 0 or not 0 <= st.head_len__h[g] <= st.cap:
            return None
    return ca


cdef _Plan _attention(rows, call, bint blocked):
    """An attention call's storage bound (``rows`` a binding of bind_rows, else bound now),
    its call checked against it (kvcache._entry.check_call), then planned; None when the call
    has no query."""
    cdef _Store st = rows if type(rows) is _Store else _Store(rows)
    cdef _Call ca = _accept_call(st, call, blocked)
    if ca is None:
        _entry.check_call(st.rows, st.shape, call, blocked)
        ca = _Call(_fields(call, _ATTEND, _ATTEND_FIELDS), not blocked)
    if ca.nq == 0:
        return None
    return _plan(st, ca, blocked)


cdef _Plan _plan(_Store st, _Call ca, bint blocked):
    """The visible rows of every query of a call (``_visible``; ca.c points at them) and its
    task list.

    attend_rows (``blocked`` False): per KV group, one task per CHUNK_ROWS chunk (at absolute
    row multiples) of the rows its queries see, groups in order, each task holding all the
    group's queries; visible ends are capped at the probability width L.
    attend_blocked: per KV group, blocks of ceil(_PF_QUERIES / heads per group) positions, the
    latest blocks (the most rows) first and the groups interleaved, so that a dynamic schedule
    ends on short tasks; with importance, a block over the one-pass budget cut in pieces that
    fit (_position_blocks)."""
    cdef _Plan pl = _Plan.__new__(_Plan)
    cdef const Py_ssize_t[::1] gq0 = ca.group_q0
    pl.st = st
    pl.ca = ca
    cdef Py_ssize_t nkv = st.nkv, hd = st.s.hd, nq = ca.nq
    cdef Py_ssize_t g, jl, j, e, f, cnt, per, stored, lo, hi
    cdef Py_ssize_t *g_lo = <Py_ssize_t *> pl.alloc(nkv * sizeof(Py_ssize_t))
    cdef Py_ssize_t *g_hi = <Py_ssize_t *> pl.alloc(nkv * sizeof(Py_ssize_t))
    pl.qf = <Py_ssize_t *> pl.alloc(nq * sizeof(Py_ssize_t))
    pl.qe = <Py_ssize_t *> pl.alloc(nq * sizeof(Py_ssize_t))
    pl.qg = <Py_ssize_t *> pl.alloc(nq * sizeof(Py_ssize_t))
    ca.c.qf = pl.qf
    ca.c.qe = pl.qe
    for g in range(nkv):
        cnt = gq0[g + 1] - gq0[g]
        g_lo[g] = g_hi[g] = 0
        if cnt == 0:
            continue
        per = cnt // ca.n_pos
        stored = st.head_len__h[g]
        lo = stored
        hi = 0
        for jl in range(cnt):
            j = gq0[g] + jl
            e = _visible(stored, ca.n_back, jl // per, ca.window, ca.first,
                         stored if blocked else ca.c.L, &f)
            pl.qf[j] = f
            pl.qe[j] = e
            pl.qg[j] = g
            if e > f:
                if f < lo:
                    lo = f
                if e > hi:
                    hi = e
                pl.work += (e - f) * hd
        if hi > lo:
            g_lo[g] = lo
            g_hi[g] = hi
            if hi > pl.maxlen:
                pl.maxlen = hi
    pl.imp = ca.imp_mode == 2 and ca.imp__l.shape[0] > 0 and pl.maxlen > 0
    if blocked:
        _position_blocks(pl, gq0, ca.n_pos)
    else:
        _row_chunks(pl, gq0, g_lo, g_hi)
    return pl


cdef int _row_chunks(_Plan pl, const Py_ssize_t[::1] gq0, const Py_ssize_t *g_lo,
                     const Py_ssize_t *g_hi) except -1:
    """attend_rows' tasks: the chunks of rows [g_lo[g], g_hi[g]) of each group g."""
    cdef Py_ssize_t nkv = gq0.shape[0] - 1, g, c, t = 0
    pl.g_task0 = <Py_ssize_t *> pl.alloc((nkv + 1) * sizeof(Py_ssize_t))
    for g in range(nkv):
        pl.g_task0[g] = pl.ntasks
        pl.width = max(pl.width, gq0[g + 1] - gq0[g])
        if g_hi[g] > g_lo[g]:
            pl.ntasks += (g_hi[g] - 1) // _CHUNK - g_lo[g] // _CHUNK + 1
    pl.g_task0[nkv] = pl.ntasks
    pl.tasks = <kvc_task *> pl.alloc((pl.ntasks + 1) * sizeof(kvc_task))
    for g in range(nkv):
        if g_hi[g] <= g_lo[g]:
            continue
        for c in range(g_lo[g] // _CHUNK, (g_hi[g] - 1) // _CHUNK + 1):
            pl.tasks[t] = _task(g, gq0[g], gq0[g + 1], max(g_lo[g], c * _CHUNK),
                                min(g_hi[g], (c + 1) * _CHUNK))
            t += 1
    return 0


cdef Py_ssize_t _pf_buffer(const Py_ssize_t *qf, const Py_ssize_t *qe, Py_ssize_t j0,
                           Py_ssize_t j1, Py_ssize_t *tlo, Py_ssize_t *thi) noexcept nogil:
    """The one-pass importance buffer (floats, KVC_PF_PBUF_FLOATS) of a task over the queries
    [j0, j1): the tiles that meet the union of their visible rows, [tlo, thi) at tile
    multiples (both 0, and the result 0, when none of them sees a row)."""
    cdef Py_ssize_t j, lo = PY_SSIZE_T_MAX, hi = 0
    for j in range(j0, j1):
        if qe[j] > qf[j]:
            if qf[j] < lo:
                lo = qf[j]
            if qe[j] > hi:
                hi = qe[j]
    tlo[0] = thi[0] = 0
    if hi <= lo:
        return 0
    tlo[0] = lo // KVC_PF_TILE * KVC_PF_TILE
    thi[0] = (hi + KVC_PF_TILE - 1) // KVC_PF_TILE * KVC_PF_TILE
    return KVC_PF_PBUF_FLOATS((thi[0] - tlo[0]) // KVC_PF_TILE, j1 - j0)


cdef Py_ssize_t _pf_piece(const Py_ssize_t *qf, const Py_ssize_t *qe, Py_ssize_t j0,
                          Py_ssize_t per, Py_ssize_t nb, Py_ssize_t budget) noexcept nogil:
    """Positions per piece of a block of nb positions (per queries each, from query j0) whose
    importance is wanted: s = ceil(nb / k) for the first k of 1, 2, 4, 8, ... whose pieces
    ([0, s), [s, 2s), ... the last one shorter) all fit the budget; 1 when k reaches nb
    (pieces of one position, kept even over the budget).  Each task reads and packs every
    tile it sees, so the fewest pieces that fit (docs/numerics.md, "Prompt attention")."""
    cdef Py_ssize_t tlo, thi, k = 1, s, a
    while k < nb:
        s = (nb + k - 1) // k
        a = 0
        while a < nb and _pf_buffer(qf, qe, j0 + a * per, j0 + min(nb, a + s) * per,
                                    &tlo, &thi) <= budget:
            a += s
        if a >= nb:
            return s
        k *= 2
    return 1


cdef int _position_blocks(_Plan pl, const Py_ssize_t[::1] gq0, Py_ssize_t n_pos) except -1:
    """attend_blocked's tasks: blocks of whole positions of each group, bq =
    ceil(_PF_QUERIES / per) positions at multiples of bq from position 0, the latest block
    first, the groups interleaved block by block.  With importance (pl.imp), a block whose
    one-pass buffer would pass the budget is cut in pieces that fit (_pf_piece), the latest
    piece first: so every prompt takes one pass, a longer one in narrower tasks."""
    cdef Py_ssize_t nkv = gq0.shape[0] - 1, g, cnt, per, bq, b, i0, nb, s, a, k
    cdef Py_ssize_t t = 0, total = 0
    cdef Py_ssize_t *g_bq = <Py_ssize_t *> pl.alloc(2 * (nkv + 1) * sizeof(Py_ssize_t))
    cdef Py_ssize_t *g_blk0 = g_bq + nkv + 1
    cdef Py_ssize_t *piece
    # ---- each group's block length, and where its blocks' piece lengths start -------------
    for g in range(nkv):
        cnt = gq0[g + 1] - gq0[g]
        g_blk0[g] = total
        g_bq[g] = 0
        if cnt == 0:
            continue
        per = cnt // n_pos
        g_bq[g] = bq = max(1, (_PF_QUERIES + per - 1) // per)
        total += (n_pos + bq - 1) // bq
    g_blk0[nkv] = total
    # ---- each block's piece length (whole blocks without importance), the tasks it makes ----
    piece = <Py_ssize_t *> pl.alloc((total + 1) * sizeof(Py_ssize_t))
    for g in range(nkv):
        if g_bq[g] == 0:
            continue
        per = (gq0[g + 1] - gq0[g]) // n_pos
        bq = g_bq[g]
        for b in range(g_blk0[g + 1] - g_blk0[g]):
            i0 = b * bq
            nb = min(n_pos, i0 + bq) - i0
            s = (_pf_piece(pl.qf, pl.qe, gq0[g] + i0 * per, per, nb, _pf_imp_budget)
                 if pl.imp else nb)
            piece[g_blk0[g] + b] = s
            pl.ntasks += (nb + s - 1) // s
            pl.width = max(pl.width, s * per)
    pl.tasks = <kvc_task *> pl.alloc((pl.ntasks + 1) * sizeof(kvc_task))
    # ---- block by block from the latest, groups in order, each block's pieces latest first ---
    for k in range(total):      # k: blocks back from each group's latest
        for g in range(nkv):
            if g_bq[g] == 0 or k >= g_blk0[g + 1] - g_blk0[g]:
                continue
            per = (gq0[g + 1] - gq0[g]) // n_pos
            b = g_blk0[g + 1] - g_blk0[g] - 1 - k
            i0 = b * g_bq[g]
            nb = min(n_pos, i0 + g_bq[g]) - i0
            s = piece[g_blk0[g] + b]
            a = (nb - 1) // s * s
            while a >= 0:
                pl.tasks[t] = _task(g, gq0[g] + (i0 + a) * per,
                                    gq0[g] + (i0 + min(nb, a + s)) * per, 0, 0)
                t += 1
                a -= s
        if t == pl.ntasks:
            break
    return 0


cdef int _query_codes(_Plan pl, _Call ca, const kvc_store *s, bint par) except -1:
    """The int8 codes of the call's queries for integer scoring (docs/numerics.md, "q8
    scoring"), in buffers of the plan that ca.c points at: query j's codes at
    j * KVC_I8_PAD(hd), its group scales and code sums at j * KVC_I8_GROUPS(hd, k_group)."""
    cdef Py_ssize_t j, nq = ca.nq, hd = s.hd, group = s.k_group
    cdef Py_ssize_t hdp = KVC_I8_PAD(hd), ngq = KVC_I8_GROUPS(hd, group)
    cdef int8_t *qi = <int8_t *> pl.alloc(nq * hdp)
    cdef float *sq = <float *> pl.alloc(nq * ngq * sizeof(float))
    cdef int32_t *qs = <int32_t *> pl.alloc(nq * ngq * sizeof(int32_t))
    cdef const float *qp = ca.c.q
    cdef int n_threads = ca.n_threads
    for j in prange(nq, nogil=True, num_threads=n_threads, schedule="static",
                    use_threads_if=par):
        _ops(KVC_FAM_Q8).quant_query(qp + j * hd, hd, group, qi + j * hdp, sq + j * ngq,
                                     qs + j * ngq)
    ca.c.qi = qi
    ca.c.qsc = sq
    ca.c.qsum = qs
    return 0


def attend_rows(rows, call):
    """Grouped attention of nq queries over the head-major storage of one layer, with the
    probability matrix.

    ``rows``: a kvcache._entry.Rows or its binding (``bind_rows``); ``call``: a
    kvcache._entry.AttendCall with ``probs`` (nq, L).  Query j of KV group g sees the rows [first_j, end_j) of AttendCall's rule, end_j
    also capped at L.  In q8-K mode the queries are already multiplied by the frozen key
    columns; q8 scores use K groups of ``rows.k_group`` channels (16 or 32; 0: from ks,
    ceil(head_dim/16) scales per row meaning 16).

    Fills out (nq, hd) and probs (nq, L) (normalised probabilities, 0 outside the visible
    rows).  imp_mode 0: importance untouched; 1: imp[p] += probs[j, p] for each query j in
    order (attend_group); 2: imp[p] += (sum over queries in order of probs[j, p])
    (attend_all_heads: a fresh buffer added once).  Rows p >= head_len of a query's group and
    p >= len(imp) are never touched.  Checked by kvcache._entry (check_rows when not bound,
    check_call; ValueError, TypeError) before any work.
    """
    cdef _Plan pl = _attention(rows, call, False)
    if pl is None:
        return
    cdef _Store st = pl.st
    cdef _Call ca = pl.ca
    cdef const kvc_store *s = &st.s
    cdef kvc_call *c = &ca.c
    cdef const kvc_task *tasks = pl.tasks
    cdef const Py_ssize_t *g_task0 = pl.g_task0
    cdef const Py_ssize_t *qf = pl.qf
    cdef const Py_ssize_t *qe = pl.qe
    cdef const Py_ssize_t *qg = pl.qg
    cdef const Py_ssize_t[::1] gq0 = ca.group_q0
    cdef const Py_ssize_t *head_len = &st.head_len__h[0]
    cdef float[:, ::1] probs__jl = ca.probs__jl
    cdef float[:, ::1] out__jd = ca.out__jd
    cdef const float[:, ::1] vcol__hd = st.vcol__hd
    cdef Py_ssize_t nkv = st.nkv, nq = ca.nq, hd = s.hd, L = c.L, maxcnt = pl.width
    cdef Py_ssize_t n_imp = ca.imp__l.shape[0], nscr = KVC_SCRATCH_FLOATS(hd)
    cdef Py_ssize_t g, j, t, e, p, ga, gb, t0, t1, j0, j1, hi
    cdef int n_threads = ca.n_threads, imp_mode = ca.imp_mode
    cdef bint quant_k = s.quant_k == KVC_K_Q8, quant_v = s.quant_v == KVC_V_Q8
    cdef bint k4 = s.quant_k == KVC_K_Q4, par = pl.work > _PAR_WORK
    cdef float *imp = &ca.imp__l[0] if n_imp > 0 else NULL
    cdef float *imp_tmp = NULL
    cdef float *dst
    # chunk partials: task t's queries at t * maxcnt; per-thread scratch of the value pass
    cdef float *part = <float *> pl.alloc((pl.ntasks * maxcnt * hd + 1) * sizeof(float))
    cdef float *scratch = <float *> pl.alloc((n_threads * nscr + 1) * sizeof(float))
    cdef const kvc_ops *q8 = _ops(KVC_FAM_Q8)      # each family's body, once per call
    cdef const kvc_ops *f32 = _ops(KVC_FAM_F32)
    if quant_k:
        _query_codes(pl, ca, s, par and nq * hd > _PAR_WORK)
    if imp_mode == 2:
        imp_tmp = <float *> pl.alloc((L + 1) * sizeof(float), True)

    # ---- groups are processed in batches whose probabilities (batch queries x L floats)
    # stay in the core's L2 between the score, softmax, value and importance passes
    ga = 0
    while ga < nkv:
        gb = ga + 1
        while gb < nkv and (gq0[gb + 1] - gq0[ga]) * L * 4 <= _BATCH_BYTES:
            gb += 1
        t0 = g_task0[ga]
        t1 = g_task0[gb]
        j0 = gq0[ga]
        j1 = gq0[gb]
        ga = gb
        if t1 == t0:
            continue

        # 1. scores: a block of 4 K rows is read once for all the group's queries
        for t in prange(t0, t1, nogil=True, num_threads=n_threads, schedule="static",
                        use_threads_if=par):
            if quant_k:
                q8.task_scores_i8(s, c, tasks + t, scratch + omp_get_thread_num() * nscr)
            elif k4:
                q8.task_scores_k4(s, c, tasks + t, scratch + omp_get_thread_num() * nscr)
            else:
                f32.task_scores(s, c, tasks + t)

        # 2. softmax per query over its visible rows; zeros elsewhere
        for j in prange(j0, j1, nogil=True, num_threads=n_threads, schedule="static",
                        use_threads_if=par):
            if qf[j] > 0:
                memset(&probs__jl[j, 0], 0, qf[j] * sizeof(float))
            if qe[j] < L:
                memset(&probs__jl[j, qe[j]], 0, (L - qe[j]) * sizeof(float))
            if qe[j] > qf[j]:
                f32.softmax(&probs__jl[j, qf[j]], qe[j] - qf[j])

        # 3. V partials per chunk: a block of 4 V rows read once for the group
        for t in prange(t0, t1, nogil=True, num_threads=n_threads, schedule="static",
                        use_threads_if=par):
            f32.task_values(s, c, tasks + t, part + t * maxcnt * hd,
                            scratch + omp_get_thread_num() * nscr)

        # 4. importance of the batch's queries, in query order, per chunk of rows: into imp
        # (mode 1) or into the fresh buffer imp_tmp (mode 2)
        if imp_mode != 0:
            hi = n_imp if n_imp < L else L
            dst = imp if imp_mode == 1 else imp_tmp
            for t in prange((hi + _CHUNK - 1) // _CHUNK, nogil=True, num_threads=n_threads,
                            schedule="static", use_threads_if=par):
                _importance_chunk(c, qg, head_len, j0, j1, t * _CHUNK,
                                  min(hi, (t + 1) * _CHUNK), dst)

    # ---- 5. merge the chunk partials in chunk order ---------------------------------------
    for j in prange(nq, nogil=True, num_threads=n_threads, schedule="static",
                    use_threads_if=par):
        g = qg[j]
        memset(&out__jd[j, 0], 0, hd * sizeof(float))
        for t in range(g_task0[g], g_task0[g + 1]):
            if tasks[t].p1 <= qf[j] or tasks[t].p0 >= qe[j]:
                continue
            f32.axpy(&out__jd[j, 0], 1.0, part + (t * maxcnt + j - gq0[g]) * hd, hd)
        if quant_v:
            for e in range(hd):
                out__jd[j, e] = out__jd[j, e] * vcol__hd[g, e]

    # ---- 6. attend_all_heads importance: the fresh per-row sums are added once -----------
    if imp_mode == 2:
        hi = n_imp if n_imp < L else L
        for p in prange(hi, nogil=True, num_threads=n_threads, schedule="static",
                        use_threads_if=par):
            imp[p] += imp_tmp[p]


cdef void _importance_chunk(const kvc_call *c, const Py_ssize_t *qg,
                            const Py_ssize_t *head_len, Py_ssize_t j0, Py_ssize_t j1,
                            Py_ssize_t p0, Py_ssize_t p1, float *dst) noexcept nogil:
    """For p in [p0, p1) below the query's group head_len, dst[p] += probs[j, p] for the
    queries j in [j0, j1) in order."""
    cdef Py_ssize_t j, p, hi
    cdef const float *pr
    for j in range(j0, j1):
        hi = head_len[qg[j]]
        if hi > p1:
            hi = p1
        pr = c.probs + j * c.L
        for p in range(p0, hi):
            dst[p] = dst[p] + pr[p]


cdef inline float *_aligned64(float *p) noexcept nogil:
    return <float *> ((<size_t> p + 63) & ~(<size_t> 63))


# The largest one-pass importance buffer of one task, in floats (KVC_PF_IMP_BUDGET, 16 MiB): a
# block that would need more is cut in pieces that fit (_position_blocks; a piece of one
# position is kept even over it).  Only the tests change it (_set_prefill_imp_budget), to reach
# the pieces with small calls.
cdef Py_ssize_t _pf_imp_budget = KVC_PF_IMP_BUDGET
PREFILL_IMP_BUDGET_FLOATS = KVC_PF_IMP_BUDGET


def _set_prefill_imp_budget(Py_ssize_t floats):
    """Set the one-pass importance budget of a task (floats, >= 0; 0: every block is cut in
    pieces of one position); returns the previous one.  For tests."""
    global _pf_imp_budget
    if floats < 0:
        raise ValueError(f"expected a budget >= 0, got {floats}")
    old = _pf_imp_budget
    _pf_imp_budget = floats
    return old


cdef Py_ssize_t _pf_geo(_Plan pl, Py_ssize_t *geo) noexcept nogil:
    """Per task t of an attend_blocked plan: the tiles [geo[3t], geo[3t + 1]) that its visible
    rows meet and its one-pass buffer geo[3t + 2] (floats; 0: no row seen).  Returns the
    largest buffer."""
    cdef Py_ssize_t t, npb = 0
    for t in range(pl.ntasks):
        geo[3 * t + 2] = _pf_buffer(pl.qf, pl.qe, pl.tasks[t].j0, pl.tasks[t].j1, geo + 3 * t,
                                    geo + 3 * t + 1)
        if geo[3 * t + 2] > npb:
            npb = geo[3 * t + 2]
    return npb


def _prefill_tasks(rows, call):
    """attend_blocked's tasks for ``call`` without running it (for tests): an (ntasks, 4)
    int64 array, per task in order its KV group, first and end query, and its one-pass
    importance buffer in floats (0: the task sees no row; 0 for every task of a call without
    importance).  Checked as attend_blocked checks."""
    cdef _Plan pl = _attention(rows, call, True)
    if pl is None:
        return np.zeros((0, 4), np.int64)
    cdef Py_ssize_t t
    cdef Py_ssize_t *geo = <Py_ssize_t *> pl.alloc(3 * pl.ntasks * sizeof(Py_ssize_t))
    _pf_geo(pl, geo)
    res = np.zeros((pl.ntasks, 4), np.int64)
    cdef long long[:, ::1] r = res
    for t in range(pl.ntasks):
        r[t, 0] = pl.tasks[t].g
        r[t, 1] = pl.tasks[t].j0
        r[t, 2] = pl.tasks[t].j1
        r[t, 3] = geo[3 * t + 2] if pl.imp else 0
    return res


def attend_blocked(rows, call):
    """Grouped attention of nq queries over one layer's head-major rows, tile by tile.

    ``rows`` and ``call`` as for :func:`attend_rows`, without the probability matrix
    (``call.probs`` is not read): an online softmax over tiles of 64 rows at absolute row
    multiples (orders in _prefill.h, docs/numerics.md), so a query's bits depend only on its
    own visible rows.  imp_mode 0: importance untouched; 2: every row p < len(imp) gets, once,
    the sum of the query's final probabilities of row p over the call's queries: per task (a
    KV group's block of positions, or a piece of one where the block's one-pass buffer would
    pass the budget) in query order from the probabilities the task kept (one pass), the
    tasks' sums added in task order.  Checked by kvcache._entry (check_rows when not bound,
    check_call; ValueError, TypeError) before any work.
    """
    cdef _Plan pl = _attention(rows, call, True)
    if pl is None:
        return
    cdef _Store st = pl.st
    cdef _Call ca = pl.ca
    cdef const kvc_store *s = &st.s
    cdef kvc_call *c = &ca.c
    cdef const kvc_task *tasks = pl.tasks
    cdef float[::1] imp__l = ca.imp__l
    cdef Py_ssize_t nq = ca.nq, hd = s.hd, nscr, ntasks = pl.ntasks
    cdef Py_ssize_t t, tid, p, lim, slot, nb, b0, b1, npb, nch, ch, r0, r1
    cdef int n_threads = ca.n_threads
    cdef bint par = 2 * pl.work > _PAR_WORK
    cdef float *scr
    cdef float *pbuf
    cdef float *part
    cdef float *acc
    cdef float *pp
    cdef Py_ssize_t *geo
    cdef const kvc_ops *pf = _ops(KVC_FAM_PREFILL)   # the family's body, once per call
    # per thread: a task's tiles
    nscr = KVC_PF_SCRATCH_FLOATS(hd, pl.width)
    nscr = (nscr + 15) // 16 * 16
    scr = _aligned64(<float *> pl.alloc((n_threads * nscr + 16) * sizeof(float)))
    c.qm = <float *> pl.alloc(nq * sizeof(float))
    c.ql = <float *> pl.alloc(nq * sizeof(float))
    if s.quant_k == KVC_K_Q8:
        _query_codes(pl, ca, s, par and nq * hd > _PAR_WORK)

    lim = min(pl.maxlen, imp__l.shape[0]) if pl.imp else 0
    if lim == 0:
        # ---- outputs, running max and sum: one task per (group, block of positions) -------
        for t in prange(ntasks, nogil=True, num_threads=n_threads, schedule="dynamic",
                        use_threads_if=par):
            pf.pf_task(s, c, tasks + t, scr + omp_get_thread_num() * nscr, NULL, NULL)
        return

    # ---- with importance: per task its tiles [geo[3t], geo[3t + 1]) and its one-pass buffer
    # (geo[3t + 2] floats; 0: no row seen) -----------------------------------------------------
    geo = <Py_ssize_t *> pl.alloc(3 * ntasks * sizeof(Py_ssize_t))
    npb = _pf_geo(pl, geo)
    npb = (npb + 15) // 16 * 16
    pbuf = _aligned64(<float *> pl.alloc((n_threads * npb + 16) * sizeof(float)))
    # the tasks' column sums (slot rows each, indexed by row), a batch of nb tasks at a time:
    # the batch only bounds the memory, the sums are added in task order whatever it is
    slot = (pl.maxlen + KVC_PF_TILE - 1) // KVC_PF_TILE * KVC_PF_TILE
    nb = min(ntasks, max(32, 8 * n_threads))
    part = <float *> pl.alloc(nb * slot * sizeof(float))
    acc = <float *> pl.alloc(lim * sizeof(float), True)
    nch = (lim + KVC_PF_IMP_ROWS - 1) // KVC_PF_IMP_ROWS
    b0 = 0
    while b0 < ntasks:
        b1 = min(b0 + nb, ntasks)
        # ---- 1. the batch's tasks: outputs, running max and sum, column sums ---------------
        for t in prange(b0, b1, nogil=True, num_threads=n_threads, schedule="dynamic",
                        use_threads_if=par):
            tid = omp_get_thread_num()
            if geo[3 * t + 2] > 0:
                pf.pf_task(s, c, tasks + t, scr + tid * nscr, pbuf + tid * npb,
                           part + (t - b0) * slot)
            else:
                pf.pf_task(s, c, tasks + t, scr + tid * nscr, NULL, NULL)
        # ---- 2. their column sums added row by row in task order -------------------------
        for ch in prange(nch, nogil=True, num_threads=n_threads, schedule="static",
                         use_threads_if=par and b1 - b0 > 1):
            for t in range(b0, b1):
                r0 = max(ch * KVC_PF_IMP_ROWS, geo[3 * t])
                r1 = min(min((ch + 1) * KVC_PF_IMP_ROWS, lim), geo[3 * t + 1])
                pp = part + (t - b0) * slot
                for p in range(r0, r1):
                    acc[p] = acc[p] + pp[p]
        b0 = b1
    # ---- 3. the call's importance added once -------------------------------------------------
    for p in range(lim):
        imp__l[p] = imp__l[p] + acc[p]



# ----------------------------------------------------------------------------------------------
# O(1) Nystrom decode (docs/o1.md).  The state lives in o1.py as stacked float32 arrays: the group-
# shared part (window ring, sinks, key landmarks) indexed by KV group g, the per-head part
# (query landmarks, mixing matrix, far accumulators) by query head h; head h belongs to group
# h // (H // G).  The kernels read it as one kvcache._entry.O1State; the per-head arithmetic and
# its order are in _kernels.h (kvc_o1_absorb, kvc_o1_head); heads are independent, so the
# result is the same for any thread count.

cdef class _O1:
    """An O(1) state (a kvcache._entry.O1State) as typed views, and the kvc_o1 the C entries
    read; ``step`` adds the views of one decode step (a checked O1Step).  Made by ``bind_o1``
    (``shape`` the state's kvcache._entry.O1Shape) or by o1_absorb after its own check
    (``shape`` None).  The views hold the arrays' buffers, so their memory and shapes stay
    what was checked while the binding lives."""
    cdef readonly object state
    cdef readonly object shape
    cdef const float[:, :, ::1] sink_k__gsd
    cdef const float[:, :, ::1] sink_v__gse
    cdef float[:, :, ::1] win_k__gcd
    cdef float[:, :, ::1] win_v__gce
    cdef const float[:, :, ::1] k_tilde__gmd
    cdef const float[:, :, ::1] q_tilde__hmd
    cdef const float[:, :, ::1] mu__hmm
    cdef float[:, :, ::1] t_hat__hme
    cdef float[:, ::1] z_hat__hm
    cdef float[:, ::1] m_max__hm
    cdef const float[:, ::1] q__hd
    cdef const float[:, ::1] k_new__gd
    cdef const float[:, ::1] v_new__ge
    cdef float[:, ::1] out__he
    cdef float[:, ::1] scr__hx
    cdef kvc_o1 o
    cdef int n_threads                          # the step's
    cdef Py_ssize_t H, G, m, d, dv, ns, cap     # the checked shape (bound: bind_o1)
    cdef bint bound

    def __init__(self, state, shape):
        self.state = state
        self.shape = shape
        if shape is not None:
            self.H, self.G, self.m, self.d, self.dv, self.ns, self.cap = shape
            self.bound = True
        self.sink_k__gsd = state.sink_k
        self.sink_v__gse = state.sink_v
        self.win_k__gcd = state.win_k
        self.win_v__gce = state.win_v
        self.k_tilde__gmd = state.k_tilde
        self.q_tilde__hmd = state.q_tilde
        self.mu__hmm = state.mu
        self.t_hat__hme = state.t_hat
        self.z_hat__hm = state.z_hat
        self.m_max__hm = state.m_max
        memset(&self.o, 0, sizeof(kvc_o1))
        self.o.m = self.q_tilde__hmd.shape[1]
        self.o.d = self.q_tilde__hmd.shape[2]
        self.o.dv = self.t_hat__hme.shape[2]
        self.o.scale = state.scale
        self.o.fm = 1 if state.fm else 0
        self.o.q_tilde = _cf3(self.q_tilde__hmd)
        self.o.k_tilde = _cf3(self.k_tilde__gmd)
        self.o.mu = _cf3(self.mu__hmm)
        self.o.t_hat = _f3(self.t_hat__hme)
        self.o.z_hat = _f2(self.z_hat__hm)
        self.o.m_max = _f2(self.m_max__hm)
        self.o.sink_k = _cf3(self.sink_k__gsd)
        self.o.sink_v = _cf3(self.sink_v__gse)
        self.o.ns = self.sink_k__gsd.shape[1]
        self.o.win_k = _f3(self.win_k__gcd)
        self.o.win_v = _f3(self.win_v__gce)
        self.o.cap = self.win_k__gcd.shape[1]

    cdef bint accept(self, step) except -1:
        """Whether kvcache._entry.check_o1_call accepts ``step`` against the bound shape,
        answered without running Python code for the common case: True when every array is a
        float32 ndarray that the typed views take (their dimensions, C order and writability)
        with the shapes, counts and ring position the check requires; the step is then set
        (:meth:`step`).  False for anything else, even a step the check would pass: the caller
        then asks the check itself, which raises naming what is wrong.  So this accepts a
        subset of what the check accepts and never raises an error of its own
        (tests/test_entry_accept.py compares the two on malformed steps).  Nothing is
        computed from the step's shapes before they are compared (k_new with no row must not
        reach the heads-per-group division)."""
        if type(step) is not _STEP or not self.bound:
            return False
        cdef tuple fields = <tuple> step
        q, k, v, win_len, slot, absorb, use_far, out, scr, nt = fields
        if not (_is_f32(q) and _is_f32(k) and _is_f32(v) and _is_f32(out) and _is_f32(scr)
                and type(win_len) is int and type(slot) is int and type(nt) is int):
            return False
        if not (1 <= win_len <= self.cap and 0 <= slot < win_len and 1 <= nt <= _THREADS_MAX):
            return False
        try:
            self.views(fields)
        except (TypeError, ValueError, BufferError):
            return False
        if not (self.q__hd.shape[0] == self.H and self.q__hd.shape[1] == self.d
                and self.k_new__gd.shape[0] == self.G and self.k_new__gd.shape[1] == self.d
                and self.v_new__ge.shape[0] == self.G and self.v_new__ge.shape[1] == self.dv
                and self.out__he.shape[0] == self.H and self.out__he.shape[1] == self.dv
                and self.scr__hx.shape[0] == self.H
                and self.scr__hx.shape[1] >= self.ns + <Py_ssize_t> win_len + 3 * self.m):
            return False
        self.numbers(fields)
        return True

    cdef step(self, tuple fields):
        """Set one checked step (``fields`` in O1Step order, ``_fields``)."""
        self.views(fields)
        self.numbers(fields)

    cdef views(self, tuple fields):
        """Take the typed views of a step's arrays (their dtype, dimensions, order and
        writability are checked by the views themselves)."""
        q, k, v, win_len, slot, absorb, use_far, out, scr, nt = fields
        self.q__hd = q
        self.k_new__gd = k
        self.v_new__ge = v
        self.out__he = out
        self.scr__hx = scr

    cdef numbers(self, tuple fields):
        """The kvc_o1 fields of a step whose views are taken and whose shapes passed."""
        q, k, v, win_len, slot, absorb, use_far, out, scr, nt = fields
        self.o.d = self.q__hd.shape[1]
        self.o.dv = self.v_new__ge.shape[1]
        self.o.hpk = self.q__hd.shape[0] // self.k_new__gd.shape[0]
        self.o.q = _cf2(self.q__hd)
        self.o.k_new = _cf2(self.k_new__gd)
        self.o.v_new = _cf2(self.v_new__ge)
        self.o.win_len = win_len
        self.o.slot = slot
        self.o.absorb = 1 if absorb else 0
        self.o.use_far = 1 if use_far else 0
        self.o.out = _f2(self.out__he)
        self.o.scr = _f2(self.scr__hx)
        self.o.scr_stride = self.scr__hx.shape[1]
        self.n_threads = nt


def bind_o1(state):
    """An O(1) state checked in full (kvcache._entry.check_o1_state: TypeError, ValueError)
    and bound for ``o1_step``, which then checks only each step against it.  Bind again when
    an owner replaces one of the state's arrays (values written into them need no new
    binding)."""
    return _O1(state, _entry.check_o1_state(state))


def o1_absorb(state, rows):
    """Far-field insertion of rows [row0, row0 + n) of every group, in row order.

    ``state``: a kvcache._entry.O1State (its q_tilde, t_hat, z_hat and m_max are read);
    ``rows``: a kvcache._entry.O1Absorb.  Head h (group g = h // (H // G)) absorbs keys[g, i] /
    values[g, i] into t_hat[h], z_hat[h], m_max[h] with the per-landmark running max; scr
    (H, >= m) is scratch.  Checked by kvcache._entry.check_o1_absorb.  A binding of ``bind_o1``
    may stand for its state."""
    if type(state) is _O1:
        state = (<_O1> state).state
    _entry.check_o1_absorb(state, rows)
    cdef _O1 st = _O1(state, None)
    cdef const float[:, :, ::1] keys__gnd = rows.keys
    cdef const float[:, :, ::1] values__gne = rows.values
    cdef float[:, ::1] scr__hm = rows.scr
    cdef Py_ssize_t row0 = rows.row0, n = rows.n
    cdef int n_threads = rows.n_threads
    cdef Py_ssize_t H = st.q_tilde__hmd.shape[0], m = st.o.m, d = st.o.d
    cdef Py_ssize_t G = keys__gnd.shape[0], nrows = keys__gnd.shape[1]
    cdef Py_ssize_t dv = values__gne.shape[2], sstride = scr__hm.shape[1], hpk, h, g, i
    cdef const float *kp = _cf3(keys__gnd)
    cdef const float *vp = _cf3(values__gne)
    cdef float *sp = _f2(scr__hm)
    cdef const kvc_o1 *o = &st.o
    cdef const kvc_ops *f32 = _ops(KVC_FAM_F32)
    if H == 0 or m == 0 or n <= 0:
        return
    hpk = H // G
    for h in prange(H, nogil=True, num_threads=n_threads, schedule="static",
                    use_threads_if=n * m * (d + dv) > _PAR_WORK):
        g = h // hpk
        for i in range(row0, row0 + n):
            f32.o1_absorb(o, h, kp + (g * nrows + i) * d, vp + (g * nrows + i) * dv,
                          sp + h * sstride)


def o1_step(state, step):
    """One decode step of every head of a sealed layer.

    ``state``: a kvcache._entry.O1State; ``step``: a kvcache._entry.O1Step.  When
    ``step.absorb``, head h first absorbs window row ``slot`` of its group (the key leaving a
    full ring) into its far field.  The output then reads the sinks and window rows
    [0, win_len) in slot order, row ``slot`` taken from (k_new, v_new) -- the caller counts
    the new row in win_len -- plus the far field when ``use_far``.  Finally the new rows are
    written into the ring at ``slot``.  scr: (H, >= sink_len + win_len + 3 m) scratch.
    ``state`` may be its binding (``bind_o1``): a decode loop binds once and each step is
    then checked against the binding alone.  Checked by kvcache._entry (check_o1_state when
    not bound, check_o1_call)."""
    cdef _O1 st = state if type(state) is _O1 else bind_o1(state)
    if not st.accept(step):
        _entry.check_o1_call(st.shape, step)
        st.step(_fields(step, _STEP, _STEP_FIELDS))
    cdef const kvc_o1 *o = &st.o
    cdef Py_ssize_t H = st.q__hd.shape[0], G = st.k_new__gd.shape[0], h, g
    cdef Py_ssize_t d = o.d, dv = o.dv, cap = o.cap, slot = o.slot
    cdef int n_threads = st.n_threads
    cdef const kvc_ops *f32 = _ops(KVC_FAM_F32)
    for h in prange(H, nogil=True, num_threads=n_threads, schedule="static",
                    use_threads_if=H > 1 and H * (o.ns + o.win_len + o.m) * (d + dv) > _PAR_WORK):
        f32.o1_step_head(o, h)
    with nogil:
        for g in range(G):
            memcpy(o.win_k + (g * cap + slot) * d, o.k_new + g * d, d * sizeof(float))
            memcpy(o.win_v + (g * cap + slot) * dv, o.v_new + g * dv, dv * sizeof(float))


# ---------------------------------------------------------------------------------------------
# Absorbed MLA decode (DeepSeek-V2 Multi-head Latent Attention).  Inner loops and their
# summation orders: _mla.h.

# partial accumulators of one call stay under this many bytes (a causal block of positions is
# processed in groups that fit)
cdef Py_ssize_t _MLA_PART_BYTES = 64 * 1024 * 1024


def fma_probe(long iters, int n_threads):
    """Run ``iters`` x 160 float32 fused multiply-adds (10 chains of 16 lanes) on each of
    ``n_threads`` threads (the benchmark times it to get the machine's peak FMA rate).
    Returns a checksum."""
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
    return _ops(KVC_FAM_MLA).mla_path().decode()


def mla_task_rows(Py_ssize_t T):
    """Rows per task for a cache of T rows: 256 * ceil(T / 8192), so at most ~32 tasks per
    position.  A function of T only, which keeps results independent of the thread count."""
    return _mla_task_rows(T)


cdef inline Py_ssize_t _mla_task_rows(Py_ssize_t T) noexcept:
    if T <= 0:
        return 256
    return 256 * ((T + 8191) // 8192)


def mla_attend(call):
    """Absorbed MLA attention of n query positions over the first T cached rows.

    ``call``: a kvcache._entry.MlaCall: qn (n, H, dn) and qr (n, H, dr) the no-RoPE and RoPE
    parts of the queries; lat (T, r) and kr (T, dr) the cached latents and shared RoPE keys;
    wuk (H, dn, r) and wuv (H, dv, r) the two halves of kv_b_proj.  Position i (0-based)
    attends causally to rows [0, T - n + i + 1).  Writes out (n, H, dv).  Checked by
    kvcache._entry.check_mla_attend before any nogil code runs."""
    _entry.check_mla_attend(call)
    cdef const float[:, :, ::1] qn__nhk = call.qn
    cdef const float[:, :, ::1] qr__nhe = call.qr
    cdef const float[:, ::1] lat__tr = call.lat
    cdef const float[:, ::1] kr__te = call.kr
    cdef const float[:, :, ::1] wuk__hkr = call.wuk
    cdef const float[:, :, ::1] wuv__hjr = call.wuv
    cdef float[:, :, ::1] out__nhj = call.out
    cdef float scale = call.scale
    cdef int n_threads = call.n_threads
    cdef Py_ssize_t n = qn__nhk.shape[0], H = qn__nhk.shape[1], dn = qn__nhk.shape[2]
    cdef Py_ssize_t T = lat__tr.shape[0], r = lat__tr.shape[1], dr = kr__te.shape[1]
    cdef Py_ssize_t dv = wuv__hjr.shape[1]
    cdef Py_ssize_t Hp, R, NT, G, g0, ng, task, tid, x, n_qT, n_qa, n_acc, n_ml, n_s
    cdef kvc_mla a
    cdef const kvc_mla *ap = &a
    cdef float *scratch
    cdef float *sbuf
    if n == 0 or H == 0:
        return
    Hp = (H + 7) // 8 * 8
    R = _mla_task_rows(T)
    NT = (T + R - 1) // R
    G = max(1, min(n, _MLA_PART_BYTES // max(1, NT * H * r * 4)))
    # the call's scratch, one C block: per position of a group its folded query qT, per
    # (position, head) qa and the merged latent c, per task the partials acc, m and l, per
    # thread a block of scores
    n_qT = G * (r + dr) * Hp
    n_qa = G * H * r
    n_acc = G * NT * H * r
    n_ml = G * NT * Hp
    n_s = KVC_MLA_BLOCK * Hp
    scratch = <float *> malloc((n_qT + 2 * n_qa + n_acc + 2 * n_ml + n_threads * n_s)
                               * sizeof(float))
    if scratch == NULL:
        raise MemoryError()
    cdef bint par_scores = T * H * (r + dr) > _PAR_WORK
    cdef bint par_heads = H > 1 and H * (dn + dv) * r > _PAR_WORK
    cdef const kvc_ops *mla = _ops(KVC_FAM_MLA)            # the family's body, once per call
    a.qn = &qn__nhk[0, 0, 0] if dn > 0 else &lat__tr[0, 0]
    a.qr = &qr__nhe[0, 0, 0] if dr > 0 else NULL
    a.lat = &lat__tr[0, 0]
    a.kr = &kr__te[0, 0] if dr > 0 else &lat__tr[0, 0]
    a.wuk = &wuk__hkr[0, 0, 0] if dn > 0 else NULL
    a.wuv = &wuv__hjr[0, 0, 0]
    a.n = n
    a.T = T
    a.H = H
    a.Hp = Hp
    a.dn = dn
    a.dr = dr
    a.r = r
    a.dv = dv
    a.scale = scale
    a.out = &out__nhj[0, 0, 0]
    a.R = R
    a.NT = NT
    a.qT = scratch
    a.qa = a.qT + n_qT
    a.c = a.qa + n_qa
    a.acc = a.c + n_qa
    a.m = a.acc + n_acc
    a.l = a.m + n_ml
    sbuf = a.l + n_ml
    if Hp > H:      # the padding columns of qT are 0 (the fold writes the others)
        for x in range(G * (r + dr)):
            memset(a.qT + x * Hp + H, 0, (Hp - H) * sizeof(float))
    g0 = 0
    try:
        while g0 < n:
            a.i0 = g0
            ng = min(n, g0 + G) - g0
            for task in prange(ng * H, nogil=True, num_threads=n_threads, schedule="static",
                               use_threads_if=par_heads):
                mla.mla_fold(ap, task)
            # static: each thread takes a contiguous run of tasks, so the rows it prefetches
            # at the end of one task are the start of its next
            for task in prange(ng * NT, nogil=True, num_threads=n_threads, schedule="static",
                               use_threads_if=par_scores):
                tid = omp_get_thread_num()
                mla.mla_task(ap, task, sbuf + tid * n_s)
            for task in prange(ng * H, nogil=True, num_threads=n_threads, schedule="static",
                               use_threads_if=par_heads):
                mla.mla_merge(ap, task)
            g0 += G
    finally:
        free(scratch)
