// The FP8 quantization kernels (src/portable/fp8_quant.h: groups along rows, an expert's rows along tokens, weight
// blocks) against a host port of python/megamoe/fp8_reference.py's rules, bit for bit: scales (NaN compared as bits)
// and e4m3 bytes, on partial groups and blocks, every input dtype, a row stride past the columns, power-of-two scales
// or not, zero groups, NaN and infinities, underflowing scales, values at the E4M3 limit. The host port is itself
// checked (without a GPU too) on a group worked by hand: the same bytes as fp8_reference's test_known_bytes. Without
// a GPU the kernel tests skip.
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
#include "portable/fp8_quant.h"

namespace megamoe::test {
namespace {

constexpr int kGroup = cuda::kFp8GroupSize;

uint32_t bits_of(float value) {
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof(bits));
    return bits;
}
float float_of(uint32_t bits) {
    float value;
    std::memcpy(&value, &bits, sizeof(value));
    return value;
}

// The 32-bit word idx of a downloaded tensor (a scale's bits, NaN payloads and the 0xFF poison included).
uint32_t word_at(const HostTensor& tensor, int64_t idx) {
    uint32_t word;
    std::memcpy(&word, tensor.bytes.data() + idx * sizeof(word), sizeof(word));
    return word;
}

// A kernel's scale against the host's: the same bits, or both NaN (the kernel's NaN is 0x7FC00000, the host's its own).
bool same_scale(uint32_t got_bits, float want) {
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
float host_scale(float amax, bool non_finite, bool pow2) {
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
float host_factor(float amax, float scale, bool non_finite, bool pow2) {
    if (non_finite) return 0.0f;
    if (amax == 0.0f) return 1.0f;
    const float factor = pow2 ? 1.0f / scale : 448.0f / amax;
    return std::min(factor, std::numeric_limits<float>::max());
}

// fp8_reference's byte of v in a group of the given factor (one f32 multiplication, clamped, round to nearest even).
uint8_t host_byte(float v, float factor, bool non_finite) {
    if (non_finite) return 0x7F;
    const float ratio = std::min(std::max(v * factor, -448.0f), 448.0f);
    return static_cast<uint8_t>(__nv_cvt_float_to_fp8(ratio, __NV_SATFINITE, __NV_E4M3));
}

struct HostQuant {
    std::vector<uint8_t> q;
    std::vector<float> scales;
};

// values [rows, cols] (f32, already what the kernel reads) quantized as fp8_reference.quantize_groups does.
HostQuant host_quantize(const std::vector<float>& values, int64_t rows, int64_t cols, bool pow2) {
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
    SKIP_WITHOUT_CUDA();
    std::mt19937_64 rng(fresh_seed());
    // 300 quantized columns of a 312-element stride (a partial group; the kernel's vector path: 4-element aligned
    // rows), and 301 of 301 (its scalar path).
    for (const auto [cols, stride] : {std::pair<int64_t, int64_t>{300, 312}, std::pair<int64_t, int64_t>{301, 301}}) {
        for (const megamoe_dtype_t dtype : {MEGAMOE_DTYPE_BF16, MEGAMOE_DTYPE_F16, MEGAMOE_DTYPE_F32}) {
            for (const bool pow2 : {false, true}) {
                HostTensor input(dtype, {37, stride});
                input.fill_random(rng, 3.0);
                expect_kernel_matches_host(input, 37, cols, pow2, pow2 ? "random, pow2" : "random");
            }
        }
    }
}

TEST(Fp8QuantCuda, DefinedEdgeCases) {
    SKIP_WITHOUT_CUDA();
    std::mt19937_64 rng(fresh_seed());
    HostTensor input(MEGAMOE_DTYPE_F32, {6, 256});
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

// quantize_groups scattering routing slots into sorted rows (slot_to_row: MEGAMOE_FP8_SORTED_X's pass over x): sorted
// row slot_to_row[s] holds token row s / topk quantized, dropped slots write nothing, rows no slot maps to keep their
// poison; both kernel paths (cols 300 of stride 312: vector; 301 of 301: scalar), bf16 and f32.
TEST(Fp8QuantCuda, ScatteredSlotsIntoSortedRows) {
    SKIP_WITHOUT_CUDA();
    std::mt19937_64 rng(fresh_seed());
    constexpr int64_t kTokens = 23, kTopk = 3, kSlots = kTokens * kTopk;
    // A random permutation of the slots onto the sorted rows, every fifth slot dropped: the last rows unused.
    std::vector<int64_t> order(static_cast<size_t>(kSlots));
    for (int64_t i = 0; i < kSlots; ++i) order[static_cast<size_t>(i)] = i;
    std::shuffle(order.begin(), order.end(), rng);
    HostTensor slot_to_row(MEGAMOE_DTYPE_I32, {kSlots});
    slot_to_row.fill(-1.0);
    int64_t num_rows = 0;
    for (int64_t i = 0; i < kSlots; ++i) {
        if (i % 5 != 4) slot_to_row.set(order[static_cast<size_t>(i)], static_cast<double>(num_rows++));
    }
    const DeviceTensor slot_to_row_dev = DeviceTensor::upload(slot_to_row);
    for (const auto [cols, stride] : {std::pair<int64_t, int64_t>{300, 312}, std::pair<int64_t, int64_t>{301, 301}}) {
        for (const megamoe_dtype_t dtype : {MEGAMOE_DTYPE_BF16, MEGAMOE_DTYPE_F32}) {
            SCOPED_TRACE(testing::Message() << "cols " << cols << ", dtype " << dtype);
            const int64_t groups = (cols + kGroup - 1) / kGroup;
            HostTensor input(dtype, {kTokens, stride});
            input.fill_random(rng, 3.0);
            std::vector<float> values(static_cast<size_t>(kTokens * cols));
            for (int64_t t = 0; t < kTokens; ++t) {
                for (int64_t c = 0; c < cols; ++c)
                    values[static_cast<size_t>(t * cols + c)] = static_cast<float>(input.get(t * stride + c));
            }
            const HostQuant want = host_quantize(values, kTokens, cols, false);  // per token row
            const DeviceTensor in_dev = DeviceTensor::upload(input);
            DeviceTensor q_dev(HostTensor(MEGAMOE_DTYPE_E4M3, {kSlots, cols}).view);
            DeviceTensor scales_dev(HostTensor(MEGAMOE_DTYPE_F32, {kSlots, groups}).view);
            q_dev.poison();
            scales_dev.poison();
            cuda::QuantizeGroupsArgs args{};
            args.in = in_dev.view().data;
            args.in_dtype = dtype;
            args.rows = kSlots;
            args.cols = cols;
            args.in_row_stride = stride;
            args.q = static_cast<uint8_t*>(q_dev.view().data);
            args.scales = static_cast<float*>(scales_dev.view().data);
            args.slot_to_row = static_cast<const int*>(slot_to_row_dev.view().data);
            args.topk = kTopk;
            ASSERT_EQ(cuda::launch_quantize_groups(args, nullptr), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
            expect_cuda(cudaDeviceSynchronize(), "quantize_groups scattering");
            const HostTensor q = q_dev.download(), scales = scales_dev.download();
            std::vector<int64_t> token_of_row(static_cast<size_t>(kSlots), -1);
            for (int64_t slot = 0; slot < kSlots; ++slot) {
                const auto row = static_cast<int64_t>(slot_to_row.get(slot));
                if (row >= 0) token_of_row[static_cast<size_t>(row)] = slot / kTopk;
            }
            for (int64_t row = 0; row < kSlots; ++row) {
                const int64_t token = token_of_row[static_cast<size_t>(row)];
                for (int64_t g = 0; g < groups; ++g) {
                    const uint32_t got = word_at(scales, row * groups + g);
                    if (token < 0) {
                        ASSERT_EQ(got, 0xFFFFFFFFu) << "scale of unused row " << row << " written";
                    } else {
                        ASSERT_TRUE(same_scale(got, want.scales[static_cast<size_t>(token * groups + g)]))
                            << "scale of row " << row << ", group " << g;
                    }
                }
                for (int64_t c = 0; c < cols; ++c) {
                    const uint8_t byte = q.bytes[static_cast<size_t>(row * cols + c)];
                    ASSERT_EQ(byte, token < 0 ? 0xFF : want.q[static_cast<size_t>(token * cols + c)])
                        << "row " << row << " (token " << token << "), column " << c;
                }
            }
        }
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

// check_expert_rows' second run: `args` (its first run's, which gave q and scales) with row_q, row_scales and,
// gathered, slot_to_row (from sorted_slot; the slots it leaves out dropped).
void check_source_rows(cuda::QuantizeExpertRowsArgs args, const HostTensor& q, const HostTensor& scales,
                       const HostTensor& tokens, const HostTensor& sorted_slot, int64_t num_rows, bool gathered) {
    SCOPED_TRACE("with the source rows along their columns (row_q)");
    const int64_t num_tokens = tokens.view.shape[0], stride = tokens.view.shape[1], cols = args.cols;
    const int64_t groups = (cols + kGroup - 1) / kGroup;
    HostTensor slot_to_row(MEGAMOE_DTYPE_I32, {num_tokens * args.topk});
    slot_to_row.fill(-1.0);
    std::vector<bool> routed(static_cast<size_t>(num_tokens), false);
    for (int64_t r = 0; r < num_rows; ++r) {
        const int64_t slot = static_cast<int64_t>(sorted_slot.get(r));
        if (gathered) slot_to_row.set(slot, static_cast<double>(r));
        routed[static_cast<size_t>(gathered ? slot / args.topk : r)] = true;
    }
    const DeviceTensor slot_to_row_dev = DeviceTensor::upload(slot_to_row);
    DeviceTensor q_dev(q.view), scales_dev(scales.view);
    DeviceTensor row_q_dev(HostTensor(MEGAMOE_DTYPE_E4M3, {num_tokens, cols}).view);
    DeviceTensor row_scales_dev(HostTensor(MEGAMOE_DTYPE_F32, {num_tokens, groups}).view);
    for (DeviceTensor* t : {&q_dev, &scales_dev, &row_q_dev, &row_scales_dev}) t->poison();
    args.q_t = static_cast<uint8_t*>(q_dev.view().data);
    args.scales = static_cast<float*>(scales_dev.view().data);
    args.row_q = static_cast<uint8_t*>(row_q_dev.view().data);
    args.row_scales = static_cast<float*>(row_scales_dev.view().data);
    args.slot_to_row = gathered ? static_cast<const int*>(slot_to_row_dev.view().data) : nullptr;
    ASSERT_EQ(cuda::launch_quantize_expert_rows(args, nullptr), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
    expect_cuda(cudaDeviceSynchronize(), "quantize_expert_rows with row_q");
    EXPECT_EQ(q_dev.download().bytes, q.bytes) << "q_t differs when the rows are quantized too";
    EXPECT_EQ(scales_dev.download().bytes, scales.bytes) << "the scales differ when the rows are quantized too";
    const HostTensor row_q = row_q_dev.download(), row_scales = row_scales_dev.download();
    int64_t num_routed = 0;
    for (int64_t source = 0; source < num_tokens; ++source) {
        if (!routed[static_cast<size_t>(source)]) {
            for (int64_t c = 0; c < cols; ++c) {
                ASSERT_EQ(row_q.bytes[static_cast<size_t>(source * cols + c)], 0xFF) << "unrouted row " << source;
            }
            for (int64_t g = 0; g < groups; ++g) {
                ASSERT_EQ(word_at(row_scales, source * groups + g), 0xFFFFFFFFu) << "unrouted row " << source;
            }
            continue;
        }
        ++num_routed;
        std::vector<float> values(static_cast<size_t>(cols));
        for (int64_t c = 0; c < cols; ++c)
            values[static_cast<size_t>(c)] = static_cast<float>(tokens.get(source * stride + c));
        const HostQuant want = host_quantize(values, 1, cols, args.pow2);
        for (int64_t g = 0; g < groups; ++g) {
            ASSERT_TRUE(same_scale(word_at(row_scales, source * groups + g), want.scales[static_cast<size_t>(g)]))
                << "row " << source << " group " << g;
        }
        for (int64_t c = 0; c < cols; ++c) {
            ASSERT_EQ(row_q.bytes[static_cast<size_t>(source * cols + c)], want.q[static_cast<size_t>(c)])
                << "row " << source << " column " << c;
        }
    }
    EXPECT_GT(num_routed, 0);
}

// One source layout of ExpertRowsAlongTokens: token rows [700, stride] of dtype (>= the 681 sorted rows, read as they
// are) (placed `offset` elements past a 16-byte boundary), the first cols of each quantized along the sorted rows of E
// = 7 experts: 130 rows (a whole tile and 2 rows), none, 1, 256 (two whole tiles), 37, 128 (exactly one tile) and 129
// (a whole tile and one row); a NaN in expert 0's first tile and -inf / +inf in expert 2's one-row tile (a NaN scale:
// its pad must stay 0, not 0x7F). Gathered by sorted slot or read as they are, power-of-two scales or not, every tile
// against the host port of its rows column by column, bitwise: q_t's tile-padded columns (the pad bytes [rows, 128)
// exactly 0) and the tile-major scales. Columns of q_t past 128 * num_tiles (to ld_q), scale rows past num_tiles and
// scale columns past cols keep the poison. Then the same pass also writing the source rows along their columns (row_q,
// row_scales): q_t and the scales bitwise the first run's, every routed source row's bytes and scales the host rules'
// over its cols values (written once, from its first routed slot), the rows no slot routes keeping the poison.
void check_expert_rows(megamoe_dtype_t dtype, int64_t cols, int64_t stride, int64_t offset) {
    std::mt19937_64 rng(fresh_seed());
    const std::vector<int> counts = {130, 0, 1, 256, 37, 128, 129};
    const int64_t num_experts = static_cast<int64_t>(counts.size()), topk = 2, num_tokens = 700;
    std::vector<int> expert_offsets = {0}, tile_offsets = {0};
    for (const int count : counts) {
        expert_offsets.push_back(expert_offsets.back() + count);
        tile_offsets.push_back(tile_offsets.back() + (count + kGroup - 1) / kGroup);
    }
    const int64_t num_rows = expert_offsets.back(), num_tiles = tile_offsets.back(), max_tiles = num_tiles + 2;
    const int64_t ld_q = kGroup * max_tiles + 16;  // room past the tiles, and past max_tiles
    const int64_t ld_scales = (cols + 3) / 4 * 4 + 4;
    HostTensor tokens(dtype, {num_tokens, stride});
    tokens.fill_random(rng, 2.0);
    const int64_t one_row = expert_offsets[2];  // expert 2's only row
    std::vector<int> slots;  // every slot but those of the tokens holding the non-finite values, shuffled
    for (int slot = 0; slot < num_tokens * topk; ++slot) {
        if (slot / topk != 7 && slot / topk != 9 && slot / topk != one_row) slots.push_back(slot);
    }
    std::shuffle(slots.begin(), slots.end(), rng);
    ASSERT_LE(num_rows, static_cast<int64_t>(slots.size())) << "a sorted row per slot at most";
    HostTensor sorted_slot(MEGAMOE_DTYPE_I32, {num_rows}), offsets(MEGAMOE_DTYPE_I32, {num_experts + 1}),
        tiles(MEGAMOE_DTYPE_I32, {num_experts + 1});
    for (int64_t r = 0; r < num_rows; ++r) sorted_slot.set(r, slots[static_cast<size_t>(r)]);
    sorted_slot.set(0, 7 * topk);  // gathered: token 7 in expert 0's first tile, token 9 in expert 2's
    sorted_slot.set(one_row, 9 * topk);
    // rows as they are: rows 7 and 9 in expert 0's first tile, row one_row in expert 2's
    tokens.set(7 * stride + 3, std::numeric_limits<double>::quiet_NaN());
    tokens.set(9 * stride + 5, -std::numeric_limits<double>::infinity());
    tokens.set(one_row * stride + 5, std::numeric_limits<double>::infinity());
    for (int64_t e = 0; e <= num_experts; ++e) {
        offsets.set(e, expert_offsets[static_cast<size_t>(e)]);
        tiles.set(e, tile_offsets[static_cast<size_t>(e)]);
    }
    const DeviceTensor tokens_dev = DeviceTensor::upload(tokens, offset), slots_dev = DeviceTensor::upload(sorted_slot);
    const DeviceTensor offsets_dev = DeviceTensor::upload(offsets), tiles_dev = DeviceTensor::upload(tiles);
    for (const bool gathered : {true, false}) {
        for (const bool pow2 : {false, true}) {
            SCOPED_TRACE(::testing::Message()
                         << (gathered ? "gathered" : "rows as they are") << (pow2 ? ", pow2" : ""));
            DeviceTensor q_dev(HostTensor(MEGAMOE_DTYPE_I32, {cols * ld_q / 4}).view);
            DeviceTensor scales_dev(HostTensor(MEGAMOE_DTYPE_F32, {max_tiles, ld_scales}).view);
            q_dev.poison();
            scales_dev.poison();
            cuda::QuantizeExpertRowsArgs args{};
            args.in = tokens_dev.view().data;
            args.in_dtype = dtype;
            args.cols = cols;
            args.in_row_stride = stride;
            args.sorted_slot = gathered ? static_cast<const int*>(slots_dev.view().data) : nullptr;
            args.topk = topk;
            args.expert_offsets = static_cast<const int*>(offsets_dev.view().data);
            args.m_tile_offsets = static_cast<const int*>(tiles_dev.view().data);
            args.num_experts = num_experts;
            args.max_tiles = max_tiles;
            args.q_t = static_cast<uint8_t*>(q_dev.view().data);
            args.ld_q = ld_q;
            args.scales = static_cast<float*>(scales_dev.view().data);
            args.ld_scales = ld_scales;
            args.pow2 = pow2;
            ASSERT_EQ(cuda::launch_quantize_expert_rows(args, nullptr), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
            expect_cuda(cudaDeviceSynchronize(), "quantize_expert_rows");
            const HostTensor q = q_dev.download(), scales = scales_dev.download();
            int non_finite_tiles = 0;
            for (int64_t e = 0; e < num_experts; ++e) {
                const int64_t first_tile = tile_offsets[static_cast<size_t>(e)];
                for (int64_t t = first_tile; t < tile_offsets[static_cast<size_t>(e) + 1]; ++t) {
                    const int64_t first = expert_offsets[static_cast<size_t>(e)] + (t - first_tile) * kGroup;
                    const int64_t rows = std::min<int64_t>(kGroup, expert_offsets[static_cast<size_t>(e) + 1] - first);
                    bool non_finite = false;
                    for (int64_t c = 0; c < cols; ++c) {
                        std::vector<float> column(static_cast<size_t>(rows));
                        for (int64_t r = 0; r < rows; ++r) {
                            const int64_t source = gathered ? sorted_slot.get(first + r) / topk : first + r;
                            column[static_cast<size_t>(r)] = static_cast<float>(tokens.get(source * stride + c));
                        }
                        const HostQuant want = host_quantize(column, 1, rows, pow2);
                        non_finite |= std::isnan(want.scales[0]);
                        ASSERT_TRUE(same_scale(word_at(scales, t * ld_scales + c), want.scales[0]))
                            << "tile " << t << " column " << c << ": " << float_of(word_at(scales, t * ld_scales + c))
                            << " against " << want.scales[0];
                        const size_t q_column = static_cast<size_t>(c * ld_q + t * kGroup);
                        for (int64_t r = 0; r < rows; ++r) {
                            ASSERT_EQ(q.bytes[q_column + static_cast<size_t>(r)], want.q[static_cast<size_t>(r)])
                                << "tile " << t << " column " << c << " row " << r;
                        }
                        for (int64_t r = rows; r < kGroup; ++r) {
                            ASSERT_EQ(q.bytes[q_column + static_cast<size_t>(r)], 0x00)
                                << "the pad: tile " << t << " (" << rows << " rows) column " << c << " row " << r;
                        }
                    }
                    non_finite_tiles += non_finite ? 1 : 0;
                    for (int64_t c = cols; c < ld_scales; ++c) {
                        ASSERT_EQ(word_at(scales, t * ld_scales + c), 0xFFFFFFFFu) << "tile " << t << " column " << c;
                    }
                }
            }
            EXPECT_EQ(non_finite_tiles, 2) << "expert 0's first tile (a NaN) and expert 2's (an infinity)";
            for (int64_t c = 0; c < cols; ++c) {  // the poison past the tile count
                for (int64_t j = num_tiles * kGroup; j < ld_q; ++j) {
                    ASSERT_EQ(q.bytes[static_cast<size_t>(c * ld_q + j)], 0xFF) << "column " << c << ", byte " << j;
                }
            }
            for (int64_t t = num_tiles; t < max_tiles; ++t) {
                for (int64_t c = 0; c < ld_scales; ++c) {
                    ASSERT_EQ(word_at(scales, t * ld_scales + c), 0xFFFFFFFFu) << "tile " << t << " column " << c;
                }
            }
            check_source_rows(args, q, scales, tokens, sorted_slot, num_rows, gathered);
        }
    }
}

// quantize_expert_rows in its tile-padded layout (check_expert_rows), bf16 and f32 sources: 70 columns of a 72-element
// stride (cols not a multiple of 8: the scalar loads), 136 of 144 (the 16-byte loads; two column blocks, the second
// of 8 columns), 136 of 140 (bf16: rows 8-byte aligned only, the scalar loads; f32: 16-byte rows, the vector loads)
// and 136 of 144 placed one element past a 16-byte boundary (the scalar loads).
TEST(Fp8QuantCuda, ExpertRowsAlongTokens) {
    SKIP_WITHOUT_CUDA();
    struct Layout {
        int64_t cols, stride, offset;
    };
    for (const megamoe_dtype_t dtype : {MEGAMOE_DTYPE_BF16, MEGAMOE_DTYPE_F32}) {
        for (const Layout layout : {Layout{70, 72, 0}, Layout{136, 144, 0}, Layout{136, 140, 0}, Layout{136, 144, 1}}) {
            SCOPED_TRACE(::testing::Message() << "dtype " << dtype << ", cols " << layout.cols << ", stride "
                                              << layout.stride << ", offset " << layout.offset);
            check_expert_rows(dtype, layout.cols, layout.stride, layout.offset);
        }
    }
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
    SKIP_WITHOUT_CUDA();
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

// quantize_expert_rows' launcher refuses the layouts the tile-padded q_t and the tile-major scales cannot hold, naming
// the argument (no GPU needed: the checks come before any launch).
TEST(Fp8QuantCuda, ExpertRowsRefuseShortOrMisalignedStrides) {
    alignas(16) static uint8_t q_t[16 * 4 * 128 + 16];
    alignas(16) static float scales[64 * 4 + 4];
    const int offsets[2] = {0, 300}, tiles[2] = {0, 3};
    float in = 0.0f;
    cuda::QuantizeExpertRowsArgs good{};
    good.in = &in;
    good.in_dtype = MEGAMOE_DTYPE_F32;
    good.cols = 16;
    good.in_row_stride = 16;
    good.expert_offsets = offsets;
    good.m_tile_offsets = tiles;
    good.num_experts = 1;
    good.max_tiles = 4;
    good.q_t = q_t;
    good.ld_q = 4 * 128;
    good.scales = scales;
    good.ld_scales = 16;
    const auto expect_refused = [](const cuda::QuantizeExpertRowsArgs& args, const char* name, const char* what) {
        SCOPED_TRACE(what);
        EXPECT_EQ(cuda::launch_quantize_expert_rows(args, nullptr), MEGAMOE_STATUS_INTERNAL_ERROR);
        const std::string error = megamoe_last_error();
        EXPECT_NE(error.find("quantize_expert_rows"), std::string::npos) << error;
        EXPECT_NE(error.find(name), std::string::npos) << error;
    };
    cuda::QuantizeExpertRowsArgs args = good;
    args.ld_q = 128 * 4 - 16;  // a multiple of 16, one tile's worth short of 128 * max_tiles
    expect_refused(args, "ld_q", "ld_q < 128 * max_tiles");
    args = good;
    args.max_tiles = 5;
    expect_refused(args, "ld_q", "max_tiles past ld_q / 128");
    args = good;
    args.ld_q = 4 * 128 + 8;
    expect_refused(args, "ld_q", "ld_q not a multiple of 16");
    args = good;
    args.q_t = q_t + 8;
    expect_refused(args, "q_t", "q_t not 16-byte aligned");
    args = good;
    args.ld_scales = 12;
    expect_refused(args, "ld_scales", "ld_scales < cols");
    args = good;
    args.ld_scales = 18;
    expect_refused(args, "ld_scales", "ld_scales not a multiple of 4");
    args = good;
    args.scales = scales + 1;
    expect_refused(args, "scales", "scales not 16-byte aligned");
}

}  // namespace
}  // namespace megamoe::test
