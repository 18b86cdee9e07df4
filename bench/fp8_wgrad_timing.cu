// Times the blockwise FP8 K-grouped GEMM of the weight gradients (sm90/k_grouped_fp8_gemm_sm90.h) against the bf16
// K-grouped kernel (sm90/k_grouped_gemm_sm90.h) at balanced routing (each expert gets T * topk / E rows) on the
// reference shapes:
//   dw13  C_e [2I, H] = dh^T x: bf16 (A = dh [rows, 2I] by TMA, B = x [T, H] gathered by slot) against FP8 (both
//         quantized along the tokens by launch_quantize_expert_rows into the tile-padded transposed layout)
//   dw2   C_e [H, I] = dy^T (s a): bf16 (A = dy [T, H] gathered, B = s a [rows, I]) against FP8
// each into the weights' dtype (bf16) and accumulated into f32 main_grads; FP8 as the GEMM alone (`fp8`; `fp8-pair`: in
// CTA pairs sharing A by multicast, MEGAMOE_SM90_FP8_WGRAD_PAIR=1) and with the two quantization passes it needs
// (`fp8+q`). CUDA events around each launch on the default stream, 3 warm-up
// launches, the median of 10; FLOPs 2 rows M N. Operands random (bf16 uniform in [-1/16, 1/16)). Usage:
//   megamoe_fp8_wgrad_timing [shape name]     (all shapes without one)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#include "device/grouped_gemm_args.h"
#include "fp8_timing_util.cuh"
#include "portable/fp8_quant.h"
#include "sm90/k_grouped_fp8_gemm_sm90.h"
#include "sm90/k_grouped_gemm_sm90.h"

namespace {

using namespace megamoe_bench;  // NOLINT(google-build-using-namespace): the timing helpers
using megamoe::cuda::KGroupedGemmArgs;
namespace sm90 = megamoe::sm90;

// Quantized columns in the tile-padded layout: q_t [cols, ld], scales [tiles, ld_scales].
struct QuantizedCols {
    Buffer q, scales;
    int64_t cols = 0, ld = 0, ld_scales = 0;
    bool alloc(int64_t num_cols, int64_t max_tiles, const char* what) {
        cols = num_cols;
        ld = 128 * max_tiles;
        ld_scales = (num_cols + 3) / 4 * 4;
        return q.alloc(static_cast<size_t>(cols * ld), what) &&
               scales.alloc(static_cast<size_t>(max_tiles * ld_scales * 4), what);
    }
    sm90::KGroupedFp8Operand operand() const { return {q.as<uint8_t>(), ld, scales.as<float>(), ld_scales}; }
};

// The bf16 weight gradient `args` in FP8: its operands' quantization and the FP8 GEMM.
struct Fp8WeightGrad {
    const KGroupedGemmArgs* args;
    const int* m_tile_offsets;
    int64_t max_tiles;
    QuantizedCols* a;
    QuantizedCols* b;

    megamoe_status_t quantize() const {
        megamoe_status_t status = quantize_one(args->a, args->lda, args->a_gather_slots, args->m, *a);
        return status != MEGAMOE_STATUS_SUCCESS ? status
                                                : quantize_one(args->b, args->ldb, args->b_gather_slots, args->n, *b);
    }
    megamoe_status_t quantize_one(const void* in, int64_t ld, const int* slots, int64_t cols,
                                  const QuantizedCols& out) const {
        megamoe::cuda::QuantizeExpertRowsArgs q{};
        q.in = in;
        q.in_dtype = MEGAMOE_DTYPE_BF16;
        q.cols = cols;
        q.in_row_stride = ld;
        q.sorted_slot = slots;
        q.topk = args->topk;
        q.expert_offsets = args->expert_offsets;
        q.m_tile_offsets = m_tile_offsets;
        q.num_experts = args->num_experts;
        q.max_tiles = max_tiles;
        q.q_t = out.q.as<uint8_t>();
        q.ld_q = out.ld;
        q.scales = out.scales.as<float>();
        q.ld_scales = out.ld_scales;
        return megamoe::cuda::launch_quantize_expert_rows(q, nullptr);
    }
    sm90::KGroupedFp8GemmArgs gemm_args(bool accumulate) const {
        sm90::KGroupedFp8GemmArgs g{};
        g.a = a->operand();
        g.b = b->operand();
        g.m = args->m;
        g.n = args->n;
        g.m_tile_offsets = m_tile_offsets;
        g.num_experts = args->num_experts;
        g.max_tiles = max_tiles;
        g.accumulate = accumulate;
        return g;
    }
};

bool run_shape(const Shape& s, int num_sms) {
    const int64_t T = s.tokens, H = s.hidden, I = s.inter, E = s.experts, rows = T * s.topk;
    BalancedRouting routing;
    if (!routing.make(s)) return false;
    const int64_t max_tiles = routing.max_tiles;
    const int64_t out_elems = E * std::max(2 * I * H, H * I);
    Buffer schedule, x, dy, dh, sa, out16, out32;
    QuantizedCols qa, qb;
    const bool allocated =
        schedule.alloc(static_cast<size_t>(megamoe::cuda::k_grouped_schedule_ints(E)) * 4, "schedule") &&
        x.alloc(T * H * 2, "x") && dy.alloc(T * H * 2, "dy") && dh.alloc(rows * 2 * I * 2, "dh") &&
        sa.alloc(rows * I * 2, "s a") && out16.alloc(out_elems * 2, "bf16 out") &&
        out32.alloc(out_elems * 4, "f32 out") && qa.alloc(std::max(2 * I, H), max_tiles, "A quantized") &&
        qb.alloc(std::max(I, H), max_tiles, "B quantized");
    if (!allocated) return false;
    uint64_t seed = 11;
    for (const auto& [buffer, count] :
         {std::pair<const Buffer*, int64_t>{&x, T * H}, {&dy, T * H}, {&dh, rows * 2 * I}, {&sa, rows * I}}) {
        fill<<<1024, 256>>>(buffer->as<void>(), count, kBf16, seed++);
    }
    CHECK_CUDA(cudaMemset(out32.as<void>(), 0, static_cast<size_t>(out_elems * 4)));
    CHECK_CUDA(cudaGetLastError());
    CHECK_CUDA(cudaDeviceSynchronize());

    KGroupedGemmArgs dw13{};
    dw13.dtype = MEGAMOE_DTYPE_BF16;
    dw13.a = dh.as<void>();
    dw13.lda = 2 * I;
    dw13.b = x.as<void>();
    dw13.ldb = H;
    dw13.b_gather_slots = routing.slots.as<int>();
    dw13.topk = s.topk;
    dw13.m = 2 * I;
    dw13.n = H;
    dw13.expert_offsets = routing.offsets.as<int>();
    dw13.num_experts = E;
    dw13.schedule = schedule.as<int>();
    KGroupedGemmArgs dw2 = dw13;
    dw2.a = dy.as<void>();
    dw2.lda = H;
    dw2.a_gather_slots = routing.slots.as<int>();
    dw2.b = sa.as<void>();
    dw2.ldb = I;
    dw2.b_gather_slots = nullptr;
    dw2.m = H;
    dw2.n = I;

    ShapeReport report{s.name};
    for (const auto& [name, args] : {std::pair<const char*, KGroupedGemmArgs*>{"dw13", &dw13}, {"dw2", &dw2}}) {
        const Fp8WeightGrad fp8{args, routing.tiles.as<int>(), max_tiles, &qa, &qb};
        const double flops = 2.0 * rows * args->m * args->n;
        for (const bool accumulate : {false, true}) {
            char gemm[32];
            std::snprintf(gemm, sizeof(gemm), "%s %s", name, accumulate ? "acc" : "bf16");
            KGroupedGemmArgs bf16 = *args;
            bf16.accumulate = accumulate;
            void* out = accumulate ? out32.as<void>() : out16.as<void>();
            const megamoe_dtype_t out_dtype = accumulate ? MEGAMOE_DTYPE_F32 : MEGAMOE_DTYPE_BF16;
            report.time(gemm, "bf16", sm90::k_grouped_gemm_sm90_supported(bf16, out), flops,
                        [&] { return sm90::launch_k_grouped_gemm_sm90(bf16, out, out_dtype, num_sms, nullptr); });
            if (fp8.quantize() != MEGAMOE_STATUS_SUCCESS || cudaDeviceSynchronize() != cudaSuccess) {
                std::fprintf(stderr, "%s: quantization failed: %s\n", name, megamoe_last_error());
                return false;
            }
            const sm90::KGroupedFp8GemmArgs fp8_args = fp8.gemm_args(accumulate);
            const bool fp8_ok = sm90::k_grouped_fp8_gemm_sm90_supported(fp8_args, out, out_dtype);
            const auto fp8_gemm = [&] {
                return sm90::launch_k_grouped_fp8_gemm_sm90(fp8_args, out, out_dtype, num_sms, nullptr);
            };
            report.time(gemm, "fp8", fp8_ok, flops, fp8_gemm);
            setenv("MEGAMOE_SM90_FP8_WGRAD_PAIR", "1", 1);  // CTA pairs sharing A by multicast
            report.time(gemm, "fp8-pair", fp8_ok, flops, fp8_gemm);
            unsetenv("MEGAMOE_SM90_FP8_WGRAD_PAIR");
            report.time(gemm, "fp8+q", fp8_ok, flops, [&] {
                const megamoe_status_t status = fp8.quantize();
                return status != MEGAMOE_STATUS_SUCCESS
                           ? status
                           : sm90::launch_k_grouped_fp8_gemm_sm90(fp8_args, out, out_dtype, num_sms, nullptr);
            });
        }
    }
    return report.all_ok;
}

}  // namespace

int main(int argc, char** argv) {
    return run_all(argc > 1 ? argv[1] : nullptr, run_shape) ? 0 : 1;
}
