// GGML_OP_GATED_DELTA_NET_BACK on the CPU: a thin adapter from ggml's tensors to ssmgrad's kernel
// (gdn_back_f32 in ssmgrad.h, compiled into ggml-cpu from ssmgrad's csrc/).
//
// ssmgrad describes every input by its NumPy shape (ggml's ne reversed) and ELEMENT strides; ggml
// has byte strides nb[], which are divided by the element size (no tensor is copied: q, k and v may
// be views with contiguous rows only, as the forward takes them). The head broadcast is ggml's
// tiled one (value head h reads key head h % H_k, GDN_BCAST_TILED), the sequence broadcast the
// forward's (sequence s reads key sequence s / (n_seqs / n_seqs_k)).
//
// One phase: each thread owns whole (key sequence, key head) groups and writes every gradient of
// them, so no barrier and no reduction; the result has the same bytes for any thread count.

#include "gdn-back.h"

#include "ggml-cpu-impl.h"
#include "ggml-impl.h"

#include "ssmgrad.h"

#include <cstdint>

static int64_t gdn_elems(size_t nb) {
    GGML_ASSERT(nb % sizeof(float) == 0);
    return (int64_t) (nb / sizeof(float));
}

// NumPy strides (ne reversed) of a 4-D ggml tensor, in elements
static void gdn_strides(const ggml_tensor * t, int64_t st[4]) {
    for (int i = 0; i < 4; ++i) {
        st[i] = gdn_elems(t->nb[3 - i]);
    }
}

// q, k {S, H_k, n_t, n_seqs_k}, v {S, H_v, n_t, n_seqs}, g {1 or S, H_v, n_t, n_seqs},
// beta {1, H_v, n_t, n_seqs}, state {S, S, H_v, n_seqs}
static gdn_params gdn_params_of(const ggml_tensor * dst) {
    const ggml_tensor * q     = dst->src[0];
    const ggml_tensor * k     = dst->src[1];
    const ggml_tensor * v     = dst->src[2];
    const ggml_tensor * g     = dst->src[3];
    const ggml_tensor * beta  = dst->src[4];
    const ggml_tensor * state = dst->src[5];

    gdn_params p = {};   // form and SIMD choice 0: automatic
    p.n_seqs        = v->ne[3];
    p.n_seqs_k      = q->ne[3];
    p.n_t           = v->ne[2];
    p.H_v           = v->ne[1];
    p.H_k           = q->ne[1];
    p.S             = v->ne[0];
    p.K             = ggml_get_op_params_i32(dst, 0);
    p.g_per_channel = g->ne[0] != 1;
    p.head_bcast    = GDN_BCAST_TILED;
    gdn_strides(q,     p.q_st);
    gdn_strides(k,     p.k_st);
    gdn_strides(v,     p.v_st);
    gdn_strides(g,     p.g_st);
    gdn_strides(beta,  p.beta_st);
    gdn_strides(state, p.state_st);
    return p;
}

size_t ggml_gated_delta_net_back_work_size(const ggml_tensor * node, int n_threads) {
    const gdn_params p = gdn_params_of(node);
    return SSM_WORK_ALIGN + gdn_back_work_size(&p, sizeof(float), n_threads);   // + the alignment of wdata's start
}

void ggml_compute_forward_gated_delta_net_back(const ggml_compute_params * params, ggml_tensor * dst) {
    const ggml_tensor * q     = dst->src[0];
    const ggml_tensor * k     = dst->src[1];
    const ggml_tensor * v     = dst->src[2];
    const ggml_tensor * g     = dst->src[3];
    const ggml_tensor * beta  = dst->src[4];
    const ggml_tensor * state = dst->src[5];
    const ggml_tensor * grad  = dst->src[6];

    for (int i = 0; i < 7; ++i) {
        GGML_ASSERT(dst->src[i]->type == GGML_TYPE_F32);
    }
    GGML_ASSERT(dst->type == GGML_TYPE_F32 && ggml_is_contiguous(dst));
    GGML_ASSERT(ggml_is_contiguous(grad));
    GGML_ASSERT(ggml_nelements(dst) == ggml_nelements(q) + ggml_nelements(k) + ggml_nelements(v) +
                                       ggml_nelements(g) + ggml_nelements(beta) + ggml_nelements(state));

    const gdn_params p = gdn_params_of(dst);

    void * work = (void *) GGML_PAD((uintptr_t) params->wdata, SSM_WORK_ALIGN);
    GGML_ASSERT((char *) work + gdn_back_work_size(&p, sizeof(float), params->nth)
                <= (char *) params->wdata + params->wsize);

    // dst is ssmgrad's gin: [d_q | d_k | d_v | d_g | d_beta | d_state]
    gdn_back_f32(&p, (const float *) q->data, (const float *) k->data, (const float *) v->data,
                 (const float *) g->data, (const float *) beta->data, (const float *) state->data,
                 (const float *) grad->data, (float *) dst->data, work, params->ith, params->nth);
}

bool ggml_cpu_gated_delta_net_back_supports_op(const ggml_tensor * op) {
    if (op->type != GGML_TYPE_F32) {
        return false;
    }
    for (int i = 0; i < GGML_MAX_SRC && op->src[i]; ++i) {
        if (op->src[i]->type != GGML_TYPE_F32) {
            return false;
        }
    }
    return true;
}
