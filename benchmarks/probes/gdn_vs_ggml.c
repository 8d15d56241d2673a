// gdn_vs_ggml: ssmgrad's gdn_fwd_f32 against ggml's own CPU forward of GGML_OP_GATED_DELTA_NET (the
// built ggml of ggml/build.sh), elementwise: how many of the packed output's floats are bitwise equal,
// the largest difference in ulp (where |value| >= 0.01) and in absolute value. Every slot ggml writes is compared (slots
// s >= n_t are the caller's in both).
//
//   bash ggml/build.sh
//   B=build/ggml; cc -O2 -std=gnu11 -Ibuild/ggml/_src/ggml/include -Icsrc benchmarks/probes/gdn_vs_ggml.c \
//      $B/ggml/src/libggml.a $B/ggml/src/libggml-cpu.a $B/ggml/src/libggml-base.a -lstdc++ -lm -lpthread \
//      -o /tmp/gdn_vs_ggml && /tmp/gdn_vs_ggml
//
// (libggml-cpu.a holds ssmgrad's kernels: ggml/build.sh compiles csrc/ into it.)

#include "ggml.h"
#include "ggml-cpu.h"
#include "ssmgrad.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint64_t rng_state = 0x2545f4914f6cdd1dull;

static float uniform(float lo, float hi) {
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return lo + (hi - lo) * (float) ((rng_state >> 40) & 0xffffff) / 16777216.0f;
}

static void fill(struct ggml_tensor * t, float lo, float hi) {
    float * d = (float *) t->data;
    for (int64_t i = 0; i < ggml_nelements(t); ++i) d[i] = uniform(lo, hi);
}

// q, k rows to unit length, as llama.cpp's graph does before the op
static void l2norm_rows(struct ggml_tensor * t) {
    float * d = (float *) t->data;
    for (int64_t r = 0; r < ggml_nelements(t) / t->ne[0]; ++r) {
        double s = 0;
        for (int64_t i = 0; i < t->ne[0]; ++i) s += (double) d[r * t->ne[0] + i] * d[r * t->ne[0] + i];
        for (int64_t i = 0; i < t->ne[0]; ++i) d[r * t->ne[0] + i] /= (float) sqrt(s);
    }
}

static int64_t ulp_diff(float a, float b) {
    int32_t ia, ib;
    memcpy(&ia, &a, 4);
    memcpy(&ib, &b, 4);
    if (ia < 0) ia = INT32_MIN - ia;
    if (ib < 0) ib = INT32_MIN - ib;
    return llabs((int64_t) ia - (int64_t) ib);
}

static void dense_strides(const int64_t * shape, int64_t * st) {   // NumPy-order shape[4]
    st[3] = 1;
    for (int d = 2; d >= 0; --d) st[d] = st[d + 1] * shape[d + 1];
}

static int run_case(int64_t S, int64_t H_v, int64_t H_k, int64_t n_t, int64_t n_seqs, int kda, int64_t K, int nth) {
    struct ggml_init_params ip = { (size_t) 512 << 20, NULL, false };
    struct ggml_context * ctx = ggml_init(ip);
    struct ggml_tensor * q = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, S, H_k, n_t, n_seqs);
    struct ggml_tensor * k = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, S, H_k, n_t, n_seqs);
    struct ggml_tensor * v = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, S, H_v, n_t, n_seqs);
    struct ggml_tensor * g = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, kda ? S : 1, H_v, n_t, n_seqs);
    struct ggml_tensor * beta = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, 1, H_v, n_t, n_seqs);
    struct ggml_tensor * state = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, S, S, H_v, n_seqs);
    fill(q, -1, 1), fill(k, -1, 1), fill(v, -1, 1), fill(g, -1.5f, -0.01f), fill(beta, 0, 1), fill(state, -0.5f, 0.5f);
    l2norm_rows(q), l2norm_rows(k);
    struct ggml_tensor * out = ggml_gated_delta_net(ctx, q, k, v, g, beta, state, K);
    struct ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, out);
    if (ggml_graph_compute_with_ctx(ctx, gf, nth) != GGML_STATUS_SUCCESS) return 2;

    gdn_params p = { .n_seqs = n_seqs, .n_seqs_k = n_seqs, .n_t = n_t, .H_v = H_v, .H_k = H_k, .S = S, .K = K,
                     .g_per_channel = kda, .head_bcast = GDN_BCAST_TILED };
    const int64_t qs[4] = { n_seqs, n_t, H_k, S }, vs[4] = { n_seqs, n_t, H_v, S };
    const int64_t gs[4] = { n_seqs, n_t, H_v, kda ? S : 1 }, bs[4] = { n_seqs, n_t, H_v, 1 };
    const int64_t ss[4] = { n_seqs, H_v, S, S };
    dense_strides(qs, p.q_st), dense_strides(qs, p.k_st), dense_strides(vs, p.v_st);
    dense_strides(gs, p.g_st), dense_strides(bs, p.beta_st), dense_strides(ss, p.state_st);
    const int64_t n_o = n_seqs * n_t * H_v * S, n_written = n_o + (n_t < K ? n_t : K) * n_seqs * H_v * S * S;
    float * mine = calloc((size_t) ggml_nelements(out), sizeof(float));
    void * work = aligned_alloc(SSM_WORK_ALIGN, (gdn_fwd_work_size(&p, 4, 1) + SSM_WORK_ALIGN) / SSM_WORK_ALIGN * SSM_WORK_ALIGN);
    gdn_fwd_f32(&p, q->data, k->data, v->data, g->data, beta->data, state->data, mine, work, 0, 1);

    const float * theirs = (const float *) out->data;
    int64_t equal = 0, max_ulp = 0;
    double max_abs = 0;
    for (int64_t i = 0; i < n_written; ++i) {
        equal += mine[i] == theirs[i];
        const int64_t u = ulp_diff(mine[i], theirs[i]);
        if (fabsf(theirs[i]) >= 1e-2f && u > max_ulp) max_ulp = u;   // ulps mean little near 0
        if (fabs((double) mine[i] - theirs[i]) > max_abs) max_abs = fabs((double) mine[i] - theirs[i]);
    }
    printf("S %3lld H_v %lld H_k %lld n_t %3lld n_seqs %lld %-6s K %lld ggml threads %d: %lld/%lld bitwise equal "
           "(%.1f%%), max %lld ulp where |x| >= 0.01, max abs %.2e\n", (long long) S, (long long) H_v, (long long) H_k, (long long) n_t,
           (long long) n_seqs, kda ? "kda" : "scalar", (long long) K, nth, (long long) equal, (long long) n_written,
           100.0 * equal / n_written, (long long) max_ulp, max_abs);
    free(mine);
    free(work);
    ggml_free(ctx);
    return 0;
}

int main(void) {
    int rc = 0;
    rc |= run_case(128, 4, 2, 70, 2, 0, 1, 1);
    rc |= run_case(128, 4, 2, 70, 2, 1, 3, 2);
    rc |= run_case(128, 2, 1, 1, 3, 0, 1, 1);
    rc |= run_case(64, 4, 4, 33, 1, 1, 1, 2);
    rc |= run_case(16, 2, 1, 9, 2, 0, 4, 1);
    rc |= run_case(19, 2, 1, 9, 2, 1, 2, 1);
    return rc;
}
