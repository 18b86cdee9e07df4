// The CUDA path's forward (cuda_path.cu's opening block): routing, the up GEMM with its gated epilogue, the down GEMM
// and the combine, on the fused sm_90a kernels where the call suits them, else the portable ones; the workspace plan,
// the path query and the entry points of megamoe_forward and megamoe_grouped_forward.
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
#include "sm90/m_grouped_gemm_sm90.h"
#include "sm90/k_grouped_gemm_sm90.h"

namespace megamoe::cuda {
namespace {

struct ForwardWorkspace {
    RoutingBuffers routing;
    uint16_t* act;    // [S, I] element type (FP8: NULL, a goes out quantized)
    uint16_t* out;    // [S, H] element type
    Fp8Rows x_fp8;    // FP8: x [rows of x, H] quantized along H
    Fp8Rows act_fp8;  // FP8: a [S, I] quantized along I by the up GEMM's epilogue

    static ForwardWorkspace carve(WorkspaceCarver& carver, const RoutingPlan& plan, const Call& call) {
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
};

// The two GEMMs of the forward: up (x gathered by sorted slot, w13) and down (a, w2).
struct ForwardGemms {
    MGroupedGemmArgs up;
    MGroupedGemmArgs down;
    MGroupedGemmArgs sm90_up;  // the same in the weights' layout (path/sm90_args.h)
    MGroupedGemmArgs sm90_down;
    bool options_ok;  // the sm_90a kernels take the call's expert options

    static ForwardGemms make(const Call& call, const RoutingPlan& plan, const ForwardWorkspace& workspace) {
        const Shape& shape = call.shape;
        ForwardGemms gemms;
        gemms.up = up_gemm_args(call.dtype, call.x, call.w13, plan, workspace.routing, shape);
        gemms.down = gemms.up;
        gemms.down.a = workspace.act;
        gemms.down.lda = shape.intermediate;
        gemms.down.a_gather_slots = nullptr;
        gemms.down.num_a_rows = shape.num_slots();
        gemms.down.b = call.w2;
        gemms.down.b_expert_stride = shape.hidden * shape.intermediate;
        gemms.down.ldb = shape.intermediate;
        gemms.down.n = shape.hidden;
        gemms.down.k = shape.intermediate;
        gemms.sm90_up = sm90_up_args(call, gemms.up);
        gemms.sm90_down = sm90_w2_args(call, gemms.down);
        gemms.options_ok = sm90_options_ok(call);
        return gemms;
    }

    bool sm90_ok(int device_index) const { return options_ok && sm90_hardware_ok(device_index); }

    // The device, dtype and alignment suit the sm_90a kernels (the expert options aside).
    bool sm90_hardware_ok(int device_index) const {
        return sm90_device_ok(device_index) && sm90::m_grouped_gemm_sm90_supported(sm90_up, true) &&
               sm90::m_grouped_gemm_sm90_supported(sm90_down, false);
    }
};

megamoe_status_t forward_on_device(const ForwardCall& call) {
    const Shape& shape = call.shape;
    const cudaStream_t stream = call.stream;
    const RoutingPlan plan = make_routing_plan(call);
    WorkspaceCarver carver(call.workspace);
    const ForwardWorkspace workspace = ForwardWorkspace::carve(carver, plan, call);
    const RoutingBuffers& routing = workspace.routing;

    MEGAMOE_CUDA_RETURN_IF_ERROR(launch_routing(call.experts, call.experts_dtype, plan, routing, stream));

    const ForwardGemms gemms = ForwardGemms::make(call, plan, workspace);
    if (call.fp8 != nullptr) {  // x quantized by a pass, a by the up GEMM's epilogue
        const int num_sms = device_info(call.device_index).num_sms;
        MEGAMOE_CUDA_RETURN_IF_ERROR(quantize_rows(call, call.x, shape.num_tokens, workspace.x_fp8));
        MEGAMOE_CUDA_RETURN_IF_ERROR(
            launch_fp8_up(call, gemms.up, workspace.x_fp8, call.saved_h, nullptr, &workspace.act_fp8, num_sms));
        MEGAMOE_CUDA_RETURN_IF_ERROR(launch_fp8_down(call, gemms.down, workspace.act_fp8, workspace.out, num_sms));
    } else if (gemms.sm90_ok(call.device_index)) {
        const int num_sms = device_info(call.device_index).num_sms;
        MEGAMOE_CUDA_RETURN_IF_ERROR(sm90::launch_m_grouped_gemm_sm90_gated(gemms.sm90_up, call.saved_h, workspace.act,
                                                                            num_sms, stream, sm90_gated_args(call)));
        MEGAMOE_CUDA_RETURN_IF_ERROR(
            sm90::launch_m_grouped_gemm_sm90_store(gemms.sm90_down, sm90_down_layout(call), workspace.out, shape.hidden,
                                                   shape.num_slots(), num_sms, stream, call.b2));
    } else {
        MEGAMOE_CUDA_RETURN_IF_ERROR(launch_up(call, gemms.up, call.saved_h, workspace.act, stream));
        MEGAMOE_CUDA_RETURN_IF_ERROR(launch_down(call, gemms.down, workspace.out, stream));
    }

    // Grouped rows: out_r = score_r o_r, 0 past the counts' sum. TODO(#12): without scores the down GEMM could store
    // straight into out (and the dX GEMM into d x_sorted below), zeroing only the padding rows.
    GatherSumArgs combine{};
    combine.out_dtype = call.dtype;
    combine.rows = workspace.out;
    combine.rows_dtype = call.dtype;
    combine.slot_to_row = routing.slot_to_row;
    combine.weights = call.weights;
    combine.weights_dtype = call.weights_dtype;
    combine.token_invalid = routing.token_invalid;
    combine.num_tokens = shape.num_tokens;
    combine.topk = shape.topk;
    combine.num_cols = shape.hidden;
    combine.out = call.y;
    return launch_gather_sum(combine, stream);
}

size_t forward_workspace_bytes(const ForwardCall& call) {
    WorkspaceCarver carver(nullptr);
    ForwardWorkspace::carve(carver, make_routing_plan(call), call);
    return carver.bytes_used();
}

megamoe_status_t run_forward(const ForwardCall& call) {
    const DeviceGuard guard(call.device_index);
    MEGAMOE_CUDA_RETURN_IF_ERROR(guard.status());
    if (call.shape.num_slots() == 0) {  // no slots: y is all zeros (or empty)
        const int64_t num_elements = call.shape.num_tokens * call.shape.hidden;
        if (num_elements == 0) return MEGAMOE_STATUS_SUCCESS;
        const size_t num_bytes = static_cast<size_t>(num_elements) * sizeof(uint16_t);  // y is bf16 or f16
        return check_cuda(cudaMemsetAsync(call.y, 0, num_bytes, call.stream), "cudaMemsetAsync(y)");
    }
    return forward_on_device(call);
}

ForwardGemms forward_gemms(const ForwardCall& call) {
    const RoutingPlan plan = make_routing_plan(call);
    WorkspaceCarver carver(call.workspace);
    const ForwardWorkspace workspace = ForwardWorkspace::carve(carver, plan, call);
    return ForwardGemms::make(call, plan, workspace);
}

bool forward_sm90(const ForwardCall& call) {
    return call.shape.num_slots() > 0 && (call.fp8 != nullptr || forward_gemms(call).sm90_ok(call.device_index));
}

megamoe_path_t forward_path(const ForwardCall& call, std::string* reason) {
    reason->clear();
    if (call.fp8 != nullptr) return MEGAMOE_PATH_SM90_FP8;  // the device was checked with the arguments
    if (forward_sm90(call)) return MEGAMOE_PATH_SM90;
    if (call.shape.num_slots() > 0 && !sm90_options_ok(call) &&
        forward_gemms(call).sm90_hardware_ok(call.device_index)) {
        *reason = blocked_reason(call);
    }
    return MEGAMOE_PATH_CUDA_PORTABLE;
}

}  // namespace

size_t workspace_size(const megamoe_forward_params_t& params, const Shape& shape) {
    return forward_workspace_bytes(forward_call(params, shape));
}
size_t workspace_size(const megamoe_grouped_forward_params_t& params, const Shape& shape) {
    return forward_workspace_bytes(forward_call(params, shape));
}
megamoe_status_t run(const megamoe_forward_params_t& params, const Shape& shape) {
    return run_forward(forward_call(params, shape));
}
megamoe_status_t run(const megamoe_grouped_forward_params_t& params, const Shape& shape) {
    return run_forward(forward_call(params, shape));
}
bool forward_uses_sm90(const megamoe_forward_params_t& params, const Shape& shape) {
    return forward_sm90(forward_call(params, shape));
}
bool forward_uses_sm90(const megamoe_grouped_forward_params_t& params, const Shape& shape) {
    return forward_sm90(forward_call(params, shape));
}
megamoe_path_t path(const megamoe_forward_params_t& params, const Shape& shape, std::string* reason) {
    return forward_path(forward_call(params, shape), reason);
}
megamoe_path_t path(const megamoe_grouped_forward_params_t& params, const Shape& shape, std::string* reason) {
    return forward_path(forward_call(params, shape), reason);
}

}  // namespace megamoe::cuda
