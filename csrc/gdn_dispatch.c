/*
 * gdn_dispatch.c -- the public GATED_DELTA_NET entry points of ssmgrad.h: the form a call takes
 * (gdn_uses_chunked, gdn_common.h), work sizes, and each kernel as a switch over the SIMD level the call
 * runs (ssm_simd_level, capped by params.simd) to the instantiation of csrc/inst/gdn_<type>_v<N>.c (the
 * token recurrence), csrc/inst/gdn_chunked_<type>_v<N>.c (the chunked form) or
 * csrc/inst/gdn_kda_chunked_<type>_v<N>.c (the chunked form of the per-channel gate, gdnk_uses_chunked).
 */
#include "ssm_common.h"
#include "gdn_common.h"
#include "gdn_inst.h"
#include "gdn_kda_chunked.h"

#if SSM_DISPATCH
#define GDN_LEVEL(p) ssm_simd_level((p)->simd)
#define GDN_BODY_LEVEL(p) GDN_LEVEL(p)   /* the SSM_LEVEL of the instantiation a call runs */
#else
#define GDN_LEVEL(p) 0   /* one pass, the _v0 files, compiled for the build's own target */
#if defined(__AVX512F__)
#define GDN_BODY_LEVEL(p) 4              /* ssm_target_begin.h: the _v0 files' level is the build's own */
#elif defined(__AVX2__) && defined(__FMA__)
#define GDN_BODY_LEVEL(p) 3
#else
#define GDN_BODY_LEVEL(p) 0
#endif
#endif
/* the KDA chunked form's auto rule by level where it was measured (the x86-64 passes); a build without
 * dispatch (aarch64, and x86-64 builds with dispatch off) keeps the level-4 rule */
#if SSM_DISPATCH
#define gdnk_uses_chunked(p) gdnk_uses_chunked_at((p), GDN_BODY_LEVEL(p))
#else
#define gdnk_uses_chunked(p) gdnk_uses_chunked_at((p), 4)
#endif

size_t gdn_fwd_work_size(const gdn_params * p, size_t elem_size, int nth) {
    const int64_t per = gdnk_uses_chunked(p)  ? gdnk_fwd_thread_elems(p)
                        : gdn_uses_chunked(p) ? gdnc_fwd_thread_elems(p)
                                              : gdn_fwd_thread_elems(p, GDN_BODY_LEVEL(p));
    return (size_t) per * elem_size * (size_t) (nth > 0 ? nth : 1);
}

int64_t gdn_back_units(const gdn_params * p) { return p->n_seqs_k * p->H_k; }

size_t gdn_back_work_size(const gdn_params * p, size_t elem_size, int nth) {
    const int64_t per = gdnk_uses_chunked(p) ? gdnk_back_thread_elems(p)
                        : gdn_uses_chunked(p) ? gdnc_back_thread_elems(p) : gdn_back_thread_elems(p);
    return (size_t) per * elem_size * (size_t) (nth > 0 ? nth : 1);
}

int64_t gdn_chunk_states(const gdn_params * p) {
    const int64_t E = gdnk_uses_chunked(p)  ? gdnk_kept_chunk_elems(p)
                      : gdn_uses_chunked(p) ? gdnc_kept_chunk_elems(p) : 0;
    return p->n_seqs * p->H_v * gdnc_n_chunks(p) * E;
}

int gdn_form(const gdn_params * p) {
    return gdn_uses_chunked(p) || gdnk_uses_chunked(p) ? SSM_FORM_CHUNKED : SSM_FORM_RECURRENCE;
}

static void fwd_f32(const gdn_params * p, const float * q, const float * k, const float * v, const float * g,
                    const float * beta, const float * state, float * out, float * kept, void * work, int ith, int nth) {
    if (gdnk_uses_chunked(p)) {
        switch (GDN_LEVEL(p)) {
#if SSM_DISPATCH
        case 4: gdn_fwd_kda_chunked_f32_v4(p, q, k, v, g, beta, state, out, kept, work, ith, nth); return;
        case 3: gdn_fwd_kda_chunked_f32_v3(p, q, k, v, g, beta, state, out, kept, work, ith, nth); return;
#endif
        default: gdn_fwd_kda_chunked_f32_v0(p, q, k, v, g, beta, state, out, kept, work, ith, nth); return;
        }
    }
    if (gdn_uses_chunked(p)) {
        switch (GDN_LEVEL(p)) {
#if SSM_DISPATCH
        case 4: gdn_fwd_chunked_f32_v4(p, q, k, v, g, beta, state, out, kept, work, ith, nth); return;
        case 3: gdn_fwd_chunked_f32_v3(p, q, k, v, g, beta, state, out, kept, work, ith, nth); return;
#endif
        default: gdn_fwd_chunked_f32_v0(p, q, k, v, g, beta, state, out, kept, work, ith, nth); return;
        }
    }
    switch (GDN_LEVEL(p)) {
#if SSM_DISPATCH
    case 4: gdn_fwd_f32_v4(p, q, k, v, g, beta, state, out, work, ith, nth); break;
    case 3: gdn_fwd_f32_v3(p, q, k, v, g, beta, state, out, work, ith, nth); break;
#endif
    default: gdn_fwd_f32_v0(p, q, k, v, g, beta, state, out, work, ith, nth); break;
    }
}

void gdn_fwd_f32(const gdn_params * p, const float * q, const float * k, const float * v, const float * g,
                 const float * beta, const float * state, float * out, void * work, int ith, int nth) {
    fwd_f32(p, q, k, v, g, beta, state, out, NULL, work, ith, nth);
}

void gdn_fwd_keep_f32(const gdn_params * p, const float * q, const float * k, const float * v, const float * g,
                      const float * beta, const float * state, float * out, float * chunk_states, void * work, int ith,
                      int nth) {
    fwd_f32(p, q, k, v, g, beta, state, out, chunk_states, work, ith, nth);
}

static void fwd_f64(const gdn_params * p, const double * q, const double * k, const double * v, const double * g,
                    const double * beta, const double * state, double * out, double * kept, void * work, int ith,
                    int nth) {
    if (gdnk_uses_chunked(p)) {
        switch (GDN_LEVEL(p)) {
#if SSM_DISPATCH
        case 4: gdn_fwd_kda_chunked_f64_v4(p, q, k, v, g, beta, state, out, kept, work, ith, nth); return;
        case 3: gdn_fwd_kda_chunked_f64_v3(p, q, k, v, g, beta, state, out, kept, work, ith, nth); return;
#endif
        default: gdn_fwd_kda_chunked_f64_v0(p, q, k, v, g, beta, state, out, kept, work, ith, nth); return;
        }
    }
    if (gdn_uses_chunked(p)) {
        switch (GDN_LEVEL(p)) {
#if SSM_DISPATCH
        case 4: gdn_fwd_chunked_f64_v4(p, q, k, v, g, beta, state, out, kept, work, ith, nth); return;
        case 3: gdn_fwd_chunked_f64_v3(p, q, k, v, g, beta, state, out, kept, work, ith, nth); return;
#endif
        default: gdn_fwd_chunked_f64_v0(p, q, k, v, g, beta, state, out, kept, work, ith, nth); return;
        }
    }
    switch (GDN_LEVEL(p)) {
#if SSM_DISPATCH
    case 4: gdn_fwd_f64_v4(p, q, k, v, g, beta, state, out, work, ith, nth); break;
    case 3: gdn_fwd_f64_v3(p, q, k, v, g, beta, state, out, work, ith, nth); break;
#endif
    default: gdn_fwd_f64_v0(p, q, k, v, g, beta, state, out, work, ith, nth); break;
    }
}

void gdn_fwd_f64(const gdn_params * p, const double * q, const double * k, const double * v, const double * g,
                 const double * beta, const double * state, double * out, void * work, int ith, int nth) {
    fwd_f64(p, q, k, v, g, beta, state, out, NULL, work, ith, nth);
}

void gdn_fwd_keep_f64(const gdn_params * p, const double * q, const double * k, const double * v, const double * g,
                      const double * beta, const double * state, double * out, double * chunk_states, void * work,
                      int ith, int nth) {
    fwd_f64(p, q, k, v, g, beta, state, out, chunk_states, work, ith, nth);
}

static void back_f32(const gdn_params * p, const float * q, const float * k, const float * v, const float * g,
                     const float * beta, const float * state, const float * kept, const float * grad, float * gin,
                     void * work, int ith, int nth) {
    if (gdnk_uses_chunked(p)) {
        switch (GDN_LEVEL(p)) {
#if SSM_DISPATCH
        case 4: gdn_back_kda_chunked_f32_v4(p, q, k, v, g, beta, state, kept, grad, gin, work, ith, nth); return;
        case 3: gdn_back_kda_chunked_f32_v3(p, q, k, v, g, beta, state, kept, grad, gin, work, ith, nth); return;
#endif
        default: gdn_back_kda_chunked_f32_v0(p, q, k, v, g, beta, state, kept, grad, gin, work, ith, nth); return;
        }
    }
    if (gdn_uses_chunked(p)) {
        switch (GDN_LEVEL(p)) {
#if SSM_DISPATCH
        case 4: gdn_back_chunked_f32_v4(p, q, k, v, g, beta, state, kept, grad, gin, work, ith, nth); return;
        case 3: gdn_back_chunked_f32_v3(p, q, k, v, g, beta, state, kept, grad, gin, work, ith, nth); return;
#endif
        default: gdn_back_chunked_f32_v0(p, q, k, v, g, beta, state, kept, grad, gin, work, ith, nth); return;
        }
    }
    switch (GDN_LEVEL(p)) {
#if SSM_DISPATCH
    case 4: gdn_back_f32_v4(p, q, k, v, g, beta, state, grad, gin, work, ith, nth); break;
    case 3: gdn_back_f32_v3(p, q, k, v, g, beta, state, grad, gin, work, ith, nth); break;
#endif
    default: gdn_back_f32_v0(p, q, k, v, g, beta, state, grad, gin, work, ith, nth); break;
    }
}

void gdn_back_f32(const gdn_params * p, const float * q, const float * k, const float * v, const float * g,
                  const float * beta, const float * state, const float * grad, float * gin, void * work, int ith,
                  int nth) {
    back_f32(p, q, k, v, g, beta, state, NULL, grad, gin, work, ith, nth);
}

void gdn_back_kept_f32(const gdn_params * p, const float * q, const float * k, const float * v, const float * g,
                       const float * beta, const float * state, const float * chunk_states, const float * grad,
                       float * gin,
                       void * work, int ith, int nth) {
    back_f32(p, q, k, v, g, beta, state, gdn_chunk_states(p) > 0 ? chunk_states : NULL, grad, gin, work, ith, nth);
}

static void back_f64(const gdn_params * p, const double * q, const double * k, const double * v, const double * g,
                     const double * beta, const double * state, const double * kept, const double * grad, double * gin,
                     void * work, int ith, int nth) {
    if (gdnk_uses_chunked(p)) {
        switch (GDN_LEVEL(p)) {
#if SSM_DISPATCH
        case 4: gdn_back_kda_chunked_f64_v4(p, q, k, v, g, beta, state, kept, grad, gin, work, ith, nth); return;
        case 3: gdn_back_kda_chunked_f64_v3(p, q, k, v, g, beta, state, kept, grad, gin, work, ith, nth); return;
#endif
        default: gdn_back_kda_chunked_f64_v0(p, q, k, v, g, beta, state, kept, grad, gin, work, ith, nth); return;
        }
    }
    if (gdn_uses_chunked(p)) {
        switch (GDN_LEVEL(p)) {
#if SSM_DISPATCH
        case 4: gdn_back_chunked_f64_v4(p, q, k, v, g, beta, state, kept, grad, gin, work, ith, nth); return;
        case 3: gdn_back_chunked_f64_v3(p, q, k, v, g, beta, state, kept, grad, gin, work, ith, nth); return;
#endif
        default: gdn_back_chunked_f64_v0(p, q, k, v, g, beta, state, kept, grad, gin, work, ith, nth); return;
        }
    }
    switch (GDN_LEVEL(p)) {
#if SSM_DISPATCH
    case 4: gdn_back_f64_v4(p, q, k, v, g, beta, state, grad, gin, work, ith, nth); break;
    case 3: gdn_back_f64_v3(p, q, k, v, g, beta, state, grad, gin, work, ith, nth); break;
#endif
    default: gdn_back_f64_v0(p, q, k, v, g, beta, state, grad, gin, work, ith, nth); break;
    }
}

void gdn_back_f64(const gdn_params * p, const double * q, const double * k, const double * v, const double * g,
                  const double * beta, const double * state, const double * grad, double * gin, void * work, int ith,
                  int nth) {
    back_f64(p, q, k, v, g, beta, state, NULL, grad, gin, work, ith, nth);
}

void gdn_back_kept_f64(const gdn_params * p, const double * q, const double * k, const double * v, const double * g,
                       const double * beta, const double * state, const double * chunk_states, const double * grad,
                       double * gin,
                       void * work, int ith, int nth) {
    back_f64(p, q, k, v, g, beta, state, gdn_chunk_states(p) > 0 ? chunk_states : NULL, grad, gin, work, ith, nth);
}
