// The FP8 weight gradients' expected values for the layer tests (test_fp8_layer_cuda.cpp) when MEGAMOE_FP8_WGRAD=1
// puts them on the K-grouped FP8 GEMM: both operands (the 16-bit rows the layer's backward made, sorted by expert)
// quantized along the rows in the routing's 128-row tiles by launch_quantize_expert_rows on the GPU (its bytes and
// scales bitwise the host rules: Fp8QuantCuda.ExpertRowsAlongTokens), then the recipe over those bytes in f64:
//   grad_e[i, j] = sum over expert e's tiles t of sl[t, i] sr[t, j] sum_{k < 128} L8[i, 128 t + k] R8[j, 128 t + k]
// within c S + u_out |grad| (+ the output's floor where S > 0), c the FP8 accumulation budget (fp8_test_util.h).
#pragma once

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cuda_test_util.h"
#include "fp8_test_util.h"
#include "portable/fp8_quant.h"

namespace megamoe::test {

inline bool fp8_weight_grads_requested() {
    const char* value = std::getenv("MEGAMOE_FP8_WGRAD");
    return value != nullptr && std::string(value) == "1";
}

// Columns of sorted rows quantized along the rows, downloaded: q_t [cols, ld] (tile t at columns [128 t, 128 t + 128)),
// scales [tiles, ld_scales].
struct ExpertColsHost {
    std::vector<uint8_t> q;
    std::vector<float> scales;
    int64_t ld = 0, ld_scales = 0;
};

// rows [R, cols] (16-bit, sorted by expert: map's offsets and tiles, on the device as offsets / tiles) on the GPU.
inline ExpertColsHost quantize_expert_cols(const HostTensor& rows, int64_t cols, const RowMap& map,
                                           const DeviceTensor& offsets, const DeviceTensor& tiles) {
    const int64_t num_tiles = map.tiles.back();
    ExpertColsHost out;
    out.ld = kGroup * std::max<int64_t>(num_tiles, 1);
    out.ld_scales = ceil_div(cols, 4) * 4;
    const DeviceTensor in = DeviceTensor::upload(rows);
    DeviceTensor q(contiguous_view(MEGAMOE_DTYPE_E4M3, {cols, out.ld}));
    DeviceTensor scales(contiguous_view(MEGAMOE_DTYPE_F32, {std::max<int64_t>(num_tiles, 1), out.ld_scales}));
    q.poison();
    scales.poison();
    if (num_tiles > 0) {
        cuda::QuantizeExpertRowsArgs args{};
        args.in = in.view().data;
        args.in_dtype = rows.view.dtype;
        args.cols = cols;
        args.in_row_stride = cols;
        args.sorted_slot = nullptr;
        args.topk = 1;
        args.expert_offsets = static_cast<const int*>(offsets.view().data);
        args.m_tile_offsets = static_cast<const int*>(tiles.view().data);
        args.num_experts = map.experts();
        args.max_tiles = num_tiles;
        args.q_t = static_cast<uint8_t*>(q.view().data);
        args.ld_q = out.ld;
        args.scales = static_cast<float*>(scales.view().data);
        args.ld_scales = out.ld_scales;
        EXPECT_EQ(cuda::launch_quantize_expert_rows(args, nullptr), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
    }
    expect_cuda(cudaDeviceSynchronize(), "quantize_expert_rows");
    const HostTensor q_host = q.download(), scales_host = scales.download();
    out.q.assign(q_host.bytes.begin(), q_host.bytes.begin() + static_cast<std::ptrdiff_t>(cols * out.ld));
    out.scales.resize(static_cast<size_t>(scales_host.size()));
    std::memcpy(out.scales.data(), scales_host.bytes.data(), out.scales.size() * sizeof(float));
    return out;
}

// The K-grouped FP8 GEMM's recipe in f64 over operands in the tile-padded layout, [E, n_a, n_b] with the term sizes S:
//   C_e[i, j] = sum over expert e's tiles t (tile_offsets) of sa[t, i] sb[t, j] sum_{k < 128} A8[i, 128 t + k] B8[j,
//   128 t + k]
inline Expected k_grouped_fp8_reference(const ExpertColsHost& a, int64_t n_a, const ExpertColsHost& b, int64_t n_b,
                                        const std::vector<int>& tile_offsets) {
    const int64_t E = static_cast<int64_t>(tile_offsets.size()) - 1;
    std::vector<double> table(256);
    for (int byte = 0; byte < 256; ++byte) table[static_cast<size_t>(byte)] = e4m3_value(static_cast<uint8_t>(byte));
    Expected out{std::vector<double>(static_cast<size_t>(E * n_a * n_b)),
                 std::vector<double>(static_cast<size_t>(E * n_a * n_b))};
    for (int64_t e = 0; e < E; ++e) {
        for (int64_t tile = tile_offsets[static_cast<size_t>(e)]; tile < tile_offsets[static_cast<size_t>(e) + 1];
             ++tile) {
            for (int64_t i = 0; i < n_a; ++i) {
                const uint8_t* a_row = &a.q[static_cast<size_t>(i * a.ld + tile * kGroup)];
                const double sa = a.scales[static_cast<size_t>(tile * a.ld_scales + i)];
                for (int64_t j = 0; j < n_b; ++j) {
                    const uint8_t* b_row = &b.q[static_cast<size_t>(j * b.ld + tile * kGroup)];
                    double partial = 0.0, partial_size = 0.0;
                    for (int64_t k = 0; k < kGroup; ++k) {
                        const double p = table[a_row[k]] * table[b_row[k]];
                        partial += p;
                        partial_size += std::fabs(p);
                    }
                    const double scale = sa * b.scales[static_cast<size_t>(tile * b.ld_scales + j)];
                    const size_t idx = static_cast<size_t>((e * n_a + i) * n_b + j);
                    out.value[idx] += scale * partial;
                    out.size[idx] += std::fabs(scale) * partial_size;
                }
            }
        }
    }
    return out;
}

// [E, n_left, n_right]: left [R, n_left] and right [R, n_right] the sorted rows (map), quantized on the GPU.
inline Target fp8_weight_grad_target(const RowMap& map, const DeviceTensor& offsets, const DeviceTensor& tiles,
                                     const HostTensor& left, int64_t n_left, const HostTensor& right, int64_t n_right,
                                     double out_rounding, double out_floor) {
    const Expected acc =
        k_grouped_fp8_reference(quantize_expert_cols(left, n_left, map, offsets, tiles), n_left,
                                quantize_expert_cols(right, n_right, map, offsets, tiles), n_right, map.tiles);
    Target t{acc.value, std::vector<double>(acc.value.size())};
    for (size_t i = 0; i < t.want.size(); ++i) {
        t.bound[i] =
            kAccumulation * acc.size[i] + out_rounding * std::fabs(t.want[i]) + (acc.size[i] > 0.0 ? out_floor : 0.0);
    }
    return t;
}

// The sorted rows of a token-major tensor [T, cols]: row r is token[r]'s.
inline HostTensor gather_rows(const HostTensor& tokens, const std::vector<int64_t>& token, int64_t cols) {
    HostTensor out(tokens.view.dtype, {static_cast<int64_t>(token.size()), cols});
    const size_t row_bytes = static_cast<size_t>(cols) * dtype_size(tokens.view.dtype);
    for (size_t r = 0; r < token.size(); ++r) {
        std::memcpy(out.bytes.data() + r * row_bytes, tokens.bytes.data() + static_cast<size_t>(token[r]) * row_bytes,
                    row_bytes);
    }
    return out;
}

}  // namespace megamoe::test
