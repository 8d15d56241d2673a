/*
 * module.c -- the extension module _ssmgrad: the CPython/NumPy glue of ssmgrad's kernels.
 *
 * Each binding parses and validates every argument (TypeError for dtypes, ValueError naming the
 * argument with expected vs actual shape, ValueError for ids out of range, MemoryError when memory
 * cannot be had), allocates outputs and scratch, then releases the GIL and runs the kernels on
 * nthreads threads (OpenMP when the build has it). The public, documented API is the Python layer
 * in ssmgrad/__init__.py, which passes the thread count. What each glue file does: ssm_glue.h.
 */
#define SSM_GLUE_IMPORTS_NUMPY   /* this file fills NumPy's C API table that the glue files share */
#include "ssm_glue.h"

static int module_exec(PyObject * m) {
    if (PyArray_ImportNumPyAPI() < 0) return -1;
    threads_init();
    settings_from_env();
    PyMethodDef * const tables[] = { glue_conv_methods, glue_scan_methods, glue_gdn_methods, glue_settings_methods,
                                     glue_testhooks_methods };
    for (size_t i = 0; i < sizeof tables / sizeof tables[0]; ++i)
        if (PyModule_AddFunctions(m, tables[i]) < 0) return -1;
    return 0;
}

static PyModuleDef_Slot slots[] = {
    { Py_mod_exec, module_exec },
#ifdef Py_mod_multiple_interpreters
    { Py_mod_multiple_interpreters, Py_MOD_MULTIPLE_INTERPRETERS_NOT_SUPPORTED },
#endif
#ifdef Py_mod_gil
    { Py_mod_gil, Py_MOD_GIL_NOT_USED },
#endif
    { 0, NULL },
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "_ssmgrad", "C kernels of ssmgrad (use the ssmgrad package).", 0, NULL, slots,
    NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__ssmgrad(void) { return PyModuleDef_Init(&moduledef); }
