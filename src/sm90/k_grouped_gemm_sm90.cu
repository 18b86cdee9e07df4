// The fused Hopper (sm_90a) K-grouped GEMM of the weight gradients: a persistent, warp-specialized wgmma kernel.
//
// Computes, for every expert e and its sorted rows r in [expert_offsets[e], expert_offsets[e + 1]):
//     C_e[m, n] = sum_r A[a_row(r), m] * B[b_row(r), n]          (f32 accumulation, out [E, M, N])
//   a_row(r) = r, or sorted_slot[r] / topk when A is gathered (the same rule for B).
//   dW13: A = dh [rows, 2I], B = x gathered [T, H]; dW2: A = dy gathered [T, H], B = s * a [rows, I].
// The reduction runs over the expert's rows: both operands are MN-major (M or N contiguous) in shared memory.
//
// Tiles: kBlockM = 128 (M) x kBlockN = 256 (N) x kBlockK = 64 rows of the reduction per stage. An operand tile is
// stored as 64-element blocks of its MN dimension (one 128-byte row per reduction row, 128-byte swizzle), kBlockK
// rows each (8 KiB): A has 2 blocks (one per consumer), B has 4. wgmma reads both through MN-major descriptors
// (transpose bits of the atom): 8-row atoms 1024 bytes apart, MN blocks 8 KiB apart, 2048 bytes per k16 step.
// Each CTA owns whole output tiles: tile t = (expert, m-tile, n-tile), expert-major, so neighbouring CTAs read the
// same expert's rows (from L2); CTA c takes t = c, c + gridDim.x, ... and loops over every row of the tile's
// expert in order: no split-K, no atomics, bitwise deterministic; an expert with no rows writes zeros.
//
// Warp roles (3 warpgroups, 384 threads, 1 CTA per SM):
//   warpgroup 0, producer (setmaxnreg down to kProducerRegs): gathers both tiles with 16-byte cp.async into the
//     swizzled layout (A: 16 threads per row, 8 rows per pass, 8 passes; B: 32 threads per row, 4 rows per pass,
//     16 passes), zero-filling rows past the expert's end and columns past M or N; the gather indices of a stage
//     are loaded first, then the copies issued. Each thread arms cp.async.mbarrier.arrive.noinc on the stage's
//     full barrier (kProducerThreads arrivals publish it) and moves on.
//   warpgroups 1, 2, consumers (setmaxnreg up to kConsumerRegs): rows [64 (w - 1), 64 w) of the M tile, m64 x 256 x
//     k16 wgmmas, one batch in flight; a stage is released (one arrive per warp on its empty barrier) once the
//     next batch has been issued. Epilogue: element type through the quad transpose and 16-byte stores, or f32
//     as 8-byte pairs.
// Shared memory (dynamic, 1024-byte aligned): kNumStages x (A tile 16 KiB + B tile 32 KiB), then kNumStages full
// and kNumStages empty mbarriers.
#include "sm90/k_grouped_gemm_sm90.h"

#include <algorithm>
#include <cute/arch/mma_sm90_gmma.hpp>
#include <type_traits>
#include <utility>

#include "cuda/cuda_utils.h"
#include "sm90/epilogue.cuh"
#include "sm90/ptx.h"

namespace megamoe::sm90 {
namespace {

using cuda::ceil_div;
namespace gmma = cute::SM90::GMMA;

constexpr int kBlockM = 128;
constexpr int kBlockN = 256;
constexpr int kBlockK = 64;  // reduction rows per stage
constexpr int kElemBytes = 2;
constexpr int kWarpSize = 32;
constexpr int kWarpgroupThreads = 128;
constexpr int kNumConsumers = 2;
constexpr int kNumThreads = (1 + kNumConsumers) * kWarpgroupThreads;
constexpr int kConsumerRows = kBlockM / kNumConsumers;
constexpr int kWgmmaK = 16;
constexpr int kChunkElems = 8;                                       // one 16-byte cp.async
constexpr int kMnBlockElems = kSwizzleBytes / kElemBytes;            // 64 MN elements per 128-byte swizzled row
constexpr int kMnBlockBytes = kMnBlockElems * kBlockK * kElemBytes;  // one MN block of a stage: 8 KiB
constexpr int kATileBytes = kBlockM * kBlockK * kElemBytes;
constexpr int kBTileBytes = kBlockN * kBlockK * kElemBytes;
constexpr int kAChunksPerRow = kBlockM / kChunkElems;
constexpr int kBChunksPerRow = kBlockN / kChunkElems;
constexpr int kARowsPerPass = kWarpgroupThreads / kAChunksPerRow;
constexpr int kBRowsPerPass = kWarpgroupThreads / kBChunksPerRow;
constexpr int kAPasses = kBlockK / kARowsPerPass;
constexpr int kBPasses = kBlockK / kBRowsPerPass;
constexpr int kFullArrivals = kWarpgroupThreads;                               // every producer thread
constexpr int kEmptyArrivals = kNumConsumers * kWarpgroupThreads / kWarpSize;  // one per consumer warp
constexpr int kNumAccRegs = kConsumerRows * kBlockN / kWarpgroupThreads;
constexpr int kProducerRegs = 56;
constexpr int kConsumerRegs = 224;
constexpr int kRegisterFile = 64 * 1024;
constexpr int kMaxSmemBytes = 227 * 1024;
constexpr int kNumStages = 4;
constexpr int kBarrierBytes = 2 * kNumStages * static_cast<int>(sizeof(uint64_t));
constexpr int kSmemBytes = kNumStages * (kATileBytes + kBTileBytes) + kBarrierBytes + kSwizzleAtomBytes;

static_assert(kConsumerRows == kMnBlockElems, "each consumer's A rows are one 64-element MN block");
static_assert(kBlockN == 256, "the wgmma atoms below are n256");
static_assert(kMnBlockBytes % kSwizzleAtomBytes == 0, "MN blocks start on a swizzle atom");
static_assert(kAPasses * kARowsPerPass == kBlockK && kBPasses * kBRowsPerPass == kBlockK,
              "the producer covers both tiles");
static_assert(kBlockK % kWgmmaK == 0 && kBlockK % 8 == 0, "a stage holds whole k16 steps and 8-row atoms");
static_assert(kSmemBytes <= kMaxSmemBytes, "stages exceed the shared memory of an SM");
static_assert(kProducerRegs * kWarpgroupThreads + kConsumerRegs * kNumConsumers * kWarpgroupThreads <= kRegisterFile,
              "setmaxnreg budgets exceed the register file");

template <typename T>
struct WgmmaAtom;
template <>
struct WgmmaAtom<__nv_bfloat16> {
    using Op = gmma::MMA_64x256x16_F32BF16BF16_SS<gmma::Major::MN, gmma::Major::MN>;
};
template <>
struct WgmmaAtom<__half> {
    using Op = gmma::MMA_64x256x16_F32F16F16_SS<gmma::Major::MN, gmma::Major::MN>;
};

template <typename Op, int kNumRegs, size_t... kRegIdx>
__device__ __forceinline__ void wgmma_unpacked(uint64_t desc_a, uint64_t desc_b, float (&acc)[kNumRegs],
                                               std::index_sequence<kRegIdx...>) {
    Op::fma(desc_a, desc_b, acc[kRegIdx]..., gmma::ScaleOut::One);
}

struct KernelParams {
    const uint16_t* a;
    int64_t lda;
    const int* a_gather_slots;
    const uint16_t* b;
    int64_t ldb;
    const int* b_gather_slots;
    int topk;
    int64_t m;
    int64_t n;
    const int* expert_offsets;
    int num_m_tiles;
    int num_n_tiles;
    int num_tiles;  // E * num_m_tiles * num_n_tiles (checked < 2^31 on the host)
    void* out;      // [E, M, N]
};

// Sorted rows are below 2^31 (T * topk < 2^31), and so are M and N (sizes of a weight's dimensions).
struct Tile {
    int expert_idx;
    int m_begin;
    int n_begin;
    int row_begin;  // the expert's sorted rows [row_begin, row_end)
    int row_end;
    int num_k_blocks;
};

__device__ __forceinline__ Tile decode_tile(const KernelParams& params, int tile_idx) {
    const int tiles_per_expert = params.num_m_tiles * params.num_n_tiles;
    Tile tile;
    tile.expert_idx = tile_idx / tiles_per_expert;
    const int within = tile_idx % tiles_per_expert;
    tile.m_begin = within / params.num_n_tiles * kBlockM;
    tile.n_begin = within % params.num_n_tiles * kBlockN;
    tile.row_begin = params.expert_offsets[tile.expert_idx];
    tile.row_end = params.expert_offsets[tile.expert_idx + 1];
    tile.num_k_blocks = (tile.row_end - tile.row_begin + kBlockK - 1) / kBlockK;
    return tile;
}

// Byte offset of 16-byte chunk `chunk_idx` (along MN) of reduction row `row` in an MN-major stage tile.
__device__ __forceinline__ uint32_t mn_major_offset(int row, int chunk_idx) {
    constexpr int kChunksPerBlock = kMnBlockElems / kChunkElems;
    return static_cast<uint32_t>(chunk_idx / kChunksPerBlock * kMnBlockBytes) +
           swizzle_128b_offset(row, chunk_idx % kChunksPerBlock);
}

// One operand's share of a stage: kPasses rows per thread, gather indices first, then the copies.
template <int kPasses, int kRowsPerPass>
__device__ __forceinline__ void load_operand(uint8_t* tile, const uint16_t* src, int64_t ld, const int* gather_slots,
                                             int topk, const Tile& tile_info, int first_row_idx, int first_row,
                                             int chunk_idx, bool col_valid, int64_t col) {
    int src_rows[kPasses];  // sorted rows and tokens are below 2^31 (T * topk < 2^31)
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
        const int row_idx = first_row_idx + first_row + pass * kRowsPerPass;
        src_rows[pass] = -1;
        if (col_valid && row_idx < tile_info.row_end) {
            src_rows[pass] = gather_slots != nullptr ? gather_slots[row_idx] / topk : row_idx;
        }
    }
#pragma unroll
    for (int pass = 0; pass < kPasses; ++pass) {
        const bool valid = src_rows[pass] >= 0;
        cuda::cp_async_16(tile + mn_major_offset(first_row + pass * kRowsPerPass, chunk_idx),
                          valid ? src + static_cast<int64_t>(src_rows[pass]) * ld + col : src, valid);
    }
}

__device__ __forceinline__ void produce(const KernelParams& params, uint8_t* smem_a, uint8_t* smem_b, uint64_t* full,
                                        uint64_t* empty, int thread_idx) {
    const int a_chunk_idx = thread_idx % kAChunksPerRow, a_first_row = thread_idx / kAChunksPerRow;
    const int b_chunk_idx = thread_idx % kBChunksPerRow, b_first_row = thread_idx / kBChunksPerRow;
    int stage_idx = 0;
    uint32_t phase = 0;
    for (int tile_idx = static_cast<int>(blockIdx.x); tile_idx < params.num_tiles;
         tile_idx += static_cast<int>(gridDim.x)) {
        const Tile tile = decode_tile(params, tile_idx);
        const int64_t a_col = tile.m_begin + a_chunk_idx * kChunkElems;
        const int64_t b_col = tile.n_begin + b_chunk_idx * kChunkElems;
        for (int k_block_idx = 0; k_block_idx < tile.num_k_blocks; ++k_block_idx) {
            mbarrier_wait(&empty[stage_idx], phase ^ 1);
            const int first_row_idx = tile.row_begin + k_block_idx * kBlockK;
            load_operand<kAPasses, kARowsPerPass>(smem_a + stage_idx * kATileBytes, params.a, params.lda,
                                                  params.a_gather_slots, params.topk, tile, first_row_idx, a_first_row,
                                                  a_chunk_idx, a_col < params.m, a_col);
            load_operand<kBPasses, kBRowsPerPass>(smem_b + stage_idx * kBTileBytes, params.b, params.ldb,
                                                  params.b_gather_slots, params.topk, tile, first_row_idx, b_first_row,
                                                  b_chunk_idx, b_col < params.n, b_col);
            cp_async_mbarrier_arrive_noinc(&full[stage_idx]);
            if (++stage_idx == kNumStages) {
                stage_idx = 0;
                phase ^= 1;
            }
        }
    }
    cuda::cp_async_commit();
    cuda::cp_async_wait<0>();  // no copy outlives its thread
}

// One consumer warpgroup's rows of the output tile C_e[m_begin + row, n_begin + col], OutT = T or float.
template <typename T, typename OutT, int kNumRegs>
__device__ __forceinline__ void store_tile(const KernelParams& params, const Tile& tile, const float (&acc)[kNumRegs],
                                           int consumer_idx, int warp_idx, int lane_idx) {
    constexpr int kNumFrags = kBlockN / 8;
    constexpr int kFragsPerChunk = 4;
    const int quad_lane = lane_idx % 4;
    const int first_row = consumer_idx * kConsumerRows + warp_idx * 16 + lane_idx / 4;
    OutT* out = static_cast<OutT*>(params.out) + static_cast<int64_t>(tile.expert_idx) * params.m * params.n;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int64_t m_idx = tile.m_begin + first_row + half * 8;
        const bool row_valid = m_idx < params.m;
        OutT* out_row = out + m_idx * params.n;
        if constexpr (std::is_same_v<OutT, float>) {
#pragma unroll
            for (int frag_idx = 0; frag_idx < kNumFrags; ++frag_idx) {
                const int64_t col = tile.n_begin + frag_idx * 8 + quad_lane * 2;
                const int reg_idx = frag_idx * 4 + half * 2;
                if (row_valid && col < params.n) store_pair_f32(out_row, col, acc[reg_idx], acc[reg_idx + 1]);
            }
        } else {
#pragma unroll
            for (int group_idx = 0; group_idx < kNumFrags / kFragsPerChunk; ++group_idx) {
                uint32_t words[kFragsPerChunk];
#pragma unroll
                for (int word_idx = 0; word_idx < kFragsPerChunk; ++word_idx) {
                    const int reg_idx = (group_idx * kFragsPerChunk + word_idx) * 4 + half * 2;
                    words[word_idx] = cuda::pack_pair<T>(acc[reg_idx], acc[reg_idx + 1]);
                }
                quad_transpose(words, quad_lane);
                const int64_t col = tile.n_begin + (group_idx * kFragsPerChunk + quad_lane) * 8;
                if (row_valid && col < params.n) store_chunk(out_row, col, words);
            }
        }
    }
}

template <typename T, typename OutT>
__device__ __forceinline__ void consume(const KernelParams& params, uint8_t* smem_a, uint8_t* smem_b, uint64_t* full,
                                        uint64_t* empty, int consumer_idx, int thread_idx) {
    const int lane_idx = thread_idx % kWarpSize;
    const int warp_idx = (thread_idx % kWarpgroupThreads) / kWarpSize;
    int stage_idx = 0;
    uint32_t phase = 0;
    float acc[kNumAccRegs];
    for (int tile_idx = static_cast<int>(blockIdx.x); tile_idx < params.num_tiles;
         tile_idx += static_cast<int>(gridDim.x)) {
        const Tile tile = decode_tile(params, tile_idx);
#pragma unroll
        for (int reg_idx = 0; reg_idx < kNumAccRegs; ++reg_idx) acc[reg_idx] = 0.0f;
        int in_flight_stage = -1;
        for (int k_block_idx = 0; k_block_idx < tile.num_k_blocks; ++k_block_idx) {
            mbarrier_wait(&full[stage_idx], phase);
            fence_proxy_async_shared();  // cp.async wrote the tiles (generic proxy), wgmma reads them (async proxy)
            const uint64_t desc_a = make_smem_desc_mn_major_sw128<kMnBlockBytes>(smem_a + stage_idx * kATileBytes +
                                                                                 consumer_idx * kMnBlockBytes);
            const uint64_t desc_b = make_smem_desc_mn_major_sw128<kMnBlockBytes>(smem_b + stage_idx * kBTileBytes);
            fence_accumulators(acc);
            wgmma_fence();
#pragma unroll
            for (int k_step = 0; k_step < kBlockK / kWgmmaK; ++k_step) {
                wgmma_unpacked<typename WgmmaAtom<T>::Op>(desc_a + k_step * kDescMnK16Step,
                                                          desc_b + k_step * kDescMnK16Step, acc,
                                                          std::make_index_sequence<kNumAccRegs>{});
            }
            wgmma_commit_group();
            wgmma_wait_group<1>();  // the previous batch is done: its stage can be refilled
            fence_accumulators(acc);
            if (in_flight_stage >= 0 && lane_idx == 0) mbarrier_arrive(&empty[in_flight_stage]);
            in_flight_stage = stage_idx;
            if (++stage_idx == kNumStages) {
                stage_idx = 0;
                phase ^= 1;
            }
        }
        wgmma_wait_group<0>();
        fence_accumulators(acc);
        if (in_flight_stage >= 0 && lane_idx == 0) mbarrier_arrive(&empty[in_flight_stage]);
        store_tile<T, OutT>(params, tile, acc, consumer_idx, warp_idx, lane_idx);
    }
}

template <typename T, typename OutT>
__global__ void __launch_bounds__(kNumThreads, 1) k_grouped_gemm_sm90_kernel(const KernelParams params) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ uint8_t smem_raw[];
    const uint32_t misalignment = shared_address(smem_raw) % kSwizzleAtomBytes;
    uint8_t* smem_a = smem_raw + (misalignment == 0 ? 0 : kSwizzleAtomBytes - misalignment);
    uint8_t* smem_b = smem_a + kNumStages * kATileBytes;
    auto* full = reinterpret_cast<uint64_t*>(smem_b + kNumStages * kBTileBytes);
    uint64_t* empty = full + kNumStages;

    const int thread_idx = static_cast<int>(threadIdx.x);
    if (thread_idx == 0) {
        for (int stage_idx = 0; stage_idx < kNumStages; ++stage_idx) {
            mbarrier_init(&full[stage_idx], kFullArrivals);
            mbarrier_init(&empty[stage_idx], kEmptyArrivals);
        }
        fence_barrier_init();
    }
    __syncthreads();
    const int warpgroup_idx = __shfl_sync(0xffffffffu, thread_idx / kWarpgroupThreads, 0);
    if (warpgroup_idx == 0) {
        setmaxnreg_dec<kProducerRegs>();
        produce(params, smem_a, smem_b, full, empty, thread_idx);
    } else {
        setmaxnreg_inc<kConsumerRegs>();
        consume<T, OutT>(params, smem_a, smem_b, full, empty, warpgroup_idx - 1, thread_idx);
    }
#endif
}

template <typename T, typename OutT>
megamoe_status_t launch_typed(const KernelParams& params, int num_sms, cudaStream_t stream) {
    const auto kernel = k_grouped_gemm_sm90_kernel<T, OutT>;
    const char* name = "k_grouped_gemm_sm90";
    MEGAMOE_CUDA_RETURN_IF_ERROR(
        cuda::check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes), name));
    const auto num_blocks = static_cast<unsigned>(std::min<int64_t>(std::max(num_sms, 1), params.num_tiles));
    kernel<<<num_blocks, kNumThreads, kSmemBytes, stream>>>(params);
    return cuda::check_launch(name);
}

}  // namespace

bool k_grouped_gemm_sm90_supported(const cuda::KGroupedGemmArgs& args, const void* out) {
    const bool dtype_ok = args.dtype == MEGAMOE_DTYPE_BF16 || args.dtype == MEGAMOE_DTYPE_F16;
    const bool sizes_ok = args.m % kChunkElems == 0 && args.n % kChunkElems == 0;
    const bool a_ok = cuda::is_aligned(args.a, 16) && args.lda % kChunkElems == 0;
    const bool b_ok = cuda::is_aligned(args.b, 16) && args.ldb % kChunkElems == 0;
    return dtype_ok && sizes_ok && a_ok && b_ok && cuda::is_aligned(out, 16);
}

megamoe_status_t launch_k_grouped_gemm_sm90(const cuda::KGroupedGemmArgs& args, void* out, megamoe_dtype_t out_dtype,
                                            int num_sms, cudaStream_t stream) {
    if (!k_grouped_gemm_sm90_supported(args, out)) {
        return set_error(MEGAMOE_STATUS_NOT_SUPPORTED, "k_grouped_gemm_sm90: operands not supported");
    }
    KernelParams params{};
    params.a = static_cast<const uint16_t*>(args.a);
    params.lda = args.lda;
    params.a_gather_slots = args.a_gather_slots;
    params.b = static_cast<const uint16_t*>(args.b);
    params.ldb = args.ldb;
    params.b_gather_slots = args.b_gather_slots;
    params.topk = static_cast<int>(args.topk);
    params.m = args.m;
    params.n = args.n;
    params.expert_offsets = args.expert_offsets;
    const int64_t num_m_tiles = ceil_div(args.m, static_cast<int64_t>(kBlockM));
    const int64_t num_n_tiles = ceil_div(args.n, static_cast<int64_t>(kBlockN));
    const int64_t num_tiles = args.num_experts * num_m_tiles * num_n_tiles;
    if (num_tiles > INT32_MAX) {
        return set_error(MEGAMOE_STATUS_NOT_SUPPORTED, "k_grouped_gemm_sm90: more than 2^31 output tiles");
    }
    params.num_m_tiles = static_cast<int>(num_m_tiles);
    params.num_n_tiles = static_cast<int>(num_n_tiles);
    params.num_tiles = static_cast<int>(num_tiles);
    params.out = out;
    if (params.num_tiles == 0) return MEGAMOE_STATUS_SUCCESS;
    const bool f32_out = out_dtype == MEGAMOE_DTYPE_F32;
    if (args.dtype == MEGAMOE_DTYPE_BF16) {
        return f32_out ? launch_typed<__nv_bfloat16, float>(params, num_sms, stream)
                       : launch_typed<__nv_bfloat16, __nv_bfloat16>(params, num_sms, stream);
    }
    return f32_out ? launch_typed<__half, float>(params, num_sms, stream)
                   : launch_typed<__half, __half>(params, num_sms, stream);
}

}  // namespace megamoe::sm90
