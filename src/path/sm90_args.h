// The sm_90a kernels' view of a call's expert options (cuda_path.cu): the GEMM arguments in the weights' layout, the
// gated epilogue's options, the dW13 GEMMs and whether the sm_90a kernels take the options at all. The separate layout
// (w1 = w13 and w3, [E, I, H] each, or [E, H, I] transposed) is read in place: B's up half (up GEMM) or K rows [I, 2I)
// (dX) from w3 through MGroupedGemmArgs::b_up, a second tensor map of the same shape; dw13 and dw3 as two K-grouped
// GEMMs over dh's gate and up columns.
#pragma once

#include "path/call.h"
#include "device/cuda_utils.h"
#include "portable/grouped_gemm.h"
#include "path/layout_steps.h"
#include "sm90/m_grouped_gemm_sm90.h"
#include "sm90/k_grouped_gemm_sm90.h"

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
inline bool is_separate(const Call& call) {
    return call.layout.gate_up == MEGAMOE_GATE_UP_SEPARATE;
}
// B = w13 (the default args) read in its layout: [E, 2I, H] or transposed [E, H, 2I]; separate: w1 and w3 (b_up), I
// rows (columns) of an expert each.
inline MGroupedGemmArgs sm90_w13_args(const Call& call, MGroupedGemmArgs args) {
    const int64_t rows = call.layout.w13_rows();
    args.b_expert_stride = rows * call.shape.hidden;
    if (call.layout.w13_transposed) args.ldb = rows;
    if (is_separate(call)) args.b_up = call.w3;
    return args;
}
inline MGroupedGemmArgs sm90_up_args(const Call& call, const MGroupedGemmArgs& args) {
    return sm90_w13_args(call, args);
}
inline MGroupedGemmArgs sm90_w2_args(const Call& call, MGroupedGemmArgs args) {  // down and dH
    if (call.layout.w2_transposed) args.ldb = call.shape.hidden;
    return args;
}
// dX: K = 2I over dh's [dg, du] columns; separate: K rows [0, I) from w1, [I, 2I) from w3 (the kernel's K halves).
inline MGroupedGemmArgs sm90_d_input_args(const Call& call, const MGroupedGemmArgs& args) {
    return sm90_w13_args(call, args);
}
inline sm90::GatedArgs sm90_gated_args(const Call& call) {
    sm90::GatedArgs gated{};
    gated.activation = call.activation;
    gated.bias = call.b13;
    gated.interleaved = call.layout.gate_up == MEGAMOE_GATE_UP_INTERLEAVED;
    gated.b_layout = sm90_up_layout(call);
    return gated;
}
// Why the sm_90a kernels do not take the call's expert options (every layout, activation and bias, but w3 aligned as
// w13 must be, its strides being w13's, and the biases read as pairs of 16-bit elements), or NULL.
inline const char* sm90_options_blocker(const Call& call) {
    if (is_separate(call) && !is_aligned(call.w3, 16)) {
        return "w3 not 16-byte aligned: the fused sm_90a kernels read it by TMA, as w13";
    }
    if (!is_aligned(call.b13, 4) || !is_aligned(call.b2, 4)) {
        return "b13 / b2 not 4-byte aligned: the fused sm_90a kernels read the biases as pairs of elements";
    }
    return nullptr;
}
inline bool sm90_options_ok(const Call& call) {
    return sm90_options_blocker(call) == nullptr;
}

// The sm_90a dW13 GEMM writing dw13 (up_half false) or the separate layout's dw3 (true), from the default one (`args`:
// over dh [rows, 2I] and x): separate, dh's gate columns [0, I) give dw13 (w1), its up columns [I, 2I) dw3; operands
// swapped where w13 is stored transposed.
inline KGroupedGemmArgs sm90_dw13_args(const Call& call, KGroupedGemmArgs args, bool up_half) {
    if (is_separate(call)) {
        args.m = call.shape.intermediate;
        if (up_half) args.a = static_cast<const uint16_t*>(args.a) + call.shape.intermediate;
    }
    return call.layout.w13_transposed ? swapped_operands(args) : args;
}
// The wanted outputs of the dW13 GEMMs: dw13, and dw3 in the separate layout.
inline int sm90_num_dw13_outputs(const Call& call) {
    return is_separate(call) ? 2 : 1;
}
inline const megamoe_tensor_t& sm90_dw13_output(const BackwardCall& call, bool up_half) {
    return up_half ? call.dw3 : call.dw13;
}
// Whether the sm_90a K-grouped kernel takes every wanted dW13 GEMM.
inline bool sm90_dw13_ok(const BackwardCall& call, const KGroupedGemmArgs& args) {
    for (int half = 0; half < sm90_num_dw13_outputs(call); ++half) {
        const megamoe_tensor_t& grad = sm90_dw13_output(call, half == 1);
        if (grad.data != nullptr &&
            !sm90::k_grouped_gemm_sm90_supported(sm90_dw13_args(call, args, half == 1), grad.data)) {
            return false;
        }
    }
    return true;
}
// The wanted dW13 GEMMs on the sm_90a K-grouped kernel, dw13 then dw3 (each reads the schedule scratch afresh).
inline megamoe_status_t launch_sm90_dw13(const BackwardCall& call, const KGroupedGemmArgs& args, int num_sms,
                                         cudaStream_t stream) {
    for (int half = 0; half < sm90_num_dw13_outputs(call); ++half) {
        const megamoe_tensor_t& grad = sm90_dw13_output(call, half == 1);
        if (grad.data == nullptr) continue;
        MEGAMOE_CUDA_RETURN_IF_ERROR(sm90::launch_k_grouped_gemm_sm90(sm90_dw13_args(call, args, half == 1), grad.data,
                                                                      grad.dtype, num_sms, stream));
    }
    return MEGAMOE_STATUS_SUCCESS;
}

}  // namespace megamoe::cuda
