// out-prod-bench: the input gradient through a frozen weight, d_x = OUT_PROD(W, transpose(d_y)), on ggml's CPU
// backend, timed with the series' dequantized tiles and with the CPU's reference mode (use_ref), which keeps
// ggml's row-by-row loops (each row of W converted to F32 once per token): the before and after of one
// binary, on the same tensors. Both results are checked to be the same bytes before anything is timed.
//
//   out-prod-bench [N_IN N_OUT N_TOKENS [THREADS [REPS]]]     default 2048 8192 256 1 5
//
// W is [N_IN, N_OUT] (ggml's ne; a projection from N_IN to N_OUT features) in F32, F16, BF16, Q8_0, Q4_0 and
// Q4_K, d_y [N_OUT, N_TOKENS]; prints a line per type: the median of REPS runs of each, and the ratio.

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9*ts.tv_nsec;
}

static int cmp_double(const void * a, const void * b) {
    const double x = *(const double *) a, y = *(const double *) b;
    return x < y ? -1 : x > y;
}

static double median_seconds(ggml_backend_t backend, struct ggml_cgraph * gf, int reps) {
    double t[64];
    ggml_backend_graph_compute(backend, gf);                 // warm-up
    for (int r = 0; r < reps; ++r) {
        const double t0 = now();
        GGML_ASSERT(ggml_backend_graph_compute(backend, gf) == GGML_STATUS_SUCCESS);
        t[r] = now() - t0;
    }
    qsort(t, reps, sizeof(double), cmp_double);
    return t[reps/2];
}

int main(int argc, char ** argv) {
    const int64_t n_in  = argc > 1 ? atoll(argv[1]) : 2048;
    const int64_t n_out = argc > 2 ? atoll(argv[2]) : 8192;
    const int64_t n_tok = argc > 3 ? atoll(argv[3]) : 256;
    const int threads   = argc > 4 ? atoi(argv[4]) : 1;
    int reps            = argc > 5 ? atoi(argv[5]) : 5;
    if (n_in <= 0 || n_out <= 0 || n_tok <= 0 || n_in % 256 || threads < 1 || reps < 1) {
        fprintf(stderr, "usage: out-prod-bench [N_IN N_OUT N_TOKENS [THREADS [REPS]]] (N_IN a multiple of 256)\n");
        return 1;
    }
    reps = reps > 64 ? 64 : reps;

    // the values, drawn once: W in F32 and d_y
    float * w32 = (float *) malloc(sizeof(float)*n_in*n_out);
    float * dy  = (float *) malloc(sizeof(float)*n_out*n_tok);
    GGML_ASSERT(w32 && dy);
    uint64_t s = 0x9e3779b97f4a7c15ull;
    for (int64_t i = 0; i < n_in*n_out; ++i) {
        s = s*6364136223846793005ull + 1442695040888963407ull;
        w32[i] = ((float) (s >> 40)/16777216.0f - 0.5f)*0.1f;
    }
    for (int64_t i = 0; i < n_out*n_tok; ++i) {
        s = s*6364136223846793005ull + 1442695040888963407ull;
        dy[i] = (float) (s >> 40)/16777216.0f - 0.5f;
    }

    ggml_backend_t backend = ggml_backend_cpu_init();
    GGML_ASSERT(backend);
    ggml_backend_cpu_set_n_threads(backend, threads);
    printf("out-prod-bench: d_x = OUT_PROD(W [%lld, %lld], d_y^T), %lld tokens, %d thread(s), median of %d\n",
           (long long) n_in, (long long) n_out, (long long) n_tok, threads, reps);
    printf("| W | row by row (use_ref) | dequantized tiles | speed-up |\n|---|---|---|---|\n");

    const enum ggml_type types[] = { GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_BF16, GGML_TYPE_Q8_0, GGML_TYPE_Q4_0,
                                     GGML_TYPE_Q4_K };
    int bad = 0;
    for (size_t ti = 0; ti < sizeof(types)/sizeof(types[0]); ++ti) {
        const enum ggml_type type = types[ti];
        struct ggml_init_params ip = { 16*ggml_tensor_overhead() + ggml_graph_overhead(), NULL, true };
        struct ggml_context * ctx = ggml_init(ip);
        struct ggml_tensor * w  = ggml_new_tensor_2d(ctx, type, n_in, n_out);
        struct ggml_tensor * g  = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n_out, n_tok);     // d_y
        struct ggml_tensor * dx = ggml_out_prod(ctx, w, ggml_transpose(ctx, g));
        struct ggml_cgraph * gf = ggml_new_graph(ctx);
        ggml_build_forward_expand(gf, dx);
        ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, backend);
        GGML_ASSERT(buf);

        void * wdata = malloc(ggml_nbytes(w));
        GGML_ASSERT(wdata);
        if (type == GGML_TYPE_F32) {
            memcpy(wdata, w32, ggml_nbytes(w));
        } else {
            ggml_quantize_chunk(type, w32, wdata, 0, n_out, n_in, NULL);
        }
        ggml_backend_tensor_set(w, wdata, 0, ggml_nbytes(w));
        ggml_backend_tensor_set(g, dy, 0, ggml_nbytes(g));

        // the same bytes both ways
        float * r0 = (float *) malloc(ggml_nbytes(dx));
        float * r1 = (float *) malloc(ggml_nbytes(dx));
        ggml_backend_cpu_set_use_ref(backend, true);
        GGML_ASSERT(ggml_backend_graph_compute(backend, gf) == GGML_STATUS_SUCCESS);
        ggml_backend_tensor_get(dx, r0, 0, ggml_nbytes(dx));
        ggml_backend_cpu_set_use_ref(backend, false);
        GGML_ASSERT(ggml_backend_graph_compute(backend, gf) == GGML_STATUS_SUCCESS);
        ggml_backend_tensor_get(dx, r1, 0, ggml_nbytes(dx));
        const int same = memcmp(r0, r1, ggml_nbytes(dx)) == 0;
        bad |= !same;

        ggml_backend_cpu_set_use_ref(backend, true);
        const double t_ref = median_seconds(backend, gf, reps);
        ggml_backend_cpu_set_use_ref(backend, false);
        const double t_new = median_seconds(backend, gf, reps);
        // F32 has the register tiles (the series' 0026) in both modes: the yardstick
        printf("| %s | %.1f ms%s | %.1f ms | %.2fx%s |\n", ggml_type_name(type), 1e3*t_ref,
               type == GGML_TYPE_F32 ? " (F32 tiles too)" : "", 1e3*t_new, t_ref/t_new, same ? "" : " (RESULTS DIFFER)");
        fflush(stdout);
        free(r0);
        free(r1);
        free(wdata);
        ggml_backend_buffer_free(buf);
        ggml_free(ctx);
    }
    ggml_backend_free(backend);
    free(w32);
    free(dy);
    printf(bad ? "FAIL: results differ\n" : "same bytes both ways for every type\n");
    return bad;
}
