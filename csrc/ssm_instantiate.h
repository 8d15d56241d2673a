/*
 * ssm_instantiate.h -- compile a kernel file's body once per element type.
 *
 * A kernel file writes its kernels once, for a type REAL, in a section guarded by SSM_TMPL,
 * then (outside that section) defines SSM_TMPL_FILE as its own name and includes this header.
 * The body is then included twice: for float (names suffixed _f32) and for double (_f64),
 * each with the helpers of its precision:
 *   SFX(name)        name##_f32 / name##_f64
 *   SSM_EXP          exp of the vectorized inner loops (a polynomial: no libm call)
 *   SSM_EXP_FAST     the same for |x| <= SSM_EXP_FAST_MAX only, cheaper
 *   SSM_SOFTPLUS     softplus with ggml's threshold at 20
 *   SSM_LANES_IS_16  whether a 64-byte vector holds 16 REALs (for preprocessor tests)
 * Deliberately no include guard: it is included once per kernel file. ssm_instantiate_end.h
 * undefines the per-type names after each pass, so that the list is written once.
 */
#ifndef SSM_TMPL_FILE
#error "define SSM_TMPL_FILE (the including file's name) first"
#endif

#define SSM_TMPL 1

#define REAL float
#define SFX(name) name##_f32
#define SSM_EXP ssm_expf
#define SSM_EXP_FAST ssm_expf_fast
#define SSM_EXP_FAST_MAX SSM_EXPF_FAST_MAX
#define SSM_SOFTPLUS ssm_softplus_fast_f32
#define SSM_LANES_IS_16 1
#include SSM_TMPL_FILE
#include "ssm_instantiate_end.h"

#define REAL double
#define SFX(name) name##_f64
#define SSM_EXP ssm_exp_f64
#define SSM_EXP_FAST ssm_exp_fast_f64
#define SSM_EXP_FAST_MAX SSM_EXP_FAST_MAX_F64
#define SSM_SOFTPLUS ssm_softplus_f64
#define SSM_LANES_IS_16 0
#include SSM_TMPL_FILE
#include "ssm_instantiate_end.h"

#undef SSM_TMPL
#undef SSM_TMPL_FILE
