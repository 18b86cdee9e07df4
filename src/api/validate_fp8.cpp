// Checks of the precision and the FP8 expert weights (validate.h's check_precision): the precision code, the
// megamoe_fp8_experts_t tensors a call reads (shapes, e4m3 / f32, x's device; a backward's absent transposed copy makes
// the weight it is transposed from required), absent ones in DEFAULT precision, and
// what the FP8 kernels run (CUDA, SwiGLU, no biases, not the interleaved layout, H and I multiples of 128: else
// NOT_SUPPORTED, never a silent 16-bit run). The FP8 weights are in the default layout whatever the 16-bit weights'
// (those give the shapes and the weight gradients' arrangement). The device's compute capability is the CUDA path's
// check (cuda_path.h).
#include <string>
#include <vector>

#include "api/validate.h"
#include "dtype.h"

namespace megamoe {
namespace {

constexpr int64_t kFp8Block = 128;  // the weights' scale blocks and the activations' groups

int64_t blocks(int64_t extent) {
    return (extent + kFp8Block - 1) / kFp8Block;
}

struct Fp8Tensor {
    const char* name;
    const megamoe_tensor_t* tensor;
    const char* dims;
    std::vector<int64_t> shape;
    megamoe_dtype_t dtype;
    bool read;           // the call reads it: required
    const char* absent;  // read because this transposed copy is absent (the backward makes it from this one), or NULL
};

// What a call needs of the FP8 weights: `reads`, but a transposed copy a backward reads may be absent, and then the
// weight it is made from is needed instead (megamoe.h: the backward transposes it into its workspace).
struct Fp8Needs {
    Fp8Reads reads;
    bool w13_for_w13_t = false;  // fp8.w13_t read but absent: fp8.w13 transposed
    bool w2_for_w2_t = false;    // fp8.w2_t read but absent: fp8.w2 transposed
};

Fp8Needs fp8_needs(const megamoe_fp8_experts_t& fp8, const Fp8Reads& reads) {
    Fp8Needs needs{reads};
    if (reads.w13_t && !is_present(fp8.w13_t)) {
        needs.reads.w13_t = false;
        needs.w13_for_w13_t = true;
    }
    if (reads.w2_t && !is_present(fp8.w2_t)) {
        needs.reads.w2_t = false;
        needs.w2_for_w2_t = true;
    }
    return needs;
}

std::vector<Fp8Tensor> fp8_tensors(const Experts& experts, const Shape& shape, const Fp8Needs& needs) {
    const megamoe_fp8_experts_t& fp8 = *experts.fp8;
    const int64_t E = shape.num_experts, H = shape.hidden, I = shape.intermediate;
    const Fp8Reads& reads = needs.reads;
    const bool w13 = reads.w13 || needs.w13_for_w13_t, w2 = reads.w2 || needs.w2_for_w2_t;
    return {
        {"fp8.w13",
         &fp8.w13,
         "[E, 2I, H]",
         {E, 2 * I, H},
         MEGAMOE_DTYPE_E4M3,
         w13,
         !reads.w13 && needs.w13_for_w13_t ? "fp8.w13_t" : nullptr},
        {"fp8.w13_t", &fp8.w13_t, "[E, H, 2I]", {E, H, 2 * I}, MEGAMOE_DTYPE_E4M3, reads.w13_t, nullptr},
        {"fp8.w13_scales",
         &fp8.w13_scales,
         "[E, 2I / 128, H / 128]",
         {E, blocks(2 * I), blocks(H)},
         MEGAMOE_DTYPE_F32,
         w13 || reads.w13_t,
         nullptr},
        {"fp8.w2",
         &fp8.w2,
         "[E, H, I]",
         {E, H, I},
         MEGAMOE_DTYPE_E4M3,
         w2,
         !reads.w2 && needs.w2_for_w2_t ? "fp8.w2_t" : nullptr},
        {"fp8.w2_t", &fp8.w2_t, "[E, I, H]", {E, I, H}, MEGAMOE_DTYPE_E4M3, reads.w2_t, nullptr},
        {"fp8.w2_scales",
         &fp8.w2_scales,
         "[E, H / 128, I / 128]",
         {E, blocks(H), blocks(I)},
         MEGAMOE_DTYPE_F32,
         w2 || reads.w2_t,
         nullptr},
    };
}

// What the FP8 kernels do not run: NOT_SUPPORTED naming it.
megamoe_status_t check_fp8_supported(const char* x_name, const megamoe_tensor_t& x, const Experts& experts,
                                     const Shape& shape) {
    const char* prefix = "precision: FP8_BLOCKWISE";
    if (x.device_type != MEGAMOE_DEVICE_CUDA) {
        return set_error(MEGAMOE_STATUS_NOT_SUPPORTED,
                         "%s runs on CUDA (the sm_90a FP8 kernels) only, %s is a CPU tensor (the recipe's CPU "
                         "reference is python's megamoe.fp8_reference)",
                         prefix, x_name);
    }
    if (experts.layout.gate_up == MEGAMOE_GATE_UP_INTERLEAVED) {
        return set_error(MEGAMOE_STATUS_NOT_SUPPORTED,
                         "%s does not take layout.gate_up = interleaved (its dSwiGLU epilogue writes dh in w13's row "
                         "order, the FP8 dX reads it concatenated); concatenated and separate layouts, transposed or "
                         "not, run",
                         prefix);
    }
    if (experts.activation.kind != MEGAMOE_ACTIVATION_SWIGLU) {
        return set_error(MEGAMOE_STATUS_NOT_SUPPORTED, "%s runs SwiGLU only, activation.kind is %d", prefix,
                         static_cast<int>(experts.activation.kind));
    }
    if (is_present(*experts.b13) || is_present(*experts.b2)) {
        return set_error(MEGAMOE_STATUS_NOT_SUPPORTED, "%s takes no biases, %s is given", prefix,
                         is_present(*experts.b13) ? "b13" : "b2");
    }
    if (shape.hidden % kFp8Block != 0 || shape.intermediate % kFp8Block != 0) {
        return set_error(MEGAMOE_STATUS_NOT_SUPPORTED,
                         "%s needs H and I multiples of 128 (the scale blocks), got H = %lld, I = %lld", prefix,
                         static_cast<long long>(shape.hidden), static_cast<long long>(shape.intermediate));
    }
    return MEGAMOE_STATUS_SUCCESS;
}

}  // namespace

megamoe_status_t check_precision(const char* x_name, const megamoe_tensor_t& x, const Experts& experts,
                                 const Shape& shape, const Fp8Reads& reads) {
    if (experts.precision != MEGAMOE_PRECISION_DEFAULT && experts.precision != MEGAMOE_PRECISION_FP8_BLOCKWISE) {
        return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT,
                         "precision: unknown precision code %d (0 DEFAULT, 1 FP8_BLOCKWISE)",
                         static_cast<int>(experts.precision));
    }
    const std::vector<Fp8Tensor> tensors = fp8_tensors(experts, shape, fp8_needs(*experts.fp8, reads));
    if (!experts.fp8_blockwise()) {
        for (const Fp8Tensor& t : tensors) {
            if (is_present(*t.tensor)) {
                return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT,
                                 "%s: given, but precision is DEFAULT (the FP8 weights are read with precision = "
                                 "MEGAMOE_PRECISION_FP8_BLOCKWISE only)",
                                 t.name);
            }
        }
        return MEGAMOE_STATUS_SUCCESS;
    }
    for (const Fp8Tensor& t : tensors) {
        if (!is_present(*t.tensor)) {
            if (!t.read) continue;
            if (t.absent != nullptr) {
                return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT,
                                 "%s: required by precision FP8_BLOCKWISE for this call: %s is absent, and the "
                                 "backward makes it by transposing %s in its workspace (megamoe_quantize_experts "
                                 "writes both)",
                                 t.name, t.absent, t.name);
            }
            return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT,
                             "%s: required by precision FP8_BLOCKWISE for this call (megamoe_quantize_experts writes "
                             "it)",
                             t.name);
        }
        const std::string dims = std::string(t.dims) + " (E, I from w13 and w2, H from " + x_name + ")";
        const char* rule = t.dtype == MEGAMOE_DTYPE_E4M3 ? "must be e4m3 (MEGAMOE_DTYPE_E4M3)" : "must be f32";
        MEGAMOE_CHECK(check_input(t.name, *t.tensor, x, x_name, 3, dims.c_str(), t.shape, t.dtype, t.dtype, rule));
    }
    return MEGAMOE_STATUS_SUCCESS;
}

megamoe_status_t check_precision_supported(const char* x_name, const megamoe_tensor_t& x, const Experts& experts,
                                           const Shape& shape) {
    return experts.fp8_blockwise() ? check_fp8_supported(x_name, x, experts, shape) : MEGAMOE_STATUS_SUCCESS;
}

std::vector<Named> fp8_inputs(const Experts& experts) {
    const megamoe_fp8_experts_t& fp8 = *experts.fp8;
    return {{"fp8.w13", &fp8.w13}, {"fp8.w13_t", &fp8.w13_t}, {"fp8.w13_scales", &fp8.w13_scales},
            {"fp8.w2", &fp8.w2},   {"fp8.w2_t", &fp8.w2_t},   {"fp8.w2_scales", &fp8.w2_scales}};
}

megamoe_status_t check_quantize_experts(const megamoe_tensor_t* w13, const megamoe_tensor_t* w2,
                                        const megamoe_fp8_experts_t* fp8, Shape* shape) {
    const struct {
        const char* name;
        const void* pointer;
    } pointers[] = {{"w13", w13}, {"w2", w2}, {"fp8", fp8}};
    for (const auto& p : pointers) {
        if (p.pointer == nullptr) return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT, "%s: NULL", p.name);
    }
    MEGAMOE_CHECK(check_tensor("w13", *w13, 3, "[E, 2I, H]"));
    MEGAMOE_CHECK(check_tensor("w2", *w2, 3, "[E, H, I]"));
    if (w13->dtype != MEGAMOE_DTYPE_BF16 && w13->dtype != MEGAMOE_DTYPE_F16 && w13->dtype != MEGAMOE_DTYPE_F32) {
        return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT, "w13: dtype %s not allowed (bf16, f16 or f32)",
                         dtype_name(w13->dtype));
    }
    MEGAMOE_CHECK(check_dtype("w2", *w2, w13->dtype, w13->dtype, "must equal the dtype of w13"));
    if (w13->device_type != MEGAMOE_DEVICE_CUDA) {
        return set_error(MEGAMOE_STATUS_NOT_SUPPORTED, "w13: megamoe_quantize_experts runs on CUDA tensors only");
    }
    MEGAMOE_CHECK(check_same_device("w2", *w2, *w13, "w13"));
    shape->num_experts = w13->shape[0];
    shape->hidden = w13->shape[2];
    shape->intermediate = w2->shape[2];
    MEGAMOE_CHECK(check_shape("w2", *w2, {shape->num_experts, shape->hidden, shape->intermediate},
                              "[E, H, I] (E and H from w13)"));
    MEGAMOE_CHECK(check_shape("w13", *w13, {shape->num_experts, 2 * shape->intermediate, shape->hidden},
                              "[E, 2I, H] (I from w2)"));
    if (shape->hidden % kFp8Block != 0 || shape->intermediate % kFp8Block != 0) {
        return set_error(MEGAMOE_STATUS_NOT_SUPPORTED,
                         "w13: the FP8 layer needs H and I multiples of 128 (the scale blocks), got H = %lld, I = %lld",
                         static_cast<long long>(shape->hidden), static_cast<long long>(shape->intermediate));
    }
    Fp8Needs all;
    all.reads.w13 = all.reads.w13_t = all.reads.w2 = all.reads.w2_t = true;
    std::vector<Named> inputs = {{"w13", w13}, {"w2", w2}};
    std::vector<Named> outputs;
    Experts experts{};
    experts.fp8 = fp8;
    for (const Fp8Tensor& t : fp8_tensors(experts, *shape, all)) {
        const bool transposed_copy = t.tensor == &fp8->w13_t || t.tensor == &fp8->w2_t;
        if (transposed_copy && !is_present(*t.tensor)) continue;  // written where given
        const std::string dims = std::string(t.dims) + " (E, H from w13, I from w2)";
        const char* rule = t.dtype == MEGAMOE_DTYPE_E4M3 ? "must be e4m3 (MEGAMOE_DTYPE_E4M3)" : "must be f32";
        MEGAMOE_CHECK(
            check_output(t.name, *t.tensor, *w13, "w13", 3, dims.c_str(), t.shape, t.dtype, t.dtype, rule, inputs));
        outputs.push_back({t.name, t.tensor});
    }
    MEGAMOE_CHECK(check_outputs_disjoint(outputs));
    for (const Named& output : outputs) inputs.push_back(output);
    return check_cuda_pointers(inputs);
}

}  // namespace megamoe
