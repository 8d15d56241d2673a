// ssm-back-check: runs ggml's SSM_CONV_BACK and SSM_SCAN_BACK on a few shapes with 1, 2, 3 and 4
// threads and checks that every thread count gives the same bytes (ssmgrad's kernels promise
// bitwise-identical results for any nth; this checks it through ggml's thread pool, plan and
// work buffer). With a directory argument it also writes each case's inputs, incoming gradient
// and results as raw float32/int32 files plus a manifest, for tests/ggml/test_ggml.py to compare with
// ssmgrad's Python API and with the float64 torch reference.
//
//   ssm-back-check [DUMP_DIR]      exit 0: all bitwise identical; 1: a mismatch; 2: usage/IO error
//
// Inputs are deterministic (a fixed-seed generator). x, B and C are views of one xBC tensor with
// llama.cpp's Mamba-2 layout, so that their byte strides are not the dense ones; the conv's
// incoming gradient is a view with a padded row stride.

#include "ggml.h"
#include "ggml-cpu.h"

#define CHECK_RNG_SEED 0x9e3779b97f4a7c15ull
#include "check_common.h"

// 0 if every thread count gives the bytes of 1 thread; out is left with the 1-thread result (for the dump)
static int check_threads(const char * cname, const char * what, struct ggml_context * ctx, struct ggml_tensor * out) {
    char label[256];
    snprintf(label, sizeof(label), "%s %s", cname, what);
    int bad = 0;
    void * ref = compute_1_to_4_threads(ctx, out, label, &bad);
    if (!bad) {
        printf("%s: %" PRId64 " floats, bitwise identical for n_threads 1, 2, 3, 4\n", label, ggml_nelements(out));
    }
    memcpy(out->data, ref, ggml_nbytes(out));
    free(ref);
    return bad;
}

static int run_conv(const char * cname, int64_t d_conv, int64_t d_inner, int64_t n_t, int64_t n_s) {
    struct ggml_init_params ip = { 64*1024*1024, NULL, false };
    struct ggml_context * ctx = ggml_init(ip);
    GGML_ASSERT(ctx);

    struct ggml_tensor * sx = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, d_conv - 1 + n_t, d_inner, n_s);
    struct ggml_tensor * c  = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, d_conv, d_inner);
    // the incoming gradient {d_inner, n_t, n_s} as a view with 3 floats of padding per row
    struct ggml_tensor * gbase = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, d_inner + 3, n_t, n_s);
    fill(sx, -1.0f, 1.0f);
    fill(c, -1.0f, 1.0f);
    fill(gbase, -1.0f, 1.0f);
    struct ggml_tensor * grad = ggml_view_3d(ctx, gbase, d_inner, n_t, n_s, gbase->nb[1], gbase->nb[2], 0);

    struct ggml_tensor * d_sx = ggml_ssm_conv_back(ctx, sx, c, grad);
    struct ggml_tensor * d_c  = ggml_ssm_conv_back_weight(ctx, sx, c, grad);

    int bad = check_threads(cname, "d_sx", ctx, d_sx) | check_threads(cname, "d_c", ctx, d_c);
    int err = dump(cname, "sx", sx) | dump(cname, "c", c) | dump(cname, "grad", grad) |
              dump(cname, "d_sx", d_sx) | dump(cname, "d_c", d_c);
    ggml_free(ctx);
    return err ? 2 : bad;
}

static int run_scan(const char * cname, int64_t d_state, int64_t head_dim, int64_t n_head, int64_t n_group,
                    int64_t n_t, int64_t n_seqs, int64_t n_rs, int64_t K, const int32_t * ids_val) {
    struct ggml_init_params ip = { 256*1024*1024, NULL, false };
    struct ggml_context * ctx = ggml_init(ip);
    GGML_ASSERT(ctx);

    const int64_t d_inner = head_dim*n_head;
    const int64_t G       = n_group*d_state;

    struct ggml_tensor * s   = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, d_state, head_dim, n_head, n_rs);
    struct ggml_tensor * dt  = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, n_head, n_t, n_seqs);
    struct ggml_tensor * A   = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, head_dim > 1 ? 1 : d_state, n_head);
    struct ggml_tensor * ids = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n_seqs);
    // llama.cpp's layout: x, B, C are slices of one xBC {d_inner + 2*G, n_t, n_seqs}
    struct ggml_tensor * xbc = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, d_inner + 2*G, n_t, n_seqs);
    fill(s, -1.0f, 1.0f);
    fill(dt, -2.0f, 1.0f);
    fill(A, -1.0f, -0.1f);
    fill(xbc, -1.0f, 1.0f);
    memcpy(ids->data, ids_val, n_seqs*sizeof(int32_t));

    struct ggml_tensor * x = ggml_view_4d(ctx, xbc, head_dim, n_head, n_t, n_seqs,
                                          head_dim*sizeof(float), xbc->nb[1], xbc->nb[2], 0);
    struct ggml_tensor * B = ggml_view_4d(ctx, xbc, d_state, n_group, n_t, n_seqs,
                                          d_state*sizeof(float), xbc->nb[1], xbc->nb[2], d_inner*sizeof(float));
    struct ggml_tensor * C = ggml_view_4d(ctx, xbc, d_state, n_group, n_t, n_seqs,
                                          d_state*sizeof(float), xbc->nb[1], xbc->nb[2], (d_inner + G)*sizeof(float));

    // the whole packed gradient of [y | K state slots], state region included
    struct ggml_tensor * grad = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, ggml_nelements(x) + K*d_state*head_dim*n_head*n_seqs);
    fill(grad, -1.0f, 1.0f);

    struct ggml_tensor * gin = ggml_ssm_scan_back(ctx, s, x, dt, A, B, C, ids, grad, K);

    int bad = check_threads(cname, "gin", ctx, gin);
    int err = dump(cname, "s", s) | dump(cname, "x", x) | dump(cname, "dt", dt) | dump(cname, "A", A) |
              dump(cname, "B", B) | dump(cname, "C", C) | dump(cname, "ids", ids) | dump(cname, "grad", grad) |
              dump(cname, "gin", gin);
    dump_param(cname, "K", K);
    ggml_free(ctx);
    return err ? 2 : bad;
}

int main(int argc, char ** argv) {
    if (dump_open(argc, argv)) {
        return 2;
    }

    const int32_t ids_m1[2]  = { 1, 0 };
    const int32_t ids_dup[4] = { 3, 0, 3, 1 };   // a duplicate; rows 2 and 4 unnamed
    const int32_t ids_k[3]   = { 2, 0, 1 };

    int rc = 0;
    rc |= run_conv("conv",  4, 67, 19, 3);
    rc |= run_conv("conv1", 4, 5, 1, 2);
    rc |= run_scan("mamba1",   16, 1, 48, 1, 20, 2, 2, 1, ids_m1);
    rc |= run_scan("mamba2",   16, 8,  8, 2, 33, 4, 5, 1, ids_dup);
    rc |= run_scan("mamba2_k", 16, 4,  6, 3, 12, 3, 3, 4, ids_k);

    return check_finish(rc);
}
