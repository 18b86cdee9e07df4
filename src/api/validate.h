// Argument checks of the C API's entry points: validate() of each params struct (validate_params.cpp: the whole layer
// and grouped rows), the expert parameters they share (validate_experts.cpp: layouts, activation, biases and their
// gradients) and the tensor checks under both (validate.cpp). Each returns SUCCESS or sets a message naming the
// offending argument and returns its status.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "common.h"
#include "layout.h"

namespace megamoe {

// Sorted-row indices are int32 on the device: at most this many rows (T * topk, or R).
constexpr int64_t kMaxRows = (int64_t{1} << 31) - 1;

// The entry of `table` for an enum `code` (megamoe.h numbers each enum's codes from 0: the table's index), or
// `unknown` for a code past the table.
template <typename T, size_t N, typename Code>
T entry_of(const T (&table)[N], Code code, T unknown) {
    const auto idx = static_cast<int64_t>(code);
    return idx >= 0 && idx < static_cast<int64_t>(N) ? table[idx] : unknown;
}

struct Named {
    const char* name;
    const megamoe_tensor_t* tensor;
};

std::string shape_string(const megamoe_tensor_t& tensor);

// Rank, dtype validity, non-negative extents, data pointer and row-major contiguity of one tensor.
megamoe_status_t check_tensor(const char* name, const megamoe_tensor_t& tensor, int32_t ndim, const char* dims);
megamoe_status_t check_shape(const char* name, const megamoe_tensor_t& tensor, std::vector<int64_t> expected,
                             const char* dims);
megamoe_status_t check_dtype(const char* name, const megamoe_tensor_t& tensor, megamoe_dtype_t want_a,
                             megamoe_dtype_t want_b, const char* rule);
// `tensor` on the device of `x` (named x_name in the message).
megamoe_status_t check_same_device(const char* name, const megamoe_tensor_t& tensor, const megamoe_tensor_t& x,
                                   const char* x_name = "x");
bool overlaps(const megamoe_tensor_t& a, const megamoe_tensor_t& b);

// The rows input x (named x_name, shape x_dims: [rows, H]) and the expert parameters: the layout and activation codes,
// w13 / w3 / w2 in their layout's shapes, the optional biases b13 [E, 2I] and b2 [E, H]; ranks, dtypes, shapes, one
// device, what CUDA supports, accum. Fills shape's num_tokens (the rows), hidden, num_experts and intermediate.
megamoe_status_t check_rows_and_weights(const char* x_name, const char* x_dims, const megamoe_tensor_t& x,
                                        const Experts& experts, megamoe_accum_t accum, Shape* shape);
// The present ones of a backward's dw13, dw3, dw2, db13, db2: each needs its parameter, has its shape, its dtype or
// f32 (f32 only when accumulated into), is on x's device and overlaps none of `inputs`; accumulate_weight_grads is 0
// or 1.
megamoe_status_t check_expert_grads(const ExpertGrads& grads, int32_t accumulate_weight_grads,
                                    const megamoe_tensor_t& x, const char* x_name, const Experts& experts,
                                    const std::vector<Named>& inputs);
// The expert parameters / gradients, named as in the params structs (for the overlap and pointer checks); both in
// the order w13, w3, w2, b13, b2 (a gradient at its parameter's index).
std::vector<Named> expert_inputs(const Experts& experts);
std::vector<Named> expert_grad_outputs(const ExpertGrads& grads);

// The FP8 weights a call reads (megamoe.h's megamoe_fp8_experts_t): the forward w13 and w2, the backward w2_t, w13_t
// when dx is wanted and w13 when h is recomputed; the scales of each weight read in either form.
struct Fp8Reads {
    bool w13 = false;
    bool w13_t = false;
    bool w2 = false;
    bool w2_t = false;
};
// The precision code; in FP8_BLOCKWISE the FP8 weights `reads` names present (the others may be absent; a transposed
// copy it names may be absent too, and then the weight it is made from must be present), each given one shaped, typed
// and on x's device; in DEFAULT none of them given (validate_fp8.cpp). After check_rows_and_weights (shape
// filled), before the overlap checks that read the FP8 tensors.
megamoe_status_t check_precision(const char* x_name, const megamoe_tensor_t& x, const Experts& experts,
                                 const Shape& shape, const Fp8Reads& reads);
// FP8_BLOCKWISE: a call the FP8 kernels run (CUDA, SwiGLU, no biases, a concatenated or separate layout, H and I
// multiples of 128), else NOT_SUPPORTED naming what; last, once every argument is valid.
megamoe_status_t check_precision_supported(const char* x_name, const megamoe_tensor_t& x, const Experts& experts,
                                           const Shape& shape);
// The FP8 weights, named as in the params structs (for the overlap and pointer checks).
std::vector<Named> fp8_inputs(const Experts& experts);
// megamoe_quantize_experts' arguments: w13 [E, 2I, H] and w2 [E, H, I] (bf16, f16 or f32, CUDA), every tensor of fp8
// present in its shape but the transposed copies (absent: not written), disjoint, device memory. Fills shape's
// num_experts, hidden and intermediate.
megamoe_status_t check_quantize_experts(const megamoe_tensor_t* w13, const megamoe_tensor_t* w2,
                                        const megamoe_fp8_experts_t* fp8, Shape* shape);

// An input the caller passes besides the checked ones: rank, shape, dtype, device of x.
megamoe_status_t check_input(const char* name, const megamoe_tensor_t& input, const megamoe_tensor_t& x,
                             const char* x_name, int32_t ndim, const char* dims, std::vector<int64_t> shape,
                             megamoe_dtype_t want_a, megamoe_dtype_t want_b, const char* rule);
// An output: present, shaped, typed, on x's device, and not overlapping any input.
megamoe_status_t check_output(const char* name, const megamoe_tensor_t& out, const megamoe_tensor_t& x,
                              const char* x_name, int32_t ndim, const char* dims, std::vector<int64_t> shape,
                              megamoe_dtype_t want_a, megamoe_dtype_t want_b, const char* rule,
                              const std::vector<Named>& inputs);
// The present ones of `outputs` do not overlap each other.
megamoe_status_t check_outputs_disjoint(const std::vector<Named>& outputs);

megamoe_status_t check_workspace(const void* workspace, size_t have, size_t need);
// Every present CUDA tensor's pointer is device (or managed) memory of its device.
megamoe_status_t check_cuda_pointers(const std::vector<Named>& tensors);

// Every argument of an entry point (validate_params.cpp); fills the problem's shape.
megamoe_status_t validate(const megamoe_forward_params_t* params, Shape* shape);
megamoe_status_t validate(const megamoe_backward_params_t* params, Shape* shape);
megamoe_status_t validate(const megamoe_grouped_forward_params_t* params, Shape* shape);
megamoe_status_t validate(const megamoe_grouped_backward_params_t* params, Shape* shape);
// What only CPU tensors let validation read: ids in [-1, E), counts >= 0 summing to at most R.
megamoe_status_t check_cpu_values(const megamoe_forward_params_t& p, const Shape& shape);
megamoe_status_t check_cpu_values(const megamoe_backward_params_t& p, const Shape& shape);
megamoe_status_t check_cpu_values(const megamoe_grouped_forward_params_t& p, const Shape& shape);
megamoe_status_t check_cpu_values(const megamoe_grouped_backward_params_t& p, const Shape& shape);
// Every present CUDA tensor of the params is device memory of its device.
megamoe_status_t check_cuda_pointers_of(const megamoe_forward_params_t& p);
megamoe_status_t check_cuda_pointers_of(const megamoe_backward_params_t& p);
megamoe_status_t check_cuda_pointers_of(const megamoe_grouped_forward_params_t& p);
megamoe_status_t check_cuda_pointers_of(const megamoe_grouped_backward_params_t& p);

}  // namespace megamoe
