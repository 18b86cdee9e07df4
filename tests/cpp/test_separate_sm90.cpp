// The separate w1 / w3 layout on the fused sm_90a kernels against the same weights stored concatenated (w13 = [w1; w3]
// per expert, transposed alike), both on sm_90a:
//   - the up GEMM reads the same gate and up rows (columns) into the same B tile, from two tensor maps instead of one:
//     saved_h and y bitwise equal (forward, and the backward's recompute through dx / the weight gradients);
//   - dX runs K = 2I as w1's K blocks then w3's: the concatenated K loop's very blocks when 64 divides I, so dx is
//     bitwise equal there; otherwise the K block straddling I is split in two (zero fill past I in each half), dx near;
//   - dw13 and dw3 are the gate and up halves of the concatenated dw13 (K-grouped over dh's column halves), dw2, d
//     topk_weights, db13 and db2 bitwise equal (dh is the same).
// Skips, with the reason, without a compute capability 9.0 device.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "layout_cuda_util.h"

namespace megamoe::test {
namespace {

constexpr megamoe_dtype_t kBf16 = MEGAMOE_DTYPE_BF16;
constexpr megamoe_dtype_t kF32 = MEGAMOE_DTYPE_F32;
constexpr double kStraddleTolerance = 1e-2;  // dx when 64 does not divide I: one K block summed in two parts

struct Outputs {
    HostTensor y, h;
    LayoutGrads grads;
};

// The problem with every tensor in the device types (bf16; topk_weights f32).
LayoutProblem device_problem(int64_t T, int64_t H, int64_t I, int64_t E, int64_t topk, Routing routing,
                             const LayoutCase& c, std::mt19937_64& rng) {
    LayoutProblem problem(T, H, I, E, topk, c);
    problem.make(rng, routing);
    for (HostTensor* t :
         {&problem.base.x, &problem.base.dy, &problem.w13, &problem.w3, &problem.w2, &problem.b13, &problem.b2}) {
        if (present(*t)) *t = converted(*t, kBf16);
    }
    problem.base.weights = converted(problem.base.weights, kF32);
    problem.base.dtype = kBf16;
    return problem;
}

// The separate problem's weights stored concatenated: w13 [E, 2I, H] (transposed [E, H, 2I]) = [w1; w3], no w3.
LayoutProblem concatenated_twin(const LayoutProblem& separate) {
    LayoutProblem twin = separate;
    twin.layout_case.gate_up = MEGAMOE_GATE_UP_CONCATENATED;
    twin.w3 = HostTensor();
    twin.w13 = HostTensor(kBf16, twin.w13_shape());
    const int64_t E = separate.base.num_experts, I = separate.base.intermediate, H = separate.base.hidden;
    for (int64_t e = 0; e < E; ++e) {
        for (int64_t i = 0; i < I; ++i) {
            for (int64_t k = 0; k < H; ++k) {
                for (const bool is_up : {false, true}) {
                    twin.w13.set(twin.gate_up_at(e, i, k, is_up).second, separate.weight(e, i, k, is_up));
                }
            }
        }
    }
    return twin;
}

bool all_finite(const HostTensor& t) {
    for (int64_t idx = 0; idx < t.size(); ++idx) {
        if (!std::isfinite(t.get(idx))) return false;
    }
    return true;
}

// Forward (saved_h kept) and keep-h backward of `problem` on the device, every gradient in bf16 (d topk_weights f32),
// after asserting both take the sm_90a kernels.
Outputs run_on_device(const LayoutProblem& problem) {
    const int64_t T = problem.base.num_tokens, H = problem.base.hidden, I = problem.base.intermediate;
    const int64_t E = problem.base.num_experts;
    Outputs out{HostTensor(kBf16, {T, H}), HostTensor(kBf16, {T * problem.base.topk, 2 * I}), LayoutGrads{}};
    {
        megamoe_forward_params_t p = problem.forward_params(out.y);
        p.saved_h = out.h.view;
        DeviceViews views;
        for (megamoe_tensor_t* view : {&p.x, &p.topk_ids, &p.topk_weights, &p.w13, &p.w3, &p.w2, &p.b13, &p.b2}) {
            views.upload(view);
        }
        DeviceTensor* y_dev = views.upload(&p.y);
        DeviceTensor* h_dev = views.upload(&p.saved_h);
        DeviceTensor workspace;
        bind_workspace(p, megamoe_forward_workspace_size, workspace);
        megamoe_path_t path = MEGAMOE_PATH_REFERENCE;
        EXPECT_EQ(megamoe_forward_path(&p, &path), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
        EXPECT_EQ(path, MEGAMOE_PATH_SM90) << megamoe_path_reason();
        y_dev->poison();
        h_dev->poison();
        EXPECT_EQ(megamoe_forward(&p), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
        expect_cuda(cudaDeviceSynchronize(), "forward");
        out.y = y_dev->download();
        out.h = h_dev->download();
    }
    LayoutGrads& g = out.grads;
    g.dx = HostTensor(kBf16, {T, H});
    g.dweights = HostTensor(kF32, {T, problem.base.topk});
    g.dw13 = HostTensor(kBf16, problem.w13_shape());
    if (present(problem.w3)) g.dw3 = HostTensor(kBf16, problem.w13_shape());
    g.dw2 = HostTensor(kBf16, dims_of(problem.w2.view));
    if (present(problem.b13)) g.db13 = HostTensor(kBf16, {E, 2 * I});
    if (present(problem.b2)) g.db2 = HostTensor(kBf16, {E, H});
    megamoe_backward_params_t p = problem.backward_params(g);
    HostTensor h_copy = out.h;
    p.saved_h = h_copy.view;
    DeviceViews views;
    for (megamoe_tensor_t* view :
         {&p.dy, &p.x, &p.topk_ids, &p.topk_weights, &p.w13, &p.w3, &p.w2, &p.b13, &p.b2, &p.saved_h}) {
        views.upload(view);
    }
    std::vector<HostTensor*> hosts = {&g.dx, &g.dweights, &g.dw13, &g.dw3, &g.dw2, &g.db13, &g.db2};
    std::vector<DeviceTensor*> devices;
    for (megamoe_tensor_t* view : {&p.dx, &p.dtopk_weights, &p.dw13, &p.dw3, &p.dw2, &p.db13, &p.db2}) {
        devices.push_back(views.upload(view));
        if (devices.back() != nullptr) devices.back()->poison();
    }
    DeviceTensor workspace;
    bind_workspace(p, megamoe_backward_workspace_size, workspace);
    megamoe_path_t path = MEGAMOE_PATH_REFERENCE;
    EXPECT_EQ(megamoe_backward_path(&p, &path), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
    EXPECT_EQ(path, MEGAMOE_PATH_SM90) << megamoe_path_reason();
    EXPECT_EQ(megamoe_backward(&p), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
    expect_cuda(cudaDeviceSynchronize(), "backward");
    for (size_t idx = 0; idx < hosts.size(); ++idx) {
        if (devices[idx] != nullptr) *hosts[idx] = devices[idx]->download();
    }
    return out;
}

// The separate layout's dw13 and dw3 as the concatenated layout's dw13 (w1's rows, then w3's, per expert).
HostTensor concatenated_dw13(const LayoutProblem& separate, const LayoutProblem& twin, const LayoutGrads& grads) {
    HostTensor out(kBf16, twin.w13_shape());
    const int64_t E = separate.base.num_experts, I = separate.base.intermediate, H = separate.base.hidden;
    for (int64_t e = 0; e < E; ++e) {
        for (int64_t i = 0; i < I; ++i) {
            for (int64_t k = 0; k < H; ++k) {
                for (const bool is_up : {false, true}) {
                    const auto [tensor, offset] = separate.gate_up_at(e, i, k, is_up);
                    out.set(twin.gate_up_at(e, i, k, is_up).second, (tensor ? grads.dw3 : grads.dw13).get(offset));
                }
            }
        }
    }
    return out;
}

TEST(SeparateSm90, MatchesTheConcatenatedLayoutBitwise) {
    SKIP_WITHOUT_SM90();
    std::mt19937_64 rng(fresh_seed());
    SCOPED_TRACE("seed " + std::to_string(fresh_seed()));
    const struct {
        const char* name;
        int64_t num_tokens, hidden, intermediate, num_experts, topk;
        Routing routing;
    } shapes[] = {
        {"64 | I, several M tiles", 150, 136, 128, 3, 2, Routing::kRandom},
        {"I = 200: two n-tiles of pairs, a K block straddling I", 200, 264, 200, 2, 2, Routing::kRandom},
        {"I = 24 < one K block, empty experts", 20, 40, 24, 8, 3, Routing::kHalfEmpty},
    };
    const LayoutCase cases[] = {
        {MEGAMOE_GATE_UP_SEPARATE, false, false, false, false},  // torchtitan
        {MEGAMOE_GATE_UP_SEPARATE, true, false, false, false},
        {MEGAMOE_GATE_UP_SEPARATE, false, true, true, false},
        {MEGAMOE_GATE_UP_SEPARATE, true, true, true, true},
    };
    for (const auto& s : shapes) {
        for (const LayoutCase& c : cases) {
            const std::string what = std::string(s.name) + ", " + describe(c);
            SCOPED_TRACE(what);
            const LayoutProblem separate =
                device_problem(s.num_tokens, s.hidden, s.intermediate, s.num_experts, s.topk, s.routing, c, rng);
            const LayoutProblem twin = concatenated_twin(separate);
            const Outputs got = run_on_device(separate);
            const Outputs want = run_on_device(twin);
            EXPECT_TRUE(all_finite(got.y)) << "y (a NaN: a read of the poisoned workspace)";
            EXPECT_TRUE(same_bytes(got.y, want.y)) << "y";
            EXPECT_TRUE(same_bytes(got.h, want.h)) << "saved_h";
            if (s.intermediate % 64 == 0) {
                EXPECT_TRUE(same_bytes(got.grads.dx, want.grads.dx)) << "dx";
            } else {
                EXPECT_LT(relative_error_to(got.grads.dx, want.grads.dx), kStraddleTolerance) << "dx";
            }
            EXPECT_TRUE(same_bytes(concatenated_dw13(separate, twin, got.grads), want.grads.dw13)) << "dw13 / dw3";
            EXPECT_TRUE(same_bytes(got.grads.dweights, want.grads.dweights)) << "d topk_weights";
            EXPECT_TRUE(same_bytes(got.grads.dw2, want.grads.dw2)) << "dw2";
            EXPECT_TRUE(same_bytes(got.grads.db13, want.grads.db13)) << "db13";
            EXPECT_TRUE(same_bytes(got.grads.db2, want.grads.db2)) << "db2";
        }
    }
}

}  // namespace
}  // namespace megamoe::test
