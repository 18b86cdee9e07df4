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
 *   w13          [E, 2I, H]    dtype of x; rows [0, I) gate, rows [I, 2I) up
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
#define MEGAMOE_VERSION_MINOR 3
#define MEGAMOE_VERSION_PATCH 0
#define MEGAMOE_MAX_DIMS 4
/* Raised whenever a public struct's layout or a function's signature changes; megamoe_abi_version() returns the
 * value the library was built with, so a binding can refuse a library that does not match its own declarations. */
#define MEGAMOE_ABI_VERSION 1

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

/* Forward: y = sum_j s_tj W2[e] (silu(W13[e,:I] x_t) * W13[e,I:] x_t), e = topk_ids[t, j]. */
typedef struct {
    megamoe_tensor_t x;             // [T, H] input activations
    megamoe_tensor_t topk_ids;      // [T, topk] expert per slot, -1 = dropped
    megamoe_tensor_t topk_weights;  // [T, topk] combine weight per slot
    megamoe_tensor_t w13;           // [E, 2I, H] gate rows then up rows
    megamoe_tensor_t w2;            // [E, H, I] down projection
    megamoe_tensor_t y;             // [T, H] output, written in full
    megamoe_tensor_t saved_h;       // [T*topk, 2I] optional output for the backward (sorted rows; see above)
    megamoe_accum_t accum;          // accumulation precision
    void* workspace;                // device (CUDA) or host (CPU) scratch of workspace_bytes, 256-byte aligned
    size_t workspace_bytes;         // at least megamoe_forward_workspace_size()
    void* stream;                   // cudaStream_t for CUDA tensors (NULL = legacy default); ignored on CPU
} megamoe_forward_params_t;

/* Backward: given dy, the gradients of DESIGN.md section 1 (dx, d topk_weights, dw13, dw2). */
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
    megamoe_tensor_t dw13;   // [E, 2I, H] output, dtype of w13 or f32; zero for experts with no tokens; optional
    megamoe_tensor_t dw2;    // [E, H, I] output, dtype of w2 or f32; optional
    megamoe_accum_t accum;   // accumulation precision
    void* workspace;         // device (CUDA) or host (CPU) scratch of workspace_bytes, 256-byte aligned
    size_t workspace_bytes;  // at least megamoe_backward_workspace_size() (it depends on the kernels the call runs)
    void* stream;            // cudaStream_t for CUDA tensors (NULL = legacy default); ignored on CPU
} megamoe_backward_params_t;

/* Grouped rows forward: out_r = s_r W2[e] (silu(W13[e,:I] x_r) * W13[e,I:] x_r) for the rows r of expert e,
 * rows [n_0 + ... + n_{e-1}, n_0 + ... + n_e) with n = tokens_per_expert; s = scores (1 when absent). */
typedef struct {
    megamoe_tensor_t x_sorted;           // [R, H] input rows, sorted by expert
    megamoe_tensor_t tokens_per_expert;  // [E] rows per expert (i32 or i64), on the device of x_sorted
    megamoe_tensor_t scores;             // [R] optional per-row scale of out (f32 or the dtype of x_sorted)
    megamoe_tensor_t w13;                // [E, 2I, H] gate rows then up rows
    megamoe_tensor_t w2;                 // [E, H, I] down projection
    megamoe_tensor_t out;                // [R, H] output, written in full (padding rows: 0)
    megamoe_tensor_t saved_h;            // [R, 2I] optional output for the backward (padding rows untouched)
    megamoe_accum_t accum;               // accumulation precision
    void* workspace;                     // device (CUDA) or host (CPU) scratch of workspace_bytes, 256-byte aligned
    size_t workspace_bytes;              // at least megamoe_grouped_forward_workspace_size()
    void* stream;                        // cudaStream_t for CUDA tensors (NULL = legacy default); ignored on CPU
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
} megamoe_grouped_backward_params_t;

/* The public structs whose sizes megamoe_struct_size() reports (the ABI guard of a binding). */
typedef enum {
    MEGAMOE_STRUCT_TENSOR = 0,
    MEGAMOE_STRUCT_FORWARD_PARAMS = 1,
    MEGAMOE_STRUCT_BACKWARD_PARAMS = 2,
    MEGAMOE_STRUCT_GROUPED_FORWARD_PARAMS = 3,
    MEGAMOE_STRUCT_GROUPED_BACKWARD_PARAMS = 4,
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

#ifdef __cplusplus
}  // extern "C"
#endif

#endif  // MEGAMOE_MEGAMOE_H_
