// The kernels of the non-default expert options on their own, against host loops: the GEMM steps of
// src/path/steps_portable.h (the gated up GEMM for every layout, activation and b13; the down GEMM with a transposed w2
// and b2; the dX GEMM over dh in w13's row order, the separate layout's two GEMMs added by the f32 accumulating
// epilogue), and the row kernels of src/portable/layout_rows.h (the per-expert column sums behind db13 / db2, the
// activation rows kernel writing dh over h in place, also as the default options' launch_dswiglu_rows). Without a GPU
// every test skips.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <tuple>
#include <vector>

#include "portable/elementwise.h"
#include "portable/layout_rows.h"
#include "path/steps_portable.h"
#include "layout_cuda_util.h"

namespace megamoe::test {
namespace {

constexpr megamoe_dtype_t kBf16 = MEGAMOE_DTYPE_BF16;
constexpr megamoe_dtype_t kF32 = MEGAMOE_DTYPE_F32;

// Rows of E = 3 experts (one empty, one over two M tiles) with their routing buffers on the device, and a Call of the
// layout case holding the device weights: what steps_portable.h's GEMM steps read.
struct GemmStepProblem {
    static constexpr int64_t kHidden = 40, kIntermediate = 72, kExperts = 3;
    static constexpr int kCounts[kExperts] = {5, 0, 140};
    LayoutProblem weights;  // the expert parameters (f64 values that bf16 holds exactly)
    LayoutProblem device;   // the same in bf16
    int64_t num_rows = 0;
    std::vector<int> offsets, tile_offsets;
    DeviceViews views;
    const int* offsets_dev = nullptr;
    const int* tile_offsets_dev = nullptr;
    cuda::Call call{};

    GemmStepProblem(const LayoutCase& c, std::mt19937_64& rng)
        : weights(1, kHidden, kIntermediate, kExperts, 1, c), device(1, kHidden, kIntermediate, kExperts, 1, c) {
        weights.make(rng);
        for (HostTensor* t : {&weights.w13, &weights.w3, &weights.w2, &weights.b13, &weights.b2}) {
            round_through(*t, kBf16);
        }
        device = weights;
        for (HostTensor* t : {&device.w13, &device.w3, &device.w2, &device.b13, &device.b2}) *t = converted(*t, kBf16);
        offsets.push_back(0);
        tile_offsets.push_back(0);
        for (const int count : kCounts) {
            offsets.push_back(offsets.back() + count);
            tile_offsets.push_back(tile_offsets.back() + (count + cuda::kGemmBlockM - 1) / cuda::kGemmBlockM);
        }
        num_rows = offsets.back();
        HostTensor offsets_host(MEGAMOE_DTYPE_I32, {kExperts + 1}), tiles_host(MEGAMOE_DTYPE_I32, {kExperts + 1});
        for (int64_t e = 0; e <= kExperts; ++e) {
            offsets_host.set(e, offsets[static_cast<size_t>(e)]);
            tiles_host.set(e, tile_offsets[static_cast<size_t>(e)]);
        }
        offsets_dev = static_cast<const int*>(views.upload(&offsets_host.view)->view().data);
        tile_offsets_dev = static_cast<const int*>(views.upload(&tiles_host.view)->view().data);
        megamoe_tensor_t w13 = device.w13.view, w3 = device.w3.view, w2 = device.w2.view, b13 = device.b13.view,
                         b2 = device.b2.view;
        call.shape = {num_rows, kHidden, kIntermediate, kExperts, 1};
        call.dtype = kBf16;
        call.w13 = views.upload(&w13)->view().data;
        call.w2 = views.upload(&w2)->view().data;
        DeviceTensor* w3_dev = views.upload(&w3);
        DeviceTensor* b13_dev = views.upload(&b13);
        DeviceTensor* b2_dev = views.upload(&b2);
        call.w3 = w3_dev != nullptr ? w3_dev->view().data : nullptr;
        call.b13 = b13_dev != nullptr ? b13_dev->view().data : nullptr;
        call.b2 = b2_dev != nullptr ? b2_dev->view().data : nullptr;
        megamoe_layout_t layout{c.gate_up, c.w13_transposed, c.w2_transposed};
        call.layout = WeightLayout::of(layout, kHidden, kIntermediate);
        megamoe_activation_t activation{};
        if (c.clamped) activation = {MEGAMOE_ACTIVATION_CLAMPED_SWIGLU, LayoutProblem::kLimit, LayoutProblem::kAlpha};
        call.activation = Activation<float>::of(activation);
        call.default_experts = call.layout.is_default() && !c.clamped && !c.biases;
    }

    int64_t expert_of(int64_t row) const {
        int64_t e = 0;
        while (offsets[static_cast<size_t>(e) + 1] <= row) ++e;
        return e;
    }

    // The rows' routing as the GEMM steps read it (the rows are the tokens: no gather).
    cuda::SortedRows rows() const { return {nullptr, offsets_dev, tile_offsets_dev, tile_offsets.back()}; }
};

void expect_rows_near(const HostTensor& got, const std::vector<double>& want, const std::string& what) {
    double diff = 0.0, norm = 0.0;
    for (int64_t idx = 0; idx < got.size(); ++idx) {
        diff += (got.get(idx) - want[static_cast<size_t>(idx)]) * (got.get(idx) - want[static_cast<size_t>(idx)]);
        norm += want[static_cast<size_t>(idx)] * want[static_cast<size_t>(idx)];
    }
    EXPECT_LT(std::sqrt(diff / std::max(norm, 1e-300)), 1e-2) << what;
}

TEST(LayoutKernels, GemmStepsEveryLayout) {
    SKIP_WITHOUT_CUDA();
    std::mt19937_64 rng(fresh_seed());
    SCOPED_TRACE("seed " + std::to_string(fresh_seed()));
    const int64_t H = GemmStepProblem::kHidden, I = GemmStepProblem::kIntermediate;
    for (const LayoutCase& c : all_layout_cases()) {
        const std::string what = describe(c);
        GemmStepProblem problem(c, rng);
        const LayoutProblem& w = problem.weights;
        const int64_t R = problem.num_rows;
        HostTensor x(kBf16, {R, H}), act_in(kBf16, {R, I}), dh(kBf16, {R, 2 * I});
        x.fill_random(rng, 0.5);
        act_in.fill_random(rng, 1.0);
        dh.fill_random(rng, 1.0);
        DeviceTensor x_dev = upload_view(x.view), act_in_dev = upload_view(act_in.view), dh_dev = upload_view(dh.view);
        DeviceTensor h_dev(HostTensor(kBf16, {R, 2 * I}).view), act_dev(HostTensor(kBf16, {R, I}).view);
        DeviceTensor o_dev(HostTensor(kBf16, {R, H}).view), q_dev(HostTensor(kF32, {R, H}).view);
        for (DeviceTensor* out : {&h_dev, &act_dev, &o_dev, &q_dev}) out->poison();

        const cuda::Call& call = problem.call;
        const cuda::SortedRows rows = problem.rows();
        ASSERT_EQ(cuda::launch_up(call, rows, x_dev.view().data, h_dev.view().data, act_dev.view().data, nullptr),
                  MEGAMOE_STATUS_SUCCESS)
            << megamoe_last_error();
        ASSERT_EQ(cuda::launch_down(call, rows, act_in_dev.view().data, o_dev.view().data, nullptr),
                  MEGAMOE_STATUS_SUCCESS)
            << megamoe_last_error();
        ASSERT_EQ(cuda::launch_d_input(call, rows, dh_dev.view().data, static_cast<float*>(q_dev.view().data), nullptr),
                  MEGAMOE_STATUS_SUCCESS)
            << megamoe_last_error();
        expect_cuda(cudaDeviceSynchronize(), "gemm steps");

        std::vector<double> want_h(static_cast<size_t>(R * 2 * I)), want_act(static_cast<size_t>(R * I));
        std::vector<double> want_o(static_cast<size_t>(R * H)), want_q(static_cast<size_t>(R * H));
        const bool interleaved = c.gate_up == MEGAMOE_GATE_UP_INTERLEAVED;
        for (int64_t r = 0; r < R; ++r) {
            const int64_t e = problem.expert_of(r);
            for (int64_t i = 0; i < I; ++i) {
                double gate = present(w.b13) ? w.b13.get(w.bias13_at(e, i, false)) : 0.0;
                double up = present(w.b13) ? w.b13.get(w.bias13_at(e, i, true)) : 0.0;
                for (int64_t k = 0; k < H; ++k) {
                    gate += w.weight(e, i, k, false) * x.get(r * H + k);
                    up += w.weight(e, i, k, true) * x.get(r * H + k);
                }
                double a = 0.0, d_gate = 0.0, d_up = 0.0;
                w.activation(gate, up, &a, &d_gate, &d_up);
                want_h[static_cast<size_t>(r * 2 * I + i)] = gate;
                want_h[static_cast<size_t>(r * 2 * I + I + i)] = up;
                want_act[static_cast<size_t>(r * I + i)] = a;
            }
            for (int64_t col = 0; col < H; ++col) {
                double o = present(w.b2) ? w.b2.get(e * H + col) : 0.0, q = 0.0;
                for (int64_t i = 0; i < I; ++i) {
                    o += w.w2.get(w.down_at(e, col, i)) * act_in.get(r * I + i);
                    const double dg = dh.get(r * 2 * I + (interleaved ? 2 * i : i));
                    const double du = dh.get(r * 2 * I + (interleaved ? 2 * i + 1 : I + i));
                    q += dg * w.weight(e, i, col, false) + du * w.weight(e, i, col, true);
                }
                want_o[static_cast<size_t>(r * H + col)] = o;
                want_q[static_cast<size_t>(r * H + col)] = q;
            }
        }
        expect_rows_near(h_dev.download(), want_h, what + ": up GEMM h");
        expect_rows_near(act_dev.download(), want_act, what + ": up GEMM a");
        expect_rows_near(o_dev.download(), want_o, what + ": down GEMM o");
        expect_rows_near(q_dev.download(), want_q, what + ": dX GEMM q");
    }
}

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
// (interleaved pairs or [dg, du]) from the derivative written out in layout_test_util.h, s * a. SwiGLU with [dg, du]
// also through launch_dswiglu_rows (the default options' entry: no b2 term).
TEST(LayoutKernels, ActivationRowsInPlace) {
    SKIP_WITHOUT_CUDA();
    std::mt19937_64 rng(fresh_seed());
    const int64_t E = 3, I = 300, H = 9, topk = 2, num_tokens = 6, rows = 10;
    const std::vector<int> offsets = {0, 4, 4, rows};
    for (const auto& [interleaved, clamped, default_entry] :
         std::vector<std::tuple<bool, bool, bool>>{{false, false, false},
                                                   {false, true, false},
                                                   {true, false, false},
                                                   {true, true, false},
                                                   {false, false, true}}) {
        SCOPED_TRACE(std::string(interleaved ? "interleaved" : "[dg, du]") + (clamped ? ", clamped" : "") +
                     (default_entry ? ", launch_dswiglu_rows" : ""));
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
        if (default_entry) {
            cuda::DSwiGLUArgs swiglu{};
            swiglu.dtype = args.dtype;
            swiglu.h = args.h;
            swiglu.dh = args.dh;
            swiglu.p = args.p;
            swiglu.act = args.act;
            swiglu.ds_rows = args.ds_rows;
            swiglu.sorted_slot = args.sorted_slot;
            swiglu.expert_offsets = args.expert_offsets;
            swiglu.num_experts = args.num_experts;
            swiglu.weights = args.weights;
            swiglu.weights_dtype = args.weights_dtype;
            swiglu.intermediate = args.intermediate;
            swiglu.max_rows = args.max_rows;
            ASSERT_EQ(cuda::launch_dswiglu_rows(swiglu, nullptr), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
        } else {
            ASSERT_EQ(cuda::launch_dact_rows(args, nullptr), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
        }
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
            for (int64_t col = 0; col < (default_entry ? 0 : H); ++col) {
                const double term = dy.get((slot / topk) * H + col) * b2.get(e * H + col);
                want_ds += term;
                ds_scale += std::fabs(term);
            }
            EXPECT_NEAR(ds.get(r), want_ds, 1e-4 * (1.0 + ds_scale)) << "row " << r;
        }
    }
}

}  // namespace
}  // namespace megamoe::test
