// Internal helpers shared by the validator, the CPU reference and the CUDA paths: the problem shape
// and the thread-local error message behind megamoe_last_error(), and MEGAMOE_CHECK, which passes a failed status on.
#pragma once

#include <cstdarg>
#include <cstdint>
#include <string>

#include "megamoe/megamoe.h"

namespace megamoe {

// The sizes of one problem, read off validated tensors (DESIGN.md section 1 names).
struct Shape {
    int64_t num_tokens;                                      // T
    int64_t hidden;                                          // H
    int64_t intermediate;                                    // I
    int64_t num_experts;                                     // E
    int64_t topk;                                            // routed experts per token
    int64_t num_slots() const { return num_tokens * topk; }  // T * topk
};

// Sets the thread-local message returned by megamoe_last_error() and returns `status`.
megamoe_status_t set_error(megamoe_status_t status, const char* fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
void clear_error();

// Returns the status of `expr` from the enclosing function unless it is SUCCESS.
#define MEGAMOE_CHECK(expr)                                                    \
    do {                                                                       \
        const megamoe_status_t megamoe_status_ = (expr);                       \
        if (megamoe_status_ != MEGAMOE_STATUS_SUCCESS) return megamoe_status_; \
    } while (0)

}  // namespace megamoe
