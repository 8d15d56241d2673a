/*
 * ssm_scan_back_dispatch.c -- the public SSM_SCAN backward entry points of ssmgrad.h: the units,
 * the work size, and both phases as a switch over the SIMD level the call runs (ssm_simd_level,
 * capped by params.simd) to the instantiation of csrc/inst/ssm_scan_back_<type>_v<N>.c. Which
 * form phase 1 takes is decided inside, by ssm_scan_forms.c's rule.
 */
#include "ssm_scan_layout.h"
#include "ssm_inst.h"

#if SSM_DISPATCH
#define SSM_LEVEL_OF(p) ssm_simd_level((p)->simd)
#else
#define SSM_LEVEL_OF(p) 0   /* one pass, the _v0 files, compiled for the build's own target */
#endif

int64_t ssm_scan_back_units(const ssm_scan_params * p) {
    return p->n_seqs * p->n_group * ssm_head_runs_per_group(p);
}

/* the shared part and nth threads' slots (the same at every level: the level-0 count) */
size_t ssm_scan_back_work_size(const ssm_scan_params * p, size_t elem_size, int nth) {
    const int n = nth > 0 ? nth : 1;
    return elem_size == sizeof(float) ? ssm_scan_back_work_bytes_f32_v0(p, n) : ssm_scan_back_work_bytes_f64_v0(p, n);
}

static void scan_back_f32(const ssm_scan_params * p, const float * s, const float * x, const float * dt,
                          const float * A, const float * B, const float * C, const int64_t * ids,
                          const float * kept, const float * grad, float * gin, void * work, int ith, int nth) {
    switch (SSM_LEVEL_OF(p)) {
#if SSM_DISPATCH
    case 4: ssm_scan_back_f32_v4(p, s, x, dt, A, B, C, ids, kept, grad, gin, work, ith, nth); break;
    case 3: ssm_scan_back_f32_v3(p, s, x, dt, A, B, C, ids, kept, grad, gin, work, ith, nth); break;
#endif
    default: ssm_scan_back_f32_v0(p, s, x, dt, A, B, C, ids, kept, grad, gin, work, ith, nth); break;
    }
}

void ssm_scan_back_f32(const ssm_scan_params * p, const float * s, const float * x, const float * dt,
                       const float * A, const float * B, const float * C, const int64_t * ids,
                       const float * grad, float * gin, void * work, int ith, int nth) {
    scan_back_f32(p, s, x, dt, A, B, C, ids, NULL, grad, gin, work, ith, nth);
}

void ssm_scan_back_kept_f32(const ssm_scan_params * p, const float * s, const float * x, const float * dt,
                            const float * A, const float * B, const float * C, const int64_t * ids,
                            const float * chunk_states, const float * grad, float * gin, void * work, int ith,
                            int nth) {
    scan_back_f32(p, s, x, dt, A, B, C, ids, ssm_scan_chunk_states(p) ? chunk_states : NULL, grad, gin, work, ith, nth);
}

static void scan_back_f64(const ssm_scan_params * p, const double * s, const double * x, const double * dt,
                          const double * A, const double * B, const double * C, const int64_t * ids,
                          const double * kept, const double * grad, double * gin, void * work, int ith, int nth) {
    switch (SSM_LEVEL_OF(p)) {
#if SSM_DISPATCH
    case 4: ssm_scan_back_f64_v4(p, s, x, dt, A, B, C, ids, kept, grad, gin, work, ith, nth); break;
    case 3: ssm_scan_back_f64_v3(p, s, x, dt, A, B, C, ids, kept, grad, gin, work, ith, nth); break;
#endif
    default: ssm_scan_back_f64_v0(p, s, x, dt, A, B, C, ids, kept, grad, gin, work, ith, nth); break;
    }
}

void ssm_scan_back_f64(const ssm_scan_params * p, const double * s, const double * x, const double * dt,
                       const double * A, const double * B, const double * C, const int64_t * ids,
                       const double * grad, double * gin, void * work, int ith, int nth) {
    scan_back_f64(p, s, x, dt, A, B, C, ids, NULL, grad, gin, work, ith, nth);
}

void ssm_scan_back_kept_f64(const ssm_scan_params * p, const double * s, const double * x, const double * dt,
                            const double * A, const double * B, const double * C, const int64_t * ids,
                            const double * chunk_states, const double * grad, double * gin, void * work, int ith,
                            int nth) {
    scan_back_f64(p, s, x, dt, A, B, C, ids, ssm_scan_chunk_states(p) ? chunk_states : NULL, grad, gin, work, ith, nth);
}
void ssm_scan_back_reduce_f32(const ssm_scan_params * p, const int64_t * ids, float * gin, float * d_A,
                              void * work, int ith, int nth) {
    switch (SSM_LEVEL_OF(p)) {
#if SSM_DISPATCH
    case 4: ssm_scan_back_reduce_f32_v4(p, ids, gin, d_A, work, ith, nth); break;
    case 3: ssm_scan_back_reduce_f32_v3(p, ids, gin, d_A, work, ith, nth); break;
#endif
    default: ssm_scan_back_reduce_f32_v0(p, ids, gin, d_A, work, ith, nth); break;
    }
}

void ssm_scan_back_reduce_f64(const ssm_scan_params * p, const int64_t * ids, double * gin, double * d_A,
                              void * work, int ith, int nth) {
    switch (SSM_LEVEL_OF(p)) {
#if SSM_DISPATCH
    case 4: ssm_scan_back_reduce_f64_v4(p, ids, gin, d_A, work, ith, nth); break;
    case 3: ssm_scan_back_reduce_f64_v3(p, ids, gin, d_A, work, ith, nth); break;
#endif
    default: ssm_scan_back_reduce_f64_v0(p, ids, gin, d_A, work, ith, nth); break;
    }
}
