// The fused Hopper (sm_90a) K-grouped GEMM of the weight gradients: a persistent, warp-specialized wgmma kernel.
//
// Computes, for every expert e and its sorted rows r in [expert_offsets[e], expert_offsets[e + 1]):
//     C_e[m, n] = sum_r A[a_row(r), m] * B[b_row(r), n]          (f32 accumulation, out [E, M, N])
//   a_row(r) = r, or sorted_slot[r] / topk when A is gathered (the same rule for B).
//   dW13: A = dh [rows, 2I], B = x gathered [T, H]; dW2: A = dy gathered [T, H], B = s * a [rows, I].
// The reduction runs over the expert's rows: both operands are MN-major (M or N contiguous) in shared memory.
//
// Tiles (the tile table, k_grouped/config.cuh): kBlockM x kBlockN outputs x kBlockK = 64 reduction rows per stage,
// 128 x 256 (NarrowATile) or, where B is gathered and A comes by TMA (dW13), 256 x 128 (WideATile): the gathered
// operand is always the 128-wide one. An operand tile is stored as 64-element blocks of its MN dimension (one 128-byte
// row per reduction row, 128-byte swizzle), kBlockK rows each (8 KiB), exactly as a TMA box of 64 MN x 64 rows lands.
// wgmma reads both through MN-major descriptors (transpose bits of the atom): 8-row atoms 1024 bytes apart, MN blocks
// 8 KiB apart, 2048 bytes per k16 step; a consumer's m64 row block is one A block.
// Loads: an ungathered operand (dh, s * a: rows contiguous by sorted row) comes by TMA (2-D tensor map over [rows,
// M or N], 128-byte swizzle, columns past M / N zero-filled) for every whole k-block of the expert; the expert's
// last, partial k-block and every gathered operand are copied with 16-byte cp.async, zero-filling rows past the
// expert's end (TMA would read the next expert's rows, or unwritten ones) and columns past M or N. Gather indices
// cost one load per producer thread per stage, issued a stage ahead (across tile boundaries too): lane j < 16 of a
// warp loads the index of one of the warp's 16 rows of the stage, divides it by topk (multiply and shift) when the
// stage comes, and the copying lanes take it by shuffle: a gathered 16-byte copy is a shuffle, one wide multiply-add
// and the cp.async. The producer decodes its next tile a whole tile ahead, the consumers while their tile's last batch
// of wgmmas runs (divisions by launch constants as multiply-high and shift, device/int_divisor.h), so no tile start
// waits for its expert offsets.
// Clusters: 2 CTAs run two output tiles of the same expert that share the TMA operand: neighbouring n-tiles (same
// A) when A is ungathered (dW13), else neighbouring m-tiles (same B, dW2); where both are, the wider one. Each CTA
// loads half of the shared operand's boxes and multicasts them to both, halving its L2 -> SM traffic; with an odd tile
// count the second CTA recomputes the first one's tile without storing it, so both always walk the same expert and stay
// in step. Tile schedule: cluster tile t = (expert, pair), expert-major, so clusters running at the same time read the
// same expert's rows (from L2). A tile's work is its expert's rows. Balanced routing: cluster c takes t = c, c +
// num_clusters, ... (the static stride, computed by every thread itself, without the tile ring). Skewed routing
// (order_experts_kernel, run before each launch, finds the busiest expert above kSkewedRowsRatio x the mean): the
// experts go heaviest first (experts_by_rank) and cluster c starts with t = c, then claims t = num_clusters +
// atomicAdd(tile_counter, 1) whenever it starts a tile, so the clusters end within about one light tile of each other.
// Without the scratch (NULL tile_counter): the static stride. Each CTA loops over every row of the tile's expert in
// order: no split-K, no atomics on the output, bitwise deterministic; an expert with no rows writes zeros.
// Tile ring: the leader CTA's producer thread 0 claims each cluster tile kClaimAhead tiles ahead and writes it into
// slot s % kTileRing of both CTAs' rings (its own: a store and an arrival; the other's: st.async completing the
// transaction bytes its full barrier expects, as a TMA load would, so neither side fences at cluster scope); every
// warp of both CTAs reads it there and then arrives on the leader's empty barrier of the slot, which the leader
// waits for before writing into the slot again.
//
// Warp roles (3 warpgroups, 384 threads, 1 CTA per SM):
//   warpgroup 0, producer (setmaxnreg down to kProducerRegs): thread 0 issues the stage's TMA boxes after an
//     arrive.expect_tx of their bytes (a plain arrive when the stage has none); all 128 threads issue the cp.async
//     copies (a 128-wide operand: 16 threads per row, 8 rows per pass, 8 passes; 256-wide: 32 threads per row, 4 rows
//     per pass, 16 passes) and arm cp.async.mbarrier.arrive.noinc on the stage's full barrier (kFullArrivals).
//   warpgroups 1, 2, consumers (setmaxnreg up to kConsumerRegs): rows [kBlockM / 2 (w - 1), kBlockM / 2 w) of the M
//     tile as m64 row blocks, m64 x kBlockN x k16 wgmmas, one batch in flight; a stage is released (one arrive per
//     warp on its empty barrier in both CTAs of the cluster: the next fill may be multicast into both) once the next
//     batch has been issued. Consumers fence the async proxy after the full wait (cp.async writes are generic-proxy).
//     Epilogue, per row block, element type: each warp packs its 16 rows 64 columns at a time into one of two 2 KiB
//     staging boxes (stmatrix, 128-byte swizzle) and lane 0 stores the box by TMA (3-D map over [E, M, N], clipped at
//     M and N), so the warp is back at its MMAs once its last store is issued and the global writes overlap the next
//     tile; f32 (or without the tensor map): quad transpose and 16-byte stores, or 8-byte f32 pairs, from registers.
//     kAccumulate (f32 only): each thread loads its f32 pairs of a row at once (one round trip per row; a row crossing
//     N pair by pair), adds its accumulators and stores them back, each element by its one thread; a tile whose expert
//     has no rows is not stored at all (the buffer stays as it is).
// Shared memory (SharedStorage, dynamic, 1024-byte aligned): 4 stages (A + B tile, 48 KiB), 2 store boxes per consumer
// warp (each chunk's store waits for the previous chunk's to have read its box), the stages' full and empty
// mbarriers, then the tile ring. What was measured of these choices: docs/log/.
#include "sm90/k_grouped_gemm_sm90.h"

#include <algorithm>
#include <type_traits>
#include <utility>

#include "device/cuda_utils.h"
#include "sm90/kit/store.cuh"
#include "sm90/k_grouped/config.cuh"
#include "sm90/k_grouped/epilogue.cuh"
#include "sm90/k_grouped/host.cuh"
#include "sm90/k_grouped/scheduler.cuh"
#include "sm90/kit/launch.h"
#include "sm90/kit/pipeline.cuh"
#include "sm90/kit/ptx.h"

namespace megamoe::sm90 {
namespace {

using cuda::ceil_div;

using namespace k_grouped;  // NOLINT(google-build-using-namespace): the kernel's own configuration and schedule

// Row block kRowBlock's accumulators += its A rows (64 x 16) x B (kBlockN x 16)^T, asynchronously.
template <class Shape, typename T, int kRowBlock, int kNumRegs>
__device__ __forceinline__ void row_block_wgmma(uint64_t desc_a, uint64_t desc_b, float (&acc)[kNumRegs]) {
    static_assert((kRowBlock + 1) * Shape::kBlockRegs <= kNumRegs, "the row block's accumulators are the consumer's");
    wgmma_unpacked<WgmmaOp<T, Shape::kBlockN, gmma::Major::MN, gmma::Major::MN>, kRowBlock * Shape::kBlockRegs>(
        desc_a, desc_b, acc, std::make_index_sequence<Shape::kBlockRegs>{});
}

// Byte offset of 16-byte chunk `chunk_idx` (along MN) of reduction row `row` in an MN-major stage tile.
__device__ __forceinline__ uint32_t mn_major_offset(int row, int chunk_idx) {
    constexpr int kChunksPerBlock = kMnBlockElems / kChunkElems;
    return static_cast<uint32_t>(chunk_idx / kChunksPerBlock * kMnBlockBytes) +
           swizzle_128b_offset(row, chunk_idx % kChunksPerBlock);
}

// The gather slot of this lane's index row of the k-block starting at sorted row `block_first_row` (lane j of warp w
// holds row j % kIndexLanes of the warp's rows: pass j / kWarpRows, sub-row j % kWarpRows), or 0 when the operand is
// not gathered. Rows past the expert's end read its last row instead (their copies are zero-filled). Not divided by
// topk here: the load stays in flight until the stage is issued.
template <typename Shape>
__device__ __forceinline__ int load_gather_slot(const Operand& operand, int block_first_row, int row_end,
                                                int thread_idx) {
    if (operand.gather_slots == nullptr) return 0;
    const int warp_idx = thread_idx / kWarpSize;
    const int index_lane = thread_idx % kWarpSize % kIndexLanes;
    const int stage_row = warp_idx * Shape::kWarpRows + index_lane % Shape::kWarpRows +
                          index_lane / Shape::kWarpRows * Shape::kRowsPerPass;
    return operand.gather_slots[min(block_first_row + stage_row, row_end - 1)];
}

// One operand's share of a stage by cp.async into the tile at shared address `tile`: row stage_row = first_row +
// kRowsPerPass p of the tile is sorted row block_first_row + stage_row, its source row (kGathered) the token this
// thread's warp loaded for it, taken by shuffle, or else that sorted row, clamped to the expert's last row (rows past
// the end are zero-filled: their source address only has to be valid). kWhole: every row of the stage is inside the
// expert, so no pass tests its row. A gathered pass is a shuffle, one wide multiply-add and the copy. kRowsPerPass is
// a multiple of 4, so stage_row's swizzle phase (row % 8) is first_row's with bit 2 flipped when kRowsPerPass p % 8 ==
// 4: every pass stores at one of two addresses plus a constant.
template <typename Shape, bool kGathered, bool kWhole>
__device__ __forceinline__ void copy_operand(uint32_t tile, const Operand& operand, int token, int block_first_row,
                                             int row_end, int thread_idx, int col, bool col_valid) {
    static_assert(Shape::kRowsPerPass % 4 == 0, "a pass keeps the swizzle phase or flips its bit 2");
    const int chunk_idx = thread_idx % Shape::kThreadsPerRow, first_row = thread_idx / Shape::kThreadsPerRow;
    const int sub_row = thread_idx % kWarpSize / Shape::kThreadsPerRow;
    const int rows_left = row_end - block_first_row - first_row;
    const uint64_t col_base = global_address(operand.data + (col_valid ? col : 0));
    const auto row_bytes = static_cast<uint32_t>(operand.ld) * kElemBytes;  // ld < 2^31 elements
    const uint32_t first_dst = tile + mn_major_offset(first_row, chunk_idx);
#pragma unroll
    for (int pass = 0; pass < Shape::kPasses; ++pass) {
        const int row_offset = pass * Shape::kRowsPerPass;
        int src_row;
        if constexpr (kGathered) {
            src_row = __shfl_sync(0xffffffffu, token, pass * Shape::kWarpRows + sub_row);
        } else {
            src_row = min(block_first_row + first_row + row_offset, row_end - 1);
        }
        const bool valid = col_valid && (kWhole || row_offset < rows_left);
        const uint32_t dst = (first_dst ^ (static_cast<uint32_t>(row_offset % 8) * kChunkBytes)) +
                             static_cast<uint32_t>(row_offset * kSwizzleBytes);
        cp_async_16(dst, col_base + static_cast<uint64_t>(static_cast<uint32_t>(src_row)) * row_bytes, valid);
    }
}

// One operand's cp.async share of a stage: gathered or not, whole or not (uniform branches outside the passes).
template <typename Shape>
__device__ __forceinline__ void copy_stage_operand(uint32_t tile, const Operand& operand, int slot,
                                                   const IntDivisor& topk, int block_first_row, int row_end,
                                                   int thread_idx, int col, bool col_valid) {
    const bool whole = block_first_row + kBlockK <= row_end;
    if (operand.gather_slots != nullptr) {
        const int token = topk.divide(slot);  // the slot's token row
        if (whole) {
            copy_operand<Shape, true, true>(tile, operand, token, block_first_row, row_end, thread_idx, col, col_valid);
        } else {
            copy_operand<Shape, true, false>(tile, operand, token, block_first_row, row_end, thread_idx, col,
                                             col_valid);
        }
    } else {
        copy_operand<Shape, false, false>(tile, operand, 0, block_first_row, row_end, thread_idx, col, col_valid);
    }
}

// One operand tile of a whole k-block by TMA (thread 0): every box, or, when the pair shares it, this CTA's half
// multicast to both.
template <typename Shape>
__device__ __forceinline__ void load_operand_tma(uint8_t* tile, const CUtensorMap* tensor_map, uint64_t* full,
                                                 int mn_begin, int block_first_row, bool shared, int cta_rank) {
#pragma unroll
    for (int box_idx = 0; box_idx < Shape::kNumBoxes; ++box_idx) {
        uint8_t* box = tile + box_idx * kMnBlockBytes;
        const int32_t col = mn_begin + box_idx * kMnBlockElems;
        if (!shared) {
            tma_load_2d(box, tensor_map, full, col, block_first_row);
        } else if (box_idx / Shape::kBoxesPerCta == cta_rank) {
            tma_load_2d_multicast(box, tensor_map, full, col, block_first_row, kClusterMask);
        }
    }
}

// The producer warpgroup, stage by stage over every k-block of this CTA's tiles. The next tile is decoded a whole tile
// ahead and the next stage's gather indices load one stage ahead, across tile boundaries too, so neither a tile's
// expert offsets nor its first indices are waited for when it starts.
template <class Shape, class Pipeline, class Storage>
__device__ __forceinline__ void produce(const CUtensorMap* a_map, const CUtensorMap* b_map, const KernelParams& params,
                                        const Pipeline& pipeline, Storage& smem, int cta_rank, int thread_idx) {
    using ATile = typename Shape::ATile;
    using BTile = typename Shape::BTile;
    const bool a_shared = params.share && !params.pair_along_m;
    const bool b_shared = params.share && params.pair_along_m;
    const int lane_idx = thread_idx % kWarpSize;
    Scheduler<Shape> scheduler(params, &smem.ring, cta_rank == 0 && thread_idx == 0, cta_rank);
    typename Pipeline::State state;
    Tile tile;
    bool has_tile = scheduler.next(tile, lane_idx);
    bool slots_loaded = false;  // a_next_slot / b_next_slot hold the indices of the next stage
    int a_next_slot = 0, b_next_slot = 0;
    while (has_tile) {
        Tile next;
        const bool has_next = scheduler.next(next, lane_idx);
        const int a_col = tile.m_begin + thread_idx % ATile::kThreadsPerRow * kChunkElems;
        const int b_col = tile.n_begin + thread_idx % BTile::kThreadsPerRow * kChunkElems;
        for (int k_block_idx = 0; k_block_idx < tile.num_k_blocks; ++k_block_idx) {
            const int block_first_row = tile.row_begin + k_block_idx * kBlockK;
            if (!slots_loaded) {  // the first stage, or the previous tile was empty
                a_next_slot = load_gather_slot<ATile>(params.a, block_first_row, tile.row_end, thread_idx);
                b_next_slot = load_gather_slot<BTile>(params.b, block_first_row, tile.row_end, thread_idx);
            }
            const int a_slot = a_next_slot, b_slot = b_next_slot;
            // The next stage's indices load while this one waits: the next k-block, or the next tile's first.
            const bool last_block = k_block_idx + 1 == tile.num_k_blocks;
            const int next_first_row = last_block ? next.row_begin : block_first_row + kBlockK;
            const int next_row_end = last_block ? next.row_end : tile.row_end;
            slots_loaded = next_first_row < next_row_end;
            if (slots_loaded) {
                a_next_slot = load_gather_slot<ATile>(params.a, next_first_row, next_row_end, thread_idx);
                b_next_slot = load_gather_slot<BTile>(params.b, next_first_row, next_row_end, thread_idx);
            }
            // The same for both CTAs of the cluster (same expert, same k-block): a shared tile is loaded by both.
            const bool whole_block = block_first_row + kBlockK <= tile.row_end;
            const bool a_tma = params.a.tma && whole_block, b_tma = params.b.tma && whole_block;
            uint8_t* tile_a = smem.a[state.index];
            uint8_t* tile_b = smem.b[state.index];
            uint64_t* full = pipeline.full_barrier(state);
            pipeline.producer_acquire(state);
            if (thread_idx == 0) {
                const uint32_t tma_bytes = (a_tma ? ATile::kBytes : 0) + (b_tma ? BTile::kBytes : 0);
                if (tma_bytes == 0) {
                    mbarrier_arrive(full);
                } else {
                    fence_proxy_async_shared();  // the stage may last have been written by cp.async
                    mbarrier_arrive_expect_tx(full, tma_bytes);
                    if (a_tma) {
                        load_operand_tma<ATile>(tile_a, a_map, full, tile.m_begin, block_first_row, a_shared,
                                                cta_rank);
                    }
                    if (b_tma) {
                        load_operand_tma<BTile>(tile_b, b_map, full, tile.n_begin, block_first_row, b_shared,
                                                cta_rank);
                    }
                }
            }
            if (!a_tma) {
                copy_stage_operand<ATile>(shared_address(tile_a), params.a, a_slot, params.topk, block_first_row,
                                          tile.row_end, thread_idx, a_col, a_col < params.m);
            }
            if (!b_tma) {
                copy_stage_operand<BTile>(shared_address(tile_b), params.b, b_slot, params.topk, block_first_row,
                                          tile.row_end, thread_idx, b_col, b_col < params.n);
            }
            cp_async_mbarrier_arrive_noinc(full);
            state.advance();
        }
        has_tile = has_next;
        tile = next;
    }
    cuda::cp_async_commit();
    cuda::cp_async_wait<0>();  // no copy outlives its thread
}

template <class Shape, typename T, typename OutT, class Pipeline, class Storage>
__device__ __forceinline__ void consume(const CUtensorMap* out_map, const KernelParams& params,
                                        const Pipeline& pipeline, Storage& smem, int cta_rank, int consumer_idx,
                                        int thread_idx) {
    const int lane_idx = thread_idx % kWarpSize;
    const int warp_idx = (thread_idx % kWarpgroupThreads) / kWarpSize;
    const uint32_t warp_staging = shared_address(smem.staging[consumer_idx * kWarpsPerWarpgroup + warp_idx]);
    typename Pipeline::State state;
    float acc[Shape::kNumAccRegs];
    Scheduler<Shape> scheduler(params, &smem.ring, false, cta_rank);
    Tile tile;
    bool has_tile = scheduler.next(tile, lane_idx);
    while (has_tile) {
        int in_flight_stage = -1;
#pragma unroll
        for (int reg_idx = 0; reg_idx < Shape::kNumAccRegs; ++reg_idx) acc[reg_idx] = 0.0f;
        for (int k_block_idx = 0; k_block_idx < tile.num_k_blocks; ++k_block_idx) {
            pipeline.consumer_wait(state);
            fence_proxy_async_shared();  // cp.async wrote the tiles (generic proxy), wgmma reads them (async proxy)
            const uint8_t* tile_a = smem.a[state.index] + consumer_idx * Shape::kRowBlocks * kMnBlockBytes;
            const uint64_t desc_b = make_smem_desc_mn_major_sw128<kMnBlockBytes>(smem.b[state.index]);
            fence_accumulators(acc);
            wgmma_fence();
            for_each_index<Shape::kRowBlocks>([&](auto row_block) {  // row block b: the consumer's A block b
                constexpr int kRowBlock = decltype(row_block)::value;
                const uint64_t desc_a =
                    make_smem_desc_mn_major_sw128<kMnBlockBytes>(tile_a + kRowBlock * kMnBlockBytes);
#pragma unroll
                for (int k_step = 0; k_step < kBlockK / kWgmmaK; ++k_step) {
                    row_block_wgmma<Shape, T, kRowBlock>(desc_a + k_step * kDescMnK16Step,
                                                         desc_b + k_step * kDescMnK16Step, acc);
                }
            });
            wgmma_commit_group();
            pipeline.retire_previous_batch(acc, state, in_flight_stage, lane_idx);
        }
        // The next tile, read and decoded while this tile's last batch runs: its integer work and its load of the
        // expert's rows are off the path from this tile's epilogue to the next tile's first wgmmas.
        Tile next;
        const bool has_next = scheduler.next(next, lane_idx);
        pipeline.retire_last_batch(acc, in_flight_stage, lane_idx);
        if (tile.store && (!params.accumulate || tile.num_k_blocks > 0)) {
            Epilogue<Shape, T, OutT, Storage::kStoreBoxesPerWarp>::store(out_map, params, tile, acc, warp_staging,
                                                                         consumer_idx, warp_idx, lane_idx);
        }
        has_tile = has_next;
        tile = next;
    }
    if (lane_idx == 0) bulk_wait_group<0, false>();  // every store complete before the CTA exits
}

template <class Shape, typename T, typename OutT, int kStoreBoxes>
__global__ void __launch_bounds__(kNumThreads, 1)
    k_grouped_gemm_sm90_kernel(const __grid_constant__ CUtensorMap a_map, const __grid_constant__ CUtensorMap b_map,
                               const __grid_constant__ CUtensorMap out_map, const KernelParams params) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using Storage = SharedStorage<Shape, kStoreBoxes>;
    extern __shared__ uint8_t smem_raw[];
    const uint32_t misalignment = shared_address(smem_raw) % kSwizzleAtomBytes;
    Storage& smem = *reinterpret_cast<Storage*>(smem_raw + (misalignment == 0 ? 0 : kSwizzleAtomBytes - misalignment));

    const int thread_idx = static_cast<int>(threadIdx.x);
    if (thread_idx == 0) {
        for (int stage_idx = 0; stage_idx < Storage::kNumStages; ++stage_idx) {
            mbarrier_init(&smem.full[stage_idx], kFullArrivals);
            mbarrier_init(&smem.empty[stage_idx], kClusterSize * kEmptyArrivalsPerCta);
        }
        for (int slot = 0; slot < kTileRing; ++slot) {
            mbarrier_init(&smem.ring.full[slot], 1);
            mbarrier_init(&smem.ring.empty[slot], kRingArrivals);
        }
        fence_barrier_init();
        if (params.a.tma) prefetch_tensor_map(&a_map);
        if (params.b.tma) prefetch_tensor_map(&b_map);
        if (params.tma_store) prefetch_tensor_map(&out_map);
    }
    cluster_sync();  // barriers initialised in both CTAs before any multicast or remote arrive
    const auto cta_rank = static_cast<int>(cluster_cta_rank());
    const StagePipeline<Storage::kNumStages, kClusterSize> pipeline{smem.full, smem.empty};
    const int warpgroup_idx = __shfl_sync(0xffffffffu, thread_idx / kWarpgroupThreads, 0);
    if (warpgroup_idx == 0) {
        setmaxnreg_dec<kProducerRegs>();
        produce<Shape>(&a_map, &b_map, params, pipeline, smem, cta_rank, thread_idx);
    } else {
        setmaxnreg_inc<kConsumerRegs>();
        consume<Shape, T, OutT>(&out_map, params, pipeline, smem, cta_rank, warpgroup_idx - 1, thread_idx);
    }
    cluster_sync();  // no CTA leaves while the other may still multicast into it or arrive on its barriers
#endif
}

// The schedule of one launch: tile_counter[1] = 1 (claim greedily) when the busiest expert has more than
// kSkewedRowsRatio x the mean rows, else 0 (the static stride);
// tile_counter[0] = 0; experts_by_rank[r] = {e, its first sorted row, its row end, 0} for the expert e of rank r, by
// rows, most first (ties: lower index first) when claiming and E <= kMaxOrderedExperts, else e = r. One block: each
// expert counts the experts ranked before it.
__global__ void __launch_bounds__(kOrderThreads)
    order_experts_kernel(const int* expert_offsets, int num_experts, int4* experts_by_rank, int* tile_counter) {
    __shared__ int num_rows[kMaxOrderedExperts];
    __shared__ int max_rows;
    const int thread_idx = static_cast<int>(threadIdx.x);
    if (thread_idx == 0) max_rows = 0;
    __syncthreads();
    for (int expert_idx = thread_idx; expert_idx < num_experts; expert_idx += kOrderThreads) {
        const int rows = expert_offsets[expert_idx + 1] - expert_offsets[expert_idx];
        if (num_experts <= kMaxOrderedExperts) num_rows[expert_idx] = rows;
        atomicMax(&max_rows, rows);
    }
    __syncthreads();
    const int64_t total_rows = expert_offsets[num_experts] - expert_offsets[0];
    const bool claimed =
        static_cast<double>(max_rows) * num_experts > kSkewedRowsRatio * static_cast<double>(total_rows);
    const bool ordered = claimed && num_experts <= kMaxOrderedExperts;
    if (thread_idx == 0) {
        tile_counter[0] = 0;
        tile_counter[1] = claimed ? 1 : 0;
    }
    for (int expert_idx = thread_idx; expert_idx < num_experts; expert_idx += kOrderThreads) {
        const int row_begin = expert_offsets[expert_idx], row_end = expert_offsets[expert_idx + 1];
        int rank = expert_idx;
        if (ordered) {
            const int mine = num_rows[expert_idx];
            rank = 0;
            for (int other_idx = 0; other_idx < num_experts; ++other_idx) {
                const int theirs = num_rows[other_idx];
                rank += theirs > mine || (theirs == mine && other_idx < expert_idx);
            }
        }
        experts_by_rank[rank] = make_int4(expert_idx, row_begin, row_end, 0);
    }
}

// ---------------------------------------------------------------------------------------------------
// Host side: the cluster launch (the tensor maps: k_grouped/host.cuh).

template <class Shape, typename T, typename OutT>
megamoe_status_t launch_typed(const CUtensorMap& a_map, const CUtensorMap& b_map, const CUtensorMap& out_map,
                              const KernelParams& params, int num_sms, cudaStream_t stream) {
    const int64_t max_clusters = std::min<int64_t>(std::max(num_sms, kClusterSize) / kClusterSize, params.num_tiles);
    return launch_cluster_kernel<kClusterSize>(
        k_grouped_gemm_sm90_kernel<Shape, T, OutT, kStoreBoxesPerWarp>, "k_grouped_gemm_sm90", kNumThreads,
        smem_bytes_of<SharedStorage<Shape, kStoreBoxesPerWarp>>(), max_clusters, stream, a_map, b_map, out_map, params);
}

// The launch on tile shape Shape: its tile counts and the pair's shared operand into `params` (whose operands, schedule
// and output are set), then the kernel for the element and output types.
template <class Shape>
megamoe_status_t launch_shape(const cuda::KGroupedGemmArgs& args, KernelParams params, const CUtensorMap& a_map,
                              const CUtensorMap& b_map, const CUtensorMap& out_map, bool f32_out, int num_sms,
                              cudaStream_t stream) {
    const int64_t num_m_tiles = ceil_div(args.m, static_cast<int64_t>(Shape::kBlockM));
    const int64_t num_n_tiles = ceil_div(args.n, static_cast<int64_t>(Shape::kBlockN));
    // The pair shares the operand that comes by TMA (A: neighbouring n-tiles; B: neighbouring m-tiles), the wider of
    // the two where both do.
    params.pair_along_m = params.b.tma && (!params.a.tma || Shape::kBlockN > Shape::kBlockM);
    params.share = params.a.tma || params.b.tma;
    const int64_t pairs_m =
        params.pair_along_m ? ceil_div(num_m_tiles, static_cast<int64_t>(kClusterSize)) : num_m_tiles;
    const int64_t pairs_n =
        params.pair_along_m ? num_n_tiles : ceil_div(num_n_tiles, static_cast<int64_t>(kClusterSize));
    const int64_t num_tiles = args.num_experts * pairs_m * pairs_n;
    if (num_tiles > INT32_MAX || num_m_tiles * kClusterSize > INT32_MAX || num_n_tiles * kClusterSize > INT32_MAX) {
        return set_error(MEGAMOE_STATUS_NOT_SUPPORTED, "k_grouped_gemm_sm90: more than 2^31 output tiles");
    }
    params.num_m_tiles = static_cast<int>(num_m_tiles);
    params.num_n_tiles = static_cast<int>(num_n_tiles);
    params.pairs_m = static_cast<int>(pairs_m);
    params.pairs_n = static_cast<int>(pairs_n);
    params.tiles_per_expert_divisor = IntDivisor::of(pairs_m * pairs_n);
    params.pairs_n_divisor = IntDivisor::of(pairs_n);
    params.num_tiles = static_cast<int>(num_tiles);
    return cuda::with_element_type(args.dtype, [&](auto tag) {
        using T = typename decltype(tag)::Type;
        return f32_out ? launch_typed<Shape, T, float>(a_map, b_map, out_map, params, num_sms, stream)
                       : launch_typed<Shape, T, T>(a_map, b_map, out_map, params, num_sms, stream);
    });
}

}  // namespace

bool k_grouped_gemm_sm90_supported(const cuda::KGroupedGemmArgs& args, const void* out) {
    const bool dtype_ok = args.dtype == MEGAMOE_DTYPE_BF16 || args.dtype == MEGAMOE_DTYPE_F16;
    const bool sizes_ok = args.m % kChunkElems == 0 && args.n % kChunkElems == 0;
    const bool a_ok = cuda::is_aligned(args.a, 16) && args.lda % kChunkElems == 0 && args.lda <= INT32_MAX;
    const bool b_ok = cuda::is_aligned(args.b, 16) && args.ldb % kChunkElems == 0 && args.ldb <= INT32_MAX;
    return dtype_ok && sizes_ok && a_ok && b_ok && cuda::is_aligned(out, 16);
}

megamoe_status_t launch_k_grouped_gemm_sm90(const cuda::KGroupedGemmArgs& args, void* out, megamoe_dtype_t out_dtype,
                                            int num_sms, cudaStream_t stream) {
    if (!k_grouped_gemm_sm90_supported(args, out)) {
        return set_error(MEGAMOE_STATUS_NOT_SUPPORTED, "k_grouped_gemm_sm90: operands not supported");
    }
    if (args.num_experts == 0 || args.m == 0 || args.n == 0) return MEGAMOE_STATUS_SUCCESS;
    CUtensorMap a_map, b_map;
    KernelParams params{};
    params.a = make_operand(args.dtype, args.a, args.lda, args.a_gather_slots, args.m, &a_map);
    params.b = make_operand(args.dtype, args.b, args.ldb, args.b_gather_slots, args.n, &b_map);
    const int64_t topk = std::max<int64_t>(args.topk, 1);  // ignored unless an operand is gathered
    params.topk = IntDivisor::of(topk);
    params.m = args.m;
    params.n = args.n;
    params.expert_offsets = args.expert_offsets;
    params.out = out;
    params.accumulate = args.accumulate;
    if (args.schedule != nullptr && cuda::is_aligned(args.schedule, 16)) {  // heaviest first, claimed greedily
        auto* experts_by_rank = reinterpret_cast<int4*>(args.schedule);     // 256-byte aligned workspace
        int* tile_counter = args.schedule + 4 * args.num_experts;
        order_experts_kernel<<<1, kOrderThreads, 0, stream>>>(args.expert_offsets, static_cast<int>(args.num_experts),
                                                              experts_by_rank, tile_counter);
        MEGAMOE_CUDA_RETURN_IF_ERROR(cuda::check_launch("k_grouped_gemm_sm90 order_experts_kernel"));
        params.experts_by_rank = experts_by_rank;
        params.tile_counter = tile_counter;
    }
    const bool f32_out = out_dtype == MEGAMOE_DTYPE_F32;
    if (args.accumulate && !f32_out) {
        return set_error(MEGAMOE_STATUS_INTERNAL_ERROR, "k_grouped_gemm_sm90: accumulation needs an f32 output");
    }
    CUtensorMap out_map{};
    params.tma_store = !f32_out && encode_out_map(args.dtype, out, args.num_experts, args.m, args.n, &out_map);
    // The gathered operand on the narrow side of the tile (the tile table, k_grouped/config.cuh).
    const bool wide_a = params.a.tma && args.b_gather_slots != nullptr;
    return wide_a ? launch_shape<WideATile>(args, params, a_map, b_map, out_map, f32_out, num_sms, stream)
                  : launch_shape<NarrowATile>(args, params, a_map, b_map, out_map, f32_out, num_sms, stream);
}

}  // namespace megamoe::sm90
