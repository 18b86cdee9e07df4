// The M-grouped tile order behind the kit's tile-scheduler interface (kit/tile_scheduler.h): cluster tiles t over the
// pairs p of M tiles (2p, 2p + 1) of the routing's device-side M-tile schedule (m_tile_offsets; its total is read on
// the device, the host only knows a bound) and the n-tiles n, in blocks of pair_block pairs (m_grouped/tile_order.h:
// pair_block 1 is t = p * num_n_tiles + n); cluster c takes t = c, c + num_clusters, ... (the static stride): the
// tiles that run side by side on neighbouring clusters share A rows or B tiles in L2, the M tiles of one expert follow
// each other. Every tile has the same K, so the stride stays balanced whatever the routing (hot or empty experts only
// change the number of M tiles). Each CTA of the pair runs one of the two M tiles; both decode both, so they agree on
// whether B is shared.
#pragma once

#include <cstdint>

#include "sm90/kit/tile_scheduler.h"
#include "sm90/m_grouped/config.cuh"
#include "sm90/m_grouped/tile_order.h"

namespace megamoe::sm90::m_grouped {

struct Tile {
    int expert_idx;
    int num_rows;  // valid rows of this CTA's M tile (0 past the end of the schedule)
    int64_t row_begin;
    int64_t n_tile_idx;
    bool shared_b;  // both M tiles of the pair exist and belong to one expert: each CTA loads one B box for both
};

// Cluster tile `tile_idx` = (pair of M tiles 2p, 2p + 1 of the routing's schedule, n-tile) as seen by CTA
// `cta_rank`, which runs M tile 2p + cta_rank. Both CTAs decode both M tiles, so they agree on shared_b.
__device__ __forceinline__ Tile decode_tile(const MainloopParams& params, int64_t tile_idx, int num_m_tiles,
                                            int num_pairs, uint32_t cta_rank) {
    const TileCoords coords =
        kPairBlockABytes == 0 || params.pair_block == 1  // the plain order without the block arithmetic
            ? TileCoords{static_cast<int>(tile_idx / params.num_n_tiles), tile_idx % params.num_n_tiles}
            : tile_coords(tile_idx, params.num_n_tiles, num_pairs, params.pair_block);
    const int first_m_tile = coords.pair_idx * kClusterSize;
    const int m_tile_idx = first_m_tile + static_cast<int>(cta_rank);
    const int first_expert = cuda::expert_of_m_tile(params.m_tile_offsets, params.num_experts, first_m_tile);
    const bool pair_complete = first_m_tile + 1 < num_m_tiles;
    const int second_expert =
        pair_complete ? cuda::expert_of_m_tile(params.m_tile_offsets, params.num_experts, first_m_tile + 1) : -1;
    Tile tile;
    tile.n_tile_idx = coords.n_tile_idx;
    tile.shared_b = first_expert == second_expert;
    tile.expert_idx = cta_rank == 0 || !pair_complete ? first_expert : second_expert;
    tile.num_rows = 0;
    tile.row_begin = params.expert_offsets[tile.expert_idx];
    if (m_tile_idx < num_m_tiles) {
        tile.row_begin += static_cast<int64_t>(m_tile_idx - params.m_tile_offsets[tile.expert_idx]) * kBlockM;
        tile.num_rows = static_cast<int>(
            min(static_cast<int64_t>(kBlockM), params.expert_offsets[tile.expert_idx + 1] - tile.row_begin));
    }
    return tile;
}

struct Scheduler {
    using Tile = m_grouped::Tile;
    const MainloopParams& params;
    int num_m_tiles;    // m_tile_offsets[E], read on the device
    int num_pairs;      // pairs of M tiles: ceil(num_m_tiles / kClusterSize)
    int64_t num_tiles;  // cluster tiles: num_pairs * num_n_tiles
    uint32_t cta_rank;
    int64_t next_idx;  // the CTA's next cluster tile
    int64_t stride;    // clusters of the grid

    __device__ __forceinline__ Scheduler(const MainloopParams& params_, int num_m_tiles_, uint32_t cta_rank_)
        : params(params_),
          num_m_tiles(num_m_tiles_),
          num_pairs((num_m_tiles_ + kClusterSize - 1) / kClusterSize),
          num_tiles(num_pairs * params_.num_n_tiles),
          cta_rank(cta_rank_),
          next_idx(blockIdx.x / kClusterSize),
          stride(gridDim.x / kClusterSize) {}

    // The CTA's next tile; false past its last one.
    __device__ __forceinline__ bool next(Tile& tile, int /*lane_idx*/) {
        if (next_idx >= num_tiles) return false;
        tile = decode_tile(params, next_idx, num_m_tiles, num_pairs, cta_rank);
        next_idx += stride;
        return true;
    }
};
static_assert(IsTileScheduler<Scheduler>::value, "the M-grouped order keeps the kit's scheduler interface");

// The first row of B_e in kNK box `box_idx` of the tile's B tile (rows of B_e: the N rows, or the gate / up rows):
// gate / up halves take kBBoxRows gate rows from pair n0 and the matching up rows second_box_row_offset (I) further;
// else the tile's kBlockN rows in order, box 1 kBBoxRows after box 0.
template <class Config, class Epi>
__device__ __forceinline__ int64_t b_box_first_row(const MainloopParams& params, const Tile& tile, int box_idx) {
    const int64_t first_row = tile.n_tile_idx * (Epi::kGateUpHalves ? Config::kBBoxRows : Config::kBlockN);
    return first_row + (box_idx == 0 ? 0 : params.second_box_row_offset);
}

}  // namespace megamoe::sm90::m_grouped
