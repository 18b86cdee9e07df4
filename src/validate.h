// Argument checks shared by the C API's entry points (api.cpp: the whole layer; api_grouped.cpp: grouped rows).
// Each returns SUCCESS or sets a message naming the offending argument and returns its status.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <vector>

#include "common.h"

namespace megamoe {

// Sorted-row indices are int32 on the device: at most this many rows (T * topk, or R).
constexpr int64_t kMaxRows = (int64_t{1} << 31) - 1;

#define MEGAMOE_CHECK(expr)                                    \
    do {                                                       \
        const megamoe_status_t status_ = (expr);               \
        if (status_ != MEGAMOE_STATUS_SUCCESS) return status_; \
    } while (0)

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

// The rows input x (named x_name, shape x_dims: [rows, H]) and the expert weights w13 [E, 2I, H], w2 [E, H, I]: ranks,
// dtypes, shapes, one device, what CUDA supports, accum. Fills shape's num_tokens (the rows), hidden, num_experts and
// intermediate.
megamoe_status_t check_rows_and_weights(const char* x_name, const char* x_dims, const megamoe_tensor_t& x,
                                        const megamoe_tensor_t& w13, const megamoe_tensor_t& w2, megamoe_accum_t accum,
                                        Shape* shape);

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
megamoe_status_t check_outputs_disjoint(std::initializer_list<Named> outputs);

megamoe_status_t check_workspace(const void* workspace, size_t have, size_t need);
// Every present CUDA tensor's pointer is device (or managed) memory of its device.
megamoe_status_t check_cuda_pointers(std::initializer_list<Named> tensors);

}  // namespace megamoe
