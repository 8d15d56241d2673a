/*
 * gdn_chunked_body.h -- GATED_DELTA_NET forward in the chunked (WY / UT-transform) form, written once
 * for the element type `real` (ssm_real_f32.h / ssm_real_f64.h): gdnc_fwd, up to GDNC_FWD_HEADS value
 * heads of one key head chunk by chunk (gdnc_fwd_unit), each chunk's o rows and state by
 * gdnc_chunk_fwd_o. The six lines it evaluates, and what it shares with the backward
 * (gdn_back_chunked_body.h): gdn_chunk.h. Included only by the instantiation files
 * csrc/inst/gdn_chunked_<type>_v<N>.c (before gdn_back_chunked_body.h); every function here is static
 * with its plain name. Which calls take it: gdn_uses_chunked (gdn_common.h): the scalar gate, K == 1,
 * n_t >= 1. Where asked (kept, gdn_fwd_keep_*), each head's state before every chunk, the chunk's Y and
 * Dl rows, its K K^T, Q K^T and T are written out for the backward: they are its pass over the chunks'
 * (gdnc_chunk_fwd) and its reverse pass's (gdnc_make_T, gdnc_back_o) element for element (the same
 * functions on the same values: A's decays here are gdnc_load_head's D, the value rows the same whether
 * read in place or copied), so the backward reads the bits it would compute.
 */
#ifndef SSM_REAL_H
#error "include ssm_real_f32.h or ssm_real_f64.h before gdn_chunked_body.h"
#endif

#include <string.h>

#include "ssm_common.h"
#include "gdn_common.h"
#include "ssm_mm.h"
#include "gdn_chunk.h"
#include "gdn_keep.h"

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
 * stride vs, Sp columns), then H becomes the state after the chunk; the cache hints pf in the products.
 * kt: NULL, or where T goes (C, C), as the backward computes it (before gdnc_chunk_delta scales it). */
static void gdnc_chunk_fwd_o(const gdn_params * p, const gdnc_buf * b, int64_t L, const real * V, int64_t vs,
                             real * o, int64_t os, ssm_pf * pf, real * kt) {
    const int64_t S = p->S, C = GDN_CHUNK;
    const real c = (real) 1 / real_sqrt((real) S);
    gdnc_make_AP(b, L, c);
    if (kt) {   /* rows past L: zero (the scratch's may be an earlier chunk's) */
        gdn_keep_copy(kt, b->T, L * C);
        memset(kt + L * C, 0, (size_t) ((C - L) * C) * sizeof(real));
    }
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

/* KK and QK zero above their diagonals (the products leave that part undefined; nothing reads it but
 * the kept copies, which are then the same whatever ran before) */
static void gdnc_keep_keys(const gdnc_buf * b, int64_t L) {
    const int64_t C = GDN_CHUNK;
    for (int64_t t = 0; t < L; ++t) {
        memset(b->KK + t * C + t + 1, 0, (size_t) (C - t - 1) * sizeof(real));
        memset(b->QK + t * C + t + 1, 0, (size_t) (C - t - 1) * sizeof(real));
    }
}

/* Forward of one unit: the batch's heads chunk by chunk, each with its own state, sharing the chunk's
 * key part (gdnc_load_keys, gdnc_chunk_keys); every value is the one a head alone would get. With kept,
 * each head's state before every chunk and the chunk's Y, Dl rows into it. */
static void gdnc_fwd_unit(const gdn_params * p, const gdnc_inputs * in, real * out, real * kept, const gdnc_buf * b,
                          int64_t u, int64_t n_units) {
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
        if (kept) gdnc_keep_keys(b, L);
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
            real * kc = kept ? kept + ((n * p->H_v + h) * gdnc_n_chunks(p) + t0 / GDN_CHUNK) * gdnc_kept_chunk_elems(p)
                             : NULL;
            if (kc) gdn_keep_copy(kc, bm.H, Sp * Sp);   /* the state before the chunk */
            real * kt = kc ? kc + gdn_kept_at(Sp, GDN_KEPT_T) : NULL;
            if (direct) {
                const real * V = in->v + n * p->v_st[0] + t0 * p->v_st[1] + h * p->v_st[2];
                gdnc_chunk_fwd_o(p, &bm, L, V, p->v_st[1], o, os, &pf, kt);
#ifdef SSMGRAD_MUTANTS
                for (int64_t t = 0; t < L; ++t)
                    for (int64_t j = 0; j < S; ++j) o[t * os + j] = SSM_MUTANT(SSM_MUT_GDN_CK_FWD, o[t * os + j]);
#endif
            } else {
                gdnc_chunk_fwd_o(p, &bm, L, b->Vc, Sp, b->Ob, Sp, &pf, kt);
                for (int64_t t = 0; t < L; ++t)
                    for (int64_t j = 0; j < S; ++j) o[t * os + j] = SSM_MUTANT(SSM_MUT_GDN_CK_FWD, b->Ob[t * Sp + j]);
            }
            /* Y, Dl, KK, QK (zero above their diagonals: gdnc_keep_keys) after the state; T is gdnc_chunk_fwd_o's */
            if (kc) gdn_keep_rows(kc, Sp, L, b->Y, b->Dl, b->KK, b->QK);
        }
    }
    for (int64_t m = m0; m < m1; ++m)
        gdnc_store_state(Hm[m - m0], Sp,
                         out + p->n_seqs * n_t * p->H_v * S + (n * p->H_v + gdn_group_head(p, kh, m)) * S * S, S);
}

/* Forward: threads split the units (gdnc_fwd_unit_of). The scratch is zeroed first: the padding of
 * every matrix stays zero (no product ever writes it with anything else). kept: NULL, or where the
 * chunks' states and rows go (gdn_fwd_keep_*). */
static void gdnc_fwd(const gdn_params * p, const gdnc_inputs * in, real * out, real * kept, void * work, int ith,
                     int nth) {
    int64_t lo, hi;
    const int64_t n_units = p->n_seqs * p->H_k * gdnc_fwd_batches(p);
    ssm_split(n_units, ith, nth, &lo, &hi);
    if (lo >= hi) return;
    real * base = (real *) work + ith * gdnc_fwd_thread_elems(p);
    memset(base, 0, (size_t) gdnc_fwd_thread_elems(p) * sizeof(real));
    gdnc_buf b;
    gdnc_carve(p, base, 0, &b);
    for (int64_t u = lo; u < hi; ++u) gdnc_fwd_unit(p, in, out, kept, &b, u, n_units);
    if (kept) gdn_keep_fence();
}
