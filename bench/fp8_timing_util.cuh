// What the FP8 timing programs share (bench/fp8_gemm_timing.cu, bench/fp8_wgrad_timing.cu): the reference shapes,
// random fills on the device, device buffers freed at scope exit, and the median of kTimed launches timed by CUDA
// events after kWarmup.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <vector>

#include "common.h"

namespace megamoe_bench {

#define CHECK_CUDA(call)                                                                                  \
    do {                                                                                                  \
        const cudaError_t err_ = (call);                                                                  \
        if (err_ != cudaSuccess) {                                                                        \
            std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(err_)); \
            return false;                                                                                 \
        }                                                                                                 \
    } while (0)

struct Shape {
    const char* name;
    int64_t tokens, hidden, inter, experts, topk;
};
constexpr Shape kShapes[] = {{"qwen3-30b-a3b", 8192, 2048, 768, 128, 8},
                             {"qwen3-235b-a22b", 8192, 4096, 1536, 128, 8},
                             {"deepseek-v3", 8192, 7168, 2048, 256, 8}};

constexpr int kWarmup = 3, kTimed = 10;

__device__ inline uint32_t mix(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    return static_cast<uint32_t>(x ^ (x >> 33));
}

enum FillKind { kBf16, kE4m3, kOnes };

// bf16 values uniform in [-1/16, 1/16) (an f32's upper half), e4m3 bytes masked with 0x77, or f32 ones.
__global__ inline void fill(void* data, int64_t count, FillKind kind, uint64_t seed) {
    for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < count; i += int64_t{gridDim.x} * blockDim.x) {
        const uint32_t bits = mix(seed * 0x9E3779B97F4A7C15ULL + i);
        if (kind == kBf16) {
            const float v = (static_cast<float>(bits) * 0x1p-32f - 0.5f) * 0.125f;
            static_cast<uint16_t*>(data)[i] = static_cast<uint16_t>(__float_as_uint(v) >> 16);
        } else if (kind == kE4m3) {
            static_cast<uint8_t*>(data)[i] = static_cast<uint8_t>(bits & 0x77);
        } else {
            static_cast<float*>(data)[i] = 1.0f;
        }
    }
}

// Device memory freed at scope exit.
class Buffer {
  public:
    Buffer() = default;
    Buffer(const Buffer&) = delete;
    Buffer& operator=(const Buffer&) = delete;
    ~Buffer() {
        if (ptr_ != nullptr) cudaFree(ptr_);
    }
    bool alloc(size_t bytes, const char* what) {
        const cudaError_t err = cudaMalloc(&ptr_, std::max<size_t>(bytes, 16));
        if (err != cudaSuccess)
            std::fprintf(stderr, "cudaMalloc %s (%zu bytes): %s\n", what, bytes, cudaGetErrorString(err));
        return err == cudaSuccess;
    }
    template <typename T>
    T* as() const {
        return static_cast<T*>(ptr_);
    }

  private:
    void* ptr_ = nullptr;
};

// Median milliseconds of `launch` over kTimed launches after kWarmup; false (printed) on a failure.
inline bool time_launch(const std::function<megamoe_status_t()>& launch, double* median_ms) {
    for (int i = 0; i < kWarmup; ++i) {
        if (launch() != MEGAMOE_STATUS_SUCCESS) {
            std::fprintf(stderr, "launch failed: %s\n", megamoe_last_error());
            return false;
        }
    }
    CHECK_CUDA(cudaDeviceSynchronize());
    cudaEvent_t start, stop;
    CHECK_CUDA(cudaEventCreate(&start));
    CHECK_CUDA(cudaEventCreate(&stop));
    std::vector<float> ms(kTimed);
    bool ok = true;
    for (int i = 0; i < kTimed && ok; ++i) {
        ok = cudaEventRecord(start, nullptr) == cudaSuccess && launch() == MEGAMOE_STATUS_SUCCESS &&
             cudaEventRecord(stop, nullptr) == cudaSuccess && cudaEventSynchronize(stop) == cudaSuccess &&
             cudaEventElapsedTime(&ms[static_cast<size_t>(i)], start, stop) == cudaSuccess;
    }
    const cudaError_t err = cudaGetLastError();
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    if (!ok || err != cudaSuccess) {
        std::fprintf(stderr, "timed launch failed: %s / %s\n", megamoe_last_error(), cudaGetErrorString(err));
        return false;
    }
    std::sort(ms.begin(), ms.end());
    *median_ms = 0.5 * (ms[kTimed / 2 - 1] + ms[kTimed / 2]);
    return true;
}

// Every reference shape (or the one named `only`) through run_shape(shape, the device's SM count), after a line on the
// device and the method.
inline bool run_all(const char* only, bool (*run_shape)(const Shape&, int)) {
    cudaDeviceProp prop{};
    CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
    std::printf("device: %s (compute capability %d.%d, %d SMs); CUDA events, %d warm-up launches, median of %d\n",
                prop.name, prop.major, prop.minor, prop.multiProcessorCount, kWarmup, kTimed);
    bool ok = true, any = false;
    for (const Shape& s : kShapes) {
        if (only != nullptr && std::strcmp(only, s.name) != 0) continue;
        any = true;
        std::printf("%s: T %lld, H %lld, I %lld, E %lld, topk %lld, %lld rows per expert\n", s.name,
                    static_cast<long long>(s.tokens), static_cast<long long>(s.hidden), static_cast<long long>(s.inter),
                    static_cast<long long>(s.experts), static_cast<long long>(s.topk),
                    static_cast<long long>(s.tokens * s.topk / s.experts));
        ok &= run_shape(s, prop.multiProcessorCount);
    }
    if (!any) std::fprintf(stderr, "no shape named %s\n", only);
    return ok && any;
}

}  // namespace megamoe_bench
