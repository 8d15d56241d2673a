/*
 * gdn_kda_chunked_body.h -- GATED_DELTA_NET forward and backward in the chunked (WY / UT-transform) form
 * for the per-channel gate (KDA: g of shape (n_seqs, n_t, H_v, S), S_t = diag(exp(g_t)) S_{t-1} + ...),
 * written once for the element type `real` (ssm_real_f32.h / ssm_real_f64.h). Included only by the
 * instantiation files csrc/inst/gdn_kda_chunked_<type>_v<N>.c; every function here is static with its
 * plain name. Which calls take it: gdnk_uses_chunked_at (gdn_kda_chunked.h): the per-channel gate, K == 1.
 *
 * Per (sequence, value head) the tokens are cut into chunks of GDN_CHUNK (the last may be shorter). The
 * state is H[i][j] (i: key channel, the one the gate scales; j: value channel; ggml stores its
 * transpose), rows of Sp = S padded to 16. Within a chunk of L tokens, with H0 the state before it,
 * G_t[i] the sum of g[i] over the chunk's tokens up to t (in double), Gam_t = exp(G_t) (a vector),
 * E_ts[i] = exp(G_t[i] - G_s[i]) for s <= t, and DL_s = E_{L-1,s}:
 *
 *   KK[t][s] = sum_i k_t[i] k_s[i] E_ts[i]   (s < t)      QK[t][s] = sum_i q_t[i] k_s[i] E_ts[i]   (s <= t)
 *   T   = (I + diag(beta) KK)^-1                            (forward substitution)
 *   Y   = V - (Gam (.) K) H0                                 (L, S)
 *   Dl  = T diag(beta) Y                                     the rows delta_t of the recurrence
 *   O   = c ((Gam (.) Q) H0 + QK Dl)                         c = 1/sqrt(S)
 *   H_L = diag(Gam_{L-1}) H0 + (DL (.) K)^T Dl
 *
 * which is the token recurrence unrolled over the chunk. The numerics of the per-channel decays: a
 * decay is only ever exp of G_t - G_s with s <= t (a difference of cumulative sums taken in double, <= 0
 * for g <= 0), or a product of two such factors exp(G_t - G_r) exp(G_r - G_s) with s < r <= t; never a
 * ratio exp(G_t) / exp(G_s) nor a factor exp(-G_s): the usual rewrite (k_t Gam_t) . (k_s / Gam_s) would
 * overflow per channel (one channel's gate may sum to -100 inside a chunk while another's is 0). KK and
 * QK are built by blocks of GDNK_SUB tokens (gdnk_pairs_fwd): a block's rows against the earlier tokens
 * as ssm_mm products of rows scaled by the two factors around the block's first token r, the pairs
 * inside a block one by one with their own exp; the backward (gdnk_pairs_back) uses the same blocks.
 * The state terms use Gam_t and DL_s, both <= 1. A gate below GDNK_G_FLOOR (-1e4, as the scalar form's)
 * is taken as it: exp of it, and of any difference spanning it, is exactly 0, so g = -inf gives the
 * recurrence's exact zeros, not inf - inf. Sums are in an order fixed by the shape (gdnk_dot2's lanes,
 * ssm_mm's products), so the result does not depend on the thread count; it differs from the
 * recurrence by rounding.
 *
 * The backward runs the chunks forward once keeping, per chunk, H0, Y, Dl, KK and QK, then the chunks
 * in reverse, recomputing the rest and applying the VJP of the lines above (gdnk_chunk_back). Where
 * asked (gdn_fwd_keep_*), the forward writes those five of every chunk out (gdnk_kept_chunk_elems' layout),
 * the same bits (gdnk_chunk_fwd computes them alike with and without o), and the backward given them
 * (gdn_back_kept_*) reads them instead: that pass, a quarter of the backward's multiply-adds, is gone.
 */
#ifndef SSM_REAL_H
#error "include ssm_real_f32.h or ssm_real_f64.h before gdn_kda_chunked_body.h"
#endif

#include <string.h>

#include "ssm_common.h"
#include "ssm_mutant.h"
#include "gdn_common.h"
#include "gdn_kda_chunked.h"
#include "gdn_grads.h"
#include "ssm_mm.h"
#include "gdn_keep.h"
#include "gdn_transpose.h"

/* A gate below this is taken as this (the scalar chunked form's floor, GDNC_G_FLOOR in gdn_chunk.h). */
#define GDNK_G_FLOOR (-1e4)

/* the six inputs, typed; and for the backward, the forward's kept chunks (gdn_back_kept_*) or NULL */
typedef struct {
    const real * q, * k, * v, * g, * beta, * state;
    const real * kept;
} gdnk_inputs;

/* one thread's scratch (gdnk_carve: the order of gdnk_fwd_thread_elems / gdnk_back_thread_elems) */
typedef struct {
    int64_t Sp;
    /* forward */
    real * H;                                              /* (Sp, Sp) the running state H[i][j] */
    real * Kc, * Qc, * Vc, * Kg, * Qg, * Kd, * DLv, * Gam;   /* (C, Sp): k, q, v, Gam k, Gam q, DL k, DL, Gam */
    real * Y, * R, * Dl, * Ob, * KH, * Ex;                 /* (C, Sp); Ex: one row's exp(G_t - G_s) */
    real * KcT, * Rk, * Rq, * Fr, * Fc;                    /* (Sp, C), then (C, Sp): gdnk_block_scale's */
    double * G, * G0;                                      /* (C, Sp); (Sp) zeros: the G before the chunk */
    real * KK, * QK, * T, * P;                             /* (C, C) */
    real * beta, * cvec;                                   /* (C) */
    /* backward */
    real * HT, * dH, * dHT;                                /* (Sp, Sp) */
    real * dO, * dDl, * KdH, * dR, * dV, * mdV, * E, * dQc, * dKc, * dKd, * dG;   /* (C, Sp) */
    real * dRq, * dRk, * dKs;                              /* (C, Sp): gdnk_pairs_back's blocks */
    real * DlT;                                            /* (Sp, C) */
    real * dQK, * dA, * dKK;                               /* (C, C) */
    real * dbeta;                                          /* (C) */
    real * Hs, * Ys, * Dls, * KKs, * QKs;                  /* per chunk: (Sp, Sp), (C, Sp) x 2, (C, C) x 2 */
} gdnk_buf;

static real * gdnk_take(real ** at, int64_t n) {
    real * r = *at;
    *at += n;
    return r;
}

static void gdnk_carve(const gdn_params * p, real * base, int back, gdnk_buf * b) {
    const int64_t Sp = gdn_pad(p->S), C = GDN_CHUNK, SS = Sp * Sp, CS = C * Sp, CC = C * C;
    real * at = base;
    b->Sp = Sp;
    b->H = gdnk_take(&at, SS);
    b->Kc = gdnk_take(&at, CS);
    b->Qc = gdnk_take(&at, CS);
    b->Vc = gdnk_take(&at, CS);
    b->Kg = gdnk_take(&at, CS);
    b->Qg = gdnk_take(&at, CS);
    b->Kd = gdnk_take(&at, CS);
    b->DLv = gdnk_take(&at, CS);
    b->Gam = gdnk_take(&at, CS);
    b->Y = gdnk_take(&at, CS);
    b->R = gdnk_take(&at, CS);
    b->Dl = gdnk_take(&at, CS);
    b->Ob = gdnk_take(&at, CS);
    b->KH = gdnk_take(&at, CS);
    b->Ex = gdnk_take(&at, CS);
    b->KcT = gdnk_take(&at, CS);
    b->Rk = gdnk_take(&at, CS);
    b->Rq = gdnk_take(&at, CS);
    b->Fr = gdnk_take(&at, CS);
    b->Fc = gdnk_take(&at, CS);                /* GDNK_FWD_CS = 19 */
    b->G = (double *) gdnk_take(&at, 2 * CS);  /* 2 CS reals hold CS doubles */
    b->G0 = (double *) gdnk_take(&at, 2 * Sp);
    b->KK = gdnk_take(&at, CC);
    b->QK = gdnk_take(&at, CC);
    b->T = gdnk_take(&at, CC);
    b->P = gdnk_take(&at, CC);                 /* GDNK_FWD_CC = 4 */
    b->beta = gdnk_take(&at, C);
    b->cvec = gdnk_take(&at, C);               /* GDNK_FWD_C = 2 */
    if (!back) return;
    b->HT = gdnk_take(&at, SS);
    b->dH = gdnk_take(&at, SS);
    b->dHT = gdnk_take(&at, SS);               /* GDNK_BACK_SS = 3 */
    b->dO = gdnk_take(&at, CS);
    b->dDl = gdnk_take(&at, CS);
    b->KdH = gdnk_take(&at, CS);
    b->dR = gdnk_take(&at, CS);
    b->dV = gdnk_take(&at, CS);
    b->mdV = gdnk_take(&at, CS);
    b->E = gdnk_take(&at, CS);
    b->dQc = gdnk_take(&at, CS);
    b->dKc = gdnk_take(&at, CS);
    b->dKd = gdnk_take(&at, CS);
    b->dG = gdnk_take(&at, CS);
    b->dRq = gdnk_take(&at, CS);
    b->dRk = gdnk_take(&at, CS);
    b->dKs = gdnk_take(&at, CS);                /* GDNK_BACK_CS = 14 */
    b->DlT = gdnk_take(&at, Sp * C);
    b->dQK = gdnk_take(&at, CC);
    b->dA = gdnk_take(&at, CC);
    b->dKK = gdnk_take(&at, CC);               /* GDNK_BACK_CC = 3 */
    b->dbeta = gdnk_take(&at, C);              /* GDNK_BACK_C = 1 */
    b->Hs = gdnk_take(&at, gdnc_n_chunks(p) * SS);
    b->Ys = gdnk_take(&at, gdnc_n_chunks(p) * CS);
    b->Dls = gdnk_take(&at, gdnc_n_chunks(p) * CS);
    b->KKs = gdnk_take(&at, gdnc_n_chunks(p) * CC);
    b->QKs = gdnk_take(&at, gdnc_n_chunks(p) * CC);
}

/* x . y over n elements, in increasing order */
static inline real gdnk_dot(const real * x, const real * y, int64_t n) {
    real s = 0;
    for (int64_t i = 0; i < n; ++i) s += x[i] * y[i];
    return s;
}

/* Below level 4: e[i] = exp(e[i]) for i < n, by real_exp_poly_fast where the whole row is in its range (then
 * equal to real_exp_poly bit for bit), a loop GCC vectorizes there, else by real_exp_poly, whose loop GCC 12
 * leaves scalar at x86-64-v3 (with it these exps were 40% of that pass's KDA backward). */
#if SSM_LEVEL < 4
static inline void gdnk_exp_rows(real * restrict e, int64_t n) {
    int out = 0;
    for (int64_t i = 0; i < n; ++i) out |= !(e[i] >= -REAL_EXP_FAST_MAX && e[i] <= REAL_EXP_FAST_MAX);
    if (!out)
        for (int64_t i = 0; i < n; ++i) e[i] = real_exp_poly_fast(e[i]);
    else
        for (int64_t i = 0; i < n; ++i) e[i] = real_exp_poly(e[i]);
}
#endif

/* e[i] = exp((real) (a[i] - b[i])) for i < n (the difference in double); below level 4 by gdnk_exp_rows.
 * Level 4 vectorizes real_exp_poly's loop with masks, and the two passes were slower there (the forward +20%) */
static inline void gdnk_exp_diff(real * restrict e, const double * restrict a, const double * restrict b, int64_t n) {
#if SSM_LEVEL >= 4
    for (int64_t i = 0; i < n; ++i) e[i] = real_exp_poly((real) (a[i] - b[i]));
#else
    for (int64_t i = 0; i < n; ++i) e[i] = (real) (a[i] - b[i]);
    gdnk_exp_rows(e, n);
#endif
}

/* n values at src with element stride st into dst, zero from n to Sp */
static inline void gdnk_row(real * dst, const real * src, int64_t st, int64_t n, int64_t Sp) {
    if (st == 1) memcpy(dst, src, (size_t) n * sizeof(real));
    else
        for (int64_t i = 0; i < n; ++i) dst[i] = src[i * st];
    for (int64_t i = n; i < Sp; ++i) dst[i] = 0;
}

/* The state of (n, h) from a (n_seqs, H_v, S, S) array stored transposed (x[n, h, j, i] = H[i][j],
 * strides st) into H (Sp, Sp) */
static void gdnk_load_state(const gdn_params * p, const real * x, const int64_t * st, real * H, int64_t Sp, int64_t n,
                            int64_t h) {
    const int64_t S = p->S;
    const real * base = x + n * st[0] + h * st[1];
    for (int64_t i = 0; i < S; ++i)
        for (int64_t j = 0; j < S; ++j) H[i * Sp + j] = base[j * st[2] + i * st[3]];
}

/* Loads chunk [t0, t0 + L) of (n, h): Kc, Qc, Vc (if want_v), beta, G, Gam, Kg, Qg, DLv, Kd. Padding
 * channels (S..Sp) have G 0 and k, q 0, so every product over them adds exact zeros. */
static void gdnk_load(const gdn_params * p, const gdnk_inputs * in, const gdnk_buf * b, int64_t n, int64_t h,
                      int64_t t0, int64_t L, int want_v) {
    const int64_t S = p->S, Sp = b->Sp;
    const int64_t nk = gdn_key_seq(p, n), kh = gdn_key_head(p, h);
    const int64_t * qs = p->q_st, * ks = p->k_st, * vs = p->v_st, * gs = p->g_st, * bs = p->beta_st;
    for (int64_t t = 0; t < L; ++t) {
        const int64_t tt = t0 + t;
        gdnk_row(b->Kc + t * Sp, in->k + nk * ks[0] + tt * ks[1] + kh * ks[2], ks[3], S, Sp);
        gdnk_row(b->Qc + t * Sp, in->q + nk * qs[0] + tt * qs[1] + kh * qs[2], qs[3], S, Sp);
        if (want_v) gdnk_row(b->Vc + t * Sp, in->v + n * vs[0] + tt * vs[1] + h * vs[2], vs[3], S, Sp);
        b->beta[t] = in->beta[n * bs[0] + tt * bs[1] + h * bs[2]];
        const real * restrict g = in->g + n * gs[0] + tt * gs[1] + h * gs[2];
        double * restrict Gt = b->G + t * Sp;
        const double * restrict Gp = t > 0 ? b->G + (t - 1) * Sp : b->G0;   /* G0: zeros */
        const int64_t st = gs[3];
        for (int64_t i = 0; i < S; ++i) {   /* -inf is taken as the floor: differences of G stay finite */
            double gv = (double) g[i * st];
            gv = gv < GDNK_G_FLOOR ? GDNK_G_FLOOR : gv;   /* (NaN stays NaN) */
            Gt[i] = Gp[i] + gv;
        }
        for (int64_t i = S; i < Sp; ++i) Gt[i] = 0;
    }
    const double * restrict GL = b->G + (L - 1) * Sp;
    for (int64_t t = 0; t < L; ++t) {
        const double * restrict Gt = b->G + t * Sp;
        real * restrict gam = b->Gam + t * Sp, * restrict dl = b->DLv + t * Sp;
        real * restrict kg = b->Kg + t * Sp, * restrict qg = b->Qg + t * Sp, * restrict kd = b->Kd + t * Sp;
        const real * restrict k = b->Kc + t * Sp, * restrict q = b->Qc + t * Sp;
#if SSM_LEVEL >= 4
        for (int64_t i = 0; i < Sp; ++i) gam[i] = real_exp_poly((real) Gt[i]);   /* (one exp per loop: vectorized) */
#else
        for (int64_t i = 0; i < Sp; ++i) gam[i] = (real) Gt[i];
        gdnk_exp_rows(gam, Sp);
#endif
        gdnk_exp_diff(dl, GL, Gt, Sp);
        for (int64_t i = 0; i < Sp; ++i) {
            kg[i] = gam[i] * k[i];
            qg[i] = gam[i] * q[i];
            kd[i] = dl[i] * k[i];
        }
    }
}

/* Ex[s] = exp(G_t - G_s) for s0 <= s < t (channel by channel; the difference in double, <= 0 for g <= 0) */
static void gdnk_exp_row(const gdnk_buf * b, int64_t s0, int64_t t) {
    const int64_t Sp = b->Sp;
    for (int64_t s = s0; s < t; ++s) gdnk_exp_diff(b->Ex + s * Sp, b->G + t * Sp, b->G + s * Sp, Sp);
}

/* *kk = kt . (ks (.) e), *qk = qt . (ks (.) e) over Sp channels (a multiple of 16), each in REAL_LANES
 * running sums (lane l takes channels l, l + REAL_LANES, ...) added in lane order: a fixed order */
static inline void gdnk_dot2(const real * restrict kt, const real * restrict qt, const real * restrict ks,
                             const real * restrict e, int64_t Sp, real * kk, real * qk) {
    real a[REAL_LANES] = { 0 }, c[REAL_LANES] = { 0 };
    for (int64_t i0 = 0; i0 < Sp; i0 += REAL_LANES)
        for (int l = 0; l < REAL_LANES; ++l) {
            const real ke = ks[i0 + l] * e[i0 + l];
            a[l] += kt[i0 + l] * ke;
            c[l] += qt[i0 + l] * ke;
        }
    real ra = 0, rc = 0;
    for (int l = 0; l < REAL_LANES; ++l) {
        ra += a[l];
        rc += c[l];
    }
    *kk = ra;
    *qk = rc;
}

/* The chunk's tokens in blocks of GDNK_SUB from r (the block's first token). Rows t of the block against
 * the earlier tokens s < r: exp(G_t - G_s) = exp(G_t - G_r) exp(G_r - G_s), both factors <= 1 for g <= 0
 * (r lies between s and t), so the block's rows scaled by the first (Rk, Rq) times the earlier rows
 * scaled by the second (KcT, transposed) are a product (ssm_mm) with no overflow, and an underflow to 0
 * only where the exact value is below float's range too. Pairs inside the block take their own exp. */
#define GDNK_SUB 16

/* the block [r, e1): Fr rows r..e1-1 = exp(G_t - G_r), Rk, Rq = k_t, q_t (.) Fr; for s < r, Fc[s] =
 * exp(G_r - G_s), Ex[s] = k_s (.) Fc[s], and KcT its transpose (KcT[i][s]) */
static void gdnk_block_scale(const gdnk_buf * b, int64_t r, int64_t e1) {
    const int64_t Sp = b->Sp, C = GDN_CHUNK;
    const double * restrict Gr = b->G + r * Sp;
    for (int64_t t = r; t < e1; ++t) {
        const double * restrict Gt = b->G + t * Sp;
        real * restrict rk = b->Rk + t * Sp, * restrict rq = b->Rq + t * Sp, * restrict fr = b->Fr + t * Sp;
        const real * restrict k = b->Kc + t * Sp, * restrict q = b->Qc + t * Sp;
        gdnk_exp_diff(fr, Gt, Gr, Sp);
        for (int64_t i = 0; i < Sp; ++i) {
            rk[i] = k[i] * fr[i];
            rq[i] = q[i] * fr[i];
        }
    }
    for (int64_t s = 0; s < r; ++s) {
        const double * restrict Gs = b->G + s * Sp;
        const real * restrict k = b->Kc + s * Sp;
        real * restrict e = b->Ex + s * Sp, * restrict fc = b->Fc + s * Sp;
        gdnk_exp_diff(fc, Gr, Gs, Sp);
        for (int64_t i = 0; i < Sp; ++i) e[i] = k[i] * fc[i];
    }
    gdnc_transpose(b->KcT, C, b->Ex, Sp, r, Sp);
}

/* KK (strictly lower) and QK (lower, diagonal included) of the chunk, zero above up to Lp: by blocks of
 * GDNK_SUB rows, the columns before the block as two products (gdnk_block_scale), the pairs inside it
 * one by one, each term with its own exp(G_t - G_s) <= 1 (gdnk_exp_row, gdnk_dot2) */
static void gdnk_pairs_fwd(const gdnk_buf * b, int64_t L) {
    const int64_t Sp = b->Sp, C = GDN_CHUNK, Lp = gdn_pad(L);
    for (int64_t r = 0; r < L; r += GDNK_SUB) {
        const int64_t e1 = ssm_min64(r + GDNK_SUB, L);
        if (r > 0) {
            gdnk_block_scale(b, r, e1);
            ssm_mm(&(ssm_mm_args) { .M = e1 - r, .J = r, .K = Sp, .X = b->Rk + r * Sp, .xi = Sp, .xk = 1, .Y = b->KcT,
                                    .ys = C, .O = b->KK + r * C, .os = C });
            ssm_mm(&(ssm_mm_args) { .M = e1 - r, .J = r, .K = Sp, .X = b->Rq + r * Sp, .xi = Sp, .xk = 1, .Y = b->KcT,
                                    .ys = C, .O = b->QK + r * C, .os = C });
        }
        for (int64_t t = r; t < e1; ++t) {
            const real * Kt = b->Kc + t * Sp, * Qt = b->Qc + t * Sp;
            real * KKt = b->KK + t * C, * QKt = b->QK + t * C;
            gdnk_exp_row(b, r, t);
            for (int64_t s = r; s < t; ++s) gdnk_dot2(Kt, Qt, b->Kc + s * Sp, b->Ex + s * Sp, Sp, KKt + s, QKt + s);
            QKt[t] = gdnk_dot(Qt, Kt, Sp);
            KKt[t] = 0;
            for (int64_t s = t + 1; s < Lp; ++s) KKt[s] = QKt[s] = 0;
        }
    }
}

/* T = (I + A)^-1 with A[t][s] = beta_t KK[t][s] (s < t), by rows: T[t] = e_t - sum_{u<t} A[t][u] T[u];
 * T is zero above its diagonal (up to Lp) */
static void gdnk_make_T(const gdnk_buf * b, const real * KK, int64_t L) {
    const int64_t C = GDN_CHUNK, Lp = gdn_pad(L);
    for (int64_t t = 0; t < L; ++t) {
        real * Tt = b->T + t * C;
        for (int64_t s = 0; s < Lp; ++s) Tt[s] = 0;
        for (int64_t u = 0; u < t; ++u) {
            const real a = b->beta[t] * KK[t * C + u];
            const real * Tu = b->T + u * C;
            for (int64_t s = 0; s <= u; ++s) Tt[s] -= a * Tu[s];
        }
        Tt[t] = 1;
    }
}

/* The forward of one chunk from H (the state before it): KK, QK, T, Y, R, Dl; with want_o the chunk's o
 * rows into Ob (C, Sp); then H becomes the state after the chunk. */
static void gdnk_chunk_fwd(const gdn_params * p, const gdnk_buf * b, int64_t L, int want_o) {
    const int64_t S = p->S, Sp = b->Sp, C = GDN_CHUNK;
    const real c = (real) 1 / real_sqrt((real) S);
    gdnk_pairs_fwd(b, L);
    gdnk_make_T(b, b->KK, L);
    ssm_mm(&(ssm_mm_args) { .M = L, .J = Sp, .K = S, .X = b->Kg, .xi = Sp, .xk = 1, .Y = b->H, .ys = Sp, .O = b->KH,
                            .os = Sp });
    for (int64_t t = 0; t < L; ++t)
        for (int64_t j = 0; j < Sp; ++j) {
            const real y = b->Vc[t * Sp + j] - b->KH[t * Sp + j];
            b->Y[t * Sp + j] = y;
            b->R[t * Sp + j] = b->beta[t] * y;
        }
    ssm_mm(&(ssm_mm_args) { .M = L, .J = Sp, .K = L, .X = b->T, .xi = C, .xk = 1, .Y = b->R, .ys = Sp, .O = b->Dl,
                            .os = Sp, .shape = SSM_MM_LOWER });
    if (want_o) {
        for (int64_t t = 0; t < L; ++t) {
            for (int64_t s = 0; s < C; ++s) b->P[t * C + s] = s <= t ? c * b->QK[t * C + s] : 0;
            b->cvec[t] = c;
        }
        ssm_mm(&(ssm_mm_args) { .M = L, .J = Sp, .K = S, .X = b->Qg, .xi = Sp, .xk = 1, .Y = b->H, .ys = Sp,
                                .O = b->Ob, .os = Sp, .rs = b->cvec });
        ssm_mm(&(ssm_mm_args) { .M = L, .J = Sp, .K = L, .X = b->P, .xi = C, .xk = 1, .Y = b->Dl, .ys = Sp,
                                .O = b->Ob, .os = Sp, .acc = 1, .shape = SSM_MM_LOWER });
    }
    const real * gL = b->Gam + (L - 1) * Sp;   /* H = diag(Gam_{L-1}) H + Kd^T Dl */
    for (int64_t i = 0; i < S; ++i)
        for (int64_t j = 0; j < Sp; ++j) b->H[i * Sp + j] *= gL[i];
    ssm_mm(&(ssm_mm_args) { .M = S, .J = Sp, .K = L, .X = b->Kd, .xi = 1, .xk = Sp, .Y = b->Dl, .ys = Sp, .O = b->H,
                            .os = Sp, .acc = 1 });
}

/* Forward of one (sequence n, value head h); with kept, each chunk's H0, Y, Dl, KK, QK into it. */
static void gdnk_fwd_unit(const gdn_params * p, const gdnk_inputs * in, real * out, real * kept, const gdnk_buf * b,
                          int64_t n, int64_t h) {
    const int64_t S = p->S, Sp = b->Sp, n_t = p->n_t, E = gdnk_kept_chunk_elems(p);
    gdnk_load_state(p, in->state, p->state_st, b->H, Sp, n, h);
    real * kh = kept ? kept + (n * p->H_v + h) * gdnc_n_chunks(p) * E : NULL;
    for (int64_t t0 = 0; t0 < n_t; t0 += GDN_CHUNK) {
        const int64_t L = ssm_min64(GDN_CHUNK, n_t - t0);
        gdnk_load(p, in, b, n, h, t0, L, 1);
        real * kc = kh ? kh + t0 / GDN_CHUNK * E : NULL;
        if (kc) gdn_keep_copy(kc, b->H, Sp * Sp);   /* the state before the chunk */
        gdnk_chunk_fwd(p, b, L, 1);
        if (kc) gdn_keep_rows(kc, b->Sp, L, b->Y, b->Dl, b->KK, b->QK);   /* Y, Dl, KK, QK after the state */
        for (int64_t t = 0; t < L; ++t) {
            real * o = out + ((n * n_t + t0 + t) * p->H_v + h) * S;
            for (int64_t j = 0; j < S; ++j) o[j] = SSM_MUTANT(SSM_MUT_GDN_KCK_FWD, b->Ob[t * Sp + j]);
        }
    }
    real * dst = out + p->n_seqs * n_t * p->H_v * S + (n * p->H_v + h) * S * S;
    gdnc_transpose(dst, S, b->H, Sp, S, S);
}

/* Forward: threads split the (sequence, value head) pairs. The scratch is zeroed first: the padding of
 * every matrix stays zero. */
static void gdnk_fwd(const gdn_params * p, const gdnk_inputs * in, real * out, real * kept, void * work, int ith,
                     int nth) {
    int64_t lo, hi;
    ssm_split(p->n_seqs * p->H_v, ith, nth, &lo, &hi);
    if (lo >= hi) return;
    real * base = (real *) work + ith * gdnk_fwd_thread_elems(p);
    memset(base, 0, (size_t) gdnk_fwd_thread_elems(p) * sizeof(real));
    gdnk_buf b;
    gdnk_carve(p, base, 0, &b);
    for (int64_t u = lo; u < hi; ++u) gdnk_fwd_unit(p, in, out, kept, &b, u / p->H_v, u % p->H_v);
    if (kept) gdn_keep_fence();
}

/* ------------------------------------------------------------------ backward
 *
 * The VJP of one chunk, given H0, Y, Dl, KK, QK (kept by the forward pass), its inputs (gdnk_load),
 * dO = c * the gradient of its o rows, and dH = the gradient of H_L; dH becomes that of H0.
 *   o:      dQK = dO Dl^T (lower incl.)   dDl = QK^T dO   d(Gam q)_t = H0 dO_t   dH0 += (Gam Q)^T dO
 *   state:  dDl += Kd dH   dKd = Dl dH^T   dGam_{L-1}[i] = <H0[i], dH[i]>   dH0 += diag(Gam_{L-1}) dH
 *   solve:  dR = T^T dDl   dV = diag(beta) dR   dbeta_t = dR_t . Y_t   d(Gam k)_t = -H0 dV_t
 *           dH0 -= (Gam K)^T dV
 *   T:      dA = -dR Dl^T (strictly lower)   dbeta_t += sum_s dA KK   dKK = diag(beta) dA
 *   pairs:  the VJP of KK and QK term by term (gdnk_pairs_back), with their d G
 *   gates:  dq += Gam (.) d(Gam q), dG_t += (Gam q) (.) d(Gam q) (and the same for k); dk += DL (.) dKd,
 *           w = Kd (.) dKd: dG_s -= w_s, dG_{L-1} += sum_s w_s; dG_{L-1} += Gam_{L-1} (.) dGam_{L-1}
 * and d g_t is the reverse cumulative sum of dG over the chunk's tokens (G restarts at every chunk).
 */

/* one pair s < t of the pairs' VJP, e = exp(G_t - G_s), w1 = dQK[t][s], w2 = dKK[t][s]:
 * dq_t += w1 k_s e, dk_t += w2 k_s e, u = (w1 q_t + w2 k_t) e: dk_s += u, dG_t += u k_s, dG_s -= u k_s */
static inline void gdnk_pair_back(int64_t Sp, real w1, real w2, const real * restrict Qt, const real * restrict Kt,
                                  const real * restrict Ks, const real * restrict e, real * restrict dQt,
                                  real * restrict dKt, real * restrict dKs, real * restrict dGt, real * restrict dGs) {
    for (int64_t i = 0; i < Sp; ++i) {
        const real ke = Ks[i] * e[i], u = (w1 * Qt[i] + w2 * Kt[i]) * e[i], cg = u * Ks[i];
        dQt[i] += w1 * ke;
        dKt[i] += w2 * ke;
        dKs[i] += u;
        dGt[i] += cg;
        dGs[i] -= cg;
    }
}

/* the VJP of a block's products with the earlier tokens (gdnk_pairs_fwd): with w1 = dQK, w2 = dKK on
 * rows [r, e1), columns s < r and Ks = Ex (k_s (.) Fc[s]): dRq = w1 Ks, dRk = w2 Ks, then dq_t += Fr dRq,
 * dk_t += Fr dRk, dG_t += Rq dRq + Rk dRk; dKs = w1^T Rq + w2^T Rk, then dk_s += Fc dKs, dG_s -= Ks dKs
 * (the block's first token's G cancels: exp(G_t - G_r) exp(G_r - G_s) depends on G_t and G_s only) */
static void gdnk_block_back(const gdnk_buf * b, int64_t r, int64_t e1) {
    const int64_t Sp = b->Sp, C = GDN_CHUNK, M = e1 - r;
    ssm_mm(&(ssm_mm_args) { .M = M, .J = Sp, .K = r, .X = b->dQK + r * C, .xi = C, .xk = 1, .Y = b->Ex, .ys = Sp,
                            .O = b->dRq + r * Sp, .os = Sp });
    ssm_mm(&(ssm_mm_args) { .M = M, .J = Sp, .K = r, .X = b->dKK + r * C, .xi = C, .xk = 1, .Y = b->Ex, .ys = Sp,
                            .O = b->dRk + r * Sp, .os = Sp });
    for (int64_t t = r; t < e1; ++t) {
        const real * restrict fr = b->Fr + t * Sp, * restrict rq = b->Rq + t * Sp, * restrict rk = b->Rk + t * Sp;
        const real * restrict dq = b->dRq + t * Sp, * restrict dk = b->dRk + t * Sp;
        real * restrict dQt = b->dQc + t * Sp, * restrict dKt = b->dKc + t * Sp, * restrict dGt = b->dG + t * Sp;
        for (int64_t i = 0; i < Sp; ++i) {
            dQt[i] += fr[i] * dq[i];
            dKt[i] += fr[i] * dk[i];
            dGt[i] += rq[i] * dq[i] + rk[i] * dk[i];
        }
    }
    ssm_mm(&(ssm_mm_args) { .M = r, .J = Sp, .K = M, .X = b->dQK + r * C, .xi = 1, .xk = C, .Y = b->Rq + r * Sp,
                            .ys = Sp, .O = b->dKs, .os = Sp });
    ssm_mm(&(ssm_mm_args) { .M = r, .J = Sp, .K = M, .X = b->dKK + r * C, .xi = 1, .xk = C, .Y = b->Rk + r * Sp,
                            .ys = Sp, .O = b->dKs, .os = Sp, .acc = 1 });
    for (int64_t s = 0; s < r; ++s) {
        const real * restrict fc = b->Fc + s * Sp, * restrict ks = b->Ex + s * Sp, * restrict d = b->dKs + s * Sp;
        real * restrict dKs = b->dKc + s * Sp, * restrict dGs = b->dG + s * Sp;
        for (int64_t i = 0; i < Sp; ++i) {
            dKs[i] += fc[i] * d[i];
            dGs[i] -= ks[i] * d[i];
        }
    }
}

/* the pairs' VJP by gdnk_pairs_fwd's blocks: the products with the earlier tokens (gdnk_block_back), the
 * pairs s < t inside the block (gdnk_pair_back) and s == t (e = 1, its d G terms cancel); blocks, then
 * rows t, then s, in increasing order: a fixed order */
static void gdnk_pairs_back(const gdnk_buf * b, int64_t L) {
    const int64_t Sp = b->Sp, C = GDN_CHUNK;
    for (int64_t r = 0; r < L; r += GDNK_SUB) {
        const int64_t e1 = ssm_min64(r + GDNK_SUB, L);
        if (r > 0) {
            gdnk_block_scale(b, r, e1);
            gdnk_block_back(b, r, e1);
        }
        for (int64_t t = r; t < e1; ++t) {
            const real * Kt = b->Kc + t * Sp, * Qt = b->Qc + t * Sp;
            real * dQt = b->dQc + t * Sp, * dKt = b->dKc + t * Sp, * dGt = b->dG + t * Sp;
            gdnk_exp_row(b, r, t);
            for (int64_t s = r; s < t; ++s)
                gdnk_pair_back(Sp, b->dQK[t * C + s], b->dKK[t * C + s], Qt, Kt, b->Kc + s * Sp, b->Ex + s * Sp, dQt,
                               dKt, b->dKc + s * Sp, dGt, b->dG + s * Sp);
            const real w1 = b->dQK[t * C + t];
            for (int64_t i = 0; i < Sp; ++i) {
                dQt[i] += w1 * Kt[i];
                dKt[i] += w1 * Qt[i];
            }
        }
    }
}

/* the o and state terms: dQK, dDl, dKd, dQc (= d(Gam q) for now), dG's row L-1 (Gam_{L-1} (.) dGam_{L-1}) */
static void gdnk_back_o_state(const gdn_params * p, const gdnk_buf * b, const real * H0, const real * Dl,
                              const real * QK, int64_t L) {
    const int64_t S = p->S, Sp = b->Sp, C = GDN_CHUNK, Lp = gdn_pad(L);
    gdnc_transpose(b->DlT, C, Dl, Sp, L, S);
    for (int64_t j = 0; j < S; ++j)
        for (int64_t t = L; t < Lp; ++t) b->DlT[j * C + t] = 0;
    ssm_mm(&(ssm_mm_args) { .M = L, .J = Lp, .K = S, .X = b->dO, .xi = Sp, .xk = 1, .Y = b->DlT, .ys = C,
                            .O = b->dQK, .os = C, .shape = SSM_MM_OUT_LOWER });
    for (int64_t t = 0; t < L; ++t)
        for (int64_t s = t + 1; s < Lp; ++s) b->dQK[t * C + s] = 0;
    ssm_mm(&(ssm_mm_args) { .M = L, .J = Sp, .K = L, .X = QK, .xi = 1, .xk = C, .Y = b->dO, .ys = Sp, .O = b->dDl,
                            .os = Sp, .shape = SSM_MM_UPPER });
    ssm_mm(&(ssm_mm_args) { .M = L, .J = Sp, .K = S, .X = b->Kd, .xi = Sp, .xk = 1, .Y = b->dH, .ys = Sp, .O = b->KdH,
                            .os = Sp });
    for (int64_t e = 0; e < L * Sp; ++e) b->dDl[e] += b->KdH[e];
    gdnc_transpose(b->dHT, Sp, b->dH, Sp, S, S);
    ssm_mm(&(ssm_mm_args) { .M = L, .J = Sp, .K = S, .X = Dl, .xi = Sp, .xk = 1, .Y = b->dHT, .ys = Sp, .O = b->dKd,
                            .os = Sp });
    gdnc_transpose(b->HT, Sp, H0, Sp, S, S);
    ssm_mm(&(ssm_mm_args) { .M = L, .J = Sp, .K = S, .X = b->dO, .xi = Sp, .xk = 1, .Y = b->HT, .ys = Sp, .O = b->dQc,
                            .os = Sp });
    real * dGL = b->dG + (L - 1) * Sp;
    const real * gL = b->Gam + (L - 1) * Sp;
    for (int64_t i = 0; i < S; ++i) dGL[i] = gL[i] * gdn_dot(H0 + i * Sp, b->dH + i * Sp, S);
}

/* the solve and T terms: dR, dV, mdV = -dV, dbeta, dKc (= d(Gam k) for now), dKK */
static void gdnk_back_solve(const gdn_params * p, const gdnk_buf * b, const real * Y, const real * KK, int64_t L) {
    const int64_t S = p->S, Sp = b->Sp, C = GDN_CHUNK, Lp = gdn_pad(L);
    ssm_mm(&(ssm_mm_args) { .M = L, .J = Sp, .K = L, .X = b->T, .xi = 1, .xk = C, .Y = b->dDl, .ys = Sp, .O = b->dR,
                            .os = Sp, .shape = SSM_MM_UPPER });
    for (int64_t t = 0; t < L; ++t) {
        b->dbeta[t] = gdn_dot(b->dR + t * Sp, Y + t * Sp, S);
        for (int64_t j = 0; j < Sp; ++j) {
            const real dv = b->beta[t] * b->dR[t * Sp + j];
            b->dV[t * Sp + j] = dv;
            b->mdV[t * Sp + j] = -dv;
        }
    }
    ssm_mm(&(ssm_mm_args) { .M = L, .J = Sp, .K = S, .X = b->mdV, .xi = Sp, .xk = 1, .Y = b->HT, .ys = Sp,
                            .O = b->dKc, .os = Sp });
    ssm_mm(&(ssm_mm_args) { .M = L, .J = Lp, .K = S, .X = b->dR, .xi = Sp, .xk = 1, .Y = b->DlT, .ys = C, .O = b->dA,
                            .os = C, .shape = SSM_MM_OUT_LOWER });
    for (int64_t t = 0; t < L; ++t) {
        real * dAt = b->dA + t * C, * dKKt = b->dKK + t * C;
        const real * KKt = KK + t * C;
        real db = 0;
        for (int64_t s = 0; s < t; ++s) {
            const real a = -dAt[s];
            db += a * KKt[s];
            dKKt[s] = a * b->beta[t];
        }
        for (int64_t s = t; s < Lp; ++s) dKKt[s] = 0;
        b->dbeta[t] += db;
    }
}

/* the gates' terms: d(Gam q), d(Gam k) into dq, dk and dG; dKd into dk and dG; then dH becomes the
 * gradient of H0 = diag(Gam_{L-1}) dH + (Gam Q)^T dO - (Gam K)^T dV */
static void gdnk_back_gates(const gdn_params * p, const gdnk_buf * b, int64_t L) {
    const int64_t S = p->S, Sp = b->Sp;
    real * dGL = b->dG + (L - 1) * Sp;
    for (int64_t t = 0; t < L; ++t) {
        real * dq = b->dQc + t * Sp, * dk = b->dKc + t * Sp, * dg = b->dG + t * Sp;
        const real * gam = b->Gam + t * Sp, * qg = b->Qg + t * Sp, * kg = b->Kg + t * Sp;
        const real * dl = b->DLv + t * Sp, * kd = b->Kd + t * Sp, * dkd = b->dKd + t * Sp;
        for (int64_t i = 0; i < Sp; ++i) {
            const real w = kd[i] * dkd[i];
            if (t == L - 1) dg[i] += qg[i] * dq[i] + kg[i] * dk[i];
            else dg[i] = qg[i] * dq[i] + kg[i] * dk[i] - w;
            dq[i] *= gam[i];
            dk[i] = gam[i] * dk[i] + dl[i] * dkd[i];
        }
    }
    for (int64_t t = 0; t < L - 1; ++t)   /* dG_{L-1} += sum_{s < L-1} w_s (w_{L-1} cancels itself) */
        for (int64_t i = 0; i < Sp; ++i) dGL[i] += b->Kd[t * Sp + i] * b->dKd[t * Sp + i];
    const real * gL = b->Gam + (L - 1) * Sp;
    for (int64_t i = 0; i < S; ++i)
        for (int64_t j = 0; j < Sp; ++j) b->dH[i * Sp + j] *= gL[i];
    ssm_mm(&(ssm_mm_args) { .M = S, .J = Sp, .K = L, .X = b->Qg, .xi = 1, .xk = Sp, .Y = b->dO, .ys = Sp, .O = b->dH,
                            .os = Sp, .acc = 1 });
    ssm_mm(&(ssm_mm_args) { .M = S, .J = Sp, .K = L, .X = b->Kg, .xi = 1, .xk = Sp, .Y = b->mdV, .ys = Sp, .O = b->dH,
                            .os = Sp, .acc = 1 });
}

static void gdnk_chunk_back(const gdn_params * p, const gdnk_buf * b, const real * H0, const real * Y, const real * Dl,
                            const real * KK, const real * QK, int64_t L) {
    gdnk_make_T(b, KK, L);
    gdnk_back_o_state(p, b, H0, Dl, QK, L);
    gdnk_back_solve(p, b, Y, KK, L);
    gdnk_back_gates(p, b, L);     /* before the pairs: it reads dQc, dKc as d(Gam q), d(Gam k) alone */
    gdnk_pairs_back(b, L);
}

/* Backward of one (sequence n, value head h): the chunks forward keeping H0, Y, Dl, KK, QK of each (or
 * those the forward kept, in->kept), then in reverse; d_q, d_k add to the key group's rows (zeroed by
 * gdn_back_groups). */
static void gdnk_back_unit(const gdn_params * p, const gdnk_inputs * in, const real * grad, const gdn_grads * gr,
                           const gdnk_buf * b, int64_t n, int64_t h) {
    const int64_t S = p->S, Sp = b->Sp, C = GDN_CHUNK, n_t = p->n_t, SS = Sp * Sp, CS = C * Sp, CC = C * C;
    const int64_t n_ch = gdnc_n_chunks(p), nk = gdn_key_seq(p, n), kh = gdn_key_head(p, h);
    const real c = (real) 1 / real_sqrt((real) S);
    /* chunk ch's H0, Y, Dl, KK, QK: hs + ch * hstep, ys, dls + ch * rstep, kks, qks + ch * cstep */
    const real * hs = b->Hs, * ys = b->Ys, * dls = b->Dls, * kks = b->KKs, * qks = b->QKs;
    int64_t hstep = SS, rstep = CS, cstep = CC;
    if (in->kept) {
        const int64_t E = gdnk_kept_chunk_elems(p);
        hs = in->kept + (n * p->H_v + h) * n_ch * E;
        ys = hs + gdn_kept_at(Sp, GDN_KEPT_Y);
        dls = hs + gdn_kept_at(Sp, GDN_KEPT_DL);
        kks = hs + gdn_kept_at(Sp, GDN_KEPT_KK);
        qks = hs + gdn_kept_at(Sp, GDN_KEPT_QK);
        hstep = rstep = cstep = E;
    } else {
        gdnk_load_state(p, in->state, p->state_st, b->H, Sp, n, h);
    }
    for (int64_t ch = 0; ch < n_ch && !in->kept; ++ch) {
        const int64_t t0 = ch * C, L = ssm_min64(C, n_t - t0);
        memcpy(b->Hs + ch * SS, b->H, SS * sizeof(real));
        gdnk_load(p, in, b, n, h, t0, L, 1);
        gdnk_chunk_fwd(p, b, L, 0);
        memcpy(b->Ys + ch * CS, b->Y, L * Sp * sizeof(real));
        memcpy(b->Dls + ch * CS, b->Dl, L * Sp * sizeof(real));
        memcpy(b->KKs + ch * CC, b->KK, CC * sizeof(real));
        memcpy(b->QKs + ch * CC, b->QK, CC * sizeof(real));
    }
    const int64_t g_slot0[4] = { p->H_v * S * S, S * S, S, 1 };   /* grad's slot 0, dense, transposed */
    gdnk_load_state(p, grad + p->n_seqs * n_t * p->H_v * S, g_slot0, b->dH, Sp, n, h);
    for (int64_t ch = n_ch - 1; ch >= 0; --ch) {
        const int64_t t0 = ch * C, L = ssm_min64(C, n_t - t0);
        gdnk_load(p, in, b, n, h, t0, L, 0);
        for (int64_t t = 0; t < L; ++t) {
            const real * go = grad + ((n * n_t + t0 + t) * p->H_v + h) * S;
            for (int64_t j = 0; j < S; ++j) b->dO[t * Sp + j] = c * go[j];
        }
        gdnk_chunk_back(p, b, hs + ch * hstep, ys + ch * rstep, dls + ch * rstep, kks + ch * cstep, qks + ch * cstep,
                        L);
#ifdef SSMGRAD_MUTANTS
        for (int64_t e = 0; e < SS; ++e) b->dH[e] = SSM_MUTANT(SSM_MUT_GDN_KCK_DSTATE, b->dH[e]);   /* carried */
#endif
        /* d g_t[i]: the sum of dG_u[i] over u >= t of the chunk, from u = L - 1 down (the first term added to
         * 0), summed in place in dG token by token, so that each token's row of dg is written whole (one
         * channel at a time down the tokens wrote one element per row of H_v S apart: 18% of this backward) */
        for (int64_t t = L - 1; t >= 0; --t) {
            real * restrict acc = b->dG + t * Sp;
            const real * restrict later = t + 1 < L ? b->dG + (t + 1) * Sp : NULL;
            real * restrict dg = gr->dg + ((n * n_t + t0 + t) * p->H_v + h) * S;
            for (int64_t i = 0; i < S; ++i) {
                const real a = (later ? later[i] : (real) 0) + acc[i];
                acc[i] = a;
                dg[i] = SSM_MUTANT(SSM_MUT_GDN_KCK_DG, a);
            }
        }
        for (int64_t t = 0; t < L; ++t) {
            const int64_t tt = t0 + t, nv = (n * n_t + tt) * p->H_v + h, nq = (nk * n_t + tt) * p->H_k + kh;
            gr->dbeta[nv] = SSM_MUTANT(SSM_MUT_GDN_KCK_DBETA, b->dbeta[t]);
            gdn_add_row(gr->dq + nq * S, b->dQc + t * Sp, S, SSM_MUT_GDN_KCK_DQ);
            gdn_add_row(gr->dk + nq * S, b->dKc + t * Sp, S, SSM_MUT_GDN_KCK_DK);
            gdn_put_row(gr->dv + nv * S, b->dV + t * Sp, S, SSM_MUT_GDN_KCK_DV);
        }
    }
    real * dst = gr->dstate + (n * p->H_v + h) * S * S;
    gdnc_transpose(dst, S, b->dH, Sp, S, S);
}

/* gdnk_back_unit as gdn_back_groups calls it */
static void gdnk_back_unit_of(const gdn_back_args * a, int64_t n, int64_t h) {
    gdnk_back_unit(a->p, a->in, a->grad, a->gr, a->b, n, h);
}

/* Backward: threads split the key groups (gdn_back_split); each owns every gradient its groups' heads
 * produce. */
static void gdnk_back(const gdn_params * p, const gdnk_inputs * in, const real * grad, real * gin, void * work, int ith,
                      int nth) {
    int64_t lo, hi;
    gdn_back_split(p, ith, nth, &lo, &hi);
    if (lo >= hi) return;
    gdnk_buf b;
    gdnk_carve(p, gdn_thread_scratch(work, ith, gdnk_back_thread_elems(p)), 1, &b);
    gdn_back_groups(p, in, grad, gin, &b, lo, hi, gdnk_back_unit_of, NULL);
}
