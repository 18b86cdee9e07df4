// The row kernels of the non-default expert options (src/cuda/layout_rows.h) on their own, against host loops: the
// per-expert column sums behind db13 / db2 and the activation rows kernel (dh written over h in place, in w13's row
// order, ds with the bias term). Without a GPU every test skips.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <vector>

#include "cuda/layout_rows.h"
#include "layout_cuda_util.h"

namespace megamoe::test {
namespace {

constexpr megamoe_dtype_t kBf16 = MEGAMOE_DTYPE_BF16;
constexpr megamoe_dtype_t kF32 = MEGAMOE_DTYPE_F32;

// db13 / db2's kernel alone: per-expert column sums in row order, gathered and weighted or not, written in bf16 / f32
// or added into f32 (an expert without rows: zeros, or its buffer untouched).
TEST(LayoutKernels, ExpertColumnSums) {
    SKIP_WITHOUT_CUDA();
    std::mt19937_64 rng(fresh_seed());
    const int64_t E = 4, cols = 37, topk = 2, num_tokens = 20, rows = 30;
    const std::vector<int> offsets = {0, 5, 5, 12, rows};
    HostTensor src(kBf16, {num_tokens * topk, cols}), weights(kF32, {num_tokens * topk});
    HostTensor offsets_host(MEGAMOE_DTYPE_I32, {E + 1}), slots(MEGAMOE_DTYPE_I32, {rows});
    src.fill_random(rng, 1.0);
    weights.fill_random(rng, 1.0);
    std::vector<int> perm(static_cast<size_t>(num_tokens * topk));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int64_t r = 0; r < rows; ++r) slots.set(r, perm[static_cast<size_t>(r)]);
    for (int64_t e = 0; e <= E; ++e) offsets_host.set(e, offsets[static_cast<size_t>(e)]);
    DeviceTensor src_dev = upload_view(src.view), weights_dev = upload_view(weights.view);
    DeviceTensor offsets_dev = upload_view(offsets_host.view), slots_dev = upload_view(slots.view);
    for (const bool gathered : {false, true}) {
        for (const megamoe_dtype_t out_dtype : {kBf16, kF32}) {
            for (const bool accumulate : {false, true}) {
                if (accumulate && out_dtype != kF32) continue;
                HostTensor initial(out_dtype, {E, cols});
                initial.fill_random(rng, 1.0);
                DeviceTensor out_dev = upload_view(initial.view);
                if (!accumulate) out_dev.poison();
                cuda::ExpertColSumsArgs args{};
                args.src = src_dev.view().data;
                args.src_dtype = kBf16;
                args.gather_slots = gathered ? static_cast<const int*>(slots_dev.view().data) : nullptr;
                args.topk = topk;
                args.weights = gathered ? weights_dev.view().data : nullptr;
                args.weights_dtype = kF32;
                args.expert_offsets = static_cast<const int*>(offsets_dev.view().data);
                args.num_experts = E;
                args.num_cols = cols;
                args.out = out_dev.view().data;
                args.out_dtype = out_dtype;
                args.accumulate = accumulate;
                ASSERT_EQ(cuda::launch_expert_col_sums(args, nullptr), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
                expect_cuda(cudaDeviceSynchronize(), "expert_col_sums");
                const HostTensor got = out_dev.download();
                for (int64_t e = 0; e < E; ++e) {
                    for (int64_t col = 0; col < cols; ++col) {
                        double want = accumulate ? initial.get(e * cols + col) : 0.0;
                        for (int r = offsets[static_cast<size_t>(e)]; r < offsets[static_cast<size_t>(e) + 1]; ++r) {
                            const int64_t slot = gathered ? static_cast<int64_t>(slots.get(r)) : r;
                            const int64_t src_row = gathered ? slot / topk : r;
                            want += (gathered ? weights.get(slot) : 1.0) * src.get(src_row * cols + col);
                        }
                        const double tolerance = out_dtype == kBf16 ? 1e-2 * (1.0 + std::fabs(want)) : 1e-4;
                        EXPECT_NEAR(got.get(e * cols + col), want, tolerance) << "expert " << e << " column " << col;
                        if (accumulate && e == 1) EXPECT_EQ(got.get(e * cols + col), initial.get(e * cols + col));
                    }
                }
            }
        }
    }
}

// The activation rows kernel alone, dh written over h in place: ds = <p, a> + <dy, b2[e]>, dh in w13's row order
// (interleaved pairs or [dg, du]) from the derivative written out in layout_test_util.h, s * a.
TEST(LayoutKernels, ActivationRowsInPlace) {
    SKIP_WITHOUT_CUDA();
    std::mt19937_64 rng(fresh_seed());
    const int64_t E = 3, I = 300, H = 9, topk = 2, num_tokens = 6, rows = 10;
    const std::vector<int> offsets = {0, 4, 4, rows};
    for (const bool interleaved : {false, true}) {
        for (const bool clamped : {false, true}) {
            const LayoutProblem math(1, 1, 1, 1, 1,
                                     {MEGAMOE_GATE_UP_CONCATENATED, false, false, clamped, false});  // activation()
            HostTensor h(kBf16, {rows, 2 * I}), p(kF32, {rows, I}), dy(kBf16, {num_tokens, H}), b2(kBf16, {E, H});
            HostTensor weights(kF32, {num_tokens * topk}), slots(MEGAMOE_DTYPE_I32, {rows});
            HostTensor offsets_host(MEGAMOE_DTYPE_I32, {E + 1});
            h.fill_random(rng, 1.0);
            p.fill_random(rng, 1.0);
            dy.fill_random(rng, 1.0);
            b2.fill_random(rng, 1.0);
            weights.fill_random(rng, 1.0);
            for (int64_t r = 0; r < rows; ++r) slots.set(r, static_cast<double>((r * 7) % (num_tokens * topk)));
            for (int64_t e = 0; e <= E; ++e) offsets_host.set(e, offsets[static_cast<size_t>(e)]);
            DeviceTensor h_dev = upload_view(h.view), p_dev = upload_view(p.view), dy_dev = upload_view(dy.view);
            DeviceTensor b2_dev = upload_view(b2.view), weights_dev = upload_view(weights.view);
            DeviceTensor slots_dev = upload_view(slots.view), offsets_dev = upload_view(offsets_host.view);
            DeviceTensor act_dev(HostTensor(kBf16, {rows, I}).view), ds_dev(HostTensor(kF32, {rows}).view);
            act_dev.poison();
            ds_dev.poison();
            cuda::DActArgs args{};
            args.dtype = kBf16;
            args.h = h_dev.view().data;
            args.dh = h_dev.view().data;
            args.dh_interleaved = interleaved;
            args.p = static_cast<const float*>(p_dev.view().data);
            args.act = act_dev.view().data;
            args.ds_rows = static_cast<float*>(ds_dev.view().data);
            args.sorted_slot = static_cast<const int*>(slots_dev.view().data);
            args.expert_offsets = static_cast<const int*>(offsets_dev.view().data);
            args.num_experts = E;
            args.weights = weights_dev.view().data;
            args.weights_dtype = kF32;
            args.dy = dy_dev.view().data;
            args.b2 = b2_dev.view().data;
            args.topk = topk;
            args.hidden = H;
            args.intermediate = I;
            args.activation = {clamped ? MEGAMOE_ACTIVATION_CLAMPED_SWIGLU : MEGAMOE_ACTIVATION_SWIGLU,
                               clamped ? static_cast<float>(LayoutProblem::kLimit) : 0.0f,
                               clamped ? static_cast<float>(LayoutProblem::kAlpha) : 0.0f};
            args.max_rows = rows;
            ASSERT_EQ(cuda::launch_dact_rows(args, nullptr), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
            expect_cuda(cudaDeviceSynchronize(), "dact_rows");
            const HostTensor dh = h_dev.download(), act = act_dev.download(), ds = ds_dev.download();
            for (int64_t r = 0; r < rows; ++r) {
                const auto slot = static_cast<int64_t>(slots.get(r));
                const double s = weights.get(slot);
                const int64_t e = r < 4 ? 0 : 2;
                double want_ds = 0.0, ds_scale = 0.0;
                for (int64_t i = 0; i < I; ++i) {
                    double a = 0.0, dg = 0.0, du = 0.0;
                    math.activation(h.get(r * 2 * I + i), h.get(r * 2 * I + I + i), &a, &dg, &du);
                    const double pi = p.get(r * I + i);
                    want_ds += pi * a;
                    ds_scale += std::fabs(pi * a);
                    const int64_t gate_at = interleaved ? 2 * i : i, up_at = interleaved ? 2 * i + 1 : I + i;
                    EXPECT_NEAR(dh.get(r * 2 * I + gate_at), s * pi * dg, 1e-2 * (1.0 + std::fabs(s * pi * dg)));
                    EXPECT_NEAR(dh.get(r * 2 * I + up_at), s * pi * du, 1e-2 * (1.0 + std::fabs(s * pi * du)));
                    EXPECT_NEAR(act.get(r * I + i), s * a, 1e-2 * (1.0 + std::fabs(s * a)));
                }
                for (int64_t col = 0; col < H; ++col) {
                    const double term = dy.get((slot / topk) * H + col) * b2.get(e * H + col);
                    want_ds += term;
                    ds_scale += std::fabs(term);
                }
                EXPECT_NEAR(ds.get(r), want_ds, 1e-4 * (1.0 + ds_scale)) << "row " << r;
            }
        }
    }
}

}  // namespace
}  // namespace megamoe::test
