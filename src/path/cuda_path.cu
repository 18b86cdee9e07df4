// The CUDA path (cuda_path.h): host orchestration of routing, grouped GEMMs (the fused sm_90a kernels or the portable
// ones) and row kernels on the caller's stream. No device->host synchronisation, no allocation: every buffer is carved
// out of the caller's workspace (256-byte aligned, sized by host-known bounds: S = T * topk rows), or, in the sm_90a
// backward, out of the dw13 output until dW13 writes it (below).
//
// Forward:  routing -> up GEMM (x gathered; gated epilogue: [g, u] + b13, then the activation) -> a [S, I]
//           -> down GEMM -> o [S, H] (element type) -> gather_sum with topk_weights -> y.
//           The GEMMs run on the fused sm_90a kernels (sm90/m_grouped_gemm_sm90.h) on a compute capability 9.0
//           device when the operands suit them, else on the portable kernels; MEGAMOE_DISABLE_SM90=1 forces
//           the portable ones. Both write the same buffers, so the workspace is the same.
//           With saved_h, the up GEMM also writes h = [g, u] into it, by sorted row (the routing is deterministic, so
//           the backward's routing finds the same rows).
// Backward: routing -> h = [g, u]: the forward's saved_h (keep-h mode), or recomputed by the up GEMM into the
//           workspace (recompute mode), by sorted row either way
//           -> dH GEMM (dy gathered x w2[e]) with the dSwiGLU epilogue: dh = [dg, du] [S, 2I] by sorted row written
//              over h in place (keep-h mode: saved_h is consumed), s * a [S, I] and ds partial sums per 256-column
//              n-tile (portable: p f32 [S, I], then the row kernel dswiglu_rows, or dact_rows for the other options)
//           -> finalize d topk_weights (parts added in order)
//           -> dW2 = K-grouped(dy gathered, s * a)
//           -> dX GEMM (dh x w13[e]) -> q [S, H] (sm_90a: over s * a; portable: over p) -> gather_sum -> dx
//           -> dW13 = K-grouped(dh, x gathered) -> db13 / db2 (per-expert column sums of dh / s dy), when given.
//           sm_90a: s * a and q live in the dw13 output until dW13 writes it, when dw13 is wanted without
//           accumulation and can hold them, 256-byte aligned (dw13_as_act_scratch; the workspace size query sees
//           the same params).
//           accumulate_weight_grads: both K-grouped GEMMs add into the f32 dw13 / dw2 in their epilogues, and a call
//           with no rows leaves them untouched (no memset).
//           Up, dH and dX run on the sm_90a kernels under the forward's conditions (all three must suit them);
//           there q is in the element type, like the forward's o rows: gather_sum still adds the topk rows in
//           f32, so the one extra rounding per row is of the size of dx's own output rounding. The portable
//           kernels write p and q in f32, so the portable path needs the larger workspace (BackwardPlan sizes it
//           for the path the call takes). The K-grouped weight gradients run on sm90/k_grouped_gemm_sm90.h with
//           the rest of the sm_90a backward (the test override MEGAMOE_TEST_PORTABLE_WEIGHT_GRADS keeps them on the
//           portable kernel).
// Non-default expert options (layouts, clamped SwiGLU, biases) run on the portable kernels (steps_portable.h: the same
// steps, B read in the weights' layout, dh in w13's row order, bias gradients as per-expert column sums), and on the
// sm_90a kernels (steps_sm90.h) every layout: the gated epilogue takes the activation, b13 and the interleaved
// pairs, B read kKN where w13 is stored transposed; the down GEMM's store epilogue adds b2; the dSwiGLU epilogue writes
// dh in w13's row order (interleaved: into its own buffer, not over h), ds's bias term <dy, b2[e]> is added to the
// first ds part by a row kernel; dX and dW13 read dh as w13 stores its rows (transposed: kNK / the operands swapped),
// dW2 likewise for a transposed w2; db13 / db2 are the portable column sums on both. The separate layout reads w1 and
// w3 in place: the up GEMM's up boxes and dX's K rows [I, 2I) from a second tensor map over w3, dw13 and dw3 as two
// K-grouped GEMMs over dh's gate and up columns. Misaligned biases or w3 keep a call on the portable kernels.
// Both entry points run these same steps on a Call (call.h): grouped rows are T = R tokens of one slot each, their
// routing a scan of tokens_per_expert (no sort; the gathers are the identity), their weights the scores (or 1); the
// combine and the dx gather-sum then only scale / copy each row and write 0 for the padding rows past the counts'
// sum. Their counts are checked on the device: when invalid, the routing flags every row (NaN out, dx, d scores) and
// the weight gradients are filled with NaN after they are computed.
// The code: a call's plan (plan.h: its backend, portable, sm90 or sm90-FP8, and its workspace), each backend's steps
// (steps.h), the forward and the backward as lists of steps (forward.cu, backward.cu); this file: the pieces they share
// (cuda_path_common.h).
#include "path/cuda_path_common.h"

#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>

#include "device/cuda_utils.h"
#include "path/steps_sm90.h"
#include "dtype.h"

namespace megamoe::cuda {

megamoe_status_t zero_if_wanted(const megamoe_tensor_t& tensor, size_t element_bytes, cudaStream_t stream,
                                const char* name) {
    const int64_t count = numel(tensor);
    if (tensor.data == nullptr || count == 0) return MEGAMOE_STATUS_SUCCESS;
    return check_cuda(cudaMemsetAsync(tensor.data, 0, static_cast<size_t>(count) * element_bytes, stream), name);
}

size_t output_element_bytes(megamoe_dtype_t dtype) {
    return dtype == MEGAMOE_DTYPE_F32 ? 4 : 2;
}

DeviceInfo device_info(int device_index) {
    static std::mutex mutex;
    static std::map<int, DeviceInfo> cache;
    const std::lock_guard<std::mutex> lock(mutex);
    const auto found = cache.find(device_index);
    if (found != cache.end()) return found->second;
    DeviceInfo info;
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, device_index) == cudaSuccess) {
        info.major = prop.major;
        info.minor = prop.minor;
        info.num_sms = prop.multiProcessorCount;
    } else {
        cudaGetLastError();
    }
    cache.emplace(device_index, info);
    return info;
}

bool sm90_device_ok(int device_index) {
    const char* disabled = std::getenv("MEGAMOE_DISABLE_SM90");
    if (disabled != nullptr && disabled[0] != '\0' && std::strcmp(disabled, "0") != 0) return false;
    const DeviceInfo info = device_info(device_index);
    return info.major == 9 && info.minor == 0;
}

RoutingPlan make_routing_plan(const Call& call) {
    return RoutingPlan::make(call.shape, kGemmBlockM, call.rows_sorted);
}

std::string blocked_reason(const Call& call) {
    const char* blocker = sm90_options_blocker(call);
    return std::string(blocker != nullptr ? blocker : "the expert options") +
           "; this call runs the portable CUDA kernels";
}

}  // namespace megamoe::cuda
