// The fused Hopper (sm_90a) M-grouped GEMMs (m_grouped/gemm.cu): the same math as the portable
// launch_m_grouped_gemm_* of portable/grouped_gemm.h, run by a persistent warp-specialized wgmma kernel. Forward: B =
// w13 or w2 read [N, K] (BLayout::kNK), outputs in the element type. Backward: the recomputed up projection (h),
// dH (B = w2[e] read [K = H, N = I], BLayout::kKN, with the dSwiGLU epilogue) and dX (B = w13[e] read [K = 2I, N = H],
// kKN, element type out).
//
// Requirements (m_grouped_gemm_sm90_supported checks them; the caller falls back to the portable kernels):
// a device of compute capability 9.0, bf16 or f16, K % 8 == 0 and N % 8 == 0, every A / B row start 16-byte
// aligned (16-byte cp.async rows and TMA strides), output rows 16-byte aligned (16-byte stores). M, N and K are
// otherwise arbitrary: rows past an expert's end, N tails and K tails are zero-filled or masked.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "activation.h"
#include "common.h"
#include "device/grouped_gemm_args.h"

namespace megamoe::sm90 {

// Whether this build's M-grouped tile order forms pair blocks (m_grouped/tile_order.h; MEGAMOE_M_PAIR_BLOCK_MIB > 0).
bool m_grouped_pair_blocks_built();

// Whether the sm_90a kernels take these operands (dtype, alignment, sizes, the driver's TMA encoder).
// `swiglu`: args describe the up projection (B_e has 2 * args.n rows; kNK only).
bool m_grouped_gemm_sm90_supported(const cuda::MGroupedGemmArgs& args, bool swiglu,
                                   cuda::BLayout b_layout = cuda::BLayout::kNK);

// The expert options of the up projection's gated epilogue (all zero: the default, SwiGLU on concatenated rows).
struct GatedArgs {
    Activation<float> activation;  // SwiGLU or clamped SwiGLU (limit, alpha)
    const void* bias;              // b13 [E, 2I] arranged as w13's rows, or NULL
    bool interleaved;              // w13's gate / up rows (columns when transposed) interleaved: g_i 2i, u_i 2i + 1
    cuda::BLayout b_layout;        // kNK: w13 [E, 2I, H]; kKN: stored transposed, [E, H, 2I] (args.ldb = 2I)
};

// Up projection with the gated activation (B = w13, args.n = I): h = [g, u] (+ b13; [rows, 2I] by sorted row, the
// layout of saved_h whatever w13's) and a = act(g, u) ([rows, I]) in the element type; either may be NULL. `num_sms`:
// bound on the persistent kernel's grid (the number of co-resident clusters of the device is asked of the runtime).
megamoe_status_t launch_m_grouped_gemm_sm90_gated(const cuda::MGroupedGemmArgs& args, void* h, void* act, int num_sms,
                                                  cudaStream_t stream, const GatedArgs& options = GatedArgs{});

// What the dH GEMM's dSwiGLU epilogue reads and writes besides its accumulators p = W2[e]^T dy.
struct DSwiGLUEpilogueArgs {
    const void* h;                  // [rows, 2I]: [g, u] by sorted row
    void* dh;                       // [rows, 2I] out: [dg, du] by sorted row (may be h itself: written in place)
    void* act;                      // [rows, I] out: s * silu(g) * u, the dW2 operand
    float* ds_parts;                // [rows, parts] out: ds per row and n-tile (parts: the launch's num_ds_parts)
    const void* weights;            // topk_weights [T * topk]; s of row r = weights[a_gather_slots[r]] (NULL: 1)
    megamoe_dtype_t weights_dtype;  // f32 or the element type
    Activation<float> activation;   // SwiGLU or clamped SwiGLU
    bool dh_interleaved;            // dh in the interleaved layout's row order (then dh must not be h)
    cuda::BLayout b_layout;         // kKN: w2 [E, H, I]; kNK: stored transposed, [E, I, H]
};

// The most partial sums of ds per row that launch_m_grouped_gemm_sm90_dswiglu writes (one per 256-column n-tile of
// I): what ds_parts must hold per row.
int64_t dswiglu_sm90_max_ds_parts(int64_t intermediate);

// dH with dSwiGLU fused (A = dy gathered by sorted slot, B = w2[e] read [K = H, N = I] (kKN; kNK when transposed),
// args.n = I): p never leaves registers; writes dh, s * a and the ds partial sums <p, a> of `epilogue` (math of
// cuda::launch_dswiglu_rows, or of the activation's backward). *num_ds_parts: the partial sums it writes per row
// (the row stride of ds_parts; at most dswiglu_sm90_max_ds_parts(I)).
megamoe_status_t launch_m_grouped_gemm_sm90_dswiglu(const cuda::MGroupedGemmArgs& args,
                                                    const DSwiGLUEpilogueArgs& epilogue, int num_sms,
                                                    cudaStream_t stream, int64_t* num_ds_parts);

// out[r, n] = sum_k A[a_row(r), k] B_e(n, k) in the element type, row stride ldo (a multiple of 8); B_e stored
// [N, K] (kNK) or [K, N] (kKN). `out` holds num_out_rows rows (at least the sorted rows, expert_offsets[E]; the
// extent of the TMA stores' tensor map). `bias`: b2 [E, N] added to each row of expert e (NULL: none).
megamoe_status_t launch_m_grouped_gemm_sm90_store(const cuda::MGroupedGemmArgs& args, cuda::BLayout b_layout, void* out,
                                                  int64_t ldo, int64_t num_out_rows, int num_sms, cudaStream_t stream,
                                                  const void* bias = nullptr);

}  // namespace megamoe::sm90
