/*
 * ssm_target_end.h -- closes what ssm_target_begin.h opened (the target pragma of levels 3 and 4).
 * No include guard: included once per instantiation file.
 */
#ifdef SSM_PASS_TARGET
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#undef SSM_PASS_TARGET
#endif
