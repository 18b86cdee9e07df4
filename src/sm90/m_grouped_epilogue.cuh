// Epilogues of the fused Hopper M-grouped GEMM (grouped_gemm_sm90.cu) as policy types, each owning its params, its
// shared memory (kStaging), what it needs of the mainloop (kTmaA, kGateUpPairs, the producer's per-tile hook), its
// per-tile state and its store of one 64-row block of the consumer's tile:
//   SwiGLUEpilogue   (up)   h = [g, u] and / or a = silu(g) * u from registers (store_tile);
//   StoreEpilogue    (down, dX) the accumulators in the element type, by TMA stores through shared memory where a
//                    warp's 16 rows lie inside the expert (store_tile_tma), else from registers (store_tile);
//   DSwiGLUEpilogue  (dH)   reads g, u, writes dh, s * a and the tile's partial sums of ds (store_tile_dswiglu).
// The store routines take the tile configuration (Config: its columns), the row block (tile rows [64 row_block,
// 64 row_block + 64)) and, at compile time, where the block's accumulators start in the consumer's registers
// (kFirstReg). ConfigOf, at the end, is the table of the tile configuration each policy runs with.
#pragma once

#include "cuda/cuda_utils.h"
#include "sm90/m_grouped_config.cuh"

namespace megamoe::sm90::m_grouped {

// One row block from the wgmma accumulators (lane l of warp w holds rows 16 w + l / 4 (+ 8) of the block and, in
// fragment f, columns 8 f + 2 (l % 4) + {0, 1}). Groups of 4 fragments are transposed across each quad, then stored
// as 16-byte chunks: a warp writes 64 contiguous bytes of each of 8 rows per store.
// kSwiGLU: the accumulators are gate / up pairs (target.h, when not NULL, gets both, target.out a = silu(g) * u);
// else target.out gets them in the element type. target: the policy's params, read where they are (the kernel's
// parameter space, so their tests stay warp-uniform): out (row stride ldo, or NULL) and, for SwiGLU, h ([rows, 2I]
// by sorted row, or NULL).
template <typename T, bool kSwiGLU, class Config, int kFirstReg, class Target, int kNumRegs>
__device__ __forceinline__ void store_tile(const MainloopParams& params, const Target& target, const Tile& tile,
                                           const float (&acc)[kNumRegs], int row_block, int warp_idx, int lane_idx) {
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
            if (target.out != nullptr) {
                quad_transpose(out_words, quad_lane);
                if (valid) store_chunk(static_cast<T*>(target.out) + row_idx * target.ldo, col, out_words);
            }
            if constexpr (kSwiGLU) {
                if (target.h != nullptr) {
                    quad_transpose(gate_words, quad_lane);
                    quad_transpose(up_words, quad_lane);
                    T* h_row = static_cast<T*>(target.h) + row_idx * 2 * params.n;
                    if (valid) store_chunk(h_row, col, gate_words);
                    if (valid) store_chunk(h_row + params.n, col, up_words);
                }
            }
        }
    }
}

// The store epilogue, one consumer warp's 16 rows of a row block (tile rows [warp_first_row, warp_first_row + 16), all
// inside the expert) by TMA stores of 16 x 64 boxes through the warp's staging boxes at `staging`
// (store_warp_rows_tma); the output's tensor map clips the columns at n. The warp returns to its MMAs as soon as its
// last store is issued.
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

// dH's epilogue: what it reads and writes besides its accumulators p = W2[e]^T dy.
struct DSwiGLUParams {
    const void* h;        // [g, u] [rows, 2I] by sorted row
    void* dh;             // [dg, du] [rows, 2I] by sorted row (may be h: written in place)
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

__device__ __forceinline__ RowWeights load_row_weights(const MainloopParams& params, const DSwiGLUParams& epilogue,
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
template <typename T, class Config, int kFirstReg, int kNumRegs>
__device__ __forceinline__ void store_tile_dswiglu(const MainloopParams& params, const DSwiGLUParams& epilogue,
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
                epilogue.ds_parts[row_idx(half) * params.num_n_tiles + tile.n_tile_idx] = ds;
            }
            ds = 0.0f;
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// The policies. Each has: Params (its part of the kernel's argument); kTmaA (A is the sorted rows themselves, loaded
// by TMA boxes, else rows gathered by cp.async); kGateUpPairs (a B tile is gate rows + the matching up rows);
// kStaging (shared memory for TMA stores); TileState with begin_tile (per consumer and tile, before its mainloop);
// producer_tile (the producer, when it starts a tile); store (one row block); prefetch_maps (thread 0 at start),
// finish (each consumer thread at the end) and name (the kernel's, in error messages).

// The hooks of a policy that needs none: no per-tile state, no producer work, no tensor map, nothing at the end.
struct NoEpilogueHooks {
    struct TileState {};

    template <class Config, class Params>
    __device__ __forceinline__ static TileState begin_tile(const MainloopParams&, const Params&, const Tile&, int, int,
                                                           int) {
        return {};
    }
    template <class Config, class Params>
    __device__ __forceinline__ static void producer_tile(const MainloopParams&, const Params&, const Tile&, int) {}
    template <class Params>
    __device__ __forceinline__ static void prefetch_maps(const Params&, const CUtensorMap*) {}
    __device__ __forceinline__ static void finish(int) {}
};

struct SwiGLUEpilogue : NoEpilogueHooks {
    struct Params {
        void* out;    // a = silu(g) * u [rows, I], or NULL
        int64_t ldo;  // I
        void* h;      // h = [g, u] [rows, 2I] by sorted row (saved_h), or NULL
    };
    static constexpr bool kTmaA = false;
    static constexpr bool kGateUpPairs = true;
    static constexpr bool kStaging = false;
    static constexpr const char* name(BLayout) { return "m_grouped_gemm_sm90[swiglu]"; }
    template <typename T, class Config, int kLocalBlock, int kNumRegs>
    __device__ __forceinline__ static void store(const CUtensorMap*, const MainloopParams& mainloop,
                                                 const Params& params, const Tile& tile, const float (&acc)[kNumRegs],
                                                 const TileState&, uint32_t, int row_block, int warp_idx,
                                                 int lane_idx) {
        store_tile<T, true, Config, kLocalBlock * Config::kBlockRegs>(mainloop, params, tile, acc, row_block, warp_idx,
                                                                      lane_idx);
    }
};

struct StoreEpilogue : NoEpilogueHooks {
    struct Params {
        void* out;  // [rows, n], row stride ldo
        int64_t ldo;
        bool tma_store;  // the output's tensor map made: a warp's rows inside the expert go out by TMA
    };
    static constexpr bool kTmaA = true;
    static constexpr bool kGateUpPairs = false;
    static constexpr bool kStaging = true;
    static constexpr const char* name(BLayout b_layout) {
        return b_layout == BLayout::kNK ? "m_grouped_gemm_sm90[store]" : "m_grouped_gemm_sm90[store, kn]";
    }
    // `warp_staging`: the warp's staging boxes (shared address). A TMA store cannot stop at the expert's end (the rows
    // after it are the next expert's first tile, another CTA's), so a warp whose rows cross it stores from registers.
    template <typename T, class Config, int kLocalBlock, int kNumRegs>
    __device__ __forceinline__ static void store(const CUtensorMap* out_map, const MainloopParams& mainloop,
                                                 const Params& params, const Tile& tile, const float (&acc)[kNumRegs],
                                                 const TileState&, uint32_t warp_staging, int row_block, int warp_idx,
                                                 int lane_idx) {
        constexpr int kFirstReg = kLocalBlock * Config::kBlockRegs;
        // The warp's first row of the tile, warp-uniform to the compiler (taken from lane 0), so the choice between TMA
        // and register stores needs no divergence handling around the register path's shuffles.
        const int warp_first_row = __shfl_sync(0xffffffffu, row_block * kWgmmaM + warp_idx * kTmaStoreRows, 0);
        if (params.tma_store && warp_first_row + kTmaStoreRows <= tile.num_rows) {
            store_tile_tma<T, Config, kFirstReg>(out_map, tile, acc, warp_staging, warp_first_row, lane_idx);
        } else {  // from registers, masked
            store_tile<T, false, Config, kFirstReg>(mainloop, params, tile, acc, row_block, warp_idx, lane_idx);
        }
    }
    __device__ __forceinline__ static void prefetch_maps(const Params& params, const CUtensorMap* out_map) {
        if (params.tma_store) prefetch_tensor_map(out_map);
    }
    __device__ __forceinline__ static void finish(int lane_idx) {
        if (lane_idx == 0) bulk_wait_group<0, false>();  // every TMA store complete before the CTA exits
    }
};

struct DSwiGLUEpilogue : NoEpilogueHooks {
    using Params = DSwiGLUParams;
    static constexpr bool kTmaA = false;
    static constexpr bool kGateUpPairs = false;
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
        store_tile_dswiglu<T, Config, kLocalBlock * Config::kBlockRegs>(
            mainloop, params, tile, acc, state.row_weights[kLocalBlock], row_block, warp_idx, lane_idx);
    }
};

// The tile configuration of each policy, and the limit it hits (H200, qwen3-30b-a3b, 2026-12-01):
// - SwiGLU (up), store (down, dX): cooperative 128 x 256. Their epilogues are cheap (the up GEMM without its
//   epilogue: 1.37 -> 1.34 ms), the mainloop is the limit; 256 columns halve A's refills per FLOP against 128.
// - dSwiGLU (dH): cooperative 128 x 256 too. Its epilogue is a third of the kernel (dH 1.17-1.25 ms, without the
//   epilogue 0.77 ms: the dSwiGLU math ~0.3 ms, the h loads and the stores ~0.1 ms each), but ping-pong on 128 x 128
//   tiles measured slower (1.47 ms): the half-width tiles refill A twice as often and the mainloop, not the hidden
//   epilogue, sets the pace. TODO(#11): ping-pong on wider tiles (128 x 192: 192 accumulators per thread) for dH.
template <class Epilogue>
using ConfigOf = Cooperative;

}  // namespace megamoe::sm90::m_grouped
