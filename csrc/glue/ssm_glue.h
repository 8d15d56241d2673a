/*
 * ssm_glue.h -- the internal header of the CPython/NumPy glue, the files of csrc/glue/ that make the
 * extension module _ssmgrad (the only files of the project that include Python.h; ggml/build.sh
 * copies csrc/ but not csrc/glue/ into ggml, and the pure-C tests compile the kernels without it):
 *
 *   module.c     the module: its functions, its import (module_exec)
 *   threads.c    run_threads: (ith, nth) slices on OpenMP threads, serial in a child forked after a team
 *   scratch.c    the kernels' scratch: one cached aligned buffer (work_alloc / work_release)
 *   check.c      argument checks and conversions shared by every binding (the messages the API raises)
 *   settings.c   what calls put into their params (scan forms, SIMD level, work per thread), build_info
 *   conv.c       ssm_conv, ssm_conv_back, ssm_conv_back_weight
 *   scan_call.c  the scan's arguments: parsed, validated, into the kernels' params (scan_call.h)
 *   scan.c       ssm_scan, ssm_scan_back, _ssm_scan_update (the in-place decode step behind
 *                ssmgrad.ssm_scan_update); _scan_work_bytes, _scan_forms (what a call would take)
 *   gdn.c        gated_delta_net, gated_delta_net_back
 *   testhooks.c  private functions only the tests call (_scratch_stress, _serial_after_fork, _vmath)
 *
 * Every glue file includes this header first. Its functions are hidden from the module's exported
 * symbols (SSM_GLUE). NumPy's C API table is one pointer shared by the glue files
 * (PY_ARRAY_UNIQUE_SYMBOL), filled by module.c at import.
 */
#ifndef SSM_GLUE_H
#define SSM_GLUE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define NPY_NO_DEPRECATED_API NPY_2_0_API_VERSION
#define PY_ARRAY_UNIQUE_SYMBOL ssmgrad_ARRAY_API
#ifndef SSM_GLUE_IMPORTS_NUMPY   /* defined by module.c only, which imports the table */
#define NO_IMPORT_ARRAY
#endif
#include <numpy/arrayobject.h>

#include <stddef.h>
#include <stdint.h>

#include "ssmgrad.h"

#define SSM_GLUE __attribute__((visibility("hidden")))

/* ------------------------------------------------------------------ threads.c */

typedef void (*task_fn)(void * ctx, int ith, int nth);

/* fn(ctx, ith, nth) for every ith in [0, nth); then, if fn2, a barrier and fn2 likewise */
SSM_GLUE void run_threads(int nth, task_fn fn, task_fn fn2, void * ctx);
/* threads to use for `units` units of `work` multiply-adds (at least glue_min_work_per_thread() each) */
SSM_GLUE int clamp_threads(int nthreads, int64_t units, double work);
/* a binding's run: scratch of work_bytes into *work (the context's own field: give it back with
 * work_release), then fn (and fn2, as run_threads) on nth threads with the GIL released; -1 with
 * MemoryError when the scratch cannot be had */
SSM_GLUE int run_kernels(int nth, size_t work_bytes, void ** work, task_fn fn, task_fn fn2, void * ctx);
/* 1 in a child forked after this process ran an OpenMP team (its calls then run serially), else 0 */
SSM_GLUE int threads_serial_after_fork(void);
/* at import: the fork handler, and OpenMP's first call (reads the environment) */
SSM_GLUE void threads_init(void);

/* ------------------------------------------------------------------ scratch.c */

/* scratch aligned to SSM_WORK_ALIGN (NULL when it cannot be had); give it back with work_release */
SSM_GLUE void * work_alloc(size_t bytes);
SSM_GLUE void work_release(void * ptr);
/* work_alloc, with MemoryError set when it returns NULL */
SSM_GLUE void * work_alloc_or_raise(size_t bytes);

/* ------------------------------------------------------------------ check.c */

/* "(2, 3, 4)" into buf */
SSM_GLUE void shape_str(char * buf, size_t len, int ndim, const npy_intp * dims);
/* obj as an aligned native float32/float64 array of ndim dims, all float arguments one dtype
 * (*typenum, *first: the first one's), TypeError/ValueError naming `name` otherwise */
SSM_GLUE PyArrayObject * float_arg(const char * fn, const char * name, PyObject * obj, int ndim,
                                   const char * legend, int * typenum, const char ** first);
/* float_arg for a 1-D array, returned dense (a strided one is packed: the kernels read it densely) */
SSM_GLUE PyArrayObject * dense_vector_arg(const char * fn, const char * name, PyObject * obj, const char * legend,
                                          int * typenum, const char ** first);
/* the call's dtype from its first float32/float64 ndarray among objs (named names), so that lists
 * among the arguments convert to it instead of deciding it */
SSM_GLUE void dtype_from_arrays(PyObject * const * objs, const char * const * names, int n, int * typenum,
                                const char ** first);
/* arr's shape == expected (entries < 0 free), else ValueError naming the argument */
SSM_GLUE int check_shape(const char * fn, const char * name, PyArrayObject * arr, const npy_intp * expected,
                         const char * legend);
/* 1 <= n and n divides total, else ValueError: "argument 'arg' has what = n<unit> (its axis axis), which
 * must be >= 1 and divide total_name = total" */
SSM_GLUE int check_divides(const char * fn, const char * arg, const char * what, const char * unit, int axis,
                           npy_intp n, const char * total_name, npy_intp total);
/* n_seqs ids, any integer dtype, as a dense int64 copy; each in [0, n_rs) (ValueError naming the id) */
SSM_GLUE PyArrayObject * ids_arg(const char * fn, PyObject * obj, npy_intp n_seqs, npy_intp n_rs);
/* a caller's `out`: writeable, aligned, C-contiguous, of the result's dtype and shape, sharing no byte
 * with reads[i] (named read_names[i], NULL entries skipped); a new reference, or NULL with the error */
SSM_GLUE PyArrayObject * out_arg(const char * fn, PyObject * obj, int ndim, const npy_intp * dims, int typenum,
                                 const char * legend, PyArrayObject * const * reads, const char * const * read_names,
                                 int n_reads);
/* [lo, hi) of the bytes an array's elements occupy (lo == hi when it has none) */
/* an uninitialized C-ordered array whose data is 64-byte aligned (the kept chunk states, which the forwards
   write with streaming stores), or NULL with the exception set */
SSM_GLUE PyArrayObject * aligned_empty(int nd, const npy_intp * dims, int typenum);
SSM_GLUE void byte_extent(PyArrayObject * a, char ** lo, char ** hi);
SSM_GLUE void elem_strides(PyArrayObject * arr, int64_t * st);
/* nthreads >= 1, K >= 1: else ValueError */
SSM_GLUE int threads_arg(int nthreads);
SSM_GLUE int k_arg(const char * fn, long long K);
/* the product of n npy_intp factors, or -1 with MemoryError on overflow */
SSM_GLUE npy_intp checked_prod(int n, ...);
/* a + b, or -1 with MemoryError on overflow */
SSM_GLUE npy_intp checked_sum(npy_intp a, npy_intp b);
/* the elements of arrs[0..n) together, or -1 with MemoryError on overflow */
SSM_GLUE npy_intp sizes_sum(PyArrayObject * const * arrs, int n);
/* every size the kernels derive must fit in int64 with room (work buffers, K slots): K * 64 times the
 * product of (sizes[i] + 1) below 4e18, else MemoryError listing "name=size" for every named size
 * (names[i] NULL: a factor counted but not listed again) and K */
SSM_GLUE int sizes_fit(const char * fn, int n, const char * const * names, const npy_intp * sizes, long long K);

/* ------------------------------------------------------------------ settings.c */

/* the defaults that calls copy into their params before they release the GIL */
SSM_GLUE int64_t glue_simd_choice(void);
SSM_GLUE int64_t glue_scan_fwd_form(void);
SSM_GLUE int64_t glue_scan_back_form(void);
SSM_GLUE long glue_min_work_per_thread(void);
/* "auto", "recurrence", "chunked" by SSM_FORM_* */
SSM_GLUE const char * glue_form_name(int form);
/* at import: the defaults from the environment (SSMGRAD_SIMD, SSMGRAD_NO_AVX512, SSMGRAD_SCAN_FWD/_BACK) */
SSM_GLUE void settings_from_env(void);

/* ------------------------------------------------------------------ the functions of the module
 * Each file's table of module functions, added to the module by module_exec (module.c). */
extern SSM_GLUE PyMethodDef glue_conv_methods[];
extern SSM_GLUE PyMethodDef glue_scan_methods[];
extern SSM_GLUE PyMethodDef glue_gdn_methods[];
extern SSM_GLUE PyMethodDef glue_settings_methods[];
extern SSM_GLUE PyMethodDef glue_testhooks_methods[];

#endif /* SSM_GLUE_H */
