/*
 * gdn.c -- the bindings of GATED_DELTA_NET: gated_delta_net and gated_delta_net_back (the public API
 * is ssmgrad.gated_delta_net in ssmgrad/__init__.py, which passes K, head_bcast and the thread count).
 *
 *   q, k  (n_seqs_k, n_t, H_k, S)      v     (n_seqs, n_t, H_v, S)
 *   g     (n_seqs, n_t, H_v, 1) or (n_seqs, n_t, H_v, S) (per channel)
 *   beta  (n_seqs, n_t, H_v, 1)        state (n_seqs, H_v, S, S)
 *   gated_delta_net       -> (N_o + K*N_s,): o (n_seqs, n_t, H_v, S), then K state slots
 *   gated_delta_net_keep  -> (that, chunk_states): gdn_fwd_keep_*'s chunk states, (0,) where it keeps none
 *   gated_delta_net_back  grad (N_o + K*N_s,) [, chunk_states] -> the six inputs' gradients, packed in their
 *                         order
 *
 * Validated with the checks the scan's bindings use (check.c), run on the kernels of gdn_dispatch.c.
 */
#include "ssm_glue.h"

#include <string.h>

enum { GDN_Q, GDN_K, GDN_V, GDN_G, GDN_BETA, GDN_STATE, GDN_N_IN };

/* one call: its validated arguments and the kernels' context */
typedef struct {
    gdn_params p;
    int f64, nthreads;
    PyArrayObject * arr[GDN_N_IN];   /* new references */
    int typenum;
    const void * in[GDN_N_IN], * grad;
    void * out, * work;
    void * kept;                     /* the chunk states (gdn_fwd_keep_*, gdn_back_kept_*), or NULL */
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

static void gdn_keep_task(void * vc, int ith, int nth) {
    gdn_call * c = vc;
    const void * const * a = c->in;
    if (c->f64) gdn_fwd_keep_f64(&c->p, a[0], a[1], a[2], a[3], a[4], a[5], c->out, c->kept, c->work, ith, nth);
    else gdn_fwd_keep_f32(&c->p, a[0], a[1], a[2], a[3], a[4], a[5], c->out, c->kept, c->work, ith, nth);
}

static void gdn_back_task(void * vc, int ith, int nth) {
    gdn_call * c = vc;
    const void * const * a = c->in;
    if (c->f64)
        gdn_back_kept_f64(&c->p, a[0], a[1], a[2], a[3], a[4], a[5], c->kept, c->grad, c->out, c->work, ith, nth);
    else gdn_back_kept_f32(&c->p, a[0], a[1], a[2], a[3], a[4], a[5], c->kept, c->grad, c->out, c->work, ith, nth);
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
    if (check_divides(fn, "q", "H_k", " heads", 2, H_k, "v's H_v", H_v)) return -1;
    if (n_seqs_k == 0 && n_seqs == 0) return 0;   /* nothing to compute */
    return check_divides(fn, "q", "n_seqs_k", " sequences", 0, n_seqs_k, "v's n_seqs", n_seqs);
}

/* the params and data pointers of validated arguments */
static void gdn_fill(gdn_call * c, long long K, int bcast, int form) {
    PyArrayObject ** arr = c->arr;
    gdn_params * p = &c->p;
    *p = (gdn_params) { .n_seqs = PyArray_DIM(arr[GDN_V], 0), .n_seqs_k = PyArray_DIM(arr[GDN_Q], 0),
                        .n_t = PyArray_DIM(arr[GDN_Q], 1), .H_v = PyArray_DIM(arr[GDN_V], 2),
                        .H_k = PyArray_DIM(arr[GDN_Q], 2), .S = PyArray_DIM(arr[GDN_Q], 3), .K = K,
                        .g_per_channel = PyArray_DIM(arr[GDN_G], 3) != 1, .head_bcast = bcast,
                        .form = form, .simd = glue_simd_choice() };
    int64_t * const st[GDN_N_IN] = { p->q_st, p->k_st, p->v_st, p->g_st, p->beta_st, p->state_st };
    for (int i = 0; i < GDN_N_IN; ++i) {
        elem_strides(arr[i], st[i]);
        c->in[i] = PyArray_DATA(arr[i]);
    }
    c->f64 = c->typenum == NPY_FLOAT64;
}

/* the six float arguments (one dtype, each 4-D) and their shapes against each other */
static int gdn_arrays(const char * fn, PyObject * const * o, gdn_call * c, long long K) {
    static const char * const names[GDN_N_IN] = { "q", "k", "v", "g", "beta", "state" };
    static const char * const legends[GDN_N_IN] = {
        "(n_seqs_k, n_t, H_k, S)", "(n_seqs_k, n_t, H_k, S)", "(n_seqs, n_t, H_v, S)",
        "(n_seqs, n_t, H_v, 1) or (n_seqs, n_t, H_v, S)", "(n_seqs, n_t, H_v, 1)", "(n_seqs, H_v, S, S)",
    };
    const char * first = NULL;
    dtype_from_arrays(o, names, GDN_N_IN, &c->typenum, &first);
    for (int i = 0; i < GDN_N_IN; ++i)
        if (!(c->arr[i] = float_arg(fn, names[i], o[i], 4, legends[i], &c->typenum, &first))) return -1;
    PyArrayObject ** arr = c->arr;
    const npy_intp n_seqs_k = PyArray_DIM(arr[GDN_Q], 0), n_t = PyArray_DIM(arr[GDN_Q], 1);
    const npy_intp H_k = PyArray_DIM(arr[GDN_Q], 2), S = PyArray_DIM(arr[GDN_Q], 3);
    const npy_intp n_seqs = PyArray_DIM(arr[GDN_V], 0), H_v = PyArray_DIM(arr[GDN_V], 2);
    if (gdn_check_shapes(fn, arr, n_seqs, n_t, H_v, S) || gdn_check_bcast(fn, n_seqs_k, n_seqs, H_k, H_v)) return -1;
    static const char * const size_names[5] = { "n_seqs", "n_t", "H_v", "S", NULL };   /* S twice: S x S states */
    const npy_intp sizes[5] = { n_seqs, n_t, H_v, S, S };
    return sizes_fit(fn, 5, size_names, sizes, K);
}

/* Parse (q, k, v, g, beta, state[, grad], K, head_bcast, form, nthreads[, chunk_states]) into c; grad and
 * chunk_states (borrowed) into *grad, *states. */
static int gdn_call_parse(const char * fn, PyObject * args, int takes_grad, gdn_call * c, PyObject ** grad,
                          PyObject ** states) {
    memset(c, 0, sizeof *c);
    c->typenum = -1;
    PyObject * o[GDN_N_IN];
    long long K;
    int bcast, form;
    if (takes_grad) {
        if (!PyArg_ParseTuple(args, "OOOOOOOLiiiO", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], grad, &K, &bcast,
                              &form, &c->nthreads, states)) return -1;
    } else if (!PyArg_ParseTuple(args, "OOOOOOLiii", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &K, &bcast,
                                 &form, &c->nthreads)) {
        return -1;
    }
    if (threads_arg(c->nthreads) || k_arg(fn, K)) return -1;
    if (bcast != GDN_BCAST_TILED && bcast != GDN_BCAST_INTERLEAVED)
        return PyErr_Format(PyExc_ValueError, "%s: head_bcast must be 0 (tiled) or 1 (interleaved), got %d", fn,
                            bcast), -1;
    if (form != SSM_FORM_AUTO && form != SSM_FORM_RECURRENCE && form != SSM_FORM_CHUNKED)
        return PyErr_Format(PyExc_ValueError, "%s: form must be 0 (auto), 1 (recurrence) or 2 (chunked), got %d", fn,
                            form), -1;
    if (gdn_arrays(fn, o, c, K)) return -1;
    gdn_fill(c, K, bcast, form);
    return 0;
}

/* elements of out: o + K slots, or -1 with MemoryError */
static npy_intp gdn_out_size(const gdn_params * p, npy_intp * n_o) {
    *n_o = checked_prod(4, (npy_intp) p->n_seqs, (npy_intp) p->n_t, (npy_intp) p->H_v, (npy_intp) p->S);
    if (*n_o < 0) return -1;
    const npy_intp n_s = checked_prod(5, (npy_intp) p->K, (npy_intp) p->n_seqs, (npy_intp) p->H_v, (npy_intp) p->S,
                                      (npy_intp) p->S);
    return n_s < 0 ? -1 : checked_sum(*n_o, n_s);
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
    const Py_ssize_t nargs = PyTuple_GET_SIZE(args);
    if (nargs == 11) {   /* the optional trailing out (None: a fresh array) */
        out_o = PyTuple_GET_ITEM(args, 10);
        args = PyTuple_GetSlice(args, 0, 10);
        if (!args) return NULL;
    } else {
        Py_INCREF(args);
    }
    const int parsed = gdn_call_parse("gated_delta_net", args, 0, &c, NULL, NULL);
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
    c.out = PyArray_DATA(out);
    if (run_kernels(nth, gdn_fwd_work_size(&c.p, c.f64 ? 8 : 4, nth), &c.work, gdn_fwd_task, NULL, &c)) goto error;
    result = (PyObject *) out;
    out = NULL;
error:   /* and the way out on success: result holds the reference to return */
    work_release(c.work);
    gdn_call_release(&c);
    Py_XDECREF(out);
    return result;
}

/* the shape of the chunk states a forward with these params keeps (gdn_chunk_states): 4 dims, or 1 dim of 0
   where it keeps none; returns the number of dims */
static int gdn_states_dims(const gdn_params * p, npy_intp * dims) {
    const int64_t n = gdn_chunk_states(p), per = p->n_seqs * p->H_v * ((p->n_t + 63) / 64);
    if (n == 0 || per == 0) {
        dims[0] = 0;
        return 1;
    }
    dims[0] = p->n_seqs;
    dims[1] = p->H_v;
    dims[2] = ((p->n_t + 63) / 64);
    dims[3] = n / per;
    return 4;
}

/* _gated_delta_net_keep: gated_delta_net, and the chunk states the backward can read (gdn_fwd_keep_*):
 * (out, chunk_states), chunk_states (n_seqs, H_v, ceil(n_t / 64), E), or (0,) where the call keeps none */
static PyObject * py_gated_delta_net_keep(PyObject * self, PyObject * args) {
    (void) self;
    gdn_call c;
    PyArrayObject * out = NULL, * kept = NULL;
    PyObject * result = NULL;
    if (gdn_call_parse("gated_delta_net", args, 0, &c, NULL, NULL)) goto error;
    npy_intp n_o, dims[4];
    const npy_intp n_out = gdn_out_size(&c.p, &n_o);
    if (n_out < 0 || !(out = (PyArrayObject *) PyArray_EMPTY(1, &n_out, c.typenum, 0))) goto error;
    {   /* the slots ggml leaves to the caller are 0 here (with K == 1 slot 0 is always written) */
        const int64_t lo = c.p.K == 1 ? 1 : (c.p.n_t < c.p.K ? c.p.n_t : c.p.K);
        const size_t slot = (size_t) (c.p.n_seqs * c.p.H_v * c.p.S * c.p.S) * PyArray_ITEMSIZE(out);
        memset(PyArray_BYTES(out) + (size_t) n_o * PyArray_ITEMSIZE(out) + lo * slot, 0, (size_t) (c.p.K - lo) * slot);
    }
    const int nd = gdn_states_dims(&c.p, dims);
    if (!(kept = aligned_empty(nd, dims, c.typenum))) goto error;
    const int nth = clamp_threads(c.nthreads, c.p.n_seqs * c.p.H_v, gdn_work(&c.p));
    c.out = PyArray_DATA(out);
    c.kept = PyArray_DATA(kept);
    if (run_kernels(nth, gdn_fwd_work_size(&c.p, c.f64 ? 8 : 4, nth), &c.work, gdn_keep_task, NULL, &c)) goto error;
    result = PyTuple_Pack(2, (PyObject *) out, (PyObject *) kept);
error:   /* and the way out on success: result holds the references to return */
    work_release(c.work);
    gdn_call_release(&c);
    Py_XDECREF(out);
    Py_XDECREF(kept);
    return result;
}

/* gated_delta_net_back's chunk_states: None, or where the call reads them (gdn_chunk_states > 0) the forward's,
 * of the shape gdn_states_dims gives, as a dense array (a new reference in *arr); ignored elsewhere */
static int gdn_states_arg(const char * fn, gdn_call * c, PyObject * states, PyArrayObject ** arr) {
    *arr = NULL;
    if (states == Py_None || gdn_chunk_states(&c->p) == 0) return 0;
    npy_intp dims[4];
    const int nd = gdn_states_dims(&c->p, dims);
    const char * first = "q";
    const char * legend = "(n_seqs, H_v, ceil(n_t / 64), E), gated_delta_net(keep_states=True)'s";
    PyArrayObject * a = float_arg(fn, "chunk_states", states, nd, legend, &c->typenum, &first);
    if (!a) return -1;
    if (check_shape(fn, "chunk_states", a, dims, legend)) {
        Py_DECREF(a);
        return -1;
    }
    *arr = PyArray_GETCONTIGUOUS(a);
    Py_DECREF(a);
    return *arr ? 0 : -1;
}

/* grad as a dense 1-D array of out's size (a strided one is packed) */
static PyArrayObject * gdn_grad_arg(const char * fn, PyObject * obj, npy_intp n_out, int * typenum) {
    const char * first = "q";
    PyArrayObject * g = dense_vector_arg(fn, "grad", obj, "(N_o + K*N_s,), the packed gradient of gated_delta_net's "
                                         "output", typenum, &first);
    const npy_intp want[1] = { n_out };
    if (g && check_shape(fn, "grad", g, want, "(N_o + K*N_s,), the size of gated_delta_net's packed output"))
        Py_CLEAR(g);
    return g;
}

static PyObject * py_gated_delta_net_back(PyObject * self, PyObject * args) {
    (void) self;
    const char * fn = "gated_delta_net_back";
    gdn_call c;
    PyObject * grad_o = NULL, * states_o = NULL, * result = NULL;
    PyArrayObject * g = NULL, * gin = NULL, * kept = NULL;
    if (gdn_call_parse(fn, args, 1, &c, &grad_o, &states_o)) goto error;
    npy_intp n_o;
    const npy_intp n_out = gdn_out_size(&c.p, &n_o);
    if (n_out < 0 || !(g = gdn_grad_arg(fn, grad_o, n_out, &c.typenum))) goto error;
    if (gdn_states_arg(fn, &c, states_o, &kept)) goto error;
    c.kept = kept ? PyArray_DATA(kept) : NULL;
    const npy_intp n_gin = sizes_sum(c.arr, GDN_N_IN);
    if (n_gin < 0 || !(gin = (PyArrayObject *) PyArray_EMPTY(1, &n_gin, c.typenum, 0))) goto error;
    const int nth = clamp_threads(c.nthreads, gdn_back_units(&c.p), 4.0 * gdn_work(&c.p));
    c.grad = PyArray_DATA(g);
    c.out = PyArray_DATA(gin);
    if (run_kernels(nth, gdn_back_work_size(&c.p, c.f64 ? 8 : 4, nth), &c.work, gdn_back_task, NULL, &c)) goto error;
    result = (PyObject *) gin;
    gin = NULL;
error:
    work_release(c.work);
    gdn_call_release(&c);
    Py_XDECREF(g);
    Py_XDECREF(gin);
    Py_XDECREF(kept);
    return result;
}

SSM_GLUE PyMethodDef glue_gdn_methods[] = {
    { "gated_delta_net", py_gated_delta_net, METH_VARARGS,
      "gated_delta_net(q, k, v, g, beta, state, K, head_bcast, form, nthreads, out=None, /)\n--\n\n"
      "See ssmgrad.gated_delta_net." },
    { "gated_delta_net_keep", py_gated_delta_net_keep, METH_VARARGS,
      "gated_delta_net_keep(q, k, v, g, beta, state, K, head_bcast, form, nthreads, /)\n--\n\n"
      "See ssmgrad.gated_delta_net (keep_states=True)." },
    { "gated_delta_net_back", py_gated_delta_net_back, METH_VARARGS,
      "gated_delta_net_back(q, k, v, g, beta, state, grad, K, head_bcast, form, nthreads, chunk_states, /)\n--\n\n"
      "See ssmgrad.gated_delta_net_back." },
    { NULL, NULL, 0, NULL },
};
