// The blockwise FP8 launches (m_grouped_fp8_gemm_sm90.h) on the M-grouped kernel of m_grouped/kernel.cuh: the
// Fp8Cooperative tile (m_grouped/config.cuh: 128 x 256 x 128-byte K blocks, a K group per stage, one set of
// accumulators in the current group's units: m_grouped/fp8_mainloop.cuh). B kNK, the store, SwiGLU and dSwiGLU
// epilogues of the 16-bit kernels.
#include "sm90/m_grouped_fp8_gemm_sm90.h"

#include <type_traits>

#include "device/cuda_utils.h"
#include "sm90/m_grouped/fp8_epilogue.cuh"
#include "sm90/m_grouped/kernel.cuh"

namespace megamoe::sm90 {
namespace {

using namespace m_grouped;  // NOLINT(google-build-using-namespace): the kernel, its configuration and epilogues

using cuda::ceil_div;

// The kernel's scale params; `b_rows`: rows of B_e (N, or 2I for gate / up pairs).
Fp8ScaleParams make_scale_params(const cuda::MGroupedGemmArgs& args, const Fp8BlockScales& scales, int64_t b_rows) {
    Fp8ScaleParams params{};
    params.a = scales.a;
    params.a_ld = scales.a_ld;
    params.b = scales.b;
    params.b_block_rows = ceil_div(b_rows, int64_t{kFp8ScaleGroup});
    params.num_k_groups = ceil_div(args.k, int64_t{kFp8ScaleGroup});
    params.b_block_stride = scales.b_transposed ? 1 : params.num_k_groups;
    params.b_group_stride = scales.b_transposed ? params.b_block_rows : 1;
    return params;
}

template <class Epi>
megamoe_status_t launch_fp8(const cuda::MGroupedGemmArgs& args, const Fp8BlockScales& scales,
                            const typename Epi::Params& epilogue, int num_sms, cudaStream_t stream,
                            const CUtensorMap& a_map, const CUtensorMap& out_map) {
    const int64_t b_rows = Epi::kGateUpPairs ? 2 * args.n : args.n;
    return launch_on<Epi, BLayout::kNK, BSource::kOne, Fp8Cooperative>(args, epilogue, num_sms, stream, a_map, out_map,
                                                                       make_scale_params(args, scales, b_rows));
}

// The store GEMM: A the sorted rows, by TMA.
megamoe_status_t launch_store(const cuda::MGroupedGemmArgs& args, const Fp8BlockScales& scales, void* out, int64_t ldo,
                              int64_t num_out_rows, int num_sms, cudaStream_t stream) {
    using Epi = StoreEpilogue;
    typename Epi::Params params{};
    params.out = out;
    params.ldo = ldo;
    CUtensorMap out_map{};
    params.tma_store = encode_store_out_map<Fp8Cooperative>(args, out, ldo, num_out_rows, &out_map);
    CUtensorMap a_map{};
    if (!encode_sorted_a_map<Fp8Cooperative>(args, args.a, args.num_a_rows, args.lda, &a_map)) {
        return set_error(MEGAMOE_STATUS_CUDA_ERROR, "m_grouped_fp8_gemm_sm90: cuTensorMapEncodeTiled failed for A");
    }
    return launch_fp8<Epi>(args, scales, params, num_sms, stream, a_map, out_map);
}

// The SwiGLU epilogue that quantizes a as well; A gathered (by cp.async).
megamoe_status_t launch_gated_quantized(const cuda::MGroupedGemmArgs& args, const Fp8BlockScales& scales, void* h,
                                        void* act, const Fp8QuantizedAct& act_q, int num_sms, cudaStream_t stream) {
    using Epi = QuantizedSwiGLUEpilogue;
    typename Epi::Params params{};
    params.out = act;
    params.ldo = args.n;
    params.h = h;
    params.act_q = act_q.q;
    params.act_scales = act_q.scales;
    params.pow2 = act_q.pow2;
    return launch_fp8<Epi>(args, scales, params, num_sms, stream, CUtensorMap{}, CUtensorMap{});
}

megamoe_status_t launch_gated(const cuda::MGroupedGemmArgs& args, const Fp8BlockScales& scales, void* h, void* act,
                              int num_sms, cudaStream_t stream) {
    using Epi = SwiGLUEpilogue;
    typename Epi::Params params{};
    params.out = act;
    params.ldo = args.n;
    params.h = h;
    return launch_fp8<Epi>(args, scales, params, num_sms, stream, CUtensorMap{}, CUtensorMap{});
}

}  // namespace

bool m_grouped_fp8_gemm_sm90_supported(const cuda::MGroupedGemmArgs& args, const Fp8BlockScales& scales, bool swiglu) {
    constexpr int64_t kMaxTmaCoord = INT32_MAX;
    constexpr int64_t kRowBytes = 16;  // e4m3 rows and strides: whole 16-byte chunks (cp.async, TMA strides)
    const int64_t b_rows = swiglu ? 2 * args.n : args.n;
    const bool dtype_ok = args.dtype == MEGAMOE_DTYPE_BF16 || args.dtype == MEGAMOE_DTYPE_F16;
    const bool sizes_ok = args.n > 0 && args.k > 0 && args.k % kRowBytes == 0 && args.n % kRowBytes == 0 &&
                          args.k <= kMaxTmaCoord && b_rows <= kMaxTmaCoord && args.num_experts <= kMaxTmaCoord &&
                          (!swiglu || args.n % kFp8ScaleGroup == 0);  // gate and up boxes inside one scale block
    const bool a_ok = cuda::is_aligned(args.a, 16) && args.lda % kRowBytes == 0 && args.lda >= args.k &&
                      (args.a_gather_slots != nullptr || (args.num_a_rows > 0 && args.num_a_rows <= kMaxTmaCoord));
    const bool b_ok = cuda::is_aligned(args.b, 16) && args.ldb % kRowBytes == 0 && args.ldb >= args.k &&
                      args.b_expert_stride % kRowBytes == 0;
    const bool scales_ok = scales.a != nullptr && scales.b != nullptr && cuda::is_aligned(scales.a, 4) &&
                           cuda::is_aligned(scales.b, 4) && scales.a_ld >= ceil_div(args.k, int64_t{kFp8ScaleGroup});
    const bool options_ok = args.b_up == nullptr && !args.interleaved && args.bias == nullptr;
    return dtype_ok && sizes_ok && a_ok && b_ok && scales_ok && options_ok && tensor_map_encoder() != nullptr;
}

megamoe_status_t launch_m_grouped_fp8_gemm_sm90_store(const cuda::MGroupedGemmArgs& args, const Fp8BlockScales& scales,
                                                      void* out, int64_t ldo, int64_t num_out_rows, int num_sms,
                                                      cudaStream_t stream) {
    if (!m_grouped_fp8_gemm_sm90_supported(args, scales, false)) {
        return set_error(MEGAMOE_STATUS_NOT_SUPPORTED,
                         "m_grouped_fp8_gemm_sm90: operands the FP8 kernel cannot take (m_grouped_fp8_gemm_sm90.h)");
    }
    if (!cuda::is_aligned(out, 16) || ldo % 8 != 0 || ldo < args.n) {
        return set_error(MEGAMOE_STATUS_NOT_SUPPORTED,
                         "m_grouped_fp8_gemm_sm90: out must be 16-byte aligned, ldo % 8 == 0 and ldo >= n");
    }
    if (args.a_gather_slots != nullptr) {
        return set_error(MEGAMOE_STATUS_NOT_SUPPORTED,
                         "m_grouped_fp8_gemm_sm90: the store GEMM takes A unpermuted (its sorted rows, by TMA)");
    }
    return launch_store(args, scales, out, ldo, num_out_rows, num_sms, stream);
}

megamoe_status_t launch_m_grouped_fp8_gemm_sm90_gated(const cuda::MGroupedGemmArgs& args, const Fp8BlockScales& scales,
                                                      void* h, void* act, int num_sms, cudaStream_t stream,
                                                      const Fp8QuantizedAct* act_q) {
    if (!m_grouped_fp8_gemm_sm90_supported(args, scales, true)) {
        return set_error(MEGAMOE_STATUS_NOT_SUPPORTED,
                         "m_grouped_fp8_gemm_sm90: operands the FP8 kernel cannot take (m_grouped_fp8_gemm_sm90.h)");
    }
    if (!cuda::is_aligned(h, 16) || !cuda::is_aligned(act, 16)) {
        return set_error(MEGAMOE_STATUS_NOT_SUPPORTED, "m_grouped_fp8_gemm_sm90: h and act must be 16-byte aligned");
    }
    if (act_q != nullptr) {
        if (act_q->q == nullptr || act_q->scales == nullptr || !cuda::is_aligned(act_q->q, 8) ||
            !cuda::is_aligned(act_q->scales, 4)) {
            return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT,
                             "m_grouped_fp8_gemm_sm90: act_q needs its bytes (8-byte aligned) and scales (4-byte)");
        }
        return launch_gated_quantized(args, scales, h, act, *act_q, num_sms, stream);
    }
    return launch_gated(args, scales, h, act, num_sms, stream);
}

megamoe_status_t launch_m_grouped_fp8_gemm_sm90_dswiglu(const cuda::MGroupedGemmArgs& args,
                                                        const Fp8BlockScales& scales,
                                                        const DSwiGLUEpilogueArgs& epilogue, int num_sms,
                                                        cudaStream_t stream, int64_t* num_ds_parts) {
    if (!m_grouped_fp8_gemm_sm90_supported(args, scales, false)) {
        return set_error(MEGAMOE_STATUS_NOT_SUPPORTED,
                         "m_grouped_fp8_gemm_sm90: operands the FP8 kernel cannot take (m_grouped_fp8_gemm_sm90.h)");
    }
    const megamoe_status_t outputs_status = check_dswiglu_outputs(epilogue, "m_grouped_fp8_gemm_sm90");
    if (outputs_status != MEGAMOE_STATUS_SUCCESS) return outputs_status;
    if (epilogue.activation.is_clamped() || epilogue.dh_interleaved) {
        return set_error(MEGAMOE_STATUS_NOT_SUPPORTED,
                         "m_grouped_fp8_gemm_sm90: the FP8 dH runs SwiGLU with dh in the [dg, du] order (the FP8 layer "
                         "takes no other activation or layout)");
    }
    *num_ds_parts = ceil_div(args.n, int64_t{Fp8Cooperative::kBlockN});
    return launch_fp8<DSwiGLUEpilogue>(args, scales, make_dswiglu_params<SwiGLUActivation>(epilogue), num_sms, stream,
                                       CUtensorMap{}, CUtensorMap{});
}

}  // namespace megamoe::sm90
