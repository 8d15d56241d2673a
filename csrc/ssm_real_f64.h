/*
 * ssm_real_f64.h -- the float64 element type of a kernel body (csrc/<op>_<form>_body.h).
 *
 * An instantiation file (csrc/inst/<op>_f64_v<N>.c) includes this header before the body: the
 * body is written once for `real` and calls these plain-named helpers, never pasted names.
 * One element type per translation unit (the guard below refuses a second).
 */
#ifndef SSM_REAL_H
#define SSM_REAL_H

#include <math.h>

#include "ssm_common.h"

typedef double real;

/* reals in one 64-byte vector (one AVX-512 register), as a preprocessor number */
#define REAL_LANES 8

/* running sums of a dot product: one AVX-512 register of doubles */
#define REAL_DOT_LANES 8

static inline real real_exp(real x) { return exp(x); }
static inline real real_sqrt(real x) { return sqrt(x); }

/* exp that the compiler vectorizes (a polynomial, no libm call; ssm_common.h), and the same for
 * |x| <= REAL_EXP_FAST_MAX only, cheaper; REAL_EXP_FAST_VEC is the latter on a GCC vector T of
 * real (UT: its unsigned integer type), the same bits per lane */
SSM_INLINE real real_exp_poly(real x) { return ssm_exp_f64(x); }
SSM_INLINE real real_exp_poly_fast(real x) { return ssm_exp_fast_f64(x); }
#define REAL_EXP_FAST_MAX SSM_EXP_FAST_MAX_F64
#define REAL_EXP_FAST_VEC(T, UT, x) SSM_EXP_FAST_VEC_F64(T, UT, x)

/* softplus with ggml's threshold at 20 (libm's log1p and exp) and its derivative; float64 has
 * no cheaper in-range pair, so the _inrange names are the same functions */
SSM_INLINE real real_softplus(real v) { return ssm_softplus_f64(v); }
SSM_INLINE real real_dsoftplus(real v) { return ssm_dsoftplus_f64(v); }
SSM_INLINE real real_softplus_inrange(real v) { return ssm_softplus_f64(v); }
SSM_INLINE real real_dsoftplus_inrange(real v) { return ssm_dsoftplus_f64(v); }

#else
#error "one element type per translation unit: ssm_real_f64.h after another ssm_real_*.h"
#endif
