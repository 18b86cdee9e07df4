// The blockwise FP8 K-grouped GEMM of the weight gradients (k_grouped_fp8_gemm_sm90.h: the math, the operands' layout,
// the requirements): a persistent, warp-specialized wgmma kernel, both operands and their scales by TMA.
//
// Tiles: kBlockM x kBlockN = 128 x 128 outputs of one expert per CTA tile, kBlockK = 128 reduction columns per stage:
// one routing M tile, hence one scale group, per stage. A stage holds A [128 rows][128 bytes] and B [128][128] as TMA
// writes boxes of 128 bytes x 128 rows with the 128-byte swizzle (K-major, as the FP8 wgmma reads both operands), and
// the group's 128 + 128 f32 scales (two plain bulk copies of 512 bytes).
// Tile schedule: tile t = (expert, m-tile, n-tile), n fastest, expert-major (CTAs running at the same time read the
// same expert's operands from L2); CTA c takes t = c, c + grid, ... (the static stride). A tile's work is its expert's
// tiles of rows, so skewed routing leaves CTAs uneven: TODO(#20) the K-grouped kernel's claimed schedule.
//
// Warp roles (3 warpgroups, 384 threads, 1 CTA per SM):
//   warpgroup 0, producer (setmaxnreg down): thread 0 waits for a stage's empty barrier, arms its full barrier with the
//     stage's bytes and issues the two TMA boxes and the two scale copies.
//   warpgroups 1, 2, consumers (setmaxnreg up): rows [64 (w - 1), 64 w) of the tile, m64 x n128 x k32 wgmmas. Per stage
//     (promotion every K group, the recipe's): the group's 4 wgmmas summed from zero into `part`, waited for, the
//     thread's 2 row scales and 32 column scales read from the stage, the stage released (one arrival per warp), then
//     acc += part * (sa[row] * sb[col]) element by element. The other consumer's wgmmas keep the tensor pipe busy
//     meanwhile (the two warpgroups' batches queue on it one after the other).
//   Epilogue, per tile: each consumer warp stages its 16 rows through two 2 KiB boxes (stmatrix for bf16 / f16, 64
//     columns a box; 8-byte shared stores for f32, 32 columns) and lane 0 stores each box by TMA into out [E, M, N]
//     (3-D map), or, accumulating, adds it there by a TMA reduce-add (one f32 add per element, deterministic): the warp
//     returns to its MMAs once the last store is issued.
// Shared memory (SharedStorage, dynamic, 1024-byte aligned): the stages (32 KiB + 1 KiB each; as many as fit beside the
// store boxes), 2 store boxes per consumer warp (32 KiB), the stages' full and empty barriers.
#include "sm90/k_grouped_fp8_gemm_sm90.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <type_traits>
#include <utility>

#include "device/cuda_utils.h"
#include "sm90/epilogue.cuh"
#include "sm90/hopper.h"
#include "sm90/knobs.h"
#include "sm90/launch.h"
#include "sm90/ptx.h"

namespace megamoe::sm90 {
namespace {

using cuda::ceil_div;

constexpr int kBlockM = 128;  // output rows of a tile: kConsumerRows per consumer warpgroup
constexpr int kBlockN = 128;  // output columns: one m64 x n128 wgmma per k32 step
constexpr int kBlockK = 128;  // reduction columns (bytes) per stage: one routing M tile, one scale group
constexpr int kMmaK = 32;     // the FP8 wgmma's k
constexpr int kGroupSize = 128;
constexpr int kConsumerRows = kBlockM / kNumConsumers;
constexpr int kAccRegs = kWgmmaM * kBlockN / kWarpgroupThreads;  // one m64 x n128 accumulator set per thread
constexpr int kNumFrags = kBlockN / 8;                           // 8-column accumulator fragments
constexpr uint64_t kDescKStep = kMmaK >> 4;                      // descriptor units (16 bytes) per k32 step
constexpr int kOperandTileBytes = kBlockM * kBlockK;
constexpr int kScaleBytes = kBlockM * static_cast<int>(sizeof(float));
constexpr uint32_t kStageTxBytes = 2 * (kOperandTileBytes + kScaleBytes);  // A, B and their scales
constexpr int kEmptyArrivals = kNumConsumers * kWarpsPerWarpgroup;         // one per consumer warp
constexpr int kStoreBoxes = kTmaStoreBuffers;
constexpr int kMaxStages = 8;
constexpr int kMinStages = 2;

static_assert(kBlockK == kSwizzleBytes, "a stage's K columns are one 128-byte swizzled row per operand row");
static_assert(kBlockK == kGroupSize, "one scale group per stage: the promotion every 128 K");
static_assert(kBlockM == kBlockN, "A and B tiles share the box shape and the scale copy size");
static_assert(kConsumerRows == kWgmmaM, "a consumer's rows are one m64 row block");
static_assert(kConsumerRows * kBlockK % kSwizzleAtomBytes == 0, "a consumer's A rows start on a swizzle atom");
static_assert(kScaleBytes % 16 == 0, "the scale copies are whole 16-byte units");
static_assert(kWgmmaM / kWarpsPerWarpgroup == kTmaStoreRows, "a store box holds one warp's 16 accumulator rows");
static_assert(kBlockN % kTmaStoreCols == 0 && kBlockN % kTmaStoreF32Cols == 0, "the epilogue stores whole boxes");

// Shared memory of one CTA (the dynamic allocation, aligned to 1024 bytes by the kernel).
template <int kStages>
struct SharedStorageOf {
    alignas(kSwizzleAtomBytes) uint8_t a[kStages][kOperandTileBytes];
    alignas(kSwizzleAtomBytes) uint8_t b[kStages][kOperandTileBytes];
    alignas(kSwizzleAtomBytes) uint8_t staging[kNumConsumers * kWarpsPerWarpgroup][kStoreBoxes * kTmaStoreBoxBytes];
    alignas(16) float a_scales[kStages][kBlockM];
    alignas(16) float b_scales[kStages][kBlockN];
    uint64_t full[kStages];
    uint64_t empty[kStages];
};

// The most stages (at most kMaxStages) whose storage and alignment slack fit in an SM's shared memory.
template <int kStages>
constexpr int fit_stages() {
    if constexpr (kStages <= kMinStages || sizeof(SharedStorageOf<kStages>) + kSwizzleAtomBytes <= kMaxSmemBytes) {
        return kStages;
    } else {
        return fit_stages<kStages - 1>();
    }
}
constexpr int kNumStages = fit_stages<kMaxStages>();
using SharedStorage = SharedStorageOf<kNumStages>;
constexpr int kSmemBytes = static_cast<int>(sizeof(SharedStorage)) + kSwizzleAtomBytes;  // + alignment slack
static_assert(kSmemBytes <= kMaxSmemBytes, "stages and store staging exceed the shared memory of an SM");
static_assert(kNumStages >= 4, "at least 4 stages: the producer runs a tile of short K ahead");

struct Params {
    const float* a_scales;  // [tiles, ld_a_scales]
    int64_t ld_a_scales;
    const float* b_scales;
    int64_t ld_b_scales;
    const int* m_tile_offsets;  // [E + 1]
    int num_m_tiles;            // output tiles per expert: num_m_tiles x num_n_tiles
    int num_n_tiles;
    int pairs_n;    // cluster tiles per m-tile: ceil(num_n_tiles / kPair)
    int num_tiles;  // cluster tiles, E * num_m_tiles * pairs_n (checked < 2^31 on the host)
};

struct Tile {
    int expert_idx;
    int m_begin;
    int n_begin;
    int first_k_tile;  // the expert's first routing tile: reduction columns from 128 first_k_tile on
    int num_k_blocks;
    bool store;  // false: the partner CTA's tile again (an odd n-tile count), computed only to keep the pair in step
};

// This CTA's tile of cluster tile `tile_idx` (kPair CTAs: neighbouring n-tiles of one m-tile, sharing A), or, past the
// last one, a tile with no k-blocks (nothing read).
template <int kPair>
__device__ __forceinline__ Tile decode_tile(const Params& params, int tile_idx, int cta_rank) {
    Tile tile{};
    if (tile_idx >= params.num_tiles) return tile;
    const int per_expert = params.num_m_tiles * params.pairs_n;
    tile.expert_idx = tile_idx / per_expert;
    const int within = tile_idx % per_expert;
    tile.m_begin = within / params.pairs_n * kBlockM;
    int n_tile = within % params.pairs_n * kPair + cta_rank;
    tile.store = n_tile < params.num_n_tiles;
    if (!tile.store) n_tile -= cta_rank;
    tile.n_begin = n_tile * kBlockN;
    tile.first_k_tile = params.m_tile_offsets[tile.expert_idx];
    tile.num_k_blocks = params.m_tile_offsets[tile.expert_idx + 1] - tile.first_k_tile;
    return tile;
}

// The clusters' static tile stride: cluster c takes cluster tiles c, c + num_clusters, ...
template <int kPair>
__device__ __forceinline__ int first_cluster_tile() {
    return static_cast<int>(blockIdx.x) / kPair;
}
template <int kPair>
__device__ __forceinline__ int num_clusters() {
    return static_cast<int>(gridDim.x) / kPair;
}

// The producer's thread 0, stage by stage over every k-block of this CTA's tiles. kPair == 2: A's rows [64 r, 64 r +
// 64) come from CTA r of the pair, multicast into both (its A map's boxes are 64 rows), so the stage's full barrier
// completes when both halves and this CTA's B and scales have landed.
template <int kPair>
__device__ __forceinline__ void produce(const CUtensorMap* a_map, const CUtensorMap* b_map, const Params& params,
                                        SharedStorage& smem, int cta_rank) {
    constexpr int kAHalfRows = kBlockM / kPair;
    int stage_idx = 0;
    uint32_t phase = 0;
    const int stride = num_clusters<kPair>();
    Tile next = decode_tile<kPair>(params, first_cluster_tile<kPair>(), cta_rank);
    for (int tile_idx = first_cluster_tile<kPair>(); tile_idx < params.num_tiles; tile_idx += stride) {
        const Tile tile = next;
        next = decode_tile<kPair>(params, tile_idx + stride, cta_rank);  // its loads in flight during this tile
        for (int k_block_idx = 0; k_block_idx < tile.num_k_blocks; ++k_block_idx) {
            const int k_tile = tile.first_k_tile + k_block_idx;
            uint64_t* full = &smem.full[stage_idx];
            mbarrier_wait(&smem.empty[stage_idx], phase ^ 1);
            mbarrier_arrive_expect_tx(full, kStageTxBytes);
            if constexpr (kPair == 1) {
                tma_load_2d(smem.a[stage_idx], a_map, full, k_tile * kBlockK, tile.m_begin);
            } else {
                tma_load_2d_multicast(smem.a[stage_idx] + cta_rank * kAHalfRows * kBlockK, a_map, full,
                                      k_tile * kBlockK, tile.m_begin + cta_rank * kAHalfRows, kClusterMask);
            }
            tma_load_2d(smem.b[stage_idx], b_map, full, k_tile * kBlockK, tile.n_begin);
            bulk_load(smem.a_scales[stage_idx], params.a_scales + k_tile * params.ld_a_scales + tile.m_begin,
                      kScaleBytes, full);
            bulk_load(smem.b_scales[stage_idx], params.b_scales + k_tile * params.ld_b_scales + tile.n_begin,
                      kScaleBytes, full);
            advance_stage<kNumStages>(stage_idx, phase);
        }
    }
}
static_assert(kClusterSize == 2, "the pair variant's multicast mask and half boxes are for 2 CTAs");

// One K group of a consumer: its 64 A rows at tile_a times the 128 B rows at tile_b (both K-major, 128-byte swizzle)
// into `part` from zero, kBlockK / kMmaK steps of m64 x n128 x k32, issued asynchronously.
__device__ __forceinline__ void group_mma(const uint8_t* tile_a, const uint8_t* tile_b, float (&part)[kAccRegs]) {
    using Op = WgmmaFp8Op<kBlockN>;
    const uint64_t desc_a = make_smem_desc_k_major_sw128(tile_a);
    const uint64_t desc_b = make_smem_desc_k_major_sw128(tile_b);
    wgmma_unpacked<Op, 0, gmma::ScaleOut::Zero>(desc_a, desc_b, part, std::make_index_sequence<kAccRegs>{});
#pragma unroll
    for (int k_step = 1; k_step < kBlockK / kMmaK; ++k_step) {
        wgmma_unpacked<Op, 0>(desc_a + k_step * kDescKStep, desc_b + k_step * kDescKStep, part,
                              std::make_index_sequence<kAccRegs>{});
    }
}

// acc += part * (sa * sb): register j of fragment f holds row row_scales[j / 2]'s column 8 f + 2 (lane % 4) + j % 2.
__device__ __forceinline__ void promote(float (&acc)[kAccRegs], const float (&part)[kAccRegs],
                                        const float (&row_scales)[2], const float2 (&col_scales)[kNumFrags]) {
#pragma unroll
    for (int frag = 0; frag < kNumFrags; ++frag) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int reg_idx = frag * 4 + half * 2;
            acc[reg_idx] = fmaf(part[reg_idx], row_scales[half] * col_scales[frag].x, acc[reg_idx]);
            acc[reg_idx + 1] = fmaf(part[reg_idx + 1], row_scales[half] * col_scales[frag].y, acc[reg_idx + 1]);
        }
    }
}

// One consumer warp's 16 rows of the tile into out: stored (bf16, f16, f32) or added (kAccumulate, f32) by TMA.
template <typename OutT, bool kAccumulate>
__device__ __forceinline__ void store_tile(const CUtensorMap* out_map, const Tile& tile, const float (&acc)[kAccRegs],
                                           uint32_t staging, int consumer_idx, int warp_idx, int lane_idx) {
    const int row = tile.m_begin + consumer_idx * kConsumerRows + warp_idx * kTmaStoreRows;
    if constexpr (std::is_same_v<OutT, float>) {
        constexpr int kChunks = kBlockN / kTmaStoreF32Cols;
        store_warp_rows_tma_f32<kChunks, 0, kStoreBoxes>(acc, staging, lane_idx, [&](uint32_t box, int chunk) {
            const int col = tile.n_begin + chunk * kTmaStoreF32Cols;
            if constexpr (kAccumulate) {
                tma_reduce_add_3d(out_map, box, col, row, tile.expert_idx);
            } else {
                tma_store_3d(out_map, box, col, row, tile.expert_idx);
            }
        });
    } else {
        static_assert(!kAccumulate, "accumulation is into f32 outputs");
        constexpr int kChunks = kBlockN / kTmaStoreCols;
        store_warp_rows_tma<OutT, kChunks, 0, kStoreBoxes>(acc, staging, lane_idx, [&](uint32_t box, int chunk) {
            tma_store_3d(out_map, box, tile.n_begin + chunk * kTmaStoreCols, row, tile.expert_idx);
        });
    }
}

// kOverlap (MEGAMOE_SM90_FP8_WGRAD_OVERLAP=1): each consumer issues the next tile's first K group into `part` before
// storing this tile's `acc`, so the epilogue runs under those wgmmas instead of with the tensor pipe idle (both
// consumers store at the same time); `part` and `acc` are separate registers, so nothing waits for the other. Else
// every group is issued and completed in turn.
template <typename OutT, bool kAccumulate, int kPair, bool kOverlap>
__device__ __forceinline__ void consume(const CUtensorMap* out_map, const Params& params, SharedStorage& smem,
                                        int cta_rank, int consumer_idx, int thread_idx) {
    const int lane_idx = thread_idx % kWarpSize;
    const int warp_idx = thread_idx % kWarpgroupThreads / kWarpSize;
    const uint32_t warp_staging = shared_address(smem.staging[consumer_idx * kWarpsPerWarpgroup + warp_idx]);
    const int first_row = consumer_idx * kConsumerRows + warp_idx * 16 + lane_idx / 4;  // and + 8
    const int first_col = 2 * (lane_idx % 4);                                           // + 8 f
    int stage_idx = 0;
    uint32_t phase = 0;
    float acc[kAccRegs];
    float part[kAccRegs];
    // The K group of the next full stage into `part`, asynchronously.
    const auto issue_group = [&] {
        mbarrier_wait(&smem.full[stage_idx], phase);
        fence_accumulators(part);
        wgmma_fence();
        group_mma(smem.a[stage_idx] + consumer_idx * kConsumerRows * kBlockK, smem.b[stage_idx], part);
        wgmma_commit_group();
    };
    // The issued group: its scales read from the stage (while its wgmmas run), its wgmmas waited for, the stage
    // released, and acc += part * (sa * sb).
    const auto complete_group = [&] {
        const float row_scales[2] = {smem.a_scales[stage_idx][first_row], smem.a_scales[stage_idx][first_row + 8]};
        float2 col_scales[kNumFrags];
#pragma unroll
        for (int frag = 0; frag < kNumFrags; ++frag) {
            col_scales[frag] = *reinterpret_cast<const float2*>(&smem.b_scales[stage_idx][frag * 8 + first_col]);
        }
        wgmma_wait_group<0>();
        fence_accumulators(part);
        __syncwarp();  // the warp's scale reads before its release of the stage
        if (lane_idx == 0) {
            if constexpr (kPair == 1) {
                mbarrier_arrive(&smem.empty[stage_idx]);
            } else {
                release_stage<kPair>(&smem.empty[stage_idx]);  // in every CTA of the pair
            }
        }
        advance_stage<kNumStages>(stage_idx, phase);
        promote(acc, part, row_scales, col_scales);
    };
    const int stride = num_clusters<kPair>();
    Tile next = decode_tile<kPair>(params, first_cluster_tile<kPair>(), cta_rank);
    if constexpr (kOverlap) {
        if (next.num_k_blocks > 0) issue_group();  // the first tile's first group
    }
    for (int tile_idx = first_cluster_tile<kPair>(); tile_idx < params.num_tiles; tile_idx += stride) {
        const Tile tile = next;
        next = decode_tile<kPair>(params, tile_idx + stride, cta_rank);  // its loads in flight during this tile
#pragma unroll
        for (int reg_idx = 0; reg_idx < kAccRegs; ++reg_idx) acc[reg_idx] = 0.0f;
        for (int k_block_idx = 0; k_block_idx < tile.num_k_blocks; ++k_block_idx) {
            if constexpr (kOverlap) {
                complete_group();  // issued by the previous iteration, or before this tile's epilogue
                if (k_block_idx + 1 < tile.num_k_blocks) issue_group();
            } else {
                issue_group();
                complete_group();
            }
        }
        if constexpr (kOverlap) {
            if (next.num_k_blocks > 0) issue_group();  // past the last tile: none
        }
        if (tile.store && (!kAccumulate || tile.num_k_blocks > 0)) {
            store_tile<OutT, kAccumulate>(out_map, tile, acc, warp_staging, consumer_idx, warp_idx, lane_idx);
        }
    }
    if (lane_idx == 0) bulk_wait_group<0, false>();  // every store complete before the CTA exits
}

template <typename OutT, bool kAccumulate, int kPair, bool kOverlap>
__global__ void __launch_bounds__(kNumThreads, 1)
    k_grouped_fp8_gemm_sm90_kernel(const __grid_constant__ CUtensorMap a_map, const __grid_constant__ CUtensorMap b_map,
                                   const __grid_constant__ CUtensorMap out_map, const Params params) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ uint8_t smem_raw[];
    const uint32_t misalignment = shared_address(smem_raw) % kSwizzleAtomBytes;
    SharedStorage& smem =
        *reinterpret_cast<SharedStorage*>(smem_raw + (misalignment == 0 ? 0 : kSwizzleAtomBytes - misalignment));
    const int thread_idx = static_cast<int>(threadIdx.x);
    if (thread_idx == 0) {
        for (int stage_idx = 0; stage_idx < kNumStages; ++stage_idx) {
            mbarrier_init(&smem.full[stage_idx], 1);                        // the producer's arrive.expect_tx
            mbarrier_init(&smem.empty[stage_idx], kPair * kEmptyArrivals);  // the pair's consumer warps
        }
        fence_barrier_init();
        prefetch_tensor_map(&a_map);
        prefetch_tensor_map(&b_map);
        prefetch_tensor_map(&out_map);
    }
    if constexpr (kPair == 1) {
        __syncthreads();
    } else {
        cluster_sync();  // barriers initialised in both CTAs before any multicast or remote arrive
    }
    // Launched programmatically (MEGAMOE_SM90_PDL): nothing an earlier kernel wrote (the operands, the routing's
    // tiles) is read before this.
    griddepcontrol_wait();
    griddepcontrol_launch_dependents();
    const int cta_rank = kPair == 1 ? 0 : static_cast<int>(cluster_cta_rank());
    const int warpgroup_idx = __shfl_sync(0xffffffffu, thread_idx / kWarpgroupThreads, 0);
    if (warpgroup_idx == 0) {
        setmaxnreg_dec<kProducerRegs>();
        if (thread_idx == 0) produce<kPair>(&a_map, &b_map, params, smem, cta_rank);
    } else {
        setmaxnreg_inc<kConsumerRegs>();
        consume<OutT, kAccumulate, kPair, kOverlap>(&out_map, params, smem, cta_rank, warpgroup_idx - 1, thread_idx);
    }
    if constexpr (kPair > 1) cluster_sync();  // no CTA leaves while its partner may multicast into it or arrive there
#endif
}

// ---------------------------------------------------------------------------------------------------
// Host side.

// Reduction columns the operands' tensor maps span: every routing tile the host bound allows.
int64_t k_extent(const KGroupedFp8GemmArgs& args) {
    return kBlockK * args.max_tiles;
}

bool operand_ok(const KGroupedFp8Operand& operand, int64_t cols, int64_t extent) {
    return cuda::is_aligned(operand.q_t, 16) && operand.ld % 16 == 0 && operand.ld >= extent &&
           cuda::is_aligned(operand.scales, 16) && operand.ld_scales % 4 == 0 && operand.ld_scales >= cols;
}

// An operand [cols, ld] of bytes as a 2-D tensor map, boxes of kBlockK bytes x box_rows rows, 128-byte swizzle.
bool encode_operand_map(const KGroupedFp8Operand& operand, int64_t cols, int64_t extent, uint32_t box_rows,
                        CUtensorMap* map) {
    return encode_2d_sw128_map(kTensorMapBytes, 1, operand.q_t, cols, extent, operand.ld, box_rows, kBlockK,
                               CU_TENSOR_MAP_L2_PROMOTION_L2_256B, map);
}

// The output [E, M, N] as a 3-D tensor map, boxes of one warp's kTmaStoreRows rows x one 128-byte row of columns.
bool encode_out_map(megamoe_dtype_t out_dtype, void* out, int64_t num_experts, int64_t m, int64_t n, CUtensorMap* map) {
    const bool f32 = out_dtype == MEGAMOE_DTYPE_F32;
    const int64_t elem_bytes = f32 ? 4 : 2;
    const cuuint64_t dims[3] = {static_cast<cuuint64_t>(n), static_cast<cuuint64_t>(m),
                                static_cast<cuuint64_t>(num_experts)};
    const cuuint64_t strides[2] = {static_cast<cuuint64_t>(n * elem_bytes),
                                   static_cast<cuuint64_t>(m * n * elem_bytes)};
    const cuuint32_t box[3] = {static_cast<cuuint32_t>(f32 ? kTmaStoreF32Cols : kTmaStoreCols),
                               static_cast<cuuint32_t>(kTmaStoreRows), 1};
    const CUtensorMapDataType type = f32 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32 : tensor_map_type_of(out_dtype);
    return encode_3d_sw128_map(type, out, dims, strides, box, CU_TENSOR_MAP_L2_PROMOTION_NONE, map);
}

template <typename OutT, bool kAccumulate, int kPair>
megamoe_status_t launch_typed(const CUtensorMap& a_map, const CUtensorMap& b_map, const CUtensorMap& out_map,
                              const Params& params, int num_sms, cudaStream_t stream) {
    const int64_t max_clusters = std::min<int64_t>(std::max(num_sms / kPair, 1), params.num_tiles);
    // MEGAMOE_SM90_FP8_WGRAD_OVERLAP=1's variant for single CTAs only.
    const auto kernel = kPair == 1 && k_grouped_fp8_overlap()
                            ? k_grouped_fp8_gemm_sm90_kernel<OutT, kAccumulate, kPair, kPair == 1>
                            : k_grouped_fp8_gemm_sm90_kernel<OutT, kAccumulate, kPair, false>;
    return launch_cluster_kernel<kPair>(kernel, "k_grouped_fp8_gemm_sm90", kNumThreads, kSmemBytes, max_clusters,
                                        stream, a_map, b_map, out_map, params);
}

template <int kPair>
megamoe_status_t launch_pair(const KGroupedFp8GemmArgs& args, void* out, megamoe_dtype_t out_dtype, Params params,
                             int num_sms, cudaStream_t stream) {
    params.pairs_n = static_cast<int>(ceil_div(static_cast<int64_t>(params.num_n_tiles), int64_t{kPair}));
    const int64_t num_tiles = args.num_experts * params.num_m_tiles * params.pairs_n;
    if (num_tiles > INT32_MAX) {
        return set_error(MEGAMOE_STATUS_NOT_SUPPORTED, "k_grouped_fp8_gemm_sm90: more than 2^31 output tiles");
    }
    params.num_tiles = static_cast<int>(num_tiles);
    const int64_t extent = k_extent(args);
    CUtensorMap a_map{}, b_map{}, out_map{};
    if (!encode_operand_map(args.a, args.m, extent, kBlockM / kPair, &a_map) ||
        !encode_operand_map(args.b, args.n, extent, kBlockN, &b_map) ||
        !encode_out_map(out_dtype, out, args.num_experts, args.m, args.n, &out_map)) {
        return set_error(MEGAMOE_STATUS_CUDA_ERROR, "k_grouped_fp8_gemm_sm90: a tensor map could not be encoded");
    }
    switch (out_dtype) {
        case MEGAMOE_DTYPE_BF16:
            return launch_typed<__nv_bfloat16, false, kPair>(a_map, b_map, out_map, params, num_sms, stream);
        case MEGAMOE_DTYPE_F16:
            return launch_typed<__half, false, kPair>(a_map, b_map, out_map, params, num_sms, stream);
        default:
            return args.accumulate ? launch_typed<float, true, kPair>(a_map, b_map, out_map, params, num_sms, stream)
                                   : launch_typed<float, false, kPair>(a_map, b_map, out_map, params, num_sms, stream);
    }
}

}  // namespace

bool k_grouped_fp8_gemm_sm90_supported(const KGroupedFp8GemmArgs& args, const void* out, megamoe_dtype_t out_dtype) {
    const bool out_ok =
        (out_dtype == MEGAMOE_DTYPE_BF16 || out_dtype == MEGAMOE_DTYPE_F16 || out_dtype == MEGAMOE_DTYPE_F32) &&
        (!args.accumulate || out_dtype == MEGAMOE_DTYPE_F32) && cuda::is_aligned(out, 16);
    const bool sizes_ok = args.m >= 0 && args.n >= 0 && args.m % kBlockM == 0 && args.n % kBlockN == 0 &&
                          args.m <= INT32_MAX && args.n <= INT32_MAX && args.num_experts >= 0 && args.max_tiles >= 0 &&
                          k_extent(args) <= INT32_MAX;
    const int64_t extent = k_extent(args);
    return out_ok && sizes_ok && operand_ok(args.a, args.m, extent) && operand_ok(args.b, args.n, extent) &&
           args.m_tile_offsets != nullptr && tensor_map_encoder() != nullptr;
}

megamoe_status_t launch_k_grouped_fp8_gemm_sm90(const KGroupedFp8GemmArgs& args, void* out, megamoe_dtype_t out_dtype,
                                                int num_sms, cudaStream_t stream) {
    if (!k_grouped_fp8_gemm_sm90_supported(args, out, out_dtype)) {
        return set_error(MEGAMOE_STATUS_NOT_SUPPORTED, "k_grouped_fp8_gemm_sm90: operands not supported");
    }
    if (args.num_experts == 0 || args.m == 0 || args.n == 0) return MEGAMOE_STATUS_SUCCESS;
    const int64_t out_bytes = args.num_experts * args.m * args.n * (out_dtype == MEGAMOE_DTYPE_F32 ? 4 : 2);
    if (args.max_tiles == 0) {  // no rows at all: zeros, or the accumulated values as they are
        if (args.accumulate) return MEGAMOE_STATUS_SUCCESS;
        return cuda::check_cuda(cudaMemsetAsync(out, 0, static_cast<size_t>(out_bytes), stream),
                                "k_grouped_fp8_gemm_sm90 zeros");
    }
    const int64_t num_m_tiles = args.m / kBlockM, num_n_tiles = args.n / kBlockN;
    Params params{};
    params.a_scales = args.a.scales;
    params.ld_a_scales = args.a.ld_scales;
    params.b_scales = args.b.scales;
    params.ld_b_scales = args.b.ld_scales;
    params.m_tile_offsets = args.m_tile_offsets;
    params.num_m_tiles = static_cast<int>(num_m_tiles);
    params.num_n_tiles = static_cast<int>(num_n_tiles);
    return k_grouped_fp8_pairs() ? launch_pair<kClusterSize>(args, out, out_dtype, params, num_sms, stream)
                                 : launch_pair<1>(args, out, out_dtype, params, num_sms, stream);
}

}  // namespace megamoe::sm90
