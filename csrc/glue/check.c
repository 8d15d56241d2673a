/*
 * check.c -- the argument checks every binding shares: conversion of float arguments (one dtype per
 * call), shapes against their legends, ids, `out` buffers, thread counts, K, and sizes that must fit.
 * Every failure raises with a message that names the function and the argument: TypeError for a
 * dtype, ValueError with the expected and the actual shape, MemoryError for sizes that cannot be had.
 */
#include "ssm_glue.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

SSM_GLUE void shape_str(char * buf, size_t len, int ndim, const npy_intp * dims) {
    size_t off = 0;
    off += snprintf(buf + off, len - off, "(");
    for (int i = 0; i < ndim && off < len; ++i)
        off += snprintf(buf + off, len - off, i ? ", %lld" : "%lld", (long long) dims[i]);
    if (off < len) off += snprintf(buf + off, len - off, ndim == 1 ? ",)" : ")");
}

static const char * dtype_name(int typenum) { return typenum == NPY_FLOAT32 ? "float32" : "float64"; }

/* what to do with a half-precision argument (float16, bfloat16; torch's too) into buf, else "" */
static void half_hint(char * buf, size_t len, const char * name, PyObject * obj, const char * dtype_str) {
    const size_t n = strlen(dtype_str);
    buf[0] = '\0';
    if (n < 7 || strcmp(dtype_str + n - 7, "float16") != 0) return;
    if (!PyArray_Check(obj) && PyObject_HasAttrString(obj, "float"))   /* a torch tensor */
        snprintf(buf, len, "; convert it with %s.float(), or use ssmgrad.torch, whose ops take torch tensors", name);
    else
        snprintf(buf, len, "; convert it with %s.astype(numpy.float32)", name);
}

/* obj's dtype attribute as a string ("" when it has none) into buf */
static void dtype_attr_str(PyObject * obj, char * buf, size_t len) {
    buf[0] = '\0';
    PyObject * dt = PyObject_GetAttrString(obj, "dtype");
    PyObject * s = dt ? PyObject_Str(dt) : NULL;
    const char * u = s ? PyUnicode_AsUTF8(s) : NULL;
    if (u) snprintf(buf, len, "%s", u);
    Py_XDECREF(s);
    Py_XDECREF(dt);
    PyErr_Clear();
}

/* np.asarray(obj); when that fails with a TypeError (a torch bfloat16 tensor: "Got unsupported
 * ScalarType BFloat16"), a TypeError that names the argument, its dtype and what to do */
static PyArrayObject * as_array(const char * fn, const char * name, PyObject * obj) {
    PyArrayObject * arr = (PyArrayObject *) PyArray_FROM_O(obj);
    if (arr || !PyErr_ExceptionMatches(PyExc_TypeError)) return arr;
    PyObject * type, * value, * tb;
    PyErr_Fetch(&type, &value, &tb);
    char dt[64];
    dtype_attr_str(obj, dt, sizeof dt);
    if (!dt[0]) {   /* nothing to add: the converter's own error */
        PyErr_Restore(type, value, tb);
        return NULL;
    }
    PyErr_NormalizeException(&type, &value, &tb);
    char hint[160];
    half_hint(hint, sizeof hint, name, obj, dt);
    PyErr_Format(PyExc_TypeError, "%s: argument '%s' must be a float32 or float64 array, got dtype %s (NumPy cannot "
                 "convert it: %S)%s", fn, name, dt, value, hint);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    return NULL;
}

/* a list of floats converts to float64; it takes the call's dtype when an array set it */
static PyArrayObject * to_call_dtype(PyArrayObject * arr, int typenum) {
    const int t = PyArray_TYPE(arr);
    if (typenum < 0 || t == typenum || (t != NPY_FLOAT32 && t != NPY_FLOAT64)) return arr;
    PyArrayObject * cast = (PyArrayObject *) PyArray_FROM_OTF((PyObject *) arr, typenum, NPY_ARRAY_FORCECAST);
    Py_DECREF(arr);
    return cast;
}

/* arr's dtype: float32/float64 and the call's (set from the first one), else TypeError */
static int check_dtype(const char * fn, const char * name, PyObject * obj, PyArrayObject * arr, int * typenum,
                       const char ** first) {
    const int t = PyArray_TYPE(arr);
    if (t != NPY_FLOAT32 && t != NPY_FLOAT64) {
        PyObject * s = PyObject_Str((PyObject *) PyArray_DESCR(arr));
        const char * u = s ? PyUnicode_AsUTF8(s) : NULL;
        char hint[160];
        if (u) {
            half_hint(hint, sizeof hint, name, obj, u);
            PyErr_Format(PyExc_TypeError, "%s: argument '%s' must be a float32 or float64 array, got dtype %s%s",
                         fn, name, u, hint);
        }
        Py_XDECREF(s);
        return -1;
    }
    if (*typenum < 0) {
        *typenum = t;
        *first = name;
    } else if (t != *typenum) {
        PyErr_Format(PyExc_TypeError, "%s: argument '%s' has dtype %s but '%s' has dtype %s; all float arguments must "
                     "share one dtype", fn, name, dtype_name(t), *first, dtype_name(*typenum));
        return -1;
    }
    return 0;
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
    } else if (!(arr = as_array(fn, name, obj)) || !(arr = to_call_dtype(arr, *typenum))) {
        return NULL;
    }
    if (check_dtype(fn, name, obj, arr, typenum, first)) {
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
    PyArrayObject * ok = (PyArrayObject *) PyArray_FROM_OTF((PyObject *) arr, PyArray_TYPE(arr), NPY_ARRAY_ALIGNED);
    Py_DECREF(arr);
    return ok;
}

SSM_GLUE PyArrayObject * dense_vector_arg(const char * fn, const char * name, PyObject * obj, const char * legend,
                                          int * typenum, const char ** first) {
    PyArrayObject * v = float_arg(fn, name, obj, 1, legend, typenum, first);
    if (!v) return NULL;
    PyArrayObject * dense = PyArray_GETCONTIGUOUS(v);
    Py_DECREF(v);
    return dense;
}

SSM_GLUE void dtype_from_arrays(PyObject * const * objs, const char * const * names, int n, int * typenum,
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

SSM_GLUE int check_divides(const char * fn, const char * arg, const char * what, const char * unit, int axis,
                           npy_intp n, const char * total_name, npy_intp total) {
    if (n >= 1 && total % n == 0) return 0;
    PyErr_Format(PyExc_ValueError, "%s: argument '%s' has %s = %lld%s (its axis %d), which must be >= 1 and divide "
                 "%s = %lld", fn, arg, what, (long long) n, unit, axis, total_name, (long long) total);
    return -1;
}

SSM_GLUE void elem_strides(PyArrayObject * arr, int64_t * st) {
    const npy_intp item = PyArray_ITEMSIZE(arr);
    for (int i = 0; i < PyArray_NDIM(arr); ++i) st[i] = (int64_t) (PyArray_STRIDES(arr)[i] / item);
}

/* the first of v[0..n) outside [0, n_rs), ValueError naming it (is_u64: the ids were unsigned) */
static int ids_in_range(const char * fn, const int64_t * v, npy_intp n, npy_intp n_rs, int is_u64) {
    for (npy_intp q = 0; q < n; ++q) {
        if (v[q] >= 0 && v[q] < n_rs) continue;
        if (is_u64 && v[q] < 0)
            PyErr_Format(PyExc_ValueError, "%s: ids[%lld] = %llu is out of range [0, n_rs = %lld)",
                         fn, (long long) q, (unsigned long long) v[q], (long long) n_rs);
        else
            PyErr_Format(PyExc_ValueError, "%s: ids[%lld] = %lld is out of range [0, n_rs = %lld)",
                         fn, (long long) q, (long long) v[q], (long long) n_rs);
        return -1;
    }
    return 0;
}

SSM_GLUE PyArrayObject * ids_arg(const char * fn, PyObject * obj, npy_intp n_seqs, npy_intp n_rs) {
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
    if (ids && ids_in_range(fn, (const int64_t *) PyArray_DATA(ids), n_seqs, n_rs, is_u64)) Py_CLEAR(ids);
    return ids;
}

SSM_GLUE void byte_extent(PyArrayObject * a, char ** lo, char ** hi) {
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

/* out's dtype, shape and layout as out_arg requires, else TypeError / ValueError */
static int out_layout(const char * fn, PyObject * obj, int ndim, const npy_intp * dims, int typenum,
                      const char * legend) {
    if (!PyArray_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s: argument 'out' must be a numpy.ndarray or None, got %s",
                     fn, Py_TYPE(obj)->tp_name);
        return -1;
    }
    PyArrayObject * out = (PyArrayObject *) obj;
    if (PyArray_TYPE(out) != typenum || !PyArray_ISNBO(PyArray_DESCR(out)->byteorder)) {
        PyErr_Format(PyExc_TypeError, "%s: argument 'out' must have the inputs' dtype %s (native byte order), "
                     "got dtype %S", fn, dtype_name(typenum), (PyObject *) PyArray_DESCR(out));
        return -1;
    }
    if (PyArray_NDIM(out) != ndim) {
        char got[256], want[256];
        shape_str(got, sizeof got, PyArray_NDIM(out), PyArray_DIMS(out));
        shape_str(want, sizeof want, ndim, dims);
        PyErr_Format(PyExc_ValueError, "%s: argument 'out' has shape %s, expected %s = %s", fn, got, want, legend);
        return -1;
    }
    if (check_shape(fn, "out", out, dims, legend)) return -1;
    if (!PyArray_ISCARRAY(out)) {
        PyErr_Format(PyExc_ValueError, "%s: argument 'out' must be C-contiguous, aligned and writeable", fn);
        return -1;
    }
    return 0;
}

SSM_GLUE PyArrayObject * out_arg(const char * fn, PyObject * obj, int ndim, const npy_intp * dims, int typenum,
                                 const char * legend, PyArrayObject * const * reads, const char * const * read_names,
                                 int n_reads) {
    if (out_layout(fn, obj, ndim, dims, typenum, legend)) return NULL;
    PyArrayObject * out = (PyArrayObject *) obj;
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

SSM_GLUE int threads_arg(int nthreads) {
    if (nthreads < 1) {
        PyErr_SetString(PyExc_ValueError, "nthreads must be >= 1");
        return -1;
    }
    return 0;
}

SSM_GLUE int k_arg(const char * fn, long long K) {
    if (K < 1) {
        PyErr_Format(PyExc_ValueError, "%s: K must be >= 1, got %lld", fn, K);
        return -1;
    }
    return 0;
}

static npy_intp overflow(void) {
    PyErr_SetString(PyExc_MemoryError, "ssmgrad: array sizes overflow the address space");
    return -1;
}

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
    return bad || acc < 0 ? overflow() : acc;
}

SSM_GLUE npy_intp checked_sum(npy_intp a, npy_intp b) {
    npy_intp s;
    return a < 0 || b < 0 || __builtin_add_overflow(a, b, &s) ? overflow() : s;
}

SSM_GLUE npy_intp sizes_sum(PyArrayObject * const * arrs, int n) {
    npy_intp acc = 0;
    for (int i = 0; i < n; ++i)
        if ((acc = checked_sum(acc, PyArray_SIZE(arrs[i]))) < 0) return -1;
    return acc;
}

SSM_GLUE int sizes_fit(const char * fn, int n, const char * const * names, const npy_intp * sizes, long long K) {
    double est = (double) K * 64.0;
    for (int i = 0; i < n; ++i) est *= (double) sizes[i] + 1;
    if (est <= 4e18) return 0;
    char list[512] = "";
    size_t off = 0;
    for (int i = 0; i < n && off < sizeof list; ++i)
        if (names[i]) off += snprintf(list + off, sizeof list - off, "%s=%lld, ", names[i], (long long) sizes[i]);
    PyErr_Format(PyExc_MemoryError, "%s: sizes too large to compute (%sK=%lld)", fn, list, K);
    return -1;
}

/* an uninitialized C-ordered array whose data is 64-byte aligned (a view into a slightly larger buffer, its base):
 * the forward writes the chunk states' rows with streaming stores where they are */
SSM_GLUE PyArrayObject * aligned_empty(int nd, const npy_intp * dims, int typenum) {
    /* the elements, checked for overflow (MemoryError), and room to align the first to 64 bytes */
    npy_intp n = 1;
    for (int i = 0; i < nd && n >= 0; ++i) n = checked_prod(2, n, dims[i]);
    const npy_intp item = typenum == NPY_FLOAT64 ? 8 : 4;
    const npy_intp room = n < 0 ? -1 : checked_sum(n, 64 / item);
    if (room < 0 || checked_prod(2, room, item) < 0) return NULL;
    PyArrayObject * buf = (PyArrayObject *) PyArray_EMPTY(1, &room, typenum, 0);
    if (!buf) return NULL;
    char * data = PyArray_DATA(buf);
    data += (64 - (uintptr_t) data % 64) % 64;
    PyArrayObject * v = (PyArrayObject *) PyArray_NewFromDescr(&PyArray_Type, PyArray_DescrFromType(typenum), nd,
                                                              (npy_intp *) dims, NULL, data, NPY_ARRAY_CARRAY, NULL);
    if (!v || PyArray_SetBaseObject(v, (PyObject *) buf) < 0) {   /* SetBaseObject steals buf, even on error */
        if (!v) Py_DECREF(buf);
        Py_XDECREF(v);
        return NULL;
    }
    return v;
}
