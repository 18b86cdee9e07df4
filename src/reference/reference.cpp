// CPU reference of DESIGN.md section 1, written to be read: every slot (t, j) is computed on its own,
// in the accumulation type Acc (double or float), with no rounding of intermediates. Inputs are first
// widened into Acc arrays (the routed experts' weights from their layout into canonical ones: expert_weights.h);
// outputs are rounded once, at the end, into their own dtypes (weight gradients into their parameters' layout).
// Per slot: h = [g, u] = W13[e] x + b13[e], a = act(g, u) (activation.h), o = W2[e] a + b2[e], y_t = sum_j s o.
//
// Memory modes: the forward writes h = [g, u] into saved_h when asked (rounded to its dtype), row by sorted row (the
// slots in the stable expert order, as the CUDA path keeps it: megamoe.h); the backward reads a given saved_h instead
// of recomputing h, and a recomputed h is rounded to that dtype too, so both modes give the same gradients bitwise.
//
// Both entry points run forward_slots / backward_slots; only the widened Inputs differ: the whole layer's slot
// (t, j) has expert topk_ids[t, j] and weight topk_weights[t, j]; grouped rows are one slot per row (topk = 1),
// expert from tokens_per_expert (none for the padding rows past their sum), weight scores[r] or 1.
//
// Determinism: y and dx sum over j = 0..topk-1 in order; dW13[e] and dW2[e] sum over the slots routed
// to e in increasing slot order (t * topk + j). Threads split tokens (y, dx) or experts (dW), never a
// single sum, so results do not depend on the thread count (parallel_for.h; small calls run on the calling thread).
// Accumulation (accumulate_weight_grads): each expert's weight and bias gradients, rounded to f32, are added into the
// caller's f32 buffers (expert_weights.h put_grad); experts with no rows leave theirs untouched.
#include "reference/reference.h"

#include <utility>
#include <vector>

#include "activation.h"
#include "dtype.h"
#include "reference/expert_weights.h"
#include "reference/parallel_for.h"

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

// The widened inputs shared by forward and backward: per slot its expert (-1: none) and weight.
template <typename Acc>
struct Inputs {
    Shape shape;
    std::vector<Acc> x;           // [T, H]
    std::vector<int64_t> expert;  // [T * topk], -1 = dropped (grouped rows: a padding row)
    std::vector<Acc> weight;      // [T * topk]
    ExpertWeights<Acc> weights;   // canonical W13[e] [2I, H], W2[e] [H, I] of the routed experts, biases
    Activation<Acc> activation;
    std::vector<int64_t> h_row;  // [T * topk]: the slot's row of saved_h (stable sort by expert), -1 = dropped
    megamoe_dtype_t h_dtype;     // the dtype saved_h holds h in: x's

    Inputs(const Shape& problem, const megamoe_tensor_t& x_t, std::vector<int64_t> slot_expert, const Experts& experts)
        : shape(problem),
          x(widen<Acc>(x_t)),
          expert(std::move(slot_expert)),
          weight(static_cast<size_t>(problem.num_slots()), Acc(1)),
          weights(ExpertWeights<Acc>::read(experts, problem, expert)),
          activation(Activation<Acc>::of(experts.activation)),
          h_row(sorted_rows(expert, problem.num_experts)),
          h_dtype(x_t.dtype) {}

    // The whole layer: slot t * topk + j goes to topk_ids[t, j] with weight topk_weights[t, j].
    static Inputs routed(const Shape& problem, const megamoe_tensor_t& x_t, const megamoe_tensor_t& ids_t,
                         const megamoe_tensor_t& weights_t, const Experts& experts) {
        std::vector<int64_t> slot_expert(static_cast<size_t>(problem.num_slots()));
        for (int64_t slot = 0; slot < problem.num_slots(); ++slot)
            slot_expert[slot] = load_index(ids_t.data, ids_t.dtype, slot);
        Inputs in(problem, x_t, std::move(slot_expert), experts);
        in.weight = widen<Acc>(weights_t);
        return in;
    }

    // Grouped rows (topk = 1): rows [n_0 + ... + n_{e-1}, n_0 + ... + n_e) go to expert e (n = counts), rows past
    // the sum to none; row r's weight is scores[r], or 1 without scores. Their h_row are the rows themselves.
    static Inputs grouped(const Shape& problem, const megamoe_tensor_t& x_t, const megamoe_tensor_t& counts_t,
                          const megamoe_tensor_t& scores_t, const Experts& experts) {
        std::vector<int64_t> row_expert(static_cast<size_t>(problem.num_slots()), -1);
        int64_t row_idx = 0;
        for (int64_t expert_idx = 0; expert_idx < problem.num_experts; ++expert_idx) {
            const int64_t num_rows = load_index(counts_t.data, counts_t.dtype, expert_idx);
            for (int64_t row_end = row_idx + num_rows; row_idx < row_end; ++row_idx) row_expert[row_idx] = expert_idx;
        }
        Inputs in(problem, x_t, std::move(row_expert), experts);
        if (scores_t.data != nullptr) in.weight = widen<Acc>(scores_t);
        return in;
    }

    // Row of each slot when the slots are sorted stably by expert (-1 for slots routed nowhere).
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

    // g, u = W13[e] x_t + b13[e] and a = act(g, u), each [I].
    void up(int64_t token_idx, int64_t expert_idx, Acc* gate, Acc* up_out, Acc* act) const {
        const int64_t H = shape.hidden, I = shape.intermediate;
        const Acc* x_row = &x[token_idx * H];
        const Acc* w = weights.w13_of(expert_idx);
        for (int64_t i = 0; i < I; ++i) {
            Acc g = weights.gate_up_bias(expert_idx, i), u = weights.gate_up_bias(expert_idx, I + i);
            for (int64_t h = 0; h < H; ++h) {
                g += w[i * H + h] * x_row[h];
                u += w[(I + i) * H + h] * x_row[h];
            }
            gate[i] = g;
            up_out[i] = u;
            act[i] = activation.forward(g, u);
        }
    }

    // g, u and a as up() gives them after a round trip through saved_h's dtype: what the backward reads in keep-h
    // mode, so that recomputing h gives the same gradients bitwise.
    void up_as_saved(int64_t token_idx, int64_t expert_idx, Acc* gate, Acc* up_out, Acc* act) const {
        up(token_idx, expert_idx, gate, up_out, act);
        for (int64_t i = 0; i < shape.intermediate; ++i) {
            gate[i] = as_saved(gate[i]);
            up_out[i] = as_saved(up_out[i]);
            act[i] = activation.forward(gate[i], up_out[i]);
        }
    }

    Acc as_saved(Acc value) const {
        uint64_t element = 0;  // room for the widest dtype
        store_element(&element, h_dtype, 0, static_cast<double>(value));
        return static_cast<Acc>(load_element(&element, h_dtype, 0));
    }
};

// y_t = sum_j s_tj o_tj, and h = [g, u] per slot into saved_h when it is present.
template <typename Acc>
void forward_slots(const Inputs<Acc>& in, const megamoe_tensor_t& y, const megamoe_tensor_t& saved_h) {
    const Shape& shape = in.shape;
    const int64_t T = shape.num_tokens, H = shape.hidden, I = shape.intermediate, topk = shape.topk;
    parallel_for(T, T * topk * 3 * H * I, [&](int64_t t) {
        std::vector<Acc> gate(I), up(I), act(I), y_row(H, Acc(0));
        for (int64_t j = 0; j < topk; ++j) {
            const int64_t slot = t * topk + j, e = in.expert[slot];
            if (e < 0) continue;
            in.up(t, e, gate.data(), up.data(), act.data());
            if (saved_h.data) {
                const int64_t h_base = in.h_row[slot] * 2 * I;
                for (int64_t i = 0; i < I; ++i) {
                    store_element(saved_h.data, saved_h.dtype, h_base + i, static_cast<double>(gate[i]));
                    store_element(saved_h.data, saved_h.dtype, h_base + I + i, static_cast<double>(up[i]));
                }
            }
            const Acc* w = in.weights.w2_of(e);
            for (int64_t h = 0; h < H; ++h) {
                Acc o = in.weights.down_bias(e, h);
                for (int64_t i = 0; i < I; ++i) o += w[h * I + i] * act[i];
                y_row[h] += in.weight[slot] * o;
            }
        }
        for (int64_t h = 0; h < H; ++h) store_element(y.data, y.dtype, t * H + h, static_cast<double>(y_row[h]));
    });
}

// What a backward writes: the gradients of x, of the slots' weights and of the expert parameters (NULL data: not
// wanted).
struct Grads {
    megamoe_tensor_t dx, dweights;
    ExpertGrads experts;
};

template <typename Acc>
void backward_slots(const Inputs<Acc>& in, const megamoe_tensor_t& dy_t, const megamoe_tensor_t& saved_h,
                    const Grads& grads) {
    const Shape& shape = in.shape;
    const std::vector<Acc> dy = widen<Acc>(dy_t);
    const int64_t T = shape.num_tokens, H = shape.hidden, I = shape.intermediate, E = shape.num_experts;
    const int64_t topk = shape.topk, S = shape.num_slots();
    std::vector<Acc> dh(static_cast<size_t>(S * 2 * I), Acc(0));  // [S, 2I] = [dg, du] per slot
    std::vector<Acc> act(static_cast<size_t>(S * I), Acc(0));     // [S, I]

    // Per slot: p = W2[e]^T dy_t, ds = <p, a> + <dy_t, b2[e]> (= <dy_t, o>), da = s p, then act's derivative into dh.
    parallel_for(T, T * topk * 5 * H * I, [&](int64_t t) {
        std::vector<Acc> gate(I), up(I), proj(I);
        for (int64_t j = 0; j < topk; ++j) {
            const int64_t slot = t * topk + j, e = in.expert[slot];
            Acc ds = 0;
            if (e >= 0) {
                Acc* a = &act[slot * I];
                if (saved_h.data) {  // h as the forward kept it (rounded), else recomputed and rounded alike
                    const int64_t h_base = in.h_row[slot] * 2 * I;
                    for (int64_t i = 0; i < I; ++i) {
                        gate[i] = static_cast<Acc>(load_element(saved_h.data, saved_h.dtype, h_base + i));
                        up[i] = static_cast<Acc>(load_element(saved_h.data, saved_h.dtype, h_base + I + i));
                        a[i] = in.activation.forward(gate[i], up[i]);
                    }
                } else {
                    in.up_as_saved(t, e, gate.data(), up.data(), a);
                }
                const Acc* w = in.weights.w2_of(e);
                for (int64_t i = 0; i < I; ++i) proj[i] = 0;
                for (int64_t h = 0; h < H; ++h) {
                    for (int64_t i = 0; i < I; ++i) proj[i] += w[h * I + i] * dy[t * H + h];
                }
                for (int64_t i = 0; i < I; ++i) {
                    ds += proj[i] * a[i];
                    in.activation.backward(gate[i], up[i], in.weight[slot] * proj[i], &dh[slot * 2 * I + i],
                                           &dh[slot * 2 * I + I + i]);
                }
                if (!in.weights.b2.empty()) {
                    for (int64_t h = 0; h < H; ++h) ds += dy[t * H + h] * in.weights.down_bias(e, h);
                }
            }
            if (grads.dweights.data) store_element(grads.dweights.data, grads.dweights.dtype, slot, ds);
        }
        if (grads.dx.data) {
            std::vector<Acc> dx_row(H, Acc(0));
            for (int64_t j = 0; j < topk; ++j) {
                const int64_t slot = t * topk + j, e = in.expert[slot];
                if (e < 0) continue;
                const Acc* w = in.weights.w13_of(e);
                for (int64_t n = 0; n < 2 * I; ++n) {
                    const Acc grad = dh[slot * 2 * I + n];
                    for (int64_t h = 0; h < H; ++h) dx_row[h] += w[n * H + h] * grad;
                }
            }
            for (int64_t h = 0; h < H; ++h) store_element(grads.dx.data, grads.dx.dtype, t * H + h, dx_row[h]);
        }
    });

    // Expert gradients: each expert sums its slots in increasing slot order.
    const ExpertGrads& wanted = grads.experts;
    const bool want_w13 = wanted.dw13->data || wanted.dw3->data, want_w2 = wanted.dw2->data != nullptr;
    const bool want_b13 = wanted.db13->data != nullptr, want_b2 = wanted.db2->data != nullptr;
    if (want_w13 || want_w2 || want_b13 || want_b2) {
        parallel_for(E, S * 3 * H * I, [&](int64_t e) {
            std::vector<Acc> dw13(want_w13 ? 2 * I * H : 0, Acc(0)), dw2(want_w2 ? H * I : 0, Acc(0));
            std::vector<Acc> db13(want_b13 ? 2 * I : 0, Acc(0)), db2(want_b2 ? H : 0, Acc(0));
            int64_t num_rows = 0;
            for (int64_t slot = 0; slot < S; ++slot) {
                if (in.expert[slot] != e) continue;
                ++num_rows;
                const int64_t t = slot / topk;
                const Acc* dh_row = &dh[slot * 2 * I];
                for (int64_t n = 0; n < 2 * I && want_w13; ++n) {
                    for (int64_t h = 0; h < H; ++h) dw13[n * H + h] += dh_row[n] * in.x[t * H + h];
                }
                for (int64_t n = 0; n < 2 * I && want_b13; ++n) db13[n] += dh_row[n];
                for (int64_t h = 0; h < H && (want_w2 || want_b2); ++h) {
                    const Acc scaled_dy = in.weight[slot] * dy[t * H + h];
                    for (int64_t i = 0; i < I && want_w2; ++i) dw2[h * I + i] += scaled_dy * act[slot * I + i];
                    if (want_b2) db2[h] += scaled_dy;
                }
            }
            const bool accumulate = wanted.accumulate;
            if (accumulate && num_rows == 0) return;  // accumulating, an expert with no rows leaves its part as is
            if (want_w13) in.weights.write_w13_grad(*wanted.dw13, *wanted.dw3, e, dw13, accumulate);
            if (want_w2) in.weights.write_w2_grad(*wanted.dw2, e, dw2, accumulate);
            if (want_b13) in.weights.write_b13_grad(*wanted.db13, e, db13, accumulate);
            for (int64_t h = 0; h < H && want_b2; ++h) {
                put_grad(*wanted.db2, e * H + h, static_cast<double>(db2[h]), accumulate);
            }
        });
    }
}

// Runs fn(Acc{}) with the accumulation type the call asks for: float for F32, else double.
template <typename Fn>
megamoe_status_t with_accum(megamoe_accum_t accum, Fn&& fn) {
    if (accum == MEGAMOE_ACCUM_F32) {
        fn(float{});
    } else {
        fn(double{});
    }
    return MEGAMOE_STATUS_SUCCESS;
}

}  // namespace

megamoe_status_t run(const megamoe_forward_params_t& p, const Shape& shape) {
    return with_accum(p.accum, [&](auto acc) {
        using Acc = decltype(acc);
        forward_slots(Inputs<Acc>::routed(shape, p.x, p.topk_ids, p.topk_weights, Experts::of(p)), p.y, p.saved_h);
    });
}

megamoe_status_t run(const megamoe_backward_params_t& p, const Shape& shape) {
    return with_accum(p.accum, [&](auto acc) {
        using Acc = decltype(acc);
        backward_slots(Inputs<Acc>::routed(shape, p.x, p.topk_ids, p.topk_weights, Experts::of(p)), p.dy, p.saved_h,
                       Grads{p.dx, p.dtopk_weights, ExpertGrads::of(p)});
    });
}

megamoe_status_t run(const megamoe_grouped_forward_params_t& p, const Shape& shape) {
    return with_accum(p.accum, [&](auto acc) {
        using Acc = decltype(acc);
        forward_slots(Inputs<Acc>::grouped(shape, p.x_sorted, p.tokens_per_expert, p.scores, Experts::of(p)), p.out,
                      p.saved_h);
    });
}

megamoe_status_t run(const megamoe_grouped_backward_params_t& p, const Shape& shape) {
    return with_accum(p.accum, [&](auto acc) {
        using Acc = decltype(acc);
        backward_slots(Inputs<Acc>::grouped(shape, p.x_sorted, p.tokens_per_expert, p.scores, Experts::of(p)), p.dout,
                       p.saved_h, Grads{p.dx_sorted, p.dscores, ExpertGrads::of(p)});
    });
}

}  // namespace megamoe::reference
