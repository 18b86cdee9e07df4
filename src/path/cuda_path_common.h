// What the CUDA path's plans and steps share (cuda_path.cu): the device facts read once per device, the routing plan of
// a call, the reason a call stays off the sm_90a kernels and the zeroing of a wanted output. The path itself:
// cuda_path.cu's opening block.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <string>

#include "common.h"
#include "path/call.h"
#include "portable/routing.h"

namespace megamoe::cuda {

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
