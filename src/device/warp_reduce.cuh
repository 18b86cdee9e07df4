// Fixed-order reductions of the portable CUDA kernels (device code: include from .cu files only): the largest value
// of a warp, and the sum over a block in warp order.
#pragma once

#include "device/cuda_utils.h"

namespace megamoe::cuda {

// The largest of the warp's values, in every lane (a butterfly of fmaxf: NaN lanes are skipped where others are not).
__device__ __forceinline__ float warp_max(float value) {
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
        value = fmaxf(value, __shfl_xor_sync(kFullMask, value, offset));
    }
    return value;
}

// Sum over a block of kThreads threads in a fixed order: a butterfly within each warp, then the warp sums in warp
// order (warp_sums: kThreads / kWarpSize floats of shared memory). Every thread gets the total.
template <int kThreads>
__device__ float block_sum(float value, float* warp_sums) {
    static_assert(kThreads % kWarpSize == 0, "block_sum reduces whole warps");
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2) value += __shfl_xor_sync(kFullMask, value, offset);
    if (threadIdx.x % kWarpSize == 0) warp_sums[threadIdx.x / kWarpSize] = value;
    __syncthreads();
    float total = 0.0f;
    for (int warp_idx = 0; warp_idx < kThreads / kWarpSize; ++warp_idx) total += warp_sums[warp_idx];
    return total;
}

}  // namespace megamoe::cuda
