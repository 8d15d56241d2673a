/*
 * gdn_f32_v3.c -- GATED_DELTA_NET kernels: the forward (gdn_recurrence_body.h) and the
 * backward (gdn_back_recurrence_body.h) of the token recurrence, for float at SIMD level 3
 * (ssm_target_begin.h), as the exported gdn_*_f32_v3 that gdn_dispatch.c calls.
 */
#define SSM_LEVEL 3
#include "../ssm_target_begin.h"
#if !SSM_SKIP_FILE
#include "../ssm_real_f32.h"
#include "../gdn_recurrence_body.h"
#include "../gdn_back_recurrence_body.h"
#include "../gdn_inst.h"

void gdn_fwd_f32_v3(const gdn_params * p, const float * q, const float * k, const float * v, const float * g,
                   const float * beta, const float * state, float * out, void * work, int ith, int nth) {
    const gdn_inputs in = { q, k, v, g, beta, state };
    gdn_fwd(p, &in, out, work, ith, nth);
}

void gdn_back_f32_v3(const gdn_params * p, const float * q, const float * k, const float * v, const float * g,
                    const float * beta, const float * state, const float * grad, float * gin, void * work, int ith,
                    int nth) {
    const gdn_inputs in = { q, k, v, g, beta, state };
    gdn_back(p, &in, grad, gin, work, ith, nth);
}
#endif
#include "../ssm_target_end.h"
