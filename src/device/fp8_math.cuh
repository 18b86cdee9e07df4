// The blockwise FP8 recipe's per-group math (python/megamoe/fp8_reference.py, bit for bit), shared by the
// quantization kernels (portable/fp8_quant.cu) and the epilogues that quantize what they write (sm90): a group's amax
// and non-finite flag, its scale (amax / 448, or the next power of two, at least 2^-149; 1 for a group of zeros; NaN
// for a group holding a NaN or an infinity), the factor its values are multiplied by (DeepSeek-V3's cast, x * (448 /
// amax): one division per group, a multiplication per value) and the e4m3 byte of each value (value * factor clamped
// to +-448, round to nearest even; 0x7F in a non-finite group).
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

#include "device/cuda_utils.h"
#include "device/warp_reduce.cuh"

namespace megamoe::cuda {

constexpr float kE4M3Max = 448.0f;
constexpr uint8_t kE4M3NanBits = 0x7F;

// A group's amax and whether it holds a NaN or an infinity, accumulated value by value, then over the lanes that share
// the group (the warp, or a quad of lanes).
struct GroupStats {
    float amax = 0.0f;
    bool non_finite = false;
    __device__ __forceinline__ void add(float value) {
        non_finite |= !isfinite(value);
        amax = fmaxf(amax, fabsf(value));
    }
    __device__ __forceinline__ void reduce_over_warp() {
        amax = warp_max(amax);
        non_finite = __any_sync(kFullMask, non_finite);
    }
    // Over the 4 lanes of each quad (lanes 4 q .. 4 q + 3), every lane of the warp taking part.
    __device__ __forceinline__ void reduce_over_quad() {
#pragma unroll
        for (int mask = 1; mask <= 2; mask *= 2) {
            amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, mask));
            non_finite |= __shfl_xor_sync(kFullMask, static_cast<int>(non_finite), mask) != 0;
        }
    }
};

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

// The group's scale (fp8_reference._scales_from_amax).
__device__ __forceinline__ float group_scale(const GroupStats& stats, bool pow2) {
    if (stats.non_finite) return __uint_as_float(0x7FC00000u);
    if (stats.amax == 0.0f) return 1.0f;
    const float scale = fmaxf(__fdiv_rn(stats.amax, kE4M3Max), __uint_as_float(1u));  // at least 2^-149
    return pow2 ? next_pow2(scale) : scale;
}

// The factor of a group of the given scale: 448 / amax (IEEE division) with the amax / 448 scales, 1 / scale (exact)
// with power-of-two ones, 1 for a group of zeros; at most the largest finite f32 (amax below ~1.3e-36, or a
// power-of-two scale below 2^-127, would give an infinity, and 0 x infinity a NaN); 0, unused, in a non-finite group.
__device__ __forceinline__ float group_factor(const GroupStats& stats, float scale, bool pow2) {
    if (stats.non_finite) return 0.0f;
    if (stats.amax == 0.0f) return 1.0f;
    const float factor = pow2 ? __frcp_rn(scale) : __fdiv_rn(kE4M3Max, stats.amax);
    return fminf(factor, __uint_as_float(0x7F7FFFFFu));
}

// The e4m3 byte of value * factor (one f32 multiplication, round to nearest even; clamped to +-448, then round to
// nearest even to e4m3), 0x7F for a non-finite group.
__device__ __forceinline__ uint8_t quantize_value(float value, float factor, bool non_finite) {
    if (non_finite) return kE4M3NanBits;
    const float ratio = fminf(fmaxf(__fmul_rn(value, factor), -kE4M3Max), kE4M3Max);
    return static_cast<uint8_t>(__nv_cvt_float_to_fp8(ratio, __NV_SATFINITE, __NV_E4M3));
}

}  // namespace megamoe::cuda
