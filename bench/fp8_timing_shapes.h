// The reference shapes every FP8 timing program runs (bench/fp8_gemm_timing.cu, fp8_wgrad_timing.cu through
// fp8_timing_util.cuh, and fp8_layer_timing.cu), and their timing method: the median of kTimed launches after
// kWarmup, by CUDA events.
#pragma once

#include <cstdint>

namespace megamoe_bench {

struct Shape {
    const char* name;
    int64_t tokens, hidden, inter, experts, topk;
};
constexpr Shape kShapes[] = {{"qwen3-30b-a3b", 8192, 2048, 768, 128, 8},
                             {"qwen3-235b-a22b", 8192, 4096, 1536, 128, 8},
                             {"deepseek-v3", 8192, 7168, 2048, 256, 8}};

constexpr int kWarmup = 3, kTimed = 10;

}  // namespace megamoe_bench
