/*
 * ssm_scan_forms.h -- the forward's forms, one file each, as ssm_scan_recurrence.c's ssm_scan_*
 * calls them (internal). Part of a kernel file's SSM_TMPL body: the names are per element type
 * and SIMD pass (SFX), so each pass of ssm_scan_recurrence.c calls the same pass of the others.
 * No include guard: included once per type and pass.
 */
#if !defined(SSM_TMPL)
#error "ssm_scan_forms.h belongs in a kernel file's SSM_TMPL body"
#endif

/* ssm_scan_decode.c: the decode path for thread ith of nth, y and the K state slots to separate
 * buffers (precondition: ssm_scan_decode_path(p)) */
void SFX(ssm_scan_decode)(const ssm_scan_params * p, const REAL * s, const REAL * x, const REAL * dt,
                          const REAL * A, const REAL * B, const REAL * C, const int64_t * ids,
                          REAL * y_out, REAL * st_out, int ith, int nth);

/* ssm_scan_chunked.c: one thread's scratch, and the (sequence, head) pairs [u_lo, u_hi) with
 * buffers from the thread's arena (precondition: ssm_scan_fwd_chunked(p)) */
size_t SFX(ssm_scan_chunked_thread_bytes)(const ssm_scan_params * p);
void SFX(ssm_scan_chunked)(const ssm_scan_params * p, const REAL * s, const REAL * x, const REAL * dt,
                           const REAL * A, const REAL * B, const REAL * C, const int64_t * ids, REAL * y_out,
                           REAL * st_out, ssm_arena * arena, int64_t u_lo, int64_t u_hi);
