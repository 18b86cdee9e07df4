// Layouts, activations and biases on CUDA: the portable path against the CPU reference (f64, on the very values the
// device holds) for every layout x activation x bias on ragged shapes (empty experts, one expert taking every slot,
// topk = 1, T = 1, dropped slots, sizes off every tile, odd sizes that force element loads), whole layer and grouped
// rows, both memory modes; outputs poisoned with NaN before each run, every run twice and bitwise equal; accumulated
// weight gradients; only the wanted gradients; the path query naming what keeps a call off the sm_90a kernels (the new
// row kernels on their own: test_layout_kernels_cuda.cpp). The sm_90a kernels take every option, the separate layout
// included (H and I multiples of 8, w3 16-byte aligned): on a Hopper GPU each combination runs there (the path
// asserted) and again on the portable kernels (MEGAMOE_DISABLE_SM90=1), both against the reference; elsewhere, and for
// the other shapes, on the portable kernels. The backward's reference reads the CUDA forward's h (rounded as the device
// rounds it), so that the clamps of the activation decide alike on both sides. Without a GPU every test skips (the
// CPU-only API test runs anywhere).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <numeric>
#include <string>
#include <vector>

#include "layout_cuda_util.h"

namespace megamoe::test {
namespace {

constexpr megamoe_dtype_t kBf16 = MEGAMOE_DTYPE_BF16;
constexpr megamoe_dtype_t kF32 = MEGAMOE_DTYPE_F32;
constexpr megamoe_dtype_t kF64 = MEGAMOE_DTYPE_F64;

struct RaggedShape {
    const char* name;
    int64_t num_tokens, hidden, intermediate, num_experts, topk;
    Routing routing;
};

const RaggedShape kShapes[] = {
    {"dropped slots, tails off every tile", 37, 72, 40, 5, 2, Routing::kSomeDropped},
    {"one expert takes every slot", 130, 64, 24, 4, 1, Routing::kOneExpert},
    {"T = 1, topk = 1", 1, 24, 16, 3, 1, Routing::kRandom},
    {"empty experts, I past one tile of pairs", 20, 40, 72, 8, 3, Routing::kHalfEmpty},
    {"odd H and I (element loads)", 19, 30, 13, 3, 2, Routing::kSomeDropped},
    {"several M tiles per expert", 150, 136, 72, 2, 2, Routing::kRandom},
    // sm_90a: two n-tiles of gate / up pairs (128 each; the second starts gate columns 128, up columns I + 128 or pair
    // 128), two n-tiles of H in down / dX, M tiles in shared-B pairs
    {"two n-tiles of pairs and of H", 200, 264, 200, 2, 2, Routing::kRandom},
};

// A problem in f64 holding values the device types hold exactly, and its device-typed twin (bf16, weights f32).
struct Twins {
    LayoutProblem f64, device;
};

Twins make_twins(const RaggedShape& s, const LayoutCase& c, std::mt19937_64& rng) {
    LayoutProblem problem(s.num_tokens, s.hidden, s.intermediate, s.num_experts, s.topk, c);
    problem.make(rng, s.routing);
    const auto rows = [](LayoutProblem& p) {
        return std::vector<HostTensor*>{&p.base.x, &p.base.dy, &p.w13, &p.w3, &p.w2, &p.b13, &p.b2};
    };
    for (HostTensor* tensor : rows(problem)) round_through(*tensor, kBf16);
    round_through(problem.base.weights, kF32);
    LayoutProblem device = problem;
    for (HostTensor* tensor : rows(device)) *tensor = converted(*tensor, kBf16);
    device.base.weights = converted(device.base.weights, kF32);
    device.base.dtype = kBf16;
    return {problem, device};
}

int64_t routed_slots(const LayoutProblem& problem) {
    int64_t count = 0;
    for (int64_t slot = 0; slot < problem.base.ids.size(); ++slot) count += problem.base.ids.get(slot) >= 0 ? 1 : 0;
    return count;
}

HostTensor leading_rows(const HostTensor& tensor, int64_t num_rows) {
    std::vector<int64_t> dims = dims_of(tensor.view);
    const int64_t row_len = tensor.size() / dims[0];
    dims[0] = num_rows;
    HostTensor out(tensor.view.dtype, dims);
    for (int64_t idx = 0; idx < num_rows * row_len; ++idx) out.set(idx, tensor.get(idx));
    return out;
}

struct ForwardOut {
    HostTensor y, h;
};

// The path a call of `problem` should take: sm_90a on a Hopper GPU (every layout) unless sizes off multiples of 8 or
// MEGAMOE_DISABLE_SM90; else the portable kernels.
bool expect_sm90(const LayoutProblem& problem) {
    std::string reason;
    const char* disabled = std::getenv("MEGAMOE_DISABLE_SM90");
    const bool portable = disabled != nullptr && disabled[0] != '\0' && std::string(disabled) != "0";
    return sm90_available(&reason) && !portable && problem.base.hidden % 8 == 0 && problem.base.intermediate % 8 == 0;
}

// The CUDA forward of the device twin (saved_h when keep_h), twice: the outputs poisoned before each run, the second
// run's bits equal to the first's.
ForwardOut cuda_forward(const LayoutProblem& device, bool keep_h) {
    const int64_t T = device.base.num_tokens, H = device.base.hidden, I = device.base.intermediate;
    HostTensor y(kBf16, {T, H}), h(kBf16, {T * device.base.topk, 2 * I});
    megamoe_forward_params_t p = device.forward_params(y);
    if (keep_h) p.saved_h = h.view;
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
    EXPECT_EQ(path, expect_sm90(device) ? MEGAMOE_PATH_SM90 : MEGAMOE_PATH_CUDA_PORTABLE) << megamoe_path_reason();
    ForwardOut first;
    for (int run = 0; run < 2; ++run) {
        y_dev->poison();
        if (h_dev != nullptr) h_dev->poison();
        expect_cuda(cudaDeviceSynchronize(), "poison");
        EXPECT_EQ(megamoe_forward(&p), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
        expect_cuda(cudaDeviceSynchronize(), "forward");
        ForwardOut got{y_dev->download(), h_dev != nullptr ? h_dev->download() : HostTensor()};
        if (run == 0) {
            first = got;
            continue;
        }
        EXPECT_TRUE(same_bytes(got.y, first.y)) << "y: a rerun is not bitwise equal";
        EXPECT_TRUE(same_bytes(got.h, first.h)) << "saved_h: a rerun is not bitwise equal";
    }
    return first;
}

// Gradient buffers for `problem`'s backward, each shaped as its input: the weight gradients in `dtype`, dx in
// `row_dtype`, d topk_weights in f32 (f64 with f64 rows); absent parameters, absent gradients.
LayoutGrads grad_buffers(const LayoutProblem& problem, megamoe_dtype_t dtype, megamoe_dtype_t row_dtype) {
    const int64_t T = problem.base.num_tokens, H = problem.base.hidden, E = problem.base.num_experts;
    const int64_t I = problem.base.intermediate;
    const auto optional = [&](const HostTensor& param, std::vector<int64_t> dims) {
        return present(param) ? HostTensor(dtype, std::move(dims)) : HostTensor();
    };
    return {HostTensor(),
            HostTensor(row_dtype, {T, H}),
            HostTensor(row_dtype == kF64 ? kF64 : kF32, {T, problem.base.topk}),
            HostTensor(dtype, problem.w13_shape()),
            optional(problem.w3, problem.w13_shape()),
            HostTensor(dtype, dims_of(problem.w2.view)),
            optional(problem.b13, {E, 2 * I}),
            optional(problem.b2, {E, H})};
}

std::vector<HostTensor*> grads_of(LayoutGrads& grads) {
    return {&grads.dx, &grads.dweights, &grads.dw13, &grads.dw3, &grads.dw2, &grads.db13, &grads.db2};
}

struct BackwardOptions {
    const HostTensor* saved_h = nullptr;  // bf16, keep-h mode; NULL: recompute
    megamoe_dtype_t grad_dtype = kBf16;
    bool accumulate = false;  // the buffers start as `initial` and the gradients are added into them
    const LayoutGrads* initial = nullptr;
    std::vector<bool> wanted = std::vector<bool>(7, true);  // per grads_of entry
};

// The CUDA backward of the device twin, twice (outputs poisoned, or reset to `initial`, before each run; bitwise
// equal reruns).
LayoutGrads cuda_backward(const LayoutProblem& device, const BackwardOptions& options) {
    LayoutGrads host = options.initial != nullptr ? *options.initial : grad_buffers(device, options.grad_dtype, kBf16);
    megamoe_backward_params_t p = device.backward_params(host);
    p.accumulate_weight_grads = options.accumulate ? 1 : 0;
    HostTensor h_copy;
    if (options.saved_h != nullptr) {
        h_copy = *options.saved_h;
        p.saved_h = h_copy.view;
    }
    std::vector<megamoe_tensor_t*> outputs = {&p.dx, &p.dtopk_weights, &p.dw13, &p.dw3, &p.dw2, &p.db13, &p.db2};
    for (size_t idx = 0; idx < outputs.size(); ++idx) {
        if (!options.wanted[idx]) *outputs[idx] = megamoe_tensor_t{};
    }
    DeviceViews views;
    for (megamoe_tensor_t* view : {&p.dy, &p.x, &p.topk_ids, &p.topk_weights, &p.w13, &p.w3, &p.w2, &p.b13, &p.b2}) {
        views.upload(view);
    }
    DeviceTensor* h_dev = views.upload(&p.saved_h);
    std::vector<DeviceTensor*> out_dev;
    for (megamoe_tensor_t* view : outputs) out_dev.push_back(views.upload(view));
    DeviceTensor workspace;
    bind_workspace(p, megamoe_backward_workspace_size, workspace);
    megamoe_path_t path = MEGAMOE_PATH_REFERENCE;
    EXPECT_EQ(megamoe_backward_path(&p, &path), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
    if (expect_sm90(device)) {  // the weight gradients may stay portable (their own conditions)
        EXPECT_TRUE(path == MEGAMOE_PATH_SM90 || path == MEGAMOE_PATH_SM90_PORTABLE_WEIGHT_GRADS) << path;
    } else {
        EXPECT_EQ(path, MEGAMOE_PATH_CUDA_PORTABLE) << megamoe_path_reason();
    }
    LayoutGrads first;
    for (int run = 0; run < 2; ++run) {
        std::vector<HostTensor*> initial = grads_of(host);
        for (size_t idx = 0; idx < out_dev.size(); ++idx) {
            if (out_dev[idx] == nullptr) continue;
            if (options.accumulate && idx >= 2) {  // the weight gradients' buffers start as `initial`
                expect_cuda(cudaMemcpy(out_dev[idx]->view().data, initial[idx]->view.data,
                                       initial[idx]->bytes.size() - 1, cudaMemcpyHostToDevice),
                            "initial");
            } else {
                out_dev[idx]->poison();
            }
        }
        if (h_dev != nullptr) {
            expect_cuda(
                cudaMemcpy(h_dev->view().data, h_copy.view.data, h_copy.bytes.size() - 1, cudaMemcpyHostToDevice),
                "saved_h");
        }
        workspace.poison();
        expect_cuda(cudaDeviceSynchronize(), "poison");
        EXPECT_EQ(megamoe_backward(&p), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
        expect_cuda(cudaDeviceSynchronize(), "backward");
        LayoutGrads got;
        std::vector<HostTensor*> got_grads = grads_of(got);
        for (size_t idx = 0; idx < out_dev.size(); ++idx) {
            if (out_dev[idx] != nullptr) *got_grads[idx] = out_dev[idx]->download();
        }
        if (run == 0) {
            first = got;
            continue;
        }
        std::vector<HostTensor*> first_grads = grads_of(first);
        for (size_t idx = 0; idx < out_dev.size(); ++idx) {
            EXPECT_TRUE(same_bytes(*got_grads[idx], *first_grads[idx])) << "gradient " << idx << ": rerun differs";
        }
    }
    return first;
}

// The CPU reference backward of the f64 twin reading h = the CUDA forward's (f64 of its bf16 values), every gradient.
LayoutGrads reference_backward(const LayoutProblem& f64, const HostTensor& cuda_h) {
    LayoutGrads ref = grad_buffers(f64, kF64, kF64);
    megamoe_backward_params_t p = f64.backward_params(ref);
    HostTensor h64 = converted(cuda_h, kF64);
    p.saved_h = h64.view;
    EXPECT_EQ(megamoe_backward(&p), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
    return ref;
}

void expect_grads_near(const LayoutGrads& got, const LayoutGrads& want, const HostTensor& ds_scale,
                       const std::string& what) {
    expect_near_reference(got.dx, want.dx, what + " dx");
    expect_near_reference(got.dweights, want.dweights, what + " d topk_weights", &ds_scale);
    expect_near_reference(got.dw13, want.dw13, what + " dw13");
    expect_near_reference(got.dw3, want.dw3, what + " dw3");
    expect_near_reference(got.dw2, want.dw2, what + " dw2");
    expect_near_reference(got.db13, want.db13, what + " db13");
    expect_near_reference(got.db2, want.db2, what + " db2");
}

void every_combination_matches_the_reference() {
    std::mt19937_64 rng(fresh_seed());
    SCOPED_TRACE("seed " + std::to_string(fresh_seed()));
    for (const RaggedShape& shape : kShapes) {
        for (const LayoutCase& c : all_layout_cases()) {
            const std::string what = std::string(shape.name) + ", " + describe(c);
            SCOPED_TRACE(what);
            const Twins twins = make_twins(shape, c, rng);
            const ForwardOut keep = cuda_forward(twins.device, true);
            const ForwardOut plain = cuda_forward(twins.device, false);
            EXPECT_TRUE(same_bytes(keep.y, plain.y)) << "y with and without saved_h differ";

            const int64_t S = shape.num_tokens * shape.topk, I = shape.intermediate;
            HostTensor y_ref(kF64, {shape.num_tokens, shape.hidden}), h_ref(kF64, {S, 2 * I});
            megamoe_forward_params_t forward = twins.f64.forward_params(y_ref);
            forward.saved_h = h_ref.view;
            ASSERT_EQ(megamoe_forward(&forward), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
            expect_near_reference(keep.y, y_ref, what + " y");
            const int64_t rows = routed_slots(twins.f64);
            expect_near_reference(leading_rows(keep.h, rows), leading_rows(h_ref, rows), what + " saved_h");

            BackwardOptions options;
            options.saved_h = &keep.h;
            const LayoutGrads kept = cuda_backward(twins.device, options);
            options.saved_h = nullptr;
            const LayoutGrads recomputed = cuda_backward(twins.device, options);
            const LayoutGrads want = reference_backward(twins.f64, keep.h);
            const LayoutGrads naive = twins.f64.naive();
            expect_grads_near(kept, want, naive.ds_scale, what + " keep-h");
            LayoutGrads kept_copy = kept, recomputed_copy = recomputed;
            const std::vector<HostTensor*> a = grads_of(kept_copy), b = grads_of(recomputed_copy);
            for (size_t idx = 0; idx < a.size(); ++idx) {
                EXPECT_TRUE(same_bytes(*a[idx], *b[idx])) << what << ": keep-h and recompute differ, gradient " << idx;
            }
        }
    }
}

TEST(LayoutsCuda, EveryCombinationMatchesTheReference) {
    SKIP_WITHOUT_CUDA();
    every_combination_matches_the_reference();
}

TEST(LayoutsCuda, EveryCombinationOnThePortablePath) {
    SKIP_WITHOUT_CUDA();
    const ScopedEnv portable("MEGAMOE_DISABLE_SM90", "1");
    every_combination_matches_the_reference();
}

// Weight gradients added into f32 buffers (accumulate_weight_grads): buffer + gradient, and the experts without rows
// (the odd ones here) left bitwise as they were; also with f32 gradients written (not accumulated).
void accumulated_and_f32_weight_gradients() {
    std::mt19937_64 rng(fresh_seed());
    SCOPED_TRACE("seed " + std::to_string(fresh_seed()));
    const RaggedShape shape = {"empty experts", 23, 40, 24, 6, 2, Routing::kHalfEmpty};
    for (const LayoutCase& c : all_layout_cases()) {
        const std::string what = describe(c);
        const Twins twins = make_twins(shape, c, rng);
        const ForwardOut keep = cuda_forward(twins.device, true);
        const LayoutGrads want = reference_backward(twins.f64, keep.h);
        const LayoutGrads naive = twins.f64.naive();
        BackwardOptions options;
        options.saved_h = &keep.h;
        options.grad_dtype = kF32;
        expect_grads_near(cuda_backward(twins.device, options), want, naive.ds_scale, what + " f32");

        LayoutGrads initial = grad_buffers(twins.device, kF32, kBf16);
        for (HostTensor* grad : {&initial.dw13, &initial.dw3, &initial.dw2, &initial.db13, &initial.db2}) {
            if (present(*grad)) grad->fill_random(rng, 1.0);
        }
        options.accumulate = true;
        options.initial = &initial;
        LayoutGrads summed = cuda_backward(twins.device, options);
        const std::vector<HostTensor*> got = {&summed.dw13, &summed.dw3, &summed.dw2, &summed.db13, &summed.db2};
        const std::vector<const HostTensor*> start = {&initial.dw13, &initial.dw3, &initial.dw2, &initial.db13,
                                                      &initial.db2};
        const std::vector<const HostTensor*> fresh = {&want.dw13, &want.dw3, &want.dw2, &want.db13, &want.db2};
        for (size_t idx = 0; idx < got.size(); ++idx) {
            if (!present(*fresh[idx])) continue;
            HostTensor added(kF64, dims_of(got[idx]->view));
            const int64_t per_expert = added.size() / shape.num_experts;
            for (int64_t elem = 0; elem < added.size(); ++elem) {
                added.set(elem, got[idx]->get(elem) - start[idx]->get(elem));
                if ((elem / per_expert) % 2 == 1) {
                    ASSERT_EQ(got[idx]->get(elem), start[idx]->get(elem)) << what << ": an empty expert's buffer moved";
                }
            }
            expect_near_reference(added, *fresh[idx], what + " accumulated gradient " + std::to_string(idx));
        }
    }
}

TEST(LayoutsCuda, AccumulatedAndF32WeightGradients) {
    SKIP_WITHOUT_CUDA();
    accumulated_and_f32_weight_gradients();
    const ScopedEnv portable("MEGAMOE_DISABLE_SM90", "1");
    accumulated_and_f32_weight_gradients();
}

// Each gradient asked for alone is bitwise the one of the full backward (the others are skipped, not needed).
TEST(LayoutsCuda, OnlyTheWantedGradients) {
    SKIP_WITHOUT_CUDA();
    std::mt19937_64 rng(fresh_seed());
    const RaggedShape shape = kShapes[0];
    for (const LayoutCase& c : all_layout_cases()) {
        const Twins twins = make_twins(shape, c, rng);
        BackwardOptions options;
        LayoutGrads full = cuda_backward(twins.device, options);
        const std::vector<HostTensor*> full_grads = grads_of(full);
        for (size_t wanted = 0; wanted < full_grads.size(); ++wanted) {
            if (!present(*full_grads[wanted])) continue;
            options.wanted = std::vector<bool>(full_grads.size(), false);
            options.wanted[wanted] = true;
            LayoutGrads alone = cuda_backward(twins.device, options);
            EXPECT_TRUE(same_bytes(*grads_of(alone)[wanted], *full_grads[wanted]))
                << describe(c) << ": gradient " << wanted << " alone differs from the full backward's";
        }
    }
}

// Grouped rows: rows sorted by expert (an empty expert, padding rows past the counts' sum), scores, every option.
void grouped_rows_match_the_reference() {
    std::mt19937_64 rng(fresh_seed());
    SCOPED_TRACE("seed " + std::to_string(fresh_seed()));
    const int64_t H = 40, I = 24, E = 4, R = 20;
    const std::vector<int64_t> counts = {5, 0, 9, 3};  // 17 rows, 3 of padding
    const int64_t valid_rows = 17;
    for (const LayoutCase& c : all_layout_cases()) {
        const std::string what = describe(c);
        const Twins twins = make_twins({"weights", 1, H, I, E, 1, Routing::kRandom}, c, rng);
        HostTensor x(kF64, {R, H}), dout(kF64, {R, H}), scores(kF64, {R}), tpe(MEGAMOE_DTYPE_I64, {E});
        x.fill_random(rng, 0.5);
        dout.fill_random(rng, 1.0);
        scores.fill_random(rng, 1.0);
        round_through(x, kBf16);
        round_through(dout, kBf16);
        round_through(scores, kF32);
        for (int64_t e = 0; e < E; ++e) tpe.set(e, static_cast<double>(counts[static_cast<size_t>(e)]));

        // CUDA forward with saved_h, twice (poisoned, bitwise).
        HostTensor out(kBf16, {R, H}), h(kBf16, {R, 2 * I});
        megamoe_grouped_forward_params_t fwd{};
        HostTensor x16 = converted(x, kBf16), s32 = converted(scores, kF32), dout16 = converted(dout, kBf16);
        fwd.x_sorted = x16.view;
        fwd.tokens_per_expert = tpe.view;
        fwd.scores = s32.view;
        fwd.out = out.view;
        fwd.saved_h = h.view;
        twins.device.set_experts(&fwd.w13, &fwd.w3, &fwd.w2, &fwd.b13, &fwd.b2, &fwd.layout, &fwd.activation);
        DeviceViews views;
        for (megamoe_tensor_t* view :
             {&fwd.x_sorted, &fwd.tokens_per_expert, &fwd.scores, &fwd.w13, &fwd.w3, &fwd.w2, &fwd.b13, &fwd.b2}) {
            views.upload(view);
        }
        DeviceTensor* out_dev = views.upload(&fwd.out);
        DeviceTensor* h_dev = views.upload(&fwd.saved_h);
        DeviceTensor workspace;
        bind_workspace(fwd, megamoe_grouped_forward_workspace_size, workspace);
        HostTensor out_first, h_first;
        for (int run = 0; run < 2; ++run) {
            out_dev->poison();
            h_dev->poison();
            expect_cuda(cudaDeviceSynchronize(), "poison");
            ASSERT_EQ(megamoe_grouped_forward(&fwd), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
            expect_cuda(cudaDeviceSynchronize(), "grouped forward");
            if (run == 0) {
                out_first = out_dev->download();
                h_first = h_dev->download();
            } else {
                EXPECT_TRUE(same_bytes(out_dev->download(), out_first)) << what << ": out rerun differs";
            }
        }
        HostTensor out_ref(kF64, {R, H}), h_ref(kF64, {R, 2 * I});
        megamoe_grouped_forward_params_t ref = fwd;
        ref.x_sorted = x.view;
        ref.tokens_per_expert = tpe.view;
        ref.scores = scores.view;
        ref.out = out_ref.view;
        ref.saved_h = h_ref.view;
        ref.workspace = nullptr;
        ref.workspace_bytes = 0;
        twins.f64.set_experts(&ref.w13, &ref.w3, &ref.w2, &ref.b13, &ref.b2, &ref.layout, &ref.activation);
        ASSERT_EQ(megamoe_grouped_forward(&ref), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
        expect_near_reference(out_first, out_ref, what + " out");
        expect_near_reference(leading_rows(h_first, valid_rows), leading_rows(h_ref, valid_rows), what + " saved_h");

        // Backward (keep-h with the CUDA h) against the reference reading that same h.
        LayoutGrads dev_grads = grad_buffers(twins.device, kBf16, kBf16),
                    ref_grads = grad_buffers(twins.f64, kF64, kF64);
        HostTensor dx(kBf16, {R, H}), ds(kF32, {R}), dx_ref(kF64, {R, H}), ds_ref(kF64, {R});
        megamoe_grouped_backward_params_t bwd{};
        bwd.dout = dout16.view;
        bwd.x_sorted = x16.view;
        bwd.tokens_per_expert = tpe.view;
        bwd.scores = s32.view;
        bwd.saved_h = h_first.view;
        bwd.dx_sorted = dx.view;
        bwd.dscores = ds.view;
        const auto bind_grads = [](megamoe_grouped_backward_params_t& p, LayoutGrads& g) {
            p.dw13 = g.dw13.view;
            p.dw2 = g.dw2.view;
            if (present(g.dw3)) p.dw3 = g.dw3.view;
            if (present(g.db13)) p.db13 = g.db13.view;
            if (present(g.db2)) p.db2 = g.db2.view;
        };
        megamoe_grouped_backward_params_t bwd_ref = bwd;
        bind_grads(bwd, dev_grads);
        twins.device.set_experts(&bwd.w13, &bwd.w3, &bwd.w2, &bwd.b13, &bwd.b2, &bwd.layout, &bwd.activation);
        HostTensor h64 = converted(h_first, kF64);
        bwd_ref.dout = dout.view;
        bwd_ref.x_sorted = x.view;
        bwd_ref.scores = scores.view;
        bwd_ref.saved_h = h64.view;
        bwd_ref.dx_sorted = dx_ref.view;
        bwd_ref.dscores = ds_ref.view;
        bind_grads(bwd_ref, ref_grads);
        twins.f64.set_experts(&bwd_ref.w13, &bwd_ref.w3, &bwd_ref.w2, &bwd_ref.b13, &bwd_ref.b2, &bwd_ref.layout,
                              &bwd_ref.activation);
        ASSERT_EQ(megamoe_grouped_backward(&bwd_ref), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();

        DeviceViews bviews;
        for (megamoe_tensor_t* view : {&bwd.dout, &bwd.x_sorted, &bwd.tokens_per_expert, &bwd.scores, &bwd.w13, &bwd.w3,
                                       &bwd.w2, &bwd.b13, &bwd.b2}) {
            bviews.upload(view);
        }
        DeviceTensor* saved = bviews.upload(&bwd.saved_h);
        std::vector<megamoe_tensor_t*> outputs = {&bwd.dx_sorted, &bwd.dscores, &bwd.dw13, &bwd.dw3,
                                                  &bwd.dw2,       &bwd.db13,    &bwd.db2};
        std::vector<DeviceTensor*> out_devs;
        for (megamoe_tensor_t* view : outputs) out_devs.push_back(bviews.upload(view));
        DeviceTensor bworkspace;
        bind_workspace(bwd, megamoe_grouped_backward_workspace_size, bworkspace);
        std::vector<HostTensor> first;
        for (int run = 0; run < 2; ++run) {
            for (DeviceTensor* dev : out_devs) {
                if (dev != nullptr) dev->poison();
            }
            expect_cuda(
                cudaMemcpy(saved->view().data, h_first.view.data, h_first.bytes.size() - 1, cudaMemcpyHostToDevice),
                "saved_h");
            expect_cuda(cudaDeviceSynchronize(), "poison");
            ASSERT_EQ(megamoe_grouped_backward(&bwd), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
            expect_cuda(cudaDeviceSynchronize(), "grouped backward");
            for (size_t idx = 0; idx < out_devs.size(); ++idx) {
                const HostTensor got = out_devs[idx] != nullptr ? out_devs[idx]->download() : HostTensor();
                if (run == 0) {
                    first.push_back(got);
                } else {
                    EXPECT_TRUE(same_bytes(got, first[idx])) << what << ": gradient " << idx << " rerun differs";
                }
            }
        }
        expect_near_reference(first[0], dx_ref, what + " dx_sorted");
        HostTensor ds_scale(kF64, {R});  // |d scores| of the size of the dot's terms: |dout| |o| per row
        for (int64_t r = 0; r < R; ++r) {
            double dout_norm = 0.0, out_norm = 0.0;
            for (int64_t col = 0; col < H; ++col) {
                dout_norm += dout.get(r * H + col) * dout.get(r * H + col);
                out_norm += out_ref.get(r * H + col) * out_ref.get(r * H + col);
            }
            ds_scale.set(r, std::sqrt(dout_norm * out_norm) / std::max(std::fabs(scores.get(r)), 1e-3));
        }
        expect_near_reference(first[1], ds_ref, what + " d scores", &ds_scale);
        const std::vector<const HostTensor*> want = {&ref_grads.dw13, &ref_grads.dw3, &ref_grads.dw2, &ref_grads.db13,
                                                     &ref_grads.db2};
        for (size_t idx = 0; idx < want.size(); ++idx) {
            expect_near_reference(first[idx + 2], *want[idx], what + " weight gradient " + std::to_string(idx));
        }
    }
}

TEST(LayoutsCuda, GroupedRowsMatchTheReference) {
    SKIP_WITHOUT_CUDA();
    grouped_rows_match_the_reference();
    const ScopedEnv portable("MEGAMOE_DISABLE_SM90", "1");
    grouped_rows_match_the_reference();
}

// The options the sm_90a kernels take (all of them) report sm90 on a Hopper GPU with no reason (elsewhere the portable
// path, with no reason); what moves a call off them (here a misaligned w3 of the separate layout) is named by
// megamoe_path_reason.
TEST(LayoutsCuda, PathReasonNamesTheOption) {
    SKIP_WITHOUT_CUDA();
    std::mt19937_64 rng(fresh_seed());
    std::string skip_reason;
    const bool sm90 = sm90_available(&skip_reason);
    const RaggedShape shape = {"aligned", 16, 64, 32, 4, 2, Routing::kRandom};
    const struct {
        LayoutCase layout_case;
        const char* option;
        bool misaligned_w3;  // w3 one element past its allocation's start
    } cases[] = {
        {{MEGAMOE_GATE_UP_CONCATENATED, false, false, false, false}, nullptr, false},
        {{MEGAMOE_GATE_UP_SEPARATE, false, false, false, false}, nullptr, false},
        {{MEGAMOE_GATE_UP_INTERLEAVED, false, false, false, false}, nullptr, false},
        {{MEGAMOE_GATE_UP_CONCATENATED, true, false, false, false}, nullptr, false},
        {{MEGAMOE_GATE_UP_CONCATENATED, false, true, false, false}, nullptr, false},
        {{MEGAMOE_GATE_UP_CONCATENATED, false, false, true, false}, nullptr, false},
        {{MEGAMOE_GATE_UP_CONCATENATED, false, false, false, true}, nullptr, false},
        {{MEGAMOE_GATE_UP_INTERLEAVED, true, true, true, true}, nullptr, false},  // gpt-oss
        {{MEGAMOE_GATE_UP_SEPARATE, true, true, true, true}, nullptr, false},
        {{MEGAMOE_GATE_UP_SEPARATE, false, false, false, false}, "w3 not 16-byte aligned", true},
        {{MEGAMOE_GATE_UP_SEPARATE, true, true, true, true}, "w3 not 16-byte aligned", true},
    };
    for (const auto& c : cases) {
        const Twins twins = make_twins(shape, c.layout_case, rng);
        HostTensor y(kBf16, {shape.num_tokens, shape.hidden});
        megamoe_forward_params_t p = twins.device.forward_params(y);
        DeviceViews views;
        for (megamoe_tensor_t* view : {&p.x, &p.topk_ids, &p.topk_weights, &p.w13, &p.w2, &p.b13, &p.b2, &p.y}) {
            views.upload(view);
        }
        DeviceTensor w3;  // separate only: aligned, or misaligned_w3
        if (p.w3.data != nullptr) {
            w3 = DeviceTensor(p.w3, c.misaligned_w3 ? 1 : 0);
            expect_cuda(cudaMemcpy(w3.view().data, p.w3.data, static_cast<size_t>(numel(p.w3)) * dtype_size(p.w3.dtype),
                                   cudaMemcpyHostToDevice),
                        "upload w3");
            p.w3 = w3.view();
        }
        megamoe_path_t path = MEGAMOE_PATH_REFERENCE;
        ASSERT_EQ(megamoe_forward_path(&p, &path), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
        const std::string reason = megamoe_path_reason();
        if (c.option == nullptr) {
            EXPECT_EQ(path, sm90 ? MEGAMOE_PATH_SM90 : MEGAMOE_PATH_CUDA_PORTABLE);
            EXPECT_EQ(reason, "");
            continue;
        }
        EXPECT_EQ(path, MEGAMOE_PATH_CUDA_PORTABLE) << c.option;
        if (sm90) {
            EXPECT_NE(reason.find(c.option), std::string::npos) << reason;
        } else {
            EXPECT_EQ(reason, "") << "no sm_90a device: the option is not what keeps the call off the sm_90a kernels";
        }
    }
}

}  // namespace
}  // namespace megamoe::test
