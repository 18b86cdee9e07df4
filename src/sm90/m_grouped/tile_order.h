// The M-grouped kernels' tile order: cluster tile t of num_pairs x num_n_tiles -> (pair, n-tile), where a pair is two
// consecutive M tiles of the routing's schedule (one per CTA of the cluster) and an n-tile a kBlockN slice of the
// output columns. The pairs come in blocks of `pair_block` consecutive pairs (the last block may be shorter); inside a
// block, the block's pairs of one n-tile are consecutive tiles, then the next n-tile:
//     t = first_tile(block) + n_tile * block_pairs + (pair - first_pair(block))
// Clusters take t = c, c + num_clusters, ... (m_grouped/scheduler.cuh), so the clusters running side by side hold a
// few n-tiles of every pair of a block: each B tile is read from DRAM once per block and then from L2 by the block's
// other pairs, and the block's A rows stay in L2 across its n-tiles. Where an expert's weights exceed the L2 (mixtral:
// w13[e] is 235 MB, 112 n-tiles of 2 MiB), the plain order (pair_block 1: t = pair * num_n_tiles + n_tile) reads every
// B tile from DRAM once per pair. Any order computes the same bits: a tile's outputs come from one CTA over all of K.
// Host (the launch picks the block; the tests check the order) and device (the scheduler decodes it).
#pragma once

#include <cstdint>

#include "host_device.h"

#ifndef MEGAMOE_M_PAIR_BLOCK_MIB
#define MEGAMOE_M_PAIR_BLOCK_MIB 0
#endif

namespace megamoe::sm90::m_grouped {

// The A rows of a block kept under this many bytes (0: pair_block 1, the plain order). A build option under
// measurement (MEGAMOE_M_PAIR_BLOCK_MIB; docs/log/2026-12-06-m-tile-order.md).
constexpr int64_t kPairBlockABytes = int64_t{MEGAMOE_M_PAIR_BLOCK_MIB} << 20;
constexpr int kMaxPairBlock = 8;
// The smallest block formed: a block of p pairs reads B from DRAM once for p pairs, so 2 saves at most half, and where
// an expert holds fewer pairs than the block (deepseek-v3: ~1.3) it spans experts, putting more B tiles in flight.
// Measured (docs/log/2026-12-06-m-tile-order.md): blocks of 4 gain 8-16 %, deepseek-v3's up at 2 lost 9 %.
constexpr int kMinPairBlock = 4;
// Hopper's L2 (H100 and H200: 50 MiB). An expert's B that fits is read from DRAM once in the plain order already, and
// there a block only spreads the clusters in flight over more A rows; a block is formed only where B_e exceeds it.
constexpr int64_t kL2Bytes = int64_t{50} << 20;
static_assert(kPairBlockABytes >= 0, "a byte budget");
static_assert(1 < kMinPairBlock && kMinPairBlock <= kMaxPairBlock, "a block is at least two pairs");

struct TileCoords {
    int pair_idx;
    int64_t n_tile_idx;
};

// Cluster tile `tile_idx` in [0, num_pairs * num_n_tiles) -> its pair and n-tile (pair_block >= 1).
MEGAMOE_HOST_DEVICE TileCoords tile_coords(int64_t tile_idx, int64_t num_n_tiles, int num_pairs, int pair_block) {
    const int64_t block_tiles = int64_t{pair_block} * num_n_tiles;
    const auto block_idx = static_cast<int>(tile_idx / block_tiles);
    const int64_t tile_in_block = tile_idx - block_idx * block_tiles;
    const int first_pair = block_idx * pair_block;
    const int block_pairs = num_pairs - first_pair < pair_block ? num_pairs - first_pair : pair_block;
    TileCoords coords;
    coords.n_tile_idx = tile_in_block / block_pairs;
    coords.pair_idx = first_pair + static_cast<int>(tile_in_block - coords.n_tile_idx * block_pairs);
    return coords;
}

// The pair block of a launch: 1 where an expert's B (b_bytes) fits the L2, else as many pairs as keep their A rows (a
// pair's rows_per_pair rows of k elements of operand_bytes) within budget_bytes, at most kMaxPairBlock, and 1 where
// fewer than kMinPairBlock fit.
inline int pair_block_for(int64_t rows_per_pair, int64_t k, int operand_bytes, int64_t b_bytes,
                          int64_t budget_bytes = kPairBlockABytes) {
    const int64_t pair_bytes = rows_per_pair * k * operand_bytes;
    if (pair_bytes <= 0 || b_bytes <= kL2Bytes) return 1;
    const int64_t fit = budget_bytes / pair_bytes;
    return fit < kMinPairBlock ? 1 : fit > kMaxPairBlock ? kMaxPairBlock : static_cast<int>(fit);
}

}  // namespace megamoe::sm90::m_grouped
