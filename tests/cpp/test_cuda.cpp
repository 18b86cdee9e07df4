// The portable CUDA path through the C API, against the same C API on CPU tensors (the reference,
// f64 accumulation) on ragged problems: experts with zero tokens, all tokens on one expert, topk = 1,
// T = 1, dropped slots, E = 1, thousands of experts, H / I / T that are not multiples of 8 / 64 / 128,
// and ids outside [-1, E) (their tokens must come back as NaN rows). Every output is poisoned with
// NaN bytes before each run, every run is done twice and must be bitwise equal, and a CUDA graph
// capture of forward + backward must replay to the same bits. Without a GPU every test skips.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "cuda_test_util.h"
#include "test_util.h"

namespace megamoe::test {
namespace {

// Relative Frobenius error bound of every output against the f64 reference. bf16 keeps 8 mantissa
// bits (unit roundoff 2^-9 ~ 2e-3); the CUDA path rounds inputs and intermediates (a, h = [g, u],
// dh, s * a) to the element type, so a few roundings stack up: 2e-2 leaves a safe margin while any
// real bug (a wrong row, a missing slot, a transposed operand) gives errors of order 1.
constexpr double kBf16Tolerance = 2e-2;
// f16 keeps 11 mantissa bits: the same reasoning with 8x smaller roundings.
constexpr double kF16Tolerance = 4e-3;

// Relative Frobenius error of `got` against `want`, skipping the rows listed in `nan_rows` (rows of
// row_len elements), which must be NaN in every element instead. The error is relative to the norm of
// `scale` when given (one entry per element), else to the norm of `want`.
void expect_close(const HostTensor& got, const HostTensor& want, int64_t row_len, const std::vector<int64_t>& nan_rows,
                  double tolerance, const std::string& what, const std::vector<double>* scale = nullptr) {
    ASSERT_EQ(got.size(), want.size()) << what;
    double diff = 0.0, norm = 0.0;
    for (int64_t idx = 0; idx < want.size(); ++idx) {
        const int64_t row = row_len > 0 ? idx / row_len : 0;
        if (std::find(nan_rows.begin(), nan_rows.end(), row) != nan_rows.end()) {
            ASSERT_TRUE(std::isnan(got.get(idx))) << what << "[" << idx << "] of an invalid token is not NaN";
            continue;
        }
        const double delta = got.get(idx) - want.get(idx);
        const double size = scale != nullptr ? (*scale)[static_cast<size_t>(idx)] : want.get(idx);
        diff += delta * delta;
        norm += size * size;
    }
    const double error = norm > 0.0 ? std::sqrt(diff / norm) : std::sqrt(diff);
    EXPECT_LT(error, tolerance) << what << ": relative Frobenius error vs the CPU reference";
}

struct CudaCase {
    const char* name;
    int64_t num_tokens, hidden, intermediate, num_experts, topk;
    Routing routing = Routing::kRandom;
    megamoe_dtype_t dtype = MEGAMOE_DTYPE_BF16;
    megamoe_dtype_t id_dtype = MEGAMOE_DTYPE_I32;
    bool weights_in_dtype = false;        // topk_weights in the element type instead of f32
    bool weight_grads_f32 = false;        // dw13 / dw2 in f32 instead of the element type
    bool dtopk_in_weights_dtype = false;  // d topk_weights in topk_weights' dtype instead of f32
    std::vector<int64_t> invalid_tokens;  // tokens whose slot 0 holds an id outside [-1, E)
};

std::ostream& operator<<(std::ostream& os, const CudaCase& c) {
    return os << c.name << " (T=" << c.num_tokens << " H=" << c.hidden << " I=" << c.intermediate
              << " E=" << c.num_experts << " topk=" << c.topk << ", seed " << fresh_seed() << ")";
}

// The problem the GPU sees and the one the reference sees (invalid ids replaced by -1).
std::pair<Problem, Problem> make_problems(const CudaCase& c) {
    std::mt19937_64 rng(fresh_seed() ^ std::hash<std::string>{}(c.name));
    Problem problem{c.num_tokens, c.hidden, c.intermediate, c.num_experts, c.topk};
    problem.dtype = c.dtype;
    problem.id_dtype = c.id_dtype;
    problem.routing = c.routing;
    problem.make(rng);
    if (c.weights_in_dtype) {
        HostTensor weights(c.dtype, {c.num_tokens, c.topk});
        for (int64_t idx = 0; idx < weights.size(); ++idx) weights.set(idx, problem.weights.get(idx));
        problem.weights = weights;
    }
    Problem reference = problem;
    for (int64_t token_idx : c.invalid_tokens) {
        reference.ids.set(token_idx * c.topk, -1);
        problem.ids.set(token_idx * c.topk, token_idx % 2 == 0 ? c.num_experts + token_idx : -2 - token_idx);
    }
    return {problem, reference};
}

struct Outputs {
    HostTensor y, dx, dtopk, dw13, dw2;
};

struct OutputDtypes {
    megamoe_dtype_t dtopk, weight_grads;
};

OutputDtypes output_dtypes(const CudaCase& c, const Problem& problem) {
    return {c.dtopk_in_weights_dtype ? problem.weights.view.dtype : MEGAMOE_DTYPE_F32,
            c.weight_grads_f32 ? MEGAMOE_DTYPE_F32 : c.dtype};
}

Outputs reference_outputs(const Problem& reference, const OutputDtypes& dtypes) {
    const int64_t T = reference.num_tokens, H = reference.hidden, I = reference.intermediate;
    const int64_t E = reference.num_experts;
    Outputs out{HostTensor(reference.dtype, {T, H}), HostTensor(reference.dtype, {T, H}),
                HostTensor(dtypes.dtopk, {T, reference.topk}), HostTensor(dtypes.weight_grads, {E, 2 * I, H}),
                HostTensor(dtypes.weight_grads, {E, H, I})};
    megamoe_forward_params_t forward = reference.forward_params(out.y);
    EXPECT_EQ(megamoe_forward(&forward), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
    megamoe_backward_params_t backward = reference.backward_params(out.dx, out.dtopk, out.dw13, out.dw2);
    EXPECT_EQ(megamoe_backward(&backward), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
    return out;
}

// Device copies of a problem's inputs and outputs, plus the C API params that point at them.
struct DeviceProblem {
    DeviceTensor x, ids, weights, w13, w2, dy;
    DeviceTensor y, dx, dtopk, dw13, dw2;
    DeviceTensor forward_workspace, backward_workspace;
    megamoe_forward_params_t forward{};
    megamoe_backward_params_t backward{};

    // offset: element offset of every tensor's data in its allocation (1 = misaligned views).
    DeviceProblem(const Problem& problem, const OutputDtypes& dtypes, cudaStream_t stream, int64_t offset = 0)
        : x(DeviceTensor::upload(problem.x, offset)),
          ids(DeviceTensor::upload(problem.ids, offset)),
          weights(DeviceTensor::upload(problem.weights, offset)),
          w13(DeviceTensor::upload(problem.w13, offset)),
          w2(DeviceTensor::upload(problem.w2, offset)),
          dy(DeviceTensor::upload(problem.dy, offset)),
          y(problem.x.view, offset),
          dx(problem.x.view, offset),
          dtopk(HostTensor(dtypes.dtopk, {problem.num_tokens, problem.topk}).view, offset),
          dw13(HostTensor(dtypes.weight_grads, {problem.num_experts, 2 * problem.intermediate, problem.hidden}).view,
               offset),
          dw2(HostTensor(dtypes.weight_grads, {problem.num_experts, problem.hidden, problem.intermediate}).view,
              offset) {
        forward.x = x.view();
        forward.topk_ids = ids.view();
        forward.topk_weights = weights.view();
        forward.w13 = w13.view();
        forward.w2 = w2.view();
        forward.y = y.view();
        forward.stream = stream;
        backward.dy = dy.view();
        backward.x = x.view();
        backward.topk_ids = ids.view();
        backward.topk_weights = weights.view();
        backward.w13 = w13.view();
        backward.w2 = w2.view();
        backward.dx = dx.view();
        backward.dtopk_weights = dtopk.view();
        backward.dw13 = dw13.view();
        backward.dw2 = dw2.view();
        backward.stream = stream;
        bind_workspace(forward, megamoe_forward_workspace_size, forward_workspace);
        bind_workspace(backward, megamoe_backward_workspace_size, backward_workspace);
    }

    // NaN bytes into every output and both workspaces (nothing may rely on zeroed memory).
    void poison() {
        for (DeviceTensor* tensor : {&y, &dx, &dtopk, &dw13, &dw2, &forward_workspace, &backward_workspace}) {
            tensor->poison();
        }
        expect_cuda(cudaDeviceSynchronize(), "poison");  // cudaMemset runs on the legacy stream
    }

    Outputs run() {
        poison();
        EXPECT_EQ(megamoe_forward(&forward), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
        EXPECT_EQ(megamoe_backward(&backward), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
        expect_cuda(cudaDeviceSynchronize(), "run");
        return download();
    }

    Outputs download() const {
        return {y.download(), dx.download(), dtopk.download(), dw13.download(), dw2.download()};
    }
};

void expect_bitwise_equal(const Outputs& first, const Outputs& second, const std::string& what) {
    EXPECT_EQ(first.y.bytes, second.y.bytes) << what << ": y differs between runs";
    EXPECT_EQ(first.dx.bytes, second.dx.bytes) << what << ": dx differs between runs";
    EXPECT_EQ(first.dtopk.bytes, second.dtopk.bytes) << what << ": dtopk_weights differs between runs";
    EXPECT_EQ(first.dw13.bytes, second.dw13.bytes) << what << ": dw13 differs between runs";
    EXPECT_EQ(first.dw2.bytes, second.dw2.bytes) << what << ": dw2 differs between runs";
}

void check_case(const CudaCase& c, int64_t offset = 0) {
    SCOPED_TRACE(::testing::PrintToString(c));
    auto [problem, reference] = make_problems(c);
    const OutputDtypes dtypes = output_dtypes(c, problem);
    const Outputs want = reference_outputs(reference, dtypes);

    DeviceProblem device(problem, dtypes, nullptr, offset);
    const Outputs got = device.run();
    expect_bitwise_equal(got, device.run(), c.name);

    const double tolerance = c.dtype == MEGAMOE_DTYPE_F16 ? kF16Tolerance : kBf16Tolerance;
    expect_close(got.y, want.y, c.hidden, c.invalid_tokens, tolerance, "y");
    expect_close(got.dx, want.dx, c.hidden, c.invalid_tokens, tolerance, "dx");
    const std::vector<double> dtopk_scale = dtopk_term_scale(reference);
    expect_close(got.dtopk, want.dtopk, c.topk, c.invalid_tokens, tolerance, "dtopk_weights", &dtopk_scale);
    expect_close(got.dw13, want.dw13, 0, {}, tolerance, "dw13");
    expect_close(got.dw2, want.dw2, 0, {}, tolerance, "dw2");
}

TEST(Cuda, RaggedShapesMatchReference) {
    SKIP_WITHOUT_CUDA();
    std::vector<CudaCase> cases;
    cases.push_back({"one token, one expert, topk 1", 1, 70, 33, 1, 1});
    cases.push_back({"odd sizes, dropped slots", 37, 70, 33, 5, 2, Routing::kSomeDropped});
    cases.push_back({"E = 1, several M tiles", 300, 136, 72, 1, 1});
    cases.push_back({"hot expert, topk 3", 301, 136, 72, 16, 3, Routing::kOneExpert});
    cases.push_back({"most experts empty", 5, 64, 40, 64, 2, Routing::kHalfEmpty});
    cases.push_back({"several chunks and tiles", 520, 256, 192, 8, 2});
    cases.push_back({"ragged, aligned H only", 130, 264, 50, 6, 2, Routing::kSomeDropped});
    cases.push_back({"ragged, aligned I only", 129, 100, 136, 6, 3});
    cases.push_back({"thousands of experts", 50, 24, 16, 3000, 3});
    for (const CudaCase& c : cases) check_case(c);
}

TEST(Cuda, DtypeVariantsMatchReference) {
    SKIP_WITHOUT_CUDA();
    std::vector<CudaCase> cases;
    CudaCase f16{"f16, int64 ids", 97, 72, 48, 7, 2, Routing::kSomeDropped, MEGAMOE_DTYPE_F16, MEGAMOE_DTYPE_I64};
    cases.push_back(f16);
    cases.push_back({"f16 ragged", 61, 70, 33, 4, 2, Routing::kOneExpert, MEGAMOE_DTYPE_F16});
    CudaCase low_weights{"bf16 weights and dtopk, f32 weight grads", 64, 70, 33, 4, 2};
    low_weights.weights_in_dtype = true;
    low_weights.dtopk_in_weights_dtype = true;
    low_weights.weight_grads_f32 = true;
    cases.push_back(low_weights);
    CudaCase f16_f32_grads{"f16, f32 weight grads", 150, 128, 64, 5, 2, Routing::kRandom, MEGAMOE_DTYPE_F16};
    f16_f32_grads.weight_grads_f32 = true;
    f16_f32_grads.weights_in_dtype = true;
    cases.push_back(f16_f32_grads);
    for (const CudaCase& c : cases) check_case(c);
}

TEST(Cuda, InvalidIdsGiveNanRowsAndLeaveOthersCorrect) {
    SKIP_WITHOUT_CUDA();
    CudaCase aligned{"invalid ids, aligned", 40, 72, 48, 6, 2};
    aligned.invalid_tokens = {0, 7, 39};
    CudaCase ragged{
        "invalid ids, int64, ragged", 23, 70, 33, 3, 3, Routing::kSomeDropped, MEGAMOE_DTYPE_BF16, MEGAMOE_DTYPE_I64};
    ragged.invalid_tokens = {4, 5};
    check_case(aligned);
    check_case(ragged);
}

// Views one element past a 256-byte aligned allocation: sizes that would allow 16-byte loads and paired
// stores, with pointers that do not (the kernels must notice and take their element paths).
TEST(Cuda, MisalignedViewsMatchReference) {
    SKIP_WITHOUT_CUDA();
    CudaCase bf16{"misaligned views", 150, 136, 72, 5, 2, Routing::kSomeDropped};
    CudaCase f32_grads{"misaligned views, f32 weight grads", 70, 64, 48, 3, 3};
    f32_grads.weight_grads_f32 = true;
    check_case(bf16, 1);
    check_case(f32_grads, 1);
}

TEST(Cuda, EmptyBatch) {
    SKIP_WITHOUT_CUDA();
    const CudaCase c{"T = 0", 0, 64, 40, 4, 2};
    auto [problem, reference] = make_problems(c);
    DeviceProblem device(problem, output_dtypes(c, problem), nullptr);
    const Outputs got = device.run();
    for (int64_t idx = 0; idx < got.dw13.size(); ++idx) ASSERT_EQ(got.dw13.get(idx), 0.0) << "dw13[" << idx << "]";
    for (int64_t idx = 0; idx < got.dw2.size(); ++idx) ASSERT_EQ(got.dw2.get(idx), 0.0) << "dw2[" << idx << "]";
}

TEST(Cuda, UnwantedGradientsAreSkipped) {
    SKIP_WITHOUT_CUDA();
    const CudaCase c{"dx and dw2 not wanted", 90, 136, 72, 5, 2, Routing::kSomeDropped};
    auto [problem, reference] = make_problems(c);
    const OutputDtypes dtypes = output_dtypes(c, problem);
    const Outputs want = reference_outputs(reference, dtypes);
    DeviceProblem device(problem, dtypes, nullptr);
    device.backward.dx = megamoe_tensor_t{};
    device.backward.dw2 = megamoe_tensor_t{};
    size_t backward_bytes = 0;
    ASSERT_EQ(megamoe_backward_workspace_size(&device.backward, &backward_bytes), MEGAMOE_STATUS_SUCCESS);
    ASSERT_LE(backward_bytes, device.backward.workspace_bytes);
    device.poison();
    ASSERT_EQ(megamoe_backward(&device.backward), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
    expect_cuda(cudaDeviceSynchronize(), "backward");
    const Outputs got = device.download();
    const std::vector<double> dtopk_scale = dtopk_term_scale(reference);
    expect_close(got.dtopk, want.dtopk, c.topk, {}, kBf16Tolerance, "dtopk_weights", &dtopk_scale);
    expect_close(got.dw13, want.dw13, 0, {}, kBf16Tolerance, "dw13");
    for (int64_t idx = 0; idx < got.dx.size(); ++idx) ASSERT_TRUE(std::isnan(got.dx.get(idx))) << "dx was written";
}

// Forward + backward captured into a CUDA graph on a side stream replay to the eager bits: the path
// never synchronises with the host and never allocates.
TEST(Cuda, GraphCaptureReplaysBitwise) {
    SKIP_WITHOUT_CUDA();
    const CudaCase c{"graph capture", 200, 136, 72, 6, 2, Routing::kSomeDropped};
    auto [problem, reference] = make_problems(c);
    cudaStream_t stream = nullptr;
    expect_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    {
        DeviceProblem device(problem, output_dtypes(c, problem), stream);
        const Outputs eager = device.run();
        expect_graph_replays(
            stream,
            [&] {
                const std::string forward_error = failure_message(megamoe_forward(&device.forward), "forward");
                return forward_error + failure_message(megamoe_backward(&device.backward), "backward");
            },
            [&] { device.poison(); }, [&] { expect_bitwise_equal(eager, device.download(), "graph replay"); });
    }
    cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace megamoe::test
