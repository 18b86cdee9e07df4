// The stage pipeline of the sm_90a kernels (as CUTLASS's PipelineTmaAsync): kNumStages shared-memory stages, each with
// a full and an empty mbarrier. The producer acquires a stage (waits on its empty barrier), fills it (TMA boxes
// counted by arrive.expect_tx, and / or cp.async copies each arming an arrival) and the fill completes the full
// barrier; the consumers wait on the full barrier, read the stage (wgmma) and release it: one arrival per consumer warp
// on the stage's empty barrier in every CTA of the cluster, since the next fill may be multicast into all of them.
// Producer and consumers walk the stages with a PipelineState each (index, and the barrier parity of the current pass
// over the stages), which runs on across tiles.
// With one wgmma batch in flight per consumer, a stage is released once the batch after it has been issued and the
// batch reading it has completed (retire_previous_batch), the tile's last one at the tile's end (retire_last_batch).
#pragma once

#include <cstdint>

#include "sm90/kit/ptx.h"

namespace megamoe::sm90 {

// A cursor over kNumStages stages: the stage index and the parity of the phase its barriers are in.
template <int kNumStages>
struct PipelineState {
    int index = 0;
    uint32_t phase = 0;

    __device__ __forceinline__ void advance() {
        if (++index == kNumStages) {
            index = 0;
            phase ^= 1;
        }
    }
};

// Releases a stage whose fills may be multicast into the kClusterSize CTAs of the cluster: one arrival on the stage's
// empty barrier (at `empty_barrier`'s offset) in each of them, this CTA included.
template <int kClusterSize>
__device__ __forceinline__ void release_stage(uint64_t* empty_barrier) {
#pragma unroll
    for (uint32_t cta_rank = 0; cta_rank < kClusterSize; ++cta_rank) mbarrier_arrive_cluster(empty_barrier, cta_rank);
}

// The barriers of a pipeline (the kernel's SharedStorage holds them) and its steps.
template <int kNumStages, int kClusterSize>
struct StagePipeline {
    using State = PipelineState<kNumStages>;
    uint64_t* full;   // [kNumStages]: the stage's fill has landed
    uint64_t* empty;  // [kNumStages]: every consumer warp (of every CTA it was multicast into) has read it

    // Producer: waits until the stage is free (its previous fill consumed; a fresh barrier counts as free).
    __device__ __forceinline__ void producer_acquire(const State& state) const {
        mbarrier_wait(&empty[state.index], state.phase ^ 1);
    }
    // The barrier the producer's fill of the stage completes (expect_tx, TMA loads, cp.async arrivals).
    __device__ __forceinline__ uint64_t* full_barrier(const State& state) const { return &full[state.index]; }
    // Consumer: waits until the stage's fill has landed.
    __device__ __forceinline__ void consumer_wait(const State& state) const {
        mbarrier_wait(&full[state.index], state.phase);
    }
    // Consumer warp (its lane 0): releases stage `stage_idx` in every CTA of the cluster.
    __device__ __forceinline__ void consumer_release(int stage_idx) const {
        release_stage<kClusterSize>(&empty[stage_idx]);
    }

    // After issuing the wgmma batch of stage `state`: waits for the previous batch, releases that batch's stage and
    // moves on to the next stage; in_flight_stage becomes this one (-1: none yet).
    template <int kNumRegs>
    __device__ __forceinline__ void retire_previous_batch(float (&acc)[kNumRegs], State& state, int& in_flight_stage,
                                                          int lane_idx) const {
        wgmma_wait_group<1>();
        fence_accumulators(acc);
        if (in_flight_stage >= 0 && lane_idx == 0) consumer_release(in_flight_stage);
        in_flight_stage = state.index;
        state.advance();
    }
    // At the end of a tile: waits for the last batch and releases its stage.
    template <int kNumRegs>
    __device__ __forceinline__ void retire_last_batch(float (&acc)[kNumRegs], int in_flight_stage,
                                                      int lane_idx) const {
        wgmma_wait_group<0>();
        fence_accumulators(acc);
        if (in_flight_stage >= 0 && lane_idx == 0) consumer_release(in_flight_stage);
    }
};

}  // namespace megamoe::sm90
