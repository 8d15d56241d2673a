// gdn-check: ggml's GATED_DELTA_NET against ssmgrad's Gated DeltaNet kernels, inside the patched ggml.
//
//   1. forward: ggml's own CPU forward of GGML_OP_GATED_DELTA_NET and ssmgrad's gdn_fwd_f32 on the same
//      inputs (q, k, v strided views with contiguous rows, as llama.cpp hands them over), compared
//      element by element in units in the last place (the float bit patterns' distance; only the
//      state slots the forward writes). One line per case:
//        fwd <case> <n_floats> max_ulp_o <u> max_ulp_state <u> max_abs <a> max_ulp_at_max <u> max_ulp_row <u> equal <f>
//      max_ulp_o / _state: the largest ulp distance of one element (large where a value is close to 0
//      by cancellation: a few ulps of the terms summed are many of the result's); max_ulp_at_max: the
//      largest |difference| in ulps of the largest |value| of its region (o, states); max_ulp_row: the
//      same per row of S values (one token and head of o, one value channel of a state); equal: the
//      fraction of elements with the same bits.
//   2. backward: GATED_DELTA_NET_BACK through ggml's graph, plan and work buffer with 1, 2, 3 and 4
//      threads gives the same bytes, and those of a direct call of gdn_back_f32 with one thread.
//   3. with a directory argument, each backward case's inputs, incoming gradient and result are
//      written as raw float32 files plus a manifest (as ssm-back-check does), for tests/ggml/test_ggml_gdn.py
//      to compare with a float64 torch reference.
//
//   gdn-check [DUMP_DIR]      exit 0: every check held; 1: a mismatch; 2: usage/IO error
//
// The forward's ulp figures are printed, not judged here: tests/ggml/test_ggml_gdn.py holds the bound.

#include "ggml.h"
#include "ggml-cpu.h"

#include "ssmgrad.h"

#include <math.h>

#define CHECK_RNG_SEED 0x243f6a8885a308d3ull
#include "check_common.h"

// the float's position on the number line, so that adjacent floats are 1 apart (-0 and +0 coincide)
static int64_t ordinal(float x) {
    int32_t i;
    memcpy(&i, &x, sizeof(i));
    return i >= 0 ? (int64_t) i : -(int64_t) (i & 0x7fffffff);
}

static int64_t ulp_dist(float a, float b) {
    const int64_t d = ordinal(a) - ordinal(b);
    return d < 0 ? -d : d;
}

// the spacing of floats at |x|
static double ulp_of(float x) {
    const float ax = fabsf(x);
    return (double) nextafterf(ax, INFINITY) - (double) ax;
}

// the case's inputs; q, k, v are views of larger tensors (a padded row stride, contiguous rows)
struct gdn_case {
    struct ggml_context * ctx;
    struct ggml_tensor * q, * k, * v, * g, * beta, * state;
    int64_t S, H_k, H_v, n_t, n_seqs, n_seqs_k, K;
    int kda;
};

static struct gdn_case make_case(int64_t S, int64_t H_k, int64_t H_v, int64_t n_t, int64_t n_seqs, int64_t n_seqs_k,
                                 int kda, int64_t K) {
    struct gdn_case c = { 0 };
    struct ggml_init_params ip = { 512*1024*1024, NULL, false };
    c.ctx = ggml_init(ip);
    GGML_ASSERT(c.ctx);
    c.S = S; c.H_k = H_k; c.H_v = H_v; c.n_t = n_t; c.n_seqs = n_seqs; c.n_seqs_k = n_seqs_k; c.kda = kda; c.K = K;

    // q and k: rows of unit norm (llama.cpp L2-normalizes them before the op), in one buffer
    // {S, 2*H_k + 1, n_t, n_seqs_k} with q at head offset 0, k at H_k (one spare head of padding)
    struct ggml_tensor * qk = ggml_new_tensor_4d(c.ctx, GGML_TYPE_F32, S, 2*H_k + 1, n_t, n_seqs_k);
    fill(qk, -1.0f, 1.0f);
    for (int64_t r = 0; r < ggml_nrows(qk); ++r) {
        float * row = (float *) qk->data + r*S;
        double n2 = 0.0;
        for (int64_t i = 0; i < S; ++i) {
            n2 += (double) row[i]*row[i];
        }
        const float inv = (float) (1.0/sqrt(n2 + 1e-12));
        for (int64_t i = 0; i < S; ++i) {
            row[i] *= inv;
        }
    }
    c.q = ggml_view_4d(c.ctx, qk, S, H_k, n_t, n_seqs_k, qk->nb[1], qk->nb[2], qk->nb[3], 0);
    c.k = ggml_view_4d(c.ctx, qk, S, H_k, n_t, n_seqs_k, qk->nb[1], qk->nb[2], qk->nb[3], H_k*qk->nb[1]);
    // v: {S, H_v, n_t, n_seqs} inside {S + 3, H_v, n_t, n_seqs}
    struct ggml_tensor * vb = ggml_new_tensor_4d(c.ctx, GGML_TYPE_F32, S + 3, H_v, n_t, n_seqs);
    fill(vb, -1.0f, 1.0f);
    c.v = ggml_view_4d(c.ctx, vb, S, H_v, n_t, n_seqs, vb->nb[1], vb->nb[2], vb->nb[3], 0);
    // g: a log-decay as the models make it (-softplus(.) * exp(A_log)), here in [-4, -0.001];
    // beta: a sigmoid's output
    c.g     = ggml_new_tensor_4d(c.ctx, GGML_TYPE_F32, kda ? S : 1, H_v, n_t, n_seqs);
    c.beta  = ggml_new_tensor_4d(c.ctx, GGML_TYPE_F32, 1, H_v, n_t, n_seqs);
    c.state = ggml_new_tensor_4d(c.ctx, GGML_TYPE_F32, S, S, H_v, n_seqs);
    fill(c.g, -4.0f, -0.001f);
    fill(c.beta, 0.0f, 1.0f);
    fill(c.state, -0.5f, 0.5f);
    return c;
}

static void nstrides(const struct ggml_tensor * t, int64_t st[4]) {
    for (int i = 0; i < 4; ++i) {
        GGML_ASSERT(t->nb[3 - i] % sizeof(float) == 0);
        st[i] = (int64_t) (t->nb[3 - i]/sizeof(float));
    }
}

static gdn_params params_of(const struct gdn_case * c) {
    gdn_params p;
    memset(&p, 0, sizeof(p));
    p.n_seqs = c->n_seqs; p.n_seqs_k = c->n_seqs_k; p.n_t = c->n_t; p.H_v = c->H_v; p.H_k = c->H_k;
    p.S = c->S; p.K = c->K; p.g_per_channel = c->kda; p.head_bcast = GDN_BCAST_TILED;
    nstrides(c->q, p.q_st);
    nstrides(c->k, p.k_st);
    nstrides(c->v, p.v_st);
    nstrides(c->g, p.g_st);
    nstrides(c->beta, p.beta_st);
    nstrides(c->state, p.state_st);
    return p;
}

static void * aligned_work(size_t size, void ** base) {
    *base = malloc(size + SSM_WORK_ALIGN);
    GGML_ASSERT(*base);
    return (void *) (((uintptr_t) *base + SSM_WORK_ALIGN - 1) & ~(uintptr_t) (SSM_WORK_ALIGN - 1));
}

static int run_fwd(const char * cname, int64_t S, int64_t H_k, int64_t H_v, int64_t n_t, int64_t n_seqs,
                   int64_t n_seqs_k, int kda, int64_t K) {
    struct gdn_case c = make_case(S, H_k, H_v, n_t, n_seqs, n_seqs_k, kda, K);

    struct ggml_tensor * out = ggml_gated_delta_net(c.ctx, c.q, c.k, c.v, c.g, c.beta, c.state, K);
    struct ggml_cgraph * gf = ggml_new_graph(c.ctx);
    ggml_build_forward_expand(gf, out);
    float * ref = (float *) compute(gf, out, 2);

    gdn_params p = params_of(&c);
    p.form = SSM_FORM_RECURRENCE;   // ggml's forward is the recurrence: its bits (the chunked form rounds differently)
    const int64_t n_out = ggml_nelements(out);
    float * got = (float *) malloc(n_out*sizeof(float));
    GGML_ASSERT(got);
    for (int64_t i = 0; i < n_out; ++i) {
        got[i] = NAN;
    }
    void * wbase;
    void * work = aligned_work(gdn_fwd_work_size(&p, sizeof(float), 1), &wbase);
    gdn_fwd_f32(&p, (const float *) c.q->data, (const float *) c.k->data, (const float *) c.v->data,
                (const float *) c.g->data, (const float *) c.beta->data, (const float *) c.state->data,
                got, work, 0, 1);
    free(wbase);

    // compared: o, and the slots s < min(K, n_t) (ggml writes no other)
    const int64_t n_o    = S*H_v*n_t*n_seqs;
    const int64_t n_slot = S*S*H_v*n_seqs;
    const int64_t n_cmp  = n_o + (K < n_t ? K : n_t)*n_slot;
    int64_t max_ulp[2] = { 0, 0 }, n_equal = 0;
    double  max_abs = 0.0, max_val[2] = { 0.0, 0.0 }, max_diff[2] = { 0.0, 0.0 }, max_row = 0.0;
    int bad = 0;
    // per row of S values (one token and head of o, one value channel of a state): the largest
    // |difference| in ulps of the row's largest |value|
    for (int64_t r0 = 0; r0 < n_cmp; r0 += S) {
        double rmax = 0.0, dmax = 0.0;
        for (int64_t i = r0; i < r0 + S; ++i) {
            if (fabs(ref[i]) > rmax) rmax = fabs(ref[i]);
            if (fabs((double) ref[i] - (double) got[i]) > dmax) dmax = fabs((double) ref[i] - (double) got[i]);
        }
        if (rmax > 0.0 && dmax/ulp_of((float) rmax) > max_row) {
            max_row = dmax/ulp_of((float) rmax);
        }
    }
    for (int64_t i = 0; i < n_cmp; ++i) {
        const int r = i >= n_o;
        if (!isfinite(ref[i]) || !isfinite(got[i])) {
            if (!bad) {
                printf("fwd %s: element %" PRId64 " not finite (ggml %.9g, ssmgrad %.9g)\n", cname, i, ref[i], got[i]);
            }
            bad = 1;
            continue;
        }
        const int64_t u = ulp_dist(ref[i], got[i]);
        n_equal += u == 0;
        const double  d = fabs((double) ref[i] - (double) got[i]);
        if (u > max_ulp[r]) max_ulp[r] = u;
        if (d > max_abs) max_abs = d;
        if (d > max_diff[r]) max_diff[r] = d;
        if (fabs(ref[i]) > max_val[r]) max_val[r] = fabs(ref[i]);
    }
    const double at0 = max_diff[0]/ulp_of((float) max_val[0]);
    const double at1 = max_diff[1]/ulp_of((float) max_val[1]);
    printf("fwd %s %" PRId64 " max_ulp_o %" PRId64 " max_ulp_state %" PRId64 " max_abs %.3g max_ulp_at_max %.3g"
           " max_ulp_row %.3g equal %.3f\n",
           cname, n_cmp, max_ulp[0], max_ulp[1], max_abs, at0 > at1 ? at0 : at1, max_row, (double) n_equal/n_cmp);
    free(ref);
    free(got);
    ggml_free(c.ctx);
    return bad;
}

static int run_back(const char * cname, int64_t S, int64_t H_k, int64_t H_v, int64_t n_t, int64_t n_seqs,
                    int64_t n_seqs_k, int kda, int64_t K) {
    struct gdn_case c = make_case(S, H_k, H_v, n_t, n_seqs, n_seqs_k, kda, K);

    // the whole packed gradient of [o | K state slots], state region included
    struct ggml_tensor * grad = ggml_new_tensor_1d(c.ctx, GGML_TYPE_F32, ggml_nelements(c.v) + K*ggml_nelements(c.state));
    fill(grad, -1.0f, 1.0f);
    struct ggml_tensor * gin = ggml_gated_delta_net_back(c.ctx, c.q, c.k, c.v, c.g, c.beta, c.state, grad, K);

    char label[256];
    snprintf(label, sizeof(label), "back %s", cname);
    int bad = 0;
    void * ref = compute_1_to_4_threads(c.ctx, gin, label, &bad);
    // the same bytes as ssmgrad's kernel called directly
    const gdn_params p = params_of(&c);
    float * direct = (float *) malloc(ggml_nbytes(gin));
    GGML_ASSERT(direct);
    void * wbase;
    void * work = aligned_work(gdn_back_work_size(&p, sizeof(float), 1), &wbase);
    gdn_back_f32(&p, (const float *) c.q->data, (const float *) c.k->data, (const float *) c.v->data,
                 (const float *) c.g->data, (const float *) c.beta->data, (const float *) c.state->data,
                 (const float *) grad->data, direct, work, 0, 1);
    free(wbase);
    if (memcmp(ref, direct, ggml_nbytes(gin)) != 0) {
        printf("back %s: differs from gdn_back_f32 called directly\n", cname);
        bad = 1;
    }
    free(direct);
    if (!bad) {
        printf("back %s: %" PRId64 " floats, bitwise identical for n_threads 1, 2, 3, 4 and a direct call\n",
               cname, ggml_nelements(gin));
    }
    memcpy(gin->data, ref, ggml_nbytes(gin));
    free(ref);

    int err = dump(cname, "q", c.q) | dump(cname, "k", c.k) | dump(cname, "v", c.v) | dump(cname, "g", c.g) |
              dump(cname, "beta", c.beta) | dump(cname, "state", c.state) | dump(cname, "grad", grad) |
              dump(cname, "gin", gin);
    dump_param(cname, "K", K);
    ggml_free(c.ctx);
    return err ? 2 : bad;
}

int main(int argc, char ** argv) {
    if (dump_open(argc, argv)) {
        return 2;
    }

    int rc = 0;
    //                               S  H_k H_v n_t seqs seqs_k kda K
    rc |= run_fwd("qwen3next",     128,  2,  4, 80,  2,  2,    0, 1);   // Qwen3-Next's head size, H_v = 2 H_k
    rc |= run_fwd("decode",        128,  2,  4,  1,  3,  3,    0, 1);   // one token
    rc |= run_fwd("decode_kda",     64,  2,  4,  1,  2,  2,    1, 2);   // one token, per-channel gate, K = 2 > n_t
    rc |= run_fwd("kda",            64,  4,  4, 70,  1,  1,    1, 1);   // Kimi-Linear's per-channel gate
    rc |= run_fwd("snapshots",      32,  1,  4, 10,  3,  3,    0, 4);   // K = 4 < n_t, H_v = 4 H_k
    rc |= run_fwd("snapshots_kda",  16,  2,  2,  3,  2,  2,    1, 5);   // K > n_t: slots 3, 4 not written
    rc |= run_fwd("seq_bcast",      16,  2,  4,  9,  4,  2,    1, 2);   // two sequences per key sequence

    rc |= run_back("back_scalar",   16,  2,  4, 70,  2,  2,    0, 1);   // 70 tokens: two 64-token segments
    rc |= run_back("back_kda",       8,  1,  2,  9,  3,  3,    1, 3);   // KDA, K = 3 < n_t
    rc |= run_back("back_bcast",     8,  2,  4,  5,  4,  2,    0, 2);   // sequence and head broadcast

    return check_finish(rc);
}
