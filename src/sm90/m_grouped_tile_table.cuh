// The M-grouped kernel's tile table: the tile configuration (m_grouped_config.cuh) each epilogue policy runs with and
// the limit each entry hits, and the experiment switches (sm90/knobs.h) that put a policy on the ping-pong tile for
// A/B timing. Measurements: docs/log/ and bench/results/ (2026-12-02: the session-6 notes).
#pragma once

#include <type_traits>

#include "sm90/knobs.h"
#include "sm90/m_grouped_config.cuh"
#include "sm90/m_grouped_dswiglu.cuh"
#include "sm90/m_grouped_epilogue.cuh"

namespace megamoe::sm90::m_grouped {

// - SwiGLU (up), store (down, dX): cooperative 128 x 256. Their epilogues are cheap, the mainloop is the limit; 256
//   columns halve A's refills per FLOP against 128. On the ping-pong tile (MEGAMOE_SM90_M_PINGPONG=128, wgmmas no
//   longer serialized) up is 1.3-1.6x slower, down and dX 1.2x.
// - dSwiGLU (dH): cooperative 128 x 256 too. Its epilogue is about a third of a consumer's time (latency-bound
//   dSwiGLU math, the tensor pipe idle meanwhile); on the ping-pong 128 x 128 tile (MEGAMOE_SM90_DH_PINGPONG=128) the
//   mainloop, refilling A twice as often, sets the pace: ~10 % slower.
//   TODO(#19): an epilogue that overlaps the next tile's mainloop without a second set of accumulators.
template <class Epilogue>
using ConfigOf = Cooperative;

static_assert(num_stages<ConfigOf<DSwiGLUEpilogue>, true>() == num_stages<ConfigOf<DSwiGLUEpilogue>, false>(),
              "dSwiGLU's sub-tile slots fit beside the pipeline stages without costing one");

// The policies with a ping-pong kernel (the default options' up and store GEMMs, the default dSwiGLU): only these are
// built on the PingPong tile.
template <class Epi, BSource kBSource>
constexpr bool kHasPingPongVariant = kBSource == BSource::kOne &&
                                     (std::is_same_v<Epi, SwiGLUEpilogue> || std::is_same_v<Epi, StoreEpilogue> ||
                                      std::is_same_v<Epi, DSwiGLUEpilogue>);

// Whether a launch of the policy takes the ping-pong tile: its switch is set (read at each launch).
template <class Epi, BSource kBSource>
bool uses_pingpong_variant() {
    if constexpr (!kHasPingPongVariant<Epi, kBSource>) {
        return false;
    } else if constexpr (std::is_same_v<Epi, DSwiGLUEpilogue>) {
        return dh_pingpong();
    } else {
        return m_grouped_pingpong();
    }
}

}  // namespace megamoe::sm90::m_grouped
