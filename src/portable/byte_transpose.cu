#include "portable/byte_transpose.h"

#include "device/byte_tile.cuh"
#include "device/cuda_utils.h"

namespace megamoe::cuda {
namespace {

constexpr int kLoadsPerThread = kByteTileSide * kByteTileChunks / kByteTileThreads;  // 16-byte chunks: 4
static_assert(kByteTileSide * kByteTileChunks % kByteTileThreads == 0, "whole 16-byte chunks per thread");

union Chunk {
    uint4 vector;
    uint8_t bytes[kByteTileChunk];
};

// Tile (batch, tile row, tile column) of blockIdx.x, the column fastest. kVector: rows and cols multiples of 16, `in`
// and `out` 16-byte aligned, so a chunk inside the matrix is one aligned 16-byte load or store; else byte by byte.
template <bool kVector>
__global__ void __launch_bounds__(kByteTileThreads) transpose_bytes_kernel(const TransposeBytesArgs args) {
    __shared__ __align__(16) uint8_t tile[kByteTileSide * kByteTileSide];
    // 32-bit: the launcher keeps batch * tile_rows * tile_cols below 2^31.
    const uint32_t tile_cols = static_cast<uint32_t>(ceil_div(args.cols, int64_t{kByteTileSide}));
    const uint32_t tile_rows = static_cast<uint32_t>(ceil_div(args.rows, int64_t{kByteTileSide}));
    const uint32_t tile_idx = blockIdx.x;
    const int64_t batch = tile_idx / (tile_rows * tile_cols);
    const int64_t first_row = int64_t{tile_idx / tile_cols % tile_rows} * kByteTileSide;
    const int64_t first_col = int64_t{tile_idx % tile_cols} * kByteTileSide;
    const unsigned thread_idx = threadIdx.x;

    // In: chunk i of the tile is row i / 8, bytes 16 (i % 8) .. + 15 (8 lanes a 128-byte row); every load issued
    // before the tile is written. Bytes outside the matrix are 0 (never stored).
    const uint8_t* const in = args.in + batch * args.rows * args.cols;
    Chunk chunks[kLoadsPerThread];
#pragma unroll
    for (int j = 0; j < kLoadsPerThread; ++j) {
        const unsigned i = j * kByteTileThreads + thread_idx;
        const int64_t row = first_row + i / kByteTileChunks;
        const int64_t col = first_col + i % kByteTileChunks * kByteTileChunk;
        chunks[j].vector = make_uint4(0, 0, 0, 0);
        if (row >= args.rows || col >= args.cols) continue;
        const uint8_t* source = in + row * args.cols + col;
        if constexpr (kVector) {
            chunks[j].vector = *reinterpret_cast<const uint4*>(source);
        } else {
#pragma unroll
            for (int k = 0; k < kByteTileChunk; ++k) {
                if (col + k < args.cols) chunks[j].bytes[k] = source[k];
            }
        }
    }
#pragma unroll
    for (int j = 0; j < kLoadsPerThread; ++j) {
        const unsigned i = j * kByteTileThreads + thread_idx;
        *reinterpret_cast<uint4*>(tile + byte_tile_offset(i / kByteTileChunks, i % kByteTileChunks * kByteTileChunk)) =
            chunks[j].vector;
    }
    __syncthreads();

    // Out: the thread's 16 x 4 block transposed, column first_col + c of the tile is output row first_col + c, its
    // 16 bytes output columns first_row .. + 15 (8 lanes a 128-byte output row).
    const TransposedBlock block = read_transposed_block(tile, thread_idx);
    const int64_t out_first = first_row + block.first_row;  // in the output's row of `rows` bytes
    if (out_first >= args.rows) return;
    uint8_t* const out = args.out + batch * args.cols * args.rows;
#pragma unroll
    for (int c = 0; c < kTransposeCols; ++c) {
        const int64_t out_row = first_col + block.first_col + c;
        if (out_row >= args.cols) break;
        Chunk column;
        column.vector = make_uint4(block.columns[c][0], block.columns[c][1], block.columns[c][2], block.columns[c][3]);
        uint8_t* target = out + out_row * args.rows + out_first;
        if constexpr (kVector) {
            *reinterpret_cast<uint4*>(target) = column.vector;
        } else {
#pragma unroll
            for (int k = 0; k < kByteTileChunk; ++k) {
                if (out_first + k < args.rows) target[k] = column.bytes[k];
            }
        }
    }
}

}  // namespace

megamoe_status_t launch_transpose_bytes(const TransposeBytesArgs& args, cudaStream_t stream) {
    if (args.batch < 0 || args.rows < 0 || args.cols < 0) {
        return set_error(MEGAMOE_STATUS_INTERNAL_ERROR, "transpose_bytes: extents >= 0");
    }
    if (args.batch == 0 || args.rows == 0 || args.cols == 0) return MEGAMOE_STATUS_SUCCESS;
    if (args.in == nullptr || args.out == nullptr) {
        return set_error(MEGAMOE_STATUS_INTERNAL_ERROR, "transpose_bytes: in and out");
    }
    const int64_t num_tiles =
        args.batch * ceil_div(args.rows, int64_t{kByteTileSide}) * ceil_div(args.cols, int64_t{kByteTileSide});
    if (num_tiles > INT32_MAX) return set_error(MEGAMOE_STATUS_INTERNAL_ERROR, "transpose_bytes: 2^31 tiles or more");
    const bool vector = args.rows % kByteTileChunk == 0 && args.cols % kByteTileChunk == 0 &&
                        is_aligned(args.in, kByteTileChunk) && is_aligned(args.out, kByteTileChunk);
    const dim3 grid(static_cast<unsigned>(num_tiles));
    if (vector) {
        transpose_bytes_kernel<true><<<grid, kByteTileThreads, 0, stream>>>(args);
    } else {
        transpose_bytes_kernel<false><<<grid, kByteTileThreads, 0, stream>>>(args);
    }
    const cudaError_t err = cudaGetLastError();
    if (err == cudaErrorNoKernelImageForDevice) {
        return set_error(MEGAMOE_STATUS_NOT_SUPPORTED,
                         "transpose_bytes_kernel: runs on compute capability 9.0 GPUs only (built for sm_90a, with "
                         "the FP8 quantizers)");
    }
    if (err != cudaSuccess) {
        return set_error(MEGAMOE_STATUS_CUDA_ERROR, "transpose_bytes_kernel: %s", cudaGetErrorString(err));
    }
    return MEGAMOE_STATUS_SUCCESS;
}

}  // namespace megamoe::cuda
