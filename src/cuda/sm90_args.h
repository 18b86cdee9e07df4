// The sm_90a kernels' view of a call's expert options (cuda_path.cu): the GEMM arguments in the weights' layout, the
// gated epilogue's options and whether the sm_90a kernels take the options at all.
#pragma once

#include "cuda/call.h"
#include "cuda/cuda_utils.h"
#include "cuda/grouped_gemm.h"
#include "cuda/layout_steps.h"
#include "sm90/grouped_gemm_sm90.h"

namespace megamoe::cuda {

// The sm_90a kernels' GEMM arguments for the call's layout, from the default ones cuda_path builds (the portable steps
// adjust those themselves, layout_steps.h): w13 stored transposed is read [K = H, N = 2I] (up, kKN) and [N = H, K = 2I]
// (dX, kNK), w2 stored transposed [K = I, N = H] (down, kKN) and [N = I, K = H] (dH, kNK).
inline BLayout sm90_up_layout(const Call& call) {
    return call.layout.w13_transposed ? BLayout::kKN : BLayout::kNK;
}
inline BLayout sm90_down_layout(const Call& call) {
    return call.layout.w2_transposed ? BLayout::kKN : BLayout::kNK;
}
inline BLayout sm90_d_hidden_layout(const Call& call) {
    return call.layout.w2_transposed ? BLayout::kNK : BLayout::kKN;
}
inline BLayout sm90_d_input_layout(const Call& call) {
    return call.layout.w13_transposed ? BLayout::kNK : BLayout::kKN;
}
inline MGroupedGemmArgs sm90_up_args(const Call& call, MGroupedGemmArgs args) {
    if (call.layout.w13_transposed) args.ldb = 2 * call.shape.intermediate;
    return args;
}
inline MGroupedGemmArgs sm90_w2_args(const Call& call, MGroupedGemmArgs args) {  // down and dH
    if (call.layout.w2_transposed) args.ldb = call.shape.hidden;
    return args;
}
inline MGroupedGemmArgs sm90_d_input_args(const Call& call, MGroupedGemmArgs args) {
    if (call.layout.w13_transposed) args.ldb = 2 * call.shape.intermediate;
    return args;
}
inline sm90::GatedArgs sm90_gated_args(const Call& call) {
    sm90::GatedArgs gated{};
    gated.activation = call.activation;
    gated.bias = call.b13;
    gated.interleaved = call.layout.gate_up == MEGAMOE_GATE_UP_INTERLEAVED;
    gated.b_layout = sm90_up_layout(call);
    return gated;
}
// Whether the sm_90a kernels take the call's expert options (all but the separate layout; the biases read as pairs of
// 16-bit elements).
inline bool sm90_options_ok(const Call& call) {
    return sm90_blocking_option(call) == nullptr && is_aligned(call.b13, 4) && is_aligned(call.b2, 4);
}

}  // namespace megamoe::cuda
