/*
 * gdn_dot.h -- x . y in ggml's order (gdn_dot), typed: the token recurrence's dot products (gdn_step.h) and
 * the chunked backwards' row sums (gdn_back_chunked_body.h, gdn_kda_chunked_body.h: d gamma, d beta,
 * <H0, dH>, which summed in increasing order were one dependent chain of adds, 12% of the scalar gate's
 * backward at S 128). Needs `real` (ssm_real_f32.h / ssm_real_f64.h) first.
 */
#ifndef GDN_DOT_H
#define GDN_DOT_H

#include <stdint.h>

/* x . y in ggml's order (ggml_vec_dot_f32 on x86-64 with AVX2/FMA, the build ggml/build.sh makes, with
 * REAL_DOT_LANES 32): REAL_DOT_LANES running sums over blocks of REAL_DOT_LANES elements, halved to 4 lanes, the
 * 4 added pairwise ((0+1) + (2+3), its two horizontal adds), then the elements past the last whole
 * block one by one. The same bits for any caller. */
static inline real gdn_dot(const real * x, const real * y, int64_t n) {
    real acc[REAL_DOT_LANES];
    for (int l = 0; l < REAL_DOT_LANES; ++l) acc[l] = 0;
    int64_t i = 0;
    for (; i + REAL_DOT_LANES <= n; i += REAL_DOT_LANES)
        for (int l = 0; l < REAL_DOT_LANES; ++l) acc[l] += x[i + l] * y[i + l];
    for (int w = REAL_DOT_LANES / 2; w >= 4; w /= 2)
        for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
    real sum = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    for (; i < n; ++i) sum += x[i] * y[i];
    return sum;
}

#endif
