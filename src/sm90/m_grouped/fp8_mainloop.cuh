// The blockwise FP8 consumer mainloop of the M-grouped kernel (Operands::kFp8 of config.cuh; kernel.cuh composes it):
// which scales a consumer thread applies and the rescaled mainloop of a tile. A thread's
// accumulators of a row block are 2 rows (lane / 4 and + 8 of its warp's 16) x the tile's columns, fragment f (8
// columns) from B box f / (kBBoxRows / 8); each K group's partial sums are scaled by sa[row, g] * sb[block of the box,
// g] (m_grouped_fp8_gemm_sm90.h).
#pragma once

#include <cstdint>

#include "sm90/kit/fragment.cuh"
#include "sm90/kit/arch.h"
#include "sm90/kit/pipeline.cuh"
#include "sm90/kit/ptx.h"
#include "sm90/m_grouped/scheduler.cuh"

namespace megamoe::sm90::m_grouped {

constexpr int kThreadRows = 2;  // accumulator rows of one thread in a row block

// Where one consumer thread reads its scales for a tile: the scale rows of its two accumulator rows (rows past the
// tile's end, whose results are not stored, read the tile's first row, masked to 0: the loads take no branch) and of
// the 128 x 128 blocks of B_e holding the tile's B boxes.
struct Fp8TileScales {
    const float* a_rows[kThreadRows];
    float a_row_masks[kThreadRows];  // 1, or 0 for a row past the tile's end
    const float* b_boxes[kNumBBoxes];
    int64_t b_group_stride;  // from one K group's scale of a B block to the next's
};

// For a tile with rows; each B box (b_box_first_row, the producer's coordinates) lies inside one 128-row scale block
// (m_grouped_fp8_gemm_sm90_supported checks the shapes that guarantee it).
template <class Config, class Epi>
__device__ __forceinline__ Fp8TileScales fp8_tile_scales(const MainloopParams& params, const Fp8ScaleParams& scales,
                                                         const Tile& tile, int row_block, int warp_idx, int lane_idx) {
    Fp8TileScales tile_scales;
#pragma unroll
    for (int half = 0; half < kThreadRows; ++half) {
        const int local_row =
            row_block * kWgmmaM + warp_idx * AccFragment::kWarpRows + AccFragment::row_in_warp(lane_idx) + half * AccFragment::kHalfRows;
        const bool valid = local_row < tile.num_rows;
        const int64_t row_idx = tile.row_begin + (valid ? local_row : 0);
        // A read by TMA holds the sorted rows themselves (and so do its scales), whatever the gather slots still give.
        const int64_t a_row =
            !Epi::kTmaA && params.a_gather_slots != nullptr ? params.a_gather_slots[row_idx] / params.topk : row_idx;
        tile_scales.a_rows[half] = scales.a + a_row * scales.a_ld;
        tile_scales.a_row_masks[half] = valid ? 1.0f : 0.0f;
    }
#pragma unroll
    for (int box_idx = 0; box_idx < kNumBBoxes; ++box_idx) {
        // A box past N_b (N's tail tile: its columns are not stored, TMA zero-fills its rows) takes the last block's
        // scales: a real number in bounds, so its zero products stay zero (and out of the ds sums).
        const int64_t block_row = min(b_box_first_row<Config, Epi>(params, tile, box_idx) / kFp8ScaleGroup,
                                      static_cast<int64_t>(scales.b_block_rows) - 1);
        tile_scales.b_boxes[box_idx] =
            scales.b + tile.expert_idx * scales.b_block_rows * scales.num_k_groups + block_row * scales.b_block_stride;
    }
    tile_scales.b_group_stride = scales.b_group_stride;
    return tile_scales;
}

// One K group's scales as loaded for the thread: its two rows' (unmasked) and the tile's boxes'.
struct GroupScaleLoads {
    float a[kThreadRows];
    float b[kNumBBoxes];
};

// Issues the loads of K group `group_idx`'s scales (the tile has rows: its first row's scales exist).
__device__ __forceinline__ void issue_group_scale_loads(const Fp8TileScales& tile_scales, int group_idx,
                                                        GroupScaleLoads& loads) {
#pragma unroll
    for (int half = 0; half < kThreadRows; ++half) loads.a[half] = __ldg(tile_scales.a_rows[half] + group_idx);
#pragma unroll
    for (int box_idx = 0; box_idx < kNumBBoxes; ++box_idx) {
        loads.b[box_idx] = __ldg(tile_scales.b_boxes[box_idx] + group_idx * tile_scales.b_group_stride);
    }
}

// The products sa * sb of loaded scales for the thread's rows and the tile's boxes (rows past the tile: 0). The first
// use of the loads: where this runs is where the thread waits for them.
__device__ __forceinline__ void group_scale_products(const Fp8TileScales& tile_scales, const GroupScaleLoads& loads,
                                                     float (&group_scales)[kThreadRows][kNumBBoxes]) {
#pragma unroll
    for (int half = 0; half < kThreadRows; ++half) {
        const float row_scale = loads.a[half] * tile_scales.a_row_masks[half];
#pragma unroll
        for (int box_idx = 0; box_idx < kNumBBoxes; ++box_idx)
            group_scales[half][box_idx] = row_scale * loads.b[box_idx];
    }
}

// The products sa * sb of K group `group_idx` for the thread's rows and the tile's boxes, loaded now (the thread waits
// for the loads here).
__device__ __forceinline__ void load_group_scales(const Fp8TileScales& tile_scales, int group_idx,
                                                  float (&group_scales)[kThreadRows][kNumBBoxes]) {
    GroupScaleLoads loads;
    issue_group_scale_loads(tile_scales, group_idx, loads);
    group_scale_products(tile_scales, loads, group_scales);
}

__device__ __forceinline__ void copy_scales(const float (&from)[kThreadRows][kNumBBoxes],
                                            float (&to)[kThreadRows][kNumBBoxes]) {
#pragma unroll
    for (int half = 0; half < kThreadRows; ++half) {
#pragma unroll
        for (int box_idx = 0; box_idx < kNumBBoxes; ++box_idx) to[half][box_idx] = from[half][box_idx];
    }
}

// previous / current, element by element: the factor that takes accumulators from the previous group's units to the
// current one's. The fast division (2 ulp; no slow-path call, which would make ptxas serialize the wgmmas around it,
// C7514); products of scales beyond 2^126 give 0 (m_grouped_fp8_gemm_sm90.h: the rescaled variant's range).
__device__ __forceinline__ void unit_change(const float (&previous)[kThreadRows][kNumBBoxes],
                                            const float (&current)[kThreadRows][kNumBBoxes],
                                            float (&factors)[kThreadRows][kNumBBoxes]) {
#pragma unroll
    for (int half = 0; half < kThreadRows; ++half) {
#pragma unroll
        for (int box_idx = 0; box_idx < kNumBBoxes; ++box_idx) {
            factors[half][box_idx] = __fdividef(previous[half][box_idx], current[half][box_idx]);
        }
    }
}

// The rescaled mainloops' scales: sa * sb of the group last issued (`current`) and of the next, and the loads of the
// one after, issued two groups ahead (L2's latency) and multiplied a group later, so the thread waits for them a whole
// K group's wgmmas after issuing them, not at once; unconditionally (the last group's again at the end: a load in a
// branch would put the rescaling, and a warpgroup arrive, on a divergent path: ptxas serializes the wgmmas, C7520).
struct GroupScalePipeline {
    float current[kThreadRows][kNumBBoxes];
    float next[kThreadRows][kNumBBoxes];
    GroupScaleLoads later;

    __device__ __forceinline__ void start(const Fp8TileScales& tile_scales, int num_k_blocks) {
        load_group_scales(tile_scales, 0, current);
        load_group_scales(tile_scales, min(1, num_k_blocks - 1), next);
        issue_group_scale_loads(tile_scales, min(2, num_k_blocks - 1), later);
    }
    // To group k_block_idx (> 0): `factors` take the accumulators from the previous group's units to its units.
    __device__ __forceinline__ void advance(const Fp8TileScales& tile_scales, int k_block_idx, int num_k_blocks,
                                            float (&factors)[kThreadRows][kNumBBoxes]) {
        unit_change(current, next, factors);
        copy_scales(next, current);
        group_scale_products(tile_scales, later, next);
        issue_group_scale_loads(tile_scales, min(k_block_idx + 2, num_k_blocks - 1), later);
    }
};

// One FP8 stage of one consumer: its 64 A rows at tile_a (K-major) times kN rows of B at tile_b (K-major) into acc,
// kBlockK / 32 steps of m64 x kN x k32; accumulating, or (kOverwrite) from zero: the first step does not read acc.
template <class Config, int kN, bool kOverwrite, int kNumRegs>
__device__ __forceinline__ void fp8_mma(const uint8_t* tile_a, const uint8_t* tile_b, float (&acc)[kNumRegs]) {
    static_assert(kNumRegs == kWgmmaM * kN / kWarpgroupThreads, "the accumulators are the wgmma's");
    constexpr gmma::ScaleOut kFirstScaleOut = kOverwrite ? gmma::ScaleOut::Zero : gmma::ScaleOut::One;
    const uint64_t desc_a = make_smem_desc_k_major_sw128(tile_a);
    const uint64_t desc_b = make_smem_desc_k_major_sw128(tile_b);
    wgmma_unpacked<WgmmaFp8Op<kN>, 0, kFirstScaleOut>(desc_a, desc_b, acc, std::make_index_sequence<kNumRegs>{});
#pragma unroll
    for (int k_step = 1; k_step < Config::kBlockK / Config::kMmaK; ++k_step) {
        wgmma_unpacked<WgmmaFp8Op<kN>, 0>(desc_a + k_step * Config::kDescKStep, desc_b + k_step * Config::kDescKStep,
                                          acc, std::make_index_sequence<kNumRegs>{});
    }
}

// The accumulators of a full-width tile row (fragment f: box f / (kBBoxRows / 8), register j: row j % 4 / 2) *=
// the factors of their rows and boxes.
template <class Config, int kNumRegs>
__device__ __forceinline__ void scale_accumulators(float (&acc)[kNumRegs],
                                                   const float (&factors)[kThreadRows][kNumBBoxes]) {
    constexpr int kFragsPerBox = Config::kBBoxRows / 8;
#pragma unroll
    for (int reg_idx = 0; reg_idx < kNumRegs; ++reg_idx)
        acc[reg_idx] *= factors[AccFragment::half_of(reg_idx)][AccFragment::frag_of(reg_idx) / kFragsPerBox];
}

// The FP8 consumer mainloop (the kernel's Mainloop for Config::kFp8): its rescaled tile, or, for a consumer with no
// rows in the tile, each stage waited for and released (the pipeline goes on).
// The rescaled mainloop of a tile with rows: the accumulators are kept in units of the current K group's scales; once
// group g - 1 has completed, they are multiplied by (its scales / group g's) and group g is issued as m64 x kBlockN
// wgmmas (A read from shared memory once per k step); the rescaling is not under the consumer's own wgmmas (the other
// consumer's keep the tensor pipe busy). A stage is released once the next group's wgmmas are issued (a lane-0 branch
// between them would make ptxas serialize every wgmma, C7520); only wgmmas of the current iteration are in flight when
// the accumulators are read (C7514). The accumulators end in the last group's units and are scaled by its scales.
template <class Config, class Epi>
struct Fp8Mainloop {
    static_assert(Config::kFp8, "e4m3 operands");

    template <class Pipeline, class Storage, int kNumRegs>
    __device__ __forceinline__ static void mma_tile(const Pipeline& pipeline, typename Pipeline::State& state,
                                                    Storage& smem, const MainloopParams& params,
                                                    const Fp8ScaleParams& scales, const Tile& tile, int num_k_blocks,
                                                    int row_block, int warp_idx, int lane_idx,
                                                    float (&acc)[kNumRegs]) {
#pragma unroll
        for (int reg_idx = 0; reg_idx < kNumRegs; ++reg_idx) acc[reg_idx] = 0.0f;
        if (row_block * kWgmmaM >= tile.num_rows) {
            for (int k_block_idx = 0; k_block_idx < num_k_blocks; ++k_block_idx) {
                pipeline.consumer_wait(state);
                if (lane_idx == 0) pipeline.consumer_release(state.index);
                state.advance();
            }
            return;
        }
        const Fp8TileScales tile_scales = fp8_tile_scales<Config, Epi>(params, scales, tile, row_block, warp_idx,
                                                                       lane_idx);
        GroupScalePipeline group_scales;
        float unit_factors[kThreadRows][kNumBBoxes];
        group_scales.start(tile_scales, num_k_blocks);
        int issued_stage = -1;
        for (int k_block_idx = 0; k_block_idx < num_k_blocks; ++k_block_idx) {
            if (k_block_idx > 0) group_scales.advance(tile_scales, k_block_idx, num_k_blocks, unit_factors);
            pipeline.consumer_wait(state);
            if constexpr (!Epi::kTmaA) fence_proxy_async_shared();
            const uint8_t* tile_a = smem.a[state.index] + row_block * kRowBlockATileBytes;
            wgmma_wait_group<0>();  // the previous group
            fence_accumulators(acc);
            if (k_block_idx > 0) scale_accumulators<Config>(acc, unit_factors);
            fence_accumulators(acc);
            wgmma_fence();
            fp8_mma<Config, Config::kBlockN, false>(tile_a, smem.b[state.index], acc);
            wgmma_commit_group();
            if (k_block_idx > 0 && lane_idx == 0) pipeline.consumer_release(issued_stage);
            issued_stage = state.index;
            state.advance();
        }
        wgmma_wait_group<0>();
        fence_accumulators(acc);
        if (lane_idx == 0) pipeline.consumer_release(issued_stage);
        scale_accumulators<Config>(acc, group_scales.current);  // from the last group's units
    }
};

}  // namespace megamoe::sm90::m_grouped
