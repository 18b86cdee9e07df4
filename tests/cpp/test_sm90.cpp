// The sm_90a toolchain probe (one CuTe wgmma tile) against a CPU product, on a Hopper GPU only.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include "sm90/cute_probe.h"
#include "test_util.h"

namespace megamoe::test {
namespace {

TEST(Sm90, CuteWgmmaProbeMatchesCpu) {
    int num_devices = 0;
    if (cudaGetDeviceCount(&num_devices) != cudaSuccess || num_devices == 0) {
        cudaGetLastError();
        GTEST_SKIP() << "no CUDA device: the sm_90a probe needs a Hopper GPU";
    }
    cudaDeviceProp prop{};
    ASSERT_EQ(cudaGetDeviceProperties(&prop, 0), cudaSuccess);
    if (prop.major != 9) GTEST_SKIP() << "device is sm_" << prop.major << prop.minor << ", the probe needs sm_90";

    constexpr int kM = 64, kN = 64, kK = 16;
    std::mt19937_64 rng(fresh_seed());
    HostTensor a(MEGAMOE_DTYPE_BF16, {kM, kK}), b(MEGAMOE_DTYPE_BF16, {kN, kK});
    a.fill_random(rng, 1.0);
    b.fill_random(rng, 1.0);
    void *a_dev = nullptr, *b_dev = nullptr, *d_dev = nullptr;
    ASSERT_EQ(cudaMalloc(&a_dev, kM * kK * 2), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&b_dev, kN * kK * 2), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&d_dev, kM * kN * 4), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(a_dev, a.view.data, kM * kK * 2, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(b_dev, b.view.data, kN * kK * 2, cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemset(d_dev, 0xFF, kM * kN * 4), cudaSuccess);  // poison: NaN everywhere
    ASSERT_EQ(sm90::launch_cute_probe(a_dev, b_dev, static_cast<float*>(d_dev), nullptr), cudaSuccess);
    std::vector<float> d(kM * kN);
    ASSERT_EQ(cudaMemcpy(d.data(), d_dev, kM * kN * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    for (int m = 0; m < kM; ++m) {
        for (int n = 0; n < kN; ++n) {
            double expected = 0.0;
            for (int k = 0; k < kK; ++k) expected += a.get(m * kK + k) * b.get(n * kK + k);
            ASSERT_NEAR(d[m * kN + n], expected, 1e-4 * (1.0 + std::fabs(expected))) << "(" << m << ", " << n << ")";
        }
    }
    cudaFree(a_dev);
    cudaFree(b_dev);
    cudaFree(d_dev);
}

}  // namespace
}  // namespace megamoe::test
