// The tensor checks under every entry point's validation (validate.h): a bad tensor gives a status and a message
// naming it, never a crash.
#include "api/validate.h"

#if MEGAMOE_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

#include <cinttypes>
#include <string>

#include "dtype.h"

namespace megamoe {
namespace {

bool is_valid_dtype(megamoe_dtype_t dtype) {
    return dtype >= MEGAMOE_DTYPE_BF16 && dtype <= MEGAMOE_DTYPE_E4M3;
}

// A CUDA tensor's pointer must be device (or managed) memory of its device: a host pointer labelled
// CUDA would otherwise crash a kernel.
// A CPU-only build (MEGAMOE_WITH_CUDA=0) refuses every CUDA tensor here (and the entry points before, api.cpp).
megamoe_status_t check_cuda_pointer(const char* name, const megamoe_tensor_t& tensor) {
    if (tensor.device_type != MEGAMOE_DEVICE_CUDA || numel(tensor) == 0) return MEGAMOE_STATUS_SUCCESS;
#if !MEGAMOE_WITH_CUDA
    return set_error(MEGAMOE_STATUS_NOT_SUPPORTED,
                     "%s: a CUDA tensor, but this libmegamoe.so was built without CUDA (CPU reference only: no nvcc "
                     "when it was built)",
                     name);
#else
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
#endif
}

// Whether the element count of a tensor (non-negative extents) times the widest dtype's 8 bytes fits in int64_t: the
// element and byte counts computed from its shape cannot overflow.
bool fits_in_memory(const megamoe_tensor_t& tensor) {
    constexpr int64_t kMaxElements = INT64_MAX / 8;
    int64_t count = 1;
    bool empty = false;
    bool overflow = false;
    for (int32_t dim = 0; dim < tensor.ndim; ++dim) {
        if (tensor.shape[dim] == 0) empty = true;
        if (overflow || empty) continue;
        overflow = tensor.shape[dim] > kMaxElements / count;
        if (!overflow) count *= tensor.shape[dim];
    }
    return empty || !overflow;
}

// The CUDA path lays buffers out at 256-byte offsets and picks kernels on their alignment: the base must be aligned
// too, so that the workspace size query (which sees no pointer) and the call agree.
constexpr uintptr_t kWorkspaceAlignment = 256;

}  // namespace

std::string shape_string(const megamoe_tensor_t& tensor) {
    std::string text = "[";
    for (int32_t dim = 0; dim < tensor.ndim && dim < MEGAMOE_MAX_DIMS; ++dim) {
        text += (dim ? ", " : "") + std::to_string(tensor.shape[dim]);
    }
    return text + "]";
}

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
    if (!fits_in_memory(tensor)) {  // numel and the byte sizes below may not overflow
        return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT, "%s: shape %s has more elements than memory can hold", name,
                         shape_string(tensor).c_str());
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

megamoe_status_t check_same_device(const char* name, const megamoe_tensor_t& tensor, const megamoe_tensor_t& x,
                                   const char* x_name) {
    const bool same = tensor.device_type == x.device_type &&
                      (x.device_type == MEGAMOE_DEVICE_CPU || tensor.device_index == x.device_index);
    if (!same) {
        return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT,
                         "%s: on %s:%d but %s is on %s:%d; all tensors must share a device", name,
                         tensor.device_type == MEGAMOE_DEVICE_CUDA ? "cuda" : "cpu", tensor.device_index, x_name,
                         x.device_type == MEGAMOE_DEVICE_CUDA ? "cuda" : "cpu", x.device_index);
    }
    return MEGAMOE_STATUS_SUCCESS;
}

bool overlaps(const megamoe_tensor_t& a, const megamoe_tensor_t& b) {
    if (!a.data || !b.data || numel(a) == 0 || numel(b) == 0) return false;
    const auto a_begin = reinterpret_cast<uintptr_t>(a.data), b_begin = reinterpret_cast<uintptr_t>(b.data);
    const auto a_end = a_begin + numel(a) * dtype_size(a.dtype), b_end = b_begin + numel(b) * dtype_size(b.dtype);
    return a_begin < b_end && b_begin < a_end;
}

megamoe_status_t check_input(const char* name, const megamoe_tensor_t& input, const megamoe_tensor_t& x,
                             const char* x_name, int32_t ndim, const char* dims, std::vector<int64_t> shape,
                             megamoe_dtype_t want_a, megamoe_dtype_t want_b, const char* rule) {
    MEGAMOE_CHECK(check_tensor(name, input, ndim, dims));
    MEGAMOE_CHECK(check_shape(name, input, std::move(shape), dims));
    MEGAMOE_CHECK(check_dtype(name, input, want_a, want_b, rule));
    return check_same_device(name, input, x, x_name);
}

megamoe_status_t check_output(const char* name, const megamoe_tensor_t& out, const megamoe_tensor_t& x,
                              const char* x_name, int32_t ndim, const char* dims, std::vector<int64_t> shape,
                              megamoe_dtype_t want_a, megamoe_dtype_t want_b, const char* rule,
                              const std::vector<Named>& inputs) {
    MEGAMOE_CHECK(check_input(name, out, x, x_name, ndim, dims, std::move(shape), want_a, want_b, rule));
    for (const Named& input : inputs) {
        if (overlaps(out, *input.tensor)) {
            return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT, "%s: overlaps the memory of %s", name, input.name);
        }
    }
    return MEGAMOE_STATUS_SUCCESS;
}

megamoe_status_t check_outputs_disjoint(const std::vector<Named>& outputs) {
    for (auto a = outputs.begin(); a != outputs.end(); ++a) {
        for (auto b = a + 1; b != outputs.end(); ++b) {
            if (is_present(*a->tensor) && is_present(*b->tensor) && overlaps(*a->tensor, *b->tensor)) {
                return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT, "%s: overlaps the memory of %s", b->name, a->name);
            }
        }
    }
    return MEGAMOE_STATUS_SUCCESS;
}

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

megamoe_status_t check_cuda_pointers(const std::vector<Named>& tensors) {
    for (const Named& item : tensors) {
        if (is_present(*item.tensor)) MEGAMOE_CHECK(check_cuda_pointer(item.name, *item.tensor));
    }
    return MEGAMOE_STATUS_SUCCESS;
}

}  // namespace megamoe
