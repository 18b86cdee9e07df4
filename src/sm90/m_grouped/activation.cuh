// Activation policies of the fused Hopper M-grouped GEMM's epilogues (m_grouped/epilogue.cuh, m_grouped/dswiglu.cuh):
// a compile-time parameter of the SwiGLU and dSwiGLU epilogues, so the epilogue's inner loop holds no switch on the
// kind. Each policy has Params (its runtime values, a base of the epilogue's params: empty for SwiGLU, so the default
// kernels' argument is unchanged), forward (a = act(g, u)) and backward (a and (dg, du) = da * act'(g, u)).
//   SwiGLUActivation         the default: activation.h's SwiGLU, the forward in FastMath, the backward in FastExpMath
//   ClampedSwiGLUActivation  gpt-oss's clamped SwiGLU (limit, alpha) in PreciseMath
// (activation.h says which numerics each user takes and why).
#pragma once

#include "activation.h"
#include "sm90/kit/store.cuh"

namespace megamoe::sm90::m_grouped {

struct SwiGLUActivation {
    struct Params {};
    static constexpr bool kClamped = false;

    __device__ __forceinline__ static float forward(const Params&, float gate, float up) {
        return SwiGLU<FastMath>::forward(gate, up);
    }
    __device__ __forceinline__ static void backward(const Params&, float gate, float up, float d_act, float& act,
                                                    float& d_gate, float& d_up) {
        SwiGLU<FastExpMath>::backward(gate, up, d_act, &act, &d_gate, &d_up);
    }
};

struct ClampedSwiGLUActivation {
    struct Params {
        float limit;
        float alpha;
    };
    static constexpr bool kClamped = true;

    __device__ __forceinline__ static Activation<float> of(const Params& params) {
        return {MEGAMOE_ACTIVATION_CLAMPED_SWIGLU, params.limit, params.alpha};
    }
    __device__ __forceinline__ static float forward(const Params& params, float gate, float up) {
        return of(params).forward(gate, up);
    }
    __device__ __forceinline__ static void backward(const Params& params, float gate, float up, float d_act, float& act,
                                                    float& d_gate, float& d_up) {
        const Activation<float> activation = of(params);
        act = activation.forward(gate, up);
        activation.backward(gate, up, d_act, &d_gate, &d_up);
    }
};

}  // namespace megamoe::sm90::m_grouped
