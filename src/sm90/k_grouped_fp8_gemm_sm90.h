// The blockwise FP8 K-grouped GEMM of the weight gradients on Hopper (sm_90a; k_grouped_fp8_gemm_sm90.cu), issue #20:
//     C_e[m, n] = sum over the tiles i of expert e of sa[i, m] * sb[i, n] * sum_{j < 128} A8[m, 128 i + j] * B8[n, 128
//     i + j]
// The reduction runs over the expert's sorted rows (tokens) in the routing's M tiles of 128 rows (tile i of expert e:
// i in [m_tile_offsets[e], m_tile_offsets[e + 1])), both operands quantized along those rows, 1 x 128 per tile and
// column, and stored transposed and tile-padded as launch_quantize_expert_rows writes them (portable/fp8_quant.h):
// A8 [M, ld_a] e4m3 bytes, tile i at columns [128 i, 128 i + 128) with zero bytes past the expert's rows; its scales
// [tiles, ld_scales_a] f32, row i holding the M columns' scales (the same for B with N). The counts stay on the device
// (m_tile_offsets), so the launch is capturable in a CUDA graph; each output tile loops over all of its expert's
// tiles in order (no split-K, no atomics: bitwise deterministic); an expert with no rows writes zeros (or,
// accumulating, leaves the output as it is).
//   dW13: A = dh quantized along its rows [2I, ...], B = x gathered and quantized [H, ...]; dW2: A = dy gathered [H,
//   ...], B = s * a [I, ...] (M, N swapped for the transposed layouts).
//
// Requirements (k_grouped_fp8_gemm_sm90_supported; the caller runs the 16-bit weight gradients otherwise): compute
// capability 9.0, M % 128 == 0 and N % 128 == 0, ld_a and ld_b multiples of 16 and >= 128 * max_tiles, the byte
// operands 16-byte aligned, ld_scales_a >= M and ld_scales_b >= N multiples of 4 with 16-byte aligned scales, out
// 16-byte aligned in bf16, f16 or f32 (accumulate: f32, C_e added to what out holds, one add per element).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common.h"

namespace megamoe::sm90 {

// One e4m3 operand quantized along the expert rows, transposed and tile-padded.
struct KGroupedFp8Operand {
    const uint8_t* q_t;   // [cols, ld] e4m3 bytes
    int64_t ld;           // >= 128 * max_tiles, a multiple of 16
    const float* scales;  // [max_tiles, ld_scales]: scales[i * ld_scales + c]
    int64_t ld_scales;    // >= cols, a multiple of 4
};

struct KGroupedFp8GemmArgs {
    KGroupedFp8Operand a;  // cols = m
    KGroupedFp8Operand b;  // cols = n
    int64_t m;
    int64_t n;
    const int* m_tile_offsets;  // [E + 1] the routing's 128-row tiles (exclusive scan of ceil(rows of e / 128))
    int64_t num_experts;
    int64_t max_tiles;  // host bound on m_tile_offsets[E]
    bool accumulate;    // out is f32 and holds values: C_e is added into it
};

bool k_grouped_fp8_gemm_sm90_supported(const KGroupedFp8GemmArgs& args, const void* out, megamoe_dtype_t out_dtype);

// C_e into out [E, M, N] (contiguous) of out_dtype (bf16, f16 or f32). `num_sms`: the persistent grid.
megamoe_status_t launch_k_grouped_fp8_gemm_sm90(const KGroupedFp8GemmArgs& args, void* out, megamoe_dtype_t out_dtype,
                                                int num_sms, cudaStream_t stream);

}  // namespace megamoe::sm90
