/*
 * scan.c -- the bindings of SSM_SCAN: ssm_scan, ssm_scan_back, and _ssm_scan_update, the in-place
 * decode step behind ssmgrad.ssm_scan_update (the public API is in ssmgrad/__init__.py, which
 * passes K and the thread count); _scan_work_bytes and _scan_forms say what a call would take
 * (tests, benchmarks). Arguments: scan_call.c.
 *
 *   ssm_scan       -> (N_y + K*N_s,): y (n_seqs, n_t, n_head, head_dim), then K state slots
 *                     (n_seqs, n_head, head_dim, d_state) each
 *   ssm_scan_keep  -> (that, chunk_states): ssm_scan_keep_*'s chunk states, (0,) where it keeps none
 *   ssm_scan_back  grad (N_y + K*N_s,) [, chunk_states] -> gin (s.size + x.size + dt.size + B.size + C.size,)
 *                     [, d_A of A's shape]
 */
#include "scan_call.h"

#include <stdio.h>

#include "ssm_scan_layout.h"   /* ssm_scan_decode_into_*, ssm_scan_*_chunked (internal) */

static void scan_fwd_task(void * vc, int ith, int nth) {
    scan_ctx * k = vc;
    if (k->f64) ssm_scan_f64(&k->p, k->s, k->x, k->dt, k->A, k->B, k->C, k->ids, k->out, k->work, ith, nth);
    else ssm_scan_f32(&k->p, k->s, k->x, k->dt, k->A, k->B, k->C, k->ids, k->out, k->work, ith, nth);
}
static void scan_keep_task(void * vc, int ith, int nth) {
    scan_ctx * k = vc;
    if (k->f64)
        ssm_scan_keep_f64(&k->p, k->s, k->x, k->dt, k->A, k->B, k->C, k->ids, k->out, k->kept, k->work, ith, nth);
    else
        ssm_scan_keep_f32(&k->p, k->s, k->x, k->dt, k->A, k->B, k->C, k->ids, k->out, k->kept, k->work, ith, nth);
}
static void scan_back_task(void * vc, int ith, int nth) {
    scan_ctx * k = vc;
    if (k->f64)
        ssm_scan_back_kept_f64(&k->p, k->s, k->x, k->dt, k->A, k->B, k->C, k->ids, k->kept, k->grad, k->out,
                               k->work, ith, nth);
    else
        ssm_scan_back_kept_f32(&k->p, k->s, k->x, k->dt, k->A, k->B, k->C, k->ids, k->kept, k->grad, k->out,
                               k->work, ith, nth);
}
static void scan_reduce_task(void * vc, int ith, int nth) {
    scan_ctx * k = vc;
    if (k->f64) ssm_scan_back_reduce_f64(&k->p, k->ids, k->out, k->d_A, k->work, ith, nth);
    else ssm_scan_back_reduce_f32(&k->p, k->ids, k->out, k->d_A, k->work, ith, nth);
}
static void scan_decode_into_task(void * vc, int ith, int nth) {
    scan_ctx * k = vc;
    void * st = (void *) k->s;       /* the state rows are updated in place */
    if (k->f64) ssm_scan_decode_into_f64(&k->p, k->s, k->x, k->dt, k->A, k->B, k->C, k->ids, k->out, st, ith, nth);
    else ssm_scan_decode_into_f32(&k->p, k->s, k->x, k->dt, k->A, k->B, k->C, k->ids, k->out, st, ith, nth);
}

static PyObject * py_ssm_scan(PyObject * self, PyObject * args) {
    (void) self;
    scan_call c;
    if (scan_call_parse("ssm_scan", args, SCAN_ARG_K | SCAN_ARG_THREADS, &c)) return NULL;
    scan_ctx k = c.k;
    PyArrayObject * out = NULL;
    PyObject * result = NULL;

    const npy_intp n_out = scan_out_size(&k.p);
    if (n_out < 0 || !(out = (PyArrayObject *) PyArray_EMPTY(1, &n_out, c.typenum, 0))) goto error;
    const int nth = clamp_threads(c.nthreads, k.p.n_seqs * k.p.n_head, scan_work(&k.p));
    k.out = PyArray_DATA(out);
    if (run_kernels(nth, ssm_scan_work_size(&k.p, k.f64 ? 8 : 4, nth), &k.work, scan_fwd_task, NULL, &k)) goto error;
    result = (PyObject *) out;
    out = NULL;

error:   /* and the way out on success: result holds the reference to return */
    work_release(k.work);
    scan_call_release(&c);
    Py_XDECREF(out);
    return result;
}

/* _ssm_scan_keep: ssm_scan, and the chunk states the backward can read (ssm_scan_keep_*): (out, chunk_states),
 * chunk_states (n_seqs, n_head, ceil(n_t / 64), head_dim, d_state), or (0,) where the call keeps none */
static PyObject * py_ssm_scan_keep(PyObject * self, PyObject * args) {
    (void) self;
    scan_call c;
    if (scan_call_parse("ssm_scan", args, SCAN_ARG_K | SCAN_ARG_THREADS, &c)) return NULL;
    scan_ctx k = c.k;
    PyArrayObject * out = NULL, * kept = NULL;
    PyObject * result = NULL;

    const npy_intp n_out = scan_out_size(&k.p);
    npy_intp dims[5];
    const int nd = scan_states_dims(&k.p, dims);
    if (n_out < 0 || !(out = (PyArrayObject *) PyArray_EMPTY(1, &n_out, c.typenum, 0))) goto error;
    if (!(kept = aligned_empty(nd, dims, c.typenum))) goto error;
    const int nth = clamp_threads(c.nthreads, k.p.n_seqs * k.p.n_head, scan_work(&k.p));
    k.out = PyArray_DATA(out);
    k.kept = PyArray_DATA(kept);
    if (run_kernels(nth, ssm_scan_work_size(&k.p, k.f64 ? 8 : 4, nth), &k.work, scan_keep_task, NULL, &k)) goto error;
    result = PyTuple_Pack(2, (PyObject *) out, (PyObject *) kept);

error:   /* and the way out on success: result holds the references to return */
    work_release(k.work);
    scan_call_release(&c);
    Py_XDECREF(out);
    Py_XDECREF(kept);
    return result;
}

/* ssm_scan_back's chunk_states: None, or where the call reads them (ssm_scan_chunk_states > 0) the forward's,
 * of the shape scan_states_dims gives, as a dense array (a new reference in *arr); ignored elsewhere */
static int scan_states_arg(const char * fn, scan_call * c, PyArrayObject ** arr) {
    *arr = NULL;
    if (c->states == Py_None || ssm_scan_chunk_states(&c->k.p) == 0) return 0;
    npy_intp dims[5];
    scan_states_dims(&c->k.p, dims);
    const char * first = "s";
    const char * legend = "(n_seqs, n_head, ceil(n_t / 64), head_dim, d_state), ssm_scan(keep_states=True)'s";
    PyArrayObject * a = float_arg(fn, "chunk_states", c->states, 5, legend, &c->typenum, &first);
    if (!a) return -1;
    if (check_shape(fn, "chunk_states", a, dims, legend)) {
        Py_DECREF(a);
        return -1;
    }
    *arr = PyArray_GETCONTIGUOUS(a);
    Py_DECREF(a);
    return *arr ? 0 : -1;
}

/* ssm_scan_back's grad: a dense 1-D array of the packed output's n_out elements. A wrong size says
 * what N_y, N_s and K are (K is easy to forget: it defaults to 1) and which K the size would fit. */
static PyArrayObject * scan_grad_arg(const char * fn, scan_call * c, npy_intp n_out) {
    const char * first = "s";
    PyArrayObject * g = dense_vector_arg(fn, "grad", c->grad, "(N_y + K*N_s,), the packed gradient of ssm_scan's "
                                         "output", &c->typenum, &first);
    if (!g || PyArray_DIM(g, 0) == n_out) return g;
    const long long K = c->k.p.K, n_y = PyArray_SIZE(c->arr[1]), n_s = (n_out - n_y) / (K > 0 ? K : 1);
    const long long got = PyArray_DIM(g, 0);
    char fits[96] = "";
    if (n_s > 0 && got > n_y && (got - n_y) % n_s == 0)
        snprintf(fits, sizeof fits, "; a grad of %lld elements fits K = %lld", got, (got - n_y) / n_s);
    PyErr_Format(PyExc_ValueError,
                 "%s: argument 'grad' has shape (%lld,), expected (%lld,) = (N_y + K*N_s,), the size of "
                 "ssm_scan's packed output, with N_y = x.size = %lld (y), N_s = n_seqs*n_head*head_dim*d_state "
                 "= %lld (one state slot) and K = %lld (K defaults to 1: pass the K given to ssm_scan)%s",
                 fn, got, (long long) n_out, n_y, n_s, K, fits);
    Py_DECREF(g);
    return NULL;
}

static PyObject * py_ssm_scan_back(PyObject * self, PyObject * args) {
    (void) self;
    const char * fn = "ssm_scan_back";
    scan_call c;
    if (scan_call_parse(fn, args, SCAN_ARG_GRAD | SCAN_ARG_K | SCAN_ARG_RETURN_DA | SCAN_ARG_THREADS | SCAN_ARG_STATES,
                        &c)) return NULL;
    scan_ctx k = c.k;
    PyArrayObject ** arr = c.arr, * g = NULL, * gin = NULL, * dA = NULL, * kept = NULL;
    PyObject * result = NULL;

    const npy_intp n_out = scan_out_size(&k.p);
    if (n_out < 0 || !(g = scan_grad_arg(fn, &c, n_out))) goto error;
    if (scan_states_arg(fn, &c, &kept)) goto error;
    /* gin = s.size + x.size + dt.size + B.size + C.size, each of which numpy already holds */
    PyArrayObject * const parts[5] = { arr[0], arr[1], arr[2], arr[4], arr[5] };
    const npy_intp n_gin = sizes_sum(parts, 5);
    if (n_gin < 0 || !(gin = (PyArrayObject *) PyArray_EMPTY(1, &n_gin, c.typenum, 0))) goto error;
    if (c.return_dA && !(dA = (PyArrayObject *) PyArray_EMPTY(2, PyArray_DIMS(arr[3]), c.typenum, 0))) goto error;

    const int64_t units = ssm_scan_back_units(&k.p);
    const int nth = clamp_threads(c.nthreads, units > k.p.n_rs * k.p.n_head ? units : k.p.n_rs * k.p.n_head,
                                  3.0 * scan_work(&k.p));
    k.grad = PyArray_DATA(g);
    k.out = PyArray_DATA(gin);
    k.d_A = dA ? PyArray_DATA(dA) : NULL;
    k.kept = kept ? PyArray_DATA(kept) : NULL;
    if (run_kernels(nth, ssm_scan_back_work_size(&k.p, k.f64 ? 8 : 4, nth), &k.work, scan_back_task, scan_reduce_task,
                    &k)) goto error;
    if (dA) {
        result = PyTuple_Pack(2, (PyObject *) gin, (PyObject *) dA);
    } else {
        result = (PyObject *) gin;
        gin = NULL;
    }

error:   /* and the way out on success: result holds the reference to return */
    work_release(k.work);
    scan_call_release(&c);
    Py_XDECREF(g);
    Py_XDECREF(gin);
    Py_XDECREF(dA);
    Py_XDECREF(kept);
    return result;
}

/* ssmgrad.ssm_scan_update's own checks of s (it is written): a writeable 4-D ndarray */
static int update_s_arg(const char * fn, PyObject * s_o) {
    if (!PyArray_Check(s_o)) {
        PyErr_Format(PyExc_TypeError, "%s: s must be a NumPy array (it is updated in place), got %s", fn,
                     Py_TYPE(s_o)->tp_name);
        return -1;
    }
    if (!PyArray_ISWRITEABLE((PyArrayObject *) s_o)) {
        PyErr_Format(PyExc_ValueError, "%s: s must be writeable (it is updated in place)", fn);
        return -1;
    }
    if (PyArray_NDIM((PyArrayObject *) s_o) != 4) {
        char got[256];
        shape_str(got, sizeof got, PyArray_NDIM((PyArrayObject *) s_o), PyArray_DIMS((PyArrayObject *) s_o));
        PyErr_Format(PyExc_ValueError, "%s: s must be 4-D (n_seqs, n_head, head_dim, d_state), got shape %s", fn, got);
        return -1;
    }
    return 0;
}

/* 1 when the decode kernel can write the states over s itself: s is the caller's C-contiguous array,
 * one row per sequence, ids[q] = q, the forward takes its decode path, and no other input shares s's memory */
static int update_in_place(const scan_call * c, PyObject * s_o) {
    const scan_ctx * k = &c->k;
    int ok = (PyObject *) c->arr[0] == s_o && PyArray_ISCARRAY(c->arr[0]) && k->p.n_rs == k->p.n_seqs
             && ssm_scan_work_size(&k->p, k->f64 ? 8 : 4, 1) == 0;
    for (int64_t q = 0; ok && k->ids && q < k->p.n_seqs; ++q) ok = k->ids[q] == q;
    char * slo, * shi;
    byte_extent(c->arr[0], &slo, &shi);
    for (int i = 1; ok && i < 6; ++i) {
        char * lo, * hi;
        byte_extent(c->arr[i], &lo, &hi);
        ok = lo == hi || hi <= slo || lo >= shi;
    }
    return ok;
}

/*
 * _ssm_scan_update(s, x, dt, A, B, C, ids, nthreads): ssm_scan with K = 1 whose final states are
 * written over s itself, returning y (n_seqs, n_t, n_head, head_dim): the in-place update of a
 * generation cache (ssmgrad.ssm_scan_update), without a fresh state and a copy back. The one
 * function that writes an input. Only where update_in_place holds; otherwise it returns None and
 * changes nothing (the caller then takes ssm_scan). Arguments are validated as by ssm_scan (the
 * same errors).
 *
 * ids None is ssmgrad.ssm_scan_update's own call, with that function's checks and messages: s must
 * be a writeable 4-D ndarray with one row per sequence (TypeError / ValueError naming s), and the
 * identity ids are implied, never built (the decode kernel takes row q for sequence q).
 */
static PyObject * py_ssm_scan_update(PyObject * self, PyObject * args) {
    (void) self;
    const int public_call = PyTuple_GET_SIZE(args) == 8 && PyTuple_GET_ITEM(args, 6) == Py_None;
    const char * fn = public_call ? "ssm_scan_update" : "_ssm_scan_update";
    if (public_call && update_s_arg(fn, PyTuple_GET_ITEM(args, 0))) return NULL;
    scan_call c;
    if (scan_call_parse(fn, args, SCAN_ARG_THREADS | SCAN_ARG_IDS_NONE, &c)) return NULL;
    scan_ctx k = c.k;
    PyArrayObject * y = NULL;
    PyObject * result = NULL;
    if (!update_in_place(&c, PyTuple_GET_ITEM(args, 0))) {
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
 * arguments (validated as by ssm_scan); 0 means the forward takes its decode path (ssm_scan_decode_body.h),
 * which the tests check so that a change cannot turn that path off unnoticed. */
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
                                      "fwd", glue_form_name(ssm_scan_fwd_chunked(p) ? SSM_FORM_CHUNKED : SSM_FORM_RECURRENCE),
                                      "back", glue_form_name(ssm_scan_back_chunked(p) ? SSM_FORM_CHUNKED : SSM_FORM_RECURRENCE),
                                      "back_units", (long long) ssm_scan_back_units(p));
    scan_call_release(&c);
    return result;
}

SSM_GLUE PyMethodDef glue_scan_methods[] = {
    { "ssm_scan", py_ssm_scan, METH_VARARGS,
      "ssm_scan(s, x, dt, A, B, C, ids, K, nthreads, /)\n--\n\nSee ssmgrad.ssm_scan." },
    { "ssm_scan_keep", py_ssm_scan_keep, METH_VARARGS,
      "ssm_scan_keep(s, x, dt, A, B, C, ids, K, nthreads, /)\n--\n\nSee ssmgrad.ssm_scan (keep_states=True)." },
    { "ssm_scan_back", py_ssm_scan_back, METH_VARARGS,
      "ssm_scan_back(s, x, dt, A, B, C, ids, grad, K, return_dA, nthreads, chunk_states, /)\n--\n\n"
      "See ssmgrad.ssm_scan_back." },
    { "_ssm_scan_update", py_ssm_scan_update, METH_VARARGS,
      "_ssm_scan_update(s, x, dt, A, B, C, ids, nthreads, /)\n--\n\nssm_scan (K = 1) writing the final states over s "
      "(private; None where it does not apply)." },
    { "_scan_work_bytes", py_scan_work_bytes, METH_VARARGS,
      "_scan_work_bytes(s, x, dt, A, B, C, ids, K, nthreads, /)\n--\n\nScratch bytes of ssm_scan for these arguments "
      "(0: the decode path)." },
    { "_scan_forms", py_scan_forms, METH_VARARGS,
      "_scan_forms(s, x, dt, A, B, C, ids, K, /)\n--\n\nThe form each scan kernel takes for these arguments "
      "(for benchmarks)." },
    { NULL, NULL, 0, NULL },
};
