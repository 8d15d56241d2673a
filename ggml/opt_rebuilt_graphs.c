// ggml-opt driven the way llama_opt_epoch drives it: no static graphs, the forward graph is rebuilt in a
// fresh context before every ggml_opt_alloc (ggml_opt_prepare_alloc), the model's weights live in a
// buffer of their own. The model is tiny and linear, out = W x + b, with ggml-opt's mean-squared-error
// loss, so tests/ggml/test_ggml_opt.py can compute the same steps in NumPy.
//
//   opt-rebuilt-graphs IN OUT
//
// IN (little-endian): int32 n_in, n_out, n_batch, n_evals, opt_period, optimizer (0 AdamW, 1 SGD);
// float32 lr, beta1, beta2, eps, wd; W0 (n_out rows of n_in), b0 (n_out), then per eval x (n_batch rows
// of n_in) and y (n_batch rows of n_out).
// OUT: float32 the loss of every eval (ggml_opt_loss: scaled by 1/opt_period), then W and b after the
// last eval.
#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml-opt.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

static struct ggml_opt_optimizer_params opt_pars;

static struct ggml_opt_optimizer_params get_opt_pars(void * ud) {
    (void) ud;
    return opt_pars;
}

static void read_or_die(void * dst, size_t size, size_t n, FILE * f) {
    if (fread(dst, size, n, f) != n) {
        fprintf(stderr, "opt-rebuilt-graphs: short input\n");
        exit(1);
    }
}

int main(int argc, char ** argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s IN OUT\n", argv[0]);
        return 2;
    }
    FILE * fin = fopen(argv[1], "rb");
    if (!fin) {
        perror(argv[1]);
        return 1;
    }
    int32_t hdr[6];
    float hp[5];
    read_or_die(hdr, sizeof(int32_t), 6, fin);
    read_or_die(hp, sizeof(float), 5, fin);
    const int64_t n_in = hdr[0], n_out = hdr[1], n_batch = hdr[2];
    const int n_evals = hdr[3], period = hdr[4], sgd = hdr[5];

    opt_pars = ggml_opt_get_default_optimizer_params(NULL);
    opt_pars.adamw.alpha = hp[0];
    opt_pars.adamw.beta1 = hp[1];
    opt_pars.adamw.beta2 = hp[2];
    opt_pars.adamw.eps   = hp[3];
    opt_pars.adamw.wd    = hp[4];
    opt_pars.sgd.alpha   = hp[0];
    opt_pars.sgd.wd      = hp[4];

    ggml_backend_t backend = ggml_backend_cpu_init();
    ggml_backend_cpu_set_n_threads(backend, 1);

    // the weights: a context and a buffer that outlive every graph
    struct ggml_init_params ip = { 4 * ggml_tensor_overhead(), NULL, true };
    struct ggml_context * ctx_w = ggml_init(ip);
    struct ggml_tensor * W = ggml_new_tensor_2d(ctx_w, GGML_TYPE_F32, n_in, n_out);
    struct ggml_tensor * b = ggml_new_tensor_1d(ctx_w, GGML_TYPE_F32, n_out);
    ggml_set_name(W, "W");
    ggml_set_name(b, "b");
    ggml_set_param(W);
    ggml_set_param(b);
    ggml_backend_buffer_t buf_w = ggml_backend_alloc_ctx_tensors(ctx_w, backend);

    float * w0 = malloc(sizeof(float) * n_in * n_out);
    float * b0 = malloc(sizeof(float) * n_out);
    float * x  = malloc(sizeof(float) * n_in * n_batch);
    float * y  = malloc(sizeof(float) * n_out * n_batch);
    float * losses = malloc(sizeof(float) * n_evals);
    read_or_die(w0, sizeof(float), n_in * n_out, fin);
    read_or_die(b0, sizeof(float), n_out, fin);
    ggml_backend_tensor_set(W, w0, 0, ggml_nbytes(W));
    ggml_backend_tensor_set(b, b0, 0, ggml_nbytes(b));

    ggml_backend_sched_t sched = ggml_backend_sched_new(&backend, NULL, 1, GGML_DEFAULT_GRAPH_SIZE, false, false);
    struct ggml_opt_params op = ggml_opt_default_params(sched, GGML_OPT_LOSS_TYPE_MEAN_SQUARED_ERROR);
    op.opt_period   = period;
    op.get_opt_pars = get_opt_pars;
    op.optimizer    = sgd ? GGML_OPT_OPTIMIZER_TYPE_SGD : GGML_OPT_OPTIMIZER_TYPE_ADAMW;
    ggml_opt_context_t opt = ggml_opt_init(op);   // no ctx_compute: the graphs are not static

    for (int e = 0; e < n_evals; ++e) {
        read_or_die(x, sizeof(float), n_in * n_batch, fin);
        read_or_die(y, sizeof(float), n_out * n_batch, fin);

        // a new graph in a new context, as llama_context::opt_epoch_iter builds one per ubatch
        const size_t size = 4 * GGML_DEFAULT_GRAPH_SIZE * ggml_tensor_overhead()
                          + 2 * ggml_graph_overhead_custom(GGML_DEFAULT_GRAPH_SIZE, true);
        struct ggml_init_params cp = { size, NULL, true };
        struct ggml_context * ctx = ggml_init(cp);
        struct ggml_tensor * in  = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n_in, n_batch);
        struct ggml_tensor * out = ggml_add(ctx, ggml_mul_mat(ctx, W, in), b);
        struct ggml_cgraph * gf = ggml_new_graph_custom(ctx, GGML_DEFAULT_GRAPH_SIZE, true);
        ggml_build_forward_expand(gf, out);

        ggml_opt_prepare_alloc(opt, ctx, gf, in, out);
        ggml_opt_alloc(opt, /*backward =*/ true);
        ggml_backend_tensor_set(in, x, 0, ggml_nbytes(in));
        ggml_backend_tensor_set(ggml_opt_labels(opt), y, 0, ggml_nbytes(out));
        ggml_opt_eval(opt, NULL);
        ggml_backend_tensor_get(ggml_opt_loss(opt), &losses[e], 0, sizeof(float));
        ggml_free(ctx);
    }
    fclose(fin);

    ggml_backend_tensor_get(W, w0, 0, ggml_nbytes(W));
    ggml_backend_tensor_get(b, b0, 0, ggml_nbytes(b));
    FILE * fout = fopen(argv[2], "wb");
    if (!fout) {
        perror(argv[2]);
        return 1;
    }
    fwrite(losses, sizeof(float), n_evals, fout);
    fwrite(w0, sizeof(float), n_in * n_out, fout);
    fwrite(b0, sizeof(float), n_out, fout);
    fclose(fout);

    ggml_opt_free(opt);
    ggml_backend_sched_free(sched);
    ggml_backend_buffer_free(buf_w);
    ggml_free(ctx_w);
    ggml_backend_free(backend);
    free(w0); free(b0); free(x); free(y); free(losses);
    return 0;
}
