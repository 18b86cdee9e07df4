// The fused sm_90a forward (sm90/m_grouped/gemm.cu, dispatched by path/cuda_path.cu) on a Hopper GPU:
//   - against the CPU reference (the C API on CPU tensors, f64 accumulation) on ragged problems: T = 1,
//     topk = 1, E = 1, one expert taking every slot, experts with no tokens, dropped slots, thousands of
//     experts, T / H / I that are not multiples of 64 or 128 (N and K tails), more tiles than SMs, f16;
//     every output and the workspace are poisoned (NaN bytes) before each run, and two runs must be bitwise
//     equal;
//   - on the four reference shapes of DESIGN.md section 4, against the portable path (MEGAMOE_DISABLE_SM90=1)
//     within bf16 error, weights drawn on the device;
//   - the dispatch: operands the sm_90a kernels cannot take (misaligned views) fall back to the portable path.
// Skips, with the reason, without a compute capability 9.0 device.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <iostream>
#include <numeric>
#include <string>
#include <vector>

#include "path/cuda_path.h"
#include "cuda_test_util.h"
#include "device_fill.h"
#include "test_util.h"

namespace megamoe::test {
namespace {

HostTensor reference_y(const Problem& problem) {
    HostTensor y(problem.dtype, {problem.num_tokens, problem.hidden});
    megamoe_forward_params_t params = problem.forward_params(y);
    EXPECT_EQ(megamoe_forward(&params), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
    return y;
}

void check_against_reference(const Sm90Case& c) {
    SCOPED_TRACE(::testing::PrintToString(c));
    const Problem problem = make_problem(c);
    const HostTensor want = reference_y(problem);
    DeviceForward device = upload_forward(problem);
    ASSERT_TRUE(cuda::forward_uses_sm90(device.params, shape_of(device.params))) << "sm_90a path not taken";
    const HostTensor got = device.run();
    EXPECT_EQ(got.bytes, device.run().bytes) << "y differs between runs";
    const double tolerance = c.dtype == MEGAMOE_DTYPE_F16 ? kF16Tolerance : kBf16Tolerance;
    EXPECT_LT(relative_error(got, want), tolerance) << "y: relative Frobenius error vs the CPU reference";
}

TEST(Sm90Forward, RaggedShapesMatchReference) {
    SKIP_WITHOUT_SM90();
    std::vector<Sm90Case> cases = sm90_ragged_cases();
    cases.push_back({"thousands of experts", 50, 24, 16, 3000, 3});
    for (const Sm90Case& c : cases) check_against_reference(c);
}

// Misaligned views (one element past the allocation) cannot take 16-byte cp.async or TMA: the dispatch
// must pick the portable kernels and stay correct.
TEST(Sm90Forward, MisalignedViewsFallBackToPortable) {
    SKIP_WITHOUT_SM90();
    const Sm90Case c{"misaligned views", 150, 136, 72, 5, 2, Routing::kSomeDropped};
    SCOPED_TRACE(::testing::PrintToString(c));
    const Problem problem = make_problem(c);
    DeviceForward device = upload_forward(problem, 1);
    EXPECT_FALSE(cuda::forward_uses_sm90(device.params, shape_of(device.params)));
    EXPECT_LT(relative_error(device.run(), reference_y(problem)), kBf16Tolerance);
}

TEST(Sm90Forward, ReferenceShapesAgreeWithPortablePath) {
    SKIP_WITHOUT_SM90();
    for (const ReferenceShape& s : kReferenceShapes) {
        SCOPED_TRACE(std::string(s.name) + ", seed " + std::to_string(fresh_seed()));
        std::mt19937_64 rng(fresh_seed() ^ std::hash<std::string>{}(s.name));
        HostTensor ids, weights;
        random_routing(s, rng, &ids, &weights);
        const megamoe_dtype_t dtype = MEGAMOE_DTYPE_BF16;
        const uint64_t seed = rng();
        DeviceForward device{device_random(dtype, {s.num_tokens, s.hidden}, seed + 1, 0.5),
                             DeviceTensor::upload(ids),
                             DeviceTensor::upload(weights),
                             device_random(dtype, {s.num_experts, 2 * s.intermediate, s.hidden}, seed + 2,
                                           1.0 / std::sqrt(static_cast<double>(s.hidden))),
                             device_random(dtype, {s.num_experts, s.hidden, s.intermediate}, seed + 3,
                                           1.0 / std::sqrt(static_cast<double>(s.intermediate))),
                             DeviceTensor(contiguous_view(dtype, {s.num_tokens, s.hidden})),
                             {}};
        device.bind();
        ASSERT_TRUE(cuda::forward_uses_sm90(device.params, shape_of(device.params))) << "sm_90a path not taken";
        const HostTensor fused = device.run();
        HostTensor portable;
        {
            const ScopedEnv disable("MEGAMOE_DISABLE_SM90", "1");
            ASSERT_FALSE(cuda::forward_uses_sm90(device.params, shape_of(device.params)));
            portable = device.run();
        }
        double norm = 0.0;
        for (int64_t idx = 0; idx < portable.size(); ++idx) norm += portable.get(idx) * portable.get(idx);
        EXPECT_GT(norm, 0.0) << "y is all zeros: the inputs were not filled";
        const double error = relative_error(fused, portable);
        EXPECT_LT(error, kPathAgreement) << "sm_90a vs portable forward";
        std::cout << s.name << ": |y| = " << std::sqrt(norm) << ", sm_90a vs portable relative error " << error << "\n";
    }
}

}  // namespace
}  // namespace megamoe::test
