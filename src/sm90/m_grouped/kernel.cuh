// The fused Hopper (sm_90a) M-grouped GEMM: a persistent, warp-specialized wgmma kernel.
//
// Computes, for the sorted rows r of each expert e (rows [expert_offsets[e], expert_offsets[e + 1])):
//     acc[r, n] = sum_k A[a_row(r), k] * B_e[n, k]
//   a_row(r) = sorted_slot[r] / topk (up projection: rows of x gathered, never copied) or r (down projection).
//   B_e = b + e * b_expert_stride, either [N, K] K-contiguous (BLayout::kNK: w13[e] [2I, H] for up, w2[e] [H, I]
//   for down) or [K, N] N-contiguous (BLayout::kKN: w2[e] read as [K = H, N = I] for the backward's dH,
//   w13[e] read as [K = 2I, N = H] for its dX).
// Epilogues (policy types, m_grouped/epilogue.cuh, m_grouped/dswiglu.cuh): GatedEpilogue (SwiGLUEpilogue by default)
// writes h = [g, u] (+ b13; by sorted row, as saved_h keeps it) and / or a = act(g, u); StoreEpilogueOf writes acc
// (+ b2) in the element type (bf16 / f16), by TMA stores where it can; DSwiGLUEpilogueOf (the backward's dH, acc = p =
// W2[e]^T dy) reads the row's g, u, s and writes dh = [dg, du] (or interleaved), s * a and the tile's partial sum of
// ds = <p, a> (one per row and n-tile, added in n-tile order later: deterministic). The activation is a compile-time
// policy (m_grouped/activation.cuh). f32 accumulation. No atomics: every output element is written once.
//
// Tiles (TileConfig in m_grouped/config.cuh, chosen per epilogue by m_grouped/tile_table.cuh): kBlockM = 128 rows (one
// M tile of the routing's schedule) x kBlockN = 256 columns of B_e x kBlockK = 64 (one
// 128-byte swizzled row of 16-bit elements). For SwiGLU, the kBlockN rows of the B tile are kBlockN / 2 gate rows (TMA
// box 0) followed by the matching up rows I + n0 + [0, kBlockN / 2) (box 1; kKN, w13 stored transposed: the first half
// of the 64-column boxes from gate column n0, the second from I + n0): each thread holds g and u of the same outputs,
// so SwiGLU is register-local; a tile writes kBlockN / 2 columns of a. Interleaved w13: the B tile is kBlockN rows (or
// columns) in storage order, and adjacent accumulator columns are a (g, u) pair, again in one thread.
// Clusters: 2 CTAs run M tiles 2p and 2p + 1 of the schedule with the same n-tile. When both belong to one expert
// (most pairs: experts span many M tiles) they need the same B tile, and each CTA loads one of its two boxes and
// multicasts it to both, which halves B's L2 -> SM traffic. Otherwise each CTA loads both boxes for itself.
// Pairing consecutive 128-row tiles, rather than cutting experts into 256-row tiles, keeps the rows wasted at an
// expert's end below 128 and needs no second M-tile schedule.
//
// Warp roles (3 warpgroups, 384 threads, 1 CTA per SM, as many clusters as fit on the device at once):
//   warpgroup 0, producer (setmaxnreg down to kProducerRegs): thread 0 issues this CTA's B boxes (3-D tensor map
//     over [E, rows of B_e, K], 128-byte swizzle, zero fill out of bounds, multicast when shared). the store epilogue's
//     A (down: a, dX: dh) is the sorted rows themselves: thread 0 loads it too, one 2-D TMA box of kBlockM rows per
//     stage (rows past the expert's end are the next expert's; their results are not stored). For SwiGLU and dSwiGLU
//     (rows of x / dy gathered by slot) all 128 threads gather the A tile with 16-byte cp.async into the same swizzled
//     layout (8 threads per row, 16 rows per pass, 8 passes), zero-filling rows past the expert's end and K past the
//     end (not one-row TMA boxes: the TMA unit is slow on small boxes). Each thread then arms
//     cp.async.mbarrier.arrive.noinc on the stage's full barrier and moves on: the stage is published when all copies
//     have landed (128 such arrivals + thread 0's arrive.expect_tx of the B bytes), with no waiting in the producer.
//     Consumers issue fence.proxy.async after the wait where cp.async filled A (cp.async writes are generic-proxy,
//     wgmma reads through the async proxy; a stage filled by TMA alone needs none). No L2 prefetches (of h for dH's
//     epilogue, or of gathered rows ahead of their stage).
//   warpgroups 1, 2, consumers (setmaxnreg up to kConsumerRegs), cooperative: rows [64 (w - 1), 64 w) of every tile
//     of the CTA. m64 x kBlockN x k16 wgmmas (both operands from shared memory, K-major); one wgmma batch
//     stays in flight, and the stage it read is released when the next batch has been issued: one arrive per warp
//     on the empty barrier of both CTAs (the next fill lands in both). A consumer whose first row block has no
//     valid rows skips its wgmmas but keeps the pipeline going. The epilogue (per row block) transposes accumulator
//     pairs across each quad of lanes and stores 16-byte chunks (64 contiguous bytes per row per warp store). dSwiGLU
//     goes through each warp's 4 KiB of shared memory instead, 16 x 32 sub-tiles: g, u by cp.async (the first
//     sub-tile's issued when the tile starts, with its rows' weights; then one sub-tile ahead), ldmatrix into the
//     accumulator layout, dg, du, s a by stmatrix and out by 16-byte loads and global stores; no quad transposes. The
//     store epilogue: a warp whose 16 rows all lie in the expert stages them 64 columns at a time with stmatrix in one
//     of its two 2 KiB boxes (128-byte swizzle) and lane 0 stores each box by TMA (2-D map over [num_out_rows, n],
//     clipped at n), so the warp is back at its MMAs once its last store is issued; a TMA store cannot stop at the
//     expert's end (the rows after it are the next expert's first tile, another CTA's), so a warp whose rows cross it
//     stores from registers.
// Tile schedule: cluster tiles t over the pairs p of the routing's device-side M-tile schedule (m_tile_offsets; its
// total m_tile_offsets[E] is read on the device, the host only knows a bound) and the n-tiles, in blocks of
// pair_block pairs (m_grouped/tile_order.h; pair_block 1: t = p * num_n_tiles + n_tile); cluster c takes
// t = c, c + num_clusters, ...: tiles that share A rows or B tiles run side by side on neighbouring clusters (read
// once from DRAM, then from L2), the M tiles of one expert follow each other.
// Every tile has the same K, so the static stride stays balanced whatever the routing (hot or empty experts
// only change the number of m-tiles). Producer and consumers walk the same tile sequence; stage and phase run on
// across tiles, so the producer prefetches the next tile while the consumers run the epilogue.
// kKN (MN-major B): the B tile is kBlockN / 64 TMA boxes of 64 N columns (one 128-byte swizzled row) x kBlockK K
// rows, 8 KiB each, box i holding columns n0 + 64 i; wgmma reads B through an MN-major descriptor (transpose bit
// of the atom), 8-row K atoms 1024 bytes apart, N blocks one box apart; a shared tile is multicast as half the
// boxes from each CTA.
// Shared memory (SharedStorage, dynamic, 1024-byte aligned): kNumStages x (A tile 16 KiB + B tile kBlockN x 128 B),
// for the store and dSwiGLU epilogues the per-warp staging (4 KiB per consumer warp, 32 KiB: two TMA store boxes or
// four sub-tile slots), then the full and empty mbarriers;
// the stage count is the most that fits 227 KiB (4 stages of 48 KiB). What was
// measured of these choices (tile shapes, schedules, TMA against cp.async, prefetches): docs/log/.
// Operands (TileConfig's Operands): 16-bit (bf16 / f16, T) as above, or blockwise FP8 (m_grouped_fp8_gemm_sm90.h,
// launched by m_grouped/fp8_gemm.cu): e4m3 A and B, kNK only, a K block of 128 e4m3 (the same 128-byte swizzled
// row, so tiles, boxes, the gather and the epilogues are unchanged; T is then the output type) is one scale group;
// the mainloop (m_grouped/fp8_mainloop.cuh) applies the scales per group to the 128 x 256 tile's one set of
// accumulators, kept in the current group's units (rescaled when the group's scale changes).
#pragma once

#include "sm90/m_grouped_gemm_sm90.h"

#include <algorithm>
#include <limits>
#include <type_traits>
#include <utility>

#include "device/cuda_utils.h"
#include "device/grouped_gemm_args.h"
#include "sm90/kit/store.cuh"
#include "sm90/kit/launch.h"
#include "sm90/kit/pipeline.cuh"
#include "sm90/m_grouped/config.cuh"
#include "sm90/m_grouped/dswiglu.cuh"
#include "sm90/m_grouped/epilogue.cuh"
#include "sm90/m_grouped/fp8_mainloop.cuh"
#include "sm90/m_grouped/mainloop.cuh"
#include "sm90/m_grouped/scheduler.cuh"
#include "sm90/m_grouped/host.cuh"
#include "sm90/m_grouped/tile_table.cuh"
#include "sm90/kit/ptx.h"

namespace megamoe::sm90::m_grouped {

using cuda::ceil_div;

// The kernel's parts for one epilogue policy, B layout, B source and tile configuration.
template <typename T, class Epi, BLayout kBLayout, BSource kBSource, class Config>
struct Kernel {
    using Storage = SharedStorage<Config, Epi::kWarpStagingBytes>;
    static constexpr int kNumStages = num_stages<Config, Epi::kWarpStagingBytes>();
    using Pipeline = StagePipeline<kNumStages, kClusterSize>;
    using Loader = StageLoader<Config, Epi, kBLayout, kBSource>;
    using Mainloop =
        std::conditional_t<Config::kFp8, Fp8Mainloop<Config, Epi>, WgmmaMainloop<T, Config, Epi, kBLayout>>;
    static_assert(!Config::kFp8 || kBLayout == BLayout::kNK, "FP8 wgmma reads B K-major");

    // Consumer warpgroup `consumer_idx`: every tile of the CTA, rows [64 consumer_idx, + 64): the mainloop, then the
    // epilogue (whose per-tile loads are issued before the mainloop).
    __device__ __forceinline__ static void consume(const CUtensorMap* out_map, const MainloopParams& params,
                                                   const typename Epi::Params& epilogue,
                                                   const ScaleParamsOf<Config>& scales, const Pipeline& pipeline,
                                                   Storage& smem, Scheduler scheduler, int num_k_blocks,
                                                   int consumer_idx, int thread_idx) {
        const int lane_idx = thread_idx % kWarpSize;
        const int warp_idx = (thread_idx % kWarpgroupThreads) / kWarpSize;
        uint32_t warp_staging = 0;  // the warp's staging (TMA store boxes, dSwiGLU's sub-tile slots)
        if constexpr (Epi::kStaging) {
            warp_staging =
                shared_address(smem.staging.boxes) +
                static_cast<uint32_t>((consumer_idx * kWarpsPerWarpgroup + warp_idx) * Epi::kWarpStagingBytes);
        }
        const int row_block = consumer_idx;  // the consumer's 64-row block of a tile
        typename Pipeline::State state;
        float acc[Config::kNumAccRegs];
        for (Tile tile; scheduler.next(tile, lane_idx);) {
            const typename Epi::TileState epilogue_state =  // its loads stay in flight during the mainloop
                Epi::template begin_tile<Config>(params, epilogue, tile, row_block, warp_staging, warp_idx, lane_idx);
            Mainloop::mma_tile(pipeline, state, smem, params, scales, tile, num_k_blocks, row_block, warp_idx, lane_idx,
                               acc);
            Epi::template store<T, Config>(out_map, params, epilogue, tile, acc, epilogue_state, warp_staging,
                                           row_block, warp_idx, lane_idx);
        }
        Epi::finish(lane_idx);
    }
};

// `b_second_map` (after the others, so the kBSource::kOne kernels' parameters keep their offsets): B's second map.
template <typename T, class Epi, BLayout kBLayout, BSource kBSource, class Config>
__global__ void __launch_bounds__(kNumThreads, 1)
    m_grouped_gemm_sm90_kernel(const __grid_constant__ CUtensorMap a_map, const __grid_constant__ CUtensorMap b_map,
                               const __grid_constant__ CUtensorMap out_map,
                               const KernelParams<typename Epi::Params, ScaleParamsOf<Config>> params,
                               const __grid_constant__ CUtensorMap b_second_map) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using Parts = Kernel<T, Epi, kBLayout, kBSource, Config>;
    using Storage = typename Parts::Storage;
    extern __shared__ uint8_t smem_raw[];
    const uint32_t misalignment = shared_address(smem_raw) % kSwizzleAtomBytes;
    Storage& smem = *reinterpret_cast<Storage*>(smem_raw + (misalignment == 0 ? 0 : kSwizzleAtomBytes - misalignment));
    const typename Parts::Pipeline pipeline{smem.full, smem.empty};

    const int thread_idx = static_cast<int>(threadIdx.x);
    if (thread_idx == 0) {
        for (int stage_idx = 0; stage_idx < Parts::kNumStages; ++stage_idx) {
            mbarrier_init(&smem.full[stage_idx], Parts::Loader::kFullArrivals);
            mbarrier_init(&smem.empty[stage_idx], kClusterSize * Config::kEmptyArrivalsPerCta);
        }
        fence_barrier_init();
        prefetch_tensor_map(&b_map);
        if (kBSource != BSource::kOne) prefetch_tensor_map(&b_second_map);
        if (Epi::kTmaA) prefetch_tensor_map(&a_map);
        Epi::prefetch_maps(params.epilogue, &out_map);
    }
    cluster_sync();  // barriers initialised in both CTAs before any multicast or remote arrive
    const uint32_t cta_rank = cluster_cta_rank();

    const MainloopParams& mainloop = params.mainloop;
    const int num_m_tiles = mainloop.m_tile_offsets[mainloop.num_experts];
    const Scheduler scheduler(mainloop, num_m_tiles, cta_rank);
    const int num_k_maps = kBSource == BSource::kKHalves ? 2 : 1;  // K halves: the K blocks of each map in turn
    const auto num_k_blocks = static_cast<int>(num_k_maps * ceil_div(mainloop.k, Config::kBlockK));
    const int warpgroup_idx = __shfl_sync(0xffffffffu, thread_idx / kWarpgroupThreads, 0);
    if (warpgroup_idx == 0) {
        setmaxnreg_dec<kProducerRegs>();
        Parts::Loader::run(&a_map, &b_map, &b_second_map, mainloop, pipeline, smem, scheduler, num_k_blocks, cta_rank,
                           thread_idx);
    } else {
        setmaxnreg_inc<kConsumerRegs>();
        Parts::consume(&out_map, mainloop, params.epilogue, params.scales, pipeline, smem, scheduler, num_k_blocks,
                       warpgroup_idx - 1, thread_idx);
    }
    cluster_sync();  // no CTA leaves while the other may still arrive on its barriers
#endif
}

// ---------------------------------------------------------------------------------------------------
// Host side (the tensor maps of A and B and the mainloop's params: m_grouped/host.cuh): the launch.

template <typename T, class Epi, BLayout kBLayout, BSource kBSource, class Config>
megamoe_status_t launch_typed(const cuda::MGroupedGemmArgs& args,
                              const KernelParams<typename Epi::Params, ScaleParamsOf<Config>>& params,
                              const CUtensorMap& a_map, const CUtensorMap& out_map, int64_t rows_per_expert,
                              int64_t cols_per_row, int num_sms, cudaStream_t stream) {
    CUtensorMap b_map;
    CUtensorMap b_second_map{};
    if (!encode_b_tensor_map<Config>(args, args.b, kBLayout, rows_per_expert, cols_per_row, &b_map) ||
        (kBSource != BSource::kOne &&
         !encode_b_tensor_map<Config>(args, args.b_up, kBLayout, rows_per_expert, cols_per_row, &b_second_map))) {
        return set_error(MEGAMOE_STATUS_CUDA_ERROR, "m_grouped_gemm_sm90: cuTensorMapEncodeTiled failed");
    }
    const int64_t max_tiles = ceil_div(args.max_m_tiles, kClusterSize) * params.mainloop.num_n_tiles;  // cluster tiles
    const int64_t max_clusters = std::min<int64_t>(std::max(num_sms, kClusterSize) / kClusterSize, max_tiles);
    return launch_cluster_kernel<kClusterSize>(m_grouped_gemm_sm90_kernel<T, Epi, kBLayout, kBSource, Config>,
                                               Epi::name(kBLayout), kNumThreads,
                                               smem_bytes<Config, Epi::kWarpStagingBytes>(), max_clusters, stream,
                                               a_map, b_map, out_map, params, b_second_map);
}

// `a_map`: A's tensor map where Epi::kTmaA (kBSource::kKHalves: encode_a_halves_map's); `out_map`: the store
// epilogue's output tensor map where its params say tma_store; else unused. kBSource other than kOne: the second B
// map over args.b_up (kUpHalf: B_e has n rows in each tensor; kKHalves: args.k / 2 rows of K in each). `scales`: the
// FP8 operands' (Config::kFp8).
template <class Epi, BLayout kBLayout, BSource kBSource, class Config>
megamoe_status_t launch_on(const cuda::MGroupedGemmArgs& args, const typename Epi::Params& epilogue, int num_sms,
                           cudaStream_t stream, const CUtensorMap& a_map, const CUtensorMap& out_map,
                           const ScaleParamsOf<Config>& scales = {}) {
    static_assert(!Epi::kGateUpHalves || Epi::kGateUpPairs, "gate / up halves are pairs");
    constexpr bool kPairs = Epi::kGateUpPairs;
    constexpr bool kUpHalf = kBSource == BSource::kUpHalf;
    KernelParams<typename Epi::Params, ScaleParamsOf<Config>> params{make_mainloop_params(args), epilogue, scales};
    params.mainloop.num_n_tiles = ceil_div(args.n, kPairs ? Config::kBlockN / 2 : Config::kBlockN);
    const int64_t b_bytes = args.pair_blocks_always ? std::numeric_limits<int64_t>::max()  // as if over the L2
                                                    : (kPairs ? 2 : 1) * args.n * args.k * Config::kOperandBytes;
    params.mainloop.pair_block =
        pair_block_for(int64_t{kClusterSize} * kBlockM, args.k, Config::kOperandBytes, b_bytes);
    params.mainloop.second_box_row_offset = kUpHalf ? 0 : Epi::kGateUpHalves ? args.n : Config::kBBoxRows;
    if (kBSource == BSource::kKHalves) params.mainloop.k = args.k / 2;
    if (args.max_m_tiles == 0 || params.mainloop.num_n_tiles == 0) return MEGAMOE_STATUS_SUCCESS;
    const int64_t b_n = kPairs && !kUpHalf ? 2 * args.n : args.n;  // N extent of B_e (of each tensor)
    const int64_t b_k = params.mainloop.k;                         // K extent of B_e (of each tensor)
    const int64_t rows_per_expert = kBLayout == BLayout::kKN ? b_k : b_n;
    const int64_t cols_per_row = kBLayout == BLayout::kKN ? b_n : b_k;
    return args.dtype == MEGAMOE_DTYPE_BF16
               ? launch_typed<__nv_bfloat16, Epi, kBLayout, kBSource, Config>(
                     args, params, a_map, out_map, rows_per_expert, cols_per_row, num_sms, stream)
               : launch_typed<__half, Epi, kBLayout, kBSource, Config>(args, params, a_map, out_map, rows_per_expert,
                                                                       cols_per_row, num_sms, stream);
}

// The launch on the epilogue's tile configuration (ConfigOf).
template <class Epi, BLayout kBLayout, BSource kBSource = BSource::kOne>
megamoe_status_t launch(const cuda::MGroupedGemmArgs& args, const typename Epi::Params& epilogue, int num_sms,
                        cudaStream_t stream, const CUtensorMap& a_map = CUtensorMap{},
                        const CUtensorMap& out_map = CUtensorMap{}) {
    return launch_on<Epi, kBLayout, kBSource, ConfigOf<Epi>>(args, epilogue, num_sms, stream, a_map, out_map);
}

}  // namespace megamoe::sm90::m_grouped
