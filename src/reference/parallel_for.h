// How the CPU reference spreads a loop of independent indices (tokens, experts) over the cores: each index is computed
// whole by one thread, so no sum is split between threads and results do not depend on the thread count.
//
// No thread pool and no OpenMP: a loop worth splitting starts its threads and joins them before returning, so nothing
// is left running, or spinning against the threads of the application (torch's intra-op pool) between calls; a loop
// too small to be worth it runs on the calling thread alone.
#pragma once

#include <cstdint>
#include <functional>

namespace megamoe::reference {

// Below this many multiply-adds in all, a loop runs on the calling thread: starting and joining a thread costs tens of
// microseconds, about what this much of the reference's arithmetic takes.
inline constexpr int64_t kParallelMinWork = int64_t{1} << 18;

// body(index) for every index in [0, count). `work` estimates the whole loop's multiply-adds: below kParallelMinWork,
// or with one CPU, the calling thread runs the indices in increasing order; else the calling thread and up to
// available_cpus() - 1 threads started for this call take indices one at a time from a shared counter. Returns once
// every index is done; the first exception a body throws is rethrown here after every thread has stopped.
void parallel_for(int64_t count, int64_t work, const std::function<void(int64_t)>& body);

// The CPUs this process may run on (its affinity mask), at least 1.
int available_cpus();

}  // namespace megamoe::reference
