/*
 * ssm_scan_rows.h -- the scan's per-block vectors for one element type: the 64-byte vector types,
 * the per-row and per-state vectors of a block at one token (ssm_rows), and the helpers that load
 * and store a block's state and fill its rows. The layout is ssm_scan_layout.h's.
 *
 * Part of a kernel body: included after the element type's header (ssm_real_f32.h /
 * ssm_real_f64.h), once per translation unit.
 */
#ifndef SSM_SCAN_ROWS_H
#define SSM_SCAN_ROWS_H

#ifndef SSM_REAL_H
#error "include ssm_real_f32.h or ssm_real_f64.h first"
#endif

#include "ssm_scan_layout.h"

/* 64-byte vectors of real (GCC vector extensions: lowered to whatever the target has) */
typedef real vec __attribute__((vector_size(64)));
#define SSM_LANES ((int) (64 / sizeof(real)))
#define SSM_NV (SSM_RT / SSM_LANES)
#if (REAL_LANES == 16)
typedef int32_t ivec __attribute__((vector_size(64)));
typedef uint32_t uvec __attribute__((vector_size(64)));
#else
typedef int64_t ivec __attribute__((vector_size(64)));
typedef uint64_t uvec __attribute__((vector_size(64)));
#endif
/* 32-byte vectors of real: the x86-64-v3 pass's (ssm_vec32), one AVX2 register each */
typedef real vec32 __attribute__((vector_size(32)));
#define SSM_LANES32 ((int) (32 / sizeof(real)))
#if (REAL_LANES == 16)
typedef uint32_t uvec32 __attribute__((vector_size(32)));
#else
typedef uint64_t uvec32 __attribute__((vector_size(32)));
#endif

/* Per-row and per-state vectors of one block at one token. */
typedef struct {
    real * H;     /* [d_state][Rp] the running state (transposed) */
    real * At;    /* [d_state][Rp] Mamba-1: A[h(r), n]; unused for Mamba-2 */
    real * Amax;  /* [Rp] Mamba-1: max over n of |A[h(r), n]|, +inf if one is NaN */
    real * x;     /* [Rp] x[q, t, h, p] */
    real * sp;    /* [Rp] softplus(dt[q, t, h]) of the row's head */
    real * xdt;   /* [Rp] x * sp */
    real * ar;    /* [Rp] Mamba-2: exp(sp * A[h]) */
    real * y;     /* [Rp] y of the token */
    const real * Bv;  /* [d_state] B[q, t, g, :]: the input row itself when its elements are
                           contiguous, else Bbuf holding a gathered copy */
    const real * Cv;  /* [d_state] C[q, t, g, :], likewise */
    real * Bbuf;  /* [d_state] */
    real * Cbuf;  /* [d_state] */
    real * hsp;   /* [heads] softplus(dt) per head of the block */
    real * har;   /* [heads] Mamba-2: exp(sp * A[h]) per head */
    real * tsp;   /* [heads][SSM_TT] blocks of fewer than SSM_VL heads: hsp of a tile of tokens */
    real * tar;   /* [heads][SSM_TT] ... and their har */
    int64_t * tile;  /* which tile tsp, tar hold (first token / SSM_TT), -1 for none; a pointer,
                        so that the copies of v made by the backward share it */
} ssm_rows;

SSM_INLINE void ssm_take_rows(ssm_arena * a, const ssm_scan_params * p, int64_t Rp,
                                    ssm_rows * v) {
    const size_t e = sizeof(real), ds = (size_t) p->d_state;
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
static void ssm_rows_begin(const ssm_scan_params * p, const ssm_block * b, const real * A,
                                ssm_rows * v) {
    const int64_t Rp = b->Rp, hd = p->head_dim, ds = p->d_state;
    memset(v->x, 0, Rp * sizeof(real));
    memset(v->sp, 0, Rp * sizeof(real));
    memset(v->xdt, 0, Rp * sizeof(real));
    memset(v->ar, 0, Rp * sizeof(real));
    *v->tile = -1;
    if (p->a_per_state) {
        memset(v->At, 0, ds * Rp * sizeof(real));
        memset(v->Amax, 0, Rp * sizeof(real));
        for (int64_t h = b->h0; h < b->h1; ++h) {
            real amax = 0;
            for (int64_t n = 0; n < ds; ++n) {
                const real a = A[h * p->A_st[0] + n * p->A_st[1]];
                const real aa = a == a ? (a >= 0 ? a : -a) : (real) INFINITY;
                amax = aa > amax ? aa : amax;
                for (int64_t pp = 0; pp < hd; ++pp) v->At[n * Rp + (h - b->h0) * hd + pp] = a;
            }
            for (int64_t pp = 0; pp < hd; ++pp) v->Amax[(h - b->h0) * hd + pp] = amax;
        }
    }
}

/* Load the block's start state s[ids[q]] into H (transposed), zero in pad rows. */
static void ssm_load_state(const ssm_scan_params * p, const ssm_block * b, const real * s,
                                const int64_t * ids, real * H) {
    const int64_t Rp = b->Rp, hd = p->head_dim, ds = p->d_state;
    memset(H, 0, ds * Rp * sizeof(real));
    const real * src = s + ids[b->q] * p->s_st[0];
    for (int64_t h = b->h0; h < b->h1; ++h)
        for (int64_t pp = 0; pp < hd; ++pp) {
            const real * row = src + h * p->s_st[1] + pp * p->s_st[2];
            const int64_t r = (h - b->h0) * hd + pp;
            for (int64_t n = 0; n < ds; ++n) H[n * Rp + r] = row[n * p->s_st[3]];
        }
}

/* Store H (transposed) into a dense (n_head, head_dim, d_state) state slot at dst (head h0). */
static void ssm_store_state(const ssm_scan_params * p, const ssm_block * b, const real * H,
                                 real * dst) {
    const int64_t Rp = b->Rp, ds = p->d_state;
    for (int64_t r = 0; r < b->R; ++r) {
        real * row = dst + r * ds;
        for (int64_t n = 0; n < ds; ++n) row[n] = H[n * Rp + r];
    }
}

/* Cache lines of the contiguous run [ptr, ptr + n) of real, asked for ahead of use. */
SSM_INLINE void ssm_prefetch_run(const real * ptr, int64_t n) {
    const char * c = (const char *) ptr;
    const int64_t bytes = n * (int64_t) sizeof(real);
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(c + off, 0, 3);
    if (bytes > 0) __builtin_prefetch(c + bytes - 1, 0, 3);
}

/* How many tokens ahead the token loops ask for their inputs. A token's rows of x are a few
 * hundred bytes spaced n_head * head_dim elements apart: a new page per token or two, which
 * the hardware prefetchers do not cross. */
#define SSM_PREFETCH_TOKENS 2

/* Ask for token t's inputs of the block (x, dt, B, C); no-op outside [0, n_t). */
SSM_INLINE void ssm_prefetch_token(const ssm_scan_params * p, const ssm_block * b, const real * x,
                                         const real * dt, const real * B, const real * C, int64_t t) {
    if (t < 0 || t >= p->n_t) return;
    const int64_t hd = p->head_dim, q = b->q, nb = b->h1 - b->h0;
    const real * xr = x + q * p->x_st[0] + t * p->x_st[1] + b->h0 * p->x_st[2];
    if (p->x_st[3] == 1 && p->x_st[2] == hd) ssm_prefetch_run(xr, nb * hd);
    else if (p->x_st[3] == 1) for (int64_t j = 0; j < nb; ++j) ssm_prefetch_run(xr + j * p->x_st[2], hd);
    if (p->dt_st[2] == 1) ssm_prefetch_run(dt + q * p->dt_st[0] + t * p->dt_st[1] + b->h0, nb);
    if (p->B_st[3] == 1) ssm_prefetch_run(B + q * p->B_st[0] + t * p->B_st[1] + b->g * p->B_st[2], p->d_state);
    if (p->C_st[3] == 1) ssm_prefetch_run(C + q * p->C_st[0] + t * p->C_st[1] + b->g * p->C_st[2], p->d_state);
}

/* whether every one of v[0, n) is >= -REAL_EXP_FAST_MAX (false if one is NaN): then
 * real_softplus_inrange and real_dsoftplus_inrange apply to all of them */
static int ssm_sp_inrange(const real * restrict v, int64_t n) {
    int ok = 1;
    for (int64_t i = 0; i < n; ++i) ok &= v[i] >= -REAL_EXP_FAST_MAX;
    return ok;
}

/* softplus of n values in place: a loop of its own so that it vectorizes */
static void ssm_softplus_n(real * restrict v, int64_t n) {
    if (ssm_sp_inrange(v, n))
        for (int64_t i = 0; i < n; ++i) v[i] = real_softplus_inrange(v[i]);
    else
        for (int64_t i = 0; i < n; ++i) v[i] = real_softplus(v[i]);
}

/* Point v->Bv, v->Cv at token t's rows of B and C where their elements are contiguous (no
 * copy); else at Bbuf, Cbuf, gathering into them if gather (the backward's reverse pass finds
 * them already gathered there). */
SSM_INLINE void ssm_token_bc(const ssm_scan_params * p, const ssm_block * b, const real * B,
                                  const real * C, int64_t t, ssm_rows * v, const int gather) {
    const int64_t ds = p->d_state, B3 = p->B_st[3], C3 = p->C_st[3];
    const real * Br = B + b->q * p->B_st[0] + t * p->B_st[1] + b->g * p->B_st[2];
    const real * Cr = C + b->q * p->C_st[0] + t * p->C_st[1] + b->g * p->C_st[2];
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
static void ssm_fill_tile(const ssm_scan_params * p, const ssm_block * b, const real * dt,
                               const real * A, int64_t t, ssm_rows * v) {
    const int64_t k = t / SSM_TT, t0 = k * SSM_TT, n = ssm_min64(SSM_TT, p->n_t - t0);
    const int64_t nb = b->h1 - b->h0, dt1 = p->dt_st[1];
    for (int64_t j = 0; j < nb; ++j) {
        const real * d = dt + b->q * p->dt_st[0] + t0 * dt1 + (b->h0 + j) * p->dt_st[2];
        real * restrict sp = v->tsp + j * SSM_TT;
        real * restrict ar = v->tar + j * SSM_TT;
        for (int64_t i = 0; i < n; ++i) sp[i] = d[i * dt1];
        for (int64_t i = 0; i < n; ++i) sp[i] = real_softplus(sp[i]);
        if (!p->a_per_state) {
            const real a = A[(b->h0 + j) * p->A_st[0]];
            for (int64_t i = 0; i < n; ++i) ar[i] = real_exp_poly(sp[i] * a);
        }
    }
    *v->tile = k;
}

/* Gather token t's inputs of the block into the row vectors. */
static void ssm_rows_token(const ssm_scan_params * p, const ssm_block * b, const real * x,
                                const real * dt, const real * A, const real * B, const real * C,
                                int64_t t, ssm_rows * v) {
    const int64_t hd = p->head_dim, q = b->q, nb = b->h1 - b->h0;
    /* local restrict copies of the pointers: stores through them cannot change v's fields,
     * which the build's -fno-strict-aliasing would otherwise make the compiler assume */
    real * restrict hsp = v->hsp;
    real * restrict har = v->har;
    const int64_t dt2 = p->dt_st[2], x2 = p->x_st[2];
    if (nb >= SSM_VL) {
        const real * dtr = dt + q * p->dt_st[0] + t * p->dt_st[1] + b->h0 * dt2;
        if (dt2 == 1) for (int64_t j = 0; j < nb; ++j) hsp[j] = dtr[j];   /* vectorizes */
        else for (int64_t j = 0; j < nb; ++j) hsp[j] = dtr[j * dt2];
        ssm_softplus_n(hsp, nb);
        if (!p->a_per_state)
            for (int64_t j = 0; j < nb; ++j) har[j] = real_exp_poly(hsp[j] * A[(b->h0 + j) * p->A_st[0]]);
    } else {
        if (*v->tile != t / SSM_TT) ssm_fill_tile(p, b, dt, A, t, v);
        const int64_t i = t % SSM_TT;
        for (int64_t j = 0; j < nb; ++j) hsp[j] = v->tsp[j * SSM_TT + i];
        if (!p->a_per_state)
            for (int64_t j = 0; j < nb; ++j) har[j] = v->tar[j * SSM_TT + i];
    }
    const real * xr = x + q * p->x_st[0] + t * p->x_st[1] + b->h0 * x2;
    if (hd == 1) {              /* Mamba-1 as llama.cpp runs it: one row per head */
        real * restrict xo = v->x;
        real * restrict so = v->sp;
        real * restrict xd = v->xdt;
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
        if (!p->a_per_state) memcpy(v->ar, har, nb * sizeof(real));
    } else {
        const int64_t x3 = p->x_st[3];
        for (int64_t j = 0; j < nb; ++j) {
            const real sp = v->hsp[j], ar = p->a_per_state ? 0 : v->har[j];
            const real * xi = xr + j * p->x_st[2];
            real * restrict xo = v->x + j * hd;
            real * restrict so = v->sp + j * hd;
            real * restrict xd = v->xdt + j * hd;
            real * restrict ao = v->ar + j * hd;
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
    ssm_token_bc(p, b, B, C, t, v, 1);
}

#endif /* SSM_SCAN_ROWS_H */
