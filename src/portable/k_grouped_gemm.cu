// The K-grouped GEMM of the portable CUDA path: the weight gradients (see grouped_gemm.h for the math; the tiles,
// pipeline and shared memory are gemm_tile.cuh's).
//
// K-grouped: blockIdx.x = (expert, M tile, N tile); the K loop walks the expert's sorted rows 32 at a
// time (both operands MN-major, rows gathered while loading, their gather indices read one K step
// ahead), then the tile is stored once: no split-K, so sums are deterministic, and an expert with no
// rows stores zeros. The output type (f32 or the element type) and accumulation are run-time values of the params,
// read once per stored pair (a warp-uniform branch after the K loop). Accumulating (f32 out) the epilogue reads, adds
// and writes each element instead, and a block whose expert has no rows returns at once, leaving its tile of out
// untouched.
#include "portable/gemm_tile.cuh"
#include "portable/grouped_gemm.h"

namespace megamoe::cuda {
namespace {

using namespace gemm_tile;  // NOLINT(build/namespaces): the tile constants and helpers of both GEMM files

struct KGroupedParams {
    const uint16_t* a;
    int64_t lda;
    const int* a_gather_slots;
    const uint16_t* b;
    int64_t ldb;
    const int* b_gather_slots;
    int64_t topk;
    int64_t m;
    int64_t n;
    const int* expert_offsets;
    int64_t num_m_tiles;
    int64_t num_n_tiles;
    void* out;  // f32 (out_f32) or the element type
    bool out_f32;
    bool accumulate;  // f32 out: out += C_e
    bool paired_stores;
};

template <typename T, bool kVec>
__global__ void __launch_bounds__(kNumThreads, kVec ? kMinBlocksPerSmVec : 1)
    k_grouped_gemm_kernel(const KGroupedParams params) {
    extern __shared__ __align__(128) uint16_t smem[];
    uint16_t* smem_a = smem;
    uint16_t* smem_b = smem + kNumStages * kTileElems;

    const int64_t num_tiles_per_expert = params.num_m_tiles * params.num_n_tiles;
    const int64_t expert_idx = blockIdx.x / num_tiles_per_expert;
    const int64_t m_tile_idx = (blockIdx.x % num_tiles_per_expert) / params.num_n_tiles;
    const int64_t n_tile_idx = blockIdx.x % params.num_n_tiles;
    const int row_begin = params.expert_offsets[expert_idx];
    const int num_rows = params.expert_offsets[expert_idx + 1] - row_begin;
    if (params.accumulate && num_rows == 0) return;  // a zero gradient: the accumulated buffer stays as it is

    const int thread_idx = static_cast<int>(threadIdx.x);
    const int lane_idx = thread_idx % kWarpSize, warp_idx = thread_idx / kWarpSize;
    const int warp_m_idx = warp_idx / kNumWarpsN, warp_n_idx = warp_idx % kNumWarpsN;

    // Loader: both tiles MN-major; thread owns k rows thread_idx / 16 + 16 p and chunk thread_idx % 16.
    const int chunk_idx = thread_idx % kMNMajorChunksPerRow, first_k_row = thread_idx / kMNMajorChunksPerRow;
    const int64_t a_col = m_tile_idx * kBlockM + chunk_idx * kChunkElems;
    const int64_t b_col = n_tile_idx * kBlockN + chunk_idx * kChunkElems;

    // The source rows of one K tile: gather indices are read one K step before their cp.async is
    // issued, so the dependent index load never stalls the copy of the stage being refilled.
    struct TileRows {
        int a_src_row[kMNMajorPasses];
        int b_src_row[kMNMajorPasses];
    };
    auto fetch_rows = [&](int k_tile_idx) {
        TileRows rows;
        for (int pass = 0; pass < kMNMajorPasses; ++pass) {
            const int local_row = k_tile_idx * kBlockK + first_k_row + pass * kMNMajorRowsPerPass;
            const int row_idx = row_begin + local_row;
            rows.a_src_row[pass] = -1;
            rows.b_src_row[pass] = -1;
            if (local_row < num_rows) {
                rows.a_src_row[pass] = params.a_gather_slots != nullptr
                                           ? static_cast<int>(params.a_gather_slots[row_idx] / params.topk)
                                           : row_idx;
                rows.b_src_row[pass] = params.b_gather_slots != nullptr
                                           ? static_cast<int>(params.b_gather_slots[row_idx] / params.topk)
                                           : row_idx;
            }
        }
        return rows;
    };
    auto load_stage = [&](int stage_idx, const TileRows& rows) {
        uint16_t* tile_a = smem_a + stage_idx * kTileElems;
        uint16_t* tile_b = smem_b + stage_idx * kTileElems;
        for (int pass = 0; pass < kMNMajorPasses; ++pass) {
            const int k_row = first_k_row + pass * kMNMajorRowsPerPass;
            const bool valid = rows.a_src_row[pass] >= 0;
            const int64_t a_src_row = valid ? rows.a_src_row[pass] : 0;
            const int64_t b_src_row = valid ? rows.b_src_row[pass] : 0;
            load_chunk<kVec>(tile_a + mn_major_offset(k_row, chunk_idx), params.a + a_src_row * params.lda, a_col,
                             params.m, valid);
            load_chunk<kVec>(tile_b + mn_major_offset(k_row, chunk_idx), params.b + b_src_row * params.ldb, b_col,
                             params.n, valid);
        }
    };

    float acc[kNumFragsM][kNumFragsN][4] = {};
    const int num_k_tiles = static_cast<int>(ceil_div(num_rows, kBlockK));
    for (int stage_idx = 0; stage_idx < kNumStages - 1; ++stage_idx) {
        if (stage_idx < num_k_tiles) load_stage(stage_idx, fetch_rows(stage_idx));
        cp_async_commit();
    }
    TileRows next_rows = fetch_rows(kNumStages - 1);
    for (int k_tile_idx = 0; k_tile_idx < num_k_tiles; ++k_tile_idx) {
        cp_async_wait<kNumStages - 2>();
        __syncthreads();  // stage k_tile_idx landed for all; stage k_tile_idx - 1 is free again
        const int next_tile_idx = k_tile_idx + kNumStages - 1;
        if (next_tile_idx < num_k_tiles) load_stage(next_tile_idx % kNumStages, next_rows);
        cp_async_commit();
        next_rows = fetch_rows(next_tile_idx + 1);
        const int stage_idx = k_tile_idx % kNumStages;
        compute_stage<T, true, true>(acc, smem_a + stage_idx * kTileElems, smem_b + stage_idx * kTileElems, warp_m_idx,
                                     warp_n_idx, lane_idx);
    }

    const int64_t out_expert = expert_idx * params.m * params.n;
#pragma unroll
    for (int frag_m = 0; frag_m < kNumFragsM; ++frag_m) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int64_t m_idx = m_tile_idx * kBlockM + warp_m_idx * kWarpM + frag_m * 16 + half * 8 + lane_idx / 4;
            if (m_idx >= params.m) continue;
            const int64_t out_row = out_expert + m_idx * params.n;
#pragma unroll
            for (int frag_n = 0; frag_n < kNumFragsN; ++frag_n) {
                const int64_t col = n_tile_idx * kBlockN + warp_n_idx * kWarpN + frag_n * 8 + (lane_idx % 4) * 2;
                const float first = acc[frag_m][frag_n][half * 2], second = acc[frag_m][frag_n][half * 2 + 1];
                if (!params.out_f32) {
                    store_pair(static_cast<T*>(params.out) + out_row, col, params.n, first, second,
                               params.paired_stores);
                } else if (params.accumulate) {
                    accumulate_pair(static_cast<float*>(params.out) + out_row, col, params.n, first, second,
                                    params.paired_stores);
                } else {
                    store_pair(static_cast<float*>(params.out) + out_row, col, params.n, first, second,
                               params.paired_stores);
                }
            }
        }
    }
}

}  // namespace

megamoe_status_t launch_k_grouped_gemm(const KGroupedGemmArgs& args, void* out, megamoe_dtype_t out_dtype,
                                       cudaStream_t stream) {
    KGroupedParams params{};
    params.a = static_cast<const uint16_t*>(args.a);
    params.lda = args.lda;
    params.a_gather_slots = args.a_gather_slots;
    params.b = static_cast<const uint16_t*>(args.b);
    params.ldb = args.ldb;
    params.b_gather_slots = args.b_gather_slots;
    params.topk = args.topk;
    params.m = args.m;
    params.n = args.n;
    params.expert_offsets = args.expert_offsets;
    params.num_m_tiles = ceil_div(args.m, kBlockM);
    params.num_n_tiles = ceil_div(args.n, kBlockN);
    params.out = out;
    params.out_f32 = out_dtype == MEGAMOE_DTYPE_F32;
    params.accumulate = args.accumulate;
    if (params.accumulate && !params.out_f32) {
        return set_error(MEGAMOE_STATUS_INTERNAL_ERROR, "k_grouped_gemm: accumulation needs an f32 output");
    }
    params.paired_stores = args.n % 2 == 0 && is_aligned(out, params.out_f32 ? 8 : 4);

    const int64_t num_blocks = args.num_experts * params.num_m_tiles * params.num_n_tiles;
    if (num_blocks == 0) return MEGAMOE_STATUS_SUCCESS;
    if (num_blocks > kMaxGridX) {
        return set_error(MEGAMOE_STATUS_NOT_SUPPORTED, "k_grouped_gemm: %lld tiles are too many",
                         static_cast<long long>(num_blocks));
    }
    const dim3 grid(static_cast<unsigned>(num_blocks));
    const bool vec = vec_ok(args.a, args.lda, args.m) && vec_ok(args.b, args.ldb, args.n);
    return with_element_type(args.dtype, [&](auto tag) {
        using T = typename decltype(tag)::Type;
        const char* name = "k_grouped_gemm";
        return vec ? launch(k_grouped_gemm_kernel<T, true>, params, grid, stream, name)
                   : launch(k_grouped_gemm_kernel<T, false>, params, grid, stream, name);
    });
}

}  // namespace megamoe::cuda
