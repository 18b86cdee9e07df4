// The M-grouped kernel's tile table: the tile configuration (m_grouped/config.cuh) each epilogue policy runs with and
// the limit each entry hits. What was measured of other tiles: docs/log/.
#pragma once

#include "sm90/m_grouped/config.cuh"
#include "sm90/m_grouped/dswiglu.cuh"
#include "sm90/m_grouped/epilogue.cuh"

namespace megamoe::sm90::m_grouped {

// - SwiGLU (up), store (down, dX): 128 x 256. Their epilogues are cheap, the mainloop is the limit; 256 columns halve
//   A's refills per FLOP against 128 (the ping-pong 128 x 128 tile: up 1.3-1.6x slower, down and dX 1.2x).
// - dSwiGLU (dH): 128 x 256 too. Its epilogue is about a third of a consumer's time (latency-bound dSwiGLU math, the
//   tensor pipe idle meanwhile); on the ping-pong 128 x 128 tile the mainloop, refilling A twice as often, sets the
//   pace (~10 % slower).
template <class Epilogue>
using ConfigOf = Cooperative;

static_assert(num_stages<ConfigOf<DSwiGLUEpilogue>, DSwiGLUEpilogue::kWarpStagingBytes>() ==
                  num_stages<ConfigOf<DSwiGLUEpilogue>, 0>(),
              "dSwiGLU's two buffers of sub-tile slots fit beside the pipeline stages without costing one");

}  // namespace megamoe::sm90::m_grouped
