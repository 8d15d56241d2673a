/*
 * ssm_conv_f32_v4.c -- SSM_CONV forward and both backward kernels (ssm_conv_body.h)
 * for float at SIMD level 4 (x86-64-v4, AVX-512), exported under full names for ssm_conv_dispatch.c.
 */
#define SSM_LEVEL 4
#include "../ssm_target_begin.h"
#if !SSM_SKIP_FILE
#include "../ssm_real_f32.h"
#include "../ssm_conv_body.h"
#include "../ssm_inst.h"

void ssm_conv_f32_v4(const ssm_conv_params * p, const float * sx, const float * c, float * y, void * work,
                     int ith, int nth) {
    ssm_conv(p, sx, c, y, work, ith, nth);
}

void ssm_conv_back_f32_v4(const ssm_conv_params * p, const float * c, const float * grad, float * d_sx,
                          void * work, int ith, int nth) {
    ssm_conv_back(p, c, grad, d_sx, work, ith, nth);
}

void ssm_conv_back_weight_f32_v4(const ssm_conv_params * p, const float * sx, const float * grad, float * d_c,
                                 void * work, int ith, int nth) {
    ssm_conv_back_weight(p, sx, grad, d_c, work, ith, nth);
}
#endif
#include "../ssm_target_end.h"
