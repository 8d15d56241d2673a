/*
 * ssm_scan_layout.h -- how the scan kernels cut the work into blocks and lay out scratch.
 * Internal; shared by the forward (ssm_scan_*.c) and the backward (ssm_scan_back_*.c).
 *
 * A block is one sequence q and a run of consecutive heads [h0, h1) of one group g. Its
 * state is kept TRANSPOSED in scratch, H[n * Rp + r] for state n and row r = (h-h0)*head_dim + p,
 * so every inner loop runs along rows: the sum over n for y is a plain vertical
 * accumulation in ggml's order (n increasing), and Mamba-1's per-state decays and Mamba-2's
 * per-head decays share one loop shape. Rows are padded to Rp, a multiple of SSM_RT; pad rows
 * hold zeros and add exact zeros to every row reduction.
 */
#ifndef SSM_SCAN_LAYOUT_H
#define SSM_SCAN_LAYOUT_H

#include <stdlib.h>
#include <string.h>

#include "ssm_arena.h"
#include "ssm_common.h"

/* rows per register tile of the token step: 4 AVX-512 registers of floats, so that the
 * per-row accumulators of a tile stay in registers across the loop over states */
#define SSM_RT 64

/* tokens per tile of softplus(dt) and e^(sp * A) for blocks of few heads (ssm_fill_tile) */
#define SSM_TT 64

typedef struct {
    int64_t q, g, h0, h1;   /* sequence, group, heads [h0, h1) */
    int64_t R, Rp;          /* rows, rows padded to SSM_RT */
} ssm_block;

SSM_INLINE int64_t ssm_heads_per_group(const ssm_scan_params * p) {
    return p->n_head / p->n_group;
}

/* Heads per block: as many as keep the block's state near SSM_BLOCK_ELEMS, at least one. */
SSM_INLINE int64_t ssm_block_heads(const ssm_scan_params * p) {
    const int64_t per_head = ssm_max64(1, p->head_dim * p->d_state);
    const int64_t hpg = ssm_heads_per_group(p);
    return ssm_max64(1, ssm_min64(SSM_BLOCK_ELEMS / per_head, hpg));
}

SSM_INLINE int64_t ssm_max_rows_padded(const ssm_scan_params * p) {
    return ssm_pad(ssm_max64(1, ssm_block_heads(p) * p->head_dim), SSM_RT);
}

/* Backward head runs: the heads of a group in rpg nearly equal runs (shape-only), each at least
 * a register tile of rows where the group has that many (fewer would be mostly padding), at Mamba-2's
 * one decay per head SSM_M2_RUN_TILES tiles (each run's chunks have D terms of d_B and d_C, two
 * Q x Q x d_state products per chunk whatever its heads: at 130m's 24 heads of 64 rows, runs of 3
 * heads spent 10% of the backward's count on them, runs of 6 spend 5%), but for the 2 runs below, and
 * no more than keep the partial sums of d_B and d_C (2 n_t d_state floats per run, group
 * and sequence) within SSM_PARTIAL_BYTES, with at least 2 runs where the group has 2 tiles
 * and the call has a single (sequence, group) pair (so that 2 threads share one long sequence). */
#define SSM_PARTIAL_BYTES (16 << 20)
#define SSM_M2_RUN_TILES 6
SSM_INLINE int64_t ssm_head_runs_per_group(const ssm_scan_params * p) {
    const int64_t hpg = ssm_heads_per_group(p);
    const int64_t tiles = hpg * p->head_dim / SSM_RT;
    const int64_t least = p->n_seqs * p->n_group >= 2 ? 1 : 2;     /* units for 2 threads */
    const int64_t by_rows = ssm_max64(1, ssm_max64(tiles / (p->a_per_state ? 1 : SSM_M2_RUN_TILES),
                                                   ssm_min64(least, tiles)));
    /* in double: no overflow for any shape (the glue asks for the units before it allocates) */
    const double per_run = (double) p->n_seqs * p->n_group * p->n_t * p->d_state * 2 * sizeof(float);
    const int64_t by_mem = per_run * least >= SSM_PARTIAL_BYTES ? least : per_run < 1 ? SSM_HEAD_RUNS_PER_GROUP
                           : ssm_max64(least, (int64_t) (SSM_PARTIAL_BYTES / per_run));
    return ssm_min64(hpg, ssm_min64(ssm_min64(SSM_HEAD_RUNS_PER_GROUP, by_mem), by_rows));
}

/* The chunked backward given the forward's states (ssm_scan_back_kept_*) runs a unit's chunks outermost,
 * all of its heads at once (ssm_back_unit_by_chunk), where d_state is a multiple of 16 (the states are
 * read in place) and a unit has at most SSM_BY_CHUNK_HEADS heads: each keeps its dS pair and its decays
 * (2 head_dim d_state + 6 n_t elements, padded). The heads' buffers a thread's scratch holds: 1 where
 * that order does not run. */
#define SSM_BY_CHUNK_HEADS 16
SSM_INLINE int64_t ssm_back_chunk_heads(const ssm_scan_params * p) {
    const int64_t hpg = ssm_heads_per_group(p), rpg = ssm_head_runs_per_group(p);   /* 0 where there are no heads */
    const int64_t h = rpg > 0 ? (hpg + rpg - 1) / rpg : 1;
    return p->d_state % 16 == 0 && h <= SSM_BY_CHUNK_HEADS ? h : 1;
}

SSM_INLINE ssm_block ssm_make_block(const ssm_scan_params * p, int64_t q, int64_t h0, int64_t h1) {
    ssm_block b;
    b.q = q;
    b.g = h0 / ssm_heads_per_group(p);
    b.h0 = h0;
    b.h1 = h1;
    b.R = (h1 - h0) * p->head_dim;
    b.Rp = ssm_pad(ssm_max64(b.R, 1), SSM_RT);
    return b;
}

/*
 * The decode path of the forward (ssm_scan_decode_body.h): calls of at most SSM_DECODE_MAX_T tokens, as in
 * generation, work on the state rows in ggml's own layout (contiguous over d_state) straight from
 * s into the output, with no transposed scratch state. It needs contiguous state rows, B and C
 * rows and (Mamba-1) A rows; other strides take the general path. It depends on the shape and
 * strides only, so every thread of a call, and ssm_scan_work_size, agree on it.
 */
#define SSM_DECODE_MAX_T 4
SSM_INLINE int ssm_scan_decode_path(const ssm_scan_params * p) {
    return p->n_t >= 1 && p->n_t <= SSM_DECODE_MAX_T && p->head_dim >= 1 && p->d_state >= 1
           && p->s_st[3] == 1 && p->B_st[3] == 1 && p->C_st[3] == 1 && (!p->a_per_state || p->A_st[1] == 1);
}

/* Internal (not in ssmgrad.h; ssm_scan_dispatch.c; the glue's in-place cache update): the decode path alone, y (dense, like
 * ssm_scan's y region) and the K state slots (dense) to separate buffers; st may be s itself when
 * K = 1, n_rs = n_seqs, ids[q] = q and s is dense. ids may be NULL: the identity, ids[q] = q.
 * Precondition: ssm_scan_decode_path(p). */
void ssm_scan_decode_into_f32(const ssm_scan_params * p, const float * s, const float * x, const float * dt,
                              const float * A, const float * B, const float * C, const int64_t * ids, float * y,
                              float * st, int ith, int nth);
void ssm_scan_decode_into_f64(const ssm_scan_params * p, const double * s, const double * x, const double * dt,
                              const double * A, const double * B, const double * C, const int64_t * ids,
                              double * y, double * st, int ith, int nth);

/* Internal (ssm_scan_forms.c; the glue's _scan_forms): whether phase 1 of the backward takes the
 * chunked form for this call, by its shape and p->back_form. */
int ssm_scan_back_chunked(const ssm_scan_params * p);
/* ... and whether the forward does (ssm_scan_forms.c; p->fwd_form) */
int ssm_scan_fwd_chunked(const ssm_scan_params * p);

#endif /* SSM_SCAN_LAYOUT_H */
