#pragma once

// CPU kernels of GGML_OP_SSM_CONV_BACK and GGML_OP_SSM_SCAN_BACK: ssmgrad's C kernels
// (ssmgrad.h), called with ggml's tensors, (ith, nth) and work buffer.

#include "ggml.h"

#include <stdbool.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

struct ggml_compute_params;

void ggml_compute_forward_ssm_conv_back(const struct ggml_compute_params * params, struct ggml_tensor * dst);
void ggml_compute_forward_ssm_scan_back(const struct ggml_compute_params * params, struct ggml_tensor * dst);

// bytes of the graph plan's work buffer that SSM_CONV_BACK / SSM_SCAN_BACK need with n_threads threads
size_t ggml_ssm_conv_back_work_size(const struct ggml_tensor * node, int n_threads);
size_t ggml_ssm_scan_back_work_size(const struct ggml_tensor * node, int n_threads);

// F32 only (and I32 ids)
bool ggml_cpu_ssm_back_supports_op(const struct ggml_tensor * op);

#ifdef __cplusplus
}
#endif
