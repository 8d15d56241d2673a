/*
 * ssm_scan_dispatch.c -- the public SSM_SCAN forward entry points of ssmgrad.h: the work size, and
 * each kernel as a switch over the SIMD level the call runs (ssm_simd_level, capped by
 * params.simd) to the instantiation of csrc/inst/ssm_scan_<type>_v<N>.c. Which form runs (the
 * decode path, the chunked form or the recurrence) is decided inside, by ssm_scan_forms.c's rules.
 */
#include "ssm_scan_layout.h"
#include "ssm_inst.h"

#if SSM_DISPATCH
#define SSM_LEVEL_OF(p) ssm_simd_level((p)->simd)
#else
#define SSM_LEVEL_OF(p) 0   /* one pass, the _v0 files, compiled for the build's own target */
#endif

/* the scratch of one thread (the same at every level: the level-0 count) */
size_t ssm_scan_work_size(const ssm_scan_params * p, size_t elem_size, int nth) {
    if (ssm_scan_decode_path(p)) return 0;   /* no scratch */
    const size_t per = elem_size == sizeof(float) ? ssm_scan_thread_bytes_f32_v0(p) : ssm_scan_thread_bytes_f64_v0(p);
    return per * (size_t) (nth > 0 ? nth : 1);
}

static void scan_f32(const ssm_scan_params * p, const float * s, const float * x, const float * dt,
                     const float * A, const float * B, const float * C, const int64_t * ids, float * out,
                     float * kept, void * work, int ith, int nth) {
    switch (SSM_LEVEL_OF(p)) {
#if SSM_DISPATCH
    case 4: ssm_scan_f32_v4(p, s, x, dt, A, B, C, ids, out, kept, work, ith, nth); break;
    case 3: ssm_scan_f32_v3(p, s, x, dt, A, B, C, ids, out, kept, work, ith, nth); break;
#endif
    default: ssm_scan_f32_v0(p, s, x, dt, A, B, C, ids, out, kept, work, ith, nth); break;
    }
}

void ssm_scan_f32(const ssm_scan_params * p, const float * s, const float * x, const float * dt,
                  const float * A, const float * B, const float * C, const int64_t * ids, float * out,
                  void * work, int ith, int nth) {
    scan_f32(p, s, x, dt, A, B, C, ids, out, NULL, work, ith, nth);
}

void ssm_scan_keep_f32(const ssm_scan_params * p, const float * s, const float * x, const float * dt,
                       const float * A, const float * B, const float * C, const int64_t * ids, float * out,
                       float * chunk_states, void * work, int ith, int nth) {
    scan_f32(p, s, x, dt, A, B, C, ids, out, chunk_states, work, ith, nth);
}

static void scan_f64(const ssm_scan_params * p, const double * s, const double * x, const double * dt,
                     const double * A, const double * B, const double * C, const int64_t * ids, double * out,
                     double * kept, void * work, int ith, int nth) {
    switch (SSM_LEVEL_OF(p)) {
#if SSM_DISPATCH
    case 4: ssm_scan_f64_v4(p, s, x, dt, A, B, C, ids, out, kept, work, ith, nth); break;
    case 3: ssm_scan_f64_v3(p, s, x, dt, A, B, C, ids, out, kept, work, ith, nth); break;
#endif
    default: ssm_scan_f64_v0(p, s, x, dt, A, B, C, ids, out, kept, work, ith, nth); break;
    }
}

void ssm_scan_f64(const ssm_scan_params * p, const double * s, const double * x, const double * dt,
                  const double * A, const double * B, const double * C, const int64_t * ids, double * out,
                  void * work, int ith, int nth) {
    scan_f64(p, s, x, dt, A, B, C, ids, out, NULL, work, ith, nth);
}

void ssm_scan_keep_f64(const ssm_scan_params * p, const double * s, const double * x, const double * dt,
                       const double * A, const double * B, const double * C, const int64_t * ids, double * out,
                       double * chunk_states, void * work, int ith, int nth) {
    scan_f64(p, s, x, dt, A, B, C, ids, out, chunk_states, work, ith, nth);
}
void ssm_scan_decode_into_f32(const ssm_scan_params * p, const float * s, const float * x, const float * dt,
                              const float * A, const float * B, const float * C, const int64_t * ids, float * y,
                              float * st, int ith, int nth) {
    switch (SSM_LEVEL_OF(p)) {
#if SSM_DISPATCH
    case 4: ssm_scan_decode_into_f32_v4(p, s, x, dt, A, B, C, ids, y, st, ith, nth); break;
    case 3: ssm_scan_decode_into_f32_v3(p, s, x, dt, A, B, C, ids, y, st, ith, nth); break;
#endif
    default: ssm_scan_decode_into_f32_v0(p, s, x, dt, A, B, C, ids, y, st, ith, nth); break;
    }
}

void ssm_scan_decode_into_f64(const ssm_scan_params * p, const double * s, const double * x, const double * dt,
                              const double * A, const double * B, const double * C, const int64_t * ids,
                              double * y, double * st, int ith, int nth) {
    switch (SSM_LEVEL_OF(p)) {
#if SSM_DISPATCH
    case 4: ssm_scan_decode_into_f64_v4(p, s, x, dt, A, B, C, ids, y, st, ith, nth); break;
    case 3: ssm_scan_decode_into_f64_v3(p, s, x, dt, A, B, C, ids, y, st, ith, nth); break;
#endif
    default: ssm_scan_decode_into_f64_v0(p, s, x, dt, A, B, C, ids, y, st, ith, nth); break;
    }
}
