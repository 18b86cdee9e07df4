// The FP8_BLOCKWISE steps of the CUDA path (megamoe.h's precision; DESIGN.md §7): each GEMM's activation operand
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

// An operand of the FP8 weight gradients: columns of an expert-sorted matrix quantized along its rows (tokens) in the
// routing's 128-row M tiles, transposed and tile-padded (launch_quantize_expert_rows' layout, the K-grouped FP8 GEMM's
// operand): q_t [cols, ld] e4m3 with ld = 128 max_tiles, scales [max_tiles, ld_scales].
struct Fp8ExpertCols {
    uint8_t* q_t = nullptr;
    float* scales = nullptr;
    int64_t cols = 0;  // the most columns the buffer holds
    int64_t ld = 0;
    int64_t ld_scales = 0;
    int64_t max_tiles = 0;

    static Fp8ExpertCols carve(WorkspaceCarver& carver, int64_t cols, int64_t max_tiles);
};

// Whether launch_fp8_weight_grad takes the 16-bit weight gradient `args` into `grad` (the kernel's requirements).
bool fp8_weight_grad_ok(const KGroupedGemmArgs& args, const RoutingBuffers& routing, const megamoe_tensor_t& grad,
                        const Fp8ExpertCols& a, const Fp8ExpertCols& b);
// The 16-bit weight gradient `args` (its A and B: rows of M and N columns, gathered or not, sorted by expert) in FP8:
// A and B quantized along the expert rows into `a` and `b` (unless a_quantized / b_quantized: already there), then the
// K-grouped FP8 GEMM into grad [E, M, N] (accumulating where args.accumulate).
megamoe_status_t launch_fp8_weight_grad(const Call& call, const KGroupedGemmArgs& args, const RoutingBuffers& routing,
                                        const megamoe_tensor_t& grad, const Fp8ExpertCols& a, const Fp8ExpertCols& b,
                                        int num_sms, bool a_quantized = false, bool b_quantized = false);
// One side of a weight gradient (`args`' A where side_is_a, else its B: dy for dW2, x for dW13) quantized in one pass
// over its source: along the tokens into `cols` (the weight gradient then launched with that side already quantized)
// and along its columns into `rows` (dH's A, or the recomputing up GEMM's), each routed source row once.
megamoe_status_t quantize_side_for_fp8_weight_grad(const Call& call, const KGroupedGemmArgs& args,
                                                   const RoutingBuffers& routing, bool side_is_a, const Fp8Rows& rows,
                                                   const Fp8ExpertCols& cols);

// `rows` rows of `in` (the call's element type, row stride cols) into `out`.
megamoe_status_t quantize_rows(const Call& call, const void* in, int64_t rows, const Fp8Rows& out);
// x's rows quantized into sorted-row order (MEGAMOE_FP8_SORTED_X=1): routing slot s's token row s / topk into out's
// row routing.slot_to_row[s] ([S, H]; dropped slots write nothing).
megamoe_status_t quantize_rows_sorted(const Call& call, const void* x, const RoutingBuffers& routing,
                                      const Fp8Rows& out);

// The up GEMM (args: up_gemm_args', or with a_gather_slots NULL and num_a_rows S when x is in sorted-row order) with x
// quantized: h = [g, u] into h, a into act (element type) and, when act_q is given, a quantized in the epilogue into it
// (the down GEMM's operand); h and act may be NULL. a_tma: sorted x read by TMA (the quantizing epilogue only).
megamoe_status_t launch_fp8_up(const Call& call, const MGroupedGemmArgs& args, const Fp8Rows& x, void* h, void* act,
                               const Fp8Rows* act_q, int num_sms, bool a_tma = false);
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
