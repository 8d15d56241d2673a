/*
 * ssm_mm.h -- the small matrix products of the chunked forms: the scan's (SSD) forward and backward
 * (ssm_scan_chunked_body.h, ssm_scan_back_chunked_body.h) and the Gated DeltaNet's
 * (gdn_chunk.h, gdn_chunked_body.h, gdn_back_chunked_body.h, gdn_kda_chunked_body.h).
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
/* 6 rows by SSM_MM_NR vectors: 24 zmm accumulators of 32 at level 4; 12 of 16 ymm / xmm below it
 * (with the SSM_MM_NR loads of Y's row and one broadcast of X: 15 registers in the k loop) */
#define SSM_MM_MR 6
#define SSM_MMW ((int64_t) (SSM_MMB / sizeof(real)))
typedef real mmv __attribute__((vector_size(SSM_MMB)));
typedef real mmu __attribute__((vector_size(SSM_MMB), aligned(sizeof(real))));   /* Y may be unaligned */

/*
 * Cache hints a product can send while it runs (they change no value): a cursor over up to
 * SSM_PF_STREAMS streams of rows, `cols` elements each, that asks for one cache line per ssm_pf_step,
 * stream by stream, row by row. A product given one (ssm_mm_args.pf) steps it every SSM_PF_EVERY
 * steps of its sums' k, so that the requests go out one by one at the pace of the arithmetic.
 */
#define SSM_PF_STREAMS 5
#define SSM_PF_EVERY 8
typedef struct {
    const real * row0[SSM_PF_STREAMS];   /* a stream's first row (NULL: no stream) */
    int64_t stride[SSM_PF_STREAMS];      /* its row stride */
    int64_t rows[SSM_PF_STREAMS];
    int write[SSM_PF_STREAMS];           /* hint for writing (else for reading) */
    int64_t cols;
    int st;                              /* the cursor: stream, row, column */
    int64_t r, c;
} ssm_pf;

/* One cache line of the streams (the next the cursor points at), then the cursor moves on; nothing
 * once every stream is done. */
SSM_INLINE void ssm_pf_step(ssm_pf * pf) {
    while (pf->st < SSM_PF_STREAMS) {
        const int st = pf->st;
        if (pf->row0[st] != NULL && pf->r < pf->rows[st]) {
            const real * a = pf->row0[st] + pf->r * pf->stride[st] + pf->c;
            if (pf->write[st]) __builtin_prefetch(a, 1, 3);
            else __builtin_prefetch(a, 0, 3);
            pf->c += 64 / (int64_t) sizeof(real);
            if (pf->c >= pf->cols) {
                pf->c = 0;
                ++pf->r;
            }
            return;
        }
        ++pf->st;
        pf->r = pf->c = 0;
    }
}

/* The lines the cursor has not reached yet, all at once */
SSM_INLINE void ssm_pf_finish(ssm_pf * pf) {
    while (pf->st < SSM_PF_STREAMS) ssm_pf_step(pf);
}

/*
 * A register tile's sums, added to c (mr rows times nr vectors): c[i][v] += sum_{k0 <= k < k1}
 * X[i xi + k xk] Y[k ys + v SSM_MMW ..], in increasing k for every element (a fixed order); with pf,
 * a cache hint (ssm_pf_step) at every k that is a multiple of SSM_PF_EVERY.
 */
SSM_INLINE void ssm_mm_tile_sum(const int mr, const int nr, mmv c[SSM_MM_MR][SSM_MM_NR], int64_t k0, int64_t k1,
                                const real * X, int64_t xi, int64_t xk, const real * Y, int64_t ys, ssm_pf * pf) {
    for (int64_t k = k0; k < k1; ++k) {
        if (pf && (k & (SSM_PF_EVERY - 1)) == 0) ssm_pf_step(pf);
        const mmu * y = (const mmu *) (Y + k * ys);
        mmv yv[SSM_MM_NR];
        for (int v = 0; v < nr; ++v) yv[v] = y[v];
        for (int i = 0; i < mr; ++i) {
            const real xb = X[i * xi + k * xk];
            for (int v = 0; v < nr; ++v) c[i][v] += xb * yv[v];
        }
    }
}

/*
 * O[i][j] = (Z ? beta Z[i][j] : acc ? O[i][j] : 0) + (rs ? rs[i] : 1) sum_{k < K} X[i xi + k xk] Y[k ys + j]
 * for i < M, j < J, J a multiple of SSM_MMW, O's and Z's rows aligned (Z with O's row stride);
 * and if O2, the second term alone to O2 (O's row stride too). A register tile of mr rows
 * times nr vectors, its sums by ssm_mm_tile_sum (with pf's cache hints, if pf).
 */
SSM_INLINE void ssm_mm_tile(const int mr, const int nr, int64_t k0, int64_t k1, const real * X, int64_t xi,
                            int64_t xk, const real * Y, int64_t ys, real * O, int64_t os, int acc,
                            const real * Z, real beta, const real * rs, real * O2, ssm_pf * pf) {
    mmv c[SSM_MM_MR][SSM_MM_NR];
    for (int i = 0; i < mr; ++i)
        for (int v = 0; v < nr; ++v) c[i][v] = (mmv) { 0 };
    ssm_mm_tile_sum(mr, nr, c, k0, k1, X, xi, xk, Y, ys, pf);
    for (int i = 0; i < mr; ++i)
        for (int v = 0; v < nr; ++v) {
            mmv * o = (mmv *) (O + i * os) + v;
            mmv r = rs ? rs[i] * c[i][v] : c[i][v];
            if (O2) ((mmv *) (O2 + i * os))[v] = r;
            if (Z) {
                /* beta through memory, read here: else the compiler keeps it and its broadcast in two
                 * registers across the sums, and at 16 registers a 6-row tile then spills Y's row */
                real b = beta;
#if SSM_LEVEL < 4   /* (at 32 registers there is room: that code stays as it was) */
                __asm__ volatile("" : "+m"(b));
#endif
                r = b * ((const mmv *) (Z + i * os))[v] + r;
            }
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
 * no Z, no rs, no O2, no cache hints). */
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
    ssm_pf * pf;            /* if not NULL: cache hints as the sums run (ssm_pf) */
} ssm_mm_args;

/* ssm_mm's loop over register tiles, with the arguments one by one: ssm_mm below unpacks the
 * struct at each call site, so that the compiler still sees which arguments are constants there
 * (and specializes this function for them, as the forward's speed needs) */
static void ssm_mm_tiles(int64_t M, int64_t J, int64_t K, const real * X, int64_t xi, int64_t xk,
                         const real * Y, int64_t ys, real * O, int64_t os, int acc, int shape,
                         const real * Z, real beta, const real * rs, real * O2, ssm_pf * pf) {
    const int64_t jw = SSM_MM_NR * SSM_MMW;
    int64_t i = 0;
    for (; i < M;) {
        const int mr = i + SSM_MM_MR <= M ? SSM_MM_MR : i + 4 <= M ? 4 : i + 2 <= M ? 2 : 1;
        const int64_t k0 = shape == SSM_MM_UPPER ? i : 0;
        const int64_t k1 = shape == SSM_MM_LOWER ? ssm_min64(K, i + mr) : K;
        const int64_t Jr = shape == SSM_MM_OUT_LOWER ? ssm_min64(J, ssm_pad(i + mr, SSM_MMW)) : J;
        int64_t j = 0;
/* the tile of mr rows and nr vectors at (i, j) */
#define SSM_MM_TILE(MR, NR)                                                                                    \
    ssm_mm_tile(MR, NR, k0, k1, X + i * xi, xi, xk, Y + j, ys, O + i * os + j, os, acc, Z ? Z + i * os + j : NULL, \
                beta, rs ? rs + i : NULL, O2 ? O2 + i * os + j : NULL, pf)
        if (mr == SSM_MM_MR) {
            for (; j + jw <= Jr; j += jw) SSM_MM_TILE(SSM_MM_MR, SSM_MM_NR);
            for (; j < Jr; j += SSM_MMW) SSM_MM_TILE(SSM_MM_MR, 1);
        } else if (mr == 4) {
            for (; j + jw <= Jr; j += jw) SSM_MM_TILE(4, SSM_MM_NR);
            for (; j < Jr; j += SSM_MMW) SSM_MM_TILE(4, 1);
        } else if (mr == 2) {
            for (; j + jw <= Jr; j += jw) SSM_MM_TILE(2, SSM_MM_NR);
            for (; j < Jr; j += SSM_MMW) SSM_MM_TILE(2, 1);
        } else {
            for (; j + jw <= Jr; j += jw) SSM_MM_TILE(1, SSM_MM_NR);
            for (; j < Jr; j += SSM_MMW) SSM_MM_TILE(1, 1);
        }
#undef SSM_MM_TILE
        i += mr;
    }
}

/* O = (Z ? beta Z : acc ? O : 0) + (rs ? rs[i] : 1) X Y, as ssm_mm_tile, over the whole M x J */
SSM_INLINE void ssm_mm(const ssm_mm_args * a) {
    ssm_mm_tiles(a->M, a->J, a->K, a->X, a->xi, a->xk, a->Y, a->ys, a->O, a->os, a->acc, a->shape, a->Z,
                 a->beta, a->rs, a->O2, a->pf);
}

#endif /* SSM_MM_H */
