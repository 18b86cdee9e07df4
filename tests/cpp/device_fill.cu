// Pseudo-random device fills for tests (device_fill.h): splitmix64 of (seed, index) -> uniform [-a, a).
#include "device_fill.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>

namespace megamoe::test {
namespace {

constexpr int kFillThreads = 256;
constexpr int64_t kMaxFillBlocks = 65536;

__device__ __forceinline__ uint64_t splitmix64(uint64_t value) {
    value += 0x9e3779b97f4a7c15ull;
    value = (value ^ (value >> 30)) * 0xbf58476d1ce4e5b9ull;
    value = (value ^ (value >> 27)) * 0x94d049bb133111ebull;
    return value ^ (value >> 31);
}

template <typename T>
__device__ __forceinline__ T convert(float value);
template <>
__device__ __forceinline__ __nv_bfloat16 convert<__nv_bfloat16>(float value) {
    return __float2bfloat16_rn(value);
}
template <>
__device__ __forceinline__ __half convert<__half>(float value) {
    return __float2half_rn(value);
}
template <>
__device__ __forceinline__ float convert<float>(float value) {
    return value;
}

template <typename T>
__global__ void __launch_bounds__(kFillThreads) fill_kernel(T* data, int64_t count, uint64_t seed, float half_width) {
    const int64_t stride = static_cast<int64_t>(gridDim.x) * kFillThreads;
    for (int64_t idx = static_cast<int64_t>(blockIdx.x) * kFillThreads + threadIdx.x; idx < count; idx += stride) {
        const uint64_t bits = splitmix64(seed ^ splitmix64(static_cast<uint64_t>(idx)));
        const float unit = static_cast<float>(bits >> 40) * (1.0f / 16777216.0f);  // [0, 1)
        data[idx] = convert<T>((2.0f * unit - 1.0f) * half_width);
    }
}

}  // namespace

cudaError_t device_fill_uniform(void* data, megamoe_dtype_t dtype, int64_t count, uint64_t seed, float std_dev) {
    if (count == 0) return cudaSuccess;
    const float half_width = std_dev * std::sqrt(3.0f);  // uniform [-a, a) has std a / sqrt(3)
    const auto num_blocks = static_cast<unsigned>(std::min(kMaxFillBlocks, (count + kFillThreads - 1) / kFillThreads));
    switch (dtype) {
        case MEGAMOE_DTYPE_BF16:
            fill_kernel<<<num_blocks, kFillThreads>>>(static_cast<__nv_bfloat16*>(data), count, seed, half_width);
            break;
        case MEGAMOE_DTYPE_F16:
            fill_kernel<<<num_blocks, kFillThreads>>>(static_cast<__half*>(data), count, seed, half_width);
            break;
        default:
            fill_kernel<<<num_blocks, kFillThreads>>>(static_cast<float*>(data), count, seed, half_width);
            break;
    }
    return cudaGetLastError();
}

}  // namespace megamoe::test
