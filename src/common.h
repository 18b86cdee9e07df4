// Internal helpers shared by the validator, the CPU reference and the CUDA paths: the problem shape
// and the thread-local error message behind megamoe_last_error().
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

}  // namespace megamoe
