/*
 * gdn_chunk.h -- what GATED_DELTA_NET's chunked (WY / UT-transform) form shares between its forward
 * (gdn_chunked_body.h) and its backward (gdn_back_chunked_body.h), typed: the six inputs, the
 * per-thread scratch (gdnc_buf, gdnc_carve), transposes and the state's loads and stores, a chunk's
 * loads (gdnc_load_keys, gdnc_load_head), T = (I + A)^-1 (gdnc_T, gdnc_make_T), K K^T and Q K^T
 * (gdnc_chunk_keys), and a chunk's deltas and state step (gdnc_chunk_delta, gdnc_chunk_state). Part of
 * a kernel body: included after the element type's header (ssm_real_f32.h / ssm_real_f64.h), once per
 * translation unit (csrc/inst/gdn_chunked_<type>_v<N>.c).
 *
 * Per (sequence, value head) the tokens are cut into chunks of GDN_CHUNK (the last may be shorter).
 * Here the state is H[i][j] (i: key channel, j: value channel; ggml stores its transpose), rows of
 * Sp = S padded to 16. Within a chunk of L tokens, with H0 the state before it, G_t the sum of g over
 * the chunk's tokens up to t (in double), gamma_t = exp(G_t), D[t][s] = exp(G_t - G_s) for s <= t:
 *
 *   A   = strictly lower part of diag(beta) (K K^T (.) D)      (L, L)
 *   T   = (I + A)^-1                                           (forward substitution)
 *   Y   = V - diag(gamma) K H0                                 (L, S)
 *   Dl  = T diag(beta) Y                                       the rows delta_t of the recurrence
 *   O   = c (diag(gamma) Q H0 + (Q K^T (.) D, lower incl.) Dl)   c = 1/sqrt(S)
 *   H_L = gamma_L H0 + K^T diag(D_L) Dl                        D_L[s] = exp(G_{L-1} - G_s)
 *
 * which is the token recurrence (ssmgrad.h) unrolled over the chunk: delta_t = beta_t (v_t - a_t
 * H_{t-1}^T k_t) with a_t H_{t-1} = gamma_t H0 + sum_{s<t} D[t][s] k_s delta_s^T. Decays enter only as
 * exp of differences G_t - G_s <= 0 for g <= 0 (never a ratio of gammas), so a very negative g gives
 * zeros, not 0/0. The products are ssm_mm's (ssm_mm.h): each element a sum in an order fixed by the
 * shape, so the result does not depend on the thread count. It differs from the recurrence (and
 * from ggml's forward) by float rounding.
 */
#ifndef GDN_CHUNK_H
#define GDN_CHUNK_H

#ifndef SSM_REAL_H
#error "include ssm_real_f32.h or ssm_real_f64.h before gdn_chunk.h"
#endif

#include <string.h>

#include "ssm_common.h"
#include "gdn_common.h"
#include "ssm_mm.h"

/* the six inputs, typed; and for the backward, the forward's kept chunks (gdn_back_kept_*) or NULL */
typedef struct {
    const real * q, * k, * v, * g, * beta, * state;
    const real * kept;
} gdnc_inputs;

/* one thread's scratch (gdnc_carve: the order of gdnc_chunk_elems, then gdnc_fwd_thread_elems' or
 * gdnc_back_thread_elems' own) */
typedef struct {
    int64_t Sp;
    /* forward */
    real * H;                                  /* (Sp, Sp) the running state H[i][j] */
    real * Kc, * Qc, * Vc;                     /* (C, Sp) the chunk's k, q, v rows, zero past S */
    real * Y, * Dl, * Ob, * DS;                /* (C, Sp) */
    real * KT;                                 /* (Sp, C) k transposed, zero past L */
    real * KK, * T, * P, * D;                  /* (C, C) */
    real * beta, * gam, * DL, * cvec;          /* (C) */
    double * G;                                /* (C) */
    real * Hx;                                 /* (GDNC_FWD_HEADS - 1) (Sp, Sp): the other heads' states */
    real * QK;                                 /* (C, C) Q K^T (lower part), shared by a key head's heads */
    /* backward */
    real * HT, * dH, * dHT;                    /* (Sp, Sp) */
    real * dO, * dDl, * KdH, * dR, * dV, * E, * dQc, * dKc, * Gq, * Gk;   /* (C, Sp) */
    real * DlT;                                /* (Sp, C) */
    real * dP, * dA, * dKK, * dQK;             /* (C, C) */
    real * dgam, * dDL, * dGt, * dbeta;        /* (C) */
    real * Hs, * Ys, * Dls;                    /* per chunk: (Sp, Sp), (C, Sp), (C, Sp) */
    real * sQK, * sKK;                         /* per chunk (C, C), or NULL: gdnc_group_sums_elems */
} gdnc_buf;

static real * gdnc_take(real ** at, int64_t n) {
    real * r = *at;
    *at += n;
    return r;
}

static void gdnc_carve(const gdn_params * p, real * base, int back, gdnc_buf * b) {
    const int64_t Sp = gdn_pad(p->S), C = GDN_CHUNK, SS = Sp * Sp, CS = C * Sp, CC = C * C;
    real * at = base;
    b->Sp = Sp;
    b->H = gdnc_take(&at, SS);
    b->Kc = gdnc_take(&at, CS);
    b->Qc = gdnc_take(&at, CS);
    b->Vc = gdnc_take(&at, CS);
    b->Y = gdnc_take(&at, CS);
    b->Dl = gdnc_take(&at, CS);
    b->Ob = gdnc_take(&at, CS);
    b->DS = gdnc_take(&at, CS);                /* GDNC_FWD_CS = 7 */
    b->KT = gdnc_take(&at, Sp * C);
    b->KK = gdnc_take(&at, CC);
    b->T = gdnc_take(&at, CC);
    b->P = gdnc_take(&at, CC);
    b->D = gdnc_take(&at, CC);                 /* GDNC_FWD_CC = 4 */
    b->beta = gdnc_take(&at, C);
    b->gam = gdnc_take(&at, C);
    b->DL = gdnc_take(&at, C);
    b->cvec = gdnc_take(&at, C);
    b->G = (double *) gdnc_take(&at, 2 * C);   /* GDNC_FWD_C = 6; 2 C reals hold C doubles */
    b->sQK = b->sKK = NULL;
    if (!back) {   /* the forward's own (gdnc_fwd_thread_elems) */
        b->Hx = gdnc_take(&at, (GDNC_FWD_HEADS - 1) * SS);
        b->QK = gdnc_take(&at, CC);
        return;
    }
    b->Hx = b->QK = NULL;   /* the backward's forward pass runs one head, without o */
    b->HT = gdnc_take(&at, SS);
    b->dH = gdnc_take(&at, SS);
    b->dHT = gdnc_take(&at, SS);               /* GDNC_BACK_SS = 3 */
    b->dO = gdnc_take(&at, CS);
    b->dDl = gdnc_take(&at, CS);
    b->KdH = gdnc_take(&at, CS);
    b->dR = gdnc_take(&at, CS);
    b->dV = gdnc_take(&at, CS);
    b->E = gdnc_take(&at, CS);
    b->dQc = gdnc_take(&at, CS);
    b->dKc = gdnc_take(&at, CS);
    b->Gq = gdnc_take(&at, CS);
    b->Gk = gdnc_take(&at, CS);                /* GDNC_BACK_CS = 10 */
    b->DlT = gdnc_take(&at, Sp * C);
    b->dP = gdnc_take(&at, CC);
    b->dA = gdnc_take(&at, CC);
    b->dKK = gdnc_take(&at, CC);
    b->dQK = gdnc_take(&at, CC);               /* GDNC_BACK_CC = 4 */
    b->dgam = gdnc_take(&at, C);
    b->dDL = gdnc_take(&at, C);
    b->dGt = gdnc_take(&at, C);
    b->dbeta = gdnc_take(&at, C);              /* GDNC_BACK_C = 4 */
    b->Hs = gdnc_take(&at, gdnc_n_chunks(p) * SS);
    b->Ys = gdnc_take(&at, gdnc_n_chunks(p) * CS);
    b->Dls = gdnc_take(&at, gdnc_n_chunks(p) * CS);
    if (gdnc_group_sums_elems(p)) {
        b->sQK = gdnc_take(&at, gdnc_n_chunks(p) * CC);
        b->sKK = gdnc_take(&at, gdnc_n_chunks(p) * CC);
    }
}

#include "gdn_transpose.h"   /* gdnc_transpose */

/* n values at src with element stride st into dst, zero from n to Sp */
static inline void gdnc_row(real * dst, const real * src, int64_t st, int64_t n, int64_t Sp) {
    if (st == 1) memcpy(dst, src, (size_t) n * sizeof(real));
    else
        for (int64_t i = 0; i < n; ++i) dst[i] = src[i * st];
    for (int64_t i = n; i < Sp; ++i) dst[i] = 0;
}

/* The state of (n, h) from a (n_seqs, H_v, S, S) array stored transposed (x[n, h, j, i] = H[i][j],
 * strides st) into H (Sp, Sp) */
static void gdnc_load_state(const gdn_params * p, const real * x, const int64_t * st, real * H, int64_t Sp, int64_t n,
                            int64_t h) {
    const int64_t S = p->S;
    const real * base = x + n * st[0] + h * st[1];
    if (st[3] == 1) {   /* rows j contiguous over i */
        gdnc_transpose(H, Sp, base, st[2], S, S);
        return;
    }
    for (int64_t i = 0; i < S; ++i)
        for (int64_t j = 0; j < S; ++j) H[i * Sp + j] = base[j * st[2] + i * st[3]];
}

/* H (Sp, Sp) stored transposed into a dense (S, S) block: dst[j][i] = H[i][j] */
static void gdnc_store_state(const real * H, int64_t Sp, real * dst, int64_t S) {
    gdnc_transpose(dst, S, H, Sp, S, S);
}

/* A gate below this is taken as this: exp of it, and of any G difference spanning it, is exactly 0
 * in both types, as exp(-inf) is, while the differences of G that do not span it stay exact. */
#define GDNC_G_FLOOR (-1e4)

/* gdnc_load's key part: Kc, Qc, KT (the same for every value head of key head kh) */
static void gdnc_load_keys(const gdn_params * p, const gdnc_inputs * in, const gdnc_buf * b, int64_t n, int64_t kh,
                           int64_t t0, int64_t L) {
    const int64_t S = p->S, Sp = b->Sp, C = GDN_CHUNK, Lp = gdn_pad(L), nk = gdn_key_seq(p, n);
    const int64_t * qs = p->q_st, * ks = p->k_st;
    for (int64_t t = 0; t < L; ++t) {
        const int64_t tt = t0 + t;
        gdnc_row(b->Kc + t * Sp, in->k + nk * ks[0] + tt * ks[1] + kh * ks[2], ks[3], S, Sp);
        gdnc_row(b->Qc + t * Sp, in->q + nk * qs[0] + tt * qs[1] + kh * qs[2], qs[3], S, Sp);
    }
    gdnc_transpose(b->KT, C, b->Kc, Sp, L, S);   /* KT (Sp, C): columns past L zero (they are a product's Y) */
    for (int64_t i = 0; i < S; ++i)
        for (int64_t t = L; t < Lp; ++t) b->KT[i * C + t] = 0;
}

/* gdnc_load's value-head part: Vc (if want_v), beta, G, gam, D (if want_D: the forward alone computes
 * its rows where it uses them, gdnc_make_AP), DL */
static void gdnc_load_head(const gdn_params * p, const gdnc_inputs * in, const gdnc_buf * b, int64_t n, int64_t h,
                           int64_t t0, int64_t L, int want_v, int want_D) {
    const int64_t S = p->S, Sp = b->Sp, C = GDN_CHUNK, Lp = gdn_pad(L);
    const int64_t * vs = p->v_st, * gs = p->g_st, * bs = p->beta_st;
    double acc = 0;
    for (int64_t t = 0; t < L; ++t) {
        const int64_t tt = t0 + t;
        if (want_v) gdnc_row(b->Vc + t * Sp, in->v + n * vs[0] + tt * vs[1] + h * vs[2], vs[3], S, Sp);
        b->beta[t] = in->beta[n * bs[0] + tt * bs[1] + h * bs[2]];
        double gv = (double) in->g[n * gs[0] + tt * gs[1] + h * gs[2]];
        if (gv < GDNC_G_FLOOR) gv = GDNC_G_FLOOR;    /* -inf: differences of G stay finite (NaN stays NaN) */
        acc += gv;
        b->G[t] = acc;
        b->gam[t] = (real) exp(acc);
    }
    /* D and DL: rows up to a multiple of 16 past the diagonal, in loops the compiler vectorizes
     * (real_exp_poly is branch-free); the lanes past the diagonal are then overwritten (their exp may
     * be inf: never used) */
    for (int64_t t = 0; t < L && want_D; ++t) {
        real * d = b->D + t * C;
        const double Gt = b->G[t];
        const int64_t n_s = gdn_pad(t + 1);
        for (int64_t s = 0; s < n_s; ++s) d[s] = (real) (Gt - b->G[s]);
        for (int64_t s = 0; s < n_s; ++s) d[s] = real_exp_poly(d[s]);
        d[t] = 1;
        for (int64_t s = t + 1; s < Lp; ++s) d[s] = 0;
    }
    const double GL = b->G[L - 1];
    for (int64_t t = 0; t < Lp; ++t) b->DL[t] = (real) (GL - b->G[t]);
    for (int64_t t = 0; t < Lp; ++t) b->DL[t] = real_exp_poly(b->DL[t]);
    b->DL[L - 1] = 1;
    for (int64_t t = L; t < Lp; ++t) b->DL[t] = 0;
}

/* Loads chunk [t0, t0 + L) of (n, h): Kc, Qc, Vc (if want_v), KT, beta, G, gam, D, DL (the backward's). */
static void gdnc_load(const gdn_params * p, const gdnc_inputs * in, const gdnc_buf * b, int64_t n, int64_t h,
                      int64_t t0, int64_t L, int want_v) {
    gdnc_load_keys(p, in, b, n, gdn_key_head(p, h), t0, L);
    gdnc_load_head(p, in, b, n, h, t0, L, want_v, 1);
}

/* Rows t0 .. t0 + nr - 1 (nr <= 4) of T, from the rows before them and A (C, C): T[t] = e_t -
 * sum_{u<t} A[t][u] T[u], every element a sum over u in increasing order, as the row-by-row
 * substitution writes it. By blocks of SSM_MMW columns, the nr rows at once (independent chains)
 * for u < t0, then the triangle among the nr rows in order. Row u is zero past u, so a block's
 * terms start at u = its first column (the earlier terms add exact zeros). */
SSM_INLINE void gdnc_T_rows(const gdnc_buf * b, const real * A, int64_t t0, int nr) {
    const int64_t C = GDN_CHUNK, W = SSM_MMW;
    real * T = b->T;
    int64_t s0 = 0;
    for (; s0 + W < t0 + nr; s0 += 2 * W) {   /* two blocks at once: twice the independent chains */
        const int64_t s1 = s0 + W;
        mmv acc[4] = { { 0 } }, acc1[4] = { { 0 } };
        for (int64_t u = s0; u < ssm_min64(s1, t0); ++u) {
            const mmv tu = *(const mmv *) (T + u * C + s0);
            for (int r = 0; r < nr; ++r) acc[r] -= A[(t0 + r) * C + u] * tu;
        }
        for (int64_t u = s1; u < t0; ++u) {
            const mmv tu = *(const mmv *) (T + u * C + s0), tu1 = *(const mmv *) (T + u * C + s1);
            for (int r = 0; r < nr; ++r) {
                const real a = A[(t0 + r) * C + u];
                acc[r] -= a * tu;
                acc1[r] -= a * tu1;
            }
        }
        for (int r = 0; r < nr; ++r) {
            *(mmv *) (T + (t0 + r) * C + s0) = acc[r];
            *(mmv *) (T + (t0 + r) * C + s1) = acc1[r];
        }
    }
    for (; s0 < t0 + nr; s0 += W) {
        mmv acc[4] = { { 0 } };
        for (int64_t u = s0; u < t0; ++u) {
            const mmv tu = *(const mmv *) (T + u * C + s0);
            for (int r = 0; r < nr; ++r) acc[r] -= A[(t0 + r) * C + u] * tu;
        }
        for (int r = 0; r < nr; ++r) *(mmv *) (T + (t0 + r) * C + s0) = acc[r];
    }
    for (int r = 0; r < nr; ++r)   /* the rest of the rows: zero (the products read a band past the diagonal) */
        for (int64_t s = s0; s < C; ++s) T[(t0 + r) * C + s] = 0;
    for (int r = 0; r < nr; ++r) {
        const int64_t t = t0 + r;
        real * Tt = T + t * C;
        for (int64_t u = t0; u < t; ++u) {
            const real a = A[t * C + u];
            const real * Tu = T + u * C;
            for (int64_t s = 0; s <= u; ++s) Tt[s] -= a * Tu[s];
        }
        Tt[t] = 1;
    }
}

/* T = (I + A)^-1 from A (C, C), by groups of 4 rows (gdnc_T_rows; a constant 4, so that the rows'
 * accumulators stay in registers) */
static void gdnc_T(const gdnc_buf * b, const real * A, int64_t L) {
    int64_t t0 = 0;
    for (; t0 + 4 <= L; t0 += 4) gdnc_T_rows(b, A, t0, 4);
    if (t0 < L) gdnc_T_rows(b, A, t0, (int) (L - t0));
}

/* KK = K K^T (lower part; gdnc_make_KK), then T = (I + A)^-1 with A[t][s] = beta_t KK[t][s] D[t][s] (s < t), by
 * rows: T[t] = e_t - sum_{u<t} A[t][u] T[u]. T is zero above its diagonal (up to C). A goes to P
 * (free here: the forward and the backward fill it later). */
static void gdnc_make_KK(const gdn_params * p, const gdnc_buf * b, int64_t L) {
    ssm_mm(&(ssm_mm_args) { .M = L, .J = gdn_pad(L), .K = p->S, .X = b->Kc, .xi = b->Sp, .xk = 1, .Y = b->KT,
                            .ys = GDN_CHUNK, .O = b->KK, .os = GDN_CHUNK, .shape = SSM_MM_OUT_LOWER });
}

/* gdnc_make_T after KK */
static void gdnc_make_AT(const gdnc_buf * b, int64_t L) {
    const int64_t C = GDN_CHUNK;
    for (int64_t t = 0; t < L; ++t) {
        real * At = b->P + t * C;
        const real bt = b->beta[t];
        for (int64_t s = 0; s < t; ++s) At[s] = bt * b->KK[t * C + s] * b->D[t * C + s];
    }
    gdnc_T(b, b->P, L);
}

static void gdnc_make_T(const gdn_params * p, const gdnc_buf * b, int64_t L) {
    gdnc_make_KK(p, b, L);
    gdnc_make_AT(b, L);
}

/* The key part of a chunk's forward (after gdnc_load_keys): KK, and with want_o QK = Q K^T (lower) */
static void gdnc_chunk_keys(const gdn_params * p, const gdnc_buf * b, int64_t L, int want_o) {
    gdnc_make_KK(p, b, L);
    if (want_o)
        ssm_mm(&(ssm_mm_args) { .M = L, .J = gdn_pad(L), .K = p->S, .X = b->Qc, .xi = b->Sp, .xk = 1, .Y = b->KT,
                                .ys = GDN_CHUNK, .O = b->QK, .os = GDN_CHUNK, .shape = SSM_MM_OUT_LOWER });
}

/* T's columns scaled by beta: T diag(beta), so that T diag(beta) Y needs no scaled copy of Y */
static void gdnc_T_beta(const gdnc_buf * b, int64_t L) {
    const int64_t C = GDN_CHUNK;
    for (int64_t t = 0; t < L; ++t) {
        real * restrict Tt = b->T + t * C;
        const real * restrict be = b->beta;
        for (int64_t s = 0; s <= t; ++s) Tt[s] *= be[s];
    }
}

/* The chunk's deltas, after T (unscaled): Y = V - diag(gamma) K H0 (the product's sums scaled by
 * -gamma_t, rounded, then V's rows added: V with row stride vs, Sp columns), T becomes T diag(beta),
 * Dl = T Y. */
static void gdnc_chunk_delta(const gdn_params * p, const gdnc_buf * b, int64_t L, const real * V, int64_t vs,
                             ssm_pf * pf) {
    const int64_t S = p->S, Sp = b->Sp, C = GDN_CHUNK;
    for (int64_t t = 0; t < L; ++t) b->cvec[t] = -b->gam[t];
    ssm_mm(&(ssm_mm_args) { .M = L, .J = Sp, .K = S, .X = b->Kc, .xi = Sp, .xk = 1, .Y = b->H, .ys = Sp, .O = b->Y,
                            .os = Sp, .rs = b->cvec, .pf = pf });
    for (int64_t t = 0; t < L; ++t) {
        real * restrict y = b->Y + t * Sp;
        const real * restrict v = V + t * vs;
        for (int64_t j = 0; j < Sp; ++j) y[j] += v[j];
    }
    gdnc_T_beta(b, L);
    ssm_mm(&(ssm_mm_args) { .M = L, .J = Sp, .K = L, .X = b->T, .xi = C, .xk = 1, .Y = b->Y, .ys = Sp, .O = b->Dl,
                            .os = Sp, .shape = SSM_MM_LOWER, .pf = pf });
}

/* H becomes the state after the chunk: H_L = gamma_L H0 + K^T diag(D_L) Dl */
static void gdnc_chunk_state(const gdn_params * p, const gdnc_buf * b, int64_t L, ssm_pf * pf) {
    const int64_t S = p->S, Sp = b->Sp;
    for (int64_t t = 0; t < L; ++t) {
        real * restrict ds = b->DS + t * Sp;
        const real * restrict dl = b->Dl + t * Sp;
        const real dL = b->DL[t];
        for (int64_t j = 0; j < Sp; ++j) ds[j] = dL * dl[j];
    }
    ssm_mm(&(ssm_mm_args) { .M = S, .J = Sp, .K = L, .X = b->Kc, .xi = 1, .xk = Sp, .Y = b->DS, .ys = Sp, .O = b->H,
                            .os = Sp, .Z = b->H, .beta = b->gam[L - 1], .pf = pf });
}

#endif /* GDN_CHUNK_H */
