// The CPU reference of DESIGN.md section 1: the test oracle and the CPU backend of the op.
// Readable first: one slot (t, j) at a time, f64 or f32 accumulation, any supported dtype.
// Grouped rows are the same computation with one slot per row (T = R, topk = 1), the expert of a row given by
// tokens_per_expert and its weight by scores (1 when absent); padding rows have no expert, like a dropped slot.
//
// Preconditions (checked by src/api/api.cpp): every tensor is on the CPU and contiguous row-major;
// ids are in [-1, E); counts are >= 0 and sum to at most R.
#pragma once

#include <cstddef>

#include "common.h"

namespace megamoe::reference {

// The reference needs no workspace: 0 bytes for every params struct.
template <typename Params>
constexpr size_t workspace_size(const Params&, const Shape&) {
    return 0;
}

megamoe_status_t run(const megamoe_forward_params_t& params, const Shape& shape);
megamoe_status_t run(const megamoe_backward_params_t& params, const Shape& shape);
megamoe_status_t run(const megamoe_grouped_forward_params_t& params, const Shape& shape);
megamoe_status_t run(const megamoe_grouped_backward_params_t& params, const Shape& shape);

}  // namespace megamoe::reference
