// The host port of python/megamoe/fp8_reference.py's quantization rules that the FP8 quantization kernels' tests hold
// them to bit for bit (test_fp8_quant_cuda.cpp, test_fp8_quant_expert_rows_cuda.cpp): a group's stats, scale, factor
// and e4m3 bytes, and the comparison of a downloaded scale's bits.
#pragma once

#include <cuda_fp8.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cuda_test_util.h"
#include "portable/fp8_quant.h"

namespace megamoe::test {

constexpr int kGroup = cuda::kFp8GroupSize;

inline uint32_t bits_of(float value) {
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof(bits));
    return bits;
}
inline float float_of(uint32_t bits) {
    float value;
    std::memcpy(&value, &bits, sizeof(value));
    return value;
}

// The 32-bit word idx of a downloaded tensor (a scale's bits, NaN payloads and the 0xFF poison included).
inline uint32_t word_at(const HostTensor& tensor, int64_t idx) {
    uint32_t word;
    std::memcpy(&word, tensor.bytes.data() + idx * sizeof(word), sizeof(word));
    return word;
}

// A kernel's scale against the host's: the same bits, or both NaN (the kernel's NaN is 0x7FC00000, the host's its own).
inline bool same_scale(uint32_t got_bits, float want) {
    return got_bits == bits_of(want) || (std::isnan(float_of(got_bits)) && std::isnan(want));
}

// A group's amax and whether it holds a NaN or an infinity, value by value.
struct HostStats {
    float amax = 0.0f;
    bool non_finite = false;
    void add(float v) {
        non_finite |= !std::isfinite(v);
        amax = std::max(amax, std::fabs(v));
    }
};

// fp8_reference's scale of a group, on the host.
inline float host_scale(float amax, bool non_finite, bool pow2) {
    if (non_finite) return std::numeric_limits<float>::quiet_NaN();
    if (amax == 0.0f) return 1.0f;
    float scale = std::max(amax / 448.0f, std::numeric_limits<float>::denorm_min());
    if (!pow2) return scale;
    const uint32_t bits = bits_of(scale);
    const uint32_t exponent = bits >> 23, mantissa = bits & 0x7FFFFFu;
    if (exponent == 0) {
        uint32_t pow2_bits = 1;
        while (pow2_bits < mantissa) pow2_bits <<= 1;
        return float_of(pow2_bits);
    }
    return mantissa == 0 ? scale : float_of((exponent + 1) << 23);
}

// fp8_reference's factor of a group: 448 / amax, or 1 / scale for power-of-two scales (f32 divisions), 1 for zeros, at
// most the largest finite f32.
inline float host_factor(float amax, float scale, bool non_finite, bool pow2) {
    if (non_finite) return 0.0f;
    if (amax == 0.0f) return 1.0f;
    const float factor = pow2 ? 1.0f / scale : 448.0f / amax;
    return std::min(factor, std::numeric_limits<float>::max());
}

// fp8_reference's byte of v in a group of the given factor (one f32 multiplication, clamped, round to nearest even).
inline uint8_t host_byte(float v, float factor, bool non_finite) {
    if (non_finite) return 0x7F;
    const float ratio = std::min(std::max(v * factor, -448.0f), 448.0f);
    return static_cast<uint8_t>(__nv_cvt_float_to_fp8(ratio, __NV_SATFINITE, __NV_E4M3));
}

struct HostQuant {
    std::vector<uint8_t> q;
    std::vector<float> scales;
};

// values [rows, cols] (f32, already what the kernel reads) quantized as fp8_reference.quantize_groups does.
inline HostQuant host_quantize(const std::vector<float>& values, int64_t rows, int64_t cols, bool pow2) {
    const int64_t groups = (cols + kGroup - 1) / kGroup;
    HostQuant out{std::vector<uint8_t>(static_cast<size_t>(rows * cols)),
                  std::vector<float>(static_cast<size_t>(rows * groups))};
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t g = 0; g < groups; ++g) {
            const int64_t begin = g * kGroup, end = std::min(cols, begin + kGroup);
            HostStats stats;
            for (int64_t c = begin; c < end; ++c) stats.add(values[static_cast<size_t>(r * cols + c)]);
            const float scale = host_scale(stats.amax, stats.non_finite, pow2);
            const float factor = host_factor(stats.amax, scale, stats.non_finite, pow2);
            out.scales[static_cast<size_t>(r * groups + g)] = scale;
            for (int64_t c = begin; c < end; ++c) {
                out.q[static_cast<size_t>(r * cols + c)] =
                    host_byte(values[static_cast<size_t>(r * cols + c)], factor, stats.non_finite);
            }
        }
    }
    return out;
}

}  // namespace megamoe::test
