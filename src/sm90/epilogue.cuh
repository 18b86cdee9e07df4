// Register-to-global epilogue helpers shared by the sm_90a GEMM kernels: wgmma m64nNk16 accumulators (lane l of
// warp w of the warpgroup holds rows 16 w + l / 4 (+ 8) and, in 8-column fragment f, columns 8 f + 2 (l % 4) + {0,
// 1}) rearranged across each quad of lanes into 16-byte chunks (and back: the transpose is its own inverse), and the
// vector loads and stores.
#pragma once

#include <cstdint>

namespace megamoe::sm90 {

// Turns the 2-column pairs that the 4 lanes of a quad hold for 4 consecutive 8-column fragments (lane q: word f =
// columns 8 f + 2 q, + 1) into one 8-column chunk per lane (lane q: columns 8 q .. 8 q + 7): a 4 x 4 transpose
// across the quad in two butterfly steps, so each lane can store 16 contiguous bytes.
__device__ __forceinline__ void quad_transpose(uint32_t (&words)[4], int quad_lane) {
#pragma unroll
    for (int mask = 2; mask >= 1; mask /= 2) {
        const bool upper = (quad_lane & mask) != 0;
#pragma unroll
        for (int word_idx = 0; word_idx < 4; ++word_idx) {
            if ((word_idx & mask) != 0) continue;
            const uint32_t sent = upper ? words[word_idx] : words[word_idx | mask];
            const uint32_t received = __shfl_xor_sync(0xffffffffu, sent, mask);
            if (upper) {
                words[word_idx] = received;
            } else {
                words[word_idx | mask] = received;
            }
        }
    }
}

// 16 bytes at row + col (16-byte aligned), as one vector store.
template <typename T>
__device__ __forceinline__ void store_chunk(T* row, int64_t col, const uint32_t (&words)[4]) {
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(row + col), "r"(words[0]), "r"(words[1]),
                 "r"(words[2]), "r"(words[3])
                 : "memory");
}

// 16 bytes at row + col (16-byte aligned), as one vector load.
template <typename T>
__device__ __forceinline__ void load_chunk(const T* row, int64_t col, uint32_t (&words)[4]) {
    asm volatile("ld.global.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(words[0]), "=r"(words[1]), "=r"(words[2]), "=r"(words[3])
                 : "l"(row + col)
                 : "memory");
}

// Two f32 values at row + col (8-byte aligned), as one vector store.
__device__ __forceinline__ void store_pair_f32(float* row, int64_t col, float first, float second) {
    asm volatile("st.global.v2.f32 [%0], {%1, %2};\n" ::"l"(row + col), "f"(first), "f"(second) : "memory");
}

}  // namespace megamoe::sm90
