// The portable CUDA path (any sm_80+ GPU): routing metadata on the device, grouped GEMMs with
// gathered operands, SwiGLU, deterministic combine. No device->host synchronisation and no
// allocation: everything lives in the caller's workspace, so a CUDA graph can capture a call.
//
// Preconditions (checked by src/api.cpp before any call here): every tensor is on the same CUDA
// device and contiguous row-major; x, w13, w2, dy share one dtype (bf16 or f16); topk_ids is i32 or
// i64; topk_weights is f32 or the dtype of x; output dtypes are as documented in megamoe.h;
// accum is DEFAULT or F32; shape.num_slots() < 2^31; the params' workspace has at least the bytes
// the matching *_workspace_size reports.
//
// Ids outside [-1, E) cannot be reported without a host sync: the CUDA path never reads out of
// bounds for them and writes NaN into y (forward) and into dx / d topk_weights (backward) for the
// tokens holding them, so the error is loud, never silent.
#pragma once

#include <cstddef>

#include "common.h"

namespace megamoe::cuda {

size_t forward_workspace_size(const megamoe_forward_params_t& params, const Shape& shape);
megamoe_status_t forward(const megamoe_forward_params_t& params, const Shape& shape);
// Whether forward() would run its GEMMs on the fused sm_90a kernels for these params (device, dtype,
// alignment, MEGAMOE_DISABLE_SM90), else on the portable ones. For tests and benchmarks.
bool forward_uses_sm90(const megamoe_forward_params_t& params, const Shape& shape);

size_t backward_workspace_size(const megamoe_backward_params_t& params, const Shape& shape);
megamoe_status_t backward(const megamoe_backward_params_t& params, const Shape& shape);
// Whether backward() would run its M-grouped GEMMs (up, dH, dX) on the fused sm_90a kernels, and its weight
// gradients (dW13, dW2; MEGAMOE_SM90_WEIGHT_GRADS=0 opts out) on the sm_90a K-grouped kernel. For tests and
// benchmarks.
bool backward_uses_sm90(const megamoe_backward_params_t& params, const Shape& shape);
bool backward_weight_grads_use_sm90(const megamoe_backward_params_t& params, const Shape& shape);

}  // namespace megamoe::cuda
