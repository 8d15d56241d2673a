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
#include "gdn_grads.h"

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

#if SSM_LEVEL >= 4
/* ------------------------------------------------------------------ the forward in 64-byte vectors
 *
 * The same operations in the same order as gdn_fwd_unit (so the same bits), arranged for the
 * registers and the L1 cache: a block of GDN_BLOCK_BYTES of state rows stays in L1 across every
 * token; per token, k and q stay in registers, and the rows go by groups of REAL_LANES in two
 * passes. Pass 1 decays each row (stored back) and runs its k dot product's running sums; the
 * group's sums are then reduced together, one row per lane (gdn_vsum_rows), giving the group's
 * deltas as one vector. Pass 2 adds delta_j k to each row (stored) and runs its q dot product,
 * reduced the same way into the group's outputs. Every row of a group is an independent chain,
 * so the core overlaps them; reducing a whole group at once costs about a fifth of reducing row
 * by row. gdn_dot's REAL_DOT_LANES running sums are REAL_DOT_LANES / REAL_LANES vector
 * accumulators, and its reduction tree the merges below. */
typedef real gdn_vec __attribute__((vector_size(64)));
typedef real gdn_vec_h __attribute__((vector_size(32)));
#if REAL_LANES == 16
typedef real gdn_vec_q __attribute__((vector_size(16)));
#endif
#define GDN_NACC (REAL_DOT_LANES / REAL_LANES)   /* vector accumulators of a dot product */
#define GDN_BLOCK_BYTES 16384                    /* state rows kept in L1 across the tokens */
#define GDN_NV_MAX 16                            /* vectors per row the vector forms take */

SSM_INLINE gdn_vec gdn_vload(const real * x) {
    gdn_vec v;
    memcpy(&v, x, sizeof v);
    return v;
}

SSM_INLINE void gdn_vstore(real * x, gdn_vec v) { memcpy(x, &v, sizeof v); }

/* Lane shuffles. GDN_SHUF(x, y, i0, i1, ...): lanes of x then y picked by constant indices, as many as
 * the vectors have. GDN_LO / GDN_HI: the low / high half of a vector (GDN_LO_Q / GDN_HI_Q of a half).
 * clang and GCC 12+ have __builtin_shufflevector; GCC 11 only __builtin_shuffle, whose mask is a
 * vector of the same lane count and width (so halves are taken by memcpy, which it compiles to the
 * same lane extracts). Either way the same lanes are added in the same order: the same bits. */
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define GDN_SHUF(x, y, ...) __builtin_shufflevector(x, y, __VA_ARGS__)
#if REAL_LANES == 16
#define GDN_LO(s) __builtin_shufflevector(s, s, 0, 1, 2, 3, 4, 5, 6, 7)
#define GDN_HI(s) __builtin_shufflevector(s, s, 8, 9, 10, 11, 12, 13, 14, 15)
#define GDN_LO_Q(h) __builtin_shufflevector(h, h, 0, 1, 2, 3)
#define GDN_HI_Q(h) __builtin_shufflevector(h, h, 4, 5, 6, 7)
#else
#define GDN_LO(s) __builtin_shufflevector(s, s, 0, 1, 2, 3)
#define GDN_HI(s) __builtin_shufflevector(s, s, 4, 5, 6, 7)
#endif
#else
#if REAL_LANES == 16
typedef int32_t gdn_mask __attribute__((vector_size(64)));
#else
typedef int64_t gdn_mask __attribute__((vector_size(64)));
#endif
#define GDN_SHUF(x, y, ...) __builtin_shuffle(x, y, (gdn_mask) { __VA_ARGS__ })
SSM_INLINE gdn_vec_h gdn_half(gdn_vec s, int hi) {
    gdn_vec_h h;
    memcpy(&h, (const char *) &s + hi * sizeof h, sizeof h);
    return h;
}
#define GDN_LO(s) gdn_half(s, 0)
#define GDN_HI(s) gdn_half(s, 1)
#if REAL_LANES == 16
SSM_INLINE gdn_vec_q gdn_quarter(gdn_vec_h h, int hi) {
    gdn_vec_q q;
    memcpy(&q, (const char *) &h + hi * sizeof q, sizeof q);
    return q;
}
#define GDN_LO_Q(h) gdn_quarter(h, 0)
#define GDN_HI_Q(h) gdn_quarter(h, 1)
#endif
#endif

/* the sum of s's lanes in gdn_dot's tree: halvings down to 4 lanes, then (0 + 1) + (2 + 3) */
SSM_INLINE real gdn_vsum(gdn_vec s) {
#if REAL_LANES == 16
    const gdn_vec_h h = GDN_LO(s) + GDN_HI(s);
    const gdn_vec_q f = GDN_LO_Q(h) + GDN_HI_Q(h);
#else
    const gdn_vec_h f = GDN_LO(s) + GDN_HI(s);
#endif
    return (f[0] + f[1]) + (f[2] + f[3]);
}

/* One merge of gdn_vsum_rows: x and y each hold REAL_LANES / W groups of W lanes (a group: the partial
 * sums of one row); the result holds x's groups then y's, each of W / 2 lanes, lane e of a group the
 * sum of lanes e and e + W / 2 (ADJ 0: a halving) or 2e and 2e + 1 (ADJ 1: a pairwise add) of it.
 * GDN_MI is the index of the first (SEC 0) or second (SEC 1) addend of result lane POS. */
#define GDN_MI(POS, W, ADJ, SEC)                                                                       \
    (((POS) / ((W) / 2) < REAL_LANES / (W) ? ((POS) / ((W) / 2)) * (W)                                 \
                                           : REAL_LANES + ((POS) / ((W) / 2) - REAL_LANES / (W)) * (W)) + \
     ((ADJ) ? 2 * ((POS) % ((W) / 2)) + (SEC) : (POS) % ((W) / 2) + (SEC) * ((W) / 2)))
#if REAL_LANES == 16
#define GDN_MIDX(W, ADJ, SEC)                                                                          \
    GDN_MI(0, W, ADJ, SEC), GDN_MI(1, W, ADJ, SEC), GDN_MI(2, W, ADJ, SEC), GDN_MI(3, W, ADJ, SEC),     \
    GDN_MI(4, W, ADJ, SEC), GDN_MI(5, W, ADJ, SEC), GDN_MI(6, W, ADJ, SEC), GDN_MI(7, W, ADJ, SEC),     \
    GDN_MI(8, W, ADJ, SEC), GDN_MI(9, W, ADJ, SEC), GDN_MI(10, W, ADJ, SEC), GDN_MI(11, W, ADJ, SEC),   \
    GDN_MI(12, W, ADJ, SEC), GDN_MI(13, W, ADJ, SEC), GDN_MI(14, W, ADJ, SEC), GDN_MI(15, W, ADJ, SEC)
#else
#define GDN_MIDX(W, ADJ, SEC)                                                                          \
    GDN_MI(0, W, ADJ, SEC), GDN_MI(1, W, ADJ, SEC), GDN_MI(2, W, ADJ, SEC), GDN_MI(3, W, ADJ, SEC),     \
    GDN_MI(4, W, ADJ, SEC), GDN_MI(5, W, ADJ, SEC), GDN_MI(6, W, ADJ, SEC), GDN_MI(7, W, ADJ, SEC)
#endif
#define GDN_MERGE(x, y, W, ADJ) (GDN_SHUF(x, y, GDN_MIDX(W, ADJ, 0)) + GDN_SHUF(x, y, GDN_MIDX(W, ADJ, 1)))

/* Lane r of the result: gdn_vsum(s[r]), the same bits, for REAL_LANES rows at once (each addition of
 * gdn_vsum's tree is one lane of one merge). */
SSM_INLINE gdn_vec gdn_vsum_rows(const gdn_vec * s) {
    gdn_vec u[REAL_LANES / 2], x[REAL_LANES / 4];
    for (int r = 0; r < REAL_LANES / 2; ++r) u[r] = GDN_MERGE(s[2 * r], s[2 * r + 1], REAL_LANES, 0);
#if REAL_LANES == 16
    for (int r = 0; r < 4; ++r) x[r] = GDN_MERGE(u[2 * r], u[2 * r + 1], 8, 0);
#else
    for (int r = 0; r < 2; ++r) x[r] = u[r];
#endif
    const gdn_vec y0 = GDN_MERGE(x[0], x[1], 4, 1);
#if REAL_LANES == 16
    const gdn_vec y1 = GDN_MERGE(x[2], x[3], 4, 1);
    return GDN_MERGE(y0, y1, 2, 1);
#else
    /* 8 lanes: u[r] holds rows 2r, 2r + 1 (4 lanes each), x the four u: pair them as above */
    const gdn_vec z0 = GDN_MERGE(u[0], u[1], 4, 1), z1 = GDN_MERGE(u[2], u[3], 4, 1);
    (void) y0;
    return GDN_MERGE(z0, z1, 2, 1);
#endif
}

/* the running sums of x . y over NV vectors in gdn_dot's order (NV a multiple of GDN_NACC), added
 * into one vector: the first step of gdn_dot's tree (the rest: gdn_vsum, gdn_vsum_rows) */
SSM_INLINE gdn_vec gdn_vdot_acc(const gdn_vec * x, const gdn_vec * y, const int NV) {
    gdn_vec acc[GDN_NACC];
    for (int a = 0; a < GDN_NACC; ++a) acc[a] = x[a] * y[a] + (gdn_vec) {0};
    for (int b = GDN_NACC; b < NV; b += GDN_NACC)
        for (int a = 0; a < GDN_NACC; ++a) acc[a] = x[b + a] * y[b + a] + acc[a];
#if GDN_NACC == 2
    return acc[0] + acc[1];
#else
    return acc[0];
#endif
}

/* One token on the rows [j, j + REAL_LANES) of M (row stride S), read from src (row stride src_st:
 * M itself, or the start state at the first token): the two passes above. */
SSM_INLINE void gdn_fwd_group_v(real * M, const real * src, int64_t src_st, int64_t S, const gdn_vec * k,
                                const gdn_vec * q, const gdn_vec * a, const real * v, real beta, real scale, real * o,
                                const int NV) {
    gdn_vec s[REAL_LANES];
    for (int r = 0; r < REAL_LANES; ++r) {
        gdn_vec m[GDN_NV_MAX];
        for (int c = 0; c < NV; ++c) {
            m[c] = gdn_vload(src + r * src_st + c * REAL_LANES) * a[c];
            gdn_vstore(M + r * S + c * REAL_LANES, m[c]);
        }
        s[r] = gdn_vdot_acc(m, k, NV);
    }
    real d[REAL_LANES];
    gdn_vstore(d, (gdn_vload(v) - gdn_vsum_rows(s)) * beta);
    for (int r = 0; r < REAL_LANES; ++r) {
        gdn_vec m[GDN_NV_MAX];
        for (int c = 0; c < NV; ++c) {
            m[c] = k[c] * d[r] + gdn_vload(M + r * S + c * REAL_LANES);
            gdn_vstore(M + r * S + c * REAL_LANES, m[c]);
        }
        s[r] = gdn_vdot_acc(m, q, NV);
    }
    gdn_vstore(o, SSM_MUTANT(SSM_MUT_GDN_VEC_FWD, gdn_vsum_rows(s) * scale));
}

/* One token on row j alone (the rows past the last whole group), read from src (row itself or the start
 * state's row). */
SSM_INLINE void gdn_fwd_row_v(real * row, const real * src, const gdn_vec * k, const gdn_vec * q, const gdn_vec * a,
                              real vj, real beta, real scale, real * oj, const int NV) {
    gdn_vec m[GDN_NV_MAX];
    for (int c = 0; c < NV; ++c) m[c] = gdn_vload(src + c * REAL_LANES) * a[c];
    const real d = (vj - gdn_vsum(gdn_vdot_acc(m, k, NV))) * beta;
    for (int c = 0; c < NV; ++c) {
        m[c] = k[c] * d + m[c];
        gdn_vstore(row + c * REAL_LANES, m[c]);
    }
    *oj = SSM_MUTANT(SSM_MUT_GDN_VEC_FWD, gdn_vsum(gdn_vdot_acc(m, q, NV)) * scale);
}

/* Rows [j0, j1) of M through tokens [0, n_t) of (n, h), NV = S / REAL_LANES vectors per row; the first
 * token reads the rows from M0 (row stride m0_st: the start state itself, or M holding its copy). */
SSM_INLINE void gdn_fwd_block_v(const gdn_params * p, const gdn_inputs * in, real * out, real * vec, int64_t n,
                                int64_t h, real * M, const real * M0, int64_t m0_st, int64_t j0, int64_t j1,
                                const int NV) {
    const int64_t S = NV * REAL_LANES, SS = S * S, n_t = p->n_t, K = p->K;
    const int64_t slot_elems = p->n_seqs * p->H_v * SS;
    real * slots = out + p->n_seqs * n_t * p->H_v * S;
    const real scale = (real) 1 / real_sqrt((real) S);
    for (int64_t t = 0; t < n_t; ++t) {
        gdn_token tk;
        gdn_token_load(p, in, vec, n, h, t, &tk);
        gdn_vec k[GDN_NV_MAX], q[GDN_NV_MAX], a[GDN_NV_MAX];
        for (int c = 0; c < NV; ++c) {
            k[c] = gdn_vload(tk.k + c * REAL_LANES);
            q[c] = gdn_vload(tk.q + c * REAL_LANES);
            a[c] = tk.a ? gdn_vload(tk.a + c * REAL_LANES) : (gdn_vec) {0} + tk.a0;
        }
        real * o = out + ((n * n_t + t) * p->H_v + h) * S;
        int64_t j = j0;
        const real * src = t == 0 ? M0 : M;
        const int64_t src_st = t == 0 ? m0_st : S;
        for (; j + REAL_LANES <= j1; j += REAL_LANES)
            gdn_fwd_group_v(M + j * S, src + j * src_st, src_st, S, k, q, a, tk.v + j, tk.beta, scale, o + j, NV);
        for (; j < j1; ++j) gdn_fwd_row_v(M + j * S, src + j * src_st, k, q, a, tk.v[j], tk.beta, scale, o + j, NV);
        const int64_t slot = n_t - 1 - t;   /* slot 0 is M itself */
        if (slot >= 1 && slot < K)
            memcpy(slots + slot * slot_elems + (n * p->H_v + h) * SS + j0 * S, M + j0 * S, (j1 - j0) * S * sizeof(real));
    }
}

/* One token (decode, n_t == 1) of (n, h): each row in one pass, the start state's row (M0, row stride
 * m0_st) into registers, then decay, k dot product, delta, update stored to M (out's slot 0), q dot
 * product, the row's own two reductions (gdn_vsum). The same operations in the same order as the
 * groups (the same bits), but no row is stored and read back between the two halves: with nothing to
 * keep in L1 across tokens, the groups' extra store and reload cost more than their shared
 * reductions save. Measured (the kernel alone from a C driver, one thread, float32, H_v 32, S 128,
 * medians of CPU time against a memcpy of the state in the same loop): the groups reading the start
 * state in place 1.5-1.6x the memcpy, rows one by one 1.1-1.2x (before: the state copied into the
 * slot first, then the groups, 2.2-2.4x). */
SSM_INLINE void gdn_fwd_decode_v(const gdn_params * p, const gdn_inputs * in, real * out, real * vec, int64_t n,
                                 int64_t h, real * M, const real * M0, int64_t m0_st, const int NV) {
    const int64_t S = NV * REAL_LANES;
    const real scale = (real) 1 / real_sqrt((real) S);
    gdn_token tk;
    gdn_token_load(p, in, vec, n, h, 0, &tk);
    gdn_vec k[GDN_NV_MAX], q[GDN_NV_MAX], a[GDN_NV_MAX];
    for (int c = 0; c < NV; ++c) {
        k[c] = gdn_vload(tk.k + c * REAL_LANES);
        q[c] = gdn_vload(tk.q + c * REAL_LANES);
        a[c] = tk.a ? gdn_vload(tk.a + c * REAL_LANES) : (gdn_vec) {0} + tk.a0;
    }
    real * o = out + (n * p->H_v + h) * S;
    for (int64_t j = 0; j < S; ++j) {
        gdn_vec m[GDN_NV_MAX];
        for (int c = 0; c < NV; ++c) m[c] = gdn_vload(M0 + j * m0_st + c * REAL_LANES) * a[c];
        const real d = SSM_MUTANT(SSM_MUT_GDN_VEC_DECODE, (tk.v[j] - gdn_vsum(gdn_vdot_acc(m, k, NV))) * tk.beta);
        for (int c = 0; c < NV; ++c) {
            m[c] = k[c] * d + m[c];
            gdn_vstore(M + j * S + c * REAL_LANES, m[c]);
        }
        o[j] = gdn_vsum(gdn_vdot_acc(m, q, NV)) * scale;
    }
}

/* gdn_fwd_unit in vectors, for S a multiple of REAL_DOT_LANES with n_t >= 1 */
static void gdn_fwd_unit_v(const gdn_params * p, const gdn_inputs * in, real * out, real * vec, int64_t n,
                           int64_t h) {
    const int64_t S = p->S, SS = S * S, sv = gdn_pad(S);
    real * M = out + p->n_seqs * p->n_t * p->H_v * S + (n * p->H_v + h) * SS;
    real * rowbuf = vec + (GDN_FWD_VECS - 1) * sv;
    /* the first token reads the start state where its rows are dense, else a copy of it in M */
    const int64_t * st = p->state_st;
    const real * M0 = M;
    int64_t m0_st = S;
    if (st[3] == 1) {
        M0 = in->state + n * st[0] + h * st[1];
        m0_st = st[2];
    } else {
        for (int64_t j = 0; j < S; ++j) memcpy(M + j * S, gdn_state_row(p, in, rowbuf, n, h, j), S * sizeof(real));
    }
    if (p->n_t == 1) {
        switch (S / REAL_LANES) {
#if GDN_NACC == 1
        case 1: gdn_fwd_decode_v(p, in, out, vec, n, h, M, M0, m0_st, 1); return;
#endif
        case 2: gdn_fwd_decode_v(p, in, out, vec, n, h, M, M0, m0_st, 2); return;
        case 4: gdn_fwd_decode_v(p, in, out, vec, n, h, M, M0, m0_st, 4); return;
        case 8: gdn_fwd_decode_v(p, in, out, vec, n, h, M, M0, m0_st, 8); return;
        case 16: gdn_fwd_decode_v(p, in, out, vec, n, h, M, M0, m0_st, 16); return;
        default: return;   /* not reached (gdn_fwd_vec_ok) */
        }
    }
    /* KDA: exp(g) of every token once, not once per block of rows */
    const gdn_inputs ig = p->g_per_channel ? gdn_with_gates(p, in, vec + GDN_FWD_VECS * sv, n, h) : *in;
    in = &ig;
    const int64_t jb = ssm_max64(1, GDN_BLOCK_BYTES / (S * (int64_t) sizeof(real)));
    for (int64_t j0 = 0; j0 < S; j0 += jb) {
        const int64_t j1 = ssm_min64(j0 + jb, S);
        switch (S / REAL_LANES) {
#if GDN_NACC == 1
        case 1: gdn_fwd_block_v(p, in, out, vec, n, h, M, M0, m0_st, j0, j1, 1); break;
#endif
        case 2: gdn_fwd_block_v(p, in, out, vec, n, h, M, M0, m0_st, j0, j1, 2); break;
        case 4: gdn_fwd_block_v(p, in, out, vec, n, h, M, M0, m0_st, j0, j1, 4); break;
        case 8: gdn_fwd_block_v(p, in, out, vec, n, h, M, M0, m0_st, j0, j1, 8); break;
        case 16: gdn_fwd_block_v(p, in, out, vec, n, h, M, M0, m0_st, j0, j1, 16); break;
        default: break;   /* not reached (gdn_fwd_vec_ok) */
        }
    }
}

/* whether gdn_fwd_unit_v runs this call */
static inline int gdn_fwd_vec_ok(const gdn_params * p) {
    return ssm_vec64(p->simd) && p->S > 0 && p->S % REAL_DOT_LANES == 0 && p->S <= GDN_NV_MAX * REAL_LANES &&
           (p->S / REAL_LANES & (p->S / REAL_LANES - 1)) == 0 && p->n_t > 0;
}
#endif

/* Forward: threads split the (sequence, value head) pairs. */
static void gdn_fwd(const gdn_params * p, const gdn_inputs * in, real * out, void * work, int ith, int nth) {
    int64_t lo, hi;
    ssm_split(p->n_seqs * p->H_v, ith, nth, &lo, &hi);
    real * vec = (real *) work + ith * gdn_fwd_thread_elems(p, SSM_LEVEL);
#if SSM_LEVEL >= 4
    if (gdn_fwd_vec_ok(p)) {
        for (int64_t u = lo; u < hi; ++u) gdn_fwd_unit_v(p, in, out, vec, u / p->H_v, u % p->H_v);
        return;
    }
#endif
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
    gdn_back_groups(p, in, grad, gin, &b, lo, hi, gdn_back_unit_of);
}
