// The C API: validate every argument (a bad one gives a status and a message naming it, never a
// crash), then dispatch to the CPU reference or the CUDA path.
#include <cuda_runtime_api.h>

#include <cinttypes>
#include <cstdio>
#include <string>
#include <vector>

#include "common.h"
#include "cuda/cuda_path.h"
#include "dtype.h"
#include "reference/reference.h"

namespace megamoe {
const char* last_error();
}

namespace megamoe {
namespace {

constexpr int64_t kMaxSlots = (int64_t{1} << 31) - 1;  // sorted-row indices are int32 on the device

#define MEGAMOE_CHECK(expr)                                    \
    do {                                                       \
        const megamoe_status_t status_ = (expr);               \
        if (status_ != MEGAMOE_STATUS_SUCCESS) return status_; \
    } while (0)

std::string shape_string(const megamoe_tensor_t& tensor) {
    std::string text = "[";
    for (int32_t dim = 0; dim < tensor.ndim && dim < MEGAMOE_MAX_DIMS; ++dim) {
        text += (dim ? ", " : "") + std::to_string(tensor.shape[dim]);
    }
    return text + "]";
}

bool is_valid_dtype(megamoe_dtype_t dtype) {
    return dtype >= MEGAMOE_DTYPE_BF16 && dtype <= MEGAMOE_DTYPE_I64;
}

// Rank, dtype validity, non-negative extents, data pointer and row-major contiguity of one tensor.
megamoe_status_t check_tensor(const char* name, const megamoe_tensor_t& tensor, int32_t ndim, const char* dims) {
    if (tensor.ndim != ndim) {
        return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT, "%s: expected %d dimensions %s, got %d", name, ndim, dims,
                         tensor.ndim);
    }
    if (!is_valid_dtype(tensor.dtype)) {
        return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT, "%s: unknown dtype code %d", name,
                         static_cast<int>(tensor.dtype));
    }
    if (tensor.device_type != MEGAMOE_DEVICE_CPU && tensor.device_type != MEGAMOE_DEVICE_CUDA) {
        return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT, "%s: unknown device type code %d", name,
                         static_cast<int>(tensor.device_type));
    }
    for (int32_t dim = 0; dim < ndim; ++dim) {
        if (tensor.shape[dim] < 0) {
            return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT, "%s: negative extent in shape %s", name,
                             shape_string(tensor).c_str());
        }
    }
    int64_t expected_stride = 1;
    for (int32_t dim = ndim - 1; dim >= 0 && numel(tensor) > 0; --dim) {  // an empty tensor has no layout
        if (tensor.shape[dim] > 1 && tensor.strides[dim] != expected_stride) {
            return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT,
                             "%s: must be contiguous row-major; dimension %d of shape %s has stride %" PRId64
                             ", expected %" PRId64,
                             name, dim, shape_string(tensor).c_str(), tensor.strides[dim], expected_stride);
        }
        expected_stride *= tensor.shape[dim];
    }
    if (tensor.data == nullptr && numel(tensor) > 0) {
        return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT, "%s: data is NULL", name);
    }
    return MEGAMOE_STATUS_SUCCESS;
}

megamoe_status_t check_shape(const char* name, const megamoe_tensor_t& tensor, std::vector<int64_t> expected,
                             const char* dims) {
    for (size_t dim = 0; dim < expected.size(); ++dim) {
        if (tensor.shape[dim] != expected[dim]) {
            std::string want = "[";
            for (size_t d = 0; d < expected.size(); ++d) want += (d ? ", " : "") + std::to_string(expected[d]);
            want += "]";
            return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT, "%s: expected shape %s = %s, got %s", name, dims,
                             want.c_str(), shape_string(tensor).c_str());
        }
    }
    return MEGAMOE_STATUS_SUCCESS;
}

megamoe_status_t check_dtype(const char* name, const megamoe_tensor_t& tensor, megamoe_dtype_t want_a,
                             megamoe_dtype_t want_b, const char* rule) {
    if (tensor.dtype != want_a && tensor.dtype != want_b) {
        return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT, "%s: dtype %s not allowed (%s)", name,
                         dtype_name(tensor.dtype), rule);
    }
    return MEGAMOE_STATUS_SUCCESS;
}

megamoe_status_t check_same_device(const char* name, const megamoe_tensor_t& tensor, const megamoe_tensor_t& x) {
    const bool same = tensor.device_type == x.device_type &&
                      (x.device_type == MEGAMOE_DEVICE_CPU || tensor.device_index == x.device_index);
    if (!same) {
        return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT,
                         "%s: on %s:%d but x is on %s:%d; all tensors must share a device", name,
                         tensor.device_type == MEGAMOE_DEVICE_CUDA ? "cuda" : "cpu", tensor.device_index,
                         x.device_type == MEGAMOE_DEVICE_CUDA ? "cuda" : "cpu", x.device_index);
    }
    return MEGAMOE_STATUS_SUCCESS;
}

// A CUDA tensor's pointer must be device (or managed) memory of its device: a host pointer labelled
// CUDA would otherwise crash a kernel.
megamoe_status_t check_cuda_pointer(const char* name, const megamoe_tensor_t& tensor) {
    if (tensor.device_type != MEGAMOE_DEVICE_CUDA || numel(tensor) == 0) return MEGAMOE_STATUS_SUCCESS;
    cudaPointerAttributes attributes{};
    const cudaError_t err = cudaPointerGetAttributes(&attributes, tensor.data);
    if (err != cudaSuccess) {
        cudaGetLastError();
        return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT, "%s: not a CUDA pointer (%s)", name, cudaGetErrorString(err));
    }
    const bool on_device = attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged;
    if (!on_device || attributes.device != tensor.device_index) {
        return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT, "%s: data is not device memory of cuda:%d", name,
                         tensor.device_index);
    }
    return MEGAMOE_STATUS_SUCCESS;
}

bool overlaps(const megamoe_tensor_t& a, const megamoe_tensor_t& b) {
    if (!a.data || !b.data || numel(a) == 0 || numel(b) == 0) return false;
    const auto a_begin = reinterpret_cast<uintptr_t>(a.data), b_begin = reinterpret_cast<uintptr_t>(b.data);
    const auto a_end = a_begin + numel(a) * dtype_size(a.dtype), b_end = b_begin + numel(b) * dtype_size(b.dtype);
    return a_begin < b_end && b_begin < a_end;
}

// CPU ids can be read here: every value must be in [-1, E). (CUDA ids are checked on the device:
// see cuda_path.h.)
megamoe_status_t check_cpu_ids(const megamoe_tensor_t& ids, const Shape& shape) {
    if (ids.device_type != MEGAMOE_DEVICE_CPU) return MEGAMOE_STATUS_SUCCESS;
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

struct Named {
    const char* name;
    const megamoe_tensor_t* tensor;
};

// Everything both directions share: the routed inputs, their shapes, dtypes and device.
megamoe_status_t check_inputs(const megamoe_tensor_t& x, const megamoe_tensor_t& ids, const megamoe_tensor_t& weights,
                              const megamoe_tensor_t& w13, const megamoe_tensor_t& w2, megamoe_accum_t accum,
                              Shape* shape) {
    MEGAMOE_CHECK(check_tensor("x", x, 2, "[T, H]"));
    MEGAMOE_CHECK(check_tensor("topk_ids", ids, 2, "[T, topk]"));
    MEGAMOE_CHECK(check_tensor("topk_weights", weights, 2, "[T, topk]"));
    MEGAMOE_CHECK(check_tensor("w13", w13, 3, "[E, 2I, H]"));
    MEGAMOE_CHECK(check_tensor("w2", w2, 3, "[E, H, I]"));

    if (x.dtype != MEGAMOE_DTYPE_BF16 && x.dtype != MEGAMOE_DTYPE_F16 && x.dtype != MEGAMOE_DTYPE_F32 &&
        x.dtype != MEGAMOE_DTYPE_F64) {
        return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT, "x: dtype %s not allowed (bf16, f16, f32 or f64)",
                         dtype_name(x.dtype));
    }
    MEGAMOE_CHECK(check_dtype("topk_ids", ids, MEGAMOE_DTYPE_I32, MEGAMOE_DTYPE_I64, "i32 or i64"));
    MEGAMOE_CHECK(check_dtype("topk_weights", weights, MEGAMOE_DTYPE_F32, x.dtype, "f32 or the dtype of x"));
    MEGAMOE_CHECK(check_dtype("w13", w13, x.dtype, x.dtype, "must equal the dtype of x"));
    MEGAMOE_CHECK(check_dtype("w2", w2, x.dtype, x.dtype, "must equal the dtype of x"));

    shape->num_tokens = x.shape[0];
    shape->hidden = x.shape[1];
    shape->topk = ids.shape[1];
    shape->num_experts = w13.shape[0];
    shape->intermediate = w2.shape[2];
    if (shape->hidden == 0)
        return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT, "x: hidden size H must be > 0, got shape %s",
                         shape_string(x).c_str());
    if (shape->topk == 0)
        return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT, "topk_ids: topk must be > 0, got shape %s",
                         shape_string(ids).c_str());
    if (shape->num_experts == 0)
        return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT, "w13: number of experts E must be > 0, got shape %s",
                         shape_string(w13).c_str());
    if (shape->intermediate == 0)
        return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT, "w2: intermediate size I must be > 0, got shape %s",
                         shape_string(w2).c_str());
    const int64_t T = shape->num_tokens, H = shape->hidden, I = shape->intermediate, E = shape->num_experts;
    MEGAMOE_CHECK(check_shape("topk_ids", ids, {T, shape->topk}, "[T, topk] (T from x)"));
    MEGAMOE_CHECK(check_shape("topk_weights", weights, {T, shape->topk}, "[T, topk] (as topk_ids)"));
    MEGAMOE_CHECK(check_shape("w13", w13, {E, 2 * I, H}, "[E, 2I, H] (E from w13, I from w2, H from x)"));
    MEGAMOE_CHECK(check_shape("w2", w2, {E, H, I}, "[E, H, I] (E from w13, H from x)"));
    if (shape->num_slots() > kMaxSlots) {
        return set_error(MEGAMOE_STATUS_NOT_SUPPORTED, "topk_ids: T * topk = %" PRId64 " exceeds 2^31 - 1 slots",
                         shape->num_slots());
    }

    for (const Named& item :
         {Named{"topk_ids", &ids}, Named{"topk_weights", &weights}, Named{"w13", &w13}, Named{"w2", &w2}}) {
        MEGAMOE_CHECK(check_same_device(item.name, *item.tensor, x));
    }
    if (x.device_type == MEGAMOE_DEVICE_CUDA) {
        if (x.dtype != MEGAMOE_DTYPE_BF16 && x.dtype != MEGAMOE_DTYPE_F16) {
            return set_error(MEGAMOE_STATUS_NOT_SUPPORTED,
                             "x: dtype %s is not supported on CUDA (bf16 or f16); use CPU tensors for f32/f64",
                             dtype_name(x.dtype));
        }
        if (accum == MEGAMOE_ACCUM_F64) {
            return set_error(MEGAMOE_STATUS_NOT_SUPPORTED, "accum: f64 accumulation is CPU-only");
        }
    }
    if (accum != MEGAMOE_ACCUM_DEFAULT && accum != MEGAMOE_ACCUM_F32 && accum != MEGAMOE_ACCUM_F64) {
        return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT, "accum: unknown accumulation code %d",
                         static_cast<int>(accum));
    }
    return MEGAMOE_STATUS_SUCCESS;
}

// The output tensors: present, shaped, typed, on x's device, device memory, and not overlapping any input.
megamoe_status_t check_output(const char* name, const megamoe_tensor_t& out, const megamoe_tensor_t& x, int32_t ndim,
                              const char* dims, std::vector<int64_t> shape, megamoe_dtype_t want_a,
                              megamoe_dtype_t want_b, const char* rule, const std::vector<Named>& inputs) {
    MEGAMOE_CHECK(check_tensor(name, out, ndim, dims));
    MEGAMOE_CHECK(check_shape(name, out, shape, dims));
    MEGAMOE_CHECK(check_dtype(name, out, want_a, want_b, rule));
    MEGAMOE_CHECK(check_same_device(name, out, x));
    for (const Named& input : inputs) {
        if (overlaps(out, *input.tensor)) {
            return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT, "%s: overlaps the memory of %s", name, input.name);
        }
    }
    return MEGAMOE_STATUS_SUCCESS;
}

// The CUDA path lays buffers out at 256-byte offsets and picks kernels on their alignment: the base must be aligned
// too, so that the workspace size query (which sees no pointer) and the call agree.
constexpr uintptr_t kWorkspaceAlignment = 256;

megamoe_status_t check_workspace(const void* workspace, size_t have, size_t need) {
    if (have < need) {
        return set_error(MEGAMOE_STATUS_WORKSPACE_TOO_SMALL, "workspace_bytes: %zu given, %zu needed", have, need);
    }
    if (need > 0 && workspace == nullptr) return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT, "workspace: NULL");
    if (need > 0 && reinterpret_cast<uintptr_t>(workspace) % kWorkspaceAlignment != 0) {
        return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT, "workspace: must be %zu-byte aligned",
                         static_cast<size_t>(kWorkspaceAlignment));
    }
    return MEGAMOE_STATUS_SUCCESS;
}

megamoe_status_t validate_forward(const megamoe_forward_params_t* params, Shape* shape) {
    if (params == nullptr) return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT, "params: NULL");
    const megamoe_forward_params_t& p = *params;
    MEGAMOE_CHECK(check_inputs(p.x, p.topk_ids, p.topk_weights, p.w13, p.w2, p.accum, shape));
    const std::vector<Named> inputs = {
        {"x", &p.x}, {"topk_ids", &p.topk_ids}, {"topk_weights", &p.topk_weights}, {"w13", &p.w13}, {"w2", &p.w2}};
    MEGAMOE_CHECK(check_output("y", p.y, p.x, 2, "[T, H]", {shape->num_tokens, shape->hidden}, p.x.dtype, p.x.dtype,
                               "must equal the dtype of x", inputs));
    if (is_present(p.saved_h)) {
        MEGAMOE_CHECK(check_output("saved_h", p.saved_h, p.x, 2, "[T*topk, 2I]",
                                   {shape->num_slots(), 2 * shape->intermediate}, p.x.dtype, p.x.dtype,
                                   "must equal the dtype of x", inputs));
        if (overlaps(p.saved_h, p.y)) {
            return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT, "saved_h: overlaps the memory of y");
        }
    }
    return MEGAMOE_STATUS_SUCCESS;
}

megamoe_status_t validate_backward(const megamoe_backward_params_t* params, Shape* shape) {
    if (params == nullptr) return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT, "params: NULL");
    const megamoe_backward_params_t& p = *params;
    MEGAMOE_CHECK(check_inputs(p.x, p.topk_ids, p.topk_weights, p.w13, p.w2, p.accum, shape));
    const int64_t T = shape->num_tokens, H = shape->hidden, I = shape->intermediate, E = shape->num_experts;
    MEGAMOE_CHECK(check_tensor("dy", p.dy, 2, "[T, H]"));
    MEGAMOE_CHECK(check_shape("dy", p.dy, {T, H}, "[T, H] (as x)"));
    MEGAMOE_CHECK(check_dtype("dy", p.dy, p.x.dtype, p.x.dtype, "must equal the dtype of x"));
    MEGAMOE_CHECK(check_same_device("dy", p.dy, p.x));
    std::vector<Named> inputs = {
        {"dy", &p.dy},   {"x", &p.x},  {"topk_ids", &p.topk_ids}, {"topk_weights", &p.topk_weights},
        {"w13", &p.w13}, {"w2", &p.w2}};
    if (is_present(p.saved_h)) {
        MEGAMOE_CHECK(check_tensor("saved_h", p.saved_h, 2, "[T*topk, 2I]"));
        MEGAMOE_CHECK(check_shape("saved_h", p.saved_h, {shape->num_slots(), 2 * I}, "[T*topk, 2I]"));
        MEGAMOE_CHECK(check_dtype("saved_h", p.saved_h, p.x.dtype, p.x.dtype, "must equal the dtype of x"));
        MEGAMOE_CHECK(check_same_device("saved_h", p.saved_h, p.x));
        inputs.push_back({"saved_h", &p.saved_h});
    }
    const Named outputs[] = {{"dx", &p.dx}, {"dtopk_weights", &p.dtopk_weights}, {"dw13", &p.dw13}, {"dw2", &p.dw2}};
    if (is_present(p.dx)) {
        MEGAMOE_CHECK(check_output("dx", p.dx, p.x, 2, "[T, H]", {T, H}, p.x.dtype, p.x.dtype,
                                   "must equal the dtype of x", inputs));
    }
    if (is_present(p.dtopk_weights)) {
        MEGAMOE_CHECK(check_output("dtopk_weights", p.dtopk_weights, p.x, 2, "[T, topk]", {T, shape->topk},
                                   MEGAMOE_DTYPE_F32, p.topk_weights.dtype, "f32 or the dtype of topk_weights",
                                   inputs));
    }
    if (is_present(p.dw13)) {
        MEGAMOE_CHECK(check_output("dw13", p.dw13, p.x, 3, "[E, 2I, H]", {E, 2 * I, H}, p.w13.dtype, MEGAMOE_DTYPE_F32,
                                   "the dtype of w13 or f32", inputs));
    }
    if (is_present(p.dw2)) {
        MEGAMOE_CHECK(check_output("dw2", p.dw2, p.x, 3, "[E, H, I]", {E, H, I}, p.w2.dtype, MEGAMOE_DTYPE_F32,
                                   "the dtype of w2 or f32", inputs));
    }
    // Outputs must not overlap each other either.
    for (size_t a = 0; a < 4; ++a) {
        for (size_t b = a + 1; b < 4; ++b) {
            if (is_present(*outputs[a].tensor) && is_present(*outputs[b].tensor) &&
                overlaps(*outputs[a].tensor, *outputs[b].tensor)) {
                return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT, "%s: overlaps the memory of %s", outputs[b].name,
                                 outputs[a].name);
            }
        }
    }
    return MEGAMOE_STATUS_SUCCESS;
}

megamoe_status_t check_cuda_pointers(std::initializer_list<Named> tensors) {
    for (const Named& item : tensors) {
        if (is_present(*item.tensor)) MEGAMOE_CHECK(check_cuda_pointer(item.name, *item.tensor));
    }
    return MEGAMOE_STATUS_SUCCESS;
}

}  // namespace
}  // namespace megamoe

using megamoe::Shape;

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

megamoe_status_t megamoe_forward_workspace_size(const megamoe_forward_params_t* params, size_t* bytes) {
    megamoe::clear_error();
    if (bytes == nullptr) return megamoe::set_error(MEGAMOE_STATUS_INVALID_ARGUMENT, "bytes: NULL");
    Shape shape{};
    MEGAMOE_CHECK(megamoe::validate_forward(params, &shape));
    *bytes = params->x.device_type == MEGAMOE_DEVICE_CUDA ? megamoe::cuda::forward_workspace_size(*params, shape)
                                                          : megamoe::reference::forward_workspace_size(*params, shape);
    return MEGAMOE_STATUS_SUCCESS;
}

megamoe_status_t megamoe_backward_workspace_size(const megamoe_backward_params_t* params, size_t* bytes) {
    megamoe::clear_error();
    if (bytes == nullptr) return megamoe::set_error(MEGAMOE_STATUS_INVALID_ARGUMENT, "bytes: NULL");
    Shape shape{};
    MEGAMOE_CHECK(megamoe::validate_backward(params, &shape));
    *bytes = params->x.device_type == MEGAMOE_DEVICE_CUDA ? megamoe::cuda::backward_workspace_size(*params, shape)
                                                          : megamoe::reference::backward_workspace_size(*params, shape);
    return MEGAMOE_STATUS_SUCCESS;
}

megamoe_status_t megamoe_forward(const megamoe_forward_params_t* params) {
    megamoe::clear_error();
    Shape shape{};
    MEGAMOE_CHECK(megamoe::validate_forward(params, &shape));
    const megamoe_forward_params_t& p = *params;
    if (p.x.device_type == MEGAMOE_DEVICE_CPU) {
        MEGAMOE_CHECK(megamoe::check_cpu_ids(p.topk_ids, shape));
        MEGAMOE_CHECK(megamoe::check_workspace(p.workspace, p.workspace_bytes,
                                               megamoe::reference::forward_workspace_size(p, shape)));
        return megamoe::reference::forward(p, shape);
    }
    MEGAMOE_CHECK(megamoe::check_cuda_pointers({{"x", &p.x},
                                                {"topk_ids", &p.topk_ids},
                                                {"topk_weights", &p.topk_weights},
                                                {"w13", &p.w13},
                                                {"w2", &p.w2},
                                                {"y", &p.y},
                                                {"saved_h", &p.saved_h}}));
    MEGAMOE_CHECK(
        megamoe::check_workspace(p.workspace, p.workspace_bytes, megamoe::cuda::forward_workspace_size(p, shape)));
    return megamoe::cuda::forward(p, shape);
}

megamoe_status_t megamoe_backward(const megamoe_backward_params_t* params) {
    megamoe::clear_error();
    Shape shape{};
    MEGAMOE_CHECK(megamoe::validate_backward(params, &shape));
    const megamoe_backward_params_t& p = *params;
    if (p.x.device_type == MEGAMOE_DEVICE_CPU) {
        MEGAMOE_CHECK(megamoe::check_cpu_ids(p.topk_ids, shape));
        MEGAMOE_CHECK(megamoe::check_workspace(p.workspace, p.workspace_bytes,
                                               megamoe::reference::backward_workspace_size(p, shape)));
        return megamoe::reference::backward(p, shape);
    }
    MEGAMOE_CHECK(megamoe::check_cuda_pointers({{"dy", &p.dy},
                                                {"x", &p.x},
                                                {"topk_ids", &p.topk_ids},
                                                {"topk_weights", &p.topk_weights},
                                                {"w13", &p.w13},
                                                {"w2", &p.w2},
                                                {"saved_h", &p.saved_h},
                                                {"dx", &p.dx},
                                                {"dtopk_weights", &p.dtopk_weights},
                                                {"dw13", &p.dw13},
                                                {"dw2", &p.dw2}}));
    MEGAMOE_CHECK(
        megamoe::check_workspace(p.workspace, p.workspace_bytes, megamoe::cuda::backward_workspace_size(p, shape)));
    return megamoe::cuda::backward(p, shape);
}

}  // extern "C"
