/*
 * scratch.c -- the kernels' scratch, handed to them by every binding (work sizes: ssmgrad.h).
 *
 * The buffer of the last call is kept for the next one, up to WORK_CACHE_MAX bytes: training calls
 * with the same shapes over and over, and a fresh buffer of tens of MB comes from mmap with every
 * page zeroed by the kernel on first touch (measured: 5-7% of a Mamba-2-130m backward at
 * n_t = 8192). The kernels never rely on zeroed scratch.
 *
 * The cache is one atomic pointer to a block whose first SSM_WORK_ALIGN bytes hold its size, so
 * taking it (an exchange with NULL) and putting it back (a compare-exchange from NULL) are single
 * atomic operations: correct with the GIL and without it (free-threaded Python: the module says
 * Py_MOD_GIL_NOT_USED). Two concurrent calls simply mean that one of them allocates its own.
 * tests/test_concurrency.py hammers it from many threads (_scratch_stress, testhooks.c).
 */
#include "ssm_glue.h"

#include <stdatomic.h>
#include <stdlib.h>

#define WORK_CACHE_MAX ((size_t) 128 << 20)

typedef struct {
    size_t bytes;     /* usable bytes after the header */
} work_header;

static _Atomic(work_header *) work_cache = NULL;

static work_header * work_header_of(void * ptr) { return (work_header *) ((char *) ptr - SSM_WORK_ALIGN); }

/* no GIL needed: _scratch_stress calls it from threads of its own */
SSM_GLUE void * work_alloc(size_t bytes) {
    size_t n = (bytes + SSM_WORK_ALIGN - 1) / SSM_WORK_ALIGN * SSM_WORK_ALIGN;
    if (n == 0) n = SSM_WORK_ALIGN;
    if (n > SIZE_MAX - SSM_WORK_ALIGN) return NULL;
    work_header * h = atomic_exchange(&work_cache, NULL);
    if (h && h->bytes >= n) return (char *) h + SSM_WORK_ALIGN;
    free(h);                      /* too small for this call: give it back first */
    void * block = NULL;
    if (posix_memalign(&block, SSM_WORK_ALIGN, SSM_WORK_ALIGN + n) != 0) return NULL;
    h = block;
    h->bytes = n;
    return (char *) block + SSM_WORK_ALIGN;
}

SSM_GLUE void work_release(void * ptr) {
    if (!ptr) return;
    work_header * h = work_header_of(ptr), * expected = NULL;
    if (h->bytes <= WORK_CACHE_MAX && atomic_compare_exchange_strong(&work_cache, &expected, h)) return;
    free(h);                      /* too big to keep, or another call's buffer is cached already */
}

/* with the GIL held (it sets the exception) */
SSM_GLUE void * work_alloc_or_raise(size_t bytes) {
    void * w = work_alloc(bytes);
    if (!w) PyErr_NoMemory();
    return w;
}
