// Row kernels of the portable CUDA path for the non-default expert options (layouts, clamped SwiGLU, biases), all
// deterministic (fixed reduction order, no atomics):
//   dact_rows        per sorted row r of expert e (slot = sorted_slot[r], s its weight), from h = [g, u] (bias
//                    included) and p = W2[e]^T dy: ds = <p, a> + <dy, b2[e]> (= <dy, o>), (dg, du) = s p act'(g, u)
//                    (activation.h), written as dh in the order of w13's rows (interleaved: dg_0, du_0, dg_1, ...;
//                    else [dg, du]), over h in place or elsewhere; s * a into `act` (dW2's operand).
//   expert_col_sums  out[e, c] = sum over the sorted rows r of expert e, in row order, of w_r src[row(r), c]
//                    (row(r) = r, or the token of sorted_slot[r]; w_r = 1, or the slot's weight): db13 (src = dh)
//                    and db2 (src = dy gathered, w = s). Experts without rows get 0 (accumulate: left untouched).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "activation.h"
#include "common.h"
#include "portable/elementwise.h"

namespace megamoe::cuda {

// DSwiGLUArgs (its dtype also that of dy and b2) and the expert options: the order of dh, b2, the activation.
struct DActArgs : DSwiGLUArgs {
    bool dh_interleaved;  // dh in interleaved order (the interleaved layout's rows), else [dg, du]
    const void* dy;       // [T, H]: row of slot / topk (read only with b2)
    const void* b2;       // [E, H], or NULL: no bias of the down projection
    int64_t topk;
    int64_t hidden;
    Activation<float> activation;
};
megamoe_status_t launch_dact_rows(const DActArgs& args, cudaStream_t stream);

// The sm_90a path's ds with b2: ds_parts[r * num_ds_parts] += <dy[row of r], b2[e]> for every sorted row r of expert e.
struct BiasDotArgs {
    megamoe_dtype_t dtype;      // of dy and b2
    const void* dy;             // [T, H]: row of slot / topk
    const void* b2;             // [E, H]
    const int* sorted_slot;     // [S], or NULL: slot r for row r
    const int* expert_offsets;  // [E + 1]; rows = expert_offsets[E]
    int64_t num_experts;
    int64_t topk;
    int64_t hidden;
    float* ds_parts;  // [rows, num_ds_parts]
    int64_t num_ds_parts;
    int64_t max_rows;  // host bound on rows (S)
};
megamoe_status_t launch_bias_dot_rows(const BiasDotArgs& args, cudaStream_t stream);

struct ExpertColSumsArgs {
    const void* src;  // [*, num_cols] in src_dtype (bf16 / f16)
    megamoe_dtype_t src_dtype;
    const int* gather_slots;  // NULL: row r; else row gather_slots[r] / topk
    int64_t topk;
    const void* weights;  // NULL: 1; else the weight of the row's slot (slot_of_row)
    megamoe_dtype_t weights_dtype;
    const int* expert_offsets;  // [E + 1]
    int64_t num_experts;
    int64_t num_cols;
    void* out;  // [E, num_cols] in out_dtype (the element type or f32)
    megamoe_dtype_t out_dtype;
    bool accumulate;  // out is f32 holding values: the sums are added into it
};
megamoe_status_t launch_expert_col_sums(const ExpertColSumsArgs& args, cudaStream_t stream);

}  // namespace megamoe::cuda
