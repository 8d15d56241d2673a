/*
 * ssm_scan_step.h -- the scan's token step on a block of rows (ssm_scan_layout.h): for every
 * row r (a (head, p) pair of the block) and state n, with the block's state H transposed,
 *   H[n][r] = e^(softplus(dt_r) * A[r][n]) * H[n][r] + B[n] * x[r] * softplus(dt_r)
 *   y[r]    = sum_n H[n][r] * C[n]          (n increasing: ggml's order)
 * in register tiles of SSM_RT rows; Mamba-1 (A per state) and Mamba-2 (A per head), the AVX-512
 * versions in 64-byte vector types (ssm_vec64) and the array loops of other CPUs. The forward's
 * recurrence (ssm_scan_recurrence_body.h) and the backward's recomputation of states
 * (ssm_scan_back_recurrence_body.h) both run
 * it; tests/reference.py's ref_ssm_scan is the math it is checked against (tests/kernels/test_scan.py).
 *
 * Part of a kernel body (csrc/ssm_scan_*_body.h): included after the element type's header
 * (ssm_real_f32.h / ssm_real_f64.h), once per translation unit.
 */
#ifndef SSM_SCAN_STEP_H
#define SSM_SCAN_STEP_H

#include "ssm_scan_rows.h"

/*
 * Whether e^(sp * A) of every row of the tile at r0 and every state is in the range of
 * real_exp_poly_fast: |fl(sp * a)| <= fl(sp * max|a|) by the monotony of rounding, and a NaN or
 * infinity anywhere fails the test. Mamba-1's real decays pass it; tiles that do not (a huge
 * softplus(dt), say) take real_exp_poly, which handles every input.
 */
SSM_INLINE int ssm_tile_exp_fast(const ssm_rows * v, int64_t r0) {
    int bad = 0;
    for (int j = 0; j < SSM_RT; ++j) bad |= !(v->sp[r0 + j] * v->Amax[r0 + j] <= REAL_EXP_FAST_MAX);
    return !bad;
}

/* Mamba-1: the tile's token step over every state, with e^(sp * A) by real_exp_poly_fast or real_exp_poly;
 * the decays also go to Dout ([d_state][Rp], like H) if keep_decay */
SSM_INLINE void ssm_step_m1_tile(const ssm_scan_params * p, int64_t Rp, int64_t r0,
                                       const ssm_rows * v, const real * sl, const real * xl,
                                       const real * Hin, real * Hout, real * yl, const int with_y,
                                       real * Dout, const int keep_decay, const int fast) {
    for (int64_t n = 0; n < p->d_state; ++n) {
        const real Bn = v->Bv[n], Cn = v->Cv[n];
        const real * hi = Hin + n * Rp + r0;
        const real * at = v->At + n * Rp + r0;
        real * ho = Hout + n * Rp + r0;
        for (int j = 0; j < SSM_RT; ++j) {
            const real a = fast ? real_exp_poly_fast(sl[j] * at[j]) : real_exp_poly(sl[j] * at[j]);
            const real h = hi[j] * a + Bn * xl[j];
            ho[j] = h;
            if (keep_decay) Dout[n * Rp + r0 + j] = a;
            if (with_y) yl[j] += SSM_MUTANT(SSM_MUT_SCAN_REC_Y, h * Cn);
        }
    }
}

/*
 * Mamba-1 with AVX-512, a tile whose decays are all in real_exp_poly_fast's range: ssm_step_m1_tile in
 * vector types, the same operations in the same order (the same bits), with the tile's x * sp,
 * sp and y in registers. As arrays of real GCC kept y and sp on the stack: a load and a store of
 * y and a load of sp per vector and state, beside the exp's 20 operations (docs/performance.md).
 */
SSM_INLINE void ssm_step_m1_tile_v4(const ssm_scan_params * p, int64_t Rp, int64_t r0,
                                          const ssm_rows * v, const real * Hin, real * Hout,
                                          real * y, const int with_y, real * Dout, const int keep_decay) {
    const int64_t c0 = r0 / SSM_LANES, rv = Rp / SSM_LANES, ds = p->d_state;
    const real * restrict Bv = v->Bv, * restrict Cv = v->Cv;   /* not reloaded after each store */
    vec xv[SSM_NV], sv[SSM_NV], yv[SSM_NV];
    for (int k = 0; k < SSM_NV; ++k) {
        xv[k] = ((const vec *) v->xdt)[c0 + k];
        sv[k] = ((const vec *) v->sp)[c0 + k];
        yv[k] = (vec) { 0 };
    }
    for (int64_t n = 0; n < ds; ++n) {
        const real Bn = Bv[n], Cn = Cv[n];
        const vec * hi = (const vec *) Hin + n * rv + c0;
        const vec * at = (const vec *) v->At + n * rv + c0;
        vec * ho = (vec *) Hout + n * rv + c0;
        vec * dd = keep_decay ? (vec *) Dout + n * rv + c0 : NULL;   /* Dout may be NULL */
        for (int k = 0; k < SSM_NV; ++k) {
            const vec a = REAL_EXP_FAST_VEC(vec, uvec, sv[k] * at[k]);
            const vec h = hi[k] * a + Bn * xv[k];
            ho[k] = h;
            if (keep_decay) dd[k] = a;
            if (with_y) yv[k] += SSM_MUTANT(SSM_MUT_SCAN_REC_Y, h * Cn);
        }
    }
    if (with_y)
        for (int k = 0; k < SSM_NV; ++k) ((vec *) y)[c0 + k] = yv[k];
}

/*
 * The same for the x86-64-v3 pass (ssm_vec32): AVX2 has 16 registers of 32 bytes, where the tile's
 * x * sp, sp and y alone would take 24, so the tile runs in sub-tiles of SSM_M1_SUB vectors, each
 * over every state (the tile's B and C are read once per sub-tile; H, A and the decays once). The
 * array loop (ssm_step_m1_tile) kept y and sp on the stack there too. The same operations in
 * the same order per row as ssm_step_m1_tile (the same bits: tests/kernels/test_scan_hashes.py).
 */
#define SSM_M1_SUB 2
SSM_INLINE void ssm_step_m1_tile_v3(const ssm_scan_params * p, int64_t Rp, int64_t r0,
                                          const ssm_rows * v, const real * Hin, real * Hout,
                                          real * y, const int with_y, real * Dout, const int keep_decay) {
    const int64_t ds = p->d_state;
    const real * restrict Bv = v->Bv, * restrict Cv = v->Cv;
    for (int64_t s0 = r0; s0 < r0 + SSM_RT; s0 += SSM_M1_SUB * SSM_LANES32) {
        vec32 xv[SSM_M1_SUB], sv[SSM_M1_SUB], yv[SSM_M1_SUB];
        for (int k = 0; k < SSM_M1_SUB; ++k) {
            xv[k] = ((const vec32 *) (v->xdt + s0))[k];
            sv[k] = ((const vec32 *) (v->sp + s0))[k];
            yv[k] = (vec32) { 0 };
        }
        for (int64_t n = 0; n < ds; ++n) {
            const real Bn = Bv[n], Cn = Cv[n];
            const vec32 * hi = (const vec32 *) (Hin + n * Rp + s0);
            const vec32 * at = (const vec32 *) (v->At + n * Rp + s0);
            vec32 * ho = (vec32 *) (Hout + n * Rp + s0);
            vec32 * dd = keep_decay ? (vec32 *) (Dout + n * Rp + s0) : NULL;   /* Dout may be NULL */
            for (int k = 0; k < SSM_M1_SUB; ++k) {
                const vec32 a = REAL_EXP_FAST_VEC(vec32, uvec32, sv[k] * at[k]);
                const vec32 h = hi[k] * a + Bn * xv[k];
                ho[k] = h;
                if (keep_decay) dd[k] = a;
                if (with_y) yv[k] += SSM_MUTANT(SSM_MUT_SCAN_REC_Y, h * Cn);
            }
        }
        if (with_y)
            for (int k = 0; k < SSM_M1_SUB; ++k) ((vec32 *) (y + s0))[k] = yv[k];
    }
}

/*
 * Mamba-2: the tile's token step, with one decay a per row, for CPUs without AVX-512 (see
 * ssm_vec64): loops over arrays of real that GCC vectorizes at each target's width.
 */
SSM_INLINE void ssm_step_m2_tile_arr(const ssm_scan_params * p, int64_t Rp, int64_t r0,
                                           const ssm_rows * v, const real * Hin, real * Hout,
                                           real * y, const int with_y) {
    real yl[SSM_RT], xl[SSM_RT], al[SSM_RT];
    for (int j = 0; j < SSM_RT; ++j) {
        yl[j] = 0;
        xl[j] = v->xdt[r0 + j];
        al[j] = v->ar[r0 + j];
    }
    for (int64_t n = 0; n < p->d_state; ++n) {
        const real Bn = v->Bv[n], Cn = v->Cv[n];
        const real * hi = Hin + n * Rp + r0;
        real * ho = Hout + n * Rp + r0;
        for (int j = 0; j < SSM_RT; ++j) {
            const real h = hi[j] * al[j] + Bn * xl[j];
            ho[j] = h;
            if (with_y) yl[j] += SSM_MUTANT(SSM_MUT_SCAN_REC_Y, h * Cn);
        }
    }
    if (with_y)
        for (int j = 0; j < SSM_RT; ++j) y[r0 + j] = yl[j];
}

/*
 * The same in vector types, for AVX-512: there the tile's y accumulators stay in registers,
 * where as arrays of real GCC kept them on the stack and storing each partial sum made the
 * loop store-bound (4.2 cycles per vector, not 3). The same operations in the same order.
 */
SSM_INLINE void ssm_step_m2_tile(const ssm_scan_params * p, int64_t Rp, int64_t r0,
                                       const ssm_rows * v, const real * Hin, real * Hout,
                                       real * y, const int with_y) {
    const int64_t c0 = r0 / SSM_LANES, rv = Rp / SSM_LANES, ds = p->d_state;
    const real * restrict Bv = v->Bv, * restrict Cv = v->Cv;   /* not reloaded after each store */
    vec xv[SSM_NV], av[SSM_NV], yv[SSM_NV];
    for (int k = 0; k < SSM_NV; ++k) {
        xv[k] = ((const vec *) v->xdt)[c0 + k];
        av[k] = ((const vec *) v->ar)[c0 + k];
        yv[k] = (vec) { 0 };
    }
    for (int64_t n = 0; n < ds; ++n) {
        const real Bn = Bv[n], Cn = Cv[n];
        const vec * hi = (const vec *) Hin + n * rv + c0;
        vec * ho = (vec *) Hout + n * rv + c0;
        for (int k = 0; k < SSM_NV; ++k) {
            const vec h = hi[k] * av[k] + Bn * xv[k];
            ho[k] = h;
            if (with_y) yv[k] += SSM_MUTANT(SSM_MUT_SCAN_REC_Y, h * Cn);
        }
    }
    if (with_y)
        for (int k = 0; k < SSM_NV; ++k) ((vec *) y)[c0 + k] = yv[k];
}

/*
 * One token of the recurrence for a whole block, Hout = a * Hin + B (x) xdt (in place when
 * Hin == Hout), and with_y: y[r] = sum_n Hout[n][r] * C[n] in increasing n (ggml's order).
 * Register-tiled: SSM_RT rows at a time, the per-row vectors held across the loop over n.
 */
SSM_INLINE void ssm_step_tiles(const ssm_scan_params * p, int64_t Rp, const ssm_rows * v,
                                     const real * Hin, real * Hout, real * y, const int with_y,
                                     real * Dout, const int keep_decay, const int per_state) {
    for (int64_t r0 = 0; r0 < Rp; r0 += SSM_RT) {
        if (!per_state) {
            ssm_step_m2_tile_arr(p, Rp, r0, v, Hin, Hout, y, with_y);
            continue;
        }
        const int fast = ssm_tile_exp_fast(v, r0);
        if (fast && ssm_vec64(p->simd)) {
            ssm_step_m1_tile_v4(p, Rp, r0, v, Hin, Hout, y, with_y, Dout, keep_decay);
            continue;
        }
        if (fast && ssm_vec32(p->simd)) {
            ssm_step_m1_tile_v3(p, Rp, r0, v, Hin, Hout, y, with_y, Dout, keep_decay);
            continue;
        }
        real yl[SSM_RT], xl[SSM_RT], sl[SSM_RT];
        for (int j = 0; j < SSM_RT; ++j) {
            yl[j] = 0;
            xl[j] = v->xdt[r0 + j];
            sl[j] = v->sp[r0 + j];
        }
        if (fast)
            ssm_step_m1_tile(p, Rp, r0, v, sl, xl, Hin, Hout, yl, with_y, Dout, keep_decay, 1);
        else
            ssm_step_m1_tile(p, Rp, r0, v, sl, xl, Hin, Hout, yl, with_y, Dout, keep_decay, 0);
        if (with_y)
            for (int j = 0; j < SSM_RT; ++j) y[r0 + j] = yl[j];
    }
}

/* ssm_step_tiles, with Hout itself as Hin when the step is in place (the forward, and the
 * backward between checkpoints): then the compiler sees that each state element is read
 * before it is written at the same index, and vectorizes without a runtime overlap check.
 * clang 14's check fails for equal pointers, and it then ran the scalar loop (measured: the
 * Mamba-1 backward 2.4x slower than GCC's). */
SSM_INLINE void ssm_step_impl(const ssm_scan_params * p, int64_t Rp, const ssm_rows * v,
                                    const real * Hin, real * Hout, real * y, const int with_y,
                                    real * Dout, const int keep_decay, const int per_state) {
    if (Hin == Hout) ssm_step_tiles(p, Rp, v, Hout, Hout, y, with_y, Dout, keep_decay, per_state);
    else ssm_step_tiles(p, Rp, v, Hin, Hout, y, with_y, Dout, keep_decay, per_state);
}

/* Mamba-2's token step with AVX-512, y if with_y (ssm_step_m2_tile) */
static void ssm_step_m2_v4(const ssm_scan_params * p, int64_t Rp, const ssm_rows * v,
                                const real * Hin, real * Hout, real * y, const int with_y) {
    for (int64_t r0 = 0; r0 < Rp; r0 += SSM_RT) {
        if (with_y) ssm_step_m2_tile(p, Rp, r0, v, Hin, Hout, y, 1);
        else ssm_step_m2_tile(p, Rp, r0, v, Hin, Hout, NULL, 0);
    }
}

/*
 * Mamba-2, two tokens in one pass over the state, Hout = a1 * (a0 * Hin + B0 (x) xdt0) + B1 (x) xdt1
 * with v0, v1 the tokens' row vectors, and the state between them to Hmid if keep_mid: the
 * same operations in the same order as two calls of ssm_step_state (the same bits), with
 * one load of the state instead of two, and one store instead of two where the state between
 * is not kept. The backward's checkpoint pass, which keeps only every Tc-th state, was bound
 * by those stores; the recomputation of a segment, which keeps them all, saves the load.
 */
SSM_INLINE void ssm_step_m2_pair_impl(const ssm_scan_params * p, int64_t Rp, const ssm_rows * v0,
                                            const ssm_rows * v1, const real * Hin, real * Hmid,
                                            real * Hout, const int keep_mid) {
    const int64_t rv = Rp / SSM_LANES, ds = p->d_state;
    const real * restrict B0 = v0->Bv, * restrict B1 = v1->Bv;
    for (int64_t r0 = 0; r0 < Rp; r0 += SSM_RT) {
        const int64_t c0 = r0 / SSM_LANES;
        vec x0[SSM_NV], a0[SSM_NV], x1[SSM_NV], a1[SSM_NV];
        for (int k = 0; k < SSM_NV; ++k) {
            x0[k] = ((const vec *) v0->xdt)[c0 + k];
            a0[k] = ((const vec *) v0->ar)[c0 + k];
            x1[k] = ((const vec *) v1->xdt)[c0 + k];
            a1[k] = ((const vec *) v1->ar)[c0 + k];
        }
        for (int64_t n = 0; n < ds; ++n) {
            const real b0 = B0[n], b1 = B1[n];
            const vec * hi = (const vec *) Hin + n * rv + c0;
            vec * hm = keep_mid ? (vec *) Hmid + n * rv + c0 : NULL;   /* Hmid may be NULL */
            vec * ho = (vec *) Hout + n * rv + c0;
            for (int k = 0; k < SSM_NV; ++k) {
                const vec h = hi[k] * a0[k] + b0 * x0[k];
                if (keep_mid) hm[k] = h;
                ho[k] = h * a1[k] + b1 * x1[k];
            }
        }
    }
}

#endif /* SSM_SCAN_STEP_H */
