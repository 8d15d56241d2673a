/*
 * scan_call.c -- the scan bindings' arguments (scan_call.h): parsed, validated against ggml's shape
 * preconditions (ggml_ssm_scan), and put into the kernels' params.
 *
 *   s  (n_rs, n_head, head_dim, d_state)      x  (n_seqs, n_t, n_head, head_dim)
 *   dt (n_seqs, n_t, n_head)                   A  (n_head, d_state) Mamba-1 or (n_head, 1) Mamba-2
 *   B, C (n_seqs, n_t, n_group, d_state)       ids (n_seqs,) rows of s, in [0, n_rs)
 */
#include "scan_call.h"

#include <string.h>

enum { S, X, DT, A, B, C };

/* the six float arguments, one dtype, each of its rank */
static int scan_arrays(const char * fn, PyObject * const * objs, PyArrayObject ** arr, int * typenum) {
    static const char * const names[6] = { "s", "x", "dt", "A", "B", "C" };
    static const int ndims[6] = { 4, 4, 3, 2, 4, 4 };
    static const char * const legends[6] = {
        "(n_rs, n_head, head_dim, d_state)", "(n_seqs, n_t, n_head, head_dim)", "(n_seqs, n_t, n_head)",
        "(n_head, d_state) or (n_head, 1)", "(n_seqs, n_t, n_group, d_state)", "(n_seqs, n_t, n_group, d_state)",
    };
    const char * first = NULL;
    dtype_from_arrays(objs, names, 6, typenum, &first);
    for (int i = 0; i < 6; ++i)
        if (!(arr[i] = float_arg(fn, names[i], objs[i], ndims[i], legends[i], typenum, &first))) return -1;
    return 0;
}

/* x, dt, A, B, C against the sizes s and x give; n_group divides n_head */
static int scan_check_shapes(const char * fn, PyArrayObject ** arr) {
    const npy_intp n_head = PyArray_DIM(arr[S], 1), head_dim = PyArray_DIM(arr[S], 2);
    const npy_intp d_state = PyArray_DIM(arr[S], 3);
    const npy_intp n_seqs = PyArray_DIM(arr[X], 0), n_t = PyArray_DIM(arr[X], 1);
    const npy_intp n_group = PyArray_DIM(arr[B], 2);
    const npy_intp want_x[4] = { -1, -1, n_head, head_dim };
    if (check_shape(fn, "x", arr[X], want_x, "(n_seqs, n_t, n_head, head_dim) with n_head, head_dim from s"))
        return -1;
    const npy_intp want_dt[3] = { n_seqs, n_t, n_head };
    if (check_shape(fn, "dt", arr[DT], want_dt, "(n_seqs, n_t, n_head)")) return -1;
    const npy_intp want_A[2] = { n_head, PyArray_DIM(arr[A], 1) == 1 ? 1 : d_state };
    if (check_shape(fn, "A", arr[A], want_A, "(n_head, d_state) for Mamba-1 or (n_head, 1) for Mamba-2")) return -1;
    const npy_intp want_B[4] = { n_seqs, n_t, -1, d_state };
    if (check_shape(fn, "B", arr[B], want_B, "(n_seqs, n_t, n_group, d_state)")) return -1;
    const npy_intp want_C[4] = { n_seqs, n_t, n_group, d_state };
    if (check_shape(fn, "C", arr[C], want_C, "(n_seqs, n_t, n_group, d_state), the shape of B")) return -1;
    return check_divides(fn, "B", "n_group", "", 2, n_group, "n_head", n_head);
}

/* K >= 1, and K > 1 only with Mamba-2's A (as in ggml) */
static int scan_check_K(const char * fn, PyArrayObject ** arr, long long K) {
    if (k_arg(fn, K)) return -1;
    if (K > 1 && PyArray_DIM(arr[A], 1) != 1) {
        PyErr_Format(PyExc_ValueError,
                     "%s: K = %lld > 1 needs the Mamba-2 form of A, shape (n_head, 1), as in ggml; got A of shape "
                     "(%lld, %lld)", fn, K, (long long) PyArray_DIM(arr[S], 1), (long long) PyArray_DIM(arr[S], 3));
        return -1;
    }
    return 0;
}

/* the params and data pointers of validated arguments */
static void scan_fill(scan_ctx * k, PyArrayObject ** arr, PyArrayObject * ids, long long K, int typenum) {
    memset(k, 0, sizeof *k);
    ssm_scan_params * p = &k->p;
    *p = (ssm_scan_params) { .n_rs = PyArray_DIM(arr[S], 0), .n_head = PyArray_DIM(arr[S], 1),
                             .head_dim = PyArray_DIM(arr[S], 2), .d_state = PyArray_DIM(arr[S], 3),
                             .n_group = PyArray_DIM(arr[B], 2), .n_t = PyArray_DIM(arr[X], 1),
                             .n_seqs = PyArray_DIM(arr[X], 0), .a_per_state = PyArray_DIM(arr[A], 1) != 1, .K = K,
                             .fwd_form = glue_scan_fwd_form(), .back_form = glue_scan_back_form(),
                             .simd = glue_simd_choice() };
    int64_t * const st[6] = { p->s_st, p->x_st, p->dt_st, p->A_st, p->B_st, p->C_st };
    const void ** const data[6] = { &k->s, &k->x, &k->dt, &k->A, &k->B, &k->C };
    for (int i = 0; i < 6; ++i) {
        elem_strides(arr[i], st[i]);
        *data[i] = PyArray_DATA(arr[i]);
    }
    k->f64 = typenum == NPY_FLOAT64;
    k->ids = ids ? (const int64_t *) PyArray_DATA(ids) : NULL;
}

/* the scan's arguments, validated: new references in arr[0..5] (s x dt A B C) and *ids. ids_o NULL:
 * the identity, ids[q] = q, for one state row per sequence (n_rs == n_seqs, checked); *ids and k->ids
 * are then NULL, which only the decode kernels take (ssm_scan_decode_into_*) */
static int scan_args(const char * fn, PyObject * const * objs, PyObject * ids_o, long long K,
                     PyArrayObject ** arr, PyArrayObject ** ids, int * typenum, scan_ctx * k) {
    if (scan_arrays(fn, objs, arr, typenum)) return -1;
    const npy_intp n_rs = PyArray_DIM(arr[S], 0), n_seqs = PyArray_DIM(arr[X], 0);
    if (!ids_o && n_rs != n_seqs) {
        PyErr_Format(PyExc_ValueError, "%s: s must hold one state per sequence: s has %lld rows, x has %lld sequences",
                     fn, (long long) n_rs, (long long) n_seqs);
        return -1;
    }
    if (scan_check_shapes(fn, arr) || scan_check_K(fn, arr, K)) return -1;
    *ids = NULL;
    if (ids_o && !(*ids = ids_arg(fn, ids_o, n_seqs, n_rs))) return -1;
    static const char * const size_names[5] = { "n_seqs", "n_t", "n_head", "head_dim", "d_state" };
    const npy_intp sizes[5] = { n_seqs, PyArray_DIM(arr[X], 1), PyArray_DIM(arr[S], 1), PyArray_DIM(arr[S], 2),
                                PyArray_DIM(arr[S], 3) };
    if (sizes_fit(fn, 5, size_names, sizes, K)) return -1;
    scan_fill(k, arr, *ids, K, *typenum);
    return 0;
}

SSM_GLUE void scan_call_release(scan_call * c) {
    for (int i = 0; i < 6; ++i) Py_CLEAR(c->arr[i]);
    Py_CLEAR(c->ids);
}

SSM_GLUE int scan_call_parse(const char * fn, PyObject * args, int takes, scan_call * c) {
    memset(c, 0, sizeof *c);
    c->K = 1;
    c->typenum = -1;
    const Py_ssize_t want = 7 + !!(takes & SCAN_ARG_GRAD) + !!(takes & SCAN_ARG_K) + !!(takes & SCAN_ARG_RETURN_DA)
                            + !!(takes & SCAN_ARG_THREADS) + !!(takes & SCAN_ARG_STATES);
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
    if (takes & SCAN_ARG_STATES) c->states = PyTuple_GET_ITEM(args, at++);
    PyObject * ids_o = PyTuple_GET_ITEM(args, 6);
    if ((takes & SCAN_ARG_IDS_NONE) && ids_o == Py_None) ids_o = NULL;
    if (scan_args(fn, objs, ids_o, c->K, c->arr, &c->ids, &c->typenum, &c->k)) {
        scan_call_release(c);
        return -1;
    }
    return 0;
}

SSM_GLUE npy_intp scan_out_size(const ssm_scan_params * p) {
    const npy_intp n_y = checked_prod(4, (npy_intp) p->n_seqs, (npy_intp) p->n_t, (npy_intp) p->n_head,
                                      (npy_intp) p->head_dim);
    if (n_y < 0) return -1;
    const npy_intp n_s = checked_prod(5, (npy_intp) p->K, (npy_intp) p->n_seqs, (npy_intp) p->n_head,
                                      (npy_intp) p->head_dim, (npy_intp) p->d_state);
    if (n_s < 0) return -1;
    return checked_sum(n_y, n_s);
}

SSM_GLUE double scan_work(const ssm_scan_params * p) {
    return (double) p->n_seqs * p->n_t * p->n_head * p->head_dim * (p->d_state > 0 ? p->d_state : 1);
}

SSM_GLUE int scan_states_dims(const ssm_scan_params * p, npy_intp * dims) {
    if (ssm_scan_chunk_states(p) == 0) {
        dims[0] = 0;
        return 1;
    }
    dims[0] = p->n_seqs;
    dims[1] = p->n_head;
    dims[2] = (p->n_t + 63) / 64;
    dims[3] = p->head_dim;
    dims[4] = p->d_state;
    return 5;
}
