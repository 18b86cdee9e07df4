/*
 * megamoe — C API of the routed-expert MLP (DESIGN.md section 1), forward and backward.
 *
 * The library is torch-free and never allocates device memory: the caller passes every output and
 * a workspace whose size the library reports. CPU tensors run the reference implementation; CUDA
 * tensors run on the caller's stream with no host synchronisation (a CUDA graph can capture it).
 *
 * Every entry point returns a status; on failure megamoe_last_error() gives a thread-local message
 * that names the offending argument (e.g. "w13: expected shape [E=8, 2*I=128, H=64], got [8, 64, 64]").
 *
 *   Names: T tokens, H hidden, I expert intermediate, E experts, topk routed experts per token.
 *   x            [T, H]        bf16 / f16 / f32 / f64 (CUDA: bf16 or f16)
 *   topk_ids     [T, topk]     int32 or int64, each in [0, E) or -1 (slot dropped)
 *   topk_weights [T, topk]     f32 or the dtype of x
 *   w13          [E, 2I, H]    dtype of x; rows [0, I) gate, rows [I, 2I) up (the default layout; see below)
 *   w2           [E, H, I]     dtype of x
 *   y            [T, H]        dtype of x
 *   saved_h      [T*topk, 2I]  dtype of x; h = [g, u] = W13[e] x_t per slot, by sorted row: the slots (t, j) with
 *                              e >= 0 sorted stably by expert (ties in slot order t * topk + j), the rows of dropped
 *                              slots at the end untouched (optional). The backward consumes it: afterwards its
 *                              contents are unspecified (the CUDA path writes [dg, du] over it).
 *
 * Grouped rows (megamoe_grouped_*): rows already sorted by expert, as an expert-parallel dispatcher hands them over.
 *   x_sorted          [R, H]   rows of expert 0, then of expert 1, ...; rows past sum(tokens_per_expert) are padding
 *   tokens_per_expert [E]      int32 or int64, rows per expert, on the device of x_sorted (read there: no host sync)
 *   scores            [R]      optional, f32 or the dtype of x_sorted: out_r is scaled by scores[r] (absent: 1)
 *   out               [R, H]   out_r = scores[r] W2[e] (silu(W13[e,:I] x_r) * W13[e,I:] x_r), 0 for padding rows
 *   saved_h           [R, 2I]  optional, h of row r in row r (padding rows untouched)
 *   Counts that are negative or sum past R are INVALID_ARGUMENT on the CPU; CUDA cannot report them without a host
 *   sync, so it never reads or writes out of bounds for them and makes every output of the call NaN.
 *
 * Memory modes of training: the forward may write saved_h (keep h: the backward then skips recomputing the up
 * projection, the fastest mode) or not (recompute: the backward recomputes h from x; only the inputs need to be
 * kept between forward and backward). On CUDA both modes give the same gradients (h comes from the same kernel and is
 * rounded to the dtype of x either way); the CPU reference reads a given saved_h as is, else recomputes h unrounded.
 * A saved_h serves one backward: a second backward of the same forward needs it written again (or recompute mode).
 *
 * Layouts, activations and biases (every params struct; all zero = the default: concatenated, untransposed, SwiGLU,
 * no biases). The weights are read where they are, in the layout `layout` describes, and their gradients are written
 * in that same layout (dw13 shaped as w13, dw3 as w3):
 *   layout.gate_up        MEGAMOE_GATE_UP_CONCATENATED  w13 [E, 2I, H]: rows [0, I) gate, [I, 2I) up (HF gate_up_proj)
 *                         MEGAMOE_GATE_UP_INTERLEAVED   w13 [E, 2I, H]: row 2i gate i, row 2i + 1 up i (gpt-oss,
 *                                                       SonicMoE, torchtitan's fused w13)
 *                         MEGAMOE_GATE_UP_SEPARATE      w13 [E, I, H] the gate alone (torchtitan / prime-rl w1) and
 *                                                       w3 [E, I, H] the up projection
 *   layout.w13_transposed 1: w13 (and w3) stored with the last two dimensions swapped: [E, H, 2I] ([E, H, I])
 *   layout.w2_transposed  1: w2 stored [E, I, H] (HF is_transposed; gpt-oss down_proj)
 *   b13  [E, 2I]  optional bias of the up projection, dtype of x, gate/up arranged as w13's rows (interleaved: g0, u0,
 *                 g1, ...; concatenated and separate: the I gate entries, then the I up entries)
 *   b2   [E, H]   optional bias of the down projection, dtype of x
 *   activation    MEGAMOE_ACTIVATION_SWIGLU: a = silu(g) * u (limit and alpha must be 0);
 *                 MEGAMOE_ACTIVATION_CLAMPED_SWIGLU (gpt-oss): g' = min(g, limit), u' = clamp(u, -limit, limit),
 *                 a = g' sigmoid(alpha g') (u' + 1), limit > 0 (gpt-oss: 7), alpha > 0 (gpt-oss: 1.702); the gradient
 *                 is zero where a clamp is active (g >= limit, |u| >= limit: the minimum-norm subgradient)
 * With them, per routed slot: h = [g, u] = W13[e] x + b13[e], a = act(g, u), o = W2[e] a + b2[e], y = sum_j s o;
 * saved_h holds h (bias included) as [g, u] (the I gate columns, then the I up columns) whatever the layout. CUDA runs
 * every option, on the fused sm_90a kernels too (a Hopper GPU; w3 16-byte aligned as w13, b13 / b2 4-byte aligned,
 * else the portable CUDA kernels of the same device); megamoe_*_path() tell which path a call would take and
 * megamoe_path_reason() names what kept it off the sm_90a kernels.
 *
 * Weight gradients accumulated in place (both backwards, accumulate_weight_grads = 1; Megatron's fp32 main_grad,
 * FSDP2's fp32 reduce): every present one of dw13, dw3, dw2, db13, db2 must be f32 and already hold values; the
 * backward adds its gradient into it, out = out + grad (the gradient in f32, one f32 addition per element), in the
 * kernel's epilogue, not by an extra pass. Each element is added by one thread once, so the same inputs and the same
 * initial buffer give bitwise the same result. Experts with no rows (and a call with no rows at all) leave their part
 * of the buffer untouched. The CPU reference rounds its gradient to f32 first, then adds. Grouped rows' invalid counts
 * on CUDA still make every weight gradient NaN (the buffer included).
 */
#ifndef MEGAMOE_MEGAMOE_H_
#define MEGAMOE_MEGAMOE_H_

#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32)
#define MEGAMOE_API __declspec(dllexport)
#else
#define MEGAMOE_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

#define MEGAMOE_VERSION_MAJOR 0
#define MEGAMOE_VERSION_MINOR 6
#define MEGAMOE_VERSION_PATCH 0
#define MEGAMOE_MAX_DIMS 4
/* Raised whenever a public struct's layout or a function's signature changes; megamoe_abi_version() returns the
 * value the library was built with, so a binding can refuse a library that does not match its own declarations. */
#define MEGAMOE_ABI_VERSION 5

typedef enum {
    MEGAMOE_STATUS_SUCCESS = 0,
    MEGAMOE_STATUS_INVALID_ARGUMENT = 1,  // a tensor or option is wrong; the message names it
    MEGAMOE_STATUS_NOT_SUPPORTED = 2,     // valid input this build / device cannot run (e.g. f32 on CUDA)
    MEGAMOE_STATUS_WORKSPACE_TOO_SMALL = 3,
    MEGAMOE_STATUS_CUDA_ERROR = 4,  // a CUDA or cuBLAS call failed; the message has its text
    MEGAMOE_STATUS_INTERNAL_ERROR = 5,
} megamoe_status_t;

typedef enum {
    MEGAMOE_DTYPE_BF16 = 0,
    MEGAMOE_DTYPE_F16 = 1,
    MEGAMOE_DTYPE_F32 = 2,
    MEGAMOE_DTYPE_F64 = 3,
    MEGAMOE_DTYPE_I32 = 4,
    MEGAMOE_DTYPE_I64 = 5,
    MEGAMOE_DTYPE_E4M3 = 6,  // float8_e4m3fn, 1 byte: the FP8 expert weights (megamoe_fp8_experts_t) only
} megamoe_dtype_t;

typedef enum {
    MEGAMOE_DEVICE_CPU = 0,
    MEGAMOE_DEVICE_CUDA = 1,
} megamoe_device_type_t;

typedef enum {
    MEGAMOE_ACCUM_DEFAULT = 0,  // CPU: f64; CUDA: f32
    MEGAMOE_ACCUM_F32 = 1,      // f32 accumulation (CPU and CUDA)
    MEGAMOE_ACCUM_F64 = 2,      // f64 accumulation (CPU only)
} megamoe_accum_t;

/* How the gate and up projections of each expert are arranged in w13 (see the top of this file). */
typedef enum {
    MEGAMOE_GATE_UP_CONCATENATED = 0,  // w13 [E, 2I, H]: gate rows, then up rows
    MEGAMOE_GATE_UP_INTERLEAVED = 1,   // w13 [E, 2I, H]: gate row i at 2i, up row i at 2i + 1
    MEGAMOE_GATE_UP_SEPARATE = 2,      // w13 [E, I, H] gate, w3 [E, I, H] up
} megamoe_gate_up_t;

/* The storage of the expert weights. All zero: w13 [E, 2I, H] concatenated, w2 [E, H, I]. */
typedef struct {
    megamoe_gate_up_t gate_up;  // arrangement of the gate and up rows
    int32_t w13_transposed;     // 0 or 1: w13 (and w3) stored [E, H, 2I] ([E, H, I])
    int32_t w2_transposed;      // 0 or 1: w2 stored [E, I, H]
} megamoe_layout_t;

typedef enum {
    MEGAMOE_ACTIVATION_SWIGLU = 0,          // silu(g) * u
    MEGAMOE_ACTIVATION_CLAMPED_SWIGLU = 1,  // min(g, limit) sigmoid(alpha min(g, limit)) (clamp(u, +-limit) + 1)
} megamoe_activation_kind_t;

/* The activation between the projections. All zero: SwiGLU. */
typedef struct {
    megamoe_activation_kind_t kind;
    double limit;  // CLAMPED_SWIGLU: the clamp, > 0 and finite (gpt-oss: 7); SWIGLU: 0
    double alpha;  // CLAMPED_SWIGLU: the sigmoid's slope, > 0 and finite (gpt-oss: 1.702); SWIGLU: 0
} megamoe_activation_t;

/* Which implementation a call runs (megamoe_*_path). */
typedef enum {
    MEGAMOE_PATH_REFERENCE = 0,                   // the CPU reference (CPU tensors)
    MEGAMOE_PATH_CUDA_PORTABLE = 1,               // the portable CUDA kernels (any sm_80+ GPU)
    MEGAMOE_PATH_SM90 = 2,                        // the fused sm_90a kernels (backward: the weight gradients too)
    MEGAMOE_PATH_SM90_PORTABLE_WEIGHT_GRADS = 3,  // backward: sm_90a up / dH / dX, portable dW13 / dW2
    MEGAMOE_PATH_SM90_FP8 = 4,                    // precision FP8_BLOCKWISE on the sm_90a kernels (see below)
} megamoe_path_t;

/* A strided view of memory. An absent optional tensor has data == NULL and ndim == 0. */
typedef struct {
    void* data;                         // first element; may be NULL only when numel == 0 or the tensor is optional
    megamoe_dtype_t dtype;              // element type
    int32_t ndim;                       // number of dimensions, 0..MEGAMOE_MAX_DIMS
    int64_t shape[MEGAMOE_MAX_DIMS];    // extent of each dimension
    int64_t strides[MEGAMOE_MAX_DIMS];  // stride of each dimension, in elements
    megamoe_device_type_t device_type;  // where data lives
    int32_t device_index;               // CUDA ordinal (ignored for CPU)
} megamoe_tensor_t;

/* The precision of the expert GEMMs.
 *   DEFAULT         operands in the dtype of x, f32 accumulation.
 *   FP8_BLOCKWISE   DeepSeek-V3's blockwise FP8 (DESIGN.md section 7): the up, down, dH and dX GEMMs read e4m3
 *                   operands with f32 scales, the activations' per 1 x 128 group along the GEMM's K (quantized by the
 *                   library: x and dy by one pass each, a in the up GEMM's epilogue, dh by a pass), the weights' per
 *                   128 x 128 block (params.fp8, made once per optimizer step by megamoe_quantize_experts); each
 *                   group's partial product scaled in f32. The combine, routing, d topk_weights and outputs stay as
 *                   in DEFAULT (y, dx in the dtype of x); the weight gradients are computed from the 16-bit operands
 *                   (dh, x, dy, s * a) as in DEFAULT, in the layout's arrangement. CUDA on a compute capability 9.0
 *                   GPU only, SwiGLU, no biases, H and I multiples of 128, the concatenated or separate layout
 *                   (transposed or not: params.fp8 is always in the default layout, w13 [E, 2I, H] gate rows then up
 *                   rows and w2 [E, H, I]; the 16-bit weights give the shapes); anything else (the interleaved
 *                   layout) is NOT_SUPPORTED with a message naming it (never a silent bf16 run). The path:
 *                   MEGAMOE_PATH_SM90_FP8. */
typedef enum {
    MEGAMOE_PRECISION_DEFAULT = 0,
    MEGAMOE_PRECISION_FP8_BLOCKWISE = 1,
} megamoe_precision_t;

/* The expert weights in blockwise FP8 and their transposed copies (the data gradients' GEMMs read both operands
 * K-major), e4m3 contiguous, one f32 scale per 128 x 128 block (a square block's transpose keeps its scale, so the
 * copies share the scales). megamoe_quantize_experts writes w13, w2, the scales and the transposed copies it is given.
 * What each call reads: the forward w13, w13_scales, w2, w2_scales; the backward w2_t and w2_scales, w13_t (when dx is
 * wanted), w13 (when saved_h is absent: h recomputed) and w13_scales with either. Absent in DEFAULT precision; in
 * FP8_BLOCKWISE the ones a call does not read may be absent (a given one is still checked). The transposed copies
 * may be absent from a backward that reads them (one byte per weight element held between calls instead of two): the
 * backward then needs w2 (for w2_t) and w13 (for w13_t, when dx is wanted) and transposes them, bytes only, into its
 * workspace before the GEMM that reads each (one buffer, w2_t then w13_t: E * 2I * H bytes where w13_t is made, else
 * E * I * H, counted by megamoe_backward_workspace_size only where a copy is made), the same bytes as the given
 * copies: the same gradients, bit for bit. The scales' extents round up (ceil(n / 128)). */
typedef struct {
    megamoe_tensor_t w13;         // [E, 2I, H] e4m3
    megamoe_tensor_t w13_t;       // [E, H, 2I] e4m3, the transpose of w13
    megamoe_tensor_t w13_scales;  // [E, 2I / 128, H / 128] f32
    megamoe_tensor_t w2;          // [E, H, I] e4m3
    megamoe_tensor_t w2_t;        // [E, I, H] e4m3, the transpose of w2
    megamoe_tensor_t w2_scales;   // [E, H / 128, I / 128] f32
} megamoe_fp8_experts_t;

/* Forward: y = sum_j s_tj W2[e] (silu(W13[e,:I] x_t) * W13[e,I:] x_t), e = topk_ids[t, j] (the default layout and
 * activation, no biases; the general form is at the top of this file). */
typedef struct {
    megamoe_tensor_t x;               // [T, H] input activations
    megamoe_tensor_t topk_ids;        // [T, topk] expert per slot, -1 = dropped
    megamoe_tensor_t topk_weights;    // [T, topk] combine weight per slot
    megamoe_tensor_t w13;             // [E, 2I, H] gate rows then up rows (other layouts: see layout)
    megamoe_tensor_t w2;              // [E, H, I] down projection
    megamoe_tensor_t y;               // [T, H] output, written in full
    megamoe_tensor_t saved_h;         // [T*topk, 2I] optional output for the backward (sorted rows; see above)
    megamoe_accum_t accum;            // accumulation precision
    void* workspace;                  // device (CUDA) or host (CPU) scratch of workspace_bytes, 256-byte aligned
    size_t workspace_bytes;           // at least megamoe_forward_workspace_size()
    void* stream;                     // cudaStream_t for CUDA tensors (NULL = legacy default); ignored on CPU
    megamoe_tensor_t w3;              // [E, I, H] up projection, with MEGAMOE_GATE_UP_SEPARATE only (else absent)
    megamoe_tensor_t b13;             // [E, 2I] optional bias of the up projection (arranged as w13's rows)
    megamoe_tensor_t b2;              // [E, H] optional bias of the down projection
    megamoe_layout_t layout;          // storage of w13 / w3 / w2 (zero: the default)
    megamoe_activation_t activation;  // zero: SwiGLU
    megamoe_precision_t precision;    // zero: DEFAULT
    megamoe_fp8_experts_t fp8;        // FP8_BLOCKWISE: the quantized weights (above); else absent
} megamoe_forward_params_t;

/* Backward: given dy, the gradients of DESIGN.md section 1 (dx, d topk_weights, dw13, dw2; dw3, db13, db2). */
typedef struct {
    megamoe_tensor_t dy;             // [T, H] gradient of y, dtype of x
    megamoe_tensor_t x;              // [T, H] forward input
    megamoe_tensor_t topk_ids;       // [T, topk] forward input
    megamoe_tensor_t topk_weights;   // [T, topk] forward input
    megamoe_tensor_t w13;            // [E, 2I, H] forward input
    megamoe_tensor_t w2;             // [E, H, I] forward input
    megamoe_tensor_t saved_h;        // [T*topk, 2I] optional, consumed: the forward's saved_h of these inputs
    megamoe_tensor_t dx;             // [T, H] output, dtype of x; optional (data NULL = not wanted)
    megamoe_tensor_t dtopk_weights;  // [T, topk] output, f32 or dtype of topk_weights; 0 for dropped slots; optional
    megamoe_tensor_t dw13;    // [E, 2I, H] output, dtype of w13 or f32; zero for experts with no tokens; optional
    megamoe_tensor_t dw2;     // [E, H, I] output, dtype of w2 or f32; optional
    megamoe_accum_t accum;    // accumulation precision
    void* workspace;          // device (CUDA) or host (CPU) scratch of workspace_bytes, 256-byte aligned
    size_t workspace_bytes;   // at least megamoe_backward_workspace_size() (it depends on the kernels the call runs)
    void* stream;             // cudaStream_t for CUDA tensors (NULL = legacy default); ignored on CPU
    megamoe_tensor_t w3;      // [E, I, H] forward input (MEGAMOE_GATE_UP_SEPARATE only)
    megamoe_tensor_t b13;     // [E, 2I] forward input, optional
    megamoe_tensor_t b2;      // [E, H] forward input, optional
    megamoe_tensor_t dw3;     // shaped as w3, dtype of w3 or f32; optional, needs w3
    megamoe_tensor_t db13;    // [E, 2I] (as b13), dtype of b13 or f32; optional, needs b13
    megamoe_tensor_t db2;     // [E, H], dtype of b2 or f32; optional, needs b2
    megamoe_layout_t layout;  // as the forward's
    megamoe_activation_t activation;
    int32_t accumulate_weight_grads;  // 0 or 1: add into the f32 dw13 / dw3 / dw2 / db13 / db2 (see the top)
    megamoe_precision_t precision;    // as the forward's
    megamoe_fp8_experts_t fp8;        // FP8_BLOCKWISE: the quantized weights; else absent
} megamoe_backward_params_t;

/* Grouped rows forward: out_r = s_r W2[e] (silu(W13[e,:I] x_r) * W13[e,I:] x_r) for the rows r of expert e,
 * rows [n_0 + ... + n_{e-1}, n_0 + ... + n_e) with n = tokens_per_expert; s = scores (1 when absent). */
typedef struct {
    megamoe_tensor_t x_sorted;           // [R, H] input rows, sorted by expert
    megamoe_tensor_t tokens_per_expert;  // [E] rows per expert (i32 or i64), on the device of x_sorted
    megamoe_tensor_t scores;             // [R] optional per-row scale of out (f32 or the dtype of x_sorted)
    megamoe_tensor_t w13;                // [E, 2I, H] gate rows then up rows (other layouts: see layout)
    megamoe_tensor_t w2;                 // [E, H, I] down projection
    megamoe_tensor_t out;                // [R, H] output, written in full (padding rows: 0)
    megamoe_tensor_t saved_h;            // [R, 2I] optional output for the backward (padding rows untouched)
    megamoe_accum_t accum;               // accumulation precision
    void* workspace;                     // device (CUDA) or host (CPU) scratch of workspace_bytes, 256-byte aligned
    size_t workspace_bytes;              // at least megamoe_grouped_forward_workspace_size()
    void* stream;                        // cudaStream_t for CUDA tensors (NULL = legacy default); ignored on CPU
    megamoe_tensor_t w3;                 // [E, I, H] up projection (MEGAMOE_GATE_UP_SEPARATE only)
    megamoe_tensor_t b13;                // [E, 2I] optional bias of the up projection (arranged as w13's rows)
    megamoe_tensor_t b2;                 // [E, H] optional bias of the down projection (scaled by the score too)
    megamoe_layout_t layout;             // storage of w13 / w3 / w2 (zero: the default)
    megamoe_activation_t activation;     // zero: SwiGLU
    megamoe_precision_t precision;       // zero: DEFAULT
    megamoe_fp8_experts_t fp8;           // FP8_BLOCKWISE: the quantized weights (above); else absent
} megamoe_grouped_forward_params_t;

/* Grouped rows backward: given dout, d x_sorted, d scores (= <dout_r, o_r>, o_r the unscaled row), dw13 and dw2. */
typedef struct {
    megamoe_tensor_t dout;               // [R, H] gradient of out, dtype of x_sorted
    megamoe_tensor_t x_sorted;           // [R, H] forward input
    megamoe_tensor_t tokens_per_expert;  // [E] forward input
    megamoe_tensor_t scores;             // [R] forward input, optional
    megamoe_tensor_t w13;                // [E, 2I, H] forward input
    megamoe_tensor_t w2;                 // [E, H, I] forward input
    megamoe_tensor_t saved_h;            // [R, 2I] optional: the forward's saved_h of these inputs (no recompute)
    megamoe_tensor_t dx_sorted;          // [R, H] output, dtype of x_sorted; 0 for padding rows; optional
    megamoe_tensor_t dscores;  // [R] output, f32 or dtype of scores; 0 for padding rows; optional, needs scores
    megamoe_tensor_t dw13;     // [E, 2I, H] output, dtype of w13 or f32; zero for experts with no rows; optional
    megamoe_tensor_t dw2;      // [E, H, I] output, dtype of w2 or f32; optional
    megamoe_accum_t accum;     // accumulation precision
    void* workspace;           // device (CUDA) or host (CPU) scratch of workspace_bytes, 256-byte aligned
    size_t workspace_bytes;    // at least megamoe_grouped_backward_workspace_size()
    void* stream;              // cudaStream_t for CUDA tensors (NULL = legacy default); ignored on CPU
    megamoe_tensor_t w3;       // [E, I, H] forward input (MEGAMOE_GATE_UP_SEPARATE only)
    megamoe_tensor_t b13;      // [E, 2I] forward input, optional
    megamoe_tensor_t b2;       // [E, H] forward input, optional
    megamoe_tensor_t dw3;      // shaped as w3, dtype of w3 or f32; optional, needs w3
    megamoe_tensor_t db13;     // [E, 2I], dtype of b13 or f32; optional, needs b13
    megamoe_tensor_t db2;      // [E, H], dtype of b2 or f32; optional, needs b2
    megamoe_layout_t layout;   // as the forward's
    megamoe_activation_t activation;
    int32_t accumulate_weight_grads;  // 0 or 1: add into the f32 dw13 / dw3 / dw2 / db13 / db2 (see the top)
    megamoe_precision_t precision;    // as the forward's
    megamoe_fp8_experts_t fp8;        // FP8_BLOCKWISE: the quantized weights; else absent
} megamoe_grouped_backward_params_t;

/* The public structs whose sizes megamoe_struct_size() reports (the ABI guard of a binding). */
typedef enum {
    MEGAMOE_STRUCT_TENSOR = 0,
    MEGAMOE_STRUCT_FORWARD_PARAMS = 1,
    MEGAMOE_STRUCT_BACKWARD_PARAMS = 2,
    MEGAMOE_STRUCT_GROUPED_FORWARD_PARAMS = 3,
    MEGAMOE_STRUCT_GROUPED_BACKWARD_PARAMS = 4,
    MEGAMOE_STRUCT_LAYOUT = 5,
    MEGAMOE_STRUCT_ACTIVATION = 6,
    MEGAMOE_STRUCT_FP8_EXPERTS = 7,
} megamoe_struct_kind_t;

/* The message of the last failed call on this thread ("" after a success). Never NULL. */
MEGAMOE_API const char* megamoe_last_error(void);
/* A fixed name for a status ("MEGAMOE_STATUS_INVALID_ARGUMENT", ...). Never NULL. */
MEGAMOE_API const char* megamoe_status_string(megamoe_status_t status);
/* Library version as MAJOR * 10000 + MINOR * 100 + PATCH. */
MEGAMOE_API int32_t megamoe_version(void);
/* MEGAMOE_ABI_VERSION of the build, and sizeof() of a public struct as the library was built (0: unknown kind). */
MEGAMOE_API int32_t megamoe_abi_version(void);
MEGAMOE_API size_t megamoe_struct_size(megamoe_struct_kind_t kind);
/* 1 where the library was built with its CUDA code, 0 for a CPU-only build (the reference alone, built without nvcc):
 * there every call on CUDA tensors returns MEGAMOE_STATUS_NOT_SUPPORTED saying so. */
MEGAMOE_API int32_t megamoe_has_cuda(void);

/* Workspace bytes the call needs for these shapes, dtypes and device (data pointers are not read). */
MEGAMOE_API megamoe_status_t megamoe_forward_workspace_size(const megamoe_forward_params_t* params, size_t* bytes);
MEGAMOE_API megamoe_status_t megamoe_backward_workspace_size(const megamoe_backward_params_t* params, size_t* bytes);

/* Validate, then run. All tensors must be on one device. CUDA calls are asynchronous on params->stream. */
MEGAMOE_API megamoe_status_t megamoe_forward(const megamoe_forward_params_t* params);
MEGAMOE_API megamoe_status_t megamoe_backward(const megamoe_backward_params_t* params);

/* Grouped rows: the same conventions (workspace query, validation, optional outputs, CUDA asynchrony). */
MEGAMOE_API megamoe_status_t megamoe_grouped_forward_workspace_size(const megamoe_grouped_forward_params_t* params,
                                                                    size_t* bytes);
MEGAMOE_API megamoe_status_t megamoe_grouped_backward_workspace_size(const megamoe_grouped_backward_params_t* params,
                                                                     size_t* bytes);
MEGAMOE_API megamoe_status_t megamoe_grouped_forward(const megamoe_grouped_forward_params_t* params);
MEGAMOE_API megamoe_status_t megamoe_grouped_backward(const megamoe_grouped_backward_params_t* params);

/* The blockwise FP8 copies of the expert weights for FP8_BLOCKWISE calls: w13 [E, 2I, H] and w2 [E, H, I]
 * (bf16, f16 or f32, CUDA, contiguous; the default layout: weights stored otherwise are copied into it first, as
 * python's megamoe.fp8 does), each in 128 x 128 blocks (amax in f32, scale = amax / 448,
 * q = e4m3(v / scale) rounded to nearest even; a block of zeros has scale 1, a block holding a NaN or an infinity a
 * NaN scale and NaN values), written into every tensor of fp8 (shapes above, E, H, I from w13 and w2; H and I
 * multiples of 128) but the transposed copies w13_t / w2_t left absent, which are not written. Run it once after each
 * optimizer step; every micro-batch's forward and backward reads the same copies (memory: 2 bytes per weight element
 * with the transposed copies, the bf16 weights' size, 1 byte without them, plus the scales). Asynchronous on stream.
 * Needs a compute capability 9.0 device (MEGAMOE_STATUS_NOT_SUPPORTED elsewhere, as the FP8 path itself). */
MEGAMOE_API megamoe_status_t megamoe_quantize_experts(const megamoe_tensor_t* w13, const megamoe_tensor_t* w2,
                                                      const megamoe_fp8_experts_t* fp8, void* stream);

/* Which implementation the call with these params would run (validated as the call is, data not read: a CUDA call
 * whose options the CUDA path cannot run returns the call's NOT_SUPPORTED and its message). */
MEGAMOE_API megamoe_status_t megamoe_forward_path(const megamoe_forward_params_t* params, megamoe_path_t* path);
MEGAMOE_API megamoe_status_t megamoe_backward_path(const megamoe_backward_params_t* params, megamoe_path_t* path);
MEGAMOE_API megamoe_status_t megamoe_grouped_forward_path(const megamoe_grouped_forward_params_t* params,
                                                          megamoe_path_t* path);
MEGAMOE_API megamoe_status_t megamoe_grouped_backward_path(const megamoe_grouped_backward_params_t* params,
                                                           megamoe_path_t* path);
/* Why the last successful megamoe_*_path call of this thread returned the portable path for a call the fused sm_90a
 * kernels would otherwise run: the expert parameter that keeps it off them, e.g. "w3 not 16-byte aligned: the fused
 * sm_90a kernels read it by TMA, as w13; this call runs the portable CUDA kernels". "" when none did (CPU tensors, or
 * a device / shape the sm_90a kernels do not run anyway) or after a failed query. Never NULL; valid until the
 * thread's next megamoe_*_path call. */
MEGAMOE_API const char* megamoe_path_reason(void);
/* A fixed name for a path: "reference", "cuda", "sm90", "sm90+cuda-weight-grads", "sm90-fp8". Never NULL. */
MEGAMOE_API const char* megamoe_path_string(megamoe_path_t path);

/* Test overrides: force a choice the library otherwise makes by itself, so that tests reach every path. Process-wide
 * (every thread and device) until set again; 0, the default, restores the library's own choices. Not for production
 * use: a call's workspace size query and the call must see the same overrides. */
typedef enum {
    MEGAMOE_TEST_PORTABLE_WEIGHT_GRADS = 1,     /* the sm_90a backward's weight gradients on the portable kernel */
    MEGAMOE_TEST_FP8_FORWARD_ONLY = 2,          /* an FP8_BLOCKWISE call's backward in the element type */
    MEGAMOE_TEST_FP8_BACKWARD_ONLY = 4,         /* an FP8_BLOCKWISE call's forward in the element type */
    MEGAMOE_TEST_FP8_OPERANDS_IN_WORKSPACE = 8, /* the FP8 backward's dy and dh copies in the workspace, not in dw13 */
    MEGAMOE_TEST_PAIR_BLOCKS = 16               /* the sm_90a M-grouped tile order in pair blocks at every launch (in
                                                   builds that form them), not only where an expert's weights exceed
                                                   the L2 */
} megamoe_test_override_t;
/* Sets the overrides (a bitwise OR of megamoe_test_override_t values). */
MEGAMOE_API void megamoe_testing_set_overrides(uint32_t overrides);
MEGAMOE_API uint32_t megamoe_testing_overrides(void);

#ifdef __cplusplus
}  // extern "C"
#endif

#endif  // MEGAMOE_MEGAMOE_H_
