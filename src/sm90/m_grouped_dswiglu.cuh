// The dSwiGLU epilogue of the fused Hopper M-grouped GEMM (grouped_gemm_sm90.cu), the backward's dH: reads g, u,
// writes dh, s * a and the tile's partial sums of ds (store_tile_dswiglu), for an activation policy
// (m_grouped_activation.cuh) and an order of dh: [dg, du] by sorted row, or interleaved (dg_0, du_0, dg_1, ...: the
// interleaved layout's row order, which the dX and dW13 GEMMs read as w13 stores its rows).
#pragma once

#include "sm90/m_grouped_epilogue.cuh"

namespace megamoe::sm90::m_grouped {

// Two 32-bit words at row + col (8-byte aligned), as one vector store.
template <typename T>
__device__ __forceinline__ void store_words2(T* row, int64_t col, uint32_t first, uint32_t second) {
    asm volatile("st.global.v2.b32 [%0], {%1, %2};\n" ::"l"(row + col), "r"(first), "r"(second) : "memory");
}

// dH's epilogue: what it reads and writes besides its accumulators p = W2[e]^T dy (and the activation's params).
template <class Act>
struct DSwiGLUParamsOf : Act::Params {
    const void* h;        // [g, u] [rows, 2I] by sorted row
    void* dh;             // [dg, du] [rows, 2I] by sorted row (may be h: written in place), or interleaved (not h)
    void* act;            // s * a [rows, I]
    float* ds_parts;      // [rows, num_n_tiles] partial sums of ds
    const void* weights;  // topk_weights [T * topk] (s of row r: weights[a_gather_slots[r]]), NULL: s = 1
    megamoe_dtype_t weights_dtype;
};

// The topk weight s of the thread's two accumulator rows of a row block (rows 16 w + l / 4 and + 8 of its 64), 0 for
// rows past the tile's end. Loaded when the tile starts (slot, then weight: two dependent loads), so the epilogue, a
// whole mainloop later, does not wait for them.
struct RowWeights {
    float weight[2];
};

template <class Params>
__device__ __forceinline__ RowWeights load_row_weights(const MainloopParams& params, const Params& epilogue,
                                                       const Tile& tile, int row_block, int warp_idx, int lane_idx) {
    RowWeights weights;
    const int first_row = row_block * kWgmmaM + warp_idx * 16 + lane_idx / 4;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int local_row = first_row + half * 8;
        weights.weight[half] = 0.0f;
        if (local_row < tile.num_rows) {
            const int64_t slot_idx = cuda::slot_of_row(params.a_gather_slots, tile.row_begin + local_row);
            weights.weight[half] = cuda::load_weight(epilogue.weights, epilogue.weights_dtype, slot_idx);
        }
    }
    return weights;
}

// dSwiGLU epilogue of one consumer warpgroup (rows and fragments as in store_tile): acc = p = W2[e]^T dy of the
// tile's I columns. Each lane reads its 16-byte chunks of g and u in batches of kLoadBatch groups, software-pipelined:
// the next batch's loads are issued before the current batch is computed and stored, so a lane waits for L2 (the
// producer prefetched the rows there) once per tile instead of once per batch. A batch's chunks are quad-transposed
// into the accumulator layout; then ds += p a, da = s p, dg = da u sigmoid(g) (1 + g (1 - sigmoid(g))),
// du = da silu(g), and s a, transposed back into chunks and stored. dh may be h itself (in place): a batch is loaded
// before it is stored, and batches touch disjoint columns. The quad's partial sums of ds (a fixed shuffle order) give
// the row's sum over the tile's columns. Columns past I hold p = 0 (B zero-filled) and read no h.
template <typename T, class Act, bool kInterleaved, class Config, int kFirstReg, int kNumRegs>
__device__ __forceinline__ void store_tile_dswiglu(const MainloopParams& params, const DSwiGLUParamsOf<Act>& epilogue,
                                                   const Tile& tile, const float (&acc)[kNumRegs],
                                                   const RowWeights& weights, int row_block, int warp_idx,
                                                   int lane_idx) {
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
    const T* h = static_cast<const T*>(epilogue.h);
    T* dh = static_cast<T*>(epilogue.dh);
    T* act = static_cast<T*>(epilogue.act);
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
                    float activation;
                    Act::backward(epilogue, gate[item_idx], up[item_idx], weight * p, activation, d_gate[item_idx],
                                  d_up[item_idx]);
                    ds = fmaf(p, activation, ds);
                    scaled_act[item_idx] = weight * activation;
                }
                if constexpr (kInterleaved) {  // dh positions 2i .. 2i + 3 of the pair's columns i, i + 1: 8 bytes
                    const int64_t frag_col = first_col + (group_idx * kFragsPerChunk + word_idx) * 8 + 2 * quad_lane;
                    if (row_valid(half) && frag_col < intermediate) {
                        store_words2(dh_row, 2 * frag_col, cuda::pack_pair<T>(d_gate[0], d_up[0]),
                                     cuda::pack_pair<T>(d_gate[1], d_up[1]));
                    }
                } else {
                    dgate_words[word_idx] = cuda::pack_pair<T>(d_gate[0], d_gate[1]);
                    dup_words[word_idx] = cuda::pack_pair<T>(d_up[0], d_up[1]);
                }
                act_words[word_idx] = cuda::pack_pair<T>(scaled_act[0], scaled_act[1]);
            }
            if constexpr (!kInterleaved) {
                quad_transpose(dgate_words, quad_lane);
                quad_transpose(dup_words, quad_lane);
            }
            quad_transpose(act_words, quad_lane);
            if (valid) {
                if constexpr (!kInterleaved) {
                    store_chunk(dh_row, col, dgate_words);
                    store_chunk(dh_row + intermediate, col, dup_words);
                }
                store_chunk(act_row, col, act_words);
            }
        }
        if (batch_idx % kBatchesPerHalf == kBatchesPerHalf - 1) {  // the half's row is done: its ds part
            ds += __shfl_xor_sync(0xffffffffu, ds, 1);
            ds += __shfl_xor_sync(0xffffffffu, ds, 2);
            if (row_valid(half) && quad_lane == 0) {
                epilogue.ds_parts[row_idx(half) * params.num_n_tiles + tile.n_tile_idx] = ds;
            }
            ds = 0.0f;
        }
    }
}

// dH's epilogue for an activation policy; kInterleaved: dh in the interleaved order (written elsewhere than h).
template <class Act, bool kInterleaved>
struct DSwiGLUEpilogueOf : NoEpilogueHooks {
    using Params = DSwiGLUParamsOf<Act>;
    static constexpr bool kTmaA = false;
    static constexpr bool kGateUpPairs = false;
    static constexpr bool kGateUpHalves = false;
    static constexpr bool kStaging = false;
    static constexpr const char* name(BLayout) { return "m_grouped_gemm_sm90[dswiglu, kn]"; }
    struct TileState {
        RowWeights row_weights[2];  // per row block of the consumer (at most two)
    };

    template <class Config>
    __device__ __forceinline__ static TileState begin_tile(const MainloopParams& mainloop, const Params& params,
                                                           const Tile& tile, int first_row_block, int warp_idx,
                                                           int lane_idx) {
        static_assert(Config::kRowBlocks <= 2, "TileState holds two row blocks' weights");
        TileState state{};
#pragma unroll
        for (int block = 0; block < Config::kRowBlocks; ++block) {
            state.row_weights[block] =
                load_row_weights(mainloop, params, tile, first_row_block + block, warp_idx, lane_idx);
        }
        return state;
    }
    // Starts the L2 prefetch of the g, u row segments that `tile` reads in its epilogue, a whole mainloop later
    // (thread t: rows t / 2 and t / 2 + 64, g or u by t % 2; kBlockN columns, fewer at the end of I).
    template <class Config>
    __device__ __forceinline__ static void producer_tile(const MainloopParams& mainloop, const Params& params,
                                                         const Tile& tile, int thread_idx) {
        constexpr int kRowsPerPass = kWarpgroupThreads / 2;  // two threads (g, u) per row
        static_assert(kBlockM % kRowsPerPass == 0, "the producer prefetches the tile's rows in whole passes");
        const int64_t first_col = tile.n_tile_idx * Config::kBlockN;
        if (first_col >= mainloop.n) return;
        const auto num_bytes =
            static_cast<uint32_t>(min(static_cast<int64_t>(Config::kBlockN), mainloop.n - first_col) * kElemBytes);
#pragma unroll
        for (int pass = 0; pass < kBlockM / kRowsPerPass; ++pass) {
            const int local_row = pass * kRowsPerPass + thread_idx / 2;
            if (local_row >= tile.num_rows) break;
            const int64_t row_idx = tile.row_begin + local_row;
            const auto* h_row = static_cast<const uint16_t*>(params.h) + row_idx * 2 * mainloop.n;
            prefetch_l2_bulk(h_row + (thread_idx % 2) * mainloop.n + first_col, num_bytes);
        }
    }
    template <typename T, class Config, int kLocalBlock, int kNumRegs>
    __device__ __forceinline__ static void store(const CUtensorMap*, const MainloopParams& mainloop,
                                                 const Params& params, const Tile& tile, const float (&acc)[kNumRegs],
                                                 const TileState& state, uint32_t, int row_block, int warp_idx,
                                                 int lane_idx) {
        store_tile_dswiglu<T, Act, kInterleaved, Config, kLocalBlock * Config::kBlockRegs>(
            mainloop, params, tile, acc, state.row_weights[kLocalBlock], row_block, warp_idx, lane_idx);
    }
};
using DSwiGLUEpilogue = DSwiGLUEpilogueOf<SwiGLUActivation, false>;

}  // namespace megamoe::sm90::m_grouped
