// Build probe for the Hopper toolchain: proves that the pinned CUTLASS/CuTe headers compile for
// sm_90a with this nvcc, and that wgmma (HGMMA in SASS) is emitted. It computes one 64x64x16 bf16
// tile product D = A * B^T through a single warpgroup MMA atom; the fused kernels of later issues
// are built from the same headers.
//
// Layouts: A (64, 16) and B (64, 16), K-major bf16 in shared memory; D (64, 64) f32 row-major.
// Threads: one warpgroup (128 threads). Shared memory: A and B tiles, 4 KiB in all.
#include <cute/tensor.hpp>
#include <cute/arch/mma_sm90.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>

#include "sm90/cute_probe.h"

namespace megamoe::sm90 {
namespace {

constexpr int kTileM = 64;
constexpr int kTileN = 64;
constexpr int kTileK = 16;
constexpr int kNumThreads = 128;  // one warpgroup
static_assert(kTileM == kTileN, "A and B tiles share one fill loop");

__global__ void __launch_bounds__(kNumThreads, 1)
    probe_kernel(const cute::bfloat16_t* a_gmem, const cute::bfloat16_t* b_gmem, float* d_gmem) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using namespace cute;
    __shared__ alignas(128) bfloat16_t a_smem[kTileM * kTileK];
    __shared__ alignas(128) bfloat16_t b_smem[kTileN * kTileK];
    auto smem_layout = GMMA::Layout_K_INTER_Atom<bfloat16_t>{};  // (8, 8) core-matrix atom, K-major, no swizzle
    Tensor s_a = make_tensor(make_smem_ptr(a_smem), tile_to_shape(smem_layout, Shape<Int<kTileM>, Int<kTileK>>{}));
    Tensor s_b = make_tensor(make_smem_ptr(b_smem), tile_to_shape(smem_layout, Shape<Int<kTileN>, Int<kTileK>>{}));
    for (int idx = threadIdx.x; idx < kTileM * kTileK; idx += kNumThreads) {  // row-major global -> atom layout
        s_a(idx / kTileK, idx % kTileK) = a_gmem[idx];
        s_b(idx / kTileK, idx % kTileK) = b_gmem[idx];
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // generic-proxy stores -> wgmma (async proxy)
    __syncthreads();
    auto tiled_mma = make_tiled_mma(SM90_64x64x16_F32BF16BF16_SS<GMMA::Major::K, GMMA::Major::K>{});
    auto thr_mma = tiled_mma.get_thread_slice(threadIdx.x);
    Tensor t_a = thr_mma.partition_fragment_A(s_a);
    Tensor t_b = thr_mma.partition_fragment_B(s_b);
    Tensor g_d = make_tensor(make_gmem_ptr(d_gmem), make_layout(Shape<Int<kTileM>, Int<kTileN>>{}, LayoutRight{}));
    Tensor acc = thr_mma.partition_fragment_C(g_d);
    clear(acc);
    warpgroup_fence_operand(acc);
    warpgroup_arrive();
    gemm(tiled_mma, t_a, t_b, acc);
    warpgroup_commit_batch();
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc);
    copy(acc, thr_mma.partition_C(g_d));
#endif
}

}  // namespace

cudaError_t launch_cute_probe(const void* a, const void* b, float* d, cudaStream_t stream) {
    probe_kernel<<<1, kNumThreads, 0, stream>>>(static_cast<const cute::bfloat16_t*>(a),
                                                static_cast<const cute::bfloat16_t*>(b), d);
    return cudaGetLastError();
}

}  // namespace megamoe::sm90
