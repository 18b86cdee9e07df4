// The M-grouped mainloop, as types with the steps of the kit's stage pipeline (kit/pipeline.cuh); kernel.cuh composes
// them:
//   StageLoader    the producer warpgroup's load of each stage: B_e's boxes by TMA (3-D map over [E, rows of B_e, K],
//                  multicast to the CTA pair where both M tiles are one expert's), A by TMA (the sorted rows: the
//                  store epilogue's) or gathered by 16-byte cp.async (rows of x / dy by slot), acquire and commit;
//   WgmmaMainloop  the consumers' 16-bit mainloop: wait for a stage, issue its m64 x kBlockN x k16 wgmmas on the
//                  consumer's 64 rows, release the stage once the next batch is issued (one batch in flight);
//   Fp8Mainloop    (fp8_mainloop.cuh) the consumers' blockwise FP8 mainloop on the same stages.
#pragma once

#include <utility>

#include "device/grouped_gemm_args.h"
#include "sm90/kit/pipeline.cuh"
#include "sm90/kit/ptx.h"
#include "sm90/m_grouped/scheduler.cuh"

namespace megamoe::sm90::m_grouped {

// wgmma's B majorness: K-major for kNK, MN-major for kKN (A is always K-major).
template <BLayout kBLayout>
constexpr gmma::Major kBMajor = kBLayout == BLayout::kNK ? gmma::Major::K : gmma::Major::MN;

// acc[kFirstReg, kFirstReg + kBlockRegs) += A (64 x 16) * B (kBlockN x 16)^T, asynchronously: one row block of
// 16-bit operands (the FP8 ones: m_grouped/fp8_mainloop.cuh's fp8_mma).
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

// The producer warpgroup's step of the mainloop: B by TMA, A by TMA or gathered by cp.async, stage by stage, for every
// tile of this CTA. `b_second_map`: the second B map of kBSource kUpHalf / kKHalves (else unused).
template <class Config, class Epi, BLayout kBLayout, BSource kBSource>
struct StageLoader {
    // How the producer loads A (the policy's kTmaA): the store epilogue's A (down: a, dX: dh) holds the sorted rows
    // themselves, one TMA box of kBlockM rows per stage (thread 0); the others gather rows of x / dy with cp.async by
    // all 128 threads (not one-row TMA boxes, 128 per stage: the TMA unit is slow on small boxes). A stage's full
    // barrier waits for the expect_tx of A and of B, or the copies' arrivals and B's expect_tx.
    static constexpr int kFullArrivals = Epi::kTmaA ? 2 : kWarpgroupThreads + 1;

    template <class Pipeline, class Storage>
    __device__ __forceinline__ static void run(const CUtensorMap* a_map, const CUtensorMap* b_map,
                                               const CUtensorMap* b_second_map, const MainloopParams& params,
                                               const Pipeline& pipeline, Storage& smem, Scheduler scheduler,
                                               int num_k_blocks, uint32_t cta_rank, int thread_idx) {
    constexpr bool kUpHalf = kBSource == BSource::kUpHalf;
    constexpr bool kKHalves = kBSource == BSource::kKHalves;
    static_assert(!kUpHalf || Epi::kGateUpHalves, "a second map for the up half: gate / up halves");
    static_assert(!kKHalves || (Epi::kTmaA && !Epi::kGateUpPairs), "K halves: A by TMA, plain N columns");
    const int num_k_blocks_per_map = kKHalves ? num_k_blocks / 2 : num_k_blocks;
    if (Epi::kTmaA && thread_idx != 0) return;  // thread 0 loads both tiles
    const int chunk_idx = thread_idx % kChunksPerRow;
    const int first_row = thread_idx / kChunksPerRow;
    typename Pipeline::State state;
    for (Tile tile; scheduler.next(tile, thread_idx % kWarpSize);) {
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
            pipeline.producer_acquire(state);
            uint8_t* tile_a = smem.a[state.index];
            uint8_t* tile_b = smem.b[state.index];
            uint64_t* full = pipeline.full_barrier(state);
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
                    cp_async_16(shared_address(tile_a) +
                                       swizzle_128b_offset(first_row + pass * kProducerRowsPerPass, chunk_idx),
                                   valid ? src_rows[pass] + k_begin : params.a, valid);
                }
                cp_async_mbarrier_arrive_noinc(full);  // the stage is published once the copies land
            }
            state.advance();
        }
    }
    cuda::cp_async_commit();
    cuda::cp_async_wait<0>();  // no copy outlives its thread
    }
};


// One row block's wgmmas of a stage: kBlockK / 16 k16 steps of m64 x kBlockN x k16 on the block's A rows.
template <typename T, BLayout kBLayout, class Config, int kNumRegs>
__device__ __forceinline__ void row_block_mma(uint64_t desc_a, uint64_t desc_b, float (&acc)[kNumRegs]) {
#pragma unroll
    for (int k_step = 0; k_step < Config::kBlockK / kWgmmaK; ++k_step) {
        wgmma<T, kBLayout, Config, 0>(desc_a + k_step * kDescK16Step, desc_b + k_step * kBDescK16Step<kBLayout>, acc);
    }
}

// The consumers' 16-bit mainloop of one tile: rows [64 row_block, + 64), kBlockK / 16 k16 steps a stage. A consumer
// whose row block has no rows only keeps the pipeline going (waits, releases).
template <typename T, class Config, class Epi, BLayout kBLayout>
struct WgmmaMainloop {
    static_assert(!Config::kFp8, "16-bit operands");

    template <class Pipeline, class Storage, int kNumRegs>
    __device__ __forceinline__ static void mma_tile(const Pipeline& pipeline, typename Pipeline::State& state,
                                                    Storage& smem, const MainloopParams&, const NoScaleParams&,
                                                    const Tile& tile, int num_k_blocks, int row_block, int,
                                                    int lane_idx, float (&acc)[kNumRegs]) {
        const bool has_rows = row_block * kWgmmaM < tile.num_rows;
#pragma unroll
        for (int reg_idx = 0; reg_idx < kNumRegs; ++reg_idx) acc[reg_idx] = 0.0f;
        int in_flight_stage = -1;
        for (int k_block_idx = 0; k_block_idx < num_k_blocks; ++k_block_idx) {
            pipeline.consumer_wait(state);
            // A written by cp.async (generic proxy) is read by wgmma (async proxy); a stage that TMA filled alone is
            // the async proxy's throughout.
            if constexpr (!Epi::kTmaA) fence_proxy_async_shared();
            const uint8_t* tile_a = smem.a[state.index] + row_block * kRowBlockATileBytes;
            const uint64_t desc_b = make_b_desc<kBLayout>(smem.b[state.index]);
            if (has_rows) {
                fence_accumulators(acc);
                wgmma_fence();
                row_block_mma<T, kBLayout, Config>(make_smem_desc_k_major_sw128(tile_a), desc_b, acc);
                wgmma_commit_group();
            }
            pipeline.retire_previous_batch(acc, state, in_flight_stage, lane_idx);
        }
        pipeline.retire_last_batch(acc, in_flight_stage, lane_idx);
    }
};

}  // namespace megamoe::sm90::m_grouped
