/*
 * ssm_real_f32.h -- the float32 element type of a kernel body (csrc/<op>_<form>_body.h).
 *
 * An instantiation file (csrc/inst/<op>_f32_v<N>.c) includes this header before the body: the
 * body is written once for `real` and calls these plain-named helpers, never pasted names.
 * No include guard needed beyond the one below: one element type per translation unit.
 */
#ifndef SSM_REAL_H
#define SSM_REAL_H

#include <math.h>

typedef float real;

/* lanes of the running sums of dot products: ggml_vec_dot_f32's on AVX2 (4 registers of 8), so
 * that a level with FMA sums as ggml's AVX2 build does; the same for every SIMD level, so that only
 * FMA contraction differs between them */
#define REAL_LANES 32

static inline real real_exp(real x) { return expf(x); }
static inline real real_sqrt(real x) { return sqrtf(x); }

#else
#error "one element type per translation unit: ssm_real_f32.h after another ssm_real_*.h"
#endif
