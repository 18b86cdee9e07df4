// What the FP8 timing programs share (bench/fp8_gemm_timing.cu, bench/fp8_wgrad_timing.cu): the reference shapes
// (fp8_timing_shapes.h), random fills on the device, device buffers freed at scope exit, and the median of kTimed
// launches timed by CUDA events after kWarmup.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <vector>

#include "common.h"
#include "fp8_timing_shapes.h"

namespace megamoe_bench {

#define CHECK_CUDA(call)                                                                                  \
    do {                                                                                                  \
        const cudaError_t err_ = (call);                                                                  \
        if (err_ != cudaSuccess) {                                                                        \
            std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(err_)); \
            return false;                                                                                 \
        }                                                                                                 \
    } while (0)

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

// Balanced routing on the device for a shape: slot t topk + j goes to expert (t topk + j) % E (distinct experts per
// token, per_expert slots each); expert e's sorted rows are its slots in increasing order, e + E i. offsets [E + 1],
// the routing's 128-row M tiles [E + 1] and the sorted slots [T topk], int32.
struct BalancedRouting {
    Buffer offsets, tiles, slots;
    int64_t per_expert = 0, tiles_per_expert = 0, max_tiles = 0;

    bool make(const Shape& s) {
        const int64_t E = s.experts, rows = s.tokens * s.topk;
        if (rows % E != 0 || E % s.topk != 0 || s.hidden % 128 != 0 || s.inter % 128 != 0) {
            std::fprintf(stderr, "%s: balanced routing needs T topk %% E == 0, E %% topk == 0, H, I %% 128 == 0\n",
                         s.name);
            return false;
        }
        per_expert = rows / E;
        tiles_per_expert = (per_expert + 127) / 128;
        max_tiles = E * tiles_per_expert;
        std::vector<int> host_offsets(static_cast<size_t>(E + 1)), host_tiles(static_cast<size_t>(E + 1)),
            host_slots(static_cast<size_t>(rows));
        for (int64_t e = 0; e <= E; ++e) {
            host_offsets[static_cast<size_t>(e)] = static_cast<int>(e * per_expert);
            host_tiles[static_cast<size_t>(e)] = static_cast<int>(e * tiles_per_expert);
        }
        for (int64_t e = 0; e < E; ++e) {
            for (int64_t i = 0; i < per_expert; ++i) {
                host_slots[static_cast<size_t>(e * per_expert + i)] = static_cast<int>(e + E * i);
            }
        }
        if (!offsets.alloc(host_offsets.size() * 4, "offsets") || !tiles.alloc(host_tiles.size() * 4, "tiles") ||
            !slots.alloc(host_slots.size() * 4, "slots")) {
            return false;
        }
        CHECK_CUDA(cudaMemcpy(offsets.as<int>(), host_offsets.data(), host_offsets.size() * 4, cudaMemcpyHostToDevice));
        CHECK_CUDA(cudaMemcpy(tiles.as<int>(), host_tiles.data(), host_tiles.size() * 4, cudaMemcpyHostToDevice));
        CHECK_CUDA(cudaMemcpy(slots.as<int>(), host_slots.data(), host_slots.size() * 4, cudaMemcpyHostToDevice));
        return true;
    }
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

// One shape's timed lines, "shape gemm kernel ms TFLOP/s" (or why not), every failure remembered in all_ok.
struct ShapeReport {
    const char* shape;
    bool all_ok = true;

    void time(const char* gemm, const char* kernel, bool supported, double flops,
              const std::function<megamoe_status_t()>& launch) {
        double ms = 0.0;
        const bool ok = supported && time_launch(launch, &ms);
        all_ok &= !supported || ok;
        if (ok) {
            std::printf("%-16s %-10s %-12s %9.3f ms %8.1f TFLOP/s\n", shape, gemm, kernel, ms, flops / ms * 1e-9);
        } else {
            std::printf("%-16s %-10s %-12s %s\n", shape, gemm, kernel,
                        supported ? "FAILED (see stderr)" : "not supported");
        }
        std::fflush(stdout);
    }
};

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
