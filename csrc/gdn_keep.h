/*
 * gdn_keep.h -- how the chunked forms of GATED_DELTA_NET (gdn_chunked_body.h, gdn_kda_chunked_body.h)
 * write what the backward reads instead of recomputing (gdn_fwd_keep_*, gdn_back_kept_*; the layout is
 * gdn_kept_chunk_elems', gdn_common.h): whole 64-byte lines with streaming stores where the pass has them
 * (past the caches: the backward reads them after the forward is done), else memcpy; the same values
 * either way. Part of a kernel body: included after the element type's header, once per translation unit.
 */
#ifndef GDN_KEEP_H
#define GDN_KEEP_H

#ifndef SSM_REAL_H
#error "include ssm_real_f32.h or ssm_real_f64.h before gdn_keep.h"
#endif

#include <stdint.h>
#include <string.h>

#include "ssm_common.h"
#include "gdn_common.h"   /* GDN_CHUNK */

#if SSM_LEVEL >= 3
#include <immintrin.h>   /* _mm512_stream_si512 / _mm256_stream_si256, _mm_sfence */
#endif

/* n elements from src to dst: with streaming stores where dst is 64-byte aligned and n whole lines */
SSM_INLINE void gdn_keep_copy(real * restrict dst, const real * restrict src, int64_t n) {
    const size_t bytes = (size_t) n * sizeof(real);
#if SSM_LEVEL >= 4
    if ((uintptr_t) dst % 64 == 0 && bytes % 64 == 0) {
        for (size_t i = 0; i < bytes; i += 64)
            _mm512_stream_si512((void *) ((char *) dst + i), _mm512_loadu_si512((const char *) src + i));
        return;
    }
#elif SSM_LEVEL == 3
    if ((uintptr_t) dst % 64 == 0 && bytes % 64 == 0) {
        for (size_t i = 0; i < bytes; i += 32)
            _mm256_stream_si256((__m256i *) ((char *) dst + i),
                                _mm256_loadu_si256((const __m256i *) ((const char *) src + i)));
        return;
    }
#endif
    memcpy(dst, src, bytes);
}

/* A kept entry's parts (gdnc_kept_chunk_elems, gdnk_kept_chunk_elems), in order: the state before the chunk
 * (Sp, Sp), its rows Y and Dl (C, Sp), its products KK and QK (C, C), and with the scalar gate T (C, C) */
enum { GDN_KEPT_H0, GDN_KEPT_Y, GDN_KEPT_DL, GDN_KEPT_KK, GDN_KEPT_QK, GDN_KEPT_T };

/* where part `part` of a kept entry begins, in elements from the entry's start */
SSM_INLINE int64_t gdn_kept_at(int64_t Sp, int part) {
    const int64_t C = GDN_CHUNK, at[] = { 0, Sp * Sp, Sp * Sp + C * Sp, Sp * Sp + 2 * C * Sp,
                                          Sp * Sp + 2 * C * Sp + C * C, Sp * Sp + 2 * C * Sp + 2 * C * C };
    return at[part];
}

/* After a chunk's forward: its (C, Sp) rows Y and Dl and its (C, C) products KK and QK into the kept entry kc
 * (after the state before the chunk), zero past the chunk's L rows */
SSM_INLINE void gdn_keep_rows(real * kc, int64_t Sp, int64_t L, const real * Y, const real * Dl, const real * KK,
                              const real * QK) {
    const int64_t C = GDN_CHUNK, CS = C * Sp, CC = C * C;
    real * ky = kc + gdn_kept_at(Sp, GDN_KEPT_Y), * kd = kc + gdn_kept_at(Sp, GDN_KEPT_DL);
    real * kk = kc + gdn_kept_at(Sp, GDN_KEPT_KK), * qk = kc + gdn_kept_at(Sp, GDN_KEPT_QK);
    gdn_keep_copy(ky, Y, L * Sp);
    gdn_keep_copy(kd, Dl, L * Sp);
    memset(ky + L * Sp, 0, (size_t) (CS - L * Sp) * sizeof(real));
    memset(kd + L * Sp, 0, (size_t) (CS - L * Sp) * sizeof(real));
    gdn_keep_copy(kk, KK, L * C);
    gdn_keep_copy(qk, QK, L * C);
    memset(kk + L * C, 0, (size_t) (CC - L * C) * sizeof(real));
    memset(qk + L * C, 0, (size_t) (CC - L * C) * sizeof(real));
}

/* the streaming stores of gdn_keep_copy seen by every thread after the caller's barrier */
SSM_INLINE void gdn_keep_fence(void) {
#if SSM_LEVEL >= 3
    _mm_sfence();
#endif
}

#endif /* GDN_KEEP_H */
