/*
 * gdn_transpose.h -- gdnc_transpose, the Gated DeltaNet chunked forms' transposes (the scalar gate's
 * gdn_chunk.h and the per-channel gate's gdn_kda_chunked_body.h): whole blocks turned in vector registers
 * where the pass has them (ssm_tile.h's: 16 x 16 for float at level 4, 8 x 8 at level 3), the rest element
 * by element.
 * Pure data movement: no bits depend on which. Part of a kernel body: included after the element type's
 * header, once per translation unit.
 */
#ifndef GDN_TRANSPOSE_H
#define GDN_TRANSPOSE_H

#ifndef SSM_REAL_H
#error "include ssm_real_f32.h or ssm_real_f64.h before gdn_transpose.h"
#endif

#include "ssm_common.h"

/* Whole blocks by ssm_tile.h's register tiles where the pass has them: float, 16 x 16 at level 4, 8 x 8 at
 * level 3 (element by element these transposes were 5% of the v3 backward's samples) */
#include "ssm_tile.h"
#if SSM_LEVEL >= 4 && REAL_LANES == 16
#define GDNC_TRANSPOSE_BLOCK 16
#define gdnc_transpose_block(dst, ds, src, ss) ssm_ck_tile16(src, ss, dst, ds)
#elif SSM_LEVEL == 3 && REAL_LANES == 16
#define GDNC_TRANSPOSE_BLOCK 8
#define gdnc_transpose_block(dst, ds, src, ss) ssm_ck_tile8(src, ss, dst, ds)
#else
#define GDNC_TRANSPOSE_BLOCK 0
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
