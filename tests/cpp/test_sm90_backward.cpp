// The sm_90a backward (path/cuda_path.cu runs the recomputed up GEMM, dH and dX on the fused wgmma kernels of
// sm90/m_grouped/gemm.cu; dH and dX read their weights N-contiguous, BLayout::kKN) on a Hopper GPU:
//   - against the CPU reference (the C API on CPU tensors, f64 accumulation) on ragged problems: T = 1, topk = 1,
//     E = 1, one expert taking every slot, experts with no tokens, dropped slots, N and K tails on every GEMM,
//     f16; every output and the workspace are poisoned (NaN bytes) before each run, two runs must be bitwise
//     equal, and each case asserts that the sm_90a path was taken;
//   - on the four reference shapes of DESIGN.md section 4, against the portable path (MEGAMOE_DISABLE_SM90=1)
//     within bf16 error (dx and d topk_weights whole, dW13 / dW2 on their first and last experts);
//   - the sm_90a K-grouped weight-gradient kernel (the default; the test override MEGAMOE_TEST_PORTABLE_WEIGHT_GRADS
//     opts out) on the ragged set and on cases aimed at its TMA k-blocks and cluster pairs;
//   - the keep-h memory mode (the forward's saved_h read by the backward) against the recompute mode, bitwise, on
//     the sm_90a and the portable path, with saved_h itself against the CPU reference's h;
//   - the M-grouped tile order in pair blocks against the plain order, bitwise (builds that form pair blocks);
//   - the dispatch: misaligned views fall back to the portable path; s * a and q in the dw13 output.
// Skips, with the reason, without a compute capability 9.0 device.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <iostream>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "path/cuda_path.h"
#include "sm90/m_grouped_gemm_sm90.h"
#include "cuda_test_util.h"
#include "device_fill.h"
#include "test_util.h"

namespace megamoe::test {
namespace {

using Grads = BackwardGrads;

Grads reference_grads(const Problem& problem) {
    const int64_t T = problem.num_tokens, H = problem.hidden, I = problem.intermediate, E = problem.num_experts;
    Grads grads{HostTensor(problem.dtype, {T, H}), HostTensor(MEGAMOE_DTYPE_F32, {T, problem.topk}),
                HostTensor(problem.dtype, {E, 2 * I, H}), HostTensor(problem.dtype, {E, H, I})};
    megamoe_backward_params_t params = problem.backward_params(grads.dx, grads.dtopk, grads.dw13, grads.dw2);
    EXPECT_EQ(megamoe_backward(&params), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
    return grads;
}

// Relative Frobenius error of got against want, relative to the norm of `scale` when given.
double relative_error_scaled(const HostTensor& got, const HostTensor& want, const std::vector<double>& scale) {
    double diff = 0.0, norm = 0.0;
    for (int64_t idx = 0; idx < want.size(); ++idx) {
        const double delta = got.get(idx) - want.get(idx);
        diff += delta * delta;
        norm += scale[static_cast<size_t>(idx)] * scale[static_cast<size_t>(idx)];
    }
    return std::sqrt(diff) / std::max(std::sqrt(norm), 1e-300);
}

void expect_bitwise_equal(const Grads& first, const Grads& second) {
    EXPECT_EQ(first.dx.bytes, second.dx.bytes) << "dx differs between runs";
    EXPECT_EQ(first.dtopk.bytes, second.dtopk.bytes) << "dtopk_weights differs between runs";
    EXPECT_EQ(first.dw13.bytes, second.dw13.bytes) << "dw13 differs between runs";
    EXPECT_EQ(first.dw2.bytes, second.dw2.bytes) << "dw2 differs between runs";
}

void check_against_reference(const Sm90Case& c, bool sm90_weight_grads) {
    SCOPED_TRACE(::testing::PrintToString(c));
    const Problem problem = make_problem(c);
    const Grads want = reference_grads(problem);
    DeviceBackward device = upload_backward(problem);
    ASSERT_TRUE(cuda::backward_uses_sm90(device.params, shape_of(device.params))) << "sm_90a path not taken";
    ASSERT_EQ(cuda::backward_weight_grads_use_sm90(device.params, shape_of(device.params)), sm90_weight_grads)
        << "sm_90a weight-gradient kernel taken or not, against MEGAMOE_TEST_PORTABLE_WEIGHT_GRADS";
    device.run();
    const Grads got = device.download();
    device.run();
    expect_bitwise_equal(got, device.download());
    const double tolerance = c.dtype == MEGAMOE_DTYPE_F16 ? kF16Tolerance : kBf16Tolerance;
    EXPECT_LT(relative_error(got.dx, want.dx), tolerance) << "dx vs the CPU reference";
    EXPECT_LT(relative_error_scaled(got.dtopk, want.dtopk, dtopk_term_scale(problem)), tolerance)
        << "dtopk_weights vs the CPU reference (relative to the size of the terms of <p, a>)";
    EXPECT_LT(relative_error(got.dw13, want.dw13), tolerance) << "dw13 vs the CPU reference";
    EXPECT_LT(relative_error(got.dw2, want.dw2), tolerance) << "dw2 vs the CPU reference";
}

TEST(Sm90Backward, RaggedShapesMatchReference) {  // sm_90a M-grouped GEMMs, portable weight gradients
    SKIP_WITHOUT_SM90();
    const ScopedOverrides portable_weight_grads(MEGAMOE_TEST_PORTABLE_WEIGHT_GRADS);
    for (const Sm90Case& c : sm90_ragged_cases()) check_against_reference(c, false);
}

// The sm_90a K-grouped weight-gradient kernel (the default) on the same ragged set, and on
// cases aimed at it: experts of whole 64-row k-blocks only (all by TMA), odd numbers of the tiles a cluster pairs
// (the second CTA recomputes the first one's tile) with M / N tails, and more cluster tiles than clusters with empty
// experts between full ones (CTAs walk experts of different lengths), and more claimed tiles per cluster than the
// tile ring holds, heaviest expert first.
TEST(Sm90Backward, WeightGradKernelMatchesReference) {
    SKIP_WITHOUT_SM90();
    std::vector<Sm90Case> cases = sm90_ragged_cases();
    cases.push_back({"whole k-blocks only, odd m-tile pairs", 256, 264, 136, 1, 1});
    cases.push_back({"odd n-tile pairs, long experts", 600, 712, 392, 2, 2});
    cases.push_back({"more cluster tiles than clusters, half empty", 768, 528, 264, 40, 4, Routing::kHalfEmpty});
    cases.push_back({"claimed tiles wrap the ring, one hot expert", 1500, 528, 264, 96, 3, Routing::kOneExpert});
    for (const Sm90Case& c : cases) check_against_reference(c, true);
}

// Keep-h mode: the forward writes saved_h (poisoned first), the backward reads it instead of recomputing h (and writes
// dh over it). The gradients must equal the recompute mode's bitwise (h comes from the same kernel either way), and
// saved_h's routed rows (sorted rows [0, routed slots)) must match the CPU reference's h row by row, so both keep the
// same row order (the rows of dropped slots, at the end, are not written, so not compared).
void check_keep_h(const Sm90Case& c, bool expect_sm90) {
    SCOPED_TRACE(::testing::PrintToString(c));
    const Problem problem = make_problem(c);
    const int64_t num_slots = problem.num_tokens * problem.topk, I = problem.intermediate;
    DeviceBackward device = upload_backward(problem);
    ASSERT_EQ(cuda::backward_uses_sm90(device.params, shape_of(device.params)), expect_sm90);
    device.run();
    const Grads recompute = device.download();

    DeviceForward forward = upload_forward(problem);
    DeviceTensor saved_h(HostTensor(problem.dtype, {num_slots, 2 * I}).view);
    forward.params.saved_h = saved_h.view();
    forward.bind();
    saved_h.poison();
    forward.run();
    const HostTensor h_got = saved_h.download();  // before the backward consumes it
    device.params.saved_h = saved_h.view();
    device.run();
    expect_bitwise_equal(recompute, device.download());

    HostTensor y_want(problem.dtype, {problem.num_tokens, problem.hidden}), h_want(problem.dtype, {num_slots, 2 * I});
    megamoe_forward_params_t reference = problem.forward_params(y_want);
    reference.saved_h = h_want.view;
    ASSERT_EQ(megamoe_forward(&reference), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
    int64_t num_routed = 0;
    for (int64_t slot_idx = 0; slot_idx < num_slots; ++slot_idx) num_routed += problem.ids.get(slot_idx) >= 0;
    double diff = 0.0, norm = 0.0;
    for (int64_t row_idx = 0; row_idx < num_routed; ++row_idx) {
        for (int64_t col = 0; col < 2 * I; ++col) {
            const double want = h_want.get(row_idx * 2 * I + col), got = h_got.get(row_idx * 2 * I + col);
            diff += (got - want) * (got - want);
            norm += want * want;
        }
    }
    const double tolerance = c.dtype == MEGAMOE_DTYPE_F16 ? kF16Tolerance : kBf16Tolerance;
    EXPECT_LT(std::sqrt(diff) / std::max(std::sqrt(norm), 1e-300), tolerance) << "saved_h vs the CPU reference";
}

TEST(Sm90Backward, KeepHMatchesRecompute) {
    SKIP_WITHOUT_SM90();
    for (const Sm90Case& c : sm90_ragged_cases()) check_keep_h(c, true);
}

TEST(Sm90Backward, KeepHMatchesRecomputeOnPortablePath) {
    SKIP_WITHOUT_SM90();
    const ScopedEnv portable("MEGAMOE_DISABLE_SM90", "1");
    for (const Sm90Case& c : sm90_ragged_cases()) check_keep_h(c, false);
}

// The M-grouped tile order in pair blocks (the test override MEGAMOE_TEST_PAIR_BLOCKS forms them at every launch, not
// only where an expert's weights exceed the L2) computes the plain order's bits: each output tile is one CTA's over
// the whole K, whichever cluster takes it. y and every gradient, on the ragged set and on experts of several pairs of
// M tiles with a partial last block. Runs where the build forms pair blocks.
TEST(Sm90Backward, PairBlocksMatchThePlainOrderBitwise) {
    SKIP_WITHOUT_SM90();
    if (!sm90::m_grouped_pair_blocks_built()) {
        GTEST_SKIP() << "this build forms no pair blocks (MEGAMOE_M_PAIR_BLOCK_MIB 0): both orders are the plain one";
    }
    std::vector<Sm90Case> cases = sm90_ragged_cases();
    cases.push_back({"4 pairs an expert, a partial last block", 1500, 264, 392, 3, 2});
    cases.push_back({"one expert of 12 pairs", 3000, 136, 264, 4, 1, Routing::kOneExpert});
    for (const Sm90Case& c : cases) {
        SCOPED_TRACE(::testing::PrintToString(c));
        const Problem problem = make_problem(c);
        DeviceForward forward = upload_forward(problem);
        DeviceBackward backward = upload_backward(problem);
        const HostTensor y_plain = forward.run();
        backward.run();
        const Grads plain = backward.download();
        const ScopedOverrides pair_blocks(MEGAMOE_TEST_PAIR_BLOCKS);
        EXPECT_EQ(forward.run().bytes, y_plain.bytes) << "y differs between the orders";
        backward.run();
        expect_bitwise_equal(plain, backward.download());
    }
}

// The sm_90a backward needs less workspace than the portable one (q in the element type, no p); a workspace that is
// not 256-byte aligned is refused by name (the size query cannot see it).
TEST(Sm90Backward, WorkspaceFitsThePathAndMustBeAligned) {
    SKIP_WITHOUT_SM90();
    const Sm90Case c{"workspace", 64, 136, 72, 5, 2};
    const Problem problem = make_problem(c);
    DeviceBackward device = upload_backward(problem);
    size_t sm90_bytes = 0, portable_bytes = 0;
    ASSERT_EQ(megamoe_backward_workspace_size(&device.params, &sm90_bytes), MEGAMOE_STATUS_SUCCESS);
    {
        const ScopedEnv portable("MEGAMOE_DISABLE_SM90", "1");
        ASSERT_EQ(megamoe_backward_workspace_size(&device.params, &portable_bytes), MEGAMOE_STATUS_SUCCESS);
        EXPECT_EQ(megamoe_backward(&device.params), MEGAMOE_STATUS_WORKSPACE_TOO_SMALL) << "sized for sm_90a";
    }
    EXPECT_LT(sm90_bytes, portable_bytes);
    DeviceTensor big = device_workspace(sm90_bytes + 256);
    device.params.workspace = static_cast<char*>(big.view().data) + 16;
    EXPECT_EQ(megamoe_backward(&device.params), MEGAMOE_STATUS_INVALID_ARGUMENT);
    EXPECT_NE(std::string(megamoe_last_error()).find("workspace: must be 256-byte aligned"), std::string::npos)
        << megamoe_last_error();
}

// The sm_90a backward keeps s * a and q in the dw13 output when the call wants dw13 without accumulation (large and
// aligned enough): the workspace shrinks by that buffer, dw13 still matches the reference, and dx, d topk_weights and
// dw2 are bitwise those of the same call without dw13 (whose act buffer is carved from the workspace).
TEST(Sm90Backward, ActBufferInDw13OutputMatchesCarved) {
    SKIP_WITHOUT_SM90();
    const Sm90Case c{"act in dw13", 150, 136, 72, 5, 2, Routing::kSomeDropped};
    SCOPED_TRACE(::testing::PrintToString(c));
    const Problem problem = make_problem(c);
    DeviceBackward device = upload_backward(problem);
    ASSERT_TRUE(cuda::backward_uses_sm90(device.params, shape_of(device.params))) << "sm_90a path not taken";
    ASSERT_TRUE(cuda::backward_act_in_dw13(device.params, shape_of(device.params)));
    const size_t bytes_with_dw13 = device.params.workspace_bytes;
    device.run();
    const Grads with_dw13 = device.download();
    device.run();
    expect_bitwise_equal(with_dw13, device.download());
    EXPECT_LT(relative_error(with_dw13.dw13, reference_grads(problem).dw13), kBf16Tolerance) << "dw13";

    device.params.dw13 = megamoe_tensor_t{};
    bind_workspace(device.params, megamoe_backward_workspace_size, device.workspace);
    ASSERT_FALSE(cuda::backward_act_in_dw13(device.params, shape_of(device.params)));
    const size_t act_bytes = static_cast<size_t>(c.num_tokens * c.topk * std::max(c.hidden, c.intermediate)) * 2;
    EXPECT_GE(device.params.workspace_bytes, bytes_with_dw13 + act_bytes) << "the act buffer is carved without dw13";
    device.run();
    const Grads without_dw13 = device.download();
    EXPECT_EQ(with_dw13.dx.bytes, without_dw13.dx.bytes) << "dx";
    EXPECT_EQ(with_dw13.dtopk.bytes, without_dw13.dtopk.bytes) << "dtopk_weights";
    EXPECT_EQ(with_dw13.dw2.bytes, without_dw13.dw2.bytes) << "dw2";
}

TEST(Sm90Backward, MisalignedViewsFallBackToPortable) {
    SKIP_WITHOUT_SM90();
    const Sm90Case c{"misaligned views", 150, 136, 72, 5, 2, Routing::kSomeDropped};
    SCOPED_TRACE(::testing::PrintToString(c));
    const Problem problem = make_problem(c);
    DeviceBackward device = upload_backward(problem, 1);
    EXPECT_FALSE(cuda::backward_uses_sm90(device.params, shape_of(device.params)));
    device.run();
    EXPECT_LT(relative_error(device.download().dx, reference_grads(problem).dx), kBf16Tolerance);
}

// Experts first and last of a weight gradient [E, rows, cols] (the whole of it would take minutes to compare).
HostTensor download_first_and_last_expert(const DeviceTensor& grad) {
    const megamoe_tensor_t& view = grad.view();
    const int64_t per_expert = view.shape[1] * view.shape[2];
    const int64_t num_experts = view.shape[0];
    HostTensor host(view.dtype, {num_experts > 1 ? 2 : 1, view.shape[1], view.shape[2]});
    const size_t expert_bytes = static_cast<size_t>(per_expert) * dtype_size(view.dtype);
    auto* dst = static_cast<char*>(host.view.data);
    const auto* src = static_cast<const char*>(view.data);
    expect_cuda(cudaMemcpy(dst, src, expert_bytes, cudaMemcpyDeviceToHost), "download expert 0");
    if (num_experts > 1) {
        expect_cuda(cudaMemcpy(dst + expert_bytes, src + (num_experts - 1) * expert_bytes, expert_bytes,
                               cudaMemcpyDeviceToHost),
                    "download the last expert");
    }
    return host;
}

TEST(Sm90Backward, ReferenceShapesAgreeWithPortablePath) {
    SKIP_WITHOUT_SM90();
    for (const ReferenceShape& s : kReferenceShapes) {
        SCOPED_TRACE(std::string(s.name) + ", seed " + std::to_string(fresh_seed()));
        std::mt19937_64 rng(fresh_seed() ^ std::hash<std::string>{}(s.name));
        HostTensor ids, weights;
        random_routing(s, rng, &ids, &weights);
        const megamoe_dtype_t dtype = MEGAMOE_DTYPE_BF16;
        const uint64_t seed = rng();
        const int64_t T = s.num_tokens, H = s.hidden, I = s.intermediate, E = s.num_experts;
        DeviceBackward device{device_random(dtype, {T, H}, seed + 1, 0.5),
                              DeviceTensor::upload(ids),
                              DeviceTensor::upload(weights),
                              device_random(dtype, {E, 2 * I, H}, seed + 2, 1.0 / std::sqrt(static_cast<double>(H))),
                              device_random(dtype, {E, H, I}, seed + 3, 1.0 / std::sqrt(static_cast<double>(I))),
                              device_random(dtype, {T, H}, seed + 4, 1.0),
                              DeviceTensor(contiguous_view(dtype, {T, H})),
                              DeviceTensor(contiguous_view(MEGAMOE_DTYPE_F32, {T, s.topk})),
                              DeviceTensor(contiguous_view(dtype, {E, 2 * I, H})),
                              DeviceTensor(contiguous_view(dtype, {E, H, I})),
                              {}};
        device.bind();
        ASSERT_TRUE(cuda::backward_uses_sm90(device.params, shape_of(device.params))) << "sm_90a path not taken";
        device.run();
        const Grads fused{device.dx.download(), device.dtopk.download(), download_first_and_last_expert(device.dw13),
                          download_first_and_last_expert(device.dw2)};
        Grads portable;
        {
            const ScopedEnv disable("MEGAMOE_DISABLE_SM90", "1");
            ASSERT_FALSE(cuda::backward_uses_sm90(device.params, shape_of(device.params)));
            device.bind();  // the portable path needs a larger workspace
            device.run();
            portable = {device.dx.download(), device.dtopk.download(), download_first_and_last_expert(device.dw13),
                        download_first_and_last_expert(device.dw2)};
        }
        const std::pair<const char*, std::pair<const HostTensor*, const HostTensor*>> pairs[] = {
            {"dx", {&fused.dx, &portable.dx}},
            {"dtopk_weights", {&fused.dtopk, &portable.dtopk}},
            {"dw13", {&fused.dw13, &portable.dw13}},
            {"dw2", {&fused.dw2, &portable.dw2}}};
        std::cout << s.name << ": sm_90a vs portable backward relative error";
        for (const auto& [what, tensors] : pairs) {
            double norm = 0.0;
            for (int64_t idx = 0; idx < tensors.second->size(); ++idx) norm += std::pow(tensors.second->get(idx), 2);
            EXPECT_GT(norm, 0.0) << what << " is all zeros: the inputs were not filled";
            const double error = relative_error(*tensors.first, *tensors.second);
            EXPECT_LT(error, kPathAgreement) << what << ": sm_90a vs portable backward";
            std::cout << " " << what << " " << error;
        }
        std::cout << "\n";
    }
}

}  // namespace
}  // namespace megamoe::test
