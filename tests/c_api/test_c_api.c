/*
 * test_c_api.c -- the ssmgrad kernels called from C through csrc/ssmgrad.h alone.
 *
 * Built and run by tests/kernels/test_c_api.py:
 *     cc -O1 -std=c11 -I csrc tests/c_api/test_c_api.c csrc/<kernel files>.c -lm
 *
 * On tiny cases (llama.cpp-like strided views, duplicate ids, spare state rows, n_group > 1,
 * K > 1 and K > n_t, both scan branches, float64 and float32):
 *   forward  vs a naive loop written here from the op contract (spec sections 2, 3 and 6),
 *   backward vs central finite differences of L = sum(out * grad) through that naive loop,
 *   and every result bitwise identical for nth = 1 and nth = 3, with the three calls made one
 *   after another and (C11 threads) concurrently, phase 1 of the scan backward finishing on
 *   every thread before phase 2 starts, as the header asks.
 * Prints the SIMD pass the kernels run ("simd selected: ..."), then one
 * "max_err <name> <value> tol <tol>" line per check, exits 1 if any check fails.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef __STDC_NO_THREADS__
#include <threads.h>
#endif

#include "ssmgrad.h"

static int n_failed = 0;

/* the SIMD pass every call asks for (params.simd): from the command line, --simd=NAME with the
 * names of SSMGRAD_SIMD (tests/kernels/test_c_api.py runs the program once per pass) */
static int64_t simd = SSM_SIMD_AUTO;

/* --no-fd: no finite differences. They call the naive reference twice per input, O(inputs x
 * outputs), no kernel: most of the program's time, and all but a little of it under valgrind
 * (.ci/sanitize.sh runs memcheck with --no-fd; every kernel call and every other check stays) */
static int with_fd = 1;

static void report(const char * name, double err, double tol) {
    int ok = err <= tol;            /* NaN fails */
    printf("max_err %-28s %.3e tol %.0e %s\n", name, err, tol, ok ? "ok" : "FAIL");
    if (!ok) ++n_failed;
}

static void report_same(const char * name, const void * a, const void * b, size_t bytes) {
    int ok = memcmp(a, b, bytes) == 0;
    printf("bitwise %-29s %s\n", name, ok ? "ok" : "FAIL");
    if (!ok) ++n_failed;
}

/* deterministic uniform numbers in [-1, 1) */
static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static double urand(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (double) (rng_state >> 11) / 9007199254740992.0 * 2.0 - 1.0;
}

static void fill(double * a, int64_t n, double scale) {
    for (int64_t i = 0; i < n; ++i) a[i] = urand() * scale;
}

static double max_abs_diff(const double * a, const double * b, int64_t n) {
    double m = 0;
    for (int64_t i = 0; i < n; ++i) {
        double d = fabs(a[i] - b[i]);
        if (!(d <= m)) m = d;       /* keeps NaN */
    }
    return m;
}

static double max_abs_diff_f32(const float * a, const double * b, int64_t n) {
    double m = 0;
    for (int64_t i = 0; i < n; ++i) {
        double d = fabs((double) a[i] - b[i]);
        if (!(d <= m)) m = d;
    }
    return m;
}

static double dot(const double * a, const double * b, int64_t n) {
    double s = 0;
    for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
    return s;
}

static void * xalloc(size_t bytes) {
    void * p = calloc(1, bytes ? bytes : 1);
    if (!p) { fprintf(stderr, "out of memory\n"); exit(2); }
    return p;
}

/* scratch buffer aligned to SSM_WORK_ALIGN (aligned_alloc wants a multiple of the alignment) */
static void * work_alloc(size_t bytes) {
    size_t n = (bytes + SSM_WORK_ALIGN - 1) / SSM_WORK_ALIGN * SSM_WORK_ALIGN;
    void * p = aligned_alloc(SSM_WORK_ALIGN, n ? n : SSM_WORK_ALIGN);
    if (!p) { fprintf(stderr, "out of memory\n"); exit(2); }
    memset(p, 0, n ? n : SSM_WORK_ALIGN);
    return p;
}

static float * to_f32(const double * a, int64_t n) {
    float * r = xalloc((size_t) n * sizeof(float));
    for (int64_t i = 0; i < n; ++i) r[i] = (float) a[i];
    return r;
}

/* ==================================================================== SSM_CONV
 * sx is stored as llama.cpp builds it: a (n_s, d_conv-1+n_t, d_inner) token matrix, read
 * through transposed strides as (n_s, d_inner, d_conv-1+n_t). grad is dense (n_s, n_t, d_inner).
 */
typedef struct { int64_t n_s, d_inner, d_conv, n_t; } conv_dims;

/* naive forward on the token-matrix storage tok[s][j][i] */
static void naive_conv(const conv_dims * d, const double * tok, const double * c, double * y) {
    const int64_t n_cols = d->d_conv - 1 + d->n_t;
    for (int64_t s = 0; s < d->n_s; ++s)
        for (int64_t t = 0; t < d->n_t; ++t)
            for (int64_t i = 0; i < d->d_inner; ++i) {
                double acc = 0;
                for (int64_t k = 0; k < d->d_conv; ++k)
                    acc += tok[(s * n_cols + t + k) * d->d_inner + i] * c[i * d->d_conv + k];
                y[(s * d->n_t + t) * d->d_inner + i] = acc;
            }
}

static void test_conv(void) {
    const conv_dims d = { 2, 5, 4, 6 };
    const int64_t n_cols = d.d_conv - 1 + d.n_t;
    const int64_t n_sx = d.n_s * n_cols * d.d_inner, n_c = d.d_inner * d.d_conv;
    const int64_t n_y = d.n_s * d.n_t * d.d_inner;

    double * tok = xalloc(n_sx * sizeof(double)), * c = xalloc(n_c * sizeof(double));
    double * g = xalloc(n_y * sizeof(double)), * y_ref = xalloc(n_y * sizeof(double));
    fill(tok, n_sx, 1.0); fill(c, n_c, 1.0); fill(g, n_y, 1.0);
    naive_conv(&d, tok, c, y_ref);

    ssm_conv_params p = { .n_s = d.n_s, .d_inner = d.d_inner, .d_conv = d.d_conv, .n_t = d.n_t,
                          .sx_st = { n_cols * d.d_inner, 1, d.d_inner },     /* transposed view */
                          .c_st = { d.d_conv, 1 },
                          .g_st = { d.n_t * d.d_inner, d.d_inner, 1 },
                          .simd = simd };

    /* forward, float64, nth = 1 and 3 */
    double * y1 = xalloc(n_y * sizeof(double)), * y3 = xalloc(n_y * sizeof(double));
    void * w64 = work_alloc(ssm_conv_work_size(&p, sizeof(double), 3));   /* for nth 1 and 3 */
    ssm_conv_f64(&p, tok, c, y1, w64, 0, 1);
    for (int ith = 0; ith < 3; ++ith) ssm_conv_f64(&p, tok, c, y3, w64, ith, 3);
    report("conv_f64_forward", max_abs_diff(y1, y_ref, n_y), 1e-13);
    report_same("conv_f64_forward_nth1_vs_3", y1, y3, n_y * sizeof(double));

    /* backward: finite differences of L = sum(y * g) */
    double * dsx_fd = xalloc(n_sx * sizeof(double)), * dc_fd = xalloc(n_c * sizeof(double));
    double * yt = xalloc(n_y * sizeof(double));
    const double eps = 1e-6;
    for (int64_t j = 0; j < n_sx * with_fd; ++j) {
        double old = tok[j];
        tok[j] = old + eps; naive_conv(&d, tok, c, yt); double lp = dot(yt, g, n_y);
        tok[j] = old - eps; naive_conv(&d, tok, c, yt); double lm = dot(yt, g, n_y);
        tok[j] = old;
        dsx_fd[j] = (lp - lm) / (2 * eps);
    }
    for (int64_t j = 0; j < n_c * with_fd; ++j) {
        double old = c[j];
        c[j] = old + eps; naive_conv(&d, tok, c, yt); double lp = dot(yt, g, n_y);
        c[j] = old - eps; naive_conv(&d, tok, c, yt); double lm = dot(yt, g, n_y);
        c[j] = old;
        dc_fd[j] = (lp - lm) / (2 * eps);
    }
    /* d_sx is dense (n_s, d_inner, n_cols): bring the fd result (token-matrix order) to it */
    double * dsx_fd_t = xalloc(n_sx * sizeof(double));
    for (int64_t s = 0; s < d.n_s; ++s)
        for (int64_t i = 0; i < d.d_inner; ++i)
            for (int64_t j = 0; j < n_cols; ++j)
                dsx_fd_t[(s * d.d_inner + i) * n_cols + j] = dsx_fd[(s * n_cols + j) * d.d_inner + i];

    double * dsx1 = xalloc(n_sx * sizeof(double)), * dsx3 = xalloc(n_sx * sizeof(double));
    double * dc1 = xalloc(n_c * sizeof(double)), * dc3 = xalloc(n_c * sizeof(double));
    ssm_conv_back_f64(&p, c, g, dsx1, w64, 0, 1);
    ssm_conv_back_weight_f64(&p, tok, g, dc1, w64, 0, 1);
    for (int ith = 0; ith < 3; ++ith) {
        ssm_conv_back_f64(&p, c, g, dsx3, w64, ith, 3);
        ssm_conv_back_weight_f64(&p, tok, g, dc3, w64, ith, 3);
    }
    if (with_fd) {
        report("conv_f64_d_sx_vs_fd", max_abs_diff(dsx1, dsx_fd_t, n_sx), 1e-7);
        report("conv_f64_d_c_vs_fd", max_abs_diff(dc1, dc_fd, n_c), 1e-7);
    }
    report_same("conv_f64_d_sx_nth1_vs_3", dsx1, dsx3, n_sx * sizeof(double));
    report_same("conv_f64_d_c_nth1_vs_3", dc1, dc3, n_c * sizeof(double));

    /* float32: same kernels, same checks at float32 accuracy */
    float * tok32 = to_f32(tok, n_sx), * c32 = to_f32(c, n_c), * g32 = to_f32(g, n_y);
    float * y32 = xalloc(n_y * sizeof(float)), * dsx32 = xalloc(n_sx * sizeof(float));
    float * dc32 = xalloc(n_c * sizeof(float));
    void * w32 = work_alloc(ssm_conv_work_size(&p, sizeof(float), 2));
    for (int ith = 0; ith < 2; ++ith) {
        ssm_conv_f32(&p, tok32, c32, y32, w32, ith, 2);
        ssm_conv_back_f32(&p, c32, g32, dsx32, w32, ith, 2);
        ssm_conv_back_weight_f32(&p, tok32, g32, dc32, w32, ith, 2);
    }
    free(w64);
    free(w32);
    report("conv_f32_forward", max_abs_diff_f32(y32, y_ref, n_y), 1e-5);
    if (with_fd) {
        report("conv_f32_d_sx_vs_fd", max_abs_diff_f32(dsx32, dsx_fd_t, n_sx), 1e-5);
        report("conv_f32_d_c_vs_fd", max_abs_diff_f32(dc32, dc_fd, n_c), 1e-5);
    }

    free(tok); free(c); free(g); free(y_ref); free(y1); free(y3); free(dsx_fd); free(dc_fd);
    free(yt); free(dsx_fd_t); free(dsx1); free(dsx3); free(dc1); free(dc3);
    free(tok32); free(c32); free(g32); free(y32); free(dsx32); free(dc32);
}

/* ==================================================================== SSM_SCAN
 * x, B, C are views into one xBC buffer (n_seqs, n_t, d_inner + 2*n_group*d_state) as in
 * llama.cpp's Mamba-2; s, dt, A are dense. The naive loop reads dense copies.
 */
typedef struct {
    int64_t n_rs, n_head, head_dim, d_state, n_group, n_t, n_seqs, K, a_per_state;
    const int64_t * ids;
    int64_t fwd_form, back_form;          /* SSM_FORM_*: 0 (auto) unless a case forces one */
} scan_dims;

/* the dense inputs of the naive loop, one after another in one array (the order of gin + A) */
typedef struct { int64_t s, x, dt, B, C, A, total; } scan_offsets;

static scan_offsets scan_layout(const scan_dims * d) {
    scan_offsets o;
    o.s = 0;
    o.x = o.s + d->n_rs * d->n_head * d->head_dim * d->d_state;
    o.dt = o.x + d->n_seqs * d->n_t * d->n_head * d->head_dim;
    o.B = o.dt + d->n_seqs * d->n_t * d->n_head;
    o.C = o.B + d->n_seqs * d->n_t * d->n_group * d->d_state;
    o.A = o.C + d->n_seqs * d->n_t * d->n_group * d->d_state;
    o.total = o.A + d->n_head * (d->a_per_state ? d->d_state : 1);
    return o;
}

static int64_t scan_out_size(const scan_dims * d) {
    return d->n_seqs * d->n_t * d->n_head * d->head_dim
         + d->K * d->n_seqs * d->n_head * d->head_dim * d->d_state;
}

static double softplus(double v) { return v <= 20.0 ? log1p(exp(v)) : v; }

/* spec section 3 and 6, written as plainly as possible */
static void naive_scan(const scan_dims * d, const double * in, double * out) {
    const scan_offsets o = scan_layout(d);
    const int64_t H = d->n_head, P = d->head_dim, N = d->d_state, G = d->n_group, T = d->n_t;
    const int64_t n_y = d->n_seqs * T * H * P, state = H * P * N;
    double * h = xalloc(state * sizeof(double));
    memset(out, 0, scan_out_size(d) * sizeof(double));
    for (int64_t q = 0; q < d->n_seqs; ++q) {
        memcpy(h, in + o.s + d->ids[q] * state, state * sizeof(double));
        if (T == 0) memcpy(out + n_y + q * state, h, state * sizeof(double));
        for (int64_t t = 0; t < T; ++t) {
            for (int64_t hh = 0; hh < H; ++hh) {
                const int64_t g = hh / (H / G);
                const double sp = softplus(in[o.dt + (q * T + t) * H + hh]);
                for (int64_t p = 0; p < P; ++p) {
                    const double xv = in[o.x + ((q * T + t) * H + hh) * P + p];
                    double yv = 0;
                    for (int64_t n = 0; n < N; ++n) {
                        const double a = exp(sp * in[o.A + hh * (d->a_per_state ? N : 1) + (d->a_per_state ? n : 0)]);
                        const double bv = in[o.B + ((q * T + t) * G + g) * N + n];
                        const double cv = in[o.C + ((q * T + t) * G + g) * N + n];
                        double * hv = h + (hh * P + p) * N + n;
                        *hv = *hv * a + bv * (xv * sp);
                        yv += *hv * cv;
                    }
                    out[((q * T + t) * H + hh) * P + p] = yv;
                }
            }
            const int64_t k = T - (t + 1);        /* h is the state after t+1 tokens */
            if (k < d->K) memcpy(out + n_y + (k * d->n_seqs + q) * state, h, state * sizeof(double));
        }
    }
    free(h);
}

/* Kernel inputs in the layouts above; REAL = double or float */
typedef struct {
    ssm_scan_params p;
    int64_t n_xbc;            /* elements of the xBC buffer */
    int64_t x_off, B_off, C_off;
} scan_setup;

static scan_setup make_setup(const scan_dims * d) {
    scan_setup su;
    memset(&su, 0, sizeof su);
    const int64_t H = d->n_head, P = d->head_dim, N = d->d_state, G = d->n_group, T = d->n_t;
    const int64_t d_inner = H * P, row = d_inner + 2 * G * N;
    su.n_xbc = d->n_seqs * T * row;
    su.x_off = 0; su.B_off = d_inner; su.C_off = d_inner + G * N;
    ssm_scan_params p = {
        .n_rs = d->n_rs, .n_head = H, .head_dim = P, .d_state = N, .n_group = G, .n_t = T,
        .n_seqs = d->n_seqs, .a_per_state = d->a_per_state, .K = d->K,
        .s_st = { H * P * N, P * N, N, 1 },
        .x_st = { T * row, row, P, 1 },
        .dt_st = { T * H, H, 1 },
        .A_st = { d->a_per_state ? N : 1, d->a_per_state ? 1 : 0 },
        .B_st = { T * row, row, N, 1 },
        .C_st = { T * row, row, N, 1 },
        .fwd_form = d->fwd_form, .back_form = d->back_form, .simd = simd,
    };
    su.p = p;
    return su;
}

/* dense naive inputs -> the xBC buffer the kernel reads x, B, C from */
static void pack_xbc(const scan_dims * d, const scan_setup * su, const double * in, double * xbc) {
    const scan_offsets o = scan_layout(d);
    const int64_t H = d->n_head, P = d->head_dim, N = d->d_state, G = d->n_group, T = d->n_t;
    const int64_t row = H * P + 2 * G * N;
    for (int64_t qt = 0; qt < d->n_seqs * T; ++qt) {
        for (int64_t j = 0; j < H * P; ++j) xbc[qt * row + su->x_off + j] = in[o.x + qt * H * P + j];
        for (int64_t j = 0; j < G * N; ++j) {
            xbc[qt * row + su->B_off + j] = in[o.B + qt * G * N + j];
            xbc[qt * row + su->C_off + j] = in[o.C + qt * G * N + j];
        }
    }
}

/* One kernel call per thread: the (ith, nth) calls of one phase run concurrently, and joining
 * them all is the barrier between phases. Without C11 threads they run one after another. */
typedef struct {
    int phase;                            /* 0 forward, 1 backward, 2 backward reduce */
    const scan_dims * d;
    const scan_setup * su;
    const double * in, * xbc, * grad;
    double * out, * gin, * dA;
    void * work;
    int ith, nth;
} scan_job;

static int scan_job_run(void * arg) {
    const scan_job * j = arg;
    const scan_offsets o = scan_layout(j->d);
    const ssm_scan_params * p = &j->su->p;
    const double * xb = j->xbc;
    if (j->phase == 0)
        ssm_scan_f64(p, j->in + o.s, xb + j->su->x_off, j->in + o.dt, j->in + o.A, xb + j->su->B_off,
                     xb + j->su->C_off, j->d->ids, j->out, j->work, j->ith, j->nth);
    else if (j->phase == 1)
        ssm_scan_back_f64(p, j->in + o.s, xb + j->su->x_off, j->in + o.dt, j->in + o.A, xb + j->su->B_off,
                          xb + j->su->C_off, j->d->ids, j->grad, j->gin, j->work, j->ith, j->nth);
    else
        ssm_scan_back_reduce_f64(p, j->d->ids, j->gin, j->dA, j->work, j->ith, j->nth);
    return 0;
}

#define MAX_THREADS 8

static void run_phase(scan_job proto, int phase, void * work) {
    scan_job jobs[MAX_THREADS];
    for (int ith = 0; ith < proto.nth; ++ith) {
        jobs[ith] = proto;
        jobs[ith].phase = phase;
        jobs[ith].work = work;
        jobs[ith].ith = ith;
    }
#ifndef __STDC_NO_THREADS__
    thrd_t tid[MAX_THREADS];
    int started[MAX_THREADS] = { 0 };
    for (int ith = 0; ith < proto.nth; ++ith)
        started[ith] = thrd_create(&tid[ith], scan_job_run, &jobs[ith]) == thrd_success;
    for (int ith = 0; ith < proto.nth; ++ith) {
        if (started[ith]) thrd_join(tid[ith], NULL);
        else scan_job_run(&jobs[ith]);     /* could not start a thread: run it here */
    }
#else
    for (int ith = 0; ith < proto.nth; ++ith) scan_job_run(&jobs[ith]);
#endif
}

static void run_scan_f64_concurrent(const scan_dims * d, const scan_setup * su, const double * in,
                                    const double * xbc, const double * grad, int nth,
                                    double * out, double * gin, double * dA) {
    scan_job proto = { 0, d, su, in, xbc, grad, out, gin, dA, NULL, 0, nth };
    void * work = work_alloc(ssm_scan_work_size(&su->p, sizeof(double), nth));
    run_phase(proto, 0, work);
    free(work);
    void * bwork = work_alloc(ssm_scan_back_work_size(&su->p, sizeof(double), nth));
    run_phase(proto, 1, bwork);
    run_phase(proto, 2, bwork);
    free(bwork);
}

/* forward + backward with nth threads called one after another, float64 */
static void run_scan_f64(const scan_dims * d, const scan_setup * su, const double * in,
                         const double * xbc, const double * grad, int nth,
                         double * out, double * gin, double * dA) {
    const scan_offsets o = scan_layout(d);
    const ssm_scan_params * p = &su->p;
    void * work = work_alloc(ssm_scan_work_size(p, sizeof(double), nth));
    for (int ith = 0; ith < nth; ++ith)
        ssm_scan_f64(p, in + o.s, xbc + su->x_off, in + o.dt, in + o.A, xbc + su->B_off,
                     xbc + su->C_off, d->ids, out, work, ith, nth);
    free(work);
    void * bwork = work_alloc(ssm_scan_back_work_size(p, sizeof(double), nth));
    for (int ith = 0; ith < nth; ++ith)       /* phase 1 for every thread ... */
        ssm_scan_back_f64(p, in + o.s, xbc + su->x_off, in + o.dt, in + o.A, xbc + su->B_off,
                          xbc + su->C_off, d->ids, grad, gin, bwork, ith, nth);
    for (int ith = 0; ith < nth; ++ith)       /* ... then the barrier, then phase 2 */
        ssm_scan_back_reduce_f64(p, d->ids, gin, dA, bwork, ith, nth);
    free(bwork);
}

static void run_scan_f32(const scan_dims * d, const scan_setup * su, const float * in,
                         const float * xbc, const float * grad, int nth,
                         float * out, float * gin, float * dA) {
    const scan_offsets o = scan_layout(d);
    const ssm_scan_params * p = &su->p;
    void * work = work_alloc(ssm_scan_work_size(p, sizeof(float), nth));
    for (int ith = 0; ith < nth; ++ith)
        ssm_scan_f32(p, in + o.s, xbc + su->x_off, in + o.dt, in + o.A, xbc + su->B_off,
                     xbc + su->C_off, d->ids, out, work, ith, nth);
    free(work);
    void * bwork = work_alloc(ssm_scan_back_work_size(p, sizeof(float), nth));
    for (int ith = 0; ith < nth; ++ith)
        ssm_scan_back_f32(p, in + o.s, xbc + su->x_off, in + o.dt, in + o.A, xbc + su->B_off,
                          xbc + su->C_off, d->ids, grad, gin, bwork, ith, nth);
    for (int ith = 0; ith < nth; ++ith)
        ssm_scan_back_reduce_f32(p, d->ids, gin, dA, bwork, ith, nth);
    free(bwork);
}

/* forward keeping the chunk states, backward reading them (ssm_scan_keep_f64, ssm_scan_back_kept_f64), float64;
 * kept: ssm_scan_chunk_states(p) elements */
static void run_scan_kept_f64(const scan_dims * d, const scan_setup * su, const double * in,
                              const double * xbc, const double * grad, int nth,
                              double * out, double * kept, double * gin, double * dA) {
    const scan_offsets o = scan_layout(d);
    const ssm_scan_params * p = &su->p;
    void * work = work_alloc(ssm_scan_work_size(p, sizeof(double), nth));
    for (int ith = 0; ith < nth; ++ith)
        ssm_scan_keep_f64(p, in + o.s, xbc + su->x_off, in + o.dt, in + o.A, xbc + su->B_off,
                          xbc + su->C_off, d->ids, out, kept, work, ith, nth);
    free(work);
    void * bwork = work_alloc(ssm_scan_back_work_size(p, sizeof(double), nth));
    for (int ith = 0; ith < nth; ++ith)
        ssm_scan_back_kept_f64(p, in + o.s, xbc + su->x_off, in + o.dt, in + o.A, xbc + su->B_off,
                               xbc + su->C_off, d->ids, kept, grad, gin, bwork, ith, nth);
    for (int ith = 0; ith < nth; ++ith)
        ssm_scan_back_reduce_f64(p, d->ids, gin, dA, bwork, ith, nth);
    free(bwork);
}

static void test_scan(const char * name, const scan_dims * d) {
    const scan_offsets o = scan_layout(d);
    const scan_setup su = make_setup(d);
    const int64_t n_out = scan_out_size(d), n_gin = o.A, n_A = o.total - o.A;
    char label[64];

    double * in = xalloc(o.total * sizeof(double));
    fill(in + o.s, o.x - o.s, 1.0);
    fill(in + o.x, o.dt - o.x, 1.0);
    fill(in + o.dt, o.B - o.dt, 1.5);
    fill(in + o.B, o.C - o.B, 1.0);
    fill(in + o.C, o.A - o.C, 1.0);
    for (int64_t j = o.A; j < o.total; ++j) in[j] = -0.5 - 1.5 * (urand() + 1.0) / 2.0;  /* decays < 0 */
    double * grad = xalloc(n_out * sizeof(double));
    fill(grad, n_out, 1.0);

    double * out_ref = xalloc(n_out * sizeof(double));
    naive_scan(d, in, out_ref);

    double * xbc = xalloc(su.n_xbc * sizeof(double));
    pack_xbc(d, &su, in, xbc);

    double * out1 = xalloc(n_out * sizeof(double)), * gin1 = xalloc(n_gin * sizeof(double));
    double * dA1 = xalloc(n_A * sizeof(double));
    double * out3 = xalloc(n_out * sizeof(double)), * gin3 = xalloc(n_gin * sizeof(double));
    double * dA3 = xalloc(n_A * sizeof(double));
    run_scan_f64(d, &su, in, xbc, grad, 1, out1, gin1, dA1);
    run_scan_f64(d, &su, in, xbc, grad, 3, out3, gin3, dA3);

    snprintf(label, sizeof label, "%s_f64_forward", name);
    report(label, max_abs_diff(out1, out_ref, n_out), 1e-12);

    /* finite differences of L = sum(out * grad) w.r.t. every input of the naive loop */
    double * fd = xalloc(o.total * sizeof(double)), * ot = xalloc(n_out * sizeof(double));
    const double eps = 1e-6;
    for (int64_t j = 0; j < o.total * with_fd; ++j) {
        double old = in[j];
        in[j] = old + eps; naive_scan(d, in, ot); double lp = dot(ot, grad, n_out);
        in[j] = old - eps; naive_scan(d, in, ot); double lm = dot(ot, grad, n_out);
        in[j] = old;
        fd[j] = (lp - lm) / (2 * eps);
    }
    static const char * parts[] = { "d_s", "d_x", "d_dt", "d_B", "d_C" };
    const int64_t starts[] = { o.s, o.x, o.dt, o.B, o.C, o.A };
    for (int k = 0; k < 5 * with_fd; ++k) {
        snprintf(label, sizeof label, "%s_f64_%s_vs_fd", name, parts[k]);
        report(label, max_abs_diff(gin1 + starts[k], fd + starts[k], starts[k + 1] - starts[k]), 1e-6);
    }
    if (with_fd) {
        snprintf(label, sizeof label, "%s_f64_d_A_vs_fd", name);
        report(label, max_abs_diff(dA1, fd + o.A, n_A), 1e-6);
    }

    /* rows of s that no id names get exactly zero */
    const int64_t state = d->n_head * d->head_dim * d->d_state;
    double unused = 0;
    for (int64_t r = 0; r < d->n_rs; ++r) {
        int named = 0;
        for (int64_t q = 0; q < d->n_seqs; ++q) named |= d->ids[q] == r;
        if (!named) for (int64_t j = 0; j < state; ++j) unused = fmax(unused, fabs(gin1[r * state + j]));
    }
    snprintf(label, sizeof label, "%s_f64_d_s_unused_rows", name);
    report(label, unused, 0.0);

    snprintf(label, sizeof label, "%s_f64_out_nth1_vs_3", name);
    report_same(label, out1, out3, n_out * sizeof(double));
    snprintf(label, sizeof label, "%s_f64_gin_nth1_vs_3", name);
    report_same(label, gin1, gin3, n_gin * sizeof(double));
    snprintf(label, sizeof label, "%s_f64_d_A_nth1_vs_3", name);
    report_same(label, dA1, dA3, n_A * sizeof(double));

    /* the same three threads, running concurrently */
    double * outc = xalloc(n_out * sizeof(double)), * ginc = xalloc(n_gin * sizeof(double));
    double * dAc = xalloc(n_A * sizeof(double));
    run_scan_f64_concurrent(d, &su, in, xbc, grad, 3, outc, ginc, dAc);
    snprintf(label, sizeof label, "%s_f64_out_concurrent", name);
    report_same(label, out1, outc, n_out * sizeof(double));
    snprintf(label, sizeof label, "%s_f64_gin_concurrent", name);
    report_same(label, gin1, ginc, n_gin * sizeof(double));
    snprintf(label, sizeof label, "%s_f64_d_A_concurrent", name);
    report_same(label, dA1, dAc, n_A * sizeof(double));
    free(outc); free(ginc); free(dAc);

    /* d_A = NULL is allowed (the LoRA path) and must not change gin */
    double * gin_noA = xalloc(n_gin * sizeof(double)), * out_noA = xalloc(n_out * sizeof(double));
    run_scan_f64(d, &su, in, xbc, grad, 2, out_noA, gin_noA, NULL);
    snprintf(label, sizeof label, "%s_f64_gin_without_d_A", name);
    report_same(label, gin1, gin_noA, n_gin * sizeof(double));

    /* the forward's chunk states read by the backward: the same bits; the last one is the final state */
    const int64_t n_kept = ssm_scan_chunk_states(&su.p);
    if (n_kept > 0) {
        double * kept = xalloc(n_kept * sizeof(double)), * out_k = xalloc(n_out * sizeof(double));
        double * gin_k = xalloc(n_gin * sizeof(double)), * dA_k = xalloc(n_A * sizeof(double));
        run_scan_kept_f64(d, &su, in, xbc, grad, 2, out_k, kept, gin_k, dA_k);
        snprintf(label, sizeof label, "%s_f64_out_keep", name);
        report_same(label, out1, out_k, n_out * sizeof(double));
        snprintf(label, sizeof label, "%s_f64_gin_kept", name);
        report_same(label, gin1, gin_k, n_gin * sizeof(double));
        snprintf(label, sizeof label, "%s_f64_d_A_kept", name);
        report_same(label, dA1, dA_k, n_A * sizeof(double));
        const int64_t nc = (d->n_t + 63) / 64, st = d->head_dim * d->d_state;
        double last = 0;
        for (int64_t qh = 0; qh < d->n_seqs * d->n_head; ++qh)
            last = fmax(last, max_abs_diff(kept + (qh * nc + nc - 1) * st, out1 + (o.dt - o.x) + qh * st, st));
        snprintf(label, sizeof label, "%s_f64_last_kept_is_final", name);
        report(label, last, 0.0);
        free(kept); free(out_k); free(gin_k); free(dA_k);
    }

    /* float32 against the float64 results */
    float * in32 = to_f32(in, o.total), * xbc32 = to_f32(xbc, su.n_xbc), * grad32 = to_f32(grad, n_out);
    float * out32 = xalloc(n_out * sizeof(float)), * gin32 = xalloc(n_gin * sizeof(float));
    float * dA32 = xalloc(n_A * sizeof(float));
    run_scan_f32(d, &su, in32, xbc32, grad32, 2, out32, gin32, dA32);
    snprintf(label, sizeof label, "%s_f32_forward", name);
    report(label, max_abs_diff_f32(out32, out_ref, n_out), 1e-4);
    if (with_fd) {
        snprintf(label, sizeof label, "%s_f32_gin_vs_fd", name);
        report(label, max_abs_diff_f32(gin32, fd, n_gin), 1e-3);
        snprintf(label, sizeof label, "%s_f32_d_A_vs_fd", name);
        report(label, max_abs_diff_f32(dA32, fd + o.A, n_A), 1e-3);
    }

    free(in); free(grad); free(out_ref); free(xbc); free(out1); free(gin1); free(dA1);
    free(out3); free(gin3); free(dA3); free(fd); free(ot); free(gin_noA); free(out_noA);
    free(in32); free(xbc32); free(grad32); free(out32); free(gin32); free(dA32);
}

/* ==================================================================== GATED_DELTA_NET, the kept chunks
 * The chunked forward keeping its chunks (gdn_fwd_keep_*) and the backward reading them (gdn_back_kept_*):
 * the bits of gdn_fwd_* and gdn_back_* (float64 and float32, 2 threads called one after another), the
 * first chunk's state the start state, and gdn_chunk_states' count (0 where the call takes the recurrence).
 * Dense inputs: q, k (n_seqs, n_t, H_k, S), v (n_seqs, n_t, H_v, S), g (.., 1 or S), beta (.., 1), state. */
typedef struct {
    int64_t n, n_q, n_v, n_g, n_b, n_s, n_out, n_gin;
    gdn_params p;
} gdn_case;

static gdn_case gdn_make_case(int64_t n_seqs, int64_t n_t, int64_t H_v, int64_t H_k, int64_t S, int kda) {
    gdn_case c = { 0 };
    const int64_t G = kda ? S : 1;
    c.n_q = n_seqs * n_t * H_k * S;
    c.n_v = n_seqs * n_t * H_v * S;
    c.n_g = n_seqs * n_t * H_v * G;
    c.n_b = n_seqs * n_t * H_v;
    c.n_s = n_seqs * H_v * S * S;
    c.n = 2 * c.n_q + c.n_v + c.n_g + c.n_b + c.n_s;
    c.n_out = c.n_v + c.n_s;
    c.n_gin = c.n;
    gdn_params * p = &c.p;
    *p = (gdn_params) { .n_seqs = n_seqs, .n_seqs_k = n_seqs, .n_t = n_t, .H_v = H_v, .H_k = H_k, .S = S, .K = 1,
                        .g_per_channel = kda, .head_bcast = GDN_BCAST_TILED, .form = SSM_FORM_CHUNKED, .simd = simd };
    const int64_t qs[4] = { n_t * H_k * S, H_k * S, S, 1 }, vs[4] = { n_t * H_v * S, H_v * S, S, 1 };
    const int64_t gs[4] = { n_t * H_v * G, H_v * G, G, 1 }, bs[4] = { n_t * H_v, H_v, 1, 1 };
    const int64_t ss[4] = { H_v * S * S, S * S, S, 1 };
    memcpy(p->q_st, qs, sizeof qs);
    memcpy(p->k_st, qs, sizeof qs);
    memcpy(p->v_st, vs, sizeof vs);
    memcpy(p->g_st, gs, sizeof gs);
    memcpy(p->beta_st, bs, sizeof bs);
    memcpy(p->state_st, ss, sizeof ss);
    return c;
}

/* forward and backward, the kept pair where kept is not NULL, nth threads one after another; REAL double */
static void gdn_run_f64(const gdn_case * c, const double * in, const double * grad, int nth, double * out,
                        double * kept, double * gin) {
    const double * q = in, * k = q + c->n_q, * v = k + c->n_q, * g = v + c->n_v, * b = g + c->n_g, * s = b + c->n_b;
    void * work = work_alloc(gdn_fwd_work_size(&c->p, sizeof(double), nth));
    for (int ith = 0; ith < nth; ++ith)
        if (kept) gdn_fwd_keep_f64(&c->p, q, k, v, g, b, s, out, kept, work, ith, nth);
        else gdn_fwd_f64(&c->p, q, k, v, g, b, s, out, work, ith, nth);
    free(work);
    work = work_alloc(gdn_back_work_size(&c->p, sizeof(double), nth));
    for (int ith = 0; ith < nth; ++ith)
        if (kept) gdn_back_kept_f64(&c->p, q, k, v, g, b, s, kept, grad, gin, work, ith, nth);
        else gdn_back_f64(&c->p, q, k, v, g, b, s, grad, gin, work, ith, nth);
    free(work);
}

static void gdn_run_f32(const gdn_case * c, const float * in, const float * grad, int nth, float * out,
                        float * kept, float * gin) {
    const float * q = in, * k = q + c->n_q, * v = k + c->n_q, * g = v + c->n_v, * b = g + c->n_g, * s = b + c->n_b;
    void * work = work_alloc(gdn_fwd_work_size(&c->p, sizeof(float), nth));
    for (int ith = 0; ith < nth; ++ith)
        if (kept) gdn_fwd_keep_f32(&c->p, q, k, v, g, b, s, out, kept, work, ith, nth);
        else gdn_fwd_f32(&c->p, q, k, v, g, b, s, out, work, ith, nth);
    free(work);
    work = work_alloc(gdn_back_work_size(&c->p, sizeof(float), nth));
    for (int ith = 0; ith < nth; ++ith)
        if (kept) gdn_back_kept_f32(&c->p, q, k, v, g, b, s, kept, grad, gin, work, ith, nth);
        else gdn_back_f32(&c->p, q, k, v, g, b, s, grad, gin, work, ith, nth);
    free(work);
}

static void test_gdn_kept(const char * name, int kda) {
    const int64_t n_seqs = 2, n_t = 70, H_v = 2, H_k = 1, S = 5, Sp = 16, C = 64, nc = 2;
    gdn_case c = gdn_make_case(n_seqs, n_t, H_v, H_k, S, kda);
    char label[96];
    const int64_t E = Sp * Sp + 2 * C * Sp + (kda ? 2 : 3) * C * C, n_kept = gdn_chunk_states(&c.p);
    snprintf(label, sizeof label, "gdn_%s_chunk_states", name);
    report(label, fabs((double) (n_kept - n_seqs * H_v * nc * E)), 0.0);
    double * in = xalloc(c.n * sizeof(double)), * grad = xalloc(c.n_out * sizeof(double));
    fill(in, c.n, 0.5);
    double * g = in + 2 * c.n_q + c.n_v, * b = g + c.n_g;
    for (int64_t i = 0; i < c.n_g; ++i) g[i] = -0.05 - 0.05 * fabs(g[i]);   /* decays < 1, beta in (0, 1) */
    for (int64_t i = 0; i < c.n_b; ++i) b[i] = 0.5 + 0.4 * b[i];
    fill(grad, c.n_out, 1.0);
    double * out = xalloc(c.n_out * sizeof(double)), * gin = xalloc(c.n_gin * sizeof(double));
    double * out_k = xalloc(c.n_out * sizeof(double)), * gin_k = xalloc(c.n_gin * sizeof(double));
    double * kept = work_alloc(n_kept * sizeof(double));   /* 64-byte aligned: the streaming stores */
    gdn_run_f64(&c, in, grad, 2, out, NULL, gin);
    gdn_run_f64(&c, in, grad, 2, out_k, kept, gin_k);
    snprintf(label, sizeof label, "gdn_%s_f64_out_keep", name);
    report_same(label, out, out_k, c.n_out * sizeof(double));
    snprintf(label, sizeof label, "gdn_%s_f64_gin_kept", name);
    report_same(label, gin, gin_k, c.n_gin * sizeof(double));
    /* entry [n, h, 0] starts with the start state, untransposed: H[i][j] = state[n, h, j, i] */
    const double * st = in + c.n - c.n_s;
    double first = 0;
    for (int64_t nh = 0; nh < n_seqs * H_v; ++nh)
        for (int64_t i = 0; i < S; ++i)
            for (int64_t j = 0; j < S; ++j)
                first = fmax(first, fabs(kept[nh * nc * E + i * Sp + j] - st[nh * S * S + j * S + i]));
    snprintf(label, sizeof label, "gdn_%s_f64_first_kept_is_start", name);
    report(label, first, 0.0);
    float * in32 = to_f32(in, c.n), * grad32 = to_f32(grad, c.n_out);
    float * o32 = xalloc(c.n_out * sizeof(float)), * gi32 = xalloc(c.n_gin * sizeof(float));
    float * ok32 = xalloc(c.n_out * sizeof(float)), * gk32 = xalloc(c.n_gin * sizeof(float));
    float * kept32 = work_alloc(n_kept * sizeof(float));
    gdn_run_f32(&c, in32, grad32, 2, o32, NULL, gi32);
    gdn_run_f32(&c, in32, grad32, 2, ok32, kept32, gk32);
    snprintf(label, sizeof label, "gdn_%s_f32_out_keep", name);
    report_same(label, o32, ok32, c.n_out * sizeof(float));
    snprintf(label, sizeof label, "gdn_%s_f32_gin_kept", name);
    report_same(label, gi32, gk32, c.n_gin * sizeof(float));
    /* nothing kept where the call takes the recurrence */
    c.p.form = SSM_FORM_RECURRENCE;
    const int64_t rec = gdn_chunk_states(&c.p);
    c.p.form = SSM_FORM_CHUNKED;
    c.p.K = 2;
    const int64_t k2 = gdn_chunk_states(&c.p);
    snprintf(label, sizeof label, "gdn_%s_no_chunk_states_recurrence", name);
    report(label, (double) (rec + k2), 0.0);
    free(in); free(grad); free(out); free(gin); free(out_k); free(gin_k); free(kept);
    free(in32); free(grad32); free(o32); free(gi32); free(ok32); free(gk32); free(kept32);
}

int main(int argc, char ** argv) {
    for (int i = 1; i < argc; ++i) {
        if (!strcmp(argv[i], "--simd=x86-64")) simd = SSM_SIMD_X86_64;
        else if (!strcmp(argv[i], "--simd=x86-64-v3")) simd = SSM_SIMD_X86_64_V3;
        else if (!strcmp(argv[i], "--simd=v4-no-vec64")) simd = SSM_SIMD_V4_NO_VEC64;
        else if (!strcmp(argv[i], "--no-fd")) with_fd = 0;
        else if (strcmp(argv[i], "--simd=auto") != 0) {
            fprintf(stderr, "usage: %s [--simd=auto|x86-64|x86-64-v3|v4-no-vec64] [--no-fd]\n", argv[0]);
            return 2;
        }
    }
    /* which pass of the kernels runs (tests/kernels/test_c_api.py checks it) */
    printf("simd compiled: %s\nsimd selected: %s\n", ssm_simd_compiled(), ssm_simd_name(simd));
    test_conv();

    /* Mamba-2 branch: scalar A per head, 2 groups, a duplicate id, spare rows, K = 2 */
    const int64_t ids2[] = { 2, 0, 2 };
    const scan_dims m2 = { .n_rs = 4, .n_head = 4, .head_dim = 2, .d_state = 3, .n_group = 2,
                           .n_t = 4, .n_seqs = 3, .K = 2, .a_per_state = 0, .ids = ids2 };
    test_scan("mamba2_K2", &m2);

    /* K > n_t: slots k >= n_t are zero and get no gradient; both sequences start from row 1 */
    const int64_t ids2k[] = { 1, 1 };
    const scan_dims m2k = { .n_rs = 2, .n_head = 2, .head_dim = 3, .d_state = 2, .n_group = 1,
                            .n_t = 2, .n_seqs = 2, .K = 4, .a_per_state = 0, .ids = ids2k };
    test_scan("mamba2_K4_nt2", &m2k);

    /* Mamba-1 branch as llama.cpp runs it: head_dim 1, n_group 1, A (n_head, d_state) */
    const int64_t ids1[] = { 1, 1 };
    const scan_dims m1 = { .n_rs = 3, .n_head = 5, .head_dim = 1, .d_state = 4, .n_group = 1,
                           .n_t = 3, .n_seqs = 2, .K = 1, .a_per_state = 1, .ids = ids1 };
    test_scan("mamba1", &m1);

    /* Mamba-2 with K = 1 across a chunk boundary (n_t 70 > 64 tokens), each form of the forward
     * and of the backward chosen through the params */
    const int64_t ids3[] = { 0, 2, 0 };
    for (int64_t form = SSM_FORM_RECURRENCE; form <= SSM_FORM_CHUNKED; ++form) {
        const scan_dims m2c = { .n_rs = 3, .n_head = 4, .head_dim = 2, .d_state = 3, .n_group = 2,
                                .n_t = 70, .n_seqs = 3, .K = 1, .a_per_state = 0, .ids = ids3,
                                .fwd_form = form, .back_form = form };
        test_scan(form == SSM_FORM_CHUNKED ? "mamba2_chunked_nt70" : "mamba2_recurrence_nt70", &m2c);
    }
    /* chunk states only where both kernels take the chunked form (test_scan checks them there) */
    {
        const scan_dims m2c = { .n_rs = 3, .n_head = 4, .head_dim = 2, .d_state = 3, .n_group = 2,
                                .n_t = 70, .n_seqs = 3, .K = 1, .a_per_state = 0, .ids = ids3 };
        scan_setup su = make_setup(&m2c);
        su.p.fwd_form = su.p.back_form = SSM_FORM_CHUNKED;
        const int64_t both = ssm_scan_chunk_states(&su.p);
        su.p.fwd_form = SSM_FORM_RECURRENCE;
        const int64_t one = ssm_scan_chunk_states(&su.p);
        if (both != 3 * 4 * 2 * 2 * 3 || one != 0) {
            printf("FAIL ssm_scan_chunk_states: %lld with both forms chunked (want %d), %lld with one (want 0)\n",
                   (long long) both, 3 * 4 * 2 * 2 * 3, (long long) one);
            ++n_failed;
        }
    }
    /* the form reaches the kernels: the two forms ask for different scratch */
    {
        const scan_dims m2c = { .n_rs = 3, .n_head = 4, .head_dim = 2, .d_state = 3, .n_group = 2,
                                .n_t = 70, .n_seqs = 3, .K = 1, .a_per_state = 0, .ids = ids3 };
        scan_setup su = make_setup(&m2c);
        su.p.fwd_form = su.p.back_form = SSM_FORM_RECURRENCE;
        const size_t rec = ssm_scan_work_size(&su.p, 8, 1), brec = ssm_scan_back_work_size(&su.p, 8, 1);
        su.p.fwd_form = su.p.back_form = SSM_FORM_CHUNKED;
        const size_t chk = ssm_scan_work_size(&su.p, 8, 1), bchk = ssm_scan_back_work_size(&su.p, 8, 1);
        if (rec == chk || brec == bchk) {
            printf("FAIL params.fwd_form / back_form do not reach the work size (%zu %zu, %zu %zu)\n",
                   rec, chk, brec, bchk);
            ++n_failed;
        }
    }

    test_gdn_kept("scalar", 0);
    test_gdn_kept("kda", 1);

    if (n_failed) {
        printf("FAILED: %d check(s)\n", n_failed);
        return 1;
    }
    printf("all C API checks passed\n");
    return 0;
}
