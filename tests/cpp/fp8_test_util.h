// The blockwise FP8 GEMM tests' shared host side (test_m_grouped_fp8_gemm_cuda.cpp: the forward GEMMs,
// test_m_grouped_fp8_backward_cuda.cpp: dH and dX): the e4m3 decoder, the f64 reference of the recipe over the
// downloaded bytes and scales (B's scales as given or, Fp8Host::scales_transposed, those of the weight whose
// transposed copy B is), the elementwise bounds (Target: |got - want| <= bound) with the accumulation budget
// c = kAccumulation per unit of the term sizes S (its justification: test_m_grouped_fp8_gemm_cuda.cpp's header),
// operands quantized on the GPU by the tested quantizers, the ragged routings and the poisoned runs.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <limits>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cuda_test_util.h"
#include "grouped_test_util.h"
#include "portable/fp8_quant.h"
#include "sm90/m_grouped_fp8_gemm_sm90.h"

namespace megamoe::test {

inline constexpr int64_t kGroup = cuda::kFp8GroupSize;
inline constexpr double kAccumulation = 1.0 / 512;  // c: the accumulation error budget per unit of the term sizes S
inline constexpr double kFrobenius = 1e-2;

inline int64_t ceil_div(int64_t a, int64_t b) {
    return (a + b - 1) / b;
}

// The exact value of an e4m3 byte (bias 7, subnormals below 2^-6, no infinities, 0x7F / 0xFF NaN).
inline double e4m3_value(uint8_t byte) {
    if ((byte & 0x7F) == 0x7F) return std::numeric_limits<double>::quiet_NaN();
    const int exponent = (byte >> 3) & 0xF, mantissa = byte & 0x7;
    const double magnitude =
        exponent == 0 ? std::ldexp(mantissa / 8.0, -6) : std::ldexp(1.0 + mantissa / 8.0, exponent - 7);
    return (byte & 0x80) != 0 ? -magnitude : magnitude;
}

// An e4m3 operand's bytes and scales. B's scales are [E, ceil(N_b / 128), ceil(K / 128)] or, scales_transposed,
// [E, ceil(K / 128), ceil(N_b / 128)]: those of the weight whose transposed copy B is (Fp8BlockScales::b_transposed).
struct Fp8Host {
    std::vector<uint8_t> q;
    std::vector<float> scales;
    bool scales_transposed = false;
};

// The sorted rows: expert e owns [offsets[e], offsets[e + 1]); row r reads A row slots[r] / topk (slots empty: r).
struct RowMap {
    std::vector<int> offsets{0}, tiles{0}, slots;
    int64_t topk = 1, num_a_rows = 0;
    int64_t rows() const { return offsets.back(); }
    int64_t experts() const { return static_cast<int64_t>(offsets.size()) - 1; }
    int64_t a_row(int64_t r) const { return slots.empty() ? r : slots[static_cast<size_t>(r)] / topk; }
};

// What a broken kernel could do, for the ToleranceRejectsMutants tests.
enum class Mutation { kNone, kNeighbourRow, kBScaleOfBlock0, kAScaleOfNextGroup, kLastGroupDropped, kGroupEndDropped };

struct Expected {
    std::vector<double> value, size;  // [rows, n_b]: acc and S
};

// acc[r, n] = sum_g sa[a_row(r), g] sb_e(n / 128, g) sum_{k in g} A8[a_row(r), k] B8_e[n, k], in f64; sb_e(i, g) =
// b.scales[e, i, g], or b.scales[e, g, i] where b.scales_transposed.
inline Expected reference(const Fp8Host& a, const Fp8Host& b, const RowMap& map, int64_t n_b, int64_t k,
                          Mutation mutation = Mutation::kNone) {
    const int64_t groups = ceil_div(k, kGroup), n_blocks = ceil_div(n_b, kGroup);
    std::vector<double> table(256);
    for (int byte = 0; byte < 256; ++byte) table[static_cast<size_t>(byte)] = e4m3_value(static_cast<uint8_t>(byte));
    Expected out{std::vector<double>(static_cast<size_t>(map.rows() * n_b)),
                 std::vector<double>(static_cast<size_t>(map.rows() * n_b))};
    for (int64_t e = 0; e < map.experts(); ++e) {
        for (int64_t r = map.offsets[static_cast<size_t>(e)]; r < map.offsets[static_cast<size_t>(e) + 1]; ++r) {
            int64_t row = map.a_row(r);
            if (mutation == Mutation::kNeighbourRow) row = (row + 1) % map.num_a_rows;
            for (int64_t n = 0; n < n_b; ++n) {
                double value = 0.0, size = 0.0;
                for (int64_t g = 0; g < groups; ++g) {
                    if (mutation == Mutation::kLastGroupDropped && g == groups - 1) continue;
                    const int64_t end = std::min(k, (g + 1) * kGroup) - (mutation == Mutation::kGroupEndDropped);
                    double partial = 0.0, partial_size = 0.0;
                    for (int64_t kk = g * kGroup; kk < end; ++kk) {
                        const double p = table[a.q[static_cast<size_t>(row * k + kk)]] *
                                         table[b.q[static_cast<size_t>((e * n_b + n) * k + kk)]];
                        partial += p;
                        partial_size += std::fabs(p);
                    }
                    const int64_t ga = mutation == Mutation::kAScaleOfNextGroup ? (g + 1) % groups : g;
                    const int64_t nb = mutation == Mutation::kBScaleOfBlock0 ? 0 : n / kGroup;
                    const int64_t sb =
                        b.scales_transposed ? (e * groups + g) * n_blocks + nb : (e * n_blocks + nb) * groups + g;
                    const double scale = static_cast<double>(a.scales[static_cast<size_t>(row * groups + ga)]) *
                                         b.scales[static_cast<size_t>(sb)];
                    value += scale * partial;
                    size += std::fabs(scale) * partial_size;
                }
                out.value[static_cast<size_t>(r * n_b + n)] = value;
                out.size[static_cast<size_t>(r * n_b + n)] = size;
            }
        }
    }
    return out;
}

// Wanted values and their elementwise bounds.
struct Target {
    std::vector<double> want, bound;
};

inline double rounding_of(megamoe_dtype_t dtype) {
    return dtype == MEGAMOE_DTYPE_F16 ? std::ldexp(1.0, -11) : std::ldexp(1.0, -8);
}

// out and h: u |want| + c S.
inline Target plain_target(const Expected& acc, megamoe_dtype_t dtype) {
    Target t{acc.value, std::vector<double>(acc.value.size())};
    for (size_t i = 0; i < t.bound.size(); ++i) {
        t.bound[i] = rounding_of(dtype) * std::fabs(acc.value[i]) + kAccumulation * acc.size[i];
    }
    return t;
}

struct Comparison {
    int64_t bad = 0;
    double worst = 0.0;      // max |got - want| / bound
    double frobenius = 0.0;  // ||got - want|| / ||want||
    std::string first_bad;
};

// got(i) against the target elementwise (NaN fails), rows of `cols` elements.
template <typename Get>
inline Comparison compare(const Get& got, const Target& t, int64_t cols) {
    Comparison c;
    double diff = 0.0, norm = 0.0;
    std::ostringstream first;
    for (size_t i = 0; i < t.want.size(); ++i) {
        const double g = got(static_cast<int64_t>(i)), err = g == t.want[i] ? 0.0 : std::fabs(g - t.want[i]);
        diff += err * err;
        norm += t.want[i] * t.want[i];
        if (!(err <= t.bound[i]) && c.bad++ < 5) {
            first << " [" << static_cast<int64_t>(i) / cols << ", " << static_cast<int64_t>(i) % cols << "] got " << g
                  << " want " << t.want[i] << " bound " << t.bound[i] << ";";
        }
        c.worst = std::max(c.worst, t.bound[i] > 0.0 ? err / t.bound[i] : (err > 0.0 ? HUGE_VAL : 0.0));
    }
    c.frobenius = std::sqrt(diff) / std::max(std::sqrt(norm), 1e-300);
    c.first_bad = first.str();
    return c;
}

inline void expect_close(const HostTensor& got, const Target& t, int64_t cols, const std::string& what) {
    ASSERT_EQ(static_cast<size_t>(got.size()), t.want.size()) << what;
    const Comparison c = compare([&](int64_t i) { return got.get(i); }, t, cols);
    EXPECT_EQ(c.bad, 0) << what << ": " << c.bad << " of " << t.want.size() << " out of bounds:" << c.first_bad;
    EXPECT_LT(c.frobenius, kFrobenius) << what << ": relative Frobenius error";
    std::cout << "  " << what << ": relative Frobenius error " << c.frobenius << ", worst |error| / bound " << c.worst
              << "\n";
}

// The FP8 GEMM's arguments: A e4m3 [num_a_rows, k] (lda k bytes) gathered by `slots` (NULL: the sorted rows), B_e
// [n_b, k] bytes, the routing's offsets and M tiles, the output in `dtype`.
inline cuda::MGroupedGemmArgs gemm_args(megamoe_dtype_t dtype, const void* a, int64_t num_a_rows, const int* slots,
                                        int64_t topk, const void* b, int64_t n_b, int64_t n, int64_t k,
                                        const int* offsets, const int* tiles, int64_t experts, int64_t max_tiles) {
    cuda::MGroupedGemmArgs args{};
    args.dtype = dtype;
    args.a = a;
    args.lda = k;
    args.a_gather_slots = slots;
    args.num_a_rows = num_a_rows;
    args.topk = topk;
    args.b = b;
    args.b_expert_stride = n_b * k;
    args.ldb = k;
    args.n = n;
    args.k = k;
    args.expert_offsets = offsets;
    args.m_tile_offsets = tiles;
    args.num_experts = experts;
    args.max_m_tiles = max_tiles;
    return args;
}

// An e4m3 operand on the device with its downloaded copy.
struct Quantized {
    DeviceTensor q, scales;
    Fp8Host host;
};

// `values` (bf16 or f16) quantized on the GPU: B [experts, rows, k] in 128 x 128 blocks, or A [rows, k] in groups along
// k. `transposed` (blocks only): q is B's transposed copy q_t [experts, k, rows] (launch_quantize_blocks' q_t), with
// the scales of `values`' blocks, so host.scales_transposed (the data gradients' B).
inline Quantized quantize(const HostTensor& values, int64_t experts, int64_t rows, int64_t k, bool blocks,
                          bool transposed = false) {
    const int64_t bytes = experts * rows * k;
    const int64_t num_scales = experts * (blocks ? ceil_div(rows, kGroup) : rows) * ceil_div(k, kGroup);
    const DeviceTensor in = DeviceTensor::upload(values);
    const auto byte_tensor = [&] { return DeviceTensor(HostTensor(MEGAMOE_DTYPE_I32, {ceil_div(bytes, 4)}).view); };
    Quantized out{byte_tensor(), DeviceTensor(HostTensor(MEGAMOE_DTYPE_F32, {num_scales}).view), {}};
    DeviceTensor untransposed = transposed ? byte_tensor() : DeviceTensor();  // q beside q_t
    out.q.poison();
    out.scales.poison();
    auto* q = static_cast<uint8_t*>(out.q.view().data);
    auto* scales = static_cast<float*>(out.scales.view().data);
    auto* q_plain = transposed ? static_cast<uint8_t*>(untransposed.view().data) : q;
    auto* q_t = transposed ? q : nullptr;
    const megamoe_status_t status =
        blocks
            ? cuda::launch_quantize_blocks(
                  {in.view().data, values.view.dtype, experts, rows, k, q_plain, q_t, scales, false}, nullptr)
            : cuda::launch_quantize_groups({in.view().data, values.view.dtype, rows, k, k, q, scales, false}, nullptr);
    EXPECT_EQ(status, MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
    expect_cuda(cudaDeviceSynchronize(), "quantize");
    const HostTensor q_host = out.q.download(), scales_host = out.scales.download();
    out.host.q.assign(q_host.bytes.begin(), q_host.bytes.begin() + bytes);
    out.host.scales.resize(static_cast<size_t>(num_scales));
    std::memcpy(out.host.scales.data(), scales_host.bytes.data(), out.host.scales.size() * sizeof(float));
    out.host.scales_transposed = transposed;
    return out;
}

// bf16 [rows, k] values N(0, sigma) times 2^j, j in [-3, 3] drawn per (block of block_rows rows, K group): 128 for
// B's blocks, 1 for A's rows.
inline HostTensor varied_values(int64_t rows, int64_t k, int64_t block_rows, double sigma, std::mt19937_64& rng) {
    HostTensor values(MEGAMOE_DTYPE_BF16, {rows, k});
    std::normal_distribution<double> normal(0.0, sigma);
    std::uniform_int_distribution<int> exponent(-3, 3);
    std::vector<int> exponents(static_cast<size_t>(ceil_div(rows, block_rows) * ceil_div(k, kGroup)));
    for (int& j : exponents) j = exponent(rng);
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < k; ++c) {
            const int j = exponents[static_cast<size_t>((r / block_rows) * ceil_div(k, kGroup) + c / kGroup)];
            values.set(r * k + c, std::ldexp(normal(rng), j));
        }
    }
    return values;
}

struct Case {
    const char* name;
    std::vector<int> counts;  // sorted rows per expert
    int64_t k, n, inter;      // K, the store GEMM's N, the gated GEMM's I
    int64_t topk, tokens;     // topk 0: A is the sorted rows; else x [tokens, K] gathered by slot
    megamoe_dtype_t dtype = MEGAMOE_DTYPE_BF16;
    int64_t tile_slack = 0;  // max_m_tiles past the schedule's total
};

inline std::vector<Case> ragged_cases(std::mt19937_64& rng) {
    std::vector<Case> cases = {
        {"one row, E = 1, sorted", {1}, 128, 48, 128, 0, 0},
        {"one row of 3 tokens x topk 2 (5 slots dropped)", {0, 1, 0}, 208, 208, 128, 2, 3},
        {"rows 1 / 127 / 0 / 129 / 300, sorted", {1, 127, 0, 129, 300}, 208, 208, 128, 0, 0},
        {"rows 1 / 127 / 0 / 129 / 300, topk 4, dropped slots, max_m_tiles + 3",
         {1, 127, 0, 129, 300},
         208,
         208,
         128,
         4,
         200,
         MEGAMOE_DTYPE_BF16,
         3},
        {"one expert takes every slot, topk 2", {0, 0, 520, 0}, 336, 208, 256, 2, 260},
        {"64 experts, a quarter empty, topk 4", {}, 256, 144, 128, 4, 160},
        {"f16 out, sorted", {130, 5}, 160, 96, 128, 0, 0, MEGAMOE_DTYPE_F16},
    };
    std::vector<int64_t> empty;
    for (int64_t e = 1; e < 64; e += 4) empty.push_back(e);
    for (const int64_t count : random_counts(64, 600, empty, rng)) cases[5].counts.push_back(static_cast<int>(count));
    return cases;
}

inline DeviceTensor upload_ints(const std::vector<int>& values) {
    HostTensor host(MEGAMOE_DTYPE_I32, {static_cast<int64_t>(values.size())});
    for (size_t i = 0; i < values.size(); ++i) host.set(static_cast<int64_t>(i), values[i]);
    return DeviceTensor::upload(host);
}

// A case's routing and quantized A on the device.
struct Prepared {
    RowMap map;
    Quantized a;
    DeviceTensor offsets, tiles, slots;
};

inline Prepared prepare(const Case& c, std::mt19937_64& rng) {
    Prepared p;
    for (const int count : c.counts) {
        p.map.offsets.push_back(p.map.offsets.back() + count);
        p.map.tiles.push_back(p.map.tiles.back() + static_cast<int>(ceil_div(count, cuda::kGemmBlockM)));
    }
    p.map.num_a_rows = p.map.rows();
    if (c.topk > 0) {  // every sorted row a distinct slot of the tokens, the rest dropped
        std::vector<int> slots(static_cast<size_t>(c.tokens * c.topk));
        std::iota(slots.begin(), slots.end(), 0);
        std::shuffle(slots.begin(), slots.end(), rng);
        p.map.slots.assign(slots.begin(), slots.begin() + p.map.rows());
        p.map.topk = c.topk;
        p.map.num_a_rows = c.tokens;
        p.slots = upload_ints(p.map.slots);
    }
    HostTensor x = varied_values(p.map.num_a_rows, c.k, 1, 1.0, rng);
    if (p.map.num_a_rows > 1) {  // A row 0's first group zero (scale 1), unless it is the only row
        for (int64_t col = 0; col < kGroup; ++col) x.set(col, 0.0);
    }
    p.a = quantize(x, 1, p.map.num_a_rows, c.k, false);
    p.offsets = upload_ints(p.map.offsets);
    p.tiles = upload_ints(p.map.tiles);
    return p;
}

// Poisons the outputs, runs `launch`, downloads them.
template <typename Launch>
inline std::vector<HostTensor> run(const std::vector<DeviceTensor*>& outputs, const Launch& launch) {
    for (DeviceTensor* out : outputs) out->poison();
    expect_cuda(cudaDeviceSynchronize(), "poison");
    EXPECT_EQ(launch(), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
    expect_cuda(cudaDeviceSynchronize(), "fp8 gemm");
    std::vector<HostTensor> got;
    for (const DeviceTensor* out : outputs) got.push_back(out->download());
    return got;
}

}  // namespace megamoe::test
