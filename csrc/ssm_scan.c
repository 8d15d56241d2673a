/*
 * ssm_scan.c -- SSM_SCAN forward: out = [y | K state slots].
 *
 * Written once for a type REAL and compiled for float and double: see
 * ssm_instantiate.h. Blocks and the transposed state layout are explained in
 * ssm_scan_layout.h.
 */
#ifndef SSM_TMPL

#include "ssm_scan_layout.h"

#define SSM_TMPL_FILE "ssm_scan.c"
#include "ssm_instantiate.h"

size_t ssm_scan_work_size(const ssm_scan_params * p, size_t elem_size, int nth) {
    const size_t per = elem_size == sizeof(float) ? ssm_scan_thread_bytes_f32(p)
                                                  : ssm_scan_thread_bytes_f64(p);
    return per * (size_t) (nth > 0 ? nth : 1);
}

int ssm_v4_off = 0;

void ssm_set_avx512_kernels(int on) { ssm_v4_off = !on; }

int ssm_avx512_kernels(void) { return ssm_cpu_v4(); }

const char * ssm_simd_compiled(void) {
#if SSM_HAVE_CLONES
    return "x86-64-v4 (AVX-512), x86-64-v3 (AVX2+FMA), x86-64 baseline (runtime dispatch)";
#elif defined(__AVX512F__)
    return "AVX-512 (compile-time)";
#elif defined(__AVX2__)
    return "AVX2 (compile-time)";
#else
    return "portable C (compiler auto-vectorization only)";
#endif
}

const char * ssm_simd_selected(void) {
#if SSM_HAVE_CLONES
    __builtin_cpu_init();
    if (__builtin_cpu_supports("x86-64-v4")) return "x86-64-v4";
    if (__builtin_cpu_supports("x86-64-v3")) return "x86-64-v3";
    return "x86-64";
#else
    return ssm_simd_compiled();
#endif
}

#else /* SSM_TMPL: the kernel for one REAL */

#include "ssm_scan_layout.h"

/* scratch of one thread: one block's state, Mamba-1's transposed A, the row vectors */
static size_t SFX(ssm_scan_thread_bytes)(const ssm_scan_params * p) {
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
void SFX(ssm_scan)(const ssm_scan_params * p, const REAL * s, const REAL * x, const REAL * dt,
                   const REAL * A, const REAL * B, const REAL * C, const int64_t * ids,
                   REAL * out, void * work, int ith, int nth) {
    const int64_t n_head = p->n_head, hd = p->head_dim, ds = p->d_state;
    const int64_t n_t = p->n_t, n_seqs = p->n_seqs, K = p->K;
    const int64_t hpg = ssm_heads_per_group(p), bh = ssm_block_heads(p);
    REAL * y_out = out;
    REAL * st_out = out + n_seqs * n_t * n_head * hd;

    ssm_arena arena = { (char *) work + SFX(ssm_scan_thread_bytes)(p) * (size_t) ith, 0 };
    SFX(ssm_rows) v;
    SFX(ssm_take_rows)(&arena, p, ssm_max_rows_padded(p), &v);

    int64_t u_lo, u_hi;
    ssm_split(n_seqs * n_head, ith, nth, &u_lo, &u_hi);

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
