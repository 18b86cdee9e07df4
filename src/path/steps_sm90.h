// The sm90 backend (steps_sm90.cu; the Backend itself: steps.h, sm90_backend()): the fused sm_90a kernels with every
// expert option as a compile-time policy, the weights read in place. The GEMMs' B in the weights' layout: w13 stored
// transposed is read [K = H, N = 2I] (up, kKN) and [N = H, K = 2I] (dX, kNK), w2 stored transposed [K = I, N = H]
// (down, kKN) and [N = I, K = H] (dH, kNK). The separate layout (w1 = w13 and w3, [E, I, H] each, or [E, H, I]
// transposed) reads B's up half (up GEMM) or K rows [I, 2I) (dX) from w3 through MGroupedGemmArgs::b_up, a second
// tensor map of the same shape; dw13 and dw3 are two K-grouped GEMMs over dh's gate and up columns (steps.h). The
// gated epilogue takes the activation, b13 and the interleaved pairs; the down GEMM's store epilogue adds b2; the
// dSwiGLU epilogue writes dh in w13's row order (interleaved: into its own buffer, not over h) and ds's bias term
// <dy, b2[e]> is added to the first ds part by a row kernel.
// Also here: whether the sm_90a kernels take a call (the plan's questions) and the pieces the FP8 backend shares.
#pragma once

#include "common.h"
#include "path/call.h"
#include "path/steps.h"
#include "sm90/m_grouped_gemm_sm90.h"

namespace megamoe::cuda {

// Why the sm_90a kernels do not take the call's expert options (every layout, activation and bias, but w3 aligned as
// w13 must be, its strides being w13's, and the biases read as pairs of 16-bit elements), or NULL.
const char* sm90_options_blocker(const Call& call);
inline bool sm90_options_ok(const Call& call) {
    return sm90_options_blocker(call) == nullptr;
}

// The device (compute capability 9.0, MEGAMOE_DISABLE_SM90), dtype and alignment suit the sm_90a kernels for the
// forward's up and down GEMMs / the backward's up, dH and dX GEMMs (the expert options aside), over the step's
// workspace.
bool sm90_forward_hardware_ok(const ForwardStep& step);
bool sm90_backward_hardware_ok(const BackwardStep& step);
// The sm_90a K-grouped kernel takes every wanted weight gradient (dw13, dw3, dw2) over the step's workspace.
bool sm90_weight_grads_ok(const BackwardStep& step);

// The dSwiGLU epilogue of the dH GEMM (16-bit and FP8): h, dh, s * a and the ds parts in the step's workspace.
sm90::DSwiGLUEpilogueArgs dswiglu_epilogue(const BackwardStep& step);
// ds's bias term <dy, b2[e]>, added to each row's first ds part, when the call has b2 and wants d topk_weights.
megamoe_status_t add_bias_dot(const BackwardStep& step, int64_t num_ds_parts);

}  // namespace megamoe::cuda
