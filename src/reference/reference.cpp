// CPU reference of DESIGN.md section 1, written to be read: every slot (t, j) is computed on its own,
// in the accumulation type Acc (double or float), with no rounding of intermediates. Inputs are first
// widened into Acc arrays; outputs are rounded once, at the end, into their own dtypes.
//
// Memory modes: the forward writes h = [g, u] into saved_h when asked (rounded to its dtype), row by sorted row (the
// slots in the stable expert order, as the CUDA path keeps it: megamoe.h); the backward reads a given saved_h instead
// of recomputing h.
//
// Determinism: y and dx sum over j = 0..topk-1 in order; dW13[e] and dW2[e] sum over the slots routed
// to e in increasing slot order (t * topk + j). Threads split tokens (y, dx) or experts (dW), never a
// single sum, so results do not depend on the thread count.
#include "reference/reference.h"

#include <cmath>
#include <vector>

#include "dtype.h"

namespace megamoe::reference {
namespace {

template <typename Acc>
std::vector<Acc> widen(const megamoe_tensor_t& tensor) {
    const int64_t count = numel(tensor);
    std::vector<Acc> values(static_cast<size_t>(count));
    for (int64_t idx = 0; idx < count; ++idx)
        values[idx] = static_cast<Acc>(load_element(tensor.data, tensor.dtype, idx));
    return values;
}

template <typename Acc>
Acc sigmoid(Acc value) {
    return Acc(1) / (Acc(1) + std::exp(-value));
}

// The widened inputs shared by forward and backward.
template <typename Acc>
struct Inputs {
    Shape shape;
    std::vector<Acc> x;           // [T, H]
    std::vector<int64_t> expert;  // [T * topk], -1 = dropped
    std::vector<Acc> weight;      // [T * topk]
    std::vector<Acc> w13;         // [E, 2I, H]
    std::vector<Acc> w2;          // [E, H, I]
    std::vector<int64_t> h_row;   // [T * topk]: the slot's row of saved_h (stable sort by expert), -1 = dropped

    Inputs(const Shape& problem, const megamoe_tensor_t& x_t, const megamoe_tensor_t& ids_t,
           const megamoe_tensor_t& weights_t, const megamoe_tensor_t& w13_t, const megamoe_tensor_t& w2_t)
        : shape(problem),
          x(widen<Acc>(x_t)),
          expert(static_cast<size_t>(problem.num_slots())),
          weight(widen<Acc>(weights_t)),
          w13(widen<Acc>(w13_t)),
          w2(widen<Acc>(w2_t)) {
        for (int64_t slot = 0; slot < problem.num_slots(); ++slot)
            expert[slot] = load_index(ids_t.data, ids_t.dtype, slot);
        h_row = sorted_rows(expert, problem.num_experts);
    }

    // Row of each slot when the slots are sorted stably by expert (dropped slots get -1).
    static std::vector<int64_t> sorted_rows(const std::vector<int64_t>& expert, int64_t num_experts) {
        std::vector<int64_t> expert_begin(static_cast<size_t>(num_experts) + 1, 0);
        for (const int64_t e : expert) {
            if (e >= 0) ++expert_begin[e + 1];
        }
        for (int64_t e = 0; e < num_experts; ++e) expert_begin[e + 1] += expert_begin[e];
        std::vector<int64_t> rows(expert.size(), -1);
        for (size_t slot = 0; slot < expert.size(); ++slot) {
            if (expert[slot] >= 0) rows[slot] = expert_begin[expert[slot]]++;
        }
        return rows;
    }

    // g, u = W13[e] x_t and a = silu(g) * u, each [I].
    void up(int64_t token_idx, int64_t expert_idx, Acc* gate, Acc* up_out, Acc* act) const {
        const int64_t H = shape.hidden, I = shape.intermediate;
        const Acc* x_row = &x[token_idx * H];
        const Acc* w = &w13[expert_idx * 2 * I * H];
        for (int64_t i = 0; i < I; ++i) {
            Acc g = 0, u = 0;
            for (int64_t h = 0; h < H; ++h) {
                g += w[i * H + h] * x_row[h];
                u += w[(I + i) * H + h] * x_row[h];
            }
            gate[i] = g;
            up_out[i] = u;
            act[i] = g * sigmoid(g) * u;
        }
    }
};

template <typename Acc>
megamoe_status_t forward_impl(const megamoe_forward_params_t& p, const Shape& shape) {
    const Inputs<Acc> in(shape, p.x, p.topk_ids, p.topk_weights, p.w13, p.w2);
    const int64_t T = shape.num_tokens, H = shape.hidden, I = shape.intermediate, topk = shape.topk;
#pragma omp parallel for schedule(dynamic)
    for (int64_t t = 0; t < T; ++t) {
        std::vector<Acc> gate(I), up(I), act(I), y_row(H, Acc(0));
        for (int64_t j = 0; j < topk; ++j) {
            const int64_t slot = t * topk + j, e = in.expert[slot];
            if (e < 0) continue;
            in.up(t, e, gate.data(), up.data(), act.data());
            if (p.saved_h.data) {
                const int64_t h_base = in.h_row[slot] * 2 * I;
                for (int64_t i = 0; i < I; ++i) {
                    store_element(p.saved_h.data, p.saved_h.dtype, h_base + i, static_cast<double>(gate[i]));
                    store_element(p.saved_h.data, p.saved_h.dtype, h_base + I + i, static_cast<double>(up[i]));
                }
            }
            const Acc* w = &in.w2[e * H * I];
            for (int64_t h = 0; h < H; ++h) {
                Acc o = 0;
                for (int64_t i = 0; i < I; ++i) o += w[h * I + i] * act[i];
                y_row[h] += in.weight[slot] * o;
            }
        }
        for (int64_t h = 0; h < H; ++h) store_element(p.y.data, p.y.dtype, t * H + h, static_cast<double>(y_row[h]));
    }
    return MEGAMOE_STATUS_SUCCESS;
}

template <typename Acc>
megamoe_status_t backward_impl(const megamoe_backward_params_t& p, const Shape& shape) {
    const Inputs<Acc> in(shape, p.x, p.topk_ids, p.topk_weights, p.w13, p.w2);
    const std::vector<Acc> dy = widen<Acc>(p.dy);
    const int64_t T = shape.num_tokens, H = shape.hidden, I = shape.intermediate, E = shape.num_experts;
    const int64_t topk = shape.topk, S = shape.num_slots();
    std::vector<Acc> dh(static_cast<size_t>(S * 2 * I), Acc(0));  // [S, 2I] = [dg, du] per slot
    std::vector<Acc> act(static_cast<size_t>(S * I), Acc(0));     // [S, I]

    // Per slot: p = W2[e]^T dy_t, ds = <p, a>, da = s p, then dSwiGLU into dh.
#pragma omp parallel for schedule(dynamic)
    for (int64_t t = 0; t < T; ++t) {
        std::vector<Acc> gate(I), up(I), proj(I);
        for (int64_t j = 0; j < topk; ++j) {
            const int64_t slot = t * topk + j, e = in.expert[slot];
            Acc ds = 0;
            if (e >= 0) {
                Acc* a = &act[slot * I];
                if (p.saved_h.data) {  // h as the forward kept it (rounded), else recomputed
                    const int64_t h_base = in.h_row[slot] * 2 * I;
                    for (int64_t i = 0; i < I; ++i) {
                        gate[i] = static_cast<Acc>(load_element(p.saved_h.data, p.saved_h.dtype, h_base + i));
                        up[i] = static_cast<Acc>(load_element(p.saved_h.data, p.saved_h.dtype, h_base + I + i));
                        a[i] = gate[i] * sigmoid(gate[i]) * up[i];
                    }
                } else {
                    in.up(t, e, gate.data(), up.data(), a);
                }
                const Acc* w = &in.w2[e * H * I];
                for (int64_t i = 0; i < I; ++i) proj[i] = 0;
                for (int64_t h = 0; h < H; ++h) {
                    for (int64_t i = 0; i < I; ++i) proj[i] += w[h * I + i] * dy[t * H + h];
                }
                for (int64_t i = 0; i < I; ++i) {
                    ds += proj[i] * a[i];
                    const Acc da = in.weight[slot] * proj[i], sig = sigmoid(gate[i]);
                    dh[slot * 2 * I + i] = da * up[i] * sig * (Acc(1) + gate[i] * (Acc(1) - sig));
                    dh[slot * 2 * I + I + i] = da * gate[i] * sig;
                }
            }
            if (p.dtopk_weights.data) store_element(p.dtopk_weights.data, p.dtopk_weights.dtype, slot, ds);
        }
        if (p.dx.data) {
            std::vector<Acc> dx_row(H, Acc(0));
            for (int64_t j = 0; j < topk; ++j) {
                const int64_t slot = t * topk + j, e = in.expert[slot];
                if (e < 0) continue;
                const Acc* w = &in.w13[e * 2 * I * H];
                for (int64_t n = 0; n < 2 * I; ++n) {
                    const Acc grad = dh[slot * 2 * I + n];
                    for (int64_t h = 0; h < H; ++h) dx_row[h] += w[n * H + h] * grad;
                }
            }
            for (int64_t h = 0; h < H; ++h) store_element(p.dx.data, p.dx.dtype, t * H + h, dx_row[h]);
        }
    }

    // Weight gradients: each expert sums its slots in increasing slot order.
    if (p.dw13.data || p.dw2.data) {
#pragma omp parallel for schedule(dynamic)
        for (int64_t e = 0; e < E; ++e) {
            std::vector<Acc> dw13(p.dw13.data ? 2 * I * H : 0, Acc(0)), dw2(p.dw2.data ? H * I : 0, Acc(0));
            for (int64_t slot = 0; slot < S; ++slot) {
                if (in.expert[slot] != e) continue;
                const int64_t t = slot / topk;
                for (int64_t n = 0; n < 2 * I && p.dw13.data; ++n) {
                    for (int64_t h = 0; h < H; ++h) dw13[n * H + h] += dh[slot * 2 * I + n] * in.x[t * H + h];
                }
                for (int64_t h = 0; h < H && p.dw2.data; ++h) {
                    const Acc scaled_dy = in.weight[slot] * dy[t * H + h];
                    for (int64_t i = 0; i < I; ++i) dw2[h * I + i] += scaled_dy * act[slot * I + i];
                }
            }
            for (size_t idx = 0; idx < dw13.size(); ++idx) {
                store_element(p.dw13.data, p.dw13.dtype, e * 2 * I * H + static_cast<int64_t>(idx), dw13[idx]);
            }
            for (size_t idx = 0; idx < dw2.size(); ++idx) {
                store_element(p.dw2.data, p.dw2.dtype, e * H * I + static_cast<int64_t>(idx), dw2[idx]);
            }
        }
    }
    return MEGAMOE_STATUS_SUCCESS;
}

}  // namespace

size_t forward_workspace_size(const megamoe_forward_params_t&, const Shape&) {
    return 0;
}
size_t backward_workspace_size(const megamoe_backward_params_t&, const Shape&) {
    return 0;
}

megamoe_status_t forward(const megamoe_forward_params_t& params, const Shape& shape) {
    return params.accum == MEGAMOE_ACCUM_F32 ? forward_impl<float>(params, shape) : forward_impl<double>(params, shape);
}

megamoe_status_t backward(const megamoe_backward_params_t& params, const Shape& shape) {
    return params.accum == MEGAMOE_ACCUM_F32 ? backward_impl<float>(params, shape)
                                             : backward_impl<double>(params, shape);
}

}  // namespace megamoe::reference
