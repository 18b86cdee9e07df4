// Routing metadata on the device (DESIGN.md section 3): a stable, deterministic counting sort of the
// S = T * topk slots by expert, with no host synchronisation and no cap on E. Grouped rows (plan.rows_sorted: rows
// already sorted by expert, T = R rows of one slot each) take the same metadata from their counts instead: offsets
// by a scan of tokens_per_expert, the identity gather (sorted_slot NULL: sorted row r is row r of x).
//
// Outputs (all int32, in the caller's workspace):
//   expert_offsets [E + 1]  sorted rows of expert e are [expert_offsets[e], expert_offsets[e + 1])
//   m_tile_offsets [E + 1]  exclusive scan of ceil(rows of e / block_m): the M-tile schedule of the
//                           M-grouped GEMM (its tile i belongs to the last e with m_tile_offsets[e] <= i)
//   sorted_slot    [S]      sorted row -> slot t * topk + j (only rows < expert_offsets[E] are written)
//   slot_to_row    [S]      slot -> sorted row, -1 for a dropped slot (id -1) or an invalid id
//   token_invalid  [T]      1 when one of the token's ids is outside [-1, E), else 0
//   counts_invalid [1]      grouped rows only: 1 when a count is negative or the counts sum past R (then every row's
//                           token_invalid is 1 too), else 0. The offsets stay in [0, R] either way: negative counts
//                           count as 0 and the running sum stops at R, so no kernel reads or writes past row R.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common.h"
#include "device/cuda_utils.h"
#include "device/grouped_gemm_args.h"

namespace megamoe::cuda {

// Host-known sizes of the sort. The slots are cut into num_chunks chunks of chunk_slots; the count
// matrix is expert-major [E][num_chunks] so one exclusive scan of it yields every (expert, chunk)
// start position in sorted order.
struct RoutingPlan {
    int64_t num_tokens = 0;
    int64_t num_slots = 0;
    int64_t num_experts = 0;
    int64_t topk = 0;
    int64_t num_chunks = 0;
    int64_t chunk_slots = 0;
    int64_t num_counts = 0;      // num_experts * num_chunks
    int64_t num_scan_tiles = 0;  // tiles of the device-wide scan over the count matrix
    int64_t block_m = 0;         // rows per M tile of the grouped GEMM schedule
    int64_t max_m_tiles = 0;     // host upper bound on m_tile_offsets[E]
    bool rows_sorted = false;    // grouped rows: metadata from tokens_per_expert, no sort (no counts, no chunks)

    static RoutingPlan make(const Shape& shape, int64_t block_m, bool rows_sorted);
};

struct RoutingBuffers {
    int* counts = nullptr;
    int* scan_tile_sums = nullptr;
    int* expert_offsets = nullptr;
    int* m_tile_offsets = nullptr;
    int* sorted_slot = nullptr;
    int* slot_to_row = nullptr;
    int* token_invalid = nullptr;
    int* counts_invalid = nullptr;  // grouped rows only

    static RoutingBuffers carve(WorkspaceCarver& carver, const RoutingPlan& plan);
};

// Enqueues the whole sort on `stream`: of topk_ids [T, topk] (requires plan.num_slots > 0), or, with
// plan.rows_sorted, the grouped rows' metadata from tokens_per_expert [E] (any R, 0 included). `experts`: either,
// with its dtype (i32 or i64).
megamoe_status_t launch_routing(const void* experts, megamoe_dtype_t experts_dtype, const RoutingPlan& plan,
                                const RoutingBuffers& buffers, cudaStream_t stream);

}  // namespace megamoe::cuda
