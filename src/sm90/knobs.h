// Experiment switches of the sm_90a kernels, read from the environment at each launch. Each keeps a variant on main
// beside the default so that one GPU run can time both in the same library (scripts/gpu_ab_knobs.sh); a variant that
// wins becomes the default and its switch goes. Unset, empty or unknown values select the default.
//   MEGAMOE_SM90_DSWIGLU_MATH=fast     dH's SwiGLU backward with the SFU's tanh (SwiGLUFastActivation); level with
//                                      the default on the H200, but its kernels spill 56-104 bytes (-Xptxas -v)
//   MEGAMOE_SM90_M_PINGPONG=128        the M-grouped kernel's default-option up (SwiGLU) and store (down, dX) GEMMs on
//                                      the ping-pong 128 x 128 tile (the other consumer's mainloop under an epilogue);
//                                      1.4-1.6x slower for up, 1.2x for down and dX on the H200 (2026-12-02)
//   MEGAMOE_SM90_DH_PINGPONG=128       dH with the default dSwiGLU epilogue (SwiGLU, [dg, du], dy gathered) on the
//                                      ping-pong 128 x 128 tile: one consumer's epilogue under the other's mainloop;
//                                      ds in 128-column parts (d topk_weights rounds differently); ~10 % slower
//   MEGAMOE_SM90_PDL=1                 the sm_90a kernels launched programmatically (PDL): each may start, and run its
//                                      prologue, while the stream's previous kernel finishes
//   MEGAMOE_SM90_SORTED_DY=1           the backward copies dy into sorted-row order once (in the dw13 output's scratch,
//                                      beside s a) and feeds dH and dW2 from it by TMA instead of gathering its rows
//   MEGAMOE_SM90_K_TILE=128x256        the K-grouped kernel on its 128 x 256 tile even where B is gathered (dW13):
//                                      the tile it used before the 256 x 128 one
//   MEGAMOE_SM90_M_LATE_DECODE=1       the M-grouped 16-bit consumers decode their next tile (two binary searches of
//                                      the M-tile offsets, the expert's rows) while their tile's last batch runs, not
//                                      before its mainloop, as the K-grouped ones do since session 12 (not yet timed)
//   MEGAMOE_SM90_FP8_PROMOTE=1         the FP8 M-grouped GEMMs on the 128 x 128 tile promoting each K group from a
//                                      second set of accumulators (Operands::kFp8Blockwise) instead of the 128 x 256
//                                      tile with one set in the current group's units: 0.6-0.75x its speed (H200)
//   MEGAMOE_SM90_FP8_HALVES=1          the FP8 M-grouped GEMMs' rescaled mainloop as two m64 x 128 column halves
//                                      (Operands::kFp8Rescaled; A read from shared memory once per half) instead of
//                                      m64 x 256 wgmmas (kFp8RescaledFullN, the default since session 11): the same
//                                      math; the halves measured 1.0-1.34x the full width's time per GEMM (up at
//                                      qwen3-235b-a22b: 1.93-2.17 ms against 1.62), never faster (H200, 2026-12-02)
//   MEGAMOE_SM90_FP8_WGRAD_PAIR=1      the K-grouped FP8 GEMM in clusters of 2 CTAs on neighbouring n-tiles, A's
//                                      halves multicast into both (a quarter less L2 -> SM traffic per stage): level at
//                                      qwen3-30b-a3b, 3-12 % slower at qwen3-235b-a22b and deepseek-v3 (session 10)
//   MEGAMOE_SM90_FP8_WGRAD_OVERLAP=1   the K-grouped FP8 GEMM's consumers issue the next tile's first K group before
//                                      storing a tile, its epilogue under those wgmmas: level with the default
//                                      (-5 % to +3 %, H200, session 11)
#pragma once

#include <cstdlib>
#include <cstring>

namespace megamoe::sm90 {

// The environment variable `name` equals `value`.
inline bool env_is(const char* name, const char* value) {
    const char* set = std::getenv(name);
    return set != nullptr && std::strcmp(set, value) == 0;
}

inline bool dswiglu_fast_math() {
    return env_is("MEGAMOE_SM90_DSWIGLU_MATH", "fast");
}
inline bool programmatic_launch() {
    return env_is("MEGAMOE_SM90_PDL", "1");
}
inline bool sorted_dy() {
    return env_is("MEGAMOE_SM90_SORTED_DY", "1");
}
inline bool m_grouped_pingpong() {
    return env_is("MEGAMOE_SM90_M_PINGPONG", "128");
}
inline bool dh_pingpong() {
    return env_is("MEGAMOE_SM90_DH_PINGPONG", "128");
}
inline bool k_grouped_narrow_a_tile() {
    return env_is("MEGAMOE_SM90_K_TILE", "128x256");
}
inline bool m_grouped_late_decode() {
    return env_is("MEGAMOE_SM90_M_LATE_DECODE", "1");
}
inline bool fp8_promoted() {
    return env_is("MEGAMOE_SM90_FP8_PROMOTE", "1");
}
inline bool k_grouped_fp8_pairs() {
    return env_is("MEGAMOE_SM90_FP8_WGRAD_PAIR", "1");
}
inline bool fp8_column_halves() {
    return env_is("MEGAMOE_SM90_FP8_HALVES", "1");
}
inline bool k_grouped_fp8_overlap() {
    return env_is("MEGAMOE_SM90_FP8_WGRAD_OVERLAP", "1");
}

}  // namespace megamoe::sm90
