/*
 * gdn_transpose.h -- gdnc_transpose, the Gated DeltaNet chunked forms' transposes (the scalar gate's
 * gdn_chunk.h and the per-channel gate's gdn_kda_chunked_body.h): whole blocks turned in vector registers
 * where the pass has them (16 x 16 for float at level 4, 8 x 8 at level 3), the rest element by element.
 * Pure data movement: no bits depend on which. Part of a kernel body: included after the element type's
 * header, once per translation unit.
 */
#ifndef GDN_TRANSPOSE_H
#define GDN_TRANSPOSE_H

#ifndef SSM_REAL_H
#error "include ssm_real_f32.h or ssm_real_f64.h before gdn_transpose.h"
#endif

#include "ssm_common.h"

/* A block of B x B floats in B vectors, transposed by rounds of two-input shuffles (round w swaps the
 * off-diagonal w x w blocks of each 2w x 2w block): B = 16 at AVX-512, four rounds; B = 8 at AVX2, three (at 16
 * vector registers; element by element these transposes were 5% of the v3 backward's samples). GDNC_LO<w>,
 * GDNC_HI<w>: round w's lane indices (0 to B - 1: x, B to 2B - 1: y). */
#if SSM_LEVEL >= 4 && REAL_LANES == 16 && !defined(GDNC_SCALAR_TRANSPOSE)
#define GDNC_TRANSPOSE_BLOCK 16
typedef float gdnc_vb __attribute__((vector_size(64), aligned(4)));
typedef int32_t gdnc_ib __attribute__((vector_size(64)));
#define GDNC_LO8 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define GDNC_HI8 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define GDNC_LO4 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27
#define GDNC_HI4 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31
#define GDNC_LO2 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29
#define GDNC_HI2 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31
#define GDNC_LO1 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30
#define GDNC_HI1 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31
#elif SSM_LEVEL == 3 && REAL_LANES == 16 && !defined(GDNC_SCALAR_TRANSPOSE)
#define GDNC_TRANSPOSE_BLOCK 8
typedef float gdnc_vb __attribute__((vector_size(32), aligned(4)));
typedef int32_t gdnc_ib __attribute__((vector_size(32)));
#define GDNC_LO4 0, 1, 2, 3, 8, 9, 10, 11
#define GDNC_HI4 4, 5, 6, 7, 12, 13, 14, 15
#define GDNC_LO2 0, 1, 8, 9, 4, 5, 12, 13
#define GDNC_HI2 2, 3, 10, 11, 6, 7, 14, 15
#define GDNC_LO1 0, 8, 2, 10, 4, 12, 6, 14
#define GDNC_HI1 1, 9, 3, 11, 5, 13, 7, 15
#else
#define GDNC_TRANSPOSE_BLOCK 0
#endif

#if GDNC_TRANSPOSE_BLOCK
/* a two-input shuffle by constant indices in GCC's and in clang's spelling */
#if defined(__clang__)
#define GDNC_SHUF(x, y, ...) __builtin_shufflevector(x, y, __VA_ARGS__)
#else
#define GDNC_SHUF(x, y, ...) __builtin_shuffle(x, y, (gdnc_ib) { __VA_ARGS__ })
#endif
SSM_INLINE void gdnc_transpose_block(real * dst, int64_t ds, const real * src, int64_t ss) {
    enum { B = GDNC_TRANSPOSE_BLOCK };
    gdnc_vb a[B];
    for (int r = 0; r < B; ++r) a[r] = *(const gdnc_vb *) (src + r * ss);
    /* round w: lane l of the low row takes (l & w) ? y[l - w] : x[l], of the high row (l & w) ? y[l] : x[l + w] */
#define GDNC_T_ROUND(w)                                                                      \
    for (int r = 0; r < B; ++r)                                                              \
        if (!(r & (w))) {                                                                    \
            const gdnc_vb x = a[r], y = a[r + (w)];                                          \
            a[r] = GDNC_SHUF(x, y, GDNC_LO##w);                                              \
            a[r + (w)] = GDNC_SHUF(x, y, GDNC_HI##w);                                        \
        }
#if GDNC_TRANSPOSE_BLOCK == 16
    GDNC_T_ROUND(8)
#endif
    GDNC_T_ROUND(4)
    GDNC_T_ROUND(2)
    GDNC_T_ROUND(1)
#undef GDNC_T_ROUND
    for (int r = 0; r < B; ++r) *(gdnc_vb *) (dst + r * ds) = a[r];
}
#endif

/* rows r (row stride ss) transposed into dst (row stride ds): dst[c][r] = src[r][c], r < nr, c < nc
 * (whole blocks by vector shuffles where the pass has them, the rest element by element) */
static void gdnc_transpose(real * dst, int64_t ds, const real * src, int64_t ss, int64_t nr, int64_t nc) {
    int64_t rb = 0, cb = 0;   /* rows / columns [0, rb) x [0, cb) done by blocks */
#if GDNC_TRANSPOSE_BLOCK
    rb = nr / GDNC_TRANSPOSE_BLOCK * GDNC_TRANSPOSE_BLOCK;
    cb = nc / GDNC_TRANSPOSE_BLOCK * GDNC_TRANSPOSE_BLOCK;
    for (int64_t r0 = 0; r0 < rb; r0 += GDNC_TRANSPOSE_BLOCK)
        for (int64_t c0 = 0; c0 < cb; c0 += GDNC_TRANSPOSE_BLOCK)
            gdnc_transpose_block(dst + c0 * ds + r0, ds, src + r0 * ss + c0, ss);
#endif
    for (int64_t r0 = 0; r0 < nr; r0 += 16)   /* columns [cb, nc) of every row */
        for (int64_t c = cb; c < nc; ++c)
            for (int64_t r = r0; r < ssm_min64(r0 + 16, nr); ++r) dst[c * ds + r] = src[r * ss + c];
    for (int64_t c = 0; c < cb; ++c)          /* rows [rb, nr) of the other columns */
        for (int64_t r = rb; r < nr; ++r) dst[c * ds + r] = src[r * ss + c];
}

#endif /* GDN_TRANSPOSE_H */
