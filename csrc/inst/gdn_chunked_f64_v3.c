/*
 * gdn_chunked_f64_v3.c -- GATED_DELTA_NET kernels of the chunked form (the forward gdn_chunked_body.h, the
 * backward gdn_back_chunked_body.h) for double at SIMD level 3 (ssm_target_begin.h), as the exported
 * gdn_*_chunked_f64_v3 that gdn_dispatch.c calls.
 */
#define SSM_LEVEL 3
#include "../ssm_target_begin.h"
#if !SSM_SKIP_FILE
#include "../ssm_real_f64.h"
#include "../gdn_chunked_body.h"
#include "../gdn_back_chunked_body.h"
#include "../gdn_inst.h"

void gdn_fwd_chunked_f64_v3(const gdn_params * p, const double * q, const double * k, const double * v, const double * g,
                      const double * beta, const double * state, double * out, double * kept, void * work, int ith,
                      int nth) {
    const gdnc_inputs in = { q, k, v, g, beta, state, NULL };
    gdnc_fwd(p, &in, out, kept, work, ith, nth);
}

void gdn_back_chunked_f64_v3(const gdn_params * p, const double * q, const double * k, const double * v, const double * g,
                       const double * beta, const double * state, const double * kept, const double * grad,
                       double * gin, void * work, int ith,
                       int nth) {
    const gdnc_inputs in = { q, k, v, g, beta, state, kept };
    gdnc_back(p, &in, grad, gin, work, ith, nth);
}
#endif
#include "../ssm_target_end.h"
