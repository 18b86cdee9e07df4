// The FP8 backward with the transposed weights absent (megamoe.h's megamoe_fp8_experts_t: one byte per weight element
// held between calls, the backward transposing w2 / w13 into its workspace), on a compute capability 9.0 GPU:
//   - cuda::launch_transpose_bytes against a host transpose on ragged extents (not multiples of the 128 x 128 tile nor
//     of the 16-byte chunk, a batch of 1, a single byte, empty extents, misaligned pointers), its output and a guard
//     past it poisoned first: every output byte written with its input byte, none past the output;
//   - megamoe_quantize_experts with w13_t / w2_t absent: w13, w2 and the scales bitwise those of the call given all
//   six;
//   - the backward (whole layer and grouped rows; keep-h and recompute; with and without dx) with w2_t, w13_t or both
//     absent: dx, d topk_weights / dscores, dw13 and dw2 bitwise those of the same call given both, outputs and
//     workspace poisoned first; the workspace query larger by the transposed buffer exactly (E * 2I * H bytes where
//     w13_t is made, else E * I * H where w2_t is, 256-byte aligned), the same where the call makes none.
// Every test skips without a compute capability 9.0 device (the kernels are built for sm_90a alone).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cuda_test_util.h"
#include "fp8_layer_test_util.h"
#include "portable/byte_transpose.h"

namespace megamoe::test {
namespace {

constexpr int64_t kGuardBytes = 512;  // poisoned bytes past the transpose's output, never written

struct TransposeCase {
    int64_t batch, rows, cols;
    int64_t in_offset = 0, out_offset = 0;  // bytes past a 256-byte aligned allocation

    std::string name() const {
        std::ostringstream os;
        os << "batch " << batch << ", rows " << rows << ", cols " << cols << ", in + " << in_offset << ", out + "
           << out_offset;
        return os.str();
    }
};

void check_transpose(const TransposeCase& c) {
    SCOPED_TRACE(c.name());
    const int64_t n = c.batch * c.rows * c.cols;
    std::mt19937_64 rng(fresh_seed() + static_cast<uint64_t>(n));
    HostTensor in(MEGAMOE_DTYPE_E4M3, {n});
    for (int64_t i = 0; i < n; ++i) in.bytes[static_cast<size_t>(i)] = static_cast<unsigned char>(rng());
    const DeviceTensor in_dev = DeviceTensor::upload(in, c.in_offset);
    DeviceTensor out_dev(contiguous_view(MEGAMOE_DTYPE_E4M3, {n + kGuardBytes}), c.out_offset);
    out_dev.poison();
    cuda::TransposeBytesArgs args{};
    args.in = static_cast<const uint8_t*>(in_dev.view().data);
    args.out = static_cast<uint8_t*>(out_dev.view().data);
    args.batch = c.batch;
    args.rows = c.rows;
    args.cols = c.cols;
    ASSERT_EQ(cuda::launch_transpose_bytes(args, nullptr), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
    expect_cuda(cudaDeviceSynchronize(), "transpose_bytes");
    const HostTensor out = out_dev.download();
    int64_t wrong = 0;
    std::string first;
    for (int64_t b = 0; b < c.batch; ++b) {
        for (int64_t r = 0; r < c.rows; ++r) {
            for (int64_t col = 0; col < c.cols; ++col) {
                const unsigned char want = in.bytes[static_cast<size_t>((b * c.rows + r) * c.cols + col)];
                const unsigned char got = out.bytes[static_cast<size_t>((b * c.cols + col) * c.rows + r)];
                if (got == want) continue;
                if (wrong++ == 0) {
                    first = "(" + std::to_string(b) + ", " + std::to_string(col) + ", " + std::to_string(r) + ")";
                }
            }
        }
    }
    EXPECT_EQ(wrong, 0) << "output bytes differ from the host transpose, the first at " << first;
    int64_t overrun = 0;
    for (int64_t i = n; i < n + kGuardBytes; ++i) overrun += out.bytes[static_cast<size_t>(i)] != 0xFF;
    EXPECT_EQ(overrun, 0) << "bytes written past the output";
}

TEST(Fp8TransposeCuda, MatchesHostTranspose) {
    SKIP_WITHOUT_SM90();
    const TransposeCase cases[] = {
        {1, 1, 1},            // one byte
        {1, 5, 3},            // inside one tile, byte by byte
        {3, 130, 257},        // partial tiles at both edges, odd extents
        {2, 17, 300},         // rows not a multiple of 16
        {1, 300, 17},         // cols not a multiple of 16
        {2, 128, 128},        // one whole tile an item, 16-byte chunks
        {4, 16, 48},          // chunked, partial tiles only
        {3, 144, 272},        // chunked, whole and partial tiles
        {5, 256, 384},        // w13 [E, 2I, H] of E = 5, I = 128, H = 384
        {5, 384, 128},        // w2 [E, H, I] likewise
        {1, 1, 4096},         // a single row
        {1, 4096, 1},         // a single column
        {2, 128, 256, 1, 0},  // in misaligned: byte by byte
        {2, 128, 256, 0, 3},  // out misaligned
        {0, 128, 128},        // nothing to do
        {2, 0, 64},           // nothing to do
    };
    for (const TransposeCase& c : cases) check_transpose(c);
}

// megamoe_quantize_experts with the transposed copies absent writes w13, w2 and the scales as with them.
TEST(Fp8OneCopyCuda, QuantizeWithoutTransposedCopies) {
    SKIP_WITHOUT_SM90();
    const LayerData d = make_layer(whole_case("quantize one copy", 4, 384, 256, 3, 1));
    DeviceLayer full(d), one(d);
    for (DeviceTensor* t : one.fp8.all()) t->poison();
    ASSERT_EQ(full.quantize(), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
    const megamoe_tensor_t w13 = one.w13.view(), w2 = one.w2.view();
    megamoe_fp8_experts_t out = one.fp8.view();
    out.w13_t = out.w2_t = megamoe_tensor_t{};
    ASSERT_EQ(megamoe_quantize_experts(&w13, &w2, &out, nullptr), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
    expect_cuda(cudaDeviceSynchronize(), "megamoe_quantize_experts");
    EXPECT_EQ(one.fp8.w13.download().bytes, full.fp8.w13.download().bytes) << "fp8.w13";
    EXPECT_EQ(one.fp8.w2.download().bytes, full.fp8.w2.download().bytes) << "fp8.w2";
    EXPECT_EQ(one.fp8.w13_scales.download().bytes, full.fp8.w13_scales.download().bytes) << "fp8.w13_scales";
    EXPECT_EQ(one.fp8.w2_scales.download().bytes, full.fp8.w2_scales.download().bytes) << "fp8.w2_scales";
    for (const DeviceTensor* t : {&one.fp8.w13_t, &one.fp8.w2_t}) {  // the absent copies' memory untouched
        const HostTensor untouched = t->download();
        EXPECT_EQ(std::count(untouched.bytes.begin(), untouched.bytes.end() - 1, 0xFF), untouched.size());
    }
}

size_t aligned(int64_t bytes) {
    return static_cast<size_t>((bytes + 255) / 256 * 256);
}

// One case: every combination of keep-h / recompute, dx / no dx, and w2_t, w13_t or both absent, against the call
// given both.
void check_one_copy(const LayerCase& c) {
    SCOPED_TRACE(::testing::PrintToString(c));
    const LayerData d = make_layer(c);
    const int64_t E = c.experts, H = c.hidden, I = c.inter;
    DeviceLayer layer(d);
    ASSERT_EQ(layer.quantize(), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
    const ForwardOut forward = run_forward(layer);
    const struct {
        const char* what;
        bool w2_t, w13_t;  // absent
    } drops[] = {{"w2_t absent", true, false}, {"w13_t absent", false, true}, {"w2_t and w13_t absent", true, true}};
    for (const bool keep_h : {true, false}) {
        for (const bool want_dx : {true, false}) {
            layer.keep_h = keep_h;
            layer.want_dx = want_dx;
            layer.fp8_view = layer.fp8.view();
            const BackwardOut given = run_backward(layer, forward.saved_h);
            const size_t given_bytes = layer.last_workspace_bytes;
            for (const auto& drop : drops) {
                const std::string what =
                    std::string(drop.what) + (keep_h ? ", keep-h" : ", recompute") + (want_dx ? ", dx" : ", no dx");
                layer.fp8_view = layer.fp8.view();
                if (drop.w2_t) layer.fp8_view.w2_t = megamoe_tensor_t{};
                if (drop.w13_t) layer.fp8_view.w13_t = megamoe_tensor_t{};
                megamoe_path_t path = MEGAMOE_PATH_REFERENCE;
                ASSERT_EQ(layer.backward(&path), MEGAMOE_STATUS_SUCCESS) << what << ": " << megamoe_last_error();
                EXPECT_EQ(path, MEGAMOE_PATH_SM90_FP8) << what;
                const BackwardOut one = run_backward(layer, forward.saved_h);
                expect_same_bits(given, one, what, want_dx);
                const bool makes_w13_t = drop.w13_t && want_dx;
                const int64_t extra = makes_w13_t ? E * 2 * I * H : drop.w2_t ? E * I * H : 0;
                EXPECT_EQ(layer.last_workspace_bytes, given_bytes + (extra > 0 ? aligned(extra) : 0))
                    << what << ": the workspace query";
            }
        }
    }
    layer.fp8_view = layer.fp8.view();
}

TEST(Fp8OneCopyCuda, BackwardWithoutTransposedCopiesIsBitwise) {
    SKIP_WITHOUT_SM90();
    std::mt19937_64 rng(fresh_seed() + 21);
    std::vector<LayerCase> cases = {
        whole_case("E = 1, T = 3", 3, 128, 128, 1, 1),
        whole_case("dropped slots, topk 2, H = 256, I = 384", 150, 256, 384, 6, 2, Routing::kSomeDropped),
        whole_case("f16, f32 weight gradients, E = 16", 120, 384, 128, 16, 3),
        grouped_case("grouped rows with padding, I = 256", 200, 128, 256, random_counts(5, 180, {1}, rng)),
    };
    cases[2].dtype = cases[2].weights_dtype = MEGAMOE_DTYPE_F16;
    cases[2].f32_grads = true;
    for (const LayerCase& c : cases) check_one_copy(c);
}

}  // namespace
}  // namespace megamoe::test
