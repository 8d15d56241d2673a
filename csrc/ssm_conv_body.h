/*
 * ssm_conv_body.h -- SSM_CONV forward and both backward kernels (d_sx and d_c), written once for
 * `real`; an instantiation file (csrc/inst/ssm_conv_<type>_v<N>.c) includes it after the element
 * type's header and exports ssm_conv, ssm_conv_back and ssm_conv_back_weight under full names.
 *
 * sx holds a channel's tokens contiguously, y and grad hold a token's channels contiguously:
 * every kernel turns one into the other. They work on tiles of LANES channels (one 64-byte
 * vector) by a window of tokens, sum along time in contiguous rows, and move between the two
 * layouts with an in-register LANES x LANES transpose. For float32 at level 4 (AVX-512) the
 * cache-blocked kernels of ssm_conv_blk_body.h take the calls they can (the same bits).
 */
#ifndef SSM_CONV_BODY_H
#define SSM_CONV_BODY_H

#ifndef SSM_REAL_H
#error "include ssm_real_f32.h or ssm_real_f64.h first"
#endif

#define SSM_CONV_BLK (SSM_LEVEL >= 4 && REAL_LANES == 16)
#if SSM_CONV_BLK
#include "ssm_conv_blk_body.h"
#endif

/* tokens in a tile's window: 16 channels x 512 floats is 32 KiB, an L1's worth. The forward
 * walks shorter windows across all channels, which keeps its scattered writes to y within a
 * few hundred KiB. */
#define CONV_TW 512
#define CONV_TW_FWD 64

#define LANES ((int) (64 / sizeof(real)))
typedef real cvec __attribute__((vector_size(64)));
typedef real cvec_u __attribute__((vector_size(64), aligned(sizeof(real))));   /* unaligned */
#if (REAL_LANES == 16)
typedef int32_t cvec_i __attribute__((vector_size(64)));
#define T_MASK(F, b) F(0, b), F(1, b), F(2, b), F(3, b), F(4, b), F(5, b), F(6, b), F(7, b), \
                     F(8, b), F(9, b), F(10, b), F(11, b), F(12, b), F(13, b), F(14, b), F(15, b)
#else
typedef int64_t cvec_i __attribute__((vector_size(64)));
#define T_MASK(F, b) F(0, b), F(1, b), F(2, b), F(3, b), F(4, b), F(5, b), F(6, b), F(7, b)
#endif
/* a stage swaps the b-lane blocks of row pairs (i, i+b): after b = 1, 2, 4, ... the rows are
 * transposed */
#define T_LO(j, b) (((j) & (b)) ? LANES + (j) - (b) : (j))
#define T_HI(j, b) (((j) & (b)) ? LANES + (j) : (j) + (b))
#define T_STAGE(b)                                                                          \
    do {                                                                                    \
        for (int i = 0; i < LANES; ++i)                                                     \
            if (!(i & (b))) {                                                               \
                const cvec u = r[i], w = r[i + (b)];                                    \
                r[i] = SSM_SHUFFLE2(cvec_i, u, w, T_MASK(T_LO, b));                    \
                r[i + (b)] = SSM_SHUFFLE2(cvec_i, u, w, T_MASK(T_HI, b));              \
            }                                                                               \
    } while (0)

/* r[i][j] <- r[j][i] */
SSM_INLINE void ssm_transpose(cvec * r) {
    T_STAGE(1);
    T_STAGE(2);
    T_STAGE(4);
#if (REAL_LANES == 16)
    T_STAGE(8);
#endif
}
#undef T_STAGE
#undef T_LO
#undef T_HI
#undef T_MASK

/* LANES rows of src (row stride ld) at columns [0, LANES) -> LANES rows of dst (row stride
 * ldd), transposed. Unaligned on both sides. */
SSM_INLINE void ssm_transpose_tile(const real * src, int64_t ld, real * dst, int64_t ldd) {
    cvec r[LANES];
    for (int i = 0; i < LANES; ++i) r[i] = *(const cvec_u *) (src + i * ld);
    ssm_transpose(r);
    for (int i = 0; i < LANES; ++i) *(cvec_u *) (dst + i * ldd) = r[i];
}

/* grad[s, t0 + w, i0 + ii] for w < nw, ii < ni -> buf[ii * CONV_TW + w]; tokens outside
 * [0, n_t) are not touched */
SSM_INLINE void ssm_gather_grad(const ssm_conv_params * p, const real * grad, int64_t s, int64_t i0,
                                      int64_t ni, int64_t t0, int64_t nw, real * buf) {
    const int64_t g0 = p->g_st[0], g1 = p->g_st[1], g2 = p->g_st[2];
    const int64_t w_lo = ssm_max64(0, -t0), w_hi = ssm_min64(nw, p->n_t - t0);
    int64_t w = w_lo;
    if (ni == LANES && g2 == 1)
        for (; w + LANES <= w_hi; w += LANES)
            ssm_transpose_tile(grad + s * g0 + (t0 + w) * g1 + i0, g1, buf + w, CONV_TW);
    for (; w < w_hi; ++w) {
        const real * gr = grad + s * g0 + (t0 + w) * g1 + i0 * g2;
        for (int64_t ii = 0; ii < ni; ++ii) buf[ii * CONV_TW + w] = gr[ii * g2];
    }
}

/*
 * Forward.
 *   sx (n_s, d_inner, d_conv-1+n_t), c (d_inner, d_conv) -> y (n_s, n_t, d_inner), dense
 *   y[s, t, i] = sum_k sx[s, i, t+k] * c[i, k], summed in increasing k from 0 (as ggml).
 * Thread ith owns channels [i_lo, i_hi). Each LANES-channel x CONV_TW-token tile is computed
 * along time (contiguous in sx) into buf, then written transposed into y.
 */
static void ssm_conv(const ssm_conv_params * p, const real * sx, const real * c,
                   real * y, void * work, int ith, int nth) {
#if SSM_CONV_BLK
    if (blk_conv_fwd_take(p, sx, c, y, work, ith, nth)) return;
#else
    (void) work;
#endif
    const int64_t n_s = p->n_s, d_inner = p->d_inner, d_conv = p->d_conv, n_t = p->n_t;
    const int64_t s0 = p->sx_st[0], s1 = p->sx_st[1], s2 = p->sx_st[2];
    const int64_t TT = CONV_TW_FWD;
    real buf[16 * CONV_TW_FWD] __attribute__((aligned(64)));

    int64_t i_lo, i_hi;
    ssm_split(d_inner, ith, nth, &i_lo, &i_hi);

    for (int64_t s = 0; s < n_s; ++s) {
        for (int64_t t0 = 0; t0 < n_t; t0 += TT) {
            const int64_t nt = ssm_min64(TT, n_t - t0);
            for (int64_t i0 = i_lo; i0 < i_hi; i0 += LANES) {
                const int64_t ni = ssm_min64(LANES, i_hi - i0);
                for (int64_t ii = 0; ii < ni; ++ii) {
                    const real * row = sx + s * s0 + (i0 + ii) * s1 + t0 * s2;
                    const real * ci = c + (i0 + ii) * p->c_st[0];
                    real * b = buf + ii * TT;
                    if (d_conv == 4 && s2 == 1) {
                        /* llama.cpp's d_conv: the four taps held in registers */
                        const real c0 = ci[0], c1 = ci[p->c_st[1]], c2 = ci[2 * p->c_st[1]], c3 = ci[3 * p->c_st[1]];
                        /* in runs of LANES tokens: clang 14 does not vectorize the plain loop
                         * (it forwards row[tt + 1] to the next token as a recurrence) */
                        int64_t tt = 0;
                        for (; tt + LANES <= nt; tt += LANES)
                            for (int j = 0; j < LANES; ++j) {
                                real acc = 0;
                                acc += SSM_MUTANT(SSM_MUT_CONV_FWD, row[tt + j] * c0);
                                acc += row[tt + j + 1] * c1;
                                acc += row[tt + j + 2] * c2;
                                acc += row[tt + j + 3] * c3;
                                b[tt + j] = acc;
                            }
                        for (; tt < nt; ++tt) {
                            real acc = 0;
                            acc += SSM_MUTANT(SSM_MUT_CONV_FWD, row[tt] * c0);
                            acc += row[tt + 1] * c1;
                            acc += row[tt + 2] * c2;
                            acc += row[tt + 3] * c3;
                            b[tt] = acc;
                        }
                    } else {
                        for (int64_t tt = 0; tt < nt; ++tt) b[tt] = 0;
                        for (int64_t k = 0; k < d_conv; ++k) {
                            const real ck = ci[k * p->c_st[1]];
                            for (int64_t tt = 0; tt < nt; ++tt)
                                b[tt] += SSM_MUTANT(SSM_MUT_CONV_FWD, row[(tt + k) * s2] * ck);
                        }
                    }
                }
                int64_t tt = 0;
                if (ni == LANES)
                    for (; tt + LANES <= nt; tt += LANES)
                        ssm_transpose_tile(buf + tt, TT, y + (s * n_t + t0 + tt) * d_inner + i0, d_inner);
                for (; tt < nt; ++tt) {
                    real * yo = y + (s * n_t + t0 + tt) * d_inner + i0;
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
 * summed in increasing k. A tile of grad (LANES channels x a window of tokens) is first
 * gathered transposed, so the sum runs along contiguous rows.
 */
static void ssm_conv_back(const ssm_conv_params * p, const real * c, const real * grad,
                        real * d_sx, void * work, int ith, int nth) {
#if SSM_CONV_BLK
    if (blk_conv_back_take(p, c, grad, d_sx, work, ith, nth)) return;
#else
    (void) work;
#endif
    const int64_t n_s = p->n_s, d_inner = p->d_inner, d_conv = p->d_conv, n_t = p->n_t;
    const int64_t g0 = p->g_st[0], g1 = p->g_st[1], g2 = p->g_st[2];
    const int64_t n_cols = d_conv - 1 + n_t;
    real buf[16 * CONV_TW] __attribute__((aligned(64)));

    int64_t i_lo, i_hi;
    ssm_split(d_inner, ith, nth, &i_lo, &i_hi);

    /* output columns per tile: the window also holds the d_conv-1 tokens before it */
    const int64_t TJ = CONV_TW - (d_conv - 1);
    if (TJ < 16) {
        /* very long kernels: no tiling, read grad where it lies */
        for (int64_t s = 0; s < n_s; ++s)
            for (int64_t i = i_lo; i < i_hi; ++i)
                for (int64_t j = 0; j < n_cols; ++j) {
                    real acc = 0;
                    for (int64_t k = 0; k < d_conv; ++k) {
                        const int64_t t = j - k;
                        if (t >= 0 && t < n_t)
                            acc += SSM_MUTANT(SSM_MUT_CONV_BACK, grad[s * g0 + t * g1 + i * g2]
                                                                     * c[i * p->c_st[0] + k * p->c_st[1]]);
                    }
                    d_sx[(s * d_inner + i) * n_cols + j] = acc;
                }
        return;
    }

    for (int64_t s = 0; s < n_s; ++s) {
        for (int64_t j0 = 0; j0 < n_cols; j0 += TJ) {
            const int64_t nj = ssm_min64(TJ, n_cols - j0);
            for (int64_t i0 = i_lo; i0 < i_hi; i0 += LANES) {
                const int64_t ni = ssm_min64(LANES, i_hi - i0);
                const int64_t tb = j0 - (d_conv - 1);          /* token of buf column 0 */
                ssm_gather_grad(p, grad, s, i0, ni, tb, nj + d_conv - 1, buf);
                for (int64_t ii = 0; ii < ni; ++ii) {
                    real * out = d_sx + (s * d_inner + i0 + ii) * n_cols + j0;
                    const real * b = buf + ii * CONV_TW + (d_conv - 1);
                    const real * ci = c + (i0 + ii) * p->c_st[0];
                    int64_t f_lo = 0, f_hi = 0;       /* columns whose 4 taps all exist */
                    if (d_conv == 4) {
                        f_lo = ssm_max64(0, 3 - j0);
                        f_hi = ssm_max64(f_lo, ssm_min64(nj, n_t - j0));
                        const real c0 = ci[0], c1 = ci[p->c_st[1]], c2 = ci[2 * p->c_st[1]], c3 = ci[3 * p->c_st[1]];
                        for (int64_t jj = f_lo; jj < f_hi; ++jj) {
                            real acc = 0;
                            acc += SSM_MUTANT(SSM_MUT_CONV_BACK, b[jj] * c0);
                            acc += b[jj - 1] * c1;
                            acc += b[jj - 2] * c2;
                            acc += b[jj - 3] * c3;
                            out[jj] = acc;
                        }
                    }
                    /* the rest (all columns when d_conv != 4), tap by tap */
                    for (int64_t jj = 0; jj < f_lo; ++jj) out[jj] = 0;
                    for (int64_t jj = f_hi; jj < nj; ++jj) out[jj] = 0;
                    for (int64_t k = 0; k < d_conv; ++k) {
                        /* only the columns j with a token j-k in [0, n_t): what lies in buf
                         * outside them is stale, and the sum has no such term */
                        const real ck = ci[k * p->c_st[1]];
                        const real * bk = b - k;
                        const int64_t lo = ssm_max64(0, k - j0), hi = ssm_min64(nj, k + n_t - j0);
                        for (int64_t jj = lo; jj < ssm_min64(hi, f_lo); ++jj)
                            out[jj] += SSM_MUTANT(SSM_MUT_CONV_BACK, bk[jj] * ck);
                        for (int64_t jj = ssm_max64(lo, f_hi); jj < hi; ++jj)
                            out[jj] += SSM_MUTANT(SSM_MUT_CONV_BACK, bk[jj] * ck);
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
static void ssm_conv_back_weight(const ssm_conv_params * p, const real * sx, const real * grad,
                               real * d_c, void * work, int ith, int nth) {
#if SSM_CONV_BLK
    if (blk_conv_back_weight_take(p, sx, grad, d_c, work, ith, nth)) return;
#else
    (void) work;
#endif
    const int64_t n_s = p->n_s, d_inner = p->d_inner, d_conv = p->d_conv, n_t = p->n_t;
    const int64_t s0 = p->sx_st[0], s1 = p->sx_st[1], s2 = p->sx_st[2];
    const int64_t TT = CONV_TW;
    real buf[16 * CONV_TW] __attribute__((aligned(64)));

    int64_t i_lo, i_hi;
    ssm_split(d_inner, ith, nth, &i_lo, &i_hi);

    for (int64_t i = i_lo; i < i_hi; ++i)
        for (int64_t k = 0; k < d_conv; ++k) d_c[i * d_conv + k] = 0;

    for (int64_t i0 = i_lo; i0 < i_hi; i0 += LANES) {
        const int64_t ni = ssm_min64(LANES, i_hi - i0);
        for (int64_t s = 0; s < n_s; ++s) {
            for (int64_t t0 = 0; t0 < n_t; t0 += TT) {
                const int64_t nt = ssm_min64(TT, n_t - t0);
                ssm_gather_grad(p, grad, s, i0, ni, t0, nt, buf);
                for (int64_t ii = 0; ii < ni; ++ii) {
                    const real * b = buf + ii * TT;
                    const real * row = sx + s * s0 + (i0 + ii) * s1 + t0 * s2;
                    if (d_conv == 4 && s2 == 1 && nt >= SSM_VL) {
                        /* the four taps in one pass: same lanes and order as the loop below */
                        real l0[SSM_VL] = { 0 }, l1[SSM_VL] = { 0 }, l2[SSM_VL] = { 0 }, l3[SSM_VL] = { 0 };
                        int64_t tt = 0;
                        for (; tt + SSM_VL <= nt; tt += SSM_VL)
                            for (int l = 0; l < SSM_VL; ++l) {
                                const real bv = b[tt + l];
                                l0[l] += bv * row[tt + l];
                                l1[l] += bv * row[tt + l + 1];
                                l2[l] += bv * row[tt + l + 2];
                                l3[l] += bv * row[tt + l + 3];
                            }
                        for (; tt < nt; ++tt) {
                            l0[tt % SSM_VL] += b[tt] * row[tt];
                            l1[tt % SSM_VL] += b[tt] * row[tt + 1];
                            l2[tt % SSM_VL] += b[tt] * row[tt + 2];
                            l3[tt % SSM_VL] += b[tt] * row[tt + 3];
                        }
                        real * lanes[4] = { l0, l1, l2, l3 };
                        for (int k = 0; k < 4; ++k) {
                            real * lane = lanes[k];
                            for (int w = SSM_VL / 2; w > 0; w /= 2)
                                for (int l = 0; l < w; ++l) lane[l] += lane[l + w];
                            d_c[(i0 + ii) * d_conv + k] += SSM_MUTANT(SSM_MUT_CONV_BACK_WEIGHT, lane[0]);
                        }
                        continue;
                    }
                    for (int64_t k = 0; k < d_conv; ++k) {
                        real lane[SSM_VL] = { 0 };
                        int64_t tt = 0;
                        if (s2 == 1) {
                            const real * r = row + k;
                            for (; tt + SSM_VL <= nt; tt += SSM_VL)
                                for (int l = 0; l < SSM_VL; ++l) lane[l] += b[tt + l] * r[tt + l];
                        }
                        for (; tt < nt; ++tt) lane[tt % SSM_VL] += b[tt] * row[(tt + k) * s2];
                        for (int w = SSM_VL / 2; w > 0; w /= 2)
                            for (int l = 0; l < w; ++l) lane[l] += lane[l + w];
                        d_c[(i0 + ii) * d_conv + k] += SSM_MUTANT(SSM_MUT_CONV_BACK_WEIGHT, lane[0]);
                    }
                }
            }
        }
    }
}

#undef LANES

#endif /* SSM_CONV_BODY_H */
