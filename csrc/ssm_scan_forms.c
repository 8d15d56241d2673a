/*
 * ssm_scan_forms.c -- which form of the scan a call takes (internal; ssm_scan_layout.h declares
 * them). The decode path (ssm_scan_decode_path, ssm_scan_layout.h) comes first in the forward;
 * otherwise Mamba-2 (one decay per head) with K == 1 may take the chunked (SSD) form, every other
 * call the token recurrence. p->fwd_form and p->back_form (SSM_FORM_*) force a form; auto picks it
 * by shape alone, never by thread count, so the thread count never changes the form (or the bits).
 * The auto thresholds are where the chunked form measured faster (docs/performance.md).
 */
#include "ssm_scan_layout.h"

/* forward, auto: head_dim >= 32, d_state >= 128, n_t >= 64 */
#define SSM_FWD_AUTO_MIN_NT 64
#define SSM_FWD_AUTO_MIN_HD 32
#define SSM_FWD_AUTO_MIN_DS 128

int ssm_scan_fwd_chunked(const ssm_scan_params * p) {
    if (p->a_per_state || p->K != 1 || p->n_t < 1 || ssm_scan_decode_path(p)) return 0;
    switch (p->fwd_form) {
    case SSM_FORM_RECURRENCE: return 0;
    case SSM_FORM_CHUNKED: return 1;
    default:
        return p->n_t >= SSM_FWD_AUTO_MIN_NT && p->head_dim >= SSM_FWD_AUTO_MIN_HD && p->d_state >= SSM_FWD_AUTO_MIN_DS;
    }
}

/* Elements one thread keeps for the backward's chunked form, beyond a chunk's buffers: C_t . B_tau
 * of every chunk and the sum over the unit's heads of its D (n_t x 64 each), and one head's state
 * at every chunk boundary (n_t / 64 x head_dim x d_state): linear in n_t, where the recurrence's
 * checkpoints grow as sqrt(n_t); where the kept states' order runs (ssm_back_chunk_heads > 1), each
 * head's dS pair and decays too. */
static double ssm_back_chunked_elems(const ssm_scan_params * p) {
    const double nc = (double) ((p->n_t + 63) / 64), h = (double) ssm_back_chunk_heads(p);
    const double Np = (double) ssm_pad(p->d_state, 16), Pp = (double) ssm_pad(p->head_dim, 16);
    const double heads = h > 1 ? h * 2 * Pp * Np + (h - 1) * nc * 64 * 6 : 0;   /* dS pairs, decays */
    return 2 * nc * 64 * 64 + (nc + 1) * (double) p->head_dim * Np + heads;
}

/* backward, auto: head_dim and d_state both >= 32 with a state of >= 2048 elements per head,
 * n_t >= 32; and at most 4M elements of the buffers above (16 MB in float32: n_t up to ~16k at
 * head_dim 64, d_state 128), to keep memory bounded */
#define SSM_AUTO_MIN_NT 32
#define SSM_AUTO_MIN_DIM 32
#define SSM_AUTO_MIN_STATE 2048
#define SSM_AUTO_MAX_ELEMS 4e6

int ssm_scan_back_chunked(const ssm_scan_params * p) {
    if (p->a_per_state || p->K != 1 || p->n_t < 1) return 0;
    switch (p->back_form) {
    case SSM_FORM_RECURRENCE: return 0;
    case SSM_FORM_CHUNKED: return 1;
    default:
        return p->n_t >= SSM_AUTO_MIN_NT && p->head_dim >= SSM_AUTO_MIN_DIM && p->d_state >= SSM_AUTO_MIN_DIM
               && p->head_dim * p->d_state >= SSM_AUTO_MIN_STATE && ssm_back_chunked_elems(p) <= SSM_AUTO_MAX_ELEMS;
    }
}

int64_t ssm_scan_chunk_states(const ssm_scan_params * p) {
    if (!ssm_scan_fwd_chunked(p) || !ssm_scan_back_chunked(p)) return 0;
    return p->n_seqs * p->n_head * ((p->n_t + 63) / 64) * p->head_dim * p->d_state;
}
