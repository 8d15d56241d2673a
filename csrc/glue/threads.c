/*
 * threads.c -- the thread runner of every binding: a call's (ith, nth) slices on an OpenMP team
 * (serially when the build has no OpenMP), and how many threads a call of a given size gets.
 */
#include "ssm_glue.h"

#include <pthread.h>
#include <stdatomic.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#ifdef _OPENMP
/*
 * fork: libgomp's thread pool does not survive fork(). A child forked after this process ran an
 * OpenMP team waits forever for pool threads that do not exist in it (measured: a Mamba-2 scan on
 * 2 threads in the parent, the same call in a multiprocessing 'fork' child: no return). The
 * pthread_atfork child handler below marks such a child, and run_threads then runs every slice on
 * the calling thread: the same slices in the same order, so the same bits, only serial. The flag
 * is inherited by the child's own children; nothing in the child resets it (libgomp cannot be
 * re-initialised in a process).
 */
static atomic_int omp_team_started = 0;   /* this process has run an OpenMP team */
static atomic_int omp_unusable = 0;       /* forked after a team: libgomp's pool is gone */

static void after_fork_in_child(void) {
    if (atomic_load_explicit(&omp_team_started, memory_order_relaxed))
        atomic_store_explicit(&omp_unusable, 1, memory_order_relaxed);
}

static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;
static void register_atfork(void) { pthread_atfork(NULL, NULL, after_fork_in_child); }
#endif

SSM_GLUE void threads_init(void) {
#ifdef _OPENMP
    pthread_once(&atfork_once, register_atfork);
    /* LLVM's libomp reads its environment at the first OpenMP call, libgomp when it is loaded:
     * make that call now, while ssmgrad/__init__.py holds OMP_WAIT_POLICY in the environment */
    (void) omp_get_max_threads();
#endif
}

SSM_GLUE int threads_serial_after_fork(void) {
#ifdef _OPENMP
    return atomic_load_explicit(&omp_unusable, memory_order_relaxed);
#else
    return 0;
#endif
}

/* Every slice is computed even if OpenMP gives us a smaller team than asked for. */
SSM_GLUE void run_threads(int nth, task_fn fn, task_fn fn2, void * ctx) {
#ifdef _OPENMP
    if (nth > 1 && !atomic_load_explicit(&omp_unusable, memory_order_relaxed)) {
        atomic_store_explicit(&omp_team_started, 1, memory_order_relaxed);
#pragma omp parallel num_threads(nth)
        {
            const int tid = omp_get_thread_num(), team = omp_get_num_threads();
            for (int ith = tid; ith < nth; ith += team) fn(ctx, ith, nth);
            if (fn2) {
#pragma omp barrier
                for (int ith = tid; ith < nth; ith += team) fn2(ctx, ith, nth);
            }
        }
        return;
    }
#endif
    for (int ith = 0; ith < nth; ++ith) fn(ctx, ith, nth);
    if (fn2)
        for (int ith = 0; ith < nth; ++ith) fn2(ctx, ith, nth);
}

SSM_GLUE int run_kernels(int nth, size_t work_bytes, void ** work, task_fn fn, task_fn fn2, void * ctx) {
    if (!(*work = work_alloc_or_raise(work_bytes))) return -1;
    Py_BEGIN_ALLOW_THREADS
    run_threads(nth, fn, fn2, ctx);
    Py_END_ALLOW_THREADS
    return 0;
}

/* at most one thread per unit of work, and none idle for lack of work (settings.c says why) */
SSM_GLUE int clamp_threads(int nthreads, int64_t units, double work) {
    const long min_work = glue_min_work_per_thread();
    const double by_work = min_work > 0 ? work / (double) min_work : (double) nthreads;
    int64_t n = nthreads;
    if (n > units) n = units;
    if ((double) n > by_work) n = (int64_t) by_work;
    return n < 1 ? 1 : (int) n;
}
