/*
 * ssm_chunk.h -- what the chunked (SSD) forms of the scan share: the forward's (ssm_scan_chunked_body.h)
 * and the backward's (ssm_scan_back_chunked_body.h). A chunk is SSM_CHUNK_T consecutive tokens of one sequence
 * (and only that: a run of heads is a block or a head run, never a chunk). Within a chunk, with
 * l_t the cumulative sum of softplus(dt) * A from its first token through t (in double), S0 the
 * state before it and Xs_t = softplus(dt_t) x_t:
 *   y_t   = e^(l_t) C_t S0 + sum_{tau <= t} e^(l_t - l_tau) (C_t . B_tau) Xs_tau
 *   S_end = e^(l_end) S0 + sum_tau e^(l_end - l_tau) B_tau (x) Xs_tau
 * evaluated as small matrix products (ssm_mm.h). Checked against tests/reference.py's ref_ssm_scan
 * (tests/kernels/test_scan_fwd_chunked.py, tests/kernels/test_scan_back_chunked.py).
 *
 * Part of a kernel body (csrc/ssm_scan_chunked_body.h, ssm_scan_back_chunked_body.h): included
 * after the element type's header, once per translation unit.
 */
#ifndef SSM_CHUNK_H
#define SSM_CHUNK_H

#include "ssm_scan_step.h"

#ifndef SSM_CHUNK_T
#define SSM_CHUNK_T 64   /* tokens per chunk */
#endif

#include "ssm_mm.h"

/* Whether every l_t - l_tau of a chunk's cumulative log decays l[0, L) (acc: l[L - 1]) is within
 * real_exp_poly_fast's range, where it gives real_exp_poly's bits and vectorizes: |fl(l_t - l_tau)| <=
 * fl(lmax - lmin) by the monotony of rounding; a NaN in l makes the last one (acc) NaN, and fails the test */
SSM_INLINE int ssm_chunk_exp_fast(const double * l, int64_t L, double acc) {
    double lmin = 0, lmax = 0;
    for (int64_t t = 0; t < L; ++t) {
        lmin = l[t] < lmin ? l[t] : lmin;
        lmax = l[t] > lmax ? l[t] : lmax;
    }
    return (real) (lmax - lmin) <= REAL_EXP_FAST_MAX && acc == acc;
}

/* d_state and head_dim padded to whole 16-element rows (Np, Pp of the chunk buffers) */
SSM_INLINE int64_t ssm_chunk_np(const ssm_scan_params * p) { return ssm_pad(ssm_max64(p->d_state, 1), 16); }
SSM_INLINE int64_t ssm_chunk_pp(const ssm_scan_params * p) { return ssm_pad(ssm_max64(p->head_dim, 1), 16); }

/* dst[j dst_s + i] = src[i ss + j] for i < rows, j < cols: the chunked forms' transposes (B, the
 * states, Xs, dS). Pure data movement (no bits change). With AVX-512 and float, 16 x 16 tiles
 * turned in registers (four stages of two-source shuffles, 64 shuffles a tile instead of 256
 * scalar loads and stores; measured: the scalar 16 x 16 blocks took 5% of the backward's samples
 * at Mamba-2-130m, n_t 512); with AVX2 and float, four 8 x 8 tiles (three stages); elsewhere, and
 * for the edges, scalar 16 x 16 blocks that stay in L1. */
#include "ssm_tile.h"   /* ssm_ck_tile16, ssm_ck_tile16_to, ssm_ck_tile8 */
static void ssm_chunk_transpose(const int64_t simd, const real * restrict src, int64_t ss,
                                                      real * restrict dst, int64_t dst_s, int64_t rows, int64_t cols) {
    (void) simd;
    for (int64_t i0 = 0; i0 < rows; i0 += 16) {
        const int64_t i1 = ssm_min64(i0 + 16, rows);
        for (int64_t j0 = 0; j0 < cols; j0 += 16) {
            const int64_t j1 = ssm_min64(j0 + 16, cols);
#if (REAL_LANES == 16)
            if (ssm_vec64(simd) && i1 - i0 == 16 && j1 - j0 == 16) {
                ssm_ck_tile16(src + i0 * ss + j0, ss, dst + j0 * dst_s + i0, dst_s);
                continue;
            }
#if SSM_LEVEL == 3
            if (i1 - i0 == 16 && j1 - j0 == 16) {
                for (int64_t a = 0; a < 16; a += 8)
                    for (int64_t b = 0; b < 16; b += 8)
                        ssm_ck_tile8(src + (i0 + a) * ss + j0 + b, ss, dst + (j0 + b) * dst_s + i0 + a, dst_s);
                continue;
            }
#endif
#endif
            for (int64_t j = j0; j < j1; ++j)
                for (int64_t i = i0; i < i1; ++i) dst[j * dst_s + i] = src[i * ss + j];
        }
    }
}

/* ssm_chunk_transpose into memory that is not read again soon (the forward's kept chunk states): with
 * AVX-512 and float, where dst's rows are 64-byte aligned, the whole tiles with streaming stores (the
 * caller ends with ssm_chunk_stream_fence); the same values either way. */
SSM_INLINE void ssm_chunk_transpose_out(const int64_t simd, const real * restrict src, int64_t ss,
                                        real * restrict dst, int64_t dst_s, int64_t rows, int64_t cols) {
#if (REAL_LANES == 16) && SSM_LEVEL >= 4
    if (ssm_vec64(simd) && (uintptr_t) dst % 64 == 0 && dst_s % 16 == 0 && rows % 16 == 0 && cols % 16 == 0) {
        for (int64_t i0 = 0; i0 < rows; i0 += 16)
            for (int64_t j0 = 0; j0 < cols; j0 += 16)
                ssm_ck_tile16_to(src + i0 * ss + j0, ss, dst + j0 * dst_s + i0, dst_s, 1);
        return;
    }
#endif
    ssm_chunk_transpose(simd, src, ss, dst, dst_s, rows, cols);
}

/* the streaming stores of ssm_chunk_transpose_out seen by every thread after the caller's barrier */
SSM_INLINE void ssm_chunk_stream_fence(void) {
#if (REAL_LANES == 16) && SSM_LEVEL >= 4
    _mm_sfence();
#endif
}

/* *Bp, *Cp (row strides *bst, *cst): the rows of B and C of tokens [t0, t0 + L) of group g, in
 * place where their rows are contiguous whole vectors (d_state a multiple of 16), else gathered
 * into Bc, Cc ([SSM_CHUNK_T][Np], zero past d_state). Rows past L are not written. */
static void ssm_chunk_bc(const ssm_scan_params * p, int64_t q, int64_t g, int64_t t0, int64_t L,
                              const real * B, const real * C, real * Bc, real * Cc, const real ** Bp,
                              const real ** Cp, int64_t * bst, int64_t * cst) {
    const int64_t Np = ssm_chunk_np(p), ds = p->d_state, B3 = p->B_st[3], C3 = p->C_st[3];
    const real * B0 = B + q * p->B_st[0] + t0 * p->B_st[1] + g * p->B_st[2];
    const real * C0 = C + q * p->C_st[0] + t0 * p->C_st[1] + g * p->C_st[2];
    if (Np == ds && B3 == 1 && C3 == 1) {
        *Bp = B0;
        *Cp = C0;
        *bst = p->B_st[1];
        *cst = p->C_st[1];
        return;
    }
    for (int64_t t = 0; t < L; ++t) {
        const real * Br = B0 + t * p->B_st[1];
        const real * Cr = C0 + t * p->C_st[1];
        real * restrict bo = Bc + t * Np;
        real * restrict co = Cc + t * Np;
        if (B3 == 1) memcpy(bo, Br, ds * sizeof(real));
        else for (int64_t n = 0; n < ds; ++n) bo[n] = Br[n * B3];
        if (C3 == 1) memcpy(co, Cr, ds * sizeof(real));
        else for (int64_t n = 0; n < ds; ++n) co[n] = Cr[n * C3];
        for (int64_t n = ds; n < Np; ++n) bo[n] = co[n] = 0;
    }
    *Bp = Bc;
    *Cp = Cc;
    *bst = *cst = Np;
}

#endif /* SSM_CHUNK_H */
