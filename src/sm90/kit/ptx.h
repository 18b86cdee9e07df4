// Raw PTX of the Hopper (sm_90a) kernels, one thin wrapper per instruction:
//   mbarrier   init, arrive (this CTA, or a CTA of the cluster), arrive + expect_tx, parity wait (the stage pipelines'
//              full / empty barriers: kit/pipeline.cuh);
//   cluster    CTA rank, cluster-wide barrier;
//   TMA        cp.async.bulk.tensor 2-D and 3-D loads, plain or multicast to CTAs of the cluster, completing
//              on an mbarrier; 2-D and 3-D stores (and 3-D reduce-adds) from shared memory in bulk async-groups,
//              commit_group and wait_group (.read: until the stores have read their shared memory); the plain
//              (non-tensor) bulk copy of contiguous bytes into shared memory, completing on an mbarrier;
//   cp.async   arrival on an mbarrier once a thread's copies landed (the copy itself: device/cp_async.cuh);
//   stmatrix   four 8 x 8 b16 matrices from the mma fragment layout to shared memory; ldmatrix, the other way;
//   ld.shared / st.shared  a 16-byte vector load from, an 8-byte f32 pair store to, a shared-memory address;
//   proxies    fence.proxy.async: generic-proxy writes to shared memory (cp.async, st.shared, stmatrix) before
//              the async proxy (wgmma, TMA) reads them;
//   wgmma      shared-memory matrix descriptors (K-major and MN-major, 128-byte swizzle), fence / commit / wait, and
//              the accumulator register fence that keeps the compiler from moving accumulator accesses
//              across an in-flight wgmma;
//   setmaxnreg register reallocation between warpgroups.
// The wgmma instruction itself comes from CuTe's MMA atoms (kit/arch.h). Semantics: PTX ISA 8.x, "mbarrier",
// "cp.async.bulk.tensor", "wgmma", "Matrix Descriptor Format".
#pragma once

#include <cuda.h>

#include <cstdint>

#include "device/cp_async.cuh"

namespace megamoe::sm90 {

using cuda::cp_async_16;
using cuda::global_address;
using cuda::shared_address;

// Bytes of one shared-memory row of a 128-byte swizzled K-major tile, and of its 8-row swizzle atom.
constexpr int kSwizzleBytes = 128;
constexpr int kSwizzleAtomBytes = 8 * kSwizzleBytes;

// Byte offset of 16-byte chunk `chunk_idx` of row `row` in a 128-byte swizzled tile (1024-byte aligned):
// the chunk index is XORed with the row's position in its 8-row atom, as TMA's SWIZZLE_128B writes it
// and as wgmma's 128-byte swizzle mode reads it.
__device__ __forceinline__ uint32_t swizzle_128b_offset(int row, int chunk_idx) {
    return static_cast<uint32_t>(row * kSwizzleBytes + ((chunk_idx ^ (row & 7)) << 4));
}

// The 64-byte swizzle of a tile of 64-byte rows (512-byte aligned): 16-byte chunk `chunk_idx` (0..3) of row `row` at
// chunk_idx ^ (row / 2) % 4, as TMA's SWIZZLE_64B writes a box of 64-byte rows. The 8 rows of an 8 x 8 b16 matrix
// (ldmatrix, stmatrix), and two rows' 4 chunks (8 lanes of 16-byte accesses), fall in 8 distinct bank groups.
constexpr int kSwizzle64RowBytes = 64;
__device__ __forceinline__ uint32_t swizzle_64b_offset(int row, int chunk_idx) {
    return static_cast<uint32_t>(row * kSwizzle64RowBytes + ((chunk_idx ^ ((row >> 1) & 3)) << 4));
}

__device__ __forceinline__ void mbarrier_init(uint64_t* barrier, uint32_t arrival_count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(shared_address(barrier)), "r"(arrival_count)
                 : "memory");
}

// Makes initialised barriers visible to the other threads and to the async proxy (TMA complete_tx).
__device__ __forceinline__ void fence_barrier_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// One arrival, and `num_bytes` more transaction bytes the current phase waits for.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* barrier, uint32_t num_bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(shared_address(barrier)),
                 "r"(num_bytes)
                 : "memory");
}

// One arrival on a barrier of this CTA.
__device__ __forceinline__ void mbarrier_arrive(uint64_t* barrier) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(shared_address(barrier)) : "memory");
}

// One arrival on the barrier at the same shared-memory offset in CTA `cta_rank` of the cluster (this CTA
// included).
__device__ __forceinline__ void mbarrier_arrive_cluster(uint64_t* barrier, uint32_t cta_rank) {
    asm volatile(
        "{\n"
        ".reg .b32 remote;\n"
        "mapa.shared::cluster.u32 remote, %0, %1;\n"
        "mbarrier.arrive.shared::cluster.b64 _, [remote];\n"
        "}\n" ::"r"(shared_address(barrier)),
        "r"(cta_rank)
        : "memory");
}

// One arrival on the barrier at `barrier`'s offset in CTA `cta_rank` of the cluster that also expects `num_bytes`
// more of asynchronous writes (st_async_u32) before its phase completes.
__device__ __forceinline__ void mbarrier_arrive_expect_tx_cluster(uint64_t* barrier, uint32_t cta_rank,
                                                                  uint32_t num_bytes) {
    asm volatile(
        "{\n"
        ".reg .b32 remote;\n"
        "mapa.shared::cluster.u32 remote, %0, %1;\n"
        "mbarrier.arrive.expect_tx.shared::cluster.b64 _, [remote], %2;\n"
        "}\n" ::"r"(shared_address(barrier)),
        "r"(cta_rank), "r"(num_bytes)
        : "memory");
}

// Stores `value` at `shared_ptr`'s offset in (another) CTA `cta_rank` of the cluster as an asynchronous write that
// completes 4 bytes of the transaction count of the barrier at `barrier`'s offset there: the readers wait on that
// barrier as on a TMA load, with no fence on either side.
__device__ __forceinline__ void st_async_u32(const void* shared_ptr, uint32_t cta_rank, uint32_t value,
                                             uint64_t* barrier) {
    asm volatile(
        "{\n"
        ".reg .b32 remote_dst, remote_bar;\n"
        "mapa.shared::cluster.u32 remote_dst, %0, %2;\n"
        "mapa.shared::cluster.u32 remote_bar, %1, %2;\n"
        "st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [remote_dst], %3, [remote_bar];\n"
        "}\n" ::"r"(shared_address(shared_ptr)),
        "r"(shared_address(barrier)), "r"(cta_rank), "r"(value)
        : "memory");
}

// Blocks until the phase of parity `parity` has completed (a fresh barrier counts its phase "1" as done).
__device__ __forceinline__ void mbarrier_wait(uint64_t* barrier, uint32_t parity) {
    const uint32_t address = shared_address(barrier);
    uint32_t done = 0;
    do {
        asm volatile(
            "{\n"
            ".reg .pred ready;\n"
            "mbarrier.try_wait.parity.shared::cta.b64 ready, [%1], %2;\n"
            "selp.u32 %0, 1, 0, ready;\n"
            "}\n"
            : "=r"(done)
            : "r"(address), "r"(parity)
            : "memory");
    } while (done == 0);
}

__device__ __forceinline__ uint32_t cluster_cta_rank() {
    uint32_t rank;
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
    return rank;
}

// Every thread of every CTA of the cluster: arrive, then wait for all (release / acquire).
__device__ __forceinline__ void cluster_sync() {
    asm volatile(
        "barrier.cluster.arrive.release.aligned;\n"
        "barrier.cluster.wait.acquire.aligned;\n" ::
            : "memory");
}

// Makes the barrier count one arrival once every cp.async this thread issued so far has landed (noinc: the
// arrival is one of those the barrier was initialised to expect). The thread does not wait.
__device__ __forceinline__ void cp_async_mbarrier_arrive_noinc(uint64_t* barrier) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(shared_address(barrier)) : "memory");
}

// Orders generic-proxy shared-memory writes this thread has performed or observed (through a barrier) before its
// later async-proxy accesses (wgmma, TMA).
__device__ __forceinline__ void fence_proxy_async_shared() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// One box of a 3-D tensor map into this CTA's shared memory, completing its bytes on `barrier`. Out-of-bounds
// elements of the box are written as zeros (and still counted).
__device__ __forceinline__ void tma_load_3d(void* shared_dst, const CUtensorMap* tensor_map, uint64_t* barrier,
                                            int32_t coord0, int32_t coord1, int32_t coord2) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], "
        "[%2];\n" ::"r"(shared_address(shared_dst)),
        "l"(reinterpret_cast<uint64_t>(tensor_map)), "r"(shared_address(barrier)), "r"(coord0), "r"(coord1), "r"(coord2)
        : "memory");
}

// One box of a 2-D tensor map into this CTA's shared memory, completing its bytes on `barrier` (as tma_load_3d).
__device__ __forceinline__ void tma_load_2d(void* shared_dst, const CUtensorMap* tensor_map, uint64_t* barrier,
                                            int32_t coord0, int32_t coord1) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];\n" ::
            "r"(shared_address(shared_dst)),
        "l"(reinterpret_cast<uint64_t>(tensor_map)), "r"(shared_address(barrier)), "r"(coord0), "r"(coord1)
        : "memory");
}

// As tma_load_3d, the box written to the same offset in every CTA of the cluster whose bit is set in `cta_mask`,
// completing its bytes on the barrier at the same offset in each of them.
__device__ __forceinline__ void tma_load_3d_multicast(void* shared_dst, const CUtensorMap* tensor_map,
                                                      uint64_t* barrier, int32_t coord0, int32_t coord1, int32_t coord2,
                                                      uint16_t cta_mask) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, "
        "{%3, %4, %5}], [%2], %6;\n" ::"r"(shared_address(shared_dst)),
        "l"(reinterpret_cast<uint64_t>(tensor_map)), "r"(shared_address(barrier)), "r"(coord0), "r"(coord1),
        "r"(coord2), "h"(cta_mask)
        : "memory");
}

// As tma_load_2d, the box written to the same offset in every CTA of the cluster whose bit is set in `cta_mask`,
// completing its bytes on the barrier at the same offset in each of them.
__device__ __forceinline__ void tma_load_2d_multicast(void* shared_dst, const CUtensorMap* tensor_map,
                                                      uint64_t* barrier, int32_t coord0, int32_t coord1,
                                                      uint16_t cta_mask) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster [%0], [%1, "
        "{%3, %4}], [%2], %5;\n" ::"r"(shared_address(shared_dst)),
        "l"(reinterpret_cast<uint64_t>(tensor_map)), "r"(shared_address(barrier)), "r"(coord0), "r"(coord1),
        "h"(cta_mask)
        : "memory");
}

// One box of a 2-D tensor map from this CTA's shared memory to global memory (elements out of bounds are not
// written), in this thread's current bulk async-group.
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* tensor_map, uint32_t shared_src, int32_t coord0,
                                             int32_t coord1) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];\n" ::"l"(
                     reinterpret_cast<uint64_t>(tensor_map)),
                 "r"(shared_src), "r"(coord0), "r"(coord1)
                 : "memory");
}

// As tma_store_2d, one box of a 3-D tensor map.
__device__ __forceinline__ void tma_store_3d(const CUtensorMap* tensor_map, uint32_t shared_src, int32_t coord0,
                                             int32_t coord1, int32_t coord2) {
    asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::"l"(
                     reinterpret_cast<uint64_t>(tensor_map)),
                 "r"(shared_src), "r"(coord0), "r"(coord1), "r"(coord2)
                 : "memory");
}

// As tma_store_3d, the box added into global memory element by element (cp.reduce.async.bulk.tensor .add: each
// element one read-add-write at the destination, f32 by round to nearest; elements out of bounds untouched).
__device__ __forceinline__ void tma_reduce_add_3d(const CUtensorMap* tensor_map, uint32_t shared_src, int32_t coord0,
                                                  int32_t coord1, int32_t coord2) {
    asm volatile(
        "cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::"l"(
            reinterpret_cast<uint64_t>(tensor_map)),
        "r"(shared_src), "r"(coord0), "r"(coord1), "r"(coord2)
        : "memory");
}

// `num_bytes` contiguous bytes (a multiple of 16; both addresses 16-byte aligned) from global memory into this CTA's
// shared memory, completing them on `barrier` as a TMA load does.
__device__ __forceinline__ void bulk_load(void* shared_dst, const void* global_src, uint32_t num_bytes,
                                          uint64_t* barrier) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                     shared_address(shared_dst)),
                 "l"(__cvta_generic_to_global(global_src)), "r"(num_bytes), "r"(shared_address(barrier))
                 : "memory");
}

// Closes this thread's current bulk async-group (the TMA stores issued since the previous commit).
__device__ __forceinline__ void bulk_commit_group() {
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}

// Waits until at most kNumPending of this thread's bulk async-groups still read their shared memory (kRead) or are
// still incomplete.
template <int kNumPending, bool kRead>
__device__ __forceinline__ void bulk_wait_group() {
    if constexpr (kRead) {
        asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kNumPending) : "memory");
    } else {
        asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(kNumPending) : "memory");
    }
}

// Two f32 values to a shared-memory address (8-byte aligned), one 8-byte store.
__device__ __forceinline__ void st_shared_v2_f32(uint32_t shared_addr, float first, float second) {
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(shared_addr), "f"(first), "f"(second) : "memory");
}

// Four 8 x 8 b16 matrices from the mma accumulator fragment layout (register i of lane l: row l / 4, columns 2 (l % 4)
// and + 1 of matrix i) to shared memory, lane l giving the address of row l % 8 of matrix l / 8 (16 bytes).
__device__ __forceinline__ void stmatrix_x4(uint32_t shared_addr, const uint32_t (&regs)[4]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(shared_addr), "r"(regs[0]),
                 "r"(regs[1]), "r"(regs[2]), "r"(regs[3])
                 : "memory");
}

// Four 8 x 8 b16 matrices from shared memory into the mma fragment layout (the inverse of stmatrix_x4: register i of
// lane l gets row l / 4, columns 2 (l % 4) and + 1 of matrix i), lane l giving the address of row l % 8 of matrix
// l / 8 (16 bytes).
__device__ __forceinline__ void ldmatrix_x4(uint32_t shared_addr, uint32_t (&regs)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(regs[0]), "=r"(regs[1]), "=r"(regs[2]), "=r"(regs[3])
                 : "r"(shared_addr)
                 : "memory");
}

// 16 bytes from a shared-memory address (16-byte aligned), as one vector load.
__device__ __forceinline__ void ld_shared_v4(uint32_t shared_addr, uint32_t (&words)[4]) {
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(words[0]), "=r"(words[1]), "=r"(words[2]), "=r"(words[3])
                 : "r"(shared_addr)
                 : "memory");
}

__device__ __forceinline__ void prefetch_tensor_map(const CUtensorMap* tensor_map) {
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(tensor_map)) : "memory");
}

// wgmma shared-memory descriptor of a K-major tile with 128-byte swizzle: rows of 128 bytes, 8-row
// atoms 1024 bytes apart (stride byte offset), leading byte offset unused for this mode (1 by convention),
// base offset 0 (tiles are 1024-byte aligned). Adding 2 to the descriptor moves its start 32 bytes,
// i.e. one k16 step of 16-bit elements along K inside the swizzled row.
__device__ __forceinline__ uint64_t make_smem_desc_k_major_sw128(const void* shared_tile) {
    constexpr uint64_t kLeadingByteOffset = 1;
    constexpr uint64_t kStrideByteOffset = kSwizzleAtomBytes >> 4;
    constexpr uint64_t kLayoutSwizzle128B = 1;
    const uint64_t start_address = (shared_address(shared_tile) & 0x3FFFF) >> 4;
    return start_address | (kLeadingByteOffset << 16) | (kStrideByteOffset << 32) | (kLayoutSwizzle128B << 62);
}
constexpr uint64_t kDescK16Step = 32 >> 4;  // descriptor units (16 bytes) per k16 step of 2-byte elements

// wgmma shared-memory descriptor of an MN-major tile with 128-byte swizzle, as TMA writes boxes of 64 MN
// elements (one 128-byte row) x K rows: K rows 128 bytes apart, 8-row atoms 1024 bytes apart (stride byte
// offset), 64-element MN blocks kMnBlockBytes apart (leading byte offset), base offset 0 (1024-byte aligned).
// Adding kDescMnK16Step moves the start 16 K rows (2048 bytes): one k16 step.
template <uint32_t kMnBlockBytes>
__device__ __forceinline__ uint64_t make_smem_desc_mn_major_sw128(const void* shared_tile) {
    static_assert(kMnBlockBytes % kSwizzleAtomBytes == 0 && (kMnBlockBytes >> 4) < (1u << 14),
                  "MN blocks start on a swizzle atom and their offset fits the 14-bit field");
    constexpr uint64_t kLeadingByteOffset = kMnBlockBytes >> 4;
    constexpr uint64_t kStrideByteOffset = kSwizzleAtomBytes >> 4;
    constexpr uint64_t kLayoutSwizzle128B = 1;
    const uint64_t start_address = (shared_address(shared_tile) & 0x3FFFF) >> 4;
    return start_address | (kLeadingByteOffset << 16) | (kStrideByteOffset << 32) | (kLayoutSwizzle128B << 62);
}
constexpr uint64_t kDescMnK16Step = (16 * kSwizzleBytes) >> 4;  // descriptor units per k16 step (16 K rows)

__device__ __forceinline__ void wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}

__device__ __forceinline__ void wgmma_commit_group() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

template <int kNumPending>
__device__ __forceinline__ void wgmma_wait_group() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kNumPending) : "memory");
}

// Keeps the compiler from moving reads or writes of accumulator registers across wgmma boundaries.
template <int kNumRegs>
__device__ __forceinline__ void fence_accumulators(float (&acc)[kNumRegs]) {
#pragma unroll
    for (int reg_idx = 0; reg_idx < kNumRegs; ++reg_idx) asm volatile("" : "+f"(acc[reg_idx])::"memory");
}

template <int kNumRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kNumRegs));
}

template <int kNumRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kNumRegs));
}

}  // namespace megamoe::sm90
