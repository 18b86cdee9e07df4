// Helpers shared by the CUDA tests: device detection, checked CUDA calls, device tensors shaped like
// host ones (optionally misaligned views), NaN poisoning, and workspaces.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <numeric>
#include <ostream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "common.h"
#include "device_fill.h"
#include "test_util.h"

namespace megamoe::test {

inline bool cuda_available() {
    int num_devices = 0;
    return cudaGetDeviceCount(&num_devices) == cudaSuccess && num_devices > 0;
}

#define SKIP_WITHOUT_CUDA() \
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device: the CUDA path tests need a GPU"

inline void expect_cuda(cudaError_t err, const char* what) {
    EXPECT_EQ(err, cudaSuccess) << what << ": " << cudaGetErrorString(err);
}

// Device memory holding a tensor shaped like a host one (contiguous), with its CUDA view.
class DeviceTensor {
  public:
    DeviceTensor() = default;
    // `offset_elements` > 0 places the data that many elements past the allocation's start, so a
    // 2-byte element type gets a view that is not 16-, 8- or 4-byte aligned.
    explicit DeviceTensor(const megamoe_tensor_t& like, int64_t offset_elements = 0) : view_(like) {
        num_bytes_ = static_cast<size_t>(numel(like)) * dtype_size(like.dtype);
        const size_t offset_bytes = static_cast<size_t>(offset_elements) * dtype_size(like.dtype);
        expect_cuda(cudaMalloc(&allocation_, std::max<size_t>(num_bytes_ + offset_bytes, 256)), "cudaMalloc");
        data_ = static_cast<char*>(allocation_) + offset_bytes;
        view_.data = data_;
        view_.device_type = MEGAMOE_DEVICE_CUDA;
        expect_cuda(cudaGetDevice(&view_.device_index), "cudaGetDevice");
    }
    static DeviceTensor upload(const HostTensor& host, int64_t offset_elements = 0) {
        DeviceTensor tensor(host.view, offset_elements);
        expect_cuda(cudaMemcpy(tensor.data_, host.view.data, tensor.num_bytes_, cudaMemcpyHostToDevice), "upload");
        return tensor;
    }
    DeviceTensor(DeviceTensor&& other) noexcept { *this = std::move(other); }
    DeviceTensor& operator=(DeviceTensor&& other) noexcept {
        std::swap(allocation_, other.allocation_);
        std::swap(data_, other.data_);
        std::swap(num_bytes_, other.num_bytes_);
        std::swap(view_, other.view_);
        return *this;
    }
    DeviceTensor(const DeviceTensor&) = delete;
    DeviceTensor& operator=(const DeviceTensor&) = delete;
    ~DeviceTensor() {
        if (allocation_ != nullptr) cudaFree(allocation_);
    }

    const megamoe_tensor_t& view() const { return view_; }
    // 0xFF bytes: NaN in bf16, f16 and f32, so an element the library forgets to write is caught.
    void poison() { expect_cuda(cudaMemset(data_, 0xFF, num_bytes_), "poison"); }
    HostTensor download() const {
        HostTensor host(view_.dtype, std::vector<int64_t>(view_.shape, view_.shape + view_.ndim));
        expect_cuda(cudaMemcpy(host.view.data, data_, num_bytes_, cudaMemcpyDeviceToHost), "download");
        return host;
    }

  private:
    void* allocation_ = nullptr;
    void* data_ = nullptr;
    size_t num_bytes_ = 0;
    megamoe_tensor_t view_{};
};

// A workspace of num_bytes, poisoned (every byte 0xFF: NaN in every float type): a kernel reading a byte no step wrote
// turns an output NaN. compute-sanitizer initcheck cannot be that check here: it reports the rows the GEMMs write by
// TMA store (cp.async.bulk.tensor) as never written.
inline DeviceTensor device_workspace(size_t num_bytes) {
    megamoe_tensor_t like{};
    like.dtype = MEGAMOE_DTYPE_I32;  // 4-byte elements
    like.ndim = 1;
    like.shape[0] = static_cast<int64_t>((num_bytes + 3) / 4);
    like.strides[0] = 1;
    DeviceTensor workspace(like);
    workspace.poison();
    return workspace;
}

// Asks `query` (a megamoe_*_workspace_size) for the workspace of `params`, allocates it into `workspace` and points
// params at it.
template <typename Params>
void bind_workspace(Params& params, megamoe_status_t (*query)(const Params*, size_t*), DeviceTensor& workspace) {
    size_t bytes = 0;
    EXPECT_EQ(query(&params, &bytes), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
    workspace = device_workspace(bytes);
    params.workspace = workspace.view().data;
    params.workspace_bytes = bytes;
}

constexpr double kBf16Tolerance = 2e-2;  // as in test_cuda.cpp: a few bf16 roundings of the intermediates
constexpr double kF16Tolerance = 4e-3;
// Two bf16 GPU paths that differ in summation order and in where intermediates are rounded.
constexpr double kPathAgreement = 1e-2;

// True on a compute capability 9.0 device; otherwise false with the reason for the skip.
inline bool sm90_available(std::string* reason) {
    int num_devices = 0;
    if (cudaGetDeviceCount(&num_devices) != cudaSuccess || num_devices == 0) {
        cudaGetLastError();
        *reason = "no CUDA device: the sm_90a kernels need a Hopper GPU";
        return false;
    }
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess || prop.major != 9 || prop.minor != 0) {
        *reason = "device is not compute capability 9.0: the sm_90a kernels need a Hopper GPU";
        return false;
    }
    return true;
}

#define SKIP_WITHOUT_SM90()                                             \
    do {                                                                \
        std::string skip_reason;                                        \
        if (!sm90_available(&skip_reason)) GTEST_SKIP() << skip_reason; \
    } while (0)

// Sets the library's test overrides (megamoe_testing_set_overrides) for its lifetime, then restores the previous ones.
class ScopedOverrides {
  public:
    explicit ScopedOverrides(uint32_t overrides) : previous_(megamoe_testing_overrides()) {
        megamoe_testing_set_overrides(overrides);
    }
    ~ScopedOverrides() { megamoe_testing_set_overrides(previous_); }
    ScopedOverrides(const ScopedOverrides&) = delete;
    ScopedOverrides& operator=(const ScopedOverrides&) = delete;

  private:
    uint32_t previous_;
};

// Sets an environment variable for the scope (MEGAMOE_DISABLE_SM90 is read on every call).
class ScopedEnv {
  public:
    ScopedEnv(const char* name, const char* value) : name_(name) { setenv(name, value, 1); }
    ~ScopedEnv() { unsetenv(name_); }
    ScopedEnv(const ScopedEnv&) = delete;
    ScopedEnv& operator=(const ScopedEnv&) = delete;

  private:
    const char* name_;
};

// Captures `launch` (library calls on `stream`; it returns "" or the first failure's message) into a CUDA graph,
// then replays the graph twice, each time after poison() (outputs NaN again) and before check_replay() (the
// outputs against the eager run's bits).
template <typename Launch, typename Poison, typename CheckReplay>
void expect_graph_replays(cudaStream_t stream, const Launch& launch, const Poison& poison,
                          const CheckReplay& check_replay) {
    poison();
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t graph_exec = nullptr;
    expect_cuda(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), "cudaStreamBeginCapture");
    const std::string launch_error = launch();
    expect_cuda(cudaStreamEndCapture(stream, &graph), "cudaStreamEndCapture");
    ASSERT_EQ(launch_error, "") << "a library call failed during the capture";
    expect_cuda(cudaGraphInstantiate(&graph_exec, graph, 0), "cudaGraphInstantiate");
    for (int replay_idx = 0; replay_idx < 2; ++replay_idx) {
        poison();
        expect_cuda(cudaGraphLaunch(graph_exec, stream), "cudaGraphLaunch");
        expect_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
        check_replay();
    }
    cudaGraphExecDestroy(graph_exec);
    cudaGraphDestroy(graph);
}

// "" when `status` is a success, else its message (for expect_graph_replays' launch).
inline std::string failure_message(megamoe_status_t status, const char* what) {
    return status == MEGAMOE_STATUS_SUCCESS ? std::string() : std::string(what) + ": " + megamoe_last_error();
}

template <typename Params>
Shape shape_of(const Params& params) {
    return {params.x.shape[0], params.x.shape[1], params.w2.shape[2], params.w13.shape[0], params.topk_ids.shape[1]};
}

// A GPU-side random tensor (uniform with the given standard deviation): big shapes without host copies.
inline DeviceTensor device_random(megamoe_dtype_t dtype, const std::vector<int64_t>& dims, uint64_t seed,
                                  double std_dev) {
    DeviceTensor tensor(contiguous_view(dtype, dims));
    expect_cuda(device_fill_uniform(tensor.view().data, dtype, numel(tensor.view()), seed, static_cast<float>(std_dev)),
                "device_fill_uniform");
    return tensor;
}

// The reference shapes of DESIGN.md section 4.
struct ReferenceShape {
    const char* name;
    int64_t num_tokens, hidden, intermediate, num_experts, topk;
};
inline const ReferenceShape kReferenceShapes[] = {{"qwen3-30b-a3b", 16384, 2048, 768, 128, 8},
                                                  {"qwen3-235b-a22b", 16384, 4096, 1536, 128, 8},
                                                  {"deepseek-v3", 8192, 7168, 2048, 256, 8},
                                                  {"mixtral-8x7b", 8192, 4096, 14336, 8, 2}};

// Distinct random experts per token and weights in [0.05, 1): topk_ids (i32) and topk_weights (f32) on the host.
inline void random_routing(const ReferenceShape& s, std::mt19937_64& rng, HostTensor* ids, HostTensor* weights) {
    *ids = HostTensor(MEGAMOE_DTYPE_I32, {s.num_tokens, s.topk});
    *weights = HostTensor(MEGAMOE_DTYPE_F32, {s.num_tokens, s.topk});
    std::vector<int64_t> experts(static_cast<size_t>(s.num_experts));
    std::uniform_real_distribution<double> uniform(0.05, 1.0);
    for (int64_t token_idx = 0; token_idx < s.num_tokens; ++token_idx) {
        std::iota(experts.begin(), experts.end(), 0);
        for (int64_t choice_idx = 0; choice_idx < s.topk; ++choice_idx) {
            std::uniform_int_distribution<int64_t> pick(choice_idx, s.num_experts - 1);
            std::swap(experts[static_cast<size_t>(choice_idx)], experts[static_cast<size_t>(pick(rng))]);
            ids->set(token_idx * s.topk + choice_idx, static_cast<double>(experts[static_cast<size_t>(choice_idx)]));
            weights->set(token_idx * s.topk + choice_idx, uniform(rng));
        }
    }
}

// One ragged problem of the sm_90a tests.
struct Sm90Case {
    const char* name;
    int64_t num_tokens, hidden, intermediate, num_experts, topk;
    Routing routing = Routing::kRandom;
    megamoe_dtype_t dtype = MEGAMOE_DTYPE_BF16;
};

inline std::ostream& operator<<(std::ostream& os, const Sm90Case& c) {
    return os << c.name << " (T=" << c.num_tokens << " H=" << c.hidden << " I=" << c.intermediate
              << " E=" << c.num_experts << " topk=" << c.topk << ", seed " << fresh_seed() << ")";
}

// The ragged shapes every sm_90a test runs (forward and backward): T = 1, one hot expert, empty experts, dropped
// slots, sizes off every tile, more tiles than SMs, f16.
inline std::vector<Sm90Case> sm90_ragged_cases() {
    std::vector<Sm90Case> cases;
    cases.push_back({"T = 1, topk = 1, E = 1", 1, 64, 32, 1, 1});
    cases.push_back({"one expert takes every slot", 300, 136, 72, 4, 1, Routing::kOneExpert});
    cases.push_back({"hot expert, topk 3", 301, 136, 72, 16, 3, Routing::kOneExpert});
    cases.push_back({"most experts empty", 5, 64, 40, 64, 2, Routing::kHalfEmpty});
    cases.push_back({"dropped slots, N and K tails", 37, 200, 72, 5, 2, Routing::kSomeDropped});
    cases.push_back({"E = 1, several M tiles", 700, 128, 256, 1, 1});
    cases.push_back({"K tails on every GEMM, N tails", 260, 520, 200, 8, 2});
    cases.push_back({"more tiles than SMs", 2048, 64, 1024, 2, 2});
    cases.push_back({"f16, dropped slots", 97, 72, 48, 7, 2, Routing::kSomeDropped, MEGAMOE_DTYPE_F16});
    return cases;
}

inline Problem make_problem(const Sm90Case& c) {
    std::mt19937_64 rng(fresh_seed() ^ std::hash<std::string>{}(c.name));
    Problem problem{c.num_tokens, c.hidden, c.intermediate, c.num_experts, c.topk};
    problem.dtype = c.dtype;
    problem.routing = c.routing;
    problem.make(rng);
    return problem;
}

// A forward problem on the device: inputs, y, workspace, and the C API params that point at them.
struct DeviceForward {
    DeviceTensor x, ids, weights, w13, w2, y, workspace;
    megamoe_forward_params_t params{};

    void bind() {
        params.x = x.view();
        params.topk_ids = ids.view();
        params.topk_weights = weights.view();
        params.w13 = w13.view();
        params.w2 = w2.view();
        params.y = y.view();
        size_t bytes = 0;
        EXPECT_EQ(megamoe_forward_workspace_size(&params, &bytes), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
        workspace = device_workspace(bytes);
        params.workspace = workspace.view().data;
        params.workspace_bytes = bytes;
    }

    // Poisons y and the workspace, runs the forward, returns y.
    HostTensor run() {
        y.poison();
        workspace.poison();
        expect_cuda(cudaDeviceSynchronize(), "poison");
        EXPECT_EQ(megamoe_forward(&params), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
        expect_cuda(cudaDeviceSynchronize(), "forward");
        return y.download();
    }
};

inline DeviceForward upload_forward(const Problem& problem, int64_t offset = 0) {
    DeviceForward device{DeviceTensor::upload(problem.x, offset),
                         DeviceTensor::upload(problem.ids, offset),
                         DeviceTensor::upload(problem.weights, offset),
                         DeviceTensor::upload(problem.w13, offset),
                         DeviceTensor::upload(problem.w2, offset),
                         DeviceTensor(problem.x.view, offset),
                         {}};
    device.bind();
    return device;
}

// A backward's gradients downloaded.
struct BackwardGrads {
    HostTensor dx, dtopk, dw13, dw2;
};

// A backward problem on the device: inputs, gradients, workspace, and the C API params that point at them.
struct DeviceBackward {
    DeviceTensor x, ids, weights, w13, w2, dy;
    DeviceTensor dx, dtopk, dw13, dw2, workspace;
    megamoe_backward_params_t params{};

    // Points params at the tensors and sizes the workspace for them.
    void bind() {
        params.dy = dy.view();
        params.x = x.view();
        params.topk_ids = ids.view();
        params.topk_weights = weights.view();
        params.w13 = w13.view();
        params.w2 = w2.view();
        params.dx = dx.view();
        params.dtopk_weights = dtopk.view();
        params.dw13 = dw13.view();
        params.dw2 = dw2.view();
        bind_workspace(params, megamoe_backward_workspace_size, workspace);
    }

    // Poisons every gradient and the workspace, runs the backward.
    void run() {
        for (DeviceTensor* tensor : {&dx, &dtopk, &dw13, &dw2, &workspace}) tensor->poison();
        expect_cuda(cudaDeviceSynchronize(), "poison");
        EXPECT_EQ(megamoe_backward(&params), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
        expect_cuda(cudaDeviceSynchronize(), "backward");
    }

    BackwardGrads download() const { return {dx.download(), dtopk.download(), dw13.download(), dw2.download()}; }
};

// A problem's backward on the device, every tensor `offset` elements into its allocation (1: misaligned views), the
// weight gradients in `grad_dtype`, d topk_weights in f32.
inline DeviceBackward upload_backward(const Problem& problem, int64_t offset, megamoe_dtype_t grad_dtype) {
    const int64_t T = problem.num_tokens, H = problem.hidden, I = problem.intermediate, E = problem.num_experts;
    DeviceBackward device{DeviceTensor::upload(problem.x, offset),
                          DeviceTensor::upload(problem.ids, offset),
                          DeviceTensor::upload(problem.weights, offset),
                          DeviceTensor::upload(problem.w13, offset),
                          DeviceTensor::upload(problem.w2, offset),
                          DeviceTensor::upload(problem.dy, offset),
                          DeviceTensor(problem.x.view, offset),
                          DeviceTensor(HostTensor(MEGAMOE_DTYPE_F32, {T, problem.topk}).view, offset),
                          DeviceTensor(HostTensor(grad_dtype, {E, 2 * I, H}).view, offset),
                          DeviceTensor(HostTensor(grad_dtype, {E, H, I}).view, offset),
                          {}};
    device.bind();
    return device;
}

// As above, the weight gradients in the problem's dtype.
inline DeviceBackward upload_backward(const Problem& problem, int64_t offset = 0) {
    return upload_backward(problem, offset, problem.dtype);
}

}  // namespace megamoe::test
