/*
 * ssm_scan.c -- SSM_SCAN forward: out = [y | K state slots].
 *
 * Written once for a type REAL and compiled for float and double
 * (and, on x86-64, for each SIMD level of the runtime dispatch): see
 * ssm_instantiate.h. Blocks and the transposed state layout are explained in
 * ssm_scan_layout.h.
 */
#ifndef SSM_TMPL

#include <stdlib.h>

#include "ssm_scan_layout.h"

#if SSM_DISPATCH || defined(__SSE2__)
#include <immintrin.h>   /* the range test of the decode path's vector code (x86 passes) */
#endif


#define SSM_TMPL_FILE "ssm_scan.c"
#include "ssm_instantiate.h"

#if SSM_DISPATCH
void ssm_scan_f32(const ssm_scan_params * p, const float * s, const float * x, const float * dt,
                  const float * A, const float * B, const float * C, const int64_t * ids, float * out,
                  void * work, int ith, int nth) {
    SSM_DISPATCH_CALL(ssm_scan_f32, (p, s, x, dt, A, B, C, ids, out, work, ith, nth));
}
void ssm_scan_f64(const ssm_scan_params * p, const double * s, const double * x, const double * dt,
                  const double * A, const double * B, const double * C, const int64_t * ids, double * out,
                  void * work, int ith, int nth) {
    SSM_DISPATCH_CALL(ssm_scan_f64, (p, s, x, dt, A, B, C, ids, out, work, ith, nth));
}
void ssm_scan_decode_into_f32(const ssm_scan_params * p, const float * s, const float * x, const float * dt,
                              const float * A, const float * B, const float * C, const int64_t * ids, float * y,
                              float * st, int ith, int nth) {
    SSM_DISPATCH_CALL(ssm_scan_decode_into_f32, (p, s, x, dt, A, B, C, ids, y, st, ith, nth));
}
void ssm_scan_decode_into_f64(const ssm_scan_params * p, const double * s, const double * x, const double * dt,
                              const double * A, const double * B, const double * C, const int64_t * ids,
                              double * y, double * st, int ith, int nth) {
    SSM_DISPATCH_CALL(ssm_scan_decode_into_f64, (p, s, x, dt, A, B, C, ids, y, st, ith, nth));
}
#endif

/*
 * Which form the forward takes: SSMGRAD_SCAN_FWD=recurrence|chunked|auto (read once; auto if unset),
 * or ssm_set_scan_fwd(). The chunked form covers Mamba-2 (one decay per head) with K == 1 outside
 * the decode path (n_t <= SSM_DECODE_MAX_T); every other call takes the recurrence. Auto picks it by
 * shape alone (never by thread count, so the bits do not depend on it).
 */
static int ssm_fwd_mode_cached = -1;

static int ssm_fwd_mode(void) { return ssm_form_mode(&ssm_fwd_mode_cached, "SSMGRAD_SCAN_FWD"); }

int ssm_scan_fwd_mode(void) { return ssm_fwd_mode(); }

void ssm_set_scan_fwd(int mode) { ssm_form_set(&ssm_fwd_mode_cached, mode); }

/* Auto: the shapes where the chunked forward measured faster than the recurrence (AVX-512,
 * float32, 1 and 2 threads; benchmarks/ab_scan_fwd.py and benchmarks/README.md): head_dim >= 32
 * and d_state >= 128 (chunked/recurrence at n_t 256, 1 thread: 0.83 at 64 x 128, 0.86 at
 * 128 x 128, 0.95 at 32 x 128; 1.02-1.17 at 64 x 64 and 128 x 64, 1.1-1.4 at 32 x 64 and below,
 * 1.12 at 16 x 128), n_t >= 64 (at 24 x 64 x 128: 1.2-1.5 at n_t 8-16, 0.9-1.05 at 32, 0.97-1.04
 * at 64, 0.6-0.8 from 512 on). Shape only: the thread count never changes the form (or the bits). */
#define SSM_FWD_AUTO_MIN_NT 64
#define SSM_FWD_AUTO_MIN_HD 32
#define SSM_FWD_AUTO_MIN_DS 128

int ssm_scan_fwd_chunked(const ssm_scan_params * p) {
    if (p->a_per_state || p->K != 1 || p->n_t < 1 || ssm_scan_decode_path(p)) return 0;
    switch (ssm_fwd_mode()) {
    case SSM_SCAN_FWD_RECURRENCE: return 0;
    case SSM_SCAN_FWD_CHUNKED: return 1;
    default:
        return p->n_t >= SSM_FWD_AUTO_MIN_NT && p->head_dim >= SSM_FWD_AUTO_MIN_HD && p->d_state >= SSM_FWD_AUTO_MIN_DS;
    }
}

size_t ssm_scan_work_size(const ssm_scan_params * p, size_t elem_size, int nth) {
    if (ssm_scan_decode_path(p)) return 0;   /* no scratch */
    const size_t per = elem_size == sizeof(float) ? SSM_BASE_NAME(ssm_scan_thread_bytes_f32)(p)
                                                  : SSM_BASE_NAME(ssm_scan_thread_bytes_f64)(p);
    return per * (size_t) (nth > 0 ? nth : 1);
}

/* ------------------------------------------------------------------ SIMD level and build facts */

int ssm_v4_off = 0;

void ssm_set_avx512_kernels(int on) { ssm_v4_off = !on; }

#define SSM_STR_(x) #x
#define SSM_STR(x) SSM_STR_(x)
#if defined(__clang__)
#define SSM_COMPILER "clang " SSM_STR(__clang_major__) "." SSM_STR(__clang_minor__) "." SSM_STR(__clang_patchlevel__)
#elif defined(__GNUC__)
#define SSM_COMPILER "GCC " SSM_STR(__GNUC__) "." SSM_STR(__GNUC_MINOR__) "." SSM_STR(__GNUC_PATCHLEVEL__)
#else
#define SSM_COMPILER "an unknown compiler"
#endif

#if SSM_DISPATCH

/* SSMGRAD_SIMD caps the level: "x86-64-v4" (no cap), "x86-64-v3" or "x86-64"; -1 if unset or unknown */
static int ssm_simd_cap(void) {
    const char * cap = getenv("SSMGRAD_SIMD");
    if (!cap || !*cap) return -1;
    if (!strcmp(cap, "x86-64-v4")) return 4;
    if (!strcmp(cap, "x86-64-v3")) return 3;
    if (!strcmp(cap, "x86-64") || !strcmp(cap, "baseline")) return 0;
    return -1;
}

/* the highest level whose every feature this CPU (and its OS: the cpuid checks include the
 * XSAVE state for AVX and AVX-512) supports */
static int ssm_cpu_level(void) {
    __builtin_cpu_init();
    const int v3 = __builtin_cpu_supports("sse3") && __builtin_cpu_supports("ssse3")
                   && __builtin_cpu_supports("sse4.1") && __builtin_cpu_supports("sse4.2")
                   && __builtin_cpu_supports("popcnt") && __builtin_cpu_supports("avx")
                   && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")
                   && __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2");
    const int v4 = v3 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
                   && __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("avx512dq")
                   && __builtin_cpu_supports("avx512vl");
    return v4 ? 4 : v3 ? 3 : 0;
}

static int ssm_level_cached = -1;

int ssm_simd_level(void) {
    int level = __atomic_load_n(&ssm_level_cached, __ATOMIC_RELAXED);
    if (level < 0) {   /* first call: every thread that races here computes the same value */
        level = ssm_cpu_level();
        const int cap = ssm_simd_cap();
        if (cap >= 0 && cap < level) level = cap;
        __atomic_store_n(&ssm_level_cached, level, __ATOMIC_RELAXED);
    }
    return level;
}

const char * ssm_simd_compiled(void) {
    return "x86-64-v4 (AVX-512), x86-64-v3 (AVX2+FMA), x86-64 baseline, picked at run time "
           "(compiler: " SSM_COMPILER "; dispatch: target pragmas + cpuid)";
}

const char * ssm_simd_selected(void) {
    const int level = ssm_simd_level();
    const int capped = level < ssm_cpu_level();
    switch (level) {
    case 4: return "x86-64-v4";
    case 3: return capped ? "x86-64-v3 (capped by SSMGRAD_SIMD)" : "x86-64-v3";
    default: return capped ? "x86-64 (capped by SSMGRAD_SIMD)" : "x86-64";
    }
}

#else /* no runtime dispatch: the build's own target */

int ssm_simd_level(void) {
#if defined(__AVX512F__)
    return 4;
#elif defined(__AVX2__) && defined(__FMA__)
    return 3;
#else
    return 0;
#endif
}

#if defined(SSM_NO_DISPATCH)
#define SSM_NO_DISPATCH_WHY "none (SSM_NO_DISPATCH: a SSMGRAD_NATIVE=1 build)"
#elif defined(__x86_64__)
#define SSM_NO_DISPATCH_WHY "none (needs GCC 9+ or clang 7+)"
#else
#define SSM_NO_DISPATCH_WHY "none (not x86-64)"
#endif

#if defined(__AVX512F__)
#define SSM_SIMD_BUILT "AVX-512"
#elif defined(__AVX2__)
#define SSM_SIMD_BUILT "AVX2"
#elif defined(__x86_64__)
#define SSM_SIMD_BUILT "x86-64 baseline (SSE2)"
#elif defined(__aarch64__) && defined(__ARM_NEON)
#define SSM_SIMD_BUILT "aarch64 (NEON, compiler auto-vectorization)"
#else
#define SSM_SIMD_BUILT "portable C (compiler auto-vectorization only)"
#endif

const char * ssm_simd_compiled(void) {
    return SSM_SIMD_BUILT ", the build's target only (compiler: " SSM_COMPILER "; dispatch: " SSM_NO_DISPATCH_WHY ")";
}

const char * ssm_simd_selected(void) { return SSM_SIMD_BUILT " (no runtime dispatch)"; }

#endif /* SSM_DISPATCH */

int ssm_avx512_kernels(void) { return ssm_simd_level() >= 4 && !ssm_v4_off; }

#else /* SSM_TMPL: the kernel for one REAL */

#include "ssm_scan_layout.h"

static size_t SFX(ssm_fwd_chunk_bytes)(const ssm_scan_params * p);

/* scratch of one thread: one block's state, Mamba-1's transposed A, the row vectors; or the
 * chunked form's buffers */
static size_t SFX(ssm_scan_thread_bytes)(const ssm_scan_params * p) {
    if (ssm_scan_fwd_chunked(p)) return SFX(ssm_fwd_chunk_bytes)(p);
    ssm_arena a = { NULL, 0 };
    SFX(ssm_rows) v;
    SFX(ssm_take_rows)(&a, p, ssm_max_rows_padded(p), &v);
    return a.off;
}

/* ------------------------------------------------------------------ the decode path
 * (ssm_scan_decode_path): per (sequence, head, row p) and token, on the row's d_state elements
 *   new[n] = old[n] * e^(sp * A) + B[n] * (x * sp),   y = sum_n new[n] * C[n]
 * with the same softplus, exp and state update expressions as the general path (the states come
 * out the same up to the compiler's choice of fused multiply-adds), but y summed along n in
 * SSM_LANES partial sums (n mod SSM_LANES, n increasing) added by a fixed tree at the end: an
 * order that depends on the type and shape only (not on the SIMD level's register width, nor on
 * the thread count), like ggml's own vectorized sum over d_state. */

/* heads whose softplus(dt) (and Mamba-2 decay) are computed together, in vector loops */
#define SSM_DEC_HEADS 64
/* Mamba-1 rows (heads) of one token interleaved by the vector code, so that their chains overlap */
#define SSM_DEC_ROWS 8

SSM_INLINE REAL SFX(ssm_dec_reduce)(REAL * acc) {
#if SSM_LANES_IS_16
    for (int j = 0; j < 8; ++j) acc[j] += acc[j + 8];
#endif
    for (int j = 0; j < 4; ++j) acc[j] += acc[j + 4];
    for (int j = 0; j < 2; ++j) acc[j] += acc[j + 2];
    return acc[0] + acc[1];
}

/* m (<= SSM_LANES) states from n0 of one row: dst = src * a + B * xdt (dst may be src: the
 * row is read into hv before any store), acc[j] += dst[j] * C[j]. Mamba-2: a[j] = a2 for every
 * j; Mamba-1 (per_state): a[j] = e^(sp * A[j]) by SSM_EXP_FAST where every argument of the chunk
 * is in its range (then equal to SSM_EXP bit for bit), else SSM_EXP */
SSM_INLINE void SFX(ssm_dec_chunk)(const int m, const int per_state, const REAL * src, REAL * dst,
                                    REAL sp, REAL a2, REAL xdt, const REAL * restrict Ar,
                                    const REAL * restrict Bv, const REAL * restrict Cv, REAL * restrict acc) {
    REAL hv[SSM_LANES], a[SSM_LANES];
    for (int j = 0; j < m; ++j) hv[j] = src[j];
    if (per_state) {
        REAL z[SSM_LANES];
        int bad = 0;
        for (int j = 0; j < m; ++j) {
            z[j] = sp * Ar[j];
            bad |= !(z[j] <= SSM_EXP_FAST_MAX && z[j] >= -SSM_EXP_FAST_MAX);
        }
        if (!bad)
            for (int j = 0; j < m; ++j) a[j] = SSM_EXP_FAST(z[j]);
        else
            for (int j = 0; j < m; ++j) a[j] = SSM_EXP(z[j]);
    } else {
        for (int j = 0; j < m; ++j) a[j] = a2;
    }
    for (int j = 0; j < m; ++j) {
        const REAL h = hv[j] * a[j] + Bv[j] * xdt;
        dst[j] = h;
        acc[j] += h * Cv[j];
    }
}

/*
 * The same chunk step in vector types for the x86 passes, SSM_DEC_VB bytes wide (AVX-512: 64, AVX2: 32,
 * SSE2: 16; a chunk of SSM_LANES states is SSM_DEC_NSUB such vectors), where GCC left the array
 * loops above partly scalar (measured: Mamba-1's 16-state rows 3x slower): the same operations in
 * the same order per lane, the exp as SSM_EXP_FAST written on vectors, SSM_EXP lane by lane for a
 * vector with an argument out of SSM_EXP_FAST's range, and the same tree for the sum over lanes, so
 * every pass gives the bits of the array loops (up to the compiler's fused multiply-adds).
 */
#if SSM_ISA_LEVEL >= 4
#define SSM_DEC_VB 64
#define SSM_DEC_VEC() SSM_USE_V4()
#elif SSM_ISA_LEVEL == 3
#define SSM_DEC_VB 32
#define SSM_DEC_VEC() 1
#elif defined(__SSE2__)
#define SSM_DEC_VB 16
#define SSM_DEC_VEC() 1
#endif

#ifdef SSM_DEC_VB
#define SSM_DEC_NSUB (64 / SSM_DEC_VB)
#if SSM_LANES_IS_16                   /* lanes per vector (a preprocessor number: no sizeof) */
#define SSM_DEC_DL (SSM_DEC_VB / 4)
#else
#define SSM_DEC_DL (SSM_DEC_VB / 8)
#endif
typedef REAL SFX(dvec) __attribute__((vector_size(SSM_DEC_VB)));
#if SSM_LANES_IS_16
typedef uint32_t SFX(duvec) __attribute__((vector_size(SSM_DEC_VB)));
typedef int32_t SFX(divec) __attribute__((vector_size(SSM_DEC_VB)));
#define SSM_DEC_EXP_BIAS 0x4B400000u
#define SSM_DEC_EXP_SHL 23
#else
typedef uint64_t SFX(duvec) __attribute__((vector_size(SSM_DEC_VB)));
typedef int64_t SFX(divec) __attribute__((vector_size(SSM_DEC_VB)));
#define SSM_DEC_EXP_BIAS 0x4338000000000000ull
#define SSM_DEC_EXP_SHL 52
#endif

SSM_INLINE SFX(dvec) SFX(ssm_dec_vload)(const REAL * ptr) {
    SFX(dvec) v;
    memcpy(&v, ptr, sizeof v);
    return v;
}

/* whether every lane of z is within SSM_EXP_FAST's range (false for NaN) */
SSM_INLINE int SFX(ssm_dec_in_range)(SFX(dvec) z) {
#if SSM_DEC_VB == 64 && SSM_LANES_IS_16
    return _mm512_cmp_ps_mask(_mm512_abs_ps((__m512) z), _mm512_set1_ps(SSM_EXP_FAST_MAX), _CMP_LE_OQ) == 0xFFFF;
#elif SSM_DEC_VB == 64
    return _mm512_cmp_pd_mask(_mm512_abs_pd((__m512d) z), _mm512_set1_pd(SSM_EXP_FAST_MAX), _CMP_LE_OQ) == 0xFF;
#elif SSM_DEC_VB == 32 && SSM_LANES_IS_16
    const __m256 a = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), (__m256) z);
    return _mm256_movemask_ps(_mm256_cmp_ps(a, _mm256_set1_ps(SSM_EXP_FAST_MAX), _CMP_LE_OQ)) == 0xFF;
#elif SSM_DEC_VB == 32
    const __m256d a = _mm256_andnot_pd(_mm256_set1_pd(-0.0), (__m256d) z);
    return _mm256_movemask_pd(_mm256_cmp_pd(a, _mm256_set1_pd(SSM_EXP_FAST_MAX), _CMP_LE_OQ)) == 0xF;
#elif SSM_LANES_IS_16
    const __m128 a = _mm_andnot_ps(_mm_set1_ps(-0.0f), (__m128) z);
    return _mm_movemask_ps(_mm_cmple_ps(a, _mm_set1_ps(SSM_EXP_FAST_MAX))) == 0xF;
#else
    const __m128d a = _mm_andnot_pd(_mm_set1_pd(-0.0), (__m128d) z);
    return _mm_movemask_pd(_mm_cmple_pd(a, _mm_set1_pd(SSM_EXP_FAST_MAX))) == 0x3;
#endif
}

/* ssm_expf_fast / ssm_exp_fast_f64 on a vector (the same expressions) */
SSM_INLINE SFX(dvec) SFX(ssm_dec_vexp_fast)(SFX(dvec) x) {
    typedef SFX(dvec) vec;
    typedef SFX(duvec) uvec;
#if SSM_LANES_IS_16
    const vec kf = x * 1.44269504088896341f + SSM_EXPF_SHIFT;
    const vec k = kf - SSM_EXPF_SHIFT;
    const vec p = SSM_EXPF_POLY(vec, x, k);
#else
    const vec kf = x * 1.4426950408889634074 + SSM_EXP_SHIFT;
    const vec k = kf - SSM_EXP_SHIFT;
    const vec p = SSM_EXP_POLY_F64(vec, x, k);
#endif
    const uvec bits = (uvec) p + (((uvec) kf - SSM_DEC_EXP_BIAS) << SSM_DEC_EXP_SHL);
    return (vec) bits;
}

/* the tree of ssm_dec_reduce on a chunk's SSM_DEC_NSUB vectors (lane j of vector u is lane
 * u * SSM_DEC_DL + j of the chunk): each fold adds lane j + w to lane j, j < w */
SSM_INLINE REAL SFX(ssm_dec_vreduce)(SFX(dvec) * acc) {
    for (int w = SSM_DEC_NSUB / 2; w >= 1; w /= 2)      /* folds across vectors */
        for (int u = 0; u < w; ++u) acc[u] += acc[u + w];
    SFX(dvec) v = acc[0];
#if SSM_DEC_DL == 16
    v = v + SSM_SHUFFLE2(SFX(divec), v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v = v + SSM_SHUFFLE2(SFX(divec), v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    v = v + SSM_SHUFFLE2(SFX(divec), v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
#elif SSM_DEC_DL == 8
    v = v + SSM_SHUFFLE2(SFX(divec), v, v, 4, 5, 6, 7, 0, 1, 2, 3);
    v = v + SSM_SHUFFLE2(SFX(divec), v, v, 2, 3, 0, 1, 6, 7, 4, 5);
#elif SSM_DEC_DL == 4
    return (v[0] + v[2]) + (v[1] + v[3]);
#endif
    return v[0] + v[1];
}

/* one token of R rows (R = 1 or SSM_DEC_ROWS) whose d_state is a multiple of SSM_LANES, and which
 * share B and C (one group); the rows are interleaved only so that their dependency chains
 * overlap, each row's operations are those of a row alone. y[r] of each row. */
SSM_INLINE void SFX(ssm_dec_rows_vec)(const int R, const int per_state, const int64_t ds,
                                       const REAL * const * src, REAL * const * dst, const REAL * sp,
                                       const REAL * a2, const REAL * xdt, const REAL * const * Ar,
                                       const REAL * Bv, const REAL * Cv, REAL * y) {
    typedef SFX(dvec) vec;
    vec acc[SSM_DEC_ROWS][SSM_DEC_NSUB];
    for (int r = 0; r < R; ++r)
        for (int u = 0; u < SSM_DEC_NSUB; ++u) acc[r][u] = (vec) { 0 };
    for (int64_t n0 = 0; n0 < ds; n0 += SSM_LANES)
        for (int u = 0; u < SSM_DEC_NSUB; ++u) {
            const int64_t n = n0 + u * SSM_DEC_DL;
            const vec bv = SFX(ssm_dec_vload)(Bv + n), cv = SFX(ssm_dec_vload)(Cv + n);
            for (int r = 0; r < R; ++r) {
                const vec hv = SFX(ssm_dec_vload)(src[r] + n);
                vec a;
                if (per_state) {
                    const vec z = sp[r] * SFX(ssm_dec_vload)(Ar[r] + n);
                    if (SFX(ssm_dec_in_range)(z)) a = SFX(ssm_dec_vexp_fast)(z);
                    else {
                        a = z;
                        for (int j = 0; j < SSM_DEC_DL; ++j) a[j] = SSM_EXP(z[j]);
                    }
                } else {
                    a = (vec) { 0 } + a2[r];
                }
                const vec h = hv * a + bv * xdt[r];
                memcpy(dst[r] + n, &h, sizeof h);
                acc[r][u] += h * cv;
            }
        }
    for (int r = 0; r < R; ++r) y[r] = SFX(ssm_dec_vreduce)(acc[r]);
}

SSM_INLINE REAL SFX(ssm_dec_row_vec)(const int per_state, const int64_t ds, const REAL * src, REAL * dst,
                                      REAL sp, REAL a2, REAL xdt, const REAL * Ar, const REAL * Bv,
                                      const REAL * Cv) {
    REAL y;
    SFX(ssm_dec_rows_vec)(1, per_state, ds, &src, &dst, &sp, &a2, &xdt, &Ar, Bv, Cv, &y);
    return y;
}
#undef SSM_DEC_EXP_BIAS
#undef SSM_DEC_EXP_SHL
#endif /* SSM_DEC_VB */

/* one token of one row (dst may be src: in place); returns y */
SSM_INLINE REAL SFX(ssm_dec_row)(const int per_state, const int64_t ds, const REAL * src, REAL * dst,
                                  REAL sp, REAL a2, REAL xdt, const REAL * Ar, const REAL * Bv, const REAL * Cv) {
    const int64_t nv = ds / SSM_LANES * SSM_LANES;
#ifdef SSM_DEC_VB
    if (SSM_DEC_VEC() && nv == ds) return SFX(ssm_dec_row_vec)(per_state, ds, src, dst, sp, a2, xdt, Ar, Bv, Cv);
#endif
    REAL acc[SSM_LANES];
    for (int j = 0; j < SSM_LANES; ++j) acc[j] = 0;
    for (int64_t n0 = 0; n0 < nv; n0 += SSM_LANES)
        SFX(ssm_dec_chunk)(SSM_LANES, per_state, src + n0, dst + n0, sp, a2, xdt, Ar + n0, Bv + n0, Cv + n0, acc);
    if (nv < ds)
        SFX(ssm_dec_chunk)((int) (ds - nv), per_state, src + nv, dst + nv, sp, a2, xdt, Ar + nv, Bv + nv,
                           Cv + nv, acc);
    return SFX(ssm_dec_reduce)(acc);
}

/* the decode path for the (sequence, head) pairs [u_lo, u_hi), per_state = p->a_per_state */
SSM_INLINE void SFX(ssm_scan_decode_impl)(const ssm_scan_params * p, const REAL * s, const REAL * x,
                                           const REAL * dt, const REAL * A, const REAL * B, const REAL * C,
                                           const int64_t * ids, REAL * y_out, REAL * st_out, int64_t u_lo,
                                           int64_t u_hi, const int per_state) {
    const int64_t n_head = p->n_head, hd = p->head_dim, ds = p->d_state;
    const int64_t n_t = p->n_t, n_seqs = p->n_seqs, K = p->K;
    const int64_t hpg = ssm_heads_per_group(p);
    const int64_t s0 = p->s_st[0], s1 = p->s_st[1], s2 = p->s_st[2];
    const int64_t x0 = p->x_st[0], x1 = p->x_st[1], x2 = p->x_st[2], x3 = p->x_st[3];
    const int64_t d0 = p->dt_st[0], d1 = p->dt_st[1], d2 = p->dt_st[2], A0 = p->A_st[0];
    const int64_t B0 = p->B_st[0], B1 = p->B_st[1], B2 = p->B_st[2];
    const int64_t C0 = p->C_st[0], C1 = p->C_st[1], C2 = p->C_st[2];
    REAL sp[SSM_DECODE_MAX_T * SSM_DEC_HEADS], ar[SSM_DECODE_MAX_T * SSM_DEC_HEADS];

    for (int64_t u = u_lo; u < u_hi;) {
        const int64_t q = u / n_head, h0 = u % n_head;
        const int64_t h1 = ssm_min64(ssm_min64(h0 + SSM_DEC_HEADS, n_head), h0 + (u_hi - u));
        const int64_t nb = h1 - h0;
        for (int64_t t = 0; t < n_t; ++t) {
            const REAL * d = dt + q * d0 + t * d1 + h0 * d2;
            REAL * restrict spt = sp + t * SSM_DEC_HEADS;
            for (int64_t j = 0; j < nb; ++j) spt[j] = d[j * d2];
            SFX(ssm_softplus_n)(spt, nb);
            if (!per_state) {
                REAL * restrict art = ar + t * SSM_DEC_HEADS;
                for (int64_t j = 0; j < nb; ++j) art[j] = SSM_EXP(spt[j] * A[(h0 + j) * A0]);
            }
        }
        const REAL * sq = s + ids[q] * s0;
#ifdef SSM_DEC_VB
        /* Mamba-1 as llama.cpp and transformers run it (one row per head), one token: SSM_DEC_ROWS
         * heads of one group at a time */
        if (SSM_DEC_VEC() && per_state && hd == 1 && n_t == 1 && ds % SSM_LANES == 0) {
            for (int64_t h = h0; h < h1;) {
                const int64_t g = h / hpg;
                const int R = h + SSM_DEC_ROWS <= h1 && (h + SSM_DEC_ROWS - 1) / hpg == g ? SSM_DEC_ROWS : 1;
                const REAL * srcs[SSM_DEC_ROWS], * Ars[SSM_DEC_ROWS];
                REAL * dsts[SSM_DEC_ROWS];
                REAL sps[SSM_DEC_ROWS], xdts[SSM_DEC_ROWS], a0s[SSM_DEC_ROWS] = { 0 };
                for (int r = 0; r < R; ++r) {
                    srcs[r] = sq + (h + r) * s1;
                    dsts[r] = st_out + (q * n_head + h + r) * ds;
                    Ars[r] = A + (h + r) * A0;
                    sps[r] = sp[h + r - h0];
                    xdts[r] = x[q * x0 + (h + r) * x2] * sps[r];
                }
                const REAL * Bv = B + q * B0 + g * B2, * Cv = C + q * C0 + g * C2;
                REAL * yv = y_out + q * n_head + h;
                if (R == SSM_DEC_ROWS)
                    SFX(ssm_dec_rows_vec)(SSM_DEC_ROWS, 1, ds, srcs, dsts, sps, a0s, xdts, Ars, Bv, Cv, yv);
                else SFX(ssm_dec_rows_vec)(1, 1, ds, srcs, dsts, sps, a0s, xdts, Ars, Bv, Cv, yv);
                for (int r = 0; r < R; ++r)   /* slots no token reaches: none for K = 1 */
                    for (int64_t k = 1; k < K; ++k)
                        memset(st_out + ((k * n_seqs + q) * n_head + h + r) * ds, 0, ds * sizeof(REAL));
                h += R;
            }
            u += nb;
            continue;
        }
#endif
        int64_t g = h0 / hpg, g_end = (g + 1) * hpg;
        for (int64_t h = h0; h < h1; ++h) {
            const int64_t j = h - h0;
            if (h == g_end) {
                ++g;
                g_end += hpg;
            }
            const REAL * src = sq + h * s1;
            REAL * dst = st_out + (q * n_head + h) * hd * ds;
            const REAL * Ar = A + h * A0;
            const REAL * xh = x + q * x0 + h * x2;
            for (int64_t t = 0; t < n_t; ++t) {
                const REAL spv = sp[t * SSM_DEC_HEADS + j];
                const REAL a = per_state ? 0 : ar[t * SSM_DEC_HEADS + j];
                const REAL * Bv = B + q * B0 + t * B1 + g * B2;
                const REAL * Cv = C + q * C0 + t * C1 + g * C2;
                REAL * yt = y_out + ((q * n_t + t) * n_head + h) * hd;
                for (int64_t pp = 0; pp < hd; ++pp) {
                    const REAL xdt = xh[t * x1 + pp * x3] * spv;
                    REAL * row = dst + pp * ds;
                    yt[pp] = SFX(ssm_dec_row)(per_state, ds, t == 0 ? src + pp * s2 : row, row, spv, a, xdt,
                                              Ar, Bv, Cv);
                }
                const int64_t k = n_t - 1 - t;     /* this state is snapshot slot k */
                if (k >= 1 && k < K)
                    memcpy(st_out + ((k * n_seqs + q) * n_head + h) * hd * ds, dst, hd * ds * sizeof(REAL));
            }
            for (int64_t k = n_t; k < K; ++k)   /* slots no token reaches (n_t >= 1 here) */
                memset(st_out + ((k * n_seqs + q) * n_head + h) * hd * ds, 0, hd * ds * sizeof(REAL));
        }
        u += nb;
    }
}

/* the decode path for thread ith of nth, y and the states to separate buffers: ssm_scan's out is
 * y_out = out, st_out = out + N_y. The glue's in-place update of a cache (ssm_scan_decode_into) passes
 * st_out = s itself, for K = 1, n_rs = n_seqs, ids[q] = q and a dense s: every row is then read
 * before it is written and by its own thread only. */
static void SFX(ssm_scan_decode)(const ssm_scan_params * p, const REAL * s, const REAL * x, const REAL * dt,
                                 const REAL * A, const REAL * B, const REAL * C, const int64_t * ids,
                                 REAL * y_out, REAL * st_out, int ith, int nth) {
    int64_t lo, hi;
    ssm_split(p->n_seqs * p->n_head, ith, nth, &lo, &hi);
    if (p->a_per_state) SFX(ssm_scan_decode_impl)(p, s, x, dt, A, B, C, ids, y_out, st_out, lo, hi, 1);
    else SFX(ssm_scan_decode_impl)(p, s, x, dt, A, B, C, ids, y_out, st_out, lo, hi, 0);
}

SSM_KERNEL void SFX(ssm_scan_decode_into)(const ssm_scan_params * p, const REAL * s, const REAL * x,
                                          const REAL * dt, const REAL * A, const REAL * B, const REAL * C,
                                          const int64_t * ids, REAL * y, REAL * st, int ith, int nth) {
    SFX(ssm_scan_decode)(p, s, x, dt, A, B, C, ids, y, st, ith, nth);
}

/*
 * ---------------------------------------------------------------------------------------
 * The chunked (SSD) form of the forward, for Mamba-2 (one decay per head) with K == 1.
 *
 * A block's tokens are cut into chunks of SSM_FQ. Within a chunk, with l_t the cumulative sum of
 * sp * A from the chunk's first token through t (in double), S0 the state before the chunk and
 * Xs_t = sp_t x_t (the recurrence's xdt):
 *   y_t   = e^(l_t) C_t S0 + sum_{tau <= t} e^(l_t - l_tau) (C_t . B_tau) Xs_tau
 *   S_end = e^(l_end) S0 + sum_tau e^(l_end - l_tau) B_tau (x) Xs_tau
 * the same algebra as the backward's chunked form (ssm_scan_back.c), in ssm_mm products. The chunks
 * run in order and each head keeps only its running state ([Np][Pp], in place); C_t . B_tau is
 * computed once per chunk for the block's heads (heads of one group). Each y and state element is
 * a sum in an order fixed by the shape; a head's results do not depend on which other heads share
 * its block (C . B is the same bits for any block), so the thread count never changes the bits.
 */
#define SSM_FQ 64      /* tokens per chunk */
#define SSM_FBH 8      /* heads per block: their states ([Np][Pp] each, 32 KB at 64 x 128 floats)
                          and one chunk's B, C stay in L2 across the block's heads */

#include "ssm_mm.h"

/* Buffers of one thread for the chunked forward. Np, Pp: d_state, head_dim padded to 16. */
typedef struct {
    REAL * S;     /* [SSM_FBH][Np][Pp] the block's running states (transposed: state n, row p) */
    REAL * Bc, * Cc;   /* [Q][Np] one chunk's B, C where gathered */
    const REAL * Bp, * Cp;   /* the chunk's rows of B and C: in the inputs, or Bc and Cc */
    int64_t bst, cst;
    REAL * BT;    /* [Np][Q] B transposed */
    REAL * CB, * CBd;   /* [Q][Q] C_t . B_tau; times e^(l_t - l_tau) below the diagonal, 0 above */
    REAL * X;     /* [Q][Pp] x where gathered */
    REAL * Xs, * W, * Y;   /* [Q][Pp] sp x; e^(l_end - l_t) sp x; the chunk's y */
    double * l;   /* [Q] */
    REAL * sp, * el, * e2, * er;   /* [Q] */
    int fast;     /* the chunk's e^(l_t - l_tau) all within SSM_EXP_FAST's range */
} SFX(ssm_fwd_chunk);

SSM_INLINE int64_t SFX(ssm_fc_np)(const ssm_scan_params * p) { return ssm_pad(ssm_max64(p->d_state, 1), 16); }
SSM_INLINE int64_t SFX(ssm_fc_pp)(const ssm_scan_params * p) { return ssm_pad(ssm_max64(p->head_dim, 1), 16); }

static void SFX(ssm_fwd_take_chunk)(ssm_arena * a, const ssm_scan_params * p, SFX(ssm_fwd_chunk) * ck) {
    const size_t e = sizeof(REAL), Q = SSM_FQ;
    const size_t Np = (size_t) SFX(ssm_fc_np)(p), Pp = (size_t) SFX(ssm_fc_pp)(p);
    ck->S = ssm_take(a, SSM_FBH * Np * Pp * e);
    ck->Bc = ssm_take(a, Q * Np * e);
    ck->Cc = ssm_take(a, Q * Np * e);
    ck->BT = ssm_take(a, Np * Q * e);
    ck->CB = ssm_take(a, Q * Q * e);
    ck->CBd = ssm_take(a, Q * Q * e);
    ck->X = ssm_take(a, Q * Pp * e);
    ck->Xs = ssm_take(a, Q * Pp * e);
    ck->W = ssm_take(a, Q * Pp * e);
    ck->Y = ssm_take(a, Q * Pp * e);
    ck->l = ssm_take(a, Q * sizeof(double));
    ck->sp = ssm_take(a, Q * e);
    ck->el = ssm_take(a, Q * e);
    ck->e2 = ssm_take(a, Q * e);
    ck->er = ssm_take(a, Q * e);
}

static size_t SFX(ssm_fwd_chunk_bytes)(const ssm_scan_params * p) {
    ssm_arena a = { NULL, 0 };
    SFX(ssm_fwd_chunk) ck;
    SFX(ssm_fwd_take_chunk)(&a, p, &ck);
    return a.off;
}

/* Bp, Cp: the rows of B and C of tokens [t0, t0 + L) of group g, in place where their rows are
 * contiguous whole vectors (d_state a multiple of 16), else gathered into Bc, Cc ([Q][Np], zero
 * past d_state); and BT = B transposed ([Np][Q], zero past L and d_state). */
static void SFX(ssm_fc_bc)(const ssm_scan_params * p, int64_t q, int64_t g, int64_t t0, int64_t L,
                           const REAL * B, const REAL * C, SFX(ssm_fwd_chunk) * ck) {
    const int64_t Np = SFX(ssm_fc_np)(p), ds = p->d_state, B3 = p->B_st[3], C3 = p->C_st[3];
    const REAL * B0 = B + q * p->B_st[0] + t0 * p->B_st[1] + g * p->B_st[2];
    const REAL * C0 = C + q * p->C_st[0] + t0 * p->C_st[1] + g * p->C_st[2];
    if (Np == ds && B3 == 1 && C3 == 1) {
        ck->Bp = B0;
        ck->Cp = C0;
        ck->bst = p->B_st[1];
        ck->cst = p->C_st[1];
    } else {
        for (int64_t t = 0; t < L; ++t) {
            const REAL * Br = B0 + t * p->B_st[1];
            const REAL * Cr = C0 + t * p->C_st[1];
            REAL * restrict bo = ck->Bc + t * Np;
            REAL * restrict co = ck->Cc + t * Np;
            for (int64_t n = 0; n < ds; ++n) bo[n] = Br[n * B3];
            for (int64_t n = 0; n < ds; ++n) co[n] = Cr[n * C3];
            for (int64_t n = ds; n < Np; ++n) bo[n] = co[n] = 0;
        }
        ck->Bp = ck->Bc;
        ck->Cp = ck->Cc;
        ck->bst = ck->cst = Np;
    }
    const int64_t Q = SSM_FQ;
    if (L < Q || Np != ds) memset(ck->BT, 0, (size_t) (Np * Q) * sizeof(REAL));
    const REAL * restrict Bp = ck->Bp;
    REAL * restrict BT = ck->BT;
    const int64_t bst = ck->bst;
    for (int64_t t0b = 0; t0b < L; t0b += 16) {     /* in 16 x 16 blocks that stay in L1 */
        const int64_t t1 = ssm_min64(t0b + 16, L);
        for (int64_t n0 = 0; n0 < ds; n0 += 16) {
            const int64_t n1 = ssm_min64(n0 + 16, ds);
            for (int64_t t = t0b; t < t1; ++t)
                for (int64_t n = n0; n < n1; ++n) BT[n * Q + t] = Bp[t * bst + n];
        }
    }
}

/* One chunk of head h (state S, [Np][Pp]): its y to y_out, S advanced in place past the chunk. */
static void SFX(ssm_fc_head)(const ssm_scan_params * p, int64_t q, int64_t h, int64_t t0, int64_t L,
                             const REAL * x, const REAL * dt, const REAL Ah, REAL * S, REAL * y_out,
                             SFX(ssm_fwd_chunk) * ck) {
    const int64_t Q = SSM_FQ, Pp = SFX(ssm_fc_pp)(p), hd = p->head_dim, ds = p->d_state;
    const int64_t n_head = p->n_head, n_t = p->n_t, x3 = p->x_st[3];

    /* softplus(dt) (as the recurrence), the cumulative log decays, e^(l_t), e^(l_end - l_t) */
    {
        const REAL * d = dt + q * p->dt_st[0] + t0 * p->dt_st[1] + h * p->dt_st[2];
        REAL * restrict sp = ck->sp;
        for (int64_t t = 0; t < L; ++t) sp[t] = d[t * p->dt_st[1]];
        for (int64_t t = 0; t < L; ++t) sp[t] = SSM_SOFTPLUS(sp[t]);
        double acc = 0;
        for (int64_t t = 0; t < L; ++t) {
            acc += (double) (sp[t] * Ah);
            ck->l[t] = acc;
        }
        REAL * restrict e2 = ck->e2;
        REAL * restrict el = ck->el;
        for (int64_t t = 0; t < L; ++t) e2[t] = (REAL) (acc - ck->l[t]);
        for (int64_t t = 0; t < L; ++t) e2[t] = SSM_EXP(e2[t]);
        for (int64_t t = 0; t < L; ++t) el[t] = (REAL) ck->l[t];
        for (int64_t t = 0; t < L; ++t) el[t] = SSM_EXP(el[t]);
        /* whether every l_t - l_tau is within SSM_EXP_FAST's range: |fl(l_t - l_tau)| <= fl(lmax - lmin)
         * by the monotony of rounding; a NaN in l makes the last one (acc) NaN, and fails the test */
        double lmin = 0, lmax = 0;
        for (int64_t t = 0; t < L; ++t) {
            lmin = ck->l[t] < lmin ? ck->l[t] : lmin;
            lmax = ck->l[t] > lmax ? ck->l[t] : lmax;
        }
        ck->fast = (REAL) (lmax - lmin) <= SSM_EXP_FAST_MAX && acc == acc;
    }

    /* Xs = sp x, W = e2 Xs ([Q][Pp], zero past head_dim) */
    {
        const REAL * x0 = x + q * p->x_st[0] + t0 * p->x_st[1] + h * p->x_st[2];
        const REAL * Xp = x0;
        int64_t xst = p->x_st[1];
        if (!(x3 == 1 && hd == Pp)) {
            for (int64_t t = 0; t < L; ++t) {
                const REAL * xr = x0 + t * p->x_st[1];
                REAL * restrict xo = ck->X + t * Pp;
                for (int64_t pp = 0; pp < hd; ++pp) xo[pp] = xr[pp * x3];
                for (int64_t pp = hd; pp < Pp; ++pp) xo[pp] = 0;
            }
            Xp = ck->X;
            xst = Pp;
        }
        for (int64_t t = 0; t < L; ++t) {
            const REAL * restrict xr = Xp + t * xst;
            REAL * restrict xs = ck->Xs + t * Pp;
            REAL * restrict w = ck->W + t * Pp;
            const REAL spt = ck->sp[t], e2t = ck->e2[t];
            for (int64_t pp = 0; pp < Pp; ++pp) xs[pp] = xr[pp] * spt;
            for (int64_t pp = 0; pp < Pp; ++pp) w[pp] = e2t * xs[pp];
        }
    }

    /* CBd[t][tau] = e^(l_t - l_tau) CB[t][tau] for tau <= t, 0 for t < tau < L */
    for (int64_t t = 0; t < L; ++t) {
        const REAL * cbr = ck->CB + t * Q;
        REAL * restrict o = ck->CBd + t * Q;
        REAL * restrict er = ck->er;
        const double lt = ck->l[t];
        for (int64_t tau = 0; tau <= t; ++tau) er[tau] = (REAL) (lt - ck->l[tau]);
        if (ck->fast)   /* equal to SSM_EXP bit for bit in its range, and a loop that vectorizes */
            for (int64_t tau = 0; tau <= t; ++tau) er[tau] = SSM_EXP_FAST(er[tau]);
        else
            for (int64_t tau = 0; tau <= t; ++tau) er[tau] = SSM_EXP(er[tau]);
        for (int64_t tau = 0; tau <= t; ++tau) o[tau] = er[tau] * cbr[tau];
        for (int64_t tau = t + 1; tau < L; ++tau) o[tau] = 0;
    }

    /* Y_t = e^(l_t) C_t S0, then + sum_{tau <= t} CBd[t][tau] Xs_tau */
    SFX(ssm_mm)(L, Pp, ds, ck->Cp, ck->cst, 1, S, Pp, ck->Y, Pp, 0, SSM_MM_FULL, NULL, 0, ck->el, NULL);
    SFX(ssm_mm)(L, Pp, L, ck->CBd, Q, 1, ck->Xs, Pp, ck->Y, Pp, 1, SSM_MM_LOWER, NULL, 0, NULL, NULL);
    for (int64_t t = 0; t < L; ++t)
        memcpy(y_out + ((q * n_t + t0 + t) * n_head + h) * hd, ck->Y + t * Pp, hd * sizeof(REAL));

    /* S[n][p] = e^(l_end) S[n][p] + sum_t B[t][n] W[t][p] (in place: each element read before written) */
    SFX(ssm_mm)(ds, Pp, L, ck->Bp, 1, ck->bst, ck->W, Pp, S, Pp, 0, SSM_MM_FULL, S, ck->el[L - 1], NULL, NULL);
}

/* Ask for the rows of x of head h at tokens [t0, t0 + L) ahead of use: one row of a few hundred
 * bytes per token, n_head * head_dim elements apart, where the hardware prefetchers do not follow. */
SSM_INLINE void SFX(ssm_fc_prefetch)(const ssm_scan_params * p, int64_t q, int64_t h, int64_t t0, const REAL * x) {
    if (t0 >= p->n_t || p->x_st[3] != 1) return;
    const int64_t L = ssm_min64(SSM_FQ, p->n_t - t0);
    const REAL * x0 = x + q * p->x_st[0] + t0 * p->x_st[1] + h * p->x_st[2];
    for (int64_t t = 0; t < L; ++t) SFX(ssm_prefetch_run)(x0 + t * p->x_st[1], p->head_dim);
}

/* The chunked forward of sequence q, heads [h0, h1) of group g (h1 - h0 <= SSM_FBH). */
static void SFX(ssm_fwd_block_chunked)(const ssm_scan_params * p, int64_t q, int64_t g, int64_t h0, int64_t h1,
                                       const REAL * s, const REAL * x, const REAL * dt, const REAL * A,
                                       const REAL * B, const REAL * C, const int64_t * ids, REAL * y_out,
                                       REAL * st_out, SFX(ssm_fwd_chunk) * ck) {
    const int64_t Q = SSM_FQ, Np = SFX(ssm_fc_np)(p), Pp = SFX(ssm_fc_pp)(p);
    const int64_t hd = p->head_dim, ds = p->d_state, n_t = p->n_t, n_head = p->n_head;
    const int64_t stn = Np * Pp;

    for (int64_t h = h0; h < h1; ++h) {          /* the start states, transposed */
        REAL * S = ck->S + (h - h0) * stn;
        memset(S, 0, (size_t) stn * sizeof(REAL));
        const REAL * src = s + ids[q] * p->s_st[0] + h * p->s_st[1];
        for (int64_t pp = 0; pp < hd; ++pp)
            for (int64_t n = 0; n < ds; ++n) S[n * Pp + pp] = src[pp * p->s_st[2] + n * p->s_st[3]];
    }
    for (int64_t t0 = 0; t0 < n_t; t0 += Q) {
        const int64_t L = ssm_min64(Q, n_t - t0);
        SFX(ssm_fc_bc)(p, q, g, t0, L, B, C, ck);
        SFX(ssm_mm)(L, Q, ds, ck->Cp, ck->cst, 1, ck->BT, Q, ck->CB, Q, 0, SSM_MM_OUT_LOWER, NULL, 0, NULL, NULL);
        for (int64_t h = h0; h < h1; ++h) {
            if (h + 1 < h1) SFX(ssm_fc_prefetch)(p, q, h + 1, t0, x);
            else {   /* the next chunk's: the first head's x rows, the group's B and C rows */
                SFX(ssm_fc_prefetch)(p, q, h0, t0 + Q, x);
                for (int64_t t = t0 + Q; t < ssm_min64(t0 + 2 * Q, n_t); ++t) {
                    if (p->B_st[3] == 1) SFX(ssm_prefetch_run)(B + q * p->B_st[0] + t * p->B_st[1] + g * p->B_st[2], ds);
                    if (p->C_st[3] == 1) SFX(ssm_prefetch_run)(C + q * p->C_st[0] + t * p->C_st[1] + g * p->C_st[2], ds);
                }
            }
            SFX(ssm_fc_head)(p, q, h, t0, L, x, dt, A[h * p->A_st[0]], ck->S + (h - h0) * stn, y_out, ck);
        }
    }
    for (int64_t h = h0; h < h1; ++h) {          /* the final states, slot 0 */
        const REAL * S = ck->S + (h - h0) * stn;
        REAL * dst = st_out + (q * n_head + h) * hd * ds;
        for (int64_t pp = 0; pp < hd; ++pp)
            for (int64_t n = 0; n < ds; ++n) dst[pp * ds + n] = S[n * Pp + pp];
    }
}

/*
 * Forward.
 *   s (n_rs, n_head, head_dim, d_state), x (n_seqs, n_t, n_head, head_dim), dt (n_seqs, n_t, n_head),
 *   A (n_head, d_state | 1), B, C (n_seqs, n_t, n_group, d_state), ids (n_seqs,)
 *   -> out: y (n_seqs, n_t, n_head, head_dim) then states (K, n_seqs, n_head, head_dim, d_state)
 * For each sequence q: H = s[ids[q]]; per token t and head h:
 *   H = exp(softplus(dt) * A) * H + B (x) (x * softplus(dt));  y = H . C   (the updated H)
 * Thread ith owns a contiguous run of the (sequence, head) pairs and writes only their y and
 * state rows, so any thread count gives the same bits.
 */
SSM_KERNEL void SFX(ssm_scan)(const ssm_scan_params * p, const REAL * s, const REAL * x, const REAL * dt,
                   const REAL * A, const REAL * B, const REAL * C, const int64_t * ids,
                   REAL * out, void * work, int ith, int nth) {
    const int64_t n_head = p->n_head, hd = p->head_dim, ds = p->d_state;
    const int64_t n_t = p->n_t, n_seqs = p->n_seqs, K = p->K;
    const int64_t hpg = ssm_heads_per_group(p), bh = ssm_block_heads(p);
    REAL * y_out = out;
    REAL * st_out = out + n_seqs * n_t * n_head * hd;

    if (ssm_scan_decode_path(p)) {
        SFX(ssm_scan_decode)(p, s, x, dt, A, B, C, ids, y_out, st_out, ith, nth);
        return;
    }
    ssm_arena arena = { (char *) work + SFX(ssm_scan_thread_bytes)(p) * (size_t) ith, 0 };
    int64_t u_lo, u_hi;
    ssm_split(n_seqs * n_head, ith, nth, &u_lo, &u_hi);
    if (ssm_scan_fwd_chunked(p)) {      /* blocks of at most SSM_FBH heads of one group */
        SFX(ssm_fwd_chunk) ck;
        SFX(ssm_fwd_take_chunk)(&arena, p, &ck);
        for (int64_t u = u_lo; u < u_hi;) {
            const int64_t q = u / n_head, h0 = u % n_head;
            const int64_t g_end = (h0 / hpg + 1) * hpg;
            const int64_t h1 = ssm_min64(ssm_min64(h0 + SSM_FBH, g_end), h0 + (u_hi - u));
            SFX(ssm_fwd_block_chunked)(p, q, h0 / hpg, h0, h1, s, x, dt, A, B, C, ids, y_out, st_out, &ck);
            u += h1 - h0;
        }
        return;
    }
    SFX(ssm_rows) v;
    SFX(ssm_take_rows)(&arena, p, ssm_max_rows_padded(p), &v);

    for (int64_t u = u_lo; u < u_hi;) {
        const int64_t q = u / n_head, h0 = u % n_head;
        const int64_t g_end = (h0 / hpg + 1) * hpg;
        const int64_t h1 = ssm_min64(ssm_min64(h0 + bh, g_end), h0 + (u_hi - u));
        const ssm_block b = ssm_make_block(p, q, h0, h1);

        SFX(ssm_rows_begin)(p, &b, A, &v);
        SFX(ssm_load_state)(p, &b, s, ids, v.H);
        for (int64_t t = 0; t < n_t; ++t) {
            SFX(ssm_prefetch_token)(p, &b, x, dt, B, C, t + SSM_PREFETCH_TOKENS);
            SFX(ssm_rows_token)(p, &b, x, dt, A, B, C, t, &v);
            SFX(ssm_step)(p, b.Rp, &v, v.H, v.H, v.y);
            memcpy(y_out + ((q * n_t + t) * n_head + h0) * hd, v.y, b.R * sizeof(REAL));
            const int64_t k = n_t - 1 - t;     /* this state is snapshot slot k */
            if (k >= 1 && k < K)
                SFX(ssm_store_state)(p, &b, v.H, st_out + ((k * n_seqs + q) * n_head + h0) * hd * ds);
        }
        SFX(ssm_store_state)(p, &b, v.H, st_out + (q * n_head + h0) * hd * ds);
        for (int64_t k = ssm_max64(1, n_t); k < K; ++k)   /* slots no token reaches */
            memset(st_out + ((k * n_seqs + q) * n_head + h0) * hd * ds, 0, b.R * ds * sizeof(REAL));
        u += h1 - h0;
    }
}

#undef SSM_FQ
#undef SSM_FBH
#undef SSM_DEC_VB
#undef SSM_DEC_VEC
#undef SSM_DEC_NSUB
#undef SSM_DEC_DL

#endif /* SSM_TMPL */
