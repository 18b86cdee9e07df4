// The sm90-FP8 backend (megamoe.h's precision FP8_BLOCKWISE; docs/DESIGN.md, FP8; the Backend: steps.h,
// fp8_backend()): the up, down, dH and dX GEMMs on the sm_90a FP8 kernels (sm90/m_grouped_fp8_gemm_sm90.h), each
// GEMM's activation operand quantized along that GEMM's K in 1 x 128 groups (x, dy and dh by a pass of
// launch_quantize_groups in the step that reads them, a in the up GEMM's epilogue), the weights the caller's
// megamoe_fp8_experts_t (w13 / w2 for the forward GEMMs, their transposed copies for dH and dX, one set of block
// scales each; a transposed copy the caller leaves absent is made from w2 / w13 by the step that reads it, into the
// workspace, by launch_transpose_bytes). The rest of the call is sm90's: its workspace layout, the dSwiGLU epilogue and
// ds's bias term (steps_sm90.h), and the shared steps, the 16-bit weight gradients included. Also here: the FP8 device
// check and megamoe_quantize_experts (cuda_path.h).
#include "device/cuda_utils.h"
#include "path/cuda_path.h"
#include "path/cuda_path_common.h"
#include "path/steps.h"
#include "path/steps_sm90.h"
#include "portable/byte_transpose.h"
#include "portable/fp8_quant.h"
#include "sm90/m_grouped_fp8_gemm_sm90.h"

namespace megamoe::cuda {
namespace {

int64_t groups(int64_t cols) {
    return ceil_div(cols, int64_t{kFp8GroupSize});
}

// `rows` rows of `in` (the call's element type, contiguous) into `out`, the recipe's amax / 448 scales (pow2 false).
megamoe_status_t quantize_rows(const Call& call, const void* in, int64_t rows, const Fp8Rows& out) {
    QuantizeGroupsArgs args{};
    args.in = in;
    args.in_dtype = call.dtype;
    args.rows = rows;
    args.cols = args.in_row_stride = out.cols;
    args.q = out.q;
    args.scales = out.scales;
    return launch_quantize_groups(args, call.stream);
}

// One quantized weight as B: [n_b, K] per expert, K contiguous (n_b = 2I for the gated up GEMM).
ExpertOperand fp8_weight(const void* weight, int64_t n_b, int64_t k) {
    return {weight, n_b * k, k};
}

// B of dH / dX, a weight's transposed copy [E, k, n]: `given` (the caller's), or, where the plan found it absent
// (`transpose`), `weight` [E, n, k] transposed into workspace.fp8_weight_t by this call, on the call's stream (dX's
// transpose goes over dH's w2_t, which dH has read by then: one stream).
megamoe_status_t transposed_weight(const BackwardStep& step, bool transpose, const megamoe_tensor_t& given,
                                   const megamoe_tensor_t& weight, int64_t n, int64_t k, const void** out) {
    if (!transpose) {
        *out = given.data;
        return MEGAMOE_STATUS_SUCCESS;
    }
    TransposeBytesArgs args{};
    args.in = static_cast<const uint8_t*>(weight.data);
    args.out = step.workspace.fp8_weight_t;
    args.batch = step.call.shape.num_experts;
    args.rows = n;
    args.cols = k;
    *out = args.out;
    return launch_transpose_bytes(args, step.call.stream);
}

// The scales of A (quantized rows) and of B (`b_scales`: the weight's, read transposed for its transposed copy).
sm90::Fp8BlockScales block_scales(const Fp8Rows& a, const megamoe_tensor_t& b_scales, bool b_transposed) {
    sm90::Fp8BlockScales scales{a.scales, groups(a.cols), static_cast<const float*>(b_scales.data)};
    scales.b_transposed = b_transposed;
    return scales;
}

// The up GEMM with x quantized (into x_fp8 first): h = [g, u] into h, and a quantized into act_q when given.
megamoe_status_t fp8_up(const Call& call, const SortedRows& rows, const Fp8Rows& x_fp8, void* h, const Fp8Rows* act_q,
                        int num_sms) {
    const Shape& shape = call.shape;
    MEGAMOE_CUDA_RETURN_IF_ERROR(quantize_rows(call, call.x, shape.num_tokens, x_fp8));
    const MGroupedGemmArgs up = m_grouped_args(call, rows, token_rows(call, rows, x_fp8.q),
                                               fp8_weight(call.fp8->w13.data, 2 * shape.intermediate, shape.hidden),
                                               shape.intermediate, shape.hidden);
    const sm90::Fp8BlockScales scales = block_scales(x_fp8, call.fp8->w13_scales, false);
    if (act_q == nullptr) {
        return sm90::launch_m_grouped_fp8_gemm_sm90_gated(up, scales, h, nullptr, num_sms, call.stream);
    }
    const sm90::Fp8QuantizedAct quantized{act_q->q, act_q->scales, false};
    return sm90::launch_m_grouped_fp8_gemm_sm90_gated(up, scales, h, nullptr, num_sms, call.stream, &quantized);
}

class Fp8Backend final : public Backend {
  public:
    // x quantized by a pass, a by the up GEMM's epilogue.
    megamoe_status_t up(const ForwardStep& step) const override {
        return fp8_up(step.call, step.rows, step.workspace.x_fp8, step.call.saved_h, &step.workspace.act_fp8,
                      step.num_sms);
    }

    megamoe_status_t down(const ForwardStep& step) const override {
        const ForwardCall& call = step.call;
        const Shape& shape = call.shape;
        const Fp8Rows& act = step.workspace.act_fp8;
        const MGroupedGemmArgs down = m_grouped_args(call, step.rows, sorted_rows(call, act.q, shape.intermediate),
                                                     fp8_weight(call.fp8->w2.data, shape.hidden, shape.intermediate),
                                                     shape.hidden, shape.intermediate);
        return sm90::launch_m_grouped_fp8_gemm_sm90_store(down, block_scales(act, call.fp8->w2_scales, false),
                                                          step.workspace.out, shape.hidden, shape.num_slots(),
                                                          step.num_sms, call.stream);
    }

    megamoe_status_t recompute_h(const BackwardStep& step) const override {
        return fp8_up(step.call, step.rows, step.workspace.x_fp8, step.workspace.h, nullptr, step.num_sms);
    }

    // dy quantized along H, B = w2's transposed FP8 copy [N = I, K = H] (made from w2 here when absent).
    megamoe_status_t d_hidden(const BackwardStep& step, int64_t* num_ds_parts) const override {
        const BackwardCall& call = step.call;
        const Shape& shape = call.shape;
        const Fp8Rows& dy = step.workspace.dy_fp8;
        const void* w2_t = nullptr;
        MEGAMOE_CUDA_RETURN_IF_ERROR(transposed_weight(step, fp8_transposes_w2(call), call.fp8->w2_t, call.fp8->w2,
                                                       shape.hidden, shape.intermediate, &w2_t));
        MEGAMOE_CUDA_RETURN_IF_ERROR(quantize_rows(call, call.dy, shape.num_tokens, dy));
        const MGroupedGemmArgs d_hidden =
            m_grouped_args(call, step.rows, token_rows(call, step.rows, dy.q),
                           fp8_weight(w2_t, shape.intermediate, shape.hidden), shape.intermediate, shape.hidden);
        MEGAMOE_CUDA_RETURN_IF_ERROR(sm90::launch_m_grouped_fp8_gemm_sm90_dswiglu(
            d_hidden, block_scales(dy, call.fp8->w2_scales, true), dswiglu_epilogue(step), step.num_sms, call.stream,
            num_ds_parts));
        return add_bias_dot(step, *num_ds_parts);
    }

    // dh quantized along 2I, B = w13's transposed FP8 copy [N = H, K = 2I] (made from w13 here when absent); q in the
    // element type over s * a.
    megamoe_status_t d_input(const BackwardStep& step, RowBuffer* q) const override {
        const BackwardCall& call = step.call;
        const Shape& shape = call.shape;
        const Fp8Rows& dh = step.workspace.dh_fp8;
        *q = {step.workspace.q_elem, call.dtype};
        MEGAMOE_CUDA_RETURN_IF_ERROR(quantize_rows(call, step.workspace.dh, shape.num_slots(), dh));
        const void* w13_t = nullptr;
        MEGAMOE_CUDA_RETURN_IF_ERROR(transposed_weight(step, fp8_transposes_w13(call), call.fp8->w13_t, call.fp8->w13,
                                                       2 * shape.intermediate, shape.hidden, &w13_t));
        const MGroupedGemmArgs d_input = m_grouped_args(
            call, step.rows, sorted_rows(call, dh.q, 2 * shape.intermediate),
            fp8_weight(w13_t, shape.hidden, 2 * shape.intermediate), shape.hidden, 2 * shape.intermediate);
        return sm90::launch_m_grouped_fp8_gemm_sm90_store(d_input, block_scales(dh, call.fp8->w13_scales, true),
                                                          step.workspace.q_elem, shape.hidden, shape.num_slots(),
                                                          step.num_sms, call.stream);
    }
};

}  // namespace

const Backend& fp8_backend() {
    static const Fp8Backend backend;
    return backend;
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

}  // namespace megamoe::cuda
