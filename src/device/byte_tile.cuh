// The 128 x 128 tiles of the FP8 quantizer that stores a transposed copy (portable/fp8_quant.cu's weight blocks): the
// tile is loaded by 8 warps of 16 rows in 16-byte chunks
// (ByteTileLoads), its e4m3 bytes go into a byte tile in shared memory with 16-byte chunk c of row r at c ^ (r / 16)
// (byte_tile_offset: the writes and the transposing reads free of bank conflicts), and each of 256 threads reads back
// a 16 x 4 block of it and transposes it in registers by byte permutes (read_transposed_block), so that a column's
// 16 bytes go out in one store.
#pragma once

#include <cstdint>

#include "device/cuda_utils.h"

namespace megamoe::cuda {

constexpr int kByteTileSide = 128;                                     // rows and columns of the tile
constexpr int kByteTileChunk = 16;                                     // bytes per vector load and store
constexpr int kByteTileChunks = kByteTileSide / kByteTileChunk;        // 16-byte chunks of a byte-tile row: 8
constexpr int kByteTileSwizzleRows = kByteTileSide / kByteTileChunks;  // rows of one swizzle pattern: 16
constexpr int kByteTileThreads = 256;                                  // 8 warps
constexpr int kByteTileRowsPerWarp = kByteTileSide / (kByteTileThreads / kWarpSize);  // tile rows a warp loads: 16
constexpr int kTransposeRows = 16;  // bytes per column: one 16-byte store
constexpr int kTransposeCols = 4;   // columns: one 4-byte word per row
static_assert(kByteTileThreads == (kByteTileSide / kTransposeRows) * (kByteTileSide / kTransposeCols),
              "the transpose: one thread per 16 rows x 4 columns of the tile");
static_assert(kByteTileRowsPerWarp == kByteTileSwizzleRows && kTransposeRows == kByteTileSwizzleRows,
              "a warp's rows and a transposing thread's rows share one swizzle: row r + i at offset(r) + i rows");

// How the tile's T values are loaded: a warp load takes whole tile rows (2 rows of bf16 / f16, 1 of f32), so a
// thread's chunks share their columns.
template <typename T>
struct ByteTileLoads {
    static constexpr int kPerLoad = kByteTileChunk / static_cast<int>(sizeof(T));  // elements: 8 bf16 / f16, 4 f32
    static constexpr int kPerRow = kByteTileSide / kPerLoad;                       // loads per tile row: 16, 32
    static constexpr int kRowsPerLoad = kWarpSize / kPerRow;                       // rows per warp load: 2, 1
    static constexpr int kLoads = kByteTileRowsPerWarp / kRowsPerLoad;             // per thread: 8, 16
    static constexpr int kMinBlocks = sizeof(T) == 2 ? 4 : 2;                      // CTAs per SM: <= 64 / 128 registers
    static_assert(kWarpSize % kPerRow == 0 && kPerLoad % 4 == 0, "a warp load: whole rows, whole 4-byte words");
};

// Byte offset of (row, col) in the swizzled byte tile (col a multiple of 4: 4-byte words stay whole).
__device__ __forceinline__ unsigned byte_tile_offset(unsigned row, unsigned col) {
    return row * kByteTileSide + ((col / kByteTileChunk) ^ (row / kByteTileSwizzleRows)) * kByteTileChunk +
           col % kByteTileChunk;
}

// rows[i]: row i of the block, byte c its column c. columns[c][m]: rows 4 m .. 4 m + 3 of column c, row 4 m in the
// low byte, so columns[c] is column c's 16 bytes in row order.
__device__ __forceinline__ void transpose_16x4_bytes(const uint32_t (&rows)[kTransposeRows],
                                                     uint32_t (&columns)[kTransposeCols][kTransposeRows / 4]) {
#pragma unroll
    for (int m = 0; m < kTransposeRows / 4; ++m) {  // the 4 x 4 bytes of rows 4 m .. 4 m + 3
        const uint32_t low01 = __byte_perm(rows[4 * m], rows[4 * m + 1], 0x5140);   // columns 0, 1 of rows 0, 1
        const uint32_t high01 = __byte_perm(rows[4 * m], rows[4 * m + 1], 0x7362);  // columns 2, 3 of rows 0, 1
        const uint32_t low23 = __byte_perm(rows[4 * m + 2], rows[4 * m + 3], 0x5140);
        const uint32_t high23 = __byte_perm(rows[4 * m + 2], rows[4 * m + 3], 0x7362);
        columns[0][m] = __byte_perm(low01, low23, 0x5410);
        columns[1][m] = __byte_perm(low01, low23, 0x7632);
        columns[2][m] = __byte_perm(high01, high23, 0x5410);
        columns[3][m] = __byte_perm(high01, high23, 0x7632);
    }
}

// A thread's block of the byte tile, transposed: rows first_row .. + 15 (first_row = 16 (thread % 8): 8 lanes cover
// a column's 128 bytes), columns first_col .. + 3 (4 (thread / 8)); columns[c] column first_col + c's 16 bytes.
struct TransposedBlock {
    unsigned first_row, first_col;
    uint32_t columns[kTransposeCols][kTransposeRows / 4];
};
__device__ __forceinline__ TransposedBlock read_transposed_block(const uint8_t* tile, unsigned thread_idx) {
    TransposedBlock block;
    block.first_row = thread_idx % (kByteTileSide / kTransposeRows) * kTransposeRows;
    block.first_col = thread_idx / (kByteTileSide / kTransposeRows) * kTransposeCols;
    const uint8_t* const tile_words = tile + byte_tile_offset(block.first_row, block.first_col);
    uint32_t words[kTransposeRows];  // row first_row + i: columns first_col .. + 3, one byte each
#pragma unroll
    for (int i = 0; i < kTransposeRows; ++i) {
        words[i] = *reinterpret_cast<const uint32_t*>(tile_words + i * kByteTileSide);
    }
    transpose_16x4_bytes(words, block.columns);
    return block;
}

}  // namespace megamoe::cuda
