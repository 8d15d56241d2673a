/*
 * ssm_chunk.h -- what the chunked (SSD) forms of the scan share: the forward's (ssm_scan_chunked.c)
 * and the backward's (ssm_scan_back_chunked.c). A chunk is SSM_CHUNK_T consecutive tokens of one sequence
 * (and only that: a run of heads is a block or a head run, never a chunk). Within a chunk, with
 * l_t the cumulative sum of softplus(dt) * A from its first token through t (in double), S0 the
 * state before it and Xs_t = softplus(dt_t) x_t:
 *   y_t   = e^(l_t) C_t S0 + sum_{tau <= t} e^(l_t - l_tau) (C_t . B_tau) Xs_tau
 *   S_end = e^(l_end) S0 + sum_tau e^(l_end - l_tau) B_tau (x) Xs_tau
 * evaluated as small matrix products (ssm_mm.h). Checked against tests/reference.py's ref_scan
 * (tests/test_scan_fwd_chunked.py, tests/test_scan_chunked.py).
 *
 * Part of a kernel file's SSM_TMPL body, after ssm_scan_step.h: included once per element type
 * and SIMD pass. No include guard on that part.
 */
#if !defined(SSM_TMPL)
#error "ssm_chunk.h belongs in a kernel file's SSM_TMPL body"
#endif

#ifndef SSM_CHUNK_T
#define SSM_CHUNK_T 64   /* tokens per chunk */
#endif

#include "ssm_mm.h"

/* d_state and head_dim padded to whole 16-element rows (Np, Pp of the chunk buffers) */
SSM_INLINE int64_t SFX(ssm_chunk_np)(const ssm_scan_params * p) { return ssm_pad(ssm_max64(p->d_state, 1), 16); }
SSM_INLINE int64_t SFX(ssm_chunk_pp)(const ssm_scan_params * p) { return ssm_pad(ssm_max64(p->head_dim, 1), 16); }

/* *Bp, *Cp (row strides *bst, *cst): the rows of B and C of tokens [t0, t0 + L) of group g, in
 * place where their rows are contiguous whole vectors (d_state a multiple of 16), else gathered
 * into Bc, Cc ([SSM_CHUNK_T][Np], zero past d_state). Rows past L are not written. */
static void SFX(ssm_chunk_bc)(const ssm_scan_params * p, int64_t q, int64_t g, int64_t t0, int64_t L,
                              const REAL * B, const REAL * C, REAL * Bc, REAL * Cc, const REAL ** Bp,
                              const REAL ** Cp, int64_t * bst, int64_t * cst) {
    const int64_t Np = SFX(ssm_chunk_np)(p), ds = p->d_state, B3 = p->B_st[3], C3 = p->C_st[3];
    const REAL * B0 = B + q * p->B_st[0] + t0 * p->B_st[1] + g * p->B_st[2];
    const REAL * C0 = C + q * p->C_st[0] + t0 * p->C_st[1] + g * p->C_st[2];
    if (Np == ds && B3 == 1 && C3 == 1) {
        *Bp = B0;
        *Cp = C0;
        *bst = p->B_st[1];
        *cst = p->C_st[1];
        return;
    }
    for (int64_t t = 0; t < L; ++t) {
        const REAL * Br = B0 + t * p->B_st[1];
        const REAL * Cr = C0 + t * p->C_st[1];
        REAL * restrict bo = Bc + t * Np;
        REAL * restrict co = Cc + t * Np;
        if (B3 == 1) memcpy(bo, Br, ds * sizeof(REAL));
        else for (int64_t n = 0; n < ds; ++n) bo[n] = Br[n * B3];
        if (C3 == 1) memcpy(co, Cr, ds * sizeof(REAL));
        else for (int64_t n = 0; n < ds; ++n) co[n] = Cr[n * C3];
        for (int64_t n = ds; n < Np; ++n) bo[n] = co[n] = 0;
    }
    *Bp = Bc;
    *Cp = Cc;
    *bst = *cst = Np;
}
