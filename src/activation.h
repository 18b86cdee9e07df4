// The activation between the two projections, a = act(g, u), and its derivatives, for every path that computes it
// (the CPU reference; on CUDA the portable kernels of the non-default options: the gated up-GEMM epilogue and the
// dact_rows kernel): one definition, __host__ __device__.
//   SwiGLU          a = silu(g) u                      da/dg = u sig(g) (1 + g (1 - sig(g))), da/du = silu(g)
//   clamped SwiGLU  g' = min(g, limit), u' = clamp(u, -limit, limit) (gpt-oss), a = g' sig(alpha g') (u' + 1)
//                   da/dg = (u' + 1) sig(alpha g') (1 + alpha g' (1 - sig(alpha g'))) where g < limit, else 0
//                   da/du = g' sig(alpha g') where -limit < u < limit, else 0
// The clamps pass a NaN through (as torch.clamp does); a value on the limit gets a zero gradient (the minimum-norm
// subgradient: F.hardtanh's, and torch.clamp's since pytorch#184572; older torch.clamp passes the gradient there).
// The SwiGLU expressions are those of the portable CUDA row kernel (portable/elementwise.cu), term for term, which
// keeps its own copy of them for the default options (the default path's kernels, and the sm_90a epilogues with their
// fast division, are left as they are; TODO(#12)). T is float or double.
#pragma once

#include <cmath>

#include "megamoe/megamoe.h"

#if defined(__CUDACC__)
#define MEGAMOE_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define MEGAMOE_HOST_DEVICE inline
#endif

namespace megamoe {

MEGAMOE_HOST_DEVICE float activation_exp(float value) {
    return expf(value);
}
MEGAMOE_HOST_DEVICE double activation_exp(double value) {
    return exp(value);
}

template <typename T>
MEGAMOE_HOST_DEVICE T sigmoid_of(T value) {
    return T(1) / (T(1) + activation_exp(-value));
}

// d/dz of z sig(alpha z), given s = sig(alpha z).
template <typename T>
MEGAMOE_HOST_DEVICE T d_scaled_silu(T value, T sig, T alpha) {
    return sig * (T(1) + alpha * value * (T(1) - sig));
}

template <typename T>
struct Activation {
    megamoe_activation_kind_t kind;
    T limit;  // clamped SwiGLU only
    T alpha;  // clamped SwiGLU only

    static Activation of(const megamoe_activation_t& activation) {
        return {activation.kind, static_cast<T>(activation.limit), static_cast<T>(activation.alpha)};
    }

    MEGAMOE_HOST_DEVICE bool is_clamped() const { return kind == MEGAMOE_ACTIVATION_CLAMPED_SWIGLU; }
    MEGAMOE_HOST_DEVICE T clamped_gate(T gate) const { return gate > limit ? limit : gate; }
    MEGAMOE_HOST_DEVICE T clamped_up(T up) const { return up > limit ? limit : (up < -limit ? -limit : up); }

    // a = act(g, u).
    MEGAMOE_HOST_DEVICE T forward(T gate, T up) const {
        if (!is_clamped()) {
            const T silu = gate * sigmoid_of(gate);
            return silu * up;
        }
        const T gate_c = clamped_gate(gate);
        return gate_c * sigmoid_of(alpha * gate_c) * (clamped_up(up) + T(1));
    }

    // (dg, du) = da * (da/dg, da/du) at (g, u).
    MEGAMOE_HOST_DEVICE void backward(T gate, T up, T d_act, T* d_gate, T* d_up) const {
        if (!is_clamped()) {
            const T sig = sigmoid_of(gate);
            const T silu = gate * sig;
            *d_gate = d_act * up * sig * (T(1) + gate * (T(1) - sig));
            *d_up = d_act * silu;
            return;
        }
        const T gate_c = clamped_gate(gate), sig = sigmoid_of(alpha * gate_c);
        *d_gate = gate < limit ? d_act * (clamped_up(up) + T(1)) * d_scaled_silu(gate_c, sig, alpha) : T(0);
        *d_up = (up > -limit && up < limit) ? d_act * (gate_c * sig) : T(0);
    }
};

}  // namespace megamoe
