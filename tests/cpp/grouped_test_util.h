// Helpers of the grouped-rows tests: a random problem (rows sorted by expert, counts with empty experts, padding
// rows past the counts' sum, optional scores) and an independent naive computation of its outputs and gradients in
// f64, written row by row from DESIGN.md section 1 with one slot per row.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "test_util.h"

namespace megamoe::test {

struct GroupedProblem {
    int64_t num_rows, hidden, intermediate, num_experts;  // R, H, I, E
    std::vector<int64_t> counts;                          // rows per expert; their sum may be below R (padding)
    bool with_scores = true;
    megamoe_dtype_t dtype = MEGAMOE_DTYPE_F64;
    megamoe_dtype_t counts_dtype = MEGAMOE_DTYPE_I32;
    megamoe_dtype_t scores_dtype = MEGAMOE_DTYPE_F64;  // f32 or dtype

    HostTensor x_sorted, tokens_per_expert, scores, w13, w2, dout;

    GroupedProblem(int64_t R, int64_t H, int64_t I, std::vector<int64_t> rows_per_expert)
        : num_rows(R),
          hidden(H),
          intermediate(I),
          num_experts(static_cast<int64_t>(rows_per_expert.size())),
          counts(std::move(rows_per_expert)) {}

    int64_t num_valid_rows() const { return std::accumulate(counts.begin(), counts.end(), int64_t{0}); }

    // The expert of row r, -1 for a padding row.
    int64_t expert_of_row(int64_t row_idx) const {
        int64_t row_end = 0;
        for (int64_t expert_idx = 0; expert_idx < num_experts; ++expert_idx) {
            row_end += counts[static_cast<size_t>(expert_idx)];
            if (row_idx < row_end) return expert_idx;
        }
        return -1;
    }

    // Random values (padding rows too: they must not matter), scores in [0.05, 1).
    void make(std::mt19937_64& rng) {
        const int64_t R = num_rows, H = hidden, I = intermediate, E = num_experts;
        x_sorted = HostTensor(dtype, {R, H});
        tokens_per_expert = HostTensor(counts_dtype, {E});
        scores = HostTensor(scores_dtype, {R});
        w13 = HostTensor(dtype, {E, 2 * I, H});
        w2 = HostTensor(dtype, {E, H, I});
        dout = HostTensor(dtype, {R, H});
        x_sorted.fill_random(rng, 0.5);
        w13.fill_random(rng, 1.0 / std::sqrt(static_cast<double>(H)));
        w2.fill_random(rng, 1.0 / std::sqrt(static_cast<double>(I)));
        dout.fill_random(rng, 1.0);
        std::uniform_real_distribution<double> uniform(0.05, 1.0);
        for (int64_t row_idx = 0; row_idx < R; ++row_idx) scores.set(row_idx, uniform(rng));
        for (int64_t expert_idx = 0; expert_idx < E; ++expert_idx) {
            tokens_per_expert.set(expert_idx, static_cast<double>(counts[static_cast<size_t>(expert_idx)]));
        }
    }

    megamoe_grouped_forward_params_t forward_params(HostTensor& out) const {
        megamoe_grouped_forward_params_t p{};
        p.x_sorted = x_sorted.view;
        p.tokens_per_expert = tokens_per_expert.view;
        if (with_scores) p.scores = scores.view;
        p.w13 = w13.view;
        p.w2 = w2.view;
        p.out = out.view;
        return p;
    }

    // dscores may be NULL (not wanted; it must be when there are no scores).
    megamoe_grouped_backward_params_t backward_params(HostTensor& dx, HostTensor* dscores, HostTensor& dw13,
                                                      HostTensor& dw2) const {
        megamoe_grouped_backward_params_t p{};
        p.dout = dout.view;
        p.x_sorted = x_sorted.view;
        p.tokens_per_expert = tokens_per_expert.view;
        if (with_scores) p.scores = scores.view;
        p.w13 = w13.view;
        p.w2 = w2.view;
        p.dx_sorted = dx.view;
        if (dscores != nullptr) p.dscores = dscores->view;
        p.dw13 = dw13.view;
        p.dw2 = dw2.view;
        return p;
    }
};

// Row counts for E experts holding num_valid rows: `empty` experts get none (spread out), the rest share them at
// random (one of them may take all).
inline std::vector<int64_t> random_counts(int64_t num_experts, int64_t num_valid, const std::vector<int64_t>& empty,
                                          std::mt19937_64& rng) {
    std::vector<int64_t> counts(static_cast<size_t>(num_experts), 0);
    std::vector<int64_t> open;
    for (int64_t expert_idx = 0; expert_idx < num_experts; ++expert_idx) {
        if (std::find(empty.begin(), empty.end(), expert_idx) == empty.end()) open.push_back(expert_idx);
    }
    std::uniform_int_distribution<size_t> pick(0, open.size() - 1);
    for (int64_t row_idx = 0; row_idx < num_valid; ++row_idx) ++counts[static_cast<size_t>(open[pick(rng)])];
    return counts;
}

// Outputs and gradients of a grouped problem, f64, from its stored (rounded) values. ds_scale[r] = sum_i |p_i a_i|,
// the size of the terms of ds = <p, a> (a single ds can cancel: see dtopk_term_scale).
struct GroupedResult {
    std::vector<double> out, dx, dscores, ds_scale, dw13, dw2;
};

inline GroupedResult naive_grouped(const GroupedProblem& problem) {
    const int64_t R = problem.num_rows, H = problem.hidden, I = problem.intermediate, E = problem.num_experts;
    GroupedResult result{std::vector<double>(static_cast<size_t>(R * H), 0.0),
                         std::vector<double>(static_cast<size_t>(R * H), 0.0),
                         std::vector<double>(static_cast<size_t>(R), 0.0),
                         std::vector<double>(static_cast<size_t>(R), 0.0),
                         std::vector<double>(static_cast<size_t>(E * 2 * I * H), 0.0),
                         std::vector<double>(static_cast<size_t>(E * H * I), 0.0)};
    std::vector<double> gate(static_cast<size_t>(I)), up(static_cast<size_t>(I)), act(static_cast<size_t>(I));
    for (int64_t row_idx = 0; row_idx < R; ++row_idx) {
        const int64_t e = problem.expert_of_row(row_idx);
        if (e < 0) continue;  // padding: zeros everywhere
        const double score = problem.with_scores ? problem.scores.get(row_idx) : 1.0;
        auto x = [&](int64_t h) { return problem.x_sorted.get(row_idx * H + h); };
        auto w13 = [&](int64_t n, int64_t h) { return problem.w13.get((e * 2 * I + n) * H + h); };
        auto w2 = [&](int64_t h, int64_t i) { return problem.w2.get((e * H + h) * I + i); };
        for (int64_t i = 0; i < I; ++i) {
            gate[i] = up[i] = 0.0;
            for (int64_t h = 0; h < H; ++h) {
                gate[i] += w13(i, h) * x(h);
                up[i] += w13(I + i, h) * x(h);
            }
            act[i] = gate[i] / (1.0 + std::exp(-gate[i])) * up[i];
        }
        for (int64_t h = 0; h < H; ++h) {
            double o = 0.0;
            for (int64_t i = 0; i < I; ++i) o += w2(h, i) * act[i];
            result.out[row_idx * H + h] = score * o;
        }
        for (int64_t i = 0; i < I; ++i) {
            double p = 0.0;
            for (int64_t h = 0; h < H; ++h) p += w2(h, i) * problem.dout.get(row_idx * H + h);
            result.dscores[row_idx] += p * act[i];
            result.ds_scale[row_idx] += std::fabs(p * act[i]);
            const double sig = 1.0 / (1.0 + std::exp(-gate[i]));
            const double d_gate = score * p * up[i] * sig * (1.0 + gate[i] * (1.0 - sig));
            const double d_up = score * p * gate[i] * sig;
            for (int64_t h = 0; h < H; ++h) {
                result.dx[row_idx * H + h] += w13(i, h) * d_gate + w13(I + i, h) * d_up;
                result.dw13[(e * 2 * I + i) * H + h] += d_gate * x(h);
                result.dw13[(e * 2 * I + I + i) * H + h] += d_up * x(h);
                result.dw2[(e * H + h) * I + i] += score * problem.dout.get(row_idx * H + h) * act[i];
            }
        }
    }
    return result;
}

// ||got - want|| / ||scale|| (scale: want itself when NULL); NaN anywhere in got gives NaN.
inline double relative_error(const HostTensor& got, const std::vector<double>& want,
                             const std::vector<double>* scale = nullptr) {
    double diff = 0.0, norm = 0.0;
    for (int64_t idx = 0; idx < got.size(); ++idx) {
        const double delta = got.get(idx) - want[static_cast<size_t>(idx)];
        const double size = scale != nullptr ? (*scale)[static_cast<size_t>(idx)] : want[static_cast<size_t>(idx)];
        diff += delta * delta;
        norm += size * size;
    }
    return norm > 0.0 ? std::sqrt(diff / norm) : std::sqrt(diff);
}

// Every element of rows [first_row, num_rows) of a [num_rows, row_len] tensor is exactly 0.
inline bool rows_are_zero(const HostTensor& tensor, int64_t first_row, int64_t row_len) {
    for (int64_t idx = first_row * row_len; idx < tensor.size(); ++idx) {
        if (tensor.get(idx) != 0.0) return false;
    }
    return true;
}

}  // namespace megamoe::test
