// The one place sm_90a tensor maps are encoded: the driver's cuTensorMapEncodeTiled (fetched through the runtime, so
// the library never links libcuda), every map with 128-byte swizzle and no OOB NaN fill: loads zero-fill elements out
// of bounds, stores skip them. 2-D maps of matrices and 3-D maps of per-expert stacks, over 16-bit elements (`dtype`)
// or bytes (e4m3 operands: TMA only moves them).
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "megamoe/megamoe.h"

namespace megamoe::sm90 {

// cuTensorMapEncodeTiled, looked up once; NULL when the driver does not provide it.
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
    static const PFN_cuTensorMapEncodeTiled_v12000 encoder = [] {
        void* fn = nullptr;
        cudaDriverEntryPointQueryResult result{};
        constexpr unsigned kDriverApiVersion = 12000;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, kDriverApiVersion, cudaEnableDefault,
                                             &result) != cudaSuccess ||
            result != cudaDriverEntryPointSuccess) {
            cudaGetLastError();
            fn = nullptr;
        }
        return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
    }();
    return encoder;
}

// The tensor maps' element types: bf16 / f16 (`dtype`), or bytes (e4m3 operands; TMA only moves them).
inline CUtensorMapDataType tensor_map_type_of(megamoe_dtype_t dtype) {
    return dtype == MEGAMOE_DTYPE_BF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
}
constexpr CUtensorMapDataType kTensorMapBytes = CU_TENSOR_MAP_DATA_TYPE_UINT8;

// The one encode: a `rank`-D tensor map (2 or 3) over `data_type` elements, dims innermost first, byte strides of
// dims 1 .. rank - 1 (multiples of 16), boxes of box[0] x ... (box[0]: at most one 128-byte row), 128-byte swizzle.
// False when the encoder is missing or refuses.
inline bool encode_sw128_map(CUtensorMapDataType data_type, cuuint32_t rank, const void* data, const cuuint64_t* dims,
                             const cuuint64_t* byte_strides, const cuuint32_t* box, CUtensorMapL2promotion l2_promotion,
                             CUtensorMap* map) {
    const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
    if (encode == nullptr) return false;
    const cuuint32_t element_strides[3] = {1, 1, 1};
    return encode(map, data_type, rank, const_cast<void*>(data), dims, byte_strides, box, element_strides,
                  CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, l2_promotion,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// A 2-D map over a [rows, cols] matrix of `data_type` elements of elem_bytes bytes (cols innermost, row stride ld
// elements, ld * elem_bytes a multiple of 16), boxes of box_cols x box_rows (box_cols: one 128-byte row).
inline bool encode_2d_sw128_map(CUtensorMapDataType data_type, int64_t elem_bytes, const void* data, int64_t rows,
                                int64_t cols, int64_t ld, uint32_t box_rows, uint32_t box_cols,
                                CUtensorMapL2promotion l2_promotion, CUtensorMap* map) {
    const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
    const cuuint64_t byte_strides[1] = {static_cast<cuuint64_t>(ld * elem_bytes)};
    const cuuint32_t box[2] = {box_cols, box_rows};
    return encode_sw128_map(data_type, 2, data, dims, byte_strides, box, l2_promotion, map);
}

// The same over a matrix of bf16 or f16 (`dtype`; ld a multiple of 8).
inline bool encode_2d_sw128_map(megamoe_dtype_t dtype, const void* data, int64_t rows, int64_t cols, int64_t ld,
                                uint32_t box_rows, uint32_t box_cols, CUtensorMapL2promotion l2_promotion,
                                CUtensorMap* map) {
    constexpr int64_t kElemBytes = 2;
    return encode_2d_sw128_map(tensor_map_type_of(dtype), kElemBytes, data, rows, cols, ld, box_rows, box_cols,
                               l2_promotion, map);
}

// A 3-D map over `data_type` elements: dims innermost first, byte strides of dims 1 and 2, boxes of box[0] x box[1] x
// box[2].
inline bool encode_3d_sw128_map(CUtensorMapDataType data_type, const void* data, const cuuint64_t (&dims)[3],
                                const cuuint64_t (&byte_strides)[2], const cuuint32_t (&box)[3],
                                CUtensorMapL2promotion l2_promotion, CUtensorMap* map) {
    return encode_sw128_map(data_type, 3, data, dims, byte_strides, box, l2_promotion, map);
}

// The same over 16-bit elements (`dtype`: bf16 or f16).
inline bool encode_3d_sw128_map(megamoe_dtype_t dtype, const void* data, const cuuint64_t (&dims)[3],
                                const cuuint64_t (&byte_strides)[2], const cuuint32_t (&box)[3],
                                CUtensorMapL2promotion l2_promotion, CUtensorMap* map) {
    return encode_3d_sw128_map(tensor_map_type_of(dtype), data, dims, byte_strides, box, l2_promotion, map);
}

}  // namespace megamoe::sm90
