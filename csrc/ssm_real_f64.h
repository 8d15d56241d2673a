/*
 * ssm_real_f64.h -- the float64 element type of a kernel body (csrc/<op>_<form>_body.h).
 *
 * An instantiation file (csrc/inst/<op>_f64_v<N>.c) includes this header before the body: the
 * body is written once for `real` and calls these plain-named helpers, never pasted names.
 */
#ifndef SSM_REAL_H
#define SSM_REAL_H

#include <math.h>

typedef double real;

/* lanes of the running sums of dot products: one AVX-512 register of doubles */
#define REAL_LANES 8

static inline real real_exp(real x) { return exp(x); }
static inline real real_sqrt(real x) { return sqrt(x); }

#else
#error "one element type per translation unit: ssm_real_f64.h after another ssm_real_*.h"
#endif
