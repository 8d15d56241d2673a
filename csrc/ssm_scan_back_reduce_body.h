/*
 * ssm_scan_back_reduce_body.h -- SSM_SCAN backward, phase 2, written once for `real`: the
 * reductions over what phase 1 (ssm_scan_back_recurrence_body.h, ssm_scan_back_chunked_body.h)
 * left in the shared part of the work (ssm_scan_back.h), after every thread finished phase 1.
 * An instantiation file (csrc/inst/ssm_scan_back_<type>_v<N>.c) includes it after the element
 * type's header.
 */
#ifndef SSM_SCAN_BACK_REDUCE_BODY_H
#define SSM_SCAN_BACK_REDUCE_BODY_H

#ifndef SSM_REAL_H
#error "include ssm_real_f32.h or ssm_real_f64.h first"
#endif

#include "ssm_scan_back.h"

/*
 * Backward, phase 2 (after every thread finished phase 1): d_B and d_C as the sums of their
 * head runs in run order; d_s[r] as the sum, in increasing q, of the shares of the sequences
 * with ids[q] == r (exactly 0 for rows no id names); d_A (if not NULL) over sequences.
 */
static void ssm_scan_back_reduce(const ssm_scan_params * p, const int64_t * ids, real * gin,
                               real * d_A, void * work, int ith, int nth) {
    const int64_t n_head = p->n_head, hd = p->head_dim, ds = p->d_state, n_t = p->n_t;
    const int64_t n_seqs = p->n_seqs, n_group = p->n_group, rpg = ssm_head_runs_per_group(p);
    const int64_t per_head = hd * ds, N_y = n_seqs * n_t * n_head * hd;
    const int64_t dsA = p->a_per_state ? ds : 1;
    real * d_s = gin;
    real * d_B = gin + p->n_rs * n_head * per_head + N_y + n_seqs * n_t * n_head;
    real * d_C = d_B + n_seqs * n_t * n_group * ds;

    ssm_arena a = { (char *) work, 0 };
    ssm_back_shared sh;
    ssm_back_take_shared(&a, p, &sh);

    int64_t lo, hi;
    ssm_split(n_seqs * n_t * n_group, ith, nth, &lo, &hi);
    for (int64_t row = lo; row < hi; ++row) {          /* row = (q, t, g) */
        const int64_t q = row / (n_t * n_group), t = row / n_group % n_t, g = row % n_group;
        const int64_t unit0 = (q * n_group + g) * rpg;
        /* each element 0 + part_0 + part_1 + ... in unit order, a row at a time (vectorizes; element by element,
         * the unit loop inside, it did not) */
        real * restrict db = d_B + row * ds, * restrict dc = d_C + row * ds;
        for (int64_t n = 0; n < ds; ++n) db[n] = dc[n] = 0;
        for (int64_t c = 0; c < rpg; ++c) {
            const real * restrict pb = sh.dB_part + ((unit0 + c) * n_t + t) * ds;
            const real * restrict pc = sh.dC_part + ((unit0 + c) * n_t + t) * ds;
            for (int64_t n = 0; n < ds; ++n) db[n] += pb[n];
            for (int64_t n = 0; n < ds; ++n) dc[n] += pc[n];
        }
    }

    ssm_split(p->n_rs * n_head, ith, nth, &lo, &hi);
    for (int64_t rh = lo; rh < hi; ++rh) {             /* rh = (row of s, head) */
        const int64_t r = rh / n_head, h = rh % n_head;
        real * dst = d_s + rh * per_head;
        memset(dst, 0, per_head * sizeof(real));
        for (int64_t q = 0; q < n_seqs; ++q) {
            if (ids[q] != r) continue;
            const real * src = sh.dS_seq + (q * n_head + h) * per_head;
            for (int64_t e = 0; e < per_head; ++e) dst[e] += src[e];
        }
    }

    if (d_A) {
        ssm_split(n_head, ith, nth, &lo, &hi);
        for (int64_t h = lo; h < hi; ++h)
            for (int64_t n = 0; n < dsA; ++n) {
                real acc = 0;
                for (int64_t q = 0; q < n_seqs; ++q) acc += sh.dA_seq[(q * n_head + h) * dsA + n];
                d_A[h * dsA + n] = acc;
            }
    }
}

#endif /* SSM_SCAN_BACK_REDUCE_BODY_H */
