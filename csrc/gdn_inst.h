/*
 * gdn_inst.h -- prototypes of the per-(type, SIMD level) GATED_DELTA_NET kernels that the
 * instantiation files csrc/inst/gdn_<type>_v<N>.c define and gdn_dispatch.c calls (internal).
 * Without runtime dispatch only the _v0 ones exist.
 */
#ifndef GDN_INST_H
#define GDN_INST_H

#include "ssmgrad.h"

void gdn_fwd_f32_v4(const gdn_params * p, const float * q, const float * k, const float * v, const float * g,
                   const float * beta, const float * state, float * out, void * work, int ith, int nth);
void gdn_back_f32_v4(const gdn_params * p, const float * q, const float * k, const float * v, const float * g,
                    const float * beta, const float * state, const float * grad, float * gin, void * work, int ith,
                    int nth);
void gdn_fwd_f32_v3(const gdn_params * p, const float * q, const float * k, const float * v, const float * g,
                   const float * beta, const float * state, float * out, void * work, int ith, int nth);
void gdn_back_f32_v3(const gdn_params * p, const float * q, const float * k, const float * v, const float * g,
                    const float * beta, const float * state, const float * grad, float * gin, void * work, int ith,
                    int nth);
void gdn_fwd_f32_v0(const gdn_params * p, const float * q, const float * k, const float * v, const float * g,
                   const float * beta, const float * state, float * out, void * work, int ith, int nth);
void gdn_back_f32_v0(const gdn_params * p, const float * q, const float * k, const float * v, const float * g,
                    const float * beta, const float * state, const float * grad, float * gin, void * work, int ith,
                    int nth);
void gdn_fwd_f64_v4(const gdn_params * p, const double * q, const double * k, const double * v, const double * g,
                   const double * beta, const double * state, double * out, void * work, int ith, int nth);
void gdn_back_f64_v4(const gdn_params * p, const double * q, const double * k, const double * v, const double * g,
                    const double * beta, const double * state, const double * grad, double * gin, void * work, int ith,
                    int nth);
void gdn_fwd_f64_v3(const gdn_params * p, const double * q, const double * k, const double * v, const double * g,
                   const double * beta, const double * state, double * out, void * work, int ith, int nth);
void gdn_back_f64_v3(const gdn_params * p, const double * q, const double * k, const double * v, const double * g,
                    const double * beta, const double * state, const double * grad, double * gin, void * work, int ith,
                    int nth);
void gdn_fwd_f64_v0(const gdn_params * p, const double * q, const double * k, const double * v, const double * g,
                   const double * beta, const double * state, double * out, void * work, int ith, int nth);
void gdn_back_f64_v0(const gdn_params * p, const double * q, const double * k, const double * v, const double * g,
                    const double * beta, const double * state, const double * grad, double * gin, void * work, int ith,
                    int nth);

/* the chunked form (csrc/inst/gdn_chunked_<type>_v<N>.c: gdn_chunked_body.h, gdn_back_chunked_body.h) */
void gdn_fwd_chunked_f32_v4(const gdn_params * p, const float * q, const float * k, const float * v, const float * g,
                      const float * beta, const float * state, float * out, float * kept, void * work, int ith,
                      int nth);
void gdn_back_chunked_f32_v4(const gdn_params * p, const float * q, const float * k, const float * v, const float * g,
                       const float * beta, const float * state, const float * kept, const float * grad, float * gin,
                       void * work, int ith,
                       int nth);
void gdn_fwd_chunked_f32_v3(const gdn_params * p, const float * q, const float * k, const float * v, const float * g,
                      const float * beta, const float * state, float * out, float * kept, void * work, int ith,
                      int nth);
void gdn_back_chunked_f32_v3(const gdn_params * p, const float * q, const float * k, const float * v, const float * g,
                       const float * beta, const float * state, const float * kept, const float * grad, float * gin,
                       void * work, int ith,
                       int nth);
void gdn_fwd_chunked_f32_v0(const gdn_params * p, const float * q, const float * k, const float * v, const float * g,
                      const float * beta, const float * state, float * out, float * kept, void * work, int ith,
                      int nth);
void gdn_back_chunked_f32_v0(const gdn_params * p, const float * q, const float * k, const float * v, const float * g,
                       const float * beta, const float * state, const float * kept, const float * grad, float * gin,
                       void * work, int ith,
                       int nth);
void gdn_fwd_chunked_f64_v4(const gdn_params * p, const double * q, const double * k, const double * v, const double * g,
                      const double * beta, const double * state, double * out, double * kept, void * work, int ith,
                      int nth);
void gdn_back_chunked_f64_v4(const gdn_params * p, const double * q, const double * k, const double * v, const double * g,
                       const double * beta, const double * state, const double * kept, const double * grad,
                       double * gin, void * work, int ith,
                       int nth);
void gdn_fwd_chunked_f64_v3(const gdn_params * p, const double * q, const double * k, const double * v, const double * g,
                      const double * beta, const double * state, double * out, double * kept, void * work, int ith,
                      int nth);
void gdn_back_chunked_f64_v3(const gdn_params * p, const double * q, const double * k, const double * v, const double * g,
                       const double * beta, const double * state, const double * kept, const double * grad,
                       double * gin, void * work, int ith,
                       int nth);
void gdn_fwd_chunked_f64_v0(const gdn_params * p, const double * q, const double * k, const double * v, const double * g,
                      const double * beta, const double * state, double * out, double * kept, void * work, int ith,
                      int nth);
void gdn_back_chunked_f64_v0(const gdn_params * p, const double * q, const double * k, const double * v, const double * g,
                       const double * beta, const double * state, const double * kept, const double * grad,
                       double * gin, void * work, int ith,
                       int nth);

/* the per-channel gate's chunked form (csrc/inst/gdn_kda_chunked_<type>_v<N>.c, gdn_kda_chunked_body.h) */
void gdn_fwd_kda_chunked_f32_v4(const gdn_params * p, const float * q, const float * k, const float * v, const float * g,
                              const float * beta, const float * state, float * out, float * kept, void * work,
                              int ith, int nth);
void gdn_back_kda_chunked_f32_v4(const gdn_params * p, const float * q, const float * k, const float * v, const float * g,
                               const float * beta, const float * state, const float * kept, const float * grad,
                               float * gin, void * work,
                               int ith, int nth);
void gdn_fwd_kda_chunked_f32_v3(const gdn_params * p, const float * q, const float * k, const float * v, const float * g,
                              const float * beta, const float * state, float * out, float * kept, void * work,
                              int ith, int nth);
void gdn_back_kda_chunked_f32_v3(const gdn_params * p, const float * q, const float * k, const float * v, const float * g,
                               const float * beta, const float * state, const float * kept, const float * grad,
                               float * gin, void * work,
                               int ith, int nth);
void gdn_fwd_kda_chunked_f32_v0(const gdn_params * p, const float * q, const float * k, const float * v, const float * g,
                              const float * beta, const float * state, float * out, float * kept, void * work,
                              int ith, int nth);
void gdn_back_kda_chunked_f32_v0(const gdn_params * p, const float * q, const float * k, const float * v, const float * g,
                               const float * beta, const float * state, const float * kept, const float * grad,
                               float * gin, void * work,
                               int ith, int nth);
void gdn_fwd_kda_chunked_f64_v4(const gdn_params * p, const double * q, const double * k, const double * v, const double * g,
                              const double * beta, const double * state, double * out, double * kept, void * work,
                              int ith, int nth);
void gdn_back_kda_chunked_f64_v4(const gdn_params * p, const double * q, const double * k, const double * v, const double * g,
                               const double * beta, const double * state, const double * kept, const double * grad,
                               double * gin, void * work,
                               int ith, int nth);
void gdn_fwd_kda_chunked_f64_v3(const gdn_params * p, const double * q, const double * k, const double * v, const double * g,
                              const double * beta, const double * state, double * out, double * kept, void * work,
                              int ith, int nth);
void gdn_back_kda_chunked_f64_v3(const gdn_params * p, const double * q, const double * k, const double * v, const double * g,
                               const double * beta, const double * state, const double * kept, const double * grad,
                               double * gin, void * work,
                               int ith, int nth);
void gdn_fwd_kda_chunked_f64_v0(const gdn_params * p, const double * q, const double * k, const double * v, const double * g,
                              const double * beta, const double * state, double * out, double * kept, void * work,
                              int ith, int nth);
void gdn_back_kda_chunked_f64_v0(const gdn_params * p, const double * q, const double * k, const double * v, const double * g,
                               const double * beta, const double * state, const double * kept, const double * grad,
                               double * gin, void * work,
                               int ith, int nth);

#endif /* GDN_INST_H */
