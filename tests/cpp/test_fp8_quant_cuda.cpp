// The FP8 quantization kernels (src/portable/fp8_quant.h: groups along rows and weight blocks) against the host port of
// python/megamoe/fp8_reference.py's rules (fp8_quant_host_port.h), bit for bit: scales (NaN compared as bits)
// and e4m3 bytes, on partial groups and blocks, every input dtype, a row stride past the columns, power-of-two scales
// or not, zero groups, NaN and infinities, underflowing scales, values at the E4M3 limit. The host port is itself
// checked (without a GPU too) on a group worked by hand: the same bytes as fp8_reference's test_known_bytes. The
// kernels are built for sm_90a alone: without a compute capability 9.0 GPU the kernel tests skip.
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <algorithm>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "cuda_test_util.h"
#include "fp8_quant_host_port.h"
#include "portable/fp8_quant.h"

namespace megamoe::test {
namespace {

// Runs the kernel on `input` ([rows, stride] of dtype, the first cols of each row quantized) and compares it with the
// host port of the same values.
void expect_kernel_matches_host(const HostTensor& input, int64_t rows, int64_t cols, bool pow2, const char* what) {
    SCOPED_TRACE(what);
    const int64_t stride = input.view.shape[1];
    const int64_t groups = (cols + kGroup - 1) / kGroup;
    std::vector<float> values(static_cast<size_t>(rows * cols));
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < cols; ++c)
            values[static_cast<size_t>(r * cols + c)] = static_cast<float>(input.get(r * stride + c));
    }
    const HostQuant want = host_quantize(values, rows, cols, pow2);
    DeviceTensor in_dev = DeviceTensor::upload(input);
    DeviceTensor q_dev(HostTensor(MEGAMOE_DTYPE_I32, {(rows * cols + 3) / 4}).view);  // the e4m3 bytes, 4 a word
    DeviceTensor scales_dev(HostTensor(MEGAMOE_DTYPE_F32, {rows, groups}).view);
    q_dev.poison();
    scales_dev.poison();
    cuda::QuantizeGroupsArgs args{};
    args.in = in_dev.view().data;
    args.in_dtype = input.view.dtype;
    args.rows = rows;
    args.cols = cols;
    args.in_row_stride = stride;
    args.q = static_cast<uint8_t*>(q_dev.view().data);
    args.scales = static_cast<float*>(scales_dev.view().data);
    args.pow2 = pow2;
    ASSERT_EQ(cuda::launch_quantize_groups(args, nullptr), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
    expect_cuda(cudaDeviceSynchronize(), "quantize_groups");
    const HostTensor q = q_dev.download(), scales = scales_dev.download();
    for (size_t i = 0; i < want.scales.size(); ++i) {
        const uint32_t got = word_at(scales, static_cast<int64_t>(i));
        EXPECT_TRUE(same_scale(got, want.scales[i]))
            << "scale " << i << ": " << float_of(got) << " against " << want.scales[i];
    }
    for (size_t i = 0; i < want.q.size(); ++i) {
        ASSERT_EQ(q.bytes[i], want.q[i]) << "q " << i << " (row " << i / cols << ", column " << i % cols << ")";
    }
}

TEST(Fp8QuantCuda, RandomGroupsEveryDtype) {
    SKIP_WITHOUT_SM90();
    std::mt19937_64 rng(fresh_seed());
    // 1064 quantized columns of a 1080-element stride (16-bit: the row path, a warp per row, more columns than its
    // chunks in flight and a partial last group; f32: the vector path), 300 of 312 (a partial group; the vector path:
    // 4-element aligned rows), and 301 of 301 (the scalar path).
    for (const auto [cols, stride] : {std::pair<int64_t, int64_t>{1064, 1080}, std::pair<int64_t, int64_t>{300, 312},
                                      std::pair<int64_t, int64_t>{301, 301}}) {
        for (const megamoe_dtype_t dtype : {MEGAMOE_DTYPE_BF16, MEGAMOE_DTYPE_F16, MEGAMOE_DTYPE_F32}) {
            for (const bool pow2 : {false, true}) {
                HostTensor input(dtype, {37, stride});
                input.fill_random(rng, 3.0);
                expect_kernel_matches_host(input, 37, cols, pow2, pow2 ? "random, pow2" : "random");
            }
        }
    }
}

void expect_edge_cases_match_host(megamoe_dtype_t dtype) {
    std::mt19937_64 rng(fresh_seed());
    HostTensor input(dtype, {6, 256});
    input.fill_random(rng, 1.0);
    for (int64_t c = 0; c < 128; ++c) input.set(0 * 256 + c, 0.0);       // a zero group: scale 1
    input.set(1 * 256 + 200, std::numeric_limits<double>::quiet_NaN());  // NaN: its group only
    input.set(2 * 256 + 5, std::numeric_limits<double>::infinity());     // +-inf: the same
    input.set(2 * 256 + 130, -std::numeric_limits<double>::infinity());
    for (int64_t c = 0; c < 256; ++c) input.set(3 * 256 + c, 1e-44);  // amax / 448 underflows: scale 2^-149
    input.set(4 * 256 + 17, 448.0);                                   // at the limit, and past it
    input.set(4 * 256 + 140, -1e30);
    for (int64_t c = 0; c < 128; ++c) input.set(5 * 256 + c, 0.0);  // the group worked by hand
    input.set(5 * 256 + 0, 896.0);
    input.set(5 * 256 + 1, 1.0);
    input.set(5 * 256 + 2, -3.0);
    for (const bool pow2 : {false, true}) {
        expect_kernel_matches_host(input, 6, 256, pow2, pow2 ? "edges, pow2" : "edges");
    }
}

// f32 (the vector path) and bf16 (the row path: its packed 16-bit maxima); bf16 rounds the values set below, and the
// host port reads the rounded ones back.
TEST(Fp8QuantCuda, DefinedEdgeCases) {
    SKIP_WITHOUT_SM90();
    for (const megamoe_dtype_t dtype : {MEGAMOE_DTYPE_F32, MEGAMOE_DTYPE_BF16}) {
        SCOPED_TRACE(testing::Message() << "dtype " << dtype);
        expect_edge_cases_match_host(dtype);
    }
}

// The host port itself on the group worked by hand (fp8_reference's test_known_bytes: the same scale and bytes), and
// on its edge cases: a zero group, a NaN group, an underflowing scale with and without pow2, a pow2 rounding up.
TEST(Fp8QuantCuda, HostPortKnownBytes) {
    const HostQuant hand = host_quantize({896.0f, 1.0f, -3.0f, 0.0f}, 1, 4, false);
    EXPECT_EQ(hand.scales[0], 2.0f);
    EXPECT_EQ(hand.q, (std::vector<uint8_t>{0x7E, 0x30, 0xBC, 0x00})) << "fp8_reference's test_known_bytes";
    EXPECT_EQ(host_quantize({0.0f, 0.0f}, 1, 2, false).scales[0], 1.0f);
    const HostQuant nan = host_quantize({1.0f, std::numeric_limits<float>::quiet_NaN()}, 1, 2, false);
    EXPECT_TRUE(std::isnan(nan.scales[0]));
    EXPECT_EQ(nan.q, (std::vector<uint8_t>{0x7F, 0x7F}));
    for (const bool pow2 : {false, true}) {
        EXPECT_EQ(host_quantize({1e-44f}, 1, 1, pow2).scales[0], std::numeric_limits<float>::denorm_min());
    }
    EXPECT_EQ(host_quantize({3.0f * 448.0f}, 1, 1, true).scales[0], 4.0f);  // scale 3 -> the next power of two
}

// One quantize_blocks case of WeightBlocksAndTheirTranspose (N > 150, K > 290: the special values below lie inside).
void check_weight_blocks(megamoe_dtype_t dtype, int64_t N, int64_t K) {
    std::mt19937_64 rng(fresh_seed());
    const int64_t E = 2, nb = (N + kGroup - 1) / kGroup, kb = (K + kGroup - 1) / kGroup;
    HostTensor w(dtype, {E, N, K});
    w.fill_random(rng, 0.05);
    for (int64_t n = 0; n < 128; ++n) {
        for (int64_t k = 128; k < 256; ++k) w.set((0 * N + n) * K + k, 0.0);  // expert 0, block (0, 1): zeros
    }
    // expert 1, block (0, 0): values below the dtype's smallest normal (bf16 / f32 2^-126, f16 2^-14): the max of
    // subnormals, a subnormal scale (bf16 / f32)
    const double tiny = dtype == MEGAMOE_DTYPE_F16 ? 1e-5 : 1e-37;
    for (int64_t n = 0; n < 128; ++n) {
        for (int64_t k = 0; k < 128; ++k) w.set((1 * N + n) * K + k, w.get((1 * N + n) * K + k) * tiny);
    }
    w.set((0 * N + 5) * K + 7, -0.0);                                          // expert 0, block (0, 0): -0, 0x80
    w.set((0 * N + 130) * K + 5, -std::numeric_limits<double>::infinity());    // expert 0, block (1, 0): -inf
    w.set((1 * N + 20) * K + 130, std::numeric_limits<double>::quiet_NaN());   // expert 1, block (0, 1): NaN
    w.set((1 * N + 150) * K + 290, std::numeric_limits<double>::quiet_NaN());  // expert 1, block (1, 2): NaN
    const DeviceTensor w_dev = DeviceTensor::upload(w);
    for (const bool pow2 : {false, true}) {
        SCOPED_TRACE(pow2 ? "pow2" : "amax / 448");
        DeviceTensor q_dev(HostTensor(MEGAMOE_DTYPE_I32, {E * N * K / 4}).view);
        DeviceTensor q_t_dev(HostTensor(MEGAMOE_DTYPE_I32, {E * N * K / 4}).view);
        DeviceTensor scales_dev(HostTensor(MEGAMOE_DTYPE_F32, {E, nb, kb}).view);
        q_dev.poison();
        q_t_dev.poison();
        scales_dev.poison();
        cuda::QuantizeBlocksArgs args{};
        args.in = w_dev.view().data;
        args.in_dtype = dtype;
        args.num_experts = E;
        args.n = N;
        args.k = K;
        args.q = static_cast<uint8_t*>(q_dev.view().data);
        args.q_t = static_cast<uint8_t*>(q_t_dev.view().data);
        args.scales = static_cast<float*>(scales_dev.view().data);
        args.pow2 = pow2;
        ASSERT_EQ(cuda::launch_quantize_blocks(args, nullptr), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
        expect_cuda(cudaDeviceSynchronize(), "quantize_blocks");
        const HostTensor q = q_dev.download(), q_t = q_t_dev.download(), scales = scales_dev.download();
        for (int64_t e = 0; e < E; ++e) {
            for (int64_t bn = 0; bn < nb; ++bn) {
                for (int64_t bk = 0; bk < kb; ++bk) {
                    HostStats stats;
                    const int64_t n_end = std::min(N, (bn + 1) * kGroup), k_end = std::min(K, (bk + 1) * kGroup);
                    for (int64_t n = bn * kGroup; n < n_end; ++n) {
                        for (int64_t k = bk * kGroup; k < k_end; ++k) {
                            stats.add(static_cast<float>(w.get((e * N + n) * K + k)));
                        }
                    }
                    const float scale = host_scale(stats.amax, stats.non_finite, pow2);
                    const float factor = host_factor(stats.amax, scale, stats.non_finite, pow2);
                    const uint32_t got = word_at(scales, (e * nb + bn) * kb + bk);
                    ASSERT_TRUE(same_scale(got, scale))
                        << "block (" << e << ", " << bn << ", " << bk << "): " << float_of(got) << " against " << scale;
                    if (e == 0 && bn == 0 && bk == 1) EXPECT_EQ(float_of(got), 1.0f) << "the zero block's scale";
                    if ((e == 0 && bn == 1 && bk == 0) || (e == 1 && bn == 0 && bk == 1)) {
                        EXPECT_TRUE(std::isnan(float_of(got))) << "a non-finite block's scale";
                    }
                    for (int64_t n = bn * kGroup; n < n_end; ++n) {
                        for (int64_t k = bk * kGroup; k < k_end; ++k) {
                            const uint8_t want =
                                host_byte(static_cast<float>(w.get((e * N + n) * K + k)), factor, stats.non_finite);
                            ASSERT_EQ(q.bytes[static_cast<size_t>((e * N + n) * K + k)], want) << n << ", " << k;
                            ASSERT_EQ(q_t.bytes[static_cast<size_t>((e * K + k) * N + n)], want) << k << ", " << n;
                        }
                    }
                }
            }
        }
    }
}

// quantize_blocks: weights [E = 2, N, K] in bf16, f16 and f32 with a zero block, a block of subnormals, a -0, a -inf
// and NaNs (the special blocks whole where N and K allow), q and its transpose against the host rules over each
// block's elements, and the scales: N = 200, K = 300 (N, K not multiples of 16: every block by the scalar kernel, byte
// by byte), N = 256, K = 304 (the whole blocks by the vector kernel: 16-byte loads and stores; the partial last
// k-blocks by the scalar kernel) and N = 272, K = 304 (the same with partial blocks at both edges).
TEST(Fp8QuantCuda, WeightBlocksAndTheirTranspose) {
    SKIP_WITHOUT_SM90();
    for (const megamoe_dtype_t dtype : {MEGAMOE_DTYPE_BF16, MEGAMOE_DTYPE_F16, MEGAMOE_DTYPE_F32}) {
        for (const auto [N, K] : {std::pair<int64_t, int64_t>{200, 300}, std::pair<int64_t, int64_t>{256, 304},
                                  std::pair<int64_t, int64_t>{272, 304}}) {
            SCOPED_TRACE(::testing::Message() << "dtype " << dtype << ", N " << N << ", K " << K);
            check_weight_blocks(dtype, N, K);
        }
    }
}
// The launcher refuses what it cannot read, naming itself (no GPU needed: nothing is launched).
TEST(Fp8QuantCuda, RefusesAShortRowStride) {
    cuda::QuantizeGroupsArgs args{};
    float in = 0.0f, scale = 0.0f;
    uint8_t q = 0;
    args.in = &in;
    args.in_dtype = MEGAMOE_DTYPE_F32;
    args.rows = 2;
    args.cols = 8;
    args.in_row_stride = 4;
    args.q = &q;
    args.scales = &scale;
    EXPECT_EQ(cuda::launch_quantize_groups(args, nullptr), MEGAMOE_STATUS_INTERNAL_ERROR);
    EXPECT_NE(std::string(megamoe_last_error()).find("quantize_groups"), std::string::npos) << megamoe_last_error();
}

}  // namespace
}  // namespace megamoe::test
