/*
 * gdn_common.h -- what the Gated DeltaNet kernels of every element type and SIMD level share (not part
 * of the public API): the head mapping and the layout of the scratch, so that the work-size
 * queries (gdn_dispatch.c) and the bodies (gdn_recurrence_body.h, gdn_back_recurrence_body.h, gdn_chunk.h)
 * agree.
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

/* the value (sequence, head) units reading one key group: value heads per key head, times value sequences
 * per key sequence */
static inline int64_t gdn_group_units(const gdn_params * p) {
    return p->n_seqs_k > 0 && p->H_k > 0 ? gdn_group_size(p) * (p->n_seqs / p->n_seqs_k) : 0;
}

/* forward scratch per thread, in elements: the token's vectors (a, q, k, v, g) and one state row; KDA
 * with more than one token, where the body runs at SIMD level 3 or 4 (`level`: the SSM_LEVEL of the body
 * that runs the call): then exp(g) of every token (the rows of gdn_with_gates, which only the vector
 * forward gdn_fwd_unit_v of those levels uses; where that does not run, they are reserved and unused) */
#define GDN_FWD_VECS 6
static inline int64_t gdn_fwd_thread_elems(const gdn_params * p, int level) {
    const int gates = p->g_per_channel && p->n_t > 1 && level >= 3;
    return (GDN_FWD_VECS + (gates ? p->n_t : 0)) * gdn_pad(p->S);
}

/* backward: checkpoints (one per segment), the segment's states, dS, then per token of a segment
 * w = v - S^T k and delta, then GDN_BACK_VECS vectors; KDA: then exp(g) of every token of the unit */
#define GDN_BACK_VECS 12
static inline int64_t gdn_back_n_ck(const gdn_params * p) {
    return p->n_t > 0 ? (p->n_t + GDN_SEGMENT - 1) / GDN_SEGMENT : 1;
}
static inline int64_t gdn_back_thread_elems(const gdn_params * p) {
    const int64_t ss = gdn_pad(p->S * p->S), sv = gdn_pad(p->S);
    /* the vector backward's deltas and w (per token, 16 rows each) after the rest, then the gate table */
    return (gdn_back_n_ck(p) + GDN_SEGMENT + 1) * ss + (2 * GDN_SEGMENT + GDN_BACK_VECS) * sv + 2 * 16 * p->n_t +
           (p->g_per_channel ? p->n_t * sv : 0);
}


/* ---------------------------------------------------------------- the chunked form
 * (gdn_chunk.h, gdn_chunked_body.h, gdn_back_chunked_body.h): chunks of GDN_CHUNK tokens, each as small
 * matrix products (WY / UT transform). It takes the scalar gate with K == 1 and n_t >= 1 (the per-channel
 * gate has its own chunked form, gdn_kda_chunked.h); K > 1 snapshots and n_t == 0 run the recurrence,
 * whatever the form asked. Auto takes it from GDN_CHUNKED_MIN_T tokens on (one-token decode and short
 * calls keep the recurrence); the rule depends on the shape only, never on threads. */
#define GDN_CHUNK 64
#define GDN_CHUNKED_MIN_T 32   /* measured with benchmarks/probes/gdn_forms.py --clock cpu (one thread,
                                   float32, H_v 16, H_k 8, S 128): forward + backward, chunked against the
                                   recurrence, 1.9 / 1.7 ms at 16 tokens, 3.3 / 3.5 at 32, 6.0 / 9.0 at 64,
                                   44 / 76 at 512; the forwards are within 1.4x of each other either way */

static inline int gdn_chunked_applies(const gdn_params * p) {
    return !p->g_per_channel && p->K == 1 && p->n_t >= 1 && p->S >= 1;
}

/* whether a call with these params runs the chunked form (forward and backward decide alike) */
static inline int gdn_uses_chunked(const gdn_params * p) {
    if (!gdn_chunked_applies(p)) return 0;
    if (p->form == SSM_FORM_CHUNKED) return 1;
    if (p->form == SSM_FORM_RECURRENCE) return 0;
    return p->n_t >= GDN_CHUNKED_MIN_T;
}

/* Per-thread scratch of the chunked form, in elements; Sp = S padded to 16, C = GDN_CHUNK. The body
 * carves it in this order (gdnc_carve). Forward: the state H (Sp, Sp); the chunk's rows of k, q, v and
 * four more (C, Sp) matrices (Y, Dl, Ob, DS); k transposed (Sp, C); four (C, C) matrices; six (C)
 * vectors (one of them of doubles, counted as two). */
#define GDNC_FWD_CS 7
#define GDNC_FWD_CC 4
#define GDNC_FWD_C 6
/* Backward, in addition: three (Sp, Sp) matrices, ten (C, Sp), one (Sp, C), four (C, C), four (C);
 * and per chunk of the (sequence, head) the state before it and its (C, Sp) rows of delta and of
 * v - gamma S^T k (the chunk-boundary states: the rest is recomputed inside the chunk). */
#define GDNC_BACK_SS 3
#define GDNC_BACK_CS 10
#define GDNC_BACK_CC 4
#define GDNC_BACK_C 4
static inline int64_t gdnc_n_chunks(const gdn_params * p) { return (p->n_t + GDN_CHUNK - 1) / GDN_CHUNK; }
/* what the forward and the backward's forward pass share */
static inline int64_t gdnc_chunk_elems(const gdn_params * p) {
    const int64_t Sp = gdn_pad(p->S), C = GDN_CHUNK;
    return Sp * Sp + GDNC_FWD_CS * C * Sp + Sp * C + GDNC_FWD_CC * C * C + GDNC_FWD_C * C;
}
/* The forward runs up to GDNC_FWD_HEADS value heads of one key head together, chunk by chunk (their
 * k, q rows and K K^T, Q K^T once for all): the other heads' states, and one more (C, C) matrix (Q K^T). */
#define GDNC_FWD_HEADS 4
static inline int64_t gdnc_fwd_thread_elems(const gdn_params * p) {
    const int64_t Sp = gdn_pad(p->S), C = GDN_CHUNK;
    return gdnc_chunk_elems(p) + (GDNC_FWD_HEADS - 1) * Sp * Sp + C * C;
}
/* What the forward keeps for the backward (gdn_fwd_keep_*), per (sequence, value head) and chunk, in
 * elements: the state before the chunk (Sp, Sp) and the chunk's (C, Sp) rows of v - gamma S^T k and of
 * delta (rows past the chunk's end zero), the three the backward's pass over the chunks would keep; then
 * the chunk's (C, C) K K^T and Q K^T (lower parts, the diagonal included; their key head's, copied for
 * each of its value heads) and T = (I + A)^-1 (before its columns are scaled by beta), which the backward
 * would compute again at every chunk (zero above the diagonals and past the chunk's rows). */
static inline int64_t gdnc_kept_chunk_elems(const gdn_params * p) {
    const int64_t Sp = gdn_pad(p->S), C = GDN_CHUNK;
    return Sp * Sp + 2 * C * Sp + 3 * C * C;
}
/* Where a key group has more than one unit (gdn_group_units), the backward sums the group's (C, C)
 * gradients of Q K^T and K K^T per chunk over its units, and multiplies the sums by Q and K once per
 * group (gdnc_back_group_end): two (C, C) per chunk. */
static inline int64_t gdnc_group_sums_elems(const gdn_params * p) {
    return gdn_group_units(p) > 1 ? gdnc_n_chunks(p) * 2 * GDN_CHUNK * GDN_CHUNK : 0;
}
static inline int64_t gdnc_back_thread_elems(const gdn_params * p) {
    const int64_t Sp = gdn_pad(p->S), C = GDN_CHUNK;
    return gdnc_chunk_elems(p) + GDNC_BACK_SS * Sp * Sp + GDNC_BACK_CS * C * Sp + Sp * C +
           GDNC_BACK_CC * C * C + GDNC_BACK_C * C + gdnc_n_chunks(p) * (Sp * Sp + 2 * C * Sp) +
           gdnc_group_sums_elems(p);
}

#endif /* GDN_COMMON_H */
