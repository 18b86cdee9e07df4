// The tile-scheduler interface of the sm_90a kernels. Every role of a CTA (the producer warpgroup, each consumer
// warpgroup) holds its own scheduler over the same sequence of work tiles and asks it for the next tile when it wants
// it:
//     using Tile = ...;                      the work tile the roles decode (its expert, rows, output coordinates)
//     bool next(Tile& tile, int lane_idx);   the CTA's next tile; false once its tiles are done (every thread of a warp
//                                            calls it alike: a scheduler may read a ring shared by the warps)
// Decoding a tile (its expert's rows: a few dependent loads) happens at the call, so a role asks early where that
// latency would show: the K-grouped producer a tile ahead, its consumers under the tile's last wgmmas. The orders:
// m_grouped/scheduler.cuh (a static stride over pairs of the routing's M tiles x n-tiles) and k_grouped/config.cuh
// (experts' output tiles, by a static stride or, where the routing is skewed, claimed from a counter).
#pragma once

#include <type_traits>
#include <utility>

namespace megamoe::sm90 {

template <class Scheduler, class = void>
struct IsTileScheduler : std::false_type {};
template <class Scheduler>
struct IsTileScheduler<Scheduler, std::void_t<typename Scheduler::Tile>>
    : std::is_same<decltype(std::declval<Scheduler&>().next(std::declval<typename Scheduler::Tile&>(), 0)), bool> {};

}  // namespace megamoe::sm90
