// What every grouped GEMM takes, the portable kernels (portable/grouped_gemm.h) and the sm_90a ones (sm90/) alike: the
// arguments of an M-grouped GEMM (one weight matrix per expert, an expert's sorted rows the M dimension) and of a
// K-grouped one (the weight gradients: an expert's rows the reduction), the layout of B, and the routing's M-tile
// schedule as the kernels read it (portable/routing.h writes it). The orchestration (path/) fills them.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "activation.h"
#include "common.h"

namespace megamoe::cuda {

constexpr int kGemmBlockM = 128;  // rows per M tile; the routing's M-tile schedule uses it

enum class BLayout {
    kNK,  // B_e is [N, K], K contiguous (w13[e] for up, w2[e] for down)
    kKN,  // B_e is [K, N], N contiguous (w2[e] for dH, w13[e] for dX)
};

struct MGroupedGemmArgs {
    megamoe_dtype_t dtype;  // element type of A and B: bf16 or f16
    const void* a;          // A rows, row stride lda elements
    int64_t lda;
    const int* a_gather_slots;  // NULL: a_row(r) = r; else a_row(r) = a_gather_slots[r] / topk
    int64_t num_a_rows;         // rows of A: every a_row(r) is below it (the extent of the sm_90a kernel's A map)
    int64_t topk;
    const void* b;  // B_0; B_e = b + e * b_expert_stride
    int64_t b_expert_stride;
    int64_t ldb;                // row stride of B_e
    int64_t n;                  // N (for the SwiGLU epilogue: I, the number of (gate, up) pairs)
    int64_t k;                  // K
    const int* expert_offsets;  // [E + 1] sorted rows per expert
    const int* m_tile_offsets;  // [E + 1] M-tile schedule (kGemmBlockM rows per tile)
    int64_t num_experts;
    int64_t max_m_tiles;      // host bound on m_tile_offsets[E]
    bool pair_blocks_always;  // sm_90a tile order: pair blocks whatever B_e's size (the test override
                              // MEGAMOE_TEST_PAIR_BLOCKS)
    // The gated-activation up GEMM of the non-default options (launch_m_grouped_gemm_gated) and the down GEMM's bias.
    const void* b_up;              // concatenated / separate: B_0 of the up rows (up row j is row / column j of it)
    bool interleaved;              // gate i and up i are the adjacent rows (kKN: columns) 2i and 2i + 1 of B_e
    const void* bias;              // gated: b13 [E, 2I] arranged as B's rows; element store: b2 [E, N]; NULL: none
    Activation<float> activation;  // gated
};

struct KGroupedGemmArgs {
    megamoe_dtype_t dtype;  // element type of A and B: bf16 or f16
    const void* a;          // rows of M values, row stride lda
    int64_t lda;
    const int* a_gather_slots;  // NULL: row r; else row a_gather_slots[r] / topk
    const void* b;              // rows of N values, row stride ldb
    int64_t ldb;
    const int* b_gather_slots;
    int64_t topk;
    int64_t m;
    int64_t n;
    const int* expert_offsets;  // [E + 1]
    int64_t num_experts;
    int* schedule;    // sm_90a kernel: k_grouped_schedule_ints(E) ints, 16-byte aligned (NULL: static order; portable:
                      // unused)
    bool accumulate;  // out is f32 and holds values: C_e is added into it
};

// Device ints the sm_90a K-grouped kernel's tile schedule needs in KGroupedGemmArgs::schedule: a 4-int entry per
// expert, the tile counter and the claiming flag.
inline int64_t k_grouped_schedule_ints(int64_t num_experts) {
    return 4 * num_experts + 2;
}

// The expert owning M tile `m_tile_idx` of the schedule: the last e with m_tile_offsets[e] <= m_tile_idx
// (experts with no rows own no tiles and are skipped by taking the last). Binary search over [E + 1].
__device__ __forceinline__ int expert_of_m_tile(const int* m_tile_offsets, int64_t num_experts, int m_tile_idx) {
    int64_t lo = 0, hi = num_experts;
    while (hi - lo > 1) {
        const int64_t mid = (lo + hi) / 2;
        if (m_tile_offsets[mid] <= m_tile_idx) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    return static_cast<int>(lo);
}

}  // namespace megamoe::cuda
