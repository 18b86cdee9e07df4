// The M-grouped family's configuration (kernel.cuh composes the kernel; its opening block holds the layouts, warp
// roles and shared-memory plan): the tile configurations and the shared-memory plan derived from them, the mainloop's
// parameters and the kernel's argument. The tile each epilogue runs with: tile_table.cuh; the tile order:
// scheduler.cuh.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "device/grouped_gemm_args.h"
#include "sm90/kit/arch.h"
#include "sm90/kit/ptx.h"
#include "sm90/kit/smem.h"
#include "sm90/kit/store.cuh"

namespace megamoe::sm90::m_grouped {

// Shared by every tile configuration.
// A cluster runs two consecutive M tiles of the schedule, one per CTA (kit/arch.h: kClusterSize).
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
// Per consumer warp, the store epilogue's staging: 2 TMA store boxes of 16 rows x 128 bytes (kit/store.cuh), 4 KiB.
// (The dSwiGLU epilogue's sub-tile slots: dswiglu.cuh.) An epilogue policy names its bytes per warp
// (kWarpStagingBytes), and the shared storage holds that for each of the kNumConsumerWarps.
constexpr int kStoreWarpStagingBytes = kTmaStoreBuffers * kTmaStoreBoxBytes;
constexpr int kNumConsumerWarps = kNumConsumers * kWarpsPerWarpgroup;

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
             // m64 x 256 wgmmas and by the last group's scales at the end (m_grouped/fp8_mainloop.cuh)
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
// the store and dSwiGLU epilogues the per-warp staging (kWarpStagingBytes per consumer warp: TMA store boxes, sub-tile
// slots), then the stages' full and empty barriers. The stage count is what the shared-memory budget holds (at most
// kMaxStages): its sizeof plus the alignment slack is the launch's request.
struct NoStaging {};
template <int kWarpStagingBytes>
struct WarpStaging {
    alignas(kSwizzleAtomBytes) uint8_t boxes[kNumConsumerWarps * kWarpStagingBytes];
};

template <int kNumStages, int kStageBBytes, int kWarpStagingBytes>
struct SharedStorageOf {
    alignas(kSwizzleAtomBytes) uint8_t a[kNumStages][kATileBytes];
    alignas(kSwizzleAtomBytes) uint8_t b[kNumStages][kStageBBytes];
    std::conditional_t<(kWarpStagingBytes > 0), WarpStaging<kWarpStagingBytes>, NoStaging> staging;
    uint64_t full[kNumStages];
    uint64_t empty[kNumStages];
};

// kWarpStagingBytes: the epilogue's shared memory per consumer warp (the epilogue policy's; 0: none).
template <class Config, int kWarpStagingBytes>
struct StorageFor {
    template <int kNumStages>
    using Of = SharedStorageOf<kNumStages, Config::kBTileBytes, kWarpStagingBytes>;
};

// The most stages the shared-memory budget holds (kit/smem.h's rule, at most kMaxStages).
template <class Config, int kWarpStagingBytes>
constexpr int num_stages() {
    return fit_stages<StorageFor<Config, kWarpStagingBytes>::template Of, kMaxStages>();
}

template <class Config, int kWarpStagingBytes>
using SharedStorage = SharedStorageOf<num_stages<Config, kWarpStagingBytes>(), Config::kBTileBytes, kWarpStagingBytes>;

template <class Config, int kWarpStagingBytes>
constexpr int smem_bytes() {
    return smem_bytes_of<SharedStorage<Config, kWarpStagingBytes>>();
}

using Cooperative = TileConfig<Operands::k16Bit>;
using Fp8Cooperative = TileConfig<Operands::kFp8>;
static_assert(num_stages<Cooperative, kStoreWarpStagingBytes>() == 4 && num_stages<Cooperative, 0>() == 4,
              "the 128 x 256 tile: 4 stages of 48 KiB (with the store staging: + 32 KiB)");
static_assert(smem_bytes<Cooperative, kStoreWarpStagingBytes>() <= kMaxSmemBytes,
              "stages and the staging boxes of TMA stores exceed the shared memory of an SM");

// What the mainloop and the tile schedule read; each epilogue policy (m_grouped/epilogue.cuh) has its own Params.
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
    int pair_block;  // pairs of M tiles per block of the tile order (m_grouped/tile_order.h)
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

}  // namespace megamoe::sm90::m_grouped
