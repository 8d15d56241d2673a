/*
 * gdn_grads.h -- what the delta-rule backward of every form shares, typed: the six regions of its packed
 * result [d_q | d_k | d_v | d_g | d_beta | d_state], and its driver (the thread split over key groups and
 * the loop over each group's value heads: gdn_back_split, gdn_back_groups). Used by the backward bodies
 * gdn_back_recurrence_body.h, gdn_back_chunked_body.h and gdn_kda_chunked_body.h. Needs `real`
 * (ssm_real_f32.h / ssm_real_f64.h) first.
 */
#ifndef GDN_GRADS_H
#define GDN_GRADS_H

#include <string.h>

#include "ssm_common.h"
#include "gdn_common.h"
#include "gdn_dot.h"   /* gdn_dot: the chunked backwards' row sums */

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

/* d[i] += s[i] and d[i] = s[i], i < n, through the mutant `mut`: rows of the packed gradient from a form's
 * scratch (restrict parameters: the loops vectorize, where restrict pointers declared in a loop body did
 * not, GCC failing the dependence analysis on rows of the one result array) */
static inline void gdn_add_row(real * restrict d, const real * restrict s, int64_t n, int mut) {
    (void) mut;
    for (int64_t i = 0; i < n; ++i) d[i] += SSM_MUTANT(mut, s[i]);
}
static inline void gdn_put_row(real * restrict d, const real * restrict s, int64_t n, int mut) {
    (void) mut;
    for (int64_t i = 0; i < n; ++i) d[i] = SSM_MUTANT(mut, s[i]);
}

/* The backward's thread split, the same in every form: the key groups u = nk * H_k + kh (key sequence nk,
 * key head kh) go to the threads in contiguous ranges; thread ith takes [*lo, *hi). A thread owns every
 * gradient its groups produce: their d_q, d_k rows and the d_v, d_g, d_beta, d_state of every value
 * (sequence, head) reading them, so no element has two writers. */
static inline void gdn_back_split(const gdn_params * p, int ith, int nth, int64_t * lo, int64_t * hi) {
    ssm_split(p->n_seqs_k * p->H_k, ith, nth, lo, hi);
}

/* What the driver hands a form's backward of one value (sequence, head): the call's arguments, the
 * form's typed inputs (gdn_inputs, gdnc_inputs, gdnk_inputs) and the thread's carved scratch. */
typedef struct {
    const gdn_params * p;
    const void * in;
    const real * grad;
    const gdn_grads * gr;
    const void * b;
} gdn_back_args;

/* A form's backward of one value (sequence n, value head h): writes the unit's d_v, d_g, d_beta,
 * d_state and adds its share to its key group's d_q, d_k rows. */
typedef void (*gdn_back_unit_fn)(const gdn_back_args * a, int64_t n, int64_t h);
/* What a form adds to key group (key sequence nk, key head kh) after all its units (or NULL) */
typedef void (*gdn_back_group_fn)(const gdn_back_args * a, int64_t nk, int64_t kh);

/* The backward of key groups [lo, hi) (gdn_back_split's range), b the thread's scratch: per group, zero
 * its d_q, d_k rows, then run `unit` on every value (sequence, head) reading it, sequences and heads in
 * increasing order (the order the shares of d_q, d_k add in, the same for any thread count), then `end`
 * (if not NULL) on the group. */
static inline void gdn_back_groups(const gdn_params * p, const void * in, const real * grad, real * gin,
                                   const void * b, int64_t lo, int64_t hi, gdn_back_unit_fn unit,
                                   gdn_back_group_fn end) {
    gdn_grads gr;
    gdn_grads_of(p, gin, &gr);
    const gdn_back_args a = { p, in, grad, &gr, b };
    const int64_t S = p->S;
    for (int64_t u = lo; u < hi; ++u) {   /* (no division before a group exists: n_seqs_k or H_k may be 0) */
        const int64_t nk = u / p->H_k, kh = u % p->H_k, per = p->n_seqs / p->n_seqs_k;
        for (int64_t t = 0; t < p->n_t; ++t) {
            const int64_t nq = (nk * p->n_t + t) * p->H_k + kh;
            memset(gr.dq + nq * S, 0, S * sizeof(real));
            memset(gr.dk + nq * S, 0, S * sizeof(real));
        }
        for (int64_t n = nk * per; n < (nk + 1) * per; ++n)
            for (int64_t m = 0; m < gdn_group_size(p); ++m) unit(&a, n, gdn_group_head(p, kh, m));
        if (end) end(&a, nk, kh);
    }
}

/* Thread ith's part of the caller's scratch, `elems` elements per thread, zeroed. */
static inline real * gdn_thread_scratch(void * work, int ith, int64_t elems) {
    real * base = (real *) work + ith * elems;
    memset(base, 0, (size_t) elems * sizeof(real));
    return base;
}

#endif
