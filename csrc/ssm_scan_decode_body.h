/*
 * ssm_scan_decode_body.h -- SSM_SCAN forward, the decode path, written once for `real`: calls of at
 * most SSM_DECODE_MAX_T (4) tokens whose rows of s, B, C (and A for Mamba-1) are contiguous
 * (ssm_scan_decode_path), as a generation step runs them. No scratch: the states are updated in
 * the output (or, for the glue's in-place cache update, in s itself).
 *
 *   s (n_rs, n_head, head_dim, d_state), x (n_seqs, n_t, n_head, head_dim), dt (n_seqs, n_t, n_head),
 *   A (n_head, d_state | 1), B, C (n_seqs, n_t, n_group, d_state), ids (n_seqs,)
 *   -> y (n_seqs, n_t, n_head, head_dim), states (K, n_seqs, n_head, head_dim, d_state)
 * per (sequence q, head h, row p) and token t, from H = s[ids[q], h, p]:
 *   H[n] = e^(softplus(dt) A[n]) H[n] + B[n] x softplus(dt),   y = sum_n H[n] C[n]
 *
 * Checked against tests/reference.py's ref_ssm_scan (tests/kernels/test_decode.py, and every scan test
 * with n_t <= 4). ssm_scan (ssm_scan_recurrence_body.h) calls it; the instantiation file exports
 * it alone as ssm_scan_decode_into_<type>_v<N>.
 */
#ifndef SSM_SCAN_DECODE_BODY_H
#define SSM_SCAN_DECODE_BODY_H

#ifndef SSM_REAL_H
#error "include ssm_real_f32.h or ssm_real_f64.h first"
#endif

#include "ssm_scan_rows.h"

#if SSM_DISPATCH || defined(__SSE2__)
#include <immintrin.h>   /* the range test of the decode path's vector code (x86) */
#endif

/* ------------------------------------------------------------------ the decode path
 * (ssm_scan_decode_path): per (sequence, head, row p) and token, on the row's d_state elements
 *   new[n] = old[n] * e^(sp * A) + B[n] * (x * sp),   y = sum_n new[n] * C[n]
 * with the same softplus, exp and state update expressions as the general path (the states come
 * out the same up to the compiler's choice of fused multiply-adds), but y summed along n in
 * SSM_LANES partial sums (n mod SSM_LANES, n increasing) added by a fixed tree at the end: an
 * order that depends on the type and shape only (not on the SIMD level's register width, nor on
 * the thread count), like ggml's own vectorized sum over d_state. */

/* heads whose softplus(dt) (and Mamba-2 decay) are computed together, in vector loops */
#define SSM_DEC_HEADS 64
/* Mamba-1 rows (heads) of one token interleaved by the vector code, so that their chains overlap */
#define SSM_DEC_ROWS 8

SSM_INLINE real ssm_dec_reduce(real * acc) {
#if (REAL_LANES == 16)
    for (int j = 0; j < 8; ++j) acc[j] += acc[j + 8];
#endif
    for (int j = 0; j < 4; ++j) acc[j] += acc[j + 4];
    for (int j = 0; j < 2; ++j) acc[j] += acc[j + 2];
    return acc[0] + acc[1];
}

/* m (<= SSM_LANES) states from n0 of one row: dst = src * a + B * xdt (dst may be src: the
 * row is read into hv before any store), acc[j] += dst[j] * C[j]. Mamba-2: a[j] = a2 for every
 * j; Mamba-1 (per_state): a[j] = e^(sp * A[j]) by real_exp_poly_fast where every argument of the m states
 * is in its range (then equal to real_exp_poly bit for bit), else real_exp_poly */
SSM_INLINE void ssm_dec_lanes(const int m, const int per_state, const real * src, real * dst,
                                    real sp, real a2, real xdt, const real * restrict Ar,
                                    const real * restrict Bv, const real * restrict Cv, real * restrict acc) {
    real hv[SSM_LANES], a[SSM_LANES];
    for (int j = 0; j < m; ++j) hv[j] = src[j];
    if (per_state) {
        real z[SSM_LANES];
        int bad = 0;
        for (int j = 0; j < m; ++j) {
            z[j] = sp * Ar[j];
            bad |= !(z[j] <= REAL_EXP_FAST_MAX && z[j] >= -REAL_EXP_FAST_MAX);
        }
        if (!bad)
            for (int j = 0; j < m; ++j) a[j] = real_exp_poly_fast(z[j]);
        else
            for (int j = 0; j < m; ++j) a[j] = real_exp_poly(z[j]);
    } else {
        for (int j = 0; j < m; ++j) a[j] = a2;
    }
    for (int j = 0; j < m; ++j) {
        const real h = hv[j] * a[j] + SSM_MUTANT(SSM_MUT_SCAN_DECODE, Bv[j] * xdt);
        dst[j] = h;
        acc[j] += h * Cv[j];
    }
}

/*
 * The same step of SSM_LANES states in vector types for the x86 passes, SSM_DEC_VB bytes wide (AVX-512: 64, AVX2: 32,
 * SSE2: 16; SSM_LANES states are SSM_DEC_NSUB such vectors), where GCC left the array
 * loops above partly scalar (measured: Mamba-1's 16-state rows 3x slower): the same operations in
 * the same order per lane, the exp as real_exp_poly_fast written on vectors, real_exp_poly lane by lane for a
 * vector with an argument out of real_exp_poly_fast's range, and the same tree for the sum over lanes, so
 * every pass gives the bits of the array loops (up to the compiler's fused multiply-adds).
 */
#if SSM_LEVEL >= 4
#define SSM_DEC_VB 64
#define SSM_DEC_VEC(simd) ssm_vec64(simd)
#elif SSM_LEVEL == 3
#define SSM_DEC_VB 32
#define SSM_DEC_VEC(simd) 1
#elif defined(__SSE2__)
#define SSM_DEC_VB 16
#define SSM_DEC_VEC(simd) 1
#endif

#ifdef SSM_DEC_VB
#define SSM_DEC_NSUB (64 / SSM_DEC_VB)
#if (REAL_LANES == 16)                   /* lanes per vector (a preprocessor number: no sizeof) */
#define SSM_DEC_DL (SSM_DEC_VB / 4)
#else
#define SSM_DEC_DL (SSM_DEC_VB / 8)
#endif
typedef real dvec __attribute__((vector_size(SSM_DEC_VB)));
#if (REAL_LANES == 16)
typedef uint32_t duvec __attribute__((vector_size(SSM_DEC_VB)));
typedef int32_t divec __attribute__((vector_size(SSM_DEC_VB)));
#define SSM_DEC_EXP_BIAS 0x4B400000u
#define SSM_DEC_EXP_SHL 23
#else
typedef uint64_t duvec __attribute__((vector_size(SSM_DEC_VB)));
typedef int64_t divec __attribute__((vector_size(SSM_DEC_VB)));
#define SSM_DEC_EXP_BIAS 0x4338000000000000ull
#define SSM_DEC_EXP_SHL 52
#endif

SSM_INLINE dvec ssm_dec_vload(const real * ptr) {
    dvec v;
    memcpy(&v, ptr, sizeof v);
    return v;
}

/* whether every lane of z is within real_exp_poly_fast's range (false for NaN) */
SSM_INLINE int ssm_dec_in_range(dvec z) {
#if SSM_DEC_VB == 64 && (REAL_LANES == 16)
    return _mm512_cmp_ps_mask(_mm512_abs_ps((__m512) z), _mm512_set1_ps(REAL_EXP_FAST_MAX), _CMP_LE_OQ) == 0xFFFF;
#elif SSM_DEC_VB == 64
    return _mm512_cmp_pd_mask(_mm512_abs_pd((__m512d) z), _mm512_set1_pd(REAL_EXP_FAST_MAX), _CMP_LE_OQ) == 0xFF;
#elif SSM_DEC_VB == 32 && (REAL_LANES == 16)
    const __m256 a = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), (__m256) z);
    return _mm256_movemask_ps(_mm256_cmp_ps(a, _mm256_set1_ps(REAL_EXP_FAST_MAX), _CMP_LE_OQ)) == 0xFF;
#elif SSM_DEC_VB == 32
    const __m256d a = _mm256_andnot_pd(_mm256_set1_pd(-0.0), (__m256d) z);
    return _mm256_movemask_pd(_mm256_cmp_pd(a, _mm256_set1_pd(REAL_EXP_FAST_MAX), _CMP_LE_OQ)) == 0xF;
#elif (REAL_LANES == 16)
    const __m128 a = _mm_andnot_ps(_mm_set1_ps(-0.0f), (__m128) z);
    return _mm_movemask_ps(_mm_cmple_ps(a, _mm_set1_ps(REAL_EXP_FAST_MAX))) == 0xF;
#else
    const __m128d a = _mm_andnot_pd(_mm_set1_pd(-0.0), (__m128d) z);
    return _mm_movemask_pd(_mm_cmple_pd(a, _mm_set1_pd(REAL_EXP_FAST_MAX))) == 0x3;
#endif
}

/* ssm_expf_fast / ssm_exp_fast_f64 on a vector (the same expressions) */
SSM_INLINE dvec ssm_dec_vexp_fast(dvec x) {
    typedef dvec vec;
    typedef duvec uvec;
#if (REAL_LANES == 16)
    const vec kf = x * 1.44269504088896341f + SSM_EXPF_SHIFT;
    const vec k = kf - SSM_EXPF_SHIFT;
    const vec p = SSM_EXPF_POLY(vec, x, k);
#else
    const vec kf = x * 1.4426950408889634074 + SSM_EXP_SHIFT;
    const vec k = kf - SSM_EXP_SHIFT;
    const vec p = SSM_EXP_POLY_F64(vec, x, k);
#endif
    const uvec bits = (uvec) p + (((uvec) kf - SSM_DEC_EXP_BIAS) << SSM_DEC_EXP_SHL);
    return (vec) bits;
}

/* the tree of ssm_dec_reduce on SSM_LANES states' SSM_DEC_NSUB vectors (lane j of vector u is
 * lane u * SSM_DEC_DL + j of the SSM_LANES): each fold adds lane j + w to lane j, j < w */
SSM_INLINE real ssm_dec_vreduce(dvec * acc) {
    for (int w = SSM_DEC_NSUB / 2; w >= 1; w /= 2)      /* folds across vectors */
        for (int u = 0; u < w; ++u) acc[u] += acc[u + w];
    dvec v = acc[0];
#if SSM_DEC_DL == 16
    v = v + SSM_SHUFFLE2(divec, v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v = v + SSM_SHUFFLE2(divec, v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    v = v + SSM_SHUFFLE2(divec, v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
#elif SSM_DEC_DL == 8
    v = v + SSM_SHUFFLE2(divec, v, v, 4, 5, 6, 7, 0, 1, 2, 3);
    v = v + SSM_SHUFFLE2(divec, v, v, 2, 3, 0, 1, 6, 7, 4, 5);
#elif SSM_DEC_DL == 4
    return (v[0] + v[2]) + (v[1] + v[3]);
#endif
    return v[0] + v[1];
}

/* one token of R rows (R = 1 or SSM_DEC_ROWS) whose d_state is a multiple of SSM_LANES, and which
 * share B and C (one group); the rows are interleaved only so that their dependency chains
 * overlap, each row's operations are those of a row alone. y[r] of each row. */
SSM_INLINE void ssm_dec_rows_vec(const int R, const int per_state, const int64_t ds,
                                       const real * const * src, real * const * dst, const real * sp,
                                       const real * a2, const real * xdt, const real * const * Ar,
                                       const real * Bv, const real * Cv, real * y) {
    typedef dvec vec;
    vec acc[SSM_DEC_ROWS][SSM_DEC_NSUB];
    for (int r = 0; r < R; ++r)
        for (int u = 0; u < SSM_DEC_NSUB; ++u) acc[r][u] = (vec) { 0 };
    for (int64_t n0 = 0; n0 < ds; n0 += SSM_LANES)
        for (int u = 0; u < SSM_DEC_NSUB; ++u) {
            const int64_t n = n0 + u * SSM_DEC_DL;
            const vec bv = ssm_dec_vload(Bv + n), cv = ssm_dec_vload(Cv + n);
            for (int r = 0; r < R; ++r) {
                const vec hv = ssm_dec_vload(src[r] + n);
                vec a;
                if (per_state) {
                    const vec z = sp[r] * ssm_dec_vload(Ar[r] + n);
                    if (ssm_dec_in_range(z)) a = ssm_dec_vexp_fast(z);
                    else {
                        a = z;
                        for (int j = 0; j < SSM_DEC_DL; ++j) a[j] = real_exp_poly(z[j]);
                    }
                } else {
                    a = (vec) { 0 } + a2[r];
                }
                const vec h = hv * a + SSM_MUTANT(SSM_MUT_SCAN_DECODE, bv * xdt[r]);
                memcpy(dst[r] + n, &h, sizeof h);
                acc[r][u] += h * cv;
            }
        }
    for (int r = 0; r < R; ++r) y[r] = ssm_dec_vreduce(acc[r]);
}

SSM_INLINE real ssm_dec_row_vec(const int per_state, const int64_t ds, const real * src, real * dst,
                                      real sp, real a2, real xdt, const real * Ar, const real * Bv,
                                      const real * Cv) {
    real y;
    ssm_dec_rows_vec(1, per_state, ds, &src, &dst, &sp, &a2, &xdt, &Ar, Bv, Cv, &y);
    return y;
}
#undef SSM_DEC_EXP_BIAS
#undef SSM_DEC_EXP_SHL
#endif /* SSM_DEC_VB */

/* one token of one row (dst may be src: in place); returns y */
SSM_INLINE real ssm_dec_row(const int vec, const int per_state, const int64_t ds, const real * src, real * dst,
                                  real sp, real a2, real xdt, const real * Ar, const real * Bv, const real * Cv) {
    const int64_t nv = ds / SSM_LANES * SSM_LANES;
#ifdef SSM_DEC_VB
    if (vec && nv == ds) return ssm_dec_row_vec(per_state, ds, src, dst, sp, a2, xdt, Ar, Bv, Cv);
#else
    (void) vec;
#endif
    real acc[SSM_LANES];
    for (int j = 0; j < SSM_LANES; ++j) acc[j] = 0;
    for (int64_t n0 = 0; n0 < nv; n0 += SSM_LANES)
        ssm_dec_lanes(SSM_LANES, per_state, src + n0, dst + n0, sp, a2, xdt, Ar + n0, Bv + n0, Cv + n0, acc);
    if (nv < ds)
        ssm_dec_lanes((int) (ds - nv), per_state, src + nv, dst + nv, sp, a2, xdt, Ar + nv, Bv + nv,
                           Cv + nv, acc);
    return ssm_dec_reduce(acc);
}

/* what the decode path of one sequence reads and writes: sq = s's rows of its state (ids[q]) */
typedef struct {
    const real * sq, * x, * A, * B, * C;
    real * y_out, * st_out;
} ssm_dec_io;

/* softplus(dt) of heads [h0, h0 + nb) of sequence q at every token, to sp[t * SSM_DEC_HEADS + j],
 * and for Mamba-2 (!per_state) their decays e^(sp A) to ar likewise */
SSM_INLINE void ssm_dec_softplus(const ssm_scan_params * p, int64_t q, int64_t h0, int64_t nb, const real * dt,
                                 const real * A, const int per_state, real * sp, real * ar) {
    const int64_t d0 = p->dt_st[0], d1 = p->dt_st[1], d2 = p->dt_st[2], A0 = p->A_st[0];
    for (int64_t t = 0; t < p->n_t; ++t) {
        const real * d = dt + q * d0 + t * d1 + h0 * d2;
        real * restrict spt = sp + t * SSM_DEC_HEADS;
        for (int64_t j = 0; j < nb; ++j) spt[j] = d[j * d2];
        ssm_softplus_n(spt, nb);
        if (!per_state) {
            real * restrict art = ar + t * SSM_DEC_HEADS;
            for (int64_t j = 0; j < nb; ++j) art[j] = real_exp_poly(spt[j] * A[(h0 + j) * A0]);
        }
    }
}

#ifdef SSM_DEC_VB
/* Mamba-1 as llama.cpp and transformers run it (one row per head, one token, d_state a multiple of
 * SSM_LANES): heads [h0, h1) of sequence q, SSM_DEC_ROWS heads of one group at a time (sp: theirs
 * from h0) */
SSM_INLINE void ssm_dec_m1_rows(const ssm_scan_params * p, const ssm_dec_io * io, int64_t q, int64_t h0,
                                int64_t h1, const real * sp) {
    const int64_t n_head = p->n_head, ds = p->d_state, n_seqs = p->n_seqs, K = p->K;
    const int64_t hpg = ssm_heads_per_group(p);
    const int64_t s1 = p->s_st[1], x0 = p->x_st[0], x2 = p->x_st[2], A0 = p->A_st[0];
    for (int64_t h = h0; h < h1;) {
        const int64_t g = h / hpg;
        const int R = h + SSM_DEC_ROWS <= h1 && (h + SSM_DEC_ROWS - 1) / hpg == g ? SSM_DEC_ROWS : 1;
        const real * srcs[SSM_DEC_ROWS], * Ars[SSM_DEC_ROWS];
        real * dsts[SSM_DEC_ROWS];
        real sps[SSM_DEC_ROWS], xdts[SSM_DEC_ROWS], a0s[SSM_DEC_ROWS] = { 0 };
        for (int r = 0; r < R; ++r) {
            srcs[r] = io->sq + (h + r) * s1;
            dsts[r] = io->st_out + (q * n_head + h + r) * ds;
            Ars[r] = io->A + (h + r) * A0;
            sps[r] = sp[h + r - h0];
            xdts[r] = io->x[q * x0 + (h + r) * x2] * sps[r];
        }
        const real * Bv = io->B + q * p->B_st[0] + g * p->B_st[2], * Cv = io->C + q * p->C_st[0] + g * p->C_st[2];
        real * yv = io->y_out + q * n_head + h;
        if (R == SSM_DEC_ROWS)
            ssm_dec_rows_vec(SSM_DEC_ROWS, 1, ds, srcs, dsts, sps, a0s, xdts, Ars, Bv, Cv, yv);
        else ssm_dec_rows_vec(1, 1, ds, srcs, dsts, sps, a0s, xdts, Ars, Bv, Cv, yv);
        for (int r = 0; r < R; ++r)   /* slots no token reaches: none for K = 1 */
            for (int64_t k = 1; k < K; ++k)
                memset(io->st_out + ((k * n_seqs + q) * n_head + h + r) * ds, 0, ds * sizeof(real));
        h += R;
    }
}
#endif

/* heads [h0, h1) of sequence q, row by row and token by token (sp, ar: theirs from h0, as
 * ssm_dec_softplus wrote them); vec: the pass's vector code where it has one */
SSM_INLINE void ssm_dec_heads(const ssm_scan_params * p, const ssm_dec_io * io, int64_t q, int64_t h0, int64_t h1,
                              const real * sp, const real * ar, const int vec, const int per_state) {
    const int64_t n_head = p->n_head, hd = p->head_dim, ds = p->d_state;
    const int64_t n_t = p->n_t, n_seqs = p->n_seqs, K = p->K;
    const int64_t hpg = ssm_heads_per_group(p);
    const int64_t s1 = p->s_st[1], s2 = p->s_st[2];
    const int64_t x0 = p->x_st[0], x1 = p->x_st[1], x2 = p->x_st[2], x3 = p->x_st[3], A0 = p->A_st[0];
    const int64_t B0 = p->B_st[0], B1 = p->B_st[1], B2 = p->B_st[2];
    const int64_t C0 = p->C_st[0], C1 = p->C_st[1], C2 = p->C_st[2];
    int64_t g = h0 / hpg, g_end = (g + 1) * hpg;
    for (int64_t h = h0; h < h1; ++h) {
        const int64_t j = h - h0;
        if (h == g_end) {
            ++g;
            g_end += hpg;
        }
        const real * src = io->sq + h * s1;
        real * dst = io->st_out + (q * n_head + h) * hd * ds;
        const real * Ar = io->A + h * A0;
        const real * xh = io->x + q * x0 + h * x2;
        for (int64_t t = 0; t < n_t; ++t) {
            const real spv = sp[t * SSM_DEC_HEADS + j];
            const real a = per_state ? 0 : ar[t * SSM_DEC_HEADS + j];
            const real * Bv = io->B + q * B0 + t * B1 + g * B2;
            const real * Cv = io->C + q * C0 + t * C1 + g * C2;
            real * yt = io->y_out + ((q * n_t + t) * n_head + h) * hd;
            for (int64_t pp = 0; pp < hd; ++pp) {
                const real xdt = xh[t * x1 + pp * x3] * spv;
                real * row = dst + pp * ds;
                yt[pp] = ssm_dec_row(vec, per_state, ds, t == 0 ? src + pp * s2 : row, row, spv, a, xdt,
                                          Ar, Bv, Cv);
            }
            const int64_t k = n_t - 1 - t;     /* this state is snapshot slot k */
            if (k >= 1 && k < K)
                memcpy(io->st_out + ((k * n_seqs + q) * n_head + h) * hd * ds, dst, hd * ds * sizeof(real));
        }
        for (int64_t k = n_t; k < K; ++k)   /* slots no token reaches (n_t >= 1 here) */
            memset(io->st_out + ((k * n_seqs + q) * n_head + h) * hd * ds, 0, hd * ds * sizeof(real));
    }
}

/* the decode path for the (sequence, head) pairs [u_lo, u_hi), per_state = p->a_per_state */
SSM_INLINE void ssm_scan_decode_impl(const ssm_scan_params * p, const real * s, const real * x,
                                           const real * dt, const real * A, const real * B, const real * C,
                                           const int64_t * ids, real * y_out, real * st_out, int64_t u_lo,
                                           int64_t u_hi, const int per_state) {
    const int64_t n_head = p->n_head;
    real sp[SSM_DECODE_MAX_T * SSM_DEC_HEADS], ar[SSM_DECODE_MAX_T * SSM_DEC_HEADS];
#ifdef SSM_DEC_VB
    const int vec = SSM_DEC_VEC(p->simd);   /* the vector code of this pass, where it has one */
#else
    const int vec = 0;
#endif

    for (int64_t u = u_lo; u < u_hi;) {
        const int64_t q = u / n_head, h0 = u % n_head;
        const int64_t h1 = ssm_min64(ssm_min64(h0 + SSM_DEC_HEADS, n_head), h0 + (u_hi - u));
        const int64_t nb = h1 - h0;
        ssm_dec_softplus(p, q, h0, nb, dt, A, per_state, sp, ar);
        /* no ids: the identity (the in-place update) */
        const ssm_dec_io io = { s + (ids ? ids[q] : q) * p->s_st[0], x, A, B, C, y_out, st_out };
#ifdef SSM_DEC_VB
        if (vec && per_state && p->head_dim == 1 && p->n_t == 1 && p->d_state % SSM_LANES == 0)
            ssm_dec_m1_rows(p, &io, q, h0, h1, sp);
        else
#endif
            ssm_dec_heads(p, &io, q, h0, h1, sp, ar, vec, per_state);
        u += nb;
    }
}

/* the decode path for thread ith of nth, y and the states to separate buffers: ssm_scan's out is
 * y_out = out, st_out = out + N_y. The glue's in-place update of a cache (ssm_scan_decode_into) passes
 * st_out = s itself, for K = 1, n_rs = n_seqs, ids[q] = q and a dense s: every row is then read
 * before it is written and by its own thread only. */
static void ssm_scan_decode(const ssm_scan_params * p, const real * s, const real * x, const real * dt,
                          const real * A, const real * B, const real * C, const int64_t * ids,
                          real * y_out, real * st_out, int ith, int nth) {
    int64_t lo, hi;
    ssm_split(p->n_seqs * p->n_head, ith, nth, &lo, &hi);
    if (p->a_per_state) ssm_scan_decode_impl(p, s, x, dt, A, B, C, ids, y_out, st_out, lo, hi, 1);
    else ssm_scan_decode_impl(p, s, x, dt, A, B, C, ids, y_out, st_out, lo, hi, 0);
}


#undef SSM_DEC_VB
#undef SSM_DEC_VEC
#undef SSM_DEC_NSUB
#undef SSM_DEC_DL

#endif /* SSM_SCAN_DECODE_BODY_H */
