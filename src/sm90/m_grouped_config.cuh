// Shared by the fused Hopper M-grouped GEMM (m_grouped_gemm_sm90.cu) and its epilogues (m_grouped_epilogue.cuh): the
// tile configurations and the shared-memory plan derived from them, the mainloop's parameters and the tile schedule
// (decode_tile). The table choosing a configuration per epilogue is with the epilogue policies. Layouts, warp roles and
// the shared-memory plan: m_grouped_gemm_sm90.cu's opening block.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "device/grouped_gemm_args.h"
#include "sm90/epilogue.cuh"
#include "sm90/hopper.h"
#include "sm90/ptx.h"

namespace megamoe::sm90::m_grouped {

// Shared by every tile configuration.
// A cluster runs two consecutive M tiles of the schedule, one per CTA (hopper.h: kClusterSize).
constexpr int kBlockM = 128;   // rows per CTA tile: one M tile of the routing's schedule
constexpr int kNumBBoxes = 2;  // kNK: TMA boxes per B tile (the gate and up halves for SwiGLU)
constexpr int kBlockK = 64;
constexpr int kChunksPerRow = kBlockK / kChunkElems;
constexpr int kProducerRowsPerPass = kWarpgroupThreads / kChunksPerRow;
constexpr int kProducerPasses = kBlockM / kProducerRowsPerPass;
constexpr int kATileBytes = kBlockM * kBlockK * kElemBytes;
constexpr int kRowBlockATileBytes = kWgmmaM * kBlockK * kElemBytes;  // the A rows of one row block
constexpr int kMaxStages = 8;
constexpr int kFp8ScaleGroup = 128;  // K elements per scale of the blockwise FP8 recipe (activations 1 x 128, weights
                                     // 128 x 128 blocks)
// kKN: boxes of 64 N columns (one 128-byte swizzled row) x kBlockK rows of K.
constexpr int kKNBoxCols = kSwizzleBytes / kElemBytes;
constexpr int kKNBoxBytes = kKNBoxCols * kBlockK * kElemBytes;
// Per consumer warp, 4 KiB of staging: the store epilogue's 2 TMA store boxes of 16 rows x 128 bytes (epilogue.cuh),
// or the dSwiGLU epilogue's 4 sub-tile slots of 16 rows x 64 bytes (m_grouped_dswiglu.cuh).
constexpr int kWarpStagingBytes = kTmaStoreBuffers * kTmaStoreBoxBytes;
constexpr int kStagingBytes = kNumConsumers * kWarpsPerWarpgroup * kWarpStagingBytes;

static_assert(kBlockK * kElemBytes == kSwizzleBytes, "a K block is one 128-byte swizzled row");
static_assert(kBlockM == cuda::kGemmBlockM, "the routing's M tile is one CTA's rows");
static_assert(kNumBBoxes == kClusterSize, "when the pair shares B, each CTA loads one box and multicasts it");
static_assert(kProducerPasses * kProducerRowsPerPass == kBlockM, "the producer covers the A tile");
static_assert(kRowBlockATileBytes % kSwizzleAtomBytes == 0, "row-block A sub-tiles start on a swizzle atom");
static_assert(kKNBoxBytes % kSwizzleAtomBytes == 0, "kKN boxes start on a swizzle atom");
static_assert(kBlockK % kWgmmaK == 0 && kBlockK % 8 == 0, "K blocks hold whole k16 steps and 8-row atoms");
static_assert(kWgmmaM / kWarpsPerWarpgroup == kTmaStoreRows && kTmaStoreCols * kElemBytes == kSwizzleBytes,
              "a store box is a warp's 16 accumulator rows of a row block x one 128-byte swizzled row");

using cuda::BLayout;

// Where a B tile's boxes come from: one tensor map over B_e, or two (the separate layout: w1 and w3, same shape).
enum class BSource {
    kOne,      // one map
    kUpHalf,   // gate / up halves: the gate box(es) from the first map, the up box(es) from the second at the same rows
               // (kNK) or columns (kKN): the separate layout's up GEMM
    kKHalves,  // K = 2 k: K blocks [0, ceil(k / kBlockK)) from the first map, as many again from the second, each from
               // K 0 of its map; A (by TMA) a 3-D map [rows, 2, k] over its halves: the separate layout's dX GEMM
};

// What the wgmmas multiply.
enum class Operands {
    k16Bit,  // bf16 / f16 A and B (the output's type): one set of accumulators, one wgmma batch in flight
    kFp8,    // e4m3 A and B with f32 scales per 128 K (m_grouped_fp8_gemm_sm90.h): one set of accumulators kept in
             // units of the current K group's scales, multiplied by (previous scales / its scales) before a group's
             // m64 x 256 wgmmas and by the last group's scales at the end (m_grouped_fp8_mainloop.cuh)
};

// The tile configuration of an operand type: 128 x 256 outputs, the two consumer warpgroups on 64 rows each (one m64
// row block), in step (cooperative). Every size the kernel, its epilogues and the host derive comes from it. A K block
// is one 128-byte swizzled row of either operand type (64 16-bit or 128 e4m3 elements): the shared-memory geometry
// (A and B tiles, swizzle, cp.async chunks per row) is the same for both.
template <Operands kOperands = Operands::k16Bit>
struct TileConfig {
    static constexpr bool kFp8 = kOperands == Operands::kFp8;
    static constexpr int kOperandBytes = kFp8 ? 1 : kElemBytes;
    static constexpr int kBlockK = kSwizzleBytes / kOperandBytes;         // K elements per stage (FP8: one scale group)
    static constexpr int kOperandChunkElems = 16 / kOperandBytes;         // elements of one 16-byte cp.async
    static constexpr int kMmaK = kFp8 ? 32 : kWgmmaK;                     // K of one wgmma
    static constexpr uint64_t kDescKStep = (kMmaK * kOperandBytes) >> 4;  // K-major descriptor units per wgmma
    static constexpr int kBlockN = 256;                                   // columns of B_e per tile
    static constexpr int kConsumerRows = kBlockM / kNumConsumers;         // rows a consumer computes: one row block
    static constexpr int kBlockRegs = kWgmmaM * kBlockN / kWarpgroupThreads;  // accumulators of the row block
    static constexpr int kNumAccRegs = kBlockRegs;
    static constexpr int kBBoxRows = kBlockN / kNumBBoxes;
    static constexpr int kBBoxBytes = kBBoxRows * kSwizzleBytes;
    static constexpr int kBTileBytes = kBlockN * kSwizzleBytes;
    static constexpr int kStageBytes = kATileBytes + kBTileBytes;
    static constexpr int kKNNumBoxes = kBlockN / kKNBoxCols;
    static constexpr int kKNBoxesPerCta = kKNNumBoxes / kClusterSize;  // a shared kKN tile: boxes multicast per CTA
    static constexpr int kStoreChunks = kBlockN / kTmaStoreCols;       // store epilogue: TMA boxes per warp row slice
    // Per CTA of the cluster, one per warp that reads a stage: a stage is refilled (by multicast) in all at once.
    static constexpr int kEmptyArrivalsPerCta = kNumConsumers * kWarpsPerWarpgroup;

    static_assert(kBlockK * kOperandBytes == kSwizzleBytes && kBlockK % kMmaK == 0,
                  "a K block is one 128-byte swizzled row of whole wgmma K steps");
    static_assert(!kFp8 || kBlockK == kFp8ScaleGroup, "an FP8 stage is one scale group along K");
    static_assert(kConsumerRows == kWgmmaM, "a consumer's rows are one m64 row block");
    static_assert(kNumAccRegs <= 128, "the accumulators of one consumer thread fit beside the epilogue's registers");
    static_assert(kBBoxBytes % kSwizzleAtomBytes == 0, "TMA boxes start on a swizzle atom");
    static_assert(kKNNumBoxes * kKNBoxBytes == kBTileBytes, "kKN boxes cover the B tile");
    static_assert(kKNBoxesPerCta * kClusterSize == kKNNumBoxes, "the CTAs of a pair split the kKN boxes evenly");
    static_assert(kBlockN % (2 * kTmaStoreCols) == 0, "SwiGLU halves and store chunks are whole 64-column boxes");
};

// Shared memory of one CTA (the dynamic allocation, aligned to 1024 bytes by the kernel): the pipeline's stages, for
// the store and dSwiGLU epilogues the per-warp staging (TMA store boxes, sub-tile slots), then the stages' full and
// empty barriers. The stage count is what the shared-memory budget holds (at most kMaxStages): its sizeof plus the
// alignment slack is the launch's request.
struct NoStaging {};
struct StoreStaging {
    alignas(kSwizzleAtomBytes) uint8_t boxes[kStagingBytes];
};

template <int kNumStages, int kStageBBytes, bool kStaging>
struct SharedStorageOf {
    alignas(kSwizzleAtomBytes) uint8_t a[kNumStages][kATileBytes];
    alignas(kSwizzleAtomBytes) uint8_t b[kNumStages][kStageBBytes];
    std::conditional_t<kStaging, StoreStaging, NoStaging> staging;
    uint64_t full[kNumStages];
    uint64_t empty[kNumStages];
};

// The most stages (at most kMaxStages, at least 2) whose storage and alignment slack fit in an SM's shared memory.
template <int kStages, int kStageBBytes, bool kStaging>
constexpr int fit_stages() {
    if constexpr (kStages <= 2 ||
                  sizeof(SharedStorageOf<kStages, kStageBBytes, kStaging>) + kSwizzleAtomBytes <= kMaxSmemBytes) {
        return kStages;
    } else {
        return fit_stages<kStages - 1, kStageBBytes, kStaging>();
    }
}

// kStaging: the epilogue has per-warp staging in shared memory (the epilogue policy's kStaging).
template <class Config, bool kStaging>
constexpr int num_stages() {
    return fit_stages<kMaxStages, Config::kBTileBytes, kStaging>();
}

template <class Config, bool kStaging>
using SharedStorage = SharedStorageOf<num_stages<Config, kStaging>(), Config::kBTileBytes, kStaging>;

template <class Config, bool kStaging>
constexpr int smem_bytes() {
    return static_cast<int>(sizeof(SharedStorage<Config, kStaging>)) + kSwizzleAtomBytes;  // + alignment slack
}

using Cooperative = TileConfig<Operands::k16Bit>;
using Fp8Cooperative = TileConfig<Operands::kFp8>;
static_assert(num_stages<Cooperative, true>() == 4 && num_stages<Cooperative, false>() == 4,
              "the 128 x 256 tile: 4 stages of 48 KiB (with staging: + 32 KiB)");
static_assert(smem_bytes<Cooperative, true>() <= kMaxSmemBytes,
              "stages and the staging boxes of TMA stores exceed the shared memory of an SM");

// What the mainloop and the tile schedule read; each epilogue policy (m_grouped_epilogue.cuh) has its own Params.
struct MainloopParams {
    const void* a;  // A rows (the operand type of the configuration: OperandBitsOf), row stride lda elements
    int64_t lda;
    const int* a_gather_slots;  // NULL: a_row(r) = r; else a_gather_slots[r] / topk
    int64_t topk;
    int64_t n;                      // output columns: I (SwiGLU, dSwiGLU) or N (store)
    int64_t k;                      // K (BSource::kKHalves: of one half)
    int64_t second_box_row_offset;  // rows from the first to the second B box: I (gate / up pairs) or kBBoxRows
    const int* expert_offsets;      // [E + 1]
    const int* m_tile_offsets;      // [E + 1]
    int64_t num_experts;
    int64_t num_n_tiles;
};

// The FP8 operands' scales (Operands::kFp8; m_grouped_fp8_gemm_sm90.h's Fp8BlockScales), after the other
// params so that the 16-bit kernels' parameter offsets do not depend on them.
struct NoScaleParams {};
struct Fp8ScaleParams {
    const float* a;  // [A rows, num_k_groups], row stride a_ld: a_scales[a_row(r), g]
    int64_t a_ld;
    // B_e's block (i, g) at b[e * b_block_rows * num_k_groups + i * b_block_stride + g * b_group_stride]:
    // [E, b_block_rows, num_k_groups], or its transpose per expert
    const float* b;
    int64_t b_block_rows;    // ceil(rows of B_e / 128)
    int64_t num_k_groups;    // ceil(K / 128)
    int64_t b_block_stride;  // num_k_groups, or 1 (transposed)
    int64_t b_group_stride;  // 1, or b_block_rows (transposed)
};

// The bits of one operand element of a configuration (A is read as such words by the gathering producer).
template <class Config>
using OperandBitsOf = std::conditional_t<Config::kFp8, uint8_t, uint16_t>;

template <class Config>
using ScaleParamsOf = std::conditional_t<Config::kFp8, Fp8ScaleParams, NoScaleParams>;

// The kernel's argument: the mainloop's params, the epilogue policy's and (FP8) the scales.
template <class EpilogueParams, class ScaleParams = NoScaleParams>
struct KernelParams {
    MainloopParams mainloop;
    EpilogueParams epilogue;
    ScaleParams scales;
};

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
                                            uint32_t cta_rank) {
    const auto first_m_tile = static_cast<int>(tile_idx / params.num_n_tiles) * kClusterSize;
    const int m_tile_idx = first_m_tile + static_cast<int>(cta_rank);
    const int first_expert = cuda::expert_of_m_tile(params.m_tile_offsets, params.num_experts, first_m_tile);
    const bool pair_complete = first_m_tile + 1 < num_m_tiles;
    const int second_expert =
        pair_complete ? cuda::expert_of_m_tile(params.m_tile_offsets, params.num_experts, first_m_tile + 1) : -1;
    Tile tile;
    tile.n_tile_idx = tile_idx % params.num_n_tiles;
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

// The first row of B_e in kNK box `box_idx` of the tile's B tile (rows of B_e: the N rows, or the gate / up rows):
// gate / up halves take kBBoxRows gate rows from pair n0 and the matching up rows second_box_row_offset (I) further;
// else the tile's kBlockN rows in order, box 1 kBBoxRows after box 0.
template <class Config, class Epi>
__device__ __forceinline__ int64_t b_box_first_row(const MainloopParams& params, const Tile& tile, int box_idx) {
    const int64_t first_row = tile.n_tile_idx * (Epi::kGateUpHalves ? Config::kBBoxRows : Config::kBlockN);
    return first_row + (box_idx == 0 ? 0 : params.second_box_row_offset);
}

}  // namespace megamoe::sm90::m_grouped
