// Blockwise FP8 quantization kernels: the rules of python/megamoe/fp8_reference.py, bit for bit.
//   quantize_groups  rows of a matrix in groups of 128 consecutive columns (the activations' 1 x 128 tiles along the
//                    GEMM's K): per group amax = max |v| (f32), scale = amax / 448 (IEEE division) or, pow2, the
//                    smallest power of two at least that, raised to 2^-149 at the least; q = e4m3(clamp(v * factor,
//                    +-448)), round to nearest even, factor = 448 / amax (IEEE division; pow2: 1 / scale), at most
//                    the largest finite f32 (DeepSeek-V3's cast). A group of zeros: scale 1. A group holding a NaN or
//                    an infinity: scale NaN and every q the byte 0x7F.
// quantize_groups: bf16 / f16 rows whose cols and stride are multiples of 8 (16-byte aligned): one warp per row, half
// a warp per group, 8 columns per lane by one 16-byte load and one 8-byte store, 4 chunks of 256 columns in flight
// (the passes over x, dy and dh; the earlier warp-per-group kernel ran them at ~1 TB/s: a 64-bit division per group
// and lane). Otherwise one warp per group, 4 columns per lane (a partial last group reads and writes only its
// columns); where cols and the row stride are multiples of 4 (and in, q aligned to 4 elements) a lane's 4 columns by
// one vector load and one 32-bit store, two groups per warp in flight.
//   quantize_blocks  weights [E, N, K] in 128 x 128 blocks (partial at the edges): the same rules over a block's
//                    elements, q [E, N, K] and, where asked, its transpose q_t [E, K, N] (the data gradients' K-major
//                    operand: a square block's transpose has the same scale), scales [E, ceil(N / 128), ceil(K / 128)].
// quantize_blocks: one block of 256 threads per 128 x 128 block, 64 elements a thread. Whole blocks where N and K are
// multiples of 16 and in, q, q_t are 16-byte aligned (every block of the reference models' weights): a kernel per
// input dtype, the 64 elements by 16-byte loads all in flight before any is used (<= 64 registers for bf16 / f16: 4
// blocks an SM, 128 KB of loads in flight), the bytes staged in a swizzled 16 KB shared tile and stored 16 bytes at a
// time (q's rows and q_t's, transposed by byte permutes). The partial blocks at the edges (and every block otherwise):
// a second, scalar kernel, element by element.
// Built for sm_90a alone (CMakeLists.txt: megamoe_fp8_quant), as FP8_BLOCKWISE runs on compute capability 9.0 GPUs
// only: on another device a launch returns NOT_SUPPORTED.
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
};
megamoe_status_t launch_quantize_groups(const QuantizeGroupsArgs& args, cudaStream_t stream);

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
