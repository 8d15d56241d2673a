/*
 * ssm_instantiate_pass.h -- one pass of ssm_instantiate.h: the kernel file's body, for float and
 * double (ssm_instantiate_types.h), under target(SSM_PASS_TARGET) set by a pragma around it (GCC:
 * push_options/target, clang: attribute push), or for the build's own target when SSM_PASS_TARGET
 * is not defined. The includer defines SSM_ISA and SSM_ISA_LEVEL; this header undefines them and
 * SSM_PASS_TARGET. No include guard: included once per pass.
 */
#ifdef SSM_PASS_TARGET
#if defined(__clang__)
SSM_PRAGMA(clang attribute push(__attribute__((target(SSM_PASS_TARGET))), apply_to = function))
#else
#pragma GCC push_options
SSM_PRAGMA(GCC target(SSM_PASS_TARGET))
#endif
#endif

#include "ssm_instantiate_types.h"

#ifdef SSM_PASS_TARGET
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#undef SSM_PASS_TARGET
#endif
#undef SSM_ISA
#undef SSM_ISA_LEVEL
