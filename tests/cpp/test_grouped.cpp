// Grouped rows on the CPU, through the C API: the reference against an independent naive loop (empty experts, one
// expert taking every row, padding rows past the counts' sum, with and without scores, R = 0, i32 / i64 counts),
// keep-h against recompute; bad input for every new argument (a status and a message naming it); the ABI guard.
#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "grouped_test_util.h"
#include "test_util.h"

namespace megamoe::test {
namespace {

struct GroupedGrads {
    HostTensor out, dx, dscores, dw13, dw2;
    explicit GroupedGrads(const GroupedProblem& pr)
        : out(pr.dtype, {pr.num_rows, pr.hidden}),
          dx(pr.dtype, {pr.num_rows, pr.hidden}),
          dscores(pr.scores_dtype, {pr.num_rows}),
          dw13(pr.dtype, {pr.num_experts, 2 * pr.intermediate, pr.hidden}),
          dw2(pr.dtype, {pr.num_experts, pr.hidden, pr.intermediate}) {}
};

// Forward and backward on the CPU into NaN-poisoned outputs; saved_h (optional) is written, then read.
GroupedGrads run_cpu(const GroupedProblem& problem, HostTensor* saved_h = nullptr) {
    GroupedGrads grads(problem);
    for (HostTensor* t : {&grads.out, &grads.dx, &grads.dscores, &grads.dw13, &grads.dw2}) t->fill(NAN);
    megamoe_grouped_forward_params_t forward = problem.forward_params(grads.out);
    if (saved_h != nullptr) forward.saved_h = saved_h->view;
    EXPECT_EQ(megamoe_grouped_forward(&forward), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
    megamoe_grouped_backward_params_t backward =
        problem.backward_params(grads.dx, problem.with_scores ? &grads.dscores : nullptr, grads.dw13, grads.dw2);
    if (saved_h != nullptr) backward.saved_h = saved_h->view;
    EXPECT_EQ(megamoe_grouped_backward(&backward), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
    return grads;
}

struct CountsCase {
    const char* name;
    int64_t num_rows, hidden, intermediate;
    std::vector<int64_t> counts;
    bool with_scores = true;
    megamoe_dtype_t counts_dtype = MEGAMOE_DTYPE_I32;
};

TEST(Grouped, ReferenceMatchesNaiveLoop) {
    const CountsCase cases[] = {
        {"ragged, empty experts, padding", 19, 12, 7, {4, 0, 6, 0, 5}},
        {"one expert takes every row", 11, 10, 5, {0, 11, 0}},
        {"no scores, i64 counts, padding", 9, 8, 6, {3, 2, 0, 1}, false, MEGAMOE_DTYPE_I64},
        {"E = 1, no padding", 6, 9, 4, {6}},
        {"only padding rows", 4, 6, 3, {0, 0}},
        {"R = 0", 0, 6, 3, {0, 0, 0}},
    };
    std::mt19937_64 rng(fresh_seed());
    for (const CountsCase& c : cases) {
        SCOPED_TRACE(std::string(c.name) + ", seed " + std::to_string(fresh_seed()));
        GroupedProblem problem{c.num_rows, c.hidden, c.intermediate, c.counts};
        problem.with_scores = c.with_scores;
        problem.counts_dtype = c.counts_dtype;
        problem.make(rng);
        const GroupedGrads got = run_cpu(problem);
        const GroupedResult want = naive_grouped(problem);
        EXPECT_LT(relative_error(got.out, want.out), 1e-12) << "out";
        EXPECT_LT(relative_error(got.dx, want.dx), 1e-12) << "dx_sorted";
        if (c.with_scores) EXPECT_LT(relative_error(got.dscores, want.dscores, &want.ds_scale), 1e-12) << "dscores";
        EXPECT_LT(relative_error(got.dw13, want.dw13), 1e-12) << "dw13";
        EXPECT_LT(relative_error(got.dw2, want.dw2), 1e-12) << "dw2";
        const int64_t num_valid = problem.num_valid_rows();
        EXPECT_TRUE(rows_are_zero(got.out, num_valid, c.hidden)) << "padding rows of out are not exactly 0";
        EXPECT_TRUE(rows_are_zero(got.dx, num_valid, c.hidden)) << "padding rows of dx_sorted are not exactly 0";
        if (c.with_scores) EXPECT_TRUE(rows_are_zero(got.dscores, num_valid, 1)) << "padding rows of dscores";
    }
}

TEST(Grouped, SavedHGivesTheRecomputedGradients) {
    std::mt19937_64 rng(fresh_seed());
    GroupedProblem problem{14, 10, 6, {5, 0, 7}};
    problem.make(rng);
    HostTensor saved_h(problem.dtype, {problem.num_rows, 2 * problem.intermediate});
    const GroupedGrads recomputed = run_cpu(problem), kept = run_cpu(problem, &saved_h);
    EXPECT_LT(relative_error(kept.dx, recomputed.dx), 1e-12);
    EXPECT_LT(relative_error(kept.dscores, recomputed.dscores), 1e-12);
    EXPECT_LT(relative_error(kept.dw13, recomputed.dw13), 1e-12);
    EXPECT_LT(relative_error(kept.dw2, recomputed.dw2), 1e-12);
    GroupedGrads wrong(problem);  // the backward really reads saved_h: a zeroed one gives other gradients
    saved_h.fill(0.0);
    megamoe_grouped_backward_params_t params = problem.backward_params(wrong.dx, &wrong.dscores, wrong.dw13, wrong.dw2);
    params.saved_h = saved_h.view;
    ASSERT_EQ(megamoe_grouped_backward(&params), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
    EXPECT_GT(relative_error(wrong.dx, recomputed.dx), 0.5);
}

// The whole layer with topk = 1 on the same rows, routed by ids that sort them into the same order, and with the
// scores as topk_weights, is the same computation.
TEST(Grouped, EqualsWholeLayerWithOneSlotPerToken) {
    std::mt19937_64 rng(fresh_seed());
    GroupedProblem grouped{12, 10, 6, {4, 0, 5, 1}};  // 2 padding rows: dropped slots (-1) in the whole layer
    grouped.make(rng);
    Problem whole{grouped.num_rows, grouped.hidden, grouped.intermediate, grouped.num_experts, 1};
    whole.make(rng);
    whole.x = grouped.x_sorted;
    whole.w13 = grouped.w13;
    whole.w2 = grouped.w2;
    whole.dy = grouped.dout;
    whole.weights = HostTensor(MEGAMOE_DTYPE_F64, {grouped.num_rows, 1});
    for (int64_t row_idx = 0; row_idx < grouped.num_rows; ++row_idx) {
        whole.ids.set(row_idx, static_cast<double>(grouped.expert_of_row(row_idx)));
        whole.weights.set(row_idx, grouped.scores.get(row_idx));
    }
    const GroupedGrads got = run_cpu(grouped);
    HostTensor y(whole.dtype, {whole.num_tokens, whole.hidden}), dx(y), dw(whole.weights), dw13(got.dw13), dw2(got.dw2);
    megamoe_forward_params_t forward = whole.forward_params(y);
    ASSERT_EQ(megamoe_forward(&forward), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
    megamoe_backward_params_t backward = whole.backward_params(dx, dw, dw13, dw2);
    ASSERT_EQ(megamoe_backward(&backward), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
    EXPECT_EQ(relative_error(got.out, y), 0.0);
    EXPECT_EQ(relative_error(got.dx, dx), 0.0);
    EXPECT_EQ(relative_error(got.dscores, dw), 0.0);
    EXPECT_EQ(relative_error(got.dw13, dw13), 0.0);
    EXPECT_EQ(relative_error(got.dw2, dw2), 0.0);
}

GroupedProblem small_grouped_problem() {
    std::mt19937_64 rng(fresh_seed());
    GroupedProblem problem{7, 10, 4, {3, 0, 2}};  // 2 padding rows
    problem.dtype = MEGAMOE_DTYPE_F32;
    problem.scores_dtype = MEGAMOE_DTYPE_F32;
    problem.make(rng);
    return problem;
}

struct GroupedBadCase {
    const char* what;
    std::function<void(GroupedProblem&, megamoe_grouped_forward_params_t&, HostTensor& scratch)> mutate;
    megamoe_status_t status;
    const char* message_part;
    bool value_check = false;  // found only when values are read (not by the workspace-size query)
};

TEST(GroupedApi, BadForwardInputsNameTheArgument) {
    using P = megamoe_grouped_forward_params_t;
    const GroupedBadCase cases[] = {
        {"x_sorted wrong rank", [](GroupedProblem&, P& p, HostTensor&) { p.x_sorted.ndim = 3; },
         MEGAMOE_STATUS_INVALID_ARGUMENT, "x_sorted: expected 2 dimensions [R, H]"},
        {"x_sorted integer dtype", [](GroupedProblem&, P& p, HostTensor&) { p.x_sorted.dtype = MEGAMOE_DTYPE_I64; },
         MEGAMOE_STATUS_INVALID_ARGUMENT, "x_sorted: dtype i64 not allowed"},
        {"x_sorted H = 0", [](GroupedProblem&, P& p, HostTensor&) { p.x_sorted.shape[1] = 0; },
         MEGAMOE_STATUS_INVALID_ARGUMENT, "x_sorted: hidden size H must be > 0"},
        {"w13 H mismatch", [](GroupedProblem&, P& p, HostTensor&) { p.w13.shape[2] = 9; },
         MEGAMOE_STATUS_INVALID_ARGUMENT, "w13:"},
        {"counts float", [](GroupedProblem&, P& p, HostTensor&) { p.tokens_per_expert.dtype = MEGAMOE_DTYPE_F32; },
         MEGAMOE_STATUS_INVALID_ARGUMENT, "tokens_per_expert: dtype f32 not allowed"},
        {"counts E mismatch", [](GroupedProblem&, P& p, HostTensor&) { p.tokens_per_expert.shape[0] = 2; },
         MEGAMOE_STATUS_INVALID_ARGUMENT, "tokens_per_expert: expected shape [E] (E from w13) = [3], got [2]"},
        {"counts rank 2",
         [](GroupedProblem&, P& p, HostTensor&) {
             p.tokens_per_expert.ndim = 2;
             p.tokens_per_expert.shape[1] = 1;
         },
         MEGAMOE_STATUS_INVALID_ARGUMENT, "tokens_per_expert: expected 1 dimensions"},
        {"counts absent", [](GroupedProblem&, P& p, HostTensor&) { p.tokens_per_expert = megamoe_tensor_t{}; },
         MEGAMOE_STATUS_INVALID_ARGUMENT, "tokens_per_expert: expected 1 dimensions"},
        {"counts on another device",
         [](GroupedProblem&, P& p, HostTensor&) { p.tokens_per_expert.device_type = MEGAMOE_DEVICE_CUDA; },
         MEGAMOE_STATUS_INVALID_ARGUMENT, "tokens_per_expert: on cuda:0 but x_sorted is on cpu"},
        {"negative count", [](GroupedProblem& pr, P&, HostTensor&) { pr.tokens_per_expert.set(1, -1); },
         MEGAMOE_STATUS_INVALID_ARGUMENT, "tokens_per_expert: value -1 at [1] is negative", true},
        {"counts sum past R", [](GroupedProblem& pr, P&, HostTensor&) { pr.tokens_per_expert.set(2, 5); },
         MEGAMOE_STATUS_INVALID_ARGUMENT,
         "tokens_per_expert: the counts sum past the R=7 rows of x_sorted (at expert 2)", true},
        {"one huge count", [](GroupedProblem& pr, P&, HostTensor&) { pr.tokens_per_expert.set(0, 2147483647.0); },
         MEGAMOE_STATUS_INVALID_ARGUMENT, "tokens_per_expert: the counts sum past the R=7 rows", true},
        {"scores shape", [](GroupedProblem&, P& p, HostTensor&) { p.scores.shape[0] = 6; },
         MEGAMOE_STATUS_INVALID_ARGUMENT, "scores: expected shape [R] (R from x_sorted) = [7], got [6]"},
        {"scores dtype", [](GroupedProblem&, P& p, HostTensor&) { p.scores.dtype = MEGAMOE_DTYPE_I32; },
         MEGAMOE_STATUS_INVALID_ARGUMENT, "scores: dtype i32 not allowed (f32 or the dtype of x_sorted)"},
        {"scores rank", [](GroupedProblem&, P& p, HostTensor&) { p.scores.ndim = 2; }, MEGAMOE_STATUS_INVALID_ARGUMENT,
         "scores: expected 1 dimensions"},
        {"out wrong shape", [](GroupedProblem&, P& p, HostTensor&) { p.out.shape[0] = 5; },
         MEGAMOE_STATUS_INVALID_ARGUMENT, "out: expected shape"},
        {"out wrong dtype", [](GroupedProblem&, P& p, HostTensor&) { p.out.dtype = MEGAMOE_DTYPE_BF16; },
         MEGAMOE_STATUS_INVALID_ARGUMENT, "out: dtype bf16 not allowed"},
        {"out aliases x_sorted", [](GroupedProblem&, P& p, HostTensor&) { p.out.data = p.x_sorted.data; },
         MEGAMOE_STATUS_INVALID_ARGUMENT, "out: overlaps the memory of x_sorted"},
        {"out aliases scores", [](GroupedProblem&, P& p, HostTensor&) { p.out.data = p.scores.data; },
         MEGAMOE_STATUS_INVALID_ARGUMENT, "out: overlaps the memory of scores"},
        {"saved_h wrong shape",
         [](GroupedProblem& pr, P& p, HostTensor& scratch) {
             scratch = HostTensor(pr.dtype, {pr.num_rows, pr.intermediate});
             p.saved_h = scratch.view;
         },
         MEGAMOE_STATUS_INVALID_ARGUMENT, "saved_h: expected shape [R, 2I]"},
        {"saved_h aliases out",
         [](GroupedProblem& pr, P& p, HostTensor& scratch) {
             scratch = HostTensor(pr.dtype, {pr.num_rows, 2 * pr.intermediate});
             p.saved_h = scratch.view;
             p.saved_h.data = p.out.data;
         },
         MEGAMOE_STATUS_INVALID_ARGUMENT, "saved_h: overlaps the memory of out"},
        {"f32 on CUDA",
         [](GroupedProblem&, P& p, HostTensor&) {
             for (megamoe_tensor_t* t : {&p.x_sorted, &p.tokens_per_expert, &p.scores, &p.w13, &p.w2, &p.out})
                 t->device_type = MEGAMOE_DEVICE_CUDA;
         },
         MEGAMOE_STATUS_NOT_SUPPORTED, "x_sorted: dtype f32 is not supported on CUDA"},
    };
    for (const GroupedBadCase& bad : cases) {
        GroupedProblem problem = small_grouped_problem();
        HostTensor out(problem.dtype, {problem.num_rows, problem.hidden}), scratch;
        megamoe_grouped_forward_params_t params = problem.forward_params(out);
        bad.mutate(problem, params, scratch);
        EXPECT_EQ(megamoe_grouped_forward(&params), bad.status) << bad.what << ": " << megamoe_last_error();
        EXPECT_NE(std::string(megamoe_last_error()).find(bad.message_part), std::string::npos)
            << bad.what << ": message was \"" << megamoe_last_error() << "\"";
        size_t bytes = 0;
        if (!bad.value_check) {
            EXPECT_NE(megamoe_grouped_forward_workspace_size(&params, &bytes), MEGAMOE_STATUS_SUCCESS) << bad.what;
        }
    }
}

TEST(GroupedApi, BadBackwardInputsNameTheArgument) {
    GroupedProblem problem = small_grouped_problem();
    const int64_t R = problem.num_rows, H = problem.hidden, I = problem.intermediate, E = problem.num_experts;
    HostTensor dx(problem.dtype, {R, H}), dscores(MEGAMOE_DTYPE_F32, {R}), dw13(problem.dtype, {E, 2 * I, H}),
        dw2(problem.dtype, {E, H, I}), saved_h(problem.dtype, {R, 2 * I}), bad_h(problem.dtype, {R, I});
    auto expect_bad = [&](std::function<void(megamoe_grouped_backward_params_t&)> mutate, const char* part) {
        megamoe_grouped_backward_params_t params = problem.backward_params(dx, &dscores, dw13, dw2);
        mutate(params);
        EXPECT_EQ(megamoe_grouped_backward(&params), MEGAMOE_STATUS_INVALID_ARGUMENT) << part;
        EXPECT_NE(std::string(megamoe_last_error()).find(part), std::string::npos)
            << "message was \"" << megamoe_last_error() << "\"";
    };
    using P = megamoe_grouped_backward_params_t;
    expect_bad([](P& p) { p.dout.shape[0] = 6; }, "dout: expected shape [R, H] (as x_sorted)");
    expect_bad([](P& p) { p.dout.dtype = MEGAMOE_DTYPE_F64; }, "dout: dtype f64 not allowed");
    expect_bad([](P& p) { p.tokens_per_expert.shape[0] = 4; }, "tokens_per_expert: expected shape");
    expect_bad([](P& p) { p.scores.dtype = MEGAMOE_DTYPE_F16; }, "scores: dtype f16 not allowed");
    expect_bad([](P& p) { p.dx_sorted.shape[0] = 6; }, "dx_sorted: expected shape");
    expect_bad([](P& p) { p.dx_sorted.data = p.dout.data; }, "dx_sorted: overlaps the memory of dout");
    expect_bad([](P& p) { p.dscores.shape[0] = 8; }, "dscores: expected shape [R]");
    expect_bad([](P& p) { p.dscores.dtype = MEGAMOE_DTYPE_BF16; }, "dscores: dtype bf16 not allowed");
    expect_bad([](P& p) { p.scores = megamoe_tensor_t{}; }, "dscores: given, but scores is absent");
    expect_bad([](P& p) { p.dscores.data = p.dx_sorted.data; }, "dscores: overlaps the memory of dx_sorted");
    expect_bad([](P& p) { p.dw13.shape[0] = 2; }, "dw13: expected shape");
    expect_bad([](P& p) { p.dw2.dtype = MEGAMOE_DTYPE_I32; }, "dw2: dtype i32 not allowed");
    expect_bad([&](P& p) { p.saved_h = bad_h.view; }, "saved_h: expected shape [R, 2I]");
    expect_bad(
        [&](P& p) {
            p.saved_h = saved_h.view;
            p.dw2.data = saved_h.view.data;
        },
        "dw2: overlaps the memory of saved_h");
    problem.tokens_per_expert.set(0, 9);
    expect_bad([](P&) {}, "tokens_per_expert: the counts sum past the R=7 rows");
    problem.tokens_per_expert.set(0, 3);

    // Optional outputs may be absent, and so may scores (then dscores must be).
    megamoe_grouped_backward_params_t params = problem.backward_params(dx, nullptr, dw13, dw2);
    params.scores = megamoe_tensor_t{};
    params.dw13 = megamoe_tensor_t{};
    EXPECT_EQ(megamoe_grouped_backward(&params), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
    EXPECT_STREQ(megamoe_last_error(), "");
    EXPECT_EQ(megamoe_grouped_backward(nullptr), MEGAMOE_STATUS_INVALID_ARGUMENT);
    EXPECT_NE(std::string(megamoe_last_error()).find("params"), std::string::npos);
    EXPECT_EQ(megamoe_grouped_backward_workspace_size(&params, nullptr), MEGAMOE_STATUS_INVALID_ARGUMENT);
    EXPECT_NE(std::string(megamoe_last_error()).find("bytes"), std::string::npos);
    size_t bytes = 123;
    ASSERT_EQ(megamoe_grouped_backward_workspace_size(&params, &bytes), MEGAMOE_STATUS_SUCCESS);
    EXPECT_EQ(bytes, 0u);  // the CPU reference needs no caller workspace
}

TEST(Api, AbiVersionAndStructSizes) {
    EXPECT_EQ(megamoe_abi_version(), MEGAMOE_ABI_VERSION);
    EXPECT_EQ(megamoe_struct_size(MEGAMOE_STRUCT_TENSOR), sizeof(megamoe_tensor_t));
    EXPECT_EQ(megamoe_struct_size(MEGAMOE_STRUCT_FORWARD_PARAMS), sizeof(megamoe_forward_params_t));
    EXPECT_EQ(megamoe_struct_size(MEGAMOE_STRUCT_BACKWARD_PARAMS), sizeof(megamoe_backward_params_t));
    EXPECT_EQ(megamoe_struct_size(MEGAMOE_STRUCT_GROUPED_FORWARD_PARAMS), sizeof(megamoe_grouped_forward_params_t));
    EXPECT_EQ(megamoe_struct_size(MEGAMOE_STRUCT_GROUPED_BACKWARD_PARAMS), sizeof(megamoe_grouped_backward_params_t));
    EXPECT_EQ(megamoe_struct_size(static_cast<megamoe_struct_kind_t>(99)), 0u);
}

}  // namespace
}  // namespace megamoe::test
