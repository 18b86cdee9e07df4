// Thread-local error message behind megamoe_last_error().
#include <cstdio>
#include <string>

#include "common.h"

namespace megamoe {
namespace {
thread_local std::string g_last_error;
}

megamoe_status_t set_error(megamoe_status_t status, const char* fmt, ...) {
    char buffer[1024];
    va_list args;
    va_start(args, fmt);
    std::vsnprintf(buffer, sizeof(buffer), fmt, args);
    va_end(args);
    g_last_error = buffer;
    return status;
}

void clear_error() {
    g_last_error.clear();
}

const char* last_error() {
    return g_last_error.c_str();
}

}  // namespace megamoe
