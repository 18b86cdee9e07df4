// The steps of the CUDA path's forward and backward (forward.cu and backward.cu read as lists of them).
//   Backend      one kernel set's M-grouped GEMM steps: up (the gated epilogue), down, h recomputed, dH (with the
//                activation's backward: dh, s * a, the ds partial sums), dX (q). Three of them: portable
//                (steps_portable.cu), sm90 (steps_sm90.cu) and sm90-FP8 (steps_fp8.cu: sm90's with e4m3 operands, each
//                activation operand quantized by its step); a call runs the one its plan chose (plan.h).
//   WeightGrads  dW2, dW13 (and the separate layout's dW3) on the K-grouped kernel the plan chose, sm_90a's or the
//                portable one; their arguments are the same for both.
//   the rest     routing, combine, d topk_weights, dx's gather-sum, the bias gradients, the zeroed gradients of a call
//                without slots and the grouped rows' NaN fill: the same kernels on every backend (steps_shared.cu).
// Every step builds its kernels' arguments once, from the call, the routing and the workspace; it enqueues on
// call.stream and returns the first failure's status (no launch after it). A step reads the workspace buffers of its
// own backend's layout (plan.h) and only those the call has.
#pragma once

#include <cstdint>

#include "common.h"
#include "device/grouped_gemm_args.h"
#include "path/call.h"
#include "path/plan.h"
#include "portable/routing.h"

namespace megamoe::cuda {

// The routing's output as the M-grouped GEMMs read it.
struct SortedRows {
    const int* sorted_slot;     // sorted row -> slot; NULL for grouped rows (the gathers are the identity)
    const int* expert_offsets;  // [E + 1]
    const int* m_tile_offsets;  // [E + 1]: the M-tile schedule
    int64_t max_m_tiles;        // host bound on m_tile_offsets[E]

    static SortedRows of(const RoutingPlan& plan, const RoutingBuffers& routing) {
        return {routing.sorted_slot, routing.expert_offsets, routing.m_tile_offsets, plan.max_m_tiles};
    }
};

// What a forward step reads: the call, its workspace and routing, the persistent grid bound of the sm_90a kernels (0
// on the portable backend).
struct ForwardStep {
    const ForwardCall& call;
    const ForwardWorkspace& workspace;
    SortedRows rows;
    int num_sms;
};

// What a backward step reads, likewise.
struct BackwardStep {
    const BackwardCall& call;
    const BackwardWorkspace& workspace;
    SortedRows rows;
    int num_sms;
};

// Rows [S, cols] in the element type or in f32.
struct RowBuffer {
    const void* data;
    megamoe_dtype_t dtype;
};

// One kernel set's M-grouped GEMM steps.
class Backend {
  public:
    virtual ~Backend() = default;
    // a = act(h) [S, I] into workspace.act (FP8: quantized into workspace.act_fp8), and h = [g, u] into call.saved_h
    // when given.
    virtual megamoe_status_t up(const ForwardStep& step) const = 0;
    // o = W2[e] a (+ b2[e]) [S, H] into workspace.out, in the element type.
    virtual megamoe_status_t down(const ForwardStep& step) const = 0;
    // h = [g, u] into workspace.h (recompute mode).
    virtual megamoe_status_t recompute_h(const BackwardStep& step) const = 0;
    // From h and p = W2[e]^T dy: dh into workspace.dh (w13's row order), s * a into workspace.act and the partial sums
    // of ds into workspace.ds_parts. *num_ds_parts (1 on entry): the partial sums it wrote per row.
    virtual megamoe_status_t d_hidden(const BackwardStep& step, int64_t* num_ds_parts) const = 0;
    // q = dh W13[e] [S, H]; *q: where and in which dtype.
    virtual megamoe_status_t d_input(const BackwardStep& step, RowBuffer* q) const = 0;
};

const Backend& portable_backend();
const Backend& sm90_backend();
const Backend& fp8_backend();
const Backend& backend_of(BackendKind kind);

// The weight gradients on the portable or the sm_90a K-grouped kernel.
class WeightGrads {
  public:
    explicit WeightGrads(bool sm90) : sm90_(sm90) {}
    // dW2[e] = sum (s dy) a^T, when wanted.
    megamoe_status_t dw2(const BackwardStep& step) const;
    // dW13[e] = sum dh x^T: dw13, and the separate layout's dw3, each when wanted.
    megamoe_status_t dw13(const BackwardStep& step) const;

  private:
    megamoe_status_t launch(const BackwardStep& step, const KGroupedGemmArgs& args, const megamoe_tensor_t& grad) const;
    bool sm90_;
};

// The K-grouped GEMM of dw13 (up_half false) or of the separate layout's dw3 (true): over dh (its gate columns [0, I)
// for dw13, its up columns [I, 2I) for dw3, in the separate layout) and x gathered; the operands swapped where w13 is
// stored transposed (the output tile is then the stored [H, 2I]).
KGroupedGemmArgs dw13_args(const BackwardStep& step, bool up_half);
// The K-grouped GEMM of dw2: dy gathered and s * a; swapped where w2 is stored transposed.
KGroupedGemmArgs dw2_args(const BackwardStep& step);
// The outputs of the dW13 GEMMs, in order: dw13, and dw3 in the separate layout (data NULL: not wanted).
int num_dw13_outputs(const Call& call);
const megamoe_tensor_t& dw13_output(const BackwardCall& call, bool up_half);

// A of an M-grouped GEMM: rows of data (row stride ld), the a_row(r) = gather_slots[r] / topk or r, num_rows of them.
struct RowOperand {
    const void* data;
    int64_t ld;
    const int* gather_slots;
    int64_t num_rows;
};
// B of an M-grouped GEMM: B_e = data + e * expert_stride, row stride ld.
struct ExpertOperand {
    const void* data;
    int64_t expert_stride;
    int64_t ld;
};
// x or dy [T, H], gathered by sorted slot.
RowOperand token_rows(const Call& call, const SortedRows& rows, const void* data);
// [S, cols] by sorted row.
RowOperand sorted_rows(const Call& call, const void* data, int64_t cols);
// w13 (and w3) as stored: one expert [w13_rows, H], or [H, w13_rows] transposed (w13_rows: 2I, separate I).
ExpertOperand w13_operand(const Call& call);
// w2 as stored: one expert [H, I], or [I, H] transposed.
ExpertOperand w2_operand(const Call& call);
// The M-grouped GEMM of A and B, N and K over the call's routing (no expert option set).
MGroupedGemmArgs m_grouped_args(const Call& call, const SortedRows& rows, const RowOperand& a, const ExpertOperand& b,
                                int64_t n, int64_t k);

// How each M-grouped GEMM reads its weight (kNK: K contiguous): up reads w13 [N = 2I, K = H], down w2 [N = H, K = I],
// dH w2 [K = H, N = I], dX w13 [K = 2I, N = H]; a transposed weight swaps its layout.
inline BLayout up_b_layout(const Call& call) {
    return call.layout.w13_transposed ? BLayout::kKN : BLayout::kNK;
}
inline BLayout down_b_layout(const Call& call) {
    return call.layout.w2_transposed ? BLayout::kKN : BLayout::kNK;
}
inline BLayout d_hidden_b_layout(const Call& call) {
    return call.layout.w2_transposed ? BLayout::kNK : BLayout::kKN;
}
inline BLayout d_input_b_layout(const Call& call) {
    return call.layout.w13_transposed ? BLayout::kNK : BLayout::kKN;
}
inline bool is_interleaved(const Call& call) {
    return call.layout.gate_up == MEGAMOE_GATE_UP_INTERLEAVED;
}
inline bool is_separate(const Call& call) {
    return call.layout.gate_up == MEGAMOE_GATE_UP_SEPARATE;
}
// Element `offset` of a 16-bit tensor.
inline const void* advance(const void* base, int64_t offset) {
    return static_cast<const uint16_t*>(base) + offset;
}

// The steps every backend shares.
// The routing (the sort of topk_ids, or the grouped rows' scan of tokens_per_expert) into `routing`.
megamoe_status_t route(const Call& call, const RoutingPlan& plan, const RoutingBuffers& routing);
// y_t = sum_j s_tj o[row of (t, j)] (grouped rows: out_r = s_r o_r, 0 for padding rows).
megamoe_status_t combine(const ForwardStep& step);
// d topk_weights from the ds partial sums (added in part order), when wanted.
megamoe_status_t finalize_d_topk_weights(const BackwardStep& step, int64_t num_ds_parts);
// dx_t = sum_j q[row of (t, j)], f32 accumulation.
megamoe_status_t sum_d_input(const BackwardStep& step, const RowBuffer& q);
// db13 = per-expert column sums of dh, db2 = of s dy, each when wanted.
megamoe_status_t bias_grads(const BackwardStep& step);
// A call without slots: dx and (unless accumulated) the weight and bias gradients zeroed, when wanted.
megamoe_status_t zero_grads(const BackwardCall& call);
// Grouped rows whose counts the routing found invalid (counts_invalid set on the device): the weight and bias
// gradients, computed from the clamped rows, become NaN. The whole layer has no such flag (bad ids only drop their
// slots): nothing.
megamoe_status_t fill_nan_if_counts_invalid(const BackwardCall& call, const RoutingBuffers& routing);

}  // namespace megamoe::cuda
