/*
 * ssm_scan_recurrence.c -- SSM_SCAN forward: the public ssm_scan_* and ssm_scan_work_size, which
 * pick the form (the decode path, ssm_scan_decode.c; the chunked form, ssm_scan_chunked.c; or the
 * token recurrence here), and the recurrence itself.
 *
 *   s (n_rs, n_head, head_dim, d_state), x (n_seqs, n_t, n_head, head_dim), dt (n_seqs, n_t, n_head),
 *   A (n_head, d_state | 1), B, C (n_seqs, n_t, n_group, d_state), ids (n_seqs,)
 *   -> out = [y (n_seqs, n_t, n_head, head_dim) | states (K, n_seqs, n_head, head_dim, d_state)]
 *   per token: H = e^(softplus(dt) A) H + B (x) (x softplus(dt)),  y = H . C
 *
 * Checked against tests/reference.py's ref_scan (tests/test_scan.py). Written once for a type REAL
 * and compiled for float and double (and, on x86-64, for each SIMD level of the runtime dispatch):
 * see ssm_instantiate.h. Blocks and the transposed state layout are explained in
 * ssm_scan_layout.h, the token step in ssm_scan_step.h.
 */
#ifndef SSM_TMPL

#include <stdlib.h>

#include "ssm_scan_layout.h"

#define SSM_TMPL_FILE "ssm_scan_recurrence.c"
#include "ssm_instantiate.h"

#if SSM_DISPATCH
void ssm_scan_f32(const ssm_scan_params * p, const float * s, const float * x, const float * dt,
                  const float * A, const float * B, const float * C, const int64_t * ids, float * out,
                  void * work, int ith, int nth) {
    SSM_DISPATCH_CALL(ssm_scan_f32, p->simd, (p, s, x, dt, A, B, C, ids, out, work, ith, nth));
}
void ssm_scan_f64(const ssm_scan_params * p, const double * s, const double * x, const double * dt,
                  const double * A, const double * B, const double * C, const int64_t * ids, double * out,
                  void * work, int ith, int nth) {
    SSM_DISPATCH_CALL(ssm_scan_f64, p->simd, (p, s, x, dt, A, B, C, ids, out, work, ith, nth));
}
#endif

/*
 * Which form the forward takes: p->fwd_form (SSM_FORM_*). The chunked form covers Mamba-2 (one
 * decay per head) with K == 1 outside the decode path (n_t <= SSM_DECODE_MAX_T); every other call
 * takes the recurrence. Auto picks it by shape alone (never by thread count, so the bits do not
 * depend on it).
 */
/* Auto: the shapes where the chunked forward measured faster than the recurrence (AVX-512,
 * float32, 1 and 2 threads; benchmarks/ab.py forms fwd and benchmarks/README.md): head_dim >= 32
 * and d_state >= 128 (chunked/recurrence at n_t 256, 1 thread: 0.83 at 64 x 128, 0.86 at
 * 128 x 128, 0.95 at 32 x 128; 1.02-1.17 at 64 x 64 and 128 x 64, 1.1-1.4 at 32 x 64 and below,
 * 1.12 at 16 x 128), n_t >= 64 (at 24 x 64 x 128: 1.2-1.5 at n_t 8-16, 0.9-1.05 at 32, 0.97-1.04
 * at 64, 0.6-0.8 from 512 on). Shape only: the thread count never changes the form (or the bits). */
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

size_t ssm_scan_work_size(const ssm_scan_params * p, size_t elem_size, int nth) {
    if (ssm_scan_decode_path(p)) return 0;   /* no scratch */
    const size_t per = elem_size == sizeof(float) ? SSM_BASE_NAME(ssm_scan_thread_bytes_f32)(p)
                                                  : SSM_BASE_NAME(ssm_scan_thread_bytes_f64)(p);
    return per * (size_t) (nth > 0 ? nth : 1);
}

#else /* SSM_TMPL: the kernel for one REAL */

#include "ssm_scan_step.h"
#include "ssm_scan_forms.h"

/* scratch of one thread: one block's state, Mamba-1's transposed A, the row vectors; or the
 * chunked form's buffers */
static size_t SFX(ssm_scan_thread_bytes)(const ssm_scan_params * p) {
    if (ssm_scan_fwd_chunked(p)) return SFX(ssm_scan_chunked_thread_bytes)(p);
    ssm_arena a = { NULL, 0 };
    SFX(ssm_rows) v;
    SFX(ssm_take_rows)(&a, p, ssm_max_rows_padded(p), &v);
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
 * state rows, so any thread count gives the same bits.
 */
SSM_KERNEL void SFX(ssm_scan)(const ssm_scan_params * p, const REAL * s, const REAL * x, const REAL * dt,
                   const REAL * A, const REAL * B, const REAL * C, const int64_t * ids,
                   REAL * out, void * work, int ith, int nth) {
    const int64_t n_head = p->n_head, hd = p->head_dim, ds = p->d_state;
    const int64_t n_t = p->n_t, n_seqs = p->n_seqs, K = p->K;
    const int64_t hpg = ssm_heads_per_group(p), bh = ssm_block_heads(p);
    REAL * y_out = out;
    REAL * st_out = out + n_seqs * n_t * n_head * hd;

    if (ssm_scan_decode_path(p)) {
        SFX(ssm_scan_decode)(p, s, x, dt, A, B, C, ids, y_out, st_out, ith, nth);
        return;
    }
    ssm_arena arena = { (char *) work + SFX(ssm_scan_thread_bytes)(p) * (size_t) ith, 0 };
    int64_t u_lo, u_hi;
    ssm_split(n_seqs * n_head, ith, nth, &u_lo, &u_hi);
    if (ssm_scan_fwd_chunked(p)) {
        SFX(ssm_scan_chunked)(p, s, x, dt, A, B, C, ids, y_out, st_out, &arena, u_lo, u_hi);
        return;
    }
    SFX(ssm_rows) v;
    SFX(ssm_take_rows)(&arena, p, ssm_max_rows_padded(p), &v);

    for (int64_t u = u_lo; u < u_hi;) {
        const int64_t q = u / n_head, h0 = u % n_head;
        const int64_t g_end = (h0 / hpg + 1) * hpg;
        const int64_t h1 = ssm_min64(ssm_min64(h0 + bh, g_end), h0 + (u_hi - u));
        const ssm_block b = ssm_make_block(p, q, h0, h1);

        SFX(ssm_rows_begin)(p, &b, A, &v);
        SFX(ssm_load_state)(p, &b, s, ids, v.H);
        for (int64_t t = 0; t < n_t; ++t) {
            SFX(ssm_prefetch_token)(p, &b, x, dt, B, C, t + SSM_PREFETCH_TOKENS);
            SFX(ssm_rows_token)(p, &b, x, dt, A, B, C, t, &v);
            SFX(ssm_step)(p, b.Rp, &v, v.H, v.H, v.y);
            memcpy(y_out + ((q * n_t + t) * n_head + h0) * hd, v.y, b.R * sizeof(REAL));
            const int64_t k = n_t - 1 - t;     /* this state is snapshot slot k */
            if (k >= 1 && k < K)
                SFX(ssm_store_state)(p, &b, v.H, st_out + ((k * n_seqs + q) * n_head + h0) * hd * ds);
        }
        SFX(ssm_store_state)(p, &b, v.H, st_out + (q * n_head + h0) * hd * ds);
        for (int64_t k = ssm_max64(1, n_t); k < K; ++k)   /* slots no token reaches */
            memset(st_out + ((k * n_seqs + q) * n_head + h0) * hd * ds, 0, b.R * ds * sizeof(REAL));
        u += h1 - h0;
    }
}

#endif /* SSM_TMPL */
