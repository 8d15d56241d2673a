/*
 * gdn_recurrence_body.h -- GATED_DELTA_NET forward and backward as a token recurrence, written once
 * for the element type `real` (ssm_real_f32.h / ssm_real_f64.h). Included only by the instantiation
 * files csrc/inst/gdn_<type>_v<N>.c, which define the exported wrappers; every function here is
 * static with its plain name.
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
#ifndef SSM_REAL_H
#error "include ssm_real_f32.h or ssm_real_f64.h before gdn_recurrence_body.h"
#endif

#include <string.h>

#include "ssm_common.h"
#include "gdn_common.h"

/* the six inputs, typed */
typedef struct {
    const real * q, * k, * v, * g, * beta, * state;
} gdn_inputs;

/* one token's vectors for one (sequence, value head), contiguous (gathered where strided) */
typedef struct {
    const real * q, * k, * v;
    const real * a;      /* exp(g_t) per channel (KDA), else NULL */
    real a0;             /* exp(g_t) for the scalar gate */
    real beta;
} gdn_token;

/* x . y in ggml's order (ggml_vec_dot_f32 on x86-64 with AVX2/FMA, the build ggml/build.sh makes, with
 * REAL_DOT_LANES 32): REAL_DOT_LANES running sums over blocks of REAL_DOT_LANES elements, halved to 4 lanes, the
 * 4 added pairwise ((0+1) + (2+3), its two horizontal adds), then the elements past the last whole
 * block one by one. The same bits for any caller. */
static inline real gdn_dot(const real * x, const real * y, int64_t n) {
    real acc[REAL_DOT_LANES];
    for (int l = 0; l < REAL_DOT_LANES; ++l) acc[l] = 0;
    int64_t i = 0;
    for (; i + REAL_DOT_LANES <= n; i += REAL_DOT_LANES)
        for (int l = 0; l < REAL_DOT_LANES; ++l) acc[l] += x[i + l] * y[i + l];
    for (int w = REAL_DOT_LANES / 2; w >= 4; w /= 2)
        for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
    real sum = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    for (; i < n; ++i) sum += x[i] * y[i];
    return sum;
}

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
    if (p->g_per_channel) {
        real * a = vec + 3 * sv;
        for (int64_t i = 0; i < S; ++i) a[i] = real_exp(g[i * gs[3]]);
        tk->a = a;
        tk->a0 = 1;
    } else {
        tk->a = NULL;
        tk->a0 = real_exp(g[0]);
    }
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

/* Forward of one (sequence n, value head h):
 *   M    (S, S)   out's slot 0 of (n, h): the state, updated in place (its first token reads state)
 *   o    (n_t, S) rows of out's o region, stride H_v * S between tokens
 *   vec  GDN_FWD_VECS padded vectors of scratch */
static void gdn_fwd_unit(const gdn_params * p, const gdn_inputs * in, real * out, real * vec, int64_t n, int64_t h) {
    const int64_t S = p->S, SS = S * S, n_t = p->n_t, K = p->K, sv = gdn_pad(S);
    const int64_t slot_elems = p->n_seqs * p->H_v * SS;
    real * slots = out + p->n_seqs * n_t * p->H_v * S;
    real * M = slots + (n * p->H_v + h) * SS;
    real * rowbuf = vec + (GDN_FWD_VECS - 1) * sv;
    const real scale = (real) 1 / real_sqrt((real) S);
    if (n_t == 0) {   /* ggml: K == 1 copies the start state to slot 0; K > 1 writes nothing */
        for (int64_t j = 0; K == 1 && j < S; ++j) memcpy(M + j * S, gdn_state_row(p, in, rowbuf, n, h, j), S * sizeof(real));
        return;
    }
    for (int64_t t = 0; t < n_t; ++t) {
        gdn_token tk;
        gdn_token_load(p, in, vec, n, h, t, &tk);
        real * o = out + ((n * n_t + t) * p->H_v + h) * S;
        for (int64_t j = 0; j < S; ++j) {
            const real * src = t == 0 ? gdn_state_row(p, in, rowbuf, n, h, j) : M + j * S;
            real w;
            gdn_row_step(M + j * S, src, &tk, tk.v[j], S, &w);
            o[j] = SSM_MUTANT(SSM_MUT_GDN_FWD, gdn_dot(M + j * S, tk.q, S) * scale);
        }
        const int64_t slot = n_t - 1 - t;   /* slot 0 is M itself */
        if (slot >= 1 && slot < K) memcpy(slots + slot * slot_elems + (n * p->H_v + h) * SS, M, SS * sizeof(real));
    }
}

/* Forward: threads split the (sequence, value head) pairs. */
static void gdn_fwd(const gdn_params * p, const gdn_inputs * in, real * out, void * work, int ith, int nth) {
    int64_t lo, hi;
    ssm_split(p->n_seqs * p->H_v, ith, nth, &lo, &hi);
    real * vec = (real *) work + ith * gdn_fwd_thread_elems(p);
    for (int64_t u = lo; u < hi; ++u) gdn_fwd_unit(p, in, out, vec, u / p->H_v, u % p->H_v);
}

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

/* the six regions of gin, typed */
typedef struct {
    real * dq, * dk, * dv, * dg, * dbeta, * dstate;
} gdn_grads;

static void gdn_grads_of(const gdn_params * p, real * gin, gdn_grads * gr) {
    const int64_t n_qk = p->n_seqs_k * p->n_t * p->H_k * p->S, n_v = p->n_seqs * p->n_t * p->H_v;
    gr->dq = gin;
    gr->dk = gr->dq + n_qk;
    gr->dv = gr->dk + n_qk;
    gr->dg = gr->dv + n_v * p->S;
    gr->dbeta = gr->dg + n_v * (p->g_per_channel ? p->S : 1);
    gr->dstate = gr->dbeta + n_v;
}

/* Token t's gradients of (n, h) into gin: dv is written by gdn_back_token, dq and dk add to the rows
 * of the key head (zeroed by gdn_back_group), dg and dbeta are written. */
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

/* Backward of one key group (key sequence nk, key head kh): zero its d_q, d_k rows, then every value
 * (sequence, head) reading it, in increasing order, adds its share. */
static void gdn_back_group(const gdn_params * p, const gdn_inputs * in, const real * grad, const gdn_grads * gr,
                           const gdn_back_scratch * b, int64_t nk, int64_t kh) {
    const int64_t S = p->S, per = p->n_seqs / p->n_seqs_k;
    for (int64_t t = 0; t < p->n_t; ++t) {
        const int64_t nq = (nk * p->n_t + t) * p->H_k + kh;
        memset(gr->dq + nq * S, 0, S * sizeof(real));
        memset(gr->dk + nq * S, 0, S * sizeof(real));
    }
    for (int64_t n = nk * per; n < (nk + 1) * per; ++n)
        for (int64_t m = 0; m < gdn_group_size(p); ++m) gdn_back_unit(p, in, grad, gr, b, n, gdn_group_head(p, kh, m));
}

/* Backward: threads split the key groups; each owns every gradient its group's heads produce. */
static void gdn_back(const gdn_params * p, const gdn_inputs * in, const real * grad, real * gin, void * work,
                     int ith, int nth) {
    int64_t lo, hi;
    ssm_split(p->n_seqs_k * p->H_k, ith, nth, &lo, &hi);
    gdn_grads gr;
    gdn_grads_of(p, gin, &gr);
    gdn_back_scratch b;
    gdn_back_scratch_of(p, work, ith, &b);
    for (int64_t u = lo; u < hi; ++u) gdn_back_group(p, in, grad, &gr, &b, u / p->H_k, u % p->H_k);
}
