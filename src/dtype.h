// Host-side element access for every megamoe_dtype_t: load as double, store from double with
// round-to-nearest-even for bf16 / f16. Used by the validator and the CPU reference.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "megamoe/megamoe.h"

namespace megamoe {

inline const char* dtype_name(megamoe_dtype_t dtype) {
    switch (dtype) {
        case MEGAMOE_DTYPE_BF16:
            return "bf16";
        case MEGAMOE_DTYPE_F16:
            return "f16";
        case MEGAMOE_DTYPE_F32:
            return "f32";
        case MEGAMOE_DTYPE_F64:
            return "f64";
        case MEGAMOE_DTYPE_I32:
            return "i32";
        case MEGAMOE_DTYPE_I64:
            return "i64";
        case MEGAMOE_DTYPE_E4M3:
            return "e4m3";
    }
    return "unknown";
}

inline size_t dtype_size(megamoe_dtype_t dtype) {
    switch (dtype) {
        case MEGAMOE_DTYPE_BF16:
        case MEGAMOE_DTYPE_F16:
            return 2;
        case MEGAMOE_DTYPE_F32:
        case MEGAMOE_DTYPE_I32:
            return 4;
        case MEGAMOE_DTYPE_F64:
        case MEGAMOE_DTYPE_I64:
            return 8;
        case MEGAMOE_DTYPE_E4M3:
            return 1;
    }
    return 0;
}

inline float bf16_bits_to_float(uint16_t bits) {
    uint32_t word = static_cast<uint32_t>(bits) << 16;
    float value;
    std::memcpy(&value, &word, sizeof(value));
    return value;
}

inline uint16_t float_to_bf16_bits(float value) {
    uint32_t word;
    std::memcpy(&word, &value, sizeof(word));
    if (std::isnan(value)) return static_cast<uint16_t>((word >> 16) | 0x40);  // keep it a quiet NaN
    word += 0x7FFF + ((word >> 16) & 1);                                       // round to nearest even
    return static_cast<uint16_t>(word >> 16);
}

inline float f16_bits_to_float(uint16_t bits) {
    const uint32_t sign = (bits >> 15) & 1, exponent = (bits >> 10) & 0x1F, mantissa = bits & 0x3FF;
    float magnitude;
    if (exponent == 0) {
        magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    } else if (exponent == 31) {
        magnitude = mantissa ? NAN : INFINITY;
    } else {
        magnitude = std::ldexp(static_cast<float>(mantissa | 0x400), static_cast<int>(exponent) - 25);
    }
    return sign ? -magnitude : magnitude;
}

inline uint16_t float_to_f16_bits(float value) {
    const uint16_t sign = std::signbit(value) ? 0x8000 : 0;
    const float magnitude = std::fabs(value);
    if (std::isnan(value)) return sign | 0x7E00;
    if (magnitude == 0.0f) return sign;
    if (magnitude >= 65520.0f) return sign | 0x7C00;  // rounds to infinity
    int exponent;
    std::frexp(magnitude, &exponent);                              // magnitude = m * 2^exponent, m in [0.5, 1)
    const int quantum_exp = exponent < -13 ? -24 : exponent - 11;  // spacing of f16 values near magnitude
    const float scaled = std::nearbyint(std::ldexp(magnitude, -quantum_exp));  // round half to even
    uint32_t mantissa = static_cast<uint32_t>(scaled);
    if (quantum_exp == -24) return sign | static_cast<uint16_t>(mantissa);  // subnormal (or min normal)
    uint32_t biased = static_cast<uint32_t>(quantum_exp + 25);
    if (mantissa >= 0x800) {  // rounding carried into the next binade
        mantissa >>= 1;
        ++biased;
    }
    if (biased >= 31) return sign | 0x7C00;
    return sign | static_cast<uint16_t>((biased << 10) | (mantissa & 0x3FF));
}

inline double load_element(const void* data, megamoe_dtype_t dtype, int64_t index) {
    switch (dtype) {
        case MEGAMOE_DTYPE_BF16:
            return bf16_bits_to_float(static_cast<const uint16_t*>(data)[index]);
        case MEGAMOE_DTYPE_F16:
            return f16_bits_to_float(static_cast<const uint16_t*>(data)[index]);
        case MEGAMOE_DTYPE_F32:
            return static_cast<const float*>(data)[index];
        case MEGAMOE_DTYPE_F64:
            return static_cast<const double*>(data)[index];
        case MEGAMOE_DTYPE_I32:
            return static_cast<const int32_t*>(data)[index];
        case MEGAMOE_DTYPE_I64:
            return static_cast<double>(static_cast<const int64_t*>(data)[index]);
        case MEGAMOE_DTYPE_E4M3:  // never an input of the reference (validation keeps it to the FP8 weights)
            break;
    }
    return NAN;
}

inline int64_t load_index(const void* data, megamoe_dtype_t dtype, int64_t index) {
    return dtype == MEGAMOE_DTYPE_I64 ? static_cast<const int64_t*>(data)[index]
                                      : static_cast<int64_t>(static_cast<const int32_t*>(data)[index]);
}

inline void store_element(void* data, megamoe_dtype_t dtype, int64_t index, double value) {
    switch (dtype) {
        case MEGAMOE_DTYPE_BF16:
            static_cast<uint16_t*>(data)[index] = float_to_bf16_bits(static_cast<float>(value));
            break;
        case MEGAMOE_DTYPE_F16:
            static_cast<uint16_t*>(data)[index] = float_to_f16_bits(static_cast<float>(value));
            break;
        case MEGAMOE_DTYPE_F32:
            static_cast<float*>(data)[index] = static_cast<float>(value);
            break;
        case MEGAMOE_DTYPE_F64:
            static_cast<double*>(data)[index] = value;
            break;
        case MEGAMOE_DTYPE_I32:
            static_cast<int32_t*>(data)[index] = static_cast<int32_t>(value);
            break;
        case MEGAMOE_DTYPE_I64:
            static_cast<int64_t*>(data)[index] = static_cast<int64_t>(value);
            break;
        case MEGAMOE_DTYPE_E4M3:  // never an output of the reference
            break;
    }
}

inline int64_t numel(const megamoe_tensor_t& tensor) {
    int64_t count = 1;
    for (int32_t dim = 0; dim < tensor.ndim; ++dim) count *= tensor.shape[dim];
    return count;
}

inline bool is_present(const megamoe_tensor_t& tensor) {
    return tensor.data != nullptr || tensor.ndim != 0;
}

}  // namespace megamoe
