/*
 * gdn_grads.h -- the six regions of the delta-rule backward's packed result
 * [d_q | d_k | d_v | d_g | d_beta | d_state], typed: shared by both forms' bodies
 * (gdn_recurrence_body.h, gdn_chunked_body.h). Needs `real` (ssm_real_f32.h / ssm_real_f64.h) first.
 */
#ifndef GDN_GRADS_H
#define GDN_GRADS_H

#include "gdn_common.h"

typedef struct {
    real * dq, * dk, * dv, * dg, * dbeta, * dstate;
} gdn_grads;

static inline void gdn_grads_of(const gdn_params * p, real * gin, gdn_grads * gr) {
    const int64_t n_qk = p->n_seqs_k * p->n_t * p->H_k * p->S, n_v = p->n_seqs * p->n_t * p->H_v;
    gr->dq = gin;
    gr->dk = gr->dq + n_qk;
    gr->dv = gr->dk + n_qk;
    gr->dg = gr->dv + n_v * p->S;
    gr->dbeta = gr->dg + n_v * (p->g_per_channel ? p->S : 1);
    gr->dstate = gr->dbeta + n_v;
}

#endif
