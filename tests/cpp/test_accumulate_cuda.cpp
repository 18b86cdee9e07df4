// Weight gradients accumulated into f32 buffers (accumulate_weight_grads) on the GPU, on the three kernel choices of
// the K-grouped weight gradients: the sm_90a kernel (Hopper only), the portable kernel after the sm_90a M-grouped
// GEMMs (the test override MEGAMOE_TEST_PORTABLE_WEIGHT_GRADS, Hopper only) and the portable path throughout
// (MEGAMOE_DISABLE_SM90=1, any GPU). On the ragged set (T = 1, one expert taking every slot, empty experts, dropped
// slots, sizes off every tile, f16) and cases aimed at the sm_90a kernel's k-blocks and cluster pairs, each buffer
// filled with random values first:
//   - accumulated == previous + the same path's fresh f32 gradient, bitwise (one f32 addition per element);
//   - two runs from the same previous buffer are bitwise equal;
//   - accumulated - previous against the CPU reference's gradient, within bf16 / f16 error;
//   - experts with no slots keep their part of the buffer bitwise;
// and an empty batch and grouped rows with empty experts and padding. Skips, with the reason, without a GPU (the
// sm_90a modes without a compute capability 9.0 device).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "path/cuda_path.h"
#include "cuda_test_util.h"
#include "grouped_test_util.h"
#include "test_util.h"

namespace megamoe::test {
namespace {

enum class WeightGradKernel { kSm90, kPortableAfterSm90, kPortablePath };

// The setting of one kernel choice (MEGAMOE_DISABLE_SM90, the test override of the weight gradients), for the scope.
struct KernelChoice {
    explicit KernelChoice(WeightGradKernel kernel)
        : disable_sm90("MEGAMOE_DISABLE_SM90", kernel == WeightGradKernel::kPortablePath ? "1" : "0"),
          portable_weight_grads(kernel == WeightGradKernel::kSm90 ? 0u : MEGAMOE_TEST_PORTABLE_WEIGHT_GRADS) {}
    ScopedEnv disable_sm90;
    ScopedOverrides portable_weight_grads;
};

HostTensor random_f32(const std::vector<int64_t>& dims, std::mt19937_64& rng) {
    HostTensor tensor(MEGAMOE_DTYPE_F32, dims);
    tensor.fill_random(rng, 1.0);
    return tensor;
}

// previous + fresh, elementwise in f32.
HostTensor f32_sum(const HostTensor& previous, const HostTensor& fresh) {
    HostTensor sum = previous;
    for (int64_t idx = 0; idx < sum.size(); ++idx) {
        sum.set(idx, static_cast<float>(previous.get(idx)) + static_cast<float>(fresh.get(idx)));
    }
    return sum;
}

// accumulated - previous, in f64 (the gradient the accumulation added).
HostTensor difference(const HostTensor& accumulated, const HostTensor& previous) {
    HostTensor diff(MEGAMOE_DTYPE_F64,
                    std::vector<int64_t>(previous.view.shape, previous.view.shape + previous.view.ndim));
    for (int64_t idx = 0; idx < diff.size(); ++idx) diff.set(idx, accumulated.get(idx) - previous.get(idx));
    return diff;
}

// Expert `expert_idx`'s block of an [E, ...] f32 tensor equals the previous buffer's, bitwise.
bool expert_untouched(const HostTensor& got, const HostTensor& previous, int64_t expert_idx) {
    const size_t block_bytes = static_cast<size_t>(previous.size() / previous.view.shape[0]) * 4;
    return std::memcmp(got.bytes.data() + expert_idx * block_bytes, previous.bytes.data() + expert_idx * block_bytes,
                       block_bytes) == 0;
}

// The whole layer's backward on the device with f32 weight gradients, accumulated or written.
struct DeviceAccumulate {
    DeviceBackward backward;

    explicit DeviceAccumulate(const Problem& problem) : backward(upload_backward(problem, 0, MEGAMOE_DTYPE_F32)) {}

    // Runs the backward with dw13 / dw2 starting as `previous13` / `previous2` (accumulate) or poisoned (not);
    // returns them afterwards.
    std::pair<HostTensor, HostTensor> run(bool accumulate, const HostTensor& previous13, const HostTensor& previous2) {
        backward.params.accumulate_weight_grads = accumulate ? 1 : 0;
        bind_workspace(backward.params, megamoe_backward_workspace_size, backward.workspace);  // poisoned
        if (accumulate) {
            expect_cuda(cudaMemcpy(backward.dw13.view().data, previous13.view.data, previous13.bytes.size() - 1,
                                   cudaMemcpyHostToDevice),
                        "upload dw13");
            expect_cuda(cudaMemcpy(backward.dw2.view().data, previous2.view.data, previous2.bytes.size() - 1,
                                   cudaMemcpyHostToDevice),
                        "upload dw2");
        } else {
            backward.dw13.poison();
            backward.dw2.poison();
        }
        expect_cuda(cudaDeviceSynchronize(), "setup");
        EXPECT_EQ(megamoe_backward(&backward.params), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
        expect_cuda(cudaDeviceSynchronize(), "backward");
        return {backward.dw13.download(), backward.dw2.download()};
    }
};

void check_accumulation(const Sm90Case& c, WeightGradKernel kernel) {
    SCOPED_TRACE(::testing::PrintToString(c));
    const KernelChoice choice(kernel);
    const Problem problem = make_problem(c);
    std::mt19937_64 rng(fresh_seed() ^ 0xacc);
    const int64_t H = c.hidden, I = c.intermediate, E = c.num_experts;
    const HostTensor previous13 = random_f32({E, 2 * I, H}, rng), previous2 = random_f32({E, H, I}, rng);

    DeviceAccumulate device(problem);
    const Shape shape = shape_of(device.backward.params);
    device.backward.params.accumulate_weight_grads = 1;
    ASSERT_EQ(cuda::backward_uses_sm90(device.backward.params, shape), kernel != WeightGradKernel::kPortablePath)
        << "sm_90a M-grouped GEMMs taken or not, against MEGAMOE_DISABLE_SM90";
    ASSERT_EQ(cuda::backward_weight_grads_use_sm90(device.backward.params, shape), kernel == WeightGradKernel::kSm90)
        << "sm_90a weight-gradient kernel taken or not, against MEGAMOE_TEST_PORTABLE_WEIGHT_GRADS";

    const auto [fresh13, fresh2] = device.run(false, previous13, previous2);
    const auto [got13, got2] = device.run(true, previous13, previous2);
    const auto [again13, again2] = device.run(true, previous13, previous2);
    EXPECT_EQ(got13.bytes, again13.bytes) << "accumulated dw13 differs between runs";
    EXPECT_EQ(got2.bytes, again2.bytes) << "accumulated dw2 differs between runs";
    EXPECT_EQ(got13.bytes, f32_sum(previous13, fresh13).bytes) << "dw13 != previous + this path's fresh gradient";
    EXPECT_EQ(got2.bytes, f32_sum(previous2, fresh2).bytes) << "dw2 != previous + this path's fresh gradient";

    HostTensor dx(c.dtype, {c.num_tokens, H}), dtopk(MEGAMOE_DTYPE_F32, {c.num_tokens, c.topk});
    HostTensor want13(MEGAMOE_DTYPE_F32, {E, 2 * I, H}), want2(MEGAMOE_DTYPE_F32, {E, H, I});
    megamoe_backward_params_t reference = problem.backward_params(dx, dtopk, want13, want2);
    ASSERT_EQ(megamoe_backward(&reference), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
    const double tolerance = c.dtype == MEGAMOE_DTYPE_F16 ? kF16Tolerance : kBf16Tolerance;
    EXPECT_LT(relative_error(difference(got13, previous13), want13), tolerance) << "added dw13 vs the CPU reference";
    EXPECT_LT(relative_error(difference(got2, previous2), want2), tolerance) << "added dw2 vs the CPU reference";

    std::vector<bool> has_rows(static_cast<size_t>(E), false);
    for (int64_t slot_idx = 0; slot_idx < c.num_tokens * c.topk; ++slot_idx) {
        const auto expert_idx = static_cast<int64_t>(problem.ids.get(slot_idx));
        if (expert_idx >= 0) has_rows[static_cast<size_t>(expert_idx)] = true;
    }
    for (int64_t expert_idx = 0; expert_idx < E; ++expert_idx) {
        if (has_rows[static_cast<size_t>(expert_idx)]) continue;
        EXPECT_TRUE(expert_untouched(got13, previous13, expert_idx)) << "dw13 of empty expert " << expert_idx;
        EXPECT_TRUE(expert_untouched(got2, previous2, expert_idx)) << "dw2 of empty expert " << expert_idx;
    }
}

std::vector<Sm90Case> accumulate_cases() {
    std::vector<Sm90Case> cases = sm90_ragged_cases();
    cases.push_back({"whole k-blocks only, odd m-tile pairs", 256, 264, 136, 1, 1});
    cases.push_back({"odd n-tile pairs, long experts", 600, 712, 392, 2, 2});
    cases.push_back({"more cluster tiles than clusters, half empty", 768, 528, 264, 40, 4, Routing::kHalfEmpty});
    cases.push_back({"claimed tiles wrap the ring, one hot expert", 1500, 528, 264, 96, 3, Routing::kOneExpert});
    return cases;
}

TEST(AccumulateCuda, Sm90WeightGradKernel) {
    SKIP_WITHOUT_SM90();
    for (const Sm90Case& c : accumulate_cases()) check_accumulation(c, WeightGradKernel::kSm90);
}

TEST(AccumulateCuda, PortableWeightGradKernelAfterSm90) {
    SKIP_WITHOUT_SM90();
    for (const Sm90Case& c : accumulate_cases()) check_accumulation(c, WeightGradKernel::kPortableAfterSm90);
}

TEST(AccumulateCuda, PortablePath) {
    SKIP_WITHOUT_CUDA();
    for (const Sm90Case& c : accumulate_cases()) check_accumulation(c, WeightGradKernel::kPortablePath);
}

TEST(AccumulateCuda, EmptyBatchLeavesTheBuffersUntouched) {
    SKIP_WITHOUT_CUDA();
    std::mt19937_64 rng(fresh_seed());
    Problem problem{0, 64, 32, 3, 2};
    problem.dtype = MEGAMOE_DTYPE_BF16;
    problem.make(rng);
    const HostTensor previous13 = random_f32({3, 64, 64}, rng), previous2 = random_f32({3, 64, 32}, rng);
    DeviceAccumulate device(problem);
    const auto [got13, got2] = device.run(true, previous13, previous2);
    EXPECT_EQ(got13.bytes, previous13.bytes);
    EXPECT_EQ(got2.bytes, previous2.bytes);
}

// Grouped rows (empty experts, padding rows, R = 0) on every kernel choice the device has: previous + fresh bitwise,
// empty experts untouched.
TEST(AccumulateCuda, GroupedRows) {
    SKIP_WITHOUT_CUDA();
    std::string reason;
    std::vector<WeightGradKernel> kernels = {WeightGradKernel::kPortablePath};
    if (sm90_available(&reason))
        kernels = {WeightGradKernel::kSm90, WeightGradKernel::kPortableAfterSm90, WeightGradKernel::kPortablePath};
    std::mt19937_64 rng(fresh_seed() ^ 0x6a09);
    for (const std::vector<int64_t>& counts : {std::vector<int64_t>{5, 0, 300, 0, 17}, std::vector<int64_t>{0, 0, 0}}) {
        const int64_t R = counts.size() == 3 ? 0 : 340, H = 136, I = 72, E = static_cast<int64_t>(counts.size());
        GroupedProblem problem(R, H, I, counts);
        problem.dtype = MEGAMOE_DTYPE_BF16;
        problem.scores_dtype = MEGAMOE_DTYPE_F32;
        problem.make(rng);
        const HostTensor previous13 = random_f32({E, 2 * I, H}, rng), previous2 = random_f32({E, H, I}, rng);
        for (const WeightGradKernel kernel : kernels) {
            SCOPED_TRACE("R = " + std::to_string(R) + ", kernel choice " + std::to_string(static_cast<int>(kernel)));
            const KernelChoice choice(kernel);
            DeviceTensor x = DeviceTensor::upload(problem.x_sorted),
                         counts_d = DeviceTensor::upload(problem.tokens_per_expert);
            DeviceTensor scores = DeviceTensor::upload(problem.scores), w13 = DeviceTensor::upload(problem.w13);
            DeviceTensor w2 = DeviceTensor::upload(problem.w2), dout = DeviceTensor::upload(problem.dout);
            DeviceTensor dw13(previous13.view), dw2(previous2.view), workspace;
            HostTensor results[2][2];
            for (int accumulate = 0; accumulate < 2; ++accumulate) {
                megamoe_grouped_backward_params_t params{};
                params.dout = dout.view();
                params.x_sorted = x.view();
                params.tokens_per_expert = counts_d.view();
                params.scores = scores.view();
                params.w13 = w13.view();
                params.w2 = w2.view();
                params.dw13 = dw13.view();
                params.dw2 = dw2.view();
                params.accumulate_weight_grads = accumulate;
                bind_workspace(params, megamoe_grouped_backward_workspace_size, workspace);
                expect_cuda(cudaMemcpy(dw13.view().data, previous13.view.data, previous13.bytes.size() - 1,
                                       cudaMemcpyHostToDevice),
                            "upload dw13");
                expect_cuda(cudaMemcpy(dw2.view().data, previous2.view.data, previous2.bytes.size() - 1,
                                       cudaMemcpyHostToDevice),
                            "upload dw2");
                expect_cuda(cudaDeviceSynchronize(), "setup");
                EXPECT_EQ(megamoe_grouped_backward(&params), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
                expect_cuda(cudaDeviceSynchronize(), "grouped backward");
                results[accumulate][0] = dw13.download();
                results[accumulate][1] = dw2.download();
            }
            EXPECT_EQ(results[1][0].bytes, f32_sum(previous13, results[0][0]).bytes) << "grouped dw13";
            EXPECT_EQ(results[1][1].bytes, f32_sum(previous2, results[0][1]).bytes) << "grouped dw2";
            for (int64_t expert_idx = 0; expert_idx < E; ++expert_idx) {
                if (counts[static_cast<size_t>(expert_idx)] != 0) continue;
                EXPECT_TRUE(expert_untouched(results[1][0], previous13, expert_idx)) << "dw13 of expert " << expert_idx;
                EXPECT_TRUE(expert_untouched(results[1][1], previous2, expert_idx)) << "dw2 of expert " << expert_idx;
            }
        }
    }
}

}  // namespace
}  // namespace megamoe::test
