// Hopper (sm_90a) toolchain probe: one wgmma tile product built from CuTe (see cute_probe.cu).
#pragma once

#include <cuda_runtime_api.h>

namespace megamoe::sm90 {

// d (64 x 64, f32 row-major) = a (64 x 16, bf16 row-major) * b (64 x 16, bf16 row-major)^T, on sm_90a only.
cudaError_t launch_cute_probe(const void* a, const void* b, float* d, cudaStream_t stream);

}  // namespace megamoe::sm90
