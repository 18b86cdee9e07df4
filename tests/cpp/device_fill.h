// Pseudo-random device fills for tests whose tensors are too large to draw on the host (the reference
// shapes' weights reach 15 GB): a counter-based hash of (seed, index), so every element differs.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "megamoe/megamoe.h"

namespace megamoe::test {

// Uniform values of standard deviation `std_dev` (zero mean) into `count` elements of dtype bf16, f16 or f32.
cudaError_t device_fill_uniform(void* data, megamoe_dtype_t dtype, int64_t count, uint64_t seed, float std_dev);

}  // namespace megamoe::test
