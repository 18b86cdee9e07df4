// The steps every backend shares (steps.h): the GEMM operands, the weight gradients' K-grouped GEMMs, routing, combine,
// d topk_weights, dx's gather-sum, the bias gradients, the gradients of a call without slots and the NaN fill.
#include "device/cuda_utils.h"
#include "dtype.h"
#include "path/cuda_path_common.h"
#include "path/steps.h"
#include "portable/elementwise.h"
#include "portable/grouped_gemm.h"
#include "portable/layout_rows.h"
#include "sm90/k_grouped_gemm_sm90.h"

namespace megamoe::cuda {
namespace {

// One side of a K-grouped GEMM: rows of `cols` values (row stride ld), row r read at gather_slots[r] / topk or r.
struct KOperand {
    const void* data;
    int64_t ld;
    const int* gather_slots;
    int64_t cols;
};

// C_e [a.cols, b.cols] = sum over the rows of expert e of a^T b.
KGroupedGemmArgs k_grouped_args(const BackwardStep& step, const KOperand& a, const KOperand& b) {
    const BackwardCall& call = step.call;
    KGroupedGemmArgs args{};
    args.dtype = call.dtype;
    args.a = a.data;
    args.lda = a.ld;
    args.a_gather_slots = a.gather_slots;
    args.m = a.cols;
    args.b = b.data;
    args.ldb = b.ld;
    args.b_gather_slots = b.gather_slots;
    args.n = b.cols;
    args.topk = call.shape.topk;
    args.expert_offsets = step.rows.expert_offsets;
    args.num_experts = call.shape.num_experts;
    args.schedule = step.workspace.k_schedule;
    args.accumulate = call.accumulate_weight_grads;
    return args;
}

// Rows of one token gradient or input ([T, H]) as a K-grouped operand, gathered by sorted slot.
KOperand token_columns(const BackwardStep& step, const void* data) {
    const int64_t hidden = step.call.shape.hidden;
    return {data, hidden, step.rows.sorted_slot, hidden};
}

// The slot sums of `rows` into out [T, H] (weights NULL: 1).
GatherSumArgs slot_sums(const Call& call, const RoutingBuffers& routing, const RowBuffer& rows, void* out) {
    GatherSumArgs sums{};
    sums.out_dtype = call.dtype;
    sums.rows = rows.data;
    sums.rows_dtype = rows.dtype;
    sums.slot_to_row = routing.slot_to_row;
    sums.token_invalid = routing.token_invalid;
    sums.num_tokens = call.shape.num_tokens;
    sums.topk = call.shape.topk;
    sums.num_cols = call.shape.hidden;
    sums.out = out;
    return sums;
}

}  // namespace

RowOperand token_rows(const Call& call, const SortedRows& rows, const void* data) {
    return {data, call.shape.hidden, rows.sorted_slot, call.shape.num_tokens};
}

RowOperand sorted_rows(const Call& call, const void* data, int64_t cols) {
    return {data, cols, nullptr, call.shape.num_slots()};
}

ExpertOperand w13_operand(const Call& call) {
    const int64_t rows = call.layout.w13_rows(), hidden = call.shape.hidden;
    return {call.w13, rows * hidden, call.layout.w13_transposed ? rows : hidden};
}

ExpertOperand w2_operand(const Call& call) {
    const int64_t hidden = call.shape.hidden, intermediate = call.shape.intermediate;
    return {call.w2, hidden * intermediate, call.layout.w2_transposed ? hidden : intermediate};
}

MGroupedGemmArgs m_grouped_args(const Call& call, const SortedRows& rows, const RowOperand& a, const ExpertOperand& b,
                                int64_t n, int64_t k) {
    MGroupedGemmArgs args{};
    args.dtype = call.dtype;
    args.a = a.data;
    args.lda = a.ld;
    args.a_gather_slots = a.gather_slots;
    args.num_a_rows = a.num_rows;
    args.topk = call.shape.topk;
    args.b = b.data;
    args.b_expert_stride = b.expert_stride;
    args.ldb = b.ld;
    args.n = n;
    args.k = k;
    args.expert_offsets = rows.expert_offsets;
    args.m_tile_offsets = rows.m_tile_offsets;
    args.num_experts = call.shape.num_experts;
    args.max_m_tiles = rows.max_m_tiles;
    args.pair_blocks_always = test_override(MEGAMOE_TEST_PAIR_BLOCKS);
    return args;
}

KGroupedGemmArgs dw13_args(const BackwardStep& step, bool up_half) {
    const BackwardCall& call = step.call;
    const int64_t intermediate = call.shape.intermediate;
    const KOperand dh{advance(step.workspace.dh, up_half ? intermediate : 0), 2 * intermediate, nullptr,
                      is_separate(call) ? intermediate : 2 * intermediate};
    const KOperand x = token_columns(step, call.x);
    return call.layout.w13_transposed ? k_grouped_args(step, x, dh) : k_grouped_args(step, dh, x);
}

KGroupedGemmArgs dw2_args(const BackwardStep& step) {
    const BackwardCall& call = step.call;
    const int64_t intermediate = call.shape.intermediate;
    const KOperand dy = token_columns(step, call.dy);
    const KOperand act{step.workspace.act, intermediate, nullptr, intermediate};
    return call.layout.w2_transposed ? k_grouped_args(step, act, dy) : k_grouped_args(step, dy, act);
}

int num_dw13_outputs(const Call& call) {
    return is_separate(call) ? 2 : 1;
}

const megamoe_tensor_t& dw13_output(const BackwardCall& call, bool up_half) {
    return up_half ? call.dw3 : call.dw13;
}

megamoe_status_t WeightGrads::launch(const BackwardStep& step, const KGroupedGemmArgs& args,
                                     const megamoe_tensor_t& grad) const {
    if (sm90_) return sm90::launch_k_grouped_gemm_sm90(args, grad.data, grad.dtype, step.num_sms, step.call.stream);
    return launch_k_grouped_gemm(args, grad.data, grad.dtype, step.call.stream);
}

megamoe_status_t WeightGrads::dw2(const BackwardStep& step) const {
    if (step.call.dw2.data == nullptr) return MEGAMOE_STATUS_SUCCESS;
    return launch(step, dw2_args(step), step.call.dw2);
}

megamoe_status_t WeightGrads::dw13(const BackwardStep& step) const {
    for (int half = 0; half < num_dw13_outputs(step.call); ++half) {
        const megamoe_tensor_t& grad = dw13_output(step.call, half == 1);
        if (grad.data != nullptr) MEGAMOE_CUDA_RETURN_IF_ERROR(launch(step, dw13_args(step, half == 1), grad));
    }
    return MEGAMOE_STATUS_SUCCESS;
}

megamoe_status_t route(const Call& call, const RoutingPlan& plan, const RoutingBuffers& routing) {
    return launch_routing(call.experts, call.experts_dtype, plan, routing, call.stream);
}

megamoe_status_t combine(const ForwardStep& step) {
    const ForwardCall& call = step.call;
    GatherSumArgs sums = slot_sums(call, step.workspace.routing, {step.workspace.out, call.dtype}, call.y);
    sums.weights = call.weights;
    sums.weights_dtype = call.weights_dtype;
    return launch_gather_sum(sums, call.stream);
}

megamoe_status_t finalize_d_topk_weights(const BackwardStep& step, int64_t num_ds_parts) {
    const BackwardCall& call = step.call;
    if (call.dweights.data == nullptr) return MEGAMOE_STATUS_SUCCESS;
    FinalizeDTopkArgs finalize{};
    finalize.ds_parts = step.workspace.ds_parts;
    finalize.num_ds_parts = num_ds_parts;
    finalize.slot_to_row = step.workspace.routing.slot_to_row;
    finalize.token_invalid = step.workspace.routing.token_invalid;
    finalize.num_slots = call.shape.num_slots();
    finalize.topk = call.shape.topk;
    finalize.dtopk_weights = call.dweights.data;
    finalize.dtopk_dtype = call.dweights.dtype;
    return launch_finalize_dtopk(finalize, call.stream);
}

megamoe_status_t sum_d_input(const BackwardStep& step, const RowBuffer& q) {
    return launch_gather_sum(slot_sums(step.call, step.workspace.routing, q, step.call.dx.data), step.call.stream);
}

megamoe_status_t bias_grads(const BackwardStep& step) {
    const BackwardCall& call = step.call;
    ExpertColSumsArgs sums{};
    sums.src_dtype = call.dtype;
    sums.topk = call.shape.topk;
    sums.expert_offsets = step.rows.expert_offsets;
    sums.num_experts = call.shape.num_experts;
    sums.accumulate = call.accumulate_weight_grads;
    if (call.db13.data != nullptr) {  // db13[e] = sum dh, in b13's (= dh's) arrangement
        ExpertColSumsArgs db13 = sums;
        db13.src = step.workspace.dh;
        db13.num_cols = 2 * call.shape.intermediate;
        db13.out = call.db13.data;
        db13.out_dtype = call.db13.dtype;
        MEGAMOE_CUDA_RETURN_IF_ERROR(launch_expert_col_sums(db13, call.stream));
    }
    if (call.db2.data != nullptr) {  // db2[e] = sum s dy
        ExpertColSumsArgs db2 = sums;
        db2.src = call.dy;
        db2.gather_slots = step.rows.sorted_slot;
        db2.weights = call.weights;
        db2.weights_dtype = call.weights_dtype;
        db2.num_cols = call.shape.hidden;
        db2.out = call.db2.data;
        db2.out_dtype = call.db2.dtype;
        MEGAMOE_CUDA_RETURN_IF_ERROR(launch_expert_col_sums(db2, call.stream));
    }
    return MEGAMOE_STATUS_SUCCESS;
}

megamoe_status_t zero_grads(const BackwardCall& call) {
    MEGAMOE_CUDA_RETURN_IF_ERROR(
        zero_if_wanted(call.dx, output_element_bytes(call.dx.dtype), call.stream, "cudaMemsetAsync(dx)"));
    if (call.accumulate_weight_grads) return MEGAMOE_STATUS_SUCCESS;  // accumulated gradients stay as they are
    for (const megamoe_tensor_t* grad : {&call.dw13, &call.dw3, &call.dw2, &call.db13, &call.db2}) {
        MEGAMOE_CUDA_RETURN_IF_ERROR(
            zero_if_wanted(*grad, output_element_bytes(grad->dtype), call.stream, "cudaMemsetAsync(weight grad)"));
    }
    return MEGAMOE_STATUS_SUCCESS;
}

megamoe_status_t fill_nan_if_counts_invalid(const BackwardCall& call, const RoutingBuffers& routing) {
    if (routing.counts_invalid == nullptr) return MEGAMOE_STATUS_SUCCESS;
    for (const megamoe_tensor_t* grad : {&call.dw13, &call.dw3, &call.dw2, &call.db13, &call.db2}) {
        MEGAMOE_CUDA_RETURN_IF_ERROR(
            launch_fill_nan_if(routing.counts_invalid, grad->data, grad->dtype, numel(*grad), call.stream));
    }
    return MEGAMOE_STATUS_SUCCESS;
}

const Backend& backend_of(BackendKind kind) {
    switch (kind) {
        case BackendKind::kSm90:
            return sm90_backend();
        case BackendKind::kSm90Fp8:
            return fp8_backend();
        case BackendKind::kPortable:
            break;
    }
    return portable_backend();
}

}  // namespace megamoe::cuda
