// The backward's dH GEMM (16-bit operands) on four warpgroups: the dSwiGLU epilogue runs in a warpgroup of its own,
// beside the next tile's MMAs, instead of on the MMA warpgroups after each tile's mainloop. Built where
// MEGAMOE_DH_EPILOGUE_WARPGROUP is 1 (CMake option, default OFF: dH then runs on the 3-warpgroup kernel of kernel.cuh
// with DSwiGLUEpilogueOf, unchanged); the FP8 dH stays on the 3-warpgroup kernel either way.
//
// What: the same outputs as DSwiGLUEpilogueOf (dswiglu.cuh) for acc = p = W2[e]^T dy on the 128 x 256 tile of the
// Cooperative configuration, the same tile sequence (Scheduler), the same producer (StageLoader: B by TMA, the rows of
// dy gathered by cp.async) and the same consumer mainloop (WgmmaMainloop).
//   dh = [dg, du] (or interleaved) and s * a: bitwise the 3-warpgroup kernel's (p is handed off in f32, each element
//     through dswiglu_element, the one copy of the math).
//   ds partial sums (ds_parts[row, n_tile], one per row and n-tile, added in n-tile order later): a fixed order of its
//     own (each lane sums its 8 columns in column order, then a butterfly over the warp's lanes, xor 16, 8, 4, 2, 1),
//     so d topk_weights is deterministic and batch invariant (a row's sum reads that row's data alone) but not bitwise
//     the 3-warpgroup kernel's (which sums per quad lane, then across the quad).
// Every output element is written once, by one thread; no atomics.
//
// Warp roles (512 threads, 1 CTA per SM, clusters of 2 as kernel.cuh):
//   warpgroup 0, producer (setmaxnreg kDhProducerRegs): StageLoader::run, as in kernel.cuh.
//   warpgroups 1, 2, MMA (setmaxnreg kDhMmaRegs): rows [64 (w - 1), + 64) of every tile (WgmmaMainloop::mma_tile, each
//     k16 step as two m64n128 wgmmas on the halves of B: ptxas compiles no m64n256 wgmma, 154 registers at the
//     instruction, in a kernel of 512 threads, whatever setmaxnreg gives the warpgroup; the accumulator layout is the
//     same), then each warp hands its 16 rows x 256 columns of f32 accumulators to the epilogue warpgroup through one
//     slot of the hand-off ring and goes straight to the next tile's mainloop. Warp m (0 .. 7 over both MMA
//     warpgroups) hands off chunk m of each tile: tile rows [16 m, 16 m + 16); chunk c of the CTA's sequence
//     (c = 8 t + m for its t-th tile) takes slot c % kDhSlots.
//   warpgroup 3, epilogue (setmaxnreg kDhEpilogueRegs): walks the same tiles (its own Scheduler) and the chunks in
//     sequence; epilogue warp e takes rows 4 e .. 4 e + 3 of each chunk, one row at a time, lane l columns
//     [8 l, 8 l + 8) of the tile: g, u by 16-byte loads from h (issued one chunk ahead: the next chunk's row i is
//     requested once row i of this chunk is done, so they are in flight while the MMA warpgroups finish that chunk),
//     p by two 16-byte shared loads, then dg, du, s a by 16-byte stores and lane 0 the row's ds part. The rows' weights
//     s come once per tile (the next tile's while this one runs): lane l loads that of the warp's tile row
//     16 (l / 4) + 4 e + l % 4 (chunk l / 4, the warp's row l % 4 of it), broadcast by shuffles.
// Shared memory (DhStorageOf, 1024-byte aligned): kDhStages pipeline stages of 48 KiB (A 16 KiB + B 32 KiB), the
//   hand-off ring of kDhSlots slots of 16 KiB (16 rows x 256 f32), the stages' full / empty mbarriers, the slots'
//   full mbarriers and the epilogue warps' read counters. A whole f32 tile (128 KiB) beside 3 stages (144 KiB)
//   exceeds 227 KiB, so the ring holds part of a tile: the stage count is the most that leaves room for kDhMinSlots
//   slots (half a tile), then as many slots as fit: 3 stages, 5 slots (80 KiB), 224 KiB in all. An MMA warp waits
//   for its slot only where the epilogue is more than kDhSlots chunks behind (the last 3 warps of a tile wait for the
//   first 3 chunks to be read out). bf16 p would hold a whole tile in 64 KiB, but changes dh's bits.
//   Slot layout: row r at 1024 r bytes, 16-byte chunk c (f32 columns 4 c .. 4 c + 3) at chunk position c ^ 2 (r % 4)
//   (handoff_offset): the MMA warps' 8-byte stores (a half-warp: 4 rows, r % 4 all different, x 32 bytes) fall in 8
//   distinct 16-byte bank groups; an epilogue lane reads chunks 2 l and 2 l + 1 of one row, lanes with l / 4 odd the
//   second first, so a quarter-warp's 16-byte loads do too (positions 0, 2, 4, 6 and 1, 3, 5, 7 of a group).
// Synchronization: the stages' barriers as in kernel.cuh. Writer to reader: handoff_full[s] (kHandoffFullArrivals:
//   every lane of the writing warp arrives after its stores, release), waited on by the epilogue warps in sequence
//   (the kit's StagePipeline<kDhSlots, 1>, consumer_wait; a parity wait is exact there: before waiting for chunk c an
//   epilogue warp has itself seen chunk c - kDhSlots, the slot's previous phase, complete). Reader to writers: not an
//   empty mbarrier, since the 8 MMA warps reach their hand-offs in no fixed order (a warp may run a tile ahead of
//   another where K is short, and warps m and m + 5 share a slot within a tile), so a parity wait could match a phase
//   two uses old; instead handoff_read[e] counts the chunks epilogue warp e has read out (after __syncwarp, lane 0
//   stores c + 1 with release once its rows' p of chunk c are in registers) and the writer of chunk c waits (acquire)
//   until every counter is at least c - kDhSlots + 1. No named barriers, no __syncthreads. Deadlock-free: a chunk
//   waits only on the read-out of the chunk kDhSlots before it, and the epilogue reads chunks in sequence.
// Registers (64 K, 512 threads, 128 a thread at launch): producer 56 (its 8 gathered row pointers; kernel.cuh's
//   budget), MMA 2 x 168 (128 accumulators, the mainloop, the hand-off: ptxas uses 152), epilogue 120 (4 rows of g, u
//   in flight: 32, p: 8, the math and two tiles' state: ptxas uses 118): 56 + 2 x 168 + 120 = 512, the register file
//   exactly.
#pragma once

#include <cstdint>

#include "device/cuda_utils.h"
#include "sm90/kit/fragment.cuh"
#include "sm90/kit/pipeline.cuh"
#include "sm90/kit/ptx.h"
#include "sm90/kit/smem.h"
#include "sm90/kit/store.cuh"
#include "sm90/m_grouped/config.cuh"
#include "sm90/m_grouped/dswiglu.cuh"
#include "sm90/m_grouped/mainloop.cuh"
#include "sm90/m_grouped/scheduler.cuh"

#ifndef MEGAMOE_DH_EPILOGUE_WARPGROUP
#define MEGAMOE_DH_EPILOGUE_WARPGROUP 0
#endif

namespace megamoe::sm90::m_grouped {

// dH's launch picks the 4-warpgroup kernel (the build option).
constexpr bool kDhEpilogueWarpgroup = MEGAMOE_DH_EPILOGUE_WARPGROUP != 0;

constexpr int kDhNumMmaWarpgroups = kNumConsumers;
constexpr int kDhNumWarpgroups = 1 + kDhNumMmaWarpgroups + 1;  // producer, MMA, epilogue
constexpr int kDhNumThreads = kDhNumWarpgroups * kWarpgroupThreads;
constexpr int kDhEpilogueWarpgroupIdx = kDhNumWarpgroups - 1;
constexpr int kDhProducerRegs = 56;
constexpr int kDhMmaRegs = 168;
constexpr int kDhEpilogueRegs = 120;
// wgmmas per k16 step (WgmmaMainloop): two of m64n128 (the opening comment says why).
constexpr int kDhMmaNSplit = 2;
static_assert(kDhNumThreads == 512, "four warpgroups");
static_assert((kDhProducerRegs + kDhNumMmaWarpgroups * kDhMmaRegs + kDhEpilogueRegs) * kWarpgroupThreads ==
                  kRegisterFile,
              "setmaxnreg budgets (producer + 2 MMA + epilogue) sum to the register file: no more (the MMA "
              "warpgroups' setmaxnreg.inc would wait forever), no less (registers left idle)");
static_assert(kDhProducerRegs % 8 == 0 && kDhMmaRegs % 8 == 0 && kDhEpilogueRegs % 8 == 0,
              "setmaxnreg takes multiples of 8");
static_assert(kDhProducerRegs >= 24 && kDhMmaRegs <= 256 && kDhEpilogueRegs >= 24, "setmaxnreg's range is 24 .. 256");
static_assert(kDhProducerRegs <= kRegisterFile / kDhNumThreads && kDhEpilogueRegs <= kRegisterFile / kDhNumThreads &&
                  kDhMmaRegs >= kRegisterFile / kDhNumThreads,
              "producer and epilogue give registers up (dec), the MMA warpgroups take them (inc), from 128 at launch");

// The hand-off: a chunk is one MMA warp's 16 accumulator rows of its row block x the tile's 256 columns, in f32.
constexpr int kHandoffRows = AccFragment::kWarpRows;
constexpr int kHandoffCols = Cooperative::kBlockN;
constexpr int kHandoffRowBytes = kHandoffCols * static_cast<int>(sizeof(float));
constexpr int kHandoffSlotBytes = kHandoffRows * kHandoffRowBytes;
constexpr int kHandoffChunksPerTile = kBlockM / kHandoffRows;  // one per MMA warp
constexpr int kDhMinSlots = kHandoffChunksPerTile / 2;
constexpr int kDhMinStages = 3;
constexpr int kHandoffFullArrivals = kWarpSize;  // the writing warp's lanes
constexpr int kDhEpilogueWarps = kWarpsPerWarpgroup;
constexpr int kDhRowsPerWarp = kHandoffRows / kDhEpilogueWarps;  // rows of a chunk per epilogue warp
constexpr int kDhColsPerLane = kHandoffCols / kWarpSize;
static_assert(kHandoffChunksPerTile == kDhNumMmaWarpgroups * kWarpsPerWarpgroup, "one chunk per MMA warp");
static_assert(kDhColsPerLane == kChunkElems, "an epilogue lane's columns of a row are one 16-byte chunk of h");
static_assert(kDhRowsPerWarp * kDhEpilogueWarps == kHandoffRows, "the epilogue warps split a chunk's rows");
static_assert(kHandoffChunksPerTile * kDhRowsPerWarp == kWarpSize,
              "a warp's rows of a tile are one per lane (the tile's weights, one load a lane)");
static_assert(kHandoffRowBytes % kSwizzleBytes == 0 && kHandoffSlotBytes % kSwizzleAtomBytes == 0,
              "slot rows are whole 128-byte bank rows; slots start on a swizzle atom");

// Byte offset of 16-byte chunk `chunk` (f32 columns 4 chunk .. + 3) of row `row` in a hand-off slot: chunk position
// chunk ^ 2 (row % 4) (the layout in the opening comment).
__host__ __device__ constexpr uint32_t handoff_offset(int row, int chunk) {
    return static_cast<uint32_t>(row * kHandoffRowBytes + ((chunk ^ ((row & 3) << 1)) << 4));
}

// Shared memory of the 4-warpgroup dH kernel (1024-byte aligned by the kernel).
template <int kNumStages, int kNumSlots, int kStageBBytes>
struct DhStorageOf {
    alignas(kSwizzleAtomBytes) uint8_t a[kNumStages][kATileBytes];
    alignas(kSwizzleAtomBytes) uint8_t b[kNumStages][kStageBBytes];
    alignas(kSwizzleAtomBytes) uint8_t handoff[kNumSlots][kHandoffSlotBytes];
    uint64_t full[kNumStages];
    uint64_t empty[kNumStages];
    uint64_t handoff_full[kNumSlots];
    uint32_t handoff_read[kDhEpilogueWarps];  // chunks of the sequence each epilogue warp has read out (0, 1, ...)
};

// DhStorageOf as a template on one count, the other fixed (kit/smem.h's fit_stages sizes either).
template <class Config, int kNumSlots>
struct DhStorageWithSlots {
    template <int kNumStages>
    using Of = DhStorageOf<kNumStages, kNumSlots, Config::kBTileBytes>;
};
template <class Config, int kNumStages>
struct DhStorageWithStages {
    template <int kNumSlots>
    using Of = DhStorageOf<kNumStages, kNumSlots, Config::kBTileBytes>;
};

// The plan of one configuration: the most stages beside half a tile of hand-off, then the most slots.
template <class Config>
struct DhPlan {
    static constexpr int kStages = fit_stages<DhStorageWithSlots<Config, kDhMinSlots>::template Of, kMaxStages>();
    static constexpr int kSlots =
        fit_stages<DhStorageWithStages<Config, kStages>::template Of, kHandoffChunksPerTile, kDhMinSlots>();
    using Storage = DhStorageOf<kStages, kSlots, Config::kBTileBytes>;
    static constexpr int kSmemBytes = smem_bytes_of<Storage>();
    static_assert(kSmemBytes <= kMaxSmemBytes, "stages and the hand-off ring exceed the shared memory of an SM");
    static_assert(kStages >= kDhMinStages, "the gathered mainloop keeps at least 3 stages");
    static_assert(kSlots >= kDhMinSlots && kSlots <= kHandoffChunksPerTile, "the ring holds half a tile to a tile");
};
static_assert(DhPlan<Cooperative>::kStages == 3 && DhPlan<Cooperative>::kSlots == 5,
              "the 128 x 256 tile: 3 stages of 48 KiB and 5 f32 hand-off slots of 16 KiB");

// dH's policy on the 4-warpgroup kernel: DSwiGLUEpilogueOf's params and outputs, the epilogue in its own warpgroup.
template <class Act, bool kInterleaved>
struct DSwiGLUWarpgroupEpilogueOf
    : EpiloguePolicy</*kTmaA*/ false, /*kGateUpPairs*/ false, /*kGateUpHalves*/ false, /*kWarpStagingBytes*/ 0> {
    using Activation = Act;
    using Params = DSwiGLUParamsOf<Act>;
    static constexpr bool kEpilogueWarpgroup = true;
    static constexpr bool kDhInterleaved = kInterleaved;
    static constexpr const char* name(BLayout) { return "m_grouped_gemm_sm90[dswiglu, epilogue warpgroup]"; }
};

// The MMA warp's hand-off of its 16 rows (acc: the row block's accumulators, AccFragment layout) into the slot at
// shared address `slot`: one 8-byte store per fragment and row half. Lane (r, q) = (l / 4, l % 4) writes fragment f's
// columns 8 f + 2 q, + 1 of rows r and r + 8 (the same r % 4): chunk 2 f + q / 2 at position 2 (f ^ r % 4) + q / 2 of
// its 8-chunk group, so the lane's addresses are one of 4 lane offsets (by f % 4) plus a constant.
template <int kNumRegs>
__device__ __forceinline__ void write_handoff(uint32_t slot, const float (&acc)[kNumRegs], int lane_idx) {
    constexpr int kNumFrags = kHandoffCols / AccFragment::kFragCols;
    static_assert(kNumRegs == kNumFrags * AccFragment::kRegsPerFrag,
                  "the warp's accumulators are its 16 rows x the tile's columns");
    static_assert(handoff_offset(8, 0) == 8 * kHandoffRowBytes, "a lane's two rows share their chunk positions");
    const int row = AccFragment::row_in_warp(lane_idx);
    const int quad_lane = AccFragment::quad_lane(lane_idx);
    uint32_t lane_offsets[4];  // fragment f % 4 of each group of 4 (128 bytes)
#pragma unroll
    for (int frag_in_group = 0; frag_in_group < 4; ++frag_in_group) {
        lane_offsets[frag_in_group] =
            slot + handoff_offset(row, 2 * frag_in_group + quad_lane / 2) + static_cast<uint32_t>(quad_lane % 2) * 8;
    }
#pragma unroll
    for (int frag_idx = 0; frag_idx < kNumFrags; ++frag_idx) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int reg_idx = AccFragment::reg(frag_idx, half);
            const uint32_t constant = (frag_idx / 4) * 8 * 16 + half * AccFragment::kHalfRows * kHandoffRowBytes;
            st_shared_v2_f32(lane_offsets[frag_idx % 4] + constant, acc[reg_idx], acc[reg_idx + 1]);
        }
    }
}

// g and u of one tile row (`local_row`) at the lane's columns col .. col + 7 (16 bytes each), zeros where the row is
// past the tile's end or the columns past I (I % 8 == 0: a chunk is all in or all out).
__device__ __forceinline__ void load_gate_up(const MainloopParams& params, const void* h, const Tile& tile,
                                             int local_row, int64_t col, uint32_t (&gate)[4], uint32_t (&up)[4]) {
    if (local_row < tile.num_rows && col < params.n) {
        const uint16_t* row = static_cast<const uint16_t*>(h) + (tile.row_begin + local_row) * 2 * params.n;
        load_chunk(row, col, gate);
        load_chunk(row + params.n, col, up);
    } else {
#pragma unroll
        for (int word = 0; word < 4; ++word) gate[word] = up[word] = 0;
    }
}

// The epilogue warpgroup's steps (warp roles in the opening comment); `Ring` the hand-off ring's StagePipeline.
template <typename T, class Act, bool kInterleaved>
struct DhEpilogueWarpgroup {
    using Params = DSwiGLUParamsOf<Act>;

    // The weight of the warp's row of the tile that lane l stands for (chunk l / 4, row l % 4 of the warp's rows), 0
    // past the tile's end.
    __device__ __forceinline__ static float lane_row_weight(const MainloopParams& params, const Params& epilogue,
                                                            const Tile& tile, int warp_idx, int lane_idx) {
        const int local_row =
            lane_idx / kDhRowsPerWarp * kHandoffRows + warp_idx * kDhRowsPerWarp + lane_idx % kDhRowsPerWarp;
        if (local_row >= tile.num_rows) return 0.0f;
        const int64_t slot_idx = cuda::slot_of_row(params.a_gather_slots, tile.row_begin + local_row);
        return cuda::load_weight(epilogue.weights, epilogue.weights_dtype, slot_idx);
    }

    // dSwiGLU of one row at the lane's 8 columns (col .. col + 7; `valid`: the row is in the tile and the columns
    // below I), its outputs stored where valid; returns the lane's part of the row's ds (column order; 0 where not
    // valid).
    __device__ __forceinline__ static float compute_row(const Params& epilogue, int64_t intermediate, int64_t row_idx,
                                                        int64_t col, bool valid, const uint32_t (&gate_words)[4],
                                                        const uint32_t (&up_words)[4], const float (&p)[kDhColsPerLane],
                                                        float weight) {
        float ds = 0.0f;
        float d_gate[kDhColsPerLane], d_up[kDhColsPerLane], scaled_act[kDhColsPerLane];
#pragma unroll
        for (int word = 0; word < kDhColsPerLane / 2; ++word) {
            float gate[2], up[2];
            cuda::unpack_pair<T>(gate_words[word], gate[0], gate[1]);
            cuda::unpack_pair<T>(up_words[word], up[0], up[1]);
#pragma unroll
            for (int item = 0; item < 2; ++item) {
                const int idx = 2 * word + item;
                dswiglu_element<Act>(epilogue, gate[item], up[item], p[idx], weight, ds, d_gate[idx], d_up[idx],
                                     scaled_act[idx]);
            }
        }
        if (!valid) return 0.0f;
        T* dh = static_cast<T*>(epilogue.dh) + row_idx * 2 * intermediate;
        uint32_t words[4];
        if constexpr (kInterleaved) {  // dh positions 2 col .. 2 col + 15: (dg, du) pairs, two 16-byte chunks
#pragma unroll
            for (int half = 0; half < 2; ++half) {
#pragma unroll
                for (int word = 0; word < 4; ++word) {
                    words[word] = cuda::pack_pair<T>(d_gate[4 * half + word], d_up[4 * half + word]);
                }
                store_chunk(dh, 2 * col + half * kChunkElems, words);
            }
        } else {
#pragma unroll
            for (int word = 0; word < 4; ++word)
                words[word] = cuda::pack_pair<T>(d_gate[2 * word], d_gate[2 * word + 1]);
            store_chunk(dh, col, words);
#pragma unroll
            for (int word = 0; word < 4; ++word) words[word] = cuda::pack_pair<T>(d_up[2 * word], d_up[2 * word + 1]);
            store_chunk(dh + intermediate, col, words);
        }
#pragma unroll
        for (int word = 0; word < 4; ++word) {
            words[word] = cuda::pack_pair<T>(scaled_act[2 * word], scaled_act[2 * word + 1]);
        }
        store_chunk(static_cast<T*>(epilogue.act) + row_idx * intermediate, col, words);
        return ds;
    }

    // Every tile of the CTA (thread_idx: 0 .. 127 in the warpgroup).
    template <class Ring, class Storage>
    __device__ __forceinline__ static void run(const MainloopParams& params, const Params& epilogue, const Ring& ring,
                                               Storage& smem, Scheduler scheduler, int thread_idx) {
        const int warp_idx = thread_idx / kWarpSize;
        const int lane_idx = thread_idx % kWarpSize;
        const int64_t intermediate = params.n;
        const int odd_quad = (lane_idx / 4) % 2;
        auto tile_row = [&](int chunk, int row) { return chunk * kHandoffRows + warp_idx * kDhRowsPerWarp + row; };
        auto lane_col = [&](const Tile& tile) { return tile.n_tile_idx * kHandoffCols + lane_idx * kDhColsPerLane; };
        Tile tile;
        if (!scheduler.next(tile, lane_idx)) return;
        float weight = lane_row_weight(params, epilogue, tile, warp_idx, lane_idx);
        uint32_t gate[kDhRowsPerWarp][4], up[kDhRowsPerWarp][4];  // this chunk's rows (then the next chunk's)
#pragma unroll
        for (int row = 0; row < kDhRowsPerWarp; ++row) {
            load_gate_up(params, epilogue.h, tile, tile_row(0, row), lane_col(tile), gate[row], up[row]);
        }
        typename Ring::State state;
        uint32_t sequence_idx = 0;  // the chunk's place in the CTA's sequence
        const uint32_t read_counter = shared_address(&smem.handoff_read[warp_idx]);
        for (;;) {
            Tile next_tile;
            const bool has_next = scheduler.next(next_tile, lane_idx);
            const float next_weight =
                has_next ? lane_row_weight(params, epilogue, next_tile, warp_idx, lane_idx) : 0.0f;
            const int64_t col = lane_col(tile);
#pragma unroll 1
            for (int chunk = 0; chunk < kHandoffChunksPerTile; ++chunk) {
                ring.consumer_wait(state);
                const uint32_t slot = shared_address(smem.handoff[state.index]);
#pragma unroll
                for (int row = 0; row < kDhRowsPerWarp; ++row) {
                    const int local_row = tile_row(chunk, row);
                    const int slot_row = warp_idx * kDhRowsPerWarp + row;
                    // Chunks 2 l and 2 l + 1, the first of them first where l / 4 is even (a quarter-warp's first
                    // loads: positions 0, 2, 4, 6 and then 1, 3, 5, 7 of their group, XORed by the row's 2 (r % 4)).
                    uint32_t first[4], second[4];
                    ld_shared_v4(slot + handoff_offset(slot_row, 2 * lane_idx + odd_quad), first);
                    ld_shared_v4(slot + handoff_offset(slot_row, 2 * lane_idx + 1 - odd_quad), second);
                    float p[kDhColsPerLane];
#pragma unroll
                    for (int word = 0; word < 4; ++word) {
                        p[word] = __uint_as_float(odd_quad != 0 ? second[word] : first[word]);
                        p[4 + word] = __uint_as_float(odd_quad != 0 ? first[word] : second[word]);
                    }
                    if (row + 1 == kDhRowsPerWarp) {  // the warp's p of the chunk read out: the slot may be refilled
                        __syncwarp();
                        if (lane_idx == 0) st_release_shared_u32(read_counter, sequence_idx + 1);
                    }
                    const float row_weight =
                        __shfl_sync(0xffffffffu, weight, chunk * kDhRowsPerWarp + row);  // lane_row_weight's lane
                    const bool row_valid = local_row < tile.num_rows;                    // warp-uniform
                    const int64_t row_idx = tile.row_begin + local_row;
                    float ds = compute_row(epilogue, intermediate, row_idx, col, row_valid && col < intermediate,
                                           gate[row], up[row], p, row_weight);
#pragma unroll
                    for (int lane_mask = kWarpSize / 2; lane_mask >= 1; lane_mask /= 2) {
                        ds += __shfl_xor_sync(0xffffffffu, ds, lane_mask);
                    }
                    if (row_valid && lane_idx == 0) {
                        epilogue.ds_parts[row_idx * params.num_n_tiles + tile.n_tile_idx] = ds;
                    }
                    // This row's registers take the next chunk's row (of this tile, or the next tile's first).
                    if (chunk + 1 < kHandoffChunksPerTile) {
                        load_gate_up(params, epilogue.h, tile, tile_row(chunk + 1, row), col, gate[row], up[row]);
                    } else if (has_next) {
                        load_gate_up(params, epilogue.h, next_tile, tile_row(0, row), lane_col(next_tile), gate[row],
                                     up[row]);
                    }
                }
                state.advance();
                ++sequence_idx;
            }
            if (!has_next) break;
            tile = next_tile;
            weight = next_weight;
        }
    }
};

// The 4-warpgroup kernel's parts for one policy, B layout and configuration.
template <typename T, class Epi, BLayout kBLayout, class Config>
struct DhKernel {
    static_assert(Epi::kEpilogueWarpgroup && !Config::kFp8, "16-bit dH on an epilogue warpgroup");
    using Plan = DhPlan<Config>;
    using Storage = typename Plan::Storage;
    static constexpr int kNumStages = Plan::kStages;
    static constexpr int kNumSlots = Plan::kSlots;
    using Pipeline = StagePipeline<kNumStages, kClusterSize>;
    // The ring's full side (its empty barriers unused: handoff_read counts instead); arrivals by mbarrier_arrive.
    using Ring = StagePipeline<kNumSlots, 1>;
    using Loader = StageLoader<Config, Epi, kBLayout, BSource::kOne>;
    using Mainloop = WgmmaMainloop<T, Config, Epi, kBLayout, kDhMmaNSplit>;
    using Epilogue = DhEpilogueWarpgroup<T, typename Epi::Activation, Epi::kDhInterleaved>;

    // MMA warpgroup `mma_idx`: every tile of the CTA, rows [64 mma_idx, + 64): the mainloop, then each warp's
    // hand-off of its 16 rows (chunk 4 mma_idx + warp of the tile).
    __device__ __forceinline__ static void mma(const MainloopParams& params, const Pipeline& pipeline, const Ring& ring,
                                               Storage& smem, Scheduler scheduler, int num_k_blocks, int mma_idx,
                                               int thread_idx) {
        const int lane_idx = thread_idx % kWarpSize;
        const int warp_idx = (thread_idx % kWarpgroupThreads) / kWarpSize;
        const int chunk_idx = mma_idx * kWarpsPerWarpgroup + warp_idx;
        int sequence_idx = chunk_idx;  // the chunk's place in the CTA's sequence: 8 t + chunk_idx
        typename Pipeline::State state;
        float acc[Config::kNumAccRegs];
        for (Tile tile; scheduler.next(tile, lane_idx);) {
            Mainloop::mma_tile(pipeline, state, smem, params, NoScaleParams{}, tile, num_k_blocks, mma_idx, warp_idx,
                               lane_idx, acc);
            typename Ring::State slot;
            slot.index = sequence_idx % kNumSlots;
            slot.phase = static_cast<uint32_t>(sequence_idx / kNumSlots) & 1u;
            // The slot's previous chunk (sequence_idx - kNumSlots) read out by every epilogue warp.
            if (sequence_idx >= kNumSlots) {
                const auto needed = static_cast<uint32_t>(sequence_idx - kNumSlots + 1);
#pragma unroll 1
                for (int epilogue_warp = 0; epilogue_warp < kDhEpilogueWarps; ++epilogue_warp) {
                    const uint32_t counter = shared_address(&smem.handoff_read[epilogue_warp]);
                    while (ld_acquire_shared_u32(counter) < needed) {
                    }
                }
            }
            if (chunk_idx * kHandoffRows < tile.num_rows) {  // a chunk past the tile's end is not read
                write_handoff(shared_address(smem.handoff[slot.index]), acc, lane_idx);
            }
            mbarrier_arrive(ring.full_barrier(slot));  // every lane: its stores are released with its arrival
            sequence_idx += kHandoffChunksPerTile;
        }
    }
};

// dH reads one B map (kBSource::kOne) and stores by its epilogue warpgroup (no TMA store map): the loader's second B
// map is b_map, never read.
template <typename T, class Epi, BLayout kBLayout, class Config>
__global__ void __launch_bounds__(kDhNumThreads, 1)
    m_grouped_gemm_sm90_dh_kernel(const __grid_constant__ CUtensorMap a_map, const __grid_constant__ CUtensorMap b_map,
                                  const KernelParams<typename Epi::Params, ScaleParamsOf<Config>> params) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
    using Parts = DhKernel<T, Epi, kBLayout, Config>;
    using Storage = typename Parts::Storage;
    extern __shared__ uint8_t smem_raw[];
    const uint32_t misalignment = shared_address(smem_raw) % kSwizzleAtomBytes;
    Storage& smem = *reinterpret_cast<Storage*>(smem_raw + (misalignment == 0 ? 0 : kSwizzleAtomBytes - misalignment));
    const typename Parts::Pipeline pipeline{smem.full, smem.empty};
    const typename Parts::Ring ring{smem.handoff_full, nullptr};

    const int thread_idx = static_cast<int>(threadIdx.x);
    if (thread_idx == 0) {
        for (int stage_idx = 0; stage_idx < Parts::kNumStages; ++stage_idx) {
            mbarrier_init(&smem.full[stage_idx], Parts::Loader::kFullArrivals);
            mbarrier_init(&smem.empty[stage_idx], kClusterSize * Config::kEmptyArrivalsPerCta);
        }
        for (int slot_idx = 0; slot_idx < Parts::kNumSlots; ++slot_idx) {
            mbarrier_init(&smem.handoff_full[slot_idx], kHandoffFullArrivals);
        }
        for (int warp = 0; warp < kDhEpilogueWarps; ++warp) smem.handoff_read[warp] = 0;
        fence_barrier_init();
        prefetch_tensor_map(&b_map);
    }
    cluster_sync();  // barriers initialised in both CTAs before any multicast or remote arrive
    const uint32_t cta_rank = cluster_cta_rank();

    const MainloopParams& mainloop = params.mainloop;
    const auto num_k_blocks = static_cast<int>(cuda::ceil_div(mainloop.k, Config::kBlockK));
    // Each role makes its scheduler after its setmaxnreg: nothing of it is live across the register reallocation.
    auto scheduler = [&] { return Scheduler(mainloop, mainloop.m_tile_offsets[mainloop.num_experts], cta_rank); };
    const int warpgroup_idx = __shfl_sync(0xffffffffu, thread_idx / kWarpgroupThreads, 0);
    if (warpgroup_idx == 0) {
        setmaxnreg_dec<kDhProducerRegs>();
        Parts::Loader::run(&a_map, &b_map, &b_map, mainloop, pipeline, smem, scheduler(), num_k_blocks, cta_rank,
                           thread_idx);
    } else if (warpgroup_idx == kDhEpilogueWarpgroupIdx) {
        setmaxnreg_dec<kDhEpilogueRegs>();
        Parts::Epilogue::run(mainloop, params.epilogue, ring, smem, scheduler(),
                             thread_idx - kDhEpilogueWarpgroupIdx * kWarpgroupThreads);
    } else {
        setmaxnreg_inc<kDhMmaRegs>();
        Parts::mma(mainloop, pipeline, ring, smem, scheduler(), num_k_blocks, warpgroup_idx - 1, thread_idx);
    }
    cluster_sync();  // no CTA leaves while the other may still arrive on its barriers
#endif
}

}  // namespace megamoe::sm90::m_grouped
