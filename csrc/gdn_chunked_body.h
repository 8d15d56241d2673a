/*
 * gdn_chunked_body.h -- GATED_DELTA_NET forward and backward in the chunked (WY / UT-transform) form,
 * written once for the element type `real` (ssm_real_f32.h / ssm_real_f64.h). Included only by the
 * instantiation files csrc/inst/gdn_chunked_<type>_v<N>.c; every function here is static with its
 * plain name. Which calls take it: gdn_uses_chunked (gdn_common.h): the scalar gate, K == 1, n_t >= 1.
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
 *
 * The backward runs the chunks forward once keeping, per chunk, H0, Y and Dl (the chunk-boundary
 * states and two (L, S) matrices), then the chunks in reverse, recomputing the rest and applying the
 * VJP of the six lines above (gdnc_chunk_back).
 */
#ifndef SSM_REAL_H
#error "include ssm_real_f32.h or ssm_real_f64.h before gdn_chunked_body.h"
#endif

#include <string.h>

#include "ssm_common.h"
#include "gdn_common.h"
#include "gdn_grads.h"
#include "ssm_mm.h"

/* the six inputs, typed */
typedef struct {
    const real * q, * k, * v, * g, * beta, * state;
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
}

/* x . y over n elements, in increasing order */
static inline real gdnc_dot(const real * x, const real * y, int64_t n) {
    real s = 0;
    for (int64_t i = 0; i < n; ++i) s += x[i] * y[i];
    return s;
}

#if SSM_LEVEL >= 4 && REAL_LANES == 16 && !defined(GDNC_SCALAR_TRANSPOSE)
/* float at AVX-512: a 16 x 16 block in 16 vectors, transposed by four rounds of two-input shuffles
 * (round w swaps the off-diagonal w x w blocks of each 2w x 2w block) */
typedef float gdnc_v16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t gdnc_i16 __attribute__((vector_size(64)));
#define GDNC_TRANSPOSE_BLOCK 16
/* the rounds' lane indices (0-15: x, 16-31: y), and a two-input shuffle by constant indices in GCC's
 * and in clang's spelling */
#define GDNC_LO8 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define GDNC_HI8 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define GDNC_LO4 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27
#define GDNC_HI4 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31
#define GDNC_LO2 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29
#define GDNC_HI2 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31
#define GDNC_LO1 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30
#define GDNC_HI1 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31
#if defined(__clang__)
#define GDNC_SHUF(x, y, ...) __builtin_shufflevector(x, y, __VA_ARGS__)
#else
#define GDNC_SHUF(x, y, ...) __builtin_shuffle(x, y, (gdnc_i16) { __VA_ARGS__ })
#endif
SSM_INLINE void gdnc_transpose16(real * dst, int64_t ds, const real * src, int64_t ss) {
    gdnc_v16 a[16];
    for (int r = 0; r < 16; ++r) a[r] = *(const gdnc_v16 *) (src + r * ss);
    /* round w: lane l of the low row takes (l & w) ? y[l - w] : x[l], of the high row (l & w) ? y[l] : x[l + w] */
#define GDNC_T_ROUND(w, LO, HI)                                                              \
    for (int r = 0; r < 16; ++r)                                                             \
        if (!(r & (w))) {                                                                    \
            const gdnc_v16 x = a[r], y = a[r + (w)];                                         \
            a[r] = GDNC_SHUF(x, y, LO);                                                      \
            a[r + (w)] = GDNC_SHUF(x, y, HI);                                                \
        }
    GDNC_T_ROUND(8, GDNC_LO8, GDNC_HI8)
    GDNC_T_ROUND(4, GDNC_LO4, GDNC_HI4)
    GDNC_T_ROUND(2, GDNC_LO2, GDNC_HI2)
    GDNC_T_ROUND(1, GDNC_LO1, GDNC_HI1)
#undef GDNC_T_ROUND
    for (int r = 0; r < 16; ++r) *(gdnc_v16 *) (dst + r * ds) = a[r];
}
#else
#define GDNC_TRANSPOSE_BLOCK 0
#endif

/* rows r (row stride ss) transposed into dst (row stride ds): dst[c][r] = src[r][c], r < nr, c < nc
 * (whole 16 x 16 blocks by vector shuffles where the pass has them, the rest element by element) */
static void gdnc_transpose(real * dst, int64_t ds, const real * src, int64_t ss, int64_t nr, int64_t nc) {
    int64_t rb = 0, cb = 0;   /* rows / columns [0, rb) x [0, cb) done by blocks */
#if GDNC_TRANSPOSE_BLOCK
    rb = nr / GDNC_TRANSPOSE_BLOCK * GDNC_TRANSPOSE_BLOCK;
    cb = nc / GDNC_TRANSPOSE_BLOCK * GDNC_TRANSPOSE_BLOCK;
    for (int64_t r0 = 0; r0 < rb; r0 += GDNC_TRANSPOSE_BLOCK)
        for (int64_t c0 = 0; c0 < cb; c0 += GDNC_TRANSPOSE_BLOCK)
            gdnc_transpose16(dst + c0 * ds + r0, ds, src + r0 * ss + c0, ss);
#endif
    for (int64_t r0 = 0; r0 < nr; r0 += 16)   /* columns [cb, nc) of every row */
        for (int64_t c = cb; c < nc; ++c)
            for (int64_t r = r0; r < ssm_min64(r0 + 16, nr); ++r) dst[c * ds + r] = src[r * ss + c];
    for (int64_t c = 0; c < cb; ++c)          /* rows [rb, nr) of the other columns */
        for (int64_t r = rb; r < nr; ++r) dst[c * ds + r] = src[r * ss + c];
}

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

/* Cache hints of the forward (ssm_pf, they change no value): the k, q, v rows of the next chunk (the
 * o rows of this one: gdnc_o_tile). Consecutive tokens of one head lie a whole row of heads apart, a
 * stride the hardware prefetchers do not follow, and these rows were a fifth of the forward's time;
 * asked for all at once (or in a few bursts between the products) the requests queue up and stall as
 * the loads did, so the products' loops ask for them one line at a time. k, q rows only with `keys`
 * (one head of a batch); at a unit's last chunk, the states that gdnc_load_state and
 * gdnc_store_state then move. The streams: */
#define GDNC_PF_K 0        /* the next chunk's k rows */
#define GDNC_PF_Q 1        /* its q rows */
#define GDNC_PF_V 2        /* its v rows */
#define GDNC_PF_ST_IN 3    /* at a unit's last chunk: the next unit's start state (dense, S rows of S) */
#define GDNC_PF_ST_OUT 4   /* and this head's final state in out (for writing) */

/* pf's k, q, v streams: the rows [t0, t0 + L) of (n, h) where they are contiguous */
static void gdnc_pf_rows(ssm_pf * pf, const gdn_params * p, const gdnc_inputs * in, int64_t n, int64_t h,
                         int64_t t0, int64_t L, int keys) {   /* keys: 1 k rows, 2 q rows, 3 both */
    const int64_t nk = gdn_key_seq(p, n), kh = gdn_key_head(p, h);
    const int64_t * qs = p->q_st, * ks = p->k_st, * vs = p->v_st;
    pf->row0[GDNC_PF_K] = (keys & 1) && ks[3] == 1 ? in->k + nk * ks[0] + t0 * ks[1] + kh * ks[2] : NULL;
    pf->row0[GDNC_PF_Q] = (keys & 2) && qs[3] == 1 ? in->q + nk * qs[0] + t0 * qs[1] + kh * qs[2] : NULL;
    pf->row0[GDNC_PF_V] = vs[3] == 1 ? in->v + n * vs[0] + t0 * vs[1] + h * vs[2] : NULL;
    pf->stride[GDNC_PF_K] = ks[1];
    pf->stride[GDNC_PF_Q] = qs[1];
    pf->stride[GDNC_PF_V] = vs[1];
    pf->rows[GDNC_PF_K] = pf->rows[GDNC_PF_Q] = pf->rows[GDNC_PF_V] = L;
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

/* The backward's forward pass over one chunk from H (the state before it), after gdnc_load and
 * gdnc_chunk_keys: Y, Dl; then H becomes the state after the chunk. */
static void gdnc_chunk_fwd(const gdn_params * p, const gdnc_buf * b, int64_t L) {
    gdnc_make_AT(b, L);
    gdnc_chunk_delta(p, b, L, b->Vc, b->Sp, NULL);
    gdnc_chunk_state(p, b, L, NULL);
}

/* The forward's decay part of a chunk, row by row without keeping D: D[t][s] = exp(G_t - G_s) (s <= t;
 * the same values as gdnc_load_head's), A[t][s] = beta_t KK[t][s] D[t][s] (s < t) into D's room, and
 * P[t][s] = QK[t][s] (c D[t][s]) (s <= t, zero past t up to Lp); then T = (I + A)^-1 (gdnc_T_rows). */
static void gdnc_make_AP(const gdnc_buf * b, int64_t L, real c) {
    const int64_t C = GDN_CHUNK, Lp = gdn_pad(L);
    real e[GDN_CHUNK] __attribute__((aligned(64)));
    const double * restrict G = b->G;
    for (int64_t t = 0; t < L; ++t) {
        real * restrict At = b->D + t * C, * restrict Pt = b->P + t * C;
        const real * restrict KKt = b->KK + t * C, * restrict QKt = b->QK + t * C;
        const double Gt = G[t];
        const real bt = b->beta[t];
        const int64_t n_s = gdn_pad(t + 1);   /* lanes past the diagonal: exp of anything, then overwritten */
        for (int64_t s = 0; s < n_s; ++s) e[s] = (real) (Gt - G[s]);
        for (int64_t s = 0; s < n_s; ++s) e[s] = real_exp_poly(e[s]);
        e[t] = 1;
        for (int64_t s = 0; s < t; ++s) At[s] = bt * KKt[s] * e[s];
        for (int64_t s = 0; s <= t; ++s) Pt[s] = QKt[s] * (c * e[s]);
        for (int64_t s = t + 1; s < Lp; ++s) Pt[s] = 0;
    }
    gdnc_T(b, b->D, L);
}

/* One register tile of the chunk's o rows: o_t = c gamma_t q_t H0 + sum_{s <= t} P[t][s] Dl_s for the
 * rows i0 .. i0 + mr - 1 and the columns j0 .. j0 + nr SSM_MMW - 1: the sum over the state's rows in
 * increasing order, scaled by c gamma_t, then the sum over s in increasing order added on (P is zero
 * past the diagonal), stored once (rows of o with stride os, unaligned). */
SSM_INLINE void gdnc_o_tile(const int mr, const int nr, const gdnc_buf * b, int64_t S, int64_t i0, int64_t j0, real c,
                            real * o, int64_t os, ssm_pf * pf) {
    const int64_t Sp = b->Sp, C = GDN_CHUNK, k1 = i0 + mr;
    for (int i = 0; i < mr; ++i)   /* the tile's o lines, for writing (they arrive while it computes) */
        for (int v = 0; v < nr; ++v) __builtin_prefetch(o + (i0 + i) * os + j0 + v * SSM_MMW, 1, 3);
    mmv acc[SSM_MM_MR][SSM_MM_NR];
    for (int i = 0; i < mr; ++i)
        for (int v = 0; v < nr; ++v) acc[i][v] = (mmv) { 0 };
    ssm_mm_tile_sum(mr, nr, acc, 0, S, b->Qc + i0 * Sp, Sp, 1, b->H + j0, Sp, pf);
    for (int i = 0; i < mr; ++i) {
        const real r = c * b->gam[i0 + i];
        for (int v = 0; v < nr; ++v) acc[i][v] *= r;
    }
    ssm_mm_tile_sum(mr, nr, acc, 0, k1, b->P + i0 * C, C, 1, b->Dl + j0, Sp, NULL);
    for (int i = 0; i < mr; ++i)
        for (int v = 0; v < nr; ++v) ((mmu *) (o + (i0 + i) * os + j0))[v] = acc[i][v];
}

/* The chunk's L o rows into o (row stride os, Sp columns) by gdnc_o_tile, in the tiles of ssm_mm */
static void gdnc_o_rows(const gdnc_buf * b, int64_t S, int64_t L, real c, real * o, int64_t os, ssm_pf * pf) {
    const int64_t Sp = b->Sp, jw = SSM_MM_NR * SSM_MMW;
    for (int64_t i = 0; i < L;) {
        const int mr = i + SSM_MM_MR <= L ? SSM_MM_MR : i + 4 <= L ? 4 : 1;
        int64_t j = 0;
        if (mr == SSM_MM_MR) {
            for (; j + jw <= Sp; j += jw) gdnc_o_tile(SSM_MM_MR, SSM_MM_NR, b, S, i, j, c, o, os, pf);
            for (; j < Sp; j += SSM_MMW) gdnc_o_tile(SSM_MM_MR, 1, b, S, i, j, c, o, os, pf);
        } else if (mr == 4) {
            for (; j + jw <= Sp; j += jw) gdnc_o_tile(4, SSM_MM_NR, b, S, i, j, c, o, os, pf);
            for (; j < Sp; j += SSM_MMW) gdnc_o_tile(4, 1, b, S, i, j, c, o, os, pf);
        } else {
            for (; j + jw <= Sp; j += jw) gdnc_o_tile(1, SSM_MM_NR, b, S, i, j, c, o, os, pf);
            for (; j < Sp; j += SSM_MMW) gdnc_o_tile(1, 1, b, S, i, j, c, o, os, pf);
        }
        i += mr;
    }
}

/* The forward of one chunk of one head from H (the state before it), after gdnc_load_head (without D)
 * and gdnc_chunk_keys (with QK): the o rows into o (row stride os; Sp columns) from the v rows V (row
 * stride vs, Sp columns), then H becomes the state after the chunk; the cache hints pf in the products. */
static void gdnc_chunk_fwd_o(const gdn_params * p, const gdnc_buf * b, int64_t L, const real * V, int64_t vs,
                             real * o, int64_t os, ssm_pf * pf) {
    const int64_t S = p->S;
    const real c = (real) 1 / real_sqrt((real) S);
    gdnc_make_AP(b, L, c);
    gdnc_chunk_delta(p, b, L, V, vs, pf);
    gdnc_o_rows(b, S, L, c, o, os, pf);
    gdnc_chunk_state(p, b, L, pf);
    ssm_pf_finish(pf);   /* what the products' steps did not reach */
}

/* The forward's units: (sequence n, key head kh, batch) with the batch's value heads m0 <= m < m1 of kh
 * (gdn_group_head), at most GDNC_FWD_HEADS of them */
static int64_t gdnc_fwd_batches(const gdn_params * p) {
    return (gdn_group_size(p) + GDNC_FWD_HEADS - 1) / GDNC_FWD_HEADS;
}
static void gdnc_fwd_unit_of(const gdn_params * p, int64_t u, int64_t * n, int64_t * kh, int64_t * m0, int64_t * m1) {
    const int64_t nb = gdnc_fwd_batches(p), bt = u % nb;
    *n = u / nb / p->H_k;
    *kh = u / nb % p->H_k;
    *m0 = bt * GDNC_FWD_HEADS;
    *m1 = ssm_min64(*m0 + GDNC_FWD_HEADS, gdn_group_size(p));
}

/* Forward of one unit: the batch's heads chunk by chunk, each with its own state, sharing the chunk's
 * key part (gdnc_load_keys, gdnc_chunk_keys); every value is the one a head alone would get. */
static void gdnc_fwd_unit(const gdn_params * p, const gdnc_inputs * in, real * out, const gdnc_buf * b, int64_t u,
                          int64_t n_units) {
    const int64_t S = p->S, Sp = b->Sp, n_t = p->n_t;
    int64_t n, kh, m0, m1;
    gdnc_fwd_unit_of(p, u, &n, &kh, &m0, &m1);
    real * Hm[GDNC_FWD_HEADS];
    for (int64_t m = m0; m < m1; ++m) {
        Hm[m - m0] = m == m0 ? b->H : b->Hx + (m - m0 - 1) * Sp * Sp;
        gdnc_load_state(p, in->state, p->state_st, Hm[m - m0], Sp, n, gdn_group_head(p, kh, m));
    }
    for (int64_t t0 = 0; t0 < n_t; t0 += GDN_CHUNK) {
        const int64_t L = ssm_min64(GDN_CHUNK, n_t - t0), last = t0 + GDN_CHUNK >= n_t;
        gdnc_load_keys(p, in, b, n, kh, t0, L);
        gdnc_chunk_keys(p, b, L, 1);
        for (int64_t m = m0; m < m1; ++m) {
            const int64_t h = gdn_group_head(p, kh, m);
            gdnc_buf bm = *b;
            bm.H = Hm[m - m0];
            /* where the o and v rows are whole vectors (S == Sp) and contiguous: o straight into out, v read
             * where it is (no copies); else through Ob and Vc */
            const int direct = S == Sp && p->v_st[3] == 1;
            gdnc_load_head(p, in, &bm, n, h, t0, L, !direct, 0);
            /* hints: the next chunk's v rows of this head, and its k rows with the batch's first head, its q
             * rows with the second (both with the first if it is alone: each head asks for at most about
             * what its products' steps carry, ssm_pf_step); or at the last chunk those of the next unit's
             * first chunk (another thread's: harmless) */
            ssm_pf pf = { .cols = S, .write[GDNC_PF_ST_OUT] = 1 };
            const int keys = m == m0 ? (m1 - m0 > 1 ? 1 : 3) : m == m0 + 1 ? 2 : 0;
            if (!last)
                gdnc_pf_rows(&pf, p, in, n, h, t0 + GDN_CHUNK, ssm_min64(GDN_CHUNK, n_t - t0 - GDN_CHUNK), keys);
            else {
                pf.row0[GDNC_PF_ST_OUT] = out + p->n_seqs * n_t * p->H_v * S + (n * p->H_v + h) * S * S;
                pf.stride[GDNC_PF_ST_OUT] = pf.stride[GDNC_PF_ST_IN] = S;
                pf.rows[GDNC_PF_ST_OUT] = pf.rows[GDNC_PF_ST_IN] = S;
                int64_t n2, kh2, a0, a1;
                if (u + 1 < n_units) gdnc_fwd_unit_of(p, u + 1, &n2, &kh2, &a0, &a1);
                if (u + 1 < n_units && a0 + m - m0 < a1) {
                    const int64_t h2 = gdn_group_head(p, kh2, a0 + m - m0), * ss = p->state_st;
                    gdnc_pf_rows(&pf, p, in, n2, h2, 0, ssm_min64(GDN_CHUNK, n_t), keys);
                    if (ss[3] == 1 && ss[2] == S) pf.row0[GDNC_PF_ST_IN] = in->state + n2 * ss[0] + h2 * ss[1];
                }
            }
            real * o = out + ((n * n_t + t0) * p->H_v + h) * S;
            const int64_t os = p->H_v * S;
            if (direct) {
                const real * V = in->v + n * p->v_st[0] + t0 * p->v_st[1] + h * p->v_st[2];
                gdnc_chunk_fwd_o(p, &bm, L, V, p->v_st[1], o, os, &pf);
#ifdef SSMGRAD_MUTANTS
                for (int64_t t = 0; t < L; ++t)
                    for (int64_t j = 0; j < S; ++j) o[t * os + j] = SSM_MUTANT(SSM_MUT_GDN_CK_FWD, o[t * os + j]);
#endif
            } else {
                gdnc_chunk_fwd_o(p, &bm, L, b->Vc, Sp, b->Ob, Sp, &pf);
                for (int64_t t = 0; t < L; ++t)
                    for (int64_t j = 0; j < S; ++j) o[t * os + j] = SSM_MUTANT(SSM_MUT_GDN_CK_FWD, b->Ob[t * Sp + j]);
            }
        }
    }
    for (int64_t m = m0; m < m1; ++m)
        gdnc_store_state(Hm[m - m0], Sp,
                         out + p->n_seqs * n_t * p->H_v * S + (n * p->H_v + gdn_group_head(p, kh, m)) * S * S, S);
}

/* Forward: threads split the units (gdnc_fwd_unit_of). The scratch is zeroed first: the padding of
 * every matrix stays zero (no product ever writes it with anything else). */
static void gdnc_fwd(const gdn_params * p, const gdnc_inputs * in, real * out, void * work, int ith, int nth) {
    int64_t lo, hi;
    const int64_t n_units = p->n_seqs * p->H_k * gdnc_fwd_batches(p);
    ssm_split(n_units, ith, nth, &lo, &hi);
    if (lo >= hi) return;
    real * base = (real *) work + ith * gdnc_fwd_thread_elems(p);
    memset(base, 0, (size_t) gdnc_fwd_thread_elems(p) * sizeof(real));
    gdnc_buf b;
    gdnc_carve(p, base, 0, &b);
    for (int64_t u = lo; u < hi; ++u) gdnc_fwd_unit(p, in, out, &b, u, n_units);
}

/* ------------------------------------------------------------------ backward */


/*
 * The VJP of one chunk (the lines at the top of this file), given H0 = Hs[c], Y, Dl of the chunk (kept
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

/* term 1: P = QK (.) D, dP (kept as dD[t][s] D[t][s] of the o term), dQK, dDl = P^T dO; DlT = Dl^T */
static void gdnc_back_o(const gdn_params * p, const gdnc_buf * b, const real * Dl, int64_t L) {
    const int64_t S = p->S, Sp = b->Sp, C = GDN_CHUNK, Lp = gdn_pad(L);
    ssm_mm(&(ssm_mm_args) { .M = L, .J = Lp, .K = S, .X = b->Qc, .xi = Sp, .xk = 1, .Y = b->KT, .ys = C, .O = b->P,
                            .os = C, .shape = SSM_MM_OUT_LOWER });
    for (int64_t j = 0; j < S; ++j) {
        for (int64_t t = 0; t < L; ++t) b->DlT[j * C + t] = Dl[t * Sp + j];
        for (int64_t t = L; t < Lp; ++t) b->DlT[j * C + t] = 0;
    }
    ssm_mm(&(ssm_mm_args) { .M = L, .J = Lp, .K = S, .X = b->dO, .xi = Sp, .xk = 1, .Y = b->DlT, .ys = C, .O = b->dP,
                            .os = C, .shape = SSM_MM_OUT_LOWER });
    for (int64_t t = 0; t < L; ++t) {
        real * Pt = b->P + t * C, * dPt = b->dP + t * C, * dQKt = b->dQK + t * C;
        const real * Dt = b->D + t * C;
        for (int64_t s = 0; s <= t; ++s) {
            const real qk = Pt[s], dp = dPt[s];
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
        b->dDL[t] = gdnc_dot(b->KdH + t * Sp, Dl + t * Sp, S);
        for (int64_t j = 0; j < Sp; ++j) b->dDl[t * Sp + j] += b->DL[t] * b->KdH[t * Sp + j];
    }
    real dgamL = 0;
    for (int64_t i = 0; i < S; ++i) dgamL += gdnc_dot(H0 + i * Sp, b->dH + i * Sp, S);
    gdnc_transpose(b->dHT, Sp, b->dH, Sp, S, S);
    ssm_mm(&(ssm_mm_args) { .M = L, .J = Sp, .K = S, .X = Dl, .xi = Sp, .xk = 1, .Y = b->dHT, .ys = Sp, .O = b->dKc,
                            .os = Sp, .rs = b->DL });
    return dgamL;
}

/* term 3 (and term 1's gamma Q H0 part): dR, dV, dbeta, dgam, dQc, dKc; Gq = gamma dO, Gk = -gamma dV */
static void gdnc_back_solve(const gdn_params * p, const gdnc_buf * b, const real * H0, const real * Y, int64_t L) {
    const int64_t S = p->S, Sp = b->Sp, C = GDN_CHUNK;
    ssm_mm(&(ssm_mm_args) { .M = L, .J = Sp, .K = L, .X = b->T, .xi = 1, .xk = C, .Y = b->dDl, .ys = Sp, .O = b->dR,
                            .os = Sp, .shape = SSM_MM_UPPER });
    for (int64_t t = 0; t < L; ++t) {
        b->dbeta[t] = gdnc_dot(b->dR + t * Sp, Y + t * Sp, S);
        for (int64_t j = 0; j < Sp; ++j) {
            const real dv = b->beta[t] * b->dR[t * Sp + j];
            b->dV[t * Sp + j] = dv;
            b->Gq[t * Sp + j] = b->gam[t] * b->dO[t * Sp + j];
            b->Gk[t * Sp + j] = -b->gam[t] * dv;
        }
    }
    /* E = dO H0^T: dq_t = gamma_t E_t, dgamma_t = q_t . E_t; then E = dV H0^T: dk_t -= gamma_t E_t,
     * dgamma_t -= k_t . E_t */
    gdnc_transpose(b->HT, Sp, H0, Sp, S, S);
    ssm_mm(&(ssm_mm_args) { .M = L, .J = Sp, .K = S, .X = b->dO, .xi = Sp, .xk = 1, .Y = b->HT, .ys = Sp, .O = b->E,
                            .os = Sp });
    for (int64_t t = 0; t < L; ++t) {
        b->dgam[t] = gdnc_dot(b->Qc + t * Sp, b->E + t * Sp, S);
        for (int64_t i = 0; i < Sp; ++i) b->dQc[t * Sp + i] = b->gam[t] * b->E[t * Sp + i];
    }
    ssm_mm(&(ssm_mm_args) { .M = L, .J = Sp, .K = S, .X = b->dV, .xi = Sp, .xk = 1, .Y = b->HT, .ys = Sp, .O = b->E,
                            .os = Sp });
    for (int64_t t = 0; t < L; ++t) {
        b->dgam[t] -= gdnc_dot(b->Kc + t * Sp, b->E + t * Sp, S);
        for (int64_t i = 0; i < Sp; ++i) b->dKc[t * Sp + i] -= b->gam[t] * b->E[t * Sp + i];
    }
}

/* term 4: dA (kept in dA as dD[t][s] D[t][s] of both terms), dbeta, dKK; the dQK and dKK products */
static void gdnc_back_A(const gdn_params * p, const gdnc_buf * b, int64_t L) {
    const int64_t S = p->S, Sp = b->Sp, C = GDN_CHUNK, Lp = gdn_pad(L);
    ssm_mm(&(ssm_mm_args) { .M = L, .J = Lp, .K = S, .X = b->dR, .xi = Sp, .xk = 1, .Y = b->DlT, .ys = C, .O = b->dA,
                            .os = C, .shape = SSM_MM_OUT_LOWER });
    for (int64_t t = 0; t < L; ++t) {
        real * dAt = b->dA + t * C, * dKKt = b->dKK + t * C;
        const real * KKt = b->KK + t * C, * Dt = b->D + t * C, * dPt = b->dP + t * C;
        real db = 0;
        for (int64_t s = 0; s < t; ++s) {
            const real a = -dAt[s];
            db += a * KKt[s] * Dt[s];
            dKKt[s] = a * b->beta[t] * Dt[s];
            dAt[s] = dPt[s] + a * b->beta[t] * KKt[s] * Dt[s];
        }
        for (int64_t s = t; s < Lp; ++s) dKKt[s] = 0;
        b->dbeta[t] += db;
    }
    ssm_mm(&(ssm_mm_args) { .M = L, .J = Sp, .K = L, .X = b->dQK, .xi = C, .xk = 1, .Y = b->Kc, .ys = Sp, .O = b->dQc,
                            .os = Sp, .acc = 1, .shape = SSM_MM_LOWER });
    ssm_mm(&(ssm_mm_args) { .M = L, .J = Sp, .K = L, .X = b->dQK, .xi = 1, .xk = C, .Y = b->Qc, .ys = Sp, .O = b->dKc,
                            .os = Sp, .acc = 1, .shape = SSM_MM_UPPER });
    ssm_mm(&(ssm_mm_args) { .M = L, .J = Sp, .K = L, .X = b->dKK, .xi = C, .xk = 1, .Y = b->Kc, .ys = Sp, .O = b->dKc,
                            .os = Sp, .acc = 1, .shape = SSM_MM_LOWER });
    ssm_mm(&(ssm_mm_args) { .M = L, .J = Sp, .K = L, .X = b->dKK, .xi = 1, .xk = C, .Y = b->Kc, .ys = Sp, .O = b->dKc,
                            .os = Sp, .acc = 1, .shape = SSM_MM_UPPER });
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

static void gdnc_chunk_back(const gdn_params * p, const gdnc_buf * b, const real * H0, const real * Y,
                            const real * Dl, int64_t L) {
    gdnc_make_T(p, b, L);
    gdnc_back_o(p, b, Dl, L);
    const real dgamL = gdnc_back_state(p, b, H0, Dl, L);
    gdnc_back_solve(p, b, H0, Y, L);
    gdnc_back_A(p, b, L);
    gdnc_back_decay(p, b, dgamL, L);
}

/* Backward of one (sequence n, value head h): the chunks forward keeping H0, Y, Dl of each, then in
 * reverse; d_q, d_k add to the key group's rows (zeroed by gdn_back_groups). */
static void gdnc_back_unit(const gdn_params * p, const gdnc_inputs * in, const real * grad, const gdn_grads * gr,
                           const gdnc_buf * b, int64_t n, int64_t h) {
    const int64_t S = p->S, Sp = b->Sp, C = GDN_CHUNK, n_t = p->n_t, SS = Sp * Sp, CS = C * Sp;
    const int64_t n_ch = gdnc_n_chunks(p), nk = gdn_key_seq(p, n), kh = gdn_key_head(p, h);
    const real c = (real) 1 / real_sqrt((real) S);
    gdnc_load_state(p, in->state, p->state_st, b->H, Sp, n, h);
    for (int64_t ch = 0; ch < n_ch; ++ch) {
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
            const real * go = grad + ((n * n_t + t0 + t) * p->H_v + h) * S;
            for (int64_t j = 0; j < S; ++j) b->dO[t * Sp + j] = c * go[j];
        }
        gdnc_chunk_back(p, b, b->Hs + ch * SS, b->Ys + ch * CS, b->Dls + ch * CS, L);
#ifdef SSMGRAD_MUTANTS
        for (int64_t e = 0; e < SS; ++e) b->dH[e] = SSM_MUTANT(SSM_MUT_GDN_CK_DSTATE, b->dH[e]);   /* carried */
#endif
        real acc = 0;   /* d g_t: the sum of dG_u over u >= t of the chunk (G restarts at every chunk) */
        for (int64_t t = L - 1; t >= 0; --t) {
            const int64_t tt = t0 + t, nv = (n * n_t + tt) * p->H_v + h, nq = (nk * n_t + tt) * p->H_k + kh;
            acc += b->dGt[t];
            gr->dg[nv] = SSM_MUTANT(SSM_MUT_GDN_CK_DG, acc);
            gr->dbeta[nv] = SSM_MUTANT(SSM_MUT_GDN_CK_DBETA, b->dbeta[t]);
            real * dq = gr->dq + nq * S, * dk = gr->dk + nq * S, * dv = gr->dv + nv * S;
            for (int64_t i = 0; i < S; ++i) {
                dq[i] += SSM_MUTANT(SSM_MUT_GDN_CK_DQ, b->dQc[t * Sp + i]);
                dk[i] += SSM_MUTANT(SSM_MUT_GDN_CK_DK, b->dKc[t * Sp + i]);
                dv[i] = SSM_MUTANT(SSM_MUT_GDN_CK_DV, b->dV[t * Sp + i]);
            }
        }
    }
    gdnc_store_state(b->dH, Sp, gr->dstate + (n * p->H_v + h) * S * S, S);
}

/* gdnc_back_unit as gdn_back_groups calls it */
static void gdnc_back_unit_of(const gdn_back_args * a, int64_t n, int64_t h) {
    gdnc_back_unit(a->p, a->in, a->grad, a->gr, a->b, n, h);
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
    gdn_back_groups(p, in, grad, gin, &b, lo, hi, gdnc_back_unit_of);
}
