// The K-grouped family's configuration (gemm.cu composes the kernel; its opening block holds the layouts, warp roles,
// the tile schedule and the shared-memory plan): the tile table and the pipeline sizes, the shared storage and the
// kernel's parameters. The tile order: scheduler.cuh.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "device/int_divisor.h"
#include "sm90/kit/smem.h"
#include "sm90/kit/store.cuh"
#include "sm90/kit/arch.h"
#include "sm90/kit/ptx.h"

namespace megamoe::sm90::k_grouped {

using cuda::IntDivisor;

constexpr int kBlockK = 64;  // reduction rows per stage
constexpr int kChunkBytes = kChunkElems * kElemBytes;
constexpr int kMnBlockElems = kSwizzleBytes / kElemBytes;            // 64 MN elements per 128-byte swizzled row
constexpr int kMnBlockBytes = kMnBlockElems * kBlockK * kElemBytes;  // one MN block (one TMA box) of a stage: 8 KiB
constexpr int kIndexLanes = kBlockK / kWarpsPerWarpgroup;  // rows of a stage per producer warp, one index per lane
// A cluster runs two output tiles of one expert sharing an operand (kit/arch.h: kClusterSize).
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
// (one 128-byte swizzled row each, as the store's tensor map reads them), in one of its store boxes (kit/store.cuh).
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

template <class Shape, int kStoreBoxes>
struct StorageFor {
    template <int kNumStages>
    using Of = SharedStorageOf<Shape, kNumStages, kStoreBoxes>;
};

// The most stages the shared-memory budget holds (kit/smem.h's rule, at most kMaxStages).
template <class Shape, int kStoreBoxes>
using SharedStorage =
    SharedStorageOf<Shape, fit_stages<StorageFor<Shape, kStoreBoxes>::template Of, kMaxStages>(), kStoreBoxes>;

// 2 store boxes per warp: a chunk's store waits for the previous chunk's to have read its box. A tile's worth (4)
// would leave 3 stages (slower: docs/log/).
constexpr int kStoreBoxesPerWarp = kTmaStoreBuffers;
template <class Shape>
constexpr bool storage_fits() {
    static_assert(SharedStorage<Shape, kStoreBoxesPerWarp>::kNumStages == 4, "2 store boxes per warp: 4 stages");
    static_assert(smem_bytes_of<SharedStorage<Shape, kStoreBoxesPerWarp>>() <= kMaxSmemBytes,
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
    bool accumulate;              // f32 out: the tile added to the values there (a tile with no rows left as it is)
};

}  // namespace megamoe::sm90::k_grouped
