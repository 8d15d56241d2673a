/*
 * ssm_scan_back.h -- what the backward's two forms of phase 1 share (internal): the buffers that
 * phase 1 fills and phase 2 reduces, two small helpers, and the chunked form's entry points
 * (ssm_scan_back_chunked_body.h) as ssm_scan_back_recurrence_body.h calls them. Part of a kernel body:
 * included after the element type's header, once per translation unit.
 */
#ifndef SSM_SCAN_BACK_H
#define SSM_SCAN_BACK_H

#include "ssm_scan_rows.h"

/* Buffers shared by all threads: phase 1 writes them, phase 2 reduces them. */
typedef struct {
    real * dB_part;   /* [unit][t][n]   partial d_B of each (sequence, group, head run) unit */
    real * dC_part;   /* [unit][t][n]   partial d_C */
    real * dS_seq;    /* [q][h][p][n]   a_1 * L_1 of each sequence, before the scatter by ids */
    real * dA_seq;    /* [q][h][n or 1] d_A of each sequence */
} ssm_back_shared;



/* the shared buffers at the start of the work (the same takes in both phases) */
static void ssm_back_take_shared(ssm_arena * a, const ssm_scan_params * p,
                                      ssm_back_shared * sh) {
    const size_t e = sizeof(real);
    const size_t part = (size_t) ssm_scan_back_units(p) * p->n_t * p->d_state * e;
    sh->dB_part = ssm_take(a, part);
    sh->dC_part = ssm_take(a, part);
    sh->dS_seq = ssm_take(a, (size_t) p->n_seqs * p->n_head * p->head_dim * p->d_state * e);
    sh->dA_seq = ssm_take(a, (size_t) p->n_seqs * p->n_head * (p->a_per_state ? p->d_state : 1) * e);
}

static size_t ssm_back_shared_bytes(const ssm_scan_params * p) {
    ssm_arena a = { NULL, 0 };
    ssm_back_shared sh;
    ssm_back_take_shared(&a, p, &sh);
    return a.off;
}

/*
 * Sum of the lanes of each of SSM_LANES vectors: lane i of the result is the sum of v[i]'s
 * lanes. A shuffle tree, each level halving the lanes per vector: a fixed order, and about
 * 2 * SSM_LANES vector operations instead of SSM_LANES horizontal sums.
 */
#define SSM_LO(i, bs) ((((i) / (bs)) < SSM_LANES / (2 * (bs)) ? ((i) / (bs)) * 2 * (bs) \
                       : SSM_LANES + (((i) / (bs)) - SSM_LANES / (2 * (bs))) * 2 * (bs)) + (i) % (bs))
#define SSM_HI(i, bs) (SSM_LO(i, bs) + (bs))
#if (REAL_LANES == 16)
#define SSM_MASK(F, bs) F(0, bs), F(1, bs), F(2, bs), F(3, bs), F(4, bs), F(5, bs), F(6, bs), F(7, bs), \
                        F(8, bs), F(9, bs), F(10, bs), F(11, bs), F(12, bs), F(13, bs), F(14, bs), F(15, bs)
#else
#define SSM_MASK(F, bs) F(0, bs), F(1, bs), F(2, bs), F(3, bs), F(4, bs), F(5, bs), F(6, bs), F(7, bs)
#endif
#define SSM_SUM_LEVEL(bs, n_in)                                                                         \
    do {                                                                                            \
        for (int k = 0; k < (n_in) / 2; ++k)                                                        \
            w[k] = SSM_SHUFFLE2(ivec, w[2 * k], w[2 * k + 1], SSM_MASK(SSM_LO, bs))              \
                   + SSM_SHUFFLE2(ivec, w[2 * k], w[2 * k + 1], SSM_MASK(SSM_HI, bs));           \
    } while (0)

SSM_INLINE vec ssm_lane_sums(const vec * v) {
    vec w[SSM_LANES];
    for (int k = 0; k < SSM_LANES; ++k) w[k] = v[k];
#if (REAL_LANES == 16)
    SSM_SUM_LEVEL(8, 16);
    SSM_SUM_LEVEL(4, 8);
    SSM_SUM_LEVEL(2, 4);
    SSM_SUM_LEVEL(1, 2);
#else
    SSM_SUM_LEVEL(4, 8);
    SSM_SUM_LEVEL(2, 4);
    SSM_SUM_LEVEL(1, 2);
#endif
    return w[0];
}
#undef SSM_SUM_LEVEL
#undef SSM_MASK
#undef SSM_LO
#undef SSM_HI

/* dst[i] += src[i] */
static void ssm_add_to(real * restrict dst, const real * restrict src, int64_t n) {
    for (int64_t i = 0; i < n; ++i) dst[i] += src[i];
}

#endif /* SSM_SCAN_BACK_H */
