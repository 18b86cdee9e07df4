// Helpers shared by the CUDA tests: device detection, checked CUDA calls, device tensors shaped like
// host ones (optionally misaligned views), NaN poisoning, and workspaces.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "test_util.h"

namespace megamoe::test {

inline bool cuda_available() {
    int num_devices = 0;
    return cudaGetDeviceCount(&num_devices) == cudaSuccess && num_devices > 0;
}

#define SKIP_WITHOUT_CUDA() \
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device: the CUDA path tests need a GPU"

inline void expect_cuda(cudaError_t err, const char* what) {
    EXPECT_EQ(err, cudaSuccess) << what << ": " << cudaGetErrorString(err);
}

// Device memory holding a tensor shaped like a host one (contiguous), with its CUDA view.
class DeviceTensor {
  public:
    DeviceTensor() = default;
    // `offset_elements` > 0 places the data that many elements past the allocation's start, so a
    // 2-byte element type gets a view that is not 16-, 8- or 4-byte aligned.
    explicit DeviceTensor(const megamoe_tensor_t& like, int64_t offset_elements = 0) : view_(like) {
        num_bytes_ = static_cast<size_t>(numel(like)) * dtype_size(like.dtype);
        const size_t offset_bytes = static_cast<size_t>(offset_elements) * dtype_size(like.dtype);
        expect_cuda(cudaMalloc(&allocation_, std::max<size_t>(num_bytes_ + offset_bytes, 256)), "cudaMalloc");
        data_ = static_cast<char*>(allocation_) + offset_bytes;
        view_.data = data_;
        view_.device_type = MEGAMOE_DEVICE_CUDA;
        expect_cuda(cudaGetDevice(&view_.device_index), "cudaGetDevice");
    }
    static DeviceTensor upload(const HostTensor& host, int64_t offset_elements = 0) {
        DeviceTensor tensor(host.view, offset_elements);
        expect_cuda(cudaMemcpy(tensor.data_, host.view.data, tensor.num_bytes_, cudaMemcpyHostToDevice), "upload");
        return tensor;
    }
    DeviceTensor(DeviceTensor&& other) noexcept { *this = std::move(other); }
    DeviceTensor& operator=(DeviceTensor&& other) noexcept {
        std::swap(allocation_, other.allocation_);
        std::swap(data_, other.data_);
        std::swap(num_bytes_, other.num_bytes_);
        std::swap(view_, other.view_);
        return *this;
    }
    DeviceTensor(const DeviceTensor&) = delete;
    DeviceTensor& operator=(const DeviceTensor&) = delete;
    ~DeviceTensor() {
        if (allocation_ != nullptr) cudaFree(allocation_);
    }

    const megamoe_tensor_t& view() const { return view_; }
    // 0xFF bytes: NaN in bf16, f16 and f32, so an element the library forgets to write is caught.
    void poison() { expect_cuda(cudaMemset(data_, 0xFF, num_bytes_), "poison"); }
    HostTensor download() const {
        HostTensor host(view_.dtype, std::vector<int64_t>(view_.shape, view_.shape + view_.ndim));
        expect_cuda(cudaMemcpy(host.view.data, data_, num_bytes_, cudaMemcpyDeviceToHost), "download");
        return host;
    }

  private:
    void* allocation_ = nullptr;
    void* data_ = nullptr;
    size_t num_bytes_ = 0;
    megamoe_tensor_t view_{};
};

inline DeviceTensor device_workspace(size_t num_bytes) {
    megamoe_tensor_t like{};
    like.dtype = MEGAMOE_DTYPE_I32;  // 4-byte elements
    like.ndim = 1;
    like.shape[0] = static_cast<int64_t>((num_bytes + 3) / 4);
    like.strides[0] = 1;
    return DeviceTensor(like);
}

}  // namespace megamoe::test
