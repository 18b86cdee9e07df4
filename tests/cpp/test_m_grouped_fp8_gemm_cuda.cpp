// The blockwise FP8 M-grouped GEMMs on Hopper (sm90/m_grouped_fp8_gemm_sm90.h): launch_m_grouped_fp8_gemm_sm90_store
// and _gated, their operands made by the tested quantizers (portable/fp8_quant.h: A in 1 x 128 groups along K, B in
// 128 x 128 blocks) from bf16 values of varied magnitude per row group and weight block (so the scales differ),
// against a host reference in f64 over the same e4m3 bytes and scales, elementwise:
//   out, h   |got - want| <= u |want| + c S        act   |got - want| <= 2u |want| + c (1.1 |up| S_g + |silu(g)| S_u)
// u the output's rounding (bf16 2^-8, f16 2^-11), S = sum_g |sa sb| sum_k |a_k b_k| (the element's term sizes) and
// c = 2^-9: the wgmma's FP8 accumulation inside a K group keeps only ~14 bits (DeepSeek-V3 report, hence the
// promotion every 128 K), so an error budget relative to max |want| would not hold; c S stays a few percent of a
// typical |want| (K = 208: S ~ 12 |want|), so a wrong scale, K group or row fails (ToleranceRejectsMutants shows it on
// the host). The relative Frobenius error is printed and held below 1e-2. Ragged routings: one row, empty experts,
// 1 / 127 / 129 / 300 rows, one expert taking every row, 64 experts, K with a partial last group, N tails, A sorted or
// gathered by slot (topk 2 and 4, dropped slots; the store GEMM refuses a gathered A), bf16 and f16 out; outputs
// poisoned (NaN) before every run, two runs bitwise equal, the gated GEMM with h or act NULL. The supported() refusals need an sm_90 device; without one the
// GPU tests skip and RefusesWithoutSm90Device checks that supported() says no. The reference, the bounds, the
// quantized operands and the ragged cases are fp8_test_util.h's (shared with test_m_grouped_fp8_backward_cuda.cpp).
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "cuda_test_util.h"
#include "fp8_test_util.h"
#include "grouped_test_util.h"
#include "portable/fp8_quant.h"
#include "sm90/m_grouped_fp8_gemm_sm90.h"

namespace megamoe::test {
namespace {

// act = silu(g) up from h's acc [rows, 2I]: 2u |act| and the accumulation errors of g and up propagated (|silu'|
// <= 1.1).
Target act_target(const Expected& h, int64_t rows, int64_t inter, megamoe_dtype_t dtype) {
    Target t{std::vector<double>(static_cast<size_t>(rows * inter)),
             std::vector<double>(static_cast<size_t>(rows * inter))};
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t i = 0; i < inter; ++i) {
            const size_t gi = static_cast<size_t>(r * 2 * inter + i), ui = gi + static_cast<size_t>(inter);
            const size_t idx = static_cast<size_t>(r * inter + i);
            const double gate = h.value[gi], up = h.value[ui], silu = gate / (1.0 + std::exp(-gate));
            t.want[idx] = silu * up;
            t.bound[idx] = 2.0 * rounding_of(dtype) * std::fabs(silu * up) +
                           kAccumulation * (1.1 * std::fabs(up) * h.size[gi] + std::fabs(silu) * h.size[ui]);
        }
    }
    return t;
}

// The gated GEMM quantizing a in its epilogue (Fp8QuantizedAct): h and act bitwise those of the plain run (`plain`:
// h, act), the bytes and scales bitwise launch_quantize_groups' of that act, every output poisoned first.
void check_quantized_act(const cuda::MGroupedGemmArgs& args, const sm90::Fp8BlockScales& scales,
                         const std::vector<HostTensor>& plain, int num_sms) {
    const int64_t rows = plain[1].view.shape[0], inter = args.n;
    DeviceTensor h(plain[0].view), act(plain[1].view);
    DeviceTensor act_q(HostTensor(MEGAMOE_DTYPE_I32, {ceil_div(rows * inter, 4)}).view);
    DeviceTensor act_scales(HostTensor(MEGAMOE_DTYPE_F32, {rows * inter / kGroup}).view);
    const sm90::Fp8QuantizedAct quantized{static_cast<uint8_t*>(act_q.view().data),
                                          static_cast<float*>(act_scales.view().data), false};
    const std::vector<HostTensor> got = run({&h, &act, &act_q, &act_scales}, [&] {
        return sm90::launch_m_grouped_fp8_gemm_sm90_gated(args, scales, h.view().data, act.view().data, num_sms,
                                                          nullptr, &quantized);
    });
    EXPECT_EQ(got[0].bytes, plain[0].bytes) << "h differs when a is quantized";
    EXPECT_EQ(got[1].bytes, plain[1].bytes) << "act differs when a is quantized";
    const Quantized want = quantize(got[1], 1, rows, inter, false);
    EXPECT_TRUE(std::equal(want.host.q.begin(), want.host.q.end(), got[2].bytes.begin()))
        << "a's e4m3 bytes differ from launch_quantize_groups' of the stored a";
    EXPECT_EQ(std::memcmp(want.host.scales.data(), got[3].bytes.data(), want.host.scales.size() * sizeof(float)), 0)
        << "a's scales differ from launch_quantize_groups' of the stored a";
    // Without act: the same bytes.
    const std::vector<HostTensor> no_act = run({&act_q}, [&] {
        return sm90::launch_m_grouped_fp8_gemm_sm90_gated(args, scales, nullptr, nullptr, num_sms, nullptr, &quantized);
    });
    EXPECT_EQ(no_act[0].bytes, got[2].bytes) << "a's bytes differ without h and act";
}

// One case on the store GEMM (out [rows, N]) or the gated one (h [rows, 2I], act [rows, I]).
void check_case(const Case& c, bool gated, std::mt19937_64& rng) {
    SCOPED_TRACE(::testing::Message() << c.name << " (K " << c.k << ", N " << c.n << ", I " << c.inter << ", seed "
                                      << fresh_seed() << ")");
    std::cout << c.name << (gated ? ", gated" : ", store") << "\n";
    cudaDeviceProp prop{};
    expect_cuda(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
    const int num_sms = prop.multiProcessorCount;
    const Prepared p = prepare(c, rng);
    const int64_t rows = p.map.rows(), n = gated ? c.inter : c.n, n_b = gated ? 2 * c.inter : c.n;
    const double sigma = 1.0 / std::sqrt(static_cast<double>(c.k));
    const Quantized b = quantize(varied_values(p.map.experts() * n_b, c.k, kGroup, sigma, rng), p.map.experts(), n_b,
                                 c.k, true);  // gated: w13 [E, 2I, K], gate rows then up rows
    const cuda::MGroupedGemmArgs args =
        gemm_args(c.dtype, p.a.q.view().data, p.map.num_a_rows,
                  p.map.slots.empty() ? nullptr : static_cast<const int*>(p.slots.view().data), p.map.topk,
                  b.q.view().data, n_b, n, c.k, static_cast<const int*>(p.offsets.view().data),
                  static_cast<const int*>(p.tiles.view().data), p.map.experts(), p.map.tiles.back() + c.tile_slack);
    const sm90::Fp8BlockScales scales{static_cast<const float*>(p.a.scales.view().data), ceil_div(c.k, kGroup),
                                      static_cast<const float*>(b.scales.view().data)};
    ASSERT_TRUE(sm90::m_grouped_fp8_gemm_sm90_supported(args, scales, gated));
    DeviceTensor out(HostTensor(c.dtype, {rows, n_b}).view), act(HostTensor(c.dtype, {rows, c.inter}).view);
    if (!gated && args.a_gather_slots != nullptr) {  // the store GEMM reads the sorted rows (by TMA) only
        EXPECT_EQ(sm90::launch_m_grouped_fp8_gemm_sm90_store(args, scales, out.view().data, n, rows, num_sms, nullptr),
                  MEGAMOE_STATUS_NOT_SUPPORTED);
        EXPECT_NE(std::string(megamoe_last_error()).find("unpermuted"), std::string::npos) << megamoe_last_error();
        return;
    }
    const auto launch = [&](void* out_ptr, void* act_ptr) {
        return [&, out_ptr, act_ptr] {
            return gated ? sm90::launch_m_grouped_fp8_gemm_sm90_gated(args, scales, out_ptr, act_ptr, num_sms, nullptr)
                         : sm90::launch_m_grouped_fp8_gemm_sm90_store(args, scales, out_ptr, n, rows, num_sms, nullptr);
        };
    };
    void* out_dev = out.view().data;
    void* act_dev = gated ? act.view().data : nullptr;
    std::vector<DeviceTensor*> outputs = {&out};
    if (gated) outputs.push_back(&act);
    const std::vector<HostTensor> first = run(outputs, launch(out_dev, act_dev));
    const std::vector<HostTensor> second = run(outputs, launch(out_dev, act_dev));
    for (size_t i = 0; i < first.size(); ++i) {
        EXPECT_EQ(first[i].bytes, second[i].bytes) << (i == 1 ? "act" : gated ? "h" : "out") << ": two runs differ";
    }
    const Expected acc = reference(p.a.host, b.host, p.map, n_b, c.k);
    const Target plain = plain_target(acc, c.dtype);
    expect_close(first[0], plain, n_b, gated ? "h" : "out");
    if (!gated) return;
    const Target act_want = act_target(acc, rows, c.inter, c.dtype);
    expect_close(first[1], act_want, c.inter, "act");
    expect_close(run({&act}, launch(nullptr, act_dev))[0], act_want, c.inter, "act (h NULL)");
    expect_close(run({&out}, launch(out_dev, nullptr))[0], plain, n_b, "h (act NULL)");
    check_quantized_act(args, scales, first, num_sms);
}

TEST(Fp8GemmSm90, StoreMatchesReference) {
    SKIP_WITHOUT_SM90();
    std::mt19937_64 rng(fresh_seed());
    for (const Case& c : ragged_cases(rng)) check_case(c, false, rng);
}

TEST(Fp8GemmSm90, GatedMatchesReference) {
    SKIP_WITHOUT_SM90();
    std::mt19937_64 rng(fresh_seed() + 1);
    for (const Case& c : ragged_cases(rng)) check_case(c, true, rng);
}

// The refusals: K % 16, I % 128 for the gated GEMM, misaligned A / lda / scales, an f32 output.
TEST(Fp8GemmSm90, SupportedRefusesWhatItCannotTake) {
    SKIP_WITHOUT_SM90();
    constexpr int64_t K = 256, kRows = 64, kExperts = 2;
    const DeviceTensor a(HostTensor(MEGAMOE_DTYPE_I32, {kRows * K}).view);
    const DeviceTensor b(HostTensor(MEGAMOE_DTYPE_I32, {kExperts * 256 * K}).view);
    const DeviceTensor sa(HostTensor(MEGAMOE_DTYPE_F32, {kRows * 2}).view),
        sb(HostTensor(MEGAMOE_DTYPE_F32, {16}).view);
    const DeviceTensor offsets = upload_ints({0, 40, kRows}), tiles = upload_ints({0, 1, 2});
    const auto args_of = [&](int64_t n, int64_t n_b) {
        return gemm_args(MEGAMOE_DTYPE_BF16, a.view().data, kRows, nullptr, 1, b.view().data, n_b, n, K,
                         static_cast<const int*>(offsets.view().data), static_cast<const int*>(tiles.view().data),
                         kExperts, 2);
    };
    const sm90::Fp8BlockScales scales{static_cast<const float*>(sa.view().data), 2,
                                      static_cast<const float*>(sb.view().data)};
    const auto supported = sm90::m_grouped_fp8_gemm_sm90_supported;
    const cuda::MGroupedGemmArgs store = args_of(256, 256), gated = args_of(128, 256);
    ASSERT_TRUE(supported(store, scales, false)) << "the well-formed store GEMM";
    ASSERT_TRUE(supported(gated, scales, true)) << "the well-formed gated GEMM";
    EXPECT_TRUE(supported(args_of(144, 144), scales, false)) << "N = 144, store";
    EXPECT_FALSE(supported(args_of(144, 288), scales, true)) << "I = 144, gated: I % 128 != 0";
    for (const bool swiglu : {false, true}) {
        SCOPED_TRACE(swiglu ? "gated" : "store");
        cuda::MGroupedGemmArgs args = swiglu ? gated : store;
        args.k = 200;
        EXPECT_FALSE(supported(args, scales, swiglu)) << "K = 200: K % 16 != 0";
        args = swiglu ? gated : store;
        args.a = static_cast<const uint8_t*>(args.a) + 8;
        EXPECT_FALSE(supported(args, scales, swiglu)) << "A 8 bytes past a 16-byte boundary";
        args = swiglu ? gated : store;
        args.lda = K + 8;
        EXPECT_FALSE(supported(args, scales, swiglu)) << "lda = K + 8 bytes";
        args = swiglu ? gated : store;
        args.dtype = MEGAMOE_DTYPE_F32;
        EXPECT_FALSE(supported(args, scales, swiglu)) << "f32 output";
        sm90::Fp8BlockScales bad = scales;
        bad.a = reinterpret_cast<const float*>(reinterpret_cast<const uint8_t*>(scales.a) + 2);
        EXPECT_FALSE(supported(swiglu ? gated : store, bad, swiglu)) << "A scales 2 bytes past a 4-byte boundary";
    }
}

// Without an sm_90 device (none, or another compute capability) supported() refuses well-formed operands.
TEST(Fp8GemmSm90, RefusesWithoutSm90Device) {
    std::string reason;
    if (sm90_available(&reason)) GTEST_SKIP() << "an sm_90 device is present: SupportedRefusesWhatItCannotTake runs";
    alignas(16) static uint8_t a[64 * 256], b[2 * 256 * 256];
    alignas(16) static float sa[64 * 2], sb[2 * 2 * 2];
    alignas(16) static int offsets[3] = {0, 40, 64}, tiles[3] = {0, 1, 2};
    const cuda::MGroupedGemmArgs args =
        gemm_args(MEGAMOE_DTYPE_BF16, a, 64, nullptr, 1, b, 256, 256, 256, offsets, tiles, 2, 2);
    EXPECT_FALSE(sm90::m_grouped_fp8_gemm_sm90_supported(args, {sa, 2, sb}, false)) << reason;
}

// The host decoder against CUDA's e4m3 -> f16 conversion on every byte, and the largest and smallest values.
TEST(Fp8GemmSm90, HostDecoderMatchesCudaConversion) {
    for (int byte = 0; byte < 256; ++byte) {
        const double mine = e4m3_value(static_cast<uint8_t>(byte));
        const __half cuda_half(__nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(byte), __NV_E4M3));
        const double theirs = static_cast<double>(__half2float(cuda_half));
        if (std::isnan(theirs)) {
            EXPECT_TRUE(std::isnan(mine)) << "byte " << byte;
        } else {
            EXPECT_EQ(mine, theirs) << "byte " << byte;
        }
    }
    EXPECT_EQ(e4m3_value(0x7E), 448.0);
    EXPECT_EQ(e4m3_value(0x01), std::ldexp(1.0, -9));
}

// The bounds on host data (no GPU): the reference itself, rounded to bf16, passes; a kernel that took a wrong scale,
// K group or row (the mutants) fails on a large share of the elements and in Frobenius norm.
TEST(Fp8GemmSm90, ToleranceRejectsMutants) {
    std::mt19937_64 rng(fresh_seed() + 2);
    SCOPED_TRACE("seed " + std::to_string(fresh_seed()));
    const int64_t k = 208, n_b = 256, groups = 2;
    RowMap map;
    map.offsets = {0, 15, 40};
    map.tiles = {0, 1, 2};
    map.num_a_rows = 40;
    std::normal_distribution<double> normal(0.0, 32.0);
    std::uniform_int_distribution<int> exponent(-6, 0);
    const auto make = [&](int64_t values, int64_t num_scales) {
        Fp8Host out;
        for (int64_t i = 0; i < values; ++i) {
            out.q.push_back(static_cast<uint8_t>(__nv_cvt_double_to_fp8(normal(rng), __NV_SATFINITE, __NV_E4M3)));
        }
        for (int64_t i = 0; i < num_scales; ++i) out.scales.push_back(std::ldexp(1.0f, exponent(rng)));
        return out;
    };
    const Fp8Host a = make(40 * k, 40 * groups), b = make(2 * n_b * k, 2 * 2 * groups);
    const Target t = plain_target(reference(a, b, map, n_b, k), MEGAMOE_DTYPE_BF16);
    const auto as_bf16 = [](const std::vector<double>& v) {
        return [&v](int64_t i) {
            return static_cast<double>(
                bf16_bits_to_float(float_to_bf16_bits(static_cast<float>(v[static_cast<size_t>(i)]))));
        };
    };
    EXPECT_EQ(compare(as_bf16(t.want), t, n_b).bad, 0) << "the reference rounded to bf16";
    const std::pair<Mutation, const char*> mutants[] = {
        {Mutation::kNeighbourRow, "the next A row"},
        {Mutation::kBScaleOfBlock0, "B's scale of n block 0 for every n"},
        {Mutation::kAScaleOfNextGroup, "A's scale of the next K group"},
        {Mutation::kLastGroupDropped, "the partial last K group dropped"},
        {Mutation::kGroupEndDropped, "the last k of each group dropped"}};
    for (const auto& [mutation, name] : mutants) {
        const Expected mutant = reference(a, b, map, n_b, k, mutation);
        const Comparison c = compare(as_bf16(mutant.value), t, n_b);
        const double share = static_cast<double>(c.bad) / static_cast<double>(t.want.size());
        EXPECT_GT(share, 0.1) << name << ": only " << c.bad << " elements out of bounds";
        EXPECT_GT(c.frobenius, kFrobenius) << name;
        std::cout << "mutant (" << name << "): " << share << " of the elements out of bounds, relative Frobenius "
                  << c.frobenius << "\n";
    }
}

}  // namespace
}  // namespace megamoe::test
