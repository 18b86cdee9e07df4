// Host-side helpers shared by the sm_90a launchers: the driver's tensor-map encoder (fetched through the runtime,
// so the library never links libcuda) and the cluster occupancy that bounds a persistent grid.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <utility>

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

// Clusters of `kernel` that fit on the device at once (asked once per device and kernel): the persistent grid
// must not exceed it, or the clusters left over would run a second wave of tiles.
inline int max_active_clusters(const void* kernel, const cudaLaunchConfig_t& config) {
    static std::mutex mutex;
    static std::map<std::pair<int, const void*>, int> cache;
    int device_idx = 0;
    if (cudaGetDevice(&device_idx) != cudaSuccess) return 0;
    const std::lock_guard<std::mutex> lock(mutex);
    const auto key = std::make_pair(device_idx, kernel);
    const auto found = cache.find(key);
    if (found != cache.end()) return found->second;
    int num_clusters = 0;
    if (cudaOccupancyMaxActiveClusters(&num_clusters, kernel, &config) != cudaSuccess) {
        cudaGetLastError();
        num_clusters = 0;
    }
    cache.emplace(key, num_clusters);
    return num_clusters;
}

}  // namespace megamoe::sm90
