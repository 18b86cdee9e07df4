// The FP8_BLOCKWISE steps of the CUDA path (megamoe.h's precision; docs/DESIGN.md, FP8): each GEMM's activation operand
// quantized along that GEMM's K in 1 x 128 groups (x and dy by a pass of launch_quantize_groups, a in the up GEMM's
// epilogue, dh by a pass), the weights the caller's megamoe_fp8_experts_t (w13 / w2 for the forward GEMMs, their
// transposed copies for dH and dX, one set of block scales each), the up, down, dH and dX GEMMs on the sm_90a FP8
// kernels (sm90/m_grouped_fp8_gemm_sm90.h). The orchestration (routing, combine, d topk_weights, the 16-bit weight
// gradients) is cuda_forward.cu's and cuda_backward.cu's; these take the 16-bit GEMM arguments they would run and
// swap in the FP8 operands.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common.h"
#include "device/cuda_utils.h"
#include "path/call.h"
#include "portable/grouped_gemm.h"
#include "portable/routing.h"
#include "sm90/m_grouped_gemm_sm90.h"

namespace megamoe::cuda {

// Rows quantized in 1 x 128 groups along their columns: q [rows, cols] e4m3, scales [rows, cols / 128] f32.
struct Fp8Rows {
    uint8_t* q = nullptr;
    float* scales = nullptr;
    int64_t cols = 0;

    static Fp8Rows carve(WorkspaceCarver& carver, int64_t rows, int64_t cols);
};

// `rows` rows of `in` (the call's element type, row stride cols) into `out`.
megamoe_status_t quantize_rows(const Call& call, const void* in, int64_t rows, const Fp8Rows& out);

// The up GEMM (args: up_gemm_args') with x quantized: h = [g, u] into h, a into act (element type) and, when act_q is
// given, a quantized in the epilogue into it (the down GEMM's operand); h and act may be NULL.
megamoe_status_t launch_fp8_up(const Call& call, const MGroupedGemmArgs& args, const Fp8Rows& x, void* h, void* act,
                               const Fp8Rows* act_q, int num_sms);
// The down GEMM (args: the forward's 16-bit down arguments) with a quantized: o [S, H] into out.
megamoe_status_t launch_fp8_down(const Call& call, const MGroupedGemmArgs& args, const Fp8Rows& act, void* out,
                                 int num_sms);
// dH (args: the backward's 16-bit dH arguments) with dy quantized and w2's transposed copy; the dSwiGLU epilogue's
// outputs as the 16-bit dH writes them.
megamoe_status_t launch_fp8_d_hidden(const Call& call, const MGroupedGemmArgs& args, const Fp8Rows& dy,
                                     const sm90::DSwiGLUEpilogueArgs& epilogue, int num_sms, int64_t* num_ds_parts);
// dX (args: the backward's 16-bit dX arguments) with dh quantized and w13's transposed copy: q [S, H] into q.
megamoe_status_t launch_fp8_d_input(const Call& call, const MGroupedGemmArgs& args, const Fp8Rows& dh, void* q,
                                    int num_sms);

}  // namespace megamoe::cuda
