/*
 * gdn_chunked_f32_v0.c -- GATED_DELTA_NET kernels of the chunked form (the forward gdn_chunked_body.h, the
 * backward gdn_back_chunked_body.h) for float at SIMD level 0 (ssm_target_begin.h), as the exported
 * gdn_*_chunked_f32_v0 that gdn_dispatch.c calls.
 */
#define SSM_LEVEL 0
#include "../ssm_target_begin.h"
#if !SSM_SKIP_FILE
#include "../ssm_real_f32.h"
#include "../gdn_chunked_body.h"
#include "../gdn_back_chunked_body.h"
#include "../gdn_inst.h"

void gdn_fwd_chunked_f32_v0(const gdn_params * p, const float * q, const float * k, const float * v, const float * g,
                      const float * beta, const float * state, float * out, float * kept, void * work, int ith,
                      int nth) {
    const gdnc_inputs in = { q, k, v, g, beta, state, NULL };
    gdnc_fwd(p, &in, out, kept, work, ith, nth);
}

void gdn_back_chunked_f32_v0(const gdn_params * p, const float * q, const float * k, const float * v, const float * g,
                       const float * beta, const float * state, const float * kept, const float * grad, float * gin,
                       void * work, int ith,
                       int nth) {
    const gdnc_inputs in = { q, k, v, g, beta, state, kept };
    gdnc_back(p, &in, grad, gin, work, ith, nth);
}
#endif
#include "../ssm_target_end.h"
