// The fused Hopper (sm_90a) M-grouped GEMM: a persistent, warp-specialized wgmma kernel.
//
// Computes, for the sorted rows r of each expert e (rows [expert_offsets[e], expert_offsets[e + 1])):
//     acc[r, n] = sum_k A[a_row(r), k] * B_e[n, k]
//   a_row(r) = sorted_slot[r] / topk (up projection: rows of x gathered, never copied) or r (down projection).
//   B_e = b + e * b_expert_stride, either [N, K] K-contiguous (BLayout::kNK: w13[e] [2I, H] for up, w2[e] [H, I]
//   for down) or [K, N] N-contiguous (BLayout::kKN: w2[e] read as [K = H, N = I] for the backward's dH,
//   w13[e] read as [K = 2I, N = H] for its dX).
// Epilogues (policy types, m_grouped_epilogue.cuh, m_grouped_dswiglu.cuh): GatedEpilogue (SwiGLUEpilogue by default)
// writes h = [g, u] (+ b13; by sorted row, as saved_h keeps it) and / or a = act(g, u); StoreEpilogueOf writes acc
// (+ b2) in the element type (bf16 / f16), by TMA stores where it can; DSwiGLUEpilogueOf (the backward's dH, acc = p =
// W2[e]^T dy) reads the row's g, u, s and writes dh = [dg, du] (or interleaved), s * a and the tile's partial sum of
// ds = <p, a> (one per row and n-tile, added in n-tile order later: deterministic). The activation is a compile-time
// policy (m_grouped_activation.cuh). f32 accumulation. No atomics: every output element is written once.
//
// Tiles (TileConfig in m_grouped_config.cuh, chosen per epilogue by m_grouped_tile_table.cuh): kBlockM = 128 rows (one
// M tile of the routing's schedule) x kBlockN columns of B_e (cooperative 256, ping-pong 128) x kBlockK = 64 (one
// 128-byte swizzled row of 16-bit elements). For SwiGLU, the kBlockN rows of the B tile are kBlockN / 2 gate rows (TMA
// box 0) followed by the matching up rows I + n0 + [0, kBlockN / 2) (box 1; kKN, w13 stored transposed: the first half
// of the 64-column boxes from gate column n0, the second from I + n0): each thread holds g and u of the same outputs,
// so SwiGLU is register-local; a tile writes kBlockN / 2 columns of a. Interleaved w13: the B tile is kBlockN rows (or
// columns) in storage order, and adjacent accumulator columns are a (g, u) pair, again in one thread.
// Clusters: 2 CTAs run M tiles 2p and 2p + 1 of the schedule with the same n-tile. When both belong to one expert
// (most pairs: experts span many M tiles) they need the same B tile, and each CTA loads one of its two boxes and
// multicasts it to both, which halves B's L2 -> SM traffic. Otherwise each CTA loads both boxes for itself.
// Pairing consecutive 128-row tiles, rather than cutting experts into 256-row tiles, keeps the rows wasted at an
// expert's end below 128 and needs no second M-tile schedule.
//
// Warp roles (3 warpgroups, 384 threads, 1 CTA per SM, as many clusters as fit on the device at once):
//   warpgroup 0, producer (setmaxnreg down to kProducerRegs): thread 0 issues this CTA's B boxes (3-D tensor map
//     over [E, rows of B_e, K], 128-byte swizzle, zero fill out of bounds, multicast when shared). the store epilogue's
//     A (down: a, dX: dh) is the sorted rows themselves: thread 0 loads it too, one 2-D TMA box of kBlockM rows per
//     stage (rows past the expert's end are the next expert's; their results are not stored). For SwiGLU and dSwiGLU
//     (rows of x / dy gathered by slot) all 128 threads gather the A tile with 16-byte cp.async into the same swizzled
//     layout (8 threads per row, 16 rows per pass, 8 passes), zero-filling rows past the expert's end and K past the
//     end (not one-row TMA boxes: the TMA unit is slow on small boxes). Each thread then arms
//     cp.async.mbarrier.arrive.noinc on the stage's full barrier and moves on: the stage is published when all copies
//     have landed (128 such arrivals + thread 0's arrive.expect_tx of the B bytes), with no waiting in the producer.
//     Consumers issue fence.proxy.async after the wait where cp.async filled A (cp.async writes are generic-proxy,
//     wgmma reads through the async proxy; a stage filled by TMA alone needs none). No L2 prefetches (of h for dH's
//     epilogue, or of gathered rows ahead of their stage).
//   warpgroups 1, 2, consumers (setmaxnreg up to kConsumerRegs), cooperative: rows [64 (w - 1), 64 w) of every tile
//     of the CTA; ping-pong: every other tile of the CTA (all 128 rows, two m64 row blocks), the other consumer's
//     stages skipped and the two mainloops in turn (named barriers), so one consumer's epilogue runs under the
//     other's mainloop. m64 x kBlockN x k16 wgmmas (both operands from shared memory, K-major); one wgmma batch
//     stays in flight, and the stage it read is released when the next batch has been issued: one arrive per warp
//     on the empty barrier of both CTAs (the next fill lands in both). A consumer whose first row block has no
//     valid rows skips its wgmmas but keeps the pipeline going (ping-pong's second row block always runs with the
//     first: no branch inside a batch). The epilogue (per row block) transposes accumulator pairs across each
//     quad of lanes and stores 16-byte chunks (64 contiguous bytes per row per warp store). dSwiGLU goes through
//     each warp's 4 KiB of shared memory instead, 16 x 32 sub-tiles: g, u by cp.async (the first sub-tile's issued
//     when the tile starts, with its rows' weights; then one sub-tile ahead), ldmatrix into the accumulator layout,
//     dg, du, s a by stmatrix and out by 16-byte loads and global stores; no quad transposes. The store epilogue:
//     a warp whose 16 rows all lie in the expert stages them 64 columns at a time with stmatrix in one of its two 2 KiB
//     boxes (128-byte swizzle) and lane 0 stores each box by TMA (2-D map over [num_out_rows, n], clipped at n), so the
//     warp is back at its MMAs once its last store is issued; a TMA store cannot stop at the expert's end (the rows
//     after it are the next expert's first tile, another CTA's), so a warp whose rows cross it stores from registers.
// Tile schedule: cluster tiles t = p * num_n_tiles + n_tile over the pairs p of the routing's device-side M-tile
// schedule (m_tile_offsets; its total m_tile_offsets[E] is read on the device, the host only knows a bound);
// cluster c takes t = c, c + num_clusters, ...: the n-tiles of one pair run side by side on neighbouring
// clusters (A read once from DRAM, then from L2), the M tiles of one expert follow each other (B_e stays in L2).
// Every tile has the same K, so the static stride stays balanced whatever the routing (hot or empty experts
// only change the number of m-tiles). Producer and consumers walk the same tile sequence; stage and phase run on
// across tiles, so the producer prefetches the next tile while the consumers run the epilogue.
// kKN (MN-major B): the B tile is kBlockN / 64 TMA boxes of 64 N columns (one 128-byte swizzled row) x kBlockK K
// rows, 8 KiB each, box i holding columns n0 + 64 i; wgmma reads B through an MN-major descriptor (transpose bit
// of the atom), 8-row K atoms 1024 bytes apart, N blocks one box apart; a shared tile is multicast as half the
// boxes from each CTA.
// Shared memory (SharedStorage, dynamic, 1024-byte aligned): kNumStages x (A tile 16 KiB + B tile kBlockN x 128 B),
// for the store and dSwiGLU epilogues the per-warp staging (4 KiB per consumer warp, 32 KiB: two TMA store boxes or
// four sub-tile slots), then the full and empty mbarriers;
// the stage count is the most that fits 227 KiB (cooperative: 4 stages of 48 KiB; ping-pong: 7 of 32 KiB). What was
// measured of these choices (tile shapes, schedules, TMA against cp.async, prefetches): docs/log/.
// Operands (TileConfig's Operands): 16-bit (bf16 / f16, T) as above, or blockwise FP8 (m_grouped_fp8_gemm_sm90.h,
// launched by m_grouped_fp8_gemm_sm90.cu): e4m3 A and B, kNK only, a K block of 128 e4m3 (the same 128-byte swizzled
// row, so tiles, boxes, the gather and the epilogues are unchanged; T is then the output type) is one scale group;
// the mainloop (m_grouped_fp8_mainloop.cuh) applies the scales per group: the rescaled 128 x 256 tile (one set of
// accumulators in the current group's units) or the promoted 128 x 128 tile (a second set per group).
#pragma once

#include "sm90/m_grouped_gemm_sm90.h"

#include <algorithm>
#include <type_traits>
#include <utility>

#include "device/cuda_utils.h"
#include "device/grouped_gemm_args.h"
#include "sm90/epilogue.cuh"
#include "sm90/launch.h"
#include "sm90/m_grouped_config.cuh"
#include "sm90/m_grouped_dswiglu.cuh"
#include "sm90/m_grouped_epilogue.cuh"
#include "sm90/m_grouped_fp8_mainloop.cuh"
#include "sm90/m_grouped_host.cuh"
#include "sm90/m_grouped_tile_table.cuh"
#include "sm90/ptx.h"

namespace megamoe::sm90::m_grouped {

using cuda::ceil_div;

// wgmma's B majorness: K-major for kNK, MN-major for kKN (A is always K-major).
template <BLayout kBLayout>
constexpr gmma::Major kBMajor = kBLayout == BLayout::kNK ? gmma::Major::K : gmma::Major::MN;

// acc[kFirstReg, kFirstReg + kBlockRegs) += A (64 x 16) * B (kBlockN x 16)^T, asynchronously: one row block of
// 16-bit operands (the FP8 ones: m_grouped_fp8_mainloop.cuh's fp8_mma).
template <typename T, BLayout kBLayout, class Config, int kFirstReg, int kNumRegs>
__device__ __forceinline__ void wgmma(uint64_t desc_a, uint64_t desc_b, float (&acc)[kNumRegs]) {
    static_assert(!Config::kFp8, "16-bit operands");
    static_assert(kFirstReg + Config::kBlockRegs <= kNumRegs, "the row block's accumulators are the consumer's");
    wgmma_unpacked<WgmmaOp<T, Config::kBlockN, gmma::Major::K, kBMajor<kBLayout>>, kFirstReg>(
        desc_a, desc_b, acc, std::make_index_sequence<Config::kBlockRegs>{});
}

// Descriptor of the B tile of a stage, and its advance per k16 step.
template <BLayout kBLayout>
__device__ __forceinline__ uint64_t make_b_desc(const uint8_t* tile_b) {
    if constexpr (kBLayout == BLayout::kNK) {
        return make_smem_desc_k_major_sw128(tile_b);
    } else {
        return make_smem_desc_mn_major_sw128<kKNBoxBytes>(tile_b);
    }
}
template <BLayout kBLayout>
constexpr uint64_t kBDescK16Step = kBLayout == BLayout::kNK ? kDescK16Step : kDescMnK16Step;

// How the producer loads A (the policy's kTmaA): the store epilogue's A (down: a, dX: dh) holds the sorted rows
// themselves, one TMA box of kBlockM rows per stage (thread 0); the others gather rows of x / dy with cp.async by all
// 128 threads (not one-row TMA boxes, 128 per stage: the TMA unit is slow on small boxes). A stage's full barrier waits
// for the expect_tx of A and of B, or the copies' arrivals and B's expect_tx.
template <class Epi>
constexpr int kFullArrivals = Epi::kTmaA ? 2 : kWarpgroupThreads + 1;

// The CTA's tile sequence: cluster tiles c, c + num_clusters, ... (c: this CTA's cluster); the producer and both
// consumers walk all of them.
struct CtaTiles {
    int64_t first;
    int64_t stride;
    __device__ __forceinline__ CtaTiles() : first(blockIdx.x / kClusterSize), stride(gridDim.x / kClusterSize) {}
    __device__ __forceinline__ int64_t at(int64_t seq_idx) const { return first + seq_idx * stride; }
};

// Producer warpgroup: B by TMA, A by TMA or gathered by cp.async, stage by stage, for every tile of this CTA.
// `b_second_map`: the second B map of kBSource kUpHalf / kKHalves (else unused).
template <class Config, class Epi, BLayout kBLayout, BSource kBSource, class Storage>
__device__ __forceinline__ void produce(const CUtensorMap* a_map, const CUtensorMap* b_map,
                                        const CUtensorMap* b_second_map, const MainloopParams& params, Storage& smem,
                                        int num_m_tiles, int64_t num_tiles, int num_k_blocks, uint32_t cta_rank,
                                        int thread_idx) {
    constexpr int kNumStages = num_stages<Config, Epi::kStaging>();
    constexpr bool kUpHalf = kBSource == BSource::kUpHalf;
    constexpr bool kKHalves = kBSource == BSource::kKHalves;
    static_assert(!kUpHalf || Epi::kGateUpHalves, "a second map for the up half: gate / up halves");
    static_assert(!kKHalves || (Epi::kTmaA && !Epi::kGateUpPairs), "K halves: A by TMA, plain N columns");
    const int num_k_blocks_per_map = kKHalves ? num_k_blocks / 2 : num_k_blocks;
    if (Epi::kTmaA && thread_idx != 0) return;  // thread 0 loads both tiles
    const int chunk_idx = thread_idx % kChunksPerRow;
    const int first_row = thread_idx / kChunksPerRow;
    const CtaTiles tiles;
    int stage_idx = 0;
    uint32_t phase = 0;
    for (int64_t tile_idx = tiles.first; tile_idx < num_tiles; tile_idx += tiles.stride) {
        const Tile tile = decode_tile(params, tile_idx, num_m_tiles, cta_rank);
        const OperandBitsOf<Config>* src_rows[kProducerPasses];
#pragma unroll
        for (int pass = 0; pass < kProducerPasses; ++pass) {
            const int local_row = first_row + pass * kProducerRowsPerPass;
            src_rows[pass] = nullptr;
            if (!Epi::kTmaA && local_row < tile.num_rows) {
                const int64_t row_idx = tile.row_begin + local_row;
                const int64_t a_row =
                    params.a_gather_slots != nullptr ? params.a_gather_slots[row_idx] / params.topk : row_idx;
                src_rows[pass] = static_cast<const OperandBitsOf<Config>*>(params.a) + a_row * params.lda +
                                 chunk_idx * Config::kOperandChunkElems;
            }
        }
        for (int k_block_idx = 0; k_block_idx < num_k_blocks; ++k_block_idx) {
            mbarrier_wait(&smem.empty[stage_idx], phase ^ 1);
            uint8_t* tile_a = smem.a[stage_idx];
            uint8_t* tile_b = smem.b[stage_idx];
            uint64_t* full = &smem.full[stage_idx];
            const bool second_k_half = kKHalves && k_block_idx >= num_k_blocks_per_map;
            const int32_t k_begin =
                (second_k_half ? k_block_idx - num_k_blocks_per_map : k_block_idx) * Config::kBlockK;
            const CUtensorMap* k_map = second_k_half ? b_second_map : b_map;  // B's map for this K block
            if constexpr (Epi::kTmaA) {  // rows past the expert's end: the next expert's, results not stored
                mbarrier_arrive_expect_tx(full, kATileBytes);
                if constexpr (kKHalves) {
                    tma_load_3d(tile_a, a_map, full, k_begin, second_k_half ? 1 : 0,
                                static_cast<int32_t>(tile.row_begin));
                } else {
                    tma_load_2d(tile_a, a_map, full, k_begin, static_cast<int32_t>(tile.row_begin));
                }
            }
            if (thread_idx == 0 && kBLayout == BLayout::kKN) {
                mbarrier_arrive_expect_tx(full, Config::kBTileBytes);
                // A shared B tile: boxes [cta_rank, cta_rank + 1) x kKNBoxesPerCta, multicast to both CTAs.
#pragma unroll
                for (int box_idx = 0; box_idx < Config::kKNNumBoxes; ++box_idx) {
                    auto b_col = static_cast<int32_t>(tile.n_tile_idx * Config::kBlockN + box_idx * kKNBoxCols);
                    const CUtensorMap* box_map = k_map;
                    if constexpr (Epi::kGateUpHalves) {  // boxes [0, half): gate columns; [half, ..): up, n on
                        constexpr int kHalfBoxes = Config::kKNNumBoxes / 2;
                        static_assert(kHalfBoxes * 2 == Config::kKNNumBoxes, "kKN gate / up halves are whole boxes");
                        const bool up = box_idx >= kHalfBoxes;  // kUpHalf: the up columns from K 0 of the second map
                        b_col =
                            static_cast<int32_t>(tile.n_tile_idx * (Config::kBlockN / 2) +
                                                 (box_idx % kHalfBoxes) * kKNBoxCols + (up && !kUpHalf ? params.n : 0));
                        if (kUpHalf && up) box_map = b_second_map;
                    }
                    uint8_t* box = tile_b + box_idx * kKNBoxBytes;
                    if (!tile.shared_b) {
                        tma_load_3d(box, box_map, full, b_col, k_begin, tile.expert_idx);
                    } else if (box_idx / Config::kKNBoxesPerCta == static_cast<int>(cta_rank)) {
                        tma_load_3d_multicast(box, box_map, full, b_col, k_begin, tile.expert_idx, kClusterMask);
                    }
                }
            } else if (thread_idx == 0) {
                mbarrier_arrive_expect_tx(full, Config::kBTileBytes);
                // A shared B tile: box cta_rank, multicast to both CTAs; else both boxes, for this CTA alone.
#pragma unroll
                for (int box_idx = 0; box_idx < kNumBBoxes; ++box_idx) {
                    const auto b_row = static_cast<int32_t>(b_box_first_row<Config, Epi>(params, tile, box_idx));
                    uint8_t* box = tile_b + box_idx * Config::kBBoxBytes;
                    const CUtensorMap* box_map = kUpHalf && box_idx == 1 ? b_second_map : k_map;
                    if (!tile.shared_b) {
                        tma_load_3d(box, box_map, full, k_begin, b_row, tile.expert_idx);
                    } else if (box_idx == static_cast<int>(cta_rank)) {
                        tma_load_3d_multicast(box, box_map, full, k_begin, b_row, tile.expert_idx, kClusterMask);
                    }
                }
            }
            if constexpr (!Epi::kTmaA) {
                const bool col_valid = k_begin + chunk_idx * Config::kOperandChunkElems < params.k;
#pragma unroll
                for (int pass = 0; pass < kProducerPasses; ++pass) {
                    const bool valid = col_valid && src_rows[pass] != nullptr;
                    cp_async_16_to(shared_address(tile_a) +
                                       swizzle_128b_offset(first_row + pass * kProducerRowsPerPass, chunk_idx),
                                   valid ? src_rows[pass] + k_begin : params.a, valid);
                }
                cp_async_mbarrier_arrive_noinc(full);  // the stage is published once the copies land
            }
            advance_stage<kNumStages>(stage_idx, phase);
        }
    }
    cuda::cp_async_commit();
    cuda::cp_async_wait<0>();  // no copy outlives its thread
}

// One row block's wgmmas of a stage: kBlockK / 16 k16 steps of m64 x kBlockN x k16 on the block's A rows.
template <typename T, BLayout kBLayout, class Config, int kNumRegs>
__device__ __forceinline__ void row_block_mma(uint64_t desc_a, uint64_t desc_b, float (&acc)[kNumRegs]) {
#pragma unroll
    for (int k_step = 0; k_step < Config::kBlockK / kWgmmaK; ++k_step) {
        wgmma<T, kBLayout, Config, 0>(desc_a + k_step * kDescK16Step, desc_b + k_step * kBDescK16Step<kBLayout>, acc);
    }
}

// Consumer warpgroup `consumer_idx`: wgmma over the stages of every tile of the CTA, rows [64 consumer_idx, + 64), then
// the epilogue. FP8 (Config::kFp8): a stage is one K group; m_grouped_fp8_mainloop.cuh's rescaled mainloop runs a
// tile's stages at once (skip_stages where the consumer has no rows).
template <typename T, class Config, class Epi, BLayout kBLayout, class Storage>
__device__ __forceinline__ void consume(const CUtensorMap* out_map, const MainloopParams& params,
                                        const typename Epi::Params& epilogue, const ScaleParamsOf<Config>& scales,
                                        Storage& smem, int num_m_tiles, int64_t num_tiles, int num_k_blocks,
                                        uint32_t cta_rank, int consumer_idx, int thread_idx) {
    constexpr int kNumStages = num_stages<Config, Epi::kStaging>();
    const int lane_idx = thread_idx % kWarpSize;
    const int warp_idx = (thread_idx % kWarpgroupThreads) / kWarpSize;
    uint32_t warp_staging = 0;  // the warp's staging (TMA store boxes, dSwiGLU's sub-tile slots)
    if constexpr (Epi::kStaging) {
        warp_staging = shared_address(smem.staging.boxes) +
                       static_cast<uint32_t>((consumer_idx * kWarpsPerWarpgroup + warp_idx) * kWarpStagingBytes);
    }
    const int row_block = consumer_idx;  // the consumer's 64-row block of a tile
    const CtaTiles tiles;
    int stage_idx = 0;
    uint32_t phase = 0;
    float acc[Config::kNumAccRegs];
    for (int64_t seq_idx = 0; tiles.at(seq_idx) < num_tiles; ++seq_idx) {
        const Tile tile = decode_tile(params, tiles.at(seq_idx), num_m_tiles, cta_rank);
        // A consumer whose row block has no rows only keeps the pipeline going.
        const bool has_rows = row_block * kWgmmaM < tile.num_rows;
        const typename Epi::TileState epilogue_state =  // its loads stay in flight during the mainloop
            Epi::template begin_tile<Config>(params, epilogue, tile, row_block, warp_staging, warp_idx, lane_idx);
#pragma unroll
        for (int reg_idx = 0; reg_idx < Config::kNumAccRegs; ++reg_idx) acc[reg_idx] = 0.0f;
        [[maybe_unused]] int in_flight_stage = -1;
        if constexpr (Config::kFp8) {  // the tile's stages at once (m_grouped_fp8_mainloop.cuh)
            static_assert(kBLayout == BLayout::kNK, "FP8 wgmma reads B K-major");
            if (has_rows) {
                const Fp8TileScales tile_scales =
                    fp8_tile_scales<Config, Epi>(params, scales, tile, row_block, warp_idx, lane_idx);
                fp8_mainloop<Config, Epi, kNumStages>(smem, stage_idx, phase, num_k_blocks, tile_scales, row_block,
                                                      lane_idx, acc);
            } else {
                skip_stages<Config, kNumStages>(smem, stage_idx, phase, num_k_blocks, lane_idx);
            }
        } else {
            for (int k_block_idx = 0; k_block_idx < num_k_blocks; ++k_block_idx) {
                mbarrier_wait(&smem.full[stage_idx], phase);
                // A written by cp.async (generic proxy) is read by wgmma (async proxy); a stage that TMA filled alone
                // is the async proxy's throughout.
                if constexpr (!Epi::kTmaA) fence_proxy_async_shared();
                const uint8_t* tile_a = smem.a[stage_idx] + row_block * kRowBlockATileBytes;
                const uint64_t desc_b = make_b_desc<kBLayout>(smem.b[stage_idx]);
                if (has_rows) {
                    fence_accumulators(acc);
                    wgmma_fence();
                    row_block_mma<T, kBLayout, Config>(make_smem_desc_k_major_sw128(tile_a), desc_b, acc);
                    wgmma_commit_group();
                }
                retire_previous_batch<kClusterSize, kNumStages>(acc, smem.empty, in_flight_stage, stage_idx, phase,
                                                                lane_idx);
            }
            retire_last_batch<kClusterSize>(acc, smem.empty, in_flight_stage, lane_idx);
        }
        Epi::template store<T, Config>(out_map, params, epilogue, tile, acc, epilogue_state, warp_staging, row_block,
                                       warp_idx, lane_idx);
    }
    Epi::finish(lane_idx);
}

// `b_second_map` (after the others, so the kBSource::kOne kernels' parameters keep their offsets): B's second map.
template <typename T, class Epi, BLayout kBLayout, BSource kBSource, class Config>
__global__ void __launch_bounds__(kNumThreads, 1)
    m_grouped_gemm_sm90_kernel(const __grid_constant__ CUtensorMap a_map, const __grid_constant__ CUtensorMap b_map,
                               const __grid_constant__ CUtensorMap out_map,
                               const KernelParams<typename Epi::Params, ScaleParamsOf<Config>> params,
                               const __grid_constant__ CUtensorMap b_second_map) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using Storage = SharedStorage<Config, Epi::kStaging>;
    constexpr int kNumStages = num_stages<Config, Epi::kStaging>();
    extern __shared__ uint8_t smem_raw[];
    const uint32_t misalignment = shared_address(smem_raw) % kSwizzleAtomBytes;
    Storage& smem = *reinterpret_cast<Storage*>(smem_raw + (misalignment == 0 ? 0 : kSwizzleAtomBytes - misalignment));

    const int thread_idx = static_cast<int>(threadIdx.x);
    if (thread_idx == 0) {
        for (int stage_idx = 0; stage_idx < kNumStages; ++stage_idx) {
            mbarrier_init(&smem.full[stage_idx], kFullArrivals<Epi>);
            mbarrier_init(&smem.empty[stage_idx], kClusterSize * Config::kEmptyArrivalsPerCta);
        }
        fence_barrier_init();
        prefetch_tensor_map(&b_map);
        if (kBSource != BSource::kOne) prefetch_tensor_map(&b_second_map);
        if (Epi::kTmaA) prefetch_tensor_map(&a_map);
        Epi::prefetch_maps(params.epilogue, &out_map);
    }
    cluster_sync();  // barriers initialised in both CTAs before any multicast or remote arrive
    const uint32_t cta_rank = cluster_cta_rank();

    const MainloopParams& mainloop = params.mainloop;
    const int num_m_tiles = mainloop.m_tile_offsets[mainloop.num_experts];
    const int64_t num_tiles = ceil_div(num_m_tiles, kClusterSize) * mainloop.num_n_tiles;  // cluster tiles
    const int num_k_maps = kBSource == BSource::kKHalves ? 2 : 1;  // K halves: the K blocks of each map in turn
    const auto num_k_blocks = static_cast<int>(num_k_maps * ceil_div(mainloop.k, Config::kBlockK));
    const int warpgroup_idx = __shfl_sync(0xffffffffu, thread_idx / kWarpgroupThreads, 0);
    if (warpgroup_idx == 0) {
        setmaxnreg_dec<kProducerRegs>();
        produce<Config, Epi, kBLayout, kBSource>(&a_map, &b_map, &b_second_map, mainloop, smem, num_m_tiles, num_tiles,
                                                 num_k_blocks, cta_rank, thread_idx);
    } else {
        setmaxnreg_inc<kConsumerRegs>();
        consume<T, Config, Epi, kBLayout>(&out_map, mainloop, params.epilogue, params.scales, smem, num_m_tiles,
                                          num_tiles, num_k_blocks, cta_rank, warpgroup_idx - 1, thread_idx);
    }
    cluster_sync();  // no CTA leaves while the other may still arrive on its barriers
#endif
}

// ---------------------------------------------------------------------------------------------------
// Host side (the tensor maps of A and B and the mainloop's params: m_grouped_host.cuh): the launch.

template <typename T, class Epi, BLayout kBLayout, BSource kBSource, class Config>
megamoe_status_t launch_typed(const cuda::MGroupedGemmArgs& args,
                              const KernelParams<typename Epi::Params, ScaleParamsOf<Config>>& params,
                              const CUtensorMap& a_map, const CUtensorMap& out_map, int64_t rows_per_expert,
                              int64_t cols_per_row, int num_sms, cudaStream_t stream) {
    CUtensorMap b_map;
    CUtensorMap b_second_map{};
    if (!encode_b_tensor_map<Config>(args, args.b, kBLayout, rows_per_expert, cols_per_row, &b_map) ||
        (kBSource != BSource::kOne &&
         !encode_b_tensor_map<Config>(args, args.b_up, kBLayout, rows_per_expert, cols_per_row, &b_second_map))) {
        return set_error(MEGAMOE_STATUS_CUDA_ERROR, "m_grouped_gemm_sm90: cuTensorMapEncodeTiled failed");
    }
    const int64_t max_tiles = ceil_div(args.max_m_tiles, kClusterSize) * params.mainloop.num_n_tiles;  // cluster tiles
    const int64_t max_clusters = std::min<int64_t>(std::max(num_sms, kClusterSize) / kClusterSize, max_tiles);
    return launch_cluster_kernel<kClusterSize>(m_grouped_gemm_sm90_kernel<T, Epi, kBLayout, kBSource, Config>,
                                               Epi::name(kBLayout), kNumThreads, smem_bytes<Config, Epi::kStaging>(),
                                               max_clusters, stream, a_map, b_map, out_map, params, b_second_map);
}

// `a_map`: A's tensor map where Epi::kTmaA (kBSource::kKHalves: encode_a_halves_map's); `out_map`: the store
// epilogue's output tensor map where its params say tma_store; else unused. kBSource other than kOne: the second B
// map over args.b_up (kUpHalf: B_e has n rows in each tensor; kKHalves: args.k / 2 rows of K in each). `scales`: the
// FP8 operands' (Config::kFp8).
template <class Epi, BLayout kBLayout, BSource kBSource, class Config>
megamoe_status_t launch_on(const cuda::MGroupedGemmArgs& args, const typename Epi::Params& epilogue, int num_sms,
                           cudaStream_t stream, const CUtensorMap& a_map, const CUtensorMap& out_map,
                           const ScaleParamsOf<Config>& scales = {}) {
    static_assert(!Epi::kGateUpHalves || Epi::kGateUpPairs, "gate / up halves are pairs");
    constexpr bool kPairs = Epi::kGateUpPairs;
    constexpr bool kUpHalf = kBSource == BSource::kUpHalf;
    KernelParams<typename Epi::Params, ScaleParamsOf<Config>> params{make_mainloop_params(args), epilogue, scales};
    params.mainloop.num_n_tiles = ceil_div(args.n, kPairs ? Config::kBlockN / 2 : Config::kBlockN);
    params.mainloop.second_box_row_offset = kUpHalf ? 0 : Epi::kGateUpHalves ? args.n : Config::kBBoxRows;
    if (kBSource == BSource::kKHalves) params.mainloop.k = args.k / 2;
    if (args.max_m_tiles == 0 || params.mainloop.num_n_tiles == 0) return MEGAMOE_STATUS_SUCCESS;
    const int64_t b_n = kPairs && !kUpHalf ? 2 * args.n : args.n;  // N extent of B_e (of each tensor)
    const int64_t b_k = params.mainloop.k;                         // K extent of B_e (of each tensor)
    const int64_t rows_per_expert = kBLayout == BLayout::kKN ? b_k : b_n;
    const int64_t cols_per_row = kBLayout == BLayout::kKN ? b_n : b_k;
    return args.dtype == MEGAMOE_DTYPE_BF16
               ? launch_typed<__nv_bfloat16, Epi, kBLayout, kBSource, Config>(
                     args, params, a_map, out_map, rows_per_expert, cols_per_row, num_sms, stream)
               : launch_typed<__half, Epi, kBLayout, kBSource, Config>(args, params, a_map, out_map, rows_per_expert,
                                                                       cols_per_row, num_sms, stream);
}

// The launch on the epilogue's tile configuration (ConfigOf).
template <class Epi, BLayout kBLayout, BSource kBSource = BSource::kOne>
megamoe_status_t launch(const cuda::MGroupedGemmArgs& args, const typename Epi::Params& epilogue, int num_sms,
                        cudaStream_t stream, const CUtensorMap& a_map = CUtensorMap{},
                        const CUtensorMap& out_map = CUtensorMap{}) {
    return launch_on<Epi, kBLayout, kBSource, ConfigOf<Epi>>(args, epilogue, num_sms, stream, a_map, out_map);
}

}  // namespace megamoe::sm90::m_grouped
