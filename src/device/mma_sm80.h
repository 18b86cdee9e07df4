// The few sm_80 PTX instructions the portable grouped GEMMs are built from, one thin wrapper each:
// cp.async (16-byte global -> shared copies with zero fill), ldmatrix (8x8 b16 tiles from shared
// memory into mma fragments, optionally transposed) and mma.sync m16n8k16 with f32 accumulators.
// Fragment layouts are those of the PTX ISA "mma.m16n8k16" section for .bf16 / .f16 inputs.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace megamoe::cuda {

__device__ __forceinline__ uint32_t shared_address(const void* ptr) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// Copies 16 bytes global -> shared without staging in registers; when `valid` is false nothing is
// read and the 16 shared bytes are zero-filled (`global_ptr` must still be a mapped address).
__device__ __forceinline__ void cp_async_16(void* shared_ptr, const void* global_ptr, bool valid) {
    const int num_src_bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(shared_ptr)),
                 "l"(__cvta_generic_to_global(global_ptr)), "r"(num_src_bytes)
                 : "memory");
}

__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Waits until at most kNumPending committed groups of this thread are still in flight.
template <int kNumPending>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kNumPending) : "memory");
}

// Four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i, register i receives it.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&regs)[4], const void* shared_row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(regs[0]), "=r"(regs[1]), "=r"(regs[2]), "=r"(regs[3])
                 : "r"(shared_address(shared_row)));
}

// As ldmatrix_x4, each matrix transposed on the way (rows in shared memory become fragment columns).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&regs)[4], const void* shared_row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(regs[0]), "=r"(regs[1]), "=r"(regs[2]), "=r"(regs[3])
                 : "r"(shared_address(shared_row)));
}

// acc[16x8] += a[16x16] * b[16x8], f32 accumulators, inputs of element type T.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&acc)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]);

template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&acc)[4], const uint32_t (&a)[4],
                                                         const uint32_t (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <>
__device__ __forceinline__ void mma_16816<__half>(float (&acc)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

}  // namespace megamoe::cuda
