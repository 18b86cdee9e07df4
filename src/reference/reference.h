// The CPU reference of DESIGN.md section 1: the test oracle and the CPU backend of the op.
// Readable first: one slot (t, j) at a time, f64 or f32 accumulation, any supported dtype.
//
// Preconditions (checked by src/api.cpp): every tensor is on the CPU and contiguous row-major;
// ids are in [-1, E).
#pragma once

#include <cstddef>

#include "common.h"

namespace megamoe::reference {

size_t forward_workspace_size(const megamoe_forward_params_t& params, const Shape& shape);
megamoe_status_t forward(const megamoe_forward_params_t& params, const Shape& shape);

size_t backward_workspace_size(const megamoe_backward_params_t& params, const Shape& shape);
megamoe_status_t backward(const megamoe_backward_params_t& params, const Shape& shape);

}  // namespace megamoe::reference
