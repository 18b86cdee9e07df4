#include "portable/fp8_quant.h"

#include <cuda_fp8.h>

#include <algorithm>

#include "device/cuda_utils.h"

namespace megamoe::cuda {
namespace {

constexpr int kQuantWarpSize = 32;
constexpr int kQuantThreads = 256;  // 8 groups per block, one per warp
constexpr int kColsPerLane = kFp8GroupSize / kQuantWarpSize;
constexpr int64_t kMaxQuantBlocks = 65535;
constexpr float kE4M3Max = 448.0f;
constexpr uint8_t kE4M3NanBits = 0x7F;
static_assert(kColsPerLane == 4, "a lane quantizes 4 columns of its group (one 32-bit store of q)");

// The smallest power of two >= scale (scale positive and finite, at least the smallest denormal).
__device__ __forceinline__ float next_pow2(float scale) {
    const uint32_t bits = __float_as_uint(scale);
    const uint32_t exponent = bits >> 23;
    const uint32_t mantissa = bits & 0x7FFFFFu;
    if (exponent == 0) {  // denormal: m 2^-149, the next power of two of m
        const uint32_t pow2 = (mantissa & (mantissa - 1)) == 0 ? mantissa : 1u << (32 - __clz(mantissa));
        return __uint_as_float(pow2);  // 1 << 23 is the smallest normal, 2^-126
    }
    return mantissa == 0 ? scale : __uint_as_float((exponent + 1) << 23);
}

// The group's scale from its amax and whether it holds a non-finite value (fp8_reference._scales_from_amax).
__device__ __forceinline__ float group_scale(float amax, bool non_finite, bool pow2) {
    if (non_finite) return __uint_as_float(0x7FC00000u);
    if (amax == 0.0f) return 1.0f;
    float scale = fmaxf(__fdiv_rn(amax, kE4M3Max), __uint_as_float(1u));  // at least 2^-149
    return pow2 ? next_pow2(scale) : scale;
}

__global__ void __launch_bounds__(kQuantThreads) quantize_groups_kernel(const QuantizeGroupsArgs args) {
    const int lane_idx = static_cast<int>(threadIdx.x) % kQuantWarpSize;
    const int64_t groups_per_row = ceil_div(args.cols, static_cast<int64_t>(kFp8GroupSize));
    const int64_t num_groups = args.rows * groups_per_row;
    const int64_t warps_per_grid = static_cast<int64_t>(gridDim.x) * (kQuantThreads / kQuantWarpSize);
    for (int64_t group_idx = static_cast<int64_t>(blockIdx.x) * (kQuantThreads / kQuantWarpSize) +
                             static_cast<int>(threadIdx.x) / kQuantWarpSize;
         group_idx < num_groups; group_idx += warps_per_grid) {
        const int64_t row_idx = group_idx / groups_per_row;
        const int64_t first_col = (group_idx % groups_per_row) * kFp8GroupSize + lane_idx * kColsPerLane;
        float values[kColsPerLane];
        float amax = 0.0f;
        bool non_finite = false;
#pragma unroll
        for (int i = 0; i < kColsPerLane; ++i) {
            const int64_t col = first_col + i;
            values[i] =
                col < args.cols ? load_scalar(args.in, args.in_dtype, row_idx * args.in_row_stride + col) : 0.0f;
            non_finite |= !isfinite(values[i]);
            amax = fmaxf(amax, fabsf(values[i]));
        }
#pragma unroll
        for (int offset = kQuantWarpSize / 2; offset > 0; offset /= 2) {
            amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, offset));
        }
        non_finite = __any_sync(0xFFFFFFFFu, non_finite);
        const float scale = group_scale(amax, non_finite, args.pow2);
        uint8_t* q_row = args.q + row_idx * args.cols;
#pragma unroll
        for (int i = 0; i < kColsPerLane; ++i) {
            const int64_t col = first_col + i;
            if (col >= args.cols) break;
            const float ratio = fminf(fmaxf(__fdiv_rn(values[i], scale), -kE4M3Max), kE4M3Max);
            q_row[col] = non_finite ? kE4M3NanBits
                                    : static_cast<uint8_t>(__nv_cvt_float_to_fp8(ratio, __NV_SATFINITE, __NV_E4M3));
        }
        if (lane_idx == 0) args.scales[group_idx] = scale;
    }
}

}  // namespace

megamoe_status_t launch_quantize_groups(const QuantizeGroupsArgs& args, cudaStream_t stream) {
    if (args.rows == 0 || args.cols == 0) return MEGAMOE_STATUS_SUCCESS;
    if (args.in == nullptr || args.q == nullptr || args.scales == nullptr || args.rows < 0 || args.cols < 0 ||
        args.in_row_stride < args.cols) {
        return set_error(MEGAMOE_STATUS_INTERNAL_ERROR, "quantize_groups: in, q, scales and a row stride >= cols");
    }
    const int64_t num_groups = args.rows * ceil_div(args.cols, static_cast<int64_t>(kFp8GroupSize));
    const int64_t groups_per_block = kQuantThreads / kQuantWarpSize;
    const dim3 grid(static_cast<unsigned>(std::min(ceil_div(num_groups, groups_per_block), kMaxQuantBlocks)));
    quantize_groups_kernel<<<grid, kQuantThreads, 0, stream>>>(args);
    return check_launch("quantize_groups_kernel");
}

}  // namespace megamoe::cuda
