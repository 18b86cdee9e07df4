// Times the whole layer through the C API, precision DEFAULT (bf16) against FP8_BLOCKWISE, on the reference shapes at
// balanced routing (slot (t, j) to expert (t * topk + j) mod E): the forward (keep-h: saved_h written) and the forward
// + backward (dx, d topk_weights, dw13, dw2 in bf16), with the FP8 weights made once beforehand by
// megamoe_quantize_experts (timed on its own: once per optimizer step in training), each call's backward workspace
// printed. FP8 twice: with the transposed copies (fp8) and one-copy (fp8-one-copy: w13_t and w2_t absent, the
// backward transposing w2 and w13 into its workspace; its outputs checked bitwise against fp8's). CUDA events on the
// default stream, 3 warm-up calls, the median of 10; the variants alternate within each of ROUNDS rounds (argument 2,
// default 2). Weights N(0, 1 / K)-like, x and dy uniform in [-1, 1]. Usage:
//   megamoe_fp8_layer_timing [shape name|all] [rounds]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "fp8_timing_shapes.h"
#include "megamoe/megamoe.h"

namespace {

#define CHECK_CUDA(call)                                                                                  \
    do {                                                                                                  \
        const cudaError_t err_ = (call);                                                                  \
        if (err_ != cudaSuccess) {                                                                        \
            std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(err_)); \
            std::exit(1);                                                                                 \
        }                                                                                                 \
    } while (0)
#define CHECK_MEGAMOE(call)                                                                           \
    do {                                                                                              \
        const megamoe_status_t status_ = (call);                                                      \
        if (status_ != MEGAMOE_STATUS_SUCCESS) {                                                      \
            std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, megamoe_last_error()); \
            std::exit(1);                                                                             \
        }                                                                                             \
    } while (0)

using megamoe_bench::kShapes;
using megamoe_bench::kTimed;
using megamoe_bench::kWarmup;
using megamoe_bench::Shape;

__global__ void fill_bf16(__nv_bfloat16* out, int64_t n, uint64_t seed, float scale) {
    for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
        uint64_t x = (static_cast<uint64_t>(i) + 1) * 0x9E3779B97F4A7C15ULL ^ seed;
        x ^= x >> 31;
        x *= 0xBF58476D1CE4E5B9ULL;
        x ^= x >> 29;
        const float u = static_cast<float>(x >> 40) / static_cast<float>(1 << 24);  // [0, 1)
        out[i] = __float2bfloat16((2.0f * u - 1.0f) * scale);
    }
}

struct Buffer {
    void* data = nullptr;
    explicit Buffer(size_t bytes) { CHECK_CUDA(cudaMalloc(&data, std::max<size_t>(bytes, 256))); }
    ~Buffer() { cudaFree(data); }
    Buffer(const Buffer&) = delete;
    Buffer& operator=(const Buffer&) = delete;
};

megamoe_tensor_t tensor(void* data, megamoe_dtype_t dtype, std::vector<int64_t> shape) {
    megamoe_tensor_t t{};
    t.data = data;
    t.dtype = dtype;
    t.ndim = static_cast<int32_t>(shape.size());
    int64_t stride = 1;
    for (int d = t.ndim - 1; d >= 0; --d) {
        t.shape[d] = shape[static_cast<size_t>(d)];
        t.strides[d] = stride;
        stride *= shape[static_cast<size_t>(d)];
    }
    t.device_type = MEGAMOE_DEVICE_CUDA;
    return t;
}

float median_ms(const std::function<void()>& call) {
    for (int i = 0; i < kWarmup; ++i) call();
    std::vector<float> times;
    cudaEvent_t start, stop;
    CHECK_CUDA(cudaEventCreate(&start));
    CHECK_CUDA(cudaEventCreate(&stop));
    for (int i = 0; i < kTimed; ++i) {
        CHECK_CUDA(cudaEventRecord(start));
        call();
        CHECK_CUDA(cudaEventRecord(stop));
        CHECK_CUDA(cudaEventSynchronize(stop));
        float ms = 0.0f;
        CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
        times.push_back(ms);
    }
    CHECK_CUDA(cudaEventDestroy(start));
    CHECK_CUDA(cudaEventDestroy(stop));
    std::sort(times.begin(), times.end());
    return times[times.size() / 2];
}

std::vector<float> download_bf16(const void* data, int64_t n) {
    std::vector<__nv_bfloat16> raw(static_cast<size_t>(n));
    CHECK_CUDA(cudaMemcpy(raw.data(), data, raw.size() * 2, cudaMemcpyDeviceToHost));
    std::vector<float> out(raw.size());
    for (size_t i = 0; i < raw.size(); ++i) out[i] = __bfloat162float(raw[i]);
    return out;
}

// |a - b| / |b| in the Frobenius norm (NaN when either holds a non-finite value).
double relative_difference(const std::vector<float>& a, const std::vector<float>& b) {
    double diff = 0.0, norm = 0.0;
    for (size_t i = 0; i < a.size(); ++i) {
        diff += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
        norm += double(b[i]) * b[i];
    }
    return std::sqrt(diff / norm);
}

void time_shape(const Shape& s, int rounds) {
    const int64_t T = s.tokens, H = s.hidden, I = s.inter, E = s.experts, K = s.topk, S = T * K;
    const auto bf16 = [](int64_t n) { return static_cast<size_t>(n) * 2; };
    Buffer x(bf16(T * H)), dy(bf16(T * H)), w13(bf16(E * 2 * I * H)), w2(bf16(E * H * I)), y(bf16(T * H));
    Buffer saved_h(bf16(S * 2 * I)), dx(bf16(T * H)), dw13(bf16(E * 2 * I * H)), dw2(bf16(E * H * I));
    Buffer ids(static_cast<size_t>(S) * 4), weights(static_cast<size_t>(S) * 4), dweights(static_cast<size_t>(S) * 4);
    Buffer q13(static_cast<size_t>(E * 2 * I * H)), q13_t(static_cast<size_t>(E * 2 * I * H));
    Buffer q2(static_cast<size_t>(E * H * I)), q2_t(static_cast<size_t>(E * H * I));
    Buffer s13(static_cast<size_t>(E * (2 * I / 128) * (H / 128)) * 4),
        s2(static_cast<size_t>(E * (H / 128) * (I / 128)) * 4);
    fill_bf16<<<1024, 256>>>(static_cast<__nv_bfloat16*>(x.data), T * H, 1, 1.0f);
    fill_bf16<<<1024, 256>>>(static_cast<__nv_bfloat16*>(dy.data), T * H, 2, 1.0f);
    fill_bf16<<<1024, 256>>>(static_cast<__nv_bfloat16*>(w13.data), E * 2 * I * H, 3, 1.7f / std::sqrt(float(H)));
    fill_bf16<<<1024, 256>>>(static_cast<__nv_bfloat16*>(w2.data), E * H * I, 4, 1.7f / std::sqrt(float(I)));
    std::vector<int32_t> host_ids(static_cast<size_t>(S));
    std::vector<float> host_weights(static_cast<size_t>(S), 1.0f / static_cast<float>(K));
    for (int64_t slot = 0; slot < S; ++slot) host_ids[static_cast<size_t>(slot)] = static_cast<int32_t>(slot % E);
    CHECK_CUDA(cudaMemcpy(ids.data, host_ids.data(), host_ids.size() * 4, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(weights.data, host_weights.data(), host_weights.size() * 4, cudaMemcpyHostToDevice));

    megamoe_fp8_experts_t fp8{};
    fp8.w13 = tensor(q13.data, MEGAMOE_DTYPE_E4M3, {E, 2 * I, H});
    fp8.w13_t = tensor(q13_t.data, MEGAMOE_DTYPE_E4M3, {E, H, 2 * I});
    fp8.w13_scales = tensor(s13.data, MEGAMOE_DTYPE_F32, {E, 2 * I / 128, H / 128});
    fp8.w2 = tensor(q2.data, MEGAMOE_DTYPE_E4M3, {E, H, I});
    fp8.w2_t = tensor(q2_t.data, MEGAMOE_DTYPE_E4M3, {E, I, H});
    fp8.w2_scales = tensor(s2.data, MEGAMOE_DTYPE_F32, {E, H / 128, I / 128});
    const megamoe_tensor_t w13_t = tensor(w13.data, MEGAMOE_DTYPE_BF16, {E, 2 * I, H});
    const megamoe_tensor_t w2_t = tensor(w2.data, MEGAMOE_DTYPE_BF16, {E, H, I});
    CHECK_MEGAMOE(megamoe_quantize_experts(&w13_t, &w2_t, &fp8, nullptr));
    megamoe_fp8_experts_t one_copy = fp8;  // the same w13, w2 and scales, no transposed copies
    one_copy.w13_t = one_copy.w2_t = megamoe_tensor_t{};

    megamoe_forward_params_t fwd{};
    fwd.x = tensor(x.data, MEGAMOE_DTYPE_BF16, {T, H});
    fwd.topk_ids = tensor(ids.data, MEGAMOE_DTYPE_I32, {T, K});
    fwd.topk_weights = tensor(weights.data, MEGAMOE_DTYPE_F32, {T, K});
    fwd.w13 = w13_t;
    fwd.w2 = w2_t;
    fwd.y = tensor(y.data, MEGAMOE_DTYPE_BF16, {T, H});
    fwd.saved_h = tensor(saved_h.data, MEGAMOE_DTYPE_BF16, {S, 2 * I});
    megamoe_backward_params_t bwd{};
    bwd.dy = tensor(dy.data, MEGAMOE_DTYPE_BF16, {T, H});
    bwd.x = fwd.x;
    bwd.topk_ids = fwd.topk_ids;
    bwd.topk_weights = fwd.topk_weights;
    bwd.w13 = fwd.w13;
    bwd.w2 = fwd.w2;
    bwd.saved_h = fwd.saved_h;
    bwd.dx = tensor(dx.data, MEGAMOE_DTYPE_BF16, {T, H});
    bwd.dtopk_weights = tensor(dweights.data, MEGAMOE_DTYPE_F32, {T, K});
    bwd.dw13 = tensor(dw13.data, MEGAMOE_DTYPE_BF16, {E, 2 * I, H});
    bwd.dw2 = tensor(dw2.data, MEGAMOE_DTYPE_BF16, {E, H, I});

    struct Variant {
        const char* name;
        megamoe_precision_t precision;
        const megamoe_fp8_experts_t* fp8;
    } variants[] = {{"bf16", MEGAMOE_PRECISION_DEFAULT, nullptr},
                    {"fp8", MEGAMOE_PRECISION_FP8_BLOCKWISE, &fp8},
                    {"fp8-one-copy", MEGAMOE_PRECISION_FP8_BLOCKWISE, &one_copy}};
    const auto select = [&](const Variant& v) {
        fwd.precision = bwd.precision = v.precision;
        fwd.fp8 = bwd.fp8 = v.fp8 == nullptr ? megamoe_fp8_experts_t{} : *v.fp8;
    };
    // The workspace of the largest variant.
    size_t workspace_bytes = 0;
    for (const Variant& v : variants) {
        select(v);
        size_t bytes = 0;
        CHECK_MEGAMOE(megamoe_forward_workspace_size(&fwd, &bytes));
        workspace_bytes = std::max(workspace_bytes, bytes);
        CHECK_MEGAMOE(megamoe_backward_workspace_size(&bwd, &bytes));
        workspace_bytes = std::max(workspace_bytes, bytes);
    }
    Buffer workspace(workspace_bytes);
    fwd.workspace = bwd.workspace = workspace.data;
    fwd.workspace_bytes = bwd.workspace_bytes = workspace_bytes;
    const megamoe_tensor_t* w13p = &w13_t;
    const megamoe_tensor_t* w2p = &w2_t;
    // A sanity check, not a test (tests/cpp/test_fp8_layer_cuda.cpp is): y, dx and expert 0's dw13 of FP8 against
    // bf16's.
    std::vector<std::vector<float>> y_of, dx_of, dw13_of;
    for (const Variant& v : variants) {
        select(v);
        CHECK_MEGAMOE(megamoe_forward(&fwd));
        CHECK_MEGAMOE(megamoe_backward(&bwd));
        y_of.push_back(download_bf16(y.data, T * H));
        dx_of.push_back(download_bf16(dx.data, T * H));
        dw13_of.push_back(download_bf16(dw13.data, 2 * I * H));  // expert 0's: host memory
        size_t backward_bytes = 0;
        CHECK_MEGAMOE(megamoe_backward_workspace_size(&bwd, &backward_bytes));
        std::printf(
            "%-16s %-13s y vs bf16 %.4f, dx vs bf16 %.4f, dw13[0] vs bf16 %.4f (relative Frobenius); "
            "backward workspace %.1f MiB\n",
            s.name, v.name, relative_difference(y_of.back(), y_of.front()),
            relative_difference(dx_of.back(), dx_of.front()), relative_difference(dw13_of.back(), dw13_of.front()),
            static_cast<double>(backward_bytes) / (1 << 20));
    }
    const bool same = y_of[2] == y_of[1] && dx_of[2] == dx_of[1] && dw13_of[2] == dw13_of[1];
    std::printf("%-16s fp8-one-copy  y, dx, dw13[0] bitwise fp8's: %s\n", s.name, same ? "yes" : "NO");
    for (int round = 1; round <= rounds; ++round) {
        for (const Variant& v : variants) {
            select(v);
            const float fwd_ms = median_ms([&] { CHECK_MEGAMOE(megamoe_forward(&fwd)); });
            const float step_ms = median_ms([&] {
                CHECK_MEGAMOE(megamoe_forward(&fwd));
                CHECK_MEGAMOE(megamoe_backward(&bwd));
            });
            std::printf("%-16s round %d  %-13s fwd %8.3f ms  fwd+bwd %8.3f ms\n", s.name, round, v.name, fwd_ms,
                        step_ms);
        }
        const float quant_ms = median_ms([&] { CHECK_MEGAMOE(megamoe_quantize_experts(w13p, w2p, &fp8, nullptr)); });
        std::printf("%-16s round %d  %-13s %8.3f ms (w13 and w2 with their transposes, once per optimizer step)\n",
                    s.name, round, "quantize-w", quant_ms);
        const float one_ms = median_ms([&] { CHECK_MEGAMOE(megamoe_quantize_experts(w13p, w2p, &one_copy, nullptr)); });
        std::printf("%-16s round %d  %-13s %8.3f ms (w13 and w2 alone, once per optimizer step)\n", s.name, round,
                    "quantize-1", one_ms);
        std::fflush(stdout);
    }
    CHECK_CUDA(cudaDeviceSynchronize());
}

}  // namespace

int main(int argc, char** argv) {
    const std::string which = argc > 1 ? argv[1] : "all";
    const int rounds = argc > 2 ? std::atoi(argv[2]) : 2;
    for (const Shape& s : kShapes) {
        if (which == "all" || which == s.name) time_shape(s, rounds);
    }
    return 0;
}
