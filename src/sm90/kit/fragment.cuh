// The wgmma accumulator fragment of one thread (PTX ISA, "wgmma ... Matrix D register fragment"), for an m64 x N row
// block of a warpgroup: lane l of warp w holds rows 16 w + l / 4 and 16 w + l / 4 + 8 of the block (its two "halves"),
// and, in each 8-column fragment f, columns 8 f + 2 (l % 4) and that + 1. Register 4 f + 2 h + j holds row half h,
// column j of fragment f. Every epilogue and mainloop that reads accumulators by position uses these.
#pragma once

namespace megamoe::sm90 {

struct AccFragment {
    static constexpr int kRegsPerFrag = 4;  // 2 rows x 2 columns
    static constexpr int kFragCols = 8;     // columns of a fragment
    static constexpr int kWarpRows = 16;    // rows of a row block per warp
    static constexpr int kHalfRows = 8;     // from a thread's first row to its second

    // The register of (fragment, row half); + 1 for the pair's second column.
    __device__ __forceinline__ static constexpr int reg(int frag_idx, int half) {
        return frag_idx * kRegsPerFrag + half * 2;
    }
    // The row half and the fragment of register `reg_idx`.
    __device__ __forceinline__ static constexpr int half_of(int reg_idx) { return reg_idx % kRegsPerFrag / 2; }
    __device__ __forceinline__ static constexpr int frag_of(int reg_idx) { return reg_idx / kRegsPerFrag; }
    // The lane's position in its quad: its column pair 2 q, 2 q + 1 of every fragment.
    __device__ __forceinline__ static int quad_lane(int lane_idx) { return lane_idx % 4; }
    __device__ __forceinline__ static int first_col(int lane_idx) { return 2 * (lane_idx % 4); }
    // The thread's first row in its warp's 16 (the second: + kHalfRows); in the 64-row block: warp_idx * kWarpRows on.
    __device__ __forceinline__ static int row_in_warp(int lane_idx) { return lane_idx / 4; }
};

}  // namespace megamoe::sm90
