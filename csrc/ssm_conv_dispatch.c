/*
 * ssm_conv_dispatch.c -- the public SSM_CONV entry points of ssmgrad.h: the work size, and each
 * kernel as a switch over the SIMD level the call runs (ssm_simd_level, capped by params.simd) to
 * the instantiation of csrc/inst/ssm_conv_<type>_v<N>.c.
 */
#include "ssm_common.h"
#include "ssm_conv_blk.h"
#include "ssm_inst.h"

/* scratch only for the float32 AVX-512 kernels (ssm_conv_blk_body.h): one buffer per thread */
size_t ssm_conv_work_size(const ssm_conv_params * p, size_t elem_size, int nth) {
    if (elem_size != sizeof(float) || !blk_may_take(p)) return 0;
    return BLK_BUF_BYTES * (size_t) (nth > 0 ? nth : 1);
}

#if SSM_DISPATCH
#define SSM_LEVEL_OF(p) ssm_simd_level((p)->simd)
#else
#define SSM_LEVEL_OF(p) 0   /* one pass, the _v0 files, compiled for the build's own target */
#endif

void ssm_conv_f32(const ssm_conv_params * p, const float * sx, const float * c, float * y, void * work, int ith,
                  int nth) {
    switch (SSM_LEVEL_OF(p)) {
#if SSM_DISPATCH
    case 4: ssm_conv_f32_v4(p, sx, c, y, work, ith, nth); break;
    case 3: ssm_conv_f32_v3(p, sx, c, y, work, ith, nth); break;
#endif
    default: ssm_conv_f32_v0(p, sx, c, y, work, ith, nth); break;
    }
}

void ssm_conv_f64(const ssm_conv_params * p, const double * sx, const double * c, double * y, void * work,
                  int ith, int nth) {
    switch (SSM_LEVEL_OF(p)) {
#if SSM_DISPATCH
    case 4: ssm_conv_f64_v4(p, sx, c, y, work, ith, nth); break;
    case 3: ssm_conv_f64_v3(p, sx, c, y, work, ith, nth); break;
#endif
    default: ssm_conv_f64_v0(p, sx, c, y, work, ith, nth); break;
    }
}
void ssm_conv_back_f32(const ssm_conv_params * p, const float * c, const float * grad, float * d_sx, void * work,
                       int ith, int nth) {
    switch (SSM_LEVEL_OF(p)) {
#if SSM_DISPATCH
    case 4: ssm_conv_back_f32_v4(p, c, grad, d_sx, work, ith, nth); break;
    case 3: ssm_conv_back_f32_v3(p, c, grad, d_sx, work, ith, nth); break;
#endif
    default: ssm_conv_back_f32_v0(p, c, grad, d_sx, work, ith, nth); break;
    }
}

void ssm_conv_back_f64(const ssm_conv_params * p, const double * c, const double * grad, double * d_sx,
                       void * work, int ith, int nth) {
    switch (SSM_LEVEL_OF(p)) {
#if SSM_DISPATCH
    case 4: ssm_conv_back_f64_v4(p, c, grad, d_sx, work, ith, nth); break;
    case 3: ssm_conv_back_f64_v3(p, c, grad, d_sx, work, ith, nth); break;
#endif
    default: ssm_conv_back_f64_v0(p, c, grad, d_sx, work, ith, nth); break;
    }
}
void ssm_conv_back_weight_f32(const ssm_conv_params * p, const float * sx, const float * grad, float * d_c,
                              void * work, int ith, int nth) {
    switch (SSM_LEVEL_OF(p)) {
#if SSM_DISPATCH
    case 4: ssm_conv_back_weight_f32_v4(p, sx, grad, d_c, work, ith, nth); break;
    case 3: ssm_conv_back_weight_f32_v3(p, sx, grad, d_c, work, ith, nth); break;
#endif
    default: ssm_conv_back_weight_f32_v0(p, sx, grad, d_c, work, ith, nth); break;
    }
}

void ssm_conv_back_weight_f64(const ssm_conv_params * p, const double * sx, const double * grad, double * d_c,
                              void * work, int ith, int nth) {
    switch (SSM_LEVEL_OF(p)) {
#if SSM_DISPATCH
    case 4: ssm_conv_back_weight_f64_v4(p, sx, grad, d_c, work, ith, nth); break;
    case 3: ssm_conv_back_weight_f64_v3(p, sx, grad, d_c, work, ith, nth); break;
#endif
    default: ssm_conv_back_weight_f64_v0(p, sx, grad, d_c, work, ith, nth); break;
    }
}
