// Shared tile machinery of the portable grouped GEMMs (grouped_gemm.cu: M-grouped, k_grouped_gemm.cu: K-grouped).
//
// Tiles: kBlockM x kBlockN x kBlockK = 128 x 128 x 32, 8 warps as 2 (M) x 4 (N), each warp owning a
// 64 x 32 sub-tile = 4 x 4 mma.sync m16n8k16 fragments with f32 accumulators in registers.
// Pipeline: kNumStages = 4 shared-memory stages filled by cp.async (or by element loads with zero
// fill when rows are not 16-byte aligned), one __syncthreads per K step.
// Shared memory (dynamic, 64 KiB): kNumStages x (A tile + B tile), 8 KiB each, in one of two layouts:
//   K-major  [128 rows][32 k]: 4 chunks of 16 bytes per row, chunk ^= (row / 2) % 4;
//   MN-major [32 k][128 cols]: 16 chunks per row, chunk ^= k % 8;
// both swizzles make every 8-row ldmatrix phase hit 8 distinct bank groups. K-major tiles feed
// ldmatrix, MN-major tiles ldmatrix.trans.
// Occupancy: the cp.async kernels are built for 2 blocks per SM (<= 128 registers, no spills; 2 x 64
// KiB of shared memory), which measured 1.3-1.6x faster than 1 block per SM on an H200.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "device/cuda_utils.h"
#include "portable/grouped_gemm.h"
#include "device/mma_sm80.h"

namespace megamoe::cuda::gemm_tile {

constexpr int kBlockM = kGemmBlockM;
constexpr int kBlockN = 128;
constexpr int kBlockK = 32;
constexpr int kNumStages = 4;
constexpr int kNumThreads = 256;
constexpr int kNumWarpsM = 2;
constexpr int kNumWarpsN = 4;
constexpr int kWarpM = kBlockM / kNumWarpsM;
constexpr int kWarpN = kBlockN / kNumWarpsN;
constexpr int kNumFragsM = kWarpM / 16;
constexpr int kNumFragsN = kWarpN / 8;
constexpr int kChunkElems = 8;  // one 16-byte chunk of 16-bit elements
constexpr int kTileElems = kBlockM * kBlockK;
constexpr int kSmemBytes = 2 * kNumStages * kTileElems * static_cast<int>(sizeof(uint16_t));
// Resident blocks per SM asked of ptxas: 2 caps registers at 128, which the cp.async kernels meet
// without spills; the element-load fallback needs a few more and keeps 1.
constexpr int kMinBlocksPerSmVec = 2;

// Loader roles: a K-major tile is 128 rows x 4 chunks, an MN-major tile 32 rows x 16 chunks.
constexpr int kKMajorChunksPerRow = kBlockK / kChunkElems;
constexpr int kKMajorRowsPerPass = kNumThreads / kKMajorChunksPerRow;
constexpr int kKMajorPasses = kBlockM / kKMajorRowsPerPass;
constexpr int kMNMajorChunksPerRow = kBlockN / kChunkElems;
constexpr int kMNMajorRowsPerPass = kNumThreads / kMNMajorChunksPerRow;
constexpr int kMNMajorPasses = kBlockK / kMNMajorRowsPerPass;

static_assert(kNumWarpsM * kNumWarpsN * kWarpSize == kNumThreads, "one warp per 64 x 32 sub-tile");
static_assert(kBlockM == kBlockN, "A and B tiles share one shared-memory tile shape");
static_assert(kBlockK == 32, "the K-major swizzle assumes 4 chunks per row");
static_assert(kMNMajorChunksPerRow == 16, "the MN-major swizzle assumes 16 chunks per row");
static_assert(kNumFragsN % 2 == 0, "B fragments are loaded two n8 fragments at a time");
static_assert(kBlockK % 16 == 0, "K steps of mma m16n8k16");
static_assert(kKMajorPasses * kKMajorRowsPerPass == kBlockM, "loader covers a K-major tile");
static_assert(kMNMajorPasses * kMNMajorRowsPerPass == kBlockK, "loader covers an MN-major tile");
static_assert(kNumStages >= 2, "cp.async pipeline needs at least two stages");

__device__ __forceinline__ int k_major_offset(int row, int chunk_idx) {
    return row * kBlockK + ((chunk_idx ^ ((row >> 1) & 3)) * kChunkElems);
}

__device__ __forceinline__ int mn_major_offset(int k_row, int chunk_idx) {
    return k_row * kBlockN + ((chunk_idx ^ (k_row & 7)) * kChunkElems);
}

// Columns [col, col + 8) of `row` into 16 bytes of shared memory; zeros past num_cols or for an
// invalid row (then `row` is only a mapped address, never read). kVec: one cp.async, which needs the
// row 16-byte aligned and num_cols % 8 == 0.
template <bool kVec>
__device__ __forceinline__ void load_chunk(uint16_t* shared_dst, const uint16_t* row, int64_t col, int64_t num_cols,
                                           bool row_valid) {
    if constexpr (kVec) {
        const bool valid = row_valid && col < num_cols;
        cp_async_16(shared_dst, valid ? row + col : row, valid);
    } else {
        uint32_t words[kChunkElems / 2];
        for (int pair_idx = 0; pair_idx < kChunkElems / 2; ++pair_idx) {
            const int64_t first = col + 2 * pair_idx;
            const uint32_t lo = row_valid && first < num_cols ? row[first] : 0;
            const uint32_t hi = row_valid && first + 1 < num_cols ? row[first + 1] : 0;
            words[pair_idx] = lo | (hi << 16);
        }
        *reinterpret_cast<uint4*>(shared_dst) = make_uint4(words[0], words[1], words[2], words[3]);
    }
}

// A pair of adjacent outputs (col, col + 1) of one row; `paired` means one aligned 8-byte store.
__device__ __forceinline__ void store_pair(float* row, int64_t col, int64_t num_cols, float first, float second,
                                           bool paired) {
    if (paired && col + 1 < num_cols) {
        *reinterpret_cast<float2*>(row + col) = make_float2(first, second);
        return;
    }
    if (col < num_cols) row[col] = first;
    if (col + 1 < num_cols) row[col + 1] = second;
}

// store_pair's f32 outputs added to the values already there: row[col] += first, row[col + 1] += second.
__device__ __forceinline__ void accumulate_pair(float* row, int64_t col, int64_t num_cols, float first, float second,
                                                bool paired) {
    if (paired && col + 1 < num_cols) {
        float2* pair = reinterpret_cast<float2*>(row + col);
        const float2 before = *pair;
        *pair = make_float2(before.x + first, before.y + second);
        return;
    }
    if (col < num_cols) row[col] = row[col] + first;
    if (col + 1 < num_cols) row[col + 1] = row[col + 1] + second;
}

template <typename T>
__device__ __forceinline__ void store_pair(T* row, int64_t col, int64_t num_cols, float first, float second,
                                           bool paired) {
    if (paired && col + 1 < num_cols) {
        *reinterpret_cast<uint32_t*>(row + col) = pack_pair<T>(first, second);
        return;
    }
    if (col < num_cols) row[col] = from_float<T>(first);
    if (col + 1 < num_cols) row[col + 1] = from_float<T>(second);
}

// The warp's A fragments of one k16 step: from a K-major tile (ldmatrix) or an MN-major one (.trans).
template <bool kMNMajor>
__device__ __forceinline__ void load_a_frags(uint32_t (&a_frags)[kNumFragsM][4], const uint16_t* tile, int warp_m_idx,
                                             int k_step, int lane_idx) {
    for (int frag_m = 0; frag_m < kNumFragsM; ++frag_m) {
        const int m_base = warp_m_idx * kWarpM + frag_m * 16;
        if constexpr (kMNMajor) {
            const int k_row = k_step + lane_idx % 8 + (lane_idx / 16) * 8;
            const int chunk_idx = m_base / kChunkElems + (lane_idx / 8) % 2;
            ldmatrix_x4_trans(a_frags[frag_m], tile + mn_major_offset(k_row, chunk_idx));
        } else {
            const int row = m_base + lane_idx % 16;
            const int chunk_idx = k_step / kChunkElems + lane_idx / 16;
            ldmatrix_x4(a_frags[frag_m], tile + k_major_offset(row, chunk_idx));
        }
    }
}

// The warp's B fragments of one k16 step, two n8 fragments per ldmatrix.x4.
template <bool kMNMajor>
__device__ __forceinline__ void load_b_frags(uint32_t (&b_frags)[kNumFragsN][2], const uint16_t* tile, int warp_n_idx,
                                             int k_step, int lane_idx) {
    for (int frag_n = 0; frag_n < kNumFragsN; frag_n += 2) {
        const int n_base = warp_n_idx * kWarpN + frag_n * 8;
        uint32_t regs[4];
        if constexpr (kMNMajor) {
            const int k_row = k_step + lane_idx % 8 + ((lane_idx / 8) % 2) * 8;
            const int chunk_idx = n_base / kChunkElems + lane_idx / 16;
            ldmatrix_x4_trans(regs, tile + mn_major_offset(k_row, chunk_idx));
        } else {
            const int n_row = n_base + lane_idx % 8 + (lane_idx / 16) * 8;
            const int chunk_idx = k_step / kChunkElems + (lane_idx / 8) % 2;
            ldmatrix_x4(regs, tile + k_major_offset(n_row, chunk_idx));
        }
        b_frags[frag_n][0] = regs[0];
        b_frags[frag_n][1] = regs[1];
        b_frags[frag_n + 1][0] = regs[2];
        b_frags[frag_n + 1][1] = regs[3];
    }
}

// All mma of one shared-memory stage.
template <typename T, bool kAMNMajor, bool kBMNMajor>
__device__ __forceinline__ void compute_stage(float (&acc)[kNumFragsM][kNumFragsN][4], const uint16_t* tile_a,
                                              const uint16_t* tile_b, int warp_m_idx, int warp_n_idx, int lane_idx) {
    for (int k_step = 0; k_step < kBlockK; k_step += 16) {
        uint32_t a_frags[kNumFragsM][4];
        uint32_t b_frags[kNumFragsN][2];
        load_a_frags<kAMNMajor>(a_frags, tile_a, warp_m_idx, k_step, lane_idx);
        load_b_frags<kBMNMajor>(b_frags, tile_b, warp_n_idx, k_step, lane_idx);
        for (int frag_m = 0; frag_m < kNumFragsM; ++frag_m) {
            for (int frag_n = 0; frag_n < kNumFragsN; ++frag_n) {
                mma_16816<T>(acc[frag_m][frag_n], a_frags[frag_m], b_frags[frag_n]);
            }
        }
    }
}

// Host side.
// A row-major operand can use 16-byte cp.async when its base, its row stride and its loaded extent
// (columns are cut into 8-element chunks) are all multiples of 16 bytes / 8 elements.
inline bool vec_ok(const void* base, int64_t row_stride, int64_t num_cols) {
    return is_aligned(base, 16) && row_stride % kChunkElems == 0 && num_cols % kChunkElems == 0;
}

template <typename Kernel, typename Params>
megamoe_status_t launch(Kernel kernel, const Params& params, dim3 grid, cudaStream_t stream, const char* name) {
    MEGAMOE_CUDA_RETURN_IF_ERROR(
        check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes), name));
    kernel<<<grid, kNumThreads, kSmemBytes, stream>>>(params);
    return check_launch(name);
}

constexpr int64_t kMaxGridX = 0x7fffffff;
constexpr int64_t kMaxGridY = 65535;

}  // namespace megamoe::cuda::gemm_tile
