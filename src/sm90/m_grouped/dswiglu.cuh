// The dSwiGLU epilogue of the fused Hopper M-grouped GEMM (m_grouped/gemm.cu), the backward's dH: reads g, u,
// writes dh, s * a and the tile's partial sums of ds (store_tile_dswiglu), for an activation policy
// (m_grouped/activation.cuh) and an order of dh: [dg, du] by sorted row, or interleaved (dg_0, du_0, dg_1, ...: the
// interleaved layout's row order, which the dX and dW13 GEMMs read as w13 stores its rows).
#pragma once

#include "sm90/kit/fragment.cuh"
#include "sm90/m_grouped/epilogue.cuh"
#include "sm90/m_grouped_gemm_sm90.h"

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

// dSwiGLU of one element, the math every dH epilogue runs: p = (W2[e]^T dy)[column], s the row's weight, g, u the
// column's gate and up. da = s p; (a, dg, du) from the activation policy; ds += p a (one fma, in the caller's order);
// scaled_act = s a.
template <class Act>
__device__ __forceinline__ void dswiglu_element(const DSwiGLUParamsOf<Act>& epilogue, float gate, float up, float p,
                                                float weight, float& ds, float& d_gate, float& d_up,
                                                float& scaled_act) {
    float activation;
    Act::backward(epilogue, gate, up, weight * p, activation, d_gate, d_up);
    ds = fmaf(p, activation, ds);
    scaled_act = weight * activation;
}

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
    const int first_row = row_block * kWgmmaM + warp_idx * AccFragment::kWarpRows + AccFragment::row_in_warp(lane_idx);
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

// The dSwiGLU epilogue's shared memory, per consumer warp (the policy's kWarpStagingBytes): slots of one sub-tile
// matrix, the warp's kDSwiGLUSubRows accumulator rows of the row block x kDSwiGLUSubCols 16-bit columns, 64-byte rows
// in the 64-byte swizzle (swizzle_64b_offset: TMA's SWIZZLE_64B of a 16 x 32 box). Slots 2 b and 2 b + 1 (buffer b)
// hold g and u of the sub-tiles with sub-tile index % 2 == b, so the next sub-tile's g, u are in flight while the
// current one is computed; the current buffer then takes its outputs dg, du, then s * a. Two buffers are 4 KiB a
// warp, the store epilogue's staging, so dH keeps the 4 pipeline stages (four buffers, three sub-tiles in flight for
// a stage, measured 9-12 % slower: docs/log/2026-12-06-dswiglu-buffers.md).
constexpr int kDSwiGLUBuffers = 2;
constexpr int kDSwiGLUSubRows = kWgmmaM / kWarpsPerWarpgroup;            // 16: a warp's rows of a row block
constexpr int kDSwiGLUSubCols = kSwizzle64RowBytes / kElemBytes;         // 32
constexpr int kDSwiGLUSlotBytes = kDSwiGLUSubRows * kSwizzle64RowBytes;  // 1 KiB
constexpr int kDSwiGLUChunksPerRow = kSwizzle64RowBytes / 16;            // 16-byte chunks per sub-tile row
constexpr int kDSwiGLURowsPerPass = kWarpSize / kDSwiGLUChunksPerRow;    // a warp's 16-byte accesses: rows per pass
constexpr int kDSwiGLUPasses = kDSwiGLUSubRows / kDSwiGLURowsPerPass;
constexpr int kDSwiGLUWarpStagingBytes = kDSwiGLUBuffers * 2 * kDSwiGLUSlotBytes;  // g, u slots per buffer
static_assert(kDSwiGLUWarpStagingBytes == kStoreWarpStagingBytes,
              "two buffers are the store epilogue's staging: the same stage count");
static_assert(kDSwiGLUSlotBytes % 512 == 0, "slots start on a 64-byte swizzle atom (8 rows of 64 bytes)");
static_assert(kDSwiGLUPasses * kDSwiGLURowsPerPass == kDSwiGLUSubRows, "a warp copies a slot in whole passes");
static_assert(kDSwiGLUSubCols % 16 == 0, "a sub-tile is whole 16 x 16 ldmatrix / stmatrix x4 blocks");

// The lane's 16-byte chunks of a sub-tile slot as a warp copies it (cp.async in, ld.shared out): pass p, row
// 8 p + l / 4 of the warp's 16, chunk l % 4 (a quad: one row's 64 bytes).
__device__ __forceinline__ int dswiglu_copy_row(int pass, int lane_idx) {
    return pass * kDSwiGLURowsPerPass + lane_idx / kDSwiGLUChunksPerRow;
}

// g, u of sub-tile `sub_tile` (tile columns [32 s, 32 s + 32)) of the warp's 16 rows from tile row warp_first_row on
// into buffer s % 2 of its slots at `staging`, by 16-byte cp.async (zero fill for rows past the tile's end and columns
// past I: I % 8 == 0, so a chunk is all in or all out), as one cp.async group of the thread.
template <class Config>
__device__ __forceinline__ void load_dswiglu_sub_tile(const MainloopParams& params, const void* h, const Tile& tile,
                                                      uint32_t staging, int warp_first_row, int sub_tile,
                                                      int lane_idx) {
    const int buffer = sub_tile % kDSwiGLUBuffers;
    const int chunk = lane_idx % kDSwiGLUChunksPerRow;
    const int64_t col = tile.n_tile_idx * Config::kBlockN + sub_tile * kDSwiGLUSubCols + chunk * 8;
    const auto* h_elems = static_cast<const uint16_t*>(h);
    const uint32_t gate_slot = staging + static_cast<uint32_t>(2 * buffer * kDSwiGLUSlotBytes);
#pragma unroll
    for (int pass = 0; pass < kDSwiGLUPasses; ++pass) {
        const int row = dswiglu_copy_row(pass, lane_idx);
        const bool valid = warp_first_row + row < tile.num_rows && col < params.n;
        const uint16_t* gate = valid ? h_elems + (tile.row_begin + warp_first_row + row) * 2 * params.n + col : h_elems;
        const uint32_t offset = swizzle_64b_offset(row, chunk);
        cp_async_16(gate_slot + offset, gate, valid);
        cp_async_16(gate_slot + kDSwiGLUSlotBytes + offset, valid ? gate + params.n : h_elems, valid);
    }
    cuda::cp_async_commit();
}

// dSwiGLU epilogue of one consumer warp's 16 rows of a row block (rows and fragments as in store_tile): acc = p =
// W2[e]^T dy of the tile's I columns, `staging` the warp's slots (shared address). Sub-tiles of 32 columns: g, u come
// by 16-byte cp.async into a buffer (zero fill for rows past the tile's end and columns past I), the next sub-tile's
// issued before the current one is read, and ldmatrix reads them straight into the accumulator layout; then ds += p a,
// da = s p, dg = da u sigmoid(g) (1 + g (1 - sigmoid(g))), du = da silu(g) (the activation policy), and dg, du, s a go
// back by stmatrix into the buffer and out by 16-byte loads from it and stores to global memory (interleaved dh: each
// lane's (dg, du) pairs stored from registers, 8 bytes per fragment). No quad transposes. dh may be h itself (in
// place): a sub-tile's g, u have landed before its dh is stored, and sub-tiles touch disjoint columns. Each lane sums
// its p a of each row in column order; the quad's partial sums (a fixed shuffle order) give the row's sum over the
// tile's columns. Columns past I hold p = 0 (B zero-filled) and read no h. kFirstLoaded: the first sub-tile's loads
// were issued when the tile started (begin_tile), so their latency hides under the mainloop.
template <typename T, class Act, bool kInterleaved, class Config, int kFirstReg, bool kFirstLoaded, int kNumRegs>
__device__ __forceinline__ void store_tile_dswiglu(const MainloopParams& params, const DSwiGLUParamsOf<Act>& epilogue,
                                                   const Tile& tile, const float (&acc)[kNumRegs],
                                                   const RowWeights& weights, uint32_t staging, int row_block,
                                                   int warp_idx, int lane_idx) {
    constexpr int kNumSubTiles = Config::kBlockN / kDSwiGLUSubCols;
    constexpr int kMatrixBlocks = kDSwiGLUSubCols / 16;  // 16 x 16 blocks (one x4 each) per sub-tile
    static_assert(Config::kBlockN % kDSwiGLUSubCols == 0, "the tile's columns are whole sub-tiles");
    static_assert(kNumSubTiles % kDSwiGLUBuffers == 0, "sub-tiles take the buffers in turn");
    static_assert(kFirstReg + Config::kBlockRegs <= kNumRegs, "the row block's accumulators are the consumer's");
    const int quad_lane = AccFragment::quad_lane(lane_idx);
    const int warp_first_row = row_block * kWgmmaM + warp_idx * kDSwiGLUSubRows;
    const int first_row = warp_first_row + AccFragment::row_in_warp(lane_idx);  // the lane's rows: + 0, + 8
    const int64_t first_col = tile.n_tile_idx * Config::kBlockN;
    const int64_t intermediate = params.n;
    T* dh = static_cast<T*>(epilogue.dh);
    T* act = static_cast<T*>(epilogue.act);
    auto row_valid = [&](int half) { return first_row + half * 8 < tile.num_rows; };  // the same for a quad's lanes
    auto row_idx = [&](int half) { return tile.row_begin + first_row + half * 8; };
    auto slot = [&](int slot_idx) { return staging + static_cast<uint32_t>(slot_idx * kDSwiGLUSlotBytes); };
    const int copy_chunk = lane_idx % kDSwiGLUChunksPerRow;  // the lane's chunks of a slot: dswiglu_copy_row
    auto copy_row = [&](int pass) { return dswiglu_copy_row(pass, lane_idx); };
    auto copy_col = [&](int sub_tile) { return first_col + sub_tile * kDSwiGLUSubCols + copy_chunk * 8; };
    // ldmatrix / stmatrix x4 of 16 x 16 block m: lane l addresses row l % 8 of matrix l / 8 (rows 8 (l / 8 % 2) ..,
    // columns 16 m + 8 (l / 16) ..), so register i is fragment 2 m + i / 2 of accumulator row half i % 2.
    const int matrix_row = lane_idx / 8 % 2 * 8 + lane_idx % 8;
    auto matrix_offset = [&](int block) { return swizzle_64b_offset(matrix_row, block * 2 + lane_idx / 16); };
    auto load_sub_tile = [&](int sub_tile) {
        load_dswiglu_sub_tile<Config>(params, epilogue.h, tile, staging, warp_first_row, sub_tile, lane_idx);
    };
    // 16-byte chunks, masked.
    auto store_slot = [&](uint32_t slot_addr, T* out, int64_t row_stride, int sub_tile) {
        const int64_t col = copy_col(sub_tile);
#pragma unroll
        for (int pass = 0; pass < kDSwiGLUPasses; ++pass) {
            const int row = copy_row(pass);
            uint32_t words[4];
            ld_shared_v4(slot_addr + swizzle_64b_offset(row, copy_chunk), words);
            if (warp_first_row + row < tile.num_rows && col < intermediate) {
                store_chunk(out + (tile.row_begin + warp_first_row + row) * row_stride, col, words);
            }
        }
    };
    float ds[2] = {0.0f, 0.0f};
    if constexpr (!kFirstLoaded) load_sub_tile(0);
#pragma unroll
    for (int sub_tile = 0; sub_tile < kNumSubTiles; ++sub_tile) {
        const int buffer = sub_tile % kDSwiGLUBuffers;
        if (sub_tile + 1 < kNumSubTiles) {  // the other buffer: its previous outputs were read out last sub-tile
            load_sub_tile(sub_tile + 1);
            cuda::cp_async_wait<1>();
        } else {
            cuda::cp_async_wait<0>();
        }
        __syncwarp();  // every lane's copies of this sub-tile have landed
        uint32_t gate_regs[kMatrixBlocks][4], up_regs[kMatrixBlocks][4];
#pragma unroll
        for (int block = 0; block < kMatrixBlocks; ++block) {
            ldmatrix_x4(slot(2 * buffer) + matrix_offset(block), gate_regs[block]);
            ldmatrix_x4(slot(2 * buffer + 1) + matrix_offset(block), up_regs[block]);
        }
        uint32_t dgate_regs[kMatrixBlocks][4], dup_regs[kMatrixBlocks][4], act_regs[kMatrixBlocks][4];
#pragma unroll
        for (int block = 0; block < kMatrixBlocks; ++block) {
#pragma unroll
            for (int matrix = 0; matrix < 4; ++matrix) {
                const int half = matrix % 2;
                const int frag_idx = sub_tile * 2 * kMatrixBlocks + block * 2 + matrix / 2;
                const int reg_idx = kFirstReg + AccFragment::reg(frag_idx, half);
                const float weight = weights.weight[half];
                float gate[2], up[2], d_gate[2], d_up[2], scaled_act[2];
                cuda::unpack_pair<T>(gate_regs[block][matrix], gate[0], gate[1]);
                cuda::unpack_pair<T>(up_regs[block][matrix], up[0], up[1]);
#pragma unroll
                for (int item_idx = 0; item_idx < 2; ++item_idx) {
                    dswiglu_element<Act>(epilogue, gate[item_idx], up[item_idx], acc[reg_idx + item_idx], weight,
                                         ds[half], d_gate[item_idx], d_up[item_idx], scaled_act[item_idx]);
                }
                if constexpr (kInterleaved) {  // dh positions 2i .. 2i + 3 of the pair's columns i, i + 1: 8 bytes
                    const int64_t frag_col = first_col + frag_idx * 8 + 2 * quad_lane;
                    if (row_valid(half) && frag_col < intermediate) {
                        store_words2(dh + row_idx(half) * 2 * intermediate, 2 * frag_col,
                                     cuda::pack_pair<T>(d_gate[0], d_up[0]), cuda::pack_pair<T>(d_gate[1], d_up[1]));
                    }
                } else {
                    dgate_regs[block][matrix] = cuda::pack_pair<T>(d_gate[0], d_gate[1]);
                    dup_regs[block][matrix] = cuda::pack_pair<T>(d_up[0], d_up[1]);
                }
                act_regs[block][matrix] = cuda::pack_pair<T>(scaled_act[0], scaled_act[1]);
            }
        }
        __syncwarp();                   // every lane's ldmatrix has read the buffer before stmatrix overwrites it
        if constexpr (!kInterleaved) {  // dg, du through the buffer's g, u slots
#pragma unroll
            for (int block = 0; block < kMatrixBlocks; ++block) {
                stmatrix_x4(slot(2 * buffer) + matrix_offset(block), dgate_regs[block]);
                stmatrix_x4(slot(2 * buffer + 1) + matrix_offset(block), dup_regs[block]);
            }
            __syncwarp();
#pragma unroll
            for (int half = 0; half < 2; ++half) {  // dg, du
                store_slot(slot(2 * buffer + half), dh + half * intermediate, 2 * intermediate, sub_tile);
            }
            __syncwarp();  // read out before s a overwrites the g slot
        }
#pragma unroll
        for (int block = 0; block < kMatrixBlocks; ++block) {
            stmatrix_x4(slot(2 * buffer) + matrix_offset(block), act_regs[block]);
        }
        __syncwarp();
        store_slot(slot(2 * buffer), act, intermediate, sub_tile);
        __syncwarp();  // read out before the next sub-tile's loads refill the buffer
    }
#pragma unroll
    for (int half = 0; half < 2; ++half) {  // the row's ds part
        ds[half] += __shfl_xor_sync(0xffffffffu, ds[half], 1);
        ds[half] += __shfl_xor_sync(0xffffffffu, ds[half], 2);
        if (row_valid(half) && quad_lane == 0) {
            epilogue.ds_parts[row_idx(half) * params.num_n_tiles + tile.n_tile_idx] = ds[half];
        }
    }
}

// dH's epilogue for an activation policy; kInterleaved: dh in the interleaved order (written elsewhere than h). Its
// staging: the sub-tile slots of store_tile_dswiglu.
template <class Act, bool kInterleaved>
struct DSwiGLUEpilogueOf
    : EpiloguePolicy</*kTmaA*/ false, /*kGateUpPairs*/ false, /*kGateUpHalves*/ false, kDSwiGLUWarpStagingBytes> {
    using Activation = Act;
    using Params = DSwiGLUParamsOf<Act>;
    static constexpr const char* name(BLayout) { return "m_grouped_gemm_sm90[dswiglu]"; }
    struct TileState {
        RowWeights row_weights;
    };

    // The rows' weights, and the g, u loads of the row block's first sub-tile into the warp's slots (free: the
    // previous tile's epilogue has read them out), so their latency hides under the mainloop.
    template <class Config>
    __device__ __forceinline__ static TileState begin_tile(const MainloopParams& mainloop, const Params& params,
                                                           const Tile& tile, int row_block, uint32_t warp_staging,
                                                           int warp_idx, int lane_idx) {
        TileState state{};
        state.row_weights = load_row_weights(mainloop, params, tile, row_block, warp_idx, lane_idx);
        load_dswiglu_sub_tile<Config>(mainloop, params.h, tile, warp_staging,
                                      row_block * kWgmmaM + warp_idx * kDSwiGLUSubRows, 0, lane_idx);
        return state;
    }
    template <typename T, class Config, int kNumRegs>
    __device__ __forceinline__ static void store(const CUtensorMap*, const MainloopParams& mainloop,
                                                 const Params& params, const Tile& tile, const float (&acc)[kNumRegs],
                                                 const TileState& state, uint32_t warp_staging, int row_block,
                                                 int warp_idx, int lane_idx) {
        store_tile_dswiglu<T, Act, kInterleaved, Config, 0, true>(mainloop, params, tile, acc, state.row_weights,
                                                                  warp_staging, row_block, warp_idx, lane_idx);
    }
};
using DSwiGLUEpilogue = DSwiGLUEpilogueOf<SwiGLUActivation, false>;

// The outputs a dH launch can take (`kernel`: the launcher, as the message names it): h, dh and act 16-byte aligned,
// an interleaved dh not written over h.
inline megamoe_status_t check_dswiglu_outputs(const DSwiGLUEpilogueArgs& args, const char* kernel) {
    if (!cuda::is_aligned(args.h, 16) || !cuda::is_aligned(args.dh, 16) || !cuda::is_aligned(args.act, 16)) {
        return set_error(MEGAMOE_STATUS_NOT_SUPPORTED, "%s: h, dh and act must be 16-byte aligned", kernel);
    }
    if (args.dh_interleaved && args.dh == args.h) {
        return set_error(MEGAMOE_STATUS_INTERNAL_ERROR, "%s: interleaved dh cannot go over h", kernel);
    }
    return MEGAMOE_STATUS_SUCCESS;
}

// The policy's params from a launch's arguments (m_grouped_gemm_sm90.h: the 16-bit and the FP8 dH launches).
template <class Act>
DSwiGLUParamsOf<Act> make_dswiglu_params(const DSwiGLUEpilogueArgs& args) {
    DSwiGLUParamsOf<Act> params{};
    params.h = args.h;
    params.dh = args.dh;
    params.act = args.act;
    params.ds_parts = args.ds_parts;
    params.weights = args.weights;
    params.weights_dtype = args.weights_dtype;
    if constexpr (Act::kClamped) {
        params.limit = args.activation.limit;
        params.alpha = args.activation.alpha;
    }
    return params;
}

}  // namespace megamoe::sm90::m_grouped
