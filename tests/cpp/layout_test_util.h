// Helpers of the layout tests: a whole-layer problem whose expert parameters are stored in a given layout (w13, w3,
// w2, b13, b2 as megamoe.h describes them), and an independent naive computation of its outputs and gradients in f64,
// written from those storage definitions (not from src/layout.h) with the activation written out again here (not from
// src/activation.h).
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "test_util.h"

namespace megamoe::test {

// Whether an optional HostTensor was made (a default one has no dimensions and no data).
inline bool present(const HostTensor& tensor) {
    return tensor.view.ndim > 0;
}

struct LayoutCase {
    megamoe_gate_up_t gate_up;
    bool w13_transposed, w2_transposed;
    bool clamped;  // gpt-oss's clamped SwiGLU (limit 0.6: many clamps active), else SwiGLU
    bool biases;   // b13 and b2
};

// The gradients a backward writes, each shaped as its input (absent ones empty).
struct LayoutGrads {
    HostTensor y, dx, dweights, dw13, dw3, dw2, db13, db2;
    HostTensor ds_scale;  // naive(): per slot sum_h |dy_h o_h|, the size of the terms of d topk_weights
};

struct LayoutProblem {
    Problem base;  // x, topk_ids, topk_weights, dy (its w13 / w2 unused)
    LayoutCase layout_case;
    HostTensor w13, w3, w2, b13, b2;
    static constexpr double kLimit = 0.6, kAlpha = 1.702;

    LayoutProblem(int64_t T, int64_t H, int64_t I, int64_t E, int64_t topk, LayoutCase c) : base(T, H, I, E, topk) {
        layout_case = c;
    }

    int64_t gate_up_rows() const {
        return layout_case.gate_up == MEGAMOE_GATE_UP_SEPARATE ? base.intermediate : 2 * base.intermediate;
    }
    std::vector<int64_t> w13_shape() const {
        const int64_t E = base.num_experts, H = base.hidden, rows = gate_up_rows();
        return layout_case.w13_transposed ? std::vector<int64_t>{E, H, rows} : std::vector<int64_t>{E, rows, H};
    }

    void make(std::mt19937_64& rng, Routing routing = Routing::kSomeDropped) {
        base.routing = routing;
        base.make(rng);
        const int64_t H = base.hidden, I = base.intermediate, E = base.num_experts;
        w13 = HostTensor(MEGAMOE_DTYPE_F64, w13_shape());
        w13.fill_random(rng, 1.0 / std::sqrt(static_cast<double>(H)));
        if (layout_case.gate_up == MEGAMOE_GATE_UP_SEPARATE) {
            w3 = HostTensor(MEGAMOE_DTYPE_F64, w13_shape());
            w3.fill_random(rng, 1.0 / std::sqrt(static_cast<double>(H)));
        }
        w2 = HostTensor(MEGAMOE_DTYPE_F64,
                        layout_case.w2_transposed ? std::vector<int64_t>{E, I, H} : std::vector<int64_t>{E, H, I});
        w2.fill_random(rng, 1.0 / std::sqrt(static_cast<double>(I)));
        if (layout_case.biases) {
            b13 = HostTensor(MEGAMOE_DTYPE_F64, {E, 2 * I});
            b2 = HostTensor(MEGAMOE_DTYPE_F64, {E, H});
            b13.fill_random(rng, 0.3);
            b2.fill_random(rng, 0.3);
        }
    }

    // Offset in the w13-like tensor of (expert e, stored row r, column k).
    int64_t rows_offset(int64_t e, int64_t r, int64_t k) const {
        const int64_t H = base.hidden, R = gate_up_rows();
        return layout_case.w13_transposed ? (e * H + k) * R + r : (e * R + r) * H + k;
    }
    // (tensor, offset) of gate (is_up false) or up weight i, column k of expert e.
    std::pair<int, int64_t> gate_up_at(int64_t e, int64_t i, int64_t k, bool is_up) const {
        const int64_t I = base.intermediate;
        switch (layout_case.gate_up) {
            case MEGAMOE_GATE_UP_INTERLEAVED:
                return {0, rows_offset(e, 2 * i + (is_up ? 1 : 0), k)};
            case MEGAMOE_GATE_UP_SEPARATE:
                return {is_up ? 1 : 0, rows_offset(e, i, k)};
            default:
                return {0, rows_offset(e, is_up ? I + i : i, k)};
        }
    }
    int64_t down_at(int64_t e, int64_t h, int64_t i) const {
        const int64_t H = base.hidden, I = base.intermediate;
        return layout_case.w2_transposed ? (e * I + i) * H + h : (e * H + h) * I + i;
    }
    int64_t bias13_at(int64_t e, int64_t i, bool is_up) const {
        const int64_t I = base.intermediate;
        if (layout_case.gate_up == MEGAMOE_GATE_UP_INTERLEAVED) return e * 2 * I + 2 * i + (is_up ? 1 : 0);
        return e * 2 * I + (is_up ? I + i : i);
    }
    double weight(int64_t e, int64_t i, int64_t k, bool is_up) const {
        const auto [tensor, offset] = gate_up_at(e, i, k, is_up);
        return (tensor ? w3 : w13).get(offset);
    }

    // a and (da/dg, da/du) written out for both activations.
    void activation(double g, double u, double* a, double* dg, double* du) const {
        if (!layout_case.clamped) {
            const double sig = 1.0 / (1.0 + std::exp(-g));
            *a = g * sig * u;
            *dg = u * (sig + g * sig * (1.0 - sig));
            *du = g * sig;
            return;
        }
        const double gc = std::min(g, kLimit), uc = std::max(-kLimit, std::min(u, kLimit));
        const double sig = 1.0 / (1.0 + std::exp(-kAlpha * gc));
        *a = gc * sig * (uc + 1.0);
        *dg = g < kLimit ? (uc + 1.0) * (sig + kAlpha * gc * sig * (1.0 - sig)) : 0.0;
        *du = (u > -kLimit && u < kLimit) ? gc * sig : 0.0;
    }

    // Every output and gradient, slot by slot.
    LayoutGrads naive() const {
        const int64_t T = base.num_tokens, H = base.hidden, I = base.intermediate, topk = base.topk;
        LayoutGrads out{HostTensor(MEGAMOE_DTYPE_F64, {T, H}),
                        HostTensor(MEGAMOE_DTYPE_F64, {T, H}),
                        HostTensor(MEGAMOE_DTYPE_F64, {T, topk}),
                        HostTensor(MEGAMOE_DTYPE_F64, w13_shape()),
                        present(w3) ? HostTensor(MEGAMOE_DTYPE_F64, w13_shape()) : HostTensor(),
                        HostTensor(MEGAMOE_DTYPE_F64, {w2.view.shape[0], w2.view.shape[1], w2.view.shape[2]}),
                        present(b13) ? HostTensor(MEGAMOE_DTYPE_F64, {b13.view.shape[0], 2 * I}) : HostTensor(),
                        present(b2) ? HostTensor(MEGAMOE_DTYPE_F64, {b2.view.shape[0], H}) : HostTensor()};
        out.ds_scale = HostTensor(MEGAMOE_DTYPE_F64, {T, topk});
        std::vector<double> gate(I), up(I), act(I), dgate(I), dup(I), proj(I);
        for (int64_t slot = 0; slot < T * topk; ++slot) {
            const auto e = static_cast<int64_t>(base.ids.get(slot));
            if (e < 0) continue;
            const int64_t t = slot / topk;
            const double s = base.weights.get(slot);
            for (int64_t i = 0; i < I; ++i) {
                gate[i] = present(b13) ? b13.get(bias13_at(e, i, false)) : 0.0;
                up[i] = present(b13) ? b13.get(bias13_at(e, i, true)) : 0.0;
                for (int64_t k = 0; k < H; ++k) {
                    gate[i] += weight(e, i, k, false) * base.x.get(t * H + k);
                    up[i] += weight(e, i, k, true) * base.x.get(t * H + k);
                }
                activation(gate[i], up[i], &act[i], &dgate[i], &dup[i]);
                proj[i] = 0.0;
            }
            double ds = 0.0;
            for (int64_t h = 0; h < H; ++h) {
                double o = present(b2) ? b2.get(e * H + h) : 0.0;
                for (int64_t i = 0; i < I; ++i) o += w2.get(down_at(e, h, i)) * act[i];
                out.y.set(t * H + h, out.y.get(t * H + h) + s * o);
                const double dy = base.dy.get(t * H + h);
                ds += dy * o;
                out.ds_scale.set(slot, out.ds_scale.get(slot) + std::fabs(dy * o));
                for (int64_t i = 0; i < I; ++i) {
                    proj[i] += w2.get(down_at(e, h, i)) * dy;
                    out.dw2.set(down_at(e, h, i), out.dw2.get(down_at(e, h, i)) + s * dy * act[i]);
                }
                if (present(b2)) out.db2.set(e * H + h, out.db2.get(e * H + h) + s * dy);
            }
            out.dweights.set(slot, ds);
            for (int64_t i = 0; i < I; ++i) {
                for (const bool is_up : {false, true}) {
                    const double dh = s * proj[i] * (is_up ? dup[i] : dgate[i]);
                    if (present(b13)) out.db13.set(bias13_at(e, i, is_up), out.db13.get(bias13_at(e, i, is_up)) + dh);
                    for (int64_t k = 0; k < H; ++k) {
                        const auto [tensor, offset] = gate_up_at(e, i, k, is_up);
                        HostTensor& dw = tensor ? out.dw3 : out.dw13;
                        dw.set(offset, dw.get(offset) + dh * base.x.get(t * H + k));
                        out.dx.set(t * H + k, out.dx.get(t * H + k) + dh * weight(e, i, k, is_up));
                    }
                }
            }
        }
        return out;
    }

    void set_experts(megamoe_tensor_t* w13_view, megamoe_tensor_t* w3_view, megamoe_tensor_t* w2_view,
                     megamoe_tensor_t* b13_view, megamoe_tensor_t* b2_view, megamoe_layout_t* layout,
                     megamoe_activation_t* act) const {
        *w13_view = w13.view;
        *w2_view = w2.view;
        if (present(w3)) *w3_view = w3.view;
        if (present(b13)) *b13_view = b13.view;
        if (present(b2)) *b2_view = b2.view;
        layout->gate_up = layout_case.gate_up;
        layout->w13_transposed = layout_case.w13_transposed;
        layout->w2_transposed = layout_case.w2_transposed;
        if (layout_case.clamped) *act = {MEGAMOE_ACTIVATION_CLAMPED_SWIGLU, kLimit, kAlpha};
    }

    megamoe_forward_params_t forward_params(HostTensor& y) const {
        megamoe_forward_params_t p = base.forward_params(y);
        set_experts(&p.w13, &p.w3, &p.w2, &p.b13, &p.b2, &p.layout, &p.activation);
        return p;
    }

    // The backward writing every gradient of `grads` (its y unused).
    megamoe_backward_params_t backward_params(LayoutGrads& grads) const {
        megamoe_backward_params_t p = base.backward_params(grads.dx, grads.dweights, grads.dw13, grads.dw2);
        set_experts(&p.w13, &p.w3, &p.w2, &p.b13, &p.b2, &p.layout, &p.activation);
        if (present(w3)) p.dw3 = grads.dw3.view;
        if (present(b13)) p.db13 = grads.db13.view;
        if (present(b2)) p.db2 = grads.db2.view;
        return p;
    }
};

// Every layout x activation x bias combination.
inline std::vector<LayoutCase> all_layout_cases() {
    std::vector<LayoutCase> cases;
    for (const auto gate_up : {MEGAMOE_GATE_UP_CONCATENATED, MEGAMOE_GATE_UP_INTERLEAVED, MEGAMOE_GATE_UP_SEPARATE}) {
        for (const int transposes : {0, 1, 2, 3}) {
            for (const bool clamped : {false, true}) {
                for (const bool biases : {false, true}) {
                    cases.push_back({gate_up, (transposes & 1) != 0, (transposes & 2) != 0, clamped, biases});
                }
            }
        }
    }
    return cases;
}

}  // namespace megamoe::test
