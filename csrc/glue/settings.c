/*
 * settings.c -- what every call puts into its kernels' params, and the module's build facts.
 *
 * The scan's forms and the SIMD pass go into every call's params (ssmgrad.h; zero is automatic),
 * from these defaults: set once from the environment at import (settings_from_env, the one place
 * that reads SSMGRAD_SIMD, SSMGRAD_NO_AVX512, SSMGRAD_SCAN_FWD and SSMGRAD_SCAN_BACK), changed by the
 * private functions _set_scan_fwd, _set_scan_back and _set_simd (tests, benchmarks). A call copies
 * them into its params before it releases the GIL, so its work size and its kernels see one choice.
 * The work per thread (clamp_threads, threads.c) likewise, changed by _set_min_work_per_thread.
 */
#include "ssm_glue.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char * const form_names[] = { "auto", "recurrence", "chunked" };   /* indexed by SSM_FORM_* */
static const char * const simd_names[] = { "auto", "x86-64", "x86-64-v3", "v4-no-vec64" };   /* by SSM_SIMD_* */
#define N_FORMS ((int) (sizeof form_names / sizeof form_names[0]))
#define N_SIMDS ((int) (sizeof simd_names / sizeof simd_names[0]))
static atomic_int scan_fwd_form = SSM_FORM_AUTO;
static atomic_int scan_back_form = SSM_FORM_AUTO;
static atomic_int simd_choice = SSM_SIMD_AUTO;

/* Below this many multiply-adds (state updates for the scan) per thread, a thread costs more than
 * it saves: waking a sleeping OpenMP thread takes tens of microseconds, and on a machine with
 * other busy processes a thread may wait milliseconds for a core while the call waits for it.
 * 2^18 is 20 us (Mamba-2 forward, compute-bound) to 260 us (one decode token, memory-bound) of
 * one core's work; measured, a Mamba-2-130m decode step (n_t = 1, 2^17.6 updates) ran no faster
 * on 2 threads than on 1. Results do not depend on it. Tests lower it (_set_min_work_per_thread)
 * to run the threaded paths at small shapes. */
#define MIN_WORK_PER_THREAD_DEFAULT (1L << 18)
static atomic_long min_work_per_thread = MIN_WORK_PER_THREAD_DEFAULT;

SSM_GLUE int64_t glue_simd_choice(void) { return atomic_load(&simd_choice); }
SSM_GLUE int64_t glue_scan_fwd_form(void) { return atomic_load(&scan_fwd_form); }
SSM_GLUE int64_t glue_scan_back_form(void) { return atomic_load(&scan_back_form); }
SSM_GLUE long glue_min_work_per_thread(void) { return atomic_load_explicit(&min_work_per_thread, memory_order_relaxed); }
SSM_GLUE const char * glue_form_name(int form) { return form_names[form]; }

/* index of name in names[0..n), or -1 */
static int name_index(const char * const * names, int n, const char * name) {
    for (int i = 0; name && i < n; ++i)
        if (!strcmp(name, names[i])) return i;
    return -1;
}

/* unset or unknown values leave the automatic choice */
SSM_GLUE void settings_from_env(void) {
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

SSM_GLUE PyMethodDef glue_settings_methods[] = {
    { "build_info", py_build_info, METH_NOARGS, "build_info()\n--\n\nOpenMP and SIMD facts of this build." },
    { "_set_min_work_per_thread", py_set_min_work_per_thread, METH_VARARGS,
      "_set_min_work_per_thread(n, /)\n--\n\nWork per thread below which calls use fewer threads; returns the old "
      "value (for tests)." },
    { "_set_scan_back", py_set_scan_back, METH_VARARGS,
      "_set_scan_back(mode, /)\n--\n\nForm of the Mamba-2 scan backward: 'auto', 'recurrence' or 'chunked' "
      "(SSMGRAD_SCAN_BACK); returns the previous one (for tests and benchmarks)." },
    { "_set_scan_fwd", py_set_scan_fwd, METH_VARARGS,
      "_set_scan_fwd(mode, /)\n--\n\nForm of the Mamba-2 scan forward: 'auto', 'recurrence' or 'chunked' "
      "(SSMGRAD_SCAN_FWD); returns the previous one (for tests and benchmarks)." },
    { "_set_simd", py_set_simd, METH_VARARGS,
      "_set_simd(name, /)\n--\n\nSIMD pass of the kernels: 'auto', 'x86-64', 'x86-64-v3' or 'v4-no-vec64' (a cap, "
      "as SSMGRAD_SIMD and SSMGRAD_NO_AVX512); returns the previous one (for tests)." },
    { NULL, NULL, 0, NULL },
};
