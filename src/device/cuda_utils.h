// Helpers shared by the portable CUDA path (any sm_80+ GPU):
//   - launch checks that turn a CUDA error into a megamoe status naming the kernel;
//   - DeviceGuard, which makes the tensors' device current for one call and restores the caller's;
//   - WorkspaceCarver, which cuts 256-byte aligned buffers out of the caller's workspace (with a
//     NULL base it only counts bytes, so the *_workspace_size functions run the very same carve);
//   - element conversions (bf16 / f16 <-> f32) and scalar loads of a runtime dtype on the device;
//   - slot_of_row and load_weight, which read a sorted row's slot and weight where grouped rows have neither
//     (NULL gather slots: row r is slot r; NULL weights: 1);
//   - the warp's size and full mask (the reductions over a warp and a block: warp_reduce.cuh).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "common.h"

namespace megamoe::cuda {

constexpr size_t kWorkspaceAlignment = 256;
constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;

__host__ __device__ constexpr int64_t ceil_div(int64_t value, int64_t divisor) {
    return (value + divisor - 1) / divisor;
}

__host__ __device__ constexpr size_t align_up(size_t value, size_t alignment) {
    return (value + alignment - 1) / alignment * alignment;
}

// Returns an error status naming `kernel_name` when the last launch (or any earlier async work the
// runtime already knows about) failed.
inline megamoe_status_t check_launch(const char* kernel_name) {
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return set_error(MEGAMOE_STATUS_CUDA_ERROR, "%s: %s", kernel_name, cudaGetErrorString(err));
    return MEGAMOE_STATUS_SUCCESS;
}

inline megamoe_status_t check_cuda(cudaError_t err, const char* what) {
    if (err != cudaSuccess) return set_error(MEGAMOE_STATUS_CUDA_ERROR, "%s: %s", what, cudaGetErrorString(err));
    return MEGAMOE_STATUS_SUCCESS;
}

// The CUDA code's name of MEGAMOE_CHECK (common.h).
#define MEGAMOE_CUDA_RETURN_IF_ERROR(expr) MEGAMOE_CHECK(expr)

// Makes `device_index` current for the guard's lifetime; the caller's device comes back after.
class DeviceGuard {
  public:
    explicit DeviceGuard(int device_index) {
        status_ = check_cuda(cudaGetDevice(&previous_), "cudaGetDevice");
        if (status_ == MEGAMOE_STATUS_SUCCESS && previous_ != device_index) {
            status_ = check_cuda(cudaSetDevice(device_index), "cudaSetDevice");
            switched_ = status_ == MEGAMOE_STATUS_SUCCESS;
        }
    }
    ~DeviceGuard() {
        if (switched_) cudaSetDevice(previous_);
    }
    DeviceGuard(const DeviceGuard&) = delete;
    DeviceGuard& operator=(const DeviceGuard&) = delete;
    megamoe_status_t status() const { return status_; }

  private:
    int previous_ = 0;
    bool switched_ = false;
    megamoe_status_t status_ = MEGAMOE_STATUS_SUCCESS;
};

// Cuts aligned buffers out of a workspace, in order. With a NULL base every pointer is NULL and only
// bytes_used() matters: the size query and the real call share one carve.
class WorkspaceCarver {
  public:
    explicit WorkspaceCarver(void* base) : base_(static_cast<char*>(base)) {}

    template <typename T>
    T* take(int64_t num_elements) {
        T* ptr = base_ == nullptr ? nullptr : reinterpret_cast<T*>(base_ + num_bytes_);
        num_bytes_ += align_up(static_cast<size_t>(num_elements) * sizeof(T), kWorkspaceAlignment);
        return ptr;
    }
    size_t bytes_used() const { return num_bytes_; }

  private:
    char* base_;
    size_t num_bytes_ = 0;
};

// The element type the CUDA path computes in for `dtype` (bf16, else f16: the entry points accept no other), as the
// argument of `launch(ElementTag<T>{})`: one place that maps a call's dtype to its kernels' template argument.
template <typename T>
struct ElementTag {
    using Type = T;
};
template <class Launch>
decltype(auto) with_element_type(megamoe_dtype_t dtype, Launch&& launch) {
    if (dtype == MEGAMOE_DTYPE_BF16) return launch(ElementTag<__nv_bfloat16>{});
    return launch(ElementTag<__half>{});
}

// Element conversions of the two 16-bit types the CUDA path computes in.
template <typename T>
__device__ __forceinline__ float to_float(T value);
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 value) {
    return __bfloat162float(value);
}
template <>
__device__ __forceinline__ float to_float<__half>(__half value) {
    return __half2float(value);
}

template <typename T>
__device__ __forceinline__ T from_float(float value);
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float value) {
    return __float2bfloat16_rn(value);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float value) {
    return __float2half_rn(value);
}

// Two floats rounded into one packed 32-bit pair (first value in the low half).
template <typename T>
__device__ __forceinline__ uint32_t pack_pair(float first, float second) {
    const T lo = from_float<T>(first), hi = from_float<T>(second);
    return static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(&lo)) |
           (static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(&hi)) << 16);
}

// The two values of a packed 32-bit pair (first value in the low half) as floats.
template <typename T>
__device__ __forceinline__ void unpack_pair(uint32_t word, float& first, float& second) {
    const uint16_t lo = static_cast<uint16_t>(word & 0xffffu), hi = static_cast<uint16_t>(word >> 16);
    first = to_float(*reinterpret_cast<const T*>(&lo));
    second = to_float(*reinterpret_cast<const T*>(&hi));
}

#if defined(__CUDACC__)
// The elements of one 16-byte load of T (8 bf16 / f16 or 4 f32) as floats.
template <typename T>
__device__ __forceinline__ void unpack_chunk(const uint4& raw, float (&values)[16 / sizeof(T)]) {
    if constexpr (sizeof(T) == 4) {
        values[0] = __uint_as_float(raw.x);
        values[1] = __uint_as_float(raw.y);
        values[2] = __uint_as_float(raw.z);
        values[3] = __uint_as_float(raw.w);
    } else {
        unpack_pair<T>(raw.x, values[0], values[1]);
        unpack_pair<T>(raw.y, values[2], values[3]);
        unpack_pair<T>(raw.z, values[4], values[5]);
        unpack_pair<T>(raw.w, values[6], values[7]);
    }
}
#endif  // __CUDACC__

// Scalars whose dtype is only known at run time (topk_weights, d topk_weights: f32, bf16 or f16).
__device__ __forceinline__ float load_scalar(const void* data, megamoe_dtype_t dtype, int64_t idx) {
    switch (dtype) {
        case MEGAMOE_DTYPE_BF16:
            return __bfloat162float(static_cast<const __nv_bfloat16*>(data)[idx]);
        case MEGAMOE_DTYPE_F16:
            return __half2float(static_cast<const __half*>(data)[idx]);
        default:
            return static_cast<const float*>(data)[idx];
    }
}

__device__ __forceinline__ void store_scalar(void* data, megamoe_dtype_t dtype, int64_t idx, float value) {
    switch (dtype) {
        case MEGAMOE_DTYPE_BF16:
            static_cast<__nv_bfloat16*>(data)[idx] = __float2bfloat16_rn(value);
            break;
        case MEGAMOE_DTYPE_F16:
            static_cast<__half*>(data)[idx] = __float2half_rn(value);
            break;
        default:
            static_cast<float*>(data)[idx] = value;
            break;
    }
}

// The slot of sorted row `row_idx`: gather_slots[row_idx], or the row itself where rows are not gathered (grouped
// rows: row r of x_sorted is slot r).
__device__ __forceinline__ int64_t slot_of_row(const int* gather_slots, int64_t row_idx) {
    return gather_slots != nullptr ? gather_slots[row_idx] : row_idx;
}

// The weight of slot `slot_idx`: weights[slot_idx] (f32, bf16 or f16), or 1 where there are none (grouped rows
// without scores).
__device__ __forceinline__ float load_weight(const void* weights, megamoe_dtype_t dtype, int64_t slot_idx) {
    return weights != nullptr ? load_scalar(weights, dtype, slot_idx) : 1.0f;
}

inline bool is_aligned(const void* ptr, size_t alignment) {
    return reinterpret_cast<uintptr_t>(ptr) % alignment == 0;
}

}  // namespace megamoe::cuda
