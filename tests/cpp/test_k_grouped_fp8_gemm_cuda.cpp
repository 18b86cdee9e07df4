// The blockwise FP8 K-grouped GEMM of the weight gradients (sm90/k_grouped_fp8_gemm_sm90.h) against a host reference
// in f64 over the same e4m3 bytes and scales:
//   C_e[m, n] = sum over expert e's routing tiles i of sa[i, m] sb[i, n] sum_{j < 128} A8[m, 128 i + j] B8[n, 128 i +
//   j]
// elementwise |got - want| <= u |want| + c S (u the output's rounding, f32: 2^-23; S = sum_i |sa sb| sum_j |a_j b_j|;
// c = 2^-9, the FP8 wgmma's accumulation inside a group: fp8_test_util.h), the relative Frobenius error below 1e-2.
// The operands are drawn as the layout of launch_quantize_expert_rows has them: random e4m3 bytes of varied exponent
// in each tile's rows, zero bytes in its pad (rows past the expert's end), NaN bytes (0x7F) in the columns past the
// last tile and NaN scales in the scale rows past it and in the scale columns past M or N, so a read outside the
// routing's tiles shows as a NaN. Ragged routings: empty experts, 1 / 128 / 129 / 300 rows, one expert taking every
// row, 64 experts of 0-2 rows, no rows at all; bf16, f16 and f32 outputs poisoned (NaN) before every run, f32
// accumulation onto random values (an expert without rows leaves them bit for bit); two runs bitwise equal, and the
// CTA-pair variant (MEGAMOE_SM90_FP8_WGRAD_PAIR=1: odd n-tile counts leave a CTA recomputing its partner's tile)
// bitwise the single CTAs'; the refusals of supported().
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "cuda_test_util.h"
#include "fp8_test_util.h"
#include "fp8_wgrad_test_util.h"
#include "sm90/k_grouped_fp8_gemm_sm90.h"

namespace megamoe::test {
namespace {

constexpr uint8_t kNanByte = 0x7F;

struct KCase {
    std::string name;
    int64_t m, n;
    std::vector<int> rows;  // per expert
    megamoe_dtype_t out_dtype;
    bool accumulate;
    int64_t extra_tiles;  // host bound past the routing's tiles
};

// The routing's tiles: m_tile_offsets (exclusive scan of ceil(rows / 128)) and each tile's row count.
struct Tiles {
    std::vector<int> offsets{0};
    std::vector<int> rows;  // per tile
    int64_t count() const { return offsets.back(); }
};

Tiles tiles_of(const std::vector<int>& rows) {
    Tiles t;
    for (const int r : rows) {
        const int n = static_cast<int>(ceil_div(r, kGroup));
        for (int i = 0; i < n; ++i)
            t.rows.push_back(std::min<int>(static_cast<int>(kGroup), r - i * static_cast<int>(kGroup)));
        t.offsets.push_back(t.offsets.back() + n);
    }
    return t;
}

// A random finite e4m3 byte of exponent field 3..11 (values 2^-4 .. 2^4 in magnitude), either sign.
uint8_t random_byte(std::mt19937_64& rng) {
    std::uniform_int_distribution<int> exponent(3, 11), mantissa(0, 7), sign(0, 1);
    return static_cast<uint8_t>(sign(rng) << 7 | exponent(rng) << 3 | mantissa(rng));
}

// One operand on the host in the tile-padded layout (fp8_wgrad_test_util.h): q_t [cols, ld], scales [max_tiles,
// ld_scales].
ExpertColsHost make_operand(int64_t cols, const Tiles& tiles, int64_t max_tiles, std::mt19937_64& rng) {
    ExpertColsHost op;
    op.ld = kGroup * max_tiles + 16;  // past the bound: NaN bytes the kernel must not read
    op.ld_scales = cols + 4;
    op.q.assign(static_cast<size_t>(cols * op.ld), kNanByte);
    op.scales.assign(static_cast<size_t>(std::max<int64_t>(max_tiles, 1) * op.ld_scales),
                     std::numeric_limits<float>::quiet_NaN());
    std::uniform_real_distribution<double> unit(0.5, 1.0);
    std::uniform_int_distribution<int> power(-6, 2);
    for (int64_t i = 0; i < tiles.count(); ++i) {
        for (int64_t c = 0; c < cols; ++c) {
            for (int64_t j = 0; j < kGroup; ++j) {
                op.q[static_cast<size_t>(c * op.ld + i * kGroup + j)] =
                    j < tiles.rows[static_cast<size_t>(i)] ? random_byte(rng) : uint8_t{0};
            }
            op.scales[static_cast<size_t>(i * op.ld_scales + c)] =
                static_cast<float>(std::ldexp(unit(rng), power(rng)));
        }
    }
    return op;
}

double out_rounding(megamoe_dtype_t dtype) {
    return dtype == MEGAMOE_DTYPE_F32 ? std::ldexp(1.0, -23) : rounding_of(dtype);
}

DeviceTensor upload_bytes(const std::vector<uint8_t>& bytes) {
    HostTensor host(MEGAMOE_DTYPE_E4M3, {static_cast<int64_t>(bytes.size())});
    std::memcpy(host.view.data, bytes.data(), bytes.size());
    return DeviceTensor::upload(host);
}

DeviceTensor upload_floats(const std::vector<float>& values) {
    HostTensor host(MEGAMOE_DTYPE_F32, {static_cast<int64_t>(values.size())});
    std::memcpy(host.view.data, values.data(), values.size() * sizeof(float));
    return DeviceTensor::upload(host);
}

// The device side of a case: operands, routing tiles and the launch arguments.
struct DeviceCase {
    DeviceTensor a_q, a_scales, b_q, b_scales, offsets;
    sm90::KGroupedFp8GemmArgs args{};
};

DeviceCase upload_case(const ExpertColsHost& a, const ExpertColsHost& b, const Tiles& tiles, const KCase& c,
                       int64_t max_tiles) {
    DeviceCase d;
    d.a_q = upload_bytes(a.q);
    d.b_q = upload_bytes(b.q);
    d.a_scales = upload_floats(a.scales);
    d.b_scales = upload_floats(b.scales);
    d.offsets = upload_ints(tiles.offsets);
    d.args.a = {static_cast<const uint8_t*>(d.a_q.view().data), a.ld, static_cast<const float*>(d.a_scales.view().data),
                a.ld_scales};
    d.args.b = {static_cast<const uint8_t*>(d.b_q.view().data), b.ld, static_cast<const float*>(d.b_scales.view().data),
                b.ld_scales};
    d.args.m = c.m;
    d.args.n = c.n;
    d.args.m_tile_offsets = static_cast<const int*>(d.offsets.view().data);
    d.args.num_experts = static_cast<int64_t>(c.rows.size());
    d.args.max_tiles = max_tiles;
    d.args.accumulate = c.accumulate;
    return d;
}

int num_sms() {
    int device = 0, sms = 0;
    expect_cuda(cudaGetDevice(&device), "cudaGetDevice");
    expect_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "sm count");
    return sms;
}

void check_case(const KCase& c) {
    SCOPED_TRACE(::testing::Message() << c.name << " (seed " << fresh_seed() << ")");
    std::mt19937_64 rng(fresh_seed() ^ std::hash<std::string>{}(c.name));
    const Tiles tiles = tiles_of(c.rows);
    const int64_t experts = static_cast<int64_t>(c.rows.size()), max_tiles = tiles.count() + c.extra_tiles;
    const ExpertColsHost a = make_operand(c.m, tiles, max_tiles, rng), b = make_operand(c.n, tiles, max_tiles, rng);
    DeviceCase d = upload_case(a, b, tiles, c, max_tiles);
    HostTensor base(c.out_dtype, {experts, c.m, c.n});  // accumulate: the values added onto
    if (c.accumulate) base.fill_random(rng, 4.0);
    DeviceTensor out(base.view);
    ASSERT_TRUE(sm90::k_grouped_fp8_gemm_sm90_supported(d.args, out.view().data, c.out_dtype));
    const auto launch = [&] {
        if (c.accumulate) {
            expect_cuda(cudaMemcpy(out.view().data, base.view.data, base.bytes.size() - 1, cudaMemcpyHostToDevice),
                        "base");
        } else {
            out.poison();
        }
        expect_cuda(cudaDeviceSynchronize(), "prepare");
        EXPECT_EQ(sm90::launch_k_grouped_fp8_gemm_sm90(d.args, out.view().data, c.out_dtype, num_sms(), nullptr),
                  MEGAMOE_STATUS_SUCCESS)
            << megamoe_last_error();
        expect_cuda(cudaDeviceSynchronize(), "k_grouped_fp8_gemm_sm90");
        return out.download();
    };
    const HostTensor got = launch();
    const Expected acc = k_grouped_fp8_reference(a, c.m, b, c.n, tiles.offsets);
    Target t{acc.value, std::vector<double>(acc.value.size())};
    for (size_t i = 0; i < t.want.size(); ++i) {
        if (c.accumulate) t.want[i] += base.get(static_cast<int64_t>(i));
        t.bound[i] = out_rounding(c.out_dtype) * std::fabs(t.want[i]) + kAccumulation * acc.size[i];
    }
    expect_close(got, t, c.n, c.name);
    for (int64_t e = 0; e < experts; ++e) {  // an expert without rows: zeros, or the accumulated values bit for bit
        if (c.rows[static_cast<size_t>(e)] != 0) continue;
        for (int64_t i = e * c.m * c.n; i < (e + 1) * c.m * c.n; ++i) {
            ASSERT_EQ(got.get(i), c.accumulate ? base.get(i) : 0.0) << "expert " << e << " without rows, element " << i;
        }
    }
    EXPECT_EQ(launch().bytes, got.bytes) << "a second run differs";
    const ScopedEnv pairs("MEGAMOE_SM90_FP8_WGRAD_PAIR", "1");  // CTA pairs sharing A by multicast: the same tiles
    EXPECT_EQ(launch().bytes, got.bytes) << "MEGAMOE_SM90_FP8_WGRAD_PAIR=1 differs";
}

TEST(KGroupedFp8GemmCuda, RaggedRoutingsAgainstTheRecipe) {
    SKIP_WITHOUT_SM90();
    const std::vector<KCase> cases = {
        {"bf16 empty, 1, 128, 300 rows", 256, 384, {0, 1, 128, 300}, MEGAMOE_DTYPE_BF16, false, 2},
        {"f16 129, 0, 500 rows", 128, 128, {129, 0, 500}, MEGAMOE_DTYPE_F16, false, 0},
        {"f32 257, 64 rows", 384, 256, {257, 64}, MEGAMOE_DTYPE_F32, false, 1},
        {"f32 accumulate 100, 0, 700 rows", 256, 256, {100, 0, 700}, MEGAMOE_DTYPE_F32, true, 3},
        {"bf16 one expert takes all", 128, 256, {0, 0, 1000, 0, 0, 0, 0, 0}, MEGAMOE_DTYPE_BF16, false, 0},
        {"f32 64 experts of 0-2 rows",
         128,
         128,
         {1, 0, 2, 1, 0, 0, 1, 2, 1, 1, 0, 2, 0, 1, 1, 0, 2, 2, 1, 0, 1, 1, 0, 0, 2, 1, 0, 1, 1, 2, 0, 0,
          0, 1, 1, 2, 0, 1, 0, 2, 1, 1, 0, 0, 1, 2, 1, 0, 1, 0, 1, 1, 2, 0, 1, 0, 0, 2, 1, 1, 0, 1, 1, 1},
         MEGAMOE_DTYPE_F32,
         false,
         0},
        {"f32 accumulate, no rows at all", 128, 128, {0, 0, 0}, MEGAMOE_DTYPE_F32, true, 0},
        {"bf16 no rows at all", 128, 256, {0, 0}, MEGAMOE_DTYPE_BF16, false, 2},
    };
    for (const KCase& c : cases) check_case(c);
}

// supported() takes a valid set of arguments and refuses each broken one (an sm_90 device: the tensor-map encoder
// must exist for the valid set to be taken).
TEST(KGroupedFp8GemmCuda, SupportedRefusesWhatItCannotRead) {
    SKIP_WITHOUT_SM90();
    const KCase c{"valid", 128, 256, {200, 10}, MEGAMOE_DTYPE_F32, false, 0};
    std::mt19937_64 rng(fresh_seed());
    const Tiles tiles = tiles_of(c.rows);
    const ExpertColsHost a = make_operand(c.m, tiles, tiles.count(), rng),
                         b = make_operand(c.n, tiles, tiles.count(), rng);
    DeviceCase d = upload_case(a, b, tiles, c, tiles.count());
    DeviceTensor out(HostTensor(MEGAMOE_DTYPE_F32, {2, c.m, c.n}).view);
    void* data = out.view().data;
    ASSERT_TRUE(sm90::k_grouped_fp8_gemm_sm90_supported(d.args, data, MEGAMOE_DTYPE_F32));
    const auto refused = [&](const char* what, auto mutate, megamoe_dtype_t dtype = MEGAMOE_DTYPE_F32,
                             void* target = nullptr) {
        sm90::KGroupedFp8GemmArgs args = d.args;
        mutate(args);
        EXPECT_FALSE(sm90::k_grouped_fp8_gemm_sm90_supported(args, target != nullptr ? target : data, dtype)) << what;
        EXPECT_EQ(
            sm90::launch_k_grouped_fp8_gemm_sm90(args, target != nullptr ? target : data, dtype, num_sms(), nullptr),
            MEGAMOE_STATUS_NOT_SUPPORTED)
            << what;
    };
    refused("M not a multiple of 128", [](auto& args) { args.m = 192; });
    refused("N not a multiple of 128", [](auto& args) { args.n = 200; });
    refused("ld_a below 128 max_tiles", [](auto& args) { args.max_tiles += 1; });
    refused("ld_b not a multiple of 16", [](auto& args) { args.b.ld -= 8; });
    refused("A misaligned", [](auto& args) { args.a.q_t += 4; });
    refused("ld_scales_b below N", [](auto& args) { args.b.ld_scales = args.n - 4; });
    refused("ld_scales_a not a multiple of 4", [](auto& args) { args.a.ld_scales += 1; });
    refused("scales misaligned", [](auto& args) { args.b.scales += 1; });
    refused("no tile offsets", [](auto& args) { args.m_tile_offsets = nullptr; });
    refused(
        "accumulating into bf16", [](auto& args) { args.accumulate = true; }, MEGAMOE_DTYPE_BF16);
    refused(
        "e4m3 out", [](auto&) {}, MEGAMOE_DTYPE_E4M3);
    refused(
        "out misaligned", [](auto&) {}, MEGAMOE_DTYPE_F32, static_cast<char*>(data) + 8);
}

}  // namespace
}  // namespace megamoe::test
