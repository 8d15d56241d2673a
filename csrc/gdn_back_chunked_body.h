/*
 * gdn_back_chunked_body.h -- GATED_DELTA_NET backward (vector-Jacobian product) in the chunked form,
 * written once for the element type `real` (ssm_real_f32.h / ssm_real_f64.h): gdnc_back. It runs the
 * chunks forward once keeping, per chunk, H0, Y and Dl (the chunk-boundary states and two (L, S)
 * matrices), then the chunks in reverse, recomputing the rest and applying the VJP of the six lines of
 * gdn_chunk.h (gdnc_chunk_back). Given the forward's kept chunks (in->kept: gdn_fwd_keep_*, the same bits
 * as that pass and as the reverse pass's K K^T, Q K^T and T) it reads them instead, and the pass is gone: of
 * a chunk's products the K H0, T Y and K^T Dl ones, both K K^T, Q K^T and both T. Where a key group has more
 * than one unit, term 4's dQK and dKK add up over the group and their products with Q and K run once per group
 * (gdnc_back_group_end). The forward is
 * gdn_chunked_body.h; the packed gradient and the thread split, gdn_grads.h. Included only by the
 * instantiation files csrc/inst/gdn_chunked_<type>_v<N>.c (after gdn_chunked_body.h); every function here
 * is static with its plain name.
 */
#ifndef SSM_REAL_H
#error "include ssm_real_f32.h or ssm_real_f64.h before gdn_back_chunked_body.h"
#endif

#include <string.h>

#include "ssm_common.h"
#include "gdn_common.h"
#include "gdn_grads.h"
#include "ssm_mm.h"
#include "gdn_chunk.h"

/* The backward's forward pass over one chunk from H (the state before it), after gdnc_load and
 * gdnc_chunk_keys: Y, Dl; then H becomes the state after the chunk. */
static void gdnc_chunk_fwd(const gdn_params * p, const gdnc_buf * b, int64_t L) {
    gdnc_make_AT(b, L);
    gdnc_chunk_delta(p, b, L, b->Vc, b->Sp, NULL);
    gdnc_chunk_state(p, b, L, NULL);
}

/*
 * The VJP of one chunk (the six lines of gdn_chunk.h), given H0 = Hs[c], Y, Dl of the chunk (kept
 * by the forward pass), its inputs (gdnc_load), dO = c * the gradient of its o rows, and dH = the
 * gradient of H_L; dH becomes that of H0. Writes dQc, dKc (this head's share), dV, dbeta, dGt (the
 * gradient of G_t; d g is its reverse cumulative sum). Five terms, one function each:
 *   term 1, O = c (diag(gamma) Q H0 + P Dl), P = QK^T (.) D (unscaled):
 *        dP = dO Dl^T (lower incl.)   dDl = P^T dO   dQK = dP (.) D   dD += dP (.) QK
 *        (its diag(gamma) Q H0 part is in term 3's products: dq_t += gamma_t H0 dO_t,
 *        dgamma_t += q_t . H0 dO_t, dH0 += Q^T diag(gamma) dO)
 *   term 2, H_L = gamma_L H0 + K^T diag(D_L) Dl:   dgamma_L = <H0, dH>   dDl_s += D_L[s] (K dH)_s
 *        dk_s = D_L[s] dH delta_s   dD_L[s] = (K dH)_s . delta_s
 *   term 3, Dl = T R, R = diag(beta) Y, Y = V - diag(gamma) K H0:   dR = T^T dDl   dV = diag(beta) dR
 *        dbeta_t = dR_t . Y_t   dgamma_t -= k_t . H0 dV_t   dk_t -= gamma_t H0 dV_t
 *   term 4, T = (I + A)^-1, A = beta KK (.) D (strictly lower):   dA = -dR Dl^T   dbeta_t += sum_s dA KK D
 *        dKK = dA beta D   dD += dA beta KK;  dq += dQK K   dk += dQK^T Q + dKK K + dKK^T K
 *   term 5, G:  dG_t = dgamma_t gamma_t + sum_s dD[t][s] D[t][s] - sum_u dD[u][t] D[u][t] - dD_L[t] D_L[t],
 *        dG_{L-1} += dgamma_L gamma_L + sum_s dD_L[s] D_L[s];
 *        dH0 = gamma_L dH + Q^T diag(gamma) dO - K^T diag(gamma) dV
 */

/* term 1: P = QK (.) D, dP (kept as dD[t][s] D[t][s] of the o term), dQK, dDl = P^T dO; DlT = Dl^T. QK: the
 * forward's Q K^T (C, C), or NULL: computed here (into dA, free until term 4) */
static void gdnc_back_o(const gdn_params * p, const gdnc_buf * b, const real * Dl, const real * QK, int64_t L) {
    const int64_t S = p->S, Sp = b->Sp, C = GDN_CHUNK, Lp = gdn_pad(L);
    if (!QK)
        ssm_mm(&(ssm_mm_args) { .M = L, .J = Lp, .K = S, .X = b->Qc, .xi = Sp, .xk = 1, .Y = b->KT, .ys = C,
                                .O = b->dA, .os = C, .shape = SSM_MM_OUT_LOWER });
    const real * QKs = QK ? QK : b->dA;
    gdnc_transpose(b->DlT, C, Dl, Sp, L, S);
    for (int64_t j = 0; j < S; ++j)
        for (int64_t t = L; t < Lp; ++t) b->DlT[j * C + t] = 0;
    ssm_mm(&(ssm_mm_args) { .M = L, .J = Lp, .K = S, .X = b->dO, .xi = Sp, .xk = 1, .Y = b->DlT, .ys = C, .O = b->dP,
                            .os = C, .shape = SSM_MM_OUT_LOWER });
    for (int64_t t = 0; t < L; ++t) {   /* (rows through restrict pointers: the loops vectorize) */
        real * restrict Pt = b->P + t * C, * restrict dPt = b->dP + t * C, * restrict dQKt = b->dQK + t * C;
        const real * restrict QKt = QKs + t * C;
        const real * restrict Dt = b->D + t * C;
        for (int64_t s = 0; s <= t; ++s) {
            const real qk = QKt[s], dp = dPt[s];
            dQKt[s] = dp * Dt[s];
            dPt[s] = dp * qk * Dt[s];
            Pt[s] = qk * Dt[s];
        }
        for (int64_t s = t + 1; s < Lp; ++s) Pt[s] = dQKt[s] = 0;
    }
    ssm_mm(&(ssm_mm_args) { .M = L, .J = Sp, .K = L, .X = b->P, .xi = 1, .xk = C, .Y = b->dO, .ys = Sp, .O = b->dDl,
                            .os = Sp, .shape = SSM_MM_UPPER });
}

/* term 2: dDl += diag(D_L) K dH, dDL, dKc = diag(D_L) Dl dH^T (its first share); returns dgamma_L */
static real gdnc_back_state(const gdn_params * p, const gdnc_buf * b, const real * H0, const real * Dl, int64_t L) {
    const int64_t S = p->S, Sp = b->Sp;
    ssm_mm(&(ssm_mm_args) { .M = L, .J = Sp, .K = S, .X = b->Kc, .xi = Sp, .xk = 1, .Y = b->dH, .ys = Sp, .O = b->KdH,
                            .os = Sp });
    for (int64_t t = 0; t < L; ++t) {
        b->dDL[t] = gdn_dot(b->KdH + t * Sp, Dl + t * Sp, S);
        real * restrict dDl = b->dDl + t * Sp;
        const real * restrict KdH = b->KdH + t * Sp;
        const real DLt = b->DL[t];
        for (int64_t j = 0; j < Sp; ++j) dDl[j] += DLt * KdH[j];
    }
    real dgamL = 0;
    for (int64_t i = 0; i < S; ++i) dgamL += gdn_dot(H0 + i * Sp, b->dH + i * Sp, S);
    gdnc_transpose(b->dHT, Sp, b->dH, Sp, S, S);
    ssm_mm(&(ssm_mm_args) { .M = L, .J = Sp, .K = S, .X = Dl, .xi = Sp, .xk = 1, .Y = b->dHT, .ys = Sp, .O = b->dKc,
                            .os = Sp, .rs = b->DL });
    return dgamL;
}

/* term 3 (and term 1's gamma Q H0 part): dR, dV, dbeta, dgam, dQc, dKc; Gq = gamma dO, Gk = -gamma dV; T: the
 * chunk's (C, C) */
static void gdnc_back_solve(const gdn_params * p, const gdnc_buf * b, const real * H0, const real * Y, const real * T,
                            int64_t L) {
    const int64_t S = p->S, Sp = b->Sp, C = GDN_CHUNK;
    ssm_mm(&(ssm_mm_args) { .M = L, .J = Sp, .K = L, .X = T, .xi = 1, .xk = C, .Y = b->dDl, .ys = Sp, .O = b->dR,
                            .os = Sp, .shape = SSM_MM_UPPER });
    for (int64_t t = 0; t < L; ++t) {
        b->dbeta[t] = gdn_dot(b->dR + t * Sp, Y + t * Sp, S);
        real * restrict dV = b->dV + t * Sp, * restrict Gq = b->Gq + t * Sp, * restrict Gk = b->Gk + t * Sp;
        const real * restrict dR = b->dR + t * Sp, * restrict dO = b->dO + t * Sp;
        const real bt = b->beta[t], gt = b->gam[t];
        for (int64_t j = 0; j < Sp; ++j) {
            const real dv = bt * dR[j];
            dV[j] = dv;
            Gq[j] = gt * dO[j];
            Gk[j] = -gt * dv;
        }
    }
    /* E = dO H0^T: dq_t = gamma_t E_t, dgamma_t = q_t . E_t; then E = dV H0^T: dk_t -= gamma_t E_t,
     * dgamma_t -= k_t . E_t */
    gdnc_transpose(b->HT, Sp, H0, Sp, S, S);
    ssm_mm(&(ssm_mm_args) { .M = L, .J = Sp, .K = S, .X = b->dO, .xi = Sp, .xk = 1, .Y = b->HT, .ys = Sp, .O = b->E,
                            .os = Sp });
    for (int64_t t = 0; t < L; ++t) {
        b->dgam[t] = gdn_dot(b->Qc + t * Sp, b->E + t * Sp, S);
        real * restrict dQc = b->dQc + t * Sp;
        const real * restrict E = b->E + t * Sp;
        const real gt = b->gam[t];
        for (int64_t i = 0; i < Sp; ++i) dQc[i] = gt * E[i];
    }
    ssm_mm(&(ssm_mm_args) { .M = L, .J = Sp, .K = S, .X = b->dV, .xi = Sp, .xk = 1, .Y = b->HT, .ys = Sp, .O = b->E,
                            .os = Sp });
    for (int64_t t = 0; t < L; ++t) {
        b->dgam[t] -= gdn_dot(b->Kc + t * Sp, b->E + t * Sp, S);
        real * restrict dKc = b->dKc + t * Sp;
        const real * restrict E = b->E + t * Sp;
        const real gt = b->gam[t];
        for (int64_t i = 0; i < Sp; ++i) dKc[i] -= gt * E[i];
    }
}

/* dQc += dQK K, dKc += dQK^T Q + dKK K + dKK^T K (dQK lower incl., dKK strictly lower, both (C, C) zero
 * elsewhere), or with acc 0 dQc, dKc are these products alone */
static void gdnc_back_keys(const gdnc_buf * b, const real * dQK, const real * dKK, int64_t L, int acc) {
    const int64_t Sp = b->Sp, C = GDN_CHUNK;
    ssm_mm(&(ssm_mm_args) { .M = L, .J = Sp, .K = L, .X = dQK, .xi = C, .xk = 1, .Y = b->Kc, .ys = Sp, .O = b->dQc,
                            .os = Sp, .acc = acc, .shape = SSM_MM_LOWER });
    ssm_mm(&(ssm_mm_args) { .M = L, .J = Sp, .K = L, .X = dQK, .xi = 1, .xk = C, .Y = b->Qc, .ys = Sp, .O = b->dKc,
                            .os = Sp, .acc = acc, .shape = SSM_MM_UPPER });
    ssm_mm(&(ssm_mm_args) { .M = L, .J = Sp, .K = L, .X = dKK, .xi = C, .xk = 1, .Y = b->Kc, .ys = Sp, .O = b->dKc,
                            .os = Sp, .acc = 1, .shape = SSM_MM_LOWER });
    ssm_mm(&(ssm_mm_args) { .M = L, .J = Sp, .K = L, .X = dKK, .xi = 1, .xk = C, .Y = b->Kc, .ys = Sp, .O = b->dKc,
                            .os = Sp, .acc = 1, .shape = SSM_MM_UPPER });
}

/* term 4: dA (kept in dA as dD[t][s] D[t][s] of both terms), dbeta, dKK; the dQK and dKK products; KK: the
 * chunk's K K^T (C, C). With sQK, sKK (the key group's sums for this chunk: gdnc_group_sums_elems) dQK and
 * dKK add to them instead, and gdnc_back_group_end takes the products of the sums. */
static void gdnc_back_A(const gdn_params * p, const gdnc_buf * b, const real * KK, real * sQK, real * sKK,
                        int64_t L) {
    const int64_t S = p->S, Sp = b->Sp, C = GDN_CHUNK, Lp = gdn_pad(L);
    ssm_mm(&(ssm_mm_args) { .M = L, .J = Lp, .K = S, .X = b->dR, .xi = Sp, .xk = 1, .Y = b->DlT, .ys = C, .O = b->dA,
                            .os = C, .shape = SSM_MM_OUT_LOWER });
    for (int64_t t = 0; t < L; ++t) {
        real * restrict dAt = b->dA + t * C, * restrict dKKt = b->dKK + t * C;
        const real * restrict KKt = KK + t * C, * restrict Dt = b->D + t * C, * restrict dPt = b->dP + t * C;
        const real bt = b->beta[t];
        real db = 0;
        for (int64_t s = 0; s < t; ++s) {
            const real a = -dAt[s];
            db += a * KKt[s] * Dt[s];
            dKKt[s] = a * bt * Dt[s];
            dAt[s] = dPt[s] + a * bt * KKt[s] * Dt[s];
        }
        for (int64_t s = t; s < Lp; ++s) dKKt[s] = 0;
        b->dbeta[t] += db;
    }
    if (!sQK) {
        gdnc_back_keys(b, b->dQK, b->dKK, L, 1);
        return;
    }
    for (int64_t t = 0; t < L; ++t) {   /* (the sums stay zero above the diagonals and past row L) */
        real * restrict sq = sQK + t * C, * restrict sk = sKK + t * C;
        const real * restrict dq = b->dQK + t * C, * restrict dk = b->dKK + t * C;
        for (int64_t s = 0; s <= t; ++s) sq[s] += dq[s];
        for (int64_t s = 0; s < t; ++s) sk[s] += dk[s];
    }
}

/* term 5: dGt, and dH becomes the gradient of H0 */
static void gdnc_back_decay(const gdn_params * p, const gdnc_buf * b, real dgamL, int64_t L) {
    const int64_t S = p->S, Sp = b->Sp, C = GDN_CHUNK;
    for (int64_t t = 0; t < L; ++t) {
        real s1 = 0, s2 = 0;
        for (int64_t s = 0; s < t; ++s) s1 += b->dA[t * C + s];
        for (int64_t u = t + 1; u < L; ++u) s2 += b->dA[u * C + t];
        b->dGt[t] = b->dgam[t] * b->gam[t] + s1 - s2 - b->dDL[t] * b->DL[t];
    }
    real sL = 0;
    for (int64_t s = 0; s < L; ++s) sL += b->dDL[s] * b->DL[s];
    b->dGt[L - 1] += dgamL * b->gam[L - 1] + sL;
    ssm_mm(&(ssm_mm_args) { .M = S, .J = Sp, .K = L, .X = b->Qc, .xi = 1, .xk = Sp, .Y = b->Gq, .ys = Sp, .O = b->dH,
                            .os = Sp, .Z = b->dH, .beta = b->gam[L - 1] });
    ssm_mm(&(ssm_mm_args) { .M = S, .J = Sp, .K = L, .X = b->Kc, .xi = 1, .xk = Sp, .Y = b->Gk, .ys = Sp, .O = b->dH,
                            .os = Sp, .acc = 1 });
}

/* The chunk's kept values: H0, Y, Dl (always), and KK, QK, T the forward's or NULL (then computed here) */
typedef struct {
    const real * H0, * Y, * Dl, * KK, * QK, * T;
} gdnc_chunk_kept;

/* The chunk's VJP; sQK, sKK: gdnc_back_A's */
static void gdnc_chunk_back(const gdn_params * p, const gdnc_buf * b, const gdnc_chunk_kept * k, real * sQK,
                            real * sKK, int64_t L) {
    const real * KK = k->KK, * T = k->T;
    if (!T) {
        gdnc_make_T(p, b, L);
        KK = b->KK;
        T = b->T;
    }
    gdnc_back_o(p, b, k->Dl, k->QK, L);
    const real dgamL = gdnc_back_state(p, b, k->H0, k->Dl, L);
    gdnc_back_solve(p, b, k->H0, k->Y, T, L);
    gdnc_back_A(p, b, KK, sQK, sKK, L);
    gdnc_back_decay(p, b, dgamL, L);
}

/* Backward of one (sequence n, value head h): the chunks forward keeping H0, Y, Dl of each (or those the
 * forward kept, in->kept), then in reverse; d_q, d_k add to the key group's rows (zeroed by gdn_back_groups). */
static void gdnc_back_unit(const gdn_params * p, const gdnc_inputs * in, const real * grad, const gdn_grads * gr,
                           const gdnc_buf * b, int64_t n, int64_t h) {
    const int64_t S = p->S, Sp = b->Sp, C = GDN_CHUNK, n_t = p->n_t, SS = Sp * Sp, CS = C * Sp;
    const int64_t n_ch = gdnc_n_chunks(p), nk = gdn_key_seq(p, n), kh = gdn_key_head(p, h);
    const real c = (real) 1 / real_sqrt((real) S);
    /* chunk ch's H0, Y, Dl: hs + ch * hstep, ys + ch * rstep, dls + ch * rstep */
    const real * hs = b->Hs, * ys = b->Ys, * dls = b->Dls;
    int64_t hstep = SS, rstep = CS;
    if (in->kept) {
        const int64_t E = gdnc_kept_chunk_elems(p);
        hs = in->kept + (n * p->H_v + h) * n_ch * E;
        ys = hs + gdn_kept_at(Sp, GDN_KEPT_Y);
        dls = hs + gdn_kept_at(Sp, GDN_KEPT_DL);
        hstep = rstep = E;
    }
    if (!in->kept) gdnc_load_state(p, in->state, p->state_st, b->H, Sp, n, h);
    for (int64_t ch = 0; ch < n_ch && !in->kept; ++ch) {
        const int64_t t0 = ch * C, L = ssm_min64(C, n_t - t0);
        memcpy(b->Hs + ch * SS, b->H, SS * sizeof(real));
        gdnc_load(p, in, b, n, h, t0, L, 1);
        gdnc_chunk_keys(p, b, L, 0);
        gdnc_chunk_fwd(p, b, L);
        memcpy(b->Ys + ch * CS, b->Y, L * Sp * sizeof(real));
        memcpy(b->Dls + ch * CS, b->Dl, L * Sp * sizeof(real));
    }
    const int64_t g_slot0[4] = { p->H_v * S * S, S * S, S, 1 };   /* grad's slot 0, dense, transposed */
    gdnc_load_state(p, grad + p->n_seqs * n_t * p->H_v * S, g_slot0, b->dH, Sp, n, h);
    for (int64_t ch = n_ch - 1; ch >= 0; --ch) {
        const int64_t t0 = ch * C, L = ssm_min64(C, n_t - t0);
        gdnc_load(p, in, b, n, h, t0, L, 0);
        for (int64_t t = 0; t < L; ++t) {
            const real * restrict go = grad + ((n * n_t + t0 + t) * p->H_v + h) * S;
            real * restrict dO = b->dO + t * Sp;
            for (int64_t j = 0; j < S; ++j) dO[j] = c * go[j];
        }
        const real * kc = in->kept ? hs + ch * hstep : NULL;   /* the kept entry: KK, QK, T after Dl */
        const gdnc_chunk_kept k = { .H0 = hs + ch * hstep, .Y = ys + ch * rstep, .Dl = dls + ch * rstep,
                                    .KK = kc ? kc + gdn_kept_at(Sp, GDN_KEPT_KK) : NULL,
                                    .QK = kc ? kc + gdn_kept_at(Sp, GDN_KEPT_QK) : NULL,
                                    .T = kc ? kc + gdn_kept_at(Sp, GDN_KEPT_T) : NULL };
        const int64_t CC = C * C;
        gdnc_chunk_back(p, b, &k, b->sQK ? b->sQK + ch * CC : NULL, b->sKK ? b->sKK + ch * CC : NULL, L);
#ifdef SSMGRAD_MUTANTS
        for (int64_t e = 0; e < SS; ++e) b->dH[e] = SSM_MUTANT(SSM_MUT_GDN_CK_DSTATE, b->dH[e]);   /* carried */
#endif
        real acc = 0;   /* d g_t: the sum of dG_u over u >= t of the chunk (G restarts at every chunk) */
        for (int64_t t = L - 1; t >= 0; --t) {
            const int64_t tt = t0 + t, nv = (n * n_t + tt) * p->H_v + h, nq = (nk * n_t + tt) * p->H_k + kh;
            acc += b->dGt[t];
            gr->dg[nv] = SSM_MUTANT(SSM_MUT_GDN_CK_DG, acc);
            gr->dbeta[nv] = SSM_MUTANT(SSM_MUT_GDN_CK_DBETA, b->dbeta[t]);
            gdn_add_row(gr->dq + nq * S, b->dQc + t * Sp, S, SSM_MUT_GDN_CK_DQ);
            gdn_add_row(gr->dk + nq * S, b->dKc + t * Sp, S, SSM_MUT_GDN_CK_DK);
            gdn_put_row(gr->dv + nv * S, b->dV + t * Sp, S, SSM_MUT_GDN_CK_DV);
        }
    }
    gdnc_store_state(b->dH, Sp, gr->dstate + (n * p->H_v + h) * S * S, S);
}

/* gdnc_back_unit as gdn_back_groups calls it */
static void gdnc_back_unit_of(const gdn_back_args * a, int64_t n, int64_t h) {
    gdnc_back_unit(a->p, a->in, a->grad, a->gr, a->b, n, h);
}

/* After every unit of key group (nk, kh), where the units summed their dQK, dKK (gdnc_group_sums_elems):
 * per chunk, the products of the sums with Q and K add to the group's d_q, d_k rows; the sums are zeroed
 * for the next group (the scratch starts zeroed). Once per group instead of once per unit: the products
 * are linear in dQK, dKK, and Q, K are the group's. */
static void gdnc_back_group_end(const gdn_back_args * a, int64_t nk, int64_t kh) {
    const gdn_params * p = a->p;
    const gdnc_buf * b = a->b;
    if (!b->sQK) return;
    const int64_t S = p->S, Sp = b->Sp, C = GDN_CHUNK, CC = C * C, n_t = p->n_t, n_ch = gdnc_n_chunks(p);
    const int64_t n = nk * (p->n_seqs / p->n_seqs_k);   /* a value sequence of key sequence nk */
    for (int64_t ch = 0; ch < n_ch; ++ch) {
        const int64_t t0 = ch * C, L = ssm_min64(C, n_t - t0);
        gdnc_load_keys(p, a->in, b, n, kh, t0, L);
        gdnc_back_keys(b, b->sQK + ch * CC, b->sKK + ch * CC, L, 0);
        for (int64_t t = 0; t < L; ++t) {
            const int64_t nq = (nk * n_t + t0 + t) * p->H_k + kh;
            gdn_add_row(a->gr->dq + nq * S, b->dQc + t * Sp, S, SSM_MUT_GDN_CK_DQ);
            gdn_add_row(a->gr->dk + nq * S, b->dKc + t * Sp, S, SSM_MUT_GDN_CK_DK);
        }
    }
    memset(b->sQK, 0, (size_t) (n_ch * CC) * sizeof(real));
    memset(b->sKK, 0, (size_t) (n_ch * CC) * sizeof(real));
}

/* Backward: threads split the key groups (gdn_back_split); each owns every gradient its groups' heads
 * produce. */
static void gdnc_back(const gdn_params * p, const gdnc_inputs * in, const real * grad, real * gin, void * work, int ith,
                      int nth) {
    int64_t lo, hi;
    gdn_back_split(p, ith, nth, &lo, &hi);
    if (lo >= hi) return;
    gdnc_buf b;
    gdnc_carve(p, gdn_thread_scratch(work, ith, gdnc_back_thread_elems(p)), 1, &b);
    gdn_back_groups(p, in, grad, gin, &b, lo, hi, gdnc_back_unit_of, gdnc_back_group_end);
}
