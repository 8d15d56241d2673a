#pragma once

// CPU kernel of GGML_OP_GATED_DELTA_NET_BACK: ssmgrad's C kernel (ssmgrad.h, gdn_back_f32), called
// with ggml's tensors, (ith, nth) and work buffer.

#include "ggml.h"

#include <stdbool.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

struct ggml_compute_params;

void ggml_compute_forward_gated_delta_net_back(const struct ggml_compute_params * params, struct ggml_tensor * dst);

// bytes of the graph plan's work buffer that GATED_DELTA_NET_BACK needs with n_threads threads
size_t ggml_gated_delta_net_back_work_size(const struct ggml_tensor * node, int n_threads);

// F32 only
bool ggml_cpu_gated_delta_net_back_supports_op(const struct ggml_tensor * op);

#ifdef __cplusplus
}
#endif
