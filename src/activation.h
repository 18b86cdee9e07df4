// The activation between the two projections, a = act(g, u), and its derivatives: one definition for every path that
// computes it (the CPU reference, the portable CUDA kernels, the sm_90a epilogues).
//   SwiGLU          a = silu(g) u                      da/dg = u sig(g) (1 + g (1 - sig(g))), da/du = silu(g)
//   clamped SwiGLU  g' = min(g, limit), u' = clamp(u, -limit, limit) (gpt-oss), a = g' sig(alpha g') (u' + 1)
//                   da/dg = (u' + 1) sig(alpha g') (1 + alpha g' (1 - sig(alpha g'))) where g < limit, else 0
//                   da/du = g' sig(alpha g') where -limit < u < limit, else 0
// The clamps pass a NaN through (as torch.clamp does); a value on the limit gets a zero gradient (the minimum-norm
// subgradient: F.hardtanh's, and torch.clamp's since pytorch#184572; older torch.clamp passes the gradient there).
//
// Numerics are named policies, each defining sig(x) = 1 / (1 + exp(-x)) and silu(x) = x sig(x) one way; the
// expressions above are written once (SwiGLU, Activation) for every policy:
//   PreciseMath  expf (exp for double) and IEEE division, silu = x * sig(x); __host__ __device__, float or double.
//                The CPU reference, the portable CUDA kernels (the up GEMM's gated epilogue, dact_rows) and the
//                sm_90a epilogues of clamped SwiGLU (Activation's default).
//   FastExpMath  __expf (the special-function unit's exp2, about 2 ulp) and IEEE division, silu = x * sig(x); device,
//                float. The sm_90a dSwiGLU epilogues (dH, 16-bit and FP8): the fast exponential for the epilogue's
//                throughput, the IEEE division for the derivative's accuracy.
//   FastMath     __expf and __fdividef, silu = __fdividef(x, 1 + __expf(-x)) (about 2 ulp; for x below about -87
//                exp(-x) is inf and silu gives 0, the limit); device, float. The sm_90a up GEMMs' SwiGLU epilogues
//                (the forward, 16-bit and FP8): the epilogue's throughput.
#pragma once

#include <cmath>

#include "host_device.h"
#include "megamoe/megamoe.h"

namespace megamoe {

struct PreciseMath {
    MEGAMOE_HOST_DEVICE static float exp(float value) { return expf(value); }
    MEGAMOE_HOST_DEVICE static double exp(double value) { return ::exp(value); }
    template <typename T>
    MEGAMOE_HOST_DEVICE static T sigmoid(T value) {
        return T(1) / (T(1) + exp(-value));
    }
    template <typename T>
    MEGAMOE_HOST_DEVICE static T silu(T value) {
        return value * sigmoid(value);
    }
};

#if defined(__CUDACC__)
struct FastExpMath {
    __device__ __forceinline__ static float sigmoid(float value) { return 1.0f / (1.0f + __expf(-value)); }
    __device__ __forceinline__ static float silu(float value) { return value * sigmoid(value); }
};

struct FastMath {
    __device__ __forceinline__ static float sigmoid(float value) { return __fdividef(1.0f, 1.0f + __expf(-value)); }
    __device__ __forceinline__ static float silu(float value) { return __fdividef(value, 1.0f + __expf(-value)); }
};
#endif

// SwiGLU in the numerics of Math.
template <typename Math>
struct SwiGLU {
    // a = silu(g) u.
    template <typename T>
    MEGAMOE_HOST_DEVICE static T forward(T gate, T up) {
        return Math::silu(gate) * up;
    }

    // a = silu(g) u with silu(g) = g sig(g), and (dg, du) = da * (da/dg, da/du) at (g, u), from one sigmoid.
    template <typename T>
    MEGAMOE_HOST_DEVICE static void backward(T gate, T up, T d_act, T* act, T* d_gate, T* d_up) {
        const T sig = Math::sigmoid(gate);
        const T silu = gate * sig;
        *act = silu * up;
        *d_gate = d_act * up * sig * (T(1) + gate * (T(1) - sig));
        *d_up = d_act * silu;
    }
};

// d/dz of z sig(alpha z), given s = sig(alpha z).
template <typename T>
MEGAMOE_HOST_DEVICE T d_scaled_silu(T value, T sig, T alpha) {
    return sig * (T(1) + alpha * value * (T(1) - sig));
}

// The activation of a call (SwiGLU or clamped SwiGLU, chosen at run time) in the numerics of Math. T is float or
// double.
template <typename T, typename Math = PreciseMath>
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
        if (!is_clamped()) return SwiGLU<Math>::forward(gate, up);
        const T gate_c = clamped_gate(gate);
        return gate_c * Math::sigmoid(alpha * gate_c) * (clamped_up(up) + T(1));
    }

    // (dg, du) = da * (da/dg, da/du) at (g, u).
    MEGAMOE_HOST_DEVICE void backward(T gate, T up, T d_act, T* d_gate, T* d_up) const {
        if (!is_clamped()) {
            T act;
            SwiGLU<Math>::backward(gate, up, d_act, &act, d_gate, d_up);
            return;
        }
        const T gate_c = clamped_gate(gate), sig = Math::sigmoid(alpha * gate_c);
        *d_gate = gate < limit ? d_act * (clamped_up(up) + T(1)) * d_scaled_silu(gate_c, sig, alpha) : T(0);
        *d_up = (up > -limit && up < limit) ? d_act * (gate_c * sig) : T(0);
    }
};

}  // namespace megamoe
