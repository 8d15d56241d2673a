/*
 * ssm_instantiate.h -- compile a kernel file's body once per SIMD level and element type.
 *
 * A kernel file writes its kernels once, for a type REAL, in a section guarded by SSM_TMPL,
 * then (outside that section) defines SSM_TMPL_FILE as its own name and includes this header.
 * With runtime dispatch (SSM_DISPATCH, see ssm_common.h) the body is compiled in three passes,
 * each for float and double (ssm_instantiate_types.h):
 *   SSM_ISA _v4, SSM_ISA_LEVEL 4: every function under target(SSM_TARGET_V4)
 *   SSM_ISA _v3, SSM_ISA_LEVEL 3: every function under target(SSM_TARGET_V3)
 *   SSM_ISA _v0, SSM_ISA_LEVEL 0: the build's own target
 * and the kernel file then defines each public kernel as a call of SSM_DISPATCH_CALL. Without
 * dispatch there is one pass, SSM_ISA empty (the public names themselves) and SSM_ISA_LEVEL 4
 * if the build's target has AVX-512, else 0.
 * The target is set by a pragma around the pass (GCC: push_options/target, clang: attribute
 * push), so the body needs no attribute of its own; the always-inline helpers of ssm_common.h,
 * compiled for the baseline, inline into every pass.
 * Deliberately no include guard: it is included once per kernel file.
 */
#ifndef SSM_TMPL_FILE
#error "define SSM_TMPL_FILE (the including file's name) first"
#endif

#define SSM_TMPL 1
#define SSM_PRAGMA_(x) _Pragma(#x)
#define SSM_PRAGMA(x) SSM_PRAGMA_(x)

#if SSM_DISPATCH

#define SSM_ISA _v4
#define SSM_ISA_LEVEL 4
#define SSM_PASS_TARGET SSM_TARGET_V4
#include "ssm_instantiate_pass.h"

#define SSM_ISA _v3
#define SSM_ISA_LEVEL 3
#define SSM_PASS_TARGET SSM_TARGET_V3
#include "ssm_instantiate_pass.h"

#define SSM_ISA _v0
#define SSM_ISA_LEVEL 0
#include "ssm_instantiate_pass.h"

#else /* one pass, for the build's own target */

#define SSM_ISA
#if defined(__AVX512F__)
#define SSM_ISA_LEVEL 4
#else
#define SSM_ISA_LEVEL 0
#endif
#include "ssm_instantiate_pass.h"

#endif /* SSM_DISPATCH */

#undef SSM_PRAGMA
#undef SSM_PRAGMA_
#undef SSM_TMPL
#undef SSM_TMPL_FILE
