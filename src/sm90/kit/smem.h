// The shared-memory budget of the sm_90a kernels and the one rule that sizes their pipelines from it: a kernel's
// shared storage is a struct templated on its stage count (its stages, its epilogue's staging, its barriers); the
// stage count is the most, up to a maximum, whose storage and the 1024-byte alignment slack fit in an SM.
#pragma once

#include <cstddef>

#include "sm90/kit/arch.h"
#include "sm90/kit/ptx.h"

namespace megamoe::sm90 {

// Bytes a kernel asks for: its storage and the slack to align it to a 128-byte swizzle atom.
template <class Storage>
constexpr int smem_bytes_of() {
    return static_cast<int>(sizeof(Storage)) + kSwizzleAtomBytes;
}

// The most stages in [kMinStages, kMaxStages] with which StorageOf<stages> fits (kMinStages if none does: the
// kernel's static_assert on its smem_bytes then says so).
template <template <int> class StorageOf, int kMaxStages, int kMinStages = 2>
constexpr int fit_stages() {
    if constexpr (kMaxStages <= kMinStages || smem_bytes_of<StorageOf<kMaxStages>>() <= kMaxSmemBytes) {
        return kMaxStages;
    } else {
        return fit_stages<StorageOf, kMaxStages - 1, kMinStages>();
    }
}

}  // namespace megamoe::sm90
