// quantize_expert_rows (src/portable/fp8_quant_expert_rows.cu: an expert's rows along the tokens, transposed and
// tile-padded for the K-grouped FP8 GEMM, with the source rows along their columns where asked) against the host port
// of python/megamoe/fp8_reference.py's rules (fp8_quant_host_port.h), bit for bit, and its launcher's refusals.
// Without a GPU the kernel tests skip.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "cuda_test_util.h"
#include "fp8_quant_host_port.h"
#include "portable/fp8_quant.h"

namespace megamoe::test {
namespace {

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
