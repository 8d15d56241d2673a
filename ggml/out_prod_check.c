// out-prod-check: ggml's CPU OUT_PROD, the op both gradients of every MUL_MAT are built from (and the input
// gradient through a frozen weight, d_x = OUT_PROD(W, d_y), whatever W's type), checked exactly where
// test-backend-ops' grad mode can only check within its finite-difference error (and cannot at all with a
// quantized weight: it differentiates F32 parameters, and MUL_MAT rounds its input to the weight's vec_dot_type):
//
//   dst[i0, i1, i2, i3] = sum over k of a[i0, k, i2 / (ne2 / a->ne[2]), i3 / (ne3 / a->ne[3])] * b[i1, k, i2, i3]
//
// Every element must equal, bit for bit, a loop written here (no ggml code but a's to_float) that sums the
// terms from 0 in the order of k with one fmaf per term, the arithmetic of ggml's row-by-row loop
// (ggml_vec_mad_f32: one FMA per term, k in order), for n_threads 1, 2, 3, 4; and a float64 loop within 1e-5
// relative to the largest magnitude of the terms. a is F32, or F16, BF16, Q8_0, Q4_0, Q4_K (quantized here with
// ggml_quantize_chunk; the loop reads a's rows converted by the type's to_float). Shapes: columns (ne0) around
// the SIMD widths and the register tile (1 .. 100; the block types' multiples of 32 and 256), rows (ne1) around
// the tile's 6, k around the F32 block of 256 (1, 255, 257, 600) and the 64 rows converted at a time (63, 65,
// 130), b contiguous (a weight's gradient: b = the incoming gradient [n, k]) and b a transposed view (an
// activation's gradient: transpose(grad)), a broadcast over dims 2 and 3 (grouped-query attention; F32
// only: ggml has none for the other types), and the shapes of a 130m model's products at a few tokens.
//
//   out-prod-check      exit 0: every check passed (last line "OK"); 1: a check failed

#include "ggml.h"
#include "ggml-cpu.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static float rng_uniform(float lo, float hi) {
    rng_state = rng_state*6364136223846793005ull + 1442695040888963407ull;
    return lo + (hi - lo)*((float) ((uint32_t) (rng_state >> 32) >> 8)/16777216.0f);
}

static void fill(struct ggml_tensor * t) {
    GGML_ASSERT(ggml_is_contiguous(t) && t->type == GGML_TYPE_F32);
    float * d = (float *) t->data;
    for (int64_t i = 0; i < ggml_nelements(t); ++i) {
        d[i] = rng_uniform(-1.0f, 1.0f);
    }
}

static float get4(const struct ggml_tensor * t, int64_t i0, int64_t i1, int64_t i2, int64_t i3) {
    return *(const float *) ((const char *) t->data + i0*t->nb[0] + i1*t->nb[1] + i2*t->nb[2] + i3*t->nb[3]);
}

// a tensor of type TYPE with ne (ne0, ne1, ne2, ne3), its values drawn as F32 and converted to TYPE; *values:
// the values it holds, as F32 (the type's to_float of each row), contiguous
static struct ggml_tensor * new_a(struct ggml_context * ctx, enum ggml_type type, int64_t ne0, int64_t ne1,
        int64_t ne2, int64_t ne3, float ** values) {
    struct ggml_tensor * a32 = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, ne0, ne1, ne2, ne3);
    fill(a32);
    const int64_t nrows = ne1*ne2*ne3;
    *values = (float *) malloc(sizeof(float)*ne0*nrows);
    GGML_ASSERT(*values);
    if (type == GGML_TYPE_F32) {
        memcpy(*values, a32->data, sizeof(float)*ne0*nrows);
        return a32;
    }
    struct ggml_tensor * a = ggml_new_tensor_4d(ctx, type, ne0, ne1, ne2, ne3);
    GGML_ASSERT(ggml_quantize_chunk(type, (const float *) a32->data, a->data, 0, nrows, ne0, NULL) == ggml_nbytes(a));
    for (int64_t r = 0; r < nrows; ++r) {
        ggml_get_type_traits(type)->to_float((const char *) a->data + r*a->nb[1], *values + r*ne0, ne0);
    }
    return a;
}

// ne0 columns, ne1 rows, k terms; (ne2, ne3) batches of b and dst, a has (ne2 / r2, ne3 / r3); b_trans: b is
// the transpose of a contiguous [k, ne1] tensor
static int run(enum ggml_type type, int64_t ne0, int64_t ne1, int64_t k, int64_t ne2, int64_t ne3, int64_t r2, int64_t r3,
        int b_trans) {
    // the tensors (a drawn in F32 too), and the work buffer of up to 4 threads (64 rows of a in F32 each)
    const size_t need = (size_t) 4*(2*ne0*k*ne2*ne3 + ne1*k*ne2*ne3 + ne0*ne1*ne2*ne3) + 4*4*(64*ne0 + 64) +
                        64*ggml_tensor_overhead() +
                        ggml_graph_overhead() + (1u << 20);
    struct ggml_init_params ip = { need, NULL, false };
    struct ggml_context * ctx = ggml_init(ip);
    GGML_ASSERT(ctx);

    float * av = NULL;
    struct ggml_tensor * a = new_a(ctx, type, ne0, k, ne2/r2, ne3/r3, &av);
    struct ggml_tensor * b;
    if (b_trans) {
        struct ggml_tensor * bt = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, k, ne1, ne2, ne3);
        fill(bt);
        b = ggml_transpose(ctx, bt);
    } else {
        b = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, ne1, k, ne2, ne3);
        fill(b);
    }
    struct ggml_tensor * out = ggml_out_prod(ctx, a, b);
    struct ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, out);

    const int64_t n = ne0*ne1*ne2*ne3;
    float  * ref = (float  *) malloc(sizeof(float)*n);
    double * r64 = (double *) malloc(sizeof(double)*n);
    float  * first = (float *) malloc(sizeof(float)*n);
    GGML_ASSERT(ref && r64 && first);
    double scale = 0.0;
    for (int64_t i3 = 0; i3 < ne3; ++i3) {
        for (int64_t i2 = 0; i2 < ne2; ++i2) {
            for (int64_t i1 = 0; i1 < ne1; ++i1) {
                for (int64_t i0 = 0; i0 < ne0; ++i0) {
                    float acc = 0.0f;
                    double acc64 = 0.0;
                    for (int64_t kk = 0; kk < k; ++kk) {
                        const float x = av[(((i3/r3)*(ne2/r2) + i2/r2)*k + kk)*ne0 + i0];
                        const float y = get4(b, i1, kk, i2, i3);
                        acc = fmaf(x, y, acc);
                        acc64 += (double) x*(double) y;
                        scale = fmax(scale, fabs((double) x*(double) y));
                    }
                    const int64_t i = ((i3*ne2 + i2)*ne1 + i1)*ne0 + i0;
                    ref[i] = acc;
                    r64[i] = acc64;
                }
            }
        }
    }

    int bad = 0;
    for (int nth = 1; nth <= 4 && !bad; ++nth) {
        memset(out->data, 0xff, ggml_nbytes(out));      // NaNs: an element never written shows
        GGML_ASSERT(ggml_graph_compute_with_ctx(ctx, gf, nth) == GGML_STATUS_SUCCESS);
        for (int64_t i3 = 0; i3 < ne3 && !bad; ++i3) {
            for (int64_t i2 = 0; i2 < ne2 && !bad; ++i2) {
                for (int64_t i1 = 0; i1 < ne1 && !bad; ++i1) {
                    for (int64_t i0 = 0; i0 < ne0; ++i0) {
                        const int64_t i = ((i3*ne2 + i2)*ne1 + i1)*ne0 + i0;
                        const float got = get4(out, i0, i1, i2, i3);
                        if (memcmp(&got, &ref[i], sizeof(float)) != 0 || fabs(got - r64[i]) > 1e-5*fmax(scale, 1e-30)*k) {
                            printf("FAIL %s ne0=%lld ne1=%lld k=%lld ne2=%lld ne3=%lld r2=%lld r3=%lld b_trans=%d threads=%d: "
                                   "dst[%lld,%lld,%lld,%lld] = %a, fmaf chain %a, float64 %.9g\n",
                                   ggml_type_name(type), (long long) ne0, (long long) ne1, (long long) k, (long long) ne2, (long long) ne3,
                                   (long long) r2, (long long) r3, b_trans, nth, (long long) i0, (long long) i1,
                                   (long long) i2, (long long) i3, got, ref[i], r64[i]);
                            bad = 1;
                            break;
                        }
                        if (nth == 1) {
                            first[i] = got;
                        }
                    }
                }
            }
        }
    }
    if (!bad) {
        printf("ok %s ne0=%lld ne1=%lld k=%lld ne2=%lld ne3=%lld r2=%lld r3=%lld b_trans=%d\n", ggml_type_name(type),
               (long long) ne0,
               (long long) ne1, (long long) k, (long long) ne2, (long long) ne3, (long long) r2, (long long) r3, b_trans);
    }
    free(av);
    free(ref);
    free(r64);
    free(first);
    ggml_free(ctx);
    return bad;
}

int main(void) {
    int bad = 0, cases = 0;
    static const int64_t cols[] = { 1, 7, 8, 9, 16, 17, 33, 47, 100 };
    static const int64_t rows[] = { 1, 6, 7, 13 };
    static const int64_t ks[]   = { 1, 255, 257, 600 };
    for (size_t c = 0; c < sizeof(cols)/sizeof(cols[0]); ++c) {
        for (size_t r = 0; r < sizeof(rows)/sizeof(rows[0]); ++r) {
            for (size_t q = 0; q < sizeof(ks)/sizeof(ks[0]); ++q) {
                for (int t = 0; t < 2; ++t) {
                    bad |= run(GGML_TYPE_F32, cols[c], rows[r], ks[q], 1, 1, 1, 1, t);
                    cases++;
                }
            }
        }
    }
    // batches, a broadcast over them (grouped-query attention)
    bad |= run(GGML_TYPE_F32, 33, 7, 20, 4, 3, 2, 3, 0); cases++;
    bad |= run(GGML_TYPE_F32, 40, 13, 9, 6, 2, 3, 1, 1); cases++;
    bad |= run(GGML_TYPE_F32, 16, 6, 300, 2, 2, 1, 1, 0); cases++;
    // a 130m model's products at 16 tokens: a weight's gradient [768, 1536] and an activation's [768, 16]
    bad |= run(GGML_TYPE_F32, 768, 1536, 16, 1, 1, 1, 1, 0); cases++;
    bad |= run(GGML_TYPE_F32, 768, 16, 1536, 1, 1, 1, 1, 1); cases++;

    // a of the types a frozen base comes in: their columns in whole blocks
    static const struct { enum ggml_type type; int64_t cols[2]; } types[] = {
        { GGML_TYPE_F16,  { 7, 100 } },
        { GGML_TYPE_BF16, { 9, 100 } },
        { GGML_TYPE_Q8_0, { 96, 0 } },
        { GGML_TYPE_Q4_0, { 160, 0 } },
        { GGML_TYPE_Q4_K, { 256, 0 } },
    };
    static const int64_t rq[] = { 1, 13 };
    static const int64_t kq[] = { 63, 65, 130 };
    for (size_t ti = 0; ti < sizeof(types)/sizeof(types[0]); ++ti) {
        for (int c = 0; c < 2 && types[ti].cols[c]; ++c) {
            for (size_t r = 0; r < sizeof(rq)/sizeof(rq[0]); ++r) {
                for (size_t q = 0; q < sizeof(kq)/sizeof(kq[0]); ++q) {
                    for (int t = 0; t < 2; ++t) {
                        bad |= run(types[ti].type, types[ti].cols[c], rq[r], kq[q], 1, 1, 1, 1, t);
                        cases++;
                    }
                }
            }
        }
        // batches (no broadcast)
        bad |= run(types[ti].type, types[ti].type == GGML_TYPE_Q4_K ? 256 : 64, 7, 70, 3, 2, 1, 1, 1); cases++;
    }
    // the input gradient through a 130m model's in_proj [768, 3072] at 16 tokens, in Q8_0
    bad |= run(GGML_TYPE_Q8_0, 768, 16, 3072, 1, 1, 1, 1, 1); cases++;
    printf("%d cases\n", cases);
    printf(bad ? "FAIL\n" : "OK\n");
    return bad ? 1 : 0;
}
