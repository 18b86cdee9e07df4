// Helpers shared by the C++ tests: host buffers with a megamoe_tensor_t view, random problems
// (fresh seed per run, never zeros), routing with ragged cases, and error norms.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "dtype.h"
#include "megamoe/megamoe.h"

namespace megamoe::test {

// Seed from the clock so each run draws fresh data; printed by every test that uses it.
inline uint64_t fresh_seed() {
    static const uint64_t seed = std::random_device{}();
    return seed;
}

// A contiguous row-major view of `dims` with no data pointer yet.
inline megamoe_tensor_t contiguous_view(megamoe_dtype_t dtype, const std::vector<int64_t>& dims) {
    megamoe_tensor_t view{};
    view.dtype = dtype;
    view.ndim = static_cast<int32_t>(dims.size());
    int64_t stride = 1;
    for (int32_t dim = view.ndim - 1; dim >= 0; --dim) {
        view.shape[dim] = dims[static_cast<size_t>(dim)];
        view.strides[dim] = stride;
        stride *= dims[static_cast<size_t>(dim)];
    }
    return view;
}

// A host buffer and the tensor view of it (contiguous row-major).
struct HostTensor {
    std::vector<unsigned char> bytes;
    megamoe_tensor_t view{};

    HostTensor() = default;
    HostTensor(megamoe_dtype_t dtype, std::vector<int64_t> shape) : view(contiguous_view(dtype, shape)) {
        bytes.assign(static_cast<size_t>(numel(view)) * dtype_size(dtype) + 1, 0);  // +1: never a NULL data pointer
        view.data = bytes.data();
        view.device_type = MEGAMOE_DEVICE_CPU;
    }
    HostTensor(const HostTensor& other) : bytes(other.bytes), view(other.view) { view.data = bytes.data(); }
    HostTensor& operator=(const HostTensor& other) {
        bytes = other.bytes;
        view = other.view;
        view.data = bytes.data();
        return *this;
    }
    int64_t size() const { return numel(view); }
    double get(int64_t idx) const { return load_element(view.data, view.dtype, idx); }
    void set(int64_t idx, double value) { store_element(view.data, view.dtype, idx, value); }
    void fill(double value) {
        for (int64_t idx = 0; idx < size(); ++idx) set(idx, value);
    }
    void fill_random(std::mt19937_64& rng, double scale) {
        std::normal_distribution<double> normal(0.0, scale);
        for (int64_t idx = 0; idx < size(); ++idx) set(idx, normal(rng));
    }
};

// How topk_ids are drawn.
enum class Routing {
    kRandom,       // distinct random experts per token
    kOneExpert,    // slot 0 of every token goes to expert 0, the rest random
    kSomeDropped,  // random, with about a quarter of the slots set to -1
    kHalfEmpty,    // only even experts are ever chosen (odd ones get zero tokens)
};

struct Problem {
    int64_t num_tokens, hidden, intermediate, num_experts, topk;
    megamoe_dtype_t dtype = MEGAMOE_DTYPE_F64;
    megamoe_dtype_t id_dtype = MEGAMOE_DTYPE_I32;
    Routing routing = Routing::kRandom;

    HostTensor x, ids, weights, w13, w2, dy;

    Problem(int64_t T, int64_t H, int64_t I, int64_t E, int64_t k)
        : num_tokens(T), hidden(H), intermediate(I), num_experts(E), topk(k) {}

    void make(std::mt19937_64& rng) {
        const int64_t T = num_tokens, H = hidden, I = intermediate, E = num_experts;
        x = HostTensor(dtype, {T, H});
        ids = HostTensor(id_dtype, {T, topk});
        weights = HostTensor(dtype == MEGAMOE_DTYPE_F64 ? MEGAMOE_DTYPE_F64 : MEGAMOE_DTYPE_F32, {T, topk});
        w13 = HostTensor(dtype, {E, 2 * I, H});
        w2 = HostTensor(dtype, {E, H, I});
        dy = HostTensor(dtype, {T, H});
        x.fill_random(rng, 0.5);
        w13.fill_random(rng, 1.0 / std::sqrt(static_cast<double>(H)));
        w2.fill_random(rng, 1.0 / std::sqrt(static_cast<double>(I)));
        dy.fill_random(rng, 1.0);
        std::uniform_real_distribution<double> uniform(0.05, 1.0);
        for (int64_t idx = 0; idx < weights.size(); ++idx) weights.set(idx, uniform(rng));
        for (int64_t t = 0; t < T; ++t) {
            std::vector<int64_t> pool;
            for (int64_t e = 0; e < E; ++e) {
                if (routing != Routing::kHalfEmpty || e % 2 == 0) pool.push_back(e);
            }
            std::shuffle(pool.begin(), pool.end(), rng);
            for (int64_t j = 0; j < topk; ++j) {
                int64_t e = pool[static_cast<size_t>(j) % pool.size()];  // repeats only when topk > pool
                if (routing == Routing::kOneExpert && j == 0) e = 0;
                if (routing == Routing::kSomeDropped && rng() % 4 == 0) e = -1;
                ids.set(t * topk + j, static_cast<double>(e));
            }
        }
    }

    megamoe_forward_params_t forward_params(HostTensor& y) const {
        megamoe_forward_params_t p{};
        p.x = x.view;
        p.topk_ids = ids.view;
        p.topk_weights = weights.view;
        p.w13 = w13.view;
        p.w2 = w2.view;
        p.y = y.view;
        return p;
    }

    megamoe_backward_params_t backward_params(HostTensor& dx, HostTensor& dw, HostTensor& dw13, HostTensor& dw2) const {
        megamoe_backward_params_t p{};
        p.dy = dy.view;
        p.x = x.view;
        p.topk_ids = ids.view;
        p.topk_weights = weights.view;
        p.w13 = w13.view;
        p.w2 = w2.view;
        p.dx = dx.view;
        p.dtopk_weights = dw.view;
        p.dw13 = dw13.view;
        p.dw2 = dw2.view;
        return p;
    }
};

// Per slot, sum_i |p_i a_i| with p = W2[e]^T dy_t and a = silu(g) * u: the size of the terms of
// ds = <p, a>. A single ds can cancel to near zero (T = 1, topk = 1 gives one scalar), and the GPU's
// bf16 rounding of h = [g, u] then dominates its relative error; against the size of its terms the
// error stays far below the tolerance (about 4e-3 at worst for bf16 in a 20000-draw simulation).
inline std::vector<double> dtopk_term_scale(const Problem& problem) {
    const int64_t H = problem.hidden, I = problem.intermediate;
    std::vector<double> scale(static_cast<size_t>(problem.num_tokens * problem.topk), 0.0);
    for (int64_t slot_idx = 0; slot_idx < problem.num_tokens * problem.topk; ++slot_idx) {
        const auto expert_idx = static_cast<int64_t>(problem.ids.get(slot_idx));
        if (expert_idx < 0) continue;
        const int64_t token_idx = slot_idx / problem.topk;
        for (int64_t col = 0; col < I; ++col) {
            double gate = 0.0, up = 0.0, p = 0.0;
            for (int64_t h = 0; h < H; ++h) {
                const double x = problem.x.get(token_idx * H + h);
                gate += problem.w13.get((expert_idx * 2 * I + col) * H + h) * x;
                up += problem.w13.get((expert_idx * 2 * I + I + col) * H + h) * x;
                p += problem.w2.get((expert_idx * H + h) * I + col) * problem.dy.get(token_idx * H + h);
            }
            scale[static_cast<size_t>(slot_idx)] += std::fabs(p * gate / (1.0 + std::exp(-gate)) * up);
        }
    }
    return scale;
}

// ||a - b|| / ||b|| over all elements (Frobenius); NaN anywhere in a gives NaN.
inline double relative_error(const HostTensor& a, const HostTensor& b) {
    double diff = 0.0, norm = 0.0;
    for (int64_t idx = 0; idx < b.size(); ++idx) {
        const double d = a.get(idx) - b.get(idx);
        diff += d * d;
        norm += b.get(idx) * b.get(idx);
    }
    return std::sqrt(diff) / std::max(std::sqrt(norm), 1e-300);
}

}  // namespace megamoe::test
