// The portable backend (steps_portable.h). Shapes, per expert e (H hidden, I intermediate, R = 2I, or I in the separate
// layout, rows of w13 and of w3):
//   w13 [R, H] (transposed [H, R]), w3 likewise, w2 [H, I] (transposed [I, H]), b13 [2I], b2 [H];
//   h [rows, 2I] canonical [g, u]; dh [rows, 2I] in w13's row order (interleaved: pairs; else [dg, du]).
// The backward's workspace is the portable layout's (plan.h): p and q in f32 in p_then_q_f32, dh over h.
#include "path/steps_portable.h"

#include "portable/elementwise.h"
#include "portable/grouped_gemm.h"
#include "portable/layout_rows.h"

namespace megamoe::cuda {
namespace {

// What both row kernels of the activation's backward read and write: h and p in, dh, s * a and ds out.
DSwiGLUArgs activation_rows_args(const BackwardStep& step) {
    const BackwardCall& call = step.call;
    const BackwardWorkspace& workspace = step.workspace;
    DSwiGLUArgs args{};
    args.dtype = call.dtype;
    args.h = workspace.h;
    args.dh = workspace.dh;
    args.p = workspace.p_then_q_f32;
    args.act = workspace.act;
    args.ds_rows = workspace.ds_parts;
    args.sorted_slot = step.rows.sorted_slot;
    args.expert_offsets = step.rows.expert_offsets;
    args.num_experts = call.shape.num_experts;
    args.weights = call.weights;
    args.weights_dtype = call.weights_dtype;
    args.intermediate = call.shape.intermediate;
    args.max_rows = call.shape.num_slots();
    return args;
}

// dh (the layout's row order), s * a and ds per row from h and p.
megamoe_status_t launch_d_act(const BackwardStep& step) {
    const BackwardCall& call = step.call;
    if (call.default_experts) return launch_dswiglu_rows(activation_rows_args(step), call.stream);
    DActArgs dact{};
    static_cast<DSwiGLUArgs&>(dact) = activation_rows_args(step);
    dact.dh_interleaved = is_interleaved(call);
    dact.dy = call.dy;
    dact.b2 = call.b2;
    dact.topk = call.shape.topk;
    dact.hidden = call.shape.hidden;
    dact.activation = call.activation;
    return launch_dact_rows(dact, call.stream);
}

class PortableBackend final : public Backend {
  public:
    megamoe_status_t up(const ForwardStep& step) const override {
        const ForwardCall& call = step.call;
        return launch_up(call, step.rows, call.x, call.saved_h, step.workspace.act, call.stream);
    }

    megamoe_status_t down(const ForwardStep& step) const override {
        return launch_down(step.call, step.rows, step.workspace.act, step.workspace.out, step.call.stream);
    }

    megamoe_status_t recompute_h(const BackwardStep& step) const override {
        const BackwardCall& call = step.call;
        return launch_up(call, step.rows, call.x, step.workspace.h, nullptr, call.stream);
    }

    // p = dy W2[e]^T [S, I] in f32, then the row kernel: one ds part per row.
    megamoe_status_t d_hidden(const BackwardStep& step, int64_t* /*num_ds_parts*/) const override {
        const BackwardCall& call = step.call;
        const Shape& shape = call.shape;
        const MGroupedGemmArgs args = m_grouped_args(call, step.rows, token_rows(call, step.rows, call.dy),
                                                     w2_operand(call), shape.intermediate, shape.hidden);
        MEGAMOE_CUDA_RETURN_IF_ERROR(launch_m_grouped_gemm_f32(
            args, d_hidden_b_layout(call), step.workspace.p_then_q_f32, shape.intermediate, call.stream));
        return launch_d_act(step);
    }

    // q in f32 over p.
    megamoe_status_t d_input(const BackwardStep& step, RowBuffer* q) const override {
        *q = {step.workspace.p_then_q_f32, MEGAMOE_DTYPE_F32};
        return launch_d_input(step.call, step.rows, step.workspace.dh, step.workspace.p_then_q_f32, step.call.stream);
    }
};

}  // namespace

const Backend& portable_backend() {
    static const PortableBackend backend;
    return backend;
}

megamoe_status_t launch_up(const Call& call, const SortedRows& rows, const void* x, void* h, void* act,
                           cudaStream_t stream) {
    const int64_t hidden = call.shape.hidden, intermediate = call.shape.intermediate;
    MGroupedGemmArgs gated =
        m_grouped_args(call, rows, token_rows(call, rows, x), w13_operand(call), intermediate, hidden);
    if (call.default_experts) return launch_m_grouped_gemm_swiglu(gated, h, act, stream);
    gated.interleaved = is_interleaved(call);
    if (is_separate(call)) {
        gated.b_up = call.w3;
    } else if (!gated.interleaved) {  // concatenated: the up rows (transposed: columns) start at I
        gated.b_up = advance(call.w13, call.layout.w13_transposed ? intermediate : intermediate * hidden);
    }
    gated.bias = call.b13;
    gated.activation = call.activation;
    return launch_m_grouped_gemm_gated(gated, up_b_layout(call), h, act, stream);
}

megamoe_status_t launch_down(const Call& call, const SortedRows& rows, const void* act, void* out,
                             cudaStream_t stream) {
    const int64_t hidden = call.shape.hidden, intermediate = call.shape.intermediate;
    MGroupedGemmArgs down =
        m_grouped_args(call, rows, sorted_rows(call, act, intermediate), w2_operand(call), hidden, intermediate);
    down.bias = call.b2;
    return launch_m_grouped_gemm_elem(down, down_b_layout(call), out, hidden, stream);
}

megamoe_status_t launch_d_input(const Call& call, const SortedRows& rows, const void* dh, float* q,
                                cudaStream_t stream) {
    const int64_t hidden = call.shape.hidden, intermediate = call.shape.intermediate;
    const BLayout b_layout = d_input_b_layout(call);
    // K = the rows of one expert of w13: 2I, or I in the separate layout, where q = dg W1[e] + du W3[e] runs as two
    // GEMMs, the up half added onto the gate half's q (one thread per element, in order).
    MGroupedGemmArgs d_input = m_grouped_args(call, rows, sorted_rows(call, dh, 2 * intermediate), w13_operand(call),
                                              hidden, call.layout.w13_rows());
    MEGAMOE_CUDA_RETURN_IF_ERROR(launch_m_grouped_gemm_f32(d_input, b_layout, q, hidden, stream));
    if (!is_separate(call)) return MEGAMOE_STATUS_SUCCESS;
    d_input.a = advance(dh, intermediate);
    d_input.b = call.w3;
    return launch_m_grouped_gemm_f32(d_input, b_layout, q, hidden, stream, true);
}

}  // namespace megamoe::cuda
