// The blockwise FP8 layer through the C API (precision MEGAMOE_PRECISION_FP8_BLOCKWISE, megamoe_quantize_experts) on
// a compute capability 9.0 GPU, against a float64 host computation of the recipe (fp8_test_util.h's reference: acc =
// sum_g sa sb sum_k A8 B8 over 128-wide K groups) on the bytes and scales the GPU made:
//   - the FP8 weights: megamoe_quantize_experts' six tensors bitwise those of cuda::launch_quantize_blocks (q, its
//     transpose, the scales; bf16 / f16 / f32 weights, a zero block, a NaN block);
//   - forward: x quantized per 1 x 128 group along H by launch_quantize_groups; h = the up GEMM's acc; saved_h bitwise
//     the h of launch_m_grouped_fp8_gemm_sm90_gated on those operands, and within u |h| + c S of the acc; that launch's
//     a (rounded to x's dtype from the f32 g, u: not recomputable from the bf16 h, so its bytes come from the GPU)
//     within 2u |a| + c (1.1 |u| S_g + |silu g| S_u), its e4m3 bytes and scales bitwise launch_quantize_groups' of
//     that a; o = the down GEMM's acc on those bytes, y_t = sum_j s_tj o_tj within u |y| + sum_j |s| (2u |o| + c S);
//   - backward: dy quantized likewise; p = dy_q w2 (B = w2_t, w2's scales read transposed); d topk_weights = <p, a>
//     (a = silu(g) u of the bf16 h) within c sum |a| S_p + e sum |p a| (+ u |ds| in a 16-bit dtype); dh = [dg, du] and
//     s a of launch_m_grouped_fp8_gemm_sm90_dswiglu on the same operands within test_m_grouped_fp8_backward_cuda.cpp's
//     bounds; dx_t = sum_j q_tj, q = dh_q w13 (dh quantized along 2I, B = w13_t) within u |dx| + sum_j (2u |q| + c S);
//     dw13 = sum dh x^T and dw2 = sum dy (s a)^T from those 16-bit operands within w sum |terms| + u_out |dw|.
//   u: x's rounding (bf16 2^-8, f16 2^-11; f32 outputs 2^-24), c = 2^-9 the FP8 accumulation budget per unit of the
//   term sizes S (fp8_test_util.h's kAccumulation, justified in test_m_grouped_fp8_gemm_cuda.cpp), e = 2^-14 the f32
//   evaluation and summation of <p, a> (as the dH test's), w = 2^-12 the f32 sums of the weight gradients (at most a
//   few hundred rows an expert here: their worst case is ~2^-15). Each output's relative Frobenius error below 1e-2.
//   Outputs exactly 0 where nothing is routed (dropped slots, padding rows, experts without rows).
// Every case: outputs and workspaces poisoned (NaN) before each run, two runs bitwise equal, keep-h (saved_h) and
// recompute bitwise equal, the calls without the FP8 copies they do not read bitwise equal, dy's and dh's e4m3 copies
// in the dw13 output (the default; the test override MEGAMOE_TEST_FP8_OPERANDS_IN_WORKSPACE: in the workspace, larger
// where they fit) bitwise the same, the path sm90-fp8 (one direction only under the FP8_FORWARD_ONLY / BACKWARD_ONLY
// overrides). Cases: T = 1 with topk 1, one expert taking every slot, empty experts, dropped slots, every
// slot dropped, several M tiles, E = 16, H and I in {128, 256, 384}, f16, weights in the element type; grouped rows
// with padding, without scores, only padding. Also: accumulate_weight_grads into f32, a CUDA graph of quantize +
// forward + backward replaying the eager bits, and the refusals (NOT_SUPPORTED naming FP8). Every test skips without a
// compute capability 9.0 device, but RefusedWithoutSm90Device, which runs on the other GPUs only.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <iostream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "activation.h"
#include "cuda_test_util.h"
#include "fp8_layer_test_util.h"
#include "fp8_test_util.h"
#include "portable/fp8_quant.h"
#include "sm90/m_grouped_fp8_gemm_sm90.h"

namespace megamoe::test {
namespace {

constexpr double kDsSummation = 1.0 / 16384;      // e
constexpr double kWeightGradSum = 1.0 / 4096;     // w
constexpr double kF32Evaluation = 1.0 / 1048576;  // dg's f32 cancellation in 1 + g (1 - sig), as the dH test's
constexpr double kF16Overflow = 65520.0;           // f16's rounding threshold to infinity

// f16's subnormal rounding; else 2^-100: the epilogues' f32 math flushes subnormal intermediates to zero (a product of
// two tiny factors, e.g. s a with a ~ 1e-39, or dg ~ 5e-37 through a flushed factor, comes out 0 where the f64
// reference keeps it); the varied data's real values are far above it, so it hides no wrong row.
double floor_of(megamoe_dtype_t dtype) {
    return dtype == MEGAMOE_DTYPE_F16 ? std::ldexp(1.0, -25) : std::ldexp(1.0, -100);
}
double output_rounding(megamoe_dtype_t dtype) {
    return dtype == MEGAMOE_DTYPE_F32 ? std::ldexp(1.0, -24) : rounding_of(dtype);
}

int num_sms() {
    cudaDeviceProp prop{};
    expect_cuda(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
    return prop.multiProcessorCount;
}

Target empty_target(int64_t size) {
    return {std::vector<double>(static_cast<size_t>(size)), std::vector<double>(static_cast<size_t>(size))};
}

// The first `rows` rows of a [*, cols] tensor (saved_h's routed rows).
HostTensor first_rows(const HostTensor& t, int64_t rows, int64_t cols) {
    HostTensor out(t.view.dtype, {rows, cols});
    std::memcpy(out.bytes.data(), t.bytes.data(), static_cast<size_t>(rows * cols) * dtype_size(t.view.dtype));
    return out;
}

// ---- The GPU's own operands: the FP8 launches the layer is made of, on the same inputs ----

// The up GEMM with the quantizing SwiGLU epilogue: h [rows, 2I], a [rows, I] and a's e4m3 bytes and scales.
struct UpOutputs {
    HostTensor h, act;
    Fp8Host act_q;
};
UpOutputs run_up(const LayerData& d, const SortedRows& s, const Quantized& x_q, const DeviceFp8Experts& fp8) {
    const int64_t rows = s.rows(), H = d.c.hidden, I = d.c.inter;
    DeviceTensor h(contiguous_view(d.c.dtype, {rows, 2 * I})), act(contiguous_view(d.c.dtype, {rows, I}));
    DeviceTensor q(contiguous_view(MEGAMOE_DTYPE_E4M3, {rows, I})),
        scales(contiguous_view(MEGAMOE_DTYPE_F32, {rows, I / kGroup}));
    const cuda::MGroupedGemmArgs args =
        gemm_args(d.c.dtype, x_q.q.view().data, d.c.tokens, s.slots_ptr(), d.c.topk, fp8.w13.view().data, 2 * I, I, H,
                  static_cast<const int*>(s.offsets.view().data), static_cast<const int*>(s.tiles.view().data),
                  d.c.experts, s.gathered.tiles.back());
    const sm90::Fp8BlockScales block_scales{static_cast<const float*>(x_q.scales.view().data), H / kGroup,
                                            static_cast<const float*>(fp8.w13_scales.view().data), false};
    EXPECT_TRUE(sm90::m_grouped_fp8_gemm_sm90_supported(args, block_scales, true));
    const sm90::Fp8QuantizedAct quantized{static_cast<uint8_t*>(q.view().data), static_cast<float*>(scales.view().data),
                                          false};
    const std::vector<HostTensor> got = run({&h, &act, &q, &scales}, [&] {
        return sm90::launch_m_grouped_fp8_gemm_sm90_gated(args, block_scales, h.view().data, act.view().data, num_sms(),
                                                          nullptr, &quantized);
    });
    return {got[0], got[1], fp8_host(q, scales, false)};
}

// dH with dSwiGLU on h (the forward's saved_h rows): dh [rows, 2I] and s a [rows, I].
struct DhOutputs {
    HostTensor dh, sa;
};
DhOutputs run_dh(const DeviceLayer& layer, const SortedRows& s, const Quantized& dy_q, const HostTensor& h) {
    const LayerCase& c = layer.data.c;
    const int64_t rows = s.rows(), H = c.hidden, I = c.inter;
    const DeviceTensor h_dev = DeviceTensor::upload(h);
    DeviceTensor dh(h.view), sa(contiguous_view(c.dtype, {rows, I}));
    DeviceTensor ds(contiguous_view(MEGAMOE_DTYPE_F32, {rows, ceil_div(I, kGroup)}));
    const cuda::MGroupedGemmArgs args =
        gemm_args(c.dtype, dy_q.q.view().data, c.tokens, s.slots_ptr(), c.topk, layer.fp8.w2_t.view().data, I, I, H,
                  static_cast<const int*>(s.offsets.view().data), static_cast<const int*>(s.tiles.view().data),
                  c.experts, s.gathered.tiles.back());
    const sm90::Fp8BlockScales scales{static_cast<const float*>(dy_q.scales.view().data), H / kGroup,
                                      static_cast<const float*>(layer.fp8.w2_scales.view().data), true};
    sm90::DSwiGLUEpilogueArgs epilogue{};
    epilogue.h = h_dev.view().data;
    epilogue.dh = dh.view().data;
    epilogue.act = sa.view().data;
    epilogue.ds_parts = static_cast<float*>(ds.view().data);
    epilogue.weights = layer.weights.view().data;
    epilogue.weights_dtype = layer.data.weighted() ? c.weights_dtype : MEGAMOE_DTYPE_F32;
    epilogue.activation = Activation<float>{MEGAMOE_ACTIVATION_SWIGLU, 0.0f, 0.0f};
    epilogue.b_layout = cuda::BLayout::kNK;
    int64_t parts = 0;
    const std::vector<HostTensor> got = run({&dh, &sa, &ds}, [&] {
        return sm90::launch_m_grouped_fp8_gemm_sm90_dswiglu(args, scales, epilogue, num_sms(), nullptr, &parts);
    });
    return {got[0], got[1]};
}

// ---- Targets (bounds in the file's header) ----

// a = silu(g) u of the up GEMM's acc: test_m_grouped_fp8_gemm_cuda.cpp's bound.
Target act_target(const Expected& h, int64_t rows, int64_t I, megamoe_dtype_t dtype) {
    Target t = empty_target(rows * I);
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t i = 0; i < I; ++i) {
            const size_t gi = static_cast<size_t>(r * 2 * I + i), ui = gi + static_cast<size_t>(I);
            const size_t idx = static_cast<size_t>(r * I + i);
            const double gate = h.value[gi], up = h.value[ui], silu = gate / (1.0 + std::exp(-gate));
            t.want[idx] = silu * up;
            t.bound[idx] = 2.0 * rounding_of(dtype) * std::fabs(silu * up) + floor_of(dtype) +
                           kAccumulation * (1.1 * std::fabs(up) * h.size[gi] + std::fabs(silu) * h.size[ui]);
        }
    }
    return t;
}

// out_t = sum over the sorted rows r of token t of w_r acc_r (w_r = s_r, or 1 unweighted): the rows rounded to
// `dtype`, summed in f32, rounded. Tokens without rows: exactly 0.
Target combine_target(const Expected& acc, const SortedRows& s, int64_t tokens, int64_t n, bool weighted,
                      megamoe_dtype_t dtype) {
    Target t = empty_target(tokens * n);
    std::vector<bool> touched(static_cast<size_t>(tokens), false);
    const double u = rounding_of(dtype), f = floor_of(dtype);
    for (int64_t r = 0; r < s.rows(); ++r) {
        const double w = weighted ? s.weight[static_cast<size_t>(r)] : 1.0;
        const int64_t token = s.token[static_cast<size_t>(r)];
        touched[static_cast<size_t>(token)] = true;
        for (int64_t j = 0; j < n; ++j) {
            const size_t in = static_cast<size_t>(r * n + j), out = static_cast<size_t>(token * n + j);
            t.want[out] += w * acc.value[in];
            t.bound[out] += std::fabs(w) * (2.0 * u * std::fabs(acc.value[in]) + kAccumulation * acc.size[in] + f);
        }
    }
    for (int64_t token = 0; token < tokens; ++token) {
        if (!touched[static_cast<size_t>(token)]) continue;
        for (int64_t j = 0; j < n; ++j) {
            const size_t idx = static_cast<size_t>(token * n + j);
            t.bound[idx] += u * std::fabs(t.want[idx]) + f;
        }
    }
    return t;
}

// d topk_weights (dscores) = <p, a> per slot, a = silu(g) u of the bf16 h; dropped slots and padding rows 0.
// *terms: sum |p a| per slot, the size of <p, a>'s terms.
Target dweights_target(const Expected& p, const HostTensor& h, const SortedRows& s, int64_t slots, int64_t I,
                       megamoe_dtype_t out_dtype, std::vector<double>* terms) {
    Target t = empty_target(slots);
    terms->assign(static_cast<size_t>(slots), 0.0);
    for (int64_t r = 0; r < s.rows(); ++r) {
        const size_t slot = static_cast<size_t>(s.slot[static_cast<size_t>(r)]);
        for (int64_t i = 0; i < I; ++i) {
            const double g = h.get(r * 2 * I + i), up = h.get(r * 2 * I + I + i), a = g / (1.0 + std::exp(-g)) * up;
            const size_t pi = static_cast<size_t>(r * I + i);
            t.want[slot] += p.value[pi] * a;
            (*terms)[slot] += std::fabs(p.value[pi] * a);
            t.bound[slot] += kAccumulation * std::fabs(a) * p.size[pi] + kDsSummation * std::fabs(p.value[pi] * a);
        }
    }
    for (int64_t r = 0; r < s.rows(); ++r) {
        const size_t slot = static_cast<size_t>(s.slot[static_cast<size_t>(r)]);
        t.bound[slot] += output_rounding(out_dtype) * std::fabs(t.want[slot]) + floor_of(out_dtype);
        if (out_dtype == MEGAMOE_DTYPE_F16 && std::fabs(t.want[slot]) - t.bound[slot] >= kF16Overflow) {
            t.want[slot] = std::copysign(HUGE_VAL, t.want[slot]);  // certainly past f16's range: the infinity
            t.bound[slot] = 0.0;
        }
    }
    return t;
}

// `t` with the f16 entries whose bound reaches f16's range (the exact value may round to infinity, or not) resolved by
// `got`: its infinity of want's sign is then the right answer; any other value is checked against the bound as is.
Target resolved_overflows(const HostTensor& got, Target t) {
    if (got.view.dtype != MEGAMOE_DTYPE_F16) return t;
    for (size_t i = 0; i < t.want.size(); ++i) {
        const double value = got.get(static_cast<int64_t>(i));
        if (std::fabs(t.want[i]) + t.bound[i] >= kF16Overflow && value == std::copysign(HUGE_VAL, t.want[i])) {
            t.want[i] = value;
            t.bound[i] = 0.0;
        }
    }
    return t;
}

// As expect_close, the relative Frobenius error against the norm of the term sizes: a single <p, a> (T = 1, topk = 1)
// can cancel far below its terms, and p's accumulation error is relative to them (as test_sm90_backward.cpp's).
void expect_close_to_terms(const HostTensor& got, const Target& target, const std::vector<double>& terms,
                           const std::string& what) {
    const Target t = resolved_overflows(got, target);
    ASSERT_EQ(static_cast<size_t>(got.size()), t.want.size()) << what;
    const Comparison c = compare([&](int64_t i) { return got.get(i); }, t, 1);
    EXPECT_EQ(c.bad, 0) << what << ": " << c.bad << " of " << t.want.size() << " out of bounds:" << c.first_bad;
    double diff = 0.0, norm = 0.0;
    for (size_t i = 0; i < terms.size(); ++i) {
        norm += terms[i] * terms[i];
        if (got.get(static_cast<int64_t>(i)) == t.want[i]) continue;  // exact, infinities included
        diff += std::pow(got.get(static_cast<int64_t>(i)) - t.want[i], 2);
    }
    const double frobenius = norm > 0.0 ? std::sqrt(diff / norm) : std::sqrt(diff);
    EXPECT_LT(frobenius, kFrobenius) << what << ": relative Frobenius error (against the terms' sizes)";
    std::cout << "  " << what << ": relative Frobenius error (terms) " << frobenius << ", worst |error| / bound "
              << c.worst << "\n";
}

// dh = [dg, du] = s p (u sig (1 + g (1 - sig)), silu g) and s a from p's acc and the bf16 h: the dH test's bounds.
struct DhTargets {
    Target dh, sa;
};
DhTargets dh_targets(const Expected& p, const HostTensor& h, const SortedRows& s, int64_t I, megamoe_dtype_t dtype) {
    const int64_t rows = s.rows();
    const double u = rounding_of(dtype), f = floor_of(dtype);
    DhTargets t{empty_target(rows * 2 * I), empty_target(rows * I)};
    const Activation<double> swiglu{MEGAMOE_ACTIVATION_SWIGLU, 0.0, 0.0};
    for (int64_t r = 0; r < rows; ++r) {
        const double w = s.weight[static_cast<size_t>(r)];
        for (int64_t i = 0; i < I; ++i) {
            const size_t gi = static_cast<size_t>(r * 2 * I + i), ui = gi + static_cast<size_t>(I);
            const size_t pi = static_cast<size_t>(r * I + i);
            const double g = h.get(static_cast<int64_t>(gi)), up = h.get(static_cast<int64_t>(ui));
            const double pv = p.value[pi], size = p.size[pi];
            double factor[2];
            swiglu.backward(g, up, w, &factor[0], &factor[1]);
            const size_t idx[2] = {gi, ui};
            for (int k = 0; k < 2; ++k) {
                t.dh.want[idx[k]] = factor[k] * pv;
                t.dh.bound[idx[k]] =
                    2.0 * u * std::fabs(factor[k] * pv) + kAccumulation * std::fabs(factor[k]) * size + f;
            }
            t.dh.bound[gi] += kF32Evaluation * std::fabs(w * pv) * (std::fabs(up) + 1.0) * (1.0 + std::fabs(g));
            t.sa.want[pi] = w * swiglu.forward(g, up);
            t.sa.bound[pi] = 2.0 * u * std::fabs(t.sa.want[pi]) + f;
        }
    }
    return t;
}

// grad_e[i, j] = sum over the rows r of expert e of left(r, i) right(r, j), [E, n_left, n_right]: f32 sums.
template <typename Left, typename Right>
Target weight_grad_target(const SortedRows& s, int64_t E, int64_t n_left, int64_t n_right, const Left& left,
                          const Right& right, megamoe_dtype_t out_dtype) {
    Target t = empty_target(E * n_left * n_right);
    std::vector<double> size(t.want.size(), 0.0), right_row(static_cast<size_t>(n_right));
    for (int64_t r = 0; r < s.rows(); ++r) {
        const int64_t e = s.expert[static_cast<size_t>(r)];
        for (int64_t j = 0; j < n_right; ++j) right_row[static_cast<size_t>(j)] = right(r, j);
        for (int64_t i = 0; i < n_left; ++i) {
            const double l = left(r, i);
            const size_t base = static_cast<size_t>((e * n_left + i) * n_right);
            for (int64_t j = 0; j < n_right; ++j) {
                const double v = l * right_row[static_cast<size_t>(j)];
                t.want[base + static_cast<size_t>(j)] += v;
                size[base + static_cast<size_t>(j)] += std::fabs(v);
            }
        }
    }
    for (size_t i = 0; i < t.want.size(); ++i) {
        t.bound[i] = kWeightGradSum * size[i] + output_rounding(out_dtype) * std::fabs(t.want[i]) +
                     (size[i] > 0.0 ? floor_of(out_dtype) : 0.0);
    }
    return t;
}

// previous + fresh, elementwise in f32.
HostTensor f32_sum(const HostTensor& previous, const HostTensor& fresh) {
    HostTensor sum = previous;
    for (int64_t i = 0; i < sum.size(); ++i)
        sum.set(i, static_cast<float>(previous.get(i)) + static_cast<float>(fresh.get(i)));
    return sum;
}

// ---- One case ----

// path/plan.cu's rule for dy's and dh's e4m3 copies in the dw13 output, stated again: act ([S, max(I, H)] 16-bit),
// then dy's e4m3 rows and f32 scales, then dh's, each 256-byte aligned, within the dw13 output (16-bit weight
// gradients).
bool fp8_operands_fit_in_dw13(const LayerCase& c) {
    const auto aligned = [](int64_t bytes) { return (bytes + 255) / 256 * 256; };
    const auto groups = [](int64_t cols) { return (cols + 127) / 128; };
    const int64_t S = c.tokens * c.topk, T = c.tokens, H = c.hidden, I = c.inter;
    const int64_t needed = aligned(S * std::max(I, H) * 2) + aligned(T * H) + aligned(T * groups(H) * 4) +
                           aligned(S * 2 * I) + aligned(S * groups(2 * I) * 4);
    return needed <= c.experts * 2 * I * H * (c.f32_grads ? 4 : 2);
}

void check_layer(const LayerCase& c) {
    SCOPED_TRACE(::testing::PrintToString(c));
    std::cout << ::testing::PrintToString(c) << "\n";
    const LayerData d = make_layer(c);
    const SortedRows s = sort_rows(d);
    const int64_t T = c.tokens, H = c.hidden, I = c.inter, E = c.experts, rows = s.rows();
    DeviceLayer layer(d);
    for (DeviceTensor* t : layer.fp8.all()) t->poison();
    ASSERT_EQ(layer.quantize(), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
    expect_cuda(cudaDeviceSynchronize(), "megamoe_quantize_experts");
    expect_quantized_as_blocks(layer);
    const HostFp8Experts w = download_fp8(layer.fp8);
    megamoe_path_t path = MEGAMOE_PATH_REFERENCE;
    ASSERT_EQ(layer.forward(&path), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
    EXPECT_EQ(path, MEGAMOE_PATH_SM90_FP8) << "forward path " << megamoe_path_string(path);
    ASSERT_EQ(layer.backward(&path), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
    EXPECT_EQ(path, MEGAMOE_PATH_SM90_FP8) << "backward path " << megamoe_path_string(path);
    {  // one direction in FP8, the other on the 16-bit path (and its path says so)
        const ScopedOverrides only(MEGAMOE_TEST_FP8_FORWARD_ONLY);
        ASSERT_EQ(layer.forward(&path), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
        EXPECT_EQ(path, MEGAMOE_PATH_SM90_FP8) << "FP8 forward only: forward path " << megamoe_path_string(path);
        ASSERT_EQ(layer.backward(&path), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
        EXPECT_NE(path, MEGAMOE_PATH_SM90_FP8) << "FP8 forward only: backward path " << megamoe_path_string(path);
    }
    {
        const ScopedOverrides only(MEGAMOE_TEST_FP8_BACKWARD_ONLY);
        ASSERT_EQ(layer.forward(&path), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
        EXPECT_NE(path, MEGAMOE_PATH_SM90_FP8) << "FP8 backward only: forward path " << megamoe_path_string(path);
        ASSERT_EQ(layer.backward(&path), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
        EXPECT_EQ(path, MEGAMOE_PATH_SM90_FP8) << "FP8 backward only: backward path " << megamoe_path_string(path);
    }

    // Forward: keep-h twice, recompute, and without the transposed copies (the forward does not read them).
    const ForwardOut kept = run_forward(layer);
    EXPECT_EQ(kept.y.bytes, run_forward(layer).y.bytes) << "y: two runs differ";
    layer.keep_h = false;
    EXPECT_EQ(kept.y.bytes, run_forward(layer).y.bytes) << "y: recompute mode (no saved_h) differs";
    layer.fp8_view.w13_t = layer.fp8_view.w2_t = megamoe_tensor_t{};
    EXPECT_EQ(kept.y.bytes, run_forward(layer).y.bytes) << "y: without fp8.w13_t and fp8.w2_t";
    layer.fp8_view = layer.fp8.view();
    layer.keep_h = true;

    const HostTensor h = first_rows(kept.saved_h, rows, 2 * I);  // the routed rows
    const Quantized x_q = quantize(d.x, 1, T, H, false), dy_q = quantize(d.dy, 1, T, H, false);
    Expected o{}, p{}, q{};
    DhOutputs dh{HostTensor(c.dtype, {0, 2 * I}), HostTensor(c.dtype, {0, I})};
    if (rows > 0) {
        const UpOutputs up = run_up(d, s, x_q, layer.fp8);
        EXPECT_EQ(h.bytes, up.h.bytes) << "saved_h: not the h of the FP8 up GEMM on the same operands";
        const Expected h_acc = reference(x_q.host, w.w13, s.gathered, 2 * I, H);
        expect_close(h, plain_target(h_acc, c.dtype), 2 * I, "saved_h");
        expect_close(up.act, act_target(h_acc, rows, I, c.dtype), I, "a (the up GEMM's)");
        const Quantized act_q = quantize(up.act, 1, rows, I, false);
        EXPECT_EQ(act_q.host.q, up.act_q.q) << "a's e4m3 bytes: not launch_quantize_groups' of a";
        EXPECT_EQ(act_q.host.scales, up.act_q.scales) << "a's scales: not launch_quantize_groups' of a";
        o = reference(up.act_q, w.w2, s.sorted, H, I);
        p = reference(dy_q.host, w.w2_t, s.gathered, I, H);
        dh = run_dh(layer, s, dy_q, h);
        const DhTargets dh_want = dh_targets(p, h, s, I, c.dtype);
        expect_close(dh.dh, dh_want.dh, 2 * I, "dh (the FP8 dH's)");
        expect_close(dh.sa, dh_want.sa, I, "s a (the FP8 dH's)");
        q = reference(quantize(dh.dh, 1, rows, 2 * I, false).host, w.w13_t, s.sorted, H, 2 * I);
    }
    expect_close(kept.y, combine_target(o, s, T, H, d.weighted(), c.dtype), H, c.grouped ? "out" : "y");

    // Backward: keep-h twice, recompute, and without dx (fp8.w13_t and, keeping h, fp8.w13 not read).
    const BackwardOut got = run_backward(layer, kept.saved_h);
    expect_same_bits(got, run_backward(layer, kept.saved_h), "two runs");
    layer.keep_h = false;
    expect_same_bits(got, run_backward(layer, kept.saved_h), "recompute mode (no saved_h) against keep-h");
    layer.keep_h = true;
    {  // dy's and dh's e4m3 copies in the dw13 output: the same bits, less workspace
        expect_same_bits(got, run_backward(layer, kept.saved_h), "the default again");
        const size_t default_bytes = layer.last_workspace_bytes;
        const ScopedOverrides in_workspace(MEGAMOE_TEST_FP8_OPERANDS_IN_WORKSPACE);
        expect_same_bits(got, run_backward(layer, kept.saved_h),
                         "dy, dh copies in the workspace (test override) against the default (in dw13)");
        if (fp8_operands_fit_in_dw13(c)) {
            EXPECT_GT(layer.last_workspace_bytes, default_bytes) << "dy, dh not in dw13 by default";
        } else {
            EXPECT_EQ(layer.last_workspace_bytes, default_bytes) << "dy, dh in the workspace either way: no room";
        }
    }
    layer.want_dx = false;
    layer.fp8_view.w13_t = layer.fp8_view.w13 = megamoe_tensor_t{};
    expect_same_bits(got, run_backward(layer, kept.saved_h), "without dx, fp8.w13_t and fp8.w13", false);
    layer.want_dx = true;
    layer.fp8_view = layer.fp8.view();

    expect_close(got.dx, combine_target(q, s, T, H, false, c.dtype), H, c.grouped ? "dx_sorted" : "dx");
    if (d.weighted()) {
        std::vector<double> terms;
        const Target want = dweights_target(p, h, s, d.num_slots(), I, c.weights_dtype, &terms);
        expect_close_to_terms(got.dweights, want, terms, c.grouped ? "dscores" : "dtopk_weights");
    }
    const auto dh_at = [&](int64_t r, int64_t i) { return dh.dh.get(r * 2 * I + i); };
    const auto x_at = [&](int64_t r, int64_t j) { return d.x.get(s.token[static_cast<size_t>(r)] * H + j); };
    const auto dy_at = [&](int64_t r, int64_t j) { return d.dy.get(s.token[static_cast<size_t>(r)] * H + j); };
    const auto sa_at = [&](int64_t r, int64_t i) { return dh.sa.get(r * I + i); };
    expect_close(got.dw13, weight_grad_target(s, E, 2 * I, H, dh_at, x_at, c.grad_dtype()), H, "dw13");
    expect_close(got.dw2, weight_grad_target(s, E, H, I, dy_at, sa_at, c.grad_dtype()), I, "dw2");

    if (!c.f32_grads) return;
    // Accumulated into f32 buffers holding values: previous + the fresh gradient, one f32 addition, twice the same.
    std::mt19937_64 rng(fresh_seed() + 11);
    HostTensor previous13(MEGAMOE_DTYPE_F32, {E, 2 * I, H}), previous2(MEGAMOE_DTYPE_F32, {E, H, I});
    previous13.fill_random(rng, 1.0);
    previous2.fill_random(rng, 1.0);
    layer.accumulate = true;
    for (int run_idx = 0; run_idx < 2; ++run_idx) {
        DeviceLayer::upload_into(layer.dw13, previous13);
        DeviceLayer::upload_into(layer.dw2, previous2);
        const BackwardOut accumulated = run_backward(layer, kept.saved_h);
        EXPECT_EQ(accumulated.dw13.bytes, f32_sum(previous13, got.dw13).bytes) << "dw13 accumulated, run " << run_idx;
        EXPECT_EQ(accumulated.dw2.bytes, f32_sum(previous2, got.dw2).bytes) << "dw2 accumulated, run " << run_idx;
        EXPECT_EQ(accumulated.dx.bytes, got.dx.bytes) << "dx with accumulate_weight_grads";
    }
}

TEST(Fp8LayerCuda, WholeLayerMatchesRecipe) {
    SKIP_WITHOUT_SM90();
    std::vector<LayerCase> cases = {
        whole_case("T = 1, topk = 1, E = 1", 1, 128, 128, 1, 1),
        whole_case("one expert takes every slot", 200, 256, 128, 4, 1, Routing::kOneExpert),
        whole_case("hot expert, topk 3, E = 16", 150, 128, 256, 16, 3, Routing::kOneExpert),
        whole_case("half the experts empty, topk 2", 97, 384, 128, 8, 2, Routing::kHalfEmpty),
        whole_case("dropped slots, topk 4, I = 384", 130, 256, 384, 8, 4, Routing::kSomeDropped),
        whole_case("several M tiles an expert, f32 weight gradients", 300, 128, 128, 2, 2),
        whole_case("every slot dropped", 3, 128, 128, 4, 2),
        whole_case("f16, dropped slots, weights in f16", 64, 128, 256, 5, 2, Routing::kSomeDropped),
        whole_case("weights in bf16, H = I = 384", 40, 384, 384, 6, 2),
    };
    cases[5].f32_grads = true;
    cases[6].drop_every_slot = true;
    cases[7].dtype = cases[7].weights_dtype = MEGAMOE_DTYPE_F16;
    cases[8].weights_dtype = MEGAMOE_DTYPE_BF16;
    for (const LayerCase& c : cases) check_layer(c);
}

TEST(Fp8LayerCuda, GroupedRowsMatchRecipe) {
    SKIP_WITHOUT_SM90();
    std::mt19937_64 rng(fresh_seed() + 12);
    std::vector<LayerCase> cases = {
        grouped_case("R = 1, E = 1", 1, 128, 128, {1}),
        grouped_case("empty experts, padding rows", 300, 256, 128, random_counts(8, 260, {1, 5}, rng)),
        grouped_case("one expert takes every row, no scores", 200, 128, 256, {0, 200, 0, 0}, false),
        grouped_case("only padding rows", 16, 128, 128, {0, 0, 0}),
        grouped_case("E = 16, scores in bf16, I = 384, f32 weight gradients", 400, 128, 384,
                     random_counts(16, 400, {}, rng)),
    };
    cases[4].weights_dtype = MEGAMOE_DTYPE_BF16;
    cases[4].f32_grads = true;
    for (const LayerCase& c : cases) check_layer(c);
}

// The FP8 weights of bf16, f16 and f32 weights (a zero block, a NaN block) bitwise launch_quantize_blocks'.
TEST(Fp8LayerCuda, QuantizeExpertsMatchesBlockQuantizer) {
    SKIP_WITHOUT_SM90();
    for (const megamoe_dtype_t dtype : {MEGAMOE_DTYPE_BF16, MEGAMOE_DTYPE_F16, MEGAMOE_DTYPE_F32}) {
        SCOPED_TRACE(dtype_name(dtype));
        LayerCase c = whole_case("quantize", 4, 256, 384, 3, 1);
        c.dtype = dtype;
        LayerData d = make_layer(c);
        for (int64_t n = 0; n < 128; ++n) {
            for (int64_t k = 128; k < 256; ++k) d.w13.set(n * 256 + k, 0.0);  // expert 0, block (0, 1)
        }
        d.w2.set((2 * 256 + 200) * 384 + 300, std::nan(""));  // expert 2, block (1, 2)
        DeviceLayer layer(d);
        for (DeviceTensor* t : layer.fp8.all()) t->poison();
        ASSERT_EQ(layer.quantize(), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
        expect_cuda(cudaDeviceSynchronize(), "megamoe_quantize_experts");
        expect_quantized_as_blocks(layer);
        EXPECT_EQ(layer.fp8.w13_scales.download().get(1), 1.0) << "the zero block's scale";
        EXPECT_TRUE(std::isnan(layer.fp8.w2_scales.download().get((2 * 2 + 1) * 3 + 2))) << "the NaN block's scale";
    }
}

// A CUDA graph of megamoe_quantize_experts + forward (keep-h) + backward on a side stream replays the eager bits.
TEST(Fp8LayerCuda, GraphReplaysTheEagerBits) {
    SKIP_WITHOUT_SM90();
    cudaStream_t stream = nullptr;
    expect_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    std::mt19937_64 rng(fresh_seed() + 13);
    for (const LayerCase& c : {whole_case("graph, whole layer", 90, 256, 128, 6, 2, Routing::kSomeDropped),
                               grouped_case("graph, grouped rows", 150, 128, 256, random_counts(5, 140, {2}, rng))}) {
        SCOPED_TRACE(::testing::PrintToString(c));
        const LayerData d = make_layer(c);
        DeviceLayer layer(d);
        layer.stream = stream;
        const auto poison = [&] {
            for (DeviceTensor* t : layer.fp8.all()) t->poison();
            layer.poison_forward();
            layer.poison_backward(nullptr);
            expect_cuda(cudaDeviceSynchronize(), "poison");
        };
        const auto launch = [&] {  // the calls in order (the operands of + are not sequenced)
            std::string error = failure_message(layer.quantize(), "megamoe_quantize_experts");
            error += failure_message(layer.forward(), "forward");
            return error + failure_message(layer.backward(), "backward");
        };
        const auto outputs = [&] {
            std::vector<HostTensor> all = {layer.y.download(), layer.dx.download(), layer.dw13.download(),
                                           layer.dw2.download(), layer.dweights.download()};
            for (DeviceTensor* t : layer.fp8.all()) all.push_back(t->download());
            return all;
        };
        poison();
        ASSERT_EQ(launch(), "");
        expect_cuda(cudaStreamSynchronize(stream), "eager run");
        const std::vector<HostTensor> eager = outputs();
        const char* names[] = {"y",        "dx",       "dw13",         "dw2",
                               "dweights", "fp8.w13",  "fp8.w13_t",    "fp8.w13_scales",
                               "fp8.w2",   "fp8.w2_t", "fp8.w2_scales"};
        expect_graph_replays(stream, launch, poison, [&] {
            const std::vector<HostTensor> replay = outputs();
            for (size_t i = 0; i < eager.size(); ++i) EXPECT_EQ(eager[i].bytes, replay[i].bytes) << names[i];
        });
    }
    cudaStreamDestroy(stream);
}

// What the FP8 kernels do not run is NOT_SUPPORTED, naming FP8, from the calls and the path queries.
void expect_not_supported(DeviceLayer& layer, const std::string& what) {
    megamoe_path_t path = MEGAMOE_PATH_REFERENCE;
    const std::pair<const char*, megamoe_status_t> calls[] = {{"forward", layer.forward()},
                                                              {"backward", layer.backward()},
                                                              {"forward path", layer.forward(&path)},
                                                              {"backward path", layer.backward(&path)}};
    for (const auto& [call, status] : calls) {
        EXPECT_EQ(status, MEGAMOE_STATUS_NOT_SUPPORTED) << what << ", " << call;
    }
    layer.forward();
    EXPECT_NE(std::string(megamoe_last_error()).find("FP8"), std::string::npos)
        << what << ": message \"" << megamoe_last_error() << "\"";
}

TEST(Fp8LayerCuda, RefusesWhatTheFp8KernelsDoNotRun) {
    SKIP_WITHOUT_SM90();
    for (const bool grouped : {false, true}) {
        SCOPED_TRACE(grouped ? "grouped rows" : "whole layer");
        const auto make_case = [&](int64_t H, int64_t I) {
            return grouped ? grouped_case("refusals", 64, H, I, {30, 34}) : whole_case("refusals", 32, H, I, 2, 2);
        };
        const LayerData d = make_layer(make_case(128, 128));
        const HostTensor b13(d.c.dtype, {2, 256}), b2(d.c.dtype, {2, 128});
        const DeviceTensor b13_dev = DeviceTensor::upload(b13), b2_dev = DeviceTensor::upload(b2);
        const std::pair<const char*, std::function<void(megamoe_layout_t&, megamoe_activation_t&, megamoe_tensor_t&,
                                                        megamoe_tensor_t&)>>
            options[] = {
                {"clamped SwiGLU",
                 [](auto&, auto& act, auto&, auto&) {
                     act = {MEGAMOE_ACTIVATION_CLAMPED_SWIGLU, 7.0, 1.702};
                 }},
                {"interleaved gate / up",
                 [](auto& layout, auto&, auto&, auto&) { layout.gate_up = MEGAMOE_GATE_UP_INTERLEAVED; }},
                {"b13", [&](auto&, auto&, auto& b, auto&) { b = b13_dev.view(); }},
                {"b2", [&](auto&, auto&, auto&, auto& b) { b = b2_dev.view(); }},
            };
        DeviceLayer layer(d);
        ASSERT_EQ(layer.quantize(), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
        for (const auto& [what, option] : options) {
            layer.options = option;
            expect_not_supported(layer, what);
        }
        layer.options = nullptr;
        {
            const ScopedEnv disable("MEGAMOE_DISABLE_SM90", "1");
            expect_not_supported(layer, "MEGAMOE_DISABLE_SM90=1");
        }
        for (const auto& [H, I] : {std::pair<int64_t, int64_t>{128, 64}, std::pair<int64_t, int64_t>{192, 128}}) {
            const LayerData odd = make_layer(make_case(H, I));  // the FP8 tensors shaped with ceil(/ 128)
            DeviceLayer odd_layer(odd);
            expect_not_supported(odd_layer, "H = " + std::to_string(H) + ", I = " + std::to_string(I));
            EXPECT_NE(odd_layer.quantize(), MEGAMOE_STATUS_SUCCESS) << "megamoe_quantize_experts, I = " << I;
        }
    }
}

// megamoe_quantize_experts refuses what it cannot write, naming the argument (absent transposed copies it leaves
// unwritten: test_fp8_one_copy_cuda.cpp).
TEST(Fp8LayerCuda, QuantizeExpertsNamesBadArguments) {
    SKIP_WITHOUT_SM90();
    const LayerData d = make_layer(whole_case("quantize refusals", 4, 256, 128, 3, 1));
    DeviceLayer layer(d);
    const HostTensor host_w2(d.c.dtype, {3, 256, 128});
    const struct {
        const char* what;
        std::function<void(megamoe_tensor_t&, megamoe_tensor_t&, megamoe_fp8_experts_t&)> mutate;
        const char* name;
    } cases[] = {
        {"w2 of 2 experts", [](auto&, auto& w2, auto&) { w2.shape[0] = 2; }, "w2"},
        {"w2 H differs", [](auto&, auto& w2, auto&) { w2.shape[1] = 128; }, "w2"},
        {"w13 f64", [](auto& w13, auto&, auto&) { w13.dtype = MEGAMOE_DTYPE_F64; }, "w13"},
        {"w2 on the CPU", [&](auto&, auto& w2, auto&) { w2 = host_w2.view; }, "w2"},
        {"fp8.w13 shape", [](auto&, auto&, auto& f) { f.w13.shape[1] = 128; }, "fp8.w13"},
        {"fp8.w2 absent", [](auto&, auto&, auto& f) { f.w2 = megamoe_tensor_t{}; }, "fp8.w2"},
        {"fp8.w2_t bf16", [](auto&, auto&, auto& f) { f.w2_t.dtype = MEGAMOE_DTYPE_BF16; }, "fp8.w2_t"},
        {"fp8.w2_scales shape", [](auto&, auto&, auto& f) { f.w2_scales.shape[2] = 2; }, "fp8.w2_scales"},
        {"fp8.w13_scales f16", [](auto&, auto&, auto& f) { f.w13_scales.dtype = MEGAMOE_DTYPE_F16; }, "fp8.w13_scales"},
    };
    for (const auto& bad : cases) {
        megamoe_tensor_t w13 = layer.w13.view(), w2 = layer.w2.view();
        megamoe_fp8_experts_t fp8 = layer.fp8.view();
        bad.mutate(w13, w2, fp8);
        const megamoe_status_t status = megamoe_quantize_experts(&w13, &w2, &fp8, nullptr);
        EXPECT_TRUE(status == MEGAMOE_STATUS_INVALID_ARGUMENT || status == MEGAMOE_STATUS_NOT_SUPPORTED)
            << bad.what << ": " << megamoe_status_string(status);
        EXPECT_NE(std::string(megamoe_last_error()).find(bad.name), std::string::npos)
            << bad.what << ": message \"" << megamoe_last_error() << "\"";
    }
}

// On a GPU that is not compute capability 9.0 the FP8 calls are NOT_SUPPORTED (never a silent 16-bit run), and so is
// megamoe_quantize_experts (its kernels are built for sm_90a alone).
TEST(Fp8LayerCuda, RefusedWithoutSm90Device) {
    SKIP_WITHOUT_CUDA();
    std::string reason;
    if (sm90_available(&reason)) GTEST_SKIP() << "a compute capability 9.0 device runs the FP8 kernels";
    const LayerData d = make_layer(whole_case("no sm_90", 8, 128, 128, 2, 2));
    DeviceLayer layer(d);
    expect_not_supported(layer, "not compute capability 9.0");
    EXPECT_EQ(layer.quantize(), MEGAMOE_STATUS_NOT_SUPPORTED) << megamoe_last_error();
}

}  // namespace
}  // namespace megamoe::test
