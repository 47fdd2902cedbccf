# The one OpenMP shim (after scikit-learn's _openmp_helpers.pxd): real OpenMP calls when the
# extension was built with -fopenmp, serial no-op fallbacks otherwise.

cdef extern from *:
    """
    #ifdef _OPENMP
    #include <omp.h>
    #define KVC_OPENMP_BUILT 1
    #else
    #define KVC_OPENMP_BUILT 0
    static inline int omp_get_max_threads(void) { return 1; }
    static inline int omp_get_thread_num(void) { return 0; }
    #endif
    """
    bint KVC_OPENMP_BUILT
    int omp_get_max_threads() noexcept nogil
    int omp_get_thread_num() noexcept nogil
