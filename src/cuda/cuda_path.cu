// The portable CUDA path (cuda_path.h): host orchestration of routing, grouped GEMMs and row kernels
// on the caller's stream. No device->host synchronisation, no allocation: every buffer is carved out
// of the caller's workspace (256-byte aligned, sized by host-known bounds: S = T * topk rows).
//
// Forward:  routing -> up GEMM (x gathered, SwiGLU epilogue) -> a [S, I]
//           -> down GEMM -> o [S, H] (element type) -> gather_sum with topk_weights -> y.
//           The GEMMs run on the fused sm_90a kernels (sm90/grouped_gemm_sm90.h) on a compute capability 9.0
//           device when the operands suit them, else on the portable kernels; MEGAMOE_DISABLE_SM90=1 forces
//           the portable ones. Both write the same buffers, so the workspace is the same.
//           With saved_h, the up GEMM also writes h = [g, u] into it, by sorted row (the routing is deterministic, so
//           the backward's routing finds the same rows).
// Backward: routing -> h = [g, u]: the forward's saved_h (keep-h mode), or recomputed by the up GEMM into the
//           workspace (recompute mode), by sorted row either way
//           -> dH GEMM (dy gathered x w2[e]) with the dSwiGLU epilogue: dh = [dg, du] [S, 2I] by sorted row written
//              over h in place (keep-h mode: saved_h is consumed), s * a [S, I] and ds partial sums per 256-column
//              n-tile
//              (portable: p f32 [S, I], then dswiglu_rows) -> finalize d topk_weights (parts added in order)
//           -> dW2 = K-grouped(dy gathered, s * a)
//           -> dX GEMM (dh x w13[e]) -> q [S, H] (sm_90a: over s * a; portable: over p) -> gather_sum -> dx
//           -> dW13 = K-grouped(dh, x gathered).
//           sm_90a: s * a and q live in the dw13 output until dW13 writes it, when dw13 is wanted without
//           accumulation and can hold them (dw13_as_act_scratch; the workspace size query sees the same params).
//           accumulate_weight_grads: both K-grouped GEMMs add into the f32 dw13 / dw2 in their epilogues, and a call
//           with no rows leaves them untouched (no memset).
//           Up, dH and dX run on the sm_90a kernels under the forward's conditions (all three must suit them);
//           there q is in the element type, like the forward's o rows: gather_sum still adds the topk rows in
//           f32, so the one extra rounding per row is of the size of dx's own output rounding. The portable
//           kernels write p and q in f32, so the portable path needs the larger workspace (BackwardPlan sizes it
//           for the path the call takes). The K-grouped weight gradients run on sm90/k_grouped_gemm_sm90.h with
//           the rest of the sm_90a backward, unless MEGAMOE_SM90_WEIGHT_GRADS=0 keeps them on the portable kernel.
// Non-default expert options (layouts, clamped SwiGLU, biases) run on the portable kernels through layout_steps.h (the
// same steps, B read in the weights' layout, dh in w13's row order, bias gradients as per-expert column sums), and on
// the sm_90a kernels (cuda/sm90_args.h) every layout: the gated epilogue takes the activation, b13 and the interleaved
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
#include "cuda/cuda_path.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>

#include "cuda/call.h"
#include "cuda/cuda_utils.h"
#include "cuda/elementwise.h"
#include "cuda/grouped_gemm.h"
#include "cuda/layout_rows.h"
#include "cuda/layout_steps.h"
#include "cuda/routing.h"
#include "cuda/sm90_args.h"
#include "dtype.h"
#include "sm90/grouped_gemm_sm90.h"
#include "sm90/k_grouped_gemm_sm90.h"

namespace megamoe::cuda {
namespace {

struct ForwardWorkspace {
    RoutingBuffers routing;
    uint16_t* act;  // [S, I] element type
    uint16_t* out;  // [S, H] element type

    static ForwardWorkspace carve(WorkspaceCarver& carver, const RoutingPlan& plan, const Shape& shape) {
        ForwardWorkspace workspace;
        const int64_t num_slots = shape.num_slots();
        workspace.routing = RoutingBuffers::carve(carver, plan);
        workspace.act = carver.take<uint16_t>(num_slots * shape.intermediate);
        workspace.out = carver.take<uint16_t>(num_slots * shape.hidden);
        return workspace;
    }
};

struct BackwardWorkspace {
    RoutingBuffers routing;
    uint16_t* h;      // [S, 2I] element type: [g, u], then [dg, du]; keep-h mode: saved_h itself (not carved)
    uint16_t* dh;     // [S, 2I]: h itself, but on the sm_90a path with interleaved dh its own buffer
    uint16_t* act;    // [S, I] element type: s * a (sm_90a path: [S, max(I, H)], later q [S, H] over it)
    float* ds_parts;  // [S, num_ds_parts]: partial sums of ds per row (sm_90a: one per n-tile of I)
    int64_t num_ds_parts;
    // Portable path: [S, max(I, H)] f32, p [S, I] of the dH GEMM (read together with h by the row kernel that writes
    // s * a, so it cannot share act's buffer), later q [S, H] of the dX GEMM. sm_90a path: q [S, H] in the element type
    // over act (dW2, the only reader of s * a, runs before dX), p stays in registers.
    float* p_then_q;
    int* k_schedule;  // sm_90a path: the K-grouped kernel's tile schedule scratch (k_grouped_schedule_ints), else NULL

    // act_scratch: on the sm_90a path, the dw13 output when it can hold act (dw13_as_act_scratch), else NULL (carved).
    // dh_apart: dh gets its own buffer (the sm_90a dSwiGLU epilogue's interleaved dh cannot go over h).
    static BackwardWorkspace carve(WorkspaceCarver& carver, const RoutingPlan& plan, const Shape& shape, bool sm90,
                                   void* saved_h, void* act_scratch, bool dh_apart = false) {
        BackwardWorkspace workspace;
        const int64_t num_slots = shape.num_slots();
        workspace.routing = RoutingBuffers::carve(carver, plan);
        const int64_t max_cols = std::max(shape.intermediate, shape.hidden);
        workspace.h = saved_h != nullptr ? static_cast<uint16_t*>(saved_h)
                                         : carver.take<uint16_t>(num_slots * 2 * shape.intermediate);
        workspace.dh = dh_apart ? carver.take<uint16_t>(num_slots * 2 * shape.intermediate) : workspace.h;
        workspace.act = act_scratch != nullptr
                            ? static_cast<uint16_t*>(act_scratch)
                            : carver.take<uint16_t>(num_slots * (sm90 ? max_cols : shape.intermediate));
        workspace.num_ds_parts = sm90::dswiglu_sm90_num_ds_parts(shape.intermediate);
        workspace.ds_parts = carver.take<float>(num_slots * workspace.num_ds_parts);
        workspace.p_then_q = sm90 ? reinterpret_cast<float*>(workspace.act) : carver.take<float>(num_slots * max_cols);
        workspace.k_schedule = sm90 ? carver.take<int>(k_grouped_schedule_ints(shape.num_experts)) : nullptr;
        return workspace;
    }
};

// The up projection shared by forward and backward: rows of x gathered by sorted slot, times w13[e].
MGroupedGemmArgs up_gemm_args(megamoe_dtype_t dtype, const void* x, const void* w13, const RoutingPlan& plan,
                              const RoutingBuffers& routing, const Shape& shape) {
    MGroupedGemmArgs args{};
    args.dtype = dtype;
    args.a = x;
    args.lda = shape.hidden;
    args.a_gather_slots = routing.sorted_slot;  // NULL for grouped rows: row r of x is sorted row r
    args.num_a_rows = shape.num_tokens;
    args.topk = shape.topk;
    args.b = w13;
    args.b_expert_stride = 2 * shape.intermediate * shape.hidden;
    args.ldb = shape.hidden;
    args.n = shape.intermediate;
    args.k = shape.hidden;
    args.expert_offsets = routing.expert_offsets;
    args.m_tile_offsets = routing.m_tile_offsets;
    args.num_experts = shape.num_experts;
    args.max_m_tiles = plan.max_m_tiles;
    return args;
}

megamoe_status_t zero_if_wanted(const megamoe_tensor_t& tensor, size_t element_bytes, cudaStream_t stream,
                                const char* name) {
    const int64_t count = numel(tensor);
    if (tensor.data == nullptr || count == 0) return MEGAMOE_STATUS_SUCCESS;
    return check_cuda(cudaMemsetAsync(tensor.data, 0, static_cast<size_t>(count) * element_bytes, stream), name);
}

size_t output_element_bytes(megamoe_dtype_t dtype) {
    return dtype == MEGAMOE_DTYPE_F32 ? 4 : 2;
}

// What the forward needs to know of a device, read once per device.
struct DeviceInfo {
    int major = 0;
    int minor = 0;
    int num_sms = 0;
};

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

// The sm_90a K-grouped weight-gradient kernel is the default where the sm_90a backward runs (H200, 2026-11-30,
// qwen3-30b-a3b: dW13 2.31 vs 4.46 ms, dW2 0.97 vs 2.36 ms on the portable kernel); MEGAMOE_SM90_WEIGHT_GRADS=0
// keeps the portable kernel for them (tests compare both).
bool sm90_weight_grads_enabled_by_env() {
    const char* value = std::getenv("MEGAMOE_SM90_WEIGHT_GRADS");
    return value == nullptr || value[0] == '\0' || std::strcmp(value, "0") != 0;
}

bool sm90_disabled_by_env() {
    const char* value = std::getenv("MEGAMOE_DISABLE_SM90");
    return value != nullptr && value[0] != '\0' && std::strcmp(value, "0") != 0;
}

// The two GEMMs of the forward: up (x gathered by sorted slot, w13) and down (a, w2).
struct ForwardGemms {
    MGroupedGemmArgs up;
    MGroupedGemmArgs down;
    MGroupedGemmArgs sm90_up;  // the same in the weights' layout (cuda/sm90_args.h)
    MGroupedGemmArgs sm90_down;
    bool options_ok;  // the sm_90a kernels take the call's expert options

    static ForwardGemms make(const Call& call, const RoutingPlan& plan, const ForwardWorkspace& workspace) {
        const Shape& shape = call.shape;
        ForwardGemms gemms;
        gemms.up = up_gemm_args(call.dtype, call.x, call.w13, plan, workspace.routing, shape);
        gemms.down = gemms.up;
        gemms.down.a = workspace.act;
        gemms.down.lda = shape.intermediate;
        gemms.down.a_gather_slots = nullptr;
        gemms.down.num_a_rows = shape.num_slots();
        gemms.down.b = call.w2;
        gemms.down.b_expert_stride = shape.hidden * shape.intermediate;
        gemms.down.ldb = shape.intermediate;
        gemms.down.n = shape.hidden;
        gemms.down.k = shape.intermediate;
        gemms.sm90_up = sm90_up_args(call, gemms.up);
        gemms.sm90_down = sm90_w2_args(call, gemms.down);
        gemms.options_ok = sm90_options_ok(call);
        return gemms;
    }

    bool sm90_ok(int device_index) const { return options_ok && sm90_hardware_ok(device_index); }

    // The device, dtype and alignment suit the sm_90a kernels (the expert options aside).
    bool sm90_hardware_ok(int device_index) const {
        if (sm90_disabled_by_env()) return false;
        const DeviceInfo info = device_info(device_index);
        return info.major == 9 && info.minor == 0 && sm90::m_grouped_gemm_sm90_supported(sm90_up, true) &&
               sm90::m_grouped_gemm_sm90_supported(sm90_down, false);
    }
};

RoutingPlan make_routing_plan(const Call& call) {
    return RoutingPlan::make(call.shape, kGemmBlockM, call.rows_sorted);
}

megamoe_status_t forward_on_device(const ForwardCall& call) {
    const Shape& shape = call.shape;
    const cudaStream_t stream = call.stream;
    const RoutingPlan plan = make_routing_plan(call);
    WorkspaceCarver carver(call.workspace);
    const ForwardWorkspace workspace = ForwardWorkspace::carve(carver, plan, shape);
    const RoutingBuffers& routing = workspace.routing;

    MEGAMOE_CUDA_RETURN_IF_ERROR(launch_routing(call.experts, call.experts_dtype, plan, routing, stream));

    const ForwardGemms gemms = ForwardGemms::make(call, plan, workspace);
    if (gemms.sm90_ok(call.device_index)) {
        const int num_sms = device_info(call.device_index).num_sms;
        MEGAMOE_CUDA_RETURN_IF_ERROR(sm90::launch_m_grouped_gemm_sm90_swiglu(gemms.sm90_up, call.saved_h, workspace.act,
                                                                             num_sms, stream, sm90_gated_args(call)));
        MEGAMOE_CUDA_RETURN_IF_ERROR(
            sm90::launch_m_grouped_gemm_sm90_store(gemms.sm90_down, sm90_down_layout(call), workspace.out, shape.hidden,
                                                   shape.num_slots(), num_sms, stream, call.b2));
    } else {
        MEGAMOE_CUDA_RETURN_IF_ERROR(launch_up(call, gemms.up, call.saved_h, workspace.act, stream));
        MEGAMOE_CUDA_RETURN_IF_ERROR(launch_down(call, gemms.down, workspace.out, stream));
    }

    // Grouped rows: out_r = score_r o_r, 0 past the counts' sum. TODO(#12): without scores the down GEMM could store
    // straight into out (and the dX GEMM into d x_sorted below), zeroing only the padding rows.
    GatherSumArgs combine{};
    combine.out_dtype = call.dtype;
    combine.rows = workspace.out;
    combine.rows_dtype = call.dtype;
    combine.slot_to_row = routing.slot_to_row;
    combine.weights = call.weights;
    combine.weights_dtype = call.weights_dtype;
    combine.token_invalid = routing.token_invalid;
    combine.num_tokens = shape.num_tokens;
    combine.topk = shape.topk;
    combine.num_cols = shape.hidden;
    combine.out = call.y;
    return launch_gather_sum(combine, stream);
}

// The GEMMs of the backward: M-grouped up (recomputed, h = [g, u]), dH (dy gathered x w2[e] read [K = H, N = I])
// and dX (dh x w13[e] read [K = 2I, N = H]); K-grouped dW13 (dh, x gathered) and dW2 (dy gathered, s * a).
struct BackwardGemms {
    MGroupedGemmArgs up;
    MGroupedGemmArgs d_hidden;
    MGroupedGemmArgs d_input;
    KGroupedGemmArgs dw13;
    KGroupedGemmArgs dw2;
    MGroupedGemmArgs sm90_up;  // the M-grouped GEMMs in the weights' layout (cuda/sm90_args.h)
    MGroupedGemmArgs sm90_d_hidden;
    MGroupedGemmArgs sm90_d_input;
    KGroupedGemmArgs sm90_dw2;  // the K-grouped one, operands swapped for a transposed w2 (dW13: sm90_dw13_args)
    const void* dw2_out;        // NULL: not wanted
    bool options_ok;            // the sm_90a kernels take the call's expert options

    static BackwardGemms make(const BackwardCall& call, const RoutingPlan& plan, const BackwardWorkspace& workspace) {
        const Shape& shape = call.shape;
        BackwardGemms gemms;
        gemms.up = up_gemm_args(call.dtype, call.x, call.w13, plan, workspace.routing, shape);
        gemms.d_hidden = gemms.up;
        gemms.d_hidden.a = call.dy;
        gemms.d_hidden.b = call.w2;
        gemms.d_hidden.b_expert_stride = shape.hidden * shape.intermediate;
        gemms.d_hidden.ldb = shape.intermediate;
        gemms.d_hidden.n = shape.intermediate;
        gemms.d_hidden.k = shape.hidden;
        gemms.d_input = gemms.up;
        gemms.d_input.a = workspace.dh;
        gemms.d_input.lda = 2 * shape.intermediate;
        gemms.d_input.a_gather_slots = nullptr;
        gemms.d_input.num_a_rows = shape.num_slots();
        gemms.d_input.n = shape.hidden;
        gemms.d_input.k = 2 * shape.intermediate;

        KGroupedGemmArgs weight_grad{};
        weight_grad.dtype = call.dtype;
        weight_grad.topk = shape.topk;
        weight_grad.expert_offsets = workspace.routing.expert_offsets;
        weight_grad.num_experts = shape.num_experts;
        weight_grad.schedule = workspace.k_schedule;
        weight_grad.accumulate = call.accumulate_weight_grads;
        gemms.dw13 = weight_grad;
        gemms.dw13.a = workspace.dh;
        gemms.dw13.lda = 2 * shape.intermediate;
        gemms.dw13.b = call.x;
        gemms.dw13.ldb = shape.hidden;
        gemms.dw13.b_gather_slots = workspace.routing.sorted_slot;
        gemms.dw13.m = 2 * shape.intermediate;
        gemms.dw13.n = shape.hidden;
        gemms.dw2 = weight_grad;
        gemms.dw2.a = call.dy;
        gemms.dw2.lda = shape.hidden;
        gemms.dw2.a_gather_slots = workspace.routing.sorted_slot;
        gemms.dw2.b = workspace.act;
        gemms.dw2.ldb = shape.intermediate;
        gemms.dw2.m = shape.hidden;
        gemms.dw2.n = shape.intermediate;
        gemms.dw2_out = call.dw2.data;
        gemms.sm90_up = sm90_up_args(call, gemms.up);
        gemms.sm90_d_hidden = sm90_w2_args(call, gemms.d_hidden);
        gemms.sm90_d_input = sm90_d_input_args(call, gemms.d_input);
        gemms.sm90_dw2 = call.layout.w2_transposed ? swapped_operands(gemms.dw2) : gemms.dw2;
        gemms.options_ok = sm90_options_ok(call);
        return gemms;
    }

    bool sm90_ok(int device_index) const { return options_ok && sm90_hardware_ok(device_index); }

    // The device, dtype and alignment suit the sm_90a kernels (the expert options aside).
    bool sm90_hardware_ok(int device_index) const {
        if (sm90_disabled_by_env()) return false;
        const DeviceInfo info = device_info(device_index);
        return info.major == 9 && info.minor == 0 && sm90::m_grouped_gemm_sm90_supported(sm90_up, true) &&
               sm90::m_grouped_gemm_sm90_supported(sm90_d_hidden, false) &&
               sm90::m_grouped_gemm_sm90_supported(sm90_d_input, false);
    }

    // The weight gradients on the sm_90a K-grouped kernel: opted into, and the M-grouped GEMMs on sm_90a too.
    bool weight_grads_sm90_ok(const BackwardCall& call) const {
        return sm90_weight_grads_enabled_by_env() && sm90_ok(call.device_index) && sm90_dw13_ok(call, dw13) &&
               (dw2_out == nullptr || sm90::k_grouped_gemm_sm90_supported(sm90_dw2, dw2_out));
    }
};

// A weight gradient (K-grouped GEMM) on the sm_90a kernel (the portable one: layout_steps.h).
megamoe_status_t launch_weight_grad_sm90(const KGroupedGemmArgs& args, const megamoe_tensor_t& grad, int num_sms,
                                         cudaStream_t stream) {
    return sm90::launch_k_grouped_gemm_sm90(args, grad.data, grad.dtype, num_sms, stream);
}

// The sm_90a backward's act buffer (s * a [S, I], then q [S, H], element type) inside the dw13 output, when the call
// asks for dw13 without accumulation and it is large and aligned enough: dw13 is written only by the last GEMM, after
// dW2 (the reader of s * a) and dx's gather-sum (the reader of q), so it is free scratch until then, and the backward's
// activation memory loses its largest buffer but h (S x max(I, H) elements: 0.44 GiB at mixtral-8x7b). NULL otherwise.
void* dw13_as_act_scratch(const BackwardCall& call) {
    const Shape& shape = call.shape;
    if (call.dw13.data == nullptr || call.accumulate_weight_grads) return nullptr;
    const size_t needed = static_cast<size_t>(shape.num_slots()) *
                          static_cast<size_t>(std::max(shape.intermediate, shape.hidden)) * sizeof(uint16_t);
    const size_t available = static_cast<size_t>(numel(call.dw13)) * output_element_bytes(call.dw13.dtype);
    const bool aligned = reinterpret_cast<uintptr_t>(call.dw13.data) % kWorkspaceAlignment == 0;
    return available >= needed && aligned ? call.dw13.data : nullptr;
}

// The backward's workspace, GEMM arguments and kernel choices for one call. The path is chosen on the layout of the
// portable path (the larger one; every buffer starts 256-byte aligned in both layouts, and the choice depends only on
// alignment), then the workspace is laid out for it. The workspace size query runs the same function, and the call
// checks the workspace it gets against it again (an environment switch flipped in between gives WORKSPACE_TOO_SMALL,
// never an overrun).
struct BackwardPlan {
    RoutingPlan routing_plan;
    BackwardWorkspace workspace;
    BackwardGemms gemms;
    bool use_sm90;
    bool weight_grads_sm90;
    bool act_in_dw13;              // sm_90a: act is the dw13 output (dw13_as_act_scratch), not carved
    bool sm90_blocked_by_options;  // the sm_90a kernels would run the call but for its expert options
    size_t workspace_bytes;

    static BackwardPlan make(const BackwardCall& call) {
        const Shape& shape = call.shape;
        BackwardPlan plan;
        plan.routing_plan = make_routing_plan(call);
        WorkspaceCarver portable_carver(call.workspace);
        plan.workspace =
            BackwardWorkspace::carve(portable_carver, plan.routing_plan, shape, false, call.saved_h, nullptr);
        plan.gemms = BackwardGemms::make(call, plan.routing_plan, plan.workspace);
        plan.use_sm90 = shape.num_slots() > 0 && plan.gemms.sm90_ok(call.device_index);
        plan.weight_grads_sm90 = plan.use_sm90 && plan.gemms.weight_grads_sm90_ok(call);
        plan.sm90_blocked_by_options =
            shape.num_slots() > 0 && !sm90_options_ok(call) && plan.gemms.sm90_hardware_ok(call.device_index);
        plan.workspace_bytes = portable_carver.bytes_used();
        plan.act_in_dw13 = false;
        if (plan.use_sm90) {
            WorkspaceCarver carver(call.workspace);
            void* act_scratch = dw13_as_act_scratch(call);
            plan.act_in_dw13 = act_scratch != nullptr;
            const bool dh_apart = call.layout.gate_up == MEGAMOE_GATE_UP_INTERLEAVED;
            plan.workspace =
                BackwardWorkspace::carve(carver, plan.routing_plan, shape, true, call.saved_h, act_scratch, dh_apart);
            plan.gemms = BackwardGemms::make(call, plan.routing_plan, plan.workspace);
            plan.workspace_bytes = carver.bytes_used();
        }
        return plan;
    }
};

// Grouped rows whose counts the routing found invalid (counts_invalid set on the device): the weight gradients,
// computed from the clamped rows, become NaN. The whole layer has no such flag (bad ids only drop their slots).
megamoe_status_t poison_weight_grads_if_counts_invalid(const BackwardCall& call, const RoutingBuffers& routing) {
    if (routing.counts_invalid == nullptr) return MEGAMOE_STATUS_SUCCESS;
    for (const megamoe_tensor_t* grad : {&call.dw13, &call.dw3, &call.dw2, &call.db13, &call.db2}) {
        MEGAMOE_CUDA_RETURN_IF_ERROR(
            launch_fill_nan_if(routing.counts_invalid, grad->data, grad->dtype, numel(*grad), call.stream));
    }
    return MEGAMOE_STATUS_SUCCESS;
}

megamoe_status_t backward_on_device(const BackwardCall& call) {
    const Shape& shape = call.shape;
    const cudaStream_t stream = call.stream;
    const megamoe_dtype_t dtype = call.dtype;
    const int64_t num_slots = shape.num_slots(), hidden = shape.hidden, intermediate = shape.intermediate;
    const BackwardPlan backward_plan = BackwardPlan::make(call);
    const BackwardWorkspace& workspace = backward_plan.workspace;
    const RoutingBuffers& routing = workspace.routing;
    if (num_slots == 0) {  // no rows at all: every gradient is zero (or empty); accumulated ones stay as they are
        MEGAMOE_CUDA_RETURN_IF_ERROR(
            zero_if_wanted(call.dx, output_element_bytes(call.dx.dtype), stream, "cudaMemsetAsync(dx)"));
        if (!call.accumulate_weight_grads) {
            for (const megamoe_tensor_t* grad : {&call.dw13, &call.dw3, &call.dw2, &call.db13, &call.db2}) {
                MEGAMOE_CUDA_RETURN_IF_ERROR(
                    zero_if_wanted(*grad, output_element_bytes(grad->dtype), stream, "cudaMemsetAsync(weight grad)"));
            }
        }
        if (!call.rows_sorted) return MEGAMOE_STATUS_SUCCESS;  // the sort needs slots; grouped counts are still read
        MEGAMOE_CUDA_RETURN_IF_ERROR(
            launch_routing(call.experts, call.experts_dtype, backward_plan.routing_plan, routing, stream));
        return poison_weight_grads_if_counts_invalid(call, routing);
    }
    const BackwardGemms& gemms = backward_plan.gemms;
    const bool use_sm90 = backward_plan.use_sm90;
    const bool weight_grads_sm90 = backward_plan.weight_grads_sm90;

    MEGAMOE_CUDA_RETURN_IF_ERROR(
        launch_routing(call.experts, call.experts_dtype, backward_plan.routing_plan, routing, stream));

    const int num_sms = use_sm90 ? device_info(call.device_index).num_sms : 0;
    // h = [g, u] by sorted row in workspace.h: kept by the forward (saved_h), or recomputed here; dh goes over it.
    const bool keep_h = call.saved_h != nullptr;
    const void* h = workspace.h;
    if (!keep_h && use_sm90) {
        MEGAMOE_CUDA_RETURN_IF_ERROR(sm90::launch_m_grouped_gemm_sm90_swiglu(gemms.sm90_up, workspace.h, nullptr,
                                                                             num_sms, stream, sm90_gated_args(call)));
    } else if (!keep_h) {
        MEGAMOE_CUDA_RETURN_IF_ERROR(launch_up(call, gemms.up, workspace.h, nullptr, stream));
    }

    int64_t num_ds_parts = 1;
    if (use_sm90) {  // p = dy gathered x w2[e] stays in registers: dh, s * a and ds parts from the epilogue
        sm90::DSwiGLUEpilogueArgs epilogue{};
        epilogue.h = h;
        epilogue.dh = workspace.dh;
        epilogue.act = workspace.act;
        epilogue.ds_parts = workspace.ds_parts;
        epilogue.weights = call.weights;
        epilogue.weights_dtype = call.weights_dtype;
        epilogue.activation = call.activation;
        epilogue.dh_interleaved = call.layout.gate_up == MEGAMOE_GATE_UP_INTERLEAVED;
        epilogue.b_layout = sm90_d_hidden_layout(call);
        MEGAMOE_CUDA_RETURN_IF_ERROR(
            sm90::launch_m_grouped_gemm_sm90_dswiglu(gemms.sm90_d_hidden, epilogue, num_sms, stream));
        num_ds_parts = workspace.num_ds_parts;
        if (call.b2 != nullptr && call.dweights.data != nullptr) {  // ds's bias term <dy, b2[e]>, on the first part
            BiasDotArgs bias_dot{};
            bias_dot.dtype = dtype;
            bias_dot.dy = call.dy;
            bias_dot.b2 = call.b2;
            bias_dot.sorted_slot = routing.sorted_slot;
            bias_dot.expert_offsets = routing.expert_offsets;
            bias_dot.num_experts = shape.num_experts;
            bias_dot.topk = shape.topk;
            bias_dot.hidden = hidden;
            bias_dot.ds_parts = workspace.ds_parts;
            bias_dot.num_ds_parts = num_ds_parts;
            bias_dot.max_rows = num_slots;
            MEGAMOE_CUDA_RETURN_IF_ERROR(launch_bias_dot_rows(bias_dot, stream));
        }
    } else {
        MEGAMOE_CUDA_RETURN_IF_ERROR(launch_d_hidden(call, gemms.d_hidden, workspace.p_then_q, stream));
        DSwiGLUArgs dswiglu{};
        dswiglu.dtype = dtype;
        dswiglu.h = h;
        dswiglu.dh = workspace.h;
        dswiglu.p = workspace.p_then_q;
        dswiglu.act = workspace.act;
        dswiglu.ds_rows = workspace.ds_parts;
        dswiglu.sorted_slot = routing.sorted_slot;
        dswiglu.expert_offsets = routing.expert_offsets;
        dswiglu.num_experts = shape.num_experts;
        dswiglu.weights = call.weights;
        dswiglu.weights_dtype = call.weights_dtype;
        dswiglu.intermediate = intermediate;
        dswiglu.max_rows = num_slots;
        MEGAMOE_CUDA_RETURN_IF_ERROR(launch_d_act(call, dswiglu, stream));
    }

    if (call.dweights.data != nullptr) {
        FinalizeDTopkArgs finalize{};
        finalize.ds_parts = workspace.ds_parts;
        finalize.num_ds_parts = num_ds_parts;
        finalize.slot_to_row = routing.slot_to_row;
        finalize.token_invalid = routing.token_invalid;
        finalize.num_slots = num_slots;
        finalize.topk = shape.topk;
        finalize.dtopk_weights = call.dweights.data;
        finalize.dtopk_dtype = call.dweights.dtype;
        MEGAMOE_CUDA_RETURN_IF_ERROR(launch_finalize_dtopk(finalize, stream));
    }

    // dW2 first: on the sm_90a path q is written over s * a, which only dW2 reads.
    if (call.dw2.data != nullptr) {  // dW2[e] = sum dy (s a)^T
        MEGAMOE_CUDA_RETURN_IF_ERROR(weight_grads_sm90
                                         ? launch_weight_grad_sm90(gemms.sm90_dw2, call.dw2, num_sms, stream)
                                         : launch_dw2(call, gemms.dw2, stream));
    }

    if (call.dx.data != nullptr) {
        // q = dh x w13[e]; then dx_t = sum_j q[row of (t, j)].
        if (use_sm90) {
            MEGAMOE_CUDA_RETURN_IF_ERROR(sm90::launch_m_grouped_gemm_sm90_store(
                gemms.sm90_d_input, sm90_d_input_layout(call), workspace.p_then_q, hidden, num_slots, num_sms, stream));
        } else {
            MEGAMOE_CUDA_RETURN_IF_ERROR(launch_d_input(call, gemms.d_input, workspace.p_then_q, stream));
        }
        GatherSumArgs gather{};
        gather.out_dtype = dtype;
        gather.rows = workspace.p_then_q;
        gather.rows_dtype = use_sm90 ? dtype : MEGAMOE_DTYPE_F32;
        gather.slot_to_row = routing.slot_to_row;
        gather.weights = nullptr;
        gather.token_invalid = routing.token_invalid;
        gather.num_tokens = shape.num_tokens;
        gather.topk = shape.topk;
        gather.num_cols = hidden;
        gather.out = call.dx.data;
        MEGAMOE_CUDA_RETURN_IF_ERROR(launch_gather_sum(gather, stream));
    }

    if (call.dw13.data != nullptr || call.dw3.data != nullptr) {  // dW13[e] = sum dh x^T
        MEGAMOE_CUDA_RETURN_IF_ERROR(weight_grads_sm90 ? launch_sm90_dw13(call, gemms.dw13, num_sms, stream)
                                                       : launch_dw13(call, gemms.dw13, stream));
    }
    MEGAMOE_CUDA_RETURN_IF_ERROR(launch_bias_grads(call, routing, workspace.dh, stream));
    return poison_weight_grads_if_counts_invalid(call, routing);
}

size_t forward_workspace_bytes(const ForwardCall& call) {
    WorkspaceCarver carver(nullptr);
    ForwardWorkspace::carve(carver, make_routing_plan(call), call.shape);
    return carver.bytes_used();
}

megamoe_status_t run_forward(const ForwardCall& call) {
    const DeviceGuard guard(call.device_index);
    MEGAMOE_CUDA_RETURN_IF_ERROR(guard.status());
    if (call.shape.num_slots() == 0) {  // no slots: y is all zeros (or empty)
        const int64_t num_elements = call.shape.num_tokens * call.shape.hidden;
        if (num_elements == 0) return MEGAMOE_STATUS_SUCCESS;
        const size_t num_bytes = static_cast<size_t>(num_elements) * sizeof(uint16_t);  // y is bf16 or f16
        return check_cuda(cudaMemsetAsync(call.y, 0, num_bytes, call.stream), "cudaMemsetAsync(y)");
    }
    return forward_on_device(call);
}

ForwardGemms forward_gemms(const ForwardCall& call) {
    const RoutingPlan plan = make_routing_plan(call);
    WorkspaceCarver carver(call.workspace);
    const ForwardWorkspace workspace = ForwardWorkspace::carve(carver, plan, call.shape);
    return ForwardGemms::make(call, plan, workspace);
}

bool forward_sm90(const ForwardCall& call) {
    return call.shape.num_slots() > 0 && forward_gemms(call).sm90_ok(call.device_index);
}

// Why a call whose device and shapes suit the sm_90a kernels runs the portable ones: its expert parameters' alignment.
std::string blocked_reason(const Call& call) {
    const char* blocker = sm90_options_blocker(call);
    return std::string(blocker != nullptr ? blocker : "the expert options") +
           "; this call runs the portable CUDA kernels";
}

megamoe_path_t forward_path(const ForwardCall& call, std::string* reason) {
    reason->clear();
    if (forward_sm90(call)) return MEGAMOE_PATH_SM90;
    if (call.shape.num_slots() > 0 && !sm90_options_ok(call) &&
        forward_gemms(call).sm90_hardware_ok(call.device_index)) {
        *reason = blocked_reason(call);
    }
    return MEGAMOE_PATH_CUDA_PORTABLE;
}

megamoe_path_t backward_path(const BackwardCall& call, std::string* reason) {
    const BackwardPlan plan = BackwardPlan::make(call);
    reason->clear();
    if (plan.sm90_blocked_by_options) *reason = blocked_reason(call);
    if (!plan.use_sm90) return MEGAMOE_PATH_CUDA_PORTABLE;
    return plan.weight_grads_sm90 ? MEGAMOE_PATH_SM90 : MEGAMOE_PATH_SM90_PORTABLE_WEIGHT_GRADS;
}

megamoe_status_t run_backward(const BackwardCall& call) {
    const DeviceGuard guard(call.device_index);
    MEGAMOE_CUDA_RETURN_IF_ERROR(guard.status());
    return backward_on_device(call);
}

}  // namespace

size_t workspace_size(const megamoe_forward_params_t& params, const Shape& shape) {
    return forward_workspace_bytes(forward_call(params, shape));
}
size_t workspace_size(const megamoe_grouped_forward_params_t& params, const Shape& shape) {
    return forward_workspace_bytes(forward_call(params, shape));
}
megamoe_status_t run(const megamoe_forward_params_t& params, const Shape& shape) {
    return run_forward(forward_call(params, shape));
}
megamoe_status_t run(const megamoe_grouped_forward_params_t& params, const Shape& shape) {
    return run_forward(forward_call(params, shape));
}
bool forward_uses_sm90(const megamoe_forward_params_t& params, const Shape& shape) {
    return forward_sm90(forward_call(params, shape));
}
bool forward_uses_sm90(const megamoe_grouped_forward_params_t& params, const Shape& shape) {
    return forward_sm90(forward_call(params, shape));
}

size_t workspace_size(const megamoe_backward_params_t& params, const Shape& shape) {
    return BackwardPlan::make(backward_call(params, shape)).workspace_bytes;
}
size_t workspace_size(const megamoe_grouped_backward_params_t& params, const Shape& shape) {
    return BackwardPlan::make(backward_call(params, shape)).workspace_bytes;
}
megamoe_status_t run(const megamoe_backward_params_t& params, const Shape& shape) {
    return run_backward(backward_call(params, shape));
}
megamoe_status_t run(const megamoe_grouped_backward_params_t& params, const Shape& shape) {
    return run_backward(backward_call(params, shape));
}
bool backward_uses_sm90(const megamoe_backward_params_t& params, const Shape& shape) {
    return BackwardPlan::make(backward_call(params, shape)).use_sm90;
}
bool backward_uses_sm90(const megamoe_grouped_backward_params_t& params, const Shape& shape) {
    return BackwardPlan::make(backward_call(params, shape)).use_sm90;
}
bool backward_weight_grads_use_sm90(const megamoe_backward_params_t& params, const Shape& shape) {
    return BackwardPlan::make(backward_call(params, shape)).weight_grads_sm90;
}
bool backward_weight_grads_use_sm90(const megamoe_grouped_backward_params_t& params, const Shape& shape) {
    return BackwardPlan::make(backward_call(params, shape)).weight_grads_sm90;
}
bool backward_act_in_dw13(const megamoe_backward_params_t& params, const Shape& shape) {
    return BackwardPlan::make(backward_call(params, shape)).act_in_dw13;
}

megamoe_path_t path(const megamoe_forward_params_t& params, const Shape& shape, std::string* reason) {
    return forward_path(forward_call(params, shape), reason);
}
megamoe_path_t path(const megamoe_grouped_forward_params_t& params, const Shape& shape, std::string* reason) {
    return forward_path(forward_call(params, shape), reason);
}
megamoe_path_t path(const megamoe_backward_params_t& params, const Shape& shape, std::string* reason) {
    return backward_path(backward_call(params, shape), reason);
}
megamoe_path_t path(const megamoe_grouped_backward_params_t& params, const Shape& shape, std::string* reason) {
    return backward_path(backward_call(params, shape), reason);
}

}  // namespace megamoe::cuda
