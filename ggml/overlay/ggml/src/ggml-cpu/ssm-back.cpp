// GGML_OP_SSM_CONV_BACK and GGML_OP_SSM_SCAN_BACK on the CPU: thin adapters from ggml's tensors
// to ssmgrad's kernels (ssmgrad.h, compiled into ggml-cpu from ssmgrad's csrc/).
//
// ssmgrad describes every input by its NumPy shape (ggml's ne reversed) and ELEMENT strides;
// ggml has byte strides nb[] and int32 ids. The strides are divided by the element size (never a
// copy of a tensor); the ids are widened into the work buffer, one copy per thread, so that no
// thread waits for another before phase 1.

#include "ssm-back.h"

#include "ggml-cpu-impl.h"
#include "ggml-impl.h"

#include "ssmgrad.h"

#include <cstdint>

static int64_t ssm_elems(size_t nb) {
    GGML_ASSERT(nb % sizeof(float) == 0);
    return (int64_t) (nb / sizeof(float));
}

// ggml_compute_forward_ssm_conv_back

// sx {d_conv - 1 + n_t, d_inner, n_s}, c {d_conv, d_inner}, grad {d_inner, n_t, n_s}
// (NumPy: sx (n_s, d_inner, d_conv - 1 + n_t), c (d_inner, d_conv), grad (n_s, n_t, d_inner))
static ssm_conv_params ssm_conv_params_of(const ggml_tensor * dst) {
    const ggml_tensor * sx   = dst->src[0];
    const ggml_tensor * c    = dst->src[1];
    const ggml_tensor * grad = dst->src[2];

    ssm_conv_params p = {};   // the form and SIMD choice 0: automatic (by shape, the best this CPU runs)
    p.n_s      = sx->ne[2];
    p.d_inner  = sx->ne[1];
    p.d_conv   = c->ne[0];
    p.n_t      = sx->ne[0] - c->ne[0] + 1;
    p.sx_st[0] = ssm_elems(sx->nb[2]);
    p.sx_st[1] = ssm_elems(sx->nb[1]);
    p.sx_st[2] = ssm_elems(sx->nb[0]);
    p.c_st[0]  = ssm_elems(c->nb[1]);
    p.c_st[1]  = ssm_elems(c->nb[0]);
    p.g_st[0]  = ssm_elems(grad->nb[2]);
    p.g_st[1]  = ssm_elems(grad->nb[1]);
    p.g_st[2]  = ssm_elems(grad->nb[0]);
    return p;
}

void ggml_compute_forward_ssm_conv_back(const ggml_compute_params * params, ggml_tensor * dst) {
    const ggml_tensor * sx   = dst->src[0];
    const ggml_tensor * c    = dst->src[1];
    const ggml_tensor * grad = dst->src[2];

    GGML_ASSERT(sx->type == GGML_TYPE_F32 && c->type == GGML_TYPE_F32 && grad->type == GGML_TYPE_F32);
    GGML_ASSERT(dst->type == GGML_TYPE_F32 && ggml_is_contiguous(dst));

    const ssm_conv_params p = ssm_conv_params_of(dst);

    // scratch of the kernels (the token-major tiles of the AVX-512 path), planned by ggml_graph_plan
    void * work = NULL;
    const size_t wsize = ssm_conv_work_size(&p, sizeof(float), params->nth);
    if (wsize > 0) {
        work = (void *) GGML_PAD((uintptr_t) params->wdata, SSM_WORK_ALIGN);
        GGML_ASSERT((char *) work + wsize <= (char *) params->wdata + params->wsize);
    }

    // op param 0: 0 = d_sx (dst shaped like sx), 1 = d_c (dst shaped like c)
    // each thread owns a slice of the channels: no barrier, and the same bytes for any nth
    switch (ggml_get_op_params_i32(dst, 0)) {
        case 0:
            ssm_conv_back_f32(&p, (const float *) c->data, (const float *) grad->data,
                              (float *) dst->data, work, params->ith, params->nth);
            break;
        case 1:
            ssm_conv_back_weight_f32(&p, (const float *) sx->data, (const float *) grad->data,
                                     (float *) dst->data, work, params->ith, params->nth);
            break;
        default:
            GGML_ABORT("fatal error");
    }
}

size_t ggml_ssm_conv_back_work_size(const ggml_tensor * node, int n_threads) {
    const ssm_conv_params p = ssm_conv_params_of(node);
    const size_t size = ssm_conv_work_size(&p, sizeof(float), n_threads);
    return size > 0 ? SSM_WORK_ALIGN + size : 0;   // + the alignment of wdata's start
}

// ggml_compute_forward_ssm_scan_back

// s {d_state, head_dim, n_head, n_rs}, x {head_dim, n_head, n_t, n_seqs}, dt {n_head, n_t, n_seqs},
// A {d_state or 1, n_head}, B and C {d_state, n_group, n_t, n_seqs}, ids {n_seqs}
static ssm_scan_params ssm_scan_params_of(const ggml_tensor * dst) {
    const ggml_tensor * s  = dst->src[0];
    const ggml_tensor * x  = dst->src[1];
    const ggml_tensor * dt = dst->src[2];
    const ggml_tensor * A  = dst->src[3];
    const ggml_tensor * B  = dst->src[4];
    const ggml_tensor * C  = dst->src[5];

    ssm_scan_params p = {};   // fwd_form, back_form, simd 0: automatic
    p.n_rs        = s->ne[3];
    p.n_head      = x->ne[1];
    p.head_dim    = x->ne[0];
    p.d_state     = s->ne[0];
    p.n_group     = B->ne[1];
    p.n_t         = x->ne[2];
    p.n_seqs      = x->ne[3];
    p.a_per_state = A->ne[0] != 1;
    p.K           = ggml_get_op_params_i32(dst, 0);
    for (int i = 0; i < 4; ++i) {
        p.s_st[i] = ssm_elems(s->nb[3 - i]);
        p.x_st[i] = ssm_elems(x->nb[3 - i]);
        p.B_st[i] = ssm_elems(B->nb[3 - i]);
        p.C_st[i] = ssm_elems(C->nb[3 - i]);
    }
    for (int i = 0; i < 3; ++i) {
        p.dt_st[i] = ssm_elems(dt->nb[2 - i]);
    }
    for (int i = 0; i < 2; ++i) {
        p.A_st[i] = ssm_elems(A->nb[1 - i]);
    }
    return p;
}

// work buffer: [ids as int64, one copy per thread | ssmgrad's scratch], each part SSM_WORK_ALIGN-aligned
static size_t ssm_ids_bytes(int64_t n_seqs) {
    return GGML_PAD((size_t) n_seqs * sizeof(int64_t), SSM_WORK_ALIGN);
}

size_t ggml_ssm_scan_back_work_size(const ggml_tensor * node, int n_threads) {
    const ssm_scan_params p = ssm_scan_params_of(node);
    return SSM_WORK_ALIGN                                  // to align the start of wdata
         + (size_t) n_threads * ssm_ids_bytes(p.n_seqs)
         + ssm_scan_back_work_size(&p, sizeof(float), n_threads);
}

void ggml_compute_forward_ssm_scan_back(const ggml_compute_params * params, ggml_tensor * dst) {
    const ggml_tensor * s    = dst->src[0];
    const ggml_tensor * x    = dst->src[1];
    const ggml_tensor * dt   = dst->src[2];
    const ggml_tensor * A    = dst->src[3];
    const ggml_tensor * B    = dst->src[4];
    const ggml_tensor * C    = dst->src[5];
    const ggml_tensor * ids  = dst->src[6];
    const ggml_tensor * grad = dst->src[7];

    for (int i = 0; i < 8; ++i) {
        GGML_ASSERT(dst->src[i]->type == (i == 6 ? GGML_TYPE_I32 : GGML_TYPE_F32));
    }
    GGML_ASSERT(dst->type == GGML_TYPE_F32 && ggml_is_contiguous(dst));
    GGML_ASSERT(ggml_is_contiguous(grad));
    GGML_ASSERT(ids->nb[0] == sizeof(int32_t));

    const int ith = params->ith;
    const int nth = params->nth;

    const ssm_scan_params p = ssm_scan_params_of(dst);

    char * wbase = (char *) GGML_PAD((uintptr_t) params->wdata, SSM_WORK_ALIGN);
    const size_t ids_bytes = ssm_ids_bytes(p.n_seqs);
    void * work = wbase + (size_t) nth * ids_bytes;
    GGML_ASSERT(wbase + (size_t) nth * ids_bytes + ssm_scan_back_work_size(&p, sizeof(float), nth)
                <= (char *) params->wdata + params->wsize);

    int64_t * ids64 = (int64_t *) (wbase + (size_t) ith * ids_bytes);
    const int32_t * ids32 = (const int32_t *) ids->data;
    for (int64_t q = 0; q < p.n_seqs; ++q) {
        GGML_ASSERT(ids32[q] >= 0 && ids32[q] < p.n_rs);
        ids64[q] = ids32[q];
    }

    // [d_s | d_x | d_dt | d_B | d_C] is ssmgrad's gin; d_A follows it
    float * gin = (float *) dst->data;
    float * d_A = gin + ggml_nelements(s) + ggml_nelements(x) + ggml_nelements(dt) +
                        ggml_nelements(B) + ggml_nelements(C);
    GGML_ASSERT(d_A + ggml_nelements(A) == gin + ggml_nelements(dst));

    // phase 1: the reverse recurrence (d_x, d_dt, partial sums in work)
    ssm_scan_back_f32(&p, (const float *) s->data, (const float *) x->data, (const float *) dt->data,
                      (const float *) A->data, (const float *) B->data, (const float *) C->data,
                      ids64, (const float *) grad->data, gin, work, ith, nth);

    ggml_barrier(params->threadpool);

    // phase 2: fixed-order reductions into d_s, d_B, d_C, d_A
    ssm_scan_back_reduce_f32(&p, ids64, gin, d_A, work, ith, nth);
}

bool ggml_cpu_ssm_back_supports_op(const ggml_tensor * op) {
    if (op->type != GGML_TYPE_F32) {
        return false;
    }
    for (int i = 0; i < GGML_MAX_SRC && op->src[i]; ++i) {
        const bool is_ids = op->op == GGML_OP_SSM_SCAN_BACK && i == 6;
        if (op->src[i]->type != (is_ids ? GGML_TYPE_I32 : GGML_TYPE_F32)) {
            return false;
        }
    }
    return true;
}
