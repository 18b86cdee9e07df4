// A 16 x 4 block of bytes transposed in registers by byte permutes, for the kernels that store the transpose of a
// byte tile 16 bytes at a time (portable/fp8_quant.cu's weight blocks, fp8_quant_expert_rows.cu's along-token copies).
#pragma once

#include <cstdint>

namespace megamoe::cuda {

constexpr int kTransposeRows = 16;  // bytes per column: one 16-byte store
constexpr int kTransposeCols = 4;   // columns: one 4-byte word per row

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

}  // namespace megamoe::cuda
