// The CPU reference's view of the expert parameters: read from their layout (layout.h) into canonical arrays in the
// accumulation type, and canonical gradients written back into that same layout (or, accumulating, rounded to f32 and
// added into the f32 values there: put_grad).
//   W13[e] [2I, H] gate rows, then up rows      W2[e] [H, I]            (only the experts some slot routes to)
//   b13 [E, 2I]    gate, then up (empty: none)  b2 [E, H] (empty: none)
#pragma once

#include <vector>

#include "dtype.h"
#include "layout.h"
#include "reference/parallel_for.h"

namespace megamoe::reference {

// Element `index` of a gradient: `value` stored in its dtype, or, when accumulating (an f32 buffer: validated),
// rounded to f32 and added to the value there in f32 (what the CUDA epilogues do with their f32 results).
inline void put_grad(const megamoe_tensor_t& grad, int64_t index, double value, bool accumulate) {
    if (accumulate) {
        float* element = static_cast<float*>(grad.data) + index;
        *element = *element + static_cast<float>(value);
    } else {
        store_element(grad.data, grad.dtype, index, value);
    }
}

template <typename Acc>
struct ExpertWeights {
    WeightLayout layout;
    std::vector<int64_t> block;  // [E]: expert e's block of w13 and w2, -1 for an expert no slot routes to (not read)
    std::vector<Acc> w13;        // [routed experts, 2I, H]
    std::vector<Acc> w2;         // [routed experts, H, I]
    std::vector<Acc> b13;        // [E, 2I] or empty
    std::vector<Acc> b2;         // [E, H] or empty

    // The weights of the experts that `slot_expert` (per slot, -1: none) routes to, in parallel over experts, and the
    // biases of all: a call reads what it computes with, not every expert's weights.
    static ExpertWeights read(const Experts& experts, const Shape& shape, const std::vector<int64_t>& slot_expert) {
        const int64_t E = shape.num_experts, H = shape.hidden, I = shape.intermediate;
        ExpertWeights weights{WeightLayout::of(experts.layout, H, I), std::vector<int64_t>(E, -1), {}, {}, {}, {}};
        const WeightLayout& layout = weights.layout;
        for (const int64_t e : slot_expert) {
            if (e >= 0) weights.block[e] = 0;
        }
        int64_t num_blocks = 0;
        for (int64_t& block : weights.block) {
            if (block == 0) block = num_blocks++;
        }
        weights.w13.resize(static_cast<size_t>(num_blocks * 2 * I * H));
        weights.w2.resize(static_cast<size_t>(num_blocks * H * I));
        parallel_for(E, num_blocks * 3 * I * H, [&](int64_t e) {
            if (weights.block[e] < 0) return;
            Acc* w13 = weights.w13_of(e);
            for (int64_t n = 0; n < 2 * I; ++n) {
                const megamoe_tensor_t& stored = layout.in_w3(n) ? *experts.w3 : *experts.w13;
                for (int64_t k = 0; k < H; ++k) {
                    w13[n * H + k] =
                        static_cast<Acc>(load_element(stored.data, stored.dtype, layout.w13_offset(e, n, k)));
                }
            }
            Acc* w2 = weights.w2_of(e);
            for (int64_t h = 0; h < H; ++h) {
                for (int64_t i = 0; i < I; ++i) {
                    w2[h * I + i] =
                        static_cast<Acc>(load_element(experts.w2->data, experts.w2->dtype, layout.w2_offset(e, h, i)));
                }
            }
        });
        if (experts.b13->data != nullptr) {
            weights.b13.resize(static_cast<size_t>(E * 2 * I));
            for (int64_t e = 0; e < E; ++e) {
                for (int64_t n = 0; n < 2 * I; ++n) {
                    weights.b13[e * 2 * I + n] =
                        static_cast<Acc>(load_element(experts.b13->data, experts.b13->dtype, layout.b13_offset(e, n)));
                }
            }
        }
        if (experts.b2->data != nullptr) {
            weights.b2.resize(static_cast<size_t>(E * H));
            for (int64_t idx = 0; idx < E * H; ++idx) {
                weights.b2[idx] = static_cast<Acc>(load_element(experts.b2->data, experts.b2->dtype, idx));
            }
        }
        return weights;
    }

    // Canonical W13[e] [2I, H] and W2[e] [H, I] of an expert some slot routes to.
    Acc* w13_of(int64_t expert_idx) { return &w13[block[expert_idx] * 2 * layout.intermediate * layout.hidden]; }
    const Acc* w13_of(int64_t expert_idx) const {
        return &w13[block[expert_idx] * 2 * layout.intermediate * layout.hidden];
    }
    Acc* w2_of(int64_t expert_idx) { return &w2[block[expert_idx] * layout.hidden * layout.intermediate]; }
    const Acc* w2_of(int64_t expert_idx) const { return &w2[block[expert_idx] * layout.hidden * layout.intermediate]; }

    Acc gate_up_bias(int64_t expert_idx, int64_t row_idx) const {
        return b13.empty() ? Acc(0) : b13[expert_idx * 2 * layout.intermediate + row_idx];
    }
    Acc down_bias(int64_t expert_idx, int64_t h) const {
        return b2.empty() ? Acc(0) : b2[expert_idx * layout.hidden + h];
    }

    // One expert's canonical dW13 [2I, H] into dw13 (and dw3) at the layout's positions; NULL data: not wanted.
    void write_w13_grad(const megamoe_tensor_t& dw13, const megamoe_tensor_t& dw3, int64_t expert_idx,
                        const std::vector<Acc>& grad, bool accumulate) const {
        const int64_t H = layout.hidden;
        for (int64_t n = 0; n < 2 * layout.intermediate; ++n) {
            const megamoe_tensor_t& stored = layout.in_w3(n) ? dw3 : dw13;
            if (stored.data == nullptr) continue;
            for (int64_t k = 0; k < H; ++k) {
                put_grad(stored, layout.w13_offset(expert_idx, n, k), grad[n * H + k], accumulate);
            }
        }
    }
    // One expert's canonical dW2 [H, I] into dw2.
    void write_w2_grad(const megamoe_tensor_t& dw2, int64_t expert_idx, const std::vector<Acc>& grad,
                       bool accumulate) const {
        const int64_t I = layout.intermediate;
        for (int64_t h = 0; h < layout.hidden; ++h) {
            for (int64_t i = 0; i < I; ++i)
                put_grad(dw2, layout.w2_offset(expert_idx, h, i), grad[h * I + i], accumulate);
        }
    }
    // One expert's canonical db13 [2I] into db13.
    void write_b13_grad(const megamoe_tensor_t& db13, int64_t expert_idx, const std::vector<Acc>& grad,
                        bool accumulate) const {
        for (int64_t n = 0; n < 2 * layout.intermediate; ++n) {
            put_grad(db13, layout.b13_offset(expert_idx, n), grad[n], accumulate);
        }
    }
};

}  // namespace megamoe::reference
