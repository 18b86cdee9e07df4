// Experiment switches of the sm_90a kernels, read from the environment at each launch. Each keeps a variant on main
// beside the default so that one GPU run can time both in the same library (scripts/gpu_ab_knobs.sh); a variant that
// wins becomes the default and its switch goes. Unset, empty or unknown values select the default.
//   MEGAMOE_SM90_DSWIGLU_MATH=fast     dH's SwiGLU backward with the SFU's tanh (SwiGLUFastActivation)
//   MEGAMOE_SM90_K_STORE=once          the K-grouped kernel with 4 store boxes per warp and 3 stages: a tile's TMA
//                                      stores never wait for each other (default: 2 boxes, 4 stages)
#pragma once

#include <cstdlib>
#include <cstring>

namespace megamoe::sm90 {

// The environment variable `name` equals `value`.
inline bool env_is(const char* name, const char* value) {
    const char* set = std::getenv(name);
    return set != nullptr && std::strcmp(set, value) == 0;
}

inline bool dswiglu_fast_math() {
    return env_is("MEGAMOE_SM90_DSWIGLU_MATH", "fast");
}
inline bool k_grouped_store_once() {
    return env_is("MEGAMOE_SM90_K_STORE", "once");
}

}  // namespace megamoe::sm90
