/*
 * ssm_scan_chunked_body.h -- SSM_SCAN forward, the chunked (SSD, matrix-product) form, written once
 * for `real`, for Mamba-2 (one decay per head, A (n_head, 1)) with K == 1 and more than 4 tokens,
 * where ssm_scan_fwd_chunked(p) says so (ssm_scan_forms.c).
 *
 *   shapes as ssm_scan_recurrence_body.h; out = [y | the final states (slot 0)]
 *
 * Checked against tests/reference.py's ref_ssm_scan (tests/kernels/test_scan_fwd_chunked.py).
 */
#ifndef SSM_SCAN_CHUNKED_BODY_H
#define SSM_SCAN_CHUNKED_BODY_H

#ifndef SSM_REAL_H
#error "include ssm_real_f32.h or ssm_real_f64.h first"
#endif

#include "ssm_scan_rows.h"

/*
 * A block's tokens are cut into chunks of SSM_CHUNK_T (ssm_chunk.h). Within a chunk, with l_t the cumulative sum of
 * sp * A from the chunk's first token through t (in double), S0 the state before the chunk and
 * Xs_t = sp_t x_t (the recurrence's xdt):
 *   y_t   = e^(l_t) C_t S0 + sum_{tau <= t} e^(l_t - l_tau) (C_t . B_tau) Xs_tau
 *   S_end = e^(l_end) S0 + sum_tau e^(l_end - l_tau) B_tau (x) Xs_tau
 * the same algebra as the backward's chunked form (ssm_scan_back_chunked_body.h), in ssm_mm products. The chunks
 * run in order and each head keeps only its running state ([Np][Pp], in place); C_t . B_tau is
 * computed once per chunk for the block's heads (heads of one group). Each y and state element is
 * a sum in an order fixed by the shape; a head's results do not depend on which other heads share
 * its block (C . B is the same bits for any block), so the thread count never changes the bits.
 * Where asked (kept, ssm_scan_keep_*), each head's state after every chunk is written out for the
 * backward's chunked form: its products are the backward's pass over the chunks (ssm_ck_head_states)
 * element for element, so the backward reads the bits it would compute.
 */
#define SSM_FBH 8      /* heads per block: their states ([Np][Pp] each, 32 KB at 64 x 128 floats)
                          and one chunk's B, C stay in L2 across the block's heads */

#include "ssm_chunk.h"

/* Buffers of one thread for the chunked forward. Np, Pp: d_state, head_dim padded to 16. */
typedef struct {
    real * S;     /* [SSM_FBH][Np][Pp] the block's running states (transposed: state n, row p) */
    real * Bc, * Cc;   /* [Q][Np] one chunk's B, C where gathered */
    const real * Bp, * Cp;   /* the chunk's rows of B and C: in the inputs, or Bc and Cc */
    int64_t bst, cst;
    real * BT;    /* [Np][Q] B transposed */
    real * CB, * CBd;   /* [Q][Q] C_t . B_tau; times e^(l_t - l_tau) below the diagonal, 0 above */
    real * X;     /* [Q][Pp] x where gathered */
    real * Xs, * W, * Y;   /* [Q][Pp] sp x; e^(l_end - l_t) sp x; the chunk's y */
    double * l;   /* [Q] */
    real * sp, * el, * e2, * er;   /* [Q] */
    int fast;     /* the chunk's e^(l_t - l_tau) all within real_exp_poly_fast's range */
} ssm_fwd_chunk;


static void ssm_fwd_take_chunk(ssm_arena * a, const ssm_scan_params * p, ssm_fwd_chunk * ck) {
    const size_t e = sizeof(real), Q = SSM_CHUNK_T;
    const size_t Np = (size_t) ssm_chunk_np(p), Pp = (size_t) ssm_chunk_pp(p);
    ck->S = ssm_take(a, SSM_FBH * Np * Pp * e);
    ck->Bc = ssm_take(a, Q * Np * e);
    ck->Cc = ssm_take(a, Q * Np * e);
    ck->BT = ssm_take(a, Np * Q * e);
    ck->CB = ssm_take(a, Q * Q * e);
    ck->CBd = ssm_take(a, Q * Q * e);
    ck->X = ssm_take(a, Q * Pp * e);
    ck->Xs = ssm_take(a, Q * Pp * e);
    ck->W = ssm_take(a, Q * Pp * e);
    ck->Y = ssm_take(a, Q * Pp * e);
    ck->l = ssm_take(a, Q * sizeof(double));
    ck->sp = ssm_take(a, Q * e);
    ck->el = ssm_take(a, Q * e);
    ck->e2 = ssm_take(a, Q * e);
    ck->er = ssm_take(a, Q * e);
}

static size_t ssm_scan_chunked_thread_bytes(const ssm_scan_params * p) {
    ssm_arena a = { NULL, 0 };
    ssm_fwd_chunk ck;
    ssm_fwd_take_chunk(&a, p, &ck);
    return a.off;
}

/* the chunk's rows of B and C (ssm_chunk_bc), and BT = B transposed ([Np][Q], zero past L and
 * d_state) */
static void ssm_fc_bc(const ssm_scan_params * p, int64_t q, int64_t g, int64_t t0, int64_t L,
                           const real * B, const real * C, ssm_fwd_chunk * ck) {
    const int64_t Np = ssm_chunk_np(p), ds = p->d_state;
    ssm_chunk_bc(p, q, g, t0, L, B, C, ck->Bc, ck->Cc, &ck->Bp, &ck->Cp, &ck->bst, &ck->cst);
    const int64_t Q = SSM_CHUNK_T;
    if (L < Q || Np != ds) memset(ck->BT, 0, (size_t) (Np * Q) * sizeof(real));
    ssm_chunk_transpose(p->simd, ck->Bp, ck->bst, ck->BT, Q, L, ds);
}

/* The chunk's softplus(dt) (as the recurrence), cumulative log decays l, e^(l_t) (el) and
 * e^(l_end - l_t) (e2), and whether every l_t - l_tau is within real_exp_poly_fast's range */
SSM_INLINE void ssm_fc_decays(const ssm_scan_params * p, int64_t q, int64_t h, int64_t t0, int64_t L,
                              const real * dt, const real Ah, ssm_fwd_chunk * ck) {
    const real * d = dt + q * p->dt_st[0] + t0 * p->dt_st[1] + h * p->dt_st[2];
    real * restrict sp = ck->sp;
    for (int64_t t = 0; t < L; ++t) sp[t] = d[t * p->dt_st[1]];
    for (int64_t t = 0; t < L; ++t) sp[t] = real_softplus(sp[t]);
    double acc = 0;
    for (int64_t t = 0; t < L; ++t) {
        acc += (double) (sp[t] * Ah);
        ck->l[t] = acc;
    }
    real * restrict e2 = ck->e2;
    real * restrict el = ck->el;
    for (int64_t t = 0; t < L; ++t) e2[t] = (real) (acc - ck->l[t]);
    for (int64_t t = 0; t < L; ++t) e2[t] = real_exp_poly(e2[t]);
    for (int64_t t = 0; t < L; ++t) el[t] = (real) ck->l[t];
    for (int64_t t = 0; t < L; ++t) el[t] = real_exp_poly(el[t]);
    ck->fast = ssm_chunk_exp_fast(ck->l, L, acc);
}

/* Xs = sp x, W = e2 Xs ([Q][Pp], zero past head_dim) of head h's chunk */
SSM_INLINE void ssm_fc_xs(const ssm_scan_params * p, int64_t q, int64_t h, int64_t t0, int64_t L, const real * x,
                          ssm_fwd_chunk * ck) {
    const int64_t Pp = ssm_chunk_pp(p), hd = p->head_dim, x3 = p->x_st[3];
    const real * x0 = x + q * p->x_st[0] + t0 * p->x_st[1] + h * p->x_st[2];
    const real * Xp = x0;
    int64_t xst = p->x_st[1];
    if (!(x3 == 1 && hd == Pp)) {
        for (int64_t t = 0; t < L; ++t) {
            const real * xr = x0 + t * p->x_st[1];
            real * restrict xo = ck->X + t * Pp;
            for (int64_t pp = 0; pp < hd; ++pp) xo[pp] = xr[pp * x3];
            for (int64_t pp = hd; pp < Pp; ++pp) xo[pp] = 0;
        }
        Xp = ck->X;
        xst = Pp;
    }
    for (int64_t t = 0; t < L; ++t) {
        const real * restrict xr = Xp + t * xst;
        real * restrict xs = ck->Xs + t * Pp;
        real * restrict w = ck->W + t * Pp;
        const real spt = ck->sp[t], e2t = ck->e2[t];
        for (int64_t pp = 0; pp < Pp; ++pp) xs[pp] = xr[pp] * spt;
        for (int64_t pp = 0; pp < Pp; ++pp) w[pp] = e2t * xs[pp];
    }
}

/* CBd[t][tau] = e^(l_t - l_tau) CB[t][tau] for tau <= t, 0 for t < tau < L */
SSM_INLINE void ssm_fc_cbd(int64_t L, ssm_fwd_chunk * ck) {
    const int64_t Q = SSM_CHUNK_T;
    for (int64_t t = 0; t < L; ++t) {
        const real * cbr = ck->CB + t * Q;
        real * restrict o = ck->CBd + t * Q;
        real * restrict er = ck->er;
        const double lt = ck->l[t];
        for (int64_t tau = 0; tau <= t; ++tau) er[tau] = (real) (lt - ck->l[tau]);
        if (ck->fast)   /* equal to real_exp_poly bit for bit in its range, and a loop that vectorizes */
            for (int64_t tau = 0; tau <= t; ++tau) er[tau] = real_exp_poly_fast(er[tau]);
        else
            for (int64_t tau = 0; tau <= t; ++tau) er[tau] = real_exp_poly(er[tau]);
        for (int64_t tau = 0; tau <= t; ++tau) o[tau] = SSM_MUTANT(SSM_MUT_SCAN_CK_Y, er[tau] * cbr[tau]);
        for (int64_t tau = t + 1; tau < L; ++tau) o[tau] = 0;
    }
}

/* One chunk of head h (state S, [Np][Pp]): its y to y_out, S advanced in place past the chunk. */
static void ssm_fc_head(const ssm_scan_params * p, int64_t q, int64_t h, int64_t t0, int64_t L,
                             const real * x, const real * dt, const real Ah, real * S, real * y_out,
                             ssm_fwd_chunk * ck) {
    const int64_t Q = SSM_CHUNK_T, Pp = ssm_chunk_pp(p), hd = p->head_dim, ds = p->d_state;
    const int64_t n_head = p->n_head, n_t = p->n_t;

    ssm_fc_decays(p, q, h, t0, L, dt, Ah, ck);
    ssm_fc_xs(p, q, h, t0, L, x, ck);
    ssm_fc_cbd(L, ck);

    /* Y_t = e^(l_t) C_t S0, then + sum_{tau <= t} CBd[t][tau] Xs_tau, then copied into y's rows
     * (through a buffer: docs/performance.md) */
    ssm_mm(&(ssm_mm_args) { .M = L, .J = Pp, .K = ds, .X = ck->Cp, .xi = ck->cst, .xk = 1, .Y = S, .ys = Pp,
                            .O = ck->Y, .os = Pp, .rs = ck->el });
    ssm_mm(&(ssm_mm_args) { .M = L, .J = Pp, .K = L, .X = ck->CBd, .xi = Q, .xk = 1, .Y = ck->Xs, .ys = Pp,
                            .O = ck->Y, .os = Pp, .acc = 1, .shape = SSM_MM_LOWER });
    for (int64_t t = 0; t < L; ++t)
        memcpy(y_out + ((q * n_t + t0 + t) * n_head + h) * hd, ck->Y + t * Pp, hd * sizeof(real));

    /* S[n][p] = e^(l_end) S[n][p] + sum_t B[t][n] W[t][p] (in place: each element read before written) */
    ssm_mm(&(ssm_mm_args) { .M = ds, .J = Pp, .K = L, .X = ck->Bp, .xi = 1, .xk = ck->bst, .Y = ck->W, .ys = Pp,
                            .O = S, .os = Pp, .Z = S, .beta = SSM_MUTANT(SSM_MUT_SCAN_CK_STATE, ck->el[L - 1]) });
}

/* Ask for the rows of x of head h at tokens [t0, t0 + L) ahead of use: one row of a few hundred
 * bytes per token, n_head * head_dim elements apart, where the hardware prefetchers do not follow. */
SSM_INLINE void ssm_fc_prefetch(const ssm_scan_params * p, int64_t q, int64_t h, int64_t t0, const real * x) {
    if (t0 >= p->n_t || p->x_st[3] != 1) return;
    const int64_t L = ssm_min64(SSM_CHUNK_T, p->n_t - t0);
    const real * x0 = x + q * p->x_st[0] + t0 * p->x_st[1] + h * p->x_st[2];
    for (int64_t t = 0; t < L; ++t) ssm_prefetch_run(x0 + t * p->x_st[1], p->head_dim);
}

/* The chunked forward of sequence q, heads [h0, h1) of group g (h1 - h0 <= SSM_FBH). */
static void ssm_fwd_block_chunked(const ssm_scan_params * p, int64_t q, int64_t g, int64_t h0, int64_t h1,
                                       const real * s, const real * x, const real * dt, const real * A,
                                       const real * B, const real * C, const int64_t * ids, real * y_out,
                                       real * st_out, real * kept, ssm_fwd_chunk * ck) {
    const int64_t Q = SSM_CHUNK_T, Np = ssm_chunk_np(p), Pp = ssm_chunk_pp(p);
    const int64_t hd = p->head_dim, ds = p->d_state, n_t = p->n_t, n_head = p->n_head;
    const int64_t stn = Np * Pp;

    for (int64_t h = h0; h < h1; ++h) {          /* the start states, transposed */
        real * S = ck->S + (h - h0) * stn;
        memset(S, 0, (size_t) stn * sizeof(real));
        const real * src = s + ids[q] * p->s_st[0] + h * p->s_st[1];
        if (p->s_st[3] == 1) ssm_chunk_transpose(p->simd, src, p->s_st[2], S, Pp, hd, ds);
        else
            for (int64_t pp = 0; pp < hd; ++pp)
                for (int64_t n = 0; n < ds; ++n) S[n * Pp + pp] = src[pp * p->s_st[2] + n * p->s_st[3]];
    }
    for (int64_t t0 = 0; t0 < n_t; t0 += Q) {
        const int64_t L = ssm_min64(Q, n_t - t0);
        ssm_fc_bc(p, q, g, t0, L, B, C, ck);
        ssm_mm(&(ssm_mm_args) { .M = L, .J = Q, .K = ds, .X = ck->Cp, .xi = ck->cst, .xk = 1, .Y = ck->BT,
                                .ys = Q, .O = ck->CB, .os = Q, .shape = SSM_MM_OUT_LOWER });
        for (int64_t h = h0; h < h1; ++h) {
            if (h + 1 < h1) ssm_fc_prefetch(p, q, h + 1, t0, x);
            else {   /* the next chunk's: the first head's x rows, the group's B and C rows */
                ssm_fc_prefetch(p, q, h0, t0 + Q, x);
                for (int64_t t = t0 + Q; t < ssm_min64(t0 + 2 * Q, n_t); ++t) {
                    if (p->B_st[3] == 1) ssm_prefetch_run(B + q * p->B_st[0] + t * p->B_st[1] + g * p->B_st[2], ds);
                    if (p->C_st[3] == 1) ssm_prefetch_run(C + q * p->C_st[0] + t * p->C_st[1] + g * p->C_st[2], ds);
                }
            }
            ssm_fc_head(p, q, h, t0, L, x, dt, A[h * p->A_st[0]], ck->S + (h - h0) * stn, y_out, ck);
            if (kept)   /* the state after the chunk, for the backward (ssm_scan_keep_*) */
                ssm_chunk_transpose_out(p->simd, ck->S + (h - h0) * stn, Pp,
                                        kept + ((q * n_head + h) * ((n_t + Q - 1) / Q) + t0 / Q) * hd * ds, ds, ds, hd);
        }
    }
    for (int64_t h = h0; h < h1; ++h) {          /* the final states, slot 0 */
        const real * S = ck->S + (h - h0) * stn;
        ssm_chunk_transpose(p->simd, S, Pp, st_out + (q * n_head + h) * hd * ds, ds, ds, hd);
    }
}

/* The chunked forward of the (sequence, head) pairs [u_lo, u_hi) in blocks of at most SSM_FBH heads
 * of one group, with the buffers taken from the thread's arena. */
static void ssm_scan_chunked(const ssm_scan_params * p, const real * s, const real * x, const real * dt,
                           const real * A, const real * B, const real * C, const int64_t * ids, real * y_out,
                           real * st_out, real * kept, ssm_arena * arena, int64_t u_lo, int64_t u_hi) {
    const int64_t n_head = p->n_head, hpg = ssm_heads_per_group(p);
    ssm_fwd_chunk ck;
    ssm_fwd_take_chunk(arena, p, &ck);
    for (int64_t u = u_lo; u < u_hi;) {
        const int64_t q = u / n_head, h0 = u % n_head;
        const int64_t g_end = (h0 / hpg + 1) * hpg;
        const int64_t h1 = ssm_min64(ssm_min64(h0 + SSM_FBH, g_end), h0 + (u_hi - u));
        ssm_fwd_block_chunked(p, q, h0 / hpg, h0, h1, s, x, dt, A, B, C, ids, y_out, st_out, kept, &ck);
        u += h1 - h0;
    }
    if (kept) ssm_chunk_stream_fence();
}

#undef SSM_FBH

#endif /* SSM_SCAN_CHUNKED_BODY_H */
