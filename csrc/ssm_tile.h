/*
 * ssm_tile.h -- square tiles of floats transposed in vector registers: 16 x 16 in 64-byte vectors
 * (ssm_ck_tile16, and ssm_ck_tile16_to with streaming stores), and 8 x 8 in 32-byte vectors at x86-64-v3
 * (ssm_ck_tile8). Shared by the scan's chunked forms (ssm_chunk.h, ssm_chunk_transpose) and the Gated
 * DeltaNet's (gdn_transpose.h, gdnc_transpose). Pure data movement. Part of a kernel body: included after the
 * element type's header, once per translation unit.
 */
#ifndef SSM_TILE_H
#define SSM_TILE_H

#ifndef SSM_REAL_H
#error "include ssm_real_f32.h or ssm_real_f64.h before ssm_tile.h"
#endif

#include "ssm_common.h"

/* One stage of an N x N tile's network (r[N]: its rows in vectors V, IV the int vector of N lanes): for every
 * pair of rows b apart, lane j of the low row takes (j & b) ? the high row's j - b : its own j, lane j of the high
 * row (j & b) ? its own j : the low row's j + b */
#define SSM_TILE_LO(j, b, N) (((j) & (b)) ? (N) + (j) - (b) : (j))
#define SSM_TILE_HI(j, b, N) (((j) & (b)) ? (N) + (j) : (j) + (b))
#define SSM_TILE_MASK8(F, b, N) F(0, b, N), F(1, b, N), F(2, b, N), F(3, b, N), F(4, b, N), F(5, b, N), F(6, b, N), \
                                F(7, b, N)
#define SSM_TILE_MASK16(F, b, N) SSM_TILE_MASK8(F, b, N), F(8, b, N), F(9, b, N), F(10, b, N), F(11, b, N),     \
                                 F(12, b, N), F(13, b, N), F(14, b, N), F(15, b, N)
#define SSM_TILE_STAGE(N, V, IV, b)                                                               \
    for (int i = 0; i < (N); ++i)                                                                 \
        if (!(i & (b))) {                                                                         \
            const V u = r[i], w = r[i + (b)];                                                     \
            r[i] = SSM_SHUFFLE2(IV, u, w, SSM_TILE_MASK##N(SSM_TILE_LO, b, N));                   \
            r[i + (b)] = SSM_SHUFFLE2(IV, u, w, SSM_TILE_MASK##N(SSM_TILE_HI, b, N));             \
        }

#if (REAL_LANES == 16)
#if SSM_LEVEL >= 4
#include <immintrin.h>   /* _mm512_stream_ps, _mm_sfence */
#endif
typedef int32_t ck_ivec __attribute__((vector_size(64)));
typedef real ssm_tile_vec __attribute__((vector_size(64)));
typedef real ck_vecu __attribute__((vector_size(64), aligned(sizeof(real))));   /* rows may be unaligned */
/* the tile turned; stream: dst's rows 64-byte aligned, written with streaming stores (whole lines, past the
 * caches: the kept chunk states, ssm_chunk_transpose_out) */
SSM_INLINE void ssm_ck_tile16_to(const real * src, int64_t ss, real * dst, int64_t dst_s, const int stream) {
    ssm_tile_vec r[16];
    for (int i = 0; i < 16; ++i) r[i] = *(const ck_vecu *) (src + i * ss);
    SSM_TILE_STAGE(16, ssm_tile_vec, ck_ivec, 1)
    SSM_TILE_STAGE(16, ssm_tile_vec, ck_ivec, 2)
    SSM_TILE_STAGE(16, ssm_tile_vec, ck_ivec, 4)
    SSM_TILE_STAGE(16, ssm_tile_vec, ck_ivec, 8)
#if SSM_LEVEL >= 4
    if (stream) {
        for (int i = 0; i < 16; ++i) _mm512_stream_ps((float *) (dst + i * dst_s), (__m512) r[i]);
        return;
    }
#else
    (void) stream;
#endif
    for (int i = 0; i < 16; ++i) *(ck_vecu *) (dst + i * dst_s) = r[i];
}
SSM_INLINE void ssm_ck_tile16(const real * src, int64_t ss, real * dst, int64_t dst_s) {
    ssm_ck_tile16_to(src, ss, dst, dst_s, 0);
}
#endif
#if (REAL_LANES == 16) && SSM_LEVEL == 3
/* AVX2 (x86-64-v3), float: an 8 x 8 tile in 32-byte registers, three stages of two-source shuffles (the
 * AVX-512 tile's network at half the width; each stage a blend, shufps or perm2f128) */
typedef int32_t ck_ivec8 __attribute__((vector_size(32)));
typedef real ck_vec8 __attribute__((vector_size(32)));
typedef real ck_vec8u __attribute__((vector_size(32), aligned(sizeof(real))));
SSM_INLINE void ssm_ck_tile8(const real * src, int64_t ss, real * dst, int64_t dst_s) {
    ck_vec8 r[8];
    for (int i = 0; i < 8; ++i) r[i] = *(const ck_vec8u *) (src + i * ss);
    SSM_TILE_STAGE(8, ck_vec8, ck_ivec8, 1)
    SSM_TILE_STAGE(8, ck_vec8, ck_ivec8, 2)
    SSM_TILE_STAGE(8, ck_vec8, ck_ivec8, 4)
    for (int i = 0; i < 8; ++i) *(ck_vec8u *) (dst + i * dst_s) = r[i];
}
#endif
#undef SSM_TILE_STAGE
#undef SSM_TILE_MASK16
#undef SSM_TILE_MASK8
#undef SSM_TILE_HI
#undef SSM_TILE_LO

#endif /* SSM_TILE_H */
