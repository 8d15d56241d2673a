/*
 * ssm_conv.c -- SSM_CONV forward and both backward kernels (d_sx and d_c).
 *
 * The kernel bodies are written once for a type REAL and compiled for float and double:
 * this file includes itself twice with SSM_TMPL set (see the bottom half).
 */
#ifndef SSM_TMPL

#include "ssm_common.h"

/* Channels per tile and the length of a tile's time window: a 16 x 512 tile of REAL is
 * 32 KiB in float, enough to turn the transposed (t, i) layout of y and grad into
 * contiguous rows without leaving L1/L2. */
#define CONV_CT 16
#define CONV_TW 512

#define SSM_TMPL 1
#define REAL float
#define SFX(name) name##_f32
#include "ssm_conv.c"
#undef REAL
#undef SFX

#define REAL double
#define SFX(name) name##_f64
#include "ssm_conv.c"
#undef REAL
#undef SFX
#undef SSM_TMPL

#else /* SSM_TMPL: the kernels, for one REAL */

/*
 * Forward.
 *   sx (n_s, d_inner, d_conv-1+n_t), c (d_inner, d_conv) -> y (n_s, n_t, d_inner), dense
 *   y[s, t, i] = sum_k sx[s, i, t+k] * c[i, k], summed in increasing k from 0 (as ggml).
 * Thread ith owns channels [i_lo, i_hi). Each 16-channel x TT-token tile is computed along
 * time (contiguous in sx) into buf, then written transposed into y.
 */
SSM_CLONES
void SFX(ssm_conv)(const ssm_conv_params * p, const REAL * sx, const REAL * c,
                   REAL * y, int ith, int nth) {
    const int64_t n_s = p->n_s, d_inner = p->d_inner, d_conv = p->d_conv, n_t = p->n_t;
    const int64_t s0 = p->sx_st[0], s1 = p->sx_st[1], s2 = p->sx_st[2];
    const int64_t TT = CONV_TW;
    REAL buf[CONV_CT * CONV_TW];

    int64_t i_lo, i_hi;
    ssm_split(d_inner, ith, nth, &i_lo, &i_hi);

    for (int64_t s = 0; s < n_s; ++s) {
        for (int64_t i0 = i_lo; i0 < i_hi; i0 += CONV_CT) {
            const int64_t ni = ssm_min64(CONV_CT, i_hi - i0);
            for (int64_t t0 = 0; t0 < n_t; t0 += TT) {
                const int64_t nt = ssm_min64(TT, n_t - t0);
                for (int64_t ii = 0; ii < ni; ++ii) {
                    const REAL * row = sx + s * s0 + (i0 + ii) * s1 + t0 * s2;
                    REAL * b = buf + ii * TT;
                    for (int64_t tt = 0; tt < nt; ++tt) b[tt] = 0;
                    for (int64_t k = 0; k < d_conv; ++k) {
                        const REAL ck = c[(i0 + ii) * p->c_st[0] + k * p->c_st[1]];
                        if (s2 == 1) {
                            const REAL * r = row + k;
                            for (int64_t tt = 0; tt < nt; ++tt) b[tt] += r[tt] * ck;
                        } else {
                            for (int64_t tt = 0; tt < nt; ++tt) b[tt] += row[(tt + k) * s2] * ck;
                        }
                    }
                }
                for (int64_t tt = 0; tt < nt; ++tt) {
                    REAL * yo = y + (s * n_t + t0 + tt) * d_inner + i0;
                    for (int64_t ii = 0; ii < ni; ++ii) yo[ii] = buf[ii * TT + tt];
                }
            }
        }
    }
}

/*
 * Backward w.r.t. sx.
 *   c (d_inner, d_conv), grad (n_s, n_t, d_inner) strided -> d_sx (n_s, d_inner, d_conv-1+n_t), dense
 *   d_sx[s, i, j] = sum_k grad[s, j-k, i] * c[i, k]   over k with 0 <= j-k < n_t,
 * summed in increasing k. A tile of grad (16 channels x a window of tokens) is first
 * gathered transposed, so the sum runs along contiguous rows.
 */
SSM_CLONES
void SFX(ssm_conv_back)(const ssm_conv_params * p, const REAL * c, const REAL * grad,
                        REAL * d_sx, int ith, int nth) {
    const int64_t n_s = p->n_s, d_inner = p->d_inner, d_conv = p->d_conv, n_t = p->n_t;
    const int64_t g0 = p->g_st[0], g1 = p->g_st[1], g2 = p->g_st[2];
    const int64_t n_cols = d_conv - 1 + n_t;
    REAL buf[CONV_CT * CONV_TW];

    int64_t i_lo, i_hi;
    ssm_split(d_inner, ith, nth, &i_lo, &i_hi);

    /* output columns per tile: the window also holds the d_conv-1 tokens before it */
    const int64_t TJ = CONV_TW - (d_conv - 1);
    if (TJ < 16) {
        /* very long kernels: no tiling, read grad where it lies */
        for (int64_t s = 0; s < n_s; ++s)
            for (int64_t i = i_lo; i < i_hi; ++i)
                for (int64_t j = 0; j < n_cols; ++j) {
                    REAL acc = 0;
                    for (int64_t k = 0; k < d_conv; ++k) {
                        const int64_t t = j - k;
                        if (t >= 0 && t < n_t)
                            acc += grad[s * g0 + t * g1 + i * g2] * c[i * p->c_st[0] + k * p->c_st[1]];
                    }
                    d_sx[(s * d_inner + i) * n_cols + j] = acc;
                }
        return;
    }

    for (int64_t s = 0; s < n_s; ++s) {
        for (int64_t i0 = i_lo; i0 < i_hi; i0 += CONV_CT) {
            const int64_t ni = ssm_min64(CONV_CT, i_hi - i0);
            for (int64_t j0 = 0; j0 < n_cols; j0 += TJ) {
                const int64_t nj = ssm_min64(TJ, n_cols - j0);
                const int64_t tb = j0 - (d_conv - 1);          /* token of buf column 0 */
                const int64_t nw = nj + d_conv - 1;
                for (int64_t w = 0; w < nw; ++w) {
                    const int64_t t = tb + w;
                    if (t >= 0 && t < n_t) {
                        const REAL * gr = grad + s * g0 + t * g1 + i0 * g2;
                        for (int64_t ii = 0; ii < ni; ++ii) buf[ii * CONV_TW + w] = gr[ii * g2];
                    } else {
                        for (int64_t ii = 0; ii < ni; ++ii) buf[ii * CONV_TW + w] = 0;
                    }
                }
                for (int64_t ii = 0; ii < ni; ++ii) {
                    REAL * out = d_sx + (s * d_inner + i0 + ii) * n_cols + j0;
                    const REAL * b = buf + ii * CONV_TW + (d_conv - 1);
                    for (int64_t jj = 0; jj < nj; ++jj) out[jj] = 0;
                    for (int64_t k = 0; k < d_conv; ++k) {
                        /* only the columns j with a token j-k in [0, n_t): a zero token times a
                         * non-finite c would be NaN where the sum has no such term */
                        const REAL ck = c[(i0 + ii) * p->c_st[0] + k * p->c_st[1]];
                        const REAL * bk = b - k;
                        const int64_t lo = ssm_max64(0, k - j0), hi = ssm_min64(nj, k + n_t - j0);
                        for (int64_t jj = lo; jj < hi; ++jj) out[jj] += bk[jj] * ck;
                    }
                }
            }
        }
    }
}

/*
 * Backward w.r.t. c.
 *   sx (n_s, d_inner, d_conv-1+n_t), grad (n_s, n_t, d_inner), both strided -> d_c (d_inner, d_conv), dense
 *   d_c[i, k] = sum_s sum_t grad[s, t, i] * sx[s, i, t+k]
 * Each channel's sums belong to one thread. Order, fixed by the shape alone: for each s and
 * each window of tokens, a 16-lane partial sum along t, folded pairwise, added to d_c.
 */
SSM_CLONES
void SFX(ssm_conv_back_weight)(const ssm_conv_params * p, const REAL * sx, const REAL * grad,
                               REAL * d_c, int ith, int nth) {
    const int64_t n_s = p->n_s, d_inner = p->d_inner, d_conv = p->d_conv, n_t = p->n_t;
    const int64_t s0 = p->sx_st[0], s1 = p->sx_st[1], s2 = p->sx_st[2];
    const int64_t g0 = p->g_st[0], g1 = p->g_st[1], g2 = p->g_st[2];
    const int64_t TT = CONV_TW;
    REAL buf[CONV_CT * CONV_TW];

    int64_t i_lo, i_hi;
    ssm_split(d_inner, ith, nth, &i_lo, &i_hi);

    for (int64_t i = i_lo; i < i_hi; ++i)
        for (int64_t k = 0; k < d_conv; ++k) d_c[i * d_conv + k] = 0;

    for (int64_t i0 = i_lo; i0 < i_hi; i0 += CONV_CT) {
        const int64_t ni = ssm_min64(CONV_CT, i_hi - i0);
        for (int64_t s = 0; s < n_s; ++s) {
            for (int64_t t0 = 0; t0 < n_t; t0 += TT) {
                const int64_t nt = ssm_min64(TT, n_t - t0);
                for (int64_t tt = 0; tt < nt; ++tt) {
                    const REAL * gr = grad + s * g0 + (t0 + tt) * g1 + i0 * g2;
                    for (int64_t ii = 0; ii < ni; ++ii) buf[ii * TT + tt] = gr[ii * g2];
                }
                for (int64_t ii = 0; ii < ni; ++ii) {
                    const REAL * b = buf + ii * TT;
                    const REAL * row = sx + s * s0 + (i0 + ii) * s1 + t0 * s2;
                    for (int64_t k = 0; k < d_conv; ++k) {
                        REAL lane[SSM_VL] = {0};
                        int64_t tt = 0;
                        if (s2 == 1) {
                            const REAL * r = row + k;
                            for (; tt + SSM_VL <= nt; tt += SSM_VL)
                                for (int l = 0; l < SSM_VL; ++l) lane[l] += b[tt + l] * r[tt + l];
                        }
                        for (; tt < nt; ++tt) lane[tt % SSM_VL] += b[tt] * row[(tt + k) * s2];
                        for (int w = SSM_VL / 2; w > 0; w /= 2)
                            for (int l = 0; l < w; ++l) lane[l] += lane[l + w];
                        d_c[(i0 + ii) * d_conv + k] += lane[0];
                    }
                }
            }
        }
    }
}

#endif /* SSM_TMPL */
