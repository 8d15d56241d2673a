/*
 * ssm_scan_back_chunked_body.h -- SSM_SCAN backward, phase 1 in the chunked (SSD, matrix-product)
 * form, written once for `real`, for Mamba-2 (one decay per head) with K == 1, where
 * ssm_scan_back_chunked(p) says so (ssm_scan_forms.c). It writes what the recurrence's phase 1
 * writes, so phase 2 (ssm_scan_back_reduce_body.h) is the same.
 *
 *   shapes as ssm_scan_back_recurrence_body.h
 *
 * Checked against tests/reference.py's ref_scan_grads (tests/kernels/test_scan_back_chunked.py).
 */
#ifndef SSM_SCAN_BACK_CHUNKED_BODY_H
#define SSM_SCAN_BACK_CHUNKED_BODY_H

#ifndef SSM_REAL_H
#error "include ssm_real_f32.h or ssm_real_f64.h first"
#endif

#include "ssm_scan_rows.h"
#include "ssm_scan_back.h"

/*
 * A unit's tokens are cut into chunks of SSM_CHUNK_T (ssm_chunk.h). Within a chunk, with l_t the cumulative sum
 * of sp * A from the chunk's first token through t, S0 the state before the chunk, dS the
 * gradient of the state after it, and Xs_t = sp_t x_t:
 *   y_t   = e^(l_t) C_t S0 + sum_{tau<=t} e^(l_t - l_tau) (C_t . B_tau) Xs_tau
 *   S_end = e^(l_end) S0 + sum_tau e^(l_end - l_tau) B_tau (x) Xs_tau
 * and the backward of both is a handful of small matrix products (C_t . B_tau is shared by
 * the unit's heads, computed once per chunk). The states before each chunk come from a pass
 * over the chunks (a matrix product per chunk too; only those are kept, one head at a time), or
 * from the forward, which kept them (ssm_scan_keep_*: the same bits as that pass); given them, a unit
 * whose partial sums would leave L2 runs chunk by chunk, all of its heads in each (ssm_back_unit_by_chunk).
 * It writes what the recurrence writes (d_x, d_dt, the unit's rows of dB_part and dC_part,
 * dS_seq, dA_seq), every sum in an order fixed by the shape, so phase 2 is unchanged.
 */
#include "ssm_chunk.h"

/* Buffers of one thread for the chunked form. Np, Pp: d_state, head_dim padded to 16. */
typedef struct {
    real * CB;    /* [nc][Q][Q] C_t . B_tau of every chunk of the unit's (sequence, group) */
    int64_t cb_q, cb_g;   /* whose CB holds: the thread's next unit of that pair reuses it; -1: none */
    real * Ds;    /* [nc][Q][Q] the sum over the unit's heads of each chunk's decayed D */
    real * St;    /* [nc + 1][P][Np] the head's state before each chunk, then the final state */
    real * Bc, * Cc, * dBc, * dCc;   /* [Q][Np] one chunk's B, C (if gathered), their grads */
    const real * Bp, * Cp;   /* the chunk's rows of B and C: in the inputs, or Bc and Cc */
    int64_t bst, cst;        /* ... and their row strides */
    const real * Xp;         /* the chunk's rows of x: in the input, or X */
    int64_t xst;
    real * BT;    /* [Np][Q] B transposed */
    real * X, * Xs, * W, * Wy, * dy, * dXs;   /* [Q][Pp] */
    real * XsT;   /* [Pp][Q] */
    real * D, * CBd;   /* [Q][Q] dy_t . Xs_tau, then times the decays; C_t . B_tau times the decays */
    real * dS, * dS2;  /* [Np][Pp] gradient of the state after the chunk, before it */
    real * dST;   /* [Pp][Np] dS transposed */
    double * l;   /* [Q] cumulative log decay within the chunk (in l_all) */
    real * sp, * dtv, * el, * e2;   /* [Q] the chunk's dt, softplus(dt), e^(l_t), e^(l_end - l_t) (in the _all arrays) */
    double * l_all;   /* [hmax][nc][Q] l of every chunk of the head: the pass that rebuilds the states */
    real * sp_all, * dtv_all, * el_all, * e2_all;   /* computes them, the reverse pass reads them back */
    real * dl, * cs, * erow, * wrow, * rd;   /* [Q] */
    /* The chunks outermost (ssm_back_unit_by_chunk): every head of the unit at once, head hslot's
     * decays at slot hslot of the _all arrays, its start state at St + hslot P Np; 0 otherwise.
     * hmax = ssm_back_chunk_heads(p) */
    int64_t hslot, nc;
    real * hdS;   /* [hmax][2][Np][Pp] each head's dS and dS2 */
    const real ** hafter;   /* [hmax] each head's states after each chunk */
    real * hdA;   /* [hmax] each head's d_A so far */
} ssm_back_chunk;

/* point the chunk's decay vectors at chunk c's slots (of head hslot) */
SSM_INLINE void ssm_ck_decays_at(ssm_back_chunk * ck, int64_t c) {
    const int64_t at = (ck->hslot * ck->nc + c) * SSM_CHUNK_T;
    ck->l = ck->l_all + at;
    ck->sp = ck->sp_all + at;
    ck->dtv = ck->dtv_all + at;
    ck->el = ck->el_all + at;
    ck->e2 = ck->e2_all + at;
}


/* sum_i a[i] b[i], n a multiple of 16: 16 interleaved partial sums, then pairwise (a fixed
 * order that vectorizes; one running sum was a chain of dependent scalar adds) */
SSM_INLINE real ssm_ck_dot(const real * restrict a, const real * restrict b, int64_t n) {
    real acc[16] = { 0 };
    for (int64_t i = 0; i < n; i += 16)
        for (int j = 0; j < 16; ++j) acc[j] += a[i + j] * b[i + j];
    for (int half = 8; half > 0; half /= 2)
        for (int j = 0; j < half; ++j) acc[j] += acc[j + half];
    return acc[0];
}

/* sum_i a[i] (the same order as ssm_ck_dot) */
SSM_INLINE real ssm_ck_sum(const real * restrict a, int64_t n) {
    real acc[16] = { 0 };
    for (int64_t i = 0; i < n; i += 16)
        for (int j = 0; j < 16; ++j) acc[j] += a[i + j];
    for (int half = 8; half > 0; half /= 2)
        for (int j = 0; j < half; ++j) acc[j] += acc[j + half];
    return acc[0];
}

/* out[t] = sum_{i < n} a[t as + i] b[t bs + i] for t < L, n a multiple of 16. With AVX-512, SSM_LANES
 * rows at a time: a vector of partial sums per row, then ssm_lane_sums across the rows (a fixed
 * order; one row at a time spent most of its time in the sum's latency and the horizontal adds).
 * Elsewhere ssm_ck_dot per row. */
typedef real vecu __attribute__((vector_size(64), aligned(sizeof(real))));   /* rows may be unaligned */
static void ssm_ck_rowdots(const int64_t simd, const real * a, int64_t as, const real * b, int64_t bs,
                                int64_t L, int64_t n, real * restrict out) {
    if (!ssm_vec64(simd)) {
        for (int64_t t = 0; t < L; ++t) out[t] = ssm_ck_dot(a + t * as, b + t * bs, n);
        return;
    }
    for (int64_t t0 = 0; t0 < L; t0 += SSM_LANES) {
        vec acc[SSM_LANES];
        for (int k = 0; k < SSM_LANES; ++k) {
            vec sum = { 0 };
            if (t0 + k < L) {
                const vecu * av = (const vecu *) (a + (t0 + k) * as);
                const vecu * bv = (const vecu *) (b + (t0 + k) * bs);
                for (int64_t i = 0; i < n / SSM_LANES; ++i) sum += av[i] * bv[i];
            }
            acc[k] = sum;
        }
        const vec r = ssm_lane_sums(acc);
        for (int k = 0; k < SSM_LANES && t0 + k < L; ++k) out[t0 + k] = r[k];
    }
}

static void ssm_back_take_chunk(ssm_arena * a, const ssm_scan_params * p, ssm_back_chunk * ck) {
    const size_t e = sizeof(real), Q = SSM_CHUNK_T;
    const size_t Np = (size_t) ssm_chunk_np(p), Pp = (size_t) ssm_chunk_pp(p), P = (size_t) p->head_dim;
    const size_t nc = (size_t) ((p->n_t + SSM_CHUNK_T - 1) / SSM_CHUNK_T), hmax = (size_t) ssm_back_chunk_heads(p);
    ck->CB = ssm_take(a, nc * Q * Q * e);
    ck->cb_q = ck->cb_g = -1;
    ck->Ds = ssm_take(a, nc * Q * Q * e);
    ck->St = ssm_take(a, (nc + 1 > hmax ? nc + 1 : hmax) * P * Np * e);
    ck->hslot = 0;
    ck->nc = (int64_t) nc;
    ck->hdS = ssm_take(a, hmax * 2 * Np * Pp * e);
    ck->hafter = ssm_take(a, hmax * sizeof(const real *));
    ck->hdA = ssm_take(a, hmax * e);
    ck->Bc = ssm_take(a, Q * Np * e);
    ck->Cc = ssm_take(a, Q * Np * e);
    ck->dBc = ssm_take(a, Q * Np * e);
    ck->dCc = ssm_take(a, Q * Np * e);
    ck->BT = ssm_take(a, Np * Q * e);
    ck->X = ssm_take(a, Q * Pp * e);
    ck->Xs = ssm_take(a, Q * Pp * e);
    ck->W = ssm_take(a, Q * Pp * e);
    ck->dy = ssm_take(a, Q * Pp * e);
    ck->dXs = ssm_take(a, Q * Pp * e);
    ck->Wy = ssm_take(a, Q * Pp * e);
    ck->XsT = ssm_take(a, Pp * Q * e);
    ck->D = ssm_take(a, Q * Q * e);
    ck->CBd = ssm_take(a, Q * Q * e);
    ck->dS = ssm_take(a, Np * Pp * e);
    ck->dS2 = ssm_take(a, Np * Pp * e);
    ck->dST = ssm_take(a, Pp * Np * e);
    ck->l_all = ssm_take(a, hmax * nc * Q * sizeof(double));
    ck->sp_all = ssm_take(a, hmax * nc * Q * e);
    ck->dtv_all = ssm_take(a, hmax * nc * Q * e);
    ck->el_all = ssm_take(a, hmax * nc * Q * e);
    ck->e2_all = ssm_take(a, hmax * nc * Q * e);
    ck->dl = ssm_take(a, Q * e);
    ck->cs = ssm_take(a, Q * e);
    ck->erow = ssm_take(a, Q * e);
    ck->wrow = ssm_take(a, Q * e);
    ck->rd = ssm_take(a, Q * e);
}

/* softplus(dt) of head h at tokens [t0, t0 + L), the cumulative log decays l (in double), and
 * e^(l_end - l_t) in e2; 0 past L */
static void ssm_ck_decays(const ssm_scan_params * p, int64_t q, int64_t h, int64_t t0, int64_t L,
                               const real * dt, real Ah, ssm_back_chunk * ck) {
    double acc = 0;
    for (int64_t t = 0; t < L; ++t) ck->dtv[t] = dt[q * p->dt_st[0] + (t0 + t) * p->dt_st[1] + h * p->dt_st[2]];
    for (int64_t t = 0; t < L; ++t) ck->sp[t] = real_softplus(ck->dtv[t]);
    for (int64_t t = 0; t < L; ++t) {
        acc += (double) (ck->sp[t] * Ah);
        ck->l[t] = acc;
    }
    for (int64_t t = 0; t < L; ++t) ck->e2[t] = real_exp_poly((real) (acc - ck->l[t]));
    for (int64_t t = 0; t < L; ++t) ck->el[t] = real_exp_poly((real) ck->l[t]);
    for (int64_t t = L; t < SSM_CHUNK_T; ++t) ck->sp[t] = ck->e2[t] = ck->el[t] = 0;
}

/* x of head h at tokens [t0, t0 + L) into X, sp * x into Xs ([Q][Pp], zero elsewhere) */
static void ssm_ck_x(const ssm_scan_params * p, int64_t q, int64_t h, int64_t t0, int64_t L,
                          const real * x, ssm_back_chunk * ck) {
    const int64_t Pp = ssm_chunk_pp(p), hd = p->head_dim, x3 = p->x_st[3];
    const real * x0 = x + q * p->x_st[0] + t0 * p->x_st[1] + h * p->x_st[2];
    if (x3 == 1 && hd == Pp) {         /* rows of whole vectors: read in place */
        ck->Xp = x0;
        ck->xst = p->x_st[1];
    } else {
        for (int64_t t = 0; t < L; ++t) {
            const real * xr = x0 + t * p->x_st[1];
            real * restrict xo = ck->X + t * Pp;
            for (int64_t pp = 0; pp < hd; ++pp) xo[pp] = xr[pp * x3];
            for (int64_t pp = hd; pp < Pp; ++pp) xo[pp] = 0;
        }
        ck->Xp = ck->X;
        ck->xst = Pp;
    }
    for (int64_t t = 0; t < L; ++t) {
        const real * restrict xr = ck->Xp + t * ck->xst;
        real * restrict xs = ck->Xs + t * Pp;
        const real sp = ck->sp[t];
        for (int64_t pp = 0; pp < Pp; ++pp) xs[pp] = sp * xr[pp];
    }
    if (L < SSM_CHUNK_T) memset(ck->Xs + L * Pp, 0, (size_t) (SSM_CHUNK_T - L) * Pp * sizeof(real));
}

/* Ask for the rows of x (and of the y gradient gy if not NULL) of head h at the tokens of chunk
 * c, ahead of use: a head's row is a few hundred bytes, one per token, n_head * head_dim
 * elements apart, where the hardware prefetchers do not follow. */
static void ssm_ck_prefetch(const ssm_scan_params * p, int64_t q, int64_t h, int64_t c,
                                 const real * x, const real * gy, const real * dx) {
    const int64_t t0 = c * SSM_CHUNK_T, hd = p->head_dim;
    if (c < 0 || t0 >= p->n_t) return;
    const int64_t L = ssm_min64(SSM_CHUNK_T, p->n_t - t0);
    for (int64_t t = t0; t < t0 + L; ++t) {
        const int64_t row = ((q * p->n_t + t) * p->n_head + h) * hd;
        if (p->x_st[3] == 1) ssm_prefetch_run(x + q * p->x_st[0] + t * p->x_st[1] + h * p->x_st[2], hd);
        if (gy) ssm_prefetch_run(gy + row, hd);
        if (dx)   /* the d_x rows the chunk will write: asked for with intent to write */
            for (int64_t off = 0; off < hd * (int64_t) sizeof(real); off += 64)
                __builtin_prefetch((const char *) (dx + row) + off, 1, 3);
    }
}

/* ssm_back_unit_chunked, step 1: C_t . B_tau of every chunk into ck->CB, shared by the unit's
 * heads (lower triangle), and by the thread's next units of the same (sequence, group): a unit whose
 * pair the thread did last finds it there (the same bits: the product depends on q and g alone) */
SSM_INLINE void ssm_ck_unit_cb(const ssm_scan_params * p, int64_t q, int64_t g, const real * B, const real * C,
                               ssm_back_chunk * ck) {
    const int64_t ds = p->d_state, n_t = p->n_t, Q = SSM_CHUNK_T, Np = ssm_chunk_np(p);
    const int64_t nc = (n_t + Q - 1) / Q;
    if (ck->cb_q == q && ck->cb_g == g) return;
    ck->cb_q = q;
    ck->cb_g = g;
    for (int64_t c = 0; c < nc; ++c) {
        const int64_t t0 = c * Q, L = ssm_min64(Q, n_t - t0);
        ssm_chunk_bc(p, q, g, t0, L, B, C, ck->Bc, ck->Cc, &ck->Bp, &ck->Cp, &ck->bst, &ck->cst);
        if (L == Q && Np == ds)   /* whole 16 x 16 blocks */
            ssm_chunk_transpose(p->simd, ck->Bp, ck->bst, ck->BT, Q, Q, Np);
        else
            for (int64_t n = 0; n < Np; ++n)
                for (int64_t t = 0; t < Q; ++t) ck->BT[n * Q + t] = t < L && n < ds ? ck->Bp[t * ck->bst + n] : 0;
        ssm_mm(&(ssm_mm_args) { .M = L, .J = Q, .K = ds, .X = ck->Cp, .xi = ck->cst, .xk = 1, .Y = ck->BT,
                                .ys = Q, .O = ck->CB + c * Q * Q, .os = Q, .shape = SSM_MM_OUT_LOWER });
    }
}

/* ssm_back_unit_chunked, step 2: head h's state before each chunk (and after the last) into
 * ck->St, [hd][Np] each, by a pass over the chunks from s[ids[q]] */
/* head h's start state s[ids[q]] into ck->St ([hd][Np], zero past d_state; at slot hslot) */
SSM_INLINE void ssm_ck_start_state(const ssm_scan_params * p, int64_t q, int64_t h, const real * s,
                                   const int64_t * ids, ssm_back_chunk * ck) {
    const int64_t hd = p->head_dim, ds = p->d_state, Np = ssm_chunk_np(p);
    real * St = ck->St + ck->hslot * hd * Np;
    memset(St, 0, (size_t) hd * Np * sizeof(real));
    const real * src = s + ids[q] * p->s_st[0] + h * p->s_st[1];
    if (p->s_st[3] == 1)   /* rows in place: copied whole (a strided element loop was 1% of the backward) */
        for (int64_t pp = 0; pp < hd; ++pp) memcpy(St + pp * Np, src + pp * p->s_st[2], (size_t) ds * sizeof(real));
    else
        for (int64_t pp = 0; pp < hd; ++pp)
            for (int64_t n = 0; n < ds; ++n) St[pp * Np + n] = src[pp * p->s_st[2] + n * p->s_st[3]];
}

SSM_INLINE void ssm_ck_head_states(const ssm_scan_params * p, int64_t q, int64_t g, int64_t h, const real * s,
                                   const real * x, const real * dt, const real * A, const real * B, const real * C,
                                   const int64_t * ids, const real * gy_in, real * d_x, ssm_back_chunk * ck) {
    const int64_t hd = p->head_dim, n_t = p->n_t;
    const int64_t Q = SSM_CHUNK_T, Np = ssm_chunk_np(p), Pp = ssm_chunk_pp(p);
    const int64_t nc = (n_t + Q - 1) / Q;
    const size_t stn = (size_t) hd * Np;   /* elements of one stored state */
    const real Ah = A[h * p->A_st[0]];
    ssm_ck_start_state(p, q, h, s, ids, ck);
    for (int64_t c = 0; c < nc; ++c) {
        const int64_t t0 = c * Q, L = ssm_min64(Q, n_t - t0);
        ssm_ck_decays_at(ck, c);
        ssm_ck_decays(p, q, h, t0, L, dt, Ah, ck);
        ssm_ck_x(p, q, h, t0, L, x, ck);
        ssm_chunk_bc(p, q, g, t0, L, B, C, ck->Bc, ck->Cc, &ck->Bp, &ck->Cp, &ck->bst, &ck->cst);
        if (c + 1 < nc) ssm_ck_prefetch(p, q, h, c + 1, x, NULL, NULL);
        else ssm_ck_prefetch(p, q, h, nc - 1, x, gy_in, d_x);   /* the backward's first chunk */
        for (int64_t t = 0; t < Q; ++t) {   /* (restrict rows: as in ssm_ck_chunk_grads) */
            real * restrict w = ck->W + t * Pp;
            const real * restrict xs = ck->Xs + t * Pp;
            const real e2 = ck->e2[t];
            for (int64_t pp = 0; pp < Pp; ++pp) w[pp] = e2 * xs[pp];
        }
        const real eend = ck->el[L - 1];
        const real * S0 = ck->St + c * stn;
        real * S1 = ck->St + (c + 1) * stn;
        /* S1[p][n] = eend S0[p][n] + sum_t W[t][p] B[t][n] */
        ssm_mm(&(ssm_mm_args) { .M = hd, .J = Np, .K = L, .X = ck->W, .xi = 1, .xk = Pp, .Y = ck->Bp,
                                .ys = ck->bst, .O = S1, .os = Np, .Z = S0, .beta = eend });
    }
}

/* ssm_back_unit_chunked, step 2 with the forward's states (kept: ssm_scan_keep_*'s chunk_states): the
 * start state and every chunk's decays as step 2 leaves them, without its products. Returns
 * head h's states after each chunk, hd x Np apart: in kept itself where its rows are whole vectors
 * (Np == d_state), else copied into ck->St after the start state. */
SSM_INLINE const real * ssm_ck_head_kept(const ssm_scan_params * p, int64_t q, int64_t h, const real * s,
                                         const real * x, const real * dt, const real * A, const int64_t * ids,
                                         const real * kept, const real * gy_in, real * d_x, ssm_back_chunk * ck) {
    const int64_t hd = p->head_dim, ds = p->d_state, n_t = p->n_t;
    const int64_t Q = SSM_CHUNK_T, Np = ssm_chunk_np(p);
    const int64_t nc = (n_t + Q - 1) / Q;
    const real Ah = A[h * p->A_st[0]];
    ssm_ck_start_state(p, q, h, s, ids, ck);
    for (int64_t c = 0; c < nc; ++c) {
        ssm_ck_decays_at(ck, c);
        ssm_ck_decays(p, q, h, c * Q, ssm_min64(Q, n_t - c * Q), dt, Ah, ck);
    }
    ssm_ck_prefetch(p, q, h, nc - 1, x, gy_in, d_x);   /* the backward's first chunk */
    const real * kh = kept + (q * p->n_head + h) * nc * hd * ds;
    if (Np == ds) return kh;
    real * St = ck->St + (size_t) hd * Np;
    for (int64_t c = 0; c < nc; ++c)
        for (int64_t pp = 0; pp < hd; ++pp) {
            real * restrict o = St + (c * hd + pp) * Np;
            memcpy(o, kh + (c * hd + pp) * ds, (size_t) ds * sizeof(real));
            for (int64_t n = ds; n < Np; ++n) o[n] = 0;
        }
    return St;
}

/* ssm_back_unit_chunked, step 3a: the chunk's D[t][tau] = dy_t . Xs_tau (in ck->D) times the
 * decays e^(l_t - l_tau) on tau <= t, zero above, and CBd = the decayed C_t . B_tau; dl_t gains
 * the pair terms' share (d y_t . the pair's term, summed over tau, less the sums over t) */
SSM_INLINE void ssm_ck_chunk_d(int64_t L, const real * CB, ssm_back_chunk * ck) {
    const int64_t Q = SSM_CHUNK_T;
    const int fast = ssm_chunk_exp_fast(ck->l, L, L > 0 ? ck->l[L - 1] : 0);
    for (int64_t t = 0; t < Q; ++t) ck->dl[t] = ck->cs[t] = 0;
    for (int64_t t = 0; t < L; ++t) {
        real * Dr = ck->D + t * Q;
        real * CBr = ck->CBd + t * Q;
        const real * cbr = CB + t * Q;
        real * restrict er = ck->erow;
        const double lt = ck->l[t];
        for (int64_t tau = 0; tau <= t; ++tau) er[tau] = (real) (lt - ck->l[tau]);
        if (fast)   /* real_exp_poly's bits in its range, half the operations (as the forward's ssm_fc_cbd) */
            for (int64_t tau = 0; tau <= t; ++tau) er[tau] = real_exp_poly_fast(er[tau]);
        else
            for (int64_t tau = 0; tau <= t; ++tau) er[tau] = real_exp_poly(er[tau]);
        real * restrict wr = ck->wrow;
        for (int64_t tau = 0; tau <= t; ++tau) {
            const real e = er[tau];
            const real cbd = e * cbr[tau];
            wr[tau] = cbd * Dr[tau];      /* d y_t . the pair's term */
            CBr[tau] = cbd;
            Dr[tau] = e * Dr[tau];
        }
        for (int64_t tau = t + 1; tau < Q; ++tau) wr[tau] = CBr[tau] = Dr[tau] = 0;
        real * restrict cs = ck->cs;
        for (int64_t tau = 0; tau < Q; ++tau) cs[tau] += wr[tau];
        ck->dl[t] += ssm_ck_sum(wr, Q);
    }
    for (int64_t t = L; t < Q; ++t)
        for (int64_t tau = 0; tau < Q; ++tau) ck->D[t * Q + tau] = ck->CBd[t * Q + tau] = 0;
    for (int64_t t = 0; t < L; ++t) ck->dl[t] -= ck->cs[t];
}

/* ssm_back_unit_chunked, step 3b: the chunk's d Xs (in ck->dXs), the head terms of d_B and d_C
 * (into the unit's partial sums where their rows are whole vectors, else into dBc / dCc), and
 * dl's terms from them and from S_end (S0, S1: the states before and after the chunk; dyp, dys:
 * the y gradient's rows) */
SSM_INLINE void ssm_ck_chunk_grads(const ssm_scan_params * p, int64_t t0, int64_t L, const real * S0,
                                   const real * S1, const real * dyp, int64_t dys, int first, real * dB_part,
                                   real * dC_part, ssm_back_chunk * ck) {
    const int64_t hd = p->head_dim, ds = p->d_state, Q = SSM_CHUNK_T, Np = ssm_chunk_np(p), Pp = ssm_chunk_pp(p);
    /* W = e2 Xs (the chunk's inputs as S_end sees them), Wy = e^(l_t) dy_t */
    for (int64_t t = 0; t < L; ++t) {   /* rows through restrict pointers: else ck's fields are read
                                           * again after every store, and the loop stays scalar */
        real * restrict w = ck->W + t * Pp, * restrict wy = ck->Wy + t * Pp;
        const real * restrict xs = ck->Xs + t * Pp, * restrict dy = dyp + t * dys;
        const real e2 = ck->e2[t], el = ck->el[t];
        for (int64_t pp = 0; pp < Pp; ++pp) {
            w[pp] = SSM_MUTANT(SSM_MUT_BACK_CK_DB, e2 * xs[pp]);
            wy[pp] = SSM_MUTANT(SSM_MUT_BACK_CK_DC, el * dy[pp]);
        }
    }

    /* d Xs_tau = e2_tau dS^T B_tau + sum_t CBd[t][tau] dy_t; l_tau loses <B_tau (x) W_tau, dS> */
    ssm_mm(&(ssm_mm_args) { .M = L, .J = Pp, .K = ds, .X = ck->Bp, .xi = ck->bst, .xk = 1, .Y = ck->dS,
                            .ys = Pp, .O = ck->dXs, .os = Pp, .rs = ck->e2 });
    ssm_ck_rowdots(p->simd, ck->dXs, Pp, ck->Xs, Pp, L, Pp, ck->rd);
    for (int64_t t = 0; t < L; ++t) ck->dl[t] -= ck->rd[t];
    ssm_mm(&(ssm_mm_args) { .M = L, .J = Pp, .K = L, .X = ck->CBd, .xi = 1, .xk = Q, .Y = dyp, .ys = dys,
                            .O = ck->dXs, .os = Pp, .acc = 1, .shape = SSM_MM_UPPER });

    /* d B_tau's head term dS W_tau (its D term, sum_t D[t][tau] C_t, comes after the heads):
     * straight into the unit's partial sums where their rows are whole vectors, else
     * through dBc */
    const int direct = Np == ds;
    real * dBo = direct ? dB_part + t0 * ds : ck->dBc;
    ssm_mm(&(ssm_mm_args) { .M = L, .J = Np, .K = hd, .X = ck->W, .xi = Pp, .xk = 1, .Y = ck->dST,
                            .ys = Np, .O = dBo, .os = Np, .acc = direct && !first });

    /* d C_t's head term S0 Wy_t (its D term, sum_tau D[t][tau] B_tau, after the heads);
     * l_t gains C_t . S0 Wy_t (y_t's share) */
    /* (straight into the partial sums too where d_B's go there, S0 Wy_t alone to dCc) */
    real * dCo = direct ? dC_part + t0 * ds : ck->dCc;
    ssm_mm(&(ssm_mm_args) { .M = L, .J = Np, .K = hd, .X = ck->Wy, .xi = Pp, .xk = 1, .Y = S0, .ys = Np,
                            .O = dCo, .os = Np, .acc = direct && !first, .O2 = direct ? ck->dCc : NULL });
    ssm_ck_rowdots(p->simd, ck->Cp, ck->cst, ck->dCc, Np, L, Np, ck->rd);
    for (int64_t t = 0; t < L; ++t) ck->dl[t] += ck->rd[t];

    /* l_end's share of S_end: <S_end, dS> */
    ck->dl[L - 1] += ssm_ck_dot(S1, ck->dST, hd * Np);
}

/* ssm_back_unit_chunked, step 3c: the chunk's d_x and d_dt of head h, its share of d_A (into
 * *dA_h), and, where d_B and d_C went through dBc / dCc, those into the partial sums;
 * d(sp A)_tau = sum_{t >= tau} dl_t */
SSM_INLINE void ssm_ck_chunk_dx(const ssm_scan_params * p, int64_t q, int64_t h, int64_t t0, int64_t L, real Ah,
                                int first, real * d_x, real * d_dt, real * dB_part, real * dC_part, real * dA_h,
                                ssm_back_chunk * ck) {
    const int64_t n_head = p->n_head, hd = p->head_dim, ds = p->d_state, n_t = p->n_t;
    const int64_t Np = ssm_chunk_np(p), Pp = ssm_chunk_pp(p);
    const int direct = Np == ds;
    ssm_ck_rowdots(p->simd, ck->Xp, ck->xst, ck->dXs, Pp, L, Pp, ck->rd);   /* x_t . dXs_t */
    real acc = 0;
    for (int64_t t = L - 1; t >= 0; --t) {
        acc += ck->dl[t];
        const real sp = ck->sp[t];
        real * restrict dx = d_x + ((q * n_t + t0 + t) * n_head + h) * hd;
        const real * restrict dxs = ck->dXs + t * Pp;
        for (int64_t pp = 0; pp < hd; ++pp) dx[pp] = SSM_MUTANT(SSM_MUT_BACK_CK_DX, sp * dxs[pp]);
        const real dsp = ck->rd[t] + Ah * acc;
        d_dt[(q * n_t + t0 + t) * n_head + h] = SSM_MUTANT(SSM_MUT_BACK_CK_DDT, dsp * real_dsoftplus(ck->dtv[t]));
        *dA_h += SSM_MUTANT(SSM_MUT_BACK_CK_DA, sp * acc);
    }
    for (int64_t t = 0; !direct && t < L; ++t) {
        real * db = dB_part + (t0 + t) * ds;
        real * dc = dC_part + (t0 + t) * ds;
        if (first) {
            memcpy(db, ck->dBc + t * Np, ds * sizeof(real));
            memcpy(dc, ck->dCc + t * Np, ds * sizeof(real));
        } else {
            ssm_add_to(db, ck->dBc + t * Np, ds);
            ssm_add_to(dc, ck->dCc + t * Np, ds);
        }
    }
}

/* ssm_back_unit_chunked, step 3, begins: head h's dS from the incoming gradient of its final state */
SSM_INLINE void ssm_ck_head_begin(const ssm_scan_params * p, int64_t q, int64_t h, const real * grad,
                                  ssm_back_chunk * ck) {
    const int64_t n_head = p->n_head, hd = p->head_dim, ds = p->d_state;
    const int64_t Np = ssm_chunk_np(p), Pp = ssm_chunk_pp(p);
    const real * gs_in = grad + p->n_seqs * p->n_t * n_head * hd;
    memset(ck->dS, 0, (size_t) Np * Pp * sizeof(real));
    memset(ck->dS2, 0, (size_t) Np * Pp * sizeof(real));
    ssm_chunk_transpose(p->simd, gs_in + (q * n_head + h) * hd * ds, ds, ck->dS, Pp, hd, ds);
}

/* ssm_back_unit_chunked, step 3, one chunk c of head h, with the states of step 2 (the start state in
 * ck->St at slot hslot, the states after each chunk from S_after, hd x Np apart), dS the gradient of the
 * state after the chunk (dS becomes that of the state before it): d_x, d_dt, the head terms of d_B and
 * d_C, D summed into ck->Ds, d_A's share into *dA_h. Hints for the chunk that comes next: (nh, ncn) (no
 * hints where ncn < 0), with its y gradient's and d_x's rows if next_full. */
SSM_INLINE void ssm_ck_head_chunk(const ssm_scan_params * p, int64_t q, int64_t g, int64_t h, int64_t c, int first,
                                  const real * x, const real * A, const real * B, const real * C,
                                  const real * grad, real * gin, const real * S_after, real * dB_part,
                                  real * dC_part, int64_t nh, int64_t ncn, int next_full, real * dA_h,
                                  ssm_back_chunk * ck) {
    const int64_t n_head = p->n_head, hd = p->head_dim, ds = p->d_state, n_t = p->n_t;
    const int64_t Q = SSM_CHUNK_T, Np = ssm_chunk_np(p), Pp = ssm_chunk_pp(p);
    const int64_t N_y = p->n_seqs * n_t * n_head * hd;
    const real * gy_in = grad;
    real * d_x = gin + p->n_rs * n_head * hd * ds;
    real * d_dt = d_x + N_y;
    const size_t stn = (size_t) hd * Np;   /* elements of one stored state */
    const real Ah = A[h * p->A_st[0]];
    const int64_t t0 = c * Q, L = ssm_min64(Q, n_t - t0);
    const real * S0 = c > 0 ? S_after + (c - 1) * stn : ck->St + ck->hslot * stn;
    const real * S1 = S_after + c * stn;
    ssm_ck_decays_at(ck, c);   /* as the pass of step 2 left them */
    ssm_ck_x(p, q, h, t0, L, x, ck);
    ssm_chunk_bc(p, q, g, t0, L, B, C, ck->Bc, ck->Cc, &ck->Bp, &ck->Cp, &ck->bst, &ck->cst);
    if (ncn >= 0) ssm_ck_prefetch(p, q, nh, ncn, x, next_full ? gy_in : NULL, next_full ? d_x : NULL);
    /* the y gradient's rows: in place where they are whole vectors, else padded copies */
    const real * dyp = gy_in + ((q * n_t + t0) * n_head + h) * hd;
    int64_t dys = n_head * hd;
    if (Pp != hd) {
        memset(ck->dy, 0, (size_t) Q * Pp * sizeof(real));
        for (int64_t t = 0; t < L; ++t) memcpy(ck->dy + t * Pp, dyp + t * dys, hd * sizeof(real));
        dyp = ck->dy;
        dys = Pp;
    }
    ssm_chunk_transpose(p->simd, ck->Xs, Pp, ck->XsT, Q, Q, Pp);
    ssm_chunk_transpose(p->simd, ck->dS, Pp, ck->dST, Np, Np, Pp);

    ssm_mm(&(ssm_mm_args) { .M = L, .J = Q, .K = hd, .X = dyp, .xi = dys, .xk = 1, .Y = ck->XsT, .ys = Q,
                            .O = ck->D, .os = Q, .shape = SSM_MM_OUT_LOWER });
    ssm_ck_chunk_d(L, ck->CB + c * Q * Q, ck);
    /* D's products with B and C are linear in D: summed over the heads first (in head
     * order), they run once per chunk after the heads (step 4) instead of once per head */
    if (first) memcpy(ck->Ds + c * Q * Q, ck->D, (size_t) Q * Q * sizeof(real));
    else ssm_add_to(ck->Ds + c * Q * Q, ck->D, Q * Q);
    ssm_ck_chunk_grads(p, t0, L, S0, S1, dyp, dys, first, dB_part, dC_part, ck);

    /* dS before the chunk = e^(l_end) dS + sum_t C_t (x) e^(l_t) dy_t */
    const real eend = ck->el[L - 1];
    ssm_mm(&(ssm_mm_args) { .M = ds, .J = Pp, .K = L, .X = ck->Cp, .xi = 1, .xk = ck->cst, .Y = ck->Wy,
                            .ys = Pp, .O = ck->dS2, .os = Pp, .Z = ck->dS,
                            .beta = SSM_MUTANT(SSM_MUT_BACK_CK_DS, eend) });
    { real * tmp = ck->dS; ck->dS = ck->dS2; ck->dS2 = tmp; }
    ssm_ck_chunk_dx(p, q, h, t0, L, Ah, first, d_x, d_dt, dB_part, dC_part, dA_h, ck);
}

/* ssm_back_unit_chunked, step 3, ends: what is left in dS is dLoss/dS_0, this sequence's share of d_s;
 * and its share of d_A */
SSM_INLINE void ssm_ck_head_end(const ssm_scan_params * p, int64_t q, int64_t h, real dA_h,
                                const ssm_back_shared * sh, ssm_back_chunk * ck) {
    const int64_t n_head = p->n_head, hd = p->head_dim, ds = p->d_state, Pp = ssm_chunk_pp(p);
    ssm_chunk_transpose(p->simd, ck->dS, Pp, sh->dS_seq + (q * n_head + h) * hd * ds, ds, ds, hd);
    sh->dA_seq[q * n_head + h] = dA_h;
}

/* ssm_back_unit_chunked, step 3: head h's chunks backwards from the incoming gradient of the
 * final state */
SSM_INLINE void ssm_ck_head_back(const ssm_scan_params * p, int64_t q, int64_t g, int64_t h, int64_t hs,
                                 int64_t he, const real * x, const real * A, const real * B, const real * C,
                                 const real * grad, real * gin, const ssm_back_shared * sh, const real * S_after,
                                 real * dB_part, real * dC_part, ssm_back_chunk * ck) {
    const int64_t nc = (p->n_t + SSM_CHUNK_T - 1) / SSM_CHUNK_T;
    ssm_ck_head_begin(p, q, h, grad, ck);
    real dA_h = 0;
    for (int64_t c = nc - 1; c >= 0; --c) {
        /* hints: the head's next chunk; after its last, the next head's first (for step 2's pass) */
        const int64_t nh = c > 0 ? h : h + 1, ncn = c > 0 ? c - 1 : h + 1 < he ? 0 : -1;
        ssm_ck_head_chunk(p, q, g, h, c, h == hs, x, A, B, C, grad, gin, S_after, dB_part, dC_part, nh, ncn,
                          c > 0, &dA_h, ck);
    }
    ssm_ck_head_end(p, q, h, dA_h, sh, ck);
}

/* ssm_back_unit_chunked, step 4, chunk c: the D terms of d_B and d_C, with D summed over the unit's
 * heads: d B_tau += sum_t Ds[t][tau] C_t,  d C_t += sum_tau Ds[t][tau] B_tau */
SSM_INLINE void ssm_ck_chunk_dterms(const ssm_scan_params * p, int64_t q, int64_t g, int64_t c, const real * B,
                                    const real * C, real * dB_part, real * dC_part, ssm_back_chunk * ck) {
    const int64_t ds = p->d_state, n_t = p->n_t, Q = SSM_CHUNK_T, Np = ssm_chunk_np(p);
    const int64_t t0 = c * Q, L = ssm_min64(Q, n_t - t0);
    const real * Ds = ck->Ds + c * Q * Q;
    ssm_chunk_bc(p, q, g, t0, L, B, C, ck->Bc, ck->Cc, &ck->Bp, &ck->Cp, &ck->bst, &ck->cst);
    if (Np == ds) {
        ssm_mm(&(ssm_mm_args) { .M = L, .J = Np, .K = L, .X = Ds, .xi = 1, .xk = Q, .Y = ck->Cp,
                                .ys = ck->cst, .O = dB_part + t0 * ds, .os = Np, .acc = 1,
                                .shape = SSM_MM_UPPER });
        ssm_mm(&(ssm_mm_args) { .M = L, .J = Np, .K = L, .X = Ds, .xi = Q, .xk = 1, .Y = ck->Bp,
                                .ys = ck->bst, .O = dC_part + t0 * ds, .os = Np, .acc = 1,
                                .shape = SSM_MM_LOWER });
    } else {
        ssm_mm(&(ssm_mm_args) { .M = L, .J = Np, .K = L, .X = Ds, .xi = 1, .xk = Q, .Y = ck->Cp,
                                .ys = ck->cst, .O = ck->dBc, .os = Np, .shape = SSM_MM_UPPER });
        ssm_mm(&(ssm_mm_args) { .M = L, .J = Np, .K = L, .X = Ds, .xi = Q, .xk = 1, .Y = ck->Bp,
                                .ys = ck->bst, .O = ck->dCc, .os = Np, .shape = SSM_MM_LOWER });
        for (int64_t t = 0; t < L; ++t) {
            ssm_add_to(dB_part + (t0 + t) * ds, ck->dBc + t * Np, ds);
            ssm_add_to(dC_part + (t0 + t) * ds, ck->dCc + t * Np, ds);
        }
    }
}

/* One unit (sequence q, group g, heads [hs, he)) in the chunked form: C . B of every chunk, then
 * per head the states before each chunk (recomputed, or the forward's: kept, if not NULL) and the
 * chunks backwards, then the D terms of d_B, d_C. */
static void ssm_back_unit_chunked(const ssm_scan_params * p, int64_t q, int64_t g, int64_t hs, int64_t he,
                                  const real * s, const real * x, const real * dt, const real * A,
                                  const real * B, const real * C, const int64_t * ids, const real * kept,
                                  const real * grad, real * gin, const ssm_back_shared * sh,
                                  real * dB_part, real * dC_part, ssm_back_chunk * ck) {
    real * d_x = gin + p->n_rs * p->n_head * p->head_dim * p->d_state;
    ssm_ck_unit_cb(p, q, g, B, C, ck);
    for (int64_t h = hs; h < he; ++h) {
        const real * S_after = ck->St + p->head_dim * ssm_chunk_np(p);
        if (kept) S_after = ssm_ck_head_kept(p, q, h, s, x, dt, A, ids, kept, grad, d_x, ck);
        else ssm_ck_head_states(p, q, g, h, s, x, dt, A, B, C, ids, grad, d_x, ck);
        ssm_ck_head_back(p, q, g, h, hs, he, x, A, B, C, grad, gin, sh, S_after, dB_part, dC_part, ck);
    }
    for (int64_t c = 0; c < ck->nc; ++c) ssm_ck_chunk_dterms(p, q, g, c, B, C, dB_part, dC_part, ck);
}

/* ssm_back_unit_by_chunk's head slot i, before its k-th chunk counted from the last: its decays and start
 * state (hslot), its dS at hdS + (2 i + k % 2) NP and dS2 beside it (the chunk step swaps the two) */
SSM_INLINE void ssm_ck_head_at(ssm_back_chunk * ck, int64_t i, int64_t k, int64_t NP) {
    ck->hslot = i;
    ck->dS = ck->hdS + (2 * i + k % 2) * NP;
    ck->dS2 = ck->hdS + (2 * i + 1 - k % 2) * NP;
}

/* ssm_back_unit_chunked with the forward's states where they are read in place (kept, Np == d_state),
 * the chunks outermost: chunk by chunk in reverse, each of the unit's heads (in order), then the chunk's D
 * terms. A chunk's rows of the unit's d_B and d_C partial sums then stay in the caches across its heads
 * (head by head, each head's pass streamed all of them: at n_t 2048, d_state 128, 2 MB). Every sum is the
 * same as ssm_back_unit_chunked's, in the same order (a row's head terms in head order, then its D terms;
 * each head's chunks in reverse): the same bits. Each head keeps its dS and d_A across the chunks. */
static void ssm_back_unit_by_chunk(const ssm_scan_params * p, int64_t q, int64_t g, int64_t hs, int64_t he,
                                   const real * s, const real * x, const real * dt, const real * A,
                                   const real * B, const real * C, const int64_t * ids, const real * kept,
                                   const real * grad, real * gin, const ssm_back_shared * sh,
                                   real * dB_part, real * dC_part, ssm_back_chunk * ck) {
    const int64_t NP = ssm_chunk_np(p) * ssm_chunk_pp(p), nc = ck->nc;
    real * d_x = gin + p->n_rs * p->n_head * p->head_dim * p->d_state;
    ssm_ck_unit_cb(p, q, g, B, C, ck);
    for (int64_t h = hs; h < he; ++h) {
        ssm_ck_head_at(ck, h - hs, 0, NP);
        ck->hafter[h - hs] = ssm_ck_head_kept(p, q, h, s, x, dt, A, ids, kept, grad, d_x, ck);
        ssm_ck_head_begin(p, q, h, grad, ck);
        ck->hdA[h - hs] = 0;
    }
    for (int64_t c = nc - 1; c >= 0; --c) {
        for (int64_t h = hs; h < he; ++h) {
            ssm_ck_head_at(ck, h - hs, nc - 1 - c, NP);
            /* hints: the next head's chunk c, after the last head the first head's chunk c - 1 */
            const int64_t nh = h + 1 < he ? h + 1 : hs, ncn = h + 1 < he ? c : c - 1;
            ssm_ck_head_chunk(p, q, g, h, c, h == hs, x, A, B, C, grad, gin, ck->hafter[h - hs], dB_part, dC_part,
                              nh, ncn, 1, ck->hdA + (h - hs), ck);
        }
        ssm_ck_chunk_dterms(p, q, g, c, B, C, dB_part, dC_part, ck);
    }
    for (int64_t h = hs; h < he; ++h) {
        ssm_ck_head_at(ck, h - hs, nc, NP);
        ssm_ck_head_end(p, q, h, ck->hdA[h - hs], sh, ck);
    }
    ck->hslot = 0;
}


/* ssm_back_unit_by_chunk pays where a unit's d_B and d_C partial sums are larger than this; below it they
 * stay in L2 head after head, and the heads' own dS pairs, revisited chunk after chunk, cost more than they
 * save (python benchmarks/ab.py builds, 130m and 2.7B layers, n_t 512 and 2048, both SIMD passes:
 * docs/performance.md) */
#define SSM_BY_CHUNK_BYTES (1 << 20)

/* Phase 1 in the chunked form for the units [u_lo, u_hi), with the buffers taken from the
 * thread's arena ta. */
static void ssm_back_phase1_chunked(const ssm_scan_params * p, const real * s, const real * x, const real * dt,
                                const real * A, const real * B, const real * C, const int64_t * ids,
                                const real * kept, const real * grad, real * gin, const ssm_back_shared * sh,
                                ssm_arena * ta, int64_t u_lo, int64_t u_hi) {
    const int64_t n_t = p->n_t, ds = p->d_state, n_group = p->n_group;
    const int64_t hpg = ssm_heads_per_group(p), rpg = ssm_head_runs_per_group(p);
    ssm_back_chunk ck;
    ssm_back_take_chunk(ta, p, &ck);
    for (int64_t unit = u_lo; unit < u_hi; ++unit) {
        const int64_t q = unit / (n_group * rpg);
        const int64_t g = unit / rpg % n_group, c = unit % rpg;
        const int64_t hs = g * hpg + c * hpg / rpg, he = g * hpg + (c + 1) * hpg / rpg;
        /* the chunks outermost where the states are read in place, the unit has heads to share them, and its
         * partial sums would leave a 1 MB L2 (SSM_BY_CHUNK_BYTES: 2 n_t d_state elements) */
        if (kept && ssm_back_chunk_heads(p) > 1 && he - hs > 1
            && 2.0 * (double) n_t * (double) ds * sizeof(real) > SSM_BY_CHUNK_BYTES)
            ssm_back_unit_by_chunk(p, q, g, hs, he, s, x, dt, A, B, C, ids, kept, grad, gin, sh,
                                   sh->dB_part + unit * n_t * ds, sh->dC_part + unit * n_t * ds, &ck);
        else
            ssm_back_unit_chunked(p, q, g, hs, he, s, x, dt, A, B, C, ids, kept, grad, gin, sh,
                                  sh->dB_part + unit * n_t * ds, sh->dC_part + unit * n_t * ds, &ck);
    }
}

static size_t ssm_back_chunked_thread_bytes(const ssm_scan_params * p) {
    ssm_arena a = { NULL, 0 };
    ssm_back_chunk ck;
    ssm_back_take_chunk(&a, p, &ck);
    return a.off;
}

#endif /* SSM_SCAN_BACK_CHUNKED_BODY_H */
