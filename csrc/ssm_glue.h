/*
 * ssm_glue.h -- what the glue files of the extension (ssmgrad_module.c, gdn_module.c) share:
 * argument checks, the scratch cache, the thread runner (defined in ssmgrad_module.c). Internal:
 * hidden from the module's exported symbols. Include after Python.h and numpy/arrayobject.h.
 */
#ifndef SSM_GLUE_H
#define SSM_GLUE_H

#include <stddef.h>
#include <stdint.h>

#define SSM_GLUE __attribute__((visibility("hidden")))

typedef void (*task_fn)(void * ctx, int ith, int nth);

/* fn(ctx, ith, nth) for every ith in [0, nth); then, if fn2, a barrier and fn2 likewise */
SSM_GLUE void run_threads(int nth, task_fn fn, task_fn fn2, void * ctx);
/* scratch aligned to SSM_WORK_ALIGN (NULL when it cannot be had); give it back with work_release */
SSM_GLUE void * work_alloc(size_t bytes);
SSM_GLUE void work_release(void * ptr);
/* obj as an aligned native float32/float64 array of ndim dims, all float arguments one dtype
 * (*typenum, *first: the first one's), TypeError/ValueError naming `name` otherwise */
SSM_GLUE PyArrayObject * float_arg(const char * fn, const char * name, PyObject * obj, int ndim,
                                   const char * legend, int * typenum, const char ** first);
/* arr's shape == expected (entries < 0 free), else ValueError naming the argument */
SSM_GLUE int check_shape(const char * fn, const char * name, PyArrayObject * arr, const npy_intp * expected,
                         const char * legend);
SSM_GLUE void elem_strides(PyArrayObject * arr, int64_t * st);
/* a caller's `out` buffer (writeable, aligned, C-contiguous, the result's dtype and shape, sharing no byte
 * with the arrays read): a new reference, or NULL with TypeError / ValueError naming it */
SSM_GLUE PyArrayObject * out_arg(const char * fn, PyObject * obj, int ndim, const npy_intp * dims, int typenum,
                                 const char * legend, PyArrayObject * const * reads, const char * const * read_names,
                                 int n_reads);
SSM_GLUE int threads_arg(int nthreads);
/* the product of n npy_intp factors, or -1 with MemoryError on overflow */
SSM_GLUE npy_intp checked_prod(int n, ...);
/* threads to use for `units` units of `work` multiply-adds */
SSM_GLUE int clamp_threads(int nthreads, int64_t units, double work);
/* the SSM_SIMD_* choice calls put into their params */
SSM_GLUE int64_t glue_simd_choice(void);

/* gdn_module.c: adds the Gated DeltaNet functions to the module (from module_exec) */
SSM_GLUE int gdn_module_add(PyObject * m);

#endif /* SSM_GLUE_H */
