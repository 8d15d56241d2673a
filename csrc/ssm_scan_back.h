/*
 * ssm_scan_back.h -- what the backward's two forms of phase 1 share (internal): the buffers that
 * phase 1 fills and phase 2 reduces, two small helpers, and the chunked form's entry points
 * (ssm_scan_back_chunked.c) as ssm_scan_back_recurrence.c calls them. Part of a kernel file's
 * SSM_TMPL body: included once per element type and SIMD pass. No include guard.
 */
#if !defined(SSM_TMPL)
#error "ssm_scan_back.h belongs in a kernel file's SSM_TMPL body"
#endif

/* Buffers shared by all threads: phase 1 writes them, phase 2 reduces them. */
typedef struct {
    REAL * dB_part;   /* [unit][t][n]   partial d_B of each (sequence, group, head run) unit */
    REAL * dC_part;   /* [unit][t][n]   partial d_C */
    REAL * dS_seq;    /* [q][h][p][n]   a_1 * L_1 of each sequence, before the scatter by ids */
    REAL * dA_seq;    /* [q][h][n or 1] d_A of each sequence */
} SFX(ssm_back_shared);


/*
 * Sum of the lanes of each of SSM_LANES vectors: lane i of the result is the sum of v[i]'s
 * lanes. A shuffle tree, each level halving the lanes per vector: a fixed order, and about
 * 2 * SSM_LANES vector operations instead of SSM_LANES horizontal sums.
 */
#define SSM_LO(i, bs) ((((i) / (bs)) < SSM_LANES / (2 * (bs)) ? ((i) / (bs)) * 2 * (bs) \
                       : SSM_LANES + (((i) / (bs)) - SSM_LANES / (2 * (bs))) * 2 * (bs)) + (i) % (bs))
#define SSM_HI(i, bs) (SSM_LO(i, bs) + (bs))
#if SSM_LANES_IS_16
#define SSM_MASK(F, bs) F(0, bs), F(1, bs), F(2, bs), F(3, bs), F(4, bs), F(5, bs), F(6, bs), F(7, bs), \
                        F(8, bs), F(9, bs), F(10, bs), F(11, bs), F(12, bs), F(13, bs), F(14, bs), F(15, bs)
#else
#define SSM_MASK(F, bs) F(0, bs), F(1, bs), F(2, bs), F(3, bs), F(4, bs), F(5, bs), F(6, bs), F(7, bs)
#endif
#define SSM_LEVEL(bs, n_in)                                                                         \
    do {                                                                                            \
        for (int k = 0; k < (n_in) / 2; ++k)                                                        \
            w[k] = SSM_SHUFFLE2(SFX(ivec), w[2 * k], w[2 * k + 1], SSM_MASK(SSM_LO, bs))              \
                   + SSM_SHUFFLE2(SFX(ivec), w[2 * k], w[2 * k + 1], SSM_MASK(SSM_HI, bs));           \
    } while (0)

SSM_INLINE SFX(vec) SFX(ssm_lane_sums)(const SFX(vec) * v) {
    SFX(vec) w[SSM_LANES];
    for (int k = 0; k < SSM_LANES; ++k) w[k] = v[k];
#if SSM_LANES_IS_16
    SSM_LEVEL(8, 16);
    SSM_LEVEL(4, 8);
    SSM_LEVEL(2, 4);
    SSM_LEVEL(1, 2);
#else
    SSM_LEVEL(4, 8);
    SSM_LEVEL(2, 4);
    SSM_LEVEL(1, 2);
#endif
    return w[0];
}
#undef SSM_LEVEL
#undef SSM_MASK
#undef SSM_LO
#undef SSM_HI

/* dst[i] += src[i] */
SSM_MAYBE_UNUSED static void SFX(ssm_add_to)(REAL * restrict dst, const REAL * restrict src, int64_t n) {
    for (int64_t i = 0; i < n; ++i) dst[i] += src[i];
}

/* ssm_scan_back_chunked.c: one thread's scratch, and phase 1 for the units [u_lo, u_hi) */
size_t SFX(ssm_back_chunked_thread_bytes)(const ssm_scan_params * p);
void SFX(ssm_back_phase1_chunked)(const ssm_scan_params * p, const REAL * s, const REAL * x, const REAL * dt,
                                const REAL * A, const REAL * B, const REAL * C, const int64_t * ids,
                                const REAL * grad, REAL * gin, const SFX(ssm_back_shared) * sh, ssm_arena * ta,
                                int64_t u_lo, int64_t u_hi);
