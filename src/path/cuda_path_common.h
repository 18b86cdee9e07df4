// What the forward (cuda_forward.cu) and backward (cuda_backward.cu) orchestration of the CUDA path share: the up
// projection's GEMM arguments, the device facts read once per device, the environment switches, the routing plan of a
// call and the reason a call stays off the sm_90a kernels. The path itself: cuda_path.cu's opening block.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <string>

#include "common.h"
#include "path/call.h"
#include "portable/grouped_gemm.h"
#include "portable/routing.h"

namespace megamoe::cuda {

// The up projection shared by forward and backward: rows of x gathered by sorted slot, times w13[e].
MGroupedGemmArgs up_gemm_args(megamoe_dtype_t dtype, const void* x, const void* w13, const RoutingPlan& plan,
                              const RoutingBuffers& routing, const Shape& shape);

// Zeroes `tensor` (element_bytes per element) on the stream, when it is given and not empty.
megamoe_status_t zero_if_wanted(const megamoe_tensor_t& tensor, size_t element_bytes, cudaStream_t stream,
                                const char* name);

size_t output_element_bytes(megamoe_dtype_t dtype);  // 4 for f32, else 2

// What the path needs to know of a device, read once per device.
struct DeviceInfo {
    int major = 0;
    int minor = 0;
    int num_sms = 0;
};
DeviceInfo device_info(int device_index);

bool sm90_weight_grads_enabled_by_env();  // MEGAMOE_SM90_WEIGHT_GRADS unset or not "0"
// MEGAMOE_FP8_ACT_PASS=1: the FP8 forward stores a in the element type and quantizes it by a pass instead of in the up
// GEMM's epilogue (bitwise the same operand; the A/B switch of the two, default off).
bool fp8_act_by_pass();
// MEGAMOE_FP8_DH_EPILOGUE=1: the FP8 backward quantizes dh for dX in dH's dSwiGLU epilogue instead of by a pass over
// the dh dH wrote (the same bytes; the A/B switch of the two, default off: the epilogue measured 0.5-0.7 ms slower at
// qwen3-30b-a3b on the H200, bench/results/2026-12-02-session10-notes.md).
bool fp8_dh_in_epilogue_by_env();
// MEGAMOE_FP8_SORTED_X=1: the FP8 forward's pass over x writes its quantized rows in sorted-row order (each routed
// slot's token row, topk times x's bytes) and the up GEMM reads them by TMA instead of gathering x's rows by cp.async
// (the same bytes and results; an experiment, default off: level with the gather or slower on the H200, session 11).
bool fp8_sorted_x_by_env();
// MEGAMOE_FP8_SORTED_DY=1: the FP8 backward's pass over dy writes its quantized rows in sorted-row order and dH reads
// them by TMA (SwiGLU, dh in the [dg, du] order and quantized by a pass, 16-bit weight gradients; an experiment:
// level with the gather or slower on the H200, session 11).
bool fp8_sorted_dy_by_env();
// MEGAMOE_FP8_WGRAD=1: the FP8 call's weight gradients on the K-grouped FP8 GEMM (their operands quantized along the
// tokens), else on the 16-bit K-grouped kernel (the default while the FP8 one is measured: TODO(#20)).
bool fp8_weight_grads_by_env();
// The FP8 backward's quantized dy and dh live in the dw13 output past the act buffer (s a, then q) when act is there
// and they fit, instead of in the workspace: dW13, the last GEMM, writes dw13 after their readers (dH, dX) ran. The FP8
// call's backward workspace is then the 16-bit call's (the H200, session 12: 117.6 -> 2.1 MiB at qwen3-30b-a3b, 326.4
// -> 4.7 MiB at deepseek-v3; the same bits, level in time). MEGAMOE_FP8_OPERANDS_IN_DW13=0 keeps them in the
// workspace (the tests compare the two).
bool fp8_operands_in_dw13_by_env();

// The device is compute capability 9.0 and MEGAMOE_DISABLE_SM90 (set and not "0") does not keep calls off the sm_90a
// kernels.
bool sm90_device_ok(int device_index);

RoutingPlan make_routing_plan(const Call& call);

// Why a call whose device and shapes suit the sm_90a kernels runs the portable ones: its expert parameters' alignment.
std::string blocked_reason(const Call& call);

}  // namespace megamoe::cuda
