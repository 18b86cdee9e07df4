// The CUDA path: a call's routing metadata on the device, its grouped GEMMs with gathered operands on the fused
// sm_90a kernels where they take the call (sm90/) and on the portable ones otherwise (portable/, any sm_80+ GPU), the
// activation and the deterministic combine. No device->host synchronisation and no allocation: everything lives in
// the caller's workspace, so a CUDA graph can capture a call.
// Both entry points run it: the whole layer and grouped rows (rows already sorted by expert; see call.h).
//
// Preconditions (checked by src/api/api.cpp before any call here): every tensor is on the same CUDA
// device and contiguous row-major; x, w13, w2, dy share one dtype (bf16 or f16); topk_ids /
// tokens_per_expert are i32 or i64; topk_weights / scores are f32 or the dtype of x; output dtypes are as
// documented in megamoe.h; accum is DEFAULT or F32; the rows (T * topk, or R) are below 2^31; the params'
// workspace has at least the bytes the matching workspace_size reports.
//
// Ids outside [-1, E) cannot be reported without a host sync: the CUDA path never reads out of
// bounds for them and writes NaN into y (forward) and into dx / d topk_weights (backward) for the
// tokens holding them, so the error is loud, never silent. Grouped rows' counts that are negative or
// sum past R likewise: no access past row R, and every output of the call (out; d x_sorted, d scores,
// dw13, dw2) is NaN.
#pragma once

#include <cstddef>
#include <string>

#include "common.h"
#include "layout.h"

namespace megamoe::cuda {

// The kernels a call with these params runs: the portable path, the fused sm_90a kernels, or (backward) the sm_90a
// M-grouped GEMMs with the portable weight gradients (forward_uses_sm90 / backward_uses_sm90 below). Every layout,
// activation and bias runs on CUDA, on the sm_90a kernels too; a call they would otherwise run but for a misaligned w3
// or bias takes the portable path, and `reason` names it ("" when nothing of the expert parameters moved it there).
megamoe_path_t path(const megamoe_forward_params_t& params, const Shape& shape, std::string* reason);
megamoe_path_t path(const megamoe_grouped_forward_params_t& params, const Shape& shape, std::string* reason);
megamoe_path_t path(const megamoe_backward_params_t& params, const Shape& shape, std::string* reason);
megamoe_path_t path(const megamoe_grouped_backward_params_t& params, const Shape& shape, std::string* reason);

// Precision FP8_BLOCKWISE: NOT_SUPPORTED (naming the device) unless the device runs the sm_90a kernels, for it has no
// portable fallback (checked with the arguments, before any query or run).
megamoe_status_t check_fp8_device(int device_index);

// megamoe_quantize_experts on validated arguments (shape: E, H, I): w13 and w2 in 128 x 128 blocks with their
// transposes where fp8 gives them, on the stream.
megamoe_status_t quantize_experts(const megamoe_tensor_t& w13, const megamoe_tensor_t& w2,
                                  const megamoe_fp8_experts_t& fp8, const Shape& shape, void* stream);

size_t workspace_size(const megamoe_forward_params_t& params, const Shape& shape);
size_t workspace_size(const megamoe_grouped_forward_params_t& params, const Shape& shape);
megamoe_status_t run(const megamoe_forward_params_t& params, const Shape& shape);
megamoe_status_t run(const megamoe_grouped_forward_params_t& params, const Shape& shape);
// Whether the forward would run its GEMMs on the fused sm_90a kernels for these params (device, dtype,
// alignment, MEGAMOE_DISABLE_SM90), else on the portable ones. For tests and benchmarks.
bool forward_uses_sm90(const megamoe_forward_params_t& params, const Shape& shape);
bool forward_uses_sm90(const megamoe_grouped_forward_params_t& params, const Shape& shape);

size_t workspace_size(const megamoe_backward_params_t& params, const Shape& shape);
size_t workspace_size(const megamoe_grouped_backward_params_t& params, const Shape& shape);
megamoe_status_t run(const megamoe_backward_params_t& params, const Shape& shape);
megamoe_status_t run(const megamoe_grouped_backward_params_t& params, const Shape& shape);
// Whether the backward would run its M-grouped GEMMs (up, dH, dX) on the fused sm_90a kernels, and its weight
// gradients (dW13, dW2; the test override MEGAMOE_TEST_PORTABLE_WEIGHT_GRADS opts out) on the sm_90a K-grouped
// kernel. For tests and benchmarks.
bool backward_uses_sm90(const megamoe_backward_params_t& params, const Shape& shape);
bool backward_uses_sm90(const megamoe_grouped_backward_params_t& params, const Shape& shape);
bool backward_weight_grads_use_sm90(const megamoe_backward_params_t& params, const Shape& shape);
bool backward_weight_grads_use_sm90(const megamoe_grouped_backward_params_t& params, const Shape& shape);
// Whether the sm_90a backward keeps s * a and q in the dw13 output instead of the workspace (for tests).
bool backward_act_in_dw13(const megamoe_backward_params_t& params, const Shape& shape);

}  // namespace megamoe::cuda
