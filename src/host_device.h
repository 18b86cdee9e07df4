// MEGAMOE_HOST_DEVICE: a function compiled for the host and, under nvcc, for the device too (the math and index
// arithmetic shared by the CPU reference, the host-side tests and the kernels).
#pragma once

#if defined(__CUDACC__)
#define MEGAMOE_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define MEGAMOE_HOST_DEVICE inline
#endif
