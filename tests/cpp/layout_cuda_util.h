// Helpers of the CUDA layout tests (test_layouts_cuda.cpp): dtype conversions of host tensors, the upload of every
// present view of a params struct, downloads into host tensors, relative errors and bitwise comparisons.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <deque>
#include <string>
#include <utility>
#include <vector>

#include "cuda_test_util.h"
#include "layout_test_util.h"

namespace megamoe::test {

inline std::vector<int64_t> dims_of(const megamoe_tensor_t& view) {
    return std::vector<int64_t>(view.shape, view.shape + view.ndim);
}

// `tensor`'s values in `dtype` (absent: absent).
inline HostTensor converted(const HostTensor& tensor, megamoe_dtype_t dtype) {
    if (!present(tensor)) return HostTensor();
    HostTensor out(dtype, dims_of(tensor.view));
    for (int64_t idx = 0; idx < tensor.size(); ++idx) out.set(idx, tensor.get(idx));
    return out;
}

// Rounds every value of `tensor` to `dtype` and back, so that the f64 reference sees the device's exact inputs.
inline void round_through(HostTensor& tensor, megamoe_dtype_t dtype) {
    if (present(tensor)) tensor = converted(converted(tensor, dtype), tensor.view.dtype);
}

// A device tensor holding the bytes of a host view (CPU-labelled), for inputs and outputs alike.
inline DeviceTensor upload_view(const megamoe_tensor_t& host) {
    DeviceTensor device(host);
    const size_t num_bytes = static_cast<size_t>(numel(host)) * dtype_size(host.dtype);
    expect_cuda(cudaMemcpy(device.view().data, host.data, num_bytes, cudaMemcpyHostToDevice), "upload");
    return device;
}

// Every present tensor view of a call moved to the device: `upload(&params.x)` points the view at a device copy.
struct DeviceViews {
    std::deque<DeviceTensor> tensors;  // a deque: the returned pointers stay valid
    DeviceTensor* upload(megamoe_tensor_t* view) {
        if (!is_present(*view) || view->data == nullptr) return nullptr;
        tensors.push_back(upload_view(*view));
        *view = tensors.back().view();
        return &tensors.back();
    }
};

// Relative Frobenius error of got against want, relative to the norm of `scale` when given (else of want).
inline double relative_error_to(const HostTensor& got, const HostTensor& want, const HostTensor* scale = nullptr) {
    double diff = 0.0, norm = 0.0;
    for (int64_t idx = 0; idx < want.size(); ++idx) {
        const double delta = got.get(idx) - want.get(idx), size = scale != nullptr ? scale->get(idx) : want.get(idx);
        diff += delta * delta;
        norm += size * size;
    }
    return norm > 0.0 ? std::sqrt(diff / norm) : std::sqrt(diff);
}

inline void expect_near_reference(const HostTensor& got, const HostTensor& want, const std::string& what,
                                  const HostTensor* scale = nullptr) {
    ASSERT_EQ(present(got), present(want)) << what;
    if (!present(want)) return;
    ASSERT_EQ(got.size(), want.size()) << what;
    EXPECT_LT(relative_error_to(got, want, scale), kBf16Tolerance) << what << ": relative error vs the CPU reference";
}

inline bool same_bytes(const HostTensor& a, const HostTensor& b) {
    return a.bytes.size() == b.bytes.size() && std::memcmp(a.bytes.data(), b.bytes.data(), a.bytes.size()) == 0;
}

inline std::string describe(const LayoutCase& c) {
    static const char* const kGateUp[] = {"concatenated", "interleaved", "separate"};
    return std::string(kGateUp[c.gate_up]) + (c.w13_transposed ? " w13^T" : "") + (c.w2_transposed ? " w2^T" : "") +
           (c.clamped ? " clamped" : " swiglu") + (c.biases ? " biases" : "");
}

}  // namespace megamoe::test
