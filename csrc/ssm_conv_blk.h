/*
 * ssm_conv_blk.h -- the sizes of the float32 AVX-512 conv kernels (ssm_conv_blk_body.h) that their
 * scratch size (ssm_conv_work_size, ssm_conv_dispatch.c) depends on, and the test of whether a
 * call may take them. Internal.
 */
#ifndef SSM_CONV_BLK_H
#define SSM_CONV_BLK_H

#include "ssm_common.h"

#ifndef CONV_BLK_TW
#define CONV_BLK_TW 256     /* tokens per window: a multiple of 16 */
#endif
#define CONV_BLK_MAXK 16    /* longest d_conv these kernels take */
/* token-major rows of a vector's buffer: a window, its d_conv - 1 neighbours, padding to 16 */
#define CONV_BLK_ROWS (CONV_BLK_TW + CONV_BLK_MAXK + 16)

/* channels of a group: CONV_BLK_G vectors side by side, so that each token-major row is read
 * or written in runs of CONV_BLK_G * 64 bytes */
#define CONV_BLK_G 4
/* y of at least this many bytes is written with streaming stores (larger than the L2s: the
 * next op finds little of it in cache anyway) */
#define CONV_BLK_NT_BYTES ((int64_t) 4 << 20)

/* The token-major buffer of a thread's call: 74 KB, in the caller's scratch rather than on the
 * stack (threads of callers such as ggml may have small stacks, e.g. musl's 128 KB); a multiple
 * of SSM_WORK_ALIGN, so every thread's slice stays aligned. */
#define BLK_BUF_BYTES ((size_t) CONV_BLK_G * CONV_BLK_ROWS * 16 * sizeof(float))

/* whether these kernels can take a call with these params: AVX-512 (and the call wants it), a
 * short kernel */
SSM_INLINE int blk_may_take(const ssm_conv_params * p) {
    return ssm_avx512_kernels(p->simd) && p->d_conv >= 1 && p->d_conv <= CONV_BLK_MAXK;
}

#endif /* SSM_CONV_BLK_H */
