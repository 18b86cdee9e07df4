// Row kernels of the portable CUDA path, all memory-bound and deterministic (fixed reduction order):
//   gather_sum    out[t, :] = sum_j w_tj rows[slot_to_row[t * topk + j], :] in j order, f32 accumulate
//                 (rows in f32 or in the element type);
//                 w = 1 when weights is NULL; NaN rows for tokens flagged invalid by the routing.
//                 Forward combine (rows = o, w = topk_weights) and backward dx (rows = q, w = 1).
//   dswiglu_rows  per sorted row r (slot = sorted_slot[r], s = topk_weights[slot]), from h = [g, u] and
//                 p = W2[e]^T dy: ds = <p, a>, da = s p, dh = [dg, du] (over h in place, or into a separate
//                 buffer), and s * a written to `act` (the dW2 operand: dW2[e] = sum dy (s a)^T): the default
//                 options' case of layout_rows.h's dact_rows (SwiGLU in PreciseMath, no b2), which runs it.
//   finalize_dtopk  d topk_weights[slot] = ds of the slot's row (the sum of its partial sums, in order), 0 for
//                 dropped slots, NaN for invalid tokens.
//   fill_nan_if   every element NaN when a device flag is set (grouped rows' weight gradients under invalid
//                 counts), else nothing.
// Grouped rows: sorted_slot NULL (row r is slot r) and weights NULL (every weight 1) are allowed wherever they are
// read.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common.h"

namespace megamoe::cuda {

struct GatherSumArgs {
    megamoe_dtype_t out_dtype;   // bf16 or f16
    const void* rows;            // [rows, num_cols]
    megamoe_dtype_t rows_dtype;  // f32 or out_dtype
    const int* slot_to_row;      // [T * topk], -1 = no row
    const void* weights;         // [T * topk] or NULL (w = 1)
    megamoe_dtype_t weights_dtype;
    const int* token_invalid;  // [T]
    int64_t num_tokens;
    int64_t topk;
    int64_t num_cols;
    void* out;  // [T, num_cols]
};
megamoe_status_t launch_gather_sum(const GatherSumArgs& args, cudaStream_t stream);

struct DSwiGLUArgs {
    megamoe_dtype_t dtype;      // element type of h, dh and act
    const void* h;              // [rows, 2I]: [g, u] by sorted row
    void* dh;                   // [rows, 2I] out: [dg, du] by sorted row (may be h itself)
    const float* p;             // [rows, I]
    void* act;                  // [rows, I] out: s * a (SwiGLU: s * silu(g) * u)
    float* ds_rows;             // [rows] out
    const int* sorted_slot;     // [S], or NULL: slot r for row r
    const int* expert_offsets;  // [E + 1]; rows = expert_offsets[E]
    int64_t num_experts;
    const void* weights;  // [T * topk], or NULL: 1
    megamoe_dtype_t weights_dtype;
    int64_t intermediate;
    int64_t max_rows;  // host bound on rows (S)
};
megamoe_status_t launch_dswiglu_rows(const DSwiGLUArgs& args, cudaStream_t stream);

struct FinalizeDTopkArgs {
    const float* ds_parts;  // [rows, num_ds_parts]: partial sums of ds per row, added in part order
    int64_t num_ds_parts;
    const int* slot_to_row;
    const int* token_invalid;
    int64_t num_slots;
    int64_t topk;
    void* dtopk_weights;  // [T * topk]
    megamoe_dtype_t dtopk_dtype;
};
megamoe_status_t launch_finalize_dtopk(const FinalizeDTopkArgs& args, cudaStream_t stream);

// data [count] (f32, bf16 or f16; NULL: nothing) all NaN when *flag != 0 (a device int), else untouched.
megamoe_status_t launch_fill_nan_if(const int* flag, void* data, megamoe_dtype_t dtype, int64_t count,
                                    cudaStream_t stream);

}  // namespace megamoe::cuda
