/*
 * ssm_scan_layout.h -- how the scan kernels cut the work into blocks and lay out scratch.
 * Internal; shared by the forward (ssm_scan_*.c) and the backward (ssm_scan_back_*.c).
 *
 * A block is one sequence q and a run of consecutive heads [h0, h1) of one group g. Its
 * state is kept TRANSPOSED in scratch, H[n * Rp + r] for state n and row r = (h-h0)*head_dim + p,
 * so every inner loop runs along rows: the sum over n for y is a plain vertical
 * accumulation in ggml's order (n increasing), and Mamba-1's per-state decays and Mamba-2's
 * per-head decays share one loop shape. Rows are padded to Rp, a multiple of SSM_RT; pad rows
 * hold zeros and add exact zeros to every row reduction.
 */
#ifndef SSM_SCAN_LAYOUT_H
#define SSM_SCAN_LAYOUT_H

#include <stdlib.h>
#include <string.h>

#include "ssm_arena.h"
#include "ssm_common.h"

/* rows per register tile of the token step: 4 AVX-512 registers of floats, so that the
 * per-row accumulators of a tile stay in registers across the loop over states */
#define SSM_RT 64

/* tokens per tile of softplus(dt) and e^(sp * A) for blocks of few heads (ssm_fill_tile) */
#define SSM_TT 64

typedef struct {
    int64_t q, g, h0, h1;   /* sequence, group, heads [h0, h1) */
    int64_t R, Rp;          /* rows, rows padded to SSM_RT */
} ssm_block;

SSM_INLINE int64_t ssm_heads_per_group(const ssm_scan_params * p) {
    return p->n_head / p->n_group;
}

/* Heads per block: as many as keep the block's state near SSM_BLOCK_ELEMS, at least one. */
SSM_INLINE int64_t ssm_block_heads(const ssm_scan_params * p) {
    const int64_t per_head = ssm_max64(1, p->head_dim * p->d_state);
    const int64_t hpg = ssm_heads_per_group(p);
    return ssm_max64(1, ssm_min64(SSM_BLOCK_ELEMS / per_head, hpg));
}

SSM_INLINE int64_t ssm_max_rows_padded(const ssm_scan_params * p) {
    return ssm_pad(ssm_max64(1, ssm_block_heads(p) * p->head_dim), SSM_RT);
}

/* Backward head runs: the heads of a group in rpg nearly equal runs (shape-only), each at least
 * a register tile of rows where the group has that many (fewer would be mostly padding), and
 * no more than keep the partial sums of d_B and d_C (2 n_t d_state floats per run, group
 * and sequence) within SSM_PARTIAL_BYTES, with at least 2 runs where the group has 2 tiles
 * and the call has a single (sequence, group) pair (so that 2 threads share one long sequence). */
#define SSM_PARTIAL_BYTES (16 << 20)
SSM_INLINE int64_t ssm_head_runs_per_group(const ssm_scan_params * p) {
    const int64_t hpg = ssm_heads_per_group(p);
    const int64_t by_rows = ssm_max64(1, hpg * p->head_dim / SSM_RT);
    /* in double: no overflow for any shape (the glue asks for the units before it allocates) */
    const double per_run = (double) p->n_seqs * p->n_group * p->n_t * p->d_state * 2 * sizeof(float);
    const int64_t least = p->n_seqs * p->n_group >= 2 ? 1 : 2;     /* units for 2 threads */
    const int64_t by_mem = per_run * least >= SSM_PARTIAL_BYTES ? least : per_run < 1 ? SSM_HEAD_RUNS_PER_GROUP
                           : ssm_max64(least, (int64_t) (SSM_PARTIAL_BYTES / per_run));
    return ssm_min64(hpg, ssm_min64(ssm_min64(SSM_HEAD_RUNS_PER_GROUP, by_mem), by_rows));
}

SSM_INLINE ssm_block ssm_make_block(const ssm_scan_params * p, int64_t q, int64_t h0, int64_t h1) {
    ssm_block b;
    b.q = q;
    b.g = h0 / ssm_heads_per_group(p);
    b.h0 = h0;
    b.h1 = h1;
    b.R = (h1 - h0) * p->head_dim;
    b.Rp = ssm_pad(ssm_max64(b.R, 1), SSM_RT);
    return b;
}

/*
 * The decode path of the forward (ssm_scan_decode.c): calls of at most SSM_DECODE_MAX_T tokens, as in
 * generation, work on the state rows in ggml's own layout (contiguous over d_state) straight from
 * s into the output, with no transposed scratch state. It needs contiguous state rows, B and C
 * rows and (Mamba-1) A rows; other strides take the general path. It depends on the shape and
 * strides only, so every thread of a call, and ssm_scan_work_size, agree on it.
 */
#define SSM_DECODE_MAX_T 4
SSM_INLINE int ssm_scan_decode_path(const ssm_scan_params * p) {
    return p->n_t >= 1 && p->n_t <= SSM_DECODE_MAX_T && p->head_dim >= 1 && p->d_state >= 1
           && p->s_st[3] == 1 && p->B_st[3] == 1 && p->C_st[3] == 1 && (!p->a_per_state || p->A_st[1] == 1);
}

/* Internal (not in ssmgrad.h; the glue's in-place cache update): the decode path alone, y (dense, like
 * ssm_scan's y region) and the K state slots (dense) to separate buffers; st may be s itself when
 * K = 1, n_rs = n_seqs, ids[q] = q and s is dense. ids may be NULL: the identity, ids[q] = q.
 * Precondition: ssm_scan_decode_path(p). */
void ssm_scan_decode_into_f32(const ssm_scan_params * p, const float * s, const float * x, const float * dt,
                              const float * A, const float * B, const float * C, const int64_t * ids, float * y,
                              float * st, int ith, int nth);
void ssm_scan_decode_into_f64(const ssm_scan_params * p, const double * s, const double * x, const double * dt,
                              const double * A, const double * B, const double * C, const int64_t * ids,
                              double * y, double * st, int ith, int nth);

/* Internal (ssm_scan_back_recurrence.c; the glue's _scan_forms): whether phase 1 of the backward takes the
 * chunked form for this call, by its shape and p->back_form. */
int ssm_scan_back_chunked(const ssm_scan_params * p);
/* ... and whether the forward does (ssm_scan_recurrence.c; p->fwd_form) */
int ssm_scan_fwd_chunked(const ssm_scan_params * p);

#endif /* SSM_SCAN_LAYOUT_H */

/* ---------------------------------------------------------------------------------------
 * The part below depends on REAL / SFX and is included once per type by each kernel file.
 */
#if defined(SSM_TMPL)

/* the helpers below that are not inline: not every kernel file uses all of them */
#define SSM_MAYBE_UNUSED __attribute__((unused))

#if !defined(SSM_EXP) || !defined(SSM_SOFTPLUS)
#error "SSM_EXP and SSM_SOFTPLUS must be defined with REAL"
#endif

/* 64-byte vectors of REAL (GCC vector extensions: lowered to whatever the target has) */
typedef REAL SFX(vec) __attribute__((vector_size(64)));
#define SSM_LANES ((int) (64 / sizeof(REAL)))
#define SSM_NV (SSM_RT / SSM_LANES)
#if SSM_LANES_IS_16
typedef int32_t SFX(ivec) __attribute__((vector_size(64)));
typedef uint32_t SFX(uvec) __attribute__((vector_size(64)));
#else
typedef int64_t SFX(ivec) __attribute__((vector_size(64)));
typedef uint64_t SFX(uvec) __attribute__((vector_size(64)));
#endif

/* Per-row and per-state vectors of one block at one token. */
typedef struct {
    REAL * H;     /* [d_state][Rp] the running state (transposed) */
    REAL * At;    /* [d_state][Rp] Mamba-1: A[h(r), n]; unused for Mamba-2 */
    REAL * Amax;  /* [Rp] Mamba-1: max over n of |A[h(r), n]|, +inf if one is NaN */
    REAL * x;     /* [Rp] x[q, t, h, p] */
    REAL * sp;    /* [Rp] softplus(dt[q, t, h]) of the row's head */
    REAL * xdt;   /* [Rp] x * sp */
    REAL * ar;    /* [Rp] Mamba-2: exp(sp * A[h]) */
    REAL * y;     /* [Rp] y of the token */
    const REAL * Bv;  /* [d_state] B[q, t, g, :]: the input row itself when its elements are
                           contiguous, else Bbuf holding a gathered copy */
    const REAL * Cv;  /* [d_state] C[q, t, g, :], likewise */
    REAL * Bbuf;  /* [d_state] */
    REAL * Cbuf;  /* [d_state] */
    REAL * hsp;   /* [heads] softplus(dt) per head of the block */
    REAL * har;   /* [heads] Mamba-2: exp(sp * A[h]) per head */
    REAL * tsp;   /* [heads][SSM_TT] blocks of fewer than SSM_VL heads: hsp of a tile of tokens */
    REAL * tar;   /* [heads][SSM_TT] ... and their har */
    int64_t * tile;  /* which tile tsp, tar hold (first token / SSM_TT), -1 for none; a pointer,
                        so that the copies of v made by the backward share it */
} SFX(ssm_rows);

SSM_INLINE void SFX(ssm_take_rows)(ssm_arena * a, const ssm_scan_params * p, int64_t Rp,
                                    SFX(ssm_rows) * v) {
    const size_t e = sizeof(REAL), ds = (size_t) p->d_state;
    v->H = ssm_take(a, ds * Rp * e);
    v->At = ssm_take(a, p->a_per_state ? ds * Rp * e : 0);
    v->Amax = ssm_take(a, p->a_per_state ? Rp * e : 0);
    v->x = ssm_take(a, Rp * e);
    v->sp = ssm_take(a, Rp * e);
    v->xdt = ssm_take(a, Rp * e);
    v->ar = ssm_take(a, Rp * e);
    v->y = ssm_take(a, Rp * e);
    v->Bbuf = ssm_take(a, ds * e);
    v->Cbuf = ssm_take(a, ds * e);
    v->Bv = v->Bbuf;
    v->Cv = v->Cbuf;
    v->hsp = ssm_take(a, (size_t) ssm_block_heads(p) * e);
    v->har = ssm_take(a, (size_t) ssm_block_heads(p) * e);
    const size_t tile_heads = (size_t) ssm_min64(ssm_block_heads(p), SSM_VL - 1);
    v->tsp = ssm_take(a, tile_heads * SSM_TT * e);
    v->tar = ssm_take(a, tile_heads * SSM_TT * e);
    v->tile = ssm_take(a, sizeof(int64_t));
}

/* Start a block: zero the per-row vectors (pad rows stay zero), transpose Mamba-1's A. */
SSM_MAYBE_UNUSED static void SFX(ssm_rows_begin)(const ssm_scan_params * p, const ssm_block * b, const REAL * A,
                                SFX(ssm_rows) * v) {
    const int64_t Rp = b->Rp, hd = p->head_dim, ds = p->d_state;
    memset(v->x, 0, Rp * sizeof(REAL));
    memset(v->sp, 0, Rp * sizeof(REAL));
    memset(v->xdt, 0, Rp * sizeof(REAL));
    memset(v->ar, 0, Rp * sizeof(REAL));
    *v->tile = -1;
    if (p->a_per_state) {
        memset(v->At, 0, ds * Rp * sizeof(REAL));
        memset(v->Amax, 0, Rp * sizeof(REAL));
        for (int64_t h = b->h0; h < b->h1; ++h) {
            REAL amax = 0;
            for (int64_t n = 0; n < ds; ++n) {
                const REAL a = A[h * p->A_st[0] + n * p->A_st[1]];
                const REAL aa = a == a ? (a >= 0 ? a : -a) : (REAL) INFINITY;
                amax = aa > amax ? aa : amax;
                for (int64_t pp = 0; pp < hd; ++pp) v->At[n * Rp + (h - b->h0) * hd + pp] = a;
            }
            for (int64_t pp = 0; pp < hd; ++pp) v->Amax[(h - b->h0) * hd + pp] = amax;
        }
    }
}

/* Load the block's start state s[ids[q]] into H (transposed), zero in pad rows. */
SSM_MAYBE_UNUSED static void SFX(ssm_load_state)(const ssm_scan_params * p, const ssm_block * b, const REAL * s,
                                const int64_t * ids, REAL * H) {
    const int64_t Rp = b->Rp, hd = p->head_dim, ds = p->d_state;
    memset(H, 0, ds * Rp * sizeof(REAL));
    const REAL * src = s + ids[b->q] * p->s_st[0];
    for (int64_t h = b->h0; h < b->h1; ++h)
        for (int64_t pp = 0; pp < hd; ++pp) {
            const REAL * row = src + h * p->s_st[1] + pp * p->s_st[2];
            const int64_t r = (h - b->h0) * hd + pp;
            for (int64_t n = 0; n < ds; ++n) H[n * Rp + r] = row[n * p->s_st[3]];
        }
}

/* Store H (transposed) into a dense (n_head, head_dim, d_state) state slot at dst (head h0). */
SSM_MAYBE_UNUSED static void SFX(ssm_store_state)(const ssm_scan_params * p, const ssm_block * b, const REAL * H,
                                 REAL * dst) {
    const int64_t Rp = b->Rp, ds = p->d_state;
    for (int64_t r = 0; r < b->R; ++r) {
        REAL * row = dst + r * ds;
        for (int64_t n = 0; n < ds; ++n) row[n] = H[n * Rp + r];
    }
}

/* Cache lines of the contiguous run [ptr, ptr + n) of REAL, asked for ahead of use. */
SSM_INLINE void SFX(ssm_prefetch_run)(const REAL * ptr, int64_t n) {
    const char * c = (const char *) ptr;
    const int64_t bytes = n * (int64_t) sizeof(REAL);
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 3);
    if (bytes > 0) __builtin_prefetch(c + bytes - 1, 0, 3);
}

/* How many tokens ahead the token loops ask for their inputs. A token's rows of x are a few
 * hundred bytes spaced n_head * head_dim elements apart: a new page per token or two, which
 * the hardware prefetchers do not cross. */
#define SSM_PREFETCH_TOKENS 2

/* Ask for token t's inputs of the block (x, dt, B, C); no-op outside [0, n_t). */
SSM_INLINE void SFX(ssm_prefetch_token)(const ssm_scan_params * p, const ssm_block * b, const REAL * x,
                                         const REAL * dt, const REAL * B, const REAL * C, int64_t t) {
    if (t < 0 || t >= p->n_t) return;
    const int64_t hd = p->head_dim, q = b->q, nb = b->h1 - b->h0;
    const REAL * xr = x + q * p->x_st[0] + t * p->x_st[1] + b->h0 * p->x_st[2];
    if (p->x_st[3] == 1 && p->x_st[2] == hd) SFX(ssm_prefetch_run)(xr, nb * hd);
    else if (p->x_st[3] == 1) for (int64_t j = 0; j < nb; ++j) SFX(ssm_prefetch_run)(xr + j * p->x_st[2], hd);
    if (p->dt_st[2] == 1) SFX(ssm_prefetch_run)(dt + q * p->dt_st[0] + t * p->dt_st[1] + b->h0, nb);
    if (p->B_st[3] == 1) SFX(ssm_prefetch_run)(B + q * p->B_st[0] + t * p->B_st[1] + b->g * p->B_st[2], p->d_state);
    if (p->C_st[3] == 1) SFX(ssm_prefetch_run)(C + q * p->C_st[0] + t * p->C_st[1] + b->g * p->C_st[2], p->d_state);
}

/* whether every one of v[0, n) is >= -SSM_EXP_FAST_MAX (false if one is NaN): then
 * SSM_SOFTPLUS_IN and SSM_DSOFTPLUS_IN apply to all of them */
SSM_MAYBE_UNUSED static int SFX(ssm_sp_inrange)(const REAL * restrict v, int64_t n) {
    int ok = 1;
    for (int64_t i = 0; i < n; ++i) ok &= v[i] >= -SSM_EXP_FAST_MAX;
    return ok;
}

/* softplus of n values in place: a loop of its own so that it vectorizes */
SSM_MAYBE_UNUSED static void SFX(ssm_softplus_n)(REAL * restrict v, int64_t n) {
    if (SFX(ssm_sp_inrange)(v, n))
        for (int64_t i = 0; i < n; ++i) v[i] = SSM_SOFTPLUS_IN(v[i]);
    else
        for (int64_t i = 0; i < n; ++i) v[i] = SSM_SOFTPLUS(v[i]);
}

/* Point v->Bv, v->Cv at token t's rows of B and C where their elements are contiguous (no
 * copy); else at Bbuf, Cbuf, gathering into them if gather (the backward's reverse pass finds
 * them already gathered there). */
SSM_INLINE void SFX(ssm_token_bc)(const ssm_scan_params * p, const ssm_block * b, const REAL * B,
                                  const REAL * C, int64_t t, SFX(ssm_rows) * v, const int gather) {
    const int64_t ds = p->d_state, B3 = p->B_st[3], C3 = p->C_st[3];
    const REAL * Br = B + b->q * p->B_st[0] + t * p->B_st[1] + b->g * p->B_st[2];
    const REAL * Cr = C + b->q * p->C_st[0] + t * p->C_st[1] + b->g * p->C_st[2];
    if (B3 == 1) v->Bv = Br;
    else {
        if (gather)
            for (int64_t n = 0; n < ds; ++n) v->Bbuf[n] = Br[n * B3];
        v->Bv = v->Bbuf;
    }
    if (C3 == 1) v->Cv = Cr;
    else {
        if (gather)
            for (int64_t n = 0; n < ds; ++n) v->Cbuf[n] = Cr[n * C3];
        v->Cv = v->Cbuf;
    }
}

/*
 * softplus(dt) and Mamba-2's e^(sp * A) of the tile of SSM_TT tokens that holds token t, for
 * each head of a block of fewer than SSM_VL heads: per token they would be a few scalar
 * evaluations (a tenth of a Mamba-2-130m forward), per tile they are vector loops along tokens.
 * The same functions as the per-token path, so blocks of any size give the same bits.
 */
SSM_MAYBE_UNUSED static void SFX(ssm_fill_tile)(const ssm_scan_params * p, const ssm_block * b, const REAL * dt,
                               const REAL * A, int64_t t, SFX(ssm_rows) * v) {
    const int64_t k = t / SSM_TT, t0 = k * SSM_TT, n = ssm_min64(SSM_TT, p->n_t - t0);
    const int64_t nb = b->h1 - b->h0, dt1 = p->dt_st[1];
    for (int64_t j = 0; j < nb; ++j) {
        const REAL * d = dt + b->q * p->dt_st[0] + t0 * dt1 + (b->h0 + j) * p->dt_st[2];
        REAL * restrict sp = v->tsp + j * SSM_TT;
        REAL * restrict ar = v->tar + j * SSM_TT;
        for (int64_t i = 0; i < n; ++i) sp[i] = d[i * dt1];
        for (int64_t i = 0; i < n; ++i) sp[i] = SSM_SOFTPLUS(sp[i]);
        if (!p->a_per_state) {
            const REAL a = A[(b->h0 + j) * p->A_st[0]];
            for (int64_t i = 0; i < n; ++i) ar[i] = SSM_EXP(sp[i] * a);
        }
    }
    *v->tile = k;
}

/* Gather token t's inputs of the block into the row vectors. */
__attribute__((unused))
SSM_MAYBE_UNUSED static void SFX(ssm_rows_token)(const ssm_scan_params * p, const ssm_block * b, const REAL * x,
                                const REAL * dt, const REAL * A, const REAL * B, const REAL * C,
                                int64_t t, SFX(ssm_rows) * v) {
    const int64_t hd = p->head_dim, q = b->q, nb = b->h1 - b->h0;
    /* local restrict copies of the pointers: stores through them cannot change v's fields,
     * which the build's -fno-strict-aliasing would otherwise make the compiler assume */
    REAL * restrict hsp = v->hsp;
    REAL * restrict har = v->har;
    const int64_t dt2 = p->dt_st[2], x2 = p->x_st[2];
    if (nb >= SSM_VL) {
        const REAL * dtr = dt + q * p->dt_st[0] + t * p->dt_st[1] + b->h0 * dt2;
        if (dt2 == 1) for (int64_t j = 0; j < nb; ++j) hsp[j] = dtr[j];   /* vectorizes */
        else for (int64_t j = 0; j < nb; ++j) hsp[j] = dtr[j * dt2];
        SFX(ssm_softplus_n)(hsp, nb);
        if (!p->a_per_state)
            for (int64_t j = 0; j < nb; ++j) har[j] = SSM_EXP(hsp[j] * A[(b->h0 + j) * p->A_st[0]]);
    } else {
        if (*v->tile != t / SSM_TT) SFX(ssm_fill_tile)(p, b, dt, A, t, v);
        const int64_t i = t % SSM_TT;
        for (int64_t j = 0; j < nb; ++j) hsp[j] = v->tsp[j * SSM_TT + i];
        if (!p->a_per_state)
            for (int64_t j = 0; j < nb; ++j) har[j] = v->tar[j * SSM_TT + i];
    }
    const REAL * xr = x + q * p->x_st[0] + t * p->x_st[1] + b->h0 * x2;
    if (hd == 1) {              /* Mamba-1 as llama.cpp runs it: one row per head */
        REAL * restrict xo = v->x;
        REAL * restrict so = v->sp;
        REAL * restrict xd = v->xdt;
        if (x2 == 1)
            for (int64_t j = 0; j < nb; ++j) {
                xo[j] = xr[j];
                so[j] = hsp[j];
                xd[j] = xr[j] * hsp[j];
            }
        else
            for (int64_t j = 0; j < nb; ++j) {
                xo[j] = xr[j * x2];
                so[j] = hsp[j];
                xd[j] = xr[j * x2] * hsp[j];
            }
        if (!p->a_per_state) memcpy(v->ar, har, nb * sizeof(REAL));
    } else {
        const int64_t x3 = p->x_st[3];
        for (int64_t j = 0; j < nb; ++j) {
            const REAL sp = v->hsp[j], ar = p->a_per_state ? 0 : v->har[j];
            const REAL * xi = xr + j * p->x_st[2];
            REAL * restrict xo = v->x + j * hd;
            REAL * restrict so = v->sp + j * hd;
            REAL * restrict xd = v->xdt + j * hd;
            REAL * restrict ao = v->ar + j * hd;
            if (x3 == 1)
                for (int64_t pp = 0; pp < hd; ++pp) {
                    xo[pp] = xi[pp];
                    xd[pp] = xi[pp] * sp;
                }
            else
                for (int64_t pp = 0; pp < hd; ++pp) {
                    xo[pp] = xi[pp * x3];
                    xd[pp] = xi[pp * x3] * sp;
                }
            for (int64_t pp = 0; pp < hd; ++pp) {
                so[pp] = sp;
                ao[pp] = ar;
            }
        }
    }
    SFX(ssm_token_bc)(p, b, B, C, t, v, 1);
}

#endif /* SSM_TMPL */
