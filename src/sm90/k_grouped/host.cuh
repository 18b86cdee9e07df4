// Host side of the fused Hopper K-grouped GEMM (k_grouped/gemm.cu): the tensor maps of its ungathered operands
// and of its element-type output.
#pragma once

#include "device/cuda_utils.h"
#include "sm90/kit/store.cuh"
#include "sm90/k_grouped/config.cuh"
#include "sm90/kit/tensor_map.h"

namespace megamoe::sm90::k_grouped {

// An ungathered operand as a 2-D tensor [kMaxTmaRows, cols] (cols innermost, 128-byte swizzle), boxes of
// kMnBlockElems columns x kBlockK rows. Only whole k-blocks inside an expert's rows are loaded, so the row extent
// is a bound, never reached; columns past `cols` are zero-filled.
inline bool encode_operand_map(megamoe_dtype_t dtype, const void* data, int64_t ld, int64_t cols, CUtensorMap* map) {
    return encode_2d_sw128_map(dtype, data, kMaxTmaRows, cols, ld, kBlockK, kMnBlockElems,
                               CU_TENSOR_MAP_L2_PROMOTION_L2_256B, map);
}

// The element-type output [E, M, N] as a 3-D tensor map (N innermost, 128-byte swizzle), boxes of kTmaStoreCols
// columns x kTmaStoreRows rows of one expert: the epilogue's TMA stores, clipped at M and N.
inline bool encode_out_map(megamoe_dtype_t dtype, void* out, int64_t num_experts, int64_t m, int64_t n,
                           CUtensorMap* map) {
    const cuuint64_t dims[3] = {static_cast<cuuint64_t>(n), static_cast<cuuint64_t>(m),
                                static_cast<cuuint64_t>(num_experts)};
    const cuuint64_t byte_strides[2] = {static_cast<cuuint64_t>(n * kElemBytes),
                                        static_cast<cuuint64_t>(m * n * kElemBytes)};
    const cuuint32_t box[3] = {static_cast<cuuint32_t>(kTmaStoreCols), static_cast<cuuint32_t>(kTmaStoreRows), 1};
    return encode_3d_sw128_map(dtype, out, dims, byte_strides, box, CU_TENSOR_MAP_L2_PROMOTION_NONE, map);
}

// The operand, by TMA when it is not gathered and its tensor map can be made (else by cp.async, zeroed map).
inline Operand make_operand(megamoe_dtype_t dtype, const void* data, int64_t ld, const int* gather_slots, int64_t cols,
                            CUtensorMap* map) {
    *map = CUtensorMap{};
    Operand operand{static_cast<const uint16_t*>(data), static_cast<int>(ld), gather_slots, false};
    operand.tma = gather_slots == nullptr && encode_operand_map(dtype, data, ld, cols, map);
    return operand;
}

}  // namespace megamoe::sm90::k_grouped
