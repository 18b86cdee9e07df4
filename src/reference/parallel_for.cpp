// parallel_for.h: threads started per loop, indices handed out by an atomic counter, the first exception kept.
#include "reference/parallel_for.h"

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

namespace megamoe::reference {

int available_cpus() {
    cpu_set_t cpus;
    CPU_ZERO(&cpus);
    if (sched_getaffinity(0, sizeof(cpus), &cpus) == 0) return std::max(1, CPU_COUNT(&cpus));
    return std::max(1u, std::thread::hardware_concurrency());
}

void parallel_for(int64_t count, int64_t work, const std::function<void(int64_t)>& body) {
    const int64_t num_threads = work < kParallelMinWork ? 1 : std::min<int64_t>(count, available_cpus());
    if (num_threads <= 1) {
        for (int64_t index = 0; index < count; ++index) body(index);
        return;
    }
    std::atomic<int64_t> next{0};
    std::mutex error_mutex;
    std::exception_ptr error;
    auto run_indices = [&] {
        try {
            for (int64_t index = next.fetch_add(1); index < count; index = next.fetch_add(1)) body(index);
        } catch (...) {
            const std::lock_guard<std::mutex> lock(error_mutex);
            if (!error) error = std::current_exception();
            next.store(count);  // the other threads take no new index
        }
    };
    std::vector<std::thread> threads;
    threads.reserve(static_cast<size_t>(num_threads - 1));
    for (int64_t thread_idx = 1; thread_idx < num_threads; ++thread_idx) {
        try {
            threads.emplace_back(run_indices);
        } catch (const std::system_error&) {
            break;  // no more threads to be had: the ones started and the calling thread do every index
        }
    }
    run_indices();
    for (std::thread& thread : threads) thread.join();
    if (error) std::rethrow_exception(error);
}

}  // namespace megamoe::reference
