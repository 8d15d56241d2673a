/*
 * ssmgrad.h -- public C API of the ssmgrad kernels.
 *
 * Forward and backward (vector-Jacobian product) of ggml's GGML_OP_SSM_CONV,
 * GGML_OP_SSM_SCAN and GGML_OP_GATED_DELTA_NET, usable without Python: a ggml fork can call
 * these as the CPU kernels of SSM_CONV_BACK / SSM_SCAN_BACK / GATED_DELTA_NET_BACK.
 *
 * Conventions
 * - Shapes are NumPy order (ggml's ne reversed), see the comment on each params struct.
 * - Every input is described by element strides (not bytes); strides may be zero or
 *   negative. Inputs are only read. Outputs are dense C-ordered (packed) arrays.
 * - Threading follows ggml: every kernel takes (ith, nth) and writes only the slice of the
 *   output that thread ith of nth owns. Results are bitwise identical for every nth.
 *   Call a kernel for every ith in [0, nth) (concurrently or not); where a kernel has two
 *   phases, every thread must finish phase 1 before any thread starts phase 2 (a barrier).
 * - Kernels never allocate, print, exit or abort. Scratch memory comes from the caller:
 *   ask *_work_size() for the byte count, pass one buffer aligned to SSM_WORK_ALIGN bytes.
 * - Kernels never validate: the caller guarantees the shape preconditions listed below
 *   and that every ids[q] lies in [0, n_rs).
 */
#ifndef SSMGRAD_H
#define SSMGRAD_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define SSM_WORK_ALIGN 64

/* Every choice a kernel makes beyond the math travels in its params, so that a kernel is a pure
 * function of its arguments, its work-size query sees the same choice, and zero (a
 * zero-initialised params struct: `= {0}` in C, `{}` in C++) always means automatic. */

/* simd: which SIMD pass the kernels run (x86-64 with runtime dispatch: ssm_common.h, docs/simd.md). Auto is
 * the best pass this CPU runs; the other values cap it (a cap never raises it), so that tests can
 * run the passes an AVX-512 machine never picks by itself. Builds without dispatch have one pass:
 * there only SSM_SIMD_V4_NO_VEC64 changes anything. */
#define SSM_SIMD_AUTO 0
#define SSM_SIMD_X86_64 1           /* the x86-64 baseline pass */
#define SSM_SIMD_X86_64_V3 2        /* the x86-64-v3 (AVX2, FMA) pass */
#define SSM_SIMD_V4_NO_VEC64 3      /* the AVX-512 pass without its 64-byte vector-type kernels: the
                                       scan runs the loops of other CPUs, the float32 conv the kernels
                                       of ssm_conv_body.h instead of ssm_conv_blk_body.h's */

/* fwd_form, back_form: which form the scan takes where it has two (Mamba-2, K == 1, and for the
 * forward more than 4 tokens); every other call takes the recurrence, whatever the value. Both
 * forms give the same result up to float rounding; each is bitwise the same for any thread count.
 * Auto decides by shape alone (never by thread count): the rules are ssm_scan_fwd_chunked and
 * ssm_scan_back_chunked (ssm_scan_forms.c). Values out of range mean auto. */
#define SSM_FORM_AUTO 0
#define SSM_FORM_RECURRENCE 1       /* the token recurrence (the backward: checkpointed, reversed) */
#define SSM_FORM_CHUNKED 2          /* chunks of 64 tokens as small matrix products (SSD) */

/* ---------------------------------------------------------------- SSM_CONV
 *   sx   (n_s, d_inner, d_conv - 1 + n_t)   strides sx_st[3]
 *   c    (d_inner, d_conv)                  strides c_st[2]
 *   y    (n_s, n_t, d_inner)                dense; also the layout of the incoming grad,
 *                                           which has strides g_st[3]
 *   y[s, t, i] = sum_{k=0}^{d_conv-1} sx[s, i, t + k] * c[i, k]
 * Preconditions: all sizes >= 0, d_conv >= 1.
 * Threads split the channels i; d_c reductions are owned by their channel's thread.
 */
typedef struct {
    int64_t n_s, d_inner, d_conv, n_t;
    int64_t sx_st[3];
    int64_t c_st[2];
    int64_t g_st[3];
    int64_t simd;          /* SSM_SIMD_*: 0 (auto) runs the best pass this CPU has */
} ssm_conv_params;

/* Bytes of scratch for ssm_conv_* with nth threads and elements of elem_size (4 or 8): one buffer
 * for the three kernels, shared by all threads (each uses its own slice). 0 where the kernels need
 * none (float64, and CPUs or params.simd without the AVX-512 kernels): work may then be NULL. */
size_t ssm_conv_work_size(const ssm_conv_params * p, size_t elem_size, int nth);

void ssm_conv_f32(const ssm_conv_params * p, const float * sx, const float * c,
                  float * y, void * work, int ith, int nth);
void ssm_conv_f64(const ssm_conv_params * p, const double * sx, const double * c,
                  double * y, void * work, int ith, int nth);
/* d_sx (dense, shaped like sx) from grad */
void ssm_conv_back_f32(const ssm_conv_params * p, const float * c, const float * grad,
                       float * d_sx, void * work, int ith, int nth);
void ssm_conv_back_f64(const ssm_conv_params * p, const double * c, const double * grad,
                       double * d_sx, void * work, int ith, int nth);
/* d_c (dense, shaped like c) from sx and grad */
void ssm_conv_back_weight_f32(const ssm_conv_params * p, const float * sx, const float * grad,
                              float * d_c, void * work, int ith, int nth);
void ssm_conv_back_weight_f64(const ssm_conv_params * p, const double * sx, const double * grad,
                              double * d_c, void * work, int ith, int nth);

/* ---------------------------------------------------------------- SSM_SCAN
 *   s    (n_rs, n_head, head_dim, d_state)     strides s_st[4]
 *   x    (n_seqs, n_t, n_head, head_dim)       strides x_st[4]
 *   dt   (n_seqs, n_t, n_head)                 strides dt_st[3]
 *   A    (n_head, d_state) if a_per_state, else (n_head, 1)   strides A_st[2]
 *   B, C (n_seqs, n_t, n_group, d_state)       strides B_st[4], C_st[4]
 *   ids  (n_seqs,) dense int64, each in [0, n_rs)
 *   K    rollback snapshots (ggml since Aug 2026), K >= 1; K = 1 is the classic op
 *
 * out (dense, 1-D): [ y (n_seqs, n_t, n_head, head_dim) | states (K, n_seqs, n_head, head_dim, d_state) ]
 *   state slot 0 is the final state of sequence q (slot q, not row ids[q]); slot k in
 *   [1, min(K, n_t)) is the state after n_t - k tokens; slots k >= n_t are written as 0.
 *
 * grad has out's layout (dense). gin (dense, 1-D):
 *   [ d_s (n_rs, ...) | d_x | d_dt | d_B | d_C ], each C-ordered in its input's shape.
 * d_A (optional, may be NULL): dense, shaped like A.
 *
 * Preconditions: n_group >= 1 divides n_head; all sizes >= 0; K >= 1.
 */
typedef struct {
    int64_t n_rs, n_head, head_dim, d_state, n_group, n_t, n_seqs;
    int64_t a_per_state;   /* 1: A is (n_head, d_state) (Mamba-1); 0: A is (n_head, 1) (Mamba-2) */
    int64_t K;
    int64_t s_st[4], x_st[4], dt_st[3], A_st[2], B_st[4], C_st[4];
    int64_t fwd_form;      /* SSM_FORM_* of the forward (ssm_scan_*, ssm_scan_work_size) */
    int64_t back_form;     /* SSM_FORM_* of the backward (ssm_scan_back_*, its work size) */
    int64_t simd;          /* SSM_SIMD_* */
} ssm_scan_params;

/* Bytes of scratch for ssm_scan_* with nth threads and elements of elem_size (4 or 8). 0 for calls
 * of at most 4 tokens with contiguous rows of s, B, C (and of A for Mamba-1): the forward then
 * works in place in out (work may be NULL). */
size_t ssm_scan_work_size(const ssm_scan_params * p, size_t elem_size, int nth);

void ssm_scan_f32(const ssm_scan_params * p, const float * s, const float * x,
                  const float * dt, const float * A, const float * B, const float * C,
                  const int64_t * ids, float * out, void * work, int ith, int nth);
void ssm_scan_f64(const ssm_scan_params * p, const double * s, const double * x,
                  const double * dt, const double * A, const double * B, const double * C,
                  const int64_t * ids, double * out, void * work, int ith, int nth);

/* Units of work phase 1 of the backward splits among threads: threads beyond it idle. */
int64_t ssm_scan_back_units(const ssm_scan_params * p);

/* Bytes of scratch for ssm_scan_back_* (shared partial sums plus per-thread checkpoints). */
size_t ssm_scan_back_work_size(const ssm_scan_params * p, size_t elem_size, int nth);

/* Phase 1 (run for every ith, then a barrier): the reverse recurrence. Writes d_x and d_dt
 * and partial sums into work. */
void ssm_scan_back_f32(const ssm_scan_params * p, const float * s, const float * x,
                       const float * dt, const float * A, const float * B, const float * C,
                       const int64_t * ids, const float * grad, float * gin,
                       void * work, int ith, int nth);
void ssm_scan_back_f64(const ssm_scan_params * p, const double * s, const double * x,
                       const double * dt, const double * A, const double * B, const double * C,
                       const int64_t * ids, const double * grad, double * gin,
                       void * work, int ith, int nth);
/* Phase 2: fixed-order reductions of the partial sums into d_s, d_B, d_C (and d_A if not NULL). */
void ssm_scan_back_reduce_f32(const ssm_scan_params * p, const int64_t * ids, float * gin,
                              float * d_A, void * work, int ith, int nth);
void ssm_scan_back_reduce_f64(const ssm_scan_params * p, const int64_t * ids, double * gin,
                              double * d_A, void * work, int ith, int nth);

/* Chunk states, for training. Where both the forward and the backward take the chunked form (Mamba-2, K == 1,
 * ssm_scan_chunk_states(p) > 0), the forward can keep each (sequence, head)'s state after every chunk of 64
 * tokens, and the backward then reads them instead of recomputing them (a pass over the chunks, one of its
 * five head_dim x d_state products per token). chunk_states, dense:
 *   (n_seqs, n_head, n_chunks, head_dim, d_state), n_chunks = ceil(n_t / 64)
 * entry c the state after the tokens [0, min(64 (c + 1), n_t)) (entry n_chunks - 1 is the final state). The
 * forward's states are the bits the backward's own pass computes, so ssm_scan_back_kept_* given the
 * chunk_states of ssm_scan_keep_* (same params, same inputs) writes the bits of ssm_scan_back_*. */

/* Elements of chunk_states for these params: 0 where either kernel takes another form (the keep and
 * kept kernels are then ssm_scan_* and ssm_scan_back_*, chunk_states unused and may be NULL). */
int64_t ssm_scan_chunk_states(const ssm_scan_params * p);

/* ssm_scan_*, and the chunk states into chunk_states (same threads, same work size) */
void ssm_scan_keep_f32(const ssm_scan_params * p, const float * s, const float * x,
                       const float * dt, const float * A, const float * B, const float * C,
                       const int64_t * ids, float * out, float * chunk_states, void * work, int ith, int nth);
void ssm_scan_keep_f64(const ssm_scan_params * p, const double * s, const double * x,
                       const double * dt, const double * A, const double * B, const double * C,
                       const int64_t * ids, double * out, double * chunk_states, void * work, int ith, int nth);
/* Phase 1 of the backward (as ssm_scan_back_*) reading the forward's chunk states; phase 2 and the work size
 * are ssm_scan_back_reduce_* and ssm_scan_back_work_size. */
void ssm_scan_back_kept_f32(const ssm_scan_params * p, const float * s, const float * x,
                            const float * dt, const float * A, const float * B, const float * C,
                            const int64_t * ids, const float * chunk_states, const float * grad, float * gin,
                            void * work, int ith, int nth);
void ssm_scan_back_kept_f64(const ssm_scan_params * p, const double * s, const double * x,
                            const double * dt, const double * A, const double * B, const double * C,
                            const int64_t * ids, const double * chunk_states, const double * grad, double * gin,
                            void * work, int ith, int nth);

/* ---------------------------------------------------------------- GATED_DELTA_NET
 *   q, k   (n_seqs_k, n_t, H_k, S)   strides q_st[4], k_st[4]
 *   v      (n_seqs, n_t, H_v, S)     strides v_st[4]
 *   g      (n_seqs, n_t, H_v, S) if g_per_channel (KDA), else (n_seqs, n_t, H_v, 1)   strides g_st[4]
 *   beta   (n_seqs, n_t, H_v, 1)     strides beta_st[4]
 *   state  (n_seqs, H_v, S, S)       strides state_st[4]; stored transposed: state[n, h, j, i] = S[i][j]
 *                                    (i: key channel, j: value channel)
 *   K      snapshot slots, K >= 1
 * Value head h of sequence n reads key/query head kh of key sequence n / (n_seqs / n_seqs_k), with
 * kh = h % H_k (GDN_BCAST_TILED, ggml) or h / (H_v / H_k) (GDN_BCAST_INTERLEAVED, transformers).
 * Per token t, with a = exp(g_t) (a vector over i for KDA, else one number):
 *   S <- diag(a) S;  d = beta_t (v_t - S^T k_t);  S <- S + k_t d^T;  o_t = S^T q_t / sqrt(S)
 * as ggml's CPU forward computes it (ggml_compute_forward_gated_delta_net_one_chunk): exp(g),
 * 1 / sqrtf(S), the order of the operations and the summation order of its dot products on x86-64
 * with AVX2 and FMA are ggml's, so that the float32 forward on a CPU with FMA gives the bits of that
 * ggml build where S is a multiple of 32 (checked: ggml/gdn_check.c, tests/ggml/test_ggml_gdn.py). Other S differ
 * from it by rounding in the last S % 32 terms (how ggml sums those depends on its compiler).
 *
 * out (dense, 1-D): [ o (n_seqs, n_t, H_v, S) | K slots, each (n_seqs, H_v, S, S) transposed as state ]
 *   slot 0 is the state after the last token, slot s the state after token n_t - 1 - s. Only the
 *   slots s < n_t are written (as in ggml: the others belong to the caller); with n_t == 0 and
 *   K == 1, slot 0 is the start state.
 *
 * grad has out's layout (dense; the unwritten slots are ignored). gin (dense, 1-D):
 *   [ d_q | d_k | d_v | d_g | d_beta | d_state ], each C-ordered in its input's shape.
 * A slot's gradient joins the reverse recurrence at the token after which that slot was taken.
 * Gradients of a key head (and key sequence) shared by several value heads add up in a fixed order.
 *
 * Preconditions: all sizes >= 0; H_k >= 1 divides H_v and n_seqs_k >= 1 divides n_seqs (or the
 * two of a pair are 0); K >= 1.
 * Threads split the (sequence, value head) pairs in the forward, the (key sequence, key head)
 * groups in the backward (each thread owns its groups' every gradient: no reduce phase).
 */
#define GDN_BCAST_TILED 0           /* value head h reads key head h % H_k (ggml) */
#define GDN_BCAST_INTERLEAVED 1     /* value head h reads key head h / (H_v / H_k) (transformers'
                                       repeat_interleave) */

typedef struct {
    int64_t n_seqs, n_seqs_k, n_t, H_v, H_k, S, K;
    int64_t g_per_channel;  /* 1: g is (n_seqs, n_t, H_v, S) (KDA); 0: (n_seqs, n_t, H_v, 1) */
    int64_t head_bcast;     /* GDN_BCAST_* */
    int64_t q_st[4], k_st[4], v_st[4], g_st[4], beta_st[4], state_st[4];
    int64_t form;           /* SSM_FORM_*: CHUNKED (64-token chunks as matrix products) is taken for
                               either gate (scalar or per-channel) with K == 1 and n_t >= 1, the
                               recurrence for every other call; AUTO: chunked from 32 tokens on with
                               the scalar gate, with the per-channel gate from 2048 at the AVX-512
                               pass and builds without dispatch, from 16 at the x86-64-v3 and
                               baseline passes (gdn_form says which one runs) */
    int64_t simd;           /* SSM_SIMD_* */
} gdn_params;

/* Bytes of scratch for gdn_fwd_* with nth threads and elements of elem_size (4 or 8). */
size_t gdn_fwd_work_size(const gdn_params * p, size_t elem_size, int nth);

void gdn_fwd_f32(const gdn_params * p, const float * q, const float * k, const float * v,
                 const float * g, const float * beta, const float * state,
                 float * out, void * work, int ith, int nth);
void gdn_fwd_f64(const gdn_params * p, const double * q, const double * k, const double * v,
                 const double * g, const double * beta, const double * state,
                 double * out, void * work, int ith, int nth);

/* The form (SSM_FORM_RECURRENCE or SSM_FORM_CHUNKED) the forward and the backward of a call with
 * these params run; the work sizes follow it. */
int gdn_form(const gdn_params * p);

/* Units of work the backward splits among threads (n_seqs_k * H_k key groups): threads beyond it idle. */
int64_t gdn_back_units(const gdn_params * p);

/* Bytes of scratch for gdn_back_*: per thread, the states at every 64th token (GDN_SEGMENT) of one
 * (sequence, head) and the 64 states of one segment, recomputed from them. */
size_t gdn_back_work_size(const gdn_params * p, size_t elem_size, int nth);

/* One phase: writes every region of gin (dense, 1-D, layout above) from grad (out's layout). */
void gdn_back_f32(const gdn_params * p, const float * q, const float * k, const float * v,
                  const float * g, const float * beta, const float * state, const float * grad,
                  float * gin, void * work, int ith, int nth);
void gdn_back_f64(const gdn_params * p, const double * q, const double * k, const double * v,
                  const double * g, const double * beta, const double * state, const double * grad,
                  double * gin, void * work, int ith, int nth);

/* Chunk states, for training. Where both the forward and the backward take a chunked form (the scalar gate's
 * or the per-channel gate's, K == 1: gdn_chunk_states(p) > 0), the forward can keep what the backward's pass
 * over the chunks computes, and the backward then reads it instead (that pass is gone: for the scalar gate
 * two of its eight S x S x 64 products per chunk, K H0 and the state update, the T Y product, and both of
 * its K K^T, Q K^T and T, 28% of its multiply-adds at S 128; for the per-channel gate also the decayed pair
 * products, 26%). chunk_states, dense: (n_seqs, H_v, n_chunks, E), n_chunks = ceil(n_t / 64),
 * Sp = S rounded up to a multiple of 16, entry [n, h, c] for the tokens [64 c, min(64 (c + 1), n_t)):
 *   the state before the chunk (Sp, Sp), H[i][j] (i: key channel; not transposed as state is),
 *   the chunk's 64 rows of v_t - gamma_t H^T k_t (Sp each), then its 64 rows of delta_t (Sp each),
 *   then its (64, 64) products K K^T and Q K^T (lower parts; with the per-channel gate their decays in and
 *   K K^T's diagonal 0), and with the scalar gate T = (I + A)^-1 (64, 64, as gdn_chunk.h defines it),
 * E = Sp Sp + 128 Sp + 12288 (the scalar gate) or + 8192 (the per-channel gate); padding, rows past n_t and
 * entries above the products' and T's diagonals are 0. What it holds is the kernels' own: it is for
 * gdn_back_kept_* with the same params and inputs, which then writes the bits of gdn_back_* (the forward's
 * values are that pass's element for element). ggml's GATED_DELTA_NET_BACK calls gdn_back_* (ggml's
 * forward is its own). */

/* Elements of chunk_states for these params: 0 where the call takes the recurrence (the keep and kept
 * kernels are then gdn_fwd_* and gdn_back_*, chunk_states unused and may be NULL). */
int64_t gdn_chunk_states(const gdn_params * p);

/* gdn_fwd_*, and the chunk states into chunk_states (same threads, same work size); written with streaming
 * stores where chunk_states is 64-byte aligned */
void gdn_fwd_keep_f32(const gdn_params * p, const float * q, const float * k, const float * v,
                      const float * g, const float * beta, const float * state,
                      float * out, float * chunk_states, void * work, int ith, int nth);
void gdn_fwd_keep_f64(const gdn_params * p, const double * q, const double * k, const double * v,
                      const double * g, const double * beta, const double * state,
                      double * out, double * chunk_states, void * work, int ith, int nth);
/* gdn_back_* reading the forward's chunk states (same work size) */
void gdn_back_kept_f32(const gdn_params * p, const float * q, const float * k, const float * v,
                       const float * g, const float * beta, const float * state, const float * chunk_states,
                       const float * grad, float * gin, void * work, int ith, int nth);
void gdn_back_kept_f64(const gdn_params * p, const double * q, const double * k, const double * v,
                       const double * g, const double * beta, const double * state, const double * chunk_states,
                       const double * grad, double * gin, void * work, int ith, int nth);

/* Build-time facts, for show_config(): SIMD clones compiled in, and the one this CPU runs (with
 * SSM_SIMD_AUTO); ssm_simd_name: the pass a call whose params have this simd value runs. */
const char * ssm_simd_compiled(void);
const char * ssm_simd_selected(void);
const char * ssm_simd_name(int64_t simd);

/* Whether a call whose params have this simd value runs the scan's AVX-512 versions (64-byte
 * vector types) and the float32 conv's cache-blocked AVX-512 kernels. */
int ssm_avx512_kernels(int64_t simd);

#ifdef __cplusplus
}
#endif

#endif /* SSMGRAD_H */
