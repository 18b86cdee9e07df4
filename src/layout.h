// Where each expert weight element lives in the layouts megamoe_layout_t describes, and the expert parameters of a
// call (w13, w3, w2, b13, b2, layout, activation) gathered from any params struct.
//
// Every path computes on the canonical matrices of one expert e:
//   W13[e] [2I, H]  rows [0, I) gate, [I, 2I) up      (canonical row n)
//   W2[e]  [H, I]
//   b13[e] [2I]     gate, then up;  b2[e] [H]
// WeightLayout maps a canonical element to its offset in the tensor that stores it (w13, or w3 for the up rows of the
// separate layout), in elements from the tensor's start:
//   gate_up   storage row of canonical row n (R rows per expert: 2I, or I in the separate layout)
//             concatenated  n              interleaved  2n (n < I), 2(n - I) + 1 (n >= I)
//             separate      n in w13 (n < I), n - I in w3 (n >= I)
//   transposed  element (row r, column k) at k * R + r instead of r * H + k
// b13 follows the gate/up arrangement of the rows (separate: concatenated).
#pragma once

#include <cstdint>

#include "activation.h"
#include "megamoe/megamoe.h"

namespace megamoe {

struct WeightLayout {
    megamoe_gate_up_t gate_up;
    bool w13_transposed;
    bool w2_transposed;
    int64_t hidden;        // H
    int64_t intermediate;  // I

    static WeightLayout of(const megamoe_layout_t& layout, int64_t hidden, int64_t intermediate) {
        return {layout.gate_up, layout.w13_transposed != 0, layout.w2_transposed != 0, hidden, intermediate};
    }

    MEGAMOE_HOST_DEVICE bool is_default() const {
        return gate_up == MEGAMOE_GATE_UP_CONCATENATED && !w13_transposed && !w2_transposed;
    }
    // Rows of one expert's block in w13 (and in w3): 2I, or I in the separate layout.
    MEGAMOE_HOST_DEVICE int64_t w13_rows() const {
        return gate_up == MEGAMOE_GATE_UP_SEPARATE ? intermediate : 2 * intermediate;
    }
    // Whether canonical row n is stored in w3 (the up rows of the separate layout) rather than in w13.
    MEGAMOE_HOST_DEVICE bool in_w3(int64_t row_idx) const {
        return gate_up == MEGAMOE_GATE_UP_SEPARATE && row_idx >= intermediate;
    }
    // Storage row (in w13 or w3) of canonical row n; also the position of b13's entry n.
    MEGAMOE_HOST_DEVICE int64_t w13_row(int64_t row_idx) const {
        const bool is_up = row_idx >= intermediate;
        const int64_t col_idx = is_up ? row_idx - intermediate : row_idx;  // i of g_i / u_i
        switch (gate_up) {
            case MEGAMOE_GATE_UP_INTERLEAVED:
                return 2 * col_idx + (is_up ? 1 : 0);
            case MEGAMOE_GATE_UP_SEPARATE:
                return col_idx;
            default:
                return row_idx;
        }
    }
    // Offset of canonical W13[e][n, k] in w13 (or in w3 when in_w3(n)).
    MEGAMOE_HOST_DEVICE int64_t w13_offset(int64_t expert_idx, int64_t row_idx, int64_t k) const {
        const int64_t num_rows = w13_rows(), row = w13_row(row_idx);
        const int64_t within = w13_transposed ? k * num_rows + row : row * hidden + k;
        return expert_idx * num_rows * hidden + within;
    }
    // Offset of canonical W2[e][h, i] in w2.
    MEGAMOE_HOST_DEVICE int64_t w2_offset(int64_t expert_idx, int64_t h, int64_t i) const {
        const int64_t within = w2_transposed ? i * hidden + h : h * intermediate + i;
        return expert_idx * hidden * intermediate + within;
    }
    // Offset of canonical b13[e][n] in b13: arranged as w13's rows (the separate layout: gate, then up).
    MEGAMOE_HOST_DEVICE int64_t b13_offset(int64_t expert_idx, int64_t row_idx) const {
        const int64_t position = gate_up == MEGAMOE_GATE_UP_INTERLEAVED ? w13_row(row_idx) : row_idx;
        return expert_idx * 2 * intermediate + position;
    }
};

// The expert parameters of one call as its params struct holds them (validated by check_experts, validate.h).
struct Experts {
    const megamoe_tensor_t* w13;
    const megamoe_tensor_t* w3;  // absent unless the separate layout
    const megamoe_tensor_t* w2;
    const megamoe_tensor_t* b13;  // absent: no bias
    const megamoe_tensor_t* b2;
    megamoe_layout_t layout;
    megamoe_activation_t activation;
    megamoe_precision_t precision;
    const megamoe_fp8_experts_t* fp8;  // the quantized weights of FP8_BLOCKWISE (absent tensors otherwise)

    template <typename Params>
    static Experts of(const Params& p) {
        return {&p.w13, &p.w3, &p.w2, &p.b13, &p.b2, p.layout, p.activation, p.precision, &p.fp8};
    }
    bool fp8_blockwise() const { return precision == MEGAMOE_PRECISION_FP8_BLOCKWISE; }
};

// The weight gradients of a backward (data NULL: not wanted); `accumulate`: added into f32 buffers holding values
// (accumulate_weight_grads) instead of written.
struct ExpertGrads {
    const megamoe_tensor_t* dw13;
    const megamoe_tensor_t* dw3;
    const megamoe_tensor_t* dw2;
    const megamoe_tensor_t* db13;
    const megamoe_tensor_t* db2;
    bool accumulate;

    template <typename Params>
    static ExpertGrads of(const Params& p) {
        return {&p.dw13, &p.dw3, &p.dw2, &p.db13, &p.db2, p.accumulate_weight_grads != 0};
    }
};

}  // namespace megamoe
