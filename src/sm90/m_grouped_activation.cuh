// Activation policies of the fused Hopper M-grouped GEMM's epilogues (m_grouped_epilogue.cuh, m_grouped_dswiglu.cuh):
// a compile-time parameter of the SwiGLU and dSwiGLU epilogues, so the epilogue's inner loop holds no switch on the
// kind. Each policy has Params (its runtime values, a base of the epilogue's params: empty for SwiGLU, so the default
// kernels' argument is unchanged), forward (a = act(g, u)) and backward (a and (dg, du) = da * act'(g, u)).
//   SwiGLUActivation         the default: the expressions the sm_90a epilogues have always used (the forward's fast
//                            silu, the backward's IEEE division; see epilogue.cuh's silu)
//   SwiGLUFastActivation     SwiGLU, the backward's sigmoid by the SFU's tanh (MEGAMOE_SM90_DSWIGLU_MATH=fast)
//   ClampedSwiGLUActivation  gpt-oss's clamped SwiGLU (limit, alpha), activation.h's one definition
#pragma once

#include "activation.h"
#include "sm90/epilogue.cuh"

namespace megamoe::sm90::m_grouped {

struct SwiGLUActivation {
    struct Params {};
    static constexpr bool kClamped = false;

    __device__ __forceinline__ static float forward(const Params&, float gate, float up) { return silu(gate) * up; }
    __device__ __forceinline__ static void backward(const Params&, float gate, float up, float d_act, float& act,
                                                    float& d_gate, float& d_up) {
        const float gate_sigmoid = 1.0f / (1.0f + __expf(-gate));
        const float silu_gate = gate * gate_sigmoid;
        act = silu_gate * up;
        d_gate = d_act * up * gate_sigmoid * (1.0f + gate * (1.0f - gate_sigmoid));
        d_up = d_act * silu_gate;
    }
};

// SwiGLU with the backward's sigmoid by the SFU: sig = 0.5 + 0.5 tanh(g / 2) (one MUFU.TANH; its relative error of
// about 2^-11 is below bf16's rounding of dh and s a), and sig (1 + g (1 - sig)) as sig + silu (1 - sig): about 13
// instructions per element with the epilogue's products, against ~39 with the IEEE division and __expf.
// The forward is SwiGLUActivation's.
struct SwiGLUFastActivation : SwiGLUActivation {
    __device__ __forceinline__ static void backward(const Params&, float gate, float up, float d_act, float& act,
                                                    float& d_gate, float& d_up) {
        const float half_tanh = 0.5f * tanh_approx(0.5f * gate);
        const float gate_sigmoid = 0.5f + half_tanh;
        const float silu_gate = gate * gate_sigmoid;
        act = silu_gate * up;
        d_gate = (d_act * up) * fmaf(silu_gate, 0.5f - half_tanh, gate_sigmoid);
        d_up = d_act * silu_gate;
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
