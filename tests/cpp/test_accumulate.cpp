// Weight gradients accumulated into caller-provided f32 buffers (accumulate_weight_grads), on the CPU reference:
//   - accumulated == the previous buffer + the fresh f32 gradient, bitwise (the reference rounds its gradient to f32,
//     then adds in f32), for f64, f32 and bf16 inputs, the whole layer and grouped rows, with experts that get no rows
//     (their part of the buffer untouched, bitwise); dw3 / db13 / db2 of the other layouts: tests/python/
//     test_accumulate.py;
//   - an empty batch (T = 0, R = 0) leaves every buffer untouched;
//   - bad input: a non-f32 gradient with accumulation, or a flag other than 0 / 1, is INVALID_ARGUMENT naming it.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "grouped_test_util.h"
#include "test_util.h"

namespace megamoe::test {
namespace {

// Random f32 values (the buffer's previous contents: never zeros).
HostTensor random_f32(const std::vector<int64_t>& dims, std::mt19937_64& rng) {
    HostTensor tensor(MEGAMOE_DTYPE_F32, dims);
    tensor.fill_random(rng, 1.0);
    return tensor;
}

// previous + fresh, elementwise in f32: what accumulation must give bitwise.
HostTensor f32_sum(const HostTensor& previous, const HostTensor& fresh) {
    HostTensor sum = previous;
    for (int64_t idx = 0; idx < sum.size(); ++idx) {
        const float value = static_cast<float>(previous.get(idx)) + static_cast<float>(fresh.get(idx));
        sum.set(idx, value);
    }
    return sum;
}

// Experts that receive no slot in `problem` (their gradient rows must stay as they were).
std::vector<bool> experts_without_rows(const Problem& problem) {
    std::vector<bool> empty(static_cast<size_t>(problem.num_experts), true);
    for (int64_t slot_idx = 0; slot_idx < problem.num_tokens * problem.topk; ++slot_idx) {
        const auto expert_idx = static_cast<int64_t>(problem.ids.get(slot_idx));
        if (expert_idx >= 0) empty[static_cast<size_t>(expert_idx)] = false;
    }
    return empty;
}

struct AccumulateCase {
    const char* name;
    int64_t num_tokens, hidden, intermediate, num_experts, topk;
    Routing routing;
    megamoe_dtype_t dtype;
};

class AccumulateReference : public ::testing::TestWithParam<AccumulateCase> {};

TEST_P(AccumulateReference, AddsTheFreshGradientIntoTheBuffer) {
    const AccumulateCase& c = GetParam();
    std::mt19937_64 rng(fresh_seed() ^ std::hash<std::string>{}(c.name));
    SCOPED_TRACE(std::string(c.name) + ", seed " + std::to_string(fresh_seed()));
    Problem problem{c.num_tokens, c.hidden, c.intermediate, c.num_experts, c.topk};
    problem.dtype = c.dtype;
    problem.routing = c.routing;
    problem.make(rng);
    const int64_t T = c.num_tokens, H = c.hidden, I = c.intermediate, E = c.num_experts;
    HostTensor dx(c.dtype, {T, H}), dtopk(problem.weights.view.dtype, {T, c.topk});
    HostTensor fresh13(MEGAMOE_DTYPE_F32, {E, 2 * I, H}), fresh2(MEGAMOE_DTYPE_F32, {E, H, I});
    megamoe_backward_params_t fresh = problem.backward_params(dx, dtopk, fresh13, fresh2);
    ASSERT_EQ(megamoe_backward(&fresh), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();

    const HostTensor before13 = random_f32({E, 2 * I, H}, rng), before2 = random_f32({E, H, I}, rng);
    HostTensor dx_acc(c.dtype, {T, H}), dtopk_acc(problem.weights.view.dtype, {T, c.topk});
    HostTensor acc13 = before13, acc2 = before2;
    megamoe_backward_params_t accumulate = problem.backward_params(dx_acc, dtopk_acc, acc13, acc2);
    accumulate.accumulate_weight_grads = 1;
    ASSERT_EQ(megamoe_backward(&accumulate), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();

    EXPECT_EQ(dx_acc.bytes, dx.bytes) << "dx changed with accumulation";
    EXPECT_EQ(dtopk_acc.bytes, dtopk.bytes) << "dtopk_weights changed with accumulation";
    EXPECT_EQ(acc13.bytes, f32_sum(before13, fresh13).bytes) << "dw13 != previous + fresh gradient (f32)";
    EXPECT_EQ(acc2.bytes, f32_sum(before2, fresh2).bytes) << "dw2 != previous + fresh gradient (f32)";
    const std::vector<bool> empty = experts_without_rows(problem);
    for (int64_t expert_idx = 0; expert_idx < E; ++expert_idx) {
        if (!empty[static_cast<size_t>(expert_idx)]) continue;
        const size_t bytes13 = static_cast<size_t>(2 * I * H) * 4, bytes2 = static_cast<size_t>(H * I) * 4;
        EXPECT_EQ(std::memcmp(acc13.bytes.data() + expert_idx * bytes13, before13.bytes.data() + expert_idx * bytes13,
                              bytes13),
                  0)
            << "dw13 of expert " << expert_idx << " (no rows) was touched";
        EXPECT_EQ(
            std::memcmp(acc2.bytes.data() + expert_idx * bytes2, before2.bytes.data() + expert_idx * bytes2, bytes2), 0)
            << "dw2 of expert " << expert_idx << " (no rows) was touched";
    }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, AccumulateReference,
    ::testing::Values(AccumulateCase{"f64", 9, 16, 12, 4, 2, Routing::kRandom, MEGAMOE_DTYPE_F64},
                      AccumulateCase{"f64 half empty", 11, 24, 10, 8, 2, Routing::kHalfEmpty, MEGAMOE_DTYPE_F64},
                      AccumulateCase{"f64 dropped", 13, 15, 11, 6, 3, Routing::kSomeDropped, MEGAMOE_DTYPE_F64},
                      AccumulateCase{"bf16 one expert", 10, 20, 9, 5, 1, Routing::kOneExpert, MEGAMOE_DTYPE_BF16},
                      AccumulateCase{"f32 half empty", 7, 18, 6, 6, 1, Routing::kHalfEmpty, MEGAMOE_DTYPE_F32}));

TEST(Accumulate, EmptyBatchLeavesTheBuffersUntouched) {
    std::mt19937_64 rng(fresh_seed());
    Problem problem{0, 8, 4, 3, 2};
    problem.make(rng);
    HostTensor dx(MEGAMOE_DTYPE_F64, {0, 8}), dtopk(MEGAMOE_DTYPE_F64, {0, 2});
    const HostTensor before13 = random_f32({3, 8, 8}, rng), before2 = random_f32({3, 8, 4}, rng);
    HostTensor dw13 = before13, dw2 = before2;
    megamoe_backward_params_t params = problem.backward_params(dx, dtopk, dw13, dw2);
    params.accumulate_weight_grads = 1;
    ASSERT_EQ(megamoe_backward(&params), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
    EXPECT_EQ(dw13.bytes, before13.bytes);
    EXPECT_EQ(dw2.bytes, before2.bytes);
}

TEST(Accumulate, GroupedRowsAddTheFreshGradient) {
    std::mt19937_64 rng(fresh_seed() ^ 0x9e37);
    for (const std::vector<int64_t>& counts :
         {std::vector<int64_t>{3, 0, 5, 2}, std::vector<int64_t>{0, 0, 0, 0}, std::vector<int64_t>{10, 0, 0, 0}}) {
        const int64_t E = 4, H = 16, I = 6, R = 12;
        GroupedProblem problem(R, H, I, counts);
        problem.make(rng);
        HostTensor dx(MEGAMOE_DTYPE_F64, {R, H}), dscores(MEGAMOE_DTYPE_F64, {R});
        HostTensor fresh13(MEGAMOE_DTYPE_F32, {E, 2 * I, H}), fresh2(MEGAMOE_DTYPE_F32, {E, H, I});
        megamoe_grouped_backward_params_t fresh = problem.backward_params(dx, &dscores, fresh13, fresh2);
        ASSERT_EQ(megamoe_grouped_backward(&fresh), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
        const HostTensor before13 = random_f32({E, 2 * I, H}, rng), before2 = random_f32({E, H, I}, rng);
        HostTensor acc13 = before13, acc2 = before2;
        megamoe_grouped_backward_params_t accumulate = problem.backward_params(dx, &dscores, acc13, acc2);
        accumulate.accumulate_weight_grads = 1;
        ASSERT_EQ(megamoe_grouped_backward(&accumulate), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
        EXPECT_EQ(acc13.bytes, f32_sum(before13, fresh13).bytes) << "grouped dw13";
        EXPECT_EQ(acc2.bytes, f32_sum(before2, fresh2).bytes) << "grouped dw2";
        if (counts[1] == 0) {
            const size_t bytes13 = static_cast<size_t>(2 * I * H) * 4;
            EXPECT_EQ(std::memcmp(acc13.bytes.data() + bytes13, before13.bytes.data() + bytes13, bytes13), 0)
                << "expert 1 (no rows) was touched";
        }
    }
}

TEST(Accumulate, BadInputNamesTheArgument) {
    std::mt19937_64 rng(fresh_seed());
    Problem problem{5, 8, 4, 3, 2};
    problem.make(rng);
    HostTensor dx(MEGAMOE_DTYPE_F64, {5, 8}), dtopk(MEGAMOE_DTYPE_F64, {5, 2});
    HostTensor dw13_f64(MEGAMOE_DTYPE_F64, {3, 8, 8}), dw2_f32(MEGAMOE_DTYPE_F32, {3, 8, 4});
    HostTensor dw13_f32(MEGAMOE_DTYPE_F32, {3, 8, 8}), dw2_f64(MEGAMOE_DTYPE_F64, {3, 8, 4});
    megamoe_backward_params_t params = problem.backward_params(dx, dtopk, dw13_f64, dw2_f32);
    params.accumulate_weight_grads = 1;
    EXPECT_EQ(megamoe_backward(&params), MEGAMOE_STATUS_INVALID_ARGUMENT);
    EXPECT_NE(std::string(megamoe_last_error()).find("dw13: accumulate_weight_grads = 1 adds into an f32 buffer"),
              std::string::npos)
        << megamoe_last_error();
    params = problem.backward_params(dx, dtopk, dw13_f32, dw2_f64);
    params.accumulate_weight_grads = 1;
    size_t bytes = 0;
    EXPECT_EQ(megamoe_backward_workspace_size(&params, &bytes), MEGAMOE_STATUS_INVALID_ARGUMENT);
    EXPECT_NE(std::string(megamoe_last_error()).find("dw2: accumulate_weight_grads"), std::string::npos)
        << megamoe_last_error();
    params = problem.backward_params(dx, dtopk, dw13_f32, dw2_f32);
    params.accumulate_weight_grads = 2;
    EXPECT_EQ(megamoe_backward(&params), MEGAMOE_STATUS_INVALID_ARGUMENT);
    EXPECT_NE(std::string(megamoe_last_error()).find("accumulate_weight_grads: must be 0 or 1, got 2"),
              std::string::npos)
        << megamoe_last_error();
    params.accumulate_weight_grads = 0;  // f32 without accumulation stays valid
    EXPECT_EQ(megamoe_backward(&params), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
}

}  // namespace
}  // namespace megamoe::test
