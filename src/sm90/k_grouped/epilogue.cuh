// The K-grouped kernel's epilogue: one consumer warpgroup's row blocks of an output tile C_e[m_begin + row,
// n_begin + col] into out [E, M, N] (accumulator fragments: kit/fragment.cuh).
//   element type with the output's tensor map: each warp stages its 16 rows of a row block 64 columns at a time in its
//     store boxes (stmatrix, 128-byte swizzle) and lane 0 stores each box by TMA (kit/store.cuh), so the warp is back at
//     its MMAs once its last store is issued and the global writes overlap the next tile;
//   f32 (or without the tensor map): quad transpose and 16-byte stores, or 8-byte f32 pairs, from registers;
//     accumulating (params.accumulate, f32 only): each thread loads its f32 pairs of a row at once (one round trip per
//     row; a row crossing N pair by pair), adds its accumulators and stores them back, each element by its one thread.
#pragma once

#include <type_traits>
#include <utility>

#include "device/cuda_utils.h"
#include "sm90/k_grouped/scheduler.cuh"
#include "sm90/kit/fragment.cuh"
#include "sm90/kit/store.cuh"

namespace megamoe::sm90::k_grouped {

// fn(std::integral_constant<int, i>) for i = 0 .. kCount - 1, in order (a compile-time index per call).
template <typename Fn, int... kIdx>
__device__ __forceinline__ void for_each_index(Fn&& fn, std::integer_sequence<int, kIdx...>) {
    (fn(std::integral_constant<int, kIdx>{}), ...);
}
template <int kCount, typename Fn>
__device__ __forceinline__ void for_each_index(Fn&& fn) {
    for_each_index(fn, std::make_integer_sequence<int, kCount>{});
}

// One consumer warpgroup's row block kRowBlock of the output tile from registers (its accumulators from
// kRowBlock * kBlockRegs on), OutT = T or float (params.accumulate: float, added to the values there).
template <class Shape, typename T, typename OutT, int kRowBlock, int kNumRegs>
__device__ __forceinline__ void store_tile(const KernelParams& params, const Tile& tile, const float (&acc)[kNumRegs],
                                           int consumer_idx, int warp_idx, int lane_idx) {
    constexpr int kFirstReg = kRowBlock * Shape::kBlockRegs;
    static_assert(kFirstReg + Shape::kBlockRegs <= kNumRegs, "the row block's accumulators are the consumer's");
    constexpr int kNumFrags = Shape::kBlockN / AccFragment::kFragCols;
    constexpr int kFragsPerChunk = 4;
    // f32 pairs of a row loaded before their stores: all of a 256-column row (no spills, 168 regs)
    constexpr int kAccumulateBatch = kNumFrags < 32 ? kNumFrags : 32;
    static_assert(kNumFrags % kAccumulateBatch == 0 && kNumFrags % kFragsPerChunk == 0, "whole batches and chunks");
    const int quad_lane = AccFragment::quad_lane(lane_idx);
    const int first_row =
        consumer_idx * Shape::kConsumerRows + kRowBlock * kWgmmaM + warp_idx * AccFragment::kWarpRows + AccFragment::row_in_warp(lane_idx);
    OutT* out = static_cast<OutT*>(params.out) + static_cast<int64_t>(tile.expert_idx) * params.m * params.n;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int64_t m_idx = tile.m_begin + first_row + half * AccFragment::kHalfRows;
        const bool row_valid = m_idx < params.m;
        OutT* out_row = out + m_idx * params.n;
        if constexpr (std::is_same_v<OutT, float>) {
            if (params.accumulate) {
#pragma unroll
                for (int batch_idx = 0; batch_idx < kNumFrags / kAccumulateBatch; ++batch_idx) {
                    const int first_frag = batch_idx * kAccumulateBatch;
                    const int64_t first_col = tile.n_begin + first_frag * 8 + quad_lane * 2;
                    if (row_valid && tile.n_begin + (first_frag + kAccumulateBatch) * 8 <= params.n) {
                        // The whole batch inside the output (the common case): its loads go out together,
                        // unpredicated (a predicate per load would exhaust the predicate registers and serialize them).
                        float2 before[kAccumulateBatch];
#pragma unroll
                        for (int pair_idx = 0; pair_idx < kAccumulateBatch; ++pair_idx) {
                            before[pair_idx] = *reinterpret_cast<const float2*>(out_row + first_col + pair_idx * 8);
                        }
#pragma unroll
                        for (int pair_idx = 0; pair_idx < kAccumulateBatch; ++pair_idx) {
                            const int reg_idx = kFirstReg + AccFragment::reg(first_frag + pair_idx, half);
                            store_pair_f32(out_row, first_col + pair_idx * 8, before[pair_idx].x + acc[reg_idx],
                                           before[pair_idx].y + acc[reg_idx + 1]);
                        }
                    } else if (row_valid) {  // the batch crosses N (N % 8 == 0: a pair is all in or all out)
#pragma unroll
                        for (int pair_idx = 0; pair_idx < kAccumulateBatch; ++pair_idx) {
                            const int64_t col = first_col + pair_idx * 8;
                            const int reg_idx = kFirstReg + AccFragment::reg(first_frag + pair_idx, half);
                            if (col >= params.n) continue;
                            const float2 before = *reinterpret_cast<const float2*>(out_row + col);
                            store_pair_f32(out_row, col, before.x + acc[reg_idx], before.y + acc[reg_idx + 1]);
                        }
                    }
                }
            } else {
#pragma unroll
                for (int frag_idx = 0; frag_idx < kNumFrags; ++frag_idx) {
                    const int64_t col = tile.n_begin + frag_idx * 8 + quad_lane * 2;
                    const int reg_idx = kFirstReg + AccFragment::reg(frag_idx, half);
                    if (row_valid && col < params.n) store_pair_f32(out_row, col, acc[reg_idx], acc[reg_idx + 1]);
                }
            }
        } else {
#pragma unroll
            for (int group_idx = 0; group_idx < kNumFrags / kFragsPerChunk; ++group_idx) {
                uint32_t words[kFragsPerChunk];
#pragma unroll
                for (int word_idx = 0; word_idx < kFragsPerChunk; ++word_idx) {
                    const int reg_idx = kFirstReg + AccFragment::reg(group_idx * kFragsPerChunk + word_idx, half);
                    words[word_idx] = cuda::pack_pair<T>(acc[reg_idx], acc[reg_idx + 1]);
                }
                quad_transpose(words, quad_lane);
                const int64_t col = tile.n_begin + (group_idx * kFragsPerChunk + quad_lane) * 8;
                if (row_valid && col < params.n) store_chunk(out_row, col, words);
            }
        }
    }
}

// One consumer warp's 16 rows of row block kRowBlock of the output tile (element type) by TMA stores, 64 columns at a
// time, through its staging boxes at `staging` (store_warp_rows_tma).
template <class Shape, typename T, int kStoreBoxes, int kRowBlock, int kNumRegs>
__device__ __forceinline__ void store_tile_tma(const CUtensorMap* out_map, const Tile& tile,
                                               const float (&acc)[kNumRegs], uint32_t staging, int consumer_idx,
                                               int warp_idx, int lane_idx) {
    const int row = tile.m_begin + consumer_idx * Shape::kConsumerRows + kRowBlock * kWgmmaM + warp_idx * kTmaStoreRows;
    store_warp_rows_tma<T, Shape::kStoreChunks, kRowBlock * Shape::kBlockRegs, kStoreBoxes>(
        acc, staging, lane_idx, [&](uint32_t box, int chunk) {
            tma_store_3d(out_map, box, tile.n_begin + chunk * kTmaStoreCols, row, tile.expert_idx);
        });
}

// The epilogue of a tile: every row block of the consumer, by TMA stores where the output is in the element type and
// its tensor map was made, else from registers.
template <class Shape, typename T, typename OutT, int kStoreBoxes>
struct Epilogue {
    template <int kNumRegs>
    __device__ __forceinline__ static void store(const CUtensorMap* out_map, const KernelParams& params,
                                                 const Tile& tile, const float (&acc)[kNumRegs], uint32_t staging,
                                                 int consumer_idx, int warp_idx, int lane_idx) {
        for_each_index<Shape::kRowBlocks>([&](auto row_block) {
            constexpr int kRowBlock = decltype(row_block)::value;
            if (!std::is_same_v<OutT, float> && params.tma_store) {
                store_tile_tma<Shape, T, kStoreBoxes, kRowBlock>(out_map, tile, acc, staging, consumer_idx, warp_idx,
                                                                 lane_idx);
            } else {
                store_tile<Shape, T, OutT, kRowBlock>(params, tile, acc, consumer_idx, warp_idx, lane_idx);
            }
        });
    }
};

}  // namespace megamoe::sm90::k_grouped
