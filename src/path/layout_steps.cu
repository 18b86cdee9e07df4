// The option-dependent steps of the portable CUDA path (layout_steps.h). Shapes, per expert e (H hidden, I
// intermediate, R = 2I, or I in the separate layout, rows of w13 and of w3):
//   w13 [R, H] (transposed [H, R]), w3 likewise, w2 [H, I] (transposed [I, H]), b13 [2I], b2 [H];
//   h [rows, 2I] canonical [g, u]; dh [rows, 2I] in w13's row order (interleaved: pairs; else [dg, du]).
#include "path/layout_steps.h"

#include "portable/layout_rows.h"

namespace megamoe::cuda {
namespace {

bool interleaved(const Call& call) {
    return call.layout.gate_up == MEGAMOE_GATE_UP_INTERLEAVED;
}
bool separate(const Call& call) {
    return call.layout.gate_up == MEGAMOE_GATE_UP_SEPARATE;
}

// Element `offset` of a 16-bit tensor.
const void* advance(const void* base, int64_t offset) {
    return static_cast<const uint16_t*>(base) + offset;
}

megamoe_status_t k_grouped(const KGroupedGemmArgs& args, const megamoe_tensor_t& grad, cudaStream_t stream) {
    return launch_k_grouped_gemm(args, grad.data, grad.dtype, stream);
}

}  // namespace

// A K-grouped weight gradient whose output is stored transposed: C^T = B^T A, the operands swapped.
KGroupedGemmArgs swapped_operands(const KGroupedGemmArgs& args) {
    KGroupedGemmArgs out = args;
    out.a = args.b;
    out.lda = args.ldb;
    out.a_gather_slots = args.b_gather_slots;
    out.m = args.n;
    out.b = args.a;
    out.ldb = args.lda;
    out.b_gather_slots = args.a_gather_slots;
    out.n = args.m;
    return out;
}

megamoe_status_t launch_up(const Call& call, const MGroupedGemmArgs& args, void* h, void* act, cudaStream_t stream) {
    if (call.default_experts) return launch_m_grouped_gemm_swiglu(args, h, act, stream);
    const int64_t hidden = call.shape.hidden, intermediate = call.shape.intermediate;
    const int64_t rows = call.layout.w13_rows();
    MGroupedGemmArgs gated = args;
    gated.b_expert_stride = rows * hidden;
    gated.ldb = call.layout.w13_transposed ? rows : hidden;
    gated.interleaved = interleaved(call);
    if (separate(call)) {
        gated.b_up = call.w3;
    } else if (!gated.interleaved) {  // concatenated: the up rows (transposed: columns) start at I
        gated.b_up = advance(call.w13, call.layout.w13_transposed ? intermediate : intermediate * hidden);
    }
    gated.bias = call.b13;
    gated.activation = call.activation;
    return launch_m_grouped_gemm_gated(gated, call.layout.w13_transposed ? BLayout::kKN : BLayout::kNK, h, act, stream);
}

megamoe_status_t launch_down(const Call& call, const MGroupedGemmArgs& args, void* out, cudaStream_t stream) {
    MGroupedGemmArgs down = args;
    down.bias = call.b2;
    if (call.layout.w2_transposed) down.ldb = call.shape.hidden;  // [K = I, N = H]
    return launch_m_grouped_gemm_elem(down, call.layout.w2_transposed ? BLayout::kKN : BLayout::kNK, out,
                                      call.shape.hidden, stream);
}

megamoe_status_t launch_d_hidden(const Call& call, const MGroupedGemmArgs& args, float* p, cudaStream_t stream) {
    MGroupedGemmArgs d_hidden = args;
    if (call.layout.w2_transposed) d_hidden.ldb = call.shape.hidden;  // [N = I, K = H]
    return launch_m_grouped_gemm_f32(d_hidden, call.layout.w2_transposed ? BLayout::kNK : BLayout::kKN, p,
                                     call.shape.intermediate, stream);
}

megamoe_status_t launch_d_act(const BackwardCall& call, const DSwiGLUArgs& args, cudaStream_t stream) {
    if (call.default_experts) return launch_dswiglu_rows(args, stream);
    DActArgs dact{};
    dact.dtype = args.dtype;
    dact.h = args.h;
    dact.dh = args.dh;
    dact.dh_interleaved = interleaved(call);
    dact.p = args.p;
    dact.act = args.act;
    dact.ds_rows = args.ds_rows;
    dact.sorted_slot = args.sorted_slot;
    dact.expert_offsets = args.expert_offsets;
    dact.num_experts = args.num_experts;
    dact.weights = args.weights;
    dact.weights_dtype = args.weights_dtype;
    dact.dy = call.dy;
    dact.b2 = call.b2;
    dact.topk = call.shape.topk;
    dact.hidden = call.shape.hidden;
    dact.intermediate = call.shape.intermediate;
    dact.activation = call.activation;
    dact.max_rows = args.max_rows;
    return launch_dact_rows(dact, stream);
}

megamoe_status_t launch_d_input(const Call& call, const MGroupedGemmArgs& args, float* q, cudaStream_t stream) {
    const int64_t hidden = call.shape.hidden, intermediate = call.shape.intermediate;
    const BLayout b_layout = call.layout.w13_transposed ? BLayout::kNK : BLayout::kKN;  // [N = H, K] or [K, N = H]
    MGroupedGemmArgs d_input = args;
    if (!separate(call)) {
        if (call.layout.w13_transposed) d_input.ldb = 2 * intermediate;
        return launch_m_grouped_gemm_f32(d_input, b_layout, q, hidden, stream);
    }
    // q = dg W1[e] + du W3[e]: K = I each, the up half added onto the gate half's q (one thread per element, in order).
    d_input.k = intermediate;
    d_input.b_expert_stride = intermediate * hidden;
    d_input.ldb = call.layout.w13_transposed ? intermediate : hidden;
    MEGAMOE_CUDA_RETURN_IF_ERROR(launch_m_grouped_gemm_f32(d_input, b_layout, q, hidden, stream));
    d_input.a = advance(args.a, intermediate);
    d_input.b = call.w3;
    return launch_m_grouped_gemm_f32(d_input, b_layout, q, hidden, stream, true);
}

megamoe_status_t launch_dw13(const BackwardCall& call, const KGroupedGemmArgs& args, cudaStream_t stream) {
    const int64_t intermediate = call.shape.intermediate;
    if (!separate(call)) {  // dh in w13's row order: [E, 2I, H] as stored, or its transpose
        if (call.dw13.data == nullptr) return MEGAMOE_STATUS_SUCCESS;
        return k_grouped(call.layout.w13_transposed ? swapped_operands(args) : args, call.dw13, stream);
    }
    KGroupedGemmArgs half = args;  // dh's gate columns [0, I) -> dw13, up columns [I, 2I) -> dw3
    half.m = intermediate;
    for (const megamoe_tensor_t* grad : {&call.dw13, &call.dw3}) {
        if (grad->data != nullptr) {
            MEGAMOE_CUDA_RETURN_IF_ERROR(
                k_grouped(call.layout.w13_transposed ? swapped_operands(half) : half, *grad, stream));
        }
        half.a = advance(args.a, intermediate);
    }
    return MEGAMOE_STATUS_SUCCESS;
}

megamoe_status_t launch_dw2(const BackwardCall& call, const KGroupedGemmArgs& args, cudaStream_t stream) {
    return k_grouped(call.layout.w2_transposed ? swapped_operands(args) : args, call.dw2, stream);
}

megamoe_status_t launch_bias_grads(const BackwardCall& call, const RoutingBuffers& routing, const void* dh,
                                   cudaStream_t stream) {
    ExpertColSumsArgs sums{};
    sums.src_dtype = call.dtype;
    sums.topk = call.shape.topk;
    sums.expert_offsets = routing.expert_offsets;
    sums.num_experts = call.shape.num_experts;
    sums.accumulate = call.accumulate_weight_grads;
    if (call.db13.data != nullptr) {  // db13[e] = sum dh, in b13's (= dh's) arrangement
        ExpertColSumsArgs db13 = sums;
        db13.src = dh;
        db13.num_cols = 2 * call.shape.intermediate;
        db13.out = call.db13.data;
        db13.out_dtype = call.db13.dtype;
        MEGAMOE_CUDA_RETURN_IF_ERROR(launch_expert_col_sums(db13, stream));
    }
    if (call.db2.data != nullptr) {  // db2[e] = sum s dy
        ExpertColSumsArgs db2 = sums;
        db2.src = call.dy;
        db2.gather_slots = routing.sorted_slot;
        db2.weights = call.weights;
        db2.weights_dtype = call.weights_dtype;
        db2.num_cols = call.shape.hidden;
        db2.out = call.db2.data;
        db2.out_dtype = call.db2.dtype;
        MEGAMOE_CUDA_RETURN_IF_ERROR(launch_expert_col_sums(db2, stream));
    }
    return MEGAMOE_STATUS_SUCCESS;
}

}  // namespace megamoe::cuda
