// One call of either C API entry point as the CUDA orchestration (cuda_path.cu) sees it, so that the whole layer
// and grouped rows run the very same forward and backward:
//   the whole layer   T tokens of topk slots each; the routing sorts the slots by expert (a counting sort of
//                     topk_ids) and the GEMMs gather x's rows through sorted_slot; weight of slot (t, j):
//                     topk_weights[t, j];
//   grouped rows      R rows already sorted by expert, taken as T = R tokens of one slot each (topk = 1); the routing
//                     reads tokens_per_expert and the gather is the identity (sorted_slot NULL); weight of row r:
//                     scores[r], or 1 (weights NULL). out, d x_sorted and d scores are y, dx and d topk_weights.
// Both carry the expert parameters' options (layout.h): w3, b13, b2, the layout and the activation. Both kernel sets
// run every option: the sm_90a kernels as compile-time policies (steps_sm90.h; a w3 or bias too misaligned for them
// keeps the call on the portable kernels: sm90_options_blocker), the portable kernels through steps_portable.h, which
// runs the default options' own kernels when default_experts.
#pragma once

#include <cuda_runtime.h>

#include "common.h"
#include "layout.h"
#include "test_overrides.h"

namespace megamoe::cuda {

struct Call {
    Shape shape;          // grouped rows: num_tokens = R, topk = 1
    const void* experts;  // topk_ids [T, topk], or tokens_per_expert [E] when rows_sorted
    megamoe_dtype_t experts_dtype;
    bool rows_sorted;       // grouped rows
    megamoe_dtype_t dtype;  // of x, w13, w2 and of every row tensor (y, dy, dx, h)
    const void* x;          // [T, H]
    const void* w13;        // [E, 2I, H]
    const void* w2;         // [E, H, I]
    const void* weights;    // [T * topk] per slot, or NULL: 1
    megamoe_dtype_t weights_dtype;
    const void* w3;   // the separate layout's up projection (shaped as w13), else NULL
    const void* b13;  // [E, 2I] arranged as w13's rows, or NULL
    const void* b2;   // [E, H], or NULL
    WeightLayout layout;
    Activation<float> activation;
    bool default_experts;  // concatenated untransposed weights, SwiGLU, no biases
    // precision FP8_BLOCKWISE: the quantized weights (validated: present as the call reads them, default experts, H
    // and I multiples of 128; steps_fp8.cu runs the GEMMs); NULL: the GEMMs in the element type.
    const megamoe_fp8_experts_t* fp8;
    void* workspace;
    cudaStream_t stream;
    int device_index;
};

struct ForwardCall : Call {
    void* y;        // [T, H] (grouped rows: out)
    void* saved_h;  // [T * topk, 2I] by sorted row, or NULL
};

struct BackwardCall : Call {
    const void* dy;             // [T, H] (grouped rows: dout)
    void* saved_h;              // the forward's saved_h (consumed: dh is written over it), or NULL (recompute h)
    megamoe_tensor_t dx;        // [T, H] (grouped rows: dx_sorted); the rest likewise optional (data NULL)
    megamoe_tensor_t dweights;  // [T * topk] (grouped rows: dscores)
    megamoe_tensor_t dw13;
    megamoe_tensor_t dw2;
    megamoe_tensor_t dw3;          // separate layout
    megamoe_tensor_t db13;         // with b13
    megamoe_tensor_t db2;          // with b2
    bool accumulate_weight_grads;  // the weight gradients are f32 and the gradients are added into them
};

inline Call make_call(const Shape& shape, const megamoe_tensor_t& experts, bool rows_sorted, const megamoe_tensor_t& x,
                      const Experts& params, const megamoe_tensor_t& weights, void* workspace, void* stream) {
    const megamoe_tensor_t &w13 = *params.w13, &w2 = *params.w2;
    Call call{};
    call.shape = shape;
    call.experts = experts.data;
    call.experts_dtype = experts.dtype;
    call.rows_sorted = rows_sorted;
    call.dtype = x.dtype;
    call.x = x.data;
    call.w13 = w13.data;
    call.w2 = w2.data;
    call.weights = weights.data;
    call.weights_dtype = weights.dtype;
    call.w3 = params.w3->data;
    call.b13 = params.b13->data;
    call.b2 = params.b2->data;
    call.layout = WeightLayout::of(params.layout, shape.hidden, shape.intermediate);
    call.activation = Activation<float>::of(params.activation);
    call.default_experts =
        call.layout.is_default() && !call.activation.is_clamped() && call.b13 == nullptr && call.b2 == nullptr;
    call.fp8 = params.fp8_blockwise() ? params.fp8 : nullptr;
    call.workspace = workspace;
    call.stream = static_cast<cudaStream_t>(stream);
    call.device_index = x.device_index;
    return call;
}

// The test overrides MEGAMOE_TEST_FP8_FORWARD_ONLY / BACKWARD_ONLY: an FP8 call runs only that direction in FP8 and
// the other in the element type (its path says so).
inline ForwardCall forward_call(const Call& call, void* y, void* saved_h) {
    ForwardCall forward{call};
    if (test_override(MEGAMOE_TEST_FP8_BACKWARD_ONLY)) forward.fp8 = nullptr;
    forward.y = y;
    forward.saved_h = saved_h;
    return forward;
}

inline ForwardCall forward_call(const megamoe_forward_params_t& p, const Shape& shape) {
    return forward_call(make_call(shape, p.topk_ids, false, p.x, Experts::of(p), p.topk_weights, p.workspace, p.stream),
                        p.y.data, p.saved_h.data);
}

inline ForwardCall forward_call(const megamoe_grouped_forward_params_t& p, const Shape& shape) {
    return forward_call(
        make_call(shape, p.tokens_per_expert, true, p.x_sorted, Experts::of(p), p.scores, p.workspace, p.stream),
        p.out.data, p.saved_h.data);
}

inline BackwardCall backward_call(const Call& call, const void* dy, void* saved_h, const megamoe_tensor_t& dx,
                                  const megamoe_tensor_t& dweights, const ExpertGrads& grads) {
    BackwardCall backward{call};
    if (test_override(MEGAMOE_TEST_FP8_FORWARD_ONLY)) backward.fp8 = nullptr;
    const megamoe_tensor_t &dw13 = *grads.dw13, &dw2 = *grads.dw2;
    const bool accumulate_weight_grads = grads.accumulate;
    backward.dw3 = *grads.dw3;
    backward.db13 = *grads.db13;
    backward.db2 = *grads.db2;
    backward.accumulate_weight_grads = accumulate_weight_grads != 0;
    backward.dy = dy;
    backward.saved_h = saved_h;
    backward.dx = dx;
    backward.dweights = dweights;
    backward.dw13 = dw13;
    backward.dw2 = dw2;
    return backward;
}

inline BackwardCall backward_call(const megamoe_backward_params_t& p, const Shape& shape) {
    return backward_call(
        make_call(shape, p.topk_ids, false, p.x, Experts::of(p), p.topk_weights, p.workspace, p.stream), p.dy.data,
        p.saved_h.data, p.dx, p.dtopk_weights, ExpertGrads::of(p));
}

inline BackwardCall backward_call(const megamoe_grouped_backward_params_t& p, const Shape& shape) {
    return backward_call(
        make_call(shape, p.tokens_per_expert, true, p.x_sorted, Experts::of(p), p.scores, p.workspace, p.stream),
        p.dout.data, p.saved_h.data, p.dx_sorted, p.dscores, ExpertGrads::of(p));
}

}  // namespace megamoe::cuda
