// The plan of one CUDA call (plan.cu): its routing plan, the backend that runs it (portable, sm90 or sm90-FP8; chosen
// on the host from the device, dtypes, shapes, pointers and MEGAMOE_DISABLE_SM90, never from tensor data) and its
// workspace, carved out of the caller's (256-byte aligned buffers, in a fixed order). The workspace size query runs the
// same planning code as the call, so the two agree; the carve order and sizes below are that answer.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common.h"
#include "device/cuda_utils.h"
#include "path/call.h"
#include "portable/routing.h"

namespace megamoe::cuda {

// The kernel set that runs a call's M-grouped GEMMs (steps.h: Backend).
enum class BackendKind {
    kPortable,  // portable/ (any sm_80+ GPU)
    kSm90,      // the fused sm_90a kernels
    kSm90Fp8,   // the fused sm_90a kernels with blockwise FP8 operands (precision FP8_BLOCKWISE)
};

// Rows quantized in 1 x 128 groups along their columns: q [rows, cols] e4m3, scales [rows, cols / 128] f32.
struct Fp8Rows {
    uint8_t* q = nullptr;
    float* scales = nullptr;
    int64_t cols = 0;

    static Fp8Rows carve(WorkspaceCarver& carver, int64_t rows, int64_t cols);
};

// The forward's buffers, in carve order: routing, a, o; FP8: x and a quantized.
struct ForwardWorkspace {
    RoutingBuffers routing;
    uint16_t* act;    // [S, I] element type (FP8: NULL, a goes out quantized)
    uint16_t* out;    // [S, H] element type: o, the combine's rows
    Fp8Rows x_fp8;    // FP8: x [rows of x, H] quantized along H
    Fp8Rows act_fp8;  // FP8: a [S, I] quantized along I by the up GEMM's epilogue

    static ForwardWorkspace carve(WorkspaceCarver& carver, const RoutingPlan& plan, const Call& call);
};

// The backward's buffers, in carve order: routing, h (recompute mode), dh (sm_90a with interleaved dh), act, the ds
// partial sums, p / q in f32 (portable), the K-grouped schedule (sm_90a); FP8: dy and dh quantized (in the workspace or
// in the dw13 output), then x quantized (recompute mode), then the transposed weights the caller left absent.
struct BackwardWorkspace {
    RoutingBuffers routing;
    uint16_t* h;      // [S, 2I] element type: [g, u], then [dg, du]; keep-h mode: saved_h itself (not carved)
    uint16_t* dh;     // [S, 2I]: h itself, but on the sm_90a path with interleaved dh its own buffer
    uint16_t* act;    // [S, I] element type: s * a (sm_90a path: [S, max(I, H)], later q [S, H] over it)
    float* ds_parts;  // [S, up to num_ds_parts]: partial sums of ds per row (sm_90a: one per n-tile of I, the dH
                      // launch says how many)
    int64_t num_ds_parts;
    // Portable path: [S, max(I, H)] f32, p [S, I] of the dH GEMM (read together with h by the row kernel that writes
    // s * a, so it cannot share act's buffer), later q [S, H] of the dX GEMM; NULL on the sm_90a path (p stays in
    // registers).
    float* p_then_q_f32;
    // sm_90a path: q [S, H] of the dX GEMM in the element type, over act (dW2, the only reader of s * a, runs before
    // dX); NULL on the portable path.
    uint16_t* q_elem;
    int* k_schedule;  // sm_90a path: the K-grouped kernel's tile schedule scratch (k_grouped_schedule_ints), else NULL
    // FP8_BLOCKWISE: dy [rows of dy, H] along H (dH's A), dh [S, 2I] along 2I (dX's A), x [rows of x, H] along H when h
    // is recomputed (the up GEMM's A); else empty.
    Fp8Rows dy_fp8;
    Fp8Rows dh_fp8;
    Fp8Rows x_fp8;
    // FP8_BLOCKWISE with fp8.w2_t absent, or fp8.w13_t absent and dx wanted: one e4m3 buffer, sized for the larger of
    // the two it holds, that the dH step fills with w2_t [E, I, H] (fp8.w2 transposed) before its GEMM and the dX step
    // then with w13_t [E, H, 2I] (fp8.w13 transposed); NULL when the caller gives both (fp8_transposes_w2 / _w13).
    uint8_t* fp8_weight_t = nullptr;

    // sm90_layout: the layout of the sm_90a backends (act [S, max(I, H)] holding q later, the K-grouped schedule; no
    // f32 p / q). act_scratch: there, the dw13 output when it can hold act, else NULL (carved). dh_apart: dh gets its
    // own buffer (the sm_90a dSwiGLU epilogue's interleaved dh cannot go over h).
    static BackwardWorkspace carve(WorkspaceCarver& carver, const RoutingPlan& plan, const Shape& shape,
                                   bool sm90_layout, void* saved_h, void* act_scratch, bool dh_apart = false);
    // dy and dh quantized for dH and dX (the workspace's carver, or the dw13 output's).
    void carve_fp8_operands(WorkspaceCarver& carver, const BackwardCall& call);
    // The other FP8 buffers of an FP8_BLOCKWISE call, after the rest.
    void carve_fp8(WorkspaceCarver& carver, const BackwardCall& call);
};

// Whether an FP8_BLOCKWISE backward makes its transposed weights itself (megamoe.h's megamoe_fp8_experts_t): w2_t for
// dH when fp8.w2_t is absent, w13_t for dX when dx is wanted and fp8.w13_t is absent.
bool fp8_transposes_w2(const BackwardCall& call);
bool fp8_transposes_w13(const BackwardCall& call);

// The forward's plan. The forward's workspace is the same on every backend (both kernel sets write the same buffers).
struct ForwardPlan {
    RoutingPlan routing_plan;
    ForwardWorkspace workspace;  // carved out of call.workspace
    BackendKind backend;         // FP8_BLOCKWISE: kSm90Fp8; else kSm90 when the call has slots and the sm_90a kernels
                                 // take it, kPortable otherwise

    static ForwardPlan make(const ForwardCall& call);
};

// The forward's workspace size (a carve that decides nothing).
size_t forward_workspace_bytes(const ForwardCall& call);

// Whether the sm_90a kernels would run the forward but for its expert options (the path query's reason).
bool forward_sm90_blocked_by_options(const ForwardCall& call, const ForwardPlan& plan);

// The backward's plan. The backend is chosen on the workspace layout of the portable backend (the larger one; every
// buffer starts 256-byte aligned in both layouts, and the choice depends only on alignment), then the workspace is laid
// out for it. The workspace size query runs the same function, and the call checks the workspace it gets against it
// again (a test override changed in between gives WORKSPACE_TOO_SMALL, never an overrun).
struct BackwardPlan {
    RoutingPlan routing_plan;
    BackwardWorkspace workspace;
    BackendKind backend;     // kPortable unless the call has slots and FP8_BLOCKWISE or the sm_90a kernels take it
    bool weight_grads_sm90;  // dW13 / dW2 on the sm_90a K-grouped kernel (else the portable one)
    bool act_in_dw13;        // sm_90a: act is the dw13 output, not carved
    bool sm90_blocked_by_options;  // the sm_90a kernels would run the call but for its expert options
    size_t workspace_bytes;

    static BackwardPlan make(const BackwardCall& call);
};

}  // namespace megamoe::cuda
