/*
 * ssm_target_begin.h -- opens one SIMD level of an instantiation file (csrc/inst/<op>_<type>_v<N>.c).
 *
 * The includer defines SSM_LEVEL (4: x86-64-v4, AVX-512; 3: x86-64-v3, AVX2+FMA; 0: the build's own
 * target) and then includes this header, the type header, the body, its explicit wrappers, and
 * ssm_target_end.h. With runtime dispatch (SSM_DISPATCH, ssm_common.h) levels 3 and 4 put every
 * function up to ssm_target_end.h under target(SSM_TARGET_V3 / _V4) by a pragma (GCC: push_options +
 * target; clang: attribute push). Without dispatch only the level-0 files are compiled, and their
 * SSM_LEVEL becomes the build's own (4 if it has AVX-512, 3 if it has AVX2 and FMA, else 0: the level
 * ssm_simd_level reports there); the level-3/4 files then define SSM_SKIP_FILE and wrap their content
 * in #if !SSM_SKIP_FILE.
 * No include guard: included once per instantiation file.
 */
#ifndef SSM_LEVEL
#error "define SSM_LEVEL (4, 3 or 0) before including ssm_target_begin.h"
#endif

#include "ssm_common.h"

#define SSM_PRAGMA_(x) _Pragma(#x)
#define SSM_PRAGMA(x) SSM_PRAGMA_(x)

#if SSM_DISPATCH
#define SSM_SKIP_FILE 0
#if SSM_LEVEL == 4
#define SSM_PASS_TARGET SSM_TARGET_V4
#elif SSM_LEVEL == 3
#define SSM_PASS_TARGET SSM_TARGET_V3
#endif
#else /* one pass for the build's own target: only the _v0 files */
#if SSM_LEVEL == 0
#define SSM_SKIP_FILE 0
#undef SSM_LEVEL
#if defined(__AVX512F__)
#define SSM_LEVEL 4
#elif defined(__AVX2__) && defined(__FMA__)
#define SSM_LEVEL 3
#else
#define SSM_LEVEL 0
#endif
#else
#define SSM_SKIP_FILE 1
#endif
#endif

/* Whether this level's kernels written in 64-byte GCC vector types run for a call with this
 * params.simd: they are one register only with AVX-512 (on AVX2 GCC builds each such vector
 * through the stack), so only level 4 has them, and SSM_SIMD_V4_NO_VEC64 turns them off there
 * (the loops of the other levels run instead). A constant 0 below level 4. */
SSM_INLINE int ssm_vec64(int64_t simd) { return SSM_LEVEL >= 4 && simd != SSM_SIMD_V4_NO_VEC64; }

/* Whether this level's kernels written in 32-byte GCC vector types (the x86-64-v3 pass's register
 * tiles, sized for AVX2's 16 registers) run: only at level 3, whatever params.simd (a call capped
 * to x86-64-v3 runs level 3; SSM_SIMD_V4_NO_VEC64 runs level 4's loops). A constant elsewhere. */
SSM_INLINE int ssm_vec32(int64_t simd) { (void) simd; return SSM_LEVEL == 3; }

#ifdef SSM_PASS_TARGET
#if defined(__clang__)
SSM_PRAGMA(clang attribute push(__attribute__((target(SSM_PASS_TARGET))), apply_to = function))
#else
#pragma GCC push_options
SSM_PRAGMA(GCC target(SSM_PASS_TARGET))
#endif
#endif
