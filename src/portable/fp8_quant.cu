#include "portable/fp8_quant.h"

#include <cuda_fp8.h>

#include <algorithm>
#include <type_traits>

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
        const int64_t row_idx = group_idx / groups_per_row;
        const int64_t first_col = (group_idx % groups_per_row) * kFp8GroupSize + lane_idx * kColsPerLane;
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
        uint8_t* q_row = args.q + row_idx * args.cols;
#pragma unroll
        for (int i = 0; i < kColsPerLane; ++i) {
            const int64_t col = first_col + i;
            if (col >= args.cols) break;
            q_row[col] = quantize_value(values[i], scale, stats.non_finite);
        }
        if (lane_idx == 0) args.scales[group_idx] = scale;
    }
}

// The vector path of quantize_groups, where cols and the row stride are multiples of 4 and in and q are aligned to 4
// elements: a lane's 4 columns by one load and one 32-bit store (a warp moves 128 contiguous bytes of q), two groups
// per warp at a time so that twice the loads are in flight. The same values, reductions and math as the scalar path:
// the same bytes.
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
        int64_t row_idx[kGroupsPerWarp], col[kGroupsPerWarp];
#pragma unroll
        for (int j = 0; j < kGroupsPerWarp; ++j) {  // warp-uniform: every lane takes part in the reductions
            const int64_t group_idx = min(first_group + j, num_groups - 1);
            row_idx[j] = group_idx / groups_per_row;
            col[j] = (group_idx % groups_per_row) * kFp8GroupSize + lane_idx * kColsPerLane;
            if (col[j] < args.cols) {
                load4(in + row_idx[j] * args.in_row_stride + col[j], values[j]);
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
            uint32_t bytes = 0;
#pragma unroll
            for (int i = 0; i < kColsPerLane; ++i) {
                bytes |= static_cast<uint32_t>(quantize_value(values[j][i], scale, stats[j].non_finite)) << (8 * i);
            }
            if (col[j] < args.cols) *reinterpret_cast<uint32_t*>(args.q + row_idx[j] * args.cols + col[j]) = bytes;
            if (lane_idx == 0) args.scales[first_group + j] = scale;
        }
    }
}

// Whether quantize_groups takes its vector path.
bool quantize_groups_vectorizable(const QuantizeGroupsArgs& args) {
    const int64_t elem_bytes = args.in_dtype == MEGAMOE_DTYPE_F32 ? 4 : 2;
    return args.cols % kColsPerLane == 0 && args.in_row_stride % kColsPerLane == 0 &&
           is_aligned(args.in, kColsPerLane * elem_bytes) && is_aligned(args.q, kColsPerLane);
}

constexpr int kTileRows = kFp8GroupSize;  // an M tile: 128 sorted rows of one expert
constexpr int kTileCols = kWarpSize;      // columns per block
constexpr int kRowsPerLane = kTileRows / kWarpSize;
constexpr int kColsPerWarp = kTileCols / (kQuantThreads / kWarpSize);
static_assert(kRowsPerLane == 4 && kColsPerWarp == 4, "a warp quantizes 4 columns, a lane 4 rows of each");

// Block (tile i, 32 columns): the tile's rows staged transposed in shared memory (passes of 8 rows x 32 columns), then
// each warp takes 4 columns: amax over the tile's rows (lane l holds rows l, l + 32, ...), the scale, the bytes.
__global__ void __launch_bounds__(kQuantThreads) quantize_expert_rows_kernel(const QuantizeExpertRowsArgs args) {
    __shared__ float tile_values[kTileCols][kTileRows + 1];  // [column][row], +1: no bank conflicts on the transpose
    __shared__ int tile_rows[2];                             // first sorted row, rows in the tile
    const int64_t tile_idx = blockIdx.x;
    const int thread_idx = static_cast<int>(threadIdx.x);
    if (thread_idx == 0) {
        int first_row = 0, num_rows = 0;
        if (tile_idx < args.m_tile_offsets[args.num_experts]) {
            int64_t low = 0, high = args.num_experts - 1;  // the last expert e with m_tile_offsets[e] <= tile_idx
            while (low < high) {
                const int64_t mid = (low + high + 1) / 2;
                if (args.m_tile_offsets[mid] <= tile_idx)
                    low = mid;
                else
                    high = mid - 1;
            }
            first_row = args.expert_offsets[low] + static_cast<int>(tile_idx - args.m_tile_offsets[low]) * kTileRows;
            num_rows = min(kTileRows, args.expert_offsets[low + 1] - first_row);
        }
        tile_rows[0] = first_row;
        tile_rows[1] = num_rows;
    }
    __syncthreads();
    const int first_row = tile_rows[0], num_rows = tile_rows[1];
    if (num_rows <= 0) return;  // past the device's tile count
    const int64_t first_col = static_cast<int64_t>(blockIdx.y) * kTileCols;
    for (int row = thread_idx / kTileCols; row < kTileRows; row += kQuantThreads / kTileCols) {
        const int col = thread_idx % kTileCols;
        float value = 0.0f;
        if (row < num_rows && first_col + col < args.cols) {
            const int64_t sorted_row = first_row + row;
            const int64_t source_row =
                args.sorted_slot != nullptr ? args.sorted_slot[sorted_row] / args.topk : sorted_row;
            value = load_scalar(args.in, args.in_dtype, source_row * args.in_row_stride + first_col + col);
        }
        tile_values[col][row] = value;
    }
    __syncthreads();
    const int warp_idx = thread_idx / kWarpSize, lane_idx = thread_idx % kWarpSize;
    for (int c = 0; c < kColsPerWarp; ++c) {
        const int col = warp_idx * kColsPerWarp + c;
        if (first_col + col >= args.cols) break;
        float values[kRowsPerLane];
        GroupStats stats;
#pragma unroll
        for (int i = 0; i < kRowsPerLane; ++i) {
            values[i] = tile_values[col][lane_idx + i * kWarpSize];  // rows past the tile's end hold 0
            stats.add(values[i]);
        }
        stats.reduce_over_warp();
        const float scale = group_scale(stats, args.pow2);
        uint8_t* q_col = args.q_t + (first_col + col) * args.ld_q + first_row;
#pragma unroll
        for (int i = 0; i < kRowsPerLane; ++i) {
            const int row = lane_idx + i * kWarpSize;  // a warp's store: 32 consecutive bytes
            if (row < num_rows) q_col[row] = quantize_value(values[i], scale, stats.non_finite);
        }
        if (lane_idx == 0) args.scales[(first_col + col) * args.ld_scales + tile_idx] = scale;
    }
}

constexpr int kBlockSide = kFp8GroupSize;  // a weight block: 128 x 128
constexpr int kBlockWarps = kQuantThreads / kWarpSize;
constexpr int kBlockRowsPerWarp = kBlockSide / kBlockWarps;  // 16 rows of the block per warp
static_assert(kBlockSide % kWarpSize == 0 && kBlockSide % kBlockWarps == 0, "a warp takes whole rows");

// Block (expert e, n-block, k-block): warp w reads rows 16 w .. 16 w + 15 of the block, lane l columns l, l + 32, ...;
// the block's amax and non-finite flag by warp shuffles and shared memory; then each value's byte into a shared tile,
// from which a whole block (n and k multiples of 16) goes out in 16-byte rows of q and, where asked, of q_t (16 bytes
// of a tile column each); a partial block at the edges byte by byte.
__global__ void __launch_bounds__(kQuantThreads) quantize_blocks_kernel(const QuantizeBlocksArgs args) {
    constexpr int kChunk = 16;                           // bytes per vector store
    constexpr int kTileStride = kBlockSide + kChunk;     // a tile row's bytes: 16-byte aligned, rows off one bank
    constexpr int kChunksPerSide = kBlockSide / kChunk;  // 16-byte chunks of a tile row
    static_assert(kTileStride % kChunk == 0, "a tile row must start 16-byte aligned");
    __shared__ float warp_amax[kBlockWarps];
    __shared__ int warp_non_finite[kBlockWarps];
    __shared__ __align__(16) uint8_t tile[kBlockSide * kTileStride];
    const int64_t n_blocks = ceil_div(args.n, static_cast<int64_t>(kBlockSide));
    const int64_t k_blocks = ceil_div(args.k, static_cast<int64_t>(kBlockSide));
    const int64_t block_idx = blockIdx.x;  // (e, nb, kb), kb fastest
    const int64_t expert = block_idx / (n_blocks * k_blocks);
    const int64_t n_block = block_idx / k_blocks % n_blocks;
    const int64_t k_block = block_idx % k_blocks;
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
    stats.reduce_over_warp();
    if (lane_idx == 0) {
        warp_amax[warp_idx] = stats.amax;
        warp_non_finite[warp_idx] = stats.non_finite ? 1 : 0;
    }
    __syncthreads();
    GroupStats block;  // the warps' in warp order
#pragma unroll
    for (int w = 0; w < kBlockWarps; ++w) {
        block.amax = fmaxf(block.amax, warp_amax[w]);
        block.non_finite |= warp_non_finite[w] != 0;
    }
    const float scale = group_scale(block, args.pow2);
    const bool whole = (n_block + 1) * kBlockSide <= args.n && (k_block + 1) * kBlockSide <= args.k &&
                       args.n % kChunk == 0 && args.k % kChunk == 0 &&
                       reinterpret_cast<uintptr_t>(args.q) % kChunk == 0 &&
                       reinterpret_cast<uintptr_t>(args.q_t) % kChunk == 0;  // NULL q_t: aligned
#pragma unroll
    for (int r = 0; r < kBlockRowsPerWarp; ++r) {
        const int tile_row = warp_idx * kBlockRowsPerWarp + r;
        const int64_t row = n_block * kBlockSide + tile_row;
#pragma unroll
        for (int c = 0; c < kColsPerLane; ++c) {
            const int tile_col = lane_idx + c * kWarpSize;
            const int64_t col = k_block * kBlockSide + tile_col;
            if (row >= args.n || col >= args.k) continue;
            const uint8_t byte = quantize_value(values[r][c], scale, block.non_finite);
            if (whole) {
                tile[tile_row * kTileStride + tile_col] = byte;
                continue;
            }
            args.q[(expert * args.n + row) * args.k + col] = byte;
            if (args.q_t != nullptr) args.q_t[(expert * args.k + col) * args.n + row] = byte;
        }
    }
    if (threadIdx.x == 0) args.scales[block_idx] = scale;
    if (!whole) return;
    __syncthreads();
    for (int i = static_cast<int>(threadIdx.x); i < kBlockSide * kChunksPerSide; i += kQuantThreads) {
        const int line = i / kChunksPerSide, chunk = i % kChunksPerSide;  // q: tile row `line`
        const int64_t row = n_block * kBlockSide + line, col = k_block * kBlockSide + chunk * kChunk;
        *reinterpret_cast<uint4*>(args.q + (expert * args.n + row) * args.k + col) =
            *reinterpret_cast<const uint4*>(tile + line * kTileStride + chunk * kChunk);
    }
    if (args.q_t == nullptr) return;
    for (int i = static_cast<int>(threadIdx.x); i < kBlockSide * kChunksPerSide; i += kQuantThreads) {
        const int line = i / kChunksPerSide, chunk = i % kChunksPerSide;  // q_t: tile column `line`
        uint32_t words[kChunk / 4];
#pragma unroll
        for (int w = 0; w < kChunk / 4; ++w) {
            const int r0 = chunk * kChunk + 4 * w;
            words[w] = uint32_t{tile[r0 * kTileStride + line]} | uint32_t{tile[(r0 + 1) * kTileStride + line]} << 8 |
                       uint32_t{tile[(r0 + 2) * kTileStride + line]} << 16 |
                       uint32_t{tile[(r0 + 3) * kTileStride + line]} << 24;
        }
        const int64_t col = k_block * kBlockSide + line, row = n_block * kBlockSide + chunk * kChunk;
        *reinterpret_cast<uint4*>(args.q_t + (expert * args.k + col) * args.n + row) =
            make_uint4(words[0], words[1], words[2], words[3]);
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
    const int64_t groups_per_block = kQuantThreads / kWarpSize;
    if (quantize_groups_vectorizable(args)) {
        const dim3 grid(
            static_cast<unsigned>(std::min(ceil_div(num_groups, groups_per_block * kGroupsPerWarp), kMaxQuantBlocks)));
        switch (args.in_dtype) {
            case MEGAMOE_DTYPE_BF16:
                quantize_groups_vector_kernel<__nv_bfloat16><<<grid, kQuantThreads, 0, stream>>>(args);
                break;
            case MEGAMOE_DTYPE_F16:
                quantize_groups_vector_kernel<__half><<<grid, kQuantThreads, 0, stream>>>(args);
                break;
            default:
                quantize_groups_vector_kernel<float><<<grid, kQuantThreads, 0, stream>>>(args);
                break;
        }
        return check_launch("quantize_groups_vector_kernel");
    }
    const dim3 grid(static_cast<unsigned>(std::min(ceil_div(num_groups, groups_per_block), kMaxQuantBlocks)));
    quantize_groups_kernel<<<grid, kQuantThreads, 0, stream>>>(args);
    return check_launch("quantize_groups_kernel");
}

megamoe_status_t launch_quantize_expert_rows(const QuantizeExpertRowsArgs& args, cudaStream_t stream) {
    if (args.max_tiles == 0 || args.cols == 0) return MEGAMOE_STATUS_SUCCESS;
    if (args.in == nullptr || args.q_t == nullptr || args.scales == nullptr || args.expert_offsets == nullptr ||
        args.m_tile_offsets == nullptr || args.num_experts <= 0 || args.in_row_stride < args.cols ||
        args.ld_scales < args.max_tiles || args.max_tiles > INT32_MAX ||
        (args.sorted_slot != nullptr && args.topk <= 0)) {
        return set_error(MEGAMOE_STATUS_INTERNAL_ERROR,
                         "quantize_expert_rows: in, q_t, scales, the routing's offsets, a row stride >= cols and "
                         "ld_scales >= max_tiles");
    }
    const dim3 grid(static_cast<unsigned>(args.max_tiles),
                    static_cast<unsigned>(ceil_div(args.cols, static_cast<int64_t>(kTileCols))));
    if (grid.y > 65535) return set_error(MEGAMOE_STATUS_INTERNAL_ERROR, "quantize_expert_rows: more than 2^21 columns");
    quantize_expert_rows_kernel<<<grid, kQuantThreads, 0, stream>>>(args);
    return check_launch("quantize_expert_rows_kernel");
}

megamoe_status_t launch_quantize_blocks(const QuantizeBlocksArgs& args, cudaStream_t stream) {
    if (args.num_experts == 0 || args.n == 0 || args.k == 0) return MEGAMOE_STATUS_SUCCESS;
    if (args.in == nullptr || args.q == nullptr || args.scales == nullptr || args.num_experts < 0 || args.n < 0 ||
        args.k < 0) {
        return set_error(MEGAMOE_STATUS_INTERNAL_ERROR, "quantize_blocks: in, q and scales, sizes >= 0");
    }
    const int64_t num_blocks = args.num_experts * ceil_div(args.n, static_cast<int64_t>(kBlockSide)) *
                               ceil_div(args.k, static_cast<int64_t>(kBlockSide));
    if (num_blocks > INT32_MAX) return set_error(MEGAMOE_STATUS_INTERNAL_ERROR, "quantize_blocks: 2^31 blocks or more");
    quantize_blocks_kernel<<<static_cast<unsigned>(num_blocks), kQuantThreads, 0, stream>>>(args);
    return check_launch("quantize_blocks_kernel");
}

}  // namespace megamoe::cuda
