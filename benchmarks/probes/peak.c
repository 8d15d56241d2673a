/*
 * peak.c -- this core's clock and its AVX-512 FMA throughput, the yardsticks of the
 * "fraction of FMA peak" figures in benchmarks/README.md.
 *
 *     cc -O2 -mavx512f benchmarks/probes/peak.c -o /tmp/peak && /tmp/peak
 *
 * Clock: a chain of dependent integer adds, one per cycle on any x86-64 core.
 * FMA: 24 independent chains of 512-bit FMAs (more than latency x throughput on current
 * cores), so the loop is bound by how many the core issues per cycle. Distinct start values
 * keep the compiler from merging the chains, which stay in registers (24 of the 32). Timings
 * are the best of 5 runs.
 */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

#define CHAINS 24

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

static double fma_per_second(float * sink) {
    const long n = 50000000L;
    const __m512 m = _mm512_set1_ps(0.9999999f), c = _mm512_set1_ps(1e-7f);
    __m512 acc[CHAINS];
    for (int i = 0; i < CHAINS; ++i) acc[i] = _mm512_set1_ps(1.0f + 0.001f * i);
    const double t0 = now();
    for (long it = 0; it < n; ++it) {
#pragma GCC unroll 24
        for (int i = 0; i < CHAINS; ++i) acc[i] = _mm512_fmadd_ps(acc[i], m, c);
    }
    const double dt = now() - t0;
    __m512 s = acc[0];
    for (int i = 1; i < CHAINS; ++i) s = _mm512_add_ps(s, acc[i]);
    *sink += _mm512_reduce_add_ps(s);
    return (double) n * CHAINS / dt;
}

int main(void) {
    double hz = 0, fps = 0;
    float sink = 0;
    for (int r = 0; r < 5; ++r) {
        const double h = clock_hz(), f = fma_per_second(&sink);
        hz = h > hz ? h : hz;
        fps = f > fps ? f : fps;
    }
    printf("clock %.2f GHz; 512-bit FMA %.2f per cycle = %.1f GFLOP/s float32 (16 lanes x 2 FLOP)"
           " [checksum %g]\n", hz * 1e-9, fps / hz, fps * 32e-9, sink);
    return 0;
}
