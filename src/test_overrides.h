// The test overrides of the C API (megamoe.h: megamoe_testing_set_overrides), read by the orchestration: one
// process-wide value, 0 unless a test sets it.
#pragma once

#include <atomic>
#include <cstdint>

#include "megamoe/megamoe.h"

namespace megamoe {

inline std::atomic<uint32_t>& test_overrides() {
    static std::atomic<uint32_t> overrides{0};
    return overrides;
}

inline bool test_override(megamoe_test_override_t which) {
    return (test_overrides().load(std::memory_order_relaxed) & static_cast<uint32_t>(which)) != 0;
}

}  // namespace megamoe
