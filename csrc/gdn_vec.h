/*
 * gdn_vec.h -- what the token recurrence's vector forms share (levels 4 and 3) (the forward's gdn_fwd_unit_v in
 * gdn_recurrence_body.h, the backward's gdn_back_unit_v in gdn_back_recurrence_body.h): the GCC
 * vector types, loads and stores, the lane shuffles, gdn_dot's reduction tree on one vector
 * (gdn_vsum) and on GDN_LANES rows at once (gdn_vsum_rows), its running sums (gdn_vdot_acc), and the
 * shapes the vector forms take (gdn_fwd_vec_ok). At level 4 in 64-byte vectors, at level 3 in 32-byte
 * ones (AVX2), with the same sums in the same order; empty below SSM_LEVEL 3. Part of a kernel body:
 * included after the element type's header, once per translation unit (csrc/inst/gdn_<type>_v<N>.c).
 */
#ifndef GDN_VEC_H
#define GDN_VEC_H

#ifndef SSM_REAL_H
#error "include ssm_real_f32.h or ssm_real_f64.h before gdn_vec.h"
#endif

#include <string.h>

#include "ssm_common.h"
#include "gdn_common.h"

#if SSM_LEVEL >= 3
/* the vector width: one AVX-512 register at level 4, one AVX2 register at level 3 (ssm_vec64 /
 * ssm_vec32); GDN_LANES reals per vector (16 or 8 floats, 8 or 4 doubles) */
#if SSM_LEVEL >= 4
#define GDN_VBYTES 64
#define GDN_LANES REAL_LANES
#else
#define GDN_VBYTES 32
#define GDN_LANES (REAL_LANES / 2)
#endif
typedef real gdn_vec __attribute__((vector_size(GDN_VBYTES)));
typedef real gdn_vec_h __attribute__((vector_size(GDN_VBYTES / 2)));
#if GDN_LANES == 16
typedef real gdn_vec_q __attribute__((vector_size(GDN_VBYTES / 4)));
#endif
#define GDN_NACC (REAL_DOT_LANES / GDN_LANES)   /* vector accumulators of a dot product: 1, 2 or 4 */
#define GDN_NV_MAX 16                           /* vectors per row the vector forms take */

SSM_INLINE gdn_vec gdn_vload(const real * x) {
    gdn_vec v;
    memcpy(&v, x, sizeof v);
    return v;
}

SSM_INLINE void gdn_vstore(real * x, gdn_vec v) { memcpy(x, &v, sizeof v); }

/* Lane shuffles. GDN_SHUF(x, y, i0, i1, ...): lanes of x then y picked by constant indices, as many as
 * the vectors have. GDN_LO / GDN_HI: the low / high half of a vector (GDN_LO_Q / GDN_HI_Q of a half).
 * clang and GCC 12+ have __builtin_shufflevector; GCC 11 only __builtin_shuffle, whose mask is a
 * vector of the same lane count and width (so halves are taken by memcpy, which it compiles to the
 * same lane extracts). Either way the same lanes are added in the same order: the same bits. */
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define GDN_SHUF(x, y, ...) __builtin_shufflevector(x, y, __VA_ARGS__)
#if GDN_LANES == 16
#define GDN_LO(s) __builtin_shufflevector(s, s, 0, 1, 2, 3, 4, 5, 6, 7)
#define GDN_HI(s) __builtin_shufflevector(s, s, 8, 9, 10, 11, 12, 13, 14, 15)
#define GDN_LO_Q(h) __builtin_shufflevector(h, h, 0, 1, 2, 3)
#define GDN_HI_Q(h) __builtin_shufflevector(h, h, 4, 5, 6, 7)
#elif GDN_LANES == 8
#define GDN_LO(s) __builtin_shufflevector(s, s, 0, 1, 2, 3)
#define GDN_HI(s) __builtin_shufflevector(s, s, 4, 5, 6, 7)
#endif
#else
#if REAL_LANES == 16
typedef int32_t gdn_mask __attribute__((vector_size(GDN_VBYTES)));
#else
typedef int64_t gdn_mask __attribute__((vector_size(GDN_VBYTES)));
#endif
#define GDN_SHUF(x, y, ...) __builtin_shuffle(x, y, (gdn_mask) { __VA_ARGS__ })
SSM_INLINE gdn_vec_h gdn_half(gdn_vec s, int hi) {
    gdn_vec_h h;
    memcpy(&h, (const char *) &s + hi * sizeof h, sizeof h);
    return h;
}
#define GDN_LO(s) gdn_half(s, 0)
#define GDN_HI(s) gdn_half(s, 1)
#if GDN_LANES == 16
SSM_INLINE gdn_vec_q gdn_quarter(gdn_vec_h h, int hi) {
    gdn_vec_q q;
    memcpy(&q, (const char *) &h + hi * sizeof q, sizeof q);
    return q;
}
#define GDN_LO_Q(h) gdn_quarter(h, 0)
#define GDN_HI_Q(h) gdn_quarter(h, 1)
#endif
#endif

/* the sum of s's lanes in gdn_dot's tree: halvings down to 4 lanes, then (0 + 1) + (2 + 3) */
SSM_INLINE real gdn_vsum(gdn_vec s) {
#if GDN_LANES == 16
    const gdn_vec_h h = GDN_LO(s) + GDN_HI(s);
    const gdn_vec_q f = GDN_LO_Q(h) + GDN_HI_Q(h);
#elif GDN_LANES == 8
    const gdn_vec_h f = GDN_LO(s) + GDN_HI(s);
#else
    const gdn_vec f = s;
#endif
    return (f[0] + f[1]) + (f[2] + f[3]);
}

/* One merge of gdn_vsum_rows: x and y each hold GDN_LANES / W groups of W lanes (a group: the partial
 * sums of one row); the result holds x's groups then y's, each of W / 2 lanes, lane e of a group the
 * sum of lanes e and e + W / 2 (ADJ 0: a halving) or 2e and 2e + 1 (ADJ 1: a pairwise add) of it.
 * GDN_MI is the index of the first (SEC 0) or second (SEC 1) addend of result lane POS. */
#define GDN_MI(POS, W, ADJ, SEC)                                                                       \
    (((POS) / ((W) / 2) < GDN_LANES / (W) ? ((POS) / ((W) / 2)) * (W)                                  \
                                          : GDN_LANES + ((POS) / ((W) / 2) - GDN_LANES / (W)) * (W)) +  \
     ((ADJ) ? 2 * ((POS) % ((W) / 2)) + (SEC) : (POS) % ((W) / 2) + (SEC) * ((W) / 2)))
#define GDN_MIDX4(W, ADJ, SEC) GDN_MI(0, W, ADJ, SEC), GDN_MI(1, W, ADJ, SEC), GDN_MI(2, W, ADJ, SEC), \
                               GDN_MI(3, W, ADJ, SEC)
#if GDN_LANES == 16
#define GDN_MIDX(W, ADJ, SEC)                                                                          \
    GDN_MIDX4(W, ADJ, SEC), GDN_MI(4, W, ADJ, SEC), GDN_MI(5, W, ADJ, SEC), GDN_MI(6, W, ADJ, SEC),     \
    GDN_MI(7, W, ADJ, SEC), GDN_MI(8, W, ADJ, SEC), GDN_MI(9, W, ADJ, SEC), GDN_MI(10, W, ADJ, SEC),    \
    GDN_MI(11, W, ADJ, SEC), GDN_MI(12, W, ADJ, SEC), GDN_MI(13, W, ADJ, SEC), GDN_MI(14, W, ADJ, SEC), \
    GDN_MI(15, W, ADJ, SEC)
#elif GDN_LANES == 8
#define GDN_MIDX(W, ADJ, SEC)                                                                          \
    GDN_MIDX4(W, ADJ, SEC), GDN_MI(4, W, ADJ, SEC), GDN_MI(5, W, ADJ, SEC), GDN_MI(6, W, ADJ, SEC),     \
    GDN_MI(7, W, ADJ, SEC)
#else
#define GDN_MIDX(W, ADJ, SEC) GDN_MIDX4(W, ADJ, SEC)
#endif
#define GDN_MERGE(x, y, W, ADJ) (GDN_SHUF(x, y, GDN_MIDX(W, ADJ, 0)) + GDN_SHUF(x, y, GDN_MIDX(W, ADJ, 1)))

/* Lane r of the result: gdn_vsum(s[r]), the same bits, for GDN_LANES rows at once (each addition of
 * gdn_vsum's tree is one lane of one merge). */
SSM_INLINE gdn_vec gdn_vsum_rows(const gdn_vec * s) {
#if GDN_LANES == 16
    gdn_vec u[8], x[4];
    for (int r = 0; r < 8; ++r) u[r] = GDN_MERGE(s[2 * r], s[2 * r + 1], 16, 0);
    for (int r = 0; r < 4; ++r) x[r] = GDN_MERGE(u[2 * r], u[2 * r + 1], 8, 0);
    const gdn_vec y0 = GDN_MERGE(x[0], x[1], 4, 1), y1 = GDN_MERGE(x[2], x[3], 4, 1);
    return GDN_MERGE(y0, y1, 2, 1);
#elif GDN_LANES == 8
    /* u[r] holds rows 2r, 2r + 1 (4 lanes each): pair them as above */
    gdn_vec u[4];
    for (int r = 0; r < 4; ++r) u[r] = GDN_MERGE(s[2 * r], s[2 * r + 1], 8, 0);
    const gdn_vec z0 = GDN_MERGE(u[0], u[1], 4, 1), z1 = GDN_MERGE(u[2], u[3], 4, 1);
    return GDN_MERGE(z0, z1, 2, 1);
#else
    /* 4 lanes: the pairs, then the pairs' sums */
    const gdn_vec z0 = GDN_MERGE(s[0], s[1], 4, 1), z1 = GDN_MERGE(s[2], s[3], 4, 1);
    return GDN_MERGE(z0, z1, 2, 1);
#endif
}

/* the running sums of x . y over NV vectors in gdn_dot's order (NV a multiple of GDN_NACC), added
 * into one vector: the first steps of gdn_dot's tree (the halvings while the REAL_DOT_LANES sums span
 * more than a vector; the rest: gdn_vsum, gdn_vsum_rows) */
SSM_INLINE gdn_vec gdn_vdot_acc(const gdn_vec * x, const gdn_vec * y, const int NV) {
    gdn_vec acc[GDN_NACC];
    for (int a = 0; a < GDN_NACC; ++a) acc[a] = x[a] * y[a] + (gdn_vec) {0};
    for (int b = GDN_NACC; b < NV; b += GDN_NACC)
        for (int a = 0; a < GDN_NACC; ++a) acc[a] = x[b + a] * y[b + a] + acc[a];
#if GDN_NACC == 4
    return (acc[0] + acc[2]) + (acc[1] + acc[3]);
#elif GDN_NACC == 2
    return acc[0] + acc[1];
#else
    return acc[0];
#endif
}

/* whether the vector forms run this call: gdn_fwd_unit_v (the backward's gdn_back_vec_ok adds its own
 * condition) */
static inline int gdn_fwd_vec_ok(const gdn_params * p) {
    return (ssm_vec64(p->simd) || ssm_vec32(p->simd)) && p->S > 0 && p->S % REAL_DOT_LANES == 0 &&
           p->S <= GDN_NV_MAX * GDN_LANES && (p->S / GDN_LANES & (p->S / GDN_LANES - 1)) == 0 && p->n_t > 0;
}
#endif

#endif /* GDN_VEC_H */
