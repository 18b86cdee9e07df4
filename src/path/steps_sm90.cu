// The sm90 backend (steps_sm90.h). Its backward workspace is the sm_90a layout (plan.h): p stays in registers, q is
// written in the element type over s * a (dW2, its only reader, runs before dX).
#include "path/steps_sm90.h"

#include "device/cuda_utils.h"
#include "path/cuda_path_common.h"
#include "portable/layout_rows.h"
#include "sm90/k_grouped_gemm_sm90.h"

namespace megamoe::cuda {
namespace {

// The up GEMM: x gathered, B = w13 in its layout; the separate layout's up half from w3.
MGroupedGemmArgs up_args(const Call& call, const SortedRows& rows) {
    MGroupedGemmArgs up = m_grouped_args(call, rows, token_rows(call, rows, call.x), w13_operand(call),
                                         call.shape.intermediate, call.shape.hidden);
    if (is_separate(call)) up.b_up = call.w3;
    return up;
}

// The down GEMM: a by sorted row, B = w2 in its layout.
MGroupedGemmArgs down_args(const ForwardStep& step) {
    const Shape& shape = step.call.shape;
    return m_grouped_args(step.call, step.rows, sorted_rows(step.call, step.workspace.act, shape.intermediate),
                          w2_operand(step.call), shape.hidden, shape.intermediate);
}

// dH: dy gathered, B = w2 in its layout read [K = H, N = I].
MGroupedGemmArgs d_hidden_args(const BackwardStep& step) {
    const BackwardCall& call = step.call;
    return m_grouped_args(call, step.rows, token_rows(call, step.rows, call.dy), w2_operand(call),
                          call.shape.intermediate, call.shape.hidden);
}

// dX: K = 2I over dh's [dg, du] columns, B = w13 in its layout; separate: K rows [0, I) from w1, [I, 2I) from w3 (the
// kernel's K halves).
MGroupedGemmArgs d_input_args(const BackwardStep& step) {
    const BackwardCall& call = step.call;
    const Shape& shape = call.shape;
    MGroupedGemmArgs d_input =
        m_grouped_args(call, step.rows, sorted_rows(call, step.workspace.dh, 2 * shape.intermediate), w13_operand(call),
                       shape.hidden, 2 * shape.intermediate);
    if (is_separate(call)) d_input.b_up = call.w3;
    return d_input;
}

sm90::GatedArgs gated_args(const Call& call) {
    sm90::GatedArgs gated{};
    gated.activation = call.activation;
    gated.bias = call.b13;
    gated.interleaved = is_interleaved(call);
    gated.b_layout = up_b_layout(call);
    return gated;
}

class Sm90Backend final : public Backend {
  public:
    megamoe_status_t up(const ForwardStep& step) const override {
        const ForwardCall& call = step.call;
        return sm90::launch_m_grouped_gemm_sm90_gated(up_args(call, step.rows), call.saved_h, step.workspace.act,
                                                      step.num_sms, call.stream, gated_args(call));
    }

    megamoe_status_t down(const ForwardStep& step) const override {
        const ForwardCall& call = step.call;
        return sm90::launch_m_grouped_gemm_sm90_store(down_args(step), down_b_layout(call), step.workspace.out,
                                                      call.shape.hidden, call.shape.num_slots(), step.num_sms,
                                                      call.stream, call.b2);
    }

    megamoe_status_t recompute_h(const BackwardStep& step) const override {
        const BackwardCall& call = step.call;
        return sm90::launch_m_grouped_gemm_sm90_gated(up_args(call, step.rows), step.workspace.h, nullptr, step.num_sms,
                                                      call.stream, gated_args(call));
    }

    // p = dy gathered x w2[e] stays in registers: dh, s * a and the ds parts from the epilogue.
    megamoe_status_t d_hidden(const BackwardStep& step, int64_t* num_ds_parts) const override {
        MEGAMOE_CUDA_RETURN_IF_ERROR(sm90::launch_m_grouped_gemm_sm90_dswiglu(
            d_hidden_args(step), dswiglu_epilogue(step), step.num_sms, step.call.stream, num_ds_parts));
        return add_bias_dot(step, *num_ds_parts);
    }

    // q in the element type over s * a.
    megamoe_status_t d_input(const BackwardStep& step, RowBuffer* q) const override {
        const BackwardCall& call = step.call;
        *q = {step.workspace.q_elem, call.dtype};
        return sm90::launch_m_grouped_gemm_sm90_store(d_input_args(step), d_input_b_layout(call), step.workspace.q_elem,
                                                      call.shape.hidden, call.shape.num_slots(), step.num_sms,
                                                      call.stream);
    }
};

}  // namespace

const Backend& sm90_backend() {
    static const Sm90Backend backend;
    return backend;
}

const char* sm90_options_blocker(const Call& call) {
    if (is_separate(call) && !is_aligned(call.w3, 16)) {
        return "w3 not 16-byte aligned: the fused sm_90a kernels read it by TMA, as w13";
    }
    if (!is_aligned(call.b13, 4) || !is_aligned(call.b2, 4)) {
        return "b13 / b2 not 4-byte aligned: the fused sm_90a kernels read the biases as pairs of elements";
    }
    return nullptr;
}

bool sm90_forward_hardware_ok(const ForwardStep& step) {
    return sm90_device_ok(step.call.device_index) &&
           sm90::m_grouped_gemm_sm90_supported(up_args(step.call, step.rows), true) &&
           sm90::m_grouped_gemm_sm90_supported(down_args(step), false);
}

bool sm90_backward_hardware_ok(const BackwardStep& step) {
    return sm90_device_ok(step.call.device_index) &&
           sm90::m_grouped_gemm_sm90_supported(up_args(step.call, step.rows), true) &&
           sm90::m_grouped_gemm_sm90_supported(d_hidden_args(step), false) &&
           sm90::m_grouped_gemm_sm90_supported(d_input_args(step), false);
}

bool sm90_weight_grads_ok(const BackwardStep& step) {
    const BackwardCall& call = step.call;
    for (int half = 0; half < num_dw13_outputs(call); ++half) {
        const megamoe_tensor_t& grad = dw13_output(call, half == 1);
        if (grad.data != nullptr && !sm90::k_grouped_gemm_sm90_supported(dw13_args(step, half == 1), grad.data)) {
            return false;
        }
    }
    return call.dw2.data == nullptr || sm90::k_grouped_gemm_sm90_supported(dw2_args(step), call.dw2.data);
}

sm90::DSwiGLUEpilogueArgs dswiglu_epilogue(const BackwardStep& step) {
    const BackwardCall& call = step.call;
    sm90::DSwiGLUEpilogueArgs epilogue{};
    epilogue.h = step.workspace.h;
    epilogue.dh = step.workspace.dh;
    epilogue.act = step.workspace.act;
    epilogue.ds_parts = step.workspace.ds_parts;
    epilogue.weights = call.weights;
    epilogue.weights_dtype = call.weights_dtype;
    epilogue.activation = call.activation;
    epilogue.dh_interleaved = is_interleaved(call);
    epilogue.b_layout = d_hidden_b_layout(call);
    return epilogue;
}

megamoe_status_t add_bias_dot(const BackwardStep& step, int64_t num_ds_parts) {
    const BackwardCall& call = step.call;
    if (call.b2 == nullptr || call.dweights.data == nullptr) return MEGAMOE_STATUS_SUCCESS;
    BiasDotArgs bias_dot{};
    bias_dot.dtype = call.dtype;
    bias_dot.dy = call.dy;
    bias_dot.b2 = call.b2;
    bias_dot.sorted_slot = step.rows.sorted_slot;
    bias_dot.expert_offsets = step.rows.expert_offsets;
    bias_dot.num_experts = call.shape.num_experts;
    bias_dot.topk = call.shape.topk;
    bias_dot.hidden = call.shape.hidden;
    bias_dot.ds_parts = step.workspace.ds_parts;
    bias_dot.num_ds_parts = num_ds_parts;
    bias_dot.max_rows = call.shape.num_slots();
    return launch_bias_dot_rows(bias_dot, call.stream);
}

}  // namespace megamoe::cuda
