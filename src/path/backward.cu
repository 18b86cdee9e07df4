// The CUDA path's backward (cuda_path.cu's opening block) as a list of steps (steps.h) on the backend its plan chose
// (plan.h): routing, h recomputed (unless kept), dH with the activation's backward, d topk_weights, dW2, dX and its
// gather-sum, dW13, the bias gradients, each gradient only when wanted. Also the entry points of megamoe_backward and
// megamoe_grouped_backward, their workspace sizes and path queries.
#include <string>

#include "device/cuda_utils.h"
#include "path/call.h"
#include "path/cuda_path.h"
#include "path/cuda_path_common.h"
#include "path/plan.h"
#include "path/steps.h"

namespace megamoe::cuda {
namespace {

// No rows at all: every gradient is zero (or empty), accumulated ones stay as they are; grouped counts are still read
// (the sort of the whole layer needs slots).
megamoe_status_t backward_without_slots(const BackwardCall& call, const BackwardPlan& plan) {
    MEGAMOE_CUDA_RETURN_IF_ERROR(zero_grads(call));
    if (!call.rows_sorted) return MEGAMOE_STATUS_SUCCESS;
    MEGAMOE_CUDA_RETURN_IF_ERROR(route(call, plan.routing_plan, plan.workspace.routing));
    return fill_nan_if_counts_invalid(call, plan.workspace.routing);
}

megamoe_status_t backward_on_device(const BackwardCall& call) {
    const BackwardPlan plan = BackwardPlan::make(call);
    if (call.shape.num_slots() == 0) return backward_without_slots(call, plan);
    const Backend& backend = backend_of(plan.backend);
    const WeightGrads weight_grads(plan.weight_grads_sm90);
    const int num_sms = plan.backend == BackendKind::kPortable ? 0 : device_info(call.device_index).num_sms;
    const RoutingBuffers& routing = plan.workspace.routing;
    const BackwardStep step{call, plan.workspace, SortedRows::of(plan.routing_plan, routing), num_sms};

    MEGAMOE_CUDA_RETURN_IF_ERROR(route(call, plan.routing_plan, routing));
    // h = [g, u] by sorted row in workspace.h: kept by the forward (saved_h), or recomputed here; dh goes over it.
    if (call.saved_h == nullptr) MEGAMOE_CUDA_RETURN_IF_ERROR(backend.recompute_h(step));
    int64_t num_ds_parts = 1;
    MEGAMOE_CUDA_RETURN_IF_ERROR(backend.d_hidden(step, &num_ds_parts));
    MEGAMOE_CUDA_RETURN_IF_ERROR(finalize_d_topk_weights(step, num_ds_parts));
    // dW2 before dX: on the sm_90a backends q is written over s * a, which only dW2 reads.
    MEGAMOE_CUDA_RETURN_IF_ERROR(weight_grads.dw2(step));
    if (call.dx.data != nullptr) {  // q = dh W13[e]; then dx_t = sum_j q[row of (t, j)]
        RowBuffer q{};
        MEGAMOE_CUDA_RETURN_IF_ERROR(backend.d_input(step, &q));
        MEGAMOE_CUDA_RETURN_IF_ERROR(sum_d_input(step, q));
    }
    // dW13 last: on the sm_90a backends its output may hold s * a, q and the FP8 operands until here.
    MEGAMOE_CUDA_RETURN_IF_ERROR(weight_grads.dw13(step));
    MEGAMOE_CUDA_RETURN_IF_ERROR(bias_grads(step));
    return fill_nan_if_counts_invalid(call, routing);
}

megamoe_path_t backward_path(const BackwardCall& call, std::string* reason) {
    const BackwardPlan plan = BackwardPlan::make(call);
    reason->clear();
    if (call.fp8 != nullptr) return MEGAMOE_PATH_SM90_FP8;  // the weight gradients in 16 bits
    if (plan.sm90_blocked_by_options) *reason = blocked_reason(call);
    if (plan.backend == BackendKind::kPortable) return MEGAMOE_PATH_CUDA_PORTABLE;
    return plan.weight_grads_sm90 ? MEGAMOE_PATH_SM90 : MEGAMOE_PATH_SM90_PORTABLE_WEIGHT_GRADS;
}

megamoe_status_t run_backward(const BackwardCall& call) {
    const DeviceGuard guard(call.device_index);
    MEGAMOE_CUDA_RETURN_IF_ERROR(guard.status());
    return backward_on_device(call);
}

bool backward_sm90(const BackwardCall& call) {
    return BackwardPlan::make(call).backend != BackendKind::kPortable;
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
    return backward_sm90(backward_call(params, shape));
}
bool backward_uses_sm90(const megamoe_grouped_backward_params_t& params, const Shape& shape) {
    return backward_sm90(backward_call(params, shape));
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
