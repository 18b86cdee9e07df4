// Row kernels of the non-default expert options (math in layout_rows.h).
//
// dact_rows: one block of 256 threads per sorted row (blocks past the device-side row count exit at once); thread i
//   handles columns i, i + 256, ... of the row in order, then H columns likewise for <dy, b2[e]>; a fixed shuffle tree
//   and the 8 warp sums in warp order give ds (deterministic). Interleaved dh goes through shared memory (2I
//   elements, dynamic): every thread has read its h values before any dh value is written over the row.
// bias_dot_rows: dact_rows' bias term alone, per sorted row, added to the row's first ds part.
// expert_col_sums: block (expert, 256 columns), one thread per column adding the expert's rows in row order.
#include "portable/layout_rows.h"

#include "device/cuda_utils.h"
#include "device/warp_reduce.cuh"
#include "portable/routing.h"

namespace megamoe::cuda {
namespace {

constexpr int kRowThreads = 256;
constexpr int kColThreads = 256;
constexpr int64_t kMaxGridY = 65535;
constexpr size_t kDefaultSharedBytes = 48 * 1024;

static_assert(kRowThreads % kWarpSize == 0, "row reduction uses whole warps");

template <typename T>
__global__ void __launch_bounds__(kRowThreads) dact_rows_kernel(const DActArgs args) {
    extern __shared__ __align__(16) unsigned char staging_bytes[];  // dh_interleaved: the row's dh [2I]
    __shared__ float warp_sums[kRowThreads / kWarpSize];
    const int64_t row_idx = blockIdx.x;
    if (row_idx >= args.expert_offsets[args.num_experts]) return;
    const int64_t slot_idx = slot_of_row(args.sorted_slot, row_idx);
    const float weight = load_weight(args.weights, args.weights_dtype, slot_idx);
    const int64_t intermediate = args.intermediate;
    const T* h_row = static_cast<const T*>(args.h) + row_idx * 2 * intermediate;
    T* dh_row = static_cast<T*>(args.dh) + row_idx * 2 * intermediate;
    T* act_row = static_cast<T*>(args.act) + row_idx * intermediate;
    const float* p_row = args.p + row_idx * intermediate;
    T* staging = reinterpret_cast<T*>(staging_bytes);

    float partial = 0.0f;
    for (int64_t col = threadIdx.x; col < intermediate; col += kRowThreads) {
        const float gate = to_float(h_row[col]), up = to_float(h_row[intermediate + col]), p = p_row[col];
        const float act = args.activation.forward(gate, up);
        partial = fmaf(p, act, partial);
        float d_gate = 0.0f, d_up = 0.0f;
        args.activation.backward(gate, up, weight * p, &d_gate, &d_up);
        if (args.dh_interleaved) {
            staging[2 * col] = from_float<T>(d_gate);
            staging[2 * col + 1] = from_float<T>(d_up);
        } else {
            dh_row[col] = from_float<T>(d_gate);
            dh_row[intermediate + col] = from_float<T>(d_up);
        }
        act_row[col] = from_float<T>(weight * act);
    }
    if (args.b2 != nullptr) {  // ds = <dy, W2 a + b2[e]>: the bias term
        const int expert_idx = expert_of_m_tile(args.expert_offsets, args.num_experts, static_cast<int>(row_idx));
        const T* dy_row = static_cast<const T*>(args.dy) + (slot_idx / args.topk) * args.hidden;
        const T* bias = static_cast<const T*>(args.b2) + expert_idx * args.hidden;
        for (int64_t col = threadIdx.x; col < args.hidden; col += kRowThreads) {
            partial = fmaf(to_float(dy_row[col]), to_float(bias[col]), partial);
        }
    }
    if (args.dh_interleaved) {
        __syncthreads();  // every h value of the row is read: dh may go over it
        for (int64_t col = threadIdx.x; col < 2 * intermediate; col += kRowThreads) dh_row[col] = staging[col];
    }
    const float ds = block_sum<kRowThreads>(partial, warp_sums);
    if (threadIdx.x == 0) args.ds_rows[row_idx] = ds;
}

// ds_parts[r, 0] += <dy[row of r], b2[e]>: the bias term of ds for the sm_90a dSwiGLU epilogue's partial sums, in
// dact_rows' order (thread i: columns i, i + 256, ...; block_sum), one thread adding it to the row's first part.
template <typename T>
__global__ void __launch_bounds__(kRowThreads) bias_dot_rows_kernel(const BiasDotArgs args) {
    __shared__ float warp_sums[kRowThreads / kWarpSize];
    const int64_t row_idx = blockIdx.x;
    if (row_idx >= args.expert_offsets[args.num_experts]) return;
    const int64_t slot_idx = slot_of_row(args.sorted_slot, row_idx);
    const int expert_idx = expert_of_m_tile(args.expert_offsets, args.num_experts, static_cast<int>(row_idx));
    const T* dy_row = static_cast<const T*>(args.dy) + (slot_idx / args.topk) * args.hidden;
    const T* bias = static_cast<const T*>(args.b2) + expert_idx * args.hidden;
    float partial = 0.0f;
    for (int64_t col = threadIdx.x; col < args.hidden; col += kRowThreads) {
        partial = fmaf(to_float(dy_row[col]), to_float(bias[col]), partial);
    }
    const float dot = block_sum<kRowThreads>(partial, warp_sums);
    if (threadIdx.x == 0) args.ds_parts[row_idx * args.num_ds_parts] += dot;
}

template <typename T>
__global__ void __launch_bounds__(kColThreads) expert_col_sums_kernel(const ExpertColSumsArgs args) {
    const int64_t expert_idx = blockIdx.x;
    const int64_t col = static_cast<int64_t>(blockIdx.y) * kColThreads + threadIdx.x;
    if (col >= args.num_cols) return;
    const int row_begin = args.expert_offsets[expert_idx], row_end = args.expert_offsets[expert_idx + 1];
    if (args.accumulate && row_begin == row_end) return;  // a zero gradient: the accumulated buffer stays as it is
    const T* src = static_cast<const T*>(args.src);
    float acc = 0.0f;
    for (int row_idx = row_begin; row_idx < row_end; ++row_idx) {
        const int64_t slot_idx = slot_of_row(args.gather_slots, row_idx);
        const int64_t src_row = args.gather_slots != nullptr ? slot_idx / args.topk : row_idx;
        const float weight = load_weight(args.weights, args.weights_dtype, slot_idx);
        acc = fmaf(weight, to_float(src[src_row * args.num_cols + col]), acc);
    }
    const int64_t out_idx = expert_idx * args.num_cols + col;
    if (args.out_dtype != MEGAMOE_DTYPE_F32) {
        static_cast<T*>(args.out)[out_idx] = from_float<T>(acc);
    } else if (args.accumulate) {
        float* out = static_cast<float*>(args.out) + out_idx;
        *out = *out + acc;
    } else {
        static_cast<float*>(args.out)[out_idx] = acc;
    }
}

template <typename T>
megamoe_status_t launch_dact_rows_typed(const DActArgs& args, cudaStream_t stream) {
    const dim3 grid(static_cast<unsigned>(args.max_rows));
    const size_t staging_bytes =
        args.dh_interleaved ? static_cast<size_t>(2 * args.intermediate) * sizeof(T) : static_cast<size_t>(0);
    if (staging_bytes > kDefaultSharedBytes) {
        MEGAMOE_CUDA_RETURN_IF_ERROR(check_cuda(
            cudaFuncSetAttribute(dact_rows_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 static_cast<int>(staging_bytes)),
            "dact_rows_kernel: interleaved dh staging (2I elements of shared memory; I too large for this device)"));
    }
    dact_rows_kernel<T><<<grid, kRowThreads, staging_bytes, stream>>>(args);
    return check_launch("dact_rows_kernel");
}

}  // namespace

megamoe_status_t launch_dact_rows(const DActArgs& args, cudaStream_t stream) {
    if (args.max_rows == 0) return MEGAMOE_STATUS_SUCCESS;
    return with_element_type(
        args.dtype, [&](auto tag) { return launch_dact_rows_typed<typename decltype(tag)::Type>(args, stream); });
}

megamoe_status_t launch_bias_dot_rows(const BiasDotArgs& args, cudaStream_t stream) {
    if (args.max_rows == 0) return MEGAMOE_STATUS_SUCCESS;
    const dim3 grid(static_cast<unsigned>(args.max_rows));
    with_element_type(args.dtype, [&](auto tag) {
        bias_dot_rows_kernel<typename decltype(tag)::Type><<<grid, kRowThreads, 0, stream>>>(args);
    });
    return check_launch("bias_dot_rows_kernel");
}

megamoe_status_t launch_expert_col_sums(const ExpertColSumsArgs& args, cudaStream_t stream) {
    const int64_t num_col_tiles = ceil_div(args.num_cols, kColThreads);
    if (args.num_experts == 0 || num_col_tiles == 0) return MEGAMOE_STATUS_SUCCESS;
    if (num_col_tiles > kMaxGridY) {
        return set_error(MEGAMOE_STATUS_NOT_SUPPORTED, "expert_col_sums: %lld columns are too many",
                         static_cast<long long>(args.num_cols));
    }
    if (args.accumulate && args.out_dtype != MEGAMOE_DTYPE_F32) {
        return set_error(MEGAMOE_STATUS_INTERNAL_ERROR, "expert_col_sums: accumulation needs an f32 output");
    }
    const dim3 grid(static_cast<unsigned>(args.num_experts), static_cast<unsigned>(num_col_tiles));
    with_element_type(args.src_dtype, [&](auto tag) {
        expert_col_sums_kernel<typename decltype(tag)::Type><<<grid, kColThreads, 0, stream>>>(args);
    });
    return check_launch("expert_col_sums_kernel");
}

}  // namespace megamoe::cuda
