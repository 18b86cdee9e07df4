// The CUDA path's backward (cuda_path.cu's opening block): routing, h kept or recomputed, dH with the dSwiGLU
// epilogue, d topk_weights, dW2, dX and its gather-sum, dW13 and the bias gradients, on the fused sm_90a kernels
// where the call suits them, else the portable ones; the workspace plan (BackwardPlan), the path queries and the entry
// points of megamoe_backward and megamoe_grouped_backward.
#include <algorithm>
#include <string>

#include "path/cuda_path.h"
#include "path/cuda_path_common.h"
#include "path/call.h"
#include "device/cuda_utils.h"
#include "portable/elementwise.h"
#include "portable/grouped_gemm.h"
#include "portable/layout_rows.h"
#include "path/layout_steps.h"
#include "portable/routing.h"
#include "path/sm90_args.h"
#include "path/fp8_steps.h"
#include "dtype.h"
#include "sm90/k_grouped_gemm_sm90.h"
#include "sm90/m_grouped_gemm_sm90.h"

namespace megamoe::cuda {
namespace {

struct BackwardWorkspace {
    RoutingBuffers routing;
    uint16_t* h;      // [S, 2I] element type: [g, u], then [dg, du]; keep-h mode: saved_h itself (not carved)
    uint16_t* dh;     // [S, 2I]: h itself, but on the sm_90a path with interleaved dh its own buffer
    uint16_t* act;    // [S, I] element type: s * a (sm_90a path: [S, max(I, H)], later q [S, H] over it)
    float* ds_parts;  // [S, up to num_ds_parts]: partial sums of ds per row (sm_90a: one per n-tile of I, the dH
                      // launch says how many)
    int64_t num_ds_parts;
    // Portable path: [S, max(I, H)] f32, p [S, I] of the dH GEMM (read together with h by the row kernel that writes
    // s * a, so it cannot share act's buffer), later q [S, H] of the dX GEMM; NULL on the sm_90a path (p stays in
    // registers).
    float* p_then_q_f32;
    // sm_90a path: q [S, H] of the dX GEMM in the element type, over act (dW2, the only reader of s * a, runs before
    // dX); NULL on the portable path.
    uint16_t* q_elem;
    int* k_schedule;  // sm_90a path: the K-grouped kernel's tile schedule scratch (k_grouped_schedule_ints), else NULL
    // FP8_BLOCKWISE: dy [rows of dy, H] along H (dH's A), dh [S, 2I] along 2I (dX's A), x [rows of x, H] along H when h
    // is recomputed (the up GEMM's A); else empty.
    Fp8Rows dy_fp8;
    Fp8Rows dh_fp8;
    Fp8Rows x_fp8;

    // act_scratch: on the sm_90a path, the dw13 output when it can hold act (dw13_as_act_scratch), else NULL (carved).
    // dh_apart: dh gets its own buffer (the sm_90a dSwiGLU epilogue's interleaved dh cannot go over h).
    static BackwardWorkspace carve(WorkspaceCarver& carver, const RoutingPlan& plan, const Shape& shape, bool sm90,
                                   void* saved_h, void* act_scratch, bool dh_apart = false) {
        BackwardWorkspace workspace;
        const int64_t num_slots = shape.num_slots();
        workspace.routing = RoutingBuffers::carve(carver, plan);
        const int64_t max_cols = std::max(shape.intermediate, shape.hidden);
        workspace.h = saved_h != nullptr ? static_cast<uint16_t*>(saved_h)
                                         : carver.take<uint16_t>(num_slots * 2 * shape.intermediate);
        workspace.dh = dh_apart ? carver.take<uint16_t>(num_slots * 2 * shape.intermediate) : workspace.h;
        workspace.act = act_scratch != nullptr
                            ? static_cast<uint16_t*>(act_scratch)
                            : carver.take<uint16_t>(num_slots * (sm90 ? max_cols : shape.intermediate));
        workspace.num_ds_parts = sm90::dswiglu_sm90_max_ds_parts(shape.intermediate);
        workspace.ds_parts = carver.take<float>(num_slots * workspace.num_ds_parts);
        workspace.p_then_q_f32 = sm90 ? nullptr : carver.take<float>(num_slots * max_cols);
        workspace.q_elem = sm90 ? workspace.act : nullptr;
        workspace.k_schedule = sm90 ? carver.take<int>(k_grouped_schedule_ints(shape.num_experts)) : nullptr;
        return workspace;
    }

    // dy and dh quantized for dH and dX (the workspace's carver, or the dw13 output's: fp8_operands_in_dw13).
    void carve_fp8_operands(WorkspaceCarver& carver, const BackwardCall& call) {
        const Shape& shape = call.shape;
        dy_fp8 = Fp8Rows::carve(carver, shape.num_tokens, shape.hidden);
        dh_fp8 = Fp8Rows::carve(carver, shape.num_slots(), 2 * shape.intermediate);
    }

    // The other FP8 buffers of an FP8_BLOCKWISE call, after the rest.
    void carve_fp8(WorkspaceCarver& carver, const BackwardCall& call) {
        if (call.saved_h == nullptr) x_fp8 = Fp8Rows::carve(carver, call.shape.num_tokens, call.shape.hidden);
    }
};

// The GEMMs of the backward: M-grouped up (recomputed, h = [g, u]), dH (dy gathered x w2[e] read [K = H, N = I])
// and dX (dh x w13[e] read [K = 2I, N = H]); K-grouped dW13 (dh, x gathered) and dW2 (dy gathered, s * a).
struct BackwardGemms {
    MGroupedGemmArgs up;
    MGroupedGemmArgs d_hidden;
    MGroupedGemmArgs d_input;
    KGroupedGemmArgs dw13;
    KGroupedGemmArgs dw2;
    MGroupedGemmArgs sm90_up;  // the M-grouped GEMMs in the weights' layout (path/sm90_args.h)
    MGroupedGemmArgs sm90_d_hidden;
    MGroupedGemmArgs sm90_d_input;
    KGroupedGemmArgs sm90_dw2;  // the K-grouped one, operands swapped for a transposed w2 (dW13: sm90_dw13_args)
    const void* dw2_out;        // NULL: not wanted
    bool options_ok;            // the sm_90a kernels take the call's expert options

    static BackwardGemms make(const BackwardCall& call, const RoutingPlan& plan, const BackwardWorkspace& workspace) {
        const Shape& shape = call.shape;
        BackwardGemms gemms;
        gemms.up = up_gemm_args(call.dtype, call.x, call.w13, plan, workspace.routing, shape);
        gemms.d_hidden = gemms.up;
        gemms.d_hidden.a = call.dy;
        gemms.d_hidden.b = call.w2;
        gemms.d_hidden.b_expert_stride = shape.hidden * shape.intermediate;
        gemms.d_hidden.ldb = shape.intermediate;
        gemms.d_hidden.n = shape.intermediate;
        gemms.d_hidden.k = shape.hidden;
        gemms.d_input = gemms.up;
        gemms.d_input.a = workspace.dh;
        gemms.d_input.lda = 2 * shape.intermediate;
        gemms.d_input.a_gather_slots = nullptr;
        gemms.d_input.num_a_rows = shape.num_slots();
        gemms.d_input.n = shape.hidden;
        gemms.d_input.k = 2 * shape.intermediate;

        KGroupedGemmArgs weight_grad{};
        weight_grad.dtype = call.dtype;
        weight_grad.topk = shape.topk;
        weight_grad.expert_offsets = workspace.routing.expert_offsets;
        weight_grad.num_experts = shape.num_experts;
        weight_grad.schedule = workspace.k_schedule;
        weight_grad.accumulate = call.accumulate_weight_grads;
        gemms.dw13 = weight_grad;
        gemms.dw13.a = workspace.dh;
        gemms.dw13.lda = 2 * shape.intermediate;
        gemms.dw13.b = call.x;
        gemms.dw13.ldb = shape.hidden;
        gemms.dw13.b_gather_slots = workspace.routing.sorted_slot;
        gemms.dw13.m = 2 * shape.intermediate;
        gemms.dw13.n = shape.hidden;
        gemms.dw2 = weight_grad;
        gemms.dw2.a = call.dy;
        gemms.dw2.lda = shape.hidden;
        gemms.dw2.a_gather_slots = workspace.routing.sorted_slot;
        gemms.dw2.b = workspace.act;
        gemms.dw2.ldb = shape.intermediate;
        gemms.dw2.m = shape.hidden;
        gemms.dw2.n = shape.intermediate;
        gemms.dw2_out = call.dw2.data;
        gemms.sm90_up = sm90_up_args(call, gemms.up);
        gemms.sm90_d_hidden = sm90_w2_args(call, gemms.d_hidden);
        gemms.sm90_d_input = sm90_d_input_args(call, gemms.d_input);
        gemms.sm90_dw2 = call.layout.w2_transposed ? swapped_operands(gemms.dw2) : gemms.dw2;
        gemms.options_ok = sm90_options_ok(call);
        return gemms;
    }

    bool sm90_ok(int device_index) const { return options_ok && sm90_hardware_ok(device_index); }

    // The device, dtype and alignment suit the sm_90a kernels (the expert options aside).
    bool sm90_hardware_ok(int device_index) const {
        return sm90_device_ok(device_index) && sm90::m_grouped_gemm_sm90_supported(sm90_up, true) &&
               sm90::m_grouped_gemm_sm90_supported(sm90_d_hidden, false) &&
               sm90::m_grouped_gemm_sm90_supported(sm90_d_input, false);
    }

    // The weight gradients on the sm_90a K-grouped kernel: opted into, and the M-grouped GEMMs on sm_90a too.
    bool weight_grads_sm90_ok(const BackwardCall& call) const {
        return !test_override(MEGAMOE_TEST_PORTABLE_WEIGHT_GRADS) && sm90_ok(call.device_index) &&
               sm90_dw13_ok(call, dw13) &&
               (dw2_out == nullptr || sm90::k_grouped_gemm_sm90_supported(sm90_dw2, dw2_out));
    }
};

// A weight gradient (K-grouped GEMM) on the sm_90a kernel (the portable one: layout_steps.h).
megamoe_status_t launch_weight_grad_sm90(const KGroupedGemmArgs& args, const megamoe_tensor_t& grad, int num_sms,
                                         cudaStream_t stream) {
    return sm90::launch_k_grouped_gemm_sm90(args, grad.data, grad.dtype, num_sms, stream);
}

// The sm_90a backward's act buffer (s * a [S, I], then q [S, H], element type) inside the dw13 output, when the call
// asks for dw13 without accumulation and it is large and aligned enough: dw13 is written only by the last GEMM, after
// dW2 (the reader of s * a) and dx's gather-sum (the reader of q), so it is free scratch until then, and the backward's
// activation memory loses its largest buffer but h (S x max(I, H) elements: 0.44 GiB at mixtral-8x7b). NULL otherwise.
// Bytes of the sm_90a backward's act buffer, [S, max(I, H)] in the element type, and of the dw13 output.
size_t act_bytes(const Shape& shape) {
    return static_cast<size_t>(shape.num_slots()) * static_cast<size_t>(std::max(shape.intermediate, shape.hidden)) *
           sizeof(uint16_t);
}
size_t dw13_bytes(const BackwardCall& call) {
    return static_cast<size_t>(numel(call.dw13)) * output_element_bytes(call.dw13.dtype);
}

void* dw13_as_act_scratch(const BackwardCall& call) {
    if (call.dw13.data == nullptr || call.accumulate_weight_grads) return nullptr;
    const bool aligned = reinterpret_cast<uintptr_t>(call.dw13.data) % kWorkspaceAlignment == 0;
    return dw13_bytes(call) >= act_bytes(call.shape) && aligned ? call.dw13.data : nullptr;
}

// Where the FP8 backward's quantized dy and dh go: the dw13 output past act ([S, max(I, H)]: s a, then q) when act is
// there and both fit: their readers, dH and dX, run before dW13 writes dw13, and neither overlaps act (dH writes s a
// while reading dy's copy; dX writes q while reading dh's). NULL otherwise (the workspace; also under the test override
// MEGAMOE_TEST_FP8_OPERANDS_IN_WORKSPACE).
void* fp8_operands_in_dw13(const BackwardCall& call, void* act_scratch) {
    if (call.fp8 == nullptr || act_scratch == nullptr || test_override(MEGAMOE_TEST_FP8_OPERANDS_IN_WORKSPACE)) {
        return nullptr;
    }
    const size_t offset = align_up(act_bytes(call.shape), kWorkspaceAlignment);
    WorkspaceCarver sizer(nullptr);
    BackwardWorkspace operands;
    operands.carve_fp8_operands(sizer, call);
    if (offset + sizer.bytes_used() > dw13_bytes(call)) return nullptr;
    return static_cast<uint8_t*>(act_scratch) + offset;
}

// The backward's workspace, GEMM arguments and kernel choices for one call. The path is chosen on the layout of the
// portable path (the larger one; every buffer starts 256-byte aligned in both layouts, and the choice depends only on
// alignment), then the workspace is laid out for it. The workspace size query runs the same function, and the call
// checks the workspace it gets against it again (a test override changed in between gives WORKSPACE_TOO_SMALL, never
// an overrun).
struct BackwardPlan {
    RoutingPlan routing_plan;
    BackwardWorkspace workspace;
    BackwardGemms gemms;
    bool use_sm90;
    bool weight_grads_sm90;
    bool act_in_dw13;              // sm_90a: act is the dw13 output (dw13_as_act_scratch), not carved
    bool sm90_blocked_by_options;  // the sm_90a kernels would run the call but for its expert options
    size_t workspace_bytes;

    static BackwardPlan make(const BackwardCall& call) {
        const Shape& shape = call.shape;
        BackwardPlan plan;
        plan.routing_plan = make_routing_plan(call);
        WorkspaceCarver portable_carver(call.workspace);
        plan.workspace =
            BackwardWorkspace::carve(portable_carver, plan.routing_plan, shape, false, call.saved_h, nullptr);
        plan.gemms = BackwardGemms::make(call, plan.routing_plan, plan.workspace);
        // FP8_BLOCKWISE: the sm_90a kernels or nothing (its device checked with the arguments).
        plan.use_sm90 = shape.num_slots() > 0 && (call.fp8 != nullptr || plan.gemms.sm90_ok(call.device_index));
        plan.weight_grads_sm90 = plan.use_sm90 && plan.gemms.weight_grads_sm90_ok(call);
        plan.sm90_blocked_by_options =
            shape.num_slots() > 0 && !sm90_options_ok(call) && plan.gemms.sm90_hardware_ok(call.device_index);
        plan.workspace_bytes = portable_carver.bytes_used();
        plan.act_in_dw13 = false;
        if (plan.use_sm90) {
            WorkspaceCarver carver(call.workspace);
            void* act_scratch = dw13_as_act_scratch(call);
            plan.act_in_dw13 = act_scratch != nullptr;
            const bool dh_apart = call.layout.gate_up == MEGAMOE_GATE_UP_INTERLEAVED;
            plan.workspace = BackwardWorkspace::carve(carver, plan.routing_plan, shape, true, call.saved_h, act_scratch,
                                                      dh_apart);
            if (call.fp8 != nullptr) {
                void* operands_in_dw13 = fp8_operands_in_dw13(call, act_scratch);
                WorkspaceCarver dw13_carver(operands_in_dw13);
                plan.workspace.carve_fp8_operands(operands_in_dw13 != nullptr ? dw13_carver : carver, call);
                plan.workspace.carve_fp8(carver, call);
            }
            plan.gemms = BackwardGemms::make(call, plan.routing_plan, plan.workspace);
            plan.workspace_bytes = carver.bytes_used();
        }
        return plan;
    }
};

// Grouped rows whose counts the routing found invalid (counts_invalid set on the device): the weight gradients,
// computed from the clamped rows, become NaN. The whole layer has no such flag (bad ids only drop their slots).
megamoe_status_t poison_weight_grads_if_counts_invalid(const BackwardCall& call, const RoutingBuffers& routing) {
    if (routing.counts_invalid == nullptr) return MEGAMOE_STATUS_SUCCESS;
    for (const megamoe_tensor_t* grad : {&call.dw13, &call.dw3, &call.dw2, &call.db13, &call.db2}) {
        MEGAMOE_CUDA_RETURN_IF_ERROR(
            launch_fill_nan_if(routing.counts_invalid, grad->data, grad->dtype, numel(*grad), call.stream));
    }
    return MEGAMOE_STATUS_SUCCESS;
}

megamoe_status_t backward_on_device(const BackwardCall& call) {
    const Shape& shape = call.shape;
    const cudaStream_t stream = call.stream;
    const megamoe_dtype_t dtype = call.dtype;
    const int64_t num_slots = shape.num_slots(), hidden = shape.hidden, intermediate = shape.intermediate;
    const BackwardPlan backward_plan = BackwardPlan::make(call);
    const BackwardWorkspace& workspace = backward_plan.workspace;
    const RoutingBuffers& routing = workspace.routing;
    if (num_slots == 0) {  // no rows at all: every gradient is zero (or empty); accumulated ones stay as they are
        MEGAMOE_CUDA_RETURN_IF_ERROR(
            zero_if_wanted(call.dx, output_element_bytes(call.dx.dtype), stream, "cudaMemsetAsync(dx)"));
        if (!call.accumulate_weight_grads) {
            for (const megamoe_tensor_t* grad : {&call.dw13, &call.dw3, &call.dw2, &call.db13, &call.db2}) {
                MEGAMOE_CUDA_RETURN_IF_ERROR(
                    zero_if_wanted(*grad, output_element_bytes(grad->dtype), stream, "cudaMemsetAsync(weight grad)"));
            }
        }
        if (!call.rows_sorted) return MEGAMOE_STATUS_SUCCESS;  // the sort needs slots; grouped counts are still read
        MEGAMOE_CUDA_RETURN_IF_ERROR(
            launch_routing(call.experts, call.experts_dtype, backward_plan.routing_plan, routing, stream));
        return poison_weight_grads_if_counts_invalid(call, routing);
    }
    const BackwardGemms& gemms = backward_plan.gemms;
    const bool use_sm90 = backward_plan.use_sm90;
    const bool weight_grads_sm90 = backward_plan.weight_grads_sm90;

    MEGAMOE_CUDA_RETURN_IF_ERROR(
        launch_routing(call.experts, call.experts_dtype, backward_plan.routing_plan, routing, stream));

    const int num_sms = use_sm90 ? device_info(call.device_index).num_sms : 0;
    // h = [g, u] by sorted row in workspace.h: kept by the forward (saved_h), or recomputed here; dh goes over it.
    const bool keep_h = call.saved_h != nullptr;
    const void* h = workspace.h;
    if (!keep_h && call.fp8 != nullptr) {
        MEGAMOE_CUDA_RETURN_IF_ERROR(quantize_rows(call, call.x, shape.num_tokens, workspace.x_fp8));
        MEGAMOE_CUDA_RETURN_IF_ERROR(
            launch_fp8_up(call, gemms.up, workspace.x_fp8, workspace.h, nullptr, nullptr, num_sms));
    } else if (!keep_h && use_sm90) {
        MEGAMOE_CUDA_RETURN_IF_ERROR(sm90::launch_m_grouped_gemm_sm90_gated(gemms.sm90_up, workspace.h, nullptr,
                                                                            num_sms, stream, sm90_gated_args(call)));
    } else if (!keep_h) {
        MEGAMOE_CUDA_RETURN_IF_ERROR(launch_up(call, gemms.up, workspace.h, nullptr, stream));
    }

    int64_t num_ds_parts = 1;
    if (use_sm90) {  // p = dy gathered x w2[e] stays in registers: dh, s * a and ds parts from the epilogue
        sm90::DSwiGLUEpilogueArgs epilogue{};
        epilogue.h = h;
        epilogue.dh = workspace.dh;
        epilogue.act = workspace.act;
        epilogue.ds_parts = workspace.ds_parts;
        epilogue.weights = call.weights;
        epilogue.weights_dtype = call.weights_dtype;
        epilogue.activation = call.activation;
        epilogue.dh_interleaved = call.layout.gate_up == MEGAMOE_GATE_UP_INTERLEAVED;
        epilogue.b_layout = sm90_d_hidden_layout(call);
        if (call.fp8 != nullptr) {  // dy quantized along H, w2's transposed FP8 copy
            MEGAMOE_CUDA_RETURN_IF_ERROR(quantize_rows(call, call.dy, shape.num_tokens, workspace.dy_fp8));
            MEGAMOE_CUDA_RETURN_IF_ERROR(
                launch_fp8_d_hidden(call, gemms.d_hidden, workspace.dy_fp8, epilogue, num_sms, &num_ds_parts));
        } else {
            MEGAMOE_CUDA_RETURN_IF_ERROR(sm90::launch_m_grouped_gemm_sm90_dswiglu(gemms.sm90_d_hidden, epilogue,
                                                                                  num_sms, stream, &num_ds_parts));
        }
        if (call.b2 != nullptr && call.dweights.data != nullptr) {  // ds's bias term <dy, b2[e]>, on the first part
            BiasDotArgs bias_dot{};
            bias_dot.dtype = dtype;
            bias_dot.dy = call.dy;
            bias_dot.b2 = call.b2;
            bias_dot.sorted_slot = routing.sorted_slot;
            bias_dot.expert_offsets = routing.expert_offsets;
            bias_dot.num_experts = shape.num_experts;
            bias_dot.topk = shape.topk;
            bias_dot.hidden = hidden;
            bias_dot.ds_parts = workspace.ds_parts;
            bias_dot.num_ds_parts = num_ds_parts;
            bias_dot.max_rows = num_slots;
            MEGAMOE_CUDA_RETURN_IF_ERROR(launch_bias_dot_rows(bias_dot, stream));
        }
    } else {
        MEGAMOE_CUDA_RETURN_IF_ERROR(launch_d_hidden(call, gemms.d_hidden, workspace.p_then_q_f32, stream));
        DSwiGLUArgs dswiglu{};
        dswiglu.dtype = dtype;
        dswiglu.h = h;
        dswiglu.dh = workspace.h;
        dswiglu.p = workspace.p_then_q_f32;
        dswiglu.act = workspace.act;
        dswiglu.ds_rows = workspace.ds_parts;
        dswiglu.sorted_slot = routing.sorted_slot;
        dswiglu.expert_offsets = routing.expert_offsets;
        dswiglu.num_experts = shape.num_experts;
        dswiglu.weights = call.weights;
        dswiglu.weights_dtype = call.weights_dtype;
        dswiglu.intermediate = intermediate;
        dswiglu.max_rows = num_slots;
        MEGAMOE_CUDA_RETURN_IF_ERROR(launch_d_act(call, dswiglu, stream));
    }

    if (call.dweights.data != nullptr) {
        FinalizeDTopkArgs finalize{};
        finalize.ds_parts = workspace.ds_parts;
        finalize.num_ds_parts = num_ds_parts;
        finalize.slot_to_row = routing.slot_to_row;
        finalize.token_invalid = routing.token_invalid;
        finalize.num_slots = num_slots;
        finalize.topk = shape.topk;
        finalize.dtopk_weights = call.dweights.data;
        finalize.dtopk_dtype = call.dweights.dtype;
        MEGAMOE_CUDA_RETURN_IF_ERROR(launch_finalize_dtopk(finalize, stream));
    }

    // dW2 first: on the sm_90a path q is written over s * a, which only dW2 reads.
    if (call.dw2.data != nullptr) {  // dW2[e] = sum dy (s a)^T
        MEGAMOE_CUDA_RETURN_IF_ERROR(weight_grads_sm90
                                         ? launch_weight_grad_sm90(gemms.sm90_dw2, call.dw2, num_sms, stream)
                                         : launch_dw2(call, gemms.dw2, stream));
    }

    if (call.dx.data != nullptr) {
        // q = dh x w13[e]; then dx_t = sum_j q[row of (t, j)].
        if (call.fp8 != nullptr) {  // dh quantized along 2I, w13's transposed FP8 copy
            MEGAMOE_CUDA_RETURN_IF_ERROR(quantize_rows(call, workspace.dh, num_slots, workspace.dh_fp8));
            MEGAMOE_CUDA_RETURN_IF_ERROR(
                launch_fp8_d_input(call, gemms.d_input, workspace.dh_fp8, workspace.q_elem, num_sms));
        } else if (use_sm90) {
            MEGAMOE_CUDA_RETURN_IF_ERROR(sm90::launch_m_grouped_gemm_sm90_store(
                gemms.sm90_d_input, sm90_d_input_layout(call), workspace.q_elem, hidden, num_slots, num_sms, stream));
        } else {
            MEGAMOE_CUDA_RETURN_IF_ERROR(launch_d_input(call, gemms.d_input, workspace.p_then_q_f32, stream));
        }
        GatherSumArgs gather{};
        gather.out_dtype = dtype;
        gather.rows = use_sm90 ? static_cast<const void*>(workspace.q_elem) : workspace.p_then_q_f32;
        gather.rows_dtype = use_sm90 ? dtype : MEGAMOE_DTYPE_F32;
        gather.slot_to_row = routing.slot_to_row;
        gather.weights = nullptr;
        gather.token_invalid = routing.token_invalid;
        gather.num_tokens = shape.num_tokens;
        gather.topk = shape.topk;
        gather.num_cols = hidden;
        gather.out = call.dx.data;
        MEGAMOE_CUDA_RETURN_IF_ERROR(launch_gather_sum(gather, stream));
    }

    if (call.dw13.data != nullptr || call.dw3.data != nullptr) {  // dW13[e] = sum dh x^T
        MEGAMOE_CUDA_RETURN_IF_ERROR(weight_grads_sm90 ? launch_sm90_dw13(call, gemms.dw13, num_sms, stream)
                                                       : launch_dw13(call, gemms.dw13, stream));
    }
    MEGAMOE_CUDA_RETURN_IF_ERROR(launch_bias_grads(call, routing, workspace.dh, stream));
    return poison_weight_grads_if_counts_invalid(call, routing);
}

megamoe_path_t backward_path(const BackwardCall& call, std::string* reason) {
    const BackwardPlan plan = BackwardPlan::make(call);
    reason->clear();
    if (call.fp8 != nullptr) return MEGAMOE_PATH_SM90_FP8;  // the weight gradients in 16 bits
    if (plan.sm90_blocked_by_options) *reason = blocked_reason(call);
    if (!plan.use_sm90) return MEGAMOE_PATH_CUDA_PORTABLE;
    return plan.weight_grads_sm90 ? MEGAMOE_PATH_SM90 : MEGAMOE_PATH_SM90_PORTABLE_WEIGHT_GRADS;
}

megamoe_status_t run_backward(const BackwardCall& call) {
    const DeviceGuard guard(call.device_index);
    MEGAMOE_CUDA_RETURN_IF_ERROR(guard.status());
    return backward_on_device(call);
}

}  // namespace

size_t workspace_size(const megamoe_backward_params_t& params, const Shape& shape) {
    return BackwardPlan::make(backward_call(params, shape)).workspace_bytes;
}
size_t workspace_size(const megamoe_grouped_backward_params_t& params, const Shape& shape) {
    return BackwardPlan::make(backward_call(params, shape)).workspace_bytes;
}
megamoe_status_t run(const megamoe_backward_params_t& params, const Shape& shape) {
    return run_backward(backward_call(params, shape));
}
megamoe_status_t run(const megamoe_grouped_backward_params_t& params, const Shape& shape) {
    return run_backward(backward_call(params, shape));
}
bool backward_uses_sm90(const megamoe_backward_params_t& params, const Shape& shape) {
    return BackwardPlan::make(backward_call(params, shape)).use_sm90;
}
bool backward_uses_sm90(const megamoe_grouped_backward_params_t& params, const Shape& shape) {
    return BackwardPlan::make(backward_call(params, shape)).use_sm90;
}
bool backward_weight_grads_use_sm90(const megamoe_backward_params_t& params, const Shape& shape) {
    return BackwardPlan::make(backward_call(params, shape)).weight_grads_sm90;
}
bool backward_weight_grads_use_sm90(const megamoe_grouped_backward_params_t& params, const Shape& shape) {
    return BackwardPlan::make(backward_call(params, shape)).weight_grads_sm90;
}
bool backward_act_in_dw13(const megamoe_backward_params_t& params, const Shape& shape) {
    return BackwardPlan::make(backward_call(params, shape)).act_in_dw13;
}
megamoe_path_t path(const megamoe_backward_params_t& params, const Shape& shape, std::string* reason) {
    return backward_path(backward_call(params, shape), reason);
}
megamoe_path_t path(const megamoe_grouped_backward_params_t& params, const Shape& shape, std::string* reason) {
    return backward_path(backward_call(params, shape), reason);
}

}  // namespace megamoe::cuda
