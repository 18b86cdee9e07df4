// Routing metadata: a stable, deterministic counting sort of the S = T * topk slots by expert.
//
// Computes (see routing.h for the layouts) expert_offsets, m_tile_offsets, sorted_slot, slot_to_row
// and token_invalid from topk_ids [T, topk] (int32 or int64), entirely on the device.
//
// Passes, all on one stream:
//   1. count   one warp per chunk of chunk_slots consecutive slots: __match_any_sync groups the 32
//              lanes of a step by expert and the group leader adds the group size into
//              counts[e][chunk] (integer atomics: order-free). Ids outside [-1, E) flag their token.
//   2. scan    exclusive scan of the expert-major count matrix (tile sums, a one-block scan of the
//              tile sums, then each tile again): counts[e][chunk] becomes the first sorted row of the
//              chunk's slots of expert e, and counts[e][0] is expert_offsets[e].
//   3. tiles   one block scans ceil(rows of e / block_m) over the experts -> m_tile_offsets.
//   4. scatter the count pass again: each slot's row = counts[e][chunk] + its rank among the earlier
//              lanes of its match group; the leader then advances counts[e][chunk]. A chunk is owned by
//              one warp that walks it in slot order, so rows are stable and deterministic.
// Thread roles: passes 1 and 4 use 8 warps per block, one chunk per warp; pass 2 uses 256 threads
// with 8 consecutive entries each; the one-block passes use 1024 threads.
// Shared memory: only the 32 warp totals of a block-wide scan.
//
// Grouped rows (rows already sorted; RoutingPlan::rows_sorted) need no sort:
//   1. offsets (one block) expert_offsets = exclusive scan of tokens_per_expert, each count taken as at least 0 and
//              the running sum stopped at R (64-bit scan, counts capped at R + 1: no overflow), and counts_invalid
//              = 1 when a count is negative or they sum past R;
//   2. tiles   pass 3 above;
//   3. rows    one thread per row: slot_to_row[r] = r below expert_offsets[E], -1 for padding rows past it, and
//              token_invalid[r] = counts_invalid (the combine and the d scores pass then write NaN for every row).
#include "portable/routing.h"

#include <algorithm>

namespace megamoe::cuda {
namespace {

constexpr int kChunkThreads = 256;             // passes 1 and 4: 8 warps, one chunk each
constexpr int64_t kChunkSlots = 512;           // preferred slots per chunk
constexpr int64_t kMaxCountEntries = 1 << 22;  // cap on E * num_chunks (16 MiB of counts)
constexpr int kScanThreads = 256;
constexpr int kScanItems = 8;
constexpr int kScanTile = kScanThreads * kScanItems;
constexpr int kSingleBlockThreads = 1024;

static_assert(kChunkThreads % kWarpSize == 0, "chunk passes use whole warps");
static_assert(kScanThreads % kWarpSize == 0 && kSingleBlockThreads % kWarpSize == 0, "scans use whole warps");
static_assert(kSingleBlockThreads / kWarpSize <= kWarpSize, "warp totals are scanned by one warp");

// Exclusive scan of one value (int or long long) per thread across a block of kNumThreads; `total` gets the block
// sum. `warp_totals` is shared scratch of kWarpSize values. Every thread of the block must call it.
template <int kNumThreads, typename T>
__device__ T block_exclusive_scan(T value, T* warp_totals, T& total) {
    constexpr int kNumWarps = kNumThreads / kWarpSize;
    const int lane_idx = threadIdx.x % kWarpSize, warp_idx = threadIdx.x / kWarpSize;
    T inclusive = value;
    for (int offset = 1; offset < kWarpSize; offset <<= 1) {
        const T other = __shfl_up_sync(kFullMask, inclusive, offset);
        if (lane_idx >= offset) inclusive += other;
    }
    if (lane_idx == kWarpSize - 1) warp_totals[warp_idx] = inclusive;
    __syncthreads();
    if (warp_idx == 0) {
        T warp_total = lane_idx < kNumWarps ? warp_totals[lane_idx] : 0;
        for (int offset = 1; offset < kWarpSize; offset <<= 1) {
            const T other = __shfl_up_sync(kFullMask, warp_total, offset);
            if (lane_idx >= offset) warp_total += other;
        }
        warp_totals[lane_idx] = warp_total;  // inclusive over warps
    }
    __syncthreads();
    const T warp_offset = warp_idx > 0 ? warp_totals[warp_idx - 1] : 0;
    total = warp_totals[kNumWarps - 1];
    __syncthreads();  // warp_totals may be reused right after
    return warp_offset + inclusive - value;
}

// The id of a slot as stored (int32 or int64).
__device__ __forceinline__ int64_t load_id(const void* topk_ids, bool ids_are_int64, int64_t slot_idx) {
    return ids_are_int64 ? static_cast<const int64_t*>(topk_ids)[slot_idx]
                         : static_cast<int64_t>(static_cast<const int32_t*>(topk_ids)[slot_idx]);
}

struct ChunkArgs {
    const void* topk_ids;
    bool ids_are_int64;
    int64_t num_slots;
    int64_t num_experts;
    int64_t topk;
    int64_t num_chunks;
    int64_t chunk_slots;
};

// One lane's slot at one step of walk_chunk.
struct ChunkSlot {
    int64_t chunk_idx;
    int64_t slot_idx;
    bool in_chunk;    // below the chunk's end (else a lane without a slot at the chunk's last step)
    bool invalid_id;  // its id is outside [-1, E): its token is flagged
    int expert_idx;   // the expert it is sorted under: its id when in [0, E), else -1 (no slot, dropped or invalid)
};

// The walk of passes 1 and 4, one and the same so that both group the slots alike: warp w takes chunk w (none past
// the last chunk) and walks its slots in order, 32 consecutive slots a step, lane l slot step_begin + l; every lane
// calls step(slot) at every step, those without a slot included (the warp-wide intrinsics need the whole warp).
template <class Step>
__device__ __forceinline__ void walk_chunk(const ChunkArgs& args, Step&& step) {
    const int64_t chunk_idx = (static_cast<int64_t>(blockIdx.x) * kChunkThreads + threadIdx.x) / kWarpSize;
    const int lane_idx = threadIdx.x % kWarpSize;
    if (chunk_idx >= args.num_chunks) return;
    const int64_t slot_begin = chunk_idx * args.chunk_slots;
    const int64_t slot_end = min(slot_begin + args.chunk_slots, args.num_slots);
    for (int64_t step_begin = slot_begin; step_begin < slot_end; step_begin += kWarpSize) {
        ChunkSlot slot{chunk_idx, step_begin + lane_idx, false, false, -1};
        slot.in_chunk = slot.slot_idx < slot_end;
        if (slot.in_chunk) {
            const int64_t id = load_id(args.topk_ids, args.ids_are_int64, slot.slot_idx);
            if (id >= 0 && id < args.num_experts) {
                slot.expert_idx = static_cast<int>(id);
            } else {
                slot.invalid_id = id != -1;
            }
        }
        step(slot);
    }
}

__global__ void __launch_bounds__(kChunkThreads) count_kernel(const ChunkArgs args, int* counts, int* token_invalid) {
    const int lane_idx = threadIdx.x % kWarpSize;
    walk_chunk(args, [&](const ChunkSlot& slot) {
        if (slot.invalid_id) token_invalid[slot.slot_idx / args.topk] = 1;
        const unsigned group_mask = __match_any_sync(kFullMask, slot.expert_idx);
        const bool is_leader = lane_idx == __ffs(group_mask) - 1;
        if (slot.expert_idx >= 0 && is_leader) {
            atomicAdd(&counts[slot.expert_idx * args.num_chunks + slot.chunk_idx], __popc(group_mask));
        }
    });
}

// Pass 2a: the sum of each kScanTile-entry tile of the count matrix.
__global__ void __launch_bounds__(kScanThreads)
    scan_tile_sum_kernel(const int* counts, int64_t num_counts, int* tile_sums) {
    __shared__ int warp_totals[kWarpSize];
    const int64_t first_idx = static_cast<int64_t>(blockIdx.x) * kScanTile + threadIdx.x * kScanItems;
    int thread_sum = 0;
    for (int item_idx = 0; item_idx < kScanItems; ++item_idx) {
        if (first_idx + item_idx < num_counts) thread_sum += counts[first_idx + item_idx];
    }
    int tile_sum;
    block_exclusive_scan<kScanThreads>(thread_sum, warp_totals, tile_sum);
    if (threadIdx.x == 0) tile_sums[blockIdx.x] = tile_sum;
}

// Pass 2b (one block): tile_sums becomes its exclusive scan.
__global__ void __launch_bounds__(kSingleBlockThreads) scan_tile_sums_kernel(int* tile_sums, int64_t num_tiles) {
    __shared__ int warp_totals[kWarpSize];
    int carry = 0;
    for (int64_t base_idx = 0; base_idx < num_tiles; base_idx += kSingleBlockThreads) {
        const int64_t tile_idx = base_idx + threadIdx.x;
        const int value = tile_idx < num_tiles ? tile_sums[tile_idx] : 0;
        int total;
        const int exclusive = block_exclusive_scan<kSingleBlockThreads>(value, warp_totals, total);
        if (tile_idx < num_tiles) tile_sums[tile_idx] = carry + exclusive;
        carry += total;
    }
}

// Pass 2c: each tile's exclusive scan plus its tile offset, in place; reads expert_offsets off it.
__global__ void __launch_bounds__(kScanThreads)
    scan_apply_kernel(int* counts, const int* tile_offsets, int64_t num_counts, int64_t num_chunks, int64_t num_experts,
                      int* expert_offsets) {
    __shared__ int warp_totals[kWarpSize];
    const int64_t first_idx = static_cast<int64_t>(blockIdx.x) * kScanTile + threadIdx.x * kScanItems;
    int values[kScanItems];
    int thread_sum = 0;
    for (int item_idx = 0; item_idx < kScanItems; ++item_idx) {
        values[item_idx] = first_idx + item_idx < num_counts ? counts[first_idx + item_idx] : 0;
        thread_sum += values[item_idx];
    }
    int tile_total;
    int running = tile_offsets[blockIdx.x] + block_exclusive_scan<kScanThreads>(thread_sum, warp_totals, tile_total);
    for (int item_idx = 0; item_idx < kScanItems; ++item_idx) {
        const int64_t count_idx = first_idx + item_idx;
        if (count_idx >= num_counts) break;
        counts[count_idx] = running;
        if (count_idx % num_chunks == 0) expert_offsets[count_idx / num_chunks] = running;
        running += values[item_idx];
        if (count_idx == num_counts - 1) expert_offsets[num_experts] = running;
    }
}

// Pass 3 (one block): m_tile_offsets = exclusive scan of ceil(rows of e / block_m).
__global__ void __launch_bounds__(kSingleBlockThreads)
    m_tile_schedule_kernel(const int* expert_offsets, int64_t num_experts, int block_m, int* m_tile_offsets) {
    __shared__ int warp_totals[kWarpSize];
    int carry = 0;
    for (int64_t base_idx = 0; base_idx < num_experts; base_idx += kSingleBlockThreads) {
        const int64_t expert_idx = base_idx + threadIdx.x;
        int num_tiles = 0;
        if (expert_idx < num_experts) {
            const int num_rows = expert_offsets[expert_idx + 1] - expert_offsets[expert_idx];
            num_tiles = (num_rows + block_m - 1) / block_m;
        }
        int total;
        const int exclusive = block_exclusive_scan<kSingleBlockThreads>(num_tiles, warp_totals, total);
        if (expert_idx < num_experts) m_tile_offsets[expert_idx] = carry + exclusive;
        carry += total;
    }
    if (threadIdx.x == 0) m_tile_offsets[num_experts] = carry;
}

// Grouped rows, pass 1 (one block): expert_offsets from the counts, clamped into [0, R]; counts_invalid.
__global__ void __launch_bounds__(kSingleBlockThreads)
    counts_scan_kernel(const void* counts, bool counts_are_int64, int64_t num_experts, int64_t num_rows,
                       int* expert_offsets, int* counts_invalid) {
    __shared__ long long warp_totals[kWarpSize];
    __shared__ int any_negative;
    if (threadIdx.x == 0) any_negative = 0;
    __syncthreads();
    const long long cap = num_rows + 1;  // a count or sum above R is invalid however far above it is
    long long carry = 0;                 // capped at R + 1
    for (int64_t base_idx = 0; base_idx < num_experts; base_idx += kSingleBlockThreads) {
        const int64_t expert_idx = base_idx + threadIdx.x;
        long long count = 0;
        if (expert_idx < num_experts) {
            const long long value = load_id(counts, counts_are_int64, expert_idx);
            if (value < 0) any_negative = 1;
            count = min(max(value, 0ll), cap);
        }
        long long total;
        const long long exclusive = block_exclusive_scan<kSingleBlockThreads>(count, warp_totals, total);
        if (expert_idx < num_experts) expert_offsets[expert_idx] = static_cast<int>(min(carry + exclusive, cap - 1));
        carry = min(carry + total, cap);
    }
    __syncthreads();  // every any_negative write is done
    if (threadIdx.x == 0) {
        expert_offsets[num_experts] = static_cast<int>(min(carry, cap - 1));
        *counts_invalid = any_negative != 0 || carry == cap ? 1 : 0;
    }
}

// Grouped rows, pass 3: the identity row map (padding rows: -1) and every row's invalid flag.
__global__ void __launch_bounds__(kChunkThreads)
    identity_rows_kernel(const int* expert_offsets, int64_t num_experts, const int* counts_invalid, int64_t num_rows,
                         int* slot_to_row, int* token_invalid) {
    const int64_t row_idx = static_cast<int64_t>(blockIdx.x) * kChunkThreads + threadIdx.x;
    if (row_idx >= num_rows) return;
    slot_to_row[row_idx] = row_idx < expert_offsets[num_experts] ? static_cast<int>(row_idx) : -1;
    token_invalid[row_idx] = *counts_invalid;
}

// Pass 4: rows for every slot. counts[e][chunk] holds the chunk's next free row of expert e.
__global__ void __launch_bounds__(kChunkThreads)
    scatter_kernel(const ChunkArgs args, int* counts, int* sorted_slot, int* slot_to_row) {
    const int lane_idx = threadIdx.x % kWarpSize;
    const unsigned lanes_before = (1u << lane_idx) - 1u;
    walk_chunk(args, [&](const ChunkSlot& slot) {
        const int expert_idx = slot.expert_idx;
        const unsigned group_mask = __match_any_sync(kFullMask, expert_idx);
        int* cursor = expert_idx >= 0 ? &counts[expert_idx * args.num_chunks + slot.chunk_idx] : nullptr;
        if (expert_idx >= 0) {
            const int row_idx = *cursor + __popc(group_mask & lanes_before);
            sorted_slot[row_idx] = static_cast<int>(slot.slot_idx);
            slot_to_row[slot.slot_idx] = row_idx;
        } else if (slot.in_chunk) {
            slot_to_row[slot.slot_idx] = -1;
        }
        __syncwarp();  // every lane has read its cursor before the leader moves it
        if (expert_idx >= 0 && lane_idx == __ffs(group_mask) - 1) *cursor += __popc(group_mask);
        __syncwarp();  // the moved cursor is visible to the next step
    });
}

}  // namespace

RoutingPlan RoutingPlan::make(const Shape& shape, int64_t block_m, bool rows_sorted) {
    RoutingPlan plan;
    plan.num_tokens = shape.num_tokens;
    plan.num_slots = shape.num_slots();
    plan.num_experts = shape.num_experts;
    plan.topk = shape.topk;
    plan.block_m = block_m;
    plan.max_m_tiles = ceil_div(plan.num_slots, block_m) + std::min(plan.num_experts, plan.num_slots);
    plan.rows_sorted = rows_sorted;
    if (rows_sorted) return plan;  // no sort: no chunks, no count matrix
    const int64_t max_chunks_for_experts =
        std::max<int64_t>(1, kMaxCountEntries / std::max<int64_t>(1, plan.num_experts));
    plan.num_chunks = std::max<int64_t>(1, std::min(ceil_div(plan.num_slots, kChunkSlots), max_chunks_for_experts));
    plan.chunk_slots = std::max<int64_t>(1, ceil_div(plan.num_slots, plan.num_chunks));
    plan.num_counts = plan.num_experts * plan.num_chunks;
    plan.num_scan_tiles = ceil_div(plan.num_counts, kScanTile);
    return plan;
}

RoutingBuffers RoutingBuffers::carve(WorkspaceCarver& carver, const RoutingPlan& plan) {
    RoutingBuffers buffers;
    if (!plan.rows_sorted) {
        buffers.counts = carver.take<int>(plan.num_counts);
        buffers.scan_tile_sums = carver.take<int>(plan.num_scan_tiles);
    }
    buffers.expert_offsets = carver.take<int>(plan.num_experts + 1);
    buffers.m_tile_offsets = carver.take<int>(plan.num_experts + 1);
    if (!plan.rows_sorted) buffers.sorted_slot = carver.take<int>(plan.num_slots);
    buffers.slot_to_row = carver.take<int>(plan.num_slots);
    buffers.token_invalid = carver.take<int>(plan.num_tokens);
    if (plan.rows_sorted) buffers.counts_invalid = carver.take<int>(1);
    return buffers;
}

namespace {

megamoe_status_t launch_m_tile_schedule(const RoutingPlan& plan, const RoutingBuffers& buffers, cudaStream_t stream) {
    m_tile_schedule_kernel<<<1, kSingleBlockThreads, 0, stream>>>(
        buffers.expert_offsets, plan.num_experts, static_cast<int>(plan.block_m), buffers.m_tile_offsets);
    return check_launch("routing m_tile_schedule_kernel");
}

// Grouped rows: offsets, tiles and the identity rows from tokens_per_expert (passes above).
megamoe_status_t launch_rows_from_counts(const void* counts, megamoe_dtype_t counts_dtype, const RoutingPlan& plan,
                                         const RoutingBuffers& buffers, cudaStream_t stream) {
    counts_scan_kernel<<<1, kSingleBlockThreads, 0, stream>>>(counts, counts_dtype == MEGAMOE_DTYPE_I64,
                                                              plan.num_experts, plan.num_tokens, buffers.expert_offsets,
                                                              buffers.counts_invalid);
    MEGAMOE_CUDA_RETURN_IF_ERROR(check_launch("routing counts_scan_kernel"));
    MEGAMOE_CUDA_RETURN_IF_ERROR(launch_m_tile_schedule(plan, buffers, stream));
    if (plan.num_tokens == 0) return MEGAMOE_STATUS_SUCCESS;
    const auto num_blocks = static_cast<unsigned>(ceil_div(plan.num_tokens, kChunkThreads));
    identity_rows_kernel<<<num_blocks, kChunkThreads, 0, stream>>>(buffers.expert_offsets, plan.num_experts,
                                                                   buffers.counts_invalid, plan.num_tokens,
                                                                   buffers.slot_to_row, buffers.token_invalid);
    return check_launch("routing identity_rows_kernel");
}

}  // namespace

megamoe_status_t launch_routing(const void* experts, megamoe_dtype_t experts_dtype, const RoutingPlan& plan,
                                const RoutingBuffers& buffers, cudaStream_t stream) {
    if (plan.rows_sorted) return launch_rows_from_counts(experts, experts_dtype, plan, buffers, stream);
    const void* topk_ids = experts;
    const megamoe_dtype_t ids_dtype = experts_dtype;
    MEGAMOE_CUDA_RETURN_IF_ERROR(
        check_cuda(cudaMemsetAsync(buffers.counts, 0, static_cast<size_t>(plan.num_counts) * sizeof(int), stream),
                   "routing: cudaMemsetAsync(counts)"));
    MEGAMOE_CUDA_RETURN_IF_ERROR(check_cuda(
        cudaMemsetAsync(buffers.token_invalid, 0, static_cast<size_t>(plan.num_tokens) * sizeof(int), stream),
        "routing: cudaMemsetAsync(token_invalid)"));

    const ChunkArgs chunk_args{
        topk_ids,        ids_dtype == MEGAMOE_DTYPE_I64, plan.num_slots, plan.num_experts, plan.topk, plan.num_chunks,
        plan.chunk_slots};
    const auto num_chunk_blocks = static_cast<unsigned>(ceil_div(plan.num_chunks, kChunkThreads / kWarpSize));
    count_kernel<<<num_chunk_blocks, kChunkThreads, 0, stream>>>(chunk_args, buffers.counts, buffers.token_invalid);
    MEGAMOE_CUDA_RETURN_IF_ERROR(check_launch("routing count_kernel"));

    const auto num_scan_tiles = static_cast<unsigned>(plan.num_scan_tiles);
    scan_tile_sum_kernel<<<num_scan_tiles, kScanThreads, 0, stream>>>(buffers.counts, plan.num_counts,
                                                                      buffers.scan_tile_sums);
    MEGAMOE_CUDA_RETURN_IF_ERROR(check_launch("routing scan_tile_sum_kernel"));
    scan_tile_sums_kernel<<<1, kSingleBlockThreads, 0, stream>>>(buffers.scan_tile_sums, plan.num_scan_tiles);
    MEGAMOE_CUDA_RETURN_IF_ERROR(check_launch("routing scan_tile_sums_kernel"));
    scan_apply_kernel<<<num_scan_tiles, kScanThreads, 0, stream>>>(buffers.counts, buffers.scan_tile_sums,
                                                                   plan.num_counts, plan.num_chunks, plan.num_experts,
                                                                   buffers.expert_offsets);
    MEGAMOE_CUDA_RETURN_IF_ERROR(check_launch("routing scan_apply_kernel"));

    MEGAMOE_CUDA_RETURN_IF_ERROR(launch_m_tile_schedule(plan, buffers, stream));

    scatter_kernel<<<num_chunk_blocks, kChunkThreads, 0, stream>>>(chunk_args, buffers.counts, buffers.sorted_slot,
                                                                   buffers.slot_to_row);
    return check_launch("routing scatter_kernel");
}

}  // namespace megamoe::cuda
