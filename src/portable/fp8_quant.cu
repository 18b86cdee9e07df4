#include "portable/fp8_quant.h"

#include <cuda_fp8.h>

#include <algorithm>
#include <type_traits>

#include "device/byte_tile.cuh"
#include "device/cuda_utils.h"
#include "device/fp8_math.cuh"
#include "device/warp_reduce.cuh"

namespace megamoe::cuda {
namespace {

constexpr int kQuantThreads = 256;  // 8 groups per block, one per warp
constexpr int kColsPerLane = kFp8GroupSize / kWarpSize;
constexpr int64_t kMaxQuantBlocks = 65535;
static_assert(kColsPerLane == 4, "a lane quantizes 4 columns of its group (one 32-bit store of q)");

__global__ void __launch_bounds__(kQuantThreads) quantize_groups_kernel(const QuantizeGroupsArgs args) {
    const int lane_idx = static_cast<int>(threadIdx.x) % kWarpSize;
    const int64_t groups_per_row = ceil_div(args.cols, static_cast<int64_t>(kFp8GroupSize));
    const int64_t num_groups = args.rows * groups_per_row;
    const int64_t warps_per_grid = static_cast<int64_t>(gridDim.x) * (kQuantThreads / kWarpSize);
    for (int64_t group_idx =
             static_cast<int64_t>(blockIdx.x) * (kQuantThreads / kWarpSize) + static_cast<int>(threadIdx.x) / kWarpSize;
         group_idx < num_groups; group_idx += warps_per_grid) {
        const int64_t row_idx = group_idx / groups_per_row;  // warp-uniform
        const int64_t group_in_row = group_idx % groups_per_row;
        const int64_t first_col = group_in_row * kFp8GroupSize + lane_idx * kColsPerLane;
        float values[kColsPerLane];
        GroupStats stats;
#pragma unroll
        for (int i = 0; i < kColsPerLane; ++i) {
            const int64_t col = first_col + i;
            values[i] =
                col < args.cols ? load_scalar(args.in, args.in_dtype, row_idx * args.in_row_stride + col) : 0.0f;
            stats.add(values[i]);
        }
        stats.reduce_over_warp();
        const float scale = group_scale(stats, args.pow2);
        const float factor = group_factor(stats, scale, args.pow2);
        uint8_t* q_row = args.q + row_idx * args.cols;
#pragma unroll
        for (int i = 0; i < kColsPerLane; ++i) {
            const int64_t col = first_col + i;
            if (col >= args.cols) break;
            q_row[col] = quantize_value(values[i], factor, stats.non_finite);
        }
        if (lane_idx == 0) args.scales[row_idx * groups_per_row + group_in_row] = scale;
    }
}

// The vector path of quantize_groups (f32 input, or cols or the row stride not a multiple of 8), where cols and the
// row stride are multiples of 4 and in and q are aligned to 4 elements: a lane's 4 columns by one load and one 32-bit
// store (a warp moves 128 contiguous bytes of q), two groups per warp at a time so that twice the loads are in flight.
// The same values, reductions and math as the scalar path: the same bytes.
constexpr int kGroupsPerWarp = 2;

template <typename T>
__device__ __forceinline__ void load4(const T* source, float (&values)[kColsPerLane]) {
    if constexpr (std::is_same_v<T, float>) {
        const float4 loaded = *reinterpret_cast<const float4*>(source);
        values[0] = loaded.x;
        values[1] = loaded.y;
        values[2] = loaded.z;
        values[3] = loaded.w;
    } else {
        const uint2 loaded = *reinterpret_cast<const uint2*>(source);
        unpack_pair<T>(loaded.x, values[0], values[1]);
        unpack_pair<T>(loaded.y, values[2], values[3]);
    }
}

template <typename T>
__global__ void __launch_bounds__(kQuantThreads) quantize_groups_vector_kernel(const QuantizeGroupsArgs args) {
    const int lane_idx = static_cast<int>(threadIdx.x) % kWarpSize;
    const int64_t groups_per_row = ceil_div(args.cols, static_cast<int64_t>(kFp8GroupSize));
    const int64_t num_groups = args.rows * groups_per_row;
    const int64_t warp_idx =
        static_cast<int64_t>(blockIdx.x) * (kQuantThreads / kWarpSize) + static_cast<int>(threadIdx.x) / kWarpSize;
    const int64_t warps_per_grid = static_cast<int64_t>(gridDim.x) * (kQuantThreads / kWarpSize);
    const T* in = static_cast<const T*>(args.in);
    for (int64_t first_group = warp_idx * kGroupsPerWarp; first_group < num_groups;
         first_group += warps_per_grid * kGroupsPerWarp) {
        float values[kGroupsPerWarp][kColsPerLane];
        GroupStats stats[kGroupsPerWarp];
        int64_t col[kGroupsPerWarp];
        int64_t rows[kGroupsPerWarp];
#pragma unroll
        for (int j = 0; j < kGroupsPerWarp; ++j) {  // warp-uniform: every lane takes part in the reductions
            const int64_t group_idx = min(first_group + j, num_groups - 1);
            rows[j] = group_idx / groups_per_row;
            col[j] = (group_idx % groups_per_row) * kFp8GroupSize + lane_idx * kColsPerLane;
            if (col[j] < args.cols) {
                load4(in + rows[j] * args.in_row_stride + col[j], values[j]);
            } else {
#pragma unroll
                for (int i = 0; i < kColsPerLane; ++i) values[j][i] = 0.0f;
            }
#pragma unroll
            for (int i = 0; i < kColsPerLane; ++i) stats[j].add(values[j][i]);
        }
#pragma unroll
        for (int j = 0; j < kGroupsPerWarp; ++j) {
            stats[j].reduce_over_warp();
            if (first_group + j >= num_groups) continue;
            const float scale = group_scale(stats[j], args.pow2);
            const float factor = group_factor(stats[j], scale, args.pow2);
            uint32_t bytes = 0;
#pragma unroll
            for (int i = 0; i < kColsPerLane; ++i) {
                bytes |= static_cast<uint32_t>(quantize_value(values[j][i], factor, stats[j].non_finite)) << (8 * i);
            }
            if (col[j] < args.cols) *reinterpret_cast<uint32_t*>(args.q + rows[j] * args.cols + col[j]) = bytes;
            if (lane_idx == 0) {
                args.scales[rows[j] * groups_per_row + (first_group + j) % groups_per_row] = scale;
            }
        }
    }
}

// The row path of quantize_groups, for 16-bit input whose cols and row stride are multiples of 8 and whose rows are
// 16-byte aligned: a warp per row, half a warp per 128-column group, a lane's 8 columns by one 16-byte load and one
// 8-byte store of q (a warp moves 256 contiguous bytes of q per chunk), kRowChunksInFlight chunks loaded before the
// first is reduced. Per-row indexing (one division per row, not per group and lane) and packed 16-bit maxima:
// bitwise the other paths' stats, scales and bytes (PackedGroupStats, quantize_chunk). The passes over x, dy and dh.
constexpr int kRowColsPerLane = 8;
constexpr int kRowLanesPerGroup = kFp8GroupSize / kRowColsPerLane;
constexpr int64_t kRowChunkCols = kWarpSize * kRowColsPerLane;  // two groups
constexpr int kRowChunksInFlight = 4;
static_assert(kRowLanesPerGroup == 16, "half a warp per group");

template <typename T>
__global__ void __launch_bounds__(kQuantThreads) quantize_groups_row_kernel(const QuantizeGroupsArgs args) {
    const int lane_idx = static_cast<int>(threadIdx.x) % kWarpSize;
    const int64_t groups_per_row = ceil_div(args.cols, static_cast<int64_t>(kFp8GroupSize));
    const int64_t warps_per_grid = static_cast<int64_t>(gridDim.x) * (kQuantThreads / kWarpSize);
    for (int64_t row_idx =
             static_cast<int64_t>(blockIdx.x) * (kQuantThreads / kWarpSize) + static_cast<int>(threadIdx.x) / kWarpSize;
         row_idx < args.rows; row_idx += warps_per_grid) {
        const T* in_row = static_cast<const T*>(args.in) + row_idx * args.in_row_stride;
        uint8_t* q_row = args.q + row_idx * args.cols;
        float* scale_row = args.scales + row_idx * groups_per_row;
        for (int64_t first_col = 0; first_col < args.cols; first_col += kRowChunkCols * kRowChunksInFlight) {
            uint32_t words[kRowChunksInFlight][4];
#pragma unroll
            for (int chunk = 0; chunk < kRowChunksInFlight; ++chunk) {
                const int64_t col = first_col + chunk * kRowChunkCols + lane_idx * kRowColsPerLane;
                const uint4 loaded = col < args.cols ? *reinterpret_cast<const uint4*>(in_row + col) : uint4{};
                words[chunk][0] = loaded.x;
                words[chunk][1] = loaded.y;
                words[chunk][2] = loaded.z;
                words[chunk][3] = loaded.w;
            }
#pragma unroll
            for (int chunk = 0; chunk < kRowChunksInFlight; ++chunk) {
                const int64_t col = first_col + chunk * kRowChunkCols + lane_idx * kRowColsPerLane;
                PackedGroupStats<T> packed;
#pragma unroll
                for (int word_idx = 0; word_idx < 4; ++word_idx) packed.add(words[chunk][word_idx]);
                packed.template reduce_over_lanes<kRowLanesPerGroup>();  // every lane: the shuffles are warp-wide
                if (col >= args.cols) continue;
                const GroupStats stats = packed.stats();
                const float scale = group_scale(stats, args.pow2);
                const float factor = group_factor(stats, scale, args.pow2);
                *reinterpret_cast<uint2*>(q_row + col) = quantize_chunk<T>(words[chunk], factor, stats.non_finite);
                if (lane_idx % kRowLanesPerGroup == 0) scale_row[col / kFp8GroupSize] = scale;
            }
        }
    }
}

// Whether quantize_groups takes its row path.
bool quantize_groups_by_rows(const QuantizeGroupsArgs& args) {
    return (args.in_dtype == MEGAMOE_DTYPE_BF16 || args.in_dtype == MEGAMOE_DTYPE_F16) &&
           args.cols % kRowColsPerLane == 0 && args.in_row_stride % kRowColsPerLane == 0 &&
           is_aligned(args.in, kRowColsPerLane * 2) && is_aligned(args.q, kRowColsPerLane);
}

// Whether quantize_groups takes its vector path.
bool quantize_groups_vectorizable(const QuantizeGroupsArgs& args) {
    const int64_t elem_bytes = args.in_dtype == MEGAMOE_DTYPE_F32 ? 4 : 2;
    return args.cols % kColsPerLane == 0 && args.in_row_stride % kColsPerLane == 0 &&
           is_aligned(args.in, kColsPerLane * elem_bytes) && is_aligned(args.q, kColsPerLane);
}

constexpr int kBlockSide = kFp8GroupSize;  // a weight block: 128 x 128
constexpr int kBlockWarps = kQuantThreads / kWarpSize;
constexpr int kBlockRowsPerWarp = kBlockSide / kBlockWarps;  // 16 rows of the block per warp
static_assert(kBlockSide % kWarpSize == 0 && kBlockSide % kBlockWarps == 0, "a warp takes whole rows");

// The (expert, n-block, k-block) of block i of quantize_blocks_kernel's grid: every block, kb fastest, or where
// quantize_blocks_vector_kernel takes the whole blocks (edges_only), the partial ones alone: per expert the last
// n-block's row of blocks (N not a multiple of 128), then the last k-block's column above that row (K not a multiple
// of 128).
struct BlockCoords {
    int64_t expert, n_block, k_block;
};
__device__ __forceinline__ BlockCoords block_coords(const QuantizeBlocksArgs& args, int64_t block_idx,
                                                    bool edges_only) {
    const int64_t n_blocks = ceil_div(args.n, static_cast<int64_t>(kBlockSide));
    const int64_t k_blocks = ceil_div(args.k, static_cast<int64_t>(kBlockSide));
    if (!edges_only) return {block_idx / (n_blocks * k_blocks), block_idx / k_blocks % n_blocks, block_idx % k_blocks};
    const int64_t n_whole = args.n / kBlockSide, k_whole = args.k / kBlockSide;
    const int64_t bottom = n_whole < n_blocks ? k_blocks : 0;  // the last n-block's row
    const int64_t side = k_whole < k_blocks ? n_whole : 0;     // the last k-block's column above it
    const int64_t expert = block_idx / (bottom + side), edge = block_idx % (bottom + side);
    return edge < bottom ? BlockCoords{expert, n_whole, edge} : BlockCoords{expert, edge - bottom, k_whole};
}

// A weight block's stats from each thread's (its warp's over shuffles, then the warps' in warp order through shared
// memory): every thread of the block calls it, and gets the block's.
__device__ __forceinline__ GroupStats block_stats(GroupStats stats, float (&warp_amax)[kBlockWarps],
                                                  int (&warp_non_finite)[kBlockWarps], int warp_idx, int lane_idx) {
    stats.reduce_over_warp();
    if (lane_idx == 0) {
        warp_amax[warp_idx] = stats.amax;
        warp_non_finite[warp_idx] = stats.non_finite ? 1 : 0;
    }
    __syncthreads();
    GroupStats block;
#pragma unroll
    for (int w = 0; w < kBlockWarps; ++w) {
        block.amax = fmaxf(block.amax, warp_amax[w]);
        block.non_finite |= warp_non_finite[w] != 0;
    }
    return block;
}

// The scalar path, for the blocks quantize_blocks_vector_kernel does not take (partial blocks at the edges; every
// block where N or K is not a multiple of 16 or a pointer is not 16-byte aligned): warp w reads rows 16 w .. 16 w + 15
// of the block, lane l columns l, l + 32, ...; the block's amax and non-finite flag by warp shuffles and shared
// memory; q and q_t byte by byte.
__global__ void __launch_bounds__(kQuantThreads)
    quantize_blocks_kernel(const QuantizeBlocksArgs args, bool edges_only) {
    __shared__ float warp_amax[kBlockWarps];
    __shared__ int warp_non_finite[kBlockWarps];
    const int64_t n_blocks = ceil_div(args.n, static_cast<int64_t>(kBlockSide));
    const int64_t k_blocks = ceil_div(args.k, static_cast<int64_t>(kBlockSide));
    const auto [expert, n_block, k_block] = block_coords(args, blockIdx.x, edges_only);
    const int warp_idx = static_cast<int>(threadIdx.x) / kWarpSize;
    const int lane_idx = static_cast<int>(threadIdx.x) % kWarpSize;
    constexpr int kColsPerLane = kBlockSide / kWarpSize;
    float values[kBlockRowsPerWarp][kColsPerLane];
    GroupStats stats;
#pragma unroll
    for (int r = 0; r < kBlockRowsPerWarp; ++r) {
        const int64_t row = n_block * kBlockSide + warp_idx * kBlockRowsPerWarp + r;
#pragma unroll
        for (int c = 0; c < kColsPerLane; ++c) {
            const int64_t col = k_block * kBlockSide + lane_idx + c * kWarpSize;
            const bool inside = row < args.n && col < args.k;
            values[r][c] = inside ? load_scalar(args.in, args.in_dtype, (expert * args.n + row) * args.k + col) : 0.0f;
            stats.add(values[r][c]);
        }
    }
    const GroupStats block = block_stats(stats, warp_amax, warp_non_finite, warp_idx, lane_idx);
    const float scale = group_scale(block, args.pow2);
    const float factor = group_factor(block, scale, args.pow2);
#pragma unroll
    for (int r = 0; r < kBlockRowsPerWarp; ++r) {
        const int64_t row = n_block * kBlockSide + warp_idx * kBlockRowsPerWarp + r;
#pragma unroll
        for (int c = 0; c < kColsPerLane; ++c) {
            const int64_t col = k_block * kBlockSide + lane_idx + c * kWarpSize;
            if (row >= args.n || col >= args.k) continue;
            const uint8_t byte = quantize_value(values[r][c], factor, block.non_finite);
            args.q[(expert * args.n + row) * args.k + col] = byte;
            if (args.q_t != nullptr) args.q_t[(expert * args.k + col) * args.n + row] = byte;
        }
    }
    if (threadIdx.x == 0) args.scales[(expert * n_blocks + n_block) * k_blocks + k_block] = scale;
}

// The vector path of quantize_blocks, for the whole blocks where N and K are multiples of 16 and in, q and q_t are
// 16-byte aligned. One block per CTA; each thread 64 elements of the block by 16-byte loads (8 of 8 bf16 / f16, 16 of
// 4 f32), all issued before any is used: warp w reads rows 16 w .. 16 w + 15, a load instruction whole rows (a warp:
// 2 rows of bf16 / f16, 1 of f32). The amax (a max: order-free) and the non-finite flag by warp shuffles and shared
// memory, the scale, factor and bytes by group_scale / group_factor / quantize_value as in the scalar path: the same
// bytes. The bytes go
// into a 128 x 128 shared tile (16 KB), then out in 16-byte rows of q (8 lanes: one 128-byte row) and of q_t (each
// thread transposes 16 rows x 4 columns of the tile by byte permutes: 8 lanes write one 128-byte row of q_t). The
// tile's 16-byte chunks are swizzled, chunk c of row r at c ^ (r / 16), so that the tile's writes, the q rows' reads
// and the transposing 4-byte reads (a warp: 4 columns of words in 8 row groups, r / 16 = 0..7) are free of bank
// conflicts. Shared memory 16 KB, registers <= 64 for bf16 / f16: 4 CTAs an SM, up to 128 KB of loads in flight.
static_assert(kQuantThreads == kByteTileThreads && kBlockSide == kByteTileSide,
              "a weight block is one byte tile (device/byte_tile.cuh), a thread of its 256 each");
static_assert(kBlockSide * kByteTileChunks % kQuantThreads == 0, "the q rows: whole 16-byte chunks per thread");

template <typename T>
__global__ void __launch_bounds__(kQuantThreads, ByteTileLoads<T>::kMinBlocks)
    quantize_blocks_vector_kernel(const QuantizeBlocksArgs args) {
    using Loads = ByteTileLoads<T>;
    __shared__ float warp_amax[kBlockWarps];
    __shared__ int warp_non_finite[kBlockWarps];
    __shared__ __align__(16) uint8_t tile[kBlockSide * kBlockSide];
    // Block (e, nb, kb) of the whole blocks, kb fastest (the launcher: E * whole n-blocks * whole k-blocks < 2^31).
    const uint32_t n_whole = static_cast<uint32_t>(args.n / kBlockSide);
    const uint32_t k_whole = static_cast<uint32_t>(args.k / kBlockSide);
    const uint32_t block_idx = blockIdx.x;
    const int64_t expert = block_idx / (n_whole * k_whole);
    const int64_t n_block = block_idx / k_whole % n_whole, k_block = block_idx % k_whole;
    const unsigned thread_idx = threadIdx.x;  // unsigned: the tile's offsets by shifts
    const unsigned warp_idx = thread_idx / kWarpSize, lane_idx = thread_idx % kWarpSize;
    const int64_t first_row = expert * args.n + n_block * kBlockSide;  // of [E * N, K]
    const int64_t first_col = k_block * kBlockSide;

    const unsigned load_row = warp_idx * kByteTileRowsPerWarp + lane_idx / Loads::kPerRow;  // + j * kRowsPerLoad
    const unsigned load_col = lane_idx % Loads::kPerRow * Loads::kPerLoad;
    const T* source = static_cast<const T*>(args.in) + (first_row + load_row) * args.k + first_col + load_col;
    uint4 raw[Loads::kLoads];
#pragma unroll
    for (int j = 0; j < Loads::kLoads; ++j) {
        raw[j] = *reinterpret_cast<const uint4*>(source + j * Loads::kRowsPerLoad * args.k);
    }
    uint8_t* const tile_chunk = tile + byte_tile_offset(load_row, load_col);
    GroupStats stats;
    if constexpr (std::is_same_v<T, float>) {
#pragma unroll
        for (int j = 0; j < Loads::kLoads; ++j) {
            float values[Loads::kPerLoad];
            unpack_chunk<T>(raw[j], values);
#pragma unroll
            for (int i = 0; i < Loads::kPerLoad; ++i) stats.add(values[i]);
        }
    } else {
        // bf16 / f16: a packed max of |x| (the sign bits cleared) that keeps a NaN, 2 elements an instruction, its two
        // halves then added as floats: the same amax (a max, exact in T) and non-finite flag (a NaN or an infinity
        // survives the max) as adding each element.
        using Pair = std::conditional_t<std::is_same_v<T, __half>, __half2, __nv_bfloat162>;
        constexpr uint32_t kMagnitude = 0x7FFF7FFFu;
        uint32_t amax_bits = 0;
#pragma unroll
        for (int j = 0; j < Loads::kLoads; ++j) {
#pragma unroll
            for (const uint32_t word : {raw[j].x, raw[j].y, raw[j].z, raw[j].w}) {
                const uint32_t magnitude = word & kMagnitude;
                const Pair amax =
                    __hmax2_nan(*reinterpret_cast<const Pair*>(&amax_bits), *reinterpret_cast<const Pair*>(&magnitude));
                amax_bits = *reinterpret_cast<const uint32_t*>(&amax);
            }
        }
        float low, high;
        unpack_pair<T>(amax_bits, low, high);
        stats.add(low);
        stats.add(high);
    }
    const GroupStats block = block_stats(stats, warp_amax, warp_non_finite, warp_idx, lane_idx);
    const float scale = group_scale(block, args.pow2);
    const float factor = group_factor(block, scale, args.pow2);
#pragma unroll
    for (int j = 0; j < Loads::kLoads; ++j) {
        float values[Loads::kPerLoad];
        unpack_chunk<T>(raw[j], values);
        uint32_t words[Loads::kPerLoad / 4] = {};
#pragma unroll
        for (int i = 0; i < Loads::kPerLoad; ++i) {
            words[i / 4] |= uint32_t{quantize_value(values[i], factor, block.non_finite)} << (8 * (i % 4));
        }
        uint8_t* target = tile_chunk + j * Loads::kRowsPerLoad * kBlockSide;  // row load_row + j * kRowsPerLoad
        if constexpr (Loads::kPerLoad == 8) {
            *reinterpret_cast<uint2*>(target) = make_uint2(words[0], words[1]);
        } else {
            *reinterpret_cast<uint32_t*>(target) = words[0];
        }
    }
    if (thread_idx == 0) {
        const int64_t n_blocks = ceil_div(args.n, static_cast<int64_t>(kBlockSide));
        const int64_t k_blocks = ceil_div(args.k, static_cast<int64_t>(kBlockSide));
        args.scales[(expert * n_blocks + n_block) * k_blocks + k_block] = scale;
    }
    __syncthreads();
#pragma unroll
    for (int pass = 0; pass < kBlockSide * kByteTileChunks / kQuantThreads; ++pass) {
        const unsigned i = pass * kQuantThreads + thread_idx;
        const unsigned line = i / kByteTileChunks, chunk = i % kByteTileChunks;  // q: tile row `line`, 8 lanes a row
        *reinterpret_cast<uint4*>(args.q + (first_row + line) * args.k + first_col + chunk * kByteTileChunk) =
            *reinterpret_cast<const uint4*>(tile + byte_tile_offset(line, chunk * kByteTileChunk));
    }
    if (args.q_t == nullptr) return;
    // q_t: the thread's transposed block (8 lanes: one q_t row).
    const TransposedBlock block_t = read_transposed_block(tile, thread_idx);
    uint8_t* target = args.q_t + (expert * args.k + first_col + block_t.first_col) * args.n + n_block * kBlockSide +
                      block_t.first_row;
#pragma unroll
    for (int c = 0; c < kTransposeCols; ++c) {
        *reinterpret_cast<uint4*>(target + c * args.n) =
            make_uint4(block_t.columns[c][0], block_t.columns[c][1], block_t.columns[c][2], block_t.columns[c][3]);
    }
}

// Whether quantize_blocks takes its vector path for the whole blocks.
bool quantize_blocks_vectorizable(const QuantizeBlocksArgs& args) {
    return args.n % kByteTileChunk == 0 && args.k % kByteTileChunk == 0 && is_aligned(args.in, kByteTileChunk) &&
           is_aligned(args.q, kByteTileChunk) && is_aligned(args.q_t, kByteTileChunk);  // NULL q_t: aligned
}

// The launch of a quantizer: built for sm_90a alone (FP8_BLOCKWISE runs on compute capability 9.0 GPUs), so another
// device finds no kernel image, NOT_SUPPORTED.
megamoe_status_t check_quantize_launch(const char* kernel_name) {
    const cudaError_t err = cudaGetLastError();
    if (err == cudaErrorNoKernelImageForDevice) {
        return set_error(MEGAMOE_STATUS_NOT_SUPPORTED,
                         "%s: the FP8 quantizers run on compute capability 9.0 GPUs only (built for sm_90a)",
                         kernel_name);
    }
    if (err != cudaSuccess) return set_error(MEGAMOE_STATUS_CUDA_ERROR, "%s: %s", kernel_name, cudaGetErrorString(err));
    return MEGAMOE_STATUS_SUCCESS;
}

// launch(ElementTag<T>{}) with T the C++ type of a quantizer's input dtype: bf16, f16, else f32.
template <class Launch>
void with_input_type(megamoe_dtype_t dtype, Launch&& launch) {
    switch (dtype) {
        case MEGAMOE_DTYPE_BF16:
            launch(ElementTag<__nv_bfloat16>{});
            break;
        case MEGAMOE_DTYPE_F16:
            launch(ElementTag<__half>{});
            break;
        default:
            launch(ElementTag<float>{});
            break;
    }
}

}  // namespace

megamoe_status_t launch_quantize_groups(const QuantizeGroupsArgs& args, cudaStream_t stream) {
    if (args.rows == 0 || args.cols == 0) return MEGAMOE_STATUS_SUCCESS;
    if (args.in == nullptr || args.q == nullptr || args.scales == nullptr || args.rows < 0 || args.cols < 0 ||
        args.in_row_stride < args.cols) {
        return set_error(MEGAMOE_STATUS_INTERNAL_ERROR, "quantize_groups: in, q, scales and a row stride >= cols");
    }
    const int64_t num_groups = args.rows * ceil_div(args.cols, static_cast<int64_t>(kFp8GroupSize));
    const int64_t warps_per_block = kQuantThreads / kWarpSize;  // a row (the row path) or a group each
    if (quantize_groups_by_rows(args)) {
        const dim3 grid(static_cast<unsigned>(std::min(ceil_div(args.rows, warps_per_block), kMaxQuantBlocks)));
        with_element_type(args.in_dtype, [&](auto tag) {
            quantize_groups_row_kernel<typename decltype(tag)::Type><<<grid, kQuantThreads, 0, stream>>>(args);
        });
        return check_quantize_launch("quantize_groups_row_kernel");
    }
    if (quantize_groups_vectorizable(args)) {
        const dim3 grid(
            static_cast<unsigned>(std::min(ceil_div(num_groups, warps_per_block * kGroupsPerWarp), kMaxQuantBlocks)));
        with_input_type(args.in_dtype, [&](auto tag) {
            quantize_groups_vector_kernel<typename decltype(tag)::Type><<<grid, kQuantThreads, 0, stream>>>(args);
        });
        return check_quantize_launch("quantize_groups_vector_kernel");
    }
    const dim3 grid(static_cast<unsigned>(std::min(ceil_div(num_groups, warps_per_block), kMaxQuantBlocks)));
    quantize_groups_kernel<<<grid, kQuantThreads, 0, stream>>>(args);
    return check_quantize_launch("quantize_groups_kernel");
}

megamoe_status_t launch_quantize_blocks(const QuantizeBlocksArgs& args, cudaStream_t stream) {
    if (args.num_experts == 0 || args.n == 0 || args.k == 0) return MEGAMOE_STATUS_SUCCESS;
    if (args.in == nullptr || args.q == nullptr || args.scales == nullptr || args.num_experts < 0 || args.n < 0 ||
        args.k < 0) {
        return set_error(MEGAMOE_STATUS_INTERNAL_ERROR, "quantize_blocks: in, q and scales, sizes >= 0");
    }
    const int64_t n_blocks = ceil_div(args.n, static_cast<int64_t>(kBlockSide));
    const int64_t k_blocks = ceil_div(args.k, static_cast<int64_t>(kBlockSide));
    const int64_t num_blocks = args.num_experts * n_blocks * k_blocks;
    if (num_blocks > INT32_MAX) return set_error(MEGAMOE_STATUS_INTERNAL_ERROR, "quantize_blocks: 2^31 blocks or more");
    if (!quantize_blocks_vectorizable(args)) {
        quantize_blocks_kernel<<<static_cast<unsigned>(num_blocks), kQuantThreads, 0, stream>>>(args, false);
        return check_quantize_launch("quantize_blocks_kernel");
    }
    const int64_t n_whole = args.n / kBlockSide, k_whole = args.k / kBlockSide;
    const int64_t whole_blocks = args.num_experts * n_whole * k_whole;
    if (whole_blocks > 0) {
        const dim3 grid(static_cast<unsigned>(whole_blocks));
        with_input_type(args.in_dtype, [&](auto tag) {
            quantize_blocks_vector_kernel<typename decltype(tag)::Type><<<grid, kQuantThreads, 0, stream>>>(args);
        });
        MEGAMOE_CUDA_RETURN_IF_ERROR(check_quantize_launch("quantize_blocks_vector_kernel"));
    }
    const int64_t edge_blocks = num_blocks - whole_blocks;  // block_coords' edges_only order
    if (edge_blocks == 0) return MEGAMOE_STATUS_SUCCESS;
    quantize_blocks_kernel<<<static_cast<unsigned>(edge_blocks), kQuantThreads, 0, stream>>>(args, true);
    return check_quantize_launch("quantize_blocks_kernel");
}

}  // namespace megamoe::cuda
