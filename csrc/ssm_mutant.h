/*
 * ssm_mutant.h -- deliberate errors for checking the tests themselves (tests/kernels/test_mutants.py).
 *
 * SSM_MUTANT(id, expr) marks one term of a kernel: in every ordinary build it is (expr), the same
 * code bit for bit. A build compiled with -DSSMGRAD_MUTANTS (the test builds one in a private copy)
 * scales the term by (1 + rel) when mutant `id` is the one selected, at load, by the environment
 * variable SSMGRAD_MUTANT=<name>[:<rel>] (names: ssm_mutant.c; rel defaults to 1e-6); with none
 * selected it computes what the ordinary build computes. expr may be a real or a GCC vector of
 * real (scaled lane by lane). One id marks one gradient region (or output) of one form of a
 * kernel, and may mark that term in each of the form's versions (per SIMD level, per layout).
 */
#ifndef SSM_MUTANT_H
#define SSM_MUTANT_H

enum {
    SSM_MUT_NONE = 0,
    /* SSM_CONV: the loops (float64, and float32 without the blocked kernels) and the float32
     * AVX-512 blocked kernels (ssm_conv_blk_body.h) */
    SSM_MUT_CONV_FWD, SSM_MUT_CONV_BACK, SSM_MUT_CONV_BACK_WEIGHT,
    SSM_MUT_CONV_BLK_FWD, SSM_MUT_CONV_BLK_BACK, SSM_MUT_CONV_BLK_BACK_WEIGHT,
    /* SSM_SCAN forward: the recurrence's y, the chunked form's y and its carried state, the
     * decode path's state update (ssm_scan_update runs it in place) */
    SSM_MUT_SCAN_REC_Y, SSM_MUT_SCAN_CK_Y, SSM_MUT_SCAN_CK_STATE, SSM_MUT_SCAN_DECODE,
    /* SSM_SCAN backward, the recurrence: the carried state gradient (d_s), d_x, d_dt, d_A, d_B, d_C */
    SSM_MUT_BACK_REC_DS, SSM_MUT_BACK_REC_DX, SSM_MUT_BACK_REC_DDT, SSM_MUT_BACK_REC_DA,
    SSM_MUT_BACK_REC_DB, SSM_MUT_BACK_REC_DC,
    /* ... the chunked form */
    SSM_MUT_BACK_CK_DS, SSM_MUT_BACK_CK_DX, SSM_MUT_BACK_CK_DDT, SSM_MUT_BACK_CK_DA,
    SSM_MUT_BACK_CK_DB, SSM_MUT_BACK_CK_DC,
    /* GATED_DELTA_NET, the recurrence's loops: the output, and the backward's d_q, d_k, d_v, d_g,
     * d_beta, carried d_state */
    SSM_MUT_GDN_FWD, SSM_MUT_GDN_DQ, SSM_MUT_GDN_DK, SSM_MUT_GDN_DV, SSM_MUT_GDN_DG, SSM_MUT_GDN_DBETA,
    SSM_MUT_GDN_DSTATE,
    /* ... the same regions in the 64-byte vector recurrence (AVX-512: S a multiple of the lanes) */
    SSM_MUT_GDN_VEC_FWD, SSM_MUT_GDN_VEC_DQ, SSM_MUT_GDN_VEC_DK, SSM_MUT_GDN_VEC_DV,
    SSM_MUT_GDN_VEC_DG, SSM_MUT_GDN_VEC_DBETA, SSM_MUT_GDN_VEC_DSTATE,
    /* ... its one-token (decode) path's delta, which reaches the new state and the output */
    SSM_MUT_GDN_VEC_DECODE,
    /* ... and in the chunked form (gdn_chunked_body.h, gdn_back_chunked_body.h) */
    SSM_MUT_GDN_CK_FWD, SSM_MUT_GDN_CK_DQ, SSM_MUT_GDN_CK_DK, SSM_MUT_GDN_CK_DV,
    SSM_MUT_GDN_CK_DG, SSM_MUT_GDN_CK_DBETA, SSM_MUT_GDN_CK_DSTATE,
    /* ... and in the chunked form of the per-channel gate (gdn_kda_chunked_body.h) */
    SSM_MUT_GDN_KCK_FWD, SSM_MUT_GDN_KCK_DQ, SSM_MUT_GDN_KCK_DK, SSM_MUT_GDN_KCK_DV,
    SSM_MUT_GDN_KCK_DG, SSM_MUT_GDN_KCK_DBETA, SSM_MUT_GDN_KCK_DSTATE,
    SSM_MUT_COUNT
};

#ifdef SSMGRAD_MUTANTS
extern int ssm_mutant_selected;     /* the selected id, SSM_MUT_NONE if none */
extern float ssm_mutant_rel;
#define SSM_MUTANT(id, expr) __extension__({                                   \
        __auto_type ssm_mut_ = (expr);                                           \
        if (ssm_mutant_selected == (id)) ssm_mut_ += ssm_mut_ * ssm_mutant_rel;  \
        ssm_mut_; })
#else
#define SSM_MUTANT(id, expr) (expr)
#endif

#endif /* SSM_MUTANT_H */
