/*
 * gdn_kda_chunked.h -- what the work-size queries (gdn_dispatch.c) and the body (gdn_kda_chunked_body.h)
 * of the delta rule's chunked form with a per-channel gate (KDA: g of shape (n_seqs, n_t, H_v, S)) share:
 * which calls take it, and the per-thread scratch (not part of the public API). The scalar gate's
 * chunked form is gdn_common.h's / gdn_chunk.h's (gdn_chunked_body.h, gdn_back_chunked_body.h); this one
 * uses the same chunk length GDN_CHUNK.
 */
#ifndef GDN_KDA_CHUNKED_H
#define GDN_KDA_CHUNKED_H

#include "gdn_common.h"

/* auto takes the KDA chunked form from GDNK_MIN_T tokens on; the rule depends on the shape only, never on
 * threads. Measured with benchmarks/probes/gdn_forms.py --gate kda (CPU time, one thread, float32;
 * benchmarks/results_gdn_kda.md), recurrence / chunked, forward + backward: 0.68-0.89x from 8 to 128
 * tokens (H_v 16, H_k 8, S 128), 0.93x at 64 and 0.88x at 512 (H_v 32, H_k 16), 0.86-1.02x at 1024 and
 * 1536 (about even), 1.01-1.21x at 2048; the recurrence's forward is the faster at every length measured
 * (0.54-0.97x).
 * The recurrence computes exp(g) once per token and head; with it once per block of state rows, as
 * before, the chunked form was the faster from 16 tokens on. */
#define GDNK_MIN_T 2048
/* Below SIMD level 4 (x86-64-v3, the x86-64 baseline), where the chunked form's exps vectorize
 * (gdnk_exp_diff) and the recurrence's vector forms do not run, the chunked form is the faster from 16
 * tokens on: gdn_form.py --gate kda --shape 32,16,128, fwd+bwd recurrence / chunked 1.46x at 16 tokens,
 * 1.37-1.53x from 64 to 512 (x86-64-v3), 1.13-1.16x at 16 and 512 (baseline); the forwards within 5%. At
 * level 4 after the same change: 0.86x at 64, 0.94x at 512, 1.00x at 1024, 1.02x at 2048. */
#define GDNK_MIN_T_NARROW 16

static inline int gdnk_applies(const gdn_params * p) {
    return p->g_per_channel && p->K == 1 && p->n_t >= 1 && p->S >= 1;
}

/* whether a call with these params runs the KDA chunked form at SIMD level LEVEL (the level of the body
 * that runs it: forward and backward decide alike) */
static inline int gdnk_uses_chunked_at(const gdn_params * p, int level) {
    if (!gdnk_applies(p)) return 0;
    if (p->form == SSM_FORM_CHUNKED) return 1;
    if (p->form == SSM_FORM_RECURRENCE) return 0;
    return p->n_t >= (level >= 4 ? GDNK_MIN_T : GDNK_MIN_T_NARROW);
}

/* Per-thread scratch, in elements (Sp = S padded to 16, C = GDN_CHUNK), in gdnk_carve's order.
 * Forward: the state (Sp, Sp); GDNK_FWD_CS (C, Sp) matrices, two more holding the cumulative gates in
 * double, and two (Sp) holding a row of double zeros; GDNK_FWD_CC (C, C); GDNK_FWD_C (C) vectors. */
#define GDNK_FWD_CS 19
#define GDNK_FWD_CC 4
#define GDNK_FWD_C 2
/* Backward, in addition: GDNK_BACK_SS (Sp, Sp), GDNK_BACK_CS (C, Sp), one (Sp, C), GDNK_BACK_CC (C, C),
 * GDNK_BACK_C (C); and per chunk of the (sequence, head) the state before it, its (C, Sp) rows of Y and of
 * delta and its two (C, C) decayed products (the chunk-boundary states: the rest is recomputed). */
#define GDNK_BACK_SS 3
#define GDNK_BACK_CS 14
#define GDNK_BACK_CC 3
#define GDNK_BACK_C 1
static inline int64_t gdnk_fwd_thread_elems(const gdn_params * p) {
    const int64_t Sp = gdn_pad(p->S), C = GDN_CHUNK;
    return Sp * Sp + (GDNK_FWD_CS + 2) * C * Sp + 2 * Sp + GDNK_FWD_CC * C * C + GDNK_FWD_C * C;
}
static inline int64_t gdnk_back_thread_elems(const gdn_params * p) {
    const int64_t Sp = gdn_pad(p->S), C = GDN_CHUNK;
    return gdnk_fwd_thread_elems(p) + GDNK_BACK_SS * Sp * Sp + GDNK_BACK_CS * C * Sp + Sp * C +
           GDNK_BACK_CC * C * C + GDNK_BACK_C * C + gdnc_n_chunks(p) * (Sp * Sp + 2 * C * Sp + 2 * C * C);
}

/* What the forward keeps for the backward (gdn_fwd_keep_*), per (sequence, value head) and chunk, in
 * elements: the scalar form's first three (the state before the chunk, Y, Dl: gdnc_kept_chunk_elems) and
 * the chunk's two (C, C) decayed products K K^T and Q K^T (zero above their diagonals), the five the
 * backward's pass over the chunks would keep (T is not kept: its substitution is a small part here). */
static inline int64_t gdnk_kept_chunk_elems(const gdn_params * p) {
    const int64_t Sp = gdn_pad(p->S), C = GDN_CHUNK;
    return Sp * Sp + 2 * C * Sp + 2 * C * C;
}

#endif /* GDN_KDA_CHUNKED_H */
