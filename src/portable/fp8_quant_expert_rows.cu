// launch_quantize_expert_rows (portable/fp8_quant.h): the weight gradients' operands quantized along tokens, in the
// routing's M tiles, written transposed and tile-padded for a K-grouped FP8 GEMM that loads them by TMA.
//
// One CTA of 256 threads per (M tile i, 128 columns): the tile's 128 x 128 values by 16-byte loads (a row's chunk of
// 8 bf16 / f16 or 4 f32; a scalar fallback element by element where cols is not a multiple of 8 or the source rows
// are not 16-byte aligned: the same registers, the same rest), all in flight before any is used. Warp w reads tile
// rows 16 w .. 16 w + 15, a load instruction whole tile rows (2 rows of bf16 / f16, 1 of f32), so a thread's chunks
// share their columns: each column's amax over the thread's rows by an integer max of the magnitudes' bits (the sign
// bits cleared: the order of non-negative floats, a NaN or an infinity above every finite value, so the same amax and
// non-finite flag as GroupStats::add value by value), then over the warp's lanes of those columns by shuffles and over
// the 8 warps through shared memory. 128 threads then take a column each: its scale (group_scale) to scales[i, c]
// (one 512-byte row segment), its factor (group_factor; NaN for a non-finite column) to shared memory. Each thread
// quantizes its values (quantize_value with its columns' factors; the rows past the tile's end the byte 0) into a 128 x
// 128 byte tile in shared memory, 16-byte chunks swizzled (chunk c of row r at c ^ (r / 16)): the writes, and the
// transposing 4-byte reads (a warp: 4 columns of words in 8 row groups) free of bank conflicts. The transpose: a thread
// takes 16 rows x 4 columns by byte permutes and stores each column's 16 bytes at once, 8 lanes one 128-byte segment of
// a q_t row. Shared memory ~21 KB, <= 64 registers for bf16 / f16 (4 CTAs an SM), <= 128 for f32 (2).
#include <cuda_fp8.h>

#include <type_traits>

#include "device/byte_tile.cuh"
#include "device/cuda_utils.h"
#include "device/fp8_math.cuh"
#include "portable/fp8_quant.h"

namespace megamoe::cuda {
namespace {

constexpr int kThreads = kByteTileThreads;
constexpr int kWarps = kThreads / kWarpSize;
constexpr int kTileRows = kFp8GroupSize;          // an M tile: 128 sorted rows of one expert
constexpr int kTileCols = kByteTileSide;          // columns per CTA
constexpr uint32_t kNonFiniteBits = 0x7F800000u;  // f32 magnitudes at least this: an infinity or a NaN
static_assert(kTileRows == kByteTileSide, "a CTA's M tile x 128 columns is one byte tile (device/byte_tile.cuh)");
static_assert(kTileCols <= kThreads, "a thread per column for the scales");

// The byte tile's loads, with this kernel's CTAs per SM when it also writes row_q and a word's magnitude mask.
template <typename T>
struct TileLoads : ByteTileLoads<T> {
    static constexpr int kMinRowBlocks = sizeof(T) == 2 ? 3 : 2;  // with row_q: <= 85 / 128 registers (no spills)
    static constexpr uint32_t kMagnitude = sizeof(T) == 2 ? 0x7FFF7FFFu : 0x7FFFFFFFu;  // a word's sign bits cleared
};

// The largest magnitudes, element by element, of two words of T's (16-bit halves or one 32-bit value), as bits.
template <typename T>
__device__ __forceinline__ uint32_t max_bits(uint32_t a, uint32_t b) {
    if constexpr (sizeof(T) == 2) {
        return __vmaxu2(a, b);
    } else {
        return max(a, b);
    }
}

// A 16-byte chunk of a source row: kPerLoad elements from `source` (columns_left of them inside the matrix, the rest
// 0), by one vector load or element by element.
template <typename T, bool kVector>
__device__ __forceinline__ uint4 load_chunk(const T* source, int64_t columns_left) {
    if constexpr (kVector) {
        return columns_left > 0 ? *reinterpret_cast<const uint4*>(source) : make_uint4(0, 0, 0, 0);
    } else {
        using Bits = std::conditional_t<sizeof(T) == 2, uint16_t, uint32_t>;
        constexpr int kPerWord = 4 / static_cast<int>(sizeof(T));
        const Bits* elements = reinterpret_cast<const Bits*>(source);
        uint32_t words[4] = {0, 0, 0, 0};
#pragma unroll
        for (int k = 0; k < TileLoads<T>::kPerLoad; ++k) {
            if (k < columns_left) {
                words[k / kPerWord] |= static_cast<uint32_t>(elements[k]) << (8 * sizeof(T) * (k % kPerWord));
            }
        }
        return make_uint4(words[0], words[1], words[2], words[3]);
    }
}

// The tile's source rows quantized along their columns (QuantizeExpertRowsArgs::row_q; the CTA's 128 columns are one
// group of each row): the thread's chunk of each of its rows to floats and a GroupStats, reduced over the kPerRow lanes
// holding the row's chunks, the scale, the chunk's bytes stored (8 or 4 bytes; element by element on the scalar path)
// and, by the row's first lane, the scale; only the rows this tile writes (row_writer).
template <typename T, bool kVector>
__device__ __forceinline__ void quantize_tile_rows(const QuantizeExpertRowsArgs& args,
                                                   const uint4 (&raw)[TileLoads<T>::kLoads], const int* source_rows,
                                                   const bool* row_writer, unsigned load_row, unsigned load_col,
                                                   unsigned lane_idx, int64_t first_col) {
    using Loads = TileLoads<T>;
    const int64_t columns_left = args.cols - (first_col + static_cast<int64_t>(load_col));
    const int64_t groups_per_row = ceil_div(args.cols, static_cast<int64_t>(kTileCols));
#pragma unroll
    for (int j = 0; j < Loads::kLoads; ++j) {
        const unsigned tile_row = load_row + j * Loads::kRowsPerLoad;
        float values[Loads::kPerLoad];
        unpack_chunk<T>(raw[j], values);  // columns past cols: 0
        GroupStats stats;
#pragma unroll
        for (int k = 0; k < Loads::kPerLoad; ++k) stats.add(values[k]);
#pragma unroll
        for (int mask = 1; mask < Loads::kPerRow; mask *= 2) {  // the row's lanes (every lane takes part)
            stats.amax = fmaxf(stats.amax, __shfl_xor_sync(kFullMask, stats.amax, mask));
            stats.non_finite |= __shfl_xor_sync(kFullMask, static_cast<int>(stats.non_finite), mask) != 0;
        }
        const int source = source_rows[tile_row];
        if (source < 0 || !row_writer[tile_row] || columns_left <= 0) continue;
        const float scale = group_scale(stats, args.pow2);
        const float factor = group_factor(stats, scale, args.pow2);
        uint8_t* q_row = args.row_q + static_cast<int64_t>(source) * args.cols + first_col + load_col;
        if constexpr (kVector) {  // cols % 8 == 0: the chunk is whole
            uint32_t words[Loads::kPerLoad / 4] = {};
#pragma unroll
            for (int k = 0; k < Loads::kPerLoad; ++k) {
                words[k / 4] |= uint32_t{quantize_value(values[k], factor, stats.non_finite)} << (8 * (k % 4));
            }
            if constexpr (Loads::kPerLoad == 8) {
                *reinterpret_cast<uint2*>(q_row) = make_uint2(words[0], words[1]);
            } else {
                *reinterpret_cast<uint32_t*>(q_row) = words[0];
            }
        } else {
#pragma unroll
            for (int k = 0; k < Loads::kPerLoad; ++k) {
                if (k < columns_left) q_row[k] = quantize_value(values[k], factor, stats.non_finite);
            }
        }
        if (lane_idx % Loads::kPerRow == 0) {
            args.row_scales[static_cast<int64_t>(source) * groups_per_row + first_col / kTileCols] = scale;
        }
    }
}

template <typename T, bool kVector, bool kRowQuantize>
__global__ void __launch_bounds__(kThreads, kRowQuantize ? TileLoads<T>::kMinRowBlocks : TileLoads<T>::kMinBlocks)
    quantize_expert_rows_kernel(const QuantizeExpertRowsArgs args) {
    using Loads = TileLoads<T>;
    __shared__ int source_rows[kTileRows];  // the tile's source rows, -1 past its end
    __shared__ bool row_writer[kTileRows];  // kRowQuantize: the tile holds the row's first routed slot
    __shared__ __align__(16) uint32_t col_max[kWarps][kTileCols];  // each warp's column magnitudes, f32 bits
    __shared__ __align__(16) float col_factor[kTileCols];          // each column's factor, NaN for a non-finite column
    __shared__ __align__(16) uint8_t tile[kTileRows * kTileCols];  // the e4m3 bytes [row][column], swizzled
    const int64_t tile_idx = blockIdx.x;
    const unsigned thread_idx = threadIdx.x;  // unsigned: the tile's offsets by shifts
    const unsigned warp_idx = thread_idx / kWarpSize, lane_idx = thread_idx % kWarpSize;

    // The tile's expert: the number of experts whose tiles end at or before it (E when the tile is past them all).
    int expert = 0;
    for (int64_t base = 0; base < args.num_experts; base += kThreads) {
        const int64_t e = base + thread_idx;
        expert += __syncthreads_count(e < args.num_experts && args.m_tile_offsets[e + 1] <= tile_idx);
    }
    if (expert >= args.num_experts) return;  // past the device's tile count: left untouched
    const int first_row =
        args.expert_offsets[expert] + static_cast<int>(tile_idx - args.m_tile_offsets[expert]) * kTileRows;
    const int num_rows = min(kTileRows, args.expert_offsets[expert + 1] - first_row);
    if (thread_idx < kTileRows) {
        int source = -1;
        bool writer = true;
        if (static_cast<int>(thread_idx) < num_rows) {
            const int sorted_row = first_row + static_cast<int>(thread_idx);
            if (args.sorted_slot != nullptr) {
                const int slot = args.sorted_slot[sorted_row];
                source = static_cast<int>(slot / args.topk);
                if constexpr (kRowQuantize) {  // an earlier slot of the token routed: its tile writes the row
                    const int64_t first_slot = static_cast<int64_t>(source) * args.topk;
                    for (int64_t other = first_slot; other < slot; ++other) writer &= args.slot_to_row[other] < 0;
                }
            } else {
                source = sorted_row;
            }
        }
        source_rows[thread_idx] = source;
        row_writer[thread_idx] = writer;
    }
    __syncthreads();

    // The loads: thread (rows load_row + j * kRowsPerLoad, columns load_col .. load_col + kPerLoad - 1 of the tile).
    const int64_t first_col = static_cast<int64_t>(blockIdx.y) * kTileCols;
    const unsigned load_row = warp_idx * kByteTileRowsPerWarp + lane_idx / Loads::kPerRow;
    const unsigned load_col = lane_idx % Loads::kPerRow * Loads::kPerLoad;
    const int64_t columns_left = args.cols - (first_col + load_col);
    const T* source = static_cast<const T*>(args.in) + first_col + load_col;
    uint4 raw[Loads::kLoads];
#pragma unroll
    for (int j = 0; j < Loads::kLoads; ++j) {
        const int row = source_rows[load_row + j * Loads::kRowsPerLoad];
        raw[j] =
            row >= 0 ? load_chunk<T, kVector>(source + row * args.in_row_stride, columns_left) : make_uint4(0, 0, 0, 0);
    }

    if constexpr (kRowQuantize) {
        quantize_tile_rows<T, kVector>(args, raw, source_rows, row_writer, load_row, load_col, lane_idx, first_col);
    }

    // Each column's amax: the thread's rows, the warp's lanes of the same columns, then the warps.
    uint32_t magnitude[4] = {0, 0, 0, 0};
#pragma unroll
    for (int j = 0; j < Loads::kLoads; ++j) {
        magnitude[0] = max_bits<T>(magnitude[0], raw[j].x & Loads::kMagnitude);
        magnitude[1] = max_bits<T>(magnitude[1], raw[j].y & Loads::kMagnitude);
        magnitude[2] = max_bits<T>(magnitude[2], raw[j].z & Loads::kMagnitude);
        magnitude[3] = max_bits<T>(magnitude[3], raw[j].w & Loads::kMagnitude);
    }
#pragma unroll
    for (int mask = Loads::kPerRow; mask < kWarpSize; mask *= 2) {
#pragma unroll
        for (int w = 0; w < 4; ++w)
            magnitude[w] = max_bits<T>(magnitude[w], __shfl_xor_sync(kFullMask, magnitude[w], mask));
    }
    if (lane_idx < Loads::kPerRow) {
        float column_amax[Loads::kPerLoad];  // exact: a magnitude of T widened
        unpack_chunk<T>(make_uint4(magnitude[0], magnitude[1], magnitude[2], magnitude[3]), column_amax);
#pragma unroll
        for (int k = 0; k < Loads::kPerLoad; k += 4) {
            *reinterpret_cast<uint4*>(&col_max[warp_idx][load_col + k]) =
                make_uint4(__float_as_uint(column_amax[k]), __float_as_uint(column_amax[k + 1]),
                           __float_as_uint(column_amax[k + 2]), __float_as_uint(column_amax[k + 3]));
        }
    }
    __syncthreads();
    if (thread_idx < kTileCols) {
        uint32_t bits = 0;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) bits = max(bits, col_max[w][thread_idx]);
        GroupStats stats;
        stats.amax = __uint_as_float(bits);
        stats.non_finite = bits >= kNonFiniteBits;
        const float scale = group_scale(stats, args.pow2);  // NaN exactly where the column holds a non-finite value
        col_factor[thread_idx] = stats.non_finite ? scale : group_factor(stats, scale, args.pow2);  // NaN: non-finite
        if (first_col + thread_idx < args.cols) args.scales[tile_idx * args.ld_scales + first_col + thread_idx] = scale;
    }
    __syncthreads();

    // The bytes into the tile; the rows past the tile's end 0 (a NaN column's would be 0x7F).
    float factor[Loads::kPerLoad];
#pragma unroll
    for (int k = 0; k < Loads::kPerLoad; k += 4) {
        const float4 four = *reinterpret_cast<const float4*>(&col_factor[load_col + k]);
        factor[k] = four.x;
        factor[k + 1] = four.y;
        factor[k + 2] = four.z;
        factor[k + 3] = four.w;
    }
    uint8_t* const tile_chunk = tile + byte_tile_offset(load_row, load_col);
#pragma unroll
    for (int j = 0; j < Loads::kLoads; ++j) {
        uint32_t words[Loads::kPerLoad / 4] = {};
        if (static_cast<int>(load_row) + j * Loads::kRowsPerLoad < num_rows) {
            float values[Loads::kPerLoad];
            unpack_chunk<T>(raw[j], values);
#pragma unroll
            for (int k = 0; k < Loads::kPerLoad; ++k) {
                words[k / 4] |= uint32_t{quantize_value(values[k], factor[k], isnan(factor[k]))} << (8 * (k % 4));
            }
        }
        uint8_t* target = tile_chunk + j * Loads::kRowsPerLoad * kTileCols;  // row load_row + j * kRowsPerLoad
        if constexpr (Loads::kPerLoad == 8) {
            *reinterpret_cast<uint2*>(target) = make_uint2(words[0], words[1]);
        } else {
            *reinterpret_cast<uint32_t*>(target) = words[0];
        }
    }
    __syncthreads();

    // q_t: the thread's transposed block (8 lanes: 128 bytes of a q_t row).
    const TransposedBlock block = read_transposed_block(tile, thread_idx);
    const int64_t first_q_col = first_col + block.first_col;
    uint8_t* const target = args.q_t + first_q_col * args.ld_q + tile_idx * kTileRows + block.first_row;
#pragma unroll
    for (int c = 0; c < kTransposeCols; ++c) {
        if (first_q_col + c >= args.cols) break;
        *reinterpret_cast<uint4*>(target + c * args.ld_q) =
            make_uint4(block.columns[c][0], block.columns[c][1], block.columns[c][2], block.columns[c][3]);
    }
}

// Whether the source rows take 16-byte loads: whole chunks of 8 columns, every row 16-byte aligned.
bool quantize_expert_rows_vectorizable(const QuantizeExpertRowsArgs& args) {
    const int64_t elem_bytes = args.in_dtype == MEGAMOE_DTYPE_F32 ? 4 : 2;
    return args.cols % 8 == 0 && args.in_row_stride * elem_bytes % kByteTileChunk == 0 &&
           is_aligned(args.in, kByteTileChunk);
}

template <typename T, bool kRowQuantize>
megamoe_status_t launch_for(const QuantizeExpertRowsArgs& args, dim3 grid, cudaStream_t stream) {
    if (quantize_expert_rows_vectorizable(args)) {
        quantize_expert_rows_kernel<T, true, kRowQuantize><<<grid, kThreads, 0, stream>>>(args);
    } else {
        quantize_expert_rows_kernel<T, false, kRowQuantize><<<grid, kThreads, 0, stream>>>(args);
    }
    return check_launch("quantize_expert_rows_kernel");
}

template <typename T>
megamoe_status_t launch_for(const QuantizeExpertRowsArgs& args, dim3 grid, cudaStream_t stream) {
    return args.row_q != nullptr ? launch_for<T, true>(args, grid, stream) : launch_for<T, false>(args, grid, stream);
}

}  // namespace

megamoe_status_t launch_quantize_expert_rows(const QuantizeExpertRowsArgs& args, cudaStream_t stream) {
    if (args.max_tiles == 0 || args.cols == 0) return MEGAMOE_STATUS_SUCCESS;
    if (args.in == nullptr || args.q_t == nullptr || args.scales == nullptr || args.expert_offsets == nullptr ||
        args.m_tile_offsets == nullptr || args.num_experts <= 0 || args.cols < 0 || args.in_row_stride < args.cols ||
        args.max_tiles < 0 || args.max_tiles > INT32_MAX || (args.sorted_slot != nullptr && args.topk <= 0)) {
        return set_error(MEGAMOE_STATUS_INTERNAL_ERROR,
                         "quantize_expert_rows: in, q_t, scales, the routing's offsets, a row stride >= cols and "
                         "0 <= max_tiles < 2^31");
    }
    if (args.ld_q < kTileRows * args.max_tiles) {
        return set_error(MEGAMOE_STATUS_INTERNAL_ERROR,
                         "quantize_expert_rows: ld_q (%lld) must be >= 128 * max_tiles (%lld): tile i at columns "
                         "[128 i, 128 i + 128) of q_t",
                         static_cast<long long>(args.ld_q), static_cast<long long>(kTileRows * args.max_tiles));
    }
    if (args.ld_q % kByteTileChunk != 0 || !is_aligned(args.q_t, kByteTileChunk)) {
        return set_error(MEGAMOE_STATUS_INTERNAL_ERROR,
                         "quantize_expert_rows: ld_q (%lld) must be a multiple of 16 and q_t 16-byte aligned",
                         static_cast<long long>(args.ld_q));
    }
    if (args.ld_scales < args.cols || args.ld_scales % 4 != 0 || !is_aligned(args.scales, kByteTileChunk)) {
        return set_error(MEGAMOE_STATUS_INTERNAL_ERROR,
                         "quantize_expert_rows: ld_scales (%lld) must be >= cols (%lld) and a multiple of 4, scales "
                         "16-byte aligned",
                         static_cast<long long>(args.ld_scales), static_cast<long long>(args.cols));
    }
    if (args.row_q != nullptr &&
        (args.row_scales == nullptr || (args.sorted_slot != nullptr && args.slot_to_row == nullptr) ||
         (args.cols % 8 == 0 && !is_aligned(args.row_q, 8)))) {
        return set_error(MEGAMOE_STATUS_INTERNAL_ERROR,
                         "quantize_expert_rows: row_q needs row_scales, slot_to_row when gathered, and 8-byte "
                         "alignment");
    }
    const dim3 grid(static_cast<unsigned>(args.max_tiles),
                    static_cast<unsigned>(ceil_div(args.cols, static_cast<int64_t>(kTileCols))));
    if (grid.y > 65535) return set_error(MEGAMOE_STATUS_INTERNAL_ERROR, "quantize_expert_rows: more than 2^23 columns");
    switch (args.in_dtype) {
        case MEGAMOE_DTYPE_BF16:
            return launch_for<__nv_bfloat16>(args, grid, stream);
        case MEGAMOE_DTYPE_F16:
            return launch_for<__half>(args, grid, stream);
        default:
            return launch_for<float>(args, grid, stream);
    }
}

}  // namespace megamoe::cuda
