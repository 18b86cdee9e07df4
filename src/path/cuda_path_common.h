// What the forward (cuda_forward.cu) and backward (cuda_backward.cu) orchestration of the CUDA path share: the up
// projection's GEMM arguments, the device facts read once per device, the routing plan of a call and the reason a call
// stays off the sm_90a kernels. The path itself: cuda_path.cu's opening block.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <string>

#include "common.h"
#include "path/call.h"
#include "portable/grouped_gemm.h"
#include "portable/routing.h"
#include "test_overrides.h"

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

// The device is compute capability 9.0 and MEGAMOE_DISABLE_SM90 (set and not "0") does not keep calls off the sm_90a
// kernels.
bool sm90_device_ok(int device_index);

RoutingPlan make_routing_plan(const Call& call);

// Why a call whose device and shapes suit the sm_90a kernels runs the portable ones: its expert parameters' alignment.
std::string blocked_reason(const Call& call);

}  // namespace megamoe::cuda
