// What both sm_90a kernels (the M-grouped m_grouped/gemm.cu and the K-grouped k_grouped/gemm.cu) are built
// on: the warp-specialized CTA (one producer and two consumer warpgroups, their setmaxnreg budgets), the cluster
// pair, the element and chunk sizes, the shared-memory budget, and the wgmma instruction from CuTe's selector with
// its accumulators passed unpacked. Each kernel's own tiles and pipeline: m_grouped/config.cuh, k_grouped/config.cuh.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cute/arch/mma_sm90.hpp>
#include <cute/layout.hpp>
#include <cute/numeric/numeric_types.hpp>
#include <type_traits>
#include <utility>

namespace megamoe::sm90 {

constexpr int kWarpSize = 32;
constexpr int kWarpgroupThreads = 128;
constexpr int kWarpsPerWarpgroup = kWarpgroupThreads / kWarpSize;
constexpr int kNumConsumers = 2;  // consumer warpgroups, after the producer warpgroup
constexpr int kNumThreads = (1 + kNumConsumers) * kWarpgroupThreads;
constexpr int kProducerRegs = 56;   // setmaxnreg of the producer warpgroup
constexpr int kConsumerRegs = 224;  // and of each consumer warpgroup
constexpr int kRegisterFile = 64 * 1024;
constexpr int kMaxSmemBytes = 227 * 1024;  // dynamic shared memory of one block on sm_90
constexpr int kClusterSize = 2;            // a CTA pair sharing an operand by multicast
constexpr uint16_t kClusterMask = (1u << kClusterSize) - 1;
constexpr int kElemBytes = 2;   // bf16 / f16 operands
constexpr int kChunkElems = 8;  // one 16-byte cp.async
constexpr int kWgmmaM = 64;     // rows of one wgmma: a consumer's row block
constexpr int kWgmmaK = 16;

static_assert(kProducerRegs * kWarpgroupThreads + kConsumerRegs * kNumConsumers * kWarpgroupThreads <= kRegisterFile,
              "setmaxnreg budgets exceed the register file");
static_assert(kChunkElems * kElemBytes == 16, "a chunk is one 16-byte copy");

namespace gmma = cute::SM90::GMMA;  // the wgmma atoms and their selector

// The CuTe wgmma atom m64 x kN x k16, both operands from shared memory, f32 accumulators, A and B of the given
// majorness (K-major, or MN-major: the transpose bits of the atom), as CuTe's selector picks it for the element type.
template <typename T>
using CuteElementOf = std::conditional_t<std::is_same_v<T, __half>, cute::half_t, cute::bfloat16_t>;
template <typename T, int kN, gmma::Major kMajorA, gmma::Major kMajorB>
using WgmmaOp = decltype(gmma::ss_op_selector<CuteElementOf<T>, CuteElementOf<T>, float,
                                              cute::Shape<cute::_64, cute::Int<kN>, cute::_16>, kMajorA, kMajorB>());
// The e4m3 x e4m3 atom m64 x kN x k32 (FP8 wgmma reads both operands K-major), f32 accumulators.
template <int kN>
using WgmmaFp8Op = decltype(gmma::ss_op_selector<cute::float_e4m3_t, cute::float_e4m3_t, float,
                                                 cute::Shape<cute::_64, cute::Int<kN>, cute::_32>>());

// acc[kFirstReg + i] for the atom's i-th accumulator, asynchronously: accumulating (kScaleOut One) or overwriting
// (Zero: the accumulators' previous values are not read).
template <typename Op, int kFirstReg, gmma::ScaleOut kScaleOut = gmma::ScaleOut::One, int kNumRegs, size_t... kRegIdx>
__device__ __forceinline__ void wgmma_unpacked(uint64_t desc_a, uint64_t desc_b, float (&acc)[kNumRegs],
                                               std::index_sequence<kRegIdx...>) {
    static_assert(kFirstReg + sizeof...(kRegIdx) <= kNumRegs, "the atom's accumulators are the caller's");
    Op::fma(desc_a, desc_b, acc[kFirstReg + kRegIdx]..., kScaleOut);
}

}  // namespace megamoe::sm90
