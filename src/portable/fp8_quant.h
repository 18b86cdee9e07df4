// Blockwise FP8 quantization kernels (issue #20): the rules of python/megamoe/fp8_reference.py, bit for bit.
//   quantize_groups  rows of a matrix in groups of 128 consecutive columns (the activations' 1 x 128 tiles along the
//                    GEMM's K): per group amax = max |v| (f32), scale = amax / 448 (IEEE division) or, pow2, the
//                    smallest power of two at least that, raised to 2^-149 at the least; q = e4m3(clamp(v / scale,
//                    +-448)), round to nearest even. A group of zeros: scale 1. A group holding a NaN or an infinity:
//                    scale NaN and every q the byte 0x7F.
// One warp per group, 4 columns per lane (a partial last group reads and writes only its columns). Any sm_80+ GPU.
// TODO(#20): the along-token copies (groups of an expert's sorted rows), the weights' 128 x 128 blocks, and the
// quantization fused into the passes that already read x, dy, a and dh.
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

}  // namespace megamoe::cuda
