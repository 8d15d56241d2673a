// train_mamba: a small Mamba-2 or Mamba-1 language model built from ggml ops and trained with
// ggml's own optimizer (ggml-opt, AdamW), on the model, batches and hyperparameters that
// ggml/train_check.py exports from examples/train.py.
//
//     train_mamba IN.bin [--threads N] [--forward-only] [--weights-out OUT.bin]
//
// prints one line per step: "loss <step> <value>" (the loss of the weights BEFORE that step's update,
// as torch's loop reports it). --forward-only evaluates step 0's loss without a backward graph (works
// on an unpatched ggml, where SSM_CONV / SSM_SCAN have no backward). --weights-out writes every
// parameter after the last step, in the input's tensor format, for a weight comparison.
//
// The model (examples/train.py, class Model): embedding -> h + block(h) -> layer norm -> head,
// cross-entropy on the last n_mem tokens. Every projection is LoRALinear: W x (+ b) + scale * B (A x).
//
//   Mamba-2 block: in_proj -> z, xBC, dt (row ranges of one weight)
//                  xBC -> ssm_conv (+ bias) -> SiLU -> x, B, C (views)
//                  ssm_scan(0, x, dt + dt_bias, A, B, C) -> y + D*x -> * SiLU(z) -> out_proj
//   Mamba-1 block: in_proj -> x, z;  x -> ssm_conv (+ bias) -> SiLU -> x_proj -> [dt_low | B | C]
//                  dt = dt_proj(dt_low) -> ssm_scan (head_dim 1, A per state) -> y + D*x -> * SiLU(z)
//                  -> out_proj
//
// ggml has no backward for concat, pad or norm, so the graph avoids them:
//   - the causal conv input [zero state | tokens^T] is ggml_acc of the transposed conv channels into
//     a zero tensor. The transposed channels come straight out of their own projection, mul_mat(u, W)
//     instead of mul_mat(W, u) (the same dot products), because ggml's transpose backward hands a
//     non-contiguous gradient to ops whose backward needs contiguous rows (acc, cont);
//   - so in_proj is several mul_mats over row ranges of its weight (views), one per part
//     ([z | xBC | dt], [x | z]), instead of views of one output;
//   - layer norm without affine (torch F.layer_norm) is rms_norm(h - mean(h)), the mean from
//     sum_rows, since the variance of h is the mean square of h - mean(h).
// Everything else (views, broadcast adds and muls, repeat, get_rows, silu, cross-entropy) has
// ggml's own backward; SSM_CONV and SSM_SCAN need the project's patch.
//
// Input file (little-endian), written by ggml/train_check.py:
//   "SSMTRAIN" | int32 n_cfg | n_cfg x (char name[32], double value)
//   int32 n_tensor | n_tensor x (char name[64], int32 trainable, int32 ndim, int64 shape[4] in NumPy
//                                order, float32 data)
//   int32 tokens[steps][batch][n_t] | int32 targets[steps][batch][n_mem]

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml-opt.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAX_CFG     64
#define MAX_TENSORS 64

static void die(const char * msg, const char * arg) {
    fprintf(stderr, "train_mamba: %s%s%s\n", msg, arg ? ": " : "", arg ? arg : "");
    exit(2);
}

// ---------------------------------------------------------------------------------------------
// Input file

struct cfg_entry { char name[32]; double value; };

struct host_tensor {
    char    name[64];
    int32_t trainable;
    int32_t ndim;
    int64_t shape[4];           // NumPy order
    int64_t n;
    float * data;
    struct ggml_tensor * t;     // its ggml tensor, once created
};

struct input {
    int n_cfg;
    struct cfg_entry cfg[MAX_CFG];
    int n_tensor;
    struct host_tensor tensors[MAX_TENSORS];
    int32_t * tokens;
    int32_t * targets;
};

static void read_exact(FILE * f, void * dst, size_t n, const char * what) {
    if (fread(dst, 1, n, f) != n) {
        die("input file truncated while reading", what);
    }
}

static double cfg(const struct input * in, const char * name) {
    for (int i = 0; i < in->n_cfg; i++) {
        if (strcmp(in->cfg[i].name, name) == 0) {
            return in->cfg[i].value;
        }
    }
    die("missing config value", name);
    return 0;
}

static int cfg_i(const struct input * in, const char * name) {
    return (int) cfg(in, name);
}

static void read_input(const char * path, struct input * in) {
    FILE * f = fopen(path, "rb");
    if (!f) {
        die("cannot open", path);
    }
    char magic[8];
    read_exact(f, magic, 8, "magic");
    if (memcmp(magic, "SSMTRAIN", 8) != 0) {
        die("not a train_check.py file", path);
    }
    read_exact(f, &in->n_cfg, 4, "n_cfg");
    if (in->n_cfg < 0 || in->n_cfg > MAX_CFG) {
        die("bad config count", path);
    }
    for (int i = 0; i < in->n_cfg; i++) {
        read_exact(f, in->cfg[i].name, 32, "config name");
        in->cfg[i].name[31] = 0;
        read_exact(f, &in->cfg[i].value, 8, "config value");
    }
    read_exact(f, &in->n_tensor, 4, "n_tensor");
    if (in->n_tensor < 0 || in->n_tensor > MAX_TENSORS) {
        die("bad tensor count", path);
    }
    for (int i = 0; i < in->n_tensor; i++) {
        struct host_tensor * h = &in->tensors[i];
        read_exact(f, h->name, 64, "tensor name");
        h->name[63] = 0;
        read_exact(f, &h->trainable, 4, "trainable");
        read_exact(f, &h->ndim, 4, "ndim");
        read_exact(f, h->shape, 32, "shape");
        if (h->ndim < 1 || h->ndim > 4) {
            die("bad ndim for", h->name);
        }
        h->n = 1;
        for (int d = 0; d < h->ndim; d++) {
            if (h->shape[d] < 1 || h->shape[d] > (1 << 24)) {
                die("bad shape for", h->name);
            }
            h->n *= h->shape[d];
        }
        h->data = malloc(h->n * sizeof(float));
        if (!h->data) {
            die("out of memory for", h->name);
        }
        read_exact(f, h->data, h->n * sizeof(float), h->name);
        h->t = NULL;
    }
    const int64_t steps = cfg_i(in, "steps"), batch = cfg_i(in, "batch");
    const int64_t n_t = cfg_i(in, "n_t"), n_mem = cfg_i(in, "n_mem");
    in->tokens  = malloc(steps * batch * n_t * sizeof(int32_t));
    in->targets = malloc(steps * batch * n_mem * sizeof(int32_t));
    if (!in->tokens || !in->targets) {
        die("out of memory for the batches", NULL);
    }
    read_exact(f, in->tokens, steps * batch * n_t * sizeof(int32_t), "tokens");
    read_exact(f, in->targets, steps * batch * n_mem * sizeof(int32_t), "targets");
    char extra;
    if (fread(&extra, 1, 1, f) != 0) {
        die("trailing bytes in", path);
    }
    fclose(f);
}

static struct host_tensor * find_tensor(struct input * in, const char * name) {
    for (int i = 0; i < in->n_tensor; i++) {
        if (strcmp(in->tensors[i].name, name) == 0) {
            return &in->tensors[i];
        }
    }
    return NULL;
}

// ---------------------------------------------------------------------------------------------
// Model graph

struct model {
    struct input * in;
    struct ggml_context * ctx_static;    // weights, constants and the token input
    struct ggml_context * ctx;           // the compute graph's tensors (allocated by ggml-opt)
    int kind;                            // 2 (Mamba-2) or 1 (Mamba-1)
    int64_t d_model, d_inner, d_state, head_dim, n_head, n_group, d_conv, dt_rank, vocab;
    int64_t n_t, n_mem, batch, N;        // N = n_t * batch tokens
    float lora_scale, eps_ln;
    // constants (no gradient)
    struct ggml_tensor * tokens;         // [n_t, batch] int32: ggml-opt's input
    struct ggml_tensor * state0;         // zero SSM state
    struct ggml_tensor * ids;            // 0..batch-1
    struct ggml_tensor * conv_zero;      // zero conv input [d_conv-1+n_t, conv_ch, batch]
    int64_t conv_ch;
};

// ggml tensor for a weight of the input file: ne is the NumPy shape reversed, the bytes are the same.
static struct ggml_tensor * W(struct model * m, const char * name) {
    struct host_tensor * h = find_tensor(m->in, name);
    if (!h) {
        die("missing tensor", name);
    }
    if (!h->t) {
        int64_t ne[4] = {1, 1, 1, 1};
        for (int d = 0; d < h->ndim; d++) {
            ne[d] = h->shape[h->ndim - 1 - d];
        }
        h->t = ggml_new_tensor(m->ctx_static, GGML_TYPE_F32, h->ndim, ne);
        ggml_set_name(h->t, name);
        if (h->trainable) {
            ggml_set_param(h->t);
        }
    }
    return h->t;
}

static int has(struct model * m, const char * name) {
    return find_tensor(m->in, name) != NULL;
}

// LoRALinear on x [d_in, N]: (W x + b) + scale * lora_b (lora_a x), as torch adds them.
static struct ggml_tensor * lora_linear(struct model * m, const char * prefix, struct ggml_tensor * x) {
    char name[64];
    struct ggml_context * ctx = m->ctx;
    snprintf(name, sizeof name, "%s.weight", prefix);
    struct ggml_tensor * y = ggml_mul_mat(ctx, W(m, name), x);
    snprintf(name, sizeof name, "%s.bias", prefix);
    if (has(m, name)) {
        y = ggml_add(ctx, y, W(m, name));
    }
    snprintf(name, sizeof name, "%s.lora_a", prefix);
    struct ggml_tensor * t = ggml_mul_mat(ctx, W(m, name), x);
    snprintf(name, sizeof name, "%s.lora_b", prefix);
    t = ggml_mul_mat(ctx, W(m, name), t);
    return ggml_add(ctx, y, ggml_scale(ctx, t, m->lora_scale));
}

// Rows [row0, row0 + n) of the bias-free LoRALinear `prefix` on u [d_in, N], with t = lora_a u:
// W[rows] u + scale * lora_b[rows] t  ->  [n, N]
static struct ggml_tensor * lora_rows(struct model * m, const char * prefix, struct ggml_tensor * u,
                                      struct ggml_tensor * t, int64_t row0, int64_t n) {
    char name[64];
    struct ggml_context * ctx = m->ctx;
    snprintf(name, sizeof name, "%s.bias", prefix);
    if (has(m, name)) {
        die("lora_rows: a projection with a bias", name);
    }
    snprintf(name, sizeof name, "%s.weight", prefix);
    struct ggml_tensor * w = W(m, name);
    snprintf(name, sizeof name, "%s.lora_b", prefix);
    struct ggml_tensor * lb = W(m, name);
    w  = ggml_view_2d(ctx, w, w->ne[0], n, w->nb[1], row0 * w->nb[1]);
    lb = ggml_view_2d(ctx, lb, lb->ne[0], n, lb->nb[1], row0 * lb->nb[1]);
    return ggml_add(ctx, ggml_mul_mat(ctx, w, u), ggml_scale(ctx, ggml_mul_mat(ctx, lb, t), m->lora_scale));
}

// The same rows, transposed per sequence: u3 [d_in, n_t, batch], t3 [rank, n_t, batch] -> [n_t, n, batch].
// mul_mat(u3, W') [s][o][t] = dot(u3[s][t], W'[s][o]): the dot products of lora_rows, laid out with
// time fastest, which is what ssm_conv's input needs. W' is the row range repeated per sequence
// (mul_mat broadcasts its first operand only).
static struct ggml_tensor * lora_rows_t(struct model * m, const char * prefix, struct ggml_tensor * u3,
                                        struct ggml_tensor * t3, int64_t row0, int64_t n) {
    char name[64];
    struct ggml_context * ctx = m->ctx;
    snprintf(name, sizeof name, "%s.weight", prefix);
    struct ggml_tensor * w = W(m, name);
    snprintf(name, sizeof name, "%s.lora_b", prefix);
    struct ggml_tensor * lb = W(m, name);
    w  = ggml_view_2d(ctx, w, w->ne[0], n, w->nb[1], row0 * w->nb[1]);
    lb = ggml_view_2d(ctx, lb, lb->ne[0], n, lb->nb[1], row0 * lb->nb[1]);
    w  = ggml_repeat_4d(ctx, w, w->ne[0], n, m->batch, 1);
    lb = ggml_repeat_4d(ctx, lb, lb->ne[0], n, m->batch, 1);
    return ggml_add(ctx, ggml_mul_mat(ctx, u3, w), ggml_scale(ctx, ggml_mul_mat(ctx, t3, lb), m->lora_scale));
}

// lora_a u of the projection `prefix`: [rank, N]
static struct ggml_tensor * lora_a(struct model * m, const char * prefix, struct ggml_tensor * u) {
    char name[64];
    snprintf(name, sizeof name, "%s.lora_a", prefix);
    return ggml_mul_mat(m->ctx, W(m, name), u);
}

// Causal conv input from the transposed channels xt [n_t, ch, batch] (contiguous): the zero conv
// state prepended along time, sx [d_conv-1+n_t, ch, batch].
static struct ggml_tensor * conv_input(struct model * m, struct ggml_tensor * xt) {
    GGML_ASSERT(xt->ne[0] == m->n_t && xt->ne[1] == m->conv_ch && ggml_is_contiguous(xt));
    struct ggml_tensor * z = m->conv_zero;
    return ggml_acc(m->ctx, z, xt, z->nb[1], z->nb[2], z->nb[3], (m->d_conv - 1) * sizeof(float));
}

// the depthwise causal conv, its bias and SiLU: xt [n_t, ch, batch] -> [ch, n_t, batch]
static struct ggml_tensor * conv_silu(struct model * m, struct ggml_tensor * xt) {
    struct ggml_context * ctx = m->ctx;
    struct ggml_tensor * y = ggml_ssm_conv(ctx, conv_input(m, xt), W(m, "block.conv_weight"));
    y = ggml_add(ctx, y, W(m, "block.conv_bias"));
    return ggml_silu(ctx, y);
}

// A as the scan takes it: the exported constant -exp(A_log) on the LoRA path, computed in the
// graph (so that A_log trains) when A_log is a parameter.
static struct ggml_tensor * scan_A(struct model * m) {
    if (has(m, "block.A")) {
        return W(m, "block.A");
    }
    return ggml_neg(m->ctx, ggml_exp(m->ctx, W(m, "block.A_log")));
}

static struct ggml_tensor * mamba2_block(struct model * m, struct ggml_tensor * u) {
    struct ggml_context * ctx = m->ctx;
    const int64_t di = m->d_inner, G = m->n_group * m->d_state, ch = m->conv_ch, nh = m->n_head;
    const int64_t nt = m->n_t, nb = m->batch, N = m->N;
    // in_proj rows: [z (di) | xBC (ch) | dt (nh)]
    struct ggml_tensor * t  = lora_a(m, "block.in_proj", u);            // [rank, N]
    struct ggml_tensor * z  = lora_rows(m, "block.in_proj", u, t, 0, di);
    struct ggml_tensor * dt = lora_rows(m, "block.in_proj", u, t, di + ch, nh);
    struct ggml_tensor * xbc_t = lora_rows_t(m, "block.in_proj", ggml_reshape_3d(ctx, u, u->ne[0], nt, nb),
                                             ggml_reshape_3d(ctx, t, t->ne[0], nt, nb), di, ch);

    struct ggml_tensor * xbc = conv_silu(m, xbc_t);                     // [ch, nt, nb], contiguous
    const size_t r = xbc->nb[1];
    struct ggml_tensor * x = ggml_view_4d(ctx, xbc, m->head_dim, nh, nt, nb,
                                          m->head_dim * sizeof(float), r, r * nt, 0);
    struct ggml_tensor * B = ggml_view_4d(ctx, xbc, m->d_state, m->n_group, nt, nb,
                                          m->d_state * sizeof(float), r, r * nt, di * sizeof(float));
    struct ggml_tensor * C = ggml_view_4d(ctx, xbc, m->d_state, m->n_group, nt, nb,
                                          m->d_state * sizeof(float), r, r * nt, (di + G) * sizeof(float));
    dt = ggml_add(ctx, ggml_reshape_3d(ctx, dt, nh, nt, nb), W(m, "block.dt_bias"));   // [nh, nt, nb]

    struct ggml_tensor * out = ggml_ssm_scan(ctx, m->state0, x, dt, scan_A(m), B, C, m->ids, 1);
    struct ggml_tensor * y = ggml_view_4d(ctx, out, m->head_dim, nh, nt, nb,
                                          m->head_dim * sizeof(float), m->head_dim * nh * sizeof(float),
                                          m->head_dim * nh * nt * sizeof(float), 0);
    y = ggml_add(ctx, y, ggml_mul(ctx, x, W(m, "block.D")));             // D [nh, 1] broadcast over head_dim
    y = ggml_reshape_2d(ctx, y, di, N);
    y = ggml_mul(ctx, y, ggml_silu(ctx, z));
    return lora_linear(m, "block.out_proj", y);
}

static struct ggml_tensor * mamba1_block(struct model * m, struct ggml_tensor * u) {
    struct ggml_context * ctx = m->ctx;
    const int64_t di = m->d_inner, ds = m->d_state, nt = m->n_t, nb = m->batch, N = m->N;
    const int64_t r = m->dt_rank;
    // in_proj rows: [x (di) | z (di)]
    struct ggml_tensor * t = lora_a(m, "block.in_proj", u);              // [rank, N]
    struct ggml_tensor * z = lora_rows(m, "block.in_proj", u, t, di, di);
    struct ggml_tensor * x_t = lora_rows_t(m, "block.in_proj", ggml_reshape_3d(ctx, u, u->ne[0], nt, nb),
                                           ggml_reshape_3d(ctx, t, t->ne[0], nt, nb), 0, di);

    struct ggml_tensor * x = conv_silu(m, x_t);                          // [di, nt, nb], contiguous
    struct ggml_tensor * x2 = ggml_reshape_2d(ctx, x, di, N);
    struct ggml_tensor * xdb = lora_linear(m, "block.x_proj", x2);       // [r + 2 ds, N]
    const size_t rr = xdb->nb[1];
    struct ggml_tensor * dt_low = ggml_cont(ctx, ggml_view_2d(ctx, xdb, r, N, rr, 0));
    struct ggml_tensor * dt = lora_linear(m, "block.dt_proj", dt_low);   // [di, N]
    dt = ggml_reshape_3d(ctx, dt, di, nt, nb);
    struct ggml_tensor * B = ggml_view_4d(ctx, xdb, ds, 1, nt, nb, ds * sizeof(float), rr, rr * nt,
                                          r * sizeof(float));
    struct ggml_tensor * C = ggml_view_4d(ctx, xdb, ds, 1, nt, nb, ds * sizeof(float), rr, rr * nt,
                                          (r + ds) * sizeof(float));
    struct ggml_tensor * xs = ggml_reshape_4d(ctx, x, 1, di, nt, nb);   // head_dim 1, n_head = d_inner

    struct ggml_tensor * out = ggml_ssm_scan(ctx, m->state0, xs, dt, scan_A(m), B, C, m->ids, 1);
    struct ggml_tensor * y = ggml_view_2d(ctx, out, di, N, di * sizeof(float), 0);
    y = ggml_add(ctx, y, ggml_mul(ctx, x2, W(m, "block.D")));            // D [di] broadcast over tokens
    y = ggml_mul(ctx, y, ggml_silu(ctx, z));
    return lora_linear(m, "block.out_proj", y);
}

// logits of the last n_mem tokens of each sequence: [vocab, n_mem * batch], row b * n_mem + j
static struct ggml_tensor * build_model(struct model * m) {
    struct ggml_context * ctx = m->ctx;
    struct ggml_tensor * tok = ggml_reshape_1d(ctx, m->tokens, m->N);
    struct ggml_tensor * h = ggml_get_rows(ctx, W(m, "emb.weight"), tok);   // [d_model, N]
    struct ggml_tensor * b = m->kind == 2 ? mamba2_block(m, h) : mamba1_block(m, h);
    h = ggml_add(ctx, h, b);
    // layer norm without affine: rms_norm of the centred rows
    struct ggml_tensor * mean = ggml_scale(ctx, ggml_sum_rows(ctx, h), 1.0f / (float) m->d_model);
    h = ggml_sub(ctx, h, ggml_repeat(ctx, mean, h));
    h = ggml_rms_norm(ctx, h, m->eps_ln);
    struct ggml_tensor * logits = ggml_add(ctx, ggml_mul_mat(ctx, W(m, "head.weight"), h), W(m, "head.bias"));
    struct ggml_tensor * last = ggml_view_3d(ctx, logits, m->vocab, m->n_mem, m->batch, logits->nb[1],
                                             logits->nb[1] * m->n_t, (m->n_t - m->n_mem) * logits->nb[1]);
    return ggml_reshape_2d(ctx, ggml_cont(ctx, last), m->vocab, m->n_mem * m->batch);
}

// ---------------------------------------------------------------------------------------------

static struct ggml_opt_optimizer_params opt_pars;

static struct ggml_opt_optimizer_params get_opt_pars(void * ud) {
    (void) ud;
    return opt_pars;
}

static double now(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

static void write_weights(struct input * in, const char * path) {
    FILE * f = fopen(path, "wb");
    if (!f) {
        die("cannot write", path);
    }
    int32_t n = 0;
    for (int i = 0; i < in->n_tensor; i++) {
        n += in->tensors[i].t != NULL;
    }
    fwrite(&n, 4, 1, f);
    for (int i = 0; i < in->n_tensor; i++) {
        struct host_tensor * h = &in->tensors[i];
        if (!h->t) {
            continue;
        }
        ggml_backend_tensor_get(h->t, h->data, 0, h->n * sizeof(float));
        fwrite(h->name, 64, 1, f);
        fwrite(&h->trainable, 4, 1, f);
        fwrite(&h->ndim, 4, 1, f);
        fwrite(h->shape, 8, 4, f);
        fwrite(h->data, sizeof(float), h->n, f);
    }
    if (fclose(f) != 0) {
        die("error writing", path);
    }
}

int main(int argc, char ** argv) {
    const char * path = NULL, * weights_out = NULL;
    int threads = 1, forward_only = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--threads") == 0 && i + 1 < argc) {
            threads = atoi(argv[++i]);
        } else if (strcmp(argv[i], "--forward-only") == 0) {
            forward_only = 1;
        } else if (strcmp(argv[i], "--weights-out") == 0 && i + 1 < argc) {
            weights_out = argv[++i];
        } else if (argv[i][0] != '-' && !path) {
            path = argv[i];
        } else {
            die("usage: train_mamba IN.bin [--threads N] [--forward-only] [--weights-out OUT.bin]", argv[i]);
        }
    }
    if (!path || threads < 1) {
        die("usage: train_mamba IN.bin [--threads N] [--forward-only] [--weights-out OUT.bin]", NULL);
    }

    static struct input in;
    read_input(path, &in);

    struct model m = {0};
    m.in = &in;
    m.kind     = cfg_i(&in, "kind");
    m.d_model  = cfg_i(&in, "d_model");
    m.d_inner  = cfg_i(&in, "d_inner");
    m.d_state  = cfg_i(&in, "d_state");
    m.head_dim = cfg_i(&in, "head_dim");
    m.n_head   = cfg_i(&in, "n_head");
    m.n_group  = cfg_i(&in, "n_group");
    m.d_conv   = cfg_i(&in, "d_conv");
    m.dt_rank  = cfg_i(&in, "dt_rank");
    m.vocab    = cfg_i(&in, "vocab");
    m.n_t      = cfg_i(&in, "n_t");
    m.n_mem    = cfg_i(&in, "n_mem");
    m.batch    = cfg_i(&in, "batch");
    m.N        = m.n_t * m.batch;
    m.lora_scale = (float) cfg(&in, "lora_scale");
    m.eps_ln     = (float) cfg(&in, "eps_ln");
    m.conv_ch  = m.kind == 2 ? m.d_inner + 2 * m.n_group * m.d_state : m.d_inner;
    const int steps = forward_only ? 1 : cfg_i(&in, "steps");
    if (m.kind != 1 && m.kind != 2) {
        die("kind must be 1 or 2", NULL);
    }

    opt_pars = ggml_opt_get_default_optimizer_params(NULL);
    opt_pars.adamw.alpha = (float) cfg(&in, "lr");
    opt_pars.adamw.beta1 = (float) cfg(&in, "beta1");
    opt_pars.adamw.beta2 = (float) cfg(&in, "beta2");
    opt_pars.adamw.eps   = (float) cfg(&in, "eps");
    opt_pars.adamw.wd    = (float) cfg(&in, "weight_decay");

    ggml_backend_t backend = ggml_backend_cpu_init();
    ggml_backend_cpu_set_n_threads(backend, threads);

    {
        struct ggml_init_params ip = { (MAX_TENSORS + 16) * ggml_tensor_overhead(), NULL, true };
        m.ctx_static = ggml_init(ip);
    }
    {
        struct ggml_init_params ip = { 4096 * ggml_tensor_overhead() + 3 * ggml_graph_overhead_custom(GGML_DEFAULT_GRAPH_SIZE, true),
                                       NULL, true };
        m.ctx = ggml_init(ip);
    }
    struct ggml_context * cs = m.ctx_static;
    m.tokens = ggml_new_tensor_2d(cs, GGML_TYPE_I32, m.n_t, m.batch);
    ggml_set_name(m.tokens, "tokens");
    if (m.kind == 2) {
        m.state0 = ggml_new_tensor_4d(cs, GGML_TYPE_F32, m.d_state, m.head_dim, m.n_head, m.batch);
    } else {
        m.state0 = ggml_new_tensor_4d(cs, GGML_TYPE_F32, m.d_state, 1, m.d_inner, m.batch);
    }
    m.ids       = ggml_new_tensor_1d(cs, GGML_TYPE_I32, m.batch);
    m.conv_zero = ggml_new_tensor_3d(cs, GGML_TYPE_F32, m.d_conv - 1 + m.n_t, m.conv_ch, m.batch);

    struct ggml_tensor * logits = build_model(&m);
    for (int i = 0; i < in.n_tensor; i++) {
        if (!in.tensors[i].t) {
            die("tensor in the input file not used by the graph", in.tensors[i].name);
        }
    }

    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(cs, backend);
    if (!buf) {
        die("cannot allocate the weights", NULL);
    }
    {
        ggml_backend_buffer_clear(buf, 0);   // zero state, zero conv input
        for (int i = 0; i < in.n_tensor; i++) {
            ggml_backend_tensor_set(in.tensors[i].t, in.tensors[i].data, 0, in.tensors[i].n * sizeof(float));
        }
        int32_t * ids = malloc(m.batch * sizeof(int32_t));
        for (int i = 0; i < m.batch; i++) {
            ids[i] = i;
        }
        ggml_backend_tensor_set(m.ids, ids, 0, m.batch * sizeof(int32_t));
        free(ids);
    }

    ggml_backend_sched_t sched = ggml_backend_sched_new(&backend, NULL, 1, GGML_DEFAULT_GRAPH_SIZE, false, false);
    struct ggml_opt_params op = ggml_opt_default_params(sched, GGML_OPT_LOSS_TYPE_CROSS_ENTROPY);
    op.ctx_compute  = m.ctx;
    op.inputs       = m.tokens;
    op.outputs      = logits;
    op.build_type   = forward_only ? GGML_OPT_BUILD_TYPE_FORWARD : GGML_OPT_BUILD_TYPE_OPT;
    op.opt_period   = 1;
    op.get_opt_pars = get_opt_pars;
    op.optimizer    = GGML_OPT_OPTIMIZER_TYPE_ADAMW;
    ggml_opt_context_t opt = ggml_opt_init(op);

    const int64_t n_rows = m.n_mem * m.batch;
    float * onehot = malloc(m.vocab * n_rows * sizeof(float));
    const double t0 = now(CLOCK_MONOTONIC), c0 = now(CLOCK_PROCESS_CPUTIME_ID);
    for (int step = 0; step < steps; step++) {
        ggml_opt_alloc(opt, !forward_only);
        ggml_backend_tensor_set(m.tokens, in.tokens + (int64_t) step * m.batch * m.n_t, 0, ggml_nbytes(m.tokens));
        memset(onehot, 0, m.vocab * n_rows * sizeof(float));
        const int32_t * tg = in.targets + (int64_t) step * n_rows;
        for (int64_t r = 0; r < n_rows; r++) {
            if (tg[r] < 0 || tg[r] >= m.vocab) {
                die("target out of range", NULL);
            }
            onehot[r * m.vocab + tg[r]] = 1.0f;
        }
        ggml_backend_tensor_set(ggml_opt_labels(opt), onehot, 0, m.vocab * n_rows * sizeof(float));
        ggml_opt_eval(opt, NULL);
        float loss;
        ggml_backend_tensor_get(ggml_opt_loss(opt), &loss, 0, sizeof loss);
        printf("loss %d %.9g\n", step, loss);
        fflush(stdout);
    }
    const double secs = now(CLOCK_MONOTONIC) - t0, cpu = now(CLOCK_PROCESS_CPUTIME_ID) - c0;
    fprintf(stderr, "train_mamba: Mamba-%d, %d step(s), %d thread(s): %.3f s, CPU %.3f s (forward + backward + AdamW)\n",
            m.kind, steps, threads, secs, cpu);
    printf("seconds %.6f\n", secs);
    printf("cpu_seconds %.6f\n", cpu);

    if (weights_out) {
        write_weights(&in, weights_out);
    }

    free(onehot);
    ggml_opt_free(opt);
    ggml_backend_sched_free(sched);
    ggml_backend_buffer_free(buf);
    ggml_free(m.ctx);
    ggml_free(m.ctx_static);
    ggml_backend_free(backend);
    for (int i = 0; i < in.n_tensor; i++) {
        free(in.tensors[i].data);
    }
    free(in.tokens);
    free(in.targets);
    return 0;
}
