// Grouped GEMMs of the portable CUDA path (any sm_80+ GPU; mma.sync m16n8k16, f32 accumulators).
//
// M-grouped (one weight matrix per expert, the rows of the expert are the M dimension):
//     out[r, n] = sum_k A[a_row(r), k] * B_e(n, k)       for the sorted rows r of expert e
//   a_row(r) = r, or the token of sorted_slot[r] (sorted_slot[r] / topk) when A is gathered.
//   B_e is b + e * b_expert_stride, stored [N, K] (BLayout::kNK, K contiguous) or [K, N] (kKN).
//   Epilogues: f32 store (or add), element-type store (plus a bias), or the gated activation of the up projection
//   for every layout, activation and b13 (launch_m_grouped_gemm_gated: each N tile holds matching gate and up rows,
//   so h = [g, u] and a = act(g, u) come straight from registers; the default options' SwiGLU is one case of it).
//   The grid is sized by host-known bounds; tiles come from the routing's m_tile_offsets.
//
// K-grouped (the weight gradients; the rows of the expert are the reduction dimension):
//     C_e[m, n] = sum over the rows r of expert e of A[a_row(r), m] * B[b_row(r), n]
//   with the same gather rule on either side. One block owns one output tile and loops over all the
//   expert's rows (no split-K): deterministic, and an expert with no rows writes exact zeros.
//   With `accumulate` the output is f32 and C_e is added into it (out = out + C_e, each element by one thread, once),
//   and an expert with no rows leaves its part of out untouched.
//
// Sizes are arbitrary (no multiple-of requirements); 16-byte cp.async loads are used when every
// operand row is 16-byte aligned, element loads with zero fill otherwise.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "activation.h"
#include "common.h"
#include "device/grouped_gemm_args.h"

namespace megamoe::cuda {

// out[r, n] in f32, row stride ldo; `accumulate`: added to the values out holds (out[r, n] += ..., one thread per
// element: the dX GEMM of the separate layout runs as two GEMMs, gate then up).
megamoe_status_t launch_m_grouped_gemm_f32(const MGroupedGemmArgs& args, BLayout b_layout, float* out, int64_t ldo,
                                           cudaStream_t stream, bool accumulate = false);

// out[r, n] in the element type, row stride ldo, plus args.bias[e, n] when given (the down GEMM's b2).
megamoe_status_t launch_m_grouped_gemm_elem(const MGroupedGemmArgs& args, BLayout b_layout, void* out, int64_t ldo,
                                            cudaStream_t stream);

// Up projection of the default options: launch_m_grouped_gemm_gated with B = w13 [E, 2I, H] (kNK, gate rows then up
// rows), args.n = I, SwiGLU, no bias; args' b_up, interleaved, bias and activation are not read.
megamoe_status_t launch_m_grouped_gemm_swiglu(const MGroupedGemmArgs& args, void* h, void* act, cudaStream_t stream);

// The up projection of every layout, activation and b13: the canonical gate row j is row (kKN: column) j of B_e, or
// 2j when args.interleaved; the up row j is row j of b_up's expert, or 2j + 1 of B_e. Writes h = [g, u] + b13
// ([rows, 2I] by sorted row, canonical order: the layout of saved_h) and a = args.activation.forward(g, u)
// (activation.h, PreciseMath) in the element type ([rows, I]); h and act may be NULL (not written).
megamoe_status_t launch_m_grouped_gemm_gated(const MGroupedGemmArgs& args, BLayout b_layout, void* h, void* act,
                                             cudaStream_t stream);

// C_e into out [E, M, N] (contiguous), dtype out_dtype: the element type or f32 (f32 only with args.accumulate).
megamoe_status_t launch_k_grouped_gemm(const KGroupedGemmArgs& args, void* out, megamoe_dtype_t out_dtype,
                                       cudaStream_t stream);

}  // namespace megamoe::cuda
