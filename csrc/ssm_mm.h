/*
 * ssm_mm.h -- the small matrix products of the scan's chunked (SSD) forms, shared by the forward
 * (ssm_scan_chunked_body.h) and the backward (ssm_scan_back_chunked_body.h).
 *
 * Part of a kernel body: included after the element type's header (ssm_real_f32.h /
 * ssm_real_f64.h) and the SIMD level (SSM_LEVEL, ssm_target_begin.h), once per translation unit.
 */
#ifndef SSM_MM_H
#define SSM_MM_H

#include "ssm_common.h"   /* ssm_pad, ssm_min64: the products need nothing of the scan's rows */

/* the products' vector width: one register of the pass */
#if SSM_LEVEL >= 4
#define SSM_MMB 64
#define SSM_MM_NR 4
#elif SSM_LEVEL >= 3
#define SSM_MMB 32
#define SSM_MM_NR 2
#else
#define SSM_MMB 16
#define SSM_MM_NR 2
#endif
#if SSM_LEVEL >= 4
#define SSM_MM_MR 6
#else
#define SSM_MM_MR 4
#endif
#define SSM_MMW ((int64_t) (SSM_MMB / sizeof(real)))
typedef real mmv __attribute__((vector_size(SSM_MMB)));
typedef real mmu __attribute__((vector_size(SSM_MMB), aligned(sizeof(real))));   /* Y may be unaligned */

/*
 * O[i][j] = (Z ? beta Z[i][j] : acc ? O[i][j] : 0) + (rs ? rs[i] : 1) sum_{k < K} X[i xi + k xk] Y[k ys + j]
 * for i < M, j < J, J a multiple of SSM_MMW, O's and Z's rows aligned (Z with O's row stride);
 * and if O2, the second term alone to O2 (O's row stride too). A register tile of mr rows times nr vectors; the
 * sum over k in increasing k for every element (a fixed order).
 */
SSM_INLINE void ssm_mm_tile(const int mr, const int nr, int64_t k0, int64_t k1, const real * X, int64_t xi,
                                  int64_t xk, const real * Y, int64_t ys, real * O, int64_t os, int acc,
                                  const real * Z, real beta, const real * rs, real * O2) {
    typedef mmv mv;
    mv c[SSM_MM_MR][SSM_MM_NR];
    for (int i = 0; i < mr; ++i)
        for (int v = 0; v < nr; ++v) c[i][v] = (mv) { 0 };
    for (int64_t k = k0; k < k1; ++k) {
        const mmu * y = (const mmu *) (Y + k * ys);
        mv yv[SSM_MM_NR];
        for (int v = 0; v < nr; ++v) yv[v] = y[v];
        for (int i = 0; i < mr; ++i) {
            const real xb = X[i * xi + k * xk];
            for (int v = 0; v < nr; ++v) c[i][v] += xb * yv[v];
        }
    }
    for (int i = 0; i < mr; ++i)
        for (int v = 0; v < nr; ++v) {
            mv * o = (mv *) (O + i * os) + v;
            mv r = rs ? rs[i] * c[i][v] : c[i][v];
            if (O2) ((mv *) (O2 + i * os))[v] = r;
            if (Z) r = beta * ((const mv *) (Z + i * os))[v] + r;
            else if (acc) r = *o + r;
            *o = r;
        }
}

/* the shape of X's nonzeros, for ssm_mm: skipping exact zeros leaves every sum's value and order */
#define SSM_MM_FULL 0
#define SSM_MM_LOWER 1   /* X[i][k] == 0 for k > i: the sum runs over k <= i */
#define SSM_MM_UPPER 2   /* X[i][k] == 0 for k < i: the sum runs over k >= i */
#define SSM_MM_OUT_LOWER 3   /* only O[i][j] for j <= i is wanted (the rest is left undefined) */

/* The arguments of ssm_mm (fields left out of an initializer are 0 / NULL: no accumulation, SSM_MM_FULL,
 * no Z, no rs, no O2). */
typedef struct {
    int64_t M, J, K;        /* O is M x J (J a multiple of SSM_MMW), the sum runs over K */
    const real * X;         /* X[i xi + k xk] */
    int64_t xi, xk;
    const real * Y;         /* Y[k ys + j] */
    int64_t ys;
    real * O;               /* O[i os + j], rows aligned */
    int64_t os;
    int acc;                /* add to O (else overwrite), where Z is NULL */
    int shape;              /* SSM_MM_FULL / _LOWER / _UPPER / _OUT_LOWER */
    const real * Z;         /* if not NULL: O = beta Z + ..., Z with O's row stride */
    real beta;
    const real * rs;        /* if not NULL: the sum of row i scaled by rs[i] */
    real * O2;              /* if not NULL: the scaled sum alone, with O's row stride */
} ssm_mm_args;

/* ssm_mm's loop over register tiles, with the arguments one by one: ssm_mm below unpacks the
 * struct at each call site, so that the compiler still sees which arguments are constants there
 * (and specializes this function for them, as the forward's speed needs) */
static void ssm_mm_tiles(int64_t M, int64_t J, int64_t K, const real * X, int64_t xi, int64_t xk,
                         const real * Y, int64_t ys, real * O, int64_t os, int acc, int shape,
                         const real * Z, real beta, const real * rs, real * O2) {
    const int64_t jw = SSM_MM_NR * SSM_MMW;
    int64_t i = 0;
    for (; i < M;) {
        const int mr = i + SSM_MM_MR <= M ? SSM_MM_MR : i + 4 <= M ? 4 : 1;
        const int64_t k0 = shape == SSM_MM_UPPER ? i : 0;
        const int64_t k1 = shape == SSM_MM_LOWER ? ssm_min64(K, i + mr) : K;
        const int64_t Jr = shape == SSM_MM_OUT_LOWER ? ssm_min64(J, ssm_pad(i + mr, SSM_MMW)) : J;
        int64_t j = 0;
        if (mr == SSM_MM_MR) {
            for (; j + jw <= Jr; j += jw)
                ssm_mm_tile(SSM_MM_MR, SSM_MM_NR, k0, k1, X + i * xi, xi, xk, Y + j, ys, O + i * os + j, os, acc, Z ? Z + i * os + j : NULL, beta, rs ? rs + i : NULL, O2 ? O2 + i * os + j : NULL);
            for (; j < Jr; j += SSM_MMW)
                ssm_mm_tile(SSM_MM_MR, 1, k0, k1, X + i * xi, xi, xk, Y + j, ys, O + i * os + j, os, acc, Z ? Z + i * os + j : NULL, beta, rs ? rs + i : NULL, O2 ? O2 + i * os + j : NULL);
        } else if (mr == 4) {
            for (; j + jw <= Jr; j += jw)
                ssm_mm_tile(4, SSM_MM_NR, k0, k1, X + i * xi, xi, xk, Y + j, ys, O + i * os + j, os, acc, Z ? Z + i * os + j : NULL, beta, rs ? rs + i : NULL, O2 ? O2 + i * os + j : NULL);
            for (; j < Jr; j += SSM_MMW)
                ssm_mm_tile(4, 1, k0, k1, X + i * xi, xi, xk, Y + j, ys, O + i * os + j, os, acc, Z ? Z + i * os + j : NULL, beta, rs ? rs + i : NULL, O2 ? O2 + i * os + j : NULL);
        } else {
            for (; j + jw <= Jr; j += jw)
                ssm_mm_tile(1, SSM_MM_NR, k0, k1, X + i * xi, xi, xk, Y + j, ys, O + i * os + j, os, acc, Z ? Z + i * os + j : NULL, beta, rs ? rs + i : NULL, O2 ? O2 + i * os + j : NULL);
            for (; j < Jr; j += SSM_MMW)
                ssm_mm_tile(1, 1, k0, k1, X + i * xi, xi, xk, Y + j, ys, O + i * os + j, os, acc, Z ? Z + i * os + j : NULL, beta, rs ? rs + i : NULL, O2 ? O2 + i * os + j : NULL);
        }
        i += mr;
    }
}

/* O = (Z ? beta Z : acc ? O : 0) + (rs ? rs[i] : 1) X Y, as ssm_mm_tile, over the whole M x J */
SSM_INLINE void ssm_mm(const ssm_mm_args * a) {
    ssm_mm_tiles(a->M, a->J, a->K, a->X, a->xi, a->xk, a->Y, a->ys, a->O, a->os, a->acc, a->shape, a->Z, a->beta, a->rs,
                 a->O2);
}

#endif /* SSM_MM_H */
