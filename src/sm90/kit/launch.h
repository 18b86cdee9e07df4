// Host-side launch of the sm_90a persistent kernels: in clusters, the grid bounded by the clusters that fit on the
// device at once (asked once per device and kernel).
#pragma once

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
