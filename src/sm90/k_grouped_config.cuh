// Shared by the fused Hopper K-grouped GEMM (k_grouped_gemm_sm90.cu): the tile and pipeline configuration, the
// kernel's parameters, the tile decode and the cluster's tile sequence (static stride or greedy claims through the
// tile ring). Layouts, warp roles, the tile schedule and the shared-memory plan: k_grouped_gemm_sm90.cu's opening
// block.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "device/int_divisor.h"
#include "sm90/epilogue.cuh"
#include "sm90/hopper.h"
#include "sm90/ptx.h"

namespace megamoe::sm90::k_grouped {

using cuda::IntDivisor;

constexpr int kBlockK = 64;  // reduction rows per stage
constexpr int kChunkBytes = kChunkElems * kElemBytes;
constexpr int kMnBlockElems = kSwizzleBytes / kElemBytes;            // 64 MN elements per 128-byte swizzled row
constexpr int kMnBlockBytes = kMnBlockElems * kBlockK * kElemBytes;  // one MN block (one TMA box) of a stage: 8 KiB
constexpr int kIndexLanes = kBlockK / kWarpsPerWarpgroup;  // rows of a stage per producer warp, one index per lane
// A cluster runs two output tiles of one expert sharing an operand (hopper.h: kClusterSize).
constexpr int64_t kMaxTmaRows = INT32_MAX;            // the row extent of the tensor maps: sorted rows are below 2^31
constexpr int kFullArrivals = kWarpgroupThreads + 1;  // every producer thread's cp.async + thread 0's (expect_tx)
constexpr int kEmptyArrivalsPerCta = kNumConsumers * kWarpgroupThreads / kWarpSize;  // one per consumer warp
constexpr int kTileRing = 8;    // claimed cluster tiles in flight: consumers trail the producer by at most a stage ring
constexpr int kClaimAhead = 2;  // the leader publishes tile s + kClaimAhead when its producer starts tile s - 1
constexpr int kRingArrivals = kClusterSize * kNumThreads / kWarpSize;  // every warp of the cluster reads each slot
constexpr int kOrderThreads = 1024;
constexpr int kMaxOrderedExperts =
    4096;  // order_experts_kernel ranks experts in shared memory (16 KiB); above: E order
constexpr double kSkewedRowsRatio = 1.5;  // busiest expert's rows over the mean above which tiles are claimed greedily

// One operand tile of kCols MN columns x kBlockK reduction rows as the producer warpgroup copies it: thread t copies
// 16-byte chunk t % kThreadsPerRow of rows t / kThreadsPerRow + kRowsPerPass p, or thread 0 loads kNumBoxes TMA
// boxes. A warp copies kWarpRows rows per pass, kIndexLanes rows per stage.
template <int kCols>
struct OperandTile {
    static constexpr int kThreadsPerRow = kCols / kChunkElems;
    static constexpr int kRowsPerPass = kWarpgroupThreads / kThreadsPerRow;
    static constexpr int kPasses = kBlockK / kRowsPerPass;
    static constexpr int kWarpRows = kWarpSize / kThreadsPerRow;
    static constexpr int kNumBoxes = kCols / kMnBlockElems;
    static constexpr int kBoxesPerCta = kNumBoxes / kClusterSize;  // a shared tile: boxes each CTA multicasts
    static constexpr int kBytes = kCols * kBlockK * kElemBytes;
    static_assert(kPasses * kRowsPerPass == kBlockK, "the producer covers the tile");
    static_assert(kWarpRows * kThreadsPerRow == kWarpSize && kWarpRows * kPasses == kIndexLanes,
                  "a warp's rows of a stage are one gather index per lane of half a warp");
    static_assert(kBoxesPerCta * kClusterSize == kNumBoxes && kNumBoxes * kMnBlockBytes == kBytes,
                  "TMA boxes cover the tile and split evenly between the CTAs of a cluster");
};

// The tile table: kBlockM x kBlockN outputs per CTA; each consumer warpgroup computes kBlockM / 2 rows as m64 row
// blocks (wgmma m64 x kBlockN x k16, 128 accumulators per thread); a stage holds A (kBlockM MN columns) and B (kBlockN)
// of kBlockK reduction rows, 48 KiB either way (4 stages). The host picks the entry by which operand is gathered
// (launch_k_grouped_gemm_sm90):
//   NarrowATile  128 x 256: A gathered, or neither (dW2: dy gathered as A, s a by TMA). The gathered side is the
//                narrow one; the 256-wide TMA operand is the one the pair shares.
//   WideATile    256 x 128: B gathered, A by TMA (dW13: dh by TMA, x gathered). The same, mirrored: 128 gathered
//                columns (8 cp.async per producer thread per stage, not 16) and the pair shares the 256-wide A; per CTA
//                and reduction row 256 elements come from L2 instead of 320 with NarrowATile. Its limit: two m64n128
//                wgmmas per k16 step read 20 % more shared memory than one m64n256.
template <int kRows, int kCols>
struct TileShape {
    static constexpr int kBlockM = kRows;
    static constexpr int kBlockN = kCols;
    static constexpr int kConsumerRows = kBlockM / kNumConsumers;
    static constexpr int kRowBlocks = kConsumerRows / kWgmmaM;
    static constexpr int kBlockRegs = kWgmmaM * kBlockN / kWarpgroupThreads;  // accumulators of one row block
    static constexpr int kNumAccRegs = kRowBlocks * kBlockRegs;
    static constexpr int kStoreChunks = kBlockN / kTmaStoreCols;  // TMA store chunks of a warp's row-block rows
    using ATile = OperandTile<kBlockM>;
    using BTile = OperandTile<kBlockN>;
    static_assert(kRowBlocks * kWgmmaM == kConsumerRows, "a consumer's rows are whole m64 row blocks");
    static_assert(kWgmmaM == kMnBlockElems, "a row block's A rows are one 64-element MN block");
    static_assert(kNumAccRegs == 128, "the accumulators leave the epilogue its registers (kConsumerRegs)");
    static_assert(kBlockN % 8 == 0 && kBlockN >= 8 && kBlockN <= 256, "wgmma's n");
};
using NarrowATile = TileShape<128, 256>;
using WideATile = TileShape<256, 128>;

// Element-type epilogue by TMA stores: each consumer warp stages its 16 rows of a row block, 64 columns at a time
// (one 128-byte swizzled row each, as the store's tensor map reads them), in one of its store boxes (epilogue.cuh).
constexpr int kMaxStages = 4;

// The cluster's claimed tiles (tile schedule above); the leader CTA's empty barriers are the ones used.
struct TileRing {
    uint64_t full[kTileRing];   // one arrival (the leader's claim) per use
    uint64_t empty[kTileRing];  // kRingArrivals per use: every warp of both CTAs has read the slot
    int tile_idx[kTileRing];
};

// Shared memory of one CTA (the dynamic allocation, aligned to 1024 bytes by the kernel): kStages pipeline stages, the
// consumer warps' store boxes (kStoreBoxes each), the stages' full and empty barriers, then the tile ring. The stage
// count is what the budget leaves beside the boxes.
template <class Shape, int kStages, int kStoreBoxes>
struct SharedStorageOf {
    static constexpr int kNumStages = kStages;
    static constexpr int kStoreBoxesPerWarp = kStoreBoxes;
    static constexpr int kWarpStagingBytes = kStoreBoxes * kTmaStoreBoxBytes;
    alignas(kSwizzleAtomBytes) uint8_t a[kStages][Shape::ATile::kBytes];
    alignas(kSwizzleAtomBytes) uint8_t b[kStages][Shape::BTile::kBytes];
    alignas(kSwizzleAtomBytes) uint8_t staging[kNumConsumers * kWarpsPerWarpgroup][kWarpStagingBytes];
    uint64_t full[kStages];
    uint64_t empty[kStages];
    TileRing ring;
};

// The most stages (at most kMaxStages, at least 2) whose storage and alignment slack fit in an SM's shared memory.
template <class Shape, int kStages, int kStoreBoxes>
constexpr int fit_stages() {
    if constexpr (kStages <= 2 ||
                  sizeof(SharedStorageOf<Shape, kStages, kStoreBoxes>) + kSwizzleAtomBytes <= kMaxSmemBytes) {
        return kStages;
    } else {
        return fit_stages<Shape, kStages - 1, kStoreBoxes>();
    }
}

template <class Shape, int kStoreBoxes>
using SharedStorage = SharedStorageOf<Shape, fit_stages<Shape, kMaxStages, kStoreBoxes>(), kStoreBoxes>;

template <class Storage>
constexpr int smem_bytes() {
    return static_cast<int>(sizeof(Storage)) + kSwizzleAtomBytes;  // + alignment slack
}

// 2 store boxes per warp: a chunk's store waits for the previous chunk's to have read its box. A tile's worth (4)
// would leave 3 stages (slower: docs/log/).
constexpr int kStoreBoxesPerWarp = kTmaStoreBuffers;
template <class Shape>
constexpr bool storage_fits() {
    static_assert(SharedStorage<Shape, kStoreBoxesPerWarp>::kNumStages == 4, "2 store boxes per warp: 4 stages");
    static_assert(smem_bytes<SharedStorage<Shape, kStoreBoxesPerWarp>>() <= kMaxSmemBytes,
                  "stages and store staging exceed the shared memory of an SM");
    static_assert(Shape::kStoreChunks % kStoreBoxesPerWarp == 0, "a row block's chunks start again at box 0");
    return true;
}
static_assert(storage_fits<NarrowATile>() && storage_fits<WideATile>(), "every tile shape fits");

static_assert(kMnBlockBytes % kSwizzleAtomBytes == 0, "MN blocks start on a swizzle atom");
static_assert(kIndexLanes <= kWarpSize, "a producer warp loads its gather indices in one instruction");
static_assert(kBlockK % kWgmmaK == 0 && kBlockK % 8 == 0, "a stage holds whole k16 steps and 8-row atoms");
static_assert(kClaimAhead >= 1 && kClaimAhead < kTileRing, "the leader publishes ahead into free ring slots");
static_assert(kWgmmaM / kWarpsPerWarpgroup == kTmaStoreRows && kTmaStoreCols * kElemBytes == kSwizzleBytes,
              "a store box is a warp's 16 accumulator rows of a row block x one 128-byte swizzled row");

struct Operand {
    const uint16_t* data;
    int ld;                   // row stride (checked < 2^31 on the host)
    const int* gather_slots;  // NULL: row r; else row gather_slots[r] / topk
    bool tma;                 // not gathered and its tensor map made: whole k-blocks come by TMA
};

struct KernelParams {
    Operand a;
    Operand b;
    IntDivisor topk;  // a gather slot divided by topk: its token row (copy_stage_operand)
    int64_t m;
    int64_t n;
    const int* expert_offsets;
    int num_m_tiles;
    int num_n_tiles;
    bool pair_along_m;  // the CTAs of a cluster take neighbouring m-tiles (same B), else neighbouring n-tiles (same A)
    bool share;         // the operand the pair has in common comes by TMA: each CTA multicasts half of its boxes
    int pairs_m;        // cluster tiles per expert: pairs_m x pairs_n
    int pairs_n;
    IntDivisor tiles_per_expert_divisor;  // pairs_m * pairs_n, and pairs_n, as divisors (decode_tile)
    IntDivisor pairs_n_divisor;
    int num_tiles;      // cluster tiles, E * pairs_m * pairs_n (checked < 2^31 on the host)
    int* tile_counter;  // [2]: tiles claimed past the first num_clusters (zeroed), claim or not (NULL: static)
    const int4* experts_by_rank;  // [E] {expert, row_begin, row_end, 0}, heaviest first (NULL: e-th is e)
    void* out;                    // [E, M, N]
    bool tma_store;               // element-type out with its tensor map made: the epilogue stores by TMA
};

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

}  // namespace megamoe::sm90::k_grouped
