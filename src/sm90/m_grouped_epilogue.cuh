// Epilogues of the fused Hopper M-grouped GEMM (grouped_gemm_sm90.cu), run by a consumer warpgroup for each 64-row
// block of its tile after the tile's wgmmas: store_tile (SwiGLU's h / a and the element-type store, from registers,
// masked), store_tile_tma (the element-type store of whole 16-row warp slices through shared memory and TMA stores)
// and store_tile_dswiglu (dH's dSwiGLU: reads g, u, writes dh, s * a and the tile's partial sums of ds). Each takes
// the tile configuration (Config: its columns), the row block (tile rows [64 row_block, 64 row_block + 64)) and, at
// compile time, where the block's accumulators start in the consumer's registers (kFirstReg).
#pragma once

#include "cuda/cuda_utils.h"
#include "sm90/m_grouped_config.cuh"

namespace megamoe::sm90::m_grouped {

// One row block from the wgmma accumulators (lane l of warp w holds rows 16 w + l / 4 (+ 8) of the block and, in
// fragment f, columns 8 f + 2 (l % 4) + {0, 1}). Groups of 4 fragments are transposed across each quad, then stored
// as 16-byte chunks: a warp writes 64 contiguous bytes of each of 8 rows per store.
template <typename T, Epilogue kEpilogue, class Config, int kFirstReg, int kNumRegs>
__device__ __forceinline__ void store_tile(const KernelParams& params, const Tile& tile, const float (&acc)[kNumRegs],
                                           int row_block, int warp_idx, int lane_idx) {
    constexpr bool kSwiGLU = kEpilogue == Epilogue::kSwiGLU;
    constexpr int kNumFrags = Config::kBlockN / 8;
    static_assert(kFirstReg + Config::kBlockRegs <= kNumRegs, "the row block's accumulators are the consumer's");
    constexpr int kNumOutFrags = kSwiGLU ? kNumFrags / 2 : kNumFrags;  // 8-column fragments of the output
    constexpr int kFragsPerChunk = 4;
    static_assert(kNumOutFrags % kFragsPerChunk == 0, "output fragments come in quad-transposed groups of 4");
    const int quad_lane = lane_idx % 4;
    const int first_row = row_block * kWgmmaM + warp_idx * 16 + lane_idx / 4;
    const int64_t first_col = tile.n_tile_idx * kNumOutFrags * 8;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int local_row = first_row + half * 8;
        const bool row_valid = local_row < tile.num_rows;
        const int64_t row_idx = tile.row_begin + local_row;
#pragma unroll
        for (int group_idx = 0; group_idx < kNumOutFrags / kFragsPerChunk; ++group_idx) {
            uint32_t out_words[kFragsPerChunk], gate_words[kFragsPerChunk], up_words[kFragsPerChunk];
#pragma unroll
            for (int word_idx = 0; word_idx < kFragsPerChunk; ++word_idx) {
                const int reg_idx = kFirstReg + (group_idx * kFragsPerChunk + word_idx) * 4 + half * 2;
                if constexpr (kSwiGLU) {
                    const int up_reg_idx = reg_idx + kNumFrags / 2 * 4;
                    const float gate0 = acc[reg_idx], gate1 = acc[reg_idx + 1];
                    const float up0 = acc[up_reg_idx], up1 = acc[up_reg_idx + 1];
                    out_words[word_idx] = cuda::pack_pair<T>(silu(gate0) * up0, silu(gate1) * up1);
                    gate_words[word_idx] = cuda::pack_pair<T>(gate0, gate1);
                    up_words[word_idx] = cuda::pack_pair<T>(up0, up1);
                } else {
                    out_words[word_idx] = cuda::pack_pair<T>(acc[reg_idx], acc[reg_idx + 1]);
                }
            }
            const int64_t col = first_col + (group_idx * kFragsPerChunk + quad_lane) * 8;
            const bool valid = row_valid && col < params.n;
            if (params.out != nullptr) {
                quad_transpose(out_words, quad_lane);
                if (valid) store_chunk(static_cast<T*>(params.out) + row_idx * params.ldo, col, out_words);
            }
            if (kSwiGLU && params.h != nullptr) {
                quad_transpose(gate_words, quad_lane);
                quad_transpose(up_words, quad_lane);
                T* h_row = static_cast<T*>(params.h) + row_idx * 2 * params.n;
                if (valid) store_chunk(h_row, col, gate_words);
                if (valid) store_chunk(h_row + params.n, col, up_words);
            }
        }
    }
}

// kStore, one consumer warp's 16 rows of a row block (tile rows [warp_first_row, warp_first_row + 16), all inside the
// expert) by
// TMA stores of 16 x 64 boxes through the warp's staging boxes at `staging` (store_warp_rows_tma); the output's
// tensor map clips the columns at n. The warp returns to its MMAs as soon as its last store is issued.
template <typename T, class Config, int kFirstReg, int kNumRegs>
__device__ __forceinline__ void store_tile_tma(const CUtensorMap* out_map, const Tile& tile,
                                               const float (&acc)[kNumRegs], uint32_t staging, int warp_first_row,
                                               int lane_idx) {
    const auto row = static_cast<int32_t>(tile.row_begin + warp_first_row);
    const auto first_col = static_cast<int32_t>(tile.n_tile_idx * Config::kBlockN);
    store_warp_rows_tma<T, Config::kStoreChunks, kFirstReg>(acc, staging, lane_idx, [&](uint32_t box, int chunk) {
        tma_store_2d(out_map, box, first_col + chunk * kTmaStoreCols, row);
    });
}

// kDSwiGLU: the topk weight s of the thread's two accumulator rows of a row block (rows 16 w + l / 4 and + 8 of its
// 64), 0 for rows past the tile's end. Loaded when the tile starts (slot, then weight: two dependent loads), so the
// epilogue, a whole mainloop later, does not wait for them.
struct RowWeights {
    float weight[2];
};

__device__ __forceinline__ RowWeights load_row_weights(const KernelParams& params, const Tile& tile, int row_block,
                                                       int warp_idx, int lane_idx) {
    RowWeights weights;
    const int first_row = row_block * kWgmmaM + warp_idx * 16 + lane_idx / 4;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int local_row = first_row + half * 8;
        weights.weight[half] = 0.0f;
        if (local_row < tile.num_rows) {
            const int64_t slot_idx = cuda::slot_of_row(params.a_gather_slots, tile.row_begin + local_row);
            weights.weight[half] = cuda::load_weight(params.weights, params.weights_dtype, slot_idx);
        }
    }
    return weights;
}

// kDSwiGLU epilogue of one consumer warpgroup (rows and fragments as in store_tile): acc = p = W2[e]^T dy of the
// tile's I columns. Each lane reads its 16-byte chunks of g and u in batches of kLoadBatch groups, software-pipelined:
// the next batch's loads are issued before the current batch is computed and stored, so a lane waits for L2 (the
// producer prefetched the rows there) once per tile instead of once per batch. A batch's chunks are quad-transposed
// into the accumulator layout; then ds += p a, da = s p, dg = da u sigmoid(g) (1 + g (1 - sigmoid(g))),
// du = da silu(g), and s a, transposed back into chunks and stored. dh may be h itself (in place): a batch is loaded
// before it is stored, and batches touch disjoint columns. The quad's partial sums of ds (a fixed shuffle order) give
// the row's sum over the tile's columns. Columns past I hold p = 0 (B zero-filled) and read no h.
template <typename T, class Config, int kFirstReg, int kNumRegs>
__device__ __forceinline__ void store_tile_dswiglu(const KernelParams& params, const Tile& tile,
                                                   const float (&acc)[kNumRegs], const RowWeights& weights,
                                                   int row_block, int warp_idx, int lane_idx) {
    constexpr int kFragsPerChunk = 4;
    constexpr int kNumGroups = Config::kBlockN / 8 / kFragsPerChunk;  // 16-byte chunks per lane and row
    constexpr int kLoadBatch = 2;
    constexpr int kBatchesPerHalf = kNumGroups / kLoadBatch;
    constexpr int kNumBatches = 2 * kBatchesPerHalf;  // both rows of the thread, one after the other
    static_assert(kNumGroups % kLoadBatch == 0, "g, u chunks are loaded in whole batches");
    static_assert(kFirstReg + Config::kBlockRegs <= kNumRegs, "the row block's accumulators are the consumer's");
    const int quad_lane = lane_idx % 4;
    const int first_row = row_block * kWgmmaM + warp_idx * 16 + lane_idx / 4;
    const int64_t first_col = tile.n_tile_idx * Config::kBlockN;
    const int64_t intermediate = params.n;
    const T* h = static_cast<const T*>(params.h);
    T* dh = static_cast<T*>(params.out);
    T* act = static_cast<T*>(params.act);
    auto row_valid = [&](int half) { return first_row + half * 8 < tile.num_rows; };  // the same for a quad's lanes
    auto row_idx = [&](int half) { return tile.row_begin + first_row + half * 8; };
    auto chunk_col = [&](int batch_idx, int batch_group) {
        return first_col +
               (((batch_idx % kBatchesPerHalf) * kLoadBatch + batch_group) * kFragsPerChunk + quad_lane) * 8;
    };
    auto load_batch = [&](int batch_idx, uint32_t(&gate)[kLoadBatch][kFragsPerChunk],
                          uint32_t(&up)[kLoadBatch][kFragsPerChunk]) {
        const int half = batch_idx / kBatchesPerHalf;
        const T* h_row = h + row_idx(half) * 2 * intermediate;
#pragma unroll
        for (int batch_group = 0; batch_group < kLoadBatch; ++batch_group) {
            const int64_t col = chunk_col(batch_idx, batch_group);
#pragma unroll
            for (int word_idx = 0; word_idx < kFragsPerChunk; ++word_idx) gate[batch_group][word_idx] = 0;
#pragma unroll
            for (int word_idx = 0; word_idx < kFragsPerChunk; ++word_idx) up[batch_group][word_idx] = 0;
            if (row_valid(half) && col < intermediate) {
                load_chunk(h_row, col, gate[batch_group]);
                load_chunk(h_row + intermediate, col, up[batch_group]);
            }
        }
    };
    uint32_t gate_next[kLoadBatch][kFragsPerChunk], up_next[kLoadBatch][kFragsPerChunk];
    load_batch(0, gate_next, up_next);
    float ds = 0.0f;
#pragma unroll
    for (int batch_idx = 0; batch_idx < kNumBatches; ++batch_idx) {
        const int half = batch_idx / kBatchesPerHalf;
        uint32_t gate_batch[kLoadBatch][kFragsPerChunk], up_batch[kLoadBatch][kFragsPerChunk];
#pragma unroll
        for (int batch_group = 0; batch_group < kLoadBatch; ++batch_group) {
#pragma unroll
            for (int word_idx = 0; word_idx < kFragsPerChunk; ++word_idx) {
                gate_batch[batch_group][word_idx] = gate_next[batch_group][word_idx];
                up_batch[batch_group][word_idx] = up_next[batch_group][word_idx];
            }
        }
        if (batch_idx + 1 < kNumBatches) load_batch(batch_idx + 1, gate_next, up_next);
        const float weight = weights.weight[half];
        T* dh_row = dh + row_idx(half) * 2 * intermediate;
        T* act_row = act + row_idx(half) * intermediate;
#pragma unroll
        for (int batch_group = 0; batch_group < kLoadBatch; ++batch_group) {
            const int group_idx = (batch_idx % kBatchesPerHalf) * kLoadBatch + batch_group;
            const int64_t col = chunk_col(batch_idx, batch_group);
            const bool valid = row_valid(half) && col < intermediate;
            uint32_t(&gate_words)[kFragsPerChunk] = gate_batch[batch_group];
            uint32_t(&up_words)[kFragsPerChunk] = up_batch[batch_group];
            quad_transpose(gate_words, quad_lane);
            quad_transpose(up_words, quad_lane);
            uint32_t dgate_words[kFragsPerChunk], dup_words[kFragsPerChunk], act_words[kFragsPerChunk];
#pragma unroll
            for (int word_idx = 0; word_idx < kFragsPerChunk; ++word_idx) {
                const int reg_idx = kFirstReg + (group_idx * kFragsPerChunk + word_idx) * 4 + half * 2;
                float gate[2], up[2], d_gate[2], d_up[2], scaled_act[2];
                cuda::unpack_pair<T>(gate_words[word_idx], gate[0], gate[1]);
                cuda::unpack_pair<T>(up_words[word_idx], up[0], up[1]);
#pragma unroll
                for (int item_idx = 0; item_idx < 2; ++item_idx) {
                    const float p = acc[reg_idx + item_idx];
                    const float gate_sigmoid = 1.0f / (1.0f + __expf(-gate[item_idx]));
                    const float silu_gate = gate[item_idx] * gate_sigmoid;
                    const float activation = silu_gate * up[item_idx];
                    ds = fmaf(p, activation, ds);
                    const float d_act = weight * p;
                    d_gate[item_idx] =
                        d_act * up[item_idx] * gate_sigmoid * (1.0f + gate[item_idx] * (1.0f - gate_sigmoid));
                    d_up[item_idx] = d_act * silu_gate;
                    scaled_act[item_idx] = weight * activation;
                }
                dgate_words[word_idx] = cuda::pack_pair<T>(d_gate[0], d_gate[1]);
                dup_words[word_idx] = cuda::pack_pair<T>(d_up[0], d_up[1]);
                act_words[word_idx] = cuda::pack_pair<T>(scaled_act[0], scaled_act[1]);
            }
            quad_transpose(dgate_words, quad_lane);
            quad_transpose(dup_words, quad_lane);
            quad_transpose(act_words, quad_lane);
            if (valid) {
                store_chunk(dh_row, col, dgate_words);
                store_chunk(dh_row + intermediate, col, dup_words);
                store_chunk(act_row, col, act_words);
            }
        }
        if (batch_idx % kBatchesPerHalf == kBatchesPerHalf - 1) {  // the half's row is done: its ds part
            ds += __shfl_xor_sync(0xffffffffu, ds, 1);
            ds += __shfl_xor_sync(0xffffffffu, ds, 2);
            if (row_valid(half) && quad_lane == 0) {
                params.ds_parts[row_idx(half) * params.num_n_tiles + tile.n_tile_idx] = ds;
            }
            ds = 0.0f;
        }
    }
}

}  // namespace megamoe::sm90::m_grouped
