// The byte transpose of the FP8 backward (path/steps_fp8.cu): in [batch, rows, cols] -> out [batch, cols, rows], one
// byte an element (e4m3 weights: w13 [E, 2I, H] -> [E, H, 2I], w2 [E, H, I] -> [E, I, H]), when the caller's
// megamoe_fp8_experts_t leaves a transposed copy absent.
// One CTA of 256 threads per 128 x 128 tile (device/byte_tile.cuh): the tile's rows loaded in 16-byte chunks (8 lanes
// a 128-byte row) into a swizzled shared byte tile, each thread reading back a 16 x 4 block transposed by byte
// permutes and storing each of its 4 output rows' 16 bytes at once (8 lanes a 128-byte output row). A chunk whose
// 16 bytes are not all inside the matrix, or not 16-byte aligned (cols, rows or a pointer not a multiple of 16), goes
// byte by byte; every output byte is written exactly once, a plain copy: deterministic. Any extents (a partial tile
// at each edge, a batch of 1, zero extents: nothing to do).
// Built for sm_90a alone with the FP8 quantizers (CMakeLists.txt: megamoe_fp8_quant), as FP8_BLOCKWISE runs on
// compute capability 9.0 GPUs only: on another device a launch returns NOT_SUPPORTED.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common.h"

namespace megamoe::cuda {

struct TransposeBytesArgs {
    const uint8_t* in;  // [batch, rows, cols], contiguous
    uint8_t* out;       // [batch, cols, rows], contiguous; not overlapping in
    int64_t batch;
    int64_t rows;
    int64_t cols;
};
// INTERNAL_ERROR for NULL pointers with a non-empty matrix, negative extents or 2^31 tiles or more.
megamoe_status_t launch_transpose_bytes(const TransposeBytesArgs& args, cudaStream_t stream);

}  // namespace megamoe::cuda
