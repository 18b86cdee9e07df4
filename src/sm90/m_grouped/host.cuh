// Host side of the fused Hopper M-grouped GEMM (m_grouped/gemm.cu, fp8_gemm.cu): the tensor maps of B (one, or the
// separate layout's two) and of the K halves' A, the mainloop's params from the GEMM arguments.
#pragma once

#include "device/cuda_utils.h"
#include "device/grouped_gemm_args.h"
#include "sm90/kit/tensor_map.h"
#include "sm90/m_grouped/config.cuh"

namespace megamoe::sm90::m_grouped {

// The tensor-map element type of the configuration's operands: args.dtype, or bytes for e4m3.
template <class Config>
CUtensorMapDataType operand_map_type(const cuda::MGroupedGemmArgs& args) {
    return Config::kFp8 ? kTensorMapBytes : tensor_map_type_of(args.dtype);
}

// B as a 3-D tensor [E, rows_per_expert, cols_per_row] (cols innermost, 128-byte swizzle) from `b`, B_0 of args.b or
// of args.b_up (the same strides): kNK rows of B_e are the N rows, cols K, boxes of Config::kBBoxRows x kBlockK; kKN
// rows are K, cols N, boxes of kBlockK x kKNBoxCols (16-bit operands only). N is 2n for gate / up pairs in one tensor.
template <class Config>
bool encode_b_tensor_map(const cuda::MGroupedGemmArgs& args, const void* b, BLayout b_layout, int64_t rows_per_expert,
                         int64_t cols_per_row, CUtensorMap* map) {
    const bool nk = b_layout == BLayout::kNK;
    const cuuint64_t dims[3] = {static_cast<cuuint64_t>(cols_per_row), static_cast<cuuint64_t>(rows_per_expert),
                                static_cast<cuuint64_t>(args.num_experts)};
    const cuuint64_t strides[2] = {static_cast<cuuint64_t>(args.ldb * Config::kOperandBytes),
                                   static_cast<cuuint64_t>(args.b_expert_stride * Config::kOperandBytes)};
    const cuuint32_t box[3] = {nk ? static_cast<cuuint32_t>(Config::kBlockK) : static_cast<cuuint32_t>(kKNBoxCols),
                               nk ? static_cast<cuuint32_t>(Config::kBBoxRows) : static_cast<cuuint32_t>(kBlockK), 1};
    return encode_3d_sw128_map(operand_map_type<Config>(args), b, dims, strides, box,
                               CU_TENSOR_MAP_L2_PROMOTION_L2_256B, map);
}

// A as the sorted rows themselves: [rows, K] of the configuration's operands (row stride ld elements) by TMA boxes of
// kBlockM rows x one K block, zero fill past `rows` and K.
template <class Config>
bool encode_sorted_a_map(const cuda::MGroupedGemmArgs& args, const void* a, int64_t rows, int64_t ld,
                         CUtensorMap* map) {
    return encode_2d_sw128_map(operand_map_type<Config>(args), Config::kOperandBytes, a, rows, args.k, ld, kBlockM,
                               Config::kBlockK, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, map);
}

// The store epilogue's output tensor map over `out` [num_out_rows, n] in args.dtype (row stride ldo): boxes of
// kTmaStoreRows x kTmaStoreCols, clipped at n; only whole boxes inside an expert's rows are stored, so the row extent
// (the caller's buffer) is a bound. Store coordinates are int32 (rows below num_out_rows, columns below n + kBlockN).
// False where it cannot be made: then every row goes out from registers.
template <class Config>
bool encode_store_out_map(const cuda::MGroupedGemmArgs& args, void* out, int64_t ldo, int64_t num_out_rows,
                          CUtensorMap* map) {
    return out != nullptr && num_out_rows > 0 && num_out_rows <= INT32_MAX && args.n <= INT32_MAX - Config::kBlockN &&
           ldo >= args.n &&
           encode_2d_sw128_map(args.dtype, out, num_out_rows, args.n, ldo, kTmaStoreRows, kTmaStoreCols,
                               CU_TENSOR_MAP_L2_PROMOTION_NONE, map);
}

// BSource::kKHalves: A [num_a_rows, 2 k] (row stride lda) as a 3-D tensor [num_a_rows, 2, k], boxes of kBlockM rows x
// 1 x kBlockK: a box never reads past its half (zero fill past k), so a K block straddling k stays in its half.
inline bool encode_a_halves_map(const cuda::MGroupedGemmArgs& args, int64_t half_k, CUtensorMap* map) {
    const cuuint64_t dims[3] = {static_cast<cuuint64_t>(half_k), 2, static_cast<cuuint64_t>(args.num_a_rows)};
    const cuuint64_t strides[2] = {static_cast<cuuint64_t>(half_k * kElemBytes),
                                   static_cast<cuuint64_t>(args.lda * kElemBytes)};
    const cuuint32_t box[3] = {static_cast<cuuint32_t>(kBlockK), 1, static_cast<cuuint32_t>(kBlockM)};
    return encode_3d_sw128_map(args.dtype, args.a, dims, strides, box, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, map);
}

inline MainloopParams make_mainloop_params(const cuda::MGroupedGemmArgs& args) {
    MainloopParams params{};
    params.a = args.a;
    params.lda = args.lda;
    params.a_gather_slots = args.a_gather_slots;
    params.topk = args.topk;
    params.n = args.n;
    params.k = args.k;
    params.expert_offsets = args.expert_offsets;
    params.m_tile_offsets = args.m_tile_offsets;
    params.num_experts = args.num_experts;
    return params;
}

// The separate layout's second B tensor (args.b_up, w3): aligned as B (its strides are B's); the K halves of dX whole
// 16-byte chunks.
inline bool second_b_ok(const cuda::MGroupedGemmArgs& args, bool k_halves) {
    return args.b_up == nullptr || (cuda::is_aligned(args.b_up, 16) && (!k_halves || (args.k / 2) % kChunkElems == 0));
}

}  // namespace megamoe::sm90::m_grouped
