// Checks of the expert parameters shared by every entry point (validate.h): the layout and activation codes, the
// weights w13 / w3 / w2 in the shapes their layout gives them, the optional biases b13 / b2, and the gradients dw13,
// dw3, dw2, db13, db2 (each shaped as its parameter; f32 when accumulated into). Each names the argument (a field of
// the params struct) it rejects.
#include <cinttypes>
#include <cmath>
#include <iterator>
#include <string>

#include "dtype.h"
#include "api/validate.h"

namespace megamoe {
namespace {

const char* gate_up_name(megamoe_gate_up_t gate_up) {
    static const char* const kNames[] = {"concatenated", "interleaved", "separate"};
    static_assert(std::size(kNames) == MEGAMOE_GATE_UP_SEPARATE + 1, "a name for every arrangement");
    return entry_of(kNames, gate_up, "unknown");
}

megamoe_status_t check_flag(const char* name, int32_t value) {
    if (value != 0 && value != 1) {
        return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT, "%s: must be 0 or 1, got %d", name, value);
    }
    return MEGAMOE_STATUS_SUCCESS;
}

megamoe_status_t check_layout(const megamoe_layout_t& layout) {
    if (layout.gate_up != MEGAMOE_GATE_UP_CONCATENATED && layout.gate_up != MEGAMOE_GATE_UP_INTERLEAVED &&
        layout.gate_up != MEGAMOE_GATE_UP_SEPARATE) {
        return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT,
                         "layout.gate_up: unknown arrangement code %d (0 concatenated, 1 interleaved, 2 separate)",
                         static_cast<int>(layout.gate_up));
    }
    MEGAMOE_CHECK(check_flag("layout.w13_transposed", layout.w13_transposed));
    return check_flag("layout.w2_transposed", layout.w2_transposed);
}

megamoe_status_t check_activation(const megamoe_activation_t& activation) {
    if (activation.kind == MEGAMOE_ACTIVATION_SWIGLU) {
        if (activation.limit != 0.0 || activation.alpha != 0.0) {
            return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT,
                             "activation.%s: must be 0 for SwiGLU, got %g (for gpt-oss's clamped SwiGLU set "
                             "activation.kind = MEGAMOE_ACTIVATION_CLAMPED_SWIGLU)",
                             activation.limit != 0.0 ? "limit" : "alpha",
                             activation.limit != 0.0 ? activation.limit : activation.alpha);
        }
        return MEGAMOE_STATUS_SUCCESS;
    }
    if (activation.kind != MEGAMOE_ACTIVATION_CLAMPED_SWIGLU) {
        return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT,
                         "activation.kind: unknown activation code %d (0 SwiGLU, 1 clamped SwiGLU)",
                         static_cast<int>(activation.kind));
    }
    const struct {
        const char* name;
        double value;
    } params[] = {{"activation.limit", activation.limit}, {"activation.alpha", activation.alpha}};
    for (const auto& param : params) {
        if (!std::isfinite(param.value) || param.value <= 0.0) {
            return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT, "%s: must be finite and > 0 for clamped SwiGLU, got %g",
                             param.name, param.value);
        }
    }
    return MEGAMOE_STATUS_SUCCESS;
}

// The dimensions of the weights as the layout stores them, for shapes and messages.
struct WeightDims {
    const char* w13;  // w13, and w3 in the separate layout
    const char* w2;
    bool separate;
    bool w13_transposed;
    bool w2_transposed;

    static WeightDims of(const megamoe_layout_t& layout) {
        const bool separate = layout.gate_up == MEGAMOE_GATE_UP_SEPARATE;
        const bool w13_transposed = layout.w13_transposed != 0, w2_transposed = layout.w2_transposed != 0;
        const char* w13 =
            separate ? (w13_transposed ? "[E, H, I]" : "[E, I, H]") : (w13_transposed ? "[E, H, 2I]" : "[E, 2I, H]");
        return {w13, w2_transposed ? "[E, I, H]" : "[E, H, I]", separate, w13_transposed, w2_transposed};
    }
    std::vector<int64_t> w13_shape(const Shape& shape) const {
        const int64_t rows = separate ? shape.intermediate : 2 * shape.intermediate;
        if (w13_transposed) return {shape.num_experts, shape.hidden, rows};
        return {shape.num_experts, rows, shape.hidden};
    }
    std::vector<int64_t> w2_shape(const Shape& shape) const {
        if (w2_transposed) return {shape.num_experts, shape.intermediate, shape.hidden};
        return {shape.num_experts, shape.hidden, shape.intermediate};
    }
    // What the message says about where the dimensions come from, and the layout that sets them unless the default.
    std::string origin(const char* x_name, const megamoe_layout_t& layout) const {
        std::string text = std::string(" (E from w13, I from w2, H from ") + x_name;
        if (layout.gate_up != MEGAMOE_GATE_UP_CONCATENATED || w13_transposed || w2_transposed) {
            text += std::string("; layout.gate_up = ") + gate_up_name(layout.gate_up) +
                    ", w13_transposed = " + (w13_transposed ? "1" : "0") +
                    ", w2_transposed = " + (w2_transposed ? "1" : "0");
        }
        return text + ")";
    }
};

// w3 present exactly when the layout is separate (before the weights' shapes, which the layout sets).
megamoe_status_t check_w3_presence(const Experts& experts, const WeightDims& dims) {
    if (dims.separate && !is_present(*experts.w3)) {
        return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT,
                         "w3: required by layout.gate_up = separate (the up projection %s; w13 holds the gate)",
                         dims.w13);
    }
    if (!dims.separate && is_present(*experts.w3)) {
        return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT,
                         "w3: given, but layout.gate_up = %s keeps the up rows in w13 (w3 is for the separate layout)",
                         gate_up_name(experts.layout.gate_up));
    }
    return MEGAMOE_STATUS_SUCCESS;
}

// w3 (present: check_w3_presence) shaped as w13; the biases optional.
megamoe_status_t check_w3_and_biases(const char* x_name, const megamoe_tensor_t& x, const Experts& experts,
                                     const WeightDims& dims, const Shape& shape) {
    const std::string same_dtype = std::string("must equal the dtype of ") + x_name;
    if (dims.separate) {
        const std::string w3_dims = dims.w13 + dims.origin(x_name, experts.layout);
        MEGAMOE_CHECK(check_input("w3", *experts.w3, x, x_name, 3, w3_dims.c_str(), dims.w13_shape(shape), x.dtype,
                                  x.dtype, same_dtype.c_str()));
    }
    if (is_present(*experts.b13)) {
        MEGAMOE_CHECK(check_input("b13", *experts.b13, x, x_name, 2, "[E, 2I] (E from w13, I from w2)",
                                  {shape.num_experts, 2 * shape.intermediate}, x.dtype, x.dtype, same_dtype.c_str()));
    }
    if (is_present(*experts.b2)) {
        const std::string b2_dims = std::string("[E, H] (E from w13, H from ") + x_name + ")";
        MEGAMOE_CHECK(check_input("b2", *experts.b2, x, x_name, 2, b2_dims.c_str(), {shape.num_experts, shape.hidden},
                                  x.dtype, x.dtype, same_dtype.c_str()));
    }
    return MEGAMOE_STATUS_SUCCESS;
}

}  // namespace

megamoe_status_t check_rows_and_weights(const char* x_name, const char* x_dims, const megamoe_tensor_t& x,
                                        const Experts& experts, megamoe_accum_t accum, Shape* shape) {
    const megamoe_tensor_t &w13 = *experts.w13, &w2 = *experts.w2;
    MEGAMOE_CHECK(check_tensor(x_name, x, 2, x_dims));
    MEGAMOE_CHECK(check_layout(experts.layout));  // first: the weights' shapes depend on it
    const WeightDims dims = WeightDims::of(experts.layout);
    MEGAMOE_CHECK(check_w3_presence(experts, dims));
    MEGAMOE_CHECK(check_tensor("w13", w13, 3, dims.w13));
    MEGAMOE_CHECK(check_tensor("w2", w2, 3, dims.w2));
    if (x.dtype != MEGAMOE_DTYPE_BF16 && x.dtype != MEGAMOE_DTYPE_F16 && x.dtype != MEGAMOE_DTYPE_F32 &&
        x.dtype != MEGAMOE_DTYPE_F64) {
        return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT, "%s: dtype %s not allowed (bf16, f16, f32 or f64)", x_name,
                         dtype_name(x.dtype));
    }
    const std::string same_dtype = std::string("must equal the dtype of ") + x_name;
    MEGAMOE_CHECK(check_dtype("w13", w13, x.dtype, x.dtype, same_dtype.c_str()));
    MEGAMOE_CHECK(check_dtype("w2", w2, x.dtype, x.dtype, same_dtype.c_str()));

    shape->num_tokens = x.shape[0];
    shape->hidden = x.shape[1];
    shape->num_experts = w13.shape[0];
    shape->intermediate = w2.shape[dims.w2_transposed ? 1 : 2];
    if (shape->hidden == 0)
        return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT, "%s: hidden size H must be > 0, got shape %s", x_name,
                         shape_string(x).c_str());
    if (shape->num_experts == 0)
        return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT, "w13: number of experts E must be > 0, got shape %s",
                         shape_string(w13).c_str());
    if (shape->intermediate == 0)
        return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT, "w2: intermediate size I must be > 0, got shape %s",
                         shape_string(w2).c_str());
    const std::string origin = dims.origin(x_name, experts.layout);
    MEGAMOE_CHECK(check_shape("w13", w13, dims.w13_shape(*shape), (dims.w13 + origin).c_str()));
    MEGAMOE_CHECK(check_shape("w2", w2, dims.w2_shape(*shape), (dims.w2 + origin).c_str()));
    MEGAMOE_CHECK(check_same_device("w13", w13, x, x_name));
    MEGAMOE_CHECK(check_same_device("w2", w2, x, x_name));
    MEGAMOE_CHECK(check_w3_and_biases(x_name, x, experts, dims, *shape));
    MEGAMOE_CHECK(check_activation(experts.activation));
    if (x.device_type == MEGAMOE_DEVICE_CUDA) {
        if (x.dtype != MEGAMOE_DTYPE_BF16 && x.dtype != MEGAMOE_DTYPE_F16) {
            return set_error(MEGAMOE_STATUS_NOT_SUPPORTED,
                             "%s: dtype %s is not supported on CUDA (bf16 or f16); use CPU tensors for f32/f64", x_name,
                             dtype_name(x.dtype));
        }
        if (accum == MEGAMOE_ACCUM_F64) {
            return set_error(MEGAMOE_STATUS_NOT_SUPPORTED, "accum: f64 accumulation is CPU-only");
        }
    }
    if (accum != MEGAMOE_ACCUM_DEFAULT && accum != MEGAMOE_ACCUM_F32 && accum != MEGAMOE_ACCUM_F64) {
        return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT, "accum: unknown accumulation code %d",
                         static_cast<int>(accum));
    }
    return MEGAMOE_STATUS_SUCCESS;
}

megamoe_status_t check_expert_grads(const ExpertGrads& grads, int32_t accumulate_weight_grads,
                                    const megamoe_tensor_t& x, const char* x_name, const Experts& experts,
                                    const std::vector<Named>& inputs) {
    MEGAMOE_CHECK(check_flag("accumulate_weight_grads", accumulate_weight_grads));
    const std::vector<Named> params = expert_inputs(experts), param_grads = expert_grad_outputs(grads);
    for (size_t idx = 0; idx < param_grads.size(); ++idx) {  // both in the order w13, w3, w2, b13, b2
        const Named &grad = param_grads[idx], &param = params[idx];
        if (!is_present(*grad.tensor)) continue;
        if (!is_present(*param.tensor)) {
            return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT, "%s: given, but %s is absent (no %s, no gradient of it)",
                             grad.name, param.name, param.name);
        }
        const megamoe_tensor_t& param_tensor = *param.tensor;
        const std::vector<int64_t> param_shape(param_tensor.shape, param_tensor.shape + param_tensor.ndim);
        const std::string dims = std::string("as ") + param.name + " " + shape_string(param_tensor);
        const std::string rule = std::string("the dtype of ") + param.name + " or f32";
        MEGAMOE_CHECK(check_output(grad.name, *grad.tensor, x, x_name, param_tensor.ndim, dims.c_str(), param_shape,
                                   param_tensor.dtype, MEGAMOE_DTYPE_F32, rule.c_str(), inputs));
        if (grads.accumulate && grad.tensor->dtype != MEGAMOE_DTYPE_F32) {
            return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT,
                             "%s: accumulate_weight_grads = 1 adds into an f32 buffer, got dtype %s", grad.name,
                             dtype_name(grad.tensor->dtype));
        }
    }
    return MEGAMOE_STATUS_SUCCESS;
}

std::vector<Named> expert_inputs(const Experts& experts) {
    return {{"w13", experts.w13}, {"w3", experts.w3}, {"w2", experts.w2}, {"b13", experts.b13}, {"b2", experts.b2}};
}

std::vector<Named> expert_grad_outputs(const ExpertGrads& grads) {
    return {{"dw13", grads.dw13}, {"dw3", grads.dw3}, {"dw2", grads.dw2}, {"db13", grads.db13}, {"db2", grads.db2}};
}

}  // namespace megamoe
