/*
 * gdn_step.h -- what the token recurrence's forward (gdn_recurrence_body.h) and backward
 * (gdn_back_recurrence_body.h) share, typed: the six inputs, one token's vectors (gdn_token,
 * gdn_token_load; KDA's gates once per unit, gdn_with_gates), ggml's dot product (gdn_dot, gdn_dot.h) and one
 * token on one state row (gdn_row_step). Part of a kernel body: included after the element type's
 * header (ssm_real_f32.h / ssm_real_f64.h), once per translation unit (csrc/inst/gdn_<type>_v<N>.c).
 *
 * Layouts and semantics: ssmgrad.h (gdn_params). The state is kept transposed as ggml keeps it:
 * row j of M (S values, contiguous) is column j of S, M[j][i] = S[i][j]. A token's update is then
 * independent per row j:
 *   r = a (.) M[j]            (a = exp(g_t), per channel i for KDA, else one number)
 *   d_j = beta (v_j - r . k)
 *   M[j] = r + d_j k
 *   o_j = (M[j] . q) / sqrt(S)
 * which is ggml's sequence of whole-state passes (scale, dot, outer product, dot) done row by row:
 * each element sees the same operations in the same order.
 */
#ifndef GDN_STEP_H
#define GDN_STEP_H

#ifndef SSM_REAL_H
#error "include ssm_real_f32.h or ssm_real_f64.h before gdn_step.h"
#endif

#include <string.h>

#include "ssm_common.h"
#include "gdn_common.h"
#include "gdn_dot.h"

/* the six inputs, typed; gate: KDA's exp(g) of every token of the (sequence, head) being run, row t
 * padded to gdn_pad(S), when the caller computed it once (gdn_gate_rows), else NULL */
typedef struct {
    const real * q, * k, * v, * g, * beta, * state;
    const real * gate;
} gdn_inputs;

/* one token's vectors for one (sequence, value head), contiguous (gathered where strided) */
typedef struct {
    const real * q, * k, * v;
    const real * a;      /* exp(g_t) per channel (KDA), else NULL */
    real a0;             /* exp(g_t) for the scalar gate */
    real beta;
} gdn_token;

/* n elements at src with element stride st: src itself when dense, else gathered into buf */
static inline const real * gdn_load(real * buf, const real * src, int64_t st, int64_t n) {
    if (st == 1) return src;
    for (int64_t i = 0; i < n; ++i) buf[i] = src[i * st];
    return buf;
}

/* the vectors of token t of (sequence n, value head h); vec: GDN_FWD_VECS - 1 padded vectors */
static void gdn_token_load(const gdn_params * p, const gdn_inputs * in, real * vec, int64_t n, int64_t h,
                           int64_t t, gdn_token * tk) {
    const int64_t S = p->S, sv = gdn_pad(S), nk = gdn_key_seq(p, n), kh = gdn_key_head(p, h);
    const int64_t * qs = p->q_st, * ks = p->k_st, * vs = p->v_st, * gs = p->g_st, * bs = p->beta_st;
    tk->q = gdn_load(vec, in->q + nk * qs[0] + t * qs[1] + kh * qs[2], qs[3], S);
    tk->k = gdn_load(vec + sv, in->k + nk * ks[0] + t * ks[1] + kh * ks[2], ks[3], S);
    tk->v = gdn_load(vec + 2 * sv, in->v + n * vs[0] + t * vs[1] + h * vs[2], vs[3], S);
    tk->beta = in->beta[n * bs[0] + t * bs[1] + h * bs[2]];
    const real * g = in->g + n * gs[0] + t * gs[1] + h * gs[2];
    if (p->g_per_channel && in->gate) {
        tk->a = in->gate + t * sv;
        tk->a0 = 1;
    } else if (p->g_per_channel) {
        real * a = vec + 3 * sv;
        for (int64_t i = 0; i < S; ++i) a[i] = real_exp(g[i * gs[3]]);
        tk->a = a;
        tk->a0 = 1;
    } else {
        tk->a = NULL;
        tk->a0 = real_exp(g[0]);
    }
}

/* KDA: exp(g) of every token of (n, h) into A (row t padded to gdn_pad(S)), gdn_token_load's own values
 * (the same real_exp of the same g), for the forms that visit a token once per block or group of state
 * rows; returns a copy of IN whose gate is A, for the unit's calls. */
static gdn_inputs gdn_with_gates(const gdn_params * p, const gdn_inputs * in, real * A, int64_t n, int64_t h) {
    const int64_t S = p->S, sv = gdn_pad(S), * gs = p->g_st;
    for (int64_t t = 0; t < p->n_t; ++t) {
        const real * g = in->g + n * gs[0] + t * gs[1] + h * gs[2];
        for (int64_t i = 0; i < S; ++i) A[t * sv + i] = real_exp(g[i * gs[3]]);
    }
    gdn_inputs ig = *in;
    ig.gate = A;
    return ig;
}

/* One token on row j (S values): dst = a (.) src + d_j k with d_j = beta (v_j - (a (.) src) . k).
 * dst may be src. Returns d_j; *w = v_j - (a (.) src) . k (the backward's d beta needs it). */
static inline real gdn_row_step(real * dst, const real * src, const gdn_token * tk, real vj, int64_t S, real * w) {
    if (tk->a)
        for (int64_t i = 0; i < S; ++i) dst[i] = src[i] * tk->a[i];
    else
        for (int64_t i = 0; i < S; ++i) dst[i] = src[i] * tk->a0;
    const real sum = gdn_dot(dst, tk->k, S);
    const real d = (vj - sum) * tk->beta;
    for (int64_t i = 0; i < S; ++i) dst[i] += tk->k[i] * d;
    *w = vj - sum;
    return d;
}

/* Row j of the start state of (n, h), contiguous (gathered into buf when strided). */
static inline const real * gdn_state_row(const gdn_params * p, const gdn_inputs * in, real * buf, int64_t n,
                                         int64_t h, int64_t j) {
    const int64_t * st = p->state_st;
    return gdn_load(buf, in->state + n * st[0] + h * st[1] + j * st[2], st[3], p->S);
}


#endif /* GDN_STEP_H */
