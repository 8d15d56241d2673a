// moe-back-check: the backward of MUL_MAT_ID and CLAMP through ggml's own autodiff
// (ggml_build_backward_expand) on the CPU, checked directly where test-backend-ops' finite differences
// cannot be exact:
//
// - MUL_MAT_ID: loss = sum(w * mul_mat_id(as, b, ids)) with random weights w (so the incoming gradient is
//   not all ones). The gradient of every expert that no token picks is exactly 0 (all bytes zero); the
//   gradients of as and b equal a float64 loop written here (no ggml code) within 1e-5 relative to the
//   largest element; they are bitwise identical for n_threads 1, 2, 3, 4. Shapes: several experts per
//   token, b broadcast and not, a token naming one expert twice, rows longer than OUT_PROD_ID's tile.
// - CLAMP: loss = sum(w * clamp(x, min, max)) at the edges (x == min, x == max), next to them, inside,
//   outside, +-inf, with min > max; one line per element "CLAMP min max x grad" (%a, exact) for
//   tests/ggml/test_ggml.py to compare with torch.clamp's gradient; NaN inputs are left out (see the README).
//
//   moe-back-check      exit 0: every check passed (last line "OK"); 1: a check failed

#include "ggml.h"
#include "ggml-cpu.h"

#include <inttypes.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint64_t rng_state = 0x2545f4914f6cdd1dull;

// 31 random bits (the generator's high ones)
static uint32_t rng_u32(void) {
    rng_state = rng_state*6364136223846793005ull + 1442695040888963407ull;
    return (uint32_t) (rng_state >> 33);
}

// uniform in [lo, hi): 24 of the 31 bits
static float rng_uniform(float lo, float hi) {
    return lo + (hi - lo)*((float) (rng_u32() >> 7)/16777216.0f);
}

static void fill(struct ggml_tensor * t, float lo, float hi) {
    GGML_ASSERT(ggml_is_contiguous(t) && t->type == GGML_TYPE_F32);
    float * d = (float *) t->data;
    for (int64_t i = 0; i < ggml_nelements(t); ++i) {
        d[i] = rng_uniform(lo, hi);
    }
}

// the forward graph of loss (a scalar, marked as the loss) into *gf, with its backward into *gb
static void loss_graphs(struct ggml_context * ctx, struct ggml_tensor * loss, struct ggml_cgraph ** gf,
                        struct ggml_cgraph ** gb) {
    ggml_set_loss(loss);
    *gf = ggml_new_graph_custom(ctx, GGML_DEFAULT_GRAPH_SIZE, true);
    ggml_build_forward_expand(*gf, loss);
    *gb = ggml_graph_dup(ctx, *gf, true);
    ggml_build_backward_expand(ctx, *gb, NULL);
}

// computes the backward graph with n_threads; the gradients of the parameters are read by the caller
static void compute(struct ggml_context * ctx, struct ggml_cgraph * gf, struct ggml_cgraph * gb, int n_threads) {
    ggml_graph_reset(gb);
    GGML_ASSERT(ggml_graph_compute_with_ctx(ctx, gf, n_threads) == GGML_STATUS_SUCCESS);
    GGML_ASSERT(ggml_graph_compute_with_ctx(ctx, gb, n_threads) == GGML_STATUS_SUCCESS);
}

// ids: per token, n_used distinct experts drawn from those not in unpicked (dup: on even tokens the
// last one repeats the first)
static void moe_ids(struct ggml_tensor * ids, int64_t n_as, const int32_t * unpicked, int n_unpicked, int dup) {
    const int64_t n_used = ids->ne[0], n_t = ids->ne[1];
    int32_t * picked = (int32_t *) malloc(n_as*sizeof(int32_t));
    GGML_ASSERT(picked);
    int n_picked = 0;
    for (int32_t i = 0; i < n_as; ++i) {
        int skip = 0;
        for (int u = 0; u < n_unpicked; ++u) {
            skip |= unpicked[u] == i;
        }
        if (!skip) {
            picked[n_picked++] = i;
        }
    }
    GGML_ASSERT(n_used <= n_picked);
    int32_t * idv = (int32_t *) ids->data;
    for (int64_t t = 0; t < n_t; ++t) {
        for (int i = n_picked - 1; i > 0; --i) { // Fisher-Yates
            const int j = (int) (rng_u32() % (uint32_t) (i + 1));
            const int32_t tmp = picked[i]; picked[i] = picked[j]; picked[j] = tmp;
        }
        for (int64_t e = 0; e < n_used; ++e) {
            idv[t*n_used + e] = picked[e];
        }
        if (dup && n_used > 1 && t % 2 == 0) {
            idv[t*n_used + n_used - 1] = idv[t*n_used];
        }
    }
    free(picked);
}

// 0 when d_as and d_b are bitwise the same for 1..4 threads; leaves the 1-thread gradients
static int moe_threads_agree(const char * cname, struct ggml_context * ctx, struct ggml_cgraph * gf,
                             struct ggml_cgraph * gb, const struct ggml_tensor * d_as, const struct ggml_tensor * d_b) {
    int bad = 0;
    compute(ctx, gf, gb, 1);
    float * ref_as = (float *) malloc(ggml_nbytes(d_as));
    float * ref_b  = (float *) malloc(ggml_nbytes(d_b));
    GGML_ASSERT(ref_as && ref_b);
    memcpy(ref_as, d_as->data, ggml_nbytes(d_as));
    memcpy(ref_b, d_b->data, ggml_nbytes(d_b));
    for (int nth = 2; nth <= 4; ++nth) {
        compute(ctx, gf, gb, nth);
        if (memcmp(ref_as, d_as->data, ggml_nbytes(d_as)) != 0 || memcmp(ref_b, d_b->data, ggml_nbytes(d_b)) != 0) {
            printf("%s: n_threads %d gives other bytes than 1\n", cname, nth);
            bad = 1;
        }
    }
    compute(ctx, gf, gb, 1);
    free(ref_as);
    free(ref_b);
    return bad;
}

// 0 when the gradient of every unpicked expert is all zero bytes
static int moe_unpicked_zero(const char * cname, const struct ggml_tensor * d_as, const int32_t * unpicked,
                             int n_unpicked) {
    int bad = 0;
    for (int u = 0; u < n_unpicked; ++u) {
        const unsigned char * p = (const unsigned char *) d_as->data + unpicked[u]*d_as->nb[2];
        for (size_t i = 0; i < d_as->nb[2]; ++i) {
            if (p[i] != 0) {
                printf("%s: the gradient of expert %d, which no token picks, is not 0 (byte %zu)\n", cname, unpicked[u], i);
                bad = 1;
                break;
            }
        }
    }
    return bad;
}

// 0 when d_as and d_b equal a float64 loop within 1e-5 of their largest element:
// out[r, e, t] = sum_j as[j, r, ids[e, t]] b[j, e % n_b, t]; d_out = w
static int moe_against_f64(const char * cname, const struct ggml_tensor * as, const struct ggml_tensor * b,
                           const struct ggml_tensor * ids, const struct ggml_tensor * w,
                           const struct ggml_tensor * d_as, const struct ggml_tensor * d_b) {
    const int64_t k = as->ne[0], m = as->ne[1], n_b = b->ne[1], n_used = ids->ne[0], n_t = ids->ne[1];
    double * gas = (double *) calloc(ggml_nelements(as), sizeof(double));
    double * gbb = (double *) calloc(ggml_nelements(b), sizeof(double));
    GGML_ASSERT(gas && gbb);
    const float * asv = (const float *) as->data;
    const float * bv  = (const float *) b->data;
    const float * wv  = (const float *) w->data;
    const int32_t * idv = (const int32_t *) ids->data;
    for (int64_t t = 0; t < n_t; ++t) {
        for (int64_t e = 0; e < n_used; ++e) {
            const int64_t x = idv[t*n_used + e];
            const int64_t jb = e % n_b;
            for (int64_t r = 0; r < m; ++r) {
                const double g = wv[(t*n_used + e)*m + r];
                for (int64_t j = 0; j < k; ++j) {
                    gas[(x*m + r)*k + j] += g*bv[(t*n_b + jb)*k + j];
                    gbb[(t*n_b + jb)*k + j] += g*asv[(x*m + r)*k + j];
                }
            }
        }
    }
    const struct { const char * name; const float * got; const double * want; int64_t n; } cmp[2] = {
        { "d_as", (const float *) d_as->data, gas, ggml_nelements(as) },
        { "d_b",  (const float *) d_b->data,  gbb, ggml_nelements(b)  },
    };
    int bad = 0;
    for (int c = 0; c < 2; ++c) {
        double scale = 0.0;
        double err   = 0.0;
        for (int64_t i = 0; i < cmp[c].n; ++i) {
            scale = fmax(scale, fabs(cmp[c].want[i]));
            err   = fmax(err, fabs(cmp[c].got[i] - cmp[c].want[i]));
        }
        const double rel = err/fmax(scale, 1e-30);
        // float32 sums of at most n_t*n_used (d_as) or m*n_used (d_b) products: measured below 3e-7
        if (!(rel <= 1e-5)) {
            printf("%s: %s differs from the float64 loop: max abs %.3g, largest element %.3g\n", cname, cmp[c].name, err, scale);
            bad = 1;
        } else {
            printf("%s: %s max error %.2e relative to its largest element\n", cname, cmp[c].name, rel);
        }
    }
    free(gas);
    free(gbb);
    return bad;
}

// unpicked: n_unpicked distinct expert numbers that no token names
static int run_moe(const char * cname, int64_t n_as, int64_t n_used, int64_t n_b, int64_t k, int64_t m, int64_t n_t,
                   const int32_t * unpicked, int n_unpicked, int dup) {
    struct ggml_init_params ip = { 256*1024*1024, NULL, false };
    struct ggml_context * ctx = ggml_init(ip);
    GGML_ASSERT(ctx);

    struct ggml_tensor * as  = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, k, m, n_as);
    struct ggml_tensor * b   = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, k, n_b, n_t);
    struct ggml_tensor * ids = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, n_used, n_t);
    struct ggml_tensor * w   = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, m, n_used, n_t);
    fill(as, -1.0f, 1.0f);
    fill(b, -1.0f, 1.0f);
    fill(w, -1.0f, 1.0f);
    moe_ids(ids, n_as, unpicked, n_unpicked, dup);

    ggml_set_param(as);
    ggml_set_param(b);
    struct ggml_tensor * loss = ggml_sum(ctx, ggml_mul(ctx, ggml_mul_mat_id(ctx, as, b, ids), w));
    struct ggml_cgraph * gf, * gb;
    loss_graphs(ctx, loss, &gf, &gb);

    struct ggml_tensor * d_as = ggml_graph_get_grad(gb, as);
    struct ggml_tensor * d_b  = ggml_graph_get_grad(gb, b);
    GGML_ASSERT(d_as && d_b && ggml_is_contiguous(d_as) && ggml_is_contiguous(d_b));

    int bad = moe_threads_agree(cname, ctx, gf, gb, d_as, d_b);
    bad |= moe_unpicked_zero(cname, d_as, unpicked, n_unpicked);
    bad |= moe_against_f64(cname, as, b, ids, w, d_as, d_b);
    ggml_free(ctx);

    if (!bad) {
        printf("%s: n_as %" PRId64 " n_used %" PRId64 " n_b %" PRId64 " k %" PRId64 " m %" PRId64 " n_t %" PRId64
               " unpicked %d dup %d: OK\n", cname, n_as, n_used, n_b, k, m, n_t, n_unpicked, dup);
    }
    return bad;
}

static int run_clamp(float min, float max) {
    const float vals[] = {
        min, max, nextafterf(min, -INFINITY), nextafterf(min, INFINITY), nextafterf(max, -INFINITY),
        nextafterf(max, INFINITY), 0.5f*(min + max), min - 1.0f, max + 1.0f, -INFINITY, INFINITY, 0.0f,
    };
    const int n = (int) (sizeof(vals)/sizeof(vals[0]));

    struct ggml_init_params ip = { 16*1024*1024, NULL, false };
    struct ggml_context * ctx = ggml_init(ip);
    GGML_ASSERT(ctx);
    struct ggml_tensor * x = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, n);
    struct ggml_tensor * w = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, n);
    memcpy(x->data, vals, sizeof(vals));
    for (int i = 0; i < n; ++i) {
        ((float *) w->data)[i] = 0.25f + 0.125f*i; // exact in float
    }
    ggml_set_param(x);
    struct ggml_tensor * loss = ggml_sum(ctx, ggml_mul(ctx, ggml_clamp(ctx, x, min, max), w));
    struct ggml_cgraph * gf, * gb;
    loss_graphs(ctx, loss, &gf, &gb);
    compute(ctx, gf, gb, 1);

    const float * g = (const float *) ggml_graph_get_grad(gb, x)->data;
    for (int i = 0; i < n; ++i) {
        printf("CLAMP %a %a %a %a %a\n", (double) min, (double) max, (double) vals[i], (double) ((float *) w->data)[i], (double) g[i]);
    }
    ggml_free(ctx);
    return 0;
}

int main(void) {
    int bad = 0;
    const int32_t u1[] = { 1, 5 };
    const int32_t u2[] = { 0 };
    const int32_t u3[] = { 3 };
    const int32_t u4[] = { 2, 4, 6 };
    bad |= run_moe("moe_bcast",   8, 2, 1, 16, 12, 7, u1, 2, 0);   // b broadcast, two experts per token
    bad |= run_moe("moe_full",    6, 4, 4, 33,  9, 5, u2, 1, 0);   // four experts per token, b not broadcast
    bad |= run_moe("moe_pairs",   8, 4, 2, 10,  7, 6, u4, 3, 0);   // b rows shared by pairs of experts
    bad |= run_moe("moe_dup",     4, 3, 3,  8,  5, 6, u3, 1, 1);   // a token naming one expert twice
    bad |= run_moe("moe_tiles",   5, 2, 1, 3000, 23, 4, u3, 1, 0); // rows longer than a tile of OUT_PROD_ID

    bad |= run_clamp(-0.5f, 0.5f);
    bad |= run_clamp(6.103515625e-5f, INFINITY); // a router's weight-sum clamp
    bad |= run_clamp(0.25f, 0.25f);              // min == max
    bad |= run_clamp(0.4f, -0.4f);               // min > max: the result is min everywhere

    printf(bad ? "FAIL\n" : "OK\n");
    return bad ? 1 : 0;
}
