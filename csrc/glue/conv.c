/*
 * conv.c -- the bindings of SSM_CONV: ssm_conv, ssm_conv_back, ssm_conv_back_weight (the public API
 * is ssmgrad.ssm_conv & co. in ssmgrad/__init__.py, which passes the thread count).
 *
 *   sx   (n_s, d_inner, d_conv-1+n_t)   the conv state's d_conv-1 columns, then the n_t tokens'
 *   c    (d_inner, d_conv)              the weights
 *   grad (n_s, n_t, d_inner)            the gradient of ssm_conv's output (the backward ones)
 *   result: ssm_conv (n_s, n_t, d_inner); ssm_conv_back sx's shape; ssm_conv_back_weight c's shape
 */
#include "ssm_glue.h"

#include <string.h>

enum { CONV_FWD, CONV_BACK, CONV_WEIGHT };

/* one call: its validated arguments (new references) and the kernels' context */
typedef struct {
    int which, nthreads, typenum;
    PyObject * out_o;                   /* borrowed: None or the caller's buffer */
    PyArrayObject * sx, * c, * g, * out;
    ssm_conv_params p;
    int f64;
    void * work;
} conv_call;

static void conv_task(void * vc, int ith, int nth) {
    conv_call * k = vc;
    const void * sx = PyArray_DATA(k->sx), * c = PyArray_DATA(k->c), * g = k->g ? PyArray_DATA(k->g) : NULL;
    void * out = PyArray_DATA(k->out);
    switch (k->which) {
    case CONV_FWD:
        if (k->f64) ssm_conv_f64(&k->p, sx, c, out, k->work, ith, nth);
        else ssm_conv_f32(&k->p, sx, c, out, k->work, ith, nth);
        break;
    case CONV_BACK:
        if (k->f64) ssm_conv_back_f64(&k->p, c, g, out, k->work, ith, nth);
        else ssm_conv_back_f32(&k->p, c, g, out, k->work, ith, nth);
        break;
    default:
        if (k->f64) ssm_conv_back_weight_f64(&k->p, sx, g, out, k->work, ith, nth);
        else ssm_conv_back_weight_f32(&k->p, sx, g, out, k->work, ith, nth);
    }
}

static void conv_call_release(conv_call * k) {
    work_release(k->work);
    k->work = NULL;
    Py_CLEAR(k->sx);
    Py_CLEAR(k->c);
    Py_CLEAR(k->g);
    Py_CLEAR(k->out);
}

/* the shapes of c, sx and grad against each other; the params from them */
static int conv_check_shapes(const char * fn, conv_call * k) {
    const npy_intp n_s = PyArray_DIM(k->sx, 0), d_inner = PyArray_DIM(k->sx, 1), n_cols = PyArray_DIM(k->sx, 2);
    const npy_intp d_conv = PyArray_DIM(k->c, 1);
    const npy_intp want_c[2] = { d_inner, -1 };
    if (check_shape(fn, "c", k->c, want_c, "(d_inner, d_conv) with d_inner from sx")) return -1;
    if (d_conv < 1) {
        PyErr_Format(PyExc_ValueError, "%s: argument 'c' must have d_conv >= 1 columns, got shape (%lld, 0)",
                     fn, (long long) d_inner);
        return -1;
    }
    if (n_cols < d_conv - 1) {
        PyErr_Format(PyExc_ValueError,
                     "%s: argument 'sx' must have at least d_conv-1 = %lld columns (the conv state), got shape "
                     "(%lld, %lld, %lld)", fn, (long long) (d_conv - 1), (long long) n_s, (long long) d_inner,
                     (long long) n_cols);
        return -1;
    }
    const npy_intp n_t = n_cols - (d_conv - 1);
    const npy_intp want_g[3] = { n_s, n_t, d_inner };
    if (k->g && check_shape(fn, "grad", k->g, want_g, "(n_s, n_t, d_inner), the shape of ssm_conv's output"))
        return -1;
    k->p = (ssm_conv_params) { .n_s = n_s, .d_inner = d_inner, .d_conv = d_conv, .n_t = n_t,
                               .simd = glue_simd_choice() };
    elem_strides(k->sx, k->p.sx_st);
    elem_strides(k->c, k->p.c_st);
    if (k->g) elem_strides(k->g, k->p.g_st);
    k->f64 = k->typenum == NPY_FLOAT64;
    return 0;
}

/* (sx, c[, grad], nthreads[, out]) into k; on error -1 with the exception set (release k) */
static int conv_call_parse(const char * fn, PyObject * args, int which, conv_call * k) {
    static const char * const names[3] = { "sx", "c", "grad" };
    PyObject * o[3] = { NULL, NULL, NULL };
    memset(k, 0, sizeof *k);
    k->which = which;
    k->typenum = -1;
    k->out_o = Py_None;
    if (which == CONV_FWD) {
        if (!PyArg_ParseTuple(args, "OOi|O", &o[0], &o[1], &k->nthreads, &k->out_o)) return -1;
    } else if (!PyArg_ParseTuple(args, "OOOi|O", &o[0], &o[1], &o[2], &k->nthreads, &k->out_o)) {
        return -1;
    }
    if (threads_arg(k->nthreads)) return -1;
    const char * first = NULL;
    dtype_from_arrays(o, names, 3, &k->typenum, &first);
    if (!(k->sx = float_arg(fn, "sx", o[0], 3, "(n_s, d_inner, d_conv-1+n_t)", &k->typenum, &first))) return -1;
    if (!(k->c = float_arg(fn, "c", o[1], 2, "(d_inner, d_conv)", &k->typenum, &first))) return -1;
    if (o[2] && !(k->g = float_arg(fn, "grad", o[2], 3, "(n_s, n_t, d_inner)", &k->typenum, &first))) return -1;
    return conv_check_shapes(fn, k);
}

/* the result: a new array, or the caller's `out` once checked */
static PyArrayObject * conv_out(const char * fn, conv_call * k) {
    const npy_intp y_dims[3] = { (npy_intp) k->p.n_s, (npy_intp) k->p.n_t, (npy_intp) k->p.d_inner };
    const int out_nd = k->which == CONV_WEIGHT ? 2 : 3;
    const npy_intp * out_dims = k->which == CONV_FWD ? y_dims : k->which == CONV_BACK ? PyArray_DIMS(k->sx)
                                                                                       : PyArray_DIMS(k->c);
    if (k->out_o == Py_None) return (PyArrayObject *) PyArray_EMPTY(out_nd, out_dims, k->typenum, 0);
    static const char * const legends[] = { "(n_s, n_t, d_inner), the shape of the result", "the shape of sx",
                                            "the shape of c" };
    static const char * const read_names[3] = { "sx", "c", "grad" };
    PyArrayObject * reads[3] = { k->sx, k->c, k->g };
    return out_arg(fn, k->out_o, out_nd, out_dims, k->typenum, legends[k->which], reads, read_names, 3);
}

static PyObject * conv_common(PyObject * args, int which) {
    static const char * const fns[] = { "ssm_conv", "ssm_conv_back", "ssm_conv_back_weight" };
    const char * fn = fns[which];
    conv_call k;
    if (conv_call_parse(fn, args, which, &k) || !(k.out = conv_out(fn, &k))) {
        conv_call_release(&k);
        return NULL;
    }
    const int nth = clamp_threads(k.nthreads, k.p.d_inner, (double) k.p.n_s * k.p.n_t * k.p.d_inner * k.p.d_conv);
    PyObject * result = NULL;
    if (!run_kernels(nth, ssm_conv_work_size(&k.p, k.f64 ? 8 : 4, nth), &k.work, conv_task, NULL, &k)) {
        result = (PyObject *) k.out;
        k.out = NULL;
    }
    conv_call_release(&k);
    return result;
}

static PyObject * py_ssm_conv(PyObject * self, PyObject * args) { (void) self; return conv_common(args, CONV_FWD); }
static PyObject * py_ssm_conv_back(PyObject * self, PyObject * args) { (void) self; return conv_common(args, CONV_BACK); }
static PyObject * py_ssm_conv_back_weight(PyObject * self, PyObject * args) {
    (void) self;
    return conv_common(args, CONV_WEIGHT);
}

SSM_GLUE PyMethodDef glue_conv_methods[] = {
    { "ssm_conv", py_ssm_conv, METH_VARARGS, "ssm_conv(sx, c, nthreads, out=None, /)\n--\n\nSee ssmgrad.ssm_conv." },
    { "ssm_conv_back", py_ssm_conv_back, METH_VARARGS,
      "ssm_conv_back(sx, c, grad, nthreads, out=None, /)\n--\n\nSee ssmgrad.ssm_conv_back." },
    { "ssm_conv_back_weight", py_ssm_conv_back_weight, METH_VARARGS,
      "ssm_conv_back_weight(sx, c, grad, nthreads, out=None, /)\n--\n\nSee ssmgrad.ssm_conv_back_weight." },
    { NULL, NULL, 0, NULL },
};
