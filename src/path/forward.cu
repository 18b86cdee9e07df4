// The CUDA path's forward (cuda_path.cu's opening block) as a list of steps (steps.h) on the backend its plan chose
// (plan.h): routing, up (the gated epilogue), down, combine. Also the entry points of megamoe_forward and
// megamoe_grouped_forward, their workspace sizes and path queries.
#include <string>

#include "device/cuda_utils.h"
#include "path/call.h"
#include "path/cuda_path.h"
#include "path/cuda_path_common.h"
#include "path/plan.h"
#include "path/steps.h"

namespace megamoe::cuda {
namespace {

// A call with slots.
megamoe_status_t forward_on_device(const ForwardCall& call) {
    const ForwardPlan plan = ForwardPlan::make(call);
    const Backend& backend = backend_of(plan.backend);
    const int num_sms = plan.backend == BackendKind::kPortable ? 0 : device_info(call.device_index).num_sms;
    const RoutingBuffers& routing = plan.workspace.routing;
    const ForwardStep step{call, plan.workspace, SortedRows::of(plan.routing_plan, routing), num_sms};

    MEGAMOE_CUDA_RETURN_IF_ERROR(route(call, plan.routing_plan, routing));
    MEGAMOE_CUDA_RETURN_IF_ERROR(backend.up(step));
    MEGAMOE_CUDA_RETURN_IF_ERROR(backend.down(step));
    // Grouped rows: out_r = score_r o_r, 0 past the counts' sum. Without scores the down GEMM could store straight into
    // out (and the dX GEMM into d x_sorted), zeroing only the padding rows: not built.
    return combine(step);
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

bool forward_sm90(const ForwardCall& call) {
    return call.shape.num_slots() > 0 && ForwardPlan::make(call).backend != BackendKind::kPortable;
}

megamoe_path_t forward_path(const ForwardCall& call, std::string* reason) {
    reason->clear();
    if (call.fp8 != nullptr) return MEGAMOE_PATH_SM90_FP8;  // the device was checked with the arguments
    const ForwardPlan plan = ForwardPlan::make(call);
    if (plan.backend == BackendKind::kSm90) return MEGAMOE_PATH_SM90;
    if (forward_sm90_blocked_by_options(call, plan)) *reason = blocked_reason(call);
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
