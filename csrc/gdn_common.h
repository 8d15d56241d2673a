/*
 * gdn_common.h -- what the Gated DeltaNet kernels of every element type and SIMD level share (not part
 * of the public API): the head mapping and the layout of the scratch, so that the work-size
 * queries (gdn_dispatch.c) and the bodies (gdn_recurrence_body.h) agree.
 */
#ifndef GDN_COMMON_H
#define GDN_COMMON_H

#include <stddef.h>
#include <stdint.h>

#include "ssmgrad.h"

/* The backward keeps the state at every GDN_SEGMENT-th token and recomputes the GDN_SEGMENT states
 * of one segment from it before running that segment in reverse. */
#define GDN_SEGMENT 64

/* every per-thread vector starts 64 bytes (16 floats; 16 doubles: 128 bytes) after the previous */
static inline int64_t gdn_pad(int64_t n) { return (n + 15) / 16 * 16; }

/* key/query head of value head h */
static inline int64_t gdn_key_head(const gdn_params * p, int64_t h) {
    return p->head_bcast == GDN_BCAST_INTERLEAVED ? h / (p->H_v / p->H_k) : h % p->H_k;
}

/* key/query sequence of sequence n (ggml: iq3 = iv3 / (n_seqs / n_seqs_k)) */
static inline int64_t gdn_key_seq(const gdn_params * p, int64_t n) { return n / (p->n_seqs / p->n_seqs_k); }

/* value heads per key head, and value head `m` (0 <= m < that) of key head kh, in increasing order */
static inline int64_t gdn_group_size(const gdn_params * p) { return p->H_v / p->H_k; }
static inline int64_t gdn_group_head(const gdn_params * p, int64_t kh, int64_t m) {
    return p->head_bcast == GDN_BCAST_INTERLEAVED ? kh * (p->H_v / p->H_k) + m : kh + m * p->H_k;
}

/* forward scratch per thread, in elements: the token's vectors (a, q, k, v, g) and one state row */
#define GDN_FWD_VECS 6
static inline int64_t gdn_fwd_thread_elems(const gdn_params * p) { return GDN_FWD_VECS * gdn_pad(p->S); }

/* backward: checkpoints (one per segment), the segment's states, dS, then per token of a segment
 * w = v - S^T k and delta, then GDN_BACK_VECS vectors */
#define GDN_BACK_VECS 12
static inline int64_t gdn_back_n_ck(const gdn_params * p) {
    return p->n_t > 0 ? (p->n_t + GDN_SEGMENT - 1) / GDN_SEGMENT : 1;
}
static inline int64_t gdn_back_thread_elems(const gdn_params * p) {
    const int64_t ss = gdn_pad(p->S * p->S), sv = gdn_pad(p->S);
    /* the vector backward's deltas and w (per token, 16 rows each) after the rest */
    return (gdn_back_n_ck(p) + GDN_SEGMENT + 1) * ss + (2 * GDN_SEGMENT + GDN_BACK_VECS) * sv + 2 * 16 * p->n_t;
}

#endif /* GDN_COMMON_H */
