// The steps of the portable CUDA path whose kernels depend on the expert options (layout, activation, biases;
// call.h), for cuda_path.cu's forward and backward. Each takes the GEMM arguments of the default layout, as
// cuda_path.cu builds them, and runs the default's very kernels when call.default_experts; otherwise it reads the
// weights in place in their layout (no copy):
//   up       gated GEMM: B rows by the layout (kNK, or kKN when w13 is transposed; interleaved rows paired in the
//            tile, concatenated / separate up rows through b_up), b13 and the activation in the epilogue
//   down     w2 transposed: kKN B; b2 added in the element-type epilogue
//   dH       p = dy W2[e]^T: kKN B, or kNK when w2 is transposed
//   dact     the row kernel of activation.h (layout_rows.h): dh in the order of w13's rows, ds with <dy, b2[e]>
//   dX       q = dh W13[e]: dh in w13's row order is the K dimension as stored (kKN, kNK when transposed); the
//            separate layout as two GEMMs, the up half added onto the gate half's f32 q
//   dW13     K-grouped over dh and x: out [E, 2I, H] as stored, operands swapped for a transposed w13 ([E, H, 2I]);
//            separate: dw13 from dh's gate half, dw3 from its up half
//   dW2      K-grouped over dy and s a, operands swapped for a transposed w2
//   biases   db13 = column sums of dh per expert, db2 = of s dy (layout_rows.h)
// Every gradient only when wanted, in the layout of its parameter, accumulated when the call says so.
#pragma once

#include <cuda_runtime.h>

#include "path/call.h"
#include "portable/elementwise.h"
#include "portable/grouped_gemm.h"
#include "portable/routing.h"

namespace megamoe::cuda {

// A K-grouped weight gradient whose output is stored transposed: C^T = B^T A, the operands swapped.
KGroupedGemmArgs swapped_operands(const KGroupedGemmArgs& args);

// h = [g, u] (+ b13) into h (may be NULL) and a = act(g, u) into act (may be NULL); args: the default up GEMM.
megamoe_status_t launch_up(const Call& call, const MGroupedGemmArgs& args, void* h, void* act, cudaStream_t stream);
// o = W2[e] a (+ b2[e]) in the element type; args: the default down GEMM.
megamoe_status_t launch_down(const Call& call, const MGroupedGemmArgs& args, void* out, cudaStream_t stream);
// p [rows, I] f32; args: the default dH GEMM.
megamoe_status_t launch_d_hidden(const Call& call, const MGroupedGemmArgs& args, float* p, cudaStream_t stream);
// dh (the layout's row order), s * a and ds per row; args: the default row kernel's.
megamoe_status_t launch_d_act(const BackwardCall& call, const DSwiGLUArgs& args, cudaStream_t stream);
// q [rows, H] f32; args: the default dX GEMM.
megamoe_status_t launch_d_input(const Call& call, const MGroupedGemmArgs& args, float* q, cudaStream_t stream);
// dw13 (and dw3) on the portable K-grouped kernel; args: the default dW13 GEMM.
megamoe_status_t launch_dw13(const BackwardCall& call, const KGroupedGemmArgs& args, cudaStream_t stream);
// dw2 on the portable K-grouped kernel; args: the default dW2 GEMM.
megamoe_status_t launch_dw2(const BackwardCall& call, const KGroupedGemmArgs& args, cudaStream_t stream);
// db13 from dh and db2 from dy (each when wanted).
megamoe_status_t launch_bias_grads(const BackwardCall& call, const RoutingBuffers& routing, const void* dh,
                                   cudaStream_t stream);

}  // namespace megamoe::cuda
