/*
 * ssm_instantiate_types.h -- one pass of ssm_instantiate.h: a kernel file's body once per
 * element type.
 *
 * The body (SSM_TMPL_FILE) is included twice: for float (names suffixed _f32) and for double
 * (_f64), each with the helpers of its precision:
 *   SFX(name)        name##_f32 / name##_f64, then the pass's SSM_ISA suffix (_v4, ... or none)
 *   SSM_EXP          exp of the vectorized inner loops (a polynomial: no libm call)
 *   SSM_EXP_FAST     the same for |x| <= SSM_EXP_FAST_MAX only, cheaper
 *   SSM_EXP_FAST_VEC SSM_EXP_FAST on a GCC vector T of REAL (T, its unsigned type, x)
 *   SSM_SOFTPLUS     softplus with ggml's threshold at 20
 *   SSM_DSOFTPLUS    its derivative
 *   SSM_SOFTPLUS_IN, SSM_DSOFTPLUS_IN  the same two for v >= -SSM_EXP_FAST_MAX only, cheaper
 *   SSM_LANES_IS_16  whether a 64-byte vector holds 16 REALs (for preprocessor tests)
 * Deliberately no include guard: it is included once per pass. ssm_instantiate_end.h
 * undefines the per-type names after each type, so that the list is written once.
 */
#define REAL float
#define SFX(name) SSM_CAT(name##_f32, SSM_ISA)
#define SSM_EXP ssm_expf
#define SSM_EXP_FAST ssm_expf_fast
#define SSM_EXP_FAST_VEC SSM_EXPF_FAST_VEC
#define SSM_EXP_FAST_MAX SSM_EXPF_FAST_MAX
#define SSM_SOFTPLUS ssm_softplus_fast_f32
#define SSM_DSOFTPLUS ssm_dsoftplus_f32
#define SSM_SOFTPLUS_IN ssm_softplus_inrange_f32
#define SSM_DSOFTPLUS_IN ssm_dsoftplus_inrange_f32
#define SSM_LANES_IS_16 1
#include SSM_TMPL_FILE
#include "ssm_instantiate_end.h"

#define REAL double
#define SFX(name) SSM_CAT(name##_f64, SSM_ISA)
#define SSM_EXP ssm_exp_f64
#define SSM_EXP_FAST ssm_exp_fast_f64
#define SSM_EXP_FAST_VEC SSM_EXP_FAST_VEC_F64
#define SSM_EXP_FAST_MAX SSM_EXP_FAST_MAX_F64
#define SSM_SOFTPLUS ssm_softplus_f64
#define SSM_DSOFTPLUS ssm_dsoftplus_f64
#define SSM_SOFTPLUS_IN ssm_softplus_f64
#define SSM_DSOFTPLUS_IN ssm_dsoftplus_f64
#define SSM_LANES_IS_16 0
#include SSM_TMPL_FILE
#include "ssm_instantiate_end.h"
