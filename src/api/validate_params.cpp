// validate() of each C API params struct (validate.h): the whole layer (x, topk_ids, topk_weights) and grouped rows
// (x_sorted, tokens_per_expert, scores), each with the expert parameters (validate_experts.cpp), its outputs and
// their overlaps; plus the checks of values only CPU tensors let validation read (ids, counts) and the device-pointer
// checks of CUDA tensors.
#include <algorithm>
#include <cinttypes>
#include <string>
#include <vector>

#include "dtype.h"
#include "api/validate.h"

namespace megamoe {
namespace {

// CPU ids can be read here: every value must be in [-1, E). (CUDA ids are checked on the device:
// see cuda_path.h.)
megamoe_status_t check_cpu_ids(const megamoe_tensor_t& ids, const Shape& shape) {
    for (int64_t slot = 0; slot < shape.num_slots(); ++slot) {
        const int64_t value = load_index(ids.data, ids.dtype, slot);
        if (value < -1 || value >= shape.num_experts) {
            return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT,
                             "topk_ids: value %" PRId64 " at [%" PRId64 ", %" PRId64 "] is out of range [-1, E=%" PRId64
                             ")",
                             value, slot / shape.topk, slot % shape.topk, shape.num_experts);
        }
    }
    return MEGAMOE_STATUS_SUCCESS;
}

// CPU counts can be read here: each must be >= 0 and their sum at most R. (CUDA counts are checked on the device:
// see cuda_path.h.)
megamoe_status_t check_cpu_counts(const megamoe_tensor_t& counts, const Shape& shape) {
    int64_t num_counted = 0;  // at most R before each addition of a count capped at R + 1: no overflow
    for (int64_t expert_idx = 0; expert_idx < shape.num_experts; ++expert_idx) {
        const int64_t value = load_index(counts.data, counts.dtype, expert_idx);
        if (value < 0) {
            return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT,
                             "tokens_per_expert: value %" PRId64 " at [%" PRId64 "] is negative", value, expert_idx);
        }
        num_counted += std::min(value, shape.num_tokens + 1);
        if (num_counted > shape.num_tokens) {
            return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT,
                             "tokens_per_expert: the counts sum past the R=%" PRId64
                             " rows of x_sorted (at expert %" PRId64 ")",
                             shape.num_tokens, expert_idx);
        }
    }
    return MEGAMOE_STATUS_SUCCESS;
}

// The whole layer's routed inputs: x and the expert parameters (check_rows_and_weights), then topk_ids and
// topk_weights.
megamoe_status_t check_routed_inputs(const megamoe_tensor_t& x, const megamoe_tensor_t& ids,
                                     const megamoe_tensor_t& weights, const Experts& experts, megamoe_accum_t accum,
                                     Shape* shape) {
    MEGAMOE_CHECK(check_rows_and_weights("x", "[T, H]", x, experts, accum, shape));
    MEGAMOE_CHECK(check_tensor("topk_ids", ids, 2, "[T, topk]"));
    MEGAMOE_CHECK(check_tensor("topk_weights", weights, 2, "[T, topk]"));
    MEGAMOE_CHECK(check_dtype("topk_ids", ids, MEGAMOE_DTYPE_I32, MEGAMOE_DTYPE_I64, "i32 or i64"));
    MEGAMOE_CHECK(check_dtype("topk_weights", weights, MEGAMOE_DTYPE_F32, x.dtype, "f32 or the dtype of x"));
    shape->topk = ids.shape[1];
    if (shape->topk == 0)
        return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT, "topk_ids: topk must be > 0, got shape %s",
                         shape_string(ids).c_str());
    MEGAMOE_CHECK(check_shape("topk_ids", ids, {shape->num_tokens, shape->topk}, "[T, topk] (T from x)"));
    MEGAMOE_CHECK(check_shape("topk_weights", weights, {shape->num_tokens, shape->topk}, "[T, topk] (as topk_ids)"));
    if (shape->num_tokens > 0 && shape->topk > kMaxRows / shape->num_tokens) {  // T * topk > kMaxRows, unmultiplied
        return set_error(MEGAMOE_STATUS_NOT_SUPPORTED,
                         "topk_ids: T * topk = %" PRId64 " * %" PRId64 " exceeds 2^31 - 1 slots", shape->num_tokens,
                         shape->topk);
    }
    MEGAMOE_CHECK(check_same_device("topk_ids", ids, x));
    return check_same_device("topk_weights", weights, x);
}

// Grouped rows' inputs: x_sorted and the expert parameters (check_rows_and_weights), then tokens_per_expert and the
// optional scores. The shape is the whole layer's with T = R rows and topk = 1.
megamoe_status_t check_grouped_inputs(const megamoe_tensor_t& x, const megamoe_tensor_t& counts,
                                      const megamoe_tensor_t& scores, const Experts& experts, megamoe_accum_t accum,
                                      Shape* shape) {
    MEGAMOE_CHECK(check_rows_and_weights("x_sorted", "[R, H]", x, experts, accum, shape));
    shape->topk = 1;
    if (shape->num_tokens > kMaxRows) {
        return set_error(MEGAMOE_STATUS_NOT_SUPPORTED, "x_sorted: R = %" PRId64 " rows exceed 2^31 - 1",
                         shape->num_tokens);
    }
    MEGAMOE_CHECK(check_input("tokens_per_expert", counts, x, "x_sorted", 1, "[E] (E from w13)", {shape->num_experts},
                              MEGAMOE_DTYPE_I32, MEGAMOE_DTYPE_I64, "i32 or i64"));
    if (is_present(scores)) {
        MEGAMOE_CHECK(check_input("scores", scores, x, "x_sorted", 1, "[R] (R from x_sorted)", {shape->num_tokens},
                                  MEGAMOE_DTYPE_F32, x.dtype, "f32 or the dtype of x_sorted"));
    }
    return MEGAMOE_STATUS_SUCCESS;
}

// `named` followed by the call's expert parameters.
std::vector<Named> with_experts(std::vector<Named> named, const Experts& experts) {
    for (const Named& item : expert_inputs(experts)) named.push_back(item);
    for (const Named& item : fp8_inputs(experts)) named.push_back(item);
    return named;
}

// The FP8 weights a backward reads: the transposed copies of the data gradients (w13_t only when dx is wanted; either
// may be absent, the backward then transposes w2 / w13: check_precision) and w13 itself when h is recomputed.
Fp8Reads backward_fp8_reads(const megamoe_tensor_t& dx, const megamoe_tensor_t& saved_h) {
    Fp8Reads reads;
    reads.w2_t = true;
    reads.w13_t = is_present(dx);
    reads.w13 = !is_present(saved_h);
    return reads;
}

Fp8Reads forward_fp8_reads() {
    Fp8Reads reads;
    reads.w13 = reads.w2 = true;
    return reads;
}

// `named` followed by the call's expert gradients.
std::vector<Named> with_expert_grads(std::vector<Named> named, const ExpertGrads& grads) {
    for (const Named& item : expert_grad_outputs(grads)) named.push_back(item);
    return named;
}

}  // namespace

megamoe_status_t check_cpu_values(const megamoe_forward_params_t& p, const Shape& shape) {
    return check_cpu_ids(p.topk_ids, shape);
}
megamoe_status_t check_cpu_values(const megamoe_backward_params_t& p, const Shape& shape) {
    return check_cpu_ids(p.topk_ids, shape);
}
megamoe_status_t check_cpu_values(const megamoe_grouped_forward_params_t& p, const Shape& shape) {
    return check_cpu_counts(p.tokens_per_expert, shape);
}
megamoe_status_t check_cpu_values(const megamoe_grouped_backward_params_t& p, const Shape& shape) {
    return check_cpu_counts(p.tokens_per_expert, shape);
}

megamoe_status_t validate(const megamoe_forward_params_t* params, Shape* shape) {
    if (params == nullptr) return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT, "params: NULL");
    const megamoe_forward_params_t& p = *params;
    const Experts experts = Experts::of(p);
    MEGAMOE_CHECK(check_routed_inputs(p.x, p.topk_ids, p.topk_weights, experts, p.accum, shape));
    MEGAMOE_CHECK(check_precision("x", p.x, experts, *shape, forward_fp8_reads()));
    const std::vector<Named> inputs =
        with_experts({{"x", &p.x}, {"topk_ids", &p.topk_ids}, {"topk_weights", &p.topk_weights}}, experts);
    const megamoe_dtype_t dtype = p.x.dtype;
    MEGAMOE_CHECK(check_output("y", p.y, p.x, "x", 2, "[T, H]", {shape->num_tokens, shape->hidden}, dtype, dtype,
                               "must equal the dtype of x", inputs));
    if (is_present(p.saved_h)) {
        MEGAMOE_CHECK(check_output("saved_h", p.saved_h, p.x, "x", 2, "[T*topk, 2I]",
                                   {shape->num_slots(), 2 * shape->intermediate}, dtype, dtype,
                                   "must equal the dtype of x", inputs));
    }
    MEGAMOE_CHECK(check_precision_supported("x", p.x, experts, *shape));
    return check_outputs_disjoint({{"y", &p.y}, {"saved_h", &p.saved_h}});
}

megamoe_status_t validate(const megamoe_grouped_forward_params_t* params, Shape* shape) {
    if (params == nullptr) return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT, "params: NULL");
    const megamoe_grouped_forward_params_t& p = *params;
    const Experts experts = Experts::of(p);
    MEGAMOE_CHECK(check_grouped_inputs(p.x_sorted, p.tokens_per_expert, p.scores, experts, p.accum, shape));
    MEGAMOE_CHECK(check_precision("x_sorted", p.x_sorted, experts, *shape, forward_fp8_reads()));
    const std::vector<Named> inputs = with_experts(
        {{"x_sorted", &p.x_sorted}, {"tokens_per_expert", &p.tokens_per_expert}, {"scores", &p.scores}}, experts);
    const megamoe_dtype_t dtype = p.x_sorted.dtype;
    MEGAMOE_CHECK(check_output("out", p.out, p.x_sorted, "x_sorted", 2, "[R, H]", {shape->num_tokens, shape->hidden},
                               dtype, dtype, "must equal the dtype of x_sorted", inputs));
    if (is_present(p.saved_h)) {
        MEGAMOE_CHECK(check_output("saved_h", p.saved_h, p.x_sorted, "x_sorted", 2, "[R, 2I]",
                                   {shape->num_tokens, 2 * shape->intermediate}, dtype, dtype,
                                   "must equal the dtype of x_sorted", inputs));
    }
    MEGAMOE_CHECK(check_precision_supported("x_sorted", p.x_sorted, experts, *shape));
    return check_outputs_disjoint({{"out", &p.out}, {"saved_h", &p.saved_h}});
}

megamoe_status_t validate(const megamoe_backward_params_t* params, Shape* shape) {
    if (params == nullptr) return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT, "params: NULL");
    const megamoe_backward_params_t& p = *params;
    const Experts experts = Experts::of(p);
    MEGAMOE_CHECK(check_routed_inputs(p.x, p.topk_ids, p.topk_weights, experts, p.accum, shape));
    MEGAMOE_CHECK(check_precision("x", p.x, experts, *shape, backward_fp8_reads(p.dx, p.saved_h)));
    const int64_t T = shape->num_tokens, H = shape->hidden;
    const megamoe_dtype_t dtype = p.x.dtype;
    MEGAMOE_CHECK(
        check_input("dy", p.dy, p.x, "x", 2, "[T, H] (as x)", {T, H}, dtype, dtype, "must equal the dtype of x"));
    std::vector<Named> inputs = with_experts(
        {{"dy", &p.dy}, {"x", &p.x}, {"topk_ids", &p.topk_ids}, {"topk_weights", &p.topk_weights}}, experts);
    if (is_present(p.saved_h)) {
        MEGAMOE_CHECK(check_input("saved_h", p.saved_h, p.x, "x", 2, "[T*topk, 2I]",
                                  {shape->num_slots(), 2 * shape->intermediate}, dtype, dtype,
                                  "must equal the dtype of x"));
        inputs.push_back({"saved_h", &p.saved_h});
    }
    if (is_present(p.dx)) {
        MEGAMOE_CHECK(
            check_output("dx", p.dx, p.x, "x", 2, "[T, H]", {T, H}, dtype, dtype, "must equal the dtype of x", inputs));
    }
    if (is_present(p.dtopk_weights)) {
        MEGAMOE_CHECK(check_output("dtopk_weights", p.dtopk_weights, p.x, "x", 2, "[T, topk]", {T, shape->topk},
                                   MEGAMOE_DTYPE_F32, p.topk_weights.dtype, "f32 or the dtype of topk_weights",
                                   inputs));
    }
    const ExpertGrads grads = ExpertGrads::of(p);
    MEGAMOE_CHECK(check_expert_grads(grads, p.accumulate_weight_grads, p.x, "x", experts, inputs));
    MEGAMOE_CHECK(check_precision_supported("x", p.x, experts, *shape));
    return check_outputs_disjoint(with_expert_grads({{"dx", &p.dx}, {"dtopk_weights", &p.dtopk_weights}}, grads));
}

megamoe_status_t validate(const megamoe_grouped_backward_params_t* params, Shape* shape) {
    if (params == nullptr) return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT, "params: NULL");
    const megamoe_grouped_backward_params_t& p = *params;
    const Experts experts = Experts::of(p);
    MEGAMOE_CHECK(check_grouped_inputs(p.x_sorted, p.tokens_per_expert, p.scores, experts, p.accum, shape));
    MEGAMOE_CHECK(check_precision("x_sorted", p.x_sorted, experts, *shape, backward_fp8_reads(p.dx_sorted, p.saved_h)));
    const int64_t R = shape->num_tokens, H = shape->hidden;
    const megamoe_dtype_t dtype = p.x_sorted.dtype;
    const char* same_dtype = "must equal the dtype of x_sorted";
    MEGAMOE_CHECK(check_input("dout", p.dout, p.x_sorted, "x_sorted", 2, "[R, H] (as x_sorted)", {R, H}, dtype, dtype,
                              same_dtype));
    std::vector<Named> inputs = with_experts({{"dout", &p.dout},
                                              {"x_sorted", &p.x_sorted},
                                              {"tokens_per_expert", &p.tokens_per_expert},
                                              {"scores", &p.scores}},
                                             experts);
    if (is_present(p.saved_h)) {
        MEGAMOE_CHECK(check_input("saved_h", p.saved_h, p.x_sorted, "x_sorted", 2, "[R, 2I]",
                                  {R, 2 * shape->intermediate}, dtype, dtype, same_dtype));
        inputs.push_back({"saved_h", &p.saved_h});
    }
    if (is_present(p.dx_sorted)) {
        MEGAMOE_CHECK(check_output("dx_sorted", p.dx_sorted, p.x_sorted, "x_sorted", 2, "[R, H]", {R, H}, dtype, dtype,
                                   same_dtype, inputs));
    }
    if (is_present(p.dscores)) {
        if (!is_present(p.scores)) {
            return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT,
                             "dscores: given, but scores is absent (no scores, no "
                             "gradient of them)");
        }
        MEGAMOE_CHECK(check_output("dscores", p.dscores, p.x_sorted, "x_sorted", 1, "[R]", {R}, MEGAMOE_DTYPE_F32,
                                   p.scores.dtype, "f32 or the dtype of scores", inputs));
    }
    const ExpertGrads grads = ExpertGrads::of(p);
    MEGAMOE_CHECK(check_expert_grads(grads, p.accumulate_weight_grads, p.x_sorted, "x_sorted", experts, inputs));
    MEGAMOE_CHECK(check_precision_supported("x_sorted", p.x_sorted, experts, *shape));
    return check_outputs_disjoint(with_expert_grads({{"dx_sorted", &p.dx_sorted}, {"dscores", &p.dscores}}, grads));
}

megamoe_status_t check_cuda_pointers_of(const megamoe_forward_params_t& p) {
    return check_cuda_pointers(with_experts({{"x", &p.x},
                                             {"topk_ids", &p.topk_ids},
                                             {"topk_weights", &p.topk_weights},
                                             {"y", &p.y},
                                             {"saved_h", &p.saved_h}},
                                            Experts::of(p)));
}
megamoe_status_t check_cuda_pointers_of(const megamoe_backward_params_t& p) {
    return check_cuda_pointers(with_expert_grads(with_experts({{"dy", &p.dy},
                                                               {"x", &p.x},
                                                               {"topk_ids", &p.topk_ids},
                                                               {"topk_weights", &p.topk_weights},
                                                               {"saved_h", &p.saved_h},
                                                               {"dx", &p.dx},
                                                               {"dtopk_weights", &p.dtopk_weights}},
                                                              Experts::of(p)),
                                                 ExpertGrads::of(p)));
}
megamoe_status_t check_cuda_pointers_of(const megamoe_grouped_forward_params_t& p) {
    return check_cuda_pointers(with_experts({{"x_sorted", &p.x_sorted},
                                             {"tokens_per_expert", &p.tokens_per_expert},
                                             {"scores", &p.scores},
                                             {"out", &p.out},
                                             {"saved_h", &p.saved_h}},
                                            Experts::of(p)));
}
megamoe_status_t check_cuda_pointers_of(const megamoe_grouped_backward_params_t& p) {
    return check_cuda_pointers(with_expert_grads(with_experts({{"dout", &p.dout},
                                                               {"x_sorted", &p.x_sorted},
                                                               {"tokens_per_expert", &p.tokens_per_expert},
                                                               {"scores", &p.scores},
                                                               {"saved_h", &p.saved_h},
                                                               {"dx_sorted", &p.dx_sorted},
                                                               {"dscores", &p.dscores}},
                                                              Experts::of(p)),
                                                 ExpertGrads::of(p)));
}

}  // namespace megamoe
