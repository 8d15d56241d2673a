/*
 * ssm_mutant.c -- the run-time selection of a mutant (ssm_mutant.h) in a build compiled with
 * -DSSMGRAD_MUTANTS; nothing in any other build.
 */
#include "ssm_mutant.h"

#ifdef SSMGRAD_MUTANTS
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int ssm_mutant_selected = SSM_MUT_NONE;
float ssm_mutant_rel = 1e-6f;

static const char * const ssm_mutant_names[SSM_MUT_COUNT] = {
    [SSM_MUT_CONV_FWD] = "conv_fwd",
    [SSM_MUT_CONV_BACK] = "conv_back",
    [SSM_MUT_CONV_BACK_WEIGHT] = "conv_back_weight",
    [SSM_MUT_CONV_BLK_FWD] = "conv_blk_fwd",
    [SSM_MUT_CONV_BLK_BACK] = "conv_blk_back",
    [SSM_MUT_CONV_BLK_BACK_WEIGHT] = "conv_blk_back_weight",
    [SSM_MUT_SCAN_REC_Y] = "scan_rec_y",
    [SSM_MUT_SCAN_CK_Y] = "scan_ck_y",
    [SSM_MUT_SCAN_CK_STATE] = "scan_ck_state",
    [SSM_MUT_SCAN_DECODE] = "scan_decode",
    [SSM_MUT_BACK_REC_DS] = "back_rec_ds",
    [SSM_MUT_BACK_REC_DX] = "back_rec_dx",
    [SSM_MUT_BACK_REC_DDT] = "back_rec_ddt",
    [SSM_MUT_BACK_REC_DA] = "back_rec_dA",
    [SSM_MUT_BACK_REC_DB] = "back_rec_dB",
    [SSM_MUT_BACK_REC_DC] = "back_rec_dC",
    [SSM_MUT_BACK_CK_DS] = "back_ck_ds",
    [SSM_MUT_BACK_CK_DX] = "back_ck_dx",
    [SSM_MUT_BACK_CK_DDT] = "back_ck_ddt",
    [SSM_MUT_BACK_CK_DA] = "back_ck_dA",
    [SSM_MUT_BACK_CK_DB] = "back_ck_dB",
    [SSM_MUT_BACK_CK_DC] = "back_ck_dC",
    [SSM_MUT_GDN_FWD] = "gdn_fwd",
    [SSM_MUT_GDN_DQ] = "gdn_dq",
    [SSM_MUT_GDN_DK] = "gdn_dk",
    [SSM_MUT_GDN_DV] = "gdn_dv",
    [SSM_MUT_GDN_DG] = "gdn_dg",
    [SSM_MUT_GDN_DBETA] = "gdn_dbeta",
    [SSM_MUT_GDN_DSTATE] = "gdn_dstate",
    [SSM_MUT_GDN_VEC_FWD] = "gdn_vec_fwd",
    [SSM_MUT_GDN_VEC_DQ] = "gdn_vec_dq",
    [SSM_MUT_GDN_VEC_DK] = "gdn_vec_dk",
    [SSM_MUT_GDN_VEC_DV] = "gdn_vec_dv",
    [SSM_MUT_GDN_VEC_DG] = "gdn_vec_dg",
    [SSM_MUT_GDN_VEC_DBETA] = "gdn_vec_dbeta",
    [SSM_MUT_GDN_VEC_DSTATE] = "gdn_vec_dstate",
    [SSM_MUT_GDN_VEC_DECODE] = "gdn_vec_decode",
    [SSM_MUT_GDN_CK_FWD] = "gdn_ck_fwd",
    [SSM_MUT_GDN_CK_DQ] = "gdn_ck_dq",
    [SSM_MUT_GDN_CK_DK] = "gdn_ck_dk",
    [SSM_MUT_GDN_CK_DV] = "gdn_ck_dv",
    [SSM_MUT_GDN_CK_DG] = "gdn_ck_dg",
    [SSM_MUT_GDN_CK_DBETA] = "gdn_ck_dbeta",
    [SSM_MUT_GDN_CK_DSTATE] = "gdn_ck_dstate",
    [SSM_MUT_GDN_KCK_FWD] = "gdn_kck_fwd",
    [SSM_MUT_GDN_KCK_DQ] = "gdn_kck_dq",
    [SSM_MUT_GDN_KCK_DK] = "gdn_kck_dk",
    [SSM_MUT_GDN_KCK_DV] = "gdn_kck_dv",
    [SSM_MUT_GDN_KCK_DG] = "gdn_kck_dg",
    [SSM_MUT_GDN_KCK_DBETA] = "gdn_kck_dbeta",
    [SSM_MUT_GDN_KCK_DSTATE] = "gdn_kck_dstate",
};

/* SSMGRAD_MUTANT=<name>[:<rel>], read once when the library loads (before any kernel runs). An
 * unknown name selects nothing and says so on stderr. */
__attribute__((constructor)) static void ssm_mutant_select(void) {
    const char * env = getenv("SSMGRAD_MUTANT");
    if (!env || !*env) return;
    const char * colon = strchr(env, ':');
    const size_t len = colon ? (size_t) (colon - env) : strlen(env);
    for (int i = 1; i < SSM_MUT_COUNT; ++i)
        if (ssm_mutant_names[i] && strlen(ssm_mutant_names[i]) == len && !strncmp(env, ssm_mutant_names[i], len))
            ssm_mutant_selected = i;
    if (colon) ssm_mutant_rel = strtof(colon + 1, NULL);
    if (ssm_mutant_selected == SSM_MUT_NONE)
        fprintf(stderr, "ssmgrad: SSMGRAD_MUTANT=%s names no mutant\n", env);
    else
        fprintf(stderr, "ssmgrad: mutant %s, relative change %g\n", ssm_mutant_names[ssm_mutant_selected],
                (double) ssm_mutant_rel);
}
#else
typedef int ssm_mutant_none;   /* ISO C: a translation unit declares something */
#endif
