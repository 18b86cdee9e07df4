// The blockwise FP8 recipe's per-group math (python/megamoe/fp8_reference.py, bit for bit), shared by the
// quantization kernels (portable/fp8_quant.cu) and the epilogues that quantize what they write (sm90): a group's amax
// and non-finite flag, its scale (amax / 448, or the next power of two, at least 2^-149; 1 for a group of zeros; NaN
// for a group holding a NaN or an infinity) and the e4m3 byte of each value (value / scale clamped to +-448, round to
// nearest even; 0x7F in a non-finite group).
#pragma once

#include <cuda_fp8.h>

#include <cstdint>
#include <cstring>

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

// The bits of a float, and the correctly rounded reciprocal and quotient, on the device and (for the CPU tests of
// GroupQuantizer) the host.
__host__ __device__ __forceinline__ uint32_t float_bits(float value) {
#ifdef __CUDA_ARCH__
    return __float_as_uint(value);
#else
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof(bits));
    return bits;
#endif
}
__host__ __device__ __forceinline__ float reciprocal_rn(float value) {
#ifdef __CUDA_ARCH__
    return __frcp_rn(value);
#else
    return 1.0f / value;
#endif
}
__host__ __device__ __forceinline__ float quotient_rn(float dividend, float divisor) {
#ifdef __CUDA_ARCH__
    return __fdiv_rn(dividend, divisor);
#else
    return dividend / divisor;
#endif
}

// The e4m3 bytes of a group: value / scale as the IEEE division rounds it (the reference's), clamped to +-448, rounded
// to nearest even; 0x7F for a non-finite group. The quotient is taken as value * (1 / scale) (both correctly rounded:
// within 3 units in the last place of the division's) wherever no e4m3 rounding midpoint lies within 4 units of it
// (its low 20 mantissa bits, those e4m3 drops, not within 4 of 0x80000), so both round to the same byte; else (near a
// midpoint, in e4m3's subnormal range below 2^-6, or a reciprocal that overflows) by the division itself.
struct GroupQuantizer {
    static constexpr uint32_t kDroppedBitsMask = (1u << 20) - 1;  // f32's mantissa bits below e4m3's 3
    static constexpr uint32_t kMidpoint = 1u << 19;
    static constexpr uint32_t kMidpointMargin = 4;
    static constexpr uint32_t kE4M3MinNormalBits = 0x3C800000u;  // 2^-6

    float scale;
    float scale_rcp;
    bool non_finite;
    bool exact_only;  // the reciprocal overflows (a scale below 2^-126): every quotient by division

    __host__ __device__ __forceinline__ GroupQuantizer(float group_scale, bool group_non_finite)
        : scale(group_scale),
          scale_rcp(reciprocal_rn(group_scale)),
          non_finite(group_non_finite),
          exact_only(!(float_bits(reciprocal_rn(group_scale)) < 0x7F800000u)) {}

    // Whether a quotient q (as float bits without the sign) may round to another e4m3 byte than one within 3 units of
    // it: near a midpoint of e4m3's normal grid, or in its subnormal range (where the midpoints sit elsewhere).
    __host__ __device__ static __forceinline__ bool near_midpoint(uint32_t magnitude_bits) {
        const uint32_t dropped = magnitude_bits & kDroppedBitsMask;
        const uint32_t distance = dropped > kMidpoint ? dropped - kMidpoint : kMidpoint - dropped;
        return magnitude_bits < kE4M3MinNormalBits || distance <= kMidpointMargin;
    }

    __host__ __device__ __forceinline__ uint8_t operator()(float value) const {
        if (non_finite) return kE4M3NanBits;
        float ratio = value * scale_rcp;
        if (exact_only || near_midpoint(float_bits(ratio) & 0x7FFFFFFFu)) ratio = quotient_rn(value, scale);
        ratio = fminf(fmaxf(ratio, -kE4M3Max), kE4M3Max);
        return static_cast<uint8_t>(__nv_cvt_float_to_fp8(ratio, __NV_SATFINITE, __NV_E4M3));
    }
};

}  // namespace megamoe::cuda
