/*
 * ssm_scan_recurrence_body.h -- SSM_SCAN forward, written once for `real`: ssm_scan, which takes
 * the form ssm_scan_forms.c picks (the decode path, ssm_scan_decode_body.h; the chunked form,
 * ssm_scan_chunked_body.h; or the token recurrence here), and the recurrence itself. An
 * instantiation file (csrc/inst/ssm_scan_<type>_v<N>.c) includes the three bodies after the
 * element type's header.
 *
 *   s (n_rs, n_head, head_dim, d_state), x (n_seqs, n_t, n_head, head_dim), dt (n_seqs, n_t, n_head),
 *   A (n_head, d_state | 1), B, C (n_seqs, n_t, n_group, d_state), ids (n_seqs,)
 *   -> out = [y (n_seqs, n_t, n_head, head_dim) | states (K, n_seqs, n_head, head_dim, d_state)]
 *   per token: H = e^(softplus(dt) A) H + B (x) (x softplus(dt)),  y = H . C
 *
 * Checked against tests/reference.py's ref_ssm_scan (tests/kernels/test_scan.py). Blocks and the
 * transposed state layout are explained in ssm_scan_layout.h, the token step in ssm_scan_step.h.
 */
#ifndef SSM_SCAN_RECURRENCE_BODY_H
#define SSM_SCAN_RECURRENCE_BODY_H

#ifndef SSM_REAL_H
#error "include ssm_real_f32.h or ssm_real_f64.h first"
#endif

#include "ssm_scan_step.h"

/* the forward's token step: state and y */
static void ssm_step(const ssm_scan_params * p, int64_t Rp, const ssm_rows * v,
                          const real * Hin, real * Hout, real * y) {
    if (p->a_per_state) ssm_step_impl(p, Rp, v, Hin, Hout, y, 1, NULL, 0, 1);
    else if (ssm_vec64(p->simd)) ssm_step_m2_v4(p, Rp, v, Hin, Hout, y, 1);
    else ssm_step_impl(p, Rp, v, Hin, Hout, y, 1, NULL, 0, 0);
}

/* scratch of one thread: one block's state, Mamba-1's transposed A, the row vectors; or the
 * chunked form's buffers */
static size_t ssm_scan_thread_bytes(const ssm_scan_params * p) {
    if (ssm_scan_fwd_chunked(p)) return ssm_scan_chunked_thread_bytes(p);
    ssm_arena a = { NULL, 0 };
    ssm_rows v;
    ssm_take_rows(&a, p, ssm_max_rows_padded(p), &v);
    return a.off;
}

/*
 * Forward.
 *   s (n_rs, n_head, head_dim, d_state), x (n_seqs, n_t, n_head, head_dim), dt (n_seqs, n_t, n_head),
 *   A (n_head, d_state | 1), B, C (n_seqs, n_t, n_group, d_state), ids (n_seqs,)
 *   -> out: y (n_seqs, n_t, n_head, head_dim) then states (K, n_seqs, n_head, head_dim, d_state)
 * For each sequence q: H = s[ids[q]]; per token t and head h:
 *   H = exp(softplus(dt) * A) * H + B (x) (x * softplus(dt));  y = H . C   (the updated H)
 * Thread ith owns a contiguous run of the (sequence, head) pairs and writes only their y and
 * state rows, so any thread count gives the same bits. kept: NULL, or where ssm_scan_chunk_states(p)
 * is not 0 the chunk states for the backward (ssm_scan_keep_*).
 */
static void ssm_scan(const ssm_scan_params * p, const real * s, const real * x, const real * dt,
                   const real * A, const real * B, const real * C, const int64_t * ids,
                   real * out, real * kept, void * work, int ith, int nth) {
    const int64_t n_head = p->n_head, hd = p->head_dim, ds = p->d_state;
    const int64_t n_t = p->n_t, n_seqs = p->n_seqs, K = p->K;
    const int64_t hpg = ssm_heads_per_group(p), bh = ssm_block_heads(p);
    real * y_out = out;
    real * st_out = out + n_seqs * n_t * n_head * hd;

    if (ssm_scan_decode_path(p)) {
        ssm_scan_decode(p, s, x, dt, A, B, C, ids, y_out, st_out, ith, nth);
        return;
    }
    ssm_arena arena = { (char *) work + ssm_scan_thread_bytes(p) * (size_t) ith, 0 };
    int64_t u_lo, u_hi;
    ssm_split(n_seqs * n_head, ith, nth, &u_lo, &u_hi);
    if (ssm_scan_fwd_chunked(p)) {
        ssm_scan_chunked(p, s, x, dt, A, B, C, ids, y_out, st_out, ssm_scan_chunk_states(p) ? kept : NULL, &arena,
                         u_lo, u_hi);
        return;
    }
    ssm_rows v;
    ssm_take_rows(&arena, p, ssm_max_rows_padded(p), &v);

    for (int64_t u = u_lo; u < u_hi;) {
        const int64_t q = u / n_head, h0 = u % n_head;
        const int64_t g_end = (h0 / hpg + 1) * hpg;
        const int64_t h1 = ssm_min64(ssm_min64(h0 + bh, g_end), h0 + (u_hi - u));
        const ssm_block b = ssm_make_block(p, q, h0, h1);

        ssm_rows_begin(p, &b, A, &v);
        ssm_load_state(p, &b, s, ids, v.H);
        for (int64_t t = 0; t < n_t; ++t) {
            ssm_prefetch_token(p, &b, x, dt, B, C, t + SSM_PREFETCH_TOKENS);
            ssm_rows_token(p, &b, x, dt, A, B, C, t, &v);
            ssm_step(p, b.Rp, &v, v.H, v.H, v.y);
            memcpy(y_out + ((q * n_t + t) * n_head + h0) * hd, v.y, b.R * sizeof(real));
            const int64_t k = n_t - 1 - t;     /* this state is snapshot slot k */
            if (k >= 1 && k < K)
                ssm_store_state(p, &b, v.H, st_out + ((k * n_seqs + q) * n_head + h0) * hd * ds);
        }
        ssm_store_state(p, &b, v.H, st_out + (q * n_head + h0) * hd * ds);
        for (int64_t k = ssm_max64(1, n_t); k < K; ++k)   /* slots no token reaches */
            memset(st_out + ((k * n_seqs + q) * n_head + h0) * hd * ds, 0, b.R * ds * sizeof(real));
        u += h1 - h0;
    }
}

#endif /* SSM_SCAN_RECURRENCE_BODY_H */
