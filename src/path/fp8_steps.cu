// The FP8_BLOCKWISE steps (fp8_steps.h): the 16-bit GEMM arguments with the FP8 operands and their scales swapped in.
#include "path/fp8_steps.h"

#include <algorithm>

#include "path/cuda_path.h"
#include "path/cuda_path_common.h"
#include "portable/fp8_quant.h"
#include "sm90/k_grouped_fp8_gemm_sm90.h"
#include "sm90/m_grouped_fp8_gemm_sm90.h"

namespace megamoe::cuda {
namespace {

int64_t groups(int64_t cols) {
    return ceil_div(cols, int64_t{kFp8GroupSize});
}

// args with A = `a` (e4m3, row stride = its K) and B = `b` (e4m3, [n_b, K] per expert, K contiguous; n_b = 2N for
// the gated up GEMM).
MGroupedGemmArgs with_fp8_operands(MGroupedGemmArgs args, const Fp8Rows& a, const void* b, int64_t n_b) {
    args.a = a.q;
    args.lda = args.k;
    args.b = b;
    args.b_expert_stride = n_b * args.k;
    args.ldb = args.k;
    return args;
}

}  // namespace

Fp8Rows Fp8Rows::carve(WorkspaceCarver& carver, int64_t rows, int64_t cols) {
    Fp8Rows out;
    out.q = carver.take<uint8_t>(rows * cols);
    out.scales = carver.take<float>(rows * groups(cols));
    out.cols = cols;
    return out;
}

Fp8ExpertCols Fp8ExpertCols::carve(WorkspaceCarver& carver, int64_t cols, int64_t max_tiles) {
    Fp8ExpertCols out;
    out.cols = cols;
    out.max_tiles = max_tiles;
    out.ld = kFp8GroupSize * max_tiles;
    out.ld_scales = ceil_div(cols, int64_t{4}) * 4;  // 16-byte rows of scales
    out.q_t = carver.take<uint8_t>(cols * out.ld);
    out.scales = carver.take<float>(std::max<int64_t>(max_tiles, 1) * out.ld_scales);
    return out;
}

namespace {

// The K-grouped FP8 GEMM's view of quantized columns: the first `cols` of `operand`.
sm90::KGroupedFp8Operand fp8_operand(const Fp8ExpertCols& operand) {
    return {operand.q_t, operand.ld, operand.scales, operand.ld_scales};
}

sm90::KGroupedFp8GemmArgs fp8_weight_grad_args(const KGroupedGemmArgs& args, const int* m_tile_offsets,
                                               const Fp8ExpertCols& a, const Fp8ExpertCols& b) {
    sm90::KGroupedFp8GemmArgs fp8{};
    fp8.a = fp8_operand(a);
    fp8.b = fp8_operand(b);
    fp8.m = args.m;
    fp8.n = args.n;
    fp8.m_tile_offsets = m_tile_offsets;
    fp8.num_experts = args.num_experts;
    fp8.max_tiles = a.max_tiles;
    fp8.accumulate = args.accumulate;
    return fp8;
}

// One side of a 16-bit weight gradient (`args`' A where side_is_a, else its B: rows of M or N values, gathered by slot
// or not) quantized along the expert rows into `out`, and, where `rows` is given, its source rows along the columns
// into it in the same pass (each routed row once).
megamoe_status_t quantize_expert_cols(const Call& call, const RoutingBuffers& routing, const KGroupedGemmArgs& args,
                                      bool side_is_a, const Fp8ExpertCols& out, const Fp8Rows* rows = nullptr) {
    QuantizeExpertRowsArgs quantize{};
    quantize.in = side_is_a ? args.a : args.b;
    quantize.in_dtype = call.dtype;
    quantize.cols = side_is_a ? args.m : args.n;
    quantize.in_row_stride = side_is_a ? args.lda : args.ldb;
    quantize.sorted_slot = side_is_a ? args.a_gather_slots : args.b_gather_slots;
    quantize.topk = std::max<int64_t>(args.topk, 1);
    quantize.expert_offsets = args.expert_offsets;
    quantize.m_tile_offsets = routing.m_tile_offsets;
    quantize.num_experts = args.num_experts;
    quantize.max_tiles = out.max_tiles;
    quantize.q_t = out.q_t;
    quantize.ld_q = out.ld;
    quantize.scales = out.scales;
    quantize.ld_scales = out.ld_scales;
    quantize.pow2 = false;
    if (rows != nullptr) {
        quantize.row_q = rows->q;
        quantize.row_scales = rows->scales;
        quantize.slot_to_row = routing.slot_to_row;
    }
    return launch_quantize_expert_rows(quantize, call.stream);
}

}  // namespace

bool fp8_weight_grad_ok(const KGroupedGemmArgs& args, const RoutingBuffers& routing, const megamoe_tensor_t& grad,
                        const Fp8ExpertCols& a, const Fp8ExpertCols& b) {
    if (a.q_t == nullptr || b.q_t == nullptr || args.m > a.cols || args.n > b.cols) return false;
    return sm90::k_grouped_fp8_gemm_sm90_supported(fp8_weight_grad_args(args, routing.m_tile_offsets, a, b), grad.data,
                                                   grad.dtype);
}

megamoe_status_t quantize_side_for_fp8_weight_grad(const Call& call, const KGroupedGemmArgs& args,
                                                   const RoutingBuffers& routing, bool side_is_a, const Fp8Rows& rows,
                                                   const Fp8ExpertCols& cols) {
    return quantize_expert_cols(call, routing, args, side_is_a, cols, &rows);
}

megamoe_status_t launch_fp8_weight_grad(const Call& call, const KGroupedGemmArgs& args, const RoutingBuffers& routing,
                                        const megamoe_tensor_t& grad, const Fp8ExpertCols& a, const Fp8ExpertCols& b,
                                        int num_sms, bool a_quantized, bool b_quantized) {
    if (!a_quantized) MEGAMOE_CUDA_RETURN_IF_ERROR(quantize_expert_cols(call, routing, args, true, a));
    if (!b_quantized) MEGAMOE_CUDA_RETURN_IF_ERROR(quantize_expert_cols(call, routing, args, false, b));
    return sm90::launch_k_grouped_fp8_gemm_sm90(fp8_weight_grad_args(args, routing.m_tile_offsets, a, b), grad.data,
                                                grad.dtype, num_sms, call.stream);
}

megamoe_status_t check_fp8_device(int device_index) {
    if (sm90_device_ok(device_index)) return MEGAMOE_STATUS_SUCCESS;
    const DeviceInfo info = device_info(device_index);
    return set_error(MEGAMOE_STATUS_NOT_SUPPORTED,
                     "precision: FP8_BLOCKWISE runs on the sm_90a FP8 kernels only (a compute capability 9.0 GPU, "
                     "MEGAMOE_DISABLE_SM90 unset); device %d is %d.%d",
                     device_index, info.major, info.minor);
}

megamoe_status_t quantize_experts(const megamoe_tensor_t& w13, const megamoe_tensor_t& w2,
                                  const megamoe_fp8_experts_t& fp8, const Shape& shape, void* stream) {
    const DeviceGuard guard(w13.device_index);
    MEGAMOE_CUDA_RETURN_IF_ERROR(guard.status());
    const struct {
        const megamoe_tensor_t& in;
        const megamoe_tensor_t& q;
        const megamoe_tensor_t& q_t;
        const megamoe_tensor_t& scales;
        int64_t n;
        int64_t k;
    } weights[] = {{w13, fp8.w13, fp8.w13_t, fp8.w13_scales, 2 * shape.intermediate, shape.hidden},
                   {w2, fp8.w2, fp8.w2_t, fp8.w2_scales, shape.hidden, shape.intermediate}};
    for (const auto& w : weights) {
        QuantizeBlocksArgs args{};
        args.in = w.in.data;
        args.in_dtype = w.in.dtype;
        args.num_experts = shape.num_experts;
        args.n = w.n;
        args.k = w.k;
        args.q = static_cast<uint8_t*>(w.q.data);
        args.q_t = static_cast<uint8_t*>(w.q_t.data);
        args.scales = static_cast<float*>(w.scales.data);
        args.pow2 = false;
        MEGAMOE_CUDA_RETURN_IF_ERROR(launch_quantize_blocks(args, static_cast<cudaStream_t>(stream)));
    }
    return MEGAMOE_STATUS_SUCCESS;
}

namespace {
// `rows` rows of `in` (the call's element type, row stride out.cols) into `out`, the recipe's amax / 448 scales.
QuantizeGroupsArgs rows_args(const Call& call, const void* in, int64_t rows, const Fp8Rows& out) {
    QuantizeGroupsArgs args{};
    args.in = in;
    args.in_dtype = call.dtype;
    args.rows = rows;
    args.cols = out.cols;
    args.in_row_stride = out.cols;
    args.q = out.q;
    args.scales = out.scales;
    args.pow2 = false;
    return args;
}
}  // namespace

megamoe_status_t quantize_rows(const Call& call, const void* in, int64_t rows, const Fp8Rows& out) {
    return launch_quantize_groups(rows_args(call, in, rows, out), call.stream);
}

megamoe_status_t quantize_rows_sorted(const Call& call, const void* x, const RoutingBuffers& routing,
                                      const Fp8Rows& out) {
    QuantizeGroupsArgs args = rows_args(call, x, call.shape.num_slots(), out);  // one row per routing slot
    args.slot_to_row = routing.slot_to_row;
    args.topk = call.shape.topk;
    return launch_quantize_groups(args, call.stream);
}

megamoe_status_t launch_fp8_up(const Call& call, const MGroupedGemmArgs& args, const Fp8Rows& x, void* h, void* act,
                               const Fp8Rows* act_q, int num_sms, bool a_tma) {
    const MGroupedGemmArgs up = with_fp8_operands(args, x, call.fp8->w13.data, 2 * args.n);
    const sm90::Fp8BlockScales scales{x.scales, groups(x.cols), static_cast<const float*>(call.fp8->w13_scales.data)};
    if (act_q == nullptr) {
        return sm90::launch_m_grouped_fp8_gemm_sm90_gated(up, scales, h, act, num_sms, call.stream);
    }
    const sm90::Fp8QuantizedAct quantized{act_q->q, act_q->scales, false, a_tma};
    return sm90::launch_m_grouped_fp8_gemm_sm90_gated(up, scales, h, act, num_sms, call.stream, &quantized);
}

megamoe_status_t launch_fp8_down(const Call& call, const MGroupedGemmArgs& args, const Fp8Rows& act, void* out,
                                 int num_sms) {
    const MGroupedGemmArgs down = with_fp8_operands(args, act, call.fp8->w2.data, args.n);
    const sm90::Fp8BlockScales scales{act.scales, groups(act.cols),
                                      static_cast<const float*>(call.fp8->w2_scales.data)};
    return sm90::launch_m_grouped_fp8_gemm_sm90_store(down, scales, out, call.shape.hidden, call.shape.num_slots(),
                                                      num_sms, call.stream);
}

megamoe_status_t launch_fp8_d_hidden(const Call& call, const MGroupedGemmArgs& args, const Fp8Rows& dy,
                                     const sm90::DSwiGLUEpilogueArgs& epilogue, int num_sms, int64_t* num_ds_parts) {
    const MGroupedGemmArgs d_hidden = with_fp8_operands(args, dy, call.fp8->w2_t.data, args.n);  // [N = I, K = H]
    sm90::Fp8BlockScales scales{dy.scales, groups(dy.cols), static_cast<const float*>(call.fp8->w2_scales.data)};
    scales.b_transposed = true;
    return sm90::launch_m_grouped_fp8_gemm_sm90_dswiglu(d_hidden, scales, epilogue, num_sms, call.stream, num_ds_parts);
}

megamoe_status_t launch_fp8_d_input(const Call& call, const MGroupedGemmArgs& args, const Fp8Rows& dh, void* q,
                                    int num_sms) {
    const MGroupedGemmArgs d_input = with_fp8_operands(args, dh, call.fp8->w13_t.data, args.n);  // [N = H, K = 2I]
    sm90::Fp8BlockScales scales{dh.scales, groups(dh.cols), static_cast<const float*>(call.fp8->w13_scales.data)};
    scales.b_transposed = true;
    return sm90::launch_m_grouped_fp8_gemm_sm90_store(d_input, scales, q, call.shape.hidden, call.shape.num_slots(),
                                                      num_sms, call.stream);
}

}  // namespace megamoe::cuda
