// A host crash of megamoe_tests (SIGSEGV, SIGBUS, SIGFPE, SIGABRT) prints the faulting thread's backtrace to stderr
// before the process dies as it would have: the GPU machine's runs keep only the logs, so a crash must name its frames
// there (symbolize the +0x offsets with `addr2line -f -C -e megamoe_tests` on the same binary).
#include <execinfo.h>
#include <signal.h>
#include <unistd.h>

#include <cstring>
#include <initializer_list>

namespace {

void print_backtrace(int signal_number) {
    static const char kHeader[] = "\n*** megamoe_tests: fatal signal, backtrace:\n";
    (void)!write(STDERR_FILENO, kHeader, sizeof(kHeader) - 1);
    void* frames[64];
    const int num_frames = backtrace(frames, 64);
    backtrace_symbols_fd(frames, num_frames, STDERR_FILENO);
    signal(signal_number, SIG_DFL);
    raise(signal_number);
}

const bool kInstalled = [] {
    for (const int signal_number : {SIGSEGV, SIGBUS, SIGFPE, SIGABRT}) signal(signal_number, print_backtrace);
    return true;
}();

}  // namespace
