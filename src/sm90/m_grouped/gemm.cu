// The 16-bit (bf16 / f16) launches of the fused Hopper M-grouped GEMM (m_grouped_gemm_sm90.h): the epilogue policy
// and B layout of each call, on the kernel of m_grouped/kernel.cuh (its contract: that file's opening block).
#include "sm90/m_grouped_gemm_sm90.h"

#include <algorithm>

#include "device/cuda_utils.h"
#include "sm90/m_grouped/kernel.cuh"

namespace megamoe::sm90 {
namespace {

using namespace m_grouped;  // NOLINT(google-build-using-namespace): the kernel, its configuration and epilogues

using cuda::ceil_div;

// The gated (up) epilogue for the call's options: activation Act, b13 (kBias), interleaved pairs, B kNK or kKN.
template <class Act, bool kBias, bool kInterleaved>
megamoe_status_t launch_gated_as(const cuda::MGroupedGemmArgs& args, const GatedArgs& options, void* h, void* act,
                                 int num_sms, cudaStream_t stream) {
    using Epi = GatedEpilogue<GatedOptions<Act, kBias, kInterleaved>>;
    typename Epi::Params epilogue{};
    epilogue.out = act;
    epilogue.ldo = args.n;
    epilogue.h = h;
    if constexpr (Act::kClamped) {
        epilogue.limit = options.activation.limit;
        epilogue.alpha = options.activation.alpha;
    }
    if constexpr (kBias) epilogue.bias = options.bias;
    if constexpr (!kInterleaved) {  // the separate layout: the up half from w3 (args.b_up)
        if (args.b_up != nullptr) {
            return options.b_layout == BLayout::kNK
                       ? launch<Epi, BLayout::kNK, BSource::kUpHalf>(args, epilogue, num_sms, stream)
                       : launch<Epi, BLayout::kKN, BSource::kUpHalf>(args, epilogue, num_sms, stream);
        }
    }
    return options.b_layout == BLayout::kNK ? launch<Epi, BLayout::kNK>(args, epilogue, num_sms, stream)
                                            : launch<Epi, BLayout::kKN>(args, epilogue, num_sms, stream);
}

template <class Act>
megamoe_status_t launch_gated(const cuda::MGroupedGemmArgs& args, const GatedArgs& options, void* h, void* act,
                              int num_sms, cudaStream_t stream) {
    if (options.bias != nullptr) {
        return options.interleaved ? launch_gated_as<Act, true, true>(args, options, h, act, num_sms, stream)
                                   : launch_gated_as<Act, true, false>(args, options, h, act, num_sms, stream);
    }
    return options.interleaved ? launch_gated_as<Act, false, true>(args, options, h, act, num_sms, stream)
                               : launch_gated_as<Act, false, false>(args, options, h, act, num_sms, stream);
}

// The dSwiGLU epilogue for activation Act, dh in the interleaved order or [dg, du]; B = w2 read kKN, or kNK when w2
// is stored transposed. *num_ds_parts: the tile configuration's n-tiles of I, one partial sum of ds each per row.
template <class Act, bool kInterleaved>
megamoe_status_t launch_dswiglu(const cuda::MGroupedGemmArgs& args, const DSwiGLUEpilogueArgs& epilogue, int num_sms,
                                cudaStream_t stream, int64_t* num_ds_parts) {
    using Epi = DSwiGLUEpilogueOf<Act, kInterleaved>;
    *num_ds_parts = ceil_div(args.n, int64_t{ConfigOf<Epi>::kBlockN});
    const typename Epi::Params params = make_dswiglu_params<Act>(epilogue);
    return epilogue.b_layout == BLayout::kKN ? launch<Epi, BLayout::kKN>(args, params, num_sms, stream)
                                             : launch<Epi, BLayout::kNK>(args, params, num_sms, stream);
}

// The store epilogue (kBias: + b2[e]) on B read b_layout.
template <bool kBias>
megamoe_status_t launch_store(const cuda::MGroupedGemmArgs& args, BLayout b_layout, void* out, int64_t ldo,
                              int64_t num_out_rows, int num_sms, cudaStream_t stream, const void* bias) {
    using Epi = StoreEpilogueOf<kBias>;
    typename Epi::Params params{};
    if constexpr (kBias) params.bias = bias;
    params.out = out;
    params.ldo = ldo;
    CUtensorMap out_map{};
    params.tma_store = encode_store_out_map<ConfigOf<Epi>>(args, out, ldo, num_out_rows, &out_map);
    // A (not gathered: the caller checked m_grouped_gemm_sm90_supported) by TMA boxes of kBlockM rows x kBlockK, zero
    // fill past num_a_rows and K.
    if (args.a_gather_slots != nullptr) {
        return set_error(MEGAMOE_STATUS_INTERNAL_ERROR, "m_grouped_gemm_sm90: the store epilogue takes A unpermuted");
    }
    CUtensorMap a_map{};
    const bool k_halves = args.b_up != nullptr;  // the separate layout's dX: K rows [k / 2, k) of B from w3
    if (k_halves ? !encode_a_halves_map(args, args.k / 2, &a_map)
                 : !encode_sorted_a_map<ConfigOf<Epi>>(args, args.a, args.num_a_rows, args.lda, &a_map)) {
        return set_error(MEGAMOE_STATUS_CUDA_ERROR, "m_grouped_gemm_sm90: cuTensorMapEncodeTiled failed for A");
    }
    if constexpr (!kBias) {  // b2 is the down GEMM's, the K halves dX's (launch_m_grouped_gemm_sm90_store checks)
        if (k_halves) {
            return b_layout == BLayout::kNK
                       ? launch<Epi, BLayout::kNK, BSource::kKHalves>(args, params, num_sms, stream, a_map, out_map)
                       : launch<Epi, BLayout::kKN, BSource::kKHalves>(args, params, num_sms, stream, a_map, out_map);
        }
    }
    return b_layout == BLayout::kNK ? launch<Epi, BLayout::kNK>(args, params, num_sms, stream, a_map, out_map)
                                    : launch<Epi, BLayout::kKN>(args, params, num_sms, stream, a_map, out_map);
}

}  // namespace

bool m_grouped_pair_blocks_built() {
    return m_grouped::kPairBlockABytes > 0;
}

bool m_grouped_gemm_sm90_supported(const cuda::MGroupedGemmArgs& args, bool swiglu, BLayout /*b_layout*/) {
    constexpr int64_t kMaxTmaCoord = INT32_MAX;
    const bool dtype_ok = args.dtype == MEGAMOE_DTYPE_BF16 || args.dtype == MEGAMOE_DTYPE_F16;
    const bool sizes_ok = args.n > 0 && args.k > 0 && args.k % kChunkElems == 0 && args.n % kChunkElems == 0 &&
                          args.k <= kMaxTmaCoord && (swiglu ? 2 * args.n : args.n) <= kMaxTmaCoord &&
                          args.num_experts <= kMaxTmaCoord;
    // Unpermuted A goes by TMA (the store epilogue): its rows are TMA coordinates.
    const bool a_ok = cuda::is_aligned(args.a, 16) && args.lda % kChunkElems == 0 &&
                      (args.a_gather_slots != nullptr || (args.num_a_rows > 0 && args.num_a_rows <= kMaxTmaCoord));
    const bool b_ok =
        cuda::is_aligned(args.b, 16) && args.ldb % kChunkElems == 0 && args.b_expert_stride % kChunkElems == 0;
    return dtype_ok && sizes_ok && a_ok && b_ok && tensor_map_encoder() != nullptr;
}

megamoe_status_t launch_m_grouped_gemm_sm90_gated(const cuda::MGroupedGemmArgs& args, void* h, void* act, int num_sms,
                                                  cudaStream_t stream, const GatedArgs& options) {
    if (!cuda::is_aligned(h, 16) || !cuda::is_aligned(act, 16) || !cuda::is_aligned(options.bias, 4)) {
        return set_error(MEGAMOE_STATUS_NOT_SUPPORTED,
                         "m_grouped_gemm_sm90: outputs must be 16-byte aligned, b13 4-byte aligned");
    }
    if (!second_b_ok(args, false) || (args.b_up != nullptr && options.interleaved)) {
        return set_error(MEGAMOE_STATUS_NOT_SUPPORTED,
                         "m_grouped_gemm_sm90: w3 must be 16-byte aligned, its rows the up half of the pairs");
    }
    return options.activation.is_clamped()
               ? launch_gated<ClampedSwiGLUActivation>(args, options, h, act, num_sms, stream)
               : launch_gated<SwiGLUActivation>(args, options, h, act, num_sms, stream);
}

int64_t dswiglu_sm90_max_ds_parts(int64_t intermediate) {
    return ceil_div(intermediate, int64_t{ConfigOf<DSwiGLUEpilogue>::kBlockN});
}

megamoe_status_t launch_m_grouped_gemm_sm90_dswiglu(const cuda::MGroupedGemmArgs& args,
                                                    const DSwiGLUEpilogueArgs& epilogue, int num_sms,
                                                    cudaStream_t stream, int64_t* num_ds_parts) {
    const megamoe_status_t outputs_status = check_dswiglu_outputs(epilogue, "m_grouped_gemm_sm90");
    if (outputs_status != MEGAMOE_STATUS_SUCCESS) return outputs_status;
    if (epilogue.activation.is_clamped()) {
        return epilogue.dh_interleaved
                   ? launch_dswiglu<ClampedSwiGLUActivation, true>(args, epilogue, num_sms, stream, num_ds_parts)
                   : launch_dswiglu<ClampedSwiGLUActivation, false>(args, epilogue, num_sms, stream, num_ds_parts);
    }
    return epilogue.dh_interleaved
               ? launch_dswiglu<SwiGLUActivation, true>(args, epilogue, num_sms, stream, num_ds_parts)
               : launch_dswiglu<SwiGLUActivation, false>(args, epilogue, num_sms, stream, num_ds_parts);
}

megamoe_status_t launch_m_grouped_gemm_sm90_store(const cuda::MGroupedGemmArgs& args, BLayout b_layout, void* out,
                                                  int64_t ldo, int64_t num_out_rows, int num_sms, cudaStream_t stream,
                                                  const void* bias) {
    if (!cuda::is_aligned(out, 16) || ldo % kChunkElems != 0 || !cuda::is_aligned(bias, 4)) {
        return set_error(MEGAMOE_STATUS_NOT_SUPPORTED,
                         "m_grouped_gemm_sm90: out must be 16-byte aligned, ldo % 8 == 0, b2 4-byte aligned");
    }
    if (!second_b_ok(args, true) || (args.b_up != nullptr && bias != nullptr)) {
        return set_error(MEGAMOE_STATUS_NOT_SUPPORTED,
                         "m_grouped_gemm_sm90: the K halves' w3 must be 16-byte aligned, k / 2 % 8 == 0, no bias");
    }
    return bias != nullptr ? launch_store<true>(args, b_layout, out, ldo, num_out_rows, num_sms, stream, bias)
                           : launch_store<false>(args, b_layout, out, ldo, num_out_rows, num_sms, stream, nullptr);
}

}  // namespace megamoe::sm90
