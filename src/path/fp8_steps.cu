// The FP8_BLOCKWISE steps (fp8_steps.h): the 16-bit GEMM arguments with the FP8 operands and their scales swapped in.
#include "path/fp8_steps.h"

#include <algorithm>

#include "path/cuda_path.h"
#include "path/cuda_path_common.h"
#include "portable/fp8_quant.h"
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

megamoe_status_t launch_fp8_up(const Call& call, const MGroupedGemmArgs& args, const Fp8Rows& x, void* h, void* act,
                               const Fp8Rows* act_q, int num_sms) {
    const MGroupedGemmArgs up = with_fp8_operands(args, x, call.fp8->w13.data, 2 * args.n);
    const sm90::Fp8BlockScales scales{x.scales, groups(x.cols), static_cast<const float*>(call.fp8->w13_scales.data)};
    if (act_q == nullptr) {
        return sm90::launch_m_grouped_fp8_gemm_sm90_gated(up, scales, h, act, num_sms, call.stream);
    }
    const sm90::Fp8QuantizedAct quantized{act_q->q, act_q->scales, false};
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
