// The C API: validate every argument (a bad one gives a status and a message naming it, never a crash), then
// dispatch to the CPU reference or the CUDA path. Two entry points share the checks (validate.h) and one dispatch
// body (run_entry): the whole layer (topk_ids routed by the library) and grouped rows (rows already sorted by
// expert, tokens_per_expert counts). megamoe_*_path report the path a call takes, and megamoe_path_reason why a call
// the fused sm_90a kernels would run takes the portable ones (its expert parameters' alignment). Also the version and
// the ABI guard (megamoe_abi_version, megamoe_struct_size). A CPU-only build (MEGAMOE_WITH_CUDA=0: no nvcc when it
// was built) has the reference alone and refuses CUDA tensors once they are validated, naming the build.
#include <iterator>
#include <string>

#include "common.h"
#if MEGAMOE_WITH_CUDA
#include "path/cuda_path.h"
#endif
#include "layout.h"
#include "reference/reference.h"
#include "test_overrides.h"
#include "api/validate.h"

namespace megamoe {
const char* last_error();
}

namespace megamoe {
namespace {

thread_local std::string g_path_reason;  // megamoe_path_reason: set by the last megamoe_*_path of this thread

// The device every tensor of the call is on (validated to be one).
megamoe_device_type_t device_of(const megamoe_forward_params_t& p) {
    return p.x.device_type;
}
megamoe_device_type_t device_of(const megamoe_backward_params_t& p) {
    return p.x.device_type;
}
megamoe_device_type_t device_of(const megamoe_grouped_forward_params_t& p) {
    return p.x_sorted.device_type;
}
megamoe_device_type_t device_of(const megamoe_grouped_backward_params_t& p) {
    return p.x_sorted.device_type;
}

// The name of the rows input that device_of reads.
template <typename Params>
const char* first_input_name(const Params&) {
    return "x";
}
const char* first_input_name(const megamoe_grouped_forward_params_t&) {
    return "x_sorted";
}
const char* first_input_name(const megamoe_grouped_backward_params_t&) {
    return "x_sorted";
}

#if !MEGAMOE_WITH_CUDA
// A CPU-only build given CUDA tensors (`what`: the argument or call that holds them).
megamoe_status_t cuda_not_built(const char* what) {
    return set_error(MEGAMOE_STATUS_NOT_SUPPORTED,
                     "%s: CUDA tensors, but this libmegamoe.so was built without CUDA (CPU reference only: no nvcc "
                     "when it was built); pass CPU tensors, or rebuild with the CUDA toolkit 12.4+ (nvcc on PATH)",
                     what);
}
#endif

// Every argument (validate.h), and for FP8_BLOCKWISE the device (the sm_90a kernels only). Every layout, activation
// and bias runs on both devices.
template <typename Params>
megamoe_status_t validate_for_device(const Params* params, Shape* shape) {
    MEGAMOE_CHECK(validate(params, shape));
#if MEGAMOE_WITH_CUDA
    if (params->precision == MEGAMOE_PRECISION_FP8_BLOCKWISE) {  // validated: CUDA tensors
        return cuda::check_fp8_device(Experts::of(*params).w13->device_index);
    }
#else
    if (device_of(*params) == MEGAMOE_DEVICE_CUDA) return cuda_not_built(first_input_name(*params));
#endif
    return MEGAMOE_STATUS_SUCCESS;
}

// The answers of the two queries (the workspace size, the path) for the CUDA path and for the CPU reference.
#if MEGAMOE_WITH_CUDA
template <typename Params>
void answer_on_cuda(const Params& params, const Shape& shape, size_t* bytes) {
    *bytes = cuda::workspace_size(params, shape);
}
template <typename Params>
void answer_on_cuda(const Params& params, const Shape& shape, megamoe_path_t* path) {
    *path = cuda::path(params, shape, &g_path_reason);
}
#endif
template <typename Params>
void answer_on_cpu(const Params& params, const Shape& shape, size_t* bytes) {
    *bytes = reference::workspace_size(params, shape);
}
template <typename Params>
void answer_on_cpu(const Params&, const Shape&, megamoe_path_t* path) {
    *path = MEGAMOE_PATH_REFERENCE;
}

// megamoe_*_workspace_size and megamoe_*_path of every entry point: validate as the call would, then answer for the
// reference or the CUDA path the call would take. `out_name` names `out` in the message refusing NULL.
template <typename Params, typename Out>
megamoe_status_t query(const Params* params, Out* out, const char* out_name) {
    clear_error();
    if (out == nullptr) return set_error(MEGAMOE_STATUS_INVALID_ARGUMENT, "%s: NULL", out_name);
    Shape shape{};
    MEGAMOE_CHECK(validate_for_device(params, &shape));
#if MEGAMOE_WITH_CUDA
    if (device_of(*params) == MEGAMOE_DEVICE_CUDA) {
        answer_on_cuda(*params, shape, out);
        return MEGAMOE_STATUS_SUCCESS;
    }
#endif
    answer_on_cpu(*params, shape, out);
    return MEGAMOE_STATUS_SUCCESS;
}

// megamoe_forward, megamoe_backward and their grouped-rows forms: validate; on the CPU read the values (ids, counts)
// and run the reference; on CUDA check the pointers and run the CUDA path; each with its workspace checked first.
template <typename Params>
megamoe_status_t run_entry(const Params* params) {
    clear_error();
    Shape shape{};
    MEGAMOE_CHECK(validate_for_device(params, &shape));
    const Params& p = *params;
#if MEGAMOE_WITH_CUDA
    if (device_of(p) == MEGAMOE_DEVICE_CUDA) {
        MEGAMOE_CHECK(check_cuda_pointers_of(p));
        MEGAMOE_CHECK(check_workspace(p.workspace, p.workspace_bytes, cuda::workspace_size(p, shape)));
        return cuda::run(p, shape);
    }
#endif
    MEGAMOE_CHECK(check_cpu_values(p, shape));
    MEGAMOE_CHECK(check_workspace(p.workspace, p.workspace_bytes, reference::workspace_size(p, shape)));
    return reference::run(p, shape);
}

// megamoe_*_path also sets megamoe_path_reason: cleared first, so a refused query leaves it empty.
template <typename Params>
megamoe_status_t query_path(const Params* params, megamoe_path_t* path) {
    g_path_reason.clear();
    return query(params, path, "path");
}

}  // namespace
}  // namespace megamoe

extern "C" {

const char* megamoe_last_error(void) {
    return megamoe::last_error();
}

const char* megamoe_status_string(megamoe_status_t status) {
    static const char* const kNames[] = {"MEGAMOE_STATUS_SUCCESS",       "MEGAMOE_STATUS_INVALID_ARGUMENT",
                                         "MEGAMOE_STATUS_NOT_SUPPORTED", "MEGAMOE_STATUS_WORKSPACE_TOO_SMALL",
                                         "MEGAMOE_STATUS_CUDA_ERROR",    "MEGAMOE_STATUS_INTERNAL_ERROR"};
    static_assert(std::size(kNames) == MEGAMOE_STATUS_INTERNAL_ERROR + 1, "a name for every status");
    return megamoe::entry_of(kNames, status, "MEGAMOE_STATUS_UNKNOWN");
}

int32_t megamoe_version(void) {
    return MEGAMOE_VERSION_MAJOR * 10000 + MEGAMOE_VERSION_MINOR * 100 + MEGAMOE_VERSION_PATCH;
}

int32_t megamoe_abi_version(void) {
    return MEGAMOE_ABI_VERSION;
}

int32_t megamoe_has_cuda(void) {
    return MEGAMOE_WITH_CUDA;
}

size_t megamoe_struct_size(megamoe_struct_kind_t kind) {
    static const size_t kSizes[] = {sizeof(megamoe_tensor_t),
                                    sizeof(megamoe_forward_params_t),
                                    sizeof(megamoe_backward_params_t),
                                    sizeof(megamoe_grouped_forward_params_t),
                                    sizeof(megamoe_grouped_backward_params_t),
                                    sizeof(megamoe_layout_t),
                                    sizeof(megamoe_activation_t),
                                    sizeof(megamoe_fp8_experts_t)};
    static_assert(std::size(kSizes) == MEGAMOE_STRUCT_FP8_EXPERTS + 1, "a size for every struct kind");
    return megamoe::entry_of(kSizes, kind, size_t{0});
}

const char* megamoe_path_string(megamoe_path_t path) {
    static const char* const kNames[] = {"reference", "cuda", "sm90", "sm90+cuda-weight-grads", "sm90-fp8"};
    static_assert(std::size(kNames) == MEGAMOE_PATH_SM90_FP8 + 1, "a name for every path");
    return megamoe::entry_of(kNames, path, "unknown");
}

void megamoe_testing_set_overrides(uint32_t overrides) {
    megamoe::test_overrides().store(overrides, std::memory_order_relaxed);
}

uint32_t megamoe_testing_overrides(void) {
    return megamoe::test_overrides().load(std::memory_order_relaxed);
}

megamoe_status_t megamoe_quantize_experts(const megamoe_tensor_t* w13, const megamoe_tensor_t* w2,
                                          const megamoe_fp8_experts_t* fp8, void* stream) {
    megamoe::clear_error();
    megamoe::Shape shape{};
    MEGAMOE_CHECK(megamoe::check_quantize_experts(w13, w2, fp8, &shape));  // CPU-only: refuses the CUDA tensors
#if MEGAMOE_WITH_CUDA
    MEGAMOE_CHECK(megamoe::cuda::check_fp8_device(w13->device_index));
    return megamoe::cuda::quantize_experts(*w13, *w2, *fp8, shape, stream);
#else
    (void)stream;
    return megamoe::cuda_not_built("w13");
#endif
}

const char* megamoe_path_reason(void) {
    return megamoe::g_path_reason.c_str();
}

// The three entry points of one params struct megamoe_<name>_params_t: megamoe_<name>, megamoe_<name>_workspace_size
// and megamoe_<name>_path (megamoe.h).
#define MEGAMOE_DEFINE_ENTRY_POINTS(name)                                                                      \
    megamoe_status_t megamoe_##name(const megamoe_##name##_params_t* params) {                                 \
        return megamoe::run_entry(params);                                                                     \
    }                                                                                                          \
    megamoe_status_t megamoe_##name##_workspace_size(const megamoe_##name##_params_t* params, size_t* bytes) { \
        return megamoe::query(params, bytes, "bytes");                                                         \
    }                                                                                                          \
    megamoe_status_t megamoe_##name##_path(const megamoe_##name##_params_t* params, megamoe_path_t* path) {    \
        return megamoe::query_path(params, path);                                                              \
    }

MEGAMOE_DEFINE_ENTRY_POINTS(forward)
MEGAMOE_DEFINE_ENTRY_POINTS(backward)
MEGAMOE_DEFINE_ENTRY_POINTS(grouped_forward)
MEGAMOE_DEFINE_ENTRY_POINTS(grouped_backward)

}  // extern "C"
