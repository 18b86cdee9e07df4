// Shared by the fused Hopper M-grouped GEMM (grouped_gemm_sm90.cu) and its epilogues (m_grouped_epilogue.cuh): the
// tile and pipeline configuration (one table: each choice says which limit it hits), the kernel's parameters and the
// tile schedule (decode_tile). Layouts, warp roles and the shared-memory plan: grouped_gemm_sm90.cu's opening block.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/grouped_gemm.h"
#include "cuda/routing.h"
#include "sm90/epilogue.cuh"
#include "sm90/ptx.h"

namespace megamoe::sm90::m_grouped {

constexpr int kBlockM = 128;     // rows per CTA
constexpr int kBlockN = 256;     // columns of B_e per tile
constexpr int kClusterSize = 2;  // a cluster runs two consecutive M tiles of the schedule, one per CTA
constexpr uint16_t kClusterMask = (1u << kClusterSize) - 1;
constexpr int kNumBBoxes = 2;  // kNK: TMA boxes per B tile (the gate and up halves for SwiGLU)
constexpr int kBlockK = 64;
constexpr int kElemBytes = 2;
constexpr int kWarpSize = 32;
constexpr int kWarpgroupThreads = 128;
constexpr int kWarpsPerWarpgroup = kWarpgroupThreads / kWarpSize;
constexpr int kNumConsumers = 2;  // consumer warpgroups
constexpr int kNumThreads = (1 + kNumConsumers) * kWarpgroupThreads;
constexpr int kConsumerRows = kBlockM / kNumConsumers;  // one wgmma M (64)
constexpr int kWgmmaK = 16;
constexpr int kChunkElems = 8;  // one 16-byte cp.async
constexpr int kChunksPerRow = kBlockK / kChunkElems;
constexpr int kProducerRowsPerPass = kWarpgroupThreads / kChunksPerRow;
constexpr int kProducerPasses = kBlockM / kProducerRowsPerPass;
constexpr int kATileBytes = kBlockM * kBlockK * kElemBytes;
constexpr int kConsumerATileBytes = kConsumerRows * kBlockK * kElemBytes;
// Per CTA of the cluster, one per consumer warp: a stage is refilled (by multicast) in all of them at once.
constexpr int kEmptyArrivalsPerCta = kNumConsumers * kWarpgroupThreads / kWarpSize;
constexpr int kProducerRegs = 56;
constexpr int kConsumerRegs = 224;
constexpr int kRegisterFile = 64 * 1024;
constexpr int kMaxSmemBytes = 227 * 1024;  // per block on sm_90

static_assert(kBlockK * kElemBytes == kSwizzleBytes, "a K block is one 128-byte swizzled row");
static_assert(kBlockM == cuda::kGemmBlockM, "the routing's M tile is one CTA's rows");
static_assert(kNumBBoxes == kClusterSize, "when the pair shares B, each CTA loads one box and multicasts it");
static_assert(kConsumerRows == 64, "each consumer warpgroup owns one m64 wgmma row block");
static_assert(kProducerPasses * kProducerRowsPerPass == kBlockM, "the producer covers the A tile");
static_assert(kConsumerATileBytes % kSwizzleAtomBytes == 0, "consumer A sub-tiles start on a swizzle atom");
static_assert(kProducerRegs * kWarpgroupThreads + kConsumerRegs * kNumConsumers * kWarpgroupThreads <= kRegisterFile,
              "setmaxnreg budgets exceed the register file");

// Pipeline and shared memory: 4 stages of 48 KiB (A 16 KiB + B 32 KiB); kStore adds 32 KiB of staging boxes.
constexpr int kNumStages = 4;
constexpr int kBBoxRows = kBlockN / kNumBBoxes;
constexpr int kBBoxBytes = kBBoxRows * kBlockK * kElemBytes;
constexpr int kBTileBytes = kBlockN * kBlockK * kElemBytes;
constexpr int kNumAccRegs = kConsumerRows * kBlockN / kWarpgroupThreads;
constexpr int kPipelineBytes = kNumStages * (kATileBytes + kBTileBytes);
constexpr int kBarrierBytes = 2 * kNumStages * static_cast<int>(sizeof(uint64_t));
// kStore's epilogue by TMA stores: kStoreChunks chunks of 64 columns per warp and tile, each staged in one of the
// warp's kTmaStoreBuffers boxes of 16 rows x 128 bytes (epilogue.cuh).
constexpr int kStoreChunks = kBlockN / kTmaStoreCols;
constexpr int kWarpStagingBytes = kTmaStoreBuffers * kTmaStoreBoxBytes;
constexpr int kStagingBytes = kNumConsumers * kWarpsPerWarpgroup * kWarpStagingBytes;

static_assert(kBBoxBytes % kSwizzleAtomBytes == 0, "TMA boxes start on a swizzle atom");
static_assert(kPipelineBytes % kSwizzleAtomBytes == 0, "the staging boxes after the stages start on a swizzle atom");
static_assert(kConsumerRows / kWarpsPerWarpgroup == kTmaStoreRows && kTmaStoreCols * kElemBytes == kSwizzleBytes,
              "a store box is a warp's 16 accumulator rows x one 128-byte swizzled row");

// kKN: boxes of 64 N columns (one 128-byte swizzled row) x kBlockK rows of K.
constexpr int kKNBoxCols = kSwizzleBytes / kElemBytes;
constexpr int kKNNumBoxes = kBlockN / kKNBoxCols;
constexpr int kKNBoxBytes = kKNBoxCols * kBlockK * kElemBytes;
constexpr int kKNBoxesPerCta = kKNNumBoxes / kClusterSize;  // a shared B tile: this many boxes multicast per CTA
static_assert(kKNNumBoxes * kKNBoxBytes == kBTileBytes, "kKN boxes cover the B tile");
static_assert(kKNBoxesPerCta * kClusterSize == kKNNumBoxes, "the CTAs of a pair split the kKN boxes evenly");
static_assert(kKNBoxBytes % kSwizzleAtomBytes == 0, "kKN boxes start on a swizzle atom");
static_assert(kBlockK % kWgmmaK == 0 && kBlockK % 8 == 0, "K blocks hold whole k16 steps and 8-row atoms");
static_assert(kNumStages >= 2, "the producer publishes a stage one stage late");

using cuda::BLayout;

enum class Epilogue { kSwiGLU, kStore, kDSwiGLU };

// Dynamic shared memory: the stages, kStore's staging boxes, the barriers, and the slack for 1024-byte alignment.
constexpr int smem_bytes(Epilogue epilogue) {
    return kPipelineBytes + (epilogue == Epilogue::kStore ? kStagingBytes : 0) + kBarrierBytes + kSwizzleAtomBytes;
}
static_assert(smem_bytes(Epilogue::kStore) <= kMaxSmemBytes,
              "stages and kStore's staging boxes exceed the shared memory of an SM");
static_assert(smem_bytes(Epilogue::kSwiGLU) == smem_bytes(Epilogue::kDSwiGLU),
              "only kStore stages its output in shared memory");

struct KernelParams {
    const uint16_t* a;  // A rows, row stride lda
    int64_t lda;
    const int* a_gather_slots;  // NULL: a_row(r) = r; else a_gather_slots[r] / topk
    int64_t topk;
    int64_t n;                      // output columns: I (kSwiGLU, kDSwiGLU) or N (kStore)
    int64_t k;                      // K
    int64_t second_box_row_offset;  // rows from the first to the second B box: I (kSwiGLU) or kBlockN / 2
    const int* expert_offsets;      // [E + 1]
    const int* m_tile_offsets;      // [E + 1]
    int64_t num_experts;
    int64_t num_n_tiles;
    void* out;  // kStore: [rows, n], row stride ldo; kSwiGLU: a [rows, I] or NULL; kDSwiGLU: dh [rows, 2I]
    int64_t ldo;
    void* h;               // kSwiGLU: [g, u] [rows, 2I] out, or NULL; kDSwiGLU: [g, u] in
    bool h_in_slot_order;  // h row of sorted row r: a_gather_slots[r] (the slot, saved_h's order) instead of r
    void* act;             // kDSwiGLU: s * a [rows, I]
    float* ds_parts;       // kDSwiGLU: [rows, num_n_tiles] partial sums of ds
    const void* weights;   // kDSwiGLU: topk_weights [T * topk] (s of row r: weights[a_gather_slots[r]]), NULL: s = 1
    megamoe_dtype_t weights_dtype;
    bool tma_store;  // kStore with the output's tensor map made: a warp's rows inside the expert go out by TMA
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
__device__ __forceinline__ Tile decode_tile(const KernelParams& params, int64_t tile_idx, int num_m_tiles,
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

}  // namespace megamoe::sm90::m_grouped
