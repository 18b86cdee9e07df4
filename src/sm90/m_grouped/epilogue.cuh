// Epilogues of the fused Hopper M-grouped GEMM (m_grouped/gemm.cu) as policy types, each owning its params, its
// shared memory (kWarpStagingBytes), what it needs of the mainloop (kTmaA, kGateUpPairs, kGateUpHalves, the producer's
// per-tile hook), its per-tile state and its store of one 64-row block of the consumer's tile:
//   GatedEpilogue    (up)   h = [g, u] (+ b13) and / or a = act(g, u) from registers (store_tile, store_tile_paired);
//                    SwiGLUEpilogue is its default instantiation
//   StoreEpilogue    (down, dX) the accumulators (+ b2) in the element type, by TMA stores through shared memory where
//                    a warp's 16 rows lie inside the expert (store_tile_tma), else from registers (store_tile);
//   DSwiGLUEpilogue  (dH)   m_grouped/dswiglu.cuh.
// The store routines take the tile configuration (Config: its columns), the row block (tile rows [64 row_block,
// 64 row_block + 64)) and, at compile time, where the block's accumulators start in the consumer's registers
// (kFirstReg). m_grouped/tile_table.cuh's ConfigOf is the table of the tile configuration each policy runs with.
#pragma once

#include <type_traits>

#include "sm90/kit/fragment.cuh"
#include "device/cuda_utils.h"
#include "sm90/m_grouped/activation.cuh"
#include "sm90/m_grouped/scheduler.cuh"

namespace megamoe::sm90::m_grouped {

// The gated epilogue's compile-time options: the activation policy (m_grouped/activation.cuh), b13 added before it
// (kBias), and how a B tile pairs gate and up (kInterleaved: adjacent accumulator columns 2i, 2i + 1 hold g_i, u_i, as
// the interleaved layout stores them; else the tile's first half holds the gate rows and its second half the up rows).
template <class Act, bool kBiasAdded, bool kInterleavedPairs>
struct GatedOptions {
    using Activation = Act;
    static constexpr bool kBias = kBiasAdded;
    static constexpr bool kInterleaved = kInterleavedPairs;
};
using SwiGLUOptions = GatedOptions<SwiGLUActivation, false, false>;

// A bias pair (16-bit elements `col`, `col` + 1 of `row`, col even) in f32.
template <typename T>
__device__ __forceinline__ void load_bias_pair(const T* row, int64_t col, float& first, float& second) {
    cuda::unpack_pair<T>(*reinterpret_cast<const uint32_t*>(row + col), first, second);
}

// The interleaved epilogue's word order after its quad transpose (word q of lane c: elements q, 4 + q of chunk c) put
// in column order by two byte permutes per word pair.
__device__ __forceinline__ void interleaved_in_order(uint32_t (&words)[4]) {
    const uint32_t w0 = words[0], w1 = words[1], w2 = words[2], w3 = words[3];
    words[0] = __byte_perm(w0, w1, 0x5410);
    words[1] = __byte_perm(w2, w3, 0x5410);
    words[2] = __byte_perm(w0, w1, 0x7632);
    words[3] = __byte_perm(w2, w3, 0x7632);
}

// One 8-column chunk of a quad's gated outputs out: a (target.out, when not NULL) and, when kGated and target.h is not
// NULL, g and u into h = [g, u] (row stride 2 n). Each word set is quad-transposed (then put in column order when
// kInterleaved) before the stores, which only the lanes whose chunk is `valid` make.
template <typename T, bool kGated, bool kInterleaved, class Target>
__device__ __forceinline__ void store_gated_chunk(const Target& target, int64_t n, int64_t row_idx, int64_t col,
                                                  bool valid, int quad_lane, uint32_t (&out_words)[4],
                                                  uint32_t (&gate_words)[4], uint32_t (&up_words)[4]) {
    if (target.out != nullptr) {
        quad_transpose(out_words, quad_lane);
        if constexpr (kInterleaved) interleaved_in_order(out_words);
        if (valid) store_chunk(static_cast<T*>(target.out) + row_idx * target.ldo, col, out_words);
    }
    if constexpr (kGated) {
        if (target.h != nullptr) {
            quad_transpose(gate_words, quad_lane);
            quad_transpose(up_words, quad_lane);
            if constexpr (kInterleaved) {
                interleaved_in_order(gate_words);
                interleaved_in_order(up_words);
            }
            T* h_row = static_cast<T*>(target.h) + row_idx * 2 * n;
            if (valid) store_chunk(h_row, col, gate_words);
            if (valid) store_chunk(h_row + n, col, up_words);
        }
    }
}

// One row block from the wgmma accumulators (lane l of warp w holds rows 16 w + l / 4 (+ 8) of the block and, in
// fragment f, columns 8 f + 2 (l % 4) + {0, 1}). Groups of 4 fragments are transposed across each quad, then stored
// as 16-byte chunks: a warp writes 64 contiguous bytes of each of 8 rows per store.
// Gated (a GatedOptions, not interleaved): the accumulators are gate / up halves (target.h, when not NULL, gets both,
// b13 added when Gated::kBias, target.out a = act(g, u)); void: target.out gets them in the element type. target: the
// policy's params, read where they are (the kernel's parameter space, so their tests stay warp-uniform): out (row
// stride ldo, or NULL) and, gated, h ([rows, 2I] by sorted row, or NULL) and the activation's params.
template <typename T, class Gated, class Config, int kFirstReg, class Target, int kNumRegs>
__device__ __forceinline__ void store_tile(const MainloopParams& params, const Target& target, const Tile& tile,
                                           const float (&acc)[kNumRegs], int row_block, int warp_idx, int lane_idx) {
    constexpr bool kSwiGLU = !std::is_void_v<Gated>;
    constexpr int kNumFrags = Config::kBlockN / 8;
    static_assert(kFirstReg + Config::kBlockRegs <= kNumRegs, "the row block's accumulators are the consumer's");
    constexpr int kNumOutFrags = kSwiGLU ? kNumFrags / 2 : kNumFrags;  // 8-column fragments of the output
    constexpr int kFragsPerChunk = 4;
    static_assert(kNumOutFrags % kFragsPerChunk == 0, "output fragments come in quad-transposed groups of 4");
    const int quad_lane = AccFragment::quad_lane(lane_idx);
    const int first_row = row_block * kWgmmaM + warp_idx * AccFragment::kWarpRows + AccFragment::row_in_warp(lane_idx);
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
                const int reg_idx = kFirstReg + AccFragment::reg(group_idx * kFragsPerChunk + word_idx, half);
                if constexpr (kSwiGLU) {
                    using Act = typename Gated::Activation;
                    static_assert(!Gated::kInterleaved, "interleaved pairs: store_tile_paired");
                    const int up_reg_idx = reg_idx + kNumFrags / 2 * 4;
                    float gate0 = acc[reg_idx], gate1 = acc[reg_idx + 1];
                    float up0 = acc[up_reg_idx], up1 = acc[up_reg_idx + 1];
                    if constexpr (Gated::kBias) {  // b13[e] of the pair's gate and up columns
                        const int64_t col = first_col + (group_idx * kFragsPerChunk + word_idx) * 8 + 2 * quad_lane;
                        if (row_valid && col < params.n) {
                            const T* bias = static_cast<const T*>(target.bias) + tile.expert_idx * 2 * params.n;
                            float gate_bias0, gate_bias1, up_bias0, up_bias1;
                            load_bias_pair(bias, col, gate_bias0, gate_bias1);
                            load_bias_pair(bias, params.n + col, up_bias0, up_bias1);
                            gate0 += gate_bias0;
                            gate1 += gate_bias1;
                            up0 += up_bias0;
                            up1 += up_bias1;
                        }
                    }
                    out_words[word_idx] =
                        cuda::pack_pair<T>(Act::forward(target, gate0, up0), Act::forward(target, gate1, up1));
                    gate_words[word_idx] = cuda::pack_pair<T>(gate0, gate1);
                    up_words[word_idx] = cuda::pack_pair<T>(up0, up1);
                } else {
                    out_words[word_idx] = cuda::pack_pair<T>(acc[reg_idx], acc[reg_idx + 1]);
                }
            }
            const int64_t col = first_col + (group_idx * kFragsPerChunk + quad_lane) * 8;
            store_gated_chunk<T, kSwiGLU, false>(target, params.n, row_idx, col, row_valid && col < params.n, quad_lane,
                                                 out_words, gate_words, up_words);
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

// The gated epilogue of interleaved pairs (Gated::kInterleaved): accumulator columns 2i, 2i + 1 of the B tile are
// g_i, u_i (lane q of a quad, fragment f: the pair of output column 4 f + q), so each lane computes one output per
// fragment and row. A group of 8 fragments covers 32 output columns, 4 chunks of 8; lane q packs the values of
// fragments 2c, 2c + 1 (elements q and 4 + q of chunk c) into word c, the quad transpose hands lane c chunk c's words
// (word q: elements q, 4 + q), and two byte permutes per word pair put them in column order. h = [g, u] by sorted
// row (the canonical order, as saved_h keeps it); b13 (interleaved, as the B tile's columns) added when Gated::kBias.
template <typename T, class Gated, class Config, int kFirstReg, class Target, int kNumRegs>
__device__ __forceinline__ void store_tile_paired(const MainloopParams& params, const Target& target, const Tile& tile,
                                                  const float (&acc)[kNumRegs], int row_block, int warp_idx,
                                                  int lane_idx) {
    using Act = typename Gated::Activation;
    constexpr int kNumFrags = Config::kBlockN / 8;
    constexpr int kFragsPerGroup = 8;  // 32 output columns: 4 chunks of 8
    constexpr int kChunks = 4;
    static_assert(kFirstReg + Config::kBlockRegs <= kNumRegs, "the row block's accumulators are the consumer's");
    static_assert(kNumFrags % kFragsPerGroup == 0, "paired fragments come in groups of 8");
    const int quad_lane = AccFragment::quad_lane(lane_idx);
    const int first_row = row_block * kWgmmaM + warp_idx * AccFragment::kWarpRows + AccFragment::row_in_warp(lane_idx);
    const int64_t first_col = tile.n_tile_idx * (Config::kBlockN / 2);  // output columns
    const int64_t first_b_col = tile.n_tile_idx * Config::kBlockN;      // B tile (and b13) columns
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int local_row = first_row + half * 8;
        const bool row_valid = local_row < tile.num_rows;
        const int64_t row_idx = tile.row_begin + local_row;
#pragma unroll
        for (int group_idx = 0; group_idx < kNumFrags / kFragsPerGroup; ++group_idx) {
            uint32_t out_words[kChunks], gate_words[kChunks], up_words[kChunks];
#pragma unroll
            for (int chunk = 0; chunk < kChunks; ++chunk) {
                float gate[2], up[2], out[2];
#pragma unroll
                for (int item = 0; item < 2; ++item) {
                    const int frag_idx = group_idx * kFragsPerGroup + chunk * 2 + item;
                    const int reg_idx = kFirstReg + AccFragment::reg(frag_idx, half);
                    gate[item] = acc[reg_idx];
                    up[item] = acc[reg_idx + 1];
                    if constexpr (Gated::kBias) {
                        const int64_t b_col = first_b_col + frag_idx * 8 + 2 * quad_lane;
                        if (row_valid && b_col < 2 * params.n) {
                            const T* bias = static_cast<const T*>(target.bias) + tile.expert_idx * 2 * params.n;
                            float gate_bias, up_bias;
                            load_bias_pair(bias, b_col, gate_bias, up_bias);
                            gate[item] += gate_bias;
                            up[item] += up_bias;
                        }
                    }
                    out[item] = Act::forward(target, gate[item], up[item]);
                }
                out_words[chunk] = cuda::pack_pair<T>(out[0], out[1]);
                gate_words[chunk] = cuda::pack_pair<T>(gate[0], gate[1]);
                up_words[chunk] = cuda::pack_pair<T>(up[0], up[1]);
            }
            const int64_t col = first_col + group_idx * 32 + quad_lane * 8;
            store_gated_chunk<T, true, true>(target, params.n, row_idx, col, row_valid && col < params.n, quad_lane,
                                             out_words, gate_words, up_words);
        }
    }
}

// b2[e] added to one row block's accumulators (both rows of the thread, columns of the tile below n) before they are
// stored: the down GEMM's o = W2[e] a + b2[e].
template <typename T, class Config, int kFirstReg, int kNumRegs>
__device__ __forceinline__ void add_row_bias(const MainloopParams& params, const void* bias, const Tile& tile,
                                             float (&acc)[kNumRegs], int lane_idx) {
    constexpr int kNumFrags = Config::kBlockN / 8;
    if (tile.num_rows == 0) return;
    const T* bias_row = static_cast<const T*>(bias) + tile.expert_idx * params.n;
#pragma unroll
    for (int frag_idx = 0; frag_idx < kNumFrags; ++frag_idx) {
        const int64_t col = tile.n_tile_idx * Config::kBlockN + frag_idx * 8 + AccFragment::first_col(lane_idx);
        if (col < params.n) {
            float first, second;
            load_bias_pair(bias_row, col, first, second);
            const int reg_idx = kFirstReg + AccFragment::reg(frag_idx, 0);
            acc[reg_idx] += first;
            acc[reg_idx + 1] += second;
            acc[reg_idx + 2] += first;
            acc[reg_idx + 3] += second;
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// The policies. Each derives from EpiloguePolicy<kTmaA, kGateUpPairs, kGateUpHalves, kWarpStagingBytes>, what it asks
// of the
// kernel: kTmaA (A is the sorted rows themselves, loaded by TMA boxes, else rows gathered by cp.async); kGateUpPairs (a
// B tile holds gate / up pairs: n counts the pairs, B_e has 2n rows); kGateUpHalves (the pairs as a box of gate rows
// and a box of the matching up rows, n apart; else the B tile is 2n's rows in storage order, interleaved);
// kWarpStagingBytes (per-warp shared memory, 0 for none: staging of TMA stores, dSwiGLU's sub-tile slots). Each has
// Params (its part of the kernel's argument), store (one row block) and name (the kernel's, in error messages); the
// base's hooks (no per-tile state, no tensor map, nothing at the end) stand unless it has its own: TileState with
// begin_tile (per consumer and tile, before its mainloop: it may issue loads into the warp's staging, free by then),
// prefetch_maps (thread 0 at start), finish (each consumer thread at the end).
struct NoTileState {};

template <bool kTmaAOperand, bool kGateUpPairTiles, bool kGateUpHalfBoxes, int kWarpStagingSmemBytes>
struct EpiloguePolicy {
    static constexpr bool kTmaA = kTmaAOperand;
    static constexpr bool kGateUpPairs = kGateUpPairTiles;
    static constexpr bool kGateUpHalves = kGateUpHalfBoxes;
    static constexpr int kWarpStagingBytes = kWarpStagingSmemBytes;
    static constexpr bool kStaging = kWarpStagingBytes > 0;
    static_assert(kGateUpPairs || !kGateUpHalves, "gate / up halves are a layout of gate / up pairs");

    using TileState = NoTileState;

    template <class Config, class Params>
    __device__ __forceinline__ static TileState begin_tile(const MainloopParams&, const Params&, const Tile&, int,
                                                           uint32_t, int, int) {
        return {};
    }
    template <class Params>
    __device__ __forceinline__ static void prefetch_maps(const Params&, const CUtensorMap*) {}
    __device__ __forceinline__ static void finish(int) {}
};

struct BiasParams {
    const void* bias;  // [E, n'] in the element type (b13: [E, 2I] arranged as w13's rows; b2: [E, H])
};
struct NoBiasParams {};
template <bool kBias>
using BiasParamsOf = std::conditional_t<kBias, BiasParams, NoBiasParams>;

// The up GEMM's epilogue for one GatedOptions (B = w13 read kNK, or kKN when w13 is stored transposed).
template <class Gated>
struct GatedEpilogue
    : EpiloguePolicy</*kTmaA*/ false, /*kGateUpPairs*/ true, !Gated::kInterleaved, /*kWarpStagingBytes*/ 0> {
    struct Params : Gated::Activation::Params, BiasParamsOf<Gated::kBias> {
        void* out;    // a = act(g, u) [rows, I], or NULL
        int64_t ldo;  // I
        void* h;      // h = [g, u] [rows, 2I] by sorted row (saved_h), or NULL
    };
    static constexpr const char* name(BLayout) { return "m_grouped_gemm_sm90[swiglu]"; }
    template <typename T, class Config, int kNumRegs>
    __device__ __forceinline__ static void store(const CUtensorMap*, const MainloopParams& mainloop,
                                                 const Params& params, const Tile& tile, const float (&acc)[kNumRegs],
                                                 const NoTileState&, uint32_t, int row_block, int warp_idx,
                                                 int lane_idx) {
        constexpr int kFirstReg = 0;  // the consumer's one row block
        if constexpr (Gated::kInterleaved) {
            store_tile_paired<T, Gated, Config, kFirstReg>(mainloop, params, tile, acc, row_block, warp_idx, lane_idx);
        } else {
            store_tile<T, Gated, Config, kFirstReg>(mainloop, params, tile, acc, row_block, warp_idx, lane_idx);
        }
    }
};
using SwiGLUEpilogue = GatedEpilogue<SwiGLUOptions>;

// kBias: b2[e] added to the accumulators before they are stored (the down GEMM). A is the sorted rows, by TMA.
template <bool kBias>
struct StoreEpilogueOf
    : EpiloguePolicy</*kTmaA*/ true, /*kGateUpPairs*/ false, /*kGateUpHalves*/ false, kStoreWarpStagingBytes> {
    struct Params : BiasParamsOf<kBias> {
        void* out;  // [rows, n], row stride ldo
        int64_t ldo;
        bool tma_store;  // the output's tensor map made: a warp's rows inside the expert go out by TMA
    };
    static constexpr const char* name(BLayout b_layout) {
        return b_layout == BLayout::kNK ? "m_grouped_gemm_sm90[store]" : "m_grouped_gemm_sm90[store, kn]";
    }
    // `warp_staging`: the warp's staging boxes (shared address). A TMA store cannot stop at the expert's end (the rows
    // after it are the next expert's first tile, another CTA's), so a warp whose rows cross it stores from registers.
    template <typename T, class Config, int kNumRegs>
    __device__ __forceinline__ static void store(const CUtensorMap* out_map, const MainloopParams& mainloop,
                                                 const Params& params, const Tile& tile, float (&acc)[kNumRegs],
                                                 const TileState&, uint32_t warp_staging, int row_block, int warp_idx,
                                                 int lane_idx) {
        constexpr int kFirstReg = 0;  // the consumer's one row block
        if constexpr (kBias) add_row_bias<T, Config, kFirstReg>(mainloop, params.bias, tile, acc, lane_idx);
        // The warp's first row of the tile, warp-uniform to the compiler (taken from lane 0), so the choice between TMA
        // and register stores needs no divergence handling around the register path's shuffles.
        const int warp_first_row = __shfl_sync(0xffffffffu, row_block * kWgmmaM + warp_idx * kTmaStoreRows, 0);
        if (params.tma_store && warp_first_row + kTmaStoreRows <= tile.num_rows) {
            store_tile_tma<T, Config, kFirstReg>(out_map, tile, acc, warp_staging, warp_first_row, lane_idx);
        } else {  // from registers, masked
            store_tile<T, void, Config, kFirstReg>(mainloop, params, tile, acc, row_block, warp_idx, lane_idx);
        }
    }
    __device__ __forceinline__ static void prefetch_maps(const Params& params, const CUtensorMap* out_map) {
        if (params.tma_store) prefetch_tensor_map(out_map);
    }
    __device__ __forceinline__ static void finish(int lane_idx) {
        if (lane_idx == 0) bulk_wait_group<0, false>();  // every TMA store complete before the CTA exits
    }
};
using StoreEpilogue = StoreEpilogueOf<false>;

}  // namespace megamoe::sm90::m_grouped
