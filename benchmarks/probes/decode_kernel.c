/*
 * decode_kernel.c -- kernel-only cost of one decode token, no Python: the exact code the extension
 * runs (linked against the built _ssmgrad*.so, whose kernel symbols are exported), timed in the
 * calling thread's CPU time (CLOCK_THREAD_CPUTIME_ID) against a memcpy of the state's bytes.
 * Built and run by benchmarks/probes/decode_overhead.py (--kernel); by hand:
 *
 *   cc -O2 -std=gnu11 -I csrc benchmarks/probes/decode_kernel.c ./_ssmgrad*.so \
 *      -L$(python -c 'import sysconfig;print(sysconfig.get_config_var("LIBDIR"))') -lpython3.11 \
 *      -Wl,-rpath,<that LIBDIR> -o /tmp/decode_kernel && /tmp/decode_kernel [rounds]
 *
 * Per layer (Mamba-2-130m: s 24x64x128, A (24,1); Mamba-1-130m: 1536 x 1 x 16, A (1536,16); one
 * sequence, one token, float32) it prints, in ns per call, the median and fastest of `rounds`
 * batches: memcpy of the state's bytes to another buffer, the in-place update
 * (ssm_scan_decode_into_f32 with st = s, the kernel of ssmgrad.ssm_scan_update) and ssm_scan_f32
 * (the decode path into a packed out). The three are timed in alternating batches (the same
 * cache state). The inputs are checked first: the in-place kernel and ssm_scan_f32 give the same
 * bits (same arithmetic, two entry points).
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ssmgrad.h"

void ssm_scan_decode_into_f32(const ssm_scan_params * p, const float * s, const float * x, const float * dt,
                              const float * A, const float * B, const float * C, const int64_t * ids, float * y,
                              float * st, int ith, int nth);

static double now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return ts.tv_sec * 1e9 + ts.tv_nsec;
}

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static float urand(void) {   /* [-1, 1) */
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (float) ((rng >> 11) * (1.0 / 9007199254740992.0) * 2 - 1);
}

static int cmp(const void * a, const void * b) {
    const double x = *(const double *) a, y = *(const double *) b;
    return x < y ? -1 : x > y;
}

static void dense(int64_t * st, const int64_t * dims, int nd) {
    int64_t acc = 1;
    for (int i = nd - 1; i >= 0; --i) {
        st[i] = acc;
        acc *= dims[i];
    }
}

static void run(const char * name, int64_t n_head, int64_t hd, int64_t ds, int mamba2, int rounds) {
    ssm_scan_params p = { 0 };
    p.n_rs = p.n_seqs = 1;
    p.n_head = n_head;
    p.head_dim = hd;
    p.d_state = ds;
    p.n_group = 1;
    p.n_t = 1;
    p.K = 1;
    p.a_per_state = !mamba2;
    const int64_t sd[4] = { 1, n_head, hd, ds }, xd[4] = { 1, 1, n_head, hd }, dd[3] = { 1, 1, n_head };
    const int64_t ad[2] = { n_head, mamba2 ? 1 : ds }, bd[4] = { 1, 1, 1, ds };
    dense(p.s_st, sd, 4);
    dense(p.x_st, xd, 4);
    dense(p.dt_st, dd, 3);
    dense(p.A_st, ad, 2);
    dense(p.B_st, bd, 4);
    dense(p.C_st, bd, 4);
    const size_t ns = (size_t) (n_head * hd * ds), nx = (size_t) (n_head * hd), na = (size_t) (n_head * ad[1]);
    float * s = aligned_alloc(64, ns * 4), * s2 = aligned_alloc(64, ns * 4), * cp = aligned_alloc(64, ns * 4);
    float * x = malloc(nx * 4), * dt = malloc(n_head * 4), * A = malloc(na * 4), * B = malloc(ds * 4),
          * C = malloc(ds * 4), * y = malloc(nx * 4), * out = aligned_alloc(64, (nx + ns) * 4 + 64);
    for (size_t i = 0; i < ns; ++i) s[i] = urand();
    for (size_t i = 0; i < nx; ++i) x[i] = urand();
    for (int64_t i = 0; i < n_head; ++i) dt[i] = urand() - 1;
    for (size_t i = 0; i < na; ++i) A[i] = -(float) (1 + (i % 16)) * (0.5f + 0.5f * (urand() + 1));
    for (int64_t i = 0; i < ds; ++i) {
        B[i] = urand();
        C[i] = urand();
    }
    const int64_t ids[1] = { 0 };
    if (ssm_scan_work_size(&p, 4, 1) != 0) {
        printf("%s: not the decode path\n", name);
        exit(1);
    }
    /* check: in place == ssm_scan_f32's decode path, bitwise */
    memcpy(s2, s, ns * 4);
    ssm_scan_f32(&p, s, x, dt, A, B, C, ids, out, NULL, 0, 1);
    ssm_scan_decode_into_f32(&p, s2, x, dt, A, B, C, ids, y, s2, 0, 1);
    if (memcmp(out, y, nx * 4) || memcmp(out + nx, s2, ns * 4)) {
        printf("%s: in-place and ssm_scan_f32 differ\n", name);
        exit(1);
    }
    const int inner = mamba2 ? 50 : 200;
    double * t[3];
    for (int k = 0; k < 3; ++k) t[k] = malloc(rounds * sizeof(double));
    for (int r = 0; r < rounds; ++r) {
        double t0 = now_ns();
        for (int i = 0; i < inner; ++i) {
            memcpy(cp, s2, ns * 4);
            __asm__ volatile("" ::: "memory");
        }
        double t1 = now_ns();
        for (int i = 0; i < inner; ++i) ssm_scan_decode_into_f32(&p, s2, x, dt, A, B, C, ids, y, s2, 0, 1);
        double t2 = now_ns();
        for (int i = 0; i < inner; ++i) ssm_scan_f32(&p, s2, x, dt, A, B, C, ids, out, NULL, 0, 1);
        double t3 = now_ns();
        t[0][r] = (t1 - t0) / inner;
        t[1][r] = (t2 - t1) / inner;
        t[2][r] = (t3 - t2) / inner;
    }
    static const char * what[3] = { "memcpy_state", "kernel_update_in_place", "kernel_ssm_scan_f32" };
    for (int k = 0; k < 3; ++k) {
        qsort(t[k], rounds, sizeof(double), cmp);
        printf("%s %s median_ns %.0f min_ns %.0f\n", name, what[k], t[k][rounds / 2], t[k][0]);
    }
    for (int k = 0; k < 3; ++k) free(t[k]);
    free(s), free(s2), free(cp), free(x), free(dt), free(A), free(B), free(C), free(y), free(out);
}

int main(int argc, char ** argv) {
    const int rounds = argc > 1 ? atoi(argv[1]) : 200;
    run("mamba2_130m", 24, 64, 128, 1, rounds);
    run("mamba1_130m", 1536, 1, 16, 0, rounds);
    return 0;
}
