// The C API of precision FP8_BLOCKWISE without a GPU (megamoe.h: megamoe_precision_t, megamoe_fp8_experts_t,
// megamoe_quantize_experts), on CPU tensors: validation runs before the device check, so
//   - each FP8 tensor a call reads (forward: fp8.w13, fp8.w13_scales, fp8.w2, fp8.w2_scales; backward: fp8.w2_t,
//     fp8.w2_scales, fp8.w13_scales, fp8.w13_t when dx is wanted, fp8.w13 when saved_h is absent) misshapen, of the
//     wrong dtype or rank, or on another device is INVALID_ARGUMENT naming it, from the call, the workspace size query
//     and the path query alike, and so is each it needs absent; those it does not read may be absent, and so may the
//     backward's transposed copies, whose absence makes the weight they are transposed from needed (fp8.w2 for
//     fp8.w2_t, fp8.w13 for fp8.w13_t with dx): its absence too is INVALID_ARGUMENT naming both;
//   - an unknown precision code is INVALID_ARGUMENT naming `precision`; FP8 tensors given with precision DEFAULT are
//     INVALID_ARGUMENT naming them (fp8.*);
//   - a valid FP8 call on CPU tensors is NOT_SUPPORTED with a message naming FP8 (the same call in DEFAULT runs);
//   - e4m3 is refused wherever a 16-bit or f32 tensor is expected (x, the weights, outputs);
//   - megamoe_quantize_experts refuses NULL arguments, CPU tensors and bad dtypes, naming the argument;
//   - the ABI: version 5, megamoe_struct_size(MEGAMOE_STRUCT_FP8_EXPERTS), the path name "sm90-fp8".
// The whole layer and grouped rows (megamoe_grouped_*) alike. The GPU side is test_fp8_layer_cuda.cpp.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "grouped_test_util.h"
#include "test_util.h"

namespace megamoe::test {
namespace {

constexpr int64_t kT = 4, kH = 128, kI = 128, kE = 2, kTopk = 2, kR = 6;

enum class Entry { kForward, kBackward, kGroupedForward, kGroupedBackward };
const Entry kEntries[] = {Entry::kForward, Entry::kBackward, Entry::kGroupedForward, Entry::kGroupedBackward};

const char* entry_name(Entry entry) {
    switch (entry) {
        case Entry::kForward:
            return "megamoe_forward";
        case Entry::kBackward:
            return "megamoe_backward";
        case Entry::kGroupedForward:
            return "megamoe_grouped_forward";
        case Entry::kGroupedBackward:
            return "megamoe_grouped_backward";
    }
    return "?";
}
bool is_backward(Entry entry) {
    return entry == Entry::kBackward || entry == Entry::kGroupedBackward;
}

const char* const kFp8Names[] = {"fp8.w13", "fp8.w13_t", "fp8.w13_scales", "fp8.w2", "fp8.w2_t", "fp8.w2_scales"};

megamoe_tensor_t& fp8_field(megamoe_fp8_experts_t& fp8, const std::string& name) {
    megamoe_tensor_t* fields[] = {&fp8.w13, &fp8.w13_t, &fp8.w13_scales, &fp8.w2, &fp8.w2_t, &fp8.w2_scales};
    for (size_t i = 0; i < 6; ++i) {
        if (name == kFp8Names[i]) return *fields[i];
    }
    ADD_FAILURE() << "no field " << name;
    return fp8.w13;
}

// The FP8 copies' shapes for E, H, I (host buffers: the CPU calls never read them).
std::vector<int64_t> fp8_shape(const std::string& name, int64_t E, int64_t H, int64_t I) {
    if (name == "fp8.w13") return {E, 2 * I, H};
    if (name == "fp8.w13_t") return {E, H, 2 * I};
    if (name == "fp8.w13_scales") return {E, 2 * I / 128, H / 128};
    if (name == "fp8.w2") return {E, H, I};
    if (name == "fp8.w2_t") return {E, I, H};
    return {E, H / 128, I / 128};
}

struct HostFp8 {
    std::vector<HostTensor> tensors;  // in kFp8Names' order
    HostFp8() {
        for (const char* name : kFp8Names) {
            const bool scales = std::string(name).find("scales") != std::string::npos;
            tensors.emplace_back(scales ? MEGAMOE_DTYPE_F32 : MEGAMOE_DTYPE_E4M3, fp8_shape(name, kE, kH, kI));
        }
    }
    megamoe_fp8_experts_t view() const {
        return {tensors[0].view, tensors[1].view, tensors[2].view, tensors[3].view, tensors[4].view, tensors[5].view};
    }
};

// One CPU problem of each entry point (bf16, H = I = 128 so that only the device keeps the FP8 kernels off it).
struct CpuLayer {
    Problem whole{kT, kH, kI, kE, kTopk};
    GroupedProblem grouped{kR, kH, kI, {2, 3}};  // a padding row
    HostTensor y, saved_h, dx, dtopk, dw13, dw2, out, grouped_h, dx_sorted, dscores, grouped_dw13, grouped_dw2;
    HostFp8 fp8;

    CpuLayer() {
        std::mt19937_64 rng(fresh_seed());
        whole.dtype = grouped.dtype = MEGAMOE_DTYPE_BF16;
        grouped.scores_dtype = MEGAMOE_DTYPE_F32;
        whole.make(rng);
        grouped.make(rng);
        y = dx = HostTensor(MEGAMOE_DTYPE_BF16, {kT, kH});
        saved_h = HostTensor(MEGAMOE_DTYPE_BF16, {kT * kTopk, 2 * kI});
        dtopk = HostTensor(MEGAMOE_DTYPE_F32, {kT, kTopk});
        dw13 = grouped_dw13 = HostTensor(MEGAMOE_DTYPE_BF16, {kE, 2 * kI, kH});
        dw2 = grouped_dw2 = HostTensor(MEGAMOE_DTYPE_BF16, {kE, kH, kI});
        out = dx_sorted = HostTensor(MEGAMOE_DTYPE_BF16, {kR, kH});
        grouped_h = HostTensor(MEGAMOE_DTYPE_BF16, {kR, 2 * kI});
        dscores = HostTensor(MEGAMOE_DTYPE_F32, {kR});
    }
};

// A call's params: precision, fp8, saved_h and dx given or not, then `mutate` on the params (any of the four).
struct Options {
    megamoe_precision_t precision = MEGAMOE_PRECISION_FP8_BLOCKWISE;
    bool with_h = false, with_dx = true;
    std::function<void(megamoe_fp8_experts_t&)> fp8;
    std::function<void(megamoe_forward_params_t&)> forward;
    std::function<void(megamoe_backward_params_t&)> backward;
};

struct Outcome {
    megamoe_status_t call, workspace, path;
    std::string message;
};

template <typename Params>
Outcome attempt(Params& p, megamoe_status_t (*query)(const Params*, size_t*),
                megamoe_status_t (*which)(const Params*, megamoe_path_t*), megamoe_status_t (*run)(const Params*)) {
    size_t bytes = 0;
    megamoe_path_t path = MEGAMOE_PATH_SM90;
    Outcome o{};
    o.workspace = query(&p, &bytes);
    o.path = which(&p, &path);
    o.call = run(&p);
    o.message = megamoe_last_error();
    if (o.path == MEGAMOE_STATUS_SUCCESS) EXPECT_EQ(path, MEGAMOE_PATH_REFERENCE);
    return o;
}

Outcome attempt(CpuLayer& layer, Entry entry, const Options& options) {
    megamoe_fp8_experts_t fp8 = layer.fp8.view();
    if (options.fp8) options.fp8(fp8);
    switch (entry) {
        case Entry::kForward: {
            megamoe_forward_params_t p = layer.whole.forward_params(layer.y);
            if (options.with_h) p.saved_h = layer.saved_h.view;
            p.precision = options.precision;
            p.fp8 = fp8;
            if (options.forward) options.forward(p);
            return attempt(p, megamoe_forward_workspace_size, megamoe_forward_path, megamoe_forward);
        }
        case Entry::kBackward: {
            megamoe_backward_params_t p = layer.whole.backward_params(layer.dx, layer.dtopk, layer.dw13, layer.dw2);
            if (options.with_h) p.saved_h = layer.saved_h.view;
            if (!options.with_dx) p.dx = megamoe_tensor_t{};
            p.precision = options.precision;
            p.fp8 = fp8;
            if (options.backward) options.backward(p);
            return attempt(p, megamoe_backward_workspace_size, megamoe_backward_path, megamoe_backward);
        }
        case Entry::kGroupedForward: {
            megamoe_grouped_forward_params_t p = layer.grouped.forward_params(layer.out);
            if (options.with_h) p.saved_h = layer.grouped_h.view;
            p.precision = options.precision;
            p.fp8 = fp8;
            return attempt(p, megamoe_grouped_forward_workspace_size, megamoe_grouped_forward_path,
                           megamoe_grouped_forward);
        }
        case Entry::kGroupedBackward: {
            megamoe_grouped_backward_params_t p =
                layer.grouped.backward_params(layer.dx_sorted, &layer.dscores, layer.grouped_dw13, layer.grouped_dw2);
            if (options.with_h) p.saved_h = layer.grouped_h.view;
            if (!options.with_dx) p.dx_sorted = megamoe_tensor_t{};
            p.precision = options.precision;
            p.fp8 = fp8;
            return attempt(p, megamoe_grouped_backward_workspace_size, megamoe_grouped_backward_path,
                           megamoe_grouped_backward);
        }
    }
    return {};
}

// The call and both queries give `status`, the message names `part`.
void expect_outcome(const Outcome& o, megamoe_status_t status, const std::string& part, const std::string& what) {
    EXPECT_EQ(o.call, status) << what << ": " << megamoe_status_string(o.call) << ", \"" << o.message << "\"";
    EXPECT_EQ(o.workspace, status) << what << ": the workspace size query";
    EXPECT_EQ(o.path, status) << what << ": the path query";
    EXPECT_NE(o.message.find(part), std::string::npos) << what << ": message \"" << o.message << "\"";
}

// Whether the call of `entry` (with or without saved_h and dx) reads the FP8 tensor `name` (megamoe.h): the forward
// w13, w13_scales, w2, w2_scales; the backward w2_t, w2_scales, w13_scales, w13_t with dx, w13 without saved_h.
bool reads(Entry entry, const std::string& name, bool with_h, bool with_dx) {
    if (!is_backward(entry)) {
        return name == "fp8.w13" || name == "fp8.w13_scales" || name == "fp8.w2" || name == "fp8.w2_scales";
    }
    if (name == "fp8.w13_t") return with_dx;
    if (name == "fp8.w13") return !with_h;
    return name != "fp8.w2";
}

// Whether the call needs `name` when every other FP8 tensor is given: what it reads, but a backward's transposed copies
// (the backward makes them from fp8.w2 / fp8.w13, given).
bool needs(Entry entry, const std::string& name, bool with_h, bool with_dx) {
    if (is_backward(entry) && (name == "fp8.w2_t" || name == "fp8.w13_t")) return false;
    return reads(entry, name, with_h, with_dx);
}

// megamoe.h lists fp8.w13_scales for every backward; the library asks for it only where fp8.w13 or fp8.w13_t is read
// (a backward with saved_h and without dx reads neither): that corner's absent scales are left unasserted.
bool scales_corner(Entry entry, const std::string& name, bool with_h, bool with_dx) {
    return is_backward(entry) && name == "fp8.w13_scales" && with_h && !with_dx;
}

TEST(Fp8LayerApi, AbiVersionStructSizeAndPathName) {
    EXPECT_EQ(MEGAMOE_ABI_VERSION, 5);
    EXPECT_EQ(megamoe_abi_version(), MEGAMOE_ABI_VERSION);
    EXPECT_EQ(megamoe_struct_size(MEGAMOE_STRUCT_FP8_EXPERTS), sizeof(megamoe_fp8_experts_t));
    EXPECT_EQ(sizeof(megamoe_fp8_experts_t), 6 * sizeof(megamoe_tensor_t));
    EXPECT_EQ(megamoe_struct_size(MEGAMOE_STRUCT_FORWARD_PARAMS), sizeof(megamoe_forward_params_t));
    EXPECT_EQ(megamoe_struct_size(MEGAMOE_STRUCT_BACKWARD_PARAMS), sizeof(megamoe_backward_params_t));
    EXPECT_EQ(megamoe_struct_size(MEGAMOE_STRUCT_GROUPED_FORWARD_PARAMS), sizeof(megamoe_grouped_forward_params_t));
    EXPECT_EQ(megamoe_struct_size(MEGAMOE_STRUCT_GROUPED_BACKWARD_PARAMS), sizeof(megamoe_grouped_backward_params_t));
    EXPECT_STREQ(megamoe_path_string(MEGAMOE_PATH_SM90_FP8), "sm90-fp8");
    EXPECT_STREQ(megamoe_path_string(MEGAMOE_PATH_SM90), "sm90");
    EXPECT_STREQ(megamoe_path_string(MEGAMOE_PATH_REFERENCE), "reference");
    static_assert(MEGAMOE_DTYPE_E4M3 == 6 && MEGAMOE_PATH_SM90_FP8 == 4 && MEGAMOE_STRUCT_FP8_EXPERTS == 7,
                  "ABI codes");
    static_assert(MEGAMOE_PRECISION_DEFAULT == 0 && MEGAMOE_PRECISION_FP8_BLOCKWISE == 1, "zero is the default");
}

// Each FP8 tensor a call reads: misshapen, of another dtype or rank, on another device: INVALID_ARGUMENT naming it;
// absent: the same where the call needs it, else (one it does not read, a backward's transposed copy) the CPU call is
// NOT_SUPPORTED. Every entry point, with and without saved_h and dx.
TEST(Fp8LayerApi, ChecksTheFp8TensorsEachCallReads) {
    CpuLayer layer;
    for (const Entry entry : kEntries) {
        for (const bool with_h : {false, true}) {
            for (const bool with_dx : {true, false}) {
                if (!is_backward(entry) && !with_dx) continue;
                for (const std::string name : kFp8Names) {
                    const std::string what = std::string(entry_name(entry)) + (with_h ? ", saved_h" : "") +
                                             (with_dx ? "" : ", no dx") + ", " + name;
                    Options options;
                    options.with_h = with_h;
                    options.with_dx = with_dx;
                    options.fp8 = [&](megamoe_fp8_experts_t& f) { fp8_field(f, name) = megamoe_tensor_t{}; };
                    const bool read = reads(entry, name, with_h, with_dx);
                    const bool needed = needs(entry, name, with_h, with_dx);
                    if (needed && !scales_corner(entry, name, with_h, with_dx)) {
                        expect_outcome(attempt(layer, entry, options), MEGAMOE_STATUS_INVALID_ARGUMENT, name,
                                       what + " absent");
                    } else if (!needed) {
                        expect_outcome(attempt(layer, entry, options), MEGAMOE_STATUS_NOT_SUPPORTED, "FP8",
                                       what + " absent (not needed)");
                    }
                    if (!read) continue;
                    const bool scales = name.find("scales") != std::string::npos;
                    const std::vector<int64_t> dims = fp8_shape(name, kE, kH, kI);
                    std::vector<int64_t> more_experts = fp8_shape(name, kE + 1, kH, kI), longer = dims;
                    longer[2] += 1;
                    const megamoe_dtype_t other = scales ? MEGAMOE_DTYPE_F64 : MEGAMOE_DTYPE_BF16;
                    const megamoe_dtype_t swapped = scales ? MEGAMOE_DTYPE_E4M3 : MEGAMOE_DTYPE_F32;
                    const megamoe_dtype_t right = scales ? MEGAMOE_DTYPE_F32 : MEGAMOE_DTYPE_E4M3;
                    const std::pair<const char*, HostTensor> replacements[] = {
                        {"[E + 1, ...]", HostTensor(right, more_experts)},
                        {"last extent + 1", HostTensor(right, longer)},
                        {"rank 2", HostTensor(right, {dims[0], dims[1] * dims[2]})},
                        {"rank 4", HostTensor(right, {dims[0], dims[1], dims[2], 1})},
                        {"dtype bf16 / f64", HostTensor(other, dims)},
                        {"dtype f32 / e4m3", HostTensor(swapped, dims)},
                    };
                    for (const auto& replacement : replacements) {
                        const megamoe_tensor_t bad = replacement.second.view;
                        options.fp8 = [&](megamoe_fp8_experts_t& f) { fp8_field(f, name) = bad; };
                        expect_outcome(attempt(layer, entry, options), MEGAMOE_STATUS_INVALID_ARGUMENT, name,
                                       what + ": " + replacement.first);
                    }
                    options.fp8 = [&](megamoe_fp8_experts_t& f) {
                        fp8_field(f, name).device_type = MEGAMOE_DEVICE_CUDA;
                    };
                    expect_outcome(attempt(layer, entry, options), MEGAMOE_STATUS_INVALID_ARGUMENT, name,
                                   what + ": on cuda, x on the cpu");
                }
            }
        }
    }
}

// A backward without the transposed copies is valid (on CPU tensors: NOT_SUPPORTED naming FP8) while the weights they
// are made from are given; fp8.w2 absent with fp8.w2_t, or fp8.w13 with fp8.w13_t where dx is wanted, is
// INVALID_ARGUMENT naming both; fp8.w2_scales stays needed. The forward never needs them.
TEST(Fp8LayerApi, BackwardTakesAbsentTransposedCopies) {
    CpuLayer layer;
    const auto drop = [](std::vector<std::string> names) {
        return [names](megamoe_fp8_experts_t& f) {
            for (const std::string& name : names) fp8_field(f, name) = megamoe_tensor_t{};
        };
    };
    for (const Entry entry : kEntries) {
        for (const bool with_h : {false, true}) {
            for (const bool with_dx : {true, false}) {
                if (!is_backward(entry) && !with_dx) continue;
                const std::string what =
                    std::string(entry_name(entry)) + (with_h ? ", saved_h" : "") + (with_dx ? "" : ", no dx") + ", ";
                Options options;
                options.with_h = with_h;
                options.with_dx = with_dx;
                options.fp8 = drop({"fp8.w2_t", "fp8.w13_t"});
                expect_outcome(attempt(layer, entry, options), MEGAMOE_STATUS_NOT_SUPPORTED, "FP8",
                               what + "both transposed copies absent");
                if (!is_backward(entry)) continue;
                options.fp8 = drop({"fp8.w2_t", "fp8.w2"});
                Outcome o = attempt(layer, entry, options);
                expect_outcome(o, MEGAMOE_STATUS_INVALID_ARGUMENT, "fp8.w2:", what + "fp8.w2_t and fp8.w2 absent");
                EXPECT_NE(o.message.find("fp8.w2_t"), std::string::npos) << what << "message \"" << o.message << "\"";
                options.fp8 = drop({"fp8.w2_t", "fp8.w2_scales"});
                expect_outcome(attempt(layer, entry, options), MEGAMOE_STATUS_INVALID_ARGUMENT, "fp8.w2_scales",
                               what + "fp8.w2_t and fp8.w2_scales absent");
                options.fp8 = drop({"fp8.w13_t", "fp8.w13"});
                o = attempt(layer, entry, options);
                if (with_dx || !with_h) {  // fp8.w13 needed: for fp8.w13_t, or for h
                    expect_outcome(o, MEGAMOE_STATUS_INVALID_ARGUMENT,
                                   "fp8.w13:", what + "fp8.w13_t and fp8.w13 absent");
                    if (with_h) {
                        EXPECT_NE(o.message.find("fp8.w13_t"), std::string::npos)
                            << what << "message \"" << o.message << "\"";
                    }
                } else {
                    expect_outcome(o, MEGAMOE_STATUS_NOT_SUPPORTED, "FP8", what + "fp8.w13_t and fp8.w13 absent");
                }
            }
        }
    }
}

// An unknown precision code names `precision`; FP8 tensors with precision DEFAULT name themselves (fp8.*).
TEST(Fp8LayerApi, PrecisionCodeAndFp8TensorsInDefaultPrecision) {
    CpuLayer layer;
    for (const Entry entry : kEntries) {
        for (const int code : {2, 7, 99}) {
            Options options;
            options.precision = static_cast<megamoe_precision_t>(code);
            expect_outcome(attempt(layer, entry, options), MEGAMOE_STATUS_INVALID_ARGUMENT, "precision",
                           std::string(entry_name(entry)) + ", precision " + std::to_string(code));
        }
        for (const std::string name : kFp8Names) {
            Options options;
            options.precision = MEGAMOE_PRECISION_DEFAULT;
            options.fp8 = [&](megamoe_fp8_experts_t& f) {
                const megamoe_tensor_t kept = fp8_field(f, name);
                f = megamoe_fp8_experts_t{};
                fp8_field(f, name) = kept;
            };
            expect_outcome(attempt(layer, entry, options), MEGAMOE_STATUS_INVALID_ARGUMENT, name,
                           std::string(entry_name(entry)) + ", DEFAULT with " + name + " given");
        }
        Options plain;  // DEFAULT without FP8 tensors: the CPU reference runs
        plain.precision = MEGAMOE_PRECISION_DEFAULT;
        plain.fp8 = [](megamoe_fp8_experts_t& f) { f = megamoe_fp8_experts_t{}; };
        const Outcome o = attempt(layer, entry, plain);
        EXPECT_EQ(o.call, MEGAMOE_STATUS_SUCCESS) << entry_name(entry) << ": " << o.message;
        EXPECT_EQ(o.workspace, MEGAMOE_STATUS_SUCCESS) << entry_name(entry);
        EXPECT_EQ(o.path, MEGAMOE_STATUS_SUCCESS) << entry_name(entry);
    }
}

// A valid FP8 call on CPU tensors: NOT_SUPPORTED naming FP8 (never the CPU reference in 16-bit); with every option.
TEST(Fp8LayerApi, CpuTensorsAreNotSupported) {
    CpuLayer layer;
    for (const Entry entry : kEntries) {
        for (const bool with_h : {false, true}) {
            Options options;
            options.with_h = with_h;
            expect_outcome(attempt(layer, entry, options), MEGAMOE_STATUS_NOT_SUPPORTED, "FP8",
                           std::string(entry_name(entry)) + (with_h ? ", saved_h" : ""));
        }
    }
}

// e4m3 only where the FP8 weights are: x, the 16-bit weights and topk_weights refuse it by name (both precisions:
// checked before the precision), dy and the outputs too (DEFAULT: an FP8 call on CPU tensors is NOT_SUPPORTED first).
TEST(Fp8LayerApi, E4m3OnlyForTheFp8Weights) {
    CpuLayer layer;
    const auto e4m3 = [](megamoe_tensor_t& t) { t.dtype = MEGAMOE_DTYPE_E4M3; };
    const std::pair<const char*, std::function<void(megamoe_forward_params_t&)>> forward[] = {
        {"x", [&](auto& p) { e4m3(p.x); }},
        {"w13", [&](auto& p) { e4m3(p.w13); }},
        {"w2", [&](auto& p) { e4m3(p.w2); }},
        {"topk_weights", [&](auto& p) { e4m3(p.topk_weights); }},
        {"y (DEFAULT)", [&](auto& p) { e4m3(p.y); }},
        {"saved_h (DEFAULT)",
         [&](auto& p) {
             p.saved_h = layer.saved_h.view;
             e4m3(p.saved_h);
         }},
    };
    const std::pair<const char*, std::function<void(megamoe_backward_params_t&)>> backward[] = {
        {"x", [&](auto& p) { e4m3(p.x); }},
        {"w2", [&](auto& p) { e4m3(p.w2); }},
        {"dy (DEFAULT)", [&](auto& p) { e4m3(p.dy); }},
        {"dx (DEFAULT)", [&](auto& p) { e4m3(p.dx); }},
        {"dtopk_weights (DEFAULT)", [&](auto& p) { e4m3(p.dtopk_weights); }},
        {"dw13 (DEFAULT)", [&](auto& p) { e4m3(p.dw13); }},
        {"dw2 (DEFAULT)", [&](auto& p) { e4m3(p.dw2); }},
    };
    for (const megamoe_precision_t precision : {MEGAMOE_PRECISION_DEFAULT, MEGAMOE_PRECISION_FP8_BLOCKWISE}) {
        Options options;
        options.precision = precision;
        if (precision == MEGAMOE_PRECISION_DEFAULT) options.fp8 = [](auto& f) { f = megamoe_fp8_experts_t{}; };
        const bool fp8 = precision == MEGAMOE_PRECISION_FP8_BLOCKWISE;
        for (const auto& [label, mutate] : forward) {
            const std::string name = std::string(label).substr(0, std::string(label).find(' '));
            if (fp8 && name != label) continue;
            options.forward = mutate;
            expect_outcome(attempt(layer, Entry::kForward, options), MEGAMOE_STATUS_INVALID_ARGUMENT, name + ":",
                           std::string("forward, e4m3 ") + label);
        }
        options.forward = nullptr;
        for (const auto& [label, mutate] : backward) {
            const std::string name = std::string(label).substr(0, std::string(label).find(' '));
            if (fp8 && name != label) continue;
            options.backward = mutate;
            expect_outcome(attempt(layer, Entry::kBackward, options), MEGAMOE_STATUS_INVALID_ARGUMENT, name + ":",
                           std::string("backward, e4m3 ") + label);
        }
    }
}

// megamoe_quantize_experts refuses NULL arguments, CPU tensors and bad dtypes or ranks, naming the argument.
TEST(Fp8LayerApi, QuantizeExpertsRefusesByName) {
    CpuLayer layer;
    const megamoe_fp8_experts_t fp8 = layer.fp8.view();
    const megamoe_tensor_t w13 = layer.whole.w13.view, w2 = layer.whole.w2.view;
    const auto expect_refused = [](megamoe_status_t status, const char* part, const char* what) {
        EXPECT_TRUE(status == MEGAMOE_STATUS_INVALID_ARGUMENT || status == MEGAMOE_STATUS_NOT_SUPPORTED)
            << what << ": " << megamoe_status_string(status);
        EXPECT_NE(std::string(megamoe_last_error()).find(part), std::string::npos)
            << what << ": message \"" << megamoe_last_error() << "\"";
    };
    EXPECT_EQ(megamoe_quantize_experts(nullptr, &w2, &fp8, nullptr), MEGAMOE_STATUS_INVALID_ARGUMENT);
    EXPECT_NE(std::string(megamoe_last_error()).find("w13"), std::string::npos) << megamoe_last_error();
    EXPECT_EQ(megamoe_quantize_experts(&w13, nullptr, &fp8, nullptr), MEGAMOE_STATUS_INVALID_ARGUMENT);
    EXPECT_NE(std::string(megamoe_last_error()).find("w2"), std::string::npos) << megamoe_last_error();
    EXPECT_EQ(megamoe_quantize_experts(&w13, &w2, nullptr, nullptr), MEGAMOE_STATUS_INVALID_ARGUMENT);
    EXPECT_NE(std::string(megamoe_last_error()).find("fp8"), std::string::npos) << megamoe_last_error();
    expect_refused(megamoe_quantize_experts(&w13, &w2, &fp8, nullptr), "w13", "CPU weights");
    megamoe_tensor_t bad13 = w13, bad2 = w2;
    bad13.dtype = MEGAMOE_DTYPE_E4M3;
    bad2.dtype = MEGAMOE_DTYPE_E4M3;
    expect_refused(megamoe_quantize_experts(&bad13, &bad2, &fp8, nullptr), "w13", "e4m3 w13");
    expect_refused(megamoe_quantize_experts(&w13, &bad2, &fp8, nullptr), "w2", "w2 of another dtype");
    bad2 = w2;
    bad2.ndim = 2;
    expect_refused(megamoe_quantize_experts(&w13, &bad2, &fp8, nullptr), "w2", "w2 of rank 2");
    bad13 = w13;
    bad13.data = nullptr;
    expect_refused(megamoe_quantize_experts(&bad13, &w2, &fp8, nullptr), "w13", "w13 data NULL");
}

}  // namespace
}  // namespace megamoe::test
