// check_common.h -- what the check programs of ggml/ (ssm_back_check.c, gdn_check.c) share: a
// fixed-seed generator and tensor fill, a dense copy of a strided tensor, the dump of a case's
// tensors for the Python tests, and a graph computed with 1 to 4 threads, compared bytewise.
//
// Each program is one file that includes this header after ggml.h and ggml-cpu.h, with
// CHECK_RNG_SEED defined first (each program keeps its own inputs).
//
// The dump: with a directory argument, dump() writes <dir>/<case>.<name>.bin (raw float32 or int32,
// dense, in ggml order = the C order of the NumPy shape ne reversed) and a manifest line
// "case name type ne0 ne1 ne2 ne3"; dump_param() a line "case name param value 0 0 0".

#ifndef CHECK_COMMON_H
#define CHECK_COMMON_H

#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef CHECK_RNG_SEED
#error "define CHECK_RNG_SEED before including check_common.h"
#endif

static uint64_t rng_state = CHECK_RNG_SEED;

// uniform in [lo, hi)
static float rng_uniform(float lo, float hi) {
    rng_state = rng_state*6364136223846793005ull + 1442695040888963407ull;
    const uint32_t r = (uint32_t) (rng_state >> 40); // 24 bits
    return lo + (hi - lo)*((float) r/16777216.0f);
}

static void fill(struct ggml_tensor * t, float lo, float hi) {
    GGML_ASSERT(ggml_is_contiguous(t) && t->type == GGML_TYPE_F32);
    float * d = (float *) t->data;
    for (int64_t i = 0; i < ggml_nelements(t); ++i) {
        d[i] = rng_uniform(lo, hi);
    }
}

// element (i0, i1, i2, i3) of an f32 tensor with any strides
static float * at(const struct ggml_tensor * t, int64_t i0, int64_t i1, int64_t i2, int64_t i3) {
    return (float *) ((char *) t->data + i0*t->nb[0] + i1*t->nb[1] + i2*t->nb[2] + i3*t->nb[3]);
}

// dense copy of a (possibly strided) f32 tensor
static float * gather(const struct ggml_tensor * t) {
    float * out = (float *) malloc(ggml_nelements(t)*sizeof(float));
    GGML_ASSERT(out);
    int64_t k = 0;
    for (int64_t i3 = 0; i3 < t->ne[3]; ++i3)
    for (int64_t i2 = 0; i2 < t->ne[2]; ++i2)
    for (int64_t i1 = 0; i1 < t->ne[1]; ++i1)
    for (int64_t i0 = 0; i0 < t->ne[0]; ++i0) {
        out[k++] = *at(t, i0, i1, i2, i3);
    }
    return out;
}

// ---------------------------------------------------------------- the dump

static const char * dump_dir = NULL;
static FILE * manifest = NULL;

// t's elements (f32: any strides; i32: contiguous) into f; 0 when all were written
static int write_elements(FILE * f, const struct ggml_tensor * t) {
    size_t n;
    if (t->type == GGML_TYPE_F32) {
        float * d = gather(t);
        n = fwrite(d, sizeof(float), ggml_nelements(t), f);
        free(d);
    } else {
        GGML_ASSERT(t->type == GGML_TYPE_I32 && ggml_is_contiguous(t));
        n = fwrite(t->data, sizeof(int32_t), ggml_nelements(t), f);
    }
    return n != (size_t) ggml_nelements(t);
}

// nothing without a dump directory; 1 on an IO error
static int dump(const char * cname, const char * name, const struct ggml_tensor * t) {
    if (!dump_dir) {
        return 0;
    }
    char path[4096];
    snprintf(path, sizeof(path), "%s/%s.%s.bin", dump_dir, cname, name);
    FILE * f = fopen(path, "wb");
    if (!f) {
        fprintf(stderr, "cannot write %s\n", path);
        return 1;
    }
    const int short_write = write_elements(f, t);
    fclose(f);
    if (short_write) {
        fprintf(stderr, "short write %s\n", path);
        return 1;
    }
    fprintf(manifest, "%s %s %s %" PRId64 " %" PRId64 " %" PRId64 " %" PRId64 "\n", cname, name,
            ggml_type_name(t->type), t->ne[0], t->ne[1], t->ne[2], t->ne[3]);
    return 0;
}

static void dump_param(const char * cname, const char * name, int64_t value) {
    if (manifest) {
        fprintf(manifest, "%s %s param %" PRId64 " 0 0 0\n", cname, name, value);
    }
}

// the command line: "prog [DUMP_DIR]"; opens the manifest when a directory is given. 0, or 2 after
// a message (usage, IO error)
static int dump_open(int argc, char ** argv) {
    if (argc > 2) {
        fprintf(stderr, "usage: %s [DUMP_DIR]\n", argv[0]);
        return 2;
    }
    if (argc == 2) {
        dump_dir = argv[1];
        char path[4096];
        snprintf(path, sizeof(path), "%s/manifest.txt", dump_dir);
        manifest = fopen(path, "w");
        if (!manifest) {
            fprintf(stderr, "cannot write %s\n", path);
            return 2;
        }
    }
    return 0;
}

// the last line (OK or FAIL) and the exit code: 0 all held, 1 a mismatch, 2 an IO error (rc: the cases' results or'ed)
static int check_finish(int rc) {
    if (manifest) {
        fclose(manifest);
    }
    printf("%s\n", rc == 0 ? "OK" : "FAIL");
    return rc == 0 ? 0 : (rc & 2 ? 2 : 1);
}

// ---------------------------------------------------------------- computing with n threads

// computes out with n_threads threads; returns a malloc'd copy of its bytes
static void * compute(struct ggml_cgraph * gf, const struct ggml_tensor * out, int n_threads) {
    struct ggml_cplan plan = ggml_graph_plan(gf, n_threads, NULL);
    uint8_t * work = NULL;
    if (plan.work_size > 0) {
        work = (uint8_t *) malloc(plan.work_size);
        GGML_ASSERT(work);
        memset(work, 0xA5, plan.work_size);        // garbage in the work buffer must not matter
        plan.work_data = work;
    }
    memset(out->data, 0x5A, ggml_nbytes(out));     // every byte of the result must be written
    GGML_ASSERT(ggml_graph_compute(gf, &plan) == GGML_STATUS_SUCCESS);
    free(work);
    void * copy = malloc(ggml_nbytes(out));
    GGML_ASSERT(copy);
    memcpy(copy, out->data, ggml_nbytes(out));
    return copy;
}

// out (f32) computed with 1 thread: its bytes are returned (malloc'd); then with 2, 3 and 4 threads,
// each compared with them bytewise: a line "<label>: n_threads N differs from 1 at element i (got vs
// want)" and *bad = 1 for each that differs
static void * compute_1_to_4_threads(struct ggml_context * ctx, struct ggml_tensor * out, const char * label,
                                     int * bad) {
    struct ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, out);
    void * ref = compute(gf, out, 1);
    for (int nth = 2; nth <= 4; ++nth) {
        void * got = compute(gf, out, nth);
        if (memcmp(ref, got, ggml_nbytes(out)) != 0) {
            const float * a = (const float *) ref;
            const float * b = (const float *) got;
            int64_t i = 0;
            while (memcmp(&a[i], &b[i], sizeof(float)) == 0) {
                ++i;
            }
            printf("%s: n_threads %d differs from 1 at element %" PRId64 " (%.9g vs %.9g)\n",
                   label, nth, i, (double) b[i], (double) a[i]);
            *bad = 1;
        }
        free(got);
    }
    return ref;
}

#endif // CHECK_COMMON_H
