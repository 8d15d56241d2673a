/*
 * ssm_instantiate_end.h -- undefine the names ssm_instantiate.h defines for one element type,
 * after the kernel file's body was compiled with them. No include guard: included once per type.
 */
#undef REAL
#undef SFX
#undef SSM_EXP
#undef SSM_EXP_FAST
#undef SSM_EXP_FAST_MAX
#undef SSM_EXP_FAST_VEC
#undef SSM_SOFTPLUS
#undef SSM_DSOFTPLUS
#undef SSM_SOFTPLUS_IN
#undef SSM_DSOFTPLUS_IN
#undef SSM_LANES_IS_16
