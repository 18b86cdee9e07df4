// Division of a non-negative int below 2^31 by a divisor d >= 1 fixed for a launch, by a multiply-high and a shift:
// x / d = umulhi(2 x, magic) >> shift with shift = ceil(log2 d) and magic = floor(2^(31 + shift) / d) + 1 (below
// 2^32). The round-up method: magic exceeds 2^(31 + shift) / d by e in (0, 1], so x magic / 2^(31 + shift) exceeds x /
// d by x e / 2^(31 + shift) < 2^-shift <= 1 / d, never reaching the next integer: exact for every x below 2^31. The
// same arithmetic on the host (the tests) and on the device (__umulhi).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace megamoe::cuda {

struct IntDivisor {
    uint32_t magic;
    int shift;

    // divisor in [1, 2^31)
    static IntDivisor of(int64_t divisor) {
        IntDivisor result{0, 0};
        while ((int64_t{1} << result.shift) < divisor) ++result.shift;
        result.magic = static_cast<uint32_t>((uint64_t{1} << (31 + result.shift)) / static_cast<uint64_t>(divisor) + 1);
        return result;
    }

    // value in [0, 2^31)
    __host__ __device__ __forceinline__ int divide(int value) const {
        const uint32_t doubled = static_cast<uint32_t>(value) * 2u;
#if defined(__CUDA_ARCH__)
        return static_cast<int>(__umulhi(doubled, magic) >> shift);
#else
        return static_cast<int>((static_cast<uint64_t>(doubled) * magic >> 32) >> shift);
#endif
    }
};

}  // namespace megamoe::cuda
