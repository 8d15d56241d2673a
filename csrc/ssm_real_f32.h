/*
 * ssm_real_f32.h -- the float32 element type of a kernel body (csrc/<op>_<form>_body.h).
 *
 * An instantiation file (csrc/inst/<op>_f32_v<N>.c) includes this header before the body: the
 * body is written once for `real` and calls these plain-named helpers, never pasted names.
 * One element type per translation unit (the guard below refuses a second).
 */
#ifndef SSM_REAL_H
#define SSM_REAL_H

#include <math.h>

#include "ssm_common.h"

typedef float real;

/* reals in one 64-byte vector (one AVX-512 register), as a preprocessor number */
#define REAL_LANES 16

/* running sums of a dot product: ggml_vec_dot_f32's on x86-64 with AVX2 (4 registers of 8),
 * so that a dot product written with them sums in ggml's order (gdn_dot) */
#define REAL_DOT_LANES 32

static inline real real_exp(real x) { return expf(x); }
static inline real real_sqrt(real x) { return sqrtf(x); }

/* exp that the compiler vectorizes (a polynomial, no libm call; ssm_common.h), and the same for
 * |x| <= REAL_EXP_FAST_MAX only, cheaper; REAL_EXP_FAST_VEC is the latter on a GCC vector T of
 * real (UT: its unsigned integer type), the same bits per lane */
SSM_INLINE real real_exp_poly(real x) { return ssm_expf(x); }
SSM_INLINE real real_exp_poly_fast(real x) { return ssm_expf_fast(x); }
#define REAL_EXP_FAST_MAX SSM_EXPF_FAST_MAX
#define REAL_EXP_FAST_VEC(T, UT, x) SSM_EXPF_FAST_VEC(T, UT, x)

/* softplus with ggml's threshold at 20 and its derivative; the _inrange pair for
 * v >= -REAL_EXP_FAST_MAX only (the same bits there, cheaper) */
SSM_INLINE real real_softplus(real v) { return ssm_softplus_fast_f32(v); }
SSM_INLINE real real_dsoftplus(real v) { return ssm_dsoftplus_f32(v); }
SSM_INLINE real real_softplus_inrange(real v) { return ssm_softplus_inrange_f32(v); }
SSM_INLINE real real_dsoftplus_inrange(real v) { return ssm_dsoftplus_inrange_f32(v); }

#else
#error "one element type per translation unit: ssm_real_f32.h after another ssm_real_*.h"
#endif
