/*
 * ssm_dispatch.c -- which SIMD pass a kernel call runs, and the build facts show_config() prints.
 *
 * The kernels are compiled once per SIMD level (csrc/inst/); each public kernel (the
 * dispatchers ssm_*_dispatch.c) calls the level ssm_simd_level(p->simd) names: the highest level this CPU runs (a fact of the hardware,
 * read from cpuid once and cached), capped by the call's params.simd (SSM_SIMD_*, ssmgrad.h).
 * Nothing here reads the environment: the Python glue turns SSMGRAD_SIMD and SSMGRAD_NO_AVX512
 * into params.simd at import (csrc/glue/settings.c).
 */
#include "ssm_common.h"

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

/* the highest level whose every feature this CPU (and its OS: the cpuid checks include the
 * XSAVE state for AVX and AVX-512) supports */
static int ssm_cpu_level_read(void) {
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

/* A cache of an immutable fact (the CPU's features), not a switch: every thread that races to
 * fill it stores the same value. */
static int ssm_cpu_level_cached = -1;

static int ssm_cpu_level(void) {
    int level = __atomic_load_n(&ssm_cpu_level_cached, __ATOMIC_RELAXED);
    if (level < 0) {
        level = ssm_cpu_level_read();
        __atomic_store_n(&ssm_cpu_level_cached, level, __ATOMIC_RELAXED);
    }
    return level;
}

int ssm_simd_level(int64_t simd) {
    const int level = ssm_cpu_level();
    const int cap = simd == SSM_SIMD_X86_64 ? 0 : simd == SSM_SIMD_X86_64_V3 ? 3 : 4;
    return cap < level ? cap : level;
}

const char * ssm_simd_compiled(void) {
    return "x86-64-v4 (AVX-512), x86-64-v3 (AVX2+FMA), x86-64 baseline, picked at run time "
           "(compiler: " SSM_COMPILER "; dispatch: target pragmas + cpuid)";
}

const char * ssm_simd_name(int64_t simd) {
    const int level = ssm_simd_level(simd);
    const int capped = level < ssm_cpu_level();
    switch (level) {
    case 4: return "x86-64-v4";
    case 3: return capped ? "x86-64-v3 (capped)" : "x86-64-v3";
    default: return capped ? "x86-64 (capped)" : "x86-64";
    }
}

const char * ssm_simd_selected(void) { return ssm_simd_name(SSM_SIMD_AUTO); }

#else /* no runtime dispatch: the build's own target */

int ssm_simd_level(int64_t simd) {
    (void) simd;
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

const char * ssm_simd_name(int64_t simd) {
    (void) simd;
    return SSM_SIMD_BUILT " (no runtime dispatch)";
}

const char * ssm_simd_selected(void) { return ssm_simd_name(SSM_SIMD_AUTO); }

#endif /* SSM_DISPATCH */

int ssm_avx512_kernels(int64_t simd) { return ssm_simd_level(simd) >= 4 && simd != SSM_SIMD_V4_NO_VEC64; }
