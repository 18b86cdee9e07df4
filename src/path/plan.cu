// The plans of the CUDA path's calls (plan.h): the workspace carves, the backend choice and the sm_90a backward's
// scratch in the dw13 output.
#include "path/plan.h"

#include <algorithm>

#include "dtype.h"
#include "path/cuda_path_common.h"
#include "path/steps.h"
#include "path/steps_sm90.h"
#include "portable/fp8_quant.h"
#include "sm90/m_grouped_gemm_sm90.h"
#include "test_overrides.h"

namespace megamoe::cuda {
namespace {

// Bytes of the sm_90a backward's act buffer, [S, max(I, H)] in the element type, and of the dw13 output.
size_t act_bytes(const Shape& shape) {
    return static_cast<size_t>(shape.num_slots()) * static_cast<size_t>(std::max(shape.intermediate, shape.hidden)) *
           sizeof(uint16_t);
}
size_t dw13_bytes(const BackwardCall& call) {
    return static_cast<size_t>(numel(call.dw13)) * output_element_bytes(call.dw13.dtype);
}

// The sm_90a backward's act buffer (s * a [S, I], then q [S, H], element type) inside the dw13 output, when the call
// asks for dw13 without accumulation and it is large and aligned enough: dw13 is written only by the last GEMM, after
// dW2 (the reader of s * a) and dx's gather-sum (the reader of q), so it is free scratch until then, and the backward's
// activation memory loses its largest buffer but h (S x max(I, H) elements: 0.44 GiB at mixtral-8x7b). NULL otherwise.
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

}  // namespace

Fp8Rows Fp8Rows::carve(WorkspaceCarver& carver, int64_t rows, int64_t cols) {
    Fp8Rows out;
    out.q = carver.take<uint8_t>(rows * cols);
    out.scales = carver.take<float>(rows * ceil_div(cols, int64_t{kFp8GroupSize}));
    out.cols = cols;
    return out;
}

ForwardWorkspace ForwardWorkspace::carve(WorkspaceCarver& carver, const RoutingPlan& plan, const Call& call) {
    const Shape& shape = call.shape;
    ForwardWorkspace workspace;
    const int64_t num_slots = shape.num_slots();
    workspace.routing = RoutingBuffers::carve(carver, plan);
    workspace.act = call.fp8 == nullptr ? carver.take<uint16_t>(num_slots * shape.intermediate) : nullptr;
    workspace.out = carver.take<uint16_t>(num_slots * shape.hidden);
    if (call.fp8 != nullptr) {
        workspace.x_fp8 = Fp8Rows::carve(carver, shape.num_tokens, shape.hidden);
        workspace.act_fp8 = Fp8Rows::carve(carver, num_slots, shape.intermediate);
    }
    return workspace;
}

BackwardWorkspace BackwardWorkspace::carve(WorkspaceCarver& carver, const RoutingPlan& plan, const Shape& shape,
                                           bool sm90_layout, void* saved_h, void* act_scratch, bool dh_apart) {
    BackwardWorkspace workspace;
    const int64_t num_slots = shape.num_slots();
    workspace.routing = RoutingBuffers::carve(carver, plan);
    const int64_t max_cols = std::max(shape.intermediate, shape.hidden);
    workspace.h = saved_h != nullptr ? static_cast<uint16_t*>(saved_h)
                                     : carver.take<uint16_t>(num_slots * 2 * shape.intermediate);
    workspace.dh = dh_apart ? carver.take<uint16_t>(num_slots * 2 * shape.intermediate) : workspace.h;
    workspace.act = act_scratch != nullptr
                        ? static_cast<uint16_t*>(act_scratch)
                        : carver.take<uint16_t>(num_slots * (sm90_layout ? max_cols : shape.intermediate));
    workspace.num_ds_parts = sm90::dswiglu_sm90_max_ds_parts(shape.intermediate);
    workspace.ds_parts = carver.take<float>(num_slots * workspace.num_ds_parts);
    workspace.p_then_q_f32 = sm90_layout ? nullptr : carver.take<float>(num_slots * max_cols);
    workspace.q_elem = sm90_layout ? workspace.act : nullptr;
    workspace.k_schedule = sm90_layout ? carver.take<int>(k_grouped_schedule_ints(shape.num_experts)) : nullptr;
    return workspace;
}

void BackwardWorkspace::carve_fp8_operands(WorkspaceCarver& carver, const BackwardCall& call) {
    const Shape& shape = call.shape;
    dy_fp8 = Fp8Rows::carve(carver, shape.num_tokens, shape.hidden);
    dh_fp8 = Fp8Rows::carve(carver, shape.num_slots(), 2 * shape.intermediate);
}

void BackwardWorkspace::carve_fp8(WorkspaceCarver& carver, const BackwardCall& call) {
    const Shape& shape = call.shape;
    if (call.saved_h == nullptr) x_fp8 = Fp8Rows::carve(carver, shape.num_tokens, shape.hidden);
    const int64_t w2_bytes = fp8_transposes_w2(call) ? shape.num_experts * shape.intermediate * shape.hidden : 0;
    const int64_t w13_bytes = fp8_transposes_w13(call) ? shape.num_experts * 2 * shape.intermediate * shape.hidden : 0;
    const int64_t bytes = std::max(w2_bytes, w13_bytes);
    fp8_weight_t = bytes > 0 ? carver.take<uint8_t>(bytes) : nullptr;
}

bool fp8_transposes_w2(const BackwardCall& call) {
    return call.fp8 != nullptr && !is_present(call.fp8->w2_t);
}

bool fp8_transposes_w13(const BackwardCall& call) {
    return call.fp8 != nullptr && call.dx.data != nullptr && !is_present(call.fp8->w13_t);
}

ForwardPlan ForwardPlan::make(const ForwardCall& call) {
    ForwardPlan plan;
    plan.routing_plan = make_routing_plan(call);
    WorkspaceCarver carver(call.workspace);
    plan.workspace = ForwardWorkspace::carve(carver, plan.routing_plan, call);
    const ForwardStep step{call, plan.workspace, SortedRows::of(plan.routing_plan, plan.workspace.routing), 0};
    if (call.fp8 != nullptr) {  // the sm_90a kernels or nothing (its device checked with the arguments)
        plan.backend = BackendKind::kSm90Fp8;
    } else if (call.shape.num_slots() > 0 && sm90_options_ok(call) && sm90_forward_hardware_ok(step)) {
        plan.backend = BackendKind::kSm90;
    } else {
        plan.backend = BackendKind::kPortable;
    }
    return plan;
}

size_t forward_workspace_bytes(const ForwardCall& call) {
    WorkspaceCarver carver(nullptr);
    ForwardWorkspace::carve(carver, make_routing_plan(call), call);
    return carver.bytes_used();
}

bool forward_sm90_blocked_by_options(const ForwardCall& call, const ForwardPlan& plan) {
    const ForwardStep step{call, plan.workspace, SortedRows::of(plan.routing_plan, plan.workspace.routing), 0};
    return call.shape.num_slots() > 0 && !sm90_options_ok(call) && sm90_forward_hardware_ok(step);
}

BackwardPlan BackwardPlan::make(const BackwardCall& call) {
    const Shape& shape = call.shape;
    BackwardPlan plan;
    plan.routing_plan = make_routing_plan(call);
    WorkspaceCarver portable_carver(call.workspace);
    const BackwardWorkspace portable_workspace =
        BackwardWorkspace::carve(portable_carver, plan.routing_plan, shape, false, call.saved_h, nullptr);
    // The questions to the sm_90a kernels, asked over the portable layout.
    const BackwardStep portable{call, portable_workspace, SortedRows::of(plan.routing_plan, portable_workspace.routing),
                                0};
    const auto sm90_ok = [&] { return sm90_options_ok(call) && sm90_backward_hardware_ok(portable); };
    // FP8_BLOCKWISE: the sm_90a kernels or nothing (its device checked with the arguments).
    const bool use_sm90 = shape.num_slots() > 0 && (call.fp8 != nullptr || sm90_ok());
    plan.weight_grads_sm90 =
        use_sm90 && !test_override(MEGAMOE_TEST_PORTABLE_WEIGHT_GRADS) && sm90_ok() && sm90_weight_grads_ok(portable);
    plan.sm90_blocked_by_options =
        shape.num_slots() > 0 && !sm90_options_ok(call) && sm90_backward_hardware_ok(portable);
    plan.workspace = portable_workspace;
    plan.workspace_bytes = portable_carver.bytes_used();
    plan.act_in_dw13 = false;
    plan.backend = BackendKind::kPortable;
    if (use_sm90) {
        plan.backend = call.fp8 != nullptr ? BackendKind::kSm90Fp8 : BackendKind::kSm90;
        WorkspaceCarver carver(call.workspace);
        void* act_scratch = dw13_as_act_scratch(call);
        plan.act_in_dw13 = act_scratch != nullptr;
        plan.workspace = BackwardWorkspace::carve(carver, plan.routing_plan, shape, true, call.saved_h, act_scratch,
                                                  is_interleaved(call));
        if (call.fp8 != nullptr) {
            void* operands_in_dw13 = fp8_operands_in_dw13(call, act_scratch);
            WorkspaceCarver dw13_carver(operands_in_dw13);
            plan.workspace.carve_fp8_operands(operands_in_dw13 != nullptr ? dw13_carver : carver, call);
            plan.workspace.carve_fp8(carver, call);
        }
        plan.workspace_bytes = carver.bytes_used();
    }
    return plan;
}

}  // namespace megamoe::cuda
