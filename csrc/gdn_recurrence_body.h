/*
 * gdn_recurrence_body.h -- GATED_DELTA_NET forward as a token recurrence, written once for the element
 * type `real` (ssm_real_f32.h / ssm_real_f64.h): gdn_fwd, row by row (gdn_fwd_unit) or at levels 4 and 3
 * in 64- and 32-byte vectors (gdn_fwd_unit_v, gdn_vec.h). The backward is gdn_back_recurrence_body.h; what the two share,
 * gdn_step.h (the token step and its math) and gdn_vec.h (the vector primitives). Included only by the
 * instantiation files csrc/inst/gdn_<type>_v<N>.c (before gdn_back_recurrence_body.h), which define the
 * exported wrappers; every function here is static with its plain name.
 */
#ifndef SSM_REAL_H
#error "include ssm_real_f32.h or ssm_real_f64.h before gdn_recurrence_body.h"
#endif

#include <string.h>

#include "ssm_common.h"
#include "gdn_common.h"
#include "gdn_step.h"
#include "gdn_vec.h"

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

#if SSM_LEVEL >= 3
/* ------------------------------------------------------------ the forward in 64- or 32-byte vectors
 *
 * The same operations in the same order as gdn_fwd_unit (so the same bits), arranged for the
 * registers and the L1 cache: a block of GDN_BLOCK_BYTES of state rows stays in L1 across every
 * token; per token, k and q stay in registers, and the rows go by groups of GDN_LANES in two
 * passes. Pass 1 decays each row (stored back) and runs its k dot product's running sums; the
 * group's sums are then reduced together, one row per lane (gdn_vsum_rows), giving the group's
 * deltas as one vector. Pass 2 adds delta_j k to each row (stored) and runs its q dot product,
 * reduced the same way into the group's outputs. Every row of a group is an independent chain,
 * so the core overlaps them; reducing a whole group at once costs about a fifth of reducing row
 * by row. gdn_dot's REAL_DOT_LANES running sums are REAL_DOT_LANES / GDN_LANES vector
 * accumulators, and its reduction tree the merges of gdn_vsum_rows (gdn_vec.h). */
#define GDN_BLOCK_BYTES 16384                    /* state rows kept in L1 across the tokens */

/* One token on the rows [j, j + GDN_LANES) of M (row stride S), read from src (row stride src_st:
 * M itself, or the start state at the first token): the two passes above. */
SSM_INLINE void gdn_fwd_group_v(real * M, const real * src, int64_t src_st, int64_t S, const gdn_vec * k,
                                const gdn_vec * q, const gdn_vec * a, const real * v, real beta, real scale, real * o,
                                const int NV) {
    gdn_vec s[GDN_LANES];
    for (int r = 0; r < GDN_LANES; ++r) {
        gdn_vec m[GDN_NV_MAX];
        for (int c = 0; c < NV; ++c) {
            m[c] = gdn_vload(src + r * src_st + c * GDN_LANES) * a[c];
            gdn_vstore(M + r * S + c * GDN_LANES, m[c]);
        }
        s[r] = gdn_vdot_acc(m, k, NV);
    }
    real d[GDN_LANES];
    gdn_vstore(d, (gdn_vload(v) - gdn_vsum_rows(s)) * beta);
    for (int r = 0; r < GDN_LANES; ++r) {
        gdn_vec m[GDN_NV_MAX];
        for (int c = 0; c < NV; ++c) {
            m[c] = k[c] * d[r] + gdn_vload(M + r * S + c * GDN_LANES);
            gdn_vstore(M + r * S + c * GDN_LANES, m[c]);
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
    for (int c = 0; c < NV; ++c) m[c] = gdn_vload(src + c * GDN_LANES) * a[c];
    const real d = (vj - gdn_vsum(gdn_vdot_acc(m, k, NV))) * beta;
    for (int c = 0; c < NV; ++c) {
        m[c] = k[c] * d + m[c];
        gdn_vstore(row + c * GDN_LANES, m[c]);
    }
    *oj = SSM_MUTANT(SSM_MUT_GDN_VEC_FWD, gdn_vsum(gdn_vdot_acc(m, q, NV)) * scale);
}

/* Rows [j0, j1) of M through tokens [0, n_t) of (n, h), NV = S / GDN_LANES vectors per row; the first
 * token reads the rows from M0 (row stride m0_st: the start state itself, or M holding its copy). */
SSM_INLINE void gdn_fwd_block_v(const gdn_params * p, const gdn_inputs * in, real * out, real * vec, int64_t n,
                                int64_t h, real * M, const real * M0, int64_t m0_st, int64_t j0, int64_t j1,
                                const int NV) {
    const int64_t S = NV * GDN_LANES, SS = S * S, n_t = p->n_t, K = p->K;
    const int64_t slot_elems = p->n_seqs * p->H_v * SS;
    real * slots = out + p->n_seqs * n_t * p->H_v * S;
    const real scale = (real) 1 / real_sqrt((real) S);
    for (int64_t t = 0; t < n_t; ++t) {
        gdn_token tk;
        gdn_token_load(p, in, vec, n, h, t, &tk);
        gdn_vec k[GDN_NV_MAX], q[GDN_NV_MAX], a[GDN_NV_MAX];
        for (int c = 0; c < NV; ++c) {
            k[c] = gdn_vload(tk.k + c * GDN_LANES);
            q[c] = gdn_vload(tk.q + c * GDN_LANES);
            a[c] = tk.a ? gdn_vload(tk.a + c * GDN_LANES) : (gdn_vec) {0} + tk.a0;
        }
        real * o = out + ((n * n_t + t) * p->H_v + h) * S;
        int64_t j = j0;
        const real * src = t == 0 ? M0 : M;
        const int64_t src_st = t == 0 ? m0_st : S;
        for (; j + GDN_LANES <= j1; j += GDN_LANES)
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
    const int64_t S = NV * GDN_LANES;
    const real scale = (real) 1 / real_sqrt((real) S);
    gdn_token tk;
    gdn_token_load(p, in, vec, n, h, 0, &tk);
    gdn_vec k[GDN_NV_MAX], q[GDN_NV_MAX], a[GDN_NV_MAX];
    for (int c = 0; c < NV; ++c) {
        k[c] = gdn_vload(tk.k + c * GDN_LANES);
        q[c] = gdn_vload(tk.q + c * GDN_LANES);
        a[c] = tk.a ? gdn_vload(tk.a + c * GDN_LANES) : (gdn_vec) {0} + tk.a0;
    }
    real * o = out + (n * p->H_v + h) * S;
    for (int64_t j = 0; j < S; ++j) {
        gdn_vec m[GDN_NV_MAX];
        for (int c = 0; c < NV; ++c) m[c] = gdn_vload(M0 + j * m0_st + c * GDN_LANES) * a[c];
        const real d = SSM_MUTANT(SSM_MUT_GDN_VEC_DECODE, (tk.v[j] - gdn_vsum(gdn_vdot_acc(m, k, NV))) * tk.beta);
        for (int c = 0; c < NV; ++c) {
            m[c] = k[c] * d + m[c];
            gdn_vstore(M + j * S + c * GDN_LANES, m[c]);
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
        switch (S / GDN_LANES) {
#if GDN_NACC == 1
        case 1: gdn_fwd_decode_v(p, in, out, vec, n, h, M, M0, m0_st, 1); return;
#endif
#if GDN_NACC <= 2
        case 2: gdn_fwd_decode_v(p, in, out, vec, n, h, M, M0, m0_st, 2); return;
#endif
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
        switch (S / GDN_LANES) {
#if GDN_NACC == 1
        case 1: gdn_fwd_block_v(p, in, out, vec, n, h, M, M0, m0_st, j0, j1, 1); break;
#endif
#if GDN_NACC <= 2
        case 2: gdn_fwd_block_v(p, in, out, vec, n, h, M, M0, m0_st, j0, j1, 2); break;
#endif
        case 4: gdn_fwd_block_v(p, in, out, vec, n, h, M, M0, m0_st, j0, j1, 4); break;
        case 8: gdn_fwd_block_v(p, in, out, vec, n, h, M, M0, m0_st, j0, j1, 8); break;
        case 16: gdn_fwd_block_v(p, in, out, vec, n, h, M, M0, m0_st, j0, j1, 16); break;
        default: break;   /* not reached (gdn_fwd_vec_ok) */
        }
    }
}
#endif

/* Forward: threads split the (sequence, value head) pairs. */
static void gdn_fwd(const gdn_params * p, const gdn_inputs * in, real * out, void * work, int ith, int nth) {
    int64_t lo, hi;
    ssm_split(p->n_seqs * p->H_v, ith, nth, &lo, &hi);
    real * vec = (real *) work + ith * gdn_fwd_thread_elems(p, SSM_LEVEL);
#if SSM_LEVEL >= 3
    if (gdn_fwd_vec_ok(p)) {
        for (int64_t u = lo; u < hi; ++u) gdn_fwd_unit_v(p, in, out, vec, u / p->H_v, u % p->H_v);
        return;
    }
#endif
    for (int64_t u = lo; u < hi; ++u) gdn_fwd_unit(p, in, out, vec, u / p->H_v, u % p->H_v);
}
