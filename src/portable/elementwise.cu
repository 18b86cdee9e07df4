// Row kernels of the portable CUDA path (math in elementwise.h).
//
// gather_sum: block (token t, column tile); each of 256 threads owns 16 bytes of every source row (8 16-bit or 4 f32
//   values: one load when aligned), loads the token's rows 8 at a time in two rounds (its invalid flag, the rows'
//   indices and weights; then the rows) and adds them in j order: the sum order is fixed, so results are bitwise
//   reproducible. No shared memory.
// dswiglu_rows: dact_rows (layout_rows.cu) with SwiGLU, no b2 and dh as [dg, du].
// finalize_dtopk: one thread per slot.
// fill_nan_if: a grid-stride loop of at most kMaxFillBlocks blocks, which return at once when the flag is 0.
#include "portable/elementwise.h"

#include <algorithm>
#include <type_traits>

#include "device/cuda_utils.h"
#include "portable/layout_rows.h"

namespace megamoe::cuda {
namespace {

constexpr int kGatherThreads = 256;
constexpr int kGatherBytes = 16;  // of a source row per thread: one 16-byte load
constexpr int kGatherBatch = 8;   // source rows whose loads are in flight together
constexpr int kSlotThreads = 256;
constexpr int64_t kMaxGridY = 65535;
constexpr int kFillThreads = 256;
constexpr int64_t kMaxFillBlocks = 1024;

// The columns a gather_sum thread owns of rows of RowT: one 16-byte load (8 16-bit or 4 f32 values).
template <typename RowT>
constexpr int kGatherCols = kGatherBytes / static_cast<int>(sizeof(RowT));

// A thread's kGatherCols<RowT> values of a source row, raw: one 16-byte load when `vec`, else num_valid elements
// (the rest zero).
template <typename RowT>
__device__ __forceinline__ uint4 load_gather_cols(const RowT* src, bool vec, int num_valid) {
    if (vec) return *reinterpret_cast<const uint4*>(src);
    constexpr int kCols = kGatherCols<RowT>;
    uint32_t words[4] = {0, 0, 0, 0};
#pragma unroll
    for (int item_idx = 0; item_idx < kCols; ++item_idx) {
        if (item_idx >= num_valid) break;
        if constexpr (sizeof(RowT) == sizeof(uint32_t)) {
            words[item_idx] = __float_as_uint(src[item_idx]);
        } else {  // two 16-bit values per word, the first in the low half (as pack_pair)
            const uint32_t bits = *reinterpret_cast<const uint16_t*>(src + item_idx);
            words[item_idx / 2] |= bits << (item_idx % 2 * 16);
        }
    }
    return make_uint4(words[0], words[1], words[2], words[3]);
}

// The values of load_gather_cols' 16 bytes as floats.
template <typename RowT>
__device__ __forceinline__ void unpack_gather_cols(const uint4& packed, float (&values)[kGatherCols<RowT>]) {
    const uint32_t words[4] = {packed.x, packed.y, packed.z, packed.w};
#pragma unroll
    for (int word_idx = 0; word_idx < 4; ++word_idx) {
        if constexpr (std::is_same_v<RowT, float>) {
            values[word_idx] = __uint_as_float(words[word_idx]);
        } else {
            unpack_pair<RowT>(words[word_idx], values[2 * word_idx], values[2 * word_idx + 1]);
        }
    }
}

// The kCols sums of a gather_sum thread rounded to T at dst: one 16-byte (8 columns) or 8-byte (4) store when `vec`.
template <typename T, int kCols>
__device__ __forceinline__ void store_gather_cols(T* dst, const float (&acc)[kCols], bool vec, int num_valid) {
    if (vec) {
        uint32_t words[kCols / 2];
#pragma unroll
        for (int word_idx = 0; word_idx < kCols / 2; ++word_idx) {
            words[word_idx] = pack_pair<T>(acc[2 * word_idx], acc[2 * word_idx + 1]);
        }
        if constexpr (kCols == 8) {
            *reinterpret_cast<uint4*>(dst) = make_uint4(words[0], words[1], words[2], words[3]);
        } else {
            *reinterpret_cast<uint2*>(dst) = make_uint2(words[0], words[1]);
        }
    } else {
        for (int item_idx = 0; item_idx < num_valid; ++item_idx) dst[item_idx] = from_float<T>(acc[item_idx]);
    }
}

// Block (token t, column tile); thread i owns kGatherCols<RowT> columns of the tile. The token's source rows go in
// batches of kGatherBatch, each in two rounds of loads: the token's invalid flag, the batch's row indices and weights
// together (none depends on another), then the batch's rows; they are added in j order (fmaf, skipping dropped
// slots): the sum order is fixed. An invalid token's columns are NaN. The output is in args.out_dtype: RowT for 16-bit
// rows, chosen at run time (one branch at the store) for f32 rows.
template <typename RowT>
__global__ void __launch_bounds__(kGatherThreads) gather_sum_kernel(const GatherSumArgs args, bool vec) {
    constexpr int kCols = kGatherCols<RowT>;
    const int64_t token_idx = blockIdx.x;
    const int64_t col = (static_cast<int64_t>(blockIdx.y) * kGatherThreads + threadIdx.x) * kCols;
    if (col >= args.num_cols) return;
    const int num_valid = static_cast<int>(min(static_cast<int64_t>(kCols), args.num_cols - col));
    const RowT* rows = static_cast<const RowT*>(args.rows) + col;
    const int token_invalid = args.token_invalid[token_idx];
    float acc[kCols] = {};
    for (int64_t first_choice = 0; first_choice < args.topk; first_choice += kGatherBatch) {
        int row_idx[kGatherBatch];
        float weight[kGatherBatch];
        uint4 packed[kGatherBatch];
#pragma unroll
        for (int batch_idx = 0; batch_idx < kGatherBatch; ++batch_idx) {
            const int64_t choice_idx = first_choice + batch_idx;
            const int64_t slot_idx = token_idx * args.topk + choice_idx;
            const bool in_topk = choice_idx < args.topk;
            row_idx[batch_idx] = in_topk ? args.slot_to_row[slot_idx] : -1;
            weight[batch_idx] = in_topk ? load_weight(args.weights, args.weights_dtype, slot_idx) : 0.0f;
        }
        if (token_invalid != 0) break;
#pragma unroll
        for (int batch_idx = 0; batch_idx < kGatherBatch; ++batch_idx) {
            if (row_idx[batch_idx] >= 0) {
                packed[batch_idx] = load_gather_cols(rows + row_idx[batch_idx] * args.num_cols, vec, num_valid);
            }
        }
#pragma unroll
        for (int batch_idx = 0; batch_idx < kGatherBatch; ++batch_idx) {
            if (row_idx[batch_idx] < 0) continue;
            float values[kCols];
            unpack_gather_cols<RowT>(packed[batch_idx], values);
#pragma unroll
            for (int item_idx = 0; item_idx < kCols; ++item_idx) {
                acc[item_idx] = fmaf(weight[batch_idx], values[item_idx], acc[item_idx]);
            }
        }
    }
    if (token_invalid != 0) {
        for (int item_idx = 0; item_idx < kCols; ++item_idx) acc[item_idx] = __int_as_float(0x7fc00000);
    }
    if constexpr (!std::is_same_v<RowT, float>) {
        store_gather_cols(static_cast<RowT*>(args.out) + token_idx * args.num_cols + col, acc, vec, num_valid);
    } else if (args.out_dtype == MEGAMOE_DTYPE_BF16) {
        store_gather_cols(static_cast<__nv_bfloat16*>(args.out) + token_idx * args.num_cols + col, acc, vec, num_valid);
    } else {
        store_gather_cols(static_cast<__half*>(args.out) + token_idx * args.num_cols + col, acc, vec, num_valid);
    }
}

__global__ void __launch_bounds__(kSlotThreads) finalize_dtopk_kernel(const FinalizeDTopkArgs args) {
    const int64_t slot_idx = static_cast<int64_t>(blockIdx.x) * kSlotThreads + threadIdx.x;
    if (slot_idx >= args.num_slots) return;
    float value = 0.0f;
    if (args.token_invalid[slot_idx / args.topk] != 0) {
        value = __int_as_float(0x7fc00000);
    } else {
        const int row_idx = args.slot_to_row[slot_idx];
        if (row_idx >= 0) {
            for (int64_t part_idx = 0; part_idx < args.num_ds_parts; ++part_idx) {
                value += args.ds_parts[row_idx * args.num_ds_parts + part_idx];
            }
        }
    }
    store_scalar(args.dtopk_weights, args.dtopk_dtype, slot_idx, value);
}

// data holds 32-bit elements (f32) or 16-bit ones, nan the element's bits.
__global__ void __launch_bounds__(kFillThreads)
    fill_nan_if_kernel(const int* flag, void* data, bool wide, int64_t count, uint32_t nan) {
    if (*flag == 0) return;
    const int64_t stride = static_cast<int64_t>(gridDim.x) * kFillThreads;
    for (int64_t idx = static_cast<int64_t>(blockIdx.x) * kFillThreads + threadIdx.x; idx < count; idx += stride) {
        if (wide) {
            static_cast<uint32_t*>(data)[idx] = nan;
        } else {
            static_cast<uint16_t*>(data)[idx] = static_cast<uint16_t>(nan);
        }
    }
}

}  // namespace

megamoe_status_t launch_fill_nan_if(const int* flag, void* data, megamoe_dtype_t dtype, int64_t count,
                                    cudaStream_t stream) {
    if (data == nullptr || count == 0) return MEGAMOE_STATUS_SUCCESS;
    const dim3 grid(static_cast<unsigned>(std::min(ceil_div(count, kFillThreads), kMaxFillBlocks)));
    const bool wide = dtype == MEGAMOE_DTYPE_F32;  // else bf16 or f16: the quiet NaN of each
    const uint32_t nan = wide ? 0x7fc00000u : (dtype == MEGAMOE_DTYPE_BF16 ? 0x7fc0u : 0x7e00u);
    fill_nan_if_kernel<<<grid, kFillThreads, 0, stream>>>(flag, data, wide, count, nan);
    return check_launch("fill_nan_if_kernel");
}

megamoe_status_t launch_gather_sum(const GatherSumArgs& args, cudaStream_t stream) {
    const bool rows_f32 = args.rows_dtype == MEGAMOE_DTYPE_F32;
    const int64_t cols_per_thread = rows_f32 ? kGatherCols<float> : kGatherCols<uint16_t>;
    const int64_t num_col_tiles = ceil_div(args.num_cols, kGatherThreads * cols_per_thread);
    if (args.num_tokens == 0 || num_col_tiles == 0) return MEGAMOE_STATUS_SUCCESS;
    if (num_col_tiles > kMaxGridY) {
        return set_error(MEGAMOE_STATUS_NOT_SUPPORTED, "gather_sum: %lld columns are too many",
                         static_cast<long long>(args.num_cols));
    }
    const bool vec = args.num_cols % cols_per_thread == 0 && is_aligned(args.rows, kGatherBytes) &&
                     is_aligned(args.out, cols_per_thread * sizeof(uint16_t));
    const dim3 grid(static_cast<unsigned>(args.num_tokens), static_cast<unsigned>(num_col_tiles));
    if (rows_f32) {
        gather_sum_kernel<float><<<grid, kGatherThreads, 0, stream>>>(args, vec);
    } else {
        with_element_type(args.out_dtype, [&](auto tag) {
            gather_sum_kernel<typename decltype(tag)::Type><<<grid, kGatherThreads, 0, stream>>>(args, vec);
        });
    }
    return check_launch("gather_sum_kernel");
}

megamoe_status_t launch_dswiglu_rows(const DSwiGLUArgs& args, cudaStream_t stream) {
    DActArgs dact{};  // the default options: dh as [dg, du], no b2
    static_cast<DSwiGLUArgs&>(dact) = args;
    dact.activation = {MEGAMOE_ACTIVATION_SWIGLU, 0.0f, 0.0f};
    return launch_dact_rows(dact, stream);
}

megamoe_status_t launch_finalize_dtopk(const FinalizeDTopkArgs& args, cudaStream_t stream) {
    if (args.num_slots == 0) return MEGAMOE_STATUS_SUCCESS;
    const dim3 grid(static_cast<unsigned>(ceil_div(args.num_slots, kSlotThreads)));
    finalize_dtopk_kernel<<<grid, kSlotThreads, 0, stream>>>(args);
    return check_launch("finalize_dtopk_kernel");
}

}  // namespace megamoe::cuda
