// Times the blockwise FP8 M-grouped GEMMs (sm90/m_grouped_fp8_gemm_sm90.h) against their bf16 siblings
// (sm90/m_grouped_gemm_sm90.h) at balanced routing (each expert gets T * topk / E rows) on the reference shapes:
//   up    launch_m_grouped_gemm_sm90_gated (A = x [T, H] gathered by slot, B = w13 [E, 2I, H]) against the FP8 gated
//   down  launch_m_grouped_gemm_sm90_store (A = a [rows, I], the sorted rows, B = w2 [E, H, I]) against the FP8 store
//   dh    launch_m_grouped_gemm_sm90_dswiglu (A = dy [T, H] gathered, B = w2 read [K = H, N = I]) against the FP8 one
//         (B = w2's transposed copy [E, I, H], its scales read transposed), both with the dSwiGLU epilogue
//   chain the forward's GEMM chain, bf16 up + down against quantize x (1 x 128 groups) + FP8 up + quantize a + FP8 down
//         (fp8: a quantized by a pass of its own; fp8-fused: by the up GEMM's epilogue, a not stored in bf16; routing
//         and combine left out)
// CUDA events around each launch on the default stream, 3 warm-up launches, the median of 10; FLOPs 2 rows N K (the up
// GEMM's N = 2I). Operands are random (e4m3 bytes masked with 0x77: finite, no NaN), the FP8 scales 1. Usage:
//   megamoe_fp8_gemm_timing [shape name]     (all shapes without one)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <utility>
#include <vector>

#include "device/grouped_gemm_args.h"
#include "fp8_timing_util.cuh"
#include "portable/fp8_quant.h"
#include "sm90/m_grouped_fp8_gemm_sm90.h"
#include "sm90/m_grouped_gemm_sm90.h"

namespace {

using namespace megamoe_bench;  // NOLINT(google-build-using-namespace): the timing helpers
using megamoe::cuda::MGroupedGemmArgs;
namespace sm90 = megamoe::sm90;

bool run_shape(const Shape& s, int num_sms) {
    const int64_t T = s.tokens, H = s.hidden, I = s.inter, E = s.experts, rows = T * s.topk;
    BalancedRouting routing;
    if (!routing.make(s)) return false;
    const int64_t max_tiles = routing.max_tiles;
    const int64_t kg_h = H / 128, kg_i = I / 128;
    Buffer x, w13, w2, act_in, h, act, out;
    Buffer x8, w13_8, w2_8, act8, sx, sw13, sw2, sact, dh, ds_parts, weights;
    const bool allocated =
        x.alloc(T * H * 2, "x") && w13.alloc(E * 2 * I * H * 2, "w13") && w2.alloc(E * H * I * 2, "w2") &&
        act_in.alloc(rows * I * 2, "a") && h.alloc(rows * 2 * I * 2, "h") && act.alloc(rows * I * 2, "act") &&
        out.alloc(rows * H * 2, "out") && x8.alloc(T * H, "x8") && w13_8.alloc(E * 2 * I * H, "w13_8") &&
        w2_8.alloc(E * H * I, "w2_8") && act8.alloc(rows * I, "a8") && sx.alloc(T * kg_h * 4, "x scales") &&
        sw13.alloc(E * (2 * I / 128) * kg_h * 4, "w13 scales") && sw2.alloc(E * (H / 128) * kg_i * 4, "w2 scales") &&
        sact.alloc(rows * kg_i * 4, "a scales") && dh.alloc(rows * 2 * I * 2, "dh") &&
        ds_parts.alloc(rows * ((I + 255) / 256) * 4, "ds parts") && weights.alloc(rows * 4, "topk weights");
    if (!allocated) return false;
    const std::pair<const Buffer*, int64_t> bf16s[] = {
        {&x, T * H}, {&w13, E * 2 * I * H}, {&w2, E * H * I}, {&act_in, rows * I}};
    const std::pair<const Buffer*, int64_t> e4m3s[] = {
        {&x8, T * H}, {&w13_8, E * 2 * I * H}, {&w2_8, E * H * I}, {&act8, rows * I}};
    const std::pair<const Buffer*, int64_t> ones[] = {{&sx, T * kg_h},
                                                      {&sw13, E * (2 * I / 128) * kg_h},
                                                      {&sw2, E * (H / 128) * kg_i},
                                                      {&sact, rows * kg_i},
                                                      {&weights, rows}};
    uint64_t seed = 1;
    for (const auto& [buffer, count] : bf16s) fill<<<1024, 256>>>(buffer->as<void>(), count, kBf16, seed++);
    for (const auto& [buffer, count] : e4m3s) fill<<<1024, 256>>>(buffer->as<void>(), count, kE4m3, seed++);
    for (const auto& [buffer, count] : ones) fill<<<1024, 256>>>(buffer->as<void>(), count, kOnes, 0);
    CHECK_CUDA(cudaGetLastError());
    CHECK_CUDA(cudaDeviceSynchronize());

    MGroupedGemmArgs up{};
    up.dtype = MEGAMOE_DTYPE_BF16;
    up.a = x.as<void>();
    up.lda = H;
    up.a_gather_slots = routing.slots.as<int>();
    up.num_a_rows = T;
    up.topk = s.topk;
    up.b = w13.as<void>();
    up.b_expert_stride = 2 * I * H;
    up.ldb = H;
    up.n = I;
    up.k = H;
    up.expert_offsets = routing.offsets.as<int>();
    up.m_tile_offsets = routing.tiles.as<int>();
    up.num_experts = E;
    up.max_m_tiles = max_tiles;
    MGroupedGemmArgs up8 = up;
    up8.a = x8.as<void>();
    up8.b = w13_8.as<void>();
    const sm90::Fp8BlockScales up_scales{sx.as<float>(), kg_h, sw13.as<float>()};

    MGroupedGemmArgs down = up;
    down.a = act_in.as<void>();
    down.lda = I;
    down.a_gather_slots = nullptr;
    down.num_a_rows = rows;
    down.topk = 1;
    down.b = w2.as<void>();
    down.b_expert_stride = H * I;
    down.ldb = I;
    down.n = H;
    down.k = I;
    MGroupedGemmArgs down8 = down;
    down8.a = act8.as<void>();
    down8.b = w2_8.as<void>();
    const sm90::Fp8BlockScales down_scales{sact.as<float>(), kg_i, sw2.as<float>()};

    // dH: p = dy w2[e] (K = H, N = I); dy is x's buffer (bf16) and x8's (e4m3), w2's transposed FP8 copy w2_8's.
    MGroupedGemmArgs dh_args = up;
    dh_args.b = w2.as<void>();
    dh_args.b_expert_stride = H * I;
    dh_args.ldb = I;  // [K = H, N = I], N contiguous (kKN)
    dh_args.n = I;
    dh_args.k = H;
    MGroupedGemmArgs dh_args8 = dh_args;
    dh_args8.a = x8.as<void>();
    dh_args8.b = w2_8.as<void>();
    dh_args8.ldb = H;  // the transposed copy [N = I, K = H], K contiguous (kNK)
    sm90::Fp8BlockScales dh_scales{sx.as<float>(), kg_h, sw2.as<float>()};
    dh_scales.b_transposed = true;
    sm90::DSwiGLUEpilogueArgs dswiglu{};
    dswiglu.h = h.as<void>();
    dswiglu.dh = dh.as<void>();
    dswiglu.act = act.as<void>();
    dswiglu.ds_parts = ds_parts.as<float>();
    dswiglu.weights = weights.as<void>();
    dswiglu.weights_dtype = MEGAMOE_DTYPE_F32;
    dswiglu.b_layout = megamoe::cuda::BLayout::kKN;
    int64_t num_ds_parts = 0;

    const double up_flops = 2.0 * rows * 2 * I * H, down_flops = 2.0 * rows * H * I;
    ShapeReport report{s.name};
    report.time("up", "bf16", sm90::m_grouped_gemm_sm90_supported(up, true), up_flops, [&] {
        return sm90::launch_m_grouped_gemm_sm90_gated(up, h.as<void>(), act.as<void>(), num_sms, nullptr);
    });
    report.time("up", "fp8", sm90::m_grouped_fp8_gemm_sm90_supported(up8, up_scales, true), up_flops, [&] {
        return sm90::launch_m_grouped_fp8_gemm_sm90_gated(up8, up_scales, h.as<void>(), act.as<void>(), num_sms,
                                                          nullptr);
    });
    report.time("down", "bf16", sm90::m_grouped_gemm_sm90_supported(down, false), down_flops, [&] {
        return sm90::launch_m_grouped_gemm_sm90_store(down, megamoe::cuda::BLayout::kNK, out.as<void>(), H, rows,
                                                      num_sms, nullptr);
    });
    report.time("down", "fp8", sm90::m_grouped_fp8_gemm_sm90_supported(down8, down_scales, false), down_flops, [&] {
        return sm90::launch_m_grouped_fp8_gemm_sm90_store(down8, down_scales, out.as<void>(), H, rows, num_sms,
                                                          nullptr);
    });
    report.time(
        "dh", "bf16", sm90::m_grouped_gemm_sm90_supported(dh_args, false, megamoe::cuda::BLayout::kKN), down_flops,
        [&] { return sm90::launch_m_grouped_gemm_sm90_dswiglu(dh_args, dswiglu, num_sms, nullptr, &num_ds_parts); });
    report.time("dh", "fp8", sm90::m_grouped_fp8_gemm_sm90_supported(dh_args8, dh_scales, false), down_flops, [&] {
        return sm90::launch_m_grouped_fp8_gemm_sm90_dswiglu(dh_args8, dh_scales, dswiglu, num_sms, nullptr,
                                                            &num_ds_parts);
    });
    const auto quantize = [](const void* in, int64_t num_rows, int64_t cols, uint8_t* q, float* scales) {
        megamoe::cuda::QuantizeGroupsArgs args{};
        args.in = in;
        args.in_dtype = MEGAMOE_DTYPE_BF16;
        args.rows = num_rows;
        args.cols = cols;
        args.in_row_stride = cols;
        args.q = q;
        args.scales = scales;
        return megamoe::cuda::launch_quantize_groups(args, nullptr);
    };
    report.time("chain", "bf16", true, up_flops + down_flops, [&] {
        const megamoe_status_t status =
            sm90::launch_m_grouped_gemm_sm90_gated(up, h.as<void>(), act.as<void>(), num_sms, nullptr);
        return status != MEGAMOE_STATUS_SUCCESS
                   ? status
                   : sm90::launch_m_grouped_gemm_sm90_store(down, megamoe::cuda::BLayout::kNK, out.as<void>(), H, rows,
                                                            num_sms, nullptr);
    });
    report.time("chain", "fp8", true, up_flops + down_flops, [&] {
        megamoe_status_t status = quantize(x.as<void>(), T, H, x8.as<uint8_t>(), sx.as<float>());
        if (status == MEGAMOE_STATUS_SUCCESS) {
            status = sm90::launch_m_grouped_fp8_gemm_sm90_gated(up8, up_scales, h.as<void>(), act.as<void>(), num_sms,
                                                                nullptr);
        }
        if (status == MEGAMOE_STATUS_SUCCESS) {
            status = quantize(act.as<void>(), rows, I, act8.as<uint8_t>(), sact.as<float>());
        }
        return status != MEGAMOE_STATUS_SUCCESS ? status
                                                : sm90::launch_m_grouped_fp8_gemm_sm90_store(
                                                      down8, down_scales, out.as<void>(), H, rows, num_sms, nullptr);
    });
    const sm90::Fp8QuantizedAct act_quantized{act8.as<uint8_t>(), sact.as<float>(), false};
    report.time("chain", "fp8-fused", true, up_flops + down_flops, [&] {
        megamoe_status_t status = quantize(x.as<void>(), T, H, x8.as<uint8_t>(), sx.as<float>());
        if (status == MEGAMOE_STATUS_SUCCESS) {
            status = sm90::launch_m_grouped_fp8_gemm_sm90_gated(up8, up_scales, h.as<void>(), nullptr, num_sms, nullptr,
                                                                &act_quantized);
        }
        return status != MEGAMOE_STATUS_SUCCESS ? status
                                                : sm90::launch_m_grouped_fp8_gemm_sm90_store(
                                                      down8, down_scales, out.as<void>(), H, rows, num_sms, nullptr);
    });
    return report.all_ok;
}

}  // namespace

int main(int argc, char** argv) {
    return run_all(argc > 1 ? argv[1] : nullptr, run_shape) ? 0 : 1;
}
