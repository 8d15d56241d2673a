/*
 * peak.c -- this core's clock and its FMA throughput, the yardsticks of the "fraction of FMA
 * peak" figures in benchmarks/README.md: 512-bit FMAs (AVX-512F) where the CPU has them, and
 * 256-bit FMAs (AVX2 + FMA) on any x86-64-v3 CPU, so an AVX2-only host reports its peak too.
 *
 *     cc -O2 benchmarks/probes/peak.c -o /tmp/peak && /tmp/peak
 *
 * No -m flag is needed: each FMA loop is compiled for its own instruction set
 * (__attribute__((target))) and runs only where __builtin_cpu_supports says the CPU has it. It
 * prints one line per loop, the 512-bit one first where it runs (benchmarks/common.py and
 * gdn_bench.py read the first line's GFLOP/s), each naming its ISA.
 *
 * Clock: a chain of dependent integer adds, one per cycle on any x86-64 core.
 * FMA: independent chains of FMAs, more than latency x throughput on current cores, so the loop
 * is bound by how many the core issues per cycle: 24 chains of zmm (of the 32 registers), 12 of
 * ymm (of the 16: AVX2 has no more, and spilling a chain would time the loads). Distinct start
 * values keep the compiler from merging the chains. Timings are the best of 5 runs.
 */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

#define CHAINS_512 24
#define CHAINS_256 12

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static double clock_hz(void) {
    const long n = 1000000000L;
    long x = 0, left = n;
    const double t0 = now();
    __asm__ volatile("1: add $1, %0\n\t"
                     "add $1, %0\n\t"
                     "add $1, %0\n\t"
                     "add $1, %0\n\t"
                     "sub $4, %1\n\t"
                     "jnz 1b"
                     : "+r"(x), "+r"(left));
    return (double) x / (now() - t0);
}

// vector FMAs per second, 512-bit
__attribute__((target("avx512f"))) static double fma512_per_second(float * sink) {
    const long n = 50000000L;
    const __m512 m = _mm512_set1_ps(0.9999999f), c = _mm512_set1_ps(1e-7f);
    __m512 acc[CHAINS_512];
    for (int i = 0; i < CHAINS_512; ++i) acc[i] = _mm512_set1_ps(1.0f + 0.001f * i);
    const double t0 = now();
    for (long it = 0; it < n; ++it) {
#pragma GCC unroll 24
        for (int i = 0; i < CHAINS_512; ++i) acc[i] = _mm512_fmadd_ps(acc[i], m, c);
    }
    const double dt = now() - t0;
    __m512 s = acc[0];
    for (int i = 1; i < CHAINS_512; ++i) s = _mm512_add_ps(s, acc[i]);
    *sink += _mm512_reduce_add_ps(s);
    return (double) n * CHAINS_512 / dt;
}

// vector FMAs per second, 256-bit
__attribute__((target("avx2,fma"))) static double fma256_per_second(float * sink) {
    const long n = 100000000L;
    const __m256 m = _mm256_set1_ps(0.9999999f), c = _mm256_set1_ps(1e-7f);
    __m256 acc[CHAINS_256];
    for (int i = 0; i < CHAINS_256; ++i) acc[i] = _mm256_set1_ps(1.0f + 0.001f * i);
    const double t0 = now();
    for (long it = 0; it < n; ++it) {
#pragma GCC unroll 12
        for (int i = 0; i < CHAINS_256; ++i) acc[i] = _mm256_fmadd_ps(acc[i], m, c);
    }
    const double dt = now() - t0;
    __m256 s = acc[0];
    for (int i = 1; i < CHAINS_256; ++i) s = _mm256_add_ps(s, acc[i]);
    float lanes[8];
    _mm256_storeu_ps(lanes, s);
    for (int i = 0; i < 8; ++i) *sink += lanes[i];
    return (double) n * CHAINS_256 / dt;
}

static void report(const char * what, int lanes, double hz, double fps, float sink) {
    printf("clock %.2f GHz; %s %.2f per cycle = %.1f GFLOP/s float32 (%d lanes x 2 FLOP) [checksum %g]\n",
           hz * 1e-9, what, fps / hz, fps * lanes * 2e-9, lanes, sink);
}

int main(void) {
    __builtin_cpu_init();
    const int has512 = __builtin_cpu_supports("avx512f");
    const int has256 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (!has256 && !has512) {
        fprintf(stderr, "peak: this CPU has neither AVX-512F nor AVX2+FMA; nothing to measure\n");
        return 1;
    }
    double hz = 0, f512 = 0, f256 = 0;
    float sink = 0;
    for (int r = 0; r < 5; ++r) {
        const double h = clock_hz();
        hz = h > hz ? h : hz;
        if (has512) {
            const double f = fma512_per_second(&sink);
            f512 = f > f512 ? f : f512;
        }
        if (has256) {
            const double f = fma256_per_second(&sink);
            f256 = f > f256 ? f : f256;
        }
    }
    if (has512) report("512-bit FMA (AVX-512F)", 16, hz, f512, sink);
    if (has256) report("256-bit FMA (AVX2+FMA)", 8, hz, f256, sink);
    return 0;
}
