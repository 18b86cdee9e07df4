// The FP8 up projection's epilogue : SwiGLU that writes a = silu(g) u quantized for the down GEMM, so no
// pass over a follows. a is rounded to the output type first (the bf16 value the 16-bit path would store, and stores
// here too where asked), then quantized in 1 x 128 groups along I by the recipe's rules (device/fp8_math.cuh): the
// bytes and scales are those launch_quantize_groups makes from that a, bit for bit. One tile's 128 output columns are
// one group of each of its rows (the rescaled 128 x 256 tile: kBlockN / 2 == 128, tiles start at multiples of 128).
// Lane q of a quad holds columns 8 f + 2 q, + 1 of fragment f of its two rows: the group's amax is a quad reduction;
// the pairs of 4 fragments are quad-transposed (as the 16-bit epilogue's stores) so that each lane stores 8 contiguous
// bytes (and 16 of a); the scale from lane 0.
// h = [g, u] by sorted row, as the 16-bit epilogue writes it (the same quad-transposed chunks), where asked.
#pragma once

#include <cstdint>

#include "sm90/kit/fragment.cuh"
#include "device/cuda_utils.h"
#include "device/fp8_math.cuh"
#include "sm90/m_grouped/epilogue.cuh"

namespace megamoe::sm90::m_grouped {

struct QuantizedSwiGLUEpilogue
    : EpiloguePolicy</*kTmaA*/ false, /*kGateUpPairs*/ true, /*kGateUpHalves*/ true, /*kWarpStagingBytes*/ 0> {
    using Activation = SwiGLUActivation;
    struct Params : Activation::Params {
        void* out;          // a [rows, I] in the element type, or NULL
        int64_t ldo;        // I
        void* h;            // [rows, 2I] by sorted row, or NULL
        uint8_t* act_q;     // a [rows, I] e4m3 bytes
        float* act_scales;  // [rows, I / 128]: the scale of row r's group g at act_scales[r * (I / 128) + g]
        bool pow2;          // power-of-two scales
    };
    static constexpr const char* name(BLayout) { return "m_grouped_gemm_sm90[swiglu, a quantized]"; }

    template <typename T, class Config, int kNumRegs>
    __device__ __forceinline__ static void store(const CUtensorMap*, const MainloopParams& mainloop,
                                                 const Params& params, const Tile& tile, const float (&acc)[kNumRegs],
                                                 const TileState&, uint32_t, int row_block, int warp_idx,
                                                 int lane_idx) {
        constexpr int kFirstReg = 0;  // the consumer's one row block
        constexpr int kNumFrags = Config::kBlockN / 8;
        constexpr int kOutFrags = kNumFrags / 2;  // a's 8-column fragments: gate fragment f, up fragment f + kOutFrags
        static_assert(kOutFrags * 8 == kFp8ScaleGroup, "a tile's output columns are one scale group");
        constexpr int kFragsPerChunk = 4;  // a quad transpose: 4 fragments' pairs into 8 columns per lane
        const int quad_lane = AccFragment::quad_lane(lane_idx);
        const int64_t groups_per_row = mainloop.n / kFp8ScaleGroup;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int local_row = row_block * kWgmmaM + warp_idx * AccFragment::kWarpRows +
                                  AccFragment::row_in_warp(lane_idx) + half * AccFragment::kHalfRows;
            const bool row_valid = local_row < tile.num_rows;
            const int64_t row_idx = tile.row_begin + local_row;
            uint32_t act_words[kOutFrags];  // a's bf16 pairs: the values a is stored as (and the quantizer reads back)
            cuda::PackedGroupStats<T> packed;
#pragma unroll
            for (int frag_idx = 0; frag_idx < kOutFrags; ++frag_idx) {
                const int reg_idx = kFirstReg + AccFragment::reg(frag_idx, half);
                float pair[2];
#pragma unroll
                for (int item = 0; item < 2; ++item) {
                    pair[item] = Activation::forward(params, acc[reg_idx + item], acc[reg_idx + item + kOutFrags * 4]);
                }
                act_words[frag_idx] = cuda::pack_pair<T>(pair[0], pair[1]);
                packed.add(act_words[frag_idx]);
            }
            packed.reduce_over_quad();
            const cuda::GroupStats stats = packed.stats();
            const float scale = cuda::group_scale(stats, params.pow2);
            const float factor = cuda::group_factor(stats, scale, params.pow2);
            uint8_t* q_row = params.act_q + row_idx * mainloop.n;
            T* out_row = static_cast<T*>(params.out) + row_idx * params.ldo;
            T* h_row = static_cast<T*>(params.h) + row_idx * 2 * mainloop.n;
            // 4 fragments at a time: their bf16 pairs quad-transposed into one 8-column chunk per lane (the shuffles
            // take every lane, so rows past the tile only skip the stores), then 8 bytes and 16 of a per lane.
#pragma unroll
            for (int group_idx = 0; group_idx < kOutFrags / kFragsPerChunk; ++group_idx) {
                uint32_t words[kFragsPerChunk];
#pragma unroll
                for (int word_idx = 0; word_idx < kFragsPerChunk; ++word_idx) {
                    words[word_idx] = act_words[group_idx * kFragsPerChunk + word_idx];
                }
                quad_transpose(words, quad_lane);
                const uint2 bytes = cuda::quantize_chunk<T>(words, factor, stats.non_finite);
                const int64_t col = tile.n_tile_idx * kFp8ScaleGroup + (group_idx * kFragsPerChunk + quad_lane) * 8;
                if (row_valid) {
                    *reinterpret_cast<uint2*>(q_row + col) = bytes;
                    if (params.out != nullptr) store_chunk(out_row, col, words);
                }
                if (params.h !=
                    nullptr) {  // h = [g, u]: the same fragments' gate and up pairs, as store_tile writes them
                    uint32_t gate_words[kFragsPerChunk], up_words[kFragsPerChunk];
#pragma unroll
                    for (int word_idx = 0; word_idx < kFragsPerChunk; ++word_idx) {
                        const int reg_idx = kFirstReg + AccFragment::reg(group_idx * kFragsPerChunk + word_idx, half);
                        gate_words[word_idx] = cuda::pack_pair<T>(acc[reg_idx], acc[reg_idx + 1]);
                        up_words[word_idx] =
                            cuda::pack_pair<T>(acc[reg_idx + kOutFrags * 4], acc[reg_idx + kOutFrags * 4 + 1]);
                    }
                    quad_transpose(gate_words, quad_lane);
                    quad_transpose(up_words, quad_lane);
                    if (row_valid) {
                        store_chunk(h_row, col, gate_words);
                        store_chunk(h_row + mainloop.n, col, up_words);
                    }
                }
            }
            if (row_valid && quad_lane == 0) params.act_scales[row_idx * groups_per_row + tile.n_tile_idx] = scale;
        }
    }
};

}  // namespace megamoe::sm90::m_grouped
