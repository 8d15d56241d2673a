/*
 * ssm_scan_back_recurrence_body.h -- SSM_SCAN backward (vector-Jacobian product), phase 1, written
 * once for `real`: ssm_scan_back, which takes the form ssm_scan_forms.c picks (the chunked form,
 * ssm_scan_back_chunked_body.h, or the checkpointed reverse recurrence here). Phase 2 is
 * ssm_scan_back_reduce_body.h; what the two phases share, ssm_scan_back.h.
 *
 *   inputs as ssm_scan (ssm_scan_recurrence_body.h); grad: the packed gradient of its out
 *   -> gin = [d_s | d_x | d_dt | d_B | d_C], d_A (optional)
 *   reverse step per token t (G the gradient of the state after t, a = e^(sp A)):
 *     G += C_t (x) dy_t;  d_x, d_dt, d_B, d_C, d_A from G and the state before t;  G = a G
 * Checked against tests/reference.py's ref_scan_grads (torch autograd on ref_ssm_scan;
 * tests/kernels/test_scan.py) and float64 finite differences (tests/c_api/test_c_api.c). The math is
 * section 3 of the spec (docs/ssm-ops.md); blocks and the transposed state layout are explained
 * in ssm_scan_layout.h.
 *
 * Memory: the forward keeps only final states, and storing every H_t would cost
 * n_t * n_head * head_dim * d_state elements. Instead each thread, for one block at a time,
 * runs the recurrence once keeping a checkpoint every Tc ~ sqrt(n_t) tokens, then walks the
 * segments backwards, recomputing the Tc states of a segment from its checkpoint and running
 * the reverse recurrence over them. The recurrence is never run backwards by dividing by a.
 * Mamba-1 also keeps the segment's decays e^(sp A) from the recomputation (one per state
 * element, like the states), so the reverse step does not evaluate exp again.
 *
 * Determinism: d_x and d_dt have one owner (the block of their head). d_B and d_C sum over
 * the heads of a group: the heads are cut into head runs fixed by the shape alone, each run
 * accumulates its partial sums in a fixed order, and phase 2 adds the runs in run order.
 * d_s (scatter-add over duplicate ids) and d_A (sum over sequences) are reduced in phase 2 in
 * increasing sequence order. None of it depends on the thread count.
 */
#ifndef SSM_SCAN_BACK_RECURRENCE_BODY_H
#define SSM_SCAN_BACK_RECURRENCE_BODY_H

#ifndef SSM_REAL_H
#error "include ssm_real_f32.h or ssm_real_f64.h first"
#endif

#include "ssm_scan_step.h"
#include "ssm_scan_back.h"

/* the backward's recomputation: the state only */
static void ssm_step_state(const ssm_scan_params * p, int64_t Rp, const ssm_rows * v,
                                const real * Hin, real * Hout) {
    if (p->a_per_state) ssm_step_impl(p, Rp, v, Hin, Hout, NULL, 0, NULL, 0, 1);
    else if (ssm_vec64(p->simd)) ssm_step_m2_v4(p, Rp, v, Hin, Hout, NULL, 0);
    else ssm_step_impl(p, Rp, v, Hin, Hout, NULL, 0, NULL, 0, 0);
}

/* (callers check ssm_vec64() first) */
static void ssm_step_state_m2_pair(const ssm_scan_params * p, int64_t Rp, const ssm_rows * v0,
                                        const ssm_rows * v1, const real * Hin, real * Hout) {
    ssm_step_m2_pair_impl(p, Rp, v0, v1, Hin, NULL, Hout, 0);
}

static void ssm_step_state_m2_pair_keep(const ssm_scan_params * p, int64_t Rp, const ssm_rows * v0,
                                             const ssm_rows * v1, const real * Hin, real * Hmid,
                                             real * Hout) {
    ssm_step_m2_pair_impl(p, Rp, v0, v1, Hin, Hmid, Hout, 1);
}

/* the backward's recomputation within a segment, Mamba-1: the state and the decays, so that
 * the reverse step reads e^(sp * A) instead of computing it a second time */
static void ssm_step_state_m1_decay(const ssm_scan_params * p, int64_t Rp, const ssm_rows * v,
                                         const real * Hin, real * Hout, real * Dout) {
    ssm_step_impl(p, Rp, v, Hin, Hout, NULL, 0, Dout, 1, 1);
}

/* checkpoint interval: about sqrt(n_t) balances checkpoints against one segment's states */
static int64_t ssm_ckpt_interval(const ssm_scan_params * p) {
    int64_t tc = 1;
    while (tc * tc < p->n_t) ++tc;
    /* ... but a segment's states must stay in L2, where the reverse pass reads them back:
     * past that, time per token grows with n_t (measured: +25% at n_t = 2048, Mamba-2) */
    /* (Mamba-1 keeps each token's decays beside its state: twice the bytes) */
    const int64_t state_bytes = ssm_max64(1, p->d_state * ssm_max_rows_padded(p) * (int64_t) sizeof(real))
                                * (p->a_per_state ? 2 : 1);
    const int64_t cap = ssm_max64(4, SSM_SEGMENT_BYTES / state_bytes);
    return ssm_min64(tc, cap);
}

/* Buffers private to one thread. */
typedef struct {
    ssm_rows v;  /* row vectors; v.H is the running state of the checkpoint pass */
    real * ckpt;      /* [segment][d_state][Rp] state before the segment's first token */
    real * seg;       /* [Tc][d_state][Rp]  states after each token of one segment (the state
                         before its first token is its checkpoint, read in place) */
    real * dseg;      /* Mamba-1: [Tc][d_state][Rp] the decays e^(sp A) of each token of the segment */
    real * M;         /* [d_state][Rp]  dLoss/dH_t without token t's own y term */
    real * dA_acc;    /* Mamba-1 [d_state][Rp], Mamba-2 [Rp]: d_A of each row over time */
    real * Gy;        /* [Rp] grad of y at the token */
    real * dtv;       /* [Rp] dt of the token's rows (Mamba-1, one row per head) */
    real * u;         /* [Rp] sum_n L * B */
    real * w;         /* [Rp] Mamba-1: sum_n L H_{t-1} a A; Mamba-2: sum_n L H_{t-1} */
    real * tok;       /* [Tc][4 Rp + 2 d_state padded] one segment's token inputs (x, sp, xdt, ar; B, C if gathered),
                         gathered while recomputing and reused by the reverse pass */
    real * dB_tok;    /* [d_state padded to lanes] the token's d_B summed over the block's rows */
    real * dC_tok;    /* [d_state padded to lanes] */
} ssm_back_thread;

/* elements of one token's slot in th->tok: every piece a multiple of 64 bytes */
static int64_t ssm_tok_elems(const ssm_scan_params * p, int64_t Rp) {
    return 4 * Rp + 2 * ssm_pad(ssm_max64(p->d_state, 1), SSM_RT);
}

/* v with its per-token vectors pointing into slot i of th->tok */
static ssm_rows ssm_tok_slot(const ssm_scan_params * p, const ssm_rows * v, real * tok,
                                       int64_t Rp, int64_t i) {
    ssm_rows w = *v;
    real * base = tok + i * ssm_tok_elems(p, Rp);
    w.x = base;
    w.sp = base + Rp;
    w.xdt = base + 2 * Rp;
    w.ar = base + 3 * Rp;
    w.Bbuf = base + 4 * Rp;
    w.Cbuf = w.Bbuf + ssm_pad(ssm_max64(p->d_state, 1), SSM_RT);
    w.Bv = w.Bbuf;
    w.Cv = w.Cbuf;
    return w;
}


static void ssm_back_take_thread(ssm_arena * a, const ssm_scan_params * p,
                                      ssm_back_thread * th) {
    const size_t e = sizeof(real), ds = (size_t) p->d_state;
    const int64_t Rp = ssm_max_rows_padded(p), tc = ssm_ckpt_interval(p);
    const int64_t nseg = (p->n_t + tc - 1) / tc;
    ssm_take_rows(a, p, Rp, &th->v);
    th->ckpt = ssm_take(a, (size_t) nseg * ds * Rp * e);
    th->seg = ssm_take(a, (size_t) tc * ds * Rp * e);
    th->dseg = ssm_take(a, p->a_per_state ? (size_t) tc * ds * Rp * e : 0);
    th->tok = ssm_take(a, (size_t) tc * ssm_tok_elems(p, Rp) * e);
    th->M = ssm_take(a, ds * Rp * e);
    th->dA_acc = ssm_take(a, (p->a_per_state ? ds : 1) * Rp * e);
    th->Gy = ssm_take(a, Rp * e);
    th->dtv = ssm_take(a, Rp * e);
    th->u = ssm_take(a, Rp * e);
    th->w = ssm_take(a, Rp * e);
    th->dB_tok = ssm_take(a, (size_t) ssm_pad((int64_t) ds, SSM_LANES) * e);
    th->dC_tok = ssm_take(a, (size_t) ssm_pad((int64_t) ds, SSM_LANES) * e);
}

static size_t ssm_back_thread_bytes(const ssm_scan_params * p) {
    ssm_arena a = { NULL, 0 };
    ssm_back_thread th;
    ssm_back_take_thread(&a, p, &th);
    return a.off;
}


/*
 * The reverse step of one token for a whole block. With M = dLoss/dH_t minus token t's y term:
 *   L      = M + Gy (x) C                                   (term 1: dLoss/dH_t)
 *   u[r]  += L * B[n]                 -> d_x = sp * u,  d_sp gets x * u        (term 2)
 *   w[r]  += L * H_{t-1} * a * A      (Mamba-2: L * H_{t-1}, scaled by a A later)   (term 3)
 *   dA    += L * H_{t-1} * a * sp     (Mamba-1, per state; Mamba-2 per row, later)
 *   dC[n] += Gy * H_t,  dB[n] += L * x * sp                 (sums over the rows)
 *   M      = a * L                                          (carried to token t-1)
 * Written with vector types of 64 bytes (GCC lowers them to AVX-512, AVX2 or SSE halves):
 * a tile of SSM_RT rows is SSM_NV vectors. The sums over rows run down the tile's vectors,
 * then across lanes, SSM_LANES states at a time (ssm_lane_sums), and over tiles in order.
 */
SSM_INLINE void ssm_back_step_impl(const ssm_scan_params * p, int64_t Rp, const ssm_rows * v,
                                         const real * Hc, const real * Hp, const real * Dc,
                                         ssm_back_thread * th, const int per_state) {
    const int64_t ds = p->d_state, dsp = ssm_pad(ds, SSM_LANES);
    vec * M = (vec *) th->M;
    const vec * hc_all = (const vec *) Hc;
    const vec * hp_all = (const vec *) Hp;
    const int64_t rv = Rp / SSM_LANES;                 /* vectors per state row */
    memset(th->dB_tok, 0, dsp * sizeof(real));
    memset(th->dC_tok, 0, dsp * sizeof(real));
    for (int64_t r0 = 0; r0 < Rp; r0 += SSM_RT) {
        const int64_t c0 = r0 / SSM_LANES;
        vec gy[SSM_NV], xl[SSM_NV], al[SSM_NV], sl[SSM_NV], ul[SSM_NV], wl[SSM_NV];
        for (int k = 0; k < SSM_NV; ++k) {
            gy[k] = ((const vec *) th->Gy)[c0 + k];
            xl[k] = ((const vec *) v->xdt)[c0 + k];
            al[k] = ((const vec *) v->ar)[c0 + k];
            sl[k] = ((const vec *) v->sp)[c0 + k];
            ul[k] = (vec) { 0 };
            wl[k] = (vec) { 0 };
        }
        for (int64_t n0 = 0; n0 < ds; n0 += SSM_LANES) {
            vec db[SSM_LANES], dc[SSM_LANES];
            const int nn = (int) ssm_min64(SSM_LANES, ds - n0);
            for (int i = 0; i < nn; ++i) {
                const int64_t n = n0 + i;
                const real Bn = v->Bv[n], Cn = v->Cv[n];
                const vec * hc = hc_all + n * rv + c0;
                const vec * hp = hp_all + n * rv + c0;
                vec * m = M + n * rv + c0;
                vec dbs = { 0 }, dcs = { 0 };
                if (per_state) {
                    const vec * at = (const vec *) (v->At + n * Rp + r0);
                    const vec * dc = (const vec *) Dc + n * rv + c0;     /* the token's decays */
                    vec * dA = (vec *) (th->dA_acc + n * Rp + r0);
                    for (int k = 0; k < SSM_NV; ++k) {
                        const vec a = dc[k];
                        const vec L = m[k] + gy[k] * Cn;
                        const vec z = L * hp[k] * a;
                        ul[k] += L * Bn;
                        wl[k] += z * at[k];
                        dA[k] += SSM_MUTANT(SSM_MUT_BACK_REC_DA, z * sl[k]);
                        m[k] = SSM_MUTANT(SSM_MUT_BACK_REC_DS, a * L);
                        dcs += SSM_MUTANT(SSM_MUT_BACK_REC_DC, gy[k] * hc[k]);
                        dbs += SSM_MUTANT(SSM_MUT_BACK_REC_DB, L * xl[k]);
                    }
                } else {
                    for (int k = 0; k < SSM_NV; ++k) {
                        const vec L = m[k] + gy[k] * Cn;
                        ul[k] += L * Bn;
                        wl[k] += L * hp[k];
                        m[k] = SSM_MUTANT(SSM_MUT_BACK_REC_DS, al[k] * L);
                        dcs += SSM_MUTANT(SSM_MUT_BACK_REC_DC, gy[k] * hc[k]);
                        dbs += SSM_MUTANT(SSM_MUT_BACK_REC_DB, L * xl[k]);
                    }
                }
                db[i] = dbs;
                dc[i] = dcs;
            }
            for (int i = nn; i < SSM_LANES; ++i) {
                db[i] = (vec) { 0 };
                dc[i] = (vec) { 0 };
            }
            *(vec *) (th->dB_tok + n0) += ssm_lane_sums(db);
            *(vec *) (th->dC_tok + n0) += ssm_lane_sums(dc);
        }
        for (int k = 0; k < SSM_NV; ++k) {
            ((vec *) th->u)[c0 + k] = ul[k];
            ((vec *) th->w)[c0 + k] = wl[k];
        }
    }
}

/*
 * The same reverse step for CPUs without AVX-512 (see ssm_vec64 in ssm_common.h), over arrays of
 * real that GCC vectorizes at the target's width (on AVX2 the vector-typed version ran 5x
 * slower than the AVX-512 one). The sums over rows for d_B and d_C run in SSM_VL interleaved
 * partial sums per state, then pairwise: a fixed order, as in the vector version.
 */
SSM_INLINE void ssm_back_step_arr(const ssm_scan_params * p, int64_t Rp, const ssm_rows * v,
                                        const real * Hc, const real * Hp, const real * Dc,
                                        ssm_back_thread * th, const int per_state) {
    const int64_t ds = p->d_state;
    real * restrict dB_tok = th->dB_tok;
    real * restrict dC_tok = th->dC_tok;
    memset(dB_tok, 0, ds * sizeof(real));
    memset(dC_tok, 0, ds * sizeof(real));
    for (int64_t r0 = 0; r0 < Rp; r0 += SSM_RT) {
        real gy[SSM_RT], xl[SSM_RT], al[SSM_RT], sl[SSM_RT], ul[SSM_RT], wl[SSM_RT];
        for (int j = 0; j < SSM_RT; ++j) {
            gy[j] = th->Gy[r0 + j];
            xl[j] = v->xdt[r0 + j];
            al[j] = v->ar[r0 + j];
            sl[j] = v->sp[r0 + j];
            ul[j] = 0;
            wl[j] = 0;
        }
        for (int64_t n = 0; n < ds; ++n) {
            const real Bn = v->Bv[n], Cn = v->Cv[n];
            real * restrict m = th->M + n * Rp + r0;
            const real * restrict hc = Hc + n * Rp + r0;
            const real * restrict hp = Hp + n * Rp + r0;
            real db[SSM_VL] = { 0 }, dc[SSM_VL] = { 0 };
            if (per_state) {
                const real * restrict at = v->At + n * Rp + r0;
                const real * restrict a = Dc + n * Rp + r0;           /* the token's decays */
                real * restrict dA = th->dA_acc + n * Rp + r0;
                for (int j0 = 0; j0 < SSM_RT; j0 += SSM_VL)
                    for (int l = 0; l < SSM_VL; ++l) {
                        const int j = j0 + l;
                        const real L = m[j] + gy[j] * Cn;
                        const real z = L * hp[j] * a[j];
                        ul[j] += L * Bn;
                        wl[j] += z * at[j];
                        dA[j] += SSM_MUTANT(SSM_MUT_BACK_REC_DA, z * sl[j]);
                        m[j] = SSM_MUTANT(SSM_MUT_BACK_REC_DS, a[j] * L);
                        dc[l] += SSM_MUTANT(SSM_MUT_BACK_REC_DC, gy[j] * hc[j]);
                        db[l] += SSM_MUTANT(SSM_MUT_BACK_REC_DB, L * xl[j]);
                    }
            } else {
                for (int j0 = 0; j0 < SSM_RT; j0 += SSM_VL)
                    for (int l = 0; l < SSM_VL; ++l) {
                        const int j = j0 + l;
                        const real L = m[j] + gy[j] * Cn;
                        ul[j] += L * Bn;
                        wl[j] += L * hp[j];
                        m[j] = SSM_MUTANT(SSM_MUT_BACK_REC_DS, al[j] * L);
                        dc[l] += SSM_MUTANT(SSM_MUT_BACK_REC_DC, gy[j] * hc[j]);
                        db[l] += SSM_MUTANT(SSM_MUT_BACK_REC_DB, L * xl[j]);
                    }
            }
            for (int half = SSM_VL / 2; half > 0; half /= 2)
                for (int l = 0; l < half; ++l) {
                    db[l] += db[l + half];
                    dc[l] += dc[l + half];
                }
            dB_tok[n] += db[0];
            dC_tok[n] += dc[0];
        }
        for (int j = 0; j < SSM_RT; ++j) {
            th->u[r0 + j] = ul[j];
            th->w[r0 + j] = wl[j];
        }
    }
}

/*
 * ssm_back_step_arr for the x86-64-v3 pass (ssm_vec32), with the same bits: there GCC kept the
 * array version's per-row sums (u, w) and inputs on the stack, a load and a store of each per
 * state, and versioned its loops for aliasing. This one takes a tile's rows SSM_VL at a time
 * (SSM_VL / SSM_LANES32 vectors of 32 bytes, their per-row values in registers across the states)
 * and its states SSM_BK_NB at a time; each state's SSM_VL interleaved partial sums of d_B and d_C
 * go through a small buffer from one group of rows to the next, in the array version's order
 * (rows j0 + l, j0 increasing), then pairwise as there.
 */
#define SSM_BK_NB 16
#define SSM_BK_G (SSM_VL / SSM_LANES32)
SSM_INLINE void ssm_back_step_v3(const ssm_scan_params * p, int64_t Rp, const ssm_rows * v,
                                       const real * Hc, const real * Hp, const real * Dc,
                                       ssm_back_thread * th, const int per_state) {
    const int64_t ds = p->d_state;
    real * restrict dB_tok = th->dB_tok;
    real * restrict dC_tok = th->dC_tok;
    const real * restrict Bv = v->Bv, * restrict Cv = v->Cv;
    memset(dB_tok, 0, ds * sizeof(real));
    memset(dC_tok, 0, ds * sizeof(real));
    real dbp[SSM_BK_NB][SSM_VL] __attribute__((aligned(32)));
    real dcp[SSM_BK_NB][SSM_VL] __attribute__((aligned(32)));
    for (int64_t r0 = 0; r0 < Rp; r0 += SSM_RT)
        for (int64_t n0 = 0; n0 < ssm_max64(ds, 1); n0 += SSM_BK_NB) {   /* once at d_state 0: u, w = 0 */
            const int nn = (int) ssm_min64(SSM_BK_NB, ds - n0);
            memset(dbp, 0, sizeof dbp);
            memset(dcp, 0, sizeof dcp);
            for (int64_t s0 = r0; s0 < r0 + SSM_RT; s0 += SSM_VL) {
                vec32 gy[SSM_BK_G], xl[SSM_BK_G], fl[SSM_BK_G], ul[SSM_BK_G], wl[SSM_BK_G];
                for (int k = 0; k < SSM_BK_G; ++k) {
                    gy[k] = ((const vec32 *) (th->Gy + s0))[k];
                    xl[k] = ((const vec32 *) (v->xdt + s0))[k];
                    fl[k] = ((const vec32 *) ((per_state ? v->sp : v->ar) + s0))[k];   /* sp, or a */
                    ul[k] = n0 ? ((const vec32 *) (th->u + s0))[k] : (vec32) { 0 };
                    wl[k] = n0 ? ((const vec32 *) (th->w + s0))[k] : (vec32) { 0 };
                }
                for (int i = 0; i < nn; ++i) {
                    const int64_t n = n0 + i;
                    const real Bn = Bv[n], Cn = Cv[n];
                    vec32 * m = (vec32 *) (th->M + n * Rp + s0);
                    const vec32 * hc = (const vec32 *) (Hc + n * Rp + s0);
                    const vec32 * hp = (const vec32 *) (Hp + n * Rp + s0);
                    vec32 * db = (vec32 *) dbp[i];
                    vec32 * dc = (vec32 *) dcp[i];
                    if (per_state) {
                        const vec32 * at = (const vec32 *) (v->At + n * Rp + s0);
                        const vec32 * a = (const vec32 *) (Dc + n * Rp + s0);   /* the token's decays */
                        vec32 * dA = (vec32 *) (th->dA_acc + n * Rp + s0);
                        for (int k = 0; k < SSM_BK_G; ++k) {
                            const vec32 L = m[k] + gy[k] * Cn;
                            const vec32 z = L * hp[k] * a[k];
                            ul[k] += L * Bn;
                            wl[k] += z * at[k];
                            dA[k] += SSM_MUTANT(SSM_MUT_BACK_REC_DA, z * fl[k]);
                            m[k] = SSM_MUTANT(SSM_MUT_BACK_REC_DS, a[k] * L);
                            dc[k] += SSM_MUTANT(SSM_MUT_BACK_REC_DC, gy[k] * hc[k]);
                            db[k] += SSM_MUTANT(SSM_MUT_BACK_REC_DB, L * xl[k]);
                        }
                    } else {
                        for (int k = 0; k < SSM_BK_G; ++k) {
                            const vec32 L = m[k] + gy[k] * Cn;
                            ul[k] += L * Bn;
                            wl[k] += L * hp[k];
                            m[k] = SSM_MUTANT(SSM_MUT_BACK_REC_DS, fl[k] * L);
                            dc[k] += SSM_MUTANT(SSM_MUT_BACK_REC_DC, gy[k] * hc[k]);
                            db[k] += SSM_MUTANT(SSM_MUT_BACK_REC_DB, L * xl[k]);
                        }
                    }
                }
                for (int k = 0; k < SSM_BK_G; ++k) {
                    ((vec32 *) (th->u + s0))[k] = ul[k];
                    ((vec32 *) (th->w + s0))[k] = wl[k];
                }
            }
            for (int i = 0; i < nn; ++i) {
                real * restrict db = dbp[i];
                real * restrict dc = dcp[i];
                for (int half = SSM_VL / 2; half > 0; half /= 2)
                    for (int l = 0; l < half; ++l) {
                        db[l] += db[l + half];
                        dc[l] += dc[l + half];
                    }
                dB_tok[n0 + i] += db[0];
                dC_tok[n0 + i] += dc[0];
            }
        }
}

/* the two branches compiled apart, so that neither carries the other's registers; the vector
 * version with AVX-512 (and at x86-64-v3 its 32-byte form), the array version elsewhere */
static void ssm_back_step_m1_v4(const ssm_scan_params * p, int64_t Rp, const ssm_rows * v,
                                     const real * Hc, const real * Hp, const real * Dc, ssm_back_thread * th) {
    ssm_back_step_impl(p, Rp, v, Hc, Hp, Dc, th, 1);
}

static void ssm_back_step_m2_v4(const ssm_scan_params * p, int64_t Rp, const ssm_rows * v,
                                     const real * Hc, const real * Hp, const real * Dc, ssm_back_thread * th) {
    ssm_back_step_impl(p, Rp, v, Hc, Hp, Dc, th, 0);
}

static void ssm_back_step_m1(const ssm_scan_params * p, int64_t Rp, const ssm_rows * v,
                                  const real * Hc, const real * Hp, const real * Dc, ssm_back_thread * th) {
    if (ssm_vec64(p->simd)) ssm_back_step_m1_v4(p, Rp, v, Hc, Hp, Dc, th);
    else if (ssm_vec32(p->simd)) ssm_back_step_v3(p, Rp, v, Hc, Hp, Dc, th, 1);
    else ssm_back_step_arr(p, Rp, v, Hc, Hp, Dc, th, 1);
}

static void ssm_back_step_m2(const ssm_scan_params * p, int64_t Rp, const ssm_rows * v,
                                  const real * Hc, const real * Hp, const real * Dc, ssm_back_thread * th) {
    if (ssm_vec64(p->simd)) ssm_back_step_m2_v4(p, Rp, v, Hc, Hp, Dc, th);
    else if (ssm_vec32(p->simd)) ssm_back_step_v3(p, Rp, v, Hc, Hp, Dc, th, 0);
    else ssm_back_step_arr(p, Rp, v, Hc, Hp, Dc, th, 0);
}

/*
 * d_x and d_dt of a token for Mamba-1 with one row per head (llama.cpp's layout), as the
 * general loop in ssm_back_block computes them, in a loop that vectorizes: it was a fifth of
 * the whole backward as a per-head scalar loop with a libm expf call in each head's sigmoid.
 *   d_x = sp * u,  d_dt = (x * u + w) * sigmoid(dt)  (1 above ggml's softplus threshold)
 */
static void ssm_back_rows1(int64_t n, const real * restrict sp, const real * restrict xv,
                                const real * restrict u, const real * restrict w,
                                const real * restrict dtv, real * restrict dx, real * restrict ddt) {
    if (ssm_sp_inrange(dtv, n))      /* the cheaper exp where it applies: the same bits */
        for (int64_t i = 0; i < n; ++i) {
            dx[i] = SSM_MUTANT(SSM_MUT_BACK_REC_DX, sp[i] * u[i]);
            const real dsp = xv[i] * u[i] + w[i];
            ddt[i] = SSM_MUTANT(SSM_MUT_BACK_REC_DDT, dsp * real_dsoftplus_inrange(dtv[i]));
        }
    else
        for (int64_t i = 0; i < n; ++i) {
            dx[i] = SSM_MUTANT(SSM_MUT_BACK_REC_DX, sp[i] * u[i]);
            const real dsp = xv[i] * u[i] + w[i];
            ddt[i] = SSM_MUTANT(SSM_MUT_BACK_REC_DDT, dsp * real_dsoftplus(dtv[i]));
        }
}

/*
 * The rows [0, n) of one head: d_x = sp * u, dA_row += spar * w (Mamba-2, with_dA), and
 * returns d_sp = sum over the rows of x * u + aA * w, summed in SSM_VL interleaved partial
 * sums and then pairwise: a fixed order (the same bits for any thread count) that
 * vectorizes, where one running sum was a chain of dependent scalar adds.
 */
static real ssm_back_head(int64_t n, real sp, real aA, int with_dA, real spar, const real * restrict x,
                               const real * restrict u, const real * restrict w, real * restrict dx,
                               real * restrict dA_row) {
    real acc[SSM_VL] = { 0 };
    int64_t i = 0;
    for (; i + SSM_VL <= n; i += SSM_VL)
        for (int j = 0; j < SSM_VL; ++j) acc[j] += x[i + j] * u[i + j] + aA * w[i + j];
    for (int j = 0; i + j < n; ++j) acc[j] += x[i + j] * u[i + j] + aA * w[i + j];
    for (int64_t k = 0; k < n; ++k) dx[k] = SSM_MUTANT(SSM_MUT_BACK_REC_DX, sp * u[k]);
    if (with_dA)
        for (int64_t k = 0; k < n; ++k) dA_row[k] += SSM_MUTANT(SSM_MUT_BACK_REC_DA, spar * w[k]);
    for (int half = SSM_VL / 2; half > 0; half /= 2)
        for (int j = 0; j < half; ++j) acc[j] += acc[j + half];
    return acc[0];
}


/* M (transposed) += a dense (n_head, head_dim, d_state) gradient slot starting at head h0 */
static void ssm_add_slot(const ssm_scan_params * p, const ssm_block * b, const real * src,
                              real * M) {
    const int64_t ds = p->d_state, Rp = b->Rp;
    for (int64_t r = 0; r < b->R; ++r)
        for (int64_t n = 0; n < ds; ++n) M[n * Rp + r] += src[r * ds + n];
}

/* ssm_back_block, step 1: the checkpoint pass. The running state lives in v->H, except that the
 * token before a checkpoint writes its state straight into the checkpoint's slot (no copy).
 * Mamba-2 with 64-byte vectors takes two tokens per pass over the state where the first one's
 * state is not kept, with their row vectors in token slots 0 and 1 (free until the segments). */
SSM_INLINE void ssm_back_checkpoints(const ssm_scan_params * p, const ssm_block * b, const real * s,
                                     const real * x, const real * dt, const real * A, const real * B,
                                     const real * C, const int64_t * ids, int64_t tc, ssm_back_thread * th) {
    const int64_t n_t = p->n_t, ds = p->d_state, Rp = b->Rp;
    ssm_rows * v = &th->v;
    const real * Hcur = th->ckpt;
    ssm_load_state(p, b, s, ids, th->ckpt);
    for (int64_t t = 0; t < n_t;) {
        const int pair = !p->a_per_state && ssm_vec64(p->simd) && tc >= 2 && t + 1 < n_t && (t + 1) % tc != 0;
        const int64_t tl = pair ? t + 1 : t;                /* the last token of this step */
        real * Hout = (tl + 1) % tc == 0 && tl + 1 < n_t ? th->ckpt + (tl + 1) / tc * ds * Rp : v->H;
        if (pair) {
            ssm_rows v0 = ssm_tok_slot(p, v, th->tok, Rp, 0);
            ssm_rows v1 = ssm_tok_slot(p, v, th->tok, Rp, 1);
            ssm_prefetch_token(p, b, x, dt, B, C, t + SSM_PREFETCH_TOKENS);
            ssm_prefetch_token(p, b, x, dt, B, C, t + 1 + SSM_PREFETCH_TOKENS);
            ssm_rows_token(p, b, x, dt, A, B, C, t, &v0);
            ssm_rows_token(p, b, x, dt, A, B, C, t + 1, &v1);
            ssm_step_state_m2_pair(p, Rp, &v0, &v1, Hcur, Hout);
        } else {
            ssm_prefetch_token(p, b, x, dt, B, C, t + SSM_PREFETCH_TOKENS);
            ssm_rows_token(p, b, x, dt, A, B, C, t, v);
            ssm_step_state(p, Rp, v, Hcur, Hout);
        }
        Hcur = Hout;
        t = tl + 1;
    }
}

/* ssm_back_block, step 2: the states of the segment [t0, t1) into th->seg (Mamba-1: and their
 * decays into th->dseg), recomputed from its checkpoint; Mamba-2 with 64-byte vectors two tokens
 * per pass */
SSM_INLINE void ssm_back_recompute(const ssm_scan_params * p, const ssm_block * b, const real * x,
                                   const real * dt, const real * A, const real * B, const real * C, int64_t t0,
                                   int64_t t1, int64_t tc, const real * ckpt_j, ssm_back_thread * th) {
    const int64_t ds = p->d_state, Rp = b->Rp;
    for (int64_t t = t0; t < t1;) {
        const int64_t nt = !p->a_per_state && ssm_vec64(p->simd) && t + 1 < t1 ? 2 : 1;
        ssm_rows vt[2];
        for (int64_t i = 0; i < nt; ++i) {
            const int64_t ti = t + i;
            vt[i] = ssm_tok_slot(p, &th->v, th->tok, Rp, ti - t0);
            ssm_prefetch_token(p, b, x, dt, B, C, ti + SSM_PREFETCH_TOKENS < t1 ? ti + SSM_PREFETCH_TOKENS
                                    : t0 - tc + (ti + SSM_PREFETCH_TOKENS - t1));   /* the next segment's */
            ssm_rows_token(p, b, x, dt, A, B, C, ti, &vt[i]);
        }
        const real * Hin = t == t0 ? ckpt_j : th->seg + (t - t0 - 1) * ds * Rp;
        real * Hout = th->seg + (t - t0) * ds * Rp;
        if (p->a_per_state)
            ssm_step_state_m1_decay(p, Rp, &vt[0], Hin, Hout, th->dseg + (t - t0) * ds * Rp);
        else if (nt == 2)
            ssm_step_state_m2_pair_keep(p, Rp, &vt[0], &vt[1], Hin, Hout, Hout + ds * Rp);
        else
            ssm_step_state(p, Rp, &vt[0], Hin, Hout);
        t += nt;
    }
}

/* ssm_back_block, step 3: token t's d_x and d_dt (owned by this block) from the reverse step's
 * u, w (restrict locals: see ssm_rows_token); Mamba-1 d_A's per-row terms go to th->dA_acc */
SSM_INLINE void ssm_back_dx_ddt(const ssm_scan_params * p, const ssm_block * b, const real * dt, const real * A,
                                const ssm_rows * vt, int64_t t, real * d_x, real * d_dt, ssm_back_thread * th) {
    const int64_t n_head = p->n_head, hd = p->head_dim, n_t = p->n_t, q = b->q, R = b->R;
    const real * restrict u = th->u, * restrict w = th->w, * restrict xv = vt->x;
    real * restrict dA_row = th->dA_acc;
    real * restrict dx = d_x + ((q * n_t + t) * n_head + b->h0) * hd;
    if (hd == 1 && p->a_per_state) {
        /* the token's dt row as is when contiguous, else gathered (into a restrict local:
         * through th->dtv the loop reloaded the pointer at every element) */
        const int64_t dt2 = p->dt_st[2];
        const real * dtr = dt + q * p->dt_st[0] + t * p->dt_st[1] + b->h0 * dt2;
        if (dt2 != 1) {
            real * restrict dg = th->dtv;
            for (int64_t r = 0; r < R; ++r) dg[r] = dtr[r * dt2];
            dtr = dg;
        }
        ssm_back_rows1(R, vt->sp, xv, u, w, dtr, dx, d_dt + (q * n_t + t) * n_head + b->h0);
    } else {
        for (int64_t h = b->h0; h < b->h1; ++h) {
            const int64_t r0 = (h - b->h0) * hd;
            const real sp = vt->sp[r0], ar = vt->ar[r0];
            const real aA = p->a_per_state ? 1 : ar * A[h * p->A_st[0]];
            const real dsp = ssm_back_head(hd, sp, aA, !p->a_per_state, sp * ar, xv + r0,
                                           u + r0, w + r0, dx + r0, dA_row + r0);
            const real d = dt[q * p->dt_st[0] + t * p->dt_st[1] + h * p->dt_st[2]];
            d_dt[(q * n_t + t) * n_head + h] = SSM_MUTANT(SSM_MUT_BACK_REC_DDT, dsp * real_dsoftplus(d));
        }
    }
}

/* ssm_back_block, step 4: the reverse recurrence over the segment [t0, t1), tokens in decreasing
 * order: the incoming gradients of y_t (and of a snapshot slot that holds H_t) join M, the
 * reverse step, d_x and d_dt, and the token's d_B, d_C into the unit's partial sums (set by the
 * unit's first block, added by the others) */
SSM_INLINE void ssm_back_reverse(const ssm_scan_params * p, const ssm_block * b, const real * dt, const real * A,
                                 const real * B, const real * C, const real * grad, real * gin, real * dB_part,
                                 real * dC_part, const int first, int64_t t0, int64_t t1, const real * ckpt_j,
                                 ssm_back_thread * th) {
    const int64_t n_head = p->n_head, hd = p->head_dim, ds = p->d_state;
    const int64_t n_t = p->n_t, n_seqs = p->n_seqs, K = p->K, q = b->q, Rp = b->Rp, R = b->R;
    const int64_t N_y = n_seqs * n_t * n_head * hd;
    const real * gy_in = grad;
    const real * gs_in = grad + N_y;
    real * d_x = gin + p->n_rs * n_head * hd * ds;
    real * d_dt = d_x + N_y;
    for (int64_t t = t1 - 1; t >= t0; --t) {
        ssm_rows vt = ssm_tok_slot(p, &th->v, th->tok, Rp, t - t0);
        ssm_token_bc(p, b, B, C, t, &vt, 0);      /* B, C as the recomputation saw them */
        if (t - SSM_PREFETCH_TOKENS >= t0) {   /* what this loop reads 2 tokens on */
            const int64_t tp = t - SSM_PREFETCH_TOKENS;
            ssm_prefetch_run(gy_in + ((q * n_t + tp) * n_head + b->h0) * hd, R);
            if (!first) {
                ssm_prefetch_run(dB_part + tp * ds, ds);
                ssm_prefetch_run(dC_part + tp * ds, ds);
            }
        }
        const int64_t k = n_t - 1 - t;     /* snapshot slot k is H_t: its gradient joins here */
        if (k >= 1 && k < K)
            ssm_add_slot(p, b, gs_in + ((k * n_seqs + q) * n_head + b->h0) * hd * ds, th->M);
        memcpy(th->Gy, gy_in + ((q * n_t + t) * n_head + b->h0) * hd, R * sizeof(real));

        const real * Hc = th->seg + (t - t0) * ds * Rp;
        const real * Hp = t == t0 ? ckpt_j : th->seg + (t - t0 - 1) * ds * Rp;
        if (p->a_per_state) ssm_back_step_m1(p, Rp, &vt, Hc, Hp, th->dseg + (t - t0) * ds * Rp, th);
        else ssm_back_step_m2(p, Rp, &vt, Hc, Hp, NULL, th);

        ssm_back_dx_ddt(p, b, dt, A, &vt, t, d_x, d_dt, th);
        if (first) {                        /* the unit's first block sets its partial sums */
            memcpy(dB_part + t * ds, th->dB_tok, ds * sizeof(real));
            memcpy(dC_part + t * ds, th->dC_tok, ds * sizeof(real));
        } else {
            ssm_add_to(dB_part + t * ds, th->dB_tok, ds);
            ssm_add_to(dC_part + t * ds, th->dC_tok, ds);
        }
    }
}

/* ssm_back_block, step 5: what is left in M is a_1 * L_1 = dLoss/dH_0, this sequence's share of
 * d_s; and the block's d_A, summed over each head's rows */
SSM_INLINE void ssm_back_block_out(const ssm_scan_params * p, const ssm_block * b, const ssm_back_shared * sh,
                                   ssm_back_thread * th) {
    const int64_t n_head = p->n_head, hd = p->head_dim, ds = p->d_state, q = b->q, Rp = b->Rp;
    ssm_store_state(p, b, th->M, sh->dS_seq + (q * n_head + b->h0) * hd * ds);
    for (int64_t h = b->h0; h < b->h1; ++h) {
        const int64_t r0 = (h - b->h0) * hd;
        if (p->a_per_state) {
            for (int64_t n = 0; n < ds; ++n) {
                real acc = 0;
                for (int64_t pp = 0; pp < hd; ++pp) acc += th->dA_acc[n * Rp + r0 + pp];
                sh->dA_seq[(q * n_head + h) * ds + n] = acc;
            }
        } else {
            real acc = 0;
            for (int64_t pp = 0; pp < hd; ++pp) acc += th->dA_acc[r0 + pp];
            sh->dA_seq[q * n_head + h] = acc;
        }
    }
}

/* Phase 1 for one block b of a unit: the checkpoint pass, then per segment from the last, its
 * states recomputed and the reverse recurrence over it. first: b is the unit's first block. */
static void ssm_back_block(const ssm_scan_params * p, const ssm_block * b,
                                const real * s, const real * x, const real * dt, const real * A,
                                const real * B, const real * C, const int64_t * ids,
                                const real * grad, real * gin, const ssm_back_shared * sh,
                                real * dB_part, real * dC_part, const int first,
                                ssm_back_thread * th) {
    const int64_t n_head = p->n_head, hd = p->head_dim, ds = p->d_state;
    const int64_t n_t = p->n_t, n_seqs = p->n_seqs, q = b->q, Rp = b->Rp;
    const int64_t tc = ssm_ckpt_interval(p), nseg = (n_t + tc - 1) / tc;
    const size_t st_bytes = (size_t) ds * Rp * sizeof(real);
    const real * gs_in = grad + n_seqs * n_t * n_head * hd;

    ssm_rows_begin(p, b, A, &th->v);
    /* pad rows of every token slot stay zero */
    memset(th->tok, 0, (size_t) ssm_min64(tc, n_t) * ssm_tok_elems(p, Rp) * sizeof(real));
    ssm_back_checkpoints(p, b, s, x, dt, A, B, C, ids, tc, th);

    /* the final state's gradient seeds the reverse recurrence */
    memset(th->M, 0, st_bytes);
    ssm_add_slot(p, b, gs_in + (q * n_head + b->h0) * hd * ds, th->M);
    memset(th->dA_acc, 0, (p->a_per_state ? ds : 1) * Rp * sizeof(real));
    memset(th->Gy, 0, Rp * sizeof(real));
    for (int64_t j = nseg - 1; j >= 0; --j) {
        const int64_t t0 = j * tc, t1 = ssm_min64(t0 + tc, n_t);
        const real * ckpt_j = th->ckpt + j * ds * Rp;
        ssm_back_recompute(p, b, x, dt, A, B, C, t0, t1, tc, ckpt_j, th);
        ssm_back_reverse(p, b, dt, A, B, C, grad, gin, dB_part, dC_part, first, t0, t1, ckpt_j, th);
    }
    ssm_back_block_out(p, b, sh, th);
}

/* Bytes of one thread's slot of the work: the chunked form's buffers or the recurrence's. */
static size_t ssm_back_slot_bytes(const ssm_scan_params * p) {
    return ssm_scan_back_chunked(p) ? ssm_back_chunked_thread_bytes(p) : ssm_back_thread_bytes(p);
}

/*
 * Backward, phase 1.
 *   inputs as the forward; grad: the whole packed gradient of out (y region and K state slots)
 *   -> gin [d_s | d_x | d_dt | d_B | d_C]: this phase writes d_x and d_dt; partial sums go to work
 *   kept: NULL, or the forward's chunk states (ssm_scan_keep_*), which the chunked form then reads
 *   instead of recomputing them (the recurrence never takes them: ssm_scan_chunk_states is 0 there)
 * Thread ith owns a contiguous range of the (sequence, group, head run) units.
 */
static void ssm_scan_back(const ssm_scan_params * p, const real * s, const real * x,
                        const real * dt, const real * A, const real * B, const real * C,
                        const int64_t * ids, const real * kept, const real * grad, real * gin,
                        void * work, int ith, int nth) {
    const int64_t n_t = p->n_t, ds = p->d_state, n_group = p->n_group;
    const int64_t hpg = ssm_heads_per_group(p), rpg = ssm_head_runs_per_group(p);
    const int64_t bh = ssm_block_heads(p);

    ssm_arena a = { (char *) work, 0 };
    ssm_back_shared sh;
    ssm_back_take_shared(&a, p, &sh);
    ssm_arena ta = { (char *) work + a.off + ssm_back_slot_bytes(p) * (size_t) ith, 0 };
    int64_t u_lo, u_hi;
    ssm_split(ssm_scan_back_units(p), ith, nth, &u_lo, &u_hi);

    if (ssm_scan_back_chunked(p)) {
        ssm_back_phase1_chunked(p, s, x, dt, A, B, C, ids, kept, grad, gin, &sh, &ta, u_lo, u_hi);
        return;
    }

    ssm_back_thread th;
    ssm_back_take_thread(&ta, p, &th);
    for (int64_t unit = u_lo; unit < u_hi; ++unit) {
        const int64_t q = unit / (n_group * rpg);
        const int64_t g = unit / rpg % n_group, c = unit % rpg;
        const int64_t hs = g * hpg + c * hpg / rpg, he = g * hpg + (c + 1) * hpg / rpg;
        real * dB_part = sh.dB_part + unit * n_t * ds;
        real * dC_part = sh.dC_part + unit * n_t * ds;
        for (int64_t h0 = hs; h0 < he; h0 += bh) {
            const ssm_block b = ssm_make_block(p, q, h0, ssm_min64(h0 + bh, he));
            ssm_back_block(p, &b, s, x, dt, A, B, C, ids, grad, gin, &sh, dB_part, dC_part, h0 == hs, &th);
        }
    }
}

#endif /* SSM_SCAN_BACK_RECURRENCE_BODY_H */
