// The blockwise FP8 launches (m_grouped_fp8_gemm_sm90.h) on the M-grouped kernel of m_grouped_kernel.cuh: the
// Fp8RescaledCooperative tile (m_grouped_config.cuh: 128 x 256 x 128-byte K blocks, a K group per stage, one set of
// accumulators in the current group's units) or, under MEGAMOE_SM90_FP8_PROMOTE=1, Fp8Cooperative (128 x 128, a
// second set promoted per group): m_grouped_fp8_mainloop.cuh. B kNK, the store and SwiGLU epilogues of the 16-bit
// kernels.
#include "sm90/m_grouped_fp8_gemm_sm90.h"

#include <type_traits>

#include "device/cuda_utils.h"
#include "sm90/m_grouped_fp8_epilogue.cuh"
#include "sm90/m_grouped_kernel.cuh"

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

template <class Epi, class Config>
megamoe_status_t launch_fp8(const cuda::MGroupedGemmArgs& args, const Fp8BlockScales& scales,
                            const typename Epi::Params& epilogue, int num_sms, cudaStream_t stream,
                            const CUtensorMap& a_map, const CUtensorMap& out_map) {
    const int64_t b_rows = Epi::kGateUpPairs ? 2 * args.n : args.n;
    if constexpr (std::is_same_v<Config, Fp8RescaledCooperative>) {
        if (!fp8_column_halves()) {  // the same tile and math with full-width wgmmas (MEGAMOE_SM90_FP8_HALVES=1: not)
            return launch_on<Epi, BLayout::kNK, BSource::kOne, Fp8RescaledFullNCooperative>(
                args, epilogue, num_sms, stream, a_map, out_map, make_scale_params(args, scales, b_rows));
        }
    }
    return launch_on<Epi, BLayout::kNK, BSource::kOne, Config>(args, epilogue, num_sms, stream, a_map, out_map,
                                                               make_scale_params(args, scales, b_rows));
}

// The sorted-row store (A by TMA) or the gathered one (A by cp.async).
template <bool kSortedA, class Config>
megamoe_status_t launch_store(const cuda::MGroupedGemmArgs& args, const Fp8BlockScales& scales, void* out, int64_t ldo,
                              int64_t num_out_rows, int num_sms, cudaStream_t stream) {
    using Epi = StoreEpilogueOf<false, kSortedA>;
    typename Epi::Params params{};
    params.out = out;
    params.ldo = ldo;
    CUtensorMap out_map{};
    params.tma_store = encode_store_out_map<Config>(args, out, ldo, num_out_rows, &out_map);
    CUtensorMap a_map{};
    if (kSortedA && !encode_sorted_a_map<Config>(args, args.a, args.num_a_rows, args.lda, &a_map)) {
        return set_error(MEGAMOE_STATUS_CUDA_ERROR, "m_grouped_fp8_gemm_sm90: cuTensorMapEncodeTiled failed for A");
    }
    return launch_fp8<Epi, Config>(args, scales, params, num_sms, stream, a_map, out_map);
}

// The SwiGLU epilogue that quantizes a as well (the rescaled tile); A sorted (by TMA) or gathered (by cp.async).
template <bool kSortedA>
megamoe_status_t launch_gated_quantized(const cuda::MGroupedGemmArgs& args, const Fp8BlockScales& scales, void* h,
                                        void* act, const Fp8QuantizedAct& act_q, int num_sms, cudaStream_t stream) {
    using Epi = QuantizedSwiGLUEpilogueOf<kSortedA>;
    typename Epi::Params params{};
    params.out = act;
    params.ldo = args.n;
    params.h = h;
    params.act_q = act_q.q;
    params.act_scales = act_q.scales;
    params.pow2 = act_q.pow2;
    CUtensorMap a_map{};
    if (kSortedA && !encode_sorted_a_map<Fp8RescaledCooperative>(args, args.a, args.num_a_rows, args.lda, &a_map)) {
        return set_error(MEGAMOE_STATUS_CUDA_ERROR, "m_grouped_fp8_gemm_sm90: cuTensorMapEncodeTiled failed for A");
    }
    return launch_fp8<Epi, Fp8RescaledCooperative>(args, scales, params, num_sms, stream, a_map, CUtensorMap{});
}

template <class Config>
megamoe_status_t launch_gated(const cuda::MGroupedGemmArgs& args, const Fp8BlockScales& scales, void* h, void* act,
                              int num_sms, cudaStream_t stream) {
    using Epi = SwiGLUEpilogue;
    typename Epi::Params params{};
    params.out = act;
    params.ldo = args.n;
    params.h = h;
    return launch_fp8<Epi, Config>(args, scales, params, num_sms, stream, CUtensorMap{}, CUtensorMap{});
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
    if (fp8_promoted()) {
        return args.a_gather_slots == nullptr
                   ? launch_store<true, Fp8Cooperative>(args, scales, out, ldo, num_out_rows, num_sms, stream)
                   : launch_store<false, Fp8Cooperative>(args, scales, out, ldo, num_out_rows, num_sms, stream);
    }
    return args.a_gather_slots == nullptr
               ? launch_store<true, Fp8RescaledCooperative>(args, scales, out, ldo, num_out_rows, num_sms, stream)
               : launch_store<false, Fp8RescaledCooperative>(args, scales, out, ldo, num_out_rows, num_sms, stream);
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
        if (fp8_promoted()) {
            return set_error(MEGAMOE_STATUS_NOT_SUPPORTED,
                             "m_grouped_fp8_gemm_sm90: quantizing a needs the default mainloop, not "
                             "MEGAMOE_SM90_FP8_PROMOTE=1 (a tile's output columns must be one scale group)");
        }
        return args.a_gather_slots == nullptr && act_q->a_tma
                   ? launch_gated_quantized<true>(args, scales, h, act, *act_q, num_sms, stream)
                   : launch_gated_quantized<false>(args, scales, h, act, *act_q, num_sms, stream);
    }
    return fp8_promoted() ? launch_gated<Fp8Cooperative>(args, scales, h, act, num_sms, stream)
                          : launch_gated<Fp8RescaledCooperative>(args, scales, h, act, num_sms, stream);
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
    if (fp8_promoted()) {
        return set_error(MEGAMOE_STATUS_NOT_SUPPORTED,
                         "m_grouped_fp8_gemm_sm90: dH needs the default mainloop, not MEGAMOE_SM90_FP8_PROMOTE=1");
    }
    *num_ds_parts = ceil_div(args.n, int64_t{Fp8RescaledCooperative::kBlockN});
    const auto launch = [&](auto epilogue_policy) {
        using Epi = decltype(epilogue_policy);
        CUtensorMap a_map{};  // Epi::kTmaA: dy's quantized rows in sorted-row order, by boxes of kBlockM rows
        if (Epi::kTmaA && !encode_sorted_a_map<Fp8RescaledCooperative>(args, epilogue.a_sorted, epilogue.a_sorted_rows,
                                                                       args.k, &a_map)) {
            return set_error(MEGAMOE_STATUS_CUDA_ERROR, "m_grouped_fp8_gemm_sm90: cuTensorMapEncodeTiled failed for A");
        }
        return launch_fp8<Epi, Fp8RescaledCooperative>(args, scales,
                                                       make_dswiglu_params<typename Epi::Activation>(epilogue), num_sms,
                                                       stream, a_map, CUtensorMap{});
    };
    const bool quantize_dh = epilogue.dh_q != nullptr;
    if (epilogue.a_sorted != nullptr) {  // dy quantized in sorted-row order (MEGAMOE_FP8_SORTED_DY=1): A by TMA
        if (quantize_dh || epilogue.dh_interleaved || epilogue.activation.is_clamped() ||
            !cuda::is_aligned(epilogue.a_sorted, 16) || epilogue.a_sorted_rows <= 0 ||
            epilogue.a_sorted_rows > INT32_MAX) {
            return set_error(MEGAMOE_STATUS_INTERNAL_ERROR,
                             "m_grouped_fp8_gemm_sm90: a sorted dy needs SwiGLU, dh in the [dg, du] order and not "
                             "quantized, 16-byte aligned rows");
        }
        return launch(DSwiGLUEpilogueOf<SwiGLUActivation, false, true, false>{});
    }
    if (quantize_dh && (epilogue.dh_interleaved || epilogue.dh_scales == nullptr ||
                        !cuda::is_aligned(epilogue.dh_q, 8) || !cuda::is_aligned(epilogue.dh_scales, 4))) {
        return set_error(MEGAMOE_STATUS_INTERNAL_ERROR,
                         "m_grouped_fp8_gemm_sm90: dh quantized needs the [dg, du] order, 8-byte aligned bytes and "
                         "4-byte aligned scales");
    }
    if (epilogue.activation.is_clamped()) {
        if (quantize_dh) return launch(DSwiGLUEpilogueOf<ClampedSwiGLUActivation, false, false, true>{});
        return epilogue.dh_interleaved ? launch(DSwiGLUEpilogueOf<ClampedSwiGLUActivation, true>{})
                                       : launch(DSwiGLUEpilogueOf<ClampedSwiGLUActivation, false>{});
    }
    if (quantize_dh) return launch(DSwiGLUEpilogueOf<SwiGLUActivation, false, false, true>{});
    return epilogue.dh_interleaved ? launch(DSwiGLUEpilogueOf<SwiGLUActivation, true>{})
                                   : launch(DSwiGLUEpilogueOf<SwiGLUActivation, false>{});
}

}  // namespace megamoe::sm90
