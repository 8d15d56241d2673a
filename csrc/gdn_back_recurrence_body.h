/*
 * gdn_back_recurrence_body.h -- GATED_DELTA_NET backward (vector-Jacobian product) of the token
 * recurrence, written once for the element type `real` (ssm_real_f32.h / ssm_real_f64.h): gdn_back,
 * checkpoints every GDN_SEGMENT tokens and each segment recomputed and run in reverse, row by row
 * (gdn_back_unit) or at level 4 by groups of REAL_LANES rows in 64-byte vectors (gdn_back_unit_v). The
 * forward and the token step's math: gdn_recurrence_body.h, gdn_step.h; the vector primitives,
 * gdn_vec.h; the packed gradient and the thread split, gdn_grads.h. Included only by the instantiation
 * files csrc/inst/gdn_<type>_v<N>.c (after gdn_recurrence_body.h); every function here is static with
 * its plain name.
 */
#ifndef SSM_REAL_H
#error "include ssm_real_f32.h or ssm_real_f64.h before gdn_back_recurrence_body.h"
#endif

#include <string.h>

#include "ssm_common.h"
#include "gdn_common.h"
#include "gdn_grads.h"
#include "gdn_step.h"
#include "gdn_vec.h"

/* ------------------------------------------------------------------ backward
 *
 * Reverse of one token t on row j (dM: the gradient of M_t, row j; becomes that of M_{t-1}):
 *   term 1, o_t = c M_t q:        dM += c do_j q;          dq += c do_j M_t[j]
 *   term 2, M_t = P + d k:        dd = dM . k;             dk += d_j dM
 *   term 3, d = beta (v - P k):   dv_j = beta dd;          dbeta += dd w_j;   du = -beta dd
 *   term 4, u = P k, P = a M_{t-1}:  dP = dM + du k;       dk += du P;        dg += dP (.) P
 *                                 dM_{t-1} = a (.) dP
 * (c = 1/sqrt(S); for the scalar gate dg is the sum over i of dP (.) P.)
 */

/* per-thread backward scratch, carved from work */
typedef struct {
    real * ck;        /* (n_ck, S, S) padded: the state before each segment */
    real * seg;       /* (GDN_SEGMENT, S, S) padded: the state after each token of the segment */
    real * dM;        /* (S, S): the gradient of the current state */
    real * w, * d;    /* (GDN_SEGMENT, S) padded: v - P^T k and delta of each token of the segment */
    real * vec;       /* GDN_BACK_VECS padded vectors */
    real * gate;      /* KDA: (n_t, S) padded, exp(g) of every token of the unit (gdn_with_gates) */
} gdn_back_scratch;

static void gdn_back_scratch_of(const gdn_params * p, void * work, int ith, gdn_back_scratch * b) {
    const int64_t ss = gdn_pad(p->S * p->S), sv = gdn_pad(p->S);
    real * base = (real *) work + ith * gdn_back_thread_elems(p);
    b->ck = base;
    b->seg = b->ck + gdn_back_n_ck(p) * ss;
    b->dM = b->seg + GDN_SEGMENT * ss;
    b->w = b->dM + ss;
    b->d = b->w + GDN_SEGMENT * sv;
    b->vec = b->d + GDN_SEGMENT * sv;
    b->gate = b->vec + GDN_BACK_VECS * sv + 2 * 16 * p->n_t;   /* after the vector backward's deltas and w */
}

/* Tokens [t0, t1) of (n, h) from the state `from`, recomputed as the forward does: the state after
 * token t into seg[t - t0], w and delta of its rows into w[t - t0], d[t - t0].
 *   from (S, S)   seg (t1 - t0, S, S) padded   w, d (t1 - t0, S) padded */
static void gdn_back_run(const gdn_params * p, const gdn_inputs * in, const gdn_back_scratch * b, int64_t n,
                         int64_t h, int64_t t0, int64_t t1, const real * from) {
    const int64_t S = p->S, ss = gdn_pad(S * S), sv = gdn_pad(S);
    for (int64_t t = t0; t < t1; ++t) {
        gdn_token tk;
        gdn_token_load(p, in, b->vec, n, h, t, &tk);
        const real * prev = t == t0 ? from : b->seg + (t - t0 - 1) * ss;
        real * next = b->seg + (t - t0) * ss;
        for (int64_t j = 0; j < S; ++j) {
            b->d[(t - t0) * sv + j] = gdn_row_step(next + j * S, prev + j * S, &tk, tk.v[j], S, &b->w[(t - t0) * sv + j]);
        }
    }
}

/* The checkpoints of (n, h): ck[s] is the state before token s * GDN_SEGMENT (ck[0] the start state,
 * dense), each the one before it run through its segment in place (no per-token states kept). */
static void gdn_back_checkpoints(const gdn_params * p, const gdn_inputs * in, const gdn_back_scratch * b,
                                 int64_t n, int64_t h) {
    const int64_t S = p->S, ss = gdn_pad(S * S), n_ck = gdn_back_n_ck(p);
    real * rowbuf = b->vec + (GDN_FWD_VECS - 1) * gdn_pad(S);
    for (int64_t j = 0; j < S; ++j) memcpy(b->ck + j * S, gdn_state_row(p, in, rowbuf, n, h, j), S * sizeof(real));
    for (int64_t s = 1; s < n_ck; ++s) {
        real * M = b->ck + s * ss;
        memcpy(M, b->ck + (s - 1) * ss, S * S * sizeof(real));
        for (int64_t t = (s - 1) * GDN_SEGMENT; t < s * GDN_SEGMENT; ++t) {
            gdn_token tk;
            gdn_token_load(p, in, b->vec, n, h, t, &tk);
            for (int64_t j = 0; j < S; ++j) {
                real w;
                gdn_row_step(M + j * S, M + j * S, &tk, tk.v[j], S, &w);
            }
        }
    }
}

/* one token's per-row accumulators and gradient outputs */
typedef struct {
    real * dq, * dk, * dg;   /* (S) each, this token's sums over rows j */
    real dbeta;
} gdn_token_grads;

/* Reverse of token t on every row (terms 1-4 above). Mt, Mp: the state after and before token t
 * (Mp before the decay), rows of S; dM (S, S) in/out; do_ the gradient of o_t; dv (S) written. */
static void gdn_back_token(const gdn_token * tk, const real * Mt, const real * Mp, real * dM, const real * do_,
                           const real * w, const real * d, real * dv, gdn_token_grads * tg, int64_t S) {
    const real c = (real) 1 / real_sqrt((real) S);
    for (int64_t i = 0; i < S; ++i) tg->dq[i] = tg->dk[i] = tg->dg[i] = 0;
    tg->dbeta = 0;
    for (int64_t j = 0; j < S; ++j) {
        real * dm = dM + j * S;
        const real * mt = Mt + j * S, * mp = Mp + j * S;
        const real cdo = c * do_[j];
        for (int64_t i = 0; i < S; ++i) {                       /* term 1 */
            dm[i] += cdo * tk->q[i];
            tg->dq[i] += SSM_MUTANT(SSM_MUT_GDN_DQ, cdo * mt[i]);
        }
        const real dd = gdn_dot(dm, tk->k, S);                  /* term 2 */
        dv[j] = SSM_MUTANT(SSM_MUT_GDN_DV, tk->beta * dd);       /* term 3 */
        tg->dbeta += SSM_MUTANT(SSM_MUT_GDN_DBETA, dd * w[j]);
        const real du = -tk->beta * dd, dj = d[j];
        for (int64_t i = 0; i < S; ++i) {                       /* term 4 */
            const real a = tk->a ? tk->a[i] : tk->a0;
            const real P = a * mp[i], dP = dm[i] + du * tk->k[i];
            tg->dk[i] += SSM_MUTANT(SSM_MUT_GDN_DK, dj * dm[i] + du * P);
            tg->dg[i] += SSM_MUTANT(SSM_MUT_GDN_DG, dP * P);
            dm[i] = SSM_MUTANT(SSM_MUT_GDN_DSTATE, a * dP);
        }
    }
}


/* Token t's gradients of (n, h) into gin: dv is written by gdn_back_token, dq and dk add to the rows
 * of the key head (zeroed by gdn_back_groups), dg and dbeta are written. */
static void gdn_back_store(const gdn_params * p, const gdn_grads * gr, const gdn_token_grads * tg, int64_t n,
                           int64_t h, int64_t t) {
    const int64_t S = p->S, nv = (n * p->n_t + t) * p->H_v + h;
    const int64_t nq = (gdn_key_seq(p, n) * p->n_t + t) * p->H_k + gdn_key_head(p, h);
    real * dq = gr->dq + nq * S, * dk = gr->dk + nq * S;
    for (int64_t i = 0; i < S; ++i) {
        dq[i] += tg->dq[i];
        dk[i] += tg->dk[i];
    }
    if (p->g_per_channel) {
        memcpy(gr->dg + nv * S, tg->dg, S * sizeof(real));
    } else {
        real sum = 0;
        for (int64_t i = 0; i < S; ++i) sum += tg->dg[i];
        gr->dg[nv] = sum;
    }
    gr->dbeta[nv] = tg->dbeta;
}

/* Backward of one (sequence n, value head h): the checkpoints, then each segment recomputed and run
 * in reverse, the slots' gradients joining dM after the token they were taken at.
 *   grad  out's layout   dM (S, S) ends as d_state of (n, h) */
static void gdn_back_unit(const gdn_params * p, const gdn_inputs * in, const real * grad, const gdn_grads * gr,
                          const gdn_back_scratch * b, int64_t n, int64_t h) {
    const int64_t S = p->S, SS = S * S, ss = gdn_pad(SS), sv = gdn_pad(S), n_t = p->n_t, K = p->K;
    const real * gslots = grad + p->n_seqs * n_t * p->H_v * S + (n * p->H_v + h) * SS;
    const int64_t slot_elems = p->n_seqs * p->H_v * SS;
    gdn_token_grads tg = { b->vec + 6 * sv, b->vec + 7 * sv, b->vec + 8 * sv, 0 };
    const gdn_inputs ig = p->g_per_channel ? gdn_with_gates(p, in, b->gate, n, h) : *in;   /* exp(g) once */
    in = &ig;
    memset(b->dM, 0, SS * sizeof(real));
    if (n_t == 0 && K == 1) memcpy(b->dM, gslots, SS * sizeof(real));   /* slot 0 was the start state */
    if (n_t > 0) gdn_back_checkpoints(p, in, b, n, h);
    for (int64_t s = n_t > 0 ? gdn_back_n_ck(p) - 1 : -1; s >= 0; --s) {
        const int64_t t0 = s * GDN_SEGMENT, t1 = ssm_min64(t0 + GDN_SEGMENT, n_t);
        gdn_back_run(p, in, b, n, h, t0, t1, b->ck + s * ss);
        for (int64_t t = t1 - 1; t >= t0; --t) {
            const int64_t slot = n_t - 1 - t, nv = (n * n_t + t) * p->H_v + h;
            if (slot < K)
                for (int64_t e = 0; e < SS; ++e) b->dM[e] += gslots[slot * slot_elems + e];
            gdn_token tk;
            gdn_token_load(p, in, b->vec, n, h, t, &tk);
            const real * Mp = t == t0 ? b->ck + s * ss : b->seg + (t - t0 - 1) * ss;
            gdn_back_token(&tk, b->seg + (t - t0) * ss, Mp, b->dM, grad + nv * S, b->w + (t - t0) * sv,
                           b->d + (t - t0) * sv, gr->dv + nv * S, &tg, S);
            gdn_back_store(p, gr, &tg, n, h, t);
        }
    }
    memcpy(gr->dstate + (n * p->H_v + h) * SS, b->dM, SS * sizeof(real));
}

#if SSM_LEVEL >= 4
/* ------------------------------------------------------------------ the backward in 64-byte vectors
 *
 * Row j of the state and of its gradient dM evolve apart from the other rows (the reverse of a token
 * on row j needs only that row, the token's vectors and the row's own delta), so the vector
 * backward takes the rows of (n, h) by groups of REAL_LANES, whose states and gradients stay in
 * the L1/L2 caches: per group, (a) the forward over every token, keeping each token's deltas and
 * w = v - P^T k of the group's rows (one vector each) and the group's rows every GDN_SEGMENT
 * tokens; (b) per segment, last first, the group's rows after each token recomputed from the
 * kept deltas (decay, then + delta k: the forward's own operations), then the tokens in reverse
 * (terms 1-4 above). The gradients d_q, d_k, d_g, d_beta of a token are sums over all rows: each
 * group adds its share, groups in increasing order (the same order for any thread count).
 * Scratch: the checkpoint area holds (n_ck, REAL_LANES, S), the segment area
 * (GDN_SEGMENT, REAL_LANES, S), dM (REAL_LANES, S); the deltas and w after the scalar layout
 * (gdn_back_thread_elems). */

/* the group's rows of `from` (stride S) through token tk into `to` (may be `from`), keeping the
 * deltas and w (lane r: row r) when dw is not NULL; NULL: the deltas are given in d */
SSM_INLINE void gdn_back_fwd_token_v(const real * from, real * to, int64_t S, const gdn_token * tk, const gdn_vec * a,
                                     const real * v, real * dk_out, real * w_out, const real * d_in, const int NV) {
    gdn_vec k[GDN_NV_MAX];
    for (int c = 0; c < NV; ++c) k[c] = gdn_vload(tk->k + c * REAL_LANES);
    real d[REAL_LANES];
    if (d_in) {
        memcpy(d, d_in, sizeof d);
    } else {
        gdn_vec sm[REAL_LANES];
        for (int r = 0; r < REAL_LANES; ++r) {
            gdn_vec m[GDN_NV_MAX];
            for (int c = 0; c < NV; ++c) {
                m[c] = gdn_vload(from + r * S + c * REAL_LANES) * a[c];
                gdn_vstore(to + r * S + c * REAL_LANES, m[c]);
            }
            sm[r] = gdn_vdot_acc(m, k, NV);
        }
        const gdn_vec w = gdn_vload(v) - gdn_vsum_rows(sm), dv = w * tk->beta;
        gdn_vstore(d, dv);
        gdn_vstore(dk_out, dv);
        gdn_vstore(w_out, w);
        from = to;
    }
    for (int r = 0; r < REAL_LANES; ++r)
        for (int c = 0; c < NV; ++c) {
            const gdn_vec m = gdn_vload(from + r * S + c * REAL_LANES);
            gdn_vstore(to + r * S + c * REAL_LANES, k[c] * d[r] + (d_in ? m * a[c] : m));
        }
}

/* a token's a = exp(g) as NV vectors (the scalar gate's number in every lane) */
SSM_INLINE void gdn_token_avec(const gdn_token * tk, gdn_vec * a, const int NV) {
    for (int c = 0; c < NV; ++c) a[c] = tk->a ? gdn_vload(tk->a + c * REAL_LANES) : (gdn_vec) {0} + tk->a0;
}

/* what the steps of gdn_back_unit_v share: the unit (n, h), its group of rows g0, and the per-token
 * deltas (dwd) and w (dww) of the group, REAL_LANES each */
typedef struct {
    const gdn_params * p;
    const gdn_inputs * in;
    const real * grad;
    const gdn_grads * gr;
    const gdn_back_scratch * b;
    int64_t n, h, g0;
    real * dwd, * dww;
} gdn_back_vctx;

/* (a) the forward of the group's rows: the checkpoints in b->ck, the deltas and w of every token */
SSM_INLINE void gdn_back_group_fwd_v(const gdn_back_vctx * x, const int NV) {
    const gdn_params * p = x->p;
    const gdn_back_scratch * b = x->b;
    const int64_t S = NV * REAL_LANES, GS = REAL_LANES * S, n_t = p->n_t, n_ck = gdn_back_n_ck(p);
    real * rowbuf = b->vec + (GDN_FWD_VECS - 1) * gdn_pad(S);
    for (int r = 0; r < REAL_LANES; ++r)
        memcpy(b->ck + r * S, gdn_state_row(p, x->in, rowbuf, x->n, x->h, x->g0 + r), S * sizeof(real));
    for (int64_t s = 0; s < n_ck; ++s) {
        real * W = s + 1 < n_ck ? b->ck + (s + 1) * GS : b->dM;   /* the last segment: scratch */
        memcpy(W, b->ck + s * GS, GS * sizeof(real));
        for (int64_t t = s * GDN_SEGMENT; t < ssm_min64((s + 1) * GDN_SEGMENT, n_t); ++t) {
            gdn_token tk;
            gdn_token_load(p, x->in, b->vec, x->n, x->h, t, &tk);
            gdn_vec a[GDN_NV_MAX];
            gdn_token_avec(&tk, a, NV);
            gdn_back_fwd_token_v(W, W, S, &tk, a, tk.v + x->g0, x->dwd + t * REAL_LANES, x->dww + t * REAL_LANES,
                                 NULL, NV);
        }
    }
}

/* (b), one segment [t0, t1): the group's rows after each token into b->seg, from checkpoint s */
SSM_INLINE void gdn_back_segment_v(const gdn_back_vctx * x, int64_t s, int64_t t0, int64_t t1, const int NV) {
    const gdn_back_scratch * b = x->b;
    const int64_t S = NV * REAL_LANES, GS = REAL_LANES * S;
    for (int64_t t = t0; t < t1; ++t) {
        gdn_token tk;
        gdn_token_load(x->p, x->in, b->vec, x->n, x->h, t, &tk);
        gdn_vec a[GDN_NV_MAX];
        gdn_token_avec(&tk, a, NV);
        gdn_back_fwd_token_v(t == t0 ? b->ck + s * GS : b->seg + (t - t0 - 1) * GS, b->seg + (t - t0) * GS, S,
                             &tk, a, NULL, NULL, NULL, x->dwd + t * REAL_LANES, NV);
    }
}

/* (b), the reverse of token t on the group's rows (terms 1-4 above): Mt, Mp the rows after and before
 * it; b->dM in/out; the group's shares of d_q, d_k, d_g, d_beta added, its d_v written */
SSM_INLINE void gdn_back_token_v(const gdn_back_vctx * x, int64_t t, const real * Mt, const real * Mp, const int NV) {
    const gdn_params * p = x->p;
    const gdn_grads * gr = x->gr;
    const gdn_back_scratch * b = x->b;
    const int64_t S = NV * REAL_LANES, n_t = p->n_t, g0 = x->g0, nv = (x->n * n_t + t) * p->H_v + x->h;
    const int64_t nq = (gdn_key_seq(p, x->n) * n_t + t) * p->H_k + gdn_key_head(p, x->h);
    const real c = (real) 1 / real_sqrt((real) S);
    gdn_token tk;
    gdn_token_load(p, x->in, b->vec, x->n, x->h, t, &tk);
    gdn_vec a[GDN_NV_MAX], k[GDN_NV_MAX], q[GDN_NV_MAX];
    gdn_token_avec(&tk, a, NV);
    for (int cc = 0; cc < NV; ++cc) {
        k[cc] = gdn_vload(tk.k + cc * REAL_LANES);
        q[cc] = gdn_vload(tk.q + cc * REAL_LANES);
    }
    real cdo[REAL_LANES], du[REAL_LANES], dj[REAL_LANES];
    gdn_vstore(cdo, gdn_vload(x->grad + nv * S + g0) * c);
    /* terms 1, 2 */
    gdn_vec aq[GDN_NV_MAX], sdd[REAL_LANES];
    for (int cc = 0; cc < NV; ++cc) aq[cc] = (gdn_vec) {0};
    for (int r = 0; r < REAL_LANES; ++r) {
        gdn_vec dm[GDN_NV_MAX];
        for (int cc = 0; cc < NV; ++cc) {
            dm[cc] = q[cc] * cdo[r] + gdn_vload(b->dM + r * S + cc * REAL_LANES);
            gdn_vstore(b->dM + r * S + cc * REAL_LANES, dm[cc]);
            aq[cc] = gdn_vload(Mt + r * S + cc * REAL_LANES) * cdo[r] + aq[cc];
        }
        sdd[r] = gdn_vdot_acc(dm, k, NV);
    }
    /* term 3 */
    const gdn_vec dd = gdn_vsum_rows(sdd), wv = gdn_vload(x->dww + t * REAL_LANES);
    gdn_vstore(gr->dv + nv * S + g0, SSM_MUTANT(SSM_MUT_GDN_VEC_DV, dd * tk.beta));
    gr->dbeta[nv] += SSM_MUTANT(SSM_MUT_GDN_VEC_DBETA, gdn_vsum(dd * wv));
    gdn_vstore(du, -tk.beta * dd);
    memcpy(dj, x->dwd + t * REAL_LANES, sizeof dj);
    /* term 4 */
    gdn_vec ak[GDN_NV_MAX], ag[GDN_NV_MAX];
    for (int cc = 0; cc < NV; ++cc) ak[cc] = ag[cc] = (gdn_vec) {0};
    for (int r = 0; r < REAL_LANES; ++r) {
        for (int cc = 0; cc < NV; ++cc) {
            const gdn_vec dm = gdn_vload(b->dM + r * S + cc * REAL_LANES);
            const gdn_vec P = a[cc] * gdn_vload(Mp + r * S + cc * REAL_LANES), dP = k[cc] * du[r] + dm;
            ak[cc] = dm * dj[r] + ak[cc];
            ak[cc] = P * du[r] + ak[cc];
            ag[cc] = dP * P + ag[cc];
            gdn_vstore(b->dM + r * S + cc * REAL_LANES, SSM_MUTANT(SSM_MUT_GDN_VEC_DSTATE, a[cc] * dP));
        }
    }
    real * dq = gr->dq + nq * S, * dk = gr->dk + nq * S;
    for (int cc = 0; cc < NV; ++cc) {
        gdn_vstore(dq + cc * REAL_LANES, gdn_vload(dq + cc * REAL_LANES) + SSM_MUTANT(SSM_MUT_GDN_VEC_DQ, aq[cc]));
        gdn_vstore(dk + cc * REAL_LANES, gdn_vload(dk + cc * REAL_LANES) + SSM_MUTANT(SSM_MUT_GDN_VEC_DK, ak[cc]));
    }
    if (p->g_per_channel) {
        for (int cc = 0; cc < NV; ++cc)
            gdn_vstore(gr->dg + nv * S + cc * REAL_LANES,
                       gdn_vload(gr->dg + nv * S + cc * REAL_LANES) + SSM_MUTANT(SSM_MUT_GDN_VEC_DG, ag[cc]));
    } else {
        gdn_vec sg = ag[0];
        for (int cc = 1; cc < NV; ++cc) sg += ag[cc];
        gr->dg[nv] += SSM_MUTANT(SSM_MUT_GDN_VEC_DG, gdn_vsum(sg));
    }
}

SSM_INLINE void gdn_back_unit_v(const gdn_params * p, const gdn_inputs * in, const real * grad, const gdn_grads * gr,
                                const gdn_back_scratch * b, int64_t n, int64_t h, const int NV) {
    const int64_t S = NV * REAL_LANES, SS = S * S, n_t = p->n_t, K = p->K, GS = REAL_LANES * S, sv = gdn_pad(S);
    const int64_t n_ck = gdn_back_n_ck(p), G = p->g_per_channel ? S : 1;
    const int64_t slot_elems = p->n_seqs * p->H_v * SS;
    const real * gslots = grad + p->n_seqs * n_t * p->H_v * S + (n * p->H_v + h) * SS;
    real * dwd = (real *) b->vec + GDN_BACK_VECS * sv;
    const gdn_inputs ig = p->g_per_channel ? gdn_with_gates(p, in, b->gate, n, h) : *in;   /* exp(g) once */
    gdn_back_vctx x = { p, &ig, grad, gr, b, n, h, 0, dwd, dwd + n_t * REAL_LANES };
    for (int64_t t = 0; t < n_t; ++t) {
        const int64_t nv = (n * n_t + t) * p->H_v + h;
        gr->dbeta[nv] = 0;
        memset(gr->dg + nv * G, 0, G * sizeof(real));
    }
    for (x.g0 = 0; x.g0 < S; x.g0 += REAL_LANES) {
        gdn_back_group_fwd_v(&x, NV);
        memset(b->dM, 0, GS * sizeof(real));
        for (int64_t s = n_ck - 1; s >= 0; --s) {
            const int64_t t0 = s * GDN_SEGMENT, t1 = ssm_min64(t0 + GDN_SEGMENT, n_t);
            gdn_back_segment_v(&x, s, t0, t1, NV);
            for (int64_t t = t1 - 1; t >= t0; --t) {
                const int64_t slot = n_t - 1 - t;
                if (slot < K)
                    for (int64_t e = 0; e < GS; ++e) b->dM[e] += gslots[slot * slot_elems + x.g0 * S + e];
                gdn_back_token_v(&x, t, b->seg + (t - t0) * GS, t == t0 ? b->ck + s * GS : b->seg + (t - t0 - 1) * GS,
                                 NV);
            }
        }
        memcpy(gr->dstate + (n * p->H_v + h) * SS + x.g0 * S, b->dM, GS * sizeof(real));
    }
}

/* whether gdn_back_unit_v runs this call (the forward's condition, and a group no wider than half a row) */
/* Level 4 only. At level 3 (gdn_vec.h's 32-byte vectors, groups of 8 float rows) this backward gave
 * other bits than the row-by-row one (its d_q, d_k, d_g, d_beta sum the rows by groups); capped Zen 5,
 * H_v 32 / H_k 16, S 128, 1 thread: with per-channel gates 2.2x faster at 64 tokens, with the scalar
 * gate 1.1x faster at 64 tokens but 1.15x slower at one (a row is 16 vectors there, k, q and the gate
 * 48, beyond AVX2's 16 registers). It stays row by row there. */
static inline int gdn_back_vec_ok(const gdn_params * p) { return gdn_fwd_vec_ok(p) && p->S >= 2 * REAL_LANES; }

static void gdn_back_unit_vs(const gdn_params * p, const gdn_inputs * in, const real * grad, const gdn_grads * gr,
                             const gdn_back_scratch * b, int64_t n, int64_t h) {
    switch (p->S / REAL_LANES) {
    case 2: gdn_back_unit_v(p, in, grad, gr, b, n, h, 2); break;
    case 4: gdn_back_unit_v(p, in, grad, gr, b, n, h, 4); break;
    case 8: gdn_back_unit_v(p, in, grad, gr, b, n, h, 8); break;
    case 16: gdn_back_unit_v(p, in, grad, gr, b, n, h, 16); break;
    default: gdn_back_unit(p, in, grad, gr, b, n, h); break;   /* not reached (gdn_back_vec_ok) */
    }
}
#endif

/* the backward of one (sequence, value head) as gdn_back_groups calls it: in vectors where they apply */
static void gdn_back_unit_of(const gdn_back_args * a, int64_t n, int64_t h) {
#if SSM_LEVEL >= 4
    if (gdn_back_vec_ok(a->p)) {
        gdn_back_unit_vs(a->p, a->in, a->grad, a->gr, a->b, n, h);
        return;
    }
#endif
    gdn_back_unit(a->p, a->in, a->grad, a->gr, a->b, n, h);
}

/* Backward: threads split the key groups (gdn_back_split); each owns every gradient its groups' heads
 * produce. */
static void gdn_back(const gdn_params * p, const gdn_inputs * in, const real * grad, real * gin, void * work,
                     int ith, int nth) {
    int64_t lo, hi;
    gdn_back_split(p, ith, nth, &lo, &hi);
    gdn_back_scratch b;
    gdn_back_scratch_of(p, work, ith, &b);
    gdn_back_groups(p, in, grad, gin, &b, lo, hi, gdn_back_unit_of, NULL);
}
