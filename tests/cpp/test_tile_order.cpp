// The M-grouped kernels' tile order (sm90/m_grouped/tile_order.h), on the host side of the same arithmetic: every
// cluster tile maps to a distinct (pair, n-tile) and every pair meets every n-tile (for pair blocks 1 .. 9, pair counts
// 1 .. 40 and n-tile counts 1 .. 13: whole and partial last blocks, blocks larger than the pairs); a pair block of 1 is
// the plain order t = pair * num_n_tiles + n_tile; inside a block, consecutive tiles walk the block's pairs of one
// n-tile before the next n-tile; and the pair block each launch picks from its budget.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "sm90/m_grouped/tile_order.h"

namespace megamoe {
namespace {

using sm90::m_grouped::pair_block_for;
using sm90::m_grouped::tile_coords;
using sm90::m_grouped::TileCoords;

TEST(TileOrder, EveryPairMeetsEveryNTileOnce) {
    for (int pair_block = 1; pair_block <= 9; ++pair_block) {
        for (int num_pairs = 1; num_pairs <= 40; ++num_pairs) {
            for (int64_t num_n_tiles = 1; num_n_tiles <= 13; ++num_n_tiles) {
                std::vector<int> seen(static_cast<size_t>(num_pairs * num_n_tiles), 0);
                for (int64_t tile_idx = 0; tile_idx < num_pairs * num_n_tiles; ++tile_idx) {
                    const TileCoords coords = tile_coords(tile_idx, num_n_tiles, num_pairs, pair_block);
                    ASSERT_GE(coords.pair_idx, 0);
                    ASSERT_LT(coords.pair_idx, num_pairs);
                    ASSERT_GE(coords.n_tile_idx, 0);
                    ASSERT_LT(coords.n_tile_idx, num_n_tiles);
                    ++seen[static_cast<size_t>(coords.pair_idx * num_n_tiles + coords.n_tile_idx)];
                }
                for (const int count : seen) {
                    ASSERT_EQ(count, 1) << "pair_block " << pair_block << ", " << num_pairs << " pairs, " << num_n_tiles
                                        << " n-tiles";
                }
            }
        }
    }
}

TEST(TileOrder, PairBlockOneIsThePlainOrder) {
    const int num_pairs = 37;
    const int64_t num_n_tiles = 112;
    for (int64_t tile_idx = 0; tile_idx < num_pairs * num_n_tiles; ++tile_idx) {
        const TileCoords coords = tile_coords(tile_idx, num_n_tiles, num_pairs, 1);
        ASSERT_EQ(coords.pair_idx, tile_idx / num_n_tiles);
        ASSERT_EQ(coords.n_tile_idx, tile_idx % num_n_tiles);
    }
}

TEST(TileOrder, ABlockWalksItsPairsOfOneNTileFirst) {
    const int num_pairs = 30;  // blocks of 4 pairs: 7 whole ones and a last one of 2
    const int pair_block = 4;
    const int64_t num_n_tiles = 5;
    int64_t tile_idx = 0;
    for (int first_pair = 0; first_pair < num_pairs; first_pair += pair_block) {
        const int block_pairs = first_pair + pair_block <= num_pairs ? pair_block : num_pairs - first_pair;
        for (int64_t n_tile_idx = 0; n_tile_idx < num_n_tiles; ++n_tile_idx) {
            for (int pair_idx = first_pair; pair_idx < first_pair + block_pairs; ++pair_idx, ++tile_idx) {
                const TileCoords coords = tile_coords(tile_idx, num_n_tiles, num_pairs, pair_block);
                ASSERT_EQ(coords.pair_idx, pair_idx) << "tile " << tile_idx;
                ASSERT_EQ(coords.n_tile_idx, n_tile_idx) << "tile " << tile_idx;
            }
        }
    }
    EXPECT_EQ(tile_idx, num_pairs * num_n_tiles);
}

TEST(TileOrder, PairBlockFromTheBudget) {
    constexpr int64_t kMiB = int64_t{1} << 20;
    constexpr int64_t kRowsPerPair = 256;    // two 128-row M tiles
    constexpr int64_t kOverL2 = 235 * kMiB;  // an expert's B that exceeds the L2 (mixtral-8x7b's w13[e])
    // bf16 A rows of a pair: 256 x K x 2 bytes.
    EXPECT_EQ(pair_block_for(kRowsPerPair, 4096, 2, kOverL2, 8 * kMiB), 4);   // 2 MiB a pair (mixtral-8x7b up, dH)
    EXPECT_EQ(pair_block_for(kRowsPerPair, 14336, 2, kOverL2, 8 * kMiB), 1);  // 7 MiB a pair (its down)
    EXPECT_EQ(pair_block_for(kRowsPerPair, 28672, 2, kOverL2, 8 * kMiB), 1);  // 14 MiB, over the budget: one pair
    EXPECT_EQ(pair_block_for(kRowsPerPair, 7168, 2, kOverL2, 8 * kMiB), 1);   // 3.5 MiB: 2 fit, under kMinPairBlock
    EXPECT_EQ(pair_block_for(kRowsPerPair, 7168, 1, kOverL2, 8 * kMiB), 4);   // its e4m3 A: 4 fit
    EXPECT_EQ(pair_block_for(kRowsPerPair, 2048, 2, kOverL2, 8 * kMiB), 8);   // 1 MiB a pair: 8, the most
    EXPECT_EQ(pair_block_for(kRowsPerPair, 512, 2, kOverL2, 8 * kMiB), 8);    // capped at kMaxPairBlock
    EXPECT_EQ(pair_block_for(kRowsPerPair, 4096, 1, kOverL2, 8 * kMiB), 8);   // e4m3 A: half the bytes
    EXPECT_EQ(pair_block_for(kRowsPerPair, 4096, 2, kOverL2, 0), 1);          // no budget: the plain order
    EXPECT_EQ(pair_block_for(kRowsPerPair, 0, 2, kOverL2, 8 * kMiB), 1);      // K = 0
    // B_e within the L2 (qwen3-235b-a22b's w13[e], 24 MiB; exactly the L2): the plain order.
    EXPECT_EQ(pair_block_for(kRowsPerPair, 4096, 2, 24 * kMiB, 8 * kMiB), 1);
    EXPECT_EQ(pair_block_for(kRowsPerPair, 4096, 2, sm90::m_grouped::kL2Bytes, 8 * kMiB), 1);
    EXPECT_EQ(pair_block_for(kRowsPerPair, 4096, 2, sm90::m_grouped::kL2Bytes + 1, 8 * kMiB), 4);
}

}  // namespace
}  // namespace megamoe
