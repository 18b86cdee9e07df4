// The K-grouped tile order behind the kit's tile-scheduler interface (kit/tile_scheduler.h): cluster tile t =
// (expert, pair of output tiles), expert-major, so clusters running at the same time read the same expert's rows; a
// tile's work is its expert's rows. Balanced routing: cluster c takes t = c, c + num_clusters, ... (the static stride,
// computed by every thread itself). Skewed routing (order_experts_kernel found the busiest expert above
// kSkewedRowsRatio x the mean): the experts go heaviest first and cluster c starts with t = c, then claims
// t = num_clusters + atomicAdd(tile_counter, 1) through the tile ring (TileSequence), so the clusters end within about
// one light tile of each other.
#pragma once

#include <cstdint>

#include "sm90/k_grouped/config.cuh"
#include "sm90/kit/tile_scheduler.h"

namespace megamoe::sm90::k_grouped {

// Sorted rows are below 2^31 (T * topk < 2^31), and so are M and N (sizes of a weight's dimensions).
struct Tile {
    int expert_idx;
    int m_begin;
    int n_begin;
    int row_begin;  // the expert's sorted rows [row_begin, row_end)
    int row_end;
    int num_k_blocks;
    bool store;  // false: the partner's tile again (odd tile count), computed only to keep the pair in step
};

// CTA `cta_rank`'s output tile of cluster tile `tile_idx`. Both CTAs get the same expert, hence the same k-blocks.
template <class Shape>
__device__ __forceinline__ Tile decode_tile(const KernelParams& params, int tile_idx, int cta_rank) {
    Tile tile;
    const int expert_rank = params.tiles_per_expert_divisor.divide(tile_idx);
    const int within = tile_idx - expert_rank * params.pairs_m * params.pairs_n;
    const int num_paired = params.pair_along_m ? params.num_m_tiles : params.num_n_tiles;
    const int within_quotient = params.pairs_n_divisor.divide(within);
    const int within_rest = within - within_quotient * params.pairs_n;
    const int pair_idx = params.pair_along_m ? within_quotient : within_rest;
    const int other_idx = params.pair_along_m ? within_rest : within_quotient;
    int paired_idx = pair_idx * kClusterSize + cta_rank;
    tile.store = paired_idx < num_paired;
    if (!tile.store) paired_idx = pair_idx * kClusterSize;
    const int m_tile_idx = params.pair_along_m ? paired_idx : other_idx;
    const int n_tile_idx = params.pair_along_m ? other_idx : paired_idx;
    tile.m_begin = m_tile_idx * Shape::kBlockM;
    tile.n_begin = n_tile_idx * Shape::kBlockN;
    if (params.experts_by_rank != nullptr) {  // one load, not a chain: it stays in flight through the current tile
        const int4 entry = params.experts_by_rank[expert_rank];
        tile.expert_idx = entry.x;
        tile.row_begin = entry.y;
        tile.row_end = entry.z;
    } else {
        tile.expert_idx = expert_rank;
        tile.row_begin = params.expert_offsets[expert_rank];
        tile.row_end = params.expert_offsets[expert_rank + 1];
    }
    tile.num_k_blocks = (tile.row_end - tile.row_begin + kBlockK - 1) / kBlockK;
    return tile;
}

// As decode_tile, or a tile with no rows and nothing to store past the last cluster tile (reads nothing).
template <class Shape>
__device__ __forceinline__ Tile decode_tile_if_any(const KernelParams& params, int tile_idx, int cta_rank) {
    if (tile_idx < params.num_tiles) return decode_tile<Shape>(params, tile_idx, cta_rank);
    Tile tile{};
    tile.store = false;
    return tile;
}

// The cluster's tile sequence. Balanced routing (no counter, or order_experts_kernel chose the static stride): every
// thread computes the static stride itself (cluster c takes c, c + num_clusters, ...), no ring. Skewed routing: tiles
// go through the tile ring above; every thread of every warp of both CTAs calls next() for each tile in the same
// order, whole warps at a time. The leader CTA's producer thread 0 (claims) keeps the ring kClaimAhead tiles ahead of
// its own reads, and its atomicAdd for a tile is issued one call before the tile is written into the ring: neither
// the atomic's round trip nor the remote write is waited for when a tile starts.
struct TileSequence {
    TileRing* ring;
    int* tile_counter;  // claims greedily from it, else NULL: the static stride, computed by every thread
    int cluster_idx;
    int num_clusters;
    bool claims;
    int seq_idx;
    int pending;  // claims: the tile for sequence number seq_idx + kClaimAhead (atomicAdd in flight)

    __device__ __forceinline__ TileSequence(TileRing* ring_, int* tile_counter_, bool claims_)
        : ring(ring_), tile_counter(nullptr), claims(false), seq_idx(0), pending(0) {
        cluster_idx = static_cast<int>(blockIdx.x) / kClusterSize;
        num_clusters = static_cast<int>(gridDim.x) / kClusterSize;
        // Read once, by every thread (the same value in both CTAs: order_experts_kernel wrote it before the launch).
        if (tile_counter_ != nullptr && tile_counter_[1] != 0) {
            tile_counter = tile_counter_;
            claims = claims_;
        }
    }

    // The claimed cluster tile of sequence number `seq`: the cluster's own index first, then the counter's.
    __device__ __forceinline__ int claim(int seq) const {
        if (seq == 0) return cluster_idx;
        return num_clusters + atomicAdd(tile_counter, 1);
    }

    // Into slot seq % kTileRing of every CTA's ring (the leader's own too) once every warp has read its previous use:
    // an arrival expecting 4 bytes, and the asynchronous store that completes them.
    __device__ __forceinline__ void publish(int seq, int tile_idx) const {
        const int slot = seq % kTileRing;
        if (seq >= kTileRing) mbarrier_wait(&ring->empty[slot], (seq / kTileRing - 1) & 1);
#pragma unroll
        for (uint32_t cta_rank = 0; cta_rank < kClusterSize; ++cta_rank) {
            mbarrier_arrive_expect_tx_cluster(&ring->full[slot], cta_rank, sizeof(int));
            st_async_u32(&ring->tile_idx[slot], cta_rank, static_cast<uint32_t>(tile_idx), &ring->full[slot]);
        }
    }

    // The next cluster tile (num_tiles or more: none left).
    __device__ __forceinline__ int next(int lane_idx) {
        if (tile_counter == nullptr) return cluster_idx + (seq_idx++) * num_clusters;  // static stride
        if (claims) {
            if (seq_idx == 0) {
                for (int seq = 0; seq < kClaimAhead; ++seq) publish(seq, claim(seq));
                pending = claim(kClaimAhead);
            }
            publish(seq_idx + kClaimAhead, pending);
            pending = claim(seq_idx + kClaimAhead + 1);
        }
        const int slot = seq_idx % kTileRing;
        mbarrier_wait(&ring->full[slot], (seq_idx / kTileRing) & 1);
        const int tile_idx = *static_cast<volatile int*>(&ring->tile_idx[slot]);
        __syncwarp();
        if (lane_idx == 0) mbarrier_arrive_cluster(&ring->empty[slot], 0);
        ++seq_idx;
        return tile_idx;
    }
};

// The kit's interface over TileSequence: next() decodes the tile for this CTA, or gives an empty one (no rows, nothing
// stored, nothing read) and false past the last.
template <class Shape>
struct Scheduler {
    using Tile = k_grouped::Tile;
    const KernelParams& params;
    TileSequence tiles;
    int cta_rank;

    __device__ __forceinline__ Scheduler(const KernelParams& params_, TileRing* ring, bool claims, int cta_rank_)
        : params(params_), tiles(ring, params_.tile_counter, claims), cta_rank(cta_rank_) {}

    __device__ __forceinline__ bool next(Tile& tile, int lane_idx) {
        const int tile_idx = tiles.next(lane_idx);
        tile = decode_tile_if_any<Shape>(params, tile_idx, cta_rank);
        return tile_idx < params.num_tiles;
    }
};
static_assert(IsTileScheduler<Scheduler<NarrowATile>>::value, "the K-grouped order keeps the kit's scheduler interface");

}  // namespace megamoe::sm90::k_grouped
