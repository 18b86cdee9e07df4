// The fused Hopper (sm_90a) K-grouped GEMM of the weight gradients (k_grouped/gemm.cu): the same math as the
// portable launch_k_grouped_gemm of portable/grouped_gemm.h,
//     C_e[m, n] = sum over the sorted rows r of expert e of A[a_row(r), m] * B[b_row(r), n],
// run by a persistent warp-specialized wgmma kernel in clusters of 2 CTAs, in which one CTA owns one output tile and
// loops over all of its expert's rows (no split-K, no atomics: deterministic; an expert with no rows writes zeros).
// An ungathered operand comes by TMA (multicast within the pair), a gathered one by cp.async.
//
// Requirements (k_grouped_gemm_sm90_supported checks them; the caller falls back to the portable kernel): bf16 or
// f16 operands, M % 8 == 0 and N % 8 == 0, A / B rows and their starts 16-byte aligned (16-byte cp.async, TMA) with
// row strides below 2^31, out 16-byte aligned. The number of rows per expert is arbitrary.
#pragma once

#include <cuda_runtime.h>

#include "common.h"
#include "device/grouped_gemm_args.h"

namespace megamoe::sm90 {

bool k_grouped_gemm_sm90_supported(const cuda::KGroupedGemmArgs& args, const void* out);

// C_e into out [E, M, N] (contiguous), dtype out_dtype: the element type or f32. `num_sms`: the persistent grid.
megamoe_status_t launch_k_grouped_gemm_sm90(const cuda::KGroupedGemmArgs& args, void* out, megamoe_dtype_t out_dtype,
                                            int num_sms, cudaStream_t stream);

}  // namespace megamoe::sm90
