// The blockwise FP8 M-grouped GEMMs on Hopper (sm_90a; m_grouped/fp8_gemm.cu): the kernel of
// m_grouped/gemm.cu with e4m3 operands and the recipe's f32 scales (docs/DESIGN.md, FP8), bf16 / f16 out.
//   acc[r, n] = sum_g sa[a_row(r), g] * sb_e[n / 128, g] * sum_{k in group g} A8[a_row(r), k] * B8_e[n, k]
// K groups of 128 (the last one may be partial), B_e in 128 x 128 blocks from its row 0, each group's products summed
// by the FP8 wgmma (whose internal accumulation keeps fewer bits than f32: why the recipe scales at least every 128 K)
// and brought into f32 accumulators with its scales once per group, as megamoe.fp8_reference.blockwise_gemm computes
// them up to f32 rounding: the accumulators are kept in the current group's units and rescaled between groups (its
// range limit: docs/DESIGN.md, FP8). a_row(r) = a_gather_slots[r] / topk (A rows gathered by slot: x for the up
// projection) or r (A the sorted rows).
//
// Operands (cuda::MGroupedGemmArgs, whose dtype is the OUTPUT's here, bf16 or f16): args.a e4m3 bytes [num_a_rows, K]
// (lda bytes), args.b e4m3 bytes, B_e = b + e * b_expert_stride stored [N_b, K] K-contiguous (BLayout::kNK only:
// FP8 wgmma reads both operands K-major; the data gradients take the weights' transposed FP8 copies), N_b = N, or 2I
// for the gated up projection (gate rows [0, I), up rows [I, 2I)); no separate w3 (b_up), no bias, not interleaved.
//
// Requirements (m_grouped_fp8_gemm_sm90_supported; the caller falls back or refuses): compute capability 9.0, output
// bf16 or f16, K % 16 == 0 and N % 16 == 0 (16-byte rows), 16-byte aligned A / B / row strides, scales 4-byte
// aligned; the gated GEMM needs I % 128 == 0 (a tile's gate and up halves each inside one scale block).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common.h"
#include "device/grouped_gemm_args.h"
#include "sm90/m_grouped_gemm_sm90.h"

namespace megamoe::sm90 {

// The f32 scales of the two e4m3 operands (fp8_reference: quantize_groups for A, quantize_blocks for B).
struct Fp8BlockScales {
    const float* a;  // [num_a_rows, ceil(K / 128)]: the scale of A row r's K group g at a[r * a_ld + g]
    int64_t a_ld;    // >= ceil(K / 128)
    // B_e's 128 x 128 blocks: [E, ceil(N_b / 128), ceil(K / 128)], contiguous; or, b_transposed, the scales of the
    // weight whose transposed copy B is ([E, ceil(K / 128), ceil(N_b / 128)], launch_quantize_blocks' scales beside its
    // q_t: a square block's transpose keeps its scale), read transposed: the data gradients' B.
    const float* b;
    bool b_transposed = false;
};

// Whether the FP8 kernels take these operands (see the requirements above). `swiglu`: the gated up projection.
bool m_grouped_fp8_gemm_sm90_supported(const cuda::MGroupedGemmArgs& args, const Fp8BlockScales& scales, bool swiglu);

// out[r, n] = acc[r, n] in args.dtype, row stride ldo (a multiple of 8), out holding num_out_rows rows (at least the
// sorted rows). A: the sorted rows (args.a_gather_slots NULL), read by TMA. The down projection (A = a e4m3, B =
// w2 [E, H, I]) and dX (A = dh e4m3 along 2I, B = w13's transposed copy [E, H, 2I] with w13's scales, b_transposed).
megamoe_status_t launch_m_grouped_fp8_gemm_sm90_store(const cuda::MGroupedGemmArgs& args, const Fp8BlockScales& scales,
                                                      void* out, int64_t ldo, int64_t num_out_rows, int num_sms,
                                                      cudaStream_t stream);

// a = silu(g) u quantized by the up projection's epilogue for the down GEMM: the bytes and scales
// launch_quantize_groups makes from the a the 16-bit output holds (rounded to args.dtype first), bit for bit.
struct Fp8QuantizedAct {
    uint8_t* q;     // [rows, I] e4m3 bytes, by sorted row (8-byte aligned)
    float* scales;  // [rows, I / 128]
    bool pow2;      // power-of-two scales
};

// The up projection with SwiGLU (args.n = I, B_e = w13[e] [2I, H] in e4m3): h = [g, u] ([rows, 2I] by sorted row)
// and a = silu(g) * u ([rows, I]) in args.dtype; either may be NULL. `act_q`: a quantized as well (NULL: not; a tile's
// 128 output columns are one scale group). A: x gathered by slot, or (args.a_gather_slots NULL) rows already in sorted
// order, read by cp.async.
megamoe_status_t launch_m_grouped_fp8_gemm_sm90_gated(const cuda::MGroupedGemmArgs& args, const Fp8BlockScales& scales,
                                                      void* h, void* act, int num_sms, cudaStream_t stream,
                                                      const Fp8QuantizedAct* act_q = nullptr);

// dH with dSwiGLU fused, FP8 operands (A = dy e4m3 [T, H] gathered by slot with its 1 x 128 scales along H, B =
// w2's transposed FP8 copy [E, I, H] (kNK) with w2's block scales, b_transposed; args.n = I, args.k = H): the
// epilogue of launch_m_grouped_gemm_sm90_dswiglu (dh, s * a, the ds partial sums from h; epilogue.b_layout is not
// used: B is kNK). SwiGLU, dh in the [dg, du] order (else NOT_SUPPORTED). *num_ds_parts: the partial sums per row
// (256-column n-tiles).
megamoe_status_t launch_m_grouped_fp8_gemm_sm90_dswiglu(const cuda::MGroupedGemmArgs& args,
                                                        const Fp8BlockScales& scales,
                                                        const DSwiGLUEpilogueArgs& epilogue, int num_sms,
                                                        cudaStream_t stream, int64_t* num_ds_parts);

}  // namespace megamoe::sm90
