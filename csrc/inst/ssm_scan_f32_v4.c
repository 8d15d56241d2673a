/*
 * ssm_scan_f32_v4.c -- SSM_SCAN forward: its decode path, chunked form and recurrence
 * (ssm_scan_*_body.h)
 * for float at SIMD level 4 (x86-64-v4, AVX-512), exported under full names for ssm_scan_dispatch.c.
 */
#define SSM_LEVEL 4
#include "../ssm_target_begin.h"
#if !SSM_SKIP_FILE
#include "../ssm_real_f32.h"
#include "../ssm_scan_decode_body.h"
#include "../ssm_scan_chunked_body.h"
#include "../ssm_scan_recurrence_body.h"
#include "../ssm_inst.h"

void ssm_scan_f32_v4(const ssm_scan_params * p, const float * s, const float * x, const float * dt,
                     const float * A, const float * B, const float * C, const int64_t * ids, float * out,
                     float * kept, void * work, int ith, int nth) {
    ssm_scan(p, s, x, dt, A, B, C, ids, out, kept, work, ith, nth);
}

void ssm_scan_decode_into_f32_v4(const ssm_scan_params * p, const float * s, const float * x, const float * dt,
                                 const float * A, const float * B, const float * C, const int64_t * ids,
                                 float * y, float * st, int ith, int nth) {
    ssm_scan_decode(p, s, x, dt, A, B, C, ids, y, st, ith, nth);
}

size_t ssm_scan_thread_bytes_f32_v4(const ssm_scan_params * p) {
    return ssm_scan_thread_bytes(p);
}
#endif
#include "../ssm_target_end.h"
