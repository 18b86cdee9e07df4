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

// A host buffer and the tensor view of it (contiguous row-major).
struct HostTensor {
    std::vector<unsigned char> bytes;
    megamoe_tensor_t view{};

    HostTensor() = default;
    HostTensor(megamoe_dtype_t dtype, std::vector<int64_t> shape) {
        view.dtype = dtype;
        view.ndim = static_cast<int32_t>(shape.size());
        int64_t count = 1;
        for (int32_t dim = view.ndim - 1; dim >= 0; --dim) {
            view.shape[dim] = shape[dim];
            view.strides[dim] = count;
            count *= shape[dim];
        }
        bytes.assign(static_cast<size_t>(count) * dtype_size(dtype) + 1, 0);  // +1: never a NULL data pointer
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
