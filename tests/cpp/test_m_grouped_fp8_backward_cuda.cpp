// The blockwise FP8 data gradients on Hopper (sm90/m_grouped_fp8_gemm_sm90.h), B the weights' transposed FP8 copies
// (launch_quantize_blocks' q_t) with the weights' own block scales read transposed (Fp8BlockScales::b_transposed):
//   dX  launch_m_grouped_fp8_gemm_sm90_store: A = dh [rows, 2I] (sorted rows, 1 x 128 groups along 2I), B_e = q_t of
//       w13[e] [2I, H], so [N = H, K = 2I]; out [rows, H] against the f64 reference within the forward test's bound
//       u |want| + c S (fp8_test_util.h, c = 2^-9 per unit of the term sizes S).
//   dH  launch_m_grouped_fp8_gemm_sm90_dswiglu: A = dy [T, H] gathered by slot, B_e = q_t of w2[e] [H, I], so
//       [N = I, K = H]; p = the recipe's f64 product, s = topk_weights[slot] (1 without weights), a = act(g, u), and
//       (activation.h in f64: SwiGLU, or the clamped one) elementwise
//         dg = F_g p, du = F_u p (F: the backward at da = s)   |got - want| <= 2u |want| + c |F| S (+ x for dg) + f
//         act = s a                                            |got - want| <= 2u |want| + f
//         ds_parts[r, t] = sum over n-tile t (256 columns) p a |got - want| <= c sum |a| S + e sum |p a|
//       dh and ds are linear in p, so p's accumulation budget c S propagates times |F| and |a|. u: the output's
//       rounding (bf16 2^-8, f16 2^-11); the second u covers the factors' f32 evaluation (a few ulps) and rounding an
//       erroneous p; x = 2^-20 |s p| (|u| + 1) (1 + alpha |g|): dg's f32 cancellation in 1 + alpha g (1 - sig), which
//       crosses 0 (SwiGLU: g = -1.28); f = 2^-25 for f16 (its subnormals' rounding), 0 for bf16; act does not
//       depend on p. ds: f32 products summed in a fixed order, ~66 terms per partial (64 per lane, then the quad):
//       e = 2^-14 against 66 f32 ulps ~ 2^-18. Each output's relative Frobenius error is held below 1e-2 as well.
//       Ragged routings (one row, empty experts, dropped slots, topk 1 to 4, 64 experts, one expert taking every
//       slot), I = 128 / 256 / 384 (a partial last ds n-tile), H with a partial last K group, f32 / element-type / no
//       weights, bf16 and f16, SwiGLU (the FP8 layer runs no other activation, dh in the [dg, du] order: the launch
//       refuses the rest); *num_ds_parts = ceil(I / 256).
// Every output poisoned (NaN) before each run, two runs bitwise equal; dh written over h bitwise the plain dh. On the host: the reference's transposed scales against an explicitly transposed copy, and the dH
// bounds against mutants. The refusals (with a message) and all GPU tests need a compute capability 9.0 device and
// skip without one.
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <numeric>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "activation.h"
#include "common.h"
#include "cuda_test_util.h"
#include "fp8_test_util.h"
#include "sm90/m_grouped_fp8_gemm_sm90.h"

namespace megamoe::test {
namespace {

constexpr int64_t kDsTileCols = 256;              // the columns of I behind one ds partial sum (the tile's N)
constexpr double kDsSummation = 1.0 / 16384;      // e
constexpr double kF32Evaluation = 1.0 / 1048576;  // 2^-20: x's factor

int num_sms() {
    cudaDeviceProp prop{};
    expect_cuda(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
    return prop.multiProcessorCount;
}

// dX of one ragged case: K = 2I of the case, N = H = the case's K, A = dh by sorted row.
void check_dx(const Case& c, std::mt19937_64& rng) {
    Case dx = c;
    dx.k = 2 * c.inter;
    dx.n = c.k;
    dx.topk = dx.tokens = 0;
    SCOPED_TRACE(::testing::Message() << c.name << " (K = 2I " << dx.k << ", N = H " << dx.n << ", seed "
                                      << fresh_seed() << ")");
    std::cout << c.name << ", dX\n";
    const Prepared p = prepare(dx, rng);
    const int64_t rows = p.map.rows(), experts = p.map.experts();
    // w13 [E, 2I, H] in 128 x 128 blocks; B = its transposed copy [E, H, 2I].
    const Quantized w13 =
        quantize(varied_values(experts * dx.k, dx.n, kGroup, 1.0 / std::sqrt(static_cast<double>(dx.k)), rng), experts,
                 dx.k, dx.n, true, true);
    const cuda::MGroupedGemmArgs args =
        gemm_args(c.dtype, p.a.q.view().data, p.map.num_a_rows, nullptr, 1, w13.q.view().data, dx.n, dx.n, dx.k,
                  static_cast<const int*>(p.offsets.view().data), static_cast<const int*>(p.tiles.view().data), experts,
                  p.map.tiles.back() + c.tile_slack);
    const sm90::Fp8BlockScales scales{static_cast<const float*>(p.a.scales.view().data), ceil_div(dx.k, kGroup),
                                      static_cast<const float*>(w13.scales.view().data), true};
    ASSERT_TRUE(sm90::m_grouped_fp8_gemm_sm90_supported(args, scales, false));
    DeviceTensor out(HostTensor(c.dtype, {rows, dx.n}).view);
    const auto launch = [&] {
        return sm90::launch_m_grouped_fp8_gemm_sm90_store(args, scales, out.view().data, dx.n, rows, num_sms(),
                                                          nullptr);
    };
    const std::vector<HostTensor> first = run({&out}, launch);
    EXPECT_EQ(first[0].bytes, run({&out}, launch)[0].bytes) << "dx: two runs differ";
    expect_close(first[0], plain_target(reference(p.a.host, w13.host, p.map, dx.n, dx.k), c.dtype), dx.n, "dx");
}

TEST(Fp8BackwardSm90, DataGradientStoreWithTransposedScales) {
    SKIP_WITHOUT_SM90();
    std::mt19937_64 rng(fresh_seed() + 3);
    std::vector<Case> cases = ragged_cases(rng);
    cases.push_back({"2I = 208 (a partial last K group), H = 336", {3, 0, 250}, 336, 0, 104, 0, 0});
    for (const Case& c : cases) check_dx(c, rng);
}

// dH's expected outputs (bounds in the file's header) from p [rows, I], h [rows, 2I] ([g, u]) and each row's s.
struct DhTargets {
    Target dh, act, ds;  // [rows, 2I] ([dg, du]), [rows, I], [rows, ceil(I / 256)]
};

DhTargets dswiglu_targets(const Expected& p, const HostTensor& h, const std::vector<double>& s, int64_t inter,
                          const Activation<double>& activation, megamoe_dtype_t dtype) {
    const int64_t rows = static_cast<int64_t>(s.size()), parts = ceil_div(inter, kDsTileCols);
    const double u = rounding_of(dtype), floor = dtype == MEGAMOE_DTYPE_F16 ? std::ldexp(1.0, -25) : 0.0;
    const auto sized = [](int64_t n) {
        return Target{std::vector<double>(static_cast<size_t>(n)), std::vector<double>(static_cast<size_t>(n))};
    };
    DhTargets t{sized(rows * 2 * inter), sized(rows * inter), sized(rows * parts)};
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t i = 0; i < inter; ++i) {
            const size_t gi = static_cast<size_t>(r * 2 * inter + i), ui = gi + static_cast<size_t>(inter);
            const size_t pi = static_cast<size_t>(r * inter + i), di = static_cast<size_t>(r * parts + i / kDsTileCols);
            const double g = h.get(static_cast<int64_t>(gi)), up = h.get(static_cast<int64_t>(ui));
            const double pv = p.value[pi], size = p.size[pi], a = activation.forward(g, up);
            double factor[2];  // dg / p, du / p: the backward is linear in da = s p
            activation.backward(g, up, s[static_cast<size_t>(r)], &factor[0], &factor[1]);
            // dg's f32 cancellation in 1 + alpha g (1 - sig) (near g = -1.28 for SwiGLU), beside the factor itself.
            const double cancel = kF32Evaluation * std::fabs(s[static_cast<size_t>(r)] * pv) * (std::fabs(up) + 1.0) *
                                  (1.0 + std::fabs(g) * std::max(1.0, activation.alpha));
            for (const auto& [idx, f] : {std::pair{gi, factor[0]}, std::pair{ui, factor[1]}}) {
                t.dh.want[idx] = f * pv;
                t.dh.bound[idx] = 2.0 * u * std::fabs(f * pv) + kAccumulation * std::fabs(f) * size + floor;
            }
            t.dh.bound[gi] += cancel;
            t.act.want[pi] = s[static_cast<size_t>(r)] * a;
            t.act.bound[pi] = 2.0 * u * std::fabs(t.act.want[pi]) + floor;
            t.ds.want[di] += pv * a;
            t.ds.bound[di] += kAccumulation * std::fabs(a) * size + kDsSummation * std::fabs(pv * a);
        }
    }
    return t;
}

enum class Weights { kF32, kElement, kNone };  // topk_weights in f32, in the element type, or NULL (s = 1)

struct DhCase {
    Case c;  // K = H = c.k, I = c.inter (a multiple of 128), dy [c.tokens, H] gathered by slot (c.topk >= 1)
    Weights weights;
};

std::vector<DhCase> dh_cases(std::mt19937_64& rng) {
    std::vector<DhCase> cases = {
        {{"one row of one token, E = 1, topk 1", {1}, 128, 0, 128, 1, 1}, Weights::kF32},
        {{"rows 1 / 127 / 0 / 129 / 300, topk 4, dropped, I = 384", {1, 127, 0, 129, 300}, 208, 0, 384, 4, 200},
         Weights::kElement},
        {{"one expert takes every slot, topk 2, I = 256", {0, 0, 520, 0}, 336, 0, 256, 2, 260}, Weights::kNone},
        {{"64 experts, a quarter empty, topk 3", {}, 160, 0, 128, 3, 220}, Weights::kF32},
        {{"f16, topk 1, dropped slots, I = 384", {130, 5, 0}, 256, 0, 384, 1, 140, MEGAMOE_DTYPE_F16},
         Weights::kElement},
        {{"topk 2, I = 256, two experts", {77, 200}, 208, 0, 256, 2, 150}, Weights::kF32},
    };
    std::vector<int64_t> empty;
    for (int64_t e = 1; e < 64; e += 4) empty.push_back(e);
    for (const int64_t count : random_counts(64, 600, empty, rng)) cases[3].c.counts.push_back(static_cast<int>(count));
    cases[1].c.tile_slack = 3;  // max_m_tiles past the schedule's total
    return cases;
}

// The stored bits of a 16-bit tensor's element idx.
uint16_t bits_at(const HostTensor& t, int64_t idx) {
    uint16_t bits = 0;
    std::memcpy(&bits, t.bytes.data() + idx * 2, 2);
    return bits;
}

void check_dh(const DhCase& d, std::mt19937_64& rng) {
    const Case& c = d.c;
    SCOPED_TRACE(::testing::Message() << c.name << " (H " << c.k << ", I " << c.inter << ", seed " << fresh_seed()
                                      << ")");
    std::cout << c.name << ", dH\n";
    const Prepared p = prepare(c, rng);  // dy [tokens, H] in 1 x 128 groups along H, gathered by slot
    const int64_t rows = p.map.rows(), experts = p.map.experts(), inter = c.inter, hidden = c.k;
    const int64_t parts = ceil_div(inter, kDsTileCols);
    // w2 [E, H, I] in 128 x 128 blocks; B = its transposed copy [E, I, H].
    const Quantized w2 =
        quantize(varied_values(experts * hidden, inter, kGroup, 1.0 / std::sqrt(static_cast<double>(hidden)), rng),
                 experts, hidden, inter, true, true);
    const cuda::MGroupedGemmArgs args =
        gemm_args(c.dtype, p.a.q.view().data, p.map.num_a_rows, static_cast<const int*>(p.slots.view().data), c.topk,
                  w2.q.view().data, inter, inter, hidden, static_cast<const int*>(p.offsets.view().data),
                  static_cast<const int*>(p.tiles.view().data), experts, p.map.tiles.back() + c.tile_slack);
    const sm90::Fp8BlockScales scales{static_cast<const float*>(p.a.scales.view().data), ceil_div(hidden, kGroup),
                                      static_cast<const float*>(w2.scales.view().data), true};
    HostTensor h(c.dtype, {rows, 2 * inter});
    h.fill_random(rng, 1.0);
    HostTensor weights(d.weights == Weights::kF32 ? MEGAMOE_DTYPE_F32 : c.dtype, {c.tokens * c.topk});
    std::uniform_real_distribution<double> weight(0.1, 1.0);
    for (int64_t slot = 0; slot < weights.size(); ++slot) weights.set(slot, weight(rng));
    std::vector<double> s(static_cast<size_t>(rows), 1.0);
    if (d.weights != Weights::kNone) {
        for (int64_t r = 0; r < rows; ++r) s[static_cast<size_t>(r)] = weights.get(p.map.slots[static_cast<size_t>(r)]);
    }
    const DeviceTensor h_dev = DeviceTensor::upload(h), weights_dev = DeviceTensor::upload(weights);
    DeviceTensor dh(h.view), act(HostTensor(c.dtype, {rows, inter}).view);
    DeviceTensor ds(HostTensor(MEGAMOE_DTYPE_F32, {rows, ceil_div(inter, kGroup)}).view);  // room for 128-column parts
    const Activation<float> activation{MEGAMOE_ACTIVATION_SWIGLU, 0.0f, 0.0f};
    sm90::DSwiGLUEpilogueArgs epilogue{};
    epilogue.h = h_dev.view().data;
    epilogue.dh = dh.view().data;
    epilogue.act = act.view().data;
    epilogue.ds_parts = static_cast<float*>(ds.view().data);
    epilogue.weights = d.weights == Weights::kNone ? nullptr : weights_dev.view().data;
    epilogue.weights_dtype = weights.view.dtype;
    epilogue.activation = activation;
    epilogue.b_layout = cuda::BLayout::kNK;
    int64_t num_ds_parts = -1;
    const auto launch = [&](const sm90::DSwiGLUEpilogueArgs& e) {
        return [&, e] {
            return sm90::launch_m_grouped_fp8_gemm_sm90_dswiglu(args, scales, e, num_sms(), nullptr, &num_ds_parts);
        };
    };
    const std::vector<HostTensor> first = run({&dh, &act, &ds}, launch(epilogue));
    ASSERT_EQ(num_ds_parts, parts) << "*num_ds_parts: one per 256-column n-tile of I";
    const std::vector<HostTensor> second = run({&dh, &act, &ds}, launch(epilogue));
    const char* names[] = {"dh", "act", "ds_parts"};
    for (size_t i = 0; i < first.size(); ++i) EXPECT_EQ(first[i].bytes, second[i].bytes) << names[i] << ": 2 runs";

    const Activation<double> activation_f64{activation.kind, activation.limit, activation.alpha};
    const DhTargets want =
        dswiglu_targets(reference(p.a.host, w2.host, p.map, inter, hidden), h, s, inter, activation_f64, c.dtype);
    HostTensor ds_got(MEGAMOE_DTYPE_F32, {rows, parts});
    std::memcpy(ds_got.bytes.data(), first[2].bytes.data(), static_cast<size_t>(rows * parts) * sizeof(float));
    expect_close(first[0], want.dh, 2 * inter, "dh");
    expect_close(first[1], want.act, inter, "act");
    expect_close(ds_got, want.ds, parts, "ds_parts");

    // dh written over h: the same values, act and ds the same bitwise.
    const DeviceTensor h_in_place = DeviceTensor::upload(h);
    sm90::DSwiGLUEpilogueArgs in_place = epilogue;
    in_place.h = in_place.dh = h_in_place.view().data;
    const std::vector<HostTensor> over_h = run({&act, &ds}, launch(in_place));
    EXPECT_EQ(h_in_place.download().bytes, first[0].bytes) << "dh written over h differs";
    EXPECT_EQ(over_h[0].bytes, first[1].bytes) << "act differs with dh over h";
    EXPECT_EQ(over_h[1].bytes, first[2].bytes) << "ds_parts differ with dh over h";
}

TEST(Fp8BackwardSm90, DHiddenMatchesReference) {
    SKIP_WITHOUT_SM90();
    std::mt19937_64 rng(fresh_seed() + 4);
    for (const DhCase& d : dh_cases(rng)) check_dh(d, rng);
}

// The launch refuses, with a message, what it cannot take; the well-formed operands launch.
TEST(Fp8BackwardSm90, DHiddenRefusesWhatItCannotTake) {
    SKIP_WITHOUT_SM90();
    constexpr int64_t kHidden = 256, kInter = 256, kRows = 64, kExperts = 2;
    const DeviceTensor a(HostTensor(MEGAMOE_DTYPE_I32, {kRows * kHidden / 4}).view);
    const DeviceTensor b(HostTensor(MEGAMOE_DTYPE_I32, {kExperts * kInter * kHidden / 4}).view);
    const DeviceTensor sa(HostTensor(MEGAMOE_DTYPE_F32, {kRows * 2}).view),
        sb(HostTensor(MEGAMOE_DTYPE_F32, {kExperts * 4}).view);
    const DeviceTensor offsets = upload_ints({0, 40, kRows}), tiles = upload_ints({0, 1, 2});
    std::vector<int> slot_values(kRows);
    std::iota(slot_values.begin(), slot_values.end(), 0);
    const DeviceTensor slots = upload_ints(slot_values);
    DeviceTensor h(HostTensor(MEGAMOE_DTYPE_BF16, {kRows, 2 * kInter}).view), dh(h.view());
    DeviceTensor act(HostTensor(MEGAMOE_DTYPE_BF16, {kRows, kInter}).view);
    DeviceTensor ds(HostTensor(MEGAMOE_DTYPE_F32, {kRows, 2}).view);
    for (DeviceTensor* t : {&h, &dh, &act, &ds}) t->poison();
    const cuda::MGroupedGemmArgs good =
        gemm_args(MEGAMOE_DTYPE_BF16, a.view().data, kRows, static_cast<const int*>(slots.view().data), 1,
                  b.view().data, kInter, kInter, kHidden, static_cast<const int*>(offsets.view().data),
                  static_cast<const int*>(tiles.view().data), kExperts, 2);
    const sm90::Fp8BlockScales good_scales{static_cast<const float*>(sa.view().data), 2,
                                           static_cast<const float*>(sb.view().data), true};
    sm90::DSwiGLUEpilogueArgs good_epilogue{};
    good_epilogue.h = h.view().data;
    good_epilogue.dh = dh.view().data;
    good_epilogue.act = act.view().data;
    good_epilogue.ds_parts = static_cast<float*>(ds.view().data);
    good_epilogue.weights_dtype = MEGAMOE_DTYPE_F32;
    good_epilogue.activation = {MEGAMOE_ACTIVATION_SWIGLU, 0.0f, 0.0f};
    good_epilogue.b_layout = cuda::BLayout::kNK;
    int64_t parts = -1;
    const auto launch = [&](const cuda::MGroupedGemmArgs& args, const sm90::Fp8BlockScales& scales,
                            const sm90::DSwiGLUEpilogueArgs& epilogue) {
        clear_error();
        return sm90::launch_m_grouped_fp8_gemm_sm90_dswiglu(args, scales, epilogue, num_sms(), nullptr, &parts);
    };
    ASSERT_EQ(launch(good, good_scales, good_epilogue), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
    expect_cuda(cudaDeviceSynchronize(), "the well-formed dH");
    EXPECT_EQ(parts, 1);
    const auto expect_refused = [&](const cuda::MGroupedGemmArgs& args, const sm90::Fp8BlockScales& scales,
                                    const sm90::DSwiGLUEpilogueArgs& epilogue, const char* what) {
        EXPECT_NE(launch(args, scales, epilogue), MEGAMOE_STATUS_SUCCESS) << what;
        EXPECT_NE(std::string(megamoe_last_error()).find("m_grouped_fp8_gemm_sm90"), std::string::npos)
            << what << ": message \"" << megamoe_last_error() << "\"";
    };
    cuda::MGroupedGemmArgs args = good;
    args.k = 200;
    expect_refused(args, good_scales, good_epilogue, "H = 200: K % 16 != 0");
    args = good;
    args.n = 200;
    expect_refused(args, good_scales, good_epilogue, "I = 200: N % 16 != 0");
    args = good;
    args.dtype = MEGAMOE_DTYPE_F32;
    expect_refused(args, good_scales, good_epilogue, "f32 output");
    sm90::Fp8BlockScales scales = good_scales;
    scales.b = reinterpret_cast<const float*>(reinterpret_cast<const uint8_t*>(scales.b) + 2);
    expect_refused(good, scales, good_epilogue, "B scales 2 bytes past a 4-byte boundary");
    sm90::DSwiGLUEpilogueArgs epilogue = good_epilogue;
    epilogue.h = static_cast<const uint8_t*>(epilogue.h) + 8;
    expect_refused(good, good_scales, epilogue, "h 8 bytes past a 16-byte boundary");
    epilogue = good_epilogue;
    epilogue.act = static_cast<uint8_t*>(epilogue.act) + 8;
    expect_refused(good, good_scales, epilogue, "act 8 bytes past a 16-byte boundary");
    epilogue = good_epilogue;
    epilogue.dh_interleaved = true;
    expect_refused(good, good_scales, epilogue, "dh in the interleaved order (the FP8 layer is refused with it)");
    epilogue = good_epilogue;
    epilogue.activation = {MEGAMOE_ACTIVATION_CLAMPED_SWIGLU, 7.0f, 1.702f};
    expect_refused(good, good_scales, epilogue, "the clamped activation (the FP8 layer is refused with it)");
}

// Random e4m3 bytes (N(0, 32), saturated) and power-of-two scales in [2^-6, 1].
Fp8Host random_fp8(int64_t values, int64_t num_scales, std::mt19937_64& rng) {
    std::normal_distribution<double> normal(0.0, 32.0);
    std::uniform_int_distribution<int> exponent(-6, 0);
    Fp8Host out;
    for (int64_t i = 0; i < values; ++i) {
        out.q.push_back(static_cast<uint8_t>(__nv_cvt_double_to_fp8(normal(rng), __NV_SATFINITE, __NV_E4M3)));
    }
    for (int64_t i = 0; i < num_scales; ++i) out.scales.push_back(std::ldexp(1.0f, exponent(rng)));
    return out;
}

// Host data for the CPU tests: 45 rows of two experts, A [45, K = 208] and B [2, N = 336, 208] with transposed scales
// ([2, 2 K groups, 3 N blocks]: not square, so reading them untransposed goes wrong).
struct HostGemm {
    RowMap map;
    Fp8Host a, b;
    static constexpr int64_t kK = 208, kN = 336, kGroups = 2, kBlocks = 3;
};

HostGemm host_gemm(std::mt19937_64& rng) {
    HostGemm g;
    g.map.offsets = {0, 20, 45};
    g.map.tiles = {0, 1, 2};
    g.map.num_a_rows = 45;
    g.a = random_fp8(45 * HostGemm::kK, 45 * HostGemm::kGroups, rng);
    g.b = random_fp8(2 * HostGemm::kN * HostGemm::kK, 2 * HostGemm::kGroups * HostGemm::kBlocks, rng);
    g.b.scales_transposed = true;
    return g;
}

// The reference reads b_transposed scales as an explicitly transposed copy read plainly, bit for bit.
TEST(Fp8BackwardSm90, ReferenceReadsTransposedScales) {
    std::mt19937_64 rng(fresh_seed() + 5);
    SCOPED_TRACE("seed " + std::to_string(fresh_seed()));
    const HostGemm g = host_gemm(rng);
    Fp8Host plain = g.b;
    plain.scales_transposed = false;
    for (int64_t e = 0; e < 2; ++e) {
        for (int64_t i = 0; i < HostGemm::kBlocks; ++i) {
            for (int64_t k = 0; k < HostGemm::kGroups; ++k) {
                plain.scales[static_cast<size_t>((e * HostGemm::kBlocks + i) * HostGemm::kGroups + k)] =
                    g.b.scales[static_cast<size_t>((e * HostGemm::kGroups + k) * HostGemm::kBlocks + i)];
            }
        }
    }
    const Expected got = reference(g.a, g.b, g.map, HostGemm::kN, HostGemm::kK);
    const Expected want = reference(g.a, plain, g.map, HostGemm::kN, HostGemm::kK);
    EXPECT_EQ(got.value, want.value);
    EXPECT_EQ(got.size, want.size);
    Fp8Host untransposed = g.b;
    untransposed.scales_transposed = false;  // the transposed scales read as if plain: must not pass
    const Target t = plain_target(want, MEGAMOE_DTYPE_BF16);
    const Comparison wrong = compare([&, v = reference(g.a, untransposed, g.map, HostGemm::kN, HostGemm::kK).value](
                                         int64_t i) { return v[static_cast<size_t>(i)]; },
                                     t, HostGemm::kN);
    EXPECT_GT(wrong.bad, static_cast<int64_t>(t.want.size() / 10)) << "the scales read untransposed";
}

// The dH bounds on host data (bf16): the targets rounded as stored pass; a kernel that took the next row's weight,
// ignored the weights, swapped g and u, or read the neighbouring dy row fails on dh, act and ds as each depends on it.
TEST(Fp8BackwardSm90, DHiddenToleranceRejectsMutants) {
    std::mt19937_64 rng(fresh_seed() + 6);
    SCOPED_TRACE("seed " + std::to_string(fresh_seed()));
    const HostGemm g = host_gemm(rng);
    const int64_t rows = 45, inter = HostGemm::kN;
    const Expected p = reference(g.a, g.b, g.map, inter, HostGemm::kK);
    HostTensor h(MEGAMOE_DTYPE_BF16, {rows, 2 * inter});
    h.fill_random(rng, 1.0);
    std::vector<double> s(static_cast<size_t>(rows));
    std::uniform_real_distribution<double> weight(0.1, 1.0);
    for (double& v : s) v = static_cast<double>(static_cast<float>(weight(rng)));
    const Activation<double> swiglu{MEGAMOE_ACTIVATION_SWIGLU, 0.0, 0.0};
    const DhTargets want = dswiglu_targets(p, h, s, inter, swiglu, MEGAMOE_DTYPE_BF16);
    const auto stored = [](const std::vector<double>& v, megamoe_dtype_t dtype) {
        HostTensor t(dtype, {static_cast<int64_t>(v.size())});
        for (size_t i = 0; i < v.size(); ++i) t.set(static_cast<int64_t>(i), v[i]);
        return t;
    };
    const auto failures = [&](const DhTargets& got) {  // the share of each output out of bounds
        const Target* targets[] = {&want.dh, &want.act, &want.ds};
        const Target* gots[] = {&got.dh, &got.act, &got.ds};
        std::vector<double> shares;
        for (int o = 0; o < 3; ++o) {
            const HostTensor t = stored(gots[o]->want, o == 2 ? MEGAMOE_DTYPE_F32 : MEGAMOE_DTYPE_BF16);
            const Comparison c = compare([&](int64_t i) { return t.get(i); }, *targets[o], 1);
            shares.push_back(static_cast<double>(c.bad) / static_cast<double>(t.size()));
        }
        return shares;
    };
    for (const double share : failures(want)) EXPECT_EQ(share, 0.0) << "the targets as stored";
    std::vector<double> next_s(s.begin() + 1, s.end()), ones(s.size(), 1.0);
    next_s.push_back(s.front());
    HostTensor swapped(h.view.dtype, {rows, 2 * inter});
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t i = 0; i < 2 * inter; ++i)
            swapped.set(r * 2 * inter + (i + inter) % (2 * inter), h.get(r * 2 * inter + i));
    }
    const Expected neighbour = reference(g.a, g.b, g.map, inter, HostGemm::kK, Mutation::kNeighbourRow);
    const struct {
        const char* name;
        DhTargets got;
        bool dh, act, ds;  // which outputs must fail
    } mutants[] = {
        {"the next row's weight", dswiglu_targets(p, h, next_s, inter, swiglu, MEGAMOE_DTYPE_BF16), true, true, false},
        {"no weights", dswiglu_targets(p, h, ones, inter, swiglu, MEGAMOE_DTYPE_BF16), true, true, false},
        {"g and u swapped", dswiglu_targets(p, swapped, s, inter, swiglu, MEGAMOE_DTYPE_BF16), true, true, true},
        {"the neighbouring dy row", dswiglu_targets(neighbour, h, s, inter, swiglu, MEGAMOE_DTYPE_BF16), true, false,
         true},
    };
    for (const auto& m : mutants) {
        const std::vector<double> shares = failures(m.got);
        const bool must[] = {m.dh, m.act, m.ds};
        const char* outputs[] = {"dh", "act", "ds_parts"};
        for (int o = 0; o < 3; ++o) {
            if (must[o]) {
                EXPECT_GT(shares[static_cast<size_t>(o)], 0.1) << m.name << ": " << outputs[o];
            }
        }
        std::cout << "mutant (" << m.name << "): out of bounds dh " << shares[0] << ", act " << shares[1]
                  << ", ds_parts " << shares[2] << "\n";
    }
}

}  // namespace
}  // namespace megamoe::test
