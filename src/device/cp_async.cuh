// The 16-byte cp.async (global -> shared, zero fill), the one wrapper of the instruction that the portable and the
// sm_90a kernels copy with, and its group commit / wait. The address forms: a generic shared pointer or a shared-space
// address (shared_address), a generic global pointer or a global-space address (global_address, for callers that
// keep a row's base and add offsets to it).
#pragma once

#include <cstdint>

namespace megamoe::cuda {

__device__ __forceinline__ uint32_t shared_address(const void* ptr) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

__device__ __forceinline__ uint64_t global_address(const void* ptr) {
    return static_cast<uint64_t>(__cvta_generic_to_global(ptr));
}

// Copies 16 bytes global -> shared without staging in registers; when `valid` is false nothing is read and the 16
// shared bytes are zero-filled (the global address must still be a mapped one).
__device__ __forceinline__ void cp_async_16(uint32_t shared_addr, uint64_t global_addr, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_addr), "l"(global_addr),
                 "r"(valid ? 16 : 0)
                 : "memory");
}
__device__ __forceinline__ void cp_async_16(uint32_t shared_addr, const void* global_ptr, bool valid) {
    cp_async_16(shared_addr, global_address(global_ptr), valid);
}
__device__ __forceinline__ void cp_async_16(void* shared_ptr, const void* global_ptr, bool valid) {
    cp_async_16(shared_address(shared_ptr), global_address(global_ptr), valid);
}

__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Waits until at most kNumPending committed groups of this thread are still in flight.
template <int kNumPending>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kNumPending) : "memory");
}

}  // namespace megamoe::cuda
