// The row kernels of src/portable/elementwise.h on their own, against host loops. Without a GPU every test skips.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cuda_test_util.h"
#include "portable/elementwise.h"

namespace megamoe::test {
namespace {

// sort_rows: every token's row lands, bit for bit, on the sorted rows of its slots (a permutation of the routed slots,
// dropped slots -1, a token with every slot dropped, topk = 1 and widths of one to many 16-byte chunks per thread);
// sorted rows no slot names keep the poison.
TEST(RowKernels, SortRowsTokenMajor) {
    SKIP_WITHOUT_CUDA();
    std::mt19937_64 rng(fresh_seed());
    struct Case {
        int64_t num_tokens, topk, num_cols;
    };
    for (const Case c : {Case{1, 1, 8}, Case{37, 3, 40}, Case{200, 8, 2048}, Case{5, 2, 7168}}) {
        SCOPED_TRACE(::testing::Message() << "T=" << c.num_tokens << " topk=" << c.topk << " cols=" << c.num_cols);
        const int64_t num_slots = c.num_tokens * c.topk;
        HostTensor rows(MEGAMOE_DTYPE_BF16, {c.num_tokens, c.num_cols});
        rows.fill_random(rng, 1.0);
        std::vector<int> perm(static_cast<size_t>(num_slots));
        std::iota(perm.begin(), perm.end(), 0);
        std::shuffle(perm.begin(), perm.end(), rng);
        HostTensor slot_to_row(MEGAMOE_DTYPE_I32, {num_slots});
        for (int64_t slot = 0; slot < num_slots; ++slot) {
            const bool dropped = slot % 5 == 1 || slot / c.topk == c.num_tokens - 1;  // the last token: all dropped
            slot_to_row.set(slot, dropped && c.num_tokens > 1 ? -1 : perm[static_cast<size_t>(slot)]);
        }
        const DeviceTensor rows_dev = DeviceTensor::upload(rows);
        const DeviceTensor slot_to_row_dev = DeviceTensor::upload(slot_to_row);
        DeviceTensor out_dev(HostTensor(MEGAMOE_DTYPE_BF16, {num_slots, c.num_cols}).view);
        out_dev.poison();
        cuda::SortRowsArgs args{};
        args.rows = rows_dev.view().data;
        args.num_tokens = c.num_tokens;
        args.num_cols = c.num_cols;
        args.slot_to_row = static_cast<const int*>(slot_to_row_dev.view().data);
        args.topk = c.topk;
        args.out = out_dev.view().data;
        ASSERT_EQ(cuda::launch_sort_rows(args, nullptr), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
        expect_cuda(cudaDeviceSynchronize(), "sort_rows");
        const HostTensor got = out_dev.download();
        const size_t row_bytes = static_cast<size_t>(c.num_cols) * sizeof(uint16_t);
        std::vector<bool> written(static_cast<size_t>(num_slots), false);
        for (int64_t slot = 0; slot < num_slots; ++slot) {
            const int row_idx = static_cast<int>(slot_to_row.get(slot));
            if (row_idx < 0) continue;
            written[static_cast<size_t>(row_idx)] = true;
            EXPECT_EQ(std::memcmp(got.bytes.data() + row_idx * row_bytes,
                                  rows.bytes.data() + (slot / c.topk) * row_bytes, row_bytes),
                      0)
                << "sorted row " << row_idx << " (slot " << slot << ")";
        }
        const std::vector<unsigned char> poison(row_bytes, 0xFF);
        for (int64_t row_idx = 0; row_idx < num_slots; ++row_idx) {
            if (written[static_cast<size_t>(row_idx)]) continue;
            EXPECT_EQ(std::memcmp(got.bytes.data() + row_idx * row_bytes, poison.data(), row_bytes), 0)
                << "sorted row " << row_idx << " is no slot's but was written";
        }
    }
}

// sort_rows refuses rows that are not whole 16-byte chunks, with a message naming the kernel.
TEST(RowKernels, SortRowsRefusesPartialChunks) {
    cuda::SortRowsArgs args{};
    alignas(16) static uint16_t storage[16];
    args.rows = storage;
    args.out = storage;
    args.num_tokens = 1;
    args.num_cols = 12;
    args.topk = 1;
    EXPECT_EQ(cuda::launch_sort_rows(args, nullptr), MEGAMOE_STATUS_INTERNAL_ERROR);
    EXPECT_NE(std::string(megamoe_last_error()).find("sort_rows"), std::string::npos) << megamoe_last_error();
}

}  // namespace
}  // namespace megamoe::test
