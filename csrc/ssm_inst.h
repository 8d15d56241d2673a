/*
 * ssm_inst.h -- the per-(element type, SIMD level) kernels that the instantiation files
 * csrc/inst/ssm_<op>_<type>_v<N>.c define and the dispatchers (ssm_conv_dispatch.c,
 * ssm_scan_dispatch.c, ssm_scan_back_dispatch.c) call (internal). Without runtime dispatch
 * only the _v0 ones exist. Each does what the public kernel of the same name without its
 * _v<N> suffix does (ssmgrad.h); the others:
 *   ssm_scan_decode_into_*     the decode path alone, y and the K state slots to separate dense
 *                              buffers; st may be s itself when K = 1, n_rs = n_seqs, ids[q] = q
 *                              and s is dense; ids may be NULL (the identity). Precondition:
 *                              ssm_scan_decode_path(p). The glue's in-place cache update.
 *   ssm_scan_thread_bytes_*    the forward's scratch per thread
 *   ssm_scan_back_work_bytes_* the backward's scratch for nth threads
 */
#ifndef SSM_INST_H
#define SSM_INST_H

#include "ssmgrad.h"

/* csrc/inst/ssm_conv_f32_v*.c */
void ssm_conv_f32_v4(const ssm_conv_params * p, const float * sx, const float * c, float * y, void * work,
                     int ith, int nth);
void ssm_conv_back_f32_v4(const ssm_conv_params * p, const float * c, const float * grad, float * d_sx,
                          void * work, int ith, int nth);
void ssm_conv_back_weight_f32_v4(const ssm_conv_params * p, const float * sx, const float * grad, float * d_c,
                                 void * work, int ith, int nth);
void ssm_conv_f32_v3(const ssm_conv_params * p, const float * sx, const float * c, float * y, void * work,
                     int ith, int nth);
void ssm_conv_back_f32_v3(const ssm_conv_params * p, const float * c, const float * grad, float * d_sx,
                          void * work, int ith, int nth);
void ssm_conv_back_weight_f32_v3(const ssm_conv_params * p, const float * sx, const float * grad, float * d_c,
                                 void * work, int ith, int nth);
void ssm_conv_f32_v0(const ssm_conv_params * p, const float * sx, const float * c, float * y, void * work,
                     int ith, int nth);
void ssm_conv_back_f32_v0(const ssm_conv_params * p, const float * c, const float * grad, float * d_sx,
                          void * work, int ith, int nth);
void ssm_conv_back_weight_f32_v0(const ssm_conv_params * p, const float * sx, const float * grad, float * d_c,
                                 void * work, int ith, int nth);
/* csrc/inst/ssm_conv_f64_v*.c */
void ssm_conv_f64_v4(const ssm_conv_params * p, const double * sx, const double * c, double * y, void * work,
                     int ith, int nth);
void ssm_conv_back_f64_v4(const ssm_conv_params * p, const double * c, const double * grad, double * d_sx,
                          void * work, int ith, int nth);
void ssm_conv_back_weight_f64_v4(const ssm_conv_params * p, const double * sx, const double * grad, double * d_c,
                                 void * work, int ith, int nth);
void ssm_conv_f64_v3(const ssm_conv_params * p, const double * sx, const double * c, double * y, void * work,
                     int ith, int nth);
void ssm_conv_back_f64_v3(const ssm_conv_params * p, const double * c, const double * grad, double * d_sx,
                          void * work, int ith, int nth);
void ssm_conv_back_weight_f64_v3(const ssm_conv_params * p, const double * sx, const double * grad, double * d_c,
                                 void * work, int ith, int nth);
void ssm_conv_f64_v0(const ssm_conv_params * p, const double * sx, const double * c, double * y, void * work,
                     int ith, int nth);
void ssm_conv_back_f64_v0(const ssm_conv_params * p, const double * c, const double * grad, double * d_sx,
                          void * work, int ith, int nth);
void ssm_conv_back_weight_f64_v0(const ssm_conv_params * p, const double * sx, const double * grad, double * d_c,
                                 void * work, int ith, int nth);
/* csrc/inst/ssm_scan_f32_v*.c */
void ssm_scan_f32_v4(const ssm_scan_params * p, const float * s, const float * x, const float * dt,
                     const float * A, const float * B, const float * C, const int64_t * ids, float * out, float * kept,
                     void * work, int ith, int nth);
void ssm_scan_decode_into_f32_v4(const ssm_scan_params * p, const float * s, const float * x, const float * dt,
                                 const float * A, const float * B, const float * C, const int64_t * ids,
                                 float * y, float * st, int ith, int nth);
size_t ssm_scan_thread_bytes_f32_v4(const ssm_scan_params * p);
void ssm_scan_f32_v3(const ssm_scan_params * p, const float * s, const float * x, const float * dt,
                     const float * A, const float * B, const float * C, const int64_t * ids, float * out, float * kept,
                     void * work, int ith, int nth);
void ssm_scan_decode_into_f32_v3(const ssm_scan_params * p, const float * s, const float * x, const float * dt,
                                 const float * A, const float * B, const float * C, const int64_t * ids,
                                 float * y, float * st, int ith, int nth);
size_t ssm_scan_thread_bytes_f32_v3(const ssm_scan_params * p);
void ssm_scan_f32_v0(const ssm_scan_params * p, const float * s, const float * x, const float * dt,
                     const float * A, const float * B, const float * C, const int64_t * ids, float * out, float * kept,
                     void * work, int ith, int nth);
void ssm_scan_decode_into_f32_v0(const ssm_scan_params * p, const float * s, const float * x, const float * dt,
                                 const float * A, const float * B, const float * C, const int64_t * ids,
                                 float * y, float * st, int ith, int nth);
size_t ssm_scan_thread_bytes_f32_v0(const ssm_scan_params * p);
/* csrc/inst/ssm_scan_f64_v*.c */
void ssm_scan_f64_v4(const ssm_scan_params * p, const double * s, const double * x, const double * dt,
                     const double * A, const double * B, const double * C, const int64_t * ids, double * out, double * kept,
                     void * work, int ith, int nth);
void ssm_scan_decode_into_f64_v4(const ssm_scan_params * p, const double * s, const double * x, const double * dt,
                                 const double * A, const double * B, const double * C, const int64_t * ids,
                                 double * y, double * st, int ith, int nth);
size_t ssm_scan_thread_bytes_f64_v4(const ssm_scan_params * p);
void ssm_scan_f64_v3(const ssm_scan_params * p, const double * s, const double * x, const double * dt,
                     const double * A, const double * B, const double * C, const int64_t * ids, double * out, double * kept,
                     void * work, int ith, int nth);
void ssm_scan_decode_into_f64_v3(const ssm_scan_params * p, const double * s, const double * x, const double * dt,
                                 const double * A, const double * B, const double * C, const int64_t * ids,
                                 double * y, double * st, int ith, int nth);
size_t ssm_scan_thread_bytes_f64_v3(const ssm_scan_params * p);
void ssm_scan_f64_v0(const ssm_scan_params * p, const double * s, const double * x, const double * dt,
                     const double * A, const double * B, const double * C, const int64_t * ids, double * out, double * kept,
                     void * work, int ith, int nth);
void ssm_scan_decode_into_f64_v0(const ssm_scan_params * p, const double * s, const double * x, const double * dt,
                                 const double * A, const double * B, const double * C, const int64_t * ids,
                                 double * y, double * st, int ith, int nth);
size_t ssm_scan_thread_bytes_f64_v0(const ssm_scan_params * p);
/* csrc/inst/ssm_scan_back_f32_v*.c */
void ssm_scan_back_f32_v4(const ssm_scan_params * p, const float * s, const float * x, const float * dt,
                          const float * A, const float * B, const float * C, const int64_t * ids, const float * kept,
                          const float * grad, float * gin, void * work, int ith, int nth);
void ssm_scan_back_reduce_f32_v4(const ssm_scan_params * p, const int64_t * ids, float * gin, float * d_A,
                                 void * work, int ith, int nth);
size_t ssm_scan_back_work_bytes_f32_v4(const ssm_scan_params * p, int nth);
void ssm_scan_back_f32_v3(const ssm_scan_params * p, const float * s, const float * x, const float * dt,
                          const float * A, const float * B, const float * C, const int64_t * ids, const float * kept,
                          const float * grad, float * gin, void * work, int ith, int nth);
void ssm_scan_back_reduce_f32_v3(const ssm_scan_params * p, const int64_t * ids, float * gin, float * d_A,
                                 void * work, int ith, int nth);
size_t ssm_scan_back_work_bytes_f32_v3(const ssm_scan_params * p, int nth);
void ssm_scan_back_f32_v0(const ssm_scan_params * p, const float * s, const float * x, const float * dt,
                          const float * A, const float * B, const float * C, const int64_t * ids, const float * kept,
                          const float * grad, float * gin, void * work, int ith, int nth);
void ssm_scan_back_reduce_f32_v0(const ssm_scan_params * p, const int64_t * ids, float * gin, float * d_A,
                                 void * work, int ith, int nth);
size_t ssm_scan_back_work_bytes_f32_v0(const ssm_scan_params * p, int nth);
/* csrc/inst/ssm_scan_back_f64_v*.c */
void ssm_scan_back_f64_v4(const ssm_scan_params * p, const double * s, const double * x, const double * dt,
                          const double * A, const double * B, const double * C, const int64_t * ids, const double * kept,
                          const double * grad, double * gin, void * work, int ith, int nth);
void ssm_scan_back_reduce_f64_v4(const ssm_scan_params * p, const int64_t * ids, double * gin, double * d_A,
                                 void * work, int ith, int nth);
size_t ssm_scan_back_work_bytes_f64_v4(const ssm_scan_params * p, int nth);
void ssm_scan_back_f64_v3(const ssm_scan_params * p, const double * s, const double * x, const double * dt,
                          const double * A, const double * B, const double * C, const int64_t * ids, const double * kept,
                          const double * grad, double * gin, void * work, int ith, int nth);
void ssm_scan_back_reduce_f64_v3(const ssm_scan_params * p, const int64_t * ids, double * gin, double * d_A,
                                 void * work, int ith, int nth);
size_t ssm_scan_back_work_bytes_f64_v3(const ssm_scan_params * p, int nth);
void ssm_scan_back_f64_v0(const ssm_scan_params * p, const double * s, const double * x, const double * dt,
                          const double * A, const double * B, const double * C, const int64_t * ids, const double * kept,
                          const double * grad, double * gin, void * work, int ith, int nth);
void ssm_scan_back_reduce_f64_v0(const ssm_scan_params * p, const int64_t * ids, double * gin, double * d_A,
                                 void * work, int ith, int nth);
size_t ssm_scan_back_work_bytes_f64_v0(const ssm_scan_params * p, int nth);

#endif /* SSM_INST_H */
