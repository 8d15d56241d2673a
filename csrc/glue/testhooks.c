/*
 * testhooks.c -- private functions of the module that only the tests call: they reach parts of the
 * glue and of the kernels that the public functions cannot show on their own.
 *
 *   _scratch_stress(nthreads, rounds)   the scratch cache (scratch.c) from many threads without the GIL
 *   _serial_after_fork()                whether this process is a fork child that runs calls serially
 *   _vmath(name, a)                     the kernels' own exp and softplus, to hold them to their error
 */
#include "ssm_glue.h"

#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <string.h>

#include "ssm_common.h"   /* ssm_expf & co. (internal) */

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

/* _serial_after_fork(): True in a child forked after this process ran an OpenMP team, where every
 * call runs its thread slices serially (see run_threads, threads.c) */
static PyObject * py_serial_after_fork(PyObject * self, PyObject * noargs) {
    (void) self;
    (void) noargs;
    return PyBool_FromLong(threads_serial_after_fork());
}

enum { VM_EXP, VM_EXP_FAST, VM_SOFTPLUS, VM_SOFTPLUS_IN, VM_DSOFTPLUS, VM_DSOFTPLUS_IN, VM_N };
static const char * const vmath_names[VM_N] = { "exp", "exp_fast", "softplus", "softplus_in", "dsoftplus",
                                                "dsoftplus_in" };

/* exp_fast and *_in only where they apply: NaN elsewhere */
static void vmath_f32(int f, const float * in, float * o, npy_intp n) {
    for (npy_intp i = 0; i < n; ++i) {
        const int in_sp = in[i] >= -SSM_EXPF_FAST_MAX;
        o[i] = f == VM_EXP ? ssm_expf(in[i]) : f == VM_SOFTPLUS ? ssm_softplus_fast_f32(in[i])
             : f == VM_DSOFTPLUS ? ssm_dsoftplus_f32(in[i])
             : f == VM_SOFTPLUS_IN ? (in_sp ? ssm_softplus_inrange_f32(in[i]) : NAN)
             : f == VM_DSOFTPLUS_IN ? (in_sp ? ssm_dsoftplus_inrange_f32(in[i]) : NAN)
             : (in_sp && in[i] <= SSM_EXPF_FAST_MAX) ? ssm_expf_fast(in[i]) : NAN;
    }
}

/* float64 has no separate in-range softplus: the _in names give the full ones */
static void vmath_f64(int f, const double * in, double * o, npy_intp n) {
    for (npy_intp i = 0; i < n; ++i)
        o[i] = f == VM_EXP ? ssm_exp_f64(in[i]) : f == VM_SOFTPLUS || f == VM_SOFTPLUS_IN ? ssm_softplus_f64(in[i])
             : f == VM_DSOFTPLUS || f == VM_DSOFTPLUS_IN ? ssm_dsoftplus_f64(in[i])
             : (in[i] >= -SSM_EXP_FAST_MAX_F64 && in[i] <= SSM_EXP_FAST_MAX_F64) ? ssm_exp_fast_f64(in[i]) : NAN;
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
    int f = 0;
    while (f < VM_N && strcmp(name, vmath_names[f]) != 0) ++f;
    if (f == VM_N) {
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
    if (out && t == NPY_FLOAT32) vmath_f32(f, PyArray_DATA(a), PyArray_DATA(out), PyArray_SIZE(a));
    else if (out) vmath_f64(f, PyArray_DATA(a), PyArray_DATA(out), PyArray_SIZE(a));
    Py_DECREF(a);
    return (PyObject *) out;
}

SSM_GLUE PyMethodDef glue_testhooks_methods[] = {
    { "_scratch_stress", py_scratch_stress, METH_VARARGS,
      "_scratch_stress(nthreads, rounds, /)\n--\n\nHammer the scratch cache from nthreads threads (for tests)." },
    { "_serial_after_fork", py_serial_after_fork, METH_NOARGS,
      "_serial_after_fork()\n--\n\nTrue in a fork child that runs its calls serially (for tests)." },
    { "_vmath", py_vmath, METH_VARARGS,
      "_vmath(name, a, /)\n--\n\nThe kernels' 'exp', 'exp_fast' or 'softplus' applied to a (for tests)." },
    { NULL, NULL, 0, NULL },
};
