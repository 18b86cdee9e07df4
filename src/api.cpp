// The C API: validate every argument (a bad one gives a status and a message naming it, never a crash), then
// dispatch to the CPU reference or the CUDA path. Two entry points share the checks (validate.h) and one dispatch
// body (run_entry): the whole layer (topk_ids routed by the library) and grouped rows (rows already sorted by
// expert, tokens_per_expert counts). Also the version and the ABI guard (megamoe_abi_version, megamoe_struct_size).
#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <string>
#include <vector>

#include "common.h"
#include "cuda/cuda_path.h"
#include "dtype.h"
#include "reference/reference.h"
#include "validate.h"

namespace megamoe {
const char* last_error();
}

namespace megamoe {
namespace {

// CPU ids can be read here: every value must be in [-1, E). (CUDA ids are checked on the device:
// see cuda_path.h.)
megamoe_status_t check_cpu_ids(const megamoe_tensor_t& ids, const Shape& shape) {
    for (int64_t slot = 0; slot < shape.num_slots(); ++slot) {
        const int64_t value = load_index(ids.data, ids.dtype, slot);
        if (value < -1 || value >= shape.num_experts) {
            return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT,
                             "topk_ids: value %" PRId64 " at [%" PRId64 ", %" PRId64 "] is out of range [-1, E=%" PRId64
                             ")",
                             value, slot / shape.topk, slot % shape.topk, shape.num_experts);
        }
    }
    return MEGAMOE_STATUS_SUCCESS;
}

// CPU counts can be read here: each must be >= 0 and their sum at most R. (CUDA counts are checked on the device:
// see cuda_path.h.)
megamoe_status_t check_cpu_counts(const megamoe_tensor_t& counts, const Shape& shape) {
    int64_t num_counted = 0;  // at most R before each addition of a count capped at R + 1: no overflow
    for (int64_t expert_idx = 0; expert_idx < shape.num_experts; ++expert_idx) {
        const int64_t value = load_index(counts.data, counts.dtype, expert_idx);
        if (value < 0) {
            return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT,
                             "tokens_per_expert: value %" PRId64 " at [%" PRId64 "] is negative", value, expert_idx);
        }
        num_counted += std::min(value, shape.num_tokens + 1);
        if (num_counted > shape.num_tokens) {
            return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT,
                             "tokens_per_expert: the counts sum past the R=%" PRId64
                             " rows of x_sorted (at expert %" PRId64 ")",
                             shape.num_tokens, expert_idx);
        }
    }
    return MEGAMOE_STATUS_SUCCESS;
}

megamoe_status_t check_cpu_values(const megamoe_forward_params_t& p, const Shape& shape) {
    return check_cpu_ids(p.topk_ids, shape);
}
megamoe_status_t check_cpu_values(const megamoe_backward_params_t& p, const Shape& shape) {
    return check_cpu_ids(p.topk_ids, shape);
}
megamoe_status_t check_cpu_values(const megamoe_grouped_forward_params_t& p, const Shape& shape) {
    return check_cpu_counts(p.tokens_per_expert, shape);
}
megamoe_status_t check_cpu_values(const megamoe_grouped_backward_params_t& p, const Shape& shape) {
    return check_cpu_counts(p.tokens_per_expert, shape);
}

// The whole layer's routed inputs: x, w13, w2 (check_rows_and_weights), then topk_ids and topk_weights.
megamoe_status_t check_routed_inputs(const megamoe_tensor_t& x, const megamoe_tensor_t& ids,
                                     const megamoe_tensor_t& weights, const megamoe_tensor_t& w13,
                                     const megamoe_tensor_t& w2, megamoe_accum_t accum, Shape* shape) {
    MEGAMOE_CHECK(check_rows_and_weights("x", "[T, H]", x, w13, w2, accum, shape));
    MEGAMOE_CHECK(check_tensor("topk_ids", ids, 2, "[T, topk]"));
    MEGAMOE_CHECK(check_tensor("topk_weights", weights, 2, "[T, topk]"));
    MEGAMOE_CHECK(check_dtype("topk_ids", ids, MEGAMOE_DTYPE_I32, MEGAMOE_DTYPE_I64, "i32 or i64"));
    MEGAMOE_CHECK(check_dtype("topk_weights", weights, MEGAMOE_DTYPE_F32, x.dtype, "f32 or the dtype of x"));
    shape->topk = ids.shape[1];
    if (shape->topk == 0)
        return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT, "topk_ids: topk must be > 0, got shape %s",
                         shape_string(ids).c_str());
    MEGAMOE_CHECK(check_shape("topk_ids", ids, {shape->num_tokens, shape->topk}, "[T, topk] (T from x)"));
    MEGAMOE_CHECK(check_shape("topk_weights", weights, {shape->num_tokens, shape->topk}, "[T, topk] (as topk_ids)"));
    if (shape->num_slots() > kMaxRows) {
        return set_error(MEGAMOE_STATUS_NOT_SUPPORTED, "topk_ids: T * topk = %" PRId64 " exceeds 2^31 - 1 slots",
                         shape->num_slots());
    }
    MEGAMOE_CHECK(check_same_device("topk_ids", ids, x));
    return check_same_device("topk_weights", weights, x);
}

// Grouped rows' inputs: x_sorted, w13, w2 (check_rows_and_weights), then tokens_per_expert and the optional scores.
// The shape is the whole layer's with T = R rows and topk = 1.
megamoe_status_t check_grouped_inputs(const megamoe_tensor_t& x, const megamoe_tensor_t& counts,
                                      const megamoe_tensor_t& scores, const megamoe_tensor_t& w13,
                                      const megamoe_tensor_t& w2, megamoe_accum_t accum, Shape* shape) {
    MEGAMOE_CHECK(check_rows_and_weights("x_sorted", "[R, H]", x, w13, w2, accum, shape));
    shape->topk = 1;
    if (shape->num_tokens > kMaxRows) {
        return set_error(MEGAMOE_STATUS_NOT_SUPPORTED, "x_sorted: R = %" PRId64 " rows exceed 2^31 - 1",
                         shape->num_tokens);
    }
    MEGAMOE_CHECK(check_input("tokens_per_expert", counts, x, "x_sorted", 1, "[E] (E from w13)", {shape->num_experts},
                              MEGAMOE_DTYPE_I32, MEGAMOE_DTYPE_I64, "i32 or i64"));
    if (is_present(scores)) {
        MEGAMOE_CHECK(check_input("scores", scores, x, "x_sorted", 1, "[R] (R from x_sorted)", {shape->num_tokens},
                                  MEGAMOE_DTYPE_F32, x.dtype, "f32 or the dtype of x_sorted"));
    }
    return MEGAMOE_STATUS_SUCCESS;
}

megamoe_status_t validate(const megamoe_forward_params_t* params, Shape* shape) {
    if (params == nullptr) return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT, "params: NULL");
    const megamoe_forward_params_t& p = *params;
    MEGAMOE_CHECK(check_routed_inputs(p.x, p.topk_ids, p.topk_weights, p.w13, p.w2, p.accum, shape));
    const std::vector<Named> inputs = {
        {"x", &p.x}, {"topk_ids", &p.topk_ids}, {"topk_weights", &p.topk_weights}, {"w13", &p.w13}, {"w2", &p.w2}};
    const megamoe_dtype_t dtype = p.x.dtype;
    MEGAMOE_CHECK(check_output("y", p.y, p.x, "x", 2, "[T, H]", {shape->num_tokens, shape->hidden}, dtype, dtype,
                               "must equal the dtype of x", inputs));
    if (is_present(p.saved_h)) {
        MEGAMOE_CHECK(check_output("saved_h", p.saved_h, p.x, "x", 2, "[T*topk, 2I]",
                                   {shape->num_slots(), 2 * shape->intermediate}, dtype, dtype,
                                   "must equal the dtype of x", inputs));
    }
    return check_outputs_disjoint({{"y", &p.y}, {"saved_h", &p.saved_h}});
}

megamoe_status_t validate(const megamoe_grouped_forward_params_t* params, Shape* shape) {
    if (params == nullptr) return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT, "params: NULL");
    const megamoe_grouped_forward_params_t& p = *params;
    MEGAMOE_CHECK(check_grouped_inputs(p.x_sorted, p.tokens_per_expert, p.scores, p.w13, p.w2, p.accum, shape));
    const std::vector<Named> inputs = {{"x_sorted", &p.x_sorted},
                                       {"tokens_per_expert", &p.tokens_per_expert},
                                       {"scores", &p.scores},
                                       {"w13", &p.w13},
                                       {"w2", &p.w2}};
    const megamoe_dtype_t dtype = p.x_sorted.dtype;
    MEGAMOE_CHECK(check_output("out", p.out, p.x_sorted, "x_sorted", 2, "[R, H]", {shape->num_tokens, shape->hidden},
                               dtype, dtype, "must equal the dtype of x_sorted", inputs));
    if (is_present(p.saved_h)) {
        MEGAMOE_CHECK(check_output("saved_h", p.saved_h, p.x_sorted, "x_sorted", 2, "[R, 2I]",
                                   {shape->num_tokens, 2 * shape->intermediate}, dtype, dtype,
                                   "must equal the dtype of x_sorted", inputs));
    }
    return check_outputs_disjoint({{"out", &p.out}, {"saved_h", &p.saved_h}});
}

// The weight gradients of either backward: optional, [E, 2I, H] / [E, H, I] in the weights' dtype or f32.
megamoe_status_t check_weight_grads(const megamoe_tensor_t& dw13, const megamoe_tensor_t& dw2,
                                    const megamoe_tensor_t& x, const char* x_name, const megamoe_tensor_t& w13,
                                    const megamoe_tensor_t& w2, const Shape& shape, const std::vector<Named>& inputs) {
    const int64_t H = shape.hidden, I = shape.intermediate, E = shape.num_experts;
    if (is_present(dw13)) {
        MEGAMOE_CHECK(check_output("dw13", dw13, x, x_name, 3, "[E, 2I, H]", {E, 2 * I, H}, w13.dtype,
                                   MEGAMOE_DTYPE_F32, "the dtype of w13 or f32", inputs));
    }
    if (is_present(dw2)) {
        MEGAMOE_CHECK(check_output("dw2", dw2, x, x_name, 3, "[E, H, I]", {E, H, I}, w2.dtype, MEGAMOE_DTYPE_F32,
                                   "the dtype of w2 or f32", inputs));
    }
    return MEGAMOE_STATUS_SUCCESS;
}

megamoe_status_t validate(const megamoe_backward_params_t* params, Shape* shape) {
    if (params == nullptr) return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT, "params: NULL");
    const megamoe_backward_params_t& p = *params;
    MEGAMOE_CHECK(check_routed_inputs(p.x, p.topk_ids, p.topk_weights, p.w13, p.w2, p.accum, shape));
    const int64_t T = shape->num_tokens, H = shape->hidden;
    const megamoe_dtype_t dtype = p.x.dtype;
    MEGAMOE_CHECK(
        check_input("dy", p.dy, p.x, "x", 2, "[T, H] (as x)", {T, H}, dtype, dtype, "must equal the dtype of x"));
    std::vector<Named> inputs = {
        {"dy", &p.dy},   {"x", &p.x},  {"topk_ids", &p.topk_ids}, {"topk_weights", &p.topk_weights},
        {"w13", &p.w13}, {"w2", &p.w2}};
    if (is_present(p.saved_h)) {
        MEGAMOE_CHECK(check_input("saved_h", p.saved_h, p.x, "x", 2, "[T*topk, 2I]",
                                  {shape->num_slots(), 2 * shape->intermediate}, dtype, dtype,
                                  "must equal the dtype of x"));
        inputs.push_back({"saved_h", &p.saved_h});
    }
    if (is_present(p.dx)) {
        MEGAMOE_CHECK(
            check_output("dx", p.dx, p.x, "x", 2, "[T, H]", {T, H}, dtype, dtype, "must equal the dtype of x", inputs));
    }
    if (is_present(p.dtopk_weights)) {
        MEGAMOE_CHECK(check_output("dtopk_weights", p.dtopk_weights, p.x, "x", 2, "[T, topk]", {T, shape->topk},
                                   MEGAMOE_DTYPE_F32, p.topk_weights.dtype, "f32 or the dtype of topk_weights",
                                   inputs));
    }
    MEGAMOE_CHECK(check_weight_grads(p.dw13, p.dw2, p.x, "x", p.w13, p.w2, *shape, inputs));
    return check_outputs_disjoint(
        {{"dx", &p.dx}, {"dtopk_weights", &p.dtopk_weights}, {"dw13", &p.dw13}, {"dw2", &p.dw2}});
}

megamoe_status_t validate(const megamoe_grouped_backward_params_t* params, Shape* shape) {
    if (params == nullptr) return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT, "params: NULL");
    const megamoe_grouped_backward_params_t& p = *params;
    MEGAMOE_CHECK(check_grouped_inputs(p.x_sorted, p.tokens_per_expert, p.scores, p.w13, p.w2, p.accum, shape));
    const int64_t R = shape->num_tokens, H = shape->hidden;
    const megamoe_dtype_t dtype = p.x_sorted.dtype;
    const char* same_dtype = "must equal the dtype of x_sorted";
    MEGAMOE_CHECK(check_input("dout", p.dout, p.x_sorted, "x_sorted", 2, "[R, H] (as x_sorted)", {R, H}, dtype, dtype,
                              same_dtype));
    std::vector<Named> inputs = {
        {"dout", &p.dout},     {"x_sorted", &p.x_sorted}, {"tokens_per_expert", &p.tokens_per_expert},
        {"scores", &p.scores}, {"w13", &p.w13},           {"w2", &p.w2}};
    if (is_present(p.saved_h)) {
        MEGAMOE_CHECK(check_input("saved_h", p.saved_h, p.x_sorted, "x_sorted", 2, "[R, 2I]",
                                  {R, 2 * shape->intermediate}, dtype, dtype, same_dtype));
        inputs.push_back({"saved_h", &p.saved_h});
    }
    if (is_present(p.dx_sorted)) {
        MEGAMOE_CHECK(check_output("dx_sorted", p.dx_sorted, p.x_sorted, "x_sorted", 2, "[R, H]", {R, H}, dtype, dtype,
                                   same_dtype, inputs));
    }
    if (is_present(p.dscores)) {
        if (!is_present(p.scores)) {
            return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT,
                             "dscores: given, but scores is absent (no scores, no "
                             "gradient of them)");
        }
        MEGAMOE_CHECK(check_output("dscores", p.dscores, p.x_sorted, "x_sorted", 1, "[R]", {R}, MEGAMOE_DTYPE_F32,
                                   p.scores.dtype, "f32 or the dtype of scores", inputs));
    }
    MEGAMOE_CHECK(check_weight_grads(p.dw13, p.dw2, p.x_sorted, "x_sorted", p.w13, p.w2, *shape, inputs));
    return check_outputs_disjoint(
        {{"dx_sorted", &p.dx_sorted}, {"dscores", &p.dscores}, {"dw13", &p.dw13}, {"dw2", &p.dw2}});
}

// The device every tensor of the call is on (validated to be one).
megamoe_device_type_t device_of(const megamoe_forward_params_t& p) {
    return p.x.device_type;
}
megamoe_device_type_t device_of(const megamoe_backward_params_t& p) {
    return p.x.device_type;
}
megamoe_device_type_t device_of(const megamoe_grouped_forward_params_t& p) {
    return p.x_sorted.device_type;
}
megamoe_device_type_t device_of(const megamoe_grouped_backward_params_t& p) {
    return p.x_sorted.device_type;
}

megamoe_status_t check_cuda_pointers_of(const megamoe_forward_params_t& p) {
    return check_cuda_pointers({{"x", &p.x},
                                {"topk_ids", &p.topk_ids},
                                {"topk_weights", &p.topk_weights},
                                {"w13", &p.w13},
                                {"w2", &p.w2},
                                {"y", &p.y},
                                {"saved_h", &p.saved_h}});
}
megamoe_status_t check_cuda_pointers_of(const megamoe_backward_params_t& p) {
    return check_cuda_pointers({{"dy", &p.dy},
                                {"x", &p.x},
                                {"topk_ids", &p.topk_ids},
                                {"topk_weights", &p.topk_weights},
                                {"w13", &p.w13},
                                {"w2", &p.w2},
                                {"saved_h", &p.saved_h},
                                {"dx", &p.dx},
                                {"dtopk_weights", &p.dtopk_weights},
                                {"dw13", &p.dw13},
                                {"dw2", &p.dw2}});
}
megamoe_status_t check_cuda_pointers_of(const megamoe_grouped_forward_params_t& p) {
    return check_cuda_pointers({{"x_sorted", &p.x_sorted},
                                {"tokens_per_expert", &p.tokens_per_expert},
                                {"scores", &p.scores},
                                {"w13", &p.w13},
                                {"w2", &p.w2},
                                {"out", &p.out},
                                {"saved_h", &p.saved_h}});
}
megamoe_status_t check_cuda_pointers_of(const megamoe_grouped_backward_params_t& p) {
    return check_cuda_pointers({{"dout", &p.dout},
                                {"x_sorted", &p.x_sorted},
                                {"tokens_per_expert", &p.tokens_per_expert},
                                {"scores", &p.scores},
                                {"w13", &p.w13},
                                {"w2", &p.w2},
                                {"saved_h", &p.saved_h},
                                {"dx_sorted", &p.dx_sorted},
                                {"dscores", &p.dscores},
                                {"dw13", &p.dw13},
                                {"dw2", &p.dw2}});
}

// megamoe_*_workspace_size of every entry point: validate, then ask the path the call would take.
template <typename Params>
megamoe_status_t query_workspace(const Params* params, size_t* bytes) {
    clear_error();
    if (bytes == nullptr) return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT, "bytes: NULL");
    Shape shape{};
    MEGAMOE_CHECK(validate(params, &shape));
    *bytes = device_of(*params) == MEGAMOE_DEVICE_CUDA ? cuda::workspace_size(*params, shape)
                                                       : reference::workspace_size(*params, shape);
    return MEGAMOE_STATUS_SUCCESS;
}

// megamoe_forward, megamoe_backward and their grouped-rows forms: validate; on the CPU read the values (ids, counts)
// and run the reference; on CUDA check the pointers and run the CUDA path; each with its workspace checked first.
template <typename Params>
megamoe_status_t run_entry(const Params* params) {
    clear_error();
    Shape shape{};
    MEGAMOE_CHECK(validate(params, &shape));
    const Params& p = *params;
    if (device_of(p) == MEGAMOE_DEVICE_CPU) {
        MEGAMOE_CHECK(check_cpu_values(p, shape));
        MEGAMOE_CHECK(check_workspace(p.workspace, p.workspace_bytes, reference::workspace_size(p, shape)));
        return reference::run(p, shape);
    }
    MEGAMOE_CHECK(check_cuda_pointers_of(p));
    MEGAMOE_CHECK(check_workspace(p.workspace, p.workspace_bytes, cuda::workspace_size(p, shape)));
    return cuda::run(p, shape);
}

}  // namespace
}  // namespace megamoe

extern "C" {

const char* megamoe_last_error(void) {
    return megamoe::last_error();
}

const char* megamoe_status_string(megamoe_status_t status) {
    switch (status) {
        case MEGAMOE_STATUS_SUCCESS:
            return "MEGAMOE_STATUS_SUCCESS";
        case MEGAMOE_STATUS_INVALID_ARGUMENT:
            return "MEGAMOE_STATUS_INVALID_ARGUMENT";
        case MEGAMOE_STATUS_NOT_SUPPORTED:
            return "MEGAMOE_STATUS_NOT_SUPPORTED";
        case MEGAMOE_STATUS_WORKSPACE_TOO_SMALL:
            return "MEGAMOE_STATUS_WORKSPACE_TOO_SMALL";
        case MEGAMOE_STATUS_CUDA_ERROR:
            return "MEGAMOE_STATUS_CUDA_ERROR";
        case MEGAMOE_STATUS_INTERNAL_ERROR:
            return "MEGAMOE_STATUS_INTERNAL_ERROR";
    }
    return "MEGAMOE_STATUS_UNKNOWN";
}

int32_t megamoe_version(void) {
    return MEGAMOE_VERSION_MAJOR * 10000 + MEGAMOE_VERSION_MINOR * 100 + MEGAMOE_VERSION_PATCH;
}

int32_t megamoe_abi_version(void) {
    return MEGAMOE_ABI_VERSION;
}

size_t megamoe_struct_size(megamoe_struct_kind_t kind) {
    switch (kind) {
        case MEGAMOE_STRUCT_TENSOR:
            return sizeof(megamoe_tensor_t);
        case MEGAMOE_STRUCT_FORWARD_PARAMS:
            return sizeof(megamoe_forward_params_t);
        case MEGAMOE_STRUCT_BACKWARD_PARAMS:
            return sizeof(megamoe_backward_params_t);
        case MEGAMOE_STRUCT_GROUPED_FORWARD_PARAMS:
            return sizeof(megamoe_grouped_forward_params_t);
        case MEGAMOE_STRUCT_GROUPED_BACKWARD_PARAMS:
            return sizeof(megamoe_grouped_backward_params_t);
    }
    return 0;
}

megamoe_status_t megamoe_forward_workspace_size(const megamoe_forward_params_t* params, size_t* bytes) {
    return megamoe::query_workspace(params, bytes);
}

megamoe_status_t megamoe_backward_workspace_size(const megamoe_backward_params_t* params, size_t* bytes) {
    return megamoe::query_workspace(params, bytes);
}

megamoe_status_t megamoe_grouped_forward_workspace_size(const megamoe_grouped_forward_params_t* params, size_t* bytes) {
    return megamoe::query_workspace(params, bytes);
}

megamoe_status_t megamoe_grouped_backward_workspace_size(const megamoe_grouped_backward_params_t* params,
                                                         size_t* bytes) {
    return megamoe::query_workspace(params, bytes);
}

megamoe_status_t megamoe_forward(const megamoe_forward_params_t* params) {
    return megamoe::run_entry(params);
}

megamoe_status_t megamoe_backward(const megamoe_backward_params_t* params) {
    return megamoe::run_entry(params);
}

megamoe_status_t megamoe_grouped_forward(const megamoe_grouped_forward_params_t* params) {
    return megamoe::run_entry(params);
}

megamoe_status_t megamoe_grouped_backward(const megamoe_grouped_backward_params_t* params) {
    return megamoe::run_entry(params);
}

}  // extern "C"
