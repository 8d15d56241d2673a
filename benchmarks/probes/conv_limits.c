/*
 * conv_limits.c -- what the conv's access patterns can reach on one core, beside a copy.
 *
 * The conv at Mamba-2-130m's width (1792 channels, n_t 8192, float32) moves a channel-major
 * array (n_t + 3 tokens per channel row) to a token-major one (1792 channels per token row) or
 * back. This times, on 58.7 MB arrays, medians of 7 runs (64 MB read in between):
 *   - a copy with plain stores, with streaming stores, glibc's memcpy, a read-only sum (GB/s of
 *     the bytes read: the read-only d_c's bound);
 *   - plain 16 x 16 AVX-512 tile transposes channel-major -> token-major ("c->t", the forward's
 *     pattern) and back ("t->c", the d_sx pattern), walking windows of TW tokens and CI channels,
 *     with plain or (c->t only: the token rows are 64-byte aligned) streaming stores.
 * GB/s = (bytes read + bytes written) / time, as benchmarks/conv_bw.py counts them.
 *
 *     gcc -O2 -mavx512f -mavx512dq -mavx512bw -mavx512vl -mfma benchmarks/probes/conv_limits.c -o /tmp/conv_limits && /tmp/conv_limits
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/mman.h>

#define D 1792
#define T 8192
#define NC (T + 3)
#define REPS 7

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}
static float * alloc(size_t n) {
    void * p = NULL;
    if (posix_memalign(&p, 2 << 20, n * 4 + (2 << 20))) exit(1);
    madvise(p, n * 4, MADV_HUGEPAGE);    /* as numpy does for large arrays */
    memset(p, 1, n * 4);
    return p;
}
static void copy_plain(const float * s, float * d, size_t n) {
    for (size_t i = 0; i < n; i += 16) _mm512_storeu_ps(d + i, _mm512_loadu_ps(s + i));
}
static void copy_nt(const float * s, float * d, size_t n) {
    for (size_t i = 0; i < n; i += 16) _mm512_stream_ps(d + i, _mm512_load_ps(s + i));
    _mm_sfence();
}
static float readsum(const float * s, size_t n) {
    __m512 a = _mm512_setzero_ps(), b = a;
    for (size_t i = 0; i < n; i += 32) {
        a = _mm512_add_ps(a, _mm512_load_ps(s + i));
        b = _mm512_add_ps(b, _mm512_load_ps(s + i + 16));
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(a, b));
}
static inline void tr16(__m512 * r) {
    __m512 t[16];
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {
        __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 2]);
        __m512d c = _mm512_castps_pd(t[4 * i + 1]), d = _mm512_castps_pd(t[4 * i + 3]);
        r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
        r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
        r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
        r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
    }
    for (int j = 0; j < 4; ++j) {
        t[j] = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x88);
        t[4 + j] = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xdd);
        t[8 + j] = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x88);
        t[12 + j] = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xdd);
    }
    for (int j = 0; j < 4; ++j) {
        r[j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88);
        r[8 + j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0xdd);
        r[4 + j] = _mm512_shuffle_f32x4(t[4 + j], t[12 + j], 0x88);
        r[12 + j] = _mm512_shuffle_f32x4(t[4 + j], t[12 + j], 0xdd);
    }
}
/* channel-major s (D x NC) -> token-major d (T x D) */
static void c2t(const float * s, float * d, int TW, int CI, int nt) {
    for (int t0 = 0; t0 < T; t0 += TW)
        for (int i0 = 0; i0 < D; i0 += CI)
            for (int ib = i0; ib < i0 + CI; ib += 16)
                for (int tb = t0; tb < t0 + TW; tb += 16) {
                    __m512 r[16];
                    for (int ii = 0; ii < 16; ++ii) r[ii] = _mm512_loadu_ps(s + (size_t) (ib + ii) * NC + tb);
                    tr16(r);
                    for (int j = 0; j < 16; ++j)
                        if (nt) _mm512_stream_ps(d + (size_t) (tb + j) * D + ib, r[j]);
                        else _mm512_store_ps(d + (size_t) (tb + j) * D + ib, r[j]);
                }
    if (nt) _mm_sfence();
}
/* token-major s (T x D) -> channel-major d (D x NC) */
static void t2c(const float * s, float * d, int TW, int CI) {
    for (int t0 = 0; t0 < T; t0 += TW)
        for (int i0 = 0; i0 < D; i0 += CI)
            for (int ib = i0; ib < i0 + CI; ib += 16)
                for (int tb = t0; tb < t0 + TW; tb += 16) {
                    __m512 r[16];
                    for (int j = 0; j < 16; ++j) r[j] = _mm512_load_ps(s + (size_t) (tb + j) * D + ib);
                    tr16(r);
                    for (int ii = 0; ii < 16; ++ii) _mm512_storeu_ps(d + (size_t) (ib + ii) * NC + tb, r[ii]);
                }
}
static int cmpd(const void * a, const void * b) {
    double x = *(const double *) a, y = *(const double *) b;
    return (x > y) - (x < y);
}

int main(void) {
    const size_t n = (size_t) D * NC;
    float * a = alloc(n + 64), * b = alloc(n + 64), * ev = alloc(16 << 20);
    const double bytes = 2.0 * 4 * n;
    volatile float sink = 0;
    const char * names[] = { "copy, plain stores", "copy, streaming stores", "memcpy (glibc)", "read only (bytes read)",
                             "c->t TW256 CI16 plain", "c->t TW256 CI16 streaming", "c->t TW256 CI64 plain",
                             "c->t TW256 CI64 streaming", "t->c TW256 CI16 plain", "t->c TW256 CI64 plain" };
    const int NV = (int) (sizeof names / sizeof names[0]);
    double tm[16][REPS];
    for (int rep = 0; rep < REPS; ++rep)
        for (int v = 0; v < NV; ++v) {
            sink += readsum(ev, 16 << 20);
            double t = now();
            switch (v) {
            case 0: copy_plain(a, b, n); break;
            case 1: copy_nt(a, b, n); break;
            case 2: memcpy(b, a, n * 4); break;
            case 3: sink += readsum(a, n); break;
            case 4: c2t(a, b, 256, 16, 0); break;
            case 5: c2t(a, b, 256, 16, 1); break;
            case 6: c2t(a, b, 256, 64, 0); break;
            case 7: c2t(a, b, 256, 64, 1); break;
            case 8: t2c(a, b, 256, 16); break;
            case 9: t2c(a, b, 256, 64); break;
            }
            tm[v][rep] = now() - t;
        }
    for (int v = 0; v < NV; ++v) {
        qsort(tm[v], REPS, sizeof(double), cmpd);
        const double by = v == 3 ? bytes / 2 : bytes;
        printf("%-28s %6.2f GB/s (median of %d; fastest %6.2f)\n", names[v], by / tm[v][REPS / 2] / 1e9, REPS,
               by / tm[v][0] / 1e9);
    }
    return sink == 12345.0f;
}
