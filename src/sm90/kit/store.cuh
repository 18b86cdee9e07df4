// Epilogue helpers shared by the sm_90a GEMM kernels, for wgmma m64nNk16 accumulators (lane l of warp w of the
// warpgroup holds rows 16 w + l / 4 (+ 8) and, in 8-column fragment f, columns 8 f + 2 (l % 4) + {0, 1}):
//   from registers: accumulator pairs rearranged across each quad of lanes into 16-byte chunks (and back: the
//     transpose is its own inverse), and the vector loads and stores;
//   through shared memory: a warp's 16 rows staged 64 columns at a time with stmatrix in 128-byte swizzled boxes
//     (or, f32, 32 columns at a time by 8-byte shared stores) and written by TMA stores or reduce-adds
//     (store_warp_rows_tma, store_warp_rows_tma_f32), so the warp need not wait for its global writes.
#pragma once

#include <cstdint>

#include "sm90/kit/fragment.cuh"
#include "activation.h"
#include "device/cuda_utils.h"
#include "sm90/kit/ptx.h"

namespace megamoe::sm90 {

// A TMA store box: one warp's kTmaStoreRows accumulator rows x kTmaStoreCols 16-bit columns (one 128-byte swizzled
// row each, as the store's tensor map reads it); each warp owns kTmaStoreBuffers of them.
constexpr int kTmaStoreElemBytes = 2;  // bf16 / f16
constexpr int kTmaStoreRows = 16;
constexpr int kTmaStoreCols = kSwizzleBytes / kTmaStoreElemBytes;
constexpr int kTmaStoreBuffers = 2;
constexpr int kTmaStoreBoxBytes = kTmaStoreRows * kSwizzleBytes;
static_assert(kTmaStoreBoxBytes % kSwizzleAtomBytes == 0, "store boxes start on a swizzle atom");
static_assert(kTmaStoreBuffers >= 2, "a warp stages one chunk while the store of the previous one reads its box");

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

// The chunk loop of a warp's TMA-stored rows: for chunk c = 0 .. kNumChunks - 1, write_box(box, c) fills box c %
// kNumBoxes at shared address `staging` (kNumBoxes boxes of kTmaStoreBoxBytes, 1024-byte aligned); every lane fences
// its writes for the async proxy, and lane 0, once the store that last used the next chunk's box has read it (at most
// kNumBoxes - 2 later stores still reading theirs), calls store_box(box, c) to issue the chunk's TMA store and commits
// it as a bulk async-group. With 2 boxes each chunk waits for the previous chunk's store; with as many boxes as a tile
// has chunks, only for stores issued a tile earlier. The warp returns as soon as its last store is issued; the caller
// waits for the stores (bulk_wait_group<0, false>) before the CTA exits.
template <int kNumChunks, int kNumBoxes, typename WriteBox, typename StoreBox>
__device__ __forceinline__ void store_warp_chunks_tma(uint32_t staging, int lane_idx, const WriteBox& write_box,
                                                      const StoreBox& store_box) {
    static_assert(kNumBoxes >= 2, "a warp stages one chunk while the store of the previous one reads its box");
    static_assert(kNumChunks % kNumBoxes == 0, "the next call's first chunk starts again at box 0");
#pragma unroll
    for (int chunk = 0; chunk < kNumChunks; ++chunk) {
        const uint32_t box = staging + static_cast<uint32_t>(chunk % kNumBoxes * kTmaStoreBoxBytes);
        write_box(box, chunk);
        fence_proxy_async_shared();  // the box was written by the generic proxy, the store reads it (async proxy)
        if (lane_idx == 0) bulk_wait_group<kNumBoxes - 2, true>();  // the next chunk's box has been read
        __syncwarp();
        if (lane_idx == 0) {
            store_box(box, chunk);
            bulk_commit_group();
        }
    }
}

// One warp's kTmaStoreRows accumulator rows (element type T; its fragments from register kFirstReg on) by TMA stores
// of kNumChunks chunks of kTmaStoreCols columns (fragments 8 c .. 8 c + 7 of chunk c): the warp packs a chunk's
// accumulators and writes them with stmatrix into its box in the 128-byte swizzle of the store's tensor map (16-byte
// unit u of row r at u ^ r % 8), then store_warp_chunks_tma's box cycle.
template <typename T, int kNumChunks, int kFirstReg = 0, int kNumBoxes = kTmaStoreBuffers, int kNumRegs,
          typename StoreBox>
__device__ __forceinline__ void store_warp_rows_tma(const float (&acc)[kNumRegs], uint32_t staging, int lane_idx,
                                                    const StoreBox& store_box) {
    constexpr int kFragsPerChunk = kTmaStoreCols / 8;
    constexpr int kMatrixRows = 8;
    static_assert(kFirstReg + kNumChunks * kFragsPerChunk * 4 <= kNumRegs,
                  "the chunks lie inside the accumulator fragments");
    const int box_row = lane_idx / kMatrixRows % 2 * kMatrixRows + lane_idx % kMatrixRows;  // matrix l / 8: rows
    const int unit_offset = lane_idx / (2 * kMatrixRows);  // matrices 2, 3: the next fragment's 8 columns
    store_warp_chunks_tma<kNumChunks, kNumBoxes>(
        staging, lane_idx,
        [&](uint32_t box, int chunk) {
#pragma unroll
            for (int pair = 0; pair < kFragsPerChunk / 2; ++pair) {
                const int frag_idx = chunk * kFragsPerChunk + pair * 2;
                uint32_t regs[4];
#pragma unroll
                for (int matrix = 0; matrix < 4; ++matrix) {
                    regs[matrix] = cuda::pack_pair<T>(acc[kFirstReg + frag_idx * 4 + matrix * 2],
                                                      acc[kFirstReg + frag_idx * 4 + matrix * 2 + 1]);
                }
                stmatrix_x4(box + swizzle_128b_offset(box_row, pair * 2 + unit_offset), regs);
            }
        },
        store_box);
}

// The f32 counterpart: chunks of kTmaStoreF32Cols columns (fragments 4 c .. 4 c + 3), one 128-byte swizzled row of
// the box per accumulator row; lane l writes its pairs (row l / 4 and + 8, columns 8 f + 2 (l % 4)) as 8-byte
// shared stores (a warp's store: 8 rows x 32 bytes, two wavefronts), then store_warp_chunks_tma's box cycle; store_box
// may issue a store or a reduce-add (tma_reduce_add_3d) of the box.
constexpr int kTmaStoreF32Cols = kSwizzleBytes / 4;
template <int kNumChunks, int kFirstReg = 0, int kNumBoxes = kTmaStoreBuffers, int kNumRegs, typename StoreBox>
__device__ __forceinline__ void store_warp_rows_tma_f32(const float (&acc)[kNumRegs], uint32_t staging, int lane_idx,
                                                        const StoreBox& store_box) {
    constexpr int kFragsPerChunk = kTmaStoreF32Cols / 8;
    static_assert(kFirstReg + kNumChunks * kFragsPerChunk * 4 <= kNumRegs,
                  "the chunks lie inside the accumulator fragments");
    const int quad_lane = AccFragment::quad_lane(lane_idx);
    store_warp_chunks_tma<kNumChunks, kNumBoxes>(
        staging, lane_idx,
        [&](uint32_t box, int chunk) {
#pragma unroll
            for (int frag = 0; frag < kFragsPerChunk; ++frag) {
                const int reg_idx = kFirstReg + (chunk * kFragsPerChunk + frag) * 4;
                const int unit = frag * 2 + quad_lane / 2;  // 16-byte unit of the row: columns 8 frag + 2 q
                const uint32_t in_unit = static_cast<uint32_t>(quad_lane % 2 * 8);
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const int row = AccFragment::row_in_warp(lane_idx) + half * AccFragment::kHalfRows;
                    st_shared_v2_f32(box + swizzle_128b_offset(row, unit) + in_unit, acc[reg_idx + half * 2],
                                     acc[reg_idx + half * 2 + 1]);
                }
            }
        },
        store_box);
}

// Two f32 values at row + col (8-byte aligned), as one vector store.
__device__ __forceinline__ void store_pair_f32(float* row, int64_t col, float first, float second) {
    asm volatile("st.global.v2.f32 [%0], {%1, %2};\n" ::"l"(row + col), "f"(first), "f"(second) : "memory");
}

}  // namespace megamoe::sm90
