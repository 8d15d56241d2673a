/*
 * ssm_scan_back_f32_v4.c -- SSM_SCAN backward: phase 1 in its chunked and recurrence forms, phase 2
 * (ssm_scan_back_*_body.h)
 * for float at SIMD level 4 (x86-64-v4, AVX-512), exported under full names for ssm_scan_back_dispatch.c.
 */
#define SSM_LEVEL 4
#include "../ssm_target_begin.h"
#if !SSM_SKIP_FILE
#include "../ssm_real_f32.h"
#include "../ssm_scan_back_chunked_body.h"
#include "../ssm_scan_back_recurrence_body.h"
#include "../ssm_scan_back_reduce_body.h"
#include "../ssm_inst.h"

void ssm_scan_back_f32_v4(const ssm_scan_params * p, const float * s, const float * x, const float * dt,
                          const float * A, const float * B, const float * C, const int64_t * ids, const float * kept,
                          const float * grad, float * gin, void * work, int ith, int nth) {
    ssm_scan_back(p, s, x, dt, A, B, C, ids, kept, grad, gin, work, ith, nth);
}

void ssm_scan_back_reduce_f32_v4(const ssm_scan_params * p, const int64_t * ids, float * gin, float * d_A,
                                 void * work, int ith, int nth) {
    ssm_scan_back_reduce(p, ids, gin, d_A, work, ith, nth);
}

size_t ssm_scan_back_work_bytes_f32_v4(const ssm_scan_params * p, int nth) {
    return ssm_back_shared_bytes(p) + (size_t) nth * ssm_back_slot_bytes(p);
}
#endif
#include "../ssm_target_end.h"
