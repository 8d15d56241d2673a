/*
 * gdn_module.c -- the CPython/NumPy glue of GATED_DELTA_NET: _ssmgrad.gated_delta_net and
 * _ssmgrad.gated_delta_net_back (the public API is ssmgrad.gated_delta_net in ssmgrad/__init__.py).
 *
 * Validates every argument (TypeError for dtypes, ValueError naming the argument with expected vs
 * actual shape, MemoryError when memory cannot be had), allocates the packed output and the
 * scratch, then releases the GIL and runs the kernels (gdn_dispatch.c) on the thread runner of
 * ssmgrad_module.c, whose helpers it shares (ssm_glue.h).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define NPY_NO_DEPRECATED_API NPY_2_0_API_VERSION
#include <numpy/arrayobject.h>

#include <string.h>

#include "ssmgrad.h"
#include "ssm_glue.h"

enum { GDN_Q, GDN_K, GDN_V, GDN_G, GDN_BETA, GDN_STATE, GDN_N_IN };

/* one call: its validated arguments and the kernels' context */
typedef struct {
    gdn_params p;
    int f64, nthreads;
    PyArrayObject * arr[GDN_N_IN];   /* new references */
    int typenum;
    const void * in[GDN_N_IN], * grad;
    void * out, * work;
} gdn_call;

static void gdn_call_release(gdn_call * c) {
    for (int i = 0; i < GDN_N_IN; ++i) Py_CLEAR(c->arr[i]);
}

static void gdn_fwd_task(void * vc, int ith, int nth) {
    gdn_call * c = vc;
    const void * const * a = c->in;
    if (c->f64) gdn_fwd_f64(&c->p, a[0], a[1], a[2], a[3], a[4], a[5], c->out, c->work, ith, nth);
    else gdn_fwd_f32(&c->p, a[0], a[1], a[2], a[3], a[4], a[5], c->out, c->work, ith, nth);
}

static void gdn_back_task(void * vc, int ith, int nth) {
    gdn_call * c = vc;
    const void * const * a = c->in;
    if (c->f64) gdn_back_f64(&c->p, a[0], a[1], a[2], a[3], a[4], a[5], c->grad, c->out, c->work, ith, nth);
    else gdn_back_f32(&c->p, a[0], a[1], a[2], a[3], a[4], a[5], c->grad, c->out, c->work, ith, nth);
}

/* the shapes of v, g, beta, state and k against the sizes q and v give */
static int gdn_check_shapes(const char * fn, PyArrayObject ** arr, npy_intp n_seqs, npy_intp n_t, npy_intp H_v,
                            npy_intp S) {
    const npy_intp want_k[4] = { PyArray_DIM(arr[GDN_Q], 0), n_t, PyArray_DIM(arr[GDN_Q], 2), S };
    if (check_shape(fn, "k", arr[GDN_K], want_k, "(n_seqs_k, n_t, H_k, S), the shape of q")) return -1;
    const npy_intp want_v[4] = { -1, n_t, -1, S };
    if (check_shape(fn, "v", arr[GDN_V], want_v, "(n_seqs, n_t, H_v, S) with n_t, S from q")) return -1;
    const npy_intp G = PyArray_DIM(arr[GDN_G], 3);
    const npy_intp want_g[4] = { n_seqs, n_t, H_v, G == 1 ? 1 : S };
    if (check_shape(fn, "g", arr[GDN_G], want_g, "(n_seqs, n_t, H_v, 1) or (n_seqs, n_t, H_v, S) (per channel)"))
        return -1;
    const npy_intp want_b[4] = { n_seqs, n_t, H_v, 1 };
    if (check_shape(fn, "beta", arr[GDN_BETA], want_b, "(n_seqs, n_t, H_v, 1)")) return -1;
    const npy_intp want_s[4] = { n_seqs, H_v, S, S };
    return check_shape(fn, "state", arr[GDN_STATE], want_s, "(n_seqs, H_v, S, S)");
}

/* the head and sequence broadcasts: H_k >= 1 divides H_v, n_seqs_k >= 1 divides n_seqs (or both are 0) */
static int gdn_check_bcast(const char * fn, npy_intp n_seqs_k, npy_intp n_seqs, npy_intp H_k, npy_intp H_v) {
    if (H_k == 0 && H_v == 0) return n_seqs_k == 0 && n_seqs == 0 ? 0 : gdn_check_bcast(fn, n_seqs_k, n_seqs, 1, 0);
    if (H_k < 1 || H_v % H_k != 0) {
        PyErr_Format(PyExc_ValueError, "%s: argument 'q' has H_k = %lld heads (its axis 2), which must be >= 1 and "
                     "divide v's H_v = %lld", fn, (long long) H_k, (long long) H_v);
        return -1;
    }
    if (n_seqs_k == 0 && n_seqs == 0) return 0;   /* nothing to compute */
    if (n_seqs_k < 1 || n_seqs % n_seqs_k != 0) {
        PyErr_Format(PyExc_ValueError, "%s: argument 'q' has n_seqs_k = %lld sequences (its axis 0), which must be "
                     ">= 1 and divide v's n_seqs = %lld", fn, (long long) n_seqs_k, (long long) n_seqs);
        return -1;
    }
    return 0;
}

/* Parse (q, k, v, g, beta, state[, grad], K, head_bcast, nthreads) into c; grad (borrowed) into *grad. */
static int gdn_call_parse(const char * fn, PyObject * args, int takes_grad, gdn_call * c, PyObject ** grad) {
    static const char * names[GDN_N_IN] = { "q", "k", "v", "g", "beta", "state" };
    static const char * legends[GDN_N_IN] = {
        "(n_seqs_k, n_t, H_k, S)", "(n_seqs_k, n_t, H_k, S)", "(n_seqs, n_t, H_v, S)",
        "(n_seqs, n_t, H_v, 1) or (n_seqs, n_t, H_v, S)", "(n_seqs, n_t, H_v, 1)", "(n_seqs, H_v, S, S)",
    };
    memset(c, 0, sizeof *c);
    c->typenum = -1;
    PyObject * o[GDN_N_IN];
    long long K;
    int bcast;
    if (takes_grad) {
        if (!PyArg_ParseTuple(args, "OOOOOOOLii", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], grad, &K, &bcast,
                              &c->nthreads)) return -1;
    } else if (!PyArg_ParseTuple(args, "OOOOOOLii", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &K, &bcast,
                                 &c->nthreads)) {
        return -1;
    }
    if (threads_arg(c->nthreads)) return -1;
    if (K < 1) return PyErr_Format(PyExc_ValueError, "%s: K must be >= 1, got %lld", fn, K), -1;
    if (bcast != GDN_BCAST_TILED && bcast != GDN_BCAST_INTERLEAVED)
        return PyErr_Format(PyExc_ValueError, "%s: head_bcast must be 0 (tiled) or 1 (interleaved), got %d", fn,
                            bcast), -1;
    const char * first = NULL;
    for (int i = 0; i < GDN_N_IN; ++i) {
        c->arr[i] = float_arg(fn, names[i], o[i], 4, legends[i], &c->typenum, &first);
        if (!c->arr[i]) return -1;
    }
    PyArrayObject ** arr = c->arr;
    const npy_intp n_seqs_k = PyArray_DIM(arr[GDN_Q], 0), n_t = PyArray_DIM(arr[GDN_Q], 1);
    const npy_intp H_k = PyArray_DIM(arr[GDN_Q], 2), S = PyArray_DIM(arr[GDN_Q], 3);
    const npy_intp n_seqs = PyArray_DIM(arr[GDN_V], 0), H_v = PyArray_DIM(arr[GDN_V], 2);
    if (gdn_check_shapes(fn, arr, n_seqs, n_t, H_v, S) || gdn_check_bcast(fn, n_seqs_k, n_seqs, H_k, H_v)) return -1;
    const double est = ((double) n_seqs + 1) * ((double) n_t + 1) * ((double) H_v + 1) * ((double) S + 1) *
                       ((double) S + 1) * (double) K * 64.0;
    if (est > 4e18)
        return PyErr_Format(PyExc_MemoryError, "%s: sizes too large to compute (n_seqs=%lld, n_t=%lld, H_v=%lld, "
                            "S=%lld, K=%lld)", fn, (long long) n_seqs, (long long) n_t, (long long) H_v,
                            (long long) S, K), -1;
    gdn_params * p = &c->p;
    *p = (gdn_params) { .n_seqs = n_seqs, .n_seqs_k = n_seqs_k, .n_t = n_t, .H_v = H_v, .H_k = H_k, .S = S, .K = K,
                        .g_per_channel = PyArray_DIM(arr[GDN_G], 3) != 1, .head_bcast = bcast,
                        .form = SSM_FORM_RECURRENCE, .simd = glue_simd_choice() };
    elem_strides(arr[GDN_Q], p->q_st);
    elem_strides(arr[GDN_K], p->k_st);
    elem_strides(arr[GDN_V], p->v_st);
    elem_strides(arr[GDN_G], p->g_st);
    elem_strides(arr[GDN_BETA], p->beta_st);
    elem_strides(arr[GDN_STATE], p->state_st);
    c->f64 = c->typenum == NPY_FLOAT64;
    for (int i = 0; i < GDN_N_IN; ++i) c->in[i] = PyArray_DATA(arr[i]);
    return 0;
}

/* elements of out: o + K slots, or -1 with MemoryError */
static npy_intp gdn_out_size(const gdn_params * p, npy_intp * n_o) {
    *n_o = checked_prod(4, (npy_intp) p->n_seqs, (npy_intp) p->n_t, (npy_intp) p->H_v, (npy_intp) p->S);
    const npy_intp n_s = checked_prod(5, (npy_intp) p->K, (npy_intp) p->n_seqs, (npy_intp) p->H_v, (npy_intp) p->S,
                                      (npy_intp) p->S);
    if (*n_o < 0 || n_s < 0) return -1;
    if (*n_o > NPY_MAX_INTP - n_s) {
        PyErr_SetString(PyExc_MemoryError, "ssmgrad: array sizes overflow the address space");
        return -1;
    }
    return *n_o + n_s;
}

/* multiply-adds of one forward */
static double gdn_work(const gdn_params * p) {
    return 4.0 * (double) p->n_seqs * (double) p->n_t * (double) p->H_v * (double) p->S * (double) p->S;
}

static PyObject * py_gated_delta_net(PyObject * self, PyObject * args) {
    (void) self;
    gdn_call c;
    PyArrayObject * out = NULL;
    PyObject * result = NULL, * out_o = Py_None;
    void * work = NULL;
    const Py_ssize_t nargs = PyTuple_GET_SIZE(args);
    if (nargs == 10) {   /* the optional trailing out (None: a fresh array) */
        out_o = PyTuple_GET_ITEM(args, 9);
        args = PyTuple_GetSlice(args, 0, 9);
        if (!args) return NULL;
    } else {
        Py_INCREF(args);
    }
    const int parsed = gdn_call_parse("gated_delta_net", args, 0, &c, NULL);
    Py_DECREF(args);
    if (parsed) goto error;
    npy_intp n_o;
    const npy_intp n_out = gdn_out_size(&c.p, &n_o);
    if (n_out < 0) goto error;
    if (out_o != Py_None) {
        static const char * names[GDN_N_IN] = { "q", "k", "v", "g", "beta", "state" };
        out = out_arg("gated_delta_net", out_o, 1, &n_out, c.typenum, "(N_o + K*N_s,), the packed output's size",
                      c.arr, names, GDN_N_IN);
    } else {
        out = (PyArrayObject *) PyArray_EMPTY(1, &n_out, c.typenum, 0);
    }
    if (!out) goto error;
    {   /* the slots ggml leaves to the caller are 0 here (with K == 1 slot 0 is always written) */
        const int64_t lo = c.p.K == 1 ? 1 : (c.p.n_t < c.p.K ? c.p.n_t : c.p.K);
        const size_t slot = (size_t) (c.p.n_seqs * c.p.H_v * c.p.S * c.p.S) * PyArray_ITEMSIZE(out);
        memset(PyArray_BYTES(out) + (size_t) n_o * PyArray_ITEMSIZE(out) + lo * slot, 0, (size_t) (c.p.K - lo) * slot);
    }
    const int nth = clamp_threads(c.nthreads, c.p.n_seqs * c.p.H_v, gdn_work(&c.p));
    work = work_alloc(gdn_fwd_work_size(&c.p, c.f64 ? 8 : 4, nth));
    if (!work) {
        PyErr_NoMemory();
        goto error;
    }
    c.out = PyArray_DATA(out);
    c.work = work;
    Py_BEGIN_ALLOW_THREADS
    run_threads(nth, gdn_fwd_task, NULL, &c);
    Py_END_ALLOW_THREADS
    result = (PyObject *) out;
    out = NULL;
error:   /* and the way out on success: result holds the reference to return */
    work_release(work);
    gdn_call_release(&c);
    Py_XDECREF(out);
    return result;
}

/* grad as a dense 1-D array of out's size (a strided one is packed) */
static PyArrayObject * gdn_grad_arg(const char * fn, PyObject * obj, npy_intp n_out, int * typenum) {
    const char * first = "q";
    PyArrayObject * g = float_arg(fn, "grad", obj, 1, "(N_o + K*N_s,), the packed gradient of gated_delta_net's "
                                  "output", typenum, &first);
    if (!g) return NULL;
    const npy_intp want[1] = { n_out };
    if (check_shape(fn, "grad", g, want, "(N_o + K*N_s,), the size of gated_delta_net's packed output")) {
        Py_DECREF(g);
        return NULL;
    }
    PyArrayObject * dense = PyArray_GETCONTIGUOUS(g);
    Py_DECREF(g);
    return dense;
}

static PyObject * py_gated_delta_net_back(PyObject * self, PyObject * args) {
    (void) self;
    const char * fn = "gated_delta_net_back";
    gdn_call c;
    PyObject * grad_o = NULL, * result = NULL;
    PyArrayObject * g = NULL, * gin = NULL;
    void * work = NULL;
    if (gdn_call_parse(fn, args, 1, &c, &grad_o)) goto error;
    npy_intp n_o, n_gin = 0;
    const npy_intp n_out = gdn_out_size(&c.p, &n_o);
    if (n_out < 0) goto error;
    if (!(g = gdn_grad_arg(fn, grad_o, n_out, &c.typenum))) goto error;
    for (int i = 0; i < GDN_N_IN; ++i)
        if (__builtin_add_overflow(n_gin, PyArray_SIZE(c.arr[i]), &n_gin)) {
            PyErr_SetString(PyExc_MemoryError, "ssmgrad: array sizes overflow the address space");
            goto error;
        }
    gin = (PyArrayObject *) PyArray_EMPTY(1, &n_gin, c.typenum, 0);
    if (!gin) goto error;
    const int nth = clamp_threads(c.nthreads, gdn_back_units(&c.p), 4.0 * gdn_work(&c.p));
    work = work_alloc(gdn_back_work_size(&c.p, c.f64 ? 8 : 4, nth));
    if (!work) {
        PyErr_NoMemory();
        goto error;
    }
    c.grad = PyArray_DATA(g);
    c.out = PyArray_DATA(gin);
    c.work = work;
    Py_BEGIN_ALLOW_THREADS
    run_threads(nth, gdn_back_task, NULL, &c);
    Py_END_ALLOW_THREADS
    result = (PyObject *) gin;
    gin = NULL;
error:
    work_release(work);
    gdn_call_release(&c);
    Py_XDECREF(g);
    Py_XDECREF(gin);
    return result;
}

static PyMethodDef gdn_methods[] = {
    { "gated_delta_net", py_gated_delta_net, METH_VARARGS,
      "gated_delta_net(q, k, v, g, beta, state, K, head_bcast, nthreads, out=None, /)\n--\n\n"
      "See ssmgrad.gated_delta_net." },
    { "gated_delta_net_back", py_gated_delta_net_back, METH_VARARGS,
      "gated_delta_net_back(q, k, v, g, beta, state, grad, K, head_bcast, nthreads, /)\n--\n\n"
      "See ssmgrad.gated_delta_net_back." },
    { NULL, NULL, 0, NULL },
};

int gdn_module_add(PyObject * m) {
    if (PyArray_ImportNumPyAPI() < 0) return -1;   /* this file's own pointer to NumPy's C API */
    return PyModule_AddFunctions(m, gdn_methods);
}
