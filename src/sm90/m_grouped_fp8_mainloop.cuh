// The blockwise FP8 mainloops of the M-grouped kernel (Operands::kFp8Blockwise, kFp8Rescaled and kFp8RescaledFullN of
// m_grouped_config.cuh; m_grouped_kernel.cuh's consume runs them): which scales a consumer thread applies, the
// promotion of a K group's f32 partial sums into the accumulators, and the rescaled mainloop of a tile. A thread's
// accumulators of a row block are 2 rows (lane / 4 and + 8 of its warp's 16) x the tile's columns, fragment f (8
// columns) from B box f / (kBBoxRows / 8); each K group's partial sums are scaled by sa[row, g] * sb[block of the box,
// g] (m_grouped_fp8_gemm_sm90.h).
#pragma once

#include <cstdint>

#include "sm90/hopper.h"
#include "sm90/m_grouped_config.cuh"
#include "sm90/ptx.h"

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
        const int local_row = row_block * kWgmmaM + warp_idx * 16 + lane_idx / 4 + half * 8;
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

// One column half's accumulators (B box kHalf: fragment f of the half, register j: row j / 2) *= factors of its box.
template <class Config, int kHalf, int kHalfRegs>
__device__ __forceinline__ void scale_half_accumulators(float (&half_acc)[kHalfRegs],
                                                        const float (&factors)[kThreadRows][kNumBBoxes]) {
    static_assert(Config::kBBoxRows / 8 * 4 == kHalfRegs, "a half is one B box's fragments");
#pragma unroll
    for (int reg_idx = 0; reg_idx < kHalfRegs; ++reg_idx) half_acc[reg_idx] *= factors[reg_idx % 4 / 2][kHalf];
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

// acc += group_acc * (sa * sb), element by element: one K group promoted (register j of fragment f: row j / 2).
template <class Config, int kNumRegs>
__device__ __forceinline__ void promote_group(float (&acc)[kNumRegs], const float (&group_acc)[kNumRegs],
                                              const float (&group_scales)[kThreadRows][kNumBBoxes]) {
    constexpr int kFragsPerBox = Config::kBBoxRows / 8;
    static_assert(kNumRegs == Config::kBlockN / 8 * 4, "one row block: 4 registers per 8-column fragment");
#pragma unroll
    for (int reg_idx = 0; reg_idx < kNumRegs; ++reg_idx) {
        const int frag_idx = reg_idx / 4;
        acc[reg_idx] = fmaf(group_acc[reg_idx], group_scales[reg_idx % 4 / 2][frag_idx / kFragsPerBox], acc[reg_idx]);
    }
}

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

// One column half (B box kHalf) of a rescaled FP8 stage into its accumulators, accumulating.
template <class Config, int kHalf, int kHalfRegs>
__device__ __forceinline__ void fp8_half_mma(const uint8_t* tile_a, const uint8_t* tile_b,
                                             float (&half_acc)[kHalfRegs]) {
    fp8_mma<Config, Config::kBBoxRows, false>(tile_a, tile_b + kHalf * Config::kBBoxBytes, half_acc);
}

// A consumer with no rows in the tile: waits for each of its stages and releases it (the pipeline goes on).
template <class Config, int kNumStages, class Storage>
__device__ __forceinline__ void skip_stages(Storage& smem, int& stage_idx, uint32_t& phase, int num_k_blocks,
                                            int lane_idx) {
    for (int k_block_idx = 0; k_block_idx < num_k_blocks; ++k_block_idx) {
        mbarrier_wait(&smem.full[stage_idx], phase);
        if (lane_idx == 0) release_stage<kClusterSize>(&smem.empty[stage_idx]);
        advance_stage<kNumStages>(stage_idx, phase);
    }
}

// The promoted FP8 mainloop of one tile with rows (Operands::kFp8Blockwise): each stage (one K group) summed into
// group_acc from zero, completed before the stage is released (no batch stays in flight), then promoted into acc by
// the group's scales (loaded a group ahead). The other consumer's wgmmas keep the tensor pipe busy meanwhile.
template <class Config, class Epi, int kNumStages, class Storage, int kNumRegs>
__device__ __forceinline__ void fp8_promoted_mainloop(Storage& smem, int& stage_idx, uint32_t& phase, int num_k_blocks,
                                                      const Fp8TileScales& tile_scales, int first_row_block,
                                                      int lane_idx, float (&acc)[kNumRegs]) {
    float group_acc[kNumRegs];
    float group_scales[kThreadRows][kNumBBoxes];
    float next_scales[kThreadRows][kNumBBoxes];
    load_group_scales(tile_scales, 0, next_scales);
    for (int k_block_idx = 0; k_block_idx < num_k_blocks; ++k_block_idx) {
        copy_scales(next_scales, group_scales);
        if (k_block_idx + 1 < num_k_blocks) load_group_scales(tile_scales, k_block_idx + 1, next_scales);
        mbarrier_wait(&smem.full[stage_idx], phase);
        if constexpr (!Epi::kTmaA) fence_proxy_async_shared();
        fence_accumulators(group_acc);
        wgmma_fence();
        fp8_mma<Config, Config::kBlockN, true>(smem.a[stage_idx] + first_row_block * kRowBlockATileBytes,
                                               smem.b[stage_idx], group_acc);
        wgmma_commit_group();
        wgmma_wait_group<0>();
        fence_accumulators(group_acc);
        if (lane_idx == 0) release_stage<kClusterSize>(&smem.empty[stage_idx]);
        advance_stage<kNumStages>(stage_idx, phase);
        promote_group<Config>(acc, group_acc, group_scales);
    }
}

// The rescaled FP8 mainloop of one tile (Operands::kFp8Rescaled; m_grouped_fp8_mainloop.cuh): the accumulators are kept
// in units of the current K group's scales, in two column halves (two register arrays, B boxes 0 and 1): once group
// g - 1 has completed, half 0 is rescaled and group g's half 0 issued, then half 1 is rescaled while those wgmmas run
// and group g's half 1 issued (only wgmmas issued in the same iteration are in flight when a half is read: ptxas
// loses their order across the loop's back edge and would serialize every wgmma, C7514). The accumulators end in the
// last group's units, are scaled by its scales and copied into `acc` (the epilogue's layout: half h at registers
// [h * kHalfRegs, + kHalfRegs)).
template <class Config, class Epi, int kNumStages, class Storage, int kNumRegs>
__device__ __forceinline__ void fp8_rescaled_mainloop(Storage& smem, int& stage_idx, uint32_t& phase, int num_k_blocks,
                                                      const Fp8TileScales& tile_scales, int first_row_block,
                                                      int lane_idx, float (&acc)[kNumRegs]) {
    static_assert(kNumBBoxes == 2, "two column halves");
    constexpr int kHalfRegs = kNumRegs / kNumBBoxes;
    float acc0[kHalfRegs], acc1[kHalfRegs];
#pragma unroll
    for (int reg_idx = 0; reg_idx < kHalfRegs; ++reg_idx) acc0[reg_idx] = acc1[reg_idx] = 0.0f;
    GroupScalePipeline scales;
    float unit_factors[kThreadRows][kNumBBoxes];
    scales.start(tile_scales, num_k_blocks);
    int issued_stage = -1;
    for (int k_block_idx = 0; k_block_idx < num_k_blocks; ++k_block_idx) {
        if (k_block_idx > 0) scales.advance(tile_scales, k_block_idx, num_k_blocks, unit_factors);
        mbarrier_wait(&smem.full[stage_idx], phase);
        if constexpr (!Epi::kTmaA) fence_proxy_async_shared();
        const uint8_t* tile_a = smem.a[stage_idx] + first_row_block * kRowBlockATileBytes;
        const uint8_t* tile_b = smem.b[stage_idx];
        wgmma_wait_group<0>();  // the previous group, both halves
        fence_accumulators(acc0);
        fence_accumulators(acc1);
        if (k_block_idx > 0) scale_half_accumulators<Config, 0>(acc0, unit_factors);
        fence_accumulators(acc0);
        wgmma_fence();
        fp8_half_mma<Config, 0>(tile_a, tile_b, acc0);
        wgmma_commit_group();
        if (k_block_idx > 0) scale_half_accumulators<Config, 1>(acc1, unit_factors);  // under half 0's wgmmas
        fence_accumulators(acc1);
        wgmma_fence();
        fp8_half_mma<Config, 1>(tile_a, tile_b, acc1);
        wgmma_commit_group();
        // Released once this group's wgmmas are issued: a lane-0 branch between them would make ptxas serialize
        // every wgmma (C7520, a warpgroup arrive on a divergent path).
        if (k_block_idx > 0 && lane_idx == 0) release_stage<kClusterSize>(&smem.empty[issued_stage]);
        issued_stage = stage_idx;
        advance_stage<kNumStages>(stage_idx, phase);
    }
    wgmma_wait_group<0>();
    fence_accumulators(acc0);
    fence_accumulators(acc1);
    if (lane_idx == 0) release_stage<kClusterSize>(&smem.empty[issued_stage]);
    scale_half_accumulators<Config, 0>(acc0, scales.current);  // from the last group's units
    scale_half_accumulators<Config, 1>(acc1, scales.current);
#pragma unroll
    for (int reg_idx = 0; reg_idx < kHalfRegs; ++reg_idx) {
        acc[reg_idx] = acc0[reg_idx];
        acc[kHalfRegs + reg_idx] = acc1[reg_idx];
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
        acc[reg_idx] *= factors[reg_idx % 4 / 2][reg_idx / 4 / kFragsPerBox];
}

// The rescaled FP8 mainloop with full-width wgmmas (Operands::kFp8RescaledFullN, the default): the
// math of fp8_rescaled_mainloop (the same units, factors and order of roundings; the layer's y and dx came out bitwise
// the same with either on the H200 at the three reference shapes), but once
// group g - 1 has completed both column halves are rescaled and group g is issued as m64 x kBlockN wgmmas, so a k step
// reads A from shared memory once instead of once per half; the rescaling is not under the consumer's own wgmmas (the
// other consumer's keep the tensor pipe busy). Only wgmmas of the current iteration are in flight when the accumulators
// are read (ptxas C7514).
template <class Config, class Epi, int kNumStages, class Storage, int kNumRegs>
__device__ __forceinline__ void fp8_rescaled_full_mainloop(Storage& smem, int& stage_idx, uint32_t& phase,
                                                           int num_k_blocks, const Fp8TileScales& tile_scales,
                                                           int first_row_block, int lane_idx, float (&acc)[kNumRegs]) {
#pragma unroll
    for (int reg_idx = 0; reg_idx < kNumRegs; ++reg_idx) acc[reg_idx] = 0.0f;
    GroupScalePipeline scales;
    float unit_factors[kThreadRows][kNumBBoxes];
    scales.start(tile_scales, num_k_blocks);
    int issued_stage = -1;
    for (int k_block_idx = 0; k_block_idx < num_k_blocks; ++k_block_idx) {
        if (k_block_idx > 0) scales.advance(tile_scales, k_block_idx, num_k_blocks, unit_factors);
        mbarrier_wait(&smem.full[stage_idx], phase);
        if constexpr (!Epi::kTmaA) fence_proxy_async_shared();
        const uint8_t* tile_a = smem.a[stage_idx] + first_row_block * kRowBlockATileBytes;
        wgmma_wait_group<0>();  // the previous group
        fence_accumulators(acc);
        if (k_block_idx > 0) scale_accumulators<Config>(acc, unit_factors);
        fence_accumulators(acc);
        wgmma_fence();
        fp8_mma<Config, Config::kBlockN, false>(tile_a, smem.b[stage_idx], acc);
        wgmma_commit_group();
        if (k_block_idx > 0 && lane_idx == 0) release_stage<kClusterSize>(&smem.empty[issued_stage]);
        issued_stage = stage_idx;
        advance_stage<kNumStages>(stage_idx, phase);
    }
    wgmma_wait_group<0>();
    fence_accumulators(acc);
    if (lane_idx == 0) release_stage<kClusterSize>(&smem.empty[issued_stage]);
    scale_accumulators<Config>(acc, scales.current);  // from the last group's units
}

}  // namespace megamoe::sm90::m_grouped
