/*
 * ssmgrad_module.c -- the CPython/NumPy glue: the extension module _ssmgrad.
 *
 * Parses and validates every argument (TypeError for dtypes, ValueError naming the argument
 * with expected vs actual shape, ValueError for ids out of range, MemoryError when memory
 * cannot be had), allocates outputs and scratch, then releases the GIL and runs the kernels
 * on nthreads threads (OpenMP when the build has it). The public, documented API is the
 * Python layer in ssmgrad/__init__.py, which passes the thread count.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define NPY_NO_DEPRECATED_API NPY_2_0_API_VERSION
#include <numpy/arrayobject.h>

#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <pthread.h>
#include <sched.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "ssmgrad.h"
#include "ssm_common.h"
#include "ssm_scan_layout.h"   /* ssm_scan_decode_into_* (internal) */
#include "ssm_glue.h"

/* ------------------------------------------------------------------ threads */


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
#endif

/* 1 when this process cannot run OpenMP teams (a child forked after a team), else 0 */
static int threads_serial_after_fork(void) {
#ifdef _OPENMP
    return atomic_load_explicit(&omp_unusable, memory_order_relaxed);
#else
    return 0;
#endif
}

/* Run fn(ctx, ith, nth) for every ith in [0, nth); then, if fn2, a barrier and fn2 likewise.
 * Every slice is computed even if OpenMP gives us a smaller team than asked for. */
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

/*
 * Scratch of the scan kernels. The buffer of the last call is kept for the next one, up to
 * WORK_CACHE_MAX bytes: training calls with the same shapes over and over, and a fresh buffer
 * of tens of MB comes from mmap with every page zeroed by the kernel on first touch (measured:
 * 5-7% of a Mamba-2-130m backward at n_t = 8192). The kernels never rely on zeroed scratch.
 *
 * The cache is one atomic pointer to a block whose first SSM_WORK_ALIGN bytes hold its size, so
 * taking it (an exchange with NULL) and putting it back (a compare-exchange from NULL) are single
 * atomic operations: correct with the GIL and without it (free-threaded Python: the module says
 * Py_MOD_GIL_NOT_USED). Two concurrent calls simply mean that one of them allocates its own.
 */
#define WORK_CACHE_MAX ((size_t) 128 << 20)

typedef struct {
    size_t bytes;     /* usable bytes after the header */
} work_header;

static _Atomic(work_header *) work_cache = NULL;

static work_header * work_header_of(void * ptr) { return (work_header *) ((char *) ptr - SSM_WORK_ALIGN); }

/* a buffer of at least `bytes` (aligned to SSM_WORK_ALIGN), or NULL; give it back with work_release */
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

/* ------------------------------------------------------------------ argument checks */

/* "(2, 3, 4)" into buf */
static void shape_str(char * buf, size_t len, int ndim, const npy_intp * dims) {
    size_t off = 0;
    off += snprintf(buf + off, len - off, "(");
    for (int i = 0; i < ndim && off < len; ++i)
        off += snprintf(buf + off, len - off, i ? ", %lld" : "%lld", (long long) dims[i]);
    if (off < len) off += snprintf(buf + off, len - off, ndim == 1 ? ",)" : ")");
}

/* Convert obj like np.asarray, require float32/float64 (the same as *typenum once set) and
 * ndim dimensions. Returns a new reference to an aligned native-byte-order array (a view
 * of obj when possible, never a modified obj), or NULL with an exception set. */
SSM_GLUE PyArrayObject * float_arg(const char * fn, const char * name, PyObject * obj, int ndim,
                                   const char * legend, int * typenum, const char ** first) {
    /* an ndarray (or subclass) is what np.asarray would return as is: no conversion call (the two
     * conversions cost about 0.1 us per argument, a tenth of a Mamba-1 decode step's glue) */
    PyArrayObject * arr;
    if (PyArray_Check(obj)) {
        Py_INCREF(obj);
        arr = (PyArrayObject *) obj;
    } else {
        arr = (PyArrayObject *) PyArray_FROM_O(obj);
        if (!arr) return NULL;
        /* a list of floats converts to float64; it takes the call's dtype when an array set it */
        const int lt = PyArray_TYPE(arr);
        if (*typenum >= 0 && lt != *typenum && (lt == NPY_FLOAT32 || lt == NPY_FLOAT64)) {
            PyArrayObject * cast = (PyArrayObject *) PyArray_FROM_OTF((PyObject *) arr, *typenum, NPY_ARRAY_FORCECAST);
            Py_DECREF(arr);
            if (!cast) return NULL;
            arr = cast;
        }
    }
    const int t = PyArray_TYPE(arr);
    if (t != NPY_FLOAT32 && t != NPY_FLOAT64) {
        PyErr_Format(PyExc_TypeError, "%s: argument '%s' must be a float32 or float64 array, got dtype %S",
                     fn, name, (PyObject *) PyArray_DESCR(arr));
        Py_DECREF(arr);
        return NULL;
    }
    if (*typenum < 0) {
        *typenum = t;
        *first = name;
    } else if (t != *typenum) {
        PyErr_Format(PyExc_TypeError,
                     "%s: argument '%s' has dtype %s but '%s' has dtype %s; all float arguments must "
                     "share one dtype", fn, name, t == NPY_FLOAT32 ? "float32" : "float64", *first,
                     *typenum == NPY_FLOAT32 ? "float32" : "float64");
        Py_DECREF(arr);
        return NULL;
    }
    if (PyArray_NDIM(arr) != ndim) {
        char got[256];
        shape_str(got, sizeof got, PyArray_NDIM(arr), PyArray_DIMS(arr));
        PyErr_Format(PyExc_ValueError, "%s: argument '%s' must be %d-D %s, got shape %s",
                     fn, name, ndim, legend, got);
        Py_DECREF(arr);
        return NULL;
    }
    /* misaligned or byte-swapped data: a private aligned copy; anything else is used in place */
    if (PyArray_ISALIGNED(arr) && PyArray_ISNBO(PyArray_DESCR(arr)->byteorder)) return arr;
    PyArrayObject * ok = (PyArrayObject *) PyArray_FROM_OTF((PyObject *) arr, t, NPY_ARRAY_ALIGNED);
    Py_DECREF(arr);
    return ok;
}

/* The call's dtype from its first float32/float64 ndarray argument (objs[i] named names[i]), so
 * that lists among the arguments convert to it (float_arg) instead of deciding it. */
static void dtype_from_arrays(PyObject * const * objs, const char * const * names, int n, int * typenum,
                              const char ** first) {
    for (int i = 0; i < n; ++i) {
        if (!objs[i] || !PyArray_Check(objs[i])) continue;
        const int t = PyArray_TYPE((PyArrayObject *) objs[i]);
        if (t == NPY_FLOAT32 || t == NPY_FLOAT64) {
            *typenum = t;
            *first = names[i];
            return;
        }
    }
}

/* Require arr's shape == expected (entries < 0 are free); message names the argument. */
SSM_GLUE int check_shape(const char * fn, const char * name, PyArrayObject * arr, const npy_intp * expected,
                         const char * legend) {
    const int nd = PyArray_NDIM(arr);
    for (int i = 0; i < nd; ++i) {
        if (expected[i] >= 0 && PyArray_DIMS(arr)[i] != expected[i]) {
            char got[256], want[256];
            npy_intp filled[NPY_MAXDIMS];
            for (int j = 0; j < nd; ++j) filled[j] = expected[j] >= 0 ? expected[j] : PyArray_DIMS(arr)[j];
            shape_str(got, sizeof got, nd, PyArray_DIMS(arr));
            shape_str(want, sizeof want, nd, filled);
            PyErr_Format(PyExc_ValueError, "%s: argument '%s' has shape %s, expected %s = %s",
                         fn, name, got, want, legend);
            return -1;
        }
    }
    return 0;
}

SSM_GLUE void elem_strides(PyArrayObject * arr, int64_t * st) {
    const npy_intp item = PyArray_ITEMSIZE(arr);
    for (int i = 0; i < PyArray_NDIM(arr); ++i) st[i] = (int64_t) (PyArray_STRIDES(arr)[i] / item);
}

/* n_seqs ids, any integer dtype, as a dense int64 copy; each in [0, n_rs). */
static PyArrayObject * ids_arg(const char * fn, PyObject * obj, npy_intp n_seqs, npy_intp n_rs) {
    PyArrayObject * arr = (PyArrayObject *) PyArray_FROM_O(obj);
    if (!arr) return NULL;
    if (!PyArray_ISINTEGER(arr) && PyArray_SIZE(arr) > 0) {
        PyErr_Format(PyExc_TypeError, "%s: argument 'ids' must be an integer array, got dtype %S",
                     fn, (PyObject *) PyArray_DESCR(arr));
        Py_DECREF(arr);
        return NULL;
    }
    if (PyArray_NDIM(arr) != 1 || PyArray_DIMS(arr)[0] != n_seqs) {
        char got[256];
        shape_str(got, sizeof got, PyArray_NDIM(arr), PyArray_DIMS(arr));
        PyErr_Format(PyExc_ValueError, "%s: argument 'ids' has shape %s, expected (%lld,) = (n_seqs,)",
                     fn, got, (long long) n_seqs);
        Py_DECREF(arr);
        return NULL;
    }
    const int is_u64 = PyArray_TYPE(arr) == NPY_ULONG || PyArray_TYPE(arr) == NPY_ULONGLONG;
    PyArrayObject * ids = (PyArrayObject *) PyArray_FROM_OTF((PyObject *) arr, NPY_INT64,
                                                             NPY_ARRAY_CARRAY_RO | NPY_ARRAY_FORCECAST);
    Py_DECREF(arr);
    if (!ids) return NULL;
    const int64_t * v = (const int64_t *) PyArray_DATA(ids);
    for (npy_intp q = 0; q < n_seqs; ++q) {
        if (v[q] < 0 || v[q] >= n_rs) {
            if (is_u64 && v[q] < 0)
                PyErr_Format(PyExc_ValueError, "%s: ids[%lld] = %llu is out of range [0, n_rs = %lld)",
                             fn, (long long) q, (unsigned long long) v[q], (long long) n_rs);
            else
                PyErr_Format(PyExc_ValueError, "%s: ids[%lld] = %lld is out of range [0, n_rs = %lld)",
                             fn, (long long) q, (long long) v[q], (long long) n_rs);
            Py_DECREF(ids);
            return NULL;
        }
    }
    return ids;
}

SSM_GLUE int threads_arg(int nthreads) {
    if (nthreads < 1) {
        PyErr_SetString(PyExc_ValueError, "nthreads must be >= 1");
        return -1;
    }
    return 0;
}

/* a * b * ... as npy_intp, or -1 with MemoryError when it does not fit */
SSM_GLUE npy_intp checked_prod(int n, ...) {
    va_list ap;
    va_start(ap, n);
    npy_intp acc = 1;
    int bad = 0;
    for (int i = 0; i < n; ++i) {
        const npy_intp f = va_arg(ap, npy_intp);
        if (__builtin_mul_overflow(acc, f, &acc)) bad = 1;
    }
    va_end(ap);
    if (bad || acc < 0) {
        PyErr_SetString(PyExc_MemoryError, "ssmgrad: array sizes overflow the address space");
        return -1;
    }
    return acc;
}

/* Below this many multiply-adds (state updates for the scan) per thread, a thread costs more than
 * it saves: waking a sleeping OpenMP thread takes tens of microseconds, and on a machine with
 * other busy processes a thread may wait milliseconds for a core while the call waits for it.
 * 2^18 is 20 us (Mamba-2 forward, compute-bound) to 260 us (one decode token, memory-bound) of
 * one core's work; measured, a Mamba-2-130m decode step (n_t = 1, 2^17.6 updates) ran no faster
 * on 2 threads than on 1. Results do not depend on it. Tests lower it (_set_min_work_per_thread)
 * to run the threaded paths at small shapes. */
#define MIN_WORK_PER_THREAD_DEFAULT (1L << 18)
static atomic_long min_work_per_thread = MIN_WORK_PER_THREAD_DEFAULT;

/* threads to use: at most one per unit of work, and none idle for lack of work */
SSM_GLUE int clamp_threads(int nthreads, int64_t units, double work) {
    const long min_work = atomic_load_explicit(&min_work_per_thread, memory_order_relaxed);
    const double by_work = min_work > 0 ? work / (double) min_work : (double) nthreads;
    int64_t n = nthreads;
    if (n > units) n = units;
    if ((double) n > by_work) n = (int64_t) by_work;
    return n < 1 ? 1 : (int) n;
}

/* ------------------------------------------------------------------ the kernels' choices
 * The scan's forms and the SIMD pass go into every call's params (ssmgrad.h; zero is automatic),
 * from these defaults: set once from the environment at import (module_exec, the one place that
 * reads SSMGRAD_SIMD, SSMGRAD_NO_AVX512, SSMGRAD_SCAN_FWD and SSMGRAD_SCAN_BACK), changed by the
 * private hooks _set_scan_fwd, _set_scan_back and _set_simd (tests, benchmarks). A call copies
 * them into its params before it releases the GIL, so its work size and its kernels see one choice. */
static const char * const form_names[] = { "auto", "recurrence", "chunked" };   /* indexed by SSM_FORM_* */
static const char * const simd_names[] = { "auto", "x86-64", "x86-64-v3", "v4-no-vec64" };   /* by SSM_SIMD_* */
#define N_FORMS ((int) (sizeof form_names / sizeof form_names[0]))
#define N_SIMDS ((int) (sizeof simd_names / sizeof simd_names[0]))
static atomic_int scan_fwd_form = SSM_FORM_AUTO;
static atomic_int scan_back_form = SSM_FORM_AUTO;
static atomic_int simd_choice = SSM_SIMD_AUTO;

SSM_GLUE int64_t glue_simd_choice(void) { return atomic_load(&simd_choice); }

/* index of name in names[0..n), or -1 */
static int name_index(const char * const * names, int n, const char * name) {
    for (int i = 0; name && i < n; ++i)
        if (!strcmp(name, names[i])) return i;
    return -1;
}

/* the defaults from the environment: unset or unknown values leave the automatic choice */
static void choices_from_env(void) {
    const int fwd = name_index(form_names, N_FORMS, getenv("SSMGRAD_SCAN_FWD"));
    const int back = name_index(form_names, N_FORMS, getenv("SSMGRAD_SCAN_BACK"));
    atomic_store(&scan_fwd_form, fwd > 0 ? fwd : SSM_FORM_AUTO);
    atomic_store(&scan_back_form, back > 0 ? back : SSM_FORM_AUTO);
    /* SSMGRAD_SIMD caps the pass ("x86-64-v4": no cap); SSMGRAD_NO_AVX512=1 keeps the AVX-512 pass
     * but runs the loops of other CPUs in it (a lower cap makes it moot) */
    const char * cap = getenv("SSMGRAD_SIMD");
    const char * no512 = getenv("SSMGRAD_NO_AVX512");
    int simd = SSM_SIMD_AUTO;
    if (cap && !strcmp(cap, "x86-64-v3")) simd = SSM_SIMD_X86_64_V3;
    else if (cap && (!strcmp(cap, "x86-64") || !strcmp(cap, "baseline"))) simd = SSM_SIMD_X86_64;
    else if (no512 && *no512 && strcmp(no512, "0") != 0) simd = SSM_SIMD_V4_NO_VEC64;
    atomic_store(&simd_choice, simd);
}

/* [lo, hi) of the bytes an array's elements occupy (lo == hi when it has none) */
static void byte_extent(PyArrayObject * a, char ** lo, char ** hi) {
    char * l = PyArray_BYTES(a), * h = PyArray_BYTES(a);
    if (PyArray_SIZE(a) == 0) {
        *lo = *hi = l;
        return;
    }
    for (int i = 0; i < PyArray_NDIM(a); ++i) {
        const npy_intp span = (PyArray_DIMS(a)[i] - 1) * PyArray_STRIDES(a)[i];
        if (span < 0) l += span;
        else h += span;
    }
    *lo = l;
    *hi = h + PyArray_ITEMSIZE(a);
}

/* A caller's `out` buffer: a writeable, aligned, C-contiguous ndarray of the result's dtype and
 * shape, sharing no byte with the arrays the kernel reads (reads[i] may be NULL). Returns a new
 * reference to it, or NULL with TypeError (not an ndarray, wrong dtype) or ValueError. */
SSM_GLUE PyArrayObject * out_arg(const char * fn, PyObject * obj, int ndim, const npy_intp * dims, int typenum,
                                 const char * legend, PyArrayObject * const * reads, const char * const * read_names,
                                 int n_reads) {
    if (!PyArray_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s: argument 'out' must be a numpy.ndarray or None, got %s",
                     fn, Py_TYPE(obj)->tp_name);
        return NULL;
    }
    PyArrayObject * out = (PyArrayObject *) obj;
    if (PyArray_TYPE(out) != typenum || !PyArray_ISNBO(PyArray_DESCR(out)->byteorder)) {
        PyErr_Format(PyExc_TypeError, "%s: argument 'out' must have the inputs' dtype %s (native byte order), "
                     "got dtype %S", fn, typenum == NPY_FLOAT32 ? "float32" : "float64",
                     (PyObject *) PyArray_DESCR(out));
        return NULL;
    }
    if (PyArray_NDIM(out) != ndim) {
        char got[256], want[256];
        shape_str(got, sizeof got, PyArray_NDIM(out), PyArray_DIMS(out));
        shape_str(want, sizeof want, ndim, dims);
        PyErr_Format(PyExc_ValueError, "%s: argument 'out' has shape %s, expected %s = %s", fn, got, want, legend);
        return NULL;
    }
    if (check_shape(fn, "out", out, dims, legend)) return NULL;
    if (!PyArray_ISCARRAY(out)) {
        PyErr_Format(PyExc_ValueError, "%s: argument 'out' must be C-contiguous, aligned and writeable", fn);
        return NULL;
    }
    char * olo, * ohi;
    byte_extent(out, &olo, &ohi);
    for (int i = 0; i < n_reads; ++i) {
        if (!reads[i]) continue;
        char * lo, * hi;
        byte_extent(reads[i], &lo, &hi);
        if (olo < ohi && lo < hi && olo < hi && lo < ohi) {
            PyErr_Format(PyExc_ValueError, "%s: argument 'out' overlaps the memory of argument '%s'",
                         fn, read_names[i]);
            return NULL;
        }
    }
    Py_INCREF(out);
    return out;
}

/* ------------------------------------------------------------------ SSM_CONV */

typedef struct {
    ssm_conv_params p;
    int f64;
    const void * sx, * c, * grad;
    void * out, * work;
} conv_ctx;

static void conv_fwd_task(void * vc, int ith, int nth) {
    conv_ctx * k = vc;
    if (k->f64) ssm_conv_f64(&k->p, k->sx, k->c, k->out, k->work, ith, nth);
    else ssm_conv_f32(&k->p, k->sx, k->c, k->out, k->work, ith, nth);
}
static void conv_back_task(void * vc, int ith, int nth) {
    conv_ctx * k = vc;
    if (k->f64) ssm_conv_back_f64(&k->p, k->c, k->grad, k->out, k->work, ith, nth);
    else ssm_conv_back_f32(&k->p, k->c, k->grad, k->out, k->work, ith, nth);
}
static void conv_weight_task(void * vc, int ith, int nth) {
    conv_ctx * k = vc;
    if (k->f64) ssm_conv_back_weight_f64(&k->p, k->sx, k->grad, k->out, k->work, ith, nth);
    else ssm_conv_back_weight_f32(&k->p, k->sx, k->grad, k->out, k->work, ith, nth);
}

enum { CONV_FWD, CONV_BACK, CONV_WEIGHT };

static PyObject * conv_common(PyObject * args, int which) {
    static const char * names[] = { "ssm_conv", "ssm_conv_back", "ssm_conv_back_weight" };
    const char * fn = names[which];
    PyObject * sx_o, * c_o, * g_o = NULL, * out_o = Py_None;
    int nthreads = 1;
    if (which == CONV_FWD) {
        if (!PyArg_ParseTuple(args, "OOi|O", &sx_o, &c_o, &nthreads, &out_o)) return NULL;
    } else if (!PyArg_ParseTuple(args, "OOOi|O", &sx_o, &c_o, &g_o, &nthreads, &out_o)) {
        return NULL;
    }
    if (threads_arg(nthreads)) return NULL;

    PyArrayObject * sx = NULL, * c = NULL, * g = NULL, * out = NULL;
    void * work = NULL;
    int typenum = -1;
    const char * first = NULL;
    {
        PyObject * const objs[3] = { sx_o, c_o, g_o };
        static const char * const names[3] = { "sx", "c", "grad" };
        dtype_from_arrays(objs, names, 3, &typenum, &first);
    }
    sx = float_arg(fn, "sx", sx_o, 3, "(n_s, d_inner, d_conv-1+n_t)", &typenum, &first);
    if (!sx) goto error;
    c = float_arg(fn, "c", c_o, 2, "(d_inner, d_conv)", &typenum, &first);
    if (!c) goto error;
    if (g_o) {
        g = float_arg(fn, "grad", g_o, 3, "(n_s, n_t, d_inner)", &typenum, &first);
        if (!g) goto error;
    }

    const npy_intp n_s = PyArray_DIM(sx, 0), d_inner = PyArray_DIM(sx, 1), n_cols = PyArray_DIM(sx, 2);
    const npy_intp d_conv = PyArray_DIM(c, 1);
    {
        const npy_intp want_c[2] = { d_inner, -1 };
        if (check_shape(fn, "c", c, want_c, "(d_inner, d_conv) with d_inner from sx")) goto error;
    }
    if (d_conv < 1) {
        PyErr_Format(PyExc_ValueError, "%s: argument 'c' must have d_conv >= 1 columns, got shape (%lld, 0)",
                     fn, (long long) d_inner);
        goto error;
    }
    if (n_cols < d_conv - 1) {
        PyErr_Format(PyExc_ValueError,
                     "%s: argument 'sx' must have at least d_conv-1 = %lld columns (the conv state), got shape "
                     "(%lld, %lld, %lld)", fn, (long long) (d_conv - 1), (long long) n_s, (long long) d_inner,
                     (long long) n_cols);
        goto error;
    }
    const npy_intp n_t = n_cols - (d_conv - 1);
    if (g) {
        const npy_intp want_g[3] = { n_s, n_t, d_inner };
        if (check_shape(fn, "grad", g, want_g, "(n_s, n_t, d_inner), the shape of ssm_conv's output")) goto error;
    }

    conv_ctx k;
    memset(&k, 0, sizeof k);
    k.p.n_s = n_s;
    k.p.d_inner = d_inner;
    k.p.d_conv = d_conv;
    k.p.n_t = n_t;
    k.p.simd = atomic_load(&simd_choice);
    elem_strides(sx, k.p.sx_st);
    elem_strides(c, k.p.c_st);
    if (g) elem_strides(g, k.p.g_st);
    k.f64 = typenum == NPY_FLOAT64;
    k.sx = PyArray_DATA(sx);
    k.c = PyArray_DATA(c);
    k.grad = g ? PyArray_DATA(g) : NULL;

    {
        const npy_intp y_dims[3] = { n_s, n_t, d_inner };
        const int out_nd = which == CONV_WEIGHT ? 2 : 3;
        const npy_intp * out_dims = which == CONV_FWD ? y_dims : which == CONV_BACK ? PyArray_DIMS(sx) : PyArray_DIMS(c);
        if (out_o == Py_None) {
            out = (PyArrayObject *) PyArray_EMPTY(out_nd, out_dims, typenum, 0);
        } else {
            static const char * legends[] = { "(n_s, n_t, d_inner), the shape of the result",
                                              "the shape of sx", "the shape of c" };
            PyArrayObject * reads[3] = { sx, c, g };
            static const char * read_names[3] = { "sx", "c", "grad" };
            out = out_arg(fn, out_o, out_nd, out_dims, typenum, legends[which], reads, read_names, 3);
        }
    }
    if (!out) goto error;
    k.out = PyArray_DATA(out);

    const int nth = clamp_threads(nthreads, d_inner, (double) n_s * n_t * d_inner * d_conv);
    work = work_alloc(ssm_conv_work_size(&k.p, k.f64 ? 8 : 4, nth));
    if (!work) {
        PyErr_NoMemory();
        goto error;
    }
    k.work = work;
    task_fn task = which == CONV_FWD ? conv_fwd_task : which == CONV_BACK ? conv_back_task : conv_weight_task;
    Py_BEGIN_ALLOW_THREADS
    run_threads(nth, task, NULL, &k);
    Py_END_ALLOW_THREADS

    work_release(work);
    Py_DECREF(sx);
    Py_DECREF(c);
    Py_XDECREF(g);
    return (PyObject *) out;

error:
    work_release(work);
    Py_XDECREF(sx);
    Py_XDECREF(c);
    Py_XDECREF(g);
    Py_XDECREF(out);
    return NULL;
}

static PyObject * py_ssm_conv(PyObject * self, PyObject * args) { (void) self; return conv_common(args, CONV_FWD); }
static PyObject * py_ssm_conv_back(PyObject * self, PyObject * args) { (void) self; return conv_common(args, CONV_BACK); }
static PyObject * py_ssm_conv_back_weight(PyObject * self, PyObject * args) {
    (void) self;
    return conv_common(args, CONV_WEIGHT);
}

/* ------------------------------------------------------------------ SSM_SCAN */

typedef struct {
    ssm_scan_params p;
    int f64;
    const void * s, * x, * dt, * A, * B, * C, * grad;
    const int64_t * ids;
    void * out, * d_A, * work;
} scan_ctx;

static void scan_fwd_task(void * vc, int ith, int nth) {
    scan_ctx * k = vc;
    if (k->f64) ssm_scan_f64(&k->p, k->s, k->x, k->dt, k->A, k->B, k->C, k->ids, k->out, k->work, ith, nth);
    else ssm_scan_f32(&k->p, k->s, k->x, k->dt, k->A, k->B, k->C, k->ids, k->out, k->work, ith, nth);
}
static void scan_back_task(void * vc, int ith, int nth) {
    scan_ctx * k = vc;
    if (k->f64)
        ssm_scan_back_f64(&k->p, k->s, k->x, k->dt, k->A, k->B, k->C, k->ids, k->grad, k->out, k->work, ith, nth);
    else
        ssm_scan_back_f32(&k->p, k->s, k->x, k->dt, k->A, k->B, k->C, k->ids, k->grad, k->out, k->work, ith, nth);
}
static void scan_reduce_task(void * vc, int ith, int nth) {
    scan_ctx * k = vc;
    if (k->f64) ssm_scan_back_reduce_f64(&k->p, k->ids, k->out, k->d_A, k->work, ith, nth);
    else ssm_scan_back_reduce_f32(&k->p, k->ids, k->out, k->d_A, k->work, ith, nth);
}

/* the scan's arguments, validated: new references in arr[0..5] (s x dt A B C) and *ids. ids_o NULL:
 * the identity, ids[q] = q, for one state row per sequence (n_rs == n_seqs, checked); *ids and k->ids
 * are then NULL, which only the decode kernels take (ssm_scan_decode_into_*) */
static int scan_args(const char * fn, PyObject * const * objs, PyObject * ids_o, long long K,
                     PyArrayObject ** arr, PyArrayObject ** ids, int * typenum, scan_ctx * k) {
    static const char * names[6] = { "s", "x", "dt", "A", "B", "C" };
    static const int ndims[6] = { 4, 4, 3, 2, 4, 4 };
    static const char * legends[6] = {
        "(n_rs, n_head, head_dim, d_state)", "(n_seqs, n_t, n_head, head_dim)", "(n_seqs, n_t, n_head)",
        "(n_head, d_state) or (n_head, 1)", "(n_seqs, n_t, n_group, d_state)", "(n_seqs, n_t, n_group, d_state)",
    };
    const char * first = NULL;
    dtype_from_arrays(objs, names, 6, typenum, &first);
    for (int i = 0; i < 6; ++i) {
        arr[i] = float_arg(fn, names[i], objs[i], ndims[i], legends[i], typenum, &first);
        if (!arr[i]) return -1;
    }
    const npy_intp n_rs = PyArray_DIM(arr[0], 0), n_head = PyArray_DIM(arr[0], 1);
    const npy_intp head_dim = PyArray_DIM(arr[0], 2), d_state = PyArray_DIM(arr[0], 3);
    const npy_intp n_seqs = PyArray_DIM(arr[1], 0), n_t = PyArray_DIM(arr[1], 1);
    if (!ids_o && n_rs != n_seqs) {
        PyErr_Format(PyExc_ValueError, "%s: s must hold one state per sequence: s has %lld rows, x has %lld sequences",
                     fn, (long long) n_rs, (long long) n_seqs);
        return -1;
    }
    const npy_intp n_group = PyArray_DIM(arr[4], 2);
    {
        const npy_intp want_x[4] = { -1, -1, n_head, head_dim };
        if (check_shape(fn, "x", arr[1], want_x, "(n_seqs, n_t, n_head, head_dim) with n_head, head_dim from s"))
            return -1;
        const npy_intp want_dt[3] = { n_seqs, n_t, n_head };
        if (check_shape(fn, "dt", arr[2], want_dt, "(n_seqs, n_t, n_head)")) return -1;
        const npy_intp A1 = PyArray_DIM(arr[3], 1);
        const npy_intp want_A[2] = { n_head, A1 == 1 ? 1 : d_state };
        if (check_shape(fn, "A", arr[3], want_A, "(n_head, d_state) for Mamba-1 or (n_head, 1) for Mamba-2"))
            return -1;
        const npy_intp want_B[4] = { n_seqs, n_t, -1, d_state };
        if (check_shape(fn, "B", arr[4], want_B, "(n_seqs, n_t, n_group, d_state)")) return -1;
        const npy_intp want_C[4] = { n_seqs, n_t, n_group, d_state };
        if (check_shape(fn, "C", arr[5], want_C, "(n_seqs, n_t, n_group, d_state), the shape of B")) return -1;
    }
    if (n_group < 1 || n_head % n_group != 0) {
        PyErr_Format(PyExc_ValueError,
                     "%s: argument 'B' has n_group = %lld (its axis 2), which must be >= 1 and divide n_head = %lld",
                     fn, (long long) n_group, (long long) n_head);
        return -1;
    }
    const int a_per_state = PyArray_DIM(arr[3], 1) != 1;
    if (K < 1) {
        PyErr_Format(PyExc_ValueError, "%s: K must be >= 1, got %lld", fn, K);
        return -1;
    }
    if (K > 1 && a_per_state) {
        PyErr_Format(PyExc_ValueError,
                     "%s: K = %lld > 1 needs the Mamba-2 form of A, shape (n_head, 1), as in ggml; got A of shape "
                     "(%lld, %lld)", fn, K, (long long) n_head, (long long) d_state);
        return -1;
    }
    *ids = NULL;
    if (ids_o) {
        *ids = ids_arg(fn, ids_o, n_seqs, n_rs);
        if (!*ids) return -1;
    }

    /* every size the kernels derive must fit, with room (work buffers, K slots) */
    const double est = ((double) n_seqs + 1) * ((double) n_t + 1) * ((double) n_head + 1) *
                       ((double) head_dim + 1) * ((double) d_state + 1) * ((double) K) * 64.0;
    if (est > 4e18) {
        PyErr_Format(PyExc_MemoryError, "%s: sizes too large to compute (n_seqs=%lld, n_t=%lld, n_head=%lld, "
                     "head_dim=%lld, d_state=%lld, K=%lld)", fn, (long long) n_seqs, (long long) n_t,
                     (long long) n_head, (long long) head_dim, (long long) d_state, K);
        return -1;
    }

    memset(k, 0, sizeof *k);
    ssm_scan_params * p = &k->p;
    p->n_rs = n_rs;
    p->n_head = n_head;
    p->head_dim = head_dim;
    p->d_state = d_state;
    p->n_group = n_group;
    p->n_t = n_t;
    p->n_seqs = n_seqs;
    p->a_per_state = a_per_state;
    p->K = K;
    p->fwd_form = atomic_load(&scan_fwd_form);
    p->back_form = atomic_load(&scan_back_form);
    p->simd = atomic_load(&simd_choice);
    elem_strides(arr[0], p->s_st);
    elem_strides(arr[1], p->x_st);
    elem_strides(arr[2], p->dt_st);
    elem_strides(arr[3], p->A_st);
    elem_strides(arr[4], p->B_st);
    elem_strides(arr[5], p->C_st);
    k->f64 = *typenum == NPY_FLOAT64;
    k->s = PyArray_DATA(arr[0]);
    k->x = PyArray_DATA(arr[1]);
    k->dt = PyArray_DATA(arr[2]);
    k->A = PyArray_DATA(arr[3]);
    k->B = PyArray_DATA(arr[4]);
    k->C = PyArray_DATA(arr[5]);
    k->ids = *ids ? (const int64_t *) PyArray_DATA(*ids) : NULL;
    return 0;
}

/* One call of a scan entry point: its arguments, parsed and validated by scan_call_parse */
typedef struct {
    long long K;
    int return_dA, nthreads;
    PyObject * grad;                 /* borrowed, for the entry points that take one */
    PyArrayObject * arr[6], * ids;   /* new references: s x dt A B C, and ids as int64 */
    int typenum;
    scan_ctx k;
} scan_call;

/* the arguments after (s, x, dt, A, B, C, ids) an entry point takes, in this order */
enum { SCAN_ARG_GRAD = 1, SCAN_ARG_K = 2, SCAN_ARG_RETURN_DA = 4, SCAN_ARG_THREADS = 8,
       SCAN_ARG_IDS_NONE = 16 /* ids may be None: the identity (scan_args' ids_o NULL) */ };

static void scan_call_release(scan_call * c) {
    for (int i = 0; i < 6; ++i) Py_CLEAR(c->arr[i]);
    Py_CLEAR(c->ids);
}

/* The one parser of the scan entry points' positional arguments: s, x, dt, A, B, C, ids, then
 * those of grad, K, return_dA, nthreads that `takes` names (K is 1 where it is not taken), then
 * validated by scan_args. On error: -1 with the exception set and nothing held. */
static int scan_call_parse(const char * fn, PyObject * args, int takes, scan_call * c) {
    memset(c, 0, sizeof *c);
    c->K = 1;
    c->typenum = -1;
    const Py_ssize_t want = 7 + !!(takes & SCAN_ARG_GRAD) + !!(takes & SCAN_ARG_K) + !!(takes & SCAN_ARG_RETURN_DA)
                            + !!(takes & SCAN_ARG_THREADS);
    if (PyTuple_GET_SIZE(args) != want) {
        PyErr_Format(PyExc_TypeError, "%s() takes exactly %zd arguments (%zd given)", fn, want, PyTuple_GET_SIZE(args));
        return -1;
    }
    PyObject * objs[6];
    for (int i = 0; i < 6; ++i) objs[i] = PyTuple_GET_ITEM(args, i);
    Py_ssize_t at = 7;
    if (takes & SCAN_ARG_GRAD) c->grad = PyTuple_GET_ITEM(args, at++);
    if ((takes & SCAN_ARG_K) && !PyArg_Parse(PyTuple_GET_ITEM(args, at++), "L", &c->K)) return -1;
    if ((takes & SCAN_ARG_RETURN_DA) && !PyArg_Parse(PyTuple_GET_ITEM(args, at++), "p", &c->return_dA)) return -1;
    if (takes & SCAN_ARG_THREADS) {
        if (!PyArg_Parse(PyTuple_GET_ITEM(args, at++), "i", &c->nthreads)) return -1;
        if (threads_arg(c->nthreads)) return -1;
    }
    PyObject * ids_o = PyTuple_GET_ITEM(args, 6);
    if ((takes & SCAN_ARG_IDS_NONE) && ids_o == Py_None) ids_o = NULL;
    if (scan_args(fn, objs, ids_o, c->K, c->arr, &c->ids, &c->typenum, &c->k)) {
        scan_call_release(c);
        return -1;
    }
    return 0;
}

/* elements of out: N_y + K * N_s, or -1 with MemoryError */
static npy_intp scan_out_size(const ssm_scan_params * p) {
    const npy_intp n_y = checked_prod(4, (npy_intp) p->n_seqs, (npy_intp) p->n_t, (npy_intp) p->n_head,
                                      (npy_intp) p->head_dim);
    if (n_y < 0) return -1;
    const npy_intp n_s = checked_prod(5, (npy_intp) p->K, (npy_intp) p->n_seqs, (npy_intp) p->n_head,
                                      (npy_intp) p->head_dim, (npy_intp) p->d_state);
    if (n_s < 0) return -1;
    if (n_y > NPY_MAX_INTP - n_s) {
        PyErr_SetString(PyExc_MemoryError, "ssmgrad: array sizes overflow the address space");
        return -1;
    }
    return n_y + n_s;
}


/* state updates of one scan */
static double scan_work(const ssm_scan_params * p) {
    return (double) p->n_seqs * p->n_t * p->n_head * p->head_dim * (p->d_state > 0 ? p->d_state : 1);
}

static PyObject * py_ssm_scan(PyObject * self, PyObject * args) {
    (void) self;
    scan_call c;
    if (scan_call_parse("ssm_scan", args, SCAN_ARG_K | SCAN_ARG_THREADS, &c)) return NULL;
    scan_ctx k = c.k;
    PyArrayObject * out = NULL;
    PyObject * result = NULL;
    void * work = NULL;

    const npy_intp n_out = scan_out_size(&k.p);
    if (n_out < 0) goto error;
    out = (PyArrayObject *) PyArray_EMPTY(1, &n_out, c.typenum, 0);
    if (!out) goto error;

    const int nth = clamp_threads(c.nthreads, k.p.n_seqs * k.p.n_head, scan_work(&k.p));
    work = work_alloc(ssm_scan_work_size(&k.p, k.f64 ? 8 : 4, nth));
    if (!work) {
        PyErr_NoMemory();
        goto error;
    }
    k.out = PyArray_DATA(out);
    k.work = work;
    Py_BEGIN_ALLOW_THREADS
    run_threads(nth, scan_fwd_task, NULL, &k);
    Py_END_ALLOW_THREADS
    result = (PyObject *) out;
    out = NULL;

error:   /* and the way out on success: result holds the reference to return */
    work_release(work);
    scan_call_release(&c);
    Py_XDECREF(out);
    return result;
}

static PyObject * py_ssm_scan_back(PyObject * self, PyObject * args) {
    (void) self;
    const char * fn = "ssm_scan_back";
    scan_call c;
    if (scan_call_parse(fn, args, SCAN_ARG_GRAD | SCAN_ARG_K | SCAN_ARG_RETURN_DA | SCAN_ARG_THREADS, &c)) return NULL;
    scan_ctx k = c.k;
    PyArrayObject ** arr = c.arr, * g = NULL, * gin = NULL, * dA = NULL;
    PyObject * result = NULL;
    int typenum = c.typenum;
    void * work = NULL;

    const npy_intp n_out = scan_out_size(&k.p);
    if (n_out < 0) goto error;
    {
        const char * first = "s";
        g = float_arg(fn, "grad", c.grad, 1, "(N_y + K*N_s,), the packed gradient of ssm_scan's output", &typenum,
                      &first);
        if (!g) goto error;
        if (PyArray_DIM(g, 0) != n_out) {    /* say what N_y, N_s and K are: K is easy to forget */
            const long long n_y = PyArray_SIZE(arr[1]), n_s = (n_out - n_y) / (k.p.K > 0 ? k.p.K : 1);
            const long long got = PyArray_DIM(g, 0);
            char fits[96] = "";
            if (n_s > 0 && got > n_y && (got - n_y) % n_s == 0)
                snprintf(fits, sizeof fits, "; a grad of %lld elements fits K = %lld", got, (got - n_y) / n_s);
            PyErr_Format(PyExc_ValueError,
                         "%s: argument 'grad' has shape (%lld,), expected (%lld,) = (N_y + K*N_s,), the size of "
                         "ssm_scan's packed output, with N_y = x.size = %lld (y), N_s = n_seqs*n_head*head_dim*d_state "
                         "= %lld (one state slot) and K = %lld (K defaults to 1: pass the K given to ssm_scan)%s",
                         fn, got, (long long) n_out, n_y, n_s, (long long) k.p.K, fits);
            goto error;
        }
        /* the kernel reads grad densely: a strided 1-D grad (autograd's expanded ones) is packed */
        PyArrayObject * dense = PyArray_GETCONTIGUOUS(g);
        Py_DECREF(g);
        g = dense;
        if (!g) goto error;
    }
    /* gin = s.size + x.size + dt.size + B.size + C.size, each of which numpy already holds */
    npy_intp n_gin = 0;
    const int parts[5] = { 0, 1, 2, 4, 5 };
    for (int i = 0; i < 5; ++i) {
        if (__builtin_add_overflow(n_gin, PyArray_SIZE(arr[parts[i]]), &n_gin)) {
            PyErr_SetString(PyExc_MemoryError, "ssmgrad: array sizes overflow the address space");
            goto error;
        }
    }
    gin = (PyArrayObject *) PyArray_EMPTY(1, &n_gin, typenum, 0);
    if (!gin) goto error;
    if (c.return_dA) {
        dA = (PyArrayObject *) PyArray_EMPTY(2, PyArray_DIMS(arr[3]), typenum, 0);
        if (!dA) goto error;
    }

    const int64_t units = ssm_scan_back_units(&k.p);
    const int nth = clamp_threads(c.nthreads, units > k.p.n_rs * k.p.n_head ? units : k.p.n_rs * k.p.n_head,
                                  3.0 * scan_work(&k.p));
    work = work_alloc(ssm_scan_back_work_size(&k.p, k.f64 ? 8 : 4, nth));
    if (!work) {
        PyErr_NoMemory();
        goto error;
    }
    k.grad = PyArray_DATA(g);
    k.out = PyArray_DATA(gin);
    k.d_A = dA ? PyArray_DATA(dA) : NULL;
    k.work = work;
    Py_BEGIN_ALLOW_THREADS
    run_threads(nth, scan_back_task, scan_reduce_task, &k);
    Py_END_ALLOW_THREADS
    if (dA) {
        result = PyTuple_Pack(2, (PyObject *) gin, (PyObject *) dA);
    } else {
        result = (PyObject *) gin;
        gin = NULL;
    }

error:   /* and the way out on success: result holds the reference to return */
    work_release(work);
    scan_call_release(&c);
    Py_XDECREF(g);
    Py_XDECREF(gin);
    Py_XDECREF(dA);
    return result;
}

/* ------------------------------------------------------------------ test hooks */

/* _scratch_stress(nthreads, rounds): nthreads POSIX threads (no GIL, no OpenMP) take and give back
 * the scan scratch cache `rounds` times each, with sizes that vary so that the cached block is
 * both reused and replaced. Each holder stamps its buffer with its thread id, yields, and checks
 * the stamps are still its own: returns how many times a buffer was found held by two threads at
 * once (0 when the cache is guarded), or raises MemoryError. Free-threaded Python reaches
 * work_alloc from many threads at once exactly like this. */
typedef struct {
    int tid, rounds;
    long clashes, failures;
} stress_arg;

static void * stress_main(void * va) {
    stress_arg * a = va;
    static const size_t sizes[3] = { 4096, 3 * 4096, 64 };
    for (int r = 0; r < a->rounds; ++r) {
        const size_t n = sizes[(a->tid + r) % 3];
        volatile uint64_t * w = work_alloc(n);
        if (!w) {
            a->failures++;
            continue;
        }
        const size_t last = n / sizeof(uint64_t) - 1;
        const uint64_t stamp = ((uint64_t) a->tid << 32) | (uint64_t) r;
        w[0] = stamp;
        w[last] = stamp;
        for (int y = 0; y < 3; ++y) {
            if (w[0] != stamp || w[last] != stamp) break;
            if (y == 1) sched_yield();
        }
        if (w[0] != stamp || w[last] != stamp) a->clashes++;
        work_release((void *) w);
    }
    return NULL;
}

static PyObject * py_scratch_stress(PyObject * self, PyObject * args) {
    (void) self;
    int nthreads, rounds;
    if (!PyArg_ParseTuple(args, "ii", &nthreads, &rounds)) return NULL;
    if (nthreads < 1 || nthreads > 64 || rounds < 0) {
        PyErr_SetString(PyExc_ValueError, "_scratch_stress: 1 <= nthreads <= 64, rounds >= 0");
        return NULL;
    }
    stress_arg a[64];
    pthread_t th[64];
    int started = 0, err = 0;
    Py_BEGIN_ALLOW_THREADS
    for (int i = 0; i < nthreads; ++i) {
        a[i] = (stress_arg) { .tid = i, .rounds = rounds };
        if (pthread_create(&th[i], NULL, stress_main, &a[i]) != 0) {
            err = 1;
            break;
        }
        started++;
    }
    for (int i = 0; i < started; ++i) pthread_join(th[i], NULL);
    Py_END_ALLOW_THREADS
    long clashes = 0, failures = 0;
    for (int i = 0; i < started; ++i) {
        clashes += a[i].clashes;
        failures += a[i].failures;
    }
    if (err) {
        PyErr_SetString(PyExc_OSError, "_scratch_stress: pthread_create failed");
        return NULL;
    }
    if (failures) return PyErr_NoMemory();
    return PyLong_FromLong(clashes);
}

/* _set_min_work_per_thread(n): the work per thread below which calls use fewer threads (0: one
 * thread per unit of work, whatever the size); returns the previous value. For tests, which run
 * the threaded paths at small shapes this way. */
static PyObject * py_set_min_work_per_thread(PyObject * self, PyObject * args) {
    (void) self;
    long n;
    if (!PyArg_ParseTuple(args, "l", &n)) return NULL;
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "_set_min_work_per_thread: n must be >= 0");
        return NULL;
    }
    return PyLong_FromLong(atomic_exchange(&min_work_per_thread, n));
}

static void scan_decode_into_task(void * vc, int ith, int nth) {
    scan_ctx * k = vc;
    void * st = (void *) k->s;       /* the state rows are updated in place */
    if (k->f64) ssm_scan_decode_into_f64(&k->p, k->s, k->x, k->dt, k->A, k->B, k->C, k->ids, k->out, st, ith, nth);
    else ssm_scan_decode_into_f32(&k->p, k->s, k->x, k->dt, k->A, k->B, k->C, k->ids, k->out, st, ith, nth);
}

/*
 * _ssm_scan_update(s, x, dt, A, B, C, ids, nthreads): ssm_scan with K = 1 whose final states are
 * written over s itself, returning y (n_seqs, n_t, n_head, head_dim): the in-place update of a
 * generation cache (ssmgrad.ssm_scan_update), without a fresh state and a copy back. Private, and
 * the one function that writes an input. Only where the forward takes its decode path, s is a
 * C-contiguous writable float array used as is, n_rs = n_seqs, ids[q] = q, and no other input
 * shares memory with s; otherwise it returns None and changes nothing (the caller then takes
 * ssm_scan). Arguments are validated as by ssm_scan (the same errors).
 *
 * ids None is ssmgrad.ssm_scan_update's own call, with that function's checks and messages: s must
 * be a writeable 4-D ndarray with one row per sequence (TypeError / ValueError naming s), and the
 * identity ids are implied, never built (the decode kernel takes row q for sequence q).
 */
static PyObject * py_ssm_scan_update(PyObject * self, PyObject * args) {
    (void) self;
    const int public_call = PyTuple_GET_SIZE(args) == 8 && PyTuple_GET_ITEM(args, 6) == Py_None;
    const char * fn = public_call ? "ssm_scan_update" : "_ssm_scan_update";
    if (public_call) {
        PyObject * s_o = PyTuple_GET_ITEM(args, 0);
        if (!PyArray_Check(s_o)) {
            PyErr_Format(PyExc_TypeError, "%s: s must be a NumPy array (it is updated in place), got %s", fn,
                         Py_TYPE(s_o)->tp_name);
            return NULL;
        }
        if (!PyArray_ISWRITEABLE((PyArrayObject *) s_o)) {
            PyErr_Format(PyExc_ValueError, "%s: s must be writeable (it is updated in place)", fn);
            return NULL;
        }
        if (PyArray_NDIM((PyArrayObject *) s_o) != 4) {
            char got[256];
            shape_str(got, sizeof got, PyArray_NDIM((PyArrayObject *) s_o), PyArray_DIMS((PyArrayObject *) s_o));
            PyErr_Format(PyExc_ValueError, "%s: s must be 4-D (n_seqs, n_head, head_dim, d_state), got shape %s",
                         fn, got);
            return NULL;
        }
    }
    scan_call c;
    if (scan_call_parse(fn, args, SCAN_ARG_THREADS | SCAN_ARG_IDS_NONE, &c)) return NULL;
    scan_ctx k = c.k;
    PyArrayObject ** arr = c.arr, * y = NULL;
    PyObject * result = NULL;
    int ok = (PyObject *) arr[0] == PyTuple_GET_ITEM(args, 0) && PyArray_ISCARRAY(arr[0]) && k.p.n_rs == k.p.n_seqs
             && ssm_scan_work_size(&k.p, k.f64 ? 8 : 4, 1) == 0;
    for (int64_t q = 0; ok && k.ids && q < k.p.n_seqs; ++q) ok = k.ids[q] == q;
    if (ok) {
        char * slo, * shi;
        byte_extent(arr[0], &slo, &shi);
        for (int i = 1; ok && i < 6; ++i) {
            char * lo, * hi;
            byte_extent(arr[i], &lo, &hi);
            ok = lo == hi || hi <= slo || lo >= shi;
        }
    }
    if (!ok) {
        result = Py_None;
        Py_INCREF(result);
        goto error;
    }
    const npy_intp dims[4] = { (npy_intp) k.p.n_seqs, (npy_intp) k.p.n_t, (npy_intp) k.p.n_head,
                               (npy_intp) k.p.head_dim };
    y = (PyArrayObject *) PyArray_EMPTY(4, dims, c.typenum, 0);
    if (!y) goto error;
    k.out = PyArray_DATA(y);
    const int nth = clamp_threads(c.nthreads, k.p.n_seqs * k.p.n_head, scan_work(&k.p));
    Py_BEGIN_ALLOW_THREADS
    run_threads(nth, scan_decode_into_task, NULL, &k);   /* nth 1 (a decode step's size): no team */
    Py_END_ALLOW_THREADS
    result = (PyObject *) y;
    y = NULL;

error:   /* and the way out otherwise */
    scan_call_release(&c);
    Py_XDECREF(y);
    return result;
}

/* _scan_work_bytes(s, x, dt, A, B, C, ids, K, nthreads): the scratch ssm_scan_work_size asks for these
 * arguments (validated as by ssm_scan); 0 means the forward takes its decode path (ssm_scan_decode.c), which
 * the tests check so that a change cannot turn that path off unnoticed. */
static PyObject * py_scan_work_bytes(PyObject * self, PyObject * args) {
    (void) self;
    scan_call c;
    if (scan_call_parse("_scan_work_bytes", args, SCAN_ARG_K | SCAN_ARG_THREADS, &c)) return NULL;
    PyObject * result = PyLong_FromSize_t(ssm_scan_work_size(&c.k.p, c.k.f64 ? 8 : 4, c.nthreads));
    scan_call_release(&c);
    return result;
}

/* _scan_forms(s, x, dt, A, B, C, ids, K): which form each kernel takes for these arguments under
 * the current modes, and how the backward cuts the work: {"fwd": "chunked" | "recurrence",
 * "back": likewise, "back_units": units of phase 1} (for benchmarks, which count the FLOP of the form used) */
static PyObject * py_scan_forms(PyObject * self, PyObject * args) {
    (void) self;
    scan_call c;
    if (scan_call_parse("_scan_forms", args, SCAN_ARG_K, &c)) return NULL;
    const ssm_scan_params * p = &c.k.p;
    PyObject * result = Py_BuildValue("{s:s,s:s,s:L}",
                                      "fwd", form_names[ssm_scan_fwd_chunked(p) ? SSM_FORM_CHUNKED : SSM_FORM_RECURRENCE],
                                      "back", form_names[ssm_scan_back_chunked(p) ? SSM_FORM_CHUNKED : SSM_FORM_RECURRENCE],
                                      "back_units", (long long) ssm_scan_back_units(p));
    scan_call_release(&c);
    return result;
}

/* _serial_after_fork(): True in a child forked after this process ran an OpenMP team, where every
 * call runs its thread slices serially (see run_threads) */
static PyObject * py_serial_after_fork(PyObject * self, PyObject * noargs) {
    (void) self;
    (void) noargs;
    return PyBool_FromLong(threads_serial_after_fork());
}

/* _vmath(name, a): the kernels' own exp / exp_fast / softplus / softplus_in / dsoftplus / dsoftplus_in
 * applied to a float32 or float64 array (a new dense array), so that the tests can hold them to
 * their stated error against libm; the _fast and _in variants only where the kernels use them
 * (NaN elsewhere) */
static PyObject * py_vmath(PyObject * self, PyObject * args) {
    (void) self;
    const char * name;
    PyObject * obj;
    if (!PyArg_ParseTuple(args, "sO", &name, &obj)) return NULL;
    const int is_exp = strcmp(name, "exp") == 0, is_sp = strcmp(name, "softplus") == 0;
    const int is_fast = strcmp(name, "exp_fast") == 0, is_sp_in = strcmp(name, "softplus_in") == 0;
    const int is_dsp = strcmp(name, "dsoftplus") == 0, is_dsp_in = strcmp(name, "dsoftplus_in") == 0;
    if (!is_exp && !is_sp && !is_fast && !is_sp_in && !is_dsp && !is_dsp_in) {
        PyErr_Format(PyExc_ValueError, "_vmath: unknown function '%s'", name);
        return NULL;
    }
    PyArrayObject * a = (PyArrayObject *) PyArray_FROM_OF(obj, NPY_ARRAY_CARRAY_RO);
    if (!a) return NULL;
    const int t = PyArray_TYPE(a);
    if (t != NPY_FLOAT32 && t != NPY_FLOAT64) {
        Py_DECREF(a);
        PyErr_SetString(PyExc_TypeError, "_vmath: float32 or float64 array expected");
        return NULL;
    }
    PyArrayObject * out = (PyArrayObject *) PyArray_EMPTY(PyArray_NDIM(a), PyArray_DIMS(a), t, 0);
    if (!out) {
        Py_DECREF(a);
        return NULL;
    }
    const npy_intp n = PyArray_SIZE(a);
    if (t == NPY_FLOAT32) {
        const float * in = PyArray_DATA(a);
        float * o = PyArray_DATA(out);
        for (npy_intp i = 0; i < n; ++i) {   /* exp_fast, *_in only where they apply: NaN elsewhere */
            const int in_sp = in[i] >= -SSM_EXPF_FAST_MAX;
            o[i] = is_exp ? ssm_expf(in[i]) : is_sp ? ssm_softplus_fast_f32(in[i])
                 : is_dsp ? ssm_dsoftplus_f32(in[i])
                 : is_sp_in ? (in_sp ? ssm_softplus_inrange_f32(in[i]) : NAN)
                 : is_dsp_in ? (in_sp ? ssm_dsoftplus_inrange_f32(in[i]) : NAN)
                 : (in_sp && in[i] <= SSM_EXPF_FAST_MAX) ? ssm_expf_fast(in[i]) : NAN;
        }
    } else {
        const double * in = PyArray_DATA(a);
        double * o = PyArray_DATA(out);
        for (npy_intp i = 0; i < n; ++i)
            o[i] = is_exp ? ssm_exp_f64(in[i]) : is_sp || is_sp_in ? ssm_softplus_f64(in[i])
                 : is_dsp || is_dsp_in ? ssm_dsoftplus_f64(in[i])
                 : (in[i] >= -SSM_EXP_FAST_MAX_F64 && in[i] <= SSM_EXP_FAST_MAX_F64) ? ssm_exp_fast_f64(in[i]) : NAN;
    }
    Py_DECREF(a);
    return (PyObject *) out;
}

/* ------------------------------------------------------------------ build facts */

static PyObject * py_build_info(PyObject * self, PyObject * noargs) {
    (void) self;
    (void) noargs;
#ifdef _OPENMP
    const int openmp = 1;
    const int omp_version = _OPENMP;
#else
    const int openmp = 0;
    const int omp_version = 0;
#endif
    const int simd = atomic_load(&simd_choice);
    return Py_BuildValue("{s:O,s:i,s:s,s:s,s:s,s:O,s:s,s:s}", "openmp", openmp ? Py_True : Py_False,
                         "openmp_version", omp_version, "simd_compiled", ssm_simd_compiled(),
                         "simd_selected", ssm_simd_name(simd), "simd", simd_names[simd],
                         "avx512_kernels", ssm_avx512_kernels(simd) ? Py_True : Py_False,
                         "scan_back", form_names[atomic_load(&scan_back_form)],
                         "scan_fwd", form_names[atomic_load(&scan_fwd_form)]);
}

/* _set_scan_back(name), _set_scan_fwd(name), _set_simd(name): set the default (a name of names[0..n))
 * that calls put into their params; return the previous one's name */
static PyObject * set_choice(PyObject * args, const char * fname, const char * const * names, int n,
                             atomic_int * choice) {
    const char * name;
    if (!PyArg_ParseTuple(args, "s", &name)) return NULL;
    const int v = name_index(names, n, name);
    if (v < 0) {
        char allowed[128] = "";
        for (int i = 0; i < n; ++i)
            snprintf(allowed + strlen(allowed), sizeof allowed - strlen(allowed), "%s'%s'", i ? ", " : "", names[i]);
        PyErr_Format(PyExc_ValueError, "%s: mode must be one of %s, got '%s'", fname, allowed, name);
        return NULL;
    }
    return PyUnicode_FromString(names[atomic_exchange(choice, v)]);
}

static PyObject * py_set_scan_back(PyObject * self, PyObject * args) {
    (void) self;
    return set_choice(args, "_set_scan_back", form_names, N_FORMS, &scan_back_form);
}

static PyObject * py_set_scan_fwd(PyObject * self, PyObject * args) {
    (void) self;
    return set_choice(args, "_set_scan_fwd", form_names, N_FORMS, &scan_fwd_form);
}

static PyObject * py_set_simd(PyObject * self, PyObject * args) {
    (void) self;
    return set_choice(args, "_set_simd", simd_names, N_SIMDS, &simd_choice);
}

static PyMethodDef methods[] = {
    { "ssm_conv", py_ssm_conv, METH_VARARGS, "ssm_conv(sx, c, nthreads, out=None, /)\n--\n\nSee ssmgrad.ssm_conv." },
    { "ssm_conv_back", py_ssm_conv_back, METH_VARARGS,
      "ssm_conv_back(sx, c, grad, nthreads, out=None, /)\n--\n\nSee ssmgrad.ssm_conv_back." },
    { "ssm_conv_back_weight", py_ssm_conv_back_weight, METH_VARARGS,
      "ssm_conv_back_weight(sx, c, grad, nthreads, out=None, /)\n--\n\nSee ssmgrad.ssm_conv_back_weight." },
    { "ssm_scan", py_ssm_scan, METH_VARARGS,
      "ssm_scan(s, x, dt, A, B, C, ids, K, nthreads, /)\n--\n\nSee ssmgrad.ssm_scan." },
    { "ssm_scan_back", py_ssm_scan_back, METH_VARARGS,
      "ssm_scan_back(s, x, dt, A, B, C, ids, grad, K, return_dA, nthreads, /)\n--\n\nSee ssmgrad.ssm_scan_back." },
    { "build_info", py_build_info, METH_NOARGS, "build_info()\n--\n\nOpenMP and SIMD facts of this build." },
    { "_scratch_stress", py_scratch_stress, METH_VARARGS,
      "_scratch_stress(nthreads, rounds, /)\n--\n\nHammer the scratch cache from nthreads threads (for tests)." },
    { "_set_min_work_per_thread", py_set_min_work_per_thread, METH_VARARGS,
      "_set_min_work_per_thread(n, /)\n--\n\nWork per thread below which calls use fewer threads; returns the old "
      "value (for tests)." },
    { "_ssm_scan_update", py_ssm_scan_update, METH_VARARGS,
      "_ssm_scan_update(s, x, dt, A, B, C, ids, nthreads, /)\n--\n\nssm_scan (K = 1) writing the final states over s "
      "(private; None where it does not apply)." },
    { "_scan_work_bytes", py_scan_work_bytes, METH_VARARGS,
      "_scan_work_bytes(s, x, dt, A, B, C, ids, K, nthreads, /)\n--\n\nScratch bytes of ssm_scan for these arguments "
      "(0: the decode path)." },
    { "_scan_forms", py_scan_forms, METH_VARARGS,
      "_scan_forms(s, x, dt, A, B, C, ids, K, /)\n--\n\nThe form each scan kernel takes for these arguments "
      "(for benchmarks)." },
    { "_serial_after_fork", py_serial_after_fork, METH_NOARGS,
      "_serial_after_fork()\n--\n\nTrue in a fork child that runs its calls serially (for tests)." },
    { "_set_scan_back", py_set_scan_back, METH_VARARGS,
      "_set_scan_back(mode, /)\n--\n\nForm of the Mamba-2 scan backward: 'auto', 'recurrence' or 'chunked' "
      "(SSMGRAD_SCAN_BACK); returns the previous one (for tests and benchmarks)." },
    { "_set_scan_fwd", py_set_scan_fwd, METH_VARARGS,
      "_set_scan_fwd(mode, /)\n--\n\nForm of the Mamba-2 scan forward: 'auto', 'recurrence' or 'chunked' "
      "(SSMGRAD_SCAN_FWD); returns the previous one (for tests and benchmarks)." },
    { "_set_simd", py_set_simd, METH_VARARGS,
      "_set_simd(name, /)\n--\n\nSIMD pass of the kernels: 'auto', 'x86-64', 'x86-64-v3' or 'v4-no-vec64' (a cap, "
      "as SSMGRAD_SIMD and SSMGRAD_NO_AVX512); returns the previous one (for tests)." },
    { "_vmath", py_vmath, METH_VARARGS,
      "_vmath(name, a, /)\n--\n\nThe kernels' 'exp', 'exp_fast' or 'softplus' applied to a (for tests)." },
    { NULL, NULL, 0, NULL },
};

#ifdef _OPENMP
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;
static void register_atfork(void) { pthread_atfork(NULL, NULL, after_fork_in_child); }
#endif

static int module_exec(PyObject * m) {
    if (PyArray_ImportNumPyAPI() < 0) return -1;
#ifdef _OPENMP
    pthread_once(&atfork_once, register_atfork);
    /* LLVM's libomp reads its environment at the first OpenMP call, libgomp when it is loaded:
     * make that call now, while ssmgrad/__init__.py holds OMP_WAIT_POLICY in the environment */
    (void) omp_get_max_threads();
#endif
    choices_from_env();
    return gdn_module_add(m);
}

static PyModuleDef_Slot slots[] = {
    { Py_mod_exec, module_exec },
#ifdef Py_mod_multiple_interpreters
    { Py_mod_multiple_interpreters, Py_MOD_MULTIPLE_INTERPRETERS_NOT_SUPPORTED },
#endif
#ifdef Py_mod_gil
    { Py_mod_gil, Py_MOD_GIL_NOT_USED },
#endif
    { 0, NULL },
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "_ssmgrad", "C kernels of ssmgrad (use the ssmgrad package).", 0, methods, slots,
    NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__ssmgrad(void) { return PyModuleDef_Init(&moduledef); }
