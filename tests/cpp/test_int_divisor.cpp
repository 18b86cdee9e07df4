// IntDivisor (device/int_divisor.h): the launch-time divisions of the K-grouped kernel (a gather slot by topk, a
// cluster tile index by its expert's tile counts) by multiply-high and shift, against the quotient, on the host side
// of the same arithmetic: every divisor 1 .. 4096 and powers of two and their neighbours up to 2^31 - 1, each with
// the numerators at and around its multiples, near 2^31 and random ones.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "device/int_divisor.h"

namespace megamoe {
namespace {

void expect_divides(int64_t divisor, std::mt19937_64& rng) {
    const cuda::IntDivisor div = cuda::IntDivisor::of(divisor);
    constexpr int64_t kLimit = int64_t{1} << 31;
    std::vector<int64_t> values = {0, 1, divisor - 1, divisor, divisor + 1, kLimit - 1, kLimit - 2, kLimit - divisor};
    const int64_t last_multiple = (kLimit - 1) / divisor * divisor;
    for (int64_t delta = -1; delta <= 1; ++delta) values.push_back(last_multiple + delta);
    std::uniform_int_distribution<int64_t> any(0, kLimit - 1);
    for (int i = 0; i < 64; ++i) {
        const int64_t multiple = any(rng) / divisor * divisor;
        values.push_back(multiple);
        values.push_back(multiple - 1);
        values.push_back(any(rng));
    }
    for (const int64_t value : values) {
        if (value < 0 || value >= kLimit) continue;
        ASSERT_EQ(div.divide(static_cast<int>(value)), value / divisor) << value << " / " << divisor;
    }
}

TEST(IntDivisor, QuotientsOfEveryNumeratorKind) {
    std::mt19937_64 rng(20261202);
    for (int64_t divisor = 1; divisor <= 4096; ++divisor) expect_divides(divisor, rng);
    for (int bit = 12; bit <= 30; ++bit) {
        for (int64_t delta = -1; delta <= 1; ++delta) expect_divides((int64_t{1} << bit) + delta, rng);
    }
    expect_divides((int64_t{1} << 31) - 1, rng);
    std::uniform_int_distribution<int64_t> any_divisor(1, (int64_t{1} << 31) - 1);
    for (int i = 0; i < 2000; ++i) expect_divides(any_divisor(rng), rng);
}

}  // namespace
}  // namespace megamoe
