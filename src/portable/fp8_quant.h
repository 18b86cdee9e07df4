// Blockwise FP8 quantization kernels (issue #20): the rules of python/megamoe/fp8_reference.py, bit for bit.
//   quantize_groups  rows of a matrix in groups of 128 consecutive columns (the activations' 1 x 128 tiles along the
//                    GEMM's K): per group amax = max |v| (f32), scale = amax / 448 (IEEE division) or, pow2, the
//                    smallest power of two at least that, raised to 2^-149 at the least; q = e4m3(clamp(v * factor,
//                    +-448)), round to nearest even, factor = 448 / amax (IEEE division; pow2: 1 / scale), at most
//                    the largest finite f32 (DeepSeek-V3's cast). A group of zeros: scale 1. A group holding a NaN or
//                    an infinity: scale NaN and every q the byte 0x7F.
//   quantize_expert_rows  the weight gradients' operands along tokens: sorted rows (gathered from a token-major source
//                    or read as they are) in groups of 128 of an expert's rows from its first row (the routing's M
//                    tiles), written transposed and tile-padded for a K-grouped FP8 GEMM that loads its operands and
//                    scales by TMA (fp8_reference.quantize_expert_rows). M tile i of expert e (i in [m_tile_offsets[e],
//                    m_tile_offsets[e + 1]); its first sorted row first = expert_offsets[e] + (i - m_tile_offsets[e])
//                    * 128, rows = min(128, expert_offsets[e + 1] - first)) lies at columns [128 i, 128 i + 128) of
//                    q_t [cols, ld_q]: q_t[c * ld_q + 128 i + j] = the e4m3 byte of sorted row first + j, column c,
//                    for j < rows, and 0x00 for j in [rows, 128) (a zero pad: a GEMM reading a whole 128-column
//                    group sums nothing from it). Scales tile-major: scales[i * ld_scales + c] scales column c of
//                    tile i (its amax over the tile's `rows` values of column c). Tiles i >= m_tile_offsets[E] (up to
//                    max_tiles) are left untouched, in q_t and in scales.
// quantize_groups: bf16 / f16 rows whose cols and stride are multiples of 8 (16-byte aligned): one warp per row, half
// a warp per group, 8 columns per lane by one 16-byte load and one 8-byte store, 4 chunks of 256 columns in flight
// (the passes over x, dy and dh; the earlier warp-per-group kernel ran them at ~1 TB/s: a 64-bit division per group
// and lane). Otherwise one warp per group, 4 columns per lane (a partial last group reads and writes only its
// columns); where cols and the row stride are multiples of 4 (and in, q aligned to 4 elements) a lane's 4 columns by
// one vector load and one 32-bit store, two groups per warp in flight.
// quantize_expert_rows (its own file, fp8_quant_expert_rows.cu): one block of 256 threads per (M tile, 128 columns),
// the tile's values by 16-byte loads where cols is a multiple of 8 and the source rows are 16-byte aligned (element by
// element otherwise), the column amaxes by integer maxima of the magnitudes' bits, the bytes staged in a swizzled 16 KB
// shared tile and stored transposed, 16 bytes at a time (8 lanes: a 128-byte segment of a q_t row); with row_q, the
// same loads also give each source row's 1 x 128 groups (the CTA's 128 columns: one group), reduced over the lanes of
// the row and stored from the tile of its first routed slot (one pass over dy for dH and dW2). Any sm_80+ GPU.
// Not yet timed on a GPU: TODO(#20).
//   quantize_blocks  weights [E, N, K] in 128 x 128 blocks (partial at the edges): the same rules over a block's
//                    elements, q [E, N, K] and, where asked, its transpose q_t [E, K, N] (the data gradients' K-major
//                    operand: a square block's transpose has the same scale), scales [E, ceil(N / 128), ceil(K / 128)].
// quantize_blocks: one block of 256 threads per 128 x 128 block, 64 elements a thread. Whole blocks where N and K are
// multiples of 16 and in, q, q_t are 16-byte aligned (every block of the reference models' weights): a kernel per
// input dtype, the 64 elements by 16-byte loads all in flight before any is used (<= 64 registers for bf16 / f16: 4
// blocks an SM, 128 KB of loads in flight), the bytes staged in a swizzled 16 KB shared tile and stored 16 bytes at a
// time (q's rows and q_t's, transposed by byte permutes). The partial blocks at the edges (and every block otherwise):
// a second, scalar kernel, element by element. Not yet timed on a GPU after the vector loads: TODO(#20).
// TODO(#20): the quantization fused into the passes that already read x, dy, a and dh.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common.h"

namespace megamoe::cuda {

constexpr int kFp8GroupSize = 128;

struct QuantizeGroupsArgs {
    const void* in;            // [rows, cols] with row stride in_row_stride (elements)
    megamoe_dtype_t in_dtype;  // bf16, f16 or f32
    int64_t rows;
    int64_t cols;
    int64_t in_row_stride;
    uint8_t* q;     // [rows, cols] e4m3 bytes, contiguous
    float* scales;  // [rows, ceil(cols / 128)], contiguous
    bool pow2;      // power-of-two scales
    // Scattering (NULL: row r of q is row r of in): row r is routing slot r, read from in's row r / topk and written
    // to q's (and the scales') row slot_to_row[r], nothing for -1 (a dropped slot): x into sorted-row order.
    const int* slot_to_row;
    int64_t topk;
};
megamoe_status_t launch_quantize_groups(const QuantizeGroupsArgs& args, cudaStream_t stream);

struct QuantizeExpertRowsArgs {
    const void* in;            // [source rows, cols] with row stride in_row_stride (elements)
    megamoe_dtype_t in_dtype;  // bf16, f16 or f32
    int64_t cols;
    int64_t in_row_stride;
    const int* sorted_slot;  // sorted row r reads source row sorted_slot[r] / topk; NULL: source row r
    int64_t topk;
    const int* expert_offsets;  // [E + 1] sorted rows of expert e: [expert_offsets[e], expert_offsets[e + 1])
    const int* m_tile_offsets;  // [E + 1] exclusive scan of ceil(rows of e / 128)
    int64_t num_experts;
    int64_t max_tiles;  // host bound on m_tile_offsets[E]
    // [cols, ld_q] e4m3 bytes, 16-byte aligned: q_t[c * ld_q + 128 i + j] the byte of column c of row j of M tile i
    // (the tile's first sorted row + j), 0x00 for j past the tile's rows; the columns of tiles past m_tile_offsets[E]
    // untouched
    uint8_t* q_t;
    int64_t ld_q;  // >= 128 * max_tiles, a multiple of 16
    // [max_tiles, ld_scales] f32, 16-byte aligned: scales[i * ld_scales + c] of column c of M tile i (the rows of tiles
    // past m_tile_offsets[E] untouched)
    float* scales;
    int64_t ld_scales;  // >= cols, a multiple of 4
    bool pow2;
    // Also, where row_q is set, the source rows quantized along their columns in 1 x 128 groups (a data gradient's
    // operand, in the same pass: launch_quantize_groups' bytes and scales, bit for bit): row_q [source rows, cols]
    // e4m3 (row stride cols), row_scales [source rows, ceil(cols / 128)] f32, each source row written once, from the
    // tile of its first routed slot (the first j with slot_to_row[t * topk + j] >= 0; with sorted_slot NULL every
    // sorted row); rows no slot routes are left untouched. NULL: not.
    uint8_t* row_q = nullptr;
    float* row_scales = nullptr;
    const int* slot_to_row = nullptr;  // [source rows * topk]: slot -> sorted row, -1 when dropped
};
megamoe_status_t launch_quantize_expert_rows(const QuantizeExpertRowsArgs& args, cudaStream_t stream);

struct QuantizeBlocksArgs {
    const void* in;            // [E, N, K], contiguous
    megamoe_dtype_t in_dtype;  // bf16, f16 or f32
    int64_t num_experts;
    int64_t n;
    int64_t k;
    uint8_t* q;     // [E, N, K] e4m3 bytes
    uint8_t* q_t;   // [E, K, N] e4m3 bytes (the transpose), or NULL
    float* scales;  // [E, ceil(N / 128), ceil(K / 128)]
    bool pow2;
};
megamoe_status_t launch_quantize_blocks(const QuantizeBlocksArgs& args, cudaStream_t stream);

}  // namespace megamoe::cuda
