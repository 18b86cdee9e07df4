// The FP8 layer tests' problems and device side (test_fp8_layer_cuda.cpp): a case of the whole layer (topk_ids,
// topk_weights) or of grouped rows (tokens_per_expert, optional scores) with bf16 / f16 values of varied magnitude
// per 1 x 128 group and 128 x 128 block (so the FP8 scales differ), its sorted rows (the slots of each expert in slot
// order, as saved_h holds them) with the routing the FP8 GEMM launchers take, the FP8 expert weights on the device
// (megamoe_fp8_experts_t), the C API calls of one problem on the device with precision FP8_BLOCKWISE (outputs and
// workspaces poisoned first), and megamoe_quantize_experts' outputs against cuda::launch_quantize_blocks' bits.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "cuda_test_util.h"
#include "fp8_test_util.h"
#include "grouped_test_util.h"
#include "portable/fp8_quant.h"
#include "test_util.h"

namespace megamoe::test {

struct LayerCase {
    const char* name;
    bool grouped;
    int64_t tokens, hidden, inter, experts, topk;  // grouped: tokens = R rows, topk = 1
    Routing routing = Routing::kRandom;            // the whole layer's topk_ids
    std::vector<int64_t> counts;                   // grouped: rows per expert (their sum may be below R: padding)
    bool weighted = true;                          // grouped: scores given
    megamoe_dtype_t dtype = MEGAMOE_DTYPE_BF16;
    megamoe_dtype_t weights_dtype = MEGAMOE_DTYPE_F32;  // topk_weights / scores (and their gradient)
    bool f32_grads = false;                             // dw13 / dw2 in f32 (else the dtype of x)
    bool drop_every_slot = false;                       // the whole layer: every topk_ids -1

    megamoe_dtype_t grad_dtype() const { return f32_grads ? MEGAMOE_DTYPE_F32 : dtype; }
};

inline LayerCase whole_case(const char* name, int64_t T, int64_t H, int64_t I, int64_t E, int64_t topk,
                            Routing routing = Routing::kRandom) {
    LayerCase c{name, false, T, H, I, E, topk};
    c.routing = routing;
    return c;
}

inline LayerCase grouped_case(const char* name, int64_t R, int64_t H, int64_t I, std::vector<int64_t> counts,
                              bool weighted = true) {
    LayerCase c{name, true, R, H, I, static_cast<int64_t>(counts.size()), 1};
    c.counts = std::move(counts);
    c.weighted = weighted;
    return c;
}

inline std::ostream& operator<<(std::ostream& os, const LayerCase& c) {
    return os << c.name << (c.grouped ? " (grouped, R=" : " (T=") << c.tokens << " H=" << c.hidden << " I=" << c.inter
              << " E=" << c.experts << " topk=" << c.topk << ", seed " << fresh_seed() << ")";
}

// N(0, sigma) times 2^j, j in [-3, 3] drawn per (block of block_rows rows, 128-column group) of the last dimension:
// 128 for the weights' blocks, 1 for the activations' rows.
inline HostTensor varied(megamoe_dtype_t dtype, const std::vector<int64_t>& dims, int64_t block_rows, double sigma,
                         std::mt19937_64& rng) {
    HostTensor values(dtype, dims);
    const int64_t cols = dims.back(), rows = values.size() / std::max<int64_t>(cols, 1);
    const int64_t groups = ceil_div(cols, kGroup);
    std::normal_distribution<double> normal(0.0, sigma);
    std::uniform_int_distribution<int> exponent(-3, 3);
    std::vector<int> exponents(static_cast<size_t>(ceil_div(rows, block_rows) * groups));
    for (int& j : exponents) j = exponent(rng);
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t col = 0; col < cols; ++col) {
            const int j = exponents[static_cast<size_t>((r / block_rows) * groups + col / kGroup)];
            values.set(r * cols + col, std::ldexp(normal(rng), j));
        }
    }
    return values;
}

// A case's host data: x, dy (dout), the weights, and topk_ids [T, topk] or tokens_per_expert [E] (route), with
// topk_weights [T, topk] or scores [R] (weights; absent for unweighted grouped rows).
struct LayerData {
    LayerCase c;
    HostTensor x, dy, w13, w2, route, weights;

    int64_t num_slots() const { return c.tokens * c.topk; }  // grouped: R
    bool weighted() const { return !c.grouped || c.weighted; }
};

inline LayerData make_layer(const LayerCase& c) {
    std::mt19937_64 rng(fresh_seed() ^ std::hash<std::string>{}(c.name));
    const int64_t T = c.tokens, H = c.hidden, I = c.inter, E = c.experts;
    LayerData d{c,
                varied(c.dtype, {T, H}, 1, 0.5, rng),
                varied(c.dtype, {T, H}, 1, 1.0, rng),
                varied(c.dtype, {E, 2 * I, H}, kGroup, 1.0 / std::sqrt(static_cast<double>(H)), rng),
                varied(c.dtype, {E, H, I}, kGroup, 1.0 / std::sqrt(static_cast<double>(I)), rng),
                HostTensor(),
                HostTensor()};
    if (T > 1) {  // x row 0's first group zero: scale 1, zero bytes
        for (int64_t col = 0; col < kGroup; ++col) d.x.set(col, 0.0);
    }
    std::uniform_real_distribution<double> uniform(0.05, 1.0);
    if (c.grouped) {
        d.route = HostTensor(MEGAMOE_DTYPE_I32, {E});
        for (int64_t e = 0; e < E; ++e) d.route.set(e, static_cast<double>(c.counts[static_cast<size_t>(e)]));
        if (c.weighted) d.weights = HostTensor(c.weights_dtype, {T});
    } else {
        Problem problem{T, H, I, E, c.topk};
        problem.dtype = MEGAMOE_DTYPE_F32;
        problem.routing = c.routing;
        problem.make(rng);
        d.route = problem.ids;
        if (c.drop_every_slot) d.route.fill(-1.0);
        d.weights = HostTensor(c.weights_dtype, {T, c.topk});
    }
    if (d.weighted()) {  // an absent HostTensor has no data (its size() is the empty product, 1)
        for (int64_t idx = 0; idx < d.weights.size(); ++idx) d.weights.set(idx, uniform(rng));
    }
    return d;
}

// The sorted rows: expert e's rows [offsets[e], offsets[e + 1]), the slots of e in slot order (grouped: the rows of
// x_sorted as they are). gathered: A = x or dy by slot; sorted: A = the sorted rows (a, dh). Per row: its token (row of
// x, y, dx), its slot (of topk_weights, d topk_weights) and its weight s (1 for unweighted grouped rows).
struct SortedRows {
    RowMap gathered, sorted;
    std::vector<int64_t> token, slot, expert;
    std::vector<double> weight;
    DeviceTensor offsets, tiles, slots;

    int64_t rows() const { return gathered.rows(); }
    const int* slots_ptr() const {
        return gathered.slots.empty() ? nullptr : static_cast<const int*>(slots.view().data);
    }
};

inline SortedRows sort_rows(const LayerData& d) {
    SortedRows s;
    const int64_t E = d.c.experts;
    std::vector<int> slots;
    for (int64_t e = 0; e < E; ++e) {
        int64_t count = 0;
        if (d.c.grouped) {
            count = d.c.counts[static_cast<size_t>(e)];
            for (int64_t i = 0; i < count; ++i) slots.push_back(static_cast<int>(s.gathered.offsets.back() + i));
        } else {
            for (int64_t slot = 0; slot < d.num_slots(); ++slot) {
                if (static_cast<int64_t>(d.route.get(slot)) != e) continue;
                slots.push_back(static_cast<int>(slot));
                ++count;
            }
        }
        s.gathered.offsets.push_back(s.gathered.offsets.back() + static_cast<int>(count));
        s.gathered.tiles.push_back(s.gathered.tiles.back() + static_cast<int>(ceil_div(count, cuda::kGemmBlockM)));
        for (int64_t i = 0; i < count; ++i) s.expert.push_back(e);
    }
    for (const int slot : slots) {
        s.slot.push_back(slot);
        s.token.push_back(slot / d.c.topk);
        s.weight.push_back(d.weighted() ? d.weights.get(slot) : 1.0);
    }
    s.gathered.topk = d.c.topk;
    s.gathered.num_a_rows = d.c.tokens;
    if (!d.c.grouped) s.gathered.slots = slots;
    s.sorted.offsets = s.gathered.offsets;
    s.sorted.tiles = s.gathered.tiles;
    s.sorted.num_a_rows = s.rows();
    s.offsets = upload_ints(s.gathered.offsets);
    s.tiles = upload_ints(s.gathered.tiles);
    if (!slots.empty()) s.slots = upload_ints(slots);
    return s;
}

// megamoe_fp8_experts_t's six tensors on the device.
struct DeviceFp8Experts {
    DeviceTensor w13, w13_t, w13_scales, w2, w2_t, w2_scales;

    DeviceFp8Experts(int64_t E, int64_t H, int64_t I)
        : w13(contiguous_view(MEGAMOE_DTYPE_E4M3, {E, 2 * I, H})),
          w13_t(contiguous_view(MEGAMOE_DTYPE_E4M3, {E, H, 2 * I})),
          w13_scales(contiguous_view(MEGAMOE_DTYPE_F32, {E, ceil_div(2 * I, kGroup), ceil_div(H, kGroup)})),
          w2(contiguous_view(MEGAMOE_DTYPE_E4M3, {E, H, I})),
          w2_t(contiguous_view(MEGAMOE_DTYPE_E4M3, {E, I, H})),
          w2_scales(contiguous_view(MEGAMOE_DTYPE_F32, {E, ceil_div(H, kGroup), ceil_div(I, kGroup)})) {}

    megamoe_fp8_experts_t view() const {
        return {w13.view(), w13_t.view(), w13_scales.view(), w2.view(), w2_t.view(), w2_scales.view()};
    }
    std::vector<DeviceTensor*> all() { return {&w13, &w13_t, &w13_scales, &w2, &w2_t, &w2_scales}; }
};

// The host copies the reference reads: the weights and their transposed copies (B of the data gradients: the scales
// of the weight read transposed).
struct HostFp8Experts {
    Fp8Host w13, w13_t, w2, w2_t;
};

inline Fp8Host fp8_host(const DeviceTensor& q, const DeviceTensor& scales, bool transposed) {
    const HostTensor q_host = q.download(), scales_host = scales.download();
    Fp8Host out;
    out.q.assign(q_host.bytes.begin(), q_host.bytes.begin() + q_host.size());
    out.scales.resize(static_cast<size_t>(scales_host.size()));
    std::memcpy(out.scales.data(), scales_host.bytes.data(), out.scales.size() * sizeof(float));
    out.scales_transposed = transposed;
    return out;
}

inline HostFp8Experts download_fp8(const DeviceFp8Experts& fp8) {
    return {fp8_host(fp8.w13, fp8.w13_scales, false), fp8_host(fp8.w13_t, fp8.w13_scales, true),
            fp8_host(fp8.w2, fp8.w2_scales, false), fp8_host(fp8.w2_t, fp8.w2_scales, true)};
}

// One problem on the device and its C API calls, precision FP8_BLOCKWISE. Outputs: y (out), saved_h, dx (dx_sorted),
// dweights (d topk_weights / dscores), dw13, dw2. keep_h: the forward writes saved_h and the backward reads it;
// want_dx: the backward writes dx; fp8_view: the FP8 weights the calls pass (a test may drop those a call does not
// read). Each call sizes its workspace (reallocated only when it grows: never during a graph capture, after eager
// runs).
struct DeviceLayer {
    const LayerData& data;
    DeviceTensor x, dy, w13, w2, route, weights;
    DeviceTensor y, saved_h, dx, dweights, dw13, dw2, forward_workspace, backward_workspace;
    DeviceFp8Experts fp8;
    megamoe_fp8_experts_t fp8_view;
    cudaStream_t stream = nullptr;
    bool keep_h = true, want_dx = true, accumulate = false;
    // Applied to every call's params: the options the FP8 kernels refuse (layout, activation, biases).
    std::function<void(megamoe_layout_t&, megamoe_activation_t&, megamoe_tensor_t& b13, megamoe_tensor_t& b2)> options;

    explicit DeviceLayer(const LayerData& d)
        : data(d),
          x(DeviceTensor::upload(d.x)),
          dy(DeviceTensor::upload(d.dy)),
          w13(DeviceTensor::upload(d.w13)),
          w2(DeviceTensor::upload(d.w2)),
          route(DeviceTensor::upload(d.route)),
          weights(d.weighted() ? DeviceTensor::upload(d.weights) : DeviceTensor()),
          y(d.x.view),
          saved_h(contiguous_view(d.c.dtype, {d.num_slots(), 2 * d.c.inter})),
          dx(d.x.view),
          dweights(d.weighted() ? DeviceTensor(d.weights.view) : DeviceTensor()),
          dw13(contiguous_view(d.c.grad_dtype(), {d.c.experts, 2 * d.c.inter, d.c.hidden})),
          dw2(contiguous_view(d.c.grad_dtype(), {d.c.experts, d.c.hidden, d.c.inter})),
          fp8(d.c.experts, d.c.hidden, d.c.inter),
          fp8_view(fp8.view()) {}

    megamoe_status_t quantize() {
        const megamoe_tensor_t w13_view = w13.view(), w2_view = w2.view();
        const megamoe_fp8_experts_t out = fp8.view();
        return megamoe_quantize_experts(&w13_view, &w2_view, &out, stream);
    }

    megamoe_status_t forward(megamoe_path_t* path = nullptr) {
        const megamoe_tensor_t h = keep_h ? saved_h.view() : megamoe_tensor_t{};
        if (data.c.grouped) {
            megamoe_grouped_forward_params_t p{};
            p.x_sorted = x.view();
            p.tokens_per_expert = route.view();
            p.scores = weights.view();
            p.w13 = w13.view();
            p.w2 = w2.view();
            p.out = y.view();
            p.saved_h = h;
            return call(p, megamoe_grouped_forward_workspace_size, megamoe_grouped_forward_path,
                        megamoe_grouped_forward, forward_workspace, path);
        }
        megamoe_forward_params_t p{};
        p.x = x.view();
        p.topk_ids = route.view();
        p.topk_weights = weights.view();
        p.w13 = w13.view();
        p.w2 = w2.view();
        p.y = y.view();
        p.saved_h = h;
        return call(p, megamoe_forward_workspace_size, megamoe_forward_path, megamoe_forward, forward_workspace, path);
    }

    megamoe_status_t backward(megamoe_path_t* path = nullptr) {
        const megamoe_tensor_t h = keep_h ? saved_h.view() : megamoe_tensor_t{};
        const megamoe_tensor_t dx_view = want_dx ? dx.view() : megamoe_tensor_t{};
        if (data.c.grouped) {
            megamoe_grouped_backward_params_t p{};
            p.dout = dy.view();
            p.x_sorted = x.view();
            p.tokens_per_expert = route.view();
            p.scores = weights.view();
            p.w13 = w13.view();
            p.w2 = w2.view();
            p.saved_h = h;
            p.dx_sorted = dx_view;
            p.dscores = dweights.view();
            p.dw13 = dw13.view();
            p.dw2 = dw2.view();
            p.accumulate_weight_grads = accumulate ? 1 : 0;
            return call(p, megamoe_grouped_backward_workspace_size, megamoe_grouped_backward_path,
                        megamoe_grouped_backward, backward_workspace, path);
        }
        megamoe_backward_params_t p{};
        p.dy = dy.view();
        p.x = x.view();
        p.topk_ids = route.view();
        p.topk_weights = weights.view();
        p.w13 = w13.view();
        p.w2 = w2.view();
        p.saved_h = h;
        p.dx = dx_view;
        p.dtopk_weights = dweights.view();
        p.dw13 = dw13.view();
        p.dw2 = dw2.view();
        p.accumulate_weight_grads = accumulate ? 1 : 0;
        return call(p, megamoe_backward_workspace_size, megamoe_backward_path, megamoe_backward, backward_workspace,
                    path);
    }

    // The outputs of the next forward (and the forward's workspace) NaN.
    void poison_forward() {
        for (DeviceTensor* t : {&y, &saved_h, &forward_workspace}) poison_if_present(t);
    }
    // The backward's outputs (the weight gradients unless accumulated into) and workspace NaN; saved_h holds `h`.
    void poison_backward(const HostTensor* h) {
        for (DeviceTensor* t : {&dx, &dweights, &backward_workspace}) poison_if_present(t);
        if (!accumulate) {
            for (DeviceTensor* t : {&dw13, &dw2}) poison_if_present(t);
        }
        if (h != nullptr) upload_into(saved_h, *h);
    }
    static void poison_if_present(DeviceTensor* t) {
        if (t->view().data != nullptr) t->poison();
    }
    static void upload_into(DeviceTensor& t, const HostTensor& host) {
        expect_cuda(cudaMemcpy(t.view().data, host.view.data, host.bytes.size() - 1, cudaMemcpyHostToDevice), "upload");
    }

    size_t last_workspace_bytes = 0;  // what the last call's size query asked for

  private:
    template <typename Params>
    megamoe_status_t call(Params& p, megamoe_status_t (*query)(const Params*, size_t*),
                          megamoe_status_t (*which)(const Params*, megamoe_path_t*),
                          megamoe_status_t (*run)(const Params*), DeviceTensor& workspace, megamoe_path_t* path) {
        p.precision = MEGAMOE_PRECISION_FP8_BLOCKWISE;
        p.fp8 = fp8_view;
        p.stream = stream;
        if (options) options(p.layout, p.activation, p.b13, p.b2);
        if (path != nullptr) return which(&p, path);
        size_t bytes = 0;
        const megamoe_status_t status = query(&p, &bytes);
        if (status != MEGAMOE_STATUS_SUCCESS) return status;
        if (workspace.view().data == nullptr || static_cast<size_t>(numel(workspace.view())) * 4 < bytes) {
            workspace = device_workspace(bytes);  // poisoned, as the callers' poisoning of the old one
            expect_cuda(cudaDeviceSynchronize(), "poison");
        }
        p.workspace = workspace.view().data;
        p.workspace_bytes = bytes;
        last_workspace_bytes = bytes;
        return run(&p);
    }
};

// The calls, outputs and workspaces poisoned first.
struct ForwardOut {
    HostTensor y, saved_h;
};
inline ForwardOut run_forward(DeviceLayer& layer) {
    layer.poison_forward();
    expect_cuda(cudaDeviceSynchronize(), "poison");
    EXPECT_EQ(layer.forward(), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
    expect_cuda(cudaDeviceSynchronize(), "forward");
    return {layer.y.download(), layer.saved_h.download()};
}

struct BackwardOut {
    HostTensor dx, dweights, dw13, dw2;
};
// `h`: what saved_h holds before a keep-h backward (it consumes it).
inline BackwardOut run_backward(DeviceLayer& layer, const HostTensor& h) {
    layer.poison_backward(layer.keep_h ? &h : nullptr);
    expect_cuda(cudaDeviceSynchronize(), "poison");
    EXPECT_EQ(layer.backward(), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
    expect_cuda(cudaDeviceSynchronize(), "backward");
    return {layer.want_dx ? layer.dx.download() : HostTensor(),
            layer.dweights.view().data != nullptr ? layer.dweights.download() : HostTensor(), layer.dw13.download(),
            layer.dw2.download()};
}

inline void expect_same_bits(const BackwardOut& a, const BackwardOut& b, const std::string& what, bool dx = true) {
    if (dx) EXPECT_EQ(a.dx.bytes, b.dx.bytes) << what << ": dx differs";
    EXPECT_EQ(a.dweights.bytes, b.dweights.bytes) << what << ": d topk_weights / dscores differs";
    EXPECT_EQ(a.dw13.bytes, b.dw13.bytes) << what << ": dw13 differs";
    EXPECT_EQ(a.dw2.bytes, b.dw2.bytes) << what << ": dw2 differs";
}

// launch_quantize_blocks' q, q_t and scales of w [E, n, k].
inline std::vector<HostTensor> quantize_blocks(const DeviceTensor& w, int64_t E, int64_t n, int64_t k) {
    DeviceTensor q(contiguous_view(MEGAMOE_DTYPE_E4M3, {E, n, k})), q_t(contiguous_view(MEGAMOE_DTYPE_E4M3, {E, k, n}));
    DeviceTensor scales(contiguous_view(MEGAMOE_DTYPE_F32, {E, ceil_div(n, kGroup), ceil_div(k, kGroup)}));
    const cuda::QuantizeBlocksArgs args{w.view().data,
                                        w.view().dtype,
                                        E,
                                        n,
                                        k,
                                        static_cast<uint8_t*>(q.view().data),
                                        static_cast<uint8_t*>(q_t.view().data),
                                        static_cast<float*>(scales.view().data),
                                        false};
    return run({&q, &q_t, &scales}, [&] { return cuda::launch_quantize_blocks(args, nullptr); });
}

// f32 scales: the same bits, or both NaN.
inline void expect_same_scales(const HostTensor& got, const HostTensor& want, const char* what) {
    int64_t bad = 0;
    for (int64_t i = 0; i < want.size(); ++i) {
        const double g = got.get(i), w = want.get(i);
        bad += !(std::isnan(g) && std::isnan(w)) && std::memcmp(got.bytes.data() + 4 * i, want.bytes.data() + 4 * i, 4);
    }
    EXPECT_EQ(bad, 0) << what << ": scales differ from launch_quantize_blocks'";
}

// megamoe_quantize_experts' outputs (already run) bitwise those of launch_quantize_blocks on w13 and w2.
inline void expect_quantized_as_blocks(const DeviceLayer& layer) {
    const LayerCase& c = layer.data.c;
    const std::vector<HostTensor> w13 = quantize_blocks(layer.w13, c.experts, 2 * c.inter, c.hidden);
    const std::vector<HostTensor> w2 = quantize_blocks(layer.w2, c.experts, c.hidden, c.inter);
    EXPECT_EQ(layer.fp8.w13.download().bytes, w13[0].bytes) << "fp8.w13 differs from launch_quantize_blocks' q";
    EXPECT_EQ(layer.fp8.w13_t.download().bytes, w13[1].bytes) << "fp8.w13_t differs from launch_quantize_blocks' q_t";
    expect_same_scales(layer.fp8.w13_scales.download(), w13[2], "fp8.w13_scales");
    EXPECT_EQ(layer.fp8.w2.download().bytes, w2[0].bytes) << "fp8.w2 differs from launch_quantize_blocks' q";
    EXPECT_EQ(layer.fp8.w2_t.download().bytes, w2[1].bytes) << "fp8.w2_t differs from launch_quantize_blocks' q_t";
    expect_same_scales(layer.fp8.w2_scales.download(), w2[2], "fp8.w2_scales");
}

}  // namespace megamoe::test
