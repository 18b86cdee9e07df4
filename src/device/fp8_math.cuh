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

// A group's stats from 16-bit values (T: bf16 or half) taken two per 32-bit word: the maxima of their magnitude bits,
// two lanes at a time (one VIMNMX3.U16x2 per two words). Magnitude bits order finite values as their magnitudes do,
// and an infinity (all exponent bits) or a NaN (above) has larger bits than any finite value, so the group holds a
// non-finite value exactly when its maximum reaches the infinity's bits; the amax is that maximum's value otherwise:
// GroupStats::add of the same values, bit for bit, at ~1 instruction per two values instead of ~4 per value.
template <typename T>
struct PackedGroupStats {
    static constexpr uint32_t kMagnitudeMask = 0x7FFF7FFFu;
    uint32_t max_bits = 0;  // two 16-bit maxima of magnitude bits
    __device__ __forceinline__ void add(uint32_t word) { max_bits = __vmaxu2(max_bits, word & kMagnitudeMask); }
    // Over each aligned run of kLanes lanes (a power of two, at most a warp), every lane of the warp taking part.
    template <int kLanes>
    __device__ __forceinline__ void reduce_over_lanes() {
        static_assert(kLanes > 0 && kLanes <= kWarpSize && (kLanes & (kLanes - 1)) == 0, "a power of two lanes");
#pragma unroll
        for (int mask = 1; mask < kLanes; mask *= 2)
            max_bits = __vmaxu2(max_bits, __shfl_xor_sync(kFullMask, max_bits, mask));
    }
    __device__ __forceinline__ void reduce_over_quad() {
        reduce_over_lanes<4>();
    }
    __device__ __forceinline__ GroupStats stats() const;
};

template <>
__device__ __forceinline__ GroupStats PackedGroupStats<__nv_bfloat16>::stats() const {
    const uint32_t bits = max(max_bits & 0xFFFFu, max_bits >> 16);
    GroupStats stats;
    stats.non_finite = bits >= 0x7F80u;
    stats.amax = stats.non_finite ? 0.0f : __uint_as_float(bits << 16);
    return stats;
}

template <>
__device__ __forceinline__ GroupStats PackedGroupStats<__half>::stats() const {
    const uint32_t bits = max(max_bits & 0xFFFFu, max_bits >> 16);
    GroupStats stats;
    stats.non_finite = bits >= 0x7C00u;
    stats.amax = stats.non_finite ? 0.0f : __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
    return stats;
}

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

// The e4m3 bytes of two values of a finite group times its factor (byte 0: first) by one paired conversion
// (F2FP.SATFINITE.E4M3.F32.PACK_AB): quantize_value's bytes, bit for bit (its clamp to +-448 is what the saturating
// conversion does to a product beyond 448 anyway; a finite group's products are finite).
__device__ __forceinline__ uint32_t quantize_pair(float first, float second, float factor) {
    return __nv_cvt_float2_to_fp8x2(make_float2(__fmul_rn(first, factor), __fmul_rn(second, factor)), __NV_SATFINITE,
                                    __NV_E4M3);
}

// The 8 e4m3 bytes of a 16-byte chunk of 8 16-bit values (value i: byte i) by the group's factor; all kE4M3NanBits in a
// non-finite group.
template <typename T>
__device__ __forceinline__ uint2 quantize_chunk(const uint32_t (&words)[4], float factor, bool non_finite) {
    uint32_t pairs[4];
#pragma unroll
    for (int word_idx = 0; word_idx < 4; ++word_idx) {
        float first, second;
        unpack_pair<T>(words[word_idx], first, second);
        pairs[word_idx] = quantize_pair(first, second, factor);
    }
    constexpr uint32_t kNanWord = 0x01010101u * kE4M3NanBits;
    const uint32_t low = __byte_perm(pairs[0], pairs[1], 0x5410), high = __byte_perm(pairs[2], pairs[3], 0x5410);
    return non_finite ? make_uint2(kNanWord, kNanWord) : make_uint2(low, high);
}

}  // namespace megamoe::cuda
