// Host-side helpers shared by the sm_90a launchers: the driver's tensor-map encoder (fetched through the runtime,
// so the library never links libcuda), 2-D tensor maps of 16-bit matrices, and the launch of a persistent kernel in
// clusters (grid bounded by the clusters that fit on the device at once).
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <utility>

#include "common.h"
#include "device/cuda_utils.h"
#include "megamoe/megamoe.h"

namespace megamoe::sm90 {

// cuTensorMapEncodeTiled, looked up once; NULL when the driver does not provide it.
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
    static const PFN_cuTensorMapEncodeTiled_v12000 encoder = [] {
        void* fn = nullptr;
        cudaDriverEntryPointQueryResult result{};
        constexpr unsigned kDriverApiVersion = 12000;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, kDriverApiVersion, cudaEnableDefault,
                                             &result) != cudaSuccess ||
            result != cudaDriverEntryPointSuccess) {
            cudaGetLastError();
            fn = nullptr;
        }
        return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
    }();
    return encoder;
}

// The tensor maps' element types: bf16 / f16 (`dtype`), or bytes (e4m3 operands; TMA only moves them).
inline CUtensorMapDataType tensor_map_type_of(megamoe_dtype_t dtype) {
    return dtype == MEGAMOE_DTYPE_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
}
constexpr CUtensorMapDataType kTensorMapBytes = CU_TENSOR_MAP_DATA_TYPE_UINT8;

// A 2-D tensor map over a [rows, cols] matrix of `data_type` elements of elem_bytes bytes (cols innermost, row stride
// ld elements, ld * elem_bytes a multiple of 16), boxes of box_cols x box_rows with 128-byte swizzle (box_cols: one
// 128-byte row); elements out of bounds are zero-filled by loads and not written by stores. False when the encoder is
// missing or refuses.
inline bool encode_2d_sw128_map(CUtensorMapDataType data_type, int64_t elem_bytes, const void* data, int64_t rows,
                                int64_t cols, int64_t ld, uint32_t box_rows, uint32_t box_cols,
                                CUtensorMapL2promotion l2_promotion, CUtensorMap* map) {
    const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
    if (encode == nullptr) return false;
    const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
    const cuuint64_t strides[1] = {static_cast<cuuint64_t>(ld * elem_bytes)};
    const cuuint32_t box[2] = {box_cols, box_rows};
    const cuuint32_t element_strides[2] = {1, 1};
    return encode(map, data_type, 2, const_cast<void*>(data), dims, strides, box, element_strides,
                  CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, l2_promotion,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// The same over a matrix of bf16 or f16 (`dtype`; ld a multiple of 8).
inline bool encode_2d_sw128_map(megamoe_dtype_t dtype, const void* data, int64_t rows, int64_t cols, int64_t ld,
                                uint32_t box_rows, uint32_t box_cols, CUtensorMapL2promotion l2_promotion,
                                CUtensorMap* map) {
    constexpr int64_t kElemBytes = 2;
    return encode_2d_sw128_map(tensor_map_type_of(dtype), kElemBytes, data, rows, cols, ld, box_rows, box_cols,
                               l2_promotion, map);
}

// A 3-D tensor map over `data_type` elements: dims innermost first, strides of dims 1 and 2 in bytes (multiples of
// 16), boxes of box[0] x box[1] x box[2] (box[0]: at most one 128-byte row), 128-byte swizzle, zero fill out of
// bounds. False when the encoder is missing or refuses.
inline bool encode_3d_sw128_map(CUtensorMapDataType data_type, const void* data, const cuuint64_t (&dims)[3],
                                const cuuint64_t (&byte_strides)[2], const cuuint32_t (&box)[3],
                                CUtensorMapL2promotion l2_promotion, CUtensorMap* map) {
    const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
    if (encode == nullptr) return false;
    const cuuint32_t element_strides[3] = {1, 1, 1};
    return encode(map, data_type, 3, const_cast<void*>(data), dims, byte_strides, box, element_strides,
                  CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, l2_promotion,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// The same over 16-bit elements (`dtype`: bf16 or f16).
inline bool encode_3d_sw128_map(megamoe_dtype_t dtype, const void* data, const cuuint64_t (&dims)[3],
                                const cuuint64_t (&byte_strides)[2], const cuuint32_t (&box)[3],
                                CUtensorMapL2promotion l2_promotion, CUtensorMap* map) {
    return encode_3d_sw128_map(tensor_map_type_of(dtype), data, dims, byte_strides, box, l2_promotion, map);
}

// Clusters of `kernel` that fit on the device at once, for a launch `config` with its dynamic shared memory (asked,
// and the kernel's shared-memory limit raised to it, once per device and kernel): a persistent grid must not exceed
// it, or the clusters left over would run a second wave of tiles.
inline megamoe_status_t prepare_cluster_kernel(const void* kernel, const cudaLaunchConfig_t& config, const char* name,
                                               int* num_clusters) {
    static std::mutex mutex;
    static std::map<std::pair<int, const void*>, int> cache;
    int device_idx = 0;
    MEGAMOE_CUDA_RETURN_IF_ERROR(cuda::check_cuda(cudaGetDevice(&device_idx), name));
    const std::lock_guard<std::mutex> lock(mutex);
    const auto key = std::make_pair(device_idx, kernel);
    const auto found = cache.find(key);
    if (found != cache.end()) {
        *num_clusters = found->second;
        return MEGAMOE_STATUS_SUCCESS;
    }
    const auto smem_bytes = static_cast<int>(config.dynamicSmemBytes);
    MEGAMOE_CUDA_RETURN_IF_ERROR(
        cuda::check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes), name));
    if (cudaOccupancyMaxActiveClusters(num_clusters, kernel, &config) != cudaSuccess || *num_clusters <= 0) {
        cudaGetLastError();
        return set_error(MEGAMOE_STATUS_CUDA_ERROR, "%s: no cluster of %u CTAs fits on the device", name,
                         config.attrs[0].val.clusterDim.x);
    }
    cache.emplace(key, *num_clusters);
    return MEGAMOE_STATUS_SUCCESS;
}

// Launches the persistent `kernel` on `stream` in clusters of kClusterSize CTAs of num_threads threads and
// smem_bytes of dynamic shared memory: as many clusters as fit on the device at once, at most max_clusters.
template <int kClusterSize, typename... KernelArgs, typename... Args>
megamoe_status_t launch_cluster_kernel(void (*kernel)(KernelArgs...), const char* name, int num_threads, int smem_bytes,
                                       int64_t max_clusters, cudaStream_t stream, Args&&... args) {
    if (max_clusters <= 0) return MEGAMOE_STATUS_SUCCESS;  // no tiles
    cudaLaunchAttribute attributes[1]{};
    attributes[0].id = cudaLaunchAttributeClusterDimension;
    attributes[0].val.clusterDim.x = kClusterSize;
    attributes[0].val.clusterDim.y = 1;
    attributes[0].val.clusterDim.z = 1;
    cudaLaunchConfig_t config{};
    config.blockDim = dim3(num_threads);
    config.dynamicSmemBytes = smem_bytes;
    config.stream = stream;
    config.attrs = attributes;
    config.numAttrs = 1;
    config.gridDim = dim3(kClusterSize);  // for the occupancy query
    int fitting = 0;
    MEGAMOE_CUDA_RETURN_IF_ERROR(prepare_cluster_kernel(reinterpret_cast<const void*>(kernel), config, name, &fitting));
    config.gridDim = dim3(static_cast<unsigned>(std::min<int64_t>(fitting, max_clusters) * kClusterSize));
    MEGAMOE_CUDA_RETURN_IF_ERROR(
        cuda::check_cuda(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...), name));
    return cuda::check_launch(name);
}

}  // namespace megamoe::sm90
