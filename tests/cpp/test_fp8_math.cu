// The blockwise FP8 recipe's per-value math (device/fp8_math.cuh) on the host, where the reference quotient is one
// IEEE division: GroupQuantizer's bytes (the quotient by a multiplication with the reciprocal, the division only near
// an e4m3 rounding midpoint, in e4m3's subnormal range or for a scale whose reciprocal overflows) equal those of the
// division, on random values over the whole range of scales, at the midpoints themselves and at the edges. The GPU
// kernels that use it are held to the host port of the rules in test_fp8_quant_cuda.cpp; this test says why the fast
// quotient cannot change a byte. Runs without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>

#include "device/fp8_math.cuh"

namespace megamoe::test {
namespace {

// The reference's byte: the correctly rounded quotient, clamped, to e4m3 (round to nearest even).
uint8_t division_byte(float value, float scale) {
    const float ratio = std::fmin(std::fmax(value / scale, -cuda::kE4M3Max), cuda::kE4M3Max);
    return static_cast<uint8_t>(__nv_cvt_float_to_fp8(ratio, __NV_SATFINITE, __NV_E4M3));
}

// Every e4m3 value and midpoint between neighbours (the finite positive grid and its halves).
std::vector<float> e4m3_grid_and_midpoints() {
    std::vector<float> grid;
    for (int byte = 1; byte < 0x7F; ++byte) {  // 0x7F is NaN
        const __nv_fp8_e4m3 value = *reinterpret_cast<const __nv_fp8_e4m3*>(&byte);
        grid.push_back(static_cast<float>(value));
    }
    std::vector<float> points = grid;
    for (size_t i = 0; i + 1 < grid.size(); ++i) points.push_back(0.5f * (grid[i] + grid[i + 1]));
    return points;
}

TEST(Fp8Math, QuantizerMatchesTheDivisionOnRandomValues) {
    std::mt19937_64 rng(0x5eed'f8);
    std::uniform_real_distribution<double> unit(-1.0, 1.0), mantissa(1.0, 2.0);
    std::uniform_int_distribution<int> scale_exponent(-140, 120), spread(0, 24);
    int64_t divisions = 0;
    constexpr int64_t kValues = 2'000'000;
    for (int64_t i = 0; i < kValues; ++i) {
        const float scale = static_cast<float>(std::ldexp(mantissa(rng), scale_exponent(rng)));
        // Values up to 448 scale, most well below (e4m3's subnormals included).
        const float value = static_cast<float>(unit(rng) * 448.0 * scale * std::ldexp(1.0, -spread(rng)));
        const cuda::GroupQuantizer quantizer(scale, false);
        ASSERT_EQ(quantizer(value), division_byte(value, scale)) << "value " << value << ", scale " << scale;
        divisions += quantizer.exact_only ||
                     cuda::GroupQuantizer::near_midpoint(cuda::float_bits(value * quantizer.scale_rcp) & 0x7FFFFFFFu);
    }
    std::cout << divisions << " of " << kValues << " quotients by division\n";
}

TEST(Fp8Math, QuantizerMatchesAtMidpointsAndEdges) {
    const std::vector<float> points = e4m3_grid_and_midpoints();
    const float scales[] = {1.0f,     0x1p-20f,  0x1p+20f,  3.0f / 448.0f, 0.7f,      1e-3f,
                            123.456f, 0x1p-126f, 0x1p-127f, 0x1p-149f,     1.17e-38f, 3e38f / 448.0f};
    for (const float scale : scales) {
        const cuda::GroupQuantizer quantizer(scale, false);
        for (const float point : points) {
            for (const float sign : {1.0f, -1.0f}) {
                const float exact = sign * point * scale;  // the midpoint itself where the product is exact
                for (const float value : {exact, std::nextafter(exact, 0.0f), std::nextafter(exact, 2.0f * exact)}) {
                    ASSERT_EQ(quantizer(value), division_byte(value, scale))
                        << "value " << value << ", scale " << scale;
                }
            }
        }
        for (const float value : {0.0f, -0.0f, 448.0f * scale, 449.0f * scale, 1e30f, -1e30f}) {
            ASSERT_EQ(quantizer(value), division_byte(value, scale)) << "value " << value << ", scale " << scale;
        }
    }
    EXPECT_TRUE(cuda::GroupQuantizer(0x1p-149f, false).exact_only) << "a denormal scale's reciprocal overflows";
    EXPECT_EQ(cuda::GroupQuantizer(std::nanf(""), true)(1.0f), cuda::kE4M3NanBits) << "a non-finite group";
}

}  // namespace
}  // namespace megamoe::test
