// The M-grouped GEMMs of the portable CUDA path (see grouped_gemm.h for the math of each kind; the tiles, pipeline
// and shared memory are gemm_tile.cuh's).
//
// M-grouped: blockIdx.x = M tile of the routing's schedule (tiles past m_tile_offsets[E] exit at
// once), blockIdx.y = N tile. A rows are gathered through sorted_slot while loading (no copy of the
// gathered matrix); each thread keeps the source rows of its two loader rows for the whole K loop.
// Consecutive blocks are M tiles of one N tile, so the M tiles of an expert share its B tile in L2.
// Two epilogues, chosen at compile time (the gated one shapes which B rows the loader reads):
//   store: the tile in f32 (stored, or added to out) or in the element type (plus b2), chosen at run time by the
//     params, one warp-uniform branch per stored pair;
//   gated: N tile t holds, as n8 fragments 2p and 2p + 1, the gate rows j and the up rows j (read from b_up: w13 + I
//     rows, or w3) of the same 8 columns j = 64 t + 8 p + [0, 8), so g and u of one output land in one thread; or,
//     for interleaved rows, the tile in storage order, whose accumulator pairs (2i, 2i + 1) are (g_i, u_i) in one
//     thread. Bias and activation (activation.h, PreciseMath) applied in f32 before h and a are rounded.
#include "portable/grouped_gemm.h"

#include "portable/gemm_tile.cuh"
#include "portable/routing.h"

namespace megamoe::cuda {
namespace {

using namespace gemm_tile;  // NOLINT(build/namespaces): the tile constants and helpers of both GEMM files

enum class Epilogue { kStore, kGatedAct };

struct MGroupedParams {
    const uint16_t* a;
    int64_t lda;
    const int* a_gather_slots;
    int64_t topk;
    const uint16_t* b;
    int64_t b_expert_stride;
    int64_t ldb;
    int64_t n;
    int64_t k;
    const int* expert_offsets;
    const int* m_tile_offsets;
    int64_t num_experts;
    void* out;  // kStore: f32 (out_f32) or the element type
    int64_t ldo;
    bool out_f32;     // kStore
    bool accumulate;  // kStore, f32: out += the tile
    void* h;          // kGatedAct, may be NULL
    void* act;        // kGatedAct, may be NULL
    bool paired_stores;
    const uint16_t* b_up;  // kGatedAct, not interleaved: B_0 of the up rows
    bool interleaved;      // kGatedAct
    const uint16_t* bias;  // kGatedAct: b13 [E, 2I]; kStore in the element type: b2 [E, N]; NULL: none
    Activation<float> activation;
};

// kStore: columns (col, col + 1) of one row, in f32 (stored or added) or in the element type (plus b2[e]).
template <typename T>
__device__ __forceinline__ void store_out_pair(const MGroupedParams& params, int64_t expert_idx, int64_t row_idx,
                                               int64_t col, float first, float second) {
    if (params.out_f32) {
        float* out_row = static_cast<float*>(params.out) + row_idx * params.ldo;
        if (params.accumulate) {
            accumulate_pair(out_row, col, params.n, first, second, params.paired_stores);
        } else {
            store_pair(out_row, col, params.n, first, second, params.paired_stores);
        }
        return;
    }
    if (params.bias != nullptr) {  // b2[e, col], b2[e, col + 1]
        const T* bias = reinterpret_cast<const T*>(params.bias) + expert_idx * params.n;
        if (col < params.n) first += to_float(bias[col]);
        if (col + 1 < params.n) second += to_float(bias[col + 1]);
    }
    store_pair(static_cast<T*>(params.out) + row_idx * params.ldo, col, params.n, first, second, params.paired_stores);
}

// kGatedAct, interleaved rows: output column `col` of one row from its gate and up accumulators (b13 entries at
// 2 col, 2 col + 1 of the expert's bias row): h = [g, u] and a = act(g, u), each rounded once.
template <typename T>
__device__ __forceinline__ void store_gated(const MGroupedParams& params, int64_t expert_idx, int64_t row_idx,
                                            int64_t col, float gate, float up) {
    const int64_t intermediate = params.n;
    if (col >= intermediate) return;
    if (params.bias != nullptr) {
        const T* bias = reinterpret_cast<const T*>(params.bias) + expert_idx * 2 * intermediate;
        gate += to_float(bias[2 * col]);
        up += to_float(bias[2 * col + 1]);
    }
    if (params.h != nullptr) {
        T* h_row = static_cast<T*>(params.h) + row_idx * 2 * intermediate;
        h_row[col] = from_float<T>(gate);
        h_row[intermediate + col] = from_float<T>(up);
    }
    if (params.act != nullptr) {
        static_cast<T*>(params.act)[row_idx * intermediate + col] = from_float<T>(params.activation.forward(gate, up));
    }
}

// kGatedAct, gate and up rows apart: output columns (col, col + 1) of one row from their gate and up accumulators
// (b13 entries at col and I + col of the expert's bias row), as store_gated computes each.
template <typename T>
__device__ __forceinline__ void store_gated_pair(const MGroupedParams& params, int64_t expert_idx, int64_t row_idx,
                                                 int64_t col, const float* gate_acc, const float* up_acc) {
    const int64_t intermediate = params.n;
    float gate[2] = {gate_acc[0], gate_acc[1]}, up[2] = {up_acc[0], up_acc[1]};
    if (params.bias != nullptr) {
        const T* bias = reinterpret_cast<const T*>(params.bias) + expert_idx * 2 * intermediate;
        for (int item = 0; item < 2; ++item) {
            if (col + item < intermediate) {
                gate[item] += to_float(bias[col + item]);
                up[item] += to_float(bias[intermediate + col + item]);
            }
        }
    }
    if (params.h != nullptr) {
        T* h_row = static_cast<T*>(params.h) + row_idx * 2 * intermediate;
        store_pair(h_row, col, intermediate, gate[0], gate[1], params.paired_stores);
        store_pair(h_row + intermediate, col, intermediate, up[0], up[1], params.paired_stores);
    }
    if (params.act != nullptr) {
        store_pair(static_cast<T*>(params.act) + row_idx * intermediate, col, intermediate,
                   params.activation.forward(gate[0], up[0]), params.activation.forward(gate[1], up[1]),
                   params.paired_stores);
    }
}

template <typename T, BLayout kBLayout, Epilogue kEpilogue, bool kVec>
__global__ void __launch_bounds__(kNumThreads, kVec ? kMinBlocksPerSmVec : 1)
    m_grouped_gemm_kernel(const MGroupedParams params) {
    static_assert(kKMajorRowsPerPass % 16 == 0 && (kMNMajorChunksPerRow % 2) == 0,
                  "a loader thread's B rows (chunks) are all gate or all up rows in the gated epilogue");
    constexpr bool kBMNMajor = kBLayout == BLayout::kKN;
    extern __shared__ __align__(128) uint16_t smem[];
    uint16_t* smem_a = smem;
    uint16_t* smem_b = smem + kNumStages * kTileElems;

    // Tile schedule, read from the device-side routing (no host knows the real tile count).
    const int m_tile_idx = static_cast<int>(blockIdx.x);
    if (m_tile_idx >= params.m_tile_offsets[params.num_experts]) return;
    const int expert_idx = expert_of_m_tile(params.m_tile_offsets, params.num_experts, m_tile_idx);
    const int row_begin =
        params.expert_offsets[expert_idx] + (m_tile_idx - params.m_tile_offsets[expert_idx]) * kBlockM;
    const int num_rows = min(kBlockM, params.expert_offsets[expert_idx + 1] - row_begin);
    const int64_t n_tile_idx = blockIdx.y;

    const int thread_idx = static_cast<int>(threadIdx.x);
    const int lane_idx = thread_idx % kWarpSize, warp_idx = thread_idx / kWarpSize;
    const int warp_m_idx = warp_idx / kNumWarpsN, warp_n_idx = warp_idx % kNumWarpsN;

    // Loader: K-major rows thread_idx / 4 + 64 p, chunk thread_idx % 4; MN-major rows thread_idx / 16 + 16 p.
    const int k_major_chunk = thread_idx % kKMajorChunksPerRow, k_major_row = thread_idx / kKMajorChunksPerRow;
    const int mn_major_chunk = thread_idx % kMNMajorChunksPerRow, mn_major_row = thread_idx / kMNMajorChunksPerRow;

    // Source rows of this thread's loader rows, fixed for the whole K loop (-1: past the tile's rows).
    // Kept as 32-bit indices, not pointers: it saves the registers that let two blocks share an SM.
    int a_src_rows[kKMajorPasses];
    for (int pass = 0; pass < kKMajorPasses; ++pass) {
        const int local_row = k_major_row + pass * kKMajorRowsPerPass;
        const int row_idx = row_begin + local_row;
        a_src_rows[pass] = -1;
        if (local_row < num_rows) {
            a_src_rows[pass] = params.a_gather_slots != nullptr
                                   ? static_cast<int>(params.a_gather_slots[row_idx] / params.topk)
                                   : row_idx;
        }
    }

    const uint16_t* b_expert = params.b + expert_idx * params.b_expert_stride;
    // kGatedAct pairing blocks of 8 gate / 8 up rows: this thread's rows (kKN: chunks) are the up rows, from b_up.
    const bool b_thread_up = kEpilogue == Epilogue::kGatedAct && !params.interleaved &&
                             (kBMNMajor ? mn_major_chunk % 2 == 1 : (k_major_row / 8) % 2 == 1);
    if (b_thread_up) b_expert = params.b_up + expert_idx * params.b_expert_stride;
    int b_src_rows[kKMajorPasses];
    if constexpr (!kBMNMajor) {
        for (int pass = 0; pass < kKMajorPasses; ++pass) {
            const int local_n = k_major_row + pass * kKMajorRowsPerPass;
            if constexpr (kEpilogue == Epilogue::kGatedAct) {
                const int64_t pair_col = n_tile_idx * (kBlockN / 2) + (local_n / 16) * 8 + local_n % 8;
                const int64_t b_row = params.interleaved ? n_tile_idx * kBlockN + local_n : pair_col;
                b_src_rows[pass] =
                    b_row >= (params.interleaved ? 2 * params.n : params.n) ? -1 : static_cast<int>(b_row);
            } else {
                const int64_t b_row = n_tile_idx * kBlockN + local_n;
                b_src_rows[pass] = b_row >= params.n ? -1 : static_cast<int>(b_row);
            }
        }
    }
    // kKN B: this thread's chunk of columns of the B rows and the column count (kGatedAct: the layout's columns).
    int64_t b_col = n_tile_idx * kBlockN + mn_major_chunk * kChunkElems;
    int64_t b_num_cols = params.n;
    if constexpr (kEpilogue == Epilogue::kGatedAct) {
        if (params.interleaved) {
            b_num_cols = 2 * params.n;
        } else {
            b_col = n_tile_idx * (kBlockN / 2) + (mn_major_chunk / 2) * kChunkElems;
        }
    }

    auto load_stage = [&](int stage_idx, int k_tile_idx) {
        uint16_t* tile_a = smem_a + stage_idx * kTileElems;
        uint16_t* tile_b = smem_b + stage_idx * kTileElems;
        const int64_t k_base = static_cast<int64_t>(k_tile_idx) * kBlockK;
        const int64_t k_col = k_base + k_major_chunk * kChunkElems;
        for (int pass = 0; pass < kKMajorPasses; ++pass) {
            const int row = k_major_row + pass * kKMajorRowsPerPass;
            const bool a_valid = a_src_rows[pass] >= 0;
            load_chunk<kVec>(tile_a + k_major_offset(row, k_major_chunk),
                             params.a + (a_valid ? a_src_rows[pass] : 0) * params.lda, k_col, params.k, a_valid);
            if constexpr (!kBMNMajor) {
                const bool b_valid = b_src_rows[pass] >= 0;
                load_chunk<kVec>(tile_b + k_major_offset(row, k_major_chunk),
                                 b_expert + (b_valid ? b_src_rows[pass] : 0) * params.ldb, k_col, params.k, b_valid);
            }
        }
        if constexpr (kBMNMajor) {
            for (int pass = 0; pass < kMNMajorPasses; ++pass) {
                const int k_row = mn_major_row + pass * kMNMajorRowsPerPass;
                const bool valid = k_base + k_row < params.k;
                const uint16_t* row = b_expert + (valid ? k_base + k_row : 0) * params.ldb;
                load_chunk<kVec>(tile_b + mn_major_offset(k_row, mn_major_chunk), row, b_col, b_num_cols, valid);
            }
        }
    };

    float acc[kNumFragsM][kNumFragsN][4] = {};
    const int num_k_tiles = static_cast<int>(ceil_div(params.k, kBlockK));
    for (int stage_idx = 0; stage_idx < kNumStages - 1; ++stage_idx) {
        if (stage_idx < num_k_tiles) load_stage(stage_idx, stage_idx);
        cp_async_commit();
    }
    for (int k_tile_idx = 0; k_tile_idx < num_k_tiles; ++k_tile_idx) {
        cp_async_wait<kNumStages - 2>();
        __syncthreads();  // stage k_tile_idx landed for all; stage k_tile_idx - 1 is free again
        const int next_tile_idx = k_tile_idx + kNumStages - 1;
        if (next_tile_idx < num_k_tiles) load_stage(next_tile_idx % kNumStages, next_tile_idx);
        cp_async_commit();
        const int stage_idx = k_tile_idx % kNumStages;
        compute_stage<T, false, kBMNMajor>(acc, smem_a + stage_idx * kTileElems, smem_b + stage_idx * kTileElems,
                                           warp_m_idx, warp_n_idx, lane_idx);
    }

    // Epilogue straight from registers: fragment (m, n) holds rows lane / 4 and lane / 4 + 8, columns
    // 2 (lane % 4) and 2 (lane % 4) + 1 of its 16 x 8 block.
#pragma unroll
    for (int frag_m = 0; frag_m < kNumFragsM; ++frag_m) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int local_row = warp_m_idx * kWarpM + frag_m * 16 + half * 8 + lane_idx / 4;
            if (local_row >= num_rows) continue;
            const int64_t row_idx = row_begin + local_row;
            if constexpr (kEpilogue == Epilogue::kGatedAct) {
#pragma unroll
                for (int frag_n = 0; frag_n < kNumFragsN; ++frag_n) {
                    const float* pair = &acc[frag_m][frag_n][half * 2];
                    if (params.interleaved) {  // storage columns (2i, 2i + 1) = (g_i, u_i)
                        const int64_t col =
                            n_tile_idx * kBlockN + warp_n_idx * kWarpN + frag_n * 8 + (lane_idx % 4) * 2;
                        store_gated<T>(params, expert_idx, row_idx, col / 2, pair[0], pair[1]);
                    } else if (frag_n % 2 == 0) {  // fragments 2p (gate) and 2p + 1 (up) of the same columns
                        const int64_t col = n_tile_idx * (kBlockN / 2) +
                                            (warp_n_idx * (kNumFragsN / 2) + frag_n / 2) * 8 + (lane_idx % 4) * 2;
                        store_gated_pair<T>(params, expert_idx, row_idx, col, pair, &acc[frag_m][frag_n + 1][half * 2]);
                    }
                }
            } else {
#pragma unroll
                for (int frag_n = 0; frag_n < kNumFragsN; ++frag_n) {
                    const int64_t col = n_tile_idx * kBlockN + warp_n_idx * kWarpN + frag_n * 8 + (lane_idx % 4) * 2;
                    store_out_pair<T>(params, expert_idx, row_idx, col, acc[frag_m][frag_n][half * 2],
                                      acc[frag_m][frag_n][half * 2 + 1]);
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// Host side: pick the instantiation (element type, aligned or not), size the grid, launch.
template <BLayout kBLayout, Epilogue kEpilogue>
megamoe_status_t dispatch_m_grouped(const MGroupedGemmArgs& args, const MGroupedParams& params, dim3 grid,
                                    cudaStream_t stream, const char* name) {
    const bool b_mn_major = kBLayout == BLayout::kKN;
    // kKN B's loaded columns: N, or the gated epilogue's 2I storage columns of interleaved rows.
    const int64_t b_cols = kEpilogue == Epilogue::kGatedAct && args.interleaved ? 2 * args.n : args.n;
    const bool b_up_ok = kEpilogue != Epilogue::kGatedAct || args.interleaved || is_aligned(args.b_up, 16);
    const bool vec = vec_ok(args.a, args.lda, args.k) && args.b_expert_stride % kChunkElems == 0 &&
                     vec_ok(args.b, args.ldb, b_mn_major ? b_cols : args.k) && b_up_ok;
    return with_element_type(args.dtype, [&](auto tag) {
        using T = typename decltype(tag)::Type;
        return vec ? launch(m_grouped_gemm_kernel<T, kBLayout, kEpilogue, true>, params, grid, stream, name)
                   : launch(m_grouped_gemm_kernel<T, kBLayout, kEpilogue, false>, params, grid, stream, name);
    });
}

MGroupedParams make_m_grouped_params(const MGroupedGemmArgs& args) {
    MGroupedParams params{};
    params.a = static_cast<const uint16_t*>(args.a);
    params.lda = args.lda;
    params.a_gather_slots = args.a_gather_slots;
    params.topk = args.topk;
    params.b = static_cast<const uint16_t*>(args.b);
    params.b_expert_stride = args.b_expert_stride;
    params.ldb = args.ldb;
    params.n = args.n;
    params.k = args.k;
    params.expert_offsets = args.expert_offsets;
    params.m_tile_offsets = args.m_tile_offsets;
    params.num_experts = args.num_experts;
    params.b_up = static_cast<const uint16_t*>(args.b_up);
    params.interleaved = args.interleaved;
    params.bias = static_cast<const uint16_t*>(args.bias);
    params.activation = args.activation;
    return params;
}

// The grid (the schedule's bound on M tiles, num_n_tiles), unlaunchable sizes refused; no tiles: grid.x == 0.
megamoe_status_t m_grouped_grid(const MGroupedGemmArgs& args, int64_t num_n_tiles, const char* name, dim3* grid) {
    *grid = dim3(0, 0);
    if (args.max_m_tiles == 0 || num_n_tiles == 0) return MEGAMOE_STATUS_SUCCESS;
    if (args.max_m_tiles > kMaxGridX || num_n_tiles > kMaxGridY) {
        return set_error(MEGAMOE_STATUS_NOT_SUPPORTED, "%s: grid %lld x %lld too large", name,
                         static_cast<long long>(args.max_m_tiles), static_cast<long long>(num_n_tiles));
    }
    *grid = dim3(static_cast<unsigned>(args.max_m_tiles), static_cast<unsigned>(num_n_tiles));
    return MEGAMOE_STATUS_SUCCESS;
}

// The store epilogue: out in f32 (out_f32; added with accumulate) or in the element type plus args.bias.
megamoe_status_t launch_store(const MGroupedGemmArgs& args, BLayout b_layout, void* out, int64_t ldo, bool out_f32,
                              bool accumulate, cudaStream_t stream) {
    const char* name = !out_f32 ? "m_grouped_gemm_elem" : (accumulate ? "m_grouped_gemm_accumulate" : "m_grouped_gemm");
    dim3 grid;
    MEGAMOE_CUDA_RETURN_IF_ERROR(m_grouped_grid(args, ceil_div(args.n, kBlockN), name, &grid));
    if (grid.x == 0) return MEGAMOE_STATUS_SUCCESS;
    MGroupedParams params = make_m_grouped_params(args);
    params.out = out;
    params.ldo = ldo;
    params.out_f32 = out_f32;
    params.accumulate = accumulate;
    if (out_f32) params.bias = nullptr;  // b2 belongs to the element-type store (the down GEMM)
    params.paired_stores = ldo % 2 == 0 && is_aligned(out, out_f32 ? 8 : 4);
    return b_layout == BLayout::kNK
               ? dispatch_m_grouped<BLayout::kNK, Epilogue::kStore>(args, params, grid, stream, name)
               : dispatch_m_grouped<BLayout::kKN, Epilogue::kStore>(args, params, grid, stream, name);
}

}  // namespace

megamoe_status_t launch_m_grouped_gemm_f32(const MGroupedGemmArgs& args, BLayout b_layout, float* out, int64_t ldo,
                                           cudaStream_t stream, bool accumulate) {
    return launch_store(args, b_layout, out, ldo, true, accumulate, stream);
}

megamoe_status_t launch_m_grouped_gemm_elem(const MGroupedGemmArgs& args, BLayout b_layout, void* out, int64_t ldo,
                                            cudaStream_t stream) {
    return launch_store(args, b_layout, out, ldo, false, false, stream);
}

megamoe_status_t launch_m_grouped_gemm_swiglu(const MGroupedGemmArgs& args, void* h, void* act, cudaStream_t stream) {
    MGroupedGemmArgs gated = args;
    gated.b_up = static_cast<const uint16_t*>(args.b) + args.n * args.ldb;  // w13's up rows start at row I
    gated.interleaved = false;
    gated.bias = nullptr;
    gated.activation = {MEGAMOE_ACTIVATION_SWIGLU, 0.0f, 0.0f};
    return launch_m_grouped_gemm_gated(gated, BLayout::kNK, h, act, stream);
}

megamoe_status_t launch_m_grouped_gemm_gated(const MGroupedGemmArgs& args, BLayout b_layout, void* h, void* act,
                                             cudaStream_t stream) {
    const char* name = "m_grouped_gemm_gated";
    dim3 grid;  // 64 (gate, up) pairs per tile in every layout
    MEGAMOE_CUDA_RETURN_IF_ERROR(m_grouped_grid(args, ceil_div(args.n, kBlockN / 2), name, &grid));
    if (grid.x == 0) return MEGAMOE_STATUS_SUCCESS;
    if (!args.interleaved && args.b_up == nullptr) {
        return set_error(MEGAMOE_STATUS_INTERNAL_ERROR, "m_grouped_gemm_gated: no B of the up rows");
    }
    MGroupedParams params = make_m_grouped_params(args);
    params.h = h;
    params.act = act;
    params.paired_stores = args.n % 2 == 0 && is_aligned(h, 4) && is_aligned(act, 4);
    return b_layout == BLayout::kNK
               ? dispatch_m_grouped<BLayout::kNK, Epilogue::kGatedAct>(args, params, grid, stream, name)
               : dispatch_m_grouped<BLayout::kKN, Epilogue::kGatedAct>(args, params, grid, stream, name);
}

}  // namespace megamoe::cuda
