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
// gathered by slot (topk 2 and 4, dropped slots), bf16 and f16 out; outputs poisoned (NaN) before every run, two runs
// bitwise equal, the gated GEMM with h or act NULL. The supported() refusals need an sm_90 device; without one the
// GPU tests skip and RefusesWithoutSm90Device checks that supported() says no.
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <limits>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "cuda_test_util.h"
#include "grouped_test_util.h"
#include "portable/fp8_quant.h"
#include "sm90/m_grouped_fp8_gemm_sm90.h"

namespace megamoe::test {
namespace {

constexpr int64_t kGroup = cuda::kFp8GroupSize;
constexpr double kAccumulation = 1.0 / 512;  // c: the accumulation error budget per unit of the term sizes S
constexpr double kFrobenius = 1e-2;

int64_t ceil_div(int64_t a, int64_t b) {
    return (a + b - 1) / b;
}

// The exact value of an e4m3 byte (bias 7, subnormals below 2^-6, no infinities, 0x7F / 0xFF NaN).
double e4m3_value(uint8_t byte) {
    if ((byte & 0x7F) == 0x7F) return std::numeric_limits<double>::quiet_NaN();
    const int exponent = (byte >> 3) & 0xF, mantissa = byte & 0x7;
    const double magnitude =
        exponent == 0 ? std::ldexp(mantissa / 8.0, -6) : std::ldexp(1.0 + mantissa / 8.0, exponent - 7);
    return (byte & 0x80) != 0 ? -magnitude : magnitude;
}

struct Fp8Host {
    std::vector<uint8_t> q;
    std::vector<float> scales;
};

// The sorted rows: expert e owns [offsets[e], offsets[e + 1]); row r reads A row slots[r] / topk (slots empty: r).
struct RowMap {
    std::vector<int> offsets{0}, tiles{0}, slots;
    int64_t topk = 1, num_a_rows = 0;
    int64_t rows() const { return offsets.back(); }
    int64_t experts() const { return static_cast<int64_t>(offsets.size()) - 1; }
    int64_t a_row(int64_t r) const { return slots.empty() ? r : slots[static_cast<size_t>(r)] / topk; }
};

// What a broken kernel could do, for ToleranceRejectsMutants.
enum class Mutation { kNone, kNeighbourRow, kBScaleOfBlock0, kAScaleOfNextGroup, kLastGroupDropped, kGroupEndDropped };

struct Expected {
    std::vector<double> value, size;  // [rows, n_b]: acc and S
};

// acc[r, n] = sum_g sa[a_row(r), g] sb[e, n / 128, g] sum_{k in g} A8[a_row(r), k] B8_e[n, k], in f64.
Expected reference(const Fp8Host& a, const Fp8Host& b, const RowMap& map, int64_t n_b, int64_t k,
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
                    const double scale = static_cast<double>(a.scales[static_cast<size_t>(row * groups + ga)]) *
                                         b.scales[static_cast<size_t>((e * n_blocks + nb) * groups + g)];
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

double rounding_of(megamoe_dtype_t dtype) {
    return dtype == MEGAMOE_DTYPE_F16 ? std::ldexp(1.0, -11) : std::ldexp(1.0, -8);
}

// out and h: u |want| + c S.
Target plain_target(const Expected& acc, megamoe_dtype_t dtype) {
    Target t{acc.value, std::vector<double>(acc.value.size())};
    for (size_t i = 0; i < t.bound.size(); ++i) {
        t.bound[i] = rounding_of(dtype) * std::fabs(acc.value[i]) + kAccumulation * acc.size[i];
    }
    return t;
}

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

struct Comparison {
    int64_t bad = 0;
    double worst = 0.0;      // max |got - want| / bound
    double frobenius = 0.0;  // ||got - want|| / ||want||
    std::string first_bad;
};

// got(i) against the target elementwise (NaN fails), rows of `cols` elements.
template <typename Get>
Comparison compare(const Get& got, const Target& t, int64_t cols) {
    Comparison c;
    double diff = 0.0, norm = 0.0;
    std::ostringstream first;
    for (size_t i = 0; i < t.want.size(); ++i) {
        const double g = got(static_cast<int64_t>(i)), err = std::fabs(g - t.want[i]);
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

void expect_close(const HostTensor& got, const Target& t, int64_t cols, const std::string& what) {
    ASSERT_EQ(static_cast<size_t>(got.size()), t.want.size()) << what;
    const Comparison c = compare([&](int64_t i) { return got.get(i); }, t, cols);
    EXPECT_EQ(c.bad, 0) << what << ": " << c.bad << " of " << t.want.size() << " out of bounds:" << c.first_bad;
    EXPECT_LT(c.frobenius, kFrobenius) << what << ": relative Frobenius error";
    std::cout << "  " << what << ": relative Frobenius error " << c.frobenius << ", worst |error| / bound " << c.worst
              << "\n";
}

// The FP8 GEMM's arguments: A e4m3 [num_a_rows, k] (lda k bytes) gathered by `slots` (NULL: the sorted rows), B_e
// [n_b, k] bytes, the routing's offsets and M tiles, the output in `dtype`.
cuda::MGroupedGemmArgs gemm_args(megamoe_dtype_t dtype, const void* a, int64_t num_a_rows, const int* slots,
                                 int64_t topk, const void* b, int64_t n_b, int64_t n, int64_t k, const int* offsets,
                                 const int* tiles, int64_t experts, int64_t max_tiles) {
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
// k.
Quantized quantize(const HostTensor& values, int64_t experts, int64_t rows, int64_t k, bool blocks) {
    const int64_t bytes = experts * rows * k;
    const int64_t num_scales = experts * (blocks ? ceil_div(rows, kGroup) : rows) * ceil_div(k, kGroup);
    const DeviceTensor in = DeviceTensor::upload(values);
    Quantized out{DeviceTensor(HostTensor(MEGAMOE_DTYPE_I32, {ceil_div(bytes, 4)}).view),
                  DeviceTensor(HostTensor(MEGAMOE_DTYPE_F32, {num_scales}).view),
                  {}};
    out.q.poison();
    out.scales.poison();
    auto* q = static_cast<uint8_t*>(out.q.view().data);
    auto* scales = static_cast<float*>(out.scales.view().data);
    const megamoe_status_t status =
        blocks
            ? cuda::launch_quantize_blocks(
                  {in.view().data, values.view.dtype, experts, rows, k, q, nullptr, scales, false}, nullptr)
            : cuda::launch_quantize_groups({in.view().data, values.view.dtype, rows, k, k, q, scales, false}, nullptr);
    EXPECT_EQ(status, MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
    expect_cuda(cudaDeviceSynchronize(), "quantize");
    const HostTensor q_host = out.q.download(), scales_host = out.scales.download();
    out.host.q.assign(q_host.bytes.begin(), q_host.bytes.begin() + bytes);
    out.host.scales.resize(static_cast<size_t>(num_scales));
    std::memcpy(out.host.scales.data(), scales_host.bytes.data(), out.host.scales.size() * sizeof(float));
    return out;
}

// bf16 [rows, k] values N(0, sigma) times 2^j, j in [-3, 3] drawn per (block of block_rows rows, K group): 128 for
// B's blocks, 1 for A's rows.
HostTensor varied_values(int64_t rows, int64_t k, int64_t block_rows, double sigma, std::mt19937_64& rng) {
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

std::vector<Case> ragged_cases(std::mt19937_64& rng) {
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

DeviceTensor upload_ints(const std::vector<int>& values) {
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

Prepared prepare(const Case& c, std::mt19937_64& rng) {
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
std::vector<HostTensor> run(const std::vector<DeviceTensor*>& outputs, const Launch& launch) {
    for (DeviceTensor* out : outputs) out->poison();
    expect_cuda(cudaDeviceSynchronize(), "poison");
    EXPECT_EQ(launch(), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
    expect_cuda(cudaDeviceSynchronize(), "fp8 gemm");
    std::vector<HostTensor> got;
    for (const DeviceTensor* out : outputs) got.push_back(out->download());
    return got;
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
