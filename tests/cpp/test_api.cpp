// Bad input through the C API: each case gives a non-success status and a message naming the
// argument, never a crash. Plus the status strings, version and workspace queries.
#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "test_util.h"

namespace megamoe::test {
namespace {

struct BadCase {
    const char* what;
    std::function<void(Problem&, megamoe_forward_params_t&, HostTensor& scratch)> mutate;
    megamoe_status_t status;
    const char* message_part;  // the argument the message must name
    bool value_check = false;  // found only when values are read (not by the workspace-size query)
};

Problem small_problem() {
    std::mt19937_64 rng(fresh_seed());
    Problem problem{6, 10, 4, 3, 2};
    problem.dtype = MEGAMOE_DTYPE_F32;
    problem.make(rng);
    return problem;
}

TEST(Api, BadForwardInputsNameTheArgument) {
    const BadCase cases[] = {
        {"x wrong rank", [](Problem&, megamoe_forward_params_t& p, HostTensor&) { p.x.ndim = 3; },
         MEGAMOE_STATUS_INVALID_ARGUMENT, "x:"},
        {"x integer dtype", [](Problem&, megamoe_forward_params_t& p, HostTensor&) { p.x.dtype = MEGAMOE_DTYPE_I32; },
         MEGAMOE_STATUS_INVALID_ARGUMENT, "x:"},
        {"x unknown dtype", [](Problem&, megamoe_forward_params_t& p, HostTensor&) { p.x.dtype = (megamoe_dtype_t)42; },
         MEGAMOE_STATUS_INVALID_ARGUMENT, "x:"},
        {"x data NULL", [](Problem&, megamoe_forward_params_t& p, HostTensor&) { p.x.data = nullptr; },
         MEGAMOE_STATUS_INVALID_ARGUMENT, "x: data is NULL"},
        {"x non-contiguous", [](Problem&, megamoe_forward_params_t& p, HostTensor&) { p.x.strides[0] = 20; },
         MEGAMOE_STATUS_INVALID_ARGUMENT, "x: must be contiguous"},
        {"w13 H mismatch", [](Problem&, megamoe_forward_params_t& p, HostTensor&) { p.w13.shape[2] = 9; },
         MEGAMOE_STATUS_INVALID_ARGUMENT, "w13:"},
        {"w13 odd rows (2I != rows)", [](Problem&, megamoe_forward_params_t& p, HostTensor&) { p.w13.shape[1] = 7; },
         MEGAMOE_STATUS_INVALID_ARGUMENT, "w13:"},
        {"w2 E mismatch", [](Problem&, megamoe_forward_params_t& p, HostTensor&) { p.w2.shape[0] = 2; },
         MEGAMOE_STATUS_INVALID_ARGUMENT, "w2:"},
        {"w2 dtype differs", [](Problem&, megamoe_forward_params_t& p, HostTensor&) { p.w2.dtype = MEGAMOE_DTYPE_F64; },
         MEGAMOE_STATUS_INVALID_ARGUMENT, "w2:"},
        {"ids float dtype",
         [](Problem&, megamoe_forward_params_t& p, HostTensor&) { p.topk_ids.dtype = MEGAMOE_DTYPE_F32; },
         MEGAMOE_STATUS_INVALID_ARGUMENT, "topk_ids:"},
        {"ids T mismatch", [](Problem&, megamoe_forward_params_t& p, HostTensor&) { p.topk_ids.shape[0] = 5; },
         MEGAMOE_STATUS_INVALID_ARGUMENT, "topk_ids:"},
        {"ids out of range high", [](Problem& pr, megamoe_forward_params_t&, HostTensor&) { pr.ids.set(3, 3); },
         MEGAMOE_STATUS_INVALID_ARGUMENT, "topk_ids: value 3 at [1, 1]", true},
        {"ids out of range low", [](Problem& pr, megamoe_forward_params_t&, HostTensor&) { pr.ids.set(0, -2); },
         MEGAMOE_STATUS_INVALID_ARGUMENT, "topk_ids: value -2", true},
        {"topk = 0",
         [](Problem&, megamoe_forward_params_t& p, HostTensor&) {
             p.topk_ids.shape[1] = 0;
             p.topk_weights.shape[1] = 0;
         },
         MEGAMOE_STATUS_INVALID_ARGUMENT, "topk_ids: topk must be > 0"},
        {"E = 0",
         [](Problem&, megamoe_forward_params_t& p, HostTensor&) {
             p.w13.shape[0] = 0;
             p.w2.shape[0] = 0;
         },
         MEGAMOE_STATUS_INVALID_ARGUMENT, "w13: number of experts"},
        {"H = 0", [](Problem&, megamoe_forward_params_t& p, HostTensor&) { p.x.shape[1] = 0; },
         MEGAMOE_STATUS_INVALID_ARGUMENT, "x: hidden size"},
        {"weights shape", [](Problem&, megamoe_forward_params_t& p, HostTensor&) { p.topk_weights.shape[1] = 3; },
         MEGAMOE_STATUS_INVALID_ARGUMENT, "topk_weights:"},
        {"weights dtype",
         [](Problem&, megamoe_forward_params_t& p, HostTensor&) { p.topk_weights.dtype = MEGAMOE_DTYPE_I64; },
         MEGAMOE_STATUS_INVALID_ARGUMENT, "topk_weights:"},
        {"y wrong shape", [](Problem&, megamoe_forward_params_t& p, HostTensor&) { p.y.shape[1] = 11; },
         MEGAMOE_STATUS_INVALID_ARGUMENT, "y:"},
        {"y wrong dtype", [](Problem&, megamoe_forward_params_t& p, HostTensor&) { p.y.dtype = MEGAMOE_DTYPE_BF16; },
         MEGAMOE_STATUS_INVALID_ARGUMENT, "y:"},
        {"y aliases x", [](Problem&, megamoe_forward_params_t& p, HostTensor&) { p.y.data = p.x.data; },
         MEGAMOE_STATUS_INVALID_ARGUMENT, "y: overlaps the memory of x"},
        {"saved_h wrong shape",
         [](Problem& pr, megamoe_forward_params_t& p, HostTensor& scratch) {
             scratch = HostTensor(pr.dtype, {pr.num_tokens * pr.topk, pr.intermediate});
             p.saved_h = scratch.view;
         },
         MEGAMOE_STATUS_INVALID_ARGUMENT, "saved_h: expected shape"},
        {"saved_h wrong dtype",
         [](Problem& pr, megamoe_forward_params_t& p, HostTensor& scratch) {
             scratch = HostTensor(MEGAMOE_DTYPE_F64, {pr.num_tokens * pr.topk, 2 * pr.intermediate});
             p.saved_h = scratch.view;
         },
         MEGAMOE_STATUS_INVALID_ARGUMENT, "saved_h: dtype"},
        {"saved_h aliases x",
         [](Problem& pr, megamoe_forward_params_t& p, HostTensor& scratch) {
             scratch = HostTensor(pr.dtype, {pr.num_tokens * pr.topk, 2 * pr.intermediate});
             p.saved_h = scratch.view;
             p.saved_h.data = p.x.data;
         },
         MEGAMOE_STATUS_INVALID_ARGUMENT, "saved_h: overlaps the memory of x"},
        {"mixed devices",
         [](Problem&, megamoe_forward_params_t& p, HostTensor&) { p.w2.device_type = MEGAMOE_DEVICE_CUDA; },
         MEGAMOE_STATUS_INVALID_ARGUMENT, "w2: on cuda"},
        {"unknown device",
         [](Problem&, megamoe_forward_params_t& p, HostTensor&) { p.w13.device_type = (megamoe_device_type_t)7; },
         MEGAMOE_STATUS_INVALID_ARGUMENT, "w13: unknown device"},
        {"negative extent", [](Problem&, megamoe_forward_params_t& p, HostTensor&) { p.x.shape[0] = -1; },
         MEGAMOE_STATUS_INVALID_ARGUMENT, "x: negative extent"},
        {"x past any memory", [](Problem&, megamoe_forward_params_t& p, HostTensor&) { p.x.shape[0] = int64_t{1} << 62; },
         MEGAMOE_STATUS_INVALID_ARGUMENT, "x: shape [4611686018427387904, 10] has more elements than memory"},
        {"T * topk past 2^31 - 1",  // the shapes alone: validation fails before any data is read
         [](Problem&, megamoe_forward_params_t& p, HostTensor&) {
             for (megamoe_tensor_t* t : {&p.x, &p.topk_ids, &p.topk_weights, &p.y}) t->shape[0] = int64_t{1} << 31;
         },
         MEGAMOE_STATUS_NOT_SUPPORTED, "topk_ids: T * topk = 2147483648 * 2 exceeds 2^31 - 1 slots"},
        {"T * topk past 2^64",  // T = 2^40, topk = 2^30: the product wraps in 64 bits
         [](Problem&, megamoe_forward_params_t& p, HostTensor&) {
             for (megamoe_tensor_t* t : {&p.x, &p.topk_ids, &p.topk_weights, &p.y}) t->shape[0] = int64_t{1} << 40;
             p.topk_ids.shape[1] = p.topk_weights.shape[1] = int64_t{1} << 30;
         },
         MEGAMOE_STATUS_INVALID_ARGUMENT, "topk_ids: shape [1099511627776, 1073741824] has more elements than memory"},
        {"unknown accum", [](Problem&, megamoe_forward_params_t& p, HostTensor&) { p.accum = (megamoe_accum_t)9; },
         MEGAMOE_STATUS_INVALID_ARGUMENT, "accum:"},
        {"f32 on CUDA",
         [](Problem&, megamoe_forward_params_t& p, HostTensor&) {
             for (megamoe_tensor_t* t : {&p.x, &p.topk_ids, &p.topk_weights, &p.w13, &p.w2, &p.y})
                 t->device_type = MEGAMOE_DEVICE_CUDA;
         },
         MEGAMOE_STATUS_NOT_SUPPORTED, "x: dtype f32 is not supported on CUDA"},
    };
    for (const BadCase& bad : cases) {
        Problem problem = small_problem();
        HostTensor y(problem.dtype, {problem.num_tokens, problem.hidden}), scratch;
        megamoe_forward_params_t params = problem.forward_params(y);
        bad.mutate(problem, params, scratch);
        const megamoe_status_t status = megamoe_forward(&params);
        EXPECT_EQ(status, bad.status) << bad.what << ": " << megamoe_last_error();
        EXPECT_NE(std::string(megamoe_last_error()).find(bad.message_part), std::string::npos)
            << bad.what << ": message was \"" << megamoe_last_error() << "\"";
        size_t bytes = 0;
        if (!bad.value_check) {
            EXPECT_NE(megamoe_forward_workspace_size(&params, &bytes), MEGAMOE_STATUS_SUCCESS) << bad.what;
        }
    }
}

TEST(Api, BadBackwardInputsNameTheArgument) {
    Problem problem = small_problem();
    HostTensor dx(problem.dtype, {6, 10}), dw(MEGAMOE_DTYPE_F32, {6, 2}), dw13(problem.dtype, {3, 8, 10}),
        dw2(problem.dtype, {3, 10, 4});
    auto expect_bad = [&](std::function<void(megamoe_backward_params_t&)> mutate, const char* part) {
        megamoe_backward_params_t params = problem.backward_params(dx, dw, dw13, dw2);
        mutate(params);
        EXPECT_EQ(megamoe_backward(&params), MEGAMOE_STATUS_INVALID_ARGUMENT) << part;
        EXPECT_NE(std::string(megamoe_last_error()).find(part), std::string::npos)
            << "message was \"" << megamoe_last_error() << "\"";
    };
    expect_bad([](megamoe_backward_params_t& p) { p.dy.shape[0] = 4; }, "dy:");
    expect_bad([](megamoe_backward_params_t& p) { p.dy.dtype = MEGAMOE_DTYPE_F64; }, "dy:");
    expect_bad([](megamoe_backward_params_t& p) { p.dx.shape[1] = 3; }, "dx:");
    expect_bad([](megamoe_backward_params_t& p) { p.dtopk_weights.dtype = MEGAMOE_DTYPE_F16; }, "dtopk_weights:");
    expect_bad([](megamoe_backward_params_t& p) { p.dw13.shape[1] = 4; }, "dw13:");
    expect_bad([](megamoe_backward_params_t& p) { p.dw2.dtype = MEGAMOE_DTYPE_I32; }, "dw2:");
    expect_bad([](megamoe_backward_params_t& p) { p.dw2.data = p.dw13.data; }, "dw2: overlaps the memory of dw13");
    expect_bad([](megamoe_backward_params_t& p) { p.dx.data = p.dy.data; }, "dx: overlaps the memory of dy");
    HostTensor saved_h(problem.dtype, {12, 8}), bad_h(problem.dtype, {12, 4});
    expect_bad([&](megamoe_backward_params_t& p) { p.saved_h = bad_h.view; }, "saved_h: expected shape");
    expect_bad(
        [&](megamoe_backward_params_t& p) {
            p.saved_h = saved_h.view;
            p.saved_h.dtype = MEGAMOE_DTYPE_F16;
        },
        "saved_h: dtype");
    expect_bad(
        [&](megamoe_backward_params_t& p) {
            p.saved_h = saved_h.view;
            p.dx.data = saved_h.view.data;
        },
        "dx: overlaps the memory of saved_h");

    // Optional outputs may be absent.
    megamoe_backward_params_t params = problem.backward_params(dx, dw, dw13, dw2);
    params.dw13 = megamoe_tensor_t{};
    params.dtopk_weights = megamoe_tensor_t{};
    EXPECT_EQ(megamoe_backward(&params), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
    EXPECT_STREQ(megamoe_last_error(), "");
}

// A CPU-only build (no nvcc when it was built) refuses CUDA tensors once they are valid, saying why.
TEST(Api, CpuOnlyBuildRefusesCudaTensors) {
    if (megamoe_has_cuda()) GTEST_SKIP() << "a CUDA build: CUDA tensors run";
    std::mt19937_64 rng(fresh_seed());
    Problem problem{6, 16, 8, 3, 2};
    problem.dtype = MEGAMOE_DTYPE_BF16;
    problem.make(rng);
    HostTensor y(problem.dtype, {problem.num_tokens, problem.hidden});
    megamoe_forward_params_t params = problem.forward_params(y);
    for (megamoe_tensor_t* t : {&params.x, &params.topk_ids, &params.topk_weights, &params.w13, &params.w2, &params.y})
        t->device_type = MEGAMOE_DEVICE_CUDA;
    size_t bytes = 0;
    megamoe_path_t path = MEGAMOE_PATH_REFERENCE;
    for (const megamoe_status_t status : {megamoe_forward(&params), megamoe_forward_workspace_size(&params, &bytes),
                                          megamoe_forward_path(&params, &path)}) {
        EXPECT_EQ(status, MEGAMOE_STATUS_NOT_SUPPORTED) << megamoe_last_error();
        EXPECT_NE(std::string(megamoe_last_error()).find("x: CUDA tensors, but this libmegamoe.so was built without CUDA"),
                  std::string::npos)
            << megamoe_last_error();
    }
}

TEST(Api, NullPointersAndWorkspace) {
    EXPECT_EQ(megamoe_forward(nullptr), MEGAMOE_STATUS_INVALID_ARGUMENT);
    EXPECT_NE(std::string(megamoe_last_error()).find("params"), std::string::npos);
    EXPECT_EQ(megamoe_backward(nullptr), MEGAMOE_STATUS_INVALID_ARGUMENT);
    Problem problem = small_problem();
    HostTensor y(problem.dtype, {6, 10});
    megamoe_forward_params_t params = problem.forward_params(y);
    EXPECT_EQ(megamoe_forward_workspace_size(&params, nullptr), MEGAMOE_STATUS_INVALID_ARGUMENT);
    EXPECT_NE(std::string(megamoe_last_error()).find("bytes"), std::string::npos);
    size_t bytes = 123;
    ASSERT_EQ(megamoe_forward_workspace_size(&params, &bytes), MEGAMOE_STATUS_SUCCESS) << megamoe_last_error();
    EXPECT_EQ(bytes, 0u);  // the CPU reference needs no caller workspace
}

TEST(Api, StatusStringsAndVersion) {
    EXPECT_STREQ(megamoe_status_string(MEGAMOE_STATUS_SUCCESS), "MEGAMOE_STATUS_SUCCESS");
    EXPECT_STREQ(megamoe_status_string(MEGAMOE_STATUS_CUDA_ERROR), "MEGAMOE_STATUS_CUDA_ERROR");
    EXPECT_STREQ(megamoe_status_string((megamoe_status_t)99), "MEGAMOE_STATUS_UNKNOWN");
    EXPECT_EQ(megamoe_version(), MEGAMOE_VERSION_MAJOR * 10000 + MEGAMOE_VERSION_MINOR * 100 + MEGAMOE_VERSION_PATCH);
}

}  // namespace
}  // namespace megamoe::test
