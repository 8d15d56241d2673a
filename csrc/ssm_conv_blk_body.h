/*
 * ssm_conv_blk_body.h -- SSM_CONV forward and both backward kernels for float32 with AVX-512,
 * cache-blocked: included by ssm_conv_body.h at SIMD level 4 for float only (the instantiation
 * file's target pragma gives the intrinsics their target).
 *
 * sx holds a channel's tokens contiguously (channel-major), y and grad hold a token's channels
 * contiguously (token-major). These kernels walk windows of CONV_BLK_TW tokens, and in each
 * window the thread's channels in groups of CONV_BLK_G vectors of 16 (d_conv 4; one vector for
 * other d_conv and for the channels left over): the channel-major side of the window is turned
 * token-major (or back) with 16 x 16 in-register transposes through a buffer (the caller's
 * scratch, ssm_conv_work_size), and every sum runs down the token-major vectors, one channel per
 * lane. The next group's lines of grad are prefetched a row at a time as the current one goes;
 * y's vectors start where its rows are 64-byte aligned, and a y of CONV_BLK_NT_BYTES or more is
 * written with streaming stores (docs/performance.md has the measurements behind these choices).
 *
 * Taken (the *_take functions return 1) when ssm_avx512_kernels(p->simd) (SSM_SIMD_V4_NO_VEC64
 * turns it off), the rows of sx and of grad are contiguous in their last index, d_conv <=
 * CONV_BLK_MAXK and the caller gave the scratch; ssm_conv_body.h's loops run every other case,
 * with the same bits. Results per channel do not depend on where a thread's channel range
 * starts, so they are the same bits for any thread count:
 *   y[s, t, i]    = ((0 + sx[t] c0) + sx[t+1] c1) + ...       increasing k, as ggml
 *   d_sx[s, i, j] = ((0 + g[j] c0) + g[j-1] c1) + ...         increasing k, absent terms skipped
 *   d_c[i, k]     = sum, over s and then the windows of CONV_BLK_TW tokens from t = 0, of each
 *                   window's running sum in increasing t (the order depends on the shape only)
 * Each product is fused into its sum (FMA).
 */
#ifndef SSM_CONV_BLK_BODY_H
#define SSM_CONV_BLK_BODY_H

#if !(SSM_LEVEL >= 4) || !(REAL_LANES == 16)
#error "ssm_conv_blk_body.h is the float32 AVX-512 (level 4) form only"
#endif

#include <immintrin.h>

#include "ssm_conv_blk.h"

/* r[i][j] <- r[j][i] for 16 vectors of 16 floats */
SSM_INLINE void blk_tr16(__m512 * r) {
    __m512 t[16];
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {
        const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 2]);
        const __m512d c = _mm512_castps_pd(t[4 * i + 1]), d = _mm512_castps_pd(t[4 * i + 3]);
        r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
        r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
        r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
        r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
    }
    /* r[4i + j], 128-bit lane m: rows 4i..4i+3 of column 4m + j */
    for (int j = 0; j < 4; ++j) {
        t[j] = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x88);
        t[4 + j] = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xdd);
        t[8 + j] = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x88);
        t[12 + j] = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xdd);
    }
    for (int j = 0; j < 4; ++j) {
        r[j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88);
        r[8 + j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0xdd);
        r[4 + j] = _mm512_shuffle_f32x4(t[4 + j], t[12 + j], 0x88);
        r[12 + j] = _mm512_shuffle_f32x4(t[4 + j], t[12 + j], 0xdd);
    }
}

SSM_INLINE __mmask16 blk_mask(int64_t n) { return n >= 16 ? (__mmask16) 0xffff : (__mmask16) ((1u << n) - 1u); }

/*
 * Channel-major rows -> token-major buffer: rows [0, ni) of src (row stride ld, tokens
 * [0, ncols) contiguous) into buf[t * 16 + ii], for t < ncols rounded up to 16 (lanes ii >= ni
 * and tokens >= ncols hold 0).
 */
SSM_INLINE void blk_to_tokens(const float * src, int64_t ld, int64_t ni, int64_t ncols, float * buf) {
    for (int64_t t0 = 0; t0 < ncols; t0 += 16) {
        const __mmask16 m = blk_mask(ncols - t0);
        __m512 r[16];
        for (int ii = 0; ii < 16; ++ii)
            r[ii] = ii < ni ? _mm512_maskz_loadu_ps(m, src + ii * ld + t0) : _mm512_setzero_ps();
        blk_tr16(r);
        for (int j = 0; j < 16; ++j) _mm512_store_ps(buf + (t0 + j) * 16, r[j]);
    }
}


/* Ask for the cache lines of rows [lo, hi) of a token-major array at p (row stride ld), one
 * line per row: the lines a vector of channels will read. */
SSM_INLINE void blk_prefetch_column(const float * p, int64_t ld, int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) _mm_prefetch((const char *) (p + t * ld), _MM_HINT_T0);
}

/* Channels before the first one at which the rows of a token-major array at base (row length
 * d_inner) are 64-byte aligned, if every row is alike; the vectors of channels start there. */
SSM_INLINE int64_t blk_head(const float * base, int64_t d_inner, int64_t i_lo, int64_t i_hi) {
    if (d_inner % 16 != 0 || ((uintptr_t) base & 3) != 0) return 0;
    return ssm_min64(i_hi - i_lo, (int64_t) ((64 - ((uintptr_t) (base + i_lo) & 63)) & 63) / 4);
}

/* taps of channels i0 + [0, ni) as vectors, 0 in lanes >= ni */
SSM_INLINE void blk_taps(const ssm_conv_params * p, const float * c, int64_t i0, int64_t ni, __m512 * ck) {
    for (int64_t k = 0; k < p->d_conv; ++k) {
        float cv[16] __attribute__((aligned(64)));
        for (int ii = 0; ii < 16; ++ii) cv[ii] = ii < ni ? c[(i0 + ii) * p->c_st[0] + k * p->c_st[1]] : 0.0f;
        ck[k] = _mm512_load_ps(cv);
    }
}

/* Forward: y[s, t, i] = sum_k sx[s, i, t + k] * c[i, k] */
static void blk_conv_fwd(const ssm_conv_params * p, const float * sx, const float * c, float * y,
                                int ith, int nth, float * restrict xT) {
    const int64_t n_s = p->n_s, d_inner = p->d_inner, K = p->d_conv, n_t = p->n_t;
    const int64_t s0 = p->sx_st[0], s1 = p->sx_st[1];
    __m512 ck[CONV_BLK_MAXK];
    int64_t i_lo, i_hi;
    ssm_split(d_inner, ith, nth, &i_lo, &i_hi);
    const int64_t head = blk_head(y, d_inner, i_lo, i_hi);
    /* streaming stores for a large y (each store fills a whole line: y's rows are 64-byte
     * aligned from the head on), so that its lines are not read before they are written */
    const int nt_y = d_inner % 16 == 0 && n_s * n_t * d_inner * 4 >= CONV_BLK_NT_BYTES;

    for (int64_t s = 0; s < n_s; ++s)
        for (int64_t t0 = 0; t0 < n_t; t0 += CONV_BLK_TW) {
            const int64_t nt = ssm_min64(CONV_BLK_TW, n_t - t0);
            for (int64_t i0 = i_lo, ni; i0 < i_hi; i0 += ni) {
                float * yo = y + (s * n_t + t0) * d_inner + i0;
                const int nts = nt_y && ((uintptr_t) yo & 63) == 0;
                if (K == 4 && !(i0 == i_lo && head > 0) && i_hi - i0 >= 16 * CONV_BLK_G) {
                    /* a group of CONV_BLK_G full vectors of channels */
                    ni = 16 * CONV_BLK_G;
                    __m512 cg[4 * CONV_BLK_G];
                    for (int g = 0; g < CONV_BLK_G; ++g) {
                        blk_taps(p, c, i0 + 16 * g, 16, cg + 4 * g);
                        blk_to_tokens(sx + s * s0 + (i0 + 16 * g) * s1 + t0, s1, 16, nt + K - 1,
                                      xT + g * CONV_BLK_ROWS * 16);
                    }
                    for (int64_t t = 0; t < nt; ++t)
                        for (int g = 0; g < CONV_BLK_G; ++g) {
                            const float * xg = xT + g * CONV_BLK_ROWS * 16 + t * 16;
                            __m512 acc = _mm512_setzero_ps();
                            acc = _mm512_fmadd_ps(_mm512_load_ps(xg), SSM_MUTANT(SSM_MUT_CONV_BLK_FWD, cg[4 * g]), acc);
                            acc = _mm512_fmadd_ps(_mm512_load_ps(xg + 16), cg[4 * g + 1], acc);
                            acc = _mm512_fmadd_ps(_mm512_load_ps(xg + 32), cg[4 * g + 2], acc);
                            acc = _mm512_fmadd_ps(_mm512_load_ps(xg + 48), cg[4 * g + 3], acc);
                            if (nts) _mm512_stream_ps(yo + t * d_inner + 16 * g, acc);
                            else _mm512_storeu_ps(yo + t * d_inner + 16 * g, acc);
                        }
                    continue;
                }
                /* one vector (the head, the tail, or d_conv != 4) */
                ni = ssm_min64(i0 == i_lo && head > 0 ? head : 16, i_hi - i0);
                blk_taps(p, c, i0, ni, ck);
                blk_to_tokens(sx + s * s0 + i0 * s1 + t0, s1, ni, nt + K - 1, xT);
                const __mmask16 m = blk_mask(ni);
                for (int64_t t = 0; t < nt; ++t) {
                    __m512 acc = _mm512_setzero_ps();
                    if (K == 4) {
                        acc = _mm512_fmadd_ps(_mm512_load_ps(xT + t * 16), SSM_MUTANT(SSM_MUT_CONV_BLK_FWD, ck[0]),
                                              acc);
                        acc = _mm512_fmadd_ps(_mm512_load_ps(xT + (t + 1) * 16), ck[1], acc);
                        acc = _mm512_fmadd_ps(_mm512_load_ps(xT + (t + 2) * 16), ck[2], acc);
                        acc = _mm512_fmadd_ps(_mm512_load_ps(xT + (t + 3) * 16), ck[3], acc);
                    } else {
                        for (int64_t k = 0; k < K; ++k)
                            acc = _mm512_fmadd_ps(_mm512_load_ps(xT + (t + k) * 16),
                                                  SSM_MUTANT(SSM_MUT_CONV_BLK_FWD, ck[k]), acc);
                    }
                    if (ni == 16 && nts) _mm512_stream_ps(yo + t * d_inner, acc);
                    else if (ni == 16) _mm512_storeu_ps(yo + t * d_inner, acc);
                    else _mm512_mask_storeu_ps(yo + t * d_inner, m, acc);
                }
            }
        }
    if (nt_y) _mm_sfence();    /* the streaming stores are seen before the caller's barrier */
}

/* Token-major buffer -> channel-major rows: buf[t * 16 + ii] for t < nj into out[ii * ld + t], rows
 * ii < ni, 16 x 16 in-register transposes (the inverse of blk_to_tokens) */
SSM_INLINE void blk_from_tokens(const float * buf, int64_t nj, int64_t ni, float * out, int64_t ld) {
    for (int64_t jb = 0; jb < nj; jb += 16) {
        const __mmask16 mc = blk_mask(nj - jb);
        __m512 r[16];
        for (int jr = 0; jr < 16; ++jr) r[jr] = jb + jr < nj ? _mm512_load_ps(buf + (jb + jr) * 16) : _mm512_setzero_ps();
        blk_tr16(r);
        if (nj - jb >= 16)
            for (int ii = 0; ii < ni; ++ii) _mm512_storeu_ps(out + ii * ld + jb, r[ii]);
        else
            for (int ii = 0; ii < ni; ++ii) _mm512_mask_storeu_ps(out + ii * ld + jb, mc, r[ii]);
    }
}

/* Column j of d_sx for one vector of channels (lanes in m), over the taps k with 0 <= j - k < n_t
 * (increasing k, each product fused into the sum): the columns where some taps fall outside */
SSM_INLINE __m512 blk_edge_col(const float * gs, int64_t g1, int64_t j, int64_t n_t, int64_t K, const __m512 * ck,
                              __mmask16 m) {
    const int64_t k_lo = ssm_max64(0, j - (n_t - 1)), k_hi = ssm_min64(K, j + 1);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t k = k_lo; k < k_hi; ++k)
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, gs + (j - k) * g1), SSM_MUTANT(SSM_MUT_CONV_BLK_BACK, ck[k]),
                              acc);
    return acc;
}

/* A thread's window of a backward kernel: sequence s, tokens (columns) [t0, t0 + n), channels
 * [i_lo, i_hi) */
typedef struct {
    int64_t s, t0, n, i_lo, i_hi;
} blk_window;

/* d_sx of a window's columns for a group of CONV_BLK_G full vectors of channels from i0 (d_conv 4) */
SSM_INLINE void blk_back_group(const ssm_conv_params * p, const float * c, const float * grad, float * d_sx,
                               const blk_window * w, int64_t i0, float * restrict dT) {
    const int64_t d_inner = p->d_inner, K = p->d_conv, n_t = p->n_t, n_cols = K - 1 + n_t;
    const int64_t g0 = p->g_st[0], g1 = p->g_st[1];
    const int64_t s = w->s, j0 = w->t0, nj = w->n;
    const int G = CONV_BLK_G, ni = 16 * G;
    __m512 cg[4 * CONV_BLK_G];
    for (int g = 0; g < G; ++g) blk_taps(p, c, i0 + 16 * g, 16, cg + 4 * g);
    const float * gs = grad + s * g0 + i0;
    const int64_t f_lo = ssm_min64(nj, ssm_max64(0, K - 1 - j0));
    const int64_t f_hi = ssm_max64(f_lo, ssm_min64(nj, n_t - j0));
    /* the rows of grad the next group reads (or the first group of the next
     * window), a row per column, G lines each: one burst is too many misses */
    const int nxt = i0 + 2 * ni <= w->i_hi;
    const float * pf = nxt ? gs + ni : grad + s * g0 + w->i_lo;
    const int64_t pf_d = nxt ? 1 : nj - (K - 1);     /* row of column jf: j0 + jf + pf_d */
    if (nxt)
        for (int g = 0; g < G; ++g)
            blk_prefetch_column(pf + 16 * g, g1, ssm_max64(0, j0 - (K - 1)), ssm_min64(n_t, j0 + f_lo + 1));
    for (int64_t jf = f_lo; jf < f_hi; ++jf) {
        const int64_t jp = j0 + jf + pf_d;
        if (jp < n_t)
            for (int g = 0; g < G; ++g) _mm_prefetch((const char *) (pf + 16 * g + jp * g1), _MM_HINT_T0);
        for (int g = 0; g < G; ++g) {
            const float * gj = gs + (j0 + jf) * g1 + 16 * g;
            __m512 acc = _mm512_setzero_ps();
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(gj), SSM_MUTANT(SSM_MUT_CONV_BLK_BACK, cg[4 * g]), acc);
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(gj - g1), cg[4 * g + 1], acc);
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(gj - 2 * g1), cg[4 * g + 2], acc);
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(gj - 3 * g1), cg[4 * g + 3], acc);
            _mm512_store_ps(dT + g * CONV_BLK_ROWS * 16 + jf * 16, acc);
        }
    }
    /* the other columns (first and last of the sequence), then dG -> rows of d_sx */
    for (int g = 0; g < G; ++g) {
        float * dTg = dT + g * CONV_BLK_ROWS * 16;
        const float * gsg = gs + 16 * g;
        for (int64_t jj = 0; jj < nj; ++jj) {
            if (jj == f_lo && f_hi > f_lo) {
                jj = f_hi - 1;
                continue;
            }
            _mm512_store_ps(dTg + jj * 16, blk_edge_col(gsg, g1, j0 + jj, n_t, K, cg + 4 * g, 0xffff));
        }
        blk_from_tokens(dTg, nj, 16, d_sx + (s * d_inner + i0 + 16 * g) * n_cols + j0, n_cols);
    }
}

/* d_sx of a window's columns for one vector of ni <= 16 channels from i0 */
SSM_INLINE void blk_back_vec(const ssm_conv_params * p, const float * c, const float * grad, float * d_sx,
                             const blk_window * w, int64_t i0, int64_t ni, float * restrict dT) {
    const int64_t d_inner = p->d_inner, K = p->d_conv, n_t = p->n_t, n_cols = K - 1 + n_t;
    const int64_t g0 = p->g_st[0], g1 = p->g_st[1];
    const int64_t s = w->s, j0 = w->t0, nj = w->n;
    __m512 ck[CONV_BLK_MAXK];
    const __mmask16 m = blk_mask(ni);
    blk_taps(p, c, i0, ni, ck);
    const float * gs = grad + s * g0 + i0;
    if (i0 + 16 < w->i_hi)     /* the next vector's lines of grad, or the next window's */
        blk_prefetch_column(gs + 16, g1, ssm_max64(0, j0 - (K - 1)), ssm_min64(n_t, j0 + nj));
    else
        blk_prefetch_column(grad + s * g0 + w->i_lo, g1, ssm_max64(0, j0 + nj - (K - 1)),
                            ssm_min64(n_t, j0 + nj + CONV_BLK_TW));
    /* columns whose d_conv taps all lie in [0, n_t), then the rest */
    const int64_t f_lo = ssm_min64(nj, ssm_max64(0, K - 1 - j0));
    const int64_t f_hi = ssm_max64(f_lo, ssm_min64(nj, n_t - j0));
    int64_t jj = 0;
    if (K == 4 && ni == 16) {
        for (int64_t jf = f_lo; jf < f_hi; ++jf) {
            const float * gj = gs + (j0 + jf) * g1;
            __m512 acc = _mm512_setzero_ps();
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(gj), SSM_MUTANT(SSM_MUT_CONV_BLK_BACK, ck[0]), acc);
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(gj - g1), ck[1], acc);
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(gj - 2 * g1), ck[2], acc);
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(gj - 3 * g1), ck[3], acc);
            _mm512_store_ps(dT + jf * 16, acc);
        }
    }
    for (; jj < nj; ++jj) {
        if (K == 4 && ni == 16 && jj == f_lo && f_hi > f_lo) {   /* done above */
            jj = f_hi - 1;
            continue;
        }
        _mm512_store_ps(dT + jj * 16, blk_edge_col(gs, g1, j0 + jj, n_t, K, ck, m));
    }
    /* token-major dT -> rows of d_sx, 16 x 16 at a time */
    blk_from_tokens(dT, nj, ni, d_sx + (s * d_inner + i0) * n_cols + j0, n_cols);
}

/* Backward w.r.t. sx: d_sx[s, i, j] = sum_k grad[s, j - k, i] * c[i, k], 0 <= j - k < n_t */
static void blk_conv_back(const ssm_conv_params * p, const float * c, const float * grad, float * d_sx,
                                 int ith, int nth, float * restrict dT) {
    const int64_t n_s = p->n_s, K = p->d_conv, n_cols = K - 1 + p->n_t;
    blk_window w;
    ssm_split(p->d_inner, ith, nth, &w.i_lo, &w.i_hi);

    for (w.s = 0; w.s < n_s; ++w.s)
        for (w.t0 = 0; w.t0 < n_cols; w.t0 += CONV_BLK_TW) {
            w.n = ssm_min64(CONV_BLK_TW, n_cols - w.t0);
            for (int64_t i0 = w.i_lo, ni; i0 < w.i_hi; i0 += ni) {
                if (K == 4 && w.i_hi - i0 >= 16 * CONV_BLK_G) {
                    /* a group of CONV_BLK_G full vectors of channels */
                    ni = 16 * CONV_BLK_G;
                    blk_back_group(p, c, grad, d_sx, &w, i0, dT);
                } else {
                    ni = ssm_min64(16, w.i_hi - i0);
                    blk_back_vec(p, c, grad, d_sx, &w, i0, ni, dT);
                }
            }
        }
}

/* d_c of a group of CONV_BLK_G full vectors of channels from i0 (d_conv 4): += the window's sums */
SSM_INLINE void blk_back_weight_group(const ssm_conv_params * p, const float * sx, const float * grad, float * d_c,
                                      const blk_window * w, int64_t i0, float * restrict xT) {
    const int64_t K = p->d_conv, n_t = p->n_t;
    const int64_t s0 = p->sx_st[0], s1 = p->sx_st[1], g0 = p->g_st[0], g1 = p->g_st[1];
    const int64_t s = w->s, t0 = w->t0, nt = w->n;
    const int G = CONV_BLK_G, ni = 16 * G;
    float part[CONV_BLK_MAXK * 16] __attribute__((aligned(64)));
    for (int g = 0; g < G; ++g)
        blk_to_tokens(sx + s * s0 + (i0 + 16 * g) * s1 + t0, s1, 16, nt + K - 1, xT + g * CONV_BLK_ROWS * 16);
    const float * gs = grad + s * g0 + t0 * g1 + i0;
    /* the rows of grad the next group reads (or the first group of the next
     * window), a row per token, G lines each: one burst is too many misses */
    const int nxt = i0 + 2 * ni <= w->i_hi;
    const float * pf = nxt ? gs + ni : grad + s * g0 + (t0 + nt) * g1 + w->i_lo;
    const int64_t pf_n = nxt ? nt : ssm_min64(nt, n_t - t0 - nt);
    __m512 a[4 * CONV_BLK_G];
    for (int q = 0; q < 4 * G; ++q) a[q] = _mm512_setzero_ps();
    for (int64_t t = 0; t < nt; ++t) {
        if (t < pf_n)
            for (int g = 0; g < G; ++g) _mm_prefetch((const char *) (pf + 16 * g + t * g1), _MM_HINT_T0);
        for (int g = 0; g < G; ++g) {
            const __m512 gv = _mm512_loadu_ps(gs + t * g1 + 16 * g);
            const float * xg = xT + g * CONV_BLK_ROWS * 16 + t * 16;
            a[4 * g] = _mm512_fmadd_ps(gv, _mm512_load_ps(xg), a[4 * g]);
            a[4 * g + 1] = _mm512_fmadd_ps(gv, _mm512_load_ps(xg + 16), a[4 * g + 1]);
            a[4 * g + 2] = _mm512_fmadd_ps(gv, _mm512_load_ps(xg + 32), a[4 * g + 2]);
            a[4 * g + 3] = _mm512_fmadd_ps(gv, _mm512_load_ps(xg + 48), a[4 * g + 3]);
        }
    }
    for (int g = 0; g < G; ++g) {
        for (int k = 0; k < 4; ++k) _mm512_store_ps(part + 16 * k, a[4 * g + k]);
        for (int64_t ii = 0; ii < 16; ++ii)
            for (int64_t k = 0; k < 4; ++k)
                d_c[(i0 + 16 * g + ii) * K + k] += SSM_MUTANT(SSM_MUT_CONV_BLK_BACK_WEIGHT, part[16 * k + ii]);
    }
}

/* d_c of one vector of ni <= 16 channels from i0: += the window's sums */
SSM_INLINE void blk_back_weight_vec(const ssm_conv_params * p, const float * sx, const float * grad, float * d_c,
                                    const blk_window * w, int64_t i0, int64_t ni, float * restrict xT) {
    const int64_t K = p->d_conv, n_t = p->n_t;
    const int64_t s0 = p->sx_st[0], s1 = p->sx_st[1], g0 = p->g_st[0], g1 = p->g_st[1];
    const int64_t s = w->s, t0 = w->t0, nt = w->n;
    float part[CONV_BLK_MAXK * 16] __attribute__((aligned(64)));
    const __mmask16 m = blk_mask(ni);
    blk_to_tokens(sx + s * s0 + i0 * s1 + t0, s1, ni, nt + K - 1, xT);
    const float * gs = grad + s * g0 + t0 * g1 + i0;
    if (i0 + 16 < w->i_hi)     /* the next vector's lines of grad, or the next window's */
        blk_prefetch_column(gs + 16, g1, 0, nt);
    else
        blk_prefetch_column(grad + s * g0 + (t0 + nt) * g1 + w->i_lo, g1, 0, ssm_min64(CONV_BLK_TW, n_t - t0 - nt));
    if (K == 4) {
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t t = 0; t < nt; ++t) {
            const __m512 g = _mm512_maskz_loadu_ps(m, gs + t * g1);
            a0 = _mm512_fmadd_ps(g, _mm512_load_ps(xT + t * 16), a0);
            a1 = _mm512_fmadd_ps(g, _mm512_load_ps(xT + (t + 1) * 16), a1);
            a2 = _mm512_fmadd_ps(g, _mm512_load_ps(xT + (t + 2) * 16), a2);
            a3 = _mm512_fmadd_ps(g, _mm512_load_ps(xT + (t + 3) * 16), a3);
        }
        _mm512_store_ps(part, a0);
        _mm512_store_ps(part + 16, a1);
        _mm512_store_ps(part + 32, a2);
        _mm512_store_ps(part + 48, a3);
    } else {
        for (int64_t k = 0; k < K; ++k) {
            __m512 a = _mm512_setzero_ps();
            for (int64_t t = 0; t < nt; ++t)
                a = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, gs + t * g1), _mm512_load_ps(xT + (t + k) * 16), a);
            _mm512_store_ps(part + 16 * k, a);
        }
    }
    for (int64_t ii = 0; ii < ni; ++ii)
        for (int64_t k = 0; k < K; ++k)
            d_c[(i0 + ii) * K + k] += SSM_MUTANT(SSM_MUT_CONV_BLK_BACK_WEIGHT, part[16 * k + ii]);
}

/* Backward w.r.t. c: d_c[i, k] = sum_s sum_t grad[s, t, i] * sx[s, i, t + k] */
static void blk_conv_back_weight(const ssm_conv_params * p, const float * sx, const float * grad,
                                        float * d_c, int ith, int nth, float * restrict xT) {
    const int64_t n_s = p->n_s, K = p->d_conv, n_t = p->n_t;
    blk_window w;
    ssm_split(p->d_inner, ith, nth, &w.i_lo, &w.i_hi);
    for (int64_t i = w.i_lo; i < w.i_hi; ++i)
        for (int64_t k = 0; k < K; ++k) d_c[i * K + k] = 0;

    for (w.s = 0; w.s < n_s; ++w.s)
        for (w.t0 = 0; w.t0 < n_t; w.t0 += CONV_BLK_TW) {
            w.n = ssm_min64(CONV_BLK_TW, n_t - w.t0);
            for (int64_t i0 = w.i_lo, ni; i0 < w.i_hi; i0 += ni) {
                if (K == 4 && w.i_hi - i0 >= 16 * CONV_BLK_G) {
                    /* a group of CONV_BLK_G full vectors of channels */
                    ni = 16 * CONV_BLK_G;
                    blk_back_weight_group(p, sx, grad, d_c, &w, i0, xT);
                } else {
                    ni = ssm_min64(16, w.i_hi - i0);
                    blk_back_weight_vec(p, sx, grad, d_c, &w, i0, ni, xT);
                }
            }
        }
}

/* ... and whether they take this one: also contiguous rows where they read them, and the
 * caller's scratch (work may be NULL only where ssm_conv_work_size is 0; the loops of
 * ssm_conv_body.h give the same bits) */
static int blk_takes(const ssm_conv_params * p, const void * work, int need_sx, int need_g) {
    return work && blk_may_take(p) && (!need_sx || p->sx_st[2] == 1) && (!need_g || p->g_st[2] == 1);
}

SSM_INLINE float * blk_buf(void * work, int ith) { return (float *) ((char *) work + BLK_BUF_BYTES * (size_t) ith); }

/* Each takes a call (returns 1) or leaves it to ssm_conv_body.h's loops (returns 0). Not inlined
 * into those loops: inlined, they changed how GCC contracts the loops' multiply-adds (the bits
 * of d_sx at a few columns with SSM_SIMD_V4_NO_VEC64). */
__attribute__((noinline))
static int blk_conv_fwd_take(const ssm_conv_params * p, const float * sx, const float * c, float * y, void * work,
                             int ith, int nth) {
    if (!blk_takes(p, work, 1, 0)) return 0;
    blk_conv_fwd(p, sx, c, y, ith, nth, blk_buf(work, ith));
    return 1;
}

__attribute__((noinline))
static int blk_conv_back_take(const ssm_conv_params * p, const float * c, const float * grad, float * d_sx,
                              void * work, int ith, int nth) {
    if (!blk_takes(p, work, 0, 1)) return 0;
    blk_conv_back(p, c, grad, d_sx, ith, nth, blk_buf(work, ith));
    return 1;
}

__attribute__((noinline))
static int blk_conv_back_weight_take(const ssm_conv_params * p, const float * sx, const float * grad,
                                     float * d_c, void * work, int ith, int nth) {
    if (!blk_takes(p, work, 1, 1)) return 0;
    blk_conv_back_weight(p, sx, grad, d_c, ith, nth, blk_buf(work, ith));
    return 1;
}

#endif /* SSM_CONV_BLK_BODY_H */
