// The CPU reference through the C API: backward against central finite differences of forward (f64),
// dropped slots and empty experts give exact zeros, f32 / bf16 paths track the f64 one, determinism (also across
// the threads of parallel_for: a call split over them gives each token's single-threaded result bitwise).
#include <gtest/gtest.h>

#include <atomic>
#include <stdexcept>
#include <thread>

#include "reference/parallel_for.h"
#include "test_util.h"

namespace megamoe::test {
namespace {

// Scalar loss L = <dy, y(inputs)>, whose gradients are exactly what megamoe_backward returns.
double loss(const Problem& problem) {
    HostTensor y(problem.dtype, {problem.num_tokens, problem.hidden});
    megamoe_forward_params_t p = problem.forward_params(y);
    EXPECT_EQ(megamoe_forward(&p), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
    double sum = 0.0;
    for (int64_t idx = 0; idx < y.size(); ++idx) sum += y.get(idx) * problem.dy.get(idx);
    return sum;
}

struct Grads {
    HostTensor dx, dw, dw13, dw2;
    explicit Grads(const Problem& pr)
        : dx(pr.dtype, {pr.num_tokens, pr.hidden}),
          dw(pr.weights.view.dtype, {pr.num_tokens, pr.topk}),
          dw13(pr.dtype, {pr.num_experts, 2 * pr.intermediate, pr.hidden}),
          dw2(pr.dtype, {pr.num_experts, pr.hidden, pr.intermediate}) {}
};

Grads backward(Problem& problem, megamoe_accum_t accum = MEGAMOE_ACCUM_DEFAULT) {
    Grads grads(problem);
    for (HostTensor* out : {&grads.dx, &grads.dw, &grads.dw13, &grads.dw2}) out->fill(NAN);  // poison
    megamoe_backward_params_t p = problem.backward_params(grads.dx, grads.dw, grads.dw13, grads.dw2);
    p.accum = accum;
    EXPECT_EQ(megamoe_backward(&p), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
    return grads;
}

// Every element of `grad` against (L(v + eps) - L(v - eps)) / 2eps for the input `input`.
void expect_matches_finite_differences(Problem& problem, HostTensor& input, const HostTensor& grad, const char* name) {
    constexpr double kEps = 1e-6;
    for (int64_t idx = 0; idx < input.size(); ++idx) {
        const double saved = input.get(idx);
        input.set(idx, saved + kEps);
        const double plus = loss(problem);
        input.set(idx, saved - kEps);
        const double minus = loss(problem);
        input.set(idx, saved);
        const double numeric = (plus - minus) / (2 * kEps);
        EXPECT_NEAR(grad.get(idx), numeric, 1e-7 + 1e-6 * std::fabs(numeric)) << name << "[" << idx << "]";
    }
}

TEST(Reference, BackwardMatchesFiniteDifferences) {
    std::mt19937_64 rng(fresh_seed());
    for (Routing routing : {Routing::kRandom, Routing::kSomeDropped, Routing::kHalfEmpty}) {
        Problem problem{5, 7, 3, 4, 2};
        problem.routing = routing;
        problem.make(rng);
        Grads grads = backward(problem);
        expect_matches_finite_differences(problem, problem.x, grads.dx, "dx");
        expect_matches_finite_differences(problem, problem.weights, grads.dw, "dtopk_weights");
        expect_matches_finite_differences(problem, problem.w13, grads.dw13, "dw13");
        expect_matches_finite_differences(problem, problem.w2, grads.dw2, "dw2");
    }
}

// Keep-h mode on the CPU: the forward's saved_h (f64, so exact) read by the backward gives the recomputed gradients.
TEST(Reference, SavedHGivesTheRecomputedGradients) {
    std::mt19937_64 rng(fresh_seed());
    Problem problem{7, 12, 5, 4, 3};
    problem.routing = Routing::kSomeDropped;
    problem.make(rng);
    HostTensor y(problem.dtype, {problem.num_tokens, problem.hidden}),
        saved_h(problem.dtype, {problem.num_tokens * problem.topk, 2 * problem.intermediate});
    megamoe_forward_params_t forward = problem.forward_params(y);
    forward.saved_h = saved_h.view;
    ASSERT_EQ(megamoe_forward(&forward), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
    const Grads recomputed = backward(problem);
    Grads kept(problem);
    megamoe_backward_params_t params = problem.backward_params(kept.dx, kept.dw, kept.dw13, kept.dw2);
    params.saved_h = saved_h.view;
    ASSERT_EQ(megamoe_backward(&params), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
    EXPECT_LT(relative_error(kept.dx, recomputed.dx), 1e-12);
    EXPECT_LT(relative_error(kept.dw, recomputed.dw), 1e-12);
    EXPECT_LT(relative_error(kept.dw13, recomputed.dw13), 1e-12);
    EXPECT_LT(relative_error(kept.dw2, recomputed.dw2), 1e-12);
    saved_h.fill(0.0);  // h is what the backward reads: a wrong one gives other gradients
    ASSERT_EQ(megamoe_backward(&params), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
    EXPECT_GT(relative_error(kept.dx, recomputed.dx), 0.5);
}

// saved_h's layout (megamoe.h): row r holds [g, u] of the r-th routed slot in the stable expert order (ties in slot
// order); the rows of dropped slots, at the end, are untouched (poisoned here, so a write there shows).
TEST(Reference, SavedHRowsAreSortedStablyByExpert) {
    std::mt19937_64 rng(fresh_seed());
    Problem problem{9, 6, 4, 5, 3};
    problem.routing = Routing::kSomeDropped;
    problem.make(rng);
    const int64_t H = problem.hidden, I = problem.intermediate, num_slots = problem.num_tokens * problem.topk;
    HostTensor y(problem.dtype, {problem.num_tokens, H}), saved_h(problem.dtype, {num_slots, 2 * I});
    saved_h.fill(std::nan(""));
    megamoe_forward_params_t forward = problem.forward_params(y);
    forward.saved_h = saved_h.view;
    ASSERT_EQ(megamoe_forward(&forward), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
    int64_t row_idx = 0;
    for (int64_t expert_idx = 0; expert_idx < problem.num_experts; ++expert_idx) {
        for (int64_t slot_idx = 0; slot_idx < num_slots; ++slot_idx) {
            if (static_cast<int64_t>(problem.ids.get(slot_idx)) != expert_idx) continue;
            const int64_t token_idx = slot_idx / problem.topk;
            for (int64_t col = 0; col < 2 * I; ++col) {
                double want = 0.0;
                for (int64_t h = 0; h < H; ++h) {
                    want += problem.w13.get((expert_idx * 2 * I + col) * H + h) * problem.x.get(token_idx * H + h);
                }
                EXPECT_NEAR(saved_h.get(row_idx * 2 * I + col), want, 1e-12) << "row " << row_idx << " col " << col;
            }
            ++row_idx;
        }
    }
    ASSERT_LT(row_idx, num_slots) << "the routing should drop some slots";
    for (int64_t idx = row_idx * 2 * I; idx < num_slots * 2 * I; ++idx) {
        EXPECT_TRUE(std::isnan(saved_h.get(idx))) << "row of a dropped slot written, element " << idx;
    }
}

TEST(Reference, DroppedSlotsAndEmptyExpertsGiveExactZeros) {
    std::mt19937_64 rng(fresh_seed());
    Problem problem{9, 6, 5, 6, 3};
    problem.routing = Routing::kHalfEmpty;
    problem.make(rng);
    problem.ids.set(0, -1);                                                                // token 0 keeps two slots
    for (int64_t j = 0; j < problem.topk; ++j) problem.ids.set(1 * problem.topk + j, -1);  // token 1: all dropped
    HostTensor y(problem.dtype, {problem.num_tokens, problem.hidden});
    y.fill(NAN);
    megamoe_forward_params_t p = problem.forward_params(y);
    ASSERT_EQ(megamoe_forward(&p), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
    for (int64_t h = 0; h < problem.hidden; ++h) EXPECT_EQ(y.get(1 * problem.hidden + h), 0.0);
    Grads grads = backward(problem);
    EXPECT_EQ(grads.dw.get(0), 0.0);
    for (int64_t h = 0; h < problem.hidden; ++h) EXPECT_EQ(grads.dx.get(1 * problem.hidden + h), 0.0);
    const int64_t per_expert13 = 2 * problem.intermediate * problem.hidden,
                  per_expert2 = problem.hidden * problem.intermediate;
    for (int64_t e = 1; e < problem.num_experts; e += 2) {  // odd experts never chosen
        for (int64_t idx = 0; idx < per_expert13; ++idx) ASSERT_EQ(grads.dw13.get(e * per_expert13 + idx), 0.0);
        for (int64_t idx = 0; idx < per_expert2; ++idx) ASSERT_EQ(grads.dw2.get(e * per_expert2 + idx), 0.0);
    }
    for (int64_t idx = 0; idx < per_expert13; ++idx) EXPECT_TRUE(std::isfinite(grads.dw13.get(idx)));
}

// Lower-precision inputs and f32 accumulation stay close to the f64 result on the same values.
TEST(Reference, LowPrecisionTracksDouble) {
    std::mt19937_64 rng(fresh_seed());
    for (megamoe_dtype_t dtype : {MEGAMOE_DTYPE_F32, MEGAMOE_DTYPE_BF16, MEGAMOE_DTYPE_F16}) {
        Problem low{13, 70, 33, 5, 2};
        low.dtype = dtype;
        low.id_dtype = MEGAMOE_DTYPE_I64;
        low.make(rng);
        Problem high = low;  // same routing; values widened from the rounded low-precision inputs
        high.dtype = MEGAMOE_DTYPE_F64;
        high.x = HostTensor(MEGAMOE_DTYPE_F64, {13, 70});
        high.w13 = HostTensor(MEGAMOE_DTYPE_F64, {5, 66, 70});
        high.w2 = HostTensor(MEGAMOE_DTYPE_F64, {5, 70, 33});
        high.dy = HostTensor(MEGAMOE_DTYPE_F64, {13, 70});
        const std::pair<const HostTensor*, HostTensor*> pairs[] = {
            {&low.x, &high.x}, {&low.w13, &high.w13}, {&low.w2, &high.w2}, {&low.dy, &high.dy}};
        for (auto [from, to] : pairs) {
            for (int64_t idx = 0; idx < from->size(); ++idx) to->set(idx, from->get(idx));
        }
        HostTensor y_low(dtype, {13, 70}), y_high(MEGAMOE_DTYPE_F64, {13, 70});
        megamoe_forward_params_t p_low = low.forward_params(y_low), p_high = high.forward_params(y_high);
        p_low.accum = MEGAMOE_ACCUM_F32;
        ASSERT_EQ(megamoe_forward(&p_low), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
        ASSERT_EQ(megamoe_forward(&p_high), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
        const double bound = dtype == MEGAMOE_DTYPE_F32 ? 1e-6 : dtype == MEGAMOE_DTYPE_BF16 ? 1e-2 : 2e-3;
        EXPECT_LT(relative_error(y_low, y_high), bound) << dtype_name(dtype);
        Grads g_low = backward(low, MEGAMOE_ACCUM_F32), g_high = backward(high);
        EXPECT_LT(relative_error(g_low.dx, g_high.dx), bound) << dtype_name(dtype);
        EXPECT_LT(relative_error(g_low.dw, g_high.dw), bound) << dtype_name(dtype);
        EXPECT_LT(relative_error(g_low.dw13, g_high.dw13), bound) << dtype_name(dtype);
        EXPECT_LT(relative_error(g_low.dw2, g_high.dw2), bound) << dtype_name(dtype);
    }
}

TEST(Reference, RunsAreBitwiseEqual) {
    std::mt19937_64 rng(fresh_seed());
    Problem problem{31, 40, 24, 7, 3};
    problem.dtype = MEGAMOE_DTYPE_BF16;
    problem.routing = Routing::kOneExpert;
    problem.make(rng);
    Grads first = backward(problem), second = backward(problem);
    EXPECT_EQ(first.dx.bytes, second.dx.bytes);
    EXPECT_EQ(first.dw.bytes, second.dw.bytes);
    EXPECT_EQ(first.dw13.bytes, second.dw13.bytes);
    EXPECT_EQ(first.dw2.bytes, second.dw2.bytes);
}

// A forward large enough to be split over threads gives, for every token, the bits of that token's forward alone
// (a call far below the threshold: one thread).
TEST(Reference, ThreadedCallGivesEachTokensSingleThreadedBits) {
    std::mt19937_64 rng(fresh_seed());
    Problem whole{48, 64, 32, 6, 2};
    whole.dtype = MEGAMOE_DTYPE_F32;
    whole.make(rng);
    ASSERT_GE(whole.num_tokens * whole.topk * 3 * whole.hidden * whole.intermediate, reference::kParallelMinWork);
    HostTensor y(whole.dtype, {whole.num_tokens, whole.hidden});
    megamoe_forward_params_t p = whole.forward_params(y);
    ASSERT_EQ(megamoe_forward(&p), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
    for (int64_t t = 0; t < whole.num_tokens; ++t) {
        Problem one = whole;
        one.num_tokens = 1;
        one.x = HostTensor(whole.dtype, {1, whole.hidden});
        one.ids = HostTensor(whole.id_dtype, {1, whole.topk});
        one.weights = HostTensor(whole.weights.view.dtype, {1, whole.topk});
        for (int64_t h = 0; h < whole.hidden; ++h) one.x.set(h, whole.x.get(t * whole.hidden + h));
        for (int64_t j = 0; j < whole.topk; ++j) {
            one.ids.set(j, whole.ids.get(t * whole.topk + j));
            one.weights.set(j, whole.weights.get(t * whole.topk + j));
        }
        HostTensor y_one(whole.dtype, {1, whole.hidden});
        megamoe_forward_params_t p_one = one.forward_params(y_one);
        ASSERT_EQ(megamoe_forward(&p_one), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
        for (int64_t h = 0; h < whole.hidden; ++h) ASSERT_EQ(y_one.get(h), y.get(t * whole.hidden + h)) << t;
    }
}

// parallel_for runs every index exactly once, on the calling thread alone below the threshold, and a body's
// exception reaches the caller whether the loop was split or not.
TEST(ParallelFor, EveryIndexOnceAndExceptionsReachTheCaller) {
    constexpr int64_t kCount = 1000;
    for (const int64_t work : {int64_t{0}, reference::kParallelMinWork * 16}) {
        std::vector<std::atomic<int>> seen(kCount);
        std::atomic<bool> other_thread{false};
        const std::thread::id caller = std::this_thread::get_id();
        reference::parallel_for(kCount, work, [&](int64_t index) {
            seen[index].fetch_add(1);
            if (std::this_thread::get_id() != caller) other_thread = true;
        });
        for (const std::atomic<int>& count : seen) ASSERT_EQ(count.load(), 1);
        if (work < reference::kParallelMinWork) EXPECT_FALSE(other_thread.load());
        EXPECT_THROW(reference::parallel_for(kCount, work,
                                             [](int64_t index) {
                                                 if (index == kCount / 2) throw std::runtime_error("index 500");
                                             }),
                     std::runtime_error);
    }
}

TEST(Reference, EmptyBatchGivesZeroWeightGradients) {
    std::mt19937_64 rng(fresh_seed());
    Problem problem{0, 8, 4, 3, 2};
    problem.make(rng);
    HostTensor y(problem.dtype, {0, 8});
    megamoe_forward_params_t p = problem.forward_params(y);
    ASSERT_EQ(megamoe_forward(&p), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
    Grads grads = backward(problem);
    for (int64_t idx = 0; idx < grads.dw13.size(); ++idx) ASSERT_EQ(grads.dw13.get(idx), 0.0);
    for (int64_t idx = 0; idx < grads.dw2.size(); ++idx) ASSERT_EQ(grads.dw2.get(idx), 0.0);
}

TEST(Reference, NanInputPropagatesAsNan) {
    std::mt19937_64 rng(fresh_seed());
    Problem problem{4, 6, 5, 3, 2};
    problem.make(rng);
    problem.x.set(2 * problem.hidden + 1, NAN);  // token 2
    HostTensor y(problem.dtype, {4, 6});
    megamoe_forward_params_t p = problem.forward_params(y);
    ASSERT_EQ(megamoe_forward(&p), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
    EXPECT_TRUE(std::isnan(y.get(2 * problem.hidden)));
    EXPECT_TRUE(std::isfinite(y.get(0)));
}

}  // namespace
}  // namespace megamoe::test
