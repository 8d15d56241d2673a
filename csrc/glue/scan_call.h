/*
 * scan_call.h -- one call of a scan binding (scan.c): its arguments, parsed and validated by
 * scan_call_parse (scan_call.c), and the kernels' context. Include after ssm_glue.h.
 */
#ifndef SSM_GLUE_SCAN_CALL_H
#define SSM_GLUE_SCAN_CALL_H

#include "ssm_glue.h"

/* what the kernels of one call read and write */
typedef struct {
    ssm_scan_params p;
    int f64;
    const void * s, * x, * dt, * A, * B, * C, * grad;
    const int64_t * ids;
    void * out, * d_A, * work;
    void * kept;                     /* the chunk states (ssm_scan_keep_*), or NULL */
} scan_ctx;

typedef struct {
    long long K;
    int return_dA, nthreads;
    PyObject * grad;                 /* borrowed, for the entry points that take one */
    PyObject * states;               /* borrowed: chunk_states (SCAN_ARG_STATES), or None */
    PyArrayObject * arr[6], * ids;   /* new references: s x dt A B C, and ids as int64 (NULL: the identity) */
    int typenum;
    scan_ctx k;
} scan_call;

/* the arguments after (s, x, dt, A, B, C, ids) an entry point takes, in this order */
enum { SCAN_ARG_GRAD = 1, SCAN_ARG_K = 2, SCAN_ARG_RETURN_DA = 4, SCAN_ARG_THREADS = 8,
       SCAN_ARG_IDS_NONE = 16 /* ids may be None: the identity, ids[q] = q (n_rs == n_seqs, checked) */,
       SCAN_ARG_STATES = 32   /* after nthreads: the forward's chunk states, or None (checked by the entry point) */ };

/* The one parser of the scan entry points' positional arguments: s, x, dt, A, B, C, ids, then
 * those of grad, K, return_dA, nthreads, chunk_states that `takes` names (K is 1 where it is not taken),
 * each validated but chunk_states. On error: -1 with the exception set and nothing held. */
SSM_GLUE int scan_call_parse(const char * fn, PyObject * args, int takes, scan_call * c);
SSM_GLUE void scan_call_release(scan_call * c);
/* elements of ssm_scan's packed output: N_y + K * N_s, or -1 with MemoryError */
SSM_GLUE npy_intp scan_out_size(const ssm_scan_params * p);
/* the shape of the chunk states a forward with these params keeps (ssm_scan_chunk_states): 5 dims, or
   1 dim of 0 where it keeps none; returns the number of dims */
SSM_GLUE int scan_states_dims(const ssm_scan_params * p, npy_intp * dims);
/* state updates of one scan */
SSM_GLUE double scan_work(const ssm_scan_params * p);

#endif /* SSM_GLUE_SCAN_CALL_H */
