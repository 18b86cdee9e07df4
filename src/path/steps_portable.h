// The portable backend's GEMM steps (steps_portable.cu; the Backend itself: steps.h, portable_backend()), for any
// sm_80+ GPU and every expert option. The default options (call.default_experts) run the default's own kernels; any
// other reads the weights in place in their layout (no copy):
//   up       gated GEMM: B rows by the layout (kNK, or kKN when w13 is transposed; interleaved rows paired in the
//            tile, concatenated / separate up rows through b_up), b13 and the activation in the epilogue
//   down     w2 transposed: kKN B; b2 added in the element-type epilogue
//   dH       p = dy W2[e]^T in f32: kKN B, or kNK when w2 is transposed; then the row kernel of the activation's
//            backward (dswiglu_rows, or dact_rows of layout_rows.h: dh in the order of w13's rows, ds with <dy, b2[e]>)
//   dX       q = dh W13[e] in f32: dh in w13's row order is the K dimension as stored (kKN, kNK when transposed); the
//            separate layout as two GEMMs, the up half added onto the gate half's q
// The weight gradients (steps.h: WeightGrads) and the bias gradients are the shared steps.
#pragma once

#include <cuda_runtime.h>

#include "common.h"
#include "path/call.h"
#include "path/steps.h"

namespace megamoe::cuda {

// h = [g, u] (+ b13) into h [S, 2I] (may be NULL) and a = act(g, u) into act [S, I] (may be NULL), from x [T, H]
// gathered through rows.sorted_slot.
megamoe_status_t launch_up(const Call& call, const SortedRows& rows, const void* x, void* h, void* act,
                           cudaStream_t stream);
// o = W2[e] a (+ b2[e]) [S, H] in the element type into out, from act [S, I].
megamoe_status_t launch_down(const Call& call, const SortedRows& rows, const void* act, void* out, cudaStream_t stream);
// q = dh W13[e] [S, H] in f32 into q, from dh [S, 2I] in w13's row order.
megamoe_status_t launch_d_input(const Call& call, const SortedRows& rows, const void* dh, float* q,
                                cudaStream_t stream);

}  // namespace megamoe::cuda
