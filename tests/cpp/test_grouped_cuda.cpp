// Grouped rows on the GPU (the CUDA path the whole layer runs, routed by tokens_per_expert with the identity gather):
//   - against the naive f64 loop of grouped_test_util.h on ragged problems: sizes off every tile (H = 72, I = 40, ...),
//     empty experts, one expert taking every row, padding rows past the counts' sum, only padding rows, with and
//     without scores, f16, i64 counts, scores and dscores in the element type, f32 weight gradients, 3000 experts; on
//     the default path (the sm_90a kernels where the device and the sizes allow them: asserted) and on the portable one
//     (MEGAMOE_DISABLE_SM90=1); every output, saved_h and the workspaces poisoned (NaN bytes) before each run; two
//     runs bitwise equal; keep-h and recompute bitwise equal; padding rows exactly 0;
//   - invalid counts (negative, summing past R, huge) give NaN in every output, and no fault; R = 0;
//   - a CUDA graph of forward + backward replays to the eager bits.
// Skips, with the reason, without a GPU.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "path/cuda_path.h"
#include "cuda_test_util.h"
#include "grouped_test_util.h"
#include "test_util.h"

namespace megamoe::test {
namespace {

struct GroupedCase {
    const char* name;
    int64_t num_rows, hidden, intermediate, num_experts, num_valid;
    std::vector<int64_t> empty_experts;
    bool with_scores = true;
    megamoe_dtype_t dtype = MEGAMOE_DTYPE_BF16;
    megamoe_dtype_t counts_dtype = MEGAMOE_DTYPE_I32;
    bool scores_in_dtype = false;   // scores and dscores in the element type instead of f32
    bool weight_grads_f32 = false;  // dw13 / dw2 in f32 instead of the element type
};

std::ostream& operator<<(std::ostream& os, const GroupedCase& c) {
    return os << c.name << " (R=" << c.num_rows << " H=" << c.hidden << " I=" << c.intermediate
              << " E=" << c.num_experts << " valid rows=" << c.num_valid << ", seed " << fresh_seed() << ")";
}

GroupedProblem make_grouped(const GroupedCase& c) {
    std::mt19937_64 rng(fresh_seed() ^ std::hash<std::string>{}(c.name));
    GroupedProblem problem{c.num_rows, c.hidden, c.intermediate,
                           random_counts(c.num_experts, c.num_valid, c.empty_experts, rng)};
    problem.with_scores = c.with_scores;
    problem.dtype = c.dtype;
    problem.counts_dtype = c.counts_dtype;
    problem.scores_dtype = c.scores_in_dtype ? c.dtype : MEGAMOE_DTYPE_F32;
    problem.make(rng);
    return problem;
}

struct GroupedOutputs {
    HostTensor out, dx, dscores, dw13, dw2;
};

// A grouped problem on the device: inputs, outputs (saved_h in keep-h mode), workspaces, and the C API params.
struct DeviceGrouped {
    bool with_scores;
    DeviceTensor x, counts, scores, w13, w2, dout;
    DeviceTensor out, saved_h, dx, dscores, dw13, dw2;
    DeviceTensor forward_workspace, backward_workspace;
    megamoe_grouped_forward_params_t forward{};
    megamoe_grouped_backward_params_t backward{};

    DeviceGrouped(const GroupedProblem& problem, bool keep_h, megamoe_dtype_t weight_grads_dtype,
                  cudaStream_t stream = nullptr)
        : with_scores(problem.with_scores),
          x(DeviceTensor::upload(problem.x_sorted)),
          counts(DeviceTensor::upload(problem.tokens_per_expert)),
          scores(problem.with_scores ? DeviceTensor::upload(problem.scores) : DeviceTensor()),
          w13(DeviceTensor::upload(problem.w13)),
          w2(DeviceTensor::upload(problem.w2)),
          dout(DeviceTensor::upload(problem.dout)),
          out(problem.x_sorted.view),
          saved_h(keep_h ? DeviceTensor(HostTensor(problem.dtype, {problem.num_rows, 2 * problem.intermediate}).view)
                         : DeviceTensor()),
          dx(problem.x_sorted.view),
          dscores(problem.with_scores ? DeviceTensor(problem.scores.view) : DeviceTensor()),
          dw13(HostTensor(weight_grads_dtype, {problem.num_experts, 2 * problem.intermediate, problem.hidden}).view),
          dw2(HostTensor(weight_grads_dtype, {problem.num_experts, problem.hidden, problem.intermediate}).view) {
        forward.x_sorted = x.view();
        forward.tokens_per_expert = counts.view();
        forward.scores = scores.view();
        forward.w13 = w13.view();
        forward.w2 = w2.view();
        forward.out = out.view();
        forward.saved_h = saved_h.view();
        forward.stream = stream;
        backward.dout = dout.view();
        backward.x_sorted = x.view();
        backward.tokens_per_expert = counts.view();
        backward.scores = scores.view();
        backward.w13 = w13.view();
        backward.w2 = w2.view();
        backward.saved_h = saved_h.view();
        backward.dx_sorted = dx.view();
        backward.dscores = dscores.view();
        backward.dw13 = dw13.view();
        backward.dw2 = dw2.view();
        backward.stream = stream;
        bind_workspace(forward, megamoe_grouped_forward_workspace_size, forward_workspace);
        bind_workspace(backward, megamoe_grouped_backward_workspace_size, backward_workspace);
    }

    Shape shape() const {
        return {forward.x_sorted.shape[0], forward.x_sorted.shape[1], forward.w2.shape[2], forward.w13.shape[0], 1};
    }

    // NaN bytes into every output, saved_h and both workspaces (nothing may rely on zeroed memory).
    void poison() {
        for (DeviceTensor* tensor :
             {&out, &saved_h, &dx, &dscores, &dw13, &dw2, &forward_workspace, &backward_workspace}) {
            if (tensor->view().data != nullptr) tensor->poison();
        }
        expect_cuda(cudaDeviceSynchronize(), "poison");
    }

    GroupedOutputs run() {
        poison();
        EXPECT_EQ(megamoe_grouped_forward(&forward), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
        EXPECT_EQ(megamoe_grouped_backward(&backward), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
        expect_cuda(cudaDeviceSynchronize(), "grouped forward + backward");
        return download();
    }

    GroupedOutputs download() const {
        return {out.download(), dx.download(), with_scores ? dscores.download() : HostTensor(), dw13.download(),
                dw2.download()};
    }
};

void expect_bitwise_equal(const GroupedOutputs& a, const GroupedOutputs& b, const std::string& what) {
    EXPECT_EQ(a.out.bytes, b.out.bytes) << what << ": out differs";
    EXPECT_EQ(a.dx.bytes, b.dx.bytes) << what << ": dx_sorted differs";
    EXPECT_EQ(a.dscores.bytes, b.dscores.bytes) << what << ": dscores differs";
    EXPECT_EQ(a.dw13.bytes, b.dw13.bytes) << what << ": dw13 differs";
    EXPECT_EQ(a.dw2.bytes, b.dw2.bytes) << what << ": dw2 differs";
}

bool all_nan(const HostTensor& tensor) {
    for (int64_t idx = 0; idx < tensor.size(); ++idx) {
        if (!std::isnan(tensor.get(idx))) return false;
    }
    return true;
}

// One path (default or MEGAMOE_DISABLE_SM90=1) of one case against the naive loop.
void check_path(const GroupedCase& c, const GroupedProblem& problem, const GroupedResult& want, bool portable) {
    SCOPED_TRACE(portable ? "portable path (MEGAMOE_DISABLE_SM90=1)" : "default path");
    std::unique_ptr<ScopedEnv> disable_sm90;
    if (portable) disable_sm90 = std::make_unique<ScopedEnv>("MEGAMOE_DISABLE_SM90", "1");
    const megamoe_dtype_t weight_grads_dtype = c.weight_grads_f32 ? MEGAMOE_DTYPE_F32 : c.dtype;
    DeviceGrouped recompute(problem, false, weight_grads_dtype), kept(problem, true, weight_grads_dtype);

    std::string no_sm90_reason;
    const bool expect_sm90 =
        !portable && sm90_available(&no_sm90_reason) && c.hidden % 8 == 0 && c.intermediate % 8 == 0;
    EXPECT_EQ(cuda::forward_uses_sm90(recompute.forward, recompute.shape()), expect_sm90) << "forward path";
    EXPECT_EQ(cuda::backward_uses_sm90(recompute.backward, recompute.shape()), expect_sm90) << "backward path";
    EXPECT_EQ(cuda::backward_weight_grads_use_sm90(recompute.backward, recompute.shape()), expect_sm90)
        << "weight-gradient path";

    const GroupedOutputs got = recompute.run();
    expect_bitwise_equal(got, recompute.run(), "two runs");
    expect_bitwise_equal(got, kept.run(), "keep-h against recompute");

    const double tolerance = c.dtype == MEGAMOE_DTYPE_F16 ? kF16Tolerance : kBf16Tolerance;
    EXPECT_LT(relative_error(got.out, want.out), tolerance) << "out vs the naive f64 loop";
    EXPECT_LT(relative_error(got.dx, want.dx), tolerance) << "dx_sorted vs the naive f64 loop";
    if (c.with_scores) {
        EXPECT_LT(relative_error(got.dscores, want.dscores, &want.ds_scale), tolerance)
            << "dscores vs the naive f64 loop (relative to the size of the terms of <p, a>)";
    }
    EXPECT_LT(relative_error(got.dw13, want.dw13), tolerance) << "dw13 vs the naive f64 loop";
    EXPECT_LT(relative_error(got.dw2, want.dw2), tolerance) << "dw2 vs the naive f64 loop";
    const int64_t num_valid = problem.num_valid_rows();
    EXPECT_TRUE(rows_are_zero(got.out, num_valid, c.hidden)) << "padding rows of out are not exactly 0";
    EXPECT_TRUE(rows_are_zero(got.dx, num_valid, c.hidden)) << "padding rows of dx_sorted are not exactly 0";
    if (c.with_scores) EXPECT_TRUE(rows_are_zero(got.dscores, num_valid, 1)) << "padding rows of dscores";
}

void check_case(const GroupedCase& c) {
    SCOPED_TRACE(::testing::PrintToString(c));
    const GroupedProblem problem = make_grouped(c);
    const GroupedResult want = naive_grouped(problem);
    check_path(c, problem, want, false);
    check_path(c, problem, want, true);
}

TEST(GroupedCuda, RaggedShapesMatchNaiveLoop) {
    SKIP_WITHOUT_CUDA();
    std::vector<GroupedCase> cases;
    cases.push_back({"H = 72, I = 40, E = 5, an empty expert, padding", 150, 72, 40, 5, 142, {1}});
    cases.push_back({"one expert takes every row", 300, 136, 72, 4, 300, {0, 2, 3}});
    cases.push_back(
        {"no scores, f16, two empty experts, padding", 97, 72, 48, 7, 90, {0, 4}, false, MEGAMOE_DTYPE_F16});
    cases.push_back({"R = 1, E = 1", 1, 64, 32, 1, 1, {}});
    cases.push_back({"K and N tails, i64 counts, several M tiles",
                     600,
                     520,
                     200,
                     8,
                     590,
                     {3},
                     true,
                     MEGAMOE_DTYPE_BF16,
                     MEGAMOE_DTYPE_I64});
    cases.push_back({"sizes off multiples of 8 (portable only)", 37, 70, 33, 5, 30, {2}});
    cases.push_back({"most experts empty", 5, 64, 40, 64, 5, {}});
    cases.push_back({"only padding rows", 20, 64, 40, 3, 0, {}});
    cases.push_back({"bf16 scores and dscores, f32 weight grads",
                     130,
                     64,
                     48,
                     6,
                     128,
                     {5},
                     true,
                     MEGAMOE_DTYPE_BF16,
                     MEGAMOE_DTYPE_I32,
                     true,
                     true});
    cases.push_back({"more tiles than SMs", 2048, 64, 1024, 2, 2000, {}});
    cases.push_back(
        {"thousands of experts (the counts scan over several 1024-expert chunks)", 50, 24, 16, 3000, 47, {}});
    for (const GroupedCase& c : cases) check_case(c);
}

// Counts that are negative, sum past R, or are huge cannot be reported without a host sync: every output is NaN,
// no kernel reads or writes out of bounds (the run completes without a CUDA error), and the next valid call is right.
TEST(GroupedCuda, InvalidCountsGiveNanEverywhere) {
    SKIP_WITHOUT_CUDA();
    const GroupedCase base{"invalid counts", 40, 72, 40, 3, 30, {}};
    const std::vector<std::vector<double>> bad_counts = {
        {10, -1, 20}, {20, 15, 10}, {2147483647.0, 1, 0}, {-2147483648.0, 40, 0}};
    for (megamoe_dtype_t counts_dtype : {MEGAMOE_DTYPE_I32, MEGAMOE_DTYPE_I64}) {
        for (const std::vector<double>& counts : bad_counts) {
            for (bool portable : {false, true}) {
                SCOPED_TRACE(::testing::Message()
                             << "counts {" << counts[0] << ", " << counts[1] << ", " << counts[2] << "}, "
                             << dtype_name(counts_dtype) << (portable ? ", portable" : ""));
                std::unique_ptr<ScopedEnv> disable_sm90;
                if (portable) disable_sm90 = std::make_unique<ScopedEnv>("MEGAMOE_DISABLE_SM90", "1");
                GroupedCase c = base;
                c.counts_dtype = counts_dtype;
                GroupedProblem problem = make_grouped(c);
                for (int64_t expert_idx = 0; expert_idx < 3; ++expert_idx) {
                    problem.tokens_per_expert.set(expert_idx, counts[static_cast<size_t>(expert_idx)]);
                }
                DeviceGrouped device(problem, false, c.dtype);
                const GroupedOutputs got = device.run();
                EXPECT_TRUE(all_nan(got.out)) << "out";
                EXPECT_TRUE(all_nan(got.dx)) << "dx_sorted";
                EXPECT_TRUE(all_nan(got.dscores)) << "dscores";
                EXPECT_TRUE(all_nan(got.dw13)) << "dw13";
                EXPECT_TRUE(all_nan(got.dw2)) << "dw2";
            }
        }
    }
    check_case(base);  // the device is still sound
}

TEST(GroupedCuda, NoRows) {
    SKIP_WITHOUT_CUDA();
    for (bool counts_valid : {true, false}) {
        SCOPED_TRACE(counts_valid ? "counts all 0" : "counts summing past R = 0");
        GroupedProblem problem{0, 64, 40, {0, counts_valid ? 0 : 2, 0}};
        problem.dtype = MEGAMOE_DTYPE_BF16;
        problem.scores_dtype = MEGAMOE_DTYPE_F32;
        std::mt19937_64 rng(fresh_seed());
        problem.make(rng);
        DeviceGrouped device(problem, false, problem.dtype);
        const GroupedOutputs got = device.run();
        EXPECT_EQ(got.out.size(), 0);
        for (const HostTensor* grad : {&got.dw13, &got.dw2}) {
            for (int64_t idx = 0; idx < grad->size(); ++idx) {
                ASSERT_EQ(std::isnan(grad->get(idx)), !counts_valid) << "dw[" << idx << "]";
                if (counts_valid) ASSERT_EQ(grad->get(idx), 0.0) << "dw[" << idx << "]";
            }
        }
    }
}

// Forward + backward captured into a CUDA graph on a side stream replay to the eager bits: no host synchronisation
// (the counts are read on the device only), no allocation.
TEST(GroupedCuda, GraphCaptureReplaysBitwise) {
    SKIP_WITHOUT_CUDA();
    const GroupedProblem problem = make_grouped({"graph capture", 200, 136, 72, 6, 190, {2}});
    cudaStream_t stream = nullptr;
    expect_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    {
        DeviceGrouped device(problem, true, problem.dtype, stream);
        const GroupedOutputs eager = device.run();
        expect_graph_replays(
            stream,
            [&] {
                const std::string forward_error =
                    failure_message(megamoe_grouped_forward(&device.forward), "grouped forward");
                return forward_error + failure_message(megamoe_grouped_backward(&device.backward), "grouped backward");
            },
            [&] { device.poison(); }, [&] { expect_bitwise_equal(eager, device.download(), "graph replay"); });
    }
    cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace megamoe::test
