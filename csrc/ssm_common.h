/*
 * ssm_common.h -- internal helpers shared by the kernels (not part of the public API).
 */
#ifndef SSM_COMMON_H
#define SSM_COMMON_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "ssmgrad.h"
#include "ssm_mutant.h"

/*
 * Runtime SIMD dispatch. With GCC 9+ or clang 7+ on x86-64, every kernel is compiled at three
 * levels, one translation unit per (op, element type, level) (csrc/inst/, ssm_target_begin.h),
 * each under a target pragma:
 *   level 4  x86-64-v4: SSM_TARGET_V4 (AVX-512 F/BW/CD/DQ/VL on top of level 3)
 *   level 3  x86-64-v3: SSM_TARGET_V3 (AVX2, FMA, BMI1/2 on top of SSE4.2 and POPCNT)
 *   level 0  x86-64 baseline: the build's own flags
 * and each public kernel (ssm_conv_f32, ...) calls the level that ssm_simd_level() picked from
 * cpuid (capped by the call's params.simd). The feature names are the ones GCC 9 and clang 7
 * already know, both in target pragmas and in __builtin_cpu_supports (GCC's "arch=x86-64-v4" needs
 * GCC 12 and target_clones needs ifunc, which clang and macOS lack). Feature sets are those of the
 * psABI levels minus what the kernels never use and old compilers cannot test for at run time
 * (F16C, LZCNT, MOVBE, XSAVE).
 * SSM_NO_DISPATCH (setup.py defines it for SSMGRAD_NATIVE=1, a -march=native build) turns this
 * off: only the level-0 files are compiled, for the build's own target. Other compilers and CPUs
 * (aarch64, ...) get that too.
 */
#if !defined(SSM_NO_DISPATCH) && defined(__x86_64__) \
    && ((defined(__clang__) && __clang_major__ >= 7) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 9))
#define SSM_DISPATCH 1
#else
#define SSM_DISPATCH 0
#endif

#define SSM_TARGET_V3 "sse3,ssse3,sse4.1,sse4.2,popcnt,avx,avx2,fma,bmi,bmi2"
#define SSM_TARGET_V4 SSM_TARGET_V3 ",avx512f,avx512bw,avx512cd,avx512dq,avx512vl"

/* The SIMD level a call whose params have this simd value (SSM_SIMD_*) runs: 4, 3 or 0 as above
 * (dispatch: the CPU's level, read once from cpuid, capped by simd), else the build's own (4 if
 * it has AVX-512, else 0). ssm_dispatch.c. */
int ssm_simd_level(int64_t simd);

#define SSM_INLINE static inline __attribute__((always_inline))

/* Shuffle of two vectors (lanes of u then lanes of w) by constant indices, as a vector of
 * type T: GCC's __builtin_shuffle takes the indices as a vector, clang's
 * __builtin_shufflevector (GCC 12+ has it too) as constant arguments. */
#if defined(__clang__)
#define SSM_SHUFFLE2(T, u, w, ...) __builtin_shufflevector(u, w, __VA_ARGS__)
#else
#define SSM_SHUFFLE2(T, u, w, ...) __builtin_shuffle(u, w, (T) { __VA_ARGS__ })
#endif

/* Lane count of the fixed-width loops: 16 floats is one AVX-512 register (two AVX2). Rows of a
 * scan block are padded to a multiple of it so that every row loop has no tail. */
#define SSM_VL 16

/* Largest state block one thread works on at a time, in elements: a few tens of KB, so the
 * block and its per-row vectors stay in L1/L2 while the token loop runs. */
#define SSM_BLOCK_ELEMS 8192

/* Heads of one group are split into at most this many head runs (the units of the backward's
 * phase 1) for the backward's partial sums of d_B and d_C. The number depends on the shape only (never on the thread count),
 * which is what makes the reductions bitwise identical for any number of threads. */
#define SSM_HEAD_RUNS_PER_GROUP 8

/* The backward recomputes a segment of states at a time and reads them back in reverse: the
 * segment is kept within this many bytes, three quarters of a 1 MB L2 (docs/performance.md). */
#define SSM_SEGMENT_BYTES (768 * 1024)

SSM_INLINE int64_t ssm_pad(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

SSM_INLINE int64_t ssm_min64(int64_t a, int64_t b) { return a < b ? a : b; }
SSM_INLINE int64_t ssm_max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* [lo, hi) of n items for thread ith of nth: contiguous, sizes differ by at most one. */
SSM_INLINE void ssm_split(int64_t n, int ith, int nth, int64_t * lo, int64_t * hi) {
    *lo = n * ith / nth;
    *hi = n * (ith + 1) / nth;
}

/* softplus with ggml's threshold: v above 20 is returned as is. */
SSM_INLINE float ssm_softplus_f32(float v) { return v <= 20.0f ? log1pf(expf(v)) : v; }
SSM_INLINE double ssm_softplus_f64(double v) { return v <= 20.0 ? log1p(exp(v)) : v; }

/*
 * expf that the compiler can vectorize (no calls, no branches): Cody-Waite reduction
 * x = k ln2 + r, |r| <= ln2/2, a degree-6 polynomial for e^r, then 2^k applied in two
 * halves so that results down to the subnormal range are right. Relative error within
 * 2 ulp of libm's expf for x in [-87, 88] (checked by the test suite); below -103.97 the
 * result is 0, above 88.73 it is +inf, NaN stays NaN.
 */
#define SSM_EXPF_SHIFT 12582912.0f              /* 1.5 * 2^23: adding it rounds to an integer */

/* e^r for r = x - k ln2, written once for T = float and for GCC vectors of floats (the decode
 * path of ssm_scan_decode_body.h): the same operations in the same order, so the same bits per lane */
#define SSM_EXPF_POLY(T, x, k) __extension__ ({                                                 \
    T r_ = (x) - (k) * 0.693359375f;            /* ln2 split in a part exact in float ... */   \
    r_ = r_ - (k) * -2.12194440e-4f;            /* ... and the rest */                          \
    T p_ = r_ * 1.9875691500e-4f + 1.3981999507e-3f;                                            \
    p_ = p_ * r_ + 8.3334519073e-3f;                                                            \
    p_ = p_ * r_ + 4.1665795894e-2f;                                                            \
    p_ = p_ * r_ + 1.6666665459e-1f;                                                            \
    p_ = p_ * r_ + 5.0000001201e-1f;                                                            \
    p_ * r_ * r_ + r_ + 1.0f; })

/* e^r of the reduction of x (|x| not beyond ~104), and kf = k + SSM_EXPF_SHIFT */
SSM_INLINE float ssm_expf_core(float x, float * kf) {
    *kf = x * 1.44269504088896341f + SSM_EXPF_SHIFT;
    const float k = *kf - SSM_EXPF_SHIFT;
    return SSM_EXPF_POLY(float, x, k);
}

SSM_INLINE float ssm_expf(float x) {
    float xc = x >= -104.0f ? x : -104.0f;      /* NaN takes the clamp: no UB in the cast */
    xc = xc <= 89.0f ? xc : 89.0f;
    float kf;
    const float p = ssm_expf_core(xc, &kf);
    int32_t ki = (int32_t) (kf - SSM_EXPF_SHIFT);
    int32_t k1 = ki >> 1;
    int32_t k2 = ki - k1;
    union { int32_t i; float f; } s1, s2;
    s1.i = (k1 + 127) << 23;
    s2.i = (k2 + 127) << 23;
    float res = p * s1.f * s2.f;
    res = x < -103.97f ? 0.0f : res;
    res = x > 88.7228f ? INFINITY : res;
    res = x == x ? res : x;
    return res;
}

/*
 * ssm_expf for |x| <= SSM_EXPF_FAST_MAX only, with about half the vector operations: there
 * e^x is a normal float, so 2^k goes straight into p's exponent field (one shift, one integer
 * add) and no clamp or special case is needed. The same reduction and polynomial as ssm_expf,
 * so equal to it bit for bit where it applies (checked by the test suite). Outside that range
 * the result is garbage: callers check the range for a whole tile first (ssm_scan_layout.h).
 * k >= -125 and p >= 0.70 keep the result normal at the low end; k <= 125 at the high end.
 */
#define SSM_EXPF_FAST_MAX 86.5f
SSM_INLINE float ssm_expf_fast(float x) {
    float kf;
    union { float f; uint32_t u; } p, k;
    p.f = ssm_expf_core(x, &kf);
    k.f = kf;                                   /* bits: 0x4B400000 + k (the shift's, plus k) */
    p.u += k.u << 23;                           /* k << 23: 0x4B400000 << 23 wraps to 0 */
    return p.f;
}

/* ssm_expf_fast on a GCC vector T of floats (UT: of uint32_t): the same expressions, the same
 * bits per lane */
#define SSM_EXPF_FAST_VEC(T, UT, x) __extension__ ({                                            \
    const T x_ = (x);                                                                           \
    const T kf_ = x_ * 1.44269504088896341f + SSM_EXPF_SHIFT;                                   \
    const T k_ = kf_ - SSM_EXPF_SHIFT;                                                          \
    (T) ((UT) SSM_EXPF_POLY(T, x_, k_) + ((UT) kf_ << 23)); })

/*
 * exp in double that the compiler can vectorize, as ssm_expf: x = k ln2 + r, |r| <= ln2/2,
 * the Taylor polynomial of e^r to degree 12 (truncation below 2e-16 relative), 2^k in two
 * halves. Within 2 ulp of libm's exp for x in [-708, 709] (checked by the test suite); 0 below
 * -745.14, +inf above 709.79, NaN stays NaN.
 */
#define SSM_EXP_SHIFT 6755399441055744.0        /* 1.5 * 2^52: adding it rounds to an integer */

/* e^r for r = x - k ln2, for T = double and vectors of doubles, as SSM_EXPF_POLY */
#define SSM_EXP_POLY_F64(T, x, k) __extension__ ({                                              \
    T r_ = (x) - (k) * 6.93147180369123816490e-01;    /* ln2 high part (exact in k * hi) */     \
    r_ = r_ - (k) * 1.90821492927058770002e-10;       /* ln2 low part */                        \
    T p_ = r_ * (1.0 / 479001600.0) + 1.0 / 39916800.0;   /* 1/12!, 1/11! */                   \
    p_ = p_ * r_ + 1.0 / 3628800.0;                                                             \
    p_ = p_ * r_ + 1.0 / 362880.0;                                                              \
    p_ = p_ * r_ + 1.0 / 40320.0;                                                               \
    p_ = p_ * r_ + 1.0 / 5040.0;                                                                \
    p_ = p_ * r_ + 1.0 / 720.0;                                                                 \
    p_ = p_ * r_ + 1.0 / 120.0;                                                                 \
    p_ = p_ * r_ + 1.0 / 24.0;                                                                  \
    p_ = p_ * r_ + 1.0 / 6.0;                                                                   \
    p_ = p_ * r_ + 0.5;                                                                         \
    p_ * r_ * r_ + r_ + 1.0; })

SSM_INLINE double ssm_exp_core_f64(double x, double * kf) {
    *kf = x * 1.4426950408889634074 + SSM_EXP_SHIFT;
    const double k = *kf - SSM_EXP_SHIFT;
    return SSM_EXP_POLY_F64(double, x, k);
}

SSM_INLINE double ssm_exp_f64(double x) {
    double xc = x >= -746.0 ? x : -746.0;       /* NaN takes the clamp: no UB in the cast */
    xc = xc <= 710.0 ? xc : 710.0;
    double kf;
    const double p = ssm_exp_core_f64(xc, &kf);
    const int32_t ki = (int32_t) (kf - SSM_EXP_SHIFT);
    const int32_t k1 = ki >> 1, k2 = ki - k1;
    union { int64_t i; double f; } s1, s2;
    s1.i = (int64_t) (k1 + 1023) << 52;
    s2.i = (int64_t) (k2 + 1023) << 52;
    double res = p * s1.f * s2.f;
    res = x < -745.1332191019412 ? 0.0 : res;
    res = x > 709.782712893384 ? INFINITY : res;
    res = x == x ? res : x;
    return res;
}

/* ssm_exp_f64 for |x| <= SSM_EXP_FAST_MAX_F64 only, as ssm_expf_fast */
#define SSM_EXP_FAST_MAX_F64 707.0
SSM_INLINE double ssm_exp_fast_f64(double x) {
    double kf;
    union { double f; uint64_t u; } p, k;
    p.f = ssm_exp_core_f64(x, &kf);
    k.f = kf;                                   /* bits: 0x4338000000000000 + k */
    p.u += k.u << 52;                           /* k << 52: the constant's part wraps to 0 */
    return p.f;
}

/* ssm_exp_fast_f64 on a GCC vector T of doubles (UT: of uint64_t), as SSM_EXPF_FAST_VEC */
#define SSM_EXP_FAST_VEC_F64(T, UT, x) __extension__ ({                                         \
    const T x_ = (x);                                                                           \
    const T kf_ = x_ * 1.4426950408889634074 + SSM_EXP_SHIFT;                                   \
    const T k_ = kf_ - SSM_EXP_SHIFT;                                                           \
    (T) ((UT) SSM_EXP_POLY_F64(T, x_, k_) + ((UT) kf_ << 52)); })

/* the derivative of softplus: sigmoid(v) below ggml's threshold, 1 above; with the
 * vectorizable exps, so that loops over rows that call it vectorize */
SSM_INLINE float ssm_dsoftplus_f32(float v) { return v <= 20.0f ? 1.0f / (1.0f + ssm_expf(-v)) : 1.0f; }
SSM_INLINE double ssm_dsoftplus_f64(double v) { return v <= 20.0 ? 1.0 / (1.0 + ssm_exp_f64(-v)) : 1.0; }

/*
 * softplus in float without libm calls, so loops over heads vectorize:
 *   softplus(v) = max(v, 0) + log1p(e),  e = exp(-|v|) in [0, 1],
 *   log1p(e) = 2 atanh(z) with z = e / (2 + e) in [0, 1/3], an odd series to z^13.
 * Within 4 ulp of the correctly rounded log1p(exp(v)) (checked by the test suite: the 2 ulp
 * of ssm_expf carry through); v above 20 is returned as
 * is, like ggml; NaN stays NaN.
 */
/* ... with e = e^(-|v|) given */
SSM_INLINE float ssm_softplus_e_f32(float v, float e) {
    const float z = e / (2.0f + e);
    const float z2 = z * z;
    float s = 1.0f / 13.0f;
    s = s * z2 + 1.0f / 11.0f;
    s = s * z2 + 1.0f / 9.0f;
    s = s * z2 + 1.0f / 7.0f;
    s = s * z2 + 1.0f / 5.0f;
    s = s * z2 + 1.0f / 3.0f;
    s = s * z2 + 1.0f;
    const float r = (v > 0.0f ? v : 0.0f) + 2.0f * z * s;
    return v <= 20.0f ? r : v;
}

SSM_INLINE float ssm_softplus_fast_f32(float v) {
    return ssm_softplus_e_f32(v, ssm_expf(v >= 0.0f ? -v : v));
}

/*
 * ssm_softplus_fast_f32 and ssm_dsoftplus_f32 for v >= -SSM_EXPF_FAST_MAX only (callers check a
 * whole row first), with ssm_expf_fast: the same bits, as ssm_expf_fast equals ssm_expf in its
 * range, and above ggml's threshold (where the exp's argument may leave it) the exp is not used.
 * The full exp's clamps and special cases were a third of a softplus.
 */
SSM_INLINE float ssm_softplus_inrange_f32(float v) {
    return ssm_softplus_e_f32(v, ssm_expf_fast(v >= 0.0f ? -v : v));
}
SSM_INLINE float ssm_dsoftplus_inrange_f32(float v) { return v <= 20.0f ? 1.0f / (1.0f + ssm_expf_fast(-v)) : 1.0f; }

#endif /* SSM_COMMON_H */
