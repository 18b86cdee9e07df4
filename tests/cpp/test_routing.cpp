// The routing metadata kernels (portable/routing.h) on their own, so a wrong sort names itself: expert_offsets,
// m_tile_offsets, sorted_slot, slot_to_row and token_invalid, bitwise against a CPU stable counting sort of the same
// ids (dropped slots, invalid ids, empty experts, one expert taking every slot, more experts than slots, topk = 1,
// T = 1, sizes off every chunk multiple). The device buffers are poisoned first, so an unwritten element shows.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "portable/grouped_gemm.h"
#include "portable/routing.h"
#include "cuda_test_util.h"

namespace megamoe::test {
namespace {

struct RoutingCase {
    const char* name;
    int64_t num_tokens, num_experts, topk;
    double drop_fraction;     // slots set to -1
    double invalid_fraction;  // slots set outside [-1, E)
    bool one_expert;          // every valid slot goes to expert 0
};

void PrintTo(const RoutingCase& c, std::ostream* os) {
    *os << c.name << " T=" << c.num_tokens << " E=" << c.num_experts << " topk=" << c.topk;
}

// What the device must produce, by a plain stable counting sort over slots in order.
struct ExpectedRouting {
    std::vector<int> expert_offsets, m_tile_offsets, sorted_slot, slot_to_row, token_invalid;
};

ExpectedRouting cpu_routing(const std::vector<int64_t>& ids, int64_t num_tokens, int64_t num_experts, int64_t topk,
                            int64_t block_m) {
    ExpectedRouting want;
    want.expert_offsets.assign(num_experts + 1, 0);
    want.token_invalid.assign(num_tokens, 0);
    want.slot_to_row.assign(ids.size(), -1);
    for (size_t slot = 0; slot < ids.size(); ++slot) {
        if (ids[slot] >= 0 && ids[slot] < num_experts) {
            ++want.expert_offsets[ids[slot] + 1];
        } else if (ids[slot] != -1) {
            want.token_invalid[slot / topk] = 1;
        }
    }
    want.m_tile_offsets.assign(num_experts + 1, 0);
    for (int64_t e = 0; e < num_experts; ++e) {
        const int rows = want.expert_offsets[e + 1];
        want.m_tile_offsets[e + 1] = want.m_tile_offsets[e] + static_cast<int>((rows + block_m - 1) / block_m);
        want.expert_offsets[e + 1] += want.expert_offsets[e];
    }
    std::vector<int> next_row(want.expert_offsets.begin(), want.expert_offsets.end() - 1);
    want.sorted_slot.assign(want.expert_offsets[num_experts], 0);
    for (size_t slot = 0; slot < ids.size(); ++slot) {
        if (ids[slot] < 0 || ids[slot] >= num_experts) continue;
        const int row = next_row[ids[slot]]++;
        want.sorted_slot[row] = static_cast<int>(slot);
        want.slot_to_row[slot] = row;
    }
    return want;
}

std::vector<int> download_ints(const int* device, int64_t count) {
    std::vector<int> host(static_cast<size_t>(count));
    if (count > 0) {
        expect_cuda(cudaMemcpy(host.data(), device, host.size() * sizeof(int), cudaMemcpyDeviceToHost), "download");
    }
    return host;
}

void check_routing(const RoutingCase& c, megamoe_dtype_t id_dtype, std::mt19937_64& rng) {
    SCOPED_TRACE(::testing::PrintToString(c));
    const int64_t num_slots = c.num_tokens * c.topk;
    std::vector<int64_t> ids(static_cast<size_t>(num_slots));
    std::uniform_int_distribution<int64_t> expert(0, c.num_experts - 1);
    std::uniform_real_distribution<double> unit(0.0, 1.0);
    for (int64_t& id : ids) {
        id = c.one_expert ? 0 : expert(rng);
        const double draw = unit(rng);
        if (draw < c.drop_fraction) {
            id = -1;
        } else if (draw < c.drop_fraction + c.invalid_fraction) {
            id = draw < c.drop_fraction + c.invalid_fraction / 2 ? c.num_experts : -2;
        }
    }
    HostTensor ids_host(id_dtype, {c.num_tokens, c.topk});
    for (int64_t slot = 0; slot < num_slots; ++slot) ids_host.set(slot, static_cast<double>(ids[slot]));
    const DeviceTensor ids_device = DeviceTensor::upload(ids_host);

    Shape shape{};
    shape.num_tokens = c.num_tokens;
    shape.topk = c.topk;
    shape.num_experts = c.num_experts;
    const cuda::RoutingPlan plan = cuda::RoutingPlan::make(shape, cuda::kGemmBlockM, false);
    cuda::WorkspaceCarver sizer(nullptr);
    cuda::RoutingBuffers::carve(sizer, plan);
    DeviceTensor workspace = device_workspace(sizer.bytes_used());  // poisoned
    cuda::WorkspaceCarver carver(workspace.view().data);
    const cuda::RoutingBuffers buffers = cuda::RoutingBuffers::carve(carver, plan);
    ASSERT_EQ(cuda::launch_routing(ids_device.view().data, id_dtype, plan, buffers, nullptr), MEGAMOE_STATUS_SUCCESS)
        << megamoe_last_error();
    expect_cuda(cudaDeviceSynchronize(), "routing");

    const ExpectedRouting want = cpu_routing(ids, c.num_tokens, c.num_experts, c.topk, cuda::kGemmBlockM);
    EXPECT_EQ(download_ints(buffers.expert_offsets, c.num_experts + 1), want.expert_offsets) << "expert_offsets";
    EXPECT_EQ(download_ints(buffers.m_tile_offsets, c.num_experts + 1), want.m_tile_offsets) << "m_tile_offsets";
    EXPECT_LE(want.m_tile_offsets[c.num_experts], plan.max_m_tiles) << "the host's bound on the M tiles";
    EXPECT_EQ(download_ints(buffers.sorted_slot, want.expert_offsets[c.num_experts]), want.sorted_slot)
        << "sorted_slot";
    EXPECT_EQ(download_ints(buffers.slot_to_row, num_slots), want.slot_to_row) << "slot_to_row";
    EXPECT_EQ(download_ints(buffers.token_invalid, c.num_tokens), want.token_invalid) << "token_invalid";
}

TEST(Routing, MatchesCpuStableCountingSortBitwise) {
    SKIP_WITHOUT_CUDA();
    std::mt19937_64 rng(fresh_seed());
    const RoutingCase cases[] = {
        {"balanced, chunks off every multiple", 1531, 24, 4, 0.0, 0.0, false},
        {"dropped and invalid ids", 777, 16, 3, 0.2, 0.05, false},
        {"one expert takes every slot", 1000, 32, 2, 0.1, 0.0, true},
        {"more experts than slots", 5, 300, 2, 0.0, 0.0, false},
        {"topk 1", 4099, 7, 1, 0.1, 0.0, false},
        {"one token", 1, 8, 8, 0.25, 0.0, false},
        {"every slot dropped", 64, 4, 2, 1.0, 0.0, false},
        {"many slots", 16384, 128, 8, 0.01, 0.0, false},
    };
    for (const RoutingCase& c : cases) {
        check_routing(c, MEGAMOE_DTYPE_I32, rng);
        check_routing(c, MEGAMOE_DTYPE_I64, rng);
    }
}

}  // namespace
}  // namespace megamoe::test
